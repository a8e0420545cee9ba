/*
 * topm.c — CPU twin of the exact top-m select (algorithm in topm.h).
 */
#include "kernels/topm.h"

#include "lib/base/base.h"

#include <string.h>

size_t kvt__topm_scratch_u32(uint32_t n) {
    (void)n;
    return KVT__TOPM_MAX_BINS;
}

void kvt__topm_u32(const uint32_t *keys, uint32_t n, uint32_t m, uint32_t *idx_out,
                   uint32_t *scratch) {
    if (m == 0 || n == 0)
        return;
    if (m >= n) {
        for (uint32_t i = 0; i < n; i++)
            idx_out[i] = i;
        return;
    }
    /* Find T, the m-th largest key, one digit per level; need = how many of the keys that share
     * T's prefix so far are still to be taken. */
    uint32_t *hist = scratch;
    uint32_t need = m;
    uint32_t prefix = 0;
    for (uint32_t level = 0; level < KVT__TOPM_LEVELS; level++) {
        const uint32_t nbins = kvt__topm_bins(level);
        memset(hist, 0, nbins * sizeof *hist);
        for (uint32_t i = 0; i < n; i++)
            if (kvt__topm_in_prefix(keys[i], level, prefix))
                hist[kvt__topm_digit(keys[i], level)]++;
        const uint32_t b = kvt__topm_pick_bin(hist, nbins, &need);
        KVT_ASSERT(b < nbins && need >= 1 && need <= hist[b]);
        prefix |= b << kvt__topm_shift(level);
    }
    const uint32_t T = prefix;

    /* Emit in index order: keys above T all, keys equal to T the first `need` of them. */
    uint32_t out = 0;
    uint32_t eq_left = need;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t k = keys[i];
        if (k > T || (k == T && eq_left > 0)) {
            if (k == T)
                eq_left--;
            idx_out[out++] = i;
        }
    }
    KVT_ASSERT(out == m && eq_left == 0);
}
