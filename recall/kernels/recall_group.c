/*
 * recall_group.c — CPU twins of the recall tier's groups and the pruned scan
 * (recall_group.h for the layout, the build's rules and the bound). The loops only
 * arrange the KVT_HD functions; the rows of a group that is not skipped go through the full
 * scan's own row evaluation (kvt__recall_rows_fire_cpu: the tiled scan's chunks on AVX2/FMA
 * CPUs, kvt__recall_row_fires_cpu row by row elsewhere), so every fire decision is the full
 * scan's.
 */
#include "recall/kernels/recall_group.h"

#include "kernels/backend.h"
#include "lib/base/base.h"

#include <stdlib.h>
#include <string.h>

/* Heads whose y·c chains advance together (independent chains: one vector instruction). */
#define YC_TILE 8u

static size_t align8(size_t b) {
    return (b + 7u) & ~(size_t)7u;
}

/* XT's row stride for B rows: B + 16 floats, so that its rows do not share cache sets (B is a
 * power of two: a stride of B floats would put every row of a column in one set). */
static size_t xt_stride(uint32_t B) {
    return (size_t)B + 16u;
}

size_t kvt__recall_group_scratch_bytes(uint32_t B, uint32_t branch_dim, uint32_t rank) {
    const size_t n = (size_t)branch_dim + rank;
    /* embeddings [B][n], projections by row and sorted [2][B], sort keys and the sort's [2][B]
     * (u64), a mean [n], a direction [n]; then the wide path's: the embeddings transposed in the build's order
     * [n][B], a segment's positions before its sort, where each position's row was, and a
     * row of XT reordered [3][B] */
    return align8(sizeof(float) * ((size_t)B * n + 2 * (size_t)B)) + sizeof(uint64_t) * 2 * B +
           sizeof(float) * 2 * n + sizeof(float) * (xt_stride(B) * n + 3 * (size_t)B);
}

/* fp32 mean of the embeddings of perm[lo .. hi) (sum in that order from +0, then / count). */
static void seg_mean(const float *restrict X, size_t n, const uint32_t *perm, uint32_t lo,
                     uint32_t hi, float *restrict m) {
    for (size_t j = 0; j < n; j++)
        m[j] = 0.0f;
    for (uint32_t i = lo; i < hi; i++) {
        const float *x = X + (size_t)perm[i] * n;
        for (size_t j = 0; j < n; j++)
            m[j] += x[j];
    }
    const float cnt = (float)(hi - lo);
    for (size_t j = 0; j < n; j++)
        m[j] /= cnt;
}

/* Rows whose chains advance together in the build (each keeps its own: bits unchanged). */
#define ROW_TILE 8u

/* The AVX-512 chains (x86-64): 32 rows at a time, one per lane of two 512-bit accumulators,
 * element j of the 16 rows of a register loaded side by side from the build's transposed copy,
 * or gathered (the rows are scattered by perm). Each lane
 * runs its row's chain in its order from +0 with the same operations (d = x − c, then
 * fmaf(d, d, acc); or fmaf(c, x, acc)): the bits of the loop below. The narrow loop kept its
 * accumulators in memory (a store and a load on every step of every chain). */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define GROUP_WIDE 1

/* With XT (the embeddings transposed in perm's order, row stride S: XT[j·S + i] =
 * X[perm[i]·n + j]) the lanes load positions [lo, hi) of it; without, element j of each lane's
 * row is gathered from X through perm. */
__attribute__((target("avx512f"))) static void seg_chains_wide(const float *X, uint32_t n,
                                                               const uint32_t *perm,
                                                               const float *XT, size_t S,
                                                               uint32_t lo, uint32_t hi,
                                                               const float *c, int dot,
                                                               float *out) {
    for (uint32_t i0 = lo; i0 < hi; i0 += 32u) {
        const uint32_t nt = hi - i0 < 32u ? hi - i0 : 32u;
        const __mmask16 k0 = nt >= 16u ? (__mmask16)0xffffu : (__mmask16)((1u << nt) - 1u);
        const __mmask16 k1 = nt >= 32u   ? (__mmask16)0xffffu
                             : nt > 16u ? (__mmask16)((1u << (nt - 16u)) - 1u)
                                        : (__mmask16)0;
        int32_t idx[32];
        for (uint32_t t = 0; !XT && t < 32u; t++)
            idx[t] = (int32_t)(perm[t < nt ? i0 + t : i0] * n);
        const __m512i v0 = XT ? _mm512_setzero_si512() : _mm512_loadu_si512(idx);
        const __m512i v1 = XT ? _mm512_setzero_si512() : _mm512_loadu_si512(idx + 16);
        const float *x = XT ? XT + i0 : NULL;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (uint32_t j = 0; j < n; j++) {
            const __m512 cj = _mm512_set1_ps(c[j]);
            __m512 x0, x1;
            if (XT) {
                x0 = _mm512_maskz_loadu_ps(k0, x + (size_t)j * S);
                x1 = _mm512_maskz_loadu_ps(k1, x + (size_t)j * S + 16);
            } else {
                x0 = _mm512_i32gather_ps(v0, X + j, 4);
                x1 = _mm512_i32gather_ps(v1, X + j, 4);
            }
            if (dot) {
                a0 = _mm512_fmadd_ps(cj, x0, a0);
                a1 = _mm512_fmadd_ps(cj, x1, a1);
            } else {
                const __m512 d0 = _mm512_sub_ps(x0, cj), d1 = _mm512_sub_ps(x1, cj);
                a0 = _mm512_fmadd_ps(d0, d0, a0);
                a1 = _mm512_fmadd_ps(d1, d1, a1);
            }
        }
        float acc[32];
        _mm512_storeu_ps(acc, a0);
        _mm512_storeu_ps(acc + 16, a1);
        for (uint32_t t = 0; t < nt; t++)
            out[i0 - lo + t] = acc[t];
    }
}

/* Row u's embedding into X[u·n ..] (kvt__recall_embed's values: a bf16 branch by the shift, fp16
 * sketch values by the conversion instruction, exact for every finite value; a run of 16 holding
 * an Inf or NaN, and any other dtype, value by value). */
__attribute__((target("avx512f"))) static void embed_wide(const uint8_t *row,
                                                          uint32_t branch_offset,
                                                          int branch_dtype, uint32_t branch_dim,
                                                          const uint16_t *csk, uint32_t rank,
                                                          float *x) {
    uint32_t j = 0;
    if (branch_dtype == KVT__DT_BF16)
        for (; j + 16u <= branch_dim; j += 16u) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(row + branch_offset + 2u * j));
            _mm512_storeu_si512(x + j, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    for (; j < branch_dim; j++)
        x[j] = kvt__recall_embed(row, branch_offset, branch_dtype, branch_dim, csk, j);
    uint32_t k = 0;
    for (; k + 16u <= rank; k += 16u) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(csk + k));
        const __m256i e = _mm256_and_si256(h, _mm256_set1_epi16(0x7c00));
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(e, _mm256_set1_epi16(0x7c00))))
            break;
        _mm512_storeu_ps(x + branch_dim + k, _mm512_cvtph_ps(h));
    }
    for (; k < rank; k++)
        x[branch_dim + k] = kvt__f16_to_f32(csk[k]);
}

/* XT[j·xt_stride(B) + u] = X[u·n + j] for rows [0, B) (16 × 16 tiles; B a multiple of 16). */
static void transpose_x(const float *restrict X, uint32_t B, uint32_t n, float *restrict XT) {
    const size_t S = xt_stride(B);
    for (uint32_t u0 = 0; u0 < B; u0 += 16u)
        for (uint32_t j0 = 0; j0 < n; j0 += 16u) {
            const uint32_t jn = n - j0 < 16u ? n - j0 : 16u;
            for (uint32_t u = u0; u < u0 + 16u; u++)
                for (uint32_t j = j0; j < j0 + jn; j++)
                    XT[(size_t)j * S + u] = X[(size_t)u * n + j];
        }
}

/* xr[lo + i] = xr[src[lo + i]] for i < cnt, through tmp (cnt floats). */
__attribute__((target("avx512f"))) static void permute_row(float *xr, const uint32_t *src,
                                                           uint32_t lo, uint32_t cnt,
                                                           float *tmp) {
    uint32_t i = 0;
    for (; i + 16u <= cnt; i += 16u)
        _mm512_storeu_ps(tmp + i, _mm512_i32gather_ps(_mm512_loadu_si512(src + lo + i), xr, 4));
    for (; i < cnt; i++)
        tmp[i] = xr[src[lo + i]];
    memcpy(xr + lo, tmp, sizeof(float) * cnt);
}

/* seg_mean on the wide path: each value's sum over the rows in perm's order (16 values to a
 * register, up to 8 registers at a time), so the bits are seg_mean's. */
__attribute__((target("avx512f"))) static void seg_mean_wide(const float *X, uint32_t n,
                                                             const uint32_t *perm, uint32_t lo,
                                                             uint32_t hi, float *m) {
    uint32_t j0 = 0;
    for (; j0 + 128u <= n; j0 += 128u) {
        __m512 a[8];
        for (int t = 0; t < 8; t++)
            a[t] = _mm512_setzero_ps();
        for (uint32_t i = lo; i < hi; i++) {
            const float *x = X + (size_t)perm[i] * n + j0;
            for (int t = 0; t < 8; t++)
                a[t] = _mm512_add_ps(a[t], _mm512_loadu_ps(x + 16 * t));
        }
        for (int t = 0; t < 8; t++)
            _mm512_storeu_ps(m + j0 + 16 * t, a[t]);
    }
    for (; j0 < n; j0 += 16u) {
        const __mmask16 k = n - j0 >= 16u ? (__mmask16)0xffffu : (__mmask16)((1u << (n - j0)) - 1u);
        __m512 a = _mm512_setzero_ps();
        for (uint32_t i = lo; i < hi; i++)
            a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(k, X + (size_t)perm[i] * n + j0));
        _mm512_mask_storeu_ps(m + j0, k, a);
    }
    const float cnt = (float)(hi - lo);
    for (uint32_t j = 0; j < n; j++)
        m[j] /= cnt;
}

static int group_wide_enabled = 1;

int kvt__recall_group_wide(int enable) {
    if (enable >= 0)
        group_wide_enabled = enable;
    return group_wide_enabled && __builtin_cpu_supports("avx512f");
}
#else
int kvt__recall_group_wide(int enable) {
    (void)enable;
    return 0;
}
#endif

/* out[i − lo] = kvt__recall_dist2(x_perm[i], c) (dot = 0) or the fmaf chain of c·x_perm[i]
 * (dot = 1) for i in [lo, hi), ROW_TILE rows' chains interleaved (32 on the wide path; X's
 * offsets must fit an int32: B·n < 2^31, which B <= 2^20 and n <= 512 keep). */
KVT__FMA_CLONES
static void seg_chains(const float *X, uint32_t n, const uint32_t *perm, uint32_t lo, uint32_t hi,
                       const float *c, int dot, int wide, float *out) {
#if defined(GROUP_WIDE)
    if (wide) {
        seg_chains_wide(X, n, perm, NULL, 0, lo, hi, c, dot, out);
        return;
    }
#endif
    (void)wide;
    for (uint32_t i0 = lo; i0 < hi; i0 += ROW_TILE) {
        const float *x[ROW_TILE];
        float acc[ROW_TILE];
        const uint32_t nt = hi - i0 < ROW_TILE ? hi - i0 : ROW_TILE;
        for (uint32_t t = 0; t < ROW_TILE; t++) {
            x[t] = X + (size_t)perm[t < nt ? i0 + t : i0] * n;
            acc[t] = 0.0f;
        }
        if (dot)
            for (uint32_t j = 0; j < n; j++)
                for (uint32_t t = 0; t < ROW_TILE; t++)
                    acc[t] = fmaf(c[j], x[t][j], acc[t]);
        else
            for (uint32_t j = 0; j < n; j++)
                for (uint32_t t = 0; t < ROW_TILE; t++) {
                    const float d = x[t][j] - c[j];
                    acc[t] = fmaf(d, d, acc[t]);
                }
        for (uint32_t t = 0; t < nt; t++)
            out[i0 - lo + t] = acc[t];
    }
}

void kvt__recall_group_chains(const float *X, uint32_t n, const uint32_t *perm, uint32_t lo,
                              uint32_t hi, const float *c, int dot, int wide, float *out) {
    seg_chains(X, n, perm, lo, hi, c, dot, wide && kvt__recall_group_wide(-1), out);
}

/* out[i − lo] for positions [lo, hi) as seg_chains gives them, from XT (the embeddings
 * transposed in perm's order, [n][B]) where the build keeps it (the wide path): the same bits. */
static void build_chains(const float *X, const float *XT, uint32_t B, uint32_t n,
                         const uint32_t *perm, uint32_t lo, uint32_t hi, const float *c, int dot,
                         int wide, float *out) {
#if defined(GROUP_WIDE)
    if (XT) {
        seg_chains_wide(X, n, perm, XT, xt_stride(B), lo, hi, c, dot, out);
        return;
    }
#endif
    (void)XT;
    (void)B;
    seg_chains(X, n, perm, lo, hi, c, dot, wide, out);
}

/* seg_mean's values, on the wide path where it runs (the same bits). */
static void build_mean(const float *X, uint32_t n, const uint32_t *perm, uint32_t lo, uint32_t hi,
                       int wide, float *m) {
#if defined(GROUP_WIDE)
    if (wide) {
        seg_mean_wide(X, n, perm, lo, hi, m);
        return;
    }
#endif
    (void)wide;
    seg_mean(X, n, perm, lo, hi, m);
}

/* The member of perm[lo .. hi) farthest from c (the first on a tie; a NaN distance never wins).
 * d: hi − lo floats of scratch. */
static uint32_t seg_farthest(const float *X, const float *XT, uint32_t B, uint32_t n,
                             const uint32_t *perm, uint32_t lo, uint32_t hi, const float *c,
                             int wide, float *d) {
    build_chains(X, XT, B, n, perm, lo, hi, c, 0, wide, d);
    uint32_t best = perm[lo];
    float bd = -1.0f;
    for (uint32_t i = lo; i < hi; i++)
        if (d[i - lo] > bd) {
            bd = d[i - lo];
            best = perm[i];
        }
    return best;
}

/* k[0 .. cnt) ascending, through tmp (cnt keys): a least-significant-byte-first radix sort,
 * each pass stable, a pass whose byte every key shares skipped. The keys are distinct, so the
 * order is the unique ascending one (what any sort gives). */
static void sort_keys(uint64_t *k, uint64_t *tmp, uint32_t cnt) {
    uint64_t *a = k, *b = tmp;
    for (uint32_t sh = 0; sh < 64u; sh += 8u) {
        uint32_t h[256] = {0};
        for (uint32_t i = 0; i < cnt; i++)
            h[a[i] >> sh & 0xffu]++;
        if (h[a[0] >> sh & 0xffu] == cnt)
            continue;
        for (uint32_t d = 0, at = 0; d < 256u; d++) {
            const uint32_t c = h[d];
            h[d] = at;
            at += c;
        }
        for (uint32_t i = 0; i < cnt; i++)
            b[h[a[i] >> sh & 0xffu]++] = a[i];
        uint64_t *t = a;
        a = b;
        b = t;
    }
    if (a != k)
        memcpy(k, a, sizeof *k * cnt);
}

KVT__FMA_CLONES
void kvt__recall_group_block_cpu(const uint8_t *base, const int32_t *slots, uint32_t B,
                                 size_t slot_stride, uint32_t branch_offset, int branch_dtype,
                                 uint32_t branch_dim, const uint16_t *csk, uint32_t csk_stride,
                                 const float *rho, uint32_t rank, uint32_t dim, void *scratch,
                                 const kvt__recall_group_block *out) {
    const uint32_t n = branch_dim + rank, G = kvt__recall_group_slots(B);
    float *X = scratch, *tv = X + (size_t)B * n, *ts = tv + B;
    uint64_t *key =
        (uint64_t *)((uint8_t *)scratch + align8(sizeof(float) * ((size_t)B * n + 2 * B)));
    uint64_t *ktmp = key + B;
    float *m = (float *)(ktmp + B), *v = m + n;
    uint32_t *perm = out->perm;
    /* the wide chains gather X at int32 offsets */
    const int wide = kvt__recall_group_wide(-1) && (uint64_t)B * n < ((uint64_t)1 << 31);
    /* the wide path's splits read XT (X transposed, kept in perm's order: its rows side by side) */
    float *XT = wide ? v + n : NULL;
    uint32_t *pos = wide ? (uint32_t *)(XT + xt_stride(B) * n) : NULL, *src = pos ? pos + B : NULL;
    float *tmp = src ? (float *)(src + B) : NULL;
    for (uint32_t u = 0; u < B; u++) {
        const uint8_t *row = base + (size_t)slots[u] * slot_stride;
#if defined(GROUP_WIDE)
        if (wide)
            embed_wide(row, branch_offset, branch_dtype, branch_dim, csk + (size_t)u * csk_stride,
                       rank, X + (size_t)u * n);
        else
#endif
            for (uint32_t j = 0; j < n; j++)
                X[(size_t)u * n + j] = kvt__recall_embed(
                    row, branch_offset, branch_dtype, branch_dim, csk + (size_t)u * csk_stride, j);
        perm[u] = u;
    }
#if defined(GROUP_WIDE)
    if (XT)
        transpose_x(X, B, n, XT);
#endif
    /* Depth-first, left first: each split leaves at most 3/4 of its segment on a side, so the
     * stack holds at most log_{4/3}(B / 32) + 1 segments (47 at B = 2^20). */
    uint32_t stack[2 * 64], sp = 0, ng = 0;
    stack[sp++] = 0;
    stack[sp++] = B;
    while (sp) {
        const uint32_t hi = stack[--sp], lo = stack[--sp], cnt = hi - lo;
        if (cnt <= KVT__RECALL_GROUP_MAX) {
            out->end[ng++] = hi;
            continue;
        }
        build_mean(X, n, perm, lo, hi, wide, m);
        const uint32_t p1 = seg_farthest(X, XT, B, n, perm, lo, hi, m, wide, ts);
        const uint32_t p2 = seg_farthest(X, XT, B, n, perm, lo, hi, X + (size_t)p1 * n, wide, ts);
        for (uint32_t j = 0; j < n; j++)
            v[j] = X[(size_t)p2 * n + j] - X[(size_t)p1 * n + j];
        build_chains(X, XT, B, n, perm, lo, hi, v, 1, wide, ts); /* t_a = v·x_a */
        for (uint32_t i = lo; i < hi; i++) {
            tv[perm[i]] = ts[i - lo];
            key[i] = (uint64_t)kvt__recall_order_key(ts[i - lo]) << 32 | perm[i];
            if (pos)
                pos[perm[i]] = i;
        }
        sort_keys(key + lo, ktmp, cnt); /* keys are distinct: the order is unique */
        for (uint32_t i = lo; i < hi; i++) {
            perm[i] = (uint32_t)key[i];
            ts[i] = tv[perm[i]];
            if (src)
                src[i] = pos[perm[i]];
        }
#if defined(GROUP_WIDE)
        for (uint32_t j = 0; XT && j < n; j++) /* XT follows perm */
            permute_row(XT + (size_t)j * xt_stride(B), src, lo, cnt, tmp);
#endif
        const uint32_t k = kvt__recall_group_cut(ts + lo, cnt);
        stack[sp++] = lo + k;
        stack[sp++] = hi;
        stack[sp++] = lo;
        stack[sp++] = lo + k;
    }
    *out->n_groups = ng;
    /* members ascending within each group: a scan reads them in row order */
    for (uint32_t g = 0, lo = 0; g < ng; lo = out->end[g++])
        for (uint32_t i = lo + 1; i < out->end[g]; i++)
            for (uint32_t j = i, x = perm[i]; j > lo && perm[j - 1] > x; j--) {
                perm[j] = perm[j - 1];
                perm[j - 1] = x;
            }
    uint32_t start = 0;
    for (uint32_t g = 0; g < G; g++) {
        float *c = out->centre + (size_t)g * dim, *st = out->stat + (size_t)g * KVT__RG_STATS;
        if (g >= ng) { /* unused slots: zero, so the planes are a function of the rows */
            out->end[g] = B;
            memset(c, 0, sizeof(float) * dim);
            memset(st, 0, sizeof(float) * KVT__RG_STATS);
            continue;
        }
        const uint32_t e = out->end[g];
        build_mean(X, n, perm, start, e, wide, c);
        for (uint32_t j = n; j < dim; j++)
            c[j] = 0.0f;
        /* the members' kvt__recall_dist2 to the centre, their chains side by side */
        seg_chains(X, n, perm, start, e, c, 0, wide, ts);
        kvt__recall_group_acc acc = kvt__recall_group_acc_new();
        for (uint32_t i = start; i < e; i++) {
            const uint32_t u = perm[i];
            kvt__recall_group_acc_take(&acc, ts[i - start], n, rho[u],
                                       kvt__recall_csk_norm(csk + (size_t)u * csk_stride, rank));
        }
        kvt__recall_group_acc_stat(&acc, kvt__recall_norm2(c, n), n, st);
        start = e;
    }
}

size_t kvt__recall_group_build_scratch_bytes(uint32_t B, uint32_t branch_dim, uint32_t rank) {
    return align8(sizeof(int32_t) * (size_t)B) + kvt__recall_group_scratch_bytes(B, branch_dim, rank);
}

void kvt__recall_group_build_cpu(const kvt__recall_scan_args *a, uint32_t B, uint32_t dim,
                                 uint32_t stride, const kvt__recall_group_block *planes,
                                 uint64_t from, uint64_t to, void *scratch) {
    const uint32_t G = kvt__recall_group_slots(B);
    const uint64_t step = stride ? stride : 1u;
    int32_t *slots = scratch;
    void *ws = (uint8_t *)scratch + align8(sizeof(int32_t) * (size_t)B);
    for (uint64_t blk = from; blk < to; blk++) {
        for (uint32_t u = 0; u < B; u++)
            slots[u] = kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)(blk * B + u));
        const uint64_t k = blk * step;
        kvt__recall_group_block out = {.perm = planes->perm + k * B,
                                       .n_groups = planes->n_groups + k,
                                       .end = planes->end + k * G,
                                       .centre = planes->centre + k * G * dim,
                                       .stat = planes->stat + k * G * KVT__RG_STATS};
        kvt__recall_group_block_cpu(a->base, slots, B, a->slot_stride, a->branch_offset,
                                    a->branch_dtype, a->branch_dim, kvt__scan_csk(a, blk * B),
                                    a->csk_stride, kvt__scan_rho(a, blk * B), a->rank, dim, ws, &out);
    }
}

int kvt__recall_groups_ok(const kvt__recall_scan_args *a, const kvt__recall_groups *g) {
    const uint32_t B = g->block_rows;
    if (!g->n_blocks)
        return 1;
    if (!(B >= 64u && (B & (B - 1u)) == 0 && g->n_blocks <= a->n_closed / B &&
          g->dim >= a->branch_dim + a->rank && g->perm && g->n_groups && g->end && g->centre &&
          g->stat))
        return 0;
    /* the planes' indices in range (what a scan dereferences): n_groups, the group ends
     * ascending with 32..64 rows each and the last at B, the row offsets below B */
    const uint32_t G = kvt__recall_group_slots(B);
    const uint64_t step = g->stride ? g->stride : 1u;
    for (uint64_t b = 0; b < g->n_blocks; b++) {
        const uint64_t k = b * step;
        const uint32_t ng = g->n_groups[k], *end = g->end + k * G, *perm = g->perm + k * B;
        if (ng == 0 || ng > G || end[ng - 1] != B)
            return 0;
        for (uint32_t i = 0, lo = 0; i < ng; lo = end[i++])
            if (end[i] < lo + KVT__RECALL_GROUP_MIN || end[i] > lo + KVT__RECALL_GROUP_MAX)
                return 0;
        for (uint32_t u = 0; u < B; u++)
            if (perm[u] >= B)
                return 0;
    }
    return 1;
}

/* The pruned scan's scratch after the full scan's: the live heads' queries [n][HP] and y·c
 * [HP] (floats), Y [H] (doubles), the live heads [H] (u32), then the kept and fired bitmaps
 * (u64 words over the closed rows). */
typedef struct prune_ws {
    float *qL, *yc;
    double *Y;
    kvt__recall_q8h *h8; /* the heads' 8-bit values (an 8-bit scan) */
    uint32_t *hmap;
    uint8_t *hok; /* each head's kvt__recall_upper_head_ok */
    uint64_t *kept, *fired;
} prune_ws;

static size_t prune_layout(uint32_t H, uint32_t rank, uint32_t D, uint64_t n_closed,
                           void *scratch, prune_ws *w) {
    const size_t HP = kvt__recall_scan_heads_padded(H);
    const size_t n = KVT__RECALL_MAX_BRANCH + rank, words = (n_closed + 63u) / 64u;
    size_t off = align8(sizeof(float) * kvt__recall_scan_scratch_floats(H, rank, D));
    uint8_t *b = scratch;
    if (w) {
        w->qL = (float *)(b + off);
        w->yc = w->qL + n * HP;
    }
    off = align8(off + sizeof(float) * (n * HP + HP));
    if (w)
        w->Y = (double *)(b + off);
    off += sizeof(double) * H;
    if (w)
        w->h8 = (kvt__recall_q8h *)(b + off);
    off = align8(off + sizeof(kvt__recall_q8h) * H);
    if (w)
        w->hmap = (uint32_t *)(b + off);
    off = align8(off + sizeof(uint32_t) * H);
    if (w)
        w->hok = b + off;
    off = align8(off + H);
    if (w) {
        w->kept = (uint64_t *)(b + off);
        w->fired = w->kept + words;
    }
    return off + sizeof(uint64_t) * 2 * words;
}

size_t kvt__recall_scan_pruned_scratch_bytes(uint32_t n_heads, uint32_t rank, uint32_t D,
                                             uint64_t n_closed) {
    return prune_layout(n_heads, rank, D, n_closed, NULL, NULL);
}

static int bit(const uint64_t *w, uint64_t i) {
    return (int)(w[i >> 6] >> (i & 63u) & 1u);
}

KVT__FMA_CLONES
void kvt__recall_scan_pruned_cpu(const kvt__recall_scan_args *a, const kvt__recall_groups *g,
                                 void *scratch, kvt__recall_prune_stats *stats) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim, rank = a->rank, H = a->n_heads;
    const uint32_t n = bd + rank;
    const size_t qdim = (size_t)D + bd;
    kvt__recall_scan_prep p;
    kvt__recall_scan_prep_cpu(a, scratch, &p);
    prune_ws w;
    prune_layout(H, rank, D, a->n_closed, scratch, &w);
    const size_t words = (a->n_closed + 63u) / 64u, HP = p.HP;
    memset(w.kept, 0, sizeof(uint64_t) * 2 * words);
    /* the bound's parts of the layer and of each head, once (kvt__recall_group_upper_at) */
    const kvt__recall_upper_k uk = kvt__recall_upper_consts(D, bd, rank, a->q8_off);
    for (uint32_t h = 0; h < H; h++) {
        w.Y[h] = kvt__recall_group_ynorm(a->q + h * qdim + D, p.q_sk + (size_t)h * rank, bd, rank);
        if (a->q8_off)
            w.h8[h] = kvt__recall_scan_q8h(&p, h);
        w.hok[h] = (uint8_t)kvt__recall_upper_head_ok(&p.heads[h], a->q8_off ? &w.h8[h] : NULL,
                                                      w.Y[h], a->mode, a->scale, a->z);
    }
    kvt__recall_prune_stats s = {0};
    s.archived = a->n_closed > a->sinks ? a->n_closed - a->sinks : 0;
    for (uint32_t i = 0; i < a->m; i++)
        if (a->kept[i] < a->n_closed) {
            w.kept[a->kept[i] >> 6] |= (uint64_t)1 << (a->kept[i] & 63u);
            s.archived -= a->kept[i] >= a->sinks;
        }
    const uint32_t B = g->block_rows, G = g->n_blocks ? kvt__recall_group_slots(B) : 0;
    const uint64_t step = g->stride ? g->stride : 1u;
    for (uint64_t b = 0; b < g->n_blocks; b++) {
        const uint64_t k = b * step; /* the block's plane slot */
        const uint32_t *perm = g->perm + k * B, *end = g->end + k * G;
        uint32_t start = 0;
        for (uint32_t gi = 0; gi < g->n_groups[k]; start = end[gi++]) {
            const float *c = g->centre + (k * G + gi) * g->dim;
            const float *st = g->stat + (k * G + gi) * KVT__RG_STATS;
            s.groups++;
            /* y·c of every head, YC_TILE chains at a time (kvt__recall_group_ydot's order) */
            for (size_t h0 = 0; h0 < HP; h0 += YC_TILE) {
                float acc[YC_TILE];
                for (uint32_t t = 0; t < YC_TILE; t++)
                    acc[t] = 0.0f;
                for (uint32_t j = 0; j < n; j++) {
                    const float *qj = p.qT + j * HP + h0, cj = c[j];
#pragma GCC unroll 8
                    for (uint32_t t = 0; t < YC_TILE; t++)
                        acc[t] = fmaf(qj[t], cj, acc[t]);
                }
                for (uint32_t t = 0; t < YC_TILE; t++)
                    w.yc[h0 + t] = acc[t];
            }
            /* kvt__recall_group_live per head, the group's part of the bound taken once */
            const kvt__recall_upper_g ug = kvt__recall_upper_group(st, &uk, a->q8_off != 0);
            uint32_t nl = 0;
            for (uint32_t h = 0; h < H; h++)
                if (!(kvt__recall_group_upper_at(&p.heads[h], a->q8_off ? &w.h8[h] : NULL, w.Y[h],
                                                 w.yc[h], &ug, &uk, w.hok[h], a->mode, a->scale,
                                                 a->z, D, bd, rank) < (double)a->best[h]))
                    w.hmap[nl++] = h;
            if (!nl)
                continue;
            s.groups_visited++;
            s.head_groups += nl;
            /* the live heads' columns, tiles padded with zero columns */
            const size_t LP = kvt__recall_scan_heads_padded(nl);
            const float *qL = p.qT;
            size_t QP = HP;
            if (nl < H && !a->q8_off) { /* (the 8-bit evaluation reads hmap, not columns) */
                for (uint32_t j = 0; j < n; j++)
                    for (size_t t = 0; t < LP; t++)
                        w.qL[j * LP + t] = t < nl ? p.qT[j * HP + w.hmap[t]] : 0.0f;
                qL = w.qL;
                QP = LP;
            }
            /* the archived members, evaluated together (kvt__recall_rows_fire_cpu: the full
             * scan's tiles where it runs them, each fire decision the row-wise one's) */
            uint64_t rows[KVT__RECALL_GROUP_MAX];
            uint8_t fire[KVT__RECALL_GROUP_MAX];
            uint32_t nm = 0;
            for (uint32_t i = start; i < end[gi] && nm < KVT__RECALL_GROUP_MAX; i++) {
                const uint64_t row = b * B + perm[i];
                if (row >= a->sinks && !bit(w.kept, row))
                    rows[nm++] = row;
            }
            s.visited += nm;
            kvt__recall_rows_fire_cpu(a, &p, qL, QP, nl < H ? w.hmap : NULL, nl, rows, nm, fire);
            for (uint32_t i = 0; i < nm; i++)
                if (fire[i])
                    w.fired[rows[i] >> 6] |= (uint64_t)1 << (rows[i] & 63u);
        }
    }
    /* closed rows past the grouped blocks: every one, every head, 64 at a time */
    for (uint64_t row = g->n_blocks * B; row < a->n_closed;) {
        uint64_t rows[64];
        uint8_t fire[64];
        uint32_t nm = 0;
        for (; row < a->n_closed && nm < 64u; row++)
            if (row >= a->sinks && !bit(w.kept, row))
                rows[nm++] = row;
        s.visited += nm;
        kvt__recall_rows_fire_cpu(a, &p, p.qT, HP, NULL, H, rows, nm, fire);
        for (uint32_t i = 0; i < nm; i++)
            if (fire[i])
                w.fired[rows[i] >> 6] |= (uint64_t)1 << (rows[i] & 63u);
    }
    /* ascending: the first min(W, fired), overflow when more fired */
    uint32_t count = 0, over = 0;
    for (size_t i = 0; i < words && !over; i++)
        for (uint64_t x = w.fired[i]; x; x &= x - 1) {
            if (count == a->cap) {
                over = 1;
                break;
            }
            a->fired[count++] = (uint32_t)(i * 64u + (uint64_t)__builtin_ctzll(x));
        }
    *a->n_fired = count;
    *a->overflow = over;
    if (stats)
        *stats = s;
}
