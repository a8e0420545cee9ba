/* recall_table.c — the recall tables (recall_table.h) over recall.c's and recall_rope.c's
 * functions. */
#include "recall/recall_table.h"

#include <string.h>

#include "lib/base/base.h"
#include "recall/kernels/recall_group.h"

/* A placeholder query: a plan item's op reads the run's query base + q_off instead. */
static const float no_query;

static bool nope_live(const void *r) {
    return ((const kvt__recall_layer *)r)->buf != NULL;
}

static kvt__recall_layer *nope_base(void *r) {
    return (kvt__recall_layer *)r;
}

static uint64_t nope_bytes(const void *r) {
    return kvt__recall_layer_bytes((const kvt__recall_layer *)r);
}

static kvt_status nope_copy(void *dst, const void *src, const kvt__backend *be) {
    return kvt__recall_layer_copy((kvt__recall_layer *)dst, (const kvt__recall_layer *)src, be);
}

static void nope_fini(void *r, const kvt__backend *be) {
    kvt__recall_layer_fini((kvt__recall_layer *)r, be);
}

/* A NoPE layer's group block: min(block_rows, KVT__RECALL_GROUP_BLOCK_MAX) closed rows. */
static uint32_t nope_group_block(uint32_t block_rows) {
    return block_rows > KVT__RECALL_GROUP_BLOCK_MAX ? KVT__RECALL_GROUP_BLOCK_MAX : block_rows;
}

/* Closed group blocks (nope_group_block); centres of the branch and the sketch. */
static kvt_status nope_groups_reserve(void *r, const kvt__backend *be,
                                      const kvt__recall_shape *sh) {
    const uint32_t B = nope_group_block(sh->block_rows);
    return kvt__recall_layer_groups_reserve((kvt__recall_layer *)r, be, sh->rows / B, B,
                                            sh->branch_dim + sh->sketch_rank);
}


/* A salience layer with a NoPE view (recall_view), the context with sketch planes. */
static bool nope_recalls(const kvt__recall_site *s) {
    return s->sketch_rank && s->policy->recall_view;
}

/* The queries the pack takes: every query head's latent and branch values. */
static uint64_t nope_query_floats(const kvt_layer_spec *sp) {
    return (uint64_t)sp->n_q_heads * (sp->value_dim + sp->branch_dim);
}

/* The context's shapes and group block (every request's group planes are over the context's
 * blocks); a planned step's rows are max_rows_per_seq, its prom_cap the context's. */
static bool nope_bound(const kvt__recall_site *s, uint64_t rows, uint32_t prom_cap, bool planned,
                       kvt__recall_bound *out) {
    (void)planned;
    if (!nope_recalls(s))
        return false;
    const kvt_layer_spec *sp = s->sp;
    kvt__recall_plan_bound(sp->n_q_heads, s->sketch_rank, sp->value_dim, sp->branch_dim, rows,
                           prom_cap, nope_group_block(s->block_rows), &out->nope);
    return true;
}

/* The scan's scratch and the step's own, at most max_rows closed rows, with or without group
 * planes. */
static size_t nope_scratch_floats(const kvt__recall_site *s, uint32_t prom_cap) {
    const kvt_layer_spec *sp = s->sp;
    size_t m = 0;
    for (uint32_t g = 0; g < 2; g++) {
        const size_t f = kvt__recall_step_scratch_max(sp->n_q_heads, s->sketch_rank,
                                                      sp->value_dim, sp->branch_dim, s->max_rows,
                                                      g ? nope_group_block(s->block_rows) : 0,
                                                      prom_cap);
        m = f > m ? f : m;
    }
    return m;
}

static bool nope_be_has(const kvt__backend *be) {
    return be->ops->recall_step != NULL;
}

static kvt_status nope_reserve(const kvt__backend *be, uint32_t n_max,
                               const kvt__recall_bound *bound) {
    if (!be->ops->recall_plan_reserve)
        return KVT_OK;
    const kvt__recall_plan_args ra = {.n_max = n_max, .bound = bound->nope};
    return be->ops->recall_plan_reserve(be, &ra);
}

/* The request's recall step as the buffer-fed op takes it (kvt__recall_step_make over the
 * policy's view of the step's table, promotion's room the policy's), its queries at the
 * request's place from the run's query base. config.recall_lagged_query: the op scans with the
 * lagged buffer once it holds a query (lag_has when the step was first planned), then copies
 * the step's queries into it. */
static kvt_status nope_items(const kvt__recall_req *rq, bool trigger, void *item, void *emit_item,
                             bool *has) {
    (void)emit_item;
    kvt__recall_layer *r = rq->r;
    kvt__recall_plan_item *it = item;
    const kvt__tier_layer *l = rq->l;
    const kvt_config *cfg = l->cfg;
    kvt__nope_view v;
    *has = false;
    if (!trigger || !l->gr->ops->recall_view || !l->gr->ops->recall_view(l, &v))
        return KVT_OK;
    uint8_t *dense = rq->e->dense ? rq->e->dense + rq->i : NULL;
    kvt__recall_step_make(r, &v, kvt__recall_layer_lag_query(r, &no_query), l->pt->n_rows,
                          cfg->recall, cfg->recall_margin, dense, &it->a);
    kvt__recall_step_promote(r,
                             l->gr->ops->promote_room ? l->gr->ops->promote_room(v.n_closed, cfg)
                                                      : 0,
                             cfg->recall_promote_hits, cfg->recall_promote_window, &it->a);
    *has = true;
    it->lag = r->lag_q;
    if (r->lag_q) {
        if (!rq->planned || rq->first) {
            r->lag_plan_use = r->lag_has;
            r->lag_plan_item = 1;
        }
        r->last_lagged = r->lag_plan_use;
        r->lag_next = NULL; /* the op copies */
    }
    it->lag_use = r->lag_q ? r->lag_plan_use : 0;
    it->div = *it->a.scan.pdiv;
    it->q_off = (uint64_t)rq->i * nope_query_floats(&l->st->spec);
    const bool ok = kvt__recall_plan_ok(&rq->bound->nope, &it->a);
    it->a.scan.pdiv = NULL; /* host values, not read by the op */
    it->a.scan.q = NULL;
    return ok ? KVT_OK
              : kvt__tls_fail(KVT_ERR_INVARIANT,
                              "its recall step breaks the rules or the run's bound");
}

/* The fetched rows merged into the request's set (one query). */
static uint32_t nope_pack_query(const kvt__recall_req *rq, const void *emit_item,
                                kvt__pack_query *q) {
    (void)emit_item;
    kvt__recall_pack_query(rq->r, q);
    return 1;
}

static kvt_status nope_step(const kvt__backend *be, const kvt__recall_run *run, void *stream) {
    const kvt__recall_plan_args ra = {.items = run->items, .n = run->n, .n_max = run->n_max,
                                      .query = run->query, .query_floats = run->query_floats,
                                      .bound = run->bound->nope};
    return be->ops->recall_step(be, &ra, stream);
}

const kvt__recall_ops kvt__recall_nope = {
    .name = "recall",
    .layer_noun = "layer",
    .fetch_area = false,
    .live = nope_live,
    .base = nope_base,
    .bytes = nope_bytes,
    .copy = nope_copy,
    .fini = nope_fini,
    .groups_reserve = nope_groups_reserve,
    .kind = 1,
    .item_bytes = sizeof(kvt__recall_plan_item),
    .emit_bytes = 0,
    .recalls = nope_recalls,
    .query_floats = nope_query_floats,
    .bound = nope_bound,
    .scratch_floats = nope_scratch_floats,
    .be_has = nope_be_has,
    .reserve = nope_reserve,
    .items = nope_items,
    .pack_query = nope_pack_query,
    .step = nope_step,
    .emit = NULL,
};

static bool rope_live(const void *r) {
    return ((const kvt__recall_rope_layer *)r)->fbuf != NULL;
}

static kvt__recall_layer *rope_base(void *r) {
    return &((kvt__recall_rope_layer *)r)->base;
}

/* The trigger's state and the fetch lists. */
static uint64_t rope_bytes(const void *r) {
    const kvt__recall_rope_layer *rr = r;
    return kvt__recall_layer_bytes(&rr->base) + (rr->fbuf ? rr->fbytes : 0);
}

static kvt_status rope_copy(void *dst, const void *src, const kvt__backend *be) {
    return kvt__recall_rope_copy((kvt__recall_rope_layer *)dst,
                                 (const kvt__recall_rope_layer *)src, be);
}

static void rope_fini(void *r, const kvt__backend *be) {
    kvt__recall_rope_fini((kvt__recall_rope_layer *)r, be);
}

/* An archive of at most sh->rows rows a KV head (the archive's limit), in blocks of block_rows
 * archive rows (docs/recall.md §9.8); centres of MLA-RoPE's rotated branch and the archive's
 * sketch. */
static kvt_status rope_groups_reserve(void *r, const kvt__backend *be,
                                      const kvt__recall_shape *sh) {
    uint64_t rows = sh->rows;
    if (sh->archive_rows && rows > sh->archive_rows)
        rows = sh->archive_rows;
    const uint32_t branch = sh->n_planes == 1 ? sh->branch_dim : 0;
    return kvt__recall_rope_groups_reserve((kvt__recall_rope_layer *)r, be, rows, sh->block_rows,
                                           branch + sh->archive_stride);
}


kvt_status kvt__recall_rope_view_of(const kvt__tier_layer *l, kvt__rope_view *v, char *err,
                                    size_t len) {
    const kvt_layer_spec *sp = &l->st->spec;
    kvt_status s = l->gr->ops->recall_rope_view(l, v, err, len);
    if (s != KVT_OK)
        return s;
    if (v->n_kv > KVT__RECALL_ROPE_MAX_KV || sp->n_q_heads == 0 || sp->n_q_heads % v->n_kv != 0 ||
        v->D <= 64)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "layer %u: %u KV heads (at most %u), %u query heads (a multiple of "
                         "them), sketched key part %u values (must exceed 64): outside what the "
                         "RoPE recall step takes",
                         l->st->layer, v->n_kv, KVT__RECALL_ROPE_MAX_KV, sp->n_q_heads, v->D);
    return KVT_OK;
}

/* The layer's largest RoPE step: shapes only, from the context's limits (max_rows_per_seq or
 * archive_rows), no pointer set but g_perm's marker; an eager run's archive up to `rows` rows a
 * head (a head archives at most every row of its request). A layer with archive sketches
 * (random eviction's, the context's sketch planes) within the kernels' KV heads. */
static bool rope_bound(const kvt__recall_site *s, uint64_t rows, uint32_t prom_cap, bool planned,
                       kvt__recall_bound *out) {
    (void)prom_cap;
    const kvt_layer_spec *sp = s->sp;
    const kvt__policy_ops *t = s->policy;
    const uint32_t stride =
        t->archive_sketch_stride ? t->archive_sketch_stride(sp, s->sketch_rank) : 0;
    if (!s->sketch_rank || stride == 0 || sp->n_kv_heads == 0 ||
        sp->n_kv_heads > KVT__RECALL_ROPE_MAX_KV)
        return false;
    kvt__recall_rope_args *a = &out->rope;
    memset(a, 0, sizeof *a);
    a->D = t->archive_key_dim(sp);
    a->n_kv = sp->n_kv_heads;
    a->group = sp->n_q_heads / sp->n_kv_heads;
    a->sample_cap = sp->n_q_heads * KVT__RECALL_SAMPLES_PER_HEAD;
    a->capped = s->archive_host; /* an overflow's choice over the whole archive */
    a->ar_n = s->archive_rows ? s->archive_rows : s->max_rows;
    for (uint32_t h = 0; h < a->n_kv; h++)
        a->rank[h] = stride;
    static uint32_t planes_on; /* the pruned scan's share: any non-NULL plane */
    const uint32_t B = s->block_rows;
    a->branch_dim = sp->n_planes == 1 ? sp->branch_dim : 0; /* MLA-RoPE's rotated branch */
    if (B >= 64u && (B & (B - 1u)) == 0) {
        a->g_perm = &planes_on;
        a->g_B = B;
        a->g_dim = a->branch_dim + stride; /* rope_groups_reserve's centres */
        a->g_blocks_cap = a->ar_n / B;
    }
    if (!planned && a->ar_n < rows) {
        a->ar_n = rows;
        if (a->g_perm)
            a->g_blocks_cap = rows / a->g_B;
    }
    return true;
}

static bool rope_recalls(const kvt__recall_site *s) {
    kvt__recall_bound b;
    return rope_bound(s, 0, 0, true, &b);
}

/* The trigger reads its query heads' keys. */
static uint64_t rope_query_floats(const kvt_layer_spec *sp) {
    return (uint64_t)sp->n_q_heads * sp->head_dim;
}

/* One KV head's group's scan scratch and the step's own, whatever the archive's length. */
static size_t rope_scratch_floats(const kvt__recall_site *s, uint32_t prom_cap) {
    kvt__recall_bound b;
    return rope_bound(s, 0, prom_cap, true, &b) ? kvt__recall_rope_scratch_floats(&b.rope) : 0;
}

static bool rope_be_has(const kvt__backend *be) {
    return be->ops->recall_rope_step && be->ops->recall_rope_emit;
}

static kvt_status rope_reserve(const kvt__backend *be, uint32_t n_max,
                               const kvt__recall_bound *bound) {
    if (!be->ops->recall_rope_plan_reserve)
        return KVT_OK;
    const kvt__recall_rope_plan_args ra = {.n_max = n_max, .bound = bound->rope};
    return be->ops->recall_rope_plan_reserve(be, &ra);
}

/* The request's trigger item (when `trigger`) and emission item over the policy's view of the
 * step's table: its queries at the request's place from the run's query base, its dense flag
 * the emission's, its row of a KVT_EMIT_TOKENS emission (chained lists in CSR), every archived
 * row when rq->all; KVT_ERR_INVALID_ARGUMENT when either breaks the rules or the run's bound. */
static kvt_status rope_items(const kvt__recall_req *rq, bool trigger, void *item, void *emit_item,
                             bool *has) {
    const kvt__recall_rope_layer *rr = rq->r;
    const kvt__tier_layer *l = rq->l;
    const kvt_emit *e = rq->e;
    const uint32_t i = rq->i;
    kvt__recall_rope_emit_plan_item *em = emit_item;
    kvt__rope_view v;
    *has = false;
    kvt_status s = kvt__recall_rope_view_of(l, &v, kvt__tls_error(), KVT__ERR_LEN);
    if (s != KVT_OK)
        return s;
    bool ok = true;
    if (trigger) {
        kvt__recall_rope_plan_item *it = item;
        kvt__recall_rope_make(rr, &v, &no_query, l->cfg->recall, l->cfg->recall_margin,
                              e->dense ? e->dense + i : NULL, &it->a);
        it->div = *it->a.pdiv;
        it->q_off = (uint64_t)i * rope_query_floats(&l->st->spec);
        ok = kvt__recall_rope_args_ok(&it->a) &&
             kvt__recall_rope_plan_fits(&rq->bound->rope, &it->a);
        it->a.pdiv = NULL; /* host values, not read by the op */
        it->a.q = NULL;
        *has = true;
    }
    if (e->layout == KVT_EMIT_TOKENS) {
        const uint64_t at = (uint64_t)i * e->capacity;
        kvt__recall_rope_emit_make(rr, &v, rq->fetch_pages, rq->fetch_rows, rq->all, e->indices,
                                   at + e->capacity, NULL, &em->a);
        em->a.chain = false;
        em->a.out = at;
        em->a.pad = e->capacity;
        em->a.length = e->lengths + i;
    } else {
        kvt__recall_rope_emit_make(rr, &v, rq->fetch_pages, rq->fetch_rows, rq->all, e->indices,
                                   e->capacity, e->indptr + (size_t)i * rq->lists, &em->a);
        if (em->a.n_kv != rq->lists)
            return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "%u KV heads, %u lists a request",
                                 em->a.n_kv, rq->lists);
    }
    em->div = *em->a.pdiv;
    ok = ok && kvt__recall_rope_emit_ok(&em->a) && em->a.ar_n <= rq->bound->rope.ar_n;
    em->a.pdiv = NULL;
    return ok ? KVT_OK
              : kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "its RoPE recall items break the rules "
                                                        "or the run's bound");
}

/* In the pack, TOKENS: a query that writes only the request's dense flag (the state's, which
 * the trigger wrote), the emission then its row; CSR / CSR_KV_HEADS: per KV head a query that
 * writes only the list's count (so the lists after it start after it; q[0]'s pages, the
 * request's table's), the emission then the lists. */
static uint32_t rope_pack_query(const kvt__recall_req *rq, const void *emit_item,
                                kvt__pack_query *q) {
    const kvt__recall_rope_emit_args *ea = &((const kvt__recall_rope_emit_plan_item *)emit_item)->a;
    const kvt__recall_rope_layer *rr = rq->r;
    const kvt_emit *e = rq->e;
    const uint32_t i = rq->i;
    const bool all = rq->all && !ea->capped;
    if (e->layout == KVT_EMIT_TOKENS) {
        q[0] = (kvt__pack_query){.dense = all ? NULL : &rr->base.st->last_dense, .all_rows = all,
                                 .out = (uint64_t)i * e->capacity, .len_at = i};
        return 1;
    }
    const kvt__pack_query set = q[0];
    for (uint32_t h = 0; h < rq->lists; h++) {
        q[h] = set;
        q[h].d = (kvt__attended_desc){.lo_end = ea->n_rows, .hi_begin = ea->n_rows + ea->ar_n,
                                      .hi_end = ea->n_rows + ea->ar_n};
        q[h].fetch = rr->fired + (size_t)h * rr->cap;
        q[h].n_fetch = rr->n_fired + h;
        q[h].fetch_cap = rr->cap;
        q[h].dense = ea->capped || all ? NULL : &rr->base.st->last_dense;
        q[h].all_rows = all;
        q[h].count_only = true;
        q[h].out = 0;
        q[h].pad = 0;
        q[h].len_at = (uint64_t)i * rq->lists + h + 1;
    }
    return rq->lists;
}

static kvt__recall_rope_plan_args rope_args(const kvt__recall_run *run) {
    return (kvt__recall_rope_plan_args){.items = run->items, .emits = run->emits, .n = run->n,
                                        .n_emit = run->n_emit, .n_max = run->n_max,
                                        .query = run->query, .query_floats = run->query_floats,
                                        .bound = run->bound->rope};
}

static kvt_status rope_step(const kvt__backend *be, const kvt__recall_run *run, void *stream) {
    const kvt__recall_rope_plan_args rp = rope_args(run);
    return be->ops->recall_rope_step(be, &rp, stream);
}

static kvt_status rope_emit(const kvt__backend *be, const kvt__recall_run *run, void *stream) {
    const kvt__recall_rope_plan_args rp = rope_args(run);
    return be->ops->recall_rope_emit(be, &rp, stream);
}

const kvt__recall_ops kvt__recall_rope = {
    .name = "RoPE recall",
    .layer_noun = "RoPE layer",
    .fetch_area = true,
    .live = rope_live,
    .base = rope_base,
    .bytes = rope_bytes,
    .copy = rope_copy,
    .fini = rope_fini,
    .groups_reserve = rope_groups_reserve,
    .kind = 2,
    .item_bytes = sizeof(kvt__recall_rope_plan_item),
    .emit_bytes = sizeof(kvt__recall_rope_emit_plan_item),
    .recalls = rope_recalls,
    .query_floats = rope_query_floats,
    .bound = rope_bound,
    .scratch_floats = rope_scratch_floats,
    .be_has = rope_be_has,
    .reserve = rope_reserve,
    .items = rope_items,
    .pack_query = rope_pack_query,
    .step = rope_step,
    .emit = rope_emit,
};

const kvt__recall_ops *const kvt__recall_kinds[KVT__RECALL_KINDS] = {NULL, &kvt__recall_nope,
                                                                      &kvt__recall_rope};
