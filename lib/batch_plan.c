/* batch_plan.c — the plan image of a batch's step (batch_internal.h): one function writes what a
 * run of a layer does (kvt__batch_plan_layer: its pack queries, its recall kind's trigger and
 * emission items, from the recall table of the layer's kind) and one runs it through the
 * backend's buffer-fed ops (kvt__batch_exec_layer: the recall step, the pack, the emission).
 * An eager run (kvt_batch_run, lib/batch.c) plans its layer into the eager image and executes
 * it; kvt_batch_plan_device plans every layer into the planned image once (kvt__batch_plan_fill)
 * and each planned run executes its layer's part (the arguments of its ops hold nothing of one
 * step, so a captured run replays over later planned steps). Nothing here calls lib/batch.c. */
#include "batch_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* May requests of this context recall: its config does, or a request with recall on was
 * created? */
static bool ctx_may_recall(const kvt_ctx *ctx) {
    return ctx->cfg.recall != KVT_RECALL_OFF || ctx->recall_seen;
}

/* The recall kind a planned step's runs of this layer hold (kvt_batch_plan_device; 0: none): the
 * layer's (b->kinds, from kvt__ctx_recall_of) where requests may recall (ctx_may_recall), in a
 * context that states max_rows_per_seq (the bound of the ops' launch and workspace), on a backend
 * with the kind's ops; fixed when the batch's plan buffer is laid out (its first planned step), so
 * that a captured run has the ops whether or not the capture's step recalled; a layer that did
 * not plan them then never does (a step where a request recalls there is not plannable). Which
 * emissions a fetch-area kind's planned step takes: docs/recall.md §9.4. */
uint8_t kvt__batch_plan_kind(const kvt_batch *b, uint32_t layer) {
    const kvt_ctx *ctx = b->ctx;
    if (b->plan.kind)
        return b->plan.kind[layer];
    const kvt__recall_ops *ro = kvt__recall_kinds[b->kinds[layer]];
    return ro && ctx_may_recall(ctx) && ctx->max_rows && ro->be_has(&b->be) ? ro->kind : 0;
}

static size_t align64(size_t x) {
    return (x + 63u) / 64u * 64u;
}

/* Where layer l's trigger items start in an image (after its pack queries). */
static size_t items_at(const kvt__plan_buf *p, uint32_t l) {
    return p->at[l] + align64(PLAN_HEAD + sizeof(kvt__pack_query) * p->qcap[l]);
}

/* Where a layer's emission items start (after its max_seqs trigger items; a layer of a recall
 * kind). */
static size_t emits_at(const kvt_batch *b, const kvt__plan_buf *p, uint32_t l) {
    return items_at(p, l) + align64(kvt__recall_kinds[p->kind[l]]->item_bytes * b->max_seqs);
}

void kvt__batch_plan_free(kvt_batch *b, kvt__plan_buf *p) {
    const kvt__alloc *a = &b->ctx->alloc;
    const uint32_t L = b->ctx->n_layers;
    if (p->at) {
        const size_t bytes = p->at[L];
        if (p->dev)
            b->be.ops->buf_free(&b->be, p->dev, bytes);
        kvt__free(a, p->host, bytes);
    }
    kvt__free(a, p->at, sizeof *p->at * (L + 1u));
    kvt__free(a, p->kind, L);
    kvt__free(a, p->qcap, sizeof *p->qcap * L);
    kvt__free(a, p->qpr, sizeof *p->qpr * L);
    memset(p, 0, sizeof *p);
}

/* Lay out an image of the given kinds and pack queries a request (every layer's part 64-byte
 * aligned) and allocate it: *p is replaced only on success (KVT_ERR_OUT_OF_MEMORY: unchanged). */
kvt_status kvt__batch_plan_layout(kvt_batch *b, kvt__plan_buf *p, const uint8_t *kind,
                                  const uint32_t *qpr) {
    kvt_ctx *ctx = b->ctx;
    const kvt__alloc *a = &ctx->alloc;
    const uint32_t L = ctx->n_layers;
    kvt__plan_buf n = {.at = kvt__calloc(a, sizeof *n.at * (L + 1u)), .kind = kvt__calloc(a, L),
                  .qcap = kvt__calloc(a, sizeof *n.qcap * L),
                  .qpr = kvt__calloc(a, sizeof *n.qpr * L)};
    if (n.at && n.kind && n.qcap && n.qpr) {
        for (uint32_t l = 0; l < L; l++) {
            n.kind[l] = kind[l];
            n.qpr[l] = qpr[l];
            n.qcap[l] = b->max_seqs * qpr[l];
            const kvt__recall_ops *ro = kvt__recall_kinds[kind[l]];
            const size_t end = ro ? emits_at(b, &n, l) + ro->emit_bytes * b->max_seqs
                                  : n.at[l] + PLAN_HEAD + sizeof(kvt__pack_query) * n.qcap[l];
            n.at[l + 1] = align64(end);
        }
        if (b->be.ops->buf_alloc(&b->be, n.at[L], (void **)&n.dev) == KVT_OK)
            n.host = kvt__calloc(a, n.at[L]);
    }
    if (!n.host) {
        kvt__batch_plan_free(b, &n);
        return KVT_ERR_OUT_OF_MEMORY;
    }
    kvt__batch_plan_free(b, p);
    *p = n;
    return KVT_OK;
}

/* Rows of request i's step that query token t of S sees: all of them with one query per request;
 * else its own and the earlier ones (a padded token t >= n_tokens sees what the last one does). */

static uint32_t visible_rows(const kvt_batch *b, uint32_t i, uint32_t S, uint32_t t) {
    return S == 1 || t >= b->n_tokens[i] ? b->n_tokens[i] : t + 1;
}

/* How a request's set is made on the layer (RECALL_*); *ro: the request's recall table there
 * (NULL: none). */
uint8_t kvt__batch_recall_way(const kvt_batch *b, uint32_t i, uint32_t layer, uint32_t S,
                          const kvt__recall_ops **ro) {
    const kvt_seq *sq = b->seqs[i];
    void *r;
    *ro = sq ? kvt__seq_recall_of(sq, layer, &r) : NULL;
    if (!*ro)
        return RECALL_NONE;
    return b->n_tokens[i] <= 1 && !b->defer[i] && (S == 1 || b->n_tokens[i] == 1) ? RECALL_FETCH
                                                                                 : RECALL_ALL;
}


/* Query token t of request i on the layer (entry i * S + t of the emission): its set (with a
 * fetching request's fetched rows: its recall table's pack_query, rq), and where it goes in the
 * TOKENS or CSR layout (CSR: from *off on, which it advances). */
static void set_query(const kvt_batch *b, uint32_t i, uint32_t t, uint32_t layer, uint32_t S,
                      const kvt_emit *emit, const kvt__recall_ops *ro,
                      const kvt__recall_req *rq, uint64_t *off, kvt__pack_query *pq) {
    const kvt_seq *sq = b->seqs[i];
    const bool tokens = emit->layout == KVT_EMIT_TOKENS;
    const uint64_t at = (uint64_t)i * S + t;
    if (sq)
        kvt__seq_step_query(sq, layer, visible_rows(b, i, S, t), pq);
    else
        *pq = (kvt__pack_query){0}; /* destroyed mid-step: attends nothing */
    if (b->recall_way[i] == RECALL_FETCH)
        (void)ro->pack_query(rq, NULL, pq);
    pq->all_rows = b->recall_way[i] == RECALL_ALL;
    pq->out = tokens ? at * emit->capacity : *off;
    pq->pad = tokens ? emit->capacity : 0;
    if (!tokens)
        pq->len_at = at + 1;
    else if (kvt__emit_flags(emit) & KVT_EMIT_LENGTHS_PER_SEQ) /* the last token's: the most rows */
        pq->len_at = t + 1 == S ? i : KVT__NO_LENGTH;
    else
        pq->len_at = at;
    /* an every-row set's size is the host's too (a fetching one's is not) */
    *off += pq->all_rows ? pq->d.hi_end : kvt__attended_desc_count(&pq->d);
}

/* KVT_EMIT_PAGED: pq's set as whole pages of P rows (kvt__paged_count's form: rows [0, lo_end)
 * and [hi_begin, hi_end), lo_end and hi_begin multiples of P, no list), or false when it is not
 * (a recall's fetched rows; kept rows that do not fill the gap between sinks and tail, which
 * are single rows; a range that starts inside a page). A list as long as the gap it lies in is
 * the whole gap (ascending, distinct: a salience close that kept every row), one range with
 * the sinks and tail. A sliding layer's window [n - W, n) starts at its first page's row 0: the
 * rows before it are FlashInfer's to mask (window_left = W - 1; kvtier.h, KVT_EMIT_PAGED). */
bool kvt__batch_paged_query(const kvt_ctx *ctx, uint32_t layer, kvt__pack_query *pq) {
    const uint64_t P = ctx->pdiv.d;
    kvt__attended_desc d = pq->d;
    if (pq->fetch || pq->n_fetch || pq->dense || pq->count_only)
        return false;
    if (pq->all_rows || d.n_list == d.hi_begin - d.lo_end)
        d = (kvt__attended_desc){.hi_end = d.hi_end}; /* one range from row 0 */
    else if (d.n_list)
        return false;
    else if (d.hi_end == d.hi_begin) /* the sinks alone */
        d = (kvt__attended_desc){.hi_end = d.lo_end};
    else if (d.lo_end == 0 && ctx->stores[layer].spec.kind == KVT_LAYER_SLIDING)
        d.hi_begin -= d.hi_begin % P;
    if (d.lo_end % P || d.hi_begin % P)
        return false;
    pq->d = d; /* (all_rows kept: the request's dense flag says it attends every row) */
    pq->paged = true;
    return true;
}


/* Refuse the image: a planned one that breaks its bound is not plannable (*fits false, KVT_OK;
 * fits NULL, a plan rewritten for the same step: KVT_ERR_INVARIANT); an eager one fails with s. */
static kvt_status plan_refuse(const kvt_batch *b, const kvt__layer_run *lr, bool *fits,
                              kvt_status s, const char *fmt, ...) {
    if (lr->planned && fits) {
        *fits = false;
        return KVT_OK;
    }
    char msg[KVT__ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvt__ctx_fail(b->ctx, lr->planned ? KVT_ERR_INVARIANT : s, "%s", msg);
}

/* The run's bound of layer l's items of recall kind `kind` (0: none) in lr->bound (the kind's
 * table): a planned image's from the context's stated limits (max_rows_per_seq; the launch and
 * workspace a device sizes once), an eager one's from the batch's longest request this step and
 * the largest promotion table among its requests. */
void kvt__batch_plan_bounds(const kvt_batch *b, uint32_t l, uint8_t kind, kvt__layer_run *lr) {
    const kvt_ctx *ctx = b->ctx;
    const kvt__recall_ops *ro = kvt__recall_kinds[kind];
    if (!ro)
        return;
    uint64_t rows = ctx->max_rows;
    uint32_t prom = ctx->cfg.recall_promote_capacity;
    for (uint32_t i = 0; !lr->planned && i < b->n_seqs; i++) {
        const kvt_seq *sq = b->seqs[i];
        if (!sq)
            continue;
        const uint64_t r = sq->n_tokens + sq->n_pending;
        rows = r > rows ? r : rows;
        prom = sq->cfg.recall_promote_capacity > prom ? sq->cfg.recall_promote_capacity : prom;
    }
    (void)ro->bound(&b->sites[l], rows, prom, lr->planned, &lr->bound);
}

/* Room for layer l's recall ops of `kind` (0: none; the kind's reserve) for max_seqs items
 * within lr's bound: a device's workspace, made outside any capture. */
kvt_status kvt__batch_reserve_recall(const kvt_batch *b, uint8_t kind, const kvt__layer_run *lr) {
    const kvt__recall_ops *ro = kvt__recall_kinds[kind];
    return ro ? ro->reserve(&b->be, b->max_seqs, &lr->bound) : KVT_OK;
}

/* After the recall items of a run or a plan: a request whose item copies its queries into its
 * lagged buffer holds a query from then on when they ran (ok), and the item is settled. */
void kvt__batch_lag_settle(kvt__recall_layer *r, bool ok) {
    if (r->lag_plan_item && ok)
        r->lag_has = 1;
    r->lag_plan_item = 0;
}

/* A device workspace of the batch's own sized once for its decode steps (from max_rows_per_seq):
 * the largest decode round (K + r + c rows and up to 64 tokens of a step, its group's layers at
 * once, kvt__ws_bounds), and the recall steps' room (recall_plan_reserve,
 * recall_rope_plan_reserve) for max_seqs items of every recall layer's largest shape, which an
 * eager run's own bound never passes. A longer prefill step may still grow them, outside any
 * graph. */
kvt_status kvt__batch_reserve_workspace(kvt_batch *b) {
    const kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    if (!ctx->max_rows || !be->ops->reserve)
        return KVT_OK;
    kvt_status s = KVT_OK;
    for (uint32_t l = 0; s == KVT_OK && l < ctx->n_layers; l++) {
        kvt__ws_bounds x = {.max_items = b->max_seqs};
        const kvt__store *st = &ctx->stores[l];
        if (st->group >= 0 && ctx->groups[st->group].ops->step_bounds) /* random eviction's round */
            ctx->groups[st->group].ops->step_bounds(&ctx->groups[st->group], st, &ctx->cfg, &x);
        s = be->ops->reserve(be, &x);
        const uint8_t kind = ctx_may_recall(ctx) ? b->kinds[l] : 0;
        kvt__layer_run lr = {.planned = true};
        kvt__batch_plan_bounds(b, l, kind, &lr);
        if (s == KVT_OK)
            s = kvt__batch_reserve_recall(b, kind, &lr);
    }
    return s;
}

/* KVT_ERR_CAPACITY: request i's set of `rows` rows on layer l past the emission's topk. */
static kvt_status over_topk(const kvt_ctx *ctx, uint32_t i, uint64_t rows, uint32_t l,
                            uint32_t topk, const char *nothing) {
    return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                         "seqs[%u] attends %llu rows on layer %u, topk is %u; %s "
                         "(kvt_batch_capacity)",
                         i, (unsigned long long)rows, l, topk, nothing);
}

/* Request i's recall on layer l (table ro, state r) as its table's item and pack-query entries
 * read it, over the step's view of its table (*tl, *view). */
static kvt__recall_req recall_req(const kvt_batch *b, uint32_t i, uint32_t l, const kvt_emit *e,
                                  const kvt__layer_run *lr, const kvt__recall_ops *ro, void *r,
                                  kvt__tier_layer *tl, kvt__ptable *view) {
    const kvt_seq *sq = b->seqs[i];
    *tl = kvt__seq_step_layer(sq, l, view);
    kvt__recall_req rq = {.r = r, .l = tl, .i = i, .e = e, .lists = lr->qpr,
                          .planned = lr->planned, .first = lr->first,
                          .all = b->recall_way[i] == RECALL_ALL, .bound = &lr->bound};
    if (ro->fetch_area) {
        const kvt_ctx *ctx = b->ctx;
        const kvt__ptable *f = &sq->fetch[ctx->stores[l].group];
        rq.fetch_pages = f->dpages;
        rq.fetch_rows = (uint32_t)((uint64_t)f->n_pages * ctx->page_rows);
    }
    return rq;
}

/* Does request i's run of layer l make its trigger item? A fetching request's, once per step and
 * layer: a second run of the layer emits what the first fetched (the fetch buffer and the
 * state's dense flag are unchanged); a planned image always holds it. */
static bool makes_trigger(const kvt_batch *b, const kvt__layer_run *lr, uint32_t i, uint32_t l) {
    return b->recall_way[i] == RECALL_FETCH && (lr->planned || !b->seqs[i]->recalled[l]);
}

/* Layer l's run into image pb: every request's recall items and sets as the run describes them
 * (b->recall_way set; nothing of the step moves rows), after the capacity checks. The image's
 * host copy only: nothing goes to the backend. The items and pack queries are the recall table's
 * of the layer's kind (pb->kind[l]). */
kvt_status kvt__batch_plan_layer(kvt_batch *b, const kvt__plan_buf *pb, uint32_t l,
                                 const kvt_emit *e, kvt__layer_run *lr, bool *fits) {
    kvt_ctx *ctx = b->ctx;
    const bool tokens = e->layout == KVT_EMIT_TOKENS;
    const uint32_t S = lr->S, qpr = lr->qpr;
    const char *nothing = lr->planned ? "nothing planned" : "nothing written";
    if ((uint64_t)b->n_seqs * S * qpr > pb->qcap[l])
        return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT, "layer %u: %u queries, the image holds %u",
                             l, b->n_seqs * S * qpr, pb->qcap[l]);
    uint8_t *at = pb->host + pb->at[l];
    kvt__pack_query *q = (kvt__pack_query *)(at + PLAN_HEAD);
    const kvt__recall_ops *lo = kvt__recall_kinds[pb->kind[l]]; /* the layer's kind */
    uint8_t *items = lo ? pb->host + items_at(pb, l) : NULL;
    uint8_t *emits = lo && lo->emit_bytes ? pb->host + emits_at(b, pb, l) : NULL;
    uint32_t n = 0, nr = 0, ne = 0;
    uint64_t off = 0, total = 0;
    /* 1. The sets (and a fetch-area request's items, which its sets are made from), with the
     * capacity checks: with recall a set may be every row of the view, what the host can
     * promise (with a fetch area: the held rows and the whole archive, the request's rows).
     * Nothing but the host image is written before every check passed. */
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        kvt_seq *sq = b->seqs[i];
        const uint8_t way = b->recall_way[i];
        void *r = NULL;
        const kvt__recall_ops *ro = way != RECALL_NONE ? kvt__seq_recall_of(sq, l, &r) : NULL;
        b->itemized[i] = 0;
        if (ro && ro != lo)
            return plan_refuse(b, lr, fits, KVT_ERR_INVARIANT, /* kvt__seq_step_quiet's rule */
                               "seqs[%u] recalls on layer %u, which plans no recall", i, l);
        /* A kind with a fetch area (RoPE) makes the request's set itself: its emission lists
         * the held rows and the fetched ones per KV head, the pack only places the lists. This
         * is the step's fork, not recall's: the pack's queries (the policy's sets) or the
         * emission's, of a request whose rows the run cannot know before the trigger ran. */
        if (ro && ro->fetch_area) {
            if (e->layout == KVT_EMIT_PAGED) /* (an eager run refused it before its work) */
                return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                     "seqs[%u] recalls on layer %u: KVT_EMIT_PAGED cannot list "
                                     "its fetched rows (kvt_batch_emit_fits); %s",
                                     i, l, nothing);
            if (lr->planned && way != RECALL_FETCH)
                return plan_refuse(b, lr, fits, KVT_ERR_INVARIANT,
                                   "seqs[%u] layer %u: a %s with several tokens", i, l, ro->name);
            const uint64_t rows = sq->n_tokens + sq->n_pending;
            if (tokens && rows > e->capacity)
                return over_topk(ctx, i, rows, l, e->capacity, nothing);
            total += rows * qpr;
            kvt__tier_layer tl;
            kvt__ptable view;
            const kvt__recall_req rq = recall_req(b, i, l, e, lr, ro, r, &tl, &view);
            void *em = emits + (size_t)ne * ro->emit_bytes;
            bool has = false;
            kvt_status s = ro->items(&rq, makes_trigger(b, lr, i, l),
                                     items + (size_t)nr * ro->item_bytes, em, &has);
            if (s != KVT_OK)
                return plan_refuse(b, lr, fits, s, "seqs[%u] layer %u: %s", i, l,
                                   kvt__tls_error());
            nr += has;
            b->itemized[i] = has;
            ne++;
            kvt__seq_step_query(sq, l, b->n_tokens[i], &q[n]); /* its table's pages */
            n += ro->pack_query(&rq, em, &q[n]);
            continue;
        }
        /* (a kind without a fetch area merges its fetched rows by its state alone) */
        const kvt__recall_req rq = {.r = r, .i = i, .e = e, .lists = qpr};
        for (uint32_t t = 0; t < S; t++) {
            set_query(b, i, t, l, S, e, ro, &rq, &off, &q[n]);
            if (e->layout == KVT_EMIT_PAGED && !kvt__batch_paged_query(ctx, l, &q[n]))
                return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                     "seqs[%u] layer %u: its attended set is not whole pages "
                                     "(%s), which KVT_EMIT_PAGED needs (TOKENS or CSR list "
                                     "rows; kvt_batch_emit_fits says before the run); %s",
                                     i, l,
                                     way == RECALL_FETCH ? "a recall fetches single rows"
                                     : q[n].d.n_list     ? "kept single rows"
                                                         : "a range starts inside a page",
                                     nothing);
            const uint64_t rows = q[n].paged           ? kvt__paged_count(&q[n].d, &ctx->pdiv)
                                  : way == RECALL_NONE ? kvt__attended_desc_count(&q[n].d)
                                                       : q[n].d.hi_end;
            if (tokens && rows > e->capacity)
                return over_topk(ctx, i, rows, l, e->capacity, nothing);
            total += rows * qpr;
            /* CSR_KV_HEADS: the set once per KV head, each its own list */
            for (uint32_t h = 0; !tokens && h < qpr; h++) {
                if (h)
                    q[n + h] = q[n];
                q[n + h].len_at = ((uint64_t)i * S + t) * qpr + h + 1;
            }
            n += qpr;
        }
    }
    if (!tokens && (total > e->capacity || total > INT32_MAX))
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                             "the batch attends %llu %s on layer %u, capacity is %u; %s "
                             "(kvt_batch_capacity)",
                             (unsigned long long)total,
                             e->layout == KVT_EMIT_PAGED ? "pages" : "rows", l, e->capacity,
                             nothing);
    /* 2. The other kinds' (NoPE's) trigger items, after every check (an item fixes its
     * request's lagged query). */
    for (uint32_t i = 0; lo && !lo->fetch_area && i < b->n_seqs; i++) {
        kvt_seq *sq = b->seqs[i];
        bool has = false;
        void *r;
        if (!makes_trigger(b, lr, i, l) || kvt__seq_recall_of(sq, l, &r) != lo)
            continue;
        kvt__tier_layer tl;
        kvt__ptable view;
        const kvt__recall_req rq = recall_req(b, i, l, e, lr, lo, r, &tl, &view);
        kvt_status s = lo->items(&rq, true, items + (size_t)nr * lo->item_bytes, NULL, &has);
        if (s != KVT_OK)
            return plan_refuse(b, lr, fits, s, "seqs[%u] layer %u: %s", i, l, kvt__tls_error());
        nr += has;
        b->itemized[i] = has;
    }
    const uint32_t counts[3] = {n, nr, ne};
    memcpy(at, counts, sizeof counts);
    lr->n_q = n;
    lr->n_recall = nr;
    lr->n_emit = ne;
    return KVT_OK;
}

/* Layer l's part of image pb to the backend, on stream (the host image as kvt__batch_plan_layer
 * left it: its counts, queries and items). */
kvt_status kvt__batch_plan_write_layer(kvt_batch *b, const kvt__plan_buf *pb, uint32_t l,
                                   const kvt__layer_run *lr, void *stream) {
    const kvt__backend *be = &b->be;
    const size_t at = pb->at[l], it = items_at(pb, l);
    kvt_status s = be->ops->write(be, pb->dev + at, pb->host + at,
                                  PLAN_HEAD + sizeof(kvt__pack_query) * lr->n_q, stream);
    const kvt__recall_ops *ro = kvt__recall_kinds[pb->kind[l]];
    if (s == KVT_OK && lr->n_recall)
        s = be->ops->write(be, pb->dev + it, pb->host + it, ro->item_bytes * lr->n_recall,
                           stream);
    const size_t em = lr->n_emit ? emits_at(b, pb, l) : 0;
    if (s == KVT_OK && lr->n_emit)
        s = be->ops->write(be, pb->dev + em, pb->host + em, ro->emit_bytes * lr->n_emit, stream);
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(b->ctx, s, "layer %u: the run's plan to the backend", l);
}

/* Run layer l's part of image pb: its recall kind's step when `trigger`, the pack, the kind's
 * emission (a fetch area's lists). A planned image's ops run whatever its counts (the device's
 * then); an eager one's skip what has no item, and make room for the recall ops first (a
 * device's workspace: an eager run is never captured). */
kvt_status kvt__batch_exec_layer(kvt_batch *b, const kvt__plan_buf *pb, uint32_t l,
                                 const float *query, void *stream, const kvt_emit *emit,
                                 const kvt__layer_run *lr, bool trigger) {
    kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    const uint8_t *at = pb->dev + pb->at[l];
    const uint32_t *counts = (const uint32_t *)at;
    const kvt__recall_ops *ro = kvt__recall_kinds[pb->kind[l]];
    kvt_status s = KVT_OK;
    kvt__recall_run run = {0};
    if (ro) {
        run = (kvt__recall_run){.items = pb->dev + items_at(pb, l),
                                .emits = ro->emit_bytes ? pb->dev + emits_at(b, pb, l) : NULL,
                                .n = counts + 1, .n_emit = counts + 2, .n_max = b->max_seqs,
                                .query = query, .query_floats = lr->query_floats,
                                .bound = &lr->bound};
        if (trigger && !lr->planned)
            s = kvt__batch_reserve_recall(b, pb->kind[l], lr);
        if (trigger && (s != KVT_OK || (s = ro->step(be, &run, stream)) != KVT_OK))
            return kvt__ctx_fail(ctx, s, "the %s step of layer %u", ro->name, l);
    }
    const kvt__pack_args pa = {.q_plan = (const kvt__pack_query *)(at + PLAN_HEAD),
                               .n_plan = counts,
                               .n_max = lr->planned ? pb->qcap[l] : lr->n_q,
                               .dense_out = emit->dense,
                               .dense_stride = lr->S * lr->qpr,
                               .pdiv = &ctx->pdiv,
                               .csr = emit->layout != KVT_EMIT_TOKENS,
                               .first_csr = true,
                               .capacity = emit->capacity,
                               .indices = emit->indices,
                               .lengths = emit->lengths,
                               .indptr = emit->indptr,
                               .last_page_len = kvt__emit_last_page_len(emit)};
    if ((s = be->ops->pack(be, &pa, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "packing the attended sets of layer %u", l);
    /* the fetch-area requests' rows, after the pack (which wrote their dense flags and, in CSR,
     * their lists' offsets) */
    if (ro && ro->emit && (lr->planned || lr->n_emit) &&
        (s = ro->emit(be, &run, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "the %s lists of layer %u", ro->name, l);
    return KVT_OK;
}

/* The eager image with room for layer l's run of n_q queries a request and, where requests
 * recall there, its kind of items (l = UINT32_MAX: none, the first layout). Laid out when the
 * batch is created, every layer with its KV heads' lists a request and the items of the recall
 * its requests may do (kvt__ctx_recall_of); grown when a run needs more (several query tokens a
 * request: KVT_ERR_OUT_OF_MEMORY leaves it unchanged). */
kvt_status kvt__batch_eager_room(kvt_batch *b, uint32_t l, uint32_t n_q, uint8_t kind) {
    kvt_ctx *ctx = b->ctx;
    const uint32_t L = ctx->n_layers;
    kvt__plan_buf *p = &b->eager;
    if (p->at && l < L && p->qpr[l] >= n_q && (kind == 0 || p->kind[l] == kind))
        return KVT_OK;
    uint8_t kinds[L ? L : 1];
    uint32_t qpr[L ? L : 1];
    for (uint32_t k = 0; k < L; k++) {
        const uint32_t kv = ctx->stores[k].spec.n_kv_heads;
        kinds[k] = p->at ? p->kind[k] : b->kinds[k];
        qpr[k] = p->at ? p->qpr[k] : kv > 1 ? kv : 1;
    }
    if (l < L && kind)
        kinds[l] = kind;
    if (l < L && n_q > qpr[l])
        qpr[l] = n_q;
    kvt_status s = kvt__batch_plan_layout(b, p, kinds, qpr);
    return s == KVT_OK ? KVT_OK : kvt__ctx_fail(ctx, s, "the batch's plan image for its runs");
}

/* Every layer's sets of the planned step into the planned image, as each run would describe
 * them (nothing of the step moves rows), with kvt_batch_run's capacity checks (sync: the page
 * tables' new entries to the backend first), then the image to the backend on stream. A recall
 * item outside its layer's bound: *fits false, KVT_OK, nothing written to the backend (the step
 * is not plannable); fits NULL (a plan rewritten for the same step): KVT_ERR_INVARIANT. */
kvt_status kvt__batch_plan_fill(kvt_batch *b, const kvt_emit *emits, uint32_t n_emits, void *stream,
                            bool sync, bool *fits) {
    kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    const uint32_t L = ctx->n_layers;
    memset(b->defer, 0, b->n_seqs); /* a planned step has no drafts and one query a request */
    for (uint32_t l = 0; l < L; l++) {
        const kvt_emit *e = &emits[n_emits == 1 ? 0 : l];
        /* kvt_batch_plan_device's copies (an older caller's struct_size bytes, the fields past
         * them zero); a re-plan passes the kept copies themselves */
        if (e != &b->plan_emit[l])
            b->plan_emit[l] = *e;
        if (ctx->stores[l].group < 0) { /* no run: nothing to plan */
            memset(b->plan.host + b->plan.at[l], 0, 3 * sizeof(uint32_t));
            continue;
        }
        for (uint32_t i = 0; i < b->n_seqs; i++) {
            kvt_seq *sq = b->seqs[i];
            kvt_status s = sq && sync ? kvt__seq_mirror_sync(sq, l, be, stream) : KVT_OK;
            if (s != KVT_OK)
                return kvt__ctx_fail(ctx, s, "seqs[%u] layer %u: page table to the backend", i,
                                     l);
            const kvt__recall_ops *ro;
            b->recall_way[i] = kvt__batch_recall_way(b, i, l, 1, &ro);
        }
        kvt__layer_run lr = {.S = 1, .qpr = b->plan.qpr[l], .planned = true, .first = fits != NULL};
        kvt__batch_plan_bounds(b, l, b->plan.kind[l], &lr);
        kvt_status s = kvt__batch_plan_layer(b, &b->plan, l, e, &lr, fits);
        if (s != KVT_OK || (fits && !*fits))
            return s;
    }
    kvt_status s = be->ops->write(be, b->plan.dev, b->plan.host, b->plan.at[L], stream);
    return s == KVT_OK ? KVT_OK : kvt__ctx_fail(ctx, s, "the step's plan to the backend");
}

kvt_status kvt__batch_run_eager(kvt_batch *b, uint32_t layer, const float *query, void *stream,
                                const kvt_emit *emit, bool recalls, kvt__layer_run *lr) {
    kvt__batch_plan_bounds(b, layer, recalls ? b->eager.kind[layer] : 0, lr);
    kvt_status s = kvt__batch_plan_layer(b, &b->eager, layer, emit, lr, NULL);
    if (s == KVT_OK)
        s = kvt__batch_plan_write_layer(b, &b->eager, layer, lr, stream);
    if (s == KVT_OK)
        s = kvt__batch_exec_layer(b, &b->eager, layer, query, stream, emit, lr, lr->n_recall > 0);
    /* the requests whose recall ran: once per step and layer; config.recall_lagged_query: the
     * op copied this step's queries, the next step's (every kind's base state: a kind without
     * a lagged query has nothing to settle) */
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        kvt_seq *sq = b->seqs[i];
        if (!sq || !b->itemized[i])
            continue;
        if (s == KVT_OK)
            sq->recalled[layer] = 1;
        kvt__batch_lag_settle(kvt__seq_recall_base(sq, layer), s == KVT_OK);
    }
    return s;
}
