/*
 * test_batch.c — the engine API v2 step timeline (kvtier.h): batch reserve all or nothing over
 * requests, vLLM's slot_mapping, plan / run / commit and their order rules, both emission
 * layouts, per-request settings, and the same decisions whether the work happens in the runs or
 * at commit (the golden files check the latter over whole cases; here, the rules).
 */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "support/testutil.h"

/* Two groups: an MLA-NoPE salience layer (1 head) and two GQA-RoPE evict layers (2 heads). */
static kvt_model *mixed_model(void) {
    kvt_layer_spec s[3];
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[0]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 16, &s[1]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 16, &s[2]), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, 3, "mixed", &m, NULL, 0), KVT_OK);
    return m;
}

/* block 64, ratio 8, K 32, r = c = 8, pages of 16 rows, no archive: the shared test context. */
static kvt_ctx *mixed_ctx(kvt_model *m, uint32_t n_pages) {
    kvt_ctx *ctx = tu_mixed_ctx(m, false, n_pages);
    cr_assert_not_null(ctx, "%s", kvt_last_error());
    return ctx;
}

static void fill_rows(kvt_seq *seq, const kvt_model *m, uint32_t n, uint32_t seed) {
    uint8_t buf[2048];
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++) {
        const kvt_layer_spec *s = kvt_model_layer(m, l);
        size_t tb = (size_t)s->n_kv_heads * s->row_bytes;
        for (uint32_t pl = 0; pl < s->n_planes; pl++)
            for (uint32_t i = 0; i < n; i++) {
                for (size_t k = 0; k < tb; k++)
                    buf[k] = (uint8_t)(seed * 131 + l * 17 + pl * 7 + i * 3 + k) & 0x3f;
                cr_assert_eq(kvt_seq_write(seq, l, pl, i, 1, buf, tb), KVT_OK, "%s",
                             kvt_last_error());
            }
    }
}

static kvt_seq *new_seq(kvt_ctx *ctx, uint64_t id) {
    kvt_seq *s;
    cr_assert_eq(tu_seq_create(ctx, id, &s), KVT_OK);
    return s;
}

static uint32_t free_pages(kvt_ctx *ctx, uint32_t layer) {
    uint32_t f;
    cr_assert_eq(kvt_ctx_free_pages(ctx, layer, &f), KVT_OK);
    return f;
}

Test(batch, reserve_is_all_or_nothing_over_requests) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 6); /* 6 pages of 16 rows per group */
    kvt_seq *s[3] = {new_seq(ctx, 1), new_seq(ctx, 2), new_seq(ctx, 3)};
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 3, &b), KVT_OK);
    uint32_t n[3] = {32, 48, 32}; /* 2 + 3 + 2 pages > 6 */
    uint32_t f0 = free_pages(ctx, 0), f1 = free_pages(ctx, 1);
    cr_assert_eq(kvt_batch_reserve(b, s, n, 3), KVT_ERR_POOL_EXHAUSTED);
    cr_assert(strstr(kvt_last_error(), "seqs[2]") && strstr(kvt_last_error(), "request 3") &&
                  strstr(kvt_last_error(), "nothing was reserved"),
              "%s", kvt_last_error());
    cr_assert_eq(free_pages(ctx, 0), f0);
    cr_assert_eq(free_pages(ctx, 1), f1);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvt_seq_pending(s[i]), 0);
    /* The batch is still usable: a smaller step goes through. */
    n[1] = 16;
    cr_assert_eq(kvt_batch_reserve(b, s, n, 3), KVT_OK, "%s", kvt_last_error());
    /* Misuse while a step is in flight. */
    cr_assert_eq(kvt_batch_reserve(b, s, n, 3), KVT_ERR_BAD_STATE);
    kvt_batch *b2;
    cr_assert_eq(kvt_batch_create(ctx, 2, &b2), KVT_OK);
    cr_assert_eq(kvt_batch_reserve(b2, s, n, 1), KVT_ERR_BAD_STATE); /* s[0] is in b's step */
    kvt_seq *dup[2] = {new_seq(ctx, 9), NULL};
    dup[1] = dup[0];
    uint32_t nd[2] = {1, 1};
    cr_assert_eq(kvt_batch_reserve(b2, dup, nd, 2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_batch_reserve(b2, s, n, 3), KVT_ERR_CAPACITY);
    for (int i = 0; i < 3; i++)
        fill_rows(s[i], m, n[i], (uint32_t)i);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvt_seq_length(s[i]), n[i]);
    kvt_batch_destroy(b2);
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(batch, slot_mapping_is_vllms_layout) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 32);
    kvt_seq *s[2] = {new_seq(ctx, 1), new_seq(ctx, 2)};
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 2, &b), KVT_OK);
    uint32_t n[2] = {5, 20};
    cr_assert_eq(kvt_batch_reserve(b, s, n, 2), KVT_OK);
    for (uint32_t l = 0; l < 3; l++) {
        int32_t map[25];
        uint32_t total = 0;
        cr_assert_eq(kvt_batch_slot_mapping(b, l, map, 24, &total), KVT_ERR_CAPACITY);
        cr_assert_eq(total, 25);
        cr_assert_eq(kvt_batch_slot_mapping(b, l, map, 25, &total), KVT_OK);
        /* int64 (vLLM's dtype): the same slots, widened; the same capacity rule. */
        int64_t map64[26];
        map64[25] = -7;
        cr_assert_eq(kvt_batch_slot_mapping64(b, l, map64, 24, &total), KVT_ERR_CAPACITY);
        cr_assert_eq(kvt_batch_slot_mapping64(b, l, map64, 26, &total), KVT_OK);
        cr_assert_eq(total, 25);
        cr_assert_eq(map64[25], -7, "nothing written past the step's tokens");
        for (uint32_t t = 0; t < 25; t++)
            cr_assert_eq(map64[t], (int64_t)map[t], "layer %u token %u", l, t);
        uint32_t t = 0;
        for (int i = 0; i < 2; i++)
            for (uint32_t j = 0; j < n[i]; j++, t++) {
                int32_t slot;
                cr_assert_eq(kvt_seq_reserved_slot(s[i], l, j, &slot), KVT_OK);
                cr_assert_eq(map[t], slot, "layer %u token %u", l, t);
            }
        /* Distinct slots across requests (no two tokens share a slot in a group). */
        for (uint32_t a = 0; a < 25; a++)
            for (uint32_t c = a + 1; c < 25; c++)
                cr_assert_neq(map[a], map[c]);
    }
    cr_assert_eq(kvt_batch_slot_mapping(b, 7, NULL, 0, &n[0]), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_batch_slot_mapping64(b, 7, NULL, 0, &n[0]), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_batch_slot_mapping64(b, 0, NULL, 25, &n[0]), KVT_ERR_INVALID_ARGUMENT);
    fill_rows(s[0], m, 5, 0);
    fill_rows(s[1], m, 20, 1);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK);
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* The order rules of the timeline, each with its status, and both emission layouts. */
Test(batch, timeline_rules_and_layouts) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 64);
    kvt_seq *s[2] = {new_seq(ctx, 1), new_seq(ctx, 2)};
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 2, &b), KVT_OK);
    int32_t idx[2 * 128], len[2], indptr[3];
    uint8_t dense[2] = {7, 7};
    kvt_emit tok = {.struct_size = sizeof tok, .layout = KVT_EMIT_TOKENS, .indices = idx,
                    .capacity = 128, .lengths = len, .dense = dense};
    cr_assert_eq(kvt_batch_plan(b), KVT_ERR_BAD_STATE);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_ERR_BAD_STATE);
    uint32_t n[2] = {40, 3};
    cr_assert_eq(kvt_batch_reserve(b, s, n, 2), KVT_OK);
    cr_assert_eq(kvt_batch_run(b, 0, NULL, NULL, &tok), KVT_ERR_BAD_STATE); /* before plan */
    fill_rows(s[0], m, 40, 3);
    fill_rows(s[1], m, 3, 4);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    /* By-position queries wait for the commit. */
    kvt_row_state st;
    cr_assert_eq(kvt_seq_row_state(s[0], 0, 0, 0, &st, NULL), KVT_ERR_BAD_STATE);
    cr_assert(strstr(kvt_last_error(), "step in flight"), "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(s[0]), KVT_ERR_BAD_STATE);
    uint32_t topk, total;
    cr_assert_eq(kvt_batch_capacity(b, 1, &topk, &total), KVT_OK);
    cr_assert_eq(topk, 40);
    cr_assert_eq(total, 43);
    /* Bad emit descriptors. */
    kvt_emit bad = tok;
    bad.struct_size = 8;
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, &bad), KVT_ERR_INVALID_ARGUMENT);
    bad = tok;
    bad.layout = (kvt_emit_layout)9;
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, &bad), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, NULL), KVT_ERR_INVALID_ARGUMENT);
    /* Too small: the layer's work is done, nothing emitted. */
    bad = tok;
    bad.capacity = 39;
    memset(idx, 0x55, sizeof idx);
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, &bad), KVT_ERR_CAPACITY);
    cr_assert_eq(idx[0], 0x55555555);
    /* Tokens layout: ascending slots, -1 padding, lengths; dense flags 0. */
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, &tok), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(len[0], 40);
    cr_assert_eq(len[1], 3);
    cr_assert_eq(dense[0], 0);
    cr_assert_eq(dense[1], 0);
    for (int i = 0; i < 2; i++)
        for (int j = len[i]; j < 128; j++)
            cr_assert_eq(idx[i * 128 + j], -1);
    for (int j = 0; j < 40; j++) {
        int32_t slot;
        cr_assert_eq(kvt_seq_reserved_slot(s[0], 1, (uint32_t)j, &slot), KVT_OK);
        cr_assert_eq(idx[j], slot, "row %d", j);
    }
    /* Writing a layer after its run is refused (its rows may have moved). */
    uint8_t row[64] = {0};
    cr_assert_eq(kvt_seq_write(s[0], 1, 0, 0, 1, row, 64), KVT_ERR_BAD_STATE);
    cr_assert_eq(kvt_seq_write(s[0], 2, 0, 0, 1, row, 64), KVT_OK); /* layer 2 has not run */
    /* CSR layout of the same layer (a second run of a layer only emits). */
    int32_t csr[64];
    kvt_emit c = {.struct_size = sizeof c, .layout = KVT_EMIT_CSR, .indices = csr,
                  .capacity = 43, .indptr = indptr};
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, &c), KVT_OK);
    cr_assert_eq(indptr[0], 0);
    cr_assert_eq(indptr[1], 40);
    cr_assert_eq(indptr[2], 43);
    cr_assert_eq(memcmp(csr, idx, 40 * sizeof *csr), 0);
    cr_assert_eq(memcmp(csr + 40, idx + 128, 3 * sizeof *csr), 0);
    c.capacity = 42;
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, &c), KVT_ERR_CAPACITY);
    /* Rejecting a token that was not reserved as a draft: refused, nothing committed, the step
     * stays open. */
    uint32_t acc[2] = {40, 2};
    cr_assert_eq(kvt_batch_commit(b, acc), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "only drafts may be rejected"), "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_length(s[1]), 0);
    acc[1] = 4;
    cr_assert_eq(kvt_batch_commit(b, acc), KVT_ERR_INVALID_ARGUMENT);
    acc[1] = 3;
    cr_assert_eq(kvt_batch_commit(b, acc), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_length(s[0]), 40);
    cr_assert_eq(kvt_seq_length(s[1]), 3);
    cr_assert_eq(kvt_seq_check(s[0]), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(s[1]), KVT_OK, "%s", kvt_last_error());
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* The engine's order within a step — layer 1 runs (and compacts in a round) before layer 2's
 * rows are written at the slots slot_mapping gave — keeps every row: the round of layer 1 moves
 * only layer 1's rows, pages go back only at commit. The final state equals a run where all work
 * happened at commit, row by row. */
Test(batch, rounds_in_runs_equal_rounds_at_commit) {
    kvt_model *m = mixed_model();
    kvt_ctx *ca = mixed_ctx(m, 64), *cb = mixed_ctx(m, 64);
    kvt_seq *a = new_seq(ca, 5), *bq = new_seq(cb, 5);
    kvt_batch *ba, *bb;
    cr_assert_eq(kvt_batch_create(ca, 1, &ba), KVT_OK);
    cr_assert_eq(kvt_batch_create(cb, 1, &bb), KVT_OK);
    uint32_t rounds_in_step = 0;
    uint64_t total = 0;
    for (int step = 0; step < 40; step++) {
        uint32_t n = 1 + (uint32_t)(step * 7 % 9);
        cr_assert_eq(kvt_batch_reserve(ba, &a, &n, 1), KVT_OK);
        cr_assert_eq(kvt_batch_reserve(bb, &bq, &n, 1), KVT_OK);
        fill_rows(bq, m, n, (uint32_t)step);
        cr_assert_eq(kvt_batch_commit(bb, NULL), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_batch_plan(ba), KVT_OK);
        kvt_layer_stats before = {.struct_size = sizeof before};
        for (uint32_t l = 0; l < 3; l++) {
            /* write this layer only, then run it */
            uint8_t buf[2048];
            const kvt_layer_spec *s = kvt_model_layer(m, l);
            size_t tb = (size_t)s->n_kv_heads * s->row_bytes;
            for (uint32_t pl = 0; pl < s->n_planes; pl++)
                for (uint32_t i = 0; i < n; i++) {
                    for (size_t k = 0; k < tb; k++)
                        buf[k] = (uint8_t)((uint32_t)step * 131 + l * 17 + pl * 7 + i * 3 + k) &
                                 0x3f;
                    cr_assert_eq(kvt_seq_write(a, l, pl, i, 1, buf, tb), KVT_OK);
                }
            int32_t idx[512], len;
            kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                          .capacity = 512, .lengths = &len};
            cr_assert_eq(kvt_batch_run(ba, l, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
            if (l == 1 && total + n >= 32 + 8 + 8 && len == 32 + 8)
                rounds_in_step++;
        }
        (void)before;
        cr_assert_eq(kvt_batch_commit(ba, NULL), KVT_OK, "%s", kvt_last_error());
        total += n;
        cr_assert_eq(kvt_seq_check(a), KVT_OK, "%s", kvt_last_error());
        /* Same positions and the same bytes at them, every layer and head. */
        char why[256] = "";
        cr_assert_eq(tu_same_rows(a, bq, why, sizeof why), KVT_OK, "step %d: %s", step, why);
    }
    cr_assert_gt(rounds_in_step, 3, "rounds ran inside runs: %u", rounds_in_step);
    kvt_batch_destroy(ba);
    kvt_batch_destroy(bb);
    kvt_ctx_destroy(ca);
    kvt_ctx_destroy(cb);
    kvt_model_destroy(m);
}

/* Per-request settings: a request's own ratio keeps its own m; a bad one is refused by name. */
Test(batch, per_request_ratio) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 64); /* context ratio 8 */
    kvt_seq_params p = kvt_seq_default_params();
    p.request_id = 1;
    kvt_seq *r8, *r32;
    cr_assert_eq(kvt_seq_create(ctx, &p, &r8), KVT_OK);
    p.ratio = 32;
    p.request_id = 2;
    cr_assert_eq(kvt_seq_create(ctx, &p, &r32), KVT_OK);
    p.ratio = (1u << 20) + 1;
    kvt_seq *bad = (kvt_seq *)1;
    cr_assert_eq(kvt_seq_create(ctx, &p, &bad), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "ratio"), "%s", kvt_last_error());
    cr_assert_null(bad);
    p.ratio = 0;
    p.recall = KVT_RECALL_ON;
    cr_assert_eq(kvt_seq_create(ctx, &p, &bad), KVT_ERR_UNSUPPORTED);
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 2, &b), KVT_OK);
    kvt_seq *s[2] = {r8, r32};
    uint32_t n[2] = {256, 256};
    cr_assert_eq(kvt_batch_reserve(b, s, n, 2), KVT_OK);
    fill_rows(r8, m, 256, 1);
    fill_rows(r32, m, 256, 1);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats a = {.struct_size = sizeof a}, c = {.struct_size = sizeof c};
    cr_assert_eq(kvt_seq_layer_stats(r8, 0, &a), KVT_OK);
    cr_assert_eq(kvt_seq_layer_stats(r32, 0, &c), KVT_OK);
    cr_assert_eq(a.closed_rows, 256);
    cr_assert(a.kept_rows + a.sink_rows <= 4 + 32 && a.kept_rows + a.sink_rows >= 32,
              "ratio 8 keeps m = 32 (+ 4 sinks), got %llu",
              (unsigned long long)(a.kept_rows + a.sink_rows));
    cr_assert(c.kept_rows + c.sink_rows <= 4 + 8, "ratio 32 keeps m = 8 (+ 4 sinks), got %llu",
              (unsigned long long)(c.kept_rows + c.sink_rows));
    cr_assert(a.kept_rows > c.kept_rows, "ratio 8 keeps %llu, ratio 32 %llu",
              (unsigned long long)a.kept_rows, (unsigned long long)c.kept_rows);
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Lifetime: destroying a request mid-step, or a batch before any run, loses no page. */
Test(batch, lifetimes) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 16);
    uint32_t f0 = free_pages(ctx, 0), f1 = free_pages(ctx, 1);
    kvt_seq *s[2] = {new_seq(ctx, 1), new_seq(ctx, 2)};
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 2, &b), KVT_OK);
    uint32_t n[2] = {20, 20};
    cr_assert_eq(kvt_batch_reserve(b, s, n, 2), KVT_OK);
    kvt_batch_destroy(b); /* abandoned before any run: reservations given back */
    cr_assert_eq(free_pages(ctx, 0), f0);
    cr_assert_eq(free_pages(ctx, 1), f1);
    cr_assert_eq(kvt_seq_pending(s[0]), 0);
    cr_assert_eq(kvt_batch_create(ctx, 2, &b), KVT_OK);
    cr_assert_eq(kvt_batch_reserve(b, s, n, 2), KVT_OK);
    fill_rows(s[0], m, 20, 0);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    kvt_seq_destroy(s[1]); /* leaves the step; its pages go back */
    int32_t idx[2 * 32], len[2];
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = 32, .lengths = len};
    cr_assert_eq(kvt_batch_run(b, 0, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(len[0], 20);
    cr_assert_eq(len[1], 0);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_length(s[0]), 20);
    kvt_seq_destroy(s[0]);
    cr_assert_eq(free_pages(ctx, 0), f0);
    cr_assert_eq(free_pages(ctx, 1), f1);
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* F1 (issue 32): a request destroyed mid-step keeps its entries of the step's slot_mapping, as
 * -1 (kvtier.h, kvt_seq_destroy): the count and every later request's indices are those the
 * engine was given before, so its cache-write kernel still writes A's rows where A reads them.
 * The reproducer: {B: 5 tokens, A: 3}, B destroyed, gave n = 3 (8 9 10) instead of n = 8. */
Test(batch, destroyed_request_keeps_its_slot_mapping_entries) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 16);
    kvt_seq *s[2] = {new_seq(ctx, 1), new_seq(ctx, 2)}; /* B, A */
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 2, &b), KVT_OK);
    uint32_t n[2] = {5, 3};
    cr_assert_eq(kvt_batch_reserve(b, s, n, 2), KVT_OK);
    for (uint32_t l = 0; l < 3; l++) {
        int32_t before[8], after[8];
        uint32_t nb = 0, na = 0;
        cr_assert_eq(kvt_batch_slot_mapping(b, l, before, 8, &nb), KVT_OK);
        cr_assert_eq(nb, 8);
        if (l == 0)
            kvt_seq_destroy(s[0]);
        cr_assert_eq(kvt_batch_slot_mapping(b, l, after, 8, &na), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(na, 8, "layer %u: %u entries after the destroy", l, na);
        for (uint32_t t = 0; t < 8; t++) {
            int32_t want = t < 5 ? -1 : before[t];
            if (l > 0 && t < 5)
                cr_assert_eq(before[t], -1);
            cr_assert_eq(after[t], want, "layer %u token %u: %d, want %d", l, t, after[t], want);
        }
    }
    fill_rows(s[1], m, 3, 0);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    int32_t idx[2 * 32], len[2];
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = 32, .lengths = len};
    cr_assert_eq(kvt_batch_run(b, 0, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(len[0], 0);
    cr_assert_eq(len[1], 3);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_length(s[1]), 3);
    cr_assert_eq(kvt_seq_check(s[1]), KVT_OK, "%s", kvt_last_error());
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* F3 (issue 32): a batch destroyed after a run of its step leaves its requests holding a step
 * that can be neither committed nor undone (kvtier.h, kvt_batch_destroy): every call on such a
 * request that would change or check it answers KVT_ERR_BAD_STATE, kvt_seq_check included (it
 * said KVT_ERR_INVARIANT, "salience state at 4 rows, table at 0": a library bug by the header);
 * kvt_seq_destroy gives every page back. */
Test(batch, a_request_orphaned_after_a_run_answers_bad_state) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 64);
    const uint32_t f0 = free_pages(ctx, 0), f1 = free_pages(ctx, 1);
    kvt_seq *s = new_seq(ctx, 1);
    for (int k = 0; k < 3; k++) { /* past a block close and a round */
        cr_assert_eq(tu_reserve(s, 30), KVT_OK, "%s", kvt_last_error());
        fill_rows(s, m, 30, (uint32_t)k);
        cr_assert_eq(tu_commit_run(s, 30), KVT_OK, "%s", kvt_last_error());
    }
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 1, &b), KVT_OK);
    uint32_t n = 4;
    cr_assert_eq(kvt_batch_reserve(b, &s, &n, 1), KVT_OK, "%s", kvt_last_error());
    fill_rows(s, m, 4, 9);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    int32_t idx[128], len[1];
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = 128, .lengths = len};
    for (uint32_t l = 0; l < 3; l++)
        cr_assert_eq(kvt_batch_run(b, l, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    kvt_batch_destroy(b);
    cr_assert_eq(kvt_seq_check(s), KVT_ERR_BAD_STATE, "%s", kvt_last_error());
    cr_assert(strstr(kvt_last_error(), "destroy it") != NULL, "%s", kvt_last_error());
    kvt_seq *x = (kvt_seq *)&x;
    cr_assert_eq(kvt_seq_fork(s, 7, &x), KVT_ERR_BAD_STATE, "%s", kvt_last_error());
    cr_assert_null(x);
    cr_assert_eq(kvt_batch_create(ctx, 1, &b), KVT_OK);
    cr_assert_eq(kvt_batch_reserve(b, &s, &n, 1), KVT_ERR_BAD_STATE, "%s", kvt_last_error());
    kvt_batch_destroy(b);
    kvt_seq_destroy(s);
    cr_assert_eq(free_pages(ctx, 0), f0);
    cr_assert_eq(free_pages(ctx, 1), f1);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Page sizes are arbitrary (vLLM's hybrid allocator uses 528-, 672- and 7,808-token blocks for
 * Kimi-Linear-style models): the same steps give the same states and bytes at every position with
 * pages of 16, 528, 672 and 7,808 rows (slots differ; decisions and rows may not). */
Test(batch, odd_page_sizes_decide_alike) {
    const uint32_t sizes[4] = {16, 528, 672, 7808};
    kvt_model *m = mixed_model();
    kvt_ctx *ctx[4];
    kvt_seq *seq[4];
    for (int k = 0; k < 4; k++) {
        kvt_config c = kvt_config_default();
        c.block_rows = 64;
        c.kappa = 4;
        c.ratio = 8;
        c.evict_budget_rows = 32;
        c.recent_rows = 8;
        c.cadence_rows = 8;
        kvt_ctx_params p = kvt_ctx_default_params();
        p.model = m;
        p.config = &c;
        p.page_rows = sizes[k];
        p.n_pages = (1200 + sizes[k] - 1) / sizes[k] + 2;
        char err[256];
        cr_assert_eq(kvt_ctx_create(&p, &ctx[k], err, sizeof err), KVT_OK, "%s", err);
        seq[k] = new_seq(ctx[k], 11);
    }
    uint64_t total = 0;
    for (int step = 0; step < 60; step++) {
        uint32_t n = 1 + (uint32_t)(step * 5 % 31);
        for (int k = 0; k < 4; k++) {
            cr_assert_eq(tu_reserve(seq[k], n), KVT_OK, "page %u: %s", sizes[k], kvt_last_error());
            fill_rows(seq[k], m, n, (uint32_t)step);
            cr_assert_eq(tu_commit_run(seq[k], n), KVT_OK, "%s", kvt_last_error());
        }
        total += n;
    }
    for (int k = 0; k < 4; k++)
        cr_assert_eq(kvt_seq_check(seq[k]), KVT_OK, "page %u: %s", sizes[k], kvt_last_error());
    for (uint32_t l = 0; l < 3; l++) {
        const kvt_layer_spec *s = kvt_model_layer(m, l);
        for (uint32_t h = 0; h < s->n_kv_heads; h++)
            for (uint64_t p = 0; p < total; p++) {
                kvt_row_state st0;
                uint8_t r0[1152];
                cr_assert_eq(kvt_seq_row_state(seq[0], l, h, p, &st0, NULL), KVT_OK);
                if (st0 != KVT_ROW_DROPPED)
                    cr_assert_eq(kvt_seq_read_row(seq[0], l, 0, h, p, r0, s->row_bytes), KVT_OK);
                for (int k = 1; k < 4; k++) {
                    kvt_row_state st;
                    uint8_t r[1152];
                    cr_assert_eq(kvt_seq_row_state(seq[k], l, h, p, &st, NULL), KVT_OK);
                    cr_assert_eq(st, st0, "page %u layer %u head %u position %llu", sizes[k], l, h,
                                 (unsigned long long)p);
                    if (st == KVT_ROW_DROPPED)
                        continue;
                    cr_assert_eq(kvt_seq_read_row(seq[k], l, 0, h, p, r, s->row_bytes), KVT_OK);
                    cr_assert_eq(memcmp(r, r0, s->row_bytes), 0);
                }
            }
    }
    for (int k = 0; k < 4; k++)
        kvt_ctx_destroy(ctx[k]);
    kvt_model_destroy(m);
}

/* The context owns its live batches: destroying it with a step in flight (after a run) frees
 * everything, as ASan checks in the sanitizer configurations. */
Test(batch, context_destroys_live_batches) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 16);
    kvt_seq *s = new_seq(ctx, 1);
    kvt_batch *b, *idle;
    cr_assert_eq(kvt_batch_create(ctx, 1, &b), KVT_OK);
    cr_assert_eq(kvt_batch_create(ctx, 4, &idle), KVT_OK);
    uint32_t n = 5;
    cr_assert_eq(kvt_batch_reserve(b, &s, &n, 1), KVT_OK);
    fill_rows(s, m, 5, 0);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    int32_t idx[8], len;
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = 8, .lengths = &len};
    cr_assert_eq(kvt_batch_run(b, 1, NULL, NULL, &e), KVT_OK);
    kvt_ctx_destroy(ctx); /* b, idle and s go with it */
    kvt_model_destroy(m);
}

/* A batch destroyed after a run that closed a block over the step's rows: the request keeps its
 * reservation and can only be destroyed, but inspection still answers sanely (the tail ends at
 * the rows the close saw, not below the closed ones: this read 2^64 - 52 rows, or aborted in a
 * debug build). */
Test(batch, stats_after_a_batch_destroyed_mid_step) {
    kvt_model *m = mixed_model();
    kvt_ctx *ctx = mixed_ctx(m, 32);
    kvt_seq *s = new_seq(ctx, 1);
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 1, &b), KVT_OK);
    uint32_t n = 100;
    cr_assert_eq(kvt_batch_reserve(b, &s, &n, 1), KVT_OK);
    fill_rows(s, m, n, 3);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    int32_t idx[128], len;
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = 128, .lengths = &len};
    cr_assert_eq(kvt_batch_run(b, 0, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    kvt_batch_destroy(b);
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(s, 0, &ls), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(ls.attended_rows, (uint64_t)len, "the set the run emitted");
    cr_assert_eq(ls.sink_rows + ls.kept_rows + ls.tail_rows, ls.attended_rows);
    cr_assert_eq(ls.tail_rows, 100 - 64);
    kvt_seq_destroy(s);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}
