/*
 * bench_step.c — what kvtier adds to a decode step of a batch, per step, on a chosen backend:
 * NS requests at N rows of context, NL MLA NoPE salience layers, one token each per step (no
 * block closes in the timed steps). Three ways of running the same steps, side by side:
 *   eager    kvt_batch_plan, kvt_batch_run per layer, kvt_batch_commit;
 *   planned  the same with kvt_batch_plan_device before the runs (each run one planned pack);
 *   graph    (CUDA only) kvt_batch_plan_device, then one CUDA graph captured over the runs of
 *            the first planned step, launched every step (the engine's way).
 * Untimed: the scheduler's reserve and the forward's row writes. Each way runs W steps per
 * window, the stream synchronised at the window's end (included); the figure is per step, the
 * range over R windows. The floor beside it: memcpy of the bytes the step emits (NL x NS x topk
 * int32), measured in the same run. Usage: bench_step [cpu|guarded|cuda] [R] [N] [NS]
 */
#include "kvtier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

enum { NL = 8, W = 200, MAXL = NL };

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
    for (uint32_t l = 0; l < NL; l++) {
        kvt_status s = kvt_batch_run(r->b, l, NULL, stream, &r->e[l]);
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

/* One window of W steps the given way (0 eager, 1 planned, 2 graph); seconds per step. */
static double window(rig *r, int way, void *stream, void **graph) {
    double total = 0;
    for (int k = 0; k < W; k++) {
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
        if (k == W - 1)
            sync_stream(stream);
        total += now_s() - t;
    }
    return total / W;
}

int main(int argc, char **argv) {
    const char *bk = argc > 1 ? argv[1] : "cpu";
    /* at most 6 windows of each way: the timed steps stay inside one block (no close) */
    int R = argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 3;
    R = R > 6 ? 6 : R;
    const uint32_t N =
        argc > 3 && atoi(argv[3]) >= 4096 ? (uint32_t)atoi(argv[3]) / 4096 * 4096 : 32768;
    const uint32_t NS = argc > 4 && atoi(argv[4]) > 0 ? (uint32_t)atoi(argv[4]) : 16;
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
    kvt_layer_spec specs[NL];
    for (int l = 0; l < NL; l++)
        kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &specs[l]);
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
    /* a topk that holds every attended set of the timed steps (sinks, kept, tail + steps) */
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(r.seqs[0], 0, &ls);
    r.topk = (uint32_t)ls.attended_rows + 3 * (uint32_t)R * W + 64;
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
    for (int rep = 0; rep < R; rep++)
        for (int w = 0; w < ways; w++) {
            double t = window(&r, w, stream, &graph);
            lo[w] = t < lo[w] ? t : lo[w];
            hi[w] = t > hi[w] ? t : hi[w];
        }
    const size_t bytes = sizeof(int32_t) * NL * NS * (size_t)ls.attended_rows;
    const double floor = memcpy_best(bytes, 20);
    printf("bench_step: kvtier %s, %s backend, %u requests x %u MLA NoPE layers at %u rows "
           "(%llu attended), %d windows of %d steps\n",
           kvt_version(0, 0, 0), kvt_ctx_backend_name(r.ctx), NS, NL, N,
           (unsigned long long)ls.attended_rows, R, W);
    const char *name[3] = {"eager", "planned", "graph"};
    for (int w = 0; w < ways; w++)
        printf("%-8s %8.1f - %8.1f us per step  (%.2f - %.2f x eager's best; %.1f - %.1f x "
               "memcpy of the %zu emitted bytes, %.1f us)\n",
               name[w], lo[w] * 1e6, hi[w] * 1e6, lo[w] / lo[0], hi[w] / lo[0], lo[w] / floor,
               hi[w] / floor, bytes, floor * 1e6);
#if KVT_HAVE_CUDA
    if (graph)
        cudaGraphExecDestroy((cudaGraphExec_t)graph);
#endif
    for (uint32_t l = 0; l < NL; l++) {
        kvt_buffer_free(r.idx[l]);
        kvt_buffer_free(r.len[l]);
    }
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
