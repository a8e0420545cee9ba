/* test_topm.c — exact radix top-m select against a sort-based reference; kvt__score_key order. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/topm.h"
#include "support/testutil.h"

#define GUARD 0xDEADBEEFu
#define N_GUARD 8

/* Reference: sort indices by (key descending, index ascending), take m, sort ascending. */
static const uint32_t *g_keys;

static int cmp_rank(const void *a, const void *b) {
    uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
    if (g_keys[i] != g_keys[j])
        return g_keys[i] > g_keys[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : (x > y);
}

static uint32_t ref_topm(const uint32_t *keys, uint32_t n, uint32_t m, uint32_t *out) {
    uint32_t take = m < n ? m : n;
    uint32_t *order = malloc(((size_t)n + 1) * sizeof *order);
    cr_assert_not_null(order);
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    g_keys = keys;
    qsort(order, n, sizeof *order, cmp_rank);
    memcpy(out, order, (size_t)take * sizeof *out);
    qsort(out, take, sizeof *out, cmp_u32);
    free(order);
    return take;
}

/* Run the radix select with guard words after idx_out and scratch; compare with the reference. */
static void check_topm(const uint32_t *keys, uint32_t n, uint32_t m, const char *what,
                       uint64_t seed) {
    uint32_t take = m < n ? m : n;
    size_t ns = kvt__topm_scratch_u32(n);
    uint32_t *idx = malloc(((size_t)take + N_GUARD) * sizeof *idx);
    uint32_t *ref = malloc(((size_t)take + 1) * sizeof *ref);
    uint32_t *scratch = malloc((ns + N_GUARD) * sizeof *scratch);
    cr_assert(idx && ref && scratch);
    for (uint32_t g = 0; g < N_GUARD; g++) {
        idx[take + g] = GUARD;
        scratch[ns + g] = GUARD;
    }
    kvt__topm_u32(keys, n, m, idx, scratch);
    for (uint32_t g = 0; g < N_GUARD; g++) {
        cr_assert_eq(idx[take + g], GUARD, "%s: n=%u m=%u seed=%llu: write past idx_out", what, n,
                     m, (unsigned long long)seed);
        cr_assert_eq(scratch[ns + g], GUARD, "%s: n=%u m=%u seed=%llu: write past scratch", what, n,
                     m, (unsigned long long)seed);
    }
    uint32_t got = ref_topm(keys, n, m, ref);
    cr_assert_eq(got, take);
    for (uint32_t i = 0; i < take; i++)
        cr_assert_eq(idx[i], ref[i], "%s: n=%u m=%u seed=%llu: idx[%u] = %u, reference %u", what, n,
                     m, (unsigned long long)seed, i, idx[i], ref[i]);
    free(idx);
    free(ref);
    free(scratch);
}

static void check_many_m(const uint32_t *keys, uint32_t n, const char *what, uint64_t seed) {
    uint32_t ms[] = {0, 1, 2, 3, n / 32, n / 7, n / 2, n - 1, n, n + 1, n + 1000};
    for (size_t k = 0; k < sizeof ms / sizeof ms[0]; k++)
        check_topm(keys, n, ms[k], what, seed);
}

Test(topm, random_keys) {
    uint32_t ns[] = {1, 2, 3, 7, 64, 100, 1000, 4096, 10007, 65536};
    for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
        uint64_t seed = 1000 + t;
        tu_rng rng = {seed};
        uint32_t n = ns[t];
        uint32_t *keys = malloc((size_t)n * sizeof *keys);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = (uint32_t)tu_next(&rng);
        check_many_m(keys, n, "uniform u32", seed);
        /* Narrow range: many ties and shared high digits. */
        for (uint32_t i = 0; i < n; i++)
            keys[i] = 0x80000000u + (uint32_t)(tu_next(&rng) % 50);
        check_many_m(keys, n, "narrow range", seed);
        /* Shared top 22 bits, differing only in the last digit. */
        for (uint32_t i = 0; i < n; i++)
            keys[i] = 0x12345400u | (uint32_t)(tu_next(&rng) & 0x3ffu);
        check_many_m(keys, n, "last digit only", seed);
        /* Random σ-like floats through the score key. */
        for (uint32_t i = 0; i < n; i++)
            keys[i] = kvt__score_key((float)(tu_uniform(&rng) * tu_uniform(&rng) * 10.0));
        check_many_m(keys, n, "sigma floats", seed);
        free(keys);
    }
}

Test(topm, random_m) {
    uint64_t seed = 77;
    tu_rng rng = {seed};
    for (int rep = 0; rep < 200; rep++) {
        uint32_t n = 1 + (uint32_t)(tu_next(&rng) % 3000);
        uint32_t m = (uint32_t)(tu_next(&rng) % (n + 2));
        uint32_t *keys = malloc((size_t)n * sizeof *keys);
        uint32_t mod = 1 + (uint32_t)(tu_next(&rng) % 5000);
        for (uint32_t i = 0; i < n; i++)
            keys[i] = (rep & 1) ? (uint32_t)tu_next(&rng) : (uint32_t)(tu_next(&rng) % mod) << 7;
        check_topm(keys, n, m, "random n, m", seed);
        free(keys);
    }
}

Test(topm, adversarial) {
    const uint32_t n = 5000;
    uint32_t *keys = malloc(n * sizeof *keys);
    uint64_t seed = 4242;
    tu_rng rng = {seed};

    for (uint32_t i = 0; i < n; i++)
        keys[i] = 0x9abcdef0u;
    check_many_m(keys, n, "all equal", seed);
    for (uint32_t i = 0; i < n; i++)
        keys[i] = 0;
    check_many_m(keys, n, "all zero keys", seed);
    for (uint32_t i = 0; i < n; i++)
        keys[i] = 0xffffffffu;
    check_many_m(keys, n, "all 0xFFFFFFFF", seed);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t r = tu_next(&rng) % 4;
        keys[i] = r == 0 ? 0u : r == 1 ? 0xffffffffu : r == 2 ? 1u : 0xfffffffeu;
    }
    check_many_m(keys, n, "extremes mix", seed);
    for (uint32_t i = 0; i < n; i++)
        keys[i] = (uint32_t)(tu_next(&rng) % 3);
    check_many_m(keys, n, "three values", seed);

    /* Floats: zeros of both signs, denormals, NaN, ±Inf, a single huge value. */
    float *f = malloc(n * sizeof *f);
    for (uint32_t i = 0; i < n; i++) {
        switch (tu_next(&rng) % 9) {
        case 0:
            f[i] = 0.0f;
            break;
        case 1:
            f[i] = -0.0f;
            break;
        case 2:
            f[i] = kvt__f32_from_bits(1u + (uint32_t)(tu_next(&rng) % 0x7fffffu));
            break;
        case 3:
            f[i] = kvt__f32_from_bits(0x80000001u + (uint32_t)(tu_next(&rng) % 0x7ffffeu));
            break;
        case 4:
            f[i] = kvt__f32_from_bits(0x7fc00000u | (uint32_t)(tu_next(&rng) & 0x3fffffu));
            break;
        case 5:
            f[i] = kvt__f32_from_bits(0xffc00001u);
            break;
        case 6:
            f[i] = INFINITY;
            break;
        case 7:
            f[i] = -INFINITY;
            break;
        default:
            f[i] = (float)tu_normal(&rng);
            break;
        }
    }
    for (uint32_t i = 0; i < n; i++)
        keys[i] = kvt__score_key(f[i]);
    check_many_m(keys, n, "zeros/denormals/NaN/Inf", seed);
    for (uint32_t i = 0; i < n; i++)
        keys[i] = kvt__score_key(1.0f);
    keys[n / 3] = kvt__score_key(3.0e38f);
    check_many_m(keys, n, "single huge", seed);
    uint32_t one, scratch[KVT__TOPM_MAX_BINS];
    kvt__topm_u32(keys, n, 1, &one, scratch);
    cr_assert_eq(one, n / 3);

    /* n = 1 */
    uint32_t k1 = 0xffffffffu;
    check_topm(&k1, 1, 0, "n=1", seed);
    check_topm(&k1, 1, 1, "n=1", seed);
    check_topm(&k1, 1, 5, "n=1", seed);
    free(f);
    free(keys);
}

Test(topm, n_zero_writes_nothing) {
    uint32_t idx[2] = {GUARD, GUARD};
    uint32_t scratch[KVT__TOPM_MAX_BINS];
    kvt__topm_u32(NULL, 0, 5, idx, scratch);
    cr_assert_eq(idx[0], GUARD);
    uint32_t k[3] = {1, 2, 3};
    kvt__topm_u32(k, 3, 0, idx, scratch);
    cr_assert_eq(idx[0], GUARD);
}

Test(topm, score_key_order) {
    const uint32_t kinf = kvt__score_key(INFINITY);
    cr_assert_eq(kinf, 0xff800000u);
    cr_assert_eq(kvt__score_key(NAN), kinf);
    cr_assert_eq(kvt__score_key(-NAN), kinf);
    cr_assert_eq(kvt__score_key(kvt__f32_from_bits(0x7f800001u)), kinf); /* signalling */
    cr_assert_eq(kvt__score_key(kvt__f32_from_bits(0xffffffffu)), kinf);
    cr_assert_eq(kvt__score_key(0.0f), kvt__score_key(-0.0f));
    const uint32_t kninf = kvt__score_key(-INFINITY);
    cr_assert_eq(kninf, 0x007fffffu);
    cr_assert_lt(kninf, kvt__score_key(-3.4028235e38f));
    cr_assert_gt(kinf, kvt__score_key(3.4028235e38f));
    cr_assert_gt(kvt__score_key(1.4e-45f), kvt__score_key(0.0f)); /* smallest denormal */
    cr_assert_lt(kvt__score_key(-1.4e-45f), kvt__score_key(-0.0f));
    cr_assert_gt(kvt__score_key(1.0f), kvt__score_key(0.99999994f));
    cr_assert_lt(kvt__score_key(-1.0f), kvt__score_key(-0.99999994f));

    /* Random pairs: key order equals float order (finite and ±Inf). */
    uint64_t seed = 99;
    tu_rng rng = {seed};
    for (int i = 0; i < 200000; i++) {
        float a, b;
        do {
            a = kvt__f32_from_bits((uint32_t)tu_next(&rng));
        } while (isnan(a));
        if (i % 3 == 0)
            b = nextafterf(a, (tu_next(&rng) & 1) ? INFINITY : -INFINITY);
        else
            do {
                b = kvt__f32_from_bits((uint32_t)tu_next(&rng));
            } while (isnan(b));
        uint32_t ka = kvt__score_key(a), kb = kvt__score_key(b);
        int fo = a < b ? -1 : (a > b), ko = ka < kb ? -1 : (ka > kb);
        cr_assert_eq(fo, ko, "seed=%llu: a=%a b=%a keys %08x %08x", (unsigned long long)seed,
                     (double)a, (double)b, ka, kb);
        cr_assert_leq(ka, kinf);
        cr_assert_geq(ka, kninf);
    }
    /* Every bit pattern's key is in [key(-Inf), key(+Inf)]: NaNs never fall below a number. */
    for (uint64_t u = 0; u <= 0xffffffffull; u += 65521) {
        uint32_t k = kvt__score_key(kvt__f32_from_bits((uint32_t)u));
        cr_assert(k >= kninf && k <= kinf, "bits %08x -> key %08x", (unsigned)u, k);
    }
}

/* The page-size divider (kernels/kvt_hd.h): quotient and remainder equal / and % for the page
 * sizes engines use (powers of two by shift and mask; 528, 672, 7808 and every size up to 1100 by
 * the multiply-high inverse), exhaustively over the first 2^20 rows and at the top of the 32-bit
 * range. */
#include "kernels/kvt_hd.h"

static void div_check(uint32_t d, uint32_t n) {
    kvt__div32 v = kvt__div32_make(d);
    uint32_t q = kvt__div32_q(&v, n), r = kvt__div32_r(&v, n);
    cr_assert(q == n / d && r == n % d, "d %u n %u: q %u r %u, want %u %u", d, n, q, r, n / d,
              n % d);
}

Test(div32, equals_hardware_division) {
    for (uint32_t d = 1; d <= 1100; d++)
        for (uint32_t n = 0; n < 5000; n++)
            div_check(d, n);
    const uint32_t sizes[] = {16, 64, 528, 672, 7808, 65536, 65535, 3, 7};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        for (uint32_t n = 0; n < (1u << 20); n++)
            div_check(sizes[k], n);
        for (uint32_t n = UINT32_MAX; n > UINT32_MAX - 100000u; n--)
            div_check(sizes[k], n);
    }
}
