/*
 * philox.h — Philox4x32-10, the counter-based generator behind every random choice in kvtier,
 * written so that the CPU twin and the CUDA kernels produce the same bits as cuRAND's device API
 * (curand_init / curand / curand_uniform on a curandStatePhilox4_32_10_t).
 *
 * Read by gcc (C11) and by nvcc, so no C-only features (restrict, _Generic, compound literals).
 *
 * The generator (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
 * SC'11) is a keyed bijection on a 128-bit counter: ten rounds of two 32x32->64 multiplies
 * (constants 0xD2511F53, 0xCD9E8D57) with a Weyl key schedule (0x9E3779B9 = golden ratio,
 * 0xBB67AE85 = sqrt(3) - 1), each block of four 32-bit outputs coming from one counter value.
 * Nothing is sequential: draw n of a stream is one block evaluation, on any thread, in any order.
 *
 * How kvtier names a stream (the cuRAND facts this relies on are spelled out at
 * kvt__philox_init and kvt__philox_draw_at below):
 *
 *   key    = kvt__philox_key(cfg.seed, request)          64 bits -> the Philox key
 *   subseq = kvt__philox_subseq(round, layer, head)      64 bits -> upper half of the counter
 *   draw i = kvt__philox_draw_at(key, subseq, i)         == curand() after
 *                                                           curand_init(key, subseq, i, &st)
 *
 * so a CUDA kernel may call curand_init(key, subseq, i, &st); curand(&st) (or this header's
 * functions, which are the same bits) and the CPU twin loops over kvt__philox_draw_at.
 */
#ifndef KVT_KERNELS_PHILOX_H
#define KVT_KERNELS_PHILOX_H

#include <stddef.h>
#include <stdint.h>

#include "kvt_hd.h"

/* Philox4x32 round multipliers and key increments (Random123's PHILOX_M4x32_0/1 and
 * PHILOX_W32_0/1; cuRAND uses the same values in curand_philox4x32_x.h). */
#define KVT__PHILOX_M0 0xD2511F53u
#define KVT__PHILOX_M1 0xCD9E8D57u
#define KVT__PHILOX_W0 0x9E3779B9u
#define KVT__PHILOX_W1 0xBB67AE85u

/* 2^-32 as cuRAND spells it (CURAND_2POW32_INV in curand_globals.h). The decimal literal rounds
 * to exactly 2^-32 in binary32; test_philox checks that. */
#define KVT__PHILOX_2POW32_INV 2.3283064e-10f

/* Mirror of curandStatePhilox4_32_10_t without the Box-Muller fields (kvtier never draws normals:
 * curand_normal has no bit-exactness guarantee across compilers, so no decision may use it). */
typedef struct kvt__philox_state {
    uint32_t ctr[4]; /* counter: ctr[0..1] = block index in the subsequence, ctr[2..3] = subseq */
    uint32_t key[2]; /* key[0] = low 32 bits of the seed, key[1] = high 32 bits */
    uint32_t out[4]; /* the block for ctr, computed eagerly as cuRAND does */
    uint32_t lane;   /* next word of out to return, 0..3 (cuRAND's STATE) */
} kvt__philox_state;

/* One Philox round: (hi, lo) of two products, mixed with the other two words and the key. */
KVT_HD void kvt__philox_round(uint32_t c[4], uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
    uint32_t hi0 = __umulhi(KVT__PHILOX_M0, c[0]), lo0 = KVT__PHILOX_M0 * c[0];
    uint32_t hi1 = __umulhi(KVT__PHILOX_M1, c[2]), lo1 = KVT__PHILOX_M1 * c[2];
#else
    uint64_t p0 = (uint64_t)KVT__PHILOX_M0 * c[0];
    uint64_t p1 = (uint64_t)KVT__PHILOX_M1 * c[2];
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
#endif
    uint32_t n0 = hi1 ^ c[1] ^ k0;
    uint32_t n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
}

/* The raw block function: out = Philox4x32-10(counter, key). Word order as in Random123's
 * kat_vectors and cuRAND's uint4 (x, y, z, w) = [0], [1], [2], [3]. out may alias counter. */
KVT_HD void kvt__philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c[4];
    uint32_t k0 = key[0], k1 = key[1];
    int r;
    c[0] = counter[0];
    c[1] = counter[1];
    c[2] = counter[2];
    c[3] = counter[3];
    for (r = 0; r < 9; r++) {
        kvt__philox_round(c, k0, k1);
        k0 += KVT__PHILOX_W0; /* key schedule bumps between rounds, 9 times for 10 rounds */
        k1 += KVT__PHILOX_W1;
    }
    kvt__philox_round(c, k0, k1);
    out[0] = c[0];
    out[1] = c[1];
    out[2] = c[2];
    out[3] = c[3];
}

/*
 * curand_init(seed, subsequence, offset, &st) for Philox4_32_10, as curand_kernel.h writes it:
 *   - key = (low 32 bits of seed, high 32 bits of seed); no hashing of the seed;
 *   - counter = 0, then skipahead_sequence(subsequence) adds subsequence to the UPPER 64 bits
 *     of the 128-bit counter (ctr.z, ctr.w), so each subsequence spans 2^64 blocks = 2^66 draws;
 *   - skipahead(offset) counts 32-bit DRAWS, not blocks: lane = offset % 4 and the lower 64 bits
 *     of the counter (ctr.x, ctr.y) advance by offset / 4. (PyTorch's Philox offset counts
 *     128-bit blocks instead; the two must not be mixed.) Starting from a zero lower half,
 *     offset / 4 < 2^62 never carries into the subsequence half.
 *   - the block for the counter is computed at once (st.output); curand() returns its words in
 *     order x, y, z, w and moves to the next counter after the fourth.
 * Philox's curand_init is O(1) (no jump matrices), so one state per (stream, position) is cheap.
 */
KVT_HD void kvt__philox_init(uint64_t seed, uint64_t subsequence, uint64_t offset,
                             kvt__philox_state *s) {
    uint64_t block = offset >> 2;
    s->key[0] = (uint32_t)seed;
    s->key[1] = (uint32_t)(seed >> 32);
    s->ctr[0] = (uint32_t)block;
    s->ctr[1] = (uint32_t)(block >> 32);
    s->ctr[2] = (uint32_t)subsequence;
    s->ctr[3] = (uint32_t)(subsequence >> 32);
    s->lane = (uint32_t)(offset & 3u);
    kvt__philox4x32_10(s->ctr, s->key, s->out);
}

/* curand(&st): the next 32-bit draw. After the fourth word of a block the full 128-bit counter
 * is incremented with carry (cuRAND's Philox_State_Incr), then the next block is computed. */
KVT_HD uint32_t kvt__philox_next(kvt__philox_state *s) {
    uint32_t ret = s->out[s->lane];
    if (++s->lane == 4u) {
        s->lane = 0;
        if (++s->ctr[0] == 0u && ++s->ctr[1] == 0u && ++s->ctr[2] == 0u)
            ++s->ctr[3];
        kvt__philox4x32_10(s->ctr, s->key, s->out);
    }
    return ret;
}

/*
 * curand_uniform's mapping of a 32-bit draw x to a float in (0, 1]: x * 2^-32 + 2^-33, written
 * exactly as cuRAND does (x * CURAND_2POW32_INV + CURAND_2POW32_INV / 2.0f), in binary32:
 *   - (float)x rounds to nearest even (exact below 2^24); the product by 2^-32 is exact;
 *   - so nvcc's contraction into fmaf(x, 2^-32, 2^-33) rounds once, like the separate add here:
 *     the bits agree for every x (needs FLT_EVAL_METHOD == 0, checked in philox.c);
 *   - never 0 (x = 0 gives 2^-33), and exactly 1.0f for the 128 values x >= 2^32 - 128, whose
 *     float conversion rounds up to 2^32. So a decision "take it when u <= p" is certain at
 *     p = 1 and impossible at p = 0.
 */
KVT_HD float kvt__philox_uniform(uint32_t x) {
    return (float)x * KVT__PHILOX_2POW32_INV + (KVT__PHILOX_2POW32_INV / 2.0f);
}

/* Vigna's splitmix64 step as a stateless hash: the output of a splitmix64 generator whose state
 * was x (state += 0x9E3779B97F4A7C15, then the Stafford variant-13 finaliser). A bijection;
 * kvt__splitmix64(0) = 0xE220A8397B1DCDAF, the generator's published first output for seed 0. */
KVT_HD uint64_t kvt__splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Philox key of one request: splitmix64(seed ^ splitmix64(request)). Hashing the request first
 * keeps (seed, request) and (seed ^ d, request ^ d) from sharing a key; the outer hash spreads
 * nearby seeds over the whole key space (Philox itself takes the seed as the key unhashed). */
KVT_HD uint64_t kvt__philox_key(uint64_t seed, uint64_t request) {
    return kvt__splitmix64(seed ^ kvt__splitmix64(request));
}

/* Subsequence of one (round, layer, head): round in the high 32 bits, layer and head in 16 bits
 * each. Callers keep layer and head below 65536 (kvt_config/model checks); the masks only stop
 * an out-of-range value from spilling into the round bits. Distinct triples in range give
 * distinct subsequences, i.e. disjoint counter ranges: streams that cannot overlap. */
KVT_HD uint64_t kvt__philox_subseq(uint32_t round, uint32_t layer, uint32_t head) {
    return ((uint64_t)round << 32) | ((uint64_t)(layer & 0xFFFFu) << 16) |
           (uint64_t)(head & 0xFFFFu);
}

/*
 * Draw number `position` of stream (key, subseq) with one block evaluation: identical to
 *     curand_init(key, subseq, position, &st); return curand(&st);
 * because curand_init puts position / 4 in the low 64 bits of the counter, subseq in the high
 * 64 bits, computes that block, and the first curand() returns its word position % 4
 * (see kvt__philox_init). This is what lets every thread draw for its own row independently.
 */
KVT_HD uint32_t kvt__philox_draw_at(uint64_t key, uint64_t subseq, uint64_t position) {
    uint32_t c[4], k[2], o[4];
    uint64_t block = position >> 2;
    c[0] = (uint32_t)block;
    c[1] = (uint32_t)(block >> 32);
    c[2] = (uint32_t)subseq;
    c[3] = (uint32_t)(subseq >> 32);
    k[0] = (uint32_t)key;
    k[1] = (uint32_t)(key >> 32);
    kvt__philox4x32_10(c, k, o);
    return o[position & 3u];
}

#ifdef __cplusplus
extern "C" {
#endif

/* CPU twin: out[i] = kvt__philox_draw_at(key, subseq, positions[i]) for i < n. positions must be
 * >= 0 (they are draw indices); any order, repeats allowed; consecutive positions in one block of
 * four share one block evaluation. n = 0 writes nothing (positions/out may then be NULL). */
void kvt__philox_draws_cpu(uint64_t key, uint64_t subseq, const int64_t *positions, size_t n,
                           uint32_t *out);

#ifdef __cplusplus
}
#endif

#endif /* KVT_KERNELS_PHILOX_H */
