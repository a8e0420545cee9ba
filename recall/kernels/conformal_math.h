/*
 * conformal_math.h — the per-element math of the recall trigger's conformal multiplier z (definition
 * and guarantee: recall/conformal.h, docs/recall.md §4). KVT_HD so the recall step's CPU twin and
 * a CUDA kernel fix z from the same samples with the same integer rank and the same order: the
 * samples are kept sorted ascending as they arrive (insertion keeps a NaN-free array sorted), so
 * the k-th smallest is one read. recall/conformal.c wraps the same functions for host callers.
 */
#ifndef KVT_KERNELS_CONFORMAL_MATH_H
#define KVT_KERNELS_CONFORMAL_MATH_H

#include <math.h>
#include <stdint.h>

#include "kernels/kvt_hd.h"

#define KVT__CONFORMAL_TAU_S_PERMILLE 947u /* τ_s = 0.947 (DESIGN: τ = 0.90 split for the scan) */
#define KVT__CONFORMAL_Z_MAX 8.0f
#define KVT__CONFORMAL_MIN_SAMPLES 18u
#define KVT__CONFORMAL_MIN_STEPS 8u
#define KVT__CONFORMAL_LAST_WINDOW 64u /* windows end at 8, 16, 32, 64 steps */

/* k = ceil((n + 1) · permille / 1000), in integers. */
KVT_HD uint32_t kvt__conformal_rank(uint32_t n, uint32_t permille) {
    uint64_t num = (uint64_t)(n + 1) * permille;
    return (uint32_t)((num + 999) / 1000);
}

/* Is `steps` the end of a window (8, 16, 32, 64)? */
KVT_HD int kvt__conformal_window_end(uint32_t steps) {
    for (uint32_t w = KVT__CONFORMAL_MIN_STEPS; w <= KVT__CONFORMAL_LAST_WINDOW; w *= 2)
        if (steps == w)
            return 1;
    return 0;
}

/* The nonconformity of one (step, head): 1 and *e set when the sample is defined (cert positive
 * and finite, score and idx not NaN, e finite). */
KVT_HD int kvt__conformal_sample(float score, float idx, float cert, float *e) {
    if (!(cert > 0.0f) || isinf(cert) || isnan(score) || isnan(idx))
        return 0;
    *e = (score - idx) / cert;
    return isfinite(*e);
}

/* Insert e into sorted[0 .. *n) (ascending) when there is room (cap); past cap it is dropped. */
KVT_HD void kvt__conformal_insert(float *sorted, uint32_t *n, uint32_t cap, float e) {
    if (*n >= cap)
        return;
    uint32_t i = *n;
    while (i > 0 && sorted[i - 1] > e) {
        sorted[i] = sorted[i - 1];
        i--;
    }
    sorted[i] = e;
    (*n)++;
}

/* Where kvt__conformal_insert, called on sorted[0 .. n0) (ascending, room for all) for
 * nw[0 .. v) in that order, leaves each value, for a parallel twin that moves values instead of
 * shifting them: the old sample o at t goes to t + #{nw < o}; nw[j] goes to #{old <= nw[j]} +
 * #{nw < nw[j]} + #{i < j: nw[i] == nw[j]} (insertion stops at the first element from the right
 * that is <= e, so equal values keep their arrival order, ±0 included). */
KVT_HD uint32_t kvt__conformal_merged_old(const float *nw, uint32_t v, uint32_t t, float o) {
    uint32_t c = t;
    for (uint32_t j = 0; j < v; j++)
        c += nw[j] < o;
    return c;
}

KVT_HD uint32_t kvt__conformal_merged_new(const float *old, uint32_t n0, const float *nw,
                                          uint32_t v, uint32_t j) {
    const float e = nw[j];
    uint32_t lo = 0, hi = n0; /* #{old <= e}: a prefix of the sorted array */
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (!(old[mid] > e))
            lo = mid + 1;
        else
            hi = mid;
    }
    for (uint32_t i = 0; i < v; i++)
        lo += nw[i] < e || (nw[i] == e && i < j);
    return lo;
}

/* Outcome of a window end. */
#define KVT__CONFORMAL_OPEN 0        /* still calibrating: the next step attends every row */
#define KVT__CONFORMAL_CALIBRATED 1  /* z from the samples, fixed for the request */
#define KVT__CONFORMAL_PROVISIONAL 2 /* the last window passed with too few samples: Z_MAX */

/* After a calibration step (steps counted, samples sorted): at a window end with n >= 18
 * samples, z = min(Z_MAX, sorted[k − 1]) with k = kvt__conformal_rank(n, 947); the phase. */
KVT_HD uint32_t kvt__conformal_close(const float *sorted, uint32_t n, uint32_t steps, float *z,
                                     uint32_t *k, uint32_t *clamped) {
    if (!kvt__conformal_window_end(steps))
        return KVT__CONFORMAL_OPEN;
    if (n >= KVT__CONFORMAL_MIN_SAMPLES) {
        *k = kvt__conformal_rank(n, KVT__CONFORMAL_TAU_S_PERMILLE);
        float q = sorted[*k - 1];
        *clamped = q > KVT__CONFORMAL_Z_MAX;
        *z = *clamped ? KVT__CONFORMAL_Z_MAX : q;
        return KVT__CONFORMAL_CALIBRATED;
    }
    return steps >= KVT__CONFORMAL_LAST_WINDOW ? KVT__CONFORMAL_PROVISIONAL : KVT__CONFORMAL_OPEN;
}

#endif /* KVT_KERNELS_CONFORMAL_MATH_H */
