/*
 * sigma.c — CPU twins of the salience scores (see sigma.h for the math and its fixed summation
 * order). These loops only arrange the KVT_HD per-element functions of sigma.h; every rounding
 * happens inside them, so a CUDA kernel mapping threads over the same functions in the same tree
 * shape gives the same bits.
 */
#include "kernels/sigma.h"

#include "lib/base/base.h"

#include <math.h>
#include <string.h>

static int is_pow2(uint32_t x) {
    return x != 0 && (x & (x - 1)) == 0;
}

/* The argument rule of both bases, then their common column 0 (1/√B). -1 when refused. */
static int basis_begin(uint32_t B, uint32_t kappa, float *out) {
    if (out == NULL || B < 64 || !is_pow2(B) || kappa < 1 || kappa > B / 2)
        return -1;
    const double c0 = 1.0 / sqrt((double)B);
    for (uint32_t u = 0; u < B; u++)
        out[u] = (float)c0;
    return 0;
}

int kvt__fourier_basis(uint32_t B, uint32_t kappa, float *out) {
    if (basis_begin(B, kappa, out) != 0)
        return -1;
    const double two_pi = 6.283185307179586476925286766559;
    const double ck = sqrt(2.0 / (double)B);
    for (uint32_t k = 1; k < kappa; k++) {
        float *cosc = out + (size_t)(2 * k - 1) * B;
        float *sinc = out + (size_t)(2 * k) * B;
        for (uint32_t u = 0; u < B; u++) {
            /* k·u mod B (64-bit product, no overflow) keeps the angle in [0, 2π): cos/sin of a
             * reduced argument are accurate to about an ulp of double, far below the fp32
             * rounding that follows. */
            uint64_t ku = ((uint64_t)k * u) % B;
            double a = two_pi * (double)ku / (double)B;
            cosc[u] = (float)(ck * cos(a));
            sinc[u] = (float)(ck * sin(a));
        }
    }
    return 0;
}

int kvt__dct_basis(uint32_t B, uint32_t kappa, float *out) {
    if (basis_begin(B, kappa, out) != 0)
        return -1;
    const double pi = 3.141592653589793238462643383280;
    const double ck = sqrt(2.0 / (double)B);
    for (uint32_t k = 1; k < 2 * kappa - 1; k++) {
        float *col = out + (size_t)k * B;
        for (uint32_t u = 0; u < B; u++) {
            /* k(2u + 1) mod 4B keeps the angle in [0, 2π) */
            uint64_t m = ((uint64_t)k * (2u * (uint64_t)u + 1u)) % (4u * (uint64_t)B);
            col[u] = (float)(ck * cos(pi * (double)m / (2.0 * (double)B)));
        }
    }
    return 0;
}

int kvt__sigma_basis(int kind, uint32_t B, uint32_t kappa, float *out) {
    switch (kind) {
    case 0:
        return kvt__fourier_basis(B, kappa, out);
    case 1:
        return kvt__dct_basis(B, kappa, out);
    default:
        return -1;
    }
}

size_t kvt__sigma_scratch_floats(uint32_t B, uint32_t n_basis, uint32_t branch_dim) {
    if (B < KVT__SIGMA_LEAF_ROWS)
        return 0;
    return (size_t)(B / KVT__SIGMA_LEAF_ROWS) * n_basis * branch_dim;
}

static inline const uint8_t *row_at(const uint8_t *base, const int32_t *slots, uint32_t u,
                                    size_t stride) {
    return base + (size_t)slots[u] * stride;
}

/* ---------------------------------------------------------------------------------------------
 * The AVX2 + FMA and AVX-512 twins (x86-64, branch_dim a multiple of 64, the CPU's choice at run
 * time, kvt__sigma_simd): the scalar loops with each chain in a vector lane — step 1a's part[j][d]
 * and step 2's rec[d] one fused multiply-add per (u, j) in the same order (vfmadd is fmaf: one
 * rounding), the residual one subtraction, step 3's 32 lane partials of kvt__sumsq_lane in four
 * (two) vectors (d = l, l + 32, .. ascending) and kvt__tree32's additions in its order (s = 16, 8,
 * 4, 2, 1). The scalar loops spend most of σ's ~0.8 µs a row on the compiler's scalar chains.
 * ------------------------------------------------------------------------------------------- */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define SIGMA_AVX2 1
#define SIGMA_FN __attribute__((target("avx2,fma")))

/* Row u's branch as fp32 into r (D values, a multiple of 8); whether all are finite. */
SIGMA_FN static int branch_avx2(const uint8_t *row, uint32_t branch_offset, int branch_dtype,
                                uint32_t D, float *r) {
    if (branch_dtype != KVT__DT_BF16) {
        for (uint32_t d = 0; d < D; d++)
            r[d] = kvt__sigma_branch_val(row, branch_offset, branch_dtype, d);
        return kvt__sigma_branch_finite(row, branch_offset, branch_dtype, D);
    }
    const __m256i ex = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    for (uint32_t d = 0; d < D; d += 8u) {
        const __m256i x = _mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + branch_offset + 2u * d))),
            16);
        _mm256_storeu_si256((__m256i *)(r + d), x);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(x, ex), ex));
    }
    return _mm256_testz_si256(bad, bad);
}

/* Step 1a for row u (its fit values r): part[j][d] += C[j][u]·r[d], 64 channels a chunk held in
 * registers. */
SIGMA_FN static void leaf_avx2(const float *r, const float *basis, uint32_t B, uint32_t u,
                               uint32_t n_basis, uint32_t D, float *part) {
    for (uint32_t c0 = 0; c0 < D; c0 += 64u) {
        __m256 x[8];
        for (int k = 0; k < 8; k++)
            x[k] = _mm256_loadu_ps(r + c0 + 8u * k);
        for (uint32_t j = 0; j < n_basis; j++) {
            const __m256 c = _mm256_set1_ps(basis[(size_t)j * B + u]);
            float *pj = part + (size_t)j * D + c0;
            for (int k = 0; k < 8; k++)
                _mm256_storeu_ps(pj + 8 * k, _mm256_fmadd_ps(c, x[k], _mm256_loadu_ps(pj + 8 * k)));
        }
    }
}

/* Steps 2 and 3 for row u (its branch r): the reconstruction from Y, the residual, the 32 lane
 * partials in four vectors, kvt__tree32 (s = 16, 8 across the vectors, then 4, 2, 1), sqrtf. */
SIGMA_FN static float row_avx2(const float *r, const float *basis, uint32_t B, uint32_t u,
                               uint32_t n_basis, uint32_t D, const float *Y) {
    __m256 lane[4];
    for (int k = 0; k < 4; k++)
        lane[k] = _mm256_setzero_ps();
    for (uint32_t c0 = 0; c0 < D; c0 += 64u) {
        __m256 rec[8];
        for (int k = 0; k < 8; k++)
            rec[k] = _mm256_setzero_ps();
        for (uint32_t j = 0; j < n_basis; j++) {
            const __m256 c = _mm256_set1_ps(basis[(size_t)j * B + u]);
            const float *yj = Y + (size_t)j * D + c0;
            for (int k = 0; k < 8; k++)
                rec[k] = _mm256_fmadd_ps(c, _mm256_loadu_ps(yj + 8 * k), rec[k]);
        }
        for (int k = 0; k < 8; k++) { /* d = c0 + 8k: lane group k % 4, term c0/32 + k/4 */
            const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(r + c0 + 8u * k), rec[k]);
            lane[k % 4] = _mm256_fmadd_ps(v, v, lane[k % 4]);
        }
    }
    const __m256 t8 =
        _mm256_add_ps(_mm256_add_ps(lane[0], lane[2]), _mm256_add_ps(lane[1], lane[3]));
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return sqrtf(_mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1))));
}

/* The same with 16 lanes (AVX-512F): a 64-channel chunk is four vectors; the 32 norm lanes two
 * (d = c0 + 16k: lanes 0–15 for even k, 16–31 for odd k), kvt__tree32's s = 16 between them. */
#define SIGMA_FN512 __attribute__((target("avx2,fma,avx512f")))
SIGMA_FN512 static void leaf_avx512(const float *r, const float *basis, uint32_t B, uint32_t u,
                                    uint32_t n_basis, uint32_t D, float *part) {
    for (uint32_t c0 = 0; c0 < D; c0 += 64u) {
        __m512 x[4];
        for (int k = 0; k < 4; k++)
            x[k] = _mm512_loadu_ps(r + c0 + 16u * k);
        for (uint32_t j = 0; j < n_basis; j++) {
            const __m512 c = _mm512_set1_ps(basis[(size_t)j * B + u]);
            float *pj = part + (size_t)j * D + c0;
            for (int k = 0; k < 4; k++)
                _mm512_storeu_ps(pj + 16 * k,
                                 _mm512_fmadd_ps(c, x[k], _mm512_loadu_ps(pj + 16 * k)));
        }
    }
}

SIGMA_FN512 static float row_avx512(const float *r, const float *basis, uint32_t B, uint32_t u,
                                    uint32_t n_basis, uint32_t D, const float *Y) {
    __m512 lane[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (uint32_t c0 = 0; c0 < D; c0 += 64u) {
        __m512 rec[4];
        for (int k = 0; k < 4; k++)
            rec[k] = _mm512_setzero_ps();
        for (uint32_t j = 0; j < n_basis; j++) {
            const __m512 c = _mm512_set1_ps(basis[(size_t)j * B + u]);
            const float *yj = Y + (size_t)j * D + c0;
            for (int k = 0; k < 4; k++)
                rec[k] = _mm512_fmadd_ps(c, _mm512_loadu_ps(yj + 16 * k), rec[k]);
        }
        for (int k = 0; k < 4; k++) {
            const __m512 v = _mm512_sub_ps(_mm512_loadu_ps(r + c0 + 16u * k), rec[k]);
            lane[k % 2] = _mm512_fmadd_ps(v, v, lane[k % 2]);
        }
    }
    const __m512 t16 = _mm512_add_ps(lane[0], lane[1]);
    const __m256 t8 =
        _mm256_add_ps(_mm512_castps512_ps256(t16),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t16), 1)));
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return sqrtf(_mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1))));
}

/* The scalar twin's steps with the rows' work in vectors (level 2: AVX-512, 1: AVX2). */
SIGMA_FN static void sigma_simd(int level, const uint8_t *base, const int32_t *slots, uint32_t B,
                                size_t slot_stride_bytes, uint32_t branch_offset, int branch_dtype,
                                uint32_t D, const float *basis, uint32_t n_basis, float *scratch,
                                float *sigma_out) {
    const uint32_t P = B / KVT__SIGMA_LEAF_ROWS;
    const size_t part_floats = (size_t)n_basis * D;
    float r[KVT__SIGMA_MAX_BRANCH_DIM];
    /* Step 1a: leaf partials, u ascending within each leaf */
    for (uint32_t p = 0; p < P; p++) {
        float *part = scratch + (size_t)p * part_floats;
        memset(part, 0, sizeof *part * part_floats);
        for (uint32_t u = p * KVT__SIGMA_LEAF_ROWS; u < (p + 1) * KVT__SIGMA_LEAF_ROWS; u++) {
            if (!branch_avx2(base + (size_t)slots[u] * slot_stride_bytes, branch_offset,
                             branch_dtype, D, r))
                memset(r, 0, sizeof *r * D); /* kvt__sigma_fit_val of a bad row */
            (level == 2 ? leaf_avx512 : leaf_avx2)(r, basis, B, u, n_basis, D, part);
        }
    }
    /* Step 1b: the stride-halving tree, element-wise additions as the scalar twin's */
    for (uint32_t s = P / 2; s >= 1; s >>= 1) {
        for (uint32_t i = 0; i < s; i++) {
            float *a = scratch + (size_t)i * part_floats;
            const float *b = scratch + (size_t)(i + s) * part_floats;
            for (size_t e = 0; e < part_floats; e += 8u)
                _mm256_storeu_ps(a + e,
                                 _mm256_add_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e)));
        }
    }
    /* Steps 2 and 3 (a bad row: +Inf) */
    for (uint32_t u = 0; u < B; u++)
        sigma_out[u] =
            branch_avx2(base + (size_t)slots[u] * slot_stride_bytes, branch_offset, branch_dtype, D,
                        r)
                ? (level == 2 ? row_avx512 : row_avx2)(r, basis, B, u, n_basis, D, scratch)
                : INFINITY;
}
#endif

static int simd_max_level = 2;

int kvt__sigma_simd(int enable) {
    if (enable >= 0)
        simd_max_level = enable;
#ifdef SIGMA_AVX2
    const int cpu = !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ? 0
                    : __builtin_cpu_supports("avx512f")                               ? 2
                                                                                      : 1;
    return cpu < simd_max_level ? cpu : simd_max_level;
#else
    return 0;
#endif
}

KVT__FMA_CLONES
void kvt__sigma_block_cpu(const uint8_t *base, const int32_t *slots, uint32_t B,
                          size_t slot_stride_bytes, uint32_t branch_offset, int branch_dtype,
                          uint32_t branch_dim, const float *basis, uint32_t n_basis, float *scratch,
                          float *sigma_out) {
    KVT_ASSERT(B >= KVT__SIGMA_LEAF_ROWS && is_pow2(B));
    KVT_ASSERT(branch_dim >= 1 && branch_dim <= KVT__SIGMA_MAX_BRANCH_DIM);
    KVT_ASSERT(n_basis >= 1 && n_basis < B);
#ifdef SIGMA_AVX2
    const int level = branch_dim % 64u == 0 ? kvt__sigma_simd(-1) : 0;
    if (level) {
        sigma_simd(level, base, slots, B, slot_stride_bytes, branch_offset, branch_dtype,
                   branch_dim, basis, n_basis, scratch, sigma_out);
        return;
    }
#endif
    const uint32_t D = branch_dim;
    const uint32_t P = B / KVT__SIGMA_LEAF_ROWS;
    const size_t part_floats = (size_t)n_basis * D; /* one partial Y: [n_basis][D] */
    float r[KVT__SIGMA_MAX_BRANCH_DIM];

    /* Step 1a: leaf partials. Each accumulator part[p][j][d] sees u ascending within its leaf;
     * looping j and d inside u changes nothing about that order. */
    for (uint32_t p = 0; p < P; p++) {
        float *part = scratch + (size_t)p * part_floats;
        for (size_t e = 0; e < part_floats; e++)
            part[e] = 0.0f;
        for (uint32_t u = p * KVT__SIGMA_LEAF_ROWS; u < (p + 1) * KVT__SIGMA_LEAF_ROWS; u++) {
            const uint8_t *row = row_at(base, slots, u, slot_stride_bytes);
            int fin = kvt__sigma_branch_finite(row, branch_offset, branch_dtype, D);
            for (uint32_t d = 0; d < D; d++)
                r[d] = kvt__sigma_fit_val(row, branch_offset, branch_dtype, d, fin);
            for (uint32_t j = 0; j < n_basis; j++) {
                const float c = basis[(size_t)j * B + u];
                float *pj = part + (size_t)j * D;
                for (uint32_t d = 0; d < D; d++)
                    pj[d] = kvt__sigma_leaf_step(pj[d], c, r[d]);
            }
        }
    }
    /* Step 1b: stride-halving tree over the P leaves; Y ends in leaf 0. */
    for (uint32_t s = P / 2; s >= 1; s >>= 1) {
        for (uint32_t i = 0; i < s; i++) {
            float *a = scratch + (size_t)i * part_floats;
            const float *b = scratch + (size_t)(i + s) * part_floats;
            for (size_t e = 0; e < part_floats; e++)
                a[e] = a[e] + b[e];
        }
    }
    const float *Y = scratch;

    /* Steps 2 and 3: per row, residual against the low-pass reconstruction, then its norm.
     * rec[d] accumulates C[j][u]·Y[j][d] for j ascending from +0, exactly the order of
     * kvt__sigma_recon (the GPU's per-element function); the loops are interchanged so the 64
     * channels' chains are independent (latency hidden, vectorisable), which changes no bit. */
    float rec[KVT__SIGMA_MAX_BRANCH_DIM];
    for (uint32_t u = 0; u < B; u++) {
        const uint8_t *row = row_at(base, slots, u, slot_stride_bytes);
        if (!kvt__sigma_branch_finite(row, branch_offset, branch_dtype, D)) {
            sigma_out[u] = INFINITY; /* a bad row: left out of the fit, kept, counted upstream */
            continue;
        }
        for (uint32_t d = 0; d < D; d++)
            rec[d] = 0.0f;
        for (uint32_t j = 0; j < n_basis; j++) {
            const float c = basis[(size_t)j * B + u];
            const float *yj = Y + (size_t)j * D;
            for (uint32_t d = 0; d < D; d++)
                rec[d] = kvt__sigma_leaf_step(rec[d], c, yj[d]);
        }
        for (uint32_t d = 0; d < D; d++)
            r[d] = kvt__sigma_residual(kvt__sigma_branch_val(row, branch_offset, branch_dtype, d),
                                       rec[d]);
        sigma_out[u] = kvt__norm_fixed(r, D);
    }
}

KVT__FMA_CLONES
void kvt__branch_norm_cpu(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                          size_t slot_stride_bytes, uint32_t branch_offset, int branch_dtype,
                          uint32_t branch_dim, float *out) {
    for (uint32_t u = 0; u < n_rows; u++) {
        const uint8_t *row = row_at(base, slots, u, slot_stride_bytes);
        out[u] = kvt__elem_norm_fixed(row + branch_offset, branch_dtype, branch_dim);
    }
}

KVT__FMA_CLONES
void kvt__row_norm_cpu(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                       size_t slot_stride_bytes, int dtype, uint32_t n_values, float *out) {
    for (uint32_t u = 0; u < n_rows; u++) {
        const uint8_t *row = row_at(base, slots, u, slot_stride_bytes);
        out[u] = kvt__elem_norm_fixed(row, dtype, n_values);
    }
}
