/* bench_data.h — the decode benches' data generator (public API only): Gaussian draws, bf16
 * rounding, an orthonormal basis (the library's kvt_orthonormalise_rows) and the structured row
 * of issue 34's case, all from bench_util.h's seeded generator. */
#ifndef KVT_BENCH_DATA_H
#define KVT_BENCH_DATA_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kvtier.h"

/* A sum of 4 uniforms, centred and scaled to unit variance. */
static inline float gauss(void) {
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += (float)((rnd() >> 11) * 0x1p-53);
    return (s - 2.0f) * 1.7320508f;
}

/* Element i of a bf16 row set to x, rounded to nearest even (NaN stays a quiet NaN): the
 * library's rounding. */
static inline void store_bf16(uint8_t *row, uint32_t i, float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    uint16_t h;
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        h = (uint16_t)((b >> 16) | 0x40u);
    } else {
        b += 0x7fffu + ((b >> 16) & 1u);
        h = (uint16_t)(b >> 16);
    }
    memcpy(row + 2u * i, &h, sizeof h);
}

/* rank orthonormal rows of n values (Gram-Schmidt in double, two passes: the library's
 * kvt_orthonormalise_rows), stored fp32. */
static inline void orthonormal_f32(uint32_t rank, uint32_t n, float *out) {
    double *v = malloc(sizeof(double) * rank * n);
    for (size_t i = 0; i < (size_t)rank * n; i++)
        v[i] = gauss();
    if (kvt_orthonormalise_rows(v, rank, n, 2) != KVT_OK) {
        fprintf(stderr, "orthonormal basis: %s\n", kvt_last_error());
        exit(1);
    }
    for (size_t i = 0; i < (size_t)rank * n; i++)
        out[i] = (float)v[i];
    free(v);
}

/* Row r of the decode benches' structured data, bf16 [D latent | bd branch]: rows r < sinks are
 * sinks (sink_len·u plus a little noise, over all D + bd values); the others have latents with
 * 90% of their energy in the span of basis ([rank][D], orthonormal) and 10% isotropic, and an
 * isotropic branch. */
static inline void structured_row(uint8_t *row, uint32_t r, uint32_t sinks, const float *u,
                                  float sink_len, const float *basis, uint32_t rank, uint32_t D,
                                  uint32_t bd) {
    if (r < sinks) {
        for (uint32_t i = 0; i < D + bd; i++)
            store_bf16(row, i, sink_len * u[i] + 0.3f * gauss());
        return;
    }
    float a[256];
    for (uint32_t k = 0; k < rank && k < 256u; k++)
        a[k] = gauss() * sqrtf(0.9f * (float)D / (float)rank);
    for (uint32_t d = 0; d < D; d++) {
        float c = sqrtf(0.1f) * gauss();
        for (uint32_t k = 0; k < rank && k < 256u; k++)
            c += a[k] * basis[(size_t)k * D + d];
        store_bf16(row, d, c);
    }
    for (uint32_t j = 0; j < bd; j++)
        store_bf16(row, D + j, gauss());
}

#endif
