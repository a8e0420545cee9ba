/* batch.c — one step of many requests: reserve (all or nothing, vLLM's slot_mapping), plan,
 * run per layer (the layer's due close or round, then the attended set into the caller's
 * fixed-capacity buffers), commit. The timeline is stated in kvtier.h; the per-request work is
 * seq_step.c's, the policy work tiers/' (through the policy tables). */
#include "handles.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

enum batch_state { BATCH_IDLE = 0, BATCH_RESERVED, BATCH_PLANNED };

/* A plan image: what every run of a layer does, in the backend's memory (dev) with its host image
 * (host). Layer l's part, from byte at[l] on: three counts (uint32: the pack queries at byte 0,
 * the trigger items at 4, the emission items at 8), from byte PLAN_HEAD on qcap[l] pack queries,
 * then on a layer of a recall kind max_seqs of the kind's trigger items and max_seqs of its
 * emission items (the recall table's item_bytes, emit_bytes; 64-byte aligned pieces). */
typedef struct plan_buf {
    uint8_t *dev, *host;
    size_t *at;     /* [n_layers + 1]: at[n_layers] is the image's size; NULL: not laid out */
    uint8_t *kind;  /* [n_layers]: the layer's recall kind (kvt__recall_kinds; 0: none) */
    uint32_t *qcap; /* [n_layers] */
    uint32_t *qpr;  /* [n_layers]: pack queries a request (the planned image's; the eager image
                     * holds max_seqs x qpr queries of any shape) */
} plan_buf;

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
    /* Recall: each request's way on the layer being run (RECALL_*), and which requests an eager
     * run's image gave a trigger item (their recall ran once the run succeeds). */
    uint8_t *recall_way;     /* [max_seqs] */
    uint8_t *itemized;       /* [max_seqs] */
    enum batch_state state;
    bool ran;            /* a run happened this step (the reservation can no longer be undone) */
    void *stream;        /* the stream of the step's last run: the commit's device work goes on
                          * it (NULL, the default stream, for a step without a run) */
    /* The backend the batch's runs and commit use: on the CPU and CUDA backends a handle with a
     * workspace of its own (own_be), so that runs and commits of distinct batches share no
     * scratch (kvtier.h, "Threads"); on the guarded backend a copy of the context's handle. */
    kvt__backend be;
    bool own_be;
    /* The step's description (plan_layer writes it, exec_layer runs it): the planned step's
     * image (kvt_batch_plan_device; laid out at the first planned step, never moved: a captured
     * run's launch points into it) and the eager runs' (laid out at the first run, grown when a
     * run needs more room). plan_emit[layer]: the emission a planned step's runs must pass. */
    plan_buf plan, eager;
    kvt_emit *plan_emit; /* [n_layers] */
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

/* The recall kind a planned step's runs of this layer hold (kvt_batch_plan_device; 0: none): the
 * layer's (kvt__ctx_recall_of) where requests may recall (ctx_may_recall), in a context that
 * states max_rows_per_seq (the bound of the ops' launch and workspace), on a backend with the
 * kind's ops; fixed when the batch's plan buffer is laid out (its first planned step), so that a
 * captured run has the ops whether or not the capture's step recalled; a layer that did not plan
 * them then never does (a step where a request recalls there is not plannable). A kind whose
 * emission lists the fetched rows (fetch_area: RoPE, docs/recall.md §9.4) is plannable with
 * KVT_EMIT_TOKENS (each request's row at a fixed place) or CSR_KV_HEADS. */
static uint8_t plan_kind(const kvt_batch *b, uint32_t layer) {
    const kvt_ctx *ctx = b->ctx;
    if (b->plan.kind)
        return b->plan.kind[layer];
    kvt__recall_site site;
    const kvt__recall_ops *ro = kvt__ctx_recall_of(ctx, layer, &site);
    return ro && ctx_may_recall(ctx) && ctx->max_rows && ro->be_has(&b->be) ? ro->kind : 0;
}

/* The recall kind requests may recall with on layer l of this context (0: none). */
static uint8_t layer_kind(const kvt_ctx *ctx, uint32_t l) {
    kvt__recall_site site;
    const kvt__recall_ops *ro = kvt__ctx_recall_of(ctx, l, &site);
    return ro ? ro->kind : 0;
}

static size_t align64(size_t x) {
    return (x + 63u) / 64u * 64u;
}

/* Where layer l's trigger items start in an image (after its pack queries). */
static size_t items_at(const plan_buf *p, uint32_t l) {
    return p->at[l] + align64(PLAN_HEAD + sizeof(kvt__pack_query) * p->qcap[l]);
}

/* Where a layer's emission items start (after its max_seqs trigger items; a layer of a recall
 * kind). */
static size_t emits_at(const kvt_batch *b, const plan_buf *p, uint32_t l) {
    return items_at(p, l) + align64(kvt__recall_kinds[p->kind[l]]->item_bytes * b->max_seqs);
}

static void plan_buf_free(kvt_batch *b, plan_buf *p) {
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
static kvt_status plan_buf_layout(kvt_batch *b, plan_buf *p, const uint8_t *kind,
                                  const uint32_t *qpr) {
    kvt_ctx *ctx = b->ctx;
    const kvt__alloc *a = &ctx->alloc;
    const uint32_t L = ctx->n_layers;
    plan_buf n = {.at = kvt__calloc(a, sizeof *n.at * (L + 1u)), .kind = kvt__calloc(a, L),
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
        plan_buf_free(b, &n);
        return KVT_ERR_OUT_OF_MEMORY;
    }
    plan_buf_free(b, p);
    *p = n;
    return KVT_OK;
}

/* Floats of one request's queries on a layer (kvt_batch_run's query). */
static size_t query_floats(const kvt_ctx *ctx, uint32_t layer) {
    const kvt_layer_spec *sp = &ctx->stores[layer].spec;
    return (size_t)sp->n_q_heads * (sp->value_dim + sp->branch_dim);
}

static kvt_status eager_room(kvt_batch *b, uint32_t l, uint32_t n_q, uint8_t kind);

static kvt_status reserve_workspace(kvt_batch *b);

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
    b->itemized = kvt__calloc(a, max_seqs);
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
    if (ws != KVT_ERR_OUT_OF_MEMORY && b->recall_ran && eager_room(b, UINT32_MAX, 0, 0) != KVT_OK)
        ws = KVT_ERR_OUT_OF_MEMORY;
    if (!b->seqs || !b->n_tokens || !b->n_drafts || !b->n_slots || !b->defer || !b->steps || !b->step_seqs ||
        !b->recall_way || !b->itemized || !b->recall_ran ||
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
    kvt__free(a, b->itemized, b->max_seqs);
    kvt__free(a, b->recall_ran, b->ctx->n_layers);
    if (b->be.cap && b->be.ops->capture_end) { /* a capture never ended: its record goes */
        void *g = NULL;
        (void)b->be.ops->capture_end(&b->be, NULL, &g);
        if (g)
            b->be.ops->graph_free(&b->be, g);
    }
    plan_buf_free(b, &b->plan);
    plan_buf_free(b, &b->eager);
    kvt__free(a, b->plan_emit, sizeof *b->plan_emit * b->ctx->n_layers);
    if (b->own_be)
        b->be.ops->close(&b->be);
    kvt__free(a, b, sizeof *b);
}

static kvt_status plan_fill(kvt_batch *b, const kvt_emit *emits, uint32_t n_emits, void *stream,
                            bool sync, bool *fits);

/* The batch forgets a destroyed request. */
static void batch_forget(kvt_batch *b, const kvt_seq *seq) {
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

/* kvt_seq_destroy lives here, with the batch membership it ends first: sequence.c's part
 * (kvt__seq_end) then parks or frees a request no batch names, so that the request's files never
 * call up into the batch's. */
void kvt_seq_destroy(kvt_seq *seq) {
    if (!seq)
        return;
    if (seq->batch) {
        batch_forget(seq->batch, seq);
        seq->batch = NULL;
    }
    kvt__seq_end(seq);
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

/* slot_mapping in either width: slots32 or slots64 (exactly one is used). */
static kvt_status slot_mapping(const kvt_batch *b, uint32_t layer, int32_t *slots32,
                               int64_t *slots64, uint32_t capacity, uint32_t *n) {
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
    if (total > 0 && !slots32 && !slots64)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "slots is NULL");
    uint64_t t = 0;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        const kvt_seq *sq = b->seqs[i];
        for (uint32_t j = 0; j < b->n_slots[i]; j++, t++) {
            int32_t slot = -1;
            if (sq)
                kvt_seq_reserved_slot(sq, layer, j, &slot);
            if (slots64)
                slots64[t] = slot;
            else
                slots32[t] = slot;
        }
    }
    return KVT_OK;
}

kvt_status kvt_batch_slot_mapping(const kvt_batch *b, uint32_t layer, int32_t *slots,
                                  uint32_t capacity, uint32_t *n) {
    return slot_mapping(b, layer, slots, NULL, capacity, n);
}

kvt_status kvt_batch_slot_mapping64(const kvt_batch *b, uint32_t layer, int64_t *slots,
                                    uint32_t capacity, uint32_t *n) {
    return slot_mapping(b, layer, NULL, slots, capacity, n);
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

static uint32_t visible_rows(const kvt_batch *b, uint32_t i, uint32_t S, uint32_t t) {
    return S == 1 || t >= b->n_tokens[i] ? b->n_tokens[i] : t + 1;
}

/* How a request's set is made on a layer: without recall; with the trigger's fetched rows (one
 * query token); every row (a request with recall whose step has several query tokens). *ro: the
 * request's recall table on the layer (NULL: none). */
enum { RECALL_NONE = 0, RECALL_FETCH = 1, RECALL_ALL = 2 };

static uint8_t recall_way(const kvt_batch *b, uint32_t i, uint32_t layer, uint32_t S,
                          const kvt__recall_ops **ro) {
    const kvt_seq *sq = b->seqs[i];
    void *r;
    *ro = sq ? kvt__seq_recall_of(sq, layer, &r) : NULL;
    if (!*ro)
        return RECALL_NONE;
    return b->n_tokens[i] <= 1 && !b->defer[i] && (S == 1 || b->n_tokens[i] == 1) ? RECALL_FETCH
                                                                                 : RECALL_ALL;
}

/* Query tokens per request an emission asks for (FlashMLA's s_q): 1 for a struct from before
 * the field, and for 0. */
static uint32_t emit_queries(const kvt_emit *e) {
    return e->struct_size >= offsetof(kvt_emit, queries_per_seq) + sizeof e->queries_per_seq &&
                   e->queries_per_seq > 1
               ? e->queries_per_seq
               : 1;
}

/* An emission's options (KVT_EMIT_*): 0 for a struct from before the field. */
static uint64_t emit_flags(const kvt_emit *e) {
    return e->struct_size >= offsetof(kvt_emit, flags) + sizeof e->flags ? e->flags : 0;
}

/* An emission's last_page_len (KVT_EMIT_PAGED): NULL for a struct from before the field. */
static int32_t *emit_last_page_len(const kvt_emit *e) {
    return e->struct_size >= offsetof(kvt_emit, last_page_len) + sizeof e->last_page_len
               ? e->last_page_len
               : NULL;
}

/* A layout value kvt_batch_run knows. */
static bool emit_layout_known(kvt_emit_layout l) {
    return l == KVT_EMIT_TOKENS || l == KVT_EMIT_CSR || l == KVT_EMIT_CSR_KV_HEADS ||
           l == KVT_EMIT_PAGED;
}

/* The options an emission may take: known bits, per-request lengths with TOKENS only. */
static kvt_status emit_flags_ok(kvt_ctx *ctx, const kvt_emit *e, const char *name) {
    const uint64_t f = emit_flags(e);
    if (f & ~KVT_EMIT_FLAGS_KNOWN)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "%s.flags: unknown bits 0x%llx", name,
                             (unsigned long long)(f & ~(uint64_t)KVT_EMIT_FLAGS_KNOWN));
    if ((f & KVT_EMIT_LENGTHS_PER_SEQ) && e->layout != KVT_EMIT_TOKENS)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "%s.flags: KVT_EMIT_LENGTHS_PER_SEQ needs the KVT_EMIT_TOKENS layout "
                             "(CSR has no lengths)",
                             name);
    return KVT_OK;
}

/* An emission's arrays its layout needs are missing (indices may be NULL at capacity 0). */
static bool emit_arrays_missing(const kvt_emit *e) {
    const bool tokens = e->layout == KVT_EMIT_TOKENS;
    return (tokens ? !e->lengths : !e->indptr) || (!e->indices && e->capacity > 0) ||
           (e->layout == KVT_EMIT_PAGED && !emit_last_page_len(e));
}

/* What emit_arrays_missing found missing, for the message. */
static const char *emit_arrays_named(const kvt_emit *e) {
    return e->layout == KVT_EMIT_TOKENS  ? "indices or lengths"
           : e->layout == KVT_EMIT_PAGED ? "indices, indptr or last_page_len (or a struct_size "
                                           "that ends before last_page_len)"
                                         : "indices or indptr";
}

/* An array the engine hands a run (what names it), of bytes the run may read or write: in the
 * backend's memory where the backend tells (ops->holds: the guarded backend), else the
 * caller's error, found before any work rather than by the op that would touch it. */
static kvt_status user_array(kvt_batch *b, const void *p, size_t bytes, const char *what) {
    const kvt__backend *be = &b->be;
    if (!p || !be->ops->holds || be->ops->holds(be, p, bytes))
        return KVT_OK;
    return kvt__ctx_fail(b->ctx, KVT_ERR_INVALID_ARGUMENT,
                         "%s: %zu bytes at %p are not in the %s backend's memory (pass "
                         "kvt_buffer memory: kvt_buffer_alloc, kvt_buffer_ptr)",
                         what, bytes, p, be->ops->name);
}

/* The emission's arrays (name: "emit" or "emits[l]"), as user_array, at what this step writes:
 * entries sets (requests x query tokens x KV heads' lists). */
static kvt_status emit_reachable(kvt_batch *b, const kvt_emit *e, const char *name,
                                 uint64_t entries) {
    char what[48];
    const bool tokens = e->layout == KVT_EMIT_TOKENS;
    kvt_status s = KVT_OK;
    snprintf(what, sizeof what, "%s.indices", name);
    s = user_array(b, e->indices, sizeof(int32_t) * (tokens ? entries * e->capacity : e->capacity),
                   what);
    if (s == KVT_OK) {
        snprintf(what, sizeof what, "%s.%s", name, tokens ? "lengths" : "indptr");
        const uint64_t n_len = !tokens ? entries + 1
                               : emit_flags(e) & KVT_EMIT_LENGTHS_PER_SEQ ? b->n_seqs
                                                                          : entries;
        s = user_array(b, tokens ? e->lengths : e->indptr, sizeof(int32_t) * n_len, what);
    }
    if (s == KVT_OK && e->layout == KVT_EMIT_PAGED) {
        snprintf(what, sizeof what, "%s.last_page_len", name);
        s = user_array(b, emit_last_page_len(e), sizeof(int32_t) * entries, what);
    }
    if (s == KVT_OK) {
        snprintf(what, sizeof what, "%s.dense", name);
        s = user_array(b, e->dense, b->n_seqs, what);
    }
    return s;
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
    else if (emit_flags(emit) & KVT_EMIT_LENGTHS_PER_SEQ) /* the last token's: the most rows */
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
static bool paged_query(const kvt_ctx *ctx, uint32_t layer, kvt__pack_query *pq) {
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

/* The emission a planned step may use: TOKENS or CSR, one query per request, arrays given. */
static kvt_status plan_emit_ok(kvt_ctx *ctx, const kvt_emit *e, uint32_t l) {
    if (e->struct_size < KVT_EMIT_SIZE_MIN)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emits[%u].struct_size is below KVT_EMIT_SIZE_MIN", l);
    if (!emit_layout_known(e->layout))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emits[%u].layout: unknown value %d",
                             l, (int)e->layout);
    if (emit_queries(e) > 1)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emits[%u].queries_per_seq: a planned step has one query per "
                             "request", l);
    if (emit_arrays_missing(e))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emits[%u]: %s is NULL", l,
                             emit_arrays_named(e));
    char name[24];
    snprintf(name, sizeof name, "emits[%u]", l);
    return emit_flags_ok(ctx, e, name);
}

/* Does a planned step's run of this layer get the emission it was planned for? */
static bool same_emit(const kvt_emit *a, const kvt_emit *b) {
    return a->layout == b->layout && a->indices == b->indices && a->capacity == b->capacity &&
           a->lengths == b->lengths && a->indptr == b->indptr && a->dense == b->dense &&
           emit_flags(a) == emit_flags(b) && emit_last_page_len(a) == emit_last_page_len(b);
}

/* ------------------------------------------------------------------------------------------
 * One description of a step. plan_layer writes what a run of layer l does into a plan image
 * (its pack queries, the NoPE recall items or the RoPE trigger and emission items) and
 * exec_layer runs the image through the backend's buffer-fed ops: the recall step, the pack,
 * the RoPE emission. An eager run (kvt_batch_run without kvt_batch_plan_device) does the
 * layer's policy work, then plans the layer into the eager image and executes it;
 * kvt_batch_plan_device plans every layer into the planned image once, and each planned run
 * executes its layer's part (the arguments of its ops hold nothing of one step, so a captured
 * run replays over later planned steps).
 * ------------------------------------------------------------------------------------------ */

/* One run's shape (plan_layer's arguments beside the emission) and what it planned. */
typedef struct layer_run {
    uint32_t S;            /* query tokens a request (a planned step: 1) */
    uint32_t qpr;          /* lists a query token: KVT_EMIT_CSR_KV_HEADS's KV heads, else 1 */
    bool planned;          /* the planned image: every fetching request has its items (the op
                            * runs once per step), the bounds are the context's; an item outside
                            * them makes the step not plannable */
    bool first;            /* planned: the step's first image (a lagged query is fixed then) */
    uint64_t query_floats; /* floats of the run's query buffer the items may read */
    uint32_t n_q;          /* out: pack queries */
    uint32_t n_recall;     /* out: trigger items */
    uint32_t n_emit;       /* out: emission items */
    kvt__recall_bound bound; /* the items' bound (the layer's recall kind's) */
} layer_run;

/* Refuse the image: a planned one that breaks its bound is not plannable (*fits false, KVT_OK;
 * fits NULL, a plan rewritten for the same step: KVT_ERR_INVARIANT); an eager one fails with s. */
static kvt_status plan_refuse(const kvt_batch *b, const layer_run *lr, bool *fits, kvt_status s,
                              const char *fmt, ...) {
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
static void plan_bounds(const kvt_batch *b, uint32_t l, uint8_t kind, layer_run *lr) {
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
    kvt__recall_site site;
    kvt__ctx_recall_site(ctx, l, &site);
    (void)ro->bound(&site, rows, prom, lr->planned, &lr->bound);
}

/* Room for layer l's recall ops of `kind` (0: none; the kind's reserve) for max_seqs items
 * within lr's bound: a device's workspace, made outside any capture. */
static kvt_status reserve_recall(const kvt_batch *b, uint8_t kind, const layer_run *lr) {
    const kvt__recall_ops *ro = kvt__recall_kinds[kind];
    return ro ? ro->reserve(&b->be, b->max_seqs, &lr->bound) : KVT_OK;
}

/* After the recall items of a run or a plan: a request whose item copies its queries into its
 * lagged buffer holds a query from then on when they ran (ok), and the item is settled. */
static void lag_settle(kvt__recall_layer *r, bool ok) {
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
static kvt_status reserve_workspace(kvt_batch *b) {
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
        const uint8_t kind = ctx_may_recall(ctx) ? layer_kind(ctx, l) : 0;
        layer_run lr = {.planned = true};
        plan_bounds(b, l, kind, &lr);
        if (s == KVT_OK)
            s = reserve_recall(b, kind, &lr);
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
                                  const layer_run *lr, const kvt__recall_ops *ro, void *r,
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

/* Layer l's run into image pb: every request's recall items and sets as the run describes them
 * (b->recall_way set; nothing of the step moves rows), after the capacity checks. The image's
 * host copy only: nothing goes to the backend. The items and pack queries are the recall table's
 * of the layer's kind (pb->kind[l]). */
static kvt_status plan_layer(kvt_batch *b, const plan_buf *pb, uint32_t l, const kvt_emit *e,
                             layer_run *lr, bool *fits) {
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
        /* items once per step and layer: a second run of the layer emits what the first fetched
         * (the fetch buffer and the state's dense flag are unchanged) */
        const bool trigger = way == RECALL_FETCH && (lr->planned || !sq->recalled[l]);
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
            kvt_status s = ro->items(&rq, trigger, items + (size_t)nr * ro->item_bytes, em, &has);
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
            if (e->layout == KVT_EMIT_PAGED && !paged_query(ctx, l, &q[n]))
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
        if (b->recall_way[i] != RECALL_FETCH || !(lr->planned || !sq->recalled[l]) ||
            kvt__seq_recall_of(sq, l, &r) != lo)
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

/* Layer l's part of image pb to the backend, on stream (the host image as plan_layer left it:
 * its counts, queries and items). */
static kvt_status plan_write_layer(kvt_batch *b, const plan_buf *pb, uint32_t l,
                                   const layer_run *lr, void *stream) {
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
static kvt_status exec_layer(kvt_batch *b, const plan_buf *pb, uint32_t l, const float *query,
                             void *stream, const kvt_emit *emit, const layer_run *lr,
                             bool trigger) {
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
            s = reserve_recall(b, pb->kind[l], lr);
        if (trigger && (s != KVT_OK || (s = ro->step(be, &run, stream)) != KVT_OK))
            return kvt__ctx_fail(ctx, s, "the %s step of layer %u", ro->name, l);
    }
    const kvt__pack_args pa = {.q_plan = (const kvt__pack_query *)(at + PLAN_HEAD),
                               .n_plan = counts, .n_max = lr->planned ? pb->qcap[l] : lr->n_q,
                               .dense_out = emit->dense, .dense_stride = lr->S * lr->qpr,
                               .pdiv = &ctx->pdiv, .csr = emit->layout != KVT_EMIT_TOKENS,
                               .first_csr = true, .capacity = emit->capacity,
                               .indices = emit->indices, .lengths = emit->lengths,
                               .indptr = emit->indptr, .last_page_len = emit_last_page_len(emit)};
    if ((s = be->ops->pack(be, &pa, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "packing the attended sets of layer %u", l);
    /* the fetch-area requests' rows, after the pack (which wrote their dense flags and, in CSR,
     * their lists' offsets) */
    if (ro && ro->emit && (lr->planned || lr->n_emit) &&
        (s = ro->emit(be, &run, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "the %s lists of layer %u", ro->name, l);
    return KVT_OK;
}

/* Floats of one request's queries on layer l as its recall (of table ro; NULL: the pack's
 * shape) reads them. */
static size_t run_query_floats(const kvt_batch *b, uint32_t l, const kvt__recall_ops *ro) {
    const kvt_layer_spec *sp = &b->ctx->stores[l].spec;
    return ro ? (size_t)ro->query_floats(sp) : query_floats(b->ctx, l);
}

/* The eager image with room for layer l's run of n_q queries a request and, where requests
 * recall there, its kind of items (l = UINT32_MAX: none, the first layout). Laid out when the
 * batch is created, every layer with its KV heads' lists a request and the items of the recall
 * its requests may do (kvt__ctx_recall_of); grown when a run needs more (several query tokens a
 * request: KVT_ERR_OUT_OF_MEMORY leaves it unchanged). */
static kvt_status eager_room(kvt_batch *b, uint32_t l, uint32_t n_q, uint8_t kind) {
    kvt_ctx *ctx = b->ctx;
    const uint32_t L = ctx->n_layers;
    plan_buf *p = &b->eager;
    if (p->at && l < L && p->qpr[l] >= n_q && (kind == 0 || p->kind[l] == kind))
        return KVT_OK;
    uint8_t kinds[L ? L : 1];
    uint32_t qpr[L ? L : 1];
    for (uint32_t k = 0; k < L; k++) {
        const uint32_t kv = ctx->stores[k].spec.n_kv_heads;
        kinds[k] = p->at ? p->kind[k] : layer_kind(ctx, k);
        qpr[k] = p->at ? p->qpr[k] : kv > 1 ? kv : 1;
    }
    if (l < L && kind)
        kinds[l] = kind;
    if (l < L && n_q > qpr[l])
        qpr[l] = n_q;
    kvt_status s = plan_buf_layout(b, p, kinds, qpr);
    return s == KVT_OK ? KVT_OK : kvt__ctx_fail(ctx, s, "the batch's plan image for its runs");
}

/* Every layer's sets of the planned step into the planned image, as each run would describe
 * them (nothing of the step moves rows), with kvt_batch_run's capacity checks (sync: the page
 * tables' new entries to the backend first), then the image to the backend on stream. A recall
 * item outside its layer's bound: *fits false, KVT_OK, nothing written to the backend (the step
 * is not plannable); fits NULL (a plan rewritten for the same step): KVT_ERR_INVARIANT. */
static kvt_status plan_fill(kvt_batch *b, const kvt_emit *emits, uint32_t n_emits, void *stream,
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
            b->recall_way[i] = recall_way(b, i, l, 1, &ro);
        }
        layer_run lr = {.S = 1, .qpr = b->plan.qpr[l], .planned = true, .first = fits != NULL};
        plan_bounds(b, l, b->plan.kind[l], &lr);
        kvt_status s = plan_layer(b, &b->plan, l, e, &lr, fits);
        if (s != KVT_OK || (fits && !*fits))
            return s;
    }
    kvt_status s = be->ops->write(be, b->plan.dev, b->plan.host, b->plan.at[L], stream);
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
    /* The array's stride is the caller's struct_size (an older caller's elements are smaller
     * than this kvt_emit): each element is read at that stride, its struct_size bytes only, into
     * a copy whose later fields are zero; every element must state the same size. */
    const size_t stride = emits->struct_size;
    if (stride < KVT_EMIT_SIZE_MIN)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "emits[0].struct_size is below KVT_EMIT_SIZE_MIN");
    kvt_emit norm[n_emits];
    for (uint32_t l = 0; l < n_emits; l++) {
        const kvt_emit *src = (const kvt_emit *)((const uint8_t *)emits + stride * l);
        if (src->struct_size != stride)
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                 "emits[%u].struct_size is %zu, emits[0]'s %zu (the array's "
                                 "stride: every element the same struct)",
                                 l, src->struct_size, stride);
        memset(&norm[l], 0, sizeof norm[l]);
        memcpy(&norm[l], src, stride < sizeof norm[l] ? stride : sizeof norm[l]);
    }
    emits = norm;
    for (uint32_t l = 0; l < n_emits; l++) {
        char name[24];
        snprintf(name, sizeof name, "emits[%u]", l);
        kvt_status s = plan_emit_ok(ctx, &emits[l], l);
        if (s == KVT_OK)
            s = emit_reachable(b, &emits[l], name,
                               (uint64_t)b->n_seqs *
                                   (emits[l].layout == KVT_EMIT_CSR_KV_HEADS && n_emits == L
                                        ? ctx->stores[l].spec.n_kv_heads
                                        : 1)); /* one for all: the least any layer writes */
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
            if (ctx->stores[l].group >= 0 && !kvt__seq_step_quiet(sq, l, plan_kind(b, l) != 0))
                return KVT_OK;
    }
    /* 2. The image, at the first planned step: every layer's counts, max_seqs queries a list
     * and the recall items. A later planned step must pass that step's emissions: a graph
     * captured over planned runs holds their arrays and capacities, which the plan's offsets
     * must fit. */
    const kvt__backend *be = &b->be;
    for (uint32_t l = 0; b->planned_once && l < L; l++)
        if (!same_emit(&emits[n_emits == 1 ? 0 : l], &b->plan_emit[l]))
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                 "emits[%u]: not the emission of the batch's first planned step "
                                 "(a graph captured over planned runs writes those arrays; plan "
                                 "other emissions on another batch)",
                                 n_emits == 1 ? 0 : l);
    if (!b->plan.at) {
        uint8_t kinds[L ? L : 1];
        uint32_t qpr[L ? L : 1];
        for (uint32_t l = 0; l < L; l++) {
            kinds[l] = plan_kind(b, l);
            qpr[l] = emits[n_emits == 1 ? 0 : l].layout == KVT_EMIT_CSR_KV_HEADS
                         ? ctx->stores[l].spec.n_kv_heads
                         : 1u;
        }
        kvt_emit *pe = b->plan_emit ? b->plan_emit : kvt__calloc(&ctx->alloc, sizeof *pe * L);
        if (!pe || plan_buf_layout(b, &b->plan, kinds, qpr) != KVT_OK) {
            if (pe != b->plan_emit)
                kvt__free(&ctx->alloc, pe, sizeof *pe * L);
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "the batch's plan image");
        }
        b->plan_emit = pe;
    }
    /* 3. Room for the planned recall ops (a device's workspace: never grown in a capture), once:
     * the layers' bounds are the batch's for its life. */
    for (uint32_t l = 0; !b->plan_reserved && l < L; l++) {
        layer_run lr = {.planned = true};
        plan_bounds(b, l, b->plan.kind[l], &lr);
        const kvt_status s = reserve_recall(b, b->plan.kind[l], &lr);
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
        for (uint32_t l = 0; b->seqs[i] && b->seqs[i]->recall && l < L; l++)
            lag_settle(&b->seqs[i]->recall[l], s == KVT_OK && fits);
    if (s != KVT_OK || !fits)
        return s;
    uint8_t *zeros = b->itemized; /* max_seqs bytes of host scratch */
    memset(zeros, 0, b->n_seqs);
    for (uint32_t l = 0; s == KVT_OK && l < n_emits; l++)
        if (emits[l].dense && b->n_seqs)
            s = be->ops->write(be, emits[l].dense, zeros, b->n_seqs, stream);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "the step's plan to the backend");
    b->planned = true;
    b->planned_once = true;
    b->stream = stream;
    *planned = true;
    return KVT_OK;
}

/* A planned step's run: layer l's part of the planned image (its recall step once per step and
 * layer, the pack, a RoPE layer's emission); the policy work is the commit's. */
static kvt_status run_planned(kvt_batch *b, uint32_t layer, const float *query, void *stream,
                              const kvt_emit *emit) {
    kvt_ctx *ctx = b->ctx;
    if (!same_emit(emit, &b->plan_emit[layer]))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "layer %u: emit is not the one kvt_batch_plan_device planned for",
                             layer);
    const kvt__recall_ops *ro = kvt__recall_kinds[plan_kind(b, layer)];
    if (ro && !query)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "query is NULL: a planned run of layer %u, where requests may "
                             "recall, holds the recall step (a graph replays it over steps "
                             "that recall)",
                             layer);
    layer_run lr = {.S = 1, .qpr = b->plan.qpr[layer], .planned = true,
                    .query_floats = run_query_floats(b, layer, ro) * b->max_seqs};
    if (ro) {
        kvt_status s = user_array(b, query, sizeof(float) * lr.query_floats, "query");
        if (s != KVT_OK)
            return s;
    }
    plan_bounds(b, layer, b->plan.kind[layer], &lr);
    b->ran = true;
    b->stream = stream;
    kvt_status s = exec_layer(b, &b->plan, layer, query, stream, emit, &lr,
                              b->recall_ran[layer] == 0);
    if (s == KVT_OK)
        b->recall_ran[layer] = 1; /* the recall step once per step and layer */
    return s;
}

kvt_status kvt_batch_emit_fits(const kvt_batch *b, uint32_t layer, kvt_emit_layout layout,
                               bool *fits) {
    if (!b || !fits)
        return KVT_ERR_INVALID_ARGUMENT;
    *fits = false;
    kvt_ctx *ctx = b->ctx;
    kvt_status s = enter_layer(b, layer, BATCH_PLANNED); /* kvt_batch_run's statuses */
    if (s != KVT_OK)
        return s;
    if (!emit_layout_known(layout))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "layout: unknown value %d",
                             (int)layout);
    *fits = true;
    if (layout != KVT_EMIT_PAGED)
        return KVT_OK;
    /* full attention and random eviction attend every row of their table, after any round */
    const bool whole = kvt__layer_policy(ctx, layer)->attended == kvt__none_attended;
    for (uint32_t i = 0; i < b->n_seqs && *fits; i++) {
        kvt_seq *sq = b->seqs[i];
        if (!sq)
            continue;
        void *r;
        if (kvt__seq_recall_of(sq, layer, &r) ||
            (!whole && !sq->stepped[layer] && !kvt__seq_step_quiet(sq, layer, false))) {
            *fits = false; /* fetched rows; a close due, after which the set is known */
            break;
        }
        kvt__pack_query q;
        kvt__seq_step_query(sq, layer, b->n_tokens[i], &q);
        *fits = paged_query(ctx, layer, &q);
    }
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
    /* One list per (request, KV head) (docs/recall.md §9): CSR over n_seqs x n_kv entries. */
    const bool heads = emit->layout == KVT_EMIT_CSR_KV_HEADS;
    if (!emit_layout_known(emit->layout))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emit.layout: unknown value %d",
                             (int)emit->layout);
    if (emit_arrays_missing(emit))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "emit: %s is NULL",
                             emit_arrays_named(emit));
    if ((s = emit_flags_ok(ctx, emit, "emit")) != KVT_OK)
        return s;
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
    if ((s = emit_reachable(b, emit, "emit", (uint64_t)b->n_seqs * S * n_kv)) != KVT_OK)
        return s;
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
    bool fetches = false;
    const kvt__recall_ops *ro = NULL; /* the layer's recall table, where a request recalls */
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        const kvt__recall_ops *rt;
        b->defer[i] = b->n_drafts[i] > 0 || (S > 1 && b->n_tokens[i] > 1);
        b->recall_way[i] = recall_way(b, i, layer, S, &rt);
        fetches |= b->recall_way[i] == RECALL_FETCH;
        ro = rt ? rt : ro;
    }
    const bool recalls = ro != NULL, area = ro && ro->fetch_area;
    if (emit->layout == KVT_EMIT_PAGED && (fetches || area))
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "layer %u: a request of the batch recalls there (single rows "
                             "fetched), which KVT_EMIT_PAGED cannot list (TOKENS or CSR can; "
                             "kvt_batch_emit_fits); nothing done",
                             layer);
    if (fetches && !query)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "query is NULL: requests of the batch recall on layer %u", layer);
    if (recalls && (s = user_array(b, query,
                                   sizeof(float) * run_query_floats(b, layer, ro) * b->n_seqs,
                                   "query")) != KVT_OK)
        return s;
    /* A fetch area's lists are per KV head (RoPE). One KV head (MLA-RoPE, MQA): the per-head
     * list is the request's list, so CSR is the per-head layout and TOKENS takes it at the
     * request's row (one query token per request). */
    const bool one_kv = ctx->stores[layer].spec.n_kv_heads == 1;
    if (area && !heads && (!one_kv || S > 1))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "layer %u: requests of the batch recall on this %s: "
                             "emit.layout must be KVT_EMIT_CSR_KV_HEADS (%s)",
                             layer, ro->layer_noun,
                             one_kv ? "TOKENS and CSR take one query per request here"
                                    : "its KV heads attend different rows");
    if (recalls && !ro->be_has(&b->be))
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED, "layer %u: the %s backend has no %s ops",
                             layer, b->be.ops->name, ro->name);
    if ((s = eager_room(b, layer, S * n_kv, recalls ? ro->kind : 0)) != KVT_OK)
        return s;
    b->ran = true;
    b->stream = stream;
    s = kvt__seqs_step(ctx, b->seqs, b->defer, b->n_seqs, layer, &b->be, stream, b->steps,
                       b->step_seqs);
    if (s != KVT_OK)
        return s;

    /* 2. The run's description (capacity first: nothing written when it fails), then its
     * execution: entry q = i * S + t is query token t of request i, which sees the step's first
     * min(t + 1, n_tokens[i]) rows (one query per request: all). */
    layer_run lr = {.S = S, .qpr = n_kv,
                    .query_floats = run_query_floats(b, layer, ro) * b->n_seqs};
    plan_bounds(b, layer, recalls ? b->eager.kind[layer] : 0, &lr);
    s = plan_layer(b, &b->eager, layer, emit, &lr, NULL);
    if (s == KVT_OK)
        s = plan_write_layer(b, &b->eager, layer, &lr, stream);
    if (s == KVT_OK)
        s = exec_layer(b, &b->eager, layer, query, stream, emit, &lr, lr.n_recall > 0);
    /* the requests whose recall ran: once per step and layer; config.recall_lagged_query: the
     * op copied this step's queries, the next step's */
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        kvt_seq *sq = b->seqs[i];
        if (!sq || !b->itemized[i])
            continue;
        if (s == KVT_OK)
            sq->recalled[layer] = 1;
        lag_settle(kvt__seq_recall_base(sq, layer), s == KVT_OK); /* (no lagged query: no-op) */
    }
    return s;
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
