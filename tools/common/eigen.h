/*
 * eigen.h — the recall basis fit shared by `kvtier-inspect calibrate` and the needle suite's
 * adaptive basis (tools/needle/core/run.c, nd_run_params.recall_adapt): a running sum of samples
 * (the centred covariance, or the uncentred second moment) and its top eigenvectors, rounded to
 * fp32 as a basis file stores them (docs/recall.md §5).
 *
 * The eigenvectors come from LAPACKE_dsyevr (Debian liblapacke-dev). Built without it
 * (KVT_HAVE_LAPACKE unset: the package absent at configure time, or -DKVT_LAPACKE=OFF), the
 * accumulator works and eig_top returns EIG_ENOLAPACKE with a message naming the package;
 * eig_have_lapacke() says so beforehand.
 *
 * Functions return EIG_OK (0) or a nonzero EIG_E* code with a message in err (err_len bytes;
 * err may be NULL with err_len 0).
 */
#ifndef KVT_TOOLS_EIGEN_H
#define KVT_TOOLS_EIGEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define EIG_OK 0
#define EIG_EARG 1 /* bad dimension or rank, or too few samples */
#define EIG_ENOMEM 2
#define EIG_ENOLAPACKE 3 /* built without LAPACKE */
#define EIG_EFAIL 4      /* the eigensolver or the orthonormalisation failed */

#define EIG_MAX_DIM 4096u

/* The running sums of one set of samples: Σ(x − x0) and the upper triangle of
 * Σ(x − x0)(x − x0)ᵀ, row-major [dim][dim], where x0 is the first sample when centred (a shift
 * that keeps a large mean from cancelling digits) and 0 otherwise (the uncentred second moment). */
typedef struct eig_acc {
    bool centred;
    uint32_t dim;
    uint64_t n;
    double *x0, *s1, *s2;
} eig_acc;

/* Zeroed sums of dim (1..EIG_MAX_DIM) values. EIG_EARG, EIG_ENOMEM (nothing allocated). */
int eig_acc_init(eig_acc *a, uint32_t dim, bool centred);
void eig_acc_free(eig_acc *a);
/* Add one sample of a->dim values (finite: the caller checks). */
void eig_acc_add(eig_acc *a, const float *x);

/* Whether eig_top can run (the build has LAPACKE). */
bool eig_have_lapacke(void);

/* The top-`rank` eigenpairs of a's matrix — the centred covariance
 * (Σyyᵀ − (Σy)(Σy)ᵀ / N) / (N − 1), the shift x0 cancelling, or the uncentred second moment
 * Σxxᵀ / N: V [rank][dim] fp32, row k the eigenvector of the k-th largest eigenvalue with its
 * sign fixed so that its largest component is positive (the result is a pure function of the
 * samples), re-orthonormalised in double (modified Gram-Schmidt twice, kvt_orthonormalise_rows)
 * before the fp32 rounding; the eigenvalues descending into w_top[rank] and the matrix's trace
 * into *total (either may be NULL). Needs 2 <= a->n and 1 <= rank <= a->dim (EIG_EARG); with
 * n − 1 < rank (centred) the last rows span directions of zero variance, still orthonormal. */
int eig_top(const eig_acc *a, uint32_t rank, float *V, double *w_top, double *total, char *err,
            size_t err_len);

#endif /* KVT_TOOLS_EIGEN_H */
