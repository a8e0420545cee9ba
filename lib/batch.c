/* batch.c — one step of many requests: reserve (all or nothing, vLLM's slot_mapping), plan,
 * run per layer (the layer's due close or round, then the attended set into the caller's
 * fixed-capacity buffers), commit. The timeline is stated in kvtier.h; the per-request work is
 * seq_step.c's, the policy work tiers/' (through the policy tables). */
#include "handles.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

enum batch_state { BATCH_IDLE = 0, BATCH_RESERVED, BATCH_PLANNED };

struct kvt_batch {
    kvt_ctx *ctx;
    kvt_batch *prev, *next; /* the context's live batches */
    uint32_t max_seqs, n_seqs;
    kvt_seq **seqs;      /* [max_seqs]; an entry is NULL once its request was destroyed */
    uint32_t *n_tokens;  /* [max_seqs]; 0 once the request was destroyed */
    uint32_t *n_slots;   /* [max_seqs]: the tokens reserved, kept when the request is destroyed
                          * mid-step, so that the step's slot_mapping keeps every later token's
                          * index (its own entries -1) */
    uint32_t *n_drafts;  /* [max_seqs]: the last n_drafts tokens may be rejected at commit */
    /* A run's scratch (allocated with the batch: a run allocates nothing): each request's
     * defer flag and the policy work handed to the layer's table in one call. */
    uint8_t *defer;          /* [max_seqs] */
    kvt__tier_step *steps;   /* [max_seqs] */
    kvt_seq **step_seqs;     /* [max_seqs] */
    /* Recall: each request's way on the layer being run (RECALL_*), the dense flags the host
     * writes, and the trigger's work items. */
    uint8_t *recall_way;     /* [max_seqs] */
    uint8_t *dense;          /* [max_seqs] */
    kvt__recall_step_args *rsteps; /* [max_seqs] */
    /* The RoPE trigger's work items and emissions of a layer, one backend call each for the
     * batch (allocated where a layer may recall on RoPE: kvt__ctx_rope_bound). */
    kvt__recall_rope_args *rrsteps;      /* [max_seqs] or NULL */
    kvt__recall_rope_emit_args *remits;  /* [max_seqs] or NULL */
    enum batch_state state;
    bool ran;            /* a run happened this step (the reservation can no longer be undone) */
    void *stream;        /* the stream of the step's last run: the commit's device work goes on
                          * it (NULL, the default stream, for a step without a run) */
    /* The backend the batch's runs and commit use: on the CPU and CUDA backends a handle with a
     * workspace of its own (own_be), so that runs and commits of distinct batches share no
     * scratch (kvtier.h, "Threads"); on the guarded backend a copy of the context's handle. */
    kvt__backend be;
    bool own_be;
    /* The plan buffer (kvt_batch_plan_device): layer l's part from byte plan_at[l] on holds the
     * count of its pack queries (uint32) and of its recall items (uint32, at byte 4), then from
     * byte PLAN_HEAD on max_seqs pack queries and, on a layer that plans recall
     * (plans_recall), max_seqs recall items after them (plan_recall_at); on a layer that plans
     * RoPE recall (plans_rope) there max_seqs RoPE trigger items, then max_seqs emission items
     * (plan_rope_emits_at). In the backend's memory
     * (allocated at the first planned step, never moved: a captured run's launch points into
     * it), with its host image. planned: this step's runs pack from it, for plan_emit[layer]. */
    uint8_t *plan_dev, *plan_host;
    size_t *plan_at; /* [n_layers + 1]: plan_at[n_layers] is the buffer's size */
    uint8_t *plan_recall; /* [n_layers]: PLAN_NOPE / PLAN_ROPE / 0, fixed with the buffer's
                           * layout */
    kvt_emit *plan_emit; /* [n_layers] */
    uint32_t *plan_qpr;  /* [n_layers]: pack queries a request (CSR_KV_HEADS: the layer's KV
                          * heads, one list each; else 1), fixed with the layout */
    uint8_t *recall_ran; /* [n_layers]: a planned run of the layer enqueued its recall step */
    bool plan_reserved;  /* the planned recall ops' room was made (recall_plan_reserve) */
    bool planned;
    bool planned_once; /* a step was planned: plan_emit holds its emissions, every later one's */
};

/* Bytes before a layer's queries in the plan buffer (its counts, then alignment). */
#define PLAN_HEAD 64u

/* May requests of this context recall: its config does, or a request with recall on was
 * created? */
static bool ctx_may_recall(const kvt_ctx *ctx) {
    return ctx->cfg.recall != KVT_RECALL_OFF || ctx->recall_seen;
}

/* May requests recall on this layer: a salience layer with sketch planes, ctx_may_recall? */
static bool layer_may_recall(const kvt_ctx *ctx, uint32_t layer) {
    return ctx->sketch_rank && kvt__layer_policy(ctx, layer)->recall_view &&
           ctx_may_recall(ctx);
}

/* Does a planned step's run of this layer hold the layer's recall step (kvt_batch_plan_device)?
 * A layer where requests may recall, in a context that states max_rows_per_seq (the bound of the
 * op's launch and workspace), on a backend with the planned op; fixed when the batch's plan
 * buffer is laid out (its first planned step), so that a captured run has the op whether or not
 * the capture's step recalled; a layer that did not plan it then never does (a step where a
 * request recalls there is not plannable). */
enum { PLAN_NOPE = 1, PLAN_ROPE = 2 };

static bool plans_recall(const kvt_batch *b, uint32_t layer) {
    const kvt_ctx *ctx = b->ctx;
    if (b->plan_recall)
        return b->plan_recall[layer] == PLAN_NOPE;
    return layer_may_recall(ctx, layer) && ctx->max_rows && b->be.ops->recall_step_planned;
}

/* The same for a RoPE layer's trigger and emission (docs/recall.md §9.4): a layer where requests
 * may recall on RoPE (kvt__ctx_rope_bound), max_rows_per_seq stated, both planned ops present;
 * fixed with the buffer's layout. Its steps are plannable with KVT_EMIT_TOKENS (each request's
 * row at a fixed place); a step where a request recalls there with another layout is not. */
static bool plans_rope(const kvt_batch *b, uint32_t layer) {
    const kvt_ctx *ctx = b->ctx;
    if (b->plan_recall)
        return b->plan_recall[layer] == PLAN_ROPE;
    kvt__recall_rope_args bound;
    return ctx_may_recall(ctx) && ctx->max_rows && kvt__ctx_rope_bound(ctx, layer, &bound) &&
           b->be.ops->recall_rope_step_planned && b->be.ops->recall_rope_emit_planned;
}

/* Where layer l's recall items (NoPE or RoPE trigger items) start in the plan (after its
 * max_seqs queries). */
static size_t plan_recall_at(const kvt_batch *b, uint32_t l) {
    const size_t q = PLAN_HEAD + sizeof(kvt__pack_query) * b->max_seqs * b->plan_qpr[l];
    return b->plan_at[l] + (q + 63u) / 64u * 64u;
}

/* Where a RoPE layer's emission items start (after its max_seqs trigger items). */
static size_t plan_rope_emits_at(const kvt_batch *b, uint32_t l) {
    const size_t t = sizeof(kvt__recall_rope_plan_item) * b->max_seqs;
    return plan_recall_at(b, l) + (t + 63u) / 64u * 64u;
}

/* Floats of one request's queries on a layer (kvt_batch_run's query). */
static size_t query_floats(const kvt_ctx *ctx, uint32_t layer) {
    const kvt_layer_spec *sp = &ctx->stores[layer].spec;
    return (size_t)sp->n_q_heads * (sp->value_dim + sp->branch_dim);
}

static void plan_bound(const kvt_batch *b, uint32_t l, kvt__recall_step_args *out);

/* A device workspace of the batch's own sized once for its decode steps (kvt__ws_bounds, from
 * max_rows_per_seq): every salience recall layer's largest item, every RoPE recall layer's, the
 * largest decode round (K + r + c rows and up to 64 tokens of a step, its group's layers at
 * once). A longer prefill step may still grow it, outside any graph. */
static kvt_status reserve_workspace(kvt_batch *b) {
    const kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    if (!ctx->max_rows || !be->ops->reserve)
        return KVT_OK;
    kvt__ws_bounds w = {.max_items = b->max_seqs};
    kvt_status s = be->ops->reserve(be, &w); /* the pack's own */
    for (uint32_t l = 0; s == KVT_OK && l < ctx->n_layers; l++) {
        kvt__recall_rope_args rope;
        kvt__ws_bounds x = {.max_items = b->max_seqs};
        if (layer_may_recall(ctx, l))
            plan_bound(b, l, &x.recall);
        if (ctx_may_recall(ctx) && kvt__ctx_rope_bound(ctx, l, &rope))
            x.rope = &rope;
        const kvt__store *st = &ctx->stores[l];
        if (st->group >= 0 && ctx->groups[st->group].ops->step_bounds) /* random eviction's round */
            ctx->groups[st->group].ops->step_bounds(&ctx->groups[st->group], st, &ctx->cfg, &x);
        s = be->ops->reserve(be, &x);
    }
    return s;
}

kvt_status kvt_batch_create(kvt_ctx *ctx, uint32_t max_seqs, kvt_batch **out) {
    if (out)
        *out = NULL;
    if (!ctx || !out)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(ctx);
    if (max_seqs == 0 || max_seqs > (1u << 20))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "max_seqs: %u not in 1..2^20",
                             max_seqs);
    const kvt__alloc *a = &ctx->alloc;
    kvt_batch *b = kvt__calloc(a, sizeof *b);
    if (!b)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "batch");
    b->ctx = ctx;
    b->max_seqs = max_seqs;
    b->seqs = kvt__calloc(a, sizeof *b->seqs * max_seqs);
    b->n_tokens = kvt__calloc(a, sizeof *b->n_tokens * max_seqs);
    b->n_drafts = kvt__calloc(a, sizeof *b->n_drafts * max_seqs);
    b->n_slots = kvt__calloc(a, sizeof *b->n_slots * max_seqs);
    b->defer = kvt__calloc(a, max_seqs);
    b->steps = kvt__calloc(a, sizeof *b->steps * max_seqs);
    b->step_seqs = kvt__calloc(a, sizeof *b->step_seqs * max_seqs);
    b->recall_way = kvt__calloc(a, max_seqs);
    b->dense = kvt__calloc(a, max_seqs);
    b->rsteps = kvt__calloc(a, sizeof *b->rsteps * max_seqs);
    bool rope = false;
    for (uint32_t l = 0; l < ctx->n_layers && !rope; l++) {
        kvt__recall_rope_args bound;
        rope = kvt__ctx_rope_bound(ctx, l, &bound);
    }
    if (rope) {
        b->rrsteps = kvt__calloc(a, sizeof *b->rrsteps * max_seqs);
        b->remits = kvt__calloc(a, sizeof *b->remits * max_seqs);
    }
    b->recall_ran = kvt__calloc(a, ctx->n_layers);
    b->be = ctx->backend;
    kvt_status ws = ctx->backend.ops->workspace
                        ? ctx->backend.ops->workspace(&ctx->backend, ctx->ws_sigma_floats,
                                                      ctx->ws_topm_u32, &b->be)
                        : KVT_ERR_UNSUPPORTED;
    b->own_be = ws == KVT_OK;
    if (ws == KVT_ERR_UNSUPPORTED)
        b->be = ctx->backend; /* shared: one thread at a time on such a context */
    if (ws == KVT_OK && b->own_be && reserve_workspace(b) != KVT_OK)
        ws = KVT_ERR_OUT_OF_MEMORY;
    if (!b->seqs || !b->n_tokens || !b->n_drafts || !b->n_slots || !b->defer || !b->steps || !b->step_seqs ||
        !b->recall_way || !b->dense || !b->rsteps || !b->recall_ran ||
        (rope && (!b->rrsteps || !b->remits)) ||
        ws == KVT_ERR_OUT_OF_MEMORY) {
        kvt_batch_destroy(b);
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "batch of %u requests", max_seqs);
    }
    b->next = ctx->batches;
    if (ctx->batches)
        ctx->batches->prev = b;
    ctx->batches = b;
    *out = b;
    return KVT_OK;
}

void kvt__batches_destroy(kvt_ctx *ctx) {
    while (ctx->batches)
        kvt_batch_destroy(ctx->batches);
}

/* End the step's membership of every request (after commit, or when the batch goes away). */
static void release_seqs(kvt_batch *b, bool unreserve) {
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        kvt_seq *s = b->seqs[i];
        if (!s)
            continue;
        if (unreserve && s->n_pending > 0)
            kvt__seq_unreserve(s);
        s->batch = NULL;
        s->in_step = false;
        memset(s->stepped, 0, 2u * b->ctx->n_layers); /* and recalled */
        b->seqs[i] = NULL;
    }
    b->n_seqs = 0;
    if (b->recall_ran)
        memset(b->recall_ran, 0, b->ctx->n_layers);
    b->state = BATCH_IDLE;
    b->ran = false;
    b->planned = false;
    b->stream = NULL;
}

void kvt_batch_destroy(kvt_batch *b) {
    if (!b)
        return;
    /* A step abandoned before any run gives its reservations back; after a run the rows may
     * have moved, so they stay reserved (the requests can only be destroyed or committed by a
     * new batch step — kvtier.h says to commit first). */
    release_seqs(b, !b->ran);
    if (b->prev)
        b->prev->next = b->next;
    else if (b->ctx->batches == b)
        b->ctx->batches = b->next;
    if (b->next)
        b->next->prev = b->prev;
    const kvt__alloc *a = &b->ctx->alloc;
    kvt__free(a, b->seqs, sizeof *b->seqs * b->max_seqs);
    kvt__free(a, b->n_tokens, sizeof *b->n_tokens * b->max_seqs);
    kvt__free(a, b->n_drafts, sizeof *b->n_drafts * b->max_seqs);
    kvt__free(a, b->n_slots, sizeof *b->n_slots * b->max_seqs);
    kvt__free(a, b->defer, b->max_seqs);
    kvt__free(a, b->steps, sizeof *b->steps * b->max_seqs);
    kvt__free(a, b->step_seqs, sizeof *b->step_seqs * b->max_seqs);
    kvt__free(a, b->recall_way, b->max_seqs);
    kvt__free(a, b->dense, b->max_seqs);
    kvt__free(a, b->rsteps, sizeof *b->rsteps * b->max_seqs);
    if (b->rrsteps)
        kvt__free(a, b->rrsteps, sizeof *b->rrsteps * b->max_seqs);
    if (b->remits)
        kvt__free(a, b->remits, sizeof *b->remits * b->max_seqs);
    kvt__free(a, b->recall_ran, b->ctx->n_layers);
    if (b->be.cap && b->be.ops->capture_end) { /* a capture never ended: its record goes */
        void *g = NULL;
        (void)b->be.ops->capture_end(&b->be, NULL, &g);
        if (g)
            b->be.ops->graph_free(&b->be, g);
    }
    if (b->plan_dev) {
        const size_t bytes = b->plan_at[b->ctx->n_layers];
        b->be.ops->buf_free(&b->be, b->plan_dev, bytes);
        kvt__free(a, b->plan_host, bytes);
        kvt__free(a, b->plan_emit, sizeof *b->plan_emit * b->ctx->n_layers);
        kvt__free(a, b->plan_at, sizeof *b->plan_at * (b->ctx->n_layers + 1u));
        kvt__free(a, b->plan_recall, b->ctx->n_layers);
        kvt__free(a, b->plan_qpr, sizeof *b->plan_qpr * b->ctx->n_layers);
    }
    if (b->own_be)
        b->be.ops->close(&b->be);
    kvt__free(a, b, sizeof *b);
}

static kvt_status plan_fill(kvt_batch *b, const kvt_emit *emits, uint32_t n_emits, void *stream,
                            bool sync, bool *fits);

void kvt__batch_forget(kvt_batch *b, const kvt_seq *seq) {
    bool found = false;
    for (uint32_t i = 0; i < b->n_seqs; i++)
        if (b->seqs[i] == seq) {
            b->seqs[i] = NULL;
            b->n_tokens[i] = 0;
            b->n_drafts[i] = 0;
            found = true;
        }
    /* A planned step's plan names the request's pages and kept set, which go with it: the plan
     * is rewritten (its set now empty, the later CSR offsets moved), ordered on the step's
     * stream before the runs or the graph launch that read it. Counts only shrink, so no
     * capacity check fails; a backend failure here leaves the context's error message. */
    if (found && b->planned)
        (void)plan_fill(b, b->plan_emit, b->ctx->n_layers, b->stream, false, NULL);
}

kvt_status kvt_batch_reserve(kvt_batch *b, kvt_seq *const *seqs, const uint32_t *n_tokens,
                             uint32_t n_seqs) {
    return kvt_batch_reserve_drafts(b, seqs, n_tokens, NULL, n_seqs);
}

kvt_status kvt_batch_reserve_drafts(kvt_batch *b, kvt_seq *const *seqs, const uint32_t *n_tokens,
                                    const uint32_t *n_drafts, uint32_t n_seqs) {
    if (!b)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_ctx *ctx = b->ctx;
    kvt__ctx_clear_error(ctx);
    if (b->state != BATCH_IDLE)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "the batch has a step in flight: commit it before the next reserve");
    if (n_seqs > b->max_seqs)
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY, "%u requests, the batch holds %u", n_seqs,
                             b->max_seqs);
    if (n_seqs > 0 && (!seqs || !n_tokens))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "seqs or n_tokens is NULL");
    /* Validate everything before anything is reserved. */
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt_seq *s = seqs[i];
        if (!s || s->ctx != ctx)
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                 "seqs[%u] is NULL or belongs to another context", i);
        if (s->batch || s->n_pending)
            return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                                 "seqs[%u] (request %llu) already has a step in flight", i,
                                 (unsigned long long)s->request_id);
        kvt_status us = kvt__seq_usable(s);
        if (us != KVT_OK)
            return us;
        if (n_drafts && n_drafts[i] > n_tokens[i])
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                 "n_drafts[%u] = %u exceeds n_tokens[%u] = %u", i, n_drafts[i], i,
                                 n_tokens[i]);
        for (uint32_t k = 0; k < i; k++)
            if (seqs[k] == s)
                return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                     "seqs[%u] and seqs[%u] are the same request", k, i);
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt_status s = n_tokens[i] ? kvt__seq_reserve(seqs[i], n_tokens[i]) : KVT_OK;
        if (s != KVT_OK) {
            /* All or nothing: give back what the earlier requests took. The message stays the
             * failing request's. */
            char tmp[KVT__ERR_LEN];
            memcpy(tmp, kvt__tls_error(), sizeof tmp);
            for (uint32_t k = i; k-- > 0;) /* last first: the pools' free stacks as before */
                kvt__seq_unreserve_cow(seqs[k]);
            return kvt__ctx_fail(ctx, s, "seqs[%u]: %s; nothing was reserved for the batch", i,
                                 tmp);
        }
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt__seq_reserve_done(seqs[i]);
        b->seqs[i] = seqs[i];
        b->n_tokens[i] = n_tokens[i];
        b->n_slots[i] = n_tokens[i];
        b->n_drafts[i] = n_drafts ? n_drafts[i] : 0;
        seqs[i]->batch = b;
    }
    b->n_seqs = n_seqs;
    b->state = BATCH_RESERVED;
    b->ran = false;
    return KVT_OK;
}

/* Entry of the per-layer calls: clear the error, check the layer, require the step to have
 * reached `need` (RESERVED: a reservation; PLANNED: plan ran). */
static kvt_status enter_layer(const kvt_batch *b, uint32_t layer, enum batch_state need) {
    const kvt_ctx *ctx = b->ctx;
    kvt__ctx_clear_error(ctx);
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "layer %u of %u", layer, ctx->n_layers);
    if (ctx->stores[layer].group < 0)
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH, "layer %u stores no per-token KV",
                             layer);
    if (b->state < need)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             need == BATCH_PLANNED ? "kvt_batch_plan first: the step is not planned"
                                                   : "no reservation: kvt_batch_reserve first");
    return KVT_OK;
}

kvt_status kvt_batch_slot_mapping(const kvt_batch *b, uint32_t layer, int32_t *slots,
                                  uint32_t capacity, uint32_t *n) {
    if (!b || !n)
        return KVT_ERR_INVALID_ARGUMENT;
    const kvt_ctx *ctx = b->ctx;
    kvt_status s = enter_layer(b, layer, BATCH_RESERVED);
    if (s != KVT_OK)
        return s;
    uint64_t total = 0;
    for (uint32_t i = 0; i < b->n_seqs; i++)
        total += b->n_slots[i];
    *n = (uint32_t)total;
    if (total > capacity)
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY, "%llu new tokens, capacity %u",
                             (unsigned long long)total, capacity);
    if (total > 0 && !slots)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "slots is NULL");
    uint64_t t = 0;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        const kvt_seq *sq = b->seqs[i];
        for (uint32_t j = 0; j < b->n_slots[i]; j++) {
            int32_t slot = -1;
            if (sq)
                kvt_seq_reserved_slot(sq, layer, j, &slot);
            slots[t++] = slot;
        }
    }
    return KVT_OK;
}

kvt_status kvt_batch_plan(kvt_batch *b) {
    if (!b)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_ctx *ctx = b->ctx;
    kvt__ctx_clear_error(ctx);
    if (b->state == BATCH_IDLE)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE, "no reservation: kvt_batch_reserve first");
    /* The step's work follows from counts inside each layer's run (the same rule a commit
     * applies); the plan fixes the step (requests become read-only by position). Emission needs
     * no host scratch: the runs describe each attended set in O(1) and the backend packs it. */
    for (uint32_t i = 0; i < b->n_seqs; i++)
        if (b->seqs[i])
            b->seqs[i]->in_step = true;
    b->state = BATCH_PLANNED;
    return KVT_OK;
}

kvt_status kvt_batch_capacity(const kvt_batch *b, uint32_t layer, uint32_t *topk,
                              uint32_t *total) {
    if (!b)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = enter_layer(b, layer, BATCH_PLANNED);
    if (s != KVT_OK)
        return s;
    uint64_t longest = 0, sum = 0;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        const kvt_seq *sq = b->seqs[i];
        uint64_t rows = sq ? sq->n_tokens + sq->n_pending : 0;
        longest = rows > longest ? rows : longest;
        sum += rows;
    }
    if (topk)
        *topk = longest > UINT32_MAX ? UINT32_MAX : (uint32_t)longest;
    if (total)
        *total = sum > UINT32_MAX ? UINT32_MAX : (uint32_t)sum;
    return KVT_OK;
}

/* Rows of request i's step that query token t of S sees: all of them with one query per request;
 * else its own and the earlier ones (a padded token t >= n_tokens sees what the last one does). */
/* Queries described per call of the backend's pack (a stack array: a run allocates nothing). */
#define KVT__PACK_CHUNK 64u

static uint32_t visible_rows(const kvt_batch *b, uint32_t i, uint32_t S, uint32_t t) {
    return S == 1 || t >= b->n_tokens[i] ? b->n_tokens[i] : t + 1;
}

/* How a request's set is made on a layer: without recall; with the trigger's fetched rows (one
 * query token); every row (a request with recall whose step has several query tokens). */
enum { RECALL_NONE = 0, RECALL_FETCH = 1, RECALL_ALL = 2 };

static uint8_t recall_way(const kvt_batch *b, uint32_t i, uint32_t layer, uint32_t S) {
    const kvt_seq *sq = b->seqs[i];
    if (!sq || !(kvt__seq_recalls(sq, layer) || kvt__seq_recalls_rope(sq, layer)))
        return RECALL_NONE;
    return b->n_tokens[i] <= 1 && !b->defer[i] && (S == 1 || b->n_tokens[i] == 1) ? RECALL_FETCH
                                                                                 : RECALL_ALL;
}

/* The RoPE trigger of request i on this layer (docs/recall.md §9), once per step: its work item
 * into b->rrsteps[*n] (one backend call takes the layer's items: run_recall); a second run of
 * the layer emits what the first fetched, its dense flag from the state. */
static kvt_status rope_recall_item(kvt_batch *b, uint32_t i, uint32_t layer, const float *query,
                                   void *stream, const kvt_emit *emit, uint32_t *n) {
    kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    kvt_seq *sq = b->seqs[i];
    const kvt_layer_spec *sp = &ctx->stores[layer].spec;
    kvt_status s;
    if (sq->recalled[layer]) {
        if (emit->dense &&
            (s = be->ops->copy(be, emit->dense + i, &sq->rrope[layer].base.st->last_dense, 1,
                               stream)) != KVT_OK)
            return kvt__ctx_fail(ctx, s, "emission's dense flags");
        return KVT_OK;
    }
    if (!be->ops->recall_rope_step || !be->ops->recall_rope_emit || !b->rrsteps)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "layer %u: the %s backend has no RoPE recall ops", layer,
                             be->ops->name);
    const size_t per_seq = (size_t)sp->n_q_heads * sp->head_dim;
    if ((s = kvt__seq_rope_recall_item(sq, layer, query + i * per_seq,
                                       emit->dense ? emit->dense + i : NULL,
                                       &b->rrsteps[*n])) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "seqs[%u] layer %u: %s", i, layer, kvt__tls_error());
    ++*n;
    return KVT_OK;
}

/* The trigger for every request that fetches on this layer (one backend call), after the
 * emission's dense flags are written (the call overwrites the fetching requests' flags). */
static kvt_status run_recall(kvt_batch *b, uint32_t layer, const float *query, void *stream,
                             const kvt_emit *emit) {
    kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    const size_t per_seq = query_floats(ctx, layer);
    kvt_status s;
    /* several query tokens: every row, but a host archive's RoPE request attends its held rows
     * only (no step copies the whole archive over the bus) */
    for (uint32_t i = 0; emit->dense && i < b->n_seqs; i++)
        b->dense[i] = b->recall_way[i] == RECALL_ALL &&
                      !(ctx->archive_host && kvt__seq_recalls_rope(b->seqs[i], layer));
    if (emit->dense && b->n_seqs &&
        (s = be->ops->write(be, emit->dense, b->dense, b->n_seqs, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "emission's dense flags");
    /* Once per step and layer: a second run of the layer emits what the first fetched (the fetch
     * buffer and the state's dense flag are unchanged), it does not scan or calibrate again. */
    uint32_t n = 0, nr = 0;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        kvt_seq *sq = b->seqs[i];
        /* a second run: the flag the first one's trigger wrote, from the state (low byte) */
        if (b->recall_way[i] == RECALL_FETCH && kvt__seq_recalls_rope(sq, layer)) {
            if ((s = rope_recall_item(b, i, layer, query, stream, emit, &nr)) != KVT_OK)
                return s;
            continue;
        }
        if (b->recall_way[i] == RECALL_FETCH && sq->recalled[layer] && emit->dense &&
            (s = be->ops->copy(be, emit->dense + i, &sq->recall[layer].st->last_dense, 1,
                               stream)) != KVT_OK)
            return kvt__ctx_fail(ctx, s, "emission's dense flags");
        if (b->recall_way[i] == RECALL_FETCH && !sq->recalled[layer] &&
            kvt__seq_recall_item(sq, layer, query + i * per_seq,
                                 emit->dense ? emit->dense + i : NULL, &b->rsteps[n]))
            b->step_seqs[n++] = sq;
    }
    if (n && (s = be->ops->recall_step(be, b->rsteps, n, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "the recall trigger of layer %u (%u requests)", layer, n);
    if (nr && (s = be->ops->recall_rope_step(be, b->rrsteps, nr, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "the RoPE recall trigger of layer %u (%u requests)", layer,
                             nr);
    for (uint32_t i = 0; nr && i < b->n_seqs; i++)
        if (b->recall_way[i] == RECALL_FETCH && kvt__seq_recalls_rope(b->seqs[i], layer))
            b->seqs[i]->recalled[layer] = 1;
    for (uint32_t k = 0; k < n; k++) {
        b->step_seqs[k]->recalled[layer] = 1;
        /* config.recall_lagged_query: this step's queries are the next step's (after the op) */
        if ((s = kvt__recall_layer_lag_advance(&b->step_seqs[k]->recall[layer], be, stream)) !=
            KVT_OK)
            return kvt__ctx_fail(ctx, s, "layer %u: keeping the queries for the next step",
                                 layer);
    }
    return KVT_OK;
}

/* Query tokens per request an emission asks for (FlashMLA's s_q): 1 for a struct from before
 * the field, and for 0. */
static uint32_t emit_queries(const kvt_emit *e) {
    return e->struct_size >= offsetof(kvt_emit, queries_per_seq) + sizeof e->queries_per_seq &&
                   e->queries_per_seq > 1
               ? e->queries_per_seq
               : 1;
}

/* An emission's arrays its layout needs are missing (indices may be NULL at capacity 0). */
static bool emit_arrays_missing(const kvt_emit *e) {
    const bool tokens = e->layout == KVT_EMIT_TOKENS;
    return (tokens ? !e->lengths : !e->indptr) || (!e->indices && e->capacity > 0);
}

/* Query token t of request i on the layer (entry i * S + t of the emission): its set, and where
 * it goes in the TOKENS or CSR layout (CSR: from *off on, which it advances). */
static void set_query(const kvt_batch *b, uint32_t i, uint32_t t, uint32_t layer, uint32_t S,
                      const kvt_emit *emit, uint64_t *off, kvt__pack_query *pq) {
    const kvt_seq *sq = b->seqs[i];
    const bool tokens = emit->layout == KVT_EMIT_TOKENS;
    const uint64_t at = (uint64_t)i * S + t;
    if (sq)
        kvt__seq_step_query(sq, layer, visible_rows(b, i, S, t), pq);
    else
        *pq = (kvt__pack_query){0}; /* destroyed mid-step: attends nothing */
    if (b->recall_way[i] == RECALL_FETCH && kvt__seq_recalls(sq, layer))
        kvt__recall_pack_query(&sq->recall[layer], pq);
    pq->all_rows = b->recall_way[i] == RECALL_ALL;
    pq->out = tokens ? at * emit->capacity : *off;
    pq->pad = tokens ? emit->capacity : 0;
    pq->len_at = tokens ? at : at + 1;
    /* an every-row set's size is the host's too (a fetching one's is not: dev_offsets) */
    *off += pq->all_rows ? pq->d.hi_end : kvt__attended_desc_count(&pq->d);
}

/* Pack the *k queued queries of pa (then none are queued). */
static kvt_status flush_pack(kvt_batch *b, uint32_t layer, void *stream, kvt__pack_args *pa,
                             uint32_t *k) {
    pa->n = *k;
    *k = 0;
    kvt_status s = b->be.ops->pack(&b->be, pa, stream);
    pa->first_csr = false;
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(b->ctx, s, "packing the attended sets of layer %u", layer);
}

/* The queued RoPE emissions b->remits[0 .. *ne) in one backend call (then none are queued). */
static kvt_status flush_rope_emits(kvt_batch *b, uint32_t layer, void *stream, uint32_t *ne) {
    const kvt__backend *be = &b->be;
    const uint32_t n = *ne;
    *ne = 0;
    if (!n)
        return KVT_OK;
    if (!be->ops->recall_rope_emit) /* refused at request creation; never reached */
        return kvt__ctx_fail(b->ctx, KVT_ERR_UNSUPPORTED,
                             "layer %u: the %s backend has no RoPE recall ops", layer,
                             be->ops->name);
    kvt_status s = be->ops->recall_rope_emit(be, b->remits, n, stream);
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(b->ctx, s, "emitting the RoPE recall lists of layer %u "
                                                  "(%u requests)", layer, n);
}

/* KVT_EMIT_TOKENS on a layer with one KV head: RoPE-recalling request i's row of the indices
 * (FlashMLA's layout: topk_length, then -1 up to topk) queued for the recall_rope_emit op (rows
 * of distinct requests are disjoint: the layer's are emitted in one call after its packs). */
static kvt_status emit_rope_tokens(kvt_batch *b, uint32_t i, uint32_t layer,
                                   const kvt_emit *emit, uint32_t *ne) {
    if (!b->remits) /* no layer of the context recalls on RoPE: never reached */
        return kvt__ctx_fail(b->ctx, KVT_ERR_INVARIANT, "seqs[%u] recalls on RoPE layer %u", i,
                             layer);
    const uint64_t at = (uint64_t)i * emit->capacity;
    kvt__recall_rope_emit_args *ea = &b->remits[(*ne)++];
    kvt_status s = kvt__seq_rope_emit_item(b->seqs[i], layer, b->recall_way[i] == RECALL_ALL,
                                           emit->indices, at + emit->capacity, NULL, ea);
    if (s != KVT_OK)
        return kvt__ctx_fail(b->ctx, s, "seqs[%u] layer %u: %s", i, layer, kvt__tls_error());
    ea->chain = false;
    ea->out = at;
    ea->pad = emit->capacity;
    ea->length = emit->lengths + i;
    return KVT_OK;
}

/* KVT_EMIT_CSR_KV_HEADS: per request, n_kv lists — a RoPE-recalling request's from the
 * recall_rope_emit op (fetched rows copied into its fetch area), any other's the shared set
 * once per head through the pack op. Every list starts where the backend ended the previous one
 * (indptr[0] = 0 written first): fetch counts are the backend's. */
static kvt_status emit_kv_heads(kvt_batch *b, uint32_t layer, uint32_t n_kv, void *stream,
                                const kvt_emit *emit, kvt__pack_query *q, kvt__pack_args *pa) {
    kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    kvt_status s = be->ops->write(be, emit->indptr, &(int32_t){0}, sizeof(int32_t), stream);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "emission's first offset");
    pa->dev_offsets = true;
    pa->first_csr = false;
    uint32_t k = 0, ne = 0;
    for (uint32_t i = 0; i <= b->n_seqs; i++) {
        const kvt_seq *sq = i < b->n_seqs ? b->seqs[i] : NULL;
        const bool rope = sq && kvt__seq_recalls_rope(sq, layer);
        /* the queued lists first: a RoPE request's chain reads where they end; a run of
         * consecutive RoPE requests is one chained call, before the next packed list */
        if (k && (rope || i == b->n_seqs) && (s = flush_pack(b, layer, stream, pa, &k)) != KVT_OK)
            return s;
        if (ne && !rope && (s = flush_rope_emits(b, layer, stream, &ne)) != KVT_OK)
            return s;
        if (i == b->n_seqs)
            break;
        if (rope && !b->remits) /* no layer of the context recalls on RoPE: never reached */
            return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT, "seqs[%u] recalls on RoPE layer %u", i,
                                 layer);
        if (rope) {
            if ((s = kvt__seq_rope_emit_item(sq, layer, b->recall_way[i] == RECALL_ALL,
                                             emit->indices, emit->capacity,
                                             emit->indptr + (size_t)i * n_kv,
                                             &b->remits[ne])) != KVT_OK)
                return kvt__ctx_fail(ctx, s, "seqs[%u] layer %u: %s", i, layer,
                                     kvt__tls_error());
            ne++;
            continue;
        }
        for (uint32_t h = 0; h < n_kv; h++) {
            if (k == KVT__PACK_CHUNK && (s = flush_pack(b, layer, stream, pa, &k)) != KVT_OK)
                return s;
            kvt__pack_query *pq = &q[k++];
            if (sq)
                kvt__seq_step_query(sq, layer, b->n_tokens[i], pq);
            else
                *pq = (kvt__pack_query){0}; /* destroyed mid-step: attends nothing */
            if (b->recall_way[i] == RECALL_FETCH && kvt__seq_recalls(sq, layer))
                kvt__recall_pack_query(&sq->recall[layer], pq);
            pq->all_rows = b->recall_way[i] == RECALL_ALL;
            pq->out = 0; /* dev_offsets */
            pq->pad = 0;
            pq->len_at = (uint64_t)i * n_kv + h + 1;
        }
    }
    return KVT_OK;
}

/* The emission a planned step may use: TOKENS or CSR, one query per request, arrays given. */
static kvt_status plan_emit_ok(kvt_ctx *ctx, const kvt_emit *e, uint32_t l) {
    if (e->struct_size < KVT_EMIT_SIZE_MIN)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emits[%u].struct_size is below KVT_EMIT_SIZE_MIN", l);
    if (e->layout != KVT_EMIT_TOKENS && e->layout != KVT_EMIT_CSR &&
        e->layout != KVT_EMIT_CSR_KV_HEADS)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emits[%u].layout: unknown value %d",
                             l, (int)e->layout);
    if (emit_queries(e) > 1)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emits[%u].queries_per_seq: a planned step has one query per "
                             "request", l);
    if (emit_arrays_missing(e))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emits[%u]: %s is NULL", l,
                             e->layout == KVT_EMIT_TOKENS ? "indices or lengths"
                                                          : "indices or indptr");
    return KVT_OK;
}

/* Does a planned step's run of this layer get the emission it was planned for? */
static bool same_emit(const kvt_emit *a, const kvt_emit *b) {
    return a->layout == b->layout && a->indices == b->indices && a->capacity == b->capacity &&
           a->lengths == b->lengths && a->indptr == b->indptr && a->dense == b->dense;
}

/* The bound of layer l's planned recall items: the context's shapes, max_rows_per_seq and
 * block_rows (every request's group planes are over the context's blocks). */
static void plan_bound(const kvt_batch *b, uint32_t l, kvt__recall_step_args *out) {
    const kvt_ctx *ctx = b->ctx;
    const kvt_layer_spec *sp = &ctx->stores[l].spec;
    kvt__recall_plan_bound(sp->n_q_heads, ctx->sketch_rank, sp->value_dim, sp->branch_dim,
                           ctx->max_rows, ctx->cfg.recall_promote_capacity, ctx->cfg.block_rows,
                           out);
}

/* Request i's recall step on layer l as the planned op takes it (kvt__seq_recall_item's, its
 * queries at the request's place from the run's query base, its dense flag the emission's);
 * *has false when the request has nothing to recall from there this step. false when the item
 * breaks the argument rules or the layer's bound (plan_bound; the step is then not plannable). */
static bool plan_recall_item(kvt_batch *b, uint32_t i, uint32_t l, const kvt_emit *e,
                             const kvt__recall_step_args *bound, bool first,
                             kvt__recall_plan_item *it, bool *has) {
    static const float no_query; /* a placeholder: the op reads the run's query + q_off */
    *has = kvt__seq_recall_item(b->seqs[i], l, &no_query, e->dense ? e->dense + i : NULL, &it->a);
    if (!*has)
        return true;
    /* config.recall_lagged_query: the op scans with the lagged buffer once it holds a query
     * (lag_has when the step was first planned), then copies the step's queries into it */
    kvt__recall_layer *r = &b->seqs[i]->recall[l];
    it->lag = r->lag_q;
    if (r->lag_q) {
        if (first) {
            r->lag_plan_use = r->lag_has;
            r->lag_plan_item = 1;
        }
        r->last_lagged = r->lag_plan_use;
        r->lag_next = NULL; /* no eager copy: the planned op's */
    }
    it->lag_use = r->lag_q ? r->lag_plan_use : 0;
    it->div = *it->a.scan.pdiv;
    it->q_off = (uint64_t)i * query_floats(b->ctx, l);
    const bool ok = kvt__recall_plan_ok(bound, &it->a);
    it->a.scan.pdiv = NULL; /* host values, not read by the op */
    it->a.scan.q = NULL;
    return ok;
}

/* The planned recall op of layer l: its items in the plan buffer, the run's query base. */
static void recall_plan_args(const kvt_batch *b, uint32_t l, const float *query,
                             kvt__recall_plan_args *out) {
    const uint8_t *at = b->plan_dev + b->plan_at[l];
    *out = (kvt__recall_plan_args){
        .items = (const kvt__recall_plan_item *)(b->plan_dev + plan_recall_at(b, l)),
        .n = (const uint32_t *)(at + sizeof(uint32_t)), .n_max = b->max_seqs, .query = query,
        .query_floats = query ? query_floats(b->ctx, l) * b->max_seqs : 0};
    plan_bound(b, l, &out->bound);
}

/* The planned RoPE ops of layer l: their items in the plan buffer, the run's query base, the
 * layer's bound (kvt__ctx_rope_bound). */
static void rope_plan_args(const kvt_batch *b, uint32_t l, const float *query,
                           kvt__recall_rope_plan_args *out) {
    const uint8_t *at = b->plan_dev + b->plan_at[l];
    const kvt_layer_spec *sp = &b->ctx->stores[l].spec;
    *out = (kvt__recall_rope_plan_args){
        .items = (const kvt__recall_rope_plan_item *)(b->plan_dev + plan_recall_at(b, l)),
        .emits = (const kvt__recall_rope_emit_plan_item *)(b->plan_dev + plan_rope_emits_at(b, l)),
        .n = (const uint32_t *)(at + sizeof(uint32_t)), .n_max = b->max_seqs, .query = query,
        .query_floats = query ? (uint64_t)sp->n_q_heads * sp->head_dim * b->max_seqs : 0};
    (void)kvt__ctx_rope_bound(b->ctx, l, &out->bound);
}

/* Request i's RoPE trigger and emission on layer l as the planned ops take them (the eager
 * run's: its queries at the request's place from the run's query base, its dense flag the
 * emission's, its row of a KVT_EMIT_TOKENS emission); false when either breaks the rules or the
 * layer's bound (the step is then not plannable). */
static bool plan_rope_item(kvt_batch *b, uint32_t i, uint32_t l, const kvt_emit *e,
                           uint32_t qpr, const kvt__recall_rope_args *bound,
                           kvt__recall_rope_plan_item *it, kvt__recall_rope_emit_plan_item *em) {
    static const float no_query; /* a placeholder: the op reads the run's query + q_off */
    kvt_seq *sq = b->seqs[i];
    const kvt_layer_spec *sp = &b->ctx->stores[l].spec;
    if (kvt__seq_rope_recall_item(sq, l, &no_query, e->dense ? e->dense + i : NULL, &it->a) !=
        KVT_OK)
        return false;
    it->div = *it->a.pdiv;
    it->q_off = (uint64_t)i * sp->n_q_heads * sp->head_dim;
    bool ok = kvt__recall_rope_args_ok(&it->a) && kvt__recall_rope_plan_fits(bound, &it->a);
    it->a.pdiv = NULL; /* host values, not read by the op */
    it->a.q = NULL;
    if (e->layout == KVT_EMIT_TOKENS) {
        const uint64_t at = (uint64_t)i * e->capacity;
        if (kvt__seq_rope_emit_item(sq, l, false, e->indices, at + e->capacity, NULL, &em->a) !=
            KVT_OK)
            return false;
        em->a.chain = false;
        em->a.out = at;
        em->a.pad = e->capacity;
        em->a.length = e->lengths + i;
    } else if (kvt__seq_rope_emit_item(sq, l, false, e->indices, e->capacity,
                                       e->indptr + (size_t)i * qpr, &em->a) != KVT_OK ||
               em->a.n_kv != qpr) {
        return false; /* (CSR over several KV heads: the eager run refuses it) */
    }
    em->div = *em->a.pdiv;
    ok = ok && kvt__recall_rope_emit_ok(&em->a) && em->a.ar_n <= bound->ar_n;
    em->a.pdiv = NULL;
    return ok;
}

/* Every layer's sets of the planned step into the plan image, as each run would describe them
 * (nothing of the step moves rows), with kvt_batch_run's capacity checks (sync: the page tables'
 * new entries to the backend first), then the image to the backend on stream. A recall item
 * outside its layer's bound: *fits false, KVT_OK, nothing written to the backend (the step is not
 * plannable); fits NULL (a plan rewritten for the same step): KVT_ERR_INVARIANT. */
static kvt_status plan_fill(kvt_batch *b, const kvt_emit *emits, uint32_t n_emits, void *stream,
                            bool sync, bool *fits) {
    kvt_ctx *ctx = b->ctx;
    const kvt__backend *be = &b->be;
    const uint32_t L = ctx->n_layers;
    memset(b->defer, 0, b->n_seqs); /* a planned step has no drafts and one query a request */
    for (uint32_t l = 0; l < L; l++) {
        const kvt_emit *e = &emits[n_emits == 1 ? 0 : l];
        uint8_t *at = b->plan_host + b->plan_at[l];
        kvt__pack_query *q = (kvt__pack_query *)(at + PLAN_HEAD);
        kvt__recall_plan_item *items =
            plans_recall(b, l) ? (kvt__recall_plan_item *)(b->plan_host + plan_recall_at(b, l))
                               : NULL;
        kvt__recall_step_args bound;
        if (items)
            plan_bound(b, l, &bound);
        const bool rope_l = plans_rope(b, l);
        kvt__recall_rope_plan_item *ritems =
            rope_l ? (kvt__recall_rope_plan_item *)(b->plan_host + plan_recall_at(b, l)) : NULL;
        kvt__recall_rope_emit_plan_item *remits =
            rope_l ? (kvt__recall_rope_emit_plan_item *)(b->plan_host + plan_rope_emits_at(b, l))
                   : NULL;
        kvt__recall_rope_args rbound;
        if (rope_l)
            (void)kvt__ctx_rope_bound(ctx, l, &rbound);
        const uint32_t qpr = b->plan_qpr[l];
        const bool tokens = e->layout == KVT_EMIT_TOKENS;
        uint32_t n = 0, n_recall = 0;
        uint64_t off = 0, total = 0;
        for (uint32_t i = 0; ctx->stores[l].group >= 0 && i < b->n_seqs; i++) {
            kvt_seq *sq = b->seqs[i];
            kvt_status s = sq && sync ? kvt__seq_mirror_sync(sq, l, be, stream) : KVT_OK;
            if (s != KVT_OK)
                return kvt__ctx_fail(ctx, s, "seqs[%u] layer %u: page table to the backend", i,
                                     l);
            b->recall_way[i] = recall_way(b, i, l, 1);
            const bool rope = b->recall_way[i] != RECALL_NONE && kvt__seq_recalls_rope(sq, l);
            if (b->recall_way[i] != RECALL_NONE && !(rope ? rope_l : items != NULL))
                return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT, /* kvt__seq_step_quiet's rule */
                                     "seqs[%u] recalls on layer %u, which plans no recall", i, l);
            if (rope) {
                /* its trigger and emission items; in the pack, TOKENS: a query that writes only
                 * its dense flag (the state's, which the trigger wrote), the emission then its
                 * row; CSR / CSR_KV_HEADS: per KV head a query that writes only the list's count
                 * (so the lists after it start after it), the emission then the lists */
                if (b->recall_way[i] != RECALL_FETCH ||
                    !plan_rope_item(b, i, l, e, qpr, &rbound, &ritems[n_recall],
                                    &remits[n_recall])) {
                    if (fits) {
                        *fits = false;
                        return KVT_OK;
                    }
                    return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                         "seqs[%u] layer %u: its RoPE recall left the plan's "
                                         "bound since plan_device checked it",
                                         i, l);
                }
                const kvt__recall_rope_emit_args *ea = &remits[n_recall].a;
                n_recall++;
                const uint64_t rows = sq->n_tokens + sq->n_pending; /* held and archived */
                if (tokens && rows > e->capacity)
                    return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                                         "seqs[%u] attends %llu rows on layer %u, topk is %u; "
                                         "nothing planned (kvt_batch_capacity)",
                                         i, (unsigned long long)rows, l, e->capacity);
                if (tokens) {
                    q[n++] = (kvt__pack_query){.dense = &sq->rrope[l].base.st->last_dense,
                                               .out = (uint64_t)i * e->capacity, .len_at = i};
                    continue;
                }
                total += (uint64_t)qpr * rows;
                const kvt__recall_rope_layer *rr = &sq->rrope[l];
                for (uint32_t h = 0; h < qpr; h++, n++) {
                    kvt__seq_step_query(sq, l, b->n_tokens[i], &q[n]); /* its table's pages */
                    q[n].d = (kvt__attended_desc){.lo_end = ea->n_rows,
                                                  .hi_begin = ea->n_rows + ea->ar_n,
                                                  .hi_end = ea->n_rows + ea->ar_n};
                    q[n].fetch = rr->fired + (size_t)h * rr->cap;
                    q[n].n_fetch = rr->n_fired + h;
                    q[n].fetch_cap = rr->cap;
                    q[n].dense = ea->capped ? NULL : &rr->base.st->last_dense;
                    q[n].all_rows = false;
                    q[n].count_only = true;
                    q[n].out = 0;
                    q[n].pad = 0;
                    q[n].len_at = (uint64_t)i * qpr + h + 1;
                }
                continue;
            }
            bool has = false;
            if (b->recall_way[i] == RECALL_FETCH &&
                !plan_recall_item(b, i, l, e, &bound, fits != NULL, &items[n_recall], &has)) {
                if (fits) {
                    *fits = false;
                    return KVT_OK;
                }
                return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT,
                                     "seqs[%u] layer %u: its recall step left the plan's bound "
                                     "since plan_device checked it",
                                     i, l);
            }
            n_recall += has;
            set_query(b, i, 0, l, 1, e, &off, &q[n]);
            /* with recall the set may be every row of the view (kvt_batch_run's bound) */
            const uint64_t rows = b->recall_way[i] == RECALL_NONE
                                      ? kvt__attended_desc_count(&q[n].d)
                                      : q[n].d.hi_end;
            total += (uint64_t)qpr * rows;
            if (tokens && rows > e->capacity)
                return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                                     "seqs[%u] attends %llu rows on layer %u, topk is %u; "
                                     "nothing planned (kvt_batch_capacity)",
                                     i, (unsigned long long)rows, l, e->capacity);
            /* CSR_KV_HEADS: the set once per KV head, each its own list */
            for (uint32_t h = 0; !tokens && h < qpr; h++) {
                if (h)
                    q[n + h] = q[n];
                q[n + h].len_at = (uint64_t)i * qpr + h + 1;
            }
            n += qpr;
        }
        if (!tokens && (total > e->capacity || total > INT32_MAX))
            return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                                 "the batch attends %llu rows on layer %u, capacity is %u; "
                                 "nothing planned (kvt_batch_capacity)",
                                 (unsigned long long)total, l, e->capacity);
        memcpy(at, &n, sizeof n);
        memcpy(at + sizeof n, &n_recall, sizeof n_recall);
        b->plan_emit[l] = *e;
    }
    kvt_status s = be->ops->write(be, b->plan_dev, b->plan_host, b->plan_at[L], stream);
    return s == KVT_OK ? KVT_OK : kvt__ctx_fail(ctx, s, "the step's plan to the backend");
}

kvt_status kvt_batch_plan_device(kvt_batch *b, const kvt_emit *emits, uint32_t n_emits,
                                 void *stream, bool *planned) {
    if (!b || !planned)
        return KVT_ERR_INVALID_ARGUMENT;
    *planned = false;
    kvt_ctx *ctx = b->ctx;
    kvt__ctx_clear_error(ctx);
    const uint32_t L = ctx->n_layers;
    if (b->state != BATCH_PLANNED || b->ran || b->planned)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "kvt_batch_plan_device: after kvt_batch_plan, before any run, once");
    if (!emits || (n_emits != 1 && n_emits != L))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emits: %u given, 1 (every layer) or n_layers = %u", n_emits, L);
    for (uint32_t l = 0; l < n_emits; l++) {
        kvt_status s = plan_emit_ok(ctx, &emits[l], l);
        if (s != KVT_OK)
            return s;
    }
    /* 1. Plannable: no drafts, no layer with work its runs must do (close, round, a recall
     * the plan cannot hold); plan_fill checks the recall items against the plan's bound. */
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        kvt_seq *sq = b->seqs[i];
        if (!sq)
            continue;
        kvt_status s = kvt__seq_usable(sq);
        if (s != KVT_OK)
            return s;
        if (b->n_drafts[i])
            return KVT_OK;
        for (uint32_t l = 0; l < L; l++)
            if (ctx->stores[l].group >= 0 &&
                !kvt__seq_step_quiet(sq, l, plans_recall(b, l) || plans_rope(b, l)))
                return KVT_OK;
    }
    /* 2. The buffer, at the first planned step: every layer's count and max_seqs queries. A
     * later planned step must pass that step's emissions: a graph captured over planned runs
     * holds their arrays and capacities, which the plan's offsets must fit. */
    const kvt__backend *be = &b->be;
    for (uint32_t l = 0; b->planned_once && l < L; l++)
        if (!same_emit(&emits[n_emits == 1 ? 0 : l], &b->plan_emit[l]))
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                 "emits[%u]: not the emission of the batch's first planned step "
                                 "(a graph captured over planned runs writes those arrays; plan "
                                 "other emissions on another batch)",
                                 n_emits == 1 ? 0 : l);
    if (!b->plan_dev) {
        size_t *at = kvt__calloc(&ctx->alloc, sizeof *at * (L + 1u));
        uint8_t *pr = at ? kvt__calloc(&ctx->alloc, L) : NULL;
        uint32_t *qpr = pr ? kvt__calloc(&ctx->alloc, sizeof *qpr * L) : NULL;
        if (!qpr) {
            kvt__free(&ctx->alloc, at, sizeof *at * (L + 1u));
            kvt__free(&ctx->alloc, pr, L);
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "the batch's plan layout");
        }
        for (uint32_t l = 0; l < L; l++) {
            pr[l] = plans_recall(b, l) ? PLAN_NOPE : plans_rope(b, l) ? PLAN_ROPE : 0;
            qpr[l] = emits[n_emits == 1 ? 0 : l].layout == KVT_EMIT_CSR_KV_HEADS
                         ? ctx->stores[l].spec.n_kv_heads
                         : 1u;
        }
        b->plan_at = at; /* plan_recall_at reads them */
        b->plan_qpr = qpr;
        for (uint32_t l = 0; l < L; l++) { /* 64-byte aligned parts */
            const size_t end =
                pr[l] == PLAN_NOPE
                    ? plan_recall_at(b, l) + sizeof(kvt__recall_plan_item) * b->max_seqs
                : pr[l] == PLAN_ROPE
                    ? plan_rope_emits_at(b, l) +
                          sizeof(kvt__recall_rope_emit_plan_item) * b->max_seqs
                    : at[l] + PLAN_HEAD + sizeof(kvt__pack_query) * b->max_seqs * qpr[l];
            at[l + 1] = at[l] + (end - at[l] + 63u) / 64u * 64u;
        }
        const size_t bytes = at[L];
        void *dev = NULL;
        kvt_status s = be->ops->buf_alloc(be, bytes, &dev);
        uint8_t *host = s == KVT_OK ? kvt__calloc(&ctx->alloc, bytes) : NULL;
        kvt_emit *pe = host ? kvt__calloc(&ctx->alloc, sizeof *pe * L) : NULL;
        if (!pe) {
            kvt__free(&ctx->alloc, host, bytes);
            if (dev)
                be->ops->buf_free(be, dev, bytes);
            kvt__free(&ctx->alloc, at, sizeof *at * (L + 1u));
            kvt__free(&ctx->alloc, pr, L);
            kvt__free(&ctx->alloc, qpr, sizeof *qpr * L);
            b->plan_at = NULL;
            b->plan_qpr = NULL;
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "the batch's plan buffer (%zu B)",
                                 bytes);
        }
        b->plan_recall = pr; /* from here on plans_recall reads it */
        b->plan_dev = dev;
        b->plan_host = host;
        b->plan_emit = pe;
    }
    /* 3. Room for the planned recall ops (a device's workspace: never grown in a capture), once:
     * the layers' bounds are the batch's for its life. */
    for (uint32_t l = 0; !b->plan_reserved && l < L; l++) {
        kvt_status s = KVT_OK;
        if (plans_recall(b, l) && be->ops->recall_plan_reserve) {
            kvt__recall_plan_args ra;
            recall_plan_args(b, l, NULL, &ra);
            s = be->ops->recall_plan_reserve(be, &ra);
        } else if (plans_rope(b, l) && be->ops->recall_rope_plan_reserve) {
            kvt__recall_rope_plan_args ra;
            rope_plan_args(b, l, NULL, &ra);
            s = be->ops->recall_rope_plan_reserve(be, &ra);
        }
        if (s != KVT_OK)
            return kvt__ctx_fail(ctx, s, "layer %u: workspace of the planned recall step", l);
    }
    b->plan_reserved = true;
    /* 4. Each layer's sets and the image; 5. the emissions' dense flags (0 where no request
     * recalls: the recall step writes the others'). */
    bool fits = true;
    kvt_status s = plan_fill(b, emits, n_emits, stream, true, &fits);
    /* lagged queries: a planned step's op fills the buffers of the requests it planned */
    for (uint32_t i = 0; i < b->n_seqs; i++)
        for (uint32_t l = 0; b->seqs[i] && b->seqs[i]->recall && l < L; l++) {
            kvt__recall_layer *r = &b->seqs[i]->recall[l];
            if (r->lag_plan_item && s == KVT_OK && fits)
                r->lag_has = 1;
            r->lag_plan_item = 0;
        }
    if (s != KVT_OK || !fits)
        return s;
    memset(b->dense, 0, b->n_seqs);
    for (uint32_t l = 0; s == KVT_OK && l < n_emits; l++)
        if (emits[l].dense && b->n_seqs)
            s = be->ops->write(be, emits[l].dense, b->dense, b->n_seqs, stream);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "the step's plan to the backend");
    b->planned = true;
    b->planned_once = true;
    b->stream = stream;
    *planned = true;
    return KVT_OK;
}

/* A planned step's run: on a layer that plans recall the planned recall step, then one pack
 * (on a RoPE layer: the trigger, the pack, the emission), all from the plan buffer, their arguments holding nothing of the step (a captured launch
 * replays over later planned steps); the policy work is the commit's. */
static kvt_status run_planned(kvt_batch *b, uint32_t layer, const float *query, void *stream,
                              const kvt_emit *emit) {
    kvt_ctx *ctx = b->ctx;
    if (!same_emit(emit, &b->plan_emit[layer]))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "layer %u: emit is not the one kvt_batch_plan_device planned for",
                             layer);
    const uint8_t *at = b->plan_dev + b->plan_at[layer];
    const bool rope = plans_rope(b, layer);
    if ((plans_recall(b, layer) || rope) && !query)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "query is NULL: a planned run of layer %u, where requests may "
                             "recall, holds the recall step (a graph replays it over steps "
                             "that recall)",
                             layer);
    kvt_status s;
    if (plans_recall(b, layer)) {
        if (b->recall_ran[layer] == 0) { /* once per step and layer, as kvt_batch_run */
            kvt__recall_plan_args ra;
            recall_plan_args(b, layer, query, &ra);
            if ((s = b->be.ops->recall_step_planned(&b->be, &ra, stream)) != KVT_OK)
                return kvt__ctx_fail(ctx, s, "the planned recall step of layer %u", layer);
            b->recall_ran[layer] = 1;
        }
    }
    kvt__recall_rope_plan_args rp;
    if (rope) {
        rope_plan_args(b, layer, query, &rp);
        if (b->recall_ran[layer] == 0) { /* the trigger once per step and layer */
            if ((s = b->be.ops->recall_rope_step_planned(&b->be, &rp, stream)) != KVT_OK)
                return kvt__ctx_fail(ctx, s, "the planned RoPE recall step of layer %u", layer);
            b->recall_ran[layer] = 1;
        }
    }
    kvt__pack_args pa = {.q_plan = (const kvt__pack_query *)(at + PLAN_HEAD),
                         .n_plan = (const uint32_t *)at,
                         .n_max = b->max_seqs * b->plan_qpr[layer],
                         .dense_out = emit->dense, .dense_stride = b->plan_qpr[layer],
                         .pdiv = &ctx->pdiv, .csr = emit->layout != KVT_EMIT_TOKENS,
                         .first_csr = true, .capacity = emit->capacity,
                         .indices = emit->indices, .lengths = emit->lengths,
                         .indptr = emit->indptr};
    b->ran = true;
    b->stream = stream;
    s = b->be.ops->pack(&b->be, &pa, stream);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "packing the planned sets of layer %u", layer);
    /* the RoPE-recalling requests' rows, after the pack (which wrote their dense flags) */
    if (rope && (s = b->be.ops->recall_rope_emit_planned(&b->be, &rp, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "the planned RoPE recall lists of layer %u", layer);
    return KVT_OK;
}

kvt__backend *kvt__batch_backend(kvt_batch *b) {
    return &b->be;
}

kvt_status kvt_batch_run(kvt_batch *b, uint32_t layer, const void *query, void *stream,
                         const kvt_emit *emit) {
    if (!b)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_ctx *ctx = b->ctx;
    kvt_status s = enter_layer(b, layer, BATCH_PLANNED);
    if (s != KVT_OK)
        return s;
    if (!emit || emit->struct_size < KVT_EMIT_SIZE_MIN)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emit is NULL or its struct_size is below KVT_EMIT_SIZE_MIN");
    if (b->planned)
        return run_planned(b, layer, query, stream, emit);
    const bool tokens = emit->layout == KVT_EMIT_TOKENS;
    /* One list per (request, KV head) (docs/recall.md §9): CSR over n_seqs x n_kv entries. */
    const bool heads = emit->layout == KVT_EMIT_CSR_KV_HEADS;
    if (!tokens && !heads && emit->layout != KVT_EMIT_CSR)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emit.layout: unknown value %d",
                             (int)emit->layout);
    if (emit_arrays_missing(emit))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emit: %s is NULL",
                             tokens ? "indices or lengths" : "indices or indptr");
    const uint32_t S = emit_queries(emit);
    if (S > KVT_MAX_QUERIES_PER_SEQ)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emit.queries_per_seq: %u above %u", S,
                             KVT_MAX_QUERIES_PER_SEQ);
    if (heads && S > 1)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emit.layout KVT_EMIT_CSR_KV_HEADS takes one query per request "
                             "(queries_per_seq %u)",
                             S);
    const uint32_t n_kv = heads ? ctx->stores[layer].spec.n_kv_heads : 1;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        const kvt_seq *sq = b->seqs[i];
        if (!sq)
            continue;
        if ((s = kvt__seq_usable(sq)) != KVT_OK)
            return s;
        if (S < b->n_tokens[i] && b->n_tokens[i] > 1 && S > 1)
            return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                                 "seqs[%u] has %u query tokens, emit.queries_per_seq is %u", i,
                                 b->n_tokens[i], S);
        /* Per-token views of a multi-token step need its rows where they were written: a run of
         * this layer that already closed or compacted over all of them cannot give them. */
        if (S > 1 && b->n_tokens[i] > 1 && sq->stepped[layer] == KVT__STEP_WORKED)
            return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                                 "seqs[%u]: layer %u already ran this step's policy work over its "
                                 "%u tokens (a run with one query per request); per-token "
                                 "emission must come with the layer's first run",
                                 i, layer, b->n_tokens[i]);
    }

    /* 1. The layer's due work for every request (once per step). A request with drafts, or with
     * several query tokens emitted one by one, leaves it to the commit: its decisions then see
     * only the accepted rows, and each query token's view is the committed state plus the
     * step's rows up to its own. */
    bool fetches = false, rope = false;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        b->defer[i] = b->n_drafts[i] > 0 || (S > 1 && b->n_tokens[i] > 1);
        b->recall_way[i] = recall_way(b, i, layer, S);
        fetches |= b->recall_way[i] == RECALL_FETCH;
        rope |= b->seqs[i] && kvt__seq_recalls_rope(b->seqs[i], layer);
    }
    if (fetches && !query)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "query is NULL: requests of the batch recall on layer %u", layer);
    /* One KV head (MLA-RoPE, MQA): the per-head list is the request's list, so CSR is the
     * per-head layout and TOKENS takes it at the request's row (one query token per request). */
    const bool one_kv = ctx->stores[layer].spec.n_kv_heads == 1;
    if (rope && !heads && (!one_kv || S > 1))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "layer %u: requests of the batch recall on this RoPE layer: "
                             "emit.layout must be KVT_EMIT_CSR_KV_HEADS (%s)",
                             layer,
                             one_kv ? "TOKENS and CSR take one query per request here"
                                    : "its KV heads attend different rows");
    b->ran = true;
    b->stream = stream;
    s = kvt__seqs_step(ctx, b->seqs, b->defer, b->n_seqs, layer, &b->be, stream, b->steps,
                       b->step_seqs);
    if (s != KVT_OK)
        return s;

    /* 2. Capacity, then the attended sets: entry q = i * S + t is query token t of request i,
     * which sees the step's first min(t + 1, n_tokens[i]) rows (one query per request: all).
     * The host describes each set in O(1) (kvt__seq_step_query); the backend's pack writes the
     * slots into the emission arrays, which live in its memory space, in chunks of queries. */
    uint64_t total = 0;
    kvt__pack_query q[KVT__PACK_CHUNK];
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        const kvt_seq *sq = b->seqs[i];
        for (uint32_t t = 0; sq && t < S; t++) {
            kvt__seq_step_query(sq, layer, visible_rows(b, i, S, t), &q[0]);
            /* With recall the set may be every row of the view: what the host can promise (on a
             * RoPE layer: the held rows and the whole archive, the request's rows). */
            uint64_t n = b->recall_way[i] == RECALL_NONE ? kvt__attended_desc_count(&q[0].d)
                         : kvt__seq_recalls_rope(sq, layer) ? sq->n_tokens + sq->n_pending
                                                            : q[0].d.hi_end;
            n *= n_kv;
            if (tokens && n > emit->capacity)
                return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                                     "seqs[%u] attends %llu rows on layer %u, topk is %u; nothing "
                                     "written (kvt_batch_capacity)",
                                     i, (unsigned long long)n, layer, emit->capacity);
            total += n;
        }
    }
    if (!tokens && (total > emit->capacity || total > INT32_MAX))
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                             "the batch attends %llu rows on layer %u, capacity is %u; nothing "
                             "written (kvt_batch_capacity)",
                             (unsigned long long)total, layer, emit->capacity);
    const kvt__backend *be = &b->be;
    /* 3. The trigger (recall on): fetched rows and dense flags, in the backend's memory. */
    if ((s = run_recall(b, layer, query, stream, emit)) != KVT_OK)
        return s;
    kvt__pack_args pa = {.q = q, .pdiv = &ctx->pdiv, .csr = !tokens, .first_csr = !heads,
                         .dev_offsets = !tokens && fetches, .capacity = emit->capacity,
                         .indices = emit->indices, .lengths = emit->lengths,
                         .indptr = emit->indptr};
    if (heads || (rope && !tokens)) /* the lists are chained on the backend from indptr[0] */
        return emit_kv_heads(b, layer, n_kv, stream, emit, q, &pa);
    uint64_t off = 0;
    uint32_t k = 0, ne = 0;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        const kvt_seq *sq = b->seqs[i];
        if (sq && kvt__seq_recalls_rope(sq, layer)) { /* TOKENS, one KV head, S = 1 */
            if ((s = emit_rope_tokens(b, i, layer, emit, &ne)) != KVT_OK)
                return s;
            continue;
        }
        for (uint32_t t = 0; t < S; t++) {
            set_query(b, i, t, layer, S, emit, &off, &q[k]);
            if (++k == KVT__PACK_CHUNK && (s = flush_pack(b, layer, stream, &pa, &k)) != KVT_OK)
                return s;
        }
    }
    if (k && (s = flush_pack(b, layer, stream, &pa, &k)) != KVT_OK)
        return s;
    if ((s = flush_rope_emits(b, layer, stream, &ne)) != KVT_OK)
        return s;
    if (!tokens && b->n_seqs == 0 && (s = be->ops->write(be, emit->indptr, &(int32_t){0},
                                                         sizeof(int32_t), stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "emission of an empty batch");
    return KVT_OK;
}

kvt_status kvt_batch_commit(kvt_batch *b, const uint32_t *n_accepted) {
    if (!b)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_ctx *ctx = b->ctx;
    kvt__ctx_clear_error(ctx);
    if (b->state == BATCH_IDLE)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE, "no step to commit");
    for (uint32_t i = 0; n_accepted && i < b->n_seqs; i++) {
        if (!b->seqs[i])
            continue;
        if (n_accepted[i] > b->n_tokens[i])
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                 "n_accepted[%u] = %u, %u reserved; nothing committed", i,
                                 n_accepted[i], b->n_tokens[i]);
        if (n_accepted[i] < b->n_tokens[i] - b->n_drafts[i])
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                 "n_accepted[%u] = %u of %u reserved, of which %u are drafts: "
                                 "only drafts may be rejected (kvt_batch_reserve_drafts); "
                                 "nothing committed",
                                 i, n_accepted[i], b->n_tokens[i], b->n_drafts[i]);
    }
    kvt_status first_err = KVT_OK;
    char first_msg[KVT__ERR_LEN] = "";
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        kvt_seq *sq = b->seqs[i];
        if (!sq)
            continue;
        kvt_status s =
            kvt__seq_commit(sq, n_accepted ? n_accepted[i] : b->n_tokens[i], &b->be, b->stream);
        if (s != KVT_OK && first_err == KVT_OK) {
            first_err = s;
            snprintf(first_msg, sizeof first_msg, "seqs[%u] (request %llu): %s", i,
                     (unsigned long long)sq->request_id, kvt__tls_error());
        }
    }
    release_seqs(b, false);
    if (first_err != KVT_OK)
        return kvt__ctx_fail(ctx, first_err, "%s", first_msg);
    return KVT_OK;
}
