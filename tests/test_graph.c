/*
 * test_graph.c — planned steps (kvt_batch_plan_device) and their capture. Two twins of the same
 * three requests (the same rows, step by step) on one backend: the eager twin runs every layer
 * of every step; the graph twin, on each step its plan_device finds plannable, replays one
 * recording of the runs of its first planned step (kvt__backend_ops.capture_begin on the
 * batch's backend: the CPU backends record the planned packs, the CUDA backend makes a CUDA
 * graph), and runs the others (a block close or an eviction round due) eagerly. Over 170 steps,
 * more than 100 of them replays, both twins emit the same sets on every layer (TOKENS on the
 * salience layer, CSR on the eviction one) and keep every invariant. Refusals: an unplanned run
 * inside a capture, plan_device at the wrong time or with a bad emission, a run with another
 * emission, drafts.
 */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "lib/handles.h"
#include "support/testutil.h"

#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

enum { NQ = 3, NL = 2, TOPK = 512, STEPS = 170, SEED = 0x9a4f };
static const uint32_t PROMPT[NQ] = {100, 131, 77};

typedef struct twin {
    kvt_ctx *ctx;
    kvt_seq *seq[NQ];
    kvt_batch *b;
    kvt_buffer *idx[NL], *len[NL]; /* layer 0 TOKENS (lengths), layer 1 CSR (indptr) */
    kvt_emit e[NL];
    uint64_t pos[NQ]; /* rows written so far */
} twin;

static kvt_model *model(void) {
    kvt_layer_spec s[NL];
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[0]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 16, &s[1]), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, NL, "graph", &m, NULL, 0), KVT_OK);
    return m;
}

/* The twin's context on backend k (false: not available here, with why). */
static bool twin_open(twin *t, kvt_model *m, kvt_backend_kind k, char *why, size_t why_len) {
    memset(t, 0, sizeof *t);
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 8;
    c.evict_budget_rows = 64;
    c.recent_rows = 8;
    c.cadence_rows = 32;
    c.evict_archive = true;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 256;
    p.backend = k;
    if (kvt_ctx_create(&p, &t->ctx, why, why_len) != KVT_OK)
        return false;
    for (uint32_t i = 0; i < NQ; i++)
        cr_assert_eq(tu_seq_create(t->ctx, 10 + i, &t->seq[i]), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_create(t->ctx, NQ, &t->b), KVT_OK);
    const size_t n_idx[NL] = {sizeof(int32_t) * NQ * TOPK, sizeof(int32_t) * NQ * TOPK};
    const size_t n_len[NL] = {sizeof(int32_t) * NQ, sizeof(int32_t) * (NQ + 1)};
    for (uint32_t l = 0; l < NL; l++) {
        cr_assert_eq(kvt_buffer_alloc(t->ctx, n_idx[l], &t->idx[l]), KVT_OK);
        cr_assert_eq(kvt_buffer_alloc(t->ctx, n_len[l], &t->len[l]), KVT_OK);
        t->e[l] = (kvt_emit){.struct_size = sizeof(kvt_emit),
                             .layout = l == 0 ? KVT_EMIT_TOKENS : KVT_EMIT_CSR,
                             .indices = kvt_buffer_ptr(t->idx[l]),
                             .capacity = l == 0 ? TOPK : NQ * TOPK};
        if (l == 0)
            t->e[l].lengths = kvt_buffer_ptr(t->len[l]);
        else
            t->e[l].indptr = kvt_buffer_ptr(t->len[l]);
    }
    return true;
}

static void twin_close(twin *t) {
    for (uint32_t l = 0; l < NL; l++) {
        kvt_buffer_free(t->idx[l]);
        kvt_buffer_free(t->len[l]);
    }
    kvt_batch_destroy(t->b);
    for (uint32_t i = 0; i < NQ; i++)
        kvt_seq_destroy(t->seq[i]);
    kvt_ctx_destroy(t->ctx);
}

/* Reserve n[i] tokens per request, write their rows (the same bytes in both twins), plan. */
static void step_begin(twin *t, const uint32_t *n) {
    cr_assert_eq(kvt_batch_reserve(t->b, t->seq, n, NQ), KVT_OK, "%s", kvt_last_error());
    uint8_t mla[1152], kv[64];
    for (uint32_t i = 0; i < NQ; i++)
        for (uint32_t r = 0; r < n[i]; r++, t->pos[i]++) {
            const uint64_t seed = SEED + i;
            tu_row_bytes(mla, sizeof mla, 0, 0, t->pos[i], seed);
            cr_assert_eq(kvt_seq_write(t->seq[i], 0, 0, r, 1, mla, sizeof mla), KVT_OK);
            for (uint32_t pl = 0; pl < 2; pl++) {
                tu_row_bytes(kv, sizeof kv, 1, pl, t->pos[i], seed);
                cr_assert_eq(kvt_seq_write(t->seq[i], 1, pl, r, 1, kv, sizeof kv), KVT_OK);
            }
        }
    cr_assert_eq(kvt_batch_plan(t->b), KVT_OK);
}

static void run_eager(twin *t, void *stream) {
    for (uint32_t l = 0; l < NL; l++)
        cr_assert_eq(kvt_batch_run(t->b, l, NULL, stream, &t->e[l]), KVT_OK, "layer %u: %s", l,
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
    for (uint32_t l = 0; l < NL; l++) {
        read_sets(a, l, &x);
        read_sets(g, l, &y);
        if (l == 0) { /* TOKENS: lengths, then each row up to topk (-1 padded) */
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

/* The whole scenario on backend k; stream: the CUDA stream (NULL on the CPU backends). */
static void graph_equals_eager(kvt_backend_kind k, void *stream) {
    kvt_model *m = model();
    twin a, g;
    char why[256] = "";
    if (!twin_open(&a, m, k, why, sizeof why)) {
        kvt_model_destroy(m);
        if (getenv("KVT_REQUIRE_GPU"))
            cr_assert_fail("KVT_REQUIRE_GPU set but the context did not open: %s", why);
        cr_skip_test("backend unavailable: %s", why);
    }
    cr_assert(twin_open(&g, m, k, why, sizeof why), "%s", why);
    kvt__backend *be = kvt__batch_backend(g.b);
    cr_assert(be->ops->capture_begin && be->ops->capture_end && be->ops->graph_launch);
    void *graph = NULL;
    uint32_t replays = 0, eager = 0;
    for (uint32_t step = 0; step <= STEPS; step++) {
        uint32_t n[NQ];
        for (uint32_t i = 0; i < NQ; i++)
            n[i] = step == 0 ? PROMPT[i] : 1;
        step_begin(&a, n);
        step_begin(&g, n);
        run_eager(&a, stream);
        bool planned = false;
        cr_assert_eq(kvt_batch_plan_device(g.b, g.e, NL, stream, &planned), KVT_OK, "%s",
                     kvt_last_error());
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
    }
    cr_log_info("%s: %u replays, %u eager steps", kvt_ctx_backend_name(g.ctx), replays, eager);
    cr_assert_geq(replays, 100, "%u replays, %u eager steps", replays, eager);
    cr_assert_geq(eager, 5, "closes and rounds ran eagerly: %u", eager);
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

Test(graph, replays_equal_eager_steps_guarded, .timeout = 240) {
    graph_equals_eager(KVT_BACKEND_GUARDED, NULL);
}

Test(graph, replays_equal_eager_steps_cpu, .timeout = 240) {
    graph_equals_eager(KVT_BACKEND_CPU, NULL);
}

/* On a device: a real CUDA graph over a non-blocking stream (skips without one). */
Test(graph, replays_equal_eager_steps_cuda, .timeout = 240) {
#if KVT_HAVE_CUDA
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        if (getenv("KVT_REQUIRE_GPU"))
            cr_assert_fail("KVT_REQUIRE_GPU set but no CUDA stream could be made");
        cr_skip_test("no CUDA device: no stream to capture");
    }
    graph_equals_eager(KVT_BACKEND_CUDA, s);
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
