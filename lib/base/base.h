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

/* The calling thread's error detail buffer (kvt_last_error): every call that fails writes its
 * message here, so two threads working on distinct contexts never race on one buffer. */
#define KVT__ERR_LEN 512
char *kvt__tls_error(void);
/* Format into the calling thread's buffer; returns s. */
kvt_status kvt__tls_fail(kvt_status s, const char *fmt, ...) KVT__PRINTF(2, 3);
kvt_status kvt__tls_vfail(kvt_status s, const char *fmt, va_list ap);
void kvt__tls_clear(void);
/* The end of a call that has no context to hold its error (kvt_ctx_create, kvt_ctx_estimate):
 * KVT_OK clears the thread's buffer; any other status puts msg in it and in err[0..len). Returns
 * s. */
kvt_status kvt__tls_finish(kvt_status s, const char *msg, char *err, size_t len);

/* Versioned parameter structs (ABI rule of kvtier.h): copy a caller's struct whose first field is
 * its struct_size into dst, which holds this build's defaults (dst_size = sizeof). Accepted sizes
 * run from min_size (the oldest supported layout) up; fields past the caller's size keep their
 * defaults; past dst_size the caller's bytes must all be zero (a newer caller that set nothing
 * this build does not know). dst->struct_size is set to dst_size. KVT_ERR_INVALID_ARGUMENT for a
 * size below min_size, KVT_ERR_UNSUPPORTED for a non-zero byte past dst_size; a message names
 * `what` in the thread's error buffer. */
kvt_status kvt__struct_in(void *dst, size_t dst_size, const void *src, size_t min_size,
                          const char *what);
/* The _init form of a default function (ABI rule of kvtier.h): write the defaults `def` (this
 * build's struct of def_size bytes, first field struct_size) into out's first `size` bytes (the
 * caller's sizeof), never past them, and set out->struct_size = size. KVT_ERR_INVALID_ARGUMENT
 * (named `what` in the thread's error buffer) for NULL or a size below min_size. */
kvt_status kvt__struct_init(void *out, size_t size, size_t min_size, const void *def,
                            size_t def_size, const char *what);
/* The size a caller's output struct (first field struct_size) may be written to: its
 * struct_size capped at this build's, or 0 when it is below min_size (nothing may be written). */
size_t kvt__struct_out_size(const void *dst, size_t build_size, size_t min_size);

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
