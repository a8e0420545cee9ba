/* seq_fork.c — prefix sharing: kvt_seq_fork and kvt_seq_attach (a new request reading its
 * source's pages, with reference counts) and the copy on write that makes a shared page a
 * request's own before a step writes into it (kvt__seq_reserve, seq_step.c). */
#include "lib/seq_internal.h"

#include "kernels/philox.h"
#include "recall/kernels/recall_scan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Copy on write: every live page of group g's table that holds a row at or past from_row and
 * that another table shares becomes this request's own — a page taken from the pool, the page's
 * rows copied into it on the backend for every layer and plane of the group. Each page copied is
 * a valid state on its own; KVT_ERR_POOL_EXHAUSTED (or a backend error) leaves the rest shared. */
kvt_status kvt__seq_own_pages(kvt_seq *seq, uint32_t g, uint64_t from_row) {
    kvt_ctx *ctx = seq->ctx;
    kvt__ptable *t = &seq->pt[g];
    kvt__pool *pool = &ctx->groups[g].pool;
    const kvt__group *gr = &ctx->groups[g];
    const uint32_t PR = ctx->page_rows;
    uint32_t n_copies = 0;
    for (uint32_t k = 0; k < t->n_pages; k++)
        n_copies += (t->first_page + k + 1) * PR > from_row && pool->refs[t->pages[k]] > 1;
    if (n_copies == 0)
        return KVT_OK;
    void *log = seq->cow;
    if (kvt__grow(&ctx->alloc, &log, &seq->cow_cap, (uint64_t)seq->n_cow + n_copies,
                  sizeof *seq->cow) != KVT_OK)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "request %llu: copy-on-write log",
                             (unsigned long long)seq->request_id);
    seq->cow = log;
    for (uint32_t k = 0; k < t->n_pages; k++) {
        uint32_t old = (uint32_t)t->pages[k];
        if ((t->first_page + k + 1) * PR <= from_row || pool->refs[old] <= 1)
            continue;
        if (pool->n_free == 0)
            return kvt__ctx_fail(ctx, KVT_ERR_POOL_EXHAUSTED,
                                 "request %llu: group %u has no free page to copy a shared page "
                                 "into (copy on write)",
                                 (unsigned long long)seq->request_id, g);
        uint32_t nw = pool->free_ids[pool->n_free - 1];
        for (uint32_t i = 0; i < gr->n_layers; i++) {
            const kvt__store *st = &ctx->stores[gr->layers[i]];
            const size_t bytes = (size_t)PR * st->slot_bytes;
            for (uint32_t p = 0; p < st->spec.n_planes; p++) {
                kvt_status s = ctx->backend.ops->copy(&ctx->backend, st->plane[p] + nw * bytes,
                                                      st->plane[p] + old * bytes, bytes, NULL);
                if (s != KVT_OK)
                    return kvt__ctx_fail(ctx, s, "copying a shared page of layer %u",
                                         gr->layers[i]);
            }
        }
        pool->n_free--;
        pool->refs[nw] = 1;
        kvt__pool_put(pool, old);
        t->pages[k] = (int32_t)nw;
        if (t->dsynced > k)
            t->dsynced = k; /* the mirror rewrites from here */
        seq->cow[seq->n_cow++] = (struct kvt__cow){.g = g, .k = k, .old = old};
    }
    return KVT_OK;
}

/* Undo group g's copies on write of the reservation being made, newest first: the table holds
 * the shared page again and the copy goes back on top of the free stack, where it was taken
 * from. Valid only within the reserve that made them (the page left is still held by the
 * other tables, nothing ran). */
void kvt__seq_cow_undo(kvt_seq *seq, uint32_t g) {
    kvt__pool *pool = &seq->ctx->groups[g].pool;
    kvt__ptable *t = &seq->pt[g];
    while (seq->n_cow && seq->cow[seq->n_cow - 1].g == g) {
        const struct kvt__cow *c = &seq->cow[--seq->n_cow];
        KVT_ASSERT(pool->refs[c->old] > 0 && c->k < t->n_pages);
        uint32_t copy = (uint32_t)t->pages[c->k];
        kvt__pool_share(pool, c->old);
        t->pages[c->k] = (int32_t)c->old;
        kvt__pool_put(pool, copy);
        if (t->dsynced > c->k)
            t->dsynced = c->k;
    }
}

/* The first row a step growing group g's table to rows_after may write: the new rows, or
 * earlier ones a policy moves (policy.h writes_from). */
uint64_t kvt__seq_group_writes_from(const kvt_seq *seq, uint32_t g, uint64_t rows_after) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__group *gr = &ctx->groups[g];
    uint64_t from = seq->pt[g].n_rows;
    for (uint32_t k = 0; gr->ops->writes_from && k < gr->n_layers; k++) {
        uint64_t f = gr->ops->writes_from(kvt__seq_state(seq, gr->layers[k]), &seq->cfg,
                                          seq->pt[g].n_rows, rows_after, seq->prompt_rows);
        from = f < from ? f : from;
    }
    return from;
}

/* Group g's table of c becomes a reader of src's live pages [k0, k0 + n_pages), which hold row
 * indices from first_page * page_rows; c then holds n_rows rows. Shared pages: read-only until
 * own_pages copies them. */
static kvt_status share_pages(kvt_seq *c, uint32_t g, const kvt__ptable *src, uint64_t k0,
                              uint32_t n_pages, uint64_t first_page, uint64_t n_rows) {
    kvt_ctx *ctx = c->ctx;
    kvt__ptable *t = &c->pt[g];
    void *arr = t->pages;
    kvt_status s = kvt__grow(&ctx->alloc, &arr, &t->cap, n_pages, sizeof *t->pages);
    t->pages = arr;
    if (s == KVT_OK)
        s = kvt__ptable_mirror_reserve(t, &ctx->backend, n_pages);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "page table of the new request");
    for (uint32_t k = 0; k < n_pages; k++) {
        t->pages[k] = src->pages[k0 + k];
        kvt__pool_share(&ctx->groups[g].pool, (uint32_t)t->pages[k]);
    }
    t->n_pages = n_pages;
    t->n_rows = n_rows;
    t->first_page = first_page;
    t->dropped_rows = first_page * ctx->page_rows;
    t->dsynced = 0;
    return KVT_OK;
}

/* A new request of src's context, its parameters src's (request id aside). */
static kvt_status seq_like(kvt_seq *src, uint64_t request_id, uint64_t prompt_rows,
                           kvt_seq **out) {
    kvt_seq_params p = kvt_seq_default_params();
    p.request_id = request_id;
    p.prompt_rows = prompt_rows;
    p.ratio = src->cfg.ratio;
    p.recall = (int32_t)src->cfg.recall;
    kvt_status s = kvt_seq_create(src->ctx, &p, out);
    if (s == KVT_OK)
        (*out)->cfg = src->cfg;
    return s;
}

/* The policies' states of c from src's (fork: all of it; attach: its first `rows` rows); on
 * failure c is destroyed and the failure named. */
static kvt_status states_from(kvt_seq *c, kvt_seq *src, uint64_t rows, bool attach,
                              kvt_status s) {
    kvt_ctx *ctx = c->ctx;
    kvt__env env = kvt__ctx_env(ctx, c, NULL);
    for (uint32_t i = 0; i < ctx->n_layers && s == KVT_OK; i++) {
        const kvt__store *st = &ctx->stores[i];
        const kvt__policy_ops *ops = st->group >= 0 ? kvt__seq_ops_of(ctx, i) : NULL;
        if (ops && attach && ops->layer_attach)
            s = ops->layer_attach(kvt__seq_state(c, i), kvt__seq_state(src, i), &env, st, rows,
                                  src->prompt_rows);
        else if (ops && !attach && ops->layer_fork)
            s = ops->layer_fork(kvt__seq_state(c, i), kvt__seq_state(src, i), &env, st,
                                src->pt[st->group].n_rows);
        /* A fork continues its parent's calibration; an attached request calibrates anew. */
        if (s == KVT_OK && !attach && kvt__seq_recalls(c, i) && kvt__seq_recalls(src, i) &&
            (s = kvt__recall_layer_copy(&c->recall[i], &src->recall[i], &ctx->backend)) != KVT_OK)
            kvt__fail(env.err, env.err_len, s, "the recall state of layer %u", i);
        if (s == KVT_OK && !attach && kvt__seq_recalls_rope(c, i) &&
            kvt__seq_recalls_rope(src, i) &&
            (s = kvt__recall_rope_copy(&c->rrope[i], &src->rrope[i], &ctx->backend)) != KVT_OK)
            kvt__fail(env.err, env.err_len, s, "the recall state of RoPE layer %u", i);
    }
    if (s == KVT_OK)
        return KVT_OK;
    char tmp[KVT__ERR_LEN];
    memcpy(tmp, kvt__tls_error(), sizeof tmp);
    kvt__seq_end(c); /* in no batch yet; its shared pages back to their other holders */
    return kvt__ctx_fail(ctx, s, "%s request %llu: %s; nothing was created",
                         attach ? "attaching to" : "forking", (unsigned long long)src->request_id,
                         tmp);
}

/* Fork and attach need src between steps. */
static kvt_status source_ready(kvt_seq *src, kvt_seq **out) {
    if (!out)
        return kvt__ctx_fail(src->ctx, KVT_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (src->n_pending || src->batch)
        return kvt__ctx_fail(src->ctx, KVT_ERR_BAD_STATE,
                             "request %llu has a step in flight: share it between steps",
                             (unsigned long long)src->request_id);
    return KVT_OK;
}

kvt_status kvt_seq_fork(kvt_seq *seq, uint64_t request_id, kvt_seq **out) {
    if (out)
        *out = NULL;
    CHECK_LIVE_SEQ(seq);
    kvt_ctx *ctx = seq->ctx;
    kvt_seq *c;
    kvt_status s = source_ready(seq, out);
    if (s == KVT_OK)
        s = seq_like(seq, request_id, seq->prompt_rows, &c);
    if (s != KVT_OK)
        return s;
    /* The tables: every live page shared, counts as the parent's. */
    for (uint32_t g = 0; g < ctx->n_groups && s == KVT_OK; g++) {
        const kvt__ptable *src = &seq->pt[g];
        s = share_pages(c, g, src, 0, src->n_pages, src->first_page, src->n_rows);
    }
    if ((s = states_from(c, seq, 0, false, s)) != KVT_OK)
        return s;
    c->n_tokens = seq->n_tokens;
    *out = c;
    return KVT_OK;
}

kvt_status kvt_seq_attach(kvt_seq *src, uint64_t prefix_rows, uint64_t request_id,
                          kvt_seq **out) {
    if (out)
        *out = NULL;
    CHECK_LIVE_SEQ(src);
    kvt_ctx *ctx = src->ctx;
    const uint64_t P = prefix_rows, PR = ctx->page_rows;
    kvt_status s = source_ready(src, out);
    if (s != KVT_OK)
        return s;
    if (P % PR != 0 || P > src->n_tokens)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "prefix_rows %llu: a multiple of page_rows (%llu) up to the "
                             "request's %llu committed rows",
                             (unsigned long long)P, (unsigned long long)PR,
                             (unsigned long long)src->n_tokens);
    /* Each group: the pages an unshared request of P rows would hold (a sliding group has
     * returned those before its widest window), all of them still src's. */
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        const kvt__group *gr = &ctx->groups[g];
        const kvt__ptable *t = &src->pt[g];
        uint64_t W = gr->window_rows;
        uint64_t first = W && P > W ? (P - W) / PR : 0;
        if (t->first_page > first)
            return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                 "group %u: request %llu returned rows before %llu, which a "
                                 "request of %llu rows still holds",
                                 g, (unsigned long long)src->request_id,
                                 (unsigned long long)(t->first_page * PR),
                                 (unsigned long long)P);
        /* Asked before any page is shared: a round may have moved the rows (and compacted the
         * table below the prefix's pages). */
        for (uint32_t k = 0; gr->ops->attach_rows && k < gr->n_layers; k++) {
            uint64_t n = gr->ops->attach_rows(kvt__seq_state(src, gr->layers[k]), &src->cfg,
                                              src->prompt_rows);
            if (P > n)
                return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                     "layer %u: request %llu's rows past its first %llu have "
                                     "moved (its policy's rounds keep only those in place); "
                                     "attach at most that prefix (asked %llu)",
                                     gr->layers[k], (unsigned long long)src->request_id,
                                     (unsigned long long)n, (unsigned long long)P);
        }
        if (t->first_page + t->n_pages < P / PR)
            return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                 "group %u: request %llu's table holds pages up to %llu, short "
                                 "of the %llu a prefix of %llu rows spans",
                                 g, (unsigned long long)src->request_id,
                                 (unsigned long long)(t->first_page + t->n_pages),
                                 (unsigned long long)(P / PR), (unsigned long long)P);
    }
    kvt_seq *c;
    if ((s = seq_like(src, request_id, src->prompt_rows < P ? src->prompt_rows : P, &c)) !=
        KVT_OK)
        return s;
    for (uint32_t g = 0; g < ctx->n_groups && s == KVT_OK; g++) {
        uint64_t W = ctx->groups[g].window_rows;
        uint64_t first = W && P > W ? (P - W) / PR : 0;
        s = share_pages(c, g, &src->pt[g], first - src->pt[g].first_page,
                        (uint32_t)(P / PR - first), first, P);
    }
    if ((s = states_from(c, src, P, true, s)) != KVT_OK)
        return s;
    c->n_tokens = P;
    *out = c;
    return KVT_OK;
}
