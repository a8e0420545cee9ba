/* recall_rope.c — the RoPE trigger's state and work item (recall_rope.h). */
#include "recall/recall_rope.h"

#include <string.h>

kvt_status kvt__recall_rope_prepare(kvt__recall_rope_layer *r, const kvt__backend *be,
                                    uint32_t n_q, uint32_t n_kv, uint32_t cap) {
    if (n_kv == 0 || n_kv > KVT__RECALL_ROPE_MAX_KV || cap == 0 || n_q % n_kv != 0)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = kvt__recall_layer_prepare(&r->base, be, n_q, 0, 0); /* no promotion on RoPE layers */
    if (s != KVT_OK)
        return s;
    const size_t bytes = sizeof(uint32_t) * (size_t)n_kv * ((size_t)cap + 2u);
    if (!r->fbuf || r->fbytes != bytes || r->n_kv != n_kv || r->cap != cap) {
        if (r->fbuf)
            be->ops->buf_free(be, r->fbuf, r->fbytes);
        r->fbuf = NULL;
        if ((s = be->ops->buf_alloc(be, bytes, &r->fbuf)) != KVT_OK)
            return s;
        r->fbytes = bytes;
        r->fired = r->fbuf;
        r->n_fired = r->fired + (size_t)n_kv * cap;
        r->overflow = r->n_fired + n_kv;
        r->n_kv = n_kv;
        r->cap = cap;
    }
    /* empty lists: n_fired and overflow zero (the fired entries are only read below n_fired) */
    uint32_t zero[2 * KVT__RECALL_ROPE_MAX_KV];
    memset(zero, 0, sizeof zero);
    return be->ops->write(be, r->n_fired, zero, sizeof(uint32_t) * 2u * n_kv, NULL);
}

void kvt__recall_rope_fini(kvt__recall_rope_layer *r, const kvt__backend *be) {
    kvt__recall_layer_fini(&r->base, be);
    if (r->fbuf)
        be->ops->buf_free(be, r->fbuf, r->fbytes);
    memset(r, 0, sizeof *r);
}

kvt_status kvt__recall_rope_copy(kvt__recall_rope_layer *dst, const kvt__recall_rope_layer *src,
                                 const kvt__backend *be) {
    if (!dst->fbuf || !src->fbuf || dst->fbytes != src->fbytes)
        return KVT_ERR_INVARIANT;
    kvt_status s = kvt__recall_layer_copy(&dst->base, &src->base, be);
    return s == KVT_OK ? be->ops->copy(be, dst->fbuf, src->fbuf, src->fbytes, NULL) : s;
}

/* The step's archive side, field by field from the policy's view (the rest zero). */
static void rope_of_view(const kvt__rope_view *v, kvt__recall_rope_args *a) {
    memset(a, 0, sizeof *a);
    a->keys = v->plane[0];
    a->pages = v->pages;
    a->first_page = v->first_page;
    a->pdiv = v->pdiv;
    a->slot_stride = v->slot_stride;
    a->row_bytes = v->row_bytes;
    a->n_rows = v->n_rows;
    a->dtype = v->dtype;
    a->D = v->D;
    a->branch_dim = v->branch_dim;
    a->branch_offset = v->branch_offset;
    a->branch_dtype = v->branch_dtype;
    a->n_kv = v->n_kv;
    a->group = v->group;
    a->ar_bytes = v->ar_bytes;
    a->ar_row_bytes = v->ar_row_bytes;
    a->ar_cap = v->ar_cap;
    a->ar_n = v->ar_n;
    a->ar_ident = v->ar_ident;
    a->capped = v->capped;
    a->ar_branch = v->ar_branch;
    a->ar_branch_bytes = v->ar_branch_bytes;
    a->csk = v->csk;
    a->rho = v->rho;
    a->csk_stride = v->csk_stride;
    a->basis = v->basis;
    a->basis_stride = v->basis_stride;
    for (uint32_t h = 0; h < v->n_kv && h < KVT__RECALL_ROPE_MAX_KV; h++)
        a->rank[h] = v->rank ? v->rank[h] : 0;
}

void kvt__recall_rope_make(const kvt__recall_rope_layer *r, const kvt__rope_view *view,
                           const float *q, kvt_recall_mode mode, float margin, uint8_t *dense,
                           kvt__recall_rope_args *out) {
    rope_of_view(view, out);
    out->q = q;
    out->best = r->base.best;
    out->mode = (int)mode;
    out->margin = margin;
    out->cap = r->cap;
    out->st = r->base.st;
    out->samples = r->base.samples;
    out->sample_cap = r->base.sample_cap;
    out->fired = r->fired;
    out->n_fired = r->n_fired;
    out->overflow = r->overflow;
    out->dense = dense;
    const kvt__recall_layer *b = &r->base;
    if (b->g_cap >= r->n_kv && r->n_kv) { /* the pruned scan's planes, every head's interleaved */
        out->g_B = b->g_B;
        out->g_dim = b->g_dim;
        out->g_blocks_cap = b->g_cap / r->n_kv;
        out->g_perm = b->g_perm;
        out->g_n = b->g_n;
        out->g_end = b->g_end;
        out->g_centre = b->g_centre;
        out->g_stat = b->g_stat;
    }
}

kvt_status kvt__recall_rope_groups_reserve(kvt__recall_rope_layer *r, const kvt__backend *be,
                                           uint64_t rows, uint32_t B, uint32_t dim) {
    if (B < 64u || (B & (B - 1u)) != 0 || r->n_kv == 0)
        return KVT_OK; /* no block the group build takes: the full scan only */
    return kvt__recall_layer_groups_reserve(&r->base, be, rows / B * r->n_kv, B, dim);
}

void kvt__recall_rope_emit_make(const kvt__recall_rope_layer *r, const kvt__rope_view *view,
                                const int32_t *fetch_pages, uint32_t fetch_cap, bool all,
                                int32_t *indices, uint64_t capacity, int32_t *indptr,
                                kvt__recall_rope_emit_args *out) {
    *out = (kvt__recall_rope_emit_args){
        .plane = {view->plane[0], view->plane[1]}, .n_planes = view->n_planes,
        .slot_stride = view->slot_stride, .row_bytes = view->row_bytes, .n_kv = view->n_kv,
        .pages = view->pages, .first_page = view->first_page, .pdiv = view->pdiv,
        .n_rows = view->n_rows, .ar_bytes = view->ar_bytes, .ar_cap = view->ar_cap,
        .ar_n = view->ar_n, .fired = r->fired, .n_fired = r->n_fired, .cap = r->cap,
        .st = r->base.st, .fetch_pages = fetch_pages, .fetch_cap = fetch_cap,
        .indices = indices, .capacity = capacity, .indptr = indptr, .out = 0, .chain = true,
        .all = all, .capped = view->capped};
}
