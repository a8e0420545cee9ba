/*
 * gqa.c — what the needle suite needs to replay GQA layers (a real engine's rotary layers: two
 * planes, K and V, n_kv_heads rows of head_dim values per token) next to MLA ones: the layout
 * check of a traced GQA layer and the reference attention of query heads over K and V rows.
 *
 * Query head h reads KV head h / (n_q_heads / n_kv_heads) (the grouping of GQA: consecutive
 * query heads share a KV head, as transformers' repeat_kv and llama.cpp lay them out). The
 * softmax is in double like kernels/attn.h's MLA reference, which reads the value as the key
 * row's first value_dim values and so cannot serve a layer whose V is a separate plane.
 */
#include "nd_internal.h"

#include <stdlib.h>
#include <string.h>

int nd_gqa_layout_check(const kvt_layer_spec *sp, uint32_t n_q_heads, uint32_t q_dim, char *msg,
                        size_t len) {
    if (sp->kind != KVT_LAYER_GQA_ROPE || sp->n_planes != 2)
        return nd_fail(msg, len, -1, "%s layer: the needle suite replays MLA layers and GQA "
                       "layers with rotary positions (gqa-rope)", kvt_layer_kind_name(sp->kind));
    if (sp->dtype != KVT_DTYPE_BF16 && sp->dtype != KVT_DTYPE_FP16 &&
        sp->dtype != KVT_DTYPE_FP32)
        return nd_fail(msg, len, -1, "row dtype %s not supported by the reference attention "
                       "(bf16, fp16, fp32)", kvt_dtype_name(sp->dtype));
    if ((uint64_t)sp->head_dim * kvt_dtype_bytes(sp->dtype) != sp->row_bytes)
        return nd_fail(msg, len, -1, "row_bytes %u != head_dim %u x %u bytes", sp->row_bytes,
                       sp->head_dim, kvt_dtype_bytes(sp->dtype));
    if (sp->n_kv_heads == 0 || n_q_heads == 0 || n_q_heads % sp->n_kv_heads != 0)
        return nd_fail(msg, len, -1, "%u query heads do not group over %u KV heads", n_q_heads,
                       sp->n_kv_heads);
    if (q_dim != sp->head_dim)
        return nd_fail(msg, len, -1, "queries of %u values, keys of %u", q_dim, sp->head_dim);
    return 0;
}

/* Byte offset of row j of KV head g in a plane. */
static size_t row_at(const nd_gqa_attn_args *a, uint32_t j, uint32_t g) {
    const size_t slot = a->slots ? (size_t)(uint32_t)a->slots[j] : (size_t)j;
    return slot * nd_token_bytes(a->spec) + (size_t)g * a->spec->row_bytes;
}

int nd_gqa_attn(const nd_gqa_attn_args *a) {
    const kvt_layer_spec *sp = a->spec;
    const uint32_t d = sp->head_dim, group = a->n_q_heads / sp->n_kv_heads;
    double *s = malloc(sizeof(double) * (a->n_rows ? a->n_rows : 1));
    double *acc = malloc(sizeof(double) * d);
    float *kr = malloc(sizeof(float) * d);
    if (!s || !acc || !kr) {
        free(s), free(acc), free(kr);
        return ND_ENOMEM;
    }
    for (uint32_t i = 0; i < a->n_heads; i++) {
        const uint32_t h = a->heads[i], g = h / group;
        const float *q = a->q + (size_t)h * d;
        double mx = -INFINITY;
        for (uint32_t j = 0; j < a->n_rows; j++) {
            nd_widen(a->k + row_at(a, j, g), sp->dtype, d, kr);
            s[j] = a->scale * nd_dot(q, kr, d);
            if (s[j] > mx || j == 0)
                mx = s[j];
        }
        double sum = 0, marked = 0;
        for (uint32_t j = 0; j < a->n_rows; j++) {
            s[j] = exp(s[j] - mx);
            sum += s[j];
            if (a->mark && a->mark[(size_t)g * a->mark_stride + j])
                marked += s[j];
        }
        memset(acc, 0, sizeof(double) * d);
        for (uint32_t j = 0; j < a->n_rows; j++) {
            nd_widen(a->v + row_at(a, j, g), sp->dtype, d, kr);
            const double p = s[j] / sum;
            for (uint32_t x = 0; x < d; x++)
                acc[x] += p * kr[x];
        }
        float *o = a->out + (size_t)i * d;
        for (uint32_t x = 0; x < d; x++)
            o[x] = (float)acc[x];
        a->mass[i] = marked / sum;
    }
    free(s), free(acc), free(kr);
    return ND_OK;
}
