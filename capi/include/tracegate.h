/* tracegate.h: write tracegate traces from C, C++, CUDA, Swift or Metal code.
 *
 * Link with libtracegate_capi (built by `cargo build --release -p tracegate-capi` into
 * target/release/). The traces are byte for byte what the Rust and Python writers produce for
 * the same calls (docs/trace-format.md); what to record is in docs/producers.md and
 * docs/capture-points.md.
 *
 * Errors: every call returns TG_OK (0) or an error code, and tg_last_error() then holds one line
 * naming the tensor, the path and the numbers. No call aborts the process; a handle is used by
 * one thread at a time.
 *
 * Handles: a tg_writer * is an opaque number the library issues once, never a pointer it follows.
 * Passing one that is not live (closed, aborted, never returned by tg_open, NULL) is refused with
 * TG_ERR_ARGUMENT and a line naming it ("... is not a live handle"): a second tg_close, a
 * tg_tensor after tg_close, a tg_close after tg_abort free nothing twice and read nothing freed.
 */
#ifndef TRACEGATE_H
#define TRACEGATE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tg_status {
    TG_OK = 0,
    TG_ERR_INVALID = 1,   /* content the format cannot hold: shape, payload size, positions, name */
    TG_ERR_IO = 2,        /* the file system refused: the message names the path */
    TG_ERR_NOT_FOUND = 3, /* e.g. a model directory without *.safetensors */
    TG_ERR_ARGUMENT = 4,  /* a NULL pointer, a string that is not UTF-8, an unknown dtype, a small buffer,
                           a writer handle that is not live */
    TG_ERR_INTERNAL = 5   /* a defect of the library itself; the message says where */
} tg_status;

/* Element types; every payload is little-endian, row-major. */
typedef enum tg_dtype {
    TG_F64 = 1,
    TG_F32 = 2,
    TG_F16 = 3,
    TG_BF16 = 4,
    TG_I64 = 5,
    TG_I32 = 6,
    TG_I16 = 7,
    TG_I8 = 8,
    TG_U8 = 9,
    TG_BOOL = 10
} tg_dtype;

/* A tensor's attributes (docs/capture-points.md). NULL (and 0) leaves one unrecorded. */
typedef struct tg_attrs {
    const char *path;        /* the code path that computed it, e.g. "prefill" */
    const char *mask;        /* e.g. "causal" */
    const int64_t *positions; /* one absolute token position per row of the token axis */
    size_t n_positions;
    const int64_t *step;     /* the decode step */
    const char *const *extra_keys; /* other string attributes, n_extra of each; the key "shard"
                                      says what a rank of a sharded run holds, e.g.
                                      "rank=1/2;partial" (docs/trace-format.md, "Sharded traces":
                                      a value outside its grammar, or a way the point may not be
                                      sharded, is TG_ERR_INVALID) */
    const char *const *extra_values;
    size_t n_extra;
} tg_attrs;

typedef struct tg_writer tg_writer;

/* Starts a trace that appears at `path` only when tg_close succeeds. `provenance_json` is a JSON
 * object (docs/producers.md, "Provenance a producer must record"). NULL on error. */
tg_writer *tg_open(const char *path, const char *provenance_json);

/* Records a tensor of `rank` dimensions `shape` (NULL when rank is 0); `nbytes` must be the
 * elements times the dtype's size. `attrs` may be NULL. */
int tg_tensor(tg_writer *w, const char *name, tg_dtype dtype, const uint64_t *shape, size_t rank,
              const void *data, size_t nbytes, const tg_attrs *attrs);

/* Records a discrete decision (argmax, router top-k): `n_values` values over `shape`, and
 * `margins` (NULL for none) with one margin per row (docs/trace-format.md). */
int tg_decision(tg_writer *w, const char *name, const uint64_t *shape, size_t rank,
                const int64_t *values, size_t n_values, const float *margins, size_t n_margins);

/* Finishes the trace: index, fsync, rename into place. Writes the whole-trace digest (64 hex
 * digits and a NUL) into `digest_hex` when it is not NULL and `cap` >= 65. Frees `w` whether it
 * succeeds or not; after an error nothing is left at `path`. */
int tg_close(tg_writer *w, char *digest_hex, size_t cap);

/* Frees `w` without writing the trace (its temporary file is removed). NULL is ignored; a handle
 * that is not live (already closed or aborted) frees nothing and leaves its refusal in
 * tg_last_error(), which is "" after a successful abort. */
void tg_abort(tg_writer *w);

/* The weights digest of a model directory, as provenance `weights_digest` must record it (32 hex
 * digits and a NUL into `out`, `cap` >= 33). A weights file that is not a regular file once
 * symlinks are followed (a FIFO, a device such as /dev/zero) is refused before it is opened. */
int tg_weights_digest(const char *model_dir, char *out, size_t cap);

/* Reading a trace (a port's own tests: its output against a reference trace). A tg_trace * is a
 * handle number like a writer's; one not live is refused with TG_ERR_ARGUMENT. */
typedef struct tg_trace tg_trace;

/* Opens the trace at `path` and verifies every payload against its digest: an edited or truncated
 * file is refused. NULL on error. */
tg_trace *tg_trace_open(const char *path);

/* The tensor `name`: its dtype (a tg_dtype), rank and shape (`cap` >= its rank). TG_ERR_NOT_FOUND
 * when the trace has no tensor of that name. */
int tg_trace_info(tg_trace *t, const char *name, int *dtype, uint64_t *shape, size_t cap,
                  size_t *rank);

/* The tensor's payload as stored (little-endian, row-major); `nbytes` must be its size. */
int tg_trace_bytes(tg_trace *t, const char *name, void *out, size_t nbytes);

/* The trace's content digest (64 hex digits and a NUL into `out`, `cap` >= 65), as tg_close
 * returned it when it was written. */
int tg_trace_digest(tg_trace *t, char *out, size_t cap);

/* Frees `t`. NULL is ignored; a handle that is not live is refused in tg_last_error(). */
void tg_trace_close(tg_trace *t);

/* The last error of this thread, one line; "" when the last call succeeded. Valid until this
 * thread's next tg_ call. */
const char *tg_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* TRACEGATE_H */
