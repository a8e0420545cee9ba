/* make_trace_seeds.c — writes the fuzz_trace seed corpus with the library's own trace writer:
 * small traces that reach every section type the reader knows (META, TEXT, LAYER, ROWS in
 * several chunks, QUERIES fp32 and bf16, NEEDLES, TARGETS, a user section, END).
 * Usage: make_trace_seeds DIR (writes DIR/NAME.kvtt). */
#include "kvtier_trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        kvt_status s_ = (call);                                                                    \
        if (s_ != KVT_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, kvt_status_name(s_));   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void fill(uint8_t *p, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((i * 31u + seed * 17u) & 0x3f);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    char path[4096];
    char err[256];
    uint8_t rows[4096];
    kvt_trace_writer *w;

    /* 1. MLA (bf16, 8 + 8 dims): 6 rows in two chunks, 3 fp32 query steps, a needle, a target. */
    snprintf(path, sizeof path, "%s/mla_small.kvtt", argv[1]);
    kvt_trace_meta meta = {.prompt_rows = 2, .n_model_layers = 3, .text = "generator=seeds\n"};
    CHECK(kvt_trace_writer_open(path, &meta, &w, err, sizeof err));
    kvt_layer_spec mla;
    CHECK(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 8, 8, &mla));
    mla.n_q_heads = 2;
    CHECK(kvt_trace_write_layer(w, 1, &mla));
    fill(rows, 4 * mla.row_bytes, 1);
    CHECK(kvt_trace_write_rows(w, 1, 0, rows, 4, 4 * mla.row_bytes));
    fill(rows, 2 * mla.row_bytes, 2);
    CHECK(kvt_trace_write_rows(w, 1, 0, rows, 2, 2 * mla.row_bytes));
    float q[3 * 2 * 16];
    for (size_t i = 0; i < sizeof q / sizeof *q; i++)
        q[i] = (float)i * 0.25f - 3.0f;
    uint64_t pos[3] = {2, 4, 6};
    CHECK(kvt_trace_write_queries(w, 1, KVT_DTYPE_FP32, 2, 16, pos, q, 3, sizeof q));
    kvt_trace_needle nd = {.layer = 1, .first_row = 3, .n_rows = 2};
    CHECK(kvt_trace_write_needles(w, &nd, 1));
    uint32_t heads[2] = {0, 1};
    kvt_trace_target tg = {.step = 2, .needle = 0, .n_heads = 2, .heads = heads};
    CHECK(kvt_trace_write_targets(w, &tg, 1));
    CHECK(kvt_trace_writer_close(w, err, sizeof err));

    /* 2. GQA (fp16, 2 heads of 4) and a sliding layer: K and V planes interleaved, bf16
     * queries in two chunks, a non-critical user section. */
    snprintf(path, sizeof path, "%s/gqa_sliding.kvtt", argv[1]);
    meta = (kvt_trace_meta){.prompt_rows = 0, .n_model_layers = 2, .text = NULL};
    CHECK(kvt_trace_writer_open(path, &meta, &w, err, sizeof err));
    kvt_layer_spec gqa, sl;
    CHECK(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 4, &gqa));
    gqa.n_q_heads = 4;
    CHECK(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 1, 4, &sl));
    sl.sliding_window = 2;
    sl.n_q_heads = 1;
    CHECK(kvt_trace_write_layer(w, 0, &gqa));
    CHECK(kvt_trace_write_layer(w, 1, &sl));
    size_t tb = (size_t)gqa.n_kv_heads * gqa.row_bytes;
    for (uint32_t step = 0; step < 3; step++)
        for (uint32_t pl = 0; pl < 2; pl++) {
            fill(rows, tb, step * 2 + pl);
            CHECK(kvt_trace_write_rows(w, 0, pl, rows, 1, tb));
            fill(rows, sl.row_bytes, step * 5 + pl);
            CHECK(kvt_trace_write_rows(w, 1, pl, rows, 1, sl.row_bytes));
        }
    uint16_t qb[2 * 4 * 4];
    for (size_t i = 0; i < sizeof qb / sizeof *qb; i++)
        qb[i] = (uint16_t)(0x3f80 + i);
    uint64_t p2[2] = {1, 3};
    CHECK(kvt_trace_write_queries(w, 0, KVT_DTYPE_BF16, 4, 4, p2, qb, 1, sizeof qb / 2));
    CHECK(kvt_trace_write_queries(w, 0, KVT_DTYPE_BF16, 4, 4, p2 + 1, qb + 16, 1, sizeof qb / 2));
    const char user[] = "engine notes";
    CHECK(kvt_trace_write_section(w, KVT_TRACE_SECTION_USER + 1, false, user, sizeof user));
    CHECK(kvt_trace_writer_close(w, err, sizeof err));

    /* 3. The smallest valid trace: a header, META and END. */
    snprintf(path, sizeof path, "%s/empty.kvtt", argv[1]);
    meta = (kvt_trace_meta){.prompt_rows = 0, .n_model_layers = 1, .text = NULL};
    CHECK(kvt_trace_writer_open(path, &meta, &w, err, sizeof err));
    CHECK(kvt_trace_writer_close(w, err, sizeof err));
    return 0;
}
