/*
 * base.h — the bottom layer every part of kvtier may include: status formatting (kvt__fail),
 * KVT_ASSERT. Not installed. Internal names are kvt__. Layers (imports point down only, checked by
 * tests/scripts/layers.cmake): base <- kernels <- tiers <- recall <- lib <- tools, bench.
 */
#ifndef KVT_LIB_BASE_BASE_H
#define KVT_LIB_BASE_BASE_H

#include "kvtier.h"

#include <stdarg.h>
#include <stddef.h>

#if defined(__GNUC__)
#define KVT__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KVT__PRINTF(a, b)
#endif

/* Format a message into err[0..len) (err may be NULL or len 0: nothing written); returns s so a
 * caller can write `return kvt__fail(err, len, KVT_ERR_PARSE, "key %s", k);`. */
kvt_status kvt__fail(char *err, size_t len, kvt_status s, const char *fmt, ...) KVT__PRINTF(4, 5);
kvt_status kvt__vfail(char *err, size_t len, kvt_status s, const char *fmt, va_list ap);

#ifndef NDEBUG
#include <stdio.h>
#include <stdlib.h>
/* Debug-build guard for internal invariants; never used on input from outside. */
#define KVT_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "kvtier: assertion failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__);  \
            abort();                                                                               \
        }                                                                                          \
    } while (0)
#else
#define KVT_ASSERT(cond)                                                                           \
    do {                                                                                           \
        (void)sizeof(cond);                                                                        \
    } while (0)
#endif

#endif /* KVT_LIB_BASE_BASE_H */
