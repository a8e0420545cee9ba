/*
 * bench_decode_step.c — one decode step of one absorbed-MLA NoPE layer as an engine runs it,
 * through the public API, against a dense attention over every row, in the same run (issue 34).
 *
 * A context of one salience layer (bf16 rows of 576 values: 512 latent | 64 branch; 32 query
 * heads; ratio 32, B = 4096, 4 sinks), one request prefilled to N rows in 4096-row chunks
 * (reserve, kvt_seq_write, commit: every close happens there). Then decode steps, each:
 *   kvt_batch_reserve + kvt_seq_write of the new row (the forward's work: not timed), then, timed
 *   as "kvtier": kvt_batch_plan, kvt_batch_run (with recall: the recall step — exact scores of
 *   the attended rows, the archive scan, the emission of attended + fetched slots), the engine's
 *   sparse attention over the emitted slots, kvt_batch_commit;
 *   and timed as "dense": the same attention code over all N rows (a contiguous range of the
 *   layer's plane: the strongest baseline, no gather).
 * The attention is kernels/attn_f32.c (fp32, register-blocked): its rate is printed as a fraction
 * of this machine's single-thread sgemm (OpenBLAS), measured in the same run; the engine's own
 * attention would stand in its place. Everything single-threaded, in the thread's CPU time.
 *
 * Cases: context 32k and 128k (the second argument caps it) × data × recall:
 *   data=structured  latents with 90% of their energy in a rank-64 subspace, 4 sink rows along a
 *                    direction every query shares (attention sinks: a head's best attended score
 *                    is a sink's), isotropic branch; the recall basis is that subspace (given
 *                    with kvt_ctx_set_recall_basis, as an engine gives a calibrated basis);
 *   data=random      isotropic latents and queries, no sinks; the basis a random rank-64 one
 *                    (the worst case for the certificate and for pruning);
 *   recall=conformal (kvt_config.recall, rank-64 sketches) or recall=off.
 * Steps: with recall, calibration steps first (untimed, until the layer's recall_calib_steps stops
 * growing); then R windows of T steps (the median step of a window: kvtier and dense, interleaved
 * step by step); then the request is filled to one row short of its open block's end in one chunk
 * and one step closes the block (timed the same way): close_over_median is that step over the
 * median window's kvtier step.
 * Printed per case, exactly one line:
 *   decode_step context=N data=D recall=R dense_over_kvtier=X bytes_per_token=Y
 *   close_over_median=Z visited=V
 * (X: median dense / median kvtier step over the median window; its range over the R windows on
 * a detail line; bytes_per_token: the bench's own count of what the step reads, per context row —
 * the attention's rows (attended + fetched, 1152 B each), the recall step's exact scores of the
 * attended rows (1152 B each again), the visited archived rows' sketch (2·rank B), branch (128 B)
 * and ρ (4 B), 4 B per emitted slot; visited: archived rows the scans evaluated / archived rows
 * over the timed steps; a dense recall step — calibration or overflow — counts every row.)
 *
 * With params.recall_scan_bits 8 (the 8-bit scan, each recall case run at 16 bits, then at 8
 * bits, in the same binary) the line carries "scan=int8" after recall= and the scan's bytes are
 * what it reads then: the row's 8-bit plane (24 B of scales and error norms, branch and sketch
 * one byte a value) and ρ.
 *
 * Usage: bench_decode_step [R windows (3)] [largest context in k rows (128)] [T steps (5)]
 *        [scan bits: 16, 8 or both (both)]
 */
#define _DEFAULT_SOURCE /* setenv, execv (bench_cpu.h) */
#include "kernels/attn.h"
#include "kvtier.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_util.h"
#include "bench_cpu.h"

enum { H = 32, KD = 576, D = 512, BD = 64, RANK = 64, BLK = 4096, SINKS = 4, RATIO = 32,
       ROW = KD * 2, CHUNK = 4096, MAXW = 16, MAXT = 64 };
#define SCALE 0.07216878364870322
#define Q_SHARED 10.0f
#define SINK_LEN 16.6f

static void die(kvt_status s, const char *what) {
    fprintf(stderr, "bench_decode_step: %s: %s (%s)\n", what, kvt_status_name(s), kvt_last_error());
    exit(1);
}

typedef struct data {
    int structured;
    float *basis; /* [RANK][D] orthonormal */
    float u[KD];  /* the sinks' direction (structured) */
} data;

/* Row r of the request (r < SINKS: a sink on structured data). */
static void make_row(const data *g, uint32_t r, uint8_t *row) {
    if (!g->structured) {
        for (uint32_t i = 0; i < KD; i++)
            kvt__store_elem(row, KVT__DT_BF16, i, gauss());
        return;
    }
    structured_row(row, r, SINKS, g->u, SINK_LEN, g->basis, RANK, D, BD);
}

/* The step's queries: q (unscaled, for the attention) and qs = SCALE·q (the library's). */
static void make_query(const data *g, float *q, float *qs) {
    for (uint32_t i = 0; i < H * KD; i++) {
        q[i] = gauss() + (g->structured ? Q_SHARED * g->u[i % KD] : 0.0f);
        qs[i] = (float)SCALE * q[i];
    }
}

typedef struct rig {
    kvt_ctx *ctx;
    kvt_seq *seq;
    kvt_batch *b;
    uint8_t *plane;
    kvt_emit e;
    int32_t *idx, len;
    float *q, *qs, *out, *scr;
    uint8_t *row;
    uint32_t topk;
    double part[3]; /* seconds in plan + run, the sparse attention, commit (summed) */
} rig;

static uint64_t rows_of(const rig *r) {
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(r->seq, 0, &ls);
    return ls.appended_rows;
}

/* Append n rows in one chunk (no run: a prefill chunk's rows). */
static void fill(rig *r, const data *g, uint32_t n) {
    uint8_t *rows = malloc((size_t)CHUNK * ROW);
    while (n) {
        const uint32_t c = n < CHUNK ? n : CHUNK;
        const uint64_t at = rows_of(r);
        for (uint32_t i = 0; i < c; i++)
            make_row(g, (uint32_t)(at + i), rows + (size_t)i * ROW);
        kvt_status s = kvt_batch_reserve(r->b, &r->seq, &c, 1);
        if (s || (s = kvt_seq_write(r->seq, 0, 0, 0, c, rows, (size_t)c * ROW)) ||
            (s = kvt_batch_commit(r->b, NULL)))
            die(s, "prefill");
        n -= c;
    }
    free(rows);
}

/* One decode step at n_rows rows before it: kvtier's part and the dense attention, each timed;
 * *emitted: the slots the run emitted. */
static void step(rig *r, const data *g, uint64_t n_rows, double *t_kvt, double *t_dense,
                 uint32_t *emitted) {
    const uint32_t one = 1;
    make_row(g, (uint32_t)n_rows, r->row);
    make_query(g, r->q, r->qs);
    kvt_status s = kvt_batch_reserve(r->b, &r->seq, &one, 1);
    if (s || (s = kvt_seq_write(r->seq, 0, 0, 0, 1, r->row, ROW)))
        die(s, "reserve");
    kvt__attn_f32_args a = {.base = r->plane, .slot_stride = ROW, .dtype = KVT__DT_BF16,
                            .key_dim = KD, .value_dim = D, .q = r->q, .n_heads = H,
                            .q_stride = KD, .scale = SCALE, .out = r->out, .scratch = r->scr};
    double t0 = cpu_s();
    if ((s = kvt_batch_plan(r->b)) || (s = kvt_batch_run(r->b, 0, r->qs, NULL, &r->e)))
        die(s, "run");
    const double tr = cpu_s();
    a.slots = r->idx;
    a.n_rows = (uint32_t)r->len;
    kvt__attn_f32_cpu(&a);
    const double ta = cpu_s();
    if ((s = kvt_batch_commit(r->b, NULL)))
        die(s, "commit");
    double t1 = cpu_s();
    r->part[0] += tr - t0;
    r->part[1] += ta - tr;
    r->part[2] += t1 - ta;
    a.slots = NULL;
    a.n_rows = (uint32_t)(n_rows + 1); /* the rows the step attends densely: all, its own too */
    kvt__attn_f32_cpu(&a);
    *t_dense = cpu_s() - t1;
    *t_kvt = t1 - t0;
    *emitted = (uint32_t)r->len;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[n / 2];
}

static void one_case(uint32_t N, int structured, int recall, int bits, int R, int T,
                     double g_sgemm) {
    data g = {.structured = structured, .basis = malloc(sizeof(float) * RANK * D)};
    orthonormal_f32(RANK, D, g.basis);
    double un = 0;
    for (uint32_t i = 0; i < KD; i++) {
        g.u[i] = gauss();
        un += (double)g.u[i] * g.u[i];
    }
    for (uint32_t i = 0; i < KD; i++)
        g.u[i] /= (float)sqrt(un);

    kvt_layer_spec spec;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, D, BD, &spec);
    spec.n_q_heads = H;
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(&spec, 1, "bench-mla", &m, err, sizeof err);
    if (s)
        die(s, err);
    const uint32_t cap = N + 2 * BLK;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.page_rows = 64;
    p.max_rows_per_seq = cap;
    p.n_pages = cap / 64 + 2;
    kvt_config cfg = kvt_config_default();
    cfg.ratio = RATIO;
    cfg.block_rows = BLK;
    cfg.sink_rows = SINKS;
    if (recall) {
        cfg.recall = KVT_RECALL_CONFORMAL;
        p.recall_sketch_rank = RANK;
        p.recall_scan_bits = (uint32_t)bits;
    }
    p.config = &cfg;
    rig r = {0};
    if ((s = kvt_ctx_create(&p, &r.ctx, err, sizeof err)))
        die(s, err);
    if (recall && (s = kvt_ctx_set_recall_basis(r.ctx, 0, g.basis, RANK)))
        die(s, "basis");
    size_t plane_bytes = 0;
    void *base = NULL;
    if ((s = kvt_layer_data(r.ctx, 0, 0, &base, &plane_bytes)))
        die(s, "plane");
    r.plane = base;
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 1;
    if ((s = kvt_seq_create(r.ctx, &sp, &r.seq)) || (s = kvt_batch_create(r.ctx, 1, &r.b)))
        die(s, "request");
    r.topk = cap;
    r.idx = malloc(sizeof(int32_t) * r.topk);
    r.e = (kvt_emit){.struct_size = sizeof(kvt_emit), .layout = KVT_EMIT_TOKENS,
                     .indices = r.idx, .capacity = r.topk, .lengths = &r.len};
    r.q = malloc(sizeof(float) * H * KD);
    r.qs = malloc(sizeof(float) * H * KD);
    r.out = malloc(sizeof(float) * H * D);
    r.scr = malloc(sizeof(float) * kvt__attn_f32_scratch_floats(H, KD, D));
    r.row = malloc(ROW);

    /* prefill to mid-block: N − B closed rows and an open block of B/2 (the timed steps see
     * N − B/2 rows, dense attention alike) */
    fill(&r, &g, N - BLK / 2);
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    double tk, td;
    uint32_t em;
    uint64_t n = rows_of(&r);
    for (int i = 0; recall && i < 256; i++) { /* calibration (untimed) */
        uint64_t before = (kvt_seq_layer_stats(r.seq, 0, &ls), ls.recall_calib_steps);
        step(&r, &g, n++, &tk, &td, &em);
        kvt_seq_layer_stats(r.seq, 0, &ls);
        if (ls.recall_calib_steps == before && i > 0)
            break;
    }
    kvt_seq_layer_stats(r.seq, 0, &ls);
    memset(r.part, 0, sizeof r.part);
    const uint64_t v0 = ls.recall_visited_rows, f0 = ls.recall_fetched_rows,
                   o0 = ls.recall_overflow_steps, st0 = ls.recall_steps;
    double ratio_w[MAXW], kvt_w[MAXW], dense_w[MAXW], bytes = 0, arch = 0;
    /* what the scan reads of a visited row: the fp16 sketch, the bf16 branch and ρ; at 8 bits
     * the row's 8-bit plane (six fp32 values, the branch and sketch bytes padded to 4) and ρ */
    const double scan_row = bits == 8 ? 24.0 + (double)((BD + RANK + 3) / 4 * 4) + 4.0
                                      : 2.0 * RANK + 2.0 * BD + 4.0;
    for (int w = 0; w < R; w++) {
        double kt[MAXT], dt[MAXT];
        for (int t = 0; t < T; t++) {
            kvt_layer_stats b4 = {.struct_size = sizeof b4};
            kvt_seq_layer_stats(r.seq, 0, &b4);
            step(&r, &g, n++, &kt[t], &dt[t], &em);
            kvt_seq_layer_stats(r.seq, 0, &ls);
            const double vis = (double)(ls.recall_visited_rows - b4.recall_visited_rows);
            const double fet = (double)(ls.recall_fetched_rows - b4.recall_fetched_rows);
            /* attended without recall = emitted − fetched (a dense step fetched every archived) */
            const double att = (double)em - fet;
            bytes += ((double)em * ROW + (recall ? att * ROW : 0.0) + vis * scan_row + 4.0 * em) /
                     (double)(n);
            arch += recall ? (double)ls.recall_last_archived : 0.0;
        }
        kvt_w[w] = median(kt, T);
        dense_w[w] = median(dt, T);
        ratio_w[w] = dense_w[w] / kvt_w[w];
    }
    kvt_seq_layer_stats(r.seq, 0, &ls);
    double part[3];
    for (int i = 0; i < 3; i++)
        part[i] = r.part[i] / (R * T);
    const double visited = arch > 0 ? (double)(ls.recall_visited_rows - v0) / arch : 0.0;
    const uint64_t fetched = ls.recall_fetched_rows - f0, over = ls.recall_overflow_steps - o0,
                   rsteps = ls.recall_steps - st0;
    double lo = 1e30, hi = 0, kv_sorted[MAXW], ratios[MAXW];
    for (int w = 0; w < R; w++) {
        lo = ratio_w[w] < lo ? ratio_w[w] : lo;
        hi = ratio_w[w] > hi ? ratio_w[w] : hi;
        kv_sorted[w] = kvt_w[w];
        ratios[w] = ratio_w[w];
    }
    const double ratio = median(ratios, R), kvt_med = median(kv_sorted, R);
    double dn_sorted[MAXW];
    memcpy(dn_sorted, dense_w, sizeof(double) * (size_t)R);
    const double dense_med = median(dn_sorted, R);

    /* the closing step: fill to one row short of the open block's end, then one step */
    kvt_seq_layer_stats(r.seq, 0, &ls);
    const uint64_t open = ls.appended_rows - ls.closed_rows;
    if (open + 1 < BLK)
        fill(&r, &g, (uint32_t)(BLK - 1 - open));
    n = rows_of(&r);
    const uint64_t closes = (kvt_seq_layer_stats(r.seq, 0, &ls), ls.closes);
    double tc, tcd;
    step(&r, &g, n++, &tc, &tcd, &em);
    kvt_seq_layer_stats(r.seq, 0, &ls);
    if (ls.closes != closes + 1) {
        fprintf(stderr, "bench_decode_step: the closing step closed %llu blocks\n",
                (unsigned long long)(ls.closes - closes));
        exit(1);
    }
    const double fl = 2.0 * H * (KD + D) * (double)N;
    printf("decode_step context=%u data=%s recall=%s%s dense_over_kvtier=%.1f bytes_per_token=%.0f "
           "close_over_median=%.1f visited=%.2f\n",
           N, structured ? "structured" : "random", recall ? "conformal" : "off",
           recall && bits == 8 ? " scan=int8" : "", ratio,
           bytes / (R * T), tc / kvt_med, visited);
    printf("  detail: dense_over_kvtier %.2f–%.2f over %d windows of %d steps; kvtier %.2f ms, "
           "dense %.2f ms (median window; dense attention %.1f GFLOP/s = %.2f of sgemm); "
           "mean step: plan + run %.2f ms, sparse attention %.2f ms, commit %.3f ms; "
           "closing step %.2f ms; recall steps %llu, overflow %llu, fetched rows %llu\n",
           lo, hi, R, T, kvt_med * 1e3, dense_med * 1e3, fl / dense_med * 1e-9,
           fl / dense_med * 1e-9 / g_sgemm, part[0] * 1e3, part[1] * 1e3, part[2] * 1e3, tc * 1e3, (unsigned long long)rsteps,
           (unsigned long long)over, (unsigned long long)fetched);
    fflush(stdout);
    kvt_batch_destroy(r.b);
    kvt_seq_destroy(r.seq);
    kvt_ctx_destroy(r.ctx);
    kvt_model_destroy(m);
    free(g.basis);
    free(r.idx);
    free(r.q);
    free(r.qs);
    free(r.out);
    free(r.scr);
    free(r.row);
}

int main(int argc, char **argv) {
    int R = argc > 1 ? atoi(argv[1]) : 3;
    const uint32_t max_k = argc > 2 ? (uint32_t)atoi(argv[2]) : 128;
    int T = argc > 3 ? atoi(argv[3]) : 5;
    /* the recall scan's precision: 16, 8, or both (each recall case at 16 bits, then at 8) */
    const char *scan = argc > 4 ? argv[4] : "both";
    const int s16 = strcmp(scan, "8") != 0, s8 = strcmp(scan, "16") != 0;
    R = R < 1 ? 1 : R > MAXW ? MAXW : R;
    T = T < 1 ? 1 : T > MAXT ? MAXT : T;
    blas_setup(argv);
    const double g_sq = sgemm_gflops(1024, 1024, 1024, "N", 3),
                 g_dec = sgemm_gflops(4096, H, KD, "T", 3), g = g_sq > g_dec ? g_sq : g_dec;
    printf("bench_decode_step: kvtier %s, CPU backend, one thread; %d heads, bf16 MLA rows of %d "
           "B, ratio %d, B = %d, rank %d; sgemm (OpenBLAS, %s kernels) 1024³ %.1f GFLOP/s, "
           "4096×%d×%d %.1f GFLOP/s\n",
           kvt_version(0, 0, 0), H, ROW, RATIO, BLK, RANK, blas_core(), g_sq, H, KD, g_dec);
    static const uint32_t ctxs[] = {32768, 131072};
    for (size_t c = 0; c < 2; c++) {
        if (ctxs[c] > max_k * 1024u)
            break;
        for (int structured = 1; structured >= 0; structured--) {
            if (s16)
                one_case(ctxs[c], structured, 1, 16, R, T, g);
            if (s8)
                one_case(ctxs[c], structured, 1, 8, R, T, g);
            if (structured)
                one_case(ctxs[c], structured, 0, 16, R, T, g);
        }
    }
    return 0;
}
