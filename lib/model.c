/* model.c — layer specs and the model (an ordered list of specs). The names and sizes of the public
 * enums (kvt_dtype_bytes, kvt_layer_kind_name, kvt_policy_for_kind, ...) are lib/base/names.c's:
 * tiers/ uses them too, and nothing below lib/ may call into it. */
#include "base/base.h"
#include "base/alloc.h"

#include "kernels/kvt_hd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(KVT_DTYPE_BF16 == KVT__DT_BF16 && KVT_DTYPE_FP16 == KVT__DT_FP16 &&
                   KVT_DTYPE_FP32 == KVT__DT_FP32 && KVT_DTYPE_FP8_E4M3 == KVT__DT_FP8,
               "kernels/kvt_hd.h dtype numbers must match kvt_dtype");

struct kvt_model {
    uint32_t n_layers;
    kvt_layer_spec *layers;
    char model_type[64];
};

static bool is_float_dtype(kvt_dtype d) {
    return d == KVT_DTYPE_BF16 || d == KVT_DTYPE_FP16 || d == KVT_DTYPE_FP32;
}

/* Upper bounds that no real model approaches; they keep size arithmetic far from overflow. */
#define KVT__MAX_HEADS 1024u
#define KVT__MAX_ROW_BYTES (1u << 20)

kvt_status kvt_layer_spec_mla(kvt_layer_kind kind, kvt_dtype dtype, uint32_t kv_lora_rank,
                              uint32_t rope_dim, kvt_layer_spec *out) {
    if (!out || kv_lora_rank == 0 || rope_dim == 0 || !is_float_dtype(dtype) ||
        (kind != KVT_LAYER_MLA_NOPE && kind != KVT_LAYER_MLA_ROPE))
        return KVT_ERR_INVALID_ARGUMENT;
    uint32_t elt = kvt_dtype_bytes(dtype);
    /* In 64 bits: a rank near 2^32 must not wrap head_dim or row_bytes to a small valid value. */
    if (((uint64_t)kv_lora_rank + rope_dim) * elt > KVT__MAX_ROW_BYTES)
        return KVT_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->dtype = dtype;
    out->n_kv_heads = 1;
    out->n_planes = 1;
    out->head_dim = kv_lora_rank + rope_dim;
    out->value_dim = kv_lora_rank;
    out->branch_dim = rope_dim;
    out->row_bytes = out->head_dim * elt;
    out->branch_offset = kv_lora_rank * elt;
    out->branch_dtype = dtype;
    return KVT_OK;
}

kvt_status kvt_layer_spec_gqa(kvt_layer_kind kind, kvt_dtype dtype, uint32_t n_kv_heads,
                              uint32_t head_dim, kvt_layer_spec *out) {
    if (!out || n_kv_heads == 0 || head_dim == 0 || !is_float_dtype(dtype) ||
        (kind != KVT_LAYER_GQA_ROPE && kind != KVT_LAYER_GQA_NOPE && kind != KVT_LAYER_SLIDING))
        return KVT_ERR_INVALID_ARGUMENT;
    if (n_kv_heads > KVT__MAX_HEADS || (uint64_t)head_dim * kvt_dtype_bytes(dtype) > KVT__MAX_ROW_BYTES)
        return KVT_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->dtype = dtype;
    out->n_kv_heads = n_kv_heads;
    out->n_planes = 2;
    out->head_dim = head_dim;
    out->value_dim = head_dim;
    out->branch_dtype = dtype;
    out->row_bytes = head_dim * kvt_dtype_bytes(dtype);
    return KVT_OK;
}


kvt_status kvt_layer_spec_check(const kvt_layer_spec *s, char *err, size_t len) {
    if (!s)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "layer spec is NULL");
    if ((unsigned)s->kind > KVT_LAYER_NO_KV)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "kind: unknown value %d", s->kind);
    if (s->kind == KVT_LAYER_NO_KV)
        return KVT_OK;
    if (kvt_dtype_bytes(s->dtype) == 0)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "dtype: unknown value %d", s->dtype);
    if (s->n_kv_heads == 0 || s->n_kv_heads > KVT__MAX_HEADS)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "n_kv_heads: %u not in 1..%u",
                         s->n_kv_heads, KVT__MAX_HEADS);
    if (s->n_planes != 1 && s->n_planes != 2)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "n_planes: %u (must be 1 or 2)",
                         s->n_planes);
    if (s->row_bytes == 0 || s->row_bytes > KVT__MAX_ROW_BYTES)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "row_bytes: %u not in 1..%u",
                         s->row_bytes, KVT__MAX_ROW_BYTES);
    if (s->head_dim == 0 || s->value_dim == 0 || s->value_dim > s->head_dim)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "head_dim/value_dim: %u/%u (need 0 < value_dim <= head_dim)", s->head_dim,
                         s->value_dim);
    bool mla = s->kind == KVT_LAYER_MLA_NOPE || s->kind == KVT_LAYER_MLA_ROPE;
    if (mla) {
        if (s->n_kv_heads != 1 || s->n_planes != 1)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "MLA layer needs n_kv_heads = 1 and n_planes = 1 (got %u, %u)",
                             s->n_kv_heads, s->n_planes);
        if (s->branch_dim == 0)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "branch_dim: 0 on an MLA layer");
        if ((uint64_t)s->head_dim * kvt_dtype_bytes(s->dtype) > s->row_bytes)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "row_bytes: %u cannot hold head_dim %u values of %u bytes",
                             s->row_bytes, s->head_dim, kvt_dtype_bytes(s->dtype));
        if (!is_float_dtype(s->branch_dtype))
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "branch_dtype: must be bf16, fp16 or fp32");
        uint64_t end = (uint64_t)s->branch_offset +
                       (uint64_t)s->branch_dim * kvt_dtype_bytes(s->branch_dtype);
        if (end > s->row_bytes)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "branch_offset: branch [%u, %llu) runs past row_bytes %u",
                             s->branch_offset, (unsigned long long)end, s->row_bytes);
    } else {
        if (s->n_planes != 2)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "n_planes: a GQA/MHA layer stores K and V (2), got %u", s->n_planes);
        if ((uint64_t)s->head_dim * kvt_dtype_bytes(s->dtype) != s->row_bytes)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "row_bytes: %u != head_dim %u x %u bytes", s->row_bytes, s->head_dim,
                             kvt_dtype_bytes(s->dtype));
        if (s->kind == KVT_LAYER_SLIDING && s->sliding_window == 0)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "sliding_window: 0 on a sliding-window layer");
    }
    return KVT_OK;
}

uint64_t kvt_layer_bytes_per_token(const kvt_layer_spec *s) {
    if (!s || s->kind == KVT_LAYER_NO_KV)
        return 0;
    return (uint64_t)s->n_planes * s->n_kv_heads * s->row_bytes;
}

kvt_status kvt_model_create(const kvt_layer_spec *layers, uint32_t n_layers,
                            const char *model_type, kvt_model **out, char *err, size_t len) {
    if (!out)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!layers || n_layers == 0 || n_layers > 65535)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "n_layers: %u not in 1..65535",
                         n_layers);
    for (uint32_t i = 0; i < n_layers; i++) {
        char sub[192];
        kvt_status s = kvt_layer_spec_check(&layers[i], sub, sizeof sub);
        if (s != KVT_OK)
            return kvt__fail(err, len, s, "layer %u: %s", i, sub);
    }
    kvt_model *m = kvt__mem_calloc(1, sizeof *m);
    if (!m)
        return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "model");
    m->layers = kvt__mem_malloc(sizeof *m->layers * n_layers);
    if (!m->layers) {
        kvt__mem_free(m);
        return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "model layers");
    }
    memcpy(m->layers, layers, sizeof *layers * n_layers);
    m->n_layers = n_layers;
    snprintf(m->model_type, sizeof m->model_type, "%s", model_type ? model_type : "custom");
    *out = m;
    return KVT_OK;
}

void kvt_model_destroy(kvt_model *m) {
    if (!m)
        return;
    kvt__mem_free(m->layers);
    kvt__mem_free(m);
}

uint32_t kvt_model_n_layers(const kvt_model *m) {
    return m ? m->n_layers : 0;
}

const kvt_layer_spec *kvt_model_layer(const kvt_model *m, uint32_t i) {
    return (m && i < m->n_layers) ? &m->layers[i] : NULL;
}

const char *kvt_model_type(const kvt_model *m) {
    return m ? m->model_type : "";
}

uint64_t kvt_model_kv_bytes_per_token(const kvt_model *m) {
    uint64_t sum = 0;
    for (uint32_t i = 0; m && i < m->n_layers; i++)
        sum += kvt_layer_bytes_per_token(&m->layers[i]);
    return sum;
}
