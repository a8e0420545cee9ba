/*
 * test_fmaf.c — kernels/fmaf.c: the fused multiply-add the CPU twins call where the compiler did
 * not emit the FMA instruction (kernels/kvt_hd.h renames those fmaf calls to kvt__fmaf). Both the
 * emulation (kvt__fmaf_emulated, what a CPU without FMA runs) and the dispatching kvt__fmaf must
 * equal the correctly rounded fmaf bit for bit (NaNs: both NaN) on
 *   1. random bit patterns of every class (normals, subnormals, zeros, infinities, NaNs);
 *   2. double-rounding traps: a*b + c a hair off a float halfway point, below double's precision
 *      (a plain (float)((double)a*b + c) rounds these wrong: counted, so the cases are real);
 *   3. float-subnormal results, products beyond float's range cancelled by c, signed zeros.
 * The reference is the hardware instruction where the CPU has FMA, else the C library's fmaf
 * (correctly rounded; this file does not take kvt_hd.h's rename).
 */
#define KVT__FMAF_IMPLEMENTATION /* this file's fmaf is the C library's or the instruction */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kvt_hd.h"
#include "support/testutil.h"

#if defined(KVT__FMAF_RENAMED)
float kvt__fmaf(float a, float b, float c);
#define DISPATCHED(a, b, c) kvt__fmaf(a, b, c)
#else
#define DISPATCHED(a, b, c) fmaf(a, b, c) /* no rename on this host: fmaf is the instruction */
#endif

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("fma"))) static float fma_hw(float a, float b, float c) {
    return __builtin_fmaf(a, b, c);
}
static float reference(float a, float b, float c) {
    return __builtin_cpu_supports("fma") ? fma_hw(a, b, c) : fmaf(a, b, c);
}
#else
static float reference(float a, float b, float c) {
    return fmaf(a, b, c);
}
#endif

#define bits kvt__bits_from_f32
#define from_bits kvt__f32_from_bits

static bool same(float x, float y) {
    return (isnan(x) && isnan(y)) || bits(x) == bits(y);
}

typedef struct tally {
    uint64_t cases, naive_wrong, subnormal;
} tally;

static void check(tally *t, float a, float b, float c) {
    const float want = reference(a, b, c), emu = kvt__fmaf_emulated(a, b, c),
                got = DISPATCHED(a, b, c);
    if (!same(emu, want) || !same(got, want))
        cr_assert_fail("fmaf(%a, %a, %a): correctly rounded %a (0x%08x), emulated %a (0x%08x), "
                       "dispatched %a (0x%08x)",
                       (double)a, (double)b, (double)c, (double)want, bits(want), (double)emu,
                       bits(emu), (double)got, bits(got));
    const float naive = (float)((double)a * (double)b + (double)c);
    t->naive_wrong += !same(naive, want);
    t->subnormal += want != 0.0f && fabsf(want) < FLT_MIN;
    t->cases++;
}

Test(fmaf, random_bit_patterns) {
    tu_rng r = {.s = 0x6d61u};
    tally t = {0};
    for (int i = 0; i < 2000000; i++) {
        uint64_t x = tu_next(&r), y = tu_next(&r);
        check(&t, from_bits((uint32_t)x), from_bits((uint32_t)(x >> 32)), from_bits((uint32_t)y));
    }
    /* Same-scale operands, where cancellation and rounding are exercised rather than one term
     * swamping the others: exponents within a few binades of each other. */
    for (int i = 0; i < 2000000; i++) {
        int e = (int)(tu_next(&r) % 200) - 100;
        float a = ldexpf((float)(tu_uniform(&r) * 2 - 1), e / 2),
              b = ldexpf((float)(tu_uniform(&r) * 2 - 1), e - e / 2),
              c = ldexpf((float)(tu_uniform(&r) * 2 - 1), e + (int)(tu_next(&r) % 5) - 2);
        check(&t, a, b, c);
    }
    cr_log_info("fmaf: %llu random cases equal", (unsigned long long)t.cases);
}

/* a*b = 2^k (1 - 2^-2j) or (1 + 2^-j)(1 + 2^-j) with k putting the product at half a float ulp
 * of c (plus a hair): p + c is within 2^-50 relative of a halfway point, so rounding first to
 * double lands on it and the tie then breaks the wrong way for a naive two-step rounding. */
Test(fmaf, double_rounding_traps) {
    tu_rng r = {.s = 0x0dd5u};
    tally t = {0};
    for (int i = 0; i < 400000; i++) {
        const int E = (int)(tu_next(&r) % 220) - 110;            /* c's binade */
        const float c0 = ldexpf((float)(1.0 + tu_uniform(&r)), E); /* [2^E, 2^(E+1)) */
        const float c = (tu_next(&r) & 1) ? -c0 : c0;
        const int j = 12 + (int)(tu_next(&r) % 12);               /* 2^-2j below 2^-53 */
        const float u = ldexpf(1.0f, -j);
        float a, b;
        switch (tu_next(&r) % 3) {
        case 0: a = 1.0f - u, b = 1.0f + u; break; /* 1 - 2^-2j */
        case 1: a = 1.0f + u, b = 1.0f + u; break; /* 1 + 2^-(j-1) + 2^-2j */
        default: a = 1.0f - u, b = 1.0f - u; break;
        }
        const int k = E - 24 + (int)(tu_next(&r) % 3) - 1; /* half an ulp of c, and beside it */
        a = ldexpf(a, k);
        if (tu_next(&r) & 1)
            a = -a;
        check(&t, a, b, c);
        check(&t, b, a, c);
    }
    cr_log_info("fmaf: %llu halfway cases equal; a naive double sum rounds %llu of them wrong",
                (unsigned long long)t.cases, (unsigned long long)t.naive_wrong);
    cr_assert_gt(t.naive_wrong, t.cases / 50, "the traps must be real: naive wrong in %llu of %llu",
                 (unsigned long long)t.naive_wrong, (unsigned long long)t.cases);
}

Test(fmaf, subnormal_overflow_and_special_values) {
    tu_rng r = {.s = 0x5ab7u};
    tally t = {0};
    for (int i = 0; i < 400000; i++) {
        /* results near and below FLT_MIN: products of ~2^-75 each, c a subnormal or small */
        float a = ldexpf((float)(tu_uniform(&r) * 2 - 1), -60 - (int)(tu_next(&r) % 20)),
              b = ldexpf((float)(tu_uniform(&r) * 2 - 1), -60 - (int)(tu_next(&r) % 20)),
              c = from_bits((uint32_t)(tu_next(&r) % 0x01000000u) | (uint32_t)(tu_next(&r) & 1) << 31);
        check(&t, a, b, c);
        /* a product beyond FLT_MAX cancelled by c: finite in a fused operation */
        float big = ldexpf((float)(1.0 + tu_uniform(&r)), 64 + (int)(tu_next(&r) % 10));
        check(&t, big, big, -FLT_MAX);
        check(&t, big, -big, FLT_MAX);
    }
    const float sp[] = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, FLT_MAX, -FLT_MAX,
                        FLT_MIN, FLT_TRUE_MIN, -FLT_TRUE_MIN, 0x1.fffffep-1f, 3.0f};
    const size_t n = sizeof sp / sizeof sp[0];
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < n; j++)
            for (size_t k = 0; k < n; k++)
                check(&t, sp[i], sp[j], sp[k]);
    cr_log_info("fmaf: %llu edge cases equal, %llu with a subnormal result",
                (unsigned long long)t.cases, (unsigned long long)t.subnormal);
    cr_assert_gt(t.subnormal, 10000u, "subnormal results must be exercised: %llu",
                 (unsigned long long)t.subnormal);
}
