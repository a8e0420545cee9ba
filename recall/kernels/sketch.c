/*
 * sketch.c — CPU twin of the recall sketch (see sketch.h for the math and its fixed summation
 * order). The loops only arrange the KVT_HD per-element functions' operations: every element
 * sees exactly the fmaf chain of kvt__sketch_coef / kvt__sketch_resid, so a CUDA kernel over the
 * same functions gives the same bits.
 */
#include "recall/kernels/sketch.h"

#include "lib/base/base.h"

#include <string.h>

/* Rows whose coefficients are computed together: their chains are independent, so the
 * innermost loop is T fused multiply-adds on contiguous data (one vector instruction), while each
 * coefficient still sees d ascending from +0. */
#define SKETCH_TILE 8u
/* Coefficients computed together per pass over a tile's latents. */
#define SKETCH_KB 4u

/* The AVX-512 path's tile: 32 rows, one lane each of two 16-lane vectors (below). */
#define WIDE_LANES 16u
#define WIDE_ROWS 32u

size_t kvt__sketch_scratch_floats(uint32_t D) {
    const size_t narrow = (size_t)SKETCH_TILE * D + 2u * (size_t)D;
    /* wide: the tile's latents [D][32], its rounded coefficients [MAX_RANK][32], the 32 norm
     * lanes [32][32] */
    const size_t wide = (size_t)WIDE_ROWS * (D + KVT__SKETCH_MAX_RANK + KVT__SIGMA_LANES);
    return narrow > wide ? narrow : wide;
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

/* ---------------------------------------------------------------------------------------------
 * The wide path (x86-64 CPUs with AVX-512F): 32 rows a tile, one row per lane of two 512-bit
 * registers, so every instruction advances 16 independent chains, and each chain is the
 * per-element function's, in its order, from +0:
 *   step 1: coefficient k of row r is fmaf(c_r[d], V[k][d], acc) for d ascending (8
 *           coefficients' chains at a time for both halves of the tile: 16 accumulators, so each
 *           loaded row vector feeds 8 fused multiply-adds and each broadcast V[k][d] two);
 *   step 2: rec_r[d] is fmaf(f32(csk_r[k]), V[k][d], rec) for k ascending (8 d's at a time for
 *           both halves: 16 accumulators again), then e = c_r[d] − rec_r[d];
 *   step 3: lane l = d mod 32 of row r's norm takes fmaf(e, e, p) for d ascending (norm_interleaved
 *           and kvt__norm_fixed's lanes), then the same tree32 and sqrtf.
 * _mm512_fmadd_ps is the correctly rounded a·b + c of fmaf in every lane, so the bits are the
 * narrow path's (tests/test_recall.c runs both against the per-element functions).
 * ------------------------------------------------------------------------------------------- */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define SKETCH_WIDE 1
#define WIDE_FN __attribute__((target("avx512f")))

/* Step 1 for coefficients k0 .. k0 + 8 of the tile: ct [D][32] latents, out [8][32]. Each d's
 * two row vectors feed 16 chains and each broadcast two. */
WIDE_FN static void wide_coef8(const float *ct, uint32_t D, const float *V, uint32_t k0,
                               float *out) {
    const float *v = V + (size_t)k0 * D;
    __m512 a[8][2];
#pragma GCC unroll 8
    for (uint32_t j = 0; j < 8u; j++)
        a[j][0] = a[j][1] = _mm512_setzero_ps();
    for (uint32_t d = 0; d < D; d++) {
        const __m512 x0 = _mm512_loadu_ps(ct + (size_t)d * WIDE_ROWS);
        const __m512 x1 = _mm512_loadu_ps(ct + (size_t)d * WIDE_ROWS + WIDE_LANES);
#pragma GCC unroll 8
        for (uint32_t j = 0; j < 8u; j++) {
            const __m512 b = _mm512_set1_ps(v[(size_t)j * D + d]);
            a[j][0] = _mm512_fmadd_ps(x0, b, a[j][0]);
            a[j][1] = _mm512_fmadd_ps(x1, b, a[j][1]);
        }
    }
#pragma GCC unroll 8
    for (uint32_t j = 0; j < 8u; j++) {
        _mm512_storeu_ps(out + (size_t)j * WIDE_ROWS, a[j][0]);
        _mm512_storeu_ps(out + (size_t)j * WIDE_ROWS + WIDE_LANES, a[j][1]);
    }
}

/* Step 1 for one coefficient k (the rank's tail past a multiple of 8). */
WIDE_FN static void wide_coef1(const float *ct, uint32_t D, const float *V, uint32_t k,
                               float *out) {
    const float *v = V + (size_t)k * D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (uint32_t d = 0; d < D; d++) {
        const __m512 b = _mm512_set1_ps(v[d]);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(ct + (size_t)d * WIDE_ROWS), b, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(ct + (size_t)d * WIDE_ROWS + WIDE_LANES), b, a1);
    }
    _mm512_storeu_ps(out, a0);
    _mm512_storeu_ps(out + WIDE_LANES, a1);
}

/* Steps 2 and 3 for the tile (D a multiple of 8): ck [rank][32] the rounded coefficients as
 * fp32, p [32][32] the norm lanes (written). Each k's two coefficient vectors feed 16 chains. */
WIDE_FN static void wide_resid(const float *ct, uint32_t D, const float *V, uint32_t rank,
                               const float *ck, float *p) {
    for (uint32_t l = 0; l < KVT__SIGMA_LANES * 2u; l++)
        _mm512_storeu_ps(p + (size_t)l * WIDE_LANES, _mm512_setzero_ps());
    for (uint32_t d0 = 0; d0 < D; d0 += 8u) {
        __m512 a[8][2];
#pragma GCC unroll 8
        for (uint32_t j = 0; j < 8u; j++)
            a[j][0] = a[j][1] = _mm512_setzero_ps();
        for (uint32_t k = 0; k < rank; k++) {
            const __m512 c0 = _mm512_loadu_ps(ck + (size_t)k * WIDE_ROWS);
            const __m512 c1 = _mm512_loadu_ps(ck + (size_t)k * WIDE_ROWS + WIDE_LANES);
            const float *v = V + (size_t)k * D + d0;
#pragma GCC unroll 8
            for (uint32_t j = 0; j < 8u; j++) {
                const __m512 b = _mm512_set1_ps(v[j]);
                a[j][0] = _mm512_fmadd_ps(c0, b, a[j][0]);
                a[j][1] = _mm512_fmadd_ps(c1, b, a[j][1]);
            }
        }
#pragma GCC unroll 8
        for (uint32_t j = 0; j < 8u; j++) {
            const uint32_t d = d0 + j;
            float *pl = p + (size_t)(d % KVT__SIGMA_LANES) * WIDE_ROWS;
            const __m512 e0 = _mm512_sub_ps(_mm512_loadu_ps(ct + (size_t)d * WIDE_ROWS), a[j][0]);
            const __m512 e1 =
                _mm512_sub_ps(_mm512_loadu_ps(ct + (size_t)d * WIDE_ROWS + WIDE_LANES), a[j][1]);
            _mm512_storeu_ps(pl, _mm512_fmadd_ps(e0, e0, _mm512_loadu_ps(pl)));
            _mm512_storeu_ps(pl + WIDE_LANES,
                             _mm512_fmadd_ps(e1, e1, _mm512_loadu_ps(pl + WIDE_LANES)));
        }
    }
}

/* 16 rows' bf16 latents, transposed into the 16 lanes of ct [D][32] that ct points at (D even):
 * one 4-byte gather per lane and pair of values (latent d in the low half, d + 1 in the high
 * one), widened exactly (bf16 is fp32's top half). Returns the lanes whose latent holds a
 * non-finite value. */
WIDE_FN static uint32_t wide_load_bf16(const uint8_t *base, const int32_t *sl, size_t stride,
                                       uint32_t D, float *ct) {
    int64_t off[WIDE_LANES];
    for (uint32_t r = 0; r < WIDE_LANES; r++)
        off[r] = (int64_t)sl[r] * (int64_t)stride;
    const __m512i o0 = _mm512_loadu_si512(off), o1 = _mm512_loadu_si512(off + 8);
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u), ex = _mm512_set1_epi32(0x7f800000);
    __mmask16 bad = 0;
    for (uint32_t d = 0; d < D; d += 2u) {
        const __m256i g0 = _mm512_i64gather_epi32(o0, base + 2u * d, 1);
        const __m256i g1 = _mm512_i64gather_epi32(o1, base + 2u * d, 1);
        const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(g0), g1, 1);
        const __m512i a = _mm512_slli_epi32(x, 16), b = _mm512_and_si512(x, hi);
        bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(a, ex), ex);
        bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, ex), ex);
        _mm512_storeu_si512(ct + (size_t)d * WIDE_ROWS, a);
        _mm512_storeu_si512(ct + (size_t)(d + 1u) * WIDE_ROWS, b);
    }
    return bad;
}

/* n vectors of 16 coefficients (f [n][16]) to fp16, rounded to nearest even (kvt__f32_to_f16's
 * rounding: IEEE binary16, overflow to Inf; a NaN's payload may differ, and a non-finite
 * coefficient zeroes its row's sketch either way). */
WIDE_FN static void wide_to_f16(const float *f, uint32_t n, uint16_t *h) {
    for (uint32_t j = 0; j < n; j++)
        _mm256_storeu_si256((__m256i *)(h + (size_t)j * WIDE_LANES),
                            _mm512_cvtps_ph(_mm512_loadu_ps(f + (size_t)j * WIDE_LANES),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* The stored sketch as fp32 (exact), ck [rank][32]: the lanes of `ok` whose coefficients are all
 * finite keep theirs, every other lane is zero. Returns those lanes. */
WIDE_FN static uint32_t wide_from_f16(const uint16_t *h, uint32_t rank, uint32_t ok, float *ck) {
    const __m512i ex = _mm512_set1_epi32(0x7f800000);
    uint32_t bad = 0;
    for (uint32_t k = 0; k < rank; k++)
        for (uint32_t g = 0; g < 2u; g++) {
            const size_t at = (size_t)k * WIDE_ROWS + g * WIDE_LANES;
            const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + at)));
            bad |= (uint32_t)_mm512_cmpeq_epi32_mask(
                       _mm512_and_si512(_mm512_castps_si512(v), ex), ex)
                   << (g * WIDE_LANES);
            _mm512_storeu_ps(ck + at, v);
        }
    const uint32_t keep = ok & ~bad;
    for (uint32_t k = 0; keep != 0xffffffffu && k < rank; k++)
        for (uint32_t g = 0; g < 2u; g++) {
            const size_t at = (size_t)k * WIDE_ROWS + g * WIDE_LANES;
            _mm512_storeu_ps(ck + at, _mm512_maskz_mov_ps((__mmask16)(keep >> (g * WIDE_LANES)),
                                                          _mm512_loadu_ps(ck + at)));
        }
    return keep;
}

/* Whether the wide path runs: the CPU has AVX-512F and kvt__sketch_wide has not turned it off. */
static int wide_enabled = 1;

int kvt__sketch_wide(int enable) {
    if (enable >= 0)
        wide_enabled = enable;
    return wide_enabled && __builtin_cpu_supports("avx512f");
}

/* The wide path over every row (D a multiple of 8). */
static void sketch_rows_wide(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                             size_t slot_stride_bytes, int dtype, uint32_t D, const float *V,
                             uint32_t rank, uint32_t csk_stride, float *scratch, uint16_t *csk,
                             float *rho) {
    float *ct = scratch;                                      /* [D][32] */
    float *ck = ct + (size_t)WIDE_ROWS * D;                   /* [rank][32]; step 1's [8][32] */
    float *p = ck + (size_t)WIDE_ROWS * KVT__SKETCH_MAX_RANK; /* [32][32] */
    uint16_t h16[KVT__SKETCH_MAX_RANK * WIDE_ROWS];           /* the tile's sketch, [rank][32] */
    for (uint32_t u0 = 0; u0 < n_rows; u0 += WIDE_ROWS) {
        const uint32_t T = n_rows - u0 < WIDE_ROWS ? n_rows - u0 : WIDE_ROWS;
        /* the tile's latents as fp32, transposed; a non-finite row and unused lanes as zeros */
        uint32_t fin = 0;
        if (T == WIDE_ROWS && dtype == KVT__DT_BF16) {
            const uint32_t bad0 = wide_load_bf16(base, slots + u0, slot_stride_bytes, D, ct);
            const uint32_t bad1 = wide_load_bf16(base, slots + u0 + WIDE_LANES, slot_stride_bytes,
                                                 D, ct + WIDE_LANES);
            fin = ~(bad0 | bad1 << WIDE_LANES);
        } else {
            for (uint32_t r = 0; r < WIDE_ROWS; r++) {
                const uint8_t *row =
                    r < T ? base + (size_t)slots[u0 + r] * slot_stride_bytes : NULL;
                uint32_t bad = row ? 0 : 1;
                for (uint32_t d = 0; row && d < D; d++) {
                    float x = kvt__sketch_latent(row, dtype, d);
                    bad |= (kvt__bits_from_f32(x) & 0x7f800000u) == 0x7f800000u;
                    ct[(size_t)d * WIDE_ROWS + r] = x;
                }
                fin |= (uint32_t)!bad << r;
            }
        }
        for (uint32_t r = 0; r < WIDE_ROWS; r++)
            for (uint32_t d = 0; !(fin >> r & 1u) && d < D; d++)
                ct[(size_t)d * WIDE_ROWS + r] = 0.0f;
        /* step 1, rounded to fp16 as it is stored */
        uint32_t k0 = 0;
        for (; k0 + 8u <= rank; k0 += 8u) {
            wide_coef8(ct, D, V, k0, ck);
            wide_to_f16(ck, 16u, h16 + (size_t)k0 * WIDE_ROWS);
        }
        for (; k0 < rank; k0++) {
            wide_coef1(ct, D, V, k0, ck);
            wide_to_f16(ck, 2u, h16 + (size_t)k0 * WIDE_ROWS);
        }
        /* the stored sketch (stride padding zero; an undescribable row's all zero, its lane then
         * computes a residual that is never stored), as fp32 for step 2 */
        fin = wide_from_f16(h16, rank, fin, ck);
        for (uint32_t r = 0; r < T; r++) {
            uint16_t *cs = csk + (size_t)(u0 + r) * csk_stride;
            const int ok = (int)(fin >> r & 1u);
            for (uint32_t k = 0; k < rank; k++)
                cs[k] = ok ? h16[(size_t)k * WIDE_ROWS + r] : 0;
            for (uint32_t k = rank; k < csk_stride; k++)
                cs[k] = 0;
        }
        wide_resid(ct, D, V, rank, ck, p);
        for (uint32_t r = 0; r < T; r++) {
            if (!(fin >> r & 1u)) {
                rho[u0 + r] = INFINITY; /* undescribable: every certificate on it is infinite */
                continue;
            }
            float lanes[KVT__SIGMA_LANES];
            for (uint32_t l = 0; l < KVT__SIGMA_LANES; l++)
                lanes[l] = p[(size_t)l * WIDE_ROWS + r];
            rho[u0 + r] = kvt__sketch_rho_canon(sqrtf(kvt__tree32(lanes)));
        }
    }
}
#else
int kvt__sketch_wide(int enable) {
    (void)enable;
    return 0;
}
#endif

KVT__FMA_CLONES
void kvt__sketch_rows_cpu(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                          size_t slot_stride_bytes, int dtype, uint32_t D, const float *V,
                          uint32_t rank, uint32_t csk_stride, float *scratch, uint16_t *csk,
                          float *rho) {
    KVT_ASSERT(D >= 1 && D <= KVT__SKETCH_MAX_DIM);
    KVT_ASSERT(rank <= csk_stride && csk_stride <= KVT__SKETCH_MAX_RANK);
#if defined(SKETCH_WIDE)
    if (D % 8u == 0 && kvt__sketch_wide(-1)) {
        sketch_rows_wide(base, slots, n_rows, slot_stride_bytes, dtype, D, V, rank, csk_stride,
                         scratch, csk, rho);
        return;
    }
#endif
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
