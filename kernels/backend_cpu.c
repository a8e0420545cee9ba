/* backend_cpu.c — the CPU backend: loops over the KVT_HD per-element math. It is complete and is
 * the reference the CUDA backend is tested against. */
#include "backend.h"

#include "kernels/philox.h"
#include "kernels/sigma.h"
#include "kernels/topm.h"

#include <string.h>

static kvt_status cpu_score_rows(const kvt__backend *be, const kvt__score_args *a, void *stream) {
    (void)stream;
    switch (a->selector) {
    case KVT_SELECT_SIGMA: {
        size_t n = kvt__sigma_scratch_floats(a->n_rows, a->n_basis, a->branch_dim);
        float *scratch = kvt__malloc(be->alloc, n * sizeof(float));
        if (!scratch)
            return KVT_ERR_OUT_OF_MEMORY;
        kvt__sigma_block_cpu(a->base, a->slots, a->n_rows, a->slot_stride, a->branch_offset,
                             a->branch_dtype, a->branch_dim, a->basis, a->n_basis, scratch,
                             a->out);
        kvt__free(be->alloc, scratch, n * sizeof(float));
        return KVT_OK;
    }
    case KVT_SELECT_BRANCH_NORM:
        kvt__branch_norm_cpu(a->base, a->slots, a->n_rows, a->slot_stride, a->branch_offset,
                             a->branch_dtype, a->branch_dim, a->out);
        return KVT_OK;
    case KVT_SELECT_ROW_NORM:
        kvt__row_norm_cpu(a->base, a->slots, a->n_rows, a->slot_stride, a->dtype, a->n_values,
                          a->out);
        return KVT_OK;
    case KVT_SELECT_RANDOM:
        /* One fixed uniform score per row, drawn at its original position. */
        for (uint32_t u = 0; u < a->n_rows; u++)
            a->out[u] = kvt__philox_uniform(
                kvt__philox_draw_at(a->key, a->subseq, a->first_position + u));
        return KVT_OK;
    }
    return KVT_ERR_INVALID_ARGUMENT;
}

static kvt_status cpu_topm(const kvt__backend *be, const uint32_t *keys, uint32_t n, uint32_t m,
                           uint32_t *idx, void *stream) {
    (void)stream;
    size_t sn = kvt__topm_scratch_u32(n);
    uint32_t *scratch = sn ? kvt__malloc(be->alloc, sn * sizeof(uint32_t)) : NULL;
    if (sn && !scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    kvt__topm_u32(keys, n, m, idx, scratch);
    kvt__free(be->alloc, scratch, sn * sizeof(uint32_t));
    return KVT_OK;
}

static kvt_status cpu_draws(const kvt__backend *be, uint64_t key, uint64_t subseq,
                            const int64_t *positions, size_t n, uint32_t *out, void *stream) {
    (void)be;
    (void)stream;
    kvt__philox_draws_cpu(key, subseq, positions, n, out);
    return KVT_OK;
}

static kvt_status cpu_move_rows(const kvt__backend *be, uint8_t *base, size_t slot_stride,
                                size_t offset, size_t bytes_per_row, const int32_t *src_slots,
                                const int32_t *dst_slots, uint32_t n, void *stream) {
    (void)be;
    (void)stream;
    for (uint32_t i = 0; i < n; i++) {
        if (src_slots[i] == dst_slots[i])
            continue;
        memmove(base + (size_t)dst_slots[i] * slot_stride + offset,
                base + (size_t)src_slots[i] * slot_stride + offset, bytes_per_row);
    }
    return KVT_OK;
}

static const kvt__backend_ops cpu_ops = {
    .name = "cpu",
    .score_rows = cpu_score_rows,
    .topm = cpu_topm,
    .draws = cpu_draws,
    .move_rows = cpu_move_rows,
};

const kvt__backend_ops *kvt__backend_cpu_ops(void) {
    return &cpu_ops;
}
