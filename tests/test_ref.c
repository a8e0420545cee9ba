/*
 * test_ref.c — the public reference math (kvtier_ref.h) is the library's own math: σ bit-equal to
 * the salience twin, attention equal to the kernel's CPU twin, and every bad argument a status.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attn.h"
#include "kernels/sigma.h"
#include "kvtier_ref.h"
#include "support/testutil.h"

Test(ref, load_store_round_trip) {
    uint8_t row[16];
    const kvt_dtype dts[3] = {KVT_DTYPE_BF16, KVT_DTYPE_FP16, KVT_DTYPE_FP32};
    for (int k = 0; k < 3; k++) {
        kvt_ref_store(row, dts[k], 2, 1.5f);
        cr_assert_eq(kvt_ref_load(row, dts[k], 2), 1.5f);
    }
    cr_assert_eq(kvt_ref_load(row, KVT_DTYPE_FP8_E4M3, 0), 0.0f);
    cr_assert_eq(kvt_ref_load(NULL, KVT_DTYPE_BF16, 0), 0.0f);
    kvt_ref_store(NULL, KVT_DTYPE_BF16, 0, 1.0f); /* no-op, no crash */
}

Test(ref, sigma_block_bit_equal_to_the_tier_twin) {
    const uint32_t B = 256, kappa = 8, D = 64, nb = 2 * kappa - 1;
    const size_t stride = 1152;
    tu_rng rng = {77};
    uint8_t *rows = malloc(B * stride);
    cr_assert(rows);
    for (uint32_t u = 0; u < B; u++)
        for (uint32_t d = 0; d < D; d++)
            kvt_ref_store(rows + u * stride + 1024, KVT_DTYPE_BF16, d,
                          (float)(sin(0.01 * u + d) + 0.2 * tu_normal(&rng)));
    kvt_ref_store(rows + 9 * stride + 1024, KVT_DTYPE_BF16, 3, NAN);
    kvt_ref_sigma *h;
    cr_assert_eq(kvt_ref_sigma_create(B, kappa, D, &h), KVT_OK);
    uint32_t n_basis;
    const float *basis = kvt_ref_sigma_basis(h, &n_basis);
    cr_assert_eq(n_basis, nb);
    float *got = malloc(B * sizeof *got), *want = malloc(B * sizeof *want);
    cr_assert_eq(kvt_ref_sigma_block(h, rows, stride, 1024, KVT_DTYPE_BF16, got), KVT_OK);
    float *basis2 = malloc(nb * B * sizeof *basis2);
    float *scratch = malloc(kvt__sigma_scratch_floats(B, nb, D) * sizeof *scratch);
    int32_t *slots = malloc(B * sizeof *slots);
    for (uint32_t u = 0; u < B; u++)
        slots[u] = (int32_t)u;
    cr_assert_eq(kvt__fourier_basis(B, kappa, basis2), 0);
    cr_assert_eq(memcmp(basis, basis2, nb * B * sizeof *basis), 0);
    kvt__sigma_block_cpu(rows, slots, B, stride, 1024, KVT__DT_BF16, D, basis2, nb, scratch, want);
    cr_assert_eq(memcmp(got, want, B * sizeof *got), 0);
    cr_assert(isinf(got[9]));
    /* bad arguments */
    cr_assert_eq(kvt_ref_sigma_block(h, rows, 1100, 1024, KVT_DTYPE_BF16, got),
                 KVT_ERR_INVALID_ARGUMENT); /* branch past the stride */
    cr_assert_eq(kvt_ref_sigma_block(h, rows, stride, 1024, KVT_DTYPE_FP8_E4M3, got),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ref_sigma_block(h, NULL, stride, 1024, KVT_DTYPE_BF16, got),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ref_sigma_block(NULL, rows, stride, 1024, KVT_DTYPE_BF16, got),
                 KVT_ERR_INVALID_ARGUMENT);
    kvt_ref_sigma *h2 = (kvt_ref_sigma *)1;
    cr_assert_eq(kvt_ref_sigma_create(100, 8, 64, &h2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_null(h2);
    cr_assert_eq(kvt_ref_sigma_create(256, 129, 64, &h2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ref_sigma_create(256, 8, 257, &h2), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ref_sigma_create(256, 8, 64, NULL), KVT_ERR_INVALID_ARGUMENT);
    kvt_ref_sigma_destroy(h);
    kvt_ref_sigma_destroy(NULL);
    free(rows), free(got), free(want), free(basis2), free(scratch), free(slots);
}

Test(ref, attention_equals_the_kernel_twin) {
    const uint32_t N = 40, K = 576, V = 512, H = 3;
    tu_rng rng = {78};
    uint8_t *rows = malloc((size_t)N * 1152);
    float *q = malloc(sizeof(float) * H * K);
    uint8_t mark[40] = {0};
    mark[7] = 1;
    for (uint32_t j = 0; j < N; j++)
        for (uint32_t d = 0; d < K; d++)
            kvt_ref_store(rows + (size_t)j * 1152, KVT_DTYPE_BF16, d, (float)tu_normal(&rng));
    for (uint32_t i = 0; i < H * K; i++)
        q[i] = (float)tu_normal(&rng);
    size_t sd = kvt_ref_attn_scratch_doubles(N, H, V, K);
    cr_assert_eq(sd, kvt__attn_scratch_doubles(N, H, V, K));
    double *scratch = malloc(sizeof(double) * sd);
    float out1[3 * 512], out2[3 * 512];
    double mass1[3], mass2[3];
    kvt_ref_attn_args r = {.base = rows, .n_rows = N, .slot_stride = 1152, .dtype = KVT_DTYPE_BF16,
                           .key_dim = K, .value_dim = V, .q = q, .n_heads = H, .q_stride = K,
                           .scale = KVT_REF_ATTN_DEFAULT_SCALE, .mark = mark, .out = out1,
                           .mark_mass = mass1, .scratch = scratch};
    cr_assert_eq(kvt_ref_attn(&r), KVT_OK);
    kvt__attn_args a = {.base = rows, .n_rows = N, .slot_stride = 1152, .dtype = KVT__DT_BF16,
                        .key_dim = K, .value_dim = V, .q = q, .n_heads = H, .q_stride = K,
                        .scale = KVT__ATTN_DEFAULT_SCALE, .mark = mark, .out = out2,
                        .mark_mass = mass2, .scratch = scratch};
    cr_assert_eq(kvt__attn_cpu(&a), 0);
    cr_assert_eq(memcmp(out1, out2, sizeof out1), 0);
    cr_assert_eq(memcmp(mass1, mass2, sizeof mass1), 0);
    r.key_dim = KVT_REF_ATTN_MAX_DIM + 1;
    cr_assert_eq(kvt_ref_attn(&r), KVT_ERR_INVALID_ARGUMENT);
    r.key_dim = K;
    r.dtype = KVT_DTYPE_FP8_E4M3;
    cr_assert_eq(kvt_ref_attn(&r), KVT_ERR_INVALID_ARGUMENT);
    cr_assert_eq(kvt_ref_attn(NULL), KVT_ERR_INVALID_ARGUMENT);
    free(rows), free(q), free(scratch);
}
