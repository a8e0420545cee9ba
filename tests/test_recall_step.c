/*
 * test_recall_step.c — the recall trigger inside a decode step (kvt_batch_run with recall on,
 * docs/recall.md §4): every emitted set is checked against a host oracle built from the
 * per-element functions (recall/kernels/recall_scan.h, recall/kernels/conformal_math.h) on the rows
 * as the test wrote them — calibration steps attend every row and fix z exactly as
 * recall/conformal.c does on the same samples; later steps attend sinks ∪ kept ∪ tail ∪ the rows
 * the trigger fires; overflow attends every row; the CPU and guarded backends (and CUDA, where a
 * device is usable: skipped with a note without one, a failure with KVT_REQUIRE_GPU=1) emit the
 * same sets; kvt_seq_check passes after every step. Seeds are fixed.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"
#include "fuzz/fuzz.h" /* fuzz_fix_crcs */
#include "kvtier.h"
#include "support/tu_cuda.h"
#include "lib/base/alloc.h"
#include "lib/handles.h"
#include "recall/conformal.h"
#include "support/testutil.h"
#include "tiers/tiers_internal.h" /* white-box: the policies' states */

#define D 512u
#define QD 576u  /* latent + branch */
#define RB 16u   /* basis rank */
#define H 4u     /* query heads */
#define PR 16u   /* page rows */
#define NMAX 1024u

/* Block rows of the next rig (64 unless a test asks for more), and whether its rows come from 4
 * tight clusters (the pruned scan's case) instead of the spread default. */
static uint32_t g_block = 64;
static bool g_clustered = false;
/* Promotion of the next rig: capacity (0: off), hits, window. */
static uint32_t g_promote[3] = {0, 3, 8};
/* config.recall_lagged_query of the next rig. */
static bool g_lagged;
/* The next rig's decode steps planned on the device (kvt_batch_plan_device) where plannable,
 * with a fixed emission (topk NMAX); its context states max_rows_per_seq. */
static bool g_planned;
static uint32_t g_scan_bits; /* params.recall_scan_bits of the next rig (0: the default) */
static uint32_t g_planned_steps; /* decode steps the planned rigs ran planned */

typedef struct rig {
    kvt_model *m;
    kvt_config c;
    kvt_ctx *ctx;
    kvt_batch *b;
    kvt_seq *seq;
    float V[RB * D];
    uint8_t *rows;       /* host copy of every row written, by position */
    uint32_t max_rows;   /* max_rows_per_seq stated (g_planned): its decode steps are planned */
    uint64_t n;          /* rows committed */
    kvt_buffer *qbuf, *ibuf, *lbuf, *dbuf;
    kvt__conformal conf; /* the oracle's calibration */
    float conf_samples[64 * H];
    tu_rng g;
} rig;

static void make_row(rig *r, uint8_t *row) {
    float c[D];
    if (g_clustered) { /* cluster k: latent along V row k, branch along axis k, tiny noise */
        uint32_t k = (uint32_t)(tu_next(&r->g) % 4u);
        for (uint32_t d = 0; d < D; d++)
            kvt__store_elem(row, KVT__DT_BF16, d,
                            3.0f * r->V[(size_t)k * D + d] + (float)(0.001 * tu_normal(&r->g)));
        for (uint32_t j = 0; j < 64; j++)
            kvt__store_elem(row + 1024, KVT__DT_BF16, j,
                            (j == 8 * k ? 4.0f : 0.0f) + (float)(0.01 * tu_normal(&r->g)));
        return;
    }
    for (uint32_t d = 0; d < D; d++)
        c[d] = (float)(0.05 * tu_normal(&r->g));
    for (uint32_t k = 0; k < 8; k++) {
        float a = (float)tu_normal(&r->g);
        for (uint32_t d = 0; d < D; d++)
            c[d] += a * r->V[(size_t)k * D + d];
    }
    for (uint32_t d = 0; d < D; d++)
        kvt__store_elem(row, KVT__DT_BF16, d, c[d]);
    for (uint32_t d = 0; d < 64; d++)
        kvt__store_elem(row + 1024, KVT__DT_BF16, d, (float)tu_normal(&r->g));
}

static void rig_open(rig *r, kvt_backend_kind be, kvt_recall_mode mode, uint32_t cap,
                     float margin, uint64_t seed) {
    memset(r, 0, sizeof *r);
    r->g.s = seed;
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    s.n_q_heads = H;
    cr_assert_eq(kvt_model_create(&s, 1, "recall-step", &r->m, NULL, 0), KVT_OK);
    r->c = kvt_config_default();
    r->c.block_rows = g_block;
    r->c.kappa = 4;
    r->c.ratio = 8;
    r->c.recall = mode;
    r->c.recall_cap_rows = cap;
    r->c.recall_margin = margin;
    r->c.recall_promote_capacity = g_promote[0];
    r->c.recall_promote_hits = g_promote[1];
    r->c.recall_promote_window = g_promote[2];
    r->c.recall_lagged_query = g_lagged;
    r->max_rows = g_planned ? NMAX : 0;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = r->m;
    p.config = &r->c;
    p.page_rows = PR;
    p.n_pages = 2 * NMAX / PR;
    p.backend = be;
    p.recall_sketch_rank = RB;
    if (g_scan_bits)
        p.recall_scan_bits = g_scan_bits;
    if (g_planned)
        p.max_rows_per_seq = NMAX;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &r->ctx, err, sizeof err), KVT_OK, "%s", err);
    cr_assert(tu_orthonormal_rows(&r->g, RB, D, r->V));
    cr_assert_eq(kvt_ctx_set_recall_basis(r->ctx, 0, r->V, RB), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_create(r->ctx, 3, &r->b), KVT_OK);
    cr_assert_eq(tu_seq_create(r->ctx, 7, &r->seq), KVT_OK, "%s", kvt_last_error());
    r->rows = calloc(NMAX, 1152);
    cr_assert(r->rows);
    cr_assert_eq(kvt_buffer_alloc(r->ctx, sizeof(float) * QD * H * 3, &r->qbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(r->ctx, sizeof(int32_t) * NMAX * 3, &r->ibuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(r->ctx, sizeof(int32_t) * 4, &r->lbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(r->ctx, 4, &r->dbuf), KVT_OK);
    kvt__conformal_init(&r->conf, r->conf_samples, 64 * H);
}

static void rig_close(rig *r) {
    kvt_ctx_destroy(r->ctx);
    kvt_model_destroy(r->m);
    free(r->rows);
}

/* A prefill of n rows in one multi-token step (attends every row: no query needed). */
static void prefill(rig *r, uint32_t n) {
    for (uint32_t u = 0; u < n; u++)
        make_row(r, r->rows + (r->n + u) * 1152);
    cr_assert_eq(kvt_batch_reserve(r->b, &r->seq, &n, 1), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_write(r->seq, 0, 0, 0, n, r->rows + r->n * 1152, (size_t)n * 1152),
                 KVT_OK);
    cr_assert_eq(kvt_batch_plan(r->b), KVT_OK);
    cr_assert_eq(kvt_batch_commit(r->b, NULL), KVT_OK, "%s", kvt_last_error());
    r->n += n;
}

static float exact(const rig *r, const float *q, uint64_t pos) {
    return kvt__recall_exact(q, r->rows + pos * 1152, KVT__DT_BF16, D, 1024, KVT__DT_BF16, 64,
                             1.0f);
}

/* A head's best exact score over the rows `in` marks (-Inf: none). */
static float best_over(const rig *r, const float *qh, const uint8_t *in, uint64_t n_rows) {
    float best = -INFINITY;
    for (uint64_t u = 0; u < n_rows; u++)
        if (in[u]) {
            float e = exact(r, qh, u);
            best = e > best ? e : best;
        }
    return best;
}

/* What one decode step emitted, and what the library's state was during it. */
typedef struct step_out {
    uint32_t len;
    int32_t idx[NMAX];
    uint8_t dense;
    uint64_t closed, n_kept;
    uint32_t kept[NMAX];
    uint16_t csk[NMAX * RB];
    float rho[NMAX];
} step_out;

/* One decode step: a new row, the queries q[H][QD], run with TOKENS emission, the state read
 * white-box before commit, then commit and kvt_seq_check. */
static void decode(rig *r, const float *q, step_out *o) {
    uint32_t one = 1;
    make_row(r, r->rows + r->n * 1152);
    cr_assert_eq(kvt_batch_reserve(r->b, &r->seq, &one, 1), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_write(r->seq, 0, 0, 0, 1, r->rows + r->n * 1152, 1152), KVT_OK);
    cr_assert_eq(kvt_batch_plan(r->b), KVT_OK);
    uint32_t topk;
    cr_assert_eq(kvt_batch_capacity(r->b, 0, &topk, NULL), KVT_OK);
    cr_assert_eq(topk, r->n + 1);
    cr_assert_eq(kvt_buffer_write(r->qbuf, 0, q, sizeof(float) * QD * H), KVT_OK);
    const bool planning = r->c.recall_lagged_query && r->max_rows; /* a planned rig */
    if (planning)
        topk = NMAX; /* one emission for every planned step */
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                  .indices = kvt_buffer_ptr(r->ibuf), .capacity = topk,
                  .lengths = kvt_buffer_ptr(r->lbuf), .dense = kvt_buffer_ptr(r->dbuf)};
    bool planned = false;
    if (planning)
        cr_assert_eq(kvt_batch_plan_device(r->b, &e, 1, NULL, &planned), KVT_OK, "%s",
                     kvt_last_error());
    g_planned_steps += planned;
    cr_assert_eq(kvt_batch_run(r->b, 0, kvt_buffer_ptr(r->qbuf), NULL, &e), KVT_OK, "%s",
                 kvt_last_error());
    int32_t len;
    cr_assert_eq(kvt_buffer_read(r->lbuf, 0, &len, sizeof len), KVT_OK);
    o->len = (uint32_t)len;
    cr_assert_eq(kvt_buffer_read(r->ibuf, 0, o->idx, sizeof(int32_t) * topk), KVT_OK);
    cr_assert_eq(kvt_buffer_read(r->dbuf, 0, &o->dense, 1), KVT_OK);
    const kvt__sal *s = &kvt__seq_state(r->seq, 0)->sal;
    const kvt__backend *be = &r->ctx->backend;
    o->closed = s->closed_rows;
    o->n_kept = s->n_kept;
    cr_assert_eq(be->ops->read(be, o->kept, s->kept, sizeof(uint32_t) * s->n_kept, NULL), KVT_OK);
    if (!s->head) { /* flat planes (a request that shares closed rows: planes_of reads them) */
        cr_assert_eq(be->ops->read(be, o->csk, s->csk, sizeof(uint16_t) * RB * o->closed, NULL),
                     KVT_OK);
        cr_assert_eq(be->ops->read(be, o->rho, s->rho, sizeof(float) * o->closed, NULL), KVT_OK);
    }
    /* padding past the set */
    for (uint32_t j = o->len; j < topk; j++)
        cr_assert_eq(o->idx[j], -1);
    cr_assert_eq(kvt_batch_commit(r->b, NULL), KVT_OK, "%s", kvt_last_error());
    r->n++;
    cr_assert_eq(kvt_seq_check(r->seq), KVT_OK, "%s", kvt_last_error());
}

/* Slot of a position (salience: row index = position). */
static int32_t slot_of(const rig *r, uint64_t pos) {
    const kvt__ptable *t = &r->seq->pt[0];
    return t->pages[pos / PR - t->first_page] * (int32_t)PR + (int32_t)(pos % PR);
}

/* Queries near the rows' subspace; target >= 0 aims every head at that row. */
static void make_queries(rig *r, float *q, int64_t target) {
    for (uint32_t h = 0; h < H; h++) {
        float *qh = q + (size_t)h * QD;
        for (uint32_t i = 0; i < QD; i++)
            qh[i] = (float)tu_normal(&r->g) * (i < D ? 0.05f : 0.3f);
        for (uint32_t k = 0; k < 8; k++) {
            float a = (float)tu_normal(&r->g) * 0.3f;
            for (uint32_t d = 0; d < D; d++)
                qh[d] += a * r->V[(size_t)k * D + d];
        }
        if (target >= 0) { /* a query that wants this row: its own latent and branch */
            const uint8_t *row = r->rows + target * 1152;
            for (uint32_t d = 0; d < D; d++)
                qh[d] += 0.5f * kvt__sketch_latent(row, KVT__DT_BF16, d);
            for (uint32_t j = 0; j < 64; j++)
                qh[D + j] += 0.5f * kvt__sigma_branch_val(row, 1024, KVT__DT_BF16, j);
        }
    }
}

/* The oracle's per-position membership of the set attended without recall. */
static void base_set(const rig *r, const step_out *o, uint64_t n_rows, uint8_t *in) {
    memset(in, 0, n_rows);
    uint64_t S = r->c.sink_rows < o->closed ? r->c.sink_rows : o->closed;
    for (uint64_t u = 0; u < S; u++)
        in[u] = 1;
    for (uint64_t i = 0; i < o->n_kept; i++)
        in[o->kept[i]] = 1;
    for (uint64_t u = o->closed; u < n_rows; u++)
        in[u] = 1;
}

/* The emitted set, by position, against the oracle's membership `want`. */
static void expect_set(const rig *r, const step_out *o, uint64_t n_rows, const uint8_t *want,
                       uint32_t step) {
    uint32_t k = 0;
    for (uint64_t u = 0; u < n_rows; u++) {
        if (!want[u])
            continue;
        cr_assert(k < o->len, "step %u: set ends at %u, position %llu missing", step, o->len,
                  (unsigned long long)u);
        cr_assert_eq(o->idx[k], slot_of(r, u), "step %u entry %u: slot %d, want %d (pos %llu)",
                     step, k, o->idx[k], slot_of(r, u), (unsigned long long)u);
        k++;
    }
    cr_assert_eq(k, o->len, "step %u: %u rows emitted, oracle has %u", step, o->len, k);
}

/* The trigger as the oracle computes it: membership of the fired archived rows, with the rows
 * `extra` marks (promoted; NULL: none) attended without recall too. */
static uint64_t oracle_fire_with(const rig *r, const step_out *o, const float *q,
                                 uint64_t n_rows, float z, int mode, const uint8_t *extra,
                                 uint8_t *in) {
    uint8_t base[NMAX];
    base_set(r, o, n_rows, base);
    for (uint64_t u = 0; extra && u < n_rows; u++)
        base[u] |= extra[u];
    float best[H];
    for (uint32_t h = 0; h < H; h++)
        best[h] = best_over(r, q + h * QD, base, n_rows);
    memcpy(in, base, n_rows);
    float q_sk[H][RB], tmp[D];
    kvt__recall_head hd[H];
    for (uint32_t h = 0; h < H; h++)
        kvt__recall_head_prep(q + h * QD, D, r->V, RB, q_sk[h], tmp, &hd[h]);
    uint64_t fired = 0;
    for (uint64_t u = 0; u < o->closed; u++) {
        if (base[u])
            continue;
        for (uint32_t h = 0; h < H; h++) {
            const float *qh = q + h * QD;
            float P, ncsk;
            float idx = kvt__recall_idx(qh, q_sk[h], r->rows + u * 1152, D, 1024, KVT__DT_BF16,
                                        64, o->csk + u * RB, RB, 1.0f, &P, &ncsk);
            int f = mode == KVT__RECALL_SOUND
                        ? kvt__recall_sound_fires(
                              idx,
                              kvt__recall_sound_margin(&hd[h], idx, P, ncsk, o->rho[u], 1.0f, z,
                                                       D, 64, RB),
                              best[h])
                        : kvt__recall_conformal_fires(
                              idx, kvt__recall_cert(&hd[h], o->rho[u], 1.0f, D), z, best[h]);
            if (f) {
                in[u] = 1;
                fired++;
                break;
            }
        }
    }
    return fired;
}

static uint64_t oracle_fire(const rig *r, const step_out *o, const float *q, uint64_t n_rows,
                            float z, int mode, uint8_t *in) {
    return oracle_fire_with(r, o, q, n_rows, z, mode, NULL, in);
}

/* The oracle's calibration step: one sample per head from its best archived row. */
static bool oracle_calibrate(rig *r, const step_out *o, const float *q, uint64_t n_rows) {
    uint8_t base[NMAX];
    base_set(r, o, n_rows, base);
    float e[H];
    uint32_t n_e = 0;
    for (uint32_t h = 0; h < H; h++) {
        const float *qh = q + h * QD;
        float bs = -INFINITY;
        int64_t arg = -1;
        for (uint64_t u = 0; u < o->closed; u++)
            if (!base[u]) {
                float x = exact(r, qh, u);
                if (x > bs) {
                    bs = x;
                    arg = (int64_t)u;
                }
            }
        if (arg < 0)
            continue;
        float q_sk[RB], tmp[D], P, ncsk;
        kvt__recall_head hd;
        kvt__recall_head_prep(qh, D, r->V, RB, q_sk, tmp, &hd);
        float idx = kvt__recall_idx(qh, q_sk, r->rows + arg * 1152, D, 1024, KVT__DT_BF16, 64,
                                    o->csk + arg * RB, RB, 1.0f, &P, &ncsk);
        float cert = kvt__recall_cert(&hd, o->rho[arg], 1.0f, D);
        if (kvt__conformal_sample(bs, idx, cert, &e[n_e]))
            n_e++;
    }
    return kvt__conformal_step(&r->conf, e, n_e);
}

static kvt_layer_stats stats(const rig *r) {
    kvt_layer_stats st = {.struct_size = sizeof st};
    cr_assert_eq(kvt_seq_layer_stats(r->seq, 0, &st), KVT_OK, "%s", kvt_last_error());
    return st;
}

/* Conformal recall end to end on both CPU-side backends: the first 8 steps with archived rows
 * calibrate (every row attended, the dense flag set) and fix z from exactly the oracle's samples;
 * every later step attends the oracle's set; queries aimed at an archived row get it back by
 * fetch; the two backends emit the same slots. */
Test(recall_step, conformal_decode_matches_the_oracle, .timeout = 240) {
    static step_out o;
    static int32_t first_sets[3][120][NMAX];
    uint32_t first_len[3][120];
    const kvt_backend_kind kinds[3] = {KVT_BACKEND_CPU, KVT_BACKEND_GUARDED, KVT_BACKEND_CUDA};
    int n_bk = tu_cuda_backend_usable() ? 3 : 2;
    for (int bk = 0; bk < n_bk; bk++) {
        rig r;
        rig_open(&r, kinds[bk], KVT_RECALL_CONFORMAL, 4096, 1.0f, 9001);
        prefill(&r, 64 * 6 + 10);
        kvt_layer_stats st0 = stats(&r);
        cr_assert_eq(st0.recall_mode, KVT_RECALL_CONFORMAL);
        cr_assert_eq(st0.recall_phase, 0);
        cr_assert_eq(st0.recall_z, 8.0f);
        bool calibrating = true;
        uint32_t aimed = 0, aimed_fetched = 0, fetched_sum = 0, archived_sum = 0;
        uint64_t visited_sum = 0;
        for (uint32_t step = 0; step < 120; step++) {
            float q[H * QD];
            int64_t target = -1;
            if (step >= 40 && step % 5 == 0) { /* aim at an archived row */
                uint8_t base[NMAX];
                base_set(&r, &o, r.n + 1, base);
                for (uint64_t u = 17 + step; u < o.closed; u++)
                    if (!base[u]) {
                        target = (int64_t)u;
                        break;
                    }
            }
            make_queries(&r, q, target);
            decode(&r, q, &o);
            uint64_t n_rows = r.n;
            memcpy(first_sets[bk][step], o.idx, sizeof(int32_t) * o.len);
            first_len[bk][step] = o.len;
            kvt_layer_stats st = stats(&r);
            uint8_t want[NMAX];
            if (calibrating) {
                cr_assert_eq(o.dense, 1, "calibration step %u is dense", step);
                memset(want, 1, n_rows);
                expect_set(&r, &o, n_rows, want, step);
                calibrating = oracle_calibrate(&r, &o, q, n_rows);
                cr_assert_eq(st.recall_phase, calibrating ? 0 : (r.conf.calibrated ? 1 : 2));
                cr_assert_eq(st.recall_samples, r.conf.n);
                if (!calibrating)
                    cr_log_info("calibrated at step %u: z = %g from %u samples (k = %u)", step,
                                (double)r.conf.z, r.conf.n, r.conf.k);
                cr_assert_eq(st.recall_z, r.conf.z, "step %u: z %g, oracle %g", step,
                             (double)st.recall_z, (double)r.conf.z);
                continue;
            }
            uint64_t fired = oracle_fire(&r, &o, q, n_rows, r.conf.z, KVT__RECALL_CONFORMAL, want);
            cr_assert_eq(o.dense, 0, "step %u overflowed", step);
            expect_set(&r, &o, n_rows, want, step);
            cr_assert_eq(st.recall_last_fired, fired);
            cr_assert_eq(st.recall_last_fetched, fired);
            fetched_sum += (uint32_t)fired;
            archived_sum += (uint32_t)st.recall_last_archived;
            visited_sum += st.recall_last_visited;
            cr_assert_leq(st.recall_last_visited, st.recall_last_archived);
            if (target >= 0) {
                aimed++;
                aimed_fetched += want[target];
            }
        }
        cr_assert_not(calibrating, "calibration never ended");
        kvt_layer_stats st = stats(&r);
        cr_assert_eq(st.recall_steps, 120);
        cr_assert_eq(st.recall_overflow_steps, 0);
        cr_assert_gt(aimed, 10);
        cr_assert_geq(aimed_fetched * 10, aimed * 9, "aimed rows fetched %u of %u",
                      aimed_fetched, aimed);
        cr_log_info("%s: %u of %u aimed rows fetched; %u of %u archived rows fetched over "
                    "the other steps; the pruned scan visited %llu of them",
                    bk == 2 ? "cuda" : bk ? "guarded" : "cpu", aimed_fetched, aimed, fetched_sum, archived_sum,
                    (unsigned long long)visited_sum);
        rig_close(&r);
    }
    for (int bk = 1; bk < n_bk; bk++)
        for (uint32_t step = 0; step < 120; step++) {
            cr_assert_eq(first_len[0][step], first_len[bk][step], "backend %d step %u", bk, step);
            cr_assert_eq(memcmp(first_sets[0][step], first_sets[bk][step],
                                sizeof(int32_t) * first_len[0][step]),
                         0, "step %u: backend %d differs from the CPU", step, bk);
        }
}

/* Sound mode never misses: every archived row whose fp32 exact score reaches the head's best
 * attended score is in the emitted set, over many random and aimed queries. */
Test(recall_step, sound_never_misses_the_best_archived_row, .timeout = 240) {
    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_SOUND, 4096, 1.0f, 4242);
    prefill(&r, 64 * 7 + 3);
    uint64_t must = 0, fetched = 0, archived = 0;
    for (uint32_t step = 0; step < 150; step++) {
        float q[H * QD];
        make_queries(&r, q, step % 3 == 0 ? (int64_t)(5 + (step * 37) % 400) : -1);
        decode(&r, q, &o);
        uint64_t n_rows = r.n;
        uint8_t base[NMAX], want[NMAX];
        base_set(&r, &o, n_rows, base);
        uint64_t fired = oracle_fire(&r, &o, q, n_rows, sqrtf((float)(D - 64)), KVT__RECALL_SOUND,
                                     want);
        if (!o.dense)
            expect_set(&r, &o, n_rows, want, step);
        uint8_t got[NMAX];
        memset(got, 0, sizeof got);
        uint64_t u0 = 0; /* the set ascends by position */
        for (uint32_t j = 0; j < o.len; j++) {
            while (u0 < n_rows && slot_of(&r, u0) != o.idx[j])
                u0++;
            cr_assert(u0 < n_rows, "step %u: entry %u is no row's slot", step, j);
            got[u0] = 1;
        }
        for (uint32_t h = 0; h < H; h++) {
            const float best = best_over(&r, q + h * QD, base, n_rows);
            for (uint64_t u = 0; u < o.closed; u++)
                if (!base[u] && exact(&r, q + h * QD, u) >= best) {
                    must++;
                    cr_assert(got[u], "step %u head %u: archived row %llu scores above the "
                              "attended best and was not attended", step, h,
                              (unsigned long long)u);
                }
        }
        kvt_layer_stats st = stats(&r);
        cr_assert_eq(st.recall_last_fired, fired);
        fetched += st.recall_last_fetched;
        archived += st.recall_last_archived;
    }
    cr_assert_gt(must, 0, "no query reached an archived row: the test proves nothing");
    kvt_layer_stats st = stats(&r);
    cr_assert_eq(st.recall_calib_steps, 0);
    cr_log_info("sound: %llu (row, head) pairs above the attended best, all attended; fetched "
                "%.3f of archived rows (its honest cost)", (unsigned long long)must,
                (double)fetched / (double)archived);
    rig_close(&r);
}

/* Past W fired rows the step attends every row, says so in the flag and the statistics; the
 * margin mode with a huge δ fires everything. */
Test(recall_step, overflow_gives_exactly_the_dense_set) {
    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_GUARDED, KVT_RECALL_MARGIN, 3, 1e30f, 77);
    prefill(&r, 64 * 3);
    for (uint32_t step = 0; step < 5; step++) {
        float q[H * QD];
        make_queries(&r, q, -1);
        decode(&r, q, &o);
        cr_assert_eq(o.dense, 1);
        uint8_t want[NMAX];
        memset(want, 1, r.n);
        expect_set(&r, &o, r.n, want, step);
        kvt_layer_stats st = stats(&r);
        cr_assert(st.recall_last_overflow && st.recall_last_dense);
        cr_assert_eq(st.recall_last_fetched, st.recall_last_archived);
        cr_assert_eq(st.recall_last_fired, 4); /* W + 1 counted */
        cr_assert_eq(st.recall_overflow_steps, step + 1);
    }
    rig_close(&r);
}

/* A margin of 0 with W large: fires exactly the rows whose idx reaches the best attended score;
 * nothing overflows. Compared with the oracle's idx. */
Test(recall_step, margin_zero_fires_by_idx) {
    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_MARGIN, 4096, 0.0f, 78);
    prefill(&r, 64 * 4);
    for (uint32_t step = 0; step < 10; step++) {
        float q[H * QD];
        make_queries(&r, q, step % 2 ? (int64_t)(40 + step) : -1);
        decode(&r, q, &o);
        uint8_t base[NMAX], want[NMAX];
        base_set(&r, &o, r.n, base);
        memcpy(want, base, r.n);
        float best[H], q_sk[H][RB], tmp[D];
        kvt__recall_head hd[H];
        for (uint32_t h = 0; h < H; h++) {
            best[h] = -INFINITY;
            for (uint64_t v = 0; v < r.n; v++)
                if (base[v]) {
                    float e = exact(&r, q + h * QD, v);
                    best[h] = e > best[h] ? e : best[h];
                }
            kvt__recall_head_prep(q + h * QD, D, r.V, RB, q_sk[h], tmp, &hd[h]);
        }
        for (uint64_t u = 0; u < o.closed; u++) {
            if (base[u])
                continue;
            for (uint32_t h = 0; h < H && !want[u]; h++) {
                float P, ncsk;
                float idx = kvt__recall_idx(q + h * QD, q_sk[h], r.rows + u * 1152, D, 1024,
                                            KVT__DT_BF16, 64, o.csk + u * RB, RB, 1.0f, &P,
                                            &ncsk);
                want[u] = !(idx + 0.0f < best[h]);
            }
        }
        cr_assert_eq(o.dense, 0);
        expect_set(&r, &o, r.n, want, step);
    }
    rig_close(&r);
}

/* Statuses: recall without sketch planes or with an unknown mode; a NULL query; a multi-token
 * step of a recalling request attends every row with the dense flag; a request without recall in
 * the same batch is untouched (CSR offsets follow the backend's counts). */
Test(recall_step, statuses_and_mixed_batches) {
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    s.n_q_heads = H;
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&s, 1, "st", &m, NULL, 0), KVT_OK);
    kvt_config c = kvt_config_default();
    c.recall = KVT_RECALL_CONFORMAL;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = PR;
    p.n_pages = 64;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(err, "recall_sketch_rank"), "%s", err);
    c.recall = KVT_RECALL_OFF;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_seq_params sp = kvt_seq_default_params();
    sp.recall = KVT_RECALL_SOUND;
    kvt_seq *bad = (kvt_seq *)1;
    cr_assert_eq(kvt_seq_create(ctx, &sp, &bad), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "recall_sketch_rank"), "%s", kvt_last_error());
    cr_assert_null(bad);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);

    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 5);
    sp.recall = 9;
    cr_assert_eq(kvt_seq_create(r.ctx, &sp, &bad), KVT_ERR_INVALID_ARGUMENT);
    prefill(&r, 64 * 3);
    /* A NULL query when a request recalls: refused before any work. */
    uint32_t one = 1;
    make_row(&r, r.rows + r.n * 1152);
    cr_assert_eq(kvt_batch_reserve(r.b, &r.seq, &one, 1), KVT_OK);
    cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, 1, r.rows + r.n * 1152, 1152), KVT_OK);
    cr_assert_eq(kvt_batch_plan(r.b), KVT_OK);
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                  .indices = kvt_buffer_ptr(r.ibuf), .capacity = NMAX,
                  .lengths = kvt_buffer_ptr(r.lbuf), .dense = kvt_buffer_ptr(r.dbuf)};
    cr_assert_eq(kvt_batch_run(r.b, 0, NULL, NULL, &e), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "query"), "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_commit(r.b, NULL), KVT_OK);
    r.n++;
    /* A multi-token step of the recalling request: every row, flagged. */
    uint32_t n3 = 3;
    for (uint32_t u = 0; u < 3; u++)
        make_row(&r, r.rows + (r.n + u) * 1152);
    cr_assert_eq(kvt_batch_reserve(r.b, &r.seq, &n3, 1), KVT_OK);
    cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, 3, r.rows + r.n * 1152, 3 * 1152), KVT_OK);
    cr_assert_eq(kvt_batch_plan(r.b), KVT_OK);
    cr_assert_eq(kvt_batch_run(r.b, 0, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
    int32_t len;
    uint8_t dense;
    cr_assert_eq(kvt_buffer_read(r.lbuf, 0, &len, sizeof len), KVT_OK);
    cr_assert_eq(kvt_buffer_read(r.dbuf, 0, &dense, 1), KVT_OK);
    cr_assert_eq(dense, 1);
    cr_assert_eq((uint64_t)len, r.n + 3);
    cr_assert_eq(kvt_batch_commit(r.b, NULL), KVT_OK);
    r.n += 3;
    /* A batch of two: the recalling request and one without recall, CSR. Calibration makes the
     * first dense; the second attends its own set. Then the CSR offsets equal TOKENS' lengths. */
    kvt_seq *plain;
    sp = kvt_seq_default_params();
    sp.request_id = 99;
    sp.recall = KVT_RECALL_OFF;
    cr_assert_eq(kvt_seq_create(r.ctx, &sp, &plain), KVT_OK);
    for (uint32_t step = 0; step < 12; step++) {
        kvt_seq *two[2] = {plain, r.seq};
        uint32_t n[2] = {1, 1};
        uint8_t rowp[1152], rows2[1152];
        make_row(&r, rowp);
        make_row(&r, rows2);
        memcpy(r.rows + r.n * 1152, rows2, 1152);
        cr_assert_eq(kvt_batch_reserve(r.b, two, n, 2), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_write(plain, 0, 0, 0, 1, rowp, 1152), KVT_OK);
        cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, 1, rows2, 1152), KVT_OK);
        cr_assert_eq(kvt_batch_plan(r.b), KVT_OK);
        float q[2 * H * QD];
        make_queries(&r, q, -1);
        make_queries(&r, q + H * QD, -1);
        cr_assert_eq(kvt_buffer_write(r.qbuf, 0, q, sizeof q), KVT_OK);
        int32_t ind_t[2 * NMAX], ind_c[2 * NMAX], lens[2], indptr[3];
        kvt_emit et = {.struct_size = sizeof et, .layout = KVT_EMIT_TOKENS,
                       .indices = kvt_buffer_ptr(r.ibuf), .capacity = NMAX,
                       .lengths = kvt_buffer_ptr(r.lbuf), .dense = kvt_buffer_ptr(r.dbuf)};
        cr_assert_eq(kvt_batch_run(r.b, 0, kvt_buffer_ptr(r.qbuf), NULL, &et), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_buffer_read(r.ibuf, 0, ind_t, sizeof ind_t), KVT_OK);
        cr_assert_eq(kvt_buffer_read(r.lbuf, 0, lens, sizeof lens), KVT_OK);
        uint8_t dn[2];
        cr_assert_eq(kvt_buffer_read(r.dbuf, 0, dn, 2), KVT_OK);
        cr_assert_eq(dn[0], 0); /* no recall */
        kvt_emit ec = {.struct_size = sizeof ec, .layout = KVT_EMIT_CSR,
                       .indices = kvt_buffer_ptr(r.ibuf), .capacity = 2 * NMAX,
                       .indptr = kvt_buffer_ptr(r.lbuf)};
        cr_assert_eq(kvt_batch_run(r.b, 0, kvt_buffer_ptr(r.qbuf), NULL, &ec), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_buffer_read(r.ibuf, 0, ind_c, sizeof ind_c), KVT_OK);
        cr_assert_eq(kvt_buffer_read(r.lbuf, 0, indptr, sizeof indptr), KVT_OK);
        cr_assert_eq(indptr[0], 0);
        cr_assert_eq(indptr[1], lens[0]);
        cr_assert_eq(indptr[2], lens[0] + lens[1]);
        cr_assert_eq(memcmp(ind_c, ind_t, sizeof(int32_t) * lens[0]), 0);
        cr_assert_eq(memcmp(ind_c + lens[0], ind_t + NMAX, sizeof(int32_t) * lens[1]), 0);
        cr_assert_eq(kvt_batch_commit(r.b, NULL), KVT_OK);
        r.n++;
        cr_assert_eq(kvt_seq_check(r.seq), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_check(plain), KVT_OK, "%s", kvt_last_error());
    }
    /* Two runs of the layer a step (TOKENS, then CSR): the trigger ran once per step. */
    kvt_layer_stats rs = stats(&r);
    cr_assert_eq(rs.recall_steps, 12, "%llu", (unsigned long long)rs.recall_steps);
    cr_assert_eq(rs.recall_calib_steps, 8);
    kvt_layer_stats st = {.struct_size = sizeof st};
    cr_assert_eq(kvt_seq_layer_stats(plain, 0, &st), KVT_OK);
    cr_assert_eq(st.recall_mode, 0);
    cr_assert_eq(st.recall_steps, 0);
    kvt_seq_destroy(plain);
    (void)o;
    rig_close(&r);
}

/* Fork r's request and attach another to its first 4 blocks, with both statistics. */
static void fork_and_attach(rig *r, kvt_seq **child, kvt_seq **att, kvt_layer_stats *cs,
                            kvt_layer_stats *as) {
    cr_assert_eq(kvt_seq_fork(r->seq, 8, child), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_attach(r->seq, 64 * 4, 9, att), KVT_OK, "%s", kvt_last_error());
    *cs = (kvt_layer_stats){.struct_size = sizeof *cs};
    *as = (kvt_layer_stats){.struct_size = sizeof *as};
    cr_assert_eq(kvt_seq_layer_stats(*child, 0, cs), KVT_OK);
    cr_assert_eq(kvt_seq_layer_stats(*att, 0, as), KVT_OK);
    cr_assert_eq(kvt_seq_check(*child), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(*att), KVT_OK, "%s", kvt_last_error());
}

/* A fork continues its parent's calibration (same z and phase, same next sets); an attached
 * request calibrates anew. */
Test(recall_step, fork_keeps_the_calibration_attach_starts_over, .timeout = 120) {
    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 31);
    prefill(&r, 64 * 5);
    for (uint32_t step = 0; step < 12; step++) {
        float q[H * QD];
        make_queries(&r, q, -1);
        decode(&r, q, &o);
    }
    kvt_layer_stats ps = stats(&r);
    cr_assert_neq(ps.recall_phase, 0);
    kvt_seq *child, *att;
    kvt_layer_stats cs, as;
    fork_and_attach(&r, &child, &att, &cs, &as);
    cr_assert_eq(cs.recall_z, ps.recall_z);
    cr_assert_eq(cs.recall_phase, ps.recall_phase);
    cr_assert_eq(cs.recall_samples, ps.recall_samples);
    cr_assert_eq(as.recall_phase, 0);
    cr_assert_eq(as.recall_steps, 0);
    kvt_seq_destroy(child);
    kvt_seq_destroy(att);
    rig_close(&r);
}

/* Positions of a step's emitted slots, through seq's page table (white-box). */
static void slots_to_positions(const kvt_seq *seq, const int32_t *idx, uint32_t n,
                               uint64_t n_rows, int64_t *pos) {
    const kvt__ptable *t = &seq->pt[0];
    for (uint32_t j = 0; j < n; j++) {
        pos[j] = -1;
        for (uint64_t u = 0; u < n_rows; u++)
            if (t->pages[u / PR - t->first_page] * (int32_t)PR + (int32_t)(u % PR) == idx[j]) {
                pos[j] = (int64_t)u;
                break;
            }
    }
}

/* A snapshot of seq in a malloc'd buffer of *need bytes. */
static uint8_t *snapshot_of(const kvt_seq *seq, size_t *need) {
    cr_assert_eq(kvt_seq_snapshot_size(seq, need), KVT_OK, "%s", kvt_last_error());
    uint8_t *snap = malloc(*need);
    cr_assert(snap);
    cr_assert_eq(kvt_seq_snapshot(seq, snap, *need, NULL), KVT_OK, "%s", kvt_last_error());
    return snap;
}

/* The same under request id `id`, for a copy restored beside seq in its own context (request
 * ids are unique among a context's live requests): META's request_id (docs/snapshot-format.md:
 * payload byte 80, after the 24-byte file header and the section's 24-byte header) rewritten,
 * every CRC made right again. The copy's random draws are keyed by its new id: these requests
 * draw nothing (σ selection on an MLA-NoPE layer; the recall trigger keys nothing by request). */
static uint8_t *snapshot_as(const kvt_seq *seq, uint64_t id, size_t *need) {
    enum { AT = 24 + 24 + 80 };
    uint8_t *snap = snapshot_of(seq, need);
    cr_assert_gt(*need, AT + 8);
    uint64_t was = 0;
    for (int i = 0; i < 8; i++)
        was |= (uint64_t)snap[AT + i] << (8 * i);
    cr_assert_eq(was, kvt_seq_request_id(seq), "META's request_id is not at byte %d", AT);
    for (int i = 0; i < 8; i++)
        snap[AT + i] = (uint8_t)(id >> (8 * i));
    fuzz_fix_crcs(snap, *need);
    return snap;
}

/* One decode step of r's request and `copy` (same new row, same queries aimed at target):
 * both attend the same positions. */
/* One decode step of r's request and n (<= 2) others with the same row and queries: every
 * request attends the same positions. */
static void step_all(rig *r, kvt_seq *const *others, uint32_t n_others, int64_t target,
                     uint32_t step) {
    const uint32_t n = 1 + n_others;
    cr_assert_leq(n, 3u);
    float q[3 * H * QD];
    make_queries(r, q, target);
    for (uint32_t i = 1; i < n; i++)
        memcpy(q + i * H * QD, q, sizeof(float) * H * QD);
    uint8_t row[1152];
    make_row(r, row);
    memcpy(r->rows + r->n * 1152, row, 1152);
    kvt_seq *all[3] = {r->seq};
    uint32_t ones[3] = {1, 1, 1};
    for (uint32_t i = 1; i < n; i++)
        all[i] = others[i - 1];
    cr_assert_eq(kvt_batch_reserve(r->b, all, ones, n), KVT_OK, "%s", kvt_last_error());
    for (uint32_t i = 0; i < n; i++)
        cr_assert_eq(kvt_seq_write(all[i], 0, 0, 0, 1, row, 1152), KVT_OK);
    cr_assert_eq(kvt_batch_plan(r->b), KVT_OK);
    cr_assert_eq(kvt_buffer_write(r->qbuf, 0, q, sizeof(float) * n * H * QD), KVT_OK);
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                  .indices = kvt_buffer_ptr(r->ibuf), .capacity = NMAX,
                  .lengths = kvt_buffer_ptr(r->lbuf), .dense = kvt_buffer_ptr(r->dbuf)};
    cr_assert_eq(kvt_batch_run(r->b, 0, kvt_buffer_ptr(r->qbuf), NULL, &e), KVT_OK, "%s",
                 kvt_last_error());
    static int32_t idx[3 * NMAX];
    static int64_t pa[NMAX], pb[NMAX];
    int32_t lens[3];
    cr_assert_eq(kvt_buffer_read(r->ibuf, 0, idx, sizeof(int32_t) * n * NMAX), KVT_OK);
    cr_assert_eq(kvt_buffer_read(r->lbuf, 0, lens, sizeof(int32_t) * n), KVT_OK);
    slots_to_positions(r->seq, idx, (uint32_t)lens[0], r->n + 1, pa);
    for (uint32_t i = 1; i < n; i++) {
        cr_assert_eq(lens[0], lens[i], "step %u, request %u", step, i);
        slots_to_positions(all[i], idx + i * NMAX, (uint32_t)lens[i], r->n + 1, pb);
        cr_assert_eq(memcmp(pa, pb, sizeof(int64_t) * (size_t)lens[0]), 0, "step %u, request %u",
                     step, i);
    }
    cr_assert_eq(kvt_batch_commit(r->b, NULL), KVT_OK);
    r->n++;
    for (uint32_t i = 0; i < n; i++)
        cr_assert_eq(kvt_seq_check(all[i]), KVT_OK, "%s", kvt_last_error());
}

static void step_pair(rig *r, kvt_seq *copy, int64_t target, uint32_t step) {
    step_all(r, &copy, 1, target, step);
}

/* A snapshot carries the trigger's state: the restored request continues with the same z, the
 * same counters and the same attended positions as the original, step for step; a context with
 * another W is a mismatch. */
Test(recall_step, snapshots_carry_the_trigger_state, .timeout = 120) {
    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 606);
    prefill(&r, 64 * 4 + 9);
    for (uint32_t step = 0; step < 10; step++) { /* calibrated after 8 */
        float q[H * QD];
        make_queries(&r, q, -1);
        decode(&r, q, &o);
    }
    size_t need;
    uint8_t *snap = snapshot_as(r.seq, 70, &need); /* restored beside r.seq */
    kvt_seq *copy;
    cr_assert_eq(kvt_seq_restore(r.ctx, snap, need, &copy), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats a = stats(&r), b = {.struct_size = sizeof b};
    cr_assert_eq(kvt_seq_layer_stats(copy, 0, &b), KVT_OK);
    cr_assert_eq(a.recall_phase, 1);
    cr_assert_eq(b.recall_phase, a.recall_phase);
    cr_assert_eq(b.recall_z, a.recall_z);
    cr_assert_eq(b.recall_samples, a.recall_samples);
    cr_assert_eq(b.recall_steps, a.recall_steps);
    cr_assert_eq(b.recall_fetched_rows, a.recall_fetched_rows);
    /* Both continue over the same rows and queries: the same positions every step. */
    for (uint32_t step = 0; step < 6; step++)
        step_pair(&r, copy, step % 2 ? 30 : -1, step);
    a = stats(&r);
    cr_assert_eq(kvt_seq_layer_stats(copy, 0, &b), KVT_OK);
    cr_assert_eq(b.recall_fetched_rows, a.recall_fetched_rows);
    cr_assert_eq(b.recall_steps, a.recall_steps);
    kvt_seq_destroy(copy);
    /* Another W: refused, naming it. */
    rig other;
    rig_open(&other, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 128, 1.0f, 606); /* same basis */
    cr_assert_eq(kvt_seq_restore(other.ctx, snap, need, &copy), KVT_ERR_MISMATCH, "%s",
                 kvt_last_error());
    cr_assert(strstr(kvt_last_error(), "W"), "%s", kvt_last_error());
    rig_close(&other);
    free(snap);
    rig_close(&r);
}

/* The pruned scan inside the step: on clustered rows (blocks of 256 split into groups of one
 * cluster each) the step visits fewer archived rows than it holds, and its sets still equal the
 * full-scan oracle's, step for step. */
Test(recall_step, pruned_scan_skips_clusters_and_changes_nothing, .timeout = 120) {
    static step_out o;
    g_block = 256;
    g_clustered = true;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 1357);
    prefill(&r, 256 * 3 + 10);
    bool calibrating = true;
    uint64_t visited = 0, archived = 0;
    for (uint32_t step = 0; step < 30; step++) {
        float q[H * QD];
        make_queries(&r, q, -1);
        decode(&r, q, &o);
        uint8_t want[NMAX];
        if (calibrating) {
            calibrating = oracle_calibrate(&r, &o, q, r.n);
            continue;
        }
        oracle_fire(&r, &o, q, r.n, r.conf.z, KVT__RECALL_CONFORMAL, want);
        if (!o.dense)
            expect_set(&r, &o, r.n, want, step);
        kvt_layer_stats st = stats(&r);
        visited += st.recall_last_visited;
        archived += st.recall_last_archived;
    }
    cr_assert_not(calibrating);
    cr_log_info("pruned scan in the step: visited %llu of %llu archived rows (%.2f)",
                (unsigned long long)visited, (unsigned long long)archived,
                (double)visited / (double)archived);
    cr_assert_lt(visited, archived, "no group was ever skipped");
    g_block = 64;
    g_clustered = false;
    rig_close(&r);
}

/* Review findings, each reproduced first: (1) a recalling request whose step attends every row
 * (two tokens) beside a plain request, CSR with nobody fetching: offsets follow every-row sizes;
 * (2) a second run of the layer in a calibration step keeps the dense flag; (3) a layer the
 * scan cannot take (value_dim 64) is refused when the request is created, not at its first
 * step. */
Test(recall_step, review_csr_every_row_second_run_flag_and_small_latents) {
    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_GUARDED, KVT_RECALL_CONFORMAL, 4096, 1.0f, 2468);
    prefill(&r, 64 * 3 + 1);
    kvt_seq *plain;
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 5;
    sp.recall = KVT_RECALL_OFF;
    cr_assert_eq(kvt_seq_create(r.ctx, &sp, &plain), KVT_OK);
    uint8_t rows[3 * 1152];
    for (uint32_t u = 0; u < 3; u++)
        make_row(&r, rows + u * 1152);
    kvt_seq *two[2] = {r.seq, plain};
    uint32_t n[2] = {2, 1};
    cr_assert_eq(kvt_batch_reserve(r.b, two, n, 2), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, 2, rows, 2 * 1152), KVT_OK);
    cr_assert_eq(kvt_seq_write(plain, 0, 0, 0, 1, rows + 2 * 1152, 1152), KVT_OK);
    cr_assert_eq(kvt_batch_plan(r.b), KVT_OK);
    static int32_t it[2 * NMAX], ic[2 * NMAX];
    int32_t lens[2], indptr[3];
    kvt_emit et = {.struct_size = sizeof et, .layout = KVT_EMIT_TOKENS,
                   .indices = kvt_buffer_ptr(r.ibuf), .capacity = NMAX,
                   .lengths = kvt_buffer_ptr(r.lbuf)};
    cr_assert_eq(kvt_batch_run(r.b, 0, NULL, NULL, &et), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_buffer_read(r.ibuf, 0, it, sizeof it), KVT_OK);
    cr_assert_eq(kvt_buffer_read(r.lbuf, 0, lens, sizeof lens), KVT_OK);
    cr_assert_eq((uint64_t)lens[0], r.n + 2); /* every row */
    kvt_emit ec = {.struct_size = sizeof ec, .layout = KVT_EMIT_CSR,
                   .indices = kvt_buffer_ptr(r.ibuf), .capacity = 2 * NMAX,
                   .indptr = kvt_buffer_ptr(r.lbuf)};
    cr_assert_eq(kvt_batch_run(r.b, 0, NULL, NULL, &ec), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_buffer_read(r.ibuf, 0, ic, sizeof ic), KVT_OK);
    cr_assert_eq(kvt_buffer_read(r.lbuf, 0, indptr, sizeof indptr), KVT_OK);
    cr_assert_eq(indptr[1], lens[0], "indptr %d %d %d", indptr[0], indptr[1], indptr[2]);
    cr_assert_eq(indptr[2], lens[0] + lens[1]);
    cr_assert_eq(memcmp(ic, it, sizeof(int32_t) * lens[0]), 0);
    cr_assert_eq(memcmp(ic + lens[0], it + NMAX, sizeof(int32_t) * lens[1]), 0);
    cr_assert_eq(kvt_batch_commit(r.b, NULL), KVT_OK);
    r.n += 2;
    kvt_seq_destroy(plain);
    /* (2) calibration steps, each run twice with a dense buffer: the flag stays 1 */
    for (uint32_t step = 0; step < 3; step++) {
        float q[H * QD];
        make_queries(&r, q, -1);
        uint32_t one = 1;
        make_row(&r, r.rows + r.n * 1152);
        cr_assert_eq(kvt_batch_reserve(r.b, &r.seq, &one, 1), KVT_OK);
        cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, 1, r.rows + r.n * 1152, 1152), KVT_OK);
        cr_assert_eq(kvt_batch_plan(r.b), KVT_OK);
        cr_assert_eq(kvt_buffer_write(r.qbuf, 0, q, sizeof q), KVT_OK);
        for (int run = 0; run < 2; run++) {
            uint8_t zero = 0, d = 9;
            cr_assert_eq(kvt_buffer_write(r.dbuf, 0, &zero, 1), KVT_OK);
            kvt_emit e = {.struct_size = sizeof e, .layout = run ? KVT_EMIT_CSR : KVT_EMIT_TOKENS,
                          .indices = kvt_buffer_ptr(r.ibuf), .capacity = NMAX,
                          .lengths = kvt_buffer_ptr(r.lbuf), .indptr = kvt_buffer_ptr(r.lbuf),
                          .dense = kvt_buffer_ptr(r.dbuf)};
            cr_assert_eq(kvt_batch_run(r.b, 0, kvt_buffer_ptr(r.qbuf), NULL, &e), KVT_OK, "%s",
                         kvt_last_error());
            cr_assert_eq(kvt_buffer_read(r.dbuf, 0, &d, 1), KVT_OK);
            cr_assert_eq(d, 1, "step %u run %d: a calibration step is dense", step, run);
        }
        cr_assert_eq(kvt_batch_commit(r.b, NULL), KVT_OK);
        r.n++;
    }
    (void)o;
    rig_close(&r);
    /* (3) */
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 64, 64, &s), KVT_OK);
    s.n_q_heads = 2;
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&s, 1, "small", &m, NULL, 0), KVT_OK);
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 16;
    p.recall_sketch_rank = 16;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    sp = kvt_seq_default_params();
    sp.recall = KVT_RECALL_CONFORMAL;
    kvt_seq *bad = (kvt_seq *)1;
    cr_assert_eq(kvt_seq_create(ctx, &sp, &bad), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "value_dim"), "%s", kvt_last_error());
    cr_assert_null(bad);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* ---- Promotion (docs/recall.md §4.2) ---------------------------------------------------------- */

/* The host oracle of promotion: the promoted set and the candidate table, from the oracle's
 * fired sets, by the rule as docs/recall.md §4.2 states it. */
typedef struct promo_oracle {
    uint32_t prom[64], prom_hist[64], n_prom;
    uint32_t cand[256], cand_hist[256], n_cand;
    uint64_t last_closed, promotions, demotions, absorbed;
    uint32_t cap, hits, mask;
} promo_oracle;

static bool has(const uint32_t *v, uint32_t n, uint32_t x) {
    for (uint32_t i = 0; i < n; i++)
        if (v[i] == x)
            return true;
    return false;
}

/* kept (after the step's close) and the sinks: what a close absorbs. */
static bool kept_or_sink(const rig *r, const step_out *o, uint32_t row) {
    return row < r->c.sink_rows || has(o->kept, (uint32_t)o->n_kept, row);
}

/* Before the step's scores: a close since the last step absorbs, demotes, filters. */
static void oracle_promo_close(const rig *r, promo_oracle *po, const step_out *o) {
    if (po->last_closed == o->closed)
        return;
    uint32_t k = 0;
    for (uint32_t i = 0; i < po->n_prom; i++) {
        if (kept_or_sink(r, o, po->prom[i]))
            po->absorbed++;
        else if (!po->prom_hist[i])
            po->demotions++;
        else {
            po->prom[k] = po->prom[i];
            po->prom_hist[k++] = po->prom_hist[i];
        }
    }
    po->n_prom = k;
    k = 0;
    for (uint32_t i = 0; i < po->n_cand; i++)
        if (!kept_or_sink(r, o, po->cand[i])) {
            po->cand[k] = po->cand[i];
            po->cand_hist[k++] = po->cand_hist[i];
        }
    po->n_cand = k;
    po->last_closed = o->closed;
}

/* After the step: histories, new candidates (lowest positions first while there is room), then
 * promotions up to `room`. fired: membership of the step's fired rows (NULL: a dense step). */
static void oracle_promo_after(promo_oracle *po, const uint8_t *fired, uint64_t n_closed,
                               uint64_t room) {
    uint32_t cc = 4 * po->cap, keep = 0;
    for (uint32_t i = 0; i < po->n_cand; i++) {
        uint32_t hit = fired && fired[po->cand[i]];
        po->cand_hist[i] = ((po->cand_hist[i] << 1) | hit) & po->mask;
        keep += po->cand_hist[i] != 0;
    }
    uint32_t nr[256], nh[256], n = 0, free_slots = cc - keep;
    for (uint64_t u = 0; u < n_closed; u++) {
        int32_t at = -1;
        for (uint32_t i = 0; i < po->n_cand; i++)
            if (po->cand[i] == u)
                at = (int32_t)i;
        if (at >= 0) {
            if (po->cand_hist[at]) {
                nr[n] = (uint32_t)u;
                nh[n++] = po->cand_hist[at];
            }
        } else if (fired && fired[u] && free_slots) {
            nr[n] = (uint32_t)u;
            nh[n++] = 1;
            free_slots--;
        }
    }
    po->n_cand = 0;
    for (uint32_t i = 0; i < n; i++) {
        if ((uint32_t)__builtin_popcount(nh[i]) >= po->hits && po->n_prom < room) {
            uint32_t j = po->n_prom++; /* insert in order */
            while (j > 0 && po->prom[j - 1] > nr[i]) {
                po->prom[j] = po->prom[j - 1];
                po->prom_hist[j] = po->prom_hist[j - 1];
                j--;
            }
            po->prom[j] = nr[i];
            po->prom_hist[j] = nh[i];
            po->promotions++;
        } else {
            po->cand[po->n_cand] = nr[i];
            po->cand_hist[po->n_cand++] = nh[i];
        }
    }
}

/* The library's promotion tables (white-box) equal the oracle's. */
static void expect_promo(const rig *r, const promo_oracle *po, uint32_t step) {
    const kvt__recall_layer *rl = &r->seq->recall[0];
    static uint8_t buf[1 << 16];
    cr_assert_leq(kvt__recall_promo_bytes(rl), sizeof buf);
    cr_assert_eq(kvt__recall_layer_read_promo(rl, &r->ctx->backend, buf), KVT_OK);
    kvt__recall_promo h;
    memcpy(&h, buf, sizeof h);
    const uint32_t *cr = (const uint32_t *)(buf + sizeof h), *ch = cr + rl->cand_cap,
                   *pr = ch + rl->cand_cap, *ph = pr + rl->prom_cap;
    cr_assert_eq(h.n_prom, po->n_prom, "step %u: %u promoted, oracle %u", step, h.n_prom,
                 po->n_prom);
    cr_assert_eq(h.n_cand, po->n_cand, "step %u: %u candidates, oracle %u", step, h.n_cand,
                 po->n_cand);
    for (uint32_t i = 0; i < h.n_prom; i++)
        cr_assert(pr[i] == po->prom[i] && ph[i] == po->prom_hist[i],
                  "step %u promoted %u: %u/%x, oracle %u/%x", step, i, pr[i], ph[i], po->prom[i],
                  po->prom_hist[i]);
    for (uint32_t i = 0; i < h.n_cand; i++)
        cr_assert(cr[i] == po->cand[i] && ch[i] == po->cand_hist[i],
                  "step %u candidate %u: %u/%x, oracle %u/%x", step, i, cr[i], ch[i],
                  po->cand[i], po->cand_hist[i]);
    cr_assert_eq(h.promotions, po->promotions);
    cr_assert_eq(h.demotions, po->demotions);
    cr_assert_eq(h.absorbed, po->absorbed);
}

/* Promotion end to end, 3 hits of 8, sound mode (and conformal after its calibration): the rows
 * the library promotes, its candidate table and every emitted set equal the host oracle's, step by
 * step over closes (absorption, demotion), on the CPU and guarded backends alike (same slots);
 * a small W overflows (dense steps count no hit). The budget holds at every step: sinks + kept
 * + promoted + tail <= sinks + m + tail with m the top-m without promotion, and the emitted set
 * exceeds it by at most W; kvt_seq_check passes after every step (decode). */
Test(recall_step, promotion_matches_the_oracle_and_keeps_the_budget, .timeout = 300) {
    static step_out o;
    static int32_t sets[2][240][NMAX];
    static uint32_t lens[2][240];
    const uint32_t W[5] = {4096, 4096, 48, 4096, 4096}, C[5] = {16, 16, 16, 60, 16};
    const kvt_recall_mode M[5] = {KVT_RECALL_SOUND, KVT_RECALL_SOUND, KVT_RECALL_SOUND,
                                  KVT_RECALL_SOUND, KVT_RECALL_CONFORMAL};
    uint64_t absorbed = 0;
    for (int run = 0; run < 5; run++) {
        g_promote[0] = C[run];
        rig r;
        rig_open(&r, run == 1 ? KVT_BACKEND_GUARDED : KVT_BACKEND_CPU, M[run], W[run], 1.0f,
                 515);
        bool calibrating = M[run] == KVT_RECALL_CONFORMAL;
        kvt_config off = r.c;
        off.recall_promote_capacity = 0;
        promo_oracle po = {.cap = C[run], .hits = 3, .mask = 0xffu};
        prefill(&r, 64 * 6 + 7);
        uint32_t dense_steps = 0;
        uint64_t max_prom = 0;
        for (uint32_t step = 0; step < 240; step++) {
            float q[H * QD];
            /* aim at one row for a while (it gets promoted and keeps hitting), then let go */
            int64_t target = step < 70 && step % 2 == 0 ? 200
                             : step % 7 == 0           ? (int64_t)(300 + step)
                                                       : -1;
            make_queries(&r, q, target);
            decode(&r, q, &o);
            const uint64_t n_rows = r.n;
            oracle_promo_close(&r, &po, &o);
            const uint32_t attended_prom = po.n_prom;
            uint8_t base[NMAX], extra[NMAX], want[NMAX];
            base_set(&r, &o, n_rows, base);
            memset(extra, 0, sizeof extra);
            for (uint32_t h = 0; h < H; h++) { /* the promoted rows' hits, before the fold */
                const float best = best_over(&r, q + h * QD, base, n_rows);
                for (uint32_t i = 0; i < po.n_prom; i++)
                    extra[po.prom[i]] |= (uint8_t)(exact(&r, q + h * QD, po.prom[i]) >= best);
            }
            for (uint32_t i = 0; i < po.n_prom; i++) {
                po.prom_hist[i] = ((po.prom_hist[i] << 1) | extra[po.prom[i]]) & po.mask;
                extra[po.prom[i]] = 1; /* from here: membership */
            }
            for (uint64_t u = 0; u < n_rows; u++)
                extra[u] = extra[u] && has(po.prom, po.n_prom, (uint32_t)u);
            if (calibrating) { /* dense, no hit; nothing can be promoted yet */
                cr_assert_eq(po.n_prom, 0);
                cr_assert_eq(o.dense, 1);
                calibrating = oracle_calibrate(&r, &o, q, n_rows);
                memcpy(want, base, n_rows);
            } else {
                oracle_fire_with(&r, &o, q, n_rows,
                                 M[run] == KVT_RECALL_SOUND ? sqrtf((float)(D - 64)) : r.conf.z,
                                 (int)M[run], extra, want);
            }
            uint8_t fired[NMAX];
            for (uint64_t u = 0; u < n_rows; u++)
                fired[u] = want[u] && !base[u] && !extra[u];
            if (o.dense) {
                dense_steps++;
                memset(want, 1, n_rows);
            }
            expect_set(&r, &o, n_rows, want, step);
            /* the budget */
            uint64_t attended = 0;
            for (uint64_t u = 0; u < n_rows; u++)
                attended += base[u] || extra[u];
            const uint64_t S = r.c.sink_rows < o.closed ? r.c.sink_rows : o.closed;
            const uint64_t budget = S + kvt__sal_m(o.closed, &off) + (n_rows - o.closed);
            cr_assert_leq(attended, budget, "step %u: %llu attended without recall, budget %llu",
                          step, (unsigned long long)attended, (unsigned long long)budget);
            if (!o.dense)
                cr_assert_leq(o.len, budget + W[run]);
            const uint64_t room = kvt__sal_promote_room(o.closed, &r.c);
            cr_assert_eq(room, kvt__sal_m(o.closed, &off) - kvt__sal_m(o.closed, &r.c));
            oracle_promo_after(&po, o.dense ? NULL : fired, o.closed, room);
            expect_promo(&r, &po, step);
            kvt_layer_stats st = stats(&r);
            cr_assert_eq(st.recall_promoted, po.n_prom);
            cr_assert_eq(st.recall_promote_room, room);
            cr_assert_eq(st.recall_promotions, po.promotions);
            cr_assert_eq(st.recall_last_promoted, attended_prom);
            max_prom = po.n_prom > max_prom ? po.n_prom : max_prom;
            if (run < 2) {
                memcpy(sets[run][step], o.idx, sizeof(int32_t) * o.len);
                lens[run][step] = o.len;
            }
        }
        cr_log_info("promotion, mode %d C %u W %u: %llu promoted, %llu demoted, %llu absorbed, at most %llu "
                    "at once, %u dense steps",
                    (int)M[run], C[run], W[run], (unsigned long long)po.promotions, (unsigned long long)po.demotions,
                    (unsigned long long)po.absorbed, (unsigned long long)max_prom, dense_steps);
        cr_assert_gt(po.promotions, 0, "nothing promoted: the test proves nothing");
        cr_assert_gt(po.demotions, 0, "nothing demoted: the demotion path is untested");
        cr_assert(run != 2 || dense_steps > 0, "W %u never overflowed", W[run]);
        absorbed += po.absorbed;
        rig_close(&r);
    }
    for (uint32_t step = 0; step < 240; step++) {
        cr_assert_eq(lens[0][step], lens[1][step], "step %u", step);
        cr_assert_eq(memcmp(sets[0][step], sets[1][step], sizeof(int32_t) * lens[0][step]), 0,
                     "step %u: backends differ", step);
    }
    cr_assert_gt(absorbed, 0, "no close kept a promoted row: absorption is untested");
    g_promote[0] = 0;
}

/* The promotion part of a request's layer-0 recall state (white-box), into buf. */
static size_t promo_blob(const rig *r, const kvt_seq *seq, uint8_t *buf) {
    const kvt__recall_layer *rl = &seq->recall[0];
    cr_assert_eq(kvt__recall_layer_read_promo(rl, &r->ctx->backend, buf), KVT_OK);
    return kvt__recall_promo_bytes(rl);
}

/* A fork copies the promotion state (same promoted rows, same sets after); an attached request
 * starts with nothing promoted; a snapshot carries the state (the restored request continues
 * with the same sets, step for step, over a close); a snapshot without promotion restores into
 * a context with promotion as a mismatch, and one with it into a context with another capacity
 * too. */
Test(recall_step, promotion_forks_attaches_and_snapshots, .timeout = 120) {
    static step_out o;
    static uint8_t pa[1 << 16], pb[1 << 16];
    g_promote[0] = 16;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_SOUND, 4096, 1.0f, 8080);
    prefill(&r, 64 * 5 + 20);
    for (uint32_t step = 0; step < 24; step++) {
        float q[H * QD];
        make_queries(&r, q, step % 2 ? 150 : -1);
        decode(&r, q, &o);
    }
    kvt_layer_stats ps = stats(&r);
    cr_assert_gt(ps.recall_promoted, 0, "nothing promoted: the test proves nothing");
    kvt_seq *child, *att;
    kvt_layer_stats cs, as;
    fork_and_attach(&r, &child, &att, &cs, &as);
    cr_assert_eq(cs.recall_promoted, ps.recall_promoted);
    cr_assert_eq(cs.recall_promotions, ps.recall_promotions);
    size_t nb = promo_blob(&r, r.seq, pa);
    cr_assert_eq(promo_blob(&r, child, pb), nb);
    cr_assert_eq(memcmp(pa, pb, nb), 0, "the fork's promotion tables differ");
    cr_assert_eq(as.recall_promoted, 0);
    cr_assert_eq(as.recall_promotions, 0);
    kvt_seq_destroy(att);
    for (uint32_t step = 0; step < 4; step++)
        step_pair(&r, child, step % 2 ? 150 : -1, step);
    kvt_seq_destroy(child);
    /* snapshot and restore */
    size_t need;
    uint8_t *snap = snapshot_as(r.seq, 70, &need); /* restored beside r.seq */
    kvt_seq *copy;
    cr_assert_eq(kvt_seq_restore(r.ctx, snap, need, &copy), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(promo_blob(&r, copy, pb), nb);
    nb = promo_blob(&r, r.seq, pa);
    cr_assert_eq(memcmp(pa, pb, nb), 0, "the restored promotion tables differ");
    for (uint32_t step = 0; step < 70; step++) /* past a close: absorption and demotion */
        step_pair(&r, copy, step % 3 ? 150 : -1, step);
    kvt_layer_stats a = stats(&r), b = {.struct_size = sizeof b};
    cr_assert_eq(kvt_seq_layer_stats(copy, 0, &b), KVT_OK);
    cr_assert_eq(b.recall_promoted, a.recall_promoted);
    cr_assert_eq(b.recall_demotions, a.recall_demotions);
    cr_assert_gt(a.recall_demotions + a.recall_absorbed, 0, "no close touched the promoted set");
    kvt_seq_destroy(copy);
    /* a context built from the snapshot alone (kvtier-inspect's way) takes its promotion */
    kvt_ctx *sctx;
    cr_assert_eq(kvt_snapshot_context(snap, need, KVT_BACKEND_CPU, &sctx), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(kvt_ctx_set_recall_basis(sctx, 0, r.V, RB), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_restore(sctx, snap, need, &copy), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt__recall_layer_read_promo(&copy->recall[0], &sctx->backend, pb), KVT_OK);
    cr_assert_eq(memcmp(pa, pb, nb), 0, "the promotion tables restored in the snapshot's context");
    kvt_layer_stats sc = {.struct_size = sizeof sc};
    cr_assert_eq(kvt_seq_layer_stats(copy, 0, &sc), KVT_OK);
    cr_assert_eq(sc.recall_promote_room, 16);
    kvt_seq_destroy(copy);
    kvt_ctx_destroy(sctx);
    /* another capacity: a mismatch, named */
    g_promote[0] = 8;
    rig other;
    rig_open(&other, KVT_BACKEND_CPU, KVT_RECALL_SOUND, 4096, 1.0f, 8080); /* same basis */
    cr_assert_eq(kvt_seq_restore(other.ctx, snap, need, &copy), KVT_ERR_MISMATCH, "%s",
                 kvt_last_error());
    cr_assert(strstr(kvt_last_error(), "promot"), "%s", kvt_last_error());
    rig_close(&other);
    free(snap);
    /* a snapshot without promotion (every file before it) into a context with promotion */
    g_promote[0] = 0;
    rig plain;
    rig_open(&plain, KVT_BACKEND_CPU, KVT_RECALL_SOUND, 4096, 1.0f, 8080);
    prefill(&plain, 64 * 3 + 5);
    snap = snapshot_as(plain.seq, 71, &need); /* restored beside plain.seq */
    cr_assert_eq(kvt_seq_restore(r.ctx, snap, need, &copy), KVT_ERR_MISMATCH, "%s",
                 kvt_last_error());
    cr_assert(strstr(kvt_last_error(), "recall_promote_capacity"), "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_restore(plain.ctx, snap, need, &copy), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(copy);
    free(snap);
    rig_close(&plain);
    rig_close(&r);
}

/* ---------------------------------------------------------------------------------------------
 * config.recall_lagged_query: the scan of step t runs with step t − 1's queries.
 * ------------------------------------------------------------------------------------------- */
/* Positions a step emitted (TOKENS, white-box slot map) and its certificate. */
typedef struct lag_out {
    uint32_t len;
    int64_t pos[NMAX];
    uint8_t dense;
    kvt_layer_stats st;
} lag_out;

static void lag_decode(rig *r, const float *q, lag_out *o) {
    static step_out so;
    decode(r, q, &so);
    o->len = so.len;
    o->dense = so.dense;
    slots_to_positions(r->seq, so.idx, so.len, r->n, o->pos);
    o->st = stats(r);
}

static void expect_same_step(const lag_out *a, const lag_out *b, uint32_t step) {
    cr_assert_eq(a->len, b->len, "step %u: %u rows vs %u", step, a->len, b->len);
    cr_assert_eq(memcmp(a->pos, b->pos, sizeof(int64_t) * a->len), 0, "step %u: positions", step);
    cr_assert_eq(a->dense, b->dense, "step %u: dense flag", step);
    cr_assert_eq(a->st.recall_phase, b->st.recall_phase, "step %u", step);
    cr_assert_eq(a->st.recall_z, b->st.recall_z, "step %u: z", step);
    cr_assert_eq(a->st.recall_samples, b->st.recall_samples, "step %u", step);
    cr_assert_eq(a->st.recall_last_fired, b->st.recall_last_fired, "step %u", step);
    cr_assert_eq(a->st.recall_last_fetched, b->st.recall_last_fetched, "step %u", step);
    cr_assert_eq(a->st.recall_last_visited, b->st.recall_last_visited, "step %u", step);
    cr_assert_eq(a->st.recall_last_overflow, b->st.recall_last_overflow, "step %u", step);
}

/* A request with the option fed q_1, q_2, ..., q_T makes, step for step, exactly the decisions
 * (emitted positions, dense flag, calibration, z, fired / fetched / visited counts) of a request
 * without it fed q_1, q_1, q_2, ..., q_{T-1}: the same rows, the same queries one step late. Both
 * CPU-side backends; queries aimed at archived rows every third step, so fetches happen (and a
 * row aimed at by q_t only is fetched at t + 1). */
static void lagged_equals_shifted(kvt_backend_kind be, uint64_t seed, bool planned) {
    static float q[3][H * QD]; /* q_{t-1}, q_t */
    rig a, b;
    g_lagged = true;
    g_planned = planned;
    rig_open(&a, be, KVT_RECALL_CONFORMAL, 4096, 1.0f, seed);
    g_lagged = g_planned = false;
    rig_open(&b, be, KVT_RECALL_CONFORMAL, 4096, 1.0f, seed);
    g_planned_steps = 0;
    prefill(&a, 64 * 4 + 9);
    prefill(&b, 64 * 4 + 9);
    static lag_out oa, ob;
    uint64_t fetched_aimed = 0;
    for (uint32_t t = 0; t < 40; t++) {
        int64_t target = t % 3 == 2 ? (int64_t)(5 + (t * 37) % 250) : -1;
        make_queries(&a, q[1], target);
        make_queries(&b, q[2], target); /* b's generator stays in step with a's */
        cr_assert_eq(memcmp(q[1], q[2], sizeof q[1]), 0);
        if (t == 0)
            memcpy(q[0], q[1], sizeof q[0]);
        lag_decode(&a, q[1], &oa);
        lag_decode(&b, q[0], &ob); /* the previous step's queries (the first: its own) */
        expect_same_step(&oa, &ob, t);
        cr_assert_eq(oa.st.recall_last_lagged, t > 0, "step %u: lagged flag", t);
        cr_assert(!ob.st.recall_last_lagged);
        fetched_aimed += oa.st.recall_phase == 1 && oa.st.recall_last_fetched > 0;
        memcpy(q[0], q[1], sizeof q[0]);
    }
    kvt_layer_stats sa = stats(&a);
    cr_assert_eq(sa.recall_steps, 40u);
    cr_assert_eq(sa.recall_phase, 1, "calibrated");
    cr_assert_gt(fetched_aimed, 0u, "some calibrated step fetched rows");
    if (planned) /* the lagged request's steps ran as planned ones (closes: eagerly) */
        cr_assert_geq(g_planned_steps, 30u, "%u of 40 steps planned", g_planned_steps);
    rig_close(&a);
    rig_close(&b);
}

Test(recall_lag, lagged_request_equals_a_plain_one_fed_the_previous_query_cpu,
     .timeout = 120) {
    lagged_equals_shifted(KVT_BACKEND_CPU, 808, false);
}

/* The same with the lagged request's steps planned on the device (kvt_batch_plan_device: the
 * planned recall op scans with the kept queries, then keeps the step's own), CPU and guarded. */
Test(recall_lag, planned_lagged_request_equals_a_plain_one_fed_the_previous_query,
     .timeout = 240) {
    lagged_equals_shifted(KVT_BACKEND_CPU, 818, true);
    lagged_equals_shifted(KVT_BACKEND_GUARDED, 819, true);
}

Test(recall_lag, lagged_request_equals_a_plain_one_fed_the_previous_query_guarded,
     .timeout = 240) {
    lagged_equals_shifted(KVT_BACKEND_GUARDED, 809, false);
}

/* The kept queries travel: a snapshot restored, and a fork, continue the lagged request step for
 * step (their first step scans with the original's last queries, not their own); a context
 * without the option refuses the snapshot, and one with it refuses a snapshot without, naming
 * the option. */
Test(recall_lag, snapshots_and_forks_carry_the_kept_queries, .timeout = 120) {
    rig r;
    g_lagged = true;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 810);
    prefill(&r, 64 * 4 + 9);
    static step_out o;
    for (uint32_t step = 0; step < 12; step++) {
        float q[H * QD];
        make_queries(&r, q, step % 3 == 2 ? 40 : -1);
        decode(&r, q, &o);
    }
    size_t need;
    uint8_t *snap = snapshot_as(r.seq, 70, &need); /* restored beside r.seq */
    kvt_seq *copy, *child;
    cr_assert_eq(kvt_seq_restore(r.ctx, snap, need, &copy), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats b = {.struct_size = sizeof b};
    cr_assert_eq(kvt_seq_layer_stats(copy, 0, &b), KVT_OK);
    cr_assert(b.recall_last_lagged);
    /* the restored request's first step aims at a row the kept queries do not: it must
     * scan with the kept ones, as the original does */
    for (uint32_t step = 0; step < 6; step++)
        step_pair(&r, copy, step % 2 ? 60 : -1, step);
    kvt_layer_stats a = stats(&r);
    cr_assert_eq(kvt_seq_layer_stats(copy, 0, &b), KVT_OK);
    cr_assert_eq(b.recall_fetched_rows, a.recall_fetched_rows);
    cr_assert_eq(b.recall_steps, a.recall_steps);
    cr_assert_eq(b.recall_last_lagged, a.recall_last_lagged);
    kvt_seq_destroy(copy);
    cr_assert_eq(kvt_seq_fork(r.seq, 11, &child), KVT_OK, "%s", kvt_last_error());
    for (uint32_t step = 0; step < 4; step++)
        step_pair(&r, child, step % 2 ? -1 : 70, step);
    a = stats(&r);
    cr_assert_eq(kvt_seq_layer_stats(child, 0, &b), KVT_OK);
    cr_assert_eq(b.recall_fetched_rows - a.recall_fetched_rows, 0u);
    kvt_seq_destroy(child);
    /* without the option: refused, named */
    rig plain;
    g_lagged = false;
    rig_open(&plain, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 810);
    cr_assert_eq(kvt_seq_restore(plain.ctx, snap, need, &copy), KVT_ERR_MISMATCH, "%s",
                 kvt_last_error());
    cr_assert(strstr(kvt_last_error(), "recall_lagged_query"), "%s", kvt_last_error());
    free(snap);
    prefill(&plain, 64 * 4 + 9);
    snap = snapshot_as(plain.seq, 71, &need); /* r.seq has plain.seq's id */
    cr_assert_eq(kvt_seq_restore(r.ctx, snap, need, &copy), KVT_ERR_MISMATCH, "%s",
                 kvt_last_error());
    cr_assert(strstr(kvt_last_error(), "recall_lagged_query"), "%s", kvt_last_error());
    free(snap);
    rig_close(&plain);
    rig_close(&r);
}

/* Prefix sharing keeps the closed rows' σ and sketch planes shared past later closes: a fork
 * reads the rows closed before it from the set it shares with its parent, and both write their
 * later closes into planes of their own. Forked requests must decide exactly as a request whose
 * planes are one flat piece (a snapshot restored: it shares nothing): the parent, its child and
 * the restored copy take the same rows and queries for 150 steps (two closes; queries aimed at
 * archived rows every third step, promotion on) and attend the same positions at every step; a
 * second fork after those closes (the parent's shared piece and its own rows become one new set)
 * does the same for 70 more. CPU and guarded backends. */
static void shared_planes_case(kvt_backend_kind be) {
    g_promote[0] = 4;
    rig r;
    rig_open(&r, be, KVT_RECALL_CONFORMAL, 4096, 1.0f, 2468);
    prefill(&r, 64 * 5 + 10);
    static step_out o;
    for (uint32_t step = 0; step < 12; step++) {
        float q[H * QD];
        make_queries(&r, q, step % 3 ? -1 : 40 + 7 * (int64_t)step);
        decode(&r, q, &o);
    }
    size_t need;
    uint8_t *snap = snapshot_as(r.seq, 70, &need); /* restored beside r.seq */
    kvt_seq *flat, *child;
    cr_assert_eq(kvt_seq_restore(r.ctx, snap, need, &flat), KVT_OK, "%s", kvt_last_error());
    free(snap);
    cr_assert_eq(kvt_seq_fork(r.seq, 21, &child), KVT_OK, "%s", kvt_last_error());
    const uint64_t forked_closed = stats(&r).closed_rows;
    uint64_t fetched0 = stats(&r).recall_fetched_rows;
    for (int round = 0; round < 2; round++) {
        kvt_seq *others[2] = {child, flat};
        const uint32_t steps = round ? 70 : 150;
        for (uint32_t step = 0; step < steps; step++) {
            int64_t target = step % 3 == 0 ? (int64_t)((step * 37) % (64 * 5)) : -1;
            step_all(&r, others, 2, target, step);
            kvt_layer_stats a = {.struct_size = sizeof a}, b = a, c = a;
            cr_assert_eq(kvt_seq_layer_stats(r.seq, 0, &a), KVT_OK);
            cr_assert_eq(kvt_seq_layer_stats(child, 0, &b), KVT_OK);
            cr_assert_eq(kvt_seq_layer_stats(flat, 0, &c), KVT_OK);
            cr_assert_gt(a.shared_side_bytes, 0u, "round %d step %u", round, step);
            cr_assert_eq(b.shared_side_bytes, a.shared_side_bytes);
            cr_assert_eq(c.shared_side_bytes, 0u);
            cr_assert_eq(b.recall_fetched_rows - c.recall_fetched_rows, 0u);
            cr_assert_eq(b.recall_promoted, c.recall_promoted);
            cr_assert_eq(b.closed_rows, c.closed_rows);
        }
        if (round == 0) {
            cr_assert_geq(stats(&r).closed_rows, forked_closed + 128u, "two closes since");
            kvt_seq_destroy(child);
            cr_assert_eq(kvt_seq_fork(r.seq, 22, &child), KVT_OK, "%s", kvt_last_error());
        }
    }
    kvt_layer_stats fs = {.struct_size = sizeof fs};
    cr_assert_eq(kvt_seq_layer_stats(flat, 0, &fs), KVT_OK);
    cr_log_info("shared planes (%s): %llu closed rows, %llu fetched, %llu promotions",
                be == KVT_BACKEND_CPU ? "cpu" : "guarded", (unsigned long long)fs.closed_rows,
                (unsigned long long)(stats(&r).recall_fetched_rows - fetched0),
                (unsigned long long)fs.recall_promotions);
    cr_assert_gt(stats(&r).recall_fetched_rows, fetched0, "no archived row was ever fetched");
    kvt_seq_destroy(child);
    kvt_seq_destroy(flat);
    g_promote[0] = 0;
    rig_close(&r);
}

Test(recall_step, forks_share_planes_past_closes_and_decide_as_flat_ones_cpu, .timeout = 240) {
    shared_planes_case(KVT_BACKEND_CPU);
}

Test(recall_step, forks_share_planes_past_closes_and_decide_as_flat_ones_guarded,
     .timeout = 240) {
    shared_planes_case(KVT_BACKEND_GUARDED);
}

/* On the guarded backend a host array as the query of a step that recalls is the caller's error
 * (KVT_ERR_INVALID_ARGUMENT naming it, before any work), not the op's KVT_ERR_INVARIANT; the same
 * step then runs with the query in a kvt_buffer. */
Test(recall_step, a_host_query_on_the_guarded_backend_is_the_callers_error) {
    rig r;
    rig_open(&r, KVT_BACKEND_GUARDED, KVT_RECALL_MARGIN, 3, 1e30f, 79);
    prefill(&r, 64 * 3);
    float q[H * QD];
    make_queries(&r, q, -1);
    uint32_t one = 1, topk;
    make_row(&r, r.rows + r.n * 1152);
    cr_assert_eq(kvt_batch_reserve(r.b, &r.seq, &one, 1), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, 1, r.rows + r.n * 1152, 1152), KVT_OK);
    cr_assert_eq(kvt_batch_plan(r.b), KVT_OK);
    cr_assert_eq(kvt_batch_capacity(r.b, 0, &topk, NULL), KVT_OK);
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                  .indices = kvt_buffer_ptr(r.ibuf), .capacity = topk,
                  .lengths = kvt_buffer_ptr(r.lbuf), .dense = kvt_buffer_ptr(r.dbuf)};
    cr_assert_eq(kvt_batch_run(r.b, 0, q, NULL, &e), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "query: ") &&
                  strstr(kvt_last_error(), "guarded backend's memory"),
              "%s", kvt_last_error());
    cr_assert_eq(kvt_buffer_write(r.qbuf, 0, q, sizeof q), KVT_OK);
    cr_assert_eq(kvt_batch_run(r.b, 0, kvt_buffer_ptr(r.qbuf), NULL, &e), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(kvt_batch_commit(r.b, NULL), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats st = stats(&r);
    cr_assert_eq(st.recall_steps, 1, "%llu", (unsigned long long)st.recall_steps); /* one run */
    rig_close(&r);
}

/* A request's sketch planes of its closed rows, the shared set's rows first (fp16 sketches and,
 * at 8 bits, the 8-bit planes), then its ρ: into csk / rho, their bytes in *n_csk. */
static void planes_of(const rig *r, const kvt_seq *seq, uint8_t *csk, float *rho, size_t *n_csk) {
    const kvt__sal *s = &kvt__seq_state(seq, 0)->sal;
    const kvt__backend *be = &r->ctx->backend;
    const size_t row = sizeof(uint16_t) * s->sk_stride;
    if (s->n_head) {
        cr_assert_eq(be->ops->read(be, csk, s->head->csk, row * s->n_head, NULL), KVT_OK);
        cr_assert_eq(be->ops->read(be, rho, s->head->rho, sizeof *rho * s->n_head, NULL), KVT_OK);
    }
    const uint64_t own = s->closed_rows - s->n_head;
    if (own) {
        cr_assert_eq(be->ops->read(be, csk + row * s->n_head, s->csk, row * own, NULL), KVT_OK);
        cr_assert_eq(be->ops->read(be, rho + s->n_head, s->rho, sizeof *rho * own, NULL), KVT_OK);
    }
    *n_csk = row * s->closed_rows;
}

/* The 8-bit scan (params.recall_scan_bits 8) inside the step: two rigs over the same rows and
 * queries, at 16 and at 8 bits, conformal and sound: every step the 8-bit step emits every row
 * the 16-bit one emits (the scan fires a superset; a dense step emits all), calibration gives the
 * same z, snapshots restore into a context with the same precision only, and bad values of the
 * knob are refused with a message naming it. Where the CUDA backend opens (the emulation, a
 * device), a third rig at 8 bits on it: its planes (written by its close) are the guarded rig's
 * byte for byte after every step, and it emits the guarded rig's sets, slot for slot. */
Test(recall_step, scan_bits_8_emits_a_superset_and_snapshots, .timeout = 240) {
    static step_out a, b, cu;
    static uint8_t pl8[NMAX * 2 * 256], plc[NMAX * 2 * 256];
    uint64_t steps = 0, equal = 0, extra = 0, cuda_steps = 0;
    const bool with_cuda = tu_cuda_backend_usable();
    for (int m = 0; m < 2; m++) {
        const kvt_recall_mode mode = m ? KVT_RECALL_SOUND : KVT_RECALL_CONFORMAL;
        rig r16, r8, rc;
        g_scan_bits = 16;
        rig_open(&r16, KVT_BACKEND_CPU, mode, 4096, 1.0f, 4242 + (uint64_t)m);
        g_scan_bits = 8;
        rig_open(&r8, KVT_BACKEND_GUARDED, mode, 4096, 1.0f, 4242 + (uint64_t)m);
        if (with_cuda)
            rig_open(&rc, KVT_BACKEND_CUDA, mode, 4096, 1.0f, 4242 + (uint64_t)m);
        g_scan_bits = 0;
        prefill(&r16, 64 * 5 + 7);
        prefill(&r8, 64 * 5 + 7);
        if (with_cuda)
            prefill(&rc, 64 * 5 + 7);
        for (uint32_t step = 0; step < 48; step++) {
            float q[H * QD], q8[H * QD];
            int64_t target = -1;
            if (step >= 16 && step % 4 == 0) { /* aim at an archived row */
                uint8_t base[NMAX];
                base_set(&r16, &a, r16.n + 1, base);
                for (uint64_t u = 11 + step; u < a.closed; u++)
                    if (!base[u]) {
                        target = (int64_t)u;
                        break;
                    }
            }
            make_queries(&r16, q, target);
            make_queries(&r8, q8, target);
            cr_assert_eq(memcmp(q, q8, sizeof q), 0);
            decode(&r16, q, &a);
            decode(&r8, q8, &b);
            cr_assert_eq(stats(&r16).recall_z, stats(&r8).recall_z, "step %u", step);
            if (with_cuda) {
                float qc[H * QD];
                make_queries(&rc, qc, target);
                cr_assert_eq(memcmp(q, qc, sizeof q), 0);
                decode(&rc, qc, &cu);
                static float rho8[NMAX], rhoc[NMAX];
                size_t nb, nc;
                planes_of(&r8, r8.seq, pl8, rho8, &nb);
                planes_of(&rc, rc.seq, plc, rhoc, &nc);
                cr_assert_eq(nc, nb);
                cr_assert_eq(memcmp(pl8, plc, nb), 0, "mode %d step %u: CUDA's 8-bit planes "
                             "differ from the guarded backend's", (int)mode, step);
                cr_assert_eq(cu.dense, b.dense, "mode %d step %u: dense", (int)mode, step);
                cr_assert_eq(cu.len, b.len, "mode %d step %u: CUDA emits %u slots, the CPU %u",
                             (int)mode, step, cu.len, b.len);
                cr_assert_eq(memcmp(cu.idx, b.idx, sizeof(int32_t) * b.len), 0,
                             "mode %d step %u: CUDA's 8-bit set differs", (int)mode, step);
                const kvt_layer_stats sc = stats(&rc), s8 = stats(&r8);
                cr_assert_eq(sc.recall_z, s8.recall_z);
                cr_assert_eq(sc.recall_last_fired, s8.recall_last_fired);
                cr_assert_eq(sc.recall_last_visited, s8.recall_last_visited);
                cuda_steps += !b.dense;
            }
            if (b.dense)
                continue;
            cr_assert_not(a.dense, "mode %d step %u: dense at 16 bits only", (int)mode, step);
            uint8_t in8[NMAX] = {0};
            for (uint32_t j = 0; j < b.len; j++)
                in8[b.idx[j]] = 1;
            for (uint32_t j = 0; j < a.len; j++)
                cr_assert(in8[a.idx[j]], "mode %d step %u: slot %d emitted at 16 bits, not at 8",
                          (int)mode, step, a.idx[j]);
            steps++;
            equal += a.len == b.len;
            extra += b.len - a.len;
        }
        if (mode == KVT_RECALL_CONFORMAL) {
            size_t need;
            uint8_t *snap = snapshot_as(r8.seq, 70, &need);
            kvt_seq *copy;
            cr_assert_eq(kvt_seq_restore(r8.ctx, snap, need, &copy), KVT_OK, "%s",
                         kvt_last_error());
            cr_assert_eq(kvt_seq_check(copy), KVT_OK, "%s", kvt_last_error());
            size_t need2;
            cr_assert_eq(kvt_seq_snapshot_size(copy, &need2), KVT_OK);
            cr_assert_eq(need2, need);
            uint8_t *snap2 = malloc(need);
            cr_assert(snap2);
            cr_assert_eq(kvt_seq_snapshot(copy, snap2, need, NULL), KVT_OK, "%s",
                         kvt_last_error());
            cr_assert_eq(memcmp(snap, snap2, need), 0, "a restored 8-bit request's snapshot");
            kvt_seq_destroy(copy);
            cr_assert_eq(kvt_seq_restore(r16.ctx, snap, need, &copy), KVT_ERR_MISMATCH, "%s",
                         kvt_last_error());
            cr_assert(strstr(kvt_last_error(), "recall sketches"), "%s", kvt_last_error());
            free(snap);
            free(snap2);
        }
        rig_close(&r16);
        rig_close(&r8);
        if (with_cuda)
            rig_close(&rc);
    }
    cr_assert_gt(steps, 40);
    cr_assert(!with_cuda || cuda_steps > 40, "%llu non-dense CUDA steps",
              (unsigned long long)cuda_steps);
    if (with_cuda)
        cr_log_info("recall_scan_bits 8 on CUDA: the guarded backend's planes and sets on %llu "
                    "non-dense steps", (unsigned long long)cuda_steps);
    cr_log_info("recall_scan_bits 8: %llu non-dense steps, the 16-bit set inside the 8-bit one "
                "every step, equal on %llu, %llu rows more in all",
                (unsigned long long)steps, (unsigned long long)equal,
                (unsigned long long)extra);
    /* the knob's refusals */
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    kvt_model *mdl;
    cr_assert_eq(kvt_model_create(&s, 1, "bits", &mdl, NULL, 0), KVT_OK);
    kvt_ctx_params p = kvt_ctx_default_params();
    cr_assert_eq(p.recall_scan_bits, 16);
    p.model = mdl;
    p.recall_sketch_rank = RB;
    kvt_ctx *ctx = NULL;
    char err[256];
    p.recall_scan_bits = 7;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "recall_scan_bits: 7 not 8 or 16"), "%s", err);
    p.recall_scan_bits = 8;
    p.recall_sketch_rank = 0;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "recall_sketch_rank"), "%s", err);
    p.recall_sketch_rank = RB;
    if (with_cuda) { /* the CUDA backend's table has the 8-bit planes (recall_scan_q8) */
        p.backend = KVT_BACKEND_CUDA;
        cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
        kvt_ctx_destroy(ctx);
        p.backend = KVT_BACKEND_CPU;
    }
    /* a backend whose table lacks the 8-bit planes is refused by that capability, named */
    kvt__backend_ops no8 = *kvt__backend_cpu_ops();
    no8.recall_scan_q8 = false;
    no8.name = "sixteen";
    cr_assert_eq(kvt__backend_scan_bits_check(&no8, 16, err, sizeof err), KVT_OK);
    cr_assert_eq(kvt__backend_scan_bits_check(&no8, 8, err, sizeof err), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(err, "recall_scan_bits 8: the sixteen backend") && strstr(err, "16-bit only"),
              "%s", err);
    cr_assert_eq(kvt__backend_scan_bits_check(kvt__backend_cpu_ops(), 8, err, sizeof err), KVT_OK);
    p.recall_scan_bits = 0; /* read as 16 */
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(mdl);
}

static void expect_same_planes(const rig *a, const kvt_seq *sa, const rig *b, const kvt_seq *sb,
                               const char *what) {
    static uint8_t ca[NMAX * 2 * 256], cb[NMAX * 2 * 256];
    static float ra[NMAX], rb[NMAX];
    size_t na, nb;
    planes_of(a, sa, ca, ra, &na);
    planes_of(b, sb, cb, rb, &nb);
    cr_assert_eq(na, nb, "%s", what);
    cr_assert_gt(na, 0u, "%s", what);
    cr_assert_eq(memcmp(ca, cb, na), 0, "%s: sketch planes differ", what);
    const uint64_t closed = kvt__seq_state(sa, 0)->sal.closed_rows;
    cr_assert_eq(memcmp(ra, rb, sizeof(float) * closed), 0, "%s: rho differs", what);
}

/* The step's emission of a rig's request (TOKENS) after decode: slots, count and dense flag. */
static void expect_same_step_out(const step_out *a, const step_out *b, const char *what,
                                 uint32_t step) {
    cr_assert_eq(a->len, b->len, "%s step %u: %u rows against %u", what, step, a->len, b->len);
    cr_assert_eq(memcmp(a->idx, b->idx, sizeof(int32_t) * a->len), 0, "%s step %u", what, step);
    cr_assert_eq(a->dense, b->dense, "%s step %u", what, step);
}

/* kvt_ctx_refit_recall_basis: a request whose layer basis is replaced mid-life decides from then
 * on exactly as one whose context had the new basis from the start. Two rigs over the same rows
 * and queries: A starts with basis V1, B with V2; each forks a child (its closed rows become a
 * shared set); then both layers are refitted to V2 at the same step (B's is a refit to the basis
 * it has: its planes must not change; both calibrate again, so conformal z comes from the same
 * samples). A's and its child's planes (shared rows and own: fp16 sketches, ρ, 8-bit planes)
 * equal B's byte for byte, and for 70 more steps A emits B's sets slot for slot, fetches and
 * visits as many rows; the pruned scan's groups are to be built anew (white-box). Sound mode
 * with 64-row blocks (a close after the refit), and conformal with 256-row blocks; planned steps
 * (kvt_batch_plan_device with the lagged query) on both sides once. CPU and guarded backends at
 * 16 and 8 bits, and the CUDA backend where it opens (the emulation, a device). */
static void refit_case(kvt_backend_kind be, uint32_t bits, kvt_recall_mode mode, bool planned) {
    static step_out oa, ob;
    static uint8_t before[NMAX * 2 * 256], after[NMAX * 2 * 256];
    static float rho_before[NMAX], rho_after[NMAX];
    const bool sound = mode == KVT_RECALL_SOUND;
    g_block = sound ? 64 : 256;
    g_clustered = true;
    g_scan_bits = bits;
    g_lagged = g_planned = planned;
    const uint32_t planned0 = g_planned_steps;
    rig a, b;
    rig_open(&a, be, mode, 4096, 1.0f, 9090);
    rig_open(&b, be, mode, 4096, 1.0f, 9090);
    g_lagged = g_planned = false;
    g_scan_bits = 0;
    g_clustered = false;
    /* V2: V1 turned a little (its rows plus noise, orthonormalised), so that the clustered rows
     * stay near its span and the pruned scan still has groups to skip */
    static float V2[RB * D];
    static double Vd[RB * D];
    tu_rng g2 = {.s = 777};
    for (uint32_t i = 0; i < RB * D; i++)
        Vd[i] = (double)a.V[i] + 0.02 * tu_normal(&g2);
    cr_assert_eq(kvt_orthonormalise_rows(Vd, RB, D, 2), KVT_OK);
    for (uint32_t i = 0; i < RB * D; i++)
        V2[i] = (float)Vd[i];
    cr_assert_eq(kvt_ctx_set_recall_basis(b.ctx, 0, V2, RB), KVT_OK, "%s", kvt_last_error());
    prefill(&a, g_block * 3 + 7);
    prefill(&b, g_block * 3 + 7);
    float q[H * QD];
    for (uint32_t step = 0; step < 10; step++) { /* A and B read different sketches here */
        int64_t t = sound && step % 2 ? 64 + 9 * (int64_t)step : -1;
        make_queries(&a, q, t);
        make_queries(&b, q, t);
        decode(&a, q, &oa);
        decode(&b, q, &ob);
    }
    kvt_seq *ca, *cb;
    cr_assert_eq(kvt_seq_fork(a.seq, 31, &ca), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_fork(b.seq, 31, &cb), KVT_OK, "%s", kvt_last_error());
    cr_assert_gt(kvt__seq_state(ca, 0)->sal.n_head, 0u, "the child shares its closed rows");
    size_t nb0, nb1;
    planes_of(&b, b.seq, before, rho_before, &nb0);
    cr_assert_eq(kvt_ctx_refit_recall_basis(a.ctx, 0, V2, RB, 0, NULL), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(kvt_ctx_refit_recall_basis(b.ctx, 0, V2, RB, 0, NULL), KVT_OK, "%s",
                 kvt_last_error());
    planes_of(&b, b.seq, after, rho_after, &nb1);
    kvt__recall_state rs; /* the groups (of the old sketches) are built anew at the next step */
    cr_assert_eq(kvt__recall_layer_read(kvt__seq_recall_base(a.seq, 0), &a.ctx->backend, &rs),
                 KVT_OK);
    cr_assert_eq(rs.n_grouped, 0u);
    cr_assert_eq(rs.phase, (uint32_t)KVT__CONFORMAL_OPEN);
    cr_assert_eq(nb0, nb1);
    cr_assert_eq(memcmp(before, after, nb0), 0, "a refit to the same basis changed its planes");
    uint32_t id_a, id_b;
    cr_assert_eq(kvt_ctx_recall_basis(a.ctx, 0, NULL, &id_a), KVT_OK);
    cr_assert_eq(kvt_ctx_recall_basis(b.ctx, 0, NULL, &id_b), KVT_OK);
    cr_assert_eq(id_a, id_b);
    expect_same_planes(&a, a.seq, &b, b.seq, "parent after the refit");
    expect_same_planes(&a, ca, &b, cb, "child after the refit");
    cr_assert_eq(kvt_seq_check(a.seq), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(ca), KVT_OK, "%s", kvt_last_error());
    const uint64_t closed0 = oa.closed;
    const kvt_layer_stats a0 = stats(&a), b0 = stats(&b);
    uint64_t archived = 0;
    for (uint32_t step = 0; step < 70; step++) {
        int64_t t = sound && step % 3 == 0 ? (int64_t)((step * 41) % (64 * 3)) : -1;
        make_queries(&a, q, t);
        make_queries(&b, q, t);
        decode(&a, q, &oa);
        decode(&b, q, &ob);
        expect_same_step_out(&oa, &ob, "refitted against fresh", step);
        archived += stats(&a).recall_last_archived;
    }
    if (sound)
        cr_assert_gt(oa.closed, closed0, "a block closed after the refit");
    expect_same_planes(&a, a.seq, &b, b.seq, "parent at the end");
    kvt_layer_stats sa = stats(&a), sb = stats(&b);
    const uint64_t fetched = sa.recall_fetched_rows - a0.recall_fetched_rows;
    const uint64_t visited = sa.recall_visited_rows - a0.recall_visited_rows;
    cr_assert_eq(fetched, sb.recall_fetched_rows - b0.recall_fetched_rows);
    cr_assert_eq(visited, sb.recall_visited_rows - b0.recall_visited_rows,
                 "the scans visited alike");
    cr_assert_eq(sa.recall_z, sb.recall_z);
    cr_assert_gt(fetched, 0u, "fetches after the refit");
    if (planned)
        cr_assert_gt(g_planned_steps, planned0 + 100u, "the steps after the refit were planned");
    cr_log_info("refit (%s, %s, %u bits%s): after it %llu rows fetched, %llu of %llu visited",
                be == KVT_BACKEND_CPU ? "cpu" : be == KVT_BACKEND_GUARDED ? "guarded" : "cuda",
                sound ? "sound" : "conformal", bits, planned ? ", planned, lagged" : "",
                (unsigned long long)fetched, (unsigned long long)visited,
                (unsigned long long)archived);
    kvt_seq_destroy(ca);
    kvt_seq_destroy(cb);
    rig_close(&a);
    rig_close(&b);
    g_block = 64;
}

Test(recall_refit, refitted_request_decides_as_a_fresh_basis, .timeout = 300) {
    const kvt_backend_kind kinds[3] = {KVT_BACKEND_CPU, KVT_BACKEND_GUARDED, KVT_BACKEND_CUDA};
    const bool with_cuda = tu_cuda_backend_usable();
    for (int k = 0; k < (with_cuda ? 3 : 2); k++)
        for (uint32_t bits = 16; bits >= 8; bits -= 8)
            for (int m = 0; m < 2; m++)
                refit_case(kinds[k], bits, m ? KVT_RECALL_CONFORMAL : KVT_RECALL_SOUND, false);
    /* planned steps (kvt_batch_plan_device, the lagged query) before and after the refit */
    refit_case(KVT_BACKEND_CPU, 16, KVT_RECALL_CONFORMAL, true);
    refit_case(KVT_BACKEND_GUARDED, 8, KVT_RECALL_CONFORMAL, true);
}

/* Conformal: a refit starts the calibration again (phase open, z = Z_MAX, the next 8 steps with
 * archived rows attend every row, then z is fixed anew); KVT_REFIT_KEEP_Z keeps z and the phase.
 * And what is refused, with nothing changed: a request in a step, a rank other than the basis's,
 * unknown flags, rows not orthonormal, a NULL V, a layer out of range. Before any reserve the
 * call is kvt_ctx_set_recall_basis (any rank). */
Test(recall_refit, recalibration_keep_z_and_refusals, .timeout = 120) {
    static step_out o;
    rig r;
    rig_open(&r, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 5150);
    static float V2[RB * D], bad[RB * D];
    tu_rng g2 = {.s = 4711};
    cr_assert(tu_orthonormal_rows(&g2, RB, D, V2));
    /* not started: a set, of any rank */
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, V2, RB - 4, 0, NULL), KVT_OK, "%s",
                 kvt_last_error());
    uint32_t rank, id0, id;
    cr_assert_eq(kvt_ctx_recall_basis(r.ctx, 0, &rank, NULL), KVT_OK);
    cr_assert_eq(rank, RB - 4);
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, r.V, RB, 0, NULL), KVT_OK);
    cr_assert_eq(kvt_ctx_recall_basis(r.ctx, 0, NULL, &id0), KVT_OK);
    prefill(&r, 64 * 5 + 7);
    float q[H * QD];
    for (uint32_t step = 0; step < 10; step++) {
        make_queries(&r, q, -1);
        decode(&r, q, &o);
    }
    kvt_layer_stats s0 = stats(&r);
    cr_assert_eq(s0.recall_phase, 1, "calibrated after 8 steps");
    /* KEEP_Z: the phase and z stay, the next step is not a calibration step */
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, V2, RB, KVT_REFIT_KEEP_Z, NULL), KVT_OK,
                 "%s", kvt_last_error());
    kvt_layer_stats s1 = stats(&r);
    cr_assert_eq(s1.recall_phase, 1);
    cr_assert_eq(s1.recall_z, s0.recall_z);
    cr_assert_neq(s1.recall_basis_id, s0.recall_basis_id);
    make_queries(&r, q, -1);
    decode(&r, q, &o);
    cr_assert_eq(stats(&r).recall_calib_steps, s0.recall_calib_steps);
    { /* a snapshot names V2: a context with the old basis refuses it, one with V2 takes it */
        size_t need;
        uint8_t *snap = snapshot_as(r.seq, 77, &need); /* beside the new rig's request 7 */
        rig o2;
        rig_open(&o2, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 5150); /* basis r.V */
        kvt_seq *back = NULL;
        kvt_status rs0 = kvt_seq_restore(o2.ctx, snap, need, &back);
        cr_assert_eq(rs0, KVT_ERR_MISMATCH, "%s %s", kvt_status_name(rs0), kvt_last_error());
        cr_assert_eq(kvt_ctx_set_recall_basis(o2.ctx, 0, V2, RB), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_restore(o2.ctx, snap, need, &back), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_check(back), KVT_OK, "%s", kvt_last_error());
        kvt_seq_destroy(back);
        free(snap);
        rig_close(&o2);
    }
    /* flags 0: calibration again, 8 dense steps, then z fixed */
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, r.V, RB, 0, NULL), KVT_OK, "%s",
                 kvt_last_error());
    kvt_layer_stats s2 = stats(&r);
    cr_assert_eq(s2.recall_phase, 0);
    cr_assert_eq(s2.recall_z, 8.0f);
    cr_assert_eq(s2.recall_basis_id, id0);
    for (uint32_t step = 0; step < 8; step++) {
        make_queries(&r, q, -1);
        decode(&r, q, &o);
        cr_assert(o.dense, "calibration step %u attends every row", step);
    }
    kvt_layer_stats s3 = stats(&r);
    cr_assert_eq(s3.recall_calib_steps, s2.recall_calib_steps + 8);
    cr_assert_eq(s3.recall_phase, 1);
    /* refusals: nothing changed */
    memcpy(bad, V2, sizeof bad);
    bad[0] *= 2.0f;
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, V2, RB - 1, 0, NULL), KVT_ERR_OUT_OF_RANGE);
    cr_assert(strstr(kvt_last_error(), "keeps the rank"), "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, V2, RB, 2u, NULL),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, bad, RB, 0, NULL),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, NULL, RB, 0, NULL),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 1, V2, RB, 0, NULL), KVT_ERR_OUT_OF_RANGE);
    uint32_t one = 1;
    make_row(&r, r.rows + r.n * 1152);
    cr_assert_eq(kvt_batch_reserve(r.b, &r.seq, &one, 1), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_refit_recall_basis(r.ctx, 0, V2, RB, 0, NULL), KVT_ERR_BAD_STATE);
    cr_assert(strstr(kvt_last_error(), "between steps"), "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, 1, r.rows + r.n * 1152, 1152), KVT_OK);
    cr_assert_eq(kvt_batch_plan(r.b), KVT_OK);
    cr_assert_eq(kvt_batch_commit(r.b, NULL), KVT_OK, "%s", kvt_last_error());
    r.n++;
    cr_assert_eq(kvt_ctx_recall_basis(r.ctx, 0, NULL, &id), KVT_OK);
    cr_assert_eq(id, id0, "a refused refit changed nothing");
    kvt_layer_stats s4 = stats(&r);
    cr_assert_eq(s4.recall_phase, 1);
    cr_assert_eq(s4.recall_z, s3.recall_z);
    cr_assert_eq(kvt_seq_check(r.seq), KVT_OK, "%s", kvt_last_error());
    rig_close(&r);
}

/* A backend table whose sketch_rows fails on its first call (then works): a refit's failure. */
static kvt__backend_ops g_failing_ops;
static const kvt__backend_ops *g_real_ops;
static int g_sketch_calls;
static kvt_status failing_sketch_rows(const kvt__backend *be, const kvt__sketch_args *a,
                                      uint32_t n, void *stream) {
    if (g_sketch_calls++ == 0)
        return KVT_ERR_OUT_OF_MEMORY;
    return g_real_ops->sketch_rows(be, a, n, stream);
}

/* A request whose re-sketch fails does not stop the others: the refit returns KVT_ERR_CORRUPT
 * naming the first failure and the count, every other request follows the new basis, and the
 * same call again sketches every request again (both then equal a context that had the new
 * basis from the start, and calibrate again). */
Test(recall_refit, a_failed_request_does_not_stop_the_others) {
    static float V2[RB * D];
    tu_rng g2 = {.s = 2024};
    cr_assert(tu_orthonormal_rows(&g2, RB, D, V2));
    rig a, b;
    rig_open(&a, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 6060);
    rig_open(&b, KVT_BACKEND_CPU, KVT_RECALL_CONFORMAL, 4096, 1.0f, 6060);
    cr_assert_eq(kvt_ctx_set_recall_basis(b.ctx, 0, V2, RB), KVT_OK, "%s", kvt_last_error());
    static step_out oa, ob;
    prefill(&a, 64 * 5 + 7);
    prefill(&b, 64 * 5 + 7);
    float q[H * QD];
    for (uint32_t step = 0; step < 10; step++) {
        make_queries(&a, q, -1);
        make_queries(&b, q, -1);
        decode(&a, q, &oa);
        decode(&b, q, &ob);
    }
    kvt_seq *ca, *cb;
    cr_assert_eq(kvt_seq_fork(a.seq, 31, &ca), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_fork(b.seq, 31, &cb), KVT_OK, "%s", kvt_last_error());
    g_real_ops = a.ctx->backend.ops;
    g_failing_ops = *g_real_ops;
    g_failing_ops.sketch_rows = failing_sketch_rows;
    g_sketch_calls = 0;
    a.ctx->backend.ops = &g_failing_ops;
    cr_assert_eq(kvt_ctx_refit_recall_basis(a.ctx, 0, V2, RB, 0, NULL), KVT_ERR_CORRUPT);
    a.ctx->backend.ops = g_real_ops;
    cr_assert(strstr(kvt_last_error(), "of 1 request(s)") && strstr(kvt_last_error(), "call again"),
              "%s", kvt_last_error());
    cr_assert_gt(g_sketch_calls, 1, "the requests after the failing one were sketched");
    /* the one that did not fail follows V2 already: the shared set (sketched by whichever
     * holder came second) and its own rows */
    expect_same_planes(&a, a.seq, &b, b.seq, "the parent after the failed refit");
    cr_assert_eq(kvt_ctx_refit_recall_basis(a.ctx, 0, V2, RB, 0, NULL), KVT_OK, "%s",
                 kvt_last_error());
    expect_same_planes(&a, a.seq, &b, b.seq, "the parent after the second call");
    expect_same_planes(&a, ca, &b, cb, "the child after the second call");
    kvt_layer_stats sa = {.struct_size = sizeof sa}, sc = sa;
    cr_assert_eq(kvt_seq_layer_stats(a.seq, 0, &sa), KVT_OK);
    cr_assert_eq(kvt_seq_layer_stats(ca, 0, &sc), KVT_OK);
    cr_assert_eq(sa.recall_phase, 0);
    cr_assert_eq(sc.recall_phase, 0);
    kvt_seq_destroy(ca);
    kvt_seq_destroy(cb);
    rig_close(&a);
    rig_close(&b);
}
