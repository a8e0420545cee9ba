/*
 * recall_scan.c — CPU twin of the recall scan (kernels/recall_scan.h for the math and its fixed
 * orders). The loops only arrange the KVT_HD functions: a CUDA kernel over the same functions
 * (one thread per (row, head), an OR over heads, a compaction of fired rows in row order) gives
 * the same fired set.
 */
#include "kernels/recall_scan.h"

#include "kernels/backend.h"
#include "lib/base/base.h"

#include <string.h>

/* Per head: rank projection values, then the kvt__recall_head fields. */
#define HEAD_FLOATS(rank) ((size_t)(rank) + 5u)
/* Heads whose idx chains advance together (independent chains: one vector instruction). */
#define SCAN_TILE 8u

/* Heads rounded up to whole tiles. */
static size_t heads_padded(uint32_t n_heads) {
    return ((size_t)n_heads + SCAN_TILE - 1) / SCAN_TILE * SCAN_TILE;
}

size_t kvt__recall_scan_scratch_floats(uint32_t n_heads, uint32_t rank, uint32_t D) {
    /* heads' q̃_sk and fields; tmp [D]; the transposed queries [branch + rank][padded heads];
     * the row's branch and sketch as fp32 */
    return (size_t)n_heads * HEAD_FLOATS(rank) + KVT__RECALL_PREP_FLOATS(D) +
           heads_padded(n_heads) * (KVT__RECALL_MAX_BRANCH + rank) + KVT__RECALL_MAX_BRANCH +
           rank + 2u * heads_padded(n_heads);
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
    for (uint32_t k = 0; k < rank; k++)
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

size_t kvt__recall_scan_heads_padded(uint32_t n_heads) {
    return heads_padded(n_heads);
}

void kvt__recall_scan_prep_cpu(const kvt__recall_scan_args *a, float *scratch,
                               kvt__recall_scan_prep *p) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim, rank = a->rank, H = a->n_heads;
    const size_t qdim = (size_t)D + bd, HP = heads_padded(H);
    /* scratch: q̃_sk of every head [H][rank], the heads [H] (5 floats each), tmp [D], then the
     * heads' branch queries and projections transposed, [bd + rank][HP] (padding heads zero),
     * then the row's branch [bd] and sketch [rank] as fp32 */
    p->q_sk = scratch;
    p->heads = (kvt__recall_head *)(scratch + (size_t)H * rank);
    float *tmp = scratch + (size_t)H * HEAD_FLOATS(rank);
    p->qT = tmp + KVT__RECALL_PREP_FLOATS(D);
    p->HP = HP;
    p->rb = p->qT + HP * (bd + rank);
    p->ck = p->rb + bd;
    p->acc = p->ck + rank;
    p->pa = p->acc + HP;
    for (uint32_t h = 0; h < H; h++)
        head_prep(a->q + h * qdim, D, a->basis, rank, p->q_sk + (size_t)h * rank, tmp,
                  &p->heads[h]);
    for (size_t h = 0; h < HP; h++) {
        for (uint32_t j = 0; j < bd; j++)
            p->qT[j * HP + h] = h < H ? a->q[h * qdim + D + j] : 0.0f;
        for (uint32_t k = 0; k < rank; k++)
            p->qT[(bd + k) * HP + h] = h < H ? p->q_sk[h * rank + k] : 0.0f;
    }
}

KVT__FMA_CLONES
int kvt__recall_row_fires_cpu(const kvt__recall_scan_args *a, const kvt__recall_scan_prep *p,
                              const float *qT, size_t HP, const uint32_t *hmap, uint32_t n,
                              uint64_t row) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim, rank = a->rank;
    const int sound = a->mode == KVT__RECALL_SOUND;
    float *rb = p->rb, *ck = p->ck, *acc = p->acc, *pa = p->pa;
    const uint8_t *r =
        a->base +
        (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) * a->slot_stride;
    const uint16_t *csk = a->csk + (size_t)row * a->csk_stride;
    const float rho = a->rho[row];
    /* The row once: branch and sketch as fp32; ‖csk‖ (kvt__recall_idx's n2 chain, the same for
     * every head) only where the sound margin reads it. */
    if (a->branch_dtype == KVT__DT_BF16) {
        const uint8_t *br = r + a->branch_offset;
        for (uint32_t j = 0; j < bd; j++) {
            uint16_t b;
            memcpy(&b, br + 2u * j, 2);
            rb[j] = kvt__f32_from_bits((uint32_t)b << 16);
        }
    } else {
        for (uint32_t j = 0; j < bd; j++)
            rb[j] = kvt__sigma_branch_val(r, a->branch_offset, a->branch_dtype, j);
    }
    for (uint32_t k = 0; k < rank; k++)
        ck[k] = f16_to_f32(csk[k]);
    float ncsk = 0.0f;
    if (sound) {
        float n2 = 0.0f;
        for (uint32_t k = 0; k < rank; k++)
            n2 = fmaf(ck[k], ck[k], n2);
        ncsk = sqrtf(n2);
    }
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
    int fire = 0;
    if (sound) {
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

void kvt__recall_scan_cpu(const kvt__recall_scan_args *a, float *scratch) {
    kvt__recall_scan_prep p;
    kvt__recall_scan_prep_cpu(a, scratch, &p);
    uint32_t count = 0, over = 0;
    uint64_t jk = 0; /* kept[jk]: the first kept row >= the current one */
    for (uint64_t row = a->sinks; row < a->n_closed; row++) {
        while (jk < a->m && a->kept[jk] < row)
            jk++;
        if (jk < a->m && a->kept[jk] == row)
            continue;
        if (!kvt__recall_row_fires_cpu(a, &p, p.qT, p.HP, NULL, a->n_heads, row))
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
