/* status.c — status names and messages from the one X-macro list in kvtier.h; error formatting. */
#include "base.h"

#include <stdio.h>

const char *kvt_strerror(kvt_status s) {
    switch (s) {
#define KVT__STATUS_TEXT(name, code, text)                                                         \
    case KVT_##name:                                                                               \
        return text;
        KVT_STATUS_LIST(KVT__STATUS_TEXT)
#undef KVT__STATUS_TEXT
    }
    return "unknown status";
}

const char *kvt_status_name(kvt_status s) {
    switch (s) {
#define KVT__STATUS_NAME(name, code, text)                                                         \
    case KVT_##name:                                                                               \
        return "KVT_" #name;
        KVT_STATUS_LIST(KVT__STATUS_NAME)
#undef KVT__STATUS_NAME
    }
    return "KVT_UNKNOWN_STATUS";
}

const char *kvt_version(int *major, int *minor, int *patch) {
    if (major)
        *major = KVT_VERSION_MAJOR;
    if (minor)
        *minor = KVT_VERSION_MINOR;
    if (patch)
        *patch = KVT_VERSION_PATCH;
#define KVT__STR2(x) #x
#define KVT__STR(x) KVT__STR2(x)
    return KVT__STR(KVT_VERSION_MAJOR) "." KVT__STR(KVT_VERSION_MINOR) "." KVT__STR(
        KVT_VERSION_PATCH);
}

int kvt_version_number(void) {
    return KVT_VERSION_NUMBER;
}

kvt_status kvt__vfail(char *err, size_t len, kvt_status s, const char *fmt, va_list ap) {
    if (err && len > 0)
        vsnprintf(err, len, fmt, ap);
    return s;
}

kvt_status kvt__fail(char *err, size_t len, kvt_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvt__vfail(err, len, s, fmt, ap);
    va_end(ap);
    return s;
}
