/*
 * test_attend.c — the backends' reference attention op (kvt__backend_ops.attend) over index sets
 * in the TOKENS layout kvt_batch_run emits: on the CPU and guarded backends it equals
 * kvt__attn_cpu query by query, bit for bit (a long set, an empty one, one row, a set holding a
 * NaN row; entries past a query's length are never read); a length outside [0, topk], a negative
 * listed slot and bad shapes are refused with nothing written; fp8 ds_mla rows (656 B) attend
 * exactly as their fp32 decoding does. The CUDA twin is held to this one
 * in test_cuda (cuda::attend_equals_the_cpu).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attn.h"
#include "kernels/backend.h"
#include "lib/base/alloc.h"
#include "support/testutil.h"

enum { K = 576, V = 512, H = 4, NQ = 4, TOPK = 300, NS = 601 };

typedef struct cas {
    size_t row_bytes, stride;
    uint8_t *pool; /* NS slots of two rows; the second is read (row_offset = row_bytes) */
    float *q;      /* [NQ][H][K + 2] */
    int32_t idx[NQ * TOPK], len[NQ];
} cas;

/* Random bf16 rows; slot NS - 1 holds a NaN and is listed by query 3 only; entries past each
 * length are -1 (they must not be read). */
static void cas_make(cas *c, tu_rng *g) {
    c->row_bytes = K * 2;
    c->stride = 2 * c->row_bytes;
    c->pool = malloc(c->stride * NS);
    c->q = malloc(sizeof(float) * NQ * H * (K + 2));
    cr_assert(c->pool && c->q);
    for (uint32_t j = 0; j < NS; j++)
        for (uint32_t i = 0; i < 2 * K; i++)
            kvt__store_elem(c->pool + j * c->stride, KVT__DT_BF16, i, (float)tu_normal(g));
    kvt__store_elem(c->pool + (NS - 1) * c->stride + c->row_bytes, KVT__DT_BF16, 7, NAN);
    for (uint32_t i = 0; i < NQ * H * (K + 2); i++)
        c->q[i] = (float)tu_normal(g);
    const int32_t lens[NQ] = {TOPK, 0, 1, 137};
    for (uint32_t i = 0; i < NQ; i++) {
        c->len[i] = lens[i];
        for (uint32_t j = 0; j < TOPK; j++)
            c->idx[i * TOPK + j] = (int32_t)j < lens[i] ? (int32_t)(tu_next(g) % (NS - 1)) : -1;
    }
    c->idx[3 * TOPK + 60] = NS - 1;
}

static void cas_free(cas *c) {
    free(c->pool);
    free(c->q);
}

static kvt__attend_args args_of(const cas *c, float *out, double *lse) {
    return (kvt__attend_args){.base = c->pool,
                              .slot_stride = c->stride,
                              .row_offset = c->row_bytes,
                              .dtype = KVT__DT_BF16,
                              .key_dim = K,
                              .value_dim = V,
                              .idx = c->idx,
                              .len = c->len,
                              .topk = TOPK,
                              .n_q = NQ,
                              .q = c->q,
                              .n_heads = H,
                              .q_stride = K + 2,
                              .scale = KVT__ATTN_DEFAULT_SCALE,
                              .out = out,
                              .lse = lse};
}

/* kvt__attn_cpu, query by query. */
static void expected(const cas *c, float *out, double *lse) {
    double *scratch = malloc(sizeof(double) * kvt__attn_scratch_doubles(TOPK, H, V, K));
    for (uint32_t i = 0; i < NQ; i++) {
        kvt__attn_args x = {.base = c->pool,
                            .slots = c->idx + i * TOPK,
                            .n_rows = (uint32_t)c->len[i],
                            .slot_stride = c->stride,
                            .row_offset = c->row_bytes,
                            .dtype = KVT__DT_BF16,
                            .key_dim = K,
                            .value_dim = V,
                            .q = c->q + (size_t)i * H * (K + 2),
                            .n_heads = H,
                            .q_stride = K + 2,
                            .scale = KVT__ATTN_DEFAULT_SCALE,
                            .out = out + (size_t)i * H * V,
                            .lse = lse + i * H,
                            .scratch = scratch};
        cr_assert_eq(kvt__attn_cpu(&x), 0);
    }
    free(scratch);
}

/* What the cases must show: query 1 empty (0, -Inf), query 3 NaN on every head (the NaN is in
 * the key part every head reads), the others finite. */
static void expected_shape(const float *out, const double *lse) {
    for (uint32_t h = 0; h < H; h++) {
        cr_assert(isfinite(lse[0 * H + h]) && isfinite(lse[2 * H + h]));
        cr_assert(isinf(lse[1 * H + h]) && lse[1 * H + h] < 0);
        cr_assert(isnan(lse[3 * H + h]));
        for (uint32_t d = 0; d < V; d++) {
            cr_assert_eq(out[(1 * H + h) * V + d], 0.0f);
            cr_assert(isnan(out[(3 * H + h) * V + d]));
            cr_assert(isfinite(out[(0 * H + h) * V + d]));
        }
    }
}

/* A case and a backend (CPU, or guarded) on the libc allocator. */
typedef struct fx {
    cas c;
    kvt__alloc al;
    kvt__backend be;
    bool guarded;
} fx;

static void fx_open(fx *f, uint64_t seed, bool guarded) {
    memset(f, 0, sizeof *f);
    tu_rng g = {seed};
    cas_make(&f->c, &g);
    cr_assert_eq(kvt__alloc_init(&f->al, KVT_ALLOC_LIBC), KVT_OK);
    f->be = (kvt__backend){.ops = kvt__backend_cpu_ops(), .alloc = &f->al};
    f->guarded = guarded;
    char why[256] = "";
    if (guarded)
        cr_assert_eq(kvt__backend_guarded_open(&f->be, why, sizeof why), KVT_OK, "%s", why);
}

static void fx_close(fx *f) {
    if (f->guarded)
        kvt__backend_cpu_close(&f->be);
    kvt__alloc_fini(&f->al);
    cas_free(&f->c);
}

Test(attend, cpu_backend_equals_the_twin_query_by_query) {
    fx f;
    fx_open(&f, 0xa77e, false);
    cas c = f.c;
    kvt__backend be = f.be;
    float *want = malloc(sizeof(float) * NQ * H * V), *got = malloc(sizeof(float) * NQ * H * V);
    double want_lse[NQ * H], got_lse[NQ * H];
    expected(&c, want, want_lse);
    expected_shape(want, want_lse);
    kvt__attend_args a = args_of(&c, got, got_lse);
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_OK);
    cr_assert_eq(memcmp(got, want, sizeof(float) * NQ * H * V), 0);
    cr_assert_eq(memcmp(got_lse, want_lse, sizeof want_lse), 0);
    /* lse only, out only */
    memset(got_lse, 0, sizeof got_lse);
    a.out = NULL;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_OK);
    cr_assert_eq(memcmp(got_lse, want_lse, sizeof want_lse), 0);
    memset(got, 0, sizeof(float) * NQ * H * V);
    a = args_of(&c, got, NULL);
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_OK);
    cr_assert_eq(memcmp(got, want, sizeof(float) * NQ * H * V), 0);
    free(want);
    free(got);
    fx_close(&f);
}

Test(attend, bad_sets_and_shapes_are_refused_with_nothing_written) {
    fx f;
    fx_open(&f, 0xbad5, false);
    cas *cp = &f.c;
    kvt__backend be = f.be;
    float *out = malloc(sizeof(float) * NQ * H * V);
    double lse[NQ * H];
    memset(out, 0x5a, sizeof(float) * NQ * H * V);
    memset(lse, 0x5a, sizeof lse);
    kvt__attend_args a = args_of(cp, out, lse);
    cp->len[2] = TOPK + 1; /* a length past topk */
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    cp->len[2] = -1;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    cp->len[2] = 1;
    cp->idx[3 * TOPK + 5] = -4; /* a negative listed slot (query 3, inside its length) */
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    cp->idx[3 * TOPK + 5] = 0;
    const kvt__attend_args good = a;
    a.key_dim = 0;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    a = good;
    a.key_dim = KVT__ATTN_MAX_DIM + 1;
    a.q_stride = KVT__ATTN_MAX_DIM + 1;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    a = good;
    a.value_dim = K + 1;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    a = good;
    a.q_stride = K - 1;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    a = good;
    a.dtype = 7; /* no such dtype */
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    a = good;
    a.dtype = KVT__DT_FP8; /* an fp8 key has 576 values */
    a.key_dim = K + 1;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    a = good;
    a.n_heads = 0;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    a = good;
    a.idx = NULL;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    for (size_t i = 0; i < sizeof(float) * NQ * H * V; i++)
        cr_assert_eq(((uint8_t *)out)[i], 0x5a, "byte %zu of out written", i);
    for (size_t i = 0; i < sizeof lse; i++)
        cr_assert_eq(((uint8_t *)lse)[i], 0x5a, "byte %zu of lse written", i);
    /* no queries: nothing to do, nothing read */
    a = good;
    a.n_q = 0;
    a.idx = NULL;
    a.len = NULL;
    a.q = NULL;
    a.base = NULL;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_OK);
    free(out);
    fx_close(&f);
}

/* The guarded backend: every argument a buffer of its own (the host cannot touch them), the same
 * results byte for byte, the same refusals. */
Test(attend, guarded_backend_reads_only_its_buffers_and_equals_the_twin) {
    fx f;
    fx_open(&f, 0x6a4d, true);
    cas c = f.c;
    kvt__backend be = f.be;
    const size_t b_pool = c.stride * NS, b_q = sizeof(float) * NQ * H * (K + 2);
    const size_t b_out = sizeof(float) * NQ * H * V, b_lse = sizeof(double) * NQ * H;
    void *d_pool, *d_q, *d_idx, *d_len, *d_out, *d_lse;
    const struct {
        void **d;
        const void *h;
        size_t n;
    } bufs[6] = {{&d_pool, c.pool, b_pool},     {&d_q, c.q, b_q},
                 {&d_idx, c.idx, sizeof c.idx}, {&d_len, c.len, sizeof c.len},
                 {&d_out, NULL, b_out},         {&d_lse, NULL, b_lse}};
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(be.ops->buf_alloc(&be, bufs[i].n, bufs[i].d), KVT_OK);
        if (bufs[i].h)
            cr_assert_eq(be.ops->write(&be, *bufs[i].d, bufs[i].h, bufs[i].n, NULL), KVT_OK);
    }
    kvt__attend_args a = args_of(&c, d_out, d_lse);
    a.base = d_pool;
    a.q = d_q;
    a.idx = d_idx;
    a.len = d_len;
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_OK);
    float *want = malloc(b_out), *got = malloc(b_out);
    double want_lse[NQ * H], got_lse[NQ * H];
    expected(&c, want, want_lse);
    cr_assert_eq(be.ops->read(&be, got, d_out, b_out, NULL), KVT_OK);
    cr_assert_eq(be.ops->read(&be, got_lse, d_lse, b_lse, NULL), KVT_OK);
    cr_assert_eq(memcmp(got, want, b_out), 0);
    cr_assert_eq(memcmp(got_lse, want_lse, b_lse), 0);
    /* host memory passed where a buffer belongs is refused, not read */
    kvt__attend_args h = a;
    h.q = c.q;
    cr_assert_neq(be.ops->attend(&be, &h, NULL), KVT_OK);
    h = a;
    h.out = got;
    cr_assert_neq(be.ops->attend(&be, &h, NULL), KVT_OK);
    /* a listed slot past the pool's buffer: refused, not read */
    int32_t far = INT32_MAX; /* (regions are page-rounded: a slot just past the end may be in) */
    cr_assert_eq(be.ops->write(&be, (int32_t *)d_idx + 3, &far, sizeof far, NULL), KVT_OK);
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVARIANT);
    cr_assert_eq(be.ops->write(&be, (int32_t *)d_idx + 3, &c.idx[3], sizeof far, NULL), KVT_OK);
    /* a bad length in the device set: refused like the CPU backend's */
    int32_t bad = TOPK + 1;
    cr_assert_eq(be.ops->write(&be, (int32_t *)d_len + 2, &bad, sizeof bad, NULL), KVT_OK);
    cr_assert_eq(be.ops->attend(&be, &a, NULL), KVT_ERR_INVALID_ARGUMENT);
    for (int i = 0; i < 6; i++)
        be.ops->buf_free(&be, *bufs[i].d, bufs[i].n);
    free(want);
    free(got);
    fx_close(&f);
}

/* Key value i of a ds_mla row, decoded from the layout itself: E4M3 byte i times the fp32 scale
 * of its group of 128 (latent), or bf16 value i - 512 of the branch at byte 528. */
static float fp8_decoded(const uint8_t *row, uint32_t i) {
    if (i >= 512) {
        uint16_t h;
        memcpy(&h, row + 528 + 2 * (i - 512), 2);
        uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    float sc;
    memcpy(&sc, row + 512 + 4 * (i / 128), 4);
    return kvt__e4m3_to_f32(row[i]) * sc;
}

/* fp8 rows attend as their exact fp32 decoding does, bit for bit (the same widened values in
 * the same order); an E4M3 NaN byte in a listed row makes its query NaN. */
Test(attend, fp8_rows_attend_as_their_fp32_decoding) {
    fx f;
    fx_open(&f, 0xf8f8, false);
    cas c = f.c; /* its index sets, lengths and queries */
    enum { R8 = 656 };
    uint8_t *p8 = malloc((size_t)R8 * NS), *p32 = malloc((size_t)4 * K * NS);
    tu_rng g = {0x88};
    for (uint32_t j = 0; j < NS; j++) {
        tu_fp8_row(&g, p8 + (size_t)j * R8);
        for (uint32_t i = 0; i < K; i++)
            kvt__store_elem(p32 + (size_t)j * 4 * K, KVT__DT_FP32, i,
                            fp8_decoded(p8 + (size_t)j * R8, i));
    }
    p8[(size_t)(NS - 1) * R8 + 9] = 0x7f; /* the slot query 3 lists */
    kvt__store_elem(p32 + (size_t)(NS - 1) * 4 * K, KVT__DT_FP32, 9,
                    fp8_decoded(p8 + (size_t)(NS - 1) * R8, 9));
    float *o8 = malloc(sizeof(float) * NQ * H * V), *o32 = malloc(sizeof(float) * NQ * H * V);
    double l8[NQ * H], l32[NQ * H];
    kvt__attend_args a = args_of(&c, o8, l8);
    a.base = p8;
    a.slot_stride = R8;
    a.row_offset = 0;
    a.dtype = KVT__DT_FP8;
    cr_assert_eq(f.be.ops->attend(&f.be, &a, NULL), KVT_OK);
    a = args_of(&c, o32, l32);
    a.base = p32;
    a.slot_stride = 4 * K;
    a.row_offset = 0;
    a.dtype = KVT__DT_FP32;
    cr_assert_eq(f.be.ops->attend(&f.be, &a, NULL), KVT_OK);
    cr_assert_eq(memcmp(o8, o32, sizeof(float) * NQ * H * V), 0);
    cr_assert_eq(memcmp(l8, l32, sizeof l8), 0);
    expected_shape(o8, l8);
    free(p8);
    free(p32);
    free(o8);
    free(o32);
    fx_close(&f);
}
