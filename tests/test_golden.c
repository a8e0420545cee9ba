/*
 * test_golden.c — golden keep sets: which positions are attended, archived and dropped, per
 * (layer, KV head), at fixed checkpoints of fixed cases (salience with each selector, random
 * eviction with drop, archive, VaSE and the shared draw, MLA-RoPE, sliding windows, a real model
 * config). The files under tests/golden/keepsets/ were recorded once the input rules were settled
 * (Core v2 step 0); every later change of the core — the layering, the engine API v2, the device
 * backends — must reproduce them byte for byte. A difference is a changed decision, not noise.
 *
 * Each file names what decides it: the selector and its basis, every config field, the page
 * geometry, the prompt, and the row generator (gen_row below, seeded per case). Rows are written
 * through the public API only and every checkpoint also runs kvt_seq_check.
 *
 * To re-record after a deliberate change of a decision (say why in the commit):
 *     KVT_GOLDEN_UPDATE=1 ./build/tests/test_golden
 * On a mismatch the actual file is written to the build directory and the first differing line
 * is printed.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "support/testutil.h"

#define MAX_LAYERS 8
#define MAX_CHECKPOINTS 16

typedef struct gcase {
    const char *name;
    const char *what;
    kvt_layer_spec specs[MAX_LAYERS];
    uint32_t n_layers;
    const char *config_file; /* or a real model config (specs unused) */
    kvt_config cfg;
    uint32_t page_rows, n_pages;
    uint64_t prompt_rows;
    uint64_t tokens;
    uint32_t max_chunk; /* commits of 1..max_chunk tokens, drawn from the seed */
    uint64_t seed;
    uint64_t checkpoints[MAX_CHECKPOINTS]; /* token counts at which the sets are dumped */
    uint32_t n_checkpoints;
    /* Rows whose first branch value (MLA) or first value (GQA) is replaced by a non-finite one. */
    uint64_t nan_pos, inf_pos;
} gcase;

/* ------------------------------------------------------------------------------------------- */
/* Row generator v1 (part of what the golden files name: changing it changes every file).     */
/* ------------------------------------------------------------------------------------------- */
static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static void put(uint8_t *p, kvt_dtype dt, uint32_t i, float v) {
    if (dt == KVT_DTYPE_FP32) {
        memcpy(p + 4 * i, &v, 4);
        return;
    }
    uint32_t u;
    memcpy(&u, &v, 4);
    uint16_t h;
    if (dt == KVT_DTYPE_BF16) {
        h = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    } else { /* fp16 for the small magnitudes used here (|v| < 60000, no subnormal care needed) */
        uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
        if (a < 0x38800000u) {
            h = (uint16_t)sign; /* flush tiny values: deterministic, fine for keep sets */
        } else {
            uint32_t m = ((a >> 13) - (112u << 10));
            uint32_t rem = a & 0x1fffu;
            if (rem > 0x1000u || (rem == 0x1000u && (m & 1u)))
                m++;
            h = (uint16_t)(sign | m);
        }
    }
    memcpy(p + 2 * i, &h, 2);
}

/* Values of (layer, plane, head, position): a slow drift along positions (inside any low-pass
 * band), noise, and every 23rd-ish position (by hash) a spike row of 4x noise in every value. */
static void gen_row(const gcase *g, const kvt_layer_spec *sp, uint32_t layer, uint32_t plane,
                    uint32_t head, uint64_t pos, uint8_t *row) {
    tu_rng r = {mix(g->seed ^ mix(((uint64_t)layer << 48) ^ ((uint64_t)plane << 40) ^
                                  ((uint64_t)head << 32) ^ pos))};
    int spike = mix(g->seed * 31 + pos) % 23 == 0;
    uint32_t n = sp->row_bytes / kvt_dtype_bytes(sp->dtype);
    if (sp->dtype == KVT_DTYPE_FP8_E4M3)
        n = 0;
    for (uint32_t d = 0; d < n; d++) {
        double drift = cos(6.283185307179586 * (double)pos / 700.0 + 0.41 * d);
        double v = drift + (spike ? 4.0 : 0.3) * tu_normal(&r);
        put(row, sp->dtype, d, (float)v);
    }
    if (sp->branch_dim) { /* the branch is what salience reads: same model, in its own dtype */
        for (uint32_t d = 0; d < sp->branch_dim; d++) {
            double drift = sin(6.283185307179586 * (double)pos / 700.0 + 0.7 * d);
            double v = 2.0 * drift + (spike ? 3.0 : 0.2) * tu_normal(&r);
            put(row + sp->branch_offset, sp->branch_dtype, d, (float)v);
        }
    }
    if (pos == g->nan_pos || pos == g->inf_pos) {
        float bad = pos == g->nan_pos ? NAN : INFINITY;
        if (sp->branch_dim)
            put(row + sp->branch_offset, sp->branch_dtype, 0, bad);
        else
            put(row, sp->dtype, 0, bad);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Dump                                                                                         */
/* ------------------------------------------------------------------------------------------- */
typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        /* b->p is NULL before the first growth: NULL + 0 is undefined in C (clang UBSan). */
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->cap - b->n, fmt, ap);
        va_end(ap);
        cr_assert(k >= 0);
        if ((size_t)k < b->cap - b->n) {
            b->n += (size_t)k;
            return;
        }
        b->cap = b->cap * 2 + (size_t)k + 256;
        b->p = realloc(b->p, b->cap);
        cr_assert(b->p);
    }
}

static const char *selector_name(kvt_selector s) {
    switch (s) {
    case KVT_SELECT_SIGMA: return "sigma";
    case KVT_SELECT_BRANCH_NORM: return "branch_norm";
    case KVT_SELECT_ROW_NORM: return "row_norm";
    case KVT_SELECT_RANDOM: return "random";
    }
    return "?";
}

static void dump_header(sbuf *b, const gcase *g, const kvt_model *m) {
    const kvt_config *c = &g->cfg;
    sb_printf(b, "# kvtier golden keep sets v1: %s\n# %s\n", g->name, g->what);
    bool any_sal = false;
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++)
        any_sal |= kvt_policy_for_kind(kvt_model_layer(m, l)->kind) == KVT_POLICY_SALIENCE;
    if (any_sal)
        sb_printf(b, "selector %s; basis %s\n", selector_name(c->selector),
                  c->selector == KVT_SELECT_SIGMA
                      ? "real Fourier low-pass, 2*kappa-1 orthonormal columns over the block"
                      : "none");
    else
        sb_printf(b, "selector philox uniform keys per (round, layer, head) (random eviction)\n");
    sb_printf(b,
              "config ratio=%u block_rows=%u kappa=%u sink_rows=%u K=%u r=%u c=%u "
              "protect_prompt=%d archive=%d shared_draw=%d vase=%d seed=%llu\n",
              c->ratio, c->block_rows, c->kappa, c->sink_rows, c->evict_budget_rows,
              c->recent_rows, c->cadence_rows, (int)c->protect_prompt, (int)c->evict_archive,
              (int)c->evict_shared_draw, (int)c->evict_vase, (unsigned long long)c->seed);
    sb_printf(b, "pages page_rows=%u n_pages=%u; prompt_rows=%llu; tokens=%llu in commits of "
              "1..%u; rows generator v1 seed %llu; nan_pos=%lld inf_pos=%lld\n",
              g->page_rows, g->n_pages, (unsigned long long)g->prompt_rows,
              (unsigned long long)g->tokens, g->max_chunk, (unsigned long long)g->seed,
              g->nan_pos == UINT64_MAX ? -1LL : (long long)g->nan_pos,
              g->inf_pos == UINT64_MAX ? -1LL : (long long)g->inf_pos);
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++) {
        const kvt_layer_spec *s = kvt_model_layer(m, l);
        sb_printf(b, "layer %u kind=%s policy=%s heads=%u head_dim=%u row_bytes=%u window=%u\n", l,
                  kvt_layer_kind_name(s->kind), kvt_policy_name(kvt_policy_for_kind(s->kind)),
                  s->n_kv_heads, s->head_dim, s->row_bytes, s->sliding_window);
    }
}

static void dump_ranges(sbuf *b, const kvt_row_state *st, uint64_t n, kvt_row_state want) {
    uint64_t k = 0, count = 0;
    for (uint64_t p = 0; p < n; p++)
        count += st[p] == want;
    sb_printf(b, " %llu:", (unsigned long long)count);
    while (k < n) {
        if (st[k] != want) {
            k++;
            continue;
        }
        uint64_t e = k;
        while (e + 1 < n && st[e + 1] == want)
            e++;
        if (e == k)
            sb_printf(b, " %llu", (unsigned long long)k);
        else
            sb_printf(b, " %llu-%llu", (unsigned long long)k, (unsigned long long)e);
        k = e + 1;
    }
    sb_printf(b, "\n");
}

static void dump_checkpoint(sbuf *b, kvt_ctx *ctx, kvt_seq *seq, uint64_t n) {
    const kvt_model *m = kvt_ctx_model(ctx);
    sb_printf(b, "checkpoint tokens=%llu\n", (unsigned long long)n);
    kvt_row_state *st = malloc(sizeof *st * (n ? n : 1));
    cr_assert(st);
    for (uint32_t l = 0; l < kvt_model_n_layers(m); l++) {
        const kvt_layer_spec *s = kvt_model_layer(m, l);
        if (s->kind == KVT_LAYER_NO_KV)
            continue;
        kvt_layer_stats ls = {.struct_size = sizeof ls};
        cr_assert_eq(kvt_seq_layer_stats(seq, l, &ls), KVT_OK);
        sb_printf(b, "layer %u attended_rows=%llu archived_rows=%llu dropped_rows=%llu closes=%llu "
                  "rounds=%llu nonfinite=%llu pages=%llu\n", l,
                  (unsigned long long)ls.attended_rows, (unsigned long long)ls.archived_rows,
                  (unsigned long long)ls.dropped_rows, (unsigned long long)ls.closes,
                  (unsigned long long)ls.rounds, (unsigned long long)ls.nonfinite_sigma,
                  (unsigned long long)ls.pages_in_use);
        for (uint32_t h = 0; h < s->n_kv_heads; h++) {
            for (uint64_t p = 0; p < n; p++)
                cr_assert_eq(kvt_seq_row_state(seq, l, h, p, &st[p], NULL), KVT_OK);
            sb_printf(b, "L%u H%u attended", l, h);
            dump_ranges(b, st, n, KVT_ROW_ATTENDED);
            sb_printf(b, "L%u H%u archived", l, h);
            dump_ranges(b, st, n, KVT_ROW_ARCHIVED);
            sb_printf(b, "L%u H%u dropped", l, h);
            dump_ranges(b, st, n, KVT_ROW_DROPPED);
        }
    }
    free(st);
}

/* ------------------------------------------------------------------------------------------- */
/* Driver                                                                                       */
/* ------------------------------------------------------------------------------------------- */
/* Write the step's rows of layer l (tokens [n, n + want)) through the public API. */
static void write_layer(const gcase *g, kvt_seq *seq, const kvt_layer_spec *s, uint32_t l,
                        uint64_t n, uint32_t want, uint8_t *row) {
    size_t tok_bytes = (size_t)s->n_kv_heads * s->row_bytes;
    cr_assert(tok_bytes <= (1 << 16));
    for (uint32_t pl = 0; pl < s->n_planes; pl++)
        for (uint32_t i = 0; i < want; i++) {
            for (uint32_t h = 0; h < s->n_kv_heads; h++)
                gen_row(g, s, l, pl, h, n + i, row + (size_t)h * s->row_bytes);
            cr_assert_eq(kvt_seq_write(seq, l, pl, i, 1, row, tok_bytes), KVT_OK, "%s",
                         kvt_last_error());
        }
}

/* The emission of `layer` at the step just committed must be the committed state's attended set:
 * for each attended position (ascending) of head 0, its slot. (Every head of a layer attends the
 * same number of rows; the emission lists head 0's slots.) */
static void check_emission(kvt_seq *seq, uint32_t layer, uint64_t n, const int32_t *idx,
                           int32_t len, const char *name) {
    int32_t k = 0;
    for (uint64_t p = 0; p < n; p++) {
        kvt_row_state st;
        int32_t slot;
        cr_assert_eq(kvt_seq_row_state(seq, layer, 0, p, &st, &slot), KVT_OK);
        if (st != KVT_ROW_ATTENDED)
            continue;
        cr_assert(k < len && idx[k] == slot, "%s layer %u at %llu tokens: emission[%d] = %d, "
                  "attended position %llu is at slot %d", name, layer, (unsigned long long)n, k,
                  k < len ? idx[k] : -2, (unsigned long long)p, slot);
        k++;
    }
    cr_assert_eq(k, len, "%s layer %u: emitted %d rows, %d attended", name, layer, len, k);
}

/* Drive the case. run = false: each step reserves, writes every layer, commits (all policy work
 * at commit). run = true: the engine's order (kvtier.h's timeline): reserve, plan, then per layer
 * write its rows and kvt_batch_run it (its close or round happens there), commit. Both must give
 * the same file: decisions do not depend on where the work runs. With run, every checkpoint also
 * checks that each layer's emission equals the committed attended set. */
static char *run_case(const gcase *g, size_t *len, bool run, kvt_backend_kind backend) {
    kvt_model *m = NULL;
    char err[512];
    if (g->config_file)
        cr_assert_eq(kvt_model_from_file(tu_model_path(g->config_file), KVT_DTYPE_BF16, &m, err,
                                         sizeof err), KVT_OK, "%s", err);
    else
        cr_assert_eq(kvt_model_create(g->specs, g->n_layers, g->name, &m, err, sizeof err), KVT_OK,
                     "%s", err);
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config p_cfg = g->cfg;
    p.config = &p_cfg;
    p.model = m;
    p.page_rows = g->page_rows;
    p.n_pages = g->n_pages;
    p.allocator = KVT_ALLOC_LIBC;
    p.backend = backend;
    kvt_ctx *ctx;
    kvt_status cs = kvt_ctx_create(&p, &ctx, err, sizeof err);
    if (backend == KVT_BACKEND_CUDA && cs == KVT_ERR_NO_DEVICE && !getenv("KVT_REQUIRE_GPU")) {
        /* No device here: the CUDA path is checked where one is (scripts/gpu-check.sh sets
         * KVT_REQUIRE_GPU, which turns this skip into a failure). */
        kvt_model_destroy(m);
        return NULL;
    }
    cr_assert_eq(cs, KVT_OK, "%s: %s", g->name, err);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 7, &seq), KVT_OK);
    cr_assert_eq(kvt_seq_set_prompt_rows(seq, g->prompt_rows), KVT_OK);
    kvt_batch *batch;
    cr_assert_eq(kvt_batch_create(ctx, 1, &batch), KVT_OK);
    const uint32_t L = kvt_model_n_layers(m);
    int32_t *emitted = malloc(sizeof(int32_t) * (g->tokens + 1) * L);
    int32_t *lens = calloc(L, sizeof *lens);
    cr_assert(emitted && lens);

    sbuf b = {0};
    dump_header(&b, g, m);
    tu_rng chunks = {g->seed ^ 0xc0ffee};
    uint64_t n = 0;
    uint32_t next_cp = 0;
    uint8_t *row = malloc(1 << 16);
    cr_assert(row);
    while (n < g->tokens) {
        uint32_t want = 1 + (uint32_t)(tu_next(&chunks) % g->max_chunk);
        /* never step over a checkpoint */
        uint64_t stop = next_cp < g->n_checkpoints ? g->checkpoints[next_cp] : g->tokens;
        if (n + want > stop)
            want = (uint32_t)(stop - n);
        cr_assert_eq(kvt_batch_reserve(batch, &seq, &want, 1), KVT_OK, "%s at %llu: %s",
                     g->name, (unsigned long long)n, kvt_last_error());
        if (run)
            cr_assert_eq(kvt_batch_plan(batch), KVT_OK, "%s", kvt_last_error());
        for (uint32_t l = 0; l < L; l++) {
            const kvt_layer_spec *s = kvt_model_layer(m, l);
            if (s->kind == KVT_LAYER_NO_KV)
                continue;
            write_layer(g, seq, s, l, n, want, row);
            if (!run)
                continue;
            uint32_t topk;
            cr_assert_eq(kvt_batch_capacity(batch, l, &topk, NULL), KVT_OK);
            cr_assert_eq(topk, n + want);
            kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                          .indices = emitted + (size_t)l * (g->tokens + 1), .capacity = topk,
                          .lengths = &lens[l]};
            /* tu_run: emission into backend buffers (the guarded backend refuses host ones) */
            cr_assert_eq(tu_run(batch, ctx, l, 1, &e), KVT_OK, "%s layer %u at %llu: %s",
                         g->name, l, (unsigned long long)n, kvt_last_error());
        }
        cr_assert_eq(kvt_batch_commit(batch, NULL), KVT_OK, "%s at %llu: %s", g->name,
                     (unsigned long long)n, kvt_last_error());
        n += want;
        if (next_cp < g->n_checkpoints && n == g->checkpoints[next_cp]) {
            cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s: %s", g->name, kvt_last_error());
            dump_checkpoint(&b, ctx, seq, n);
            for (uint32_t l = 0; run && l < L; l++)
                if (kvt_model_layer(m, l)->kind != KVT_LAYER_NO_KV)
                    check_emission(seq, l, n, emitted + (size_t)l * (g->tokens + 1), lens[l],
                                   g->name);
            next_cp++;
        }
    }
    free(row);
    free(emitted);
    free(lens);
    kvt_batch_destroy(batch);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    *len = b.n;
    return b.p;
}

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    cr_assert(p);
    cr_assert_eq(fread(p, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    p[n] = 0;
    *len = (size_t)n;
    return p;
}

static void write_all(const char *path, const char *p, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert(f, "cannot write %s", path);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

static void check_golden_path(const gcase *g, bool run, kvt_backend_kind backend);

/* "_guarded" / "_cuda" for file names ("" on the CPU backend). */
static const char *kvt_backend_suffix(kvt_backend_kind b) {
    return b == KVT_BACKEND_GUARDED ? "_guarded" : b == KVT_BACKEND_CUDA ? "_cuda" : "";
}

/* Both drivers (commit-only and the engine's run order) against the same file, and the run order
 * again on the guarded-device backend (no host access to the pool outside the backend's ops). */
static void check_golden(const gcase *g) {
    check_golden_path(g, false, KVT_BACKEND_CPU);
    check_golden_path(g, true, KVT_BACKEND_CPU);
    check_golden_path(g, true, KVT_BACKEND_GUARDED);
    check_golden_path(g, true, KVT_BACKEND_CUDA);
}

static void check_golden_path(const gcase *g, bool run, kvt_backend_kind backend) {
    size_t n;
    char *got = run_case(g, &n, run, backend);
    if (!got) {
        cr_log_info("%s: CUDA path skipped: no usable CUDA device in this build or machine",
                    g->name);
        return;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/golden/keepsets/%s.txt", KVT_SOURCE_DIR, g->name);
    const char *upd = getenv("KVT_GOLDEN_UPDATE");
    if (upd && strcmp(upd, "1") == 0 && !run) {
        write_all(path, got, n);
        cr_log_warn("recorded %s (%zu bytes)", path, n);
        free(got);
        return;
    }
    size_t en;
    char *exp = read_all(path, &en);
    cr_assert(exp, "missing golden file %s (record with KVT_GOLDEN_UPDATE=1)", path);
    if (en != n || memcmp(exp, got, n) != 0) {
        char out[1024];
        snprintf(out, sizeof out, "%s/golden_%s%s%s.actual.txt", KVT_BINARY_DIR, g->name,
                 run ? "_run" : "", kvt_backend_suffix(backend));
        write_all(out, got, n);
        size_t i = 0, line = 1, ls = 0;
        while (i < n && i < en && got[i] == exp[i]) {
            if (got[i] == '\n') {
                line++;
                ls = i + 1;
            }
            i++;
        }
        const char *ge = memchr(got + ls, '\n', n - ls), *ee = memchr(exp + ls, '\n', en - ls);
        int gl = ge ? (int)(ge - (got + ls)) : (int)(n - ls);
        int el = ee ? (int)(ee - (exp + ls)) : (int)(en - ls);
        cr_assert_fail("%s (%s path, %s backend): decisions changed at line %zu\n  golden: %.*s\n  actual: %.*s\n"
                       "(actual file: %s)", g->name, run ? "run" : "commit",
                       backend == KVT_BACKEND_GUARDED ? "guarded"
                       : backend == KVT_BACKEND_CUDA  ? "cuda"
                                                      : "cpu",
                       line, el > 300 ? 300 : el, exp + ls,
                       gl > 300 ? 300 : gl, got + ls, out);
    }
    free(exp);
    free(got);
}

/* ------------------------------------------------------------------------------------------- */
/* Cases                                                                                        */
/* ------------------------------------------------------------------------------------------- */
static gcase salience_case(const char *name, const char *what, kvt_selector sel, uint32_t ratio) {
    gcase g = {.name = name, .what = what, .n_layers = 1, .page_rows = 64, .n_pages = 64,
               .prompt_rows = 0, .tokens = 3000, .max_chunk = 97, .seed = 101,
               .checkpoints = {255, 256, 700, 1024, 1500, 2048, 2500, 3000}, .n_checkpoints = 8,
               .nan_pos = 700 - 17, .inf_pos = 1900};
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &g.specs[0]),
                 KVT_OK);
    g.cfg = kvt_config_default();
    g.cfg.block_rows = 256;
    g.cfg.kappa = 8;
    g.cfg.ratio = ratio;
    g.cfg.selector = sel;
    g.cfg.seed = 0x901d;
    return g;
}

static gcase evict_case(const char *name, const char *what) {
    gcase g = {.name = name, .what = what, .n_layers = 2, .page_rows = 16, .n_pages = 64,
               .prompt_rows = 24, .tokens = 700, .max_chunk = 13, .seed = 202,
               .checkpoints = {23, 96, 97, 200, 350, 512, 700}, .n_checkpoints = 7,
               .nan_pos = UINT64_MAX, .inf_pos = UINT64_MAX};
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 4, 16, &g.specs[0]),
                 KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 32, &g.specs[1]),
                 KVT_OK);
    g.cfg = kvt_config_default();
    g.cfg.evict_budget_rows = 64;
    g.cfg.recent_rows = 16;
    g.cfg.cadence_rows = 16;
    g.cfg.seed = 0xe71c7;
    return g;
}

Test(golden, salience_sigma) {
    gcase g = salience_case("salience_sigma",
                            "MLA-NoPE bf16 1152-B rows, sigma at 8x, a NaN row and an Inf row",
                            KVT_SELECT_SIGMA, 8);
    check_golden(&g);
}

Test(golden, salience_sigma_32x_fp16_branch) {
    gcase g = salience_case("salience_sigma_32x_fp16",
                            "MLA-NoPE fp16 rows, sigma at 32x, kappa 4, 2 sinks", KVT_SELECT_SIGMA,
                            32);
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_FP16, 512, 64, &g.specs[0]),
                 KVT_OK);
    g.cfg.kappa = 4;
    g.cfg.sink_rows = 2;
    check_golden(&g);
}

Test(golden, salience_ablations) {
    gcase g = salience_case("salience_branch_norm", "ablation: branch L2 norm at 16x",
                            KVT_SELECT_BRANCH_NORM, 16);
    check_golden(&g);
    g = salience_case("salience_row_norm", "ablation: row L2 norm at 16x", KVT_SELECT_ROW_NORM,
                      16);
    check_golden(&g);
    g = salience_case("salience_random", "ablation: Philox uniform score at 16x",
                      KVT_SELECT_RANDOM, 16);
    check_golden(&g);
}

Test(golden, evict_drop) {
    gcase g = evict_case("evict_drop", "random eviction, two GQA layers (4 and 2 KV heads), drop");
    check_golden(&g);
}

Test(golden, evict_archive) {
    gcase g = evict_case("evict_archive", "random eviction with the archive");
    g.cfg.evict_archive = true;
    check_golden(&g);
}

Test(golden, evict_vase) {
    gcase g = evict_case("evict_vase", "random eviction with VaSE protection, archive");
    g.cfg.evict_vase = true;
    g.cfg.evict_archive = true;
    check_golden(&g);
}

Test(golden, evict_shared_draw_no_prompt_protection) {
    gcase g = evict_case("evict_shared_draw", "shared draw across heads, prompt not protected");
    g.cfg.evict_shared_draw = true;
    g.cfg.protect_prompt = false;
    check_golden(&g);
}

Test(golden, evict_prompt_over_budget_mla_rope) {
    gcase g = evict_case("evict_mla_rope", "MLA-RoPE + GQA group, prompt of 80 rows > K = 64");
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_ROPE, KVT_DTYPE_BF16, 512, 64, &g.specs[0]),
                 KVT_OK);
    g.prompt_rows = 80;
    g.cfg.cadence_rows = 0; /* c = r */
    check_golden(&g);
}

Test(golden, sliding_windows) {
    gcase g = {.name = "sliding", .what = "two sliding layers (windows 40 and 24) and a global "
                                          "GQA layer under random eviction",
               .n_layers = 3, .page_rows = 16, .n_pages = 64, .prompt_rows = 8, .tokens = 400,
               .max_chunk = 9, .seed = 303, .checkpoints = {10, 40, 41, 100, 250, 400},
               .n_checkpoints = 6, .nan_pos = UINT64_MAX, .inf_pos = UINT64_MAX};
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 1, 16, &g.specs[0]), KVT_OK);
    g.specs[0].sliding_window = 40;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 1, 16, &g.specs[1]), KVT_OK);
    g.specs[1].sliding_window = 24;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 16, &g.specs[2]), KVT_OK);
    g.cfg = kvt_config_default();
    g.cfg.evict_budget_rows = 48;
    g.cfg.recent_rows = 8;
    g.cfg.cadence_rows = 24;
    g.cfg.seed = 0x51d;
    check_golden(&g);
}

Test(golden, kimi_linear_config) {
    gcase g = {.name = "kimi_linear", .what = "Kimi-Linear-48B-A3B config.json (7 NoPE MLA "
                                              "layers, 20 KDA), sigma at 32x, B = 256",
               .config_file = "kimi-linear-48b-a3b-instruct.json", .page_rows = 64,
               .n_pages = 40, .prompt_rows = 100, .tokens = 2304, .max_chunk = 200, .seed = 404,
               .checkpoints = {512, 1300, 2304}, .n_checkpoints = 3, .nan_pos = UINT64_MAX,
               .inf_pos = UINT64_MAX};
    g.cfg = kvt_config_default();
    g.cfg.block_rows = 256;
    g.cfg.kappa = 8;
    g.cfg.seed = 0x4b1;
    check_golden(&g);
}
