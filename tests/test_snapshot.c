/* test_snapshot.c — request snapshots (kvtier.h, "Snapshots"): bit-identical round trips in the
 * middle of eviction rounds and around block closes; a restored request continues exactly as
 * one never snapshotted (the snapshot bytes of both, which hold every row, position, keep set,
 * archive and counter, compared after every step); restore into another context and onto the
 * guarded backend; refusals (another model or configuration, an open reservation); every-byte
 * corruption and every-length truncation refused with the context unchanged; the atomic file
 * writer under failing writes, fsyncs and renames; a host-allocation fault at every allocation
 * of snapshot and restore. The contexts use KVT_ALLOC_LIBC, whose allocations go through
 * aligned_alloc, interposed here. */
#include <criterion/criterion.h>

#include "fuzz/fuzz.h" /* fuzz_fix_crcs */
#include "kvtier.h"
#include "lib/snapshot.h"
#include "support/testutil.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "support/fault_alloc.h"

/* The guarded backend, except under valgrind, which cannot follow its protection keys
 * (tests/scripts/valgrind.sh sets KVT_UNDER_VALGRIND): the CPU backend there. */
static kvt_backend_kind guarded(void) {
    return getenv("KVT_UNDER_VALGRIND") ? KVT_BACKEND_CPU : KVT_BACKEND_GUARDED;
}

/* Step of the exhaustive loops (every byte, every length, every allocation): 1, or 7 under
 * valgrind, where each restore costs ~50x and the fast label's budget is minutes. */
static size_t sweep_step(void) {
    return getenv("KVT_UNDER_VALGRIND") ? 7 : 1;
}

/* ------------------------------------------------------------------------------------------- */
/* A small mixed model: salience (MLA-NoPE), random eviction (GQA-RoPE, 2 heads), a sliding      */
/* layer (window 40) and a no-KV layer.                                                          */
/* ------------------------------------------------------------------------------------------- */
static kvt_model *mixed_model(uint32_t gqa_heads) {
    kvt_layer_spec s[5];
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 32, 16, &s[0]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, gqa_heads, 16, &s[1]),
                 KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 1, 16, &s[2]), KVT_OK);
    s[2].sliding_window = 40;
    s[3] = (kvt_layer_spec){.kind = KVT_LAYER_NO_KV};
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 32, 16, &s[4]), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, 5, "snapshot-mixed", &m, NULL, 0), KVT_OK);
    return m;
}

static kvt_config small_config(bool archive) {
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 4;
    c.sink_rows = 4;
    c.evict_budget_rows = 48;
    c.recent_rows = 16;
    c.evict_archive = archive;
    c.seed = 77;
    return c;
}

static kvt_ctx *make_ctx(const kvt_model *m, const kvt_config *c, kvt_backend_kind be,
                         uint32_t n_pages) {
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = c;
    p.page_rows = 16;
    p.n_pages = n_pages;
    p.backend = be;
    p.allocator = KVT_ALLOC_LIBC;
    kvt_ctx *ctx;
    char err[256] = "";
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    return ctx;
}

/* Deterministic bf16 values for (layer, plane, position): twins get the same rows. */
static void fill_rows(uint8_t *dst, size_t bytes, uint32_t layer, uint32_t plane, uint64_t pos) {
    tu_rng r = {pos * 1000003u + layer * 7919u + plane * 104729u + 1};
    for (size_t i = 0; i + 1 < bytes; i += 2) {
        float f = (float)(tu_uniform(&r) * 4.0 - 2.0);
        uint32_t b;
        memcpy(&b, &f, 4);
        dst[i] = (uint8_t)(b >> 16);
        dst[i + 1] = (uint8_t)(b >> 24);
    }
}

/* Steps run every layer before their commit (closes and rounds inside the runs, as in an
 * engine's forward) instead of doing all policy work at commit. */
static bool g_run_layers;

/* Write the rows of the n reserved tokens of every layer. */
static void write_rows(kvt_seq *seq, uint32_t n) {
    kvt_status s;
    const kvt_model *m = kvt_ctx_model(kvt_seq_context(seq));
    uint64_t first = kvt_seq_length(seq);
    static uint8_t buf[1 << 16];
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++) {
        const kvt_layer_spec *sp = kvt_model_layer(m, l);
        if (sp->kind == KVT_LAYER_NO_KV)
            continue;
        size_t slot = (size_t)sp->n_kv_heads * sp->row_bytes;
        for (uint32_t p = 0; p < sp->n_planes; p++)
            for (uint32_t i = 0; i < n; i++) {
                cr_assert_leq(slot, sizeof buf);
                fill_rows(buf, slot, l, p, first + i);
                s = kvt_seq_write(seq, l, p, i, 1, buf, slot);
                cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
            }
    }
}

/* Reserve n tokens, write every layer's rows, commit. */
static kvt_status step(kvt_seq *seq, uint32_t n) {
    kvt_status s = tu_reserve(seq, n);
    if (s != KVT_OK)
        return s;
    write_rows(seq, n);
    return g_run_layers ? tu_commit_run(seq, n) : tu_commit(seq, n);
}

/* A snapshot in a malloc'ed buffer. */
static uint8_t *snap(const kvt_seq *seq, size_t *n) {
    cr_assert_eq(kvt_seq_snapshot_size(seq, n), KVT_OK, "%s", kvt_last_error());
    uint8_t *b = malloc(*n);
    size_t w = 0;
    cr_assert_eq(kvt_seq_snapshot(seq, b, *n, &w), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(w, *n);
    return b;
}

/* Two requests have the same whole state: equal snapshots (rows in row-index order, positions,
 * keep sets, archives, counters: every byte but the page ids, which the format does not hold)
 * and the same row state and bytes at every (layer, head, position). */
static void assert_same(const kvt_seq *a, const kvt_seq *b, const char *where) {
    size_t na, nb;
    uint8_t *sa = snap(a, &na), *sb = snap(b, &nb);
    cr_assert_eq(na, nb, "%s: snapshot sizes %zu vs %zu", where, na, nb);
    size_t i = 0;
    while (i < na && sa[i] == sb[i])
        i++;
    cr_assert_eq(i, na, "%s: snapshots differ at byte %zu of %zu", where, i, na);
    char why[512] = "";
    cr_assert_eq(tu_same_rows(a, b, why, sizeof why), KVT_OK, "%s: %s", where, why);
    cr_assert_eq(kvt_seq_check(b), KVT_OK, "%s: %s", where, kvt_last_error());
    free(sa);
    free(sb);
}

static uint32_t free_pages_sum(const kvt_ctx *ctx) {
    uint32_t sum = 0;
    const kvt_model *m = kvt_ctx_model(ctx);
    int32_t seen[8] = {0};
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++) {
        int32_t g = kvt_ctx_layer_group(ctx, l);
        if (g < 0 || seen[g]++)
            continue;
        uint32_t f;
        kvt_ctx_free_pages(ctx, l, &f);
        sum += f;
    }
    return sum;
}

/* Step sizes that pass block closes (64) and rounds (K + r + c = 80) one token at a time and in
 * chunks (a chunked prefill commit runs one round down to K + r). */
static uint32_t step_size(int i) {
    return i < 12 ? 9 : (i % 5 == 0 ? 13 : 1);
}

/* A request of ctx with id `id`, driven through `steps` steps of step_size. */
static kvt_seq *driven(kvt_ctx *ctx, uint64_t id, int steps) {
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, id, &seq), KVT_OK);
    for (int i = 0; i < steps; i++)
        cr_assert_eq(step(seq, step_size(i)), KVT_OK, "step %d: %s", i, kvt_last_error());
    return seq;
}

/* ------------------------------------------------------------------------------------------- */
/* Round trips                                                                                   */
/* ------------------------------------------------------------------------------------------- */
static void round_trips(bool archive) {
    kvt_model *m = mixed_model(2);
    kvt_config c = small_config(archive);
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, 128);
    kvt_ctx *aside = make_ctx(m, &c, KVT_BACKEND_CPU, 128);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 42, &seq), KVT_OK);
    kvt_seq_set_prompt_rows(seq, 10);
    int trips = 0;
    for (int i = 0; i < 220; i++) {
        cr_assert_eq(step(seq, step_size(i)), KVT_OK, "step %d: %s", i, kvt_last_error());
        /* Restore aside and compare; then, as a preemption does, destroy the request, restore it
         * into the same context (its id is free again) and continue from the restored copy. */
        size_t n;
        uint8_t *b = snap(seq, &n);
        kvt_seq *a, *r;
        cr_assert_eq(kvt_seq_restore(aside, b, n, &a), KVT_OK, "step %d: %s", i, kvt_last_error());
        assert_same(seq, a, "round trip");
        kvt_seq_destroy(seq);
        cr_assert_eq(kvt_seq_restore(ctx, b, n, &r), KVT_OK, "step %d: %s", i, kvt_last_error());
        assert_same(a, r, "round trip in place");
        kvt_seq_destroy(a);
        seq = r;
        free(b);
        trips++;
    }
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(seq, 1, &ls), KVT_OK);
    cr_assert_gt(ls.rounds, 5, "rounds %llu", (unsigned long long)ls.rounds);
    cr_assert_eq(kvt_seq_layer_stats(seq, 0, &ls), KVT_OK);
    cr_assert_gt(ls.closes, 3, "closes %llu", (unsigned long long)ls.closes);
    cr_assert_eq(trips, 220);
    kvt_ctx_destroy(aside);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(snapshot, round_trip_every_step_dropping) {
    round_trips(false);
}

Test(snapshot, round_trip_every_step_archiving) {
    round_trips(true);
}

/* A request snapshotted, destroyed and restored at step s (into the same context, another CPU
 * context with a different pool, a guarded context) continues exactly as a twin never
 * snapshotted: equal snapshots and rows after every later step. The twin has the same request
 * id, so the same draws, in a context of its own (ids are unique among a context's live
 * requests). */
static void continuation(kvt_backend_kind be, bool other_ctx, bool archive, int at) {
    kvt_model *m = mixed_model(2);
    kvt_config c = small_config(archive);
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, 128);
    kvt_ctx *ctx2 = other_ctx ? make_ctx(m, &c, be, 97) : ctx;
    kvt_ctx *twin = make_ctx(m, &c, KVT_BACKEND_CPU, 128);
    kvt_seq *a, *b;
    cr_assert_eq(tu_seq_create(twin, 9, &a), KVT_OK);
    cr_assert_eq(tu_seq_create(ctx, 9, &b), KVT_OK);
    kvt_seq_set_prompt_rows(a, 6);
    kvt_seq_set_prompt_rows(b, 6);
    for (int i = 0; i < 160; i++) {
        if (i == at) {
            size_t n;
            uint8_t *buf = snap(b, &n);
            kvt_seq_destroy(b);
            cr_assert_eq(kvt_seq_restore(ctx2, buf, n, &b), KVT_OK, "%s", kvt_last_error());
            free(buf);
        }
        cr_assert_eq(step(a, step_size(i)), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(step(b, step_size(i)), KVT_OK, "%s", kvt_last_error());
        if (i >= at)
            assert_same(a, b, "continuation");
    }
    if (ctx2 != ctx)
        kvt_ctx_destroy(ctx2);
    kvt_ctx_destroy(twin);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(snapshot, continuation_same_context) {
    continuation(KVT_BACKEND_CPU, false, true, 20);
}

Test(snapshot, continuation_other_context) {
    continuation(KVT_BACKEND_CPU, true, false, 31);
}

Test(snapshot, continuation_guarded_backend) {
    continuation(guarded(), true, true, 17);
}

/* CPU -> CUDA: the CUDA backend fills the same read / write ops; skipped without a device. */
Test(snapshot, continuation_cuda_backend) {
    kvt_model *m = mixed_model(2);
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config c = small_config(true);
    p.model = m;
    p.config = &c;
    p.backend = KVT_BACKEND_CUDA;
    kvt_ctx *probe = NULL;
    kvt_status s = kvt_ctx_create(&p, &probe, NULL, 0);
    kvt_ctx_destroy(probe);
    kvt_model_destroy(m);
    if (s == KVT_ERR_NO_DEVICE)
        cr_skip_test("no CUDA device (or built without CUDA): CPU -> CUDA restore not run");
    cr_assert_eq(s, KVT_OK);
    continuation(KVT_BACKEND_CUDA, true, true, 19);
}

Test(snapshot, continuation_with_runs) {
    g_run_layers = true;
    continuation(KVT_BACKEND_CPU, true, true, 23);
    g_run_layers = false;
}

/* A snapshot taken on the guarded backend restores on the CPU backend, byte for byte. */
Test(snapshot, guarded_to_cpu) {
    kvt_model *m = mixed_model(2);
    kvt_config c = small_config(true);
    kvt_ctx *g = make_ctx(m, &c, guarded(), 64);
    kvt_ctx *cpu = make_ctx(m, &c, KVT_BACKEND_CPU, 64);
    kvt_seq *a = driven(g, 3, 40), *b;
    size_t n;
    uint8_t *buf = snap(a, &n);
    cr_assert_eq(kvt_seq_restore(cpu, buf, n, &b), KVT_OK, "%s", kvt_last_error());
    assert_same(a, b, "guarded -> cpu");
    free(buf);
    kvt_ctx_destroy(g);
    kvt_ctx_destroy(cpu);
    kvt_model_destroy(m);
}

/* Real model configurations: Kimi Linear (salience on 7 MLA-NoPE layers, 20 no-KV layers) and
 * Gemma 3 (sliding layers returning pages, random eviction on the global layers). */
static void real_model(const char *file, uint32_t tokens) {
    kvt_model *m;
    char err[256];
    cr_assert_eq(kvt_model_from_file(tu_model_path(file), KVT_DTYPE_BF16, &m, err, sizeof err),
                 KVT_OK, "%s: %s", file, err);
    kvt_config c = small_config(true);
    c.evict_budget_rows = 96;
    c.recent_rows = 32;
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, 64);
    kvt_ctx *ctx2 = make_ctx(m, &c, guarded(), 64);
    kvt_ctx *twin = make_ctx(m, &c, KVT_BACKEND_CPU, 64); /* a's: the same id, the same draws */
    kvt_seq *a, *b;
    cr_assert_eq(tu_seq_create(twin, 1, &a), KVT_OK);
    cr_assert_eq(tu_seq_create(ctx, 1, &b), KVT_OK);
    uint32_t done = 0;
    for (int i = 0; done < tokens; i++) {
        uint32_t n = i % 3 == 0 ? 37 : 5;
        if (i == 9) {
            size_t sz;
            uint8_t *buf = snap(b, &sz);
            kvt_seq_destroy(b);
            cr_assert_eq(kvt_seq_restore(ctx2, buf, sz, &b), KVT_OK, "%s", kvt_last_error());
            free(buf);
        }
        cr_assert_eq(step(a, n), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(step(b, n), KVT_OK, "%s", kvt_last_error());
        done += n;
        if (i >= 9 && i % 4 == 0)
            assert_same(a, b, file);
    }
    assert_same(a, b, file);
    kvt_ctx_destroy(twin);
    kvt_ctx_destroy(ctx);
    kvt_ctx_destroy(ctx2);
    kvt_model_destroy(m);
}

Test(snapshot, kimi_linear) {
    real_model("kimi-linear-48b-a3b-instruct.json", 400);
}

Test(snapshot, gemma3_sliding_and_global) {
    real_model("gemma-3-1b-it.json", 700);
}

/* ------------------------------------------------------------------------------------------- */
/* Refusals                                                                                      */
/* ------------------------------------------------------------------------------------------- */
Test(snapshot, open_reservation_refused) {
    kvt_model *m = mixed_model(2);
    kvt_config c = small_config(false);
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, 64);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(step(seq, 20), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 3), KVT_OK);
    size_t n = 0;
    uint8_t buf[64];
    cr_assert_eq(kvt_seq_snapshot_size(seq, &n), KVT_ERR_BAD_STATE);
    cr_assert(strstr(kvt_last_error(), "reservation"), "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_snapshot(seq, buf, sizeof buf, &n), KVT_ERR_BAD_STATE);
    cr_assert_eq(kvt_seq_snapshot_file(seq, "/tmp/never-written.kvts"), KVT_ERR_BAD_STATE);
    cr_assert_eq(access("/tmp/never-written.kvts", F_OK), -1);
    cr_assert_eq(tu_commit(seq, 3), KVT_OK);
    cr_assert_eq(kvt_seq_snapshot_size(seq, &n), KVT_OK);
    cr_assert_eq(kvt_seq_snapshot(seq, buf, sizeof buf, &n), KVT_ERR_CAPACITY);
    cr_assert_eq(kvt_seq_snapshot(NULL, buf, sizeof buf, &n), KVT_ERR_INVALID_ARGUMENT);
    kvt_seq *r = (kvt_seq *)1;
    cr_assert_eq(kvt_seq_restore(ctx, NULL, 0, &r), KVT_ERR_PARSE);
    cr_assert_null(r);
    cr_assert_eq(kvt_seq_restore(NULL, buf, 1, &r), KVT_ERR_INVALID_ARGUMENT);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Another configuration field, model, page size or policy: KVT_ERR_MISMATCH naming it, and the
 * context unchanged. */
Test(snapshot, mismatch_refused) {
    kvt_model *m = mixed_model(2), *m4 = mixed_model(4);
    kvt_config c = small_config(true);
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, 64);
    kvt_seq *seq = driven(ctx, 1, 14);
    size_t n;
    uint8_t *buf = snap(seq, &n);
    struct {
        const char *name;
        kvt_config cfg;
        const kvt_model *model;
        uint32_t page_rows;
        const char *expect;
    } cases[8];
    int nc = 0;
    for (int k = 0; k < 8; k++) {
        cases[k].cfg = c;
        cases[k].model = m;
        cases[k].page_rows = 16;
    }
    cases[nc].name = "ratio", cases[nc].cfg.ratio = 8, cases[nc++].expect = "config.ratio";
    cases[nc].name = "seed", cases[nc].cfg.seed = 78, cases[nc++].expect = "config.seed";
    cases[nc].name = "K", cases[nc].cfg.evict_budget_rows = 40,
    cases[nc++].expect = "config.evict_budget_rows";
    cases[nc].name = "archive", cases[nc].cfg.evict_archive = false,
    cases[nc++].expect = "config.evict_archive";
    cases[nc].name = "block", cases[nc].cfg.block_rows = 128,
    cases[nc++].expect = "config.block_rows";
    cases[nc].name = "heads", cases[nc].model = m4, cases[nc++].expect = "n_kv_heads";
    cases[nc].name = "page", cases[nc].page_rows = 32, cases[nc++].expect = "page_rows";
    for (int k = 0; k < nc; k++) {
        kvt_ctx_params p = kvt_ctx_default_params();
        p.model = cases[k].model;
        p.config = &cases[k].cfg;
        p.page_rows = cases[k].page_rows;
        p.n_pages = 64;
        p.allocator = KVT_ALLOC_LIBC;
        kvt_ctx *other;
        cr_assert_eq(kvt_ctx_create(&p, &other, NULL, 0), KVT_OK);
        uint32_t before = free_pages_sum(other);
        kvt_seq *r = NULL;
        cr_assert_eq(kvt_seq_restore(other, buf, n, &r), KVT_ERR_MISMATCH, "%s", cases[k].name);
        cr_assert_null(r);
        cr_assert(strstr(kvt_last_error(), cases[k].expect), "%s: %s", cases[k].name,
                  kvt_last_error());
        cr_assert_eq(free_pages_sum(other), before);
        kvt_ctx_destroy(other);
    }
    /* A policy override: the GQA layer under none instead of evict. */
    kvt_policy pol[5] = {KVT_POLICY_SALIENCE, KVT_POLICY_NONE, KVT_POLICY_NONE, KVT_POLICY_NONE,
                         KVT_POLICY_SALIENCE};
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 64;
    p.layer_policies = pol;
    kvt_ctx *other;
    cr_assert_eq(kvt_ctx_create(&p, &other, NULL, 0), KVT_OK);
    kvt_seq *r = NULL;
    cr_assert_eq(kvt_seq_restore(other, buf, n, &r), KVT_ERR_MISMATCH);
    cr_assert(strstr(kvt_last_error(), "policy") || strstr(kvt_last_error(), "group"), "%s",
              kvt_last_error());
    kvt_ctx_destroy(other);
    /* A pool too small, and max_rows_per_seq too small. */
    p.layer_policies = NULL;
    p.n_pages = 3;
    cr_assert_eq(kvt_ctx_create(&p, &other, NULL, 0), KVT_OK);
    cr_assert_eq(kvt_seq_restore(other, buf, n, &r), KVT_ERR_POOL_EXHAUSTED);
    cr_assert_eq(free_pages_sum(other), 3 * 3);
    kvt_ctx_destroy(other);
    p.n_pages = 64;
    p.max_rows_per_seq = 20;
    cr_assert_eq(kvt_ctx_create(&p, &other, NULL, 0), KVT_OK);
    cr_assert_eq(kvt_seq_restore(other, buf, n, &r), KVT_ERR_CAPACITY);
    kvt_ctx_destroy(other);
    free(buf);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    kvt_model_destroy(m4);
}

/* ------------------------------------------------------------------------------------------- */
/* Corruption and truncation                                                                     */
/* ------------------------------------------------------------------------------------------- */
/* A small snapshot that has been through a round and a close (archive on). */
static kvt_seq *small_seq_id(kvt_ctx *ctx, uint64_t id) {
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, id, &seq), KVT_OK);
    kvt_seq_set_prompt_rows(seq, 4);
    cr_assert_eq(step(seq, 70), KVT_OK);
    cr_assert_eq(step(seq, 14), KVT_OK);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(step(seq, 1), KVT_OK);
    return seq;
}

static kvt_seq *small_seq(kvt_ctx *ctx) {
    return small_seq_id(ctx, 5);
}

static kvt_model *tiny_model(void) {
    kvt_layer_spec s[3];
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 8, 8, &s[0]);
    kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 4, &s[1]);
    kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 1, 4, &s[2]);
    s[2].sliding_window = 20;
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, 3, "tiny", &m, NULL, 0), KVT_OK);
    return m;
}

/* Restore must refuse; the context must be as before: the original request checks, the free
 * pages are what they were, no request appeared. */
static void refused(kvt_ctx *ctx, const kvt_seq *orig, const uint8_t *b, size_t n, uint32_t free0,
                    const char *what, size_t at) {
    kvt_seq *r = NULL;
    kvt_status s = kvt_seq_restore(ctx, b, n, &r);
    cr_assert_neq(s, KVT_OK, "%s at %zu: restored", what, at);
    cr_assert(s == KVT_ERR_PARSE || s == KVT_ERR_CORRUPT || s == KVT_ERR_UNSUPPORTED ||
                  s == KVT_ERR_MISMATCH,
              "%s at %zu: %s", what, at, kvt_status_name(s));
    cr_assert_neq(kvt_last_error()[0], '\0', "%s at %zu: no message", what, at);
    cr_assert_null(r);
    cr_assert_eq(free_pages_sum(ctx), free0, "%s at %zu: pages", what, at);
    cr_assert_eq(kvt_seq_check(orig), KVT_OK, "%s at %zu: %s", what, at, kvt_last_error());
}

/* The tiny model's context, small_seq's request in it, its snapshot and the free pages. */
/* seq (request 5) lives in home, where its snapshot b was taken; restores go into ctx, whose
 * own request `other` (request 6, the same steps) must come through every refusal unchanged.
 * (Request ids are unique among a context's live requests: b cannot be restored into home
 * while seq lives.) */
typedef struct fixture {
    kvt_model *m;
    kvt_ctx *home, *ctx;
    kvt_seq *seq, *other;
    uint8_t *b;
    size_t n;
    uint32_t free0;
} fixture;

static fixture fixture_make(bool archive) {
    fixture x;
    x.m = tiny_model();
    kvt_config c = small_config(archive);
    x.home = make_ctx(x.m, &c, KVT_BACKEND_CPU, 64);
    x.seq = small_seq(x.home);
    x.b = snap(x.seq, &x.n);
    x.ctx = make_ctx(x.m, &c, KVT_BACKEND_CPU, 64);
    x.other = small_seq_id(x.ctx, 6);
    x.free0 = free_pages_sum(x.ctx);
    return x;
}

static void fixture_free(fixture *x) {
    free(x->b);
    kvt_ctx_destroy(x->ctx);
    kvt_ctx_destroy(x->home);
    kvt_model_destroy(x->m);
}

/* A snapshot is refused beside its live original (the same request id), with nothing changed,
 * from a buffer and from a file; once the original is destroyed (a preemption) it comes back
 * into the context that took it. */
Test(snapshot, restore_beside_the_live_original_refused) {
    fixture x = fixture_make(true);
    const uint32_t free0 = free_pages_sum(x.home);
    char path[] = "/tmp/kvt-dup-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(kvt_seq_snapshot_file(x.seq, path), KVT_OK, "%s", kvt_last_error());
    for (int file = 0; file < 2; file++) {
        kvt_seq *r = (kvt_seq *)&r;
        kvt_status s = file ? kvt_seq_restore_file(x.home, path, &r)
                            : kvt_seq_restore(x.home, x.b, x.n, &r);
        cr_assert_eq(s, KVT_ERR_INVALID_ARGUMENT, "%s", kvt_status_name(s));
        cr_assert_null(r);
        cr_assert(strstr(kvt_last_error(), "request 5 is already live"), "%s", kvt_last_error());
        cr_assert_eq(free_pages_sum(x.home), free0);
        cr_assert_eq(kvt_seq_check(x.seq), KVT_OK, "%s", kvt_last_error());
    }
    kvt_seq *r, *back;
    cr_assert_eq(kvt_seq_restore(x.ctx, x.b, x.n, &r), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(x.seq);
    cr_assert_eq(kvt_seq_restore_file(x.home, path, &back), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_request_id(back), 5u);
    assert_same(r, back, "restored after its original was destroyed");
    unlink(path);
    fixture_free(&x);
}

Test(snapshot, every_byte_corrupted) {
    fixture x = fixture_make(true);
    kvt_ctx *ctx = x.ctx;
    kvt_seq *seq = x.seq;
    uint8_t *b = x.b;
    size_t n = x.n;
    uint32_t free0 = x.free0;
    for (size_t i = 0; i < n; i += sweep_step()) {
        for (int k = 0; k < 2; k++) {
            uint8_t old = b[i];
            b[i] ^= k ? 0x01 : 0xa5;
            refused(ctx, x.other, b, n, free0, "corrupt byte", i);
            b[i] = old;
        }
    }
    cr_log_info("snapshot: %zu bytes, each corrupted twice, every restore refused", n);
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore(ctx, b, n, &r), KVT_OK, "%s", kvt_last_error());
    assert_same(seq, r, "after corruption loop");
    fixture_free(&x);
}

/* Every byte corrupted with the checksums then made right again (as fuzz_snapshot's 0x88 inputs):
 * what the CRCs no longer catch, the sizes, counts, ranges and invariants must. Each restore is
 * refused with a documented status and the context unchanged, or accepted with a request that
 * passes kvt_seq_check (a flipped row byte, σ that still ranks the same, the model type's name
 * are harmless) and gives its pages back when destroyed. */
Test(snapshot, every_byte_corrupted_behind_fixed_checksums) {
    fixture x = fixture_make(true);
    uint8_t *t = malloc(x.n);
    int accepted = 0, refused_n = 0;
    int patterns = 2;
    for (size_t i = 0; i < x.n; i += sweep_step())
        for (int k = 0; k < patterns; k++) {
            memcpy(t, x.b, x.n);
            t[i] ^= k ? 0x80 : 0x01;
            fuzz_fix_crcs(t, x.n);
            kvt_seq *r = NULL;
            kvt_status s = kvt_seq_restore(x.ctx, t, x.n, &r);
            cr_assert(s == KVT_OK || s == KVT_ERR_PARSE || s == KVT_ERR_CORRUPT ||
                          s == KVT_ERR_UNSUPPORTED || s == KVT_ERR_MISMATCH ||
                          s == KVT_ERR_CAPACITY || s == KVT_ERR_POOL_EXHAUSTED,
                      "byte %zu: %s", i, kvt_status_name(s));
            if (s != KVT_OK) {
                cr_assert_null(r);
                cr_assert_eq(free_pages_sum(x.ctx), x.free0, "byte %zu: pages", i);
                refused_n++;
                continue;
            }
            accepted++;
            cr_assert_eq(kvt_seq_check(r), KVT_OK, "byte %zu: %s", i, kvt_last_error());
            kvt_seq_destroy(r);
            cr_assert_eq(free_pages_sum(x.ctx), x.free0, "byte %zu: pages after destroy", i);
        }
    cr_assert_eq(kvt_seq_check(x.other), KVT_OK, "%s", kvt_last_error());
    cr_assert_gt(refused_n, 0);
    cr_log_info("checksums fixed: %d corruptions refused, %d accepted as valid states",
                refused_n, accepted);
    free(t);
    fixture_free(&x);
}

Test(snapshot, every_length_truncated) {
    fixture x = fixture_make(false);
    kvt_ctx *ctx = x.ctx;
    uint8_t *b = x.b;
    size_t n = x.n;
    uint32_t free0 = x.free0;
    for (size_t len = 0; len < n; len += sweep_step()) {
        uint8_t *t = malloc(len ? len : 1); /* exactly len bytes: ASan sees any overread */
        memcpy(t, b, len);
        refused(ctx, x.other, t, len, free0, "truncated to", len);
        free(t);
    }
    /* Extra bytes after END are refused too. */
    uint8_t *ext = malloc(n + 8);
    memcpy(ext, b, n);
    memset(ext + n, 0, 8);
    refused(ctx, x.other, ext, n + 8, free0, "extended to", n + 8);
    free(ext);
    fixture_free(&x);
}

/* ------------------------------------------------------------------------------------------- */
/* Files                                                                                         */
/* ------------------------------------------------------------------------------------------- */
static uint8_t *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*n ? *n : 1);
    cr_assert_eq(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

/* Files in dir other than the snapshot itself (temporaries left behind). */
static int stray_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "s.kvts"))
            n++;
    closedir(d);
    return n;
}

Test(snapshot, file_atomic_under_io_faults) {
    fixture x = fixture_make(true);
    kvt_ctx *ctx = x.ctx;
    kvt_seq *seq = x.seq;
    char dir[] = "/tmp/kvt-snap-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/s.kvts", dir);
    /* Short transfers: at most 1000 bytes per read or write, so a snapshot takes several. */
    fault_io_chunk = 1000;
    cr_assert_eq(kvt_seq_snapshot_file(seq, path), KVT_OK, "%s", kvt_last_error());
    size_t n_old;
    uint8_t *old = read_file(path, &n_old);
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore_file(ctx, path, &r), KVT_OK, "%s", kvt_last_error());
    assert_same(seq, r, "file");
    kvt_seq_destroy(r);
    /* The request moves on; each I/O call of the next snapshot fails in turn. */
    cr_assert_eq(step(seq, 5), KVT_OK);
    int faults = 0;
    for (int k = 0;; k++) {
        fault_io_countdown = k;
        fault_io_what = NULL;
        kvt_status s = kvt_seq_snapshot_file(seq, path);
        fault_io_countdown = -1;
        if (!fault_io_what) {
            cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
            break;
        }
        faults++;
        if (s == KVT_OK) {
            /* Only the listing of stale temporaries and the close of the directory (after its
             * fsync) may fail without failing the write. */
            cr_assert(!strcmp(fault_io_what, "opendir") || !strcmp(fault_io_what, "close"),
                      "fault %d: %s", k, fault_io_what);
            free(old);
            old = read_file(path, &n_old);
            continue;
        }
        cr_assert_eq(s, KVT_ERR_IO, "fault %d (%s): %s", k, fault_io_what, kvt_status_name(s));
        cr_assert(strstr(kvt_last_error(), fault_io_what) ||
                      (!strcmp(fault_io_what, "open") && strstr(kvt_last_error(), "create")),
                  "%s: %s", fault_io_what, kvt_last_error());
        if (strstr(kvt_last_error(), "directory")) {
            /* The directory's open or fsync failed after the rename: the new file is in place. */
            size_t nn;
            uint8_t *now = read_file(path, &nn);
            kvt_seq *q;
            cr_assert_eq(kvt_seq_restore(ctx, now, nn, &q), KVT_OK);
            assert_same(seq, q, "after directory fsync failure");
            kvt_seq_destroy(q);
            free(now);
        } else {
            /* Nothing renamed: the old file is intact, byte for byte. */
            size_t nn;
            uint8_t *now = read_file(path, &nn);
            cr_assert_eq(nn, n_old);
            cr_assert_eq(memcmp(now, old, nn), 0, "old file changed after a failed %s",
                         fault_io_what);
            free(now);
        }
        cr_assert_eq(stray_files(dir), 0, "temporary file left after a failed %s",
                     fault_io_what);
    }
    /* opendir, create, lock, several writes, 2 fsyncs, 2 closes, 1 rename, the directory's open */
    cr_assert_geq(faults, 10, "faults %d", faults);
    cr_assert_eq(kvt_seq_restore_file(ctx, path, &r), KVT_OK, "%s", kvt_last_error());
    assert_same(seq, r, "file after faults");
    cr_log_info("file writer: %d I/O faults injected", faults);
    cr_assert_eq(kvt_seq_restore_file(ctx, "/nonexistent/x.kvts", &r), KVT_ERR_IO);
    cr_assert_eq(kvt_seq_snapshot_file(seq, "/nonexistent/x.kvts"), KVT_ERR_IO);
    unlink(path);
    rmdir(dir);
    free(old);
    fixture_free(&x);
}

/* ------------------------------------------------------------------------------------------- */
/* Host allocation faults                                                                        */
/* ------------------------------------------------------------------------------------------- */
/* Fail the k-th allocation of a restore (and of a file snapshot), for every k: each call either
 * succeeds or answers KVT_ERR_OUT_OF_MEMORY with the context unchanged. Leaks show under ASan and
 * valgrind (this test runs in both configurations). */
static void faults_at_every_allocation(kvt_backend_kind be, bool slots) {
    kvt_model *m = mixed_model(2);
    kvt_config c = small_config(true);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 128;
    p.backend = be;
    p.allocator = KVT_ALLOC_LIBC;
    if (slots) {
        p.max_seqs = 4;
        p.max_rows_per_seq = 512;
        p.archive_rows_per_seq = 256;
    }
    kvt_ctx *ctx, *into; /* the request's, and the one its snapshot is restored into */
    cr_assert_eq(kvt_ctx_create(&p, &ctx, NULL, 0), KVT_OK);
    cr_assert_eq(kvt_ctx_create(&p, &into, NULL, 0), KVT_OK);
    kvt_seq *seq = driven(ctx, 5, 40), *bystander = driven(into, 6, 10);
    size_t n;
    uint8_t *b = snap(seq, &n);
    uint32_t free0 = free_pages_sum(into);
    int faults = 0;
    for (int k = 0;; k++) {
        kvt_seq *r = NULL;
        fault_countdown = k;
        fault_hits = 0;
        kvt_status s = kvt_seq_restore(into, b, n, &r);
        fault_countdown = -1;
        if (s != KVT_OK) {
            cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "k %d: %s: %s", k, kvt_status_name(s),
                         kvt_last_error());
            cr_assert_null(r);
            cr_assert_eq(free_pages_sum(into), free0, "k %d", k);
            cr_assert_eq(kvt_seq_check(bystander), KVT_OK, "k %d: %s", k, kvt_last_error());
            faults++;
            continue;
        }
        assert_same(seq, r, "restore under faults");
        kvt_seq_destroy(r);
        if (fault_hits == 0)
            break;
    }
    cr_assert_gt(faults, slots ? 1 : 5, "faults %d", faults);
    /* The file writer's allocations. */
    char path[] = "/tmp/kvt-snap-fault-XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    int ffaults = 0;
    for (int k = 0;; k++) {
        fault_countdown = k;
        fault_hits = 0;
        kvt_status s = kvt_seq_snapshot_file(seq, path);
        fault_countdown = -1;
        if (fault_hits == 0) {
            cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
            break;
        }
        if (s != KVT_OK) {
            cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "%s", kvt_status_name(s));
            ffaults++;
        }
    }
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore_file(into, path, &r), KVT_OK, "%s", kvt_last_error());
    assert_same(seq, r, "file after allocation faults");
    unlink(path);
    cr_log_info("restore: %d allocation faults, file writer: %d", faults, ffaults);
    free(b);
    kvt_ctx_destroy(into);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(snapshot, faults_at_every_allocation) {
    faults_at_every_allocation(KVT_BACKEND_CPU, false);
}

Test(snapshot, faults_at_every_allocation_slots_guarded) {
    faults_at_every_allocation(guarded(), true);
}

/* kvt_snapshot_context builds a context the snapshot restores into, and kvt_seq_scores reads σ. */
Test(snapshot, snapshot_context_and_scores) {
    kvt_model *m = mixed_model(2);
    kvt_config c = small_config(true);
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, 128);
    kvt_seq *seq = driven(ctx, 5, 60);
    size_t n;
    uint8_t *b = snap(seq, &n);
    kvt_ctx *own;
    cr_assert_eq(kvt_snapshot_context(b, n, guarded(), &own), KVT_OK, "%s",
                 kvt_last_error());
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore(own, b, n, &r), KVT_OK, "%s", kvt_last_error());
    assert_same(seq, r, "own context");
    uint64_t na = 0, nb = 0;
    cr_assert_eq(kvt_seq_scores(seq, 0, NULL, 0, &na), KVT_OK);
    cr_assert_gt(na, 0);
    float *sa = malloc(sizeof *sa * na), *sb = malloc(sizeof *sb * na);
    cr_assert_eq(kvt_seq_scores(seq, 0, sa, na, &na), KVT_OK);
    cr_assert_eq(kvt_seq_scores(r, 0, sb, na, &nb), KVT_OK);
    cr_assert_eq(memcmp(sa, sb, sizeof *sa * na), 0);
    cr_assert_eq(kvt_seq_scores(seq, 1, sa, na, &na), KVT_ERR_POLICY_MISMATCH);
    cr_assert_eq(kvt_seq_scores(seq, 0, sa, 1, &na), KVT_ERR_CAPACITY);
    for (size_t len = 0; len < 200 && len < n; len++)
        cr_assert_neq(kvt_snapshot_context(b, len, KVT_BACKEND_CPU, &own), KVT_OK);
    free(sa);
    free(sb);
    free(b);
    kvt_ctx_destroy(kvt_seq_context(r));
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* ------------------------------------------------------------------------------------------- */
/* A whole scenario under allocation faults                                                      */
/* ------------------------------------------------------------------------------------------- */
/* Create a context and a request, prefill, decode through closes and eviction rounds with an
 * archive, snapshot to a file, destroy, restore from it, decode on, destroy: with the k-th host
 * allocation of the whole scenario failing. Each call either succeeds or answers
 * KVT_ERR_OUT_OF_MEMORY; a refused call is retried (faults are one-shot); a commit that failed
 * keeps its rows and the next commit finishes its work; kvt_seq_check passes after every step,
 * and at the end every row written reads back exactly (no row lost). Returns the final snapshot,
 * which equals the fault-free run's unless a commit failed (a round retried one commit later
 * sees more candidates and draws another keep set: a different state, no row lost). */
static kvt_status retry_oom(kvt_status s, int *ooms) {
    if (s == KVT_ERR_OUT_OF_MEMORY)
        ++*ooms;
    return s;
}

/* No row lost: every committed (layer, head, position) reads back the bytes written for it
 * (write_rows), attended or archived; only the sliding layer's rows older than its window may
 * be gone (dropped with their pages). */
static void rows_exact(const kvt_seq *seq) {
    const kvt_model *m = kvt_ctx_model(kvt_seq_context(seq));
    static uint8_t want[1 << 12], got[1 << 12];
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++) {
        const kvt_layer_spec *sp = kvt_model_layer(m, l);
        if (sp->kind == KVT_LAYER_NO_KV)
            continue;
        size_t slot = (size_t)sp->n_kv_heads * sp->row_bytes;
        for (uint64_t pos = 0; pos < kvt_seq_length(seq); pos++)
            for (uint32_t p = 0; p < sp->n_planes; p++) {
                fill_rows(want, slot, l, p, pos);
                for (uint32_t h = 0; h < sp->n_kv_heads; h++) {
                    kvt_status s = kvt_seq_read_row(seq, l, p, h, pos, got, sizeof got);
                    if (s == KVT_ERR_DROPPED && sp->kind == KVT_LAYER_SLIDING)
                        continue;
                    cr_assert_eq(s, KVT_OK, "layer %u head %u position %llu: %s", l, h,
                                 (unsigned long long)pos, kvt_last_error());
                    cr_assert_eq(memcmp(got, want + (size_t)h * sp->row_bytes, sp->row_bytes),
                                 0, "layer %u plane %u head %u position %llu: bytes differ", l,
                                 p, h, (unsigned long long)pos);
                }
            }
    }
}
#define RETRY(call)                                                                                \
    do {                                                                                           \
        kvt_status s_ = retry_oom((call), ooms);                                                   \
        if (s_ == KVT_ERR_OUT_OF_MEMORY)                                                           \
            s_ = (call);                                                                           \
        cr_assert_eq(s_, KVT_OK, "%s: %s: %s", #call, kvt_status_name(s_), kvt_last_error());     \
    } while (0)

static uint8_t *scenario(const kvt_model *m, const char *path, int *ooms, size_t *n_out,
                         bool *commit_failed) {
    *commit_failed = false;
    kvt_config c = small_config(true);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 64;
    p.allocator = KVT_ALLOC_LIBC;
    kvt_ctx *ctx = NULL;
    RETRY(kvt_ctx_create(&p, &ctx, NULL, 0));
    kvt_seq *seq = NULL;
    RETRY(tu_seq_create(ctx, 5, &seq));
    kvt_seq_set_prompt_rows(seq, 6);
    for (int i = 0; i < 16; i++) {
        uint32_t n = i == 0 ? 70 : 5;
        RETRY(tu_reserve(seq, n));
        write_rows(seq, n);
        kvt_status s = retry_oom(tu_commit(seq, n), ooms);
        cr_assert(s == KVT_OK || s == KVT_ERR_OUT_OF_MEMORY, "commit: %s", kvt_status_name(s));
        *commit_failed |= s != KVT_OK;
        RETRY(kvt_seq_check(seq)); /* its scratch may fail too */
        if (i == 7) {
            RETRY(kvt_seq_snapshot_file(seq, path));
            kvt_seq_destroy(seq); /* preempted: its id is free for the restore */
            kvt_seq *r = NULL;
            RETRY(kvt_seq_restore_file(ctx, path, &r));
            seq = r;
        }
    }
    RETRY(tu_commit(seq, 0)); /* a zero-token step finishes what a failed commit left */
    uint8_t *b = snap(seq, n_out);
    rows_exact(seq);
    kvt_seq_destroy(seq);
    uint32_t free_all = free_pages_sum(ctx);
    cr_assert_eq(free_all, 3 * 64, "pages lost: %u free of %u", free_all, 3 * 64);
    kvt_ctx_destroy(ctx);
    return b;
}

Test(snapshot, whole_scenario_under_allocation_faults) {
    kvt_model *m = mixed_model(2);
    char dir[] = "/tmp/kvt-snap-scen-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/s.kvts", dir);
    int ooms = 0, runs = 0, differ = 0;
    size_t n_ref, n;
    bool failed;
    uint8_t *ref = scenario(m, path, &ooms, &n_ref, &failed);
    cr_assert_eq(ooms, 0);
    for (int k = 0;; k += (int)sweep_step()) {
        fault_countdown = k;
        fault_hits = 0;
        uint8_t *b = scenario(m, path, &ooms, &n, &failed);
        fault_countdown = -1;
        if (!failed) {
            cr_assert_eq(n, n_ref, "k %d", k);
            cr_assert_eq(memcmp(b, ref, n), 0, "k %d: the final state differs", k);
        } else {
            differ += n != n_ref || memcmp(b, ref, n) != 0;
        }
        free(b);
        runs++;
        if (fault_hits == 0)
            break;
    }
    cr_assert_gt(ooms, 20 / (int)sweep_step(), "%d OOMs", ooms);
    cr_log_info("whole scenario: %d runs, a fault at each allocation, %d calls answered "
                "KVT_ERR_OUT_OF_MEMORY, %d final states differ after a failed commit",
                runs, ooms, differ);
    free(ref);
    unlink(path);
    rmdir(dir);
    kvt_model_destroy(m);
}

/* A restored request's first step may reserve nothing (a request that only attends): its page
 * tables' mirrors in the backend's memory were sized at restore, so the commit's sync finds room
 * (fuzz_api found the unsized mirror: tests/fuzz/regress/fuzz_api/restore_mirror_unreserved). */
Test(snapshot, zero_token_step_after_restore) {
    kvt_model *m = mixed_model(2);
    kvt_config c = small_config(true);
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, 128);
    kvt_ctx *into = make_ctx(m, &c, KVT_BACKEND_CPU, 128);
    kvt_seq *seq = driven(ctx, 4, 30), *r;
    size_t n;
    uint8_t *b = snap(seq, &n);
    cr_assert_eq(kvt_seq_restore(into, b, n, &r), KVT_OK, "%s", kvt_last_error());
    kvt_batch *bt;
    cr_assert_eq(kvt_batch_create(into, 1, &bt), KVT_OK);
    uint32_t zero = 0;
    cr_assert_eq(kvt_batch_reserve(bt, &r, &zero, 1), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_plan(bt), KVT_OK);
    int32_t idx[4096], len;
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = 4096, .lengths = &len};
    cr_assert_eq(kvt_batch_run(bt, 1, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_commit(bt, NULL), KVT_OK, "%s", kvt_last_error());
    kvt_batch_destroy(bt);
    assert_same(seq, r, "after a zero-token step");
    free(b);
    kvt_ctx_destroy(into);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Stale temporaries (issue 32): a writer killed before its rename leaves PATH.tmp.XXXXXX; the
 * next successful write of PATH removes those no process holds locked that are at least 60 s
 * old, and leaves a live writer's (locked), a recent one, another name's and a look-alike. */
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
static void make_tmp(const char *p, bool old, int *lock_fd) {
    int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    cr_assert_geq(fd, 0, "%s", p);
    cr_assert_eq(write(fd, "\x89KVT", 4), 4); /* a writer killed after 4 bytes of the magic */
    if (old) {
        struct timespec ts[2] = {{.tv_sec = time(NULL) - 3600}, {.tv_sec = time(NULL) - 3600}};
        cr_assert_eq(futimens(fd, ts), 0);
    }
    if (lock_fd) {
        cr_assert_eq(flock(fd, LOCK_EX | LOCK_NB), 0);
        *lock_fd = fd;
    } else {
        close(fd);
    }
}

Test(snapshot, dead_writers_temporaries_removed_on_the_next_write) {
    fixture x = fixture_make(true);
    char dir[] = "/tmp/kvt-stale-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[128], p[160];
    snprintf(path, sizeof path, "%s/s.kvts", dir);
    static const char *const dead[] = {"s.kvts.tmp.aB3xYz", "s.kvts.tmp.000000"};
    static const char *const kept[] = {"s.kvts.tmp.recent", "s.kvts.tmp.locked",
                                       "t.kvts.tmp.aB3xYz", "s.kvts.tmp.toolong1", "s.kvts.tmpXaB3xYz"};
    int lock_fd = -1;
    for (size_t i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, dead[i]);
        make_tmp(p, true, NULL);
    }
    for (size_t i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, kept[i]);
        make_tmp(p, i != 0, i == 1 ? &lock_fd : NULL);
    }
    cr_assert_eq(kvt_seq_snapshot_file(x.seq, path), KVT_OK, "%s", kvt_last_error());
    for (size_t i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, dead[i]);
        cr_assert_neq(access(p, F_OK), 0, "a dead writer's %s is still there", dead[i]);
    }
    for (size_t i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, kept[i]);
        cr_assert_eq(access(p, F_OK), 0, "%s was removed", kept[i]);
        unlink(p);
    }
    close(lock_fd);
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore_file(x.ctx, path, &r), KVT_OK, "%s", kvt_last_error());
    assert_same(x.seq, r, "after the clean-up");
    kvt_seq_destroy(r);
    unlink(path);
    cr_assert_eq(rmdir(dir), 0, "only the snapshot was left");
    fixture_free(&x);
}
