/*
 * curand_oracle.cu — cuRAND's Philox as a host-side oracle for test_philox (see curand_oracle.h).
 *
 * One file, two compilers:
 *   - g++ (test_philox.cmake sets LANGUAGE CXX): the oracle linked into test_philox. cuRAND's
 *     device API is header-only; curand_kernel.h wraps every function in QUALIFIERS, which it
 *     defines as `static __forceinline__ __device__` only #if !defined(QUALIFIERS). Defining it
 *     first as plain `static inline` makes the whole device API ordinary host C++ (its 32x32->64
 *     multiply already has a host branch, NV_IF_ELSE_TARGET(NV_IS_HOST, ...)).
 *   - nvcc (a compile-only check when nvcc exists): QUALIFIERS becomes __host__ __device__ and a
 *     kernel below calls kernels/philox.h next to cuRAND in device code, so a change that nvcc
 *     cannot read (restrict, _Generic, compound literals, a host-only call) breaks the build.
 */
#if defined(__CUDACC__)
#define QUALIFIERS static __forceinline__ __host__ __device__
#else
#define QUALIFIERS static inline
#endif

#include <curand.h>
#include <curand_kernel.h>

#include "kernels/philox.h"
#include "support/curand_oracle.h"

extern "C" int oracle_curand(uint64_t seed, uint64_t subseq, uint64_t offset, size_t n,
                             uint32_t *out) {
    curandStatePhilox4_32_10_t st;
    curand_init(seed, subseq, offset, &st);
    for (size_t i = 0; i < n; i++)
        out[i] = curand(&st);
    return 0;
}

extern "C" int oracle_curand_uniform(uint64_t seed, uint64_t subseq, uint64_t offset, size_t n,
                                     float *out) {
    curandStatePhilox4_32_10_t st;
    curand_init(seed, subseq, offset, &st);
    for (size_t i = 0; i < n; i++)
        out[i] = curand_uniform(&st);
    return 0;
}

extern "C" float oracle_uniform(uint32_t x) {
    return _curand_uniform(x);
}

extern "C" float oracle_2pow32_inv(void) {
    return CURAND_2POW32_INV;
}

extern "C" int oracle_host_generate(uint64_t seed, uint64_t offset, size_t n_first, size_t n,
                                    uint32_t *out) {
    curandGenerator_t g;
    curandStatus_t st = curandCreateGeneratorHost(&g, CURAND_RNG_PSEUDO_PHILOX4_32_10);
    if (st != CURAND_STATUS_SUCCESS)
        return (int)st;
    st = curandSetPseudoRandomGeneratorSeed(g, seed);
    if (st == CURAND_STATUS_SUCCESS && offset != 0)
        st = curandSetGeneratorOffset(g, offset);
    if (st == CURAND_STATUS_SUCCESS && n_first > 0)
        st = curandGenerate(g, out, n_first);
    if (st == CURAND_STATUS_SUCCESS && n > n_first)
        st = curandGenerate(g, out + n_first, n - n_first);
    curandDestroyGenerator(g);
    return (int)st;
}

extern "C" int oracle_host_generate_uniform(uint64_t seed, uint64_t offset, size_t n, float *out) {
    curandGenerator_t g;
    curandStatus_t st = curandCreateGeneratorHost(&g, CURAND_RNG_PSEUDO_PHILOX4_32_10);
    if (st != CURAND_STATUS_SUCCESS)
        return (int)st;
    st = curandSetPseudoRandomGeneratorSeed(g, seed);
    if (st == CURAND_STATUS_SUCCESS && offset != 0)
        st = curandSetGeneratorOffset(g, offset);
    if (st == CURAND_STATUS_SUCCESS)
        st = curandGenerateUniform(g, out, n);
    curandDestroyGenerator(g);
    return (int)st;
}

#if defined(__CUDACC__)
/* Compile-only (nothing launches it in this build): each thread compares cuRAND's device API
 * with kernels/philox.h for draw `i` of one stream and counts mismatches. */
__global__ void oracle_device_agreement(uint64_t key, uint64_t subseq, uint32_t n,
                                        unsigned int *mismatches) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    curandStatePhilox4_32_10_t st;
    kvt__philox_state ks;
    curand_init(key, subseq, i, &st);
    kvt__philox_init(key, subseq, i, &ks);
    uint32_t first = kvt__philox_draw_at(key, subseq, i);
    unsigned int bad = 0;
    for (int d = 0; d < 5; d++) {
        uint32_t a = curand(&st), b = kvt__philox_next(&ks);
        bad += a != b;
        bad += d == 0 && a != first;
        bad += _curand_uniform(a) != kvt__philox_uniform(b);
    }
    /* splitmix64 is a bijection, so distinct requests get distinct keys */
    bad += kvt__philox_key(key, i) == kvt__philox_key(key, i + 1u);
    if (bad)
        atomicAdd(mismatches, bad);
}
#endif
