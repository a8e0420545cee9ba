/*
 * kvt_hd.h — what the CPU twins and the CUDA kernels share: the KVT_HD qualifier and the
 * element conversions every kernel uses. Read by gcc and by nvcc, so no C-only features
 * (restrict, _Generic, compound literals).
 */
#ifndef KVT_KERNELS_HD_H
#define KVT_KERNELS_HD_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define KVT_HD __host__ __device__ __forceinline__
#else
#define KVT_HD static inline
#endif

/* The per-element math is written with explicit fmaf so CPU and GPU round identically. On x86-64
 * without -mfma every fmaf is a libm call (a software fused multiply-add); the FMA clone of a CPU
 * twin marked KVT__FMA_CLONES runs the same correctly rounded operation as one instruction,
 * chosen at load time by the CPU's features (GCC function multiversioning). Results are
 * bit-identical between the clones. Host C only (nvcc never compiles a twin). -DKVT_NO_FMA_CLONES
 * builds the default code alone (to time what a CPU without FMA runs). */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__) &&     \
    !defined(__SANITIZE_ADDRESS__) && !defined(KVT_NO_FMA_CLONES)
#define KVT__FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define KVT__FMA_CLONES
#endif

/* Where the compiler does not know the CPU has FMA (no -mfma: the default clone above, every
 * clang and ASan build), an fmaf it does not expand into the instruction is a library call. On a
 * CPU without FMA, glibc's fmaf is a software routine that saves and restores the floating-point
 * environment on every call: 94% of test_recall_step's time on such a CPU, whose tests ran
 * 12-40x longer than on an FMA machine (CI timed out on one). Those calls are renamed here to
 * kvt__fmaf (kernels/fmaf.c): the FMA instruction where the CPU has it, else an exact emulation
 * in double (the product of two floats is exact in double; the sum's rounding error is recovered
 * exactly and folded in by rounding to odd, so the last rounding, to float, is the correctly
 * rounded a*b+c). Bit-identical to fmaf on every input, NaN payloads aside (tests/test_fmaf.c).
 * The rename changes only the symbol called: GCC still expands fmaf inline where FMA is enabled
 * (the FMA clones) and still folds constants. */
#if !defined(__CUDACC__) && defined(__x86_64__) && defined(__ELF__) && !defined(__FMA__) &&        \
    defined(__GNUC__)
#define KVT__FMAF_RENAMED 1
#if !defined(KVT__FMAF_IMPLEMENTATION) /* kernels/fmaf.c, tests/test_fmaf.c: no rename */
#include <math.h>
float fmaf(float, float, float) __asm__("kvt__fmaf");
#endif
#endif
#if !defined(__CUDACC__)
/* The emulation, on every host (what kvt__fmaf runs on a CPU without FMA). */
float kvt__fmaf_emulated(float a, float b, float c);
#endif

/* How many of s[0 .. n) (ascending) lie below v; whether v is among them. The sorted index
 * sets (kept sets, promoted rows, fired rows) are searched with these on every backend. */
KVT_HD uint64_t kvt__sorted_below(const uint32_t *s, uint64_t n, uint64_t v) {
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        const uint64_t mid = lo + (hi - lo) / 2;
        if (s[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

KVT_HD int kvt__sorted_has(const uint32_t *s, uint64_t n, uint64_t v) {
    const uint64_t i = kvt__sorted_below(s, n, v);
    return i < n && s[i] == v;
}

/* Element types, numbered as kvt_dtype in lib/kvtier.h (kept in sync by a static assertion). */
#define KVT__DT_BF16 0
#define KVT__DT_FP16 1
#define KVT__DT_FP32 2
#define KVT__DT_FP8 3

KVT_HD float kvt__f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

KVT_HD uint32_t kvt__bits_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

KVT_HD float kvt__bf16_to_f32(uint16_t h) {
    return kvt__f32_from_bits((uint32_t)h << 16);
}

/* Round to nearest even; NaN stays NaN (quiet). */
KVT_HD uint16_t kvt__f32_to_bf16(float f) {
    uint32_t u = kvt__bits_from_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE binary16 -> binary32, exact (subnormals, Inf, NaN included). */
KVT_HD float kvt__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return kvt__f32_from_bits(bits);
}

/* binary32 -> binary16, round to nearest even. */
KVT_HD uint16_t kvt__f32_to_f16(float f) {
    uint32_t u = kvt__bits_from_f32(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to >= 65520: Inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (a < 0x33000000u)
            return (uint16_t)sign;
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14 .. 24 */
        uint32_t half = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = ((a >> 13) - (112u << 10));
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

/* OCP FP8 E4M3 ("FN": bias 7, no infinities, S.1111.111 is NaN, largest finite 448) -> fp32,
 * exact. */
KVT_HD float kvt__e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xfu;
    uint32_t man = b & 0x7u;
    if (exp == 0xfu && man == 0x7u)
        return kvt__f32_from_bits(sign | 0x7fc00000u);
    if (exp == 0) /* zero or subnormal: man · 2^-9, exact in fp32 */
        return kvt__f32_from_bits(sign | kvt__bits_from_f32((float)man * 0.001953125f));
    return kvt__f32_from_bits(sign | ((exp + 127u - 7u) << 23) | (man << 20));
}

/* The fp8 row kvtier reads (FlashMLA's 656-B "ds_mla" layout, DESIGN §1): KVT__FP8_VALUES fp8
 * E4M3 latent values, then one fp32 scale per KVT__FP8_GROUP of them (4 scales at byte 512),
 * then the bf16 branch (byte 528, read through branch_offset / branch_dtype, never as fp8).
 * Latent value i = e4m3(byte i) · scale[i / 128], one fp32 rounding. A layer with fp8 rows
 * must have exactly this layout (lib/context.c checks it before any kernel reads one). */
#define KVT__FP8_VALUES 512u
#define KVT__FP8_GROUP 128u

#if defined(__CUDACC__)
/* The device's element loads (device code under nvcc; the CPU twins never see this branch). memcpy
 * from a uint8_t * is what the host wants, but nvcc cannot assume the alignment and reads a bf16
 * as two byte loads (issue 33: 21 of k_scan_rows' loads, 42 of k_step_rows'). Here every load is
 * naturally aligned and at least 2 bytes wide: a 2-byte element one u16 load (at an odd address
 * the two u16 units its bytes lie in), a 4-byte value one u32 load (two aligned words when
 * misaligned), an fp8 code the aligned u32 word holding it. The extra bytes read never leave the
 * aligned units the value's own bytes lie in, so no load touches a page or a sector the value does
 * not. kvtier's row layouts in practice are aligned (bf16 1152/1024, ds_mla 656/528): there the
 * misaligned branches never run. scripts/ptx-check.sh (ctest ptxas_no_spills) fails when a scan,
 * step, RoPE or pack kernel's PTX loads a byte of an element again. The CUDA emulation compiles
 * this branch too, each load a memcpy of the value's own bytes (the same value; ASan sees no
 * byte outside it), so the aligned-unit assembly below is nvcc's alone, unexercised there. */
#if defined(KVT_CUDA_EMU_RUNTIME_H)
__device__ __forceinline__ uint16_t kvt__dev_ld_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
__device__ __forceinline__ uint32_t kvt__dev_ld_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
__device__ __forceinline__ uint8_t kvt__dev_ld_u8(const uint8_t *p) {
    return *p;
}
#else
__device__ __forceinline__ uint16_t kvt__dev_ld_u16(const uint8_t *p) {
    const uintptr_t a = (uintptr_t)p;
    if (!(a & 1u))
        return *(const uint16_t *)p;
    /* the u16 units at p - 1 and p + 1, whole (plain loads would be narrowed by the compiler to
     * the one byte of each that is used: a byte load again) */
    uint16_t lo, hi;
    asm("ld.u16 %0, [%2];\n\tld.u16 %1, [%2+2];" : "=h"(lo), "=h"(hi) : "l"(p - 1));
    return (uint16_t)((lo >> 8) | (hi << 8));
}
__device__ __forceinline__ uint32_t kvt__dev_ld_u32(const uint8_t *p) {
    const uintptr_t a = (uintptr_t)p;
    const uint32_t sh = 8u * (uint32_t)(a & 3u);
    if (!sh)
        return *(const uint32_t *)p;
    const uint32_t *w = (const uint32_t *)(p - (a & 3u));
    return (w[0] >> sh) | (w[1] << (32u - sh));
}
__device__ __forceinline__ uint8_t kvt__dev_ld_u8(const uint8_t *p) {
    const uintptr_t a = (uintptr_t)p;
    return (uint8_t)(*(const uint32_t *)(p - (a & 3u)) >> (8u * (uint32_t)(a & 3u)));
}
#endif
#endif

/* Load element i of a row of dtype dt (bf16, fp16, fp32; fp8: latent i < KVT__FP8_VALUES of the
 * layout above, p the row's first byte) as fp32. */
KVT_HD float kvt__load_elem(const uint8_t *p, int dt, uint32_t i) {
#if defined(__CUDA_ARCH__)
    if (dt == KVT__DT_FP8)
        return kvt__e4m3_to_f32(kvt__dev_ld_u8(p + i)) *
               kvt__f32_from_bits(kvt__dev_ld_u32(p + KVT__FP8_VALUES + 4u * (i / KVT__FP8_GROUP)));
    if (dt == KVT__DT_FP32)
        return kvt__f32_from_bits(kvt__dev_ld_u32(p + 4u * i));
    const uint16_t h = kvt__dev_ld_u16(p + 2u * i);
#else
    if (dt == KVT__DT_FP8) {
        float scale;
        memcpy(&scale, p + KVT__FP8_VALUES + 4u * (i / KVT__FP8_GROUP), 4);
        return kvt__e4m3_to_f32(p[i]) * scale;
    }
    if (dt == KVT__DT_FP32) {
        float f;
        memcpy(&f, p + 4u * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2u * i, 2);
#endif
    return dt == KVT__DT_BF16 ? kvt__bf16_to_f32(h) : kvt__f16_to_f32(h);
}

/* Store v as element i of dtype dt (bf16, fp16, fp32; not fp8), rounding to nearest even. */
KVT_HD void kvt__store_elem(uint8_t *p, int dt, uint32_t i, float v) {
    if (dt == KVT__DT_FP32) {
        memcpy(p + 4u * i, &v, 4);
        return;
    }
    uint16_t h = dt == KVT__DT_BF16 ? kvt__f32_to_bf16(v) : kvt__f32_to_f16(v);
    memcpy(p + 2u * i, &h, 2);
}

/* ---------------------------------------------------------------------------------------------
 * Division by a page size fixed at context creation (slot = page * page_rows + row % page_rows).
 * Page sizes are arbitrary (vLLM's hybrid allocator uses 528-, 672- and 7,808-token blocks), so a
 * 64-bit division per row would sit in every emission loop (measured at 3.1-3.6 ns a row on the
 * host in round 1). Instead: a power of two divides by shift and mask; any other d by Lemire's
 * multiply-high with M = floor((2^64 - 1) / d) + 1, exact for every 32-bit numerator and divisor
 * (Lemire, Kaser, Kurz 2019, "Faster remainder by direct computation", Theorem 1). Row indices
 * fit in 32 bits because slots are int32.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt__div32 {
    uint32_t d;
    uint32_t shift; /* log2(d) when d is a power of two */
    uint64_t magic; /* 0 when d is a power of two (shift and mask), else M */
} kvt__div32;

static inline kvt__div32 kvt__div32_make(uint32_t d) {
    kvt__div32 r;
    r.d = d;
    r.shift = 0;
    r.magic = 0;
    if (d != 0 && (d & (d - 1)) == 0) {
        while ((1u << r.shift) < d)
            r.shift++;
    } else if (d != 0) {
        r.magic = UINT64_MAX / d + 1;
    }
    return r;
}

KVT_HD uint64_t kvt__mulhi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
    return __umul64hi(a, b);
#else
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#endif
}

/* n / d and n % d for n < 2^32. */
KVT_HD uint32_t kvt__div32_q(const kvt__div32 *v, uint32_t n) {
    return v->magic ? (uint32_t)kvt__mulhi64(v->magic, n) : n >> v->shift;
}
KVT_HD uint32_t kvt__div32_r(const kvt__div32 *v, uint32_t n) {
    return v->magic ? (uint32_t)kvt__mulhi64(v->magic * n, v->d) : n & (v->d - 1u);
}

/* Slot of row index `row` of a page table: pages[k] holds rows (first_page + k) * d onwards, d =
 * page_rows as a divider (no hardware division). The one mapping of rows to slots, for the host
 * (kvt__slot) and the backends' ops alike. */
KVT_HD int32_t kvt__page_slot(const int32_t *pages, uint64_t first_page, const kvt__div32 *pd,
                              uint32_t row) {
    return pages[kvt__div32_q(pd, row) - first_page] * (int32_t)pd->d +
           (int32_t)kvt__div32_r(pd, row);
}

#endif /* KVT_KERNELS_HD_H */
