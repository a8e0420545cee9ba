/*
 * bench_rope_step.c — one decode step of a GQA-RoPE layer with recall (issue 12 item 6) on the
 * CPU, side by side in one run: dense attention over every row against kvtier's step at 8×
 * (random eviction with the archive, prompt protected, the conformal trigger over rank-32 key
 * sketches), and the bytes a step moves out of the archive, with the archive in device memory
 * (the default) and in pinned host memory (kvt_ctx_params.archive_space HOST).
 *
 * Shape: 8 KV heads of 128 bf16 values, 32 query heads (G = 4), K = N/8 rows a head kept by the
 * one eviction round (at N rows), r = 64, a 16-row protected prompt. Keys: 90% of their energy
 * in a random rank-32 subspace per head (the basis given to the sketch), 10% isotropic; the
 * prompt's keys point along a per-head direction u that every query carries too (attention
 * sinks: a head's best attended score, ≈ 14.7, is a prompt row's, other rows score ≈ N(0, 1.3²)),
 * plus an isotropic part, so the trigger fires on a few archived rows, as on a model.
 *
 * Per context N, best and worst over `reps` steps (thread CPU time, single-threaded):
 *   (a) dense attention over all N rows (kernels/attn_f32.c: G query heads per KV head over a
 *       contiguous run of its keys, value = key, so it reads one plane: it flatters dense),
 *   (b) the same attention code over each KV head's emitted list (the held rows and the fetched
 *       ones, a gather),
 *   (c) kvtier's step: kvt_batch_plan + kvt_batch_run (the trigger: the best attended score per
 *       query head, the scan of the archive, the fetch copy, the CSR_KV_HEADS lists) + commit.
 * speedup = a / (b + c). Calibration steps (dense with a device archive; with a host archive each
 * query head's best archived row) are timed apart. Bytes: the archive's bytes per committed
 * token, and per step the bytes copied out of the archive (kvt_layer_stats.recall_moved_bytes:
 * with a host archive the bytes that cross the bus; calibration steps with a host archive also
 * read every archived key in place).
 *
 * Usage: bench_rope_step [reps (5)] [largest context in k rows (128)]
 */
#include "kernels/attn.h"
#include "kernels/kvt_hd.h"
#include "kvtier.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_util.h"

enum { H = 8, D = 128, G = 4, NQ = H * G, R = 64, PROMPT = 16, RANK = 32, ROWB = D * 2 };
#define Q_SHARED 10.0f
#define SINK_LEN 16.6f

static float gauss(void) { /* a sum of 4 uniforms, centred and scaled to unit variance */
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += (float)((rnd() >> 11) * 0x1p-53);
    return (s - 2.0f) * 1.7320508f;
}

static uint16_t bf16(float f) { /* round to nearest even (finite inputs) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(kvt_status s, const char *what) {
    fprintf(stderr, "bench_rope_step: %s: %s (%s)\n", what, kvt_status_name(s), kvt_last_error());
    exit(1);
}

#define OK(call, what)                                                                             \
    do {                                                                                           \
        kvt_status s_ = (call);                                                                    \
        if (s_ != KVT_OK)                                                                          \
            die(s_, what);                                                                         \
    } while (0)

typedef struct data {
    uint64_t n;
    uint16_t *k, *v;     /* [n][H][D] */
    float V[H][RANK * D];/* key bases */
    float u[H][D];       /* the sinks' direction per head */
} data;

static void make_data(data *x, uint64_t n) {
    x->n = n;
    x->k = malloc(sizeof(uint16_t) * n * H * D);
    x->v = malloc(sizeof(uint16_t) * n * H * D);
    for (int h = 0; h < H; h++) {
        bench_basis(x->V[h], RANK, D);
        double nn = 0;
        for (int d = 0; d < D; d++)
            x->u[h][d] = gauss();
        for (int d = 0; d < D; d++)
            nn += (double)x->u[h][d] * x->u[h][d];
        for (int d = 0; d < D; d++)
            x->u[h][d] /= (float)sqrt(nn);
    }
    const float sub = sqrtf(0.9f * D / RANK), iso = sqrtf(0.1f);
    float c[RANK], key[D];
    for (uint64_t i = 0; i < n; i++)
        for (int h = 0; h < H; h++) {
            for (int d = 0; d < D; d++)
                key[d] = i < PROMPT ? SINK_LEN * x->u[h][d] : iso * gauss();
            for (int j = 0; i >= PROMPT && j < RANK; j++)
                c[j] = sub * gauss();
            for (int j = 0; i >= PROMPT && j < RANK; j++)
                for (int d = 0; d < D; d++)
                    key[d] += c[j] * x->V[h][j * D + d];
            uint16_t *kp = x->k + (i * H + h) * D, *vp = x->v + (i * H + h) * D;
            for (int d = 0; d < D; d++) {
                kp[d] = bf16(key[d]);
                vp[d] = bf16(gauss());
            }
        }
}

static void make_queries(const data *x, float *q) {
    const float s = 1.0f / sqrtf((float)D);
    for (int t = 0; t < NQ; t++)
        for (int d = 0; d < D; d++)
            q[t * D + d] = s * (Q_SHARED * x->u[t / G][d] + gauss());
}

/* G query heads of KV head h over n rows of the K plane at base (slots or a contiguous run): the
 * few fetched rows of a head (value = key; a small share of the step). */
static void attend(const uint8_t *base, const int32_t *slots, uint32_t n, uint32_t h,
                   const float *q, float *out, float *scratch) {
    kvt__attn_f32_args a = {.base = base, .slots = slots, .n_rows = n,
                            .slot_stride = (size_t)H * ROWB, .row_offset = (size_t)h * ROWB,
                            .dtype = KVT__DT_BF16, .key_dim = D, .value_dim = D,
                            .q = q + (size_t)h * G * D, .n_heads = G, .q_stride = D, .scale = 1.0,
                            .out = out, .scratch = scratch};
    if (kvt__attn_f32_cpu(&a) != 0) {
        fprintf(stderr, "bench_rope_step: attention refused its arguments\n");
        exit(1);
    }
}

/* The dense baseline: exact softmax attention of every query head over rows [0, n) of the
 * shadow planes (K and V, bf16, [n][H][D]), fp32, AVX2/FMA, reading both planes once in order:
 * per tile of 64 rows, every KV head's G scores a row (16 vector FMAs each), an online softmax
 * (expf), then the value rows (16 vector FMAs a row and query head). Its time is compared with a
 * memcpy of the same bytes (its floor) in the output. */
enum { TILE = 64, DV = D / 8 };
__attribute__((target("avx2,fma"))) static inline __m256 bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

typedef struct dense_ws {
    __m256 acc[NQ][DV], qv[NQ][DV];
    float mx[NQ], l[NQ], sc[NQ][TILE];
} dense_ws;

__attribute__((target("avx2,fma"))) static void dense_gqa(const uint16_t *k, const uint16_t *v,
                                                          const int32_t *slots, uint64_t n,
                                                          const float *q, float *out,
                                                          dense_ws *w) {
    for (int t = 0; t < NQ; t++) {
        w->mx[t] = -INFINITY;
        w->l[t] = 0;
        for (int c = 0; c < DV; c++) {
            w->acc[t][c] = _mm256_setzero_ps();
            w->qv[t][c] = _mm256_loadu_ps(q + (size_t)t * D + 8 * c);
        }
    }
    for (uint64_t r0 = 0; r0 < n; r0 += TILE) {
        const uint32_t T = n - r0 < TILE ? (uint32_t)(n - r0) : TILE;
        for (uint32_t r = 0; r < T; r++)
            for (int h = 0; h < H; h++) {
                const uint64_t at = slots ? (uint64_t)slots[r0 + r] : r0 + r;
                const uint16_t *kr = k + (at * H + h) * D;
                __m256 a[G];
#pragma GCC unroll 4
                for (int g = 0; g < G; g++)
                    a[g] = _mm256_setzero_ps();
                for (int c = 0; c < DV; c++) {
                    const __m256 kv = bf16x8(kr + 8 * c);
    #pragma GCC unroll 4
                for (int g = 0; g < G; g++)
                        a[g] = _mm256_fmadd_ps(w->qv[h * G + g][c], kv, a[g]);
                }
                for (int g = 0; g < G; g++) {
                    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a[g]),
                                          _mm256_extractf128_ps(a[g], 1));
                    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
                    x = _mm_add_ss(x, _mm_movehdup_ps(x));
                    w->sc[h * G + g][r] = _mm_cvtss_f32(x);
                }
            }
        for (int t = 0; t < NQ; t++) {
            float m = w->mx[t];
            for (uint32_t r = 0; r < T; r++)
                m = w->sc[t][r] > m ? w->sc[t][r] : m;
            const float f = expf(w->mx[t] - m);
            w->l[t] *= f;
            for (int c = 0; c < DV; c++)
                w->acc[t][c] = _mm256_mul_ps(w->acc[t][c], _mm256_set1_ps(f));
            for (uint32_t r = 0; r < T; r++) {
                w->sc[t][r] = expf(w->sc[t][r] - m);
                w->l[t] += w->sc[t][r];
            }
            w->mx[t] = m;
        }
        for (uint32_t r = 0; r < T; r++)
            for (int h = 0; h < H; h++) {
                const uint64_t at = slots ? (uint64_t)slots[r0 + r] : r0 + r;
                const uint16_t *vr = v + (at * H + h) * D;
                for (int c = 0; c < DV; c++) {
                    const __m256 vv = bf16x8(vr + 8 * c);
    #pragma GCC unroll 4
                for (int g = 0; g < G; g++)
                        w->acc[h * G + g][c] = _mm256_fmadd_ps(_mm256_set1_ps(w->sc[h * G + g][r]),
                                                               vv, w->acc[h * G + g][c]);
                }
            }
    }
    for (int t = 0; t < NQ; t++)
        for (int c = 0; c < DV; c++)
            _mm256_storeu_ps(out + t * D + 8 * c,
                             _mm256_mul_ps(w->acc[t][c], _mm256_set1_ps(1.0f / w->l[t])));
}

/* Query head 4h of every KV head h leans on one random archived row of h (a fact asked for):
 * q += 0.3 · its key (the trigger should fetch it). */
static void aim(const data *x, const kvt_seq *seq, uint64_t n_rows, float *q) {
    for (uint32_t h = 0; h < H; h++)
        for (int tries = 0; tries < 64; tries++) {
            const uint64_t pos = PROMPT + rnd() % (n_rows - PROMPT);
            kvt_row_state st;
            int32_t slot;
            if (kvt_seq_row_state(seq, 0, h, pos, &st, &slot) != KVT_OK || st != KVT_ROW_ARCHIVED)
                continue;
            const uint16_t *k = x->k + (pos * H + h) * D;
            for (int d = 0; d < D; d++) {
                uint32_t u = (uint32_t)k[d] << 16;
                float f;
                memcpy(&f, &u, 4);
                q[(size_t)h * G * D + d] += 0.3f * f;
            }
            break;
        }
}

typedef struct result {
    double dense, attended, step, calib;    /* best seconds */
    double floor;                           /* memcpy of the bytes dense reads (both planes) */
    double dense_w, attended_w, step_w;     /* worst */
    uint32_t calib_steps;
    double fetched, moved, moved_calib;     /* per (measured / calibration) step, mean */
    uint64_t archive_bytes, n_tokens, pool_pages;
} result;

static void run_context(const data *x, uint64_t N, kvt_space space, int reps, result *res) {
    const uint64_t K = N / 8;
    kvt_layer_spec sp;
    OK(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, H, D, &sp), "spec");
    sp.n_q_heads = NQ;
    kvt_model *m;
    char err[256];
    OK(kvt_model_create(&sp, 1, "bench", &m, err, sizeof err), "model");
    kvt_config cfg = kvt_config_default();
    cfg.evict_budget_rows = (uint32_t)K;
    cfg.recent_rows = R;
    cfg.cadence_rows = (uint32_t)(N - K - R);
    cfg.evict_archive = true;
    cfg.recall = KVT_RECALL_CONFORMAL;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.config = &cfg;
    p.model = m;
    p.page_rows = 64;
    /* the table and, with a device archive, a fetch area as large as the request */
    p.n_pages = (uint32_t)(2 * (N + 4096) / 64);
    p.recall_sketch_rank = RANK;
    p.archive_space = space;
    kvt_ctx *ctx;
    OK(kvt_ctx_create(&p, &ctx, err, sizeof err), err);
    kvt_model_destroy(m);
    for (uint32_t h = 0; h < H; h++)
        OK(kvt_ctx_set_recall_head_basis(ctx, 0, h, x->V[h], RANK), "basis");
    kvt_seq_params qp = kvt_seq_default_params();
    qp.request_id = 1;
    qp.prompt_rows = PROMPT;
    kvt_seq *seq;
    OK(kvt_seq_create(ctx, &qp, &seq), "sequence");
    kvt_batch *b;
    OK(kvt_batch_create(ctx, 1, &b), "batch");
    const size_t slot = (size_t)H * ROWB;
    /* the prefill up to one row short of the round; its rows come from the data's first rows,
     * the decode steps' after them (the data holds N + the steps' rows) */
    uint32_t first = (uint32_t)(N - 1), one = 1;
    OK(kvt_batch_reserve(b, &seq, &first, 1), "reserve");
    OK(kvt_seq_write(seq, 0, 0, 0, first, x->k, first * slot), "write");
    OK(kvt_seq_write(seq, 0, 1, 0, first, x->v, first * slot), "write");
    OK(kvt_batch_plan(b), "plan");
    OK(kvt_batch_commit(b, NULL), "commit");
    const uint64_t cap = (uint64_t)H * (N + 4096);
    kvt_buffer *qb, *ib, *pb;
    OK(kvt_buffer_alloc(ctx, sizeof(float) * NQ * D, &qb), "buffer");
    OK(kvt_buffer_alloc(ctx, sizeof(int32_t) * cap, &ib), "buffer");
    OK(kvt_buffer_alloc(ctx, sizeof(int32_t) * (H + 1), &pb), "buffer");
    void *kbase, *vbase;
    size_t kbytes;
    OK(kvt_layer_data(ctx, 0, 0, &kbase, &kbytes), "layer data"); /* host memory on the CPU */
    OK(kvt_layer_data(ctx, 0, 1, &vbase, &kbytes), "layer data");
    float q[NQ * D], out[G * D], dout[NQ * D];
    dense_ws *dws = aligned_alloc(64, sizeof(dense_ws));
    float *scratch = malloc(sizeof(float) * kvt__attn_f32_scratch_floats(G, D, D));
    memset(res, 0, sizeof *res);
    res->dense = res->attended = res->step = res->calib = 1e30;
    uint64_t row = first, fetched = 0, measured = 0, moved = 0, moved_calib = 0;
    for (int step = 0; measured < (uint64_t)reps; step++) {
        if (row >= x->n)
            die(KVT_ERR_CAPACITY, "the data ran out of rows (calibration took too long)");
        make_queries(x, q);
        if (step % 2 == 0 && step > 0)
            aim(x, seq, row, q);
        OK(kvt_buffer_write(qb, 0, q, sizeof q), "queries");
        OK(kvt_batch_reserve(b, &seq, &one, 1), "reserve");
        OK(kvt_seq_write(seq, 0, 0, 0, 1, x->k + row * H * D, slot), "write");
        OK(kvt_seq_write(seq, 0, 1, 0, 1, x->v + row * H * D, slot), "write");
        row++;
        kvt_emit em = {.struct_size = sizeof em, .layout = KVT_EMIT_CSR_KV_HEADS,
                       .indices = kvt_buffer_ptr(ib), .capacity = cap,
                       .indptr = kvt_buffer_ptr(pb), .queries_per_seq = 1};
        double t = cpu_s();
        OK(kvt_batch_plan(b), "plan");
        OK(kvt_batch_run(b, 0, kvt_buffer_ptr(qb), NULL, &em), "run");
        OK(kvt_batch_commit(b, NULL), "commit");
        t = cpu_s() - t;
        kvt_layer_stats ls = {.struct_size = sizeof ls};
        OK(kvt_seq_layer_stats(seq, 0, &ls), "stats");
        if (step == 0) { /* the round's step (its trigger may calibrate already) */
            res->calib_steps = (uint32_t)ls.recall_calib_steps;
            continue;
        }
        if (ls.recall_last_archived && ls.recall_calib_steps > res->calib_steps) {
            res->calib_steps++;
            moved_calib += ls.recall_last_moved_bytes;
            res->calib = t < res->calib ? t : res->calib;
            continue;
        }
        const int32_t *indptr = kvt_buffer_ptr(pb), *idx = kvt_buffer_ptr(ib);
        /* every head lists the held rows first (the same slots), then its fetched ones */
        const uint32_t held = (uint32_t)(ls.attended_rows);
        double ta = cpu_s();
        dense_gqa(kbase, vbase, idx, held, q, dout, dws);
        for (uint32_t h = 0; h < H; h++)
            if ((uint32_t)(indptr[h + 1] - indptr[h]) > held)
                attend(kbase, idx + indptr[h] + held, (uint32_t)(indptr[h + 1] - indptr[h]) - held,
                       h, q, out, scratch);
        ta = cpu_s() - ta;
        double td = cpu_s();
        dense_gqa(x->k, x->v, NULL, row, q, dout, dws);
        td = cpu_s() - td;
        res->step = t < res->step ? t : res->step;
        res->step_w = t > res->step_w ? t : res->step_w;
        res->attended = ta < res->attended ? ta : res->attended;
        res->attended_w = ta > res->attended_w ? ta : res->attended_w;
        res->dense = td < res->dense ? td : res->dense;
        res->dense_w = td > res->dense_w ? td : res->dense_w;
        fetched += ls.recall_last_fetched;
        moved += ls.recall_last_moved_bytes;
        measured++;
        res->archive_bytes = ls.archive_bytes;
        res->n_tokens = ls.appended_rows / H;
        res->pool_pages = ls.pages_in_use;
    }
    res->fetched = (double)fetched / (double)measured;
    res->moved = (double)moved / (double)measured;
    res->moved_calib = res->calib_steps ? (double)moved_calib / res->calib_steps : 0;
    res->floor = memcpy_best((size_t)row * H * ROWB * 2, 3);
    free(scratch);
    free(dws);
    kvt_buffer_free(qb);
    kvt_buffer_free(ib);
    kvt_buffer_free(pb);
    kvt_batch_destroy(b);
    kvt_seq_destroy(seq);
    kvt_ctx_destroy(ctx);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    int maxk = argc > 2 ? atoi(argv[2]) : 128;
    if (reps < 1)
        reps = 1;
    printf("GQA-RoPE decode step, 8 KV heads x 128 bf16, 32 query heads, 8x (K = N/8, r = 64), "
           "conformal recall, rank-32 key sketches; thread CPU time, best [worst] of %d steps\n",
           reps);
    for (int k = 32; k <= maxk; k *= 4) {
        const uint64_t N = (uint64_t)k * 1024;
        data x;
        make_data(&x, N + 256); /* the decode steps' rows after the prefill's */
        for (int sp = 0; sp < 2; sp++) {
            result r;
            run_context(&x, N, sp ? KVT_SPACE_HOST : KVT_SPACE_DEVICE, reps, &r);
            printf("N %3dk, archive in %-6s dense (a) %7.2f [%7.2f] ms | attended (b) %6.2f "
                   "[%6.2f] ms | step (c) %7.2f [%7.2f] ms | a/(b+c) %.2f | calibration steps %u, "
                   "best %.1f ms\n",
                   k, sp ? "host" : "device", r.dense * 1e3, r.dense_w * 1e3, r.attended * 1e3,
                   r.attended_w * 1e3, r.step * 1e3, r.step_w * 1e3,
                   r.dense / (r.attended + r.step), r.calib_steps, r.calib * 1e3);
            printf("         dense = %.2fx a memcpy of the %.0f MB it reads (%.2f ms)\n",
                   r.dense / r.floor, (double)(N + reps) * H * ROWB * 2 / 1e6, r.floor * 1e3);
            printf("         archive %.0f B per token (%.1f MB), fetched %.1f (row, KV head) "
                   "pairs a step = %.1f kB moved a step (calibration steps: %.1f kB), pool pages "
                   "%llu\n",
                   (double)r.archive_bytes / (double)r.n_tokens, r.archive_bytes / 1e6,
                   r.fetched, r.moved / 1e3, r.moved_calib / 1e3,
                   (unsigned long long)r.pool_pages);
        }
        free(x.k);
        free(x.v);
    }
    return 0;
}
