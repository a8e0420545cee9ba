/* nd_internal.h — helpers shared by the needle core's sources (not part of its API). */
#ifndef KVT_TOOLS_NEEDLE_INTERNAL_H
#define KVT_TOOLS_NEEDLE_INTERNAL_H

#include "needle.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>

#if defined(__GNUC__)
#define ND_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define ND_PRINTF(a, b)
#endif

/* Write a message into err (may be NULL) and return code. */
int nd_fail(char *err, size_t len, int code, const char *fmt, ...) ND_PRINTF(4, 5);

/* ------------------------------------------------------------------------------------------- */
/* Seeded randomness: splitmix64 (Vigna). Every stream is keyed by (seed, stream, index), so any   */
/* row, needle or query can be generated on its own, in any order, with the same bits.          */
/* ------------------------------------------------------------------------------------------- */
static inline uint64_t nd_mix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct nd_rng {
    uint64_t s;
    double spare;  /* second Box-Muller normal */
    int has_spare;
} nd_rng;

/* Streams of the generator (documented in docs/needle.md). */
enum {
    ND_STREAM_TOPIC = 1,  /* topic vectors and drift parameters */
    ND_STREAM_ROW = 2,    /* one per row: latent and branch noise */
    ND_STREAM_PAIR = 3,   /* key-value haystack membership */
    ND_STREAM_NEEDLE = 4, /* one per needle: direction, rows, band target */
    ND_STREAM_QUERY = 5,  /* one per target: heads, noise, mass target */
    ND_STREAM_WALK = 6,   /* --branch drift: the AR(1) walk of the branch, drawn row by row */
};

static inline nd_rng nd_rng_for(uint64_t seed, uint64_t stream, uint64_t index) {
    nd_rng r;
    r.s = nd_mix64(seed ^ nd_mix64((stream << 48) ^ nd_mix64(index)));
    r.spare = 0.0;
    r.has_spare = 0;
    return r;
}

static inline uint64_t nd_next(nd_rng *r) {
    r->s += 0x9E3779B97F4A7C15ull;
    uint64_t z = r->s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1): 53 random bits, never 0. */
static inline double nd_uniform(nd_rng *r) {
    return ((double)(nd_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* Standard normal (Box-Muller, both outputs used). */
static inline double nd_normal(nd_rng *r) {
    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    double u1 = nd_uniform(r), u2 = nd_uniform(r);
    double rad = sqrt(-2.0 * log(u1));
    double a = 6.283185307179586 * u2;
    r->spare = rad * sin(a);
    r->has_spare = 1;
    return rad * cos(a);
}

/* Uniform integer in [0, n). */
static inline uint64_t nd_below(nd_rng *r, uint64_t n) {
    return n ? (uint64_t)(nd_uniform(r) * (double)n) % n : 0;
}

/* 0 when rows of sp are laid out as the reference attention (kernels/attn.h) reads them: key =
 * the row's first head_dim values of dtype (bf16/fp16/fp32), i.e. head_dim == value_dim +
 * branch_dim, branch_dtype == dtype, branch_offset == value_dim x sizeof(dtype), head_dim values
 * within row_bytes. Else -1 with a message naming the field in msg. */
int nd_spec_layout_check(const kvt_layer_spec *sp, char *msg, size_t len);

/* Values of a row widened to float (dtype bf16 / fp16 / fp32). */
void nd_widen(const uint8_t *row, kvt_dtype dt, uint32_t n, float *out);
/* Store float values into a row of dtype dt (round to nearest even). */
void nd_narrow(uint8_t *row, kvt_dtype dt, uint32_t n, const float *in);

/* ------------------------------------------------------------------------------------------- */
/* GQA layers (gqa.c)                                                                           */
/* ------------------------------------------------------------------------------------------- */
/* Bytes of one token's rows in one plane: n_kv_heads x row_bytes (an MLA layer: one row). */
static inline size_t nd_token_bytes(const kvt_layer_spec *sp) {
    return (size_t)sp->n_kv_heads * sp->row_bytes;
}
/* Whether a case is a GQA layer (K in rows, V in vrows) rather than MLA. */
static inline bool nd_case_gqa(const nd_case *c) {
    return c->spec.n_planes == 2;
}
/* 0 when a GQA layer can be replayed: kind gqa-rope, 2 planes, a float dtype, row_bytes =
 * head_dim values, n_q_heads a multiple of n_kv_heads, q_dim = head_dim. Else -1 with a
 * message. */
int nd_gqa_layout_check(const kvt_layer_spec *sp, uint32_t n_q_heads, uint32_t q_dim, char *msg,
                        size_t len);

/* Reference attention of some query heads over GQA rows: row j of KV head g at
 * k / v + slot_j x nd_token_bytes + g x row_bytes (slot_j = slots[j], or j when slots is NULL).
 * Query head h (q + h x head_dim) reads KV head h / (n_q_heads / n_kv_heads). Per listed head
 * i: out[i][head_dim] and mass[i], the softmax mass on rows j with mark[g x mark_stride + j]
 * nonzero (mark may be NULL: mass 0). Double-precision softmax. ND_OK or ND_ENOMEM. */
typedef struct nd_gqa_attn_args {
    const kvt_layer_spec *spec;
    const uint8_t *k, *v;
    const int32_t *slots;
    uint32_t n_rows;
    const float *q;
    uint32_t n_q_heads;
    const uint32_t *heads;
    uint32_t n_heads;
    double scale;
    const uint8_t *mark;
    size_t mark_stride;
    float *out;
    double *mass;
} nd_gqa_attn_args;
int nd_gqa_attn(const nd_gqa_attn_args *a);

/* Dot product of n floats, 8 accumulators, in double (fast enough, order fixed). */
static inline double nd_dot(const float *a, const float *b, uint32_t n) {
    double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (uint32_t l = 0; l < 8; l++)
            p[l] += (double)a[i + l] * (double)b[i + l];
    for (; i < n; i++)
        p[0] += (double)a[i] * (double)b[i];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

#endif
