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
 *   data=needle      (with a needle data directory, bench/needle_data.sh) kvtier-needle's
 *                    haystack and decode phase, read from its trace: rows whose latents follow a
 *                    few slowly drifting topics (clustered: where the pruned scan pays), filler
 *                    and no-salience needle queries in the trace's order; the basis the
 *                    generator's query subspace (../bench_decode_case.h);
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
 * and ρ (4 B), 4 B per emitted slot, and on a step that ran the pruned scan (it visited fewer
 * rows than it archived) the group planes of every archived row as allocated (20.75 B a row);
 * visited: archived rows the scans evaluated / archived rows over the timed steps; a dense recall
 * step — calibration or overflow — counts every row.)
 *
 * With params.recall_scan_bits 8 (the 8-bit scan, each recall case run at 16 bits, then at 8
 * bits, in the same binary) the line carries "scan=int8" after recall= and the scan's bytes are
 * what it reads then: the row's 8-bit plane (24 B of scales and error norms, branch and sketch
 * one byte a value) and ρ.
 *
 * With recall, after the closing step: one kvt_ctx_refit_recall_basis to the same basis (z kept),
 * timed alone: what re-sketching every closed row costs, in ms and in dense steps ("refit:").
 *
 * The case (sizes, data, context, measurement, line) is ../bench_decode_case.h's, shared with
 * bench_step's decode mode (the same case on a device).
 *
 * Usage: bench_decode_step [R windows (3)] [largest context in k rows (128)] [T steps (5)]
 *        [scan bits: 16, 8 or both (both)] [needle data directory, - for none (none)]
 *        [data: all, structured, random or needle (all)]
 */
#define _DEFAULT_SOURCE /* setenv, execv (bench_cpu.h) */
#include "kernels/attn.h"
#include "kvtier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_decode_case.h"
#include "../bench_util.h"
#include "bench_cpu.h"

static void die(kvt_status s, const char *what) {
    fprintf(stderr, "bench_decode_step: %s: %s (%s)\n", what, kvt_status_name(s), kvt_last_error());
    exit(1);
}

typedef struct rig {
    dec_case c;
    const dec_data *g;
    kvt_emit e;
    int32_t *idx, len;
    float *q, *qs, *out, *scr;
    uint8_t *row;
    double part[3]; /* seconds in plan + run, the sparse attention, commit (summed) */
    double last_close[3]; /* the same, of the last step that closed a block */
} rig;

/* One decode step at n_rows rows before it: kvtier's part and the dense attention, each timed
 * in the thread's CPU time; *emitted: the slots the run emitted. */
static void step(void *rv, uint64_t n_rows, double *t_kvt, double *t_dense, uint32_t *emitted) {
    rig *r = rv;
    kvt_status s = dec_step_begin(&r->c, r->g, n_rows, r->row, r->q, r->qs);
    if (s)
        die(s, "reserve");
    kvt__attn_f32_args a = {.base = r->c.plane, .slot_stride = DEC_ROW, .dtype = KVT__DT_BF16,
                            .key_dim = DEC_KD, .value_dim = DEC_D, .q = r->q, .n_heads = DEC_H,
                            .q_stride = DEC_KD, .scale = DEC_SCALE, .out = r->out,
                            .scratch = r->scr};
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(r->c.seq, 0, &ls);
    const uint64_t closes = ls.closes;
    double t0 = cpu_s();
    if ((s = kvt_batch_plan(r->c.b)) || (s = kvt_batch_run(r->c.b, 0, r->qs, NULL, &r->e)))
        die(s, "run");
    const double tr = cpu_s();
    a.slots = r->idx;
    a.n_rows = (uint32_t)r->len;
    kvt__attn_f32_cpu(&a);
    const double ta = cpu_s();
    if ((s = kvt_batch_commit(r->c.b, NULL)))
        die(s, "commit");
    double t1 = cpu_s();
    r->part[0] += tr - t0;
    r->part[1] += ta - tr;
    r->part[2] += t1 - ta;
    kvt_seq_layer_stats(r->c.seq, 0, &ls);
    if (ls.closes != closes) {
        r->last_close[0] = tr - t0;
        r->last_close[1] = ta - tr;
        r->last_close[2] = t1 - ta;
    }
    a.slots = NULL;
    a.n_rows = (uint32_t)(n_rows + 1); /* the rows the step attends densely: all, its own too */
    kvt__attn_f32_cpu(&a);
    *t_dense = cpu_s() - t1;
    *t_kvt = t1 - t0;
    *emitted = (uint32_t)r->len;
}

/* One case at N rows: data `kind` (DEC_NEEDLE: the trace and basis under needle_dir), recall
 * conformal at `bits` or off. */
static void one_case(uint32_t N, int kind, const char *needle_dir, int recall, int bits, int R,
                     int T, double g_sgemm) {
    dec_data g;
    if (kind == DEC_NEEDLE) {
        char tp[4096], bp[4096];
        snprintf(tp, sizeof tp, "%s/needle-%uk.kvtt", needle_dir, N / 1024u);
        snprintf(bp, sizeof bp, "%s/needle-%uk.basis", needle_dir, N / 1024u);
        dec_data_init_trace(&g, tp, bp, N);
    } else {
        dec_data_init(&g, kind == DEC_STRUCTURED);
    }
    char err[256];
    const char *what;
    rig r = {.g = &g};
    kvt_status s = dec_open(&r.c, KVT_BACKEND_CPU, N, &g, recall, bits, err, sizeof err, &what);
    if (s)
        die(s, what);
    r.idx = malloc(sizeof(int32_t) * r.c.cap);
    r.e = (kvt_emit){.struct_size = sizeof(kvt_emit), .layout = KVT_EMIT_TOKENS,
                     .indices = r.idx, .capacity = r.c.cap, .lengths = &r.len};
    r.q = malloc(sizeof(float) * DEC_H * DEC_KD);
    r.qs = malloc(sizeof(float) * DEC_H * DEC_KD);
    r.out = malloc(sizeof(float) * DEC_H * DEC_D);
    r.scr = malloc(sizeof(float) * kvt__attn_f32_scratch_floats(DEC_H, DEC_KD, DEC_D));
    r.row = malloc(DEC_ROW);
    const dec_bench b = {.prog = "bench_decode_step", .c = &r.c, .g = &g, .rig = &r,
                         .step = step, .acc = r.part, .n_acc = 3};
    dec_result res;
    dec_measure(&b, N, recall, bits, R, T, &res);
    const double fl = 2.0 * DEC_H * (DEC_KD + DEC_D) * (double)N;
    dec_print_line(N, kind, recall, bits, "dense_over_kvtier", &res);
    printf("  detail: dense_over_kvtier %.2f–%.2f over %d windows of %d steps; kvtier %.2f ms, "
           "dense %.2f ms (median window; dense attention %.1f GFLOP/s = %.2f of sgemm); "
           "mean step: plan + run %.2f ms, sparse attention %.2f ms, commit %.3f ms; "
           "closing step %.2f ms (plan + run %.2f, attention %.2f, commit %.2f), the slowest of "
           "the %d after it %.2f ms (%.2f of the median; the slowest windowed step %.2f); "
           "recall steps %llu, overflow %llu, fetched rows %llu\n",
           res.lo, res.hi, R, T, res.kvt_med * 1e3, res.dense_med * 1e3,
           fl / res.dense_med * 1e-9, fl / res.dense_med * 1e-9 / g_sgemm, res.acc[0] * 1e3,
           res.acc[1] * 1e3, res.acc[2] * 1e3, res.close_s * 1e3, r.last_close[0] * 1e3,
           r.last_close[1] * 1e3, r.last_close[2] * 1e3, DEC_AFTER, res.after_close_max_s * 1e3,
           res.after_close_max_s / res.kvt_med, res.window_max_s / res.kvt_med,
           (unsigned long long)res.rsteps, (unsigned long long)res.over,
           (unsigned long long)res.fetched);
    if (recall) { /* a refit (kvt_ctx_refit_recall_basis) to the same basis, z kept: its cost */
        const double t0 = cpu_s();
        s = kvt_ctx_refit_recall_basis(r.c.ctx, 0, g.basis, DEC_RANK, KVT_REFIT_KEEP_Z, NULL);
        const double t_refit = cpu_s() - t0;
        if (s)
            die(s, "kvt_ctx_refit_recall_basis");
        kvt_layer_stats ls = {.struct_size = sizeof ls};
        kvt_seq_layer_stats(r.c.seq, 0, &ls);
        printf("  refit: %.1f ms for %llu closed rows (%.2f us a row) = %.1f dense steps\n",
               t_refit * 1e3, (unsigned long long)ls.closed_rows,
               t_refit * 1e6 / (double)ls.closed_rows, t_refit / res.dense_med);
    }
    fflush(stdout);
    dec_close(&r.c);
    dec_data_free(&g);
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
    /* the needle data's directory (bench/needle_data.sh writes it): its cases run after the
     * others when given */
    const char *needle_dir = argc > 5 && strcmp(argv[5], "-") ? argv[5] : NULL;
    /* the data to run: all (default), structured, random or needle */
    const char *only = argc > 6 ? argv[6] : "all";
    const int s16 = strcmp(scan, "8") != 0, s8 = strcmp(scan, "16") != 0;
    R = R < 1 ? 1 : R > DEC_MAXW ? DEC_MAXW : R;
    T = T < 1 ? 1 : T > DEC_MAXT ? DEC_MAXT : T;
    blas_setup(argv);
    const double g_sq = sgemm_gflops(1024, 1024, 1024, "N", 3),
                 g_dec = sgemm_gflops(4096, DEC_H, DEC_KD, "T", 3), g = g_sq > g_dec ? g_sq : g_dec;
    printf("bench_decode_step: kvtier %s, CPU backend, one thread; ", kvt_version(0, 0, 0));
    dec_print_case();
    printf("; sgemm (OpenBLAS, %s kernels) 1024³ %.1f GFLOP/s, 4096×%d×%d %.1f GFLOP/s\n",
           blas_core(), g_sq, DEC_H, DEC_KD, g_dec);
    static const uint32_t ctxs[] = {32768, 131072};
    for (size_t c = 0; c < 2; c++) {
        if (ctxs[c] > max_k * 1024u)
            break;
        static const int kinds[] = {DEC_STRUCTURED, DEC_RANDOM, DEC_NEEDLE};
        for (int k = 0; k < 3; k++) {
            if (kinds[k] == DEC_NEEDLE && !needle_dir)
                break;
            if (strcmp(only, "all") && strcmp(only, dec_kind_name(kinds[k])))
                continue;
            if (s16)
                one_case(ctxs[c], kinds[k], needle_dir, 1, 16, R, T, g);
            if (s8)
                one_case(ctxs[c], kinds[k], needle_dir, 1, 8, R, T, g);
            if (kinds[k] != DEC_RANDOM)
                one_case(ctxs[c], kinds[k], needle_dir, 0, 16, R, T, g);
        }
    }
    return 0;
}
