/* abi.c — the thread's error buffer and the struct_size rule of versioned parameter structs. */
#include "base.h"

#include <stdio.h>
#include <string.h>

/* One buffer per thread: a kvtier call reports its detail where the calling thread reads it
 * (kvt_last_error), whatever context it used. */
static _Thread_local char tls_err[KVT__ERR_LEN];

char *kvt__tls_error(void) {
    return tls_err;
}

kvt_status kvt__tls_vfail(kvt_status s, const char *fmt, va_list ap) {
    return kvt__vfail(tls_err, sizeof tls_err, s, fmt, ap);
}

kvt_status kvt__tls_fail(kvt_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvt__tls_vfail(s, fmt, ap);
    va_end(ap);
    return s;
}

void kvt__tls_clear(void) {
    tls_err[0] = '\0';
}

kvt_status kvt__tls_finish(kvt_status s, const char *msg, char *err, size_t len) {
    if (s == KVT_OK) {
        kvt__tls_clear();
        return KVT_OK;
    }
    kvt__tls_fail(s, "%s", msg);
    return kvt__fail(err, len, s, "%s", msg);
}

const char *kvt_last_error(void) {
    return tls_err;
}

kvt_status kvt__struct_in(void *dst, size_t dst_size, const void *src, size_t min_size,
                          const char *what) {
    size_t n;
    memcpy(&n, src, sizeof n);
    if (n < min_size)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT,
                             "%s.struct_size: %zu is below the oldest layout this library reads "
                             "(%zu); start from its default_params/default function",
                             what, n, min_size);
    if (n > dst_size) {
        const unsigned char *tail = (const unsigned char *)src + dst_size;
        for (size_t i = 0; i < n - dst_size; i++)
            if (tail[i] != 0)
                return kvt__tls_fail(KVT_ERR_UNSUPPORTED,
                                     "%s.struct_size: %zu; byte %zu is set but this library "
                                     "(%zu bytes) does not know that field: built against a "
                                     "newer kvtier",
                                     what, n, dst_size + i, dst_size);
    }
    memcpy(dst, src, n < dst_size ? n : dst_size);
    memcpy(dst, &dst_size, sizeof dst_size);
    return KVT_OK;
}

kvt_status kvt__struct_init(void *out, size_t size, size_t min_size, const void *def,
                            size_t def_size, const char *what) {
    if (!out || size < min_size)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT,
                             "%s_init: %s (the oldest layout this library writes is %zu bytes)",
                             what, out ? "struct_size too small" : "NULL struct", min_size);
    memcpy(out, def, size < def_size ? size : def_size);
    memcpy(out, &size, sizeof size);
    return KVT_OK;
}

size_t kvt__struct_out_size(const void *dst, size_t build_size, size_t min_size) {
    size_t n;
    memcpy(&n, dst, sizeof n);
    if (n < min_size)
        return 0;
    return n < build_size ? n : build_size;
}
