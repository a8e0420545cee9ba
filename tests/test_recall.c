/*
 * test_recall.c — the recall tier's foundations (docs/recall.md): the per-row sketch (csk, ρ) of
 * recall/kernels/sketch.h against known low-rank data and against its own per-element functions,
 * the sketch_rows op on the CPU and guarded backends, the sketch planes a salience close writes
 * (bit-equal across backends, covered by kvt_seq_check, allocated up front), the basis API and
 * the basis file. Seeds are fixed and printed on failure.
 */
#define _GNU_SOURCE /* mkstemp, truncate */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"
#include "kvtier.h"
#include "kvtier_trace.h"
#include "lib/handles.h"
#include "recall/conformal.h"
#include "support/testutil.h"
#include "tiers/tiers_internal.h" /* white-box: the policies' states */

#define D 512u
#define R 64u

/* rank orthonormal rows of n values (Gram-Schmidt in double on normal draws, twice for
 * accuracy), stored fp32. */
static void orthonormal_rows(uint64_t seed, uint32_t rank, uint32_t n, float *out) {
    tu_rng g = {seed};
    cr_assert(tu_orthonormal_rows(&g, rank, n, out));
}

/* Sketch rows stored as fp32 rows [n][D] (slot u = row u) with the CPU twin. */
static void sketch_host(const float *rows, uint32_t n, int dtype, size_t stride, const float *V,
                        uint32_t rank, uint32_t csk_stride, uint16_t *csk, float *rho) {
    int32_t *slots = malloc(sizeof(int32_t) * n);
    float *scratch = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    cr_assert(slots && scratch);
    for (uint32_t u = 0; u < n; u++)
        slots[u] = (int32_t)u;
    kvt__sketch_rows_cpu((const uint8_t *)rows, slots, n, stride, dtype, D, V, rank, csk_stride,
                         scratch, csk, rho);
    free(slots);
    free(scratch);
}

static double norm_d(const float *x, uint32_t n) {
    double s = 0;
    for (uint32_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return sqrt(s);
}

/* ρ recomputed in double against the stored fp16 sketch: ‖c − Σ f32(csk_k) V_k‖. */
static double rho_against(const float *c, const uint16_t *csk, const float *V, uint32_t rank) {
    double s = 0;
    for (uint32_t d = 0; d < D; d++) {
        double rec = 0;
        for (uint32_t k = 0; k < rank; k++)
            rec += (double)kvt__f16_to_f32(csk[k]) * V[(size_t)k * D + d];
        double e = c[d] - rec;
        s += e * e;
    }
    return sqrt(s);
}

/* A latent exactly in span(V): the sketch holds its coefficients to fp16 rounding, and ρ is what
 * that rounding misses — measured against the stored fp16 sketch, not against the exact
 * projection (whose remainder is ~fp32 noise, far smaller). */
Test(sketch, latent_in_span_leaves_only_fp16_rounding) {
    const uint64_t seed = 1001;
    float *V = malloc(sizeof(float) * R * D);
    float *rows = malloc(sizeof(float) * 16 * D);
    double *a = malloc(sizeof(double) * 16 * R);
    cr_assert(V && rows && a);
    orthonormal_rows(seed, R, D, V);
    tu_rng g = {seed + 1};
    for (uint32_t u = 0; u < 16; u++) {
        for (uint32_t k = 0; k < R; k++)
            a[u * R + k] = tu_normal(&g) * (1.0 + u); /* scales 1 .. 16 */
        for (uint32_t d = 0; d < D; d++) {
            double x = 0;
            for (uint32_t k = 0; k < R; k++)
                x += a[u * R + k] * V[(size_t)k * D + d];
            rows[u * D + d] = (float)x;
        }
    }
    uint16_t csk[16 * R];
    float rho[16];
    sketch_host(rows, 16, KVT__DT_FP32, D * sizeof(float), V, R, R, csk, rho);
    for (uint32_t u = 0; u < 16; u++) {
        const float *c = rows + u * D;
        double fp16_err = 0, exact_res = 0;
        for (uint32_t k = 0; k < R; k++) {
            double got = kvt__f16_to_f32(csk[u * R + k]), want = a[u * R + k];
            /* fp16 has 11 significant bits: rounding to nearest is within 2^-11 relative. */
            cr_assert_leq(fabs(got - want), fabs(want) * 0x1p-11 + 1e-4 * (1.0 + u),
                          "seed %llu row %u coefficient %u: %g vs %g", (unsigned long long)seed, u,
                          k, got, want);
            fp16_err += (got - want) * (got - want);
        }
        fp16_err = sqrt(fp16_err);
        for (uint32_t d = 0; d < D; d++) {
            double rec = 0;
            for (uint32_t k = 0; k < R; k++)
                rec += a[u * R + k] * V[(size_t)k * D + d];
            exact_res += (c[d] - rec) * (c[d] - rec);
        }
        exact_res = sqrt(exact_res);
        double ref = rho_against(c, csk + u * R, V, R);
        /* ρ is the norm of what the fp16 sketch misses (to fp32 accuracy of a 512-term sum)... */
        cr_assert_leq(fabs(rho[u] - ref), 1e-5 * norm_d(c, D) + 1e-3 * ref,
                      "seed %llu row %u: rho %g, recomputed %g", (unsigned long long)seed, u,
                      (double)rho[u], ref);
        /* ...which is the fp16 rounding of the coefficients (V orthonormal)... */
        cr_assert_leq(fabs(rho[u] - fp16_err), 1e-5 * norm_d(c, D) + 0.05 * fp16_err,
                      "row %u: rho %g, fp16 error %g", u, (double)rho[u], fp16_err);
        /* ...and not the exact projection's remainder, which is far smaller. */
        cr_assert_gt(rho[u], 4.0 * exact_res, "row %u: rho %g vs exact remainder %g", u,
                     (double)rho[u], exact_res);
        cr_assert_leq(rho[u], 1e-3 * norm_d(c, D), "row %u: rho %g, |c| %g", u, (double)rho[u],
                      norm_d(c, D));
    }
    free(V);
    free(rows);
    free(a);
}

/* A latent orthogonal to span(V): csk ≈ 0 and ρ = ‖c‖. */
Test(sketch, orthogonal_latent_has_empty_sketch_and_full_rho) {
    const uint64_t seed = 2002;
    float *W = malloc(sizeof(float) * (R + 8) * D); /* rows 0..R-1: V; R..R+7: orthogonal to V */
    cr_assert(W);
    orthonormal_rows(seed, R + 8, D, W);
    float rows[8 * D];
    for (uint32_t u = 0; u < 8; u++)
        for (uint32_t d = 0; d < D; d++)
            rows[u * D + d] = W[(size_t)(R + u) * D + d] * (float)(3 + u);
    uint16_t csk[8 * R];
    float rho[8];
    sketch_host(rows, 8, KVT__DT_FP32, D * sizeof(float), W, R, R, csk, rho);
    for (uint32_t u = 0; u < 8; u++) {
        double n = norm_d(rows + u * D, D);
        for (uint32_t k = 0; k < R; k++)
            cr_assert_leq(fabs(kvt__f16_to_f32(csk[u * R + k])), 1e-5 * n,
                          "seed %llu row %u coefficient %u", (unsigned long long)seed, u, k);
        cr_assert_float_eq(rho[u], n, 1e-5 * n, "row %u: rho %g, |c| %g", u, (double)rho[u], n);
    }
    free(W);
}

/* The CPU twin (tiled, loops interchanged, coefficients four at a time) gives exactly the bits
 * of the per-element KVT_HD functions a CUDA kernel will map threads over: bf16, fp16 and fp32
 * rows, a tail tile (13 rows), ranks 0 (ρ = the latent's fixed-order norm), 13 (a tail of the
 * 4-coefficient pass) and 48, a stride past the rank (zero-filled). */
Test(sketch, twin_equals_per_element_functions_bit_for_bit) {
    const uint64_t seed = 3003;
    const uint32_t n = 13, rank = 48, stride = 64;
    const int dts[3] = {KVT__DT_BF16, KVT__DT_FP16, KVT__DT_FP32};
    const uint32_t ranks[3] = {0, 13, rank};
    float *V = malloc(sizeof(float) * rank * D);
    uint8_t *rows = malloc(576 * 4 * n);
    cr_assert(V && rows);
    orthonormal_rows(seed, rank, D, V);
    for (int t = 0; t < 3; t++) {
        const int dt = dts[t];
        const size_t row_bytes = 576 * (dt == KVT__DT_FP32 ? 4 : 2);
        tu_rng g = {seed + 1};
        for (uint32_t u = 0; u < n; u++)
            for (uint32_t d = 0; d < 576; d++)
                kvt__store_elem(rows + u * row_bytes, dt, d,
                                (float)(tu_normal(&g) * (d % 7 == 0 ? 4.0 : 0.5)));
        for (int ri = 0; ri < 3; ri++) {
            const uint32_t rk = ranks[ri];
            uint16_t csk[13 * 64];
            float rho[13];
            memset(csk, 0xff, sizeof csk);
            sketch_host((const float *)rows, n, dt, row_bytes, V, rk, stride, csk, rho);
            for (uint32_t u = 0; u < n; u++) {
                const uint8_t *row = rows + u * row_bytes;
                float c[D], e[D];
                uint16_t want[64];
                for (uint32_t d = 0; d < D; d++)
                    c[d] = kvt__sketch_latent(row, dt, d);
                for (uint32_t k = 0; k < rk; k++)
                    want[k] = kvt__f32_to_f16(kvt__sketch_coef(c, D, V + (size_t)k * D));
                for (uint32_t k = 0; k < stride; k++)
                    cr_assert_eq(csk[u * stride + k], k < rk ? want[k] : 0,
                                 "seed %llu dtype %d rank %u row %u coefficient %u",
                                 (unsigned long long)seed, dt, rk, u, k);
                for (uint32_t d = 0; d < D; d++)
                    e[d] = kvt__sketch_resid(c[d], want, rk, V, D, d);
                float r = kvt__norm_fixed(e, D);
                cr_assert_eq(kvt__bits_from_f32(rho[u]), kvt__bits_from_f32(r),
                             "dtype %d rank %u row %u: %a vs %a", dt, rk, u, (double)rho[u],
                             (double)r);
                if (rk == 0)
                    cr_assert_eq(kvt__bits_from_f32(rho[u]),
                                 kvt__bits_from_f32(kvt__elem_norm_fixed(row, dt, D)));
            }
        }
    }
    free(V);
    free(rows);
}

/* A NaN in one latent, and a coefficient past fp16's range in another: those rows get csk = 0
 * and ρ = +Inf (always fetched); the other rows of their tile are what they are without them. */
Test(sketch, undescribable_rows_cost_only_themselves) {
    float *V = malloc(sizeof(float) * R * D);
    float rows[8 * D], clean[8 * D];
    cr_assert(V);
    orthonormal_rows(4004, R, D, V);
    tu_rng g = {4005};
    for (uint32_t i = 0; i < 8 * D; i++)
        rows[i] = clean[i] = (float)tu_normal(&g);
    rows[2 * D + 100] = NAN;
    for (uint32_t d = 0; d < D; d++)
        rows[5 * D + d] = V[d] * 1e6f; /* coefficient 0 = 1e6 > 65504 */
    uint16_t csk[8 * R], csk_c[8 * R];
    float rho[8], rho_c[8];
    sketch_host(rows, 8, KVT__DT_FP32, D * sizeof(float), V, R, R, csk, rho);
    sketch_host(clean, 8, KVT__DT_FP32, D * sizeof(float), V, R, R, csk_c, rho_c);
    for (uint32_t u = 0; u < 8; u++) {
        if (u == 2 || u == 5) {
            cr_assert(isinf(rho[u]) && rho[u] > 0, "row %u: rho %g", u, (double)rho[u]);
            for (uint32_t k = 0; k < R; k++)
                cr_assert_eq(csk[u * R + k], 0, "row %u coefficient %u", u, k);
            continue;
        }
        cr_assert_eq(memcmp(csk + u * R, csk_c + u * R, R * 2), 0, "row %u", u);
        cr_assert_eq(kvt__bits_from_f32(rho[u]), kvt__bits_from_f32(rho_c[u]), "row %u", u);
    }
    free(V);
}

/* The AVX-512 path (32 rows a tile, two 16-lane vectors: bf16 tiles gathered, coefficients rounded
 * to fp16 by the vector conversion) against the narrow path, bit for bit: bf16, fp16 and fp32 rows
 * behind the identity and a shuffled slot table, 77 rows (two full tiles and a 13-row tail), ranks
 * 0, 13 (a tail past a multiple of 8), 40 (a multiple of 8, not of 16) and 64, a stride past the
 * rank; with the identity table, in both halves of the first tile a row with a NaN or an Inf and
 * one whose coefficient overflows fp16 or whose coefficients are fp16 subnormals, a NaN row and an
 * Inf row in the second tile's halves and a NaN row in the tail. The narrow path is the one
 * twin_equals_per_element_functions_bit_for_bit checks where the CPU has no AVX-512. */
Test(sketch, wide_path_equals_narrow_path_bit_for_bit) {
    const uint32_t n = 77, stride = 72;
    const int dts[3] = {KVT__DT_BF16, KVT__DT_FP16, KVT__DT_FP32};
    const uint32_t ranks[4] = {0, 13, 40, 64};
    const int had = kvt__sketch_wide(-1);
    if (!had)
        cr_log_info("no AVX-512 here: the wide path is not run");
    float *V = malloc(sizeof(float) * 64 * D), *scratch = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    uint8_t *rows = malloc(576 * 4 * n);
    uint16_t *c1 = malloc(2 * n * stride), *c2 = malloc(2 * n * stride);
    float rho1[77], rho2[77];
    int32_t slots[77];
    cr_assert(V && scratch && rows && c1 && c2);
    orthonormal_rows(5005, 64, D, V);
    tu_rng g = {5006};
    for (uint32_t u = 0; u < n; u++)
        slots[u] = (int32_t)u;
    for (int t = 0; t < 6; t++) {
        const int dt = dts[t % 3];
        if (t == 3) /* the second round behind a shuffled slot table */
            for (uint32_t u = n - 1; u > 0; u--) {
                uint32_t j = (uint32_t)(tu_next(&g) % (u + 1));
                int32_t x = slots[u];
                slots[u] = slots[j];
                slots[j] = x;
            }
        const size_t row_bytes = 576 * (dt == KVT__DT_FP32 ? 4 : 2);
        for (uint32_t u = 0; u < n; u++)
            for (uint32_t d = 0; d < 576; d++) {
                float x = (float)(tu_normal(&g) * (d % 5 == 0 ? 3.0 : 0.5));
                if (u == 7)
                    x = d == 200 ? NAN : x;
                if (u == 9)
                    x = d == 3 ? (dt == KVT__DT_FP16 ? INFINITY : -INFINITY) : x;
                if (u == 20)
                    x = d < D ? V[d] * 1e6f : x; /* coefficient 0 past 65504 */
                if (u == 25)
                    x *= 1e-7f; /* coefficients below fp16's smallest normal */
                if (u == 40)
                    x = d == D - 1 ? NAN : x;
                if (u == 60)
                    x = d == 0 ? INFINITY : x;
                if (u == 70)
                    x = d == 301 ? NAN : x;
                kvt__store_elem(rows + (size_t)u * row_bytes, dt, d, x);
            }
        for (int ri = 0; ri < 4; ri++) {
            const uint32_t rk = ranks[ri];
            memset(c1, 0xff, 2 * n * stride);
            memset(c2, 0xee, 2 * n * stride);
            kvt__sketch_wide(0);
            kvt__sketch_rows_cpu(rows, slots, n, row_bytes, dt, D, V, rk, stride, scratch, c1, rho1);
            kvt__sketch_wide(1);
            kvt__sketch_rows_cpu(rows, slots, n, row_bytes, dt, D, V, rk, stride, scratch, c2, rho2);
            for (uint32_t u = 0; u < n; u++) {
                for (uint32_t k = 0; k < stride; k++)
                    cr_assert_eq(c1[u * stride + k], c2[u * stride + k],
                                 "dtype %d rank %u row %u coefficient %u", dt, rk, u, k);
                cr_assert_eq(kvt__bits_from_f32(rho1[u]), kvt__bits_from_f32(rho2[u]),
                             "dtype %d rank %u row %u: %a vs %a", dt, rk, u, (double)rho1[u],
                             (double)rho2[u]);
            }
            /* the planted rows: undescribable ones infinite, the subnormal one finite */
            uint32_t at[77]; /* position of slot s */
            for (uint32_t u = 0; u < n; u++)
                at[slots[u]] = u;
            cr_assert(isinf(rho2[at[7]]) && isinf(rho2[at[9]]));
            cr_assert(isinf(rho2[at[40]]) && isinf(rho2[at[60]]) && isinf(rho2[at[70]]));
            cr_assert(rk == 0 || isinf(rho2[at[20]]));
            cr_assert(isfinite(rho2[at[25]]));
        }
    }
    kvt__sketch_wide(had);
    free(V);
    free(scratch);
    free(rows);
    free(c1);
    free(c2);
}

/* ---------------------------------------------------------------------------------------------
 * Through the library: contexts with sketch planes.
 * ------------------------------------------------------------------------------------------- */
static kvt_model *mla_model(kvt_dtype dt, bool with_gqa) {
    kvt_layer_spec s[2];
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, dt, 512, 64, &s[0]), KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 16, &s[1]), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(s, with_gqa ? 2 : 1, "recall", &m, NULL, 0), KVT_OK);
    return m;
}

static kvt_config small_config(void) {
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 8;
    return c;
}

static kvt_ctx *make_ctx(kvt_model *m, const kvt_config *c, kvt_backend_kind be, uint32_t rank,
                         uint32_t max_rows) {
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = c;
    p.page_rows = 16;
    p.n_pages = 256;
    p.backend = be;
    p.recall_sketch_rank = rank;
    p.max_rows_per_seq = max_rows;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    return ctx;
}

/* Latents near a rank-8 subspace of V's span plus noise, branches random: bf16 rows. */
static void fill_rows(uint64_t seed, const float *V, uint8_t *rows, uint32_t n) {
    tu_rng g = {seed};
    for (uint32_t u = 0; u < n; u++) {
        uint8_t *row = rows + (size_t)u * 1152;
        float c[D];
        for (uint32_t d = 0; d < D; d++)
            c[d] = (float)(0.05 * tu_normal(&g));
        for (uint32_t k = 0; k < 8; k++) {
            float a = (float)tu_normal(&g);
            for (uint32_t d = 0; d < D; d++)
                c[d] += a * V[(size_t)k * D + d];
        }
        for (uint32_t d = 0; d < D; d++)
            kvt__store_elem(row, KVT__DT_BF16, d, c[d]);
        for (uint32_t d = 0; d < 64; d++)
            kvt__store_elem(row + 1024, KVT__DT_BF16, d, (float)tu_normal(&g));
    }
}

/* Commit n rows in steps of `step` through the batch API (runs then commit). */
static void feed(kvt_seq *seq, const uint8_t *rows, uint32_t n, uint32_t step) {
    for (uint32_t t = 0; t < n; t += step) {
        uint32_t k = n - t < step ? n - t : step;
        cr_assert_eq(tu_reserve(seq, k), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, k, rows + (size_t)t * 1152, (size_t)k * 1152),
                     KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(tu_commit_run(seq, k), KVT_OK, "%s", kvt_last_error());
    }
}

/* The planes of a request's layer 0, read through the backend. */
static void read_planes(const kvt_seq *seq, uint64_t rows, uint16_t *csk, float *rho) {
    const kvt__sal *s = &kvt__seq_state(seq, 0)->sal;
    const kvt__backend *be = &seq->ctx->backend;
    /* rows [0, n_head) in the set shared with other requests, the rest in the request's own */
    const uint64_t nh = rows < s->n_head ? rows : s->n_head, w = s->sk_stride;
    if (nh) {
        cr_assert_eq(be->ops->read(be, csk, s->head->csk, sizeof *csk * nh * w, NULL), KVT_OK);
        cr_assert_eq(be->ops->read(be, rho, s->head->rho, sizeof *rho * nh, NULL), KVT_OK);
    }
    if (rows > nh) {
        cr_assert_eq(be->ops->read(be, csk + nh * w, s->csk, sizeof *csk * (rows - nh) * w, NULL),
                     KVT_OK);
        cr_assert_eq(be->ops->read(be, rho + nh, s->rho, sizeof *rho * (rows - nh), NULL), KVT_OK);
    }
}

/* One context with sketch planes (rank R) over a one-layer bf16 MLA-NoPE model, rows near an
 * 8-dim subspace of a basis V drawn from seed, and one request (id 1). */
typedef struct fixture {
    kvt_model *m;
    kvt_config c;
    kvt_ctx *ctx;
    float *V;
    uint8_t *rows;
    kvt_seq *seq;
} fixture;

static void setup(fixture *f, kvt_backend_kind be, uint32_t max_rows, uint64_t seed,
                  uint32_t n_rows, bool basis) {
    f->m = mla_model(KVT_DTYPE_BF16, false);
    f->c = small_config();
    f->ctx = make_ctx(f->m, &f->c, be, R, max_rows);
    f->V = malloc(sizeof(float) * R * D);
    f->rows = malloc((size_t)n_rows * 1152);
    cr_assert(f->V && f->rows);
    orthonormal_rows(seed, R, D, f->V);
    fill_rows(seed + 1, f->V, f->rows, n_rows);
    if (basis)
        cr_assert_eq(kvt_ctx_set_recall_basis(f->ctx, 0, f->V, R), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(tu_seq_create(f->ctx, 1, &f->seq), KVT_OK);
}

static void teardown(fixture *f) {
    kvt_ctx_destroy(f->ctx);
    free(f->V);
    free(f->rows);
    kvt_model_destroy(f->m);
}

/* Every close sketches its rows: the CPU and guarded backends write the same bits, which are
 * the twin's on the rows as stored; stats carry the basis; kvt_seq_check passes, and catches a
 * damaged plane. */
Test(sketch_planes, closes_write_the_twins_bits_on_every_backend) {
    const uint32_t N = 64 * 5 + 17, rank = 48;
    kvt_model *m = mla_model(KVT_DTYPE_BF16, false);
    kvt_config c = small_config();
    float *V = malloc(sizeof(float) * rank * D);
    uint8_t *rows = malloc((size_t)N * 1152);
    cr_assert(V && rows);
    orthonormal_rows(5005, rank, D, V);
    fill_rows(5006, V, rows, N);
    kvt_ctx *ctx[2];
    kvt_seq *seq[2];
    uint16_t *csk[2];
    float *rho[2];
    const kvt_backend_kind kinds[2] = {KVT_BACKEND_CPU, KVT_BACKEND_GUARDED};
    for (int b = 0; b < 2; b++) {
        ctx[b] = make_ctx(m, &c, kinds[b], R, 0);
        cr_assert_eq(kvt_ctx_set_recall_basis(ctx[b], 0, V, rank), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(tu_seq_create(ctx[b], 7, &seq[b]), KVT_OK);
        feed(seq[b], rows, N, b ? 5 : 64); /* prefill chunks vs decode-like steps */
        cr_assert_eq(kvt_seq_check(seq[b]), KVT_OK, "%s", kvt_last_error());
        kvt_layer_stats st = {.struct_size = sizeof st};
        cr_assert_eq(kvt_seq_layer_stats(seq[b], 0, &st), KVT_OK);
        cr_assert_eq(st.closed_rows, 64 * 5);
        cr_assert_eq(st.sketched_rows, 64 * 5);
        cr_assert_eq(st.recall_rank, rank);
        uint32_t id = 0, rk = 0;
        cr_assert_eq(kvt_ctx_recall_basis(ctx[b], 0, &rk, &id), KVT_OK);
        cr_assert_eq(st.recall_basis_id, id);
        cr_assert_eq(rk, rank);
        cr_assert_neq(id, 0);
        csk[b] = malloc(sizeof(uint16_t) * 64 * 5 * R);
        rho[b] = malloc(sizeof(float) * 64 * 5);
        cr_assert(csk[b] && rho[b]);
        read_planes(seq[b], 64 * 5, csk[b], rho[b]);
    }
    cr_assert_eq(memcmp(csk[0], csk[1], sizeof(uint16_t) * 64 * 5 * R), 0, "csk differ");
    cr_assert_eq(memcmp(rho[0], rho[1], sizeof(float) * 64 * 5), 0, "rho differ");
    /* The twin on the rows as the engine wrote them. */
    uint16_t *want_c = malloc(sizeof(uint16_t) * 64 * 5 * R);
    float want_r[64 * 5];
    cr_assert(want_c);
    sketch_host((const float *)rows, 64 * 5, KVT__DT_BF16, 1152, V, rank, R, want_c, want_r);
    cr_assert_eq(memcmp(csk[0], want_c, sizeof(uint16_t) * 64 * 5 * R), 0);
    cr_assert_eq(memcmp(rho[0], want_r, sizeof want_r), 0);
    /* The rows sit near an 8-dim subspace of the basis: ρ ≈ the noise's norm (0.05·√(512−48)). */
    double mean = 0;
    for (uint32_t u = 0; u < 64 * 5; u++)
        mean += rho[0][u] / (64.0 * 5);
    cr_assert(mean > 0.9 && mean < 1.3, "mean rho %g", mean);
    /* The checker reads the planes: a NaN ρ and a coefficient past the rank are violations. */
    const kvt__sal *s = &kvt__seq_state(seq[0], 0)->sal;
    const kvt__backend *be = &ctx[0]->backend;
    float nan = NAN;
    cr_assert_eq(be->ops->write(be, s->rho + 10, &nan, sizeof nan, NULL), KVT_OK);
    cr_assert_eq(kvt_seq_check(seq[0]), KVT_ERR_INVARIANT);
    cr_assert(strstr(kvt_last_error(), "row 10"), "%s", kvt_last_error());
    cr_assert_eq(be->ops->write(be, s->rho + 10, &want_r[10], sizeof nan, NULL), KVT_OK);
    cr_assert_eq(kvt_seq_check(seq[0]), KVT_OK, "%s", kvt_last_error());
    uint16_t one = 0x3c00;
    cr_assert_eq(be->ops->write(be, s->csk + 3 * R + rank, &one, sizeof one, NULL), KVT_OK);
    cr_assert_eq(kvt_seq_check(seq[0]), KVT_ERR_INVARIANT);
    for (int b = 0; b < 2; b++) {
        free(csk[b]);
        free(rho[b]);
        kvt_ctx_destroy(ctx[b]);
    }
    free(want_c);
    free(V);
    free(rows);
    kvt_model_destroy(m);
}

/* The twin's sketches of rows [lo, hi) of rows (a request's positions) against a request's
 * planes at the same rows (read_planes: the open block's rows sketched ahead included). */
static void planes_are_the_twins(const kvt_seq *seq, const uint8_t *rows, uint64_t lo, uint64_t hi,
                                 const float *V, uint32_t rank, const char *what) {
    const uint64_t n = hi - lo;
    cr_assert(n > 0 && hi <= 512);
    uint16_t got_c[512 * R], want_c[512 * R];
    float got_r[512], want_r[512];
    read_planes(seq, hi, got_c, got_r);
    sketch_host((const float *)(rows + lo * 1152), (uint32_t)n, KVT__DT_BF16, 1152, V, rank, R,
                want_c, want_r);
    cr_assert_eq(memcmp(got_c + lo * R, want_c, sizeof(uint16_t) * n * R), 0, "%s: csk", what);
    cr_assert_eq(memcmp(got_r + lo, want_r, sizeof(float) * n), 0, "%s: rho", what);
}

/* A commit sketches its final rows ahead of their close, 32 at a time: after every decode step
 * the rows sketched ahead are whole tiles of the open block, their planes are the twin's, and a
 * close then writes the same bits as a close that sketches its whole block. A fork, a refit
 * (another basis) and a restore forget the rows sketched ahead, and the next close is right. */
Test(sketch_planes, decode_sketches_ahead_the_same_bits) {
    fixture f;
    const uint32_t N = 64 * 5 + 40;
    setup(&f, KVT_BACKEND_CPU, 0, 7171, N, true);
    uint64_t ahead_steps = 0;
    for (uint32_t t = 0; t < 64 * 2 + 40; t++) {
        feed(f.seq, f.rows + (size_t)t * 1152, 1, 1);
        const kvt__sal *s = &kvt__seq_state(f.seq, 0)->sal;
        const uint64_t n = t + 1, open = n - s->closed_rows;
        cr_assert_eq(s->n_rows, n);
        /* whole tiles of the open block's committed rows, no more */
        const uint64_t want = s->closed_rows + open / 32 * 32;
        cr_assert_eq(s->sk_rows > s->closed_rows ? s->sk_rows : s->closed_rows, want,
                     "row %llu: sketched to %llu, closed %llu", (unsigned long long)n,
                     (unsigned long long)s->sk_rows, (unsigned long long)s->closed_rows);
        ahead_steps += s->sk_rows > s->closed_rows;
        if (want > s->closed_rows && (n % 32 == 0))
            planes_are_the_twins(f.seq, f.rows, s->closed_rows, want, f.V, R, "ahead");
        cr_assert_eq(kvt_seq_check(f.seq), KVT_OK, "%s", kvt_last_error());
    }
    cr_assert_gt(ahead_steps, 64);
    planes_are_the_twins(f.seq, f.rows, 0, 64 * 2, f.V, R, "closed");
    /* A fork: both requests go on (the parent's planes moved into the shared set) and close. */
    kvt_seq *kid;
    cr_assert_eq(kvt_seq_fork(f.seq, 2, &kid), KVT_OK, "%s", kvt_last_error());
    cr_assert_leq(kvt__seq_state(f.seq, 0)->sal.sk_rows, 64 * 2);
    cr_assert_leq(kvt__seq_state(kid, 0)->sal.sk_rows, 64 * 2);
    for (uint32_t t = 64 * 2 + 40; t < 64 * 3 + 8; t++) {
        feed(f.seq, f.rows + (size_t)t * 1152, 1, 1);
        feed(kid, f.rows + (size_t)t * 1152, 1, 1);
    }
    planes_are_the_twins(f.seq, f.rows, 64 * 2, 64 * 3, f.V, R, "parent after the fork");
    planes_are_the_twins(kid, f.rows, 64 * 2, 64 * 3, f.V, R, "fork");
    /* A refit to another basis: the rows sketched ahead with the old one are sketched again. */
    for (uint32_t t = 64 * 3 + 8; t < 64 * 3 + 48; t++)
        feed(f.seq, f.rows + (size_t)t * 1152, 1, 1);
    cr_assert_gt(kvt__seq_state(f.seq, 0)->sal.sk_rows, 64 * 3);
    float *V2 = malloc(sizeof(float) * R * D);
    cr_assert(V2);
    orthonormal_rows(7272, R, D, V2);
    cr_assert_eq(kvt_ctx_refit_recall_basis(f.ctx, 0, V2, R, KVT_REFIT_KEEP_Z, NULL), KVT_OK,
                 "%s", kvt_last_error());
    for (uint32_t t = 64 * 3 + 48; t < 64 * 4 + 8; t++)
        feed(f.seq, f.rows + (size_t)t * 1152, 1, 1);
    planes_are_the_twins(f.seq, f.rows, 64 * 3, 64 * 4, V2, R, "after the refit");
    /* A snapshot and a restore: the restored request sketches its open block at its close. */
    size_t bytes;
    cr_assert_eq(kvt_seq_snapshot_size(f.seq, &bytes), KVT_OK, "%s", kvt_last_error());
    uint8_t *snap = malloc(bytes);
    cr_assert(snap);
    cr_assert_eq(kvt_seq_snapshot(f.seq, snap, bytes, NULL), KVT_OK, "%s", kvt_last_error());
    kvt_ctx *c2 = make_ctx(f.m, &f.c, KVT_BACKEND_GUARDED, R, 0);
    cr_assert_eq(kvt_ctx_set_recall_basis(c2, 0, V2, R), KVT_OK);
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore(c2, snap, bytes, &r), KVT_OK, "%s", kvt_last_error());
    cr_assert_leq(kvt__seq_state(r, 0)->sal.sk_rows, 64 * 4);
    for (uint32_t t = 64 * 4 + 8; t < 64 * 5 + 8; t++)
        feed(r, f.rows + (size_t)t * 1152, 1, 1);
    planes_are_the_twins(r, f.rows, 64 * 4, 64 * 5, V2, R, "restored");
    cr_assert_eq(kvt_seq_check(r), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(kid), KVT_OK, "%s", kvt_last_error());
    free(snap);
    free(V2);
    kvt_ctx_destroy(c2);
    teardown(&f);
}

/* The guarded backend refuses a sketch whose planes are host memory (a GPU could not write
 * them). */
Test(sketch_planes, guarded_op_refuses_host_planes) {
    fixture f;
    setup(&f, KVT_BACKEND_GUARDED, 0, 11011, 64, false);
    feed(f.seq, f.rows, 64, 64);
    const kvt__sal *s = &kvt__seq_state(f.seq, 0)->sal;
    kvt__sketch_args a = {.base = f.ctx->stores[0].plane[0],
                          .pages = f.seq->pt[0].dpages,
                          .pdiv = &f.ctx->pdiv,
                          .n_rows = 64,
                          .slot_stride = 1152,
                          .dtype = KVT__DT_BF16,
                          .latent_dim = D,
                          .csk_stride = R,
                          .csk = s->csk,
                          .rho = s->rho};
    const kvt__backend *be = &f.ctx->backend;
    cr_assert_eq(be->ops->sketch_rows(be, &a, 1, NULL), KVT_OK);
    float host_rho[64];
    a.rho = host_rho;
    cr_assert_eq(be->ops->sketch_rows(be, &a, 1, NULL), KVT_ERR_INVARIANT);
    teardown(&f);
}

/* The recall_scan op over a request's own state (pool plane, page-table mirror, sketch planes,
 * basis, kept set from real closes): in sound mode every archived row whose exact score reaches
 * its head's best attended score (sinks, kept, tail) fires, and the CPU and guarded contexts fire
 * the same rows. */
Test(sketch_planes, sound_scan_over_a_requests_planes) {
    const uint32_t N = 64 * 6 + 23, H = 4, STEPS = 24;
    uint32_t fired[2][STEPS][N];
    uint32_t n_fired[2][STEPS];
    uint64_t must = 0, arch_total = 0;
    for (int b = 0; b < 2; b++) {
        fixture f;
        setup(&f, b ? KVT_BACKEND_GUARDED : KVT_BACKEND_CPU, 0, 31031, N, true);
        feed(f.seq, f.rows, N, 64);
        const kvt__sal *s = &kvt__seq_state(f.seq, 0)->sal;
        const kvt__backend *be = &f.ctx->backend;
        const uint64_t closed = s->closed_rows;
        uint32_t *kept = malloc(sizeof(uint32_t) * s->n_kept + 4);
        uint8_t *is_kept = calloc(N, 1);
        cr_assert(kept && is_kept && closed == 64 * 6);
        cr_assert_eq(be->ops->read(be, kept, s->kept, sizeof *kept * s->n_kept, NULL), KVT_OK);
        for (uint64_t i = 0; i < s->n_kept; i++)
            is_kept[kept[i]] = 1;
        const uint32_t S = f.c.sink_rows;
        void *dq, *dbest, *dout;
        const size_t qb = sizeof(float) * 576 * H;
        cr_assert_eq(be->ops->buf_alloc(be, qb, &dq), KVT_OK);
        cr_assert_eq(be->ops->buf_alloc(be, sizeof(float) * H, &dbest), KVT_OK);
        cr_assert_eq(be->ops->buf_alloc(be, sizeof(uint32_t) * (N + 2), &dout), KVT_OK);
        tu_rng g = {777};
        float q[4 * 576], best[4];
        for (uint32_t st = 0; st < STEPS; st++) {
            for (uint32_t h = 0; h < H; h++) {
                float *qh = q + (size_t)h * 576;
                for (uint32_t i = 0; i < 576; i++)
                    qh[i] = (float)tu_normal(&g) * (i < D ? 0.2f : 1.0f);
                for (uint32_t k = 0; k < 8; k++) { /* toward the rows' subspace */
                    float a = (float)tu_normal(&g);
                    for (uint32_t d = 0; d < D; d++)
                        qh[d] += a * f.V[(size_t)k * D + d];
                }
                best[h] = -INFINITY;
                for (uint32_t u = 0; u < N; u++)
                    if (u < S || u >= closed || is_kept[u]) {
                        float e = kvt__recall_exact(qh, f.rows + (size_t)u * 1152, KVT__DT_BF16,
                                                    D, 1024, KVT__DT_BF16, 64, 0.0721687836f);
                        best[h] = e > best[h] ? e : best[h];
                    }
            }
            cr_assert_eq(be->ops->write(be, dq, q, qb, NULL), KVT_OK);
            cr_assert_eq(be->ops->write(be, dbest, best, sizeof best, NULL), KVT_OK);
            kvt__recall_scan_args a = {.base = f.ctx->stores[0].plane[0],
                                       .pages = f.seq->pt[0].dpages,
                                       .first_page = f.seq->pt[0].first_page,
                                       .pdiv = &f.ctx->pdiv,
                                       .slot_stride = 1152,
                                       .dtype = KVT__DT_BF16,
                                       .latent_dim = D,
                                       .branch_offset = 1024,
                                       .branch_dtype = KVT__DT_BF16,
                                       .branch_dim = 64,
                                       .csk = s->csk,
                                       .rho = s->rho,
                                       .csk_stride = s->sk_stride,
                                       .basis = f.ctx->stores[0].rbasis.V,
                                       .rank = f.ctx->stores[0].rbasis.rank,
                                       .n_closed = closed,
                                       .sinks = S,
                                       .kept = s->kept,
                                       .m = (uint32_t)s->n_kept,
                                       .q = dq,
                                       .best = dbest,
                                       .n_heads = H,
                                       .scale = 0.0721687836f,
                                       .z = sqrtf(448.0f),
                                       .mode = KVT__RECALL_SOUND,
                                       .cap = N,
                                       .fired = dout,
                                       .n_fired = (uint32_t *)dout + N,
                                       .overflow = (uint32_t *)dout + N + 1};
            cr_assert_eq(be->ops->recall_scan(be, &a, 1, NULL), KVT_OK);
            uint32_t out[N + 2];
            cr_assert_eq(be->ops->read(be, out, dout, sizeof out, NULL), KVT_OK);
            cr_assert_eq(out[N + 1], 0); /* no overflow */
            n_fired[b][st] = out[N];
            memcpy(fired[b][st], out, sizeof(uint32_t) * out[N]);
            uint8_t got[N];
            memset(got, 0, sizeof got);
            for (uint32_t i = 0; i < out[N]; i++)
                got[out[i]] = 1;
            for (uint32_t u = S; u < closed; u++) {
                if (is_kept[u])
                    continue;
                arch_total += b == 0;
                for (uint32_t h = 0; h < H; h++)
                    if (kvt__recall_exact(q + (size_t)h * 576, f.rows + (size_t)u * 1152,
                                          KVT__DT_BF16, D, 1024, KVT__DT_BF16, 64,
                                          0.0721687836f) >= best[h]) {
                        must += b == 0;
                        cr_assert(got[u], "step %u head %u row %u missed", st, h, u);
                    }
            }
        }
        be->ops->buf_free(be, dq, qb);
        be->ops->buf_free(be, dbest, sizeof(float) * H);
        be->ops->buf_free(be, dout, sizeof(uint32_t) * (N + 2));
        free(kept);
        free(is_kept);
        teardown(&f);
    }
    uint64_t total = 0;
    for (uint32_t st = 0; st < STEPS; st++) {
        cr_assert_eq(n_fired[0][st], n_fired[1][st]);
        cr_assert_eq(memcmp(fired[0][st], fired[1][st], sizeof(uint32_t) * n_fired[0][st]), 0);
        total += n_fired[0][st];
    }
    cr_log_info("sound scan over a request's planes: %u steps x %u heads, %llu (row, head) pairs "
                "at or above the best attended score, all fired; firing rate %.3f",
                STEPS, H, (unsigned long long)must, (double)total / (double)arch_total);
}

/* Every backend has the recall ops now (a backend without them would refuse a context with
 * sketch planes instead of calling NULL at the first close). Without a device the CUDA request
 * ends earlier, at NO_DEVICE; both CPU-side backends have the ops. */
Test(sketch_planes, backend_without_recall_ops_refused) {
    kvt_model *m = mla_model(KVT_DTYPE_BF16, false);
    kvt_config c = small_config();
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 16;
    p.recall_sketch_rank = R;
    p.backend = KVT_BACKEND_CUDA;
    kvt_ctx *ctx = NULL;
    char err[256] = "";
    /* CUDA has the sketch, scan and step ops: sketch planes are served, and so are the recall
     * modes. */
    kvt_status s = kvt_ctx_create(&p, &ctx, err, sizeof err);
    if (s == KVT_ERR_NO_DEVICE) {
        cr_log_info("no CUDA device: neither answer is reached (%s)", err);
    } else {
        cr_assert_eq(s, KVT_OK, "%s: %s", kvt_status_name(s), err);
        cr_assert(ctx->backend.ops->sketch_rows && ctx->backend.ops->recall_scan &&
                  ctx->backend.ops->recall_step);
        kvt_ctx_destroy(ctx);
        c.recall = KVT_RECALL_CONFORMAL;
        cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
        kvt_ctx_destroy(ctx);
        c.recall = KVT_RECALL_OFF;
    }
    for (int b = 0; b < 2; b++) {
        p.backend = b ? KVT_BACKEND_GUARDED : KVT_BACKEND_CPU;
        cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
        cr_assert_not_null(ctx->backend.ops->recall_scan);
        kvt_ctx_destroy(ctx);
    }
    kvt_model_destroy(m);
}

/* Recall off (the default): no planes, nothing sketched, the same kept sets as with sketches. */
Test(sketch_planes, off_by_default_and_changes_no_decision) {
    const uint32_t N = 64 * 4;
    fixture f;
    setup(&f, KVT_BACKEND_CPU, 0, 6006, N, true);
    kvt_ctx *off = make_ctx(f.m, &f.c, KVT_BACKEND_CPU, 0, 0);
    kvt_seq *a;
    cr_assert_eq(tu_seq_create(off, 1, &a), KVT_OK);
    feed(a, f.rows, N, 64);
    feed(f.seq, f.rows, N, 64);
    cr_assert_null(kvt__seq_state(a, 0)->sal.csk);
    kvt_layer_stats st = {.struct_size = sizeof st};
    cr_assert_eq(kvt_seq_layer_stats(a, 0, &st), KVT_OK);
    cr_assert_eq(st.sketched_rows, 0);
    cr_assert_eq(st.recall_rank, 0);
    char why[256];
    cr_assert_eq(tu_same_rows(a, f.seq, why, sizeof why), KVT_OK, "%s", why);
    kvt_ctx_destroy(off);
    teardown(&f);
}

/* A layer without a basis still sketches: empty csk, ρ = the latent's norm. */
Test(sketch_planes, no_basis_gives_rho_the_latent_norm) {
    fixture f;
    setup(&f, KVT_BACKEND_CPU, 0, 7007, 64, false);
    feed(f.seq, f.rows, 64, 64);
    uint16_t csk[64 * R];
    float rho[64];
    read_planes(f.seq, 64, csk, rho);
    for (uint32_t u = 0; u < 64; u++) {
        for (uint32_t k = 0; k < R; k++)
            cr_assert_eq(csk[u * R + k], 0);
        cr_assert_eq(kvt__bits_from_f32(rho[u]),
                     kvt__bits_from_f32(kvt__elem_norm_fixed(f.rows + u * 1152, KVT__DT_BF16, D)));
    }
    cr_assert_eq(kvt_seq_check(f.seq), KVT_OK, "%s", kvt_last_error());
    teardown(&f);
}

/* With max_rows_per_seq stated the sketch planes and their scratch are sized at creation: a
 * decode that closes blocks allocates nothing (test_steady's rule, with sketches on). */
Test(sketch_planes, steady_decode_allocates_nothing) {
    const uint32_t NSEQ = 8, STEPS = 400;
    fixture f;
    setup(&f, KVT_BACKEND_CPU, STEPS + 8, 8008, STEPS, true);
    kvt_ctx *ctx = f.ctx;
    const uint8_t *rows = f.rows;
    kvt_seq *seqs[8] = {f.seq};
    for (uint32_t i = 1; i < NSEQ; i++)
        cr_assert_eq(tu_seq_create(ctx, i + 1, &seqs[i]), KVT_OK);
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, NSEQ, &b), KVT_OK);
    uint32_t ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    int32_t *idx = malloc(sizeof(int32_t) * NSEQ * (STEPS + 8));
    int32_t lens[8];
    cr_assert(idx);
    const uint64_t before = kvt_ctx_host_allocations(ctx);
    for (uint32_t t = 0; t < STEPS; t++) {
        cr_assert_eq(kvt_batch_reserve(b, seqs, ones, NSEQ), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_batch_plan(b), KVT_OK);
        uint32_t topk;
        cr_assert_eq(kvt_batch_capacity(b, 0, &topk, NULL), KVT_OK);
        kvt_emit e = {.struct_size = sizeof e,
                      .layout = KVT_EMIT_TOKENS,
                      .indices = idx,
                      .capacity = topk,
                      .lengths = lens};
        for (uint32_t i = 0; i < NSEQ; i++)
            cr_assert_eq(kvt_seq_write(seqs[i], 0, 0, 0, 1, rows + (size_t)t * 1152, 1152), KVT_OK);
        cr_assert_eq(kvt_batch_run(b, 0, NULL, NULL, &e), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    }
    const uint64_t after = kvt_ctx_host_allocations(ctx);
    kvt_layer_stats st = {.struct_size = sizeof st};
    cr_assert_eq(kvt_seq_layer_stats(seqs[0], 0, &st), KVT_OK);
    cr_assert_eq(st.sketched_rows, STEPS / 64 * 64);
    cr_assert_eq(after, before, "%llu host allocations", (unsigned long long)(after - before));
    for (uint32_t i = 0; i < NSEQ; i++)
        cr_assert_eq(kvt_seq_check(seqs[i]), KVT_OK, "%s", kvt_last_error());
    free(idx);
    kvt_batch_destroy(b);
    teardown(&f);
}

/* ---------------------------------------------------------------------------------------------
 * The basis API and file.
 * ------------------------------------------------------------------------------------------- */
Test(basis, statuses) {
    kvt_model *m = mla_model(KVT_DTYPE_BF16, true);
    kvt_config c = small_config();
    float *V = malloc(sizeof(float) * (R + 1) * D);
    cr_assert(V);
    orthonormal_rows(9009, R + 1, D, V);
    kvt_ctx *none = make_ctx(m, &c, KVT_BACKEND_CPU, 0, 0);
    cr_assert_eq(kvt_ctx_set_recall_basis(none, 0, V, R), KVT_ERR_UNSUPPORTED);
    kvt_ctx_destroy(none);
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, R, 0);
    cr_assert_eq(kvt_ctx_set_recall_basis(NULL, 0, V, R), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, NULL, R), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 2, V, R), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 1, V, R), KVT_ERR_POLICY_MISMATCH);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, 0), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R + 1), KVT_ERR_OUT_OF_RANGE);
    float keep = V[5 * D + 7];
    V[5 * D + 7] = INFINITY;
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_ERR_INVALID_ARGUMENT);
    V[5 * D + 7] = NAN;
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_ERR_INVALID_ARGUMENT);
    V[5 * D + 7] = keep + 0.1f; /* no longer orthonormal */
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "orthonormal"), "%s", kvt_last_error());
    V[5 * D + 7] = keep;
    uint32_t rank = 99, id = 99;
    cr_assert_eq(kvt_ctx_recall_basis(ctx, 0, &rank, &id), KVT_OK);
    cr_assert_eq(rank, 0);
    cr_assert_eq(id, 0);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V + D, 32), KVT_OK); /* replaced below */
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_recall_basis(ctx, 0, &rank, &id), KVT_OK);
    cr_assert_eq(rank, R);
    /* The id is zlib's CRC-32 of V's bytes. */
    uLong z = crc32(0L, Z_NULL, 0);
    z = crc32(z, (const Bytef *)V, sizeof(float) * R * D);
    cr_assert_eq(id, (uint32_t)z);
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(tu_reserve(seq, 1), KVT_OK);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_ERR_BAD_STATE);
    cr_assert_eq(tu_commit(seq, 1), KVT_OK);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    /* Creation: fp8 salience rows outside the ds_mla layout cannot be sketched; a rank past the
     * limit or the latent. */
    kvt_layer_spec f = {.kind = KVT_LAYER_MLA_NOPE,
                        .dtype = KVT_DTYPE_FP8_E4M3,
                        .n_kv_heads = 1,
                        .n_planes = 1,
                        .head_dim = 576,
                        .value_dim = 512,
                        .branch_dim = 64,
                        .row_bytes = 656,
                        .branch_offset = 528,
                        .branch_dtype = KVT_DTYPE_BF16};
    kvt_model *m8;
    cr_assert_eq(kvt_model_create(&f, 1, "fp8", &m8, NULL, 0), KVT_OK);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m8;
    p.recall_sketch_rank = R;
    kvt_ctx *bad = NULL;
    char err[256];
    /* the ds_mla layout is sketched (test_fp8); any other fp8 layout is refused */
    cr_assert_eq(kvt_ctx_create(&p, &bad, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx_destroy(bad);
    kvt_model_destroy(m8);
    f.row_bytes = 720;
    f.branch_offset = 592;
    cr_assert_eq(kvt_model_create(&f, 1, "fp8", &m8, NULL, 0), KVT_OK);
    p.model = m8;
    cr_assert_eq(kvt_ctx_create(&p, &bad, err, sizeof err), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(err, "fp8") && strstr(err, "ds_mla"), "%s", err);
    p.recall_sketch_rank = 0;
    cr_assert_eq(kvt_ctx_create(&p, &bad, err, sizeof err), KVT_OK, "%s", err);
    kvt_ctx_destroy(bad);
    kvt_model_destroy(m8);
    kvt_model *mb = mla_model(KVT_DTYPE_BF16, false);
    p.model = mb;
    p.recall_sketch_rank = KVT_RECALL_MAX_RANK + 1;
    cr_assert_eq(kvt_ctx_create(&p, &bad, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    kvt_model_destroy(mb);
    free(V);
}

/* Sound mode needs a basis whose departure from orthonormality its margin covers
 * (‖V Vᵀ − I‖_F <= 2^-20): an fp32 rounding of an orthonormal basis passes; one perturbed by 1e-4
 * (which set_recall_basis's 1e-3 per-entry check accepts) is refused for sound mode, in either
 * order of basis and request, and stays usable for the conformal mode. */
Test(basis, sound_mode_needs_an_orthonormal_basis) {
    kvt_layer_spec sp;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &sp), KVT_OK);
    sp.n_q_heads = 4;
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&sp, 1, "sound", &m, NULL, 0), KVT_OK);
    float *V = malloc(sizeof(float) * R * D);
    cr_assert(V);
    orthonormal_rows(4242, R, D, V);
    kvt_config c = small_config();
    c.recall = KVT_RECALL_SOUND;
    kvt_ctx *snd = make_ctx(m, &c, KVT_BACKEND_CPU, R, 0);
    cr_assert_eq(kvt_ctx_set_recall_basis(snd, 0, V, R), KVT_OK, "%s", kvt_last_error());
    V[3 * D + 11] += 1e-4f; /* row 3's norm moves by ~2e-4: within 1e-3, far above 2^-20 */
    cr_assert_eq(kvt_ctx_set_recall_basis(snd, 0, V, R), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "sound") && strstr(kvt_last_error(), "layer 0"), "%s",
              kvt_last_error());
    kvt_ctx_destroy(snd);
    /* conformal context: the perturbed basis is accepted; a sound request is then refused, a
     * request with recall off is not */
    c.recall = KVT_RECALL_CONFORMAL;
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, R, 0);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_OK, "%s", kvt_last_error());
    kvt_seq_params p = kvt_seq_default_params();
    p.recall = KVT_RECALL_SOUND;
    kvt_seq *seq = NULL;
    cr_assert_eq(kvt_seq_create(ctx, &p, &seq), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "sound"), "%s", kvt_last_error());
    cr_assert_null(seq);
    p.recall = KVT_RECALL_OFF;
    cr_assert_eq(kvt_seq_create(ctx, &p, &seq), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    /* a live sound request refuses a basis its margin does not cover */
    c.recall = KVT_RECALL_OFF;
    ctx = make_ctx(m, &c, KVT_BACKEND_CPU, R, 0);
    p.recall = KVT_RECALL_SOUND;
    cr_assert_eq(kvt_seq_create(ctx, &p, &seq), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_ERR_INVALID_ARGUMENT);
    V[3 * D + 11] -= 1e-4f;
    orthonormal_rows(4242, R, D, V);
    cr_assert_eq(kvt_ctx_set_recall_basis(ctx, 0, V, R), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    free(V);
}

Test(basis, file_round_trip_and_damage) {
    char path[] = "/tmp/kvt_basis_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    float *V = malloc(sizeof(float) * R * D), *back = malloc(sizeof(float) * R * D);
    cr_assert(V && back);
    orthonormal_rows(10010, R, D, V);
    kvt_recall_basis_info in = {
        .layer = 3, .rank = R, .dim = D, .captured = 0.875, .samples = 12345};
    cr_assert_eq(kvt_recall_basis_write(path, &in, V), KVT_OK);
    kvt_recall_basis_info out;
    cr_assert_eq(kvt_recall_basis_read(path, &out, back, (size_t)R * D), KVT_OK);
    cr_assert_eq(out.layer, 3);
    cr_assert_eq(out.rank, R);
    cr_assert_eq(out.dim, D);
    cr_assert_eq(out.captured, 0.875);
    cr_assert_eq(out.samples, 12345);
    cr_assert_eq(memcmp(V, back, sizeof(float) * R * D), 0);
    cr_assert_eq(kvt_recall_basis_read(path, &out, back, (size_t)R * D - 1), KVT_ERR_CAPACITY);
    /* Loaded into a context: the same id as the file's. */
    kvt_model *m = mla_model(KVT_DTYPE_BF16, false);
    kvt_config c = small_config();
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, R, 0);
    cr_assert_eq(kvt_ctx_load_recall_basis(ctx, 0, path), KVT_OK, "%s", kvt_last_error());
    uint32_t rank, id;
    cr_assert_eq(kvt_ctx_recall_basis(ctx, 0, &rank, &id), KVT_OK);
    cr_assert_eq(rank, R);
    cr_assert_eq(id, out.id);
    /* One flipped bit in V: CRC mismatch. */
    FILE *f = fopen(path, "r+b");
    cr_assert(f);
    fseek(f, 40 + 1000, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, 40 + 1000, SEEK_SET);
    fputc(ch ^ 0x10, f);
    fclose(f);
    cr_assert_eq(kvt_recall_basis_read(path, &out, NULL, 0), KVT_ERR_CORRUPT);
    cr_assert_eq(kvt_ctx_load_recall_basis(ctx, 0, path), KVT_ERR_CORRUPT);
    /* Truncated: sizes disagree. */
    cr_assert_eq(truncate(path, 100), 0);
    cr_assert_eq(kvt_recall_basis_read(path, &out, NULL, 0), KVT_ERR_PARSE);
    cr_assert_eq(kvt_recall_basis_read("/nonexistent/basis", &out, NULL, 0), KVT_ERR_IO);
    remove(path);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    free(V);
    free(back);
}

/* ---------------------------------------------------------------------------------------------
 * kvtier-inspect calibrate on a synthetic trace of known structure. The query latents are
 *     x_i = μ + Σ_k A_k cos(2π f_k i / n) U_k + Σ_j B_j cos(2π g_j i / n) W_j
 * over the n = steps × heads samples (i = step · heads + head), with U (8 directions) and W (8
 * weaker ones) orthonormal and all frequencies distinct in 1 .. n/2 − 1: over whole periods the
 * cosines are orthogonal with mean 0, so the sample covariance is exactly diagonal in the basis
 * [U | W] with eigenvalues A_k² n / (2(n − 1)) and B_j² n / (2(n − 1)), and the mean μ (large)
 * must be removed by the centring. The captured variance of rank 8 is ΣA² / (ΣA² + ΣB²) and the
 * recovered rows are ±U_k, in order.
 * ------------------------------------------------------------------------------------------- */
#if KVT_HAVE_LAPACKE && KVT_HAVE_INSPECT
#define CAL_STEPS 96u
#define CAL_HEADS 8u

static void write_cal_trace(const char *path, const float *UW, bool with_queries) {
    kvt_layer_spec sp;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &sp), KVT_OK);
    sp.n_q_heads = CAL_HEADS;
    kvt_trace_meta meta = {.n_model_layers = 4, .text = "generator=test_recall calibrate\n"};
    kvt_trace_writer *w;
    char err[256];
    cr_assert_eq(kvt_trace_writer_open(path, &meta, &w, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_eq(kvt_trace_write_layer(w, 2, &sp), KVT_OK);
    uint8_t *rows = calloc(CAL_STEPS, 1152);
    cr_assert(rows);
    cr_assert_eq(kvt_trace_write_rows(w, 2, 0, rows, CAL_STEPS, (size_t)CAL_STEPS * 1152), KVT_OK);
    free(rows);
    const uint32_t n = CAL_STEPS * CAL_HEADS;
    float *q = malloc(sizeof(float) * CAL_HEADS * 576);
    cr_assert(q);
    for (uint32_t s = 0; with_queries && s < CAL_STEPS; s++) {
        for (uint32_t h = 0; h < CAL_HEADS; h++) {
            uint32_t i = s * CAL_HEADS + h;
            float *x = q + h * 576;
            for (uint32_t d = 0; d < 576; d++)
                x[d] = d < 512 ? 5.0f + 0.01f * (float)d : 1.0f; /* μ; the branch is ignored */
            for (uint32_t k = 0; k < 16; k++) {
                double amp = k < 8 ? 10.0 - k : 0.3 - 0.02 * (k - 8);
                uint32_t f = 3 + 7 * k; /* distinct, < n/2 */
                double a = amp * cos(6.283185307179586 * (double)((uint64_t)f * i % n) / n);
                for (uint32_t d = 0; d < 512; d++)
                    x[d] += (float)(a * UW[(size_t)k * 512 + d]);
            }
        }
        uint64_t pos = s + 1;
        cr_assert_eq(kvt_trace_write_queries(w, 2, KVT_DTYPE_FP32, CAL_HEADS, 576, &pos, q, 1,
                                             sizeof(float) * CAL_HEADS * 576),
                     KVT_OK);
    }
    free(q);
    cr_assert_eq(kvt_trace_writer_close(w, err, sizeof err), KVT_OK, "%s", err);
}

/* Create an empty temporary file from a mkstemp template (rewritten in place). */
static void temp_file(char *tmpl) {
    int fd = mkstemp(tmpl);
    cr_assert_geq(fd, 0, "mkstemp %s", tmpl);
    close(fd);
}

static int run_calibrate(const char *args, char *out, size_t out_len) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/tools/kvtier-inspect calibrate %s 2>&1", KVT_BINARY_DIR, args);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, out_len - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#endif

Test(calibrate, recovers_a_known_subspace_and_its_variance, .timeout = 120) {
#if !KVT_HAVE_LAPACKE
    cr_skip_test("built without LAPACKE (liblapacke-dev): kvtier-inspect calibrate is disabled");
#elif !KVT_HAVE_INSPECT
    cr_skip_test("built without the tools (KVT_BUILD_TOOLS=OFF): no kvtier-inspect to run");
#else
    char trace[] = "/tmp/kvt_cal_XXXXXX", basis[] = "/tmp/kvt_calb_XXXXXX";
    temp_file(trace);
    temp_file(basis);
    float *UW = malloc(sizeof(float) * 16 * 512);
    cr_assert(UW);
    orthonormal_rows(12012, 16, 512, UW);
    write_cal_trace(trace, UW, true);
    double sa = 0, sb = 0, s4 = 0;
    for (uint32_t k = 0; k < 16; k++) {
        double amp = k < 8 ? 10.0 - k : 0.3 - 0.02 * (k - 8);
        *(k < 8 ? &sa : &sb) += amp * amp;
        if (k < 4)
            s4 += amp * amp;
    }
    char out[4096], args[512];
    snprintf(args, sizeof args, "%s -o %s --rank 8", trace, basis);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 0, "%s", out);
    cr_log_info("%s", out);
    cr_assert(strstr(out, "layer 2: 768 samples"), "%s", out);
    kvt_recall_basis_info info;
    float V[8 * 512];
    cr_assert_eq(kvt_recall_basis_read(basis, &info, V, sizeof V / sizeof V[0]), KVT_OK);
    cr_assert_eq(info.layer, 2);
    cr_assert_eq(info.rank, 8);
    cr_assert_eq(info.dim, 512);
    cr_assert_eq(info.samples, CAL_STEPS * CAL_HEADS);
    cr_assert_float_eq(info.captured, sa / (sa + sb), 1e-5, "captured %.8f, expected %.8f",
                       info.captured, sa / (sa + sb));
    for (uint32_t k = 0; k < 8; k++) {
        double dot = 0;
        for (uint32_t d = 0; d < 512; d++)
            dot += (double)V[k * 512 + d] * UW[(size_t)k * 512 + d];
        cr_assert_geq(fabs(dot), 0.9999, "row %u: |V_k . U_k| = %.6f", k, fabs(dot));
    }
    /* The file loads into a context (orthonormal to the library's tolerance). */
    kvt_model *m = mla_model(KVT_DTYPE_BF16, false);
    kvt_config c = small_config();
    kvt_ctx *ctx = make_ctx(m, &c, KVT_BACKEND_CPU, R, 0);
    cr_assert_eq(kvt_ctx_load_recall_basis(ctx, 0, basis), KVT_OK, "%s", kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    /* Rank 4 of the 8 strong directions: their share. */
    snprintf(args, sizeof args, "%s -o %s --rank 4 --layer 2", trace, basis);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 0, "%s", out);
    cr_assert_eq(kvt_recall_basis_read(basis, &info, NULL, 0), KVT_OK);
    cr_assert_float_eq(info.captured, s4 / (sa + sb), 1e-5, "captured %.8f", info.captured);
    /* Two copies of the trace: twice the samples, the same subspace and share. */
    snprintf(args, sizeof args, "%s %s -o %s --rank 8", trace, trace, basis);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 0, "%s", out);
    cr_assert_eq(kvt_recall_basis_read(basis, &info, NULL, 0), KVT_OK);
    cr_assert_eq(info.samples, 2 * CAL_STEPS * CAL_HEADS);
    cr_assert_float_eq(info.captured, sa / (sa + sb), 1e-5);
    /* Refusals: a trace without queries, a layer not traced, a bad command line. */
    write_cal_trace(trace, UW, false);
    snprintf(args, sizeof args, "%s -o %s", trace, basis);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "carries no queries"), "%s", out);
    snprintf(args, sizeof args, "%s -o %s --layer 1", trace, basis);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_assert_eq(run_calibrate("--rank 0", out, sizeof out), 2, "%s", out);
    remove(trace);
    remove(basis);
    free(UW);
#endif
}

/* ---------------------------------------------------------------------------------------------
 * Conformal z (recall/conformal.h) on hand-computed samples.
 * ------------------------------------------------------------------------------------------- */
Test(conformal, rank_and_the_smallest_sample_count) {
    /* k = ceil((n + 1) * 0.947): n = 18 -> 17.993 -> 18 (= n, the largest sample); n = 17 ->
     * 17.046 -> 18 > n (too few); n = 100 -> 95.647 -> 96; n = 999 -> 947 exactly. */
    cr_assert_eq(kvt__conformal_rank(18, 947), 18);
    cr_assert_eq(kvt__conformal_rank(17, 947), 18);
    cr_assert_eq(kvt__conformal_rank(100, 947), 96);
    cr_assert_eq(kvt__conformal_rank(999, 947), 947);
    cr_assert_eq(kvt__conformal_rank(256, 947), 244); /* 257 * 0.947 = 243.379 */
    float e;
    cr_assert(kvt__conformal_sample(3.0f, 1.0f, 0.5f, &e));
    cr_assert_eq(e, 4.0f);
    cr_assert(kvt__conformal_sample(1.0f, 3.0f, 0.5f, &e));
    cr_assert_eq(e, -4.0f);
    cr_assert_not(kvt__conformal_sample(3.0f, 1.0f, 0.0f, &e));
    cr_assert_not(kvt__conformal_sample(3.0f, 1.0f, INFINITY, &e));
    cr_assert_not(kvt__conformal_sample(NAN, 1.0f, 1.0f, &e));
}

/* 8 steps of 2 samples: 16 < 18 at the first window end, so z stays provisional; 8 more steps:
 * n = 32, k = ceil(33 * 0.947) = ceil(31.251) = 32: the largest sample. */
Test(conformal, windows_and_a_hand_computed_z) {
    float buf[64 * 4];
    kvt__conformal c;
    kvt__conformal_init(&c, buf, 64 * 4);
    for (uint32_t s = 0; s < 8; s++) {
        float e[2] = {0.25f * (float)s, -1.0f + 0.5f * (float)s}; /* max so far 3.0 */
        cr_assert(kvt__conformal_step(&c, e, 2), "step %u", s);
    }
    cr_assert_eq(c.z, KVT__CONFORMAL_Z_MAX);
    cr_assert_not(c.calibrated);
    for (uint32_t s = 8; s < 16; s++) {
        float e[2] = {0.25f * (float)s, -1.0f + 0.25f * (float)s}; /* s = 15: 3.75 and 2.75 */
        cr_assert_eq(kvt__conformal_step(&c, e, 2), s < 15, "step %u", s);
    }
    cr_assert(c.calibrated && c.fixed);
    cr_assert_eq(c.n, 32);
    cr_assert_eq(c.k, 32);
    cr_assert_eq(c.z, 3.75f);
    /* Fixed: later steps change nothing. */
    float big = 100.0f;
    cr_assert_not(kvt__conformal_step(&c, &big, 1));
    cr_assert_eq(c.z, 3.75f);
}

/* 100 samples at the 8-step window: e = 0.05 * (i + 1) for i < 100 in a scrambled order; k = 96,
 * so z = 4.8; the same samples scaled by 2 give 9.6, clamped to Z_MAX = 8 and reported. */
Test(conformal, order_statistic_and_clamp) {
    for (int scale = 1; scale <= 2; scale++) {
        float buf[256], e[100];
        for (uint32_t i = 0; i < 100; i++)
            e[(i * 37) % 100] = 0.05f * (float)(i + 1) * (float)scale; /* 37 is prime to 100 */
        kvt__conformal c;
        kvt__conformal_init(&c, buf, 256);
        for (uint32_t s = 0; s < 8; s++)
            kvt__conformal_step(&c, e + s * 12, s < 7 ? 12 : 16);
        cr_assert(c.calibrated);
        cr_assert_eq(c.n, 100);
        cr_assert_eq(c.k, 96);
        if (scale == 1) {
            cr_assert_float_eq(c.z, 4.8f, 1e-6);
            cr_assert_not(c.clamped);
        } else {
            cr_assert_eq(c.z, KVT__CONFORMAL_Z_MAX);
            cr_assert(c.clamped);
        }
    }
    /* Never 18 samples by the 64-step window: provisional Z_MAX for good. */
    float buf[64], one = 1.0f;
    kvt__conformal c;
    kvt__conformal_init(&c, buf, 64);
    uint32_t s = 0;
    while (kvt__conformal_step(&c, &one, s % 4 == 0 ? 1 : 0))
        s++;
    cr_assert_eq(c.steps, 64);
    cr_assert_eq(c.n, 16);
    cr_assert(c.fixed && !c.calibrated);
    cr_assert_eq(c.z, KVT__CONFORMAL_Z_MAX);
}

/* A request's sketch planes travel with it: a snapshot restores into a context with the same
 * basis (its own snapshot then the same bytes), and is refused by one with another basis; a
 * fork and an attach carry the closed rows' sketches (their planes equal the parent's). */
Test(sketch_planes, snapshots_forks_and_attaches_carry_the_sketches) {
    fixture f;
    const uint32_t N = 64 * 4 + 16;
    setup(&f, KVT_BACKEND_CPU, 0, 9090, N, true);
    feed(f.seq, f.rows, N, 16);
    size_t bytes, bytes2;
    cr_assert_eq(kvt_seq_snapshot_size(f.seq, &bytes), KVT_OK, "%s", kvt_last_error());
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    cr_assert(a && b);
    cr_assert_eq(kvt_seq_snapshot(f.seq, a, bytes, NULL), KVT_OK, "%s", kvt_last_error());
    kvt_ctx *same_basis = make_ctx(f.m, &f.c, KVT_BACKEND_GUARDED, R, 0);
    cr_assert_eq(kvt_ctx_set_recall_basis(same_basis, 0, f.V, R), KVT_OK);
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore(same_basis, a, bytes, &r), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_snapshot_size(r, &bytes2), KVT_OK);
    cr_assert_eq(bytes2, bytes);
    cr_assert_eq(kvt_seq_snapshot(r, b, bytes, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(memcmp(a, b, bytes), 0, "a restored request's snapshot differs");
    kvt_ctx *other = make_ctx(f.m, &f.c, KVT_BACKEND_CPU, R, 0); /* no basis set */
    kvt_seq *x;
    cr_assert_eq(kvt_seq_restore(other, a, bytes, &x), KVT_ERR_MISMATCH, "%s", kvt_last_error());
    cr_assert(strstr(kvt_last_error(), "recall sketches") != NULL, "%s", kvt_last_error());
    /* Fork and attach (at 4 closed blocks' 256 rows). */
    const uint64_t closed = 64 * 4;
    uint16_t *pc = malloc(sizeof(uint16_t) * closed * R), *cc = malloc(sizeof(uint16_t) * closed * R);
    float *pr = malloc(sizeof(float) * closed), *cr_ = malloc(sizeof(float) * closed);
    cr_assert(pc && cc && pr && cr_);
    read_planes(f.seq, closed, pc, pr);
    kvt_seq *kid;
    for (int v = 0; v < 2; v++) {
        if (v == 0)
            cr_assert_eq(kvt_seq_fork(f.seq, 2, &kid), KVT_OK, "%s", kvt_last_error());
        else
            cr_assert_eq(kvt_seq_attach(f.seq, closed, 3, &kid), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_check(kid), KVT_OK, "%s", kvt_last_error());
        read_planes(kid, closed, cc, cr_);
        cr_assert_eq(memcmp(pc, cc, sizeof(uint16_t) * closed * R), 0, "csk of the %s",
                     v ? "attach" : "fork");
        cr_assert_eq(memcmp(pr, cr_, sizeof(float) * closed), 0);
        kvt_layer_stats st = {.struct_size = sizeof st};
        cr_assert_eq(kvt_seq_layer_stats(kid, 0, &st), KVT_OK);
        cr_assert_eq(st.sketched_rows, closed);
    }
    free(pc);
    free(cc);
    free(pr);
    free(cr_);
    free(a);
    free(b);
    kvt_ctx_destroy(same_basis);
    kvt_ctx_destroy(other);
    teardown(&f);
}

/* ---------------------------------------------------------------------------------------------
 * kvtier-inspect calibrate on RoPE layers: per KV head, the top eigenvectors of the uncentred
 * second moment of the traced rows' keys (docs/recall.md §9), one file PREFIX.h<H> per head,
 * loaded by kvt_ctx_load_recall_head_basis. Synthetic: a GQA-RoPE layer (2 KV heads, head_dim
 * 64, bf16) whose head h's keys are Σ_k a_k U_h,k (U_h: 8 orthonormal rows, another subspace per
 * head; a_k normal with scale 4 − k/4) plus noise of 1e-3: the fitted rows must lie in span U_h
 * (each row's projection on it >= 0.9999 of its norm²), not in the other head's, and capture
 * >= 0.999 of the key energy. Real: Gemma-3-270M's global layers (tests/data).
 * ------------------------------------------------------------------------------------------- */
#if KVT_HAVE_LAPACKE && KVT_HAVE_INSPECT
#define KC_ROWS 200u
#define KC_HEADS 2u
#define KC_DIM 64u
#define KC_RANK 8u

static void kc_spec(uint32_t head_dim, kvt_layer_spec *sp) {
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, KC_HEADS, head_dim, sp),
                 KVT_OK);
    sp->n_q_heads = 4;
}

/* Layer 1 of a 4-layer model: keys of head h in span U_h (U: [KC_HEADS][KC_RANK][KC_DIM]). */
static void write_key_trace(const char *path, const float *U, uint64_t seed) {
    kvt_layer_spec sp;
    kc_spec(KC_DIM, &sp);
    kvt_trace_meta meta = {.n_model_layers = 4, .text = "generator=test_recall key calibrate\n"};
    kvt_trace_writer *w;
    char err[256];
    cr_assert_eq(kvt_trace_writer_open(path, &meta, &w, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_eq(kvt_trace_write_layer(w, 1, &sp), KVT_OK);
    const size_t bytes = (size_t)KC_ROWS * KC_HEADS * sp.row_bytes;
    uint16_t *k = malloc(bytes), *v = calloc(1, bytes);
    cr_assert(k && v);
    tu_rng g = {seed};
    for (uint32_t r = 0; r < KC_ROWS; r++)
        for (uint32_t h = 0; h < KC_HEADS; h++) {
            float x[KC_DIM];
            for (uint32_t d = 0; d < KC_DIM; d++)
                x[d] = (float)(1e-3 * tu_normal(&g));
            for (uint32_t j = 0; j < KC_RANK; j++) {
                float a = (float)((4.0 - 0.25 * j) * tu_normal(&g));
                for (uint32_t d = 0; d < KC_DIM; d++)
                    x[d] += a * U[((size_t)h * KC_RANK + j) * KC_DIM + d];
            }
            for (uint32_t d = 0; d < KC_DIM; d++) /* bf16, truncated: noise of 2^-8 at most */
                memcpy(&k[((size_t)r * KC_HEADS + h) * KC_DIM + d], (char *)&x[d] + 2, 2);
        }
    cr_assert_eq(kvt_trace_write_rows(w, 1, 0, k, KC_ROWS, bytes), KVT_OK);
    cr_assert_eq(kvt_trace_write_rows(w, 1, 1, v, KC_ROWS, bytes), KVT_OK);
    free(k);
    free(v);
    cr_assert_eq(kvt_trace_writer_close(w, err, sizeof err), KVT_OK, "%s", err);
}

/* Smallest share of a fitted row's norm² inside span U (rank rows of dim). */
static double min_share_in(const float *V, uint32_t vrank, const float *U, uint32_t rank,
                           uint32_t dim) {
    double worst = 1.0;
    for (uint32_t a = 0; a < vrank; a++) {
        double in = 0;
        for (uint32_t j = 0; j < rank; j++) {
            double dot = 0;
            for (uint32_t d = 0; d < dim; d++)
                dot += (double)V[(size_t)a * dim + d] * U[(size_t)j * dim + d];
            in += dot * dot;
        }
        worst = in < worst ? in : worst;
    }
    return worst;
}

static kvt_ctx *key_ctx(kvt_model *m, kvt_recall_mode mode, uint32_t sketch_rank) {
    kvt_config c = kvt_config_default();
    c.recall = mode;
    return make_ctx(m, &c, KVT_BACKEND_CPU, sketch_rank, 0);
}
#endif

Test(calibrate, key_bases_per_kv_head_span_each_heads_keys, .timeout = 120) {
#if !KVT_HAVE_LAPACKE
    cr_skip_test("built without LAPACKE (liblapacke-dev): kvtier-inspect calibrate is disabled");
#elif !KVT_HAVE_INSPECT
    cr_skip_test("built without the tools (KVT_BUILD_TOOLS=OFF): no kvtier-inspect to run");
#else
    char trace[] = "/tmp/kvt_kcal_XXXXXX", prefix[] = "/tmp/kvt_kcalb_XXXXXX";
    temp_file(trace);
    temp_file(prefix);
    float U[KC_HEADS * KC_RANK * KC_DIM];
    orthonormal_rows(4242, KC_RANK, KC_DIM, U);
    orthonormal_rows(4343, KC_RANK, KC_DIM, U + KC_RANK * KC_DIM);
    write_key_trace(trace, U, 99);
    char out[4096], args[512], file[600];
    snprintf(args, sizeof args, "%s -o %s --rank %u", trace, prefix, KC_RANK); /* default layer */
    cr_assert_eq(run_calibrate(args, out, sizeof out), 0, "%s", out);
    cr_log_info("%s", out);
    cr_assert(strstr(out, "layer 1 KV head 0: 200 samples (keys of 200 rows"), "%s", out);
    cr_assert(strstr(out, "layer 1 KV head 1: 200 samples"), "%s", out);
    cr_assert(strstr(out, "uncentred key energy"), "%s", out);
    kvt_layer_spec sp[2];
    kc_spec(KC_DIM, &sp[0]);
    kc_spec(32, &sp[1]);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(sp, 2, "keys", &m, NULL, 0), KVT_OK);
    kvt_ctx *ctx = key_ctx(m, KVT_RECALL_CONFORMAL, 16);
    kvt_ctx *sound = key_ctx(m, KVT_RECALL_SOUND, 16);
    for (uint32_t h = 0; h < KC_HEADS; h++) {
        snprintf(file, sizeof file, "%s.h%u", prefix, h);
        kvt_recall_basis_info info;
        float V[KC_RANK * KC_DIM];
        cr_assert_eq(kvt_recall_basis_read(file, &info, V, KC_RANK * KC_DIM), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert(info.layer == 1 && info.rank == KC_RANK && info.dim == KC_DIM &&
                  info.samples == KC_ROWS);
        cr_assert_geq(info.captured, 0.999, "head %u: captured %.6f", h, info.captured);
        cr_assert_leq(info.captured, 1.0);
        const float *mine = U + (size_t)h * KC_RANK * KC_DIM;
        const float *other = U + (size_t)(1 - h) * KC_RANK * KC_DIM;
        double in = min_share_in(V, KC_RANK, mine, KC_RANK, KC_DIM);
        double cross = 1.0 - min_share_in(V, KC_RANK, other, KC_RANK, KC_DIM);
        cr_assert_geq(in, 0.9999, "head %u: a row has only %.6f of its norm^2 in its span", h, in);
        cr_assert_geq(cross, 0.5, "head %u: its basis lies in the other head's span", h);
        /* Orthonormal to fp32 precision, as the sound mode needs. */
        double frob = 0;
        for (uint32_t a = 0; a < KC_RANK; a++)
            for (uint32_t b = 0; b < KC_RANK; b++) {
                double dot = -(a == b);
                for (uint32_t d = 0; d < KC_DIM; d++)
                    dot += (double)V[a * KC_DIM + d] * V[b * KC_DIM + d];
                frob += dot * dot;
            }
        cr_assert_leq(sqrt(frob), 0x1p-20, "head %u: |V V^T - I|_F = %.3g", h, sqrt(frob));
        cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 0, h, file), KVT_OK, "%s",
                     kvt_last_error());
        cr_assert_eq(kvt_ctx_load_recall_head_basis(sound, 0, h, file), KVT_OK, "%s",
                     kvt_last_error());
        uint32_t rank = 0, id = 0;
        cr_assert_eq(kvt_ctx_recall_head_basis(sound, 0, h, &rank, &id), KVT_OK);
        cr_assert(rank == KC_RANK && id == info.id, "rank %u id 0x%08x", rank, id);
    }
    /* Refusals: a file on a layer of another head_dim, a KV head out of range, a NULL path. */
    snprintf(file, sizeof file, "%s.h0", prefix);
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 1, 0, file), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "key dim 32"), "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 0, 2, file), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 2, 0, file), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 0, 0, NULL), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_load_recall_head_basis(NULL, 0, 0, file), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ctx_load_recall_basis(ctx, 0, file), KVT_ERR_POLICY_MISMATCH, "%s",
                 kvt_last_error());
    kvt_ctx_destroy(ctx);
    kvt_ctx_destroy(sound);
    kvt_model_destroy(m);
    /* A rank above the sketch's stride (16) is refused at load; above the dim, by the tool. */
    snprintf(args, sizeof args, "%s -o %s --rank 32 --layer 1", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 0, "%s", out);
    kc_spec(KC_DIM, &sp[0]);
    cr_assert_eq(kvt_model_create(sp, 1, "keys", &m, NULL, 0), KVT_OK);
    ctx = key_ctx(m, KVT_RECALL_CONFORMAL, 16);
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 0, 0, file), KVT_ERR_OUT_OF_RANGE);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    snprintf(args, sizeof args, "%s -o %s --rank 65", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "cannot give a rank-65 basis"), "%s", out);
    snprintf(args, sizeof args, "%s -o %s --rank x", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 2, "%s", out);
    snprintf(args, sizeof args, "%s -o %s --layer 2", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "layer 2 is not traced"), "%s", out);
    /* Bad input: a missing trace, a corrupt one (a flipped byte in the K rows), a truncated one,
     * a file that is not a trace: a message and exit 1, never a crash. */
    snprintf(args, sizeof args, "/nonexistent/kvt.kvtt -o %s", prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "kvtier-inspect calibrate: /nonexistent/kvt.kvtt: "), "%s", out);
    FILE *f = fopen(trace, "r+b");
    cr_assert(f);
    cr_assert_eq(fseek(f, -4000, SEEK_END), 0);
    int ch = fgetc(f);
    cr_assert_eq(fseek(f, -4000, SEEK_END), 0);
    fputc(ch ^ 0x40, f);
    fclose(f);
    snprintf(args, sizeof args, "%s -o %s", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "kvtier-inspect calibrate: ") && strstr(out, trace), "%s", out);
    cr_log_info("corrupt: %s", out);
    cr_assert_eq(truncate(trace, 5000), 0);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_log_info("truncated: %s", out);
    snprintf(args, sizeof args, "%s.h0 -o %s", prefix, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    for (uint32_t h = 0; h < KC_HEADS; h++) {
        snprintf(file, sizeof file, "%s.h%u", prefix, h);
        remove(file);
    }
    remove(trace);
    remove(prefix);
#endif
}

/* The committed Gemma-3-270M trace (tests/data/gemma3-270m-fact-1k.md): global layers 5, 11, 17,
 * GQA-RoPE, 1 KV head of head_dim 256, 1,019 rows of fp32 post-RoPE keys. Calibrate runs on
 * each, the share is in (0, 1], and the files load on a context made from the model's config. */
Test(calibrate, key_bases_of_the_gemma_trace, .timeout = 120) {
#if !KVT_HAVE_LAPACKE
    cr_skip_test("built without LAPACKE (liblapacke-dev): kvtier-inspect calibrate is disabled");
#elif !KVT_HAVE_INSPECT
    cr_skip_test("built without the tools (KVT_BUILD_TOOLS=OFF): no kvtier-inspect to run");
#else
    const char *trace = KVT_SOURCE_DIR "/tests/data/gemma3-270m-fact-1k.kvtt";
    char prefix[] = "/tmp/kvt_gcal_XXXXXX";
    temp_file(prefix);
    kvt_model *m;
    char err[256], out[4096], args[1024], file[600];
    cr_assert_eq(kvt_model_from_file(KVT_SOURCE_DIR "/tests/data/gemma-3-270m.json",
                                     KVT_DTYPE_FP32, &m, err, sizeof err),
                 KVT_OK, "%s", err);
    kvt_ctx *ctx = key_ctx(m, KVT_RECALL_SOUND, 128);
    snprintf(file, sizeof file, "%s.h0", prefix);
    const uint32_t layers[] = {5, 11, 17};
    for (uint32_t i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "%s -o %s --rank 64%s%u", trace, prefix,
                 i ? " --layer " : "", i ? layers[i] : 0);
        if (!i) /* the default layer: the first traced RoPE layer */
            snprintf(args, sizeof args, "%s -o %s --rank 64", trace, prefix);
        cr_assert_eq(run_calibrate(args, out, sizeof out), 0, "%s", out);
        cr_log_info("%s", out);
        char want[64];
        snprintf(want, sizeof want, "layer %u KV head 0: 1019 samples", layers[i]);
        cr_assert(strstr(out, want), "%s", out);
        kvt_recall_basis_info info;
        cr_assert_eq(kvt_recall_basis_read(file, &info, NULL, 0), KVT_OK);
        cr_assert(info.layer == layers[i] && info.dim == 256 && info.rank == 64);
        cr_assert(info.captured > 0 && info.captured <= 1, "captured %g", info.captured);
        cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, layers[i], 0, file), KVT_OK, "%s",
                     kvt_last_error());
    }
    /* The layer field is informational: layer 17's basis loads on layer 5 too; a sliding layer
     * (random eviction does not run there), KV head 1 and another dim are refused. */
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 5, 0, file), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 0, 0, file), KVT_ERR_POLICY_MISMATCH);
    cr_assert_eq(kvt_ctx_load_recall_head_basis(ctx, 5, 1, file), KVT_ERR_OUT_OF_RANGE);
    snprintf(args, sizeof args, "%s -o %s --layer 0", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "layer 0 is not traced"), "%s", out);
    snprintf(args, sizeof args, "%s -o %s --layer 5 --rank 257", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 2, "%s", out);
    snprintf(args, sizeof args, "%s -o %s --layer 5 --rank 256", trace, prefix);
    cr_assert_eq(run_calibrate(args, out, sizeof out), 0, "%s", out); /* every direction */
    cr_assert(strstr(out, "captures 100.0000%"), "%s", out);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    remove(file);
    remove(prefix);
#endif
}
