/*
 * recall_group.h — the pruned recall scan (issue 10 item 5, docs/recall.md §3.2): at block close
 * the rows of the block are partitioned into groups of 32..64 similar rows, each with a centre, a
 * radius and the extremes of ρ and ‖csk‖; a step skips a whole group when no head can fire on any
 * member, and evaluates the members of the others exactly as the full scan does
 * (recall_scan.h), so its output is the full scan's, bit for bit. Read by gcc and nvcc
 * (no restrict, _Generic or compound literals).
 *
 * The space. idx is linear in a row's embedding x = [r | f32(csk)] (branch_dim + rank values):
 * idx_a = s·acc_a, acc_a = the fmaf chain of y·x_a with y = [q_br | q̃_sk] of the head
 * (kvt__recall_idx's chain). Groups are built and bounded in that space.
 *
 * Layout, per closed block of B rows (B = block_rows, a power of two >= 64), G = B/32 group
 * slots (the most a block can have; n_groups of them used):
 *
 *     perm     [B]        uint32  row offsets in the block, group-major, ascending within a
 *                                 group (a permutation of 0..B-1)
 *     n_groups [1]        uint32
 *     end      [G]        uint32  group g's members are perm[end[g-1] .. end[g]) (end[-1] = 0)
 *     centre   [G][dim]   fp32    dim >= branch_dim + rank (the layer's stride); zero past it
 *     stat     [G][5]     fp32    radius, ‖centre‖ bound, ρ max, ρ min, ‖csk‖ max
 *
 * Bytes per row: 4 (perm) + (4 + 4·dim + 20)/32 for the group slots, 4/B for n_groups: at
 * dim = 128 (rank 64), 4 + 16.75 = 20.75 B a row as allocated (4 + ~12.5 as used: the bench's
 * blocks average ~43 rows a group), against the sketch's 132.
 *
 * The build (kvt__recall_group_block_cpu; every choice deterministic, ties by position, so a
 * GPU twin over the same KVT_HD functions builds the same groups). A segment of n > 64 rows
 * splits in two: its fp32 mean m (sum over the segment in order, then / n), p1 = the row
 * farthest from m, p2 = the row farthest from p1 (first in segment order on a tie), v = x_p2 −
 * x_p1, t_a = v·x_a (fmaf chain); the segment is sorted by (t, row offset) (t by its total-order
 * key: no comparison is ambiguous) and cut at k in [q, n − q], q = max(32, ⌊n/4⌋), minimising
 * the two sides' sum of squared deviations of t (1-D 2-means, computed in double from the sorted
 * t; on equal costs the k nearest n/2, then the smaller). A segment of n <= 64 is a group; every
 * group holds 32..64 rows. Depth-first, left first: groups are numbered left to right; then each
 * group's members are sorted ascending (a scan reads them in row order).
 *
 * Per group: centre c = fp32 mean of its members (sum in perm order, then / count); radius R =
 * max over members of kvt__recall_radius_up(kvt__recall_dist2(x_a, c)), a true upper bound of
 * the real ‖x_a − c‖ (below); ‖c‖ bound likewise; ρ max / min over members of the stored ρ;
 * ‖csk‖ max = max over members of kvt__recall_csk_norm (the scan's own ‖csk‖ chain: the same bits).
 * A member with a NaN or infinite value makes the radius +Inf: that group is never skipped.
 *
 * The bound (kvt__recall_group_live). For a member a, head h, with Y >= ‖y‖ (double, per step),
 * Nc >= ‖c‖, R >= ‖x_a − c‖, n = branch_dim + rank, u = 2^-24:
 *
 *     acc_a <= y·x_a + γ_n·Σ|y_j||x_aj|           (the fp32 chain; Σ|y||x| <= Y·(Nc + R))
 *     y·x_a  = y·c + y·(x_a − c) <= y·c + Y·R      (Cauchy–Schwarz)
 *
 * and y·c is computed by the same kind of chain (kvt__recall_group_ydot: error <= γ_n·Y·Nc).
 * With MAG = s·Y·(Nc + R) and the stated rounding ε = 2·γ_{n+8} + 2^-16 (the two chains, the
 * products by s, the final addition, the bound's own double evaluation, and 2^-16 for the
 * certificate term below), every member's fp32 trigger left-hand side is at most
 *
 *     U = s·(yc + Y·R) + T + ε·(MAG + |T|) + 2^-100
 *
 * T, the certificate term, from the fp32 functions of the full scan at the group's extremes:
 *   conformal: T = z · kvt__recall_cert(h, ρ max) (ρ min when z < 0): cert is nondecreasing in ρ
 *     and every fp32 rounding is monotone, so each member's z·cert is at most T (up to 2^-16·|T|
 *     should a compiler contract the two evaluations differently);
 *   sound: T = kvt__recall_sound_margin(h, Imax, Pmax, ‖csk‖ max, ρ max) with Imax >= s·Y·(Nc +
 *     R)·(1 + ε) >= |idx_a| and Pmax >= Y·(Nc + R)·(1 + ε) >= P_a: the margin is a composition of
 *     fp32 +, ·, min and |idx/s| over nonnegative values, nondecreasing in each of ρ, ‖csk‖, P,
 *     |idx|, so it bounds every member's margin.
 * The group is skipped for head h when U < best_h (strict: the sound trigger fires at equality;
 * a NaN best never skips). A group is skipped when it is skipped for every head. The bound's
 * no-overflow argument needs finite, moderate magnitudes: s and |z| <= 2^20, the head's norms,
 * Y, R, Nc, ρ max and ‖csk‖ max <= 2^40 (products of four stay below fp32's range, so no member's
 * evaluation can overflow to Inf or NaN); outside that (a NaN or Inf anywhere, ρ = +Inf rows,
 * absurd scales) the group is live and evaluated exactly. Members that are sinks or kept are not
 * archived: they are never evaluated and never fire (the bound over all members bounds the
 * archived ones).
 *
 * At 8 bits (args.q8_off: the 8-bit scan, recall_scan.h) the bound is widened by a bound on
 * every member's rounding width, from the same statistics (kvt__recall_group_upper), and the
 * members are evaluated by the 8-bit scan's own functions: the output is the full 8-bit scan's.
 *
 * Output: fired rows are collected in a bitmap over the closed rows, then written ascending —
 * the first min(W, fired) rows and overflow = fired > W, as the full scan (which stops at the
 * W+1-th fired row in row order: the pruned scan must know every fired row to know the first W).
 */
#ifndef KVT_KERNELS_RECALL_GROUP_H
#define KVT_KERNELS_RECALL_GROUP_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kvt_hd.h"
#include "recall/kernels/recall_scan.h"
#include "kernels/sigma.h"

#define KVT__RECALL_GROUP_MIN 32u
#define KVT__RECALL_GROUP_MAX 64u
/* A NoPE layer's group planes cover blocks of min(config.block_rows, this) closed rows: a close
 * of a 4096-row block gives 8 of them, each built apart (a group's members come from its own
 * 512 rows). */
#define KVT__RECALL_GROUP_BLOCK_MAX 512u
/* The newest closed blocks a pruning step builds one at a time (kvt__recall_groups_want). */
#define KVT__RECALL_GROUP_LAG 8u
/* stat fields of a group */
#define KVT__RG_RADIUS 0
#define KVT__RG_NCENTRE 1
#define KVT__RG_RHO_MAX 2
#define KVT__RG_RHO_MIN 3
#define KVT__RG_NCSK_MAX 4
#define KVT__RG_STATS 5u

/* The grouped blocks after a scan step's build, from n_grouped before it: every closed block of
 * B rows (at most cap) at the first build (a prefill's, a restored request's); later, every
 * closed block but the newest KVT__RECALL_GROUP_LAG at once, and of those one a step (a block
 * closes on some step; its groups are built on the scan steps that follow, one block each, so
 * that no step builds a whole close's groups). Until its groups are built a block's rows are
 * scanned in full: the same fired rows either way. Both twins build by this rule, so their
 * grouped blocks and visited counts stay equal. */
KVT_HD uint64_t kvt__recall_groups_want(uint64_t n_closed, uint32_t B, uint64_t cap,
                                        uint64_t n_grouped) {
    uint64_t all = n_closed / B;
    if (all > cap)
        all = cap;
    if (n_grouped == 0)
        return all;
    uint64_t w = all > KVT__RECALL_GROUP_LAG ? all - KVT__RECALL_GROUP_LAG : 0;
    if (w < n_grouped + 1u)
        w = n_grouped + 1u;
    return w < all ? w : all;
}

/* Group slots of a block of B rows. */
KVT_HD uint32_t kvt__recall_group_slots(uint32_t B) {
    return B / KVT__RECALL_GROUP_MIN;
}

/* Element j of a row's embedding [r | f32(csk)] (j < branch_dim + rank). */
KVT_HD float kvt__recall_embed(const uint8_t *row, uint32_t branch_offset, int branch_dtype,
                               uint32_t branch_dim, const uint16_t *csk, uint32_t j) {
    return j < branch_dim ? kvt__sigma_branch_val(row, branch_offset, branch_dtype, j)
                          : kvt__f16_to_f32(csk[j - branch_dim]);
}

/* A float's total-order key (ascending keys = ascending values, -0 before +0, NaNs at the ends
 * by sign): the sort's comparisons are never ambiguous. */
KVT_HD uint32_t kvt__recall_order_key(float t) {
    uint32_t u = kvt__bits_from_f32(t);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* ‖csk‖ exactly as the scan computes it (kvt__recall_idx's n2 chain, then sqrtf). */
KVT_HD float kvt__recall_csk_norm(const uint16_t *csk, uint32_t rank) {
    float n2 = 0.0f;
    for (uint32_t k = 0; k < rank; k++) {
        float ck = kvt__f16_to_f32(csk[k]);
        n2 = fmaf(ck, ck, n2);
    }
    return sqrtf(n2);
}

/* Squared distance: fmaf chain over j ascending of (x_j − c_j)², from +0. */
KVT_HD float kvt__recall_dist2(const float *x, const float *c, uint32_t n) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < n; j++) {
        float d = x[j] - c[j];
        acc = fmaf(d, d, acc);
    }
    return acc;
}

/* Squared norm: fmaf chain over j ascending of c_j², from +0 (kvt__recall_dist2 against 0). */
KVT_HD float kvt__recall_norm2(const float *c, uint32_t n) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < n; j++)
        acc = fmaf(c[j], c[j], acc);
    return acc;
}

/* An upper bound of the real norm whose square's chain (n terms, kvt__recall_dist2's order)
 * gave d2. Each difference rounds by at most u (exact when subnormal), each square and the chain
 * lose at most γ_n relatively and n·2^-150 absolutely (underflow), sqrtf u: the real norm is at
 * most sqrtf(d2)·(1 + γ_{n+4}) + 2^-70; ×(1 + 2^-12) then + 2^-64, each rounded to nearest,
 * covers it for n <= 1024 (γ_{1028} + 3u < 2^-12). NaN becomes +Inf. */
KVT_HD float kvt__recall_radius_up(float d2, uint32_t n) {
    (void)n;
    float r = sqrtf(d2) * 1.000244140625f + 5.42101086e-20f; /* 1 + 2^-12, 2^-64 */
    return r <= 3.40282347e38f ? r : INFINITY;
}

/* y·c for one head: fmaf chain over the branch (q_br, j < branch_dim) then the sketch (q̃_sk,
 * k < rank), from +0 — the twin's column-tiled loop gives the same bits. */
KVT_HD float kvt__recall_group_ydot(const float *q_br, const float *q_sk, const float *c,
                                    uint32_t branch_dim, uint32_t rank) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < branch_dim; j++)
        acc = fmaf(q_br[j], c[j], acc);
    for (uint32_t k = 0; k < rank; k++)
        acc = fmaf(q_sk[k], c[branch_dim + k], acc);
    return acc;
}

/* Y >= ‖[q_br | q̃_sk]‖ (double; the sum's relative error is far below the 2^-40 added). */
KVT_HD double kvt__recall_group_ynorm(const float *q_br, const float *q_sk, uint32_t branch_dim,
                                      uint32_t rank) {
    double s2 = 0.0;
    for (uint32_t j = 0; j < branch_dim; j++)
        s2 += (double)q_br[j] * q_br[j];
    for (uint32_t k = 0; k < rank; k++)
        s2 += (double)q_sk[k] * q_sk[k];
    return sqrt(s2) * (1.0 + 9.094947017729282e-13); /* 2^-40 */
}

/* The cut k of a sorted segment of cnt > 64 values t (the build's 1-D 2-means in double over k in
 * [q, cnt − q], q = max(32, ⌊cnt/4⌋), each sum in order; on equal costs the k nearest cnt/2, then
 * the smaller; every cost NaN: cnt/2). One thread, the same bits on every backend. */
KVT_HD uint32_t kvt__recall_group_cut(const float *t, uint32_t cnt) {
    const uint32_t q = cnt / 4 > KVT__RECALL_GROUP_MIN ? cnt / 4 : KVT__RECALL_GROUP_MIN;
    const uint32_t klo = q, khi = cnt - q, mid = cnt / 2;
    const double tm = t[mid];
    double s1 = 0.0, s2 = 0.0;
    for (uint32_t i = 0; i < cnt; i++) {
        double d = (double)t[i] - tm;
        s1 += d;
        s2 += d * d;
    }
    double a1 = 0.0, a2 = 0.0, bc = INFINITY;
    uint32_t bk = 0;
    for (uint32_t k = 1; k <= khi; k++) {
        double d = (double)t[k - 1] - tm;
        a1 += d;
        a2 += d * d;
        if (k < klo)
            continue;
        double c = (a2 - a1 * a1 / k) + ((s2 - a2) - (s1 - a1) * (s1 - a1) / (cnt - k));
        uint32_t dk = k > mid ? k - mid : mid - k, db = bk > mid ? bk - mid : mid - bk;
        if (c < bc || (c == bc && dk < db)) {
            bc = c;
            bk = k;
        }
    }
    return bk ? bk : mid;
}

/* A group's statistics as its members are taken (any order: every fold is order-free). */
typedef struct kvt__recall_group_acc {
    float R, rmax, rmin, nck;
    int bad;
} kvt__recall_group_acc;

KVT_HD kvt__recall_group_acc kvt__recall_group_acc_new(void) {
    kvt__recall_group_acc g;
    g.R = 0.0f;
    g.rmax = 0.0f;
    g.rmin = INFINITY;
    g.nck = 0.0f;
    g.bad = 0;
    return g;
}

/* A member: d2 its squared distance to the centre (kvt__recall_dist2), p its ρ, nc its ‖csk‖
 * (kvt__recall_csk_norm); n = branch_dim + rank. */
KVT_HD void kvt__recall_group_acc_take(kvt__recall_group_acc *g, float d2, uint32_t n, float p,
                                       float nc) {
    const float r = kvt__recall_radius_up(d2, n);
    g->R = r > g->R ? r : g->R;
    g->bad |= !(r <= 3.40282347e38f);
    if (!(p >= 0.0f && p <= 3.40282347e38f)) /* never NaN (sketch.h); a NaN makes the group live */
        g->rmax = INFINITY;
    else {
        g->rmax = p > g->rmax ? p : g->rmax;
        g->rmin = p < g->rmin ? p : g->rmin;
    }
    g->nck = nc > g->nck || !(nc == nc) ? nc : g->nck;
}

/* The group's stat fields (KVT__RG_*), nc2 the centre's squared norm (kvt__recall_norm2). */
KVT_HD void kvt__recall_group_acc_stat(const kvt__recall_group_acc *g, float nc2, uint32_t n,
                                       float *st) {
    st[KVT__RG_RADIUS] = g->bad ? INFINITY : g->R;
    st[KVT__RG_NCENTRE] = kvt__recall_radius_up(nc2, n);
    st[KVT__RG_RHO_MAX] = g->rmax;
    st[KVT__RG_RHO_MIN] = g->rmin <= g->rmax ? g->rmin : 0.0f;
    st[KVT__RG_NCSK_MAX] = g->nck == g->nck ? g->nck : INFINITY;
}

/* An upper bound, in double, of every member's fp32 trigger left-hand side for this head (the
 * header comment's U), +Inf where the bound's no-overflow argument does not hold (the group is
 * then evaluated). q8: NULL for the 16-bit scan; the head's 8-bit values for the 8-bit scan
 * (sk_width its plane's sketch width, args.q8_off), whose trigger the bound then covers:
 *
 * The 8-bit widening. A member's plane holds e_r, n_r (branch) and e_c, n_c (sketch), and its
 * 8-bit trigger is the 16-bit one's with idx8 (|idx16 − idx8| <= B, kvt__recall_q8_bound) and
 * the width B added (recall_scan.h). None of the member's plane values is read here: each is
 * bounded from the group's statistics. Every member's embedding has real norm ‖x‖ <= X = Nc + R,
 * so ‖r‖ <= X and ‖csk‖ <= Xc = min(X, ‖csk‖ max·(1 + 2^-14) + 2^-100). A part of n values with
 * norm at most X is quantised with t = max|x|/127 <= X/127·(1 + u), each value's error at most
 * t/2 plus its product's and scale's roundings (<= 4u·|x_i|), so its stored error norm (rounded,
 * ×(1 + 2^-8)) is at most E = X·(√n/254 + 2^-20)·(1 + 2^-7) + 2^-100 (the absolute term: a
 * subnormal max, whose error is x itself, is below 2^-120), and its stored quantised norm at
 * most N = (X + E)·(1 + 2^-7). B is nondecreasing in e_r, n_r, e_c, n_c (nonnegative
 * coefficients, monotone roundings), so Bm = kvt__recall_q8_bound's formula at (E_r, N_r, E_c,
 * N_c) in double ×(1 + 2^-20) (its fp32 evaluation's roundings) bounds every member's B. Then
 *   conformal  fl(fl(idx8 + B') + z·cert) <= idx16 + z·cert + 2·Bm + 2^-20·(|idx16| + 2·Bm +
 *              |z·cert|) (B' = B + 2^-22·(...) and the two additions' roundings): T8 = T + 2·Bm
 *              + 2^-19·(MAG + 2·Bm + |z|·cert(ρ max) + |T|);
 *   sound      idx8 + (margin(|idx8| + B, P', ‖csk‖', ρ) + B)·(1 + 2^-8), with |idx8| + B <=
 *              Imax + 2·Bm, P' = Qb·(n_r + e_r) + Qs·(n_c + e_c) <= Qb·(N_r + E_r) + Qs·(N_c +
 *              E_c), ‖csk‖' = n_c + e_c <= N_c + E_c (the margin is nondecreasing in each, their
 *              fp32 values rounded up by ×(1 + 2^-20)): T8 = Bm + (margin(...) + Bm)·(1 + 2^-8)·
 *              (1 + 2^-20);
 *   margin     never bounded: +Inf (the step does not prune in the margin mode).
 * and U = s·(yc + Y·R) + T8 + ε·(MAG + |T| + |T8|) + 2^-100 as in the 16-bit case. A query
 * value out of range (a NaN scale, an error norm above 2^40) gives +Inf. */
/* The parts of the bound that depend on the layer alone (kvt__recall_group_upper_at; a scan
 * takes them once): the values the bound's expressions compute, so the bits are the same. */
typedef struct kvt__recall_upper_k {
    double eps;    /* 2·γ(branch_dim + rank + 8) + 2^-16 */
    double ar, ac; /* √branch_dim / 254 + 2^-20, √sk_width / 254 + 2^-20 (8 bits) */
    float sq;      /* √(D − 64), the certificate's divisor (kvt__recall_cert) */
} kvt__recall_upper_k;

KVT_HD kvt__recall_upper_k kvt__recall_upper_consts(uint32_t D, uint32_t branch_dim, uint32_t rank,
                                                    uint32_t sk_width) {
    kvt__recall_upper_k k;
    k.eps = 2.0 * (double)kvt__recall_gamma(branch_dim + rank + 8u) + 1.52587890625e-05; /* 2^-16 */
    k.ar = sqrt((double)branch_dim) / 254.0 + 9.5367431640625e-07;
    k.ac = sqrt((double)sk_width) / 254.0 + 9.5367431640625e-07;
    k.sq = sqrtf((float)(D - 64u));
    return k;
}

/* The parts that depend on a group alone (its statistics st; at 8 bits its members' rounding
 * bounds). ok = 0: a statistic out of the bound's range (the bound is then +Inf). */
typedef struct kvt__recall_upper_g {
    int ok;
    double R, Nc;
    float rmax, rmin, nck;
    double Er, Ec, Nr, Ncs; /* 8 bits: E_r, E_c, N_r, N_c of the header comment */
} kvt__recall_upper_g;

KVT_HD kvt__recall_upper_g kvt__recall_upper_group(const float *st, const kvt__recall_upper_k *k,
                                                   int q8) {
    const double lim = 1099511627776.0; /* 2^40 */
    kvt__recall_upper_g g;
    g.R = st[KVT__RG_RADIUS];
    g.Nc = st[KVT__RG_NCENTRE];
    g.rmax = st[KVT__RG_RHO_MAX];
    g.rmin = st[KVT__RG_RHO_MIN];
    g.nck = st[KVT__RG_NCSK_MAX];
    g.ok = g.R <= lim && g.Nc <= lim && g.rmax <= lim && g.rmin >= 0.0f && g.nck <= lim;
    g.Er = g.Ec = g.Nr = g.Ncs = 0.0;
    if (q8) {
        const double tiny = 7.888609052210118e-31; /* 2^-100 */
        const double X = g.Nc + g.R, u7 = 1.0078125;
        const double xc = (double)g.nck * (1.0 + 6.103515625e-05) + tiny; /* 2^-14 */
        const double Xc = xc < X ? xc : X;
        g.Er = X * k->ar * u7 + tiny;
        g.Ec = Xc * k->ac * u7 + tiny;
        g.Nr = (X + g.Er) * u7;
        g.Ncs = (Xc + g.Ec) * u7;
    }
    return g;
}

/* The parts that depend on a head alone (and the scan's s, z, mode): whether its values are
 * within the bound's range (0: the bound is +Inf). */
KVT_HD int kvt__recall_upper_head_ok(const kvt__recall_head *h, const kvt__recall_q8h *q8,
                                     double Y, int mode, float s, float z) {
    const double lim = 1099511627776.0, slim = 1048576.0; /* 2^40, 2^20 */
    if (!(s <= slim && z <= slim && z >= -slim && Y <= lim && h->nres <= lim &&
          h->Qres <= lim && h->Qsk <= lim && h->nlat <= lim && h->eta <= lim))
        return 0;
    return !q8 || (mode != KVT__RECALL_MARGIN && q8->Qb <= lim && q8->Qs <= lim &&
                   q8->Eb <= lim && q8->Es <= lim && q8->Nb <= lim && q8->Ns <= lim);
}

/* kvt__recall_group_upper from its parts (the same bits): k the layer's, g the group's, head_ok
 * the head's (kvt__recall_upper_head_ok). */
KVT_HD double kvt__recall_group_upper_at(const kvt__recall_head *h, const kvt__recall_q8h *q8,
                                         double Y, float yc, const kvt__recall_upper_g *g,
                                         const kvt__recall_upper_k *k, int head_ok, int mode,
                                         float s, float z, uint32_t D, uint32_t branch_dim,
                                         uint32_t rank) {
    if (!(head_ok && g->ok))
        return INFINITY;
    const double eps = k->eps, R = g->R, Nc = g->Nc;
    const float rmax = g->rmax, rmin = g->rmin, nck = g->nck;
    const double mag = (double)s * Y * (Nc + R);
    const double tiny = 7.888609052210118e-31; /* 2^-100 */
    /* fp32 values >= the members' |idx| and P: ×(1 + 2^-20) before rounding to nearest,
     * + 2^-120 for the subnormal range */
    const double u20 = 1.0 + 9.5367431640625e-07, up = (1.0 + eps) * u20; /* 1 + 2^-20 */
    double Bm = 0.0, Pq = 0.0, Ncq = 0.0;
    if (q8) {
        const double Er = g->Er, Ec = g->Ec, Nr = g->Nr, Ncs = g->Ncs;
        const double mn = q8->Qb * Er + q8->Eb * Nr + q8->Qs * Ec + q8->Es * Ncs;
        const double rn = q8->Qb * (Nr + Er) + q8->Qs * (Ncs + Ec) + q8->Nb * Nr + q8->Ns * Ncs;
        Bm = (double)s * (mn + 3.0517578125e-05 * rn) * (1.0 + 0.00390625) * u20; /* 2^-15 */
        Pq = q8->Qb * (Nr + Er) + q8->Qs * (Ncs + Ec);
        Ncq = Ncs + Ec;
    }
    double T, T8;
    if (mode == KVT__RECALL_SOUND) {
        float imax = (float)(mag * up + 7.52316384526264e-37);
        float pmax = (float)(Y * (Nc + R) * up + 7.52316384526264e-37);
        T = kvt__recall_sound_margin(h, imax, pmax, nck, rmax, s, z, D, branch_dim, rank);
        T8 = T;
        if (q8) {
            const double P = Pq > (double)pmax ? Pq : (double)pmax;
            const double nc = Ncq > (double)nck ? Ncq : (double)nck;
            const float i8 = (float)(((double)imax + 2.0 * Bm) * u20 + 7.52316384526264e-37);
            const float p8 = (float)(P * u20 + 7.52316384526264e-37);
            const float n8 = (float)(nc * u20 + 7.52316384526264e-37);
            const double m8 =
                kvt__recall_sound_margin(h, i8, p8, n8, rmax, s, z, D, branch_dim, rank);
            T8 = Bm + (m8 + Bm) * (1.0 + 0.00390625) * u20;
        }
    } else {
        T = (double)(z * kvt__recall_cert_by(h, z >= 0.0f ? rmax : rmin, s, k->sq));
        T8 = T;
        if (q8) {
            const double za = fabs((double)z * kvt__recall_cert_by(h, rmax, s, k->sq));
            T8 = T + 2.0 * Bm + 1.9073486328125e-06 * (mag + 2.0 * Bm + za + fabs(T)); /* 2^-19 */
        }
    }
    if (!q8) /* the 16-bit bound, as it always was */
        return (double)s * ((double)yc + Y * R) + T + eps * (mag + fabs(T)) + tiny;
    return (double)s * ((double)yc + Y * R) + T8 + eps * (mag + fabs(T) + fabs(T8)) + tiny;
}

KVT_HD double kvt__recall_group_upper(const kvt__recall_head *h, const kvt__recall_q8h *q8,
                                      double Y, float yc, const float *st, int mode, float s,
                                      float z, uint32_t D, uint32_t branch_dim, uint32_t rank,
                                      uint32_t sk_width) {
    const kvt__recall_upper_k k = kvt__recall_upper_consts(D, branch_dim, rank, sk_width);
    const kvt__recall_upper_g g = kvt__recall_upper_group(st, &k, q8 != NULL);
    return kvt__recall_group_upper_at(h, q8, Y, yc, &g, &k,
                                      kvt__recall_upper_head_ok(h, q8, Y, mode, s, z), mode, s, z,
                                      D, branch_dim, rank);
}

/* May a member of the group fire for this head? (the header comment's bound, U < best
 * excludes; 1 = evaluate) q8, sk_width: as kvt__recall_group_upper's (NULL: the 16-bit scan). */
KVT_HD int kvt__recall_group_live(const kvt__recall_head *h, const kvt__recall_q8h *q8, double Y,
                                  float yc, const float *st, int mode, float s, float z,
                                  float best, uint32_t D, uint32_t branch_dim, uint32_t rank,
                                  uint32_t sk_width) {
    return !(kvt__recall_group_upper(h, q8, Y, yc, st, mode, s, z, D, branch_dim, rank,
                                     sk_width) < (double)best);
}

/* ---------------------------------------------------------------------------------------------
 * CPU twins (recall_group.c)
 * ------------------------------------------------------------------------------------------- */
struct kvt__recall_scan_args;

/* One block's group planes (the layout above), as the build writes them. */
typedef struct kvt__recall_group_block {
    uint32_t *perm;     /* [B] */
    uint32_t *n_groups; /* [1] */
    uint32_t *end;      /* [B/32] */
    float *centre;      /* [B/32][dim] */
    float *stat;        /* [B/32][KVT__RG_STATS] */
} kvt__recall_group_block;

/* Bytes of scratch kvt__recall_group_block_cpu takes: 8·(B + 9)·(branch_dim + rank) + 36·B and
 * 8-byte alignment — the block's embeddings as fp32 twice (by row, and transposed in the
 * build's order for the AVX-512 chains): 0.55 MB at B = 512 (a NoPE layer's group block),
 * rank 64. */
size_t kvt__recall_group_scratch_bytes(uint32_t B, uint32_t branch_dim, uint32_t rank);

/* Build the groups of one closed block of B rows (a power of two >= 64): row u (block offset) at
 * base + (size_t)slots[u] * slot_stride, its branch branch_dim values of branch_dtype at byte
 * branch_offset; its sketch csk + u * csk_stride (rank fp16 values used), its ρ rho[u]. dim >=
 * branch_dim + rank is the centre stride. Arguments trusted (kvt__recall_group_args_ok); scratch
 * 8-byte aligned, kvt__recall_group_scratch_bytes. */
/* Whether the build's distance and projection chains run their AVX-512 path (32 rows at a time;
 * the same bits): the CPU has AVX-512F and it is enabled. enable 0 / 1 turns it off / on (tests
 * run both), -1 only asks. */
int kvt__recall_group_wide(int enable);
/* The build's chains, for tests: out[i − lo] = kvt__recall_dist2(X[perm[i]], c, n) (dot = 0) or
 * the fmaf chain of c·X[perm[i]] over j ascending from +0 (dot = 1), X [rows][n]; wide = 1 runs
 * the AVX-512 path where kvt__recall_group_wide allows it. */
void kvt__recall_group_chains(const float *X, uint32_t n, const uint32_t *perm, uint32_t lo,
                              uint32_t hi, const float *c, int dot, int wide, float *out);

void kvt__recall_group_block_cpu(const uint8_t *base, const int32_t *slots, uint32_t B,
                                 size_t slot_stride, uint32_t branch_offset, int branch_dtype,
                                 uint32_t branch_dim, const uint16_t *csk, uint32_t csk_stride,
                                 const float *rho, uint32_t rank, uint32_t dim, void *scratch,
                                 const kvt__recall_group_block *out);

/* The group planes of a (request, layer) as the pruned scan reads them: blocks 0 .. n_blocks − 1
 * (rows [0, n_blocks·block_rows), every one closed), block b's planes at slot k = b·stride
 * (stride 0 reads as 1): perm + k·B, n_groups + k, end + k·B/32, centre + k·(B/32)·dim, stat +
 * k·(B/32)·KVT__RG_STATS. A RoPE layer's planes interleave its KV heads (stride n_kv, each head's
 * pointers offset by its slot; rope_trigger.h). Closed rows past the grouped blocks are
 * scanned one by one. */
typedef struct kvt__recall_groups {
    uint32_t block_rows;
    uint64_t n_blocks;
    uint32_t dim;
    uint32_t stride;
    const uint32_t *perm;
    const uint32_t *n_groups;
    const uint32_t *end;
    const float *centre;
    const float *stat;
} kvt__recall_groups;

/* Bytes of scratch kvt__recall_group_build_cpu takes: a block's slots, then the build's. */
size_t kvt__recall_group_build_scratch_bytes(uint32_t B, uint32_t branch_dim, uint32_t rank);

/* Build the groups of closed blocks [from, to) of a scan's rows (a's rows through its pages,
 * its sketches and ρ, branch and rank) into the planes as kvt__recall_groups reads them: block
 * b's at slot b·stride (stride 0: 1) past `planes`' pointers, centres of dim floats. Arguments
 * trusted; scratch 8-byte aligned, kvt__recall_group_build_scratch_bytes. */
void kvt__recall_group_build_cpu(const struct kvt__recall_scan_args *a, uint32_t B, uint32_t dim,
                                 uint32_t stride, const kvt__recall_group_block *planes,
                                 uint64_t from, uint64_t to, void *scratch);

/* What a pruned scan did (for benchmarks and tests). */
typedef struct kvt__recall_prune_stats {
    uint64_t archived;       /* archived rows of the work item */
    uint64_t visited;        /* archived rows evaluated */
    uint64_t groups;         /* groups of the grouped blocks */
    uint64_t groups_visited; /* groups not skipped */
    uint64_t head_groups;    /* (group, head) pairs the bound could not exclude */
} kvt__recall_prune_stats;

/* Are the group planes usable with a (B a power of two >= 64, dim >= branch_dim + rank, the
 * grouped rows closed, every plane present when a block is, and every index in range: n_groups,
 * ends ascending by 32..64 up to B, row offsets below B)? O(grouped rows). Not checked: that perm
 * is a permutation (a repeated offset is evaluated twice, a missing one never: the build writes
 * permutations). */
int kvt__recall_groups_ok(const struct kvt__recall_scan_args *a, const kvt__recall_groups *g);

/* Bytes of scratch kvt__recall_scan_pruned_cpu takes (8-byte aligned). */
size_t kvt__recall_scan_pruned_scratch_bytes(uint32_t n_heads, uint32_t rank, uint32_t D,
                                             uint64_t n_closed);

/* The pruned scan: a's outputs are exactly kvt__recall_scan_cpu's (same arguments, checked as
 * the recall_scan op checks them, and kvt__recall_groups_ok). stats may be NULL. */
void kvt__recall_scan_pruned_cpu(const struct kvt__recall_scan_args *a,
                                 const kvt__recall_groups *g, void *scratch,
                                 kvt__recall_prune_stats *stats);

#endif /* KVT_KERNELS_RECALL_GROUP_H */
