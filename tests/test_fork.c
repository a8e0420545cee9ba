/*
 * test_fork.c — prefix sharing: kvt_seq_fork gives a child every committed page of its parent
 * (reference-counted, read-only while shared) and a copy of its policy state; a page either
 * side will write is copied first (the step's partial page at reserve; the pages past the
 * protected prompt before an eviction round). The proofs, on a model with one layer of each
 * policy (salience, random eviction with and without the archive, sliding window):
 *   - children forked before any round, decoded independently with their own rows, equal at
 *     every step (row state and bytes at every layer, head and position) unshared requests of
 *     the same ids fed the same rows — through closes, rounds and window releases;
 *   - after a fork past rounds, the parent continues exactly as a parent never forked, whatever
 *     its children write, and each child starts equal to its parent;
 *   - forking takes no page; sharing keeps the prompt's pages shared through rounds;
 *   - a forked request's snapshot is self-contained (restored elsewhere, it continues alike);
 *   - kvt_seq_attach: requests started from another's first P rows (closed σ blocks inherited,
 *     top-m selected anew, the prefix's window) equal unshared requests fed those P rows;
 *     prefixes a round or a window has changed are refused;
 *   - the salience side planes (σ, sketches) of closed blocks are shared by the holders until
 *     one closes a block; kvt_ctx_memory_stats counts shared pages and planes once, and a
 *     child's snapshot taken after its parent is gone restores and continues alike;
 *   - the k-th allocation failing, for every k, in a fork, an attach and a copy-on-write reserve
 *     (one closing a block: the side planes copied too): each answers KVT_ERR_OUT_OF_MEMORY with
 *     nothing created or reserved, no page leaked;
 *   - kvt_seq_check (reference counts included) after every step; misuse answers its status.
 */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "support/fault_alloc.h"
#include "support/testutil.h"

#define N_CHILD 3

static void write_rows(kvt_seq *seq, const kvt_model *m, uint64_t first, uint32_t n,
                       uint64_t seed) {
    uint8_t buf[4096];
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        const kvt_layer_spec *s = kvt_model_layer(m, l);
        size_t tb = (size_t)s->n_kv_heads * s->row_bytes;
        for (uint32_t pl = 0; pl < s->n_planes; pl++)
            for (uint32_t t = 0; t < n; t++) {
                tu_row_bytes(buf, tb, l, pl, first + t, seed);
                cr_assert_eq(kvt_seq_write(seq, l, pl, t, 1, buf, tb), KVT_OK, "%s",
                             kvt_last_error());
            }
    }
}

/* One step of n rows with the given content seed; run order (policy work in the runs) or
 * commit order. */
static void step(kvt_seq *seq, const kvt_model *m, uint32_t n, uint64_t seed, bool run) {
    cr_assert_eq(tu_reserve(seq, n), KVT_OK, "%s", kvt_last_error());
    write_rows(seq, m, kvt_seq_length(seq), n, seed);
    cr_assert_eq(run ? tu_commit_run(seq, n) : tu_commit(seq, n), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
}

static void same(const kvt_seq *a, const kvt_seq *b, const char *what, int k) {
    char why[512] = "";
    cr_assert_eq(tu_same_rows(a, b, why, sizeof why), KVT_OK, "%s, step %d: %s", what, k, why);
}

static kvt_seq *new_seq(kvt_ctx *ctx, uint64_t id, uint64_t prompt) {
    kvt_seq *s;
    cr_assert_eq(tu_seq_create(ctx, id, &s), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_set_prompt_rows(s, prompt), KVT_OK);
    return s;
}

static uint32_t used_pages(kvt_ctx *ctx, uint32_t n_pages) {
    uint32_t used = 0;
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        uint32_t f;
        cr_assert_eq(kvt_ctx_free_pages(ctx, l, &f), KVT_OK);
        used += n_pages - f; /* groups counted once per layer: fine for comparisons */
    }
    return used;
}

static void fork_before_rounds(bool archive) {
    kvt_model *m = tu_mixed_model();
    cr_assert_not_null(m);
    const uint32_t NP = 512;
    kvt_ctx *ctx = tu_mixed_ctx(m, archive, NP), *ref = tu_mixed_ctx(m, archive, NP);
    cr_assert(ctx && ref);
    const uint64_t PROMPT = 32;
    kvt_seq *parent = new_seq(ctx, 1, PROMPT);
    kvt_seq *child[N_CHILD], *twin[N_CHILD + 1];
    /* The prompt and a little decode: below K + r + c = 48 rows, so no round has run. */
    const uint32_t pre[3] = {20, 12, 12};
    for (int i = 0; i <= N_CHILD; i++)
        twin[i] = new_seq(ref, i == 0 ? 1 : 10 + (uint64_t)i, PROMPT);
    for (int k = 0; k < 3; k++) {
        step(parent, m, pre[k], 0, k % 2);
        for (int i = 0; i <= N_CHILD; i++)
            step(twin[i], m, pre[k], 0, k % 2);
    }
    const uint32_t used0 = used_pages(ctx, NP);
    for (int i = 0; i < N_CHILD; i++) {
        cr_assert_eq(kvt_seq_fork(parent, 11 + (uint64_t)i, &child[i]), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_seq_check(child[i]), KVT_OK, "%s", kvt_last_error());
        same(child[i], parent, "child as forked", 0);
    }
    cr_assert_eq(used_pages(ctx, NP), used0, "a fork takes no page");
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        kvt_layer_stats st = {.struct_size = sizeof st};
        cr_assert_eq(kvt_seq_layer_stats(child[0], l, &st), KVT_OK);
        cr_assert_eq(st.shared_pages, st.pages_in_use, "layer %u: every page shared", l);
    }
    /* Independent decode: each request its own rows (seed), its own step sizes. */
    tu_rng rng = {0xf0f0 + archive};
    kvt_seq *all[N_CHILD + 1] = {parent, child[0], child[1], child[2]};
    for (int k = 0; k < 80; k++) {
        for (int i = 0; i <= N_CHILD; i++) {
            uint32_t n = 1 + (uint32_t)(tu_next(&rng) % 9);
            bool run = tu_next(&rng) & 1;
            step(all[i], m, n, 100 + (uint64_t)i, run);
            step(twin[i], m, n, 100 + (uint64_t)i, run);
            same(all[i], twin[i], i == 0 ? "parent vs never forked" : "child vs unshared", k);
        }
    }
    uint32_t shared_used = used_pages(ctx, NP), unshared_used = used_pages(ref, NP);
    cr_log_info("archive %d: %u pages in use with sharing, %u without (%d requests)", archive,
                shared_used, unshared_used, N_CHILD + 1);
    cr_assert(shared_used < unshared_used, "the prompt's pages stay shared: %u vs %u",
              shared_used, unshared_used);
    for (int i = 0; i < N_CHILD; i++)
        kvt_seq_destroy(child[i]);
    cr_assert_eq(kvt_seq_check(parent), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_ctx_destroy(ref);
    kvt_model_destroy(m);
}

Test(fork, children_equal_unshared_requests) {
    fork_before_rounds(false);
}

Test(fork, children_equal_unshared_requests_with_archive) {
    fork_before_rounds(true);
}

/* Forked past closes and rounds: the parent goes on exactly as one never forked, whatever the
 * children write (their rounds copy what they move; their appends copy the partial page). */
Test(fork, parent_is_isolated_from_its_children) {
    kvt_model *m = tu_mixed_model();
    const uint32_t NP = 512;
    kvt_ctx *ctx = tu_mixed_ctx(m, true, NP), *ref = tu_mixed_ctx(m, true, NP);
    cr_assert(m && ctx && ref);
    kvt_seq *parent = new_seq(ctx, 1, 24), *twin = new_seq(ref, 1, 24);
    tu_rng rng = {77};
    for (int k = 0; k < 30; k++) {
        uint32_t n = 1 + (uint32_t)(tu_next(&rng) % 13);
        step(parent, m, n, 0, k % 2);
        step(twin, m, n, 0, k % 2);
    }
    kvt_seq *c[2];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(kvt_seq_fork(parent, 50 + (uint64_t)i, &c[i]), KVT_OK, "%s",
                     kvt_last_error());
        same(c[i], parent, "child as forked", 0);
    }
    for (int k = 0; k < 60; k++) {
        uint32_t n = 1 + (uint32_t)(tu_next(&rng) % 11);
        for (int i = 0; i < 2; i++)
            step(c[i], m, 1 + (n + (uint32_t)i) % 7, 900 + (uint64_t)i, i);
        step(parent, m, n, 0, k % 2);
        step(twin, m, n, 0, k % 2);
        same(parent, twin, "parent vs never forked", k);
    }
    /* A forked request's snapshot is self-contained: restored into another context (its pages
     * its own), it holds the same rows and continues alike. */
    size_t bytes;
    cr_assert_eq(kvt_seq_snapshot_size(c[1], &bytes), KVT_OK, "%s", kvt_last_error());
    void *buf = malloc(bytes);
    cr_assert_eq(kvt_seq_snapshot(c[1], buf, bytes, NULL), KVT_OK, "%s", kvt_last_error());
    kvt_ctx *other = tu_mixed_ctx(m, true, NP);
    kvt_seq *back;
    cr_assert_eq(kvt_seq_restore(other, buf, bytes, &back), KVT_OK, "%s", kvt_last_error());
    same(back, c[1], "restored fork", 0);
    step(back, m, 9, 77, true);
    step(c[1], m, 9, 77, true);
    same(back, c[1], "restored fork continued", 1);
    free(buf);
    kvt_ctx_destroy(other);
    /* A child outlives its parent. */
    kvt_seq_destroy(parent);
    step(c[0], m, 5, 901, true);
    cr_assert_eq(kvt_seq_check(c[1]), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_ctx_destroy(ref);
    kvt_model_destroy(m);
}

/* Request ids are unique among a context's live requests (an id keys the request's random
 * draws): kvt_seq_create, kvt_seq_fork and kvt_seq_attach refuse one in use with
 * KVT_ERR_INVALID_ARGUMENT naming it, *out NULL, nothing taken; a destroyed request's id (a
 * parked slot's included) is free again; another context is independent. kvt_seq_request_id
 * reads each request's id. */
static void ids_refused(kvt_ctx *ctx, kvt_seq *p, uint64_t id) {
    kvt_ctx_memory before = {.struct_size = sizeof before}, after = before;
    cr_assert_eq(kvt_ctx_memory_stats(ctx, &before), KVT_OK);
    kvt_seq *c = (kvt_seq *)&c;
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = id;
    cr_assert_eq(kvt_seq_create(ctx, &sp, &c), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(c);
    char want[64];
    snprintf(want, sizeof want, "request id %llu is already live", (unsigned long long)id);
    cr_assert(strstr(kvt_last_error(), want) != NULL, "%s", kvt_last_error());
    c = (kvt_seq *)&c;
    cr_assert_eq(kvt_seq_fork(p, id, &c), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(c);
    cr_assert(strstr(kvt_last_error(), want) != NULL, "%s", kvt_last_error());
    c = (kvt_seq *)&c;
    cr_assert_eq(kvt_seq_attach(p, 16, id, &c), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(c);
    cr_assert(strstr(kvt_last_error(), want) != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_memory_stats(ctx, &after), KVT_OK);
    cr_assert_eq(after.requests, before.requests);
    cr_assert_eq(after.pages_in_use, before.pages_in_use);
    cr_assert_eq(after.shared_pages, before.shared_pages);
    cr_assert_eq(kvt_seq_check(p), KVT_OK, "%s", kvt_last_error());
}

Test(fork, live_request_ids_are_unique) {
    kvt_model *m = tu_mixed_model();
    for (int slots = 0; slots < 2; slots++) { /* requests built on demand, or parked slots */
        kvt_ctx *ctx = slots ? tu_mixed_ctx_slots(m, false, 64, TU_K, 0, 4, 256)
                             : tu_mixed_ctx(m, false, 64);
        kvt_ctx *other = tu_mixed_ctx(m, false, 8);
        cr_assert(ctx && other);
        kvt_seq *p = new_seq(ctx, 1, 4), *q = new_seq(ctx, 2, 0), *c, *x;
        cr_assert_eq(kvt_seq_request_id(p), 1u);
        cr_assert_eq(kvt_seq_request_id(NULL), 0u);
        step(p, m, 32, 0, false);
        ids_refused(ctx, p, 1); /* its own id */
        ids_refused(ctx, p, 2); /* another live request's */
        kvt_seq_destroy(q);     /* free again */
        cr_assert_eq(kvt_seq_fork(p, 2, &c), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_request_id(c), 2u);
        cr_assert_eq(kvt_seq_attach(p, 16, 3, &x), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_request_id(x), 3u);
        ids_refused(ctx, p, 3);
        cr_assert_eq(tu_seq_create(other, 1, &q), KVT_OK, "%s", kvt_last_error());
        kvt_seq_destroy(x);
        cr_assert_eq(tu_seq_create(ctx, 3, &x), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_request_id(x), 3u);
        kvt_ctx_destroy(other);
        kvt_ctx_destroy(ctx);
    }
    kvt_model_destroy(m);
}

Test(fork, misuse_and_exhaustion) {
    kvt_model *m = tu_mixed_model();
    kvt_ctx *ctx = tu_mixed_ctx(m, false, 8); /* 8 pages of 16 rows per group */
    cr_assert(m && ctx);
    kvt_seq *p = new_seq(ctx, 1, 4), *c;
    step(p, m, 40, 0, false); /* 3 pages, the last one partial */
    cr_assert_eq(kvt_seq_fork(p, 2, NULL), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(tu_reserve(p, 1), KVT_OK);
    cr_assert_eq(kvt_seq_fork(p, 2, &c), KVT_ERR_BAD_STATE);
    cr_assert_null(c);
    cr_assert_eq(tu_commit(p, 1), KVT_OK);
    kvt_seq *kids[3];
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvt_seq_fork(p, 10 + (uint64_t)i, &kids[i]), KVT_OK, "%s", kvt_last_error());
    /* 3 pages shared by 4 requests, 5 free: each writer copies the shared partial page. */
    uint32_t free0;
    cr_assert_eq(kvt_ctx_free_pages(ctx, TU_L_SAL, &free0), KVT_OK);
    cr_assert_eq(free0, 5u);
    for (int i = 0; i < 3; i++)
        step(kids[i], m, 1, 5 + (uint64_t)i, false);
    step(p, m, 1, 0, false); /* the last holder keeps the original: no copy */
    cr_assert_eq(kvt_ctx_free_pages(ctx, TU_L_SAL, &free0), KVT_OK);
    cr_assert_eq(free0, 2u);
    /* Exhaust: a fork shares, its write needs a page the pool does not have. */
    kvt_seq *more[3];
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kvt_seq_fork(kids[0], 20 + (uint64_t)i, &more[i]), KVT_OK);
    for (int i = 0; i < 2; i++)
        step(more[i], m, 1, 30 + (uint64_t)i, false);
    cr_assert_eq(tu_reserve(more[2], 1), KVT_ERR_POOL_EXHAUSTED);
    cr_assert(strstr(kvt_last_error(), "free page") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(more[2]), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(more[0]);
    step(more[2], m, 1, 32, false);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* A prefix holder of exactly P = 128 rows (no round yet: K is large), two requests attached to
 * its 128 rows, each then decoded on its own, against unshared requests of the same ids fed the
 * same rows; an attach to its first 64 is refused (its sliding window returned rows a request of
 * 64 rows still holds). */
Test(fork, attached_requests_equal_unshared_requests) {
    kvt_model *m = tu_mixed_model();
    const uint32_t NP = 512, K = 256;
    kvt_ctx *ctx = tu_mixed_ctx_k(m, true, NP, K), *ref = tu_mixed_ctx_k(m, true, NP, K);
    cr_assert(m && ctx && ref);
    kvt_seq *holder = new_seq(ctx, 1, 40);
    for (int k = 0; k < 8; k++)
        step(holder, m, 16, 0, k % 2); /* 128 rows: two closed blocks of 64 */
    const uint64_t P[2] = {128, 128};
    kvt_seq *c[2], *twin[2];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(kvt_seq_attach(holder, P[i], 20 + (uint64_t)i, &c[i]), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_seq_length(c[i]), P[i]);
        cr_assert_eq(kvt_seq_check(c[i]), KVT_OK, "%s", kvt_last_error());
        twin[i] = new_seq(ref, 20 + (uint64_t)i, 40);
        step(twin[i], m, (uint32_t)P[i], 0, false);
        same(c[i], twin[i], "attached as created", 0);
    }
    tu_rng rng = {5};
    for (int k = 0; k < 60; k++)
        for (int i = 0; i < 2; i++) {
            uint32_t n = 1 + (uint32_t)(tu_next(&rng) % 12);
            bool run = tu_next(&rng) & 1;
            step(c[i], m, n, 300 + (uint64_t)i, run);
            step(twin[i], m, n, 300 + (uint64_t)i, run);
            same(c[i], twin[i], "attached vs unshared", k);
        }
    /* Misuse: not a page multiple, past the length, a prefix a window or a round changed. */
    kvt_seq *x;
    cr_assert_eq(kvt_seq_attach(holder, 64, 9, &x), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "returned rows") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_attach(holder, 40, 9, &x), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_seq_attach(holder, 144, 9, &x), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_seq_attach(c[0], 64, 9, &x), KVT_ERR_UNSUPPORTED, "%s", kvt_last_error());
    cr_assert_null(x);
    cr_assert_eq(kvt_seq_check(holder), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_ctx_destroy(ref);
    kvt_model_destroy(m);
}

static kvt_layer_stats sal_stats(const kvt_seq *s) {
    kvt_layer_stats st = {.struct_size = sizeof st};
    cr_assert_eq(kvt_seq_layer_stats(s, TU_L_SAL, &st), KVT_OK, "%s", kvt_last_error());
    return st;
}

/* Free pages of every layer's group, summed (a leak or a lost reference shows here). */
static uint32_t free_sum(kvt_ctx *ctx) {
    uint32_t sum = 0;
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        uint32_t f;
        cr_assert_eq(kvt_ctx_free_pages(ctx, l, &f), KVT_OK);
        sum += f;
    }
    return sum;
}

/* Fork, attach and a copy-on-write reserve with the k-th host allocation failing, for every k
 * until the call needs fewer: every failure is KVT_ERR_OUT_OF_MEMORY (or, for the reserve, the
 * step simply fails) with the pool as before and every request checking; then the call works.
 * Then the parent's own: the reserve of its next closing step (its planes moved into the shared
 * set at the first fork, so it takes new ones there) and a fork after that close (its shared
 * piece and its own rows copied into one new set). */
Test(fork, every_allocation_of_fork_attach_and_copy_on_write_may_fail) {
    kvt_model *m = tu_mixed_model();
    kvt_ctx *ctx = tu_mixed_ctx_sketch(m, true, 256, 256, 8); /* σ and sketch planes shared */
    cr_assert(m && ctx);
    kvt_seq *p = new_seq(ctx, 1, 20), *q = new_seq(ctx, 2, 20);
    for (int k = 0; k < 5; k++)
        step(p, m, 16 + (uint32_t)k, 0, k % 2); /* 90 rows: a closed block, a partial page */
    for (int k = 0; k < 6; k++)
        step(q, m, 16, 0, k % 2); /* a prefix holder of 96 rows (its window: the last 40) */
    /* 2: a reserve that copies the partial page; 3: one that also closes a block, so copies
     * the shared σ and sketch planes too. */
    int faults[6] = {0, 0, 0, 0, 0, 0};
    const uint32_t cow_rows[5] = {0, 0, 3, 38, 38};
    for (int what = 0; what < 6; what++) {
        for (int k = 0;; k++) {
            const uint32_t free0 = free_sum(ctx);
            kvt_seq *c = NULL;
            kvt_status s;
            fault_hits = 0;
            fault_countdown = k;
            if (what == 4) { /* the parent's closing reserve */
                const uint64_t closed = sal_stats(p).closed_rows;
                s = tu_reserve(p, cow_rows[4]);
                fault_countdown = -1;
                if (fault_hits == 0) {
                    cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
                    cr_assert_eq(tu_commit(p, cow_rows[4]), KVT_OK, "%s", kvt_last_error());
                    cr_assert_eq(sal_stats(p).closed_rows, closed + 64u);
                    cr_assert_eq(kvt_seq_check(p), KVT_OK, "%s", kvt_last_error());
                    break;
                }
                faults[4]++;
                cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "k=%d: %s", k, kvt_last_error());
                cr_assert_eq(kvt_seq_pending(p), 0u, "k=%d: nothing reserved", k);
                cr_assert_eq(free_sum(ctx), free0, "k=%d: pages back", k);
                cr_assert_eq(kvt_seq_check(p), KVT_OK, "%s", kvt_last_error());
                continue;
            }
            if (what == 0 || what == 5)
                s = kvt_seq_fork(p, 100 + (uint64_t)k + 1000u * (what == 5), &c);
            else if (what == 1)
                s = kvt_seq_attach(q, 96, 200 + (uint64_t)k, &c);
            else { /* the copy-on-write reserve of a fresh fork */
                fault_countdown = -1;
                cr_assert_eq(kvt_seq_fork(p, 300 + (uint64_t)k, &c), KVT_OK, "%s",
                             kvt_last_error());
                fault_countdown = k;
                s = tu_reserve(c, cow_rows[what]);
            }
            fault_countdown = -1;
            if (fault_hits == 0) { /* the call needed fewer than k + 1 allocations */
                cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
                if (what == 2 || what == 3)
                    cr_assert_eq(tu_commit(c, cow_rows[what]), KVT_OK, "%s", kvt_last_error());
                cr_assert_eq(kvt_seq_check(c), KVT_OK, "%s", kvt_last_error());
                kvt_seq_destroy(c);
                cr_assert_eq(free_sum(ctx), free0, "pages back after destroy");
                break;
            }
            faults[what]++;
            cr_assert_eq(s, KVT_ERR_OUT_OF_MEMORY, "k=%d: %s (%s)", k, kvt_status_name(s),
                         kvt_last_error());
            if (what < 2 || what == 5) {
                cr_assert_null(c);
                cr_assert_eq(free_sum(ctx), free0, "k=%d: a failed %s kept pages", k,
                             what ? "attach" : "fork");
            } else {
                cr_assert_eq(kvt_seq_pending(c), 0u, "k=%d: nothing reserved", k);
                cr_assert_eq(free_sum(ctx), free0, "k=%d: the refused reserve kept copies", k);
                cr_assert_eq(kvt_seq_check(c), KVT_OK, "%s", kvt_last_error());
                kvt_seq_destroy(c);
                cr_assert_eq(free_sum(ctx), free0, "k=%d: pages back", k);
            }
            cr_assert_eq(kvt_seq_check(p), KVT_OK, "%s", kvt_last_error());
        }
    }
    cr_log_info("faults injected: fork %d, attach %d, copy-on-write reserve %d (closing a "
                "block: %d), the parent's closing reserve %d, a fork after it %d",
                faults[0], faults[1], faults[2], faults[3], faults[4], faults[5]);
    cr_assert(faults[0] > 0 && faults[1] > 0 && faults[2] > 0 && faults[3] > faults[2],
              "the close's own σ and sketch planes can fail too");
    cr_assert(faults[4] > 0, "the parent takes own planes at its closing reserve");
    cr_assert(faults[5] > faults[0], "the fork's copy into a new set can fail too");
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* The context's memory, shared pages and side planes counted once. */
static kvt_ctx_memory memory_of(const kvt_ctx *ctx) {
    kvt_ctx_memory mm = {.struct_size = sizeof mm};
    cr_assert_eq(kvt_ctx_memory_stats(ctx, &mm), KVT_OK, "%s", kvt_last_error());
    return mm;
}

/* The same σ plane (bit for bit). */
static void same_scores(const kvt_seq *a, const kvt_seq *b, const char *what, int k) {
    static float x[1024], y[1024];
    uint64_t na, nb;
    cr_assert_eq(kvt_seq_scores(a, TU_L_SAL, x, 1024, &na), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_scores(b, TU_L_SAL, y, 1024, &nb), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(na, nb, "%s, step %d: %llu vs %llu closed rows", what, k,
                 (unsigned long long)na, (unsigned long long)nb);
    cr_assert_eq(memcmp(x, y, sizeof *x * na), 0, "%s, step %d: σ differs", what, k);
}

/* Snapshots of two requests hold the same bytes (rows, σ, kept set, sketches, counters). */
static void same_snapshot(const kvt_seq *a, const kvt_seq *b, const char *what) {
    size_t na, nb;
    cr_assert_eq(kvt_seq_snapshot_size(a, &na), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_snapshot_size(b, &nb), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(na, nb, "%s: snapshot sizes %zu vs %zu", what, na, nb);
    uint8_t *x = malloc(na), *y = malloc(nb);
    cr_assert(x && y);
    cr_assert_eq(kvt_seq_snapshot(a, x, na, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_snapshot(b, y, nb, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(memcmp(x, y, na), 0, "%s: snapshots differ", what);
    free(x);
    free(y);
}

/* Salience side planes of closed blocks (σ, sketches) are one set for the parent and its
 * children for as long as they live: a holder's later closes go into planes of its own, covering
 * only its rows past the shared ones (no copy of the set); the context's memory counts
 * shared pages and planes once and agrees with the requests' own statistics; every request
 * equals its unshared twin throughout (rows, σ, snapshot bytes); a child's snapshot written
 * after its parent is gone restores elsewhere and continues alike. */
Test(fork, side_planes_stay_shared_past_later_closes_and_are_counted_once) {
    kvt_model *m = tu_mixed_model();
    const uint32_t NP = 512, K = 512, RANK = 8;
    kvt_ctx *ctx = tu_mixed_ctx_sketch(m, false, NP, K, RANK);
    kvt_ctx *ref = tu_mixed_ctx_sketch(m, false, NP, K, RANK);
    cr_assert(m && ctx && ref);
    kvt_seq *all[N_CHILD + 1], *twin[N_CHILD + 1];
    all[0] = new_seq(ctx, 1, 40);
    for (int i = 0; i <= N_CHILD; i++)
        twin[i] = new_seq(ref, i == 0 ? 1 : 10 + (uint64_t)i, 40);
    for (int k = 0; k < 4; k++) { /* 200 rows: three closed blocks of 64 */
        step(all[0], m, 50, 0, k % 2);
        for (int i = 0; i <= N_CHILD; i++)
            step(twin[i], m, 50, 0, k % 2);
    }
    const kvt_ctx_memory m0 = memory_of(ctx);
    const kvt_layer_stats p0 = sal_stats(all[0]);
    cr_assert_eq(p0.closed_rows, 192u);
    cr_assert_eq(p0.shared_side_bytes, 0u);
    cr_assert_eq(m0.shared_side_bytes, 0u);
    cr_assert_eq(m0.shared_pages, 0u);
    for (int i = 1; i <= N_CHILD; i++) {
        cr_assert_eq(kvt_seq_fork(all[0], 10 + (uint64_t)i, &all[i]), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_seq_check(all[i]), KVT_OK, "%s", kvt_last_error());
    }
    cr_assert_eq(kvt_seq_check(all[0]), KVT_OK, "%s", kvt_last_error());
    /* σ (4 B), 8 fp16 sketch values and ρ (4 B) per closed row: at least 24 B x 192 rows. */
    const kvt_layer_stats p1 = sal_stats(all[0]);
    cr_assert_geq(p1.shared_side_bytes, 24u * 192u);
    cr_assert_eq(p1.side_bytes, p0.side_bytes, "the parent's planes are the set now shared");
    const kvt_ctx_memory m1 = memory_of(ctx);
    uint64_t own_sum = 0, held_pages = 0;
    for (int i = 0; i <= N_CHILD; i++)
        for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
            kvt_layer_stats st = {.struct_size = sizeof st};
            cr_assert_eq(kvt_seq_layer_stats(all[i], l, &st), KVT_OK);
            own_sum += st.side_bytes - st.shared_side_bytes;
            if (l == TU_L_SAL) {
                held_pages += st.pages_in_use;
                cr_assert_eq(st.shared_side_bytes, p1.shared_side_bytes, "request %d", i);
                cr_assert_eq(st.shared_pages, st.pages_in_use);
            }
        }
    cr_assert_eq(m1.requests, N_CHILD + 1u);
    cr_assert_eq(m1.pages_in_use, m0.pages_in_use, "a fork takes no page");
    cr_assert_eq(m1.shared_pages, m1.pages_in_use);
    cr_assert_eq(m1.shared_bytes, m1.bytes_in_use);
    cr_assert_eq(m1.bytes_in_use, m0.bytes_in_use);
    uint32_t sal_free;
    cr_assert_eq(kvt_ctx_free_pages(ctx, TU_L_SAL, &sal_free), KVT_OK);
    cr_assert_eq(held_pages, (N_CHILD + 1u) * (NP - sal_free), "the requests count each page");
    cr_assert_eq(m1.shared_side_bytes, p1.shared_side_bytes, "one shared set, counted once");
    cr_assert_eq(m1.side_bytes, own_sum + m1.shared_side_bytes);
    const kvt_ctx_memory mr = memory_of(ref);
    cr_log_info("side bytes: %llu shared (%llu in the shared set), %llu unshared; pool bytes "
                "%llu vs %llu",
                (unsigned long long)m1.side_bytes, (unsigned long long)m1.shared_side_bytes,
                (unsigned long long)mr.side_bytes, (unsigned long long)m1.bytes_in_use,
                (unsigned long long)mr.bytes_in_use);
    cr_assert_lt(m1.side_bytes + 2 * p1.shared_side_bytes, mr.side_bytes + 1,
                 "the children's copies are not made");
    for (int i = 0; i <= N_CHILD; i++) {
        same(all[i], twin[i], "as forked", 0);
        same_scores(all[i], twin[i], "as forked", 0);
    }
    /* One row a step, each request its own rows: at the close at 256 rows each holder writes
     * its fourth block into planes of its own; the three shared blocks stay one set. */
    tu_rng rng = {0x51de};
    for (int k = 0; k < 60; k++) {
        for (int i = 0; i <= N_CHILD; i++) {
            bool run = tu_next(&rng) & 1;
            step(all[i], m, 1, 500 + (uint64_t)i, run);
            step(twin[i], m, 1, 500 + (uint64_t)i, run);
            same(all[i], twin[i], i ? "child vs unshared" : "parent vs never forked", k);
            same_scores(all[i], twin[i], "σ", k);
        }
        const kvt_ctx_memory mk = memory_of(ctx);
        cr_assert_eq(mk.shared_side_bytes, p1.shared_side_bytes, "step %d", k);
        for (int i = 0; i <= N_CHILD; i++)
            cr_assert_eq(sal_stats(all[i]).shared_side_bytes, p1.shared_side_bytes, "step %d", k);
    }
    /* 256 closed rows each; 192 of them in the one shared set: the unshared twins hold four
     * copies of those rows' planes (σ 4 B, the sketch 2·RANK B and ρ 4 B a row), the sharing
     * requests one. Each sharing holder also takes own sketch planes for its open block's rows
     * (they are sketched ahead of the close) where the twins' planes had room to spare: at most
     * a block of them each. A copy of the shared rows (N_CHILD × 192 rows) is past that. */
    cr_assert_eq(sal_stats(all[N_CHILD]).closed_rows, 256u);
    const kvt_ctx_memory m2 = memory_of(ctx), mr2 = memory_of(ref);
    cr_log_info("after the next close: side bytes %llu shared vs %llu unshared",
                (unsigned long long)m2.side_bytes, (unsigned long long)mr2.side_bytes);
    const uint64_t shared_rows = 192u * (4u + 2u * RANK + 4u);
    const uint64_t open_room = (N_CHILD + 1u) * 64u * (2u * RANK + 4u);
    cr_assert_leq(N_CHILD * shared_rows, p1.shared_side_bytes * N_CHILD);
    cr_assert_gt(N_CHILD * shared_rows, open_room, "the test could not see a copy");
    cr_assert_leq(m2.side_bytes + N_CHILD * shared_rows, mr2.side_bytes + open_room,
                  "the shared rows' planes were copied (%llu vs %llu)",
                  (unsigned long long)m2.side_bytes, (unsigned long long)mr2.side_bytes);
    for (int i = 0; i <= N_CHILD; i++)
        same_snapshot(all[i], twin[i], "fork vs unshared");
    /* The parent goes; a child's snapshot is self-contained. */
    kvt_seq_destroy(all[0]);
    size_t bytes;
    cr_assert_eq(kvt_seq_snapshot_size(all[1], &bytes), KVT_OK, "%s", kvt_last_error());
    void *buf = malloc(bytes);
    cr_assert(buf);
    cr_assert_eq(kvt_seq_snapshot(all[1], buf, bytes, NULL), KVT_OK, "%s", kvt_last_error());
    kvt_ctx *other = tu_mixed_ctx_sketch(m, false, NP, K, RANK);
    kvt_seq *back;
    cr_assert_eq(kvt_seq_restore(other, buf, bytes, &back), KVT_OK, "%s", kvt_last_error());
    free(buf);
    for (int k = 0; k < 70; k++) { /* through the next close */
        same(back, all[1], "restored child", k);
        same_scores(back, all[1], "restored child", k);
        step(back, m, 1, 77, k % 2);
        step(all[1], m, 1, 77, k % 2);
    }
    for (int i = 1; i <= N_CHILD; i++)
        cr_assert_eq(kvt_seq_check(all[i]), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(other);
    kvt_ctx_destroy(ctx);
    kvt_ctx_destroy(ref);
    kvt_model_destroy(m);
}

/* Attached requests share the closed blocks' planes of their prefix with its holder; one that
 * closes a block still shares them (its new block goes into its own planes); the set is freed
 * with its last holder and counted as that holder's own once it is alone. */
Test(fork, attached_requests_share_side_planes_past_their_closes) {
    kvt_model *m = tu_mixed_model();
    kvt_ctx *ctx = tu_mixed_ctx_sketch(m, false, 512, 512, 8);
    cr_assert(m && ctx);
    kvt_seq *holder = new_seq(ctx, 1, 40);
    for (int k = 0; k < 8; k++)
        step(holder, m, 16, 0, k % 2); /* 128 rows: two closed blocks */
    kvt_seq *a, *b;
    cr_assert_eq(kvt_seq_attach(holder, 128, 2, &a), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_attach(holder, 128, 3, &b), KVT_OK, "%s", kvt_last_error());
    const kvt_layer_stats h = sal_stats(holder), sa = sal_stats(a), sb = sal_stats(b);
    cr_assert_gt(h.shared_side_bytes, 0u);
    cr_assert_eq(sa.shared_side_bytes, h.shared_side_bytes);
    cr_assert_eq(sb.shared_side_bytes, h.shared_side_bytes);
    cr_assert_eq(memory_of(ctx).shared_side_bytes, h.shared_side_bytes);
    cr_assert_eq(kvt_seq_check(b), KVT_OK, "%s", kvt_last_error());
    /* b closes its third block first, then the holder: all three still share the two blocks. */
    for (int k = 0; k < 64; k++)
        step(b, m, 1, 9, k % 2);
    for (int k = 0; k < 64; k++)
        step(holder, m, 1, 0, k % 2);
    cr_assert_eq(sal_stats(b).closed_rows, 192u);
    cr_assert_eq(sal_stats(holder).closed_rows, 192u);
    cr_assert_eq(sal_stats(b).shared_side_bytes, h.shared_side_bytes);
    cr_assert_eq(sal_stats(a).shared_side_bytes, h.shared_side_bytes);
    cr_assert_eq(sal_stats(holder).shared_side_bytes, h.shared_side_bytes);
    cr_assert_eq(memory_of(ctx).shared_side_bytes, h.shared_side_bytes);
    kvt_seq_destroy(a);
    cr_assert_eq(sal_stats(holder).shared_side_bytes, h.shared_side_bytes, "b still holds it");
    cr_assert_eq(kvt_seq_check(holder), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(b), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(b);
    cr_assert_eq(sal_stats(holder).shared_side_bytes, 0u, "the last holder owns the set");
    cr_assert_eq(memory_of(ctx).shared_side_bytes, 0u);
    cr_assert_eq(kvt_seq_check(holder), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(holder);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Request slots (max_seqs, max_rows_per_seq): a forked child takes a slot and shares its
 * parent's side planes; destroyed, the slot is parked and gives its share back (the parent is
 * the set's only holder again); the slot serves a new request from scratch; a second fork of the
 * parent, which closed blocks since the first, shares one new set of all its closed rows; and
 * the closes after it keep sharing it (each writes its own planes, sized at the slot's creation
 * or taken at the step's reserve, never in the step). */
Test(fork, parked_slots_give_their_share_back) {
    kvt_model *m = tu_mixed_model();
    kvt_ctx *ctx = tu_mixed_ctx_slots(m, false, 512, 512, 8, 4, 1024);
    cr_assert(m && ctx);
    kvt_seq *p = new_seq(ctx, 1, 40), *c;
    for (int k = 0; k < 9; k++)
        step(p, m, 16, 0, k % 2); /* 144 rows: two closed blocks */
    cr_assert_eq(kvt_seq_fork(p, 2, &c), KVT_OK, "%s", kvt_last_error());
    const kvt_layer_stats shared = sal_stats(c);
    cr_assert_gt(shared.shared_side_bytes, 0u);
    cr_assert_eq(sal_stats(p).shared_side_bytes, shared.shared_side_bytes);
    cr_assert_eq(kvt_seq_check(p), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(c); /* parked */
    cr_assert_eq(sal_stats(p).shared_side_bytes, 0u, "the parked slot holds no share");
    cr_assert_eq(memory_of(ctx).shared_side_bytes, 0u);
    cr_assert_eq(memory_of(ctx).requests, 1u);
    cr_assert_eq(kvt_seq_check(p), KVT_OK, "%s", kvt_last_error());
    kvt_seq *fresh = new_seq(ctx, 3, 40), *ref = NULL;
    kvt_ctx *rctx = tu_mixed_ctx_slots(m, false, 512, 512, 8, 4, 1024);
    cr_assert(rctx);
    ref = new_seq(rctx, 3, 40);
    for (int k = 0; k < 10; k++) {
        step(fresh, m, 16, 5, k % 2);
        step(ref, m, 16, 5, k % 2);
        same(fresh, ref, "slot reused", k);
        same_scores(fresh, ref, "slot reused", k);
        step(p, m, 16, 0, k % 2);
    }
    cr_assert_eq(sal_stats(fresh).shared_side_bytes, 0u);
    /* Fork again: p's closed rows (a shared piece, then its own) become one new set. */
    const uint64_t p_closed = sal_stats(p).closed_rows;
    cr_assert_eq(kvt_seq_fork(p, 4, &c), KVT_OK, "%s", kvt_last_error());
    const kvt_layer_stats again = sal_stats(c);
    cr_assert_eq(again.closed_rows, p_closed);
    cr_assert_geq(again.shared_side_bytes, 24u * p_closed, "σ, 8 sketch values and ρ a row");
    cr_assert_gt(p_closed, 128u);
    cr_assert_eq(sal_stats(p).shared_side_bytes, again.shared_side_bytes);
    cr_assert_eq(memory_of(ctx).shared_side_bytes, again.shared_side_bytes);
    for (int w = 0; w < 2; w++) { /* the child closes a block, then the parent */
        kvt_seq *q = w ? p : c;
        const uint32_t to_close = (uint32_t)(64 - kvt_seq_length(q) % 64);
        cr_assert_eq(tu_reserve(q, to_close), KVT_OK, "%s", kvt_last_error());
        write_rows(q, m, kvt_seq_length(q), to_close, 6);
        cr_assert_eq(tu_commit_run(q, to_close), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(sal_stats(q).closed_rows, p_closed + 64);
        cr_assert_eq(sal_stats(q).shared_side_bytes, again.shared_side_bytes, "still shared");
        cr_assert_eq(kvt_seq_check(q), KVT_OK, "%s", kvt_last_error());
    }
    kvt_ctx_destroy(rctx);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* F0 (issue 32): an attach to a request whose eviction rounds have compacted its table. The
 * rows past the prefix its rounds protect have moved, and the compacted table may hold fewer
 * pages than the prefix asks for: every such attach is KVT_ERR_UNSUPPORTED with nothing
 * changed (no page shared, no reference count touched, *out NULL); an attach within the
 * protected prefix (or before any round) succeeds and its child checks. Page sizes 16 to 96
 * rows, rows committed in steps of 1 to 200, every prefix length that is a page multiple. The
 * fuzzer's reproducer: one step past a round, prefix 64 on 64-row pages (also 40/40, 96/96);
 * it read the table past its pages and pushed a free page twice (ASan: heap-buffer-overflow in
 * kvt__pool_put). */
Test(fork, attach_after_rounds_is_refused_with_nothing_changed) {
    kvt_model *m = tu_mixed_model();
    cr_assert_not_null(m);
    const uint32_t page_rows[] = {16, 24, 40, 64, 96};
    const uint32_t steps[][3] = {{200, 0, 0}, {64, 1, 0}, {40, 1, 1}, {100, 0, 0}, {7, 9, 60}};
    uint32_t refused = 0, attached = 0;
    for (size_t a = 0; a < 2; a++)
        for (size_t pi = 0; pi < sizeof page_rows / sizeof *page_rows; pi++)
            for (size_t si = 0; si < sizeof steps / sizeof *steps; si++) {
                const uint32_t PR = page_rows[pi], NP = 256;
                kvt_ctx *ctx = tu_mixed_ctx_pages(m, a == 1, NP, PR);
                cr_assert_not_null(ctx, "%s", kvt_last_error());
                kvt_seq *src = new_seq(ctx, 1, 4);
                for (int k = 0; k < 3 && steps[si][k]; k++)
                    step(src, m, steps[si][k], 0, k % 2);
                for (int rep = 0; rep < 2; rep++) {
                    const uint64_t n = kvt_seq_length(src);
                    for (uint64_t P = PR; P <= n; P += PR) {
                        const uint32_t free0 = free_sum(ctx);
                        kvt_seq *c = (kvt_seq *)&c; /* must become NULL on refusal */
                        kvt_status s = kvt_seq_attach(src, P, 50 + P, &c);
                        cr_assert(s == KVT_OK || s == KVT_ERR_UNSUPPORTED,
                                  "page %u steps %zu prefix %llu: %s (%s)", PR, si,
                                  (unsigned long long)P, kvt_strerror(s), kvt_last_error());
                        cr_assert_eq(kvt_seq_check(src), KVT_OK, "%s", kvt_last_error());
                        if (s != KVT_OK) {
                            refused++;
                            cr_assert_null(c);
                            cr_assert_eq(free_sum(ctx), free0, "page %u prefix %llu", PR,
                                         (unsigned long long)P);
                            continue;
                        }
                        attached++;
                        cr_assert_eq(kvt_seq_length(c), P);
                        cr_assert_eq(kvt_seq_check(c), KVT_OK, "%s", kvt_last_error());
                        step(c, m, 3, 7, false);
                        cr_assert_eq(kvt_seq_check(src), KVT_OK, "%s", kvt_last_error());
                        kvt_seq_destroy(c);
                        cr_assert_eq(free_sum(ctx), free0, "page %u prefix %llu", PR,
                                     (unsigned long long)P);
                    }
                    step(src, m, 30, 1, rep); /* past another round */
                }
                cr_assert_eq(kvt_seq_check(src), KVT_OK, "%s", kvt_last_error());
                kvt_ctx_destroy(ctx);
            }
    cr_log_info("attach after rounds: %u refused, %u attached", refused, attached);
    cr_assert(refused > 0 && attached > 0);
    kvt_model_destroy(m);
}

/* F2 (issue 32): a batch reserve refused (the pool exhausted by a later request, or the k-th
 * host allocation failing) after an earlier request of the batch copied shared pages on write
 * leaves every request and pool as they were: free pages, the fork's shared pages, and the
 * pools' free stacks (the next reserve's slot_mapping equals that of a twin context where the
 * refused reserve never happened). The reproducer: free pages 86/92/92 -> 85/88/91 and the
 * fork's shared pages 10 -> 9 after a refused reserve. */
static void shared_of(kvt_seq *s, uint32_t *out) {
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        kvt_layer_stats st = {.struct_size = sizeof st};
        cr_assert_eq(kvt_seq_layer_stats(s, l, &st), KVT_OK, "%s", kvt_last_error());
        out[l] = (uint32_t)st.shared_pages;
    }
}

static void slots_of(kvt_ctx *ctx, kvt_seq **seqs, const uint32_t *n, uint32_t n_seqs,
                     int32_t *slots, uint32_t cap) {
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, n_seqs, &b), KVT_OK);
    cr_assert_eq(kvt_batch_reserve(b, seqs, n, n_seqs), KVT_OK, "%s", kvt_last_error());
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        uint32_t got;
        cr_assert_eq(kvt_batch_slot_mapping(b, l, slots + l * cap, cap, &got), KVT_OK);
    }
    kvt_batch_destroy(b); /* before any run: given back */
}

Test(fork, refused_reserve_gives_copies_on_write_back) {
    kvt_model *m = tu_mixed_model();
    cr_assert_not_null(m);
    const uint32_t NP = 40, CAP = 64;
    kvt_ctx *ctx[2] = {tu_mixed_ctx(m, true, NP), tu_mixed_ctx(m, true, NP)};
    kvt_seq *p[2], *c[2], *r[2];
    for (int x = 0; x < 2; x++) {
        cr_assert_not_null(ctx[x]);
        p[x] = new_seq(ctx[x], 1, 20);
        r[x] = new_seq(ctx[x], 2, 20);
        for (int k = 0; k < 5; k++)
            step(p[x], m, 9 + (uint32_t)k, 0, k % 2); /* 55 rows: a partial page */
        step(r[x], m, 16, 1, false);
        cr_assert_eq(kvt_seq_fork(p[x], 3, &c[x]), KVT_OK, "%s", kvt_last_error());
    }
    uint32_t shared0[TU_N_LAYERS], shared1[TU_N_LAYERS];
    int refusals = 0;
    for (int how = 0; how < 2; how++)
        for (int k = 0; k < (how ? 40 : 1); k++) {
            /* a fresh fork each time: its allocations (the copy-on-write log among them) are
             * all made by the reserve under test */
            kvt_seq *f;
            cr_assert_eq(kvt_seq_fork(p[0], 10 + (uint64_t)k, &f), KVT_OK, "%s",
                         kvt_last_error());
            const uint32_t free0 = free_sum(ctx[0]);
            shared_of(f, shared0);
            kvt_batch *b;
            cr_assert_eq(kvt_batch_create(ctx[0], 2, &b), KVT_OK);
            kvt_seq *seqs[2] = {f, r[0]};
            /* the fork writes into its shared partial page (a copy on write); then r asks
             * for more pages than are free (how 0), or the k-th allocation fails (how 1) */
            uint32_t n[2] = {3, how ? 320 : 16u * NP}; /* 320: r's table grows */
            fault_hits = 0;
            fault_countdown = how ? k : -1;
            kvt_status s = kvt_batch_reserve(b, seqs, n, 2);
            fault_countdown = -1;
            if (how && fault_hits == 0) {
                cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
                kvt_batch_destroy(b);
                kvt_seq_destroy(f);
                break;
            }
            refusals++;
            cr_assert_eq(s, how ? KVT_ERR_OUT_OF_MEMORY : KVT_ERR_POOL_EXHAUSTED, "k=%d: %s", k,
                         kvt_last_error());
            cr_assert_eq(free_sum(ctx[0]), free0, "how %d k=%d: free pages changed", how, k);
            shared_of(f, shared1);
            for (uint32_t l = 0; l < TU_N_LAYERS; l++)
                cr_assert_eq(shared1[l], shared0[l], "how %d k=%d layer %u: shared pages %u -> %u",
                             how, k, l, shared0[l], shared1[l]);
            cr_assert_eq(kvt_seq_pending(f) + kvt_seq_pending(r[0]), 0u);
            cr_assert_eq(kvt_seq_check(f), KVT_OK, "%s", kvt_last_error());
            cr_assert_eq(kvt_seq_check(r[0]), KVT_OK, "%s", kvt_last_error());
            cr_assert_eq(kvt_seq_check(p[0]), KVT_OK, "%s", kvt_last_error());
            kvt_batch_destroy(b);
            kvt_seq_destroy(f);
        }
    cr_log_info("refused batch reserves with a copy on write: %d", refusals);
    cr_assert(refusals > 2, "the copy-on-write log's own allocation and r's can fail");
    /* The free stacks as in the twin that never saw the refusals: the same slots. */
    int32_t s0[TU_N_LAYERS * 64], s1[TU_N_LAYERS * 64];
    kvt_seq *q0[2] = {c[0], r[0]}, *q1[2] = {c[1], r[1]};
    const uint32_t n[2] = {3, 20};
    slots_of(ctx[0], q0, n, 2, s0, CAP);
    slots_of(ctx[1], q1, n, 2, s1, CAP);
    for (uint32_t l = 0; l < TU_N_LAYERS; l++)
        for (uint32_t t = 0; t < 23; t++)
            cr_assert_eq(s0[l * CAP + t], s1[l * CAP + t], "layer %u token %u", l, t);
    for (int x = 0; x < 2; x++) {
        kvt_ctx_destroy(ctx[x]);
    }
    kvt_model_destroy(m);
}
