/* test_census.c — the model census: real Hugging Face configs read into layer specs with the
 * exact byte counts of docs/design.md §1, census totals, and every malformed input answered
 * with its status and a message naming the key. */
#include "support/testutil.h"

#include <kvtier.h>

#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KIMI "kimi-linear-48b-a3b-instruct.json"
#define DSV3 "deepseek-v3.json"
#define QWEN3 "qwen3-8b.json"
#define LLAMA "llama-3.1-8b.json"
#define QNEXT "qwen3-next-80b-a3b-thinking.json"
#define GEMMA "gemma-3-1b-it.json"

/* ---- helpers -------------------------------------------------------------------------------- */

static kvt_model *load(const char *file, kvt_dtype dtype) {
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = kvt_model_from_file(tu_model_path(file), dtype, &m, err, sizeof err);
    cr_assert_eq(s, KVT_OK, "%s: %s (%s)", file, kvt_status_name(s), err);
    cr_assert_not_null(m);
    return m;
}

static json_t *load_json(const char *file) {
    json_error_t je;
    json_t *j = json_load_file(tu_model_path(file), 0, &je);
    cr_assert_not_null(j, "%s: %s", file, je.text);
    return j;
}

/* A JSON value from text ("-3", "4.5", "\"8\"", "[1,2]"). */
static json_t *val(const char *text) {
    json_error_t je;
    json_t *v = json_loads(text, JSON_DECODE_ANY, &je);
    cr_assert_not_null(v, "bad test value %s", text);
    return v;
}

static kvt_status parse_obj(const json_t *j, kvt_dtype dtype, kvt_model **m, char *err,
                            size_t len) {
    char *s = json_dumps(j, JSON_ENCODE_ANY);
    cr_assert_not_null(s);
    kvt_status st = kvt_model_from_json(s, strlen(s), dtype, m, err, len);
    free(s);
    return st;
}

/* Parse j (consumed), expect status `want` and a message containing `part`. */
static void expect_fail(json_t *j, kvt_status want, const char *part) {
    char err[512] = "";
    kvt_model *m = (kvt_model *)(uintptr_t)1;
    kvt_status s = parse_obj(j, KVT_DTYPE_BF16, &m, err, sizeof err);
    json_decref(j);
    cr_assert_eq(s, want, "got %s, want %s (message: %s)", kvt_status_name(s),
                 kvt_status_name(want), err);
    cr_assert_null(m, "*out must be NULL on failure");
    cr_assert(strstr(err, part) != NULL, "message '%s' lacks '%s'", err, part);
}

/* A real config with one key replaced by a JSON value, expected to fail. */
static void expect_key_fail(const char *file, const char *key, const char *value,
                            const char *part) {
    json_t *j = load_json(file);
    json_object_set_new(j, key, val(value));
    expect_fail(j, KVT_ERR_PARSE, part);
}

static void expect_text_fail(const char *text, size_t len, kvt_status want, const char *part) {
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = kvt_model_from_json(text, len, KVT_DTYPE_BF16, &m, err, sizeof err);
    cr_assert_eq(s, want, "got %s, want %s (message: %s)", kvt_status_name(s),
                 kvt_status_name(want), err);
    cr_assert_null(m);
    cr_assert(strstr(err, part) != NULL, "message '%s' lacks '%s'", err, part);
}

/* Write text to a fresh temporary file; returns its path (caller unlinks and frees). */
static char *temp_file(const char *text, size_t len) {
    char *path = strdup("/tmp/kvt_census_XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0, "mkstemp");
    cr_assert_eq(write(fd, text, len), (ssize_t)len);
    close(fd);
    return path;
}

static void census(const kvt_model *m, uint64_t ctx, uint64_t conc, double ratio,
                   kvt_census_totals *t) {
    kvt_status s = kvt_model_census(m, ctx, conc, ratio, t);
    cr_assert_eq(s, KVT_OK, "census: %s", kvt_status_name(s));
}

static bool in_list(uint32_t i, const uint32_t *list, size_t n) {
    for (size_t k = 0; k < n; k++)
        if (list[k] == i)
            return true;
    return false;
}

/* ---- real configs ------------------------------------------------------------------------- */

Test(census_real, kimi_linear) {
    kvt_model *m = load(KIMI, KVT_DTYPE_BF16);
    /* full_attn_layers 4, 8, ..., 27 are 1-indexed: MLA at 0-indexed 3, 7, 11, 15, 19, 23, 26. */
    static const uint32_t mla[] = {3, 7, 11, 15, 19, 23, 26};
    cr_assert_eq(kvt_model_n_layers(m), 27);
    cr_assert_str_eq(kvt_model_type(m), "kimi_linear");
    for (uint32_t i = 0; i < 27; i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        if (in_list(i, mla, 7)) {
            cr_assert_eq(l->kind, KVT_LAYER_MLA_NOPE, "layer %u", i);
            cr_assert_eq(kvt_policy_for_kind(l->kind), KVT_POLICY_SALIENCE);
            cr_assert_eq(l->head_dim, 576);
            cr_assert_eq(l->value_dim, 512);
            cr_assert_eq(l->branch_dim, 64);
            cr_assert_eq(l->row_bytes, 1152);
            cr_assert_eq(l->branch_offset, 1024);
            cr_assert_eq(l->n_kv_heads, 1);
            cr_assert_eq(l->n_planes, 1);
            cr_assert_eq(kvt_layer_bytes_per_token(l), 1152);
        } else {
            cr_assert_eq(l->kind, KVT_LAYER_NO_KV, "layer %u", i);
            cr_assert_eq(kvt_policy_for_kind(l->kind), KVT_POLICY_NONE);
            cr_assert_eq(kvt_layer_bytes_per_token(l), 0);
        }
        cr_assert_eq(l->n_q_heads, 32);
    }
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 8064);

    /* DESIGN 1: 32k x 1 request = 264 MB; x 32 requests = 8.5 GB; ~252 B/token attended at 32x. */
    kvt_census_totals t;
    census(m, 32768, 1, 32.0, &t);
    cr_assert_eq(t.kv_bytes_per_token, 8064);
    cr_assert_eq(t.dense_bytes, 264241152ull);
    cr_assert_eq(t.attended_bytes, 8064ull * 1024);
    cr_assert_eq(t.attended_bytes / 32768, 252);
    cr_assert_eq(t.freed_bytes, 0, "salience frees nothing: the archive is in the same pool");
    cr_assert_eq(t.salience_layers, 7);
    cr_assert_eq(t.evict_layers, 0);
    cr_assert_eq(t.none_layers, 20);
    cr_assert_eq(t.no_kv_layers, 20);
    census(m, 32768, 32, 32.0, &t);
    cr_assert_eq(t.dense_bytes, 8455716864ull);
    kvt_model_destroy(m);
}

Test(census_real, kimi_linear_fp32_and_fp16) {
    kvt_model *m = load(KIMI, KVT_DTYPE_FP32);
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 16128);
    cr_assert_eq(kvt_model_layer(m, 3)->branch_offset, 2048);
    kvt_model_destroy(m);
    m = load(KIMI, KVT_DTYPE_FP16);
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 8064);
    cr_assert_eq(kvt_model_layer(m, 26)->dtype, KVT_DTYPE_FP16);
    kvt_model_destroy(m);
}

Test(census_real, deepseek_v3) {
    kvt_model *m = load(DSV3, KVT_DTYPE_BF16);
    cr_assert_eq(kvt_model_n_layers(m), 61, "the MTP layer (num_nextn_predict_layers) not counted");
    for (uint32_t i = 0; i < 61; i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        cr_assert_eq(l->kind, KVT_LAYER_MLA_ROPE, "layer %u", i);
        cr_assert_eq(kvt_policy_for_kind(l->kind), KVT_POLICY_EVICT);
        cr_assert_eq(l->row_bytes, 1152);
        cr_assert_eq(l->n_q_heads, 128);
    }
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 70272);
    kvt_census_totals t;
    census(m, 32768, 2, 32.0, &t);
    cr_assert_eq(t.dense_bytes, 70272ull * 32768 * 2);
    cr_assert_eq(t.attended_bytes, 70272ull * 1024 * 2);
    cr_assert_eq(t.freed_bytes, 70272ull * (32768 - 1024) * 2);
    cr_assert_eq(t.evict_layers, 61);
    cr_assert_eq(t.salience_layers + t.none_layers, 0);
    kvt_model_destroy(m);
}

Test(census_real, qwen3_8b) {
    kvt_model *m = load(QWEN3, KVT_DTYPE_BF16);
    cr_assert_eq(kvt_model_n_layers(m), 36);
    for (uint32_t i = 0; i < 36; i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        cr_assert_eq(l->kind, KVT_LAYER_GQA_ROPE, "layer %u", i);
        cr_assert_eq(l->n_kv_heads, 8);
        cr_assert_eq(l->n_planes, 2);
        cr_assert_eq(l->head_dim, 128);
        cr_assert_eq(l->row_bytes, 256);
        cr_assert_eq(l->n_q_heads, 32);
    }
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 147456);
    kvt_model_destroy(m);
}

Test(census_real, llama_3_1_8b_head_dim_from_hidden_size) {
    kvt_model *m = load(LLAMA, KVT_DTYPE_BF16);
    cr_assert_eq(kvt_model_n_layers(m), 32);
    for (uint32_t i = 0; i < 32; i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        cr_assert_eq(l->kind, KVT_LAYER_GQA_ROPE);
        cr_assert_eq(l->head_dim, 128, "4096 / 32 without a head_dim key");
        cr_assert_eq(l->n_kv_heads, 8);
    }
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 131072);
    kvt_model_destroy(m);
}

Test(census_real, qwen3_next) {
    kvt_model *m = load(QNEXT, KVT_DTYPE_BF16);
    cr_assert_eq(kvt_model_n_layers(m), 48);
    uint32_t full = 0;
    for (uint32_t i = 0; i < 48; i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        if ((i + 1) % 4 == 0) {
            full++;
            cr_assert_eq(l->kind, KVT_LAYER_GQA_ROPE, "layer %u", i);
            cr_assert_eq(l->n_kv_heads, 2);
            cr_assert_eq(l->head_dim, 256);
            cr_assert_eq(l->n_q_heads, 16);
            cr_assert_eq(kvt_layer_bytes_per_token(l), 2048);
        } else {
            cr_assert_eq(l->kind, KVT_LAYER_NO_KV, "layer %u is Gated DeltaNet", i);
        }
    }
    cr_assert_eq(full, 12);
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 24576);
    kvt_census_totals t;
    census(m, 1000, 1, 1.0, &t);
    cr_assert_eq(t.evict_layers, 12);
    cr_assert_eq(t.no_kv_layers, 36);
    cr_assert_eq(t.none_layers, 36);
    cr_assert_eq(t.attended_bytes, t.dense_bytes, "ratio 1 changes nothing");
    cr_assert_eq(t.freed_bytes, 0);
    kvt_model_destroy(m);
}

static void check_gemma_layers(const kvt_model *m) {
    cr_assert_eq(kvt_model_n_layers(m), 26);
    for (uint32_t i = 0; i < 26; i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        bool global = i == 5 || i == 11 || i == 17 || i == 23;
        cr_assert_eq(l->kind, global ? KVT_LAYER_GQA_ROPE : KVT_LAYER_SLIDING, "layer %u", i);
        cr_assert_eq(l->sliding_window, global ? 0u : 512u, "layer %u", i);
        cr_assert_eq(l->n_kv_heads, 1);
        cr_assert_eq(l->head_dim, 256);
        cr_assert_eq(l->n_q_heads, 4);
        cr_assert_eq(kvt_layer_bytes_per_token(l), 1024);
    }
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 26624);
}

Test(census_real, gemma3_1b_pattern_and_totals) {
    kvt_model *m = load(GEMMA, KVT_DTYPE_BF16);
    check_gemma_layers(m);
    kvt_census_totals t;
    census(m, 32768, 1, 32.0, &t);
    /* 4 global layers hold the whole context; 22 sliding layers hold 512 tokens. */
    cr_assert_eq(t.kv_bytes_per_token, 26624, "kv_bytes_per_token is uncapped");
    cr_assert_eq(t.dense_bytes, 4ull * 1024 * 32768 + 22ull * 1024 * 512);
    cr_assert_eq(t.attended_bytes, 4ull * 1024 * 1024 + 22ull * 1024 * 512);
    cr_assert_eq(t.freed_bytes, 4ull * 1024 * (32768 - 1024));
    cr_assert_eq(t.evict_layers, 4);
    cr_assert_eq(t.none_layers, 22);
    cr_assert_eq(t.no_kv_layers, 0);
    /* Below the window nothing is capped. */
    census(m, 300, 3, 1.0, &t);
    cr_assert_eq(t.dense_bytes, 26624ull * 300 * 3);
    kvt_model_destroy(m);
}

/* The same model written with layer_types (newer transformers saves) must read the same. */
Test(census_real, gemma3_layer_types_matches_pattern) {
    json_t *j = load_json(GEMMA);
    json_int_t pattern = json_integer_value(json_object_get(j, "sliding_window_pattern"));
    cr_assert_eq(pattern, 6);
    json_object_del(j, "sliding_window_pattern");
    json_t *lt = json_array();
    for (json_int_t i = 0; i < 26; i++)
        json_array_append_new(
            lt, json_string((i + 1) % pattern == 0 ? "full_attention" : "sliding_attention"));
    json_object_set_new(j, "layer_types", lt);
    char *text = json_dumps(j, JSON_INDENT(2));
    char *path = temp_file(text, strlen(text));
    free(text);
    json_decref(j);

    char err[512] = "";
    kvt_model *b = NULL;
    kvt_status s = kvt_model_from_file(path, KVT_DTYPE_BF16, &b, err, sizeof err);
    unlink(path);
    free(path);
    cr_assert_eq(s, KVT_OK, "%s", err);
    check_gemma_layers(b);
    kvt_model *a = load(GEMMA, KVT_DTYPE_BF16);
    for (uint32_t i = 0; i < 26; i++)
        cr_assert(memcmp(kvt_model_layer(a, i), kvt_model_layer(b, i), sizeof(kvt_layer_spec)) == 0,
                  "layer %u differs between the two encodings", i);
    kvt_model_destroy(a);
    kvt_model_destroy(b);
}

/* gemma3 (multimodal) nests the language model's config in text_config. */
Test(census_real, gemma3_nested_text_config) {
    json_t *root = json_pack("{s:s, s:o}", "model_type", "gemma3", "text_config", load_json(GEMMA));
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = parse_obj(root, KVT_DTYPE_BF16, &m, err, sizeof err);
    json_decref(root);
    cr_assert_eq(s, KVT_OK, "%s", err);
    check_gemma_layers(m);
    cr_assert_str_eq(kvt_model_type(m), "gemma3");
    kvt_model_destroy(m);
}

/* Key names in messages carry the text_config. prefix. */
Test(census_real, gemma3_nested_error_names_prefix) {
    json_t *tc = load_json(GEMMA);
    json_object_set_new(tc, "num_hidden_layers", json_integer(0));
    json_t *root = json_pack("{s:s, s:o}", "model_type", "gemma3", "text_config", tc);
    expect_fail(root, KVT_ERR_PARSE,
                "text_config.num_hidden_layers: expected a positive integer, got 0");
}

Test(census_real, kimi_mla_use_nope_false_is_rope) {
    json_t *j = load_json(KIMI);
    json_object_set_new(j, "mla_use_nope", json_false());
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = parse_obj(j, KVT_DTYPE_BF16, &m, err, sizeof err);
    json_decref(j);
    cr_assert_eq(s, KVT_OK, "%s", err);
    cr_assert_eq(kvt_model_layer(m, 3)->kind, KVT_LAYER_MLA_ROPE);
    cr_assert_eq(kvt_policy_for_kind(kvt_model_layer(m, 3)->kind), KVT_POLICY_EVICT);
    cr_assert_eq(kvt_model_layer(m, 0)->kind, KVT_LAYER_NO_KV);
    cr_assert_eq(kvt_model_kv_bytes_per_token(m), 8064);
    kvt_model_destroy(m);
}

Test(census_real, qwen2_sliding_from_max_window_layers) {
    const char *cfg = "{\"model_type\":\"qwen2\",\"num_hidden_layers\":4,\"num_attention_heads\":8,"
                      "\"num_key_value_heads\":2,\"hidden_size\":512,\"use_sliding_window\":true,"
                      "\"sliding_window\":128,\"max_window_layers\":2}";
    char err[256] = "";
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_from_json(cfg, strlen(cfg), KVT_DTYPE_BF16, &m, err, sizeof err), KVT_OK,
                 "%s", err);
    cr_assert_eq(kvt_model_layer(m, 1)->kind, KVT_LAYER_GQA_ROPE);
    cr_assert_eq(kvt_model_layer(m, 2)->kind, KVT_LAYER_SLIDING);
    cr_assert_eq(kvt_model_layer(m, 3)->sliding_window, 128);
    cr_assert_eq(kvt_model_layer(m, 0)->head_dim, 64);
    kvt_model_destroy(m);
}

/* ---- totals ------------------------------------------------------------------------------ */

Test(census_totals, rounding_and_minimum_rows) {
    kvt_model *m = load(DSV3, KVT_DTYPE_BF16);
    kvt_census_totals t;
    census(m, 100, 1, 32.0, &t); /* 3.125 -> 3 */
    cr_assert_eq(t.attended_bytes, 70272ull * 3);
    census(m, 48, 1, 32.0, &t); /* 1.5 -> 2 */
    cr_assert_eq(t.attended_bytes, 70272ull * 2);
    census(m, 10, 1, 32.0, &t); /* 0.3 -> at least 1 row */
    cr_assert_eq(t.attended_bytes, 70272ull * 1);
    cr_assert_eq(t.freed_bytes, 70272ull * 9);
    census(m, 10, 1, 2.5, &t); /* non-integral ratio: 4 */
    cr_assert_eq(t.attended_bytes, 70272ull * 4);
    census(m, 0, 1, 8.0, &t);
    cr_assert_eq(t.dense_bytes + t.attended_bytes + t.freed_bytes, 0);
    kvt_model_destroy(m);
}

Test(census_totals, bad_arguments) {
    kvt_model *m = load(KIMI, KVT_DTYPE_BF16);
    kvt_census_totals t;
    cr_assert_eq(kvt_model_census(m, 100, 1, 0.5, &t), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_census(m, 100, 1, 0.0 / 0.0, &t), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_census(m, 100, 1, 1.0 / 0.0, &t), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_census(NULL, 100, 1, 1.0, &t), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_census(m, 100, 1, 1.0, NULL), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_census(m, UINT64_MAX / 2, UINT64_MAX / 2, 1.0, &t),
                 KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(t.dense_bytes, 0, "zeroed on error");
    kvt_model_destroy(m);
}

/* A shared prefix is held once: one layer of each policy, 4 requests of 1000 tokens, ratio 10
 * (K = 100), the first 600 (then 950) tokens shared; figures worked out by hand. */
Test(census_totals, shared_prefix_counted_once) {
    kvt_layer_spec s[3];
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[0]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 64, &s[1]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 2, 32, &s[2]), KVT_OK);
    s[2].sliding_window = 128;
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, 3, "mixed", &m, NULL, 0), KVT_OK);
    const uint64_t b0 = 1152, b1 = 2 * 2 * 64 * 2, b2 = 2 * 2 * 32 * 2;
    cr_assert_eq(kvt_layer_bytes_per_token(&s[1]), b1);
    cr_assert_eq(kvt_layer_bytes_per_token(&s[2]), b2);
    kvt_census_totals t, u;
    cr_assert_eq(kvt_model_census_shared(m, 1000, 4, 10.0, 600, &t), KVT_OK);
    /* salience and evict hold 4 x 1000 - 3 x 600 = 2200 rows; the window (the last 128 of
     * 1000) none of the prefix: 4 x 128; evict keeps 4 x 100 - 3 x 100 = 100 rows. */
    cr_assert_eq(t.dense_bytes, 2200 * b0 + 2200 * b1 + 512 * b2);
    cr_assert_eq(t.freed_bytes, (2200 - 100) * b1);
    cr_assert_eq(t.attended_bytes, 400 * b0 + 400 * b1 + 512 * b2, "reads are per request");
    cr_assert_eq(kvt_model_census_shared(m, 1000, 4, 10.0, 950, &t), KVT_OK);
    /* the window holds rows 872..999, 78 of them shared: 512 - 3 x 78 = 278 */
    cr_assert_eq(t.dense_bytes, 1150 * b0 + 1150 * b1 + 278 * b2);
    cr_assert_eq(t.freed_bytes, (1150 - 100) * b1);
    /* no prefix, or one request: kvt_model_census's figures */
    cr_assert_eq(kvt_model_census_shared(m, 1000, 4, 10.0, 0, &t), KVT_OK);
    census(m, 1000, 4, 10.0, &u);
    cr_assert_eq(memcmp(&t, &u, sizeof t), 0);
    cr_assert_eq(kvt_model_census_shared(m, 1000, 1, 10.0, 1000, &t), KVT_OK);
    census(m, 1000, 1, 10.0, &u);
    cr_assert_eq(memcmp(&t, &u, sizeof t), 0);
    cr_assert_eq(kvt_model_census_shared(m, 1000, 0, 10.0, 500, &t), KVT_OK);
    cr_assert_eq(t.dense_bytes + t.freed_bytes + t.attended_bytes, 0);
    cr_assert_eq(kvt_model_census_shared(m, 1000, 4, 10.0, 1001, &t), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_census_shared(m, UINT64_MAX / 2, UINT64_MAX / 2, 1.0, 1, &t),
                 KVT_ERR_OUT_OF_RANGE);
    kvt_model_destroy(m);
    /* a real model, no prefix: the same as kvt_model_census at several contexts */
    m = load(GEMMA, KVT_DTYPE_BF16);
    for (uint64_t c = 1; c < 100000; c *= 7) {
        cr_assert_eq(kvt_model_census_shared(m, c, 3, 8.0, 0, &t), KVT_OK);
        census(m, c, 3, 8.0, &u);
        cr_assert_eq(memcmp(&t, &u, sizeof t), 0, "context %llu", (unsigned long long)c);
    }
    kvt_model_destroy(m);
}

/* ---- malformed input ---------------------------------------------------------------------- */

Test(census_bad, truncated_json_reports_line_and_column) {
    json_t *j = load_json(KIMI);
    char *text = json_dumps(j, JSON_INDENT(2));
    json_decref(j);
    expect_text_fail(text, strlen(text) / 2, KVT_ERR_PARSE, "line ");
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_model_from_json(text, strlen(text) / 2, KVT_DTYPE_BF16, &m, err, sizeof err);
    cr_assert(strstr(err, "column ") != NULL, "%s", err);
    free(text);
}

Test(census_bad, truncated_file_names_path) {
    const char *text = "{\n  \"model_type\": \"llama\",\n  \"num_hidden_layers\": ";
    char *path = temp_file(text, strlen(text));
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = kvt_model_from_file(path, KVT_DTYPE_BF16, &m, err, sizeof err);
    cr_assert_eq(s, KVT_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, path) != NULL && strstr(err, "line 3") != NULL, "%s", err);
    unlink(path);
    free(path);
}

Test(census_bad, empty_file) {
    char *path = temp_file("", 0);
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = kvt_model_from_file(path, KVT_DTYPE_BF16, &m, err, sizeof err);
    unlink(path);
    free(path);
    cr_assert_eq(s, KVT_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, "invalid JSON") != NULL, "%s", err);
}

Test(census_bad, nonexistent_file) {
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s =
        kvt_model_from_file("/nonexistent/kvt/config.json", KVT_DTYPE_BF16, &m, err, sizeof err);
    cr_assert_eq(s, KVT_ERR_IO, "%s", err);
    cr_assert_null(m);
    cr_assert(strstr(err, "/nonexistent/kvt/config.json") != NULL, "%s", err);
}

Test(census_bad, directory_is_io_error) {
    char err[512] = "";
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_from_file("/tmp", KVT_DTYPE_BF16, &m, err, sizeof err), KVT_ERR_IO, "%s",
                 err);
}

Test(census_bad, non_object_root) {
    expect_text_fail("[1, 2]", 6, KVT_ERR_PARSE, "root: expected a JSON object");
}

Test(census_bad, unknown_model_type) {
    expect_key_fail(LLAMA, "model_type", "\"gpt_neox\"", "model_type: unknown family \"gpt_neox\"");
}

Test(census_bad, model_type_missing) {
    json_t *j = load_json(LLAMA);
    json_object_del(j, "model_type");
    expect_fail(j, KVT_ERR_PARSE, "model_type: missing");
}

Test(census_bad, model_type_not_string) {
    expect_key_fail(LLAMA, "model_type", "3", "model_type: expected a string, got 3");
}

Test(census_bad, negative_layers) {
    expect_key_fail(LLAMA, "num_hidden_layers", "-3",
                    "num_hidden_layers: expected a positive integer, got -3");
}

Test(census_bad, zero_layers) {
    expect_key_fail(DSV3, "num_hidden_layers", "0",
                    "num_hidden_layers: expected a positive integer, got 0");
}

Test(census_bad, fractional_dim) {
    expect_key_fail(QWEN3, "num_key_value_heads", "4.5",
                    "num_key_value_heads: expected a positive integer, got 4.5");
}

Test(census_bad, string_dim) {
    expect_key_fail(QWEN3, "head_dim", "\"8\"", "head_dim: expected a positive integer, got \"8\"");
}

Test(census_bad, boolean_dim) {
    expect_key_fail(DSV3, "kv_lora_rank", "true",
                    "kv_lora_rank: expected a positive integer, got true");
}

Test(census_bad, null_required_dim) {
    expect_key_fail(DSV3, "qk_rope_head_dim", "null",
                    "qk_rope_head_dim: expected a positive integer, got null");
}

Test(census_bad, huge_layers) {
    expect_key_fail(LLAMA, "num_hidden_layers", "5000",
                    "num_hidden_layers: 5000 exceeds the limit of 4096");
}

Test(census_bad, huge_heads) {
    expect_key_fail(QWEN3, "num_attention_heads", "4096",
                    "num_attention_heads: 4096 exceeds the limit of 1024");
}

Test(census_bad, huge_head_dim) {
    expect_key_fail(QWEN3, "head_dim", "100000", "head_dim: 100000 exceeds the limit of 65536");
}

Test(census_bad, huge_kv_lora_rank) {
    expect_key_fail(KIMI, "kv_lora_rank", "4294967808",
                    "kv_lora_rank: 4294967808 exceeds the limit of 65536");
}

Test(census_bad, integer_beyond_64_bits) {
    const char *t = "{\"model_type\":\"llama\",\"num_hidden_layers\":99999999999999999999999}";
    expect_text_fail(t, strlen(t), KVT_ERR_PARSE, "invalid JSON");
}

Test(census_bad, missing_key) {
    json_t *j = load_json(QWEN3);
    json_object_del(j, "num_attention_heads");
    expect_fail(j, KVT_ERR_PARSE, "num_attention_heads: missing");
}

Test(census_bad, missing_hidden_size_without_head_dim) {
    json_t *j = load_json(LLAMA);
    json_object_del(j, "hidden_size");
    expect_fail(j, KVT_ERR_PARSE, "hidden_size: missing");
}

Test(census_bad, hidden_size_not_divisible) {
    expect_key_fail(LLAMA, "hidden_size", "4097", "hidden_size: 4097 / num_attention_heads 32");
}

Test(census_bad, kv_heads_do_not_divide_q_heads) {
    expect_key_fail(QWEN3, "num_key_value_heads", "5",
                    "num_key_value_heads: 5 does not divide num_attention_heads 32");
}

Test(census_bad, duplicate_key) {
    const char *t = "{\"model_type\":\"llama\",\"model_type\":\"qwen3\"}";
    expect_text_fail(t, strlen(t), KVT_ERR_PARSE, "duplicate");
}

Test(census_bad, kimi_layer_out_of_range) {
    json_t *j = load_json(KIMI);
    json_t *full = json_object_get(json_object_get(j, "linear_attn_config"), "full_attn_layers");
    json_array_set_new(full, 2, json_integer(99));
    expect_fail(j, KVT_ERR_PARSE,
                "linear_attn_config.full_attn_layers[2]: layer 99 out of range 1..27");
}

Test(census_bad, kimi_layer_zero_is_out_of_range) {
    json_t *j = load_json(KIMI);
    json_t *kda = json_object_get(json_object_get(j, "linear_attn_config"), "kda_layers");
    json_array_set_new(kda, 0, json_integer(0));
    expect_fail(j, KVT_ERR_PARSE, "linear_attn_config.kda_layers[0]: layer 0 out of range 1..27");
}

Test(census_bad, kimi_overlapping_lists) {
    json_t *j = load_json(KIMI);
    json_t *kda = json_object_get(json_object_get(j, "linear_attn_config"), "kda_layers");
    json_array_set_new(kda, 0, json_integer(4)); /* 1 -> 4, an MLA layer */
    expect_fail(j, KVT_ERR_PARSE,
                "linear_attn_config.kda_layers[0]: layer 4 is also in "
                "full_attn_layers");
}

Test(census_bad, kimi_layer_uncovered) {
    json_t *j = load_json(KIMI);
    json_t *kda = json_object_get(json_object_get(j, "linear_attn_config"), "kda_layers");
    json_array_remove(kda, json_array_size(kda) - 1); /* drop 26 */
    expect_fail(j, KVT_ERR_PARSE, "layer 26 (1-indexed) is in neither");
}

Test(census_bad, kimi_layer_twice) {
    json_t *j = load_json(KIMI);
    json_t *full = json_object_get(json_object_get(j, "linear_attn_config"), "full_attn_layers");
    json_array_append_new(full, json_integer(8));
    expect_fail(j, KVT_ERR_PARSE, "full_attn_layers[7]: layer 8 listed twice");
}

Test(census_bad, kimi_layer_not_integer) {
    json_t *j = load_json(KIMI);
    json_t *full = json_object_get(json_object_get(j, "linear_attn_config"), "full_attn_layers");
    json_array_set_new(full, 1, json_string("8"));
    expect_fail(j, KVT_ERR_PARSE, "full_attn_layers[1]: expected a layer number, got \"8\"");
}

Test(census_bad, kimi_missing_linear_attn_config) {
    json_t *j = load_json(KIMI);
    json_object_del(j, "linear_attn_config");
    expect_fail(j, KVT_ERR_PARSE, "linear_attn_config: missing");
}

Test(census_bad, kimi_missing_kda_layers) {
    json_t *j = load_json(KIMI);
    json_object_del(json_object_get(j, "linear_attn_config"), "kda_layers");
    expect_fail(j, KVT_ERR_PARSE, "linear_attn_config.kda_layers: missing");
}

Test(census_bad, kimi_mla_use_nope_not_boolean) {
    expect_key_fail(KIMI, "mla_use_nope", "\"yes\"",
                    "mla_use_nope: expected true or false, got \"yes\"");
}

Test(census_bad, qwen3_next_zero_interval) {
    expect_key_fail(QNEXT, "full_attention_interval", "0",
                    "full_attention_interval: expected a positive integer, got 0");
}

Test(census_bad, gemma_layer_types_wrong_length) {
    expect_key_fail(GEMMA, "layer_types", "[\"full_attention\"]",
                    "layer_types: 1 entries for num_hidden_layers 26");
}

Test(census_bad, gemma_layer_types_unknown_entry) {
    json_t *j = load_json(GEMMA);
    json_t *lt = json_array();
    for (int i = 0; i < 26; i++)
        json_array_append_new(lt, json_string(i == 7 ? "chunked_attention" : "full_attention"));
    json_object_set_new(j, "layer_types", lt);
    expect_fail(j, KVT_ERR_PARSE, "layer_types[7]: unknown layer type \"chunked_attention\"");
}

Test(census_bad, gemma_zero_window) {
    expect_key_fail(GEMMA, "sliding_window", "0",
                    "sliding_window: expected a positive integer, got 0");
}

Test(census_bad, gemma3_text_config_not_object) {
    const char *t = "{\"model_type\":\"gemma3\",\"text_config\":[]}";
    expect_text_fail(t, strlen(t), KVT_ERR_PARSE, "text_config: expected an object");
}

Test(census_bad, fp8_dtype_and_null_arguments) {
    char err[256] = "";
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_from_file(tu_model_path(KIMI), KVT_DTYPE_FP8_E4M3, &m, err, sizeof err),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "dtype") != NULL, "%s", err);
    cr_assert_eq(kvt_model_from_file(NULL, KVT_DTYPE_BF16, &m, err, sizeof err),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_from_json(NULL, 0, KVT_DTYPE_BF16, &m, err, sizeof err),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_model_from_json("{}", 2, KVT_DTYPE_BF16, NULL, NULL, 0),
                 KVT_ERR_INVALID_ARGUMENT);
    /* err may be NULL. */
    cr_assert_eq(kvt_model_from_json("{}", 2, KVT_DTYPE_BF16, &m, NULL, 0), KVT_ERR_PARSE);
}
