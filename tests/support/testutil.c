#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

const char *tu_models_dir(void) {
    const char *env = getenv("KVT_MODELS_DIR");
    if (env && *env)
        return env;
    return KVT_SOURCE_DIR "/../shared/models";
}

const char *tu_model_path(const char *file) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", tu_models_dir(), file);
    return buf;
}

uint64_t tu_next(tu_rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double tu_uniform(tu_rng *r) {
    return (double)(tu_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

double tu_normal(tu_rng *r) {
    double u1 = tu_uniform(r), u2 = tu_uniform(r);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
