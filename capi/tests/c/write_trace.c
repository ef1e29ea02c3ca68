/* A port's trace writer in C, as include/tracegate.h documents it: argv[1] the trace to write,
 * argv[2] a model directory. Prints the weights digest and the trace digest, one per line, then
 * "refused CODE: MESSAGE" for each misuse it tries. Exits non-zero where a call does other than
 * the header says. */
#include <stdio.h>
#include <string.h>

#include "tracegate.h"

static int failed = 0;

#define EXPECT(cond)                                                              \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "line %d: %s (last error: %s)\n", __LINE__, #cond,    \
                    tg_last_error());                                             \
            failed = 1;                                                           \
        }                                                                         \
    } while (0)

/* Prints what a refused call said; its code must be `want` and its message non-empty. */
static void refused(int got, int want) {
    printf("refused %d: %s\n", got, tg_last_error());
    EXPECT(got == want);
    EXPECT(strlen(tg_last_error()) > 0);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: write_trace OUT.trace MODEL_DIR\n");
        return 2;
    }
    char weights[33];
    EXPECT(tg_weights_digest(argv[2], weights, sizeof weights) == TG_OK);
    printf("%s\n", weights);

    char provenance[512];
    snprintf(provenance, sizeof provenance,
             "{\"producer\": \"c-port\", \"weights_digest\": \"%s\", \"prompt_tokens\": [3, 17, 5]}",
             weights);
    tg_writer *w = tg_open(argv[1], provenance);
    EXPECT(w != NULL);

    /* layer.00.hidden_out: 3 tokens x 4, f32, with every attribute. */
    float hidden[12];
    for (int i = 0; i < 12; i++) hidden[i] = 0.25f * (float)i - 1.0f;
    uint64_t shape[2] = {3, 4};
    int64_t positions[3] = {0, 1, 2};
    const char *keys[1] = {"note"};
    const char *values[1] = {"from C"};
    tg_attrs attrs = {"prefill", "causal", positions, 3, NULL, keys, values, 1};
    EXPECT(tg_tensor(w, "layer.00.hidden_out", TG_F32, shape, 2, hidden, sizeof hidden, &attrs) == TG_OK);

    /* logits: one row of 5 as bf16 bits, at decode step 2. */
    uint16_t logits[5] = {0x3f80, 0xbf80, 0x4000, 0x0000, 0x7f80};
    uint64_t lshape[2] = {1, 5};
    int64_t step = 2, pos = 3;
    tg_attrs lattrs = {"decode", "causal", &pos, 1, &step, NULL, NULL, 0};
    EXPECT(tg_tensor(w, "decode.0002.logits", TG_BF16, lshape, 2, logits, sizeof logits, &lattrs) == TG_OK);

    /* A sharded run's rank 1 of 2: its partial sum of layer.00.attn_out, before the all-reduce
     * (docs/trace-format.md, "Sharded traces"): the extra attribute `shard`. */
    const char *skeys[1] = {"shard"};
    const char *svalues[1] = {"rank=1/2;partial"};
    tg_attrs sattrs = {"prefill", "causal", positions, 3, NULL, skeys, svalues, 1};
    EXPECT(tg_tensor(w, "layer.00.attn_out", TG_F32, shape, 2, hidden, sizeof hidden, &sattrs) == TG_OK);

    /* The greedy token with its margin, and a router's top-2 without margins. */
    int64_t argmax[1] = {2};
    float margin[1] = {1.0f};
    uint64_t dshape[1] = {1};
    EXPECT(tg_decision(w, "decode.0002.argmax", dshape, 1, argmax, 1, margin, 1) == TG_OK);
    int64_t topk[4] = {1, 6, 0, 3};
    uint64_t kshape[2] = {2, 2};
    EXPECT(tg_decision(w, "layer.00.router.topk", kshape, 2, topk, 4, NULL, 0) == TG_OK);

    /* Misuse: each is refused with a code and a line, and the writer goes on. */
    int64_t two[2] = {0, 1};
    tg_attrs short_positions = {"prefill", "causal", two, 2, NULL, NULL, NULL, 0};
    refused(tg_tensor(w, "layer.00.attn_out", TG_F32, shape, 2, hidden, sizeof hidden, &short_positions),
            TG_ERR_INVALID);
    refused(tg_tensor(w, "layer.00.mlp_out", TG_F32, shape, 2, hidden, sizeof hidden - 4, NULL),
            TG_ERR_INVALID);
    refused(tg_tensor(w, "layer.00.hidden_out", TG_F32, shape, 2, hidden, sizeof hidden, NULL),
            TG_ERR_INVALID); /* a duplicate name */
    refused(tg_tensor(w, "layer.00.q", (tg_dtype)0, shape, 2, hidden, sizeof hidden, NULL),
            TG_ERR_ARGUMENT);
    refused(tg_tensor(w, NULL, TG_F32, shape, 2, hidden, sizeof hidden, NULL), TG_ERR_ARGUMENT);
    refused(tg_tensor(w, "layer.00.k", TG_F32, NULL, 2, hidden, sizeof hidden, NULL), TG_ERR_ARGUMENT);
    /* Shards refused: malformed (a leading zero), and one the registry does not allow
     * (hidden_in is replicated on every rank, never a partial sum). */
    const char *malformed[1] = {"rank=01/2;partial"};
    tg_attrs bad_shard = {"prefill", "causal", positions, 3, NULL, skeys, malformed, 1};
    refused(tg_tensor(w, "layer.00.v", TG_F32, shape, 2, hidden, sizeof hidden, &bad_shard), TG_ERR_INVALID);
    tg_attrs not_allowed = {"prefill", "causal", positions, 3, NULL, skeys, svalues, 1};
    refused(tg_tensor(w, "layer.00.hidden_in", TG_F32, shape, 2, hidden, sizeof hidden, &not_allowed),
            TG_ERR_INVALID);
    refused(tg_decision(w, "decode.0003.argmax", dshape, 1, argmax, 1, margin, 2), TG_ERR_INVALID);
    refused(tg_tensor(NULL, "layer.00.v", TG_F32, shape, 2, hidden, sizeof hidden, NULL), TG_ERR_ARGUMENT);
    refused(tg_weights_digest("/nonexistent/model", weights, sizeof weights), TG_ERR_IO);
    refused(tg_weights_digest(argv[2], weights, 8), TG_ERR_ARGUMENT);
    EXPECT(tg_open("/nonexistent/dir/x.trace", "{}") == NULL);
    printf("refused open: %s\n", tg_last_error());
    EXPECT(tg_open(argv[1], "[1, 2]") == NULL);
    printf("refused open: %s\n", tg_last_error());

    /* A writer abandoned halfway leaves nothing behind. */
    char abandoned[4096];
    snprintf(abandoned, sizeof abandoned, "%s.abandoned", argv[1]);
    tg_writer *a = tg_open(abandoned, "{}");
    EXPECT(a != NULL);
    EXPECT(tg_tensor(a, "logits", TG_BF16, lshape, 2, logits, sizeof logits, NULL) == TG_OK);
    tg_abort(a);
    tg_abort(NULL);

    char digest[65];
    EXPECT(tg_close(w, digest, sizeof digest) == TG_OK);
    EXPECT(strlen(tg_last_error()) == 0);
    printf("%s\n", digest);
    return failed;
}
