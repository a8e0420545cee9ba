/* conformal.c — the per-request conformal z (definition and guarantee in conformal.h). */
#include "recall/conformal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void kvt__conformal_init(kvt__conformal *c, float *samples, uint32_t cap) {
    memset(c, 0, sizeof *c);
    c->samples = samples;
    c->cap = cap;
    c->z = KVT__CONFORMAL_Z_MAX;
}

bool kvt__conformal_sample(float score, float idx, float cert, float *e) {
    if (!(cert > 0.0f) || isinf(cert) || isnan(score) || isnan(idx))
        return false;
    *e = (score - idx) / cert;
    return !isnan(*e);
}

uint32_t kvt__conformal_rank(uint32_t n, uint32_t permille) {
    uint64_t num = (uint64_t)(n + 1) * permille;
    return (uint32_t)((num + 999) / 1000);
}

/* Is `steps` the end of a window (8, 16, 32, 64)? */
static bool window_end(uint32_t steps) {
    for (uint32_t w = KVT__CONFORMAL_MIN_STEPS; w <= KVT__CONFORMAL_LAST_WINDOW; w *= 2)
        if (steps == w)
            return true;
    return false;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The k-th smallest (1-based) of x[0..n), sorting x in place (once per request; no NaN: samples
 * are checked when made). */
static float kth_smallest(float *x, uint32_t n, uint32_t k) {
    qsort(x, n, sizeof *x, cmp_float);
    return x[k - 1];
}

bool kvt__conformal_step(kvt__conformal *c, const float *e, uint32_t n_e) {
    if (c->fixed)
        return false;
    for (uint32_t i = 0; i < n_e && c->n < c->cap; i++)
        c->samples[c->n++] = e[i];
    c->steps++;
    if (!window_end(c->steps))
        return true;
    if (c->n >= KVT__CONFORMAL_MIN_SAMPLES) {
        c->k = kvt__conformal_rank(c->n, KVT__CONFORMAL_TAU_S_PERMILLE);
        float q = kth_smallest(c->samples, c->n, c->k);
        c->clamped = q > KVT__CONFORMAL_Z_MAX;
        c->z = c->clamped ? KVT__CONFORMAL_Z_MAX : q;
        c->calibrated = true;
        c->fixed = true;
    } else if (c->steps >= KVT__CONFORMAL_LAST_WINDOW) {
        c->fixed = true; /* provisional Z_MAX for good */
    }
    return !c->fixed;
}
