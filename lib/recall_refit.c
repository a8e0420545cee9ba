/* recall_refit.c — kvt_ctx_refit_recall_basis and kvt_ctx_refit_recall_head_basis: a layer's
 * recall basis (a salience layer's, or one KV head's key basis of an evict layer's archive)
 * replaced while requests live (kvtier.h, docs/recall.md §5.1). Above both the bases
 * (recall_basis.c) and the requests (sequence.c, seq_step.c): it checks V as a set does, writes
 * it over the old one in place, then has every live request's policy sketch its rows again
 * (tiers/policy.h, resketch) and its trigger start over. */
#include "handles.h"
#include "seq_internal.h"

#include <stdio.h>

/* No request of ctx in a step (reserved, not committed): KVT_OK, else KVT_ERR_BAD_STATE named. */
static kvt_status between_steps(const kvt_ctx *ctx, const char *fn) {
    for (const kvt_seq *q = ctx->seqs; q; q = q->next)
        if (kvt__seq_in_step(q))
            return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                                 "%s: request %llu is in a step (reserved, not committed): the "
                                 "basis is replaced between steps",
                                 fn, (unsigned long long)q->request_id);
    return KVT_OK;
}

/* V (rank x D, host) over the basis at dst (backend memory), then every live request's rows of
 * (layer, head) sketched again and its trigger rebased; the basis's id and ‖V Vᵀ − I‖_F into
 * *id_out and *omega_out once V is written; returns once the stream has run the sketches. */
static kvt_status refit(kvt_ctx *ctx, const char *fn, uint32_t layer, uint32_t head, float *dst,
                        const float *V, size_t n, float omega, uint32_t *id_out,
                        float *omega_out, uint32_t flags, void *stream) {
    const kvt__backend *be = &ctx->backend;
    const kvt__policy_ops *t = kvt__layer_policy(ctx, layer);
    kvt_status s = be->ops->write(be, dst, V, sizeof(float) * n, stream);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "%s: writing V", fn);
    *id_out = kvt__basis_id(V, n);
    *omega_out = omega;
    /* From here on the basis is V: every live request's sketches follow it. A request that
     * fails does not stop the others (each is sketched again whatever happened before it); the
     * first failure is named with the count. */
    const uint64_t epoch = ++ctx->refits;
    uint32_t failed = 0;
    uint64_t first_id = 0;
    kvt_status first = KVT_OK;
    char why[160] = "";
    for (kvt_seq *q = ctx->seqs; q; q = q->next) {
        kvt__env env = kvt__ctx_env(ctx, q, stream);
        kvt__tier_layer l = kvt__seq_tier_layer(q, layer);
        s = kvt__seq_mirror_sync(q, layer, be, stream);
        if (s == KVT_OK)
            s = t->resketch(kvt__seq_state(q, layer), &env, &l, head, epoch);
        kvt__recall_layer *r = s == KVT_OK ? kvt__seq_recall_base(q, layer) : NULL;
        if (r)
            s = kvt__recall_layer_rebase(r, be, !(flags & KVT_REFIT_KEEP_Z));
        if (s != KVT_OK && failed++ == 0) {
            first = s;
            first_id = q->request_id;
            snprintf(why, sizeof why, "%s", kvt__tls_error());
        }
    }
    float probe; /* the sketches ran on stream: one read after them waits for them */
    s = be->ops->read(be, &probe, dst, sizeof probe, stream);
    if (failed)
        return kvt__ctx_fail(ctx, KVT_ERR_CORRUPT,
                             "%s: layer %u: sketching the rows of %u request(s) with the new basis "
                             "failed, the first request %llu (%s: %s); their sketches mix two "
                             "bases: call again with the same V (every request is sketched "
                             "again) or destroy them (their stored rows are intact)",
                             fn, layer, failed, (unsigned long long)first_id,
                             kvt_status_name(first), why);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, KVT_ERR_CORRUPT,
                             "%s: layer %u: waiting for the sketches failed (%s): the requests' "
                             "sketches may mix two bases; call again with the same V",
                             fn, layer, kvt_status_name(s));
    return KVT_OK;
}

/* The checks every refit shares once requests live: flags, V (finite, orthonormal; the sound
 * mode's bound when a sound request lives), between steps. */
static kvt_status refit_checks(kvt_ctx *ctx, const char *fn, uint32_t layer, const float *V,
                               uint32_t rank, uint32_t D, uint32_t flags, float *omega) {
    if (flags & ~KVT_REFIT_KEEP_Z)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", fn,
                             flags & ~KVT_REFIT_KEEP_Z);
    kvt_status s = between_steps(ctx, fn);
    if (s == KVT_OK)
        s = kvt__basis_check(ctx, fn, V, rank, D, omega);
    if (s == KVT_OK && kvt__sound_live(ctx))
        s = kvt__sound_basis_check(ctx, layer, *omega);
    return s;
}

/* The layer of a refit once requests live: in range, under a policy whose bases it replaces (a
 * salience layer's basis, or an evict archive's key bases: `keys`). */
static kvt_status refit_layer(kvt_ctx *ctx, const char *fn, uint32_t layer, bool keys) {
    kvt__ctx_clear_error(ctx);
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "%s: layer %u of %u", fn, layer,
                             ctx->n_layers);
    const kvt__policy_ops *t = kvt__layer_policy(ctx, layer);
    if (!t->resketch || !(keys ? t->archive_sketch_stride != NULL : t->recall_view != NULL))
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH,
                             keys ? "%s: layer %u is under policy %s; key bases are for the "
                                    "archive of evict (RoPE) layers (a salience layer's: "
                                    "kvt_ctx_refit_recall_basis)"
                                  : "%s: layer %u is under policy %s; a layer basis is replaced "
                                    "on salience (MLA-NoPE) layers (key bases: "
                                    "kvt_ctx_refit_recall_head_basis)",
                             fn, layer, kvt_policy_name(ctx->policies[layer]));
    return KVT_OK;
}

kvt_status kvt_ctx_refit_recall_basis(kvt_ctx *ctx, uint32_t layer, const float *V, uint32_t rank,
                                      uint32_t flags, void *stream) {
    static const char fn[] = "kvt_ctx_refit_recall_basis";
    if (!ctx || !V)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, ctx ? "V" : "ctx");
    if (!ctx->started)
        return kvt_ctx_set_recall_basis(ctx, layer, V, rank);
    kvt_status s = refit_layer(ctx, fn, layer, false);
    if (s != KVT_OK)
        return s;
    kvt__store *st = &ctx->stores[layer];
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
    const uint32_t D = st->spec.value_dim;
    float omega = 0.0f;
    s = refit_checks(ctx, fn, layer, V, rank, D, flags, &omega);
    if (s != KVT_OK)
        return s;
    return refit(ctx, fn, layer, 0, st->rbasis.V, V, (size_t)rank * D, omega, &st->rbasis.id,
                 &st->rbasis.omega, flags, stream);
}

kvt_status kvt_ctx_refit_recall_head_basis(kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                           const float *V, uint32_t rank, uint32_t flags,
                                           void *stream) {
    static const char fn[] = "kvt_ctx_refit_recall_head_basis";
    if (!ctx || !V)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, ctx ? "V" : "ctx");
    if (!ctx->started)
        return kvt_ctx_set_recall_head_basis(ctx, layer, kv_head, V, rank);
    kvt_status s = refit_layer(ctx, fn, layer, true);
    if (s != KVT_OK)
        return s;
    kvt__store *st = &ctx->stores[layer];
    const kvt__policy_ops *t = kvt__layer_policy(ctx, layer);
    if (ctx->sketch_rank == 0 || t->archive_sketch_stride(&st->spec, ctx->sketch_rank) == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "%s: layer %u keeps no archive key sketches (params."
                             "recall_sketch_rank %u; sketched: GQA/MHA and MLA-RoPE layers of "
                             "bf16, fp16 or fp32 rows)",
                             fn, layer, ctx->sketch_rank);
    if (kv_head >= st->spec.n_kv_heads)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "%s: KV head %u of %u", fn, kv_head,
                             st->spec.n_kv_heads);
    const uint32_t have = st->kb_rank ? st->kb_rank[kv_head] : 0;
    if (rank == 0 || rank != have)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE,
                             have ? "%s: rank %u, KV head %u's basis has rank %u (a refit keeps "
                                    "the rank)"
                                  : "%s: rank %u, and KV head %u has no basis: set one with "
                                    "kvt_ctx_set_recall_head_basis before any request reserves "
                                    "rows",
                             fn, rank, kv_head, have);
    const uint32_t D = t->archive_key_dim(&st->spec);
    float omega = 0.0f;
    s = refit_checks(ctx, fn, layer, V, rank, D, flags, &omega);
    if (s != KVT_OK)
        return s;
    return refit(ctx, fn, layer, kv_head, st->kb_V + (size_t)kv_head * st->kb_stride * D, V,
                 (size_t)rank * D, omega, &st->kb_id[kv_head], &st->kb_omega[kv_head], flags,
                 stream);
}
