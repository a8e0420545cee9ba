/* recall_refit.c — kvt_ctx_refit_recall_basis: a salience layer's recall basis replaced while
 * requests live (kvtier.h, docs/recall.md §5.1). Above both the basis (recall_basis.c) and the
 * requests (sequence.c, seq_step.c): it checks V as a set does, then has every live request's
 * policy sketch its closed rows again and its trigger start over. */
#include "handles.h"
#include "seq_internal.h"

#include <stdio.h>

/* kvt_ctx_refit_recall_basis once requests live: V checked, same rank, between steps. */
kvt_status kvt_ctx_refit_recall_basis(kvt_ctx *ctx, uint32_t layer, const float *V, uint32_t rank,
                                      uint32_t flags, void *stream) {
    static const char fn[] = "kvt_ctx_refit_recall_basis";
    if (!ctx || !V)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, ctx ? "V" : "ctx");
    if (!ctx->started)
        return kvt_ctx_set_recall_basis(ctx, layer, V, rank);
    kvt__ctx_clear_error(ctx);
    if (flags & ~KVT_REFIT_KEEP_Z)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", fn,
                             flags & ~KVT_REFIT_KEEP_Z);
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "%s: layer %u of %u", fn, layer,
                             ctx->n_layers);
    kvt__store *st = &ctx->stores[layer];
    const kvt__policy_ops *t = kvt__layer_policy(ctx, layer);
    if (!t->recall_view || !t->resketch)
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH,
                             "%s: layer %u is under policy %s; a basis is replaced on salience "
                             "(MLA-NoPE) layers",
                             fn, layer, kvt_policy_name(ctx->policies[layer]));
    if (ctx->sketch_rank == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "%s: the context builds no recall sketches (params.recall_sketch_rank "
                             "0)", fn);
    if (rank == 0 || rank != st->rbasis.rank)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE,
                             st->rbasis.rank
                                 ? "%s: rank %u, the layer's basis has rank %u (a refit keeps "
                                   "the rank)"
                                 : "%s: rank %u, and layer %u has no basis: set one with "
                                   "kvt_ctx_set_recall_basis before any request reserves rows",
                             fn, rank, st->rbasis.rank ? st->rbasis.rank : layer);
    for (const kvt_seq *q = ctx->seqs; q; q = q->next)
        if (q->n_pending || q->in_step || q->batch)
            return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                                 "%s: request %llu is in a step (reserved, not committed): the "
                                 "basis is replaced between steps",
                                 fn, (unsigned long long)q->request_id);
    const uint32_t D = st->spec.value_dim;
    float omega = 0.0f;
    kvt_status s = kvt__basis_check(ctx, fn, V, rank, D, &omega);
    if (s != KVT_OK)
        return s;
    if (kvt__sound_live(ctx) && (s = kvt__sound_basis_check(ctx, layer, omega)) != KVT_OK)
        return s;
    const kvt__backend *be = &ctx->backend;
    const size_t n = (size_t)rank * D;
    if ((s = be->ops->write(be, st->rbasis.V, V, sizeof(float) * n, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "%s: writing V", fn);
    st->rbasis.id = kvt__basis_id(V, n);
    st->rbasis.omega = omega;
    /* From here on the layer's basis is V: every live request's sketches follow it. */
    const uint64_t epoch = ++ctx->refits;
    for (kvt_seq *q = ctx->seqs; q; q = q->next) {
        kvt__env env = kvt__ctx_env(ctx, q, stream);
        kvt__tier_layer l = kvt__seq_tier_layer(q, layer);
        s = kvt__seq_mirror_sync(q, layer, be, stream);
        if (s == KVT_OK)
            s = t->resketch(kvt__seq_state(q, layer), &env, &l, epoch);
        kvt__recall_layer *r = s == KVT_OK ? kvt__seq_recall_base(q, layer) : NULL;
        if (r)
            s = kvt__recall_layer_rebase(r, be, !(flags & KVT_REFIT_KEEP_Z));
        if (s != KVT_OK) {
            char why[160];
            snprintf(why, sizeof why, "%s", kvt__tls_error());
            return kvt__ctx_fail(ctx, KVT_ERR_CORRUPT,
                                 "%s: request %llu, layer %u: sketching its closed rows with the "
                                 "new basis failed (%s: %s); its sketches mix two bases: destroy "
                                 "it (its stored rows are intact)",
                                 fn, (unsigned long long)q->request_id, layer,
                                 kvt_status_name(s), why);
        }
    }
    float probe; /* the sketches ran on stream: one read after them waits for them */
    if ((s = be->ops->read(be, &probe, st->rbasis.V, sizeof probe, stream)) != KVT_OK)
        return kvt__ctx_fail(ctx, KVT_ERR_CORRUPT, "%s: waiting for the sketches of layer %u",
                             fn, layer);
    return KVT_OK;
}

