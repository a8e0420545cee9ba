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

/* A kvt_buffer of the guarded backend is protected like the pool. */
Test(guarded, host_touching_a_buffer_faults, .signal = KVT_TEST_FAULT_SIGNAL) {
    kvt_model *m;
    kvt_ctx *ctx = guarded_ctx(&m);
    kvt_buffer *b;
    cr_assert_eq(kvt_buffer_alloc(ctx, 4096, &b), KVT_OK);
    volatile int32_t x = *(volatile int32_t *)kvt_buffer_ptr(b); /* must not return */
    (void)x;
}

Test(guarded, buffers_copy_through_the_backend_and_refuse_bad_ranges) {
    kvt_model *m;
    kvt_ctx *ctx = guarded_ctx(&m);
    kvt_buffer *b, *b2;
    cr_assert_eq(kvt_buffer_alloc(ctx, 0, &b), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(b);
    cr_assert_eq(kvt_buffer_alloc(NULL, 8, &b), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_buffer_alloc(ctx, 100, &b), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, 10, &b2), KVT_OK); /* freed by kvt_ctx_destroy */
    cr_assert_eq(kvt_buffer_size(b), 100);
    uint8_t in[100], out[100] = {0};
    for (int i = 0; i < 100; i++)
        in[i] = (uint8_t)(i * 7 + 1);
    uint8_t zero[100] = {0};
    cr_assert_eq(kvt_buffer_read(b, 0, out, 100), KVT_OK);
    cr_assert_eq(memcmp(out, zero, 100), 0, "zeroed at allocation");
    cr_assert_eq(kvt_buffer_write(b, 0, in, 100), KVT_OK);
    cr_assert_eq(kvt_buffer_read_async(b, 10, out, 50, NULL), KVT_OK);
    cr_assert_eq(memcmp(out, in + 10, 50), 0);
    cr_assert_eq(kvt_buffer_write_async(b, 99, in, 1, NULL), KVT_OK);
    cr_assert_eq(kvt_buffer_read(b, 99, out, 1), KVT_OK);
    cr_assert_eq(out[0], in[0]);
    cr_assert_eq(kvt_buffer_read(b, 60, out, 41), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_buffer_write(b, 101, in, 0), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_buffer_write(b, SIZE_MAX, in, 2), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_buffer_read(b, 0, NULL, 4), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_buffer_read(NULL, 0, out, 4), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_buffer_read(b, 0, out, 100), KVT_OK, "the buffer is unchanged by refusals");
    cr_assert_eq(out[99], in[0]);
    cr_assert_eq(memcmp(out, in, 99), 0);
    kvt_buffer_free(b);
    kvt_buffer_free(NULL);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* The emission lives in the backend's memory: on the guarded backend kvt_batch_run writes it into
 * protected kvt_buffer memory (a host write would fault), and what comes back equals the CPU
 * backend's emission of the same steps, both layouts, one set per request and per query token. */
Test(guarded, emission_into_protected_buffers_equals_the_cpu_backends) {
    kvt_model *m;
    kvt_ctx *g = guarded_ctx(&m);
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config c = *kvt_ctx_config(g);
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 32;
    kvt_ctx *h;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &h, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx *ctx[2] = {g, h};
    kvt_seq *seq[2][2];
    kvt_batch *b[2];
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(tu_seq_create(ctx[k], 1, &seq[k][0]), KVT_OK);
        cr_assert_eq(tu_seq_create(ctx[k], 2, &seq[k][1]), KVT_OK);
        cr_assert_eq(kvt_batch_create(ctx[k], 2, &b[k]), KVT_OK);
    }
    enum { TOPK = 256, SQ = 3 };
    kvt_buffer *bi, *bl, *bp, *bd;
    cr_assert_eq(kvt_buffer_alloc(g, sizeof(int32_t) * 2 * SQ * TOPK, &bi), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(g, sizeof(int32_t) * 2 * SQ, &bl), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(g, sizeof(int32_t) * (2 * SQ + 1), &bp), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(g, 2, &bd), KVT_OK);
    static int32_t hi[2 * SQ * TOPK], back[2 * SQ * TOPK];
    int32_t hl[2 * SQ], hp[2 * SQ + 1], bl_back[2 * SQ], bp_back[2 * SQ + 1];
    uint8_t hd[2], bd_back[2];
    tu_rng rng = {7};
    uint32_t packed = 0;
    for (int step = 0; step < 120; step++) {
        uint32_t n[2] = {step == 0 ? 40 : 1 + (uint32_t)(tu_next(&rng) % SQ), 1};
        uint32_t drafts[2] = {n[0] - 1, 0};
        for (int k = 0; k < 2; k++) {
            cr_assert_eq(kvt_batch_reserve_drafts(b[k], seq[k], n, drafts, 2), KVT_OK, "%s",
                         kvt_last_error());
            for (int r = 0; r < 2; r++)
                for (uint32_t l = 0; l < 2; l++) {
                    const kvt_layer_spec *sp = kvt_model_layer(m, l);
                    size_t tb = (size_t)sp->n_kv_heads * sp->row_bytes;
                    uint8_t buf[1152];
                    for (uint32_t pl = 0; pl < sp->n_planes; pl++)
                        for (uint32_t t = 0; t < n[r]; t++) {
                            for (size_t i = 0; i < tb; i++)
                                buf[i] = (uint8_t)((step * 31 + r * 17 + t * 5 + pl + i * 3) & 0x3f);
                            cr_assert_eq(kvt_seq_write(seq[k][r], l, pl, t, 1, buf, tb), KVT_OK);
                        }
                }
            cr_assert_eq(kvt_batch_plan(b[k]), KVT_OK);
        }
        for (uint32_t l = 0; l < 2; l++) {
            bool csr = (step + l) % 2;
            uint32_t sq = step % 3 == 0 ? 1 : SQ;
            if (step == 0)
                sq = 1; /* the 40-token prompt: one set */
            kvt_emit eg = {.struct_size = sizeof eg, .layout = csr ? KVT_EMIT_CSR : KVT_EMIT_TOKENS,
                           .indices = kvt_buffer_ptr(bi),
                           .capacity = csr ? 2 * SQ * TOPK : TOPK,
                           .lengths = kvt_buffer_ptr(bl), .indptr = kvt_buffer_ptr(bp),
                           .dense = kvt_buffer_ptr(bd), .queries_per_seq = sq};
            kvt_emit eh = eg;
            eh.indices = hi;
            eh.lengths = hl;
            eh.indptr = hp;
            eh.dense = hd;
            cr_assert_eq(kvt_batch_run(b[0], l, NULL, NULL, &eg), KVT_OK, "%s", kvt_last_error());
            cr_assert_eq(kvt_batch_run(b[1], l, NULL, NULL, &eh), KVT_OK, "%s", kvt_last_error());
            uint32_t nq = 2 * sq;
            size_t ni = csr ? (size_t)0 : (size_t)nq * TOPK;
            if (csr) {
                cr_assert_eq(kvt_buffer_read(bp, 0, bp_back, sizeof(int32_t) * (nq + 1)), KVT_OK);
                cr_assert_eq(memcmp(bp_back, hp, sizeof(int32_t) * (nq + 1)), 0, "step %d", step);
                ni = (size_t)hp[nq];
            } else {
                cr_assert_eq(kvt_buffer_read(bl, 0, bl_back, sizeof(int32_t) * nq), KVT_OK);
                cr_assert_eq(memcmp(bl_back, hl, sizeof(int32_t) * nq), 0, "step %d", step);
            }
            cr_assert_eq(kvt_buffer_read(bi, 0, back, sizeof(int32_t) * ni), KVT_OK);
            cr_assert_eq(memcmp(back, hi, sizeof(int32_t) * ni), 0, "step %d layer %u", step, l);
            cr_assert_eq(kvt_buffer_read(bd, 0, bd_back, 2), KVT_OK);
            cr_assert_eq(memcmp(bd_back, hd, 2), 0);
            packed += (uint32_t)ni;
        }
        for (int k = 0; k < 2; k++) {
            uint32_t acc[2] = {n[0] - (uint32_t)(step % 2 && n[0] > 1), 1};
            cr_assert_eq(kvt_batch_commit(b[k], acc), KVT_OK, "%s", kvt_last_error());
        }
    }
    cr_assert_gt(packed, 10000);
    cr_assert_eq(kvt_seq_check(seq[0][0]), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(g); /* frees its buffers and batches */
    kvt_ctx_destroy(h);
    kvt_model_destroy(m);
}

/* Host arrays handed to a run where the backend's memory is asked for are the caller's error:
 * kvt_batch_run and kvt_batch_plan_device answer KVT_ERR_INVALID_ARGUMENT naming the argument,
 * before any work (the same step then runs with kvt_buffer memory), not KVT_ERR_INVARIANT from
 * the op that would have touched them (a library bug by the header). An array of the backend's
 * that is too small for what the step writes is refused the same way. */
Test(guarded, host_arrays_handed_to_a_run_are_the_callers_error) {
    kvt_model *m;
    kvt_ctx *ctx = guarded_ctx(&m);
    kvt_seq *seq;
    kvt_batch *b;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(kvt_batch_create(ctx, 1, &b), KVT_OK);
    enum { TOPK = 1025 }; /* the backend's buffers are whole 4096-B pages: one int past one */
    kvt_buffer *bi, *bl, *bp, *bd, *small;
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof(int32_t) * TOPK, &bi), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof(int32_t), &bl), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof(int32_t) * 2, &bp), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, 1, &bd), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, 4096, &small), KVT_OK);
    static int32_t hi[TOPK];
    int32_t hl[1], hp[2];
    uint8_t hd[1];
    const kvt_emit good = {.struct_size = sizeof good, .layout = KVT_EMIT_TOKENS,
                           .indices = kvt_buffer_ptr(bi), .capacity = TOPK,
                           .lengths = kvt_buffer_ptr(bl), .indptr = kvt_buffer_ptr(bp),
                           .dense = kvt_buffer_ptr(bd)};
    struct {
        kvt_emit e;
        const char *named;
    } bad[6];
    for (int i = 0; i < 6; i++)
        bad[i].e = good;
    bad[0].e.indices = hi, bad[0].named = "emit.indices";
    bad[1].e.lengths = hl, bad[1].named = "emit.lengths";
    bad[2].e.dense = hd, bad[2].named = "emit.dense";
    bad[3].e.indices = kvt_buffer_ptr(small), bad[3].named = "emit.indices"; /* a page: one int short */
    bad[4].e.layout = KVT_EMIT_CSR, bad[4].e.indptr = hp, bad[4].named = "emit.indptr";
    bad[5].e.layout = KVT_EMIT_CSR, bad[5].e.capacity = 2049, bad[5].named = "emit.indices"; /* 2 pages + 1 */
    for (uint32_t step = 0; step < 3; step++) {
        uint32_t n = step == 0 ? 20 : 1;
        cr_assert_eq(kvt_batch_reserve(b, &seq, &n, 1), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_batch_plan(b), KVT_OK, "%s", kvt_last_error());
        for (uint32_t l = 0; l < 2; l++) {
            for (int i = 0; i < 6; i++) {
                cr_assert_eq(kvt_batch_run(b, l, NULL, NULL, &bad[i].e), KVT_ERR_INVALID_ARGUMENT,
                             "case %d", i);
                cr_assert(strstr(kvt_last_error(), bad[i].named), "case %d: %s", i,
                          kvt_last_error());
                cr_assert(strstr(kvt_last_error(), "guarded backend's memory"), "%s",
                          kvt_last_error());
            }
            if (step == 1 && l == 0) { /* before any run: the planned path checks them too */
                bool planned = true;
                kvt_emit pe = bad[0].e;
                cr_assert_eq(kvt_batch_plan_device(b, &pe, 1, NULL, &planned),
                             KVT_ERR_INVALID_ARGUMENT);
                cr_assert(!planned);
                cr_assert(strstr(kvt_last_error(), "emits[0].indices"), "%s", kvt_last_error());
            }
            cr_assert_eq(kvt_batch_run(b, l, NULL, NULL, &good), KVT_OK, "%s", kvt_last_error());
            int32_t len = -1;
            cr_assert_eq(kvt_buffer_read(bl, 0, &len, sizeof len), KVT_OK);
            cr_assert_eq(len, step == 0 ? 20 : 20 + (int32_t)step, "layer %u", l);
        }
        cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    }
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}
