/* ref.c — the public reference math (kvtier_ref.h): thin, validated wrappers over the CPU twins
 * in kernels/, so tools and benchmarks compute with exactly the library's functions while
 * including only public headers. */
#include "kvtier_ref.h"
#include "base/alloc.h"

#include "base/base.h"
#include "kernels/attn.h"
#include "kernels/kvt_hd.h"
#include "kernels/sigma.h"

#include <stdlib.h>

_Static_assert(KVT_REF_ATTN_MAX_DIM == KVT__ATTN_MAX_DIM, "kvtier_ref.h and kernels/attn.h agree");

/* The handles here belong to no context, so they use libc directly (no context arena to draw
 * from); they are reference tools, never in an engine's decode path. */

static bool float_dtype(kvt_dtype dt) {
    return dt == KVT_DTYPE_BF16 || dt == KVT_DTYPE_FP16 || dt == KVT_DTYPE_FP32;
}

float kvt_ref_load(const void *row, kvt_dtype dtype, uint32_t i) {
    if (!row || !float_dtype(dtype))
        return 0.0f;
    return kvt__load_elem((const uint8_t *)row, (int)dtype, i);
}

void kvt_ref_store(void *row, kvt_dtype dtype, uint32_t i, float v) {
    if (row && float_dtype(dtype))
        kvt__store_elem((uint8_t *)row, (int)dtype, i, v);
}

struct kvt_ref_sigma {
    uint32_t B, n_basis, branch_dim;
    float *basis;   /* [n_basis][B] */
    float *scratch; /* kvt__sigma_scratch_floats */
    int32_t *slots; /* [B]: 0..B-1 */
};

kvt_status kvt_ref_sigma_create(uint32_t block_rows, uint32_t kappa, uint32_t branch_dim,
                                kvt_ref_sigma **out) {
    return kvt_ref_sigma_create_basis(block_rows, kappa, branch_dim, KVT_SIGMA_FOURIER, out);
}

kvt_status kvt_ref_sigma_create_basis(uint32_t block_rows, uint32_t kappa, uint32_t branch_dim,
                                      kvt_sigma_basis basis, kvt_ref_sigma **out) {
    if (!out)
        return KVT_ERR_INVALID_ARGUMENT;
    *out = NULL;
    if (block_rows < 64 || (block_rows & (block_rows - 1)) != 0 || kappa < 1 ||
        kappa > block_rows / 2 || branch_dim < 1 || branch_dim > KVT__SIGMA_MAX_BRANCH_DIM)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_ref_sigma *h = kvt__mem_calloc(1, sizeof *h);
    if (!h)
        return KVT_ERR_OUT_OF_MEMORY;
    h->B = block_rows;
    h->n_basis = 2 * kappa - 1;
    h->branch_dim = branch_dim;
    h->basis = kvt__mem_malloc(sizeof(float) * (size_t)h->n_basis * block_rows);
    h->scratch = kvt__mem_malloc(sizeof(float) * kvt__sigma_scratch_floats(block_rows, h->n_basis,
                                                                  branch_dim));
    h->slots = kvt__mem_malloc(sizeof(int32_t) * block_rows);
    if (!h->basis || !h->scratch || !h->slots) {
        kvt_ref_sigma_destroy(h);
        return KVT_ERR_OUT_OF_MEMORY;
    }
    if (kvt__sigma_basis((int)basis, block_rows, kappa, h->basis) != 0) {
        kvt_ref_sigma_destroy(h);
        return KVT_ERR_INVALID_ARGUMENT;
    }
    for (uint32_t u = 0; u < block_rows; u++)
        h->slots[u] = (int32_t)u;
    *out = h;
    return KVT_OK;
}

void kvt_ref_sigma_destroy(kvt_ref_sigma *h) {
    if (!h)
        return;
    kvt__mem_free(h->basis);
    kvt__mem_free(h->scratch);
    kvt__mem_free(h->slots);
    kvt__mem_free(h);
}

const float *kvt_ref_sigma_basis(const kvt_ref_sigma *h, uint32_t *n_basis) {
    if (n_basis)
        *n_basis = h ? h->n_basis : 0;
    return h ? h->basis : NULL;
}

kvt_status kvt_ref_sigma_block(kvt_ref_sigma *h, const void *rows, size_t row_stride_bytes,
                               uint32_t branch_offset, kvt_dtype branch_dtype, float *sigma_out) {
    if (!h || !rows || !sigma_out || !float_dtype(branch_dtype) ||
        (uint64_t)branch_offset + (uint64_t)h->branch_dim * kvt_dtype_bytes(branch_dtype) >
            row_stride_bytes)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__sigma_block_cpu((const uint8_t *)rows, h->slots, h->B, row_stride_bytes, branch_offset,
                         (int)branch_dtype, h->branch_dim, h->basis, h->n_basis, h->scratch,
                         sigma_out);
    return KVT_OK;
}

size_t kvt_ref_attn_scratch_doubles(uint32_t n_rows, uint32_t n_heads, uint32_t value_dim,
                                    uint32_t key_dim) {
    return kvt__attn_scratch_doubles(n_rows, n_heads, value_dim, key_dim);
}

kvt_status kvt_ref_attn(const kvt_ref_attn_args *r) {
    if (!r || !float_dtype(r->dtype))
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__attn_args a = {
        .base = (const uint8_t *)r->base,
        .slots = r->slots,
        .n_rows = r->n_rows,
        .slot_stride = r->slot_stride,
        .row_offset = r->row_offset,
        .dtype = (int)r->dtype,
        .key_dim = r->key_dim,
        .value_dim = r->value_dim,
        .q = r->q,
        .n_heads = r->n_heads,
        .q_stride = r->q_stride,
        .scale = r->scale,
        .mark = r->mark,
        .out = r->out,
        .mark_mass = r->mark_mass,
        .lse = r->lse,
        .scratch = r->scratch,
    };
    return kvt__attn_cpu(&a) == 0 ? KVT_OK : KVT_ERR_INVALID_ARGUMENT;
}
