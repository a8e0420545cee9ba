/*
 * bench_tiers.c — what the CPU tiers cost, as ratios to memcpy of the same bytes measured in the
 * same run (machines are shared; absolute times drift, ratios much less):
 *   1. salience block close (σ of 4096 rows + global top-m) vs memcpy of the block's rows;
 *   2. one random-eviction round (per-head draws, top-K, compaction, page trim) vs memcpy of the
 *      rows it keeps, per-head and shared-draw;
 *   3. the attended set in FlashMLA's layout at 128k context, 32x, vs memcpy of as many int32s.
 * Each figure is the best of several repetitions. Usage: bench_tiers [reps]
 */
#include "kvtier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = 0x1234567;
static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill_bf16(uint8_t *p, size_t n_values) {
    uint16_t *v = (uint16_t *)p;
    for (size_t i = 0; i < n_values; i++)
        v[i] = (uint16_t)(0x3c00u + (rnd() & 0x3ffu)) ^ (uint16_t)((rnd() & 1u) << 15);
}

static double memcpy_best(size_t bytes, int reps) {
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t = now_s();
        memcpy(b, a, bytes);
        t = now_s() - t;
        if (t < best)
            best = t;
    }
    volatile uint8_t sink = b[bytes / 2];
    (void)sink;
    free(a);
    free(b);
    return best;
}

static void die(kvt_status s, const char *what, const char *detail) {
    fprintf(stderr, "bench_tiers: %s: %s (%s)\n", what, kvt_status_name(s), detail);
    exit(1);
}

static void bench_salience(int reps) {
    const uint32_t B = 4096;
    kvt_layer_spec spec;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &spec);
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(&spec, 1, "bench", &m, err, sizeof err);
    if (s)
        die(s, "model", err);
    uint8_t *rows = malloc((size_t)B * 1152);
    fill_bf16(rows, (size_t)B * 576);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        kvt_ctx_params p = kvt_ctx_default_params();
        p.model = m;
        p.n_pages = 17 * 4096 / 64;
        kvt_ctx *ctx;
        if ((s = kvt_ctx_create(&p, &ctx, err, sizeof err)))
            die(s, "context", err);
        kvt_seq *seq;
        kvt_seq_create(ctx, 1, &seq);
        /* 16 blocks to build history, time the 17th close (global top-m over 69,632 rows). */
        for (int b = 0; b < 17; b++) {
            if ((s = kvt_seq_reserve(seq, B)))
                die(s, "reserve", kvt_last_error());
            kvt_seq_write(seq, 0, 0, 0, B, rows, (size_t)B * 1152);
            double t = now_s();
            s = kvt_seq_commit(seq, B);
            t = now_s() - t;
            if (s)
                die(s, "commit", kvt_last_error());
            if (b == 16 && t < best)
                best = t;
        }
        kvt_ctx_destroy(ctx);
    }
    double mc = memcpy_best((size_t)B * 1152, reps * 4);
    printf("salience close   B=4096 rows, 69,632 closed: %8.3f ms  = %6.1f ns/row  = %5.2fx memcpy "
           "of the block (%.3f ms)\n",
           best * 1e3, best * 1e9 / B, best / mc, mc * 1e3);
    free(rows);
    kvt_model_destroy(m);
}

static void bench_evict(int reps, bool shared) {
    const uint32_t L = 8, H = 8, D = 128, K = 1024, R = 64;
    kvt_layer_spec specs[8];
    for (uint32_t l = 0; l < L; l++)
        kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, H, D, &specs[l]);
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(specs, L, "bench", &m, err, sizeof err);
    if (s)
        die(s, "model", err);
    uint32_t n = K + R + R; /* the round fires at K + r + c rows */
    size_t slot = (size_t)H * D * 2;
    uint8_t *rows = malloc((size_t)n * slot);
    fill_bf16(rows, (size_t)n * H * D);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        kvt_ctx_params p = kvt_ctx_default_params();
        kvt_config p_cfg = kvt_config_default();
        p.config = &p_cfg;
        p.model = m;
        p.n_pages = 64;
        p_cfg.evict_budget_rows = K;
        p_cfg.recent_rows = R;
        p_cfg.evict_shared_draw = shared;
        kvt_ctx *ctx;
        if ((s = kvt_ctx_create(&p, &ctx, err, sizeof err)))
            die(s, "context", err);
        kvt_seq *seq;
        kvt_seq_create(ctx, (uint64_t)r + 1, &seq);
        kvt_seq_set_prompt_rows(seq, 128);
        if ((s = kvt_seq_reserve(seq, n - 1)))
            die(s, "reserve", kvt_last_error());
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t pl = 0; pl < 2; pl++)
                kvt_seq_write(seq, l, pl, 0, n - 1, rows, (size_t)(n - 1) * slot);
        kvt_seq_commit(seq, n - 1);
        kvt_seq_reserve(seq, 1);
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t pl = 0; pl < 2; pl++)
                kvt_seq_write(seq, l, pl, 0, 1, rows, slot);
        double t = now_s();
        s = kvt_seq_commit(seq, 1); /* this commit runs the round */
        t = now_s() - t;
        if (s)
            die(s, "commit", kvt_last_error());
        kvt_layer_stats ls = {.struct_size = sizeof ls};
        kvt_seq_layer_stats(seq, 0, &ls);
        if (ls.rounds != 1)
            die(KVT_ERR_INVARIANT, "round did not run", "");
        if (t < best)
            best = t;
        kvt_ctx_destroy(ctx);
    }
    size_t kept_bytes = (size_t)(K + R) * slot * 2 * L;
    double mc = memcpy_best(kept_bytes, reps * 4);
    printf("evict round      %u layers x %u heads x %u, K=%u r=c=%u, %s draw: %8.3f ms  = %5.2fx "
           "memcpy of the kept rows (%.3f ms, %.1f MB)\n",
           L, H, D, K, R, shared ? "shared  " : "per-head", best * 1e3, best / mc, mc * 1e3,
           kept_bytes / 1e6);
    free(rows);
    kvt_model_destroy(m);
}

static void bench_attended(int reps) {
    const uint32_t N = 131072, B = 4096;
    kvt_layer_spec spec;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &spec);
    kvt_model *m;
    char err[256];
    kvt_model_create(&spec, 1, "bench", &m, err, sizeof err);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = N / 64 + 64;
    kvt_ctx *ctx;
    kvt_status s = kvt_ctx_create(&p, &ctx, err, sizeof err);
    if (s)
        die(s, "context", err);
    kvt_seq *seq;
    kvt_seq_create(ctx, 1, &seq);
    uint8_t *rows = malloc((size_t)B * 1152);
    fill_bf16(rows, (size_t)B * 576);
    for (uint32_t b = 0; b < N / B; b++) {
        kvt_seq_reserve(seq, B);
        kvt_seq_write(seq, 0, 0, 0, B, rows, (size_t)B * 1152);
        if ((s = kvt_seq_commit(seq, B)))
            die(s, "commit", kvt_last_error());
    }
    uint32_t cnt;
    kvt_attended_count(ctx, 0, &seq, 1, &cnt);
    int32_t *idx = malloc(sizeof(int32_t) * cnt);
    int32_t len;
    double best = 1e30;
    for (int r = 0; r < reps * 10; r++) {
        double t = now_s();
        kvt_attended_tokens(ctx, 0, &seq, 1, NULL, NULL, idx, cnt, &len);
        t = now_s() - t;
        if (t < best)
            best = t;
    }
    double mc = memcpy_best(sizeof(int32_t) * cnt, reps * 10);
    double dense = memcpy_best((size_t)N * 1152, reps);
    printf("attended set     128k context at 32x (%u rows): %8.3f ms = %5.1fx memcpy of the "
           "indices; %.4f of one dense read of the layer (%.3f ms)\n",
           cnt, best * 1e3, best / mc, best / dense, dense * 1e3);
    free(idx);
    free(rows);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    if (reps < 1)
        reps = 1;
    printf("bench_tiers: kvtier %s, CPU backend, best of %d\n", kvt_version(0, 0, 0), reps);
    bench_salience(reps);
    bench_evict(reps, false);
    bench_evict(reps, true);
    bench_attended(reps);
    return 0;
}
