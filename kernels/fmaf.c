/*
 * fmaf.c — kvt__fmaf, the fused multiply-add the CPU twins call wherever the compiler did not
 * expand fmaf into the FMA instruction (kernels/kvt_hd.h renames those calls): the instruction
 * where the CPU has it, otherwise an exact emulation that needs no floating-point environment.
 *
 * The emulation: p = a*b is exact in double (24 + 24 significant bits < 53; the smallest product
 * of two float subnormals, 2^-298, is a normal double). s = RN(p + c) and its error e, exactly
 * (Knuth's two-sum: p and c are doubles and nothing overflows). When e != 0 and s is even in its
 * last bit, s moves one double ulp toward p + c: s is then p + c rounded to odd at 53 bits, and
 * rounding that to float (24 bits, or fewer for a float subnormal) rounds p + c correctly,
 * because 53 >= 24 + 2 (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums:
 * proved algorithms using rounding to odd", IEEE TC 2008). s cannot be 0 with e != 0: p and c
 * are multiples of 2^-298, so a nonzero p + c is at least that, a normal double.
 */
#define KVT__FMAF_IMPLEMENTATION
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kvt_hd.h"

float kvt__fmaf_emulated(float a, float b, float c) {
    const double p = (double)a * (double)b, dc = (double)c;
    double s = p + dc;
    if (!isfinite(s))
        return (float)s; /* an infinite or NaN operand or product: IEEE's sum of them */
    const double pv = s - dc, cv = s - pv;
    const double e = (p - pv) + (dc - cv);
    if (e != 0.0) {
        uint64_t u;
        memcpy(&u, &s, sizeof u);
        if ((u & 1u) == 0) {
            /* the neighbour toward p + c: away from zero when e has s's sign, else toward it */
            u = ((e > 0.0) == (s > 0.0)) ? u + 1 : u - 1;
            memcpy(&s, &u, sizeof s);
        }
    }
    return (float)s;
}

#if defined(KVT__FMAF_RENAMED)
__attribute__((target("fma"))) static float fmaf_instruction(float a, float b, float c) {
    return __builtin_fmaf(a, b, c);
}

/* What every renamed fmaf call reaches (its name is the asm label in kernels/kvt_hd.h). The
 * feature test is a load of libgcc's CPU model, set up before main. (Not an indirect function:
 * its resolver runs before the sanitizers' runtimes exist, and clang's ThreadSanitizer
 * instruments it even under no_sanitize: test_threads crashed in the dynamic loader.) */
float kvt__fmaf(float a, float b, float c);
float kvt__fmaf(float a, float b, float c) {
    if (__builtin_cpu_supports("fma"))
        return fmaf_instruction(a, b, c);
    return kvt__fmaf_emulated(a, b, c);
}
#endif
