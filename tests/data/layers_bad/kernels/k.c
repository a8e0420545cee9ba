/* A kernel reaching up into tiers/: check_layers.py must refuse it, the include and the call
 * (tests/scripts/layers.cmake compiles this fixture's library files to check calls with nm). */
#include "kernels/k.h"
#include "tiers/t.h"

int kvt__fixture_kernel(void) {
    return kvt__fixture_tier() + 1; /* defined in tiers/t.c: a call up, refused */
}
