/* conformal.c — the per-request conformal z (definition and guarantee in conformal.h; the math
 * in recall/kernels/conformal_math.h, shared with the recall step's backend op). */
#include "recall/conformal.h"

#include <string.h>

void kvt__conformal_init(kvt__conformal *c, float *samples, uint32_t cap) {
    memset(c, 0, sizeof *c);
    c->samples = samples;
    c->cap = cap;
    c->z = KVT__CONFORMAL_Z_MAX;
}

bool kvt__conformal_step(kvt__conformal *c, const float *e, uint32_t n_e) {
    if (c->fixed)
        return false;
    for (uint32_t i = 0; i < n_e; i++)
        kvt__conformal_insert(c->samples, &c->n, c->cap, e[i]);
    c->steps++;
    uint32_t clamped = 0;
    uint32_t phase = kvt__conformal_close(c->samples, c->n, c->steps, &c->z, &c->k, &clamped);
    c->clamped = clamped != 0;
    c->calibrated = phase == KVT__CONFORMAL_CALIBRATED;
    c->fixed = phase != KVT__CONFORMAL_OPEN;
    return !c->fixed;
}
