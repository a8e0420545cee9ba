/* alloc.c — host allocation through a private jemalloc arena, or libc (see alloc.h). */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include "alloc.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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

/* ---- the seam: the hook and the live count ----
 * Only this file and io.c call the system's allocation and file functions (seam.h). */
static _Atomic(kvt__seam_hook) seam_hook;
static void *_Atomic seam_user;
static _Atomic int64_t seam_live;

void kvt__seam_set_hook(kvt__seam_hook fn, void *user) {
    atomic_store(&seam_user, user);
    atomic_store(&seam_hook, fn);
}

int64_t kvt__seam_live(void) {
    return atomic_load_explicit(&seam_live, memory_order_relaxed);
}

void kvt__seam_count(int64_t delta) {
    atomic_fetch_add_explicit(&seam_live, delta, memory_order_relaxed);
}

int kvt__seam_enter(kvt__seam_kind kind, const char *op, const char *file, const char *func,
                    size_t *bytes) {
    kvt__seam_hook fn = atomic_load_explicit(&seam_hook, memory_order_acquire);
    if (!fn)
        return 0;
    kvt__seam_call c = {.kind = kind, .op = op, .file = file, .func = func, .bytes = *bytes};
    int e = fn(atomic_load(&seam_user), &c);
    if (c.bytes < *bytes)
        *bytes = c.bytes;
    return e;
}

/* An allocation of `op` at the site: false when the hook fails it. */
static bool seam_alloc(const char *op, size_t bytes, const char *file, const char *func) {
    return kvt__seam_enter(KVT__SEAM_ALLOC, op, file, func, &bytes) == 0;
}

/* Count a successful allocation; pass p through. */
static void *counted(void *p) {
    if (p)
        kvt__seam_count(1);
    return p;
}

/* ---- a context's allocator ---- */

void *kvt__malloc_at(const kvt__alloc *a, size_t bytes, const char *file, const char *func) {
    if (bytes == 0)
        return NULL;
    count(a);
    if (!seam_alloc("malloc", bytes, file, func))
        return NULL;
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc)
        return counted(mallocx(bytes, a->flags));
#endif
    size_t rounded = (bytes + KVT__ALIGN - 1) / KVT__ALIGN * KVT__ALIGN;
    if (rounded < bytes)
        return NULL;
    return counted(aligned_alloc(KVT__ALIGN, rounded));
}

void *kvt__calloc_at(const kvt__alloc *a, size_t bytes, const char *file, const char *func) {
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc) {
        if (!bytes)
            return NULL;
        count(a);
        if (!seam_alloc("calloc", bytes, file, func))
            return NULL;
        return counted(mallocx(bytes, a->flags | KVT__JE_ZERO));
    }
#endif
    void *p = kvt__malloc_at(a, bytes, file, func);
    if (p)
        memset(p, 0, bytes);
    return p;
}

void kvt__free(const kvt__alloc *a, void *p, size_t bytes) {
    if (!p)
        return;
    kvt__seam_count(-1);
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc) {
        sdallocx(p, bytes, a->flags);
        return;
    }
#endif
    (void)bytes;
    free(p);
}

void *kvt__realloc_at(const kvt__alloc *a, void *p, size_t old_bytes, size_t new_bytes,
                      const char *file, const char *func) {
    if (!p)
        return kvt__malloc_at(a, new_bytes, file, func);
    if (new_bytes == 0)
        return NULL;
#if KVT__JE_AVAILABLE
    if (a->use_jemalloc) {
        count(a);
        if (!seam_alloc("realloc", new_bytes, file, func))
            return NULL;
        return rallocx(p, new_bytes, a->flags);
    }
#endif
    void *q = kvt__malloc_at(a, new_bytes, file, func);
    if (!q)
        return NULL;
    memcpy(q, p, old_bytes < new_bytes ? old_bytes : new_bytes);
    kvt__free(a, p, old_bytes);
    return q;
}

kvt_status kvt__grow_at(const kvt__alloc *a, void **arr, uint64_t *cap, uint64_t need, size_t elt,
                        const char *file, const char *func) {
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
    void *q = kvt__realloc_at(a, *arr, (size_t)(*cap * elt), (size_t)(n * elt), file, func);
    if (!q)
        return KVT_ERR_OUT_OF_MEMORY;
    *arr = q;
    *cap = n;
    return KVT_OK;
}

/* ---- allocations that belong to no context: libc ---- */

void *kvt__mem_malloc_at(size_t bytes, const char *file, const char *func) {
    if (!seam_alloc("malloc", bytes, file, func))
        return NULL;
    return counted(malloc(bytes ? bytes : 1));
}

void *kvt__mem_calloc_at(size_t n, size_t size, const char *file, const char *func) {
    if (size && n > SIZE_MAX / size)
        return NULL;
    if (!seam_alloc("calloc", n * size, file, func))
        return NULL;
    return counted(calloc(n ? n : 1, size ? size : 1));
}

void *kvt__mem_realloc_at(void *p, size_t bytes, const char *file, const char *func) {
    if (!seam_alloc("realloc", bytes, file, func))
        return NULL;
    void *q = realloc(p, bytes ? bytes : 1);
    if (q && !p)
        kvt__seam_count(1);
    return q;
}

char *kvt__mem_strdup_at(const char *s, const char *file, const char *func) {
    size_t n = strlen(s) + 1;
    if (!seam_alloc("strdup", n, file, func))
        return NULL;
    char *d = counted(malloc(n));
    if (d)
        memcpy(d, s, n);
    return d;
}

void kvt__mem_free(void *p) {
    if (!p)
        return;
    kvt__seam_count(-1);
    free(p);
}

void *kvt__mem_map_at(size_t len, int prot, int flags, const char *file, const char *func) {
    if (!seam_alloc("mmap", len, file, func))
        return NULL;
    void *p = mmap(NULL, len, prot, flags | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : counted(p);
}

void kvt__mem_unmap(void *p, size_t len) {
    if (!p)
        return;
    kvt__seam_count(-1);
    munmap(p, len);
}

/* jansson's functions: malloc and free behind the seam (see alloc.h for why they must stay
 * exactly those underneath). */
/* Whether one of jansson's allocations failed on this thread since the last kvt__mem_json_failed
 * call: jansson's lexer reports a failed allocation as a syntax error ("string or '}' expected"),
 * so the census asks here to answer KVT_ERR_OUT_OF_MEMORY instead. */
static _Thread_local bool json_alloc_failed;

bool kvt__mem_json_failed(void) {
    bool f = json_alloc_failed;
    json_alloc_failed = false;
    return f;
}

static void *json_malloc(size_t bytes) {
    void *p = seam_alloc("jansson", bytes, "jansson", "json_malloc") ? malloc(bytes) : NULL;
    if (!p)
        json_alloc_failed = true;
    return counted(p);
}

static void json_free(void *p) {
    kvt__mem_free(p);
}

static void json_install_once(void) {
    json_malloc_t m = NULL;
    json_free_t f = NULL;
    json_get_alloc_funcs(&m, &f);
    if ((m == malloc && f == free) || (m == NULL && f == NULL))
        json_set_alloc_funcs(json_malloc, json_free);
}

void kvt__mem_json_install(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, json_install_once);
}
