/*
 * test_budget.c — the salience budget that counts the tail (kvt_config.salience_budget, issue 10
 * item 8): m at each close from the hand-computed rule, the effective ratio it gives against the
 * reference rule on the same rows, the floor, snapshots that carry the mode.
 */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "lib/handles.h"
#include "support/testutil.h"
#include "tiers/tiers_internal.h" /* white-box: the policies' states */

Test(budget, m_by_hand) {
    kvt_config c = kvt_config_default(); /* B 4096, ratio 32, sinks 4 */
    cr_assert_eq(kvt__sal_m(4096, &c), 128); /* reference: closed / ratio */
    c.salience_budget = true;
    c.budget_min_kept = 256;
    cr_assert_eq(kvt__sal_m(0, &c), 0);
    cr_assert_eq(kvt__sal_m(4096, &c), 256);   /* ceil(6144/32) = 192 < 4 + 2048: the floor */
    cr_assert_eq(kvt__sal_m(126976, &c), 1980); /* ceil(129024/32) = 4032, minus 2052 */
    cr_assert_eq(kvt__sal_m(1u << 20, &c), 32832 - 2052); /* (1048576 + 2048)/32 = 32832 */
    c.block_rows = 64;
    c.budget_min_kept = 100;
    cr_assert_eq(kvt__sal_m(64, &c), 64); /* never more than the closed rows */
    char err[128];
    c.budget_min_kept = 0;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "budget_min_kept"), "%s", err);
}

static kvt_ctx *ctx_for(kvt_model *m, bool budget) {
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 8;
    c.salience_budget = budget;
    c.budget_min_kept = 4;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 512;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    return ctx;
}

/* The same rows in both modes: after every close the kept count is the rule's, the checker
 * passes, and at the end budget mode attends about context / ratio rows while the reference
 * attends the tail on top. */
Test(budget, effective_ratio_holds_the_ratio) {
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&s, 1, "budget", &m, NULL, 0), KVT_OK);
    double eff[2] = {0, 0};
    const uint32_t N = 64 * 60 + 32;
    uint8_t *rows = malloc((size_t)N * 1152);
    cr_assert(rows);
    tu_rng g = {11};
    for (size_t i = 0; i < (size_t)N * 576; i++)
        kvt__store_elem(rows, KVT__DT_BF16, (uint32_t)i, (float)tu_normal(&g));
    for (int budget = 0; budget < 2; budget++) {
        kvt_ctx *ctx = ctx_for(m, budget);
        kvt_seq *seq;
        cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
        double sum_ratio = 0;
        uint32_t n_meas = 0;
        for (uint32_t t = 0; t < N; t += 16) {
            cr_assert_eq(tu_reserve(seq, 16), KVT_OK, "%s", kvt_last_error());
            cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, 16, rows + (size_t)t * 1152, 16 * 1152),
                         KVT_OK);
            cr_assert_eq(tu_commit(seq, 16), KVT_OK, "%s", kvt_last_error());
            kvt_layer_stats st = {.struct_size = sizeof st};
            cr_assert_eq(kvt_seq_layer_stats(seq, 0, &st), KVT_OK);
            const kvt_config *cfg = &seq->cfg;
            uint64_t want_m = kvt__sal_m(st.closed_rows, cfg);
            cr_assert_eq(kvt__seq_state(seq, 0)->sal.n_kept, want_m, "rows %u", t + 16);
            cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
            cr_assert_float_eq(st.effective_ratio,
                               (double)(t + 16) / (double)st.attended_rows, 1e-12);
            if (t + 16 >= 64 * 20) { /* past the start, over whole blocks */
                sum_ratio += st.effective_ratio;
                n_meas++;
            }
        }
        eff[budget] = sum_ratio / n_meas;
        kvt_ctx_destroy(ctx);
    }
    cr_log_info("mean effective ratio at ratio 8, B = 64: reference %.2f, budget %.2f", eff[0],
                eff[1]);
    cr_assert(eff[1] > 7.0 && eff[1] < 9.0, "budget mode: %.2f", eff[1]);
    cr_assert(eff[0] < eff[1] - 0.5, "the reference attends its tail on top: %.2f vs %.2f", eff[0],
              eff[1]);
    free(rows);
    kvt_model_destroy(m);
}

/* A snapshot of a budget-mode request restores only where the mode and floor match. */
Test(budget, snapshots_name_the_mode) {
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&s, 1, "budget", &m, NULL, 0), KVT_OK);
    kvt_ctx *a = ctx_for(m, true), *b = ctx_for(m, false);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(a, 1, &seq), KVT_OK);
    uint8_t row[1152] = {0};
    for (uint32_t t = 0; t < 200; t++) {
        cr_assert_eq(tu_reserve(seq, 1), KVT_OK);
        row[0] = (uint8_t)t;
        cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, 1, row, 1152), KVT_OK);
        cr_assert_eq(tu_commit(seq, 1), KVT_OK);
    }
    size_t n;
    cr_assert_eq(kvt_seq_snapshot_size(seq, &n), KVT_OK);
    uint8_t *buf = malloc(n);
    cr_assert_eq(kvt_seq_snapshot(seq, buf, n, NULL), KVT_OK);
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore(b, buf, n, &r), KVT_ERR_MISMATCH);
    cr_assert(strstr(kvt_last_error(), "salience_budget"), "%s", kvt_last_error());
    kvt_seq_destroy(seq); /* its id is free for the restore */
    cr_assert_eq(kvt_seq_restore(a, buf, n, &r), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(r);
    free(buf);
    kvt_ctx_destroy(a);
    kvt_ctx_destroy(b);
    kvt_model_destroy(m);
}
