/*
 * recall_scan.c — CPU twin of the recall scan (recall_scan.h for the math and its fixed
 * orders). The loops only arrange the KVT_HD functions: a CUDA kernel over the same functions
 * (one thread per (row, head), an OR over heads, a compaction of fired rows in row order) gives
 * the same fired set. Two arrangements: the row-wise scan (one row against every head) and, on
 * x86-64 with AVX2 and FMA, the tiled scan (a GEMM over chunks of rows × heads; each vector lane
 * performs one (row, head) chain's fused multiply-adds, and the triggers' operations, in the
 * per-element functions' order, so the bits are theirs — tests/test_recall_scan.c).
 */
#define _DEFAULT_SOURCE /* syscall (the AMX permission, level 3 of the 8-bit scan) */
#include "recall/kernels/recall_scan.h"

#include "kernels/backend.h"
#include "lib/base/base.h"

#include <stdlib.h>
#include <string.h>

/* Per head: rank projection values, then the kvt__recall_head fields. */
#define HEAD_FLOATS(rank) ((size_t)(rank) + 5u)
/* Heads whose idx chains advance together (independent chains: one vector instruction). */
#define SCAN_TILE 8u
/* Archived rows the tiled scan evaluates together (a multiple of its row tiles, 6 and 2). */
#define CHUNK_ROWS 48u

/* The 8-bit scan's scratch (kvt__recall_scan_prep's q8 fields): the heads' values [10][HP]
 * (tb ts Qb Qs Eb Es Nb Ns, then −128·sb and −128·ss as int32: the SIMD dots' correction), their
 * vectors [HP][len] and the packing of the SIMD dots (VNNI, AMX: s8 [len / 4][HQ][4]; AVX2: s16
 * [len / 2][HQ][2]; HQ: HP rounded up to 16; len <= KVT__RECALL_MAX_BRANCH +
 * KVT__SKETCH_MAX_RANK bytes each), the quantiser's tmp and the AVX2 dots' widened rows. */
#define Q8_MAX_LEN (KVT__RECALL_MAX_BRANCH + KVT__SKETCH_MAX_RANK)
#define Q8_FLOATS(HP)                                                                              \
    (10u * (HP) + (3u * (HP) + 32u) * (Q8_MAX_LEN / 4u) + Q8_MAX_LEN +                             \
     CHUNK_ROWS * Q8_MAX_LEN / 2u + Q8_PF_N * (HP))
/* The conformal 8-bit trigger's screen (q8_screen_tables): per head ca, cc, α, β, γ, δ, w. */
#define Q8_PF_N 7u
/* Heads of the VNNI packing: whole zmm vectors of 16. */
#define Q8_HQ(HP) (((HP) + 15u) / 16u * 16u)

/* Heads rounded up to whole tiles. */
static size_t heads_padded(uint32_t n_heads) {
    return ((size_t)n_heads + SCAN_TILE - 1) / SCAN_TILE * SCAN_TILE;
}

size_t kvt__recall_scan_scratch_floats(uint32_t n_heads, uint32_t rank, uint32_t D) {
    /* heads' q̃_sk and fields; their preparation's scratch; the transposed queries [branch +
     * rank][padded heads]; the row's branch and sketch as fp32; the row-wise scan's chains
     * [2][padded heads]; the tiled scan's chunk: its rows' embeddings [CHUNK_ROWS][branch +
     * rank], their chains [2][CHUNK_ROWS][padded heads], and per head s·‖q̃_res‖ and the
     * threshold [2][padded] */
    const size_t HP = heads_padded(n_heads);
    return (size_t)n_heads * HEAD_FLOATS(rank) + KVT__RECALL_HEADS_PREP_FLOATS(D, rank) +
           HP * (KVT__RECALL_MAX_BRANCH + rank) + KVT__RECALL_MAX_BRANCH + rank + 2u * HP +
           (size_t)CHUNK_ROWS * (KVT__RECALL_MAX_BRANCH + rank) + 2u * CHUNK_ROWS * HP + 2u * HP +
           Q8_FLOATS(HP);
}

/* kvt__f16_to_f32 without branches (so a loop of it vectorises), exact for every input: the
 * exponent is rebiased in the integer domain; zero and subnormal inputs are finished by one exact
 * fp32 subtraction; Inf and NaN get the all-ones exponent (the NaN payload kept, as there). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t e = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    o += e == 0x0f800000u ? (uint32_t)(128 - 16) << 23 : 0u;
    /* zero or subnormal: 2^-14 · (1 + m/1024) − 2^-14, exact; the result is selected by bits, so
     * no arithmetic touches the other inputs (a signalling NaN stays as kvt__f16_to_f32 gives it) */
    float fsub = kvt__f32_from_bits(o + (1u << 23)) - kvt__f32_from_bits(113u << 23);
    uint32_t bits = e == 0u ? kvt__bits_from_f32(fsub) : o;
    return kvt__f32_from_bits(bits | ((uint32_t)(h & 0x8000u) << 16));
}

/* Every 16-bit pattern converts as kvt__f16_to_f32 does (tests/test_recall_scan.c). */
float kvt__recall_f16_fast(uint16_t h) {
    return f16_to_f32(h);
}

/* kvt__recall_head_prep with the residual's loops interchanged: element d still sees its chain
 * over k ascending from +0 (kvt__recall_resid), but the D chains advance together over V's
 * contiguous rows instead of striding through V once per element. */
KVT__FMA_CLONES
static void head_prep(const float *q, uint32_t D, const float *V, uint32_t rank, float *q_sk,
                      float *tmp, kvt__recall_head *h) {
    /* q̃_sk[k] = kvt__sketch_coef(q, D, V_k): eight coefficients' chains advance together (one
     * chain at a time waits on each fused multiply-add's latency), each over d ascending from +0
     * with kvt__sketch_coef_step, so every coefficient has the per-element function's bits. */
    uint32_t k0 = 0;
    for (; k0 + 8u <= rank; k0 += 8u) {
        float c[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        const float *V0 = V + (size_t)k0 * D;
        for (uint32_t d = 0; d < D; d++)
            for (uint32_t i = 0; i < 8u; i++)
                c[i] = kvt__sketch_coef_step(c[i], q[d], V0[(size_t)i * D + d]);
        for (uint32_t i = 0; i < 8u; i++)
            q_sk[k0 + i] = c[i];
    }
    for (uint32_t k = k0; k < rank; k++)
        q_sk[k] = kvt__sketch_coef(q, D, V + (size_t)k * D);
    for (uint32_t d = 0; d < D; d++)
        tmp[d] = 0.0f;
    for (uint32_t k = 0; k < rank; k++) {
        const float c = q_sk[k];
        const float *Vk = V + (size_t)k * D;
        for (uint32_t d = 0; d < D; d++)
            tmp[d] = fmaf(c, Vk[d], tmp[d]);
    }
    for (uint32_t d = 0; d < D; d++)
        tmp[d] = q[d] - tmp[d];
    kvt__recall_head_finish(q, D, rank, q_sk, tmp, h);
}

/* ---------------------------------------------------------------------------------------------
 * The heads' preparation across heads (kvt__recall_heads_prep_cpu). W heads share a vector, one
 * head a lane (W = 16 on AVX-512, 8 on AVX2 + FMA), from their latents transposed (a gather a d):
 * qT[d][w] = q_lat[d] of head w (padding lanes zero). Per lane, so per head, every operation is
 * the scalar function's, in its order:
 *   projection  q̃_sk[k] = the chain fmaf(q[d], V[k][d], ·) over d ascending from +0
 *               (kvt__sketch_coef's); eight k's advance together, one vector instruction each a
 *               step, into skT[k][w];
 *   residual    q̃_res[d] = q[d] − the chain fmaf(q̃_sk[k], V[k][d], ·) over k ascending from +0
 *               (kvt__recall_resid's); W d's advance together (a cache line of each V row);
 *   norms       kvt__norm_fixed's: partial l = the chain fmaf(x[i], x[i], ·) over i = l, l + 32,
 *               .. ascending from +0 (each residual element goes into its partial as soon as it is
 *               made, in ascending d), then the stride-halving tree (s = 16 .. 1: p[i] + p[i + s])
 *               and sqrtf (vector or scalar: both correctly rounded);
 * and kvt__recall_head_bounds on the three norms. Lanes never mix, so which heads share a vector
 * changes no bit (tests/test_recall_scan.c, at every level).
 * ------------------------------------------------------------------------------------------- */
/* The widest level's heads a vector (KVT__RECALL_HEADS_PREP_FLOATS: qT, skT and the partials). */
#define PREP_LANES 16u

/* The vector kernels of one level (VEC, W lanes, and ZERO, LD, ST, FMA, SET1, SUB defined around
 * it): proj (the projection into skT [rank][W], eight k's a pass over d), resid (the residual, W
 * d's a pass over k, each element then straight into its norm partial: part [32][W]; XD lists
 * the W accumulators) and sumsq (x [n][W] into the partials). Named accumulators: the chains
 * must stay in registers. */
#define PREP_X8(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define PREP_X16(M) PREP_X8(M) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define PREP_DECL(i) VEC c##i = ZERO();
#define PREP_PROJ(i) c##i = FMA(x, SET1(v[(size_t)(i) * D + d]), c##i);
#define PREP_PUT(i) ST(skT + (size_t)(k0 + (i)) * W, c##i);
#define PREP_RESID(i) c##i = FMA(sk, SET1(v[i]), c##i);
#define PREP_KEEP(i) r[i] = c##i;
#define PREP_KERNELS(SUF, ATTR, XD)                                                                \
    ATTR static void proj_##SUF(const float *qT, uint32_t D, const float *V, uint32_t rank,       \
                                float *skT) {                                                      \
        uint32_t k0 = 0;                                                                           \
        for (; k0 + 8u <= rank; k0 += 8u) {                                                        \
            const float *v = V + (size_t)k0 * D;                                                   \
            PREP_X8(PREP_DECL)                                                                     \
            for (uint32_t d = 0; d < D; d++) {                                                     \
                const VEC x = LD(qT + (size_t)d * W);                                              \
                PREP_X8(PREP_PROJ)                                                                 \
            }                                                                                      \
            PREP_X8(PREP_PUT)                                                                      \
        }                                                                                          \
        for (; k0 < rank; k0++) {                                                                  \
            VEC c = ZERO();                                                                        \
            for (uint32_t d = 0; d < D; d++)                                                       \
                c = FMA(LD(qT + (size_t)d * W), SET1(V[(size_t)k0 * D + d]), c);                   \
            ST(skT + (size_t)k0 * W, c);                                                           \
        }                                                                                          \
    }                                                                                              \
    ATTR static void resid_##SUF(const float *qT, uint32_t D, const float *V, uint32_t rank,      \
                                 const float *skT, float *part) {                                  \
        for (uint32_t d0 = 0; d0 < D; d0 += W) {                                                   \
            const uint32_t nd = D - d0 < W ? D - d0 : W;                                           \
            VEC r[W];                                                                              \
            if (nd == W) {                                                                         \
                XD(PREP_DECL)                                                                      \
                for (uint32_t k = 0; k < rank; k++) {                                              \
                    const VEC sk = LD(skT + (size_t)k * W);                                        \
                    const float *v = V + (size_t)k * D + d0;                                       \
                    XD(PREP_RESID)                                                                 \
                }                                                                                  \
                XD(PREP_KEEP)                                                                      \
            } else {                                                                               \
                for (uint32_t i = 0; i < nd; i++) {                                                \
                    VEC c = ZERO();                                                                \
                    for (uint32_t k = 0; k < rank; k++)                                            \
                        c = FMA(LD(skT + (size_t)k * W), SET1(V[(size_t)k * D + d0 + i]), c);      \
                    r[i] = c;                                                                      \
                }                                                                                  \
            }                                                                                      \
            for (uint32_t i = 0; i < nd; i++) {                                                    \
                const VEC e = SUB(LD(qT + (size_t)(d0 + i) * W), r[i]);                            \
                float *p = part + ((d0 + i) % 32u) * W;                                            \
                ST(p, FMA(e, e, LD(p)));                                                           \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    ATTR static void sumsq_##SUF(const float *x, uint32_t n, float *part) {                        \
        for (uint32_t i = 0; i < n; i++) {                                                         \
            const VEC e = LD(x + (size_t)i * W);                                                   \
            float *p = part + (i % 32u) * W;                                                       \
            ST(p, FMA(e, e, LD(p)));                                                               \
        }                                                                                          \
    }

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define PREP_SIMD 1
/* The operations of a level of PREP_BITS (512 or 256): _mm512_loadu_ps or _mm256_loadu_ps, .. */
#define PREP_OP__(b, op) _mm##b##_##op
#define PREP_OP_(b, op) PREP_OP__(b, op)
#define PREP_VEC_(b) __m##b
#define PREP_VEC(b) PREP_VEC_(b)
#define VEC PREP_VEC(PREP_BITS)
#define ZERO PREP_OP_(PREP_BITS, setzero_ps)
#define LD PREP_OP_(PREP_BITS, loadu_ps)
#define ST PREP_OP_(PREP_BITS, storeu_ps)
#define FMA PREP_OP_(PREP_BITS, fmadd_ps)
#define SET1 PREP_OP_(PREP_BITS, set1_ps)
#define SUB PREP_OP_(PREP_BITS, sub_ps)
#define PREP_BITS 512
#define W 16u
PREP_KERNELS(512, __attribute__((target("avx512f"))), PREP_X16)
#undef PREP_BITS
#undef W
#define PREP_BITS 256
#define W 8u
PREP_KERNELS(256, __attribute__((target("avx2,fma"))), PREP_X8)
#undef PREP_BITS
#undef W
#undef VEC
#undef ZERO
#undef LD
#undef ST
#undef FMA
#undef SET1
#undef SUB

/* qT[d][w] = q[w·q_stride + d] for w < nh (a head's latent down its lane), padding lanes zero:
 * one masked gather a d (lanes past nh read nothing; q_stride < 2^27: the indices are int32). */
__attribute__((target("avx512f"))) static void lanes_512(const float *q, size_t q_stride,
                                                         uint32_t nh, uint32_t D, float *qT) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)q_stride));
    const __mmask16 m = (__mmask16)((1u << nh) - 1u);
    for (uint32_t d = 0; d < D; d++)
        _mm512_storeu_ps(qT + (size_t)d * 16u,
                         _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, q + d, 4));
}

__attribute__((target("avx2,fma"))) static void lanes_256(const float *q, size_t q_stride,
                                                          uint32_t nh, uint32_t D, float *qT) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)q_stride));
    const __m256 m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)nh), lane));
    for (uint32_t d = 0; d < D; d++)
        _mm256_storeu_ps(qT + (size_t)d * 8u,
                         _mm256_mask_i32gather_ps(_mm256_setzero_ps(), q + d, idx, m, 4));
}
#endif

#ifdef PREP_SIMD
/* The tree and sqrtf of partials [32][W] per lane (destroys part; kvt__tree32's adds). */
static void prep_tree(float *part, uint32_t W, float *out) {
    for (uint32_t s = 16u; s >= 1u; s >>= 1)
        for (uint32_t i = 0; i < s; i++)
            for (uint32_t w = 0; w < W; w++)
                part[i * W + w] = part[i * W + w] + part[(i + s) * W + w];
    for (uint32_t w = 0; w < W; w++)
        out[w] = sqrtf(part[w]);
}

/* Heads h0 .. h0 + W (those below n_heads) at level lv (1 or 2). */
static void prep_group(int lv, const float *q, size_t q_stride, uint32_t n_heads, uint32_t h0,
                       uint32_t D, const float *V, uint32_t rank, float *q_sk,
                       kvt__recall_head *heads, float *scratch) {
    const uint32_t W = lv == 2 ? 16u : 8u, nh = n_heads - h0 < W ? n_heads - h0 : W;
    float *qT = scratch, *skT = qT + (size_t)D * W, *part = skT + (size_t)rank * W;
    float nlat[PREP_LANES], nres[PREP_LANES], nsk[PREP_LANES];
    (lv == 2 ? lanes_512 : lanes_256)(q + h0 * q_stride, q_stride, nh, D, qT);
    void (*proj)(const float *, uint32_t, const float *, uint32_t, float *) =
        lv == 2 ? proj_512 : proj_256;
    void (*resid)(const float *, uint32_t, const float *, uint32_t, const float *, float *) =
        lv == 2 ? resid_512 : resid_256;
    void (*sumsq)(const float *, uint32_t, float *) = lv == 2 ? sumsq_512 : sumsq_256;
    proj(qT, D, V, rank, skT);
    memset(part, 0, sizeof(float) * 32u * W);
    sumsq(skT, rank, part);
    prep_tree(part, W, nsk);
    memset(part, 0, sizeof(float) * 32u * W);
    sumsq(qT, D, part);
    prep_tree(part, W, nlat);
    memset(part, 0, sizeof(float) * 32u * W);
    resid(qT, D, V, rank, skT, part);
    prep_tree(part, W, nres);
    for (uint32_t w = 0; w < nh; w++) {
        for (uint32_t k = 0; k < rank; k++)
            q_sk[(size_t)(h0 + w) * rank + k] = skT[(size_t)k * W + w];
        kvt__recall_head_bounds(nlat[w], nres[w], rank ? nsk[w] : 0.0f, D, rank, &heads[h0 + w]);
    }
}
#endif

static int prep_cap = 2;

int kvt__recall_prep_level(int enable) {
    if (enable >= 0)
        prep_cap = enable;
#ifdef PREP_SIMD
    const int cpu = !__builtin_cpu_supports("fma")      ? 0
                    : __builtin_cpu_supports("avx512f") ? 2
                    : __builtin_cpu_supports("avx2")    ? 1
                                                        : 0;
#else
    const int cpu = 0;
#endif
    return cpu < prep_cap ? cpu : prep_cap;
}

void kvt__recall_heads_prep_cpu(const float *q, size_t q_stride, uint32_t n_heads, uint32_t D,
                                const float *V, uint32_t rank, float *q_sk,
                                kvt__recall_head *heads, float *scratch) {
    const int lv = kvt__recall_prep_level(-1);
    KVT_ASSERT(q_stride < ((size_t)1 << 27)); /* the gathers' int32 indices */
#ifdef PREP_SIMD
    if (lv) {
        for (uint32_t h0 = 0; h0 < n_heads; h0 += lv == 2 ? 16u : 8u)
            prep_group(lv, q, q_stride, n_heads, h0, D, V, rank, q_sk, heads, scratch);
        return;
    }
#endif
    (void)lv;
    for (uint32_t h = 0; h < n_heads; h++)
        head_prep(q + h * q_stride, D, V, rank, q_sk + (size_t)h * rank, scratch, &heads[h]);
}

size_t kvt__recall_scan_heads_padded(uint32_t n_heads) {
    return heads_padded(n_heads);
}

/* The 8-bit scan's heads (kvt__recall_q8_head): values into p->q8f (SoA), vectors into p->q8v
 * (padding heads all 128: zero), and the packing of the level's dots: VNNI and AMX
 * p->q8p[j4][h][4] = the s8 values, AVX2 p->q8p as int16 [j2][h][2]. */
KVT__FMA_CLONES
static void q8_prep(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p, float *tmp) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim, H = a->n_heads, W = a->q8_off;
    const size_t HP = p->HP, qdim = (size_t)D + bd;
    const uint32_t len = kvt__recall_q8_len(bd, W);
    p->q8len = len;
    memset(p->q8p, 0, 2u * Q8_HQ(HP) * len); /* the packing's padding heads: zero */
    const int vnni = kvt__recall_scan_q8_level(-1) >= 2; /* the s8 packing (levels 2 and 3) */
    for (size_t h = 0; h < HP; h++) {
        kvt__recall_q8h q;
        uint8_t *v = p->q8v + h * len;
        if (h < H) {
            kvt__recall_q8_head(a->q + h * qdim, D, bd, p->q_sk + h * a->rank, a->rank, W, tmp, v,
                                &q);
        } else {
            memset(&q, 0, sizeof q);
            memset(v, 128, len);
        }
        const float f[8] = {q.tb, q.ts, q.Qb, q.Qs, q.Eb, q.Es, q.Nb, q.Ns};
        for (uint32_t i = 0; i < 8u; i++)
            p->q8f[i * HP + h] = f[i];
        const int32_t cb = -128 * q.sb, cs = -128 * q.ss; /* the u8 offset's correction */
        memcpy(p->q8f + 8u * HP + h, &cb, 4);
        memcpy(p->q8f + 9u * HP + h, &cs, 4);
        if (vnni)
            for (uint32_t j = 0; j < len; j++)
                p->q8p[((size_t)(j / 4u) * Q8_HQ(HP) + h) * 4u + j % 4u] = (uint8_t)(v[j] - 128u);
        else
            for (uint32_t j = 0; j < len; j++) {
                const int16_t w = (int16_t)((int32_t)v[j] - 128);
                memcpy(p->q8p + (((size_t)(j / 2u) * Q8_HQ(HP) + h) * 2u + j % 2u) * 2u, &w, 2);
            }
    }
}

/* Head h's values back as the struct the per-element functions take. */
static inline kvt__recall_q8h q8_head(const kvt__recall_scan_prep *p, size_t h) {
    const size_t HP = p->HP;
    kvt__recall_q8h q = {p->q8f[h], p->q8f[HP + h], p->q8f[2 * HP + h], p->q8f[3 * HP + h],
                         p->q8f[4 * HP + h], p->q8f[5 * HP + h], p->q8f[6 * HP + h],
                         p->q8f[7 * HP + h], 0, 0};
    int32_t cb, cs; /* rows 8, 9 hold −128·Σ q (the SIMD dots' correction) */
    memcpy(&cb, p->q8f + 8 * HP + h, 4);
    memcpy(&cs, p->q8f + 9 * HP + h, 4);
    q.sb = cb / -128;
    q.ss = cs / -128;
    return q;
}

kvt__recall_q8h kvt__recall_scan_q8h(const kvt__recall_scan_prep *p, size_t h) {
    return q8_head(p, h);
}

/* A closed row's 8-bit plane. */
static inline const uint8_t *q8_plane(const kvt__recall_scan_args *a, uint64_t row) {
    return (const uint8_t *)(kvt__scan_csk(a, row) + a->q8_off);
}

/* The 8-bit trigger of one row over heads 0 .. H, from its dots ib[h], is[h] (the
 * per-element functions, head by head until one fires). */
static int q8_row_trigger(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p,
                          const uint8_t *pl, const int32_t *ib, const int32_t *is, float rho) {
    for (uint32_t h = 0; h < a->n_heads; h++) {
        const kvt__recall_q8h q = q8_head(p, h);
        if (kvt__recall_q8_fires(&p->heads[h], &q, pl, ib[h], is[h], rho, a->scale, a->z,
                                 a->best[h], a->mode, a->latent_dim, a->branch_dim, a->rank))
            return 1;
    }
    return 0;
}

/* Does row fire in the 8-bit scan? (kvt__recall_q8_dots per head, then q8_row_trigger.) */
static int q8_row_fires(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p,
                        uint64_t row) {
    const uint8_t *pl = q8_plane(a, row);
    int32_t *ib = (int32_t *)p->tacc, *is = (int32_t *)p->tpa;
    for (uint32_t h = 0; h < a->n_heads; h++)
        kvt__recall_q8_dots(pl + 4u * KVT__Q8_FLOATS, p->q8v + (size_t)h * p->q8len,
                            a->branch_dim, p->q8len, &ib[h], &is[h]);
    return q8_row_trigger(a, p, pl, ib, is, *kvt__scan_rho(a, row));
}

void kvt__recall_scan_prep_cpu(const kvt__recall_scan_args *a, float *scratch,
                               kvt__recall_scan_prep *p) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim, rank = a->rank, H = a->n_heads;
    const size_t qdim = (size_t)D + bd, HP = heads_padded(H);
    /* scratch: q̃_sk of every head [H][rank], the heads [H] (5 floats each), tmp (the heads'
     * preparation's, KVT__RECALL_HEADS_PREP_FLOATS; the 8-bit quantiser has its own), then the
     * heads' branch queries and projections transposed, [bd + rank][HP] (padding heads zero),
     * then the row's branch [bd] and sketch [rank] as fp32 */
    p->q_sk = scratch;
    p->heads = (kvt__recall_head *)(scratch + (size_t)H * rank);
    float *tmp = scratch + (size_t)H * HEAD_FLOATS(rank);
    p->qT = tmp + KVT__RECALL_HEADS_PREP_FLOATS(D, rank);
    p->HP = HP;
    p->rb = p->qT + HP * (bd + rank);
    p->ck = p->rb + bd;
    p->acc = p->ck + rank;
    p->pa = p->acc + HP;
    p->X = p->pa + HP;
    p->tacc = p->X + (size_t)CHUNK_ROWS * (bd + rank);
    p->tpa = p->tacc + (size_t)CHUNK_ROWS * HP;
    p->snres = p->tpa + (size_t)CHUNK_ROWS * HP;
    p->tbest = p->snres + HP;
    p->q8f = p->tbest + HP;
    p->q8v = (uint8_t *)(p->q8f + 10u * HP);
    p->q8p = p->q8v + HP * Q8_MAX_LEN;
    p->q8len = 0;
    kvt__recall_heads_prep_cpu(a->q, qdim, H, D, a->basis, rank, p->q_sk, p->heads, tmp);
    if (a->q8_off)
        q8_prep(a, p, (float *)(p->q8p + 2u * Q8_HQ(HP) * Q8_MAX_LEN));
    p->q8x = (int16_t *)(p->q8p + 2u * Q8_HQ(HP) * Q8_MAX_LEN + 4u * Q8_MAX_LEN);
    p->q8pf = (float *)(p->q8x + (size_t)CHUNK_ROWS * Q8_MAX_LEN);
    p->q8pf_on = 0;
    for (size_t h = 0; h < HP; h++) {
        for (uint32_t j = 0; j < bd; j++)
            p->qT[j * HP + h] = h < H ? a->q[h * qdim + D + j] : 0.0f;
        for (uint32_t k = 0; k < rank; k++)
            p->qT[(bd + k) * HP + h] = h < H ? p->q_sk[h * rank + k] : 0.0f;
    }
}

/* The row's embedding x = [branch | f32(csk)] (bd + rank values) into x, as kvt__recall_idx
 * reads it; returns ‖csk‖ (kvt__recall_idx's n2 chain, then sqrtf) when sound, else 0. */
__attribute__((always_inline)) static inline float
load_row(const kvt__recall_scan_args *a, uint64_t row, float *x) {
    const uint32_t bd = a->branch_dim, rank = a->rank;
    const uint8_t *r =
        a->base +
        (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) * a->slot_stride;
    const uint16_t *csk = kvt__scan_csk(a, row);
    if (a->branch_dtype == KVT__DT_BF16) {
        const uint8_t *br = r + a->branch_offset;
        for (uint32_t j = 0; j < bd; j++) {
            uint16_t b;
            memcpy(&b, br + 2u * j, 2);
            x[j] = kvt__f32_from_bits((uint32_t)b << 16);
        }
    } else {
        for (uint32_t j = 0; j < bd; j++)
            x[j] = kvt__sigma_branch_val(r, a->branch_offset, a->branch_dtype, j);
    }
    float *ck = x + bd;
    for (uint32_t k = 0; k < rank; k++)
        ck[k] = f16_to_f32(csk[k]);
    if (a->mode != KVT__RECALL_SOUND)
        return 0.0f;
    float n2 = 0.0f;
    for (uint32_t k = 0; k < rank; k++)
        n2 = fmaf(ck[k], ck[k], n2);
    return sqrtf(n2);
}

/* The trigger of one row over columns 0 .. n of its chains acc, pa (column t is head hmap[t],
 * hmap NULL: head t): kvt__recall_sound_fires / the margin / kvt__recall_conformal_fires per
 * head, as the per-element functions compute them. */
__attribute__((always_inline)) static inline int
row_trigger(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p, const float *acc,
            const float *pa, const uint32_t *hmap, uint32_t n, float rho, float ncsk) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim, rank = a->rank;
    int fire = 0;
    if (a->mode == KVT__RECALL_SOUND) {
        for (uint32_t t = 0; t < n && !fire; t++) {
            const size_t h = hmap ? hmap[t] : t;
            const float idx = a->scale * acc[t];
            fire = kvt__recall_sound_fires(
                idx,
                kvt__recall_sound_margin(&p->heads[h], idx, pa[t], ncsk, rho, a->scale, a->z, D,
                                         bd, rank),
                a->best[h]);
        }
    } else if (a->mode == KVT__RECALL_MARGIN) {
        for (uint32_t t = 0; t < n; t++) {
            const size_t h = hmap ? hmap[t] : t;
            fire |= !(a->scale * acc[t] + a->z < a->best[h]);
        }
    } else {
        /* kvt__recall_conformal_fires(idx, kvt__recall_cert(...), z, best) per head, cert's
         * ((s·‖q̃_res‖)·ρ) / √(D − 64) in its own order */
        const float sqrt_dr = sqrtf((float)(D - 64u));
        for (uint32_t t = 0; t < n; t++) {
            const size_t h = hmap ? hmap[t] : t;
            const float idx = a->scale * acc[t];
            const float cert = a->scale * p->heads[h].nres * rho / sqrt_dr;
            fire |= !(idx + a->z * cert <= a->best[h]);
        }
    }
    return fire;
}

KVT__FMA_CLONES
int kvt__recall_row_fires_cpu(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p,
                              const float *qT, size_t HP, const uint32_t *hmap, uint32_t n,
                              uint64_t row) {
    const uint32_t bd = a->branch_dim, rank = a->rank;
    const int sound = a->mode == KVT__RECALL_SOUND;
    float *acc = p->acc, *pa = p->pa;
    /* The row once: branch and sketch as fp32 (rb, then ck = rb + bd); ‖csk‖ only where the
     * sound margin reads it. */
    const float ncsk = load_row(a, row, p->rb);
    const float *rb = p->rb, *ck = p->rb + bd;
    const float rho = *kvt__scan_rho(a, row);
    /* Every column's chains advance together, j outer (each head keeps kvt__recall_idx's order:
     * branch j ascending, then k ascending, from +0, so the bits are the per-element function's);
     * the |·| chain only in sound mode. */
    uint32_t t0 = 0;
    /* Whole tiles of 32 columns with their accumulators in registers (4 independent vector
     * chains: the j loop is not held up by one chain's latency), then the rest through memory. */
    for (; t0 + 32u <= n; t0 += 32u) {
        float A[32], Q[32];
        for (uint32_t t = 0; t < 32u; t++)
            A[t] = Q[t] = 0.0f;
        if (sound) {
            for (uint32_t j = 0; j < bd + rank; j++) {
                const float x = j < bd ? rb[j] : ck[j - bd], ax = fabsf(x);
                const float *qj = qT + j * HP + t0;
#pragma GCC unroll 32
                for (uint32_t t = 0; t < 32u; t++) {
                    A[t] = fmaf(qj[t], x, A[t]);
                    Q[t] = fmaf(fabsf(qj[t]), ax, Q[t]);
                }
            }
        } else {
            for (uint32_t j = 0; j < bd + rank; j++) {
                const float x = j < bd ? rb[j] : ck[j - bd];
                const float *qj = qT + j * HP + t0;
#pragma GCC unroll 32
                for (uint32_t t = 0; t < 32u; t++)
                    A[t] = fmaf(qj[t], x, A[t]);
            }
        }
        for (uint32_t t = 0; t < 32u; t++) {
            acc[t0 + t] = A[t];
            pa[t0 + t] = Q[t];
        }
    }
    for (uint32_t t = t0; t < n; t++)
        acc[t] = pa[t] = 0.0f;
    for (uint32_t j = 0; t0 < n && j < bd + rank; j++) {
        const float x = j < bd ? rb[j] : ck[j - bd];
        const float *qj = qT + j * HP;
        for (uint32_t t = t0; t < n; t++)
            acc[t] = fmaf(qj[t], x, acc[t]);
        if (sound) {
            const float ax = fabsf(x);
            for (uint32_t t = t0; t < n; t++)
                pa[t] = fmaf(fabsf(qj[t]), ax, pa[t]);
        }
    }
    return row_trigger(a, p, acc, pa, hmap, n, rho, ncsk);
}

/* ---------------------------------------------------------------------------------------------
 * The tiled scan (x86-64 with AVX2 and FMA): a GEMM over a chunk of archived rows × all heads.
 * A register tile of RT rows × 8·W heads holds RT·W vector accumulators, one lane per (row,
 * head) chain; the k loop runs over the embedding index j ascending, and each step is one
 * _mm256_fmadd_ps per accumulator: lane (r, h) computes fmaf(qT[j][h], x_r[j], acc) — the
 * correctly rounded fused multiply-add kvt__recall_idx's chain does, in its order, from +0. So
 * every (row, head) chain is bit for bit the per-element function's; tiling decides only which
 * chains share an instruction (tests/test_recall_scan.c compares the chains and the fired sets
 * with the row-wise scan and the per-element functions over random shapes).
 * ------------------------------------------------------------------------------------------- */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define SCAN_TILED 1
#define TILED_FN __attribute__((target("avx2,fma")))

/* Register tiles (explicit: the accumulators must stay in registers). Rows r0 .. r0 + RT of X
 * (stride J) × heads h0 .. h0 + 8·W of qT (stride HP): the idx chains into acc and, when sound,
 * the |·| chains into pa ([rows][HP] each). T_FMA(v, r, w): accumulator v of row r, vector w. */
#define T_ZERO(v) __m256 v = _mm256_setzero_ps()
#define T_X(r) const __m256 x##r = _mm256_broadcast_ss(X + (r0 + r) * J + j)
#define T_AX(r) const __m256 ax##r = _mm256_andnot_ps(sign, x##r) /* fabsf */
#define T_ST(v, r, w) _mm256_storeu_ps(out + (r0 + r) * HP + h0 + 8u * (w), v)

/* conformal and margin: 6 rows × 16 heads, 12 accumulators */
TILED_FN static void tile_6x16(const float *X, size_t J, const float *qT, size_t HP, size_t r0,
                               size_t h0, float *out) {
    T_ZERO(a00); T_ZERO(a01); T_ZERO(a10); T_ZERO(a11); T_ZERO(a20); T_ZERO(a21);
    T_ZERO(a30); T_ZERO(a31); T_ZERO(a40); T_ZERO(a41); T_ZERO(a50); T_ZERO(a51);
    for (size_t j = 0; j < J; j++) {
        const float *qj = qT + j * HP + h0;
        const __m256 q0 = _mm256_loadu_ps(qj), q1 = _mm256_loadu_ps(qj + 8);
        T_X(0); a00 = _mm256_fmadd_ps(q0, x0, a00); a01 = _mm256_fmadd_ps(q1, x0, a01);
        T_X(1); a10 = _mm256_fmadd_ps(q0, x1, a10); a11 = _mm256_fmadd_ps(q1, x1, a11);
        T_X(2); a20 = _mm256_fmadd_ps(q0, x2, a20); a21 = _mm256_fmadd_ps(q1, x2, a21);
        T_X(3); a30 = _mm256_fmadd_ps(q0, x3, a30); a31 = _mm256_fmadd_ps(q1, x3, a31);
        T_X(4); a40 = _mm256_fmadd_ps(q0, x4, a40); a41 = _mm256_fmadd_ps(q1, x4, a41);
        T_X(5); a50 = _mm256_fmadd_ps(q0, x5, a50); a51 = _mm256_fmadd_ps(q1, x5, a51);
    }
    T_ST(a00, 0, 0); T_ST(a01, 0, 1); T_ST(a10, 1, 0); T_ST(a11, 1, 1); T_ST(a20, 2, 0);
    T_ST(a21, 2, 1); T_ST(a30, 3, 0); T_ST(a31, 3, 1); T_ST(a40, 4, 0); T_ST(a41, 4, 1);
    T_ST(a50, 5, 0); T_ST(a51, 5, 1);
}

/* conformal and margin: 6 rows × the last 8 heads */
TILED_FN static void tile_6x8(const float *X, size_t J, const float *qT, size_t HP, size_t r0,
                              size_t h0, float *out) {
    T_ZERO(a00); T_ZERO(a10); T_ZERO(a20); T_ZERO(a30); T_ZERO(a40); T_ZERO(a50);
    for (size_t j = 0; j < J; j++) {
        const __m256 q0 = _mm256_loadu_ps(qT + j * HP + h0);
        T_X(0); a00 = _mm256_fmadd_ps(q0, x0, a00);
        T_X(1); a10 = _mm256_fmadd_ps(q0, x1, a10);
        T_X(2); a20 = _mm256_fmadd_ps(q0, x2, a20);
        T_X(3); a30 = _mm256_fmadd_ps(q0, x3, a30);
        T_X(4); a40 = _mm256_fmadd_ps(q0, x4, a40);
        T_X(5); a50 = _mm256_fmadd_ps(q0, x5, a50);
    }
    T_ST(a00, 0, 0); T_ST(a10, 1, 0); T_ST(a20, 2, 0); T_ST(a30, 3, 0); T_ST(a40, 4, 0);
    T_ST(a50, 5, 0);
}

/* sound: 2 rows × 16 heads, the idx (a) and |·| (p) chains, 8 accumulators */
TILED_FN static void tile_2x16s(const float *X, size_t J, const float *qT, size_t HP, size_t r0,
                                size_t h0, float *out, float *pout) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    T_ZERO(a00); T_ZERO(a01); T_ZERO(a10); T_ZERO(a11);
    T_ZERO(p00); T_ZERO(p01); T_ZERO(p10); T_ZERO(p11);
    for (size_t j = 0; j < J; j++) {
        const float *qj = qT + j * HP + h0;
        const __m256 q0 = _mm256_loadu_ps(qj), q1 = _mm256_loadu_ps(qj + 8);
        const __m256 b0 = _mm256_andnot_ps(sign, q0), b1 = _mm256_andnot_ps(sign, q1);
        T_X(0); T_AX(0);
        a00 = _mm256_fmadd_ps(q0, x0, a00); a01 = _mm256_fmadd_ps(q1, x0, a01);
        p00 = _mm256_fmadd_ps(b0, ax0, p00); p01 = _mm256_fmadd_ps(b1, ax0, p01);
        T_X(1); T_AX(1);
        a10 = _mm256_fmadd_ps(q0, x1, a10); a11 = _mm256_fmadd_ps(q1, x1, a11);
        p10 = _mm256_fmadd_ps(b0, ax1, p10); p11 = _mm256_fmadd_ps(b1, ax1, p11);
    }
    T_ST(a00, 0, 0); T_ST(a01, 0, 1); T_ST(a10, 1, 0); T_ST(a11, 1, 1);
    out = pout;
    T_ST(p00, 0, 0); T_ST(p01, 0, 1); T_ST(p10, 1, 0); T_ST(p11, 1, 1);
}

/* sound: 2 rows × the last 8 heads */
TILED_FN static void tile_2x8s(const float *X, size_t J, const float *qT, size_t HP, size_t r0,
                               size_t h0, float *out, float *pout) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    T_ZERO(a00); T_ZERO(a10); T_ZERO(p00); T_ZERO(p10);
    for (size_t j = 0; j < J; j++) {
        const __m256 q0 = _mm256_loadu_ps(qT + j * HP + h0);
        const __m256 b0 = _mm256_andnot_ps(sign, q0);
        T_X(0); T_AX(0);
        a00 = _mm256_fmadd_ps(q0, x0, a00); p00 = _mm256_fmadd_ps(b0, ax0, p00);
        T_X(1); T_AX(1);
        a10 = _mm256_fmadd_ps(q0, x1, a10); p10 = _mm256_fmadd_ps(b0, ax1, p10);
    }
    T_ST(a00, 0, 0); T_ST(a10, 1, 0);
    out = pout;
    T_ST(p00, 0, 0); T_ST(p10, 1, 0);
}

/* conformal and margin on AVX-512: 6 rows × 32 heads, 12 accumulators of 16 lanes (the same
 * fused multiply-add per lane as tile_6x16's, twice the heads an instruction) */
#define Z_ZERO(v) __m512 v = _mm512_setzero_ps()
#define Z_X(r) const __m512 x##r = _mm512_set1_ps(X[(r0 + r) * J + j])
#define Z_ST(v, r, w) _mm512_storeu_ps(out + (r0 + r) * HP + h0 + 16u * (w), v)
__attribute__((target("avx512f"))) static void tile_6x32(const float *X, size_t J,
                                                         const float *qT, size_t HP, size_t r0,
                                                         size_t h0, float *out) {
    Z_ZERO(a00); Z_ZERO(a01); Z_ZERO(a10); Z_ZERO(a11); Z_ZERO(a20); Z_ZERO(a21);
    Z_ZERO(a30); Z_ZERO(a31); Z_ZERO(a40); Z_ZERO(a41); Z_ZERO(a50); Z_ZERO(a51);
    for (size_t j = 0; j < J; j++) {
        const float *qj = qT + j * HP + h0;
        const __m512 q0 = _mm512_loadu_ps(qj), q1 = _mm512_loadu_ps(qj + 16);
        Z_X(0); a00 = _mm512_fmadd_ps(q0, x0, a00); a01 = _mm512_fmadd_ps(q1, x0, a01);
        Z_X(1); a10 = _mm512_fmadd_ps(q0, x1, a10); a11 = _mm512_fmadd_ps(q1, x1, a11);
        Z_X(2); a20 = _mm512_fmadd_ps(q0, x2, a20); a21 = _mm512_fmadd_ps(q1, x2, a21);
        Z_X(3); a30 = _mm512_fmadd_ps(q0, x3, a30); a31 = _mm512_fmadd_ps(q1, x3, a31);
        Z_X(4); a40 = _mm512_fmadd_ps(q0, x4, a40); a41 = _mm512_fmadd_ps(q1, x4, a41);
        Z_X(5); a50 = _mm512_fmadd_ps(q0, x5, a50); a51 = _mm512_fmadd_ps(q1, x5, a51);
    }
    Z_ST(a00, 0, 0); Z_ST(a01, 0, 1); Z_ST(a10, 1, 0); Z_ST(a11, 1, 1); Z_ST(a20, 2, 0);
    Z_ST(a21, 2, 1); Z_ST(a30, 3, 0); Z_ST(a31, 3, 1); Z_ST(a40, 4, 0); Z_ST(a41, 4, 1);
    Z_ST(a50, 5, 0); Z_ST(a51, 5, 1);
}

/* Whether tile_6x32 runs: the CPU has AVX-512F, and kvt__recall_scan_wide has not turned it off. */
static int wide_enabled = 1;

int kvt__recall_scan_wide(int enable) {
    if (enable >= 0)
        wide_enabled = enable;
    return wide_enabled && __builtin_cpu_supports("avx512f");
}

/* The chains of rows 0 .. nr of X (nr a multiple of the row tile: 6, or 2 when sound) against
 * every column of qT (HP a multiple of 8). */
TILED_FN static void tile_scores(const float *X, size_t J, const float *qT, size_t HP, size_t nr,
                                 int sound, float *acc, float *pa) {
    const int wide = !sound && kvt__recall_scan_wide(-1);
    for (size_t r0 = 0; r0 < nr; r0 += sound ? 2u : 6u) {
        size_t h0 = 0;
        if (wide)
            for (; h0 + 32u <= HP; h0 += 32u)
                tile_6x32(X, J, qT, HP, r0, h0, acc);
        if (sound) {
            for (; h0 + 16u <= HP; h0 += 16u)
                tile_2x16s(X, J, qT, HP, r0, h0, acc, pa);
            if (h0 < HP)
                tile_2x8s(X, J, qT, HP, r0, h0, acc, pa);
        } else {
            for (; h0 + 16u <= HP; h0 += 16u)
                tile_6x16(X, J, qT, HP, r0, h0, acc);
            if (h0 < HP)
                tile_6x8(X, J, qT, HP, r0, h0, acc);
        }
    }
}

/* The conformal (margin = 0) or margin (margin = 1) trigger of one row over columns 0 .. H of
 * acc (p->snres and p->tbest hold the columns' heads' values), eight lanes at a time: the scalar
 * row_trigger's operations, each one IEEE operation per lane in the same order
 * (((s·‖q̃_res‖)·ρ)/√(D−64), z·cert, idx + that, the compare; padding lanes masked). */
TILED_FN static int trigger_vec(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p,
                                const float *acc, uint32_t H, float rho, int margin) {
    const __m256 s = _mm256_set1_ps(a->scale), z = _mm256_set1_ps(a->z);
    const __m256 vr = _mm256_set1_ps(rho);
    const __m256 sq = _mm256_set1_ps(sqrtf((float)(a->latent_dim - 64u)));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int bits = 0;
    for (uint32_t h0 = 0; h0 < H; h0 += 8u) {
        const __m256 idx = _mm256_mul_ps(s, _mm256_loadu_ps(acc + h0));
        const __m256 best = _mm256_loadu_ps(p->tbest + h0);
        __m256 f;
        if (margin) { /* !(idx + z < best) */
            f = _mm256_cmp_ps(_mm256_add_ps(idx, z), best, _CMP_NLT_UQ);
        } else { /* !(idx + z·cert <= best) */
            const __m256 sn = _mm256_loadu_ps(p->snres + h0);
            const __m256 cert = _mm256_div_ps(_mm256_mul_ps(sn, vr), sq);
            f = _mm256_cmp_ps(_mm256_add_ps(idx, _mm256_mul_ps(z, cert)), best, _CMP_NLE_UQ);
        }
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(H - h0)), lane);
        bits |= _mm256_movemask_ps(_mm256_and_ps(f, _mm256_castsi256_ps(live)));
    }
    return bits != 0;
}

/* load_row with the conversions eight lanes at a time: bf16 by a shift, fp16 by f16_to_f32's
 * integer steps and its one exact subtraction, lane for lane (the same bits); fp32 and fp16
 * branches and the tails through load_row's scalar code. */
TILED_FN static float load_row_vec(const kvt__recall_scan_args *a, uint64_t row, float *x) {
    const uint32_t bd = a->branch_dim, rank = a->rank;
    if (a->branch_dtype != KVT__DT_BF16 || (bd | rank) & 7u || a->mode == KVT__RECALL_SOUND)
        return load_row(a, row, x);
    const uint8_t *br =
        a->base +
        (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) * a->slot_stride +
        a->branch_offset;
    const uint16_t *csk = kvt__scan_csk(a, row);
    for (uint32_t j = 0; j < bd; j += 8u) {
        const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(br + 2u * j)));
        _mm256_storeu_si256((__m256i *)(x + j), _mm256_slli_epi32(b, 16));
    }
    const __m256i m7fff = _mm256_set1_epi32(0x7fff), mexp = _mm256_set1_epi32(0x0f800000);
    const __m256i bias = _mm256_set1_epi32((127 - 15) << 23);
    const __m256i infb = _mm256_set1_epi32((128 - 16) << 23), one = _mm256_set1_epi32(1 << 23);
    const __m256 c113 = _mm256_castsi256_ps(_mm256_set1_epi32(113 << 23));
    const __m256i msign = _mm256_set1_epi32(0x8000), zero = _mm256_setzero_si256();
    for (uint32_t k = 0; k < rank; k += 8u) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(csk + k)));
        __m256i o = _mm256_slli_epi32(_mm256_and_si256(h, m7fff), 13);
        const __m256i e = _mm256_and_si256(o, mexp);
        o = _mm256_add_epi32(o, bias);
        o = _mm256_add_epi32(o, _mm256_and_si256(_mm256_cmpeq_epi32(e, mexp), infb));
        const __m256 fsub = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(o, one)), c113);
        const __m256i bits = _mm256_blendv_epi8(o, _mm256_castps_si256(fsub),
                                                _mm256_cmpeq_epi32(e, zero));
        const __m256i sg = _mm256_slli_epi32(_mm256_and_si256(h, msign), 16);
        _mm256_storeu_si256((__m256i *)(x + bd + k), _mm256_or_si256(bits, sg));
    }
    return 0.0f;
}

/* Closed rows ahead of the one being read whose branch and sketch are prefetched (the pool's
 * rows are 1152 B apart and the page table may scatter them: the loads would stall). */
#define PREFETCH_ROWS 16u
/* Listed rows ahead of the one being read that kvt__recall_rows_fire_cpu prefetches (4: 12 was
 * slower in the pruned scan of bench_decode). */
#define LIST_AHEAD 4u

static inline void prefetch_row(const kvt__recall_scan_args *a, uint64_t row) {
    const uint8_t *r =
        a->base +
        (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) * a->slot_stride +
        a->branch_offset;
    const uint8_t *c = (const uint8_t *)kvt__scan_csk(a, row);
    const uint32_t bb = a->branch_dtype == KVT__DT_FP32 ? 4u : 2u;
    for (uint32_t o = 0; o < a->branch_dim * bb; o += 64u)
        __builtin_prefetch(r + o);
    for (uint32_t o = 0; o < a->rank * 2u; o += 64u)
        __builtin_prefetch(c + o);
}

/* The columns' per-head values of the vectorised trigger: column t is head hmap[t] (NULL: t),
 * columns nc .. QP zero. */
static void column_tables(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                          const uint32_t *hmap, uint32_t nc, size_t QP) {
    for (size_t t = 0; t < QP; t++) {
        const size_t h = t < nc ? (hmap ? hmap[t] : t) : 0;
        /* s·‖q̃_res‖: the first product of row_trigger's cert, the same rounding */
        p->snres[t] = t < nc ? a->scale * p->heads[h].nres : 0.0f;
        p->tbest[t] = t < nc ? a->best[h] : 0.0f;
    }
}

/* Rows 0 .. n (<= CHUNK_ROWS) whose embeddings are in p->X and ‖csk‖ in ncsk: every (row, column)
 * chain by tile_scores against qT (stride QP), then each row's trigger over columns 0 .. nc
 * (column_tables set for them); fire[i] = 0/1. */
TILED_FN static void chunk_fire(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                                const float *qT, size_t QP, const uint32_t *hmap, uint32_t nc,
                                const uint64_t *rows, const float *ncsk, size_t n, uint8_t *fire) {
    const size_t J = (size_t)a->branch_dim + a->rank;
    const int sound = a->mode == KVT__RECALL_SOUND, margin = a->mode == KVT__RECALL_MARGIN;
    const size_t rt = sound ? 2u : 6u, nr = (n + rt - 1) / rt * rt;
    if (nr > n) /* padding rows: zero embeddings, their chains unread */
        memset(p->X + n * J, 0, sizeof(float) * (nr - n) * J);
    tile_scores(p->X, J, qT, QP, nr, sound, p->tacc, p->tpa);
    for (size_t i = 0; i < n; i++) {
        const float *acc = p->tacc + i * QP;
        const float rho = *kvt__scan_rho(a, rows[i]);
        fire[i] = (uint8_t)(sound ? row_trigger(a, p, acc, p->tpa + i * QP, hmap, nc, rho, ncsk[i])
                                  : trigger_vec(a, p, acc, nc, rho, margin));
    }
}

/* The full scan, tiled: chunks of CHUNK_ROWS archived rows ascending (each row's branch and
 * sketch prefetched PREFETCH_ROWS closed rows ahead), chunk_fire, fired rows in row order, at
 * most cap, stopping at the (cap + 1)-th as the row-wise scan does. */
TILED_FN static void scan_tiled(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p) {
    const size_t J = (size_t)a->branch_dim + a->rank;
    column_tables(a, p, NULL, a->n_heads, p->HP);
    uint64_t rows[CHUNK_ROWS];
    float ncsk[CHUNK_ROWS];
    uint8_t fire[CHUNK_ROWS];
    uint32_t count = 0, over = 0;
    uint64_t jk = 0, row = a->sinks;
    while (row < a->n_closed && !over) {
        size_t n = 0;
        for (; row < a->n_closed && n < CHUNK_ROWS; row++) {
            while (jk < a->m && a->kept[jk] < row)
                jk++;
            if (jk < a->m && a->kept[jk] == row)
                continue;
            if (row + PREFETCH_ROWS < a->n_closed)
                prefetch_row(a, row + PREFETCH_ROWS);
            rows[n] = row;
            ncsk[n] = load_row_vec(a, row, p->X + n * J);
            n++;
        }
        chunk_fire(a, p, p->qT, p->HP, NULL, a->n_heads, rows, ncsk, n, fire);
        for (size_t i = 0; i < n; i++) {
            if (!fire[i])
                continue;
            if (count == a->cap) {
                over = 1;
                break;
            }
            a->fired[count++] = (uint32_t)rows[i];
        }
    }
    *a->n_fired = count;
    *a->overflow = over;
}

/* ---------------------------------------------------------------------------------------------
 * The 8-bit scan on AVX-512 VNNI. A tile of 6 rows × 16 heads: per 4 bytes of the rows' vectors
 * one vpdpbusd per (row, part) adds u8(row)·s8(head) products into int32 lanes — exact, so the
 * dots equal kvt__recall_q8_dots' after the u8 offset's correction (−128·Σ q_head); the branch
 * and sketch parts in separate accumulators. The conformal trigger runs 16 heads a vector, each
 * lane kvt__recall_q8_fires' operations in its order; the other modes per head, scalar.
 * ------------------------------------------------------------------------------------------- */
#define VNNI_FN __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

static inline int32_t ld4(const uint8_t *b) {
    int32_t v;
    memcpy(&v, b, 4);
    return v;
}

/* Dots of rows x[0 .. 6) (vectors of len bytes; the branch's bd4 = branch_dim / 4 groups first)
 * against heads h0 .. h0 + 16 of the packing qp ([len / 4][HQ][4]) into ib, is ([rows][HP]):
 * Σ u8·s8 from the correction corr ([2][HP]: −128·Σ q of each head's branch, then sketch). */
VNNI_FN static void q8_tile(const uint8_t *const *x, const uint8_t *qp, const int32_t *corr,
                            size_t HQ, size_t HP, uint32_t bd4, uint32_t n4, size_t r0, size_t h0,
                            int32_t *ib, int32_t *is) {
    /* lanes past HP (the packing's padding heads) are not stored */
    const __mmask16 m = (__mmask16)(HP - h0 >= 16u ? 0xffffu : (1u << (HP - h0)) - 1u);
    /* the accumulators start at the u8 offset's correction −128·Σ q_head */
    __m512i b0 = _mm512_maskz_loadu_epi32(m, corr + h0), b1 = b0, b2 = b0, b3 = b0, b4 = b0,
            b5 = b0;
    __m512i c0 = _mm512_maskz_loadu_epi32(m, corr + HP + h0), c1 = c0, c2 = c0, c3 = c0, c4 = c0,
            c5 = c0;
#define Q8_X(r) _mm512_set1_epi32(ld4(x[r] + 4u * j))
    for (uint32_t j = 0; j < bd4; j++) {
        const __m512i q = _mm512_loadu_si512(qp + ((size_t)j * HQ + h0) * 4u);
        b0 = _mm512_dpbusd_epi32(b0, Q8_X(0), q);
        b1 = _mm512_dpbusd_epi32(b1, Q8_X(1), q);
        b2 = _mm512_dpbusd_epi32(b2, Q8_X(2), q);
        b3 = _mm512_dpbusd_epi32(b3, Q8_X(3), q);
        b4 = _mm512_dpbusd_epi32(b4, Q8_X(4), q);
        b5 = _mm512_dpbusd_epi32(b5, Q8_X(5), q);
    }
    for (uint32_t j = bd4; j < n4; j++) {
        const __m512i q = _mm512_loadu_si512(qp + ((size_t)j * HQ + h0) * 4u);
        c0 = _mm512_dpbusd_epi32(c0, Q8_X(0), q);
        c1 = _mm512_dpbusd_epi32(c1, Q8_X(1), q);
        c2 = _mm512_dpbusd_epi32(c2, Q8_X(2), q);
        c3 = _mm512_dpbusd_epi32(c3, Q8_X(3), q);
        c4 = _mm512_dpbusd_epi32(c4, Q8_X(4), q);
        c5 = _mm512_dpbusd_epi32(c5, Q8_X(5), q);
    }
#undef Q8_X
    int32_t *o = ib + r0 * HP + h0, *t = is + r0 * HP + h0;
    _mm512_mask_storeu_epi32(o, m, b0);
    _mm512_mask_storeu_epi32(o + HP, m, b1);
    _mm512_mask_storeu_epi32(o + 2 * HP, m, b2);
    _mm512_mask_storeu_epi32(o + 3 * HP, m, b3);
    _mm512_mask_storeu_epi32(o + 4 * HP, m, b4);
    _mm512_mask_storeu_epi32(o + 5 * HP, m, b5);
    _mm512_mask_storeu_epi32(t, m, c0);
    _mm512_mask_storeu_epi32(t + HP, m, c1);
    _mm512_mask_storeu_epi32(t + 2 * HP, m, c2);
    _mm512_mask_storeu_epi32(t + 3 * HP, m, c3);
    _mm512_mask_storeu_epi32(t + 4 * HP, m, c4);
    _mm512_mask_storeu_epi32(t + 5 * HP, m, c5);
}

/* ---------------------------------------------------------------------------------------------
 * Level 3: the same dots on AMX (amx-tile, amx-int8; Linux grants the tile data per process,
 * arch_prctl ARCH_REQ_XCOMP_PERM, asked once). A block of 16 consecutive closed rows in one piece
 * of the planes is one A tile a K chunk, loaded straight from the rows (csk_stride fp16 words
 * apart); the packing p->q8p ([len / 4][HQ][4]) is AMX's B layout for 16 heads a tile (rows
 * HQ·4 bytes apart). C tiles (16 rows × 16 heads, int32) start from the correction −128·Σ q_head
 * (tileloadd with stride 0: one row for all 16), then tdpbusd adds u8(row)·s8(head) products —
 * exact integer sums, so the same int32 dots as q8_tile's. K runs in chunks of 64 bytes (the
 * tile's width), the branch's and the sketch's separately; each part's last chunk, when shorter,
 * has tiles of its own shape (the configuration holds both). Tiles: 0, 1 the branch and sketch
 * C; 2, 3 A and B of a 64-byte chunk; 4, 5 of the branch's short chunk; 6, 7 of the sketch's.
 * ------------------------------------------------------------------------------------------- */
#if defined(__linux__)
#include <cpuid.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#define Q8_AMX 1
#define AMX_FN                                                                                     \
    __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")))
/* gcc's tileloadd and ldtilecfg intrinsics do not tell the compiler what memory they read: every
 * store before them must be done first (a compiler barrier, no instruction) */
#define AMX_FENCE(ptr) __asm__ __volatile__("" : : "r"(ptr) : "memory")

static int amx_granted_v;

static void amx_ask(void) {
    unsigned eax, ebx, ecx, edx;
    /* KVT_NO_AMX set (and not "0"): never ask, so the process keeps its signal frames as they
     * are (level 2 then) */
    const char *no = getenv("KVT_NO_AMX");
    if (no && *no && strcmp(no, "0") != 0) {
        amx_granted_v = 0;
        return;
    }
    /* CPUID.(7, 0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8; then the kernel's permission
     * (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18; refused by kernels before 5.16,
     * or while a too small sigaltstack is installed) */
    amx_granted_v = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 24 & 1u) &&
                    (edx >> 25 & 1u) && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* Whether this process may use the AMX tiles (asked once, whichever thread asks first). */
static int amx_granted(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, amx_ask);
    return amx_granted_v;
}

/* ldtilecfg's 64 bytes (palette 1). */
typedef struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* The tiles of a scan whose vectors are len bytes, the branch's bd first (both multiples of 4). */
AMX_FN static void q8_amx_begin(uint32_t bd, uint32_t len) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const uint32_t tb = bd % 64u, ts = (len - bd) % 64u;
    for (int t = 0; t < 4; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    c.rows[4] = c.rows[6] = 16;
    c.colsb[4] = (uint16_t)tb;
    c.rows[5] = (uint8_t)(tb / 4u);
    c.colsb[6] = (uint16_t)ts;
    c.rows[7] = (uint8_t)(ts / 4u);
    c.colsb[5] = c.colsb[7] = 64;
    if (!tb) /* an unused tile: zero rows and width */
        c.rows[4] = c.colsb[5] = 0;
    if (!ts)
        c.rows[6] = c.colsb[7] = 0;
    AMX_FENCE(&c);
    _tile_loadconfig(&c);
}

AMX_FN static void q8_amx_end(void) {
    _tile_release();
}

/* Dots of 16 rows whose vectors (len bytes, the branch's bd first) lie xs bytes apart from x,
 * against every head (HP) of the packing qp, into rows 0 .. 16 of ib and is ([rows][HP]), from
 * the correction corr ([2][HP]); q8_amx_begin's tiles. */
AMX_FN static void q8_amx16(const uint8_t *x, size_t xs, const uint8_t *qp, const int32_t *corr,
                            size_t HQ, size_t HP, uint32_t bd, uint32_t len, int32_t *ib,
                            int32_t *is) {
    const size_t qs = HQ * 4u; /* bytes from one K group of the packing to the next */
    int32_t cz[2][16], out[2][16][16];
    AMX_FENCE(x);
    for (size_t h0 = 0; h0 < HP; h0 += 16u) {
        const size_t w = HP - h0 >= 16u ? 16u : HP - h0; /* HP is a multiple of 8 */
        if (w == 16u) {
            _tile_loadd(0, corr + h0, 0);
            _tile_loadd(1, corr + HP + h0, 0);
        } else { /* the last 8 heads: the correction's padding lanes zero */
            memset(cz, 0, sizeof cz);
            memcpy(cz[0], corr + h0, 4u * w);
            memcpy(cz[1], corr + HP + h0, 4u * w);
            AMX_FENCE(cz);
            _tile_loadd(0, cz[0], 0);
            _tile_loadd(1, cz[1], 0);
        }
        const uint8_t *q = qp + 4u * h0;
/* C tile c += bytes [k0, k1) of the rows × the heads: whole 64-byte chunks in tiles 2, 3, a
 * shorter last one in tiles ta, tb (tile numbers are immediates: a macro, not a function) */
#define Q8_AMX_PART(c, ta, tb, k0, k1)                                                                 for (uint32_t k = (k0); k < (k1); k += 64u) {                                                          if (k + 64u <= (k1)) {                                                                                 _tile_loadd(2, x + k, xs);                                                                         _tile_loadd(3, q + k / 4u * qs, qs);                                                               _tile_dpbusd(c, 2, 3);                                                                         } else {                                                                                               _tile_loadd(ta, x + k, xs);                                                                        _tile_loadd(tb, q + k / 4u * qs, qs);                                                              _tile_dpbusd(c, ta, tb);                                                                       }                                                                                              }
        Q8_AMX_PART(0, 4, 5, 0u, bd)
        Q8_AMX_PART(1, 6, 7, bd, len)
#undef Q8_AMX_PART
        if (w == 16u) {
            _tile_stored(0, ib + h0, 4u * HP);
            _tile_stored(1, is + h0, 4u * HP);
        } else { /* the padding lanes must not reach the next row's heads */
            _tile_stored(0, out[0], 64);
            _tile_stored(1, out[1], 64);
            for (size_t r = 0; r < 16u; r++) {
                memcpy(ib + r * HP + h0, out[0][r], 4u * w);
                memcpy(is + r * HP + h0, out[1][r], 4u * w);
            }
        }
    }
}
#endif

static int q8_max_level = 3;
/* Tests: 1 turns the conformal 8-bit screen off (kvt__recall_scan_q8_screen). */
static int q8_screen_off = 0;

int kvt__recall_scan_q8_screen(int enable) {
    if (enable >= 0)
        q8_screen_off = !enable;
    return !q8_screen_off;
}

/* Rows the screen ruled out, over the process (tests: the screen is not vacuous). */
static _Atomic uint64_t q8_screened;

uint64_t kvt__recall_scan_q8_screened(void) {
    return q8_screened;
}

int kvt__recall_scan_q8_level(int enable) {
    if (enable >= 0)
        q8_max_level = enable;
    int cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")
                  ? 2
              : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                 : 0;
#ifdef Q8_AMX
    /* the permission is asked only where level 3 could run */
    if (cpu == 2 && q8_max_level >= 3 && amx_granted())
        cpu = 3;
#endif
    return cpu < q8_max_level ? cpu : q8_max_level;
}

/* The screen of the conformal 8-bit trigger. Per (row, head) the trigger computes, in fp32 and
 * in kvt__recall_q8_fires' order, lhs = (idx8 + B') + z·cert and fires on !(lhs <= best): about
 * forty operations and a division. The screen bounds lhs from above with a few multiply-adds of
 * per-head constants (q8_screen_tables), so a row whose bound is below best for every head is
 * known not to fire and skips the trigger; any other row runs the trigger itself. So the fired
 * set, the count and the overflow are the trigger's, bit for bit.
 *
 * The bound. In real arithmetic, with the head's tb, ts, Qb, Qs, Eb, Es, Nb, Ns and the row's
 * s_r, s_c, e_r, n_r, e_c, n_c, ρ (all >= 0), k8 = 1 + 2^-8, k15 = 2^-15:
 *   idx8 = ca·s_r·I_b + cc·s_c·I_s                 ca = s·tb, cc = s·ts
 *   B    = α·e_r + β·n_r + γ·e_c + δ·n_c           α = s·k8·(1 + k15)·Qb, β = s·k8·(Eb + k15·(Qb
 *                                                  + Nb)), γ, δ alike with Qs, Es, Ns
 *   z·cert = w·ρ                                   w = z·s·‖q̃_res‖/√(D − 64)
 * (kvt__recall_q8_bound expanded: the same sum). Computed as the trigger computes them, idx8 is
 * within γ_4·M of the real value (M = |ca·s_r·I_b| + |cc·s_c·I_s|), B within γ_10·B, z·cert within
 * γ_3, B' = B + 2^-22·(|idx8| + B + |z·cert|), and lhs's two additions add γ_2 of the magnitudes.
 * The screen computes ia, M, Ba and zw by the formulas above (multiply-adds; each within γ_5 of
 * its real value) and T = M + Ba + |zw|; then lhs <= ia + Ba + zw + (2^-22 + 50u)·T (u = 2^-24),
 * and the screen's U = ((ia + Ba) + zw) + (2^-16·T + 2^-64) exceeds that with room for its own
 * roundings. Subnormal intermediates lose at most 2^-150 each, times the factors that follow them
 * (below 2^60 in range): the 2^-64. The screen skips a (row, head) only on U < best, so a NaN
 * anywhere runs the trigger.
 * In range: s > 0, √(D − 64) >= 1, and every per-head constant and row value at most 2^30 in
 * magnitude (finite), so neither evaluation overflows (the largest product, s·tb·s_r·I_b, stays
 * below 2^114). A scan whose heads are out of range does not screen (q8pf_on 0); a row whose
 * values are out of range, or not finite, runs the trigger. */
#define Q8_PF_RANGE 1073741824.0f /* 2^30 */

/* The screen's per-head constants into p->q8pf [Q8_PF_N][HP] (padding heads 0); p->q8pf_on says
 * whether every live head's inputs are in range. After column_tables (snres). */
static void q8_screen_tables(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p) {
    const size_t HP = p->HP;
    const float s = a->scale, z = a->z, k8 = 1.0f + 0.00390625f, k15 = 3.0517578e-5f;
    const float sq = sqrtf((float)(a->latent_dim - 64u));
    int on = s > 0.0f && s <= Q8_PF_RANGE && fabsf(z) <= Q8_PF_RANGE && sq >= 1.0f;
    for (size_t h = 0; h < HP; h++) {
        const float *f = p->q8f; /* tb ts Qb Qs Eb Es Nb Ns */
        float v[8];
        for (uint32_t i = 0; i < 8u; i++) {
            v[i] = f[i * HP + h];
            on &= fabsf(v[i]) <= Q8_PF_RANGE; /* false for a NaN */
        }
        on &= fabsf(p->snres[h]) <= Q8_PF_RANGE;
        const float sk = s * k8;
        const float c[Q8_PF_N] = {s * v[0],
                                  s * v[1],
                                  sk * (v[2] + k15 * v[2]),
                                  sk * (v[4] + k15 * (v[2] + v[6])),
                                  sk * (v[3] + k15 * v[3]),
                                  sk * (v[5] + k15 * (v[3] + v[7])),
                                  z * p->snres[h] / sq};
        for (uint32_t i = 0; i < Q8_PF_N; i++)
            p->q8pf[i * HP + h] = h < a->n_heads ? c[i] : 0.0f;
    }
    p->q8pf_on = on;
}

/* The screen over a chunk's rows i < n (planes x[i] − 24 bytes, dots ib, is [at[i]][HP], ρ
 * rho[i]): maybe[i] = 0 where the row cannot fire for any of heads 0 .. H, 1 where the trigger
 * must run (a bound at or above some head's best, a NaN, a value out of range). Head vectors
 * outer (their constants stay in registers), rows inner. */
VNNI_FN static void q8_screen_chunk(const kvt__recall_scan_prep *p, const uint8_t *const *x,
                                    const uint8_t *at, const int32_t *ib, const int32_t *is,
                                    const float *rho, size_t n, uint32_t H, uint8_t *maybe) {
    const size_t HP = p->HP;
    const __m256 lim = _mm256_set1_ps(Q8_PF_RANGE), sgn = _mm256_set1_ps(-0.0f);
    for (size_t i = 0; i < n; i++) { /* every value in range (a NaN fails the compare): the
                                      * plane's s_r s_c e_r n_r e_c n_c, then ρ twice */
        const __m256 v = _mm256_mask_loadu_ps(_mm256_set1_ps(rho[i]), 0x3f,
                                              x[i] - 4u * KVT__Q8_FLOATS);
        maybe[i] = _mm256_cmp_ps_mask(_mm256_andnot_ps(sgn, v), lim, _CMP_LE_OQ) != 0xff;
    }
    const __m512 k16 = _mm512_set1_ps(1.52587890625e-5f), tiny = _mm512_set1_ps(5.421011e-20f);
    for (uint32_t h0 = 0; h0 < H; h0 += 16u) {
        const __mmask16 live = (__mmask16)(H - h0 >= 16u ? 0xffffu : (1u << (H - h0)) - 1u);
#define LD(i) _mm512_maskz_loadu_ps(live, p->q8pf + (i) * HP + h0)
        const __m512 ca = LD(0), cc = LD(1), al = LD(2), be = LD(3), ga = LD(4), de = LD(5);
        const __m512 w = LD(6);
#undef LD
        const __m512 best = _mm512_maskz_loadu_ps(live, p->tbest + h0);
        for (size_t i = 0; i < n; i++) {
            if (maybe[i])
                continue;
            const uint8_t *pl = x[i] - 4u * KVT__Q8_FLOATS;
            const __m512 sr = _mm512_set1_ps(kvt__recall_q8_f(pl, 0));
            const __m512 sc = _mm512_set1_ps(kvt__recall_q8_f(pl, 1));
            const __m512 x0 = _mm512_mul_ps(ca, sr), y0 = _mm512_mul_ps(cc, sc);
            const __m512i jb = _mm512_maskz_loadu_epi32(live, ib + (size_t)at[i] * HP + h0);
            const __m512i js = _mm512_maskz_loadu_epi32(live, is + (size_t)at[i] * HP + h0);
            const __m512 fib = _mm512_cvtepi32_ps(jb), fis = _mm512_cvtepi32_ps(js);
            const __m512 ia = _mm512_fmadd_ps(x0, fib, _mm512_mul_ps(y0, fis));
            const __m512 M = _mm512_fmadd_ps(x0, _mm512_abs_ps(fib),
                                             _mm512_mul_ps(y0, _mm512_abs_ps(fis)));
            const __m512 Ba = _mm512_fmadd_ps(
                al, _mm512_set1_ps(kvt__recall_q8_f(pl, 2)),
                _mm512_fmadd_ps(be, _mm512_set1_ps(kvt__recall_q8_f(pl, 3)),
                                _mm512_fmadd_ps(ga, _mm512_set1_ps(kvt__recall_q8_f(pl, 4)),
                                                _mm512_mul_ps(de, _mm512_set1_ps(
                                                                      kvt__recall_q8_f(pl, 5))))));
            const __m512 zw = _mm512_mul_ps(w, _mm512_set1_ps(rho[i]));
            const __m512 T = _mm512_add_ps(_mm512_add_ps(M, Ba), _mm512_abs_ps(zw));
            const __m512 U = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(ia, Ba), zw),
                                           _mm512_fmadd_ps(k16, T, tiny));
            maybe[i] = _mm512_mask_cmp_ps_mask(live, U, best, _CMP_NLT_UQ) != 0;
        }
    }
}

/* The conformal trigger of one row (plane pl) over heads 0 .. H from its corrected dots: the
 * lanes of kvt__recall_q8_fires' conformal branch, 16 heads a vector. */
VNNI_FN static int q8_conformal_vec(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p,
                                    const uint8_t *pl, const int32_t *ib, const int32_t *is,
                                    float rho, uint32_t H) {
    const size_t HP = p->HP;
    const __m512 s = _mm512_set1_ps(a->scale), z = _mm512_set1_ps(a->z);
    const __m512 sr = _mm512_set1_ps(kvt__recall_q8_f(pl, 0)),
                 sc = _mm512_set1_ps(kvt__recall_q8_f(pl, 1));
    const __m512 er = _mm512_set1_ps(kvt__recall_q8_f(pl, 2)),
                 nr = _mm512_set1_ps(kvt__recall_q8_f(pl, 3));
    const __m512 ec = _mm512_set1_ps(kvt__recall_q8_f(pl, 4)),
                 nc = _mm512_set1_ps(kvt__recall_q8_f(pl, 5));
    const __m512 nre = _mm512_add_ps(nr, er), nce = _mm512_add_ps(nc, ec);
    const __m512 vr = _mm512_set1_ps(rho), sq = _mm512_set1_ps(sqrtf((float)(a->latent_dim - 64u)));
    const __m512 k15 = _mm512_set1_ps(3.0517578e-5f), k8 = _mm512_set1_ps(1.0f + 0.00390625f);
    const __m512 k22 = _mm512_set1_ps(2.3841858e-7f);
    __mmask16 fire = 0;
    for (uint32_t h0 = 0; h0 < H; h0 += 16u) {
        const __mmask16 live = (__mmask16)(H - h0 >= 16u ? 0xffffu : (1u << (H - h0)) - 1u);
#define LD(i) _mm512_maskz_loadu_ps(live, p->q8f + (i) * HP + h0)
        const __m512 tb = LD(0), ts = LD(1), Qb = LD(2), Qs = LD(3), Eb = LD(4), Es = LD(5);
        const __m512 Nb = LD(6), Ns = LD(7);
#undef LD
        const __m512 fib = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(live, ib + h0));
        const __m512 fis = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(live, is + h0));
        const __m512 va = _mm512_mul_ps(_mm512_mul_ps(tb, sr), fib);
        const __m512 vb = _mm512_mul_ps(_mm512_mul_ps(ts, sc), fis);
        const __m512 idx = _mm512_mul_ps(s, _mm512_add_ps(va, vb));
        __m512 mn = _mm512_add_ps(_mm512_mul_ps(Qb, er), _mm512_mul_ps(Eb, nr));
        mn = _mm512_add_ps(mn, _mm512_mul_ps(Qs, ec));
        mn = _mm512_add_ps(mn, _mm512_mul_ps(Es, nc));
        __m512 rd = _mm512_add_ps(_mm512_mul_ps(Qb, nre), _mm512_mul_ps(Qs, nce));
        rd = _mm512_add_ps(rd, _mm512_mul_ps(Nb, nr));
        rd = _mm512_add_ps(rd, _mm512_mul_ps(Ns, nc));
        const __m512 B =
            _mm512_mul_ps(_mm512_mul_ps(s, _mm512_add_ps(mn, _mm512_mul_ps(k15, rd))), k8);
        const __m512 sn = _mm512_maskz_loadu_ps(live, p->snres + h0);
        const __m512 zc = _mm512_mul_ps(z, _mm512_div_ps(_mm512_mul_ps(sn, vr), sq));
        const __m512 ai = _mm512_abs_ps(idx), az = _mm512_abs_ps(zc);
        const __m512 Bp = _mm512_add_ps(
            B, _mm512_mul_ps(k22, _mm512_add_ps(_mm512_add_ps(ai, B), az)));
        const __m512 lhs = _mm512_add_ps(_mm512_add_ps(idx, Bp), zc);
        const __m512 best = _mm512_maskz_loadu_ps(live, p->tbest + h0);
        fire |= _mm512_mask_cmp_ps_mask(live, lhs, best, _CMP_NLE_UQ);
    }
    return fire != 0;
}

/* The AVX2 dots (CPUs without VNNI): the chunk's row vectors widened to int16 (x16, [rows][len]),
 * a tile of 6 rows × 8 heads: per 2 values one vpmaddwd per (row, part) adds u8·s16 pairs into
 * int32 lanes (exact: |sum| <= 2·255·127), accumulated as q8_tile's. */
TILED_FN static void q8_tile_avx2(const int16_t *x16, size_t len, const uint8_t *qp,
                                  const int32_t *corr, size_t HQ, size_t HP, uint32_t bd2,
                                  uint32_t n2, size_t r0, size_t h0, int32_t *ib, int32_t *is) {
    /* from the correction, as q8_tile (HP is a multiple of 8: whole loads) */
    __m256i b0 = _mm256_loadu_si256((const __m256i *)(corr + h0)), b1 = b0, b2 = b0, b3 = b0,
            b4 = b0, b5 = b0;
    __m256i c0 = _mm256_loadu_si256((const __m256i *)(corr + HP + h0)), c1 = c0, c2 = c0,
            c3 = c0, c4 = c0, c5 = c0;
    const int16_t *x = x16 + r0 * len;
#define Q8_X2(r) _mm256_set1_epi32(ld4((const uint8_t *)(x + (r) * len + 2u * j)))
#define Q8_MADD(acc, r) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(Q8_X2(r), q))
    for (uint32_t j = 0; j < bd2; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qp + ((size_t)j * HQ + h0) * 4u));
        Q8_MADD(b0, 0); Q8_MADD(b1, 1); Q8_MADD(b2, 2); Q8_MADD(b3, 3); Q8_MADD(b4, 4);
        Q8_MADD(b5, 5);
    }
    for (uint32_t j = bd2; j < n2; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qp + ((size_t)j * HQ + h0) * 4u));
        Q8_MADD(c0, 0); Q8_MADD(c1, 1); Q8_MADD(c2, 2); Q8_MADD(c3, 3); Q8_MADD(c4, 4);
        Q8_MADD(c5, 5);
    }
#undef Q8_MADD
#undef Q8_X2
    int32_t o[8];
    const size_t w = HP - h0 >= 8u ? 8u : HP - h0;
#define Q8_ST(v, r, out)                                                                           \
    _mm256_storeu_si256((__m256i *)o, v);                                                          \
    memcpy(out + (r0 + (r)) * HP + h0, o, 4u * w)
    Q8_ST(b0, 0, ib); Q8_ST(b1, 1, ib); Q8_ST(b2, 2, ib); Q8_ST(b3, 3, ib); Q8_ST(b4, 4, ib);
    Q8_ST(b5, 5, ib); Q8_ST(c0, 0, is); Q8_ST(c1, 1, is); Q8_ST(c2, 2, is); Q8_ST(c3, 3, is);
    Q8_ST(c4, 4, is); Q8_ST(c5, 5, is);
#undef Q8_ST
}

/* q8_conformal_vec eight heads a vector (AVX2): the same lanes' operations. */
TILED_FN static int q8_conformal_avx2(const kvt__recall_scan_args *a,
                                      const kvt__recall_scan_prep *p, const uint8_t *pl,
                                      const int32_t *ib, const int32_t *is, float rho, uint32_t H) {
    const size_t HP = p->HP;
    const __m256 s = _mm256_set1_ps(a->scale), z = _mm256_set1_ps(a->z);
    const __m256 sr = _mm256_set1_ps(kvt__recall_q8_f(pl, 0)),
                 sc = _mm256_set1_ps(kvt__recall_q8_f(pl, 1));
    const __m256 er = _mm256_set1_ps(kvt__recall_q8_f(pl, 2)),
                 nr = _mm256_set1_ps(kvt__recall_q8_f(pl, 3));
    const __m256 ec = _mm256_set1_ps(kvt__recall_q8_f(pl, 4)),
                 nc = _mm256_set1_ps(kvt__recall_q8_f(pl, 5));
    const __m256 nre = _mm256_add_ps(nr, er), nce = _mm256_add_ps(nc, ec);
    const __m256 vr = _mm256_set1_ps(rho), sq = _mm256_set1_ps(sqrtf((float)(a->latent_dim - 64u)));
    const __m256 k15 = _mm256_set1_ps(3.0517578e-5f), k8 = _mm256_set1_ps(1.0f + 0.00390625f);
    const __m256 k22 = _mm256_set1_ps(2.3841858e-7f);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int bits = 0;
    for (uint32_t h0 = 0; h0 < H; h0 += 8u) { /* HP >= H rounded to 8: loads stay in the tables */
#define LD(i) _mm256_loadu_ps(p->q8f + (i) * HP + h0)
        const __m256 tb = LD(0), ts = LD(1), Qb = LD(2), Qs = LD(3), Eb = LD(4), Es = LD(5);
        const __m256 Nb = LD(6), Ns = LD(7);
#undef LD
        const __m256 fib = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(ib + h0)));
        const __m256 fis = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(is + h0)));
        const __m256 va = _mm256_mul_ps(_mm256_mul_ps(tb, sr), fib);
        const __m256 vb = _mm256_mul_ps(_mm256_mul_ps(ts, sc), fis);
        const __m256 idx = _mm256_mul_ps(s, _mm256_add_ps(va, vb));
        __m256 mn = _mm256_add_ps(_mm256_mul_ps(Qb, er), _mm256_mul_ps(Eb, nr));
        mn = _mm256_add_ps(mn, _mm256_mul_ps(Qs, ec));
        mn = _mm256_add_ps(mn, _mm256_mul_ps(Es, nc));
        __m256 rd = _mm256_add_ps(_mm256_mul_ps(Qb, nre), _mm256_mul_ps(Qs, nce));
        rd = _mm256_add_ps(rd, _mm256_mul_ps(Nb, nr));
        rd = _mm256_add_ps(rd, _mm256_mul_ps(Ns, nc));
        const __m256 B =
            _mm256_mul_ps(_mm256_mul_ps(s, _mm256_add_ps(mn, _mm256_mul_ps(k15, rd))), k8);
        const __m256 sn = _mm256_loadu_ps(p->snres + h0);
        const __m256 zc = _mm256_mul_ps(z, _mm256_div_ps(_mm256_mul_ps(sn, vr), sq));
        const __m256 ai = _mm256_and_ps(idx, absm), az = _mm256_and_ps(zc, absm);
        const __m256 Bp = _mm256_add_ps(
            B, _mm256_mul_ps(k22, _mm256_add_ps(_mm256_add_ps(ai, B), az)));
        const __m256 lhs = _mm256_add_ps(_mm256_add_ps(idx, Bp), zc);
        const __m256 f = _mm256_cmp_ps(lhs, _mm256_loadu_ps(p->tbest + h0), _CMP_NLE_UQ);
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(H - h0)), lane);
        bits |= _mm256_movemask_ps(_mm256_and_ps(f, _mm256_castsi256_ps(live)));
    }
    return bits != 0;
}

/* The next chunk of the 8-bit scan at SIMD level lv (3 AMX, 2 VNNI, 1 AVX2), from row *row_io on
 * (*jk_io: the kept cursor, as the row-wise scan keeps it): its archived rows ascending (rows,
 * their vectors x) and their dots, row i's in rows at[i] of p->tacc, p->tpa (int32 [CHUNK_ROWS]
 * [HP]: branch, sketch); returns how many. Levels 2 and 1 take CHUNK_ROWS archived rows and tile
 * them 6 at a time (at[i] = i); level 3 takes the window of CHUNK_ROWS consecutive closed rows
 * (fewer where the rows end or the planes change piece at n_head), dots its 16-row blocks on AMX
 * straight from the strided planes (kept rows inside included, their dots unread; at[i]: the
 * row's place in the window) and the rest with q8_tile. */
TILED_FN static void q8_chunk_dots(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                                   int lv, const uint8_t **x, size_t n);

TILED_FN static size_t q8_chunk(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p, int lv,
                                uint64_t *row_io, uint64_t *jk_io, uint64_t *rows,
                                const uint8_t **x, uint8_t *at) {
    const uint32_t len = p->q8len;
    uint64_t row = *row_io, jk = *jk_io, end = a->n_closed, live = 0;
    const uint64_t r0 = row;
    const uint8_t *xa[CHUNK_ROWS]; /* level 3: the window's vectors, kept rows too */
    if (lv == 3) {
        end = r0 + CHUNK_ROWS < end ? r0 + CHUNK_ROWS : end;
        if (r0 < a->n_head && end > a->n_head)
            end = a->n_head;
    }
    size_t n = 0;
    for (; row < end && n < CHUNK_ROWS; row++) {
        const uint8_t *v = q8_plane(a, row) + 4u * KVT__Q8_FLOATS;
        if (lv == 3)
            xa[row - r0] = v;
        while (jk < a->m && a->kept[jk] < row)
            jk++;
        if (jk < a->m && a->kept[jk] == row)
            continue;
        if (row + PREFETCH_ROWS < a->n_closed) { /* every line of the plane, its last too */
            const uint8_t *f = q8_plane(a, row + PREFETCH_ROWS);
            for (uint32_t o = 0; o < 4u * KVT__Q8_FLOATS + len; o += 64u)
                __builtin_prefetch(f + o);
            __builtin_prefetch(f + 4u * KVT__Q8_FLOATS + len - 1u);
        }
        rows[n] = row;
        x[n] = v;
        at[n] = (uint8_t)(lv == 3 ? row - r0 : n);
        live |= 1ull << at[n];
        n++;
    }
    *row_io = row;
    *jk_io = jk;
#ifdef Q8_AMX
    if (lv == 3) {
        const size_t HP = p->HP, HQ = Q8_HQ(HP);
        const uint32_t bd = a->branch_dim, bd4 = bd / 4u, n4 = len / 4u;
        const int32_t *corr = (const int32_t *)(p->q8f + 8u * HP); /* [2][HP] */
        int32_t *ib = (int32_t *)p->tacc, *is = (int32_t *)p->tpa;
        const size_t w = (size_t)(row - r0);
        size_t o = 0;
        for (; o + 16u <= w; o += 16u)
            if (live >> o & 0xffffu)
                q8_amx16(xa[o], 2u * (size_t)a->csk_stride, p->q8p, corr, HQ, HP, bd, len,
                         ib + o * HP, is + o * HP);
        for (size_t i = w; i < CHUNK_ROWS; i++) /* padding rows: results unread */
            xa[i] = xa[0];
        for (; o < w; o += 6u) { /* the rest: 6-row tiles, the last one kept inside the window */
            const size_t g = o + 6u <= CHUNK_ROWS ? o : CHUNK_ROWS - 6u;
            if (live >> g & 0x3fu)
                for (size_t h0 = 0; h0 < HP; h0 += 16u)
                    q8_tile(xa + g, p->q8p, corr, HQ, HP, bd4, n4, g, h0, ib, is);
        }
        return n;
    }
#else
    (void)xa, (void)live; /* level 3 is not built here */
#endif
    q8_chunk_dots(a, p, lv, x, n);
    return n;
}

/* The dots of the n (<= CHUNK_ROWS) rows whose vectors are x[0 .. n) against every head, at
 * level lv (2 VNNI, 1 AVX2) into p->tacc / p->tpa ([i][HP] int32: the branch's, the sketch's);
 * x must have room for CHUNK_ROWS (padding rows repeat x[0], their dots unread). */
TILED_FN static void q8_chunk_dots(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                                   int lv, const uint8_t **x, size_t n) {
    const size_t HP = p->HP, HQ = Q8_HQ(HP);
    const uint32_t len = p->q8len, bd = a->branch_dim, bd4 = bd / 4u, n4 = len / 4u;
    const int32_t *corr = (const int32_t *)(p->q8f + 8u * HP); /* [2][HP] */
    int32_t *ib = (int32_t *)p->tacc, *is = (int32_t *)p->tpa;
    const size_t nr = (n + 5u) / 6u * 6u;
    for (size_t i = n; i < nr; i++) /* padding rows: row 0's vector again, results unread */
        x[i] = x[0];
    if (lv == 2) {
        for (size_t t0 = 0; t0 < nr; t0 += 6u)
            for (size_t h0 = 0; h0 < HP; h0 += 16u)
                q8_tile(x + t0, p->q8p, corr, HQ, HP, bd4, n4, t0, h0, ib, is);
    } else {
        int16_t *x16 = p->q8x; /* the chunk's rows widened [CHUNK_ROWS][len] */
        for (size_t i = 0; i < nr; i++) {
            uint32_t j = 0;
            for (; j + 16u <= len; j += 16u)
                _mm256_storeu_si256(
                    (__m256i *)(x16 + i * len + j),
                    _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(x[i] + j))));
            for (; j < len; j++) /* the tail (len is a multiple of 4 only) */
                x16[i * len + j] = x[i][j];
        }
        for (size_t t0 = 0; t0 < nr; t0 += 6u)
            for (size_t h0 = 0; h0 < HP; h0 += 8u)
                q8_tile_avx2(x16, len, p->q8p, corr, HQ, HP, bd / 2u, len / 2u, t0, h0, ib, is);
    }
}

/* A row's 8-bit trigger over every head from its dots bi, si [HP] at level lv, as the scan runs
 * it: the vectorised conformal trigger (VNNI and AMX levels: q8_conformal_vec; AVX2:
 * q8_conformal_avx2), the per-element functions in the other modes. */
TILED_FN static int q8_fire(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p,
                            int lv, const uint8_t *pl, const int32_t *bi, const int32_t *si,
                            float rho) {
    if (a->mode != KVT__RECALL_CONFORMAL)
        return q8_row_trigger(a, p, pl, bi, si, rho);
    return lv >= 2 ? q8_conformal_vec(a, p, pl, bi, si, rho, a->n_heads)
                   : q8_conformal_avx2(a, p, pl, bi, si, rho, a->n_heads);
}

/* kvt__recall_rows_fire_cpu at 8 bits, level lv (2 VNNI, 1 AVX2; AMX's windows need
 * consecutive rows: level 2 for it): the listed rows CHUNK_ROWS at a time through q8_chunk_dots,
 * then each row's trigger over every head as scan_q8 runs it (no screen: it only skips work), so
 * fire[i] is the full scan's decision for the row. */
TILED_FN static void rows_fire_q8(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                                  int lv, const uint64_t *rows, uint32_t n, uint8_t *fire) {
    const size_t HP = p->HP;
    const int32_t *ib = (const int32_t *)p->tacc, *is = (const int32_t *)p->tpa;
    const uint8_t *x[CHUNK_ROWS];
    column_tables(a, p, NULL, a->n_heads, HP);
    for (uint32_t c0 = 0; c0 < n; c0 += CHUNK_ROWS) {
        const uint32_t c = n - c0 < CHUNK_ROWS ? n - c0 : CHUNK_ROWS;
        for (uint32_t i = 0; i < c; i++)
            x[i] = q8_plane(a, rows[c0 + i]) + 4u * KVT__Q8_FLOATS;
        q8_chunk_dots(a, p, lv, x, c);
        for (uint32_t i = 0; i < c; i++) {
            const int32_t *bi = ib + i * HP, *si = is + i * HP;
            fire[c0 + i] = (uint8_t)q8_fire(a, p, lv, x[i] - 4u * KVT__Q8_FLOATS, bi, si,
                                            *kvt__scan_rho(a, rows[c0 + i]));
        }
    }
}

/* The full 8-bit scan at SIMD level lv (3 AMX, 2 VNNI, 1 AVX2): q8_chunk after q8_chunk over the
 * archived rows ascending, the trigger per row; fired rows in row order, at most cap, stopping
 * at the (cap + 1)-th. */
TILED_FN static void scan_q8(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p, int lv) {
    const size_t HP = p->HP;
    const uint32_t H = a->n_heads;
    column_tables(a, p, NULL, H, HP);
    const int32_t *ib = (const int32_t *)p->tacc, *is = (const int32_t *)p->tpa;
    const uint8_t *x[CHUNK_ROWS];
    uint64_t rows[CHUNK_ROWS];
    uint8_t at[CHUNK_ROWS], maybe[CHUNK_ROWS];
    float rho_c[CHUNK_ROWS];
    uint32_t count = 0, over = 0;
    uint64_t jk = 0, row = a->sinks, ruled = 0;
    const int conformal = a->mode == KVT__RECALL_CONFORMAL;
    if (conformal)
        q8_screen_tables(a, p);
    /* the screen on the VNNI and AMX levels (their trigger is q8_conformal_vec) */
    const int screen = conformal && lv >= 2 && p->q8pf_on && !q8_screen_off;
#ifdef Q8_AMX
    if (lv == 3)
        q8_amx_begin(a->branch_dim, p->q8len);
#endif
    while (row < a->n_closed && !over) {
        const size_t n = q8_chunk(a, p, lv, &row, &jk, rows, x, at);
        for (size_t i = 0; i < n; i++)
            rho_c[i] = *kvt__scan_rho(a, rows[i]);
        if (screen)
            q8_screen_chunk(p, x, at, ib, is, rho_c, n, H, maybe);
        for (size_t i = 0; i < n; i++) {
            if (screen && !maybe[i]) {
                ruled++;
                continue;
            }
            const int32_t *bi = ib + at[i] * HP, *si = is + at[i] * HP;
            const uint8_t *pl = x[i] - 4u * KVT__Q8_FLOATS;
            const float rho = rho_c[i];
            const int f = q8_fire(a, p, lv, pl, bi, si, rho);
            if (!f)
                continue;
            if (count == a->cap) {
                over = 1;
                break;
            }
            a->fired[count++] = (uint32_t)rows[i];
        }
    }
#ifdef Q8_AMX
    if (lv == 3)
        q8_amx_end();
#endif
    *a->n_fired = count;
    *a->overflow = over;
    if (ruled)
        q8_screened += ruled;
}

/* kvt__recall_rows_fire_cpu, tiled: chunks of the listed rows, each prefetched a few ahead. */
TILED_FN static void rows_fire_tiled(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                                     const float *qT, size_t QP, const uint32_t *hmap,
                                     uint32_t nc, const uint64_t *rows, uint32_t n,
                                     uint8_t *fire) {
    const size_t J = (size_t)a->branch_dim + a->rank;
    float ncsk[CHUNK_ROWS];
    column_tables(a, p, hmap, nc, QP);
    for (uint32_t c0 = 0; c0 < n; c0 += CHUNK_ROWS) {
        const uint32_t c = n - c0 < CHUNK_ROWS ? n - c0 : CHUNK_ROWS;
        for (uint32_t i = 0; i < c; i++) {
            /* listed rows are scattered: no hardware prefetcher sees them */
            if (c0 + i + LIST_AHEAD < n)
                prefetch_row(a, rows[c0 + i + LIST_AHEAD]);
            ncsk[i] = load_row_vec(a, rows[c0 + i], p->X + i * J);
        }
        chunk_fire(a, p, qT, QP, hmap, nc, rows + c0, ncsk, c, fire + c0);
    }
}
#endif

#ifndef SCAN_TILED
int kvt__recall_scan_q8_level(int enable) {
    (void)enable;
    return 0;
}

int kvt__recall_scan_q8_screen(int enable) {
    (void)enable;
    return 0;
}

uint64_t kvt__recall_scan_q8_screened(void) {
    return 0;
}
#endif

/* Does this CPU run the tiled scan? (0 under tests that force the row-wise one.) */
static int tiled_enabled = 1;

int kvt__recall_scan_tiled(int enable) {
#ifdef SCAN_TILED
    if (enable >= 0)
        tiled_enabled = enable;
    return tiled_enabled && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    (void)enable;
    (void)tiled_enabled;
    return 0;
#endif
}

int kvt__recall_chains_tiled(const float *X, size_t J, const float *qT, size_t HP, size_t nr,
                             float *acc) {
#ifdef SCAN_TILED
    if (kvt__recall_scan_tiled(-1) && nr % 6u == 0 && HP % 8u == 0) {
        tile_scores(X, J, qT, HP, nr, 0, acc, NULL);
        return 1;
    }
#endif
    (void)X, (void)J, (void)qT, (void)HP, (void)nr, (void)acc;
    return 0;
}

void kvt__recall_rows_fire_cpu(const kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                               const float *qT, size_t QP, const uint32_t *hmap, uint32_t nc,
                               const uint64_t *rows, uint32_t n, uint8_t *fire) {
#ifdef SCAN_TILED
    const int lv = a->q8_off && a->branch_dim % 4u == 0 ? kvt__recall_scan_q8_level(-1) : 0;
    if (lv) { /* the 8-bit scan's tiles (every head: a head the caller left out cannot fire) */
        rows_fire_q8(a, p, lv > 2 ? 2 : lv, rows, n, fire);
        return;
    }
#endif
    if (a->q8_off) { /* the 8-bit scan: the per-element functions, every head (q8_row_fires) */
        for (uint32_t i = 0; i < n; i++)
            fire[i] = (uint8_t)q8_row_fires(a, p, rows[i]);
        return;
    }
#ifdef SCAN_TILED
    if (kvt__recall_scan_tiled(-1)) {
        rows_fire_tiled(a, p, qT, QP, hmap, nc, rows, n, fire);
        return;
    }
#endif
    for (uint32_t i = 0; i < n; i++)
        fire[i] = (uint8_t)kvt__recall_row_fires_cpu(a, p, qT, QP, hmap, nc, rows[i]);
}

void kvt__recall_scan_rowwise_cpu(const kvt__recall_scan_args *a, float *scratch) {
    kvt__recall_scan_prep p;
    kvt__recall_scan_prep_cpu(a, scratch, &p);
    uint32_t count = 0, over = 0;
    uint64_t jk = 0; /* kept[jk]: the first kept row >= the current one */
    for (uint64_t row = a->sinks; row < a->n_closed; row++) {
        while (jk < a->m && a->kept[jk] < row)
            jk++;
        if (jk < a->m && a->kept[jk] == row)
            continue;
        if (a->q8_off ? !q8_row_fires(a, &p, row)
                      : !kvt__recall_row_fires_cpu(a, &p, p.qT, p.HP, NULL, a->n_heads, row))
            continue;
        if (count == a->cap) {
            over = 1;
            break;
        }
        a->fired[count++] = (uint32_t)row;
    }
    *a->n_fired = count;
    *a->overflow = over;
}

void kvt__recall_scan_cpu(const kvt__recall_scan_args *a, float *scratch) {
#ifdef SCAN_TILED
    const int lv = a->q8_off && a->branch_dim % 4u == 0 ? kvt__recall_scan_q8_level(-1) : 0;
    if (lv) {
        kvt__recall_scan_prep p;
        kvt__recall_scan_prep_cpu(a, scratch, &p);
        scan_q8(a, &p, lv);
        return;
    }
    if (kvt__recall_scan_tiled(-1) && !a->q8_off) {
        kvt__recall_scan_prep p;
        kvt__recall_scan_prep_cpu(a, scratch, &p);
        scan_tiled(a, &p);
        return;
    }
#endif
    kvt__recall_scan_rowwise_cpu(a, scratch);
}

int kvt__recall_scan_q8_dots_cpu(const kvt__recall_scan_args *a, float *scratch, int32_t *ib,
                                 int32_t *is) {
#ifndef SCAN_TILED
    (void)a, (void)scratch, (void)ib, (void)is;
    return 0;
#else
    const int lv = a->q8_off && a->branch_dim % 4u == 0 ? kvt__recall_scan_q8_level(-1) : 0;
    if (!lv)
        return 0;
    kvt__recall_scan_prep p;
    kvt__recall_scan_prep_cpu(a, scratch, &p);
    const int32_t *cb = (const int32_t *)p.tacc, *cs = (const int32_t *)p.tpa;
    const uint8_t *x[CHUNK_ROWS];
    uint64_t rows[CHUNK_ROWS], jk = 0, row = a->sinks;
    uint8_t at[CHUNK_ROWS];
    size_t k = 0;
    const size_t H = a->n_heads;
#ifdef Q8_AMX
    if (lv == 3)
        q8_amx_begin(a->branch_dim, p.q8len);
#endif
    while (row < a->n_closed) { /* scan_q8's chunks, every row's dots copied out */
        const size_t n = q8_chunk(a, &p, lv, &row, &jk, rows, x, at);
        for (size_t i = 0; i < n; i++, k++) {
            memcpy(ib + k * H, cb + at[i] * p.HP, 4u * H);
            memcpy(is + k * H, cs + at[i] * p.HP, 4u * H);
        }
    }
#ifdef Q8_AMX
    if (lv == 3)
        q8_amx_end();
#endif
    return lv;
#endif
}

int kvt__recall_scan_tile_chains_cpu(const kvt__recall_scan_args *a, float *scratch,
                                     const uint64_t *rows, uint32_t n, float *acc, float *pa) {
#ifndef SCAN_TILED
    (void)a, (void)scratch, (void)rows, (void)n, (void)acc, (void)pa;
    return 0;
#else
    if (!kvt__recall_scan_tiled(-1))
        return 0;
    kvt__recall_scan_prep p;
    kvt__recall_scan_prep_cpu(a, scratch, &p);
    const size_t J = (size_t)a->branch_dim + a->rank, HP = p.HP;
    const size_t rt = a->mode == KVT__RECALL_SOUND ? 2u : 6u;
    for (uint32_t c0 = 0; c0 < n; c0 += CHUNK_ROWS) { /* as scan_tiled, a chunk at a time */
        const uint32_t c = n - c0 < CHUNK_ROWS ? n - c0 : CHUNK_ROWS;
        const size_t nr = (c + rt - 1) / rt * rt;
        for (uint32_t i = 0; i < c; i++)
            load_row_vec(a, rows[c0 + i], p.X + i * J);
        memset(p.X + c * J, 0, sizeof(float) * (nr - c) * J);
        tile_scores(p.X, J, p.qT, HP, nr, a->mode == KVT__RECALL_SOUND, p.tacc, p.tpa);
        memcpy(acc + c0 * HP, p.tacc, sizeof(float) * c * HP);
        memcpy(pa + c0 * HP, p.tpa, sizeof(float) * c * HP);
    }
    return 1;
#endif
}
