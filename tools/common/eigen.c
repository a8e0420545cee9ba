/*
 * eigen.c — the recall basis fit of eigen.h (moved from tools/inspect/calibrate.c, unchanged in
 * its arithmetic: kvtier-inspect calibrate writes the same bytes).
 */
#include "eigen.h"

#include <kvtier.h> /* kvt_orthonormalise_rows, kvt_last_error */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if KVT_HAVE_LAPACKE
#include <lapacke.h>
#endif

int eig_acc_init(eig_acc *a, uint32_t dim, bool centred) {
    memset(a, 0, sizeof *a);
    if (dim < 1 || dim > EIG_MAX_DIM)
        return EIG_EARG;
    a->centred = centred;
    a->dim = dim;
    a->x0 = calloc(dim, sizeof(double));
    a->s1 = calloc(dim, sizeof(double));
    a->s2 = calloc((size_t)dim * dim, sizeof(double));
    if (!a->x0 || !a->s1 || !a->s2) {
        eig_acc_free(a);
        return EIG_ENOMEM;
    }
    return EIG_OK;
}

void eig_acc_free(eig_acc *a) {
    free(a->x0);
    free(a->s1);
    free(a->s2);
    a->x0 = a->s1 = a->s2 = NULL;
}

void eig_acc_add(eig_acc *a, const float *x) {
    const uint32_t n = a->dim;
    if (a->n == 0 && a->centred)
        for (uint32_t i = 0; i < n; i++)
            a->x0[i] = x[i];
    double y[EIG_MAX_DIM];
    for (uint32_t i = 0; i < n; i++) {
        y[i] = (double)x[i] - a->x0[i];
        a->s1[i] += y[i];
    }
    for (uint32_t i = 0; i < n; i++) {
        double *row = a->s2 + (size_t)i * n;
        const double yi = y[i];
        for (uint32_t j = i; j < n; j++)
            row[j] += yi * y[j];
    }
    a->n++;
}

bool eig_have_lapacke(void) {
#if KVT_HAVE_LAPACKE
    return true;
#else
    return false;
#endif
}

int eig_top(const eig_acc *a, uint32_t rank, float *V, double *w_top, double *total, char *err,
            size_t err_len) {
    if (!a || !a->s2 || !V || rank < 1 || rank > a->dim || a->n < 2) {
        snprintf(err, err_len,
                 "eigenvectors: %llu samples of dim %u cannot give a rank-%u basis (two or more "
                 "samples and a rank of at most the dim are needed)",
                 a ? (unsigned long long)a->n : 0ull, a ? a->dim : 0u, rank);
        return EIG_EARG;
    }
#if !KVT_HAVE_LAPACKE
    (void)w_top, (void)total;
    snprintf(err, err_len,
             "built without LAPACKE: the eigenvectors need it (install Debian's "
             "liblapacke-dev, scripts/deps.sh, and reconfigure)");
    return EIG_ENOLAPACKE;
#else
    const uint32_t n = a->dim;
    const double N = (double)a->n;
    double *A = malloc(sizeof(double) * n * n);
    double *w = malloc(sizeof(double) * n);
    double *Z = malloc(sizeof(double) * n * rank);
    double *Vd = malloc(sizeof(double) * n * rank);
    lapack_int *supp = malloc(sizeof(lapack_int) * 2 * rank);
    if (!A || !w || !Z || !Vd || !supp) {
        free(A), free(w), free(Z), free(Vd), free(supp);
        snprintf(err, err_len, "eigenvectors: out of memory");
        return EIG_ENOMEM;
    }
    double tr = 0;
    for (uint32_t i = 0; i < n; i++) /* upper triangle only */
        for (uint32_t j = i; j < n; j++) {
            const double s2 = a->s2[(size_t)i * n + j];
            double v = a->centred ? (s2 - a->s1[i] * a->s1[j] / N) / (N - 1.0) : s2 / N;
            A[(size_t)i * n + j] = v;
            if (i == j)
                tr += v;
        }
    if (total)
        *total = tr;
    lapack_int m = 0;
    lapack_int info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', (lapack_int)n, A,
                                     (lapack_int)n, 0.0, 0.0, (lapack_int)(n - rank + 1),
                                     (lapack_int)n, 0.0, &m, w, Z, (lapack_int)rank, supp);
    int rc = EIG_OK;
    if (info != 0 || m != (lapack_int)rank) {
        snprintf(err, err_len, "LAPACKE_dsyevr failed (info %d, %d of %u eigenpairs)", (int)info,
                 (int)m, rank);
        rc = EIG_EFAIL;
    }
    /* dsyevr returns ascending eigenvalues; column j of Z (row-major [n][rank]) is eigenvector
     * j. */
    for (uint32_t k = 0; rc == EIG_OK && k < rank; k++) {
        uint32_t j = rank - 1 - k;
        if (w_top)
            w_top[k] = w[j];
        uint32_t arg = 0;
        for (uint32_t d = 1; d < n; d++)
            if (fabs(Z[(size_t)d * rank + j]) > fabs(Z[(size_t)arg * rank + j]))
                arg = d;
        double sign = Z[(size_t)arg * rank + j] < 0 ? -1.0 : 1.0;
        for (uint32_t d = 0; d < n; d++)
            Vd[(size_t)k * n + d] = sign * Z[(size_t)d * rank + j];
    }
    /* Modified Gram-Schmidt in double, twice over the whole basis ("twice is enough": two sweeps
     * of one pass each, every row normalised in each), directions and signs kept: rows
     * orthonormal to double precision before the fp32 rounding. */
    if (rc == EIG_OK && (kvt_orthonormalise_rows(Vd, rank, n, 1) != KVT_OK ||
                         kvt_orthonormalise_rows(Vd, rank, n, 1) != KVT_OK)) {
        snprintf(err, err_len, "%s", kvt_last_error());
        rc = EIG_EFAIL;
    }
    if (rc == EIG_OK)
        for (size_t i = 0; i < (size_t)rank * n; i++)
            V[i] = (float)Vd[i];
    free(A), free(w), free(Z), free(Vd), free(supp);
    return rc;
#endif
}
