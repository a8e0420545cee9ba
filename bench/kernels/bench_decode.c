/*
 * bench_decode.c — one decode step of one MLA layer on the CPU (issue 10): dense attention over
 * every row against kvtier's step at 32× — attention over the attended set (sinks, top-m kept,
 * tail), the full recall scan of the archived rows (conformal, z = 8) and the emission of the
 * attended slots — with the same attention code for both (kernels/attn_f32.c), whose rate is
 * reported as a fraction of this machine's sgemm rate (OpenBLAS) measured in the same run.
 *
 * Shape: H = 32 query heads, bf16 rows of 576 values (512 latent | 64 branch, 1152 B), blocks of
 * B = 4096 rows, 4 sinks; the step happens mid-block: the tail (open block) holds B/2 rows, the
 * closed rows are N − B/2, m = closed/32 of them kept (random positions), the rest archived with
 * rank-64 sketches. Everything single-threaded (attention is per sequence; OpenBLAS pinned to one
 * thread too), timed in the thread's CPU time (CLOCK_THREAD_CPUTIME_ID), sgemm included.
 *
 * Synthetic data (shaped so that the conformal trigger behaves as on a model: most archived rows
 * are far below the threshold): latents are 90% of their energy in a random rank-64 subspace
 * (the basis given to the sketch), 10% isotropic; every query carries a shared component along
 * the sink rows' direction (attention sinks: the best attended score of each head is a sink's),
 * plus an isotropic part. Printed: how many archived rows fired.
 *
 * Times, per context, best and range over `reps` repeats:
 *   (a) dense attention over all N rows (a contiguous range),
 *   (b) attention over the attended set (a gather) — its max score per head is the scan's
 *       threshold, no separate prologue,
 *   (c) the recall scan (the backend's recall_scan op: kvt__recall_scan_cpu — the tiled scan
 *       on AVX2/FMA CPUs), visiting every archived row,
 *   (c2) the pruned scan (recall/kernels/recall_group.h: kvt__recall_scan_pruned_cpu over the
 *       groups of every closed 4096-row block, built at setup as a block close builds them, not
 *       timed; the closed rows past the last whole block are scanned one by one), the scan the
 *       recall step runs in conformal and sound modes; its fired set is checked equal to (c)'s, and
 *       "visit" is the fraction of archived rows it evaluated,
 *   (d) emission: the backend's pack op writes the attended slots (TOKENS layout),
 *   (e) attention over the rows the scan fired (they join the attended set).
 * speedup = a / (b + c + d + e), a / (b + c2 + d + e), and a / b.
 *   (c') a projection, not a scan: the attention kernel itself over the archived rows' idx inputs
 *        ([branch | csk] as 128 bf16 values a row, all heads per row load, value_dim 0) — the
 *        FLOPs of every head's idx at GEMM speed, plus a softmax's exponentials instead of the
 *        trigger's compares. It shows what a GEMM-shaped scan could cost; speedup' = a / (b + c' +
 *        d + e). The twin (c) is what kvtier runs today.
 * Visited fraction: archived rows the pruned scan evaluated / archived rows (1.0 for (c)).
 * Bytes read per context row: dense 1152; kvtier
 * (attended + fired)·1152 + archived·(csk 128 + ρ 4 + branch 128) + 4 per emitted slot.
 *
 * The pool (and so dense attention, the gathers and the scan's branch reads alike) is on
 * transparent huge pages (madvise) unless the third argument is 0.
 *
 * Usage: bench_decode [reps (3)] [largest context in k rows (128)] [huge pages (1) | 0]
 */
#define _DEFAULT_SOURCE /* madvise's MADV_HUGEPAGE */
#include "kernels/attn.h"
#include "kernels/backend.h"
#include "recall/kernels/recall_group.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../bench_util.h"
#include "bench_cpu.h"

enum { H = 32, KD = 576, D = 512, BD = 64, RANK = 64, BLK = 4096, SINKS = 4, RATIO = 32,
       PR = 64, ROW = KD * 2, TAIL = BLK / 2 };
#define SCALE 0.07216878364870322
#define Z 8.0f
/* Queries: isotropic N(0, 1) per value plus Q_SHARED·u; sinks: SINK_LEN·u. A sink then scores
 * s·Q_SHARED·SINK_LEN ≈ 12 against ≈ N(0, 1.9²) for the other rows: the sinks take most of the
 * attention, and a head fires on an archived row when its idx is ~4σ high. */
#define Q_SHARED 10.0f
#define SINK_LEN 16.6f

typedef struct stats {
    double best, worst;
} stats;

static void note(stats *s, double t) {
    if (t < s->best)
        s->best = t;
    if (t > s->worst)
        s->worst = t;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 3;
    uint32_t max_k = argc > 2 ? (uint32_t)atoi(argv[2]) : 128;
    const int huge = argc > 3 ? atoi(argv[3]) != 0 : 1;
    if (reps < 1)
        reps = 1;
    if (max_k < 3) /* the tail alone is 2k rows */
        max_k = 3;
    blas_setup(argv);
    const uint32_t NMAX = max_k * 1024u;

    /* sgemm rates: square, and the decode step's score shape (rows × 576 by 576 × heads) */
    double g_sq = sgemm_gflops(1024, 1024, 1024, "N", reps);
    double g_dec = sgemm_gflops(4096, H, KD, "T", reps);
    double g_ref = g_sq > g_dec ? g_sq : g_dec, g_lo = g_sq;
    printf("decode step, CPU, single thread: H = %d heads, bf16 MLA rows (%d B), B = %d, sinks %d, "
           "%d×, tail %d rows, rank %d, conformal z = %.0f, %d repeats\n",
           H, ROW, BLK, SINKS, RATIO, TAIL, RANK, Z, reps);
    printf("sgemm (OpenBLAS, %s kernels, 1 thread): 1024³ %.1f GFLOP/s, 4096×%d×%d (decode score shape) "
           "%.1f GFLOP/s\n", blas_core(), g_sq, H, KD, g_dec);
    printf("pool: %s\n", huge ? "2-MiB aligned, madvise(MADV_HUGEPAGE) (transparent huge pages)"
                             : "2-MiB aligned, 4-KiB pages");
    printf("recall scan (c): %s\n", kvt__recall_scan_tiled(-1)
                                       ? kvt__recall_scan_wide(-1)
                                             ? "the tiled scan (AVX-512 tiles, AVX2/FMA edges)"
                                             : "the tiled scan (AVX2/FMA)"
                                       : "the row-wise scan (no AVX2/FMA on this CPU)");

    /* the pool: NMAX rows, identity page table of PR-row pages */
    /* the pool on transparent huge pages unless asked not to (an engine's KV pool is one large
     * pinned or hugepage-backed allocation; with 4-KiB pages the scan's strided branch reads take
     * a TLB miss every ~3.5 rows, dense attention's sequential reads amortise them) */
    const size_t pool_bytes = ((size_t)NMAX * ROW + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    uint8_t *pool = aligned_alloc(2u << 20, pool_bytes);
    if (huge && pool && madvise(pool, pool_bytes, MADV_HUGEPAGE) != 0)
        printf("madvise(MADV_HUGEPAGE) refused: 4-KiB pages\n");
    float *basis = malloc(sizeof(float) * RANK * D), *q = malloc(sizeof(float) * H * KD);
    float u[KD];
    orthonormal_f32(RANK, D, basis);
    double un = 0;
    for (uint32_t i = 0; i < KD; i++) {
        u[i] = gauss();
        un += (double)u[i] * u[i];
    }
    for (uint32_t i = 0; i < KD; i++)
        u[i] /= (float)sqrt(un); /* the sinks' direction, a unit vector */
    for (uint32_t r = 0; r < NMAX; r++)
        structured_row(pool + (size_t)r * ROW, r, SINKS, u, SINK_LEN, basis, RANK, D, BD);
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t i = 0; i < KD; i++)
            q[h * KD + i] = gauss() + Q_SHARED * u[i];
    int32_t *pages = malloc(sizeof(int32_t) * (NMAX / PR));
    for (uint32_t p = 0; p < NMAX / PR; p++)
        pages[p] = (int32_t)p;
    kvt__div32 pd = kvt__div32_make(PR);
    /* sketches of every row that can be closed (row r's sketch at r) */
    const uint32_t NC = NMAX - TAIL;
    uint16_t *csk = malloc(sizeof(uint16_t) * (size_t)NC * RANK);
    float *rho = malloc(sizeof(float) * NC);
    int32_t *ident = malloc(sizeof(int32_t) * NMAX);
    for (uint32_t r = 0; r < NMAX; r++)
        ident[r] = (int32_t)r;
    float *sks = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    double t_sk = cpu_s();
    kvt__sketch_rows_cpu(pool, ident, NC, ROW, KVT__DT_BF16, D, basis, RANK, RANK, sks, csk, rho);
    t_sk = cpu_s() - t_sk;

    kvt__alloc al;
    if (kvt__alloc_init(&al, KVT_ALLOC_LIBC) != KVT_OK)
        return 1;
    kvt__backend be = {.alloc = &al};
    if (kvt__backend_cpu_open(&be) != KVT_OK)
        return 1;

    float *scr = malloc(sizeof(float) * kvt__attn_f32_scratch_floats(H, KD, D));
    float *out = malloc(sizeof(float) * H * D), *best = malloc(sizeof(float) * H);
    int32_t *att = malloc(sizeof(int32_t) * NMAX), *fired_slots = malloc(sizeof(int32_t) * NMAX);
    uint32_t *kept = malloc(sizeof(uint32_t) * NMAX), *fired = malloc(sizeof(uint32_t) * NMAX);
    uint8_t *pick = malloc(NMAX);
    int32_t *idx_out = malloc(sizeof(int32_t) * NMAX), lens[2];

    /* the double reference's rate once, at 4096 rows (issue 10: 3–5% of sgemm) */
    {
        uint32_t n = 4096;
        double *ds = malloc(sizeof(double) * kvt__attn_scratch_doubles(n, H, D, KD));
        kvt__attn_args r = {.base = pool, .n_rows = n, .slot_stride = ROW, .dtype = KVT__DT_BF16,
                            .key_dim = KD, .value_dim = D, .q = q, .n_heads = H, .q_stride = KD,
                            .scale = SCALE, .out = out, .scratch = ds};
        double t = cpu_s();
        kvt__attn_cpu(&r);
        t = cpu_s() - t;
        printf("double reference (kernels/attn.c), 4096 rows: %.1f GFLOP/s = %.3f of sgemm\n",
               2.0 * H * (KD + D) * n / t * 1e-9, 2.0 * H * (KD + D) * n / t * 1e-9 / g_ref);
        free(ds);
    }
    printf("sketches of %u rows: %.2f s (setup, not timed below)\n", NC, t_sk);

    /* (c')'s inputs: per row [branch | f32(csk) as bf16], per head [q_br | q̃_sk = q_lat Vᵀ] */
    enum { PXD = BD + RANK };
    uint8_t *px = malloc((size_t)NC * PXD * 2);
    float *qpx = malloc(sizeof(float) * H * PXD);
    for (uint32_t r = 0; r < NC; r++) {
        uint8_t *o = px + (size_t)r * PXD * 2;
        memcpy(o, pool + (size_t)r * ROW + 2 * D, 2 * BD);
        for (uint32_t k = 0; k < RANK; k++)
            kvt__store_elem(o, KVT__DT_BF16, BD + k, kvt__f16_to_f32(csk[(size_t)r * RANK + k]));
    }
    for (uint32_t h = 0; h < H; h++) {
        for (uint32_t j = 0; j < BD; j++)
            qpx[h * PXD + j] = q[h * KD + D + j];
        for (uint32_t k = 0; k < RANK; k++) {
            double acc = 0;
            for (uint32_t d = 0; d < D; d++)
                acc += (double)q[h * KD + d] * basis[(size_t)k * D + d];
            qpx[h * PXD + BD + k] = (float)acc;
        }
    }
    float *pxscr = malloc(sizeof(float) * kvt__attn_f32_scratch_floats(H, PXD, 0));
    /* (c2)'s groups: every whole 4096-row block of the closable rows, as a close builds them */
    const uint32_t NBLK = NC / BLK, GS = kvt__recall_group_slots(BLK);
    uint32_t *g_perm = malloc(sizeof(uint32_t) * (size_t)NBLK * BLK);
    uint32_t *g_ng = malloc(sizeof(uint32_t) * (NBLK + 1));
    uint32_t *g_end = malloc(sizeof(uint32_t) * NBLK * GS + 4);
    float *g_centre = malloc(sizeof(float) * (size_t)NBLK * GS * PXD + 4);
    float *g_stat = malloc(sizeof(float) * (size_t)NBLK * GS * KVT__RG_STATS + 4);
    void *g_scr = malloc(kvt__recall_group_scratch_bytes(BLK, BD, RANK));
    double t_gr = cpu_s();
    for (uint32_t b = 0; b < NBLK; b++) {
        kvt__recall_group_block o = {.perm = g_perm + (size_t)b * BLK, .n_groups = g_ng + b,
                                     .end = g_end + (size_t)b * GS,
                                     .centre = g_centre + (size_t)b * GS * PXD,
                                     .stat = g_stat + (size_t)b * GS * KVT__RG_STATS};
        kvt__recall_group_block_cpu(pool, ident + (size_t)b * BLK, BLK, ROW, 2 * D, KVT__DT_BF16,
                                    BD, csk + (size_t)b * BLK * RANK, RANK, rho + (size_t)b * BLK,
                                    RANK, PXD, g_scr, &o);
    }
    t_gr = cpu_s() - t_gr;
    printf("groups of %u blocks for the pruned scan: %.2f s (setup, not timed below)\n\n", NBLK,
           t_gr);
    void *pscr = malloc(kvt__recall_scan_pruned_scratch_bytes(H, RANK, D, NC));
    uint32_t *fired2 = malloc(sizeof(uint32_t) * NMAX);
    int32_t *arch = malloc(sizeof(int32_t) * NMAX);

    static const uint32_t ctxs[] = {2560, 3072, 4096, 8192, 16384, 32768, 65536, 131072};
    /* crossover: the smallest measured N from which on (that N and every larger one measured)
     * kvtier's step (best time) beats dense (best time); 0: not reached. For the twin scan and
     * for the projection (c'). */
    uint32_t cross = 0, cross_px = 0;
    printf("%7s %9s %8s %8s %7s %7s %9s %7s %7s %8s %7s %6s %6s %6s %8s %8s %5s\n", "N",
           "dense ms", "attn ms", "scan ms", "emit ms", "(e) ms", "a/(b..e)", "a/b", "GF/s a",
           "frac", "c' ms", "a/(..)'", "fired", "B/tok", "prune ms", "a/(..)p", "visit");
    for (size_t ci = 0; ci < sizeof ctxs / sizeof ctxs[0]; ci++) {
        const uint32_t N = ctxs[ci];
        if (N > NMAX)
            break;
        /* the sgemm peak again beside each context (its best so far is the fraction's base) */
        double g = sgemm_gflops(1024, 1024, 1024, "N", reps);
        g_lo = g < g_lo ? g : g_lo;
        g_ref = g > g_ref ? g : g_ref;
        const uint32_t closed = N - TAIL, m = closed / RATIO;
        /* kept: m distinct random positions in [SINKS, closed), ascending */
        memset(pick, 0, closed);
        for (uint32_t c = 0; c < m;) {
            uint32_t r = SINKS + (uint32_t)(rnd() % (closed - SINKS));
            if (!pick[r]) {
                pick[r] = 1;
                c++;
            }
        }
        uint32_t na = 0, nk = 0;
        for (uint32_t r = 0; r < SINKS; r++)
            att[na++] = (int32_t)r;
        for (uint32_t r = SINKS; r < closed; r++)
            if (pick[r]) {
                kept[nk++] = r;
                att[na++] = (int32_t)r;
            }
        for (uint32_t r = closed; r < N; r++)
            att[na++] = (int32_t)r;
        const uint32_t archived = closed - SINKS - m;
        uint32_t narch = 0;
        for (uint32_t r = SINKS; r < closed; r++)
            if (!pick[r])
                arch[narch++] = (int32_t)r;
        kvt__attn_f32_args proxy = {.base = px, .slots = arch, .n_rows = narch,
                                    .slot_stride = PXD * 2, .dtype = KVT__DT_BF16,
                                    .key_dim = PXD, .value_dim = 0, .q = qpx, .n_heads = H,
                                    .q_stride = PXD, .scale = SCALE, .scratch = pxscr};

        kvt__attn_f32_args dense = {.base = pool, .n_rows = N, .slot_stride = ROW,
                                    .dtype = KVT__DT_BF16, .key_dim = KD, .value_dim = D,
                                    .q = q, .n_heads = H, .q_stride = KD, .scale = SCALE,
                                    .out = out, .scratch = scr};
        kvt__attn_f32_args sparse = dense;
        sparse.slots = att;
        sparse.n_rows = na;
        sparse.max_score = best;
        uint32_t nf = 0, ov = 0;
        kvt__recall_scan_args s = {.base = pool, .pages = pages, .pdiv = &pd,
                                   .slot_stride = ROW, .dtype = KVT__DT_BF16, .latent_dim = D,
                                   .branch_offset = 2 * D, .branch_dtype = KVT__DT_BF16,
                                   .branch_dim = BD, .csk = csk, .rho = rho, .csk_stride = RANK,
                                   .basis = basis, .rank = RANK, .n_closed = closed,
                                   .sinks = SINKS, .kept = kept, .m = m, .q = q, .best = best,
                                   .n_heads = H, .scale = (float)SCALE, .z = Z,
                                   .mode = KVT__RECALL_CONFORMAL, .cap = archived,
                                   .fired = fired, .n_fired = &nf, .overflow = &ov};
        kvt__pack_query pq[2] = {
            {.d = {.lo_end = SINKS, .list = kept, .n_list = m, .hi_begin = closed, .hi_end = N},
             .pages = pages, .out = 0, .pad = na, .len_at = 0},
            {.d = {.lo_end = 0, .list = fired, .n_list = 0, .hi_begin = 0, .hi_end = 0},
             .pages = pages, .out = na, .len_at = 1}};
        const uint32_t n_pq = 2; /* the CPU backend's memory is host memory: the image here */
        kvt__pack_args pk = {.q_plan = pq, .n_plan = &n_pq, .n_max = 2, .pdiv = &pd,
                             .indices = idx_out, .lengths = lens};
        kvt__attn_f32_args fa = dense;
        fa.slots = fired_slots;
        fa.out = out;
        stats ta = {1e30, 0}, tb = ta, tc = ta, td = ta, te = ta, tt = ta, tp = ta, tq = ta;
        kvt__recall_groups grp = {.block_rows = BLK, .n_blocks = closed / BLK, .dim = PXD,
                                  .perm = g_perm, .n_groups = g_ng, .end = g_end,
                                  .centre = g_centre, .stat = g_stat};
        kvt__recall_scan_args s2 = s;
        uint32_t nf2 = 0, ov2 = 0;
        s2.fired = fired2;
        s2.n_fired = &nf2;
        s2.overflow = &ov2;
        kvt__recall_prune_stats pst = {0};
        for (int rep = 0; rep < reps; rep++) {
            double t0 = cpu_s();
            kvt__attn_f32_cpu(&dense);
            double t1 = cpu_s();
            kvt__attn_f32_cpu(&sparse);
            double t2 = cpu_s();
            if (be.ops->recall_scan(&be, &s, 1, NULL) != KVT_OK)
                return 1;
            double t3 = cpu_s();
            pq[1].d.n_list = nf;
            pq[1].pad = nf;
            if (be.ops->pack(&be, &pk, NULL) != KVT_OK)
                return 1;
            double t4 = cpu_s();
            for (uint32_t i = 0; i < nf; i++)
                fired_slots[i] = (int32_t)fired[i];
            fa.n_rows = nf;
            kvt__attn_f32_cpu(&fa);
            double t5 = cpu_s();
            note(&ta, t1 - t0);
            note(&tb, t2 - t1);
            note(&tc, t3 - t2);
            note(&td, t4 - t3);
            note(&te, t5 - t4);
            note(&tt, t5 - t1);
            double t6 = cpu_s();
            kvt__attn_f32_cpu(&proxy);
            double t7 = cpu_s();
            kvt__recall_scan_pruned_cpu(&s2, &grp, pscr, &pst);
            note(&tp, t7 - t6);
            note(&tq, cpu_s() - t7);
        }
        if (nf2 != nf || ov2 != ov || memcmp(fired, fired2, sizeof(uint32_t) * nf)) {
            fprintf(stderr, "pruned scan fired %u rows, full scan %u\n", nf2, nf);
            return 1;
        }
        const double visited = pst.archived ? (double)pst.visited / pst.archived : 1.0;
        if (lens[0] != (int32_t)na || lens[1] != (int32_t)nf) {
            fprintf(stderr, "emission wrote %d + %d slots, expected %u + %u\n", lens[0], lens[1],
                    na, nf);
            return 1;
        }
        const double fl = 2.0 * H * (KD + D) * (double)N;
        const double bytes = ((double)na + nf) * ROW + (double)archived * (2 * RANK + 4 + 2 * BD) +
                             4.0 * (na + nf);
        const double tpx = tb.best + tp.best + td.best + te.best;
        const double tpr = tb.best + tq.best + td.best + te.best;
        printf("%7u %9.2f %8.2f %8.2f %7.3f %7.3f %9.2f %7.2f %7.1f %8.2f %7.2f %6.2f %6u %6.0f "
               "%8.2f %8.2f %5.2f\n",
               N, ta.best * 1e3, tb.best * 1e3, tc.best * 1e3, td.best * 1e3, te.best * 1e3,
               ta.best / tt.best, ta.best / tb.best, fl / ta.best * 1e-9,
               fl / ta.best * 1e-9 / g_ref, tp.best * 1e3, ta.best / tpx, nf, bytes / N,
               tq.best * 1e3, ta.best / tpr, visited);
        printf("%7s ranges: dense %.2f–%.2f, attn %.2f–%.2f, scan %.2f–%.2f, emit %.3f–%.3f, "
               "fired %.3f–%.3f, c' %.2f–%.2f, pruned %.2f–%.2f; a/(b..e) %.2f–%.2f (worst/best "
               "pairings); attended %u rows, archived %u\n", "", ta.best * 1e3, ta.worst * 1e3,
               tb.best * 1e3, tb.worst * 1e3, tc.best * 1e3, tc.worst * 1e3, td.best * 1e3,
               td.worst * 1e3, te.best * 1e3, te.worst * 1e3, tp.best * 1e3, tp.worst * 1e3,
               tq.best * 1e3, tq.worst * 1e3, ta.best / tt.worst, ta.worst / tt.best, na,
               archived);
        if (tt.best < ta.best) {
            if (!cross)
                cross = N;
        } else {
            cross = 0;
        }
        if (tpx < ta.best) {
            if (!cross_px)
                cross_px = N;
        } else {
            cross_px = 0;
        }
        fflush(stdout);
    }
    { /* the scan's fixed cost: no archived row, only the heads' preparation */
        float b0[H];
        for (uint32_t h = 0; h < H; h++)
            b0[h] = 0.0f;
        uint32_t nf = 0, ov = 0, f0 = 0;
        kvt__recall_scan_args s = {.base = pool, .pages = pages, .pdiv = &pd,
                                   .slot_stride = ROW, .dtype = KVT__DT_BF16, .latent_dim = D,
                                   .branch_offset = 2 * D, .branch_dtype = KVT__DT_BF16,
                                   .branch_dim = BD, .csk = csk, .rho = rho, .csk_stride = RANK,
                                   .basis = basis, .rank = RANK, .n_closed = SINKS,
                                   .sinks = SINKS, .kept = kept, .m = 0, .q = q, .best = b0,
                                   .n_heads = H, .scale = (float)SCALE, .z = Z,
                                   .mode = KVT__RECALL_CONFORMAL, .cap = 1, .fired = &f0,
                                   .n_fired = &nf, .overflow = &ov};
        stats t0 = {1e30, 0};
        for (int rep = 0; rep < reps; rep++) {
            double t = cpu_s();
            if (be.ops->recall_scan(&be, &s, 1, NULL) != KVT_OK)
                return 1;
            note(&t0, cpu_s() - t);
        }
        printf("\nrecall scan twin with no archived row (its %d heads' preparation alone): "
               "%.2f ms (%.2f–%.2f)\n", H, t0.best * 1e3, t0.best * 1e3, t0.worst * 1e3);
    }
    printf("sgemm 1024³ re-measured before each context: %.1f–%.1f GFLOP/s; \"frac\" is a's "
           "rate over the best sgemm rate measured up to that row\n", g_lo, g_ref);
    printf("crossover (beats dense at that N and every larger N measured): with the recall "
           "scan twin ");
    if (cross)
        printf("N = %u rows", cross);
    else
        printf("not reached up to N = %u", NMAX);
    printf("; with the projection (c') ");
    if (cross_px)
        printf("N = %u rows\n", cross_px);
    else
        printf("not reached up to N = %u\n", NMAX);
    printf("bytes read per context row at 32×: dense %d; the reference figure for kvtier is 294\n",
           ROW);
    kvt__backend_cpu_close(&be);
    kvt__alloc_fini(&al);
    free(pool);
    free(basis);
    free(q);
    free(pages);
    free(csk);
    free(rho);
    free(ident);
    free(sks);
    free(scr);
    free(out);
    free(best);
    free(att);
    free(fired_slots);
    free(kept);
    free(fired);
    free(pick);
    free(idx_out);
    free(px);
    free(qpx);
    free(pxscr);
    free(arch);
    free(g_perm);
    free(g_ng);
    free(g_end);
    free(g_centre);
    free(g_stat);
    free(g_scr);
    free(pscr);
    free(fired2);
    return 0;
}
