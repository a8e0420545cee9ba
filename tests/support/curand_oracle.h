/*
 * curand_oracle.h — cuRAND, compiled for the host, as the reference test_philox compares
 * kernels/philox.h to. Built into test_philox only where the CUDA toolkit (headers + libcurand)
 * was found at configure time; then KVT_HAVE_CURAND=1. Needs no GPU.
 *
 * Every function returns 0 on success or the curandStatus_t it got (nonzero).
 */
#ifndef KVT_TESTS_CURAND_ORACLE_H
#define KVT_TESTS_CURAND_ORACLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Device API on the host: curand_init(seed, subseq, offset, &st) on a
 * curandStatePhilox4_32_10_t, then out[i] = curand(&st) for i < n. */
int oracle_curand(uint64_t seed, uint64_t subseq, uint64_t offset, size_t n, uint32_t *out);
/* Same, out[i] = curand_uniform(&st). */
int oracle_curand_uniform(uint64_t seed, uint64_t subseq, uint64_t offset, size_t n, float *out);
/* cuRAND's own mapping of one draw: _curand_uniform(x) from curand_uniform.h. */
float oracle_uniform(uint32_t x);
/* CURAND_2POW32_INV as the headers define it. */
float oracle_2pow32_inv(void);

/* Host generator: curandCreateGeneratorHost(CURAND_RNG_PSEUDO_PHILOX4_32_10), default ordering,
 * curandSetPseudoRandomGeneratorSeed(seed), curandSetGeneratorOffset(offset) when offset != 0,
 * then curandGenerate of n_first values into out and of n - n_first more into out + n_first
 * (two calls, to see where the second one continues; n_first = n for one call). */
int oracle_host_generate(uint64_t seed, uint64_t offset, size_t n_first, size_t n, uint32_t *out);
/* Same with curandGenerateUniform (one call). */
int oracle_host_generate_uniform(uint64_t seed, uint64_t offset, size_t n, float *out);

#ifdef __cplusplus
}
#endif

#endif
