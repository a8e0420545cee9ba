/*
 * bench_recall_scan.c — the recall scan's CPU twin (the recall_scan op of the CPU backend,
 * recall/kernels/recall_scan.c) on one (request, layer): B = 4096 closed bf16 MLA-NoPE rows (512 +
 * 64; or the count given) behind a shuffled page table, a rank-64 sketch, sinks 4, m = B / 8 kept
 * (512: 3580 archived rows); H query heads; thresholds +FLT_MAX so that no row fires and every (row, head) pair is
 * evaluated (the scan's worst case: a row that fires stops at its first firing head). Conformal
 * and sound modes; the op as dispatched (the tiled scan on AVX2/FMA CPUs) and the row-wise scan
 * side by side; then the 8-bit scan (params.recall_scan_bits 8: the rows' 8-bit planes,
 * recall/kernels/recall_scan.h) on its AMX, VNNI and AVX2 paths (those the CPU has); best of
 * `reps` (default 5) in thread CPU time. Per step, and ns per (archived row, head); "net": less
 * the heads' preparation
 * (kvt__recall_scan_prep_cpu, timed alone: the q̃_sk projections every step pays once, whatever
 * its rows), what a step over many more rows pays per row; and that preparation's core
 * (kvt__recall_heads_prep_cpu) at each SIMD level the CPU has (kvt__recall_prep_level).
 * Usage: bench_recall_scan [reps] [closed rows (4096; a multiple of 64: e.g. 131072, the decode
 * step's 128k context, whose planes no cache holds)]
 */
#include "kernels/backend.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_util.h"

enum { D = 512, BD = 64, RANK = 64, PR = 64, SINKS = 4, ROW = 1152 };

/* This thread's CPU time (the machine is shared: other processes' slices are not counted). */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float gauss(void) { /* a sum of 4 uniforms, centred: shape enough for a benchmark */
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += (float)((rnd() >> 11) * 0x1p-53);
    return s - 2.0f;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    /* closed rows (a multiple of the page, >= 4096), an eighth of them kept */
    const uint32_t NR = argc > 2 ? (uint32_t)atoi(argv[2]) : 4096u, M = NR / 8u;
    if (NR < 4096u || NR % PR) {
        fprintf(stderr, "bench_recall_scan: rows must be a multiple of %d, at least 4096\n", PR);
        return 1;
    }
    uint8_t *pool = malloc((size_t)NR * ROW);
    int32_t *pages = malloc(sizeof(int32_t) * (NR / PR)), *slots = malloc(sizeof(int32_t) * NR);
    float *V = malloc(sizeof(float) * RANK * D), *rho = malloc(sizeof(float) * NR);
    uint16_t *csk = malloc(sizeof(uint16_t) * NR * RANK);
    uint32_t *kept = malloc(sizeof(uint32_t) * M), *fired = malloc(sizeof(uint32_t) * NR);
    uint32_t nf = 0, ov = 0;
    float *scratch = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    /* V: coordinate directions scaled — orthonormal, enough for timing (the math is the same). */
    memset(V, 0, sizeof(float) * RANK * D);
    for (int k = 0; k < RANK; k++)
        V[(size_t)k * D + (size_t)k * 7] = 1.0f;
    for (int p = 0; p < (int)(NR / PR); p++)
        pages[p] = p;
    for (int p = (int)(NR / PR) - 1; p > 0; p--) {
        int j = (int)(rnd() % (uint64_t)(p + 1)), t = pages[p];
        pages[p] = pages[j];
        pages[j] = t;
    }
    kvt__div32 pd = kvt__div32_make(PR);
    for (uint32_t r = 0; r < NR; r++) {
        slots[r] = kvt__page_slot(pages, 0, &pd, r);
        for (uint32_t i = 0; i < D + BD; i++)
            kvt__store_elem(pool + (size_t)slots[r] * ROW, KVT__DT_BF16, i, gauss());
    }
    kvt__sketch_rows_cpu(pool, slots, NR, ROW, KVT__DT_BF16, D, V, RANK, RANK, scratch, csk, rho);
    /* the 8-bit planes: each sketch row widened by its plane (as a close writes them) */
    const uint32_t S8 = RANK + kvt__recall_q8_words(BD, RANK);
    uint16_t *csk8 = malloc(sizeof(uint16_t) * NR * S8);
    float tq[BD + RANK];
    for (uint32_t r = 0; r < NR; r++) {
        memcpy(csk8 + (size_t)r * S8, csk + (size_t)r * RANK, sizeof(uint16_t) * RANK);
        kvt__recall_q8_row(pool + (size_t)slots[r] * ROW, 2 * D, KVT__DT_BF16, BD,
                           csk8 + (size_t)r * S8, RANK, tq, (uint8_t *)(csk8 + (size_t)r * S8 + RANK));
    }
    for (uint32_t i = 0; i < M; i++)
        kept[i] = SINKS + i * 7; /* ascending, spread */
    kvt__alloc a;
    if (kvt__alloc_init(&a, KVT_ALLOC_LIBC) != KVT_OK)
        return 1;
    kvt__backend be = {.alloc = &a};
    if (kvt__backend_cpu_open(&be) != KVT_OK)
        return 1;
    printf("recall scan, CPU twin: %u closed rows, %u archived, rank %u, best of %d\n", NR,
           NR - SINKS - M, RANK, reps);
    static const uint32_t heads[] = {16, 32, 64};
    for (int hi = 0; hi < 3; hi++) {
        uint32_t H = heads[hi];
        float *q = malloc(sizeof(float) * H * (D + BD)), *best = malloc(sizeof(float) * H);
        for (size_t i = 0; i < (size_t)H * (D + BD); i++)
            q[i] = gauss();
        for (uint32_t h = 0; h < H; h++)
            best[h] = FLT_MAX;
        for (int mode = KVT__RECALL_CONFORMAL; mode <= KVT__RECALL_SOUND; mode++) {
            kvt__recall_scan_args s = {.base = pool, .pages = pages, .pdiv = &pd,
                                       .slot_stride = ROW, .dtype = KVT__DT_BF16,
                                       .latent_dim = D, .branch_offset = 2 * D,
                                       .branch_dtype = KVT__DT_BF16, .branch_dim = BD,
                                       .csk = csk, .rho = rho, .csk_stride = RANK, .basis = V,
                                       .rank = RANK, .n_closed = NR, .sinks = SINKS,
                                       .kept = kept, .m = M, .q = q, .best = best,
                                       .n_heads = H, .scale = 0.0721687836f,
                                       .z = mode == KVT__RECALL_SOUND ? 21.2f : 2.0f,
                                       .mode = mode, .cap = NR, .fired = fired,
                                       .n_fired = &nf, .overflow = &ov};
            /* the op as dispatched (tiled where the CPU has AVX2/FMA), then the row-wise scan,
             * alternating within each repeat */
            const int tiled = kvt__recall_scan_tiled(-1);
            double t_best[2] = {1e30, 1e30};
            for (int r = 0; r < reps; r++)
                for (int w = 0; w < 2; w++) {
                    kvt__recall_scan_tiled(w == 0);
                    double t = cpu_now();
                    if (be.ops->recall_scan(&be, &s, 1, NULL) != KVT_OK)
                        return 1;
                    t = cpu_now() - t;
                    t_best[w] = t < t_best[w] ? t : t_best[w];
                }
            kvt__recall_scan_tiled(1);
            /* the heads' preparation alone, 16-bit then 8-bit (the 8-bit one also quantises) */
            float *pscr = malloc(sizeof(float) * kvt__recall_scan_scratch_floats(H, RANK, D));
            double t_prep[2] = {1e30, 1e30};
            for (int r = 0; r < reps; r++)
                for (int w = 0; w < 2; w++) {
                    kvt__recall_scan_args sp = s;
                    if (w) {
                        sp.csk = csk8;
                        sp.csk_stride = RANK + kvt__recall_q8_words(BD, RANK);
                        sp.q8_off = RANK;
                    }
                    kvt__recall_scan_prep pp;
                    double t = cpu_now();
                    kvt__recall_scan_prep_cpu(&sp, pscr, &pp);
                    t = cpu_now() - t;
                    t_prep[w] = t < t_prep[w] ? t : t_prep[w];
                }
            /* the heads' preparation itself (kvt__recall_heads_prep_cpu) at each SIMD level the
             * CPU has, the levels alternating within each repeat */
            const int top = kvt__recall_prep_level(-1);
            double t_lv[3] = {1e30, 1e30, 1e30};
            for (int r = 0; r < reps; r++)
                for (int l = top; l >= 0; l--) {
                    kvt__recall_prep_level(l);
                    kvt__recall_head *hd = (kvt__recall_head *)(pscr + (size_t)H * RANK);
                    double t = cpu_now();
                    kvt__recall_heads_prep_cpu(s.q, D + BD, H, D, s.basis, RANK, pscr, hd,
                                               (float *)(hd + H));
                    t = cpu_now() - t;
                    t_lv[l] = t < t_lv[l] ? t : t_lv[l];
                }
            kvt__recall_prep_level(2);
            free(pscr);
            const double pairs = (double)(NR - SINKS - M) * H;
            for (int w = 0; w < 2; w++)
                printf("  %2u heads, %-9s %-8s %9.1f us a step  %6.2f ns per (row, head), net "
                       "%5.2f  fired %u\n", H, mode == KVT__RECALL_SOUND ? "sound" : "conformal",
                       w ? "row-wise" : tiled ? "tiled" : "(none)", t_best[w] * 1e6,
                       t_best[w] * 1e9 / pairs, (t_best[w] - t_prep[0]) * 1e9 / pairs, nf);
            /* the 8-bit scan: AMX, VNNI, then AVX2 (those the CPU has), alternating within each
             * repeat */
            s.csk = csk8;
            s.csk_stride = S8;
            s.q8_off = RANK;
            const int lv = kvt__recall_scan_q8_level(-1);
            double t8[3] = {1e30, 1e30, 1e30};
            for (int r = 0; r < reps; r++)
                for (int w = 0; w < 3 && w < lv; w++) {
                    kvt__recall_scan_q8_level(lv - w);
                    double t = cpu_now();
                    if (be.ops->recall_scan(&be, &s, 1, NULL) != KVT_OK)
                        return 1;
                    t = cpu_now() - t;
                    t8[w] = t < t8[w] ? t : t8[w];
                }
            kvt__recall_scan_q8_level(lv);
            static const char *const q8_name[] = {"", "8b AVX2", "8b VNNI", "8b AMX"};
            for (int w = 0; w < 3 && w < lv; w++)
                printf("  %2u heads, %-9s %-8s %9.1f us a step  %6.2f ns per (row, head), net "
                       "%5.2f  fired %u\n", H, mode == KVT__RECALL_SOUND ? "sound" : "conformal",
                       q8_name[lv - w], t8[w] * 1e6, t8[w] * 1e9 / pairs,
                       (t8[w] - t_prep[1]) * 1e9 / pairs, nf);
            if (mode == KVT__RECALL_CONFORMAL) {
                printf("  %2u heads, the heads' preparation alone: %.1f us (16-bit), %.1f us "
                       "(8-bit)\n", H, t_prep[0] * 1e6, t_prep[1] * 1e6);
                printf("  %2u heads, kvt__recall_heads_prep_cpu by level:", H);
                for (int l = top; l >= 0; l--)
                    printf(" %s %.1f us%s", l == 2 ? "AVX-512" : l == 1 ? "AVX2" : "head by head",
                           t_lv[l] * 1e6, l ? "," : "\n");
            }
        }
        free(q);
        free(best);
    }
    kvt__backend_cpu_close(&be);
    kvt__alloc_fini(&a);
    free(pool);
    free(pages);
    free(kept);
    free(slots);
    free(V);
    free(rho);
    free(csk);
    free(csk8);
    free(fired);
    free(scratch);
    return 0;
}
