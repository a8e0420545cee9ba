/*
 * topm.h — exact top-m selection over 32-bit keys (DESIGN §2.1: "exact top-m by a radix/histogram
 * select ... O(n), no sort"), and the order-preserving float → key map used to rank σ. Pure math,
 * no state. The per-key pieces are KVT_HD inline functions for the CUDA twin; this header is read
 * by gcc and nvcc (no restrict, _Generic or compound literals).
 *
 * Selection (kvt__topm_u32). Keys are compared as unsigned 32-bit integers, larger first, ties to
 * the lower index. The m-th largest key T is found digit by digit, most significant first, with
 * three histogram passes over the keys:
 *
 *     level 0: bits 31..21 (11 bits, 2048 bins)   — for σ >= 0 keyed by kvt__score_key the sign
 *                                                    bit is always set, so only the upper 1024
 *                                                    bins are used: DESIGN's `bits >> 21`
 *     level 1: bits 20..10 (11 bits)               over the keys whose bits 31..21 match
 *     level 2: bits  9..0  (10 bits, 1024 bins)    over the keys whose bits 31..10 match
 *
 * At each level the bins are scanned from the highest down, accumulating counts, until the
 * running count reaches `need` (initially m); that bin fixes the next digit of T and `need`
 * drops by the count of keys strictly above the bin. After level 2, T is exact and `need` is the
 * number of keys equal to T to take. A last pass emits, in ascending index order, every key > T
 * and the first `need` keys == T. Four reads of the keys; no sort; arbitrary uint32 keys (0 and
 * 0xFFFFFFFF included), so the same routine serves the random-eviction keys (raw Philox draws).
 */
#ifndef KVT_KERNELS_TOPM_H
#define KVT_KERNELS_TOPM_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kvt_hd.h"

#define KVT__TOPM_LEVELS 3u
#define KVT__TOPM_MAX_BINS 2048u

/* Order-preserving map of a float to a uint32 key: a > b (as floats) implies key(a) > key(b),
 * and equal floats give equal keys. Canonicalisation: every NaN (either sign, any payload) and
 * +Inf map to the key of +Inf (0xFF800000, the largest key produced: a non-finite score is kept,
 * never dropped), −Inf to 0x007FFFFF (the smallest key produced), −0 and +0 both to 0x80000000.
 * Positives set the sign bit; negatives are bit-inverted so that more negative is smaller. */
KVT_HD uint32_t kvt__score_key(float f) {
    uint32_t u = kvt__bits_from_f32(f);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) { /* Inf or NaN */
        if (a > 0x7f800000u || u == 0x7f800000u)
            return 0xff800000u; /* NaN, +Inf */
        return 0x007fffffu;     /* -Inf */
    }
    if (a == 0)
        return 0x80000000u; /* ±0 */
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Shift and width of digit `level` (0 = most significant). */
KVT_HD uint32_t kvt__topm_shift(uint32_t level) {
    return level == 0 ? 21u : (level == 1 ? 10u : 0u);
}

KVT_HD uint32_t kvt__topm_bins(uint32_t level) {
    return level == 2 ? 1024u : 2048u;
}

/* Digit of key at level. */
KVT_HD uint32_t kvt__topm_digit(uint32_t key, uint32_t level) {
    return (key >> kvt__topm_shift(level)) & (kvt__topm_bins(level) - 1u);
}

/* Whether key agrees with the prefix fixed by the levels above `level` (prefix holds those bits
 * in place, lower bits zero). Level 0 has no prefix: every key takes part. */
KVT_HD int kvt__topm_in_prefix(uint32_t key, uint32_t level, uint32_t prefix) {
    if (level == 0)
        return 1;
    uint32_t hi_shift = kvt__topm_shift(level - 1); /* bits at and above it are fixed */
    return (key >> hi_shift) == (prefix >> hi_shift);
}

/* Scan hist[0..nbins) from the highest bin down until the running count reaches *need (>= 1,
 * <= the histogram's total); return that bin and lower *need by the count strictly above it. */
KVT_HD uint32_t kvt__topm_pick_bin(const uint32_t *hist, uint32_t nbins, uint32_t *need) {
    uint32_t above = 0;
    uint32_t b = nbins;
    while (b > 0) {
        b--;
        if (above + hist[b] >= *need)
            break;
        above += hist[b];
    }
    *need -= above;
    return b;
}

/* u32 of scratch kvt__topm_u32 needs (one histogram; independent of n today). */
size_t kvt__topm_scratch_u32(uint32_t n);

/* Exact top-m of keys[0..n): the indices of the m largest keys, ties to the lower index, written
 * to idx_out in ascending index order. m = 0 (or n = 0) writes nothing; m >= n writes 0..n−1.
 * idx_out holds min(m, n) entries; scratch holds kvt__topm_scratch_u32(n) entries. O(n). */
void kvt__topm_u32(const uint32_t *keys, uint32_t n, uint32_t m, uint32_t *idx_out,
                   uint32_t *scratch);

#endif /* KVT_KERNELS_TOPM_H */
