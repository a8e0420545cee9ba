/*
 * test_spec.c — speculative decoding through the batch API: kvt_batch_reserve_drafts reserves a
 * token and its drafts, kvt_batch_run emits one attended set per query token (FlashMLA's
 * [batch, s_q, topk]) that sees the step's rows causally, and kvt_batch_commit accepts k of n.
 * The proof: a request decoded with drafts, rejected drafts written with other bytes, ends every
 * step in exactly the state (every layer, head and position: row state and bytes; free pages) of
 * a request that reserved only the accepted tokens — with block closes and eviction rounds made
 * due by drafts, accepted and rejected — and each query token's set is the committed attended set
 * plus the step's rows up to its own (the last window on a sliding layer).
 */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "support/testutil.h"

enum { L_SAL = TU_L_SAL, L_EV1 = TU_L_EV1, L_EV2 = TU_L_EV2, L_SLIDE = TU_L_SLIDE,
       N_LAYERS = TU_N_LAYERS };
enum { BLOCK = TU_BLOCK, K_EV = TU_K, R_EV = TU_R, C_EV = TU_R, WINDOW = TU_WINDOW, S_Q = 5,
       TOPK = 1024 };

/* salience (MLA NoPE, 1 head), two evict layers (GQA RoPE, 2 heads), a sliding window of 40. */
static kvt_model *spec_model(void) {
    kvt_model *m = tu_mixed_model();
    cr_assert_not_null(m);
    return m;
}

static kvt_ctx *spec_ctx(kvt_model *m, bool archive) {
    kvt_ctx *ctx = tu_mixed_ctx(m, archive, 256);
    cr_assert_not_null(ctx, "%s", kvt_last_error());
    return ctx;
}

static void row_bytes(uint8_t *buf, size_t n, uint32_t l, uint32_t pl, uint64_t pos, uint64_t junk) {
    tu_row_bytes(buf, n, l, pl, pos, junk);
}

/* Write the step's rows of seq: token t holds position first + t; tokens t >= good are junk. */
static void write_step(kvt_seq *seq, const kvt_model *m, uint64_t first, uint32_t n, uint32_t good,
                       uint64_t junk) {
    uint8_t buf[4096];
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        const kvt_layer_spec *s = kvt_model_layer(m, l);
        size_t tb = (size_t)s->n_kv_heads * s->row_bytes;
        for (uint32_t pl = 0; pl < s->n_planes; pl++)
            for (uint32_t t = 0; t < n; t++) {
                row_bytes(buf, tb, l, pl, first + t, t < good ? 0 : junk);
                cr_assert_eq(kvt_seq_write(seq, l, pl, t, 1, buf, tb), KVT_OK, "%s",
                             kvt_last_error());
            }
    }
}

/* One plain step of a reference request: reserve n, write, commit (the commit path). */
static void plain_step(kvt_batch *b, kvt_seq *seq, const kvt_model *m, uint32_t n) {
    if (n == 0)
        return;
    cr_assert_eq(kvt_batch_reserve(b, &seq, &n, 1), KVT_OK, "%s", kvt_last_error());
    write_step(seq, m, kvt_seq_length(seq), n, n, 0);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
}

/* The attended set of every request between steps, as slots ascending by position. */
static uint32_t attended(kvt_ctx *ctx, uint32_t layer, kvt_seq *seq, int32_t *slots) {
    int32_t len;
    cr_assert_eq(tu_attended_tokens(ctx, layer, &seq, 1, slots, TOPK, &len), KVT_OK, "%s",
                 kvt_last_error());
    return (uint32_t)len;
}

/* Same row state and bytes at every (layer, head, position); same free pages. */
static void assert_same(kvt_ctx *ca, kvt_seq *a, kvt_ctx *cb, kvt_seq *b, int step) {
    cr_assert_eq(kvt_seq_check(a), KVT_OK, "step %d: %s", step, kvt_last_error());
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        uint32_t fa, fb;
        cr_assert_eq(kvt_ctx_free_pages(ca, l, &fa), KVT_OK);
        cr_assert_eq(kvt_ctx_free_pages(cb, l, &fb), KVT_OK);
        cr_assert_eq(fa, fb, "step %d layer %u: rejected drafts' pages came back", step, l);
    }
    char why[256] = "";
    cr_assert_eq(tu_same_rows(a, b, why, sizeof why), KVT_OK, "step %d: %s", step, why);
}

/* Rows of the evict group's table (every head holds as many). */
static uint64_t evict_rows(kvt_seq *seq) {
    kvt_layer_stats st = {.struct_size = sizeof st};
    cr_assert_eq(kvt_seq_layer_stats(seq, L_EV1, &st), KVT_OK);
    return st.attended_rows;
}

static void drafts_decode(bool archive, bool csr) {
    kvt_model *m = spec_model();
    kvt_ctx *ca = spec_ctx(m, archive), *cb = spec_ctx(m, archive);
    /* a: decoded with drafts; c: a plain one-token request in the same batch; b, d: references. */
    kvt_seq *a, *c, *b, *d;
    cr_assert_eq(tu_seq_create(ca, 7, &a), KVT_OK);
    cr_assert_eq(tu_seq_create(ca, 8, &c), KVT_OK);
    cr_assert_eq(tu_seq_create(cb, 7, &b), KVT_OK);
    cr_assert_eq(tu_seq_create(cb, 8, &d), KVT_OK);
    kvt_batch *ba, *bb;
    cr_assert_eq(kvt_batch_create(ca, 2, &ba), KVT_OK);
    cr_assert_eq(kvt_batch_create(cb, 1, &bb), KVT_OK);
    /* A prompt of 100 rows, the same in both. */
    kvt_seq *pa[2] = {a, c};
    uint32_t np[2] = {100, 100};
    cr_assert_eq(kvt_batch_reserve(ba, pa, np, 2), KVT_OK);
    write_step(a, m, 0, 100, 100, 0);
    write_step(c, m, 0, 100, 100, 0);
    cr_assert_eq(kvt_batch_commit(ba, NULL), KVT_OK, "%s", kvt_last_error());
    plain_step(bb, b, m, 100);
    plain_step(bb, d, m, 100);

    tu_rng rng = {.s = 0x5EC0 + archive * 2 + csr};
    uint32_t close_acc = 0, close_rej = 0, round_acc = 0, round_rej = 0, zero_acc = 0;
    static int32_t before[N_LAYERS][TOPK], idx[2 * S_Q * TOPK], lengths[2 * S_Q],
        indptr[2 * S_Q + 1];
    for (int step = 0; step < 600; step++) {
        uint64_t N = kvt_seq_length(a);
        uint32_t n = 1 + (uint32_t)(tu_next(&rng) % S_Q);
        bool all_drafts = tu_next(&rng) % 8 == 0; /* the sampled token itself may be rejected */
        uint32_t drafts = all_drafts ? n : n - 1;
        uint32_t k = (n - drafts) + (uint32_t)(tu_next(&rng) % (drafts + 1));
        /* What the drafts make due, and whether the accepted part keeps it. */
        uint64_t sure = N + (n - drafts), R = evict_rows(a), sure_r = R + (n - drafts);
        if ((N + n) / BLOCK > sure / BLOCK)
            (N + k) / BLOCK > sure / BLOCK ? close_acc++ : close_rej++;
        if (R + n >= K_EV + R_EV + C_EV && sure_r < K_EV + R_EV + C_EV)
            R + k >= K_EV + R_EV + C_EV ? round_acc++ : round_rej++;
        zero_acc += k == 0;
        uint32_t la[N_LAYERS], lc[N_LAYERS];
        static int32_t before_c[N_LAYERS][TOPK];
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            la[l] = attended(ca, l, a, before[l]);
            lc[l] = attended(ca, l, c, before_c[l]);
        }

        kvt_seq *seqs[2] = {a, c};
        uint32_t nt[2] = {n, 1}, nd[2] = {drafts, 0};
        cr_assert_eq(kvt_batch_reserve_drafts(ba, seqs, nt, nd, 2), KVT_OK, "%s",
                     kvt_last_error());
        write_step(a, m, N, n, k, (uint64_t)step + 1);
        write_step(c, m, kvt_seq_length(c), 1, 1, 0);
        cr_assert_eq(kvt_batch_plan(ba), KVT_OK);
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            kvt_emit e = {.struct_size = sizeof e,
                          .layout = csr ? KVT_EMIT_CSR : KVT_EMIT_TOKENS,
                          .indices = idx,
                          .capacity = csr ? 2 * S_Q * TOPK : TOPK,
                          .lengths = lengths,
                          .indptr = indptr,
                          .queries_per_seq = S_Q};
            cr_assert_eq(kvt_batch_run(ba, l, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
            for (uint32_t r = 0; r < 2; r++)
                for (uint32_t t = 0; t < S_Q; t++) {
                    uint32_t q = r * S_Q + t;
                    const int32_t *got = csr ? idx + indptr[q] : idx + (size_t)q * TOPK;
                    uint32_t len = csr ? (uint32_t)(indptr[q + 1] - indptr[q]) : (uint32_t)lengths[q];
                    /* Expected: the committed set, then the step's rows up to token t. A request
                     * with drafts did no work in the run. */
                    kvt_seq *sq = seqs[r];
                    uint32_t vis = t < nt[r] ? t + 1 : nt[r];
                    if (nd[r] == 0 && l != L_SLIDE) {
                        /* One token, no draft (c, or a sampled token alone): its close or
                         * round ran in the run and decided the set (the state comparison after
                         * commit checks it); every padded token repeats token 0's set. */
                        uint32_t q0 = r * S_Q;
                        const int32_t *t0 = csr ? idx + indptr[q0] : idx + (size_t)q0 * TOPK;
                        uint32_t len0 = csr ? (uint32_t)(indptr[q0 + 1] - indptr[q0])
                                            : (uint32_t)lengths[q0];
                        cr_assert_eq(len, len0);
                        cr_assert_eq(memcmp(got, t0, len * sizeof *got), 0);
                        continue;
                    }
                    const int32_t *base = r == 0 ? before[l] : before_c[l];
                    uint32_t nb = r == 0 ? la[l] : lc[l];
                    uint32_t from = 0;
                    if (l == L_SLIDE && nb + vis > WINDOW)
                        from = nb + vis - WINDOW; /* the window ending at token t */
                    cr_assert_eq(len, nb - from + vis,
                                 "step %d layer %u req %u token %u: %u rows, expected %u + %u - %u",
                                 step, l, r, t, len, nb, vis, from);
                    cr_assert_eq(memcmp(got, base + from, (nb - from) * sizeof *got), 0,
                                 "step %d layer %u req %u token %u", step, l, r, t);
                    for (uint32_t j = 0; j < vis; j++) {
                        int32_t slot;
                        cr_assert_eq(kvt_seq_reserved_slot(sq, l, j, &slot), KVT_OK);
                        cr_assert_eq(got[nb - from + j], slot, "step %d layer %u token %u row %u",
                                     step, l, t, j);
                    }
                    if (!csr)
                        for (uint32_t j = len; j < TOPK; j++)
                            cr_assert_eq(got[j], -1);
                }
            if (csr)
                continue;
            /* FlashMLA's topk_length per request (KVT_EMIT_LENGTHS_PER_SEQ), a second run of
             * the layer (it only emits): the same rows, lengths[r] = its last token's count,
             * the most any of its tokens attends. */
            static int32_t idx2[2 * S_Q * TOPK];
            int32_t per_seq[2] = {-5, -5};
            kvt_emit e2 = e;
            e2.indices = idx2;
            e2.lengths = per_seq;
            e2.flags = KVT_EMIT_LENGTHS_PER_SEQ;
            cr_assert_eq(kvt_batch_run(ba, l, NULL, NULL, &e2), KVT_OK, "%s", kvt_last_error());
            cr_assert_eq(memcmp(idx2, idx, sizeof idx2), 0, "step %d layer %u", step, l);
            for (uint32_t r = 0; r < 2; r++) {
                cr_assert_eq(per_seq[r], lengths[r * S_Q + S_Q - 1]);
                for (uint32_t t = 0; t < S_Q; t++)
                    cr_assert_leq(lengths[r * S_Q + t], per_seq[r], "step %d layer %u", step, l);
            }
        }
        uint32_t acc[2] = {k, 1};
        if (n > drafts) { /* rejecting the sampled token, which is not a draft */
            uint32_t bad[2] = {n - drafts - 1, 1};
            cr_assert_eq(kvt_batch_commit(ba, bad), KVT_ERR_INVALID_ARGUMENT);
        }
        cr_assert_eq(kvt_batch_commit(ba, acc), KVT_OK, "step %d: %s", step, kvt_last_error());
        plain_step(bb, b, m, k);
        plain_step(bb, d, m, 1);
        assert_same(ca, a, cb, b, step);
        assert_same(ca, c, cb, d, step);
    }
    cr_log_info("closes due in drafts: %u accepted, %u rejected; rounds: %u accepted, %u "
                "rejected; %u steps accepted nothing",
                close_acc, close_rej, round_acc, round_rej, zero_acc);
    cr_assert_geq(close_acc, 3, "block closes made due by accepted drafts: %u", close_acc);
    cr_assert_geq(close_rej, 3, "block closes made due by rejected drafts only: %u", close_rej);
    cr_assert_geq(round_acc, 3, "eviction rounds made due by accepted drafts: %u", round_acc);
    cr_assert_geq(round_rej, 3, "eviction rounds made due by rejected drafts only: %u",
                  round_rej);
    cr_assert_geq(zero_acc, 3);
    kvt_batch_destroy(ba);
    kvt_batch_destroy(bb);
    kvt_ctx_destroy(ca);
    kvt_ctx_destroy(cb);
    kvt_model_destroy(m);
}

Test(spec, drafts_accepted_k_of_n_equal_k_plain_tokens_tokens_layout, .timeout = 120) {
    drafts_decode(false, false);
}

Test(spec, drafts_accepted_k_of_n_equal_k_plain_tokens_csr_archive, .timeout = 120) {
    drafts_decode(true, true);
}

Test(spec, misuse) {
    kvt_model *m = spec_model();
    kvt_ctx *ctx = spec_ctx(m, false);
    kvt_seq *a;
    cr_assert_eq(tu_seq_create(ctx, 1, &a), KVT_OK);
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 1, &b), KVT_OK);
    uint32_t n = 4, nd = 5;
    cr_assert_eq(kvt_batch_reserve_drafts(b, &a, &n, &nd, 1), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_seq_pending(a), 0);
    /* No drafts: a multi-token step whose first run closed over all of it cannot then be emitted
     * per token. */
    n = 70; /* a block of 64 closes in the step */
    cr_assert_eq(kvt_batch_reserve(b, &a, &n, 1), KVT_OK);
    write_step(a, m, 0, n, n, 0);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    static int32_t idx[S_Q * TOPK];
    int32_t len[300];
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = TOPK, .lengths = len, .queries_per_seq = 1};
    cr_assert_eq(kvt_batch_run(b, L_SAL, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    cr_assert_lt(len[0], 70, "the block closed in the run");
    e.queries_per_seq = 2;
    cr_assert_eq(kvt_batch_run(b, L_SAL, NULL, NULL, &e), KVT_ERR_CAPACITY); /* 70 > s_q */
    e.queries_per_seq = 300;
    cr_assert_eq(kvt_batch_run(b, L_SAL, NULL, NULL, &e), KVT_ERR_INVALID_ARGUMENT);
    e.queries_per_seq = 70;
    e.capacity = 80;
    static int32_t big[70 * 80];
    e.indices = big;
    cr_assert_eq(kvt_batch_run(b, L_SAL, NULL, NULL, &e), KVT_ERR_BAD_STATE);
    cr_assert(strstr(kvt_last_error(), "per-token emission"), "%s", kvt_last_error());
    /* The first run of another layer may emit per token: token t sees rows 0..t. */
    cr_assert_eq(kvt_batch_run(b, L_SLIDE, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    for (uint32_t t = 0; t < 70; t++)
        cr_assert_eq(len[t], t + 1 < WINDOW ? (int32_t)t + 1 : WINDOW);
    /* Per-request lengths (FlashMLA's topk_length): the last token's, only lengths[0] written;
     * TOKENS only, known bits only. */
    int32_t one[2] = {-5, -5};
    kvt_emit ps = e;
    ps.lengths = one;
    ps.flags = KVT_EMIT_LENGTHS_PER_SEQ;
    cr_assert_eq(kvt_batch_run(b, L_SLIDE, NULL, NULL, &ps), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(one[0], len[69]);
    cr_assert_eq(one[1], -5, "one length per request");
    ps.flags = 0x2;
    cr_assert_eq(kvt_batch_run(b, L_SLIDE, NULL, NULL, &ps), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "unknown bits"), "%s", kvt_last_error());
    int32_t ptr[3];
    ps.flags = KVT_EMIT_LENGTHS_PER_SEQ;
    ps.layout = KVT_EMIT_CSR;
    ps.indptr = ptr;
    ps.capacity = 70 * 80;
    cr_assert_eq(kvt_batch_run(b, L_SLIDE, NULL, NULL, &ps), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "KVT_EMIT_TOKENS"), "%s", kvt_last_error());
    /* A struct from before queries_per_seq: one set per request. */
    kvt_emit old = {.struct_size = KVT_EMIT_SIZE_MIN, .layout = KVT_EMIT_TOKENS, .indices = idx,
                    .capacity = TOPK, .lengths = len};
    cr_assert_eq(kvt_batch_run(b, L_EV1, NULL, NULL, &old), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(len[0], K_EV + R_EV, "the round ran in the run (no drafts, one query)");
    old.struct_size = KVT_EMIT_SIZE_MIN - 1;
    cr_assert_eq(kvt_batch_run(b, L_EV1, NULL, NULL, &old), KVT_ERR_INVALID_ARGUMENT);
    uint32_t k = 69;
    cr_assert_eq(kvt_batch_commit(b, &k), KVT_ERR_INVALID_ARGUMENT); /* no drafts */
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(a), KVT_OK, "%s", kvt_last_error());
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}
