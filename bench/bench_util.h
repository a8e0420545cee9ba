/* bench_util.h — what every benchmark times with: a monotonic clock, a seeded generator, and
 * the copy floor (the best of several memcpy of the same bytes, measured in the same run). */
#ifndef KVT_BENCH_UTIL_H
#define KVT_BENCH_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* splitmix64 over a per-program state (each bench seeds it as it likes). */
static uint64_t rng_state = 0x1234567;
static inline uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Best of `reps` memcpy of `bytes` between two touched buffers. */
static inline double memcpy_best(size_t bytes, int reps) {
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t = now_s();
        memcpy(b, a, bytes);
        t = now_s() - t;
        if (t < best)
            best = t;
    }
    volatile uint8_t sink = b[bytes / 2];
    (void)sink;
    free(a);
    free(b);
    return best;
}

/* A rank × d orthonormal basis (rows): double Gram-Schmidt of random rows, stored fp32. */
static inline void bench_basis(float *V, uint32_t rank, uint32_t d) {
    double *v = malloc(sizeof(double) * rank * d);
    for (uint32_t k = 0; k < rank; k++) {
        double *vk = v + (size_t)k * d;
        for (uint32_t i = 0; i < d; i++)
            vk[i] = (double)(rnd() >> 11) * 0x1p-53 - 0.5;
        for (int pass = 0; pass < 2; pass++)
            for (uint32_t j = 0; j < k; j++) {
                double dot = 0;
                for (uint32_t i = 0; i < d; i++)
                    dot += vk[i] * v[(size_t)j * d + i];
                for (uint32_t i = 0; i < d; i++)
                    vk[i] -= dot * v[(size_t)j * d + i];
            }
        double nn = 0;
        for (uint32_t i = 0; i < d; i++)
            nn += vk[i] * vk[i];
        for (uint32_t i = 0; i < d; i++) {
            vk[i] /= sqrt(nn);
            V[(size_t)k * d + i] = (float)vk[i];
        }
    }
    free(v);
}

#endif
