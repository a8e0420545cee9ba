/* alloc.c — host allocation through a private jemalloc arena, or libc (see alloc.h). */
#include "alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(KVT_HAVE_JEMALLOC) && !defined(__SANITIZE_ADDRESS__)
/* Weak references: resolved when jemalloc is in the process, NULL otherwise. Declared by hand
 * (unprefixed Debian names) so no jemalloc header or DT_NEEDED entry is required. */
extern void *mallocx(size_t size, int flags) __attribute__((weak));
extern void *rallocx(void *ptr, size_t size, int flags) __attribute__((weak));
extern void sdallocx(void *ptr, size_t size, int flags) __attribute__((weak));
extern int mallctl(const char *name, void *oldp, size_t *oldlenp, void *newp, size_t newlen)
    __attribute__((weak));
#define KVT__JE_ARENA(a) ((((int)(a)) + 1) << 20)
#define KVT__JE_TCACHE_NONE (((int)(-1 + 2)) << 8)
#define KVT__JE_LG_ALIGN(la) ((int)(la))
#define KVT__JE_ZERO ((int)0x40)
#define KVT__JE_AVAILABLE 1
#else
#define KVT__JE_AVAILABLE 0
#endif

kvt_status kvt__alloc_init(kvt__alloc *a, kvt_allocator kind) {
    memset(a, 0, sizeof *a);
    if (kind != KVT_ALLOC_DEFAULT && kind != KVT_ALLOC_LIBC)
        return KVT_ERR_INVALID_ARGUMENT;
#if KVT__JE_AVAILABLE
    if (kind == KVT_ALLOC_DEFAULT && mallocx && sdallocx && rallocx && mallctl) {
        unsigned arena = 0;
        size_t sz = sizeof arena;
        if (mallctl("arenas.create", &arena, &sz, NULL, 0) == 0) {
            a->use_jemalloc = 1;
            a->arena = arena;
            a->flags = KVT__JE_ARENA(arena) | KVT__JE_TCACHE_NONE | KVT__JE_LG_ALIGN(6);
        }
    }
#endif
    return KVT_OK;
}

void kvt__alloc_fini(kvt__alloc *a) {
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc) {
        char name[64];
        snprintf(name, sizeof name, "arena.%u.destroy", a->arena);
        mallctl(name, NULL, NULL, NULL, 0);
    }
#endif
    memset(a, 0, sizeof *a);
}

const char *kvt__alloc_name(const kvt__alloc *a) {
    return a->use_jemalloc ? "jemalloc" : "libc";
}

_Static_assert(sizeof(kvt__counter) == sizeof(uint64_t) &&
                   _Alignof(kvt__counter) == _Alignof(uint64_t),
               "C++ units see kvt__alloc.calls as a plain uint64_t (alloc.h)");

/* The counter is part of the context's allocator object, which is never const itself. Threads
 * of one context count concurrently (kvtier.h, "Threads"). */
static void count(const kvt__alloc *a) {
    atomic_fetch_add_explicit(&((kvt__alloc *)a)->calls, 1, memory_order_relaxed);
}

uint64_t kvt__alloc_calls(const kvt__alloc *a) {
    return atomic_load_explicit(&((kvt__alloc *)a)->calls, memory_order_relaxed);
}

void *kvt__malloc(const kvt__alloc *a, size_t bytes) {
    if (bytes == 0)
        return NULL;
    count(a);
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc)
        return mallocx(bytes, a->flags);
#endif
    size_t rounded = (bytes + KVT__ALIGN - 1) / KVT__ALIGN * KVT__ALIGN;
    if (rounded < bytes)
        return NULL;
    return aligned_alloc(KVT__ALIGN, rounded);
}

void *kvt__calloc(const kvt__alloc *a, size_t bytes) {
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc) {
        if (bytes)
            count(a);
        return bytes ? mallocx(bytes, a->flags | KVT__JE_ZERO) : NULL;
    }
#endif
    void *p = kvt__malloc(a, bytes);
    if (p)
        memset(p, 0, bytes);
    return p;
}

void kvt__free(const kvt__alloc *a, void *p, size_t bytes) {
    if (!p)
        return;
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc) {
        sdallocx(p, bytes, a->flags);
        return;
    }
#endif
    (void)bytes;
    free(p);
}

void *kvt__realloc(const kvt__alloc *a, void *p, size_t old_bytes, size_t new_bytes) {
    if (!p)
        return kvt__malloc(a, new_bytes);
    if (new_bytes == 0)
        return NULL;
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc) {
        count(a);
        return rallocx(p, new_bytes, a->flags);
    }
#endif
    void *q = kvt__malloc(a, new_bytes);
    if (!q)
        return NULL;
    memcpy(q, p, old_bytes < new_bytes ? old_bytes : new_bytes);
    free(p);
    return q;
}

kvt_status kvt__grow(const kvt__alloc *a, void **arr, uint64_t *cap, uint64_t need, size_t elt) {
    if (need <= *cap)
        return KVT_OK;
    uint64_t n = *cap ? *cap : 16;
    while (n < need) {
        if (n > (UINT64_MAX / 2))
            return KVT_ERR_OUT_OF_MEMORY;
        n *= 2;
    }
    if (n > SIZE_MAX / elt)
        return KVT_ERR_OUT_OF_MEMORY;
    void *q = kvt__realloc(a, *arr, (size_t)(*cap * elt), (size_t)(n * elt));
    if (!q)
        return KVT_ERR_OUT_OF_MEMORY;
    *arr = q;
    *cap = n;
    return KVT_OK;
}
