/* a tool reaching into kernels/: refused (tools include public headers only). */
#include "kvtier.h"
#include "kernels/k.h"
