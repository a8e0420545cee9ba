/* ctx_env.c — what every lib/ file asks of a context, apart from context.c's lifecycle: the
 * calling thread's error reporting for a call on it, the environment of a policy call, a layer's
 * RoPE recall bound. context.c's destroy calls down into batch.c, sequence.c, buffer.c and
 * recall_basis.c; they call these, so that no call of theirs goes back up into context.c (the
 * lib/ call graph: tests/scripts/check_layers.py prints its cycles). */
#include "handles.h"

#include "recall/kernels/rope_trigger.h"

#include <stdio.h>
#include <string.h>

/* Details go to the calling thread's buffer (kvt_last_error), not to the context: two threads on
 * two contexts never share it. ctx names the call's context for future use (per-context
 * logging); it is not written. */
kvt_status kvt__ctx_fail(const kvt_ctx *ctx, kvt_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvt__tls_vfail(s, fmt, ap);
    va_end(ap);
    /* the device runtime's own words, when it had some (CUDA's error name and string) */
    const char *dev = ctx && ctx->backend.ops && ctx->backend.ops->last_error
                          ? ctx->backend.ops->last_error(&ctx->backend)
                          : NULL;
    if (dev) {
        char *m = kvt__tls_error();
        const size_t n = strlen(m);
        snprintf(m + n, KVT__ERR_LEN - n, " [%s: %s]", ctx->backend.ops->name, dev);
    }
    return s;
}

void kvt__ctx_clear_error(const kvt_ctx *ctx) {
    kvt__tls_clear();
    if (ctx && ctx->backend.ops && ctx->backend.ops->last_error) /* an earlier call's, handled */
        (void)ctx->backend.ops->last_error(&ctx->backend);
}

kvt__env kvt__ctx_env(const kvt_ctx *ctx, const kvt_seq *seq, void *stream) {
    kvt__env e;
    e.alloc = &ctx->alloc;
    e.backend = &ctx->backend;
    e.home = &ctx->backend;
    e.cfg = seq ? &seq->cfg : &ctx->cfg; /* a request's own ratio */
    e.page_rows = ctx->page_rows;
    e.pdiv = &ctx->pdiv;
    e.philox_key = seq ? seq->philox_key : 0;
    e.layer_offset = ctx->layer_offset;
    e.head_offset = ctx->kv_head_offset;
    e.max_rows = ctx->max_rows;
    e.archive_rows = ctx->archive_rows;
    e.archive_host = ctx->archive_host;
    e.sketch_stride = ctx->sketch_rank;
    e.scan_bits = ctx->scan_bits;
    e.stream = stream;
    e.err = kvt__tls_error();
    e.err_len = KVT__ERR_LEN;
    return e;
}

bool kvt__ctx_rope_bound(const kvt_ctx *ctx, uint32_t layer, kvt__recall_rope_args *out) {
    const kvt_layer_spec *sp = &ctx->stores[layer].spec;
    const kvt__policy_ops *t = kvt__layer_policy(ctx, layer); /* an archive with key sketches? */
    const uint32_t stride =
        t->archive_sketch_stride ? t->archive_sketch_stride(sp, ctx->sketch_rank) : 0;
    if (!ctx->sketch_rank || stride == 0 || sp->n_kv_heads == 0 ||
        sp->n_kv_heads > KVT__RECALL_ROPE_MAX_KV)
        return false;
    kvt__recall_rope_args *a = out;
    memset(a, 0, sizeof *a);
    a->D = t->archive_key_dim(sp);
    a->n_kv = sp->n_kv_heads;
    a->group = sp->n_q_heads / sp->n_kv_heads;
    a->sample_cap = sp->n_q_heads * KVT__RECALL_SAMPLES_PER_HEAD;
    a->capped = ctx->archive_host; /* an overflow's choice over the whole archive */
    a->ar_n = ctx->archive_rows ? ctx->archive_rows : ctx->max_rows;
    for (uint32_t h = 0; h < a->n_kv; h++)
        a->rank[h] = stride;
    static uint32_t planes_on; /* the pruned scan's share: any non-NULL plane */
    const uint32_t B = ctx->cfg.block_rows;
    a->branch_dim = sp->n_planes == 1 ? sp->branch_dim : 0; /* MLA-RoPE's rotated branch */
    if (B >= 64u && (B & (B - 1u)) == 0) {
        a->g_perm = &planes_on;
        a->g_B = B;
        a->g_dim = a->branch_dim + stride; /* rope_groups_reserve's centres */
        a->g_blocks_cap = a->ar_n / B;
    }
    return true;
}
