/* bench_step_decode.h — bench_step's decode mode (`bench_step cuda decode ...`): issue 34's case,
 * one decode step of one absorbed-MLA NoPE layer as an engine runs it on the device, through the
 * public API, against a dense attention over every row in the same run; bench/kernels/
 * bench_decode_step.c's case and line, on a backend of the caller's choice (the CUDA backend on a
 * device, or under the emulation at a tiny size: ctest's cuda_emu_bench_step_decode).
 *
 * A context of one salience layer (bf16 rows of 576 values: 512 latent | 64 branch; 32 query
 * heads; ratio 32, B = 4096, 4 sinks), one request prefilled to N − B/2 rows in 4096-row chunks
 * (every close happens there). Data as bench_decode_step's (its own generator here, public API
 * only): structured — latents with 90% of their energy in a rank-64 subspace, 4 sink rows along
 * a direction every query shares, the recall basis that subspace; random — isotropic rows and
 * queries, a random rank-64 basis. Recall conformal (rank-64 sketches, params.recall_scan_bits 16
 * or 8) or off. Each step, timed on the wall clock with the stream synchronised:
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

#if KVT_HAVE_CUBLAS
#include "cuda/bench_attn.h"
#endif

enum { DH = 32, DKD = 576, DD = 512, DBD = 64, DRANK = 64, DBLK = 4096, DSINKS = 4, DRATIO = 32,
       DROW = DKD * 2, DMAXW = 16, DMAXT = 64 };
#define DSCALE 0.07216878364870322
#define DQ_SHARED 10.0f
#define DSINK_LEN 16.6f

/* A sum of 4 uniforms, centred and scaled to unit variance. */
static float dgauss(void) {
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += (float)((rnd() >> 11) * 0x1p-53);
    return (s - 2.0f) * 1.7320508f;
}

static uint16_t to_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    if ((b & 0x7f800000u) == 0x7f800000u)
        return (uint16_t)(b >> 16);
    b += 0x7fffu + ((b >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(b >> 16);
}

typedef struct ddata {
    int structured;
    float basis[DRANK * DD]; /* orthonormal rows */
    float u[DKD];            /* the sinks' and queries' shared direction (structured) */
} ddata;

/* Row r (bf16 [512 latent | 64 branch]): bench_decode_step's generator. */
static void drow(const ddata *g, uint32_t r, uint16_t *row) {
    if (!g->structured) {
        for (uint32_t i = 0; i < DKD; i++)
            row[i] = to_bf16(dgauss());
        return;
    }
    if (r < DSINKS) {
        for (uint32_t i = 0; i < DKD; i++)
            row[i] = to_bf16(DSINK_LEN * g->u[i] + 0.3f * dgauss());
        return;
    }
    float a[DRANK], c[DD];
    for (uint32_t k = 0; k < DRANK; k++)
        a[k] = dgauss() * sqrtf(0.9f * (float)DD / (float)DRANK);
    for (uint32_t d = 0; d < DD; d++)
        c[d] = sqrtf(0.1f) * dgauss();
    for (uint32_t k = 0; k < DRANK; k++)
        for (uint32_t d = 0; d < DD; d++)
            c[d] += a[k] * g->basis[(size_t)k * DD + d];
    for (uint32_t d = 0; d < DD; d++)
        row[d] = to_bf16(c[d]);
    for (uint32_t j = 0; j < DBD; j++)
        row[DD + j] = to_bf16(dgauss());
}

typedef struct drig {
    kvt_ctx *ctx;
    kvt_seq *seq;
    kvt_batch *b;
    const uint8_t *plane; /* the layer's plane (backend memory) */
    kvt_buffer *idx, *len, *qbuf;
    kvt_emit e;
    void *stream;
    float q[DH * DKD], qs[DH * DKD];
    uint16_t row[DKD];
    double row_read; /* seconds to read one row (half a device copy): the floors */
    double part[3];  /* plan + run, the attention (or its floor), commit */
#if KVT_HAVE_CUBLAS
    bench_attn *attn;
#endif
} drig;

static uint64_t drows(const drig *r) {
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(r->seq, 0, &ls);
    return ls.appended_rows;
}

/* Append n rows in chunks (a prefill's: no run), from rows (pre-generated) or the generator. */
static void dfill(drig *r, const ddata *g, uint32_t n, const uint16_t *rows) {
    uint16_t *buf = rows ? NULL : malloc(sizeof(uint16_t) * DKD * DBLK);
    while (n) {
        const uint32_t c = n < DBLK ? n : DBLK;
        const uint64_t at = drows(r);
        const uint16_t *src = rows ? rows + at * DKD : buf;
        for (uint32_t i = 0; !rows && i < c; i++)
            drow(g, (uint32_t)(at + i), buf + (size_t)i * DKD);
        kvt_status s = kvt_batch_reserve(r->b, &r->seq, &c, 1);
        if (s || (s = kvt_seq_write(r->seq, 0, 0, 0, c, src, (size_t)c * DROW)) ||
            (s = kvt_batch_commit(r->b, NULL)))
            die(s, "prefill");
        n -= c;
    }
    free(buf);
}

/* The attention over n rows (slots: the emission's, NULL: rows 0 .. n of the plane), enqueued;
 * without cuBLAS nothing runs and its floor (n row reads) is returned, else 0. */
static double dattend(drig *r, const int32_t *slots, uint32_t n) {
#if KVT_HAVE_CUBLAS
    if (r->attn) {
        if (n && bench_attn_run(r->attn, r->plane, DROW, slots, n, (float)DSCALE) != 0)
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
static void dstep(drig *r, const ddata *g, uint64_t n_rows, double *t_kvt, double *t_dense,
                  double *t_att, uint32_t *emitted) {
    const uint32_t one = 1;
    drow(g, (uint32_t)n_rows, r->row);
    for (uint32_t i = 0; i < DH * DKD; i++) {
        r->q[i] = dgauss() + (g->structured ? DQ_SHARED * g->u[i % DKD] : 0.0f);
        r->qs[i] = (float)DSCALE * r->q[i];
    }
    kvt_status s = kvt_batch_reserve(r->b, &r->seq, &one, 1);
    if (s || (s = kvt_seq_write(r->seq, 0, 0, 0, 1, r->row, DROW)) ||
        (s = kvt_buffer_write(r->qbuf, 0, r->qs, sizeof r->qs)))
        die(s, "reserve");
#if KVT_HAVE_CUBLAS
    if (r->attn && bench_attn_set_query(r->attn, r->q) != 0)
        die(KVT_ERR_NO_DEVICE, "query");
#endif
    sync_stream(r->stream);
    double t0 = now_s();
    if ((s = kvt_batch_plan(r->b)) ||
        (s = kvt_batch_run(r->b, 0, kvt_buffer_ptr(r->qbuf), r->stream, &r->e)))
        die(s, "run");
    sync_stream(r->stream);
    const double tr = now_s();
    int32_t len = 0;
    if ((s = kvt_buffer_read(r->len, 0, &len, sizeof len)))
        die(s, "emitted count");
    double fl = dattend(r, (const int32_t *)kvt_buffer_ptr(r->idx), (uint32_t)len);
    sync_stream(r->stream);
    const double ta = now_s();
    if ((s = kvt_batch_commit(r->b, NULL)))
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
    *t_att = ta - tr + fl; /* the count's read-back and the attention (or its floor) */
    *emitted = (uint32_t)len;
}

static int dcmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double dmedian(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, dcmp);
    return v[n / 2];
}

/* One case: context N, data g, recall on (bits 16 / 8) or off; prefill from rows[0 .. N). */
static void dcase(kvt_backend_kind kind, void *stream, uint32_t N, const ddata *g,
                  const uint16_t *rows, int recall, int bits, int R, int T) {
    kvt_layer_spec spec;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, DD, DBD, &spec);
    spec.n_q_heads = DH;
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(&spec, 1, "bench-mla", &m, err, sizeof err);
    if (s)
        die(s, err);
    const uint32_t cap = N + 2 * DBLK;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.page_rows = 64;
    p.max_rows_per_seq = cap;
    p.n_pages = cap / 64 + 2;
    p.backend = kind;
    kvt_config cfg = kvt_config_default();
    cfg.ratio = DRATIO;
    cfg.block_rows = DBLK;
    cfg.sink_rows = DSINKS;
    if (recall) {
        cfg.recall = KVT_RECALL_CONFORMAL;
        p.recall_sketch_rank = DRANK;
        p.recall_scan_bits = (uint32_t)bits;
    }
    p.config = &cfg;
    static drig r;
    memset(&r, 0, sizeof r);
    r.stream = stream;
    if ((s = kvt_ctx_create(&p, &r.ctx, err, sizeof err)))
        die(s, err);
    if (recall && (s = kvt_ctx_set_recall_basis(r.ctx, 0, g->basis, DRANK)))
        die(s, "basis");
    void *base = NULL;
    size_t plane_bytes = 0;
    if ((s = kvt_layer_data(r.ctx, 0, 0, &base, &plane_bytes)))
        die(s, "plane");
    r.plane = base;
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 1;
    if ((s = kvt_seq_create(r.ctx, &sp, &r.seq)) || (s = kvt_batch_create(r.ctx, 1, &r.b)) ||
        (s = kvt_buffer_alloc(r.ctx, sizeof(int32_t) * cap, &r.idx)) ||
        (s = kvt_buffer_alloc(r.ctx, sizeof(int32_t), &r.len)) ||
        (s = kvt_buffer_alloc(r.ctx, sizeof r.qs, &r.qbuf)))
        die(s, "request");
    r.e = (kvt_emit){.struct_size = sizeof(kvt_emit), .layout = KVT_EMIT_TOKENS,
                     .indices = kvt_buffer_ptr(r.idx), .capacity = cap,
                     .lengths = kvt_buffer_ptr(r.len)};
    r.row_read = read_floor(kind, stream, (size_t)N * DROW) / 2 / N;
#if KVT_HAVE_CUBLAS
    if (kind == KVT_BACKEND_CUDA) {
        r.attn = bench_attn_create(cap, DH, DKD, DD, stream, err, sizeof err);
        if (!r.attn)
            fprintf(stderr, "bench_step: no cuBLAS attention (%s): the floors stand in\n", err);
    }
#endif
    /* prefill to mid-block: N − B closed rows and an open block of B/2 */
    dfill(&r, g, N - DBLK / 2, rows);
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    double tk, td, ta;
    uint32_t em;
    uint64_t n = drows(&r);
    for (int i = 0; recall && i < 256; i++) { /* calibration (untimed) */
        uint64_t before = (kvt_seq_layer_stats(r.seq, 0, &ls), ls.recall_calib_steps);
        dstep(&r, g, n++, &tk, &td, &ta, &em);
        kvt_seq_layer_stats(r.seq, 0, &ls);
        if (ls.recall_calib_steps == before && i > 0)
            break;
    }
    kvt_seq_layer_stats(r.seq, 0, &ls);
    memset(r.part, 0, sizeof r.part);
    const uint64_t v0 = ls.recall_visited_rows, f0 = ls.recall_fetched_rows,
                   o0 = ls.recall_overflow_steps, st0 = ls.recall_steps;
    double ratio_w[DMAXW], kvt_w[DMAXW], dense_w[DMAXW], bytes = 0, arch = 0, floor_r = 0;
    /* what the scan reads of a visited row: the fp16 sketch, the bf16 branch and ρ; at 8 bits
     * the row's 8-bit plane (six fp32 values, the branch and sketch bytes padded to 4) and ρ */
    const double scan_row = bits == 8 ? 24.0 + (double)((DBD + DRANK + 3) / 4 * 4) + 4.0
                                      : 2.0 * DRANK + 2.0 * DBD + 4.0;
    for (int w = 0; w < R; w++) {
        double kt[DMAXT], dt[DMAXT];
        for (int t = 0; t < T; t++) {
            kvt_layer_stats b4 = {.struct_size = sizeof b4};
            kvt_seq_layer_stats(r.seq, 0, &b4);
            dstep(&r, g, n++, &kt[t], &dt[t], &ta, &em);
            kvt_seq_layer_stats(r.seq, 0, &ls);
            const double vis = (double)(ls.recall_visited_rows - b4.recall_visited_rows);
            const double fet = (double)(ls.recall_fetched_rows - b4.recall_fetched_rows);
            const double att = (double)em - fet; /* attended without recall */
            bytes += ((double)em * DROW + (recall ? att * DROW : 0.0) + vis * scan_row +
                      4.0 * em) /
                     (double)n;
            arch += recall ? (double)ls.recall_last_archived : 0.0;
            /* the floor ratio: every row read once against kvtier's step with its attention
             * at its floor (the emitted rows read once) */
            floor_r += r.row_read * (double)n / (kt[t] - ta + r.row_read * em);
        }
        kvt_w[w] = dmedian(kt, T);
        dense_w[w] = dmedian(dt, T);
        ratio_w[w] = dense_w[w] / kvt_w[w];
    }
    kvt_seq_layer_stats(r.seq, 0, &ls);
    double part[3];
    for (int i = 0; i < 3; i++)
        part[i] = r.part[i] / (R * T);
    const double visited = arch > 0 ? (double)(ls.recall_visited_rows - v0) / arch : 0.0;
    const uint64_t fetched = ls.recall_fetched_rows - f0, over = ls.recall_overflow_steps - o0,
                   rsteps = ls.recall_steps - st0;
    double lo = 1e30, hi = 0, kv_sorted[DMAXW], ratios[DMAXW], dn_sorted[DMAXW];
    for (int w = 0; w < R; w++) {
        lo = ratio_w[w] < lo ? ratio_w[w] : lo;
        hi = ratio_w[w] > hi ? ratio_w[w] : hi;
        kv_sorted[w] = kvt_w[w];
        ratios[w] = ratio_w[w];
        dn_sorted[w] = dense_w[w];
    }
    const double ratio = dmedian(ratios, R), kvt_med = dmedian(kv_sorted, R),
                 dense_med = dmedian(dn_sorted, R);
    /* the closing step: fill to one row short of the open block's end, then one step */
    kvt_seq_layer_stats(r.seq, 0, &ls);
    const uint64_t open = ls.appended_rows - ls.closed_rows;
    if (open + 1 < DBLK)
        dfill(&r, g, (uint32_t)(DBLK - 1 - open), NULL);
    n = drows(&r);
    const uint64_t closes = (kvt_seq_layer_stats(r.seq, 0, &ls), ls.closes);
    double tc, tcd;
    dstep(&r, g, n++, &tc, &tcd, &ta, &em);
    kvt_seq_layer_stats(r.seq, 0, &ls);
    if (ls.closes != closes + 1) {
        fprintf(stderr, "bench_step: the closing step closed %llu blocks\n",
                (unsigned long long)(ls.closes - closes));
        exit(1);
    }
    int real = 0;
#if KVT_HAVE_CUBLAS
    real = r.attn != NULL;
#endif
    printf("decode_step context=%u data=%s recall=%s%s %s=%.1f bytes_per_token=%.0f "
           "close_over_median=%.1f visited=%.2f\n",
           N, g->structured ? "structured" : "random", recall ? "conformal" : "off",
           recall && bits == 8 ? " scan=int8" : "",
           real ? "dense_over_kvtier" : "dense_floor_over_kvtier", ratio, bytes / (R * T),
           tc / kvt_med, visited);
    printf("  detail (%s backend): %s %.2f–%.2f over %d windows of %d steps; kvtier %.3f ms, "
           "dense %.3f ms (median window; %s); mean step: plan + run %.3f ms, attention %.3f ms, "
           "commit %.3f ms; dense_floor_over_kvtier %.1f (mean over the steps: every row read once "
           "against the step with its attention at its floor, the emitted rows read once); closing step %.3f ms; recall steps %llu, overflow "
           "%llu, fetched rows %llu\n",
           kvt_ctx_backend_name(r.ctx), real ? "dense_over_kvtier" : "dense_floor_over_kvtier",
           lo, hi, R, T, kvt_med * 1e3, dense_med * 1e3,
           real ? "attention: cuBLAS GEMM, softmax, GEMM on bf16 rows"
                : "no attention built: half a device copy of the rows each side reads",
           part[0] * 1e3, part[1] * 1e3, part[2] * 1e3, floor_r / (R * T), tc * 1e3,
           (unsigned long long)rsteps, (unsigned long long)over, (unsigned long long)fetched);
    fflush(stdout);
#if KVT_HAVE_CUBLAS
    bench_attn_destroy(r.attn);
#endif
    kvt_buffer_free(r.idx);
    kvt_buffer_free(r.len);
    kvt_buffer_free(r.qbuf);
    kvt_batch_destroy(r.b);
    kvt_seq_destroy(r.seq);
    kvt_ctx_destroy(r.ctx);
    kvt_model_destroy(m);
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
    R = R < 1 ? 1 : R > DMAXW ? DMAXW : R;
    T = T < 1 ? 1 : T > DMAXT ? DMAXT : T;
    printf("bench_step decode: kvtier %s; %d heads, bf16 MLA rows of %d B, ratio %d, B = %d, "
           "rank %d; wall time, the stream synchronised%s\n",
           kvt_version(0, 0, 0), DH, DROW, DRATIO, DBLK, DRANK,
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
        ctxs[0] = max_k * 1024u < 2 * DBLK ? 2 * DBLK : max_k * 1024u;
        nc = 1;
    }
    static ddata g;
    for (uint32_t c = 0; c < nc; c++)
        for (int structured = 1; structured >= 0; structured--) {
            if ((structured && strcmp(which, "random") == 0) ||
                (!structured && strcmp(which, "structured") == 0))
                continue;
            g.structured = structured;
            bench_basis(g.basis, DRANK, DD);
            double un = 0;
            for (uint32_t i = 0; i < DKD; i++) {
                g.u[i] = dgauss();
                un += (double)g.u[i] * g.u[i];
            }
            for (uint32_t i = 0; i < DKD; i++)
                g.u[i] /= (float)sqrt(un);
            /* the prefill's rows, generated once for the context's cases */
            const uint32_t N = ctxs[c];
            uint16_t *rows = malloc(sizeof(uint16_t) * DKD * N);
            if (!rows)
                die(KVT_ERR_OUT_OF_MEMORY, "rows");
            for (uint32_t i = 0; i < N; i++)
                drow(&g, i, rows + (size_t)i * DKD);
            if (s16)
                dcase(kind, stream, N, &g, rows, 1, 16, R, T);
            if (s8)
                dcase(kind, stream, N, &g, rows, 1, 8, R, T);
            dcase(kind, stream, N, &g, rows, 0, 16, R, T);
            free(rows);
        }
    return 0;
}

#endif
