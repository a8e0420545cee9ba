/* test_salience.c — the NoPE salience tier through the public API, at the default block size:
 * spikes kept, smooth rows and large smooth decoys archived (a branch-norm selector must fail
 * this), keep masks against a double-precision reference, invariants and archived bytes after
 * every block close. */
#include <criterion/criterion.h>

#include "kvtier.h"
#include "support/testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ROW 1152u
#define PI 3.14159265358979323846

static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The haystack: the branch follows a slow trend of constant norm (channel d rotates with a period
 * of 1024 rows: 4 cycles per 4096-row block, inside the κ = 16 low-pass band) plus small noise.
 *  - spike rows: the branch points in a random direction, same norm as the trend (σ large);
 *  - smooth rows: exactly on the trend, no noise, same norm (σ ≈ 0);
 *  - decoy block: the trend times a smooth envelope up to 5× (norm large, σ small).
 * The noise (10% of the per-channel amplitude) sits well above bf16 rounding. With 1% noise and a
 * 10× decoy, bf16 rounding of the large values (ulp 2^-4 at |v| >= 8) is itself high-frequency
 * content larger than the noise, and σ then ranks 2381 of the 4096 decoy rows into the top 1/8 —
 * measured here; σ is an absolute residual, so rounding noise that grows with magnitude raises
 * it. Real caches whose noise floor is within a few ulp of their magnitude would see the same. */
typedef struct hay {
    uint64_t n;
    uint64_t decoy_first, decoy_rows;
    uint64_t spikes[16], smooth[16];
    int n_spikes, n_smooth;
    /* Rows whose branch gets one non-finite value after it is built: bad[i] takes bad_bits[i]
     * (a bf16 NaN or ±Inf) in channel 7. */
    uint64_t bad[4];
    uint16_t bad_bits[4];
    int n_bad;
} hay;

static const double AMP = 1.0, NOISE = 0.1;

static double trend(uint64_t p, int d, const hay *h) {
    double env = 1.0;
    if (p >= h->decoy_first && p < h->decoy_first + h->decoy_rows) {
        double x = (double)(p - h->decoy_first) / (double)h->decoy_rows;
        env = 1.0 + 4.0 * sin(PI * x) * sin(PI * x);
    }
    /* Pairs of channels rotate together: constant norm AMP * sqrt(32) outside the decoy. */
    double ph = 2.0 * PI * (double)p / 1024.0 + 0.37 * (d / 2);
    return env * AMP * (d % 2 ? sin(ph) : cos(ph));
}

static int is_in(const uint64_t *v, int n, uint64_t p) {
    for (int i = 0; i < n; i++)
        if (v[i] == p)
            return 1;
    return 0;
}

static void make_row(uint8_t *row, uint64_t p, const hay *h, tu_rng *rng) {
    uint16_t *v = (uint16_t *)row;
    for (int i = 0; i < 512; i++)
        v[i] = bf16((float)tu_normal(rng));
    if (is_in(h->spikes, h->n_spikes, p)) {
        double dir[64], nn = 0;
        for (int d = 0; d < 64; d++) {
            dir[d] = tu_normal(rng);
            nn += dir[d] * dir[d];
        }
        double scale = AMP * sqrt(32.0) / sqrt(nn);
        for (int d = 0; d < 64; d++)
            v[512 + d] = bf16((float)(dir[d] * scale));
        return;
    }
    int smooth = is_in(h->smooth, h->n_smooth, p);
    for (int d = 0; d < 64; d++)
        v[512 + d] = bf16((float)(trend(p, d, h) + (smooth ? 0.0 : NOISE * tu_normal(rng))));
    for (int i = 0; i < h->n_bad; i++)
        if (h->bad[i] == p)
            v[512 + 7] = h->bad_bits[i];
}

static kvt_model *one_mla_layer(void) {
    kvt_layer_spec s;
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s);
    kvt_model *m;
    cr_assert_eq(kvt_model_create(&s, 1, "nope", &m, NULL, 0), KVT_OK);
    return m;
}

typedef struct run {
    kvt_ctx *ctx;
    kvt_seq *seq;
    uint8_t *shadow;
} run;

/* Append the haystack block by block through the public API, checking after every close. */
static run replay(const hay *h, uint32_t ratio, kvt_selector sel, uint64_t seed, bool check) {
    kvt_model *m = one_mla_layer();
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config p_cfg = kvt_config_default();
    p.config = &p_cfg;
    p.model = m;
    p_cfg.ratio = ratio;
    p_cfg.selector = sel;
    p.page_rows = 64;
    p.n_pages = (uint32_t)(h->n / 64 + 1);
    run r = {0};
    char err[256];
    cr_assert_eq(kvt_ctx_create(&p, &r.ctx, err, sizeof err), KVT_OK, "%s", err);
    kvt_model_destroy(m); /* the context keeps its own copy */
    cr_assert_eq(tu_seq_create(r.ctx, 1, &r.seq), KVT_OK);
    r.shadow = malloc(h->n * ROW);
    tu_rng rng = {seed};
    const uint32_t chunk = 1024; /* 4 commits per 4096-row block */
    for (uint64_t pos = 0; pos < h->n; pos += chunk) {
        uint32_t n = (uint32_t)(h->n - pos < chunk ? h->n - pos : chunk);
        for (uint32_t i = 0; i < n; i++)
            make_row(r.shadow + (pos + i) * ROW, pos + i, h, &rng);
        cr_assert_eq(tu_reserve(r.seq, n), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_seq_write(r.seq, 0, 0, 0, n, r.shadow + pos * ROW, (size_t)n * ROW),
                     KVT_OK);
        cr_assert_eq(tu_commit(r.seq, n), KVT_OK, "%s", kvt_last_error());
        if (!check || (pos + n) % 4096 != 0)
            continue;
        /* After every close: invariants, every row attended or archived with its exact bytes,
         * attended rows within m + sinks + tail. */
        cr_assert_eq(kvt_seq_check(r.seq), KVT_OK, "%s", kvt_last_error());
        uint8_t row[ROW];
        uint64_t att = 0;
        for (uint64_t q = 0; q < pos + n; q++) {
            kvt_row_state st;
            cr_assert_eq(kvt_seq_row_state(r.seq, 0, 0, q, &st, NULL), KVT_OK);
            cr_assert(st == KVT_ROW_ATTENDED || st == KVT_ROW_ARCHIVED);
            att += st == KVT_ROW_ATTENDED;
            cr_assert_eq(kvt_seq_read_row(r.seq, 0, 0, 0, q, row, ROW), KVT_OK);
            cr_assert_eq(memcmp(row, r.shadow + q * ROW, ROW), 0, "row %llu bytes changed",
                         (unsigned long long)q);
        }
        kvt_layer_stats ls = {.struct_size = sizeof ls};
        kvt_seq_layer_stats(r.seq, 0, &ls);
        uint64_t m_rows = (ls.closed_rows + ratio / 2) / ratio;
        if (m_rows < 1)
            m_rows = 1;
        cr_assert_eq(ls.attended_rows, att);
        cr_assert_eq(ls.archived_rows, pos + n - att);
        cr_assert(att <= m_rows + 4 + ls.tail_rows);
        if (sel == KVT_SELECT_SIGMA) /* σ reads the 128-byte branch of each closed row only */
            cr_assert_eq(ls.sigma_bytes_read, ls.closed_rows * 128);
    }
    return r;
}

static void run_free(run *r) {
    kvt_ctx_destroy(r->ctx);
    free(r->shadow);
}

static kvt_row_state state_of(const run *r, uint64_t p) {
    kvt_row_state st;
    cr_assert_eq(kvt_seq_row_state(r->seq, 0, 0, p, &st, NULL), KVT_OK);
    return st;
}

static hay make_hay(uint64_t seed) {
    hay h = {.n = 65536, .decoy_first = 5 * 4096, .decoy_rows = 4096};
    tu_rng rng = {seed ^ 0xabcdef};
    /* One spike and one smooth control per closed block (not the decoy block, not the sinks). */
    for (int b = 0; b < 16; b++) {
        if (b == 5)
            continue;
        uint64_t base = (uint64_t)b * 4096;
        h.spikes[h.n_spikes++] = base + 100 + tu_next(&rng) % 3800;
        uint64_t s;
        do {
            s = base + 100 + tu_next(&rng) % 3800;
        } while (s == h.spikes[h.n_spikes - 1]);
        h.smooth[h.n_smooth++] = s;
    }
    return h;
}

static int count_state(const run *r, const uint64_t *v, int n, kvt_row_state want) {
    int c = 0;
    for (int i = 0; i < n; i++)
        c += state_of(r, v[i]) == want;
    return c;
}

static int decoy_kept(const run *r, const hay *h) {
    int c = 0;
    for (uint64_t p = h->decoy_first; p < h->decoy_first + h->decoy_rows; p++)
        c += state_of(r, p) == KVT_ROW_ATTENDED;
    return c;
}

Test(salience_tier, spikes_kept_smooth_and_decoys_archived_65k, .timeout = 600) {
    const uint32_t ratios[] = {8, 32, 128};
    uint64_t seed = 20261129;
    hay h = make_hay(seed);
    cr_log_info("seed %llu, %d spikes, %d smooth controls, decoy block of %llu rows", (unsigned long long)seed,
                h.n_spikes, h.n_smooth, (unsigned long long)h.decoy_rows);
    for (int i = 0; i < 3; i++) {
        run r = replay(&h, ratios[i], KVT_SELECT_SIGMA, seed, /*check=*/i == 1);
        int spikes = count_state(&r, h.spikes, h.n_spikes, KVT_ROW_ATTENDED);
        int smooth = count_state(&r, h.smooth, h.n_smooth, KVT_ROW_ARCHIVED);
        int decoys = decoy_kept(&r, &h);
        cr_log_info("sigma %ux: spikes kept %d/%d, smooth archived %d/%d, decoy rows kept %d",
                    ratios[i], spikes, h.n_spikes, smooth, h.n_smooth, decoys);
        cr_expect_eq(spikes, h.n_spikes, "ratio %u", ratios[i]);
        cr_expect_eq(smooth, h.n_smooth, "ratio %u", ratios[i]);
        /* The decoy block's rows are smooth: σ ranks them with ordinary noise rows, so at most
         * their fair share (~1/ratio of the block) may be kept, never the block. */
        cr_expect_leq(decoys, (int)(2 * 4096 / ratios[i] + 8), "ratio %u: %d decoy rows kept",
                      ratios[i], decoys);
        run_free(&r);
    }
}

/* A non-finite value in one row's branch costs that row only (the input rule of sigma.h). Before
 * the rule, one NaN made σ NaN for all 4096 rows of its block, the canonical +Inf ties went to the
 * block's lowest positions, the whole kept budget landed on them and the spikes elsewhere were
 * archived. Now: the bad rows are attended (+Inf, first in rank) and counted; every spike is still
 * kept and every smooth control archived; the poisoned block keeps no more than its fair share
 * plus its bad rows; the stored bytes (NaN included) stay exact. */
Test(salience_tier, nonfinite_branch_costs_only_its_row, .timeout = 300) {
    uint64_t seed = 20261130;
    hay h = make_hay(seed);
    const uint64_t blk = 2 * 4096;
    const uint16_t bits[3] = {0x7fc0, 0x7f80, 0xff80}; /* bf16 NaN, +Inf, -Inf */
    for (int i = 0; i < 3; i++) {
        uint64_t p;
        do
            p = blk + 100 + (uint64_t)(i + 1) * 977 + (uint64_t)i;
        while (is_in(h.spikes, h.n_spikes, p) || is_in(h.smooth, h.n_smooth, p));
        h.bad[h.n_bad] = p;
        h.bad_bits[h.n_bad++] = bits[i];
    }
    const uint32_t ratio = 32;
    run r = replay(&h, ratio, KVT_SELECT_SIGMA, seed, /*check=*/true);
    int spikes = count_state(&r, h.spikes, h.n_spikes, KVT_ROW_ATTENDED);
    int smooth = count_state(&r, h.smooth, h.n_smooth, KVT_ROW_ARCHIVED);
    int bad = count_state(&r, h.bad, h.n_bad, KVT_ROW_ATTENDED);
    int kept_in_block = 0;
    for (uint64_t p = blk; p < blk + 4096; p++)
        kept_in_block += state_of(&r, p) == KVT_ROW_ATTENDED;
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(r.seq, 0, &ls), KVT_OK);
    cr_log_info("seed %llu: %d bad rows attended, spikes kept %d/%d, smooth archived %d/%d, "
                "poisoned block keeps %d rows, nonfinite_sigma %llu", (unsigned long long)seed, bad,
                spikes, h.n_spikes, smooth, h.n_smooth, kept_in_block,
                (unsigned long long)ls.nonfinite_sigma);
    cr_assert_eq(bad, h.n_bad);
    cr_assert_eq(ls.nonfinite_sigma, (uint64_t)h.n_bad);
    cr_assert_eq(spikes, h.n_spikes, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(smooth, h.n_smooth, "seed %llu", (unsigned long long)seed);
    cr_assert_leq(kept_in_block, 2 * 4096 / (int)ratio + h.n_bad, "poisoned block keeps %d rows",
                  kept_in_block);
    run_free(&r);
}

Test(salience_tier, branch_norm_selector_fails_the_decoy, .timeout = 300) {
    /* The ablation: ranking by branch L2 norm keeps the large smooth decoy and loses the spikes
     * at high ratios — the reason σ exists. If this ever passes, the decoy test proves nothing. */
    uint64_t seed = 20261129;
    hay h = make_hay(seed);
    run r = replay(&h, 32, KVT_SELECT_BRANCH_NORM, seed, false);
    int spikes = count_state(&r, h.spikes, h.n_spikes, KVT_ROW_ATTENDED);
    int decoys = decoy_kept(&r, &h);
    cr_log_info("branch-norm 32x: spikes kept %d/%d, decoy rows kept %d", spikes, h.n_spikes, decoys);
    cr_assert(decoys > 1024 || spikes < h.n_spikes,
              "branch-norm passed the decoy test (decoys kept %d, spikes %d)", decoys, spikes);
    cr_assert_gt(decoys, 1024);
    run_free(&r);
}

/* Double-precision σ by an explicit DFT low-pass (no shared code with the library). */
static void sigma_ref(const uint8_t *rows, uint64_t first, uint32_t B, uint32_t kappa,
                      double *out) {
    double *R = malloc(sizeof(double) * B * 64);
    for (uint32_t u = 0; u < B; u++)
        for (int d = 0; d < 64; d++)
            R[u * 64 + d] = from_bf16(((const uint16_t *)(rows + (first + u) * ROW))[512 + d]);
    double *low = calloc((size_t)B * 64, sizeof(double));
    for (int d = 0; d < 64; d++) {
        double mean = 0;
        for (uint32_t u = 0; u < B; u++)
            mean += R[u * 64 + d];
        mean /= B;
        for (uint32_t u = 0; u < B; u++)
            low[u * 64 + d] = mean;
        for (uint32_t k = 1; k < kappa; k++) {
            double a = 0, b = 0;
            for (uint32_t u = 0; u < B; u++) {
                double w = 2.0 * PI * k * u / B;
                a += R[u * 64 + d] * cos(w);
                b += R[u * 64 + d] * sin(w);
            }
            for (uint32_t u = 0; u < B; u++) {
                double w = 2.0 * PI * k * u / B;
                low[u * 64 + d] += 2.0 / B * (a * cos(w) + b * sin(w));
            }
        }
    }
    for (uint32_t u = 0; u < B; u++) {
        double s = 0;
        for (int d = 0; d < 64; d++) {
            double e = R[u * 64 + d] - low[u * 64 + d];
            s += e * e;
        }
        out[u] = sqrt(s);
    }
    free(R);
    free(low);
}

Test(salience_tier, keep_mask_matches_double_reference) {
    /* 8 blocks of 1024 rows of plain drift + noise; the library's kept set equals the top-m of
     * double-precision σ, except rows whose σ is within the tolerance of the m-th σ. */
    const uint32_t B = 1024, kappa = 16, ratio = 16;
    hay h = {.n = 8 * 1024, .decoy_first = ~0ull, .decoy_rows = 0};
    kvt_model *m = one_mla_layer();
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config p_cfg = kvt_config_default();
    p.config = &p_cfg;
    p.model = m;
    p_cfg.block_rows = B;
    p_cfg.kappa = kappa;
    p_cfg.ratio = ratio;
    p.n_pages = 200;
    kvt_ctx *ctx;
    cr_assert_eq(kvt_ctx_create(&p, &ctx, NULL, 0), KVT_OK);
    kvt_seq *seq;
    tu_seq_create(ctx, 3, &seq);
    uint8_t *rows = malloc(h.n * ROW);
    tu_rng rng = {777};
    for (uint64_t q = 0; q < h.n; q++)
        make_row(rows + q * ROW, q, &h, &rng);
    cr_assert_eq(tu_reserve(seq, (uint32_t)h.n), KVT_OK);
    cr_assert_eq(kvt_seq_write(seq, 0, 0, 0, (uint32_t)h.n, rows, h.n * ROW), KVT_OK);
    cr_assert_eq(tu_commit(seq, (uint32_t)h.n), KVT_OK);
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "%s", kvt_last_error());
    double *sig = malloc(sizeof(double) * h.n);
    double max_norm = 0;
    for (uint64_t b = 0; b < h.n / B; b++)
        sigma_ref(rows, b * B, B, kappa, sig + b * B);
    for (uint64_t q = 0; q < h.n; q++) {
        double s = 0;
        for (int d = 0; d < 64; d++) {
            double v = from_bf16(((uint16_t *)(rows + q * ROW))[512 + d]);
            s += v * v;
        }
        if (sqrt(s) > max_norm)
            max_norm = sqrt(s);
    }
    /* m-th largest reference σ */
    double *sorted = malloc(sizeof(double) * h.n);
    memcpy(sorted, sig, sizeof(double) * h.n);
    for (uint64_t i = 1; i < h.n; i++) { /* insertion sort is fine for 8k */
        double v = sorted[i];
        uint64_t j = i;
        while (j > 0 && sorted[j - 1] < v) {
            sorted[j] = sorted[j - 1];
            j--;
        }
        sorted[j] = v;
    }
    uint64_t mm = (h.n + ratio / 2) / ratio;
    double thr = sorted[mm - 1], tol = 1e-5 * max_norm;
    int mismatches = 0, ambiguous = 0;
    for (uint64_t q = 0; q < h.n; q++) {
        kvt_row_state st;
        kvt_seq_row_state(seq, 0, 0, q, &st, NULL);
        bool lib_kept = st == KVT_ROW_ATTENDED && q >= 4;
        bool ref_kept = sig[q] > thr;
        if (fabs(sig[q] - thr) <= tol) {
            ambiguous++;
            continue;
        }
        if (q < 4)
            continue; /* sinks are attended whatever their σ */
        mismatches += lib_kept != ref_kept;
    }
    cr_log_info("keep mask vs double reference: %d mismatches, %d rows within tol %.3g of the "
                "m-th σ",
                mismatches, ambiguous, tol);
    cr_assert_eq(mismatches, 0);
    free(sorted);
    free(sig);
    free(rows);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}
