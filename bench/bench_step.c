/*
 * bench_step.c — what kvtier adds to a decode step of a batch, per step, on a chosen backend:
 * NS requests at N rows of context, NL MLA NoPE salience layers, one token each per step (no
 * block closes in the timed steps). Three ways of running the same steps, side by side:
 *   eager    kvt_batch_plan, kvt_batch_run per layer, kvt_batch_commit;
 *   planned  the same with kvt_batch_plan_device before the runs (each run one planned pack);
 *   graph    (CUDA only) kvt_batch_plan_device, then one CUDA graph captured over the runs of
 *            the first planned step, launched every step (the engine's way).
 * Untimed: the scheduler's reserve and the forward's row writes. A window runs W steps of each
 * way, interleaved step by step (the tail grows with each step: every way sees the same
 * lengths), the stream synchronised after each step (included); the figure is per step, the
 * range over R windows. Beside it, measured in the same run: memcpy of the bytes the step emits
 * (NL x NS x topk int32), and the floor of a dense decode attention over every row — reading
 * each row's 1152 bytes once per layer and request, taken as half a copy of them (a copy reads
 * and writes each byte; device-to-device on CUDA, memcpy on the host; no dense attention can
 * read less), beside the same floor for the rows kvtier's set attends: the step's cost plus
 * that, against the dense floor, is the most kvtier can save per step.
 * `recall`: recall on every layer (margin mode, δ = 1, sketch planes of rank 16, QH = 8 query
 * heads; queries written once, each head aimed at one of the prefill block's rows, which the
 * context holds N / 4096 times): each step's planned runs hold the planned recall step (the
 * graph way captures it too); the mean rows fired per step is printed.
 * Usage: bench_step [cpu|guarded|cuda] [R] [N] [NS] [recall]
 *        bench_step [cpu|guarded|cuda] decode [R] [largest k rows] [T] [16|8|both] [data]
 * The second form is issue 34's decode step of one absorbed-MLA layer with recall, against a
 * dense attention on the same device (bench_step_decode.h).
 */
#include "kvtier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

enum { NL = 8, W = 200, MAXL = NL, QH = 8, QD = 576 };

static void die(kvt_status s, const char *what) {
    fprintf(stderr, "bench_step: %s: %s (%s)\n", what, kvt_status_name(s), kvt_last_error());
    exit(1);
}

typedef struct rig {
    kvt_ctx *ctx;
    kvt_seq **seqs;
    kvt_batch *b;
    uint32_t ns, topk;
    kvt_buffer *idx[MAXL], *len[MAXL];
    kvt_emit e[MAXL];
    uint8_t *row;
    uint32_t *ones;
    kvt_buffer *query; /* recall: [NS][QH][QD] fp32 (NULL without recall) */
} rig;

static void step_begin(rig *r) {
    kvt_status s = kvt_batch_reserve(r->b, r->seqs, r->ones, r->ns);
    if (s)
        die(s, "reserve");
    for (uint32_t i = 0; i < r->ns; i++)
        for (uint32_t l = 0; l < NL; l++)
            if ((s = kvt_seq_write(r->seqs[i], l, 0, 0, 1, r->row, 1152)))
                die(s, "row write");
}

static void runs(rig *r, void *stream) {
    const void *q = r->query ? kvt_buffer_ptr(r->query) : NULL;
    for (uint32_t l = 0; l < NL; l++) {
        kvt_status s = kvt_batch_run(r->b, l, q, stream, &r->e[l]);
        if (s)
            die(s, "run");
    }
}

static void sync_stream(void *stream) {
#if KVT_HAVE_CUDA
    if (stream && cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess) {
        fprintf(stderr, "bench_step: stream synchronise failed\n");
        exit(1);
    }
#else
    (void)stream;
#endif
}

/* Best of several reads of `bytes` (the rows of one request's layer): a device-to-device copy on
 * the stream (CUDA), else memcpy. */
static double read_floor(kvt_backend_kind kind, void *stream, size_t bytes) {
#if KVT_HAVE_CUDA
    if (kind == KVT_BACKEND_CUDA && stream) {
        void *a = NULL, *b = NULL;
        if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess)
            die(KVT_ERR_OUT_OF_MEMORY, "device buffers of the dense floor");
        cudaMemsetAsync(a, 1, bytes, (cudaStream_t)stream);
        double best = 1e30;
        for (int k = 0; k < 20; k++) {
            sync_stream(stream);
            double t = now_s();
            cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)stream);
            sync_stream(stream);
            t = now_s() - t;
            best = t < best ? t : best;
        }
        cudaFree(a);
        cudaFree(b);
        return best;
    }
#endif
    (void)kind;
    (void)stream;
    return memcpy_best(bytes, 20);
}

#include "bench_step_decode.h"

/* One window of W steps of each of the first `ways` ways (0 eager, 1 planned, 2 graph),
 * interleaved step by step (each way's steps see the same context lengths: the tail grows with
 * every step), the stream synchronised after each step (included); seconds per step into sec. */
static void window(rig *r, int ways, void *stream, void **graph, double *sec) {
    double total[3] = {0, 0, 0};
    for (int k = 0; k < W * ways; k++) {
        const int way = k % ways;
        step_begin(r);
        double t = now_s();
        kvt_status s = kvt_batch_plan(r->b);
        if (s)
            die(s, "plan");
        bool planned = false;
        if (way > 0 && (s = kvt_batch_plan_device(r->b, r->e, NL, stream, &planned)))
            die(s, "plan_device");
        if (way > 0 && !planned) {
            fprintf(stderr, "bench_step: a timed step was not plannable\n");
            exit(1);
        }
#if KVT_HAVE_CUDA
        if (way == 2) {
            if (!*graph) {
                cudaGraph_t g;
                cudaGraphExec_t x;
                if (cudaStreamBeginCapture((cudaStream_t)stream,
                                           cudaStreamCaptureModeThreadLocal) != cudaSuccess)
                    die(KVT_ERR_NO_DEVICE, "capture");
                runs(r, stream);
                if (cudaStreamEndCapture((cudaStream_t)stream, &g) != cudaSuccess ||
                    cudaGraphInstantiate(&x, g, 0) != cudaSuccess)
                    die(KVT_ERR_NO_DEVICE, "graph");
                cudaGraphDestroy(g);
                *graph = x;
            }
            if (cudaGraphLaunch((cudaGraphExec_t)*graph, (cudaStream_t)stream) != cudaSuccess)
                die(KVT_ERR_NO_DEVICE, "graph launch");
        } else
#endif
        {
            (void)graph;
            runs(r, stream);
        }
        if ((s = kvt_batch_commit(r->b, NULL)))
            die(s, "commit");
        sync_stream(stream);
        total[way] += now_s() - t;
    }
    for (int w = 0; w < ways; w++)
        sec[w] = total[w] / W;
}

int main(int argc, char **argv) {
    const char *bk = argc > 1 ? argv[1] : "cpu";
    const bool decode = argc > 2 && strcmp(argv[2], "decode") == 0;
    /* at most 6 windows of each way: the timed steps stay inside one block (no close) */
    int R = argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 3;
    R = R > 6 ? 6 : R;
    const uint32_t N =
        argc > 3 && atoi(argv[3]) >= 4096 ? (uint32_t)atoi(argv[3]) / 4096 * 4096 : 32768;
    const uint32_t NS = argc > 4 && atoi(argv[4]) > 0 ? (uint32_t)atoi(argv[4]) : 16;
    const bool recall = argc > 5 && strcmp(argv[5], "recall") == 0;
    kvt_backend_kind kind = strcmp(bk, "cuda") == 0      ? KVT_BACKEND_CUDA
                            : strcmp(bk, "guarded") == 0 ? KVT_BACKEND_GUARDED
                                                         : KVT_BACKEND_CPU;
    void *stream = NULL;
#if KVT_HAVE_CUDA
    if (kind == KVT_BACKEND_CUDA) {
        cudaStream_t cs;
        if (cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess) {
            printf("bench_step: no CUDA device: nothing measured\n");
            return 0;
        }
        stream = cs;
    }
#endif
    if (decode) {
        const int rc = decode_main(kind, stream, argc, argv);
#if KVT_HAVE_CUDA
        if (stream)
            cudaStreamDestroy((cudaStream_t)stream);
#endif
        return rc;
    }
    kvt_layer_spec specs[NL];
    for (int l = 0; l < NL; l++) {
        kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &specs[l]);
        specs[l].n_q_heads = QH;
    }
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(specs, NL, "mla", &m, err, sizeof err);
    if (s)
        die(s, err);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.page_rows = 64;
    p.max_rows_per_seq = N + 4096;
    p.n_pages = NS * ((N + 4096) / 64 + 1);
    p.backend = kind;
    kvt_config cfg = kvt_config_default();
    if (recall) {
        cfg.recall = KVT_RECALL_MARGIN;
        cfg.recall_margin = 1.0f;
        p.config = &cfg;
        p.recall_sketch_rank = 16;
    }
    rig r = {.ns = NS};
    if ((s = kvt_ctx_create(&p, &r.ctx, err, sizeof err))) {
        printf("bench_step: %s backend unavailable: %s: nothing measured\n", bk, err);
        return 0;
    }
    r.seqs = calloc(NS, sizeof *r.seqs);
    r.ones = malloc(sizeof *r.ones * NS);
    uint32_t *chunk = malloc(sizeof *chunk * NS);
    for (uint32_t i = 0; i < NS; i++) {
        kvt_seq_params sp = kvt_seq_default_params();
        sp.request_id = i + 1;
        if ((s = kvt_seq_create(r.ctx, &sp, &r.seqs[i])))
            die(s, "request");
        r.ones[i] = 1;
    }
    if ((s = kvt_batch_create(r.ctx, NS, &r.b)))
        die(s, "batch");
    /* prefill N rows per request in blocks (every close happens here) */
    uint8_t *rows = malloc((size_t)4096 * 1152);
    uint16_t *v = (uint16_t *)rows;
    for (size_t i = 0; i < (size_t)4096 * 576; i++)
        v[i] = (uint16_t)(0x3c00u + (rnd() & 0x3ffu)) ^ (uint16_t)((rnd() & 1u) << 15);
    r.row = rows + 1152 * 7;
    for (uint32_t done = 0; done < N; done += 4096) {
        for (uint32_t i = 0; i < NS; i++)
            chunk[i] = 4096;
        if ((s = kvt_batch_reserve(r.b, r.seqs, chunk, NS)))
            die(s, "prefill reserve");
        for (uint32_t i = 0; i < NS; i++)
            for (uint32_t l = 0; l < NL; l++)
                kvt_seq_write(r.seqs[i], l, 0, 0, 4096, rows, (size_t)4096 * 1152);
        if ((s = kvt_batch_commit(r.b, NULL)))
            die(s, "prefill commit");
    }
    /* a topk that holds every attended set of the timed steps (sinks, kept, tail + steps; with
     * recall every row: an overflowing step attends them all) */
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(r.seqs[0], 0, &ls);
    r.topk = (recall ? N : (uint32_t)ls.attended_rows) + 3 * (uint32_t)R * W + 64;
    if (recall) {
        const size_t nq = (size_t)NS * QH * QD;
        float *q = malloc(sizeof(float) * nq);
        const uint16_t *bf = (const uint16_t *)rows;
        for (size_t i = 0; i < nq; i++) { /* head i / QD: the latent and branch of a row */
            const size_t row = (i / QD * 37 + 100) % 4096, d = i % QD;
            uint32_t bits = (uint32_t)bf[row * 576 + d] << 16;
            float v;
            memcpy(&v, &bits, sizeof v);
            q[i] = 20.0f * v + (float)(0.1 * ((double)(rnd() >> 11) * 0x1p-53 - 0.5));
        }
        if ((s = kvt_buffer_alloc(r.ctx, sizeof(float) * nq, &r.query)) ||
            (s = kvt_buffer_write(r.query, 0, q, sizeof(float) * nq)))
            die(s, "queries");
        free(q);
    }
    for (uint32_t l = 0; l < NL; l++) {
        if ((s = kvt_buffer_alloc(r.ctx, sizeof(int32_t) * NS * r.topk, &r.idx[l])) ||
            (s = kvt_buffer_alloc(r.ctx, sizeof(int32_t) * NS, &r.len[l])))
            die(s, "emission buffers");
        r.e[l] = (kvt_emit){.struct_size = sizeof(kvt_emit),
                            .layout = KVT_EMIT_TOKENS,
                            .indices = kvt_buffer_ptr(r.idx[l]),
                            .capacity = r.topk,
                            .lengths = kvt_buffer_ptr(r.len[l])};
    }
    const int ways = kind == KVT_BACKEND_CUDA ? 3 : 2;
    double lo[3] = {1e30, 1e30, 1e30}, hi[3] = {0, 0, 0};
    void *graph = NULL;
    for (int rep = 0; rep < R; rep++) {
        double t[3];
        window(&r, ways, stream, &graph, t);
        for (int w = 0; w < ways; w++) {
            lo[w] = t[w] < lo[w] ? t[w] : lo[w];
            hi[w] = t[w] > hi[w] ? t[w] : hi[w];
        }
    }
    const size_t bytes = sizeof(int32_t) * NL * NS * (size_t)ls.attended_rows;
    const double floor = memcpy_best(bytes, 20);
    /* the dense floor: one request's N rows read once (its layer's rows), x NS x NL */
    const double row_read = read_floor(kind, stream, (size_t)N * 1152) / 2 / N;
    const double dense = row_read * N * NS * NL, sparse = row_read * ls.attended_rows * NS * NL;
    printf("bench_step: kvtier %s, %s backend, %u requests x %u MLA NoPE layers at %u rows "
           "(%llu attended), %d windows of %d steps%s\n",
           kvt_version(0, 0, 0), kvt_ctx_backend_name(r.ctx), NS, NL, N,
           (unsigned long long)ls.attended_rows, R, W,
           recall ? ", recall on (margin, planned recall steps)" : "");
    if (recall) {
        uint64_t steps = 0, fired = 0, dense_steps = 0;
        for (uint32_t i = 0; i < NS; i++)
            for (uint32_t l = 0; l < NL; l++) {
                kvt_layer_stats x = {.struct_size = sizeof x};
                kvt_seq_layer_stats(r.seqs[i], l, &x);
                steps += x.recall_steps;
                fired += x.recall_fired_rows;
                dense_steps += x.recall_overflow_steps + x.recall_calib_steps;
            }
        printf("recall   %.1f rows fired per request-layer step, %llu of %llu steps dense\n",
               steps ? (double)fired / (double)steps : 0.0, (unsigned long long)dense_steps,
               (unsigned long long)steps);
    }
    const char *name[3] = {"eager", "planned", "graph"};
    for (int w = 0; w < ways; w++)
        printf("%-8s %8.1f - %8.1f us per step  (%.2f - %.2f x eager's best; %.1f - %.1f x "
               "memcpy of the %zu emitted bytes, %.1f us)\n",
               name[w], lo[w] * 1e6, hi[w] * 1e6, lo[w] / lo[0], hi[w] / lo[0], lo[w] / floor,
               hi[w] / floor, bytes, floor * 1e6);
    printf("dense    reading every row once: %.1f us per step (half a %s); the attended rows: "
           "%.1f us (%.3f x)\n",
           dense * 1e6, stream ? "device copy" : "memcpy", sparse * 1e6, sparse / dense);
    for (int w = 0; w < ways; w++)
        printf("%-8s + attended-row read = %.3f - %.3f x the dense floor\n", name[w],
               (lo[w] + sparse) / dense, (hi[w] + sparse) / dense);
#if KVT_HAVE_CUDA
    if (graph)
        cudaGraphExecDestroy((cudaGraphExec_t)graph);
#endif
    for (uint32_t l = 0; l < NL; l++) {
        kvt_buffer_free(r.idx[l]);
        kvt_buffer_free(r.len[l]);
    }
    kvt_buffer_free(r.query);
    kvt_batch_destroy(r.b);
    for (uint32_t i = 0; i < NS; i++)
        kvt_seq_destroy(r.seqs[i]);
    kvt_ctx_destroy(r.ctx);
    kvt_model_destroy(m);
    free(rows);
    free(r.seqs);
    free(r.ones);
    free(chunk);
#if KVT_HAVE_CUDA
    if (stream)
        cudaStreamDestroy((cudaStream_t)stream);
#endif
    return 0;
}
