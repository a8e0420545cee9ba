/* ctx_env.c — what every lib/ file asks of a context, apart from context.c's lifecycle: the
 * calling thread's error reporting for a call on it, the environment of a policy call, a layer's
 * recall table (the kind requests recall with there). context.c's destroy calls down into
 * batch.c, sequence.c, buffer.c and recall_basis.c; they call these, so that no call of theirs
 * goes back up into context.c (the lib/ call graph: tests/scripts/check_layers.py prints its
 * cycles). */
#include "handles.h"


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

const kvt__recall_ops *kvt__ctx_recall_of(const kvt_ctx *ctx, uint32_t layer,
                                          kvt__recall_site *site) {
    *site = (kvt__recall_site){.sp = &ctx->stores[layer].spec,
                               .policy = kvt__layer_policy(ctx, layer),
                               .sketch_rank = ctx->sketch_rank,
                               .block_rows = ctx->cfg.block_rows,
                               .archive_host = ctx->archive_host,
                               .archive_rows = ctx->archive_rows,
                               .max_rows = ctx->max_rows};
    for (uint32_t k = 1; k < KVT__RECALL_KINDS; k++)
        if (kvt__recall_kinds[k]->recalls(site))
            return kvt__recall_kinds[k];
    return NULL;
}
