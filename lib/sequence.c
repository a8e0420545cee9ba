/* sequence.c — a request's lifecycle: create (a new request or a parked slot), its recall
 * state, destroy, and the plain queries (prompt rows, length, pages needed, usable). Validation of
 * everything from outside happens in lib/; the tier state machines live in tiers/, reached only
 * through each group's policy table (tiers/policy.h). The rest of a request: seq_fork.c (fork,
 * attach, copy on write), seq_step.c (reserve / write / commit, the attended set, the step's
 * queries and recall items), seq_inspect.c (rows by position, statistics, the invariant check);
 * what they share: seq_internal.h. */
#include "lib/seq_internal.h"

#include "kernels/philox.h"
#include "recall/kernels/recall_scan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kvt_status kvt__seq_layer_of(const kvt_seq *seq, uint32_t layer, const kvt__store **st) {
    const kvt_ctx *ctx = seq->ctx;
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "layer %u of %u", layer, ctx->n_layers);
    if (ctx->stores[layer].group < 0)
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH,
                             "layer %u (%s) stores no per-token KV", layer,
                             kvt_layer_kind_name(ctx->stores[layer].spec.kind));
    *st = &ctx->stores[layer];
    return KVT_OK;
}

/* layer_of, and a KV head of that layer. */
kvt_status kvt__seq_layer_head_of(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                  const kvt__store **st) {
    kvt_status s = kvt__seq_layer_of(seq, layer, st);
    if (s != KVT_OK)
        return s;
    if (head >= (*st)->spec.n_kv_heads)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_OUT_OF_RANGE, "head %u of %u (layer %u)", head,
                             (*st)->spec.n_kv_heads, layer);
    return KVT_OK;
}

kvt_seq_params kvt_seq_default_params(void) {
    kvt_seq_params p;
    memset(&p, 0, sizeof p);
    p.struct_size = sizeof p;
    p.recall = -1;
    return p;
}

kvt_status kvt_seq_params_init(kvt_seq_params *out, size_t struct_size) {
    const kvt_seq_params p = kvt_seq_default_params();
    return kvt__struct_init(out, struct_size, KVT_SEQ_PARAMS_SIZE_MIN, &p, sizeof p,
                            "kvt_seq_params");
}

/* Link a request into the context's live list. */
static void link_live(kvt_ctx *ctx, kvt_seq *seq) {
    seq->prev = NULL;
    seq->next = ctx->seqs;
    if (ctx->seqs)
        ctx->seqs->prev = seq;
    ctx->seqs = seq;
    ctx->n_live++;
}

static void unlink_live(kvt_ctx *ctx, kvt_seq *seq) {
    if (seq->prev)
        seq->prev->next = seq->next;
    else
        ctx->seqs = seq->next;
    if (seq->next)
        seq->next->prev = seq->prev;
    seq->prev = seq->next = NULL;
    ctx->n_live--;
}

const kvt_seq *kvt__ctx_live_request(const kvt_ctx *ctx, uint64_t request_id) {
    /* A walk of the live list: creates are scheduler calls, rare next to steps, and a context
     * holds at most a few thousand requests. */
    for (const kvt_seq *q = ctx->seqs; q; q = q->next)
        if (q->request_id == request_id)
            return q;
    return NULL;
}

/* The request's own fields from its parameters (a new request or a reused slot). */
static void bind_params(kvt_seq *seq, const kvt_seq_params *p, const kvt_config *cfg) {
    seq->cfg = *cfg;
    seq->request_id = p->request_id;
    seq->prompt_rows = p->prompt_rows;
    seq->philox_key = kvt__philox_key(seq->ctx->cfg.seed, p->request_id);
}

/* Build a request (allocating), linked live. On failure nothing is left and the message is
 * set. */
static kvt_status seq_build(kvt_ctx *ctx, const kvt_seq_params *p, const kvt_config *cfg,
                            kvt_seq **out) {
    const kvt__alloc *a = &ctx->alloc;
    kvt_seq *seq = kvt__calloc(a, sizeof *seq);
    if (!seq)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "sequence");
    seq->ctx = ctx;
    bind_params(seq, p, cfg);
    seq->layers = kvt__calloc(a, kvt__tier_state_bytes * ctx->n_layers);
    seq->stepped = kvt__calloc(a, 2u * ctx->n_layers);
    seq->recalled = seq->stepped ? seq->stepped + ctx->n_layers : NULL;
    if (!seq->layers || !seq->stepped) {
        kvt__free(a, seq->layers, kvt__tier_state_bytes * ctx->n_layers);
        kvt__free(a, seq->stepped, 2u * ctx->n_layers);
        kvt__free(a, seq, sizeof *seq);
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "sequence layers");
    }
    link_live(ctx, seq);
    /* A stated limit sizes the page tables now (the layers' state in layer_init below). */
    for (uint32_t g = 0; ctx->max_rows && g < ctx->n_groups; g++) {
        void *arr = seq->pt[g].pages;
        uint32_t pages = kvt__pages_for(ctx->max_rows, ctx->page_rows);
        if (kvt__grow(a, &arr, &seq->pt[g].cap, pages, sizeof *seq->pt[g].pages) != KVT_OK) {
            kvt__seq_free(seq);
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "page tables for %u rows",
                                 ctx->max_rows);
        }
        seq->pt[g].pages = arr;
        if (kvt__ptable_mirror_reserve(&seq->pt[g], &ctx->backend, pages) != KVT_OK) {
            kvt__seq_free(seq);
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY,
                                 "page table mirrors for %u rows in the backend's memory",
                                 ctx->max_rows);
        }
    }
    kvt__env env = kvt__ctx_env(ctx, seq, NULL);
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        if (ctx->stores[i].group < 0 || !kvt__seq_ops_of(ctx, i)->layer_init)
            continue;
        kvt_status s =
            kvt__seq_ops_of(ctx, i)->layer_init(kvt__seq_state(seq, i), &env, &ctx->stores[i]);
        if (s != KVT_OK) {
            kvt__seq_free(seq); /* leaves the message layer_init wrote */
            return s;
        }
    }
    *out = seq;
    return KVT_OK;
}

/* A parked slot back to the state of a new request with these parameters (its allocations
 * kept). On failure the slot is parked again and the message set. */
static kvt_status seq_reuse(kvt_ctx *ctx, kvt_seq *seq, const kvt_seq_params *p,
                            const kvt_config *cfg) {
    bind_params(seq, p, cfg);
    seq->n_tokens = 0;
    seq->n_pending = 0;
    seq->batch = NULL;
    seq->in_step = false;
    memset(seq->stepped, 0, 2u * ctx->n_layers);
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        kvt__ptable *t = &seq->pt[g];
        KVT_ASSERT(t->n_pages == 0);
        t->n_rows = 0;
        t->n_pending = 0;
        t->first_page = 0;
        t->dropped_rows = 0;
    }
    kvt__env env = kvt__ctx_env(ctx, seq, NULL);
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        if (ctx->stores[i].group < 0)
            continue;
        const kvt__policy_ops *ops = kvt__seq_ops_of(ctx, i);
        kvt_status s = KVT_OK;
        if (ops->layer_reset)
            s = ops->layer_reset(kvt__seq_state(seq, i), &env, &ctx->stores[i]);
        else if (!ops->layer_init)
            memset(kvt__seq_state(seq, i), 0, kvt__tier_state_bytes);
        else
            s = kvt__fail(env.err, env.err_len, KVT_ERR_INVARIANT,
                          "layer %u: a policy with state but no reset cannot reuse a slot", i);
        if (s != KVT_OK)
            return s;
    }
    link_live(ctx, seq);
    return KVT_OK;
}

bool kvt__seq_recalls(const kvt_seq *seq, uint32_t layer) {
    return seq->cfg.recall != KVT_RECALL_OFF && seq->recall && seq->recall[layer].buf;
}

bool kvt__seq_recalls_rope(const kvt_seq *seq, uint32_t layer) {
    return seq->cfg.recall != KVT_RECALL_OFF && seq->rrope && seq->rrope[layer].fbuf;
}

const kvt__recall_ops *kvt__seq_recall_of(const kvt_seq *seq, uint32_t layer, void **r) {
    if (kvt__seq_recalls(seq, layer))
        return *r = &seq->recall[layer], &kvt__recall_nope;
    if (kvt__seq_recalls_rope(seq, layer))
        return *r = &seq->rrope[layer], &kvt__recall_rope;
    *r = NULL;
    return NULL;
}

bool kvt__seq_recall_fetches(const kvt_seq *seq, uint32_t layer) {
    void *r;
    const kvt__recall_ops *ro = kvt__seq_recall_of(seq, layer, &r);
    return ro && ro->fetch_area;
}

kvt__recall_layer *kvt__seq_recall_base(const kvt_seq *seq, uint32_t layer) {
    void *r;
    const kvt__recall_ops *ro = kvt__seq_recall_of(seq, layer, &r);
    return ro ? ro->base(r) : NULL;
}

/* Can this context recall with the request's config? KVT_ERR_UNSUPPORTED with the reason. */
static kvt_status recall_supported(const kvt_ctx *ctx, const kvt_config *cfg) {
    if (cfg->recall == KVT_RECALL_OFF)
        return KVT_OK;
    if (ctx->sketch_rank == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "recall mode %d needs sketch planes: create the context with "
                             "params.recall_sketch_rank > 0",
                             (int)cfg->recall);
    if (!ctx->backend.ops->recall_step)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "recall mode %d: the %s backend has no recall step yet",
                             (int)cfg->recall, ctx->backend.ops->name);
    for (uint32_t i = 0; cfg->recall == KVT_RECALL_SOUND && i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        kvt_status s = kvt__sound_basis_check(ctx, i, st->rbasis.omega);
        for (uint32_t h = 0; s == KVT_OK && st->kb_omega && h < st->spec.n_kv_heads; h++)
            s = kvt__sound_basis_check(ctx, i, st->kb_omega[h]); /* RoPE key bases */
        if (s != KVT_OK)
            return s;
    }
    if (cfg->recall_promote_capacity && !ctx->backend.ops->recall_promote)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "config.recall_promote_capacity %u: the %s backend's recall step has "
                             "no promotion yet",
                             cfg->recall_promote_capacity, ctx->backend.ops->name);
    return KVT_OK;
}

kvt_status kvt__seq_recall_groups_reserve(kvt_seq *seq, uint32_t layer,
                                          const kvt__recall_ops *ro, void *r, uint64_t rows) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt_layer_spec *sp = &ctx->stores[layer].spec;
    const kvt__policy_ops *ops = kvt__layer_policy(ctx, layer);
    const kvt__recall_shape sh = {
        .rows = rows,
        .block_rows = seq->cfg.block_rows,
        .branch_dim = sp->branch_dim,
        .n_planes = sp->n_planes,
        .sketch_rank = ctx->sketch_rank,
        .archive_stride =
            ops->archive_sketch_stride ? ops->archive_sketch_stride(sp, ctx->sketch_rank) : 0,
        .archive_rows = ctx->archive_rows};
    return ro->groups_reserve(r, &ctx->backend, &sh);
}

/* The RoPE trigger's buffers (docs/recall.md §9) for every layer whose policy has an archive view
 * that the request's configuration gives something to recall from (archive, sketches); a layer
 * without (KVT_ERR_UNSUPPORTED from the view) does not recall, as a salience layer without
 * sketch planes. */
static kvt_status seq_rope_recall_prepare(kvt_seq *seq) {
    kvt_ctx *ctx = seq->ctx;
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        if (st->group < 0 || !kvt__seq_ops_of(ctx, i)->recall_rope_view)
            continue;
        kvt__tier_layer l = kvt__seq_tier_layer(seq, i);
        kvt__rope_view v;
        char msg[KVT__ERR_LEN];
        kvt_status s = kvt__recall_rope_view_of(&l, &v, msg, sizeof msg);
        if (s == KVT_ERR_UNSUPPORTED) {
            if (seq->rrope) /* a reused slot's, from a request that recalled here */
                kvt__recall_rope_fini(&seq->rrope[i], &ctx->backend);
            continue;
        }
        if (s != KVT_OK)
            return kvt__ctx_fail(ctx, s, "recall on layer %u: %s", i, msg);
        if (seq->cfg.recall_lagged_query)
            return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                 "recall on RoPE layer %u: config.recall_lagged_query is for "
                                 "salience (NoPE) recall layers only",
                                 i);
        if (!ctx->backend.ops->recall_rope_step || !ctx->backend.ops->recall_rope_emit)
            return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                 "recall on RoPE layer %u: the %s backend has no RoPE recall ops "
                                 "yet (recall_sketch_rank 0 or recall off on this context keeps "
                                 "its archive without recall)",
                                 i, ctx->backend.ops->name);
        if (!seq->rrope &&
            !(seq->rrope = kvt__calloc(&ctx->alloc, sizeof *seq->rrope * ctx->n_layers)))
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "recall state");
        if ((s = kvt__recall_rope_prepare(&seq->rrope[i], &ctx->backend, st->spec.n_q_heads,
                                          v.n_kv, seq->cfg.recall_cap_rows)) != KVT_OK)
            return kvt__ctx_fail(ctx, s, "recall state of RoPE layer %u (%u query heads, %u KV "
                                 "heads, W %u)",
                                 i, st->spec.n_q_heads, v.n_kv, seq->cfg.recall_cap_rows);
        if (ctx->max_rows && (s = kvt__seq_recall_groups_reserve(seq, i, &kvt__recall_rope,
                                                                 &seq->rrope[i], ctx->max_rows)) !=
                                 KVT_OK)
            return kvt__ctx_fail(ctx, s, "the recall scan's group planes of RoPE layer %u", i);
        /* A stated limit: the fetch area's page array and mirror sized now for the most it
         * holds (the request's rows; with a host archive W), so that no reserve allocates. */
        if (ctx->max_rows) {
            kvt__ptable *f = &seq->fetch[st->group];
            uint32_t rows = ctx->max_rows;
            if (ctx->archive_host && rows > seq->cfg.recall_cap_rows)
                rows = seq->cfg.recall_cap_rows;
            const uint32_t pages = kvt__pages_for(rows, ctx->page_rows);
            void *arr = f->pages;
            if ((s = kvt__grow(&ctx->alloc, &arr, &f->cap, pages, sizeof *f->pages)) != KVT_OK)
                return kvt__ctx_fail(ctx, s, "RoPE recall's fetch area for %u rows", rows);
            f->pages = arr;
            if ((s = kvt__ptable_mirror_reserve(f, &ctx->backend, pages)) != KVT_OK)
                return kvt__ctx_fail(ctx, s, "RoPE recall's fetch area mirror for %u rows", rows);
        }
    }
    return KVT_OK;
}

/* The trigger's buffers of a request with recall on, in their initial state (a request without
 * keeps what a slot had, unused). */
static kvt_status seq_recall_prepare(kvt_seq *seq) {
    kvt_ctx *ctx = seq->ctx;
    if (seq->cfg.recall == KVT_RECALL_OFF)
        return KVT_OK;
    if (!seq->recall) {
        seq->recall = kvt__calloc(&ctx->alloc, sizeof *seq->recall * ctx->n_layers);
        if (!seq->recall)
            return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "recall state");
    }
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        if (st->group < 0 || !kvt__seq_ops_of(ctx, i)->recall_view)
            continue;
        if (st->spec.value_dim <= 64 || st->spec.branch_dim > KVT__RECALL_MAX_BRANCH)
            return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                 "recall on layer %u: value_dim %u (must exceed 64) / branch_dim "
                                 "%u (at most %u) outside what the recall scan takes",
                                 i, st->spec.value_dim, st->spec.branch_dim,
                                 KVT__RECALL_MAX_BRANCH);
        if (st->spec.n_q_heads == 0 || st->spec.n_q_heads > 4096)
            return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                                 "recall on layer %u: its spec states %u query heads (1..4096)",
                                 i, st->spec.n_q_heads);
        kvt_status s = kvt__recall_layer_prepare(&seq->recall[i], &ctx->backend,
                                                 st->spec.n_q_heads, seq->cfg.recall_cap_rows,
                                                 seq->cfg.recall_promote_capacity);
        if (s == KVT_OK)
            s = kvt__recall_layer_lag_prepare(
                &seq->recall[i], &ctx->backend,
                seq->cfg.recall_lagged_query
                    ? st->spec.n_q_heads * (st->spec.value_dim + st->spec.branch_dim)
                    : 0);
        if (s == KVT_OK && ctx->max_rows) /* a stated limit: every block's planes now */
            s = kvt__seq_recall_groups_reserve(seq, i, &kvt__recall_nope, &seq->recall[i],
                                               ctx->max_rows);
        if (s != KVT_OK)
            return kvt__ctx_fail(ctx, s, "recall state of layer %u (%u heads, W %u)", i,
                                 st->spec.n_q_heads, seq->cfg.recall_cap_rows);
    }
    return seq_rope_recall_prepare(seq);
}

kvt_status kvt_seq_create(kvt_ctx *ctx, const kvt_seq_params *user, kvt_seq **out) {
    if (out)
        *out = NULL;
    if (!ctx || !out)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(ctx);
    kvt_seq_params p = kvt_seq_default_params();
    if (user) {
        kvt_status s = kvt__struct_in(&p, sizeof p, user, KVT_SEQ_PARAMS_SIZE_MIN, "seq params");
        if (s != KVT_OK)
            return s;
    }
    kvt_config cfg = ctx->cfg;
    if (p.ratio != 0)
        cfg.ratio = p.ratio;
    if (p.recall != -1)
        cfg.recall = (kvt_recall_mode)p.recall;
    char msg[KVT__ERR_LEN];
    kvt_status cs = kvt__config_in(&cfg, &cfg, msg, sizeof msg);
    if (cs != KVT_OK)
        return kvt__ctx_fail(ctx, cs, "seq params: %s", msg);
    if ((cs = recall_supported(ctx, &cfg)) != KVT_OK)
        return cs;
    if (kvt__ctx_live_request(ctx, p.request_id))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "request id %llu is already live in this context (an id keys the "
                             "request's random draws): destroy that request first or use "
                             "another id",
                             (unsigned long long)p.request_id);
    if (cfg.recall != KVT_RECALL_OFF)
        ctx->recall_seen = true;
    if (ctx->max_seqs && ctx->n_live >= ctx->max_seqs)
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                             "%u live requests: params.max_seqs is %u; destroy one first",
                             ctx->n_live, ctx->max_seqs);
    kvt_seq *slot = ctx->free_seqs;
    kvt_status s;
    if (!slot) {
        if ((s = seq_build(ctx, &p, &cfg, &slot)) != KVT_OK)
            return s;
    } else {
        ctx->free_seqs = slot->next;
        slot->next = NULL;
        if ((s = seq_reuse(ctx, slot, &p, &cfg)) != KVT_OK) {
            slot->next = ctx->free_seqs;
            ctx->free_seqs = slot;
            return s;
        }
    }
    if ((s = seq_recall_prepare(slot)) != KVT_OK) {
        kvt__seq_end(slot); /* parked again (a slot) or freed: in no batch yet */
        return s;
    }
    *out = slot;
    return KVT_OK;
}

void kvt__seq_free(kvt_seq *seq) {
    KVT_ASSERT(!seq->batch);
    kvt_ctx *ctx = seq->ctx;
    const kvt__alloc *a = &ctx->alloc;
    for (uint32_t g = 0; g < ctx->n_groups; g++)
        kvt__ptable_fini(&seq->pt[g], &ctx->groups[g].pool, a, &ctx->backend);
    for (uint32_t i = 0; seq->layers && i < ctx->n_layers; i++)
        if (ctx->stores[i].group >= 0 && kvt__seq_ops_of(ctx, i)->layer_fini)
            kvt__seq_ops_of(ctx, i)->layer_fini(kvt__seq_state(seq, i), a);
    kvt__free(a, seq->layers, kvt__tier_state_bytes * ctx->n_layers);
    kvt__free(a, seq->stepped, 2u * ctx->n_layers);
    kvt__free(a, seq->cow, sizeof *seq->cow * seq->cow_cap);
    for (uint32_t i = 0; seq->recall && i < ctx->n_layers; i++)
        kvt__recall_nope.fini(&seq->recall[i], &ctx->backend);
    kvt__free(a, seq->recall, seq->recall ? sizeof *seq->recall * ctx->n_layers : 0);
    for (uint32_t i = 0; seq->rrope && i < ctx->n_layers; i++)
        kvt__recall_rope.fini(&seq->rrope[i], &ctx->backend);
    kvt__free(a, seq->rrope, seq->rrope ? sizeof *seq->rrope * ctx->n_layers : 0);
    for (uint32_t g = 0; g < ctx->n_groups; g++)
        kvt__ptable_fini(&seq->fetch[g], &ctx->groups[g].pool, a, &ctx->backend);
    unlink_live(ctx, seq);
    kvt__free(a, seq, sizeof *seq);
}

kvt_status kvt__seq_slots_build(kvt_ctx *ctx) {
    kvt_seq_params p = kvt_seq_default_params();
    for (uint32_t k = 0; k < ctx->max_seqs; k++) {
        kvt_seq *seq;
        kvt_status s = seq_build(ctx, &p, &ctx->cfg, &seq);
        if (s != KVT_OK)
            return s;
        seq->slot = true;
        kvt__seq_end(seq); /* parks it */
    }
    return KVT_OK;
}

void kvt__seq_slots_free(kvt_ctx *ctx) {
    while (ctx->free_seqs) {
        kvt_seq *seq = ctx->free_seqs;
        ctx->free_seqs = seq->next;
        seq->next = NULL;
        link_live(ctx, seq); /* kvt__seq_free unlinks */
        kvt__seq_free(seq);
    }
}

void kvt__seq_end(kvt_seq *seq) {
    KVT_ASSERT(!seq->batch);
    kvt_ctx *ctx = seq->ctx;
    if (!seq->slot || ctx->destroying) {
        kvt__seq_free(seq);
        return;
    }
    /* A slot: every page goes back to the pool, the allocations stay for the next request;
     * what its policies share with other requests (prefix sharing) goes back to them. */
    for (uint32_t i = 0; i < ctx->n_layers; i++)
        if (ctx->stores[i].group >= 0 && kvt__seq_ops_of(ctx, i)->layer_unshare)
            kvt__seq_ops_of(ctx, i)->layer_unshare(kvt__seq_state(seq, i), &ctx->alloc);
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        kvt__ptable *t = &seq->pt[g];
        t->n_rows = 0;
        t->n_pending = 0;
        t->first_page = 0;
        kvt__ptable_trim(t, &ctx->groups[g].pool);
        seq->fetch[g].n_pending = 0; /* RoPE recall's fetch area: every page back */
        kvt__ptable_trim(&seq->fetch[g], &ctx->groups[g].pool);
    }
    unlink_live(ctx, seq);
    seq->next = ctx->free_seqs;
    ctx->free_seqs = seq;
}

/* The first layer whose policy says it is damaged (else: has used the prompt length), or
 * n_layers when none does. */
static uint32_t first_layer_with(const kvt_seq *seq, bool damaged) {
    const kvt_ctx *ctx = seq->ctx;
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        if (ctx->stores[i].group < 0)
            continue;
        const kvt__policy_ops *ops = kvt__seq_ops_of(ctx, i);
        bool (*holds)(const kvt__tier_state *) = damaged ? ops->damaged : ops->prompt_used;
        if (holds && holds(kvt__seq_state(seq, i)))
            return i;
    }
    return ctx->n_layers;
}

kvt_status kvt_seq_set_prompt_rows(kvt_seq *seq, uint64_t n_rows) {
    CHECK_SEQ(seq);
    if (first_layer_with(seq, false) < seq->ctx->n_layers)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_BAD_STATE,
                             "the prompt length cannot change after an eviction round ran");
    seq->prompt_rows = n_rows;
    return KVT_OK;
}

uint64_t kvt_seq_length(const kvt_seq *seq) {
    return seq ? seq->n_tokens : 0;
}

kvt_status kvt_seq_pages_needed(const kvt_seq *seq, uint32_t n_tokens, uint32_t *out) {
    CHECK_SEQ(seq);
    if (!out)
        return KVT_ERR_INVALID_ARGUMENT;
    const kvt_ctx *ctx = seq->ctx;
    uint64_t sum = 0;
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        const kvt__ptable *t = &seq->pt[g];
        uint64_t need =
            kvt__ptable_pages_for(t, t->n_rows + t->n_pending + n_tokens, ctx->page_rows);
        if (need > t->n_pages)
            sum += need - t->n_pages;
    }
    /* RoPE recall's fetch area of a group: sized at reserve to the request's rows (with a host
     * archive at most recall_cap_rows, as kvt__seq_reserve does), from the same pool. */
    bool fetch_counted[KVT__MAX_GROUPS] = {false};
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        if (!kvt__seq_recall_fetches(seq, i))
            continue;
        const uint32_t fg = (uint32_t)ctx->stores[i].group;
        if (fetch_counted[fg])
            continue;
        fetch_counted[fg] = true;
        const kvt__ptable *f = &seq->fetch[fg];
        uint64_t rows = seq->n_tokens + (uint64_t)n_tokens;
        if (ctx->archive_host && rows > seq->cfg.recall_cap_rows)
            rows = seq->cfg.recall_cap_rows;
        uint64_t need = kvt__ptable_pages_for(f, rows, ctx->page_rows);
        if (need > f->n_pages)
            sum += need - f->n_pages;
    }
    *out = sum > UINT32_MAX ? UINT32_MAX : (uint32_t)sum;
    return KVT_OK;
}

/* A sequence whose eviction compaction failed on the device cannot be used any more. */
static kvt_status check_usable(const kvt_seq *seq) {
    uint32_t i = first_layer_with(seq, true);
    if (i < seq->ctx->n_layers)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_BAD_STATE,
                             "request %llu was damaged by a device error during compaction of "
                             "layer %u; destroy it",
                             (unsigned long long)seq->request_id, i);
    return KVT_OK;
}

kvt_status kvt__seq_usable(const kvt_seq *seq) {
    return check_usable(seq);
}

kvt_ctx *kvt_seq_context(const kvt_seq *seq) {
    return seq ? seq->ctx : NULL;
}

uint64_t kvt_seq_request_id(const kvt_seq *seq) {
    return seq ? seq->request_id : 0;
}

uint32_t kvt_seq_pending(const kvt_seq *seq) {
    return seq ? seq->n_pending : 0;
}
