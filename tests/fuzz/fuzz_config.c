/* fuzz_config.c — the census: a Hugging Face config.json (any bytes) through
 * kvt_model_from_json, then everything a model answers, and a context built on it.
 *
 * The input is the JSON text itself, so real configs are seeds as they are; the cache dtype is
 * taken from the input's length (any of the four, fp8 included). A model that loads must hold
 * only specs kvt_layer_spec_check accepts, and its census must answer within its documented
 * statuses at small and huge contexts. */
#include "fuzz.h"

#include <math.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvt_dtype dtype = (kvt_dtype)(size % 4);
    kvt_model *m = NULL;
    char err[256];
    kvt_status s = kvt_model_from_json((const char *)data, size, dtype, &m, err, sizeof err);
    FUZZ_STATUS("kvt_model_from_json", s, KVT_ERR_PARSE, KVT_ERR_INVALID_ARGUMENT,
                KVT_ERR_OUT_OF_MEMORY);
    if (s != KVT_OK) {
        FUZZ_REQUIRE(memchr(err, 0, sizeof err) != NULL, "err not NUL-terminated");
        FUZZ_REQUIRE(m == NULL, "*out set on failure");
        return 0;
    }
    FUZZ_REQUIRE(m != NULL, "KVT_OK without a model");
    uint32_t n = kvt_model_n_layers(m);
    FUZZ_REQUIRE(kvt_model_type(m) != NULL, "NULL model_type");
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        FUZZ_REQUIRE(l != NULL, "layer %u of %u missing", i, n);
        FUZZ_REQUIRE(kvt_layer_spec_check(l, err, sizeof err) == KVT_OK, "layer %u: %s", i, err);
        sum += kvt_layer_bytes_per_token(l);
    }
    FUZZ_REQUIRE(kvt_model_layer(m, n) == NULL, "layer past the end");
    FUZZ_REQUIRE(kvt_model_kv_bytes_per_token(m) == sum, "bytes per token disagree");

    static const uint64_t contexts[] = {0, 1, 4096, 131072, UINT64_C(1) << 40, UINT64_MAX};
    static const double ratios[] = {1.0, 7.5, 32.0, 1e300, 0.5, NAN};
    for (size_t c = 0; c < sizeof contexts / sizeof *contexts; c++)
        for (size_t r = 0; r < sizeof ratios / sizeof *ratios; r++) {
            kvt_census_totals t;
            s = kvt_model_census(m, contexts[c], c == 5 ? UINT64_MAX : 3, ratios[r], &t);
            FUZZ_STATUS("kvt_model_census", s, KVT_ERR_INVALID_ARGUMENT, KVT_ERR_OUT_OF_RANGE);
            if (ratios[r] < 1.0 || isnan(ratios[r]))
                FUZZ_REQUIRE(s == KVT_ERR_INVALID_ARGUMENT, "ratio %g accepted", ratios[r]);
            if (s == KVT_OK)
                FUZZ_REQUIRE(t.salience_layers + t.evict_layers + t.none_layers == n &&
                                 t.no_kv_layers <= t.none_layers,
                             "census counts %llu + %llu + %llu layers of %u",
                             (unsigned long long)t.salience_layers,
                             (unsigned long long)t.evict_layers,
                             (unsigned long long)t.none_layers, n);
        }

    /* A context of one one-row page per group, when the model's rows are small enough that this
     * stays cheap: the model's layers must be ones a context accepts. */
    if (sum > 0 && sum <= (1u << 22)) {
        kvt_ctx_params p = kvt_ctx_default_params();
        p.model = m;
        p.page_rows = 1;
        p.n_pages = 1;
        p.allocator = KVT_ALLOC_LIBC;
        kvt_ctx *ctx = NULL;
        s = kvt_ctx_create(&p, &ctx, err, sizeof err);
        FUZZ_STATUS("kvt_ctx_create", s, KVT_ERR_OUT_OF_MEMORY);
        kvt_ctx_destroy(ctx);
    }
    kvt_model_destroy(m);
    return 0;
}
