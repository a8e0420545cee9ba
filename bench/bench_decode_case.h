/* bench_decode_case.h — issue 34's decode-step case, defined once for its two benches:
 * bench/kernels/bench_decode_step.c (the CPU backend, one thread, against a CPU attention) and
 * bench_step's decode mode (bench_step_decode.h: a backend of the caller's choice, the device).
 *
 * The case: one absorbed-MLA NoPE salience layer (bf16 rows of 576 values: 512 latent | 64
 * branch; 32 query heads; ratio 32, B = 4096, 4 sinks), one request prefilled to N − B/2 rows in
 * 4096-row chunks (every close happens there); recall conformal (rank-64 sketches,
 * params.recall_scan_bits 16 or 8) or off. The data (dec_data, dec_row, dec_query):
 *   structured  latents with 90% of their energy in a rank-64 subspace, 4 sink rows along a
 *               direction every query shares, an isotropic branch; the recall basis that subspace;
 *   random      isotropic rows and queries, no sinks; a random rank-64 basis;
 *   needle      a kvtier-needle trace (dec_data_init_trace; bench/needle_data.sh writes it): its
 *               rows and its decode phase's queries (filler and no-salience needle queries, in
 *               the trace's order), the basis file beside it (the generator's query subspace).
 *               The trace's decode phase starts at N − B/2 rows, where the timed steps of the
 *               other data start; rows past the trace's (the closing step's fill) repeat its
 *               rows from the sinks on, and steps past its decode phase its queries.
 * The measurement (dec_measure, over a bench's own step): calibration steps (recall: untimed,
 * until the layer's recall_calib_steps stops growing), R windows of T timed steps, then the
 * request filled to one row short of its open block's end and one step that closes the block;
 * what the step reads per context row (bytes_per_token), the archived rows the scans visited, and
 * the one line both benches print per case (dec_print_line):
 *   decode_step context=N data=D recall=R [scan=int8] dense_over_kvtier=X bytes_per_token=Y
 *   close_over_median=Z visited=V
 * Public API only (bench/: lib/kvtier.h and bench/'s own headers).
 */
#ifndef KVT_BENCH_DECODE_CASE_H
#define KVT_BENCH_DECODE_CASE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_data.h"
#include "kvtier.h"
#include "kvtier_trace.h"

enum { DEC_H = 32, DEC_KD = 576, DEC_D = 512, DEC_BD = 64, DEC_RANK = 64, DEC_BLK = 4096,
       DEC_SINKS = 4, DEC_RATIO = 32, DEC_ROW = DEC_KD * 2, DEC_MAXW = 16, DEC_MAXT = 64 };
#define DEC_SCALE 0.07216878364870322
#define DEC_Q_SHARED 10.0f
#define DEC_SINK_LEN 16.6f

enum { DEC_RANDOM = 0, DEC_STRUCTURED = 1, DEC_NEEDLE = 2 };

typedef struct dec_data {
    int kind;        /* DEC_RANDOM, DEC_STRUCTURED or DEC_NEEDLE */
    float *basis;    /* [DEC_RANK][DEC_D] orthonormal */
    float u[DEC_KD]; /* the sinks' and the queries' shared direction (structured) */
    /* needle: the trace's rows [t_n][DEC_ROW], its decode queries [t_steps][DEC_H][DEC_KD]
     * (unscaled), the rows before its decode phase (decode step k appends row t_start + k) */
    uint8_t *t_rows;
    float *t_q;
    uint64_t t_n, t_start;
    uint32_t t_steps;
} dec_data;

static inline const char *dec_kind_name(int kind) {
    return kind == DEC_NEEDLE ? "needle" : kind == DEC_STRUCTURED ? "structured" : "random";
}

/* The case's data: its basis, then the sinks' direction (both drawn, whatever the data). */
static inline void dec_data_init(dec_data *g, int structured) {
    memset(g, 0, sizeof *g);
    g->kind = structured ? DEC_STRUCTURED : DEC_RANDOM;
    g->basis = malloc(sizeof(float) * DEC_RANK * DEC_D);
    if (!g->basis) {
        fprintf(stderr, "decode case: out of memory\n");
        exit(1);
    }
    orthonormal_f32(DEC_RANK, DEC_D, g->basis);
    double un = 0;
    for (uint32_t i = 0; i < DEC_KD; i++) {
        g->u[i] = gauss();
        un += (double)g->u[i] * g->u[i];
    }
    for (uint32_t i = 0; i < DEC_KD; i++)
        g->u[i] /= (float)sqrt(un);
}

/* The needle data at N rows: the trace at `trace` (its first layer: MLA-NoPE, DEC_H heads of
 * DEC_KD queries, rows of DEC_ROW bytes, a decode phase that starts at N − B/2 rows) and the
 * basis file at `basis` (rank DEC_RANK, dim DEC_D), both read whole. Exits with a message on a
 * file that does not fit. */
static inline void dec_data_init_trace(dec_data *g, const char *trace, const char *basis,
                                       uint32_t N) {
    memset(g, 0, sizeof *g);
    g->kind = DEC_NEEDLE;
    char err[256] = "";
    kvt_trace *t = NULL;
    kvt_trace_layer li;
    kvt_recall_basis_info bi;
    uint64_t pos = 0;
    kvt_status s = kvt_trace_open(trace, &t, err, sizeof err);
    if (s || (s = kvt_trace_layer_info(t, 0, &li))) {
        fprintf(stderr, "decode case: %s: %s (%s)\n", trace, kvt_status_name(s),
                t ? kvt_trace_last_error(t) : err);
        exit(1);
    }
    const uint64_t start = li.n_tokens > li.n_steps ? li.n_tokens - li.n_steps : 0;
    if (li.spec.kind != KVT_LAYER_MLA_NOPE || li.n_q_heads != DEC_H || li.q_dim != DEC_KD ||
        li.spec.n_kv_heads != 1 || li.spec.row_bytes != DEC_ROW || li.n_steps < 2 ||
        li.n_steps > 4096 || kvt_trace_query_position(t, 0, 0, &pos) || pos != start + 1 ||
        start != (uint64_t)N - DEC_BLK / 2) {
        fprintf(stderr,
                "decode case: %s: not this case's trace (want an MLA-NoPE layer of %d heads and "
                "%d B rows whose decode phase starts at %u rows; bench/needle_data.sh writes one)\n",
                trace, DEC_H, DEC_ROW, N - DEC_BLK / 2);
        exit(1);
    }
    g->t_n = li.n_tokens;
    g->t_start = start;
    g->t_steps = (uint32_t)li.n_steps;
    g->t_rows = malloc((size_t)DEC_ROW * g->t_n);
    g->t_q = malloc(sizeof(float) * DEC_H * DEC_KD * g->t_steps);
    g->basis = malloc(sizeof(float) * DEC_RANK * DEC_D);
    if (!g->t_rows || !g->t_q || !g->basis) {
        fprintf(stderr, "decode case: out of memory\n");
        exit(1);
    }
    s = kvt_trace_read_rows(t, 0, 0, 0, g->t_n, g->t_rows, (size_t)DEC_ROW * g->t_n);
    for (uint32_t k = 0; !s && k < g->t_steps; k++)
        s = kvt_trace_read_query(t, 0, k, KVT_DTYPE_FP32, g->t_q + (size_t)k * DEC_H * DEC_KD,
                                 sizeof(float) * DEC_H * DEC_KD, NULL);
    if (s) {
        fprintf(stderr, "decode case: %s: %s (%s)\n", trace, kvt_status_name(s),
                kvt_trace_last_error(t));
        exit(1);
    }
    kvt_trace_close(t);
    if ((s = kvt_recall_basis_read(basis, &bi, g->basis, (size_t)DEC_RANK * DEC_D)) ||
        bi.rank != DEC_RANK || bi.dim != DEC_D) {
        fprintf(stderr, "decode case: %s: %s (want rank %d, dim %d)\n", basis,
                s ? kvt_status_name(s) : "another shape", DEC_RANK, DEC_D);
        exit(1);
    }
}

static inline void dec_data_free(dec_data *g) {
    free(g->basis);
    free(g->t_rows);
    free(g->t_q);
    g->basis = NULL;
    g->t_rows = NULL;
    g->t_q = NULL;
}

/* Row r of the request, bf16 (r < DEC_SINKS: a sink on structured data). */
static inline void dec_row(const dec_data *g, uint32_t r, uint8_t *row) {
    if (g->kind == DEC_NEEDLE) { /* past the trace: its rows again from the sinks on */
        const uint64_t i = r < g->t_n ? r : DEC_SINKS + (r - g->t_n) % (g->t_start - DEC_SINKS);
        memcpy(row, g->t_rows + i * DEC_ROW, DEC_ROW);
        return;
    }
    if (g->kind == DEC_RANDOM) {
        for (uint32_t i = 0; i < DEC_KD; i++)
            store_bf16(row, i, gauss());
        return;
    }
    structured_row(row, r, DEC_SINKS, g->u, DEC_SINK_LEN, g->basis, DEC_RANK, DEC_D, DEC_BD);
}

/* The queries of the step at n_rows rows before it: q (unscaled, for the attention) and qs =
 * DEC_SCALE·q (the library's). */
static inline void dec_query(const dec_data *g, uint64_t n_rows, float *q, float *qs) {
    if (g->kind == DEC_NEEDLE) { /* decode step n_rows − t_start, its queries again past them */
        const uint64_t k = (n_rows >= g->t_start ? n_rows - g->t_start : 0) % g->t_steps;
        memcpy(q, g->t_q + k * DEC_H * DEC_KD, sizeof(float) * DEC_H * DEC_KD);
        for (uint32_t i = 0; i < DEC_H * DEC_KD; i++)
            qs[i] = (float)DEC_SCALE * q[i];
        return;
    }
    for (uint32_t i = 0; i < DEC_H * DEC_KD; i++) {
        q[i] = gauss() + (g->kind == DEC_STRUCTURED ? DEC_Q_SHARED * g->u[i % DEC_KD] : 0.0f);
        qs[i] = (float)DEC_SCALE * q[i];
    }
}

/* "%d heads, bf16 MLA rows of %d B, ratio %d, B = %d, rank %d": the case in a bench's header. */
static inline void dec_print_case(void) {
    printf("%d heads, bf16 MLA rows of %d B, ratio %d, B = %d, rank %d", DEC_H, DEC_ROW, DEC_RATIO,
           DEC_BLK, DEC_RANK);
}

/* The case's objects: a model of the one layer, a context for N rows (and room for the closing
 * fill) on backend kind, the request and its batch; plane: the layer's rows. */
typedef struct dec_case {
    kvt_model *m;
    kvt_ctx *ctx;
    kvt_seq *seq;
    kvt_batch *b;
    const uint8_t *plane;
    uint32_t cap; /* the request's rows at most */
} dec_case;

/* Create the case's objects (recall: conformal at bits 16 or 8, with g's basis). On an error the
 * status, and in *what the message to print with it (err or the call that failed). */
static inline kvt_status dec_open(dec_case *c, kvt_backend_kind kind, uint32_t N,
                                  const dec_data *g, int recall, int bits, char *err, size_t n_err,
                                  const char **what) {
    memset(c, 0, sizeof *c);
    *what = err;
    kvt_layer_spec spec;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, DEC_D, DEC_BD, &spec);
    spec.n_q_heads = DEC_H;
    kvt_status s = kvt_model_create(&spec, 1, "bench-mla", &c->m, err, n_err);
    if (s)
        return s;
    c->cap = N + 2 * DEC_BLK;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = c->m;
    p.page_rows = 64;
    p.max_rows_per_seq = c->cap;
    p.n_pages = c->cap / 64 + 2;
    p.backend = kind;
    kvt_config cfg = kvt_config_default();
    cfg.ratio = DEC_RATIO;
    cfg.block_rows = DEC_BLK;
    cfg.sink_rows = DEC_SINKS;
    if (recall) {
        cfg.recall = KVT_RECALL_CONFORMAL;
        p.recall_sketch_rank = DEC_RANK;
        p.recall_scan_bits = (uint32_t)bits;
    }
    p.config = &cfg;
    if ((s = kvt_ctx_create(&p, &c->ctx, err, n_err)))
        return s;
    *what = "basis";
    if (recall && (s = kvt_ctx_set_recall_basis(c->ctx, 0, g->basis, DEC_RANK)))
        return s;
    *what = "plane";
    size_t plane_bytes = 0;
    void *base = NULL;
    if ((s = kvt_layer_data(c->ctx, 0, 0, &base, &plane_bytes)))
        return s;
    c->plane = base;
    *what = "request";
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 1;
    if ((s = kvt_seq_create(c->ctx, &sp, &c->seq)) || (s = kvt_batch_create(c->ctx, 1, &c->b)))
        return s;
    return KVT_OK;
}

static inline void dec_close(dec_case *c) {
    kvt_batch_destroy(c->b);
    kvt_seq_destroy(c->seq);
    kvt_ctx_destroy(c->ctx);
    kvt_model_destroy(c->m);
    memset(c, 0, sizeof *c);
}

/* The rows the request holds. */
static inline uint64_t dec_rows(kvt_seq *seq) {
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(seq, 0, &ls);
    return ls.appended_rows;
}

static inline int dec_cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0 .. n) (sorts v). */
static inline double dec_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, dec_cmp);
    return v[n / 2];
}

/* Append n rows to c's request in chunks of B (a prefill's: no run): rows[at ..] where rows is
 * given (generated beforehand), else g's from the generator. */
static inline kvt_status dec_fill(const dec_case *c, const dec_data *g, uint32_t n,
                                  const uint8_t *rows) {
    uint8_t *buf = rows ? NULL : malloc((size_t)DEC_ROW * DEC_BLK);
    if (!rows && !buf)
        return KVT_ERR_OUT_OF_MEMORY;
    kvt_seq *seq = c->seq;
    kvt_status s = KVT_OK;
    while (n && !s) {
        const uint32_t k = n < DEC_BLK ? n : DEC_BLK;
        const uint64_t at = dec_rows(seq);
        for (uint32_t i = 0; !rows && i < k; i++)
            dec_row(g, (uint32_t)(at + i), buf + (size_t)i * DEC_ROW);
        const uint8_t *src = rows ? rows + at * DEC_ROW : buf;
        if (!(s = kvt_batch_reserve(c->b, &seq, &k, 1)) &&
            !(s = kvt_seq_write(seq, 0, 0, 0, k, src, (size_t)k * DEC_ROW)))
            s = kvt_batch_commit(c->b, NULL);
        n -= k;
    }
    free(buf);
    return s;
}

/* A decode step's untimed start (the forward's work): row n_rows and the step's queries drawn
 * (into row, q, qs), the row reserved and written. */
static inline kvt_status dec_step_begin(const dec_case *c, const dec_data *g, uint64_t n_rows,
                                        uint8_t *row, float *q, float *qs) {
    const uint32_t one = 1;
    kvt_seq *seq = c->seq;
    dec_row(g, (uint32_t)n_rows, row);
    dec_query(g, n_rows, q, qs);
    kvt_status s = kvt_batch_reserve(c->b, &seq, &one, 1);
    return s ? s : kvt_seq_write(seq, 0, 0, 0, 1, row, DEC_ROW);
}

/* A bench's side of the measurement: its case, its data, its step. */
typedef struct dec_bench {
    const char *prog; /* the bench's name, in its error messages */
    const dec_case *c;
    const dec_data *g;
    const uint8_t *rows; /* the prefill's rows, generated beforehand (NULL: the generator) */
    void *rig;
    /* one decode step at n_rows rows before it: kvtier's part and the dense attention, each
     * timed; *emitted: the slots the run emitted */
    void (*step)(void *rig, uint64_t n_rows, double *t_kvt, double *t_dense, uint32_t *emitted);
    double *acc; /* the step's own sums (n_acc of them): zeroed after the calibration */
    int n_acc;
} dec_bench;

/* dec_fill or exit with a message. */
static inline void dec_fill_or_die(const dec_bench *b, uint32_t n, const uint8_t *rows) {
    kvt_status s = dec_fill(b->c, b->g, n, rows);
    if (s) {
        fprintf(stderr, "%s: prefill: %s (%s)\n", b->prog, kvt_status_name(s), kvt_last_error());
        exit(1);
    }
}

enum { DEC_MAXACC = 8 };
/* Steps after a close that build its group blocks (KVT__RECALL_GROUP_LAG at most), and more. */
enum { DEC_AFTER = 12 };

typedef struct dec_result {
    double ratio, lo, hi;   /* dense ÷ kvtier: median window, range over the windows */
    double kvt_med, dense_med; /* the median window's median steps (s) */
    double bytes_per_token, visited, close_s, close_over_median;
    double after_close_max_s; /* the slowest of the DEC_AFTER steps after the closing one */
    double window_max_s;      /* the slowest timed step of the windows */
    double acc[DEC_MAXACC]; /* the step's sums over the timed steps, per step */
    uint64_t rsteps, over, fetched; /* recall steps, overflow steps, fetched rows (timed) */
} dec_result;

/* Run the case at N rows through b (R windows of T steps; recall and bits as the context's). */
static inline void dec_measure(const dec_bench *b, uint32_t N, int recall, int bits, int R, int T,
                               dec_result *out) {
    memset(out, 0, sizeof *out);
    kvt_seq *seq = b->c->seq;
    /* prefill to mid-block: N − B closed rows and an open block of B/2 (the timed steps see
     * N − B/2 rows, dense attention alike) */
    dec_fill_or_die(b, N - DEC_BLK / 2, b->rows);
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    double tk, td;
    uint32_t em;
    uint64_t n = dec_rows(seq);
    for (int i = 0; recall && i < 256; i++) { /* calibration (untimed) */
        uint64_t before = (kvt_seq_layer_stats(seq, 0, &ls), ls.recall_calib_steps);
        b->step(b->rig, n++, &tk, &td, &em);
        kvt_seq_layer_stats(seq, 0, &ls);
        if (ls.recall_calib_steps == before && i > 0)
            break;
    }
    /* DEC_AFTER steps more (untimed), so that the windows time the steady state well after the
     * first scan step (which builds every closed block's groups, kvt__recall_groups_want); the
     * steps right after a close, which build its group blocks one a step, are timed below */
    for (int i = 0; recall && i < DEC_AFTER; i++)
        b->step(b->rig, n++, &tk, &td, &em);
    kvt_seq_layer_stats(seq, 0, &ls);
    memset(b->acc, 0, sizeof(double) * (size_t)b->n_acc);
    const uint64_t v0 = ls.recall_visited_rows, f0 = ls.recall_fetched_rows,
                   o0 = ls.recall_overflow_steps, st0 = ls.recall_steps;
    double ratio_w[DEC_MAXW], kvt_w[DEC_MAXW], dense_w[DEC_MAXW], bytes = 0, arch = 0;
    /* what the scan reads of a visited row: the fp16 sketch, the bf16 branch and ρ; at 8 bits
     * the row's 8-bit plane (six fp32 values, the branch and sketch bytes padded to 4) and ρ */
    const double scan_row = bits == 8 ? 24.0 + (double)((DEC_BD + DEC_RANK + 3) / 4 * 4) + 4.0
                                      : 2.0 * DEC_RANK + 2.0 * DEC_BD + 4.0;
    const double dec_group_row = 4.0 + (4.0 * (DEC_BD + DEC_RANK) + 4.0 + 20.0) / 32.0;
    for (int w = 0; w < R; w++) {
        double kt[DEC_MAXT], dt[DEC_MAXT];
        for (int t = 0; t < T; t++) {
            kvt_layer_stats b4 = {.struct_size = sizeof b4};
            kvt_seq_layer_stats(seq, 0, &b4);
            b->step(b->rig, n++, &kt[t], &dt[t], &em);
            kvt_seq_layer_stats(seq, 0, &ls);
            const double vis = (double)(ls.recall_visited_rows - b4.recall_visited_rows);
            const double fet = (double)(ls.recall_fetched_rows - b4.recall_fetched_rows);
            /* attended without recall = emitted − fetched (a dense step fetched every archived) */
            const double att = (double)em - fet;
            /* a step that visited fewer rows than it archived ran the pruned scan: it read the
             * group planes of every grouped row as allocated (20.75 B a row at rank 64: perm 4 B,
             * a group slot's end, centre and statistics per 32 rows) */
            const double archs = recall ? (double)ls.recall_last_archived : 0.0;
            const double grp = vis < archs ? archs * dec_group_row : 0.0;
            bytes += ((double)em * DEC_ROW + (recall ? att * DEC_ROW : 0.0) + vis * scan_row +
                      grp + 4.0 * em) /
                     (double)(n);
            arch += recall ? (double)ls.recall_last_archived : 0.0;
        }
        for (int t = 0; t < T; t++)
            out->window_max_s = kt[t] > out->window_max_s ? kt[t] : out->window_max_s;
        kvt_w[w] = dec_median(kt, T);
        dense_w[w] = dec_median(dt, T);
        ratio_w[w] = dense_w[w] / kvt_w[w];
    }
    kvt_seq_layer_stats(seq, 0, &ls);
    for (int i = 0; i < b->n_acc && i < DEC_MAXACC; i++)
        out->acc[i] = b->acc[i] / (R * T);
    out->visited = arch > 0 ? (double)(ls.recall_visited_rows - v0) / arch : 0.0;
    out->fetched = ls.recall_fetched_rows - f0;
    out->over = ls.recall_overflow_steps - o0;
    out->rsteps = ls.recall_steps - st0;
    double kv_sorted[DEC_MAXW], ratios[DEC_MAXW], dn_sorted[DEC_MAXW];
    out->lo = 1e30;
    out->hi = 0;
    for (int w = 0; w < R; w++) {
        out->lo = ratio_w[w] < out->lo ? ratio_w[w] : out->lo;
        out->hi = ratio_w[w] > out->hi ? ratio_w[w] : out->hi;
        kv_sorted[w] = kvt_w[w];
        ratios[w] = ratio_w[w];
        dn_sorted[w] = dense_w[w];
    }
    out->ratio = dec_median(ratios, R);
    out->kvt_med = dec_median(kv_sorted, R);
    out->dense_med = dec_median(dn_sorted, R);
    out->bytes_per_token = bytes / (R * T);

    /* the closing step: fill to one row short of the open block's end, then one step */
    kvt_seq_layer_stats(seq, 0, &ls);
    const uint64_t open = ls.appended_rows - ls.closed_rows;
    if (open + 1 < DEC_BLK)
        dec_fill_or_die(b, (uint32_t)(DEC_BLK - 1 - open), NULL);
    n = dec_rows(seq);
    const uint64_t closes = (kvt_seq_layer_stats(seq, 0, &ls), ls.closes);
    double tcd;
    b->step(b->rig, n++, &out->close_s, &tcd, &em);
    kvt_seq_layer_stats(seq, 0, &ls);
    if (ls.closes != closes + 1) {
        fprintf(stderr, "%s: the closing step closed %llu blocks\n", b->prog,
                (unsigned long long)(ls.closes - closes));
        exit(1);
    }
    out->close_over_median = out->close_s / out->kvt_med;
    /* the steps right after it (the new block's groups are built there, one block a step) */
    for (int i = 0; i < DEC_AFTER; i++) {
        double t;
        b->step(b->rig, n++, &t, &tcd, &em);
        out->after_close_max_s = t > out->after_close_max_s ? t : out->after_close_max_s;
    }
}

/* The case's line; ratio_name: dense_over_kvtier, or dense_floor_over_kvtier where both sides
 * are read floors. */
static inline void dec_print_line(uint32_t N, int kind, int recall, int bits,
                                  const char *ratio_name, const dec_result *r) {
    printf("decode_step context=%u data=%s recall=%s%s %s=%.1f bytes_per_token=%.0f "
           "close_over_median=%.1f visited=%.2f\n",
           N, dec_kind_name(kind), recall ? "conformal" : "off",
           recall && bits == 8 ? " scan=int8" : "", ratio_name, r->ratio, r->bytes_per_token,
           r->close_over_median, r->visited);
}

#endif
