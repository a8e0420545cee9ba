/* test_faults.c — host allocation failures injected at every allocation of context creation,
 * reserve, commit (block close, eviction round): each gives a clean status, never a crash or a
 * leak, loses no stored row, and the policy work completes on the next commit. The context uses
 * KVT_ALLOC_LIBC, whose allocations go through aligned_alloc, interposed here. */
#include <criterion/criterion.h>

#include "kvtier.h"
#include "support/testutil.h"

#include <stdlib.h>
#include <string.h>

#include "support/fault_alloc.h"

static kvt_model *two_group_model(void) {
    kvt_layer_spec s[3];
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[0]);
    kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 4, 64, &s[1]);
    s[2] = (kvt_layer_spec){.kind = KVT_LAYER_NO_KV};
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, 3, "faults", &m, NULL, 0), KVT_OK);
    return m;
}

static kvt_ctx_params params(const kvt_model *m) {
    kvt_ctx_params p = kvt_ctx_default_params();
    static kvt_config p_cfg; /* outlives the call: the params point at it */
    p_cfg = kvt_config_default();
    p.config = &p_cfg;
    p.model = m;
    p.allocator = KVT_ALLOC_LIBC;
    p.page_rows = 16;
    p.n_pages = 64;
    p_cfg.block_rows = 64;
    p_cfg.kappa = 4;
    p_cfg.ratio = 8;
    p_cfg.evict_budget_rows = 48;
    p_cfg.recent_rows = 16;
    p_cfg.evict_archive = true;
    return p;
}

Test(faults, context_creation_at_every_allocation) {
    kvt_model *m = two_group_model();
    kvt_ctx_params p = params(m);
    int failures = 0;
    for (int k = 0; k < 200; k++) {
        kvt_ctx *ctx = NULL;
        char err[256] = "";
        fault_countdown = k;
        fault_hits = 0;
        kvt_status s = kvt_ctx_create(&p, &ctx, err, sizeof err);
        fault_countdown = -1;
        if (fault_hits == 0) { /* ran out of allocations to fail: creation succeeded */
            cr_assert_eq(s, KVT_OK, "%s", err);
            kvt_ctx_destroy(ctx);
            break;
        }
        if (s == KVT_OK) { /* the failed allocation was optional */
            kvt_ctx_destroy(ctx);
            continue;
        }
        failures++;
        cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "k %d: %s (%s)", k, kvt_status_name(s), err);
        cr_assert_null(ctx);
        cr_assert_neq(err[0], '\0');
    }
    cr_assert_gt(failures, 3);
    kvt_model_destroy(m);
}

/* Append rows with a fault armed at allocation k of each reserve/commit; check no row is lost
 * and that a retry completes the work. run: each step also runs every layer (kvt_batch_run), so
 * the closes and rounds happen inside the runs and the faults hit them there. */
static void faults_through_steps(bool run) {
    kvt_model *m = two_group_model();
    kvt_ctx_params p = params(m);
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, NULL, 0), KVT_OK);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 5, &seq), KVT_OK);
    kvt_seq_set_prompt_rows(seq, 8);
    kvt_batch *batch; /* created outside the fault window: faults hit the library's step calls */
    cr_assert_eq(kvt_batch_create(ctx, 1, &batch), KVT_OK);
    tu_rng rng = {31337};
    uint8_t mla[1152], gk[4 * 128], gv[4 * 128];
    uint8_t *shadow = malloc(400 * 1152);
    int oom_reserve = 0, oom_commit = 0, oom_run = 0;
    uint64_t pos = 0;
    for (int step = 0; pos < 400; step++) {
        /* On every other step fail the k-th allocation, k = 0, 1, 2 in turn: allocations are rare
         * in a steady state (arrays grow by doubling, scratch is kept), so this reaches each of
         * them, and the step after a failure runs fault-free (the retry). */
        int k = step % 2 ? -1 : (step / 2) % 3;
        uint32_t free_before;
        kvt_ctx_free_pages(ctx, 0, &free_before);
        fault_countdown = k;
        fault_hits = 0;
        uint32_t one = 1;
        kvt_status s = kvt_batch_reserve(batch, &seq, &one, 1);
        fault_countdown = -1;
        if (s != KVT_OK) {
            cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "%s", kvt_last_error());
            uint32_t free_after;
            kvt_ctx_free_pages(ctx, 0, &free_after);
            cr_assert_eq(free_after, free_before, "a failed reserve kept pages");
            cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
            oom_reserve++;
            continue;
        }
        for (int i = 0; i < 1152; i++)
            mla[i] = (uint8_t)tu_next(&rng);
        for (int i = 0; i < 4 * 128; i++) {
            gk[i] = (uint8_t)tu_next(&rng) & 0x3f; /* finite bf16 values */
            gv[i] = (uint8_t)tu_next(&rng) & 0x3f;
        }
        memcpy(shadow + pos * 1152, mla, 1152);
        cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, 1, mla, sizeof mla), KVT_OK);
        cr_assert_eq(kvt_seq_write(seq, 1, 0, 0, 1, gk, sizeof gk), KVT_OK);
        cr_assert_eq(kvt_seq_write(seq, 1, 1, 0, 1, gv, sizeof gv), KVT_OK);
        fault_countdown = k;
        fault_hits = 0;
        s = kvt_batch_plan(batch);
        if (s != KVT_OK) { /* nothing planned: the commit below does all the work */
            cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "%s", kvt_last_error());
            oom_run++;
        }
        for (uint32_t l = 0; run && s == KVT_OK && l < 2; l++) {
            int32_t idx[512], len;
            kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                          .capacity = 512, .lengths = &len};
            s = kvt_batch_run(batch, l, NULL, NULL, &e);
            if (s != KVT_OK) { /* a close or round failed in the run: the commit retries it */
                cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "%s", kvt_last_error());
                oom_run++;
            }
        }
        s = kvt_batch_commit(batch, NULL);
        fault_countdown = -1;
        pos++;
        if (s != KVT_OK) {
            cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "%s", kvt_last_error());
            oom_commit++;
            /* Every committed row is still attended or archived with the attended set
             * reporting exactly the attended rows; none is lost on the evict layer either. */
            uint32_t cnt, att = 0;
            cr_assert_eq(tu_attended_count(ctx, 0, &seq, 1, &cnt), KVT_OK);
            for (uint64_t q = 0; q < pos; q++) {
                kvt_row_state st;
                cr_assert_eq(kvt_seq_row_state(seq, 0, 0, q, &st, NULL), KVT_OK);
                cr_assert(st == KVT_ROW_ATTENDED || st == KVT_ROW_ARCHIVED);
                att += st == KVT_ROW_ATTENDED;
                for (uint32_t h = 0; h < 4; h++) {
                    cr_assert_eq(kvt_seq_row_state(seq, 1, h, q, &st, NULL), KVT_OK);
                    cr_assert(st == KVT_ROW_ATTENDED || st == KVT_ROW_ARCHIVED);
                }
            }
            cr_assert_eq(cnt, att, "attended set %u rows, %u attended states", cnt, att);
            uint32_t zero = 0;
            cr_assert_eq(kvt_batch_reserve(batch, &seq, &zero, 1), KVT_OK);
            cr_assert_eq(kvt_batch_commit(batch, NULL), KVT_OK, "retry: %s", kvt_last_error());
        }
        cr_assert_eq(kvt_seq_check(seq), KVT_OK, "pos %llu: %s", (unsigned long long)pos,
                     kvt_last_error());
    }
    uint8_t row[1152];
    for (uint64_t q = 0; q < pos; q++) {
        cr_assert_eq(kvt_seq_read_row(seq, 0, 0, 0, q, row, sizeof row), KVT_OK);
        cr_assert_eq(memcmp(row, shadow + q * 1152, 1152), 0, "row %llu", (unsigned long long)q);
    }
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(seq, 0, &ls), KVT_OK);
    cr_log_info("%s: %d reserves, %d plans/runs and %d commits failed for memory; %llu closes, "
                "rows %llu", run ? "run path" : "commit path", oom_reserve, oom_run, oom_commit,
                (unsigned long long)ls.closes, (unsigned long long)pos);
    cr_assert_gt(oom_reserve + oom_commit + oom_run, 8);
    cr_assert_gt(run ? oom_run : oom_commit, 0);
    cr_assert_eq(ls.closed_rows, 384);
    free(shadow);
    kvt_batch_destroy(batch);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(faults, reserve_and_commit_at_every_allocation) {
    faults_through_steps(false);
}

Test(faults, reserve_run_and_commit_at_every_allocation) {
    faults_through_steps(true);
}

Test(faults, bad_specs_and_partial_binding) {
    char err[256];
    kvt_layer_spec s;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s);
    s.row_bytes = 128; /* cannot hold 576 bf16 values */
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_create(&s, 1, "x", &m, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "row_bytes") != NULL, "%s", err);
    /* A branch wider than the salience kernels take is refused at context creation. */
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 512, &s);
    cr_assert_eq(kvt_model_create(&s, 1, "x", &m, err, sizeof err), KVT_OK);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 2;
    kvt_ctx *ctx = NULL;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(err, "branch_dim") != NULL, "%s", err);
    kvt_model_destroy(m);
    /* External storage with only the K plane of a GQA layer bound: reserve refuses. */
    kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 64, &s);
    cr_assert_eq(kvt_model_create(&s, 1, "x", &m, err, sizeof err), KVT_OK);
    p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 2;
    p.page_rows = 16;
    p.external_storage = true;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    size_t bytes = 2 * 16 * 2 * 128;
    void *k = calloc(1, bytes);
    cr_assert_eq(kvt_layer_bind(ctx, 0, 0, k, bytes), KVT_OK);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 1), KVT_ERR_BAD_STATE);
    cr_assert(strstr(kvt_last_error(), "plane 1") != NULL, "%s", kvt_last_error());
    int64_t posbuf[1];
    uint64_t n = 9;
    cr_assert_eq(kvt_seq_positions(seq, 0, 0, posbuf, 1, &n), KVT_OK); /* empty sequence */
    cr_assert_eq(n, 0);
    kvt_ctx_destroy(ctx);
    free(k);
    kvt_model_destroy(m);
}
