/* bench_cpu.h — what the single-threaded CPU step benches (bench_decode, bench_decode_step) time
 * and compare with: the thread's CPU time, Box-Muller draws, and this machine's single-thread
 * sgemm rate (OpenBLAS, through the Fortran interface every BLAS has), measured in the same run as
 * the figures it is the ruler of; the data generator (Gaussian draws, the orthonormal basis, the
 * structured row) is ../bench_data.h's, included here. */
#ifndef KVT_BENCH_CPU_H
#define KVT_BENCH_CPU_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "../bench_data.h"
#include "../bench_util.h"
#include "kernels/kvt_hd.h"
#include "kvtier.h"

void sgemm_(const char *ta, const char *tb, const int *m, const int *n, const int *k,
            const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
            const float *beta, float *c, const int *ldc);
void openblas_set_num_threads(int n) __attribute__((weak));
char *openblas_get_corename(void) __attribute__((weak));

/* OpenBLAS pinned to one thread (the steps measured beside it are single-threaded), on the
 * kernels this CPU runs best. OpenBLAS picks its kernels from the CPU model when it loads; a model
 * it does not know gets its oldest x86-64 kernels (Debian 12's 0.3.21 on this Sapphire Rapids-class
 * machine: "Prescott", SSE3, 26–30 GFLOP/s against 145–152 with its SkylakeX kernels), which would
 * make every baseline measured against it look fast. Without OPENBLAS_CORETYPE in the environment
 * the program runs itself again with it set from the CPU's features (AVX-512: SkylakeX; AVX2 and
 * FMA: Haswell); a user's OPENBLAS_CORETYPE is kept. Call first in main. */
static inline void blas_setup(char **argv) {
    if (!getenv("OPENBLAS_CORETYPE")) {
        __builtin_cpu_init();
        const char *core = __builtin_cpu_supports("avx512f")  ? "SkylakeX"
                           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                               ? "Haswell"
                               : NULL;
        if (core && setenv("OPENBLAS_CORETYPE", core, 1) == 0) {
            execv("/proc/self/exe", argv);
            unsetenv("OPENBLAS_CORETYPE"); /* exec failed: go on with what OpenBLAS chose */
        }
    }
    if (openblas_set_num_threads)
        openblas_set_num_threads(1);
}

/* The kernels OpenBLAS runs ("?" when the BLAS is not OpenBLAS). */
static inline const char *blas_core(void) {
    return openblas_get_corename ? openblas_get_corename() : "?";
}

/* A standard normal draw by Box-Muller (the kernel benches' other data generator). */
static inline float gauss_bm(void) {
    double u = ((rnd() >> 11) + 1) * 0x1p-53, v = (rnd() >> 11) * 0x1p-53;
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* This thread's CPU time: the machine is shared, and a single-threaded step's CPU time does not
 * count the slices other processes take from it (their cache pressure still counts). */
static inline double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* GFLOP/s of the best of `reps` sgemm calls of shape m x n x k (the first call warms up). */
static inline double sgemm_gflops(int m, int n, int k, const char *ta, int reps) {
    float *A = malloc(sizeof(float) * (size_t)m * k), *B = malloc(sizeof(float) * (size_t)k * n);
    float *C = malloc(sizeof(float) * (size_t)m * n);
    for (size_t i = 0; i < (size_t)m * k; i++)
        A[i] = gauss();
    for (size_t i = 0; i < (size_t)k * n; i++)
        B[i] = gauss();
    const float one = 1.0f, zero = 0.0f;
    int lda = ta[0] == 'T' ? k : m;
    double best = 1e30;
    for (int r = 0; r < reps + 1; r++) {
        double t = cpu_s();
        sgemm_(ta, "N", &m, &n, &k, &one, A, &lda, B, &k, &zero, C, &m);
        t = cpu_s() - t;
        if (r > 0 && t < best)
            best = t;
    }
    free(A);
    free(B);
    free(C);
    return 2.0 * m * n * k / best * 1e-9;
}

#endif /* KVT_BENCH_CPU_H */
