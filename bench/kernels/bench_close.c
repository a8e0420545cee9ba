/*
 * bench_close.c — what a salience close runs per row, each CPU twin alone on one block of B = 4096
 * bf16 MLA-NoPE rows (512 latent + 64 branch, 1152 B, behind a shuffled slot table): σ
 * (kvt__sigma_block_cpu, κ = 16: 31 basis columns; its AVX-512 and AVX2 twins and its scalar
 * loops), the rank-64 sketch (kvt__sketch_rows_cpu, its AVX-512 path and its narrow path where the
 * CPU has AVX-512F) and the pruned scan's group build (kvt__recall_group_block_cpu, its AVX-512
 * chains and its narrow ones, on the whole block and in the 512-row group blocks a NoPE layer
 * builds) and the 8-bit planes (kvt__recall_q8_rows_cpu at
 * params.recall_scan_bits 8: per row, kvt__recall_q8_row, then its AVX2 and AVX-512 paths where the
 * CPU has them, each compared byte for byte). Latents: 90% of their energy in a rank-64 subspace
 * (the basis), as bench_decode_step's structured data. Per twin: thread CPU time per row, min–max
 * over `reps` repeats. Usage: bench_close [reps] (default 5).
 */
#include "kernels/sigma.h"
#include "recall/kernels/recall_group.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench_util.h"
#include "bench_cpu.h"

enum { B = 4096, D = 512, BD = 64, RANK = 64, KD = D + BD, ROW = 2 * KD, KAPPA = 16,
       NBASIS = 2 * KAPPA - 1, DIM = BD + RANK, GB = KVT__RECALL_GROUP_BLOCK_MAX };

typedef struct range {
    double lo, hi;
} range;

static void take(range *r, double t) {
    r->lo = t < r->lo ? t : r->lo;
    r->hi = t > r->hi ? t : r->hi;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    if (reps < 1)
        reps = 1;
    uint8_t *pool = malloc((size_t)B * ROW);
    int32_t *slots = malloc(sizeof(int32_t) * B);
    float *V = malloc(sizeof(float) * RANK * D), *rho = malloc(sizeof(float) * B);
    float *sig = malloc(sizeof(float) * B), *basis = malloc(sizeof(float) * NBASIS * B);
    uint16_t *csk = malloc(sizeof(uint16_t) * B * RANK), *csk2 = malloc(sizeof(uint16_t) * B * RANK);
    float *rho2 = malloc(sizeof(float) * B);
    float *sk = malloc(sizeof(float) * kvt__sketch_scratch_floats(D));
    float *ss = malloc(sizeof(float) * kvt__sigma_scratch_floats(B, NBASIS, BD));
    void *gs = malloc(kvt__recall_group_scratch_bytes(B, BD, RANK));
    const uint32_t G = kvt__recall_group_slots(B);
    uint32_t *perm = malloc(sizeof(uint32_t) * B), *end = malloc(sizeof(uint32_t) * G), ng = 0;
    uint32_t ngs[B / GB];
    float *centre = malloc(sizeof(float) * G * DIM), *stat = malloc(sizeof(float) * G * KVT__RG_STATS);
    if (!pool || !slots || !V || !rho || !sig || !basis || !csk || !csk2 || !rho2 || !sk || !ss ||
        !gs || !perm || !end || !centre || !stat || kvt__sigma_basis(0, B, KAPPA, basis) != 0) {
        fprintf(stderr, "bench_close: out of memory\n");
        return 1;
    }
    /* an orthonormal basis (the library's Gram-Schmidt of Gaussian rows, in double) */
    double *w = malloc(sizeof(double) * RANK * D);
    for (uint32_t i = 0; w && i < RANK * D; i++)
        w[i] = gauss_bm();
    if (!w || kvt_orthonormalise_rows(w, RANK, D, 2) != KVT_OK) {
        fprintf(stderr, "bench_close: basis: %s\n", kvt_last_error());
        return 1;
    }
    for (uint32_t i = 0; i < RANK * D; i++)
        V[i] = (float)w[i];
    free(w);
    for (uint32_t u = 0; u < B; u++)
        slots[u] = (int32_t)u;
    for (uint32_t u = B - 1; u > 0; u--) { /* shuffled slots, as a page table leaves them */
        uint32_t j = (uint32_t)(rnd() % (u + 1));
        int32_t t = slots[u];
        slots[u] = slots[j];
        slots[j] = t;
    }
    for (uint32_t u = 0; u < B; u++) {
        uint16_t *row = (uint16_t *)(pool + (size_t)u * ROW);
        float c[RANK], x[D];
        for (uint32_t k = 0; k < RANK; k++)
            c[k] = 3.0f * gauss_bm();
        for (uint32_t d = 0; d < D; d++) {
            float v = 0.33f * gauss_bm() * sqrtf((float)RANK / D) * 3.0f;
            for (uint32_t k = 0; k < RANK; k++)
                v += c[k] * V[(size_t)k * D + d];
            x[d] = v;
        }
        for (uint32_t d = 0; d < KD; d++) {
            float f = d < D ? x[d] : gauss_bm();
            uint32_t bits;
            memcpy(&bits, &f, 4);
            row[d] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        }
    }
    const int wide = kvt__sketch_wide(-1);
    const int gwide = kvt__recall_group_wide(-1);
    uint32_t *perm2 = malloc(sizeof(uint32_t) * B), ng2 = 0;
    if (!perm2)
        return 1;
    range rs = {1e30, 0}, rk = {1e30, 0}, rn = {1e30, 0}, rg = {1e30, 0}, rgn = {1e30, 0};
    range rgs = {1e30, 0};
    range rq[3] = {{1e30, 0}, {1e30, 0}, {1e30, 0}}, rsn[2] = {{1e30, 0}, {1e30, 0}};
    const int swide = kvt__sigma_simd(-1);
    float *sig2 = malloc(sizeof(float) * B);
    if (!sig2)
        return 1;
    /* the 8-bit planes: sketch rows of S fp16 words (the rank-64 sketch, then the plane) */
    const uint32_t S = RANK + kvt__recall_q8_words(BD, RANK);
    const int qlevel = kvt__recall_q8_rows_level(-1);
    uint16_t *q8 = malloc(sizeof(uint16_t) * B * S), *q8ref = malloc(sizeof(uint16_t) * B * S);
    float *qs = malloc(sizeof(float) * kvt__recall_q8_rows_scratch_floats(BD, RANK));
    if (!q8 || !q8ref || !qs)
        return 1;
    int same = 1, qsame = 1;
    for (int r = 0; r < reps; r++) {
        double t;
        for (int lv = 0; lv < swide; lv++) { /* the lower levels, for scale: the same bits */
            kvt__sigma_simd(lv);
            t = cpu_s();
            kvt__sigma_block_cpu(pool, slots, B, ROW, 2 * D, KVT__DT_BF16, BD, basis, NBASIS, ss,
                                 lv ? sig : sig2);
            take(&rsn[lv], cpu_s() - t);
            kvt__sigma_simd(2);
            if (lv)
                same &= !memcmp(sig, sig2, sizeof(float) * B);
        }
        t = cpu_s();
        kvt__sigma_block_cpu(pool, slots, B, ROW, 2 * D, KVT__DT_BF16, BD, basis, NBASIS, ss, sig);
        take(&rs, cpu_s() - t);
        if (swide) /* against the scalar loops' */
            same &= !memcmp(sig, sig2, sizeof(float) * B);
        if (wide) { /* the narrow path, for scale, then the wide one: the same bits */
            kvt__sketch_wide(0);
            t = cpu_s();
            kvt__sketch_rows_cpu(pool, slots, B, ROW, KVT__DT_BF16, D, V, RANK, RANK, sk, csk2, rho2);
            take(&rn, cpu_s() - t);
            kvt__sketch_wide(1);
        }
        t = cpu_s();
        kvt__sketch_rows_cpu(pool, slots, B, ROW, KVT__DT_BF16, D, V, RANK, RANK, sk, csk, rho);
        take(&rk, cpu_s() - t);
        if (wide)
            same &= !memcmp(csk, csk2, sizeof(uint16_t) * B * RANK) &&
                    !memcmp(rho, rho2, sizeof(float) * B);
        kvt__recall_group_block out = {.perm = perm, .n_groups = &ng, .end = end,
                                       .centre = centre, .stat = stat};
        if (gwide) { /* the narrow build, for scale: the same planes (perm compared here) */
            kvt__recall_group_wide(0);
            t = cpu_s();
            kvt__recall_group_block_cpu(pool, slots, B, ROW, 2 * D, KVT__DT_BF16, BD, csk, RANK,
                                        rho, RANK, DIM, gs, &out);
            take(&rgn, cpu_s() - t);
            kvt__recall_group_wide(1);
            memcpy(perm2, perm, sizeof(uint32_t) * B);
            ng2 = ng;
        }
        t = cpu_s();
        kvt__recall_group_block_cpu(pool, slots, B, ROW, 2 * D, KVT__DT_BF16, BD, csk, RANK, rho,
                                    RANK, DIM, gs, &out);
        take(&rg, cpu_s() - t);
        if (gwide)
            same &= ng == ng2 && !memcmp(perm, perm2, sizeof(uint32_t) * B);
        /* as the library builds a NoPE layer's groups: blocks of KVT__RECALL_GROUP_BLOCK_MAX rows
         * (8 at B = 4096), each apart; their planes side by side in the same arrays */
        t = cpu_s();
        for (uint32_t u0 = 0; u0 < B; u0 += GB) {
            const uint32_t k = u0 / GB, g = kvt__recall_group_slots(GB);
            kvt__recall_group_block sub = {.perm = perm + u0, .n_groups = &ngs[k],
                                           .end = end + k * g, .centre = centre + k * g * DIM,
                                           .stat = stat + k * g * KVT__RG_STATS};
            kvt__recall_group_block_cpu(pool, slots + u0, GB, ROW, 2 * D, KVT__DT_BF16, BD,
                                        csk + (size_t)u0 * RANK, RANK, rho + u0, RANK, DIM, gs,
                                        &sub);
        }
        take(&rgs, cpu_s() - t);
        for (int lv = 0; lv <= qlevel; lv++) { /* per row first: the reference */
            uint16_t *dst = lv ? q8 : q8ref;
            for (uint32_t u = 0; u < B; u++)
                memcpy(dst + (size_t)u * S, csk + (size_t)u * RANK, sizeof(uint16_t) * RANK);
            kvt__recall_q8_rows_level(lv);
            t = cpu_s();
            kvt__recall_q8_rows_cpu(pool, slots, B, ROW, 2 * D, KVT__DT_BF16, BD, dst, S, RANK, qs);
            take(&rq[lv], cpu_s() - t);
            if (lv)
                qsame &= !memcmp(q8, q8ref, sizeof(uint16_t) * B * S);
        }
        kvt__recall_q8_rows_level(2);
    }
    const double ns = 1e9 / B;
    printf("bench_close: one block of %u bf16 rows (512 + 64), %d repeats, thread CPU time per row "
           "(min-max); exit status 1 if a wide path's output differs from the narrow one's\n", B, reps);
    static const char *const sname[3] = {"scalar", "AVX2", "AVX-512"};
    printf("  sigma (kappa %u, %-7s) %6.0f - %6.0f ns\n", KAPPA, sname[swide], rs.lo * ns,
           rs.hi * ns);
    for (int lv = swide - 1; lv >= 0; lv--)
        printf(
            "  sigma (kappa %u, %-7s) %6.0f - %6.0f ns%s\n", KAPPA, sname[lv], rsn[lv].lo * ns,
            rsn[lv].hi * ns,
            lv ? ""
               : (same ? "; SIMD == scalar bit for bit: yes" : "; SIMD == scalar bit for bit: NO"));
    printf("  sketch rank %u (%s)  %6.0f - %6.0f ns\n", RANK, wide ? "AVX-512" : "narrow ",
           rk.lo * ns, rk.hi * ns);
    if (wide)
        printf("  sketch rank %u (narrow)  %6.0f - %6.0f ns; wide == narrow bit for bit: %s\n",
               RANK, rn.lo * ns, rn.hi * ns, same ? "yes" : "NO");
    printf("  group build (%u groups, %s) %6.0f - %6.0f ns\n", ng, gwide ? "AVX-512" : "narrow",
           rg.lo * ns, rg.hi * ns);
    if (gwide)
        printf("  group build (narrow)     %6.0f - %6.0f ns\n", rgn.lo * ns, rgn.hi * ns);
    printf("  group build in %u-row blocks, as the library builds them (%u of them) %6.0f - %6.0f "
           "ns\n",
           (unsigned)GB, (unsigned)(B / GB), rgs.lo * ns, rgs.hi * ns);
    static const char *const qname[3] = {"per row", "AVX2", "AVX-512"};
    for (int lv = 0; lv <= qlevel; lv++)
        printf("  8-bit planes (%-7s)   %6.0f - %6.0f ns%s\n", qname[lv], rq[lv].lo * ns,
               rq[lv].hi * ns,
               lv == qlevel && lv ? (qsame ? "; SIMD == per row byte for byte: yes"
                                           : "; SIMD == per row byte for byte: NO")
                                  : "");
    free(sig2);
    free(q8);
    free(q8ref);
    free(qs);
    return same && qsame ? 0 : 1;
}
