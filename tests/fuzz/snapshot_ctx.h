/* snapshot_ctx.h — the model, configuration and context that fuzz_snapshot restores into and
 * make_snapshot_seeds writes its seeds from (they must agree, or every seed is a mismatch): a
 * salience layer (MLA-NoPE), random eviction with its archive (GQA-RoPE, 2 heads), a sliding
 * layer (window 12) and a no-KV layer; blocks of 64 rows, K = 16, r = 4. */
#ifndef KVT_TESTS_FUZZ_SNAPSHOT_CTX_H
#define KVT_TESTS_FUZZ_SNAPSHOT_CTX_H

#include "kvtier.h"

static inline kvt_ctx *fuzz_snapshot_ctx(kvt_model **model, uint32_t n_pages) {
    kvt_layer_spec s[4];
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 8, 16, &s[0]);
    kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 4, &s[1]);
    kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 1, 4, &s[2]);
    s[2].sliding_window = 12;
    s[3] = (kvt_layer_spec){.kind = KVT_LAYER_NO_KV};
    if (kvt_model_create(s, 4, "fuzz-snapshot", model, NULL, 0) != KVT_OK)
        return NULL;
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 4;
    c.sink_rows = 2;
    c.evict_budget_rows = 16;
    c.recent_rows = 4;
    c.evict_archive = true;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = *model;
    p.config = &c;
    p.page_rows = 4;
    p.n_pages = n_pages;
    p.allocator = KVT_ALLOC_LIBC;
    kvt_ctx *ctx = NULL;
    if (kvt_ctx_create(&p, &ctx, NULL, 0) != KVT_OK) {
        kvt_model_destroy(*model);
        *model = NULL;
    }
    return ctx;
}

#endif
