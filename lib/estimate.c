/* estimate.c — kvt_ctx_estimate: a context's memory before it is created. The pool's figures
 * follow from the model and params (what build_groups in context.c allocates) and so do the
 * archive's rows at a stated limit; the side planes of a request come from the library's own sizing, read off a probe context of one
 * page per group holding one request of max_rows_per_seq rows. Public calls only. */
#include "kvtier.h"

#include "lib/base/base.h"
#include "tiers/policy.h"

#include <string.h>

static uint64_t ceil_div(uint64_t a, uint64_t b) {
    return a / b + (a % b != 0);
}

/* The probe's side planes per group: one request of max_rows_per_seq rows. */
static kvt_status probe(const kvt_ctx_params *p, kvt_ctx_estimate_out *o, char *err,
                        size_t len) {
    kvt_ctx_params q = *p;
    q.n_pages = 1;
    q.backend = KVT_BACKEND_CPU;
    q.allocator = KVT_ALLOC_LIBC;
    q.external_storage = false;
    q.max_seqs = 0;
    kvt_ctx *ctx;
    kvt_status s = kvt_ctx_create(&q, &ctx, err, len);
    if (s != KVT_OK)
        return s;
    kvt_seq *seq = NULL;
    s = kvt_seq_create(ctx, NULL, &seq);
    if (s != KVT_OK)
        s = kvt__fail(err, len, s, "a request of max_rows_per_seq %u rows: %s",
                      p->max_rows_per_seq, kvt_last_error());
    const uint32_t L = kvt_model_n_layers(p->model);
    for (uint32_t i = 0; s == KVT_OK && i < L; i++) {
        const int32_t g = kvt_ctx_layer_group(ctx, i);
        if (g < 0)
            continue;
        kvt_layer_stats ls;
        memset(&ls, 0, sizeof ls);
        ls.struct_size = sizeof ls;
        if ((s = kvt_seq_layer_stats(seq, i, &ls)) != KVT_OK) {
            s = kvt__fail(err, len, s, "layer %u: %s", i, kvt_last_error());
            break;
        }
        o->groups[g].side_bytes_per_seq += ls.side_bytes;
    }
    kvt_seq_destroy(seq);
    kvt_ctx_destroy(ctx);
    return s;
}

static kvt_status estimate(const kvt_ctx_params *params, kvt_ctx_estimate_out *out, char *err,
                           size_t len) {
    if (!params || !out || out->struct_size < KVT_CTX_ESTIMATE_OUT_SIZE_MIN)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params or out is NULL, or out->struct_size is below "
                         "KVT_CTX_ESTIMATE_OUT_SIZE_MIN (%zu)",
                         (size_t)KVT_CTX_ESTIMATE_OUT_SIZE_MIN);
    /* The ABI rule (kvtier.h): fields past the caller's struct take their defaults, a newer
     * caller's extra bytes must be zero. */
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_status s = kvt__struct_in(&p, sizeof p, params, KVT_CTX_PARAMS_SIZE_MIN, "params");
    if (s != KVT_OK)
        return kvt__fail(err, len, s, "%s", kvt__tls_error());
    if (!p.model)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "params.model is NULL");
    if (p.max_seqs == 0 || p.max_rows_per_seq == 0)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.max_seqs (%u) and params.max_rows_per_seq (%u): the estimate "
                         "needs both stated",
                         p.max_seqs, p.max_rows_per_seq);
    kvt_ctx_estimate_out o;
    memset(&o, 0, sizeof o);
    o.struct_size = out->struct_size < sizeof o ? out->struct_size : sizeof o;
    s = probe(&p, &o, err, len);
    if (s != KVT_OK)
        return s;
    const bool archive = (p.config ? p.config->evict_archive : kvt_config_default().evict_archive);
    /* The groups as kvt_ctx_create forms them: one per policy, in order of first layer. */
    const uint32_t L = kvt_model_n_layers(p.model);
    kvt_policy seen[3];
    for (uint32_t i = 0; i < L; i++) {
        const kvt_layer_spec *sp = kvt_model_layer(p.model, i);
        if (sp->kind == KVT_LAYER_NO_KV)
            continue;
        const kvt_policy pol = p.layer_policies ? p.layer_policies[i] : kvt_policy_for_kind(sp->kind);
        uint32_t g = 0;
        while (g < o.n_groups && seen[g] != pol)
            g++;
        if (g == o.n_groups) {
            if (g == 3)
                return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "layer %u: policy %d", i,
                                 (int)pol);
            seen[g] = pol;
            o.groups[g].policy = pol;
            o.n_groups++;
        }
        o.groups[g].n_layers++;
        const uint64_t row = (uint64_t)sp->n_planes * sp->n_kv_heads * sp->row_bytes;
        o.groups[g].row_bytes += row;
        /* an archive the policy allocates whole at kvt_seq_create (random eviction's, of a
         * stated limit) */
        const kvt__policy_ops *t = kvt__policy_table(pol);
        if (t && t->archive_bytes_at_create)
            o.groups[g].archive_bytes_per_seq +=
                t->archive_bytes_at_create(sp, p.archive_rows_per_seq, archive);
    }
    const uint64_t per_seq = ceil_div(p.max_rows_per_seq, p.page_rows);
    const uint64_t needed = per_seq * p.max_seqs;
    const bool fits = needed <= UINT32_MAX && needed * p.page_rows <= (uint64_t)INT32_MAX;
    o.n_pages_needed = fits ? (uint32_t)needed : 0;
    for (uint32_t g = 0; g < o.n_groups; g++) {
        kvt_ctx_estimate_group *x = &o.groups[g];
        x->page_bytes = x->row_bytes * p.page_rows;
        x->pool_bytes = x->page_bytes * p.n_pages;
        x->pages_needed = needed;
        o.pool_bytes += x->pool_bytes;
        o.pool_bytes_needed += x->page_bytes * needed;
        o.side_bytes += x->side_bytes_per_seq * p.max_seqs;
        o.archive_bytes += x->archive_bytes_per_seq * p.max_seqs;
    }
    memcpy(out, &o, o.struct_size);
    return KVT_OK;
}

kvt_status kvt_ctx_estimate(const kvt_ctx_params *params, kvt_ctx_estimate_out *out, char *err,
                            size_t len) {
    /* The detail goes to err and to the thread's buffer, as kvt_ctx_create's. */
    char msg[KVT__ERR_LEN] = "";
    return kvt__tls_finish(estimate(params, out, msg, sizeof msg), msg, err, len);
}
