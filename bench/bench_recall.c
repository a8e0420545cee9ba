/*
 * bench_recall.c — what the recall sketches add to a salience block close, measured side by side
 * in one run through the public API: one MLA-NoPE layer (bf16, 512 + 64), B = 4096, a request
 * prefilled with one block in one step, the step's close timed (kvt_batch_run: σ of the block,
 * its sketches when the context builds them, the top-m select). Contexts without sketches, with
 * sketch planes and no basis (ρ only), and with a rank-64 basis; best of REPS closes each,
 * interleaved. Per row: ns, and the sketch's fused multiply-adds per ns.
 */
#include "bench_util.h"

#include <kvtier.h>

#include <stdio.h>

#define B 4096u
#define D 512u
#define RANK 64u
#define REPS 5

/* Seconds of one close of B rows in a fresh request of ctx. */
static double one_close(kvt_ctx *ctx, const uint8_t *rows) {
    kvt_seq *seq;
    kvt_batch *b;
    if (kvt_seq_create(ctx, NULL, &seq) != KVT_OK || kvt_batch_create(ctx, 1, &b) != KVT_OK)
        return NAN;
    uint32_t n = B;
    static int32_t idx[B + 8];
    int32_t len;
    kvt_emit e = {.struct_size = sizeof e,
                  .layout = KVT_EMIT_TOKENS,
                  .indices = idx,
                  .capacity = B + 8,
                  .lengths = &len};
    double t = NAN;
    if (kvt_batch_reserve(b, &seq, &n, 1) == KVT_OK &&
        kvt_seq_write(seq, 0, 0, 0, B, rows, (size_t)B * 1152) == KVT_OK &&
        kvt_batch_plan(b) == KVT_OK) {
        t = now_s();
        kvt_status s = kvt_batch_run(b, 0, NULL, NULL, &e);
        t = s == KVT_OK ? now_s() - t : NAN;
        kvt_batch_commit(b, NULL);
    }
    kvt_batch_destroy(b);
    kvt_seq_destroy(seq);
    return t;
}

int main(void) {
    kvt_layer_spec sp;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, D, 64, &sp);
    kvt_model *m;
    if (kvt_model_create(&sp, 1, "bench_recall", &m, NULL, 0) != KVT_OK)
        return 1;
    uint8_t *rows = malloc((size_t)B * 1152);
    float *V = malloc(sizeof(float) * RANK * D);
    for (size_t i = 0; i < (size_t)B * 1152; i += 2) {
        uint16_t h = (uint16_t)(0x3c00u + (rnd() & 0x3ffu)) ^ (uint16_t)(rnd() & 0x8000u);
        memcpy(rows + i, &h, 2); /* bf16-shaped values in about [1, 2) in magnitude */
    }
    bench_basis(V, RANK, D);
    const char *names[3] = {"sigma only (recall_sketch_rank 0)", "sigma + sketch planes, no basis",
                            "sigma + rank-64 sketches"};
    kvt_ctx *ctx[3];
    for (int c = 0; c < 3; c++) {
        kvt_ctx_params p = kvt_ctx_default_params();
        p.model = m;
        p.page_rows = 64;
        p.n_pages = 2 * B / 64;
        p.recall_sketch_rank = c ? RANK : 0;
        char err[256];
        if (kvt_ctx_create(&p, &ctx[c], err, sizeof err) != KVT_OK ||
            (c == 2 && kvt_ctx_set_recall_basis(ctx[c], 0, V, RANK) != KVT_OK)) {
            fprintf(stderr, "bench_recall: %s %s\n", err, kvt_last_error());
            return 1;
        }
    }
    double best[3] = {1e30, 1e30, 1e30};
    for (int r = 0; r < REPS; r++)
        for (int c = 0; c < 3; c++) {
            double t = one_close(ctx[c], rows);
            if (t < best[c])
                best[c] = t;
        }
    printf("block close of %u rows (one MLA-NoPE layer, bf16), best of %d:\n", B, REPS);
    for (int c = 0; c < 3; c++)
        printf("  %-36s %8.1f us  %7.1f ns/row  x%.2f\n", names[c], best[c] * 1e6,
               best[c] * 1e9 / B, best[c] / best[0]);
    double sk = best[2] - best[0];
    printf("rank-64 sketch alone: %.1f ns/row, %.2f fused multiply-adds per ns (2 x %u x %u a "
           "row)\n",
           sk * 1e9 / B, 2.0 * RANK * D * B / (sk * 1e9), RANK, D);
    for (int c = 0; c < 3; c++)
        kvt_ctx_destroy(ctx[c]);
    kvt_model_destroy(m);
    free(rows);
    free(V);
    return 0;
}
