/*
 * philox.c — CPU twin of the Philox draws (kernels/philox.h holds the per-element math that the
 * CUDA kernels share).
 */
#include "philox.h"

#include <float.h>

/* kvt__philox_uniform matches curand_uniform bit for bit only when float expressions are
 * evaluated in float (SSE, AArch64), not in x87 extended precision. */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "kvtier needs FLT_EVAL_METHOD == 0 (e.g. -mfpmath=sse on 32-bit x86) for bit-exact draws"
#endif

void kvt__philox_draws_cpu(uint64_t key, uint64_t subseq, const int64_t *positions, size_t n,
                           uint32_t *out) {
    uint32_t c[4], k[2], blk[4];
    uint64_t have = 0;
    int valid = 0;
    size_t i;

    c[2] = (uint32_t)subseq;
    c[3] = (uint32_t)(subseq >> 32);
    k[0] = (uint32_t)key;
    k[1] = (uint32_t)(key >> 32);
    for (i = 0; i < n; i++) {
        uint64_t pos = (uint64_t)positions[i];
        uint64_t b = pos >> 2;
        /* Same block as the previous draw (the common case: rows visited in order): reuse it.
         * Otherwise this is kvt__philox_draw_at with the key and subsequence words hoisted. */
        if (!valid || b != have) {
            c[0] = (uint32_t)b;
            c[1] = (uint32_t)(b >> 32);
            kvt__philox4x32_10(c, k, blk);
            have = b;
            valid = 1;
        }
        out[i] = blk[pos & 3u];
    }
}
