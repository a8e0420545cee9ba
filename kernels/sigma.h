/*
 * sigma.h — salience scores of the NoPE salience tier (DESIGN §2.1): the low-pass Fourier
 * residual σ of the 64-dim decoupled branch, and the two norm ablations. Pure math: no policy, no
 * state. The per-element pieces are KVT_HD inline functions so the CUDA kernels reuse them
 * unchanged; this header is read by gcc and nvcc (no restrict, _Generic or compound literals).
 *
 * σ of one closed block of B rows. R is the B x D matrix of the rows' branches (D = branch_dim,
 * 64 in practice) and C a B x n orthonormal low-frequency basis (n = 2κ − 1 columns): the real
 * Fourier columns (kvt__fourier_basis, the reference and the default) or the DCT-II columns
 * (kvt__dct_basis), as kvt_config.sigma_basis says. The basis is data: nothing below depends on
 * which. With Y = Cᵀ R (n x D):
 *
 *     σ_u = ‖ R_u − Σ_j C[u][j] Y[j] ‖₂
 *
 * i.e. the part of row u the block's slow drift along the sequence axis does not explain.
 *
 * Summation order (fixed, so a GPU kernel can reproduce the CPU twin bit for bit). Every
 * multiply-add is an explicit fmaf (one rounding; fmaf is exact-rounded in glibc and in CUDA),
 * every other operation a single IEEE fp32 add, subtract or sqrtf (correctly rounded; CUDA's
 * default -prec-sqrt=true). No operation is left for a compiler to contract.
 *
 *   1. Y = Cᵀ R, a blocked tree over u. The block is cut into P = B / KVT__SIGMA_LEAF_ROWS leaves
 *      of 64 consecutive rows. Leaf p holds, for every (j, d),
 *          part[p][j][d] = fmaf(C[j][u], R[u][d], ...) sequentially for u = 64p .. 64p+63,
 *      starting from +0.0f (kvt__sigma_leaf_step). The P partials are then summed by a
 *      stride-halving tree: for s = P/2, P/4, .., 1: part[i] = part[i] + part[i + s] for i < s
 *      (the shape of a shared-memory reduction); Y = part[0]. Error grows like 64 + log2(P)
 *      roundings instead of B for a sequential sum, which matters when a large DC/drift component
 *      is to cancel.
 *   2. Reconstruction of element (u, d): rec = fmaf(C[j][u], Y[j][d], rec) for j = 0 .. n−1
 *      ascending, from +0.0f (kvt__sigma_recon); residual e = R[u][d] − rec.
 *   3. Squared norm over d, "warp-shaped" (kvt__sumsq_lane + kvt__tree32): 32 lanes; lane l
 *      accumulates acc = fmaf(e_d, e_d, acc) for d = l, l+32, l+64, .. < D, from +0.0f; the 32 lane
 *      partials are summed by a stride-halving tree (s = 16, 8, 4, 2, 1: p[i] = p[i] + p[i+s]),
 *      which a warp does with __shfl_down_sync. σ_u = sqrtf(result).
 *
 * The ablation norms (branch norm, row norm) use the same step 3 on the raw values.
 *
 * Non-finite rows cost only themselves. A row whose branch holds any NaN or ±Inf value (a "bad
 * row", kvt__sigma_branch_finite) is left out of its block's fit: it enters step 1 as a branch of
 * zeros (kvt__sigma_fit_val), which adds exactly nothing to any partial (fmaf(c, 0, acc) = acc for
 * the accumulators here, which start at +0 and never hold −0), and its σ is +Inf without steps 2
 * and 3. Every other row of the block gets the σ it would get if the bad row's branch were zero.
 * Without this rule one NaN made Y, hence σ of all B rows, NaN; the canonical +Inf ties then went
 * to the block's lowest positions and the whole kept budget landed there. The caller counts bad
 * rows (their σ is the only non-finite output besides an fp32 overflow of a huge finite branch)
 * and kvt__score_key maps NaN/Inf to +Inf: a bad row ranks first, so it stays attended and takes
 * one slot of the budget — its own.
 */
#ifndef KVT_KERNELS_SIGMA_H
#define KVT_KERNELS_SIGMA_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kvt_hd.h"

/* Rows per leaf of the blocked Y reduction (step 1 above). B is a power of two >= 64, so P >= 1
 * is a power of two too. */
#define KVT__SIGMA_LEAF_ROWS 64u
/* Lanes of the squared-norm reduction (step 3): one warp. */
#define KVT__SIGMA_LANES 32u
/* Largest branch_dim kvt__sigma_block_cpu accepts. */
#define KVT__SIGMA_MAX_BRANCH_DIM 256u

/* Value d of the branch of one row (row points at the row's first byte), as fp32. Only the
 * branch bytes [branch_offset, branch_offset + branch_dim * elt) are read. */
KVT_HD float kvt__sigma_branch_val(const uint8_t *row, uint32_t branch_offset, int branch_dtype,
                                   uint32_t d) {
    return kvt__load_elem(row + branch_offset, branch_dtype, d);
}

/* Is every value of a row's branch finite? (exponent bits, so no compiler flag can fold it) */
KVT_HD int kvt__sigma_branch_finite(const uint8_t *row, uint32_t branch_offset, int branch_dtype,
                                    uint32_t branch_dim) {
    for (uint32_t d = 0; d < branch_dim; d++) {
        uint32_t bits = kvt__bits_from_f32(kvt__sigma_branch_val(row, branch_offset, branch_dtype, d));
        if ((bits & 0x7f800000u) == 0x7f800000u)
            return 0;
    }
    return 1;
}

/* Value d of a row's branch as the fit (step 1) sees it: the value itself, or 0 for a bad row. */
KVT_HD float kvt__sigma_fit_val(const uint8_t *row, uint32_t branch_offset, int branch_dtype,
                                uint32_t d, int row_finite) {
    return row_finite ? kvt__sigma_branch_val(row, branch_offset, branch_dtype, d) : 0.0f;
}

/* One step of a leaf of the Y reduction: acc + C[j][u] * R[u][d], one rounding. */
KVT_HD float kvt__sigma_leaf_step(float acc, float c_ju, float r_ud) {
    return fmaf(c_ju, r_ud, acc);
}

/* Reconstruction of element (u, d) from the low-pass coefficients: Σ_j C[j][u] Y[j][d], j
 * ascending, fmaf from +0. basis is [n_basis][B] (column j at basis + j * B), y is
 * [n_basis][y_stride] (row j at y + j * y_stride). */
KVT_HD float kvt__sigma_recon(const float *basis, uint32_t B, uint32_t n_basis, uint32_t u,
                              const float *y, uint32_t y_stride, uint32_t d) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < n_basis; j++)
        acc = fmaf(basis[(size_t)j * B + u], y[(size_t)j * y_stride + d], acc);
    return acc;
}

/* Residual of element (u, d): what the low-pass part leaves over. */
KVT_HD float kvt__sigma_residual(float r_ud, float rec) {
    return r_ud - rec;
}

/* Lane l's partial of a squared norm: Σ v[d]² over d = l, l+32, .. < n, fmaf from +0. */
KVT_HD float kvt__sumsq_lane(const float *v, uint32_t n, uint32_t lane) {
    float acc = 0.0f;
    for (uint32_t d = lane; d < n; d += KVT__SIGMA_LANES)
        acc = fmaf(v[d], v[d], acc);
    return acc;
}

/* Stride-halving tree over 32 lane partials (destroys p); returns p[0] + .. in the fixed order
 * s = 16, 8, 4, 2, 1: p[i] = p[i] + p[i + s]. */
KVT_HD float kvt__tree32(float *p) {
    for (uint32_t s = KVT__SIGMA_LANES / 2; s >= 1; s >>= 1)
        for (uint32_t i = 0; i < s; i++)
            p[i] = p[i] + p[i + s];
    return p[0];
}

/* Lane l's partial of a squared norm read straight from a row: elements l, l+32, .. < n of dtype
 * dt (bf16, fp16, fp32) at p, fmaf from +0. Used by the norm ablations. */
KVT_HD float kvt__elem_sumsq_lane(const uint8_t *p, int dt, uint32_t n, uint32_t lane) {
    float acc = 0.0f;
    for (uint32_t d = lane; d < n; d += KVT__SIGMA_LANES) {
        float x = kvt__load_elem(p, dt, d);
        acc = fmaf(x, x, acc);
    }
    return acc;
}

/* L2 norm of n elements of dtype dt at p, in the fixed order (lanes, tree, sqrtf). */
KVT_HD float kvt__elem_norm_fixed(const uint8_t *p, int dt, uint32_t n) {
    float part[KVT__SIGMA_LANES];
    for (uint32_t l = 0; l < KVT__SIGMA_LANES; l++)
        part[l] = kvt__elem_sumsq_lane(p, dt, n, l);
    return sqrtf(kvt__tree32(part));
}

/* L2 norm of v[0..n) in the fixed order above (lanes, then tree, then sqrtf). */
KVT_HD float kvt__norm_fixed(const float *v, uint32_t n) {
    float p[KVT__SIGMA_LANES];
    for (uint32_t l = 0; l < KVT__SIGMA_LANES; l++)
        p[l] = kvt__sumsq_lane(v, n, l);
    return sqrtf(kvt__tree32(p));
}

/* ---------------------------------------------------------------------------------------------
 * CPU twins (kernels/sigma.c)
 * ------------------------------------------------------------------------------------------- */

/* The n_basis = 2κ − 1 orthonormal low-frequency real Fourier columns over u = 0 .. B−1:
 *   column 0          1/√B
 *   column 2k − 1     √(2/B)·cos(2πku/B)   for k = 1 .. κ−1
 *   column 2k         √(2/B)·sin(2πku/B)
 * built in double (angle reduced as (k·u mod B) / B before the trig call) and stored fp32.
 * Layout: out[j * B + u] — column-major in the sense [n_basis][B], each column contiguous.
 * out holds (2κ − 1) * B floats. k stays below κ <= B/2, so no column is the zero sine at k = B/2.
 * Returns 0, or -1 (out untouched) when B is not a power of two >= 64, κ is not in 1..B/2, or out
 * is NULL. */
int kvt__fourier_basis(uint32_t B, uint32_t kappa, float *out);

/* The n_basis = 2κ − 1 first DCT-II columns over u = 0 .. B−1 (orthonormal as they stand):
 *   column 0          1/√B
 *   column k          √(2/B)·cos(πk(2u + 1)/(2B))   for k = 1 .. 2κ − 2
 * Column k makes k/2 cycles per block, so the span reaches κ − 1 cycles like the Fourier columns,
 * without assuming the block is periodic: the even extension behind DCT-II has no jump at the
 * block's ends, so a slow drift (a linear ramp, a random walk) leaves no edge residual.
 * Built in double (angle reduced as (k·(2u + 1) mod 4B) / (2B) half-turns) and stored fp32, same
 * layout and argument rules as kvt__fourier_basis (2κ − 2 < B since κ <= B/2). */
int kvt__dct_basis(uint32_t B, uint32_t kappa, float *out);

/* The basis σ uses under kvt_config.sigma_basis (KVT_SIGMA_FOURIER = 0: kvt__fourier_basis,
 * KVT_SIGMA_DCT = 1: kvt__dct_basis), 2κ − 1 columns either way. -1 for another kind. */
int kvt__sigma_basis(int kind, uint32_t B, uint32_t kappa, float *out);

/* Floats of scratch kvt__sigma_block_cpu needs: (B / 64) leaves x n_basis x branch_dim partials.
 * 0 when B < 64. */
size_t kvt__sigma_scratch_floats(uint32_t B, uint32_t n_basis, uint32_t branch_dim);

/* σ of one closed block of B rows (order documented at the top of this file). Row u is at
 * base + (size_t)slots[u] * slot_stride_bytes; its branch is branch_dim (<= 256) values of
 * branch_dtype (KVT__DT_BF16/FP16/FP32) at byte branch_offset of the row. basis is
 * kvt__sigma_basis(kind, B, κ) with n_basis = 2κ − 1 columns. scratch holds
 * kvt__sigma_scratch_floats(B, n_basis, branch_dim) floats. sigma_out[u] for u < B (+Inf for a
 * row with a non-finite branch value, which is left out of the fit). Only the branch bytes of the
 * B rows are read. Arguments are trusted (the caller validated them);
 * B must be a power of two >= 64 (KVT_ASSERT in debug builds). */
void kvt__sigma_block_cpu(const uint8_t *base, const int32_t *slots, uint32_t B,
                          size_t slot_stride_bytes, uint32_t branch_offset, int branch_dtype,
                          uint32_t branch_dim, const float *basis, uint32_t n_basis, float *scratch,
                          float *sigma_out);

/* The SIMD level kvt__sigma_block_cpu runs (sigma.c; branch_dim a multiple of 64; the same bits as
 * the scalar loops): 2 AVX-512F (16 lanes), 1 AVX2 + FMA (8 lanes), 0 the scalar loops. The
 * CPU's best level, capped by enable (0..2: tests and benches only, not thread-safe); -1 only
 * asks. */
int kvt__sigma_simd(int enable);

/* Ablation: out[u] = L2 norm of the branch of row u (same gather as σ), fp32, fixed order. */
void kvt__branch_norm_cpu(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                          size_t slot_stride_bytes, uint32_t branch_offset, int branch_dtype,
                          uint32_t branch_dim, float *out);

/* Ablation: out[u] = L2 norm of the first n_values values of row u (e.g. all 576 of an MLA row),
 * read as dtype (KVT__DT_BF16/FP16/FP32; fp8 rows are not supported here), fp32, fixed order. */
void kvt__row_norm_cpu(const uint8_t *base, const int32_t *slots, uint32_t n_rows,
                       size_t slot_stride_bytes, int dtype, uint32_t n_values, float *out);

#endif /* KVT_KERNELS_SIGMA_H */
