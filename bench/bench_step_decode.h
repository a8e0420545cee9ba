/* bench_step_decode.h — bench_step's decode mode (`bench_step cuda decode ...`): issue 34's case,
 * one decode step of one absorbed-MLA NoPE layer as an engine runs it on the device, through the
 * public API, against a dense attention over every row in the same run; bench/kernels/
 * bench_decode_step.c's case and line, on a backend of the caller's choice (the CUDA backend on a
 * device, or under the emulation at a tiny size: ctest's cuda_emu_bench_step_decode).
 *
 * The case, its data, its measurement and its line are bench_decode_case.h's (the same as
 * bench_decode_step's; here a context's data are drawn once, its prefill rows generated
 * beforehand, for its three cases). Each step, timed on the wall clock with the stream synchronised:
 *   kvtier: kvt_batch_plan, kvt_batch_run (the recall step and the emission, on the stream), the
 *           emitted count read back (the host sizes the attention), the attention over the
 *           emitted slots (gathered), kvt_batch_commit;
 *   dense:  the same attention over all rows (rows 0 .. n of the layer's plane: no gather).
 * The attention (bench/cuda/bench_attn.cu, built where cuBLAS is) is two cuBLAS GEMMs (scores of
 * bf16 rows and queries with fp32 accumulation; the weighted sum of the rows' values) around a
 * softmax kernel: a real dense decode, unfused (it reads the rows twice; a fused FlashMLA kernel
 * reads them once, so dense_floor_over_kvtier is printed beside it). Without cuBLAS (the
 * emulation) no attention runs: both sides take a read floor instead (half a device-to-device
 * copy of the rows each attends, measured in the same run) and the line says
 * dense_floor_over_kvtier, not dense_over_kvtier.
 * Printed per case, exactly one line (the fields as bench_decode_step's):
 *   decode_step context=N data=D recall=R [scan=int8] dense_over_kvtier=X bytes_per_token=Y
 *   close_over_median=Z visited=V
 * then a detail line (the range over windows, the parts, the floor ratio).
 */
#ifndef KVT_BENCH_STEP_DECODE_H
#define KVT_BENCH_STEP_DECODE_H

#include "bench_decode_case.h"
#if KVT_HAVE_CUBLAS
#include "cuda/bench_attn.h"
#endif

typedef struct drig {
    dec_case c;
    const dec_data *g;
    kvt_buffer *idx, *len, *qbuf;
    kvt_emit e;
    void *stream;
    float q[DEC_H * DEC_KD], qs[DEC_H * DEC_KD];
    uint8_t row[DEC_ROW];
    double row_read; /* seconds to read one row (half a device copy): the floors */
    /* plan + run, the attention (or its floor), commit; the floor ratio (every row read once
     * against kvtier's step with its attention at its floor, the emitted rows read once) */
    double part[4];
#if KVT_HAVE_CUBLAS
    bench_attn *attn;
#endif
} drig;

/* The attention over n rows (slots: the emission's, NULL: rows 0 .. n of the plane), enqueued;
 * without cuBLAS nothing runs and its floor (n row reads) is returned, else 0. */
static double dattend(drig *r, const int32_t *slots, uint32_t n) {
#if KVT_HAVE_CUBLAS
    if (r->attn) {
        if (n && bench_attn_run(r->attn, r->c.plane, DEC_ROW, slots, n, (float)DEC_SCALE) != 0)
            die(KVT_ERR_NO_DEVICE, "attention (cuBLAS)");
        return 0.0;
    }
#endif
    (void)slots;
    return r->row_read * n;
}

/* One decode step at n_rows rows before it: kvtier's part and the dense attention, each timed
 * (wall, the stream synchronised; an attention's floor added where it does not run); *emitted:
 * the slots the run emitted. */
static void dstep(void *rv, uint64_t n_rows, double *t_kvt, double *t_dense, uint32_t *emitted) {
    drig *r = rv;
    kvt_status s = dec_step_begin(&r->c, r->g, n_rows, r->row, r->q, r->qs);
    if (s || (s = kvt_buffer_write(r->qbuf, 0, r->qs, sizeof r->qs)))
        die(s, "reserve");
#if KVT_HAVE_CUBLAS
    if (r->attn && bench_attn_set_query(r->attn, r->q) != 0)
        die(KVT_ERR_NO_DEVICE, "query");
#endif
    sync_stream(r->stream);
    double t0 = now_s();
    if ((s = kvt_batch_plan(r->c.b)) ||
        (s = kvt_batch_run(r->c.b, 0, kvt_buffer_ptr(r->qbuf), r->stream, &r->e)))
        die(s, "run");
    sync_stream(r->stream);
    const double tr = now_s();
    int32_t len = 0;
    if ((s = kvt_buffer_read(r->len, 0, &len, sizeof len)))
        die(s, "emitted count");
    double fl = dattend(r, (const int32_t *)kvt_buffer_ptr(r->idx), (uint32_t)len);
    sync_stream(r->stream);
    const double ta = now_s();
    if ((s = kvt_batch_commit(r->c.b, NULL)))
        die(s, "commit");
    sync_stream(r->stream);
    double t1 = now_s();
    r->part[0] += tr - t0;
    r->part[1] += ta - tr + fl;
    r->part[2] += t1 - ta;
    const double fd = dattend(r, NULL, (uint32_t)(n_rows + 1)); /* every row, its own too */
    sync_stream(r->stream);
    *t_dense = now_s() - t1 + fd;
    *t_kvt = t1 - t0 + fl;
    *emitted = (uint32_t)len;
    /* the floor ratio: every row read once against kvtier's step without its attention (nor
     * the count's read-back), with the emitted rows read once */
    r->part[3] += r->row_read * (double)(n_rows + 1) /
                  (t1 - t0 - (ta - tr) + r->row_read * (uint32_t)len);
}

/* One case: context N, data g, recall on (bits 16 / 8) or off; prefill from rows[0 .. N). */
static void dcase(kvt_backend_kind kind, void *stream, uint32_t N, const dec_data *g,
                  const uint8_t *rows, int recall, int bits, int R, int T) {
    char err[256];
    const char *what;
    static drig r;
    memset(&r, 0, sizeof r);
    r.g = g;
    r.stream = stream;
    kvt_status s = dec_open(&r.c, kind, N, g, recall, bits, err, sizeof err, &what);
    if (s)
        die(s, what);
    if ((s = kvt_buffer_alloc(r.c.ctx, sizeof(int32_t) * r.c.cap, &r.idx)) ||
        (s = kvt_buffer_alloc(r.c.ctx, sizeof(int32_t), &r.len)) ||
        (s = kvt_buffer_alloc(r.c.ctx, sizeof r.qs, &r.qbuf)))
        die(s, "request");
    r.e = (kvt_emit){.struct_size = sizeof(kvt_emit), .layout = KVT_EMIT_TOKENS,
                     .indices = kvt_buffer_ptr(r.idx), .capacity = r.c.cap,
                     .lengths = kvt_buffer_ptr(r.len)};
    r.row_read = read_floor(kind, stream, (size_t)N * DEC_ROW) / 2 / N;
#if KVT_HAVE_CUBLAS
    if (kind == KVT_BACKEND_CUDA) {
        r.attn = bench_attn_create(r.c.cap, DEC_H, DEC_KD, DEC_D, stream, err, sizeof err);
        if (!r.attn)
            fprintf(stderr, "bench_step: no cuBLAS attention (%s): the floors stand in\n", err);
    }
#endif
    const dec_bench b = {.prog = "bench_step", .c = &r.c, .g = g, .rows = rows, .rig = &r,
                         .step = dstep, .acc = r.part, .n_acc = 4};
    dec_result res;
    dec_measure(&b, N, recall, bits, R, T, &res);
    int real = 0;
#if KVT_HAVE_CUBLAS
    real = r.attn != NULL;
#endif
    dec_print_line(N, g->kind, recall, bits,
                   real ? "dense_over_kvtier" : "dense_floor_over_kvtier", &res);
    printf("  detail (%s backend): %s %.2f–%.2f over %d windows of %d steps; kvtier %.3f ms, "
           "dense %.3f ms (median window; %s); mean step: plan + run %.3f ms, attention %.3f ms, "
           "commit %.3f ms; dense_floor_over_kvtier %.1f (mean over the steps: every row read once "
           "against the step with its attention at its floor, the emitted rows read once); closing step %.3f ms; recall steps %llu, overflow "
           "%llu, fetched rows %llu\n",
           kvt_ctx_backend_name(r.c.ctx), real ? "dense_over_kvtier" : "dense_floor_over_kvtier",
           res.lo, res.hi, R, T, res.kvt_med * 1e3, res.dense_med * 1e3,
           real ? "attention: cuBLAS GEMM, softmax, GEMM on bf16 rows"
                : "no attention built: half a device copy of the rows each side reads",
           res.acc[0] * 1e3, res.acc[1] * 1e3, res.acc[2] * 1e3, res.acc[3], res.close_s * 1e3,
           (unsigned long long)res.rsteps, (unsigned long long)res.over,
           (unsigned long long)res.fetched);
    fflush(stdout);
#if KVT_HAVE_CUBLAS
    bench_attn_destroy(r.attn);
#endif
    kvt_buffer_free(r.idx);
    kvt_buffer_free(r.len);
    kvt_buffer_free(r.qbuf);
    dec_close(&r.c);
}

/* bench_step BACKEND decode [R (3)] [largest context in k rows (128)] [T steps (5)]
 * [scan bits: 16, 8 or both (both)] [data: structured, random or both (both)]: per context
 * (32k, 128k up to the largest; a largest below 32k runs that context alone: the emulation's
 * smoke) and data, recall at each precision asked, then recall off. */
static int decode_main(kvt_backend_kind kind, void *stream, int argc, char **argv) {
    int R = argc > 3 ? atoi(argv[3]) : 3;
    const uint32_t max_k = argc > 4 && atoi(argv[4]) > 0 ? (uint32_t)atoi(argv[4]) : 128;
    int T = argc > 5 ? atoi(argv[5]) : 5;
    const char *bits = argc > 6 ? argv[6] : "both", *which = argc > 7 ? argv[7] : "both";
    const int s16 = strcmp(bits, "8") != 0, s8 = strcmp(bits, "16") != 0;
    R = R < 1 ? 1 : R > DEC_MAXW ? DEC_MAXW : R;
    T = T < 1 ? 1 : T > DEC_MAXT ? DEC_MAXT : T;
    printf("bench_step decode: kvtier %s; ", kvt_version(0, 0, 0));
    dec_print_case();
    printf("; wall time, the stream synchronised%s\n",
#if KVT_HAVE_CUBLAS
           "; dense: cuBLAS attention over every row"
#else
           "; no cuBLAS here: the dense and sparse attentions at their read floors"
#endif
    );
    uint32_t ctxs[2] = {32768, 131072}, nc = 0;
    for (uint32_t c = 0; c < 2; c++)
        if (ctxs[c] <= max_k * 1024u)
            ctxs[nc++] = ctxs[c];
    if (nc == 0) {
        ctxs[0] = max_k * 1024u < 2 * DEC_BLK ? 2 * DEC_BLK : max_k * 1024u;
        nc = 1;
    }
    for (uint32_t c = 0; c < nc; c++)
        for (int structured = 1; structured >= 0; structured--) {
            if ((structured && strcmp(which, "random") == 0) ||
                (!structured && strcmp(which, "structured") == 0))
                continue;
            dec_data g;
            dec_data_init(&g, structured);
            /* the prefill's rows, generated once for the context's cases */
            const uint32_t N = ctxs[c];
            uint8_t *rows = malloc((size_t)DEC_ROW * N);
            if (!rows)
                die(KVT_ERR_OUT_OF_MEMORY, "rows");
            for (uint32_t i = 0; i < N; i++)
                dec_row(&g, i, rows + (size_t)i * DEC_ROW);
            if (s16)
                dcase(kind, stream, N, &g, rows, 1, 16, R, T);
            if (s8)
                dcase(kind, stream, N, &g, rows, 1, 8, R, T);
            dcase(kind, stream, N, &g, rows, 0, 16, R, T);
            free(rows);
            dec_data_free(&g);
        }
    return 0;
}

#endif
