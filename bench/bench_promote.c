/*
 * bench_promote.c — what recall promotion (docs/recall.md §4.2) costs and saves in a decode step,
 * measured side by side in one run through the public API. One MLA-NoPE layer (bf16, 512 + 64),
 * H query heads, B = 4096, ratio 32, sound recall, rank-64 basis; latents inside the basis's span
 * plus a little noise. Every step's queries are random in that span plus two "hot" rows out of
 * HOT recurring ones (a needle the request keeps returning to): without promotion they are
 * fetched again and again, with it they join the promoted set. Contexts with C = 0 (off) and
 * C = 64 step in lockstep over the same rows and queries; each step's kvt_batch_run is timed
 * (the recall step, pack), interleaved. Prints per config the median and best step, and the mean
 * fetched and promoted rows; ratios to C = 0 measured in the same run.
 */
#include "bench_util.h"

#include <kvtier.h>

#include <stdio.h>

#define B 4096u
#define D 512u
#define QD 576u
#define RANK 64u
#define H 8u
#define N0 (4u * B + 100u) /* rows before the first decode step */
#define STEPS 96u
#define HOT 16u
#define NC 2

static float V[RANK * D];
static uint32_t hot[HOT];

static double gauss(void) {
    double u = ((double)(rnd() >> 11) + 0.5) * 0x1p-53, v = (double)(rnd() >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static uint16_t bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* A row: latent = Σ_k a_k V_k (k < 16) + noise, branch random. */
static void make_row(uint8_t *row) {
    float c[D];
    for (uint32_t d = 0; d < D; d++)
        c[d] = (float)(0.02 * gauss());
    for (uint32_t k = 0; k < 16; k++) {
        float a = (float)gauss();
        for (uint32_t d = 0; d < D; d++)
            c[d] += a * V[k * D + d];
    }
    uint16_t *p = (uint16_t *)(void *)row;
    for (uint32_t d = 0; d < D; d++)
        p[d] = bf16(c[d]);
    for (uint32_t j = 0; j < 64; j++)
        p[D + j] = bf16((float)gauss());
}

/* Queries: random in the span, each head drawn towards two hot rows. */
static void make_queries(const uint8_t *rows, float *q) {
    for (uint32_t h = 0; h < H; h++) {
        float *qh = q + (size_t)h * QD;
        for (uint32_t i = 0; i < QD; i++)
            qh[i] = (float)gauss() * (i < D ? 0.02f : 0.2f);
        for (uint32_t k = 0; k < 16; k++) {
            float a = (float)gauss() * 0.2f;
            for (uint32_t d = 0; d < D; d++)
                qh[d] += a * V[k * D + d];
        }
        const uint16_t *t = (const uint16_t *)(const void *)(rows +
                                                             (size_t)hot[rnd() % HOT] * 1152);
        for (uint32_t i = 0; i < QD; i++)
            qh[i] += 0.4f * from_bf16(t[i]);
    }
}

typedef struct run {
    kvt_ctx *ctx;
    kvt_seq *seq;
    kvt_batch *b;
    kvt_buffer *qbuf, *ibuf, *lbuf;
    double t[STEPS];
    uint64_t fetched, promoted;
} run;

static int open_run(run *r, kvt_model *m, uint32_t cap, const uint8_t *rows) {
    kvt_config c = kvt_config_default();
    c.recall = KVT_RECALL_SOUND;
    c.recall_promote_capacity = cap;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 64;
    p.n_pages = (N0 + STEPS + 64) / 64 + 2;
    p.recall_sketch_rank = RANK;
    char err[256];
    if (kvt_ctx_create(&p, &r->ctx, err, sizeof err) != KVT_OK ||
        kvt_ctx_set_recall_basis(r->ctx, 0, V, RANK) != KVT_OK ||
        kvt_seq_create(r->ctx, NULL, &r->seq) != KVT_OK ||
        kvt_batch_create(r->ctx, 1, &r->b) != KVT_OK ||
        kvt_buffer_alloc(r->ctx, sizeof(float) * QD * H, &r->qbuf) != KVT_OK ||
        kvt_buffer_alloc(r->ctx, sizeof(int32_t) * (N0 + STEPS + 8), &r->ibuf) != KVT_OK ||
        kvt_buffer_alloc(r->ctx, sizeof(int32_t), &r->lbuf) != KVT_OK) {
        fprintf(stderr, "bench_promote: %s %s\n", err, kvt_last_error());
        return 1;
    }
    uint32_t n = N0;
    if (kvt_batch_reserve(r->b, &r->seq, &n, 1) != KVT_OK ||
        kvt_seq_write(r->seq, 0, 0, 0, N0, rows, (size_t)N0 * 1152) != KVT_OK ||
        kvt_batch_plan(r->b) != KVT_OK || kvt_batch_commit(r->b, NULL) != KVT_OK) {
        fprintf(stderr, "bench_promote: prefill: %s\n", kvt_last_error());
        return 1;
    }
    return 0;
}

/* One decode step of r with this row and these queries; its run timed into r->t[step]. */
static int step(run *r, uint32_t s, const uint8_t *row, const float *q) {
    uint32_t one = 1, topk;
    if (kvt_batch_reserve(r->b, &r->seq, &one, 1) != KVT_OK ||
        kvt_seq_write(r->seq, 0, 0, 0, 1, row, 1152) != KVT_OK || kvt_batch_plan(r->b) != KVT_OK ||
        kvt_batch_capacity(r->b, 0, &topk, NULL) != KVT_OK ||
        kvt_buffer_write(r->qbuf, 0, q, sizeof(float) * QD * H) != KVT_OK)
        return 1;
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                  .indices = kvt_buffer_ptr(r->ibuf), .capacity = topk,
                  .lengths = kvt_buffer_ptr(r->lbuf)};
    double t = now_s();
    kvt_status st = kvt_batch_run(r->b, 0, kvt_buffer_ptr(r->qbuf), NULL, &e);
    r->t[s] = now_s() - t;
    if (st != KVT_OK || kvt_batch_commit(r->b, NULL) != KVT_OK)
        return 1;
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    if (kvt_seq_layer_stats(r->seq, 0, &ls) != KVT_OK)
        return 1;
    r->fetched += ls.recall_last_fetched;
    r->promoted += ls.recall_last_promoted;
    return 0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(void) {
    kvt_layer_spec sp;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, D, 64, &sp);
    sp.n_q_heads = H;
    kvt_model *m;
    if (kvt_model_create(&sp, 1, "bench_promote", &m, NULL, 0) != KVT_OK)
        return 1;
    bench_basis(V, RANK, D);
    uint8_t *rows = malloc((size_t)(N0 + STEPS) * 1152);
    for (uint32_t u = 0; u < N0 + STEPS; u++)
        make_row(rows + (size_t)u * 1152);
    for (uint32_t i = 0; i < HOT; i++)
        hot[i] = 100u + (uint32_t)(rnd() % (4u * B - 200u));
    const uint32_t caps[NC] = {0, 64};
    static run r[NC];
    for (int c = 0; c < NC; c++)
        if (open_run(&r[c], m, caps[c], rows))
            return 1;
    static float q[QD * H];
    for (uint32_t s = 0; s < STEPS; s++) {
        make_queries(rows, q);
        for (int c = 0; c < NC; c++)
            if (step(&r[c], s, rows + (size_t)(N0 + s) * 1152, q)) {
                fprintf(stderr, "bench_promote: step %u: %s\n", s, kvt_last_error());
                return 1;
            }
    }
    printf("decode steps of one MLA-NoPE layer (%u heads, %u rows, sound recall, rank %u), %u "
           "steps:\n",
           H, N0, RANK, STEPS);
    double med[NC];
    for (int c = 0; c < NC; c++) {
        qsort(r[c].t, STEPS, sizeof(double), cmp);
        med[c] = r[c].t[STEPS / 2];
        printf("  C %3u: median %8.1f us  best %8.1f us  x%.3f (median)  fetched %.1f, promoted "
               "%.1f rows a step\n",
               caps[c], med[c] * 1e6, r[c].t[0] * 1e6, med[c] / med[0],
               (double)r[c].fetched / STEPS, (double)r[c].promoted / STEPS);
    }
    for (int c = 0; c < NC; c++)
        kvt_ctx_destroy(r[c].ctx);
    kvt_model_destroy(m);
    free(rows);
    return 0;
}
