/* batch.c — one step of many requests: reserve (all or nothing, vLLM's slot_mapping), plan,
 * run per layer (the layer's due close or round, then the attended set into the caller's
 * fixed-capacity buffers), commit. The timeline is stated in kvtier.h; the per-request work is
 * seq_step.c's, the policy work tiers/' (through the policy tables). */
#include "batch_internal.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

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
    b->sites = kvt__calloc(a, sizeof *b->sites * ctx->n_layers);
    b->kinds = kvt__calloc(a, ctx->n_layers);
    for (uint32_t l = 0; b->sites && b->kinds && l < ctx->n_layers; l++) {
        const kvt__recall_ops *ro = kvt__ctx_recall_of(ctx, l, &b->sites[l]);
        b->kinds[l] = ro ? ro->kind : 0;
    }
    b->be = ctx->backend;
    kvt_status ws = ctx->backend.ops->workspace
                        ? ctx->backend.ops->workspace(&ctx->backend, ctx->ws_sigma_floats,
                                                      ctx->ws_topm_u32, &b->be)
                        : KVT_ERR_UNSUPPORTED;
    b->own_be = ws == KVT_OK;
    if (ws == KVT_ERR_UNSUPPORTED)
        b->be = ctx->backend; /* shared: one thread at a time on such a context */
    const bool sized = b->sites && b->kinds; /* what the image's layout reads */
    if (ws == KVT_OK && b->own_be && sized && kvt__batch_reserve_workspace(b) != KVT_OK)
        ws = KVT_ERR_OUT_OF_MEMORY;
    if (ws != KVT_ERR_OUT_OF_MEMORY && b->recall_ran && sized &&
        kvt__batch_eager_room(b, UINT32_MAX, 0, 0) != KVT_OK)
        ws = KVT_ERR_OUT_OF_MEMORY;
    if (!b->seqs || !b->n_tokens || !b->n_drafts || !b->n_slots || !b->defer || !b->steps ||
        !b->step_seqs || !b->recall_way || !b->itemized || !b->recall_ran || !b->sites ||
        !b->kinds ||
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
    kvt__free(a, b->sites, sizeof *b->sites * b->ctx->n_layers);
    kvt__free(a, b->kinds, b->ctx->n_layers);
    if (b->be.cap && b->be.ops->capture_end) { /* a capture never ended: its record goes */
        void *g = NULL;
        (void)b->be.ops->capture_end(&b->be, NULL, &g);
        if (g)
            b->be.ops->graph_free(&b->be, g);
    }
    kvt__batch_plan_free(b, &b->plan);
    kvt__batch_plan_free(b, &b->eager);
    kvt__free(a, b->plan_emit, sizeof *b->plan_emit * b->ctx->n_layers);
    if (b->own_be)
        b->be.ops->close(&b->be);
    kvt__free(a, b, sizeof *b);
}

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
        (void)kvt__batch_plan_fill(b, b->plan_emit, b->ctx->n_layers, b->stream, false, NULL);
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

/* Query tokens per request an emission asks for (FlashMLA's s_q): 1 for a struct from before
 * the field, and for 0. */
static uint32_t emit_queries(const kvt_emit *e) {
    return e->struct_size >= offsetof(kvt_emit, queries_per_seq) + sizeof e->queries_per_seq &&
                   e->queries_per_seq > 1
               ? e->queries_per_seq
               : 1;
}

/* A layout value kvt_batch_run knows. */
static bool emit_layout_known(kvt_emit_layout l) {
    return l == KVT_EMIT_TOKENS || l == KVT_EMIT_CSR || l == KVT_EMIT_CSR_KV_HEADS ||
           l == KVT_EMIT_PAGED;
}

/* The options an emission may take: known bits, per-request lengths with TOKENS only. */
static kvt_status emit_flags_ok(kvt_ctx *ctx, const kvt_emit *e, const char *name) {
    const uint64_t f = kvt__emit_flags(e);
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
           (e->layout == KVT_EMIT_PAGED && !kvt__emit_last_page_len(e));
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
                               : kvt__emit_flags(e) & KVT_EMIT_LENGTHS_PER_SEQ ? b->n_seqs
                                                                          : entries;
        s = user_array(b, tokens ? e->lengths : e->indptr, sizeof(int32_t) * n_len, what);
    }
    if (s == KVT_OK && e->layout == KVT_EMIT_PAGED) {
        snprintf(what, sizeof what, "%s.last_page_len", name);
        s = user_array(b, kvt__emit_last_page_len(e), sizeof(int32_t) * entries, what);
    }
    if (s == KVT_OK) {
        snprintf(what, sizeof what, "%s.dense", name);
        s = user_array(b, e->dense, b->n_seqs, what);
    }
    return s;
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
           kvt__emit_flags(a) == kvt__emit_flags(b) &&
           kvt__emit_last_page_len(a) == kvt__emit_last_page_len(b);
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
     * the plan cannot hold); kvt__batch_plan_fill checks the recall items against the plan's bound.
     */
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
                !kvt__seq_step_quiet(sq, l, kvt__batch_plan_kind(b, l) != 0))
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
            kinds[l] = kvt__batch_plan_kind(b, l);
            qpr[l] = emits[n_emits == 1 ? 0 : l].layout == KVT_EMIT_CSR_KV_HEADS
                         ? ctx->stores[l].spec.n_kv_heads
                         : 1u;
        }
        kvt_emit *pe = b->plan_emit ? b->plan_emit : kvt__calloc(&ctx->alloc, sizeof *pe * L);
        if (!pe || kvt__batch_plan_layout(b, &b->plan, kinds, qpr) != KVT_OK) {
            if (pe != b->plan_emit)
                kvt__free(&ctx->alloc, pe, sizeof *pe * L);
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "the batch's plan image");
        }
        b->plan_emit = pe;
    }
    /* 3. Room for the planned recall ops (a device's workspace: never grown in a capture), once:
     * the layers' bounds are the batch's for its life. */
    for (uint32_t l = 0; !b->plan_reserved && l < L; l++) {
        kvt__layer_run lr = {.planned = true};
        kvt__batch_plan_bounds(b, l, b->plan.kind[l], &lr);
        const kvt_status s = kvt__batch_reserve_recall(b, b->plan.kind[l], &lr);
        if (s != KVT_OK)
            return kvt__ctx_fail(ctx, s, "layer %u: workspace of the planned recall step", l);
    }
    b->plan_reserved = true;
    /* 4. Each layer's sets and the image; 5. the emissions' dense flags (0 where no request
     * recalls: the recall step writes the others'). */
    bool fits = true;
    kvt_status s = kvt__batch_plan_fill(b, emits, n_emits, stream, true, &fits);
    /* lagged queries: a planned step's op fills the buffers of the requests it planned */
    for (uint32_t i = 0; i < b->n_seqs; i++)
        for (uint32_t l = 0; b->seqs[i] && b->seqs[i]->recall && l < L; l++)
            kvt__batch_lag_settle(&b->seqs[i]->recall[l], s == KVT_OK && fits);
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
    const kvt__recall_ops *ro = kvt__recall_kinds[kvt__batch_plan_kind(b, layer)];
    if (ro && !query)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "query is NULL: a planned run of layer %u, where requests may "
                             "recall, holds the recall step (a graph replays it over steps "
                             "that recall)",
                             layer);
    kvt__layer_run lr = {.S = 1,
                         .qpr = b->plan.qpr[layer],
                         .planned = true,
                         .query_floats = ro ? ro->query_floats(&ctx->stores[layer].spec) *
                                                  b->max_seqs
                                            : 0};
    if (ro) {
        kvt_status s = user_array(b, query, sizeof(float) * lr.query_floats, "query");
        if (s != KVT_OK)
            return s;
    }
    kvt__batch_plan_bounds(b, layer, b->plan.kind[layer], &lr);
    b->ran = true;
    b->stream = stream;
    kvt_status s = kvt__batch_exec_layer(b, &b->plan, layer, query, stream, emit, &lr,
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
        *fits = kvt__batch_paged_query(ctx, layer, &q);
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
        b->recall_way[i] = kvt__batch_recall_way(b, i, layer, S, &rt);
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
    /* floats of the run's query the trigger items may read */
    const uint64_t qf = recalls ? ro->query_floats(&ctx->stores[layer].spec) * b->n_seqs : 0;
    if (recalls && (s = user_array(b, query, sizeof(float) * qf, "query")) != KVT_OK)
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
    if ((s = kvt__batch_eager_room(b, layer, S * n_kv, recalls ? ro->kind : 0)) != KVT_OK)
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
    kvt__layer_run lr = {.S = S, .qpr = n_kv, .query_floats = qf};
    return kvt__batch_run_eager(b, layer, query, stream, emit, recalls, &lr);
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
