/*
 * q8_plane.c — the 8-bit planes of a closed block's rows on the CPU (recall_scan.h, "The 8-bit
 * scan"; docs/recall.md §3.3): kvt__recall_q8_row for every row of the block, the close's last
 * piece of work at params.recall_scan_bits 8.
 *
 * Row by row, kvt__recall_q8_row spends 0.5–0.9 µs on 152 B of output: two loops per part (the max,
 * then the rounding), fp16 values widened one at a time, and above all the rounding-error sum
 * e2 += d·d in double, one dependent addition per value (4 cycles each, 128 a row). The SIMD
 * paths compute the same operations in the same order, laid out differently:
 *   1. per row, along its values (8 or 16 lanes): the widening (the bf16 shift, F16C for the
 *      sketch — both exact), max|x| and the finiteness test (order-free: a max of non-NaN values;
 *      any non-finite value takes the part's non-finite branch whatever the lanes hold), then
 *      r = (x·inv + 1.5·2^23) − 1.5·2^23 clamped, q, the bytes q + 128, Σq² (an integer: exact
 *      in any order; Σq, which the row's plane does not keep, is not formed), and each value's
 *      d² = (x − t·r)² in double (element-wise: no order);
 *   2. across the rows of a tile of 8 (one lane a row, gathers from the d² rows), the sum e2 of
 *      each part, value after value from 0 in ascending order: kvt__recall_q8_quant's additions
 *      exactly, in every lane;
 *   3. per row, the scalars as there: t, e = (float)sqrt(e2)·slack, ‖t·q‖, the non-finite fixups.
 * So every byte and float of the plane is the per-element function's (tests/test_recall_scan.c
 * compares them on the edge rows of the q8 tests). The paths need parts (branch_dim, sk_width)
 * that are whole vectors (multiples of 8; 16 for AVX-512) and are chosen at run time by the CPU
 * (kvt__recall_q8_rows_level), as the scan's VNNI/AVX2 dots are.
 */
#include "recall/kernels/recall_scan.h"

#include "kernels/sigma.h"

#include <math.h>
#include <string.h>

/* Rows whose error sums run together (lanes of the gathers). */
#define Q8_TILE 8u

size_t kvt__recall_q8_rows_scratch_floats(uint32_t branch_dim, uint32_t sk_width) {
    /* the reference's tmp; the tile's values [Q8_TILE][L] fp32 and their d² [Q8_TILE][L] fp64
     * (L = branch_dim + sk_width), two floats for the fp64 alignment */
    const size_t L = (size_t)branch_dim + sk_width;
    return L + 3u * Q8_TILE * L + 2u;
}

/* The per-element function row by row: the reference, and the path where no SIMD one applies. */
static void rows_ref(const uint8_t *base, const int32_t *slots, uint32_t n, size_t slot_stride,
                     uint32_t branch_offset, int branch_dtype, uint32_t branch_dim, uint16_t *csk,
                     size_t csk_stride, uint32_t sk_width, float *tmp) {
    for (uint32_t u = 0; u < n; u++) {
        uint16_t *c = csk + (size_t)u * csk_stride;
        kvt__recall_q8_row(base + (size_t)slots[u] * slot_stride, branch_offset, branch_dtype,
                           branch_dim, c, sk_width, tmp, (uint8_t *)(c + sk_width));
    }
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define Q8_SIMD 1
#define AVX2_FN __attribute__((target("avx2,f16c")))
#define AVX512_FN __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl")))

/* What step 1 leaves of one part of one row for step 3. */
typedef struct part_out {
    float t;    /* the scale m/127 */
    int fin;    /* every value finite */
    int32_t q2; /* Σ q² */
} part_out;

/* The scalar tail shared by both paths: the scale from the max (kvt__recall_q8_quant's). */
static inline void scale_of(float m, float *t, float *inv) {
    *t = m / 127.0f;
    *inv = m > 0.0f ? 127.0f / m : 0.0f;
}

/* Row u's values of the tile: the branch (bf16 by the shift, other dtypes by the per-element
 * loads), then the fp16 sketch widened by F16C (exact, as kvt__f16_to_f32). */
AVX2_FN static void load_row(const uint8_t *row, uint32_t branch_offset, int branch_dtype,
                             uint32_t branch_dim, const uint16_t *c, uint32_t sk_width, float *x) {
    if (branch_dtype == KVT__DT_BF16) {
        for (uint32_t j = 0; j < branch_dim; j += 8u) {
            const __m256i b = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(row + branch_offset + 2u * j)));
            _mm256_storeu_si256((__m256i *)(x + j), _mm256_slli_epi32(b, 16));
        }
    } else {
        for (uint32_t j = 0; j < branch_dim; j++)
            x[j] = kvt__sigma_branch_val(row, branch_offset, branch_dtype, j);
    }
    for (uint32_t k = 0; k < sk_width; k += 8u)
        _mm256_storeu_ps(x + branch_dim + k,
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + k))));
}

/* Step 1 of one part (n values x, a multiple of 8): bytes to out, d² to dd. */
AVX2_FN static part_out part_avx2(const float *x, uint32_t n, uint8_t *out, double *dd) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4028235e38f);
    __m256 m = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (uint32_t i = 0; i < n; i += 8u) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));
        m = _mm256_max_ps(a, m);
    }
    part_out o = {0.0f, _mm256_movemask_ps(ok) == 0xff, 0};
    if (!o.fin) {
        memset(out, 128, n);
        return o;
    }
    float mv[8], inv;
    _mm256_storeu_ps(mv, m);
    float mx = 0.0f;
    for (int k = 0; k < 8; k++)
        mx = mv[k] > mx ? mv[k] : mx;
    scale_of(mx, &o.t, &inv);
    const __m256 vinv = _mm256_set1_ps(inv), C = _mm256_set1_ps(12582912.0f);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256d td = _mm256_set1_pd((double)o.t);
    __m256i q2 = _mm256_setzero_si256();
    const __m256i off = _mm256_set1_epi32(128);
    for (uint32_t i = 0; i < n; i += 8u) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xv, vinv), C), C);
        r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q)); /* NaN (0·Inf): 0 */
        r = _mm256_max_ps(_mm256_min_ps(r, hi), lo);
        const __m256i q = _mm256_cvttps_epi32(r);
        q2 = _mm256_add_epi32(q2, _mm256_mullo_epi32(q, q));
        const __m256i b = _mm256_add_epi32(q, off);
        const __m128i w =
            _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storel_epi64((__m128i *)(out + i), _mm_packus_epi16(w, w));
        for (int h = 0; h < 2; h++) {
            const __m128 xs = h ? _mm256_extractf128_ps(xv, 1) : _mm256_castps256_ps128(xv);
            const __m128 rs = h ? _mm256_extractf128_ps(r, 1) : _mm256_castps256_ps128(r);
            const __m256d d =
                _mm256_sub_pd(_mm256_cvtps_pd(xs), _mm256_mul_pd(td, _mm256_cvtps_pd(rs)));
            _mm256_storeu_pd(dd + i + 4u * h, _mm256_mul_pd(d, d));
        }
    }
    int32_t qv[8];
    _mm256_storeu_si256((__m256i *)qv, q2);
    for (int k = 0; k < 8; k++)
        o.q2 += qv[k];
    return o;
}

/* The upper 8 floats of a zmm (AVX-512F alone: no DQ's extractf32x8). */
AVX512_FN static inline __m256 hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* Step 1 with 16 lanes (n a multiple of 16). */
AVX512_FN static part_out part_avx512(const float *x, uint32_t n, uint8_t *out, double *dd) {
    const __m512 big = _mm512_set1_ps(3.4028235e38f);
    __m512 m = _mm512_setzero_ps();
    __mmask16 ok = 0xffff;
    for (uint32_t i = 0; i < n; i += 16u) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        ok &= _mm512_cmp_ps_mask(a, big, _CMP_LE_OQ);
        m = _mm512_max_ps(a, m);
    }
    part_out o = {0.0f, ok == 0xffff, 0};
    if (!o.fin) {
        memset(out, 128, n);
        return o;
    }
    float inv;
    scale_of(_mm512_reduce_max_ps(m), &o.t, &inv);
    const __m512 vinv = _mm512_set1_ps(inv), C = _mm512_set1_ps(12582912.0f);
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512d td = _mm512_set1_pd((double)o.t);
    __m512i q2 = _mm512_setzero_si512();
    const __m512i off = _mm512_set1_epi32(128);
    for (uint32_t i = 0; i < n; i += 16u) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xv, vinv), C), C);
        r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r); /* NaN (0·Inf): 0 */
        r = _mm512_max_ps(_mm512_min_ps(r, hi), lo);
        const __m512i q = _mm512_cvttps_epi32(r);
        q2 = _mm512_add_epi32(q2, _mm512_mullo_epi32(q, q));
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, off)));
        for (int h = 0; h < 2; h++) {
            const __m256 xs = h ? hi256(xv) : _mm512_castps512_ps256(xv);
            const __m256 rs = h ? hi256(r) : _mm512_castps512_ps256(r);
            const __m512d d =
                _mm512_sub_pd(_mm512_cvtps_pd(xs), _mm512_mul_pd(td, _mm512_cvtps_pd(rs)));
            _mm512_storeu_pd(dd + i + 8u * h, _mm512_mul_pd(d, d));
        }
    }
    o.q2 = _mm512_reduce_add_epi32(q2);
    return o;
}

/* Step 2: e2[u] = Σ dd[u·L + i], i = 0 .. n ascending from +0, for the tile's rows (one lane a
 * row; rows past nr read row nr − 1's, discarded). */
AVX2_FN static void sums_avx2(const double *dd, size_t L, uint32_t n, uint32_t nr, double *e2) {
    int32_t ix[Q8_TILE];
    for (uint32_t u = 0; u < Q8_TILE; u++)
        ix[u] = (int32_t)((u < nr ? u : nr - 1u) * L);
    const __m128i i0 = _mm_loadu_si128((const __m128i *)ix);
    const __m128i i1 = _mm_loadu_si128((const __m128i *)(ix + 4));
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    for (uint32_t i = 0; i < n; i++) {
        s0 = _mm256_add_pd(s0, _mm256_i32gather_pd(dd + i, i0, 8));
        s1 = _mm256_add_pd(s1, _mm256_i32gather_pd(dd + i, i1, 8));
    }
    _mm256_storeu_pd(e2, s0);
    _mm256_storeu_pd(e2 + 4, s1);
}

AVX512_FN static void sums_avx512(const double *dd, size_t L, uint32_t n, uint32_t nr, double *e2) {
    int32_t ix[Q8_TILE];
    for (uint32_t u = 0; u < Q8_TILE; u++)
        ix[u] = (int32_t)((u < nr ? u : nr - 1u) * L);
    const __m256i iv = _mm256_loadu_si256((const __m256i *)ix);
    __m512d s = _mm512_setzero_pd();
    for (uint32_t i = 0; i < n; i++)
        s = _mm512_add_pd(s, _mm512_i32gather_pd(iv, dd + i, 8));
    _mm512_storeu_pd(e2, s);
}

/* Steps 1–3 over the rows, a tile at a time (level 2: AVX-512, 1: AVX2). */
AVX2_FN static void rows_simd(int level, const uint8_t *base, const int32_t *slots, uint32_t n,
                              size_t slot_stride, uint32_t branch_offset, int branch_dtype,
                              uint32_t branch_dim, uint16_t *csk, size_t csk_stride,
                              uint32_t sk_width, float *scratch) {
    const float slack = 1.0f + 0.00390625f;
    const uint32_t L = branch_dim + sk_width, len = kvt__recall_q8_len(branch_dim, sk_width);
    float *xs = scratch + L;
    uintptr_t p = (uintptr_t)(xs + (size_t)Q8_TILE * L);
    double *dd = (double *)((p + 7u) & ~(uintptr_t)7u);
    for (uint32_t u0 = 0; u0 < n; u0 += Q8_TILE) {
        const uint32_t nr = n - u0 < Q8_TILE ? n - u0 : Q8_TILE;
        part_out po[Q8_TILE][2];
        for (uint32_t k = 0; k < nr; k++) {
            const uint16_t *c = csk + (size_t)(u0 + k) * csk_stride;
            uint8_t *v = (uint8_t *)(c + sk_width) + 4u * KVT__Q8_FLOATS;
            float *x = xs + (size_t)k * L;
            double *d = dd + (size_t)k * L;
            load_row(base + (size_t)slots[u0 + k] * slot_stride, branch_offset, branch_dtype,
                     branch_dim, c, sk_width, x);
            if (level == 2) {
                po[k][0] = part_avx512(x, branch_dim, v, d);
                po[k][1] = part_avx512(x + branch_dim, sk_width, v + branch_dim, d + branch_dim);
            } else {
                po[k][0] = part_avx2(x, branch_dim, v, d);
                po[k][1] = part_avx2(x + branch_dim, sk_width, v + branch_dim, d + branch_dim);
            }
            for (uint32_t i = L; i < len; i++)
                v[i] = 128u;
        }
        double e2[2][Q8_TILE];
        if (level == 2) {
            sums_avx512(dd, L, branch_dim, nr, e2[0]);
            sums_avx512(dd + branch_dim, L, sk_width, nr, e2[1]);
        } else {
            sums_avx2(dd, L, branch_dim, nr, e2[0]);
            sums_avx2(dd + branch_dim, L, sk_width, nr, e2[1]);
        }
        for (uint32_t k = 0; k < nr; k++) {
            float f[KVT__Q8_FLOATS];
            for (int h = 0; h < 2; h++) { /* kvt__recall_q8_quant's results */
                const part_out *o = &po[k][h];
                f[h] = o->fin ? o->t : NAN;
                f[2 + 2 * h] = o->fin ? (float)sqrt(e2[h][k]) * slack : INFINITY;
                f[3 + 2 * h] = o->fin ? o->t * sqrtf((float)o->q2) * slack : 0.0f;
            }
            if (!(f[0] == f[0]) || !(f[1] == f[1])) { /* kvt__recall_q8_row's fixup */
                f[0] = f[1] = 0.0f;
                f[2] = f[4] = INFINITY;
            }
            uint8_t *out = (uint8_t *)(csk + (size_t)(u0 + k) * csk_stride + sk_width);
            for (uint32_t i = 0; i < KVT__Q8_FLOATS; i++) { /* little-endian, as there */
                const uint32_t b = kvt__bits_from_f32(f[i]);
                for (uint32_t j = 0; j < 4u; j++)
                    out[4u * i + j] = (uint8_t)(b >> (8u * j));
            }
        }
    }
}
#endif

#ifdef Q8_SIMD
#include <cpuid.h>
/* F16C (CPUID.1:ECX bit 29; clang's __builtin_cpu_supports does not know the name). */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1u);
}
#endif

static int q8_rows_max_level = 2;

int kvt__recall_q8_rows_level(int enable) {
    if (enable >= 0)
        q8_rows_max_level = enable;
#ifdef Q8_SIMD
    const int f16c = has_f16c();
    const int cpu = f16c && __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
                        ? 2
                    : f16c && __builtin_cpu_supports("avx2") ? 1
                                                             : 0;
    return cpu < q8_rows_max_level ? cpu : q8_rows_max_level;
#else
    return 0;
#endif
}

void kvt__recall_q8_rows_cpu(const uint8_t *base, const int32_t *slots, uint32_t n,
                             size_t slot_stride, uint32_t branch_offset, int branch_dtype,
                             uint32_t branch_dim, uint16_t *csk, size_t csk_stride,
                             uint32_t sk_width, float *scratch) {
#ifdef Q8_SIMD
    int level = kvt__recall_q8_rows_level(-1);
    if (level == 2 && (branch_dim % 16u || sk_width % 16u))
        level = 1;
    if (level >= 1 && branch_dim % 8u == 0 && sk_width % 8u == 0) {
        rows_simd(level, base, slots, n, slot_stride, branch_offset, branch_dtype, branch_dim, csk,
                  csk_stride, sk_width, scratch);
        return;
    }
#endif
    rows_ref(base, slots, n, slot_stride, branch_offset, branch_dtype, branch_dim, csk, csk_stride,
             sk_width, scratch);
}
