/*
 * attn_f32.c — the fast fp32 MLA decode attention (attn.h, "fp32 attention"): the same math as
 * kernels/attn.c's double reference, computed the way a GEMM is, so that a benchmark can compare
 * attention over a subset of rows with attention over all of them at a fair speed.
 *
 * Why it can run like a GEMM: a decode step reads every row once for all H heads, H·(key_dim +
 * value_dim) fused multiply-adds per row (32 · 1088 per 1152-B bf16 row on MLA). Rows are taken
 * KVT__ATTN_F32_TILE at a time, widened to fp32 once into a tile buffer, and two small GEMMs run
 * on the tile with one register-blocked micro-kernel C[MR][16] += A[MR][k] · B[k][16] (MR <= 6
 * rows of A broadcast, 16 columns = two 8-float vectors; 12 accumulators, the classic AVX2 sgemm
 * shape):
 *   scores  S[t][h]  = Σ_d  Kt[t][d] · QT[d][h]        (QT: queries transposed, scale folded in)
 *   values  OT[e][h] += Σ_t Kt[t][e] · P[t][h]         (P = exp(S − m) in place of S)
 * Heads are the vector dimension of both, padded to a multiple of 16 with zero queries.
 * The softmax is online (one read of every row): per tile, each head's running max m and sum l
 * are updated, OT and l rescaled by exp(m_old − m_new) when the max moves.
 *
 * Precision: fp32 throughout (scores, exp by a degree-6 polynomial after range reduction — about
 * 2 ulp —, sums). Summation order is the tiling's, not attn.h's fixed one: results agree with
 * the double reference to a relative ~1e-5 (tests/test_attn_f32.c states the bound it checks),
 * not bit for bit.
 *
 * Speed: the entry point is KVT__FMA_CLONES (an FMA clone chosen at load time); the file is
 * compiled with -O3 -ffp-contract=fast (CMakeLists.txt) so `c += a * b` on the vector type is one
 * fused multiply-add. Everything below the entry is always_inline so it is compiled into each
 * clone with the clone's instruction set.
 */
#include "kernels/attn.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define NR 16u    /* columns (heads) of the micro-kernel: two vectors of 8 */
#define MR_MAX 6u /* rows of the micro-kernel */
#define TILE KVT__ATTN_F32_TILE

#define AI static inline __attribute__((always_inline))

/* 8 floats; alignment 4 so any float address may be loaded or stored through it. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

#define LD(p) (*(const v8 *)(const void *)(p))
#define ST(p, v) (*(v8 *)(void *)(p) = (v))

/* (Macros, not functions: a function taking or returning a 32-byte vector draws GCC's ABI note
 * in the default clone.) */
/* Bitwise select: m ? a : b (m lanes all-ones or zero, as vector comparisons give). */
#define VSEL(m, a, b) ((v8)(((vi8)(a) & (m)) | ((vi8)(b) & ~(m))))
#define VBCAST(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})
/* max(a, b) lane-wise; a NaN in b is ignored (b > a is false), a NaN in a is kept. */
#define VMAX(a, b) VSEL((b) > (a), (b), (a))

/* exp(x) lane-wise (Cephes expf: x = n·ln2 + r, |r| <= ln2/2, degree-6 polynomial, then 2^n).
 * x is clamped to [-87, 88] (exp(-87) = 1.6e-38: a weight that small is 0 to every sum here);
 * NaN stays NaN (the clamps compare false). */
AI void vexp(v8 *io) {
    const v8 lo = VBCAST(-87.0f), hi = VBCAST(88.0f);
    v8 x = *io;
    x = VSEL(x < lo, lo, x);
    x = VSEL(x > hi, hi, x);
    const v8 magic = VBCAST(12582912.0f); /* 1.5 · 2^23: adding it rounds to an integer */
    v8 n = (x * 1.44269504088896341f + magic) - magic;
    v8 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8 p = VBCAST(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v8 y = p * (r * r) + r + 1.0f;
    vi8 e = (__builtin_convertvector(n, vi8) + 127) << 23;
    *io = y * (v8)e;
}

/* C[i][0..16) (+)= Σ_k A[i·a_rs + k·a_ks] · B[k·b_ks + 0..16), i < MR. */
AI void micro(const uint32_t MR, uint32_t kn, const float *A, size_t a_rs, size_t a_ks,
              const float *B, size_t b_ks, float *C, size_t c_rs, int accumulate) {
    v8 c0[MR_MAX], c1[MR_MAX];
#pragma GCC unroll 6
    for (uint32_t i = 0; i < MR; i++) {
        if (accumulate) {
            c0[i] = LD(C + i * c_rs);
            c1[i] = LD(C + i * c_rs + 8);
        } else {
            c0[i] = VBCAST(0.0f);
            c1[i] = VBCAST(0.0f);
        }
    }
    for (uint32_t k = 0; k < kn; k++) {
        const v8 b0 = LD(B + k * b_ks), b1 = LD(B + k * b_ks + 8);
        const float *ak = A + k * a_ks;
#pragma GCC unroll 6
        for (uint32_t i = 0; i < MR; i++) {
            const float a = ak[i * a_rs];
            c0[i] += a * b0;
            c1[i] += a * b1;
        }
    }
#pragma GCC unroll 6
    for (uint32_t i = 0; i < MR; i++) {
        ST(C + i * c_rs, c0[i]);
        ST(C + i * c_rs + 8, c1[i]);
    }
}

/* The micro-kernel for rows [0, rows) of A and C, MR_MAX at a time (constant MR per call, so
 * each size is compiled with its accumulators in registers). */
AI void gemm_rows(uint32_t rows, uint32_t kn, const float *A, size_t a_rs, size_t a_ks,
                  const float *B, size_t b_ks, float *C, size_t c_rs, int accumulate) {
    uint32_t i = 0;
    for (; i + MR_MAX <= rows; i += MR_MAX)
        micro(MR_MAX, kn, A + i * a_rs, a_rs, a_ks, B, b_ks, C + i * c_rs, c_rs, accumulate);
    const float *Ai = A + i * a_rs;
    float *Ci = C + i * c_rs;
    switch (rows - i) {
    case 5: micro(5, kn, Ai, a_rs, a_ks, B, b_ks, Ci, c_rs, accumulate); break;
    case 4: micro(4, kn, Ai, a_rs, a_ks, B, b_ks, Ci, c_rs, accumulate); break;
    case 3: micro(3, kn, Ai, a_rs, a_ks, B, b_ks, Ci, c_rs, accumulate); break;
    case 2: micro(2, kn, Ai, a_rs, a_ks, B, b_ks, Ci, c_rs, accumulate); break;
    case 1: micro(1, kn, Ai, a_rs, a_ks, B, b_ks, Ci, c_rs, accumulate); break;
    default: break;
    }
}

/* Row values widened to fp32 (bf16: a shift; fp16: exact conversion; fp32: a copy). */
AI void widen_f32(const uint8_t *row, int dt, uint32_t n, float *out) {
    if (dt == KVT__DT_BF16) {
        for (uint32_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, row + 2 * (size_t)i, 2);
            uint32_t u = (uint32_t)h << 16;
            memcpy(&out[i], &u, 4);
        }
    } else if (dt == KVT__DT_FP32) {
        memcpy(out, row, sizeof(float) * n);
    } else {
        for (uint32_t i = 0; i < n; i++)
            out[i] = kvt__load_elem(row, dt, i);
    }
}

/* Heads rounded up to whole micro-kernel columns. */
static size_t heads_padded(uint32_t n_heads) {
    return ((size_t)n_heads + NR - 1) / NR * NR;
}

size_t kvt__attn_f32_scratch_floats(uint32_t n_heads, uint32_t key_dim, uint32_t value_dim) {
    const size_t HP = heads_padded(n_heads);
    /* QT [K][HP], S/P [TILE][HP], OT [V][HP], m l alpha [HP] each, the tile [TILE][K], and 8
     * floats to align the start to 32 bytes */
    return HP * key_dim + (size_t)TILE * HP + HP * value_dim + 3 * HP + (size_t)TILE * key_dim +
           8;
}

typedef struct work {
    const kvt__attn_f32_args *a;
    size_t HP;
    float *QT, *S, *OT, *m, *l, *al, *Kt;
} work;

/* One tile of tn rows starting at gather position j0: widen, scores, online softmax, values. */
AI void tile_step(const work *w, uint32_t j0, uint32_t tn) {
    const kvt__attn_f32_args *a = w->a;
    const uint32_t K = a->key_dim, V = a->value_dim;
    const size_t HP = w->HP;
    for (uint32_t t = 0; t < tn; t++) {
        size_t slot = a->slots ? (size_t)a->slots[j0 + t] : (size_t)(j0 + t);
        if (a->slots && j0 + t + 8 < a->n_rows) { /* the gathered row 8 ahead: start its lines */
            const uint8_t *nx =
                a->base + (size_t)a->slots[j0 + t + 8] * a->slot_stride + a->row_offset;
            for (size_t b = 0; b < (size_t)K * 2; b += 64)
                __builtin_prefetch(nx + b);
        }
        widen_f32(a->base + slot * a->slot_stride + a->row_offset, a->dtype, K,
                  w->Kt + (size_t)t * K);
    }
    /* scores, 16 heads at a time */
    for (size_t h0 = 0; h0 < HP; h0 += NR)
        gemm_rows(tn, K, w->Kt, K, 1, w->QT + h0, HP, w->S + h0, HP, 0);
    /* online softmax, 8 heads at a time */
    for (size_t h = 0; h < HP; h += 8) {
        v8 tm = VBCAST(-INFINITY);
        for (uint32_t t = 0; t < tn; t++) {
            const v8 st = LD(w->S + t * HP + h);
            tm = VMAX(tm, st);
        }
        const v8 mo = LD(w->m + h), mn = VMAX(mo, tm);
        v8 al = mo - mn;
        vexp(&al);
        v8 ls = LD(w->l + h) * al;
        for (uint32_t t = 0; t < tn; t++) {
            v8 p = LD(w->S + t * HP + h) - mn;
            vexp(&p);
            ST(w->S + t * HP + h, p);
            ls += p;
        }
        ST(w->m + h, mn);
        ST(w->l + h, ls);
        ST(w->al + h, al);
    }
    /* rescale the accumulators of the heads whose max moved */
    for (size_t h = 0; h < HP; h += 8) {
        const v8 al = LD(w->al + h);
        int moved = 0;
        for (int i = 0; i < 8; i++)
            moved |= al[i] != 1.0f;
        if (moved)
            for (uint32_t e = 0; e < V; e++)
                ST(w->OT + (size_t)e * HP + h, LD(w->OT + (size_t)e * HP + h) * al);
    }
    /* values: OT[e][h] += Σ_t Kt[t][e] · P[t][h] */
    for (uint32_t e0 = 0; e0 < V; e0 += 48) {
        uint32_t en = V - e0 < 48 ? V - e0 : 48;
        for (size_t h0 = 0; h0 < HP; h0 += NR)
            gemm_rows(en, tn, w->Kt + e0, 1, K, w->S + h0, HP, w->OT + (size_t)e0 * HP + h0, HP,
                      1);
    }
}

KVT__FMA_CLONES
static void run_tiles(const work *w) {
    const uint32_t N = w->a->n_rows;
    for (uint32_t j0 = 0; j0 < N; j0 += TILE)
        tile_step(w, j0, N - j0 < TILE ? N - j0 : TILE);
}

int kvt__attn_f32_cpu(const kvt__attn_f32_args *a) {
    if (!a || !a->q || !a->scratch || (a->n_rows > 0 && !a->base) || a->key_dim == 0 ||
        a->key_dim > KVT__ATTN_MAX_DIM || a->value_dim > a->key_dim || a->q_stride < a->key_dim)
        return -1;
    if (a->dtype != KVT__DT_BF16 && a->dtype != KVT__DT_FP16 && a->dtype != KVT__DT_FP32)
        return -1;
    if (a->slots)
        for (uint32_t j = 0; j < a->n_rows; j++)
            if (a->slots[j] < 0)
                return -1;
    const uint32_t H = a->n_heads, K = a->key_dim, V = a->value_dim;
    if (a->n_rows == 0) {
        for (uint32_t h = 0; h < H; h++) {
            if (a->out)
                memset(a->out + (size_t)h * V, 0, sizeof(float) * V);
            if (a->lse)
                a->lse[h] = -INFINITY;
            if (a->max_score)
                a->max_score[h] = -INFINITY;
        }
        return 0;
    }
    work w = {.a = a, .HP = heads_padded(H)};
    const size_t HP = w.HP;
    float *s = (float *)(((uintptr_t)a->scratch + 31) & ~(uintptr_t)31);
    w.QT = s;
    w.S = w.QT + HP * K;
    w.OT = w.S + (size_t)TILE * HP;
    w.m = w.OT + HP * V;
    w.l = w.m + HP;
    w.al = w.l + HP;
    w.Kt = w.al + HP;
    const float sc = (float)a->scale;
    for (uint32_t d = 0; d < K; d++)
        for (size_t h = 0; h < HP; h++)
            w.QT[d * HP + h] = h < H ? sc * a->q[h * a->q_stride + d] : 0.0f;
    for (size_t h = 0; h < HP; h++) {
        w.m[h] = -INFINITY;
        w.l[h] = 0.0f;
    }
    memset(w.OT, 0, sizeof(float) * HP * V);
    run_tiles(&w);
    for (uint32_t h = 0; h < H; h++) {
        const float inv = 1.0f / w.l[h];
        if (a->out)
            for (uint32_t e = 0; e < V; e++)
                a->out[(size_t)h * V + e] = w.OT[(size_t)e * HP + h] * inv;
        if (a->lse)
            a->lse[h] = w.m[h] + logf(w.l[h]);
        if (a->max_score)
            a->max_score[h] = w.m[h];
    }
    return 0;
}
