/* seq_inspect.c — inspection of a request (synchronising, off the decode path): rows by
 * original position (row state, read_row, positions, last slot map), statistics
 * (kvt_seq_layer_stats, kvt_ctx_memory_stats), the invariant check (kvt_seq_check) and the σ
 * scores. */
#include "lib/seq_internal.h"

#include "kernels/philox.h"
#include "recall/kernels/recall_scan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const kvt__recall_layer *recall_base(const kvt_seq *seq, uint32_t layer) {
    return kvt__seq_recall_base(seq, layer);
}

/* ------------------------------------------------------------------------------------------- */
/* Rows by original position                                                                   */
/* ------------------------------------------------------------------------------------------- */
static kvt_status locate(const kvt_seq *seq, uint32_t layer, uint32_t head, uint64_t pos,
                         kvt_row_state *state, int32_t *slot, const kvt__store **stp) {
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_head_of(seq, layer, head, &st);
    if (s != KVT_OK)
        return s;
    const kvt_ctx *ctx = seq->ctx;
    *stp = st;
    *slot = -1;
    if (pos >= seq->n_tokens) {
        if (pos < seq->n_tokens + seq->n_pending) {
            *state = KVT_ROW_PENDING;
            const kvt__ptable *t = &seq->pt[st->group];
            *slot = kvt__slot(t, &ctx->pdiv, t->n_rows + (pos - seq->n_tokens));
            return KVT_OK;
        }
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "position %llu of %llu committed",
                             (unsigned long long)pos, (unsigned long long)seq->n_tokens);
    }
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    *state = l.gr->ops->row_state(&l, head, pos, slot);
    return KVT_OK;
}

kvt_status kvt_seq_row_state(const kvt_seq *seq, uint32_t layer, uint32_t head, uint64_t position,
                             kvt_row_state *state, int32_t *slot) {
    CHECK_BETWEEN_STEPS(seq);
    if (!state)
        return KVT_ERR_INVALID_ARGUMENT;
    int32_t sl;
    const kvt__store *st;
    kvt_status s = locate(seq, layer, head, position, state, &sl, &st);
    /* Documented: a slot is given for attended and pending rows only (an archived row may still
     * have one in the pool). */
    if (s == KVT_OK && slot)
        *slot = (*state == KVT_ROW_ATTENDED || *state == KVT_ROW_PENDING) ? sl : -1;
    return s;
}

kvt_status kvt_seq_read_row(const kvt_seq *seq, uint32_t layer, uint32_t plane, uint32_t head,
                            uint64_t position, void *dst, size_t dst_bytes) {
    CHECK_BETWEEN_STEPS(seq);
    if (!dst)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_row_state state;
    int32_t slot;
    const kvt__store *st;
    kvt_status s = locate(seq, layer, head, position, &state, &slot, &st);
    if (s != KVT_OK)
        return s;
    const kvt_ctx *ctx = seq->ctx;
    if (plane >= st->spec.n_planes)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "plane %u of %u", plane,
                             st->spec.n_planes);
    if (dst_bytes < st->spec.row_bytes)
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY, "dst_bytes %zu < row_bytes %u", dst_bytes,
                             st->spec.row_bytes);
    const kvt__policy_ops *ops = kvt__seq_ops_of(ctx, layer);
    if (state == KVT_ROW_DROPPED)
        return kvt__ctx_fail(ctx, KVT_ERR_DROPPED, "layer %u head %u position %llu was dropped %s",
                             layer, head, (unsigned long long)position,
                             ops->dropped_how ? ops->dropped_how : "");
    if (slot >= 0) /* in the pool: through the backend (its memory space) */
        return ctx->backend.ops->read(&ctx->backend, dst,
                                      st->plane[plane] + (size_t)slot * st->slot_bytes +
                                          (size_t)head * st->spec.row_bytes,
                                      st->spec.row_bytes, NULL);
    /* Archived out of the pool (eviction's archive, in the backend's memory). */
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    s = ops->read_archived ? ops->read_archived(&l, head, plane, position, dst)
                           : KVT_ERR_INVARIANT;
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "archived row of layer %u head %u position %llu: %s", layer,
                             head, (unsigned long long)position,
                             s == KVT_ERR_INVARIANT ? "not found" : "reading it failed");
    return KVT_OK;
}

kvt_status kvt_seq_positions(const kvt_seq *seq, uint32_t layer, uint32_t head, int64_t *positions,
                             uint64_t capacity, uint64_t *n) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_head_of(seq, layer, head, &st);
    if (s != KVT_OK)
        return s;
    const kvt__ptable *t = &seq->pt[st->group];
    if (n)
        *n = t->n_rows;
    if (!positions)
        return KVT_OK;
    if (t->n_rows > capacity)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_CAPACITY, "%llu rows, capacity %llu",
                             (unsigned long long)t->n_rows, (unsigned long long)capacity);
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    s = l.gr->ops->positions(&l, head, positions);
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(seq->ctx, s, "positions of layer %u from the backend",
                                       layer);
}

kvt_status kvt_seq_last_slot_map(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                 int32_t *old_to_new, uint64_t capacity, uint64_t *n) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_head_of(seq, layer, head, &st);
    if (s != KVT_OK)
        return s;
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    if (!l.gr->ops->last_slot_map) /* rows of this policy never move */
        return kvt__ctx_fail(seq->ctx, KVT_ERR_POLICY_MISMATCH,
                             "layer %u does not run eviction rounds", layer);
    uint64_t n_map = 0;
    s = l.gr->ops->last_slot_map(&l, head, NULL, &n_map);
    if (n)
        *n = n_map;
    if (s != KVT_OK || !old_to_new)
        return s;
    if (n_map > capacity)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_CAPACITY, "%llu entries, capacity %llu",
                             (unsigned long long)n_map, (unsigned long long)capacity);
    s = l.gr->ops->last_slot_map(&l, head, old_to_new, &n_map);
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(seq->ctx, s, "slot map of layer %u from the backend",
                                       layer);
}

/* ------------------------------------------------------------------------------------------- */
/* Statistics and invariants                                                                   */
/* ------------------------------------------------------------------------------------------- */
/* Backend bytes beyond the pool's pages that layer i holds for seq: the policy's side planes
 * (*shared of them in the set *key, which other requests hold too) and the recall trigger's. */
static void layer_side_bytes(const kvt_seq *seq, uint32_t i, uint64_t *own, uint64_t *shared,
                             const void **key, uint32_t *holders) {
    const kvt__policy_ops *ops = kvt__seq_ops_of(seq->ctx, i);
    *own = *shared = 0;
    *key = NULL;
    *holders = 1;
    if (ops->side_bytes)
        ops->side_bytes(kvt__seq_state(seq, i), own, shared, key, holders);
    if (seq->recall)
        *own += kvt__recall_layer_bytes(&seq->recall[i]);
    if (seq->rrope) /* the RoPE trigger's state and fetch lists */
        *own += kvt__recall_layer_bytes(&seq->rrope[i].base) +
                (seq->rrope[i].fbuf ? seq->rrope[i].fbytes : 0);
}

kvt_status kvt_seq_layer_stats(const kvt_seq *seq, uint32_t layer, kvt_layer_stats *out) {
    CHECK_BETWEEN_STEPS(seq);
    size_t out_size = out ? kvt__struct_out_size(out, sizeof *out, KVT_LAYER_STATS_SIZE_MIN) : 0;
    if (out_size == 0)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_INVALID_ARGUMENT,
                             "out->struct_size below KVT_LAYER_STATS_SIZE_MIN (%zu)",
                             (size_t)KVT_LAYER_STATS_SIZE_MIN);
    kvt_layer_stats full;
    kvt_layer_stats *caller = out;
    out = &full;
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    const kvt_ctx *ctx = seq->ctx;
    const kvt__ptable *t = &seq->pt[st->group];
    uint32_t H = st->spec.n_kv_heads;
    memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
    out->policy = ctx->policies[layer];
    out->appended_rows = seq->n_tokens * H;
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    out->attended_rows = kvt__attended_count(&l);
    /* the table's pages and, with recall on a RoPE layer of the group, the fetch area's */
    const uint64_t fetch_pages = seq->fetch[st->group].n_pages;
    out->pages_in_use = t->n_pages + fetch_pages;
    const kvt__pool *pool = &ctx->groups[st->group].pool;
    for (uint32_t k = 0; pool->shared && k < t->n_pages; k++)
        out->shared_pages += pool->refs[t->pages[k]] > 1;
    out->bytes_in_use = out->pages_in_use * ctx->page_rows * st->slot_bytes * st->spec.n_planes;
    const void *side_key;
    uint32_t side_holders;
    layer_side_bytes(seq, layer, &out->side_bytes, &out->shared_side_bytes, &side_key,
                     &side_holders);
    out->side_bytes += out->shared_side_bytes;
    out->prompt_rows = seq->prompt_rows;
    if (l.gr->ops->stats)
        l.gr->ops->stats(&l, out);
    if (recall_base(seq, layer)) {
        kvt__recall_state rs;
        if ((s = kvt__recall_layer_read(recall_base(seq, layer), &ctx->backend, &rs)) != KVT_OK)
            return kvt__ctx_fail(ctx, s, "reading the recall state of layer %u", layer);
        out->recall_mode = (int32_t)seq->cfg.recall;
        out->recall_phase = (int32_t)rs.phase;
        out->recall_z = kvt__recall_mode_z((int)seq->cfg.recall, st->spec.value_dim,
                                           seq->cfg.recall_margin, rs.z);
        out->recall_samples = rs.n_samples;
        out->recall_steps = rs.steps;
        out->recall_calib_steps = rs.calib_steps;
        out->recall_overflow_steps = rs.overflow_steps;
        out->recall_visited_rows = rs.visited;
        out->recall_fired_rows = rs.fired;
        out->recall_fetched_rows = rs.fetched;
        out->recall_last_archived = rs.last_archived;
        out->recall_last_visited = rs.last_visited;
        out->recall_last_fired = rs.last_fired;
        out->recall_last_fetched = rs.last_fetched;
        out->recall_last_dense = rs.last_dense != 0;
        out->recall_last_overflow = rs.last_overflow != 0;
        out->recall_last_lagged = recall_base(seq, layer)->last_lagged != 0;
        if (kvt__seq_recalls_rope(seq, layer)) { /* fetched rows copied out of the archive */
            const uint64_t rb = (uint64_t)st->spec.n_planes * st->spec.row_bytes;
            out->recall_moved_bytes = rs.fetched * rb;
            out->recall_last_moved_bytes = rs.last_fetched * rb;
        }
        kvt__recall_promo pr;
        if (seq->recall[layer].promo &&
            (s = ctx->backend.ops->read(&ctx->backend, &pr, seq->recall[layer].promo, sizeof pr,
                                        NULL)) != KVT_OK)
            return kvt__ctx_fail(ctx, s, "reading the recall promotion of layer %u", layer);
        if (seq->recall[layer].promo) {
            out->recall_promoted = pr.n_prom;
            out->recall_promote_room =
                kvt__seq_promote_room(kvt__layer_policy(ctx, layer), out->closed_rows, &seq->cfg);
            out->recall_promotions = pr.promotions;
            out->recall_demotions = pr.demotions;
            out->recall_absorbed = pr.absorbed;
            out->recall_last_promoted = pr.last_promoted;
        }
    }
    /* promoted rows are attended at every step: they count in the compression */
    const uint64_t attended = out->attended_rows + out->recall_promoted;
    out->effective_ratio = attended ? (double)seq->n_tokens / (double)attended : 0.0;
    uint64_t row_bytes_all = kvt_layer_bytes_per_token(&st->spec);
    out->attended_bytes_per_token =
        seq->n_tokens ? (double)out->attended_rows * (double)row_bytes_all / (double)seq->n_tokens
                      : 0.0;
    /* An output struct: written up to the caller's size, which says so. */
    full.struct_size = out_size;
    memcpy(caller, &full, out_size);
    return KVT_OK;
}

/* Shared side-plane sets seen by kvt_ctx_memory_stats: one entry per (holder, layer). */
typedef struct side_set {
    const void *key;
    uint64_t bytes;
} side_set;

static int side_set_cmp(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const side_set *)a)->key, y = (uintptr_t)((const side_set *)b)->key;
    return x < y ? -1 : x > y;
}

kvt_status kvt_ctx_memory_stats(const kvt_ctx *ctx, kvt_ctx_memory *out) {
    if (!ctx)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(ctx);
    size_t out_size = out ? kvt__struct_out_size(out, sizeof *out, KVT_CTX_MEMORY_SIZE_MIN) : 0;
    if (out_size == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "out is NULL or out->struct_size below KVT_CTX_MEMORY_SIZE_MIN (%zu)",
                             (size_t)KVT_CTX_MEMORY_SIZE_MIN);
    kvt_ctx_memory m;
    memset(&m, 0, sizeof m);
    /* The pools: a page is held once whatever the number of its holders. */
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        const kvt__group *gr = &ctx->groups[g];
        uint64_t page_bytes = 0;
        for (uint32_t k = 0; k < gr->n_layers; k++) {
            const kvt__store *st = &ctx->stores[gr->layers[k]];
            page_bytes += (uint64_t)ctx->page_rows * st->slot_bytes * st->spec.n_planes;
        }
        const uint64_t held = ctx->n_pages - gr->pool.n_free;
        m.pages_in_use += held;
        m.shared_pages += gr->pool.shared;
        m.bytes_in_use += held * page_bytes;
        m.shared_bytes += gr->pool.shared * page_bytes;
    }
    /* The side planes: own ones summed, shared sets once each (sorted by key). */
    uint64_t n_sets = 0;
    for (const kvt_seq *q = ctx->seqs; q; q = q->next) {
        if (q->in_step)
            return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                                 "request %llu has a step in flight: memory is counted between "
                                 "steps",
                                 (unsigned long long)q->request_id);
        m.requests++;
        n_sets += ctx->n_layers;
    }
    const size_t bytes = sizeof(side_set) * (n_sets ? n_sets : 1);
    side_set *sets = kvt__malloc(&ctx->alloc, bytes);
    if (!sets)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "memory statistics: scratch of %zu bytes",
                             bytes);
    size_t n = 0;
    for (const kvt_seq *q = ctx->seqs; q; q = q->next)
        for (uint32_t i = 0; i < ctx->n_layers; i++) {
            if (ctx->stores[i].group < 0)
                continue;
            uint64_t own, shared;
            const void *key;
            uint32_t holders;
            layer_side_bytes(q, i, &own, &shared, &key, &holders);
            m.side_bytes += own;
            const kvt__tier_layer l = kvt__seq_tier_layer(q, i);
            if (l.gr->ops->stats) { /* the archive's rows, by space */
                kvt_layer_stats ls;
                memset(&ls, 0, sizeof ls);
                l.gr->ops->stats(&l, &ls);
                *(ls.archive_space == KVT_SPACE_HOST ? &m.archive_host_bytes
                                                     : &m.archive_device_bytes) += ls.archive_bytes;
            }
            if (shared)
                sets[n++] = (side_set){key, shared};
        }
    qsort(sets, n, sizeof *sets, side_set_cmp);
    for (size_t k = 0; k < n; k++)
        if (k == 0 || sets[k].key != sets[k - 1].key) {
            m.side_bytes += sets[k].bytes;
            m.shared_side_bytes += sets[k].bytes;
        }
    kvt__free(&ctx->alloc, sets, bytes);
    m.struct_size = out_size;
    memcpy(out, &m, out_size);
    return KVT_OK;
}

static kvt_status check_pages(const kvt_seq *seq) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__alloc *a = &ctx->alloc;
    size_t bytes = sizeof(uint32_t) * ctx->n_pages;
    uint32_t *seen = kvt__malloc(a, bytes); /* tables holding each page */
    if (!seen)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "check scratch");
    kvt_status rc = KVT_OK;
    for (uint32_t g = 0; g < ctx->n_groups && rc == KVT_OK; g++) {
        const kvt__pool *p = &ctx->groups[g].pool;
        memset(seen, 0, bytes);
        for (uint32_t i = 0; i < p->n_free && rc == KVT_OK; i++) {
            if (p->free_ids[i] >= ctx->n_pages || seen[p->free_ids[i]]++ ||
                p->refs[p->free_ids[i]] != 0)
                rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT, "group %u: free page %u invalid, "
                                   "listed twice or still referenced", g, p->free_ids[i]);
        }
        uint64_t held = 0;
        for (const kvt_seq *q = ctx->seqs; q && rc == KVT_OK; q = q->next) {
            const kvt__ptable *t = &q->pt[g];
            if (t->n_pages != kvt__ptable_pages_for(t, t->n_rows + t->n_pending, ctx->page_rows) ||
                (t->n_pages == 0 && t->first_page != 0))
                rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                   "group %u: request %llu holds %u pages for rows [%llu, %llu)",
                                   g, (unsigned long long)q->request_id, t->n_pages,
                                   (unsigned long long)kvt__ptable_first_row(t, ctx->page_rows),
                                   (unsigned long long)(t->n_rows + t->n_pending));
            else if (t->dropped_rows != kvt__ptable_first_row(t, ctx->page_rows))
                rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                   "group %u: request %llu counted %llu dropped rows for %llu "
                                   "returned pages",
                                   g, (unsigned long long)q->request_id,
                                   (unsigned long long)t->dropped_rows,
                                   (unsigned long long)t->first_page);
            else if (t->first_page != 0 &&
                     (ctx->groups[g].window_rows == 0 ||
                      kvt__ptable_first_row(t, ctx->page_rows) + ctx->groups[g].window_rows >
                          t->n_rows))
                rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                   "group %u: request %llu returned rows [0, %llu) of %llu, "
                                   "inside a window of %u rows",
                                   g, (unsigned long long)q->request_id,
                                   (unsigned long long)kvt__ptable_first_row(t, ctx->page_rows),
                                   (unsigned long long)t->n_rows, ctx->groups[g].window_rows);
            else if (ctx->groups[g].window_rows != 0 && t->n_rows > ctx->groups[g].window_rows &&
                     t->first_page !=
                         (t->n_rows - ctx->groups[g].window_rows) / ctx->page_rows)
                rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                   "group %u: request %llu has returned %llu leading pages, its "
                                   "window of %u rows in %llu allows exactly %llu",
                                   g, (unsigned long long)q->request_id,
                                   (unsigned long long)t->first_page, ctx->groups[g].window_rows,
                                   (unsigned long long)t->n_rows,
                                   (unsigned long long)((t->n_rows - ctx->groups[g].window_rows) /
                                                        ctx->page_rows));
            for (uint32_t i = 0; i < t->n_pages && rc == KVT_OK; i++) {
                int32_t pg = t->pages[i];
                if (pg < 0 || (uint32_t)pg >= ctx->n_pages)
                    rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                       "group %u: page %d of request %llu invalid", g, pg,
                                       (unsigned long long)q->request_id);
                else if (seen[pg]++ == 0)
                    held++; /* a shared page counts once */
            }
            /* a RoPE recall's fetch area: pages of the request's own, never shared */
            const kvt__ptable *f = &q->fetch[g];
            for (uint32_t i = 0; i < f->n_pages && rc == KVT_OK; i++) {
                int32_t pg = f->pages[i];
                if (pg < 0 || (uint32_t)pg >= ctx->n_pages || seen[pg]++ != 0)
                    rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                       "group %u: fetch page %d of request %llu invalid or held "
                                       "twice",
                                       g, pg, (unsigned long long)q->request_id);
                else
                    held++;
            }
        }
        /* Every page is free or held by exactly as many tables as its reference count says. */
        uint64_t shared = 0;
        for (uint32_t pg = 0; pg < ctx->n_pages && rc == KVT_OK; pg++) {
            bool is_free = p->refs[pg] == 0;
            if (is_free ? seen[pg] != 1 : seen[pg] != p->refs[pg])
                rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                   "group %u: page %u is referenced %u times, held by %u tables%s",
                                   g, pg, p->refs[pg], is_free ? 0 : seen[pg],
                                   is_free ? " (free)" : "");
            shared += p->refs[pg] > 1;
        }
        if (rc == KVT_OK && shared != p->shared)
            rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT, "group %u: %llu shared pages, counted %llu",
                               g, (unsigned long long)shared, (unsigned long long)p->shared);
        if (rc == KVT_OK && held + p->n_free != ctx->n_pages)
            rc = kvt__ctx_fail(ctx, KVT_ERR_INVARIANT, "group %u: %llu held + %u free != %u pages",
                               g, (unsigned long long)held, p->n_free, ctx->n_pages);
    }
    kvt__free(a, seen, bytes);
    return rc;
}

/* The promotion part of a layer's recall state against the policy's view (kept set, closed
 * rows, the close's reserve). */
static kvt_status check_promo(const kvt_seq *seq, uint32_t layer, char *msg, size_t len) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__recall_layer *r = &seq->recall[layer];
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    kvt__recall_scan_args v;
    if (!l.gr->ops->recall_view || !l.gr->ops->recall_view(&l, &v))
        return KVT_OK;
    size_t pb = kvt__recall_promo_bytes(r), kb = sizeof(uint32_t) * v.m;
    uint8_t *buf = kvt__malloc(&ctx->alloc, pb + kb + 1);
    if (!buf)
        return KVT_ERR_OUT_OF_MEMORY;
    uint32_t *kept = (uint32_t *)(void *)(buf + pb);
    kvt_status s = kvt__recall_layer_read_promo(r, &ctx->backend, buf);
    if (s == KVT_OK && kb)
        s = ctx->backend.ops->read(&ctx->backend, kept, v.kept, kb, NULL);
    if (s == KVT_OK)
        s = kvt__recall_promo_check(r, buf, v.n_closed, v.sinks, kept, v.m,
                                    kvt__seq_promote_room(l.gr->ops, v.n_closed, &seq->cfg),
                                    seq->cfg.recall_promote_window, msg, len);
    kvt__free(&ctx->alloc, buf, pb + kb + 1);
    return s;
}

/* The trigger's state of a layer, read back (samples included). */
static kvt_status check_recall(const kvt_seq *seq, uint32_t layer) {
    const kvt__recall_layer *r = recall_base(seq, layer);
    if (!r)
        return KVT_OK;
    const kvt_ctx *ctx = seq->ctx;
    kvt__recall_state rs;
    kvt_status s = kvt__recall_layer_read(r, &ctx->backend, &rs);
    float *smp = NULL;
    size_t bytes = sizeof *smp * (rs.n_samples <= r->sample_cap ? rs.n_samples : 0);
    if (s == KVT_OK && bytes && !(smp = kvt__malloc(&ctx->alloc, bytes)))
        s = KVT_ERR_OUT_OF_MEMORY;
    if (s == KVT_OK && bytes)
        s = kvt__recall_layer_read_samples(r, &ctx->backend, smp, rs.n_samples);
    char msg[KVT__ERR_LEN] = "";
    if (s == KVT_OK)
        s = kvt__recall_state_check(r, &rs, bytes ? smp : NULL, msg, sizeof msg);
    kvt__free(&ctx->alloc, smp, bytes);
    if (s == KVT_OK && r->promo)
        s = check_promo(seq, layer, msg, sizeof msg);
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(ctx, s, "layer %u: %s", layer,
                                       msg[0] ? msg : "reading the recall state");
}

/* A set of side planes seq shares on layer i (prefix sharing) is held by as many live requests
 * as it records (parked slots hold none). */
static kvt_status check_side_share(const kvt_seq *seq, uint32_t i) {
    uint64_t own, shared;
    const void *key;
    uint32_t holders;
    layer_side_bytes(seq, i, &own, &shared, &key, &holders);
    if (!key)
        return KVT_OK;
    uint32_t seen = 0;
    for (const kvt_seq *q = seq->ctx->seqs; q; q = q->next) {
        uint64_t o2, s2;
        const void *k2;
        uint32_t h2;
        layer_side_bytes(q, i, &o2, &s2, &k2, &h2);
        if (k2 == key && (s2 != shared || h2 != holders))
            return kvt__ctx_fail(seq->ctx, KVT_ERR_INVARIANT,
                                 "layer %u: requests %llu and %llu share side planes but count "
                                 "%llu bytes / %u holders and %llu / %u",
                                 i, (unsigned long long)seq->request_id,
                                 (unsigned long long)q->request_id, (unsigned long long)shared,
                                 holders, (unsigned long long)s2, h2);
        seen += k2 == key;
    }
    if (seen != holders || holders < 2)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_INVARIANT,
                             "layer %u: request %llu's shared side planes record %u holders, %u "
                             "live requests hold them",
                             i, (unsigned long long)seq->request_id, holders, seen);
    return KVT_OK;
}

kvt_status kvt_seq_check(const kvt_seq *seq) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt_ctx *ctx = seq->ctx;
    /* Orphaned: a run did the step's policy work over rows no commit will count, so counters
     * disagree by design; that is the caller's state, not a library bug. */
    if (seq->n_pending && !seq->batch)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "request %llu: its step's batch was destroyed after a run, so the "
                             "step can be neither committed nor undone: destroy it",
                             (unsigned long long)seq->request_id);
    kvt_status s = check_pages(seq);
    if (s != KVT_OK)
        return s;
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        const kvt__ptable *t = &seq->pt[g];
        bool positional = ctx->groups[g].ops->rows_are_positions;
        if (t->n_pending != seq->n_pending || (positional && t->n_rows != seq->n_tokens) ||
            t->n_rows > seq->n_tokens)
            return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                 "group %u holds %llu rows + %u pending; sequence has %llu + %u", g,
                                 (unsigned long long)t->n_rows, t->n_pending,
                                 (unsigned long long)seq->n_tokens, seq->n_pending);
    }
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        if (ctx->stores[i].group < 0)
            continue;
        s = kvt__seq_check_layer(seq, i, true);
        if (s != KVT_OK)
            return s;
        if ((s = check_recall(seq, i)) != KVT_OK)
            return s;
        if ((s = check_side_share(seq, i)) != KVT_OK)
            return s;
    }
    return KVT_OK;
}

kvt_status kvt_seq_scores(const kvt_seq *seq, uint32_t layer, float *scores, uint64_t capacity,
                          uint64_t *n) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    if (!l.gr->ops->scores)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_POLICY_MISMATCH,
                             "layer %u (%s) keeps no per-row scores", layer,
                             kvt_policy_name(seq->ctx->policies[layer]));
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    l.gr->ops->stats(&l, &ls);
    if (n)
        *n = ls.closed_rows;
    if (!scores)
        return KVT_OK;
    if (ls.closed_rows > capacity)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_CAPACITY, "%llu scores, capacity %llu",
                             (unsigned long long)ls.closed_rows, (unsigned long long)capacity);
    char msg[KVT__ERR_LEN];
    s = l.gr->ops->scores(&l, scores, msg, sizeof msg);
    return s == KVT_OK ? KVT_OK : kvt__ctx_fail(seq->ctx, s, "layer %u: %s", layer, msg);
}
