/*
 * gen.c — the synthetic haystack generator. The statistical model is documented in
 * docs/needle.md; this file follows it section by section:
 *
 *   1. background rows: RMS-normalised latent = 0.6·topic(t) + 0.8·noise (topic drifts slowly
 *      through 4 fixed directions), branch = slow per-channel drift + heteroscedastic noise,
 *      with the sink direction projected out;
 *   2. sinks (rows 0..S-1): small latent, branch = A_s · sink direction;
 *   3. optional key-value haystack: a fraction of rows with fresh latent directions and a noisier
 *      branch (needle look-alikes);
 *   4. needles: R rows sharing one random latent direction; branch = drift + β·h with β set by
 *      bisection so that σ of each row lands in its salience band within its block;
 *   5. optional RoPE: every branch rotated by its position (after calibration);
 *   6. queries at position T: branch part c_q · sink direction (+ noise); targeted heads' latent
 *      a · needle direction + noise, a set by bisection so that the needle's full-cache mass is
 *      μ ~ U[mass_lo, mass_hi]; other heads random.
 * Every random number comes from a splitmix64 stream keyed by (seed, stream, index).
 */
#include "nd_internal.h"

#include "kvtier_ref.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_TOPICS 4
#define N_DRIFT 2
#define SINK_AMP 24.0  /* A_s: norm of a sink's branch along the sink direction */
#define LAT_TOPIC 0.6  /* weight of the topic in a background latent (before normalisation) */
#define LAT_NOISE 0.8
#define BR_DRIFT 0.6   /* per-channel drift amplitude of the branch */
#define BR_NOISE 0.35  /* median per-channel noise of the branch */
#define BR_NOISE_LOG_SD 0.25
#define Q_NOISE 0.3    /* per-element query latent noise */
#define Q_OTHER 8.0    /* norm scale of a non-targeted head's latent direction */
#define WALK_PHI 0.9995 /* --branch drift: AR(1) coefficient per row (time constant 2000 rows) */
#define WALK_SD 1.0    /* its stationary per-channel standard deviation */

static const char *const k_branch_names[] = {"smooth", "drift"};

const char *nd_branch_name(nd_branch b) {
    return (unsigned)b <= ND_BRANCH_DRIFT ? k_branch_names[b] : "?";
}

int nd_branch_parse(const char *s, nd_branch *out) {
    for (int i = 0; i <= ND_BRANCH_DRIFT; i++)
        if (strcmp(s, k_branch_names[i]) == 0) {
            *out = (nd_branch)i;
            return 0;
        }
    return -1;
}
#define DECOY_COS2 0.8 /* decoys: squared cosine between the template and a needle / decoy */
#define ND_STREAM_DECODE 6 /* one per decode step: filler queries */
#define ND_STREAM_DECOY 7  /* decoy membership and directions; the query subspace (index 0) */

nd_gen_params nd_gen_default_params(void) {
    nd_gen_params p;
    memset(&p, 0, sizeof p);
    p.context = 32768;
    p.seed = 1;
    p.dtype = KVT_DTYPE_BF16;
    const kvt_config lib = kvt_config_default(); /* the library's B, κ and sinks */
    p.block_rows = lib.block_rows;
    p.kappa = lib.kappa;
    p.sink_rows = lib.sink_rows;
    p.n_q_heads = 8;
    p.n_target_heads = 2;
    p.needle_rows = 1;
    p.needles_per_depth = 1;
    p.mass_lo = 0.6;
    p.mass_hi = 0.9;
    p.scale = KVT_REF_ATTN_DEFAULT_SCALE;
    p.decode_gap = 3;
    p.query_rank = 64;
    return p;
}

/* Fixed per-seed model parameters. */
typedef struct model {
    uint32_t L, D;
    float *topic;          /* [N_TOPICS][L], unit RMS */
    double t_period[N_TOPICS], t_phase[N_TOPICS];
    double d_amp[N_DRIFT][64], d_period[N_DRIFT][64], d_phase[N_DRIFT][64];
    float sink_dir[64];    /* unit */
    float *walk;           /* --branch drift: [n_rows][D] AR(1) walk added to the drift; NULL
                              for the smooth branch */
} model;

static void rms_normalise(float *v, uint32_t n, double rms) {
    double s = 0;
    for (uint32_t i = 0; i < n; i++)
        s += (double)v[i] * v[i];
    double f = s > 0 ? rms * sqrt((double)n / s) : 0.0;
    for (uint32_t i = 0; i < n; i++)
        v[i] = (float)(v[i] * f);
}

/* An orthonormal basis of a random rank-r subspace of R^L: Gaussian rows, Gram-Schmidt in double
 * (kvt_orthonormalise_rows, two passes, so the rows are orthonormal to fp32 precision). U: [r][L].
 * Coordinate axes when that cannot be had (out of memory, or r > L). */
static void subspace_init(float *U, uint32_t r, uint32_t L, uint64_t seed) {
    nd_rng g = nd_rng_for(seed, ND_STREAM_DECOY, 0);
    double *u = malloc(sizeof(double) * (size_t)r * L);
    if (u) {
        for (size_t i = 0; i < (size_t)r * L; i++)
            u[i] = nd_normal(&g);
    }
    if (!u || kvt_orthonormalise_rows(u, r, L, 2) != KVT_OK) { /* callers check U */
        memset(U, 0, sizeof(float) * (size_t)r * L);
        for (uint32_t k = 0; k < r && k < L; k++)
            U[(size_t)k * L + k] = 1.0f;
        free(u);
        return;
    }
    for (size_t i = 0; i < (size_t)r * L; i++)
        U[i] = (float)u[i];
    free(u);
}

/* A random unit vector of the subspace spanned by U's r rows: Uᵀ g normalised, g ~ N(0, I_r). */
static void subspace_draw(const float *U, uint32_t r, uint32_t L, nd_rng *g, float *out) {
    double c[KVT_RECALL_MAX_RANK], n = 0;
    for (uint32_t k = 0; k < r; k++)
        c[k] = nd_normal(g);
    for (uint32_t i = 0; i < L; i++) {
        double v = 0;
        for (uint32_t k = 0; k < r; k++)
            v += c[k] * U[(size_t)k * L + i];
        out[i] = (float)v;
        n += v * v;
    }
    n = n > 0 ? sqrt(n) : 1.0;
    for (uint32_t i = 0; i < L; i++)
        out[i] = (float)(out[i] / n);
}

/* cos·t + sin·u normalised (t, u unit): a decoy's or a decoyed needle's latent direction. */
static void decoy_dir(const float *t, const float *u, uint32_t L, float *out) {
    double a = sqrt(DECOY_COS2), b = sqrt(1.0 - DECOY_COS2), n = 0;
    for (uint32_t i = 0; i < L; i++) {
        out[i] = (float)(a * t[i] + b * u[i]);
        n += (double)out[i] * out[i];
    }
    n = sqrt(n);
    for (uint32_t i = 0; i < L; i++)
        out[i] = (float)(out[i] / n);
}

/* A non-targeted head's (or a filler query's) latent: Q_OTHER · w + Q_NOISE · g, w a random unit
 * direction (in the query subspace when the case has one). */
static void other_latent(const nd_case *c, uint32_t L, nd_rng *r, float *q) {
    float dir[512];
    if (c->qbasis) {
        subspace_draw(c->qbasis, c->qbasis_rank, L, r, dir);
    } else {
        for (uint32_t i = 0; i < L; i++)
            dir[i] = (float)nd_normal(r);
        rms_normalise(dir, L, 1.0 / sqrt((double)L)); /* unit norm */
    }
    for (uint32_t i = 0; i < L; i++)
        q[i] = (float)(Q_OTHER * dir[i] + Q_NOISE * nd_normal(r));
}

static void model_init(model *m, uint64_t seed, uint32_t L, uint32_t D) {
    m->L = L;
    m->D = D;
    nd_rng r = nd_rng_for(seed, ND_STREAM_TOPIC, 0);
    for (int k = 0; k < N_TOPICS; k++) {
        for (uint32_t i = 0; i < L; i++)
            m->topic[(size_t)k * L + i] = (float)nd_normal(&r);
        rms_normalise(m->topic + (size_t)k * L, L, 1.0);
        /* topic periods log-uniform in [8k, 128k] rows */
        m->t_period[k] = 8192.0 * pow(16.0, nd_uniform(&r));
        m->t_phase[k] = 6.283185307179586 * nd_uniform(&r);
    }
    for (int k = 0; k < N_DRIFT; k++)
        for (uint32_t d = 0; d < D; d++) {
            m->d_amp[k][d] = BR_DRIFT * (0.5 + nd_uniform(&r)) / sqrt((double)N_DRIFT);
            /* branch drift periods log-uniform in [16k, 256k] rows: under one block (4096) a
             * drift is a slow curve the κ = 16 low-pass explains (docs/needle.md) */
            m->d_period[k][d] = 16384.0 * pow(16.0, nd_uniform(&r));
            m->d_phase[k][d] = 6.283185307179586 * nd_uniform(&r);
        }
    double s = 0;
    for (uint32_t d = 0; d < D; d++) {
        m->sink_dir[d] = (float)nd_normal(&r);
        s += (double)m->sink_dir[d] * m->sink_dir[d];
    }
    for (uint32_t d = 0; d < D; d++)
        m->sink_dir[d] = (float)(m->sink_dir[d] / sqrt(s));
}

/* The AR(1) walk of --branch drift, per channel: w_0 ~ N(0, WALK_SD²) (stationary), then
 * w_t = φ·w_{t−1} + WALK_SD·√(1 − φ²)·N(0, 1). One stream drawn from row 0 up, so the first rows
 * of a longer haystack are those of a shorter one with the same seed. */
static void walk_init(model *m, uint64_t seed, uint64_t n_rows) {
    nd_rng r = nd_rng_for(seed, ND_STREAM_WALK, 0);
    const double innov = WALK_SD * sqrt(1.0 - WALK_PHI * WALK_PHI);
    const uint32_t D = m->D;
    for (uint32_t d = 0; d < D; d++)
        m->walk[d] = (float)(WALK_SD * nd_normal(&r));
    for (uint64_t t = 1; t < n_rows; t++)
        for (uint32_t d = 0; d < D; d++)
            m->walk[t * D + d] =
                (float)(WALK_PHI * m->walk[(t - 1) * D + d] + innov * nd_normal(&r));
}

/* Slow branch drift at row t, sink direction projected out. */
static void drift_at(const model *m, uint64_t t, float *out) {
    double proj = 0;
    for (uint32_t d = 0; d < m->D; d++) {
        double v = 0;
        for (int k = 0; k < N_DRIFT; k++)
            v += m->d_amp[k][d] *
                 cos(6.283185307179586 * (double)t / m->d_period[k][d] + m->d_phase[k][d]);
        if (m->walk)
            v += m->walk[t * m->D + d];
        out[d] = (float)v;
        proj += v * m->sink_dir[d];
    }
    for (uint32_t d = 0; d < m->D; d++)
        out[d] = (float)(out[d] - proj * m->sink_dir[d]);
}

static void project_out_sink(const model *m, float *br) {
    double proj = 0;
    for (uint32_t d = 0; d < m->D; d++)
        proj += (double)br[d] * m->sink_dir[d];
    for (uint32_t d = 0; d < m->D; d++)
        br[d] = (float)(br[d] - proj * m->sink_dir[d]);
}

/* Background (or key-value pair) row t into lat[L], br[D]. */
static void background_row(const model *m, uint64_t seed, uint64_t t, bool pair, float *lat,
                           float *br) {
    nd_rng r = nd_rng_for(seed, ND_STREAM_ROW, t);
    const uint32_t L = m->L, D = m->D;
    if (pair) {
        /* a key-value pair: a fresh direction, unrelated to the topic */
        for (uint32_t i = 0; i < L; i++)
            lat[i] = (float)nd_normal(&r);
    } else {
        double c[N_TOPICS];
        for (int k = 0; k < N_TOPICS; k++)
            c[k] = cos(6.283185307179586 * (double)t / m->t_period[k] + m->t_phase[k]);
        double tn = 0;
        for (uint32_t i = 0; i < L; i++) {
            double v = 0;
            for (int k = 0; k < N_TOPICS; k++)
                v += c[k] * m->topic[(size_t)k * L + i];
            lat[i] = (float)v;
            tn += v * v;
        }
        double f = tn > 0 ? LAT_TOPIC * sqrt((double)L / tn) : 0.0;
        for (uint32_t i = 0; i < L; i++)
            lat[i] = (float)(lat[i] * f + LAT_NOISE * nd_normal(&r));
    }
    rms_normalise(lat, L, 1.0);
    double noise = BR_NOISE * exp(BR_NOISE_LOG_SD * nd_normal(&r)) * (pair ? 2.5 : 1.0);
    drift_at(m, t, br);
    for (uint32_t d = 0; d < D; d++)
        br[d] = (float)(br[d] + noise * nd_normal(&r));
    project_out_sink(m, br);
}

static void put_row(uint8_t *row, const kvt_layer_spec *sp, const float *lat, const float *br) {
    nd_narrow(row, sp->dtype, sp->value_dim, lat);
    nd_narrow(row + sp->branch_offset, sp->branch_dtype, sp->branch_dim, br);
}

/* Rotate a branch by position t: pairs (i, i + D/2), θ_i = 10000^(−2i/D) (NeoX layout). */
static void rope_rotate(float *br, uint32_t D, uint64_t t) {
    for (uint32_t i = 0; i < D / 2; i++) {
        double th = pow(10000.0, -2.0 * (double)i / (double)D);
        double a = fmod((double)t * th, 6.283185307179586);
        double c = cos(a), s = sin(a);
        double x = br[i], y = br[i + D / 2];
        br[i] = (float)(x * c - y * s);
        br[i + D / 2] = (float)(x * s + y * c);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* σ calibration of needle rows (section 4 of the model)                                       */
/* ------------------------------------------------------------------------------------------- */
typedef struct calib_row {
    uint64_t pos;
    double lo, hi, target; /* band [lo, hi] in percent, target percentile inside it */
    float h[64];           /* high-frequency direction of this row */
    float drift[64];
    double beta;
    uint32_t needle;       /* index of the needle the row belongs to */
    bool miss;             /* set by calibrate_block: ended outside its band */
} calib_row;

typedef struct calib_ctx {
    uint32_t B, n_basis;
    kvt_ref_sigma *ref;    /* the library's σ (basis and scratch inside) */
    const float *basis;    /* [n_basis][B], the handle's */
    float *sig;            /* [B] */
    double *Y;             /* [n_basis][D] */
    float *sorted;         /* [B] */
} calib_ctx;

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double pct_of(const float *sig, uint32_t B, uint32_t u) {
    uint32_t below = 0;
    for (uint32_t v = 0; v < B; v++)
        if (v != u && sig[v] < sig[u])
            below++;
    return 100.0 * below / (double)(B - 1);
}

static void block_sigma(calib_ctx *cc, const nd_case *c, uint64_t b0) {
    const kvt_layer_spec *sp = &c->spec;
    /* The layout was checked when the case was set up (branch inside the row, float dtype), so
     * this cannot fail. */
    (void)kvt_ref_sigma_block(cc->ref, c->rows + b0 * sp->row_bytes, sp->row_bytes,
                              sp->branch_offset, sp->branch_dtype, cc->sig);
}

/* σ of row u (block-relative) if its branch became b, given Y of the current block (double)
 * and its current branch b0: Y' = Y + C[:,u] (b − b0)ᵀ, e = b − Σ_j C[j][u] Y'_j. */
static double sigma_if(const calib_ctx *cc, uint32_t D, uint32_t u, const float *b,
                       const float *b0) {
    double s = 0;
    for (uint32_t d = 0; d < D; d++) {
        double delta = (double)b[d] - b0[d];
        double rec = 0;
        for (uint32_t j = 0; j < cc->n_basis; j++) {
            double cj = cc->basis[(size_t)j * cc->B + u];
            rec += cj * (cc->Y[(size_t)j * D + d] + cj * delta);
        }
        double e = b[d] - rec;
        s += e * e;
    }
    return sqrt(s);
}

/* Calibrate every row of rows[0..n) (all in the block starting at b0). Returns the number of
 * rows that ended outside their band and flags each of them (calib_row.miss). */
static int calibrate_block(calib_ctx *cc, nd_case *c, uint64_t b0, calib_row *rows, uint32_t n) {
    const kvt_layer_spec *sp = &c->spec;
    const uint32_t B = cc->B, D = sp->branch_dim;
    float br[64], cur[64], tmp[64];
    int bad = 0;
    for (int pass = 0; pass < 10; pass++) {
        block_sigma(cc, c, b0);
        bad = 0;
        for (uint32_t i = 0; i < n; i++) {
            double p = pct_of(cc->sig, B, (uint32_t)(rows[i].pos - b0));
            rows[i].miss = false;
            if (p < rows[i].lo || p > rows[i].hi)
                bad++;
        }
        if (bad == 0)
            return 0;
        /* Y of the block in double, from the stored values. */
        memset(cc->Y, 0, sizeof(double) * cc->n_basis * D);
        for (uint32_t u = 0; u < B; u++) {
            nd_widen(c->rows + (b0 + u) * sp->row_bytes + sp->branch_offset, sp->branch_dtype, D,
                     tmp);
            for (uint32_t j = 0; j < cc->n_basis; j++) {
                double cj = cc->basis[(size_t)j * B + u];
                double *y = cc->Y + (size_t)j * D;
                for (uint32_t d = 0; d < D; d++)
                    y[d] += cj * tmp[d];
            }
        }
        memcpy(cc->sorted, cc->sig, sizeof(float) * B);
        qsort(cc->sorted, B, sizeof(float), cmp_float);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)(rows[i].pos - b0);
            double p = pct_of(cc->sig, B, u);
            if (p >= rows[i].lo && p <= rows[i].hi)
                continue;
            /* Target σ: between the sorted values around the target rank (u's own value is in
             * the sorted list; at this accuracy it does not matter, the next pass checks). */
            double k = rows[i].target / 100.0 * (double)(B - 1);
            uint32_t k0 = (uint32_t)floor(k);
            if (k0 >= B - 1)
                k0 = B - 2;
            double goal = 0.5 * ((double)cc->sorted[k0] + (double)cc->sorted[k0 + 1]);
            uint8_t *row = c->rows + rows[i].pos * sp->row_bytes;
            nd_widen(row + sp->branch_offset, sp->branch_dtype, D, cur);
            double lo = 0, hi = rows[i].beta > 0 ? 2 * rows[i].beta : 1.0;
            for (int it = 0; it < 60; it++) {
                for (uint32_t d = 0; d < D; d++)
                    br[d] = (float)(rows[i].drift[d] + hi * rows[i].h[d]);
                if (sigma_if(cc, D, u, br, cur) >= goal)
                    break;
                lo = hi;
                hi *= 2;
            }
            for (int it = 0; it < 50; it++) {
                double mid = 0.5 * (lo + hi);
                for (uint32_t d = 0; d < D; d++)
                    br[d] = (float)(rows[i].drift[d] + mid * rows[i].h[d]);
                if (sigma_if(cc, D, u, br, cur) < goal)
                    lo = mid;
                else
                    hi = mid;
            }
            rows[i].beta = 0.5 * (lo + hi);
            for (uint32_t d = 0; d < D; d++)
                br[d] = (float)(rows[i].drift[d] + rows[i].beta * rows[i].h[d]);
            nd_narrow(row + sp->branch_offset, sp->branch_dtype, D, br);
            /* Keep Y current for the next row of this block. */
            nd_widen(row + sp->branch_offset, sp->branch_dtype, D, br);
            for (uint32_t j = 0; j < cc->n_basis; j++) {
                double cj = cc->basis[(size_t)j * B + u];
                for (uint32_t d = 0; d < D; d++)
                    cc->Y[(size_t)j * D + d] += cj * ((double)br[d] - cur[d]);
            }
        }
    }
    block_sigma(cc, c, b0);
    bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        double p = pct_of(cc->sig, B, (uint32_t)(rows[i].pos - b0));
        rows[i].miss = p < rows[i].lo || p > rows[i].hi;
        bad += rows[i].miss;
    }
    return bad;
}

static void band_of(nd_salience s, double *lo, double *hi, double *tlo, double *thi) {
    switch (s) {
    /* Targets are drawn uniformly over (nearly) the whole band, so that a ratio whose cut-off
     * falls inside a band shows a partial pass rate instead of an artefact of the draw. */
    case ND_SAL_STRONG:
        *lo = 99.0, *hi = 100.0, *tlo = 99.02, *thi = 99.98;
        return;
    case ND_SAL_WEAK:
        *lo = 90.0, *hi = 97.0, *tlo = 90.1, *thi = 96.9;
        return;
    case ND_SAL_NONE:
        *lo = 0.0, *hi = 49.99, *tlo = 1.0, *thi = 49.0;
        return;
    default:
        *lo = 0.0, *hi = 100.0, *tlo = 0.0, *thi = 100.0;
        return;
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Queries (section 6)                                                                          */
/* ------------------------------------------------------------------------------------------- */

/* Needle mass under the full cache for latent scale a: x[j] a + y[j] are the scores. */
static double mass_at(const double *x, const double *y, uint64_t n, uint64_t f, uint64_t r,
                      double a) {
    double mx = -DBL_MAX;
    for (uint64_t j = 0; j < n; j++) {
        double s = a * x[j] + y[j];
        if (s > mx)
            mx = s;
    }
    double z = 0, mm = 0;
    for (uint64_t j = 0; j < n; j++) {
        double w = exp(a * x[j] + y[j] - mx);
        z += w;
        if (j >= f && j < f + r)
            mm += w;
    }
    return mm / z;
}

static int make_queries(const nd_gen_params *p, const model *m, nd_case *c, const float *vdirs,
                        void (*progress)(void *, double), void *ud, char *err, size_t err_len) {
    const kvt_layer_spec *sp = &c->spec;
    const uint32_t L = sp->value_dim, D = sp->branch_dim, K = sp->head_dim;
    const uint64_t TM = c->n_rows; /* every target's position is at most this */
    double *x = malloc(sizeof(double) * TM);
    double *y = malloc(sizeof(double) * TM);
    float *rowf = malloc(sizeof(float) * K);
    if (!x || !y || !rowf) {
        free(x), free(y), free(rowf);
        return nd_fail(err, err_len, ND_ENOMEM, "query calibration scratch");
    }
    int rc = ND_OK;
    for (uint32_t ti = 0; ti < c->n_targets && rc == ND_OK; ti++) {
        nd_target *tg = &c->targets[ti];
        const nd_needle *nd = &c->needles[tg->needle];
        const uint64_t T = tg->position; /* the query attends rows [0, T) */
        nd_rng r = nd_rng_for(p->seed, ND_STREAM_QUERY, (p->context << 20) ^ ti);
        tg->q = calloc((size_t)p->n_q_heads * K, sizeof(float));
        if (!tg->q) {
            rc = nd_fail(err, err_len, ND_ENOMEM, "query");
            break;
        }
        /* Targeted heads: a random subset. */
        uint32_t perm[ND_MAX_HEADS];
        for (uint32_t h = 0; h < p->n_q_heads; h++)
            perm[h] = h;
        for (uint32_t h = 0; h < p->n_target_heads; h++) {
            uint32_t k = h + (uint32_t)nd_below(&r, p->n_q_heads - h);
            uint32_t t_ = perm[h];
            perm[h] = perm[k];
            perm[k] = t_;
        }
        tg->n_heads = p->n_target_heads;
        for (uint32_t h = 0; h < tg->n_heads; h++)
            tg->heads[h] = perm[h];
        /* sort targeted heads ascending */
        for (uint32_t a = 1; a < tg->n_heads; a++)
            for (uint32_t b = a; b > 0 && tg->heads[b - 1] > tg->heads[b]; b--) {
                uint32_t t_ = tg->heads[b];
                tg->heads[b] = tg->heads[b - 1];
                tg->heads[b - 1] = t_;
            }
        /* Branch part, shared by all heads: sinks take ~ ln T − 1 of logit each. */
        double cq = (log((double)T) - 1.0) / (p->scale * SINK_AMP);
        float qbr[64];
        for (uint32_t d = 0; d < D; d++)
            qbr[d] = (float)(cq * m->sink_dir[d] + 0.1 * nd_normal(&r));
        if (p->rope)
            rope_rotate(qbr, D, T);
        const float *v = vdirs + (size_t)tg->needle * L;
        /* x_j = s · v·lat_j: the needle direction's share of every score. */
        for (uint64_t j = 0; j < T; j++) {
            nd_widen(c->rows + j * sp->row_bytes, sp->dtype, L, rowf);
            x[j] = p->scale * nd_dot(v, rowf, L);
        }
        for (uint32_t h = 0; h < p->n_q_heads; h++) {
            float *q = tg->q + (size_t)h * K;
            bool targeted = false;
            for (uint32_t k = 0; k < tg->n_heads; k++)
                targeted |= tg->heads[k] == h;
            for (uint32_t d = 0; d < D; d++)
                q[L + d] = qbr[d];
            if (!targeted) {
                other_latent(c, L, &r, q);
                continue;
            }
            for (uint32_t i = 0; i < L; i++)
                q[i] = (float)(Q_NOISE * nd_normal(&r));
            double mu = p->mass_lo + (p->mass_hi - p->mass_lo) * nd_uniform(&r);
            /* y_j = s · (noise·lat_j + q_branch·br_j): the rest of the score. */
            for (uint64_t j = 0; j < T; j++) {
                const uint8_t *row = c->rows + j * sp->row_bytes;
                nd_widen(row, sp->dtype, L, rowf);
                nd_widen(row + sp->branch_offset, sp->branch_dtype, D, rowf + L);
                y[j] = p->scale * nd_dot(q, rowf, K);
            }
            /* mass(a) increases with a (the needle rows' x is ~ s·sqrt(L), everyone else's ~ s);
             * bisection on a in [0, hi]. */
            double lo = 0, hi = 1;
            while (hi < 1e4 && mass_at(x, y, T, nd->first_row, nd->n_rows, hi) < mu)
                hi *= 2;
            for (int it = 0; it < 40; it++) {
                double mid = 0.5 * (lo + hi);
                if (mass_at(x, y, T, nd->first_row, nd->n_rows, mid) < mu)
                    lo = mid;
                else
                    hi = mid;
            }
            double a = 0.5 * (lo + hi);
            for (uint32_t i = 0; i < L; i++)
                q[i] = (float)(q[i] + a * v[i]);
        }
        if (progress)
            progress(ud, 0.5 + 0.5 * (double)(ti + 1) / c->n_targets);
    }
    free(x), free(y), free(rowf);
    return rc;
}

/* ------------------------------------------------------------------------------------------- */
/* Driver                                                                                       */
/* ------------------------------------------------------------------------------------------- */
static int cmp_needle_pos(const void *a, const void *b) {
    const nd_needle *x = a, *y = b;
    if (x->first_row != y->first_row)
        return x->first_row < y->first_row ? -1 : 1;
    return 0;
}

static char *append(char *text, size_t *len, size_t *cap, const char *fmt, ...) ND_PRINTF(4, 5);
static char *append(char *text, size_t *len, size_t *cap, const char *fmt, ...) {
    if (!text)
        return NULL;
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0)
        return text;
    if (*len + (size_t)n + 1 > *cap) {
        size_t nc = (*cap + (size_t)n + 1) * 2;
        char *t = realloc(text, nc);
        if (!t) {
            free(text);
            return NULL;
        }
        text = t;
        *cap = nc;
    }
    memcpy(text + *len, buf, (size_t)n + 1);
    *len += (size_t)n;
    return text;
}

int nd_generate(const nd_gen_params *p, nd_case *out, void (*progress)(void *, double), void *ud,
                char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    if (!p)
        return nd_fail(err, err_len, ND_EARG, "no parameters");
    if (p->context < 64 || p->context > (UINT64_C(1) << 26))
        return nd_fail(err, err_len, ND_EARG, "context %llu outside [64, 2^26]",
                       (unsigned long long)p->context);
    if (p->n_q_heads < 1 || p->n_q_heads > ND_MAX_HEADS || p->n_target_heads < 1 ||
        p->n_target_heads > p->n_q_heads)
        return nd_fail(err, err_len, ND_EARG, "heads: %u query heads, %u targeted (1 <= targeted "
                       "<= heads <= %u)", p->n_q_heads, p->n_target_heads, ND_MAX_HEADS);
    if (p->needle_rows < 1 || p->needle_rows > ND_MAX_NEEDLE_ROWS)
        return nd_fail(err, err_len, ND_EARG, "needle rows %u outside [1, %u]", p->needle_rows,
                       ND_MAX_NEEDLE_ROWS);
    if (p->block_rows < 64 || (p->block_rows & (p->block_rows - 1)) || p->kappa < 1 ||
        p->kappa > p->block_rows / 2)
        return nd_fail(err, err_len, ND_EARG, "block rows %u / kappa %u invalid", p->block_rows,
                       p->kappa);
    if ((unsigned)p->calib_basis > KVT_SIGMA_DCT)
        return nd_fail(err, err_len, ND_EARG, "calibration basis %d unknown", (int)p->calib_basis);
    if ((unsigned)p->branch > ND_BRANCH_DRIFT)
        return nd_fail(err, err_len, ND_EARG, "branch model %d unknown", (int)p->branch);
    if (!(p->kv_haystack >= 0 && p->kv_haystack <= 0.5))
        return nd_fail(err, err_len, ND_EARG, "kv haystack fraction %g outside [0, 0.5]",
                       p->kv_haystack);
    if (!(p->mass_lo > 0 && p->mass_lo <= p->mass_hi && p->mass_hi < 1))
        return nd_fail(err, err_len, ND_EARG, "needle mass range [%g, %g] invalid", p->mass_lo,
                       p->mass_hi);
    if (p->dtype != KVT_DTYPE_BF16 && p->dtype != KVT_DTYPE_FP16 && p->dtype != KVT_DTYPE_FP32)
        return nd_fail(err, err_len, ND_EARG, "row dtype must be bf16, fp16 or fp32");
    if (p->prompt_rows >= p->context || p->sink_rows >= p->context)
        return nd_fail(err, err_len, ND_EARG, "prompt/sink rows leave no room for needles");
    uint32_t n_needles = p->n_depths * p->n_levels * p->needles_per_depth;
    if (n_needles == 0)
        return nd_fail(err, err_len, ND_EARG, "no needles (depths x levels x needles per depth)");
    for (uint32_t i = 0; i < p->n_depths; i++)
        if (!(p->depths[i] >= 0 && p->depths[i] <= 1))
            return nd_fail(err, err_len, ND_EARG, "depth %g outside [0, 1]", p->depths[i]);
    const bool decode = p->decode_calib > 0;
    if (p->decode_calib > 65536 || p->decode_gap > 4096)
        return nd_fail(err, err_len, ND_EARG, "decode phase: %u calibration steps, gap %u (at "
                       "most 65536 and 4096)", p->decode_calib, p->decode_gap);
    if (decode && (p->query_rank < 1 || p->query_rank > KVT_RECALL_MAX_RANK))
        return nd_fail(err, err_len, ND_EARG, "query rank %u outside [1, %u]", p->query_rank,
                       KVT_RECALL_MAX_RANK);
    if (!(p->decoys >= 0 && p->decoys <= 0.5) || (p->decoys > 0 && !decode))
        return nd_fail(err, err_len, ND_EARG, "decoy fraction %g: in [0, 0.5], and only with a "
                       "decode phase", p->decoys);

    nd_case *c = out;
    c->seed = p->seed;
    kvt_layer_kind kind = p->rope ? KVT_LAYER_MLA_ROPE : KVT_LAYER_MLA_NOPE;
    if (kvt_layer_spec_mla(kind, p->dtype, 512, 64, &c->spec) != KVT_OK)
        return nd_fail(err, err_len, ND_ELIB, "kvt_layer_spec_mla failed");
    c->spec.n_q_heads = p->n_q_heads;
    const kvt_layer_spec *sp = &c->spec;
    const uint32_t L = sp->value_dim, D = sp->branch_dim;
    const uint64_t HR = p->context; /* haystack rows; the decode phase's rows follow */
    const uint32_t n_decode =
        decode ? p->decode_calib + n_needles * (p->decode_gap + 1) : 0;
    c->n_rows = HR + n_decode;
    c->prompt_rows = p->prompt_rows;
    c->n_q_heads = p->n_q_heads;
    c->q_dim = sp->head_dim;
    c->rows = malloc((size_t)c->n_rows * sp->row_bytes);
    c->needles = calloc(n_needles, sizeof *c->needles);
    c->targets = calloc(n_needles, sizeof *c->targets);
    model m;
    memset(&m, 0, sizeof m);
    m.topic = malloc(sizeof(float) * N_TOPICS * L);
    if (p->branch == ND_BRANCH_DRIFT)
        m.walk = malloc(sizeof(float) * c->n_rows * D);
    float *vdirs = malloc(sizeof(float) * (size_t)n_needles * L);
    float *tmpl = NULL; /* decoys' template direction */
    if (decode) {
        c->qbasis_rank = p->query_rank;
        c->qbasis = malloc(sizeof(float) * (size_t)p->query_rank * L);
        c->decode_q = malloc(sizeof(float) * (size_t)n_decode * p->n_q_heads * sp->head_dim);
        c->decode_target = malloc(sizeof(int32_t) * n_decode);
        tmpl = malloc(sizeof(float) * L);
        if (!c->qbasis || !c->decode_q || !c->decode_target || !tmpl) {
            free(tmpl);
            free(vdirs);
            free(m.topic);
            nd_case_free(c);
            return nd_fail(err, err_len, ND_ENOMEM, "decode phase buffers");
        }
        c->decode_start = HR;
        c->n_decode = n_decode;
        subspace_init(c->qbasis, p->query_rank, L, p->seed);
        nd_rng g = nd_rng_for(p->seed, ND_STREAM_DECOY, UINT64_MAX);
        subspace_draw(c->qbasis, c->qbasis_rank, L, &g, tmpl);
    }
    calib_row *crow = calloc((size_t)n_needles * p->needle_rows, sizeof *crow);
    calib_ctx cc;
    memset(&cc, 0, sizeof cc);
    cc.B = p->block_rows;
    cc.n_basis = 2 * p->kappa - 1;
    kvt_status ref_st = kvt_ref_sigma_create_basis(cc.B, p->kappa, D, p->calib_basis, &cc.ref);
    cc.basis = kvt_ref_sigma_basis(cc.ref, NULL);
    cc.sig = malloc(sizeof(float) * cc.B);
    cc.sorted = malloc(sizeof(float) * cc.B);
    cc.Y = malloc(sizeof(double) * cc.n_basis * D);
    int rc = ND_OK;
    if (ref_st == KVT_ERR_INVALID_ARGUMENT) {
        rc = nd_fail(err, err_len, ND_EARG, "block rows %u / kappa %u invalid", cc.B, p->kappa);
        goto done;
    }
    if (!c->rows || !c->needles || !c->targets || !m.topic || !vdirs || !crow || !cc.ref ||
        (p->branch == ND_BRANCH_DRIFT && !m.walk) ||
        !cc.sig || !cc.sorted || !cc.Y) {
        rc = nd_fail(err, err_len, ND_ENOMEM, "generator buffers (%llu rows)",
                     (unsigned long long)c->n_rows);
        goto done;
    }
    model_init(&m, p->seed, L, D);
    if (m.walk)
        walk_init(&m, p->seed, c->n_rows);

    /* 1-3: background, sinks, key-value pairs. */
    {
        float lat[512], br[64];
        for (uint64_t t = 0; t < c->n_rows; t++) {
            uint8_t *row = c->rows + t * sp->row_bytes;
            if (t < p->sink_rows) {
                nd_rng r = nd_rng_for(p->seed, ND_STREAM_ROW, t);
                for (uint32_t i = 0; i < L; i++)
                    lat[i] = (float)(0.25 * nd_normal(&r));
                for (uint32_t d = 0; d < D; d++)
                    br[d] = (float)(SINK_AMP * m.sink_dir[d] + 0.1 * nd_normal(&r));
            } else {
                bool pair = false;
                if (p->kv_haystack > 0) {
                    nd_rng r = nd_rng_for(p->seed, ND_STREAM_PAIR, t);
                    pair = nd_uniform(&r) < p->kv_haystack;
                }
                background_row(&m, p->seed, t, pair, lat, br);
                if (p->decoys > 0 && t < HR) {
                    /* a decoy: the template plus its own direction, like a needle's latent */
                    nd_rng r = nd_rng_for(p->seed, ND_STREAM_DECOY, t + 1);
                    if (nd_uniform(&r) < p->decoys) {
                        float u[512], d[512];
                        subspace_draw(c->qbasis, c->qbasis_rank, L, &r, u);
                        decoy_dir(tmpl, u, L, d);
                        for (uint32_t k = 0; k < L; k++)
                            lat[k] = (float)(d[k] * sqrt((double)L) + 0.3 * nd_normal(&r));
                        rms_normalise(lat, L, 1.0);
                    }
                }
            }
            put_row(row, sp, lat, br);
            if (progress && (t & 0xFFFF) == 0)
                progress(ud, 0.3 * (double)t / c->n_rows);
        }
    }

    /* 4: needles. Depth groups: at each depth, n_levels x per_depth needles laid side by side,
     * gap rows apart; groups in ascending depth, pushed right if they would overlap. */
    {
        const uint64_t R = p->needle_rows, gap = 53;
        const uint64_t lo_pos = p->prompt_rows > p->sink_rows ? p->prompt_rows : p->sink_rows;
        uint32_t per_group = p->n_levels * p->needles_per_depth;
        uint64_t group_span = per_group * (R + gap);
        if (lo_pos + (uint64_t)p->n_depths * group_span > HR) {
            rc = nd_fail(err, err_len, ND_EARG, "context %llu too short for %u needles of %llu "
                         "rows", (unsigned long long)HR, n_needles, (unsigned long long)R);
            goto done;
        }
        /* depths in ascending order (stable) */
        uint32_t order[256];
        if (p->n_depths > 256) {
            rc = nd_fail(err, err_len, ND_EARG, "at most 256 depths");
            goto done;
        }
        for (uint32_t i = 0; i < p->n_depths; i++)
            order[i] = i;
        for (uint32_t a = 1; a < p->n_depths; a++)
            for (uint32_t b = a; b > 0 && p->depths[order[b - 1]] > p->depths[order[b]]; b--) {
                uint32_t t_ = order[b];
                order[b] = order[b - 1];
                order[b - 1] = t_;
            }
        uint64_t next_free = lo_pos;
        uint32_t k = 0;
        for (uint32_t gi = 0; gi < p->n_depths; gi++) {
            double dep = p->depths[order[gi]];
            uint64_t start = (uint64_t)llround(dep * (double)HR);
            /* leave room for this group and the deeper ones */
            uint64_t room_end = HR - (uint64_t)(p->n_depths - gi) * group_span;
            if (start > room_end)
                start = room_end;
            if (start < next_free)
                start = next_free;
            for (uint32_t j = 0; j < per_group; j++) {
                nd_needle *nd = &c->needles[k++];
                nd->first_row = start + j * (R + gap);
                nd->n_rows = R;
                nd->depth = dep;
                nd->salience = p->levels[j % p->n_levels];
            }
            next_free = start + group_span;
        }
        qsort(c->needles, n_needles, sizeof *c->needles, cmp_needle_pos);
        c->n_needles = n_needles;
    }
    {
        uint32_t nc = 0;
        for (uint32_t i = 0; i < c->n_needles; i++) {
            nd_needle *nd = &c->needles[i];
            /* keyed by (context, needle): haystacks of different lengths draw their needles
             * independently (the background rows they share are the same) */
            nd_rng r = nd_rng_for(p->seed, ND_STREAM_NEEDLE, (p->context << 20) ^ i);
            float *v = vdirs + (size_t)i * L;
            if (decode) { /* in the query subspace (and on the decoys' template) */
                float u[512];
                subspace_draw(c->qbasis, c->qbasis_rank, L, &r, u);
                if (p->decoys > 0)
                    decoy_dir(tmpl, u, L, v);
                else
                    memcpy(v, u, sizeof(float) * L);
            } else {
                for (uint32_t k = 0; k < L; k++)
                    v[k] = (float)nd_normal(&r);
                rms_normalise(v, L, 1.0 / sqrt((double)L)); /* unit norm */
            }
            double lo, hi, tlo, thi;
            band_of(nd->salience, &lo, &hi, &tlo, &thi);
            for (uint64_t rr = 0; rr < nd->n_rows; rr++) {
                uint64_t t = nd->first_row + rr;
                float lat[512], br[64];
                for (uint32_t k = 0; k < L; k++)
                    lat[k] = (float)(v[k] * sqrt((double)L) + 0.3 * nd_normal(&r));
                rms_normalise(lat, L, 1.0);
                drift_at(&m, t, br);
                calib_row *cr = &crow[nc];
                memcpy(cr->drift, br, sizeof(float) * D);
                for (uint32_t d = 0; d < D; d++)
                    cr->h[d] = (float)nd_normal(&r);
                project_out_sink(&m, cr->h);
                /* start from a background-like noise level */
                double beta0 = BR_NOISE * exp(BR_NOISE_LOG_SD * nd_normal(&r));
                for (uint32_t d = 0; d < D; d++)
                    br[d] = (float)(cr->drift[d] + beta0 * cr->h[d]);
                put_row(c->rows + t * sp->row_bytes, sp, lat, br);
                cr->pos = t;
                cr->lo = lo;
                cr->hi = hi;
                cr->target = tlo + (thi - tlo) * nd_uniform(&r);
                cr->beta = beta0;
                cr->needle = i;
                cr->miss = false;
                if (nd->salience != ND_SAL_NATURAL &&
                    (t / cc.B + 1) * (uint64_t)cc.B <= HR) /* complete blocks only */
                    nc++;
            }
        }
        /* Calibrate block by block (rows are in ascending position). */
        uint32_t i = 0;
        while (i < nc) {
            uint64_t b0 = crow[i].pos / cc.B * cc.B;
            uint32_t j = i;
            while (j < nc && crow[j].pos / cc.B * cc.B == b0)
                j++;
            c->band_misses += (uint32_t)calibrate_block(&cc, c, b0, crow + i, j - i);
            for (uint32_t k2 = i; k2 < j; k2++)
                if (crow[k2].miss)
                    c->needles[crow[k2].needle].band_miss = true;
            i = j;
            if (progress)
                progress(ud, 0.3 + 0.2 * (double)i / nc);
        }
    }
    /* 5: RoPE: rotate every branch by its position. */
    if (p->rope) {
        float br[64];
        for (uint64_t t = 0; t < c->n_rows; t++) {
            uint8_t *b = c->rows + t * sp->row_bytes + sp->branch_offset;
            nd_widen(b, sp->branch_dtype, D, br);
            rope_rotate(br, D, t);
            nd_narrow(b, sp->branch_dtype, D, br);
        }
    }
    /* 6: one query per needle, all at position T = context (every needle block closed when
     * context is a multiple of B). Targets in needle order (ascending position). */
    c->n_targets = c->n_needles;
    for (uint32_t i = 0; i < c->n_targets; i++) {
        c->targets[i].step = i;
        c->targets[i].position = HR;
        c->targets[i].needle = i;
        if (decode) { /* 8: needle i's query at decode step calib + i (gap + 1) + gap */
            uint64_t k = p->decode_calib + (uint64_t)i * (p->decode_gap + 1) + p->decode_gap;
            c->targets[i].step = k;
            c->targets[i].position = HR + k + 1;
        }
    }
    rc = make_queries(p, &m, c, vdirs, progress, ud, err, err_len);
    if (rc != ND_OK)
        goto done;
    /* 8: the decode phase's queries: the needles' at their steps, filler queries elsewhere
     * (every head as a non-targeted head of a needle query; branch for position T). */
    for (uint32_t k = 0; k < c->n_decode; k++) {
        const size_t qn = (size_t)p->n_q_heads * sp->head_dim;
        float *dq = c->decode_q + (size_t)k * qn;
        c->decode_target[k] = -1;
        for (uint32_t i = 0; i < c->n_targets; i++)
            if (c->targets[i].step == k) {
                c->decode_target[k] = (int32_t)i;
                memcpy(dq, c->targets[i].q, sizeof(float) * qn);
            }
        if (c->decode_target[k] >= 0)
            continue;
        nd_rng r = nd_rng_for(p->seed, ND_STREAM_DECODE, (p->context << 20) ^ k);
        const uint64_t T = HR + k + 1;
        double cq = (log((double)T) - 1.0) / (p->scale * SINK_AMP);
        float qbr[64];
        for (uint32_t d = 0; d < D; d++)
            qbr[d] = (float)(cq * m.sink_dir[d] + 0.1 * nd_normal(&r));
        if (p->rope)
            rope_rotate(qbr, D, T);
        for (uint32_t h = 0; h < p->n_q_heads; h++) {
            float *q = dq + (size_t)h * sp->head_dim;
            other_latent(c, L, &r, q);
            memcpy(q + L, qbr, sizeof(float) * D);
        }
    }
    {
        size_t len = 0, cap = 1024;
        char *t = malloc(cap);
        if (t)
            t[0] = 0;
        t = append(t, &len, &cap,
                   "generator=kvtier-needle synthetic v1\nseed=%llu\ncontext=%llu\nrope=%d\n"
                   "prompt_rows=%llu\nblock_rows=%u\nkappa=%u\nsink_rows=%u\nn_q_heads=%u\n"
                   "n_target_heads=%u\nneedle_rows=%u\nkv_haystack=%g\nmass=%g..%g\nscale=%.17g\n",
                   (unsigned long long)p->seed, (unsigned long long)p->context, p->rope ? 1 : 0,
                   (unsigned long long)p->prompt_rows, p->block_rows, p->kappa, p->sink_rows,
                   p->n_q_heads, p->n_target_heads, p->needle_rows, p->kv_haystack, p->mass_lo,
                   p->mass_hi, p->scale);
        if (p->branch != ND_BRANCH_SMOOTH) /* the smooth branch's text is what it always was */
            t = append(t, &len, &cap, "branch=%s\n", nd_branch_name(p->branch));
        if (p->calib_basis != KVT_SIGMA_FOURIER) /* likewise */
            t = append(t, &len, &cap, "calib_basis=%s\n",
                       p->calib_basis == KVT_SIGMA_DCT ? "dct" : "?");
        if (decode)
            t = append(t, &len, &cap, "decode_calib=%u\ndecode_gap=%u\nquery_rank=%u\n"
                       "decoys=%g\n", p->decode_calib, p->decode_gap, p->query_rank, p->decoys);
        for (uint32_t i = 0; i < c->n_needles; i++) {
            t = append(t, &len, &cap, "needle.%u.salience=%s\n", i,
                       nd_salience_name(c->needles[i].salience));
            t = append(t, &len, &cap, "needle.%u.depth=%.6f\n", i, c->needles[i].depth);
            if (c->needles[i].band_miss)
                t = append(t, &len, &cap, "needle.%u.band_miss=1\n", i);
        }
        if (!t) {
            rc = nd_fail(err, err_len, ND_ENOMEM, "provenance text");
            goto done;
        }
        c->text = t;
    }
    if (progress)
        progress(ud, 1.0);
done:
    free(m.topic);
    free(m.walk);
    free(vdirs);
    free(tmpl);
    free(crow);
    kvt_ref_sigma_destroy(cc.ref);
    free(cc.sig), free(cc.sorted), free(cc.Y);
    if (rc != ND_OK)
        nd_case_free(c);
    return rc;
}
