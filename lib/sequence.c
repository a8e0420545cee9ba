/* sequence.c — a request's lifecycle: reserve / write / commit, the attended set, rows by
 * position, statistics and the invariant check. Validation of everything from outside happens
 * here; the tier state machines live in tiers/, reached only through each group's policy table
 * (tiers/policy.h). */
#include "handles.h"

#include "kernels/philox.h"
#include "kernels/recall_scan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK_SEQ(seq)                                                                             \
    do {                                                                                           \
        if (!(seq))                                                                                \
            return KVT_ERR_INVALID_ARGUMENT;                                                       \
        kvt__ctx_clear_error((seq)->ctx);                                                          \
    } while (0)

static kvt_status check_usable(const kvt_seq *seq);

/* CHECK_SEQ for calls that change a sequence: a damaged one only accepts kvt_seq_destroy. */
#define CHECK_LIVE_SEQ(seq)                                                                        \
    do {                                                                                           \
        CHECK_SEQ(seq);                                                                            \
        kvt_status live_ = check_usable(seq);                                                      \
        if (live_ != KVT_OK)                                                                       \
            return live_;                                                                          \
    } while (0)

/* By-position queries describe the committed state: refused while a step is in flight (a
 * layer's run may have compacted its rows while the table still holds the old count). */
#define CHECK_BETWEEN_STEPS(seq)                                                                   \
    do {                                                                                           \
        CHECK_SEQ(seq);                                                                            \
        if ((seq)->in_step)                                                                        \
            return kvt__ctx_fail((seq)->ctx, KVT_ERR_BAD_STATE,                                    \
                                 "request %llu has a step in flight (planned, not committed): "    \
                                 "by-position queries answer between steps",                       \
                                 (unsigned long long)(seq)->request_id);                           \
    } while (0)

static kvt_status layer_of(const kvt_seq *seq, uint32_t layer, const kvt__store **st) {
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
static kvt_status layer_head_of(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                const kvt__store **st) {
    kvt_status s = layer_of(seq, layer, st);
    if (s != KVT_OK)
        return s;
    if (head >= (*st)->spec.n_kv_heads)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_OUT_OF_RANGE, "head %u of %u (layer %u)", head,
                             (*st)->spec.n_kv_heads, layer);
    return KVT_OK;
}

/* Layer `layer` (one with KV) of a sequence as its policy table's per-layer entries see it. */
static kvt__tier_layer tier_layer(const kvt_seq *seq, uint32_t layer) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__store *st = &ctx->stores[layer];
    kvt__tier_layer l;
    l.cfg = &seq->cfg;
    l.page_rows = ctx->page_rows;
    l.pdiv = &ctx->pdiv;
    l.gr = &ctx->groups[st->group];
    l.st = st;
    l.pt = &seq->pt[st->group];
    l.state = &seq->layers[layer];
    l.appended = seq->n_tokens;
    l.prompt_rows = seq->prompt_rows;
    return l;
}

/* The policy table of a layer with KV. */
static const kvt__policy_ops *ops_of(const kvt_ctx *ctx, uint32_t layer) {
    return ctx->groups[ctx->stores[layer].group].ops;
}

/* The rows of a close's budget reserved for recall's promoted set (the table's promote_room;
 * 0 without one). */
static uint64_t promote_room(const kvt__policy_ops *ops, uint64_t closed_rows,
                             const kvt_config *cfg) {
    return ops->promote_room ? ops->promote_room(closed_rows, cfg) : 0;
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
    seq->layers = kvt__calloc(a, sizeof *seq->layers * ctx->n_layers);
    seq->stepped = kvt__calloc(a, 2u * ctx->n_layers);
    seq->recalled = seq->stepped ? seq->stepped + ctx->n_layers : NULL;
    if (!seq->layers || !seq->stepped) {
        kvt__free(a, seq->layers, sizeof *seq->layers * ctx->n_layers);
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
        if (ctx->stores[i].group < 0 || !ops_of(ctx, i)->layer_init)
            continue;
        kvt_status s = ops_of(ctx, i)->layer_init(&seq->layers[i], &env, &ctx->stores[i]);
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
        const kvt__policy_ops *ops = ops_of(ctx, i);
        kvt_status s = KVT_OK;
        if (ops->layer_reset)
            s = ops->layer_reset(&seq->layers[i], &env, &ctx->stores[i]);
        else if (!ops->layer_init)
            memset(&seq->layers[i], 0, sizeof seq->layers[i]);
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

kvt__recall_layer *kvt__seq_recall_base(const kvt_seq *seq, uint32_t layer) {
    if (kvt__seq_recalls(seq, layer))
        return &seq->recall[layer];
    return kvt__seq_recalls_rope(seq, layer) ? &seq->rrope[layer].base : NULL;
}

static const kvt__recall_layer *recall_base(const kvt_seq *seq, uint32_t layer) {
    return kvt__seq_recall_base(seq, layer);
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

/* The group planes of the pruned scan on `layer` for a request holding `rows` rows. */
static kvt_status recall_groups_reserve(kvt_seq *seq, uint32_t layer, uint64_t rows) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__store *st = &ctx->stores[layer];
    const uint32_t B = seq->cfg.block_rows;
    return kvt__recall_layer_groups_reserve(&seq->recall[layer], &ctx->backend, rows / B, B,
                                            st->spec.branch_dim + ctx->sketch_rank);
}

/* The RoPE trigger's group planes on `layer` for an archive of at most `rows` rows a KV head
 * (the pruned scan over archive blocks of config.block_rows rows; docs/recall.md §9.8). */
static kvt_status rope_groups_reserve(kvt_seq *seq, uint32_t layer, uint64_t rows) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt_layer_spec *sp = &ctx->stores[layer].spec;
    if (ctx->archive_rows && rows > ctx->archive_rows)
        rows = ctx->archive_rows;
    const uint32_t branch = sp->n_planes == 1 ? sp->branch_dim : 0; /* MLA-RoPE's rotated branch */
    /* a layer with the RoPE trigger's buffers: its policy keeps archive sketches */
    const uint32_t stride =
        kvt__layer_policy(ctx, layer)->archive_sketch_stride(sp, ctx->sketch_rank);
    return kvt__recall_rope_groups_reserve(&seq->rrope[layer], &ctx->backend, rows,
                                           seq->cfg.block_rows, branch + stride);
}

/* The RoPE trigger's buffers (docs/recall.md §9) for every layer whose policy has an archive view
 * that the request's configuration gives something to recall from (archive, sketches); a layer
 * without (KVT_ERR_UNSUPPORTED from the view) does not recall, as a salience layer without
 * sketch planes. */
static kvt_status seq_rope_recall_prepare(kvt_seq *seq) {
    kvt_ctx *ctx = seq->ctx;
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        if (st->group < 0 || !ops_of(ctx, i)->recall_rope_view)
            continue;
        kvt__tier_layer l = tier_layer(seq, i);
        kvt__recall_rope_args v;
        char msg[KVT__ERR_LEN];
        kvt_status s = ops_of(ctx, i)->recall_rope_view(&l, &v, msg, sizeof msg);
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
        if (ctx->max_rows && (s = rope_groups_reserve(seq, i, ctx->max_rows)) != KVT_OK)
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
        if (st->group < 0 || !ops_of(ctx, i)->recall_view)
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
            s = recall_groups_reserve(seq, i, ctx->max_rows);
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
        kvt_seq_destroy(slot);
        return s;
    }
    *out = slot;
    return KVT_OK;
}

void kvt__seq_free(kvt_seq *seq) {
    kvt_ctx *ctx = seq->ctx;
    const kvt__alloc *a = &ctx->alloc;
    for (uint32_t g = 0; g < ctx->n_groups; g++)
        kvt__ptable_fini(&seq->pt[g], &ctx->groups[g].pool, a, &ctx->backend);
    for (uint32_t i = 0; seq->layers && i < ctx->n_layers; i++)
        if (ctx->stores[i].group >= 0 && ops_of(ctx, i)->layer_fini)
            ops_of(ctx, i)->layer_fini(&seq->layers[i], a);
    kvt__free(a, seq->layers, sizeof *seq->layers * ctx->n_layers);
    kvt__free(a, seq->stepped, 2u * ctx->n_layers);
    kvt__free(a, seq->cow, sizeof *seq->cow * seq->cow_cap);
    for (uint32_t i = 0; seq->recall && i < ctx->n_layers; i++)
        kvt__recall_layer_fini(&seq->recall[i], &ctx->backend);
    kvt__free(a, seq->recall, seq->recall ? sizeof *seq->recall * ctx->n_layers : 0);
    for (uint32_t i = 0; seq->rrope && i < ctx->n_layers; i++)
        kvt__recall_rope_fini(&seq->rrope[i], &ctx->backend);
    kvt__free(a, seq->rrope, seq->rrope ? sizeof *seq->rrope * ctx->n_layers : 0);
    for (uint32_t g = 0; g < ctx->n_groups; g++)
        kvt__ptable_fini(&seq->fetch[g], &ctx->groups[g].pool, a, &ctx->backend);
    if (seq->batch)
        kvt__batch_forget(seq->batch, seq);
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
        kvt_seq_destroy(seq); /* parks it */
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

void kvt_seq_destroy(kvt_seq *seq) {
    if (!seq)
        return;
    kvt_ctx *ctx = seq->ctx;
    if (!seq->slot || ctx->destroying) {
        kvt__seq_free(seq);
        return;
    }
    /* A slot: every page goes back to the pool, the allocations stay for the next request;
     * what its policies share with other requests (prefix sharing) goes back to them. */
    for (uint32_t i = 0; i < ctx->n_layers; i++)
        if (ctx->stores[i].group >= 0 && ops_of(ctx, i)->layer_unshare)
            ops_of(ctx, i)->layer_unshare(&seq->layers[i], &ctx->alloc);
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        kvt__ptable *t = &seq->pt[g];
        t->n_rows = 0;
        t->n_pending = 0;
        t->first_page = 0;
        kvt__ptable_trim(t, &ctx->groups[g].pool);
        seq->fetch[g].n_pending = 0; /* RoPE recall's fetch area: every page back */
        kvt__ptable_trim(&seq->fetch[g], &ctx->groups[g].pool);
    }
    if (seq->batch)
        kvt__batch_forget(seq->batch, seq);
    seq->batch = NULL;
    unlink_live(ctx, seq);
    seq->next = ctx->free_seqs;
    ctx->free_seqs = seq;
}

/* Copy on write: every live page of group g's table that holds a row at or past from_row and
 * that another table shares becomes this request's own — a page taken from the pool, the page's
 * rows copied into it on the backend for every layer and plane of the group. Each page copied is
 * a valid state on its own; KVT_ERR_POOL_EXHAUSTED (or a backend error) leaves the rest shared. */
static kvt_status own_pages(kvt_seq *seq, uint32_t g, uint64_t from_row) {
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
static void cow_undo(kvt_seq *seq, uint32_t g) {
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
static uint64_t group_writes_from(const kvt_seq *seq, uint32_t g, uint64_t rows_after) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__group *gr = &ctx->groups[g];
    uint64_t from = seq->pt[g].n_rows;
    for (uint32_t k = 0; gr->ops->writes_from && k < gr->n_layers; k++) {
        uint64_t f = gr->ops->writes_from(&seq->layers[gr->layers[k]], &seq->cfg,
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
        const kvt__policy_ops *ops = st->group >= 0 ? ops_of(ctx, i) : NULL;
        if (ops && attach && ops->layer_attach)
            s = ops->layer_attach(&c->layers[i], &src->layers[i], &env, st, rows,
                                  src->prompt_rows);
        else if (ops && !attach && ops->layer_fork)
            s = ops->layer_fork(&c->layers[i], &src->layers[i], &env, st,
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
    kvt_seq_destroy(c); /* its shared pages back to their other holders */
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
            uint64_t n = gr->ops->attach_rows(&src->layers[gr->layers[k]], &src->cfg,
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

/* The first layer whose policy says it is damaged (else: has used the prompt length), or
 * n_layers when none does. */
static uint32_t first_layer_with(const kvt_seq *seq, bool damaged) {
    const kvt_ctx *ctx = seq->ctx;
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        if (ctx->stores[i].group < 0)
            continue;
        const kvt__policy_ops *ops = ops_of(ctx, i);
        bool (*holds)(const kvt__tier_state *) = damaged ? ops->damaged : ops->prompt_used;
        if (holds && holds(&seq->layers[i]))
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
        if (!kvt__seq_recalls_rope(seq, i))
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

uint32_t kvt_seq_pending(const kvt_seq *seq) {
    return seq ? seq->n_pending : 0;
}

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
        cow_undo(seq, g);
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
    for (g = 0; g < ctx->n_groups; g++) {
        s = kvt__ptable_reserve(&seq->pt[g], &ctx->groups[g].pool, a, n_tokens);
        /* Copy on write: pages the step will write that a fork shares become this request's. */
        if (s == KVT_OK && ctx->groups[g].pool.shared)
            s = own_pages(seq, g, group_writes_from(seq, g, seq->pt[g].n_rows + n_tokens));
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
        if (ctx->stores[i].group < 0 || !ops_of(ctx, i)->reserve)
            continue;
        const kvt__ptable *t = &seq->pt[ctx->stores[i].group];
        s = ops_of(ctx, i)->reserve(&seq->layers[i], &env, &ctx->stores[i], t->n_rows + n_tokens);
    }
    /* The recall trigger's group planes for the blocks the step can close (a step's run builds
     * them, and a run allocates nothing). */
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++)
        if (kvt__seq_recalls(seq, i) && (s = recall_groups_reserve(seq, i, seq->n_tokens +
                                                                             n_tokens)) != KVT_OK)
            snprintf(why, sizeof why, "layer %u: the recall scan's group planes", i);
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++)
        if (kvt__seq_recalls_rope(seq, i) &&
            (s = rope_groups_reserve(seq, i, seq->n_tokens + n_tokens)) != KVT_OK)
            snprintf(why, sizeof why, "layer %u: the RoPE recall scan's group planes", i);
    /* RoPE recall: the fetch area holds the whole archive after the step (a dense step lists
     * it): held + archived rows are at most the request's rows; with a host archive no step is
     * dense and it holds at most recall_cap_rows rows. Its size is set only once the whole
     * reservation succeeded (a failure trims it back to what it held). */
    uint32_t f_grown[KVT__MAX_GROUPS] = {0};
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++) {
        if (!kvt__seq_recalls_rope(seq, i))
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
        for (uint32_t h = 0; h < ctx->n_groups; h++) /* all or nothing: fetch areas as they were */
            kvt__ptable_trim(&seq->fetch[h], &ctx->groups[h].pool);
        for (uint32_t h = g < ctx->n_groups ? g + 1 : ctx->n_groups; h-- > 0;) {
            cow_undo(seq, h); /* copies on write given back: the request as it was */
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
    kvt_status s = layer_of(seq, layer, &st);
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
    kvt_status s = layer_of(seq, layer, &st);
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
static kvt_status check_layer(const kvt_seq *seq, uint32_t layer, bool full) {
    const kvt_ctx *ctx = seq->ctx;
    kvt__tier_layer l = tier_layer(seq, layer);
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
        kvt_status s = check_layer(seq, i, false);
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
    kvt__tier_layer l = tier_layer(seq, layer);
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
                            .state = &seq->layers[layer],
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
    if (s == KVT_OK && kvt__seq_recalls_rope(seq, layer))
        s = kvt__ptable_mirror_sync(&seq->fetch[g], be, stream);
    return s;
}

bool kvt__seq_step_quiet(kvt_seq *seq, uint32_t layer, bool recall_planned) {
    kvt_ctx *ctx = seq->ctx;
    if (kvt__seq_recalls_rope(seq, layer) && (!recall_planned || seq->n_pending > 1))
        return false;
    if (kvt__seq_recalls(seq, layer) && (!recall_planned || seq->n_pending > 1))
        return false;
    const kvt__policy_ops *ops = ops_of(ctx, layer);
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
    const kvt__policy_ops *ops = ops_of(ctx, layer);
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

bool kvt__seq_recall_item(kvt_seq *seq, uint32_t layer, const float *q, uint8_t *dense,
                          kvt__recall_step_args *out) {
    kvt__ptable view;
    kvt__tier_layer l = step_layer(seq, layer, seq->n_pending, &view);
    kvt__recall_scan_args v;
    if (!kvt__seq_recalls(seq, layer) || !l.gr->ops->recall_view ||
        !l.gr->ops->recall_view(&l, &v))
        return false;
    kvt__recall_step_make(&seq->recall[layer], &v,
                          kvt__recall_layer_lag_query(&seq->recall[layer], q), view.n_rows,
                          seq->cfg.recall, seq->cfg.recall_margin, dense, out);
    kvt__recall_step_promote(&seq->recall[layer], promote_room(l.gr->ops, v.n_closed, &seq->cfg),
                             seq->cfg.recall_promote_hits, seq->cfg.recall_promote_window, out);
    return true;
}

kvt_status kvt__seq_rope_recall_item(const kvt_seq *seq, uint32_t layer, const float *q,
                                     uint8_t *dense, kvt__recall_rope_args *out) {
    kvt__ptable view;
    kvt__tier_layer l = step_layer(seq, layer, seq->n_pending, &view);
    kvt__recall_rope_args v;
    kvt_status s = l.gr->ops->recall_rope_view(&l, &v, kvt__tls_error(), KVT__ERR_LEN);
    if (s != KVT_OK)
        return s;
    kvt__recall_rope_make(&seq->rrope[layer], &v, q, seq->cfg.recall, seq->cfg.recall_margin,
                          dense, out);
    return KVT_OK;
}

kvt_status kvt__seq_rope_emit_item(const kvt_seq *seq, uint32_t layer, bool all,
                                   int32_t *indices, uint64_t capacity, int32_t *indptr,
                                   kvt__recall_rope_emit_args *out) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__store *st = &ctx->stores[layer];
    kvt__ptable view;
    kvt__tier_layer l = step_layer(seq, layer, seq->n_pending, &view);
    kvt__recall_rope_args v; /* the archive as the policy describes it */
    kvt_status s = l.gr->ops->recall_rope_view(&l, &v, kvt__tls_error(), KVT__ERR_LEN);
    if (s != KVT_OK)
        return s;
    const kvt__recall_rope_layer *r = &seq->rrope[layer];
    const kvt__ptable *f = &seq->fetch[st->group];
    *out = (kvt__recall_rope_emit_args){
        .plane = {st->plane[0], st->plane[1]}, .n_planes = st->spec.n_planes,
        .slot_stride = st->slot_bytes,
        .row_bytes = st->spec.row_bytes, .n_kv = v.n_kv, .pages = v.pages,
        .first_page = v.first_page, .pdiv = v.pdiv, .n_rows = v.n_rows, .ar_bytes = v.ar_bytes,
        .ar_cap = v.ar_cap, .ar_n = v.ar_n, .fired = r->fired, .n_fired = r->n_fired,
        .cap = r->cap, .st = r->base.st, .fetch_pages = f->dpages,
        .fetch_cap = (uint32_t)((uint64_t)f->n_pages * ctx->page_rows), .indices = indices,
        .capacity = capacity, .indptr = indptr, .out = 0, .chain = true, .all = all,
        .capped = v.capped};
    return KVT_OK;
}

kvt_status kvt__seq_rope_recall_view(kvt_seq *seq, uint32_t layer, kvt__recall_rope_args *out) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    kvt_ctx *ctx = seq->ctx;
    if (!ops_of(ctx, layer)->recall_rope_view)
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH,
                             "layer %u: its policy has no archive a RoPE recall reads", layer);
    if ((s = kvt__ptable_mirror_sync(&seq->pt[st->group], &ctx->backend, NULL)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "layer %u: page table to the backend", layer);
    kvt__tier_layer l = tier_layer(seq, layer);
    char *err = kvt__tls_error();
    if ((s = ops_of(ctx, layer)->recall_rope_view(&l, out, err, KVT__ERR_LEN)) != KVT_OK)
        return s;
    return KVT_OK;
}

kvt_status kvt_seq_first_row(const kvt_seq *seq, uint32_t layer, uint64_t *first_row) {
    CHECK_BETWEEN_STEPS(seq);
    if (!first_row)
        return KVT_ERR_INVALID_ARGUMENT;
    const kvt__store *st;
    kvt_status s = layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    *first_row = kvt__ptable_first_row(&seq->pt[st->group], seq->ctx->page_rows);
    return KVT_OK;
}

kvt_status kvt_seq_block_table(const kvt_seq *seq, uint32_t layer, int32_t *pages,
                               uint32_t capacity, uint32_t *n_pages, uint64_t *n_rows) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = layer_of(seq, layer, &st);
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

/* ------------------------------------------------------------------------------------------- */
/* Rows by original position                                                                   */
/* ------------------------------------------------------------------------------------------- */
static kvt_status locate(const kvt_seq *seq, uint32_t layer, uint32_t head, uint64_t pos,
                         kvt_row_state *state, int32_t *slot, const kvt__store **stp) {
    const kvt__store *st;
    kvt_status s = layer_head_of(seq, layer, head, &st);
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
    kvt__tier_layer l = tier_layer(seq, layer);
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
    const kvt__policy_ops *ops = ops_of(ctx, layer);
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
    kvt__tier_layer l = tier_layer(seq, layer);
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
    kvt_status s = layer_head_of(seq, layer, head, &st);
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
    kvt__tier_layer l = tier_layer(seq, layer);
    s = l.gr->ops->positions(&l, head, positions);
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(seq->ctx, s, "positions of layer %u from the backend",
                                       layer);
}

kvt_status kvt_seq_last_slot_map(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                 int32_t *old_to_new, uint64_t capacity, uint64_t *n) {
    CHECK_BETWEEN_STEPS(seq);
    const kvt__store *st;
    kvt_status s = layer_head_of(seq, layer, head, &st);
    if (s != KVT_OK)
        return s;
    kvt__tier_layer l = tier_layer(seq, layer);
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
    const kvt__policy_ops *ops = ops_of(seq->ctx, i);
    *own = *shared = 0;
    *key = NULL;
    *holders = 1;
    if (ops->side_bytes)
        ops->side_bytes(&seq->layers[i], own, shared, key, holders);
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
    kvt_status s = layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    const kvt_ctx *ctx = seq->ctx;
    const kvt__ptable *t = &seq->pt[st->group];
    uint32_t H = st->spec.n_kv_heads;
    memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
    out->policy = ctx->policies[layer];
    out->appended_rows = seq->n_tokens * H;
    kvt__tier_layer l = tier_layer(seq, layer);
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
                promote_room(kvt__layer_policy(ctx, layer), out->closed_rows, &seq->cfg);
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
            const kvt__tier_layer l = tier_layer(q, i);
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
    kvt__tier_layer l = tier_layer(seq, layer);
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
                                    promote_room(l.gr->ops, v.n_closed, &seq->cfg),
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
        s = check_layer(seq, i, true);
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
    kvt_status s = layer_of(seq, layer, &st);
    if (s != KVT_OK)
        return s;
    kvt__tier_layer l = tier_layer(seq, layer);
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
