/* ortho.c — kvt_orthonormalise_rows (kvtier.h): the one Gram-Schmidt of the tree. kvtier-inspect
 * calibrate, kvtier-needle's generator, bench_decode and the tests' bases all come from it, so
 * that a basis they make is the same bits wherever it is made. In the bottom layer: a pure
 * function every layer and every tool may call. */
#include "base.h"

#include <math.h>

kvt_status kvt_orthonormalise_rows(double *V, uint32_t rank, uint32_t n, uint32_t passes) {
    if ((!V && rank > 0) || rank > n || passes == 0)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT,
                             "kvt_orthonormalise_rows: %s",
                             !V && rank > 0 ? "V is NULL"
                             : rank > n     ? "rank above the row length"
                                            : "passes is 0");
    for (uint32_t k = 0; k < rank; k++) {
        double *v = V + (size_t)k * n;
        double n_in = 0; /* the row's norm² before its projections go (only compared with) */
        for (uint32_t d = 0; d < n; d++)
            n_in += v[d] * v[d];
        for (uint32_t pass = 0; pass < passes; pass++)
            for (uint32_t j = 0; j < k; j++) {
                const double *u = V + (size_t)j * n;
                double dot = 0;
                for (uint32_t d = 0; d < n; d++)
                    dot += v[d] * u[d];
                for (uint32_t d = 0; d < n; d++)
                    v[d] -= dot * u[d];
            }
        double nn = 0;
        for (uint32_t d = 0; d < n; d++)
            nn += v[d] * v[d];
        nn = sqrt(nn);
        if (!(nn > 1e-10 * sqrt(n_in)) || !isfinite(nn))
            return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT,
                                 "kvt_orthonormalise_rows: row %u keeps norm %g of %g once "
                                 "orthogonalised (rows linearly dependent, or not finite)",
                                 k, nn, sqrt(n_in));
        for (uint32_t d = 0; d < n; d++)
            v[d] /= nn;
    }
    return KVT_OK;
}
