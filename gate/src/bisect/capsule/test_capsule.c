/* A tracegate repro capsule as a C test of your port's own suite (docs/bisect.md, "Capsules").
 *
 * `gate bisect --capsule DIR` writes this file beside the capsule's manifest.json. It checks a
 * trace your port's `layer` verb wrote for layer @LAYER@ (run on the capsule's reference.trace,
 * input layer.@LL@.hidden_in, with the replay model `gate capsule run DIR --work W` builds; its
 * candidate trace is W/capsule.candidate.trace) against the capsule's reference.trace, under the
 * rule the bisection judged with: each capture point's bounds, taken from policy.json when the
 * capsule was written (CHECKS below), or bit for bit.
 *
 *   cc -std=c99 -o test_capsule test_capsule.c -I <tracegate>/capi/include \
 *      -L <tracegate>/target/release -ltracegate_capi -lm
 *   ./test_capsule DIR CANDIDATE_TRACE
 *
 * Exit 0: every capture point the candidate recorded is within its rule; 1: one is not (each
 * named, with the bound, its limit and the value); 2: nothing could be checked, or a trace could
 * not be read. The measures are docs/diff.md's ("Measures"), summed in double in index order
 * over the pairs where both values are finite; ULPs are counted when both sides have one dtype.
 * Not checked here (gate capsule run checks them): the router's decisions, a noise-relative bound
 * (noise.trace), the tensors' attributes (positions, path).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tracegate.h"

/* A bound not set is NAN; `bits`: the capsule was judged bit for bit. */
typedef struct check {
    const char *name;
    int bits;
    double max_ulp, max_abs, max_rel, max_rel_l2, min_cosine, max_scale_error;
    int noise_ratio; /* the rule also bounds the noise ratio: not checked here */
} check;

/* The content digest of the capsule's reference.trace: another trace there is refused. */
static const char *REFERENCE_DIGEST = "@DIGEST@";

/* A capsule that keeps some heads only (manifest units.heads.judged.slices): its reference
 * holds those heads' slices of each per-head point, along the point's head axis; the candidate's
 * tensor is cut to the same heads before it is judged. Empty for a capsule of whole heads. */
typedef struct slice {
    const char *name;
    int axis, n;
    int heads[256];
} slice;

static const slice SLICES[] = {
@SLICES@
    {NULL, 0, 0, {0}},
};

static const check CHECKS[] = {
@CHECKS@
    {NULL, 0, NAN, NAN, NAN, NAN, NAN, NAN, 0},
};

/* One tensor, widened to double, and its raw bits for ULPs. */
typedef struct tensor {
    int dtype;
    uint64_t n;
    uint64_t shape[8];
    size_t rank;
    double *v;
    uint64_t *bits;
} tensor;

static double half_to_double(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0) return s * ldexp(m, -24);
    if (e == 31) return m ? NAN : s * INFINITY;
    return s * ldexp(m + 1024, e - 25);
}

/* 0 read, 1 absent, 2 an error (said). */
static int load(tg_trace *t, const char *name, tensor *out) {
    int rc = tg_trace_info(t, name, &out->dtype, out->shape, 8, &out->rank);
    if (rc != TG_OK) {
        if (rc == TG_ERR_NOT_FOUND) return 1;
        printf("%s: %s\n", name, tg_last_error());
        return 2;
    }
    out->n = 1;
    for (size_t i = 0; i < out->rank; i++) out->n *= out->shape[i];
    size_t width = out->dtype == TG_F64 ? 8 : out->dtype == TG_F32 ? 4 : 2;
    if (out->dtype != TG_F64 && out->dtype != TG_F32 && out->dtype != TG_F16 &&
        out->dtype != TG_BF16) {
        printf("%s: dtype %d is not a float: NOT CHECKED here\n", name, out->dtype);
        return 2;
    }
    unsigned char *raw = malloc(out->n * width + 1);
    out->v = malloc(out->n * sizeof(double) + 1);
    out->bits = malloc(out->n * sizeof(uint64_t) + 1);
    if (!raw || !out->v || !out->bits) return 2;
    if (tg_trace_bytes(t, name, raw, out->n * width) != TG_OK) {
        printf("%s: %s\n", name, tg_last_error());
        return 2;
    }
    for (uint64_t i = 0; i < out->n; i++) {
        uint64_t b = 0;
        memcpy(&b, raw + i * width, width); /* little-endian hosts, as the traces */
        out->bits[i] = b;
        if (out->dtype == TG_F64) {
            memcpy(&out->v[i], &b, 8);
        } else if (out->dtype == TG_F32) {
            uint32_t u = (uint32_t)b;
            float f;
            memcpy(&f, &u, 4);
            out->v[i] = f;
        } else if (out->dtype == TG_BF16) {
            uint32_t u = (uint32_t)b << 16;
            float f;
            memcpy(&f, &u, 4);
            out->v[i] = f;
        } else {
            out->v[i] = half_to_double((uint16_t)b);
        }
    }
    free(raw);
    return 0;
}

/* `k` cut to the heads `s` keeps along its axis (what the capsule's reference holds). 0 done, 2
 * the candidate has no such axis or head (said). */
static int cut(const slice *s, tensor *k) {
    if ((size_t)s->axis >= k->rank) {
        printf("%s: the candidate's tensor has no axis %d\n", s->name, s->axis);
        return 2;
    }
    uint64_t outer = 1, inner = 1, h = k->shape[s->axis];
    for (int i = 0; i < s->axis; i++) outer *= k->shape[i];
    for (size_t i = (size_t)s->axis + 1; i < k->rank; i++) inner *= k->shape[i];
    for (int j = 0; j < s->n; j++) {
        if ((uint64_t)s->heads[j] >= h) {
            printf("%s: the candidate's tensor has %llu heads, the capsule keeps head %d\n",
                   s->name, (unsigned long long)h, s->heads[j]);
            return 2;
        }
    }
    uint64_t n = outer * (uint64_t)s->n * inner;
    double *v = malloc(n * sizeof(double) + 1);
    uint64_t *bits = malloc(n * sizeof(uint64_t) + 1);
    if (!v || !bits) return 2;
    for (uint64_t o = 0; o < outer; o++)
        for (int j = 0; j < s->n; j++)
            for (uint64_t i = 0; i < inner; i++) {
                uint64_t from = (o * h + (uint64_t)s->heads[j]) * inner + i;
                uint64_t to = (o * (uint64_t)s->n + (uint64_t)j) * inner + i;
                v[to] = k->v[from];
                bits[to] = k->bits[from];
            }
    free(k->v), free(k->bits);
    k->v = v, k->bits = bits, k->n = n;
    k->shape[s->axis] = (uint64_t)s->n;
    return 0;
}

/* The slice of point `name`, if the capsule keeps some heads of it. */
static const slice *slice_of(const char *name) {
    for (size_t i = 0; SLICES[i].name != NULL; i++)
        if (strcmp(SLICES[i].name, name) == 0) return &SLICES[i];
    return NULL;
}

/* The ordered integer of float bits (sign-magnitude to a line): its steps are ULPs. */
static int64_t ordered(int dtype, uint64_t b) {
    int top = dtype == TG_F64 ? 63 : dtype == TG_F32 ? 31 : 15;
    uint64_t sign = (uint64_t)1 << top;
    int64_t mag = (int64_t)(b & (sign - 1));
    return (b & sign) ? -mag : mag;
}

static int broke(const char *name, const char *bound, double limit, double value, int below) {
    printf("FAIL %s: broke %s: %.9g %s %.9g\n", name, bound, value, below ? "<" : ">", limit);
    return 1;
}

/* 0 within the rule, 1 not. */
static int judge(const check *c, const tensor *r, const tensor *k) {
    uint64_t differing = 0, nonfinite = 0, max_ulp = 0;
    double max_abs = 0, max_rel = 0, rr = 0, cc = 0, rc = 0, dd = 0;
    int same = r->dtype == k->dtype;
    for (uint64_t i = 0; i < r->n; i++) {
        double x = r->v[i], y = k->v[i];
        int finite = isfinite(x) && isfinite(y);
        if (finite) {
            rr += x * x;
            cc += y * y;
            rc += x * y;
        }
        int differs = same ? r->bits[i] != k->bits[i]
                           : !(x == y && signbit(x) == signbit(y)) && !(isnan(x) && isnan(y));
        if (!differs) continue;
        differing++;
        if (!finite) {
            nonfinite++;
            continue;
        }
        if (same) {
            int64_t d = ordered(r->dtype, r->bits[i]) - ordered(k->dtype, k->bits[i]);
            uint64_t u = d < 0 ? (uint64_t)-d : (uint64_t)d;
            if (u > max_ulp) max_ulp = u;
        }
        double d = fabs(x - y);
        dd += d * d;
        if (d > max_abs) max_abs = d;
        double rel = x == 0 ? INFINITY : d / fabs(x);
        if (d > 0 && rel > max_rel) max_rel = rel;
    }
    int bad = 0;
    if (c->bits) {
        if (differing > 0) {
            printf("FAIL %s: %llu of %llu elements differ in bits (judged by bits)\n", c->name,
                   (unsigned long long)differing, (unsigned long long)r->n);
            return 1;
        }
        return 0;
    }
    if (nonfinite > 0) bad |= broke(c->name, "nonfinite_differences", 0, (double)nonfinite, 0);
    if (!isnan(c->max_ulp)) {
        if (!same)
            printf("NOT CHECKED %s: max_ulp across dtypes %d and %d\n", c->name, r->dtype,
                   k->dtype);
        else if ((double)max_ulp > c->max_ulp)
            bad |= broke(c->name, "max_ulp", c->max_ulp, (double)max_ulp, 0);
    }
    if (!isnan(c->max_abs) && max_abs > c->max_abs)
        bad |= broke(c->name, "max_abs", c->max_abs, max_abs, 0);
    if (!isnan(c->max_rel) && max_rel > c->max_rel)
        bad |= broke(c->name, "max_rel", c->max_rel, max_rel, 0);
    /* Undefined (a zero reference or side) breaks a bound, as in the policy. */
    double rel_l2 = differing == 0 ? 0 : rr > 0 ? sqrt(dd / rr) : NAN;
    double den = sqrt(rr * cc);
    double cosine = differing == 0 ? 1 : (den > 0 && isfinite(den)) ? rc / den : NAN;
    double scale = differing == 0 ? 0 : rr > 0 ? rc / rr - 1 : NAN;
    if (!isnan(c->max_rel_l2) && !(rel_l2 <= c->max_rel_l2))
        bad |= broke(c->name, "max_rel_l2", c->max_rel_l2, rel_l2, 0);
    if (!isnan(c->min_cosine) && !(cosine >= c->min_cosine))
        bad |= broke(c->name, "min_cosine", c->min_cosine, cosine, 1);
    if (!isnan(c->max_scale_error) && !(fabs(scale) <= c->max_scale_error))
        bad |= broke(c->name, "max_scale_error", c->max_scale_error, fabs(scale), 0);
    if (c->noise_ratio)
        printf("NOT CHECKED %s: max_noise_ratio (needs noise.trace: gate capsule run)\n", c->name);
    return bad;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CAPSULE_DIR CANDIDATE_TRACE\n", argv[0]);
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/reference.trace", argv[1]);
    tg_trace *ref = tg_trace_open(path);
    if (!ref) {
        printf("reference %s: %s\n", path, tg_last_error());
        return 2;
    }
    char digest[65];
    if (tg_trace_digest(ref, digest, sizeof digest) != TG_OK ||
        strcmp(digest, REFERENCE_DIGEST) != 0) {
        printf("reference %s: its digest is %s, the capsule's is %s: not the capsule's\n", path,
               digest, REFERENCE_DIGEST);
        return 2;
    }
    tg_trace *cand = tg_trace_open(argv[2]);
    if (!cand) {
        printf("candidate %s: %s\n", argv[2], tg_last_error());
        return 2;
    }
    int failed = 0, checked = 0, errors = 0;
    for (size_t i = 0; CHECKS[i].name != NULL; i++) {
        const check *c = &CHECKS[i];
        tensor r = {0}, k = {0};
        int got = load(ref, c->name, &r);
        int have = got == 0 ? load(cand, c->name, &k) : 2;
        const slice *s = slice_of(c->name);
        if (have == 0 && s) have = cut(s, &k);
        if (got == 0 && have == 1) {
            printf("NOT CHECKED %s: absent from the candidate's trace\n", c->name);
        } else if (got != 0 || have != 0) {
            errors++;
        } else if (r.rank != k.rank || r.n != k.n ||
                   memcmp(r.shape, k.shape, r.rank * sizeof(uint64_t)) != 0) {
            printf("FAIL %s: the candidate's shape differs from the reference's\n", c->name);
            failed++;
            checked++;
        } else {
            int bad = judge(c, &r, &k);
            if (!bad) printf("ok %s\n", c->name);
            failed += bad;
            checked++;
        }
        free(r.v), free(r.bits), free(k.v), free(k.bits);
    }
    tg_trace_close(ref);
    tg_trace_close(cand);
    printf("layer @LL@: %d capture points checked, %d failed\n", checked, failed);
    if (failed) return 1;
    if (errors || checked == 0) return 2;
    return 0;
}
