/*
 * test_fp8.c — recall on fp8 rows (FlashMLA's 656-B ds_mla layout: 512 E4M3 latent values, 4 fp32
 * scales, 64 bf16 branch values; kernels/kvt_hd.h). The decoder is checked against an
 * independent one on every byte; then an fp8 layer and an fp32 layer holding exactly the decoded
 * values (decoded by the test, not the library) are driven in lockstep through a conformal decode
 * with needle queries: their sketch planes, emitted sets and trigger statistics must be equal bit
 * for bit, on the CPU and guarded backends (and CUDA where a device is), with kvt_seq_check after
 * every step. The same for random eviction with VaSE on an MLA-RoPE layer: its value ranges read
 * the fp8 rows' scales, so both layers keep, archive and emit the same rows.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvt_hd.h"
#include "kvtier.h"
#include "lib/handles.h"
#include "support/testutil.h"
#include "tiers/tiers_internal.h" /* white-box: the policies' states */

#define D 512u
#define QD 576u
#define RB 16u
#define H 4u
#define PR 16u
#define BLOCK 64u
#define NMAX 768u
#define ROW8 656u
#define ROW32 2304u /* 576 fp32 values: the first 512 the latent; the same 64 bf16 branch values at byte 2048 */

/* The E4M3 ("FN") value of a byte by its definition, in double. */
static double e4m3_ref(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7)
        return NAN;
    double v = e == 0 ? ldexp(m, -9) : ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

Test(fp8, e4m3_decoder_on_every_byte_and_the_scaled_layout) {
    for (unsigned b = 0; b < 256; b++) {
        double want = e4m3_ref((uint8_t)b);
        float got = kvt__e4m3_to_f32((uint8_t)b);
        if (isnan(want)) {
            cr_assert(isnan(got), "byte 0x%02x", b);
            continue;
        }
        cr_assert_eq((double)got, want, "byte 0x%02x: %a vs %a", b, (double)got, want);
        cr_assert_eq(signbit(got) != 0, (b & 0x80) != 0, "byte 0x%02x sign", b);
    }
    cr_assert_eq(kvt__e4m3_to_f32(0x7e), 448.0f); /* the largest finite value */
    cr_assert_eq(kvt__e4m3_to_f32(0x01), 0x1p-9f); /* the smallest subnormal */
    /* A row: value i = e4m3(byte i) · scale[i / 128], one fp32 rounding. */
    uint8_t row[ROW8];
    memset(row, 0, sizeof row);
    const float scales[4] = {0.5f, 3.0f, 1e-3f, -7.25f};
    memcpy(row + 512, scales, sizeof scales);
    for (uint32_t i = 0; i < 512; i++)
        row[i] = (uint8_t)((i * 37u + 11u) & 0xffu);
    for (uint32_t i = 0; i < 512; i++) {
        float want = (float)((double)kvt__e4m3_to_f32(row[i]) * (double)scales[i / 128]);
        float got = kvt__load_elem(row, KVT__DT_FP8, i);
        if (isnan(want))
            cr_assert(isnan(got), "value %u", i);
        else
            cr_assert_eq(got, want, "value %u", i);
    }
}

/* One side of the lockstep: a context whose one layer stores fp8 or fp32 rows. */
typedef struct side {
    kvt_model *m;
    kvt_ctx *ctx;
    kvt_batch *b;
    kvt_seq *seq;
    uint32_t row_bytes;
    kvt_buffer *qbuf, *ibuf, *lbuf;
} side;

/* V non-NULL: an MLA-NoPE salience layer with conformal recall over basis V; NULL: an MLA-RoPE
 * random-eviction layer with VaSE and an archive (no recall). */
static void side_open(side *s, bool fp8, kvt_backend_kind be, const float *V) {
    memset(s, 0, sizeof *s);
    kvt_layer_spec sp = {.kind = V ? KVT_LAYER_MLA_NOPE : KVT_LAYER_MLA_ROPE,
                         .dtype = fp8 ? KVT_DTYPE_FP8_E4M3 : KVT_DTYPE_FP32,
                         .n_kv_heads = 1, .n_planes = 1, .head_dim = QD, .value_dim = D,
                         .branch_dim = 64, .row_bytes = fp8 ? ROW8 : ROW32,
                         .branch_offset = fp8 ? 528 : 2048, .branch_dtype = KVT_DTYPE_BF16,
                         .n_q_heads = H};
    s->row_bytes = sp.row_bytes;
    char err[256];
    cr_assert_eq(kvt_model_create(&sp, 1, fp8 ? "fp8" : "fp32", &s->m, err, sizeof err), KVT_OK,
                 "%s", err);
    kvt_config c = kvt_config_default();
    c.block_rows = BLOCK;
    c.kappa = 4;
    c.ratio = 8;
    c.recall = V ? KVT_RECALL_CONFORMAL : KVT_RECALL_OFF;
    c.evict_budget_rows = 64;
    c.recent_rows = 8;
    c.cadence_rows = 16;
    c.evict_vase = true;
    c.evict_archive = true;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = s->m;
    p.config = &c;
    p.page_rows = PR;
    p.n_pages = 2 * NMAX / PR;
    p.backend = be;
    p.recall_sketch_rank = V ? RB : 0;
    kvt_status cs = kvt_ctx_create(&p, &s->ctx, err, sizeof err);
    if (cs != KVT_OK && be == KVT_BACKEND_CUDA) {
        kvt_model_destroy(s->m);
        if (getenv("KVT_REQUIRE_GPU"))
            cr_assert_fail("KVT_REQUIRE_GPU set but the CUDA context did not open: %s", err);
        cr_skip_test("CUDA backend unavailable: %s", err);
    }
    cr_assert_eq(cs, KVT_OK, "%s", err);
    if (V)
        cr_assert_eq(kvt_ctx_set_recall_basis(s->ctx, 0, V, RB), KVT_OK, "%s",
                     kvt_last_error());
    cr_assert_eq(kvt_batch_create(s->ctx, 1, &s->b), KVT_OK);
    cr_assert_eq(tu_seq_create(s->ctx, 3, &s->seq), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_buffer_alloc(s->ctx, sizeof(float) * QD * H, &s->qbuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(s->ctx, sizeof(int32_t) * NMAX, &s->ibuf), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(s->ctx, sizeof(int32_t), &s->lbuf), KVT_OK);
}

static void side_close(side *s) {
    kvt_ctx_destroy(s->ctx);
    kvt_model_destroy(s->m);
}

/* Nearest finite E4M3 code of x (ties: the even code), by search: the test's own encoder. */
static uint8_t e4m3_encode(float x) {
    uint8_t best = 0;
    double bd = INFINITY;
    for (unsigned b = 0; b < 0x7f; b++) {
        double d = fabs(fabs((double)x) - e4m3_ref((uint8_t)b));
        if (d < bd || (d == bd && (b & 1) == 0)) {
            bd = d;
            best = (uint8_t)b;
        }
    }
    return (uint8_t)(best | (x < 0 ? 0x80 : 0));
}

/* A row in both layouts: the latent quantised to fp8 with one scale per 128 values, and its
 * decoded values (the test's decoder) as fp32; the same bf16 branch. latent[] returns them. */
static void make_rows(tu_rng *g, const float *V, uint8_t *r8, uint8_t *r32, float *latent) {
    float c[D];
    for (uint32_t d = 0; d < D; d++)
        c[d] = (float)(0.05 * tu_normal(g));
    for (uint32_t k = 0; k < 8; k++) {
        float a = (float)tu_normal(g);
        for (uint32_t d = 0; d < D; d++)
            c[d] += a * V[(size_t)k * D + d];
    }
    for (uint32_t grp = 0; grp < 4; grp++) {
        float mx = 0;
        for (uint32_t d = grp * 128; d < grp * 128 + 128; d++)
            mx = fmaxf(mx, fabsf(c[d]));
        float scale = mx > 0 ? mx / 448.0f : 1.0f;
        memcpy(r8 + 512 + 4 * grp, &scale, 4);
        for (uint32_t d = grp * 128; d < grp * 128 + 128; d++) {
            r8[d] = e4m3_encode(c[d] / scale);
            latent[d] = (float)(e4m3_ref(r8[d]) * (double)scale);
            memcpy(r32 + 4 * d, &latent[d], 4);
        }
    }
    for (uint32_t j = 0; j < 64; j++) {
        uint16_t h = kvt__f32_to_bf16((float)tu_normal(g));
        memcpy(r8 + 528 + 2 * j, &h, 2);
        memcpy(r32 + 2048 + 2 * j, &h, 2);
    }
}

static void reserve_write(side *s, uint32_t n, const uint8_t *rows) {
    cr_assert_eq(kvt_batch_reserve(s->b, &s->seq, &n, 1), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_write(s->seq, 0, 0, 0, n, rows, (size_t)n * s->row_bytes), KVT_OK,
                 "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_plan(s->b), KVT_OK);
}

/* One decode step of a side: run with the queries (NULL: none), emitted set out, commit,
 * check. */
static uint32_t side_step(side *s, const float *q, int32_t *idx) {
    uint32_t topk;
    cr_assert_eq(kvt_batch_capacity(s->b, 0, &topk, NULL), KVT_OK);
    if (q) /* NULL: no recall on the side's layer */
        cr_assert_eq(kvt_buffer_write(s->qbuf, 0, q, sizeof(float) * QD * H), KVT_OK);
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS,
                  .indices = kvt_buffer_ptr(s->ibuf), .capacity = topk,
                  .lengths = kvt_buffer_ptr(s->lbuf)};
    cr_assert_eq(kvt_batch_run(s->b, 0, q ? kvt_buffer_ptr(s->qbuf) : NULL, NULL, &e), KVT_OK,
                 "%s", kvt_last_error());
    int32_t len;
    cr_assert_eq(kvt_buffer_read(s->lbuf, 0, &len, sizeof len), KVT_OK);
    cr_assert_eq(kvt_buffer_read(s->ibuf, 0, idx, sizeof(int32_t) * (size_t)len), KVT_OK);
    cr_assert_eq(kvt_batch_commit(s->b, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(s->seq), KVT_OK, "%s", kvt_last_error());
    return (uint32_t)len;
}

static void planes_equal(const side *a, const side *b) {
    const kvt__sal *sa = &kvt__seq_state(a->seq, 0)->sal, *sb = &kvt__seq_state(b->seq, 0)->sal;
    cr_assert_eq(sa->closed_rows, sb->closed_rows);
    size_t n = sa->closed_rows;
    if (!n)
        return;
    uint16_t *ca = malloc(2 * RB * n), *cb = malloc(2 * RB * n);
    float *ra = malloc(4 * n), *rb = malloc(4 * n);
    cr_assert(ca && cb && ra && rb);
    const kvt__backend *ba = &a->ctx->backend, *bb = &b->ctx->backend;
    cr_assert_eq(ba->ops->read(ba, ca, sa->csk, 2 * RB * n, NULL), KVT_OK);
    cr_assert_eq(bb->ops->read(bb, cb, sb->csk, 2 * RB * n, NULL), KVT_OK);
    cr_assert_eq(ba->ops->read(ba, ra, sa->rho, 4 * n, NULL), KVT_OK);
    cr_assert_eq(bb->ops->read(bb, rb, sb->rho, 4 * n, NULL), KVT_OK);
    cr_assert(memcmp(ca, cb, 2 * RB * n) == 0, "sketch coefficients differ");
    cr_assert(memcmp(ra, rb, 4 * n) == 0, "residual norms differ");
    free(ca);
    free(cb);
    free(ra);
    free(rb);
}

static void lockstep(kvt_backend_kind be) {
    tu_rng g = {.s = 99};
    float *V = malloc(sizeof(float) * RB * D);
    float *lat = malloc(sizeof(float) * D * NMAX);
    uint8_t *r8 = malloc((size_t)ROW8 * NMAX), *r32 = malloc((size_t)ROW32 * NMAX);
    cr_assert(V && lat && r8 && r32);
    cr_assert(tu_orthonormal_rows(&g, RB, D, V));
    side a, b;
    side_open(&a, true, be, V);
    side_open(&b, false, be, V);
    const uint32_t n0 = 4 * BLOCK;
    for (uint32_t u = 0; u < n0; u++)
        make_rows(&g, V, r8 + (size_t)u * ROW8, r32 + (size_t)u * ROW32, lat + (size_t)u * D);
    reserve_write(&a, n0, r8);
    reserve_write(&b, n0, r32);
    cr_assert_eq(kvt_batch_commit(a.b, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_commit(b.b, NULL), KVT_OK, "%s", kvt_last_error());
    planes_equal(&a, &b);
    static int32_t ia[NMAX], ib[NMAX];
    float q[H * QD];
    uint64_t n = n0;
    for (uint32_t step = 0; n < NMAX; step++, n++) {
        make_rows(&g, V, r8 + n * ROW8, r32 + n * ROW32, lat + n * D);
        reserve_write(&a, 1, r8 + n * ROW8);
        reserve_write(&b, 1, r32 + n * ROW32);
        /* filler queries in the basis's span; every 5th step after calibration one head points
         * at an old row (a needle: most are archived at ratio 8) */
        for (uint32_t h = 0; h < H; h++) {
            float *qh = q + h * QD;
            memset(qh, 0, sizeof(float) * QD);
            for (uint32_t k = 0; k < RB; k++) {
                float w = (float)(0.3 * tu_normal(&g));
                for (uint32_t d = 0; d < D; d++)
                    qh[d] += w * V[(size_t)k * D + d];
            }
            for (uint32_t j = 0; j < 64; j++)
                qh[D + j] = (float)(0.1 * tu_normal(&g));
        }
        if (step >= 24 && step % 5 == 0) {
            uint64_t target = tu_next(&g) % (n0 - 8) + 4;
            for (uint32_t d = 0; d < D; d++)
                q[d] = 0.25f * lat[target * D + d];
        }
        uint32_t la = side_step(&a, q, ia), lb = side_step(&b, q, ib);
        cr_assert_eq(la, lb, "step %u: %u vs %u rows", step, la, lb);
        cr_assert(memcmp(ia, ib, sizeof(int32_t) * la) == 0, "step %u: emitted sets differ", step);
        if (kvt_seq_length(a.seq) % BLOCK == 0)
            planes_equal(&a, &b);
    }
    planes_equal(&a, &b);
    kvt_layer_stats sa = {.struct_size = sizeof sa}, sb = {.struct_size = sizeof sb};
    cr_assert_eq(kvt_seq_layer_stats(a.seq, 0, &sa), KVT_OK);
    cr_assert_eq(kvt_seq_layer_stats(b.seq, 0, &sb), KVT_OK);
    cr_assert_eq(sa.recall_z, sb.recall_z);
    cr_assert_eq(sa.recall_fired_rows, sb.recall_fired_rows);
    cr_assert_eq(sa.recall_fetched_rows, sb.recall_fetched_rows);
    cr_assert_eq(sa.sketched_rows, sb.sketched_rows);
    cr_assert_eq(sa.recall_phase, 1, "calibrated (phase %d)", sa.recall_phase);
    /* the lockstep compared something: rows fired after calibration */
    cr_assert_gt(sa.recall_fired_rows, 0, "no row fired: the needle steps tested nothing");
    side_close(&a);
    side_close(&b);
    free(V);
    free(lat);
    free(r8);
    free(r32);
}

Test(fp8, ds_mla_rows_recall_as_their_decoded_fp32_values_cpu, .timeout = 240) {
    lockstep(KVT_BACKEND_CPU);
}

Test(fp8, ds_mla_rows_recall_as_their_decoded_fp32_values_guarded, .timeout = 240) {
    lockstep(KVT_BACKEND_GUARDED);
}

/* On a device: the CUDA kernels read the fp8 rows (sketches, scan, emission); skips without. */
Test(fp8, ds_mla_rows_recall_as_their_decoded_fp32_values_cuda, .timeout = 240) {
    lockstep(KVT_BACKEND_CUDA);
}

/* ---------------------------------------------------------------------------------------------
 * Random eviction with VaSE on an MLA-RoPE layer: the value range (kernels/evict.h) of an fp8 row
 * reads its 512 latent values through their scales, so an fp8 layer and an fp32 layer of the
 * decoded values keep the same rows (the draws are positional), archive the same count and emit
 * the same slots at every step, rounds included.
 * ------------------------------------------------------------------------------------------- */
static void evict_lockstep(kvt_backend_kind be) {
    tu_rng g = {.s = 1234};
    float *V = malloc(sizeof(float) * RB * D), *lat = malloc(sizeof(float) * D);
    uint8_t *r8 = malloc(ROW8), *r32 = malloc(ROW32);
    cr_assert(V && lat && r8 && r32);
    cr_assert(tu_orthonormal_rows(&g, RB, D, V));
    side a, b;
    side_open(&a, true, be, NULL);
    side_open(&b, false, be, NULL);
    static int32_t ia[NMAX], ib[NMAX];
    static int64_t pa[NMAX], pb[NMAX];
    for (uint32_t step = 0; step < 400; step++) {
        make_rows(&g, V, r8, r32, lat);
        reserve_write(&a, 1, r8);
        reserve_write(&b, 1, r32);
        uint32_t la = side_step(&a, NULL, ia), lb = side_step(&b, NULL, ib);
        cr_assert_eq(la, lb, "step %u: %u vs %u rows", step, la, lb);
        cr_assert(memcmp(ia, ib, sizeof(int32_t) * la) == 0, "step %u: emitted sets differ", step);
        /* the rows behind the slots: the same original positions (a round compacts whichever
         * rows it keeps into the same slots) */
        uint64_t na = 0, nb = 0;
        cr_assert_eq(kvt_seq_positions(a.seq, 0, 0, pa, NMAX, &na), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_seq_positions(b.seq, 0, 0, pb, NMAX, &nb), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(na, nb);
        cr_assert(memcmp(pa, pb, sizeof(int64_t) * na) == 0, "step %u: kept positions differ",
                  step);
    }
    kvt_layer_stats sa = {.struct_size = sizeof sa}, sb = {.struct_size = sizeof sb};
    cr_assert_eq(kvt_seq_layer_stats(a.seq, 0, &sa), KVT_OK);
    cr_assert_eq(kvt_seq_layer_stats(b.seq, 0, &sb), KVT_OK);
    cr_assert_gt(sa.rounds, 10, "rounds ran: %llu", (unsigned long long)sa.rounds);
    cr_assert_eq(sa.rounds, sb.rounds);
    cr_assert_eq(sa.archived_rows, sb.archived_rows);
    cr_assert_eq(sa.attended_rows, sb.attended_rows);
    side_close(&a);
    side_close(&b);
    free(V);
    free(lat);
    free(r8);
    free(r32);
}

Test(fp8, ds_mla_rows_evict_with_vase_as_their_decoded_fp32_values_cpu, .timeout = 120) {
    evict_lockstep(KVT_BACKEND_CPU);
}

Test(fp8, ds_mla_rows_evict_with_vase_as_their_decoded_fp32_values_guarded, .timeout = 120) {
    evict_lockstep(KVT_BACKEND_GUARDED);
}

/* On a device: the CUDA round reads the fp8 rows' values for VaSE; skips without. */
Test(fp8, ds_mla_rows_evict_with_vase_as_their_decoded_fp32_values_cuda, .timeout = 120) {
    evict_lockstep(KVT_BACKEND_CUDA);
}
