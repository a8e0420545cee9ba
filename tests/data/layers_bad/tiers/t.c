/* A tier calling down into kernels/: allowed, include and call (the checker must not report it). */
#include "tiers/t.h"
#include "kernels/k.h"
#include "tiers/t_internal.h" /* its own folder's private header: allowed */

int kvt__fixture_tier(void) {
    return KVT__FIXTURE_TIER_PRIVATE - 1;
}

int kvt__fixture_tier_calls_down(void) {
    return kvt__fixture_kernel();
}
