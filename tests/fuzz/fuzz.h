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

#endif
