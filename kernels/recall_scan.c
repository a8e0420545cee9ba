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

size_t kvt__recall_scan_scratch_floats(uint32_t n_heads, uint32_t rank, uint32_t D) {
    return (size_t)n_heads * HEAD_FLOATS(rank) + KVT__RECALL_PREP_FLOATS(D);
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

KVT__FMA_CLONES
void kvt__recall_scan_cpu(const kvt__recall_scan_args *a, float *scratch) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim, rank = a->rank, H = a->n_heads;
    const size_t qdim = (size_t)D + bd;
    /* scratch: q̃_sk of every head [H][rank], the heads [H] (5 floats each), tmp [D] */
    float *q_sk = scratch;
    kvt__recall_head *heads = (kvt__recall_head *)(scratch + (size_t)H * rank);
    float *tmp = scratch + (size_t)H * HEAD_FLOATS(rank);
    for (uint32_t h = 0; h < H; h++)
        head_prep(a->q + h * qdim, D, a->basis, rank, q_sk + (size_t)h * rank, tmp, &heads[h]);
    uint32_t count = 0, over = 0;
    uint64_t j = 0; /* kept[j]: the first kept row >= the current one */
    for (uint64_t row = a->sinks; row < a->n_closed; row++) {
        while (j < a->m && a->kept[j] < row)
            j++;
        if (j < a->m && a->kept[j] == row)
            continue;
        const uint8_t *p =
            a->base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) *
                          a->slot_stride;
        const uint16_t *csk = a->csk + (size_t)row * a->csk_stride;
        const float rho = a->rho[row];
        int fire = 0;
        for (uint32_t h = 0; h < H && !fire; h++) {
            float P, ncsk;
            float idx = kvt__recall_idx(a->q + h * qdim, q_sk + (size_t)h * rank, p, D,
                                        a->branch_offset, a->branch_dtype, bd, csk, rank,
                                        a->scale, &P, &ncsk);
            if (a->mode == KVT__RECALL_SOUND)
                fire = kvt__recall_sound_fires(
                    idx,
                    kvt__recall_sound_margin(&heads[h], idx, P, ncsk, rho, a->scale, a->z, D, bd,
                                             rank),
                    a->best[h]);
            else
                fire = kvt__recall_conformal_fires(
                    idx, kvt__recall_cert(&heads[h], rho, a->scale, D), a->z, a->best[h]);
        }
        if (!fire)
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
