/*
 * test_attn_f32.c — the fast fp32 MLA decode attention (kernels/attn_f32.c) against the double
 * reference (kernels/attn.c) on random rows: contiguous ranges and gathers with gaps and out of
 * order, 1 row, row counts that leave partial tiles and partial micro-kernel blocks, head counts
 * that are not multiples of 16, bf16 / fp16 / fp32 rows, peaked softmaxes whose running max
 * moves from tile to tile (the online rescale), the empty set, NaN propagation, refused
 * arguments.
 *
 * Bound checked, per head: with A = max_j s·Σ_d |q_d·k_jd| (the scores' condition: an fp32 score
 * errs by up to γ_K·A, typically ~√K·u·A) and e = 2e-5 + 16·u·A (u = 2^-24),
 *     max_e |out − ref| <= e · max_e |ref| + 1e-7,
 *     |lse − ref| <= e · (1 + |ref|),  |max_score − max of the double scores| <= e · (1 + |max|).
 * On unit-variance data A ≈ 27 and e ≈ 4.6e-5; the peaked case has A ≈ 600.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attn.h"
#include "support/testutil.h"

#define K 576u
#define V 512u
#define TOL 2e-5

typedef struct setup {
    uint32_t n_slots, H;
    int dtype;
    size_t row_bytes, stride, offset;
    uint8_t *pool;
    float *q;
} setup;

static size_t dt_bytes(int dt) {
    return dt == KVT__DT_FP32 ? 4 : 2;
}

/* n_slots slots of two rows each (the row read is the second: row_offset = row_bytes); row values
 * normal, scaled by 1 + grow · slot (so later rows score higher: the max moves), queries normal
 * times qmul. */
static setup make(tu_rng *g, uint32_t n_slots, uint32_t H, int dt, double qmul, double grow) {
    setup s = {.n_slots = n_slots, .H = H, .dtype = dt};
    s.row_bytes = K * dt_bytes(dt);
    s.stride = 2 * s.row_bytes;
    s.offset = s.row_bytes;
    s.pool = malloc(s.stride * (n_slots ? n_slots : 1));
    s.q = malloc(sizeof(float) * H * (K + 3));
    cr_assert(s.pool && s.q);
    for (uint32_t j = 0; j < n_slots; j++)
        for (uint32_t r = 0; r < 2; r++)
            for (uint32_t i = 0; i < K; i++)
                kvt__store_elem(s.pool + j * s.stride + r * s.row_bytes, dt, i,
                                (float)(tu_normal(g) * (1.0 + grow * j)));
    for (uint32_t i = 0; i < H * (K + 3); i++)
        s.q[i] = (float)(tu_normal(g) * qmul);
    return s;
}

static void drop(setup *s) {
    free(s->pool);
    free(s->q);
}

/* Run both kernels over (slots, n) and compare within the bound above. */
static void check(const setup *s, const int32_t *slots, uint32_t n) {
    const uint32_t H = s->H;
    kvt__attn_args r = {.base = s->pool, .slots = slots, .n_rows = n, .slot_stride = s->stride,
                        .row_offset = s->offset, .dtype = s->dtype, .key_dim = K,
                        .value_dim = V, .q = s->q, .n_heads = H, .q_stride = K + 3,
                        .scale = KVT__ATTN_DEFAULT_SCALE};
    float *ro = malloc(sizeof(float) * H * V), *fo = malloc(sizeof(float) * H * V);
    double *rl = malloc(sizeof(double) * H);
    double *rs = malloc(sizeof(double) * kvt__attn_scratch_doubles(n, H, V, K));
    float *fl = malloc(sizeof(float) * H), *fm = malloc(sizeof(float) * H);
    float *fs = malloc(sizeof(float) * kvt__attn_f32_scratch_floats(H, K, V));
    r.out = ro;
    r.lse = rl;
    r.scratch = rs;
    cr_assert_eq(kvt__attn_cpu(&r), 0);
    kvt__attn_f32_args f = {.base = s->pool, .slots = slots, .n_rows = n,
                            .slot_stride = s->stride, .row_offset = s->offset,
                            .dtype = s->dtype, .key_dim = K, .value_dim = V, .q = s->q,
                            .n_heads = H, .q_stride = K + 3, .scale = KVT__ATTN_DEFAULT_SCALE,
                            .out = fo, .lse = fl, .max_score = fm, .scratch = fs};
    cr_assert_eq(kvt__attn_f32_cpu(&f), 0);
    double row[K];
    for (uint32_t h = 0; h < H; h++) {
        double ref_max = -INFINITY, err = 0, mag = 0, cond = 0;
        for (uint32_t j = 0; j < n; j++) {
            size_t slot = slots ? (size_t)slots[j] : j;
            for (uint32_t i = 0; i < K; i++)
                row[i] = kvt__attn_val(s->pool + slot * s->stride + s->offset, s->dtype, i);
            double sc = kvt__attn_score(row, s->q + (size_t)h * (K + 3), K,
                                        KVT__ATTN_DEFAULT_SCALE);
            ref_max = sc > ref_max ? sc : ref_max;
            double ab = 0;
            for (uint32_t i = 0; i < K; i++)
                ab += fabs(row[i] * s->q[(size_t)h * (K + 3) + i]);
            ab *= KVT__ATTN_DEFAULT_SCALE;
            cond = ab > cond ? ab : cond;
        }
        const double tol = TOL + 16.0 * 0x1p-24 * cond;
        for (uint32_t e = 0; e < V; e++) {
            double d = fabs((double)fo[h * V + e] - ro[h * V + e]);
            err = d > err ? d : err;
            mag = fabs(ro[h * V + e]) > mag ? fabs(ro[h * V + e]) : mag;
        }
        cr_assert(err <= tol * mag + 1e-7, "n %u head %u: out error %g of magnitude %g", n, h,
                  err, mag);
        cr_assert(fabs(fl[h] - rl[h]) <= tol * (1 + fabs(rl[h])), "n %u head %u: lse %g vs %g",
                  n, h, fl[h], rl[h]);
        cr_assert(fabs(fm[h] - ref_max) <= tol * (1 + fabs(ref_max)),
                  "n %u head %u: max %g vs %g", n, h, fm[h], ref_max);
    }
    free(ro);
    free(fo);
    free(rl);
    free(rs);
    free(fl);
    free(fm);
    free(fs);
}

Test(attn_f32, contiguous_ranges_match_the_reference) {
    tu_rng g = {.s = 11};
    setup s = make(&g, 200, 32, KVT__DT_BF16, 1.0, 0.0);
    /* micro-kernel blocks of 6 rows and tiles of 96: partial ones of every kind */
    static const uint32_t ns[] = {1, 5, 7, 97, 200};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
        check(&s, NULL, ns[i]);
    drop(&s);
}

Test(attn_f32, gathers_with_gaps_and_any_order_match_the_reference) {
    tu_rng g = {.s = 12};
    setup s = make(&g, 600, 32, KVT__DT_BF16, 1.0, 0.0);
    int32_t slots[200];
    for (uint32_t j = 0; j < 200; j++)
        slots[j] = (int32_t)(j * 3 + (j % 2)); /* gaps of 1 and 3 slots */
    check(&s, slots, 200);
    for (uint32_t j = 199; j > 0; j--) { /* shuffled */
        uint32_t k = (uint32_t)(tu_next(&g) % (j + 1));
        int32_t t = slots[j];
        slots[j] = slots[k];
        slots[k] = t;
    }
    check(&s, slots, 200);
    slots[0] = 599;
    check(&s, slots, 1);
    drop(&s);
}

Test(attn_f32, head_counts_off_the_tile_and_other_dtypes) {
    tu_rng g = {.s = 13};
    static const uint32_t hs[] = {1, 5, 17, 40};
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++) {
        setup s = make(&g, 130, hs[i], KVT__DT_BF16, 1.0, 0.0);
        check(&s, NULL, 130);
        drop(&s);
    }
    setup a = make(&g, 130, 16, KVT__DT_FP16, 1.0, 0.0);
    check(&a, NULL, 130);
    drop(&a);
    setup b = make(&g, 130, 16, KVT__DT_FP32, 1.0, 0.0);
    check(&b, NULL, 130);
    drop(&b);
}

/* Peaked softmaxes: scores spread over tens of units, growing along the rows, so the running max
 * moves in every tile and the accumulators are rescaled. */
Test(attn_f32, peaked_softmax_with_a_moving_max) {
    tu_rng g = {.s = 14};
    setup s = make(&g, 300, 32, KVT__DT_BF16, 4.0, 0.015);
    check(&s, NULL, 300);
    drop(&s);
}

Test(attn_f32, empty_set_nan_and_refusals) {
    tu_rng g = {.s = 15};
    setup s = make(&g, 20, 8, KVT__DT_BF16, 1.0, 0.0);
    float out[8 * V], lse[8], mx[8];
    float *fs = malloc(sizeof(float) * kvt__attn_f32_scratch_floats(8, K, V));
    for (uint32_t i = 0; i < 8 * V; i++)
        out[i] = 1.0f;
    kvt__attn_f32_args f = {.base = s.pool, .n_rows = 0, .slot_stride = s.stride,
                            .row_offset = s.offset, .dtype = KVT__DT_BF16, .key_dim = K,
                            .value_dim = V, .q = s.q, .n_heads = 8, .q_stride = K + 3,
                            .scale = KVT__ATTN_DEFAULT_SCALE, .out = out, .lse = lse,
                            .max_score = mx, .scratch = fs};
    cr_assert_eq(kvt__attn_f32_cpu(&f), 0);
    for (uint32_t h = 0; h < 8; h++) {
        cr_assert(isinf(lse[h]) && lse[h] < 0);
        cr_assert(isinf(mx[h]) && mx[h] < 0);
        for (uint32_t e = 0; e < V; e++)
            cr_assert_eq(out[h * V + e], 0.0f);
    }
    /* a NaN value in one row: every head's output and lse are NaN */
    kvt__store_elem(s.pool + 7 * s.stride + s.offset, KVT__DT_BF16, 3, NAN);
    f.n_rows = 20;
    cr_assert_eq(kvt__attn_f32_cpu(&f), 0);
    for (uint32_t h = 0; h < 8; h++) {
        cr_assert(isnan(out[h * V + 3]), "head %u", h);
        cr_assert(isnan(lse[h]), "head %u", h);
    }
    /* refusals: nothing written */
    out[0] = 5.0f;
    kvt__attn_f32_args bad = f;
    bad.scratch = NULL;
    cr_assert_eq(kvt__attn_f32_cpu(&bad), -1);
    bad = f;
    bad.value_dim = K + 1;
    cr_assert_eq(kvt__attn_f32_cpu(&bad), -1);
    bad = f;
    bad.q_stride = K - 1;
    cr_assert_eq(kvt__attn_f32_cpu(&bad), -1);
    bad = f;
    bad.dtype = KVT__DT_FP8;
    cr_assert_eq(kvt__attn_f32_cpu(&bad), -1);
    int32_t neg[2] = {0, -1};
    bad = f;
    bad.slots = neg;
    bad.n_rows = 2;
    cr_assert_eq(kvt__attn_f32_cpu(&bad), -1);
    cr_assert_eq(out[0], 5.0f);
    free(fs);
    drop(&s);
}
