/*
 * test_rope_recall.c — recall on RoPE layers (issue 12, docs/recall.md §8): the sketches of the
 * random-eviction archive (tiers/evict.c kvt__ev_sketch_pending, built with kernels/sketch.h's
 * per-element functions), the per-KV-head key bases (kvt_ctx_set_recall_head_basis), and that
 * without recall sketch planes nothing changes.
 *
 * The harness drives one request of a GQA-RoPE model through the public step API, keeps a
 * shadow of every key it wrote, runs kvt_seq_check after every step, and compares the
 * archive's sketch planes (read through the backend: the guarded backend faults on a host touch)
 * with a host oracle: kvt__sketch_rows_cpu over the shadow keys in the archive's order.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvt_hd.h"
#include "kernels/sketch.h"
#include "kvtier.h"
#include "lib/handles.h"
#include "support/testutil.h"

enum { RR_MAXH = 4 };

typedef struct rr {
    kvt_ctx *ctx;
    kvt_seq *seq;
    kvt_layer_spec sp;
    uint32_t H, D, stride;
    uint64_t n_tok, cap;
    uint8_t *rows[2];  /* shadow [token][H][row_bytes] per plane */
    float *V[RR_MAXH]; /* host bases ([rank][D]) or NULL */
    uint32_t rank[RR_MAXH];
    tu_rng rng;
    uint64_t seed;
} rr;

static kvt_config rr_cfg(uint32_t K, uint32_t r, uint32_t c) {
    kvt_config cfg = kvt_config_default();
    cfg.evict_budget_rows = K;
    cfg.recent_rows = r;
    cfg.cadence_rows = c;
    cfg.protect_prompt = true;
    cfg.evict_archive = true;
    return cfg;
}

/* A one-layer GQA-RoPE model of H KV heads of D bf16 values; sketch planes of `sk_rank`
 * (0: none); bases for the heads with rank[h] > 0. */
static void rr_init(rr *x, uint32_t H, uint32_t D, kvt_config cfg, uint32_t sk_rank,
                    const uint32_t *rank, kvt_backend_kind backend, uint64_t seed) {
    memset(x, 0, sizeof *x);
    x->H = H;
    x->D = D;
    x->seed = seed;
    x->rng.s = seed;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, H, D, &x->sp), KVT_OK);
    x->sp.n_q_heads = 4 * H;
    char err[512] = "";
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_create(&x->sp, 1, "rope", &m, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.config = &cfg;
    p.model = m;
    p.page_rows = 16;
    p.n_pages = 256;
    p.allocator = KVT_ALLOC_LIBC;
    p.backend = backend;
    p.recall_sketch_rank = sk_rank;
    cr_assert_eq(kvt_ctx_create(&p, &x->ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_model_destroy(m);
    x->stride = sk_rank < D ? sk_rank : D;
    for (uint32_t h = 0; rank && h < H; h++) {
        x->rank[h] = rank[h];
        if (!rank[h])
            continue;
        x->V[h] = malloc(sizeof(float) * rank[h] * D);
        cr_assert(tu_orthonormal_rows(&x->rng, rank[h], D, x->V[h]));
        cr_assert_eq(kvt_ctx_set_recall_head_basis(x->ctx, 0, h, x->V[h], rank[h]), KVT_OK, "%s",
                     kvt_last_error());
    }
    cr_assert_eq(tu_seq_create(x->ctx, 7, &x->seq), KVT_OK);
}

static void rr_fini(rr *x) {
    kvt_seq_destroy(x->seq);
    kvt_ctx_destroy(x->ctx);
    for (int p = 0; p < 2; p++)
        free(x->rows[p]);
    for (uint32_t h = 0; h < RR_MAXH; h++)
        free(x->V[h]);
    memset(x, 0, sizeof *x);
}

static uint8_t *rr_row(const rr *x, uint32_t plane, uint64_t pos, uint32_t h) {
    return x->rows[plane] + (pos * x->H + h) * x->sp.row_bytes;
}

/* A key of head h at pos: normal draws, some of them in span of the head's basis (so ρ takes
 * both small and full values), one in 97 with a NaN (ρ = +Inf). bf16. */
static void rr_fill(rr *x, uint64_t pos, uint32_t h, uint8_t *key, uint8_t *val) {
    float c[1024];
    const uint32_t D = x->D;
    if (x->V[h] && pos % 3 == 0) {
        for (uint32_t d = 0; d < D; d++)
            c[d] = 0.0f;
        for (uint32_t k = 0; k < x->rank[h]; k++) {
            float a = (float)tu_normal(&x->rng);
            for (uint32_t d = 0; d < D; d++)
                c[d] += a * x->V[h][(size_t)k * D + d];
        }
    } else {
        for (uint32_t d = 0; d < D; d++)
            c[d] = (float)tu_normal(&x->rng);
    }
    if (pos % 97 == 50)
        c[pos % D] = NAN;
    for (uint32_t d = 0; d < D; d++) {
        uint16_t b = kvt__f32_to_bf16(c[d]);
        memcpy(key + 2 * d, &b, 2);
        b = kvt__f32_to_bf16((float)tu_normal(&x->rng));
        memcpy(val + 2 * d, &b, 2);
    }
}

/* One step of n tokens: reserve, write, commit (through the run when `run`), kvt_seq_check. */
static void rr_step(rr *x, uint32_t n, bool run) {
    if (x->n_tok + n > x->cap) {
        x->cap = (x->n_tok + n) * 2;
        for (int p = 0; p < 2; p++) {
            x->rows[p] = realloc(x->rows[p], x->cap * x->H * x->sp.row_bytes);
            cr_assert_not_null(x->rows[p]);
        }
    }
    cr_assert_eq(tu_reserve(x->seq, n), KVT_OK, "%s", kvt_last_error());
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < x->H; h++)
            rr_fill(x, x->n_tok + t, h, rr_row(x, 0, x->n_tok + t, h),
                    rr_row(x, 1, x->n_tok + t, h));
    const size_t slot = (size_t)x->H * x->sp.row_bytes;
    for (uint32_t p = 0; p < 2; p++)
        cr_assert_eq(kvt_seq_write(x->seq, 0, p, 0, n, rr_row(x, p, x->n_tok, 0), n * slot),
                     KVT_OK, "%s", kvt_last_error());
    kvt_status s = run ? tu_commit_run(x->seq, n) : tu_commit(x->seq, n);
    cr_assert_eq(s, KVT_OK, "seed %llu: %s", (unsigned long long)x->seed, kvt_last_error());
    x->n_tok += n;
    cr_assert_eq(kvt_seq_check(x->seq), KVT_OK, "seed %llu after %llu tokens: %s",
                 (unsigned long long)x->seed, (unsigned long long)x->n_tok, kvt_last_error());
}

static void dev_read(const rr *x, void *dst, const void *src, size_t bytes) {
    const kvt__backend *be = &x->ctx->backend;
    cr_assert_eq(be->ops->read(be, dst, src, bytes, NULL), KVT_OK);
}

/* The archive's sketches equal the host oracle's, bit for bit, for every head and row. Returns
 * the rows checked per head. */
static uint64_t rr_check_sketches(const rr *x) {
    const kvt__ev *e = &x->seq->layers[0].ev;
    cr_assert_eq(e->sk_n, e->ar_n, "every archived row is sketched after a commit");
    cr_assert_eq(e->sk_stride, x->stride);
    const uint64_t n = e->ar_n;
    if (n == 0)
        return 0;
    const uint32_t D = x->D, S = x->stride;
    int64_t *pos = malloc(sizeof *pos * n);
    uint16_t *csk = malloc(sizeof *csk * n * S), *want_csk = malloc(sizeof *csk * n * S);
    float *rho = malloc(sizeof *rho * n), *want_rho = malloc(sizeof *rho * n);
    int32_t *slots = malloc(sizeof *slots * n);
    float *scratch = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    cr_assert(pos && csk && want_csk && rho && want_rho && slots && scratch);
    for (uint32_t h = 0; h < x->H; h++) {
        dev_read(x, pos, e->ar_pos + (size_t)h * e->ar_cap, sizeof *pos * n);
        dev_read(x, csk, e->ar_csk + (size_t)h * e->ar_cap * S, sizeof *csk * n * S);
        dev_read(x, rho, e->ar_rho + (size_t)h * e->ar_cap, sizeof *rho * n);
        /* The oracle reads the shadow keys: slot of archive row k = its position's shadow row. */
        for (uint64_t k = 0; k < n; k++) {
            cr_assert(pos[k] >= 0 && (uint64_t)pos[k] < x->n_tok);
            slots[k] = (int32_t)((uint64_t)pos[k] * x->H + h);
        }
        kvt__sketch_rows_cpu(x->rows[0], slots, (uint32_t)n, x->sp.row_bytes, KVT__DT_BF16, D,
                             x->V[h], x->rank[h], S, scratch, want_csk, want_rho);
        for (uint64_t k = 0; k < n; k++) {
            cr_assert(memcmp(&rho[k], &want_rho[k], sizeof *rho) == 0,
                      "seed %llu head %u archive row %llu (position %lld): rho %a, oracle %a",
                      (unsigned long long)x->seed, h, (unsigned long long)k, (long long)pos[k],
                      (double)rho[k], (double)want_rho[k]);
            cr_assert(memcmp(csk + k * S, want_csk + k * S, sizeof *csk * S) == 0,
                      "seed %llu head %u archive row %llu: csk differs", (unsigned long long)x->seed,
                      h, (unsigned long long)k);
        }
    }
    free(pos);
    free(csk);
    free(want_csk);
    free(rho);
    free(want_rho);
    free(slots);
    free(scratch);
    return n;
}

static kvt_layer_stats rr_stats(const rr *x) {
    kvt_layer_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    cr_assert_eq(kvt_seq_layer_stats(x->seq, 0, &s), KVT_OK);
    return s;
}

/* ---- (1) Sketches of the archive ------------------------------------------------------------ */

static void sketch_run(kvt_backend_kind backend, uint64_t seed) {
    const uint32_t rank[3] = {32, 0, 8}; /* head 1 has no basis: ρ = ‖k‖ */
    rr x;
    rr_init(&x, 3, 128, rr_cfg(32, 8, 16), 32, rank, backend, seed);
    cr_assert_eq(kvt_seq_set_prompt_rows(x.seq, 5), KVT_OK);
    rr_step(&x, 5, false); /* the prompt */
    uint64_t checked = 0;
    for (int i = 0; i < 150; i++) {
        rr_step(&x, 1 + (uint32_t)(i % 3 == 0), i % 2 == 0); /* half the rounds run in the step */
        if (i % 25 == 24)
            checked += rr_check_sketches(&x);
    }
    checked += rr_check_sketches(&x);
    cr_assert_gt(x.seq->layers[0].ev.rounds, 5u);
    cr_assert_gt(checked, 100u);
    kvt_layer_stats st = rr_stats(&x);
    cr_assert_eq(st.sketched_rows, st.archived_rows);
    cr_assert_eq(st.recall_rank, 32u);
    uint32_t r = 99, id = 0;
    cr_assert_eq(kvt_ctx_recall_head_basis(x.ctx, 0, 1, &r, &id), KVT_OK);
    cr_assert_eq(r, 0u);
    cr_assert_eq(id, 0u);
    cr_assert_eq(kvt_ctx_recall_head_basis(x.ctx, 0, 2, &r, &id), KVT_OK);
    cr_assert_eq(r, 8u);
    cr_assert_neq(id, 0u);
    rr_fini(&x);
}

Test(rope_sketch, archive_sketches_equal_the_oracle_cpu) {
    sketch_run(KVT_BACKEND_CPU, 1201);
}

Test(rope_sketch, archive_sketches_equal_the_oracle_guarded) {
    sketch_run(KVT_BACKEND_GUARDED, 1201);
}

/* ρ with no basis is the key's norm (σ's fixed order), and rows the sketch cannot describe
 * (a NaN) get ρ = +Inf and an empty sketch: checked by the oracle, and here in plain terms. */
Test(rope_sketch, no_basis_rho_is_the_key_norm) {
    rr x;
    rr_init(&x, 1, 128, rr_cfg(16, 4, 8), 16, NULL, KVT_BACKEND_CPU, 77);
    for (int i = 0; i < 120; i++)
        rr_step(&x, 1, false);
    rr_check_sketches(&x);
    const kvt__ev *e = &x.seq->layers[0].ev;
    uint64_t n = e->ar_n, inf = 0;
    int64_t *pos = malloc(sizeof *pos * n);
    float *rho = malloc(sizeof *rho * n);
    dev_read(&x, pos, e->ar_pos, sizeof *pos * n);
    dev_read(&x, rho, e->ar_rho, sizeof *rho * n);
    for (uint64_t k = 0; k < n; k++) {
        const uint8_t *key = rr_row(&x, 0, (uint64_t)pos[k], 0);
        double s = 0;
        bool finite = true;
        for (uint32_t d = 0; d < x.D; d++) {
            float v = kvt__load_elem(key, KVT__DT_BF16, d);
            finite = finite && isfinite(v);
            s += (double)v * v;
        }
        if (!finite) {
            cr_assert(isinf(rho[k]));
            inf++;
            continue;
        }
        cr_assert_float_eq(rho[k], sqrt(s), 1e-5 * sqrt(s), "row %llu", (unsigned long long)k);
    }
    cr_assert_gt(inf, 0u, "the data has undescribable rows");
    free(pos);
    free(rho);
    rr_fini(&x);
}

/* Forks carry the sketches; a snapshot restore rebuilds them (derived data) bit for bit. */
Test(rope_sketch, fork_and_snapshot_keep_the_sketches) {
    const uint32_t rank[2] = {16, 16};
    rr x;
    rr_init(&x, 2, 128, rr_cfg(16, 4, 8), 16, rank, KVT_BACKEND_CPU, 99);
    for (int i = 0; i < 80; i++)
        rr_step(&x, 1, false);
    rr_check_sketches(&x);
    kvt_seq *child = NULL;
    cr_assert_eq(kvt_seq_fork(x.seq, 8, &child), KVT_OK, "%s", kvt_last_error());
    kvt_seq *parent = x.seq;
    x.seq = child;
    rr_check_sketches(&x);
    cr_assert_eq(kvt_seq_check(child), KVT_OK, "%s", kvt_last_error());
    /* snapshot of the parent into memory, restored as a new request */
    size_t bytes = 0;
    cr_assert_eq(kvt_seq_snapshot_size(parent, &bytes), KVT_OK, "%s", kvt_last_error());
    void *buf = malloc(bytes);
    size_t written = 0;
    cr_assert_eq(kvt_seq_snapshot(parent, buf, bytes, &written), KVT_OK, "%s",
                 kvt_last_error());
    kvt_seq *back = NULL;
    cr_assert_eq(kvt_seq_restore(x.ctx, buf, written, &back), KVT_OK, "%s",
                 kvt_last_error());
    x.seq = back;
    rr_check_sketches(&x);
    cr_assert_eq(kvt_seq_check(back), KVT_OK, "%s", kvt_last_error());
    free(buf);
    kvt_seq_destroy(back);
    kvt_seq_destroy(child);
    x.seq = parent;
    rr_fini(&x);
}

/* Without sketch planes (recall_sketch_rank 0, the default) the archive has none: nothing is
 * computed, the statistics say so. */
Test(rope_sketch, off_without_sketch_planes) {
    rr x;
    rr_init(&x, 2, 128, rr_cfg(16, 4, 8), 0, NULL, KVT_BACKEND_CPU, 5);
    for (int i = 0; i < 60; i++)
        rr_step(&x, 1, i % 2 == 0);
    const kvt__ev *e = &x.seq->layers[0].ev;
    cr_assert_eq(e->sk_stride, 0u);
    cr_assert_null(e->ar_csk);
    cr_assert_gt(e->ar_n, 0u);
    kvt_layer_stats st = rr_stats(&x);
    cr_assert_eq(st.sketched_rows, 0u);
    float V[128];
    memset(V, 0, sizeof V);
    V[0] = 1.0f;
    cr_assert_eq(kvt_ctx_set_recall_head_basis(x.ctx, 0, 0, V, 1), KVT_ERR_UNSUPPORTED);
    rr_fini(&x);
}

/* The basis API's refusals, each with nothing changed. */
Test(rope_sketch, head_basis_statuses) {
    kvt_model *m = tu_mixed_model();
    cr_assert_not_null(m);
    kvt_config cfg = kvt_config_default();
    cfg.evict_archive = true;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.config = &cfg;
    p.model = m;
    p.page_rows = 16;
    p.n_pages = 64;
    p.recall_sketch_rank = 8;
    kvt_ctx *ctx = NULL;
    char err[512];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    float V[8 * 16];
    tu_rng rng = {3};
    cr_assert(tu_orthonormal_rows(&rng, 8, 16, V));
    cr_assert_eq(kvt_ctx_set_recall_head_basis(NULL, TU_L_EV1, 0, V, 8), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 0, NULL, 8),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, 99, 0, V, 8), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_SAL, 0, V, 8), KVT_ERR_POLICY_MISMATCH);
    cr_assert(strstr(kvt_last_error(), "policy") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 2, V, 8), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 0, V, 9), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 0, V, 0), KVT_ERR_OUT_OF_RANGE);
    float bad[8 * 16];
    memcpy(bad, V, sizeof bad);
    bad[17] += 0.5f; /* rows no longer orthonormal */
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 0, bad, 8),
                 KVT_ERR_INVALID_ARGUMENT);
    bad[17] = NAN;
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 0, bad, 8),
                 KVT_ERR_INVALID_ARGUMENT);
    uint32_t r = 7;
    cr_assert_eq(kvt_ctx_recall_head_basis(ctx, TU_L_EV1, 0, &r, NULL), KVT_OK);
    cr_assert_eq(r, 0u, "nothing changed");
    /* The salience basis call stays refused on an evict layer. */
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, TU_L_EV1, V, 8), KVT_ERR_POLICY_MISMATCH);
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 1, V, 8), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(kvt_ctx_recall_head_basis(ctx, TU_L_EV1, 1, &r, NULL), KVT_OK);
    cr_assert_eq(r, 8u);
    kvt_seq *seq = NULL;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 1), KVT_OK);
    cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, TU_L_EV1, 0, V, 8), KVT_ERR_BAD_STATE);
    kvt_seq_destroy(seq);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}
