/*
 * conformal.h — the per-request conformal multiplier z of the recall trigger (DESIGN §2.1,
 * issue 10 item 3, docs/recall.md §4). Host code, pure: no storage of its own beyond what the
 * caller hands in, no backend.
 *
 * Definition. During the calibration steps of a (request, layer), each step attends every row
 * (exact), and for every query head h whose best-scoring archived row a* has a positive
 * certificate, one nonconformity sample is recorded:
 *
 *     e = (score_a* − idx_a*) / cert_a*
 *
 * (score: the exact logit; idx, cert: docs/recall.md §3). Samples are checked at the end of the
 * windows of 8, 16, 32 and 64 steps; at the first window end with n >= 18 samples (from >= 8
 * steps, which every window end has),
 *
 *     z = min(Z_MAX, the k-th smallest e),   k = ceil((n + 1) · τ_s),   τ_s = 0.947, Z_MAX = 8
 *
 * and z is fixed for the request. Before that z = Z_MAX (provisional); a request that reaches the
 * end of the 64-step window with fewer than 18 samples keeps z = Z_MAX, still provisional, for
 * good. n >= 18 is exactly the smallest n with k <= n (19 · 0.947 = 17.993 → k = 18). τ_s is
 * handled in thousandths (947), so k is computed in integers: no rounding can move it.
 *
 * Guarantee, as it is: if the later queries of the request are exchangeable with its calibration
 * queries, P(e_new <= z) >= τ_s for the best archived row of a head of a new query, marginally
 * over the draw of calibration and new query together (split conformal prediction). Not per
 * query, not conditional on the query's content, and void if the request's queries drift; the
 * clamp to Z_MAX can only lower coverage where it binds, and is reported (kvt__conformal.clamped).
 * Z_MAX = 8 is not a sound multiplier (sound: √(D − 64) ≈ 21.2 cert units, docs/recall.md §3).
 *
 * Samples the definition leaves out: a head with no archived row, and one whose cert_a* is 0 or
 * not finite (ρ = 0, q_res = 0, or an undescribable row with ρ = +Inf, which is always fetched:
 * it needs no z). A NaN score or idx gives no sample either.
 */
#ifndef KVT_RECALL_CONFORMAL_H
#define KVT_RECALL_CONFORMAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The constants and the per-element math (rank, sample, sorted insertion, window close) are
 * recall/kernels/conformal_math.h's: the recall step's backend op fixes z on the device with the
 * same functions (kvt__recall_step_cpu), this host form serves tests and tools. */
#include "recall/kernels/conformal_math.h"

/* One (request, layer)'s calibration. samples (kept sorted ascending) has room for cap floats (64 steps x the layer's
 * query heads suffices): owned by the caller (the request's state), so a step allocates nothing. */
typedef struct kvt__conformal {
    float *samples;
    uint32_t cap;
    uint32_t n;      /* samples recorded */
    uint32_t steps;  /* calibration steps seen */
    float z;         /* Z_MAX until fixed */
    bool fixed;      /* z is the request's for good (calibrated, or the last window passed) */
    bool calibrated; /* z came from the samples (false: provisional Z_MAX) */
    bool clamped;    /* the k-th sample exceeded Z_MAX */
    uint32_t k;      /* the order statistic used (0 until calibrated) */
} kvt__conformal;

/* Start a calibration over caller memory of cap floats. */
void kvt__conformal_init(kvt__conformal *c, float *samples, uint32_t cap);
/* Record one calibration step's samples (e[0..n_e), the defined ones of its heads), then, at a
 * window end, fix z if it can. Returns true while the request still calibrates (its next step must
 * attend every row), false once z is fixed (the step's samples are then ignored). Samples past
 * cap are dropped (the caller sizes cap for 64 steps of its heads). */
bool kvt__conformal_step(kvt__conformal *c, const float *e, uint32_t n_e);

#endif
