/*
 * bench_recall_prune.c — the pruned recall scan (recall/kernels/recall_group.h) against the full
 * scan (recall/kernels/recall_scan.c), side by side in one run, on one (request, layer): NB blocks
 * of B = 4096 closed bf16 MLA-NoPE rows (512 + 64) behind a shuffled page table, a rank-64 sketch,
 * sinks 4, m = 512 kept per block, H = 16 heads; thresholds = each head's best attended exact score
 * (sinks and kept rows), the thresholds a step would use. Two data sets:
 *   random     every value N(0,1) (shape of bench_recall_scan);
 *   clustered  32 clusters (branch N(0,1), latent 3·N(0,1) per basis direction + 0.02 off span)
 *              with members = centre + 0.05·N(0,1), and 8 "needle" rows per block aimed at a head
 *              (its query's direction, ~3× a row's norm), which fire.
 * Per data set and mode (conformal z = 2, sound z = √448): archived rows visited per step (the
 * full scan visits all), groups visited, fired rows (both scans: identical, checked), and the
 * thread CPU time of each scan over `reps` alternating repeats (min–max), with the per-repeat
 * ratio's range (CPU time, not wall: see bench_cpu.h's cpu_s).
 * Also the group build's time per block, beside the block's rank-64 sketch. Usage: bench_recall_prune [reps] (default 3).
 */
#include "kernels/backend.h"
#include "recall/kernels/recall_group.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_util.h"
#include "bench_cpu.h"

enum { B = 4096, NB = 2, NR = B * NB, D = 512, BD = 64, RANK = 64, PR = 64, M = 512, SINKS = 4,
       ROW = 1152, H = 16, QD = D + BD, DIM = BD + RANK, KC = 32, NEEDLES = 8 };

typedef struct data {
    uint8_t *pool;
    int32_t pages[NR / PR], slots[NR];
    kvt__div32 pd;
    float *V, *rho, *q, best[H];
    uint16_t *csk;
    uint32_t kept[M * NB];
    uint8_t is_kept[NR];
    /* groups */
    uint32_t perm[NR], ng[NB], end[NB * (B / 32)];
    float *centre, *stat;
} data;

static float score(const data *d, const float *q, uint32_t row) {
    return kvt__recall_exact(q, d->pool + (size_t)d->slots[row] * ROW, KVT__DT_BF16, D, 2 * D,
                             KVT__DT_BF16, BD, 0.0721687836f);
}

/* Rows (random or clustered with needles), sketches, kept set, queries and thresholds. */
static void make(data *d, int clustered) {
    memset(d->V, 0, sizeof(float) * RANK * D);
    for (int k = 0; k < RANK; k++) /* coordinate directions: orthonormal, enough for timing */
        d->V[(size_t)k * D + (size_t)k * 7] = 1.0f;
    for (int p = 0; p < NR / PR; p++)
        d->pages[p] = p;
    for (int p = NR / PR - 1; p > 0; p--) {
        int j = (int)(rnd() % (uint64_t)(p + 1)), t = d->pages[p];
        d->pages[p] = d->pages[j];
        d->pages[j] = t;
    }
    d->pd = kvt__div32_make(PR);
    for (uint32_t h = 0; h < H; h++) { /* in span: N(0,1) per direction, 0.3 off span */
        float *q = d->q + (size_t)h * QD;
        for (uint32_t i = 0; i < QD; i++)
            q[i] = i < D ? 0.3f * gauss_bm() : gauss_bm();
        for (int k = 0; k < RANK; k++)
            q[k * 7] = gauss_bm();
    }
    static float cen[KC][QD];
    for (int c = 0; c < KC; c++)
        for (uint32_t i = 0; i < QD; i++)
            cen[c][i] = i >= D ? gauss_bm() : i % 7 == 0 && i / 7 < RANK ? 3.0f * gauss_bm()
                                                                       : 0.02f * gauss_bm();
    for (uint32_t r = 0; r < NR; r++) {
        d->slots[r] = kvt__page_slot(d->pages, 0, &d->pd, r);
        uint8_t *p = d->pool + (size_t)d->slots[r] * ROW;
        const float *c = cen[rnd() % KC];
        for (uint32_t i = 0; i < QD; i++)
            kvt__store_elem(p, KVT__DT_BF16, i, clustered ? c[i] + 0.05f * gauss_bm() : gauss_bm());
    }
    memset(d->is_kept, 0, sizeof d->is_kept);
    for (uint32_t b = 0; b < NB; b++)
        for (uint32_t i = 0; i < M; i++) {
            uint32_t r = b * B + SINKS + i * 7; /* spread */
            d->kept[b * M + i] = r;
            d->is_kept[r] = 1;
        }
    if (clustered) /* needles: archived rows along a head's query, ~3× a row's norm */
        for (uint32_t b = 0; b < NB; b++)
            for (uint32_t k = 0; k < NEEDLES; k++) {
                uint32_t r;
                do
                    r = b * B + SINKS + (uint32_t)(rnd() % (B - SINKS));
                while (d->is_kept[r]);
                const float *q = d->q + (size_t)(k % H) * QD;
                double n2 = 0;
                for (uint32_t i = 0; i < QD; i++)
                    n2 += (double)q[i] * q[i];
                float a = (float)(75.0 / sqrt(n2));
                uint8_t *p = d->pool + (size_t)d->slots[r] * ROW;
                for (uint32_t i = 0; i < QD; i++)
                    kvt__store_elem(p, KVT__DT_BF16, i, a * q[i]);
            }
    float *scratch = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    kvt__sketch_rows_cpu(d->pool, d->slots, NR, ROW, KVT__DT_BF16, D, d->V, RANK, RANK, scratch,
                         d->csk, d->rho);
    free(scratch);
    for (uint32_t h = 0; h < H; h++) {
        d->best[h] = -INFINITY;
        for (uint32_t r = 0; r < NR; r++)
            if (r < SINKS || d->is_kept[r]) {
                float e = score(d, d->q + (size_t)h * QD, r);
                d->best[h] = e > d->best[h] ? e : d->best[h];
            }
    }
}

/* The best time of one block's rank-64 sketch (what a close already pays), for scale. */
static double sketch_time(data *d, int reps) {
    float *scratch = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    double tb = 1e30;
    for (int r = 0; r < reps; r++) {
        double t = cpu_s();
        kvt__sketch_rows_cpu(d->pool, d->slots, B, ROW, KVT__DT_BF16, D, d->V, RANK, RANK,
                             scratch, d->csk, d->rho);
        t = cpu_s() - t;
        tb = t < tb ? t : tb;
    }
    free(scratch);
    return tb;
}

/* Build every block's groups; returns the best time of one block's build. */
static double build(data *d, int reps) {
    void *scratch = malloc(kvt__recall_group_scratch_bytes(B, BD, RANK));
    double tb = 1e30;
    for (int r = 0; r < reps; r++)
        for (uint32_t b = 0; b < NB; b++) {
            kvt__recall_group_block o = {.perm = d->perm + b * B,
                                         .n_groups = d->ng + b,
                                         .end = d->end + b * (B / 32),
                                         .centre = d->centre + (size_t)b * (B / 32) * DIM,
                                         .stat = d->stat + (size_t)b * (B / 32) * KVT__RG_STATS};
            double t = cpu_s();
            kvt__recall_group_block_cpu(d->pool, d->slots + b * B, B, ROW, 2 * D, KVT__DT_BF16,
                                        BD, d->csk + (size_t)b * B * RANK, RANK,
                                        d->rho + (size_t)b * B, RANK, DIM, scratch, &o);
            t = cpu_s() - t;
            tb = t < tb ? t : tb;
        }
    free(scratch);
    return tb;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 3;
    if (reps < 1)
        reps = 1;
    data *d = calloc(1, sizeof *d);
    d->pool = malloc((size_t)NR * ROW);
    d->V = malloc(sizeof(float) * RANK * D);
    d->rho = malloc(sizeof(float) * NR);
    d->q = malloc(sizeof(float) * H * QD);
    d->csk = malloc(sizeof(uint16_t) * NR * RANK);
    d->centre = malloc(sizeof(float) * NB * (B / 32) * DIM);
    d->stat = malloc(sizeof(float) * NB * (B / 32) * KVT__RG_STATS);
    uint32_t *f1 = malloc(sizeof(uint32_t) * NR), *f2 = malloc(sizeof(uint32_t) * NR);
    float *s1 = malloc(sizeof(float) * kvt__recall_scan_scratch_floats(H, RANK, D));
    void *s2 = malloc(kvt__recall_scan_pruned_scratch_bytes(H, RANK, D, NR));
    printf("recall scan, pruned vs full (CPU twins): %u blocks of %u bf16 rows, %u archived, rank "
           "%u, %u heads, thresholds = best attended score; %d alternating repeats (min-max), thread CPU time\n",
           NB, B, NR - SINKS - M * NB, RANK, H, reps);
    for (int clustered = 0; clustered < 2; clustered++) {
        make(d, clustered);
        double tb = build(d, reps), ts = sketch_time(d, reps);
        uint32_t ng = 0;
        for (uint32_t b = 0; b < NB; b++)
            ng += d->ng[b];
        printf("%s data: %u groups; group build %.2f ms a block (%.0f ns a row) = %.2fx the "
               "block's rank-64 sketch (%.2f ms)\n",
               clustered ? "clustered + needles" : "random", ng, tb * 1e3, tb * 1e9 / B, tb / ts,
               ts * 1e3);
        kvt__recall_groups g = {.block_rows = B, .n_blocks = NB, .dim = DIM, .perm = d->perm,
                                .n_groups = d->ng, .end = d->end, .centre = d->centre,
                                .stat = d->stat};
        for (int mode = KVT__RECALL_CONFORMAL; mode <= KVT__RECALL_SOUND; mode++) {
            uint32_t n1 = 0, o1 = 0, n2 = 0, o2 = 0;
            kvt__recall_scan_args a = {
                .base = d->pool, .pages = d->pages, .pdiv = &d->pd, .slot_stride = ROW,
                .dtype = KVT__DT_BF16, .latent_dim = D, .branch_offset = 2 * D,
                .branch_dtype = KVT__DT_BF16, .branch_dim = BD, .csk = d->csk, .rho = d->rho,
                .csk_stride = RANK, .basis = d->V, .rank = RANK, .n_closed = NR,
                .sinks = SINKS, .kept = d->kept, .m = M * NB, .q = d->q, .best = d->best,
                .n_heads = H, .scale = 0.0721687836f,
                .z = mode == KVT__RECALL_SOUND ? sqrtf(448.0f) : 2.0f, .mode = mode, .cap = NR,
                .fired = f1, .n_fired = &n1, .overflow = &o1};
            kvt__recall_scan_args a2 = a;
            a2.fired = f2;
            a2.n_fired = &n2;
            a2.overflow = &o2;
            double full[64], pr[64], ratio_lo = 1e30, ratio_hi = 0;
            kvt__recall_prune_stats st = {0};
            int R = reps < 64 ? reps : 64;
            for (int r = 0; r < R; r++) {
                double t = cpu_s();
                kvt__recall_scan_cpu(&a, s1);
                full[r] = cpu_s() - t;
                t = cpu_s();
                kvt__recall_scan_pruned_cpu(&a2, &g, s2, &st);
                pr[r] = cpu_s() - t;
                double q = pr[r] / full[r];
                ratio_lo = q < ratio_lo ? q : ratio_lo;
                ratio_hi = q > ratio_hi ? q : ratio_hi;
            }
            double fl = 1e30, fh = 0, pl = 1e30, ph = 0;
            for (int r = 0; r < R; r++) {
                fl = full[r] < fl ? full[r] : fl;
                fh = full[r] > fh ? full[r] : fh;
                pl = pr[r] < pl ? pr[r] : pl;
                ph = pr[r] > ph ? pr[r] : ph;
            }
            int same = n1 == n2 && o1 == o2 && !memcmp(f1, f2, sizeof(uint32_t) * n1);
            printf("  %-9s fired %5u (%s)  visited %5.1f%% of archived rows, %5.1f%% of groups, "
                   "%4.1f%% of (group, head)  full %7.2f-%7.2f ms  pruned %7.2f-%7.2f ms  "
                   "pruned/full %.3f-%.3f\n",
                   mode == KVT__RECALL_SOUND ? "sound" : "conformal", n1,
                   same ? "identical" : "DIFFERENT", 100.0 * st.visited / st.archived,
                   100.0 * st.groups_visited / st.groups, 100.0 * st.head_groups / (st.groups * H),
                   fl * 1e3, fh * 1e3, pl * 1e3, ph * 1e3, ratio_lo, ratio_hi);
            if (!same)
                return 1;
        }
    }
    free(d->pool);
    free(d->V);
    free(d->rho);
    free(d->q);
    free(d->csk);
    free(d->centre);
    free(d->stat);
    free(d);
    free(f1);
    free(f2);
    free(s1);
    free(s2);
    return 0;
}
