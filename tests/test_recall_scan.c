/*
 * test_recall_scan.c — the recall scan (recall/kernels/recall_scan.h, the recall_scan op): the
 * sound mode never misses an archived row whose exact score reaches its head's threshold, over
 * randomized rows (near and far from span V, no basis, adversarial near-identical rows) and
 * queries; the op's fired set equals a per-element reference and is bit-equal on the CPU and
 * guarded backends; cap W and the overflow flag are exact; the guarded op refuses host pointers.
 * Seeds are fixed and printed on failure.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"
#include "support/testutil.h"

#define D 512u
#define BD 64u
#define QD (D + BD)
#define PR 16u /* page rows */
#define SMAX 0.072168784f /* 192^-1/2 */

/* rank orthonormal rows of n values (Gram-Schmidt in double, twice), stored fp32. */
static void orthonormal_rows(tu_rng *g, uint32_t rank, uint32_t n, float *out) {
    cr_assert(tu_orthonormal_rows(g, rank, n, out));
}

/* One scenario: a pool of N rows behind a permuted page table, their sketches, a kept set. */
typedef struct scen {
    uint32_t N, rank, csk_stride, sinks, m;
    uint32_t q8; /* 8-bit planes (scen_q8): the fp16 width, the plane after it; 0: none */
    uint32_t n_head; /* run_scan: rows [0, n_head) of csk / rho in arrays of their own */
    int dtype;
    size_t stride;
    uint8_t *pool;   /* [N slots][stride] */
    int32_t *pages;  /* [N / PR] */
    kvt__div32 pdiv;
    float *V;        /* [rank][D] or NULL */
    uint16_t *csk;   /* [N][csk_stride] */
    float *rho;      /* [N] */
    uint32_t *kept;  /* [m] ascending */
    uint8_t *is_kept;
} scen;

static void put(uint8_t *row, int dt, uint32_t i, float v) {
    kvt__store_elem(row, dt, i, v);
}

/* Row kinds: 0 near span V (noise nz), 1 far (random), 2 a near-identical copy of an earlier
 * row, 3 exactly in span V, 4 large magnitude. */
static void scen_make(scen *s, tu_rng *g, uint32_t N, uint32_t rank, int dtype) {
    memset(s, 0, sizeof *s);
    s->N = N;
    s->rank = rank;
    s->csk_stride = rank ? rank + (uint32_t)(tu_next(g) % 3) : 1;
    s->dtype = dtype;
    s->stride = (size_t)QD * (dtype == KVT__DT_FP32 ? 4 : 2);
    s->pool = calloc(N, s->stride);
    s->pages = malloc(sizeof(int32_t) * (N / PR));
    s->pdiv = kvt__div32_make(PR);
    s->V = rank ? malloc(sizeof(float) * rank * D) : NULL;
    s->csk = malloc(sizeof(uint16_t) * N * s->csk_stride);
    s->rho = malloc(sizeof(float) * N);
    s->is_kept = calloc(N, 1);
    cr_assert(s->pool && s->pages && s->csk && s->rho && s->is_kept);
    if (rank)
        orthonormal_rows(g, rank, D, s->V);
    for (uint32_t p = 0; p < N / PR; p++)
        s->pages[p] = (int32_t)p;
    for (uint32_t p = N / PR - 1; p > 0; p--) { /* a permuted table */
        uint32_t j = (uint32_t)(tu_next(g) % (p + 1));
        int32_t t = s->pages[p];
        s->pages[p] = s->pages[j];
        s->pages[j] = t;
    }
    float c[D];
    for (uint32_t row = 0; row < N; row++) {
        uint8_t *p = s->pool + (size_t)kvt__page_slot(s->pages, 0, &s->pdiv, row) * s->stride;
        uint32_t kind = (uint32_t)(tu_next(g) % 5);
        if (row == 0 && kind == 2)
            kind = 1;
        if (kind == 2) { /* a copy of an earlier row, perturbed by ~1e-6 */
            uint32_t src = (uint32_t)(tu_next(g) % row);
            const uint8_t *q =
                s->pool + (size_t)kvt__page_slot(s->pages, 0, &s->pdiv, src) * s->stride;
            for (uint32_t i = 0; i < QD; i++)
                put(p, dtype, i,
                    kvt__load_elem(q, dtype, i) * (1.0f + 1e-6f * (float)tu_normal(g)));
            continue;
        }
        double scale = kind == 4 ? 300.0 : 1.0;
        double nz = kind == 3 ? 0.0 : kind == 0 ? (tu_next(g) % 2 ? 1e-3 : 0.05) : 1.0;
        for (uint32_t d = 0; d < D; d++)
            c[d] = (float)(nz * tu_normal(g) * scale);
        if (rank && kind != 1 && kind != 4)
            for (uint32_t k = 0; k < rank; k++) {
                float a = (float)(3.0 * tu_normal(g));
                for (uint32_t d = 0; d < D; d++)
                    c[d] += a * s->V[(size_t)k * D + d];
            }
        for (uint32_t d = 0; d < D; d++)
            put(p, dtype, d, c[d]);
        for (uint32_t j = 0; j < BD; j++)
            put(p, dtype, D + j, (float)(tu_normal(g) * scale));
    }
    int32_t *slots = malloc(sizeof(int32_t) * N);
    float *scratch = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    cr_assert(slots && scratch);
    for (uint32_t row = 0; row < N; row++)
        slots[row] = kvt__page_slot(s->pages, 0, &s->pdiv, row);
    kvt__sketch_rows_cpu(s->pool, slots, N, s->stride, dtype, D, s->V, rank, s->csk_stride,
                         scratch, s->csk, s->rho);
    free(slots);
    free(scratch);
    /* sinks and a kept set of m rows (some inside the sinks, as a close may keep them) */
    s->sinks = (uint32_t)(tu_next(g) % 9);
    s->m = N / 8;
    s->kept = malloc(sizeof(uint32_t) * s->m);
    uint32_t got = 0;
    while (got < s->m) {
        uint32_t r = (uint32_t)(tu_next(g) % N);
        if (!s->is_kept[r]) {
            s->is_kept[r] = 1;
            got++;
        }
    }
    got = 0;
    for (uint32_t r = 0; r < N; r++)
        if (s->is_kept[r])
            s->kept[got++] = r;
}

static void scen_free(scen *s) {
    free(s->pool);
    free(s->pages);
    free(s->V);
    free(s->csk);
    free(s->rho);
    free(s->kept);
    free(s->is_kept);
}

static bool archived(const scen *s, uint32_t row) {
    return row >= s->sinks && !s->is_kept[row];
}

static const uint8_t *row_at(const scen *s, uint32_t row) {
    return s->pool + (size_t)kvt__page_slot(s->pages, 0, &s->pdiv, row) * s->stride;
}

static float exact(const scen *s, const float *q, uint32_t row, float sc) {
    uint32_t elt = s->dtype == KVT__DT_FP32 ? 4 : 2;
    return kvt__recall_exact(q, row_at(s, row), s->dtype, D, D * elt, s->dtype, BD, sc);
}

/* Queries: latent near span V (share in span random) or random; some heads tiny or large. */
static void make_queries(tu_rng *g, const scen *s, uint32_t H, float *q) {
    for (uint32_t h = 0; h < H; h++) {
        float *qh = q + (size_t)h * QD;
        /* a quarter of the heads exactly inside span V: q_res is rounding only, so the bound
         * rests on the ‖q_sk‖·ε term (the sketch's fp16 rounding) */
        double in = tu_next(g) % 4 == 0 ? 1.0 : tu_uniform(g);
        double mag = tu_next(g) % 7 == 0 ? 40.0 : 1.0;
        for (uint32_t i = 0; i < QD; i++)
            qh[i] = (float)(tu_normal(g) * mag * (i < D ? (1.0 - in) * 0.3 : 1.0));
        if (in == 1.0 && s->rank == 0)
            for (uint32_t d = 0; d < D; d++)
                qh[d] = (float)(tu_normal(g) * mag); /* no span: a plain latent */
        for (uint32_t k = 0; s->rank && k < s->rank; k++) {
            float a = (float)(tu_normal(g) * in * mag);
            for (uint32_t d = 0; d < D; d++)
                qh[d] += a * s->V[(size_t)k * D + d];
        }
    }
}

/* The op on a backend: every input copied into its buffers, the outputs read back. */
typedef struct scan_out {
    uint32_t *fired;
    uint32_t n_fired, overflow;
} scan_out;

static void *dev(const kvt__backend *be, const void *host, size_t bytes) {
    void *p = NULL;
    cr_assert_eq(be->ops->buf_alloc(be, bytes ? bytes : 4, &p), KVT_OK);
    if (bytes && host)
        cr_assert_eq(be->ops->write(be, p, host, bytes, NULL), KVT_OK);
    return p;
}

static kvt_status run_scan(const kvt__backend *be, const scen *s, const float *q,
                           const float *best, uint32_t H, float sc, float z, int mode,
                           uint32_t cap, scan_out *out) {
    uint32_t elt = s->dtype == KVT__DT_FP32 ? 4 : 2;
    size_t qb = sizeof(float) * QD * H;
    const size_t nh = s->n_head, ck = sizeof(uint16_t) * s->csk_stride;
    kvt__recall_scan_args a = {
        .base = dev(be, s->pool, s->stride * s->N),
        .pages = dev(be, s->pages, sizeof(int32_t) * (s->N / PR)),
        .pdiv = &s->pdiv,
        .slot_stride = s->stride,
        .dtype = s->dtype,
        .latent_dim = D,
        .branch_offset = D * elt,
        .branch_dtype = s->dtype,
        .branch_dim = BD,
        .csk = dev(be, s->csk + nh * s->csk_stride, ck * (s->N - nh)),
        .rho = dev(be, s->rho + nh, sizeof(float) * (s->N - nh)),
        .csk_head = nh ? dev(be, s->csk, ck * nh) : NULL,
        .rho_head = nh ? dev(be, s->rho, sizeof(float) * nh) : NULL,
        .n_head = nh,
        .csk_stride = s->csk_stride,
        .q8_off = s->q8,
        .basis = s->rank ? dev(be, s->V, sizeof(float) * s->rank * D) : NULL,
        .rank = s->rank,
        .n_closed = s->N,
        .sinks = s->sinks,
        .kept = dev(be, s->kept, sizeof(uint32_t) * s->m),
        .m = s->m,
        .q = dev(be, q, qb),
        .best = dev(be, best, sizeof(float) * H),
        .n_heads = H,
        .scale = sc,
        .z = z,
        .mode = mode,
        .cap = cap,
        .fired = dev(be, NULL, sizeof(uint32_t) * cap),
        .n_fired = dev(be, NULL, 4),
        .overflow = dev(be, NULL, 4)};
    kvt_status st = be->ops->recall_scan(be, &a, 1, NULL);
    out->fired = calloc(cap + 1, sizeof(uint32_t));
    cr_assert(out->fired);
    if (st == KVT_OK) {
        cr_assert_eq(be->ops->read(be, &out->n_fired, a.n_fired, 4, NULL), KVT_OK);
        cr_assert_eq(be->ops->read(be, &out->overflow, a.overflow, 4, NULL), KVT_OK);
        cr_assert(out->n_fired <= cap);
        if (out->n_fired)
            cr_assert_eq(be->ops->read(be, out->fired, a.fired, 4 * out->n_fired, NULL), KVT_OK);
    }
    be->ops->buf_free(be, (void *)a.base, s->stride * s->N);
    be->ops->buf_free(be, (void *)a.pages, sizeof(int32_t) * (s->N / PR));
    be->ops->buf_free(be, (void *)a.csk, ck * (s->N - nh));
    be->ops->buf_free(be, (void *)a.rho, sizeof(float) * (s->N - nh));
    if (nh) {
        be->ops->buf_free(be, (void *)a.csk_head, ck * nh);
        be->ops->buf_free(be, (void *)a.rho_head, sizeof(float) * nh);
    }
    if (a.basis)
        be->ops->buf_free(be, (void *)a.basis, sizeof(float) * s->rank * D);
    be->ops->buf_free(be, (void *)a.kept, sizeof(uint32_t) * s->m);
    be->ops->buf_free(be, (void *)a.q, qb);
    be->ops->buf_free(be, (void *)a.best, sizeof(float) * H);
    be->ops->buf_free(be, a.fired, cap ? sizeof(uint32_t) * cap : 4);
    be->ops->buf_free(be, a.n_fired, 4);
    be->ops->buf_free(be, a.overflow, 4);
    return st;
}

typedef struct rig {
    kvt__alloc a;
    kvt__backend cpu, guarded;
} rig;

static void rig_open(rig *r) {
    memset(r, 0, sizeof *r);
    cr_assert_eq(kvt__alloc_init(&r->a, KVT_ALLOC_LIBC), KVT_OK);
    r->cpu.alloc = &r->a;
    cr_assert_eq(kvt__backend_cpu_open(&r->cpu), KVT_OK);
    r->guarded.alloc = &r->a;
    char why[256] = "";
    cr_assert_eq(kvt__backend_guarded_open(&r->guarded, why, sizeof why), KVT_OK, "%s", why);
}

static void rig_close(rig *r) {
    kvt__backend_cpu_close(&r->cpu);
    kvt__backend_cpu_close(&r->guarded);
    kvt__alloc_fini(&r->a);
}

/* The reference: the per-element functions, row by row, head by head. fired[row] = 0/1. With
 * worst (sound mode), every archived (row, head) also checks |exact − idx| <= the sound margin
 * and *worst keeps the largest share of the margin the real error took. */
static uint32_t reference(const scen *s, const float *q, const float *best, uint32_t H, float sc,
                          float z, int mode, uint8_t *fired, double *worst) {
    uint32_t elt = s->dtype == KVT__DT_FP32 ? 4 : 2, n = 0;
    float *qsk = malloc(sizeof(float) * (s->rank + 1) * H);
    float tmp[D];
    kvt__recall_head *hd = malloc(sizeof *hd * H);
    cr_assert(qsk && hd);
    for (uint32_t h = 0; h < H; h++)
        kvt__recall_head_prep(q + (size_t)h * QD, D, s->V, s->rank, qsk + (size_t)h * s->rank,
                              tmp, &hd[h]);
    for (uint32_t row = 0; row < s->N; row++) {
        fired[row] = 0;
        if (!archived(s, row))
            continue;
        for (uint32_t h = 0; h < H; h++) {
            float P, nc;
            float idx = kvt__recall_idx(q + (size_t)h * QD, qsk + (size_t)h * s->rank,
                                        row_at(s, row), D, D * elt, s->dtype, BD,
                                        s->csk + (size_t)row * s->csk_stride, s->rank, sc, &P,
                                        &nc);
            float margin = kvt__recall_sound_margin(&hd[h], idx, P, nc, s->rho[row], sc, z, D,
                                                    BD, s->rank);
            if (worst && mode == KVT__RECALL_SOUND) {
                /* how much of the margin the real error takes (<= 1: sound) */
                double err = fabs((double)exact(s, q + (size_t)h * QD, row, sc) - idx);
                double u = err / margin;
                cr_assert(u <= 1.0, "row %u head %u: |score - idx| %g above the margin %g", row,
                          h, err, margin);
                *worst = u > *worst ? u : *worst;
            }
            int f = mode == KVT__RECALL_SOUND
                        ? kvt__recall_sound_fires(idx, margin, best[h])
                        : kvt__recall_conformal_fires(
                              idx, kvt__recall_cert(&hd[h], s->rho[row], sc, D), z, best[h]);
            fired[row] |= (uint8_t)f;
        }
        n += fired[row];
    }
    free(qsk);
    free(hd);
    return n;
}

/* The sound mode never misses: for thousands of steps of random heads, with the threshold the
 * head's best attended score (sinks and kept rows) and, harder, the exact score of the head's
 * best archived row itself (so that row sits exactly at the threshold), every archived row whose
 * exact score reaches the threshold fires. The op's fired set is the per-element reference's,
 * and the firing rate is reported. */
Test(recall_scan, sound_never_misses) {
    rig r;
    rig_open(&r);
    const uint32_t H = 8, N = 256, CONFIGS = 48, STEPS = 24;
    const float z = sqrtf((float)(D - 64u));
    uint64_t n_steps = 0, n_queries = 0, archived_rows = 0, fired_att = 0, fired_top = 0,
             must_fire = 0;
    double worst = 0;
    float *q = malloc(sizeof(float) * QD * H);
    float best[8], top[8];
    uint8_t *ref = malloc(N);
    float *ex = malloc(sizeof(float) * H * N); /* exact scores of the step [head][row] */
    cr_assert(q && ref && ex);
    for (uint32_t c = 0; c < CONFIGS; c++) {
        uint64_t seed = 0x5ca4000u + c;
        tu_rng g = {seed};
        static const uint32_t ranks[] = {0, 1, 8, 64, 64, 128};
        uint32_t rank = ranks[c % 6];
        int dtype = c % 2 ? KVT__DT_BF16 : KVT__DT_FP32;
        scen s;
        scen_make(&s, &g, N, rank, dtype);
        uint32_t n_arch = 0;
        for (uint32_t row = 0; row < N; row++)
            n_arch += archived(&s, row);
        for (uint32_t st = 0; st < STEPS; st++) {
            make_queries(&g, &s, H, q);
            for (uint32_t h = 0; h < H; h++) {
                best[h] = -INFINITY;
                top[h] = -INFINITY;
                for (uint32_t row = 0; row < N; row++) {
                    float e = ex[(size_t)h * N + row] = exact(&s, q + (size_t)h * QD, row, SMAX);
                    if (archived(&s, row))
                        top[h] = e > top[h] ? e : top[h];
                    else
                        best[h] = e > best[h] ? e : best[h];
                }
            }
            for (int pass = 0; pass < 2; pass++) {
                const float *thr = pass ? top : best;
                scan_out o;
                cr_assert_eq(run_scan(&r.cpu, &s, q, thr, H, SMAX, z, KVT__RECALL_SOUND, N, &o),
                             KVT_OK);
                cr_assert_eq(o.overflow, 0);
                /* The per-element oracle (strided, slow): every fourth step. */
                bool oracle = st % 4 == 0;
                uint32_t n_ref =
                    oracle ? reference(&s, q, thr, H, SMAX, z, KVT__RECALL_SOUND, ref, &worst) : 0;
                cr_assert(!oracle || o.n_fired == n_ref, "seed %llx step %u",
                          (unsigned long long)seed, st);
                uint8_t *got = calloc(N, 1);
                cr_assert(got);
                for (uint32_t i = 0; i < o.n_fired; i++) {
                    cr_assert(i == 0 || o.fired[i] > o.fired[i - 1]);
                    cr_assert(archived(&s, o.fired[i]));
                    got[o.fired[i]] = 1;
                    cr_assert(!oracle || ref[o.fired[i]]);
                }
                for (uint32_t row = 0; row < N; row++) {
                    if (!archived(&s, row))
                        continue;
                    for (uint32_t h = 0; h < H; h++)
                        if (ex[(size_t)h * N + row] >= thr[h]) {
                            must_fire++;
                            cr_assert(got[row],
                                      "seed %llx (rank %u) step %u head %u: row %u scores %g >= "
                                      "%g but did not fire",
                                      (unsigned long long)seed, rank, st, h, row,
                                      ex[(size_t)h * N + row], thr[h]);
                        }
                }
                if (pass)
                    fired_top += o.n_fired;
                else
                    fired_att += o.n_fired;
                free(got);
                free(o.fired);
            }
            archived_rows += n_arch;
            n_steps++;
            n_queries += H;
        }
        scen_free(&s);
    }
    cr_assert(must_fire >= n_steps * H); /* every head's best archived row, at least */
    cr_log_info("recall_scan sound: %llu steps, %llu queries, %llu (row, head) pairs at or "
                "above threshold, all fired; firing rate %.4f with the best attended score as "
                "threshold, %.4f with the best archived score; |score - idx| took at most %.3g of the "
                "sound margin",
                (unsigned long long)n_steps, (unsigned long long)n_queries,
                (unsigned long long)must_fire, (double)fired_att / (double)archived_rows,
                (double)fired_top / (double)archived_rows, worst);
    free(q);
    free(ref);
    free(ex);
    rig_close(&r);
}

/* CPU and guarded: the same fired rows, counts and flags, bit for bit, in both modes and for z
 * from negative to large (conformal), with caps that overflow; both equal the per-element
 * functions' set. */
Test(recall_scan, cpu_and_guarded_bit_equal) {
    rig r;
    rig_open(&r);
    const uint32_t H = 43, N = 128; /* a whole 32-column tile of the twin, then 11 more */
    float *q = malloc(sizeof(float) * QD * H);
    uint8_t ref[128];
    cr_assert(q);
    uint64_t compared = 0;
    for (uint32_t c = 0; c < 12; c++) {
        uint64_t seed = 0x9a4d0u + c;
        tu_rng g = {seed};
        scen s;
        scen_make(&s, &g, N, c % 3 == 0 ? 0 : 16 * (c % 3), c % 2 ? KVT__DT_FP32 : KVT__DT_BF16);
        for (uint32_t st = 0; st < 6; st++) {
            make_queries(&g, &s, H, q);
            float best[43];
            for (uint32_t h = 0; h < H; h++)
                best[h] = (float)(tu_normal(&g) * 2.0);
            static const float zs[] = {-1.0f, 0.0f, 0.5f, 2.0f, 8.0f};
            for (uint32_t v = 0; v < 6; v++) {
                int mode = v == 5 ? KVT__RECALL_SOUND : KVT__RECALL_CONFORMAL;
                float z = v == 5 ? sqrtf((float)(D - 64u)) : zs[v];
                uint32_t cap = (uint32_t)(tu_next(&g) % N);
                scan_out a, b;
                cr_assert_eq(run_scan(&r.cpu, &s, q, best, H, SMAX, z, mode, cap, &a), KVT_OK);
                cr_assert_eq(run_scan(&r.guarded, &s, q, best, H, SMAX, z, mode, cap, &b),
                             KVT_OK);
                cr_assert_eq(a.n_fired, b.n_fired, "seed %llx", (unsigned long long)seed);
                cr_assert_eq(a.overflow, b.overflow, "seed %llx", (unsigned long long)seed);
                cr_assert_eq(memcmp(a.fired, b.fired, 4 * a.n_fired), 0);
                /* and the per-element functions' set */
                uint32_t k = reference(&s, q, best, H, SMAX, z, mode, ref, NULL), j = 0;
                cr_assert_eq(a.overflow, k > cap ? 1u : 0u, "seed %llx", (unsigned long long)seed);
                for (uint32_t row = 0; row < N && j < a.n_fired; row++)
                    if (ref[row])
                        cr_assert_eq(a.fired[j++], row, "seed %llx", (unsigned long long)seed);
                cr_assert_eq(j, a.n_fired);
                cr_assert_eq(a.n_fired, k < cap ? k : cap);
                free(a.fired);
                free(b.fired);
                compared++;
            }
        }
        scen_free(&s);
    }
    cr_log_info("recall_scan: %llu scans bit-equal on the CPU and guarded backends",
                (unsigned long long)compared);
    free(q);
    rig_close(&r);
}

/* Cap W: the first min(W, k) fired rows of the uncapped scan, overflow exactly when k > W. */
Test(recall_scan, cap_and_overflow_exact) {
    rig r;
    rig_open(&r);
    const uint32_t H = 2, N = 128;
    tu_rng g = {0xca9u};
    scen s;
    scen_make(&s, &g, N, 8, KVT__DT_FP32);
    float q[2 * QD], best[2] = {0.0f, 0.5f};
    make_queries(&g, &s, H, q);
    scan_out full;
    cr_assert_eq(run_scan(&r.cpu, &s, q, best, H, SMAX, 1.0f, KVT__RECALL_CONFORMAL, N, &full),
                 KVT_OK);
    uint32_t k = full.n_fired;
    cr_assert_eq(full.overflow, 0);
    cr_assert(k >= 3, "k = %u", k);
    const uint32_t caps[] = {0, 1, k - 1, k, k + 1, N};
    for (uint32_t i = 0; i < 6; i++)
        for (int b = 0; b < 2; b++) {
            scan_out o;
            cr_assert_eq(run_scan(b ? &r.guarded : &r.cpu, &s, q, best, H, SMAX, 1.0f,
                                  KVT__RECALL_CONFORMAL, caps[i], &o),
                         KVT_OK);
            cr_assert_eq(o.n_fired, caps[i] < k ? caps[i] : k);
            cr_assert_eq(o.overflow, caps[i] < k ? 1u : 0u, "cap %u k %u", caps[i], k);
            cr_assert_eq(memcmp(o.fired, full.fired, 4 * o.n_fired), 0);
            free(o.fired);
        }
    /* Every archived row fires with best = -Inf; none with best = +Inf (conformal, finite). */
    float lo[2] = {-INFINITY, -INFINITY}, hi[2] = {INFINITY, INFINITY};
    uint32_t n_arch = 0;
    for (uint32_t row = 0; row < N; row++)
        n_arch += archived(&s, row);
    scan_out o;
    cr_assert_eq(run_scan(&r.cpu, &s, q, lo, H, SMAX, 1.0f, KVT__RECALL_CONFORMAL, N, &o),
                 KVT_OK);
    cr_assert_eq(o.n_fired, n_arch);
    free(o.fired);
    cr_assert_eq(run_scan(&r.cpu, &s, q, hi, H, SMAX, 1.0f, KVT__RECALL_CONFORMAL, N, &o),
                 KVT_OK);
    cr_assert_eq(o.n_fired, 0);
    free(o.fired);
    free(full.fired);
    scen_free(&s);
    rig_close(&r);
}

/* Rows the sketch cannot describe (ρ = +Inf) fire in both modes, whatever the threshold short
 * of +Inf; a NaN query fires every row (sound). */
Test(recall_scan, undescribable_rows_and_nan_queries_fire) {
    rig r;
    rig_open(&r);
    tu_rng g = {0x1f1u};
    scen s;
    scen_make(&s, &g, 64, 8, KVT__DT_FP32);
    uint32_t row = 0;
    while (!archived(&s, row))
        row++;
    s.rho[row] = INFINITY;
    memset(s.csk + (size_t)row * s.csk_stride, 0, 2 * s.csk_stride);
    float q[QD], best = 1e30f;
    make_queries(&g, &s, 1, q);
    for (int mode = 1; mode <= 2; mode++) {
        scan_out o;
        float z = mode == KVT__RECALL_SOUND ? sqrtf(448.0f) : 0.0f;
        cr_assert_eq(run_scan(&r.cpu, &s, q, &best, 1, SMAX, z, mode, 64, &o), KVT_OK);
        cr_assert_eq(o.n_fired, 1, "mode %d", mode);
        cr_assert_eq(o.fired[0], row);
        free(o.fired);
    }
    q[3] = NAN;
    scan_out o;
    cr_assert_eq(run_scan(&r.cpu, &s, q, &best, 1, SMAX, sqrtf(448.0f), KVT__RECALL_SOUND, 64,
                          &o),
                 KVT_OK);
    uint32_t n_arch = 0;
    for (uint32_t u = 0; u < 64; u++)
        n_arch += archived(&s, u);
    cr_assert_eq(o.n_fired, n_arch);
    free(o.fired);
    scen_free(&s);
    rig_close(&r);
}

/* Misuse: a sound z below √(D − 64) or NaN, a NaN conformal z, a zero scale, an unknown mode,
 * and (guarded) a host pointer among the arguments are refused. */
Test(recall_scan, refuses_bad_arguments_and_host_pointers) {
    rig r;
    rig_open(&r);
    tu_rng g = {0xbad1u};
    scen s;
    scen_make(&s, &g, 64, 8, KVT__DT_BF16);
    float q[QD], best = 0.0f;
    make_queries(&g, &s, 1, q);
    scan_out o;
    cr_assert_eq(run_scan(&r.cpu, &s, q, &best, 1, SMAX, 8.0f, KVT__RECALL_SOUND, 4, &o),
                 KVT_ERR_INVALID_ARGUMENT);
    free(o.fired);
    cr_assert_eq(run_scan(&r.cpu, &s, q, &best, 1, SMAX, NAN, KVT__RECALL_SOUND, 4, &o),
                 KVT_ERR_INVALID_ARGUMENT);
    free(o.fired);
    cr_assert_eq(run_scan(&r.guarded, &s, q, &best, 1, SMAX, 1.0f, 7, 4, &o),
                 KVT_ERR_INVALID_ARGUMENT);
    free(o.fired);
    cr_assert_eq(run_scan(&r.cpu, &s, q, &best, 1, SMAX, NAN, KVT__RECALL_CONFORMAL, 4, &o),
                 KVT_ERR_INVALID_ARGUMENT);
    free(o.fired);
    cr_assert_eq(run_scan(&r.cpu, &s, q, &best, 1, 0.0f, 1.0f, KVT__RECALL_CONFORMAL, 4, &o),
                 KVT_ERR_INVALID_ARGUMENT);
    free(o.fired);
    /* A host query array on the guarded backend. */
    const kvt__backend *be = &r.guarded;
    void *dq = dev(be, q, sizeof q), *db = dev(be, &best, 4), *out = dev(be, NULL, 64);
    kvt__recall_scan_args a = {.latent_dim = D,
                               .branch_dim = BD,
                               .dtype = KVT__DT_BF16,
                               .branch_dtype = KVT__DT_BF16,
                               .csk_stride = 1,
                               .q = q,
                               .best = db,
                               .n_heads = 1,
                               .scale = SMAX,
                               .z = 1.0f,
                               .mode = KVT__RECALL_CONFORMAL,
                               .cap = 4,
                               .fired = out,
                               .n_fired = (uint32_t *)out + 8,
                               .overflow = (uint32_t *)out + 9};
    cr_assert_eq(be->ops->recall_scan(be, &a, 1, NULL), KVT_ERR_INVARIANT);
    a.q = dq;
    cr_assert_eq(be->ops->recall_scan(be, &a, 1, NULL), KVT_OK); /* no closed rows: nothing */
    uint32_t nf = 7;
    a.n_fired = &nf; /* host output */
    cr_assert_eq(be->ops->recall_scan(be, &a, 1, NULL), KVT_ERR_INVARIANT);
    be->ops->buf_free(be, dq, sizeof q);
    be->ops->buf_free(be, db, 4);
    be->ops->buf_free(be, out, 64);
    scen_free(&s);
    rig_close(&r);
}

/* The exact score against a double-precision dot product, and idx = exact for a row exactly
 * representable in a full-rank... (rank < D here: idx vs exact within the sound bound is what
 * sound_never_misses covers); here: exact's own accuracy. */
Test(recall_scan, exact_score_matches_double) {
    tu_rng g = {0xe8ac7u};
    scen s;
    scen_make(&s, &g, 32, 0, KVT__DT_FP32);
    float q[QD];
    make_queries(&g, &s, 1, q);
    for (uint32_t row = 0; row < 32; row++) {
        const float *x = (const float *)row_at(&s, row);
        double want = 0, mag = 0;
        for (uint32_t i = 0; i < QD; i++) {
            want += (double)q[i] * x[i];
            mag += fabs((double)q[i] * x[i]);
        }
        want *= SMAX;
        float got = exact(&s, q, row, SMAX);
        cr_assert(fabs(got - want) <= 1e-5 * mag * SMAX + 1e-30, "row %u: %g vs %g", row, got,
                  want);
    }
    scen_free(&s);
}

/* The twin's branch-free fp16 conversion equals kvt__f16_to_f32 on every bit pattern. */
Test(recall_scan, fast_f16_conversion_is_exact) {
    for (uint32_t h = 0; h < 65536u; h++) {
        uint32_t a = kvt__bits_from_f32(kvt__recall_f16_fast((uint16_t)h));
        uint32_t b = kvt__bits_from_f32(kvt__f16_to_f32((uint16_t)h));
        cr_assert_eq(a, b, "0x%04x: 0x%08x, want 0x%08x", h, a, b);
    }
}

/* An fp32 value of the heads-preparation test: mostly normal, some 0, −0, subnormal, huge
 * (1e30: its squares overflow the norms), ±Inf and NaN. */
static float prep_val(tu_rng *g, uint32_t kind) {
    static const float sp[] = {0.0f, -0.0f, 1e-40f, -3e-39f, 1e30f, -1e30f, INFINITY, -INFINITY,
                               NAN};
    switch (kind) {
    case 0: /* normal, a special value now and then */
        return tu_next(g) % 97 == 0 ? sp[tu_next(g) % 9] : (float)tu_normal(g);
    case 1: /* huge */
        return (float)(1e30 * tu_normal(g));
    case 2: /* subnormal */
        return (float)(1e-41 * tu_normal(g));
    case 3: /* zero */
        return 0.0f;
    default: /* tiny and huge together */
        return (float)(tu_next(g) % 2 ? 1e25 * tu_normal(g) : 1e-30 * tu_normal(g));
    }
}

/* Two floats that must be the same bits; NaN against any NaN (the payload a NaN operand leaves
 * is the instruction's operand order's, not the chain's). */
static bool same_bits(float a, float b) {
    return isnan(a) ? isnan(b) : kvt__bits_from_f32(a) == kvt__bits_from_f32(b);
}

/* kvt__recall_heads_prep_cpu (the scan's and the calibration step's preparation) against
 * kvt__recall_head_prep head by head, bit for bit, at every SIMD level this CPU has (head by
 * head, 8 heads a vector on AVX2 + FMA, 16 on AVX-512): latent dims 65..1024 (multiples of 16
 * and not), ranks 0..130 (multiples of 8 and odd), 1..53 heads (whole vectors and partial ones),
 * strided queries; heads of random, zero, huge, subnormal and mixed values with NaN/±Inf
 * sprinkled, bases random or with special values. Every q̃_sk value and the five fields of every
 * head; the outputs past the last head stay untouched (guards), the scratch is the macro's. */
Test(recall_scan, heads_prep_bit_equal_at_every_level) {
    const int top = kvt__recall_prep_level(-1);
    if (top < 2)
        cr_log_info("heads' preparation: this CPU runs level %d at most (2 AVX-512, 1 AVX2 + "
                    "FMA): the levels above it are not compared",
                    top);
    static const uint32_t Ds[] = {65, 96, 100, 128, 511, 512, 1024};
    static const uint32_t ranks[] = {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 130};
    const float guard = -1234.5f;
    uint64_t compared = 0;
    for (uint64_t seed = 1; seed <= 120; seed++) {
        tu_rng g = {0x9e3779b1u * seed};
        const uint32_t Dl = Ds[tu_next(&g) % 7], rank = ranks[tu_next(&g) % 12];
        const uint32_t H = 1 + (uint32_t)(tu_next(&g) % 53);
        const size_t stride = Dl + (size_t)(tu_next(&g) % 80);
        float *q = malloc(sizeof(float) * (H * stride + 1));
        float *V = rank ? malloc(sizeof(float) * rank * Dl) : NULL;
        float *ref_sk = malloc(sizeof(float) * (H * rank + 1)), *tmp = malloc(sizeof(float) * Dl);
        float *sk = malloc(sizeof(float) * (H * rank + 16));
        float *scratch = malloc(sizeof(float) * KVT__RECALL_HEADS_PREP_FLOATS(Dl, rank));
        kvt__recall_head *ref = malloc(sizeof *ref * H), *hd = malloc(sizeof *hd * (H + 1));
        cr_assert(q && (V || !rank) && ref_sk && tmp && sk && scratch && ref && hd);
        for (uint32_t h = 0; h < H; h++) {
            const uint32_t kind = seed % 5 == 0 ? 0 : (uint32_t)(tu_next(&g) % 8);
            for (size_t d = 0; d < stride; d++)
                q[h * stride + d] = d < Dl ? prep_val(&g, kind > 4 ? 0 : kind) : NAN;
        }
        const double vs = 1.0 / sqrt((double)Dl);
        for (uint32_t i = 0; i < rank * Dl; i++)
            V[i] = seed % 7 == 0 ? prep_val(&g, 0) : (float)(vs * tu_normal(&g));
        for (uint32_t h = 0; h < H; h++)
            kvt__recall_head_prep(q + h * stride, Dl, V, rank, ref_sk + (size_t)h * rank, tmp,
                                  &ref[h]);
        for (int lv = 0; lv <= top; lv++) {
            cr_assert_eq(kvt__recall_prep_level(lv), lv);
            for (uint32_t i = 0; i < H * rank + 16; i++)
                sk[i] = guard;
            memset(&hd[H], 0x5a, sizeof hd[H]);
            kvt__recall_heads_prep_cpu(q, stride, H, Dl, V, rank, sk, hd, scratch);
            for (uint32_t h = 0; h < H; h++) {
                for (uint32_t k = 0; k < rank; k++) {
                    const size_t e = (size_t)h * rank + k;
                    cr_assert(same_bits(sk[e], ref_sk[e]),
                              "seed %llu level %d (D %u, rank %u, %u heads): head %u q_sk[%u] "
                              "%a, want %a",
                              (unsigned long long)seed, lv, Dl, rank, H, h, k, (double)sk[e],
                              (double)ref_sk[e]);
                }
                const float got[5] = {hd[h].nlat, hd[h].nres, hd[h].Qres, hd[h].Qsk, hd[h].eta};
                const float want[5] = {ref[h].nlat, ref[h].nres, ref[h].Qres, ref[h].Qsk,
                                       ref[h].eta};
                for (int f = 0; f < 5; f++)
                    cr_assert(same_bits(got[f], want[f]),
                              "seed %llu level %d (D %u, rank %u, %u heads): head %u field %d "
                              "(nlat nres Qres Qsk eta) %a, want %a",
                              (unsigned long long)seed, lv, Dl, rank, H, h, f, (double)got[f],
                              (double)want[f]);
                compared++;
            }
            for (uint32_t i = H * rank; i < H * rank + 16; i++)
                cr_assert(kvt__bits_from_f32(sk[i]) == kvt__bits_from_f32(guard),
                          "seed %llu level %d: q_sk[%u] past the last head written",
                          (unsigned long long)seed, lv, i);
            const unsigned char *gb = (const unsigned char *)&hd[H];
            for (size_t i = 0; i < sizeof hd[H]; i++)
                cr_assert_eq(gb[i], 0x5a, "seed %llu level %d: heads[%u] written",
                             (unsigned long long)seed, lv, H);
        }
        kvt__recall_prep_level(2);
        free(q);
        free(V);
        free(ref_sk);
        free(tmp);
        free(sk);
        free(scratch);
        free(ref);
        free(hd);
    }
    cr_log_info("heads' preparation: %llu heads compared over levels 0..%d",
                (unsigned long long)compared, top);
}

/* ---------------------------------------------------------------------------------------------
 * The tiled scan (kvt__recall_scan_cpu on AVX2/FMA CPUs) against the row-wise scan and the
 * per-element functions, over random shapes: latent dims 65..512, branches of 0..100 values
 * (multiples of 8 and not) in bf16, fp16 or fp32, ranks 0..128, 1..70 heads (tiles of 16 and 8
 * and partial ones), 1..300 closed rows (chunks of 48 and tiles of 6 and 2 partial), strided and
 * permuted rows, raw fp16 sketch patterns (subnormal, Inf, NaN), special branch values, ρ of 0
 * and +Inf, thresholds at a row's own trigger value and one ulp either side, NaN and ±Inf.
 * Checked: every (row, head) idx chain and |·| chain of the tiled scan bit for bit against
 * kvt__recall_idx (heads prepared by kvt__recall_head_prep); fired rows, count and overflow
 * identical to the row-wise scan and to the per-element trigger functions; and the pruned
 * scan's evaluation of listed rows against a random subset of heads (kvt__recall_rows_fire_cpu)
 * identical to kvt__recall_row_fires_cpu's, row by row.
 * ------------------------------------------------------------------------------------------- */
static float rand_special(tu_rng *g) {
    static const float sp[] = {0.0f, -0.0f, 1e-40f, -3e-39f, 65504.0f, 1e30f};
    switch (tu_next(g) % 64) {
    case 0:
        return INFINITY;
    case 1:
        return -INFINITY;
    case 2:
        return NAN;
    case 3:
        return sp[tu_next(g) % 6];
    default:
        return (float)tu_normal(g);
    }
}

Test(recall_scan, tiled_scan_bit_equal_to_rowwise_and_per_element) {
    const int tiled = kvt__recall_scan_tiled(-1);
    if (!tiled)
        cr_log_info("the tiled scan does not run on this CPU (no AVX2/FMA): the row-wise scan "
                    "is compared with the per-element functions only");
    uint32_t shapes = 0, chains = 0, fired_total = 0, overflowed = 0;
    for (uint64_t seed = 1; seed <= 160; seed++) {
        /* odd seeds on the AVX-512 tiles where the CPU has them, even ones on the AVX2 tiles */
        kvt__recall_scan_wide((int)(seed & 1u));
        tu_rng g = {0x7113du * seed};
        static const uint32_t Ds[] = {65, 96, 128, 512};
        static const uint32_t BDs[] = {0, 8, 16, 24, 64, 100};
        static const uint32_t ranks[] = {0, 1, 7, 8, 16, 64, 128};
        static const int bdts[] = {KVT__DT_BF16, KVT__DT_FP16, KVT__DT_FP32};
        const uint32_t Dl = Ds[tu_next(&g) % 4], bd = BDs[tu_next(&g) % 6];
        const uint32_t rank = ranks[tu_next(&g) % 7];
        const int bdt = seed % 4 ? bdts[tu_next(&g) % 3] : KVT__DT_BF16;
        const uint32_t H = 1 + (uint32_t)(tu_next(&g) % 70);
        const uint32_t N = 1 + (uint32_t)(tu_next(&g) % 300);
        const uint32_t pr = 1u << (uint32_t)(tu_next(&g) % 5), np = (N + pr - 1) / pr;
        const int mode = 1 + (int)(seed % 3);
        const uint32_t be = bdt == KVT__DT_FP32 ? 4 : 2;
        const uint32_t boff = 2 * Dl, stride = boff + bd * be + 2 * (uint32_t)(tu_next(&g) % 3);
        const uint32_t cstride = rank + (uint32_t)(tu_next(&g) % 3);
        const float sc = (float)(0.02 + tu_uniform(&g) * 0.2);
        const float z = mode == KVT__RECALL_SOUND
                            ? sqrtf((float)(Dl - 64)) + (float)tu_uniform(&g)
                        : mode == KVT__RECALL_MARGIN ? (float)(3.0 * tu_uniform(&g))
                                                     : (float)(-1.0 + 11.0 * tu_uniform(&g));
        uint8_t *pool = malloc((size_t)np * pr * stride + 1);
        int32_t *pages = malloc(sizeof(int32_t) * np);
        uint16_t *csk = malloc(sizeof(uint16_t) * ((size_t)N * cstride + 1));
        float *rho = malloc(sizeof(float) * N), *V = malloc(sizeof(float) * (rank * Dl + 1));
        float *q = malloc(sizeof(float) * H * (Dl + bd)), *best = malloc(sizeof(float) * H);
        uint32_t *kept = malloc(sizeof(uint32_t) * N), m = 0;
        cr_assert(pool && pages && csk && rho && V && q && best && kept);
        for (size_t i = 0; i < (size_t)np * pr * stride; i++)
            pool[i] = (uint8_t)tu_next(&g);
        for (uint32_t p = 0; p < np; p++)
            pages[p] = (int32_t)p;
        for (uint32_t p = np - 1; p > 0; p--) {
            uint32_t j = (uint32_t)(tu_next(&g) % (p + 1));
            int32_t t = pages[p];
            pages[p] = pages[j];
            pages[j] = t;
        }
        kvt__div32 pd = kvt__div32_make(pr);
        for (uint32_t row = 0; row < N; row++) {
            uint8_t *r = pool + (size_t)kvt__page_slot(pages, 0, &pd, row) * stride;
            for (uint32_t j = 0; j < bd; j++)
                kvt__store_elem(r + boff, bdt, j, rand_special(&g));
            for (uint32_t k = 0; k < cstride; k++)
                csk[(size_t)row * cstride + k] = tu_next(&g) % 50 == 0
                                                     ? (uint16_t)tu_next(&g)
                                                     : kvt__f32_to_f16((float)tu_normal(&g));
            uint64_t k = tu_next(&g) % 40;
            rho[row] = k == 0 ? INFINITY : k == 1 ? 0.0f : (float)(2.0 * tu_uniform(&g));
        }
        for (uint32_t i = 0; i < rank * Dl; i++)
            V[i] = (float)(tu_normal(&g) / sqrt((double)Dl));
        for (uint32_t i = 0; i < H * (Dl + bd); i++)
            q[i] = tu_next(&g) % 500 == 0 ? rand_special(&g) : (float)tu_normal(&g);
        const uint32_t sinks = (uint32_t)(tu_next(&g) % 9);
        for (uint32_t row = 0; row < N; row++)
            if (tu_next(&g) % 6 == 0)
                kept[m++] = row;
        const size_t HP = kvt__recall_scan_heads_padded(H);
        float *scratch = malloc(sizeof(float) * kvt__recall_scan_scratch_floats(H, rank, Dl));
        float *qsk = malloc(sizeof(float) * (H * rank + 1)), *tmp = malloc(sizeof(float) * Dl);
        float *idx = malloc(sizeof(float) * N * H), *P = malloc(sizeof(float) * N * H);
        float *ncsk = malloc(sizeof(float) * N);
        kvt__recall_head *hd = malloc(sizeof *hd * H);
        cr_assert(scratch && qsk && tmp && idx && P && ncsk && hd);
        /* the per-element reference: every (row, head) idx, P and ‖csk‖ */
        for (uint32_t h = 0; h < H; h++)
            kvt__recall_head_prep(q + (size_t)h * (Dl + bd), Dl, rank ? V : NULL, rank,
                                  qsk + (size_t)h * rank, tmp, &hd[h]);
        for (uint32_t row = 0; row < N; row++)
            for (uint32_t h = 0; h < H; h++)
                idx[(size_t)row * H + h] = kvt__recall_idx(
                    q + (size_t)h * (Dl + bd), qsk + (size_t)h * rank,
                    pool + (size_t)kvt__page_slot(pages, 0, &pd, row) * stride, Dl, boff, bdt,
                    bd, csk + (size_t)row * cstride, rank, sc, &P[(size_t)row * H + h],
                    &ncsk[row]);
        /* thresholds: a row's idx (plus its margin) exactly, or one ulp either side, or far,
         * NaN, ±Inf */
        for (uint32_t h = 0; h < H; h++) {
            const uint32_t row = (uint32_t)(tu_next(&g) % N);
            const float v = idx[(size_t)row * H + h];
            float t = mode == KVT__RECALL_SOUND
                          ? v + kvt__recall_sound_margin(&hd[h], v, P[(size_t)row * H + h],
                                                         ncsk[row], rho[row], sc, z, Dl, bd, rank)
                      : mode == KVT__RECALL_MARGIN
                          ? v + z
                          : v + z * kvt__recall_cert(&hd[h], rho[row], sc, Dl);
            switch (tu_next(&g) % 8) {
            case 0:
                t = nextafterf(t, INFINITY);
                break;
            case 1:
                t = nextafterf(t, -INFINITY);
                break;
            case 2:
                t = 1e30f;
                break;
            case 3:
                t = tu_next(&g) % 4 ? INFINITY : tu_next(&g) % 2 ? -INFINITY : NAN;
                break;
            default:
                break;
            }
            best[h] = t;
        }
        uint32_t cap = seed % 2 ? N : 1 + (uint32_t)(tu_next(&g) % (N + 1)), nf[2] = {0, 0},
                 ov[2] = {0, 0};
        uint32_t *fired = malloc(sizeof(uint32_t) * 2 * cap);
        cr_assert(fired);
        kvt__recall_scan_args a = {.base = pool, .pages = pages, .pdiv = &pd,
                                   .slot_stride = stride, .dtype = KVT__DT_BF16,
                                   .latent_dim = Dl, .branch_offset = boff, .branch_dtype = bdt,
                                   .branch_dim = bd, .csk = csk, .rho = rho,
                                   .csk_stride = cstride, .basis = rank ? V : NULL,
                                   .rank = rank, .n_closed = N, .sinks = sinks, .kept = kept,
                                   .m = m, .q = q, .best = best, .n_heads = H, .scale = sc,
                                   .z = z, .mode = mode, .cap = cap};
        /* the tiled chains, 48 rows at a time */
        if (tiled) {
            float *acc = malloc(sizeof(float) * 48 * HP), *pa = malloc(sizeof(float) * 48 * HP);
            uint64_t rows[48];
            cr_assert(acc && pa);
            for (uint32_t r0 = 0; r0 < N; r0 += 48) {
                uint32_t n = N - r0 < 48 ? N - r0 : 48;
                for (uint32_t i = 0; i < n; i++)
                    rows[i] = r0 + i;
                cr_assert(kvt__recall_scan_tile_chains_cpu(&a, scratch, rows, n, acc, pa));
                for (uint32_t i = 0; i < n; i++)
                    for (uint32_t h = 0; h < H; h++) {
                        const size_t e = (size_t)(r0 + i) * H + h;
                        const float ti = sc * acc[i * HP + h];
                        cr_assert(memcmp(&ti, &idx[e], 4) == 0,
                                  "seed %llu row %u head %u: tiled idx %a, per-element %a",
                                  (unsigned long long)seed, r0 + i, h, (double)ti,
                                  (double)idx[e]);
                        cr_assert(mode != KVT__RECALL_SOUND ||
                                      memcmp(&pa[i * HP + h], &P[e], 4) == 0,
                                  "seed %llu row %u head %u: tiled P %a, per-element %a",
                                  (unsigned long long)seed, r0 + i, h, (double)pa[i * HP + h],
                                  (double)P[e]);
                        chains++;
                    }
            }
            free(acc);
            free(pa);
        }
        /* the pruned scan's evaluation of listed rows against a subset of the heads (its live
         * heads' columns, as recall/kernels/recall_group.c lays them out) equals the row-wise
         * one's */
        {
            kvt__recall_scan_prep p;
            kvt__recall_scan_prep_cpu(&a, scratch, &p);
            uint32_t *hmap = malloc(sizeof(uint32_t) * H), nl = 0;
            const size_t J = (size_t)bd + rank;
            float *qL = malloc(sizeof(float) * (J * HP + 1));
            uint64_t *rows = malloc(sizeof(uint64_t) * N);
            uint8_t *fire = malloc(N);
            cr_assert(hmap && qL && rows && fire);
            for (uint32_t h = 0; h < H; h++)
                if (tu_next(&g) % 3)
                    hmap[nl++] = h;
            const int all = nl == H;
            const size_t LP = kvt__recall_scan_heads_padded(nl);
            for (size_t j = 0; j < J; j++)
                for (size_t t = 0; t < LP; t++)
                    qL[j * LP + t] = t < nl ? p.qT[j * HP + hmap[t]] : 0.0f;
            uint32_t nr = 0;
            for (uint32_t row = 0; row < N; row++)
                if (tu_next(&g) % 2)
                    rows[nr++] = (row * 7919u) % N; /* scattered, repeats allowed */
            const float *qc = all ? p.qT : qL;
            const size_t QP = all ? HP : LP;
            const uint32_t *hm = all ? NULL : hmap;
            kvt__recall_rows_fire_cpu(&a, &p, qc, QP, hm, nl, rows, nr, fire);
            for (uint32_t i = 0; i < nr; i++)
                cr_assert_eq(fire[i], kvt__recall_row_fires_cpu(&a, &p, qc, QP, hm, nl, rows[i]),
                             "seed %llu: listed row %u (%llu) of %u, %u of %u heads",
                             (unsigned long long)seed, i, (unsigned long long)rows[i], nr, nl, H);
            free(hmap);
            free(qL);
            free(rows);
            free(fire);
        }
        /* fired sets: the dispatched scan (tiled), the row-wise scan, the per-element triggers */
        for (int w = 0; w < 2; w++) {
            a.fired = fired + (size_t)w * cap;
            a.n_fired = &nf[w];
            a.overflow = &ov[w];
            if (w == 0)
                kvt__recall_scan_cpu(&a, scratch);
            else
                kvt__recall_scan_rowwise_cpu(&a, scratch);
        }
        uint32_t nref = 0, oref = 0, mk = 0;
        for (uint32_t row = sinks; row < N && !oref; row++) {
            while (mk < m && kept[mk] < row)
                mk++;
            if (mk < m && kept[mk] == row)
                continue;
            int f = 0;
            for (uint32_t h = 0; h < H && !f; h++) {
                const float v = idx[(size_t)row * H + h];
                if (mode == KVT__RECALL_SOUND)
                    f = kvt__recall_sound_fires(
                        v,
                        kvt__recall_sound_margin(&hd[h], v, P[(size_t)row * H + h], ncsk[row],
                                                 rho[row], sc, z, Dl, bd, rank),
                        best[h]);
                else if (mode == KVT__RECALL_MARGIN)
                    f = !(v + z < best[h]);
                else
                    f = kvt__recall_conformal_fires(v, kvt__recall_cert(&hd[h], rho[row], sc, Dl),
                                                    z, best[h]);
            }
            if (!f)
                continue;
            if (nref == cap)
                oref = 1;
            else
                cr_assert_eq(fired[cap + nref++], row, "seed %llu: row-wise fired[%u]",
                             (unsigned long long)seed, nref - 1);
        }
        cr_assert_eq(nf[1], nref, "seed %llu", (unsigned long long)seed);
        cr_assert_eq(ov[1], oref, "seed %llu", (unsigned long long)seed);
        cr_assert_eq(nf[0], nf[1], "seed %llu: tiled %u fired, row-wise %u",
                     (unsigned long long)seed, nf[0], nf[1]);
        cr_assert_eq(ov[0], ov[1], "seed %llu", (unsigned long long)seed);
        cr_assert(memcmp(fired, fired + cap, sizeof(uint32_t) * nf[0]) == 0, "seed %llu",
                  (unsigned long long)seed);
        shapes++;
        fired_total += nf[0];
        overflowed += ov[0];
        free(fired);
        free(pool);
        free(pages);
        free(csk);
        free(rho);
        free(V);
        free(q);
        free(best);
        free(kept);
        free(scratch);
        free(qsk);
        free(tmp);
        free(idx);
        free(P);
        free(ncsk);
        free(hd);
    }
    kvt__recall_scan_wide(1);
    cr_log_info("tiled scan: %u shapes, %u (row, head) chains compared, %u rows fired, %u "
                "overflowing scans (AVX-512 tiles on odd seeds: %s)", shapes, chains, fired_total,
                overflowed, kvt__recall_scan_wide(-1) ? "yes" : "no AVX-512 here");
    cr_assert(fired_total > 0 && overflowed > 0 && (!tiled || chains > 100000));
}

/* ---------------------------------------------------------------------------------------------
 * The 8-bit scan (params.recall_scan_bits 8; recall/kernels/recall_scan.h "The 8-bit scan").
 * ------------------------------------------------------------------------------------------- */

/* Rows at the quantisation's edges, before the planes are built: branches whose values sit on
 * the half-steps of their scale (x·127/max = k + 1/2: the rounding's worst case), one spike and
 * tiny rest (the error of the small values is all of them), all zero, subnormal, and huge. */
static void scen_edges(scen *s, tu_rng *g) {
    for (uint32_t row = 0; row < s->N; row++) {
        uint8_t *p = (uint8_t *)row_at(s, row);
        const uint32_t kind = (uint32_t)(tu_next(g) % 8);
        const float m = (float)(0.5 + tu_uniform(g) * 4.0);
        for (uint32_t j = 0; j < BD && kind < 5; j++) {
            float v;
            if (kind == 0) /* half-steps */
                v = j == 0 ? m : m * ((float)(tu_next(g) % 127) + 0.5f) / 127.0f;
            else if (kind == 1) /* a spike */
                v = j == 3 ? m * 1000.0f : m * 1e-3f * (float)tu_normal(g);
            else if (kind == 2)
                v = 0.0f;
            else if (kind == 3) /* subnormal */
                v = 1e-39f * (float)(tu_next(g) % 100);
            else /* huge */
                v = m * 1e30f * (float)tu_normal(g);
            put(p, s->dtype, D + j, (tu_next(g) % 2 ? -1.0f : 1.0f) * v);
        }
    }
}

/* Widen the scenario's sketch rows by the 8-bit plane (kvt__recall_q8_row per row). */
static void scen_q8(scen *s) {
    const uint32_t W = s->csk_stride, S = W + kvt__recall_q8_words(BD, W);
    const uint32_t elt = s->dtype == KVT__DT_FP32 ? 4 : 2;
    uint16_t *c = calloc((size_t)s->N * S, 2);
    float tmp[BD + KVT__SKETCH_MAX_RANK];
    cr_assert(c);
    for (uint32_t row = 0; row < s->N; row++) {
        uint16_t *r = c + (size_t)row * S;
        memcpy(r, s->csk + (size_t)row * W, 2u * W);
        kvt__recall_q8_row(row_at(s, row), D * elt, s->dtype, BD, r, W, tmp, (uint8_t *)(r + W));
    }
    free(s->csk);
    s->csk = c;
    s->q8 = W;
    s->csk_stride = S;
}

/* The 8-bit reference: the per-element functions, row by row, head by head (fired[row] = 0/1).
 * With worst, every archived (row, head) also checks |idx16 − idx8| <= B (the bound the
 * triggers widen by), and *worst keeps the largest share of B the real gap took. */
static float *g_lhs8; /* when set: reference8's conformal left-hand sides [row][H] */

static uint32_t reference8(const scen *s, const float *q, const float *best, uint32_t H, float sc,
                           float z, int mode, uint8_t *fired, double *worst) {
    const uint32_t elt = s->dtype == KVT__DT_FP32 ? 4 : 2, W = s->q8;
    const uint32_t len = kvt__recall_q8_len(BD, W);
    uint32_t n = 0;
    float *qsk = malloc(sizeof(float) * (s->rank + 1) * H);
    float tmp[D], tq[BD + KVT__SKETCH_MAX_RANK];
    kvt__recall_head *hd = malloc(sizeof *hd * H);
    kvt__recall_q8h *h8 = malloc(sizeof *h8 * H);
    uint8_t *v = malloc((size_t)len * H);
    cr_assert(qsk && hd && h8 && v);
    for (uint32_t h = 0; h < H; h++) {
        kvt__recall_head_prep(q + (size_t)h * QD, D, s->V, s->rank, qsk + (size_t)h * s->rank,
                              tmp, &hd[h]);
        kvt__recall_q8_head(q + (size_t)h * QD, D, BD, qsk + (size_t)h * s->rank, s->rank, W, tq,
                            v + (size_t)h * len, &h8[h]);
    }
    for (uint32_t row = 0; row < s->N; row++) {
        fired[row] = 0;
        if (!archived(s, row))
            continue;
        const uint16_t *c = s->csk + (size_t)row * s->csk_stride;
        const uint8_t *pl = (const uint8_t *)(c + W);
        for (uint32_t h = 0; h < H; h++) {
            int32_t ib, is;
            kvt__recall_q8_dots(pl + 4u * KVT__Q8_FLOATS, v + (size_t)h * len, BD, len, &ib, &is);
            if (worst) {
                float P, nc;
                const float i16 = kvt__recall_idx(q + (size_t)h * QD, qsk + (size_t)h * s->rank,
                                                  row_at(s, row), D, D * elt, s->dtype, BD, c,
                                                  s->rank, sc, &P, &nc);
                const float i8 = kvt__recall_q8_idx(&h8[h], pl, ib, is, sc);
                const float B = kvt__recall_q8_bound(&h8[h], pl, sc);
                const double gap = fabs((double)i16 - (double)i8);
                if (isfinite(i16) && isfinite(B)) {
                    cr_assert(gap <= B, "row %u head %u: |idx16 - idx8| = %g above B = %g", row,
                              h, gap, (double)B);
                    if (B > 0)
                        *worst = gap / B > *worst ? gap / B : *worst;
                }
            }
            fired[row] |= (uint8_t)kvt__recall_q8_fires(&hd[h], &h8[h], pl, ib, is, s->rho[row],
                                                        sc, z, best[h], mode, D, BD, s->rank);
            if (g_lhs8) { /* kvt__recall_q8_fires' conformal left-hand side, in its order */
                const float i8 = kvt__recall_q8_idx(&h8[h], pl, ib, is, sc);
                const float B = kvt__recall_q8_bound(&h8[h], pl, sc);
                const float zc = z * kvt__recall_cert(&hd[h], s->rho[row], sc, D);
                const float Bp = B + 2.3841858e-7f * (fabsf(i8) + B + fabsf(zc));
                g_lhs8[(size_t)row * H + h] = (i8 + Bp) + zc;
            }
        }
        n += fired[row];
    }
    free(qsk);
    free(hd);
    free(h8);
    free(v);
    return n;
}

/* The 8-bit op (AMX and VNNI where the CPU has them, AVX2, row by row, and the guarded backend)
 * gives the per-element functions' fired set bit for bit in the three modes, over ranks, dtypes,
 * z from negative to large, heads not a multiple of 16, rows at the quantisation's edges, the
 * planes split in two arrays at n_head and caps the scan stops at mid-tile;
 * every row the 16-bit per-element reference fires, the 8-bit one fires too (z keeps its
 * meaning); and |idx16 − idx8| <= B on every (row, head). */
Test(recall_scan, q8_bit_equal_superset_and_bound) {
    rig r;
    rig_open(&r);
    const uint32_t H = 43, N = 192;
    float *q = malloc(sizeof(float) * QD * H);
    uint8_t ref8[192], ref16[192];
    cr_assert(q);
    uint64_t compared = 0, fired8 = 0, fired16 = 0;
    double worst = 0;
    const int level = kvt__recall_scan_q8_level(-1);
    const uint64_t screened0 = kvt__recall_scan_q8_screened();
    for (uint32_t c = 0; c < 12; c++) {
        uint64_t seed = 0x9a48000u + c;
        tu_rng g = {seed};
        static const uint32_t ranks[] = {0, 1, 8, 64, 64, 128};
        scen s;
        scen_make(&s, &g, N, ranks[c % 6], c % 2 ? KVT__DT_FP32 : KVT__DT_BF16);
        if (c % 3 == 2)
            scen_edges(&s, &g);
        scen_q8(&s);
        if (c % 2) /* rows [0, n_head) in arrays of their own (a shared prefix) */
            s.n_head = 1 + (uint32_t)(tu_next(&g) % (N - 1));
        for (uint32_t st = 0; st < 4; st++) {
            make_queries(&g, &s, H, q);
            float best[43];
            for (uint32_t h = 0; h < H; h++)
                best[h] = (float)(tu_normal(&g) * 2.0);
            static const float zs[] = {-1.0f, 0.0f, 0.5f, 2.0f, 8.0f};
            for (uint32_t m = 0; m < 9; m++) {
                const int mode = m == 5   ? KVT__RECALL_SOUND
                                 : m == 6 ? KVT__RECALL_MARGIN
                                          : KVT__RECALL_CONFORMAL;
                const float z = m == 5 ? sqrtf((float)(D - 64u)) : m == 6 ? 0.25f : m >= 7 ? 1.0f : zs[m];
                if (m >= 7) { /* thresholds at the edge: each head's best is the trigger value of
                               * its second-highest archived row (that row sits exactly on it and
                               * does not fire; one above does): a wrong dot or epilogue moves it.
                               * m 8: one ulp below the highest (it fires by one ulp: the
                               * conformal screen must not rule it out) */
                    static float lhs[192 * 43];
                    g_lhs8 = lhs;
                    reference8(&s, q, best, H, SMAX, z, mode, ref8, NULL);
                    g_lhs8 = NULL;
                    for (uint32_t h = 0; h < H; h++) {
                        float t1 = -INFINITY, t2 = -INFINITY;
                        for (uint32_t row = 0; row < N; row++) {
                            const float v = lhs[(size_t)row * H + h];
                            if (!archived(&s, row) || !(v == v))
                                continue;
                            if (v > t1) {
                                t2 = t1;
                                t1 = v;
                            } else if (v > t2 && v < t1) {
                                t2 = v;
                            }
                        }
                        best[h] = m == 8 ? nextafterf(t1, -INFINITY) : t2;
                    }
                }
                const uint32_t k8 = reference8(&s, q, best, H, SMAX, z, mode, ref8,
                                               m == 0 ? &worst : NULL);
                if (mode != KVT__RECALL_MARGIN) {
                    const uint32_t k16 = reference(&s, q, best, H, SMAX, z, mode, ref16, NULL);
                    for (uint32_t row = 0; row < N; row++)
                        cr_assert(!ref16[row] || ref8[row],
                                  "seed %llx mode %d: row %u fires at 16 bits, not at 8",
                                  (unsigned long long)seed, mode, row);
                    fired16 += k16;
                    fired8 += k8;
                }
                /* AMX, VNNI, AVX2, per element; then the CPU's best level with a cap below the
                 * fired count (the (cap + 1)-th fired row stops the scan, mid-tile), and on the
                 * guarded backend with any cap */
                for (int b = 0; b < 6; b++) {
                    const uint32_t cap = b == 4   ? (k8 ? (uint32_t)(tu_next(&g) % k8) : 0)
                                         : b == 5 ? (uint32_t)(tu_next(&g) % N)
                                                  : N;
                    kvt__recall_scan_q8_level(b >= 4 ? 3 : 3 - b);
                    scan_out o;
                    cr_assert_eq(run_scan(b == 5 ? &r.guarded : &r.cpu, &s, q, best, H, SMAX, z,
                                          mode, cap, &o),
                                 KVT_OK);
                    kvt__recall_scan_q8_level(3);
                    cr_assert_eq(o.overflow, k8 > cap ? 1u : 0u, "seed %llx",
                                 (unsigned long long)seed);
                    cr_assert_eq(o.n_fired, k8 < cap ? k8 : cap, "seed %llx mode %d path %d",
                                 (unsigned long long)seed, mode, b);
                    uint32_t j = 0;
                    for (uint32_t row = 0; row < N && j < o.n_fired; row++)
                        if (ref8[row])
                            cr_assert_eq(o.fired[j++], row, "seed %llx",
                                         (unsigned long long)seed);
                    free(o.fired);
                    compared++;
                }
            }
        }
        scen_free(&s);
    }
    if (level < 3)
        cr_log_info("recall_scan q8: level 3 (AMX) is not available here (the CPU's best is %d): "
                    "its runs ran level %d",
                    level, level);
    const uint64_t screened = kvt__recall_scan_q8_screened();
    if (level >= 2) /* the screen ran and ruled rows out: its equality above is not vacuous */
        cr_assert_gt(screened - screened0, 0u, "the conformal 8-bit screen never ruled a row out");
    cr_log_info("recall_scan q8: %llu scans equal to the per-element functions (SIMD levels "
                "3..0 from the CPU's %d; the screen of levels 3 and 2 ruled out %llu rows); the "
                "16-bit set inside the 8-bit one (%llu rows fired at 16 bits, %llu at 8); "
                "|idx16 - idx8| took at most %.3g of B",
                (unsigned long long)compared, level, (unsigned long long)(screened - screened0),
                (unsigned long long)fired16, (unsigned long long)fired8, worst);
    free(q);
    rig_close(&r);
}

/* The 8-bit scan's integer dots at every SIMD level the CPU has (3 AMX, 2 VNNI, 1 AVX2) are
 * kvt__recall_q8_dots' for every archived row and head: planes of random bytes (all 256 values),
 * branch widths and sketch widths below, at and past 64 bytes (whole and short K chunks), heads
 * not a multiple of 16 (a last tile of 8), rows split at n_head into two arrays (16-row blocks
 * and the rest on either side), kept rows inside blocks and whole kept blocks, rows of any stride. */
Test(recall_scan, q8_dots_every_level) {
    static const uint32_t bds[] = {4, 60, 64, 68, 128, 132, 200, 256};
    static const uint32_t ranks[] = {1, 8, 60, 64, 66, 128, 190, 256};
    static const uint32_t heads[] = {1, 7, 8, 16, 17, 24, 32, 43, 64};
    const int cpu = kvt__recall_scan_q8_level(-1);
    uint64_t dots = 0, runs[4] = {0, 0, 0, 0};
    for (uint32_t c = 0; c < 24; c++) {
        const uint64_t seed = 0x9d07000u + c;
        tu_rng g = {seed};
        const uint32_t bd = bds[c % 8], rank = ranks[(c / 2 + c) % 8], H = heads[c % 9];
        const uint32_t W = rank + (rank < KVT__SKETCH_MAX_RANK ? (uint32_t)(tu_next(&g) % 3) : 0);
        const uint32_t Wc = W < KVT__SKETCH_MAX_RANK ? W : KVT__SKETCH_MAX_RANK;
        const uint32_t len = kvt__recall_q8_len(bd, Wc);
        const uint32_t S = Wc + kvt__recall_q8_words(bd, Wc) + (uint32_t)(tu_next(&g) % 3);
        const uint32_t N = 40 + (uint32_t)(tu_next(&g) % 200), qd = D + bd;
        const uint32_t nh = c % 3 == 0 ? 0 : (uint32_t)(tu_next(&g) % N);
        const uint32_t sinks = (uint32_t)(tu_next(&g) % 9);
        uint16_t *hd = malloc(sizeof(uint16_t) * S * (nh ? nh : 1));
        uint16_t *tl = malloc(sizeof(uint16_t) * S * (N - nh));
        float *rho = calloc(N, sizeof(float)), *V = malloc(sizeof(float) * rank * D);
        float *q = malloc(sizeof(float) * qd * H), *best = calloc(H, sizeof(float));
        uint8_t *is_kept = calloc(N, 1), *v = malloc((size_t)len * H);
        uint32_t *kept = malloc(sizeof(uint32_t) * N), m = 0;
        int32_t *ib = malloc(sizeof(int32_t) * N * H), *is = malloc(sizeof(int32_t) * N * H);
        float *scratch = malloc(sizeof(float) * kvt__recall_scan_scratch_floats(H, rank, D));
        float *qsk = malloc(sizeof(float) * rank * H), tmp[D], tq[KVT__RECALL_MAX_BRANCH + KVT__SKETCH_MAX_RANK];
        cr_assert(hd && tl && rho && V && q && best && is_kept && v && kept && ib && is &&
                  scratch && qsk);
        orthonormal_rows(&g, rank, D, V);
        for (size_t i = 0; i < (size_t)qd * H; i++)
            q[i] = (float)tu_normal(&g) * (i % qd < D ? 0.3f : 1.0f);
        for (size_t i = 0; i < (size_t)S * (nh ? nh : 1); i++)
            hd[i] = (uint16_t)tu_next(&g);
        for (size_t i = 0; i < (size_t)S * (N - nh); i++)
            tl[i] = (uint16_t)tu_next(&g);
        /* kept: single rows (a sixth of them), and in every other scenario a run of 20 */
        const uint32_t run0 = c % 2 ? (uint32_t)(tu_next(&g) % N) : N;
        for (uint32_t row = 0; row < N; row++)
            if (tu_next(&g) % 6 == 0 || (row >= run0 && row < run0 + 20u)) {
                is_kept[row] = 1;
                kept[m++] = row;
            }
        kvt__recall_head hh;
        for (uint32_t h = 0; h < H; h++) {
            kvt__recall_q8h h8;
            kvt__recall_head_prep(q + (size_t)h * qd, D, V, rank, qsk + (size_t)h * rank, tmp,
                                  &hh);
            kvt__recall_q8_head(q + (size_t)h * qd, D, bd, qsk + (size_t)h * rank, rank, Wc, tq,
                                v + (size_t)h * len, &h8);
        }
        kvt__recall_scan_args a = {.latent_dim = D, .branch_dim = bd, .csk = tl, .rho = rho,
                                   .csk_head = nh ? hd : NULL, .rho_head = nh ? rho : NULL,
                                   .n_head = nh, .csk_stride = S, .basis = V, .rank = rank,
                                   .n_closed = N, .sinks = sinks, .kept = kept, .m = m, .q = q,
                                   .best = best, .n_heads = H, .scale = SMAX, .z = 1.0f,
                                   .mode = KVT__RECALL_CONFORMAL, .q8_off = Wc};
        for (int lv = cpu; lv >= 1; lv--) {
            kvt__recall_scan_q8_level(lv);
            memset(ib, 0x55, sizeof(int32_t) * N * H);
            memset(is, 0x55, sizeof(int32_t) * N * H);
            const int got = kvt__recall_scan_q8_dots_cpu(&a, scratch, ib, is);
            kvt__recall_scan_q8_level(3);
            cr_assert_eq(got, bd % 4u == 0 ? lv : 0, "seed %llx: level %d ran as %d",
                         (unsigned long long)seed, lv, got);
            uint32_t k = 0;
            for (uint32_t row = sinks; row < N; row++) {
                if (is_kept[row])
                    continue;
                const uint8_t *pl =
                    (const uint8_t *)(row < nh ? hd + (size_t)row * S : tl + (size_t)(row - nh) * S) +
                    2u * Wc + 4u * KVT__Q8_FLOATS;
                for (uint32_t h = 0; h < H; h++) {
                    int32_t eb, es;
                    kvt__recall_q8_dots(pl, v + (size_t)h * len, bd, len, &eb, &es);
                    cr_assert(ib[(size_t)k * H + h] == eb && is[(size_t)k * H + h] == es,
                              "seed %llx level %d (bd %u, width %u, %u heads, n_head %u): row %u "
                              "head %u dots %d %d, kvt__recall_q8_dots %d %d",
                              (unsigned long long)seed, lv, bd, Wc, H, nh, row, h,
                              ib[(size_t)k * H + h], is[(size_t)k * H + h], eb, es);
                    dots++;
                }
                k++;
            }
            runs[lv]++;
        }
        free(hd), free(tl), free(rho), free(V), free(q), free(best), free(is_kept), free(v);
        free(kept), free(ib), free(is), free(scratch), free(qsk);
    }
    if (cpu < 3)
        cr_log_info("q8 dots: level 3 (AMX) is not available here (the CPU's best is %d): not run",
                    cpu);
    cr_log_info("q8 dots: %llu (row, head) dots equal to kvt__recall_q8_dots' (scans by level: "
                "AMX %llu, VNNI %llu, AVX2 %llu)",
                (unsigned long long)dots, (unsigned long long)runs[3], (unsigned long long)runs[2],
                (unsigned long long)runs[1]);
}

/* The conformal 8-bit screen never rules out a row the trigger fires on where the trigger's own
 * fp32 evaluation overflows: rows whose plane values are finite but huge (an e_r, n_c, s_r or ρ
 * past 2^30 — the trigger's products overflow to +Inf and fire, the screen's would not), under
 * thresholds at FLT_MAX; and with the screen off the scan is the same. */
Test(recall_scan, q8_screen_keeps_overflowing_rows) {
    rig r;
    rig_open(&r);
    const uint32_t H = 20, N = 128;
    float *q = malloc(sizeof(float) * QD * H), best[20];
    uint8_t ref8[128];
    cr_assert(q);
    tu_rng g = {0x5c4ee7u};
    scen s;
    scen_make(&s, &g, N, 64, KVT__DT_BF16);
    scen_q8(&s);
    make_queries(&g, &s, H, q);
    for (uint32_t h = 0; h < H; h++)
        best[h] = FLT_MAX;
    static const float huge[] = {3e38f, 1e38f, 2e37f, 3e38f};
    uint32_t poked = 0;
    for (uint32_t row = s.sinks; row < N; row += 9) {
        if (!archived(&s, row))
            continue;
        uint8_t *pl = (uint8_t *)(s.csk + (size_t)row * s.csk_stride + s.q8);
        const uint32_t which = poked % 4;
        const uint32_t field = which == 0 ? 2u : which == 1 ? 5u : which == 2 ? 0u : 6u;
        if (field == 6u)
            s.rho[row] = huge[which];
        else
            memcpy(pl + 4u * field, &huge[which], 4);
        poked++;
    }
    const uint32_t k8 = reference8(&s, q, best, H, SMAX, 1.0f, KVT__RECALL_CONFORMAL, ref8, NULL);
    cr_assert_gt(k8, 0u, "no poked row fires at FLT_MAX: the test is vacuous");
    for (int screen = 1; screen >= 0; screen--) {
        kvt__recall_scan_q8_screen(screen);
        scan_out o;
        cr_assert_eq(run_scan(&r.cpu, &s, q, best, H, SMAX, 1.0f, KVT__RECALL_CONFORMAL, N, &o),
                     KVT_OK);
        kvt__recall_scan_q8_screen(1);
        cr_assert_eq(o.n_fired, k8, "screen %d: %u fired, the per-element functions %u", screen,
                     o.n_fired, k8);
        uint32_t j = 0;
        for (uint32_t row = 0; row < N; row++)
            if (ref8[row])
                cr_assert_eq(o.fired[j++], row);
        free(o.fired);
    }
    cr_log_info("q8 screen: %u of %u poked rows fire at thresholds FLT_MAX, the scan agrees "
                "with the screen on and off", k8, poked);
    scen_free(&s);
    free(q);
    rig_close(&r);
}

/* One thread's 8-bit scans (q8_scans_in_threads). */
typedef struct q8_job {
    const kvt__recall_scan_args *a;
    uint32_t *fired, n_fired, overflow;
    int level;
} q8_job;

static void *q8_job_main(void *arg) {
    q8_job *j = arg;
    j->level = kvt__recall_scan_q8_level(-1); /* the first asks (the tile permission, once) */
    kvt__recall_scan_args a = *j->a;
    a.fired = j->fired;
    a.n_fired = &j->n_fired;
    a.overflow = &j->overflow;
    float *scratch = malloc(sizeof(float) * kvt__recall_scan_scratch_floats(a.n_heads, a.rank,
                                                                            a.latent_dim));
    if (!scratch)
        return NULL;
    for (int rep = 0; rep < 6; rep++) /* each scan loads and releases this thread's tiles */
        kvt__recall_scan_cpu(&a, scratch);
    free(scratch);
    return j;
}

/* The 8-bit scan from 4 threads at once (at level 3 where the CPU has it: each thread its own
 * tile configuration, the threads racing to ask for the permission first) fires the per-element
 * functions' rows in every thread, with a cap that overflows and without. */
Test(recall_scan, q8_scans_in_threads) {
    enum { T = 4 };
    const uint32_t H = 43, N = 384;
    tu_rng g = {0x9e3a000u};
    scen s;
    scen_make(&s, &g, N, 64, KVT__DT_BF16);
    scen_q8(&s);
    s.n_head = 100;
    float *q = malloc(sizeof(float) * QD * H), best[43];
    uint8_t ref[384];
    cr_assert(q);
    make_queries(&g, &s, H, q);
    for (uint32_t h = 0; h < H; h++)
        best[h] = (float)(tu_normal(&g) * 2.0);
    const uint32_t k8 = reference8(&s, q, best, H, SMAX, 1.0f, KVT__RECALL_CONFORMAL, ref, NULL);
    cr_assert(k8 > 2, "the scenario fires %u rows", k8);
    const size_t nh = s.n_head;
    for (int capped = 0; capped < 2; capped++) {
        const uint32_t cap = capped ? k8 / 2u : N;
        kvt__recall_scan_args a = {.latent_dim = D, .branch_dim = BD,
                                   .csk = s.csk + nh * s.csk_stride, .rho = s.rho + nh,
                                   .csk_head = s.csk, .rho_head = s.rho, .n_head = nh,
                                   .csk_stride = s.csk_stride, .basis = s.V, .rank = s.rank,
                                   .n_closed = N, .sinks = s.sinks, .kept = s.kept, .m = s.m,
                                   .q = q, .best = best, .n_heads = H, .scale = SMAX, .z = 1.0f,
                                   .mode = KVT__RECALL_CONFORMAL, .cap = cap, .q8_off = s.q8};
        q8_job jobs[T];
        pthread_t th[T];
        for (int t = 0; t < T; t++) {
            jobs[t] = (q8_job){.a = &a, .fired = calloc(N, sizeof(uint32_t))};
            cr_assert(jobs[t].fired);
            cr_assert_eq(pthread_create(&th[t], NULL, q8_job_main, &jobs[t]), 0);
        }
        for (int t = 0; t < T; t++) {
            void *r = NULL;
            cr_assert_eq(pthread_join(th[t], &r), 0);
            cr_assert(r == &jobs[t], "thread %d had no scratch", t);
            const q8_job *j = &jobs[t];
            cr_assert_eq(j->overflow, k8 > cap ? 1u : 0u, "thread %d (level %d)", t, j->level);
            cr_assert_eq(j->n_fired, k8 < cap ? k8 : cap, "thread %d (level %d)", t, j->level);
            uint32_t i = 0;
            for (uint32_t row = 0; row < N && i < j->n_fired; row++)
                if (ref[row])
                    cr_assert_eq(j->fired[i++], row, "thread %d (level %d)", t, j->level);
            free(jobs[t].fired);
        }
        if (jobs[0].level < 3)
            cr_log_info("q8 threads: level 3 (AMX) is not available here: the threads ran level %d",
                        jobs[0].level);
    }
    free(q);
    scen_free(&s);
}

/* KVT_NO_AMX=1 keeps the process off the AMX tiles: the 8-bit scan's level is at most 2 (each
 * Criterion test runs in its own process, so this one asks first). */
Test(recall_scan, q8_no_amx_env) {
    cr_assert_eq(setenv("KVT_NO_AMX", "1", 1), 0);
    const int level = kvt__recall_scan_q8_level(-1);
    cr_assert_leq(level, 2, "KVT_NO_AMX=1, yet the 8-bit scan runs level %d", level);
    cr_log_info("q8: with KVT_NO_AMX=1 the 8-bit scan runs level %d", level);
}

/* The sound mode stays sound at 8 bits: every archived row whose exact score reaches its head's
 * threshold (the best attended score, and the best archived score itself) fires, with rows at the
 * quantisation's edges in every other scenario. */
Test(recall_scan, q8_sound_never_misses) {
    rig r;
    rig_open(&r);
    const uint32_t H = 8, N = 256, CONFIGS = 24, STEPS = 12;
    const float z = sqrtf((float)(D - 64u));
    uint64_t must_fire = 0, fired = 0, arch = 0;
    float *q = malloc(sizeof(float) * QD * H);
    float best[8], top[8];
    float *ex = malloc(sizeof(float) * H * N);
    cr_assert(q && ex);
    for (uint32_t c = 0; c < CONFIGS; c++) {
        uint64_t seed = 0x5ca8000u + c;
        tu_rng g = {seed};
        static const uint32_t ranks[] = {0, 1, 8, 64, 64, 128};
        scen s;
        scen_make(&s, &g, N, ranks[c % 6], c % 2 ? KVT__DT_BF16 : KVT__DT_FP32);
        if (c % 2)
            scen_edges(&s, &g);
        scen_q8(&s);
        for (uint32_t st = 0; st < STEPS; st++) {
            make_queries(&g, &s, H, q);
            for (uint32_t h = 0; h < H; h++) {
                best[h] = top[h] = -INFINITY;
                for (uint32_t row = 0; row < N; row++) {
                    float e = ex[(size_t)h * N + row] = exact(&s, q + (size_t)h * QD, row, SMAX);
                    if (!isfinite(e))
                        continue;
                    if (archived(&s, row))
                        top[h] = e > top[h] ? e : top[h];
                    else
                        best[h] = e > best[h] ? e : best[h];
                }
            }
            for (int pass = 0; pass < 2; pass++) {
                const float *thr = pass ? top : best;
                scan_out o;
                cr_assert_eq(run_scan(&r.cpu, &s, q, thr, H, SMAX, z, KVT__RECALL_SOUND, N, &o),
                             KVT_OK);
                uint8_t got[256] = {0};
                for (uint32_t i = 0; i < o.n_fired; i++)
                    got[o.fired[i]] = 1;
                for (uint32_t row = 0; row < N; row++) {
                    if (!archived(&s, row))
                        continue;
                    arch++;
                    for (uint32_t h = 0; h < H; h++)
                        if (ex[(size_t)h * N + row] >= thr[h]) {
                            must_fire++;
                            cr_assert(got[row],
                                      "seed %llx step %u head %u: row %u scores %g >= %g but "
                                      "did not fire (8-bit)",
                                      (unsigned long long)seed, st, h, row,
                                      ex[(size_t)h * N + row], thr[h]);
                        }
                }
                fired += o.n_fired;
                free(o.fired);
            }
        }
        scen_free(&s);
    }
    cr_assert(must_fire > 0);
    cr_log_info("recall_scan q8 sound: %llu (row, head) pairs at or above threshold, all fired; "
                "firing rate %.4f",
                (unsigned long long)must_fire, (double)fired / (double)arch);
    free(q);
    free(ex);
    rig_close(&r);
}

/* Sketch values at the quantisation's edges (fp16 bits), per row kind: all zero, subnormal only
 * (a subnormal max: 127/max overflows, 0·Inf is NaN), the largest finite fp16, half-steps of the
 * scale, one Inf, one NaN; kinds 6 and 7 leave the sketch as it is. */
static void edge_sketch(tu_rng *g, uint16_t *c, uint32_t W) {
    const uint32_t kind = (uint32_t)(tu_next(g) % 8);
    const float m = (float)(0.25 + tu_uniform(g) * 8.0);
    for (uint32_t k = 0; k < W && kind < 6; k++) {
        const uint16_t sg = tu_next(g) % 2 ? 0x8000u : 0u;
        if (kind == 0)
            c[k] = sg;
        else if (kind == 1)
            c[k] = (uint16_t)(sg | (tu_next(g) % 0x400u));
        else if (kind == 2)
            c[k] = (uint16_t)(sg | (k == 0 ? 0x7bffu : (uint16_t)(tu_next(g) % 0x7c00u)));
        else if (kind == 3)
            c[k] =
                (uint16_t)(sg | kvt__f32_to_f16(
                                    k == 0 ? m : m * ((float)(tu_next(g) % 127) + 0.5f) / 127.0f));
        else if (k == 0)
            c[k] = kind == 4 ? 0x7c00u : 0x7e01u;
    }
}

/* kvt__recall_q8_rows_cpu at every SIMD level writes kvt__recall_q8_row's bytes: on the edge rows
 * of the q8 tests (half-steps, a spike, zero, subnormal and huge branches; zero, subnormal,
 * largest, Inf and NaN sketches), for bf16, fp16 and fp32 rows and sketch widths that take the
 * AVX-512 path, the AVX2 one and the per-row one; nothing written past a row's plane. */
Test(recall_scan, q8_rows_simd_equal_per_row) {
    static const uint32_t widths[] = {64, 48, 128, 40, 8, 66, 16, 32};
    static const int dts[] = {KVT__DT_BF16, KVT__DT_FP16, KVT__DT_FP32};
    const uint32_t N = 160, G = 8; /* G guard words after each row */
    const int cpu = kvt__recall_q8_rows_level(-1);
    uint64_t rows_at[3] = {0, 0, 0};
    for (uint32_t c = 0; c < 24; c++) {
        const uint64_t seed = 0x9d70000u + c;
        tu_rng g = {seed};
        scen s;
        scen_make(&s, &g, N, 64, dts[c % 3]);
        if (c % 4 != 3)
            scen_edges(&s, &g);
        const uint32_t W = widths[c % 8], S = W + kvt__recall_q8_words(BD, W) + G;
        const uint32_t elt = s.dtype == KVT__DT_FP32 ? 4 : 2;
        uint16_t *ref = calloc((size_t)N * S, 2), *got = malloc((size_t)N * S * 2);
        int32_t *slots = malloc(sizeof(int32_t) * N);
        float *tmp = malloc(sizeof(float) * kvt__recall_q8_rows_scratch_floats(BD, W));
        cr_assert(ref && got && slots && tmp);
        for (uint32_t row = 0; row < N; row++) {
            uint16_t *r = ref + (size_t)row * S;
            for (uint32_t k = 0; k < W; k++)
                r[k] = k < s.csk_stride ? s.csk[(size_t)row * s.csk_stride + k] : 0u;
            if (c % 4 != 3)
                edge_sketch(&g, r, W);
            for (uint32_t k = S - G; k < S; k++)
                r[k] = 0xa5a5u;
            slots[row] = kvt__page_slot(s.pages, 0, &s.pdiv, row);
        }
        memcpy(got, ref, (size_t)N * S * 2);
        for (uint32_t row = 0; row < N; row++) {
            uint16_t *r = ref + (size_t)row * S;
            kvt__recall_q8_row(row_at(&s, row), D * elt, s.dtype, BD, r, W, tmp,
                               (uint8_t *)(r + W));
        }
        for (int lv = 2; lv >= 0; lv--) {
            uint16_t *o = malloc((size_t)N * S * 2);
            cr_assert(o);
            memcpy(o, got, (size_t)N * S * 2);
            kvt__recall_q8_rows_level(lv);
            kvt__recall_q8_rows_cpu(s.pool, slots, N, s.stride, D * elt, s.dtype, BD, o, S, W, tmp);
            kvt__recall_q8_rows_level(2);
            for (uint32_t row = 0; row < N; row++)
                cr_assert(!memcmp(o + (size_t)row * S, ref + (size_t)row * S, 2u * S),
                          "seed %llx: level %d (CPU %d), width %u, dtype %d: row %u's plane "
                          "differs from kvt__recall_q8_row's (or a guard word was written)",
                          (unsigned long long)seed, lv, cpu, W, s.dtype, row);
            const int eff = lv < cpu ? lv : cpu;
            rows_at[eff == 2 && W % 16u ? 1 : W % 8u ? 0 : eff] += N;
            free(o);
        }
        free(ref);
        free(got);
        free(slots);
        free(tmp);
        scen_free(&s);
    }
    cr_log_info("q8 rows: planes equal to kvt__recall_q8_row's: %llu rows per row, %llu by AVX2, "
                "%llu by AVX-512 (CPU level %d)",
                (unsigned long long)rows_at[0], (unsigned long long)rows_at[1],
                (unsigned long long)rows_at[2], cpu);
    cr_assert(cpu < 1 || rows_at[1] > 0);
    cr_assert(cpu < 2 || rows_at[2] > 0);
}

/* The close's op (sketch_rows with q8_off) writes the fp16 sketch and ρ as without it, and the
 * 8-bit plane kvt__recall_q8_row computes from them. */
Test(recall_scan, q8_planes_from_the_close) {
    rig r;
    rig_open(&r);
    tu_rng g = {0x9c10u};
    scen s;
    scen_make(&s, &g, 64, 64, KVT__DT_BF16);
    scen_edges(&s, &g);
    scen q;
    memcpy(&q, &s, sizeof q);
    q.csk = malloc(2u * s.N * s.csk_stride);
    cr_assert(q.csk);
    memcpy(q.csk, s.csk, 2u * s.N * s.csk_stride);
    scen_q8(&q);
    const uint32_t S = q.csk_stride, W = q.q8;
    for (int b = 0; b < 2; b++) {
        const kvt__backend *be = b ? &r.guarded : &r.cpu;
        kvt__sketch_args a = {.base = dev(be, s.pool, s.stride * s.N),
                              .pages = dev(be, s.pages, sizeof(int32_t) * (s.N / PR)),
                              .pdiv = &s.pdiv,
                              .first_row = 0,
                              .n_rows = s.N,
                              .slot_stride = s.stride,
                              .dtype = s.dtype,
                              .latent_dim = D,
                              .basis = dev(be, s.V, sizeof(float) * s.rank * D),
                              .rank = s.rank,
                              .csk_stride = S,
                              .csk = dev(be, NULL, 2u * s.N * S),
                              .rho = dev(be, NULL, sizeof(float) * s.N),
                              .q8_off = W,
                              .branch_offset = D * 2u,
                              .branch_dtype = s.dtype,
                              .branch_dim = BD};
        cr_assert_eq(be->ops->sketch_rows(be, &a, 1, NULL), KVT_OK);
        uint16_t *c = malloc(2u * s.N * S);
        float *rho = malloc(sizeof(float) * s.N);
        cr_assert(c && rho);
        cr_assert_eq(be->ops->read(be, c, a.csk, 2u * s.N * S, NULL), KVT_OK);
        cr_assert_eq(be->ops->read(be, rho, a.rho, sizeof(float) * s.N, NULL), KVT_OK);
        cr_assert_eq(memcmp(c, q.csk, 2u * s.N * S), 0);
        cr_assert_eq(memcmp(rho, s.rho, sizeof(float) * s.N), 0);
        /* a stride that does not fit the plane is refused */
        a.csk_stride = S - 1;
        cr_assert_eq(be->ops->sketch_rows(be, &a, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        be->ops->buf_free(be, (void *)a.base, s.stride * s.N);
        be->ops->buf_free(be, (void *)a.pages, sizeof(int32_t) * (s.N / PR));
        be->ops->buf_free(be, (void *)a.basis, sizeof(float) * s.rank * D);
        be->ops->buf_free(be, a.csk, 2u * s.N * S);
        be->ops->buf_free(be, a.rho, sizeof(float) * s.N);
        free(c);
        free(rho);
    }
    free(q.csk);
    scen_free(&s);
    rig_close(&r);
}
