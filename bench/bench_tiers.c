/*
 * bench_tiers.c — what the CPU tiers cost, as ratios to memcpy of the same bytes measured in the
 * same run (machines are shared; absolute times drift, ratios much less):
 *   1. salience block close (σ of 4096 rows + global top-m) vs memcpy of the block's rows;
 *   2. one random-eviction round (per-head draws, top-K, compaction, page trim) vs memcpy of the
 *      rows it keeps, per-head and shared-draw;
 *   3. the attended set in FlashMLA's layout at 128k context, 32x, vs memcpy of as many int32s;
 *   4. (and the decode step of a batch, below); prefix sharing: memory of n forked children vs
 *      unshared requests, and the forks' cost vs copying the prompt; the salience side planes
 *      (σ, sketches) they share (`bench_tiers REPS side`: those figures alone).
 * Each figure is the best of several repetitions. Usage: bench_tiers [reps]
 */
#include "kvtier.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"

static void fill_bf16(uint8_t *p, size_t n_values) {
    uint16_t *v = (uint16_t *)p;
    for (size_t i = 0; i < n_values; i++)
        v[i] = (uint16_t)(0x3c00u + (rnd() & 0x3ffu)) ^ (uint16_t)((rnd() & 1u) << 15);
}

static void die(kvt_status s, const char *what, const char *detail) {
    fprintf(stderr, "bench_tiers: %s: %s (%s)\n", what, kvt_status_name(s), detail);
    exit(1);
}

/* A request of its own with the given id (defaults otherwise). */
static kvt_seq *new_seq(kvt_ctx *ctx, uint64_t id, uint64_t prompt_rows) {
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = id;
    sp.prompt_rows = prompt_rows;
    kvt_seq *seq;
    kvt_status s = kvt_seq_create(ctx, &sp, &seq);
    if (s)
        die(s, "sequence", kvt_last_error());
    return seq;
}

/* Plan, run every layer with KV (emitting into idx, capacity topk), commit: one engine step
 * after the rows were written. Returns the seconds spent in plan + runs + commit. */
static double step_run_commit(kvt_batch *b, const kvt_model *m, int32_t *idx, uint32_t topk) {
    int32_t len;
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = topk, .lengths = &len};
    double t = now_s();
    kvt_status s = kvt_batch_plan(b);
    for (uint32_t l = 0; s == KVT_OK && l < kvt_model_n_layers(m); l++)
        s = kvt_batch_run(b, l, NULL, NULL, &e);
    if (s == KVT_OK)
        s = kvt_batch_commit(b, NULL);
    t = now_s() - t;
    if (s)
        die(s, "step", kvt_last_error());
    return t;
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
        kvt_seq *seq = new_seq(ctx, 1, 0);
        kvt_batch *batch;
        if ((s = kvt_batch_create(ctx, 1, &batch)))
            die(s, "batch", kvt_last_error());
        int32_t *idx = malloc(sizeof(int32_t) * 17 * B);
        /* 16 blocks to build history, time the 17th close (global top-m over 69,632 rows): the
         * step whose run closes the block (plan + run + commit). */
        for (int b = 0; b < 17; b++) {
            uint32_t n = B;
            if ((s = kvt_batch_reserve(batch, &seq, &n, 1)))
                die(s, "reserve", kvt_last_error());
            kvt_seq_write(seq, 0, 0, 0, B, rows, (size_t)B * 1152);
            double t = step_run_commit(batch, m, idx, 17 * B);
            if (b == 16 && t < best)
                best = t;
        }
        free(idx);
        kvt_batch_destroy(batch);
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
        kvt_seq *seq = new_seq(ctx, (uint64_t)r + 1, 128);
        kvt_batch *batch;
        if ((s = kvt_batch_create(ctx, 1, &batch)))
            die(s, "batch", kvt_last_error());
        uint32_t first = n - 1, one = 1;
        if ((s = kvt_batch_reserve(batch, &seq, &first, 1)))
            die(s, "reserve", kvt_last_error());
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t pl = 0; pl < 2; pl++)
                kvt_seq_write(seq, l, pl, 0, n - 1, rows, (size_t)(n - 1) * slot);
        if ((s = kvt_batch_commit(batch, NULL)))
            die(s, "commit", kvt_last_error());
        if ((s = kvt_batch_reserve(batch, &seq, &one, 1)))
            die(s, "reserve", kvt_last_error());
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t pl = 0; pl < 2; pl++)
                kvt_seq_write(seq, l, pl, 0, 1, rows, slot);
        int32_t *idx = malloc(sizeof(int32_t) * n);
        /* This step's runs run the round, layer by layer; the commit returns the pages. */
        double t = step_run_commit(batch, m, idx, n);
        free(idx);
        kvt_batch_destroy(batch);
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
    kvt_seq *seq = new_seq(ctx, 1, 0);
    kvt_batch *batch;
    if ((s = kvt_batch_create(ctx, 1, &batch)))
        die(s, "batch", kvt_last_error());
    uint8_t *rows = malloc((size_t)B * 1152);
    fill_bf16(rows, (size_t)B * 576);
    for (uint32_t b = 0; b < N / B; b++) {
        uint32_t n = B;
        if ((s = kvt_batch_reserve(batch, &seq, &n, 1)))
            die(s, "reserve", kvt_last_error());
        kvt_seq_write(seq, 0, 0, 0, B, rows, (size_t)B * 1152);
        if ((s = kvt_batch_commit(batch, NULL)))
            die(s, "commit", kvt_last_error());
    }
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(seq, 0, &ls);
    uint32_t cnt = (uint32_t)ls.attended_rows;
    int32_t *idx = malloc(sizeof(int32_t) * N);
    int32_t len;
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = cnt, .lengths = &len};
    double best = 1e30;
    for (int r = 0; r < reps * 10; r++) {
        /* A decode step with no new row (nothing to close): the emission alone. */
        uint32_t zero = 0;
        if ((s = kvt_batch_reserve(batch, &seq, &zero, 1)) || (s = kvt_batch_plan(batch)))
            die(s, "step", kvt_last_error());
        double t = now_s();
        s = kvt_batch_run(batch, 0, NULL, NULL, &e);
        t = now_s() - t;
        if (s || (s = kvt_batch_commit(batch, NULL)))
            die(s, "run", kvt_last_error());
        if (t < best)
            best = t;
    }
    kvt_batch_destroy(batch);
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

/* Host enqueue time of one decode step of a batch: 16 requests x 7 NoPE MLA layers (Kimi
 * Linear's attention layers) at 32k rows each, 32x, with max_rows_per_seq set (no allocation):
 * plan + 7 runs (emission of every request's attended set, FlashMLA layout) + commit, with no
 * block closing in the step (the common step: one in 4096 closes), against copying the index
 * arrays the step emits (the floor of any host-side emission). */
static void bench_batch_step(int reps) {
    enum { NS = 16, NL = 7, B = 4096 };
    const uint32_t N = 32768;
    kvt_layer_spec specs[NL];
    for (int l = 0; l < NL; l++)
        kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &specs[l]);
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(specs, NL, "kimi-attn", &m, err, sizeof err);
    if (s)
        die(s, "model", err);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.page_rows = 64;
    p.max_rows_per_seq = N + 64;
    p.n_pages = NS * ((N + 64) / 64 + 1);
    kvt_ctx *ctx;
    if ((s = kvt_ctx_create(&p, &ctx, err, sizeof err)))
        die(s, "context", err);
    kvt_seq *seqs[NS];
    for (int i = 0; i < NS; i++)
        seqs[i] = new_seq(ctx, (uint64_t)i + 1, 0);
    kvt_batch *b;
    if ((s = kvt_batch_create(ctx, NS, &b)))
        die(s, "batch", kvt_last_error());
    uint8_t *rows = malloc((size_t)B * 1152);
    fill_bf16(rows, (size_t)B * 576);
    /* Prefill N - 1 rows per request in chunks of B (the closes happen here), then time decode
     * steps of one token each that close nothing. */
    uint32_t n[NS];
    for (uint32_t done = 0; done < N - 1; done += B) {
        uint32_t c = N - 1 - done < B ? N - 1 - done : B;
        for (int i = 0; i < NS; i++)
            n[i] = c;
        if ((s = kvt_batch_reserve(b, seqs, n, NS)))
            die(s, "prefill reserve", kvt_last_error());
        for (int i = 0; i < NS; i++)
            for (int l = 0; l < NL; l++)
                kvt_seq_write(seqs[i], (uint32_t)l, 0, 0, c, rows, (size_t)c * 1152);
        if ((s = kvt_batch_commit(b, NULL)))
            die(s, "prefill commit", kvt_last_error());
    }
    uint32_t topk_max = 0;
    int32_t *idx = malloc(sizeof(int32_t) * NS * (N + 64) * NL);
    int32_t *copy = malloc(sizeof(int32_t) * NS * (N + 64) * NL);
    int32_t lens[NL][NS];
    double best = 1e30, best_tight = 1e30;
    uint64_t emitted = 0;
    uint32_t tight = 0; /* the longest attended set seen + 64: a topk an engine could size */
    uint64_t allocs = kvt_ctx_host_allocations(ctx);
    for (int r = 0; r < reps * 8; r++) {
        const bool use_tight = r >= reps * 4 && tight > 0;
        /* the step's token: reserve and write are the scheduler's and the forward's, untimed */
        for (int i = 0; i < NS; i++)
            n[i] = 1;
        if ((s = kvt_batch_reserve(b, seqs, n, NS)))
            die(s, "reserve", kvt_last_error());
        for (int i = 0; i < NS; i++)
            for (int l = 0; l < NL; l++)
                kvt_seq_write(seqs[i], (uint32_t)l, 0, 0, 1, rows, 1152);
        double t = now_s();
        uint32_t topk = 0;
        s = kvt_batch_plan(b);
        if (s == KVT_OK)
            s = kvt_batch_capacity(b, 0, &topk, NULL);
        if (use_tight)
            topk = tight;
        for (int l = 0; s == KVT_OK && l < NL; l++) {
            kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                          .indices = idx + (size_t)l * NS * topk, .capacity = topk,
                          .lengths = lens[l]};
            s = kvt_batch_run(b, (uint32_t)l, NULL, NULL, &e);
        }
        if (s == KVT_OK)
            s = kvt_batch_commit(b, NULL);
        t = now_s() - t;
        if (s)
            die(s, "step", kvt_last_error());
        if (use_tight) {
            if (t < best_tight)
                best_tight = t;
            continue;
        }
        if (t < best)
            best = t;
        topk_max = topk;
        emitted = 0;
        for (int l = 0; l < NL; l++)
            for (int i = 0; i < NS; i++) {
                emitted += (uint64_t)lens[l][i];
                /* + 64: the tail grows by one row a step */
                tight = (uint32_t)lens[l][i] + 64 > tight ? (uint32_t)lens[l][i] + 64 : tight;
            }
    }
    allocs = kvt_ctx_host_allocations(ctx) - allocs;
    /* The floor: copying the arrays the step emitted (NL x NS x topk int32, padding included). */
    size_t bytes = sizeof(int32_t) * (size_t)NL * NS * topk_max;
    double mc = 1e30;
    for (int r = 0; r < reps * 4; r++) {
        double t = now_s();
        memcpy(copy, idx, bytes);
        t = now_s() - t;
        if (t < mc)
            mc = t;
    }
    size_t tight_bytes = sizeof(int32_t) * (size_t)NL * NS * tight;
    double mc_tight = 1e30;
    for (int r = 0; r < reps * 4; r++) {
        double t = now_s();
        memcpy(copy, idx, tight_bytes);
        t = now_s() - t;
        if (t < mc_tight)
            mc_tight = t;
    }
    printf("batch step       %d requests x %d NoPE layers at %u rows, 32x: plan + %d runs + commit, "
           "%llu rows emitted, %llu host allocations\n"
           "                 topk = kvt_batch_capacity (%u, the longest request):  %8.3f ms = %5.1fx "
           "copying the emitted arrays (%.3f ms, %.1f MB with padding)\n"
           "                 topk = longest attended set + 64 (%u):              %8.3f ms = %5.1fx "
           "copying the emitted arrays (%.3f ms, %.2f MB)\n",
           NS, NL, N, NL, (unsigned long long)emitted, (unsigned long long)allocs, topk_max,
           best * 1e3, best / mc, mc * 1e3, bytes / 1e6, tight, best_tight * 1e3,
           best_tight / mc_tight, mc_tight * 1e3, tight_bytes / 1e6);
    free(idx);
    free(copy);
    free(rows);
    kvt_batch_destroy(b);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Prefix sharing: a request with a protected prompt of P rows forked into n children, each then
 * decoding D rows of its own through random-eviction rounds (8 GQA layers x 8 heads x 128 bf16,
 * K = 6144, r = c = 64), vs n + 1 unshared requests fed the same rows. Pool pages in use
 * (counted once), and the time of the n forks plus the children's first (copy-on-write) reserve
 * vs memcpy of the prompt's rows n times (what copying the prefix would cost). */
static kvt_ctx *fork_ctx(kvt_model *m, uint32_t n_pages) {
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config c = kvt_config_default();
    c.evict_budget_rows = 6144; /* a 4k prompt fits under K: all of it protected */
    c.recent_rows = 64;
    p.config = &c;
    p.model = m;
    p.n_pages = n_pages;
    kvt_ctx *ctx;
    char err[256];
    kvt_status s = kvt_ctx_create(&p, &ctx, err, sizeof err);
    if (s)
        die(s, "context", err);
    return ctx;
}

/* Reserve n rows for seq, write them (every layer and plane), commit. */
static void feed_rows(kvt_batch *b, kvt_seq *seq, const kvt_model *m, uint32_t n,
                      const uint8_t *rows, size_t slot) {
    kvt_status s = kvt_batch_reserve(b, &seq, &n, 1);
    if (s)
        die(s, "reserve", kvt_last_error());
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++)
        for (uint32_t pl = 0; pl < 2; pl++)
            kvt_seq_write(seq, l, pl, 0, n, rows, (size_t)n * slot);
    if ((s = kvt_batch_commit(b, NULL)))
        die(s, "commit", kvt_last_error());
}

static uint32_t pages_used(kvt_ctx *ctx, uint32_t n_pages) {
    uint32_t f;
    kvt_ctx_free_pages(ctx, 0, &f);
    return n_pages - f;
}

static void bench_fork(int reps, uint32_t P, uint32_t n, uint32_t D) {
    const uint32_t L = 8, H = 8, Dh = 128, NP = 4096;
    kvt_layer_spec specs[8];
    for (uint32_t l = 0; l < L; l++)
        kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, H, Dh, &specs[l]);
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(specs, L, "bench", &m, err, sizeof err);
    if (s)
        die(s, "model", err);
    const size_t slot = (size_t)H * Dh * 2;
    uint8_t *rows = malloc((size_t)P * slot);
    fill_bf16(rows, (size_t)P * H * Dh);
    uint32_t used[2] = {0, 0};
    double best = 1e30;
    uint64_t shared_pages = 0;
    for (int r = 0; r < reps; r++) {
        for (int shared = 1; shared >= 0; shared--) {
            kvt_ctx *ctx = fork_ctx(m, NP);
            kvt_batch *b;
            if ((s = kvt_batch_create(ctx, 1, &b)))
                die(s, "batch", kvt_last_error());
            kvt_seq *root = new_seq(ctx, 1, P);
            feed_rows(b, root, m, P, rows, slot);
            kvt_seq *kids[64];
            double t = now_s();
            for (uint32_t i = 0; i < n; i++) {
                if (shared) {
                    if ((s = kvt_seq_fork(root, 10 + i, &kids[i])))
                        die(s, "fork", kvt_last_error());
                    uint32_t one = 1;
                    if ((s = kvt_batch_reserve(b, &kids[i], &one, 1))) /* copy on write */
                        die(s, "reserve", kvt_last_error());
                    if ((s = kvt_batch_commit(b, NULL)))
                        die(s, "commit", kvt_last_error());
                } else {
                    kids[i] = new_seq(ctx, 10 + i, P);
                    feed_rows(b, kids[i], m, P, rows, slot);
                    feed_rows(b, kids[i], m, 1, rows, slot);
                }
            }
            t = now_s() - t;
            if (shared && t < best)
                best = t;
            for (uint32_t d = 0; d < D; d += 64) /* each child's own decode, rounds included */
                for (uint32_t i = 0; i < n; i++)
                    feed_rows(b, kids[i], m, 64, rows, slot);
            used[shared] = pages_used(ctx, NP);
            if (shared) {
                kvt_layer_stats st = {.struct_size = sizeof st};
                kvt_seq_layer_stats(kids[0], 0, &st);
                shared_pages = st.shared_pages;
            }
            kvt_batch_destroy(b);
            kvt_ctx_destroy(ctx);
        }
    }
    double mc = memcpy_best((size_t)P * slot * 2 * L, reps * 2) * n;
    printf("prefix sharing   %u children of a %u-row prompt, %u rows each after: %u pages in use "
           "shared vs %u unshared (%.2fx less; a child still shares %llu of its pages); %u forks + "
           "copy-on-write reserves %.3f ms = %.3fx memcpy of the prompt %u times (%.3f ms)\n",
           n, P, D, used[1], used[0], (double)used[0] / used[1], (unsigned long long)shared_pages,
           n, best * 1e3, best / mc, n, mc * 1e3);
    free(rows);
    kvt_model_destroy(m);
}

/* Prefix sharing of the salience side planes: a P-row prompt on L MLA-NoPE layers (bf16, 512 +
 * 64; the design's B = 4096, recall sketches of rank 64: σ 4 B + 64 fp16 + ρ 4 B = 136 B a
 * closed row) forked into n children, vs n + 1 unshared requests fed the same rows. The
 * context's memory (kvt_ctx_memory_stats: a shared page or plane set counted once) right after
 * the forks and each child's first one-row step, then after every request has decoded B rows of
 * its own (each writes its next close into planes of its own; the set stays shared). The n
 * forks' time vs feeding the prompt n times (rows written, the block's σ and sketches
 * computed). */
static kvt_ctx_memory ctx_memory(const kvt_ctx *ctx) {
    kvt_ctx_memory mm = {.struct_size = sizeof mm};
    kvt_status s = kvt_ctx_memory_stats(ctx, &mm);
    if (s)
        die(s, "memory statistics", kvt_last_error());
    return mm;
}

static void bench_fork_side(int reps, uint32_t P, uint32_t n) {
    const uint32_t L = 4, B = 4096, PR = 64;
    kvt_layer_spec specs[4];
    for (uint32_t l = 0; l < L; l++)
        kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &specs[l]);
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(specs, L, "bench", &m, err, sizeof err);
    if (s)
        die(s, "model", err);
    const size_t slot = 576 * 2;
    uint8_t *rows = malloc((size_t)P * slot);
    fill_bf16(rows, (size_t)P * 576);
    const uint32_t NP = (n + 1) * ((P + B) / PR + 2);
    kvt_ctx_memory after[2][2];
    double best[2] = {1e30, 1e30};
    for (int r = 0; r < reps; r++)
        for (int shared = 1; shared >= 0; shared--) {
            kvt_ctx_params p = kvt_ctx_default_params();
            kvt_config c = kvt_config_default();
            c.block_rows = B;
            p.config = &c;
            p.model = m;
            p.n_pages = NP;
            p.page_rows = PR;
            p.recall_sketch_rank = 64;
            kvt_ctx *ctx;
            if ((s = kvt_ctx_create(&p, &ctx, err, sizeof err)))
                die(s, "context", err);
            kvt_batch *b;
            if ((s = kvt_batch_create(ctx, 1, &b)))
                die(s, "batch", kvt_last_error());
            kvt_seq *all[65];
            all[0] = new_seq(ctx, 1, P);
            feed_rows(b, all[0], m, P, rows, slot);
            double t = now_s();
            for (uint32_t i = 1; i <= n; i++) {
                if (shared) {
                    if ((s = kvt_seq_fork(all[0], 10 + i, &all[i])))
                        die(s, "fork", kvt_last_error());
                } else {
                    all[i] = new_seq(ctx, 10 + i, P);
                    feed_rows(b, all[i], m, P, rows, slot);
                }
            }
            t = now_s() - t;
            best[shared] = t < best[shared] ? t : best[shared];
            for (uint32_t i = 0; i <= n; i++)
                feed_rows(b, all[i], m, 1, rows, slot);
            after[shared][0] = ctx_memory(ctx);
            for (uint32_t i = 0; i <= n; i++) /* B - 1 more rows: each request closes a block */
                for (uint32_t d = 1; d < B; d += 63)
                    feed_rows(b, all[i], m, B - d < 63 ? B - d : 63, rows + (size_t)d * slot,
                              slot);
            after[shared][1] = ctx_memory(ctx);
            kvt_batch_destroy(b);
            kvt_ctx_destroy(ctx);
        }
    const double MB = 1024.0 * 1024.0;
    for (int k = 0; k < 2; k++)
        printf("prefix sharing   side planes, %u children of a %u-row prompt (%u MLA-NoPE layers, "
               "B %u, sketch rank 64), %s: %.2f MB shared (%.2f MB of it in shared sets) vs "
               "%.2f MB unshared (unshared/shared %.2fx); pool %.1f MB vs %.1f MB (%.2fx)\n",
               n, P, L, B, k ? "after each decoded B rows of its own" : "after the forks",
               after[1][k].side_bytes / MB, after[1][k].shared_side_bytes / MB,
               after[0][k].side_bytes / MB,
               (double)after[0][k].side_bytes / (double)after[1][k].side_bytes,
               after[1][k].bytes_in_use / MB, after[0][k].bytes_in_use / MB,
               (double)after[0][k].bytes_in_use / (double)after[1][k].bytes_in_use);
    printf("prefix sharing   %u forks sharing the side planes %.3f ms vs %u unshared prompts fed "
           "%.1f ms (%.2e x)\n",
           n, best[1] * 1e3, n, best[0] * 1e3, best[1] / best[0]);
    free(rows);
    kvt_model_destroy(m);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    if (reps < 1)
        reps = 1;
    printf("bench_tiers: kvtier %s, CPU backend, best of %d\n", kvt_version(0, 0, 0), reps);
    if (argc > 2 && strcmp(argv[2], "side") == 0) { /* the side planes' sharing alone */
        bench_fork_side(reps, 4096, 8);
        return 0;
    }
    bench_salience(reps);
    bench_evict(reps, false);
    bench_evict(reps, true);
    bench_attended(reps);
    bench_batch_step(reps);
    bench_fork(reps, 4096, 8, 4096); /* rounds run in every child: the prompt stays shared */
    bench_fork_side(reps, 4096, 8);
    return 0;
}
