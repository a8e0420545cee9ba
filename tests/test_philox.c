/*
 * test_philox.c — kernels/philox.h: Philox4x32-10 bit for bit as cuRAND's device API.
 *
 *  1. Random123 known-answer vectors for the block function.
 *  2. cuRAND's device API (curand_kernel.h compiled for the host, tests/support/curand_oracle.cu):
 *     curand_init / curand / curand_uniform over many (seed, subsequence, offset) triples.
 *  3. cuRAND's host generator (Philox, default ordering) and its element -> (subsequence, draw)
 *     layout: element 4 (r 65536 + t) + j is draw 4 r + j of subsequence t.
 *  4. draw_at == init + next, the key/subsequence mapping, distinct streams, the uniform map.
 *
 * Groups 2 and 3 need the CUDA toolkit at build time (KVT_HAVE_CURAND=1), not a GPU. Without it
 * they skip with a message, except under KVT_REQUIRE_CURAND=1 (CI where libcurand exists), where
 * they fail: a build that silently lost its oracle must not pass.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/philox.h"
#include "support/testutil.h"

#if KVT_HAVE_CURAND
#include "support/curand_oracle.h"
#endif

/* ---------------------------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------------------------- */

/* Called first by every test that needs the cuRAND oracle when it was not built in. */
#if !KVT_HAVE_CURAND
static void curand_absent(void) {
    const char *req = getenv("KVT_REQUIRE_CURAND");
    if (req && strcmp(req, "1") == 0)
        cr_assert_fail("KVT_REQUIRE_CURAND=1 but test_philox was built without the cuRAND oracle "
                       "(CUDA toolkit headers/libcurand not found when CMake configured)");
    cr_skip_test("built without the cuRAND oracle (no CUDA toolkit at configure time)");
}
#endif

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static uint64_t ctr_lo64(const uint32_t c[4]) {
    return (uint64_t)c[1] << 32 | c[0];
}

static uint64_t ctr_hi64(const uint32_t c[4]) {
    return (uint64_t)c[3] << 32 | c[2];
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

#if KVT_HAVE_CURAND
/* (seed, subsequence, offset) corners: word boundaries of both 64-bit halves, offsets in every
 * lane, offsets whose block count needs both counter words, the largest offset curand_init
 * accepts. */
static const uint64_t k_seeds[] = {
    0u, 1u, 0xFFFFFFFFu, 0x100000000ull, 0x243F6A8885A308D3ull, 0xFFFFFFFFFFFFFFFFull};
static const uint64_t k_subseqs[] = {0u,
                                     1u,
                                     3u,
                                     65535u,
                                     0xFFFFFFFFu,
                                     1ull << 32,
                                     1ull << 40,
                                     (1ull << 63) + 5u,
                                     0xFFFFFFFFFFFFFFFFull};
static const uint64_t k_offsets[] = {0u,
                                     1u,
                                     2u,
                                     3u,
                                     4u,
                                     5u,
                                     6u,
                                     7u,
                                     1023u,
                                     1024u,
                                     1025u,
                                     (1ull << 32) + 3u,
                                     (1ull << 34) - 1u,
                                     (1ull << 40) + 2u,
                                     (1ull << 62) + 1u,
                                     0xFFFFFFFFFFFFFFF0ull,
                                     0xFFFFFFFFFFFFFFFFull};
#define N_ARR(a) (sizeof(a) / sizeof((a)[0]))
#define RUN_DRAWS 41 /* consecutive draws per triple: >= 10 block boundaries from any lane */
#define RANDOM_TRIPLES 3000
#define RANDOM_RUN 17
#endif

/* ---------------------------------------------------------------------------------------------
 * 1. Random123 known answers
 *
 * philox4x32 R=10 lines (CTR[4] KEY[2] -> EXPECTED[4], hex words in array order) of Random123's
 * kat_vectors: the first three are the gen(0,0), gen(fff,fff), gen(pi digits) triple of the
 * current tests/kat_vectors; the other 52 come from the longer examples/kat_vectors of an
 * earlier release (as kept in github.com/girving/random123-manual), which walks single bits of
 * the counter with four keys. Numbers only, copied verbatim.
 * ------------------------------------------------------------------------------------------- */
typedef struct kat {
    uint32_t ctr[4], key[2], out[4];
} kat;

/* clang-format off */
static const kat k_kat[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}, {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    {{0x00000001, 0x00000000, 0x00000000, 0x00000000}, {0x00000001, 0x00000000}, {0xac08141b, 0xdfc5ccbe, 0x79c07a47, 0xa7f66093}},
    {{0x00000000, 0x00000001, 0x00000000, 0x00000000}, {0x00000001, 0x00000000}, {0x833ff8dc, 0x225c963c, 0x232b88b3, 0x0b334b07}},
    {{0x00000000, 0x00000000, 0x00000001, 0x00000000}, {0x00000001, 0x00000000}, {0x07071c12, 0x428264b6, 0x3909104b, 0x6da2bda2}},
    {{0x00000000, 0x00000000, 0x00000000, 0x00000001}, {0x00000001, 0x00000000}, {0x127bee41, 0x1e047488, 0x48842b20, 0x0a393496}},
    {{0x00000000, 0xffffffff, 0x00000000, 0x00000000}, {0x00000001, 0x00000000}, {0x04e2eae1, 0x463cc999, 0xe7786310, 0x65b3dc49}},
    {{0x00000000, 0x80000000, 0x00000000, 0x00000000}, {0x00000001, 0x00000000}, {0x34a4d61d, 0x340e4017, 0xf6945830, 0xe9f52b96}},
    {{0x00000000, 0x00000000, 0xffffffff, 0x00000000}, {0x00000001, 0x00000000}, {0xfb0905e2, 0x78378790, 0xca37926b, 0xcdf58cfa}},
    {{0x00000000, 0x00000000, 0x80000000, 0x00000000}, {0x00000001, 0x00000000}, {0xf2e15c7d, 0x3fedcd99, 0x90046f6c, 0x6657f0ca}},
    {{0x00000000, 0x00000000, 0x00000000, 0xffffffff}, {0x00000001, 0x00000000}, {0xf50c9398, 0xb36cdab2, 0x436bdc89, 0xcc49431b}},
    {{0x00000000, 0x00000000, 0x00000000, 0x80000000}, {0x00000001, 0x00000000}, {0xdde26e4e, 0x17666f3b, 0xfc1f5b3a, 0x83ac805d}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0x00000001, 0x00000000}, {0x38527b8f, 0xfad9a48c, 0x20e675c0, 0xf2fea26a}},
    {{0xa4093822, 0x299f31d0, 0x082efa98, 0xec4e6c89}, {0x00000001, 0x00000000}, {0xfb9877f8, 0x482895e2, 0x60b01453, 0x198ea67b}},
    {{0x452821e6, 0x38d01377, 0xbe5466cf, 0x34e90c6c}, {0x00000001, 0x00000000}, {0xf7b7fa0a, 0x8d970e2c, 0x205c9c76, 0x83b16ce5}},
    {{0x00000001, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000001}, {0xccf3076a, 0x6306f434, 0xbea71965, 0xd96fe48a}},
    {{0x00000000, 0x00000001, 0x00000000, 0x00000000}, {0x00000000, 0x00000001}, {0x532f1322, 0x36c890fb, 0x6504b937, 0x07bbfef7}},
    {{0x00000000, 0x00000000, 0x00000001, 0x00000000}, {0x00000000, 0x00000001}, {0x7f6c13ff, 0x114b2447, 0x0550eced, 0xea1fc805}},
    {{0x00000000, 0x00000000, 0x00000000, 0x00000001}, {0x00000000, 0x00000001}, {0x96b27e8c, 0x28826d0f, 0x66d958ef, 0x081509dc}},
    {{0x00000000, 0xffffffff, 0x00000000, 0x00000000}, {0x00000000, 0x00000001}, {0x00e94a67, 0x3524f44e, 0x22995230, 0xbb54df1e}},
    {{0x00000000, 0x80000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000001}, {0xce1afc4e, 0x4fbf97a1, 0x6110bee9, 0xa559be2f}},
    {{0x00000000, 0x00000000, 0xffffffff, 0x00000000}, {0x00000000, 0x00000001}, {0x576241af, 0xd3b45bee, 0x619bd94d, 0x15dd8793}},
    {{0x00000000, 0x00000000, 0x80000000, 0x00000000}, {0x00000000, 0x00000001}, {0xd9da65af, 0xeced57ba, 0xc34d2661, 0x91fe931f}},
    {{0x00000000, 0x00000000, 0x00000000, 0xffffffff}, {0x00000000, 0x00000001}, {0x36241728, 0x4d42c858, 0xfea737d6, 0x49f40347}},
    {{0x00000000, 0x00000000, 0x00000000, 0x80000000}, {0x00000000, 0x00000001}, {0x0436a39b, 0x31be9efa, 0x6abd0c76, 0xe7a68f83}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0x00000000, 0x00000001}, {0x126514c3, 0xd1898b69, 0xda2707b3, 0x6e6fb436}},
    {{0xa4093822, 0x299f31d0, 0x082efa98, 0xec4e6c89}, {0x00000000, 0x00000001}, {0x1c28fa3f, 0x8c5bf977, 0xbb989783, 0x0c1a3737}},
    {{0x452821e6, 0x38d01377, 0xbe5466cf, 0x34e90c6c}, {0x00000000, 0x00000001}, {0xac87a8c1, 0xf240abdb, 0xadd6c012, 0x68a32a78}},
    {{0x00000001, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0xffffffff}, {0x473ab778, 0x330bacc0, 0xacd5fc9a, 0x5ede76b3}},
    {{0x00000000, 0x00000001, 0x00000000, 0x00000000}, {0x00000000, 0xffffffff}, {0xcdfbd51c, 0xcaae5f2e, 0x10739cfc, 0x79e95162}},
    {{0x00000000, 0x00000000, 0x00000001, 0x00000000}, {0x00000000, 0xffffffff}, {0x6c4b0e80, 0x357e5a94, 0x3255445d, 0x6f433f0b}},
    {{0x00000000, 0x00000000, 0x00000000, 0x00000001}, {0x00000000, 0xffffffff}, {0x5c4ecd0c, 0x64c12cf9, 0x8f9fb4c8, 0x40c4a01f}},
    {{0x00000000, 0xffffffff, 0x00000000, 0x00000000}, {0x00000000, 0xffffffff}, {0x5f9c47aa, 0x19861d86, 0xff2be81d, 0x4c7db17e}},
    {{0x00000000, 0x80000000, 0x00000000, 0x00000000}, {0x00000000, 0xffffffff}, {0x715a87cf, 0xf966a7f0, 0x3e6dd95f, 0xe884e2fd}},
    {{0x00000000, 0x00000000, 0xffffffff, 0x00000000}, {0x00000000, 0xffffffff}, {0x07678411, 0x9e524307, 0xba634e67, 0x94ee8cb7}},
    {{0x00000000, 0x00000000, 0x80000000, 0x00000000}, {0x00000000, 0xffffffff}, {0xb6f48e28, 0xf2fa9414, 0x00b64f66, 0x4810cdb4}},
    {{0x00000000, 0x00000000, 0x00000000, 0xffffffff}, {0x00000000, 0xffffffff}, {0x9f18bb20, 0x62161056, 0x7ea8c028, 0x4c01fc6e}},
    {{0x00000000, 0x00000000, 0x00000000, 0x80000000}, {0x00000000, 0xffffffff}, {0x2a460458, 0x0a2709e5, 0x47bc9115, 0x0f96d8af}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0x00000000, 0xffffffff}, {0x08f7720c, 0x845ee9e0, 0x502ccd3d, 0xa9a00e27}},
    {{0xa4093822, 0x299f31d0, 0x082efa98, 0xec4e6c89}, {0x00000000, 0xffffffff}, {0x9fcce05d, 0x837d3f3c, 0x5cdf3e61, 0xdb2544c0}},
    {{0x452821e6, 0x38d01377, 0xbe5466cf, 0x34e90c6c}, {0x00000000, 0xffffffff}, {0x72ce44b3, 0xb44f9b78, 0x49af0267, 0x726813ac}},
    {{0x00000001, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x80000000}, {0xe29b9f84, 0x2903d316, 0x42a1f56f, 0x1ad02eab}},
    {{0x00000000, 0x00000001, 0x00000000, 0x00000000}, {0x00000000, 0x80000000}, {0x94f419f8, 0x1116c316, 0x99f2fa30, 0xbc048ad6}},
    {{0x00000000, 0x00000000, 0x00000001, 0x00000000}, {0x00000000, 0x80000000}, {0x488b0258, 0x9eea6420, 0xafe7062e, 0x768f5637}},
    {{0x00000000, 0x00000000, 0x00000000, 0x00000001}, {0x00000000, 0x80000000}, {0xdbec6d70, 0x69cea528, 0xf7e22262, 0x2e9f3e8f}},
    {{0x00000000, 0xffffffff, 0x00000000, 0x00000000}, {0x00000000, 0x80000000}, {0x905ee550, 0xc7520e9a, 0x9af9d0ad, 0x69b97e98}},
    {{0x00000000, 0x80000000, 0x00000000, 0x00000000}, {0x00000000, 0x80000000}, {0x1b89d963, 0x0defe9af, 0x60c9d3fb, 0x3cfae97d}},
    {{0x00000000, 0x00000000, 0xffffffff, 0x00000000}, {0x00000000, 0x80000000}, {0x601b5460, 0xfe29678b, 0x54510a02, 0xc72ed094}},
    {{0x00000000, 0x00000000, 0x80000000, 0x00000000}, {0x00000000, 0x80000000}, {0xae56ca02, 0x7609ba67, 0x25abd7df, 0x46ce39a3}},
    {{0x00000000, 0x00000000, 0x00000000, 0xffffffff}, {0x00000000, 0x80000000}, {0x09812238, 0x47b8470d, 0x3e0d0a26, 0x92d96c9a}},
    {{0x00000000, 0x00000000, 0x00000000, 0x80000000}, {0x00000000, 0x80000000}, {0xf7a0b371, 0xe51dc93d, 0x56ce135d, 0x1d4b5580}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0x00000000, 0x80000000}, {0x63675d2c, 0x422d7c4d, 0x3145d30d, 0x3bce33a4}},
    {{0xa4093822, 0x299f31d0, 0x082efa98, 0xec4e6c89}, {0x00000000, 0x80000000}, {0xaa74e81c, 0xc9ddb97b, 0x2c2cd881, 0x9390c78d}},
    {{0x452821e6, 0x38d01377, 0xbe5466cf, 0x34e90c6c}, {0x00000000, 0x80000000}, {0x94ca5566, 0x14924b2f, 0x28214292, 0x59faeaee}},
};
/* clang-format on */
#define N_KAT (sizeof(k_kat) / sizeof(k_kat[0]))

Test(philox_kat, block_function) {
    cr_assert_eq(N_KAT, 55);
    for (size_t i = 0; i < N_KAT; i++) {
        const kat *v = &k_kat[i];
        uint32_t out[4];
        kvt__philox4x32_10(v->ctr, v->key, out);
        for (int j = 0; j < 4; j++)
            cr_assert_eq(out[j], v->out[j], "kat %zu word %d: %08x, expected %08x", i, j, out[j],
                         v->out[j]);
        /* out may alias counter */
        uint32_t c[4];
        memcpy(c, v->ctr, sizeof c);
        kvt__philox4x32_10(c, v->key, c);
        cr_assert_eq(memcmp(c, v->out, sizeof c), 0, "kat %zu in place", i);
    }
}

/* The same vectors reached through curand_init's mapping, where the counter is reachable:
 * seed = key, subsequence = counter high 64 bits, offset = 4 x counter low 64 bits (< 2^64). */
Test(philox_kat, through_init_and_draw_at) {
    int reached = 0;
    for (size_t i = 0; i < N_KAT; i++) {
        const kat *v = &k_kat[i];
        uint64_t lo = ctr_lo64(v->ctr), hi = ctr_hi64(v->ctr);
        uint64_t key = (uint64_t)v->key[1] << 32 | v->key[0];
        if (lo >= (1ull << 62))
            continue;
        reached++;
        kvt__philox_state s;
        kvt__philox_init(key, hi, 4 * lo, &s);
        for (int j = 0; j < 4; j++) {
            cr_assert_eq(kvt__philox_next(&s), v->out[j], "kat %zu lane %d via init/next", i, j);
            cr_assert_eq(kvt__philox_draw_at(key, hi, 4 * lo + (uint64_t)j), v->out[j],
                         "kat %zu lane %d via draw_at", i, j);
        }
    }
    cr_assert_eq(reached, 41, "reachable vectors: %d", reached);
}

/* The 128-bit counter increment carries through all four words, as cuRAND's Philox_State_Incr:
 * the draw after block (ffffffff, ffffffff, ffffffff, 0) comes from block (0, 0, 0, 1). */
Test(philox_kat, counter_carry) {
    kvt__philox_state s;
    kvt__philox_init(7, 0, 0, &s);
    s.ctr[0] = s.ctr[1] = s.ctr[2] = 0xFFFFFFFFu;
    s.ctr[3] = 0;
    kvt__philox4x32_10(s.ctr, s.key, s.out);
    uint32_t expect[4], next_ctr[4] = {0, 0, 0, 1};
    kvt__philox4x32_10(next_ctr, s.key, expect);
    for (int j = 0; j < 4; j++)
        (void)kvt__philox_next(&s);
    cr_assert_eq(s.ctr[0] | s.ctr[1] | s.ctr[2], 0u);
    cr_assert_eq(s.ctr[3], 1u);
    for (int j = 0; j < 4; j++)
        cr_assert_eq(kvt__philox_next(&s), expect[j]);
}

/* ---------------------------------------------------------------------------------------------
 * 2. cuRAND device API, compiled for the host
 * ------------------------------------------------------------------------------------------- */
Test(philox_curand, device_api_corners) {
#if KVT_HAVE_CURAND
    size_t triples = 0, draws = 0;
    for (size_t a = 0; a < N_ARR(k_seeds); a++)
        for (size_t b = 0; b < N_ARR(k_subseqs); b++)
            for (size_t c = 0; c < N_ARR(k_offsets); c++) {
                uint64_t seed = k_seeds[a], sub = k_subseqs[b], off = k_offsets[c];
                uint32_t ref[RUN_DRAWS];
                float refu[RUN_DRAWS];
                cr_assert_eq(oracle_curand(seed, sub, off, RUN_DRAWS, ref), 0);
                cr_assert_eq(oracle_curand_uniform(seed, sub, off, RUN_DRAWS, refu), 0);
                kvt__philox_state s;
                kvt__philox_init(seed, sub, off, &s);
                for (int d = 0; d < RUN_DRAWS; d++) {
                    uint32_t x = kvt__philox_next(&s);
                    cr_assert_eq(x, ref[d],
                                 "seed %#llx subseq %#llx offset %#llx draw %d: %08x, curand %08x",
                                 (unsigned long long)seed, (unsigned long long)sub,
                                 (unsigned long long)off, d, x, ref[d]);
                    cr_assert_eq(f32_bits(kvt__philox_uniform(x)), f32_bits(refu[d]),
                                 "uniform: seed %#llx subseq %#llx offset %#llx draw %d",
                                 (unsigned long long)seed, (unsigned long long)sub,
                                 (unsigned long long)off, d);
                    /* draw_at names the same draw while offset + d does not wrap 2^64 */
                    if (off + (uint64_t)d >= off)
                        cr_assert_eq(kvt__philox_draw_at(seed, sub, off + (uint64_t)d), ref[d],
                                     "draw_at: seed %#llx subseq %#llx offset %#llx draw %d",
                                     (unsigned long long)seed, (unsigned long long)sub,
                                     (unsigned long long)off, d);
                    draws++;
                }
                triples++;
            }
    cr_assert_eq(triples, 6u * 9u * 17u);
    cr_log_info("device API corners: %zu triples, %zu draws", triples, draws);
#else
    curand_absent();
#endif
}

Test(philox_curand, device_api_random) {
#if KVT_HAVE_CURAND
    tu_rng r = {0x5EEDC0DE12345ull};
    for (int i = 0; i < RANDOM_TRIPLES; i++) {
        uint64_t seed = tu_next(&r), sub = tu_next(&r), off = tu_next(&r);
        /* mix in small subsequences and offsets, the ones kvtier actually uses */
        if (i % 3 == 1)
            sub >>= 32;
        if (i % 4 == 2)
            off >>= 40;
        uint32_t ref[RANDOM_RUN];
        cr_assert_eq(oracle_curand(seed, sub, off, RANDOM_RUN, ref), 0);
        kvt__philox_state s;
        kvt__philox_init(seed, sub, off, &s);
        for (int d = 0; d < RANDOM_RUN; d++)
            cr_assert_eq(kvt__philox_next(&s), ref[d],
                         "rng seed 0x5EEDC0DE12345 triple %d (seed %#llx subseq %#llx offset "
                         "%#llx) draw %d",
                         i, (unsigned long long)seed, (unsigned long long)sub,
                         (unsigned long long)off, d);
    }
#else
    curand_absent();
#endif
}

/* curand_uniform's mapping x -> x 2^-32 + 2^-33 against cuRAND's own _curand_uniform: every
 * x < 2^24 (where (float)x is exact and the + 2^-33 can round, ties included), every x within
 * 4096 of 2^k for k = 24..32, and every 251st x in between. */
Test(philox_curand, uniform_mapping) {
#if KVT_HAVE_CURAND
    cr_assert_eq(f32_bits(oracle_2pow32_inv()), f32_bits(ldexpf(1.0f, -32)));
    uint64_t checked = 0;
    for (uint64_t x = 0; x < (1ull << 24); x++, checked++)
        cr_assert_eq(f32_bits(kvt__philox_uniform((uint32_t)x)),
                     f32_bits(oracle_uniform((uint32_t)x)), "x = %#llx", (unsigned long long)x);
    for (int k = 24; k <= 32; k++)
        for (int64_t d = -4096; d < 4096; d++) {
            int64_t x = ((int64_t)1 << k) + d;
            if (x < 0 || x > (int64_t)0xFFFFFFFF)
                continue;
            checked++;
            cr_assert_eq(f32_bits(kvt__philox_uniform((uint32_t)x)),
                         f32_bits(oracle_uniform((uint32_t)x)), "x = %#llx", (long long)x);
        }
    for (uint64_t x = 1ull << 24; x <= 0xFFFFFFFFull; x += 251, checked++)
        cr_assert_eq(f32_bits(kvt__philox_uniform((uint32_t)x)),
                     f32_bits(oracle_uniform((uint32_t)x)), "x = %#llx", (unsigned long long)x);
    cr_log_info("uniform mapping: %llu values of x", (unsigned long long)checked);
#else
    curand_absent();
#endif
}

/* ---------------------------------------------------------------------------------------------
 * 3. cuRAND host generator (runs on the CPU; no device needed)
 * ------------------------------------------------------------------------------------------- */

#if KVT_HAVE_CURAND
/* Element i of the host generator's default ordering: draw 4 r + j of subsequence t, where
 * i = 4 (r 65536 + t) + j. */
static uint32_t host_element(uint64_t seed, uint64_t i) {
    uint64_t j = i & 3u, q = i >> 2, t = q % 65536u, r = q / 65536u;
    return kvt__philox_draw_at(seed, t, 4 * r + j);
}
#endif

Test(philox_curand, host_generator_layout) {
#if KVT_HAVE_CURAND
    static const uint64_t seeds[] = {0u, 12345u, 0xFFFFFFFFFFFFFFFFull, 0x9C3B1A22D5E0F417ull};
    /* two full rounds of 65536 subsequences, then a partial third that stops mid-block */
    const size_t n = 4u * 65536u * 2u + 4u * 3u + 2u;
    uint32_t *out = malloc(n * sizeof *out);
    cr_assert_not_null(out);
    for (size_t s = 0; s < N_ARR(seeds); s++) {
        /* one call, and the same n in two calls split mid-block: the second continues */
        for (int split = 0; split < 2; split++) {
            size_t n_first = split ? 4u * 65536u + 6u : n;
            memset(out, 0, n * sizeof *out);
            cr_assert_eq(oracle_host_generate(seeds[s], 0, n_first, n, out), 0,
                         "curandCreateGeneratorHost/Generate failed");
            for (size_t i = 0; i < n; i++)
                cr_assert_eq(out[i], host_element(seeds[s], i), "seed %#llx element %zu (split %d)",
                             (unsigned long long)seeds[s], i, split);
        }
    }
    /* curandSetGeneratorOffset(o) shifts by o elements of the same layout */
    static const uint64_t offsets[] = {1u, 7u, 4u * 65536u - 3u, 4u * 65536u * 5u + 9u};
    const size_t m = 4u * 65536u + 11u;
    for (size_t k = 0; k < N_ARR(offsets); k++) {
        cr_assert_eq(oracle_host_generate(12345u, offsets[k], m, m, out), 0);
        for (size_t i = 0; i < m; i++)
            cr_assert_eq(out[i], host_element(12345u, offsets[k] + i), "offset %llu element %zu",
                         (unsigned long long)offsets[k], i);
    }
    free(out);
#else
    curand_absent();
#endif
}

Test(philox_curand, host_generator_uniform) {
#if KVT_HAVE_CURAND
    const size_t n = 4u * 65536u + 4u * 5u + 3u;
    float *out = malloc(n * sizeof *out);
    cr_assert_not_null(out);
    cr_assert_eq(oracle_host_generate_uniform(777u, 0, n, out), 0);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(f32_bits(out[i]), f32_bits(kvt__philox_uniform(host_element(777u, i))),
                     "element %zu", i);
    free(out);
#else
    curand_absent();
#endif
}

/* ---------------------------------------------------------------------------------------------
 * 4. kvtier's own mapping
 * ------------------------------------------------------------------------------------------- */
Test(philox, draw_at_is_init_then_next) {
    tu_rng r = {0xD1A7A7ull};
    for (int i = 0; i < 5000; i++) {
        uint64_t key = tu_next(&r), sub = tu_next(&r) >> (i % 64), pos = tu_next(&r) >> (i % 61);
        kvt__philox_state s;
        kvt__philox_init(key, sub, pos, &s);
        for (uint64_t d = 0; d < 9 && pos + d >= pos; d++) {
            uint32_t x = kvt__philox_next(&s);
            cr_assert_eq(kvt__philox_draw_at(key, sub, pos + d), x,
                         "rng seed 0xD1A7A7 case %d draw %llu", i, (unsigned long long)d);
        }
    }
}

Test(philox, draws_cpu_twin) {
    tu_rng r = {0xC0FFEEull};
    enum { N = 4099 };
    int64_t *pos = malloc(N * sizeof *pos);
    uint32_t *out = malloc(N * sizeof *out);
    cr_assert(pos && out);
    const uint64_t key = kvt__philox_key(42, 7), sub = kvt__philox_subseq(3, 17, 5);
    /* in order (block reuse), reversed, repeated, random and huge positions */
    for (int i = 0; i < N; i++) {
        switch (i % 5) {
        case 0:
            pos[i] = i;
            break;
        case 1:
            pos[i] = N - i;
            break;
        case 2:
            pos[i] = pos[i - 1];
            break;
        case 3:
            pos[i] = (int64_t)(tu_next(&r) >> 1);
            break;
        default:
            pos[i] = INT64_MAX - (i % 7);
            break;
        }
    }
    kvt__philox_draws_cpu(key, sub, pos, N, out);
    for (int i = 0; i < N; i++)
        cr_assert_eq(out[i], kvt__philox_draw_at(key, sub, (uint64_t)pos[i]), "i = %d", i);
    for (int i = 0; i < N; i++)
        pos[i] = i;
    kvt__philox_draws_cpu(key, sub, pos, N, out);
    kvt__philox_state s;
    kvt__philox_init(key, sub, 0, &s);
    for (int i = 0; i < N; i++)
        cr_assert_eq(out[i], kvt__philox_next(&s), "consecutive i = %d", i);
    kvt__philox_draws_cpu(key, sub, NULL, 0, NULL); /* n = 0 touches nothing */
    free(pos);
    free(out);
}

Test(philox, splitmix64_reference) {
    /* Vigna's splitmix64 seeded with 0: its first four outputs are the hash of 0, g, 2g, 3g */
    const uint64_t g = 0x9E3779B97F4A7C15ull;
    cr_assert_eq(kvt__splitmix64(0), 0xE220A8397B1DCDAFull);
    cr_assert_eq(kvt__splitmix64(g), 0x6E789E6AA1B965F4ull);
    cr_assert_eq(kvt__splitmix64(2 * g), 0x06C45D188009454Full);
    cr_assert_eq(kvt__splitmix64(3 * g), 0xF88BB8A8724C81ECull);
    /* and tests/support's splitmix64 generator agrees */
    tu_rng r = {123456789u};
    for (uint64_t i = 1; i <= 100; i++)
        cr_assert_eq(kvt__splitmix64(123456789u + (i - 1) * g), tu_next(&r));
}

Test(philox, key_and_subseq_mapping) {
    tu_rng r = {0xBEEFull};
    for (int i = 0; i < 1000; i++) {
        uint64_t seed = tu_next(&r), req = tu_next(&r) >> (i % 64);
        cr_assert_eq(kvt__philox_key(seed, req), kvt__splitmix64(seed ^ kvt__splitmix64(req)));
    }
    cr_assert_eq(kvt__philox_key(0, 0), kvt__splitmix64(0xE220A8397B1DCDAFull));
    /* distinct requests of one seed get distinct keys (a bijection; checked on 65536) */
    enum { NR = 65536 };
    uint64_t *keys = malloc(NR * sizeof *keys);
    cr_assert_not_null(keys);
    for (uint64_t q = 0; q < NR; q++)
        keys[q] = kvt__philox_key(2024u, q);
    qsort(keys, NR, sizeof *keys, cmp_u64);
    for (int i = 1; i < NR; i++)
        cr_assert_neq(keys[i], keys[i - 1]);
    free(keys);

    cr_assert_eq(kvt__philox_subseq(0, 0, 0), 0u);
    cr_assert_eq(kvt__philox_subseq(1, 2, 3), 0x0000000100020003ull);
    cr_assert_eq(kvt__philox_subseq(0xFFFFFFFFu, 0xFFFFu, 0xFFFFu), 0xFFFFFFFFFFFFFFFFull);
    cr_assert_eq(kvt__philox_subseq(5, 0, 0xFFFFu), 0x000000050000FFFFull);
    cr_assert_eq(kvt__philox_subseq(5, 0xFFFFu, 0), 0x00000005FFFF0000ull);
    /* out of range layer/head never reach the round bits */
    cr_assert_eq(kvt__philox_subseq(9, 0x12345u, 0x1FFFFu) >> 32, 9u);
    /* the subsequence is the upper counter half: same as curand_init(key, subseq, pos) */
    kvt__philox_state s;
    kvt__philox_init(77u, kvt__philox_subseq(4, 3, 2), 10, &s);
    cr_assert_eq(s.ctr[3], 4u);
    cr_assert_eq(s.ctr[2], (3u << 16) | 2u);
    cr_assert_eq(s.ctr[0], 2u);
    cr_assert_eq(s.ctr[1], 0u);
    cr_assert_eq(s.lane, 2u);
}

/* Different (round, layer, head) give different streams: every triple's first 8 draws differ
 * from every other triple's. */
Test(philox, distinct_streams) {
    enum { R = 8, L = 16, H = 8, N = R * L * H };
    uint64_t *sig = malloc(N * 4 * sizeof *sig);
    uint64_t *subs = malloc(N * sizeof *subs);
    cr_assert(sig && subs);
    const uint64_t key = kvt__philox_key(0x5EEDull, 3);
    int n = 0;
    for (uint32_t rd = 0; rd < R; rd++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++, n++) {
                uint64_t sub = kvt__philox_subseq(rd, l, h);
                subs[n] = sub;
                /* 4 x 64-bit words = draws 0..7 */
                for (int w = 0; w < 4; w++)
                    sig[4 * n + w] = (uint64_t)kvt__philox_draw_at(key, sub, 2u * w) << 32 |
                                     kvt__philox_draw_at(key, sub, 2u * w + 1u);
            }
    qsort(subs, N, sizeof *subs, cmp_u64);
    for (int i = 1; i < N; i++)
        cr_assert_neq(subs[i], subs[i - 1]);
    /* draws: every 64-bit pair of every stream distinct (collision odds ~ 2^-40 here) */
    qsort(sig, 4 * N, sizeof *sig, cmp_u64);
    for (int i = 1; i < 4 * N; i++)
        cr_assert_neq(sig[i], sig[i - 1], "two streams share draws");
    /* and another request's key changes every stream */
    cr_assert_neq(
        kvt__philox_draw_at(kvt__philox_key(0x5EEDull, 4), kvt__philox_subseq(0, 0, 0), 0),
        kvt__philox_draw_at(key, kvt__philox_subseq(0, 0, 0), 0));
    free(sig);
    free(subs);
}

/* curand_uniform's formula, without cuRAND: (0, 1], exact at the ends, the correctly rounded
 * x 2^-32 + 2^-33 where (float)x is exact, and monotone. */
Test(philox, uniform_formula) {
    const float two_m32 = ldexpf(1.0f, -32), two_m33 = ldexpf(1.0f, -33);
    cr_assert_eq(f32_bits(KVT__PHILOX_2POW32_INV), f32_bits(two_m32));
    cr_assert_eq(f32_bits(kvt__philox_uniform(0)), f32_bits(two_m33), "u(0) = 2^-33, never 0");
    cr_assert_eq(kvt__philox_uniform(0xFFFFFFFFu), 1.0f, "u(2^32 - 1) = 1.0f exactly");
    /* exactly the top 128 values map to 1.0f: (float)x rounds to 2^32 from 2^32 - 128 up */
    int ones = 0;
    for (uint32_t x = 0xFFFFF000u;; x++) {
        ones += kvt__philox_uniform(x) == 1.0f;
        if (x == 0xFFFFFFFFu)
            break;
    }
    cr_assert_eq(ones, 128);
    cr_assert_lt(kvt__philox_uniform(0xFFFFFF7Fu), 1.0f);
    cr_assert_eq(kvt__philox_uniform(0xFFFFFF80u), 1.0f);
    /* x < 2^24: x 2^-32 + 2^-33 is exact in double; one rounding to float must give our bits */
    float prev = 0.0f;
    for (uint32_t x = 0; x < (1u << 24); x++) {
        double exact = (double)x * 0x1p-32 + 0x1p-33;
        float u = kvt__philox_uniform(x);
        cr_assert_eq(f32_bits(u), f32_bits((float)exact), "x = %#x", x);
        /* nvcc contracts the expression into one fma (fma.rn.f32 x, 2^-32, 2^-33): same bits */
        cr_assert_eq(f32_bits(u), f32_bits(fmaf((float)x, two_m32, two_m33)), "fma x = %#x", x);
        cr_assert_geq(u, prev);
        prev = u;
    }
    /* random x: the float expression evaluated step by step, no contraction possible */
    tu_rng r = {0xF10A7ull};
    for (int i = 0; i < 200000; i++) {
        uint32_t x = (uint32_t)tu_next(&r);
        volatile float fx = (float)x;
        volatile float prod = fx * two_m32;
        volatile float sum = prod + two_m33;
        float u = kvt__philox_uniform(x);
        cr_assert_eq(f32_bits(u), f32_bits(sum), "rng seed 0xF10A7 x = %#x", x);
        cr_assert_eq(f32_bits(u), f32_bits(fmaf(fx, two_m32, two_m33)), "fma x = %#x", x);
        cr_assert(u > 0.0f && u <= 1.0f);
    }
}
