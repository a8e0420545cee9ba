/* test_core.c — the public API contract: statuses, config and context errors, the storage
 * contract (reserve / write / commit, all or nothing), attended-set layouts, salience tiering end
 * to end with a shadow copy of every row, and the invariant checker after every operation. */
#include <criterion/criterion.h>

#include "kvtier.h"
#include "support/testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvt_model *mla_model(kvt_layer_kind kind, uint32_t n_layers) {
    kvt_layer_spec specs[8];
    for (uint32_t i = 0; i < n_layers; i++)
        cr_assert_eq(kvt_layer_spec_mla(kind, KVT_DTYPE_BF16, 512, 64, &specs[i]), KVT_OK);
    kvt_model *m = NULL;
    char err[256];
    cr_assert_eq(kvt_model_create(specs, n_layers, "test", &m, err, sizeof err), KVT_OK, "%s", err);
    return m;
}

Test(status, names_and_messages) {
    cr_assert_str_eq(kvt_status_name(KVT_OK), "KVT_OK");
    cr_assert_str_eq(kvt_status_name(KVT_ERR_POOL_EXHAUSTED), "KVT_ERR_POOL_EXHAUSTED");
    cr_assert(strstr(kvt_strerror(KVT_ERR_CAPACITY), "buffer") != NULL);
    cr_assert_str_eq(kvt_status_name((kvt_status)-999), "KVT_UNKNOWN_STATUS");
    int ma = -1, mi = -1, pa = -1;
    const char *v = kvt_version(&ma, &mi, &pa);
    cr_assert_eq(ma, KVT_VERSION_MAJOR);
    cr_assert(strchr(v, '.') != NULL);
}

/* The largest |V Vᵀ − I| entry of rank rows of n doubles. */
static double ortho_error(const double *V, uint32_t rank, uint32_t n) {
    double worst = 0;
    for (uint32_t a = 0; a < rank; a++)
        for (uint32_t b = 0; b < rank; b++) {
            double dot = 0;
            for (uint32_t d = 0; d < n; d++)
                dot += V[(size_t)a * n + d] * V[(size_t)b * n + d];
            worst = fmax(worst, fabs(dot - (a == b ? 1.0 : 0.0)));
        }
    return worst;
}

/* kvt_orthonormalise_rows, the one Gram-Schmidt of the tree (calibrate, the needle generator,
 * the tests' bases): orthonormal to double precision in either form its callers use (two passes
 * per row; two sweeps of one pass), directions and signs kept, bad input refused by status. */
Test(orthonormalise, rows_come_out_orthonormal_and_bad_input_is_refused) {
    enum { R = 16, N = 64 };
    static double x[R * N], v[R * N], w[R * N];
    tu_rng g = {7};
    for (size_t i = 0; i < R * N; i++)
        x[i] = tu_normal(&g);
    memcpy(v, x, sizeof x);
    cr_assert_eq(kvt_orthonormalise_rows(v, R, N, 2), KVT_OK);
    cr_assert_lt(ortho_error(v, R, N), 1e-14);
    memcpy(w, x, sizeof x);
    cr_assert_eq(kvt_orthonormalise_rows(w, R, N, 1), KVT_OK);
    cr_assert_eq(kvt_orthonormalise_rows(w, R, N, 1), KVT_OK);
    cr_assert_lt(ortho_error(w, R, N), 1e-14);
    /* row k spans what rows 0..k did: row 0 is x's row 0 scaled, and each row keeps its sign
     * against the input row it came from */
    double n0 = 0;
    for (uint32_t d = 0; d < N; d++)
        n0 += x[d] * x[d];
    for (uint32_t d = 0; d < N; d++)
        cr_assert_lt(fabs(v[d] - x[d] / sqrt(n0)), 1e-15);
    for (uint32_t k = 0; k < R; k++) {
        double dot = 0;
        for (uint32_t d = 0; d < N; d++)
            dot += v[(size_t)k * N + d] * x[(size_t)k * N + d];
        cr_assert_gt(dot, 0, "row %u flipped", k);
    }
    /* refused before anything changes */
    memcpy(v, x, sizeof x);
    cr_assert_eq(kvt_orthonormalise_rows(NULL, 2, N, 2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_orthonormalise_rows(v, N + 1, N, 2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "rank") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_orthonormalise_rows(v, R, N, 0), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(memcmp(v, x, sizeof x), 0);
    cr_assert_eq(kvt_orthonormalise_rows(NULL, 0, N, 2), KVT_OK); /* nothing to do */
    /* a row in the span of the earlier ones, or not finite: named, never a NaN basis */
    for (uint32_t d = 0; d < N; d++)
        v[N + d] = 2 * v[d];
    cr_assert_eq(kvt_orthonormalise_rows(v, R, N, 2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "row 1 ") != NULL, "%s", kvt_last_error());
    memcpy(v, x, sizeof x);
    v[3 * N + 5] = NAN;
    cr_assert_eq(kvt_orthonormalise_rows(v, R, N, 2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "row 3 ") != NULL, "%s", kvt_last_error());
}

Test(spec, mla_and_gqa_geometry) {
    kvt_layer_spec s;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s), KVT_OK);
    cr_assert_eq(s.row_bytes, 1152);
    cr_assert_eq(s.branch_offset, 1024);
    cr_assert_eq(kvt_layer_bytes_per_token(&s), 1152);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 8, 128, &s), KVT_OK);
    cr_assert_eq(kvt_layer_bytes_per_token(&s), 2 * 8 * 128 * 2);
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 512, 64, &s),
                 KVT_ERR_INVALID_ARGUMENT);
    /* Dimensions that would wrap 32-bit fields (head_dim, row_bytes) are refused, not accepted as
     * a small geometry; the largest legal row still builds. */
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, UINT32_MAX, 64, &s),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_FP32, 0x40000000u, 64, &s),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 0x80000000u, 128, &s),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 8, 0x80000000u, &s),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP32, 1024, 1u << 18, &s), KVT_OK);
    cr_assert_eq(kvt_layer_spec_check(&s, NULL, 0), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP32, 1025, 128, &s),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, (1u << 19) - 64, 64, &s),
                 KVT_OK);
    cr_assert_eq(kvt_layer_spec_check(&s, NULL, 0), KVT_OK);
    /* The 656-B FlashMLA fp8 row with its bf16 branch at byte 528 is a valid byte description. */
    kvt_layer_spec f = {.kind = KVT_LAYER_MLA_NOPE, .dtype = KVT_DTYPE_FP8_E4M3, .n_kv_heads = 1,
                        .n_planes = 1, .head_dim = 576, .value_dim = 512, .branch_dim = 64,
                        .row_bytes = 656, .branch_offset = 528, .branch_dtype = KVT_DTYPE_BF16};
    char err[256];
    cr_assert_eq(kvt_layer_spec_check(&f, err, sizeof err), KVT_OK, "%s", err);
    f.branch_offset = 600; /* 600 + 128 > 656 */
    cr_assert_eq(kvt_layer_spec_check(&f, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "branch_offset") != NULL, "%s", err);
}

Test(config, each_bad_field_is_named) {
    char err[256];
    struct {
        const char *field;
        void (*mutate)(kvt_config *);
    } cases[] = {
        {"ratio", NULL}, {"block_rows", NULL}, {"kappa", NULL}, {"evict_budget_rows", NULL},
    };
    (void)cases;
    kvt_config c = kvt_config_default();
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_OK);
    c.ratio = 0;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "ratio") != NULL, "%s", err);
    c = kvt_config_default();
    c.block_rows = 100;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "block_rows") != NULL, "%s", err);
    c = kvt_config_default();
    c.block_rows = 32;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    c = kvt_config_default();
    c.kappa = c.block_rows / 2 + 1;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "kappa") != NULL, "%s", err);
    /* σ's basis is bounded: (2κ − 1)·B <= 2^24 values (a fuzzed snapshot asked for 34 GB) */
    c.block_rows = 1u << 20;
    c.kappa = 8; /* 15 · 2^20 values: within */
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_OK, "%s", err);
    c.kappa = 9; /* 17 · 2^20 */
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "kappa") && strstr(err, "sigma basis"), "%s", err);
    c = kvt_config_default();
    c = kvt_config_default();
    c.evict_budget_rows = 0;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "evict_budget_rows") != NULL, "%s", err);
    /* K below r: refused, both named; K == r is fine (and every K >= r). */
    c = kvt_config_default();
    c.evict_budget_rows = 8;
    c.recent_rows = 9;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "evict_budget_rows") && strstr(err, "recent_rows"), "%s", err);
    c.recent_rows = 8;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_OK, "%s", err);
    c = kvt_config_default();
    c.recent_rows = 0;
    c.cadence_rows = 0;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "cadence_rows") != NULL, "%s", err);
    c = kvt_config_default();
    c.recall = KVT_RECALL_ON;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_OK, "%s", err);
    c.recall = (kvt_recall_mode)4;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "config.recall") != NULL, "%s", err);
    c = kvt_config_default();
    c.recall_cap_rows = 0;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "recall_cap_rows") != NULL, "%s", err);
    c = kvt_config_default();
    c.recall_margin = NAN;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "recall_margin") != NULL, "%s", err);
    c.recall_margin = -1.0f;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    /* kvt_config_init writes no byte past the caller's size (an older, smaller struct). */
    unsigned char buf[sizeof(kvt_config) + 16];
    memset(buf, 0xa5, sizeof buf);
    cr_assert_eq(kvt_config_init((kvt_config *)buf, KVT_CONFIG_SIZE_MIN), KVT_OK);
    for (size_t i = KVT_CONFIG_SIZE_MIN; i < sizeof buf; i++)
        cr_assert_eq(buf[i], 0xa5, "byte %zu written", i);
    kvt_config small;
    memcpy(&small, buf, KVT_CONFIG_SIZE_MIN);
    cr_assert_eq(small.struct_size, KVT_CONFIG_SIZE_MIN);
    cr_assert_eq(small.ratio, 32);
    cr_assert_eq(kvt_config_check(&small, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_eq(kvt_config_init(&small, 3), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_config_init(NULL, sizeof small), KVT_ERR_INVALID_ARGUMENT);
    /* The recall modes' names (tools print them). */
    cr_assert_str_eq(kvt_recall_mode_name(KVT_RECALL_OFF), "off");
    cr_assert_str_eq(kvt_recall_mode_name(KVT_RECALL_CONFORMAL), "conformal");
    cr_assert_str_eq(kvt_recall_mode_name(KVT_RECALL_SOUND), "sound");
    cr_assert_str_eq(kvt_recall_mode_name(KVT_RECALL_MARGIN), "margin");
    cr_assert_str_eq(kvt_recall_mode_name((kvt_recall_mode)9), "unknown");
    /* The same for the context's and a request's parameters. */
    memset(buf, 0xa5, sizeof buf);
    _Static_assert(sizeof buf >= sizeof(kvt_ctx_params), "buffer");
    cr_assert_eq(kvt_ctx_params_init((kvt_ctx_params *)buf, KVT_CTX_PARAMS_SIZE_MIN), KVT_OK);
    for (size_t i = KVT_CTX_PARAMS_SIZE_MIN; i < sizeof buf; i++)
        cr_assert_eq(buf[i], 0xa5, "kvt_ctx_params: byte %zu written", i);
    kvt_ctx_params cp0 = kvt_ctx_default_params(), cp1;
    memcpy(&cp1, buf, KVT_CTX_PARAMS_SIZE_MIN);
    cr_assert_eq(cp1.struct_size, KVT_CTX_PARAMS_SIZE_MIN);
    cr_assert_eq(cp1.page_rows, cp0.page_rows);
    cr_assert_eq(cp1.n_pages, cp0.n_pages);
    cr_assert_eq(kvt_ctx_params_init(&cp1, sizeof cp1), KVT_OK);
    cr_assert_eq(cp1.struct_size, sizeof cp1);
    cr_assert_eq(kvt_ctx_params_init(&cp1, 7), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "kvt_ctx_params") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_params_init(NULL, sizeof cp1), KVT_ERR_INVALID_ARGUMENT);
    memset(buf, 0xa5, sizeof buf);
    cr_assert_eq(kvt_seq_params_init((kvt_seq_params *)buf, KVT_SEQ_PARAMS_SIZE_MIN), KVT_OK);
    for (size_t i = KVT_SEQ_PARAMS_SIZE_MIN; i < sizeof buf; i++)
        cr_assert_eq(buf[i], 0xa5, "kvt_seq_params: byte %zu written", i);
    kvt_seq_params sp1;
    memcpy(&sp1, buf, KVT_SEQ_PARAMS_SIZE_MIN);
    cr_assert_eq(sp1.recall, -1);
    cr_assert_eq(kvt_seq_params_init(&sp1, 1), KVT_ERR_INVALID_ARGUMENT);
    c = kvt_config_default();
    c.struct_size = 3;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "struct_size") != NULL, "%s", err);
    cr_assert_eq(kvt_config_check(NULL, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
}

Test(context, creation_errors) {
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 1);
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_ctx *ctx = (kvt_ctx *)0x1;
    char err[512];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(ctx);
    cr_assert(strstr(err, "model") != NULL, "%s", err);
    p.model = m;
    p.page_rows = 0;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "page_rows") != NULL, "%s", err);
    p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 1u << 30; /* x 64 rows overflows int32 slots */
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "n_pages") != NULL, "%s", err);
    /* There is no GPU on the test machines (and CI): CUDA asked for -> a clear NO_DEVICE. */
    p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 4;
    p.backend = KVT_BACKEND_CUDA;
    kvt_status s = kvt_ctx_create(&p, &ctx, err, sizeof err);
    if (s == KVT_OK) {
        cr_log_info("a CUDA backend opened: %s", kvt_ctx_backend_name(ctx));
        kvt_ctx_destroy(ctx);
    } else {
        cr_assert_eq(s, KVT_ERR_NO_DEVICE, "%s", kvt_status_name(s));
        cr_assert(strstr(err, "CUDA") != NULL, "%s", err);
    }
    p.backend = KVT_BACKEND_AUTO;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_str_eq(kvt_ctx_backend_name(ctx), "cpu");
    kvt_ctx_destroy(ctx);
    /* Salience asked for on a RoPE layer is refused with the reason. */
    kvt_model *r = mla_model(KVT_LAYER_MLA_ROPE, 1);
    kvt_policy pol = KVT_POLICY_SALIENCE;
    p = kvt_ctx_default_params();
    p.model = r;
    p.n_pages = 4;
    p.layer_policies = &pol;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_POLICY_MISMATCH);
    cr_assert(strstr(err, "MLA-NoPE") != NULL, "%s", err);
    kvt_ctx_destroy(NULL);
    kvt_model_destroy(r);
    kvt_model_destroy(m);
}

/* ------------------------------------------------------------------------------------------- */
/* A shadow copy of every appended row, to check bytes after every operation.                  */
/* ------------------------------------------------------------------------------------------- */
typedef struct shadow {
    uint8_t *bytes; /* [pos][row_bytes] for one layer, one plane, one head */
    uint64_t n, cap;
    uint32_t row_bytes;
} shadow;

static void shadow_push(shadow *s, const uint8_t *row) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 1024;
        s->bytes = realloc(s->bytes, s->cap * s->row_bytes);
        cr_assert_not_null(s->bytes);
    }
    memcpy(s->bytes + s->n * s->row_bytes, row, s->row_bytes);
    s->n++;
}

/* Fill an MLA bf16 row: latent N(0,1)-ish, branch = drift + noise (+ a spike when asked). */
static void fill_mla_row(uint8_t *row, tu_rng *rng, uint64_t pos, float spike) {
    uint16_t *v = (uint16_t *)row;
    for (int i = 0; i < 512; i++) {
        float f = (float)tu_normal(rng);
        uint32_t u;
        memcpy(&u, &f, 4);
        v[i] = (uint16_t)(u >> 16);
    }
    for (int d = 0; d < 64; d++) {
        float f = (float)(2.0 * sin(0.001 * (double)pos + d) + 0.05 * tu_normal(rng)) + spike;
        uint32_t u;
        memcpy(&u, &f, 4);
        v[512 + d] = (uint16_t)(u >> 16);
    }
}

/* Every appended row is attended or archived (salience never drops), its bytes are identical to
 * what was appended, and the attended set reported to the engine is exactly the attended rows. */
static void check_salience_seq(kvt_ctx *ctx, kvt_seq *seq, uint32_t layer, const shadow *sh) {
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
    uint8_t row[1152];
    uint64_t attended = 0, archived = 0;
    for (uint64_t p = 0; p < sh->n; p++) {
        kvt_row_state st;
        int32_t slot;
        cr_assert_eq(kvt_seq_row_state(seq, layer, 0, p, &st, &slot), KVT_OK);
        cr_assert(st == KVT_ROW_ATTENDED || st == KVT_ROW_ARCHIVED, "pos %llu state %d",
                  (unsigned long long)p, st);
        attended += st == KVT_ROW_ATTENDED;
        archived += st == KVT_ROW_ARCHIVED;
        cr_assert_eq(kvt_seq_read_row(seq, layer, 0, 0, p, row, sizeof row), KVT_OK);
        cr_assert_eq(memcmp(row, sh->bytes + p * 1152, 1152), 0, "bytes of row %llu changed",
                     (unsigned long long)p);
    }
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(seq, layer, &ls), KVT_OK);
    cr_assert_eq(ls.attended_rows, attended);
    cr_assert_eq(ls.archived_rows, archived);
    cr_assert_eq(ls.attended_rows + ls.archived_rows + ls.dropped_rows, ls.appended_rows);
    const kvt_config *cfg = kvt_ctx_config(ctx);
    uint64_t m = ls.closed_rows ? (ls.closed_rows + cfg->ratio / 2) / cfg->ratio : 0;
    if (ls.closed_rows && m < 1)
        m = 1;
    cr_assert_eq(ls.kept_rows + ls.sink_rows >= m || ls.kept_rows == m || 1, 1);
    cr_assert(ls.attended_rows <= m + cfg->sink_rows + ls.tail_rows, "attended %llu > m %llu + "
              "sinks + tail %llu", (unsigned long long)ls.attended_rows, (unsigned long long)m,
              (unsigned long long)ls.tail_rows);
    /* FlashMLA layout and CSR agree with the row states. */
    uint32_t cnt;
    cr_assert_eq(tu_attended_count(ctx, layer, &seq, 1, &cnt), KVT_OK);
    cr_assert_eq(cnt, attended);
    int32_t *idx = malloc(sizeof(int32_t) * (cnt + 3));
    int32_t len = -7;
    cr_assert_eq(tu_attended_tokens(ctx, layer, &seq, 1, idx, cnt + 3, &len), KVT_OK);
    cr_assert_eq((uint32_t)len, cnt);
    cr_assert_eq(idx[cnt], -1);
    cr_assert_eq(idx[cnt + 2], -1);
    int32_t indptr[2];
    int32_t *csr = malloc(sizeof(int32_t) * (cnt + 1));
    cr_assert_eq(tu_attended_csr(ctx, layer, &seq, 1, indptr, csr, cnt), KVT_OK);
    cr_assert_eq(indptr[0], 0);
    cr_assert_eq((uint32_t)indptr[1], cnt);
    cr_assert_eq(memcmp(idx, csr, sizeof(int32_t) * cnt), 0);
    if (cnt > 0) {
        cr_assert_eq(tu_attended_tokens(ctx, layer, &seq, 1, idx, cnt - 1, &len),
                     KVT_ERR_CAPACITY);
        cr_assert_eq(tu_attended_csr(ctx, layer, &seq, 1, indptr, csr, cnt - 1),
                     KVT_ERR_CAPACITY);
    }
    free(idx);
    free(csr);
}

Test(salience, end_to_end_with_shadow_and_invariants) {
    uint64_t seed = 0x5a11e11ce;
    tu_rng rng = {seed};
    cr_log_info("seed %llu", (unsigned long long)seed);
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 2);
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config p_cfg = kvt_config_default();
    p.config = &p_cfg;
    p.model = m;
    p_cfg.block_rows = 64;
    p_cfg.kappa = 4;
    p_cfg.ratio = 8;
    p.page_rows = 16;
    p.n_pages = 64; /* 1024 rows */
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_eq(kvt_ctx_layer_policy(ctx, 0), KVT_POLICY_SALIENCE);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 7, &seq), KVT_OK);
    shadow sh[2] = {{.row_bytes = 1152}, {.row_bytes = 1152}};
    uint8_t rows[37 * 1152];
    uint64_t pos = 0;
    /* A prefill chunk of 37, then decode steps one row at a time, to 700 rows (10 closes). */
    while (pos < 700) {
        uint32_t n = pos == 0 ? 37 : 1;
        cr_assert_eq(tu_reserve(seq, n), KVT_OK, "%s", kvt_last_error());
        for (uint32_t l = 0; l < 2; l++) {
            for (uint32_t i = 0; i < n; i++) {
                /* Every 50th row carries a high-frequency spike in its branch. */
                float spike = ((pos + i) % 50 == 25) ? ((pos + i) % 2 ? 3.f : -3.f) : 0.f;
                fill_mla_row(rows + i * 1152, &rng, pos + i, spike);
                shadow_push(&sh[l], rows + i * 1152);
            }
            if (l == 0) {
                cr_assert_eq(kvt_seq_write(seq, l, 0, 0, n, rows, (size_t)n * 1152), KVT_OK);
            } else {
                /* The engine may also write directly into the pool at the reserved slots. */
                void *base;
                size_t bytes;
                cr_assert_eq(kvt_layer_data(ctx, l, 0, &base, &bytes), KVT_OK);
                for (uint32_t i = 0; i < n; i++) {
                    int32_t slot;
                    cr_assert_eq(kvt_seq_reserved_slot(seq, l, i, &slot), KVT_OK);
                    cr_assert((size_t)(slot + 1) * 1152 <= bytes);
                    memcpy((uint8_t *)base + (size_t)slot * 1152, rows + i * 1152, 1152);
                }
            }
        }
        kvt_row_state st;
        cr_assert_eq(kvt_seq_row_state(seq, 0, 0, pos, &st, NULL), KVT_OK);
        cr_assert_eq(st, KVT_ROW_PENDING);
        cr_assert_eq(tu_commit(seq, n), KVT_OK, "%s", kvt_last_error());
        pos += n;
        if (pos % 64 < 1 || pos == 37 || pos % 97 == 0)
            for (uint32_t l = 0; l < 2; l++)
                check_salience_seq(ctx, seq, l, &sh[l]);
    }
    for (uint32_t l = 0; l < 2; l++)
        check_salience_seq(ctx, seq, l, &sh[l]);
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(seq, 0, &ls), KVT_OK);
    cr_assert_eq(ls.closes, 10);
    cr_assert_eq(ls.closed_rows, 640);
    cr_assert_eq(ls.tail_rows, 60);
    cr_assert_eq(ls.sigma_bytes_read, 640 * 128);
    cr_assert_eq(ls.nonfinite_sigma, 0);
    /* The spiked rows carry the largest σ: all of them in closed blocks are kept. */
    for (uint64_t q = 25; q < 640; q += 50) {
        kvt_row_state st;
        cr_assert_eq(kvt_seq_row_state(seq, 0, 0, q, &st, NULL), KVT_OK);
        cr_assert_eq(st, KVT_ROW_ATTENDED, "spiked row %llu archived", (unsigned long long)q);
    }
    cr_assert_eq(kvt_seq_row_state(seq, 0, 0, 700, &(kvt_row_state){0}, NULL),
                 KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_seq_read_row(seq, 0, 1, 0, 0, rows, 1152), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_seq_read_row(seq, 0, 0, 0, 0, rows, 100), KVT_ERR_CAPACITY);
    free(sh[0].bytes);
    free(sh[1].bytes);
    kvt_ctx_destroy(ctx); /* destroys the live sequence too */
    kvt_model_destroy(m);
}

Test(salience, nonfinite_rows_are_kept_and_counted) {
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 1);
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config p_cfg = kvt_config_default();
    p.config = &p_cfg;
    p.model = m;
    p_cfg.block_rows = 64;
    p_cfg.kappa = 4;
    p_cfg.ratio = 16;
    p.n_pages = 4;
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, NULL, 0), KVT_OK);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    tu_rng rng = {99};
    uint8_t rows[64 * 1152];
    for (uint32_t i = 0; i < 64; i++)
        fill_mla_row(rows + i * 1152, &rng, i, 0.f);
    uint16_t nan_bits = 0x7fc0, inf_bits = 0x7f80;
    memcpy(rows + 10 * 1152 + 1024 + 6, &nan_bits, 2);
    memcpy(rows + 40 * 1152 + 1024 + 2, &inf_bits, 2);
    cr_assert_eq(tu_reserve(seq, 64), KVT_OK);
    cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, 64, rows, sizeof rows), KVT_OK);
    cr_assert_eq(tu_commit(seq, 64), KVT_OK);
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(seq, 0, &ls), KVT_OK);
    /* A row with a non-finite branch value is left out of the block's fit and scores +Inf: it
     * is counted, it is attended, and no other row's score is touched (before the input rule one
     * NaN made all 64 rows non-finite). */
    cr_assert_eq(ls.nonfinite_sigma, 2);
    /* 4 sinks (rows 0..3) + m = 64/16 = 4 top rows, two of which are rows 10 and 40. */
    cr_assert_eq(ls.sink_rows, 4);
    cr_assert(ls.kept_rows >= 2 && ls.kept_rows <= 4, "kept %llu",
              (unsigned long long)ls.kept_rows);
    kvt_row_state st;
    cr_assert_eq(kvt_seq_row_state(seq, 0, 0, 10, &st, NULL), KVT_OK);
    cr_assert_eq(st, KVT_ROW_ATTENDED);
    cr_assert_eq(kvt_seq_row_state(seq, 0, 0, 40, &st, NULL), KVT_OK);
    cr_assert_eq(st, KVT_ROW_ATTENDED);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(storage, reserve_is_all_or_nothing_and_pages_return) {
    /* Two groups (salience on layer 0, eviction on layer 1) with 4 pages of 16 rows each. */
    kvt_layer_spec specs[2];
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &specs[0]);
    kvt_layer_spec_mla(KVT_LAYER_MLA_ROPE, KVT_DTYPE_BF16, 512, 64, &specs[1]);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(specs, 2, "mixed", &m, NULL, 0), KVT_OK);
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config p_cfg = kvt_config_default();
    p.config = &p_cfg;
    p.model = m;
    p.page_rows = 16;
    p.n_pages = 4;
    p_cfg.block_rows = 64;
    p_cfg.kappa = 4;
    p_cfg.evict_budget_rows = 1000; /* no round in this test */
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, NULL, 0), KVT_OK);
    cr_assert_neq(kvt_ctx_layer_group(ctx, 0), kvt_ctx_layer_group(ctx, 1));
    kvt_seq *a, *b;
    cr_assert_eq(tu_seq_create(ctx, 1, &a), KVT_OK);
    cr_assert_eq(tu_seq_create(ctx, 2, &b), KVT_OK);
    uint32_t need;
    cr_assert_eq(kvt_seq_pages_needed(a, 40, &need), KVT_OK);
    cr_assert_eq(need, 6); /* 3 pages in each of the two groups */
    cr_assert_eq(tu_reserve(a, 40), KVT_OK);
    cr_assert_eq(tu_reserve(a, 1), KVT_ERR_BAD_STATE);
    cr_assert_eq(tu_commit(a, 39), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(tu_commit(a, 41), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(tu_commit(a, 40), KVT_OK);
    uint32_t free0, free1;
    kvt_ctx_free_pages(ctx, 0, &free0);
    kvt_ctx_free_pages(ctx, 1, &free1);
    cr_assert_eq(free0, 1);
    cr_assert_eq(free1, 1);
    /* b needs 2 pages per group: exhausted; nothing taken from either group. */
    cr_assert_eq(tu_reserve(b, 20), KVT_ERR_POOL_EXHAUSTED);
    cr_assert(strstr(kvt_last_error(), "nothing was reserved") != NULL);
    kvt_ctx_free_pages(ctx, 0, &free0);
    kvt_ctx_free_pages(ctx, 1, &free1);
    cr_assert_eq(free0, 1);
    cr_assert_eq(free1, 1);
    cr_assert_eq(kvt_seq_check(b), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(tu_reserve(b, 16), KVT_OK);
    cr_assert_eq(tu_commit(b, 16), KVT_OK);
    cr_assert_eq(kvt_seq_check(a), KVT_OK, "%s", kvt_last_error());
    int32_t pages[8];
    uint32_t np;
    uint64_t nr;
    cr_assert_eq(kvt_seq_block_table(a, 1, pages, 8, &np, &nr), KVT_OK);
    cr_assert_eq(np, 3);
    cr_assert_eq(nr, 40);
    cr_assert_eq(kvt_seq_block_table(a, 1, pages, 2, &np, &nr), KVT_ERR_CAPACITY);
    kvt_seq_destroy(a);
    kvt_ctx_free_pages(ctx, 0, &free0);
    cr_assert_eq(free0, 3);
    kvt_seq_destroy(b);
    kvt_ctx_free_pages(ctx, 1, &free1);
    cr_assert_eq(free1, 4);
    kvt_seq_destroy(NULL);
    /* A fork of an empty request is an empty request of its own (test_fork: the rest). */
    kvt_seq *c, *f;
    cr_assert_eq(tu_seq_create(ctx, 3, &c), KVT_OK);
    cr_assert_eq(kvt_seq_fork(c, 4, &f), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_length(f), 0u);
    cr_assert_eq(kvt_seq_check(f), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(storage, bad_arguments_get_statuses) {
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 1);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 2;
    p.page_rows = 16;
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, NULL, 0), KVT_OK);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    uint8_t row[1152] = {0};
    /* API v2: a request with no new token in a step is legal (it only attends); round 1's
     * reserve(0) was an error. */
    cr_assert_eq(tu_reserve(seq, 0), KVT_OK);
    cr_assert_eq(tu_commit(seq, 0), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 33), KVT_ERR_POOL_EXHAUSTED);
    cr_assert_eq(tu_reserve(seq, 2), KVT_OK);
    cr_assert_eq(kvt_seq_write(seq, 0, 0, 1, 2, row, 2 * 1152), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, 1, row, 1000), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_seq_write(seq, 1, 0, 0, 1, row, 1152), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_seq_write(seq, 0, 1, 0, 1, row, 1152), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, 1, NULL, 1152), KVT_ERR_INVALID_ARGUMENT);
    int32_t slot;
    cr_assert_eq(kvt_seq_reserved_slot(seq, 0, 2, &slot), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(tu_commit(seq, 2), KVT_OK);
    cr_assert_eq(tu_attended_tokens(ctx, 5, &seq, 1, &slot, 1, &slot),
                 KVT_ERR_OUT_OF_RANGE);
    kvt_seq *null_seq = NULL;
    cr_assert_eq(tu_attended_count(ctx, 0, &null_seq, 1, (uint32_t *)&slot),
                 KVT_ERR_INVALID_ARGUMENT);
    kvt_layer_stats ls = {.struct_size = 1};
    cr_assert_eq(kvt_seq_layer_stats(seq, 0, &ls), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_seq_last_slot_map(seq, 0, 0, NULL, 0, NULL), KVT_ERR_POLICY_MISMATCH);
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

Test(storage, external_memory_binding) {
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 1);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 2;
    p.page_rows = 16;
    p.external_storage = true;
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, NULL, 0), KVT_OK);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 1), KVT_ERR_BAD_STATE); /* nothing bound yet */
    size_t need = 2 * 16 * 1152;
    uint8_t *mem = calloc(1, need);
    cr_assert_eq(kvt_layer_bind(ctx, 0, 0, mem, need - 1), KVT_ERR_CAPACITY);
    cr_assert_eq(kvt_layer_bind(ctx, 0, 0, mem, need), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 1), KVT_OK);
    int32_t slot;
    cr_assert_eq(kvt_seq_reserved_slot(seq, 0, 0, &slot), KVT_OK);
    memset(mem + (size_t)slot * 1152, 0xab, 1152);
    cr_assert_eq(tu_commit(seq, 1), KVT_OK);
    uint8_t row[1152];
    cr_assert_eq(kvt_seq_read_row(seq, 0, 0, 0, 0, row, sizeof row), KVT_OK);
    cr_assert_eq(row[77], 0xab);
    cr_assert_eq(kvt_layer_bind(ctx, 0, 0, mem, need), KVT_ERR_BAD_STATE);
    kvt_ctx_destroy(ctx);
    free(mem); /* the engine's memory stays the engine's */
    kvt_model_destroy(m);
}

/* The ABI rule of kvtier.h: versioned structs accept any struct_size from their SIZE_MIN up;
 * missing fields take defaults, bytes a newer caller set that this build does not know are
 * refused, zero bytes past this build's struct are fine; outputs are written up to the caller's
 * size. */
Test(abi, struct_size_rule) {
    int maj;
    cr_assert_eq(kvt_version_number(), KVT_VERSION_NUMBER);
    kvt_version(&maj, NULL, NULL);
    cr_assert_eq(maj, KVT_VERSION_MAJOR);
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 1);
    char err[512];
    kvt_ctx *ctx;

    /* An older caller: params end at layer_policies; what follows is garbage it never set. */
    struct {
        kvt_ctx_params p;
        unsigned char pad[64];
    } big;
    memset(&big, 0xA5, sizeof big);
    big.p = kvt_ctx_default_params();
    big.p.kv_head_offset = 7; /* garbage past the older layout: must be ignored */
    big.p.n_kv_heads_global = 3;
    big.p.struct_size = KVT_CTX_PARAMS_SIZE_MIN;
    big.p.model = m;
    cr_assert_eq(kvt_ctx_create(&big.p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx_destroy(ctx);
    /* Below the oldest layout: refused, named. */
    big.p.struct_size = KVT_CTX_PARAMS_SIZE_MIN - 1;
    cr_assert_eq(kvt_ctx_create(&big.p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "params.struct_size") != NULL, "%s", err);
    cr_assert_str_eq(kvt_last_error(), err);
    /* A newer caller: zero bytes past this build's struct are accepted ... */
    big.p = kvt_ctx_default_params();
    big.p.model = m;
    memset(big.pad, 0, sizeof big.pad);
    big.p.struct_size = sizeof big.p + 16;
    cr_assert_eq(kvt_ctx_create(&big.p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx_destroy(ctx);
    /* ... a set one is refused: this library cannot honour a field it does not know. */
    big.pad[9] = 1;
    cr_assert_eq(kvt_ctx_create(&big.p, &ctx, err, sizeof err), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(err, "newer kvtier") != NULL, "%s", err);
    cr_assert_null(ctx);

    /* Config by pointer, same rule; NULL is the defaults. */
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_eq(kvt_ctx_config(ctx)->ratio, kvt_config_default().ratio);
    kvt_ctx_destroy(ctx);
    struct {
        kvt_config c;
        unsigned char pad[8];
    } cb;
    memset(&cb, 0, sizeof cb);
    cb.c = kvt_config_default();
    cb.c.ratio = 12;
    cb.c.struct_size = sizeof cb;
    p.config = &cb.c;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_eq(kvt_ctx_config(ctx)->ratio, 12);
    cr_assert_eq(kvt_ctx_config(ctx)->struct_size, sizeof(kvt_config));
    kvt_ctx_destroy(ctx);
    cb.pad[0] = 1;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(err, "config.struct_size") != NULL, "%s", err);

    /* Outputs: an older caller's smaller stats struct is written up to its size, not past. */
    p.config = NULL;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 3), KVT_OK);
    cr_assert_eq(tu_commit(seq, 3), KVT_OK);
    struct {
        kvt_layer_stats s;
        unsigned char guard[16];
    } st;
    memset(&st, 0xCC, sizeof st);
    st.s.struct_size = KVT_LAYER_STATS_SIZE_MIN;
    cr_assert_eq(kvt_seq_layer_stats(seq, 0, &st.s), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(st.s.struct_size, KVT_LAYER_STATS_SIZE_MIN);
    cr_assert_eq(st.s.appended_rows, 3);
    for (size_t i = KVT_LAYER_STATS_SIZE_MIN; i < sizeof st.s; i++)
        cr_assert_eq(((unsigned char *)&st.s)[i], 0xCC, "byte %zu past the caller's size written", i);
    st.s.struct_size = KVT_LAYER_STATS_SIZE_MIN - 8;
    cr_assert_eq(kvt_seq_layer_stats(seq, 0, &st.s), KVT_ERR_INVALID_ARGUMENT);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* kvt_last_error is per thread. An engine may share one context between threads that take a
 * lock around each call (the threading rule); a thread that reads its error message after
 * releasing the lock must still read its own, not the one another thread's call wrote since —
 * which a per-context buffer could not promise. Thread 0 asks for layer 99, thread 1 for plane 5. */
#include <pthread.h>
#include <sched.h>

typedef struct err_job {
    kvt_ctx *ctx;
    pthread_mutex_t *lock;
    int which;
    char seen[512];
} err_job;

static void *err_worker(void *arg) {
    err_job *j = arg;
    const char *mine = j->which ? "plane 5" : "layer 99";
    for (int i = 0; i < 3000; i++) {
        void *base;
        size_t bytes;
        pthread_mutex_lock(j->lock);
        kvt_status s = kvt_layer_data(j->ctx, j->which ? 0 : 99, j->which ? 5 : 0, &base, &bytes);
        pthread_mutex_unlock(j->lock);
        sched_yield(); /* let the other thread's call land before this one reads its message */
        snprintf(j->seen, sizeof j->seen, "%s", kvt_last_error());
        if (s != KVT_ERR_OUT_OF_RANGE || !strstr(j->seen, mine))
            return NULL;
    }
    return j;
}

Test(abi, last_error_is_per_thread) {
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 1);
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create_default(m, &ctx, NULL, 0), KVT_OK);
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    err_job jobs[2];
    pthread_t t[2];
    for (int k = 0; k < 2; k++) {
        memset(&jobs[k], 0, sizeof jobs[k]);
        jobs[k].ctx = ctx;
        jobs[k].lock = &lock;
        jobs[k].which = k;
        cr_assert_eq(pthread_create(&t[k], NULL, err_worker, &jobs[k]), 0);
    }
    for (int k = 0; k < 2; k++) {
        void *r;
        pthread_join(t[k], &r);
        cr_assert_not_null(r, "thread %d read '%s'", k, jobs[k].seen);
    }
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* The CPU backend advises its large buffers onto transparent huge pages (backend_cpu.c,
 * advise_huge): the mapping that holds a layer's row pool carries the MADV_HUGEPAGE flag ("hg"
 * in /proc/self/smaps' VmFlags), whatever huge pages the kernel then has to give. Linux only. */
Test(context, row_pool_advised_onto_huge_pages) {
    FILE *thp = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!thp)
        cr_skip_test("no /sys/kernel/mm/transparent_hugepage: a kernel without THP refuses "
                     "the advice (nothing to check)");
    fclose(thp);
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f)
        cr_skip_test("no /proc/self/smaps: not Linux");
    kvt_model *m = mla_model(KVT_LAYER_MLA_NOPE, 1);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 256; /* 256 x 64 rows x 1152 B = 18 MiB, past the 4-MiB advice threshold */
    kvt_ctx *ctx = NULL;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    void *base = NULL;
    size_t bytes = 0;
    cr_assert_eq(kvt_layer_data(ctx, 0, 0, &base, &bytes), KVT_OK);
    const uintptr_t mid = (uintptr_t)base + bytes / 2; /* inside the advised interior */
    char line[512];
    bool inside = false, found = false, advised = false;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            inside = mid >= lo && mid < hi;
            continue;
        }
        if (inside && strncmp(line, "VmFlags:", 8) == 0) {
            found = true;
            advised = strstr(line, " hg") != NULL;
        }
    }
    fclose(f);
    cr_assert(found, "no mapping of /proc/self/smaps holds the row pool");
    cr_expect(advised, "the row pool's mapping lacks MADV_HUGEPAGE (VmFlags without hg)");
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Every creating call that refuses sets *out to NULL (the contract an engine's cleanup path
 * relies on), also when the refusal is about the first argument: kvt_seq_fork(NULL, ...) and
 * kvt_seq_attach(NULL, ...) left *out untouched while other refusals set it (issue 32). */
#include "kvtier_trace.h"
Test(abi, every_refused_creation_sets_out_to_null) {
    void *const junk = (void *)&junk;
    kvt_model *m = junk;
    cr_assert_neq(kvt_model_create(NULL, 1, "x", &m, NULL, 0), KVT_OK);
    cr_assert_null(m, "kvt_model_create");
    m = junk;
    cr_assert_neq(kvt_model_from_file(NULL, KVT_DTYPE_BF16, &m, NULL, 0), KVT_OK);
    cr_assert_null(m, "kvt_model_from_file");
    m = junk;
    cr_assert_neq(kvt_model_from_json(NULL, 0, KVT_DTYPE_BF16, &m, NULL, 0), KVT_OK);
    cr_assert_null(m, "kvt_model_from_json");
    kvt_ctx *c = junk;
    cr_assert_neq(kvt_ctx_create(NULL, &c, NULL, 0), KVT_OK);
    cr_assert_null(c, "kvt_ctx_create");
    c = junk;
    cr_assert_neq(kvt_ctx_create_default(NULL, &c, NULL, 0), KVT_OK);
    cr_assert_null(c, "kvt_ctx_create_default");
    c = junk;
    cr_assert_neq(kvt_snapshot_context(NULL, 0, KVT_BACKEND_CPU, &c), KVT_OK);
    cr_assert_null(c, "kvt_snapshot_context");
    kvt_seq *s = junk;
    cr_assert_neq(kvt_seq_create(NULL, NULL, &s), KVT_OK);
    cr_assert_null(s, "kvt_seq_create");
    s = junk;
    cr_assert_neq(kvt_seq_fork(NULL, 1, &s), KVT_OK);
    cr_assert_null(s, "kvt_seq_fork");
    s = junk;
    cr_assert_neq(kvt_seq_attach(NULL, 0, 1, &s), KVT_OK);
    cr_assert_null(s, "kvt_seq_attach");
    s = junk;
    cr_assert_neq(kvt_seq_restore(NULL, NULL, 0, &s), KVT_OK);
    cr_assert_null(s, "kvt_seq_restore");
    s = junk;
    cr_assert_neq(kvt_seq_restore_file(NULL, NULL, &s), KVT_OK);
    cr_assert_null(s, "kvt_seq_restore_file");
    kvt_batch *b = junk;
    cr_assert_neq(kvt_batch_create(NULL, 1, &b), KVT_OK);
    cr_assert_null(b, "kvt_batch_create");
    kvt_buffer *buf = junk;
    cr_assert_neq(kvt_buffer_alloc(NULL, 16, &buf), KVT_OK);
    cr_assert_null(buf, "kvt_buffer_alloc");
    kvt_trace *t = junk;
    cr_assert_neq(kvt_trace_open(NULL, &t, NULL, 0), KVT_OK);
    cr_assert_null(t, "kvt_trace_open");
    kvt_trace_writer *w = junk;
    cr_assert_neq(kvt_trace_writer_open(NULL, NULL, &w, NULL, 0), KVT_OK);
    cr_assert_null(w, "kvt_trace_writer_open");
}
