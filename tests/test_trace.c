/* test_trace.c — the trace format: golden files from the independent Python writer
 * (tests/golden/make_golden.py), every broken variant, C writer == Python bytes, round trips,
 * exhaustive byte corruption and truncation, and a multi-MB streaming write read back by ranges. */
#include "kvtier_trace.h"

#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Test data: byte i of a stream keyed by seed (make_golden.py's pattern()). */
static uint8_t pat(uint32_t seed, uint64_t i) {
    uint32_t x = seed * 0x9E3779B1u + (uint32_t)i * 0x85EBCA77u;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    return (uint8_t)x;
}
static void fill(uint8_t *p, uint32_t seed, uint64_t start, uint64_t n) {
    for (uint64_t k = 0; k < n; k++)
        p[k] = pat(seed, start + k);
}
static uint32_t row_seed(uint32_t layer, uint32_t plane) {
    return 1000 + layer * 10 + plane;
}
static uint32_t q_seed(uint32_t layer) {
    return 5000 + layer;
}

static const char *golden(const char *name) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/tests/golden/%s", KVT_SOURCE_DIR, name);
    return buf;
}
static const char *tmp_path(const char *name) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/trace_test_%ld_%s", KVT_BINARY_DIR, (long)getpid(), name);
    return buf;
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc(sz > 0 ? (size_t)sz : 1);
    cr_assert(p);
    cr_assert_eq(fread(p, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return p;
}
static void spit(const char *path, const uint8_t *p, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    fclose(f);
}

/* Check every row of every plane of a layer against the pattern, whole and by sub-ranges. */
static void check_rows(kvt_trace *t, uint32_t layer) {
    kvt_trace_layer li;
    cr_assert_eq(kvt_trace_find_layer(t, layer, &li), KVT_OK);
    uint64_t tb = (uint64_t)li.spec.n_kv_heads * li.spec.row_bytes;
    uint8_t *buf = malloc(li.n_tokens * tb), *want = malloc(li.n_tokens * tb);
    for (uint32_t p = 0; p < li.spec.n_planes; p++) {
        fill(want, row_seed(layer, p), 0, li.n_tokens * tb);
        cr_assert_eq(kvt_trace_read_rows(t, layer, p, 0, li.n_tokens, buf, li.n_tokens * tb),
                     KVT_OK, "%s", kvt_trace_last_error(t));
        cr_assert(memcmp(buf, want, li.n_tokens * tb) == 0, "layer %u plane %u rows", layer, p);
        for (uint64_t a = 0; a < li.n_tokens; a += 3)
            for (uint64_t n = 1; a + n <= li.n_tokens; n += 5) {
                cr_assert_eq(kvt_trace_read_rows(t, layer, p, a, n, buf, n * tb), KVT_OK);
                cr_assert(memcmp(buf, want + a * tb, n * tb) == 0, "rows [%llu,+%llu)",
                          (unsigned long long)a, (unsigned long long)n);
            }
    }
    cr_assert_eq(kvt_trace_read_rows(t, layer, 0, li.n_tokens, 1, buf, tb), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_trace_read_rows(t, layer, 0, 0, 2, buf, tb), KVT_ERR_CAPACITY);
    cr_assert_eq(kvt_trace_read_rows(t, layer, li.spec.n_planes, 0, 1, buf, tb),
                 KVT_ERR_OUT_OF_RANGE);
    free(buf);
    free(want);
}

/* Check every query step (raw and as fp32) and its position. */
static void check_queries(kvt_trace *t, uint32_t layer, const uint64_t *positions) {
    kvt_trace_layer li;
    cr_assert_eq(kvt_trace_find_layer(t, layer, &li), KVT_OK);
    uint32_t eb = kvt_dtype_bytes(li.q_dtype);
    uint64_t elems = (uint64_t)li.n_q_heads * li.q_dim, sb = elems * eb;
    uint8_t *raw = malloc(sb), *want = malloc(sb);
    float *f = malloc(elems * 4);
    for (uint64_t s = 0; s < li.n_steps; s++) {
        uint64_t pos = 0;
        fill(want, q_seed(layer), s * sb, sb);
        cr_assert_eq(kvt_trace_read_query(t, layer, s, li.q_dtype, raw, sb, &pos), KVT_OK, "%s",
                     kvt_trace_last_error(t));
        cr_assert(memcmp(raw, want, sb) == 0, "layer %u step %llu", layer, (unsigned long long)s);
        cr_assert_eq(pos, positions[s]);
        cr_assert_eq(kvt_trace_query_position(t, layer, s, &pos), KVT_OK);
        cr_assert_eq(pos, positions[s]);
        cr_assert_eq(kvt_trace_read_query(t, layer, s, KVT_DTYPE_FP32, f, elems * 4, NULL), KVT_OK);
        for (uint64_t i = 0; i < elems; i++) {
            uint32_t bits;
            memcpy(&bits, (uint8_t *)f + 4 * i, 4);
            uint32_t expect = eb == 2 ? (uint32_t)(want[2 * i] | want[2 * i + 1] << 8) << 16
                                      : (uint32_t)want[4 * i] | (uint32_t)want[4 * i + 1] << 8 |
                                            (uint32_t)want[4 * i + 2] << 16 |
                                            (uint32_t)want[4 * i + 3] << 24;
            cr_assert_eq(bits, expect, "step %llu elem %llu", (unsigned long long)s,
                         (unsigned long long)i);
        }
    }
    cr_assert_eq(kvt_trace_read_query(t, layer, li.n_steps, li.q_dtype, raw, sb, NULL),
                 KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_trace_read_query(t, layer, 0, li.q_dtype, raw, sb - 1, NULL),
                 KVT_ERR_CAPACITY);
    cr_assert_eq(kvt_trace_read_query(t, layer, 0, KVT_DTYPE_FP16, raw, sb * 4, NULL),
                 KVT_ERR_UNSUPPORTED);
    free(raw);
    free(want);
    free(f);
}

static void check_mla_spec(const kvt_layer_spec *s) {
    cr_assert_eq(s->kind, KVT_LAYER_MLA_NOPE);
    cr_assert_eq(s->dtype, KVT_DTYPE_BF16);
    cr_assert_eq(s->n_kv_heads, 1);
    cr_assert_eq(s->n_planes, 1);
    cr_assert_eq(s->head_dim, 576);
    cr_assert_eq(s->value_dim, 512);
    cr_assert_eq(s->branch_dim, 64);
    cr_assert_eq(s->row_bytes, 1152);
    cr_assert_eq(s->branch_offset, 1024);
    cr_assert_eq(s->branch_dtype, KVT_DTYPE_BF16);
    cr_assert_eq(s->sliding_window, 0);
    cr_assert_eq(s->n_q_heads, 2);
}

static const char MLA_TEXT[] = "generator=make_golden.py\ncontent=mla_bf16\nseed=1\n";
static const char GQA_TEXT[] = "generator=make_golden.py\ncontent=gqa_2plane\n";

static void check_mla(kvt_trace *t) {
    uint32_t major, minor;
    kvt_trace_format_version(t, &major, &minor);
    cr_assert_eq(major, 1);
    cr_assert_eq(minor, 0);
    cr_assert_eq(kvt_trace_prompt_rows(t), 6);
    cr_assert_eq(kvt_trace_n_model_layers(t), 27);
    size_t tl;
    cr_assert_str_eq(kvt_trace_text(t, &tl), MLA_TEXT);
    cr_assert_eq(tl, strlen(MLA_TEXT));
    cr_assert_eq(kvt_trace_n_layers(t), 2);
    kvt_trace_layer li;
    cr_assert_eq(kvt_trace_layer_info(t, 0, &li), KVT_OK);
    cr_assert_eq(li.layer, 3);
    check_mla_spec(&li.spec);
    cr_assert_eq(li.n_tokens, 20);
    cr_assert_eq(li.n_steps, 3);
    cr_assert_eq(li.q_dtype, KVT_DTYPE_BF16);
    cr_assert_eq(li.n_q_heads, 2);
    cr_assert_eq(li.q_dim, 576);
    cr_assert_eq(kvt_trace_layer_info(t, 1, &li), KVT_OK);
    cr_assert_eq(li.layer, 7);
    check_mla_spec(&li.spec);
    cr_assert_eq(li.n_tokens, 20);
    cr_assert_eq(li.n_steps, 1);
    cr_assert_eq(li.q_dtype, KVT_DTYPE_FP32);
    cr_assert_eq(kvt_trace_layer_info(t, 2, &li), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_trace_find_layer(t, 4, &li), KVT_ERR_OUT_OF_RANGE);
    check_rows(t, 3);
    check_rows(t, 7);
    check_queries(t, 3, (const uint64_t[]){16, 18, 20});
    check_queries(t, 7, (const uint64_t[]){20});
    uint32_t n;
    const kvt_trace_needle *nd = kvt_trace_needles(t, &n);
    cr_assert_eq(n, 2);
    cr_assert(nd[0].layer == 3 && nd[0].first_row == 9 && nd[0].n_rows == 2);
    cr_assert(nd[1].layer == 7 && nd[1].first_row == 14 && nd[1].n_rows == 1);
    const kvt_trace_target *tg = kvt_trace_targets(t, &n);
    cr_assert_eq(n, 2);
    cr_assert(tg[0].step == 1 && tg[0].needle == 0 && tg[0].n_heads == 2);
    cr_assert(tg[0].heads[0] == 0 && tg[0].heads[1] == 1);
    cr_assert(tg[1].step == 0 && tg[1].needle == 1 && tg[1].n_heads == 1 && tg[1].heads[0] == 1);
    cr_assert_eq(kvt_trace_verify(t), KVT_OK, "%s", kvt_trace_last_error(t));
}

static void check_gqa(kvt_trace *t) {
    cr_assert_eq(kvt_trace_prompt_rows(t), 4);
    cr_assert_eq(kvt_trace_n_model_layers(t), 2);
    cr_assert_str_eq(kvt_trace_text(t, NULL), GQA_TEXT);
    cr_assert_eq(kvt_trace_n_layers(t), 2);
    for (uint32_t i = 0; i < 2; i++) {
        kvt_trace_layer li;
        cr_assert_eq(kvt_trace_layer_info(t, i, &li), KVT_OK);
        cr_assert_eq(li.layer, i);
        cr_assert_eq(li.spec.kind, KVT_LAYER_GQA_ROPE);
        cr_assert_eq(li.spec.dtype, KVT_DTYPE_FP16);
        cr_assert_eq(li.spec.n_kv_heads, 2);
        cr_assert_eq(li.spec.n_planes, 2);
        cr_assert_eq(li.spec.head_dim, 8);
        cr_assert_eq(li.spec.value_dim, 8);
        cr_assert_eq(li.spec.branch_dim, 0);
        cr_assert_eq(li.spec.row_bytes, 16);
        cr_assert_eq(li.spec.n_q_heads, 4);
        cr_assert_eq(li.n_tokens, 10);
        cr_assert_eq(li.n_steps, i == 0 ? 2 : 0);
        check_rows(t, i);
    }
    check_queries(t, 0, (const uint64_t[]){8, 10});
    uint32_t n;
    const kvt_trace_needle *nd = kvt_trace_needles(t, &n);
    cr_assert(n == 1 && nd[0].layer == 0 && nd[0].first_row == 5 && nd[0].n_rows == 1);
    const kvt_trace_target *tg = kvt_trace_targets(t, &n);
    cr_assert(n == 1 && tg[0].step == 1 && tg[0].needle == 0 && tg[0].n_heads == 2);
    cr_assert(tg[0].heads[0] == 0 && tg[0].heads[1] == 3);
    cr_assert_eq(kvt_trace_verify(t), KVT_OK, "%s", kvt_trace_last_error(t));
}

Test(trace, golden_mla_bf16) {
    kvt_trace *t = NULL;
    char err[256] = "";
    cr_assert_eq(kvt_trace_open(golden("mla_bf16.kvtt"), &t, err, sizeof err), KVT_OK, "%s", err);
    check_mla(t);
    kvt_trace_close(t);
}

Test(trace, golden_gqa_2plane) {
    kvt_trace *t = NULL;
    char err[256] = "";
    cr_assert_eq(kvt_trace_open(golden("gqa_2plane.kvtt"), &t, err, sizeof err), KVT_OK, "%s", err);
    check_gqa(t);
    kvt_trace_close(t);
}

Test(trace, golden_unknown_sections_skipped) {
    kvt_trace *t = NULL;
    char err[256] = "";
    cr_assert_eq(kvt_trace_open(golden("unknown_section.kvtt"), &t, err, sizeof err), KVT_OK, "%s",
                 err);
    uint32_t minor;
    kvt_trace_format_version(t, NULL, &minor);
    cr_assert_eq(minor, 7, "a newer minor version is read");
    check_gqa(t);
    kvt_trace_close(t);
}

/* ---- broken files: status and message ---- */
typedef enum { AT_OPEN, AT_VERIFY } phase;
static const struct broken {
    const char *name;
    kvt_status status;
    const char *msg;
    phase when;
} BROKEN[] = {
    {"bad_magic", KVT_ERR_PARSE, "bad magic", AT_OPEN},
    {"major2", KVT_ERR_UNSUPPORTED, "unknown format version 2.0", AT_OPEN},
    {"kind_snapshot", KVT_ERR_PARSE, "(snapshot), expected kind 1", AT_OPEN},
    {"header_crc", KVT_ERR_CORRUPT, "file header CRC mismatch", AT_OPEN},
    {"trunc_header", KVT_ERR_PARSE, "truncated file header", AT_OPEN},
    {"empty", KVT_ERR_PARSE, "truncated file header", AT_OPEN},
    {"trunc_section_header", KVT_ERR_PARSE, "truncated section header: section 0", AT_OPEN},
    {"trunc_meta_payload", KVT_ERR_PARSE, "truncated section 0 (type 1)", AT_OPEN},
    {"trunc_rows", KVT_ERR_PARSE, "truncated section 4 (type 4)", AT_OPEN},
    {"trunc_no_end", KVT_ERR_PARSE, "no END section", AT_OPEN},
    {"trailing_bytes", KVT_ERR_PARSE, "8 bytes after the END section", AT_OPEN},
    {"crc_meta", KVT_ERR_CORRUPT, "META (section 0): CRC mismatch", AT_OPEN},
    {"crc_rows", KVT_ERR_CORRUPT, "CRC mismatch in section 4 (ROWS", AT_VERIFY},
    {"length_past_eof", KVT_ERR_PARSE, "runs past the end of the file", AT_OPEN},
    {"rows_len_mismatch", KVT_ERR_PARSE, "length 152 != 24 + n_tokens 5 x 32 bytes", AT_OPEN},
    {"rows_absurd_tokens", KVT_ERR_PARSE, "absurd n_tokens 1099511627776", AT_OPEN},
    {"rows_gap", KVT_ERR_PARSE, "chunk starts at token 1, expected 0", AT_OPEN},
    {"rows_unknown_layer", KVT_ERR_PARSE, "layer 9 has no preceding LAYER section", AT_OPEN},
    {"layer_row_bytes0", KVT_ERR_PARSE, "row_bytes: 0 not in", AT_OPEN},
    {"layer_bad_kind", KVT_ERR_PARSE, "unknown kind 77", AT_OPEN},
    {"layer_index_range", KVT_ERR_PARSE, "layer index 5 not below n_model_layers 2", AT_OPEN},
    {"layer_duplicate", KVT_ERR_PARSE, "layer 0 declared twice", AT_OPEN},
    {"queries_absurd_heads", KVT_ERR_PARSE, "absurd n_q_heads 1073741824", AT_OPEN},
    {"queries_position_range", KVT_ERR_PARSE, "at position 11, beyond the layer's 10 rows",
     AT_OPEN},
    {"needle_range", KVT_ERR_PARSE, "needle 0: rows [9, +2) outside layer 0's 10 rows", AT_OPEN},
    {"target_head_range", KVT_ERR_PARSE, "target 0: head 4, layer 0 has 4 query heads", AT_OPEN},
    {"critical_unknown", KVT_ERR_UNSUPPORTED, "unknown type 0x80000002 marked critical", AT_OPEN},
    {"missing_meta", KVT_ERR_PARSE, "missing META section", AT_OPEN},
    {"prompt_range", KVT_ERR_PARSE, "prompt_rows 11 exceeds layer 0's 10 rows", AT_OPEN},
};

Test(trace, golden_broken_files) {
    for (size_t i = 0; i < sizeof BROKEN / sizeof *BROKEN; i++) {
        const struct broken *b = &BROKEN[i];
        char name[128], err[256] = "";
        snprintf(name, sizeof name, "broken_%s.kvtt", b->name);
        kvt_trace *t = NULL;
        kvt_status s = kvt_trace_open(golden(name), &t, err, sizeof err);
        if (b->when == AT_OPEN) {
            cr_assert_eq(s, b->status, "%s: got %s (%s)", name, kvt_status_name(s), err);
            cr_assert_null(t);
            cr_assert(strstr(err, b->msg), "%s: message '%s' lacks '%s'", name, err, b->msg);
            continue;
        }
        cr_assert_eq(s, KVT_OK, "%s: %s", name, err);
        s = kvt_trace_verify(t);
        cr_assert_eq(s, b->status, "%s: verify gave %s", name, kvt_status_name(s));
        cr_assert(strstr(kvt_trace_last_error(t), b->msg), "%s: '%s' lacks '%s'", name,
                  kvt_trace_last_error(t), b->msg);
        kvt_trace_close(t);
    }
}

Test(trace, corrupt_rows_caught_by_full_read_not_partial) {
    kvt_trace *t = NULL;
    char err[256];
    cr_assert_eq(kvt_trace_open(golden("broken_crc_rows.kvtt"), &t, err, sizeof err), KVT_OK);
    uint8_t buf[10 * 32];
    /* The flipped byte is in the first chunk (tokens 0..3) of layer 0 plane 0. */
    cr_assert_eq(kvt_trace_read_rows(t, 0, 0, 0, 4, buf, sizeof buf), KVT_ERR_CORRUPT);
    cr_assert(strstr(kvt_trace_last_error(t), "CRC mismatch in ROWS chunk of layer 0 plane 0"));
    cr_assert_eq(kvt_trace_read_rows(t, 0, 0, 0, 10, buf, sizeof buf), KVT_ERR_CORRUPT);
    cr_assert_eq(kvt_trace_read_rows(t, 0, 0, 1, 3, buf, sizeof buf), KVT_OK, "partial read");
    cr_assert_eq(kvt_trace_read_rows(t, 0, 1, 0, 10, buf, sizeof buf), KVT_OK, "other plane");
    kvt_trace_close(t);
}

Test(trace, open_missing_file_and_bad_args) {
    kvt_trace *t = (kvt_trace *)1;
    char err[256];
    cr_assert_eq(kvt_trace_open("/nonexistent/x.kvtt", &t, err, sizeof err), KVT_ERR_IO);
    cr_assert_null(t);
    cr_assert(strstr(err, "cannot open"));
    cr_assert_eq(kvt_trace_open(NULL, &t, NULL, 0), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_open(KVT_SOURCE_DIR, &t, err, sizeof err), KVT_ERR_IO);
    kvt_trace_close(NULL);
    cr_assert_eq(kvt_trace_writer_close(NULL, NULL, 0), KVT_OK);
    kvt_trace_writer_abort(NULL);
}

/* ---- C writer: the same content as the Python goldens, byte for byte ---- */
static void write_rows(kvt_trace_writer *w, uint32_t layer, uint32_t plane, uint64_t first,
                       uint64_t n, uint64_t tb) {
    uint8_t *p = malloc(n * tb);
    fill(p, row_seed(layer, plane), first * tb, n * tb);
    cr_assert_eq(kvt_trace_write_rows(w, layer, plane, p, n, n * tb), KVT_OK, "%s",
                 kvt_trace_writer_last_error(w));
    free(p);
}
static void write_q(kvt_trace_writer *w, uint32_t layer, kvt_dtype dt, uint32_t heads, uint32_t dim,
                    uint64_t first, const uint64_t *pos, uint64_t n) {
    uint64_t sb = (uint64_t)heads * dim * kvt_dtype_bytes(dt);
    uint8_t *p = malloc(n * sb);
    fill(p, q_seed(layer), first * sb, n * sb);
    cr_assert_eq(kvt_trace_write_queries(w, layer, dt, heads, dim, pos, p, n, n * sb), KVT_OK, "%s",
                 kvt_trace_writer_last_error(w));
    free(p);
}

static void write_mla(const char *path) {
    kvt_trace_meta m = {.prompt_rows = 6, .n_model_layers = 27, .text = MLA_TEXT};
    kvt_trace_writer *w;
    char err[256];
    cr_assert_eq(kvt_trace_writer_open(path, &m, &w, err, sizeof err), KVT_OK, "%s", err);
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    s.n_q_heads = 2;
    cr_assert_eq(kvt_trace_write_layer(w, 3, &s), KVT_OK, "%s", kvt_trace_writer_last_error(w));
    cr_assert_eq(kvt_trace_write_layer(w, 7, &s), KVT_OK);
    write_rows(w, 3, 0, 0, 12, 1152);
    write_rows(w, 7, 0, 0, 20, 1152);
    write_rows(w, 3, 0, 12, 8, 1152);
    write_q(w, 3, KVT_DTYPE_BF16, 2, 576, 0, (const uint64_t[]){16, 18}, 2);
    write_q(w, 3, KVT_DTYPE_BF16, 2, 576, 2, (const uint64_t[]){20}, 1);
    write_q(w, 7, KVT_DTYPE_FP32, 2, 576, 0, (const uint64_t[]){20}, 1);
    kvt_trace_needle nd[2] = {{3, 9, 2}, {7, 14, 1}};
    cr_assert_eq(kvt_trace_write_needles(w, nd, 2), KVT_OK);
    kvt_trace_target tg[2] = {{1, 0, 2, (const uint32_t[]){0, 1}},
                              {0, 1, 1, (const uint32_t[]){1}}};
    cr_assert_eq(kvt_trace_write_targets(w, tg, 2), KVT_OK);
    cr_assert_eq(kvt_trace_writer_close(w, err, sizeof err), KVT_OK, "%s", err);
}

static void write_gqa(const char *path) {
    kvt_trace_meta m = {.prompt_rows = 4, .n_model_layers = 2, .text = GQA_TEXT};
    kvt_trace_writer *w;
    char err[256];
    cr_assert_eq(kvt_trace_writer_open(path, &m, &w, err, sizeof err), KVT_OK, "%s", err);
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 8, &s), KVT_OK);
    s.n_q_heads = 4;
    s.branch_dtype = KVT_DTYPE_BF16;
    cr_assert_eq(kvt_trace_write_layer(w, 0, &s), KVT_OK, "%s", kvt_trace_writer_last_error(w));
    cr_assert_eq(kvt_trace_write_layer(w, 1, &s), KVT_OK);
    const uint64_t chunks[2][2] = {{0, 4}, {4, 6}};
    for (int c = 0; c < 2; c++)
        for (uint32_t l = 0; l < 2; l++)
            for (uint32_t p = 0; p < 2; p++)
                write_rows(w, l, p, chunks[c][0], chunks[c][1], 32);
    write_q(w, 0, KVT_DTYPE_FP32, 4, 8, 0, (const uint64_t[]){8, 10}, 2);
    kvt_trace_needle nd = {0, 5, 1};
    cr_assert_eq(kvt_trace_write_needles(w, &nd, 1), KVT_OK);
    kvt_trace_target tg = {1, 0, 2, (const uint32_t[]){0, 3}};
    cr_assert_eq(kvt_trace_write_targets(w, &tg, 1), KVT_OK);
    cr_assert_eq(kvt_trace_writer_close(w, err, sizeof err), KVT_OK, "%s", err);
}

static void assert_same_bytes(const char *a, const char *b) {
    size_t na, nb;
    uint8_t *pa = slurp(a, &na), *pb = slurp(b, &nb);
    cr_assert_eq(na, nb, "%s is %zu bytes, %s is %zu", a, na, b, nb);
    for (size_t i = 0; i < na; i++)
        cr_assert_eq(pa[i], pb[i], "first difference at byte %zu", i);
    free(pa);
    free(pb);
}

Test(trace, c_writer_matches_python_golden) {
    const char *p = tmp_path("mla.kvtt");
    write_mla(p);
    assert_same_bytes(p, golden("mla_bf16.kvtt"));
    kvt_trace *t;
    char err[256];
    cr_assert_eq(kvt_trace_open(p, &t, err, sizeof err), KVT_OK, "%s", err);
    check_mla(t);
    kvt_trace_close(t);
    unlink(p);

    p = tmp_path("gqa.kvtt");
    write_gqa(p);
    assert_same_bytes(p, golden("gqa_2plane.kvtt"));
    cr_assert_eq(kvt_trace_open(p, &t, err, sizeof err), KVT_OK, "%s", err);
    check_gqa(t);
    kvt_trace_close(t);
    unlink(p);
}

Test(trace, writer_refuses_bad_calls) {
    const char *p = tmp_path("bad.kvtt");
    kvt_trace_meta m = {.prompt_rows = 0, .n_model_layers = 4, .text = NULL};
    kvt_trace_writer *w;
    char err[256];
    kvt_trace_meta m0 = {.n_model_layers = 0};
    cr_assert_eq(kvt_trace_writer_open(p, &m0, &w, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_writer_open("/nonexistent/dir/x.kvtt", &m, &w, err, sizeof err),
                 KVT_ERR_IO);
    cr_assert_eq(kvt_trace_writer_open(p, &m, &w, err, sizeof err), KVT_OK);
    kvt_layer_spec s;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s);
    uint8_t row[1152] = {0};
    cr_assert_eq(kvt_trace_write_rows(w, 0, 0, row, 1, sizeof row), KVT_ERR_BAD_STATE);
    cr_assert_eq(kvt_trace_write_layer(w, 4, &s), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_trace_writer_last_error(w), "n_model_layers"));
    kvt_layer_spec bad = s;
    bad.row_bytes = 0;
    cr_assert_eq(kvt_trace_write_layer(w, 0, &bad), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_write_layer(w, 0, &s), KVT_OK);
    cr_assert_eq(kvt_trace_write_layer(w, 0, &s), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_write_rows(w, 0, 1, row, 1, sizeof row), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_write_rows(w, 0, 0, row, 1, sizeof row - 1), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_write_rows(w, 0, 0, row, 1, sizeof row), KVT_OK);
    uint64_t pos[2] = {1, 0};
    float q[2 * 576] = {0};
    cr_assert_eq(kvt_trace_write_queries(w, 0, KVT_DTYPE_FP16, 1, 576, pos, q, 1, 1152),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_write_queries(w, 0, KVT_DTYPE_FP32, 1, 576, pos, q, 2, sizeof q),
                 KVT_ERR_INVALID_ARGUMENT, "decreasing positions");
    cr_assert_eq(kvt_trace_write_queries(w, 0, KVT_DTYPE_FP32, 1, 576, pos, q, 1, 2304), KVT_OK);
    cr_assert_eq(kvt_trace_write_queries(w, 0, KVT_DTYPE_FP32, 2, 576, pos, q, 1, sizeof q),
                 KVT_ERR_INVALID_ARGUMENT, "shape change");
    cr_assert_eq(kvt_trace_write_section(w, 5, false, "x", 1), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_write_section(w, KVT_TRACE_SECTION_USER, false, "xyz", 3), KVT_OK);
    kvt_trace_needle nd = {1, 0, 1};
    cr_assert_eq(kvt_trace_write_needles(w, &nd, 1), KVT_ERR_INVALID_ARGUMENT);
    nd.layer = 0;
    cr_assert_eq(kvt_trace_write_needles(w, &nd, 1), KVT_OK);
    cr_assert_eq(kvt_trace_write_needles(w, &nd, 1), KVT_ERR_BAD_STATE);
    kvt_trace_target tg = {0, 0, 0, NULL};
    cr_assert_eq(kvt_trace_write_targets(w, &tg, 1), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_trace_writer_close(w, err, sizeof err), KVT_OK, "%s", err);
    /* What was accepted forms a valid trace. */
    kvt_trace *t;
    cr_assert_eq(kvt_trace_open(p, &t, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_str_eq(kvt_trace_text(t, NULL), "");
    cr_assert_eq(kvt_trace_verify(t), KVT_OK);
    kvt_trace_close(t);

    /* An aborted writer leaves no file. */
    cr_assert_eq(kvt_trace_writer_open(p, &m, &w, err, sizeof err), KVT_OK);
    kvt_trace_writer_abort(w);
    cr_assert_neq(access(p, F_OK), 0);
}

/* ---- corruption: every byte of a small file, a stride of a bigger one ---- */

/* Offsets that are section padding (writers write zeros, readers ignore them). */
static bool *padding_map(const uint8_t *f, size_t n) {
    bool *pad = calloc(n, 1);
    size_t off = 24;
    while (off + 24 <= n) {
        uint32_t type = (uint32_t)f[off] | (uint32_t)f[off + 1] << 8 | (uint32_t)f[off + 2] << 16 |
                        (uint32_t)f[off + 3] << 24;
        uint64_t len = 0;
        for (int i = 7; i >= 0; i--)
            len = len << 8 | f[off + 8 + i];
        size_t end = off + 24 + (size_t)len, next = off + 24 + (((size_t)len + 7) & ~(size_t)7);
        for (size_t i = end; i < next; i++)
            pad[i] = true;
        off = next;
        if (type == 0)
            break;
    }
    return pad;
}

/* Open, verify and read everything; KVT_OK only if all of it succeeded. */
static kvt_status exercise(const char *path) {
    kvt_trace *t = NULL;
    kvt_status s = kvt_trace_open(path, &t, NULL, 0);
    if (s != KVT_OK)
        return s;
    s = kvt_trace_verify(t);
    for (uint32_t i = 0; s == KVT_OK && i < kvt_trace_n_layers(t); i++) {
        kvt_trace_layer li;
        kvt_trace_layer_info(t, i, &li);
        size_t tb = (size_t)li.spec.n_kv_heads * li.spec.row_bytes;
        uint8_t *buf = malloc(li.n_tokens * tb + 1);
        for (uint32_t p = 0; s == KVT_OK && p < li.spec.n_planes; p++)
            s = kvt_trace_read_rows(t, li.layer, p, 0, li.n_tokens, buf, li.n_tokens * tb);
        free(buf);
        size_t qb = (size_t)li.n_q_heads * li.q_dim * 4;
        float *q = malloc(qb + 4);
        for (uint64_t st = 0; s == KVT_OK && st < li.n_steps; st++)
            s = kvt_trace_read_query(t, li.layer, st, KVT_DTYPE_FP32, q, qb, NULL);
        free(q);
    }
    kvt_trace_close(t);
    return s;
}

static void corrupt_loop(const char *name, size_t stride) {
    size_t n;
    uint8_t *orig = slurp(golden(name), &n);
    bool *pad = padding_map(orig, n);
    const char *p = tmp_path("flip.kvtt");
    uint8_t *f = malloc(n);
    size_t ok = 0, refused = 0;
    const uint8_t masks[3] = {0x01, 0x80, 0xFF};
    for (size_t i = 0; i < n; i++) {
        /* Every byte of headers and small sections; a stride through big payloads. */
        if (stride > 1 && i > 1024 && i % stride != 0)
            continue;
        for (int m = 0; m < 3; m++) {
            memcpy(f, orig, n);
            f[i] ^= masks[m];
            spit(p, f, n);
            kvt_status s = exercise(p);
            if (pad[i]) {
                cr_assert_eq(s, KVT_OK, "%s: flip 0x%02x at padding byte %zu refused (%s)", name,
                             masks[m], i, kvt_status_name(s));
                ok++;
            } else {
                cr_assert(s == KVT_ERR_PARSE || s == KVT_ERR_CORRUPT || s == KVT_ERR_UNSUPPORTED,
                          "%s: flip 0x%02x at byte %zu gave %s", name, masks[m], i,
                          kvt_status_name(s));
                refused++;
            }
        }
    }
    cr_assert_gt(refused, 0);
    cr_log_info("%s: %zu flips refused, %zu padding flips accepted", name, refused, ok);
    unlink(p);
    free(f);
    free(pad);
    free(orig);
}

Test(trace, corruption_every_byte_gqa) {
    corrupt_loop("gqa_2plane.kvtt", 1);
    corrupt_loop("unknown_section.kvtt", 1);
}

Test(trace, corruption_strided_mla) {
    corrupt_loop("mla_bf16.kvtt", 61);
}

Test(trace, truncation_at_every_length) {
    size_t n;
    uint8_t *orig = slurp(golden("gqa_2plane.kvtt"), &n);
    const char *p = tmp_path("trunc.kvtt");
    for (size_t len = 0; len < n; len++) {
        spit(p, orig, len);
        char err[256] = "";
        kvt_trace *t = NULL;
        kvt_status s = kvt_trace_open(p, &t, err, sizeof err);
        cr_assert_eq(s, KVT_ERR_PARSE, "length %zu: %s (%s)", len, kvt_status_name(s), err);
        cr_assert(strstr(err, "truncated"), "length %zu: '%s'", len, err);
    }
    unlink(p);
    free(orig);
}

/* ---- streaming: a multi-MB layer written in uneven chunks, read back by ranges ---- */
Test(trace, streaming_big_layer) {
    const char *p = tmp_path("big.kvtt");
    const uint64_t N = 5000, tb = 1152; /* 5.76 MB */
    kvt_trace_meta m = {.prompt_rows = 100, .n_model_layers = 61, .text = "generator=test"};
    kvt_trace_writer *w;
    char err[256];
    cr_assert_eq(kvt_trace_writer_open(p, &m, &w, err, sizeof err), KVT_OK);
    kvt_layer_spec s;
    kvt_layer_spec_mla(KVT_LAYER_MLA_ROPE, KVT_DTYPE_BF16, 512, 64, &s);
    s.n_q_heads = 16;
    cr_assert_eq(kvt_trace_write_layer(w, 60, &s), KVT_OK);
    uint8_t *chunk = malloc(700 * tb);
    uint64_t at = 0, k = 0, steps = 0;
    uint16_t *q = malloc(16 * 576 * 2);
    while (at < N) {
        uint64_t n = 1 + (k * 7919) % 700;
        if (n > N - at)
            n = N - at;
        fill(chunk, row_seed(60, 0), at * tb, n * tb);
        cr_assert_eq(kvt_trace_write_rows(w, 60, 0, chunk, n, n * tb), KVT_OK);
        at += n;
        /* One decode query per chunk, issued once the chunk's rows exist. */
        fill((uint8_t *)q, q_seed(60), steps * 16 * 576 * 2, 16 * 576 * 2);
        cr_assert_eq(
            kvt_trace_write_queries(w, 60, KVT_DTYPE_BF16, 16, 576, &at, q, 1, 16 * 576 * 2),
            KVT_OK);
        steps++;
        k++;
    }
    cr_assert_eq(kvt_trace_writer_close(w, err, sizeof err), KVT_OK, "%s", err);
    free(chunk);

    kvt_trace *t;
    cr_assert_eq(kvt_trace_open(p, &t, err, sizeof err), KVT_OK, "%s", err);
    kvt_trace_layer li;
    cr_assert_eq(kvt_trace_find_layer(t, 60, &li), KVT_OK);
    cr_assert_eq(li.n_tokens, N);
    cr_assert_eq(li.n_steps, steps);
    cr_assert_eq(kvt_trace_verify(t), KVT_OK, "%s", kvt_trace_last_error(t));
    uint8_t *buf = malloc(1200 * tb), *want = malloc(1200 * tb);
    uint64_t seed = 12345;
    for (int r = 0; r < 60; r++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t a = (seed >> 33) % N;
        uint64_t n = 1 + (seed >> 13) % 1200;
        if (n > N - a)
            n = N - a;
        cr_assert_eq(kvt_trace_read_rows(t, 60, 0, a, n, buf, 1200 * tb), KVT_OK, "%s",
                     kvt_trace_last_error(t));
        fill(want, row_seed(60, 0), a * tb, n * tb);
        cr_assert(memcmp(buf, want, n * tb) == 0, "seed 12345 range %d: [%llu,+%llu)", r,
                  (unsigned long long)a, (unsigned long long)n);
    }
    uint64_t prev = 0;
    for (uint64_t st = 0; st < steps; st++) {
        uint64_t pos;
        cr_assert_eq(kvt_trace_read_query(t, 60, st, KVT_DTYPE_BF16, q, 16 * 576 * 2, &pos),
                     KVT_OK);
        fill(want, q_seed(60), st * 16 * 576 * 2, 16 * 576 * 2);
        cr_assert(memcmp(q, want, 16 * 576 * 2) == 0);
        cr_assert_gt(pos, prev);
        prev = pos;
    }
    cr_assert_eq(prev, N);
    free(buf);
    free(want);
    free(q);
    kvt_trace_close(t);
    unlink(p);
}
