/*
 * bench_rope_recall.c — what the archive's recall sketches (docs/recall.md §8.1) add to a
 * random-eviction round, side by side in one run: one round of one GQA-RoPE layer (8 KV heads of
 * 128 bf16 values) over 8192 rows at an 8x budget (K = 1024, r = 64, so 7104 rows a head are
 * evicted), run inside the step as an engine would, with
 *   a. no archive (rows dropped),
 *   b. the archive (rows copied out, no sketches: recall_sketch_rank 0),
 *   c. the archive with sketches, no basis (ρ = ‖k‖ only),
 *   d. the archive with sketches on rank-32 bases (the default of issue 12).
 * Each figure is the best of `reps` repetitions; ratios are to (b) measured in the same run, and
 * to two copy floors measured beside them: a memcpy of the rows the round keeps (the compaction
 * floor, issue 9's), and a memcpy of the kept and the evicted rows (every byte the archive round
 * moves: compaction plus the archive copy).
 * Usage: bench_rope_recall [reps]
 */
#include "kvtier.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

enum { H = 8, D = 128, K = 1024, R = 64, N = 8192, RANK = 32 };

static void die(kvt_status s, const char *what, const char *detail) {
    fprintf(stderr, "bench_rope_recall: %s: %s (%s)\n", what, kvt_status_name(s), detail);
    exit(1);
}

static void fill_bf16(uint8_t *p, size_t n_values) {
    uint16_t *v = (uint16_t *)p;
    for (size_t i = 0; i < n_values; i++)
        v[i] = (uint16_t)(0x3c00u + (rnd() & 0x3ffu)) ^ (uint16_t)((rnd() & 1u) << 15);
}

/* rank orthonormal rows of D values (Gram-Schmidt in double on uniform draws). */
static void basis(float *V) {
    double w[RANK][D];
    for (int k = 0; k < RANK; k++) {
        for (int d = 0; d < D; d++)
            w[k][d] = (double)(rnd() >> 11) / 9007199254740992.0 - 0.5;
        for (int pass = 0; pass < 2; pass++)
            for (int j = 0; j < k; j++) {
                double dot = 0;
                for (int d = 0; d < D; d++)
                    dot += w[k][d] * w[j][d];
                for (int d = 0; d < D; d++)
                    w[k][d] -= dot * w[j][d];
            }
        double n = 0;
        for (int d = 0; d < D; d++)
            n += w[k][d] * w[k][d];
        for (int d = 0; d < D; d++) {
            w[k][d] /= sqrt(n);
            V[k * D + d] = (float)w[k][d];
        }
    }
}

/* One round: the table filled to N - 1 rows, then a step of one row whose run does the round.
 * Returns the seconds of that step (plan, run, commit). */
static double one_round(const kvt_model *m, const uint8_t *rows, bool archive, uint32_t sk_rank,
                        const float *V, uint64_t id) {
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config cfg = kvt_config_default();
    p.config = &cfg;
    p.model = m;
    p.page_rows = 64;
    p.n_pages = N / 64 + 8;
    p.recall_sketch_rank = sk_rank;
    cfg.evict_budget_rows = K;
    cfg.recent_rows = R;
    cfg.cadence_rows = N - K - R;
    cfg.evict_archive = archive;
    char err[256];
    kvt_ctx *ctx;
    kvt_status s = kvt_ctx_create(&p, &ctx, err, sizeof err);
    if (s)
        die(s, "context", err);
    for (uint32_t h = 0; V && h < H; h++)
        if ((s = kvt_ctx_set_recall_head_basis(ctx, 0, h, V, RANK)))
            die(s, "basis", kvt_last_error());
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = id;
    sp.prompt_rows = 16;
    kvt_seq *seq;
    if ((s = kvt_seq_create(ctx, &sp, &seq)))
        die(s, "sequence", kvt_last_error());
    kvt_batch *b;
    if ((s = kvt_batch_create(ctx, 1, &b)))
        die(s, "batch", kvt_last_error());
    const size_t slot = (size_t)H * D * 2;
    uint32_t first = N - 1, one = 1;
    if ((s = kvt_batch_reserve(b, &seq, &first, 1)))
        die(s, "reserve", kvt_last_error());
    for (uint32_t pl = 0; pl < 2; pl++)
        kvt_seq_write(seq, 0, pl, 0, N - 1, rows, (size_t)(N - 1) * slot);
    if ((s = kvt_batch_commit(b, NULL)))
        die(s, "commit", kvt_last_error());
    if ((s = kvt_batch_reserve(b, &seq, &one, 1)))
        die(s, "reserve", kvt_last_error());
    for (uint32_t pl = 0; pl < 2; pl++)
        kvt_seq_write(seq, 0, pl, 0, 1, rows, slot);
    int32_t *idx = malloc(sizeof(int32_t) * N), len;
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                  .capacity = N, .lengths = &len};
    double t = now_s();
    s = kvt_batch_plan(b);
    if (s == KVT_OK)
        s = kvt_batch_run(b, 0, NULL, NULL, &e);
    if (s == KVT_OK)
        s = kvt_batch_commit(b, NULL);
    t = now_s() - t;
    if (s)
        die(s, "step", kvt_last_error());
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    kvt_seq_layer_stats(seq, 0, &ls);
    if (ls.rounds != 1 || (sk_rank && archive && ls.sketched_rows != (uint64_t)H * (N - K - R)))
        die(KVT_ERR_INVARIANT, "round", "did not run as expected");
    free(idx);
    kvt_batch_destroy(b);
    kvt_seq_destroy(seq);
    kvt_ctx_destroy(ctx);
    return t;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 3;
    if (reps < 1)
        reps = 1;
    kvt_layer_spec spec;
    kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, H, D, &spec);
    spec.n_q_heads = 4 * H;
    kvt_model *m;
    char err[256];
    kvt_status s = kvt_model_create(&spec, 1, "bench", &m, err, sizeof err);
    if (s)
        die(s, "model", err);
    uint8_t *rows = malloc((size_t)N * H * D * 2);
    fill_bf16(rows, (size_t)N * H * D);
    float *V = malloc(sizeof(float) * RANK * D);
    basis(V);
    const char *name[4] = {"no archive", "archive", "archive + sketches, no basis",
                           "archive + sketches, rank 32"};
    double best[4] = {1e30, 1e30, 1e30, 1e30};
    for (int r = 0; r < reps; r++) /* interleaved: the machine's drift hits every config alike */
        for (int c = 0; c < 4; c++) {
            double t = one_round(m, rows, c > 0, c >= 2 ? RANK : 0, c == 3 ? V : NULL,
                                 (uint64_t)r + 1);
            if (t < best[c])
                best[c] = t;
        }
    const double evicted = (double)H * (N - K - R);
    printf("one eviction round, 1 layer x %d KV heads x %d bf16, N = %d, K = %d, r = %d: %.0f "
           "(row, head) pairs evicted\n",
           H, D, N, K, R, evicted);
    const size_t kept_bytes = (size_t)(K + R) * H * D * 2 * 2, ev_bytes = (size_t)evicted * D * 2 * 2;
    const double floor_kept = memcpy_best(kept_bytes, 2 * reps + 3),
                 floor_all = memcpy_best(kept_bytes + ev_bytes, 2 * reps + 3);
    printf("  floors: memcpy of the kept rows (%.1f MB) %.3f ms; of kept + evicted rows (%.1f MB) "
           "%.3f ms\n",
           kept_bytes / 1e6, floor_kept * 1e3, (kept_bytes + ev_bytes) / 1e6, floor_all * 1e3);
    for (int c = 0; c < 4; c++)
        printf("  %-30s %8.3f ms  = %5.2fx the archive round, %6.2fx the kept-row floor, %5.2fx "
               "the all-row floor  (%.1f ns per evicted row-head)\n",
               name[c], best[c] * 1e3, best[c] / best[1], best[c] / floor_kept,
               best[c] / floor_all, best[c] * 1e9 / evicted);
    free(rows);
    free(V);
    kvt_model_destroy(m);
    return 0;
}
