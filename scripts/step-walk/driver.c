/* driver.c — one decode step of one MLA-NoPE layer with conformal recall on, traced function by
 * function (scripts/step-walk/walk.sh builds the library with -finstrument-functions and this
 * driver without): a 512-row prompt, 64 decode steps to calibrate, then the traced step —
 * reserve, plan, the layer's run, commit. The trace is the entered and left functions' addresses,
 * written to the file named by argv[1]. Public API only. */
#include "kvtier.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 512u
#define QD 576u
#define RB 16u
#define H 4u
#define ROW 1152u

static FILE *g_trace;
static int g_on;

__attribute__((no_instrument_function)) void __cyg_profile_func_enter(void *fn, void *site) {
    (void)site;
    if (g_on)
        fprintf(g_trace, "> %p\n", fn);
}
__attribute__((no_instrument_function)) void __cyg_profile_func_exit(void *fn, void *site) {
    (void)site;
    if (g_on)
        fprintf(g_trace, "< %p\n", fn);
}

static uint64_t g_s = 0x5eed;
static double uni(void) {
    g_s += 0x9e3779b97f4a7c15ull;
    uint64_t z = g_s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}
static double gauss(void) {
    return sqrt(-2.0 * log(uni() + 1e-300)) * cos(6.283185307179586 * uni());
}
static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static void row(uint8_t *r) {
    for (uint32_t d = 0; d < (D + 64); d++) {
        uint16_t v = bf16((float)gauss());
        memcpy(r + 2 * d, &v, 2);
    }
}

#define OK(x)                                                                                      \
    do {                                                                                           \
        kvt_status s_ = (x);                                                                       \
        if (s_ != KVT_OK) {                                                                        \
            fprintf(stderr, "%s: %s (%s)\n", #x, kvt_status_name(s_), kvt_last_error());           \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 2)
        return 2;
    kvt_layer_spec s;
    OK(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, D, 64, &s));
    s.n_q_heads = H;
    kvt_model *m;
    OK(kvt_model_create(&s, 1, "walk", &m, NULL, 0));
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 8;
    c.recall = KVT_RECALL_CONFORMAL;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 256;
    p.recall_sketch_rank = RB;
    char err[256];
    kvt_ctx *ctx;
    if (kvt_ctx_create(&p, &ctx, err, sizeof err) != KVT_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    float *V = calloc((size_t)RB * D, sizeof *V);
    for (uint32_t k = 0; k < RB; k++)
        V[(size_t)k * D + k * 7] = 1.0f; /* orthonormal: distinct unit axes */
    OK(kvt_ctx_set_recall_basis(ctx, 0, V, RB));
    kvt_batch *b;
    OK(kvt_batch_create(ctx, 1, &b));
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 1;
    kvt_seq *seq;
    OK(kvt_seq_create(ctx, &sp, &seq));
    uint8_t *rows = malloc((size_t)512 * ROW);
    for (uint32_t u = 0; u < 512; u++)
        row(rows + (size_t)u * ROW);
    uint32_t n = 512;
    OK(kvt_batch_reserve(b, &seq, &n, 1));
    OK(kvt_seq_write(seq, 0, 0, 0, n, rows, (size_t)n * ROW));
    OK(kvt_batch_plan(b));
    OK(kvt_batch_commit(b, NULL));
    static float q[H * QD];
    static int32_t idx[4096], len[1];
    uint8_t dense[1];
    g_trace = fopen(argv[1], "w");
    for (int step = 0; step <= 64; step++) {
        uint8_t r1[ROW];
        row(r1);
        for (uint32_t i = 0; i < H * QD; i++)
            q[i] = (float)gauss();
        uint32_t one = 1;
        g_on = step == 64;
        OK(kvt_batch_reserve(b, &seq, &one, 1));
        OK(kvt_seq_write(seq, 0, 0, 0, 1, r1, ROW));
        OK(kvt_batch_plan(b));
        kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                      .capacity = 4096, .lengths = len, .dense = dense};
        OK(kvt_batch_run(b, 0, q, NULL, &e));
        OK(kvt_batch_commit(b, NULL));
        g_on = 0;
    }
    fclose(g_trace);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    free(rows);
    free(V);
    return 0;
}
