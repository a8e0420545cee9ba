/*
 * test_estimate.c — kvt_ctx_estimate against what kvt_ctx_create allocates, on the real model
 * configs of tests/data/models: each group's pool bytes equal its layers' planes
 * (kvt_layer_data's sizes), the context built with n_pages_needed pages admits max_seqs requests
 * of max_rows_per_seq rows each with no page to spare in any group (and one page fewer refuses
 * the step), and the side planes and archive equal kvt_ctx_memory_stats' over those requests.
 */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "support/testutil.h"

typedef struct est_case {
    const char *file;
    kvt_dtype dtype;
    uint32_t page_rows, max_seqs, max_rows;
    bool archive;             /* evict_archive, archive_rows_per_seq max_rows - K - r */
    kvt_space archive_space;
    uint32_t sketch_rank;
} est_case;

static kvt_model *load(const char *file, kvt_dtype dtype) {
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = kvt_model_from_file(tu_model_path(file), dtype, &m, err, sizeof err);
    cr_assert_eq(s, KVT_OK, "%s: %s (%s)", file, kvt_status_name(s), err);
    return m;
}

static kvt_ctx_params params_of(const est_case *c, const kvt_model *m, kvt_config *cfg) {
    *cfg = kvt_config_default();
    cfg->evict_archive = c->archive;
    cfg->evict_budget_rows = 16; /* K + r = 20: a round at commit of a max_rows step */
    cfg->recent_rows = 4;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = cfg;
    p.page_rows = c->page_rows;
    p.n_pages = 3; /* the estimate's pool_bytes is at this, pool_bytes_needed at its n_pages */
    p.allocator = KVT_ALLOC_LIBC;
    p.max_seqs = c->max_seqs;
    p.max_rows_per_seq = c->max_rows;
    p.archive_rows_per_seq = c->archive ? c->max_rows - 20 : 0; /* that round fills it */
    p.archive_space = c->archive_space;
    p.recall_sketch_rank = c->sketch_rank;
    return p;
}

/* Reserve max_rows rows for every request in one step; KVT_OK or the reserve's status. *b: the
 * batch, for the commit. */
static kvt_status fill_all(kvt_ctx *ctx, const est_case *c, kvt_seq **seqs, kvt_batch **b) {
    cr_assert_eq(kvt_batch_create(ctx, c->max_seqs, b), KVT_OK);
    uint32_t n[8];
    for (uint32_t i = 0; i < c->max_seqs; i++)
        n[i] = c->max_rows;
    return kvt_batch_reserve(*b, seqs, n, c->max_seqs);
}

static void check_case(const est_case *c) {
    kvt_model *m = load(c->file, c->dtype);
    kvt_config cfg;
    kvt_ctx_params p = params_of(c, m, &cfg);
    kvt_ctx_estimate_out e;
    memset(&e, 0xab, sizeof e);
    e.struct_size = sizeof e;
    char err[512] = "";
    cr_assert_eq(kvt_ctx_estimate(&p, &e, err, sizeof err), KVT_OK, "%s: %s", c->file, err);
    const uint32_t per_seq = (c->max_rows + c->page_rows - 1) / c->page_rows;
    cr_assert_eq(e.n_pages_needed, per_seq * c->max_seqs, "%s", c->file);
    cr_assert_gt(e.n_groups, 0);

    /* The context the estimate describes, at n_pages_needed. */
    p.n_pages = e.n_pages_needed;
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s: %s", c->file, err);
    uint64_t planes[3] = {0}, pool_needed = 0;
    uint32_t first_layer[3], layers[3] = {0};
    for (uint32_t i = 0; i < kvt_model_n_layers(m); i++) {
        const int32_t g = kvt_ctx_layer_group(ctx, i);
        if (g < 0)
            continue;
        cr_assert_lt((uint32_t)g, e.n_groups, "%s layer %u", c->file, i);
        cr_assert_eq(e.groups[g].policy, kvt_ctx_layer_policy(ctx, i), "%s layer %u", c->file, i);
        if (layers[g]++ == 0)
            first_layer[g] = i;
        for (uint32_t pl = 0; pl < kvt_model_layer(m, i)->n_planes; pl++) {
            void *base;
            size_t bytes;
            cr_assert_eq(kvt_layer_data(ctx, i, pl, &base, &bytes), KVT_OK);
            planes[g] += bytes;
        }
    }
    for (uint32_t g = 0; g < e.n_groups; g++) {
        const kvt_ctx_estimate_group *x = &e.groups[g];
        cr_assert_eq(x->n_layers, layers[g], "%s group %u", c->file, g);
        cr_assert_eq(x->page_bytes, x->row_bytes * c->page_rows);
        cr_assert_eq(x->pool_bytes, x->page_bytes * 3, "%s group %u", c->file, g);
        cr_assert_eq(x->page_bytes * e.n_pages_needed, planes[g], "%s group %u: %llu B allocated",
                     c->file, g, (unsigned long long)planes[g]);
        cr_assert_eq(x->pages_needed, e.n_pages_needed);
        pool_needed += planes[g];
    }
    cr_assert_eq(e.pool_bytes_needed, pool_needed, "%s", c->file);

    /* max_seqs requests: their side planes and archives as estimated (kvt_ctx_memory_stats). */
    kvt_seq *seqs[8];
    for (uint32_t i = 0; i < c->max_seqs; i++)
        cr_assert_eq(tu_seq_create(ctx, i + 1, &seqs[i]), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_memory mem = {.struct_size = sizeof mem};
    cr_assert_eq(kvt_ctx_memory_stats(ctx, &mem), KVT_OK);
    cr_assert_eq(mem.side_bytes, e.side_bytes, "%s: %llu side bytes held, %llu estimated",
                 c->file, (unsigned long long)mem.side_bytes, (unsigned long long)e.side_bytes);
    if (c->sketch_rank)
        cr_assert_gt(e.side_bytes, 0, "%s", c->file);

    /* They fit, with no page to spare in any group. */
    kvt_batch *b;
    cr_assert_eq(fill_all(ctx, c, seqs, &b), KVT_OK, "%s: %s", c->file, kvt_last_error());
    for (uint32_t g = 0; g < e.n_groups; g++) {
        uint32_t free_pages = 1;
        cr_assert_eq(kvt_ctx_free_pages(ctx, first_layer[g], &free_pages), KVT_OK);
        cr_assert_eq(free_pages, 0, "%s group %u", c->file, g);
    }
    /* The commit's round fills each archive to its stated limit: the rows it holds (kvt_layer_stats
     * .archive_bytes over requests and layers) are the capacity estimated. */
    cr_assert_eq(kvt_batch_plan(b), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s: %s", c->file, kvt_last_error());
    cr_assert_eq(kvt_ctx_memory_stats(ctx, &mem), KVT_OK);
    cr_assert_eq(mem.archive_device_bytes + mem.archive_host_bytes, e.archive_bytes,
                 "%s: %llu archive bytes held, %llu estimated", c->file,
                 (unsigned long long)(mem.archive_device_bytes + mem.archive_host_bytes),
                 (unsigned long long)e.archive_bytes);
    cr_assert_eq(c->archive_space == KVT_SPACE_HOST ? mem.archive_device_bytes
                                                    : mem.archive_host_bytes,
                 0);
    if (c->archive)
        cr_assert_gt(e.archive_bytes, 0, "%s", c->file);
    kvt_ctx_destroy(ctx);

    /* One page fewer refuses the step. */
    p.n_pages = e.n_pages_needed - 1;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s: %s", c->file, err);
    for (uint32_t i = 0; i < c->max_seqs; i++)
        cr_assert_eq(tu_seq_create(ctx, i + 1, &seqs[i]), KVT_OK);
    kvt_status s = fill_all(ctx, c, seqs, &b);
    cr_assert_eq(s, KVT_ERR_POOL_EXHAUSTED, "%s: %s", c->file, kvt_status_name(s));
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(estimate, equals_what_the_context_allocates_on_real_models) {
    const est_case cases[] = {
        {"llama-3.1-8b.json", KVT_DTYPE_BF16, 16, 2, 100, false, KVT_SPACE_DEVICE, 0},
        {"llama-3.1-8b.json", KVT_DTYPE_BF16, 64, 3, 130, true, KVT_SPACE_HOST, 0},
        {"qwen3-8b.json", KVT_DTYPE_BF16, 32, 2, 64, true, KVT_SPACE_DEVICE, 16},
        {"deepseek-v3.json", KVT_DTYPE_BF16, 64, 2, 200, true, KVT_SPACE_DEVICE, 16},
        {"kimi-linear-48b-a3b-instruct.json", KVT_DTYPE_BF16, 16, 3, 300, false, KVT_SPACE_DEVICE,
         64},
        {"gemma-3-1b-it.json", KVT_DTYPE_BF16, 16, 4, 90, false, KVT_SPACE_DEVICE, 0},
        {"qwen3-next-80b-a3b-thinking.json", KVT_DTYPE_BF16, 64, 1, 65, false, KVT_SPACE_DEVICE, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_case(&cases[i]);
}

Test(estimate, refuses_what_it_cannot_estimate) {
    kvt_model *m = load("llama-3.1-8b.json", KVT_DTYPE_BF16);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    kvt_ctx_estimate_out e = {.struct_size = sizeof e};
    char err[256];
    cr_assert_eq(kvt_ctx_estimate(&p, &e, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "max_seqs"), "%s", err);
    cr_assert(strstr(kvt_last_error(), "max_rows_per_seq"), "%s", kvt_last_error());
    p.max_seqs = 2;
    p.max_rows_per_seq = 100;
    cr_assert_eq(kvt_ctx_estimate(NULL, &e, NULL, 0), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_estimate(&p, NULL, NULL, 0), KVT_ERR_INVALID_ARGUMENT);
    e.struct_size = 8;
    cr_assert_eq(kvt_ctx_estimate(&p, &e, NULL, 0), KVT_ERR_INVALID_ARGUMENT);
    e.struct_size = sizeof e;
    p.struct_size = 8; /* the ABI rule: below KVT_CTX_PARAMS_SIZE_MIN */
    cr_assert_eq(kvt_ctx_estimate(&p, &e, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    p.struct_size = sizeof p;
    p.page_rows = 0; /* kvt_ctx_create's own checks, on the probe */
    cr_assert_eq(kvt_ctx_estimate(&p, &e, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "page_rows"), "%s", err);
    p.page_rows = 64;
    p.model = NULL;
    cr_assert_eq(kvt_ctx_estimate(&p, &e, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    kvt_model_destroy(m);
}
