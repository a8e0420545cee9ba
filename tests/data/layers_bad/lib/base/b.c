/* base reaching up into kernels/: refused. */
#include "kernels/k.h"
#include "kvtier.h"
