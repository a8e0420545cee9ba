/*
 * recall_scan.h — the recall tier's per-(query head, archived row) scores (docs/recall.md §3):
 * the exact score, the approximate score idx from the row's sketch, the conformal certificate
 * unit and the sound bound. Pure math: no policy, no state. Read by gcc and nvcc (no restrict,
 * _Generic or compound literals): the KVT_HD functions are the per-element math the CPU twin
 * (recall_scan.c) and a CUDA kernel share, each with a fixed accumulation order and
 * explicit fmaf, so fired sets are bit-equal across backends.
 *
 * A stored row is [c | r]: latent c (its first D values) and branch r (branch_dim values at
 * branch_offset). A head's absorbed query is q = [q_lat | q_br] (D + branch_dim fp32, latent
 * first: the trace format's QUERIES layout). With s the softmax scale:
 *
 *     score_a = s · (q_br · r_a + q_lat · c_a)                         (kvt__recall_exact)
 *     idx_a   = s · (q_br · r_a + q̃_sk · csk_a)                       (kvt__recall_idx)
 *     cert_a  = s · ‖q̃_res‖ · ρ_a / √(D − 64)                         (kvt__recall_cert)
 *
 * q̃_sk = q_lat Vᵀ and q̃_res = q_lat − q̃_sk V as computed in fp32 (kvt__recall_head_prep).
 *
 * Orders (every multiply-add an fmaf, every chain from +0.0f, indices ascending):
 *   exact: acc over j < branch_dim of q_br[j]·r[j], then over d < D of q_lat[d]·c[d]; s·acc.
 *   idx:   acc over j < branch_dim of q_br[j]·r[j], then over k < rank of q̃_sk[k]·f32(csk[k]);
 *          s·acc. Alongside, P = the same chain over |·| products and ‖csk‖² over k.
 *   head:  q̃_sk[k] = chain over d (kvt__sketch_coef's order); q̃_res[d] = q_lat[d] − chain over
 *          k of q̃_sk[k]·V[k][d]; norms by kvt__norm_fixed (σ's warp-shaped order).
 *
 * The sound bound (kvt__recall_sound_fires). Real arithmetic, V orthonormal: with e = c − csk V
 * = e⊥ + δV, q_lat·c − q̃_sk·csk = q_res·e⊥ + q_sk·δ + η·csk (η = q_sk − q̃_sk, the fp32 error
 * of the head's projection), so |score − idx| / s is at most
 *
 *     Qres·E + Qsk·min(E, ε) + ‖η‖·‖csk‖ + γ_n·P + γ_{D+bd}·(P + ‖q_lat‖·(‖csk‖ + E))
 *
 * where E bounds ‖e‖ from the stored ρ (ρ's own fp32 evaluation: (1 + γ_D + 2u)·ρ + γ_r·√r·‖csk‖),
 * ε bounds ‖δ‖ (fp16 rounding 2^-11‖csk‖ + 2^-25√r, plus the fp32 coefficient chain γ_D·√r·‖c‖,
 * ‖c‖ <= ‖csk‖ + E), Qres and Qsk bound the exact ‖q_res‖, ‖q_sk‖ from the computed ones (plus
 * ‖η‖ <= γ_D·√r·‖q_lat‖ and the reconstruction's γ_r·√r·‖q̃_sk‖), γ_n·P bounds idx's own fp32
 * evaluation and the last term the exact-score function's (so "kvt__recall_exact >= best" implies
 * "fired" for the fp32 score a test or an engine computes, not only for the real one). Every
 * factor gets a relative slack of 2^-8 and the whole an absolute 2^-120, which absorbs the
 * roundings of the bound's own evaluation, of the two products by s, and V's departure from
 * orthonormality at fp32 precision (tests: Gram-Schmidt in double, rounded to fp32). In cert
 * units the Qres·E term is √(D − 64) units: the sound mode takes z >= √(D − 64) and fires on
 *
 *     idx + z · s·Qres·E·(1 + 2^-8)/√(D − 64) + s·(the other terms) >= best          (not <)
 *
 * written !(lhs < best): a NaN anywhere (a non-finite query, best NaN) fires, ρ = +Inf fires.
 * A basis orthonormal only to kvt_ctx_set_recall_basis's 1e-3 per entry of V Vᵀ is not covered:
 * the library refuses sound mode unless ω = ‖V Vᵀ − I‖_F <= 2^-20, and then the slack covers ω
 * (docs/recall.md §3.1: the terms ω·‖q_sk‖·‖csk‖ and the factors √(1 + ω) it adds are below
 * 2^-9 of terms already in the bound).
 *
 * The conformal mode fires on !(idx + z·cert <= best) (a NaN fires; cert = s·‖q̃_res‖·ρ/√(D−64),
 * no rounding terms: its z is calibrated, not proven).
 */
#ifndef KVT_KERNELS_RECALL_SCAN_H
#define KVT_KERNELS_RECALL_SCAN_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kvt_hd.h"
#include "kernels/sigma.h"
#include "recall/kernels/sketch.h"

/* Trigger modes of the scan (docs/recall.md §4). */
#define KVT__RECALL_CONFORMAL 1
#define KVT__RECALL_SOUND 2
#define KVT__RECALL_MARGIN 3 /* fires on !(idx + z < best): z is the margin δ >= 0 */

/* The multiplier a trigger mode scans with: √(D − 64) in sound mode (the least sound z), the
 * margin δ in margin mode, the request's calibrated z in conformal mode. */
KVT_HD float kvt__recall_mode_z(int mode, uint32_t D, float margin, float conformal_z) {
    return mode == KVT__RECALL_SOUND    ? sqrtf((float)(D - 64u))
           : mode == KVT__RECALL_MARGIN ? margin
                                        : conformal_z;
}

/* Largest branch a scan takes (the NoPE branch is 64 on every MLA model in the census). */
#define KVT__RECALL_MAX_BRANCH 256u

/* γ_n = n·u / (1 − n·u), u = 2^-24: the relative error bound of an n-term fp32 sum/dot. */
KVT_HD float kvt__recall_gamma(uint32_t n) {
    float nu = (float)n * 5.9604645e-8f;
    return nu / (1.0f - nu);
}

/* The exact score s·(q_br·r + q_lat·c) of one row (row points at its first byte). */
KVT_HD float kvt__recall_exact(const float *q, const uint8_t *row, int dtype, uint32_t D,
                               uint32_t branch_offset, int branch_dtype, uint32_t branch_dim,
                               float s) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < branch_dim; j++)
        acc = fmaf(q[D + j], kvt__sigma_branch_val(row, branch_offset, branch_dtype, j), acc);
    for (uint32_t d = 0; d < D; d++)
        acc = fmaf(q[d], kvt__sketch_latent(row, dtype, d), acc);
    return s * acc;
}

/* What the scan keeps of one query head. */
typedef struct kvt__recall_head {
    float nlat; /* ‖q_lat‖ as computed */
    float nres; /* ‖q̃_res‖ as computed (the conformal cert's) */
    float Qres; /* >= the exact ‖q_res‖ */
    float Qsk;  /* >= the exact ‖q_sk‖ */
    float eta;  /* >= ‖q_sk − q̃_sk‖ */
} kvt__recall_head;

/* Floats of scratch kvt__recall_head_prep takes for a latent of D values. */
#define KVT__RECALL_PREP_FLOATS(D) ((size_t)(D))

/* Element d of a head's residual q̃_res (chain over k ascending from +0, then a subtraction). */
KVT_HD float kvt__recall_resid(const float *q, const float *q_sk, const float *V, uint32_t rank,
                               uint32_t D, uint32_t d) {
    float rec = 0.0f;
    for (uint32_t k = 0; k < rank; k++)
        rec = fmaf(q_sk[k], V[(size_t)k * D + d], rec);
    return q[d] - rec;
}

/* A head's fields from its three norms as computed: ‖q_lat‖, ‖q̃_res‖ and ‖q̃_sk‖ (0 at rank 0). */
KVT_HD void kvt__recall_head_bounds(float nlat, float nres, float nsk, uint32_t D, uint32_t rank,
                                    kvt__recall_head *h) {
    const float slack = 1.0f + 0.00390625f; /* 2^-8 */
    const float sqrt_r = sqrtf((float)rank);
    const float gD = kvt__recall_gamma(D + 2u);
    const float gr = kvt__recall_gamma(rank + 2u);
    h->nlat = nlat;
    h->nres = nres;
    h->eta = gD * sqrt_r * nlat * slack;
    h->Qsk = (nsk * (1.0f + gr) + h->eta) * slack;
    h->Qres = (nres * (1.0f + gD) + gr * sqrt_r * nsk + h->eta) * slack;
}

/* A head's norms and bounds from its projection q_sk and residual res[0 .. D). */
KVT_HD void kvt__recall_head_finish(const float *q, uint32_t D, uint32_t rank, const float *q_sk,
                                    const float *res, kvt__recall_head *h) {
    float nres = kvt__norm_fixed(res, D);
    float nlat = kvt__norm_fixed(q, D);
    float nsk = rank ? kvt__norm_fixed(q_sk, rank) : 0.0f;
    kvt__recall_head_bounds(nlat, nres, nsk, D, rank, h);
}

/* A head's projection q̃_sk[0 .. rank) (out) and norms. V: [rank][D] (NULL when rank is 0);
 * tmp: D floats. */
KVT_HD void kvt__recall_head_prep(const float *q, uint32_t D, const float *V, uint32_t rank,
                                  float *q_sk, float *tmp, kvt__recall_head *h) {
    for (uint32_t k = 0; k < rank; k++)
        q_sk[k] = kvt__sketch_coef(q, D, V + (size_t)k * D);
    for (uint32_t d = 0; d < D; d++)
        tmp[d] = kvt__recall_resid(q, q_sk, V, rank, D, d);
    kvt__recall_head_finish(q, D, rank, q_sk, tmp, h);
}

/* idx of one row, and its side sums: *P = Σ|products| (same chain), *ncsk = ‖csk‖ (chain over
 * k, then sqrtf). csk: the row's rank fp16 values. */
KVT_HD float kvt__recall_idx(const float *q, const float *q_sk, const uint8_t *row, uint32_t D,
                             uint32_t branch_offset, int branch_dtype, uint32_t branch_dim,
                             const uint16_t *csk, uint32_t rank, float s, float *P, float *ncsk) {
    float acc = 0.0f, pa = 0.0f, n2 = 0.0f;
    for (uint32_t j = 0; j < branch_dim; j++) {
        float qj = q[D + j], rj = kvt__sigma_branch_val(row, branch_offset, branch_dtype, j);
        acc = fmaf(qj, rj, acc);
        pa = fmaf(fabsf(qj), fabsf(rj), pa);
    }
    for (uint32_t k = 0; k < rank; k++) {
        float ck = kvt__f16_to_f32(csk[k]);
        acc = fmaf(q_sk[k], ck, acc);
        pa = fmaf(fabsf(q_sk[k]), fabsf(ck), pa);
        n2 = fmaf(ck, ck, n2);
    }
    *P = pa;
    *ncsk = sqrtf(n2);
    return s * acc;
}

/* kvt__recall_cert with sq = sqrtf((float)(D − 64)) given (a loop over rows takes it once). */
KVT_HD float kvt__recall_cert_by(const kvt__recall_head *h, float rho, float s, float sq) {
    return s * h->nres * rho / sq;
}

/* The conformal certificate unit s·‖q̃_res‖·ρ/√(D − 64) (D > 64; 0·Inf is NaN: the trigger
 * fires on it). */
KVT_HD float kvt__recall_cert(const kvt__recall_head *h, float rho, float s, uint32_t D) {
    return kvt__recall_cert_by(h, rho, s, sqrtf((float)(D - 64u)));
}

/* The sound margin of a row: z·(the Qres·E term in cert units) + s·(the other terms), the
 * header comment's bound on |score − idx| when z >= √(D − 64). NaN when an input is NaN; +Inf
 * for ρ = +Inf (or NaN when the head's Qres is 0: the trigger fires on both). */
KVT_HD float kvt__recall_sound_margin(const kvt__recall_head *h, float idx, float P, float ncsk,
                                      float rho, float s, float z, uint32_t D,
                                      uint32_t branch_dim, uint32_t rank) {
    const float slack = 1.0f + 0.00390625f;
    const float sqrt_r = sqrtf((float)rank);
    const float gD = kvt__recall_gamma(D + 2u);
    const float gr = kvt__recall_gamma(rank + 2u);
    const float gn = kvt__recall_gamma(branch_dim + rank + 2u);
    const float gx = kvt__recall_gamma(D + branch_dim + 2u);
    float ncsk_b = ncsk * (1.0f + gr) * slack;
    float E = (rho * (1.0f + gD) + gr * sqrt_r * ncsk_b) * slack;
    float eps = (4.8828125e-4f * ncsk_b + 2.9802322e-8f * sqrt_r + gD * sqrt_r * (ncsk_b + E)) *
                slack;
    float dmin = eps < E ? eps : E;
    float unit = s * (h->Qres * E * slack) / sqrtf((float)(D - 64u));
    float rest = h->Qsk * dmin + h->eta * ncsk_b + gn * P * slack +
                 gx * (P * slack + h->nlat * slack * (ncsk_b + E));
    rest = s * (rest * slack + 2.0f * 5.9604645e-8f * (fabsf(idx / s) + rest)) + 7.5231638e-37f;
    return z * unit + rest;
}

/* Sound trigger: !(idx + margin < best) — at the threshold fires; a NaN fires. */
KVT_HD int kvt__recall_sound_fires(float idx, float margin, float best) {
    return !(idx + margin < best);
}

/* Conformal trigger: !(idx + z·cert <= best). */
KVT_HD int kvt__recall_conformal_fires(float idx, float cert, float z, float best) {
    return !(idx + z * cert <= best);
}

/* ---------------------------------------------------------------------------------------------
 * The 8-bit scan (params.recall_scan_bits = 8; docs/recall.md §3.3). Each closed row's sketch
 * row (csk_stride fp16 words) carries, from fp16 word q8_off (the fp16 part's width) on, an 8-bit
 * plane written at the close (kvt__recall_q8_row): six fp32 values {s_r, s_c, e_r, n_r, e_c, n_c}
 * then J4 = kvt__recall_q8_len(branch_dim, q8_off) bytes u8 = q + 128 (q in [-127, 127]): the
 * branch r quantised as s_r·q (branch_dim values), then the fp16 sketch csk as s_c·q (q8_off
 * values; entries past the basis rank 0), padded with 128 (zero) to a multiple of 4. e_r >=
 * ‖r − s_r·q_r‖ and e_c >= ‖csk − s_c·q_c‖ (the rounding errors), n_r >= ‖s_r·q_r‖, n_c >=
 * ‖s_c·q_c‖. A head's q_br and q̃_sk are quantised the same way at the step (kvt__recall_q8_head,
 * per-head scales t_b, t_s), so its integer dots I_b = Σ q_b·q_r and I_s = Σ q_s·q_c are exact in
 * int32 in any order (|I| <= 512·127² < 2^24: exact in fp32 too). Then
 *
 *     idx8 = s·((t_b·s_r)·I_b + (t_s·s_c)·I_s)                          (kvt__recall_q8_idx)
 *
 * and, in real arithmetic, q·r − q̂·r̂ = q·e_r + e_q·r̂ for each part, so the 16-bit scan's idx (the
 * fp32 value kvt__recall_idx returns) is within
 *
 *     B = s·(Qb·e_r + Eb·n_r + Qs·e_c + Es·n_c + 2^-15·(Qb·(n_r + e_r) + Qs·(n_c + e_c) + Qb̂·n_r
 *           + Qŝ·n_c))·(1 + 2^-8)                                       (kvt__recall_q8_bound)
 *
 * of idx8 (Qb, Qs >= ‖q_br‖, ‖q̃_sk‖; Eb, Es >= the query's rounding errors; Qb̂, Qŝ >= the
 * quantised queries' norms; the 2^-15 term covers the fp32 evaluation of kvt__recall_idx, γ_512 <
 * 2^-15, and of idx8). The triggers widen by B, so the 8-bit scan fires every row the 16-bit scan
 * fires (a superset: tests/test_recall_scan.c):
 *   conformal: !((idx8 + B') + z·cert <= best), B' = B + 2^-22·(|idx8| + B + |z·cert|) (the
 *              roundings of the two additions); cert and the calibrated z are the 16-bit mode's
 *              (the calibration scores the 16-bit idx of the best archived row), so z still means
 *              what it did: |score − idx16| <= z·cert on the calibrated quantile, and idx8 + B >=
 *              idx16 always.
 *   sound:     !(idx8 + m8 < best), m8 = (kvt__recall_sound_margin(h, |idx8| + B, P', ‖csk‖', ρ)
 *              + B)·(1 + 2^-8) with P' = Qb·(n_r + e_r) + Qs·(n_c + e_c) >= Σ|products| and ‖csk‖'
 *              = n_c + e_c (the margin is nondecreasing in all three).
 *   margin:    !((idx8 + B) + z < best).
 * A non-finite row gets e_r = e_c = +Inf (fires); a non-finite query a NaN scale (fires).
 * ------------------------------------------------------------------------------------------- */
/* fp32 values ahead of the plane's bytes. */
#define KVT__Q8_FLOATS 6u

/* Bytes of a row's (or a head's) 8-bit vector: branch then sketch, padded to a multiple of 4. */
KVT_HD uint32_t kvt__recall_q8_len(uint32_t branch_dim, uint32_t sk_width) {
    return (branch_dim + sk_width + 3u) / 4u * 4u;
}

/* fp16 words of a sketch row the 8-bit plane adds (after the sk_width fp16 values). */
KVT_HD uint32_t kvt__recall_q8_words(uint32_t branch_dim, uint32_t sk_width) {
    return (4u * KVT__Q8_FLOATS + kvt__recall_q8_len(branch_dim, sk_width)) / 2u;
}

/* Quantise x[0 .. n) with one scale: out[i] = q_i + 128, q_i = round(x_i · 127/max|x|) clamped
 * to ±127 (n values; the caller pads). Returns the scale t = max|x|/127 (0 for all-zero x) and
 * sets *e >= ‖x − t·q‖ (the errors and their squares summed in double: x − t·q is exact there
 * before one rounding), *nq >= ‖t·q‖, *sum = Σ q_i. Non-finite x: t = NaN, *e = +Inf, every q 0. */
KVT_HD float kvt__recall_q8_quant(const float *x, uint32_t n, uint8_t *out, float *e, float *nq,
                                  int32_t *sum) {
    const float slack = 1.0f + 0.00390625f;
    float m = 0.0f;
    int fin = 1;
    for (uint32_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        fin &= a <= 3.4028235e38f;
        m = a > m ? a : m;
    }
    int32_t s = 0;
    if (!fin) {
        for (uint32_t i = 0; i < n; i++)
            out[i] = 128u;
        *e = INFINITY;
        *nq = 0.0f;
        *sum = 0;
        return NAN;
    }
    const float t = m / 127.0f, inv = m > 0.0f ? 127.0f / m : 0.0f;
    double e2 = 0.0; /* in double: x − t·q exact before one rounding, no fmaf (a libm call on a
                      * target without FMA) */
    int32_t q2 = 0;
    for (uint32_t i = 0; i < n; i++) {
        /* round to nearest even by the 1.5·2^23 trick (|x·inv| <= 127·(1 + 2^-23): exact, and
         * rintf's value; no libm call where the target lacks a rounding instruction) */
        float r = (x[i] * inv + 12582912.0f) - 12582912.0f;
        /* a subnormal max overflows inv: 0·Inf is NaN (q 0; the error below is then x itself) */
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r == r ? r : 0.0f;
        const int32_t q = (int32_t)r;
        const double d = (double)x[i] - (double)t * (double)r; /* t·q exact in double */
        e2 += d * d;
        q2 += q * q;
        s += q;
        out[i] = (uint8_t)(q + 128);
    }
    *e = (float)sqrt(e2) * slack; /* the rounding to float is within the slack */
    *nq = t * sqrtf((float)q2) * slack;
    *sum = s;
    return t;
}

/* The 8-bit plane of one row (kvt__recall_q8_words(branch_dim, sk_width) fp16 words at out):
 * its branch (row, branch_offset/dtype/dim) and its fp16 sketch csk[0 .. sk_width). tmp: room for
 * branch_dim + sk_width floats. */
KVT_HD void kvt__recall_q8_row(const uint8_t *row, uint32_t branch_offset, int branch_dtype,
                               uint32_t branch_dim, const uint16_t *csk, uint32_t sk_width,
                               float *tmp, uint8_t *out) {
    float f[KVT__Q8_FLOATS];
    uint8_t *v = out + 4u * KVT__Q8_FLOATS;
    int32_t sum;
    for (uint32_t j = 0; j < branch_dim; j++)
        tmp[j] = kvt__sigma_branch_val(row, branch_offset, branch_dtype, j);
    for (uint32_t k = 0; k < sk_width; k++)
        tmp[branch_dim + k] = kvt__f16_to_f32(csk[k]);
    f[0] = kvt__recall_q8_quant(tmp, branch_dim, v, &f[2], &f[3], &sum);
    f[1] = kvt__recall_q8_quant(tmp + branch_dim, sk_width, v + branch_dim, &f[4], &f[5], &sum);
    if (!(f[0] == f[0]) || !(f[1] == f[1])) { /* a non-finite row fires wherever it is read */
        f[0] = f[1] = 0.0f;
        f[2] = f[4] = INFINITY;
    }
    for (uint32_t i = branch_dim + sk_width; i < kvt__recall_q8_len(branch_dim, sk_width); i++)
        v[i] = 128u;
    for (uint32_t i = 0; i < KVT__Q8_FLOATS; i++) { /* bytes: the plane's alignment is 2 */
        const uint32_t b = kvt__bits_from_f32(f[i]);
        for (uint32_t k = 0; k < 4u; k++)
            out[4u * i + k] = (uint8_t)(b >> (8u * k));
    }
}

/* The plane's fp32 values of a row (little-endian bytes; on the device one kvt__dev_ld_u32, no
 * byte loads: kernels/kvt_hd.h, scripts/ptx-check.sh). */
KVT_HD float kvt__recall_q8_f(const uint8_t *pl, uint32_t i) {
    const uint8_t *b = pl + 4u * i;
#if defined(__CUDA_ARCH__)
    return kvt__f32_from_bits(kvt__dev_ld_u32(b));
#else
    return kvt__f32_from_bits((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                              (uint32_t)b[3] << 24);
#endif
}

/* What the 8-bit scan keeps of one query head (besides its quantised vector). */
typedef struct kvt__recall_q8h {
    float tb, ts;   /* scales of q_br and q̃_sk */
    float Qb, Qs;   /* >= ‖q_br‖, ‖q̃_sk‖ */
    float Eb, Es;   /* >= the quantisation errors */
    float Nb, Ns;   /* >= the quantised vectors' norms */
    int32_t sb, ss; /* Σ of the quantised values (the u8 offset's correction) */
} kvt__recall_q8h;

/* Quantise head q's q_br (q + D, branch_dim) and q̃_sk (q_sk[0 .. rank), zeros to sk_width) into
 * out (kvt__recall_q8_len bytes, as a row's: q + 128) and h. tmp: branch_dim + sk_width floats. */
KVT_HD void kvt__recall_q8_head(const float *q, uint32_t D, uint32_t branch_dim,
                                const float *q_sk, uint32_t rank, uint32_t sk_width, float *tmp,
                                uint8_t *out, kvt__recall_q8h *h) {
    const float slack = 1.0f + 0.00390625f;
    for (uint32_t j = 0; j < branch_dim; j++)
        tmp[j] = q[D + j];
    for (uint32_t k = 0; k < sk_width; k++)
        tmp[branch_dim + k] = k < rank ? q_sk[k] : 0.0f;
    h->tb = kvt__recall_q8_quant(tmp, branch_dim, out, &h->Eb, &h->Nb, &h->sb);
    h->ts = kvt__recall_q8_quant(tmp + branch_dim, sk_width, out + branch_dim, &h->Es, &h->Ns,
                                 &h->ss);
    h->Qb = branch_dim ? kvt__norm_fixed(tmp, branch_dim) * slack : 0.0f;
    h->Qs = sk_width ? kvt__norm_fixed(tmp + branch_dim, sk_width) * slack : 0.0f;
    for (uint32_t i = branch_dim + sk_width; i < kvt__recall_q8_len(branch_dim, sk_width); i++)
        out[i] = 128u;
}

/* The integer dots of a row's and a head's vectors (u8 = q + 128 both): *ib over the branch
 * (branch_dim values), *is over the sketch (the rest of len, a multiple of 4). Exact in int32 in
 * any order: on the device four values a load (kvt__dev_ld_u32: no byte loads), the same sums. */
KVT_HD void kvt__recall_q8_dots(const uint8_t *x, const uint8_t *qv, uint32_t branch_dim,
                                uint32_t len, int32_t *ib, int32_t *is) {
    int32_t b = 0, c = 0;
#if defined(__CUDA_ARCH__)
    for (uint32_t j = 0; j < len; j += 4u) {
        const uint32_t xw = kvt__dev_ld_u32(x + j), qw = kvt__dev_ld_u32(qv + j);
        for (uint32_t k = 0; k < 4u; k++) {
            const int32_t p = ((int32_t)(xw >> (8u * k) & 255u) - 128) *
                              ((int32_t)(qw >> (8u * k) & 255u) - 128);
            if (j + k < branch_dim)
                b += p;
            else
                c += p;
        }
    }
#else
    for (uint32_t j = 0; j < branch_dim; j++)
        b += ((int32_t)x[j] - 128) * ((int32_t)qv[j] - 128);
    for (uint32_t j = branch_dim; j < len; j++)
        c += ((int32_t)x[j] - 128) * ((int32_t)qv[j] - 128);
#endif
    *ib = b;
    *is = c;
}

/* idx8 of a (row, head) from its integer dots; pl: the row's plane. */
KVT_HD float kvt__recall_q8_idx(const kvt__recall_q8h *h, const uint8_t *pl, int32_t ib,
                                int32_t is, float s) {
    const float a = (h->tb * kvt__recall_q8_f(pl, 0)) * (float)ib;
    const float b = (h->ts * kvt__recall_q8_f(pl, 1)) * (float)is;
    return s * (a + b);
}

/* B: the bound on |idx16 − idx8| (score units) of the block comment above. */
KVT_HD float kvt__recall_q8_bound(const kvt__recall_q8h *h, const uint8_t *pl, float s) {
    const float er = kvt__recall_q8_f(pl, 2), nr = kvt__recall_q8_f(pl, 3);
    const float ec = kvt__recall_q8_f(pl, 4), nc = kvt__recall_q8_f(pl, 5);
    const float main = h->Qb * er + h->Eb * nr + h->Qs * ec + h->Es * nc;
    const float rnd = h->Qb * (nr + er) + h->Qs * (nc + ec) + h->Nb * nr + h->Ns * nc;
    return s * (main + 3.0517578e-5f * rnd) * (1.0f + 0.00390625f);
}

/* Does a (row, head) fire in the 8-bit scan? The block comment's triggers, in this order. */
KVT_HD int kvt__recall_q8_fires(const kvt__recall_head *hd, const kvt__recall_q8h *h,
                                const uint8_t *pl, int32_t ib, int32_t is, float rho, float s,
                                float z, float best, int mode, uint32_t D, uint32_t branch_dim,
                                uint32_t rank) {
    const float idx = kvt__recall_q8_idx(h, pl, ib, is, s);
    const float B = kvt__recall_q8_bound(h, pl, s);
    if (mode == KVT__RECALL_SOUND) {
        const float nc = kvt__recall_q8_f(pl, 5) + kvt__recall_q8_f(pl, 4);
        const float P = h->Qb * (kvt__recall_q8_f(pl, 3) + kvt__recall_q8_f(pl, 2)) + h->Qs * nc;
        const float m = kvt__recall_sound_margin(hd, fabsf(idx) + B, P, nc, rho, s, z, D,
                                                 branch_dim, rank);
        return kvt__recall_sound_fires(idx, (m + B) * (1.0f + 0.00390625f), best);
    }
    if (mode == KVT__RECALL_MARGIN)
        return !((idx + B) + z < best);
    const float zc = z * kvt__recall_cert(hd, rho, s, D);
    const float Bp = B + 2.3841858e-7f * (fabsf(idx) + B + fabsf(zc));
    return !((idx + Bp) + zc <= best);
}

/* ---------------------------------------------------------------------------------------------
 * CPU twin (recall_scan.c)
 * ------------------------------------------------------------------------------------------- */
struct kvt__recall_scan_args;

/* Floats of scratch kvt__recall_scan_cpu takes. */
size_t kvt__recall_scan_scratch_floats(uint32_t n_heads, uint32_t rank, uint32_t D);

/* kvt__f16_to_f32 as the CPU twin computes it (branch-free; the same value for every input). */
float kvt__recall_f16_fast(uint16_t h);

/* Floats of scratch kvt__recall_heads_prep_cpu takes: 16 heads' latents, projections and norm
 * partials transposed ([D], [rank] and [32] rows of 16 lanes; more than D, head by head's tmp). */
#define KVT__RECALL_HEADS_PREP_FLOATS(D, rank) (16u * ((size_t)(D) + (size_t)(rank) + 32u))

/* The heads' preparation: for h < n_heads, head h's query at q + h·q_stride (its q_lat, D values)
 * gives q̃_sk at q_sk + h·rank and its fields in heads[h], bit for bit what kvt__recall_head_prep
 * gives (every chain the same fmaf sequence; tests/test_recall_scan.c). The heads go 16 (AVX-512)
 * or 8 (AVX2 + FMA) a vector, one head a lane, where the CPU has them (kvt__recall_prep_level);
 * else head by head. V: [rank][D] (NULL when rank is 0); q_stride < 2^27 (a query's D +
 * branch_dim floats: at most 1280); scratch: KVT__RECALL_HEADS_PREP_FLOATS(D, rank) floats. */
void kvt__recall_heads_prep_cpu(const float *q, size_t q_stride, uint32_t n_heads, uint32_t D,
                                const float *V, uint32_t rank, float *q_sk,
                                kvt__recall_head *heads, float *scratch);

/* The SIMD level of kvt__recall_heads_prep_cpu: 2 AVX-512 (16 heads a vector), 1 AVX2 + FMA (8),
 * 0 head by head. The CPU's best level, capped by enable (0..2: tests and benches only, not
 * thread-safe); -1 only asks. */
int kvt__recall_prep_level(int enable);

/* One work item (kernels/backend.h), arguments checked by the caller: the heads prepared, then
 * the archived rows ascending, each against the heads in order until one fires. On x86-64 with
 * AVX2 and FMA it runs the tiled scan (recall_scan.c: a GEMM over chunks of rows × all
 * heads, every (row, head) chain still kvt__recall_idx's fmaf sequence), else the row-wise one;
 * the outputs are the same bits either way. */
void kvt__recall_scan_cpu(const struct kvt__recall_scan_args *a, float *scratch);

/* The row-wise scan (one row at a time against every head): the reference the tiled scan is
 * tested against, and the scan where the tiled one is not built or the CPU lacks AVX2/FMA. */
void kvt__recall_scan_rowwise_cpu(const struct kvt__recall_scan_args *a, float *scratch);

/* Whether kvt__recall_scan_cpu runs the tiled scan; enable 0 or 1 switches it (tests only, not
 * thread-safe), -1 only asks. 0 where it is not built or the CPU lacks AVX2/FMA. */
int kvt__recall_scan_tiled(int enable);
/* Whether the tiled chains take 32 heads an instruction group on AVX-512 (conformal and margin
 * modes; the same bits as the AVX2 tiles); enable 0 or 1 switches it (tests only), -1 asks. */
int kvt__recall_scan_wide(int enable);

/* The SIMD level of the 8-bit scan (args.q8_off; branch_dim a multiple of 4): 3 the AMX dots
 * (tdpbusd tiles of 16 rows × 16 heads; x86-64 Linux with amx-tile and amx-int8, where the
 * process is granted the tile data: asked once, arch_prctl ARCH_REQ_XCOMP_PERM), 2 the AVX-512
 * VNNI dots (vpdpbusd), 1 the AVX2 ones (vpmaddwd), 0 the per-element functions row by row — the
 * same integer dots, so the same bits. The CPU's best level, capped by enable (0..3: tests only,
 * not thread-safe); -1 only asks. */
int kvt__recall_scan_q8_level(int enable);

/* Whether the conformal 8-bit scan of levels 2 and 3 screens rows (recall_scan.c: a bound on the
 * trigger's value from a few multiply-adds; a row it cannot rule out runs the trigger, so the
 * fired set is the same either way); enable 0 or 1 switches it (tests only, not thread-safe), -1
 * only asks. 0 where the tiled scan is not built. */
int kvt__recall_scan_q8_screen(int enable);
/* Rows the screen has ruled out in this process (tests). */
uint64_t kvt__recall_scan_q8_screened(void);

/* Floats of scratch kvt__recall_q8_rows_cpu takes. */
size_t kvt__recall_q8_rows_scratch_floats(uint32_t branch_dim, uint32_t sk_width);

/* The 8-bit planes of a block's rows (q8_plane.c): for u < n, the row at base + slots[u]·
 * slot_stride (its branch: branch_offset bytes, branch_dtype, branch_dim values) and its fp16
 * sketch csk + u·csk_stride (sk_width values) give the plane at fp16 word sk_width of that sketch
 * row — kvt__recall_q8_row's bytes, computed with AVX-512 or AVX2 where the CPU has them and the
 * parts are whole vectors (kvt__recall_q8_rows_level), the same bits either way. */
void kvt__recall_q8_rows_cpu(const uint8_t *base, const int32_t *slots, uint32_t n,
                             size_t slot_stride, uint32_t branch_offset, int branch_dtype,
                             uint32_t branch_dim, uint16_t *csk, size_t csk_stride,
                             uint32_t sk_width, float *scratch);

/* The SIMD level of kvt__recall_q8_rows_cpu: 2 AVX-512 (F, BW, VL; 16 lanes, parts multiples of
 * 16), 1 AVX2 + F16C (8 lanes, multiples of 8), 0 kvt__recall_q8_row row by row. The CPU's best
 * level, capped by enable (0..2: tests and benches only, not thread-safe); -1 only asks. */
int kvt__recall_q8_rows_level(int enable);

/* The register-tiled chains on their own (the recall step's exact scores use them): acc[r][h] =
 * the chain of fmaf(qT[j][h], X[r][j], ·) over j = 0 .. J ascending from +0, for rows r < nr of X
 * (stride J) and columns h < HP of qT ([J][HP]) — bit for bit the scalar chain. Returns 0, with
 * nothing written, where the tiled scan does not run (kvt__recall_scan_tiled) or nr is not a
 * multiple of 6 or HP of 8: the caller computes the chains itself. */
int kvt__recall_chains_tiled(const float *X, size_t J, const float *qT, size_t HP, size_t nr,
                             float *acc);

/* Tests: the tiled scan's idx chains (acc) and, in sound mode, |·| chains (pa) of rows[0 .. n)
 * (archived or not; any n), [n][kvt__recall_scan_heads_padded(n_heads)] each; scratch as for
 * kvt__recall_scan_cpu. Returns 0 (nothing written) where the tiled scan does not run. */
int kvt__recall_scan_tile_chains_cpu(const struct kvt__recall_scan_args *a, float *scratch,
                                     const uint64_t *rows, uint32_t n, float *acc, float *pa);

/* Tests: the 8-bit scan's dots (args.q8_off) of every archived row, ascending, against every
 * head, [archived rows][n_heads] int32 each (ib the branch's, is the sketch's, as
 * kvt__recall_q8_dots gives them), computed as kvt__recall_scan_cpu does at the current level;
 * scratch as for kvt__recall_scan_cpu. Returns the level, or 0 (nothing written) where the scan
 * runs the per-element functions. */
int kvt__recall_scan_q8_dots_cpu(const struct kvt__recall_scan_args *a, float *scratch,
                                 int32_t *ib, int32_t *is);

/* The pieces kvt__recall_scan_cpu is made of, for the pruned scan (recall_group.h),
 * which evaluates the rows of the groups it cannot skip exactly as the full scan does. */
typedef struct kvt__recall_scan_prep {
    float *q_sk;             /* [n_heads][rank] */
    kvt__recall_head *heads; /* [n_heads] */
    float *qT;               /* [branch_dim + rank][HP]: q_br then q̃_sk, padding heads zero */
    size_t HP;               /* heads rounded up to whole tiles */
    float *rb, *ck;          /* a row's branch [branch_dim] and sketch [rank] as fp32 */
    float *acc, *pa;         /* [HP] each: the columns' idx and |·| chains of a row */
    float *X;                /* the tiled scan's chunk of rows' embeddings [rows][bd + rank] */
    float *tacc, *tpa;       /* [rows][HP] each: their idx and |·| chains */
    float *snres, *tbest;    /* [HP] each: s·‖q̃_res‖ and best per head (tiled conformal) */
    float *q8f;              /* 8-bit scan: the heads' kvt__recall_q8h values, [10][HP] */
    uint8_t *q8v, *q8p;      /* their vectors [HP][q8len], the SIMD dots' packing */
    int16_t *q8x;            /* the AVX2 dots' rows widened, [CHUNK_ROWS][q8len] */
    uint32_t q8len;          /* kvt__recall_q8_len (0: a 16-bit scan) */
    float *q8pf;             /* the conformal 8-bit trigger's screen, [7][HP] (recall_scan.c) */
    int q8pf_on;             /* whether the screen runs (its inputs are in range) */
} kvt__recall_scan_prep;

/* Head h's 8-bit values as the per-element functions take them (a prepared 8-bit scan). */
kvt__recall_q8h kvt__recall_scan_q8h(const kvt__recall_scan_prep *p, size_t h);

/* Heads rounded up to whole tiles of the twin (the columns of a transposed query block). */
size_t kvt__recall_scan_heads_padded(uint32_t n_heads);

/* Prepare every head of a into scratch (kvt__recall_scan_scratch_floats floats). */
void kvt__recall_scan_prep_cpu(const struct kvt__recall_scan_args *a, float *scratch,
                               kvt__recall_scan_prep *p);

/* Does row fire for one of n heads? The heads' queries are the columns of qT ([branch_dim +
 * rank][HP], HP a multiple of the tile, columns n .. HP zero); column t is head hmap[t] (hmap
 * NULL: head t). The full scan passes p->qT, p->HP, NULL, n_heads. Per (row, head) the bits are
 * kvt__recall_idx's and the trigger functions': which heads share a tile changes none. */
int kvt__recall_row_fires_cpu(const struct kvt__recall_scan_args *a,
                              const kvt__recall_scan_prep *p, const float *qT, size_t HP,
                              const uint32_t *hmap, uint32_t n, uint64_t row);

/* Does each of rows[0 .. n) fire? fire[i] = kvt__recall_row_fires_cpu(a, p, qT, QP, hmap, nc,
 * rows[i]) bit for bit (QP a multiple of 8, at most p->HP; nc <= QP), through the tiled
 * evaluation where kvt__recall_scan_cpu runs it (the listed rows a chunk at a time against every
 * column), else row by row. Writes p's chunk and column scratch. The 8-bit scan (a->q8_off):
 * every head, not only the listed ones (the caller lists every head that can fire: a row's
 * decision is the full scan's either way), on the full scan's tiles where it runs them, else
 * through kvt__recall_q8_dots and kvt__recall_q8_fires row by row (qT, QP and hmap unread). */
void kvt__recall_rows_fire_cpu(const struct kvt__recall_scan_args *a, kvt__recall_scan_prep *p,
                               const float *qT, size_t QP, const uint32_t *hmap, uint32_t nc,
                               const uint64_t *rows, uint32_t n, uint8_t *fire);

#endif /* KVT_KERNELS_RECALL_SCAN_H */
