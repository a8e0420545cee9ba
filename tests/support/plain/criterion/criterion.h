/*
 * criterion.h — a plain stand-in for the part of Criterion 2.4 that test_cuda uses, for the
 * ThreadSanitizer build of the CUDA emulation (tests/scripts/cuda_emu.cmake), where Criterion
 * itself aborts at start ("Could not initialize inheritable arena": boxfort's shared
 * arena cannot be mapped beside TSan's shadow). Included instead of <criterion/criterion.h> by
 * putting tests/support/plain first on the include path; the test sources are unchanged.
 *
 * Each Test(suite, name, ...) registers itself; main runs those matching --filter (a glob with
 * extglob patterns, as Criterion's) one at a time, each in a child process (as Criterion does,
 * so a test's crash or a sanitizer report is that test's failure), and exits 1 if any failed. A
 * failed assertion prints its file, line and message and ends the child with status 1;
 * cr_skip_test ends it with 77 (a skip). The options' .timeout is ignored.
 */
#ifndef KVT_TESTS_PLAIN_CRITERION_H
#define KVT_TESTS_PLAIN_CRITERION_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct kvt_plain_test {
    const char *suite, *name;
    void (*fn)(void);
    struct kvt_plain_test *next;
} kvt_plain_test;

void kvt_plain_register(kvt_plain_test *t);
_Noreturn void kvt_plain_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
_Noreturn void kvt_plain_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void kvt_plain_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define Test(suite, name, ...)                                                                     \
    static void kvt_plain_##suite##_##name(void);                                                  \
    static kvt_plain_test kvt_plain_t_##suite##_##name = {#suite, #name,                           \
                                                          kvt_plain_##suite##_##name, NULL};       \
    __attribute__((constructor)) static void kvt_plain_reg_##suite##_##name(void) {                \
        kvt_plain_register(&kvt_plain_t_##suite##_##name);                                         \
    }                                                                                              \
    static void kvt_plain_##suite##_##name(void)

#define cr_assert(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond))                                                                               \
            kvt_plain_fail(__FILE__, __LINE__, "assertion failed: " #cond ": " __VA_ARGS__);      \
    } while (0)
#define KVT_PLAIN_CMP(a, op, b, ...)                                                               \
    do {                                                                                           \
        if (!((a)op(b)))                                                                           \
            kvt_plain_fail(__FILE__, __LINE__, "assertion failed: " #a " " #op " " #b ": "         \
                                               __VA_ARGS__);                                       \
    } while (0)
#define cr_assert_eq(a, b, ...) KVT_PLAIN_CMP(a, ==, b, "" __VA_ARGS__)
#define cr_assert_neq(a, b, ...) KVT_PLAIN_CMP(a, !=, b, "" __VA_ARGS__)
#define cr_assert_gt(a, b, ...) KVT_PLAIN_CMP(a, >, b, "" __VA_ARGS__)
#define cr_assert_geq(a, b, ...) KVT_PLAIN_CMP(a, >=, b, "" __VA_ARGS__)
#define cr_assert_lt(a, b, ...) KVT_PLAIN_CMP(a, <, b, "" __VA_ARGS__)
#define cr_assert_leq(a, b, ...) KVT_PLAIN_CMP(a, <=, b, "" __VA_ARGS__)
#define cr_assert_null(p, ...) KVT_PLAIN_CMP((const void *)(p), ==, NULL, "" __VA_ARGS__)
#define cr_assert_not_null(p, ...) KVT_PLAIN_CMP((const void *)(p), !=, NULL, "" __VA_ARGS__)
#define cr_assert_fail(...) kvt_plain_fail(__FILE__, __LINE__, "" __VA_ARGS__)
#define cr_skip_test(...) kvt_plain_skip("" __VA_ARGS__)
#define cr_log_info(...) kvt_plain_info(__VA_ARGS__)

#endif /* KVT_TESTS_PLAIN_CRITERION_H */
