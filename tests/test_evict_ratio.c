/*
 * test_evict_ratio.c — config.evict_ratio_budget: random eviction's K from the request's ratio.
 * Requests of ratios 4 and 8 in one context keep P + ceil((T − P) / ratio) + r rows and at most
 * c − 1 more (P the protected prompt, T the request's length), every step, where the default
 * (K = evict_budget_rows for every request) never evicts a request shorter than K + r + c; the
 * state passes kvt_seq_check; a snapshot restored in another context then decides exactly as the
 * request it was taken from; a fork and a context without the option behave as stated.
 */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "support/testutil.h"

enum { R = 8, C = 8, PROMPT = 40, HEADS = 2 };

static kvt_model *one_gqa(void) {
    kvt_layer_spec s[2];
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, HEADS, 16, &s[0]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, HEADS, 16, &s[1]), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, 2, "gqa", &m, NULL, 0), KVT_OK);
    return m;
}

static kvt_ctx *ctx_of(kvt_model *m, bool ratio_budget) {
    kvt_config c = kvt_config_default();
    c.ratio = 8;
    c.recent_rows = R;
    c.cadence_rows = C;
    c.evict_ratio_budget = ratio_budget;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 1024;
    p.allocator = KVT_ALLOC_LIBC;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    return ctx;
}

static kvt_seq *seq_of(kvt_ctx *ctx, uint64_t id, uint32_t ratio) {
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = id;
    sp.prompt_rows = PROMPT;
    sp.ratio = ratio;
    kvt_seq *s;
    cr_assert_eq(kvt_seq_create(ctx, &sp, &s), KVT_OK, "%s", kvt_last_error());
    return s;
}

static uint64_t attended(const kvt_seq *s, uint32_t layer) {
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(s, layer, &ls), KVT_OK);
    return ls.attended_rows;
}

/* One step of n tokens (committed, every layer run). */
static void step(kvt_seq *s, uint32_t n) {
    cr_assert_eq(tu_reserve(s, n), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(tu_commit_run(s, n), KVT_OK, "%s", kvt_last_error());
}

/* K of the option at length T and ratio q (the prompt protected). */
static uint64_t k_of(uint64_t T, uint32_t q) {
    uint64_t K = PROMPT + (T - PROMPT + q - 1) / q;
    return K < R ? R : K;
}

/* The positions of both layers' heads of s, for comparison. */
static int64_t *positions(const kvt_seq *s, uint64_t *n_out) {
    const uint64_t cap = 4096;
    int64_t *all = calloc(4 * cap, sizeof *all);
    uint64_t n = 0;
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t h = 0; h < HEADS; h++) {
            uint64_t k;
            cr_assert_eq(kvt_seq_positions(s, l, h, all + (l * HEADS + h) * cap, cap, &k), KVT_OK);
            n = k;
        }
    *n_out = n;
    return all;
}

Test(evict_ratio, each_request_keeps_its_ratio) {
    kvt_model *m = one_gqa();
    kvt_ctx *ctx = ctx_of(m, true);
    const uint32_t ratio[2] = {4, 8};
    kvt_seq *s[2] = {seq_of(ctx, 1, ratio[0]), seq_of(ctx, 2, ratio[1])};
    uint64_t rounds_seen = 0;
    for (int k = 0; k < 2; k++)
        step(s[k], PROMPT);
    for (uint64_t T = PROMPT + 1; T <= 1500; T++)
        for (int k = 0; k < 2; k++) {
            step(s[k], 1);
            const uint64_t K = k_of(T, ratio[k]);
            for (uint32_t l = 0; l < 2; l++) {
                const uint64_t a = attended(s[k], l);
                kvt_layer_stats ls = {.struct_size = sizeof ls};
                cr_assert_eq(kvt_seq_layer_stats(s[k], l, &ls), KVT_OK);
                cr_assert_eq(ls.dropped_rows, (T - a) * HEADS);
                if (ls.rounds == 0) {
                    cr_assert_eq(a, T);
                    cr_assert_lt(T, K + R + C, "T %llu ratio %u", (unsigned long long)T, ratio[k]);
                } else {
                    rounds_seen++;
                    cr_assert(a >= K + R && a < K + R + C,
                              "T %llu ratio %u layer %u: %llu rows attended, K %llu",
                              (unsigned long long)T, ratio[k], l, (unsigned long long)a,
                              (unsigned long long)K);
                }
            }
            if (T % 250 == 0)
                cr_assert_eq(kvt_seq_check(s[k]), KVT_OK, "%s", kvt_last_error());
        }
    cr_assert_gt(rounds_seen, 0);
    /* at 1500 tokens: 40 + 365 + [8, 16) at 4x; 40 + 183 + [8, 16) at 8x */
    cr_assert(attended(s[0], 0) >= 413 && attended(s[0], 0) < 421);
    cr_assert(attended(s[1], 0) >= 231 && attended(s[1], 0) < 239);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Off (the default): K = evict_budget_rows (1024) for every request, whatever its ratio: 1000
 * tokens are all attended. */
Test(evict_ratio, off_keeps_the_configured_budget) {
    kvt_model *m = one_gqa();
    kvt_config d = kvt_config_default();
    cr_assert(!d.evict_ratio_budget);
    kvt_ctx *ctx = ctx_of(m, false);
    kvt_seq *s = seq_of(ctx, 1, 4);
    step(s, PROMPT);
    for (int t = PROMPT; t < 1000; t++)
        step(s, 1);
    cr_assert_eq(attended(s, 0), 1000);
    for (int t = 1000; t < 1100; t++)
        step(s, 1);
    cr_assert(attended(s, 0) >= 1024 + R && attended(s, 0) < 1024 + R + C);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* A snapshot taken mid-run and restored into another context goes on deciding exactly as the
 * original (same request id, same draws, K recomputed from the same lengths); a context without
 * the option refuses it, naming the field; a fork keeps the ratio. */
Test(evict_ratio, snapshot_restore_and_fork_keep_deciding_at_the_ratio) {
    kvt_model *m = one_gqa();
    kvt_ctx *a = ctx_of(m, true), *b = ctx_of(m, true), *off = ctx_of(m, false);
    kvt_seq *s = seq_of(a, 7, 4);
    step(s, PROMPT);
    for (int t = PROMPT; t < 600; t++)
        step(s, 1 + (t % 3 == 0)); /* steps of one and two tokens */
    size_t n = 0, w = 0;
    cr_assert_eq(kvt_seq_snapshot_size(s, &n), KVT_OK);
    uint8_t *buf = malloc(n);
    cr_assert_eq(kvt_seq_snapshot(s, buf, n, &w), KVT_OK, "%s", kvt_last_error());
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore(off, buf, w, &r), KVT_ERR_MISMATCH);
    cr_assert(strstr(kvt_last_error(), "evict_ratio_budget"), "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_restore(b, buf, w, &r), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(r), KVT_OK, "%s", kvt_last_error());
    kvt_seq *f;
    cr_assert_eq(kvt_seq_fork(s, 8, &f), KVT_OK, "%s", kvt_last_error());
    for (int t = 0; t < 300; t++) {
        step(s, 1);
        step(r, 1);
        step(f, 1);
    }
    uint64_t n1, n2;
    int64_t *p1 = positions(s, &n1), *p2 = positions(r, &n2);
    cr_assert_eq(n1, n2);
    cr_assert_eq(memcmp(p1, p2, sizeof *p1 * 4 * 4096), 0, "the restored request decided otherwise");
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(f, 0, &ls), KVT_OK);
    const uint64_t T = ls.appended_rows / HEADS, K = k_of(T, 4);
    cr_assert(ls.attended_rows >= K + R && ls.attended_rows < K + R + C, "fork: %llu of %llu",
              (unsigned long long)ls.attended_rows, (unsigned long long)T);
    cr_assert_eq(kvt_seq_check(f), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(r), KVT_OK, "%s", kvt_last_error());
    free(p1);
    free(p2);
    free(buf);
    kvt_ctx_destroy(a);
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(off);
    kvt_model_destroy(m);
}
