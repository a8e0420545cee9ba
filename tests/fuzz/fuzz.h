/* fuzz.h — shared by the libFuzzer targets of tests/fuzz/ (and their plain replay driver).
 *
 * A target defines LLVMFuzzerTestOneInput. Built with -DKVT_FUZZ=ON (clang), libFuzzer drives
 * it; in every other build tests/fuzz/replay.c gives it a main() that feeds it the seed corpus
 * and the regression inputs (tests/fuzz/corpus/<target>/, tests/fuzz/regress/<target>/), so a
 * crash found once stays fixed in the plain ctest run. A finding is an abort: FUZZ_REQUIRE
 * prints what failed and aborts, which libFuzzer records as a crash and ctest as a failure. */
#ifndef KVT_TESTS_FUZZ_FUZZ_H
#define KVT_TESTS_FUZZ_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvtier.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_REQUIRE(cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz: %s:%d: %s: ", __FILE__, __LINE__, #cond);                       \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, " (last error: %s)\n", kvt_last_error());                              \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* FUZZ_STATUS(name, s, ...): s must be KVT_OK or one of the listed errors (those the call's
 * contract in kvtier.h documents). KVT_ERR_INVARIANT is never listed, so it always aborts. */
static inline int fuzz_status_in(kvt_status s, const kvt_status *allowed, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s == allowed[i])
            return 1;
    return 0;
}
#define FUZZ_STATUS(call, s, ...)                                                                  \
    do {                                                                                           \
        static const kvt_status fuzz__ok_[] = {KVT_OK, __VA_ARGS__};                              \
        FUZZ_REQUIRE(fuzz_status_in((s), fuzz__ok_, sizeof fuzz__ok_ / sizeof fuzz__ok_[0]),       \
                     "%s returned %s, outside its documented set", call, kvt_status_name(s));    \
    } while (0)

/* Input bytes consumed front to back; past the end every read is 0 (so any input is a program). */
typedef struct fuzz_in {
    const uint8_t *p;
    size_t n;
} fuzz_in;

static inline uint8_t fuzz_u8(fuzz_in *in) {
    if (in->n == 0)
        return 0;
    in->n--;
    return *in->p++;
}
static inline uint32_t fuzz_u16(fuzz_in *in) {
    uint32_t lo = fuzz_u8(in);
    return lo | (uint32_t)fuzz_u8(in) << 8;
}
/* A value in [lo, hi]. */
static inline uint32_t fuzz_range(fuzz_in *in, uint32_t lo, uint32_t hi) {
    uint32_t span = hi - lo + 1;
    uint32_t v = span > 256 ? fuzz_u16(in) : fuzz_u8(in);
    return lo + v % span;
}

/* kvtier containers (traces, snapshots; docs/trace-format.md §1): the file header's CRC of bytes
 * 0..19 at 20; each section header's payload CRC at 16 (of the payload's length bytes, when they
 * are in the input) and its own CRC of bytes 0..19 at 20; sections start at multiples of 8 after
 * the payload, the padding zero. fuzz_fix_crcs restores the magic's first byte and recomputes
 * every CRC and padding, so that a target whose input starts with 0x88 reaches the parsers
 * behind the checksums; other inputs fuzz the checksums themselves. */
#include <string.h>
#include <zlib.h>

static inline uint32_t fuzz_get_u32(const uint8_t *p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void fuzz_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void fuzz_fix_crcs(uint8_t *b, size_t n) {
    b[0] = 0x89;
    if (n < 24)
        return;
    fuzz_put_u32(b + 20, (uint32_t)crc32(0, b, 20));
    uint64_t off = 24;
    while (off + 24 <= n) {
        uint8_t *h = b + off;
        uint64_t len = fuzz_get_u32(h + 8) | (uint64_t)fuzz_get_u32(h + 12) << 32;
        if (len <= n - off - 24)
            fuzz_put_u32(h + 16, (uint32_t)crc32(0, h + 24, (uInt)len));
        fuzz_put_u32(h + 20, (uint32_t)crc32(0, h, 20));
        if (len > n - off - 24)
            break;
        uint64_t pad = (8 - len % 8) % 8;
        if (pad <= n - off - 24 - len)
            memset(h + 24 + len, 0, (size_t)pad);
        off += 24 + len + pad;
    }
}

#endif
