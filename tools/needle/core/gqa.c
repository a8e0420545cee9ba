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

int nd_gqa_attn(const nd_gqa_attn_args *a) {
    const kvt_layer_spec *sp = a->spec;
    const uint32_t d = sp->head_dim, group = a->n_q_heads / sp->n_kv_heads;
    const size_t tb = (size_t)sp->n_kv_heads * sp->row_bytes;
    double *s = malloc(sizeof(double) * (a->n_rows ? a->n_rows : 1));
    float *kr = malloc(sizeof(float) * d * 2);
    if (!s || !kr) {
        free(s), free(kr);
        return ND_ENOMEM;
    }
    float *vr = kr + d;
    for (uint32_t i = 0; i < a->n_heads; i++) {
        const uint32_t h = a->heads[i], g = h / group;
        const float *q = a->q + (size_t)h * d;
        double mx = -INFINITY;
        for (uint32_t j = 0; j < a->n_rows; j++) {
            size_t at = (size_t)(a->slots ? (uint32_t)a->slots[j] : j) * tb + (size_t)g * sp->row_bytes;
            nd_widen(a->k + at, sp->dtype, d, kr);
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
        float *o = a->out + (size_t)i * d;
        double *acc = calloc(d, sizeof(double));
        if (!acc) {
            free(s), free(kr);
            return ND_ENOMEM;
        }
        for (uint32_t j = 0; j < a->n_rows; j++) {
            size_t at = (size_t)(a->slots ? (uint32_t)a->slots[j] : j) * tb + (size_t)g * sp->row_bytes;
            nd_widen(a->v + at, sp->dtype, d, vr);
            const double p = s[j] / sum;
            for (uint32_t x = 0; x < d; x++)
                acc[x] += p * vr[x];
        }
        for (uint32_t x = 0; x < d; x++)
            o[x] = (float)acc[x];
        free(acc);
        a->mass[i] = marked / sum;
    }
    free(s), free(kr);
    return ND_OK;
}
