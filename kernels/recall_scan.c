/*
 * recall_scan.c — CPU twin of the recall scan (kernels/recall_scan.h for the math and its fixed
 * orders). The loops only arrange the KVT_HD functions: a CUDA kernel over the same functions
 * (one thread per (row, head), an OR over heads, a compaction of fired rows in row order) gives
 * the same fired set.
 */
#include "kernels/recall_scan.h"

#include "kernels/backend.h"
#include "lib/base/base.h"

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
           rank;
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
    float *rb = p->rb, *ck = p->ck;
    const uint8_t *r =
        a->base +
        (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) * a->slot_stride;
    const uint16_t *csk = a->csk + (size_t)row * a->csk_stride;
    const float rho = a->rho[row];
    /* The row once: branch and sketch as fp32, ‖csk‖ (kvt__recall_idx's n2 chain, the same for
     * every head). */
    float n2 = 0.0f;
    for (uint32_t j = 0; j < bd; j++)
        rb[j] = kvt__sigma_branch_val(r, a->branch_offset, a->branch_dtype, j);
    for (uint32_t k = 0; k < rank; k++) {
        ck[k] = kvt__f16_to_f32(csk[k]);
        n2 = fmaf(ck[k], ck[k], n2);
    }
    const float ncsk = sqrtf(n2);
    int fire = 0;
    /* SCAN_TILE heads at a time: each head's acc and P see kvt__recall_idx's chains (branch j
     * ascending, then k ascending, from +0), so the bits are the per-element function's. */
    for (size_t t0 = 0; t0 < n && !fire; t0 += SCAN_TILE) {
        float acc[SCAN_TILE], pa[SCAN_TILE];
        for (uint32_t t = 0; t < SCAN_TILE; t++)
            acc[t] = pa[t] = 0.0f;
        for (uint32_t j = 0; j < bd + rank; j++) {
            const float x = j < bd ? rb[j] : ck[j - bd], ax = fabsf(x);
            const float *qj = qT + j * HP + t0;
#pragma GCC unroll 8
            for (uint32_t t = 0; t < SCAN_TILE; t++) {
                acc[t] = fmaf(qj[t], x, acc[t]);
                pa[t] = fmaf(fabsf(qj[t]), ax, pa[t]);
            }
        }
        for (uint32_t t = 0; t < SCAN_TILE && t0 + t < n && !fire; t++) {
            const size_t h = hmap ? hmap[t0 + t] : t0 + t;
            const float idx = a->scale * acc[t];
            if (a->mode == KVT__RECALL_SOUND)
                fire = kvt__recall_sound_fires(
                    idx,
                    kvt__recall_sound_margin(&p->heads[h], idx, pa[t], ncsk, rho, a->scale, a->z,
                                             D, bd, rank),
                    a->best[h]);
            else
                fire = kvt__recall_conformal_fires(
                    idx, kvt__recall_cert(&p->heads[h], rho, a->scale, D), a->z, a->best[h]);
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
