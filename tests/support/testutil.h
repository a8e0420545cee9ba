/* testutil.h — helpers shared by the Criterion tests (seeded randomness, paths, row filling). */
#ifndef KVT_TESTS_TESTUTIL_H
#define KVT_TESTS_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

/* Directory holding the real model configs (../shared/models, or $KVT_MODELS_DIR). */
const char *tu_models_dir(void);
/* Path of a model config inside tu_models_dir() (static buffer, valid until the next call). */
const char *tu_model_path(const char *file);

/* Deterministic test RNG (splitmix64); every test prints its seed on failure. */
typedef struct tu_rng {
    uint64_t s;
} tu_rng;
uint64_t tu_next(tu_rng *r);
double tu_uniform(tu_rng *r);  /* [0, 1) */
double tu_normal(tu_rng *r);   /* standard normal (Box-Muller) */

#endif
