/*
 * census.c — the model census: read a Hugging Face config.json into per-layer kvt_layer_specs,
 * and the cache totals of a model at a context length, concurrency and compression ratio.
 *
 * Every family marks its layer kinds its own way; each reader below follows how the family's
 * transformers/remote code defines it, and says so where the rule is not obvious:
 *
 *   deepseek_v2, deepseek_v3  every layer MLA, branch rotated; num_hidden_layers excludes the MTP
 *                             layer(s) (num_nextn_predict_layers), which are not counted.
 *   kimi_linear               linear_attn_config.full_attn_layers (MLA) and .kda_layers (KDA, no
 *                             per-token KV), both 1-INDEXED; mla_use_nope says whether the branch
 *                             is cached unrotated.
 *   llama, mistral, qwen2,    GQA with RoPE; head_dim, or hidden_size / num_attention_heads when
 *   qwen3                     absent or null; num_key_value_heads defaults to num_attention_heads
 *                             (as in transformers). Sliding layers from layer_types, else
 *                             mistral: every layer when sliding_window is set; qwen2/qwen3: layers
 *                             i >= max_window_layers when use_sliding_window is true.
 *   qwen3_next                layer_types, else full attention where (i+1) %
 * full_attention_interval
 *                             == 0; the other layers are Gated DeltaNet (no per-token KV).
 *   gemma3_text (gemma3 with  layer_types, else sliding_window_pattern P: layer i global when
 *   a nested text_config)     (i+1) % P == 0, sliding otherwise. Keys the multimodal checkpoints
 *                             leave out take Gemma3TextConfig's defaults (see read_gemma3).
 *
 * Every number read is checked: a positive JSON integer (not 4.5, "8" or true) under a cap no
 * real model approaches, so that no size computed from it can overflow.
 */
#include "base/alloc.h"
#include "base/base.h"
#include "base/io.h"
#include "tiers/policy.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Caps on what a config may say. They are far above any published model and keep every product
 * (layers x heads x head_dim x 4 bytes < 2^44) inside 64 bits. */
#define CENSUS_MAX_LAYERS 4096u
#define CENSUS_MAX_HEADS 1024u
#define CENSUS_MAX_HEAD_DIM 65536u
#define CENSUS_MAX_LORA 65536u
#define CENSUS_MAX_HIDDEN (1u << 26)
#define CENSUS_MAX_WINDOW (1u << 30)
#define CENSUS_MAX_FILE_BYTES (16u << 20)

/* Where messages go, and the key prefix ("text_config." inside a gemma3 config). */
typedef struct parse {
    char *err;
    size_t len;
    const char *prefix;
} parse;

/* Short JSON rendering of a value for error messages ("-3", "4.5", "\"8\"", "true"). */
static void describe(const json_t *v, char *buf, size_t n) {
    if (!v) {
        snprintf(buf, n, "nothing");
        return;
    }
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!s) {
        snprintf(buf, n, "an unprintable value");
        return;
    }
    if (strlen(s) > 40)
        snprintf(buf, n, "%.37s...", s);
    else
        snprintf(buf, n, "%s", s);
    json_free_t jfree; /* jansson's own free: whichever allocator jansson has (alloc.h) */
    json_get_alloc_funcs(NULL, &jfree);
    jfree(s);
}

/* Check that v (the value of `name`) is an integer in 1..max. */
static kvt_status check_dim(const parse *p, const char *name, const json_t *v, uint32_t max,
                            uint32_t *out) {
    char got[64];
    if (!v)
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "%s%s: missing (expected a positive integer)", p->prefix, name);
    if (!json_is_integer(v) || json_integer_value(v) <= 0) {
        describe(v, got, sizeof got);
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE, "%s%s: expected a positive integer, got %s",
                         p->prefix, name, got);
    }
    json_int_t x = json_integer_value(v);
    if ((unsigned long long)x > max)
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE, "%s%s: %lld exceeds the limit of %u",
                         p->prefix, name, (long long)x, max);
    *out = (uint32_t)x;
    return KVT_OK;
}

/* obj[key] as an integer in 1..max; required. */
static kvt_status get_dim(const parse *p, const json_t *obj, const char *key, uint32_t max,
                          uint32_t *out) {
    return check_dim(p, key, json_object_get(obj, key), max, out);
}

/* obj[key] when present and not null (then checked like get_dim); else *out = dflt. */
static kvt_status get_dim_or(const parse *p, const json_t *obj, const char *key, uint32_t max,
                             uint32_t dflt, uint32_t *out) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        *out = dflt;
        return KVT_OK;
    }
    return check_dim(p, key, v, max, out);
}

/* obj[key] as a boolean; absent or null gives dflt. */
static kvt_status get_bool_or(const parse *p, const json_t *obj, const char *key, bool dflt,
                              bool *out) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        *out = dflt;
        return KVT_OK;
    }
    if (!json_is_boolean(v)) {
        char got[64];
        describe(v, got, sizeof got);
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE, "%s%s: expected true or false, got %s",
                         p->prefix, key, got);
    }
    *out = json_is_true(v);
    return KVT_OK;
}

/* Per-layer role while reading, before the specs are built. */
enum role { ROLE_UNSET = 0, ROLE_FULL, ROLE_SLIDING, ROLE_NO_KV };

/* `layer_types`: an array of n strings; names[k] maps to roles[k] (names NULL-terminated).
 * *present is false (and roles untouched) when the key is absent or null. */
static kvt_status read_layer_types(const parse *p, const json_t *cfg, uint32_t n,
                                   const char *const *names, const enum role *roles, enum role *out,
                                   bool *present) {
    const json_t *lt = json_object_get(cfg, "layer_types");
    *present = false;
    if (!lt || json_is_null(lt))
        return KVT_OK;
    char got[64];
    if (!json_is_array(lt)) {
        describe(lt, got, sizeof got);
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "%slayer_types: expected an array of strings, got %s", p->prefix, got);
    }
    if (json_array_size(lt) != n)
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "%slayer_types: %zu entries for num_hidden_layers %u", p->prefix,
                         json_array_size(lt), n);
    for (uint32_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(lt, i);
        const char *s = json_string_value(e);
        size_t k = 0;
        while (s && names[k] && strcmp(s, names[k]) != 0)
            k++;
        if (!s || !names[k]) {
            describe(e, got, sizeof got);
            char allowed[160] = "";
            for (size_t j = 0; names[j]; j++) {
                size_t used = strlen(allowed);
                snprintf(allowed + used, sizeof allowed - used, "%s\"%s\"", j ? ", " : "",
                         names[j]);
            }
            return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                             "%slayer_types[%u]: unknown layer type %s (expected one of %s)",
                             p->prefix, i, got, allowed);
        }
        out[i] = roles[k];
    }
    *present = true;
    return KVT_OK;
}

/* Build a model from roles: full layers get `full` (a GQA kind), sliding layers a sliding GQA
 * spec with `window`. */
/* Common end of the family readers: report a failed spec build, else copy the specs into the
 * model; frees specs either way. */
static kvt_status finish_model(const parse *p, kvt_layer_spec *specs, uint32_t n,
                               const char *model_type, kvt_status s, const char *what,
                               kvt_model **out) {
    if (s != KVT_OK)
        s = kvt__fail(p->err, p->len, s, "cannot build %s layer spec", what);
    else
        s = kvt_model_create(specs, n, model_type, out, p->err, p->len);
    kvt__mem_free(specs);
    return s;
}

static kvt_status build_gqa(const parse *p, const char *model_type, kvt_dtype dtype,
                            const enum role *roles, uint32_t n, kvt_layer_kind full,
                            uint32_t kv_heads, uint32_t head_dim, uint32_t q_heads, uint32_t window,
                            kvt_model **out) {
    kvt_layer_spec *specs = kvt__mem_calloc(n, sizeof *specs);
    if (!specs)
        return kvt__fail(p->err, p->len, KVT_ERR_OUT_OF_MEMORY, "layer specs");
    kvt_status s = KVT_OK;
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        switch (roles[i]) {
        case ROLE_NO_KV:
            specs[i].kind = KVT_LAYER_NO_KV;
            specs[i].dtype = dtype;
            specs[i].branch_dtype = dtype;
            break;
        case ROLE_SLIDING:
            s = kvt_layer_spec_gqa(KVT_LAYER_SLIDING, dtype, kv_heads, head_dim, &specs[i]);
            specs[i].sliding_window = window;
            break;
        case ROLE_FULL:
        case ROLE_UNSET:
            s = kvt_layer_spec_gqa(full, dtype, kv_heads, head_dim, &specs[i]);
            break;
        }
        specs[i].n_q_heads = q_heads;
    }
    return finish_model(p, specs, n, model_type, s, "a GQA", out);
}

/* num_key_value_heads must divide num_attention_heads (GQA groups of equal size). */
static kvt_status check_groups(const parse *p, uint32_t q_heads, uint32_t kv_heads) {
    if (kv_heads > q_heads || q_heads % kv_heads != 0)
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "%snum_key_value_heads: %u does not divide num_attention_heads %u",
                         p->prefix, kv_heads, q_heads);
    return KVT_OK;
}

/* head_dim, or hidden_size / num_attention_heads when head_dim is absent or null. */
static kvt_status read_head_dim(const parse *p, const json_t *cfg, uint32_t q_heads,
                                uint32_t *out) {
    const json_t *v = json_object_get(cfg, "head_dim");
    if (v && !json_is_null(v))
        return check_dim(p, "head_dim", v, CENSUS_MAX_HEAD_DIM, out);
    uint32_t hidden;
    kvt_status s = get_dim(p, cfg, "hidden_size", CENSUS_MAX_HIDDEN, &hidden);
    if (s != KVT_OK)
        return s;
    if (hidden % q_heads != 0 || hidden / q_heads > CENSUS_MAX_HEAD_DIM)
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "%shidden_size: %u / num_attention_heads %u is not a head_dim in 1..%u "
                         "(and no head_dim key)",
                         p->prefix, hidden, q_heads, CENSUS_MAX_HEAD_DIM);
    *out = hidden / q_heads;
    return KVT_OK;
}

/* --- MLA families ------------------------------------------------------------------------- */

/* kv_lora_rank, qk_rope_head_dim, num_attention_heads, num_hidden_layers. */
static kvt_status read_mla_dims(const parse *p, const json_t *cfg, uint32_t *n_layers,
                                uint32_t *rank, uint32_t *rope, uint32_t *q_heads) {
    kvt_status s;
    if ((s = get_dim(p, cfg, "num_hidden_layers", CENSUS_MAX_LAYERS, n_layers)) != KVT_OK ||
        (s = get_dim(p, cfg, "kv_lora_rank", CENSUS_MAX_LORA, rank)) != KVT_OK ||
        (s = get_dim(p, cfg, "qk_rope_head_dim", CENSUS_MAX_HEAD_DIM, rope)) != KVT_OK ||
        (s = get_dim(p, cfg, "num_attention_heads", CENSUS_MAX_HEADS, q_heads)) != KVT_OK)
        return s;
    return KVT_OK;
}

static kvt_status build_mla(const parse *p, const char *model_type, kvt_dtype dtype,
                            const enum role *roles, uint32_t n, kvt_layer_kind kind, uint32_t rank,
                            uint32_t rope, uint32_t q_heads, kvt_model **out) {
    kvt_layer_spec *specs = kvt__mem_calloc(n, sizeof *specs);
    if (!specs)
        return kvt__fail(p->err, p->len, KVT_ERR_OUT_OF_MEMORY, "layer specs");
    kvt_status s = KVT_OK;
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        if (roles && roles[i] == ROLE_NO_KV) {
            specs[i].kind = KVT_LAYER_NO_KV;
            specs[i].dtype = dtype;
            specs[i].branch_dtype = dtype;
        } else {
            s = kvt_layer_spec_mla(kind, dtype, rank, rope, &specs[i]);
        }
        specs[i].n_q_heads = q_heads;
    }
    return finish_model(p, specs, n, model_type, s, "an MLA", out);
}

/* DeepSeek-V2/V3: num_hidden_layers MLA layers with a rotated branch. The MTP module
 * (num_nextn_predict_layers) sits after them and is not part of decoding's cache here. */
static kvt_status read_deepseek(const parse *p, const json_t *cfg, const char *model_type,
                                kvt_dtype dtype, kvt_model **out) {
    uint32_t n, rank, rope, q_heads;
    kvt_status s = read_mla_dims(p, cfg, &n, &rank, &rope, &q_heads);
    if (s != KVT_OK)
        return s;
    return build_mla(p, model_type, dtype, NULL, n, KVT_LAYER_MLA_ROPE, rank, rope, q_heads, out);
}

/* One of Kimi's 1-indexed layer lists: marks roles[number - 1] = role, rejecting non-integers,
 * numbers outside 1..n, repeats, and layers the other list already claimed. */
static kvt_status kimi_list(const parse *p, const json_t *lac, const char *key, uint32_t n,
                            enum role role, const char *other, enum role *roles) {
    const json_t *arr = json_object_get(lac, key);
    char got[64];
    if (!arr)
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "linear_attn_config.%s: missing (expected an array of 1-indexed layer "
                         "numbers)",
                         key);
    if (!json_is_array(arr)) {
        describe(arr, got, sizeof got);
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "linear_attn_config.%s: expected an array of 1-indexed layer numbers, "
                         "got %s",
                         key, got);
    }
    for (size_t i = 0; i < json_array_size(arr); i++) {
        const json_t *e = json_array_get(arr, i);
        if (!json_is_integer(e)) {
            describe(e, got, sizeof got);
            return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                             "linear_attn_config.%s[%zu]: expected a layer number, got %s", key, i,
                             got);
        }
        json_int_t x = json_integer_value(e);
        if (x < 1 || x > (json_int_t)n)
            return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                             "linear_attn_config.%s[%zu]: layer %lld out of range 1..%u "
                             "(the list is 1-indexed)",
                             key, i, (long long)x, n);
        enum role *r = &roles[x - 1];
        if (*r == role)
            return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                             "linear_attn_config.%s[%zu]: layer %lld listed twice", key, i,
                             (long long)x);
        if (*r != ROLE_UNSET)
            return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                             "linear_attn_config.%s[%zu]: layer %lld is also in %s", key, i,
                             (long long)x, other);
        *r = role;
    }
    return KVT_OK;
}

/* Kimi Linear: MLA at linear_attn_config.full_attn_layers, KDA at .kda_layers, both 1-indexed
 * (modeling_kimi.py tests `layer_idx + 1 in full_attn_layers`). mla_use_nope: true caches the
 * 64-dim branch unrotated (NoPE -> salience); false or absent means a rotated branch, the safe
 * reading (random eviction is valid on either; salience is not valid on a rotated branch). */
static kvt_status read_kimi(const parse *p, const json_t *cfg, const char *model_type,
                            kvt_dtype dtype, kvt_model **out) {
    uint32_t n, rank, rope, q_heads;
    bool nope;
    kvt_status s = read_mla_dims(p, cfg, &n, &rank, &rope, &q_heads);
    if (s != KVT_OK || (s = get_bool_or(p, cfg, "mla_use_nope", false, &nope)) != KVT_OK)
        return s;
    const json_t *lac = json_object_get(cfg, "linear_attn_config");
    if (!json_is_object(lac)) {
        char got[64];
        describe(lac, got, sizeof got);
        if (!lac)
            return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                             "linear_attn_config: missing (expected an object with "
                             "full_attn_layers and kda_layers)");
        return kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                         "linear_attn_config: expected an object, got %s", got);
    }
    enum role *roles = kvt__mem_calloc(n, sizeof *roles);
    if (!roles)
        return kvt__fail(p->err, p->len, KVT_ERR_OUT_OF_MEMORY, "layer roles");
    s = kimi_list(p, lac, "full_attn_layers", n, ROLE_FULL, "kda_layers", roles);
    if (s == KVT_OK)
        s = kimi_list(p, lac, "kda_layers", n, ROLE_NO_KV, "full_attn_layers", roles);
    for (uint32_t i = 0; i < n && s == KVT_OK; i++)
        if (roles[i] == ROLE_UNSET)
            s = kvt__fail(p->err, p->len, KVT_ERR_PARSE,
                          "linear_attn_config: layer %u (1-indexed) is in neither "
                          "full_attn_layers nor kda_layers",
                          i + 1);
    if (s == KVT_OK)
        s = build_mla(p, model_type, dtype, roles, n,
                      nope ? KVT_LAYER_MLA_NOPE : KVT_LAYER_MLA_ROPE, rank, rope, q_heads, out);
    kvt__mem_free(roles);
    return s;
}

/* --- GQA families ------------------------------------------------------------------------- */

static const char *const k_sliding_names[] = {"full_attention", "sliding_attention", NULL};
static const enum role k_sliding_roles[] = {ROLE_FULL, ROLE_SLIDING};

/* sliding_window as a window size, required when some layer slides. */
static kvt_status read_window(const parse *p, const json_t *cfg, uint32_t *window) {
    return get_dim(p, cfg, "sliding_window", CENSUS_MAX_WINDOW, window);
}

/* llama, mistral, qwen2, qwen3: GQA with RoPE on every layer, some sliding (see top). */
static kvt_status read_gqa_family(const parse *p, const json_t *cfg, const char *model_type,
                                  kvt_dtype dtype, kvt_model **out) {
    uint32_t n, q_heads, kv_heads, head_dim, window = 0;
    kvt_status s;
    if ((s = get_dim(p, cfg, "num_hidden_layers", CENSUS_MAX_LAYERS, &n)) != KVT_OK ||
        (s = get_dim(p, cfg, "num_attention_heads", CENSUS_MAX_HEADS, &q_heads)) != KVT_OK ||
        (s = get_dim_or(p, cfg, "num_key_value_heads", CENSUS_MAX_HEADS, q_heads, &kv_heads)) !=
            KVT_OK ||
        (s = check_groups(p, q_heads, kv_heads)) != KVT_OK ||
        (s = read_head_dim(p, cfg, q_heads, &head_dim)) != KVT_OK)
        return s;
    enum role *roles = kvt__mem_calloc(n, sizeof *roles);
    if (!roles)
        return kvt__fail(p->err, p->len, KVT_ERR_OUT_OF_MEMORY, "layer roles");
    bool listed = false, any_sliding = false;
    s = read_layer_types(p, cfg, n, k_sliding_names, k_sliding_roles, roles, &listed);
    if (s == KVT_OK && !listed) {
        const json_t *sw = json_object_get(cfg, "sliding_window");
        bool has_window = sw && !json_is_null(sw);
        if (strcmp(model_type, "mistral") == 0 && has_window) {
            for (uint32_t i = 0; i < n; i++)
                roles[i] = ROLE_SLIDING;
        } else if (strcmp(model_type, "qwen2") == 0 || strcmp(model_type, "qwen3") == 0) {
            bool use = false;
            uint32_t first = 0;
            s = get_bool_or(p, cfg, "use_sliding_window", false, &use);
            if (s == KVT_OK && use && has_window) {
                const json_t *mw = json_object_get(cfg, "max_window_layers");
                if (mw && json_is_integer(mw) && json_integer_value(mw) == 0)
                    first = 0; /* every layer slides */
                else
                    s = get_dim(p, cfg, "max_window_layers", CENSUS_MAX_LAYERS, &first);
                for (uint32_t i = first; i < n && s == KVT_OK; i++)
                    roles[i] = ROLE_SLIDING;
            }
        }
    }
    for (uint32_t i = 0; i < n; i++)
        any_sliding |= roles[i] == ROLE_SLIDING;
    if (s == KVT_OK && any_sliding)
        s = read_window(p, cfg, &window);
    if (s == KVT_OK)
        s = build_gqa(p, model_type, dtype, roles, n, KVT_LAYER_GQA_ROPE, kv_heads, head_dim,
                      q_heads, window, out);
    kvt__mem_free(roles);
    return s;
}

/* Qwen3-Next: full attention (GQA, RoPE) where (i+1) % full_attention_interval == 0 (the
 * transformers Qwen3NextConfig rule), Gated DeltaNet elsewhere; layer_types wins when saved. */
static kvt_status read_qwen3_next(const parse *p, const json_t *cfg, const char *model_type,
                                  kvt_dtype dtype, kvt_model **out) {
    static const char *const names[] = {"full_attention", "linear_attention", NULL};
    static const enum role roles_of[] = {ROLE_FULL, ROLE_NO_KV};
    uint32_t n, q_heads, kv_heads, head_dim, interval;
    kvt_status s;
    if ((s = get_dim(p, cfg, "num_hidden_layers", CENSUS_MAX_LAYERS, &n)) != KVT_OK ||
        (s = get_dim(p, cfg, "num_attention_heads", CENSUS_MAX_HEADS, &q_heads)) != KVT_OK ||
        (s = get_dim(p, cfg, "num_key_value_heads", CENSUS_MAX_HEADS, &kv_heads)) != KVT_OK ||
        (s = check_groups(p, q_heads, kv_heads)) != KVT_OK ||
        (s = read_head_dim(p, cfg, q_heads, &head_dim)) != KVT_OK)
        return s;
    enum role *roles = kvt__mem_calloc(n, sizeof *roles);
    if (!roles)
        return kvt__fail(p->err, p->len, KVT_ERR_OUT_OF_MEMORY, "layer roles");
    bool listed = false;
    s = read_layer_types(p, cfg, n, names, roles_of, roles, &listed);
    if (s == KVT_OK && !listed) {
        s = get_dim(p, cfg, "full_attention_interval", CENSUS_MAX_LAYERS, &interval);
        for (uint32_t i = 0; i < n && s == KVT_OK; i++)
            roles[i] = (i + 1) % interval == 0 ? ROLE_FULL : ROLE_NO_KV;
    }
    if (s == KVT_OK)
        s = build_gqa(p, model_type, dtype, roles, n, KVT_LAYER_GQA_ROPE, kv_heads, head_dim,
                      q_heads, 0, out);
    kvt__mem_free(roles);
    return s;
}

/* Gemma 3: sliding-window layers and global layers, both GQA with RoPE (different bases).
 * layer_types when saved (newer transformers), else sliding_window_pattern P: layer i is global
 * when (i+1) % P == 0 (Gemma3TextConfig: `bool((i + 1) % sliding_window_pattern)` -> sliding).
 * Multimodal checkpoints (gemma-3-4b/12b/27b) save a text_config that omits keys equal to
 * Gemma3TextConfig's defaults, which are therefore applied here: num_attention_heads 8,
 * num_key_value_heads 4, head_dim 256, sliding_window 4096, sliding_window_pattern 6. */
static kvt_status read_gemma3(const parse *p, const json_t *cfg, const char *model_type,
                              kvt_dtype dtype, kvt_model **out) {
    uint32_t n, q_heads, kv_heads, head_dim, window, pattern;
    kvt_status s;
    if ((s = get_dim(p, cfg, "num_hidden_layers", CENSUS_MAX_LAYERS, &n)) != KVT_OK ||
        (s = get_dim_or(p, cfg, "num_attention_heads", CENSUS_MAX_HEADS, 8, &q_heads)) != KVT_OK ||
        (s = get_dim_or(p, cfg, "num_key_value_heads", CENSUS_MAX_HEADS, 4, &kv_heads)) != KVT_OK ||
        (s = check_groups(p, q_heads, kv_heads)) != KVT_OK ||
        (s = get_dim_or(p, cfg, "head_dim", CENSUS_MAX_HEAD_DIM, 256, &head_dim)) != KVT_OK ||
        (s = get_dim_or(p, cfg, "sliding_window", CENSUS_MAX_WINDOW, 4096, &window)) != KVT_OK)
        return s;
    enum role *roles = kvt__mem_calloc(n, sizeof *roles);
    if (!roles)
        return kvt__fail(p->err, p->len, KVT_ERR_OUT_OF_MEMORY, "layer roles");
    bool listed = false;
    s = read_layer_types(p, cfg, n, k_sliding_names, k_sliding_roles, roles, &listed);
    if (s == KVT_OK && !listed) {
        s = get_dim_or(p, cfg, "sliding_window_pattern", CENSUS_MAX_LAYERS, 6, &pattern);
        for (uint32_t i = 0; i < n && s == KVT_OK; i++)
            roles[i] = (i + 1) % pattern == 0 ? ROLE_FULL : ROLE_SLIDING;
    }
    if (s == KVT_OK)
        s = build_gqa(p, model_type, dtype, roles, n, KVT_LAYER_GQA_ROPE, kv_heads, head_dim,
                      q_heads, window, out);
    kvt__mem_free(roles);
    return s;
}

/* --- entry points ------------------------------------------------------------------------- */

typedef kvt_status (*family_reader)(const parse *, const json_t *, const char *, kvt_dtype,
                                    kvt_model **);

static const struct family {
    const char *model_type;
    family_reader read;
} k_families[] = {
    {"deepseek_v2", read_deepseek}, {"deepseek_v3", read_deepseek},  {"kimi_linear", read_kimi},
    {"qwen3", read_gqa_family},     {"qwen2", read_gqa_family},      {"llama", read_gqa_family},
    {"mistral", read_gqa_family},   {"qwen3_next", read_qwen3_next}, {"gemma3_text", read_gemma3},
};

static kvt_status from_root(const json_t *root, kvt_dtype dtype, kvt_model **out, char *err,
                            size_t len) {
    parse p = {err, len, ""};
    char got[64];
    if (!json_is_object(root)) {
        describe(root, got, sizeof got);
        return kvt__fail(err, len, KVT_ERR_PARSE, "root: expected a JSON object, got %s", got);
    }
    const json_t *mt = json_object_get(root, "model_type");
    if (!mt)
        return kvt__fail(err, len, KVT_ERR_PARSE, "model_type: missing");
    if (!json_is_string(mt)) {
        describe(mt, got, sizeof got);
        return kvt__fail(err, len, KVT_ERR_PARSE, "model_type: expected a string, got %s", got);
    }
    const char *model_type = json_string_value(mt);
    const json_t *cfg = root;
    const char *family = model_type;
    if (strcmp(model_type, "gemma3") == 0) {
        /* Gemma 3 multimodal: the language model's config is nested. */
        cfg = json_object_get(root, "text_config");
        if (!json_is_object(cfg)) {
            describe(cfg, got, sizeof got);
            return kvt__fail(err, len, KVT_ERR_PARSE,
                             "text_config: expected an object (model_type gemma3), got %s", got);
        }
        p.prefix = "text_config.";
        family = "gemma3_text";
    }
    for (size_t i = 0; i < sizeof k_families / sizeof k_families[0]; i++)
        if (strcmp(family, k_families[i].model_type) == 0)
            return k_families[i].read(&p, cfg, model_type, dtype, out);
    char shown[48];
    snprintf(shown, sizeof shown, "%.40s%s", model_type, strlen(model_type) > 40 ? "..." : "");
    return kvt__fail(err, len, KVT_ERR_PARSE,
                     "model_type: unknown family \"%s\" (known: deepseek_v2, deepseek_v3, "
                     "kimi_linear, qwen3, qwen2, llama, mistral, qwen3_next, gemma3_text, gemma3)",
                     shown);
}

static kvt_status from_buffer(const char *json, size_t n, const char *source, kvt_dtype dtype,
                              kvt_model **out, char *err, size_t len) {
    json_error_t je;
    kvt__mem_json_install();
    (void)kvt__mem_json_failed();
    json_t *root = json_loadb(json, n, JSON_REJECT_DUPLICATES, &je);
    /* jansson reports some allocation failures as syntax errors, or with no message at all:
     * whether one of its allocations failed is the seam's to say. */
    if (kvt__mem_json_failed() || (!root && json_error_code(&je) == json_error_out_of_memory)) {
        json_decref(root);
        return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "%s: out of memory parsing the JSON",
                         source);
    }
    if (!root)
        return kvt__fail(err, len, KVT_ERR_PARSE, "%s: invalid JSON at line %d, column %d: %s",
                         source, je.line, je.column, je.text);
    kvt_status s = from_root(root, dtype, out, err, len);
    json_decref(root);
    return s;
}

static kvt_status check_args(kvt_dtype dtype, kvt_model **out, char *err, size_t len) {
    if (!out)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (dtype != KVT_DTYPE_BF16 && dtype != KVT_DTYPE_FP16 && dtype != KVT_DTYPE_FP32)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "dtype: the census takes bf16, fp16 or fp32 (got %d)", (int)dtype);
    return KVT_OK;
}

kvt_status kvt_model_from_json(const char *json, size_t n, kvt_dtype dtype, kvt_model **out,
                               char *err, size_t len) {
    kvt_status s = check_args(dtype, out, err, len);
    if (s != KVT_OK)
        return s;
    if (!json)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "json is NULL");
    return from_buffer(json, n, "config", dtype, out, err, len);
}

kvt_status kvt_model_from_file(const char *path, kvt_dtype dtype, kvt_model **out, char *err,
                               size_t len) {
    kvt_status s = check_args(dtype, out, err, len);
    if (s != KVT_OK)
        return s;
    if (!path)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "path is NULL");
    int fd = kvt__io_open(path, O_RDONLY, 0);
    if (fd < 0)
        return kvt__fail(err, len, KVT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    /* Read at most the cap + 1 bytes: a config is a few KB; anything larger is not one. */
    size_t cap = CENSUS_MAX_FILE_BYTES, used = 0, size = 4096;
    char *buf = kvt__mem_malloc(size);
    int read_error = 0;
    while (buf) {
        if (used == size) {
            if (size > cap)
                break;
            char *nb = kvt__mem_realloc(buf, size * 2);
            if (!nb) {
                kvt__mem_free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            size *= 2;
        }
        ssize_t got = kvt__io_read(fd, buf + used, size - used);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            read_error = errno;
            break;
        }
        if (got == 0)
            break;
        used += (size_t)got;
    }
    kvt__io_close(fd); /* read-only: a failed close loses nothing */
    if (!buf)
        return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "%s: read buffer", path);
    if (read_error) {
        kvt__mem_free(buf);
        return kvt__fail(err, len, KVT_ERR_IO, "%s: read error: %s", path, strerror(read_error));
    }
    if (used > cap) {
        kvt__mem_free(buf);
        return kvt__fail(err, len, KVT_ERR_IO, "%s: larger than the %u-byte limit for a config",
                         path, CENSUS_MAX_FILE_BYTES);
    }
    s = from_buffer(buf, used, path, dtype, out, err, len);
    kvt__mem_free(buf);
    return s;
}

/* --- totals ------------------------------------------------------------------------------- */

/* a * b, false on overflow. */
static bool mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a)
        return false;
    *out = a * b;
    return true;
}

static bool add_u64(uint64_t *acc, uint64_t x) {
    if (x > UINT64_MAX - *acc)
        return false;
    *acc += x;
    return true;
}

/* Rows kept (evict) or read (salience) at a ratio: context / ratio rounded to nearest, at least
 * 1 when there is any context, at most the context. Exact integer arithmetic for an integral
 * ratio (the usual case), double otherwise. */
static uint64_t rows_at_ratio(uint64_t context, double ratio) {
    if (context == 0)
        return 0;
    uint64_t rows;
    if (ratio == floor(ratio) && ratio < 9.0e18) {
        uint64_t r = (uint64_t)ratio;
        rows = context / r + (context % r >= r - context % r ? 1 : 0);
    } else {
        double d = floor((double)context / ratio + 0.5);
        rows = d >= (double)context ? context : (uint64_t)d;
    }
    if (rows < 1)
        rows = 1;
    return rows > context ? context : rows;
}

kvt_status kvt_model_census(const kvt_model *m, uint64_t context, uint64_t concurrency,
                            double ratio, kvt_census_totals *out) {
    return kvt_model_census_shared(m, context, concurrency, ratio, 0, out);
}

/* Rows of a layer C requests hold together when each holds `rows` of which the first `shared`
 * are one copy for all: C * rows - (C - 1) * shared (shared <= rows). */
static bool held_once(uint64_t C, uint64_t rows, uint64_t shared, uint64_t *out) {
    uint64_t all, dup;
    if (C == 0) {
        *out = 0;
        return true;
    }
    if (!mul_u64(C, rows, &all) || !mul_u64(C - 1, shared, &dup))
        return false;
    *out = all - dup;
    return true;
}

kvt_status kvt_model_census_shared(const kvt_model *m, uint64_t context, uint64_t concurrency,
                                   double ratio, uint64_t shared_rows, kvt_census_totals *out) {
    if (out)
        memset(out, 0, sizeof *out);
    if (!m || !out || !isfinite(ratio) || !(ratio >= 1.0) || shared_rows > context)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_census_totals t = {0};
    /* Layers counted by their policy (kvt_policy_for_kind: one of the three). */
    uint64_t *const layers_under[] = {[KVT_POLICY_NONE] = &t.none_layers,
                                      [KVT_POLICY_SALIENCE] = &t.salience_layers,
                                      [KVT_POLICY_EVICT] = &t.evict_layers};
    t.kv_bytes_per_token = kvt_model_kv_bytes_per_token(m);
    uint64_t k_rows = rows_at_ratio(context, ratio);
    for (uint32_t i = 0; i < kvt_model_n_layers(m); i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        kvt_policy pol = kvt_policy_for_kind(l->kind);
        (*layers_under[pol])++;
        if (l->kind == KVT_LAYER_NO_KV) {
            t.no_kv_layers++;
            continue;
        }
        /* The policy's model of the layer (policy.h layer_window, census): a sliding-window
         * layer stores its window; salience attends the budget and keeps its archive in the
         * pool; random eviction frees what is past the budget. */
        const kvt__policy_ops *ops = kvt__policy_table(pol);
        uint64_t stored = context, attended, freed = 0;
        uint32_t window;
        if (ops->layer_window && ops->layer_window(l, &window) && window < stored)
            stored = window;
        if (ops->census)
            ops->census(stored, k_rows, &attended, &freed);
        else
            attended = stored;
        /* The shared prefix's rows the layer still holds (a sliding layer holds the last
         * `stored` rows), and of them those a random-evicting layer keeps: the protected prompt,
         * at most its budget. Every request reads its own attended rows. */
        const uint64_t start = context - stored;
        const uint64_t overlap = shared_rows > start ? shared_rows - start : 0;
        const uint64_t kept = stored - freed;
        uint64_t per_req, rows_held, rows_kept, dense, att, fr;
        uint64_t bpt = kvt_layer_bytes_per_token(l);
        if (!mul_u64(bpt, concurrency, &per_req) ||
            !held_once(concurrency, stored, overlap, &rows_held) ||
            !held_once(concurrency, kept, overlap < kept ? overlap : kept, &rows_kept) ||
            !mul_u64(bpt, rows_held, &dense) || !mul_u64(per_req, attended, &att) ||
            !mul_u64(bpt, rows_held - rows_kept, &fr) || !add_u64(&t.dense_bytes, dense) ||
            !add_u64(&t.attended_bytes, att) || !add_u64(&t.freed_bytes, fr))
            return KVT_ERR_OUT_OF_RANGE;
    }
    *out = t;
    return KVT_OK;
}
