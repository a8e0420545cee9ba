/*
 * test_recall_prune.c — the pruned recall scan (recall/kernels/recall_group.h): its fired rows,
 * count and overflow flag are IDENTICAL to the full scan's (kvt__recall_scan_cpu) over thousands of
 * randomized steps (no basis and ranks 1..128, clustered, near-identical, in/near/far from span
 * V and needle rows, heads in span V or aimed at a needle, both modes, thresholds from attended
 * rows and adversarial thresholds exactly at a row's trigger value, caps below the fired count);
 * and the group build: every row in exactly one group of 32..64, the radius and centre-norm
 * really bound (in double), the extremes exact, the planes a function of the rows alone
 * (scratch contents and the page table's order change no bit). Seeds are fixed and printed on
 * failure.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "recall/kernels/recall_group.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"
#include "support/testutil.h"

#define D 512u
#define BD 64u
#define QD (D + BD)
#define PR 16u
#define SC 0.072168784f /* 192^-1/2 */

/* A (request, layer): nb closed blocks of B rows plus `tail` closed rows past them, behind a
 * shuffled page table, their sketches and groups, sinks and a kept set. */
typedef struct lay {
    uint32_t N, B, nb, tail, rank, cs, dim, sinks, m;
    uint32_t q8; /* the 8-bit scan's planes: their offset in a sketch row (0: 16-bit only) */
    int dt;
    size_t stride;
    uint8_t *pool;
    int32_t *pages, *slots;
    kvt__div32 pdiv;
    float *V, *rho;
    uint16_t *csk;
    uint32_t *kept;
    uint8_t *is_kept;
    uint32_t *perm, *ng, *end;
    float *centre, *stat;
} lay;

static uint8_t *row_of(const lay *l, uint32_t row) {
    return l->pool + (size_t)l->slots[row] * l->stride;
}

static uint32_t elt(const lay *l) {
    return l->dt == KVT__DT_FP32 ? 4u : 2u;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    cr_assert(p);
    return p;
}

static kvt__recall_group_block block_planes(const lay *l, uint32_t b) {
    const uint32_t G = kvt__recall_group_slots(l->B);
    return (kvt__recall_group_block){.perm = l->perm + (size_t)b * l->B,
                                     .n_groups = l->ng + b,
                                     .end = l->end + (size_t)b * G,
                                     .centre = l->centre + (size_t)b * G * l->dim,
                                     .stat = l->stat + (size_t)b * G * KVT__RG_STATS};
}

/* The 8-bit planes the next lay_make writes (the fp16 sketch's width: tests of the 8-bit scan
 * set it, 0 for the 16-bit tests). */
static bool q8_mode;

/* Row r's 8-bit plane from its branch and fp16 sketch (kvt__recall_q8_row, as the close). */
static void q8_plane_of(const lay *l, uint32_t r) {
    if (!l->q8)
        return;
    float tmp[BD + KVT__SKETCH_MAX_RANK];
    uint16_t *c = l->csk + (size_t)r * l->cs;
    kvt__recall_q8_row(row_of(l, r), D * elt(l), l->dt, BD, c, l->q8, tmp, (uint8_t *)(c + l->q8));
}

/* Build block b's groups (slots from the layer's table). fill: the scratch's bytes before. */
static void build_block(const lay *l, uint32_t b, int fill) {
    size_t sb = kvt__recall_group_scratch_bytes(l->B, BD, l->rank);
    void *scratch = xmalloc(sb);
    memset(scratch, fill, sb);
    kvt__recall_group_block o = block_planes(l, b);
    kvt__recall_group_block_cpu(l->pool, l->slots + (size_t)b * l->B, l->B, l->stride, D * elt(l),
                                l->dt, BD, l->csk + (size_t)b * l->B * l->cs, l->cs,
                                l->rho + (size_t)b * l->B, l->rank, l->dim, scratch, &o);
    free(scratch);
}

/* Rows: K clusters (a latent a·V plus an off-span part of scale off, a random branch), members
 * = centre + noise·N(0,1); among them near-identical copies of earlier rows (5%), needles (large,
 * random), far rows (random) and large ones (0.5% each). K = 0: every row independent. */
static void lay_make_x(lay *l, tu_rng *g, uint32_t B, uint32_t nb, uint32_t tail,
                       uint32_t rank, int dt, uint32_t K, double noise, double off, bool outliers) {
    memset(l, 0, sizeof *l);
    l->B = B;
    l->nb = nb;
    l->tail = tail;
    l->N = nb * B + tail;
    l->rank = rank;
    l->cs = rank ? rank + (uint32_t)(tu_next(g) % 3) : 1;
    if (q8_mode) { /* the fp16 width, then the plane (entries from rank on 0, as the close) */
        l->q8 = l->cs;
        l->cs = l->q8 + kvt__recall_q8_words(BD, l->q8);
    }
    l->dim = BD + rank + (uint32_t)(tu_next(g) % 2) * 5; /* a stride past the embedding */
    l->dt = dt;
    l->stride = (size_t)QD * (dt == KVT__DT_FP32 ? 4 : 2);
    const uint32_t np = (l->N + PR - 1) / PR, N = np * PR, G = kvt__recall_group_slots(B);
    l->pool = calloc(N, l->stride);
    l->pages = xmalloc(sizeof(int32_t) * np);
    l->slots = xmalloc(sizeof(int32_t) * N);
    l->pdiv = kvt__div32_make(PR);
    l->V = rank ? xmalloc(sizeof(float) * rank * D) : NULL;
    l->csk = xmalloc(sizeof(uint16_t) * l->N * l->cs);
    l->rho = xmalloc(sizeof(float) * l->N);
    l->is_kept = calloc(l->N, 1);
    l->perm = xmalloc(sizeof(uint32_t) * nb * B);
    l->ng = xmalloc(sizeof(uint32_t) * (nb + 1));
    l->end = xmalloc(sizeof(uint32_t) * nb * G);
    l->centre = xmalloc(sizeof(float) * nb * G * l->dim);
    l->stat = xmalloc(sizeof(float) * nb * G * KVT__RG_STATS);
    cr_assert(l->pool && l->is_kept);
    if (rank)
        cr_assert(tu_orthonormal_rows(g, rank, D, l->V));
    for (uint32_t p = 0; p < np; p++)
        l->pages[p] = (int32_t)p;
    for (uint32_t p = np - 1; p > 0; p--) {
        uint32_t j = (uint32_t)(tu_next(g) % (p + 1));
        int32_t t = l->pages[p];
        l->pages[p] = l->pages[j];
        l->pages[j] = t;
    }
    for (uint32_t r = 0; r < l->N; r++)
        l->slots[r] = kvt__page_slot(l->pages, 0, &l->pdiv, r);
    /* cluster centres [K][QD] */
    uint32_t Kc = K ? K : 1;
    float *cen = xmalloc(sizeof(float) * Kc * QD);
    for (uint32_t k = 0; k < Kc; k++) {
        float *c = cen + (size_t)k * QD;
        for (uint32_t d = 0; d < QD; d++)
            c[d] = (float)(tu_normal(g) * (d < D ? off : 1.0));
        for (uint32_t j = 0; rank && j < rank; j++) {
            float a = (float)(3.0 * tu_normal(g));
            for (uint32_t d = 0; d < D; d++)
                c[d] += a * l->V[(size_t)j * D + d];
        }
    }
    for (uint32_t r = 0; r < l->N; r++) {
        uint8_t *p = row_of(l, r);
        /* 5% copies, 0.5% each needles, far and large rows */
        uint32_t u = (uint32_t)(tu_next(g) % 200), kind = u < 10 ? 0 : u < 13 ? u - 9 : 4;
        if (!outliers && kind != 0)
            kind = 4;
        if (kind == 0 && r > 0) {
            const uint8_t *q = row_of(l, (uint32_t)(tu_next(g) % r));
            for (uint32_t i = 0; i < QD; i++)
                kvt__store_elem(p, dt, i,
                                kvt__load_elem(q, dt, i) * (1.0f + 1e-6f * (float)tu_normal(g)));
            continue;
        }
        double big = kind == 1 ? 4.0 + 6.0 * tu_uniform(g) : kind == 3 ? 300.0 : 1.0;
        const float *c = cen + (size_t)(tu_next(g) % Kc) * QD;
        for (uint32_t i = 0; i < QD; i++) {
            double v = K == 0 || kind == 1 || kind == 2 ? tu_normal(g) * big
                                                        : c[i] * big + noise * tu_normal(g);
            kvt__store_elem(p, dt, i, (float)v);
        }
    }
    free(cen);
    float *scratch = xmalloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    kvt__sketch_rows_cpu(l->pool, l->slots, l->N, l->stride, dt, D, l->V, rank, l->cs, scratch,
                         l->csk, l->rho);
    free(scratch);
    for (uint32_t r = 0; r < l->N; r++)
        q8_plane_of(l, r);
    l->sinks = (uint32_t)(tu_next(g) % 9);
    l->m = l->N / 8;
    l->kept = xmalloc(sizeof(uint32_t) * (l->m + 1));
    for (uint32_t got = 0; got < l->m;) {
        uint32_t r = (uint32_t)(tu_next(g) % l->N);
        if (!l->is_kept[r]) {
            l->is_kept[r] = 1;
            got++;
        }
    }
    for (uint32_t r = 0, got = 0; r < l->N; r++)
        if (l->is_kept[r])
            l->kept[got++] = r;
    for (uint32_t b = 0; b < nb; b++)
        build_block(l, b, 0x5a);
}

static void lay_make(lay *l, tu_rng *g, uint32_t B, uint32_t nb, uint32_t tail, uint32_t rank,
                     int dt, uint32_t K, double noise, double off) {
    lay_make_x(l, g, B, nb, tail, rank, dt, K, noise, off, true);
}

static void lay_free(lay *l) {
    free(l->pool);
    free(l->pages);
    free(l->slots);
    free(l->V);
    free(l->csk);
    free(l->rho);
    free(l->kept);
    free(l->is_kept);
    free(l->perm);
    free(l->ng);
    free(l->end);
    free(l->centre);
    free(l->stat);
}

static bool archived(const lay *l, uint32_t r) {
    return r >= l->sinks && !l->is_kept[r];
}

static kvt__recall_scan_args scan_args(const lay *l, const float *q, const float *best,
                                       uint32_t H, float z, int mode, uint32_t cap,
                                       uint32_t *fired, uint32_t *nf, uint32_t *ov) {
    return (kvt__recall_scan_args){.base = l->pool,
                                   .pages = l->pages,
                                   .pdiv = &l->pdiv,
                                   .slot_stride = l->stride,
                                   .dtype = l->dt,
                                   .latent_dim = D,
                                   .branch_offset = D * elt(l),
                                   .branch_dtype = l->dt,
                                   .branch_dim = BD,
                                   .csk = l->csk,
                                   .rho = l->rho,
                                   .csk_stride = l->cs,
                                   .q8_off = l->q8,
                                   .basis = l->V,
                                   .rank = l->rank,
                                   .n_closed = l->N,
                                   .sinks = l->sinks,
                                   .kept = l->kept,
                                   .m = l->m,
                                   .q = q,
                                   .best = best,
                                   .n_heads = H,
                                   .scale = SC,
                                   .z = z,
                                   .mode = mode,
                                   .cap = cap,
                                   .fired = fired,
                                   .n_fired = nf,
                                   .overflow = ov};
}

static kvt__recall_groups groups_of(const lay *l) {
    return (kvt__recall_groups){.block_rows = l->B,
                                .n_blocks = l->nb,
                                .dim = l->dim,
                                .perm = l->perm,
                                .n_groups = l->ng,
                                .end = l->end,
                                .centre = l->centre,
                                .stat = l->stat};
}

/* Full and pruned scans of one step; asserts identical outputs. Returns the full scan's count. */
typedef struct totals {
    uint64_t steps, fired_steps, capped, archived, visited, groups, groups_visited, skipped_fired;
} totals;

static uint32_t compare(const lay *l, const float *q, const float *best, uint32_t H, float z,
                        int mode, uint32_t cap, totals *t, uint64_t seed, const char *what) {
    uint32_t *f1 = xmalloc(sizeof(uint32_t) * (cap + 1)), *f2 = xmalloc(sizeof(uint32_t) * (cap + 1));
    uint32_t n1 = 7, o1 = 7, n2 = 9, o2 = 9;
    kvt__recall_scan_args a1 = scan_args(l, q, best, H, z, mode, cap, f1, &n1, &o1);
    kvt__recall_scan_args a2 = scan_args(l, q, best, H, z, mode, cap, f2, &n2, &o2);
    kvt__recall_groups g = groups_of(l);
    cr_assert(kvt__recall_groups_ok(&a2, &g));
    float *s1 = xmalloc(sizeof(float) * kvt__recall_scan_scratch_floats(H, l->rank, D));
    void *s2 = xmalloc(kvt__recall_scan_pruned_scratch_bytes(H, l->rank, D, l->N));
    kvt__recall_scan_cpu(&a1, s1);
    kvt__recall_prune_stats st;
    kvt__recall_scan_pruned_cpu(&a2, &g, s2, &st);
    cr_assert_eq(n2, n1, "seed %llx (%s, rank %u, mode %d, z %g, cap %u): pruned %u fired, full %u",
                 (unsigned long long)seed, what, l->rank, mode, (double)z, cap, n2, n1);
    cr_assert_eq(o2, o1, "seed %llx (%s): overflow %u vs %u", (unsigned long long)seed, what, o2,
                 o1);
    cr_assert_eq(memcmp(f1, f2, sizeof(uint32_t) * n1), 0, "seed %llx (%s): fired rows differ",
                 (unsigned long long)seed, what);
    uint64_t arch = 0;
    for (uint32_t r = 0; r < l->N; r++)
        arch += archived(l, r);
    cr_assert_eq(st.archived, arch);
    cr_assert(st.visited <= arch);
    t->steps++;
    t->fired_steps += n1 > 0;
    t->capped += o1;
    t->archived += arch;
    t->visited += st.visited;
    t->groups += st.groups;
    t->groups_visited += st.groups_visited;
    if (n1 && st.groups_visited < st.groups)
        t->skipped_fired++;
    free(f1);
    free(f2);
    free(s1);
    free(s2);
    return n1 + o1;
}

/* Queries: random, in span V, or aimed at a row (its latent and branch, scaled, plus noise). */
static void make_queries(tu_rng *g, const lay *l, uint32_t H, float *q) {
    for (uint32_t h = 0; h < H; h++) {
        float *qh = q + (size_t)h * QD;
        uint32_t kind = (uint32_t)(tu_next(g) % 4);
        double mag = tu_next(g) % 7 == 0 ? 40.0 : 1.0;
        if (kind == 0) { /* aimed at a row */
            const uint8_t *r = row_of(l, (uint32_t)(tu_next(g) % l->N));
            double a = (0.2 + tu_uniform(g)) * mag;
            for (uint32_t i = 0; i < QD; i++)
                qh[i] = (float)(a * kvt__load_elem(r, l->dt, i) + 0.05 * tu_normal(g));
            continue;
        }
        double in = kind == 1 ? 1.0 : tu_uniform(g);
        for (uint32_t i = 0; i < QD; i++)
            qh[i] = (float)(tu_normal(g) * mag * (i < D ? (1.0 - in) * 0.3 : 1.0));
        if (kind == 1 && l->rank == 0)
            for (uint32_t d = 0; d < D; d++)
                qh[d] = (float)(tu_normal(g) * mag);
        for (uint32_t k = 0; k < l->rank; k++) {
            float a = (float)(tu_normal(g) * in * mag);
            for (uint32_t d = 0; d < D; d++)
                qh[d] += a * l->V[(size_t)k * D + d];
        }
    }
}

/* The trigger's left-hand side of (row, head) as the per-element functions compute it (the
 * 8-bit one's where the layer has planes: kvt__recall_q8_fires' sums). */
static float lhs(const lay *l, const float *qh, uint32_t row, float z, int mode) {
    float *qsk = xmalloc(sizeof(float) * (l->rank + 1)), tmp[D], P, nc;
    kvt__recall_head hd;
    kvt__recall_head_prep(qh, D, l->V, l->rank, qsk, tmp, &hd);
    if (l->q8) {
        uint8_t v[BD + KVT__SKETCH_MAX_RANK + 4];
        kvt__recall_q8h h8;
        kvt__recall_q8_head(qh, D, BD, qsk, l->rank, l->q8, tmp, v, &h8);
        free(qsk);
        const uint8_t *pl = (const uint8_t *)(l->csk + (size_t)row * l->cs + l->q8);
        int32_t ib, is;
        kvt__recall_q8_dots(pl + 4u * KVT__Q8_FLOATS, v, BD, kvt__recall_q8_len(BD, l->q8), &ib,
                            &is);
        const float idx = kvt__recall_q8_idx(&h8, pl, ib, is, SC);
        const float B = kvt__recall_q8_bound(&h8, pl, SC);
        if (mode == KVT__RECALL_SOUND) {
            const float c8 = kvt__recall_q8_f(pl, 5) + kvt__recall_q8_f(pl, 4);
            const float P8 =
                h8.Qb * (kvt__recall_q8_f(pl, 3) + kvt__recall_q8_f(pl, 2)) + h8.Qs * c8;
            const float m = kvt__recall_sound_margin(&hd, fabsf(idx) + B, P8, c8, l->rho[row], SC,
                                                     z, D, BD, l->rank);
            return idx + (m + B) * (1.0f + 0.00390625f);
        }
        const float zc = z * kvt__recall_cert(&hd, l->rho[row], SC, D);
        return (idx + (B + 2.3841858e-7f * (fabsf(idx) + B + fabsf(zc)))) + zc;
    }
    float idx = kvt__recall_idx(qh, qsk, row_of(l, row), D, D * elt(l), l->dt, BD,
                                l->csk + (size_t)row * l->cs, l->rank, SC, &P, &nc);
    free(qsk);
    if (mode == KVT__RECALL_SOUND)
        return idx + kvt__recall_sound_margin(&hd, idx, P, nc, l->rho[row], SC, z, D, BD, l->rank);
    return idx + z * kvt__recall_cert(&hd, l->rho[row], SC, D);
}

static float exact(const lay *l, const float *qh, uint32_t row) {
    return kvt__recall_exact(qh, row_of(l, row), l->dt, D, D * elt(l), l->dt, BD, SC);
}

/* Thousands of steps: the pruned scan's output is the full scan's, bit for bit. */
static void identical_to_full_scan(uint32_t CONFIGS) {
    const uint32_t H = 8, STEPS = 8;
    float *q = xmalloc(sizeof(float) * QD * H), best[8];
    totals t = {0};
    for (uint32_t c = 0; c < CONFIGS; c++) {
        uint64_t seed = 0x9e0000u + c;
        tu_rng g = {seed};
        static const uint32_t ranks[] = {0, 1, 8, 64, 64, 128};
        static const uint32_t Bs[] = {64, 128, 256};
        static const uint32_t Ks[] = {0, 1, 3, 8, 24};
        static const double noises[] = {0.0, 1e-3, 0.03, 0.3};
        uint32_t rank = ranks[c % 6], B = Bs[(c / 6) % 3], K = Ks[(c / 2) % 5];
        uint32_t nb = 1 + (uint32_t)(tu_next(&g) % (B == 256 ? 3 : 5));
        uint32_t tail = tu_next(&g) % 3 ? (uint32_t)(tu_next(&g) % B) : 0;
        lay l;
        if (q8_mode) /* the members' evaluation at every SIMD level the CPU has (0: the
                      * per-element functions), the full scan's alike */
            kvt__recall_scan_q8_level((int)(c % 3));
        lay_make(&l, &g, B, nb, tail, rank, c % 2 ? KVT__DT_BF16 : KVT__DT_FP32, K,
                 noises[tu_next(&g) % 4], tu_next(&g) % 2 ? 0.0 : 0.02);
        for (uint32_t s = 0; s < STEPS; s++) {
            make_queries(&g, &l, H, q);
            int mode = tu_next(&g) % 3 == 0 ? KVT__RECALL_SOUND : KVT__RECALL_CONFORMAL;
            static const float zs[] = {-1.0f, 0.0f, 0.5f, 2.0f, 8.0f};
            float z = mode == KVT__RECALL_SOUND ? (tu_next(&g) % 4 ? sqrtf(448.0f) : 30.0f)
                                                : zs[tu_next(&g) % 5];
            /* thresholds: the best attended exact score; the best archived one (every other
             * step: the exact scores of every row are the test's main cost) */
            const bool all = s % 2 == 0;
            float att[8], top[8];
            for (uint32_t h = 0; h < H; h++) {
                att[h] = top[h] = -INFINITY;
                for (uint32_t r = 0; r < l.N; r++) {
                    if (!all && archived(&l, r))
                        continue;
                    float e = exact(&l, q + (size_t)h * QD, r);
                    if (archived(&l, r))
                        top[h] = e > top[h] ? e : top[h];
                    else
                        att[h] = e > att[h] ? e : att[h];
                }
                if (!all)
                    top[h] = att[h] + 1.0f;
            }
            for (int v = 0; v < 4; v++) {
                const char *what = "attended";
                for (uint32_t h = 0; h < H; h++)
                    best[h] = v == 0 ? att[h] : top[h];
                if (v == 1)
                    what = all ? "best archived" : "attended + 1";
                if (v == 2) { /* adversarial: one head's threshold exactly at a row's trigger
                               * value (or one ulp either side); the others can hardly fire */
                    what = "at a row's trigger value";
                    uint32_t r = (uint32_t)(tu_next(&g) % l.N), h0 = (uint32_t)(tu_next(&g) % H);
                    while (!archived(&l, r))
                        r = (r + 1) % l.N;
                    for (uint32_t h = 0; h < H; h++)
                        best[h] = tu_next(&g) % 2 ? INFINITY : top[h] + fabsf(top[h]);
                    float x = lhs(&l, q + (size_t)h0 * QD, r, z, mode);
                    uint32_t w = (uint32_t)(tu_next(&g) % 3);
                    best[h0] = w == 0 ? x : w == 1 ? nextafterf(x, INFINITY) : nextafterf(x, -INFINITY);
                }
                if (v == 3) { /* a mix: ±Inf, NaN, random */
                    what = "mixed";
                    for (uint32_t h = 0; h < H; h++) {
                        uint32_t w = (uint32_t)(tu_next(&g) % 8);
                        best[h] = w == 0 ? -INFINITY : w == 1 ? INFINITY : w == 2 ? NAN
                                                                        : att[h] + (float)tu_normal(&g);
                    }
                }
                uint32_t k = compare(&l, q, best, H, z, mode, l.N, &t, seed, what);
                /* caps below, at and above the fired count */
                if (k > 1) {
                    compare(&l, q, best, H, z, mode, k / 2, &t, seed, what);
                    compare(&l, q, best, H, z, mode, k - 1, &t, seed, what);
                } else {
                    compare(&l, q, best, H, z, mode, 0, &t, seed, what);
                }
            }
        }
        lay_free(&l);
    }
    cr_log_info("recall_prune%s: %llu scans identical to the full scan (%llu with fired rows, "
                "%llu capped with overflow, %llu skipped groups while rows fired); visited "
                "%.3f of archived rows, %.3f of groups",
                q8_mode ? " (8-bit)" : "", (unsigned long long)t.steps, (unsigned long long)t.fired_steps,
                (unsigned long long)t.capped, (unsigned long long)t.skipped_fired,
                (double)t.visited / (double)t.archived,
                (double)t.groups_visited / (double)t.groups);
    /* the test must exercise the skip path, including steps where rows fired (random data with
     * thresholds this low fires whole clusters: most groups are visited, see the bench) */
    /* (at 8 bits the widened bound skips less: 4% of the groups, 181 steps that fired, when
     * written; the 16-bit bound 8% and 449) */
    cr_assert(t.groups_visited < t.groups - t.groups / (q8_mode ? 50 : 20),
              "visited %llu of %llu groups", (unsigned long long)t.groups_visited,
              (unsigned long long)t.groups);
    cr_assert(t.skipped_fired > (q8_mode ? 100 : 300) * CONFIGS / 42);
    cr_assert(t.capped > 100 * CONFIGS / 42);
    free(q);
}

Test(recall_prune, identical_to_full_scan) {
    identical_to_full_scan(42);
}

/* The 8-bit scan (docs/recall.md §3.2: the groups' bound widened by the planes' rounding,
 * kvt__recall_group_upper): the same scenarios, the pruned scan's output the full 8-bit scan's. */
Test(recall_prune, identical_to_full_scan_q8) {
    q8_mode = true;
    identical_to_full_scan(30);
}

/* Re-sketch row r and rebuild its block's groups (after its bytes changed). */
static void lay_touch(lay *l, uint32_t r) {
    float *scratch = xmalloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    kvt__sketch_rows_cpu(l->pool, l->slots + r, 1, l->stride, l->dt, D, l->V, l->rank, l->cs,
                         scratch, l->csk + (size_t)r * l->cs, l->rho + r);
    free(scratch);
    q8_plane_of(l, r);
    if (r < l->nb * l->B)
        build_block(l, r / l->B, 0);
}

/* Where pruning works: tight clusters of at least a group's size, thresholds the best attended score, and per step a few
 * "needle" rows planted along some heads' queries (they fire); one head's threshold exactly at a
 * needle's trigger value (or one ulp either side) while the others keep the attended one. Most
 * groups are skipped, and the outputs are still the full scan's. */
static void clustered_needles_identical(void) {
    /* two heads: with many, every cluster is some head's best (the union is what is skipped) */
    const uint32_t H = 2, CONFIGS = 16, STEPS = 12;
    float *q = xmalloc(sizeof(float) * QD * H), best[8], att[8];
    totals t = {0};
    for (uint32_t c = 0; c < CONFIGS; c++) {
        uint64_t seed = 0x7ee0u + c;
        tu_rng g = {seed};
        lay l;
        /* clusters of 64 rows or more a block (a group holds 32..64 rows), no outliers */
        uint32_t B = c % 2 ? 512 : 256;
        lay_make_x(&l, &g, B, 3, (uint32_t)(tu_next(&g) % 50), c % 3 ? 64 : 8,
                   c % 2 ? KVT__DT_BF16 : KVT__DT_FP32, 2 + (uint32_t)(tu_next(&g) % (B / 64 - 1)),
                   c % 4 ? 0.03 : 0.003, 0.02, false);
        for (uint32_t s = 0; s < STEPS; s++) {
            make_queries(&g, &l, H, q);
            uint32_t needle[2];
            for (uint32_t k = 0; k < 2; k++) { /* plant two needles along heads 0 and 1 */
                uint32_t r = (uint32_t)(tu_next(&g) % l.N);
                while (!archived(&l, r))
                    r = (r + 1) % l.N;
                needle[k] = r;
                const float *qh = q + (size_t)k * QD;
                double n2 = 0;
                for (uint32_t i = 0; i < QD; i++)
                    n2 += (double)qh[i] * qh[i];
                double a = (30.0 + 30.0 * tu_uniform(&g)) / sqrt(n2);
                for (uint32_t i = 0; i < QD; i++)
                    kvt__store_elem(row_of(&l, r), l.dt, i, (float)(a * qh[i]));
                lay_touch(&l, r);
            }
            for (uint32_t h = 0; h < H; h++) {
                att[h] = -INFINITY;
                for (uint32_t r = 0; r < l.N; r++)
                    if (!archived(&l, r)) {
                        float e = exact(&l, q + (size_t)h * QD, r);
                        att[h] = e > att[h] ? e : att[h];
                    }
            }
            for (int mode = 1; mode <= 2; mode++) {
                float z = mode == KVT__RECALL_SOUND ? sqrtf(448.0f) : (float)(4.0 * tu_uniform(&g));
                uint32_t k = compare(&l, q, att, H, z, mode, l.N, &t, seed, "clustered");
                if (k > 1)
                    compare(&l, q, att, H, z, mode, k / 2, &t, seed, "clustered, capped");
                for (uint32_t w = 0; w < 3; w++) { /* head 0 at its needle's trigger value */
                    memcpy(best, att, sizeof best);
                    float x = lhs(&l, q, needle[0], z, mode);
                    best[0] = w == 0 ? x : w == 1 ? nextafterf(x, INFINITY) : nextafterf(x, -INFINITY);
                    compare(&l, q, best, H, z, mode, l.N, &t, seed, "at a needle's trigger value");
                }
            }
        }
        lay_free(&l);
    }
    cr_log_info("recall_prune clustered%s: %llu scans identical to the full scan (%llu with fired "
                "rows, %llu of them with skipped groups); visited %.3f of archived rows, %.3f of "
                "groups",
                q8_mode ? " (8-bit)" : "", (unsigned long long)t.steps, (unsigned long long)t.fired_steps,
                (unsigned long long)t.skipped_fired, (double)t.visited / (double)t.archived,
                (double)t.groups_visited / (double)t.groups);
    cr_assert(t.skipped_fired > t.steps / 2);
    /* (at 8 bits 0.80 of the rows when written, the 16-bit bound 0.63) */
    cr_assert(t.visited < (q8_mode ? t.archived * 9 / 10 : t.archived * 3 / 4));
    free(q);
}

Test(recall_prune, clustered_needles_identical) {
    clustered_needles_identical();
}

/* The same at 8 bits: the widened bound still skips most of the clustered rows. */
Test(recall_prune, clustered_needles_identical_q8) {
    q8_mode = true;
    clustered_needles_identical();
}

/* Every row of a block in exactly one group of 32..64, groups in perm order; the centre is the
 * members' mean; radius and ‖centre‖ bound the real distances (double); ρ and ‖csk‖ extremes are
 * the members'. */
Test(recall_prune, groups_partition_and_bound) {
    uint64_t blocks = 0, groups = 0;
    double worst = 0.0; /* the largest real distance / stored radius */
    for (uint32_t c = 0; c < 24; c++) {
        uint64_t seed = 0x6a0u + c;
        tu_rng g = {seed};
        static const uint32_t Bs[] = {64, 128, 512, 1024};
        lay l;
        lay_make(&l, &g, Bs[c % 4], 2, 0, (uint32_t[]){0, 8, 64}[c % 3],
                 c % 2 ? KVT__DT_BF16 : KVT__DT_FP32, (uint32_t[]){0, 1, 5, 40}[(c / 3) % 4],
                 (double[]){0.0, 1e-4, 0.1}[c % 3], 0.0);
        const uint32_t n = BD + l.rank, G = kvt__recall_group_slots(l.B);
        for (uint32_t b = 0; b < l.nb; b++) {
            kvt__recall_group_block o = block_planes(&l, b);
            uint32_t ng = *o.n_groups, start = 0;
            cr_assert(ng >= l.B / 64 && ng <= G, "seed %llx: %u groups", (unsigned long long)seed, ng);
            uint8_t *seen = calloc(l.B, 1);
            for (uint32_t gi = 0; gi < ng; gi++) {
                uint32_t e = o.end[gi], cnt = e - start;
                cr_assert(e > start && cnt >= 32 && cnt <= 64, "seed %llx group %u: %u rows",
                          (unsigned long long)seed, gi, cnt);
                const float *cen = o.centre + (size_t)gi * l.dim, *st = o.stat + (size_t)gi * 5;
                double mean[BD + 128] = {0}, mabs[BD + 128] = {0}, nc = 0;
                float rmax = 0, rmin = INFINITY, nk = 0;
                for (uint32_t i = start; i < e; i++) {
                    uint32_t u = o.perm[i], row = b * l.B + u;
                    cr_assert(u < l.B && !seen[u], "seed %llx: row %u twice", (unsigned long long)seed, u);
                    seen[u] = 1;
                    double d2 = 0;
                    for (uint32_t j = 0; j < n; j++) {
                        double x = kvt__recall_embed(row_of(&l, row), D * elt(&l), l.dt, BD,
                                                     l.csk + (size_t)row * l.cs, j);
                        mean[j] += x / cnt;
                        mabs[j] += fabs(x) / cnt;
                        d2 += (x - cen[j]) * (x - cen[j]);
                    }
                    double r = sqrt(d2);
                    cr_assert(r <= st[KVT__RG_RADIUS], "seed %llx: distance %.9g > radius %.9g",
                              (unsigned long long)seed, r, (double)st[KVT__RG_RADIUS]);
                    if (st[KVT__RG_RADIUS] > 0)
                        worst = fmax(worst, r / st[KVT__RG_RADIUS]);
                    rmax = fmaxf(rmax, l.rho[row]);
                    rmin = fminf(rmin, l.rho[row]);
                    nk = fmaxf(nk, kvt__recall_csk_norm(l.csk + (size_t)row * l.cs, l.rank));
                }
                for (uint32_t j = 0; j < l.dim; j++) {
                    if (j < n)
                        cr_assert(fabs(cen[j] - mean[j]) <= 1e-5 * mabs[j]);
                    else
                        cr_assert_eq(cen[j], 0.0f);
                    nc += (double)cen[j] * cen[j];
                }
                cr_assert(sqrt(nc) <= st[KVT__RG_NCENTRE]);
                cr_assert(sqrt(nc) >= st[KVT__RG_NCENTRE] * (1 - 1e-3) - 1e-18);
                cr_assert_eq(st[KVT__RG_RHO_MAX], rmax);
                cr_assert_eq(st[KVT__RG_RHO_MIN], rmin);
                cr_assert_eq(st[KVT__RG_NCSK_MAX], nk);
                start = e;
                groups++;
            }
            cr_assert_eq(start, l.B);
            for (uint32_t u = 0; u < l.B; u++)
                cr_assert(seen[u]);
            free(seen);
            blocks++;
        }
        lay_free(&l);
    }
    cr_log_info("recall_group: %llu blocks, %llu groups; the largest real distance took %.6f "
                "of its group's radius",
                (unsigned long long)blocks, (unsigned long long)groups, worst);
}

/* The planes are a function of the rows: a rebuild over dirty scratch, and the same rows behind
 * a different page table (other slots), give the same bytes. Identical rows (every projection
 * tied) still split into valid groups. */
Test(recall_prune, build_deterministic) {
    for (uint32_t c = 0; c < 8; c++) {
        uint64_t seed = 0xde7u + c;
        tu_rng g = {seed};
        lay l;
        lay_make(&l, &g, c % 2 ? 256 : 128, 1, 0, c % 3 ? 16 : 0, KVT__DT_BF16, c < 4 ? 1 : 6,
                 c < 2 ? 0.0 : 0.05, 0.0);
        const uint32_t G = kvt__recall_group_slots(l.B);
        size_t pb = sizeof(uint32_t) * l.B, eb = sizeof(uint32_t) * G,
               cb = sizeof(float) * G * l.dim, sb = sizeof(float) * G * 5;
        uint32_t *perm = xmalloc(pb), *end = xmalloc(eb), ng = l.ng[0];
        float *cen = xmalloc(cb), *st = xmalloc(sb);
        memcpy(perm, l.perm, pb);
        memcpy(end, l.end, eb);
        memcpy(cen, l.centre, cb);
        memcpy(st, l.stat, sb);
        build_block(&l, 0, 0xff); /* dirty scratch: NaN patterns everywhere */
        cr_assert(l.ng[0] == ng && !memcmp(perm, l.perm, pb) && !memcmp(end, l.end, eb) &&
                      !memcmp(cen, l.centre, cb) && !memcmp(st, l.stat, sb),
                  "seed %llx: rebuild differs", (unsigned long long)seed);
        /* move every row to another slot (reverse the page table, copy the bytes) */
        uint8_t *pool2 = xmalloc(l.stride * l.B);
        int32_t *slots2 = xmalloc(sizeof(int32_t) * l.B);
        for (uint32_t r = 0; r < l.B; r++) {
            slots2[r] = (int32_t)(l.B - 1 - r);
            memcpy(pool2 + (size_t)slots2[r] * l.stride, row_of(&l, r), l.stride);
        }
        size_t sbytes = kvt__recall_group_scratch_bytes(l.B, BD, l.rank);
        void *scratch = xmalloc(sbytes);
        kvt__recall_group_block o = block_planes(&l, 0);
        kvt__recall_group_block_cpu(pool2, slots2, l.B, l.stride, D * 2, l.dt, BD, l.csk, l.cs,
                                    l.rho, l.rank, l.dim, scratch, &o);
        cr_assert(l.ng[0] == ng && !memcmp(perm, l.perm, pb) && !memcmp(end, l.end, eb) &&
                      !memcmp(cen, l.centre, cb) && !memcmp(st, l.stat, sb),
                  "seed %llx: other slots, other groups", (unsigned long long)seed);
        free(scratch);
        free(pool2);
        free(slots2);
        free(perm);
        free(end);
        free(cen);
        free(st);
        lay_free(&l);
    }
    /* every row identical: ties everywhere, still 32..64 per group and radius 0-ish */
    tu_rng g = {0x1de};
    lay l;
    lay_make(&l, &g, 512, 1, 0, 8, KVT__DT_FP32, 1, 0.0, 0.0);
    for (uint32_t r = 1; r < l.B; r++)
        memcpy(row_of(&l, r), row_of(&l, 0), l.stride);
    for (uint32_t r = 1; r < l.B; r++) {
        memcpy(l.csk + (size_t)r * l.cs, l.csk, 2 * l.cs);
        l.rho[r] = l.rho[0];
    }
    build_block(&l, 0, 0);
    cr_assert_eq(l.ng[0], 8); /* ties: every cut at the middle */
    for (uint32_t gi = 0; gi < 8; gi++) {
        cr_assert_eq(l.end[gi], 64 * (gi + 1));
        cr_assert(l.stat[gi * 5 + KVT__RG_RADIUS] < 1e-4f * (1.0f + l.stat[gi * 5 + KVT__RG_NCENTRE]));
    }
    lay_free(&l);
}

/* The build's AVX-512 chains (32 rows a gather) against the narrow loop: the same planes, byte for
 * byte, over clustered and random blocks, bf16 and fp32, ranks 0, 16 and 64, with ties (identical
 * rows). Where the CPU has no AVX-512 both builds run the narrow loop. */
Test(recall_prune, wide_build_equals_narrow_build) {
    const int had = kvt__recall_group_wide(-1);
    for (uint32_t c = 0; c < 6; c++) {
        tu_rng g = {0x31deu + c};
        lay l;
        lay_make(&l, &g, c % 2 ? 512 : 256, 1, 0, c % 3 == 0 ? 0 : (c % 3 == 1 ? 16 : 64),
                 c < 3 ? KVT__DT_BF16 : KVT__DT_FP32, c < 2 ? 1 : 6, c == 0 ? 0.0 : 0.05, 0.0);
        if (c == 5) /* ties: a run of identical rows */
            for (uint32_t r = 1; r < 100; r++) {
                memcpy(row_of(&l, r), row_of(&l, 0), l.stride);
                memcpy(l.csk + (size_t)r * l.cs, l.csk, 2 * l.cs);
                l.rho[r] = l.rho[0];
            }
        const uint32_t G = kvt__recall_group_slots(l.B);
        size_t pb = sizeof(uint32_t) * l.B, eb = sizeof(uint32_t) * G,
               cb = sizeof(float) * G * l.dim, sb = sizeof(float) * G * 5;
        kvt__recall_group_wide(0);
        build_block(&l, 0, 0);
        uint32_t *perm = xmalloc(pb), *end = xmalloc(eb), ng = l.ng[0];
        float *cen = xmalloc(cb), *st = xmalloc(sb);
        memcpy(perm, l.perm, pb);
        memcpy(end, l.end, eb);
        memcpy(cen, l.centre, cb);
        memcpy(st, l.stat, sb);
        kvt__recall_group_wide(1);
        build_block(&l, 0, 0xff);
        cr_assert(l.ng[0] == ng && !memcmp(perm, l.perm, pb) && !memcmp(end, l.end, eb) &&
                      !memcmp(cen, l.centre, cb) && !memcmp(st, l.stat, sb),
                  "case %u: the wide build differs", c);
        free(perm);
        free(end);
        free(cen);
        free(st);
        lay_free(&l);
    }
    /* the chains themselves, both paths, against the per-element functions: 77 rows of a
     * shuffled order (two full 32-row tiles and a tail), n = 128 and 37 */
    tu_rng g = {0x31ffu};
    const uint32_t rows = 77;
    for (uint32_t n = 37; n <= 128; n += 91) {
        float *X = xmalloc(sizeof(float) * rows * n), c[128], out[77];
        uint32_t perm[77];
        for (uint32_t i = 0; i < rows * n; i++)
            X[i] = (float)(tu_normal(&g) * (i % 3 ? 1.0 : 1e-3));
        for (uint32_t j = 0; j < n; j++)
            c[j] = (float)tu_normal(&g);
        for (uint32_t i = 0; i < rows; i++)
            perm[i] = (i * 31u + 5u) % rows;
        for (int wide = 0; wide < 2; wide++)
            for (int dot = 0; dot < 2; dot++) {
                kvt__recall_group_chains(X, n, perm, 3, rows, c, dot, wide, out);
                for (uint32_t i = 3; i < rows; i++) {
                    const float *x = X + (size_t)perm[i] * n;
                    float want = 0.0f;
                    if (dot)
                        for (uint32_t j = 0; j < n; j++)
                            want = fmaf(c[j], x[j], want);
                    else
                        want = kvt__recall_dist2(x, c, n);
                    cr_assert_eq(kvt__bits_from_f32(out[i - 3]), kvt__bits_from_f32(want),
                                 "n %u wide %d dot %d row %u: %a vs %a", n, wide, dot, i,
                                 (double)out[i - 3], (double)want);
                }
            }
        free(X);
    }
    kvt__recall_group_wide(had);
}

/* Rows the bound cannot describe: a NaN branch value, an undescribable row (ρ = +Inf), a NaN
 * query: the groups holding them are evaluated, and the outputs stay identical. */
Test(recall_prune, non_finite_rows_and_queries) {
    tu_rng g = {0x0f1u};
    lay l;
    lay_make(&l, &g, 128, 2, 17, 8, KVT__DT_FP32, 3, 1e-3, 0.0);
    uint32_t r1 = 40, r2 = 200;
    l.is_kept[r1] = l.is_kept[r2] = 0; /* keep them archived */
    uint32_t m = 0;
    for (uint32_t r = 0; r < l.N; r++)
        if (l.is_kept[r])
            l.kept[m++] = r;
    l.m = m;
    l.sinks = 0;
    kvt__store_elem(row_of(&l, r1), l.dt, D + 3, NAN);
    l.rho[r2] = INFINITY;
    memset(l.csk + (size_t)r2 * l.cs, 0, 2 * l.cs);
    for (uint32_t b = 0; b < l.nb; b++)
        build_block(&l, b, 0);
    /* the NaN row's group has radius +Inf: never skipped */
    const uint32_t G = kvt__recall_group_slots(l.B);
    for (uint32_t gi = 0, start = 0; gi < l.ng[0]; start = l.end[gi++])
        for (uint32_t i = start; i < l.end[gi]; i++)
            if (l.perm[i] == r1)
                cr_assert(isinf(l.stat[gi * KVT__RG_STATS + KVT__RG_RADIUS]));
    for (uint32_t gi = 0; gi < l.ng[1]; gi++) /* block 1 holds r2: its ρ max is +Inf */
        for (uint32_t i = gi ? l.end[G + gi - 1] : 0; i < l.end[G + gi]; i++)
            if (l.perm[l.B + i] == r2 - l.B)
                cr_assert(isinf(l.stat[(G + gi) * KVT__RG_STATS + KVT__RG_RHO_MAX]));
    const uint32_t H = 4;
    float q[4 * QD], best[4];
    totals t = {0};
    for (int s = 0; s < 40; s++) {
        make_queries(&g, &l, H, q);
        if (s % 5 == 4)
            q[(size_t)(s % H) * QD + 7] = NAN;
        for (uint32_t h = 0; h < H; h++)
            best[h] = s % 3 ? 1e30f : 5.0f * (float)tu_normal(&g);
        int mode = s % 2 ? KVT__RECALL_SOUND : KVT__RECALL_CONFORMAL;
        float z = mode == KVT__RECALL_SOUND ? sqrtf(448.0f) : 1.0f;
        uint32_t *f = xmalloc(4 * l.N), nf = 0, ov = 0;
        kvt__recall_scan_args a = scan_args(&l, q, best, H, z, mode, l.N, f, &nf, &ov);
        float *sc = xmalloc(sizeof(float) * kvt__recall_scan_scratch_floats(H, l.rank, D));
        kvt__recall_scan_cpu(&a, sc);
        bool has1 = false, has2 = false;
        for (uint32_t i = 0; i < nf; i++) {
            has1 |= f[i] == r1;
            has2 |= f[i] == r2;
        }
        cr_assert(has1 && has2, "step %d: the NaN row and the ρ = +Inf row fire in the full scan", s);
        compare(&l, q, best, H, z, mode, l.N, &t, 0x0f1u, "non-finite");
        free(f);
        free(sc);
    }
    lay_free(&l);
}

/* kvt__recall_groups_ok: the built planes pass; bad shapes and out-of-range indices are refused. */
Test(recall_prune, groups_ok_refuses_bad_planes) {
    tu_rng g = {0x0c0u};
    lay l;
    lay_make(&l, &g, 128, 2, 5, 8, KVT__DT_BF16, 2, 0.01, 0.0);
    float q[QD], best = 0.0f;
    make_queries(&g, &l, 1, q);
    uint32_t f[4], nf, ov;
    kvt__recall_scan_args a = scan_args(&l, q, &best, 1, 1.0f, KVT__RECALL_CONFORMAL, 4, f, &nf, &ov);
    kvt__recall_groups gr = groups_of(&l);
    cr_assert(kvt__recall_groups_ok(&a, &gr));
    kvt__recall_groups x = gr;
    x.block_rows = 96; /* not a power of two */
    cr_assert(!kvt__recall_groups_ok(&a, &x));
    x = gr;
    x.n_blocks = 3; /* more rows than are closed */
    cr_assert(!kvt__recall_groups_ok(&a, &x));
    x = gr;
    x.dim = BD + l.rank - 1;
    cr_assert(!kvt__recall_groups_ok(&a, &x));
    x = gr;
    x.stat = NULL;
    cr_assert(!kvt__recall_groups_ok(&a, &x));
    x = gr;
    x.n_blocks = 0; /* nothing grouped: every row scanned one by one */
    cr_assert(kvt__recall_groups_ok(&a, &x));
    uint32_t keep = l.perm[130];
    l.perm[130] = 128; /* a row offset out of its block */
    cr_assert(!kvt__recall_groups_ok(&a, &gr));
    l.perm[130] = keep;
    uint32_t ng = l.ng[1];
    l.ng[1] = 5; /* more groups than slots */
    cr_assert(!kvt__recall_groups_ok(&a, &gr));
    l.ng[1] = ng;
    uint32_t e0 = l.end[0];
    l.end[0] = 20; /* a group under 32 rows */
    cr_assert(!kvt__recall_groups_ok(&a, &gr));
    l.end[0] = e0;
    cr_assert(kvt__recall_groups_ok(&a, &gr));
    lay_free(&l);
}
