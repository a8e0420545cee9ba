/*
 * sketch.c — CPU twin of the recall sketch (see sketch.h for the math and its fixed summation
 * order). The loops only arrange the KVT_HD per-element functions' operations: every element
 * sees exactly the fmaf chain of kvt__sketch_coef / kvt__sketch_resid, so a CUDA kernel over the
 * same functions gives the same bits.
 */
#include "kernels/sketch.h"

#include "lib/base/base.h"

#include <string.h>

/* Rows whose coefficients are computed together: their chains are independent, so the
 * innermost loop is T fused multiply-adds on contiguous data (one vector instruction), while each
 * coefficient still sees d ascending from +0. */
#define SKETCH_TILE 8u
/* Coefficients computed together per pass over a tile's latents. */
#define SKETCH_KB 4u

size_t kvt__sketch_scratch_floats(uint32_t D) {
    return (size_t)SKETCH_TILE * D + 2u * (size_t)D;
}

/* kvt__norm_fixed with its 32 lane chains advanced together: lane l still accumulates
 * d = l, l+32, .. ascending from +0, then the same tree and sqrtf, so the bits are
 * kvt__norm_fixed's; the 32 chains are independent, so they vectorise instead of running one
 * after the other (16 dependent steps each for D = 512). */
static inline float norm_interleaved(const float *v, uint32_t n) {
    float p[KVT__SIGMA_LANES];
    for (uint32_t l = 0; l < KVT__SIGMA_LANES; l++)
        p[l] = 0.0f;
    uint32_t d0 = 0;
    for (; d0 + KVT__SIGMA_LANES <= n; d0 += KVT__SIGMA_LANES)
        for (uint32_t l = 0; l < KVT__SIGMA_LANES; l++)
            p[l] = fmaf(v[d0 + l], v[d0 + l], p[l]);
    for (uint32_t l = 0; d0 + l < n; l++)
        p[l] = fmaf(v[d0 + l], v[d0 + l], p[l]);
    return sqrtf(kvt__tree32(p));
}

KVT__FMA_CLONES
void kvt__sketch_rows_cpu(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                          size_t slot_stride_bytes, int dtype, uint32_t D, const float *V,
                          uint32_t rank, uint32_t csk_stride, float *scratch, uint16_t *csk,
                          float *rho) {
    KVT_ASSERT(D >= 1 && D <= KVT__SKETCH_MAX_DIM);
    KVT_ASSERT(rank <= csk_stride && csk_stride <= KVT__SKETCH_MAX_RANK);
    float *ct = scratch;                            /* [D][SKETCH_TILE]: the tile's latents */
    float *rec = scratch + (size_t)SKETCH_TILE * D; /* [D] */
    float *e = rec + D;                             /* [D] */
    for (uint32_t u0 = 0; u0 < n_rows; u0 += SKETCH_TILE) {
        uint32_t T = n_rows - u0 < SKETCH_TILE ? n_rows - u0 : SKETCH_TILE;
        int fin[SKETCH_TILE];
        /* The tile's latents as fp32, transposed; a non-finite row (and the tile's unused
         * lanes) as zeros, so its lane computes finite garbage that is never stored. */
        for (uint32_t r = 0; r < SKETCH_TILE; r++) {
            const uint8_t *row = r < T ? base + (size_t)slots[u0 + r] * slot_stride_bytes : NULL;
            uint32_t bad = row ? 0 : 1; /* kvt__sketch_row_finite, fused with the load */
            for (uint32_t d = 0; row && d < D; d++) {
                float x = kvt__sketch_latent(row, dtype, d);
                bad |= (kvt__bits_from_f32(x) & 0x7f800000u) == 0x7f800000u;
                ct[(size_t)d * SKETCH_TILE + r] = x;
            }
            fin[r] = !bad;
            for (uint32_t d = 0; bad && d < D; d++)
                ct[(size_t)d * SKETCH_TILE + r] = 0.0f;
        }
        /* Step 1: coefficients, then fp16. SKETCH_KB coefficients at a time: their chains are
         * independent, so the fused multiply-adds of one d do not wait on each other's latency
         * (one chain at a time was latency-bound at ~4 cycles per step). */
        for (uint32_t k0 = 0; k0 < rank; k0 += SKETCH_KB) {
            const uint32_t kb = rank - k0 < SKETCH_KB ? rank - k0 : SKETCH_KB;
            float acc[SKETCH_KB][SKETCH_TILE];
            for (uint32_t j = 0; j < SKETCH_KB; j++)
                for (uint32_t r = 0; r < SKETCH_TILE; r++)
                    acc[j][r] = 0.0f;
            if (kb == SKETCH_KB) {
                const float *V0 = V + (size_t)k0 * D;
                for (uint32_t d = 0; d < D; d++) {
                    const float *cd = ct + (size_t)d * SKETCH_TILE;
#pragma GCC unroll 4
                    for (uint32_t j = 0; j < SKETCH_KB; j++) {
                        const float v = V0[(size_t)j * D + d];
#pragma GCC unroll 8
                        for (uint32_t r = 0; r < SKETCH_TILE; r++)
                            acc[j][r] = kvt__sketch_coef_step(acc[j][r], cd[r], v);
                    }
                }
            } else {
                for (uint32_t j = 0; j < kb; j++) {
                    const float *Vk = V + (size_t)(k0 + j) * D;
                    for (uint32_t d = 0; d < D; d++)
                        for (uint32_t r = 0; r < SKETCH_TILE; r++)
                            acc[j][r] = kvt__sketch_coef_step(
                                acc[j][r], ct[(size_t)d * SKETCH_TILE + r], Vk[d]);
                }
            }
            for (uint32_t j = 0; j < kb; j++)
                for (uint32_t r = 0; r < T; r++)
                    csk[(size_t)(u0 + r) * csk_stride + k0 + j] = kvt__f32_to_f16(acc[j][r]);
        }
        /* Steps 2 and 3 per row: residual against the stored sketch, its norm. rec[d] sees k
         * ascending from +0 (kvt__sketch_resid's chain); the loops are interchanged so the D
         * chains are independent, which changes no bit. */
        for (uint32_t r = 0; r < T; r++) {
            uint16_t *cs = csk + (size_t)(u0 + r) * csk_stride;
            for (uint32_t k = rank; k < csk_stride; k++)
                cs[k] = 0;
            int ok = fin[r];
            for (uint32_t k = 0; ok && k < rank; k++)
                ok = kvt__f16_finite(cs[k]);
            if (!ok) {
                for (uint32_t k = 0; k < rank; k++)
                    cs[k] = 0;
                rho[u0 + r] = INFINITY; /* undescribable: every certificate on it is infinite */
                continue;
            }
            for (uint32_t d = 0; d < D; d++)
                rec[d] = 0.0f;
            for (uint32_t k = 0; k < rank; k++) {
                const float c = kvt__f16_to_f32(cs[k]);
                const float *Vk = V + (size_t)k * D;
                for (uint32_t d = 0; d < D; d++)
                    rec[d] = fmaf(c, Vk[d], rec[d]);
            }
            for (uint32_t d = 0; d < D; d++)
                e[d] = ct[(size_t)d * SKETCH_TILE + r] - rec[d];
            rho[u0 + r] = kvt__sketch_rho_canon(norm_interleaved(e, D));
        }
    }
}
