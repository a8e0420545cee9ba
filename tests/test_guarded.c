/*
 * test_guarded.c — the guarded-device backend: the CPU backend whose buffers the host cannot touch
 * outside the backend's own ops. A host read of a pool row faults; every library path that moves
 * row bytes goes through the backend, so whole cases run on it with the CPU backend's decisions
 * (test_golden runs every golden case on it too); the mprotect fallback works when no protection
 * key is left.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvtier.h"
#include "support/testutil.h"

static kvt_ctx *guarded_ctx(kvt_model **m_out) {
    kvt_layer_spec s[2];
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[0]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 16, &s[1]), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, 2, "g", &m, NULL, 0), KVT_OK);
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 8;
    c.evict_budget_rows = 16;
    c.recent_rows = 4;
    c.evict_archive = true;
    c.evict_vase = true;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 32;
    p.backend = KVT_BACKEND_GUARDED;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_str_eq(kvt_ctx_backend_name(ctx), "guarded");
    *m_out = m;
    return ctx;
}

/* Under AddressSanitizer the fault reaches ASan's SEGV handler, which reports and aborts
 * (test.sh sets abort_on_error=1). */
#if defined(__SANITIZE_ADDRESS__)
#define KVT_TEST_FAULT_SIGNAL SIGABRT
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVT_TEST_FAULT_SIGNAL SIGABRT
#endif
#endif
#ifndef KVT_TEST_FAULT_SIGNAL
#define KVT_TEST_FAULT_SIGNAL SIGSEGV
#endif

/* The proof that the guard is real: the host dereferencing the pool pointer dies. */
Test(guarded, host_touching_the_pool_faults, .signal = KVT_TEST_FAULT_SIGNAL) {
    kvt_model *m;
    kvt_ctx *ctx = guarded_ctx(&m);
    void *base;
    size_t bytes;
    cr_assert_eq(kvt_layer_data(ctx, 0, 0, &base, &bytes), KVT_OK);
    volatile uint8_t x = *(volatile uint8_t *)base; /* must not return */
    (void)x;
}

/* Rows written, closed, evicted (VaSE reads value ranges, the archive copies rows out),
 * compacted and read back, all through the backend: the bytes come back exactly. */
static void run_and_check(kvt_ctx *ctx) {
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 3, &seq), KVT_OK);
    enum { N = 200 };
    static uint8_t mla[N][1152], k[N][64], v[N][64];
    tu_rng rng = {99};
    for (int t = 0; t < N; t++) {
        for (int i = 0; i < 1152; i++)
            mla[t][i] = (uint8_t)(tu_next(&rng) & 0x3f);
        for (int i = 0; i < 64; i++) {
            k[t][i] = (uint8_t)(tu_next(&rng) & 0x3f);
            v[t][i] = (uint8_t)(tu_next(&rng) & 0x3f);
        }
        cr_assert_eq(tu_reserve(seq, 1), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, 1, mla[t], 1152), KVT_OK);
        cr_assert_eq(kvt_seq_write(seq, 1, 0, 0, 1, k[t], 64), KVT_OK);
        cr_assert_eq(kvt_seq_write(seq, 1, 1, 0, 1, v[t], 64), KVT_OK);
        cr_assert_eq(tu_commit_run(seq, 1), KVT_OK, "%s", kvt_last_error());
    }
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(seq, 1, &ls), KVT_OK);
    cr_assert_gt(ls.rounds, 5);
    uint8_t row[1152];
    for (int t = 0; t < N; t++) {
        cr_assert_eq(kvt_seq_read_row(seq, 0, 0, 0, (uint64_t)t, row, 1152), KVT_OK);
        cr_assert_eq(memcmp(row, mla[t], 1152), 0, "MLA row %d", t);
        for (uint32_t h = 0; h < 2; h++) {
            cr_assert_eq(kvt_seq_read_row(seq, 1, 0, h, (uint64_t)t, row, 32), KVT_OK);
            cr_assert_eq(memcmp(row, k[t] + 32 * h, 32), 0, "K row %d head %u", t, h);
            cr_assert_eq(kvt_seq_read_row(seq, 1, 1, h, (uint64_t)t, row, 32), KVT_OK);
            cr_assert_eq(memcmp(row, v[t] + 32 * h, 32), 0, "V row %d head %u", t, h);
        }
    }
    kvt_seq_destroy(seq);
}

Test(guarded, every_row_path_goes_through_the_backend) {
    kvt_model *m;
    kvt_ctx *ctx = guarded_ctx(&m);
    run_and_check(ctx);
    /* kvt_layer_read / kvt_layer_write: whole slots, checked. */
    uint8_t buf[3 * 1152], back[3 * 1152];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)i;
    cr_assert_eq(kvt_layer_write(ctx, 0, 0, 5, 3, buf, sizeof buf), KVT_OK);
    cr_assert_eq(kvt_layer_read(ctx, 0, 0, 5, 3, back, sizeof back), KVT_OK);
    cr_assert_eq(memcmp(buf, back, sizeof buf), 0);
    cr_assert_eq(kvt_layer_read(ctx, 0, 0, 511, 2, back, 2 * 1152), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_layer_read(ctx, 0, 0, 0, 2, back, 1152), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_layer_read(ctx, 0, 2, 0, 1, back, 1152), KVT_ERR_OUT_OF_RANGE);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* With every protection key taken (16 per process), the backend falls back to mprotect around
 * each op: the same rows come back. */
Test(guarded, mprotect_fallback_without_a_protection_key) {
    int keys[16], n = 0;
    while (n < 16 && (keys[n] = pkey_alloc(0, 0)) >= 0)
        n++;
    kvt_model *m;
    kvt_ctx *ctx = guarded_ctx(&m);
    run_and_check(ctx);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    for (int i = 0; i < n; i++)
        pkey_free(keys[i]);
}

Test(guarded, engine_memory_cannot_be_guarded) {
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&s, 1, "g", &m, NULL, 0), KVT_OK);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 4;
    p.backend = KVT_BACKEND_GUARDED;
    p.external_storage = true;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(err, "external_storage"), "%s", err);
    kvt_model_destroy(m);
}
