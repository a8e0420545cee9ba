/* context.c — context lifecycle: model copy, per-layer policies, groups and their policy tables,
 * row pools, backend. Its destroy calls down into batch.c, sequence.c, buffer.c and
 * recall_basis.c to tear their handles down; what those ask of a context (its error reporting,
 * a policy call's environment, a layer's RoPE recall bound) is ctx_env.c's, so that none of
 * them calls back up into this file. */
#include "handles.h"

#include "recall/kernels/recall_scan.h"
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/recall_step.h"
#include "kernels/topm.h"
#include "recall/recall.h"


#include <stdio.h>
#include <string.h>

kvt_ctx_params kvt_ctx_default_params(void) {
    kvt_ctx_params p;
    memset(&p, 0, sizeof p);
    p.struct_size = sizeof p;
    p.config = NULL; /* kvt_config_default() */
    p.page_rows = 64;
    p.n_pages = 1024;
    p.backend = KVT_BACKEND_CPU;
    p.allocator = KVT_ALLOC_DEFAULT;
    p.recall_scan_bits = 16;
    return p;
}

kvt_status kvt_ctx_params_init(kvt_ctx_params *out, size_t struct_size) {
    const kvt_ctx_params p = kvt_ctx_default_params();
    return kvt__struct_init(out, struct_size, KVT_CTX_PARAMS_SIZE_MIN, &p, sizeof p,
                            "kvt_ctx_params");
}

void kvt_ctx_destroy(kvt_ctx *ctx) {
    if (!ctx)
        return;
    kvt__batches_destroy(ctx); /* first: a batch's step may still hold reservations */
    kvt__buffers_free(ctx);
    ctx->destroying = true; /* requests are freed, slots too */
    while (ctx->seqs)
        kvt__seq_end(ctx->seqs); /* the batches have let them go */
    kvt__seq_slots_free(ctx);
    const kvt__alloc *a = &ctx->alloc;
    for (uint32_t i = 0; ctx->stores && i < ctx->n_layers; i++) {
        kvt__store *st = &ctx->stores[i];
        for (int p = 0; p < 2; p++)
            if (st->owned[p])
                ctx->backend.ops->buf_free(&ctx->backend, st->plane[p], st->plane_bytes);
        kvt__rbasis_free(ctx, st);
    }
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        kvt__group *gr = &ctx->groups[g];
        if (gr->ops && gr->ops->group_fini)
            gr->ops->group_fini(gr, a);
        kvt__pool_fini(&gr->pool, a);
        kvt__free(a, gr->layers, sizeof(uint32_t) * gr->n_layers);
        kvt__free(a, gr->ptrs, sizeof(void *) * 2 * gr->n_layers);
        kvt__free(a, gr->state, kvt__group_state_bytes);
    }
    kvt__free(a, ctx->stores, sizeof *ctx->stores * ctx->n_layers);
    kvt__free(a, ctx->policies, sizeof *ctx->policies * ctx->n_layers);
    kvt_model_destroy(ctx->model);
    ctx->backend.ops->close(&ctx->backend); /* set before any failure that comes here */
    kvt__alloc alloc = ctx->alloc;
    kvt__free(&alloc, ctx, sizeof *ctx);
    kvt__alloc_fini(&alloc);
}

/* Resolve and check each layer's policy. */
static kvt_status resolve_policies(kvt_ctx *ctx, const kvt_ctx_params *p, char *err, size_t len) {
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt_layer_spec *sp = kvt_model_layer(ctx->model, i);
        kvt_policy pol = p->layer_policies ? p->layer_policies[i] : kvt_policy_for_kind(sp->kind);
        const kvt__policy_ops *ops = kvt__policy_table(pol);
        if (!ops)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "layer_policies[%u]: unknown policy %d", i, (int)pol);
        /* Whether the policy can serve the layer is the policy's own rule (its table). */
        char why[KVT__ERR_LEN] = "";
        kvt_status s = ops->supports_layer ? ops->supports_layer(sp, i, &ctx->cfg, why, sizeof why)
                                           : KVT_OK;
        if (s != KVT_OK)
            return p->layer_policies ? kvt__fail(err, len, s, "layer_policies[%u]: %s", i, why)
                                     : kvt__fail(err, len, s, "%s", why);
        ctx->policies[i] = pol;
    }
    return KVT_OK;
}

static kvt_status build_groups(kvt_ctx *ctx, char *err, size_t len) {
    const kvt__alloc *a = &ctx->alloc;
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt_layer_spec *sp = kvt_model_layer(ctx->model, i);
        kvt__store *st = &ctx->stores[i];
        st->spec = *sp;
        st->layer = i;
        st->group = -1;
        if (sp->kind == KVT_LAYER_NO_KV)
            continue;
        uint32_t g = 0;
        while (g < ctx->n_groups && ctx->groups[g].policy != ctx->policies[i])
            g++;
        if (g == ctx->n_groups) {
            ctx->groups[g].policy = ctx->policies[i];
            ctx->n_groups++;
        }
        st->group = (int32_t)g;
        st->slot_bytes = (size_t)sp->n_kv_heads * sp->row_bytes;
        uint64_t rows = (uint64_t)ctx->n_pages * ctx->page_rows;
        if (st->slot_bytes != 0 && rows > SIZE_MAX / st->slot_bytes)
            return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                             "n_pages: layer %u pool of %llu rows overflows the address space", i,
                             (unsigned long long)rows);
        st->plane_bytes = (size_t)rows * st->slot_bytes;
    }
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        kvt__group *gr = &ctx->groups[g];
        for (uint32_t i = 0; i < ctx->n_layers; i++)
            gr->n_layers += ctx->stores[i].group == (int32_t)g;
        gr->layers = kvt__malloc(a, sizeof(uint32_t) * gr->n_layers);
        gr->ptrs = kvt__calloc(a, sizeof(void *) * 2 * gr->n_layers);
        gr->state = kvt__calloc(a, kvt__group_state_bytes); /* the policy's, opaque here */
        if (!gr->layers || !gr->ptrs || !gr->state)
            return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "group layer list");
        uint32_t k = 0;
        for (uint32_t i = 0; i < ctx->n_layers; i++)
            if (ctx->stores[i].group == (int32_t)g)
                gr->layers[k++] = i;
        /* The policy table, chosen once: from here on the group's layers are run only through
         * it. resolve_policies admitted only policies that have one. */
        gr->ops = kvt__policy_ops_for(gr, ctx->stores);
        KVT_ASSERT(gr->ops != NULL);
        gr->home = &ctx->backend;
        if (gr->ops->group_init) {
            kvt_status s = gr->ops->group_init(gr, ctx->stores, a, &ctx->cfg, err, len);
            if (s != KVT_OK)
                return s;
        }
        kvt_status s = kvt__pool_init(&gr->pool, a, ctx->n_pages, ctx->page_rows);
        if (s != KVT_OK)
            return kvt__fail(err, len, s, "page allocator");
    }
    if (!ctx->external) {
        for (uint32_t i = 0; i < ctx->n_layers; i++) {
            kvt__store *st = &ctx->stores[i];
            if (st->group < 0)
                continue;
            for (uint32_t p = 0; p < st->spec.n_planes; p++) {
                /* Zeroed so that a slot the engine never wrote reads as zeros, not garbage. */
                /* In the backend's memory space (zeroed: a slot the engine never wrote reads as
                 * zeros, not garbage). */
                void *buf = NULL;
                if (ctx->backend.ops->buf_alloc(&ctx->backend, st->plane_bytes, &buf) == KVT_OK)
                    st->plane[p] = buf;
                if (!st->plane[p])
                    return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY,
                                     "row pool: layer %u plane %u needs %zu bytes", i, p,
                                     st->plane_bytes);
                st->owned[p] = true;
            }
        }
    }
    return KVT_OK;
}

static kvt_status open_cpu(kvt_ctx *ctx, char *err, size_t len) {
    kvt_status s = kvt__backend_cpu_open(&ctx->backend);
    return s == KVT_OK ? KVT_OK : kvt__fail(err, len, s, "CPU backend workspace");
}

kvt_status kvt__backend_scan_bits_check(const kvt__backend_ops *ops, uint32_t bits, char *err,
                                        size_t len) {
    if (bits == 8 && !ops->recall_scan_q8)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "params.recall_scan_bits 8: the %s backend's recall scan is 16-bit only "
                         "(its table has no 8-bit planes: recall_scan_q8)",
                         ops->name);
    return KVT_OK;
}

static kvt_status open_backend(kvt_ctx *ctx, kvt_backend_kind kind, char *err, size_t len) {
    ctx->backend.alloc = &ctx->alloc;
    if (kind == KVT_BACKEND_CPU)
        return open_cpu(ctx, err, len);
    if (kind == KVT_BACKEND_GUARDED) {
        if (ctx->external)
            return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                             "backend: the guarded backend's buffers are its own; external_storage "
                             "(engine host memory) cannot be guarded");
        return kvt__backend_guarded_open(&ctx->backend, err, len);
    }
    if (kind != KVT_BACKEND_CUDA && kind != KVT_BACKEND_AUTO)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "backend: unknown value %d",
                         (int)kind);
    char why[256] = "";
    kvt_status s = kvt__backend_cuda_open(&ctx->backend, why, sizeof why);
    if (s == KVT_OK)
        return KVT_OK;
    ctx->backend.impl = NULL;
    if (kind == KVT_BACKEND_AUTO)
        return open_cpu(ctx, err, len); /* CPU fallback, by request */
    return kvt__fail(err, len, s, "backend: CUDA requested but unavailable: %s", why);
}

/* With a stated max_rows_per_seq, the size of a backend workspace that serves the largest
 * commit's work (a salience close: σ of a block over the widest branch, its sketches) and the
 * largest top-m (all of a request's rows), on a backend whose scratch is host memory sized up
 * front (scratch_reserve: the CPU backends). A backend that gives each batch a handle of its own
 * (workspace) sizes it there (kvt_batch_create); one whose batches share the context's handle
 * (the guarded backend) has it sized here. */
static kvt_status size_workspace(kvt_ctx *ctx, char *err, size_t len) {
    if (ctx->max_rows == 0 || !ctx->backend.ops->scratch_reserve)
        return KVT_OK;
    ctx->ws_sigma_floats = 0;
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__policy_ops *t = kvt__layer_policy(ctx, i);
        const size_t f = t->close_scratch_floats
                             ? t->close_scratch_floats(&ctx->stores[i].spec, &ctx->cfg,
                                                       ctx->sketch_rank)
                             : 0;
        if (f > ctx->ws_sigma_floats)
            ctx->ws_sigma_floats = f;
    }
    /* A recall step (a request with recall on, its own or the context's mode) takes its scratch
     * from the same piece, sized here at the context's limits by the recall table of each layer
     * where requests may recall (its scratch_floats: a NoPE step's scan and own scratch at up to
     * max_rows closed rows, with or without group planes; a RoPE step's for one KV head's group,
     * whatever the archive's length), so that no step grows it (steady-state decode allocates
     * nothing). */
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        kvt__recall_site site;
        const kvt__recall_ops *ro = kvt__ctx_recall_of(ctx, i, &site);
        const size_t f = ro ? ro->scratch_floats(&site, ctx->cfg.recall_promote_capacity) : 0;
        if (f > ctx->ws_sigma_floats)
            ctx->ws_sigma_floats = f;
    }
    /* A salience close's selection takes its keys and the top-m scratch in one piece. */
    ctx->ws_topm_u32 = (size_t)ctx->max_rows + kvt__topm_scratch_u32(ctx->max_rows);
    if (ctx->backend.ops->workspace)
        return KVT_OK;
    kvt_status s = ctx->backend.ops->scratch_reserve(&ctx->backend, ctx->ws_sigma_floats,
                                                     ctx->ws_topm_u32);
    return s == KVT_OK ? KVT_OK : kvt__fail(err, len, s, "backend workspace for %u rows",
                                            ctx->max_rows);
}

/* params.recall_sketch_rank against every layer's policy (supports_sketch; docs/recall.md). */
static kvt_status check_sketch_rank(const kvt_ctx *ctx, uint32_t r, char *err, size_t len) {
    if (r == 0)
        return KVT_OK;
    if (r > KVT_RECALL_MAX_RANK)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.recall_sketch_rank: %u above KVT_RECALL_MAX_RANK (%u)", r,
                         KVT_RECALL_MAX_RANK);
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__policy_ops *t = kvt__layer_policy(ctx, i);
        kvt_status s = t->supports_sketch
                           ? t->supports_sketch(kvt_model_layer(ctx->model, i), i, r, err, len)
                           : KVT_OK;
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}

/* Parallelism fields: every layer's heads must fit in the global head count. */
static kvt_status check_parallel(const kvt_ctx_params *p) {
    uint32_t n = kvt_model_n_layers(p->model);
    if (p->layer_offset > (1u << 24))
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "params.layer_offset: %u too large",
                             p->layer_offset);
    for (uint32_t i = 0; p->n_kv_heads_global != 0 && i < n; i++) {
        const kvt_layer_spec *sp = kvt_model_layer(p->model, i);
        if (sp->kind == KVT_LAYER_NO_KV)
            continue;
        if ((uint64_t)p->kv_head_offset + sp->n_kv_heads > p->n_kv_heads_global)
            return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT,
                                 "params.kv_head_offset: %u + layer %u's %u KV heads exceeds "
                                 "n_kv_heads_global %u",
                                 p->kv_head_offset, i, sp->n_kv_heads, p->n_kv_heads_global);
    }
    if (p->n_kv_heads_global == 0 && p->kv_head_offset != 0)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT,
                             "params.kv_head_offset: %u without n_kv_heads_global",
                             p->kv_head_offset);
    return KVT_OK;
}

static kvt_status ctx_create(const kvt_ctx_params *user, kvt_ctx **out, char *err, size_t len) {
    if (!user)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "params is NULL");
    kvt_ctx_params pv = kvt_ctx_default_params();
    kvt_status s = kvt__struct_in(&pv, sizeof pv, user, KVT_CTX_PARAMS_SIZE_MIN, "params");
    if (s != KVT_OK)
        return kvt__fail(err, len, s, "%s", kvt__tls_error());
    const kvt_ctx_params *p = &pv;
    if (!p->model)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "params.model is NULL");
    kvt_config cfg = kvt_config_default();
    if (p->config && (s = kvt__config_in(p->config, &cfg, err, len)) != KVT_OK)
        return s;
    if ((s = check_parallel(p)) != KVT_OK)
        return kvt__fail(err, len, s, "%s", kvt__tls_error());
    if (p->page_rows == 0 || p->page_rows > 65536)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "params.page_rows: %u not in 1..65536",
                         p->page_rows);
    if (p->n_pages == 0 || (uint64_t)p->n_pages * p->page_rows > (uint64_t)INT32_MAX)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.n_pages: %u x page_rows %u must be in 1..2^31-1 (int32 slots)",
                         p->n_pages, p->page_rows);
    if (p->max_rows_per_seq > (uint32_t)INT32_MAX)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.max_rows_per_seq: %u exceeds 2^31-1 (int32 row indices)",
                         p->max_rows_per_seq);
    if (p->max_seqs > (1u << 20))
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "params.max_seqs: %u above 2^20",
                         p->max_seqs);
    if ((unsigned)p->archive_space > KVT_SPACE_HOST)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.archive_space: unknown value %d", (int)p->archive_space);
    if (p->recall_scan_bits != 0 && p->recall_scan_bits != 8 && p->recall_scan_bits != 16)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.recall_scan_bits: %u not 8 or 16", p->recall_scan_bits);
    if (p->recall_scan_bits == 8 && p->recall_sketch_rank == 0)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.recall_scan_bits 8: the 8-bit planes need recall sketches "
                         "(params.recall_sketch_rank > 0)");
    if ((unsigned)p->allocator > KVT_ALLOC_LIBC)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "params.allocator: unknown value %d",
                         (int)p->allocator);

    kvt__alloc alloc;
    s = kvt__alloc_init(&alloc, p->allocator);
    if (s != KVT_OK)
        return kvt__fail(err, len, s, "allocator");
    kvt_ctx *ctx = kvt__calloc(&alloc, sizeof *ctx);
    if (!ctx) {
        kvt__alloc_fini(&alloc);
        return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "context");
    }
    ctx->alloc = alloc;
    ctx->cfg = cfg;
    ctx->kv_head_offset = p->kv_head_offset;
    ctx->n_kv_heads_global = p->n_kv_heads_global;
    ctx->layer_offset = p->layer_offset;
    ctx->max_rows = p->max_rows_per_seq;
    ctx->archive_rows = p->archive_rows_per_seq;
    ctx->archive_host = p->archive_space == KVT_SPACE_HOST;
    ctx->max_seqs = p->max_seqs;
    ctx->sketch_rank = p->recall_sketch_rank;
    ctx->scan_bits = p->recall_scan_bits == 8 ? 8u : 16u;
    ctx->page_rows = p->page_rows;
    ctx->pdiv = kvt__div32_make(p->page_rows);
    ctx->n_pages = p->n_pages;
    ctx->external = p->external_storage;
    ctx->backend.alloc = &ctx->alloc;
    ctx->backend.ops = kvt__backend_cpu_ops();

    uint32_t n = kvt_model_n_layers(p->model);
    const kvt_layer_spec *l0 = kvt_model_layer(p->model, 0);
    s = kvt_model_create(l0, n, kvt_model_type(p->model), &ctx->model, err, len);
    if (s != KVT_OK)
        goto fail;
    ctx->n_layers = n;
    ctx->stores = kvt__calloc(&ctx->alloc, sizeof *ctx->stores * n);
    ctx->policies = kvt__calloc(&ctx->alloc, sizeof *ctx->policies * n);
    if (!ctx->stores || !ctx->policies) {
        s = kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "layer tables");
        goto fail;
    }
    if ((s = resolve_policies(ctx, p, err, len)) != KVT_OK ||
        (s = check_sketch_rank(ctx, p->recall_sketch_rank, err, len)) != KVT_OK)
        goto fail;
    if ((s = open_backend(ctx, p->backend, err, len)) != KVT_OK)
        goto fail;
    /* The recall tier's ops are optional in a backend's table (the CPU, guarded and CUDA
     * backends have both): a context that asks for sketches on a backend without them is
     * refused, not left to call NULL. */
    if (ctx->sketch_rank &&
        (!ctx->backend.ops->sketch_rows || !ctx->backend.ops->recall_scan)) {
        s = kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                      "params.recall_sketch_rank: the %s backend has no recall ops (sketch_rows, "
                      "recall_scan)",
                      ctx->backend.ops->name);
        goto fail;
    }
    if ((s = kvt__backend_scan_bits_check(ctx->backend.ops, ctx->scan_bits, err, len)) != KVT_OK)
        goto fail;
    for (uint32_t i = 0; ctx->scan_bits == 8 && i < ctx->n_layers; i++) {
        const kvt_layer_spec *sp = kvt_model_layer(ctx->model, i);
        if (kvt__layer_policy(ctx, i)->recall_view && sp->branch_dim > KVT__RECALL_MAX_BRANCH) {
            s = kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                          "params.recall_scan_bits 8: layer %u's branch_dim %u above %u", i,
                          sp->branch_dim, KVT__RECALL_MAX_BRANCH);
            goto fail;
        }
    }
    if (ctx->cfg.recall != KVT_RECALL_OFF &&
        (ctx->sketch_rank == 0 || !ctx->backend.ops->recall_step)) {
        s = kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                      "config.recall %d: %s", (int)ctx->cfg.recall,
                      ctx->sketch_rank == 0
                          ? "recall needs sketch planes (params.recall_sketch_rank > 0)"
                          : "the backend has no recall step yet");
        goto fail;
    }
    if (ctx->cfg.recall != KVT_RECALL_OFF && ctx->cfg.recall_promote_capacity &&
        !ctx->backend.ops->recall_promote) {
        s = kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                      "config.recall_promote_capacity %u: the %s backend's recall step has no "
                      "promotion yet",
                      ctx->cfg.recall_promote_capacity, ctx->backend.ops->name);
        goto fail;
    }
    if ((s = build_groups(ctx, err, len)) != KVT_OK || (s = size_workspace(ctx, err, len)) != KVT_OK)
        goto fail;
    /* Request slots: with both limits stated, every request's state is built now. */
    if (ctx->max_seqs && ctx->max_rows && (s = kvt__seq_slots_build(ctx)) != KVT_OK) {
        kvt__fail(err, len, s, "request slots (max_seqs %u x max_rows_per_seq %u): %s",
                  ctx->max_seqs, ctx->max_rows, kvt__tls_error());
        goto fail;
    }
    *out = ctx;
    return KVT_OK;
fail:
    kvt_ctx_destroy(ctx);
    return s;
}

kvt_status kvt_ctx_create(const kvt_ctx_params *params, kvt_ctx **out, char *err, size_t len) {
    if (!out) {
        kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "out is NULL");
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "out is NULL");
    }
    *out = NULL;
    /* The detail goes to err (there is no context yet to ask) and to the thread's buffer. */
    char msg[KVT__ERR_LEN] = "";
    return kvt__tls_finish(ctx_create(params, out, msg, sizeof msg), msg, err, len);
}

kvt_status kvt_ctx_create_default(const kvt_model *model, kvt_ctx **out, char *err,
                                  size_t len) {
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = model;
    return kvt_ctx_create(&p, out, err, len);
}

uint64_t kvt_ctx_host_allocations(const kvt_ctx *ctx) {
    return ctx ? kvt__alloc_calls(&ctx->alloc) : 0;
}

const kvt_model *kvt_ctx_model(const kvt_ctx *ctx) {
    return ctx ? ctx->model : NULL;
}

const kvt_config *kvt_ctx_config(const kvt_ctx *ctx) {
    return ctx ? &ctx->cfg : NULL;
}

const char *kvt_ctx_backend_name(const kvt_ctx *ctx) {
    return ctx ? ctx->backend.ops->name : "";
}

const char *kvt_ctx_allocator_name(const kvt_ctx *ctx) {
    return ctx ? kvt__alloc_name(&ctx->alloc) : "";
}

kvt_policy kvt_ctx_layer_policy(const kvt_ctx *ctx, uint32_t layer) {
    return (ctx && layer < ctx->n_layers) ? ctx->policies[layer] : KVT_POLICY_NONE;
}

int32_t kvt_ctx_layer_group(const kvt_ctx *ctx, uint32_t layer) {
    return (ctx && layer < ctx->n_layers) ? ctx->stores[layer].group : -1;
}

kvt_status kvt_ctx_free_pages(const kvt_ctx *ctx, uint32_t layer, uint32_t *out) {
    if (!ctx || !out)
        return KVT_ERR_INVALID_ARGUMENT;
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "layer %u of %u", layer, ctx->n_layers);
    int32_t g = ctx->stores[layer].group;
    if (g < 0)
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH, "layer %u stores no per-token KV",
                             layer);
    *out = ctx->groups[g].pool.n_free;
    return KVT_OK;
}

static kvt_status plane_of(const kvt_ctx *ctx, uint32_t layer, uint32_t plane, kvt__store **st) {
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "layer %u of %u", layer, ctx->n_layers);
    kvt__store *s = &ctx->stores[layer];
    if (s->group < 0)
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH, "layer %u stores no per-token KV",
                             layer);
    if (plane >= s->spec.n_planes)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "plane %u of %u (layer %u)", plane,
                             s->spec.n_planes, layer);
    *st = s;
    return KVT_OK;
}

kvt_status kvt_layer_data(kvt_ctx *ctx, uint32_t layer, uint32_t plane, void **base,
                          size_t *bytes) {
    if (!ctx || !base || !bytes)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__store *st = NULL;
    kvt_status s = plane_of(ctx, layer, plane, &st);
    if (s != KVT_OK)
        return s;
    if (!st->plane[plane])
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "layer %u plane %u: external storage not bound yet", layer, plane);
    *base = st->plane[plane];
    *bytes = st->plane_bytes;
    return KVT_OK;
}

static kvt_status layer_copy(kvt_ctx *ctx, uint32_t layer, uint32_t plane, uint64_t first,
                             uint64_t n, void *host, size_t bytes, bool write) {
    if (!ctx || !host)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(ctx);
    kvt__store *st = NULL;
    kvt_status s = plane_of(ctx, layer, plane, &st);
    if (s != KVT_OK)
        return s;
    if (!st->plane[plane])
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE, "layer %u plane %u: storage not bound",
                             layer, plane);
    uint64_t n_slots = st->plane_bytes / st->slot_bytes;
    if (first > n_slots || n > n_slots - first)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "slots [%llu, %llu) of %llu",
                             (unsigned long long)first, (unsigned long long)(first + n),
                             (unsigned long long)n_slots);
    if ((uint64_t)bytes != n * st->slot_bytes)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "%zu bytes for %llu slots of %zu",
                             bytes, (unsigned long long)n, st->slot_bytes);
    uint8_t *dev = st->plane[plane] + (size_t)first * st->slot_bytes;
    return write ? ctx->backend.ops->write(&ctx->backend, dev, host, bytes, NULL)
                 : ctx->backend.ops->read(&ctx->backend, host, dev, bytes, NULL);
}

kvt_status kvt_layer_read(kvt_ctx *ctx, uint32_t layer, uint32_t plane, uint64_t first_slot,
                          uint64_t n_slots, void *dst, size_t bytes) {
    return layer_copy(ctx, layer, plane, first_slot, n_slots, dst, bytes, false);
}

kvt_status kvt_layer_write(kvt_ctx *ctx, uint32_t layer, uint32_t plane, uint64_t first_slot,
                           uint64_t n_slots, const void *src, size_t bytes) {
    return layer_copy(ctx, layer, plane, first_slot, n_slots, (void *)src, bytes, true);
}

kvt_status kvt_layer_bind(kvt_ctx *ctx, uint32_t layer, uint32_t plane, void *base, size_t bytes) {
    if (!ctx || !base)
        return KVT_ERR_INVALID_ARGUMENT;
    if (!ctx->external)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "kvt_layer_bind needs params.external_storage = true");
    if (!ctx->backend.ops->host_visible)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "kvt_layer_bind: the %s backend's planes are its own memory",
                             ctx->backend.ops->name);
    if (ctx->started)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "kvt_layer_bind after the first reservation would lose rows");
    kvt__store *st = NULL;
    kvt_status s = plane_of(ctx, layer, plane, &st);
    if (s != KVT_OK)
        return s;
    if (bytes < st->plane_bytes)
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                             "layer %u plane %u: %zu bytes bound, %zu needed", layer, plane,
                             bytes, st->plane_bytes);
    st->plane[plane] = base;
    st->owned[plane] = false;
    return KVT_OK;
}
