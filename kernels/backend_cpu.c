/* backend_cpu.c — the CPU backend: loops over the KVT_HD per-element math. It is complete and is
 * the reference the CUDA backend is tested against. */
#include "backend.h"

#include "kernels/philox.h"
#include "kernels/sigma.h"
#include "kernels/topm.h"

#include <string.h>

static const kvt__backend_ops cpu_ops_table;

/* The CPU backend's workspace (be->impl when opened with kvt__backend_cpu_open): grow-only
 * scratch of σ and top-m, sized once from the context's stated limits so that no op allocates in
 * a steady state. A backend without one (impl NULL, as tests build them) allocates per call. */
typedef struct cpu_ws {
    float *sigma;
    uint64_t sigma_cap;
    uint32_t *topm;
    uint64_t topm_cap;
} cpu_ws;

kvt_status kvt__backend_cpu_open(kvt__backend *be) {
    be->ops = &cpu_ops_table;
    be->impl = kvt__calloc(be->alloc, sizeof(cpu_ws));
    return be->impl ? KVT_OK : KVT_ERR_OUT_OF_MEMORY;
}

void kvt__backend_cpu_close(kvt__backend *be) {
    cpu_ws *w = be->impl;
    if (!w)
        return;
    kvt__free(be->alloc, w->sigma, sizeof *w->sigma * w->sigma_cap);
    kvt__free(be->alloc, w->topm, sizeof *w->topm * w->topm_cap);
    kvt__free(be->alloc, w, sizeof *w);
    be->impl = NULL;
}

kvt_status kvt__backend_cpu_reserve(kvt__backend *be, size_t sigma_floats, size_t topm_u32) {
    cpu_ws *w = be->impl;
    if (!w)
        return KVT_OK;
    void *p = w->sigma;
    kvt_status s = kvt__grow(be->alloc, &p, &w->sigma_cap, sigma_floats, sizeof *w->sigma);
    if (s != KVT_OK)
        return s;
    w->sigma = p;
    p = w->topm;
    s = kvt__grow(be->alloc, &p, &w->topm_cap, topm_u32, sizeof *w->topm);
    if (s == KVT_OK)
        w->topm = p;
    return s;
}

/* Scratch of n elements: the workspace's (grown when needed), or a fresh allocation the caller
 * frees (*owned). */
static void *scratch_get(const kvt__backend *be, bool sigma, size_t n, size_t elt, bool *owned) {
    cpu_ws *w = be->impl;
    *owned = false;
    if (!w) {
        *owned = true;
        return kvt__malloc(be->alloc, n * elt);
    }
    kvt_status s = sigma ? kvt__backend_cpu_reserve((kvt__backend *)be, n, 0)
                         : kvt__backend_cpu_reserve((kvt__backend *)be, 0, n);
    if (s != KVT_OK)
        return NULL;
    return sigma ? (void *)w->sigma : (void *)w->topm;
}

static kvt_status cpu_score_rows(const kvt__backend *be, const kvt__score_args *a, void *stream) {
    (void)stream;
    switch (a->selector) {
    case KVT_SELECT_SIGMA: {
        size_t n = kvt__sigma_scratch_floats(a->n_rows, a->n_basis, a->branch_dim);
        bool owned;
        float *scratch = scratch_get(be, true, n, sizeof(float), &owned);
        if (!scratch)
            return KVT_ERR_OUT_OF_MEMORY;
        kvt__sigma_block_cpu(a->base, a->slots, a->n_rows, a->slot_stride, a->branch_offset,
                             a->branch_dtype, a->branch_dim, a->basis, a->n_basis, scratch,
                             a->out);
        if (owned)
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
    bool owned = false;
    uint32_t *scratch = sn ? scratch_get(be, false, sn, sizeof(uint32_t), &owned) : NULL;
    if (sn && !scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    kvt__topm_u32(keys, n, m, idx, scratch);
    if (owned)
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

static const kvt__backend_ops cpu_ops_table = {
    .name = "cpu",
    .score_rows = cpu_score_rows,
    .topm = cpu_topm,
    .draws = cpu_draws,
    .move_rows = cpu_move_rows,
};

const kvt__backend_ops *kvt__backend_cpu_ops(void) {
    return &cpu_ops_table;
}
