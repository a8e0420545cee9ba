/* recall/kernels/ is at the kernels rank (a sub-layer of recall/): it may include kernels/ and
 * its own folder, and reaching up into recall/ itself is refused. */
#include "recall/kernels/rk.h"
#include "kernels/k.h"
#include "recall/r.h"
