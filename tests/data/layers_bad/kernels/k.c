/* A kernel reaching up into tiers/: check_layers.py must refuse it. */
#include "kernels/k.h"
#include "tiers/t.h"
