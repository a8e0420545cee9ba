/*
 * attn.h — reference MLA decode attention (DESIGN §5): the ruler the needle suite measures kvtier
 * with. One decode step of one MLA layer for a set of query heads over a gathered set of rows.
 * Pure math: no policy, no state. The per-element pieces are KVT_HD inline functions so a CUDA
 * kernel can reuse them; this header is read by gcc and nvcc (no restrict, _Generic or compound
 * literals).
 *
 * MLA with absorbed queries (DeepSeek-V2 §2.1.2, Kimi Linear's MLA layers): each token stores one
 * latent row of key_dim = kv_lora_rank + rope_dim = 512 + 64 = 576 values. The key of row j is the
 * whole row k_j (576 values), its value the first value_dim = 512 values v_j. A query head h
 * brings an absorbed query q_h of 576 values (512 latent | 64 branch) and
 *
 *     score_hj = s · (q_h · k_j)                 s = 192^-1/2 by default (qk_nope 128 + rope 64)
 *     p_hj     = exp(score_hj − M_h) / Z_h       M_h = max_j score_hj, Z_h = Σ_j exp(score_hj − M_h)
 *     out_h    = Σ_j p_hj · v_j                  (value_dim values)
 *     mass_h   = Σ_{j marked} p_hj               (e.g. the rows of a needle)
 *     lse_h    = M_h + log Z_h
 *
 * Precision (why double): scores, the softmax and the output are accumulated in double. The
 * suite compares attention over a subset of rows with attention over all of them (up to 2^17+
 * rows); with fp32 accumulation the output's rounding error grows with the row count and would
 * blur the very differences being measured (a mass ratio of 0.9, a cosine of 0.95 are far above
 * it, but a reference should not be the noisiest part of a measurement). Row values are read in
 * their storage dtype (bf16, fp16, fp32, or fp8 ds_mla rows: kvt__attn_val) and widened exactly;
 * queries are fp32.
 *
 * Summation order (fixed, so results are reproducible across runs and row orders are the only
 * input that matters):
 *   1. dot product: KVT__ATTN_LANES = 8 lanes, lane l sums q[d]·k[d] for d = l, l+8, .. < key_dim
 *      in ascending d (kvt__attn_dot_lane), from +0.0; the 8 partials are summed by a
 *      stride-halving tree (s = 4, 2, 1: p[i] = p[i] + p[i+s]); score = scale · result.
 *   2. M_h = max over rows in gather order; weights w = exp(score − M_h);
 *   3. Z_h, mass_h and out_h accumulate w (and w · v_j) over rows in gather order; out_h and mass_h
 *      are divided by Z_h at the end.
 * A CUDA twin would split rows over blocks and merge partial (M, Z, out) triples (split-K online
 * softmax); its results agree with this twin to a relative ~1e-12, not bit for bit.
 *
 * Non-finite values propagate: a NaN in any row or query makes that head's outputs NaN.
 * An empty row set gives out = 0, mass = 0, lse = −Inf.
 */
#ifndef KVT_KERNELS_ATTN_H
#define KVT_KERNELS_ATTN_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kvt_hd.h"

/* Lanes of the dot-product reduction (step 1). */
#define KVT__ATTN_LANES 8u
/* Largest key_dim the CPU twin accepts (row buffer on the stack). */
#define KVT__ATTN_MAX_DIM 4096u
/* DeepSeek-V2/V3 and Kimi Linear: softmax scale 1/sqrt(qk_nope_head_dim + qk_rope_head_dim). */
#define KVT__ATTN_DEFAULT_SCALE 0.07216878364870322 /* 192^-1/2 */

/* fp8 rows (FlashMLA's 656-B ds_mla layout, kernels/kvt_hd.h): the key is the 512 scaled E4M3
 * latent values, then the 64 bf16 branch values at byte 528; the value the latent. */
#define KVT__FP8_BRANCH_AT 528u
#define KVT__FP8_KEY_DIM 576u

/* Value i of a row of dtype dt, widened to double exactly (fp8: latent i < 512, one fp32 rounding
 * of e4m3 · scale as everywhere else; branch i - 512 from the bf16 part). */
KVT_HD double kvt__attn_val(const uint8_t *row, int dt, uint32_t i) {
    if (dt == KVT__DT_FP8 && i >= KVT__FP8_VALUES)
        return (double)kvt__load_elem(row + KVT__FP8_BRANCH_AT, KVT__DT_BF16, i - KVT__FP8_VALUES);
    return (double)kvt__load_elem(row, dt, i);
}

/* A row dtype and shape the reference reads: bf16, fp16, fp32 of any key_dim, or fp8 ds_mla
 * rows of key_dim <= 576 (and so value_dim <= 512 of latent, or more reaching into the branch
 * only if the caller asks: value_dim <= key_dim). */
KVT_HD int kvt__attn_dtype_ok(int dt, uint32_t key_dim) {
    return dt == KVT__DT_BF16 || dt == KVT__DT_FP16 || dt == KVT__DT_FP32 ||
           (dt == KVT__DT_FP8 && key_dim <= KVT__FP8_KEY_DIM);
}

/* Lane l's partial of q · k over d = l, l+8, .. < n: k as doubles (already widened), q fp32. */
KVT_HD double kvt__attn_dot_lane(const double *k, const float *q, uint32_t n, uint32_t lane) {
    double acc = 0.0;
    for (uint32_t d = lane; d < n; d += KVT__ATTN_LANES)
        acc += (double)q[d] * k[d];
    return acc;
}

/* Stride-halving tree over the 8 lane partials (destroys p). */
KVT_HD double kvt__attn_tree8(double *p) {
    for (uint32_t s = KVT__ATTN_LANES / 2; s >= 1; s >>= 1)
        for (uint32_t i = 0; i < s; i++)
            p[i] = p[i] + p[i + s];
    return p[0];
}

/* score = scale · (q · k) in the fixed order of step 1. */
KVT_HD double kvt__attn_score(const double *k, const float *q, uint32_t n, double scale) {
    double p[KVT__ATTN_LANES];
    for (uint32_t l = 0; l < KVT__ATTN_LANES; l++)
        p[l] = kvt__attn_dot_lane(k, q, n, l);
    return scale * kvt__attn_tree8(p);
}

/* Unnormalised softmax weight of a score given the running maximum. */
KVT_HD double kvt__attn_weight(double score, double max_score) {
    return exp(score - max_score);
}

/* acc[d] += w · v[d] for d < value_dim (v already widened). */
KVT_HD void kvt__attn_accum(double *acc, const double *v, uint32_t value_dim, double w) {
    for (uint32_t d = 0; d < value_dim; d++)
        acc[d] += w * v[d];
}

/* ---------------------------------------------------------------------------------------------
 * CPU twin (kernels/attn.c)
 * ------------------------------------------------------------------------------------------- */

/* One decode step of one MLA layer, n_heads query heads, over n_rows gathered rows. */
typedef struct kvt__attn_args {
    const uint8_t *base;   /* first byte of the plane holding the rows (a pool plane, or any
                              array of rows) */
    const int32_t *slots;  /* [n_rows]: row j at base + slots[j] * slot_stride + row_offset;
                              NULL: row j at slot j (a contiguous array). Slots must be >= 0. */
    uint32_t n_rows;
    size_t slot_stride;    /* bytes between consecutive slots (n_kv_heads * row_bytes) */
    size_t row_offset;     /* bytes from a slot's start to the row (kv head * row_bytes; 0) */
    int dtype;             /* KVT__DT_BF16 / FP16 / FP32, or FP8 (ds_mla rows, key_dim <= 576) */
    uint32_t key_dim;      /* values of a key: 576 (<= KVT__ATTN_MAX_DIM) */
    uint32_t value_dim;    /* leading values forming the value: 512 (<= key_dim) */
    const float *q;        /* [n_heads] absorbed queries at q + h * q_stride, key_dim floats */
    uint32_t n_heads;
    size_t q_stride;       /* floats between heads (>= key_dim) */
    double scale;          /* softmax scale s */
    const uint8_t *mark;   /* [n_rows]: nonzero marks row j (a needle); NULL: nothing marked */
    float *out;            /* [n_heads][value_dim] attention output; NULL: not written */
    double *mark_mass;     /* [n_heads] Σ p over marked rows; NULL: not written */
    double *lse;           /* [n_heads] log-sum-exp of the scores; NULL: not written */
    double *scratch;       /* kvt__attn_scratch_doubles(...) doubles, caller-owned */
} kvt__attn_args;

/* Doubles of scratch kvt__attn_cpu needs: scores [n_heads][n_rows], accumulators
 * [n_heads][value_dim] and one widened row [key_dim]. */
size_t kvt__attn_scratch_doubles(uint32_t n_rows, uint32_t n_heads, uint32_t value_dim,
                                 uint32_t key_dim);

/* Run the step (math and order at the top of this file). Two reads of every row (scores, then
 * weights and values). Returns 0, or -1 with nothing written when an argument is invalid (NULL
 * base with n_rows > 0, NULL q or scratch, key_dim 0 or > KVT__ATTN_MAX_DIM, value_dim > key_dim,
 * q_stride < key_dim, a negative slot, an unknown dtype). */
int kvt__attn_cpu(const kvt__attn_args *a);

/* ---------------------------------------------------------------------------------------------
 * Fast fp32 twin (kernels/attn_f32.c): the same step computed like a GEMM, for benchmarks that
 * compare attention over a subset of rows with attention over all of them (bench/kernels/
 * bench_decode.c). fp32 throughout, online softmax (every row read once, for all heads), the
 * tiling's summation order: agrees with kvt__attn_cpu to a relative ~1e-5 on unit-scale data, not
 * bit for bit (the error grows with the scores' magnitude: tests/test_attn_f32.c states the bound).
 * ------------------------------------------------------------------------------------------- */

/* Rows widened to fp32 per tile (a tile of 96 bf16 MLA rows is 216 KiB of fp32). */
#define KVT__ATTN_F32_TILE 96u

typedef struct kvt__attn_f32_args {
    const uint8_t *base;   /* as kvt__attn_args: row j at base + slots[j] * slot_stride +
                              row_offset; slots NULL: a contiguous range, row j at slot j (point
                              base at the range's first slot) */
    const int32_t *slots;  /* [n_rows] (a gather; any order, gaps allowed), or NULL */
    uint32_t n_rows;
    size_t slot_stride;
    size_t row_offset;
    int dtype;             /* KVT__DT_BF16 / FP16 / FP32 */
    uint32_t key_dim;      /* <= KVT__ATTN_MAX_DIM */
    uint32_t value_dim;    /* <= key_dim */
    const float *q;        /* [n_heads] queries at q + h * q_stride */
    uint32_t n_heads;
    size_t q_stride;       /* >= key_dim */
    double scale;          /* softmax scale s (applied in fp32) */
    float *out;            /* [n_heads][value_dim]; NULL: not written */
    float *lse;            /* [n_heads] log-sum-exp of the scores; NULL: not written */
    float *max_score;      /* [n_heads] the largest score s·(q·k) over the rows (fp32): the
                              recall scan's threshold "best"; NULL: not written */
    float *scratch;        /* kvt__attn_f32_scratch_floats(...) floats, caller-owned */
} kvt__attn_f32_args;

/* Floats of scratch kvt__attn_f32_cpu needs (whatever n_rows). */
size_t kvt__attn_f32_scratch_floats(uint32_t n_heads, uint32_t key_dim, uint32_t value_dim);

/* Run the step. An empty row set gives out = 0, lse = max_score = −Inf. A NaN score or value
 * makes the head's out and lse NaN (max_score ignores NaN scores). Returns 0, or -1 with nothing
 * written on the arguments kvt__attn_cpu refuses (scratch NULL instead of its doubles). */
int kvt__attn_f32_cpu(const kvt__attn_f32_args *a);

#endif /* KVT_KERNELS_ATTN_H */
