/*
 * test_sigma.c — σ (low-pass Fourier residual of the branch) against an independent double
 * computation, the Fourier basis, and the norm ablations.
 *
 * The reference never touches kvt__fourier_basis: per channel it takes the explicit DFT
 * coefficients a_k = Σ_u x_u cos(2πku/B), b_k = Σ_u x_u sin(2πku/B) for k < κ in double and
 * subtracts the low-pass signal a_0/B + (2/B) Σ_{k≥1} (a_k cos + b_k sin) from x, then takes the
 * norm of what is left over the channels.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/sigma.h"
#include "kvtier.h"
#include "kvtier_ref.h"
#include "support/testutil.h"

#define D 64u
#define TWO_PI 6.283185307179586476925286766559
#define N_GUARD 16
static const float GUARD_F = -12345.678f;

typedef struct layout {
    const char *name;
    size_t stride_bytes;
    uint32_t branch_offset;
    int dt;
} layout;

static const layout LAYOUTS[] = {
    {"MLA bf16 row (1152 B, branch @1024)", 1152, 1024, KVT__DT_BF16},
    {"ds_mla fp8 row (656 B, bf16 branch @528)", 656, 528, KVT__DT_BF16},
    {"MLA fp16 row (1152 B, branch @1024)", 1152, 1024, KVT__DT_FP16},
    {"MLA fp32 row (2304 B, branch @2048)", 2304, 2048, KVT__DT_FP32},
};

/* Max |σ − σ_ref| / (block's largest branch norm), per branch dtype, over every block tested. */
static double g_max_rel[3];

/* A block of B rows scattered over a pool of B + B/2 slots (a random permutation subset). Every
 * byte of the pool is 0xFF (NaN in bf16, fp16 and fp32) except the branches written through
 * set(), so reading anything but the block's branch bytes poisons σ. */
typedef struct block {
    uint8_t *pool;
    int32_t *slots;
    uint32_t B;
    const layout *L;
} block;

static void block_init(block *b, const layout *L, uint32_t B, tu_rng *rng) {
    uint32_t n_slots = B + B / 2;
    b->L = L;
    b->B = B;
    b->pool = malloc(n_slots * L->stride_bytes);
    b->slots = malloc(n_slots * sizeof *b->slots);
    cr_assert(b->pool && b->slots);
    memset(b->pool, 0xff, n_slots * L->stride_bytes);
    for (uint32_t i = 0; i < n_slots; i++)
        b->slots[i] = (int32_t)i;
    for (uint32_t i = n_slots - 1; i > 0; i--) { /* Fisher-Yates */
        uint32_t j = (uint32_t)(tu_next(rng) % (i + 1));
        int32_t t = b->slots[i];
        b->slots[i] = b->slots[j];
        b->slots[j] = t;
    }
}

static void block_free(block *b) {
    free(b->pool);
    free(b->slots);
}

static uint8_t *row_ptr(const block *b, uint32_t u) {
    return b->pool + (size_t)b->slots[u] * b->L->stride_bytes;
}

static void set(block *b, uint32_t u, uint32_t d, double v) {
    kvt__store_elem(row_ptr(b, u) + b->L->branch_offset, b->L->dt, d, (float)v);
}

static double get(const block *b, uint32_t u, uint32_t d) {
    return (double)kvt__load_elem(row_ptr(b, u) + b->L->branch_offset, b->L->dt, d);
}

/* Independent double reference (see the top of the file). */
static void sigma_ref(const block *b, uint32_t kappa, double *sig) {
    const uint32_t B = b->B;
    double *ct = malloc(B * sizeof *ct), *st = malloc(B * sizeof *st);
    double *x = malloc(B * sizeof *x), *ss = calloc(B, sizeof *ss);
    cr_assert(ct && st && x && ss);
    for (uint32_t t = 0; t < B; t++) {
        ct[t] = cos(TWO_PI * (double)t / (double)B);
        st[t] = sin(TWO_PI * (double)t / (double)B);
    }
    for (uint32_t d = 0; d < D; d++) {
        for (uint32_t u = 0; u < B; u++)
            x[u] = get(b, u, d);
        double ak[KVT__SIGMA_MAX_BRANCH_DIM * 8], bk[KVT__SIGMA_MAX_BRANCH_DIM * 8];
        cr_assert(kappa <= sizeof ak / sizeof ak[0]);
        for (uint32_t k = 0; k < kappa; k++) {
            double sa = 0, sb = 0;
            for (uint32_t u = 0; u < B; u++) {
                uint32_t t = (uint32_t)(((uint64_t)k * u) % B);
                sa += x[u] * ct[t];
                sb += x[u] * st[t];
            }
            ak[k] = sa;
            bk[k] = sb;
        }
        for (uint32_t u = 0; u < B; u++) {
            double lp = ak[0] / B;
            for (uint32_t k = 1; k < kappa; k++) {
                uint32_t t = (uint32_t)(((uint64_t)k * u) % B);
                lp += (2.0 / B) * (ak[k] * ct[t] + bk[k] * st[t]);
            }
            double e = x[u] - lp;
            ss[u] += e * e;
        }
    }
    for (uint32_t u = 0; u < B; u++)
        sig[u] = sqrt(ss[u]);
    free(ct);
    free(st);
    free(x);
    free(ss);
}

static double max_branch_norm(const block *b) {
    double mx = 0;
    for (uint32_t u = 0; u < b->B; u++) {
        double s = 0;
        for (uint32_t d = 0; d < D; d++)
            s += get(b, u, d) * get(b, u, d);
        mx = fmax(mx, sqrt(s));
    }
    return mx;
}

/* Run kvt__sigma_block_cpu with guard floats after scratch and output, on the basis of kind
 * (kvt_sigma_basis). */
static float *run_sigma_kind(const block *b, uint32_t kappa, int kind) {
    const uint32_t B = b->B, nb = 2 * kappa - 1;
    float *basis = malloc((size_t)nb * B * sizeof *basis);
    cr_assert_eq(kvt__sigma_basis(kind, B, kappa, basis), 0);
    size_t ns = kvt__sigma_scratch_floats(B, nb, D);
    float *scratch = malloc((ns + N_GUARD) * sizeof *scratch);
    float *out = malloc((B + N_GUARD) * sizeof *out);
    for (int g = 0; g < N_GUARD; g++)
        scratch[ns + g] = out[B + g] = GUARD_F;
    kvt__sigma_block_cpu(b->pool, b->slots, B, b->L->stride_bytes, b->L->branch_offset, b->L->dt, D,
                         basis, nb, scratch, out);
    for (int g = 0; g < N_GUARD; g++) {
        cr_assert_eq(scratch[ns + g], GUARD_F, "write past scratch (B=%u kappa=%u)", B, kappa);
        cr_assert_eq(out[B + g], GUARD_F, "write past sigma_out (B=%u kappa=%u)", B, kappa);
    }
    free(basis);
    free(scratch);
    return out;
}

static float *run_sigma(const block *b, uint32_t kappa) {
    return run_sigma_kind(b, kappa, KVT_SIGMA_FOURIER);
}

/* Drift + DC + noise: per channel a DC offset, low-frequency sinusoids and a linear ramp (not
 * periodic: leaks into every bin), all ~1000x the noise. in_band: sinusoids strictly below κ and
 * no ramp, so the low-pass part explains everything but the noise and σ is the small difference
 * of large numbers (the hard cancellation case); otherwise some sinusoids sit just above κ. */
static void fill_drift(block *b, uint32_t kappa, tu_rng *rng, double noise, double drift, double dc,
                       int in_band) {
    const uint32_t B = b->B;
    for (uint32_t d = 0; d < D; d++) {
        double off = dc * (1.0 + 0.5 * tu_uniform(rng)) * ((d & 1) ? -1 : 1);
        double amp[4], ph[4];
        uint32_t kk[4];
        for (int i = 0; i < 4; i++) {
            amp[i] = drift * (0.2 + tu_uniform(rng));
            ph[i] = TWO_PI * tu_uniform(rng);
            kk[i] = (uint32_t)(tu_next(rng) % (in_band ? kappa : kappa + 2));
        }
        double ramp = in_band ? 0.0 : drift * (tu_uniform(rng) - 0.5);
        for (uint32_t u = 0; u < B; u++) {
            double v = off + ramp * (double)u / B;
            for (int i = 0; i < 4; i++)
                v += amp[i] * cos(TWO_PI * kk[i] * (double)u / B + ph[i]);
            v += noise * tu_normal(rng);
            set(b, u, d, v);
        }
    }
}

static void check_block(block *b, uint32_t kappa, uint64_t seed, const char *what) {
    const uint32_t B = b->B;
    float *s = run_sigma(b, kappa);
    double *ref = malloc(B * sizeof *ref);
    sigma_ref(b, kappa, ref);
    double scale = max_branch_norm(b), worst = 0, ref_mean = 0, worst_rel_sigma = 0;
    uint32_t worst_u = 0;
    for (uint32_t u = 0; u < B; u++) {
        cr_assert(isfinite(s[u]), "%s [%s] B=%u kappa=%u seed=%llu: sigma[%u] not finite", what,
                  b->L->name, B, kappa, (unsigned long long)seed, u);
        double e = fabs((double)s[u] - ref[u]);
        if (e > worst) {
            worst = e;
            worst_u = u;
        }
        ref_mean += ref[u] / B;
        if (ref[u] > 0)
            worst_rel_sigma = fmax(worst_rel_sigma, e / ref[u]);
    }
    double rel = worst / scale;
    if (rel > g_max_rel[b->L->dt])
        g_max_rel[b->L->dt] = rel;
    printf("sigma %-40s %-9s B=%-5u kappa=%-3u max|d|/maxnorm=%.2e max|d|/sigma_ref=%.1e "
           "(mean sigma_ref/maxnorm %.1e)\n",
           b->L->name, what, B, kappa, rel, worst_rel_sigma, ref_mean / scale);
    cr_assert_leq(worst, 1e-5 * scale,
                  "%s [%s] B=%u kappa=%u seed=%llu: |sigma - ref| = %.3e at u=%u (sigma %.9g, "
                  "ref %.9g), limit 1e-5 x %.6g",
                  what, b->L->name, B, kappa, (unsigned long long)seed, worst, worst_u,
                  (double)s[worst_u], ref[worst_u], scale);
    free(s);
    free(ref);
}

Test(sigma, matches_double_reference) {
    struct {
        uint32_t B, kappa;
    } cases[] = {{64, 16}, {64, 1}, {64, 32}, {1024, 16}, {1024, 5}, {4096, 16}, {4096, 3}};
    for (size_t l = 0; l < sizeof LAYOUTS / sizeof LAYOUTS[0]; l++) {
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            uint64_t seed = 0x5157a000u + 31 * l + c;
            tu_rng rng = {seed};
            block b;
            block_init(&b, &LAYOUTS[l], cases[c].B, &rng);
            /* Hard cancellation: drift 1000x the noise, DC offset 3000x. */
            fill_drift(&b, cases[c].kappa, &rng, 0.01, 10.0, 30.0, 1);
            check_block(&b, cases[c].kappa, seed, "inband+DC");
            fill_drift(&b, cases[c].kappa, &rng, 0.01, 10.0, 30.0, 0);
            check_block(&b, cases[c].kappa, seed, "drift+DC");
            /* Plain noise: sigma close to the branch norm. */
            for (uint32_t u = 0; u < b.B; u++)
                for (uint32_t d = 0; d < D; d++)
                    set(&b, u, d, tu_normal(&rng));
            check_block(&b, cases[c].kappa, seed, "noise");
            block_free(&b);
        }
    }
    printf("sigma max |sigma - ref| / block max branch norm: bf16 %.2e  fp16 %.2e  fp32 %.2e\n",
           g_max_rel[KVT__DT_BF16], g_max_rel[KVT__DT_FP16], g_max_rel[KVT__DT_FP32]);
}

/* A row whose branch is flipped (same norm, a one-row event: high frequency along u) gets a large
 * sigma; the smooth rows of the same norm get ~0. Channel pairs (2i, 2i+1) rotate at in-band
 * frequencies, a_i (cos θ_i(u), sin θ_i(u)), so every row has the same norm N. The flip adds
 * v = −2 r_u0 at u0 alone; its residual is v (1 − (2κ−1)/B) at u0 and at most |v| (2κ−1)/B
 * elsewhere (Σ_j C_j(u0)² = (2κ−1)/B). */
Test(sigma, spike_versus_smooth) {
    struct {
        uint32_t B, kappa;
    } cases[] = {{4096, 16}, {256, 4}, {1024, 16}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint32_t B = cases[c].B, kappa = cases[c].kappa;
        uint64_t seed = 0xabc0 + c;
        tu_rng rng = {seed};
        block b;
        block_init(&b, &LAYOUTS[3], B, &rng); /* fp32 rows: the smooth signal is stored exactly */
        double n2 = 0;
        for (uint32_t i = 0; i < D / 2; i++) {
            double a = 1.0 + tu_uniform(&rng);
            double ph = TWO_PI * tu_uniform(&rng);
            uint32_t k = (uint32_t)(tu_next(&rng) % kappa);
            n2 += a * a;
            for (uint32_t u = 0; u < B; u++) {
                double th = TWO_PI * (double)k * u / B + ph;
                set(&b, u, 2 * i, a * cos(th));
                set(&b, u, 2 * i + 1, a * sin(th));
            }
        }
        const double N = sqrt(n2);
        float *s = run_sigma(&b, kappa);
        for (uint32_t u = 0; u < B; u++)
            cr_assert_leq(s[u], 1e-5 * N, "B=%u seed=%llu: smooth row %u sigma %g (norm %g)", B,
                          (unsigned long long)seed, u, (double)s[u], N);
        free(s);

        const uint32_t u0 = B / 3;
        for (uint32_t d = 0; d < D; d++)
            set(&b, u0, d, -get(&b, u0, d));
        s = run_sigma(&b, kappa);
        const double frac = (2.0 * kappa - 1) / B;
        double expect = 2 * N * (1 - frac);
        cr_assert(fabs(s[u0] - expect) <= 1e-4 * expect,
                  "B=%u seed=%llu: spike sigma %g, expected %g", B, (unsigned long long)seed,
                  (double)s[u0], expect);
        for (uint32_t u = 0; u < B; u++)
            if (u != u0)
                cr_assert_leq(s[u], 2 * N * frac + 1e-5 * N, "B=%u: row %u sigma %g", B, u,
                              (double)s[u]);
        /* A smooth row with the same norm as the spike row: ~0 next to ~2N. */
        cr_assert_lt(s[u0 + B / 4], 0.05 * s[u0]);
        free(s);
        block_free(&b);
    }
}

Test(sigma, deterministic_and_gather_independent) {
    const uint32_t B = 1024, kappa = 16;
    uint64_t seed = 31337;
    tu_rng rng = {seed};
    block a, b;
    block_init(&a, &LAYOUTS[0], B, &rng);
    block_init(&b, &LAYOUTS[1], B, &rng); /* other stride, offset and slot permutation */
    fill_drift(&a, kappa, &rng, 0.1, 5.0, 2.0, 0);
    for (uint32_t u = 0; u < B; u++)
        for (uint32_t d = 0; d < D; d++)
            set(&b, u, d, get(&a, u, d));
    float *s1 = run_sigma(&a, kappa), *s2 = run_sigma(&a, kappa), *s3 = run_sigma(&b, kappa);
    cr_assert(memcmp(s1, s2, B * sizeof *s1) == 0, "two runs differ");
    cr_assert(memcmp(s1, s3, B * sizeof *s1) == 0, "same rows, other layout: bits differ");
    free(s1);
    free(s2);
    free(s3);
    block_free(&a);
    block_free(&b);
}

/* A row with a non-finite branch value is left out of the fit and scored +Inf; every other row
 * gets exactly (bit for bit) the σ it gets when that row's branch is zero. */
Test(sigma, nonfinite_row_costs_only_itself) {
    const uint32_t B = 256, kappa = 8;
    const float bad_vals[3] = {NAN, INFINITY, -INFINITY};
    for (int li = 0; li < 4; li++) {
        uint64_t seed = 5 + (uint64_t)li;
        tu_rng rng = {seed};
        block b;
        block_init(&b, &LAYOUTS[li], B, &rng);
        fill_drift(&b, kappa, &rng, 0.1, 5.0, 2.0, 0);
        for (uint32_t d = 0; d < D; d++) {
            set(&b, 10, d, 0.0);
            set(&b, 200, d, 0.0);
        }
        float *ref = run_sigma(&b, kappa);
        for (int k = 0; k < 3; k++) {
            set(&b, 10, 7, bad_vals[k]);
            set(&b, 200, 63, bad_vals[(k + 1) % 3]);
            float *s = run_sigma(&b, kappa);
            for (uint32_t u = 0; u < B; u++) {
                if (u == 10 || u == 200) {
                    cr_assert(isinf(s[u]) && s[u] > 0, "%s: bad row %u scored %g", b.L->name, u,
                              s[u]);
                    continue;
                }
                cr_assert(memcmp(&s[u], &ref[u], sizeof(float)) == 0,
                          "%s seed %llu: row %u %.9g, with the bad rows zeroed %.9g", b.L->name,
                          (unsigned long long)seed, u, s[u], ref[u]);
            }
            free(s);
            set(&b, 10, 7, 0.0);
            set(&b, 200, 63, 0.0);
        }
        free(ref);
        block_free(&b);
    }
}

/* max |CᵀC − I| of an [nb][B] basis, in double. */
static double gram_error(const float *basis, uint32_t nb, uint32_t B) {
    double worst = 0;
    for (uint32_t i = 0; i < nb; i++)
        for (uint32_t j = i; j < nb; j++) {
            double g = 0;
            for (uint32_t u = 0; u < B; u++)
                g += (double)basis[(size_t)i * B + u] * basis[(size_t)j * B + u];
            worst = fmax(worst, fabs(g - (i == j ? 1.0 : 0.0)));
        }
    return worst;
}

Test(sigma, basis_orthonormal) {
    struct {
        uint32_t B, kappa;
    } cases[] = {{64, 1},    {64, 16},   {64, 32},  {128, 64}, {256, 128},
                 {1024, 16}, {4096, 16}, {4096, 1}, {65536, 4}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint32_t B = cases[c].B, kappa = cases[c].kappa, nb = 2 * kappa - 1;
        float *basis = malloc((size_t)nb * B * sizeof *basis);
        cr_assert_eq(kvt__fourier_basis(B, kappa, basis), 0);
        double worst = gram_error(basis, nb, B);
        cr_assert_leq(worst, 1e-6, "B=%u kappa=%u: |CᵀC − I| = %g", B, kappa, worst);
        /* Column layout: 1/√B, then cos k, sin k. */
        cr_assert_float_eq(basis[5], (float)(1 / sqrt((double)B)), 1e-9);
        if (kappa > 1) {
            cr_assert_float_eq(basis[(size_t)1 * B + 0], (float)sqrt(2.0 / B), 1e-9);
            cr_assert_float_eq(basis[(size_t)2 * B + 0], 0.0f, 1e-9);
            cr_assert_float_eq(basis[(size_t)2 * B + B / 4], (float)sqrt(2.0 / B), 1e-9);
        }
        free(basis);
    }
}

Test(sigma, basis_rejects_bad_arguments) {
    float buf[64 * 64];
    cr_assert_eq(kvt__fourier_basis(32, 4, buf), -1);
    cr_assert_eq(kvt__fourier_basis(0, 4, buf), -1);
    cr_assert_eq(kvt__fourier_basis(96, 4, buf), -1);
    cr_assert_eq(kvt__fourier_basis(100, 4, buf), -1);
    cr_assert_eq(kvt__fourier_basis(64, 0, buf), -1);
    cr_assert_eq(kvt__fourier_basis(64, 33, buf), -1);
    cr_assert_eq(kvt__fourier_basis(64, 4, NULL), -1);
    cr_assert_eq(kvt__fourier_basis(64, 32, buf), 0);
    cr_assert_eq(kvt__sigma_scratch_floats(4096, 31, 64), (size_t)64 * 31 * 64);
    cr_assert_eq(kvt__sigma_scratch_floats(64, 31, 64), (size_t)31 * 64);
}

Test(sigma, norm_ablations) {
    static const struct {
        int dt;
        size_t stride;
        uint32_t n_values, branch_offset;
    } cases[] = {
        {KVT__DT_BF16, 1152, 576, 1024},
        {KVT__DT_FP16, 1152, 576, 1024},
        {KVT__DT_FP32, 2304, 576, 2048},
        {KVT__DT_BF16, 200, 100, 72}, /* odd sizes: 100 values, 64-value branch at value 36 */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        uint64_t seed = 900 + c;
        tu_rng rng = {seed};
        layout L = {"ablation", cases[c].stride, cases[c].branch_offset, cases[c].dt};
        block b;
        const uint32_t n = 300;
        block_init(&b, &L, n, &rng);
        for (uint32_t u = 0; u < n; u++)
            for (uint32_t i = 0; i < cases[c].n_values; i++)
                kvt__store_elem(row_ptr(&b, u), cases[c].dt, i,
                                (float)(tu_normal(&rng) * (1 + (u % 7)) + (i % 5)));
        float *bn = malloc((n + N_GUARD) * sizeof *bn), *rn = malloc((n + N_GUARD) * sizeof *rn);
        for (int g = 0; g < N_GUARD; g++)
            bn[n + g] = rn[n + g] = GUARD_F;
        kvt__branch_norm_cpu(b.pool, b.slots, n, L.stride_bytes, L.branch_offset, L.dt, D, bn);
        kvt__row_norm_cpu(b.pool, b.slots, n, L.stride_bytes, L.dt, cases[c].n_values, rn);
        for (int g = 0; g < N_GUARD; g++)
            cr_assert(bn[n + g] == GUARD_F && rn[n + g] == GUARD_F, "write past out");
        for (uint32_t u = 0; u < n; u++) {
            double sb = 0, sr = 0;
            for (uint32_t d = 0; d < D; d++)
                sb += get(&b, u, d) * get(&b, u, d);
            for (uint32_t i = 0; i < cases[c].n_values; i++) {
                double x = kvt__load_elem(row_ptr(&b, u), L.dt, i);
                sr += x * x;
            }
            cr_assert(fabs(bn[u] - sqrt(sb)) <= 2e-6 * sqrt(sb),
                      "seed=%llu row %u: branch %g vs %g", (unsigned long long)seed, u,
                      (double)bn[u], sqrt(sb));
            cr_assert(fabs(rn[u] - sqrt(sr)) <= 2e-6 * sqrt(sr), "seed=%llu row %u: row %g vs %g",
                      (unsigned long long)seed, u, (double)rn[u], sqrt(sr));
        }
        free(bn);
        free(rn);
        block_free(&b);
    }
}

/* The CPU twin interleaves the per-element chains (loop interchange, vectorisation, the FMA
 * clone); a GPU kernel will evaluate kvt__sigma_recon / kvt__sigma_residual / kvt__norm_fixed per
 * element. Both must give the same bits: recompute every σ from the twin's Y (left in scratch
 * leaf 0) through the per-element KVT_HD functions and compare exactly. */
Test(sigma, twin_equals_per_element_functions) {
    const uint32_t B = 1024, kappa = 16, nb = 2 * kappa - 1;
    for (int li = 0; li < 2; li++) {
        uint64_t seed = 4242 + (uint64_t)li;
        tu_rng rng = {seed};
        block a;
        block_init(&a, &LAYOUTS[li], B, &rng);
        fill_drift(&a, kappa, &rng, 0.1, 5.0, 2.0, 0);
        float *basis = malloc((size_t)nb * B * sizeof *basis);
        cr_assert_eq(kvt__fourier_basis(B, kappa, basis), 0);
        size_t ns = kvt__sigma_scratch_floats(B, nb, D);
        float *scratch = malloc(ns * sizeof *scratch), *out = malloc(B * sizeof *out);
        kvt__sigma_block_cpu(a.pool, a.slots, B, a.L->stride_bytes, a.L->branch_offset, a.L->dt, D,
                             basis, nb, scratch, out);
        const float *Y = scratch;
        for (uint32_t u = 0; u < B; u++) {
            float r[D];
            const uint8_t *row = row_ptr(&a, u);
            for (uint32_t d = 0; d < D; d++)
                r[d] = kvt__sigma_residual(
                    kvt__sigma_branch_val(row, a.L->branch_offset, a.L->dt, d),
                    kvt__sigma_recon(basis, B, nb, u, Y, D, d));
            float s = kvt__norm_fixed(r, D);
            cr_assert(memcmp(&s, &out[u], sizeof s) == 0, "seed %llu row %u: twin %.9g, "
                      "per-element %.9g", (unsigned long long)seed, u, out[u], s);
        }
        free(basis);
        free(scratch);
        free(out);
        block_free(&a);
    }
}

/* The AVX2 + FMA and AVX-512 twins (kvt__sigma_simd) give the scalar twin's bits: σ of every row
 * and the fit Y (scratch leaf 0), on every layout, Fourier and DCT bases, several B and κ, branches
 * of 64 and 128 values (and 96, which takes the scalar loops), with rows at the edges: non-finite
 * (left out of the fit), all zero, subnormal, huge, and a near-exact low-pass fit (cancellation).
 */
Test(sigma, simd_twin_equals_scalar_twin) {
    static const uint32_t Bs[] = {64, 256, 1024, 4096};
    static const uint32_t kappas[] = {1, 4, 16, 8};
    static const uint32_t dims[] = {64, 128, 96};
    const int simd = kvt__sigma_simd(-1);
    uint64_t rows = 0, rows_at[3] = {0, 0, 0};
    for (uint32_t c = 0; c < 24; c++) {
        const uint64_t seed = 0x51600u + c;
        tu_rng rng = {seed};
        const layout *L = &LAYOUTS[c % 4];
        const uint32_t B = Bs[(c / 4) % 4], kappa = kappas[c % 4], nb = 2 * kappa - 1;
        const uint32_t bd = L->stride_bytes >= 1152 ? dims[c % 3] : 64u;
        const uint32_t off =
            L->branch_offset + 64u * (L->dt == KVT__DT_FP32 ? 4u : 2u) -
            bd * (L->dt == KVT__DT_FP32 ? 4u : 2u); /* the branch ends where D's does */
        block b;
        block_init(&b, L, B, &rng);
        fill_drift(&b, kappa, &rng, c % 2 ? 1e-3 : 0.1, 5.0, 2.0, (int)(c % 3 == 0));
        for (uint32_t u = 0; u < B; u++) { /* the channels past 64 and the edge rows */
            uint8_t *br = row_ptr(&b, u) + off;
            const uint32_t kind = (uint32_t)(tu_next(&rng) % 16);
            for (uint32_t d = 0; d < bd; d++) {
                float v = kvt__load_elem(br, L->dt, d);
                if (bd != 64u && d < bd - 64u)
                    v = (float)tu_normal(&rng);
                if (kind == 0)
                    v = 0.0f;
                else if (kind == 1)
                    v = 1e-40f * (float)(tu_next(&rng) % 1000);
                else if (kind == 2)
                    v = v * 1e30f;
                else if (kind == 3 && d == (uint32_t)(tu_next(&rng) % bd))
                    v = tu_next(&rng) % 2 ? NAN : -INFINITY;
                kvt__store_elem(br, L->dt, d, v);
            }
        }
        float *basis = malloc((size_t)nb * B * sizeof *basis);
        cr_assert_eq(kvt__sigma_basis((int)(c % 2), B, kappa, basis), 0);
        const size_t ns = kvt__sigma_scratch_floats(B, nb, bd);
        float *sc[3], *out[3];
        for (int v = 0; v < 3; v++) { /* levels 0 (scalar), 1 (AVX2), 2 (AVX-512) */
            sc[v] = malloc((ns + N_GUARD) * sizeof(float));
            out[v] = malloc((B + N_GUARD) * sizeof(float));
            cr_assert(sc[v] && out[v]);
            for (int g = 0; g < N_GUARD; g++)
                sc[v][ns + g] = out[v][B + g] = GUARD_F;
            kvt__sigma_simd(v);
            kvt__sigma_block_cpu(b.pool, b.slots, B, L->stride_bytes, off, L->dt, bd, basis, nb,
                                 sc[v], out[v]);
            kvt__sigma_simd(2);
            for (int g = 0; g < N_GUARD; g++)
                cr_assert(sc[v][ns + g] == GUARD_F && out[v][B + g] == GUARD_F,
                          "seed %llx: write past the scratch or σ", (unsigned long long)seed);
        }
        for (int v = 1; v < 3; v++) {
            cr_assert(!memcmp(sc[0], sc[v], sizeof(float) * nb * bd),
                      "seed %llx (%s, B %u, kappa %u, branch %u): level %d: the fit Y differs",
                      (unsigned long long)seed, L->name, B, kappa, bd, v);
            for (uint32_t u = 0; u < B; u++)
                cr_assert(!memcmp(&out[0][u], &out[v][u], sizeof(float)),
                          "seed %llx (%s, B %u, kappa %u, branch %u): level %d, row %u: SIMD "
                          "%.9g, scalar %.9g",
                          (unsigned long long)seed, L->name, B, kappa, bd, v, u, (double)out[v][u],
                          (double)out[0][u]);
            rows_at[v] += simd >= v && bd % 64u == 0 ? B : 0;
        }
        rows += B;
        for (int v = 0; v < 3; v++) {
            free(sc[v]);
            free(out[v]);
        }
        free(basis);
        block_free(&b);
    }
    cr_log_info("sigma: %llu rows equal at every level, %llu through the AVX2 twin, %llu through "
                "the AVX-512 one (CPU level %d)",
                (unsigned long long)rows, (unsigned long long)rows_at[1],
                (unsigned long long)rows_at[2], simd);
    cr_assert(simd < 1 || rows_at[1] > 0);
    cr_assert(simd < 2 || rows_at[2] > 0);
}

/* ---------------------------------------------------------------------------------------------
 * The σ basis option (kvt_config.sigma_basis): DCT-II columns instead of the periodic Fourier ones
 * ------------------------------------------------------------------------------------------- */

Test(sigma_basis, dct_orthonormal_and_laid_out) {
    struct {
        uint32_t B, kappa;
    } cases[] = {{64, 1}, {64, 16}, {64, 32}, {128, 64}, {1024, 16}, {4096, 16}, {65536, 4}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint32_t B = cases[c].B, kappa = cases[c].kappa, nb = 2 * kappa - 1;
        float *basis = malloc((size_t)nb * B * sizeof *basis);
        cr_assert_eq(kvt__dct_basis(B, kappa, basis), 0);
        double worst = gram_error(basis, nb, B);
        cr_assert_leq(worst, 1e-6, "B=%u kappa=%u: |CᵀC − I| = %g", B, kappa, worst);
        /* Column k at row u: √(2/B)·cos(πk(2u + 1)/(2B)), column 0 constant. */
        for (uint32_t k = 0; k < nb; k++)
            for (uint32_t u = 0; u < B; u += B / 8 + 3) {
                double want = k == 0 ? 1 / sqrt((double)B)
                                     : sqrt(2.0 / B) * cos(TWO_PI / 2 * k * (2.0 * u + 1) / (2.0 * B));
                cr_assert_float_eq(basis[(size_t)k * B + u], (float)want, 1e-7,
                                   "B=%u column %u row %u", B, k, u);
            }
        /* The dispatcher: kind 0 is the Fourier table bit for bit, kind 1 this one. */
        float *other = malloc((size_t)nb * B * sizeof *other);
        cr_assert_eq(kvt__sigma_basis(KVT_SIGMA_DCT, B, kappa, other), 0);
        cr_assert(memcmp(basis, other, (size_t)nb * B * sizeof *basis) == 0);
        cr_assert_eq(kvt__sigma_basis(KVT_SIGMA_FOURIER, B, kappa, other), 0);
        cr_assert_eq(kvt__fourier_basis(B, kappa, basis), 0);
        cr_assert(memcmp(basis, other, (size_t)nb * B * sizeof *basis) == 0);
        free(other);
        free(basis);
    }
    float buf[64 * 64];
    cr_assert_eq(kvt__dct_basis(32, 4, buf), -1);
    cr_assert_eq(kvt__dct_basis(96, 4, buf), -1);
    cr_assert_eq(kvt__dct_basis(64, 0, buf), -1);
    cr_assert_eq(kvt__dct_basis(64, 33, buf), -1);
    cr_assert_eq(kvt__dct_basis(64, 4, NULL), -1);
    cr_assert_eq(kvt__sigma_basis(2, 64, 4, buf), -1);
    cr_assert_eq(kvt__sigma_basis(-1, 64, 4, buf), -1);
}

/* Of the top B/32 σ rows of a block whose branch is a per-channel linear ramp plus small
 * heteroscedastic noise, how many lie within 32 rows of either end of the block (chance: 64 / B
 * of them). */
static uint32_t ramp_top_edge_rows(int kind, uint64_t seed) {
    const uint32_t B = 1024, kappa = 16, top = B / 32, edge = 32;
    tu_rng rng = {seed};
    block b;
    block_init(&b, &LAYOUTS[3], B, &rng); /* fp32 branch: no rounding of the ramp */
    double slope[D];
    for (uint32_t d = 0; d < D; d++)
        slope[d] = (tu_uniform(&rng) - 0.5) * 4.0 / B; /* a span of up to ±2 over the block */
    for (uint32_t u = 0; u < B; u++) {
        double noise = 0.1 * exp(0.25 * tu_normal(&rng));
        for (uint32_t d = 0; d < D; d++)
            set(&b, u, d, slope[d] * ((double)u - B / 2.0) + noise * tu_normal(&rng));
    }
    float *sig = run_sigma_kind(&b, kappa, kind);
    uint32_t near = 0;
    for (uint32_t k = 0; k < top; k++) { /* pick the top rows one by one */
        uint32_t best = 0;
        for (uint32_t u = 1; u < B; u++)
            if (sig[u] > sig[best])
                best = u;
        near += best < edge || best >= B - edge;
        sig[best] = -1.0f;
    }
    free(sig);
    block_free(&b);
    return near;
}

/* A drifting branch (a ramp) must not put the σ budget at the block's ends. Chance is 2 of the 32
 * top rows; the periodic Fourier fit sees the ramp as a jump at the block's ends and puts nearly
 * all 32 there (checked too, so the test can tell the two bases apart); DCT-II has no such jump. */
Test(sigma_basis, ramp_edges_not_favoured_with_dct) {
    for (uint64_t seed = 1; seed <= 3; seed++) {
        uint32_t dct = ramp_top_edge_rows(KVT_SIGMA_DCT, seed);
        uint32_t fourier = ramp_top_edge_rows(KVT_SIGMA_FOURIER, seed);
        cr_log_info("seed %llu: top 32 rows near an edge: DCT %u, Fourier %u (chance 2)",
                    (unsigned long long)seed, dct, fourier);
        cr_assert_leq(dct, 8, "seed %llu: DCT put %u of the top 32 rows at the block's edges",
                      (unsigned long long)seed, dct);
        cr_assert_geq(fourier, 24, "seed %llu: Fourier put only %u of 32 at the edges: the ramp "
                      "no longer tells the bases apart", (unsigned long long)seed, fourier);
    }
}

Test(sigma_basis, config_field_checked_and_defaulted) {
    char err[256];
    kvt_config c = kvt_config_default();
    cr_assert_eq(c.sigma_basis, KVT_SIGMA_FOURIER, "the reference basis stays the default");
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_OK, "%s", err);
    c.sigma_basis = KVT_SIGMA_DCT;
    cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_OK, "%s", err);
    const int bad[] = {2, 3, -1, 1000};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c.sigma_basis = (kvt_sigma_basis)bad[i];
        err[0] = 0;
        cr_assert_eq(kvt_config_check(&c, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
        cr_assert(strstr(err, "config.sigma_basis"), "message names the field: %s", err);
    }
    /* A caller built before the field: its struct ends at KVT_CONFIG_SIZE_MIN, so whatever lies
     * after is not read and the context gets the default. */
    cr_assert_eq(KVT_CONFIG_SIZE_MIN, offsetof(kvt_config, recall_cap_rows));
    cr_assert_gt(offsetof(kvt_config, sigma_basis), KVT_CONFIG_SIZE_MIN);
    kvt_layer_spec sp;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &sp), KVT_OK);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&sp, 1, "one", &m, NULL, 0), KVT_OK);
    c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.struct_size = KVT_CONFIG_SIZE_MIN;
    c.sigma_basis = (kvt_sigma_basis)7; /* past the caller's struct: never read */
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 16;
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    cr_assert_eq(kvt_ctx_config(ctx)->sigma_basis, KVT_SIGMA_FOURIER);
    kvt_ctx_destroy(ctx);
    c.struct_size = sizeof c; /* now it is read, and refused */
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_ERR_INVALID_ARGUMENT);
    kvt_model_destroy(m);
}

/* The option reaches σ: a context with sigma_basis = DCT scores a closed block exactly as
 * kvt__sigma_block_cpu does on the DCT table (bit for bit), and differently from the Fourier
 * context on the same rows. */
/* A context of one MLA-NoPE bf16 layer (512 + 64), block B, κ 4, ratio 8, σ basis kind. */
static kvt_ctx *one_layer_ctx(kvt_sigma_basis kind, uint32_t B, kvt_model **m) {
    kvt_layer_spec sp;
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &sp), KVT_OK);
    cr_assert_eq(kvt_model_create(&sp, 1, "one", m, NULL, 0), KVT_OK);
    kvt_config c = kvt_config_default();
    c.block_rows = B;
    c.kappa = 4;
    c.ratio = 8;
    c.sigma_basis = kind;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = *m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 2 * B / 16 + 4;
    kvt_ctx *ctx;
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &ctx, err, sizeof err), KVT_OK, "%s", err);
    return ctx;
}

/* A request of ctx holding one closed block of B rows (row_bytes each at rows). */
static kvt_seq *seq_with_block(kvt_ctx *ctx, uint32_t B, const uint8_t *rows, size_t row_bytes) {
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 1, &seq), KVT_OK);
    cr_assert_eq(tu_reserve(seq, B), KVT_OK);
    cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, B, rows, (size_t)B * row_bytes), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(tu_commit(seq, B), KVT_OK, "%s", kvt_last_error());
    return seq;
}

static float *seq_scores(const kvt_seq *seq, uint32_t B) {
    uint64_t n = 0;
    float *sc = malloc(sizeof *sc * B);
    cr_assert_eq(kvt_seq_scores(seq, 0, sc, B, &n), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(n, B);
    return sc;
}

/* The option reaches σ: a context with sigma_basis = DCT scores a closed block exactly as
 * kvt__sigma_block_cpu does on the DCT table (bit for bit), and differently from the Fourier
 * context on the same rows. */
static float *context_scores(kvt_sigma_basis kind, uint32_t B, uint8_t *rows, size_t row_bytes) {
    kvt_model *m;
    kvt_ctx *ctx = one_layer_ctx(kind, B, &m);
    float *sc = seq_scores(seq_with_block(ctx, B, rows, row_bytes), B);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    return sc;
}

/* B rows of the MLA bf16 layout: random latent, branch = per-channel ramp + noise. */
static uint8_t *ramp_rows(uint32_t B, const layout *L, uint64_t seed) {
    tu_rng rng = {seed};
    uint8_t *rows = calloc(B, L->stride_bytes);
    for (uint32_t u = 0; u < B; u++) {
        for (uint32_t i = 0; i < 512; i++)
            kvt__store_elem(rows + (size_t)u * L->stride_bytes, L->dt, i,
                            (float)tu_normal(&rng));
        for (uint32_t d = 0; d < D; d++)
            kvt__store_elem(rows + (size_t)u * L->stride_bytes + L->branch_offset, L->dt, d,
                            (float)(0.02 * d * ((double)u - B / 2.0) / B * 8 + 0.1 * tu_normal(&rng)));
    }
    return rows;
}

/* A snapshot carries the basis in META's formerly reserved word (file offset 76: 24-byte file
 * header, 24-byte section header, 7 words): 0 for FOURIER, so those snapshots are what they
 * were; restoring into a context of the other basis is a mismatch naming the field, into one of
 * the same basis gives the same scores. */
Test(sigma_basis, snapshot_carries_the_basis) {
    const uint32_t B = 128;
    const layout *L = &LAYOUTS[0];
    uint8_t *rows = ramp_rows(B, L, 5);
    for (int kind = KVT_SIGMA_FOURIER; kind <= KVT_SIGMA_DCT; kind++) {
        kvt_model *m, *m2, *m3;
        kvt_ctx *ctx = one_layer_ctx((kvt_sigma_basis)kind, B, &m);
        kvt_seq *seq = seq_with_block(ctx, B, rows, L->stride_bytes);
        size_t n = 0;
        cr_assert_eq(kvt_seq_snapshot_size(seq, &n), KVT_OK);
        uint8_t *buf = malloc(n);
        cr_assert_eq(kvt_seq_snapshot(seq, buf, n, &n), KVT_OK, "%s", kvt_last_error());
        /* META's configuration flags word (file header 24 + section header 24 + 60): bit 32 */
        cr_assert_eq((buf[108] >> 5) & 1u, (uint32_t)kind);
        kvt_ctx *other = one_layer_ctx((kvt_sigma_basis)(1 - kind), B, &m2);
        kvt_seq *r;
        cr_assert_eq(kvt_seq_restore(other, buf, n, &r), KVT_ERR_MISMATCH);
        cr_assert(strstr(kvt_last_error(), "config.sigma_basis"), "%s", kvt_last_error());
        kvt_ctx *same = one_layer_ctx((kvt_sigma_basis)kind, B, &m3);
        cr_assert_eq(kvt_seq_restore(same, buf, n, &r), KVT_OK, "%s", kvt_last_error());
        float *a = seq_scores(seq, B), *b = seq_scores(r, B);
        cr_assert(memcmp(a, b, B * sizeof *a) == 0);
        free(a);
        free(b);
        free(buf);
        kvt_ctx_destroy(same);
        kvt_ctx_destroy(other);
        kvt_ctx_destroy(ctx);
        kvt_model_destroy(m);
        kvt_model_destroy(m2);
        kvt_model_destroy(m3);
    }
    free(rows);
}

Test(sigma_basis, context_option_reaches_sigma) {
    const uint32_t B = 128, kappa = 4;
    const layout *L = &LAYOUTS[0]; /* the MLA bf16 row: 1152 B, branch at 1024 */
    uint8_t *rows = ramp_rows(B, L, 77);
    int32_t *slots = malloc(B * sizeof *slots);
    for (uint32_t u = 0; u < B; u++)
        slots[u] = (int32_t)u;
    for (int kind = KVT_SIGMA_FOURIER; kind <= KVT_SIGMA_DCT; kind++) {
        const uint32_t nb = 2 * kappa - 1;
        float *basis = malloc((size_t)nb * B * sizeof *basis);
        cr_assert_eq(kvt__sigma_basis(kind, B, kappa, basis), 0);
        float *scratch = malloc(kvt__sigma_scratch_floats(B, nb, D) * sizeof *scratch);
        float *want = malloc(B * sizeof *want);
        kvt__sigma_block_cpu(rows, slots, B, L->stride_bytes, L->branch_offset, L->dt, D, basis,
                             nb, scratch, want);
        float *got = context_scores((kvt_sigma_basis)kind, B, rows, L->stride_bytes);
        cr_assert(memcmp(got, want, B * sizeof *got) == 0, "kind %d: scores differ from the CPU "
                  "twin on its basis", kind);
        if (kind == KVT_SIGMA_DCT) {
            float *four = context_scores(KVT_SIGMA_FOURIER, B, rows, L->stride_bytes);
            cr_assert(memcmp(got, four, B * sizeof *got) != 0, "DCT scored like Fourier");
            free(four);
        }
        free(got);
        free(want);
        free(scratch);
        free(basis);
    }
    free(rows);
    free(slots);
}

/* The reference API takes the basis too (kvtier-needle calibrates its needles with it):
 * kvt_ref_sigma_create is the FOURIER one; an unknown basis is refused. */
Test(sigma_basis, ref_handle_takes_the_basis) {
    const uint32_t B = 256, kappa = 8, nb = 2 * kappa - 1;
    float *want = malloc((size_t)nb * B * sizeof *want);
    for (int kind = KVT_SIGMA_FOURIER; kind <= KVT_SIGMA_DCT; kind++) {
        kvt_ref_sigma *h;
        cr_assert_eq(kvt_ref_sigma_create_basis(B, kappa, D, (kvt_sigma_basis)kind, &h), KVT_OK);
        uint32_t n = 0;
        const float *got = kvt_ref_sigma_basis(h, &n);
        cr_assert_eq(n, nb);
        cr_assert_eq(kvt__sigma_basis(kind, B, kappa, want), 0);
        cr_assert(memcmp(got, want, (size_t)nb * B * sizeof *want) == 0, "kind %d", kind);
        kvt_ref_sigma_destroy(h);
    }
    kvt_ref_sigma *h;
    cr_assert_eq(kvt_ref_sigma_create(B, kappa, D, &h), KVT_OK);
    cr_assert(memcmp(kvt_ref_sigma_basis(h, NULL), want, (size_t)nb * B * sizeof *want) != 0,
              "kvt_ref_sigma_create is not the DCT basis");
    cr_assert_eq(kvt__fourier_basis(B, kappa, want), 0);
    cr_assert(memcmp(kvt_ref_sigma_basis(h, NULL), want, (size_t)nb * B * sizeof *want) == 0);
    kvt_ref_sigma_destroy(h);
    h = (kvt_ref_sigma *)1;
    cr_assert_eq(kvt_ref_sigma_create_basis(B, kappa, D, (kvt_sigma_basis)2, &h),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(h);
    free(want);
}
