/* Two lib/ files calling each other: a call cycle, refused (lib/'s files call one way). c1.c
 * also includes a header private to tiers/ (a *_internal.h), refused. */
#include "tiers/t_internal.h"

int kvt__fixture_lib_two(int n);

int kvt__fixture_lib_one(int n) {
    return n > 0 ? kvt__fixture_lib_two(n - 1) : KVT__FIXTURE_TIER_PRIVATE;
}
