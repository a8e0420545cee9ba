/*
 * test_rope_recall.c — recall on RoPE layers (issue 12, docs/recall.md §9): the sketches of the
 * random-eviction archive (tiers/evict.c kvt__ev_sketch_pending, built with
 * recall/kernels/sketch.h's per-element functions), the per-KV-head key bases
 * (kvt_ctx_set_recall_head_basis), and that without recall sketch planes nothing changes.
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

#include "kernels/attn.h"
#include "kernels/kvt_hd.h"
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"
#include "kvtier.h"
#include "lib/handles.h"
#include "recall/conformal.h"
#include "recall/recall_rope.h"
#include "support/oneshot.h"
#include "support/testutil.h"
#include "tiers/tiers_internal.h" /* white-box: the policies' states */

#include "support/tu_cuda.h"

enum { RR_MAXH = 4 };

/* Context overrides for the next rr_init (0: the defaults). g_mla: an MLA-RoPE layer instead (one
 * latent head of D values, a rotated 64-value branch scored exactly; H must be 1). */
static uint32_t g_n_pages, g_max_seqs, g_max_rows;
static bool g_mla;
/* g_archive_host: the next rr_init's archive in pinned host memory (params.archive_space HOST).
 * check_lists' oracle then caps each head's fetched rows at g_cap_rows, and g_capped_calib says
 * the step was a capped calibration step (each query head's best archived row fetched). */
static bool g_archive_host, g_capped_calib;
static uint32_t g_cap_rows;
/* g_clustered: rr_fill draws the keys of a head with a basis around four tight centres in it (no
 * plain normal draws; the NaN rows stay), so that the pruned scan's groups separate them. */
static bool g_clustered;

typedef struct rr {
    kvt_ctx *ctx;
    kvt_seq *seq;
    kvt_layer_spec sp;
    uint32_t H, D, stride;
    uint32_t bd, bo, QW, P; /* branch values and byte offset (MLA), query width D + bd, planes */
    uint64_t n_tok, cap;
    uint32_t n_pages;  /* the context's pool pages (one group) */
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
    cfg.block_rows = 64; /* the pruned scan's archive blocks: groups from the 64th archived row */
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
    if (g_mla) {
        cr_assert_eq(H, 1u);
        cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_ROPE, KVT_DTYPE_BF16, D, 64, &x->sp), KVT_OK);
        x->bd = x->sp.branch_dim;
        x->bo = x->sp.branch_offset;
    } else {
        cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, H, D, &x->sp), KVT_OK);
    }
    x->QW = D + x->bd;
    x->P = x->sp.n_planes;
    x->sp.n_q_heads = 4 * H;
    char err[512] = "";
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_create(&x->sp, 1, "rope", &m, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.config = &cfg;
    p.model = m;
    p.page_rows = 16;
    p.n_pages = x->n_pages = g_n_pages ? g_n_pages : 256;
    p.max_seqs = g_max_seqs;
    p.max_rows_per_seq = g_max_rows;
    p.allocator = KVT_ALLOC_LIBC;
    p.backend = backend;
    p.recall_sketch_rank = sk_rank;
    p.archive_space = g_archive_host ? KVT_SPACE_HOST : KVT_SPACE_DEVICE;
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

/* A key of head h at pos, bf16. With a basis: mostly near an 8-dim subspace of it (small ρ: the
 * trigger is selective), one in five a plain normal draw (ρ near ‖k‖); without: normal draws
 * (ρ = ‖k‖). One in 97 has a NaN (ρ = +Inf). */
static void rr_fill(rr *x, uint64_t pos, uint32_t h, uint8_t *key, uint8_t *val) {
    float c[1024];
    const uint32_t D = x->D;
    if (g_clustered && x->V[h]) {
        const uint32_t cl = (uint32_t)((pos * 7u + h) % 4u); /* centre cl: 2·(basis row cl) */
        for (uint32_t d = 0; d < D; d++)
            c[d] = (float)(0.02 * tu_normal(&x->rng)) + 2.0f * x->V[h][(size_t)cl * D + d];
    } else if (x->V[h] && pos % 5 != 0) {
        const uint32_t sub = x->rank[h] < 8 ? x->rank[h] : 8;
        for (uint32_t d = 0; d < D; d++)
            c[d] = (float)(0.02 * tu_normal(&x->rng));
        for (uint32_t k = 0; k < sub; k++) {
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
    for (uint32_t j = 0; j < x->bd; j++) { /* MLA-RoPE: the rotated branch (any values) */
        uint16_t b = kvt__f32_to_bf16((float)(0.5 * tu_normal(&x->rng)));
        memcpy(key + x->bo + 2 * j, &b, 2);
    }
}

/* One step of n tokens: reserve, write, commit (through the run when `run`), kvt_seq_check. */
static void rr_write(rr *x, uint32_t n);

static void rr_step(rr *x, uint32_t n, bool run) {
    cr_assert_eq(tu_reserve(x->seq, n), KVT_OK, "%s", kvt_last_error());
    rr_write(x, n);
    kvt_status s = run ? tu_commit_run(x->seq, n) : tu_commit(x->seq, n);
    cr_assert_eq(s, KVT_OK, "seed %llu: %s", (unsigned long long)x->seed, kvt_last_error());
    x->n_tok += n;
    cr_assert_eq(kvt_seq_check(x->seq), KVT_OK, "seed %llu after %llu tokens: %s",
                 (unsigned long long)x->seed, (unsigned long long)x->n_tok, kvt_last_error());
}

/* The rows of n reserved tokens: drawn into the shadow, written with kvt_seq_write. */
static void rr_write(rr *x, uint32_t n) {
    if (x->n_tok + n > x->cap) {
        x->cap = (x->n_tok + n) * 2;
        for (int p = 0; p < 2; p++) {
            x->rows[p] = realloc(x->rows[p], x->cap * x->H * x->sp.row_bytes);
            cr_assert_not_null(x->rows[p]);
        }
    }
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < x->H; h++)
            rr_fill(x, x->n_tok + t, h, rr_row(x, 0, x->n_tok + t, h),
                    rr_row(x, 1, x->n_tok + t, h));
    const size_t slot = (size_t)x->H * x->sp.row_bytes;
    for (uint32_t p = 0; p < x->P; p++)
        cr_assert_eq(kvt_seq_write(x->seq, 0, p, 0, n, rr_row(x, p, x->n_tok, 0), n * slot),
                     KVT_OK, "%s", kvt_last_error());
}

static void dev_read(const rr *x, void *dst, const void *src, size_t bytes) {
    const kvt__backend *be = &x->ctx->backend;
    cr_assert_eq(be->ops->read(be, dst, src, bytes, NULL), KVT_OK);
}

/* The archive's sketches equal the host oracle's, bit for bit, for every head and row. Returns
 * the rows checked per head. */
static uint64_t rr_check_sketches(const rr *x) {
    const kvt__ev *e = &kvt__seq_state(x->seq, 0)->ev;
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
    cr_assert_gt(kvt__seq_state(x.seq, 0)->ev.rounds, 5u);
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
    const kvt__ev *e = &kvt__seq_state(x.seq, 0)->ev;
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
    /* preemption: the request goes, then comes back under its id (ids are unique among a
     * context's live requests) */
    kvt_seq *back = NULL;
    cr_assert_eq(kvt_seq_restore(x.ctx, buf, written, &back), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(back);
    kvt_seq_destroy(parent);
    cr_assert_eq(kvt_seq_restore(x.ctx, buf, written, &back), KVT_OK, "%s",
                 kvt_last_error());
    x.seq = back;
    rr_check_sketches(&x);
    cr_assert_eq(kvt_seq_check(back), KVT_OK, "%s", kvt_last_error());
    free(buf);
    kvt_seq_destroy(child);
    rr_fini(&x);
}

/* Without sketch planes (recall_sketch_rank 0, the default) the archive has none: nothing is
 * computed, the statistics say so. */
Test(rope_sketch, off_without_sketch_planes) {
    rr x;
    rr_init(&x, 2, 128, rr_cfg(16, 4, 8), 0, NULL, KVT_BACKEND_CPU, 5);
    for (int i = 0; i < 60; i++)
        rr_step(&x, 1, i % 2 == 0);
    const kvt__ev *e = &kvt__seq_state(x.seq, 0)->ev;
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

/* A CPU context of 64 pages of 16 rows over m with cfg and sketch planes of sk_rank. */
static kvt_ctx *small_ctx(kvt_model *m, const kvt_config *cfg, uint32_t sk_rank) {
    kvt_ctx_params p = kvt_ctx_default_params();
    p.config = cfg;
    p.model = m;
    p.page_rows = 16;
    p.n_pages = 64;
    p.recall_sketch_rank = sk_rank;
    p.archive_space = g_archive_host ? KVT_SPACE_HOST : KVT_SPACE_DEVICE;
    kvt_ctx *ctx = NULL;
    char err[512] = "";
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    return ctx;
}

/* The basis API's refusals, each with nothing changed. */
Test(rope_sketch, head_basis_statuses) {
    kvt_model *m = tu_mixed_model();
    cr_assert_not_null(m);
    kvt_config cfg = kvt_config_default();
    cfg.evict_archive = true;
    kvt_ctx *ctx = small_ctx(m, &cfg, 8);
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

/* ---- (2) The trigger ------------------------------------------------------------------------ */

enum { TR_MAXQ = 64, TR_MAXA = 4096 };

/* One trigger step's outputs, read back from the backend. */
typedef struct trig_out {
    kvt__recall_state st;
    uint32_t n_fired[RR_MAXH], overflow[RR_MAXH];
    uint32_t *fired[RR_MAXH]; /* [cap] each */
    uint8_t dense;
    float best[TR_MAXQ];
} trig_out;

/* The test's side of the trigger: the state the recall tier keeps, the queries' and the dense
 * flag's backend buffers. */
typedef struct trig {
    kvt__recall_rope_layer rl;
    float *qdev;
    uint8_t *ddev;
    uint32_t nq, cap;
    kvt__conformal conf; /* the oracle's calibration */
    float conf_samples[64 * TR_MAXQ];
} trig;

static const kvt__backend *be_of(const rr *x) {
    return &x->ctx->backend;
}

static void trig_init(trig *t, rr *x, uint32_t cap) {
    memset(t, 0, sizeof *t);
    t->nq = x->sp.n_q_heads;
    t->cap = cap;
    const kvt__backend *be = be_of(x);
    cr_assert_eq(kvt__recall_rope_prepare(&t->rl, be, t->nq, x->H, cap), KVT_OK);
    void *p = NULL;
    cr_assert_eq(be->ops->buf_alloc(be, sizeof(float) * t->nq * x->QW, &p), KVT_OK);
    t->qdev = p;
    cr_assert_eq(be->ops->buf_alloc(be, 1, &p), KVT_OK);
    t->ddev = p;
    kvt__conformal_init(&t->conf, t->conf_samples, 64 * t->nq);
}

static void trig_fini(trig *t, rr *x) {
    const kvt__backend *be = be_of(x);
    kvt__recall_rope_fini(&t->rl, be);
    be->ops->buf_free(be, t->qdev, sizeof(float) * t->nq * x->QW);
    be->ops->buf_free(be, t->ddev, 1);
}

/* Run one trigger step on the committed state with queries q ([nq][D], host). */
static void trig_run(trig *t, rr *x, const float *q, kvt_recall_mode mode, float margin,
                     trig_out *o) {
    const kvt__backend *be = be_of(x);
    kvt__rope_view view;
    kvt__recall_rope_args a;
    cr_assert_eq(kvt__seq_rope_recall_view(x->seq, 0, &view), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(be->ops->write(be, t->qdev, q, sizeof(float) * t->nq * x->QW, NULL), KVT_OK);
    kvt__recall_rope_make(&t->rl, &view, t->qdev, mode, margin, t->ddev, &a);
    cr_assert_eq(os_rope_step(be, &a, 1, NULL), KVT_OK);
    dev_read(x, &o->st, t->rl.base.st, sizeof o->st);
    dev_read(x, o->n_fired, t->rl.n_fired, sizeof(uint32_t) * x->H);
    dev_read(x, o->overflow, t->rl.overflow, sizeof(uint32_t) * x->H);
    dev_read(x, &o->dense, t->ddev, 1);
    dev_read(x, o->best, t->rl.base.best, sizeof(float) * t->nq);
    for (uint32_t h = 0; h < x->H; h++) {
        o->fired[h] = realloc(o->fired[h], sizeof(uint32_t) * t->cap);
        cr_assert(o->n_fired[h] <= t->cap);
        if (o->n_fired[h])
            dev_read(x, o->fired[h], t->rl.fired + (size_t)h * t->cap,
                     sizeof(uint32_t) * o->n_fired[h]);
    }
    /* The state passes the recall tier's own invariants after every step. */
    float *samples = malloc(sizeof(float) * (o->st.n_samples + 1));
    if (o->st.n_samples)
        dev_read(x, samples, t->rl.base.samples, sizeof(float) * o->st.n_samples);
    char err[256];
    cr_assert_eq(kvt__recall_state_check(&t->rl.base, &o->st, samples, err, sizeof err), KVT_OK,
                 "%s", err);
    free(samples);
}

static void trig_out_free(trig_out *o) {
    for (uint32_t h = 0; h < RR_MAXH; h++)
        free(o->fired[h]);
}

/* What the oracle knows of the committed state: per head the attended positions and the
 * archive (positions in archive order, sketches as stored: their equality with the sketch oracle
 * is rope_sketch's test). */
typedef struct oview {
    uint64_t n_rows, ar_n;
    int64_t *pos[RR_MAXH];
    int64_t *ar_pos[RR_MAXH];
    uint16_t *csk[RR_MAXH];
    float *rho[RR_MAXH];
} oview;

static void oview_read(const rr *x, oview *v) {
    memset(v, 0, sizeof *v);
    const kvt__ev *e = &kvt__seq_state(x->seq, 0)->ev;
    v->ar_n = e->ar_n;
    for (uint32_t h = 0; h < x->H; h++) {
        v->pos[h] = malloc(sizeof(int64_t) * (x->n_tok + 1));
        cr_assert_eq(kvt_seq_positions(x->seq, 0, h, v->pos[h], x->n_tok + 1, &v->n_rows), KVT_OK);
        v->ar_pos[h] = malloc(sizeof(int64_t) * (v->ar_n + 1));
        v->csk[h] = malloc(sizeof(uint16_t) * (v->ar_n + 1) * x->stride);
        v->rho[h] = malloc(sizeof(float) * (v->ar_n + 1));
        if (!v->ar_n)
            continue;
        dev_read(x, v->ar_pos[h], e->ar_pos + (size_t)h * e->ar_cap, sizeof(int64_t) * v->ar_n);
        dev_read(x, v->csk[h], e->ar_csk + (size_t)h * e->ar_cap * x->stride,
                 sizeof(uint16_t) * v->ar_n * x->stride);
        dev_read(x, v->rho[h], e->ar_rho + (size_t)h * e->ar_cap, sizeof(float) * v->ar_n);
    }
}

static void oview_free(oview *v) {
    for (uint32_t h = 0; h < RR_MAXH; h++) {
        free(v->pos[h]);
        free(v->ar_pos[h]);
        free(v->csk[h]);
        free(v->rho[h]);
    }
}

static float o_exact(const rr *x, const float *q, uint32_t h, int64_t pos) {
    return kvt__recall_exact(q, rr_row(x, 0, (uint64_t)pos, h), KVT__DT_BF16, x->D, x->bo,
                             KVT__DT_BF16, x->bd, 1.0f);
}

/* The oracle's best per query head (over the attended rows of its KV head). */
static void o_best(const rr *x, const oview *v, const float *q, float *best) {
    const uint32_t G = x->sp.n_q_heads / x->H;
    for (uint32_t t = 0; t < x->sp.n_q_heads; t++) {
        const uint32_t h = t / G;
        best[t] = -INFINITY;
        for (uint64_t i = 0; i < v->n_rows; i++) {
            float sc = o_exact(x, q + (size_t)t * x->QW, h, v->pos[h][i]);
            best[t] = sc > best[t] ? sc : best[t];
        }
    }
}

/* The oracle's fired membership of head h's archive (in[k] = 1), for scan z and mode; count.
 * key (or NULL): each row's capped-overflow priority, kvt__recall_rope_capped_key of
 * max_g (idx_g − best_g). */
static uint64_t o_fire_keys(const rr *x, const oview *v, const float *q, const float *best,
                            uint32_t h, float z, int mode, uint8_t *in, uint32_t *key);

static uint64_t o_fire(const rr *x, const oview *v, const float *q, const float *best, uint32_t h,
                       float z, int mode, uint8_t *in) {
    return o_fire_keys(x, v, q, best, h, z, mode, in, NULL);
}

static uint64_t o_fire_keys(const rr *x, const oview *v, const float *q, const float *best,
                            uint32_t h, float z, int mode, uint8_t *in, uint32_t *key) {
    const uint32_t G = x->sp.n_q_heads / x->H, D = x->D, R = x->rank[h];
    float q_sk[KVT__SKETCH_MAX_RANK + 1], tmp[1024];
    uint64_t n = 0;
    for (uint64_t k = 0; k < v->ar_n; k++) {
        in[k] = 0;
        float score = -INFINITY;
        for (uint32_t g = 0; g < G && (key || !in[k]); g++) {
            const uint32_t t = h * G + g;
            const float *qh = q + (size_t)t * x->QW;
            kvt__recall_head hd;
            kvt__recall_head_prep(qh, D, x->V[h], R, q_sk, tmp, &hd);
            float P, ncsk;
            float idx = kvt__recall_idx(qh, q_sk, rr_row(x, 0, (uint64_t)v->ar_pos[h][k], h), D,
                                        x->bo, KVT__DT_BF16, x->bd, v->csk[h] + k * x->stride, R,
                                        1.0f, &P, &ncsk);
            int f;
            if (mode == KVT__RECALL_SOUND)
                f = kvt__recall_sound_fires(idx,
                                            kvt__recall_sound_margin(&hd, idx, P, ncsk,
                                                                     v->rho[h][k], 1.0f, z, D,
                                                                     x->bd, R),
                                            best[t]);
            else if (mode == KVT__RECALL_MARGIN)
                f = !(idx + z < best[t]);
            else
                f = kvt__recall_conformal_fires(
                    idx, kvt__recall_cert(&hd, v->rho[h][k], 1.0f, D), z, best[t]);
            in[k] |= (uint8_t)f;
            const float sc = idx - best[t];
            if (sc > score || sc != sc)
                score = sc;
        }
        if (key)
            key[k] = kvt__recall_rope_capped_key(in[k], score);
        n += in[k];
    }
    return n;
}

/* The archive index of KV head h's best archived row for query qh by exact score (ties to the
 * lower index, NaN skipped), its score in *bs; -1 when none. */
static int64_t o_best_archived(const rr *x, const oview *v, const float *qh, uint32_t h,
                               float *bs) {
    int64_t arg = -1;
    *bs = -INFINITY;
    for (uint64_t k = 0; k < v->ar_n; k++) {
        float sc = o_exact(x, qh, h, v->ar_pos[h][k]);
        if (sc > *bs) {
            *bs = sc;
            arg = (int64_t)k;
        }
    }
    return arg;
}

/* The oracle's calibration step: one sample per query head from its best archived row; true
 * while the request still calibrates. */
static bool o_calibrate(trig *t, const rr *x, const oview *v, const float *q, const float *best) {
    (void)best;
    const uint32_t G = x->sp.n_q_heads / x->H, D = x->D;
    float e[TR_MAXQ];
    uint32_t n_e = 0;
    for (uint32_t qt = 0; qt < x->sp.n_q_heads; qt++) {
        const uint32_t h = qt / G;
        const float *qh = q + (size_t)qt * x->QW;
        float bs;
        const int64_t arg = o_best_archived(x, v, qh, h, &bs);
        if (arg < 0)
            continue;
        float q_sk[KVT__SKETCH_MAX_RANK + 1], tmp[1024], P, ncsk;
        kvt__recall_head hd;
        kvt__recall_head_prep(qh, D, x->V[h], x->rank[h], q_sk, tmp, &hd);
        float idx = kvt__recall_idx(qh, q_sk, rr_row(x, 0, (uint64_t)v->ar_pos[h][arg], h), D,
                                    x->bo, KVT__DT_BF16, x->bd, v->csk[h] + arg * x->stride,
                                    x->rank[h], 1.0f, &P, &ncsk);
        float cert = kvt__recall_cert(&hd, v->rho[h][arg], 1.0f, D);
        if (kvt__conformal_sample(bs, idx, cert, &e[n_e]))
            n_e++;
    }
    return kvt__conformal_step(&t->conf, e, n_e);
}

/* A capped calibration step's rows of KV head h (in[k] = 1): each query head's best archived row
 * by exact score (ties to the lower index, NaN skipped), as o_calibrate picks them. */
static void o_calib_rows(const rr *x, const oview *v, const float *q, uint32_t h, uint8_t *in) {
    const uint32_t G = x->sp.n_q_heads / x->H;
    memset(in, 0, v->ar_n);
    for (uint32_t g = 0; g < G; g++) {
        float bs;
        const int64_t arg = o_best_archived(x, v, q + (size_t)(h * G + g) * x->QW, h, &bs);
        if (arg >= 0)
            in[arg] = 1;
    }
}

/* Queries: a random direction inside the head's 8-dim key subspace (or a plain normal draw
 * without a basis) plus small noise outside it; one in three query heads aimed at a random
 * archived row of its KV head (it then outscores most attended rows, so a miss would show). */
static void make_queries(rr *x, const oview *v, float *q, uint32_t *aimed) {
    const uint32_t G = x->sp.n_q_heads / x->H, D = x->D;
    *aimed = 0;
    uint32_t cl_of[RR_MAXH]; /* g_clustered: every query head of a KV head aims at one cluster */
    for (uint32_t h = 0; g_clustered && h < x->H; h++)
        cl_of[h] = (uint32_t)(tu_next(&x->rng) % 4u);
    for (uint32_t t = 0; t < x->sp.n_q_heads; t++) {
        const uint32_t h = t / G;
        float *qh = q + (size_t)t * x->QW;
        bool aim = v->ar_n && (g_clustered || tu_next(&x->rng) % 3 == 0);
        uint64_t ak = aim ? tu_next(&x->rng) % v->ar_n : 0;
        for (int tries = 0; aim && g_clustered && tries < 64; tries++) {
            const uint64_t pos = (uint64_t)v->ar_pos[h][ak];
            if ((pos * 7u + h) % 4u == cl_of[h])
                break;
            ak = tu_next(&x->rng) % v->ar_n;
        }
        const uint8_t *key = aim ? rr_row(x, 0, (uint64_t)v->ar_pos[h][ak], h) : NULL;
        for (uint32_t d = 0; d < D; d++) {
            float kd = key ? kvt__load_elem(key, KVT__DT_BF16, d) : 0.0f;
            if (key && !isfinite(kd))
                kd = 0.0f;
            qh[d] = 0.3f * kd + (float)(0.03 * tu_normal(&x->rng));
        }
        for (uint32_t j = 0; j < x->bd; j++) { /* MLA-RoPE: the branch part */
            float kj = key ? kvt__sigma_branch_val(key, x->bo, KVT__DT_BF16, j) : 0.0f;
            qh[D + j] = 0.3f * kj + (float)(0.1 * tu_normal(&x->rng));
        }
        const uint32_t sub = x->rank[h] < 8 ? x->rank[h] : 8;
        for (uint32_t k = 0; !key && k < sub; k++) {
            float b = (float)(0.3 * tu_normal(&x->rng));
            for (uint32_t d = 0; d < D; d++)
                qh[d] += b * x->V[h][(size_t)k * D + d];
        }
        *aimed += aim;
    }
}

/* make_queries on the committed state. */
static void aimed_queries(rr *x, float *q) {
    oview v;
    oview_read(x, &v);
    uint32_t aimed;
    make_queries(x, &v, q, &aimed);
    oview_free(&v);
}

/* The backend's fired list of head h equals the oracle's membership: the first min(cap, n)
 * ascending, overflow when more. */
static void expect_fired(const rr *x, const trig_out *o, uint32_t h, const uint8_t *in,
                         uint64_t n_in, uint32_t cap, int step) {
    if (o->st.last_dense && !o->overflow[h]) {
        cr_assert_eq(o->n_fired[h], 0u);
        return;
    }
    const bool over = n_in > cap;
    cr_assert_eq(o->overflow[h], (uint32_t)over, "seed %llu step %d head %u: overflow %u, oracle "
                 "fired %llu of cap %u", (unsigned long long)x->seed, step, h, o->overflow[h],
                 (unsigned long long)n_in, cap);
    if (over) {
        cr_assert_eq(o->n_fired[h], 0u, "a dense step leaves no list");
        return;
    }
    cr_assert_eq(o->n_fired[h], (uint32_t)n_in, "seed %llu step %d head %u: %u fired, oracle %llu",
                 (unsigned long long)x->seed, step, h, o->n_fired[h], (unsigned long long)n_in);
    for (uint64_t k = 0, w = 0; w < n_in; k++)
        if (in[k]) {
            cr_assert_eq(o->fired[h][w], (uint32_t)k, "seed %llu step %d head %u: fired[%llu] = "
                         "%u, oracle %llu", (unsigned long long)x->seed, step, h,
                         (unsigned long long)w, o->fired[h][w], (unsigned long long)k);
            w++;
        }
}

/* The RoPE model of the trigger tests: 2 KV heads of 128, 8 query heads (G = 4), bases of rank
 * 32 and 16 (sound_never_misses also runs a head without one). */
static void trig_model_ranks(rr *x, kvt_backend_kind backend, uint64_t seed, uint32_t r1) {
    const uint32_t rank[2] = {32, r1};
    rr_init(x, g_mla ? 1 : 2, 128, rr_cfg(32, 8, 16), 32, rank, backend, seed); /* MLA: head 0 */
    cr_assert_eq(kvt_seq_set_prompt_rows(x->seq, 4), KVT_OK);
    rr_step(x, 4, false);
    for (int i = 0; i < 60; i++)
        rr_step(x, 1, i % 2 == 0);
}

static void trig_model(rr *x, kvt_backend_kind backend, uint64_t seed) {
    trig_model_ranks(x, backend, seed, 16);
}

/* Conformal decode: the first steps calibrate (dense, no list; z as the oracle's calibration
 * over the same samples, bit for bit), every later step's per-KV-head fired lists equal the
 * oracle's; the best scores too. Run on CPU and guarded: both equal the oracle, so each other. */
static void conformal_run(kvt_backend_kind backend, uint64_t seed, uint64_t *fetched_aimed) {
    rr x;
    trig_model(&x, backend, seed);
    trig t;
    trig_init(&t, &x, 4096);
    trig_out o;
    memset(&o, 0, sizeof o);
    float q[TR_MAXQ * 256], best[TR_MAXQ];
    bool calibrating = true;
    uint64_t aimed_total = 0;
    uint8_t *in = malloc(TR_MAXA);
    for (int step = 0; step < 60; step++) {
        rr_step(&x, 1, step % 3 == 0);
        oview v;
        oview_read(&x, &v);
        cr_assert(v.ar_n < TR_MAXA);
        uint32_t aimed;
        make_queries(&x, &v, q, &aimed);
        trig_run(&t, &x, q, KVT_RECALL_CONFORMAL, 0.0f, &o);
        o_best(&x, &v, q, best);
        cr_assert(memcmp(best, o.best, sizeof(float) * t.nq) == 0, "seed %llu step %d: best",
                  (unsigned long long)seed, step);
        if (calibrating) {
            cr_assert_eq(o.dense, 1, "a calibration step attends every row");
            calibrating = o_calibrate(&t, &x, &v, q, best);
            cr_assert_eq(o.st.n_samples, t.conf.n);
            cr_assert_eq(o.st.z, t.conf.z, "step %d: z %g, oracle %g", step, (double)o.st.z,
                         (double)t.conf.z);
            cr_assert_eq(o.st.phase != KVT__CONFORMAL_OPEN, !calibrating);
        } else {
            uint64_t total = 0;
            for (uint32_t h = 0; h < x.H; h++) {
                uint64_t n = o_fire(&x, &v, q, best, h, t.conf.z, KVT__RECALL_CONFORMAL, in);
                expect_fired(&x, &o, h, in, n, t.cap, step);
                total += n;
            }
            cr_assert_eq(o.st.last_fetched, total);
            cr_assert_eq(o.st.last_archived, v.ar_n * x.H);
            aimed_total += aimed;
        }
        oview_free(&v);
    }
    cr_assert(!calibrating, "z was fixed within 60 steps");
    cr_assert_gt(aimed_total, 0u);
    cr_log_info("conformal (seed %llu): z %g from %u samples after %llu calibration steps; %llu "
                "steps fetched %llu of %llu archived (row, KV head) pairs",
                (unsigned long long)seed, (double)o.st.z, o.st.n_samples,
                (unsigned long long)o.st.calib_steps, (unsigned long long)o.st.steps,
                (unsigned long long)o.st.fetched, (unsigned long long)o.st.visited);
    *fetched_aimed = o.st.fetched;
    free(in);
    trig_out_free(&o);
    trig_fini(&t, &x);
    rr_fini(&x);
}

Test(rope_trigger, conformal_fired_sets_equal_the_oracle, .timeout = 240) {
    uint64_t a = 0, b = 0;
    conformal_run(KVT_BACKEND_CPU, 4242, &a);
    conformal_run(KVT_BACKEND_GUARDED, 4242, &b);
    cr_assert_eq(a, b, "CPU and guarded fetched the same rows (%llu, %llu)",
                 (unsigned long long)a, (unsigned long long)b);
}

/* The pruned scan over the archive's groups (docs/recall.md §9.8): on a state whose keys sit in
 * four tight clusters, a trigger with group planes (blocks of 256 archived rows) and one without
 * (the full scan) run on the same committed state at every step give the same outputs, bit for
 * bit — fired lists, overflow, dense, best scores, z — while the pruned one evaluates fewer
 * archived rows; the full scan's lists are the oracle's (rope_trigger). On spread keys (below,
 * clustered = false) nothing is skipped and the step falls back to the full scan. */
static void prune_run(kvt_backend_kind backend, kvt_recall_mode mode, bool clustered,
                      uint64_t seed, uint64_t *visited_full, uint64_t *visited_pruned) {
    const uint32_t rank[2] = {32, 32};
    g_clustered = clustered;
    rr x;
    rr_init(&x, g_mla ? 1 : 2, 128, rr_cfg(32, 8, 16), 32, rank, backend, seed);
    cr_assert_eq(kvt_seq_set_prompt_rows(x.seq, 4), KVT_OK);
    rr_step(&x, 4, false);
    trig full, pruned;
    trig_init(&full, &x, 4096);
    trig_init(&pruned, &x, 4096);
    trig_out of, op;
    memset(&of, 0, sizeof of);
    memset(&op, 0, sizeof op);
    float q[TR_MAXQ * 256];
    uint64_t grouped_steps = 0;
    for (int step = 0; step < 900; step++) {
        rr_step(&x, 1, step % 2 == 0);
        if (step < 300 && step % 10 != 0)
            continue; /* the archive fills; the trigger runs now and then */
        cr_assert_eq(kvt__recall_rope_groups_reserve(&pruned.rl, be_of(&x), x.n_tok, 256,
                                                     x.bd + 32),
                     KVT_OK);
        aimed_queries(&x, q);
        trig_run(&full, &x, q, mode, 0.0f, &of);
        trig_run(&pruned, &x, q, mode, 0.0f, &op);
        cr_assert_eq(op.dense, of.dense, "step %d", step);
        cr_assert(memcmp(op.best, of.best, sizeof(float) * full.nq) == 0, "step %d: best", step);
        cr_assert_eq(op.st.z, of.st.z, "step %d", step);
        cr_assert_eq(op.st.last_fired, of.st.last_fired, "step %d", step);
        cr_assert_eq(op.st.last_fetched, of.st.last_fetched, "step %d", step);
        for (uint32_t h = 0; h < x.H; h++) {
            cr_assert_eq(op.overflow[h], of.overflow[h], "step %d head %u", step, h);
            cr_assert_eq(op.n_fired[h], of.n_fired[h], "step %d head %u", step, h);
            cr_assert(memcmp(op.fired[h], of.fired[h], sizeof(uint32_t) * of.n_fired[h]) == 0,
                      "step %d head %u: fired lists differ", step, h);
        }
        cr_assert_eq(of.st.n_grouped, 0u);
        cr_assert_leq(op.st.last_visited, of.st.last_visited, "step %d", step);
        grouped_steps += op.st.n_grouped > 0;
    }
    cr_assert_gt(grouped_steps, 0u, "groups were built");
    *visited_full = of.st.visited;
    *visited_pruned = op.st.visited;
    cr_log_info("pruned RoPE scan (%s, %s keys, seed %llu): %llu of %llu archived rows visited, "
                "%u blocks a head grouped",
                mode == KVT_RECALL_SOUND ? "sound" : "conformal",
                clustered ? "clustered" : "spread", (unsigned long long)seed,
                (unsigned long long)op.st.visited, (unsigned long long)of.st.visited,
                op.st.n_grouped);
    trig_out_free(&of);
    trig_out_free(&op);
    trig_fini(&full, &x);
    trig_fini(&pruned, &x);
    rr_fini(&x);
    g_clustered = false;
}

Test(rope_prune, clustered_keys_skip_groups_and_change_nothing_cpu, .timeout = 240) {
    for (int m = 0; m < 2; m++) {
        uint64_t vf, vp;
        prune_run(KVT_BACKEND_CPU, m ? KVT_RECALL_SOUND : KVT_RECALL_CONFORMAL, true, 5150 + m,
                  &vf, &vp);
        cr_assert_lt(vp * 4, vf * 3, "the pruned scan visited %llu of %llu rows",
                     (unsigned long long)vp, (unsigned long long)vf);
    }
}

Test(rope_prune, clustered_keys_skip_groups_and_change_nothing_guarded, .timeout = 240) {
    uint64_t vf, vp;
    prune_run(KVT_BACKEND_GUARDED, KVT_RECALL_CONFORMAL, true, 6160, &vf, &vp);
    cr_assert_lt(vp * 4, vf * 3);
}

/* MLA-RoPE: the rows' embedding is [rotated branch | sketch] (the branch read from the archived
 * rows), one latent head of 8 query heads. */
Test(rope_prune, mla_changes_nothing_guarded, .timeout = 240) {
    g_mla = true;
    uint64_t vf, vp;
    prune_run(KVT_BACKEND_GUARDED, KVT_RECALL_CONFORMAL, true, 6262, &vf, &vp);
    g_mla = false;
    cr_assert_leq(vp, vf);
}

Test(rope_prune, spread_keys_change_nothing, .timeout = 240) {
    for (int m = 0; m < 2; m++) {
        uint64_t vf, vp;
        prune_run(KVT_BACKEND_CPU, m ? KVT_RECALL_SOUND : KVT_RECALL_CONFORMAL, false, 7170 + m,
                  &vf, &vp);
        cr_assert_leq(vp, vf);
    }
}

/* Sound mode never misses an archived row whose exact score reaches its query head's attended
 * best (the fp32 score kvt__recall_exact computes); margin mode is the oracle's !(idx + δ < best). */
static void sound_margin_run(void) {
    rr x;
    trig_model_ranks(&x, KVT_BACKEND_CPU, 777, 0);
    trig t;
    trig_init(&t, &x, 4096);
    trig_out o;
    memset(&o, 0, sizeof o);
    float q[TR_MAXQ * 256], best[TR_MAXQ];
    uint8_t *in = malloc(TR_MAXA);
    const uint32_t G = x.sp.n_q_heads / x.H;
    uint64_t reaching = 0, fetched = 0, archived = 0;
    for (int step = 0; step < 40; step++) {
        rr_step(&x, 1, step % 2 == 0);
        oview v;
        oview_read(&x, &v);
        uint32_t aimed;
        make_queries(&x, &v, q, &aimed);
        const bool margin = step % 4 == 3;
        const float delta = step % 8 == 3 ? 0.0f : 0.5f;
        trig_run(&t, &x, q, margin ? KVT_RECALL_MARGIN : KVT_RECALL_SOUND, delta, &o);
        o_best(&x, &v, q, best);
        cr_assert_eq(o.st.phase, KVT__CONFORMAL_OPEN, "sound and margin never calibrate");
        for (uint32_t h = 0; h < x.H; h++) {
            uint64_t n = o_fire(&x, &v, q, best, h, margin ? delta : sqrtf((float)(x.D - 64)),
                                margin ? KVT__RECALL_MARGIN : KVT__RECALL_SOUND, in);
            expect_fired(&x, &o, h, in, n, t.cap, step);
            if (margin || o.overflow[h])
                continue;
            fetched += o.n_fired[h];
            archived += v.ar_n;
            /* soundness, directly: every row reaching a head's best is in the list */
            for (uint64_t k = 0; k < v.ar_n; k++)
                for (uint32_t g = 0; g < G; g++) {
                    const uint32_t qt = h * G + g;
                    if (!(o_exact(&x, q + (size_t)qt * x.QW, h, v.ar_pos[h][k]) >= best[qt]))
                        continue;
                    reaching++;
                    bool found = false;
                    for (uint32_t j = 0; j < o.n_fired[h] && !found; j++)
                        found = o.fired[h][j] == k;
                    cr_assert(found, "seed 777 step %d head %u: archived row %llu reaches query "
                              "head %u's best and did not fire", step, h, (unsigned long long)k,
                              qt);
                }
        }
        oview_free(&v);
    }
    cr_assert_gt(reaching, 10u, "the data has archived rows that beat the attended ones");
    cr_log_info("sound%s: %llu (row, head) pairs reaching the best, fetched %llu of %llu archived "
                "(row, KV head) pairs", g_mla ? " (MLA-RoPE)" : "", (unsigned long long)reaching,
                (unsigned long long)fetched, (unsigned long long)archived);
    free(in);
    trig_out_free(&o);
    trig_fini(&t, &x);
    rr_fini(&x);
}

Test(rope_trigger, sound_never_misses_and_margin_is_exact, .timeout = 240) {
    sound_margin_run();
}

/* Overflow: with W = 2 a sound step fires more rows than W in some head: the step is dense (the
 * flag, every list empty, the whole archive counted as fetched), and the overflow is counted. */
Test(rope_trigger, overflow_gives_every_row) {
    rr x;
    trig_model(&x, KVT_BACKEND_CPU, 31);
    trig t;
    trig_init(&t, &x, 2);
    trig_out o;
    memset(&o, 0, sizeof o);
    float q[TR_MAXQ * 256], best[TR_MAXQ];
    uint8_t *in = malloc(TR_MAXA);
    oview v;
    oview_read(&x, &v);
    uint32_t aimed;
    make_queries(&x, &v, q, &aimed);
    trig_run(&t, &x, q, KVT_RECALL_SOUND, 0.0f, &o);
    o_best(&x, &v, q, best);
    uint32_t over = 0;
    for (uint32_t h = 0; h < x.H; h++) {
        uint64_t n = o_fire(&x, &v, q, best, h, sqrtf((float)(x.D - 64)), KVT__RECALL_SOUND, in);
        over |= n > 2;
        expect_fired(&x, &o, h, in, n, 2, 0);
    }
    cr_assert(over, "the data overflows W = 2 (sound fetches more)");
    cr_assert_eq(o.dense, 1);
    cr_assert_eq(o.st.last_dense, 1u);
    cr_assert_eq(o.st.last_overflow, 1u);
    cr_assert_eq(o.st.overflow_steps, 1u);
    cr_assert_eq(o.st.last_fetched, v.ar_n * x.H);
    for (uint32_t h = 0; h < x.H; h++)
        cr_assert_eq(o.n_fired[h], 0u);
    oview_free(&v);
    free(in);
    trig_out_free(&o);
    trig_fini(&t, &x);
    rr_fini(&x);
}

/* Statuses: the view of a layer without an archive, without sketches, of a salience layer; the
 * op's argument checks; salience on a RoPE layer stays refused. */
Test(rope_trigger, statuses) {
    /* no archive: the request's config has none */
    kvt_config cfg = rr_cfg(16, 4, 8);
    cfg.evict_archive = false;
    rr x;
    rr_init(&x, 2, 128, cfg, 16, NULL, KVT_BACKEND_CPU, 3);
    rr_step(&x, 1, false);
    kvt__rope_view v;
    cr_assert_eq(kvt__seq_rope_recall_view(x.seq, 0, &v), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "no archive") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt__seq_rope_recall_view(x.seq, 3, &v), KVT_ERR_OUT_OF_RANGE);
    rr_fini(&x);
    /* no sketch planes */
    rr_init(&x, 2, 128, rr_cfg(16, 4, 8), 0, NULL, KVT_BACKEND_CPU, 3);
    rr_step(&x, 1, false);
    cr_assert_eq(kvt__seq_rope_recall_view(x.seq, 0, &v), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "sketches") != NULL, "%s", kvt_last_error());
    rr_fini(&x);
    /* the op's argument checks: nothing runs */
    trig_model(&x, KVT_BACKEND_GUARDED, 3);
    trig t;
    trig_init(&t, &x, 16);
    kvt__rope_view view;
    kvt__recall_rope_args a;
    cr_assert_eq(kvt__seq_rope_recall_view(x.seq, 0, &view), KVT_OK, "%s", kvt_last_error());
    kvt__recall_rope_make(&t.rl, &view, t.qdev, KVT_RECALL_CONFORMAL, 0.0f, t.ddev, &a);
    const kvt__backend *be = be_of(&x);
    kvt__recall_rope_args bad = a;
    bad.D = 64;
    cr_assert_eq(os_rope_step(be, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
    bad = a;
    bad.rank[0] = bad.csk_stride + 1;
    cr_assert_eq(os_rope_step(be, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
    bad = a;
    bad.mode = 9;
    cr_assert_eq(os_rope_step(be, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
    bad = a;
    float host_q[8 * 128];
    bad.q = host_q; /* a host pointer: the guarded backend refuses it */
    cr_assert_eq(os_rope_step(be, &bad, 1, NULL), KVT_ERR_INVARIANT);
    trig_fini(&t, &x);
    rr_fini(&x);
    /* salience on a RoPE layer: the paper's control, refused */
    kvt_layer_spec sp;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 128, &sp), KVT_OK);
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_create(&sp, 1, "rope", &m, NULL, 0), KVT_OK);
    kvt_policy pol = KVT_POLICY_SALIENCE;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.layer_policies = &pol;
    p.recall_sketch_rank = 32;
    kvt_ctx *ctx = NULL;
    char err[256] = "";
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_POLICY_MISMATCH, "%s", err);
    cr_assert_null(ctx);
    kvt_model_destroy(m);
}

/* ---- (3) Emission: fetched rows copied into fetch slots, per-KV-head lists -------------------- */

/* A fetch area of the request: pool pages of the layer's group taken off the free list (what
 * the request's reservation will do), as a page table in a backend buffer. */
typedef struct fetch_area {
    uint32_t pages[64], n_pages;
    int32_t *pages_dev;
    uint32_t n; /* rows */
} fetch_area;

static void fetch_take(rr *x, uint32_t rows, fetch_area *f) {
    memset(f, 0, sizeof *f);
    kvt__pool *pool = &x->ctx->groups[x->ctx->stores[0].group].pool;
    const uint32_t pr = x->ctx->page_rows;
    f->n_pages = (rows + pr - 1) / pr;
    cr_assert(f->n_pages <= 64 && pool->n_free >= f->n_pages);
    f->n = f->n_pages * pr;
    int32_t ids[64];
    for (uint32_t k = 0; k < f->n_pages; k++) {
        uint32_t page = pool->free_ids[--pool->n_free];
        pool->refs[page] = 1;
        f->pages[k] = page;
        ids[k] = (int32_t)page;
    }
    const kvt__backend *be = be_of(x);
    void *p = NULL;
    cr_assert_eq(be->ops->buf_alloc(be, sizeof(int32_t) * f->n_pages, &p), KVT_OK);
    f->pages_dev = p;
    cr_assert_eq(be->ops->write(be, p, ids, sizeof(int32_t) * f->n_pages, NULL), KVT_OK);
}

static void fetch_give(rr *x, fetch_area *f) {
    kvt__pool *pool = &x->ctx->groups[x->ctx->stores[0].group].pool;
    for (uint32_t k = 0; k < f->n_pages; k++)
        kvt__pool_put(pool, f->pages[k]);
    be_of(x)->ops->buf_free(be_of(x), f->pages_dev, sizeof(int32_t) * f->n_pages);
}

static int cmp_pos(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Reference attention (kernels/attn.h) of query q over rows given as [V | K] (2D values each, so
 * the value is the first D values and the key, with the query [0 | q], the rest). */
static void ref_attn(const rr *x, const uint8_t *rows, uint32_t n, const float *q, float *out,
                     double *lse) {
    const uint32_t D = x->D;
    if (x->P == 1) { /* MLA: the row is the key [c | r], its first D values the value */
        double *sc = malloc(sizeof(double) * kvt__attn_scratch_doubles(n, 1, D, x->QW));
        kvt__attn_args a = {.base = rows, .slots = NULL, .n_rows = n,
                            .slot_stride = x->sp.row_bytes, .row_offset = 0,
                            .dtype = KVT__DT_BF16, .key_dim = x->QW, .value_dim = D, .q = q,
                            .n_heads = 1, .q_stride = x->QW, .scale = 1.0, .out = out,
                            .lse = lse, .scratch = sc};
        cr_assert_eq(kvt__attn_cpu(&a), 0);
        free(sc);
        return;
    }
    float qq[256];
    for (uint32_t d = 0; d < D; d++) {
        qq[d] = 0.0f;
        qq[D + d] = q[d];
    }
    double *scratch = malloc(sizeof(double) * kvt__attn_scratch_doubles(n, 1, D, 2 * D));
    kvt__attn_args a = {.base = rows, .slots = NULL, .n_rows = n, .slot_stride = 2u * x->sp.row_bytes,
                        .row_offset = 0, .dtype = KVT__DT_BF16, .key_dim = 2 * D, .value_dim = D,
                        .q = qq, .n_heads = 1, .q_stride = 2 * D, .scale = 1.0, .out = out,
                        .lse = lse, .scratch = scratch};
    cr_assert_eq(kvt__attn_cpu(&a), 0);
    free(scratch);
}

/* Per KV head, the listed rows (indptr/indices, read back) are exactly the attended rows then
 * the fired archived rows (the oracle's, or all on a dense step), the bytes at every listed slot
 * are those rows' (both planes), no slot is listed twice, and every query head's reference
 * attention over the listed rows equals the one over the oracle's rows. */
static void check_lists(rr *x, bool dense, const oview *v, const float *q, const float *best,
                        int mode, float z, const int32_t *indptr, const int32_t *indices,
                        uint64_t *fetched_rows) {
    const uint32_t H = x->H, G = x->sp.n_q_heads / H, D = x->D, rb = x->sp.row_bytes;
    const uint64_t m = v->ar_n ? v->ar_n : 1;
    const kvt__store *st = &x->ctx->stores[0];
    uint8_t *in = malloc(v->ar_n + 1);
    const size_t slot_bytes = st->slot_bytes;
    const size_t es = (size_t)x->P * rb; /* one entry's bytes: [V | K], or the MLA row */
    uint8_t *got = malloc((v->n_rows + m) * es), *want = malloc((v->n_rows + m) * es);
    int64_t *wpos = malloc(sizeof(int64_t) * (v->n_rows + m));
    cr_assert_eq(indptr[0], 0);
    for (uint32_t h = 0; h < H; h++) {
        /* the oracle's rows of head h: attended positions, then fired (or all) archived ones */
        uint64_t n = 0;
        for (uint64_t r = 0; r < v->n_rows; r++)
            wpos[n++] = v->pos[h][r];
        if (dense) {
            for (uint64_t k = 0; k < v->ar_n; k++)
                wpos[n++] = v->ar_pos[h][k];
        } else if (v->ar_n) {
            uint64_t n_in = 0;
            uint32_t *key = malloc(sizeof(uint32_t) * (v->ar_n + 1));
            if (g_capped_calib)
                o_calib_rows(x, v, q, h, in);
            else
                n_in = o_fire_keys(x, v, q, best, h, z, mode, in, key);
            /* a host archive's overflow: the g_cap_rows fired rows of the highest keys, ties to
             * the lower index (repeatedly the best not yet taken) */
            if (g_cap_rows && !g_capped_calib && n_in > g_cap_rows) {
                uint8_t *keep = calloc(v->ar_n, 1);
                for (uint32_t j = 0; j < g_cap_rows; j++) {
                    int64_t b = -1;
                    for (uint64_t k = 0; k < v->ar_n; k++)
                        if (in[k] && !keep[k] && (b < 0 || key[k] > key[b]))
                            b = (int64_t)k;
                    keep[b] = 1;
                }
                memcpy(in, keep, v->ar_n);
                free(keep);
            }
            free(key);
            for (uint64_t k = 0; k < v->ar_n; k++)
                if (in[k])
                    wpos[n++] = v->ar_pos[h][k];
        }
        cr_assert_eq((uint64_t)(indptr[h + 1] - indptr[h]), n,
                     "seed %llu head %u: %d rows listed, the oracle has %llu",
                     (unsigned long long)x->seed, h, indptr[h + 1] - indptr[h],
                     (unsigned long long)n);
        *fetched_rows += n - v->n_rows;
        /* the listed rows' bytes, in list order, [V | K] */
        for (uint64_t e = 0; e < n; e++) {
            const int32_t slot = indices[indptr[h] + e];
            for (uint64_t e2 = 0; e2 < e; e2++)
                cr_assert_neq(indices[indptr[h] + e2], slot, "head %u lists slot %d twice", h,
                              slot);
            uint8_t *g = got + e * es;
            if (x->P == 1) {
                dev_read(x, g, st->plane[0] + (size_t)slot * slot_bytes, rb);
            } else {
                dev_read(x, g, st->plane[1] + (size_t)slot * slot_bytes + (size_t)h * rb, rb);
                dev_read(x, g + rb, st->plane[0] + (size_t)slot * slot_bytes + (size_t)h * rb,
                         rb);
            }
            cr_assert((x->P == 1 && memcmp(g, rr_row(x, 0, (uint64_t)wpos[e], h), rb) == 0) ||
                          (x->P == 2 && memcmp(g, rr_row(x, 1, (uint64_t)wpos[e], h), rb) == 0 &&
                           memcmp(g + rb, rr_row(x, 0, (uint64_t)wpos[e], h), rb) == 0),
                      "seed %llu head %u entry %llu: bytes differ from position %lld's",
                      (unsigned long long)x->seed, h, (unsigned long long)e, (long long)wpos[e]);
        }
        /* the oracle's rows sorted by position, from the shadow */
        qsort(wpos, n, sizeof *wpos, cmp_pos);
        for (uint64_t e = 0; e < n; e++) {
            cr_assert(e == 0 || wpos[e] > wpos[e - 1], "a position twice in head %u's set", h);
            if (x->P == 1) {
                memcpy(want + e * es, rr_row(x, 0, (uint64_t)wpos[e], h), rb);
            } else {
                memcpy(want + e * es, rr_row(x, 1, (uint64_t)wpos[e], h), rb);
                memcpy(want + e * es + rb, rr_row(x, 0, (uint64_t)wpos[e], h), rb);
            }
        }
        for (uint32_t g = 0; g < G; g++) {
            const float *qt = q + (size_t)(h * G + g) * x->QW;
            float out_a[128], out_b[128];
            double lse_a, lse_b;
            ref_attn(x, got, (uint32_t)n, qt, out_a, &lse_a);
            ref_attn(x, want, (uint32_t)n, qt, out_b, &lse_b);
            if (isnan(lse_b)) { /* a NaN key among the rows: both NaN */
                cr_assert(isnan(lse_a));
                continue;
            }
            cr_assert(fabs(lse_a - lse_b) <= 1e-9 * (1.0 + fabs(lse_b)), "lse %.17g vs %.17g",
                      lse_a, lse_b);
            for (uint32_t d = 0; d < D; d++)
                cr_assert(fabsf(out_a[d] - out_b[d]) <= 1e-6f * (1.0f + fabsf(out_b[d])),
                          "head %u out[%u] %g vs %g", h * G + g, d, (double)out_a[d],
                          (double)out_b[d]);
        }
    }
    free(in);
    free(got);
    free(want);
    free(wpos);
}

/* Run the emission after a trigger step and check it: per KV head, the listed rows are exactly the
 * attended rows then the fired archived rows (the oracle's, or all on a dense step), the bytes at
 * every listed slot are those rows' (both planes), no slot is listed twice, and every query
 * head's reference attention over the listed rows equals the one over the oracle's rows. */
static void emit_and_check(rr *x, trig *t, const trig_out *o, const oview *v, const float *q,
                           const float *best, int mode, float z, uint64_t *fetched_rows) {
    const kvt__backend *be = be_of(x);
    const uint32_t H = x->H, rb = x->sp.row_bytes;
    const uint64_t m = v->ar_n ? v->ar_n : 1;
    fetch_area f;
    fetch_take(x, (uint32_t)m, &f);
    kvt__rope_view view;
    cr_assert_eq(kvt__seq_rope_recall_view(x->seq, 0, &view), KVT_OK, "%s", kvt_last_error());
    const uint64_t cap_idx = (uint64_t)H * (view.n_rows + view.ar_n);
    cr_assert_leq(view.n_rows + view.ar_n, x->n_tok, "within what kvt_batch_capacity promises");
    void *ind = NULL, *ptr = NULL;
    cr_assert_eq(be->ops->buf_alloc(be, sizeof(int32_t) * cap_idx, &ind), KVT_OK);
    cr_assert_eq(be->ops->buf_alloc(be, sizeof(int32_t) * (H + 1), &ptr), KVT_OK);
    const kvt__store *st = &x->ctx->stores[0];
    kvt__recall_rope_emit_args ea = {
        .plane = {st->plane[0], st->plane[1]}, .n_planes = 2, .slot_stride = st->slot_bytes,
        .row_bytes = rb,
        .n_kv = H, .pages = view.pages, .first_page = view.first_page, .pdiv = view.pdiv,
        .n_rows = view.n_rows, .ar_bytes = view.ar_bytes, .ar_cap = view.ar_cap,
        .ar_n = view.ar_n, .fired = t->rl.fired, .n_fired = t->rl.n_fired, .cap = t->rl.cap,
        .st = t->rl.base.st, .fetch_pages = f.pages_dev, .fetch_cap = f.n, .indices = ind,
        .capacity = cap_idx, .indptr = ptr, .out = 0};
    kvt__recall_rope_emit_args bad = ea;
    bad.capacity = cap_idx - 1;
    cr_assert_eq(os_rope_emit(be, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(os_rope_emit(be, &ea, 1, NULL), KVT_OK);
    int32_t *indptr = malloc(sizeof(int32_t) * (H + 1));
    int32_t *indices = malloc(sizeof(int32_t) * (cap_idx + 1));
    dev_read(x, indptr, ptr, sizeof(int32_t) * (H + 1));
    dev_read(x, indices, ind, sizeof(int32_t) * cap_idx);
    check_lists(x, o->st.last_dense != 0, v, q, best, mode, z, indptr, indices, fetched_rows);
    free(indptr);
    free(indices);
    be->ops->buf_free(be, ind, sizeof(int32_t) * cap_idx);
    be->ops->buf_free(be, ptr, sizeof(int32_t) * (H + 1));
    fetch_give(x, &f);
}

/* Conformal decode with the emission after every step (calibration steps list the whole archive,
 * later ones the fired rows), then sound and an overflow, on the CPU and guarded backends; the
 * reference attention over exactly the listed rows is the oracle set's. */
static void emission_run(kvt_backend_kind backend, uint64_t seed) {
    rr x;
    trig_model(&x, backend, seed);
    trig t;
    trig_init(&t, &x, 64);
    trig_out o;
    memset(&o, 0, sizeof o);
    float q[TR_MAXQ * 256], best[TR_MAXQ];
    uint64_t fetched = 0, dense_steps = 0, steps = 0;
    for (int step = 0; step < 24; step++) {
        rr_step(&x, 1, step % 2 == 1);
        oview v;
        oview_read(&x, &v);
        uint32_t aimed;
        make_queries(&x, &v, q, &aimed);
        const kvt_recall_mode mode = step < 20 ? KVT_RECALL_CONFORMAL : KVT_RECALL_SOUND;
        trig_run(&t, &x, q, mode, 0.0f, &o);
        o_best(&x, &v, q, best);
        const float z = mode == KVT_RECALL_SOUND ? sqrtf((float)(x.D - 64)) : o.st.z;
        emit_and_check(&x, &t, &o, &v, q, best, (int)mode, z, &fetched);
        dense_steps += o.st.last_dense;
        steps++;
        oview_free(&v);
    }
    cr_assert_gt(dense_steps, 0u, "calibration or overflow steps were emitted");
    cr_assert_lt(dense_steps, steps, "fetching steps were emitted");
    cr_log_info("emission (seed %llu): %llu steps, %llu dense, %llu fetched rows listed",
                (unsigned long long)seed, (unsigned long long)steps,
                (unsigned long long)dense_steps, (unsigned long long)fetched);
    trig_out_free(&o);
    trig_fini(&t, &x);
    rr_fini(&x);
}

Test(rope_emit, listed_rows_equal_the_oracle_cpu, .timeout = 240) {
    emission_run(KVT_BACKEND_CPU, 515);
}

Test(rope_emit, listed_rows_equal_the_oracle_guarded, .timeout = 240) {
    emission_run(KVT_BACKEND_GUARDED, 515);
}

/* ---- (3) End to end: kvt_batch_run on a RoPE layer with recall --------------------------------- */

/* A decode step through the public step API: reserve one token, write it, plan, run the layer
 * with the queries and a KVT_EMIT_CSR_KV_HEADS emission, commit, kvt_seq_check. The lists and
 * the dense flag come back in indptr/indices/dense. */
typedef struct e2e {
    kvt_batch *b;
    kvt_buffer *qbuf, *ibuf, *pbuf, *dbuf;
    uint32_t cap_idx;
} e2e;

static void e2e_init(e2e *e, rr *x, uint32_t max_rows) {
    memset(e, 0, sizeof *e);
    cr_assert_eq(kvt_batch_create(x->ctx, 1, &e->b), KVT_OK);
    e->cap_idx = x->H * max_rows;
    cr_assert_eq(kvt_buffer_alloc(x->ctx, sizeof(float) * x->sp.n_q_heads * x->QW, &e->qbuf),
                 KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(x->ctx, sizeof(int32_t) * e->cap_idx, &e->ibuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(x->ctx, sizeof(int32_t) * (x->H + 1), &e->pbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(x->ctx, 1, &e->dbuf), KVT_OK);
}

static void e2e_fini(e2e *e) {
    kvt_batch_destroy(e->b);
    kvt_buffer_free(e->qbuf);
    kvt_buffer_free(e->ibuf);
    kvt_buffer_free(e->pbuf);
    kvt_buffer_free(e->dbuf);
}

static kvt_status e2e_step(e2e *e, rr *x, const float *q, kvt_emit_layout layout,
                           int32_t *indptr, int32_t *indices, uint8_t *dense) {
    uint32_t one = 1;
    cr_assert_eq(kvt_batch_reserve(e->b, &x->seq, &one, 1), KVT_OK, "%s", kvt_last_error());
    rr_write(x, 1);
    cr_assert_eq(kvt_buffer_write(e->qbuf, 0, q, sizeof(float) * x->sp.n_q_heads * x->QW), KVT_OK);
    uint32_t topk, total;
    cr_assert_eq(kvt_batch_plan(e->b), KVT_OK);
    cr_assert_eq(kvt_batch_capacity(e->b, 0, &topk, &total), KVT_OK);
    cr_assert_leq((uint64_t)x->H * total, e->cap_idx);
    kvt_emit em = {.struct_size = sizeof em, .layout = layout,
                   .indices = kvt_buffer_ptr(e->ibuf), .capacity = x->H * total,
                   .indptr = kvt_buffer_ptr(e->pbuf), .dense = kvt_buffer_ptr(e->dbuf),
                   .queries_per_seq = 1};
    kvt_status s = kvt_batch_run(e->b, 0, kvt_buffer_ptr(e->qbuf), NULL, &em);
    cr_assert_eq(kvt_batch_commit(e->b, NULL), KVT_OK, "%s", kvt_last_error());
    x->n_tok += 1;
    cr_assert_eq(kvt_seq_check(x->seq), KVT_OK, "seed %llu after %llu tokens: %s",
                 (unsigned long long)x->seed, (unsigned long long)x->n_tok, kvt_last_error());
    if (s == KVT_OK) {
        cr_assert_eq(kvt_buffer_read(e->pbuf, 0, indptr, sizeof(int32_t) * (x->H + 1)), KVT_OK);
        cr_assert_eq(kvt_buffer_read(e->ibuf, 0, indices, sizeof(int32_t) * e->cap_idx), KVT_OK);
        cr_assert_eq(kvt_buffer_read(e->dbuf, 0, dense, 1), KVT_OK);
    }
    return s;
}

/* After a conformal decode step through kvt_batch_run (dense flag and the lists read back as
 * indptr/indices): the committed state's oracle — while calibrating, a whole-archive list and z
 * as the oracle's calibration; then the lists of check_lists. Counts into the tallies. */
typedef struct e2e_tally {
    bool calibrating;
    uint64_t fetched, dense_steps, archived_steps;
} e2e_tally;

static void e2e_check(rr *x, trig *t, const float *q, uint8_t dense, const int32_t *indptr,
                      const int32_t *indices, int step, e2e_tally *y) {
    float best[TR_MAXQ];
    oview v; /* the state the run saw: the committed one (its round ran in the step) */
    oview_read(x, &v);
    o_best(x, &v, q, best);
    kvt_layer_stats ls = rr_stats(x);
    /* the request is the pool's only holder: the pages in use are its table's and its fetch
     * area's, and the statistics count both */
    uint32_t free_pages = 0;
    cr_assert_eq(kvt_ctx_free_pages(x->ctx, 0, &free_pages), KVT_OK);
    cr_assert_eq(ls.pages_in_use, (uint64_t)x->n_pages - free_pages,
                 "step %d: pages_in_use %llu, pool pages taken %u", step,
                 (unsigned long long)ls.pages_in_use, x->n_pages - free_pages);
    if (v.ar_n == 0) {
        cr_assert_eq(dense, 0);
    } else if (y->calibrating) {
        cr_assert_eq(dense, 1, "step %d: a calibration step lists the whole archive", step);
        y->calibrating = o_calibrate(t, x, &v, q, best);
        cr_assert_eq(ls.recall_z, t->conf.z, "step %d: z %g, oracle %g", step,
                     (double)ls.recall_z, (double)t->conf.z);
    }
    y->dense_steps += dense;
    y->archived_steps += v.ar_n > 0;
    check_lists(x, dense != 0, &v, q, best, KVT__RECALL_CONFORMAL, t->conf.z, indptr, indices,
                &y->fetched);
    cr_assert_eq(ls.recall_mode, (int32_t)KVT_RECALL_CONFORMAL);
    oview_free(&v);
}

/* Preemption mid-request: the request is snapshotted (its RECALL section: the RoPE trigger's
 * calibration and counters), destroyed and restored; the restored one has the same trigger state
 * and archive, and the oracle then follows it as it followed the original. */
static void snapshot_swap(rr *x) {
    kvt_layer_stats a = rr_stats(x);
    size_t bytes = 0, wrote = 0;
    cr_assert_eq(kvt_seq_snapshot_size(x->seq, &bytes), KVT_OK, "%s", kvt_last_error());
    void *buf = malloc(bytes);
    cr_assert_eq(kvt_seq_snapshot(x->seq, buf, bytes, &wrote), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(x->seq);
    x->seq = NULL;
    cr_assert_eq(kvt_seq_restore(x->ctx, buf, wrote, &x->seq), KVT_OK, "%s", kvt_last_error());
    free(buf);
    cr_assert_eq(kvt_seq_check(x->seq), KVT_OK, "%s", kvt_last_error());
    cr_assert(kvt__seq_recalls_rope(x->seq, 0), "the restored request recalls on the layer");
    kvt_layer_stats b = rr_stats(x);
    cr_assert_eq(b.recall_mode, a.recall_mode);
    cr_assert_eq(b.recall_phase, a.recall_phase);
    cr_assert(memcmp(&b.recall_z, &a.recall_z, sizeof a.recall_z) == 0);
    cr_assert_eq(b.recall_samples, a.recall_samples);
    cr_assert_eq(b.recall_steps, a.recall_steps);
    cr_assert_eq(b.recall_calib_steps, a.recall_calib_steps);
    cr_assert_eq(b.recall_fetched_rows, a.recall_fetched_rows);
    cr_assert_eq(b.archived_rows, a.archived_rows);
    cr_assert_eq(b.sketched_rows, a.sketched_rows);
    cr_assert_eq(b.attended_rows, a.attended_rows);
}

/* Conformal decode through kvt_batch_run: every step's per-KV-head lists are the oracle's
 * (calibration steps: every archived row; then the fired ones), with the right bytes and the
 * reference attention of the oracle set; z as the oracle's calibration; statistics, fork (the
 * child continues), a snapshot and restore at step 60 (the oracle follows the restored request),
 * another layout refused. */
/* clustered: keys in clusters (g_clustered), archive blocks of 256 rows and 800 rows prefilled,
 * so that the request's steps take the pruned scan and skip groups (docs/recall.md §9.8). */
static void e2e_run_with(kvt_backend_kind backend, uint64_t seed, bool clustered) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_CONFORMAL;
    cfg.recall_cap_rows = clustered ? 512 : 64; /* a cluster fires whole: ~220 rows a head */
    if (clustered)
        cfg.block_rows = 256;
    const uint32_t rank[2] = {32, clustered ? 32 : 16};
    g_clustered = clustered;
    rr x;
    rr_init(&x, 2, 128, cfg, 32, rank, backend, seed);
    cr_assert(kvt__seq_recalls_rope(x.seq, 0), "the request recalls on the RoPE layer");
    cr_assert_eq(kvt_seq_set_prompt_rows(x.seq, 4), KVT_OK);
    if (clustered) {
        rr_step(&x, 4, false);
        for (int i = 0; i < 16; i++)
            rr_step(&x, 50, false);
    }
    uint64_t sum_archived = 0, sum_visited = 0;
    e2e e;
    e2e_init(&e, &x, 1024);
    trig t; /* the oracle's calibration only */
    memset(&t, 0, sizeof t);
    t.nq = x.sp.n_q_heads;
    kvt__conformal_init(&t.conf, t.conf_samples, 64 * t.nq);
    float q[TR_MAXQ * 256];
    int32_t indptr[RR_MAXH + 1];
    int32_t *indices = malloc(sizeof(int32_t) * e.cap_idx);
    uint8_t dense = 0;
    e2e_tally y = {.calibrating = true};
    for (int step = 0; step < 100; step++) {
        if (step == 60)
            snapshot_swap(&x);
        aimed_queries(&x, q); /* at rows archived before this step */
        cr_assert_eq(e2e_step(&e, &x, q, KVT_EMIT_CSR_KV_HEADS, indptr, indices, &dense), KVT_OK,
                     "seed %llu step %d: %s", (unsigned long long)seed, step, kvt_last_error());
        e2e_check(&x, &t, q, dense, indptr, indices, step, &y);
        kvt_layer_stats st = rr_stats(&x);
        if (!dense) {
            sum_archived += st.recall_last_archived;
            sum_visited += st.recall_last_visited;
        }
    }
    cr_assert(!y.calibrating);
    cr_assert_gt(y.archived_steps, y.dense_steps, "fetching steps ran");
    if (clustered)
        cr_assert_lt(sum_visited * 4, sum_archived * 3, "the pruned scan visited %llu of %llu "
                     "archived (row, KV head) pairs on steps that were not dense",
                     (unsigned long long)sum_visited, (unsigned long long)sum_archived);
    cr_log_info("end to end (seed %llu, %s keys): the scans visited %llu of %llu archived (row, "
                "KV head) pairs on steps that were not dense", (unsigned long long)seed,
                clustered ? "clustered" : "spread", (unsigned long long)sum_visited,
                (unsigned long long)sum_archived);
    const uint64_t fetched = y.fetched, dense_steps = y.dense_steps,
                   archived_steps = y.archived_steps;
    kvt_layer_stats ls = rr_stats(&x);
    cr_assert_eq(ls.recall_calib_steps, 8u);
    cr_log_info("end to end (seed %llu): z %g, %llu steps, %llu dense, %llu fetched (row, KV "
                "head) pairs listed; stats: fetched %llu of %llu steps",
                (unsigned long long)seed, (double)ls.recall_z, (unsigned long long)archived_steps,
                (unsigned long long)dense_steps, (unsigned long long)fetched,
                (unsigned long long)ls.recall_fetched_rows, (unsigned long long)ls.recall_steps);
    /* another layout on a layer where the request recalls: refused before any work */
    uint32_t one = 1;
    cr_assert_eq(kvt_batch_reserve(e.b, &x.seq, &one, 1), KVT_OK);
    rr_write(&x, 1);
    cr_assert_eq(kvt_batch_plan(e.b), KVT_OK);
    int32_t len;
    kvt_emit bad = {.struct_size = sizeof bad, .layout = KVT_EMIT_TOKENS,
                    .indices = kvt_buffer_ptr(e.ibuf), .capacity = 128,
                    .lengths = kvt_buffer_ptr(e.pbuf)};
    (void)len;
    cr_assert_eq(kvt_batch_run(e.b, 0, kvt_buffer_ptr(e.qbuf), NULL, &bad),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "KVT_EMIT_CSR_KV_HEADS") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_commit(e.b, NULL), KVT_OK);
    x.n_tok++;
    cr_assert_eq(kvt_seq_check(x.seq), KVT_OK, "%s", kvt_last_error());
    /* a fork continues the calibration */
    kvt_seq *child = NULL;
    cr_assert_eq(kvt_seq_fork(x.seq, 99, &child), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats lc;
    memset(&lc, 0, sizeof lc);
    lc.struct_size = sizeof lc;
    cr_assert_eq(kvt_seq_layer_stats(child, 0, &lc), KVT_OK);
    cr_assert_eq(lc.recall_z, ls.recall_z);
    cr_assert_eq(lc.recall_phase, ls.recall_phase);
    cr_assert_eq(kvt_seq_check(child), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(child);
    free(indices);
    e2e_fini(&e);
    rr_fini(&x);
    g_clustered = false;
}

static void e2e_run(kvt_backend_kind backend, uint64_t seed) {
    e2e_run_with(backend, seed, false);
}

Test(rope_e2e, pruned_scan_lists_equal_the_oracle_cpu, .timeout = 240) {
    e2e_run_with(KVT_BACKEND_CPU, 818, true);
}

Test(rope_e2e, pruned_scan_lists_equal_the_oracle_guarded, .timeout = 240) {
    e2e_run_with(KVT_BACKEND_GUARDED, 828, true);
}

Test(rope_e2e, batch_run_lists_equal_the_oracle_cpu, .timeout = 240) {
    e2e_run(KVT_BACKEND_CPU, 808);
}

Test(rope_e2e, batch_run_lists_equal_the_oracle_guarded, .timeout = 240) {
    e2e_run(KVT_BACKEND_GUARDED, 808);
}

/* The fetch area in the pool: a reserve that cannot take it is KVT_ERR_POOL_EXHAUSTED with
 * nothing reserved (the pool's free pages unchanged); a parked request slot gives its fetch pages
 * back, and the slot serves a request without recall as before. */
Test(rope_e2e, fetch_area_pool_and_slots) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_SOUND;
    cfg.recall_cap_rows = 64;
    const uint32_t rank[2] = {32, 16};
    /* 10 pages of 16 rows: the table needs at most 4 (56 rows), the fetch area the rest */
    g_n_pages = 10;
    rr x;
    rr_init(&x, 2, 128, cfg, 32, rank, KVT_BACKEND_CPU, 21);
    g_n_pages = 0;
    e2e e;
    e2e_init(&e, &x, 256);
    float q[TR_MAXQ * 256];
    int32_t indptr[RR_MAXH + 1];
    int32_t *indices = malloc(sizeof(int32_t) * e.cap_idx);
    uint8_t dense;
    kvt_status s = KVT_OK;
    uint32_t free_before = 0, free_after = 0;
    for (int step = 0; step < 200 && s == KVT_OK; step++) {
        oview v;
        oview_read(&x, &v);
        uint32_t aimed;
        make_queries(&x, &v, q, &aimed);
        oview_free(&v);
        cr_assert_eq(kvt_ctx_free_pages(x.ctx, 0, &free_before), KVT_OK);
        uint32_t one = 1;
        s = kvt_batch_reserve(e.b, &x.seq, &one, 1);
        if (s != KVT_OK)
            break;
        kvt_batch_destroy(e.b); /* give the reservation back: the next call reserves anew */
        cr_assert_eq(kvt_batch_create(x.ctx, 1, &e.b), KVT_OK);
        cr_assert_eq(e2e_step(&e, &x, q, KVT_EMIT_CSR_KV_HEADS, indptr, indices, &dense),
                     KVT_OK, "step %d: %s", step, kvt_last_error());
    }
    cr_assert_eq(s, KVT_ERR_POOL_EXHAUSTED, "the fetch area outgrew the pool (%s)",
                 kvt_status_name(s));
    cr_assert(strstr(kvt_last_error(), "fetch") != NULL || strstr(kvt_last_error(), "pages"),
              "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_free_pages(x.ctx, 0, &free_after), KVT_OK);
    cr_assert_eq(free_after, free_before, "nothing reserved");
    cr_assert_eq(kvt_seq_check(x.seq), KVT_OK, "%s", kvt_last_error());
    free(indices);
    e2e_fini(&e);
    rr_fini(&x);

    /* request slots (max_seqs with max_rows): parking gives the fetch pages back */
    g_max_seqs = 2;
    g_max_rows = 512;
    rr_init(&x, 2, 128, cfg, 32, rank, KVT_BACKEND_GUARDED, 22);
    g_max_seqs = g_max_rows = 0;
    uint32_t all_free;
    e2e_init(&e, &x, 512);
    indices = malloc(sizeof(int32_t) * e.cap_idx);
    cr_assert_eq(kvt_ctx_free_pages(x.ctx, 0, &all_free), KVT_OK);
    all_free += x.seq->pt[0].n_pages; /* none yet: created, nothing reserved */
    for (int step = 0; step < 80; step++) {
        oview v;
        oview_read(&x, &v);
        uint32_t aimed;
        make_queries(&x, &v, q, &aimed);
        oview_free(&v);
        cr_assert_eq(e2e_step(&e, &x, q, KVT_EMIT_CSR_KV_HEADS, indptr, indices, &dense),
                     KVT_OK, "step %d: %s", step, kvt_last_error());
    }
    cr_assert_gt(x.seq->fetch[0].n_pages, 0u);
    kvt_batch_destroy(e.b);
    e.b = NULL;
    kvt_seq_destroy(x.seq); /* parked */
    uint32_t now_free;
    cr_assert_eq(kvt_ctx_free_pages(x.ctx, 0, &now_free), KVT_OK);
    cr_assert_eq(now_free, all_free, "every page back, the fetch area's too");
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 5;
    sp.recall = KVT_RECALL_OFF;
    cr_assert_eq(kvt_seq_create(x.ctx, &sp, &x.seq), KVT_OK, "%s", kvt_last_error());
    cr_assert(!kvt__seq_recalls_rope(x.seq, 0));
    x.n_tok = 0;
    for (int step = 0; step < 70; step++)
        rr_step(&x, 1, step % 2 == 0); /* plain random eviction through the usual layouts */
    free(indices);
    e2e_fini(&e);
    rr_fini(&x);
}

/* A batch of two requests, one recalling on the RoPE layer and one not, emitted together with
 * KVT_EMIT_CSR_KV_HEADS in both orders: the recalling one's lists are the oracle's, the other's
 * n_kv lists are each its attended rows (the table's slots); the offsets chain across both. */
Test(rope_e2e, mixed_batch_chains_the_lists, .timeout = 240) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_CONFORMAL;
    cfg.recall_cap_rows = 64;
    const uint32_t rank[2] = {32, 16};
    rr x; /* x.seq recalls; y shares x's context and rows generator but not its recall */
    rr_init(&x, 2, 128, cfg, 32, rank, KVT_BACKEND_GUARDED, 909);
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 77;
    sp.recall = KVT_RECALL_OFF;
    kvt_seq *other = NULL;
    cr_assert_eq(kvt_seq_create(x.ctx, &sp, &other), KVT_OK, "%s", kvt_last_error());
    cr_assert(!kvt__seq_recalls_rope(other, 0));
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(x.ctx, 2, &b), KVT_OK);
    const uint32_t H = x.H, D = x.D, nq = x.sp.n_q_heads;
    const uint32_t cap = 2 * H * 256;
    kvt_buffer *qbuf, *ibuf, *pbuf;
    cr_assert_eq(kvt_buffer_alloc(x.ctx, sizeof(float) * 2 * nq * D, &qbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(x.ctx, sizeof(int32_t) * cap, &ibuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(x.ctx, sizeof(int32_t) * (2 * H + 1), &pbuf), KVT_OK);
    int32_t *indices = malloc(sizeof(int32_t) * cap), indptr[2 * RR_MAXH + 1];
    float q[2 * TR_MAXQ * 256], best[TR_MAXQ];
    trig t;
    memset(&t, 0, sizeof t);
    kvt__conformal_init(&t.conf, t.conf_samples, 64 * nq);
    uint8_t *other_rows = malloc((size_t)2 * H * x.sp.row_bytes);
    uint64_t other_n = 0, fetched = 0;
    bool calibrating = true;
    for (int step = 0; step < 90; step++) {
        const bool recall_first = step % 2 == 0;
        kvt_seq *seqs[2] = {recall_first ? x.seq : other, recall_first ? other : x.seq};
        const uint32_t ri = recall_first ? 0 : 1; /* the recalling request's place */
        uint32_t ones[2] = {1, 1};
        cr_assert_eq(kvt_batch_reserve(b, seqs, ones, 2), KVT_OK, "%s", kvt_last_error());
        rr_write(&x, 1);
        for (uint32_t p = 0; p < 2; p++) { /* the other request's row: any finite bytes */
            for (uint32_t k = 0; k < H * x.sp.row_bytes / 2; k++) {
                uint16_t v = kvt__f32_to_bf16((float)tu_normal(&x.rng));
                memcpy(other_rows + p * H * x.sp.row_bytes + 2 * k, &v, 2);
            }
            cr_assert_eq(kvt_seq_write(other, 0, p, 0, 1, other_rows + p * H * x.sp.row_bytes,
                                       H * x.sp.row_bytes),
                         KVT_OK);
        }
        oview v0;
        oview_read(&x, &v0);
        uint32_t aimed;
        make_queries(&x, &v0, q + (size_t)ri * nq * D, &aimed);
        oview_free(&v0);
        cr_assert_eq(kvt_buffer_write(qbuf, 0, q, sizeof(float) * 2 * nq * D), KVT_OK);
        cr_assert_eq(kvt_batch_plan(b), KVT_OK);
        uint32_t topk, total;
        cr_assert_eq(kvt_batch_capacity(b, 0, &topk, &total), KVT_OK);
        cr_assert_leq(H * total, cap);
        kvt_emit em = {.struct_size = sizeof em, .layout = KVT_EMIT_CSR_KV_HEADS,
                       .indices = kvt_buffer_ptr(ibuf), .capacity = H * total,
                       .indptr = kvt_buffer_ptr(pbuf), .queries_per_seq = 1};
        cr_assert_eq(kvt_batch_run(b, 0, kvt_buffer_ptr(qbuf), NULL, &em), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
        x.n_tok++;
        other_n++;
        cr_assert_eq(kvt_seq_check(x.seq), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_check(other), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_buffer_read(pbuf, 0, indptr, sizeof(int32_t) * (2 * H + 1)), KVT_OK);
        cr_assert_eq(kvt_buffer_read(ibuf, 0, indices, sizeof(int32_t) * cap), KVT_OK);
        cr_assert_eq(indptr[0], 0);
        /* the recalling request: its lists against the oracle (offsets rebased) */
        oview v;
        oview_read(&x, &v);
        const float *qx = q + (size_t)ri * nq * D;
        o_best(&x, &v, qx, best);
        kvt__recall_state rs;
        dev_read(&x, &rs, x.seq->rrope[0].base.st, sizeof rs);
        if (v.ar_n && calibrating)
            calibrating = o_calibrate(&t, &x, &v, qx, best);
        int32_t local[RR_MAXH + 1];
        for (uint32_t h = 0; h <= H; h++)
            local[h] = indptr[ri * H + h] - indptr[ri * H];
        check_lists(&x, rs.last_dense != 0, &v, qx, best, KVT__RECALL_CONFORMAL, t.conf.z, local,
                    indices + indptr[ri * H], &fetched);
        oview_free(&v);
        /* the other request: every head lists its table's rows [0, n_rows) in order */
        int32_t pages[64];
        uint32_t n_pages;
        uint64_t n_rows;
        cr_assert_eq(kvt_seq_block_table(other, 0, pages, 64, &n_pages, &n_rows), KVT_OK);
        const uint32_t oi = 1 - ri;
        for (uint32_t h = 0; h < H; h++) {
            const int32_t *l = indices + indptr[oi * H + h];
            cr_assert_eq((uint64_t)(indptr[oi * H + h + 1] - indptr[oi * H + h]), n_rows,
                         "step %d head %u", step, h);
            for (uint64_t r = 0; r < n_rows; r++)
                cr_assert_eq(l[r], pages[r / 16] * 16 + (int32_t)(r % 16));
        }
    }
    cr_assert(!calibrating);
    cr_assert_gt(fetched, 0u);
    cr_assert_gt(other_n, 60u);
    free(indices);
    free(other_rows);
    kvt_batch_destroy(b);
    kvt_buffer_free(qbuf);
    kvt_buffer_free(ibuf);
    kvt_buffer_free(pbuf);
    kvt_seq_destroy(other);
    rr_fini(&x);
}

/* KVT_EMIT_CSR_KV_HEADS on a layer without recall and with more KV heads than one pack call
 * takes (80): every head lists the table's rows, in order, offsets chained. */
Test(rope_e2e, kv_heads_layout_many_heads) {
    const uint32_t H = 80, D = 16;
    kvt_layer_spec sp;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, H, D, &sp), KVT_OK);
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_create(&sp, 1, "heads", &m, NULL, 0), KVT_OK);
    kvt_config cfg = rr_cfg(16, 4, 8);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.config = &cfg;
    p.model = m;
    p.page_rows = 16;
    p.n_pages = 16;
    kvt_ctx *ctx = NULL;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_seq *seq = NULL;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, 1, &b), KVT_OK);
    const size_t slot = (size_t)H * sp.row_bytes;
    uint8_t *row = calloc(1, slot);
    int32_t *idx = malloc(sizeof(int32_t) * H * 64), ptr[81];
    for (int step = 0; step < 40; step++) {
        uint32_t one = 1;
        cr_assert_eq(kvt_batch_reserve(b, &seq, &one, 1), KVT_OK);
        for (uint32_t pl = 0; pl < 2; pl++)
            cr_assert_eq(kvt_seq_write(seq, 0, pl, 0, 1, row, slot), KVT_OK);
        cr_assert_eq(kvt_batch_plan(b), KVT_OK);
        uint32_t topk, total;
        cr_assert_eq(kvt_batch_capacity(b, 0, &topk, &total), KVT_OK);
        kvt_emit em = {.struct_size = sizeof em, .layout = KVT_EMIT_CSR_KV_HEADS, .indices = idx,
                       .capacity = H * total, .indptr = ptr, .queries_per_seq = 1};
        cr_assert_eq(kvt_batch_run(b, 0, NULL, NULL, &em), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK);
        cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
        int32_t pages[16];
        uint32_t n_pages;
        uint64_t n_rows;
        cr_assert_eq(kvt_seq_block_table(seq, 0, pages, 16, &n_pages, &n_rows), KVT_OK);
        cr_assert_eq(ptr[0], 0);
        for (uint32_t h = 0; h < H; h++) {
            cr_assert_eq((uint64_t)(ptr[h + 1] - ptr[h]), n_rows, "step %d head %u", step, h);
            for (uint64_t r = 0; r < n_rows; r++)
                cr_assert_eq(idx[ptr[h] + r], pages[r / 16] * 16 + (int32_t)(r % 16));
        }
    }
    free(row);
    free(idx);
    kvt_batch_destroy(b);
    kvt_seq_destroy(seq);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* ---- review probes (not for commit) ---- */
static kvt_status rv_step(e2e *e, rr *x, const float *q) {
    uint32_t one = 1;
    kvt_status s = kvt_batch_reserve(e->b, &x->seq, &one, 1);
    if (s != KVT_OK)
        return s;
    rr_write(x, 1);
    cr_assert_eq(kvt_buffer_write(e->qbuf, 0, q, sizeof(float) * x->sp.n_q_heads * x->QW), KVT_OK);
    uint32_t topk, total;
    cr_assert_eq(kvt_batch_plan(e->b), KVT_OK);
    cr_assert_eq(kvt_batch_capacity(e->b, 0, &topk, &total), KVT_OK);
    kvt_emit em = {.struct_size = sizeof em, .layout = KVT_EMIT_CSR_KV_HEADS,
                   .indices = kvt_buffer_ptr(e->ibuf), .capacity = x->H * total,
                   .indptr = kvt_buffer_ptr(e->pbuf), .dense = kvt_buffer_ptr(e->dbuf),
                   .queries_per_seq = 1};
    s = kvt_batch_run(e->b, 0, kvt_buffer_ptr(e->qbuf), NULL, &em);
    cr_assert_eq(kvt_batch_commit(e->b, NULL), KVT_OK, "%s", kvt_last_error());
    x->n_tok += 1;
    return s;
}

static void rv_query(rr *x, float *q) {
    oview v;
    oview_read(x, &v);
    uint32_t aimed;
    make_queries(x, &v, q, &aimed);
    oview_free(&v);
}

/* kvt_seq_pages_needed counts exactly the pages a reserve takes, the fetch area's among them
 * (admission control: neither fewer, which would fail a reserve it admitted, nor more, which
 * would refuse a request that fits; with a host archive the fetch area holds at most W rows). */
static void pages_needed_run(bool host) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_SOUND;
    cfg.recall_cap_rows = 64;
    const uint32_t rank[2] = {32, 16};
    rr x;
    g_archive_host = host;
    rr_init(&x, 2, 128, cfg, 32, rank, KVT_BACKEND_CPU, 31);
    g_archive_host = false;
    e2e e;
    e2e_init(&e, &x, 512);
    float q[TR_MAXQ * 256];
    int bad = 0;
    for (int step = 0; step < 200; step++) {
        rv_query(&x, q);
        uint32_t need, f0, f1;
        cr_assert_eq(kvt_seq_pages_needed(x.seq, 1, &need), KVT_OK);
        cr_assert_eq(kvt_ctx_free_pages(x.ctx, 0, &f0), KVT_OK);
        uint32_t one = 1;
        cr_assert_eq(kvt_batch_reserve(e.b, &x.seq, &one, 1), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_ctx_free_pages(x.ctx, 0, &f1), KVT_OK);
        if (f0 - f1 != need && !bad++)
            cr_log_error("step %d: pages_needed said %u, the reserve took %u (fetch area %u pages)",
                         step, need, f0 - f1, x.seq->fetch[0].n_pages);
        if (host)
            cr_assert_leq(x.seq->fetch[0].n_pages, (cfg.recall_cap_rows + 15) / 16,
                          "step %d: a host archive's fetch area holds at most W rows", step);
        kvt_batch_destroy(e.b);
        cr_assert_eq(kvt_batch_create(x.ctx, 1, &e.b), KVT_OK);
        cr_assert_eq(rv_step(&e, &x, q), KVT_OK, "%s", kvt_last_error());
    }
    cr_assert_eq(bad, 0, "%d steps took other than the pages kvt_seq_pages_needed said", bad);
    e2e_fini(&e);
    rr_fini(&x);
}

Test(rope_recall_more, pages_needed_counts_the_fetch_area) {
    pages_needed_run(false);
}

Test(rope_recall_more, pages_needed_counts_a_host_archive_fetch_area) {
    pages_needed_run(true);
}



/* Review D: fork (and attach) of a RoPE-recalling request, both stepped in one batch. */
static void rv_fork_steps(kvt_backend_kind backend, bool attach) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_SOUND;
    cfg.recall_cap_rows = 64;
    const uint32_t rank[2] = {32, 16};
    rr x;
    rr_init(&x, 2, 128, cfg, 32, rank, backend, 41);
    cr_assert_eq(kvt_seq_set_prompt_rows(x.seq, 48), KVT_OK);
    e2e e;
    e2e_init(&e, &x, 512);
    float q[TR_MAXQ * 256];
    for (int step = 0; step < 80; step++) {
        rv_query(&x, q);
        cr_assert_eq(rv_step(&e, &x, q), KVT_OK, "%s", kvt_last_error());
    }
    kvt_seq *child = NULL;
    kvt_status fs = attach ? kvt_seq_attach(x.seq, 16, 99, &child) : kvt_seq_fork(x.seq, 99, &child);
    cr_assert_eq(fs, KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(child), KVT_OK, "%s", kvt_last_error());
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(x.ctx, 2, &b), KVT_OK);
    const uint32_t cap = 2 * x.H * 1024;
    kvt_buffer *ib, *pb, *db, *qb;
    cr_assert_eq(kvt_buffer_alloc(x.ctx, sizeof(int32_t) * cap, &ib), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(x.ctx, sizeof(int32_t) * (2 * x.H + 1), &pb), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(x.ctx, 2, &db), KVT_OK);
    const size_t qn = (size_t)x.sp.n_q_heads * x.QW;
    cr_assert_eq(kvt_buffer_alloc(x.ctx, sizeof(float) * 2 * qn, &qb), KVT_OK);
    for (int step = 0; step < 60; step++) {
        rv_query(&x, q);
        kvt_seq *two[2] = {x.seq, child};
        uint32_t n[2] = {1, 1};
        cr_assert_eq(kvt_batch_reserve(b, two, n, 2), KVT_OK, "step %d: %s", step, kvt_last_error());
        rr_write(&x, 1);
        const size_t slot = (size_t)x.H * x.sp.row_bytes;
        for (uint32_t p = 0; p < 2; p++)
            cr_assert_eq(kvt_seq_write(child, 0, p, 0, 1, rr_row(&x, p, x.n_tok, 0), slot), KVT_OK);
        cr_assert_eq(kvt_buffer_write(qb, 0, q, sizeof(float) * qn), KVT_OK);
        cr_assert_eq(kvt_buffer_write(qb, sizeof(float) * qn, q, sizeof(float) * qn), KVT_OK);
        cr_assert_eq(kvt_batch_plan(b), KVT_OK);
        uint32_t topk, total;
        cr_assert_eq(kvt_batch_capacity(b, 0, &topk, &total), KVT_OK);
        cr_assert_leq(x.H * total, cap);
        kvt_emit em = {.struct_size = sizeof em, .layout = KVT_EMIT_CSR_KV_HEADS,
                       .indices = kvt_buffer_ptr(ib), .capacity = x.H * total,
                       .indptr = kvt_buffer_ptr(pb), .dense = kvt_buffer_ptr(db),
                       .queries_per_seq = 1};
        cr_assert_eq(kvt_batch_run(b, 0, kvt_buffer_ptr(qb), NULL, &em), KVT_OK, "step %d: %s",
                     step, kvt_last_error());
        cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
        x.n_tok++;
        cr_assert_eq(kvt_seq_check(x.seq), KVT_OK, "step %d: %s", step, kvt_last_error());
        cr_assert_eq(kvt_seq_check(child), KVT_OK, "step %d: %s", step, kvt_last_error());
    }
    kvt_batch_destroy(b);
    kvt_seq_destroy(child);
    kvt_buffer_free(ib); kvt_buffer_free(pb); kvt_buffer_free(db); kvt_buffer_free(qb);
    e2e_fini(&e);
    rr_fini(&x);
}
Test(rope_recall_more, rope_fork_steps_cpu) { rv_fork_steps(KVT_BACKEND_CPU, false); }
Test(rope_recall_more, rope_fork_steps_guarded) { rv_fork_steps(KVT_BACKEND_GUARDED, false); }
Test(rope_recall_more, rope_attach_steps_guarded) { rv_fork_steps(KVT_BACKEND_GUARDED, true); }

/* ---- MLA-RoPE: one latent head, its rotated branch scored exactly ------------------------------ */

/* The trigger on an MLA-RoPE layer (kv_lora_rank 128 + a 64-value branch, 4 query heads on the
 * one latent head): the same oracles as on GQA — calibration z bit for bit, conformal fired sets,
 * CPU == guarded; sound never misses, margin exact — with the branch in every exact score and idx. */
Test(rope_mla, conformal_fired_sets_equal_the_oracle, .timeout = 240) {
    g_mla = true;
    uint64_t a = 0, b = 0;
    conformal_run(KVT_BACKEND_CPU, 4343, &a);
    conformal_run(KVT_BACKEND_GUARDED, 4343, &b);
    g_mla = false;
    cr_assert_eq(a, b, "CPU and guarded fetched the same rows (%llu, %llu)",
                 (unsigned long long)a, (unsigned long long)b);
}

Test(rope_mla, sound_never_misses_and_margin_is_exact, .timeout = 240) {
    g_mla = true;
    sound_margin_run();
    g_mla = false;
}

/* Decode through kvt_batch_run on an MLA-RoPE layer, the emission layout changing every step:
 * KVT_EMIT_TOKENS (FlashMLA's indices: the held rows, then the fetch slots, then -1 up to topk,
 * the length in topk_length), KVT_EMIT_CSR and KVT_EMIT_CSR_KV_HEADS (one list: the same). Each
 * step's list is the oracle's (calibration: every archived row; then the fired ones), its bytes
 * the rows', its attention the oracle set's; the archive's sketches equal the sketch oracle's; z
 * as the oracle's calibration; two query tokens a step are refused unless per KV head. */
static void mla_e2e_run(kvt_backend_kind backend, uint64_t seed) {
    g_mla = true;
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_CONFORMAL;
    cfg.recall_cap_rows = 64;
    const uint32_t rank[1] = {32};
    rr x;
    rr_init(&x, 1, 128, cfg, 32, rank, backend, seed);
    g_mla = false;
    cr_assert(kvt__seq_recalls_rope(x.seq, 0), "the request recalls on the MLA-RoPE layer");
    cr_assert_eq(kvt_seq_set_prompt_rows(x.seq, 4), KVT_OK);
    e2e e;
    e2e_init(&e, &x, 512);
    kvt_buffer *lbuf = NULL;
    cr_assert_eq(kvt_buffer_alloc(x.ctx, sizeof(int32_t), &lbuf), KVT_OK);
    trig t;
    memset(&t, 0, sizeof t);
    t.nq = x.sp.n_q_heads;
    kvt__conformal_init(&t.conf, t.conf_samples, 64 * t.nq);
    float q[TR_MAXQ * 256];
    int32_t indptr[2];
    int32_t *indices = malloc(sizeof(int32_t) * e.cap_idx);
    e2e_tally y = {.calibrating = true};
    uint64_t tokens_steps = 0;
    for (int step = 0; step < 90; step++) {
        if (step == 45)
            snapshot_swap(&x);
        aimed_queries(&x, q); /* at rows archived before this step */
        const kvt_emit_layout layout = step % 3 == 0   ? KVT_EMIT_TOKENS
                                       : step % 3 == 1 ? KVT_EMIT_CSR
                                                       : KVT_EMIT_CSR_KV_HEADS;
        uint8_t dense = 0;
        uint32_t topk = 0;
        if (layout == KVT_EMIT_TOKENS) {
            uint32_t one = 1, total;
            cr_assert_eq(kvt_batch_reserve(e.b, &x.seq, &one, 1), KVT_OK, "%s", kvt_last_error());
            rr_write(&x, 1);
            cr_assert_eq(kvt_buffer_write(e.qbuf, 0, q, sizeof(float) * t.nq * x.QW), KVT_OK);
            cr_assert_eq(kvt_batch_plan(e.b), KVT_OK);
            cr_assert_eq(kvt_batch_capacity(e.b, 0, &topk, &total), KVT_OK);
            cr_assert_leq(topk, e.cap_idx);
            kvt_emit em = {.struct_size = sizeof em, .layout = KVT_EMIT_TOKENS,
                           .indices = kvt_buffer_ptr(e.ibuf), .capacity = topk,
                           .lengths = kvt_buffer_ptr(lbuf), .dense = kvt_buffer_ptr(e.dbuf),
                           .queries_per_seq = 1};
            cr_assert_eq(kvt_batch_run(e.b, 0, kvt_buffer_ptr(e.qbuf), NULL, &em), KVT_OK, "%s",
                         kvt_last_error());
            cr_assert_eq(kvt_batch_commit(e.b, NULL), KVT_OK, "%s", kvt_last_error());
            x.n_tok++;
            cr_assert_eq(kvt_seq_check(x.seq), KVT_OK, "%s", kvt_last_error());
            int32_t len = -1;
            cr_assert_eq(kvt_buffer_read(lbuf, 0, &len, sizeof len), KVT_OK);
            cr_assert_eq(kvt_buffer_read(e.ibuf, 0, indices, sizeof(int32_t) * topk), KVT_OK);
            cr_assert_eq(kvt_buffer_read(e.dbuf, 0, &dense, 1), KVT_OK);
            cr_assert(len >= 0 && (uint32_t)len <= topk, "topk_length %d of topk %u", len, topk);
            for (uint32_t j = (uint32_t)len; j < topk; j++)
                cr_assert_eq(indices[j], -1, "step %d: entry %u past the length is %d", step, j,
                             indices[j]);
            indptr[0] = 0;
            indptr[1] = len;
            tokens_steps++;
        } else {
            cr_assert_eq(e2e_step(&e, &x, q, layout, indptr, indices, &dense), KVT_OK,
                         "seed %llu step %d: %s", (unsigned long long)seed, step,
                         kvt_last_error());
        }
        e2e_check(&x, &t, q, dense, indptr, indices, step, &y);
        if (step % 30 == 29)
            rr_check_sketches(&x);
    }
    cr_assert(!y.calibrating);
    cr_assert_gt(y.archived_steps, y.dense_steps, "fetching steps ran");
    cr_assert_gt(y.fetched, 0u, "rows were fetched");
    cr_assert_eq(tokens_steps, 30u);
    /* two query tokens with TOKENS: refused, named (CSR_KV_HEADS takes one query a request) */
    uint32_t one = 1;
    cr_assert_eq(kvt_batch_reserve(e.b, &x.seq, &one, 1), KVT_OK);
    rr_write(&x, 1);
    cr_assert_eq(kvt_batch_plan(e.b), KVT_OK);
    kvt_emit two = {.struct_size = sizeof two, .layout = KVT_EMIT_TOKENS,
                    .indices = kvt_buffer_ptr(e.ibuf), .capacity = 256,
                    .lengths = kvt_buffer_ptr(e.pbuf), .queries_per_seq = 2};
    cr_assert_eq(kvt_batch_run(e.b, 0, kvt_buffer_ptr(e.qbuf), NULL, &two),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "one query per request") != NULL, "%s",
              kvt_last_error());
    cr_assert_eq(kvt_batch_commit(e.b, NULL), KVT_OK);
    x.n_tok++;
    cr_assert_eq(kvt_seq_check(x.seq), KVT_OK, "%s", kvt_last_error());
    kvt_layer_stats ls = rr_stats(&x);
    cr_log_info("MLA-RoPE end to end (%s, seed %llu): z %g, %llu steps with an archive, %llu "
                "dense, %llu fetched rows listed",
                backend == KVT_BACKEND_CPU ? "cpu" : "guarded", (unsigned long long)seed,
                (double)ls.recall_z, (unsigned long long)y.archived_steps,
                (unsigned long long)y.dense_steps, (unsigned long long)y.fetched);
    kvt_buffer_free(lbuf);
    free(indices);
    e2e_fini(&e);
    rr_fini(&x);
}

Test(rope_mla, batch_run_every_layout_equals_the_oracle_cpu, .timeout = 240) {
    mla_e2e_run(KVT_BACKEND_CPU, 909);
}

Test(rope_mla, batch_run_every_layout_equals_the_oracle_guarded, .timeout = 240) {
    mla_e2e_run(KVT_BACKEND_GUARDED, 909);
}

/* Sound mode on a RoPE layer needs key bases its margin covers (‖V Vᵀ − I‖_F <= 2^-20, as on
 * NoPE layers): a head basis within kvt_ctx_set_recall_head_basis's 1e-3 but far above 2^-20 is
 * refused in a sound context and while a sound request lives; in a conformal context it is
 * taken and a sound request is then refused at creation, a request with recall off is not. */
Test(rope_mla, sound_mode_needs_orthonormal_key_bases) {
    for (int mla = 0; mla < 2; mla++) {
        kvt_layer_spec sp;
        if (mla)
            cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_ROPE, KVT_DTYPE_BF16, 128, 64, &sp),
                         KVT_OK);
        else
            cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 128, &sp),
                         KVT_OK);
        sp.n_q_heads = 4;
        kvt_model *m = NULL;
        cr_assert_eq(kvt_model_create(&sp, 1, "sound", &m, NULL, 0), KVT_OK);
        tu_rng rng = {.s = 77};
        float V[16 * 128];
        cr_assert(tu_orthonormal_rows(&rng, 16, 128, V));
        kvt_config c = rr_cfg(32, 8, 16);
        kvt_ctx_params p = kvt_ctx_default_params();
        p.config = &c;
        p.model = m;
        p.page_rows = 16;
        p.n_pages = 64;
        p.recall_sketch_rank = 16;
        kvt_ctx *ctx = NULL;
        char err[256];
        for (int sound_ctx = 1; sound_ctx >= 0; sound_ctx--) {
            c.recall = sound_ctx ? KVT_RECALL_SOUND : KVT_RECALL_CONFORMAL;
            cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
            cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, 0, 0, V, 16), KVT_OK, "%s",
                         kvt_last_error());
            V[3 * 128 + 11] += 1e-4f; /* within 1e-3, far above 2^-20 */
            kvt_status s = kvt_ctx_set_recall_head_basis(ctx, 0, 0, V, 16);
            if (sound_ctx) {
                cr_assert_eq(s, KVT_ERR_INVALID_ARGUMENT);
                cr_assert(strstr(kvt_last_error(), "sound") != NULL, "%s", kvt_last_error());
                uint32_t r = 0, id0 = 0, id1 = 0;
                cr_assert_eq(kvt_ctx_recall_head_basis(ctx, 0, 0, &r, &id0), KVT_OK);
                V[3 * 128 + 11] -= 1e-4f;
                cr_assert(tu_orthonormal_rows(&(tu_rng){.s = 77}, 16, 128, V));
                cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, 0, 0, V, 16), KVT_OK);
                cr_assert_eq(kvt_ctx_recall_head_basis(ctx, 0, 0, NULL, &id1), KVT_OK);
                cr_assert_eq(id0, id1, "the refused basis changed nothing");
            } else {
                cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
                kvt_seq_params sq = kvt_seq_default_params();
                sq.recall = KVT_RECALL_SOUND;
                kvt_seq *seq = NULL;
                cr_assert_eq(kvt_seq_create(ctx, &sq, &seq), KVT_ERR_INVALID_ARGUMENT);
                cr_assert(strstr(kvt_last_error(), "sound") != NULL, "%s", kvt_last_error());
                cr_assert_null(seq);
                sq.recall = KVT_RECALL_OFF;
                cr_assert_eq(kvt_seq_create(ctx, &sq, &seq), KVT_OK, "%s", kvt_last_error());
                kvt_seq_destroy(seq);
                V[3 * 128 + 11] -= 1e-4f;
            }
            kvt_ctx_destroy(ctx);
        }
        /* a live sound request refuses a loose key basis */
        c.recall = KVT_RECALL_OFF;
        cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
        kvt_seq_params sq = kvt_seq_default_params();
        sq.recall = KVT_RECALL_SOUND;
        kvt_seq *seq = NULL;
        cr_assert_eq(kvt_seq_create(ctx, &sq, &seq), KVT_OK, "%s", kvt_last_error());
        cr_assert(tu_orthonormal_rows(&(tu_rng){.s = 77}, 16, 128, V));
        V[5 * 128 + 2] += 1e-4f;
        cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, 0, 0, V, 16), KVT_ERR_INVALID_ARGUMENT);
        kvt_seq_destroy(seq);
        cr_assert_eq(kvt_ctx_set_recall_head_basis(ctx, 0, 0, V, 16), KVT_OK, "%s",
                     kvt_last_error());
        kvt_ctx_destroy(ctx);
        kvt_model_destroy(m);
    }
}

/* config.recall_lagged_query is for salience (NoPE) recall: a request that would recall on a
 * RoPE layer with it is refused at creation, naming the option; without recall it is inert. */
/* A one-layer GQA-RoPE model: 2 KV heads of 128 bf16 values, 8 query heads. */
static kvt_model *gqa_model(void) {
    kvt_layer_spec sp;
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 128, &sp), KVT_OK);
    sp.n_q_heads = 8;
    kvt_model *m = NULL;
    cr_assert_eq(kvt_model_create(&sp, 1, "rope", &m, NULL, 0), KVT_OK);
    return m;
}

/* A request of model m under cfg is created with recall off, and refused with conformal recall
 * (KVT_ERR_UNSUPPORTED, the message naming `option`, no request made). */
static void refused_with_recall(kvt_model *m, kvt_config *cfg, const char *option) {
    for (int recall = 0; recall < 2; recall++) {
        cfg->recall = recall ? KVT_RECALL_CONFORMAL : KVT_RECALL_OFF;
        kvt_ctx *ctx = small_ctx(m, cfg, 16);
        kvt_seq *seq = NULL;
        kvt_status s = tu_seq_create(ctx, 3, &seq);
        if (recall) {
            cr_assert_eq(s, KVT_ERR_UNSUPPORTED, "%s", kvt_last_error());
            cr_assert(strstr(kvt_last_error(), option), "%s", kvt_last_error());
            cr_assert_null(seq);
        } else {
            cr_assert_eq(s, KVT_OK, "%s", kvt_last_error());
            kvt_seq_destroy(seq);
        }
        kvt_ctx_destroy(ctx);
    }
}

Test(rope_recall, lagged_query_refused_on_rope_layers) {
    kvt_model *m = gqa_model();
    kvt_config cfg = rr_cfg(64, 16, 16);
    cfg.recall_lagged_query = true;
    refused_with_recall(m, &cfg, "recall_lagged_query");
    kvt_model_destroy(m);
}

/* ---- (4) A host archive (params.archive_space HOST, docs/recall.md §9.7) ---------------------- */

/* Conformal decode through kvt_batch_run with the archive in pinned host memory and a small W:
 * no step attends the whole archive; calibration steps fetch each query head's best archived row
 * (and sample as with a device archive: z equals the oracle's), overflow steps the first W fired
 * rows, flagged; the lists, bytes and reference attention are the oracle's at every step; the
 * fetch area holds at most W rows; the bytes moved are the fetched rows'; the archive's bytes are
 * counted in host memory; snapshot/restore and fork keep the placement. */
static void host_e2e_run(kvt_backend_kind backend, uint64_t seed, uint32_t W, bool mla) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_CONFORMAL;
    cfg.recall_cap_rows = W;
    const uint32_t rank[2] = {32, 16};
    rr x;
    g_archive_host = true;
    g_mla = mla; /* MLA-RoPE: one latent head, the branch plane in the backend's memory */
    rr_init(&x, mla ? 1 : 2, 128, cfg, 32, rank, backend, seed);
    g_archive_host = g_mla = false;
    cr_assert(kvt__seq_recalls_rope(x.seq, 0), "the request recalls on the RoPE layer");
    cr_assert_eq(kvt_seq_set_prompt_rows(x.seq, 4), KVT_OK);
    e2e e;
    e2e_init(&e, &x, 512);
    trig t;
    memset(&t, 0, sizeof t);
    t.nq = x.sp.n_q_heads;
    kvt__conformal_init(&t.conf, t.conf_samples, 64 * t.nq);
    float q[TR_MAXQ * 256];
    int32_t indptr[RR_MAXH + 1];
    int32_t *indices = malloc(sizeof(int32_t) * e.cap_idx);
    uint8_t dense = 0;
    bool calibrating = true;
    uint64_t listed_fetched = 0, calib_steps = 0, overflow_steps = 0, archived_steps = 0;
    const uint64_t rb2 = (uint64_t)x.P * x.sp.row_bytes; /* every plane of a (row, KV head) */
    const uint32_t page_rows = 16, fetch_pages_max = (W + page_rows - 1) / page_rows;
    g_cap_rows = W;
    for (int step = 0; step < 100; step++) {
        if (step == 60)
            snapshot_swap(&x);
        aimed_queries(&x, q); /* at rows archived before this step */
        cr_assert_eq(e2e_step(&e, &x, q, KVT_EMIT_CSR_KV_HEADS, indptr, indices, &dense), KVT_OK,
                     "seed %llu step %d: %s", (unsigned long long)seed, step, kvt_last_error());
        cr_assert_eq(dense, 0, "step %d: a host archive never attends every row", step);
        float best[TR_MAXQ];
        oview v;
        oview_read(&x, &v);
        o_best(&x, &v, q, best);
        kvt_layer_stats ls = rr_stats(&x);
        cr_assert_eq(ls.archive_space, (int32_t)KVT_SPACE_HOST);
        cr_assert(!ls.recall_last_dense);
        const bool calib = v.ar_n && calibrating;
        if (calib) {
            calibrating = o_calibrate(&t, &x, &v, q, best);
            cr_assert_eq(ls.recall_z, t.conf.z, "step %d: z %g, oracle %g", step,
                         (double)ls.recall_z, (double)t.conf.z);
            calib_steps++;
        }
        archived_steps += v.ar_n > 0;
        overflow_steps += ls.recall_last_overflow;
        g_capped_calib = calib;
        uint64_t fetched = 0;
        check_lists(&x, false, &v, q, best, KVT__RECALL_CONFORMAL, t.conf.z, indptr, indices,
                    &fetched);
        g_capped_calib = false;
        listed_fetched += fetched;
        cr_assert_eq(ls.recall_last_fetched, fetched, "step %d", step);
        cr_assert_eq(ls.recall_last_moved_bytes, fetched * rb2, "step %d", step);
        cr_assert_leq(fetched, (uint64_t)x.H * W);
        /* the fetch area: at most W rows (the pages beyond the table's) */
        uint32_t tpages = (uint32_t)((v.n_rows + page_rows - 1) / page_rows);
        cr_assert_leq(ls.pages_in_use - tpages, fetch_pages_max, "step %d: %llu pages in use, "
                      "table %u", step, (unsigned long long)ls.pages_in_use, tpages);
        oview_free(&v);
    }
    kvt_layer_stats ls = rr_stats(&x);
    cr_assert(!calibrating);
    cr_assert_eq(ls.recall_calib_steps, calib_steps);
    cr_assert_eq(ls.recall_overflow_steps, overflow_steps);
    cr_assert_gt(overflow_steps, 0u, "W = %u overflows on this data", W);
    cr_assert_gt(archived_steps, calib_steps + overflow_steps, "fetching steps ran");
    /* after the restore the totals restart from the snapshot's, which kept them */
    cr_assert_eq(ls.recall_moved_bytes, ls.recall_fetched_rows * rb2);
    cr_assert_gt(ls.archived_rows, 0u);
    kvt_ctx_memory mem = {.struct_size = sizeof mem};
    cr_assert_eq(kvt_ctx_memory_stats(x.ctx, &mem), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(mem.archive_host_bytes, ls.archive_bytes);
    cr_assert_eq(mem.archive_device_bytes, 0u);
    /* every archived row's bytes, read back, are the appended ones */
    for (uint32_t h = 0; h < x.H; h++) {
        oview v;
        oview_read(&x, &v);
        uint8_t row[512];
        for (uint64_t k = 0; k < v.ar_n; k++)
            for (uint32_t pl = 0; pl < x.P; pl++) {
                cr_assert_eq(kvt_seq_read_row(x.seq, 0, pl, h, (uint64_t)v.ar_pos[h][k], row,
                                              x.sp.row_bytes),
                             KVT_OK, "%s", kvt_last_error());
                cr_assert(memcmp(row, rr_row(&x, pl, (uint64_t)v.ar_pos[h][k], h),
                                 x.sp.row_bytes) == 0);
            }
        oview_free(&v);
    }
    /* a fork's archive is host memory too */
    kvt_seq *child = NULL;
    cr_assert_eq(kvt_seq_fork(x.seq, 99, &child), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(child), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_memory_stats(x.ctx, &mem), KVT_OK);
    cr_assert_eq(mem.archive_host_bytes, 2 * ls.archive_bytes);
    cr_assert_eq(mem.archive_device_bytes, 0u);
    kvt_seq_destroy(child);
    cr_log_info("host archive (seed %llu, W %u): %llu steps with an archive, %llu calibration, "
                "%llu capped overflows, %llu (row, KV head) pairs fetched = %llu B moved",
                (unsigned long long)seed, W, (unsigned long long)archived_steps,
                (unsigned long long)calib_steps, (unsigned long long)overflow_steps,
                (unsigned long long)listed_fetched, (unsigned long long)ls.recall_moved_bytes);
    g_cap_rows = 0;
    free(indices);
    e2e_fini(&e);
    rr_fini(&x);
}

Test(rope_host, capped_lists_equal_the_oracle_cpu, .timeout = 240) {
    host_e2e_run(KVT_BACKEND_CPU, 808, 6, false);
}

Test(rope_host, capped_lists_equal_the_oracle_guarded, .timeout = 240) {
    host_e2e_run(KVT_BACKEND_GUARDED, 909, 6, false);
}

/* MLA-RoPE: the same with one latent head of 128 + a rotated 64-value branch; the branch plane
 * (the scan's reads) checked against the rows by kvt_seq_check at every step. */
Test(rope_host, mla_capped_lists_equal_the_oracle_guarded, .timeout = 240) {
    host_e2e_run(KVT_BACKEND_GUARDED, 606, 6, true);
}

/* A device archive (the default) is counted as device memory; an unknown space is refused. */
Test(rope_host, placement_statuses) {
    kvt_model *m = gqa_model();
    kvt_config cfg = rr_cfg(64, 16, 16);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.config = &cfg;
    p.model = m;
    p.archive_space = (kvt_space)7;
    kvt_ctx *ctx = NULL;
    char err[512] = "";
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(err, "archive_space"), "%s", err);
    cr_assert_null(ctx);
    kvt_model_destroy(m);

    /* the device default: the archive's bytes counted as device memory */
    rr x;
    rr_init(&x, 2, 128, rr_cfg(32, 8, 16), 0, NULL, KVT_BACKEND_CPU, 5);
    rr_step(&x, 4, false);
    for (int i = 0; i < 80; i++)
        rr_step(&x, 1, true);
    kvt_layer_stats ls = rr_stats(&x);
    cr_assert_gt(ls.archive_bytes, 0u);
    cr_assert_eq(ls.archive_space, (int32_t)KVT_SPACE_DEVICE);
    kvt_ctx_memory mem = {.struct_size = sizeof mem};
    cr_assert_eq(kvt_ctx_memory_stats(x.ctx, &mem), KVT_OK);
    cr_assert_eq(mem.archive_device_bytes, ls.archive_bytes);
    cr_assert_eq(mem.archive_host_bytes, 0u);
    rr_fini(&x);
}

/* ------------------------------------------------------------------------------------------------
 * One backend call per layer for a batch (DESIGN §3): three RoPE-recalling requests run together
 * against the same three each alone in a context of its own (the same bases, rows, queries and
 * request id, so the same eviction draws). After every step each request's recall state (its
 * certificate counters, z, the pruned scan's counts), fired rows and list lengths per KV head
 * are the lone run's, and the batch's layer took one recall_rope_step call and one
 * recall_rope_emit call for the three (the guarded backend's counts). GQA with CSR_KV_HEADS (one
 * chained emission call), MLA-RoPE with TOKENS (FlashMLA's rows, one call after the packs).
 * ---------------------------------------------------------------------------------------------- */
enum { BT_K = 3 };

/* Per context: a batch and its query, index, offset (or length) buffers. */
typedef struct bt_side {
    kvt_batch *b;
    kvt_buffer *qbuf, *ibuf, *pbuf;
} bt_side;

static void bt_side_init(bt_side *s, kvt_ctx *ctx, uint32_t n, size_t qfloats, uint32_t cap,
                         uint32_t H) {
    cr_assert_eq(kvt_batch_create(ctx, n, &s->b), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof(float) * n * qfloats, &s->qbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof(int32_t) * n * cap, &s->ibuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof(int32_t) * (n * H + 1), &s->pbuf), KVT_OK);
}

static void bt_side_fini(bt_side *s) {
    kvt_batch_destroy(s->b);
    kvt_buffer_free(s->qbuf);
    kvt_buffer_free(s->ibuf);
    kvt_buffer_free(s->pbuf);
}

/* Plan and run side s's batch of n requests (queries q) on layer 0 with `layout`, commit; the
 * list lengths into len[n][H] (TOKENS: topk_length). */
static void bt_run(bt_side *s, uint32_t n, uint32_t H, const float *q, size_t qfloats,
                   kvt_emit_layout layout, uint32_t cap, int32_t *len) {
    cr_assert_eq(kvt_buffer_write(s->qbuf, 0, q, sizeof(float) * n * qfloats), KVT_OK);
    cr_assert_eq(kvt_batch_plan(s->b), KVT_OK, "%s", kvt_last_error());
    uint32_t topk, total;
    cr_assert_eq(kvt_batch_capacity(s->b, 0, &topk, &total), KVT_OK);
    const bool tokens = layout == KVT_EMIT_TOKENS;
    cr_assert_leq(tokens ? topk : H * total, tokens ? cap : n * cap);
    kvt_emit em = {.struct_size = sizeof em, .layout = layout, .indices = kvt_buffer_ptr(s->ibuf),
                   .capacity = tokens ? topk : n * cap, .queries_per_seq = 1};
    if (tokens)
        em.lengths = kvt_buffer_ptr(s->pbuf);
    else
        em.indptr = kvt_buffer_ptr(s->pbuf);
    cr_assert_eq(kvt_batch_run(s->b, 0, kvt_buffer_ptr(s->qbuf), NULL, &em), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(kvt_batch_commit(s->b, NULL), KVT_OK, "%s", kvt_last_error());
    int32_t p[BT_K * RR_MAXH + 1];
    const uint32_t np = tokens ? n : n * H + 1;
    cr_assert_eq(kvt_buffer_read(s->pbuf, 0, p, sizeof(int32_t) * np), KVT_OK);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t h = 0; h < H; h++)
            len[i * H + h] = tokens ? p[i] : p[i * H + h + 1] - p[i * H + h];
}

/* A request's trigger outputs: state, per-head fired counts, overflow flags and fired rows. */
typedef struct bt_out {
    kvt__recall_state st;
    uint32_t n_fired[RR_MAXH], overflow[RR_MAXH], fired[RR_MAXH * 64];
} bt_out;

static void bt_read(const rr *x, const kvt_seq *s, bt_out *o) {
    const kvt__recall_rope_layer *r = &s->rrope[0];
    memset(o, 0, sizeof *o);
    cr_assert_leq(r->n_kv * r->cap, RR_MAXH * 64u);
    dev_read(x, &o->st, r->base.st, sizeof o->st);
    dev_read(x, o->n_fired, r->n_fired, sizeof(uint32_t) * r->n_kv);
    dev_read(x, o->overflow, r->overflow, sizeof(uint32_t) * r->n_kv);
    dev_read(x, o->fired, r->fired, sizeof(uint32_t) * r->n_kv * r->cap);
    for (uint32_t h = 0; h < r->n_kv; h++) /* rows past the count are scratch */
        for (uint32_t j = o->n_fired[h]; j < r->cap; j++)
            o->fired[h * r->cap + j] = 0;
}

static void batch_equals_alone(bool mla, uint64_t seed) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_CONFORMAL;
    cfg.recall_cap_rows = 64;
    const uint32_t H = mla ? 1 : 2, rank[2] = {32, 16};
    const kvt_emit_layout layout = mla ? KVT_EMIT_TOKENS : KVT_EMIT_CSR_KV_HEADS;
    rr al[BT_K], bx;
    for (uint32_t k = 0; k <= BT_K; k++) {
        rr *x = k < BT_K ? &al[k] : &bx;
        g_mla = mla;
        rr_init(x, H, 128, cfg, 32, rank, KVT_BACKEND_GUARDED, seed); /* the same bases */
        g_mla = false;
        for (uint32_t j = 0; j < 1000u * k; j++) /* each lone request's own rows */
            tu_next(&x->rng);
    }
    /* request k has id 7 + k in the batch and alone (its draws' key; ids are unique among a
     * context's live requests) */
    kvt_seq *bs[BT_K] = {bx.seq};
    for (uint32_t k = 1; k < BT_K; k++) {
        cr_assert_eq(tu_seq_create(bx.ctx, 7 + k, &bs[k]), KVT_OK);
        kvt_seq_destroy(al[k].seq);
        cr_assert_eq(tu_seq_create(al[k].ctx, 7 + k, &al[k].seq), KVT_OK);
    }
    for (uint32_t k = 0; k < BT_K; k++)
        cr_assert(kvt__seq_recalls_rope(bs[k], 0) && kvt__seq_recalls_rope(al[k].seq, 0));
    const uint32_t nq = bx.sp.n_q_heads, cap = mla ? 512 : H * 256;
    const size_t qf = (size_t)nq * bx.QW, slot = (size_t)H * bx.sp.row_bytes;
    bt_side sa[BT_K], sb;
    for (uint32_t k = 0; k < BT_K; k++)
        bt_side_init(&sa[k], al[k].ctx, 1, qf, cap, H);
    bt_side_init(&sb, bx.ctx, BT_K, qf, cap, H);
    float *q = malloc(sizeof(float) * BT_K * qf);
    uint64_t fetched = 0, fired_steps = 0;
    for (int step = 0; step < 90; step++) {
        uint32_t ones[BT_K] = {1, 1, 1};
        cr_assert_eq(kvt_batch_reserve(sb.b, bs, ones, BT_K), KVT_OK, "%s", kvt_last_error());
        for (uint32_t k = 0; k < BT_K; k++) {
            rr *x = &al[k];
            aimed_queries(x, q + k * qf); /* on the committed state, before the step's row */
            cr_assert_eq(kvt_batch_reserve(sa[k].b, &x->seq, ones, 1), KVT_OK, "%s",
                         kvt_last_error());
            rr_write(x, 1);
            for (uint32_t p = 0; p < x->P; p++)
                cr_assert_eq(kvt_seq_write(bs[k], 0, p, 0, 1, rr_row(x, p, x->n_tok, 0), slot),
                             KVT_OK, "%s", kvt_last_error());
        }
        int32_t la[BT_K * RR_MAXH], lb[BT_K * RR_MAXH];
        for (uint32_t k = 0; k < BT_K; k++) {
            bt_run(&sa[k], 1, H, q + k * qf, qf, layout, cap, la + k * H);
            al[k].n_tok++;
        }
        kvt__guarded_calls c0, c1;
        cr_assert(kvt__backend_guarded_calls(&bx.ctx->backend, &c0));
        bt_run(&sb, BT_K, H, q, qf, layout, cap, lb);
        cr_assert(kvt__backend_guarded_calls(&bx.ctx->backend, &c1));
        cr_assert_eq(c1.rope_step - c0.rope_step, 1u, "step %d: one trigger call", step);
        cr_assert_eq(c1.rope_step_items - c0.rope_step_items, BT_K);
        cr_assert_eq(c1.rope_emit - c0.rope_emit, 1u, "step %d: one emission call", step);
        cr_assert_eq(c1.rope_emit_items - c0.rope_emit_items, BT_K);
        for (uint32_t k = 0; k < BT_K; k++) {
            cr_assert_eq(kvt_seq_check(bs[k]), KVT_OK, "%s", kvt_last_error());
            cr_assert_eq(kvt_seq_check(al[k].seq), KVT_OK, "%s", kvt_last_error());
            bt_out oa, ob;
            bt_read(&al[k], al[k].seq, &oa);
            bt_read(&bx, bs[k], &ob);
            cr_assert(memcmp(&oa.st, &ob.st, sizeof oa.st) == 0,
                      "step %d request %u: state differs (fired %llu/%llu, visited %llu/%llu)",
                      step, k, (unsigned long long)oa.st.last_fired,
                      (unsigned long long)ob.st.last_fired,
                      (unsigned long long)oa.st.last_visited,
                      (unsigned long long)ob.st.last_visited);
            cr_assert(memcmp(&oa, &ob, sizeof oa) == 0, "step %d request %u: fired rows differ",
                      step, k);
            for (uint32_t h = 0; h < H; h++)
                cr_assert_eq(la[k * H + h], lb[k * H + h], "step %d request %u head %u", step, k,
                             h);
            fetched += oa.st.last_fetched;
            fired_steps += !oa.st.last_dense && oa.st.last_fired > 0;
        }
    }
    for (uint32_t k = 0; k < BT_K; k++) {
        bt_out o;
        bt_read(&bx, bs[k], &o);
        cr_assert_neq(o.st.phase, KVT__CONFORMAL_OPEN, "request %u calibrated", k);
    }
    cr_assert_gt(fired_steps, 0u, "steps fetched fired rows");
    cr_log_info("batch of %u vs alone (%s): %llu rows fetched, %llu steps with fired rows", BT_K,
                mla ? "MLA-RoPE, TOKENS" : "GQA, CSR_KV_HEADS", (unsigned long long)fetched,
                (unsigned long long)fired_steps);
    free(q);
    for (uint32_t k = 0; k < BT_K; k++)
        bt_side_fini(&sa[k]);
    bt_side_fini(&sb);
    for (uint32_t k = 1; k < BT_K; k++)
        kvt_seq_destroy(bs[k]);
    for (uint32_t k = 0; k < BT_K; k++)
        rr_fini(&al[k]);
    rr_fini(&bx);
}

Test(rope_batch, three_requests_one_call_equal_each_alone_gqa, .timeout = 240) {
    batch_equals_alone(false, 5151);
}

Test(rope_batch, three_requests_one_call_equal_each_alone_mla_tokens, .timeout = 240) {
    batch_equals_alone(true, 5252);
}

/* ------------------------------------------------------------------------------------------------
 * RoPE recall inside a CUDA graph (kvt_batch_plan_device; docs/recall.md §9.4): two twins of a
 * context, each a batch of a recalling request and one without recall, emitting with a fixed
 * capacity: an MLA-RoPE layer with KVT_EMIT_TOKENS (FlashMLA's rows) or CSR, a GQA-RoPE layer of
 * two KV heads with KVT_EMIT_CSR_KV_HEADS (a list per (request, KV head), chained by device
 * counts). The eager twin runs every step; the graph twin, on each step plan_device finds
 * plannable, replays one recording of its first planned step's run (the planned trigger, the
 * pack, the planned emission), and runs the others (eviction rounds) eagerly. Every step's
 * lists, lengths or offsets and dense flags, and the recalling request's trigger state, are the
 * eager twin's; most steps replay, some fetch rows.
 * ---------------------------------------------------------------------------------------------- */
typedef struct gt_twin {
    rr x;
    kvt_seq *other;
    kvt_batch *b;
    kvt_buffer *qbuf, *ibuf, *lbuf, *dbuf;
    kvt_emit_layout layout;
    uint32_t cap, n_len; /* entries of indices; of lengths (TOKENS) or indptr */
} gt_twin;

enum { GT_TOPK = 512 };

static void gt_open(gt_twin *t, bool mla, kvt_emit_layout layout, kvt_backend_kind backend,
                    uint64_t seed) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_CONFORMAL;
    cfg.recall_cap_rows = 64;
    const uint32_t rank[2] = {32, 16}, H = mla ? 1 : 2;
    g_mla = mla;
    g_max_seqs = 2;
    g_max_rows = GT_TOPK; /* max_rows_per_seq: what sizes a planned step's ops */
    rr_init(&t->x, H, 128, cfg, 32, rank, backend, seed);
    g_mla = false;
    g_max_seqs = g_max_rows = 0;
    cr_assert_eq(kvt_seq_set_prompt_rows(t->x.seq, 4), KVT_OK);
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 77;
    sp.recall = KVT_RECALL_OFF;
    cr_assert_eq(kvt_seq_create(t->x.ctx, &sp, &t->other), KVT_OK, "%s", kvt_last_error());
    cr_assert(kvt__seq_recalls_rope(t->x.seq, 0) && !kvt__seq_recalls_rope(t->other, 0));
    cr_assert_eq(kvt_batch_create(t->x.ctx, 2, &t->b), KVT_OK);
    t->layout = layout;
    t->cap = 2 * H * GT_TOPK;
    t->n_len = layout == KVT_EMIT_TOKENS ? 2 : 2 * H + 1;
    const size_t qf = (size_t)t->x.sp.n_q_heads * t->x.QW;
    cr_assert_eq(kvt_buffer_alloc(t->x.ctx, sizeof(float) * 2 * qf, &t->qbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(t->x.ctx, sizeof(int32_t) * t->cap, &t->ibuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(t->x.ctx, sizeof(int32_t) * t->n_len, &t->lbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(t->x.ctx, 2, &t->dbuf), KVT_OK);
}

static void gt_close(gt_twin *t) {
    kvt_batch_destroy(t->b);
    kvt_buffer_free(t->qbuf);
    kvt_buffer_free(t->ibuf);
    kvt_buffer_free(t->lbuf);
    kvt_buffer_free(t->dbuf);
    kvt_seq_destroy(t->other);
    rr_fini(&t->x);
}

static kvt_emit gt_emit(const gt_twin *t) {
    kvt_emit e = {.struct_size = sizeof(kvt_emit), .layout = t->layout,
                  .indices = kvt_buffer_ptr(t->ibuf), .dense = kvt_buffer_ptr(t->dbuf),
                  .queries_per_seq = 1};
    if (t->layout == KVT_EMIT_TOKENS) {
        e.capacity = GT_TOPK;
        e.lengths = kvt_buffer_ptr(t->lbuf);
    } else {
        e.capacity = t->cap;
        e.indptr = kvt_buffer_ptr(t->lbuf);
    }
    return e;
}

/* Reserve a token for both requests, write their rows (the other's from `rows`) and queries. */
static void gt_begin(gt_twin *t, const uint8_t *rows, const float *q) {
    kvt_seq *seqs[2] = {t->x.seq, t->other};
    uint32_t ones[2] = {1, 1};
    cr_assert_eq(kvt_batch_reserve(t->b, seqs, ones, 2), KVT_OK, "%s", kvt_last_error());
    rr_write(&t->x, 1);
    const size_t slot = (size_t)t->x.H * t->x.sp.row_bytes;
    for (uint32_t p = 0; p < t->x.P; p++)
        cr_assert_eq(kvt_seq_write(t->other, 0, p, 0, 1, rows + p * slot, slot), KVT_OK);
    const size_t qf = (size_t)t->x.sp.n_q_heads * t->x.QW;
    cr_assert_eq(kvt_buffer_write(t->qbuf, 0, q, sizeof(float) * 2 * qf), KVT_OK);
    cr_assert_eq(kvt_batch_plan(t->b), KVT_OK, "%s", kvt_last_error());
}

static void gt_run(gt_twin *t, void *stream) {
    const kvt_emit em = gt_emit(t);
    cr_assert_eq(kvt_batch_run(t->b, 0, kvt_buffer_ptr(t->qbuf), stream, &em), KVT_OK, "%s",
                 kvt_last_error());
}

/* The stream's work done (a CUDA stream: the buffers are read on another). */
static void gt_sync(void *stream) {
#if KVT_HAVE_CUDA
    if (stream)
        cr_assert_eq(cudaStreamSynchronize((cudaStream_t)stream), cudaSuccess);
#else
    (void)stream;
#endif
}

static void gt_commit(gt_twin *t) {
    cr_assert_eq(kvt_batch_commit(t->b, NULL), KVT_OK, "%s", kvt_last_error());
    t->x.n_tok++;
    cr_assert_eq(kvt_seq_check(t->x.seq), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(t->other), KVT_OK, "%s", kvt_last_error());
}

/* The emitted lists of both twins are the same (TOKENS: every row and length; CSR: the offsets
 * and the entries they cover), and the dense flags. */
static void gt_same(const gt_twin *a, const gt_twin *g, int step, bool planned) {
    int32_t la[2 * RR_MAXH + 1], lg[2 * RR_MAXH + 1];
    uint8_t da[2], dg[2];
    cr_assert_eq(kvt_buffer_read(a->lbuf, 0, la, sizeof(int32_t) * a->n_len), KVT_OK);
    cr_assert_eq(kvt_buffer_read(g->lbuf, 0, lg, sizeof(int32_t) * g->n_len), KVT_OK);
    cr_assert_eq(kvt_buffer_read(a->dbuf, 0, da, 2), KVT_OK);
    cr_assert_eq(kvt_buffer_read(g->dbuf, 0, dg, 2), KVT_OK);
    for (uint32_t j = 0; j < a->n_len; j++)
        cr_assert_eq(la[j], lg[j], "step %d (%s): %s[%u] %d eager, %d graph", step,
                     planned ? "replay" : "eager",
                     a->layout == KVT_EMIT_TOKENS ? "length" : "indptr", j, la[j], lg[j]);
    cr_assert(da[0] == dg[0] && da[1] == dg[1], "step %d: dense flags", step);
    const uint32_t used = a->layout == KVT_EMIT_TOKENS ? 2 * GT_TOPK : (uint32_t)la[a->n_len - 1];
    cr_assert_leq(used, a->cap);
    int32_t *ia = malloc(sizeof(int32_t) * a->cap), *ig = malloc(sizeof(int32_t) * a->cap);
    cr_assert_eq(kvt_buffer_read(a->ibuf, 0, ia, sizeof(int32_t) * used), KVT_OK);
    cr_assert_eq(kvt_buffer_read(g->ibuf, 0, ig, sizeof(int32_t) * used), KVT_OK);
    cr_assert(memcmp(ia, ig, sizeof(int32_t) * used) == 0, "step %d (%s): lists differ", step,
              planned ? "replay" : "eager");
    free(ia);
    free(ig);
}

static void rope_graph_run(bool mla, kvt_emit_layout layout, kvt_backend_kind backend,
                           uint64_t seed, void *stream) {
    gt_twin a, g;
    gt_open(&a, mla, layout, backend, seed);
    gt_open(&g, mla, layout, backend, seed);
    kvt__backend *be = kvt__batch_backend(g.b);
    cr_assert(be->ops->capture_begin && be->ops->capture_end && be->ops->graph_launch);
    const size_t qf = (size_t)a.x.sp.n_q_heads * a.x.QW;
    const size_t slot = (size_t)a.x.H * a.x.sp.row_bytes;
    float *q = calloc(2 * qf, sizeof(float));
    uint8_t *rows = malloc(2 * slot);
    void *graph = NULL;
    uint32_t replays = 0, eager = 0, replay_fetch = 0;
    tu_rng rg = {seed ^ 0x5eed};
    for (int step = 0; step < 160; step++) {
        aimed_queries(&a.x, q); /* both twins' generators in step */
        aimed_queries(&g.x, q);
        for (uint32_t p = 0; p < 2; p++)
            for (size_t k = 0; k < slot / 2; k++) {
                const uint16_t v = kvt__f32_to_bf16((float)tu_normal(&rg));
                memcpy(rows + p * slot + 2 * k, &v, 2);
            }
        gt_begin(&a, rows, q);
        gt_begin(&g, rows, q);
        gt_run(&a, stream);
        const kvt_emit em = gt_emit(&g);
        bool planned = false;
        cr_assert_eq(kvt_batch_plan_device(g.b, &em, 1, stream, &planned), KVT_OK, "%s",
                     kvt_last_error());
        if (planned && !graph) { /* the recording: nothing runs until it is launched */
            cr_assert_eq(be->ops->capture_begin(be, stream), KVT_OK);
            gt_run(&g, stream);
            cr_assert_eq(be->ops->capture_end(be, stream, &graph), KVT_OK);
        }
        if (planned) {
            cr_assert_eq(be->ops->graph_launch(be, graph, stream), KVT_OK, "%s",
                         kvt_last_error());
            replays++;
        } else {
            gt_run(&g, stream);
            eager++;
        }
        gt_sync(stream);
        gt_same(&a, &g, step, planned);
        gt_commit(&a);
        gt_commit(&g);
        kvt__recall_state sa, sg;
        dev_read(&a.x, &sa, a.x.seq->rrope[0].base.st, sizeof sa);
        dev_read(&g.x, &sg, g.x.seq->rrope[0].base.st, sizeof sg);
        cr_assert(memcmp(&sa, &sg, sizeof sa) == 0, "step %d: trigger state differs", step);
        replay_fetch += planned && !sg.last_dense && sg.last_fired > 0;
    }
    cr_log_info("RoPE graph twin (%s, %s, layout %d): %u replays, %u eager steps, %u replays "
                "fetched rows",
                kvt_ctx_backend_name(g.x.ctx), mla ? "MLA-RoPE" : "GQA-RoPE", (int)layout,
                replays, eager, replay_fetch);
    cr_assert_geq(replays, 100u, "%u replays, %u eager steps", replays, eager);
    cr_assert_geq(eager, 5u, "rounds ran eagerly: %u", eager);
    cr_assert_geq(replay_fetch, 10u, "replayed steps that fetched rows: %u", replay_fetch);
    if (graph)
        be->ops->graph_free(be, graph);
    free(q);
    free(rows);
    gt_close(&a);
    gt_close(&g);
}

/* Every layout a RoPE recall plans with. */
static void rope_graph_all(kvt_backend_kind backend, uint64_t seed, void *stream) {
    rope_graph_run(true, KVT_EMIT_TOKENS, backend, seed, stream);
    rope_graph_run(true, KVT_EMIT_CSR, backend, seed + 1, stream);
    rope_graph_run(false, KVT_EMIT_CSR_KV_HEADS, backend, seed + 2, stream);
}

Test(rope_graph, replays_equal_the_eager_twin_cpu, .timeout = 240) {
    rope_graph_all(KVT_BACKEND_CPU, 6060, NULL);
}

Test(rope_graph, replays_equal_the_eager_twin_guarded, .timeout = 240) {
    rope_graph_all(KVT_BACKEND_GUARDED, 6161, NULL);
}

/* On a device: a real CUDA graph over a non-blocking stream (skips without one). */
Test(rope_graph, replays_equal_the_eager_twin_cuda, .timeout = 240) {
#if KVT_HAVE_CUDA
    cudaStream_t s = tu_cuda_stream();
    rope_graph_all(KVT_BACKEND_CUDA, 6262, s);
    cudaStreamDestroy(s);
#else
    if (getenv("KVT_REQUIRE_GPU"))
        cr_assert_fail("KVT_REQUIRE_GPU set but the build has no CUDA");
    cr_skip_test("built without CUDA");
#endif
}

/* The bound a planned RoPE step's launch and workspace are sized by (the RoPE table's bound) holds
 * the group planes' shape — blocks of config.block_rows rows, centres of branch + stride values,
 * max_rows / block_rows blocks — so a request's item fits it, and an item with larger blocks or
 * centres does not (the CUDA op would otherwise build groups in too small a scratch). */
Test(rope_graph, bound_holds_the_group_planes) {
    kvt_config cfg = rr_cfg(32, 8, 16);
    cfg.recall = KVT_RECALL_CONFORMAL;
    const uint32_t rank[2] = {32, 16};
    rr x;
    g_max_seqs = 2;
    g_max_rows = GT_TOPK;
    rr_init(&x, 2, 128, cfg, 32, rank, KVT_BACKEND_CPU, 77);
    g_max_seqs = g_max_rows = 0;
    kvt__recall_rope_args b, it;
    kvt__recall_site site;
    kvt__recall_bound bound;
    cr_assert_eq(kvt__ctx_recall_of(x.ctx, 0, &site), &kvt__recall_rope);
    cr_assert(kvt__recall_rope.bound(&site, 0, 0, true, &bound));
    b = bound.rope;
    cr_assert_not_null(b.g_perm);
    cr_assert_eq(b.g_B, cfg.block_rows);
    cr_assert_eq(b.g_dim, b.branch_dim + x.stride);
    cr_assert_eq(b.g_blocks_cap, (uint64_t)GT_TOPK / cfg.block_rows);
    for (int s = 0; s < 40; s++)
        rr_step(&x, 1, true);
    static const float q;
    kvt__rope_view view;
    cr_assert_eq(kvt__seq_rope_recall_view(x.seq, 0, &view), KVT_OK, "%s", kvt_last_error());
    kvt__recall_rope_make(&x.seq->rrope[0], &view, &q, cfg.recall, 0.0f, NULL, &it);
    cr_assert_not_null(it.g_perm);
    cr_assert(kvt__recall_rope_plan_fits(&b, &it));
    kvt__recall_rope_args big = it;
    big.g_dim = b.g_dim + 1;
    cr_assert(!kvt__recall_rope_plan_fits(&b, &big), "wider centres than the bound's");
    big = it;
    big.g_B = 2 * b.g_B;
    cr_assert(!kvt__recall_rope_plan_fits(&b, &big), "larger blocks than the bound's");
    rr_fini(&x);
}

/* ---- A key basis replaced while requests live (kvt_ctx_refit_recall_head_basis) ------------ */

/* One head's basis refitted mid-life: every archived row of that head is sketched again with the
 * new basis — the archive's sketches equal the host oracle's for the new basis, bit for bit,
 * every head (the others' unchanged) — and the rounds after it sketch with it too; the id
 * changes, the rank is kept; refusals change nothing. CPU, guarded (device and host archive) and
 * the CUDA backend where it opens. */
static void refit_head_run(kvt_backend_kind backend, bool host, uint64_t seed) {
    const uint32_t rank[3] = {32, 0, 8};
    g_archive_host = host;
    rr x;
    rr_init(&x, 3, 128, rr_cfg(32, 8, 16), 32, rank, backend, seed);
    g_archive_host = false;
    cr_assert_eq(kvt_seq_set_prompt_rows(x.seq, 5), KVT_OK);
    rr_step(&x, 5, false);
    for (int i = 0; i < 80; i++)
        rr_step(&x, 1 + (uint32_t)(i % 3 == 0), i % 2 == 0);
    cr_assert_gt(rr_check_sketches(&x), 20u);
    uint32_t id0, id1, r;
    cr_assert_eq(kvt_ctx_recall_head_basis(x.ctx, 0, 0, NULL, &id0), KVT_OK);
    tu_rng g2 = {.s = seed + 1};
    float *V2 = malloc(sizeof(float) * 32 * 128);
    cr_assert(V2 && tu_orthonormal_rows(&g2, 32, 128, V2));
    /* refused, nothing changed: another rank, a head without a basis, a head out of range,
     * the NoPE call on an evict layer, a step in flight */
    cr_assert_eq(kvt_ctx_refit_recall_head_basis(x.ctx, 0, 0, V2, 16, 0, NULL),
                 KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_refit_recall_head_basis(x.ctx, 0, 1, V2, 32, 0, NULL),
                 KVT_ERR_OUT_OF_RANGE);
    cr_assert(strstr(kvt_last_error(), "no basis"), "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_refit_recall_head_basis(x.ctx, 0, 3, V2, 32, 0, NULL),
                 KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_refit_recall_basis(x.ctx, 0, V2, 32, 0, NULL), KVT_ERR_POLICY_MISMATCH);
    cr_assert_eq(tu_reserve(x.seq, 1), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_refit_recall_head_basis(x.ctx, 0, 0, V2, 32, 0, NULL),
                 KVT_ERR_BAD_STATE);
    rr_write(&x, 1);
    cr_assert_eq(tu_commit(x.seq, 1), KVT_OK, "%s", kvt_last_error());
    x.n_tok += 1;
    cr_assert_eq(kvt_ctx_recall_head_basis(x.ctx, 0, 0, &r, &id1), KVT_OK);
    cr_assert_eq(id1, id0, "a refused refit changed the basis");
    cr_assert_eq(rr_check_sketches(&x), kvt__seq_state(x.seq, 0)->ev.ar_n);
    /* the refit: head 0's sketches follow V2, the others stay */
    cr_assert_eq(kvt_ctx_refit_recall_head_basis(x.ctx, 0, 0, V2, 32, 0, NULL), KVT_OK, "%s",
                 kvt_last_error());
    memcpy(x.V[0], V2, sizeof(float) * 32 * 128);
    cr_assert_eq(kvt_ctx_recall_head_basis(x.ctx, 0, 0, &r, &id1), KVT_OK);
    cr_assert_eq(r, 32u);
    cr_assert_neq(id1, id0);
    const uint64_t archived = rr_check_sketches(&x);
    cr_assert_gt(archived, 20u);
    for (int i = 0; i < 60; i++) /* rounds after the refit archive and sketch with V2 */
        rr_step(&x, 1 + (uint32_t)(i % 3 == 0), i % 2 == 0);
    cr_assert_gt(rr_check_sketches(&x), archived, "rounds archived rows after the refit");
    kvt_layer_stats st = rr_stats(&x);
    cr_assert_eq(st.sketched_rows, st.archived_rows);
    free(V2);
    rr_fini(&x);
}

Test(rope_refit, refitted_head_sketches_equal_the_oracle, .timeout = 120) {
    refit_head_run(KVT_BACKEND_CPU, false, 3301);
    refit_head_run(KVT_BACKEND_GUARDED, false, 3302);
    refit_head_run(KVT_BACKEND_GUARDED, true, 3303);
    if (tu_cuda_backend_usable())
        refit_head_run(KVT_BACKEND_CUDA, false, 3304);
    /* an archive without key sketches (params.recall_sketch_rank 0): unsupported, named */
    rr x;
    rr_init(&x, 2, 64, rr_cfg(32, 8, 16), 0, NULL, KVT_BACKEND_CPU, 3305);
    rr_step(&x, 40, false);
    float *V = malloc(sizeof(float) * 8 * 64);
    tu_rng g = {.s = 9};
    cr_assert(V && tu_orthonormal_rows(&g, 8, 64, V));
    cr_assert_eq(kvt_ctx_refit_recall_head_basis(x.ctx, 0, 0, V, 8, 0, NULL),
                 KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "no archive key sketches"), "%s", kvt_last_error());
    free(V);
    rr_fini(&x);
}
