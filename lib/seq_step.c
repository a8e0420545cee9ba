/* seq_step.c — a request's step: reserve (pages, copy on write, the policies' reserve), the
 * reserved slots and kvt_seq_write, commit (the policies' group_commit and the accounting
 * check), and what a batch's run asks of each request: the layer's step work, the attended set
 * of a query, the recall items, the block table. */
#include "lib/seq_internal.h"

#include "kernels/philox.h"
#include "recall/kernels/recall_scan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvt__seq_unreserve(kvt_seq *seq) {
    kvt_ctx *ctx = seq->ctx;
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        seq->pt[g].n_pending = 0;
        kvt__ptable_trim(&seq->pt[g], &ctx->groups[g].pool);
    }
    seq->n_pending = 0;
}

/* Groups last to first, each its copies then its new pages: the reverse of kvt__seq_reserve's
 * order, so each page returns to the free stack where it was taken from. */
void kvt__seq_unreserve_cow(kvt_seq *seq) {
    kvt_ctx *ctx = seq->ctx;
    for (uint32_t g = ctx->n_groups; g-- > 0;) {
        kvt__seq_cow_undo(seq, g);
        seq->pt[g].n_pending = 0;
        kvt__ptable_trim(&seq->pt[g], &ctx->groups[g].pool);
    }
    KVT_ASSERT(seq->n_cow == 0);
    seq->n_cow = 0;
    seq->n_pending = 0;
}

kvt_status kvt__seq_reserve(kvt_seq *seq, uint32_t n_tokens) {
    CHECK_LIVE_SEQ(seq);
    kvt_ctx *ctx = seq->ctx;
    if (n_tokens == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "n_tokens is 0");
    if (seq->n_pending != 0)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "%u reserved tokens are not committed yet", seq->n_pending);
    if (ctx->max_rows && seq->n_tokens + n_tokens > ctx->max_rows)
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                             "request %llu: %llu + %u tokens exceed max_rows_per_seq %u; nothing "
                             "was reserved",
                             (unsigned long long)seq->request_id,
                             (unsigned long long)seq->n_tokens, n_tokens, ctx->max_rows);
    for (uint32_t i = 0; i < ctx->n_layers; i++)
        for (uint32_t p = 0; ctx->stores[i].group >= 0 && p < ctx->stores[i].spec.n_planes; p++)
            if (!ctx->stores[i].plane[p])
                return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                                     "layer %u plane %u: external storage not bound "
                                     "(kvt_layer_bind)",
                                     i, p);
    const kvt__alloc *a = &ctx->alloc;
    uint32_t g;
    kvt_status s = KVT_OK;
    seq->n_cow = 0;
    /* config.evict_ratio_budget: the step's K from the request's length after it (every call
     * of the step, reserve to commit, reads it from the request's config); put back on failure */
    const uint32_t K_before = seq->cfg.evict_budget_rows;
    if (seq->cfg.evict_ratio_budget)
        seq->cfg.evict_budget_rows =
            kvt__ev_ratio_budget(&seq->cfg, seq->n_tokens + n_tokens, seq->prompt_rows);
    for (g = 0; g < ctx->n_groups; g++) {
        s = kvt__ptable_reserve(&seq->pt[g], &ctx->groups[g].pool, a, n_tokens);
        /* Copy on write: pages the step will write that a fork shares become this request's. */
        if (s == KVT_OK && ctx->groups[g].pool.shared)
            s = kvt__seq_own_pages(
                seq, g, kvt__seq_group_writes_from(seq, g, seq->pt[g].n_rows + n_tokens));
        if (s == KVT_OK)
            s = kvt__ptable_mirror_reserve(&seq->pt[g], &ctx->backend, seq->pt[g].n_pages);
        if (s != KVT_OK)
            break;
    }
    /* Policy bookkeeping (eviction positions) grows here too, so that commit cannot fail for
     * memory. */
    kvt__env env = kvt__ctx_env(ctx, seq, NULL);
    char why[KVT__ERR_LEN] = "";
    env.err = why;
    env.err_len = sizeof why;
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++) {
        if (ctx->stores[i].group < 0 || !kvt__seq_ops_of(ctx, i)->reserve)
            continue;
        const kvt__ptable *t = &seq->pt[ctx->stores[i].group];
        s = kvt__seq_ops_of(ctx, i)->reserve(kvt__seq_state(seq, i), &env, &ctx->stores[i],
                                             t->n_rows + n_tokens);
    }
    /* The recall trigger's group planes for the blocks the step can close (a step's run builds
     * them, and a run allocates nothing). */
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++) {
        void *r;
        const kvt__recall_ops *ro = kvt__seq_recall_of(seq, i, &r);
        if (ro && (s = kvt__seq_recall_groups_reserve(seq, i, ro, r,
                                                      seq->n_tokens + n_tokens)) != KVT_OK)
            snprintf(why, sizeof why, "layer %u: the %s scan's group planes", i, ro->name);
    }
    /* RoPE recall: the fetch area holds the whole archive after the step (a dense step lists
     * it): held + archived rows are at most the request's rows; with a host archive no step is
     * dense and it holds at most recall_cap_rows rows. Its size is set only once the whole
     * reservation succeeded (a failure trims it back to what it held). */
    uint32_t f_grown[KVT__MAX_GROUPS] = {0};
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++) {
        if (!kvt__seq_recall_fetches(seq, i))
            continue;
        const uint32_t fg = (uint32_t)ctx->stores[i].group;
        kvt__ptable *f = &seq->fetch[fg]; /* its n_pending: the rows it holds (n_rows 0) */
        uint64_t need = seq->n_tokens + n_tokens;
        if (ctx->archive_host && need > seq->cfg.recall_cap_rows)
            need = seq->cfg.recall_cap_rows;
        if (need > UINT32_MAX)
            s = KVT_ERR_CAPACITY;
        else if (need > f->n_pending &&
                 (s = kvt__ptable_reserve(f, &ctx->groups[fg].pool, a,
                                          (uint32_t)(need - f->n_pending))) == KVT_OK &&
                 (s = kvt__ptable_mirror_reserve(f, &ctx->backend, f->n_pages)) == KVT_OK)
            f_grown[fg] = (uint32_t)need;
        if (s != KVT_OK)
            snprintf(why, sizeof why, "layer %u: the recall fetch area (%llu rows of group %u)",
                     i, (unsigned long long)need, fg);
    }
    if (s != KVT_OK) {
        seq->cfg.evict_budget_rows = K_before;
        for (uint32_t h = 0; h < ctx->n_groups; h++) /* all or nothing: fetch areas as they were */
            kvt__ptable_trim(&seq->fetch[h], &ctx->groups[h].pool);
        for (uint32_t h = g < ctx->n_groups ? g + 1 : ctx->n_groups; h-- > 0;) {
            kvt__seq_cow_undo(seq, h); /* copies on write given back: the request as it was */
            kvt__ptable_trim(&seq->pt[h], &ctx->groups[h].pool);
        }
        if (s == KVT_ERR_POOL_EXHAUSTED)
            return kvt__ctx_fail(ctx, s,
                                 "request %llu reserving %u tokens: group %u (%s) has %u free "
                                 "pages of %u; nothing was reserved",
                                 (unsigned long long)seq->request_id, n_tokens, g, kvt_policy_name(ctx->groups[g < ctx->n_groups ? g : 0].policy),
                                 ctx->groups[g < ctx->n_groups ? g : 0].pool.n_free, ctx->n_pages);
        return kvt__ctx_fail(ctx, s, "request %llu reserving %u tokens%s%s; nothing was reserved",
                             (unsigned long long)seq->request_id, n_tokens, why[0] ? ": " : "",
                             why);
    }
    for (g = 0; g < ctx->n_groups; g++) {
        seq->pt[g].n_pending = n_tokens;
        if (f_grown[g])
            seq->fetch[g].n_pending = f_grown[g];
    }
    seq->n_pending = n_tokens;
    ctx->started = true;
    return KVT_OK;
}

kvt_status kvt_seq_reserved_slot(const kvt_seq *seq, uint32_t layer, uint32_t i, int32_t *slot) {
    CHECK_SEQ(seq);
    if (!slot)
        return KVT_ERR_INVALID_ARGUMENT;
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    if (i >= seq->n_pending)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_OUT_OF_RANGE, "reserved token %u of %u", i,
                             seq->n_pending);
    const kvt__ptable *t = &seq->pt[st->group];
    *slot = kvt__slot(t, &seq->ctx->pdiv, t->n_rows + i);
    return KVT_OK;
}

kvt_status kvt_seq_write(kvt_seq *seq, uint32_t layer, uint32_t plane, uint32_t first, uint32_t n,
                         const void *src, size_t src_bytes) {
    CHECK_SEQ(seq);
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    const kvt_ctx *ctx = seq->ctx;
    if (plane >= st->spec.n_planes)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "plane %u of %u", plane,
                             st->spec.n_planes);
    if (!src)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "src is NULL");
    if ((uint64_t)first + n > seq->n_pending || n == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE,
                             "rows [%u, %llu) outside the %u reserved tokens", first,
                             (unsigned long long)first + n, seq->n_pending);
    if (src_bytes != (size_t)n * st->slot_bytes)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "src_bytes %zu != %u rows x %zu bytes", src_bytes, n, st->slot_bytes);
    if (seq->stepped[layer])
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "layer %u already ran for this step: its rows may have moved; write "
                             "a layer's rows before kvt_batch_run",
                             layer);
    const kvt__ptable *t = &seq->pt[st->group];
    const uint8_t *in = src;
    for (uint32_t i = 0; i < n; i++) {
        int32_t slot = kvt__slot(t, &ctx->pdiv, t->n_rows + first + i);
        /* Through the backend: the pool lives in its memory space. */
        kvt_status ws = ctx->backend.ops->write(&ctx->backend,
                                                st->plane[plane] + (size_t)slot * st->slot_bytes,
                                                in + (size_t)i * st->slot_bytes, st->slot_bytes,
                                                NULL);
        if (ws != KVT_OK)
            return kvt__ctx_fail(ctx, ws, "writing row %u of layer %u", first + i, layer);
    }
    return KVT_OK;
}

/* Run every group's policy after `new_rows` rows were committed (0: a retry). Each policy is
 * incremental from its own state, so a failed run (host memory) is completed by the next commit;
 * a failure in one group does not stop the others. */
static kvt_status run_policies(kvt_seq *seq, uint64_t new_rows, const kvt__backend *be,
                               void *stream) {
    kvt_ctx *ctx = seq->ctx;
    kvt__env env = kvt__ctx_env(ctx, seq, stream);
    env.backend = be;
    kvt_status first_err = KVT_OK;
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        kvt__group *gr = &ctx->groups[g];
        if (!gr->ops->group_commit)
            continue;
        kvt__tier_group tg = {.gr = gr,
                              .pt = &seq->pt[g],
                              .stores = ctx->stores,
                              .states = seq->layers,
                              .appended = seq->n_tokens,
                              .new_rows = new_rows,
                              .prompt_rows = seq->prompt_rows};
        kvt_status s = gr->ops->group_commit(&env, &tg);
        if (s != KVT_OK && first_err == KVT_OK)
            first_err = s;
    }
    return first_err;
}

/* Run a layer's check entry: the full check (kvt_seq_check), else the per-commit counts. The
 * entry writes its message into the calling thread's error buffer; the layer is prefixed to it. KVT_OK
 * when the table has no such entry. */
kvt_status kvt__seq_check_layer(const kvt_seq *seq, uint32_t layer, bool full) {
    const kvt_ctx *ctx = seq->ctx;
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    kvt_status (*check)(const kvt__tier_layer *, char *, size_t) =
        full ? l.gr->ops->check : l.gr->ops->check_counts;
    kvt_status s = check ? check(&l, kvt__tls_error(), KVT__ERR_LEN) : KVT_OK;
    if (s == KVT_OK)
        return KVT_OK;
    char tmp[KVT__ERR_LEN];
    memcpy(tmp, kvt__tls_error(), sizeof tmp);
    return kvt__ctx_fail(ctx, s, "layer %u: %s", layer, tmp);
}

/* O(layers x heads) accounting after every commit: every appended (position, KV head) row is
 * attended, archived or dropped — counted by independently maintained counters. The full
 * membership and bytes check is kvt_seq_check (O(rows)). */
static kvt_status check_counters(const kvt_seq *seq) {
    const kvt_ctx *ctx = seq->ctx;
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        if (st->group < 0)
            continue;
        const kvt__ptable *t = &seq->pt[st->group];
        /* Only a group with a window returns leading pages, and never one its widest window
         * reads. */
        uint32_t W = ctx->groups[st->group].window_rows;
        bool bad_front = W == 0 ? t->first_page != 0 || t->dropped_rows != 0
                                : t->first_page != 0 &&
                                      kvt__ptable_first_row(t, ctx->page_rows) + W > t->n_rows;
        if (bad_front)
            return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                 "layer %u: %llu leading pages returned with %llu rows held and "
                                 "a window of %u rows",
                                 i, (unsigned long long)t->first_page,
                                 (unsigned long long)t->n_rows, W);
        kvt_status s = kvt__seq_check_layer(seq, i, false);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}

kvt_status kvt__seq_commit(kvt_seq *seq, uint32_t n_tokens, const kvt__backend *be,
                           void *stream) {
    CHECK_LIVE_SEQ(seq);
    kvt_ctx *ctx = seq->ctx;
    if (n_tokens > seq->n_pending)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "committing %u tokens, %u reserved", n_tokens, seq->n_pending);
    /* Rejected drafts: their rows were never committed and no policy work of this step read them
     * (kvt__seq_step deferred it), so they go like an unreserved tail; their pages return. */
    for (uint32_t g = 0; n_tokens < seq->n_pending && g < ctx->n_groups; g++) {
        seq->pt[g].n_pending = n_tokens;
        kvt__ptable_trim(&seq->pt[g], &ctx->groups[g].pool);
    }
    seq->n_pending = n_tokens;
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        seq->pt[g].n_rows += n_tokens;
        seq->pt[g].n_pending = 0;
    }
    seq->n_tokens += n_tokens;
    seq->n_pending = 0;
    /* The policies' ops read the tables' mirrors: bring them up to date on the stream. */
    kvt_status s = KVT_OK;
    for (uint32_t g = 0; g < ctx->n_groups && s == KVT_OK; g++)
        s = kvt__ptable_mirror_sync(&seq->pt[g], be, stream);
    if (s != KVT_OK)
        s = kvt__ctx_fail(ctx, s, "request %llu: page table to the backend",
                          (unsigned long long)seq->request_id);
    else
        s = run_policies(seq, n_tokens, be, stream);
    seq->in_step = false;
    memset(seq->stepped, 0, 2u * ctx->n_layers);
    kvt_status c = check_counters(seq);
    return c != KVT_OK ? c : s;
}

/* ------------------------------------------------------------------------------------------- */
/* Attended set                                                                                */
/* ------------------------------------------------------------------------------------------- */

/* The layer as its table's entries see it during a step: the group's table with this step's
 * rows counted, as many as the layer holds (a layer that compacted in its run holds fewer until
 * commit). *view is the storage for that table view. */
static kvt__tier_layer step_layer(const kvt_seq *seq, uint32_t layer, uint32_t visible,
                                   kvt__ptable *view) {
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    *view = *l.pt;
    uint64_t rows = l.pt->n_rows + l.pt->n_pending;
    view->n_rows = l.gr->ops->held_rows ? l.gr->ops->held_rows(l.state, rows) : rows;
    /* A query token that sees only the first `visible` rows of the step: the step's last rows
     * leave the view (valid because no work of this step moved them: kvt__seq_step). */
    if (visible < l.pt->n_pending)
        view->n_rows -= l.pt->n_pending - visible;
    view->n_pending = 0;
    l.pt = view;
    return l;
}

/* The layer's step work of one request, as its policy's layer_step takes it. */
static kvt__tier_step tier_step_of(kvt_ctx *ctx, kvt_seq *seq, uint32_t layer) {
    const kvt__store *st = &ctx->stores[layer];
    return (kvt__tier_step){.gr = &ctx->groups[st->group],
                            .st = &ctx->stores[layer],
                            .pt = &seq->pt[st->group],
                            .state = kvt__seq_state(seq, layer),
                            .appended = seq->n_tokens,
                            .step_rows = seq->n_pending,
                            .prompt_rows = seq->prompt_rows,
                            .cfg = &seq->cfg,
                            .philox_key = seq->philox_key};
}

kvt_status kvt__seq_mirror_sync(kvt_seq *seq, uint32_t layer, const kvt__backend *be,
                                void *stream) {
    /* The layer's ops and its emission read the table's mirror (the step's pages too), and a
     * RoPE recall's emission its fetch area's. */
    const int32_t g = seq->ctx->stores[layer].group;
    kvt_status s = kvt__ptable_mirror_sync(&seq->pt[g], be, stream);
    if (s == KVT_OK && kvt__seq_recall_fetches(seq, layer))
        s = kvt__ptable_mirror_sync(&seq->fetch[g], be, stream);
    return s;
}

bool kvt__seq_step_quiet(kvt_seq *seq, uint32_t layer, bool recall_planned) {
    kvt_ctx *ctx = seq->ctx;
    void *r;
    if (kvt__seq_recall_of(seq, layer, &r) && (!recall_planned || seq->n_pending > 1))
        return false;
    const kvt__policy_ops *ops = kvt__seq_ops_of(ctx, layer);
    if (!ops->layer_step || seq->n_pending == 0)
        return true;
    if (!ops->step_due)
        return false;
    const kvt__tier_step t = tier_step_of(ctx, seq, layer);
    return !ops->step_due(&t);
}

kvt_status kvt__seqs_step(kvt_ctx *ctx, kvt_seq *const *seqs, const uint8_t *defer, uint32_t n,
                          uint32_t layer, const kvt__backend *be, void *stream,
                          kvt__tier_step *t, kvt_seq **who) {
    const kvt__policy_ops *ops = kvt__seq_ops_of(ctx, layer);
    kvt_status first = KVT_OK;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvt_seq *seq = seqs[i];
        if (!seq || seq->stepped[layer])
            continue;
        kvt_status s = kvt__seq_mirror_sync(seq, layer, be, stream);
        if (s != KVT_OK) {
            if (first == KVT_OK)
                first = kvt__ctx_fail(ctx, s, "request %llu layer %u: page table to the backend",
                                      (unsigned long long)seq->request_id, layer);
            continue;
        }
        if (defer[i]) {
            seq->stepped[layer] = KVT__STEP_DEFERRED;
            continue;
        }
        if (!ops->layer_step || seq->n_pending == 0) {
            seq->stepped[layer] = KVT__STEP_NOTHING;
            continue;
        }
        t[k] = tier_step_of(ctx, seq, layer);
        who[k++] = seq;
    }
    if (k == 0)
        return first;
    /* Every request's work in one policy call: batched backend ops. */
    kvt__env env = kvt__ctx_env(ctx, NULL, stream);
    env.backend = be;
    ops->layer_step(&env, t, k);
    for (uint32_t j = 0; j < k; j++) {
        if (t[j].status == KVT_OK) {
            who[j]->stepped[layer] = KVT__STEP_WORKED;
        } else if (first == KVT_OK) {
            char tmp[KVT__ERR_LEN];
            memcpy(tmp, kvt__tls_error(), sizeof tmp);
            first = kvt__ctx_fail(ctx, t[j].status, "request %llu layer %u: %s",
                                  (unsigned long long)who[j]->request_id, layer, tmp);
        }
    }
    return first;
}

void kvt__seq_step_query(const kvt_seq *seq, uint32_t layer, uint32_t visible,
                         kvt__pack_query *q) {
    kvt__ptable view;
    kvt__tier_layer l = step_layer(seq, layer, visible, &view);
    memset(q, 0, sizeof *q);
    l.gr->ops->attended(&l, &q->d);
    q->pages = view.dpages; /* the mirror: kvt__seq_step synced it */
    q->first_page = view.first_page;
}

kvt__tier_layer kvt__seq_step_layer(const kvt_seq *seq, uint32_t layer, kvt__ptable *view) {
    return step_layer(seq, layer, seq->n_pending, view);
}

kvt_status kvt__seq_rope_recall_view(kvt_seq *seq, uint32_t layer, kvt__rope_view *out) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    kvt_ctx *ctx = seq->ctx;
    if (!kvt__seq_ops_of(ctx, layer)->recall_rope_view)
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH,
                             "layer %u: its policy has no archive a RoPE recall reads", layer);
    if ((s = kvt__ptable_mirror_sync(&seq->pt[st->group], &ctx->backend, NULL)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "layer %u: page table to the backend", layer);
    kvt__tier_layer l = kvt__seq_tier_layer(seq, layer);
    char *err = kvt__tls_error();
    return kvt__recall_rope_view_of(&l, out, err, KVT__ERR_LEN);
}

kvt_status kvt_seq_first_row(const kvt_seq *seq, uint32_t layer, uint64_t *first_row) {
    CHECK_BETWEEN_STEPS(seq);
    if (!first_row)
        return KVT_ERR_INVALID_ARGUMENT;
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    *first_row = kvt__ptable_first_row(&seq->pt[st->group], seq->ctx->page_rows);
    return KVT_OK;
}

kvt_status kvt_seq_block_table(const kvt_seq *seq, uint32_t layer, int32_t *pages,
                               uint32_t capacity, uint32_t *n_pages, uint64_t *n_rows) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = kvt__seq_layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    const kvt__ptable *t = &seq->pt[st->group];
    uint32_t used = (uint32_t)kvt__ptable_pages_for(t, t->n_rows + t->n_pending,
                                                    seq->ctx->page_rows);
    if (n_pages)
        *n_pages = used;
    if (n_rows)
        *n_rows = t->n_rows;
    if (!pages)
        return KVT_OK; /* size query */
    if (used > capacity)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_CAPACITY, "block table has %u pages, capacity %u",
                             used, capacity);
    if (used)
        memcpy(pages, t->pages, sizeof *pages * used);
    return KVT_OK;
}
