/*
 * test_graph.c — planned steps (kvt_batch_plan_device) and their capture. Two twins of the same
 * three requests (the same rows, step by step) on one backend: the eager twin runs every layer
 * of every step; the graph twin, on each step its plan_device finds plannable, replays one
 * recording of the runs of its first planned step (kvt__backend_ops.capture_begin on the
 * batch's backend: the CPU backends record the planned packs, the CUDA backend makes a CUDA
 * graph), and runs the others (a block close or an eviction round due) eagerly. Over 170 steps,
 * more than 100 of them replays, both twins emit the same sets on every layer (TOKENS on the
 * salience layer, CSR on the eviction one) and keep every invariant. With recall on the salience
 * layer (a context with sketch planes and max_rows_per_seq), the recording holds the planned
 * recall step too: conformal (calibration steps dense, then fetches, TOKENS) and margin with
 * promotion (CSR, whose offsets follow the device's counts) replay the eager twin's sets, dense
 * flags and recall counters with the same queries. Refusals: an unplanned run inside a capture,
 * plan_device at the wrong time or with a bad emission, a run with another emission, drafts, a
 * planned recall run without its query; a lagged query plans (its replays equal the eager
 * twin's, queries aimed every step).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "lib/handles.h"
#include "support/testutil.h"

#include "support/tu_cuda.h"

enum { NQ = 3, NL = 2, TOPK = 512, STEPS = 170, SEED = 0x9a4f };
enum { QH = 4, QD = 576, RB = 16 }; /* the salience layer's query heads, query floats, basis */
static const uint32_t PROMPT[NQ] = {100, 131, 77};

/* What a scenario turns on: recall on the salience layer (KVT_RECALL_OFF: none, and no sketch
 * planes unless `sketch`), its promotion capacity, layer 0's layout, a lagged query, one
 * emission shared by both layers (TOKENS; plan_device gets n_emits = 1). */
typedef struct scenario {
    kvt_recall_mode recall;
    uint32_t promote;
    kvt_emit_layout layout0;
    bool lagged, shared, sketch;
} scenario;
static const scenario PLAIN = {KVT_RECALL_OFF, 0, KVT_EMIT_TOKENS, false, false, false};
/* Recall on the salience layer: conformal, TOKENS (calibration steps replayed dense, then
 * fetches); margin with promotion, CSR (offsets from the device's counts); conformal with one
 * emission for both layers (the eviction layer's run leaves its own dense flags, 0). */
static const scenario CONFORMAL = {KVT_RECALL_CONFORMAL, 0, KVT_EMIT_TOKENS, false, false, false};
static const scenario MARGIN_PROMOTE = {KVT_RECALL_MARGIN, 8, KVT_EMIT_CSR, false, false, false};
static const scenario SHARED_EMIT = {KVT_RECALL_CONFORMAL, 0, KVT_EMIT_TOKENS, false, true, false};
/* Conformal recall with config.recall_lagged_query: each replayed step scans with the previous
 * step's queries, which the planned op copied into the request's buffer after its step. */
static const scenario LAGGED = {KVT_RECALL_CONFORMAL, 0, KVT_EMIT_TOKENS, true, false, false};

typedef struct twin {
    kvt_ctx *ctx;
    kvt_seq *seq[NQ];
    kvt_batch *b;
    kvt_buffer *idx[NL], *len[NL]; /* layer 0 TOKENS (lengths), layer 1 CSR (indptr) */
    kvt_buffer *dense, *query;     /* layer 0's dense flags [NQ]; queries [NQ][QH][QD] */
    kvt_emit e[NL];
    uint64_t pos[NQ]; /* rows written so far */
    bool recall, shared, lagged;
    tu_rng g;         /* the rows' and queries' draws (the same in both twins) */
    uint8_t *rows;    /* salience rows written, [NQ][MAXR][1152] (recall scenarios) */
} twin;

enum { MAXR = 512 };

static kvt_model *model(void) {
    kvt_layer_spec s[NL];
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[0]), KVT_OK);
    s[0].n_q_heads = QH;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 16, &s[1]), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, NL, "graph", &m, NULL, 0), KVT_OK);
    return m;
}

/* The twin's context on backend k for scenario sc (false: not available here, with why). */
static bool twin_open_sc(twin *t, kvt_model *m, kvt_backend_kind k, const scenario *sc, char *why,
                         size_t why_len) {
    memset(t, 0, sizeof *t);
    t->recall = sc->recall != KVT_RECALL_OFF;
    t->lagged = sc->lagged;
    t->g.s = SEED;
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 8;
    c.evict_budget_rows = 64;
    c.recent_rows = 8;
    c.cadence_rows = 32;
    /* with recall, the eviction layer drops (an archive with sketch planes would recall too,
     * a RoPE recall: not plannable) */
    c.evict_archive = !t->recall;
    c.recall = sc->recall;
    c.recall_margin = 0.5f;
    c.recall_promote_capacity = sc->promote;
    c.recall_promote_hits = 2;
    c.recall_promote_window = 8;
    c.recall_lagged_query = sc->lagged;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 256;
    p.backend = k;
    if (t->recall || sc->sketch) {
        p.recall_sketch_rank = RB;
        p.max_rows_per_seq = MAXR; /* what a planned recall step is sized by */
    }
    if (kvt_ctx_create(&p, &t->ctx, why, why_len) != KVT_OK)
        return false;
    if (t->recall || sc->sketch) {
        static float V[RB * 512];
        tu_rng g = {.s = 77};
        cr_assert(tu_orthonormal_rows(&g, RB, 512, V));
        cr_assert_eq(kvt_ctx_set_recall_basis(t->ctx, 0, V, RB), KVT_OK, "%s", kvt_last_error());
        t->rows = calloc((size_t)NQ * MAXR, 1152);
        cr_assert(t->rows);
        t->recall = true; /* rows kept, queries written: a request may recall */
    }
    for (uint32_t i = 0; i < NQ; i++)
        cr_assert_eq(tu_seq_create(t->ctx, 10 + i, &t->seq[i]), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_create(t->ctx, NQ, &t->b), KVT_OK);
    const size_t n_idx[NL] = {sizeof(int32_t) * NQ * TOPK, sizeof(int32_t) * NQ * TOPK};
    const size_t n_len[NL] = {sizeof(int32_t) * (NQ + 1), sizeof(int32_t) * (NQ + 1)};
    for (uint32_t l = 0; l < NL; l++) {
        cr_assert_eq(kvt_buffer_alloc(t->ctx, n_idx[l], &t->idx[l]), KVT_OK);
        cr_assert_eq(kvt_buffer_alloc(t->ctx, n_len[l], &t->len[l]), KVT_OK);
        const kvt_emit_layout lay = l == 0 ? sc->layout0 : KVT_EMIT_CSR;
        t->e[l] = (kvt_emit){.struct_size = sizeof(kvt_emit),
                             .layout = lay,
                             .indices = kvt_buffer_ptr(t->idx[l]),
                             .capacity = lay == KVT_EMIT_TOKENS ? TOPK : NQ * TOPK};
        if (lay == KVT_EMIT_TOKENS)
            t->e[l].lengths = kvt_buffer_ptr(t->len[l]);
        else
            t->e[l].indptr = kvt_buffer_ptr(t->len[l]);
    }
    cr_assert_eq(kvt_buffer_alloc(t->ctx, NQ, &t->dense), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(t->ctx, sizeof(float) * NQ * QH * QD, &t->query), KVT_OK);
    t->e[0].dense = kvt_buffer_ptr(t->dense);
    if (sc->shared) /* layer 1 writes layer 0's arrays, its dense flags too */
        t->e[1] = t->e[0];
    t->shared = sc->shared;
    return true;
}

static bool twin_open(twin *t, kvt_model *m, kvt_backend_kind k, char *why, size_t why_len) {
    return twin_open_sc(t, m, k, &PLAIN, why, why_len);
}

static void twin_close(twin *t) {
    for (uint32_t l = 0; l < NL; l++) {
        kvt_buffer_free(t->idx[l]);
        kvt_buffer_free(t->len[l]);
    }
    kvt_buffer_free(t->dense);
    kvt_buffer_free(t->query);
    free(t->rows);
    kvt_batch_destroy(t->b);
    for (uint32_t i = 0; i < NQ; i++)
        kvt_seq_destroy(t->seq[i]);
    kvt_ctx_destroy(t->ctx);
}

/* A salience row with Gaussian latent and branch (recall scenarios: scores spread). */
static void recall_row(twin *t, uint8_t *row) {
    for (uint32_t d = 0; d < 512; d++)
        kvt__store_elem(row, KVT__DT_BF16, d, (float)(0.2 * tu_normal(&t->g)));
    for (uint32_t d = 0; d < 64; d++)
        kvt__store_elem(row + 1024, KVT__DT_BF16, d, (float)(0.2 * tu_normal(&t->g)));
}

/* The step's queries into the twin's buffer: noise, and every 4th step, for each request, its
 * heads aimed at an older row (likely archived: the trigger should fetch it). */
static void write_queries(twin *t, uint32_t step) {
    static float q[NQ * QH * QD];
    for (uint32_t i = 0; i < NQ; i++)
        for (uint32_t h = 0; h < QH; h++) {
            float *qh = q + ((size_t)i * QH + h) * QD;
            for (uint32_t d = 0; d < QD; d++)
                qh[d] = (float)(0.05 * tu_normal(&t->g));
            /* aimed at a random early row every 4th step (a lagged query: every step, so a step
             * that scanned with its own queries instead of the previous step's would fire
             * other rows) */
            if ((t->lagged || step % 4 == 0) && t->pos[i] > 80) {
                const uint64_t u = 8 + tu_next(&t->g) % (t->pos[i] - 72);
                const uint8_t *row = t->rows + ((size_t)i * MAXR + u) * 1152;
                for (uint32_t d = 0; d < 512; d++)
                    qh[d] += 3.0f * kvt__load_elem(row, KVT__DT_BF16, d);
                for (uint32_t d = 0; d < 64; d++)
                    qh[512 + d] += 3.0f * kvt__load_elem(row + 1024, KVT__DT_BF16, d);
            }
        }
    cr_assert_eq(kvt_buffer_write(t->query, 0, q, sizeof q), KVT_OK);
}

/* Reserve n[i] tokens per request, write their rows (the same bytes in both twins), plan. */
static void step_begin(twin *t, const uint32_t *n) {
    cr_assert_eq(kvt_batch_reserve(t->b, t->seq, n, NQ), KVT_OK, "%s", kvt_last_error());
    uint8_t mla[1152], kv[64];
    for (uint32_t i = 0; i < NQ; i++)
        for (uint32_t r = 0; r < n[i]; r++, t->pos[i]++) {
            const uint64_t seed = SEED + i;
            if (t->recall) {
                recall_row(t, mla);
                memcpy(t->rows + ((size_t)i * MAXR + t->pos[i]) * 1152, mla, sizeof mla);
            } else {
                tu_row_bytes(mla, sizeof mla, 0, 0, t->pos[i], seed);
            }
            cr_assert_eq(kvt_seq_write(t->seq[i], 0, 0, r, 1, mla, sizeof mla), KVT_OK);
            for (uint32_t pl = 0; pl < 2; pl++) {
                tu_row_bytes(kv, sizeof kv, 1, pl, t->pos[i], seed);
                cr_assert_eq(kvt_seq_write(t->seq[i], 1, pl, r, 1, kv, sizeof kv), KVT_OK);
            }
        }
    cr_assert_eq(kvt_batch_plan(t->b), KVT_OK);
}

static void run_eager(twin *t, void *stream) {
    const void *q = t->recall ? kvt_buffer_ptr(t->query) : NULL;
    for (uint32_t l = 0; l < NL; l++)
        cr_assert_eq(kvt_batch_run(t->b, l, q, stream, &t->e[l]), KVT_OK, "layer %u: %s", l,
                     kvt_last_error());
}

static void commit_checked(twin *t) {
    cr_assert_eq(kvt_batch_commit(t->b, NULL), KVT_OK, "%s", kvt_last_error());
    for (uint32_t i = 0; i < NQ; i++)
        cr_assert_eq(kvt_seq_check(t->seq[i]), KVT_OK, "seqs[%u]: %s", i, kvt_last_error());
}

/* The emitted sets of layer l (read back through the buffers). */
typedef struct sets {
    int32_t idx[NQ * TOPK], len[NQ + 1];
} sets;

static void read_sets(twin *t, uint32_t l, sets *s) {
    cr_assert_eq(kvt_buffer_read(t->idx[l], 0, s->idx, sizeof s->idx), KVT_OK);
    cr_assert_eq(kvt_buffer_read(t->len[l], 0, s->len, kvt_buffer_size(t->len[l])), KVT_OK);
}

static void same_sets(twin *a, twin *g, uint32_t step) {
    static sets x, y;
    uint8_t da[NQ], dg[NQ];
    cr_assert_eq(kvt_buffer_read(a->dense, 0, da, NQ), KVT_OK);
    cr_assert_eq(kvt_buffer_read(g->dense, 0, dg, NQ), KVT_OK);
    cr_assert_eq(memcmp(da, dg, NQ), 0, "step %u: dense flags", step);
    for (uint32_t l = 0; l < (a->shared ? 1u : NL); l++) { /* shared: the last run's sets */
        read_sets(a, l, &x);
        read_sets(g, l, &y);
        if (a->e[l].layout == KVT_EMIT_TOKENS) { /* lengths, then each row up to topk (-1) */
            cr_assert_eq(memcmp(x.len, y.len, sizeof(int32_t) * NQ), 0, "step %u: lengths", step);
            cr_assert_eq(memcmp(x.idx, y.idx, sizeof x.idx), 0, "step %u: TOKENS indices", step);
            for (uint32_t i = 0; i < NQ; i++)
                cr_assert_gt(x.len[i], 0);
        } else { /* CSR: offsets, then the listed slots */
            cr_assert_eq(memcmp(x.len, y.len, sizeof(int32_t) * (NQ + 1)), 0, "step %u: indptr",
                         step);
            cr_assert_eq(memcmp(x.idx, y.idx, sizeof(int32_t) * (size_t)x.len[NQ]), 0,
                         "step %u: CSR indices", step);
        }
    }
}

/* Layer 0's recall counters of request i. */
static kvt_layer_stats recall_stats(twin *t, uint32_t i) {
    kvt_layer_stats x = {.struct_size = sizeof x};
    cr_assert_eq(kvt_seq_layer_stats(t->seq[i], 0, &x), KVT_OK, "%s", kvt_last_error());
    return x;
}

/* The whole scenario on backend k; stream: the CUDA stream (NULL on the CPU backends). */
static void graph_equals_eager_sc(kvt_backend_kind k, void *stream, const scenario *sc) {
    kvt_model *m = model();
    twin a, g;
    char why[256] = "";
    if (!twin_open_sc(&a, m, k, sc, why, sizeof why)) {
        kvt_model_destroy(m);
        if (getenv("KVT_REQUIRE_GPU"))
            cr_assert_fail("KVT_REQUIRE_GPU set but the context did not open: %s", why);
        cr_skip_test("backend unavailable: %s", why);
    }
    cr_assert(twin_open_sc(&g, m, k, sc, why, sizeof why), "%s", why);
    kvt__backend *be = kvt__batch_backend(g.b);
    cr_assert(be->ops->capture_begin && be->ops->capture_end && be->ops->graph_launch);
    void *graph = NULL;
    uint32_t replays = 0, eager = 0, replay_fetch = 0, replay_dense = 0;
    for (uint32_t step = 0; step <= STEPS; step++) {
        uint32_t n[NQ];
        for (uint32_t i = 0; i < NQ; i++)
            n[i] = step == 0 ? PROMPT[i] : 1;
        step_begin(&a, n);
        step_begin(&g, n);
        if (a.recall) {
            write_queries(&a, step);
            write_queries(&g, step);
        }
        run_eager(&a, stream);
        bool planned = false;
        cr_assert_eq(kvt_batch_plan_device(g.b, g.e, g.shared ? 1 : NL, stream, &planned),
                     KVT_OK, "%s", kvt_last_error());
        if (planned && !graph) { /* the recording: nothing runs until it is launched */
            cr_assert_eq(be->ops->capture_begin(be, stream), KVT_OK);
            run_eager(&g, stream);
            cr_assert_eq(be->ops->capture_end(be, stream, &graph), KVT_OK);
        }
        if (planned) {
            cr_assert_eq(be->ops->graph_launch(be, graph, stream), KVT_OK);
            replays++;
        } else {
            run_eager(&g, stream);
            eager++;
        }
#if KVT_HAVE_CUDA
        if (stream)
            cr_assert_eq(cudaStreamSynchronize((cudaStream_t)stream), cudaSuccess);
#endif
        same_sets(&a, &g, step);
        commit_checked(&a);
        commit_checked(&g);
        for (uint32_t i = 0; planned && g.recall && i < NQ; i++) {
            const kvt_layer_stats x = recall_stats(&g, i);
            replay_fetch += x.recall_last_fired > 0 && !x.recall_last_dense;
            replay_dense += x.recall_last_dense;
        }
    }
    cr_log_info("%s: %u replays, %u eager steps; replayed recall steps: %u fetched, %u dense",
                kvt_ctx_backend_name(g.ctx), replays, eager, replay_fetch, replay_dense);
    cr_assert_geq(replays, 100, "%u replays, %u eager steps", replays, eager);
    cr_assert_geq(eager, 5, "closes and rounds ran eagerly: %u", eager);
    if (g.recall) { /* the replays recalled, and both twins' triggers counted the same */
        cr_assert_geq(replay_fetch, 10, "replayed steps that fetched rows: %u", replay_fetch);
        if (sc->recall == KVT_RECALL_CONFORMAL)
            cr_assert_geq(replay_dense, 1, "replayed calibration steps: %u", replay_dense);
        uint64_t promoted = 0;
        for (uint32_t i = 0; i < NQ; i++) {
            const kvt_layer_stats x = recall_stats(&a, i), y = recall_stats(&g, i);
            cr_assert_eq(x.recall_steps, y.recall_steps);
            cr_assert_eq(x.recall_calib_steps, y.recall_calib_steps);
            cr_assert_eq(x.recall_overflow_steps, y.recall_overflow_steps);
            cr_assert_eq(x.recall_fired_rows, y.recall_fired_rows);
            cr_assert_eq(x.recall_fetched_rows, y.recall_fetched_rows);
            cr_assert_eq(x.recall_z, y.recall_z);
            cr_assert_eq(x.recall_last_lagged, sc->lagged, "request %u: lagged %d", i,
                         (int)x.recall_last_lagged);
            cr_assert_eq(y.recall_last_lagged, sc->lagged);
            cr_assert_eq(x.recall_promotions, y.recall_promotions);
            cr_assert_eq(x.recall_demotions, y.recall_demotions);
            cr_assert_gt(y.recall_steps, STEPS / 2);
            promoted += y.recall_promotions;
        }
        if (sc->promote)
            cr_assert_gt(promoted, 0, "no row was promoted");
    }
    /* the twins end in the same state: every layer's counters */
    for (uint32_t i = 0; i < NQ; i++)
        for (uint32_t l = 0; l < NL; l++) {
            kvt_layer_stats x = {.struct_size = sizeof x}, y = {.struct_size = sizeof y};
            cr_assert_eq(kvt_seq_layer_stats(a.seq[i], l, &x), KVT_OK);
            cr_assert_eq(kvt_seq_layer_stats(g.seq[i], l, &y), KVT_OK);
            cr_assert_eq(x.attended_rows, y.attended_rows);
            cr_assert_eq(x.archived_rows, y.archived_rows);
        }
    be->ops->graph_free(be, graph);
    twin_close(&a);
    twin_close(&g);
    kvt_model_destroy(m);
}

static void graph_equals_eager(kvt_backend_kind k, void *stream) {
    graph_equals_eager_sc(k, stream, &PLAIN);
}


Test(graph, recall_replays_equal_eager_steps_guarded, .timeout = 240) {
    graph_equals_eager_sc(KVT_BACKEND_GUARDED, NULL, &CONFORMAL);
}

Test(graph, recall_replays_equal_eager_steps_cpu, .timeout = 240) {
    graph_equals_eager_sc(KVT_BACKEND_CPU, NULL, &CONFORMAL);
}

Test(graph, recall_promotion_csr_replays_equal_eager_steps_guarded, .timeout = 240) {
    graph_equals_eager_sc(KVT_BACKEND_GUARDED, NULL, &MARGIN_PROMOTE);
}

Test(graph, recall_promotion_csr_replays_equal_eager_steps_cpu, .timeout = 240) {
    graph_equals_eager_sc(KVT_BACKEND_CPU, NULL, &MARGIN_PROMOTE);
}

Test(graph, recall_shared_emission_replays_equal_eager_steps_guarded, .timeout = 240) {
    graph_equals_eager_sc(KVT_BACKEND_GUARDED, NULL, &SHARED_EMIT);
}

Test(graph, recall_lagged_query_replays_equal_eager_steps_guarded, .timeout = 240) {
    graph_equals_eager_sc(KVT_BACKEND_GUARDED, NULL, &LAGGED);
}

Test(graph, recall_lagged_query_replays_equal_eager_steps_cpu, .timeout = 240) {
    graph_equals_eager_sc(KVT_BACKEND_CPU, NULL, &LAGGED);
}

Test(graph, replays_equal_eager_steps_guarded, .timeout = 240) {
    graph_equals_eager(KVT_BACKEND_GUARDED, NULL);
}

Test(graph, replays_equal_eager_steps_cpu, .timeout = 240) {
    graph_equals_eager(KVT_BACKEND_CPU, NULL);
}

/* On a device: a real CUDA graph over a non-blocking stream (skips without one). */
Test(graph, replays_equal_eager_steps_cuda, .timeout = 240) {
#if KVT_HAVE_CUDA
    cudaStream_t s = tu_cuda_stream();
    graph_equals_eager(KVT_BACKEND_CUDA, s);
    graph_equals_eager_sc(KVT_BACKEND_CUDA, s, &CONFORMAL);
    graph_equals_eager_sc(KVT_BACKEND_CUDA, s, &LAGGED);
    graph_equals_eager_sc(KVT_BACKEND_CUDA, s, &MARGIN_PROMOTE);
    graph_equals_eager_sc(KVT_BACKEND_CUDA, s, &SHARED_EMIT);
    cudaStreamDestroy(s);
    /* a failure of the device runtime comes back with its own words */
    kvt_model *m = model();
    twin t;
    char why[256] = "";
    cr_assert(twin_open(&t, m, KVT_BACKEND_CUDA, why, sizeof why), "%s", why);
    kvt_buffer *huge = NULL;
    cr_assert_eq(kvt_buffer_alloc(t.ctx, (size_t)1 << 52, &huge), KVT_ERR_OUT_OF_MEMORY);
    cr_assert(strstr(kvt_last_error(), "cudaErrorMemoryAllocation") != NULL, "%s",
              kvt_last_error());
    twin_close(&t);
    kvt_model_destroy(m);
#else
    if (getenv("KVT_REQUIRE_GPU"))
        cr_assert_fail("KVT_REQUIRE_GPU set in a build without CUDA");
    cr_skip_test("built without CUDA");
#endif
}

/* Refusals, and nothing half-planned. */
Test(graph, plan_device_refusals) {
    kvt_model *m = model();
    twin t;
    char why[256] = "";
    cr_assert(twin_open(&t, m, KVT_BACKEND_GUARDED, why, sizeof why), "%s", why);
    bool planned = true;
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_ERR_BAD_STATE);
    cr_assert(!planned);
    uint32_t n[NQ] = {PROMPT[0], PROMPT[1], PROMPT[2]};
    step_begin(&t, n);
    /* the prompt step closes blocks: not plannable, and an unplanned run cannot be captured */
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK);
    cr_assert(!planned);
    kvt__backend *be = kvt__batch_backend(t.b);
    cr_assert_eq(be->ops->capture_begin(be, NULL), KVT_OK);
    cr_assert_eq(be->ops->capture_begin(be, NULL), KVT_ERR_BAD_STATE);
    cr_assert_neq(kvt_batch_run(t.b, 0, NULL, NULL, &t.e[0]), KVT_OK);
    void *graph = (void *)1;
    cr_assert_eq(be->ops->capture_end(be, NULL, &graph), KVT_ERR_BAD_STATE);
    cr_assert_null(graph);
    cr_assert_eq(be->ops->capture_end(be, NULL, &graph), KVT_ERR_BAD_STATE);
    /* a planned pack the guard refuses (its plan in host memory) voids the capture too */
    static kvt__pack_query host_plan[NQ];
    static uint32_t host_n;
    kvt__pack_args hp = {.q_plan = host_plan, .n_plan = &host_n, .n_max = NQ,
                         .capacity = TOPK, .indices = t.e[0].indices, .lengths = t.e[0].lengths};
    cr_assert_eq(be->ops->capture_begin(be, NULL), KVT_OK);
    cr_assert_eq(be->ops->pack(be, &hp, NULL), KVT_ERR_INVARIANT);
    cr_assert_eq(be->ops->capture_end(be, NULL, &graph), KVT_ERR_BAD_STATE);
    cr_assert_null(graph);
    run_eager(&t, NULL); /* the failed run left the step runnable */
    commit_checked(&t);
    for (uint32_t i = 0; i < NQ; i++)
        n[i] = 1;
    step_begin(&t, n);
    kvt_emit bad = t.e[0];
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, 3, NULL, &planned), KVT_ERR_INVALID_ARGUMENT);
    bad.layout = KVT_EMIT_CSR_KV_HEADS;
    cr_assert_eq(kvt_batch_plan_device(t.b, &bad, 1, NULL, &planned), KVT_ERR_INVALID_ARGUMENT);
    bad = t.e[0];
    bad.queries_per_seq = 2;
    cr_assert_eq(kvt_batch_plan_device(t.b, &bad, 1, NULL, &planned), KVT_ERR_INVALID_ARGUMENT);
    bad = t.e[0];
    bad.capacity = 8; /* fewer than the rows attended */
    cr_assert_eq(kvt_batch_plan_device(t.b, &bad, 1, NULL, &planned), KVT_ERR_CAPACITY);
    cr_assert(!planned);
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert(planned);
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_ERR_BAD_STATE);
    /* a run must pass the emission it was planned for */
    cr_assert_eq(kvt_batch_run(t.b, 0, NULL, NULL, &t.e[1]), KVT_ERR_INVALID_ARGUMENT);
    run_eager(&t, NULL);
    commit_checked(&t);
    /* a request destroyed after plan_device: the plan is rewritten, its set empty, the others
     * where an eager run puts them (its pages are back in the pool) */
    for (uint32_t i = 0; i < NQ; i++)
        n[i] = 1;
    step_begin(&t, n);
    /* later planned steps pass the first one's emissions (a graph writes those arrays) */
    kvt_emit other[NL] = {t.e[0], t.e[1]};
    other[0].capacity = TOPK - 1;
    cr_assert_eq(kvt_batch_plan_device(t.b, other, NL, NULL, &planned), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(!planned);
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK);
    cr_assert(planned);
    kvt_seq_destroy(t.seq[1]);
    t.seq[1] = NULL;
    run_eager(&t, NULL);
    static sets got;
    read_sets(&t, 0, &got);
    cr_assert_eq(got.len[1], 0, "the destroyed request attends nothing");
    for (uint32_t j = 0; j < TOPK; j++)
        cr_assert_eq(got.idx[TOPK + j], -1);
    cr_assert_gt(got.len[0], 0);
    cr_assert_gt(got.len[2], 0);
    read_sets(&t, 1, &got);
    cr_assert_eq(got.len[2] - got.len[1], 0, "CSR: the destroyed request's list is empty");
    cr_assert_eq(kvt_batch_commit(t.b, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(tu_seq_create(t.ctx, 77, &t.seq[1]), KVT_OK);
    /* drafts: the commit may reject rows, so nothing is planned */
    const uint32_t drafts[NQ] = {0, 1, 0};
    n[1] = 2;
    cr_assert_eq(kvt_batch_reserve_drafts(t.b, t.seq, n, drafts, NQ), KVT_OK);
    cr_assert_eq(kvt_batch_plan(t.b), KVT_OK);
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK);
    cr_assert(!planned);
    cr_assert_eq(be->ops->capture_begin(be, NULL), KVT_OK); /* never ended: destroy frees it */
    kvt_batch_destroy(t.b); /* abandoned before any run */
    t.b = NULL;
    for (uint32_t i = 0; i < NQ; i++)
        cr_assert_eq(kvt_seq_check(t.seq[i]), KVT_OK, "%s", kvt_last_error());
    twin_close(&t);
    kvt_model_destroy(m);
}

/* A planned step on a layer that plans recall: its run needs the query (a graph replays the
 * recall step over steps that recall); a lagged query plans too (the planned op copies the
 * step's queries into the request's buffer). */
/* Twin t on the guarded backend for sc, its prompt step committed and a decode step begun
 * (rows and queries written, planned on the host). */
static void open_at_decode(twin *t, kvt_model *m, const scenario *sc) {
    char why[256] = "";
    cr_assert(twin_open_sc(t, m, KVT_BACKEND_GUARDED, sc, why, sizeof why), "%s", why);
    uint32_t n[NQ] = {PROMPT[0], PROMPT[1], PROMPT[2]};
    step_begin(t, n);
    run_eager(t, NULL);
    commit_checked(t);
    for (uint32_t i = 0; i < NQ; i++)
        n[i] = 1;
    step_begin(t, n);
    write_queries(t, 1);
}

Test(graph, recall_plan_refusals) {
    kvt_model *m = model();
    twin t;
    open_at_decode(&t, m, &CONFORMAL);
    bool planned = false;
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert(planned, "a decode step with recall and nothing due is plannable");
    cr_assert_eq(kvt_batch_run(t.b, 0, NULL, NULL, &t.e[0]), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "query is NULL") != NULL, "%s", kvt_last_error());
    run_eager(&t, NULL); /* the refused run changed nothing */
    commit_checked(&t);
    for (uint32_t i = 0; i < NQ; i++)
        cr_assert_eq(recall_stats(&t, i).recall_steps, 1);
    twin_close(&t);
    const scenario lagged = {KVT_RECALL_CONFORMAL, 0, KVT_EMIT_TOKENS, true, false, false};
    open_at_decode(&t, m, &lagged);
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK);
    cr_assert(planned, "a lagged query is plannable");
    run_eager(&t, NULL);
    commit_checked(&t);
    twin_close(&t);
    kvt_model_destroy(m);
}

/* Which layers plan recall follows the context and is fixed with a batch's plan: with sketch
 * planes but recall off, a planned run needs no query; once a request with recall on exists, a
 * batch planned before it does not plan its recalling steps (they run eagerly), and a new
 * batch plans them (its runs then take the query). */
Test(graph, recall_planning_follows_the_context) {
    kvt_model *m = model();
    twin t;
    const scenario off = {KVT_RECALL_OFF, 0, KVT_EMIT_TOKENS, false, false, true};
    open_at_decode(&t, m, &off);
    bool planned = false;
    cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert(planned);
    for (uint32_t l = 0; l < NL; l++) /* no request can recall: no query needed */
        cr_assert_eq(kvt_batch_run(t.b, l, NULL, NULL, &t.e[l]), KVT_OK, "%s", kvt_last_error());
    commit_checked(&t);
    /* a request with recall on takes request 2's place */
    kvt_seq_destroy(t.seq[2]);
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 99;
    sp.recall = KVT_RECALL_MARGIN;
    cr_assert_eq(kvt_seq_create(t.ctx, &sp, &t.seq[2]), KVT_OK, "%s", kvt_last_error());
    uint32_t n[NQ] = {1, 1, PROMPT[2]};
    t.pos[2] = 0;
    step_begin(&t, n);
    run_eager(&t, NULL);
    commit_checked(&t);
    for (uint32_t i = 0; i < NQ; i++)
        n[i] = 1;
    /* 8 steps on the old batch: none planned (its plan holds no recall step); then 8 on a new
     * one, which lays its plan out with the recall step: the steps without a close or round
     * planned, their runs taking the query */
    uint32_t old_planned = 0, new_planned = 0;
    for (uint32_t k = 0; k < 16; k++) {
        if (k == 8) {
            kvt_batch_destroy(t.b);
            cr_assert_eq(kvt_batch_create(t.ctx, NQ, &t.b), KVT_OK);
        }
        step_begin(&t, n);
        write_queries(&t, 2 + k);
        cr_assert_eq(kvt_batch_plan_device(t.b, t.e, NL, NULL, &planned), KVT_OK, "%s",
                     kvt_last_error());
        if (planned)
            cr_assert_eq(kvt_batch_run(t.b, 0, NULL, NULL, &t.e[0]), KVT_ERR_INVALID_ARGUMENT,
                         "a planned recall run without its query");
        *(k < 8 ? &old_planned : &new_planned) += planned;
        run_eager(&t, NULL);
        commit_checked(&t);
    }
    cr_assert_eq(old_planned, 0, "the old batch planned a recalling step");
    cr_assert_geq(new_planned, 4, "the new batch planned %u of 8 steps", new_planned);
    cr_assert_eq(recall_stats(&t, 2).recall_steps, 16);
    twin_close(&t);
    kvt_model_destroy(m);
}
