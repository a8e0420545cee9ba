/*
 * sketch.h — the recall tier's per-row sketch (DESIGN §2.1 "Recall tier", docs/recall.md §2).
 * Pure math: no policy, no state. Read by gcc and nvcc (no restrict, _Generic or compound
 * literals): the KVT_HD functions are the per-element math the CPU twin and a CUDA kernel share.
 *
 * A row's latent c (its first D = value_dim values: 512 on MLA) is described, against the layer's
 * basis V (rank r rows of D fp32, orthonormal; kvt_ctx_set_recall_basis), by
 *
 *     csk_k = fp16( Σ_d c_d · V[k][d] )                 k < r      (the sketch, stored fp16)
 *     ρ     = ‖ c − Σ_k f32(csk_k) · V[k] ‖₂                       (stored fp32)
 *
 * ρ is measured against the STORED fp16 sketch, not the exact projection: it is the norm of
 * everything a scan that reads csk misses, the projection's remainder and csk's rounding
 * together, so a certificate built on it bounds what the scan really misses (docs/recall.md §3).
 * Without a basis (r = 0) the sketch is empty and ρ = ‖c‖.
 *
 * Summation order (fixed, so a GPU kernel reproduces the CPU twin bit for bit; every multiply-add
 * an explicit fmaf, every other operation one IEEE fp32 operation):
 *   1. coefficient k: acc = fmaf(c_d, V[k][d], acc) for d = 0 .. D−1 ascending from +0.0f
 *      (kvt__sketch_coef), then rounded to fp16, nearest even (kvt__f32_to_f16);
 *   2. residual d: rec = fmaf(f32(csk_k), V[k][d], rec) for k = 0 .. r−1 ascending from +0.0f,
 *      e_d = c_d − rec (kvt__sketch_resid);
 *   3. ρ = sqrtf of the warp-shaped sum of squares of e (kvt__norm_fixed: 32 lanes, fmaf over
 *      d = l, l+32, .., then a stride-halving tree), the order σ uses.
 *
 * Rows the sketch cannot describe. When a latent value is NaN or ±Inf, or a coefficient rounds to
 * ±Inf in fp16 (|coefficient| ≥ 65520), the row is written as csk = 0 and ρ = +Inf: any
 * certificate built on it is infinite, so every trigger mode fetches the row whenever it is
 * archived (it costs only itself; a NaN could otherwise poison idx of every head). A ρ that
 * overflows fp32 is +Inf too. ρ is never NaN.
 */
#ifndef KVT_KERNELS_SKETCH_H
#define KVT_KERNELS_SKETCH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kvt_hd.h"
#include "kernels/sigma.h"

/* Largest latent a sketch takes (D = value_dim; 512 on every MLA model in the census). */
#define KVT__SKETCH_MAX_DIM 1024u
/* Largest basis rank (the public KVT_RECALL_MAX_RANK). */
#define KVT__SKETCH_MAX_RANK 256u

/* A row dtype the sketch reads: bf16, fp16, fp32, or the fp8 ds_mla layout (kvt_hd.h) with a
 * latent of at most its KVT__FP8_VALUES values. */
KVT_HD int kvt__sketch_dtype_ok(int dtype, uint32_t D) {
    return dtype == KVT__DT_BF16 || dtype == KVT__DT_FP16 || dtype == KVT__DT_FP32 ||
           (dtype == KVT__DT_FP8 && D <= KVT__FP8_VALUES);
}

/* Latent value d of a row (row points at its first byte; bf16, fp16, fp32 or the fp8 ds_mla
 * layout's scaled values). */
KVT_HD float kvt__sketch_latent(const uint8_t *row, int dtype, uint32_t d) {
    return kvt__load_elem(row, dtype, d);
}

/* Is every latent value finite? (exponent bits: no compiler flag can fold the test away) */
KVT_HD int kvt__sketch_row_finite(const uint8_t *row, int dtype, uint32_t D) {
    for (uint32_t d = 0; d < D; d++)
        if ((kvt__bits_from_f32(kvt__sketch_latent(row, dtype, d)) & 0x7f800000u) == 0x7f800000u)
            return 0;
    return 1;
}

/* One step of a coefficient (step 1): acc + c_d · V[k][d], one rounding. */
KVT_HD float kvt__sketch_coef_step(float acc, float c_d, float v_kd) {
    return fmaf(c_d, v_kd, acc);
}

/* Coefficient k of a latent held as fp32 (c[0..D)): step 1 before the fp16 rounding. */
KVT_HD float kvt__sketch_coef(const float *c, uint32_t D, const float *V_k) {
    float acc = 0.0f;
    for (uint32_t d = 0; d < D; d++)
        acc = kvt__sketch_coef_step(acc, c[d], V_k[d]);
    return acc;
}

/* Residual element d (step 2): c_d minus the fp16 sketch's reconstruction, k ascending. V is
 * [rank][D]; csk holds rank fp16 values. */
KVT_HD float kvt__sketch_resid(float c_d, const uint16_t *csk, uint32_t rank, const float *V,
                               uint32_t D, uint32_t d) {
    float rec = 0.0f;
    for (uint32_t k = 0; k < rank; k++)
        rec = fmaf(kvt__f16_to_f32(csk[k]), V[(size_t)k * D + d], rec);
    return c_d - rec;
}

/* Is an fp16 value ±Inf or NaN? */
KVT_HD int kvt__f16_finite(uint16_t h) {
    return (h & 0x7c00u) != 0x7c00u;
}

/* ρ as stored: NaN (an fp32 overflow inside the sum can give Inf − Inf) becomes +Inf. */
KVT_HD float kvt__sketch_rho_canon(float rho) {
    return rho <= 3.40282347e38f ? rho : INFINITY;
}

/* ---------------------------------------------------------------------------------------------
 * CPU twin (sketch.c)
 * ------------------------------------------------------------------------------------------- */

/* Floats of scratch kvt__sketch_rows_cpu needs for a latent of D values. */
size_t kvt__sketch_scratch_floats(uint32_t D);

/* Sketch n_rows rows: row u at base + (size_t)slots[u] * slot_stride_bytes, its latent the first
 * D values of dtype (kvt__sketch_dtype_ok: bf16 / fp16 / fp32 / fp8 ds_mla). V: [rank][D]
 * fp32 (NULL when rank is 0). Writes csk[u * csk_stride + k] for k < csk_stride (entries from
 * rank on are 0) and rho[u], in the fixed order above. scratch holds
 * kvt__sketch_scratch_floats(D) floats. Arguments are trusted (checked upstream): D <=
 * KVT__SKETCH_MAX_DIM, rank <= csk_stride <= KVT__SKETCH_MAX_RANK. */
void kvt__sketch_rows_cpu(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                          size_t slot_stride_bytes, int dtype, uint32_t D, const float *V,
                          uint32_t rank, uint32_t csk_stride, float *scratch, uint16_t *csk,
                          float *rho);

/* Whether kvt__sketch_rows_cpu runs its AVX-512 path (32 rows a tile; the same bits): the CPU has
 * AVX-512F and it is enabled. enable 0 / 1 turns it off / on (tests run both), -1 only asks. */
int kvt__sketch_wide(int enable);

#endif /* KVT_KERNELS_SKETCH_H */
