/*
 * alloc.h — the one host-memory wrapper. Every host byte kvtier owns (metadata, the CPU row pool,
 * archive copies, snapshots) goes through it.
 *
 * KVT_ALLOC_DEFAULT uses jemalloc's mallocx/sdallocx on a private arena created per context, when
 * jemalloc is present in the process; kvtier references jemalloc through weak symbols and the
 * shared library records no dependency on it, because Debian's libjemalloc.so.2 is built with
 * initial-exec TLS and makes any library that needs it fail to dlopen ("cannot allocate memory in
 * static TLS block") — engines are Python processes that load kvtier with dlopen. Executables that
 * link the static library (tools, tests) link jemalloc and get the arena; a Python engine gets it
 * with LD_PRELOAD=libjemalloc.so.2 and libc otherwise. KVT_ALLOC_LIBC (and every KVT_SANITIZE
 * build) routes to aligned_alloc/free so ASan and valgrind see every byte.
 */
#ifndef KVT_LIB_BASE_ALLOC_H
#define KVT_LIB_BASE_ALLOC_H

#include "kvtier.h"
#include "seam.h"

/* The allocation counter is shared by every thread working on a context (a run and the
 * scheduler's calls may allocate at once; kvtier.h, "Threads"): a C11 atomic, counted relaxed.
 * C++ translation units (nvcc) only pass kvt__alloc by pointer and never touch the counter; they
 * see a plain uint64_t of the same size and alignment (alloc.c asserts it). */
#ifdef __cplusplus
typedef uint64_t kvt__counter;
#else
#include <stdatomic.h>
typedef _Atomic uint64_t kvt__counter;
#endif

typedef struct kvt__alloc {
    int use_jemalloc;
    unsigned arena;
    int flags;          /* mallocx flags: arena, no tcache */
    kvt__counter calls; /* allocations made (malloc, calloc, realloc): a steady-state decode makes
                         * none, which tests check (kvt_ctx_host_allocations) */
} kvt__alloc;

/* Alignment of every allocation (a cache line). */
#define KVT__ALIGN 64u

kvt_status kvt__alloc_init(kvt__alloc *a, kvt_allocator kind);
void kvt__alloc_fini(kvt__alloc *a);
const char *kvt__alloc_name(const kvt__alloc *a);
/* Allocations made so far (relaxed: a count, not a synchronisation point). */
uint64_t kvt__alloc_calls(const kvt__alloc *a);

/* Each allocation below is a call of the allocation seam (seam.h): a macro passes its caller's
 * file and function as the site, so a test hook can fail it and name it. */

/* NULL on failure or bytes == 0. */
#define kvt__malloc(a, bytes) kvt__malloc_at((a), (bytes), KVT__SITE)
#define kvt__calloc(a, bytes) kvt__calloc_at((a), (bytes), KVT__SITE)
/* bytes must be the size passed at allocation (sized deallocation). NULL is a no-op. */
void kvt__free(const kvt__alloc *a, void *p, size_t bytes);
/* Grow or shrink keeping the first min(old, new) bytes; NULL on failure (p untouched). */
#define kvt__realloc(a, p, old_bytes, new_bytes)                                                   \
    kvt__realloc_at((a), (p), (old_bytes), (new_bytes), KVT__SITE)

/* Grow *arr (elements of elt bytes, capacity *cap) to hold at least need elements (doubling).
 * KVT_OK or KVT_ERR_OUT_OF_MEMORY (array unchanged). */
#define kvt__grow(a, arr, cap, need, elt) kvt__grow_at((a), (arr), (cap), (need), (elt), KVT__SITE)
/* kvt__grow on a typed array `arr` with capacity `cap`; returns the status from the enclosing
 * function on failure (the array is unchanged then). */
#define KVT__GROW_OR_RETURN(a, arr, cap, need)                                                     \
    do {                                                                                           \
        void *p_ = (arr);                                                                          \
        kvt_status g_ = kvt__grow((a), &p_, &(cap), (need), sizeof *(arr));                        \
        if (g_ != KVT_OK)                                                                          \
            return g_;                                                                             \
        (arr) = p_;                                                                                \
    } while (0)

void *kvt__malloc_at(const kvt__alloc *a, size_t bytes, const char *file, const char *func);
void *kvt__calloc_at(const kvt__alloc *a, size_t bytes, const char *file, const char *func);
void *kvt__realloc_at(const kvt__alloc *a, void *p, size_t old_bytes, size_t new_bytes,
                      const char *file, const char *func);
kvt_status kvt__grow_at(const kvt__alloc *a, void **arr, uint64_t *cap, uint64_t need, size_t elt,
                        const char *file, const char *func);

/* ---- allocations that belong to no context ----
 * Models, the census, traces and their writers, container readers, reference handles, recall
 * basis buffers, snapshot-context temporaries: libc's malloc behind the same seam, unsized (free
 * takes no size), the same contracts as malloc, calloc (n elements of size bytes, overflow-
 * checked), realloc, free and strdup. */
#define kvt__mem_malloc(bytes) kvt__mem_malloc_at((bytes), KVT__SITE)
#define kvt__mem_calloc(n, size) kvt__mem_calloc_at((n), (size), KVT__SITE)
#define kvt__mem_realloc(p, bytes) kvt__mem_realloc_at((p), (bytes), KVT__SITE)
#define kvt__mem_strdup(s) kvt__mem_strdup_at((s), KVT__SITE)
void kvt__mem_free(void *p);
void *kvt__mem_malloc_at(size_t bytes, const char *file, const char *func);
void *kvt__mem_calloc_at(size_t n, size_t size, const char *file, const char *func);
void *kvt__mem_realloc_at(void *p, size_t bytes, const char *file, const char *func);
char *kvt__mem_strdup_at(const char *s, const char *file, const char *func);

/* Anonymous private mappings (the guarded backend's buffers and arena): mmap(NULL, len, prot,
 * flags | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) behind the seam; NULL (not MAP_FAILED) on failure.
 * kvt__mem_unmap(p, len) undoes one whole mapping. */
#define kvt__mem_map(len, prot, flags) kvt__mem_map_at((len), (prot), (flags), KVT__SITE)
void *kvt__mem_map_at(size_t len, int prot, int flags, const char *file, const char *func);
void kvt__mem_unmap(void *p, size_t len);

/* Route jansson's allocations through the seam (site file "jansson"): json_set_alloc_funcs,
 * once per process. jansson's allocator is process-global, shared with anything else in the
 * process that uses libjansson: kvtier installs its functions only while jansson still has its
 * defaults (malloc and free), and its functions are malloc and free behind the seam, so an object
 * made before the switch or by another user of jansson is freed correctly either way. A process
 * that gave jansson its own allocator keeps it; kvtier's JSON then bypasses the seam (no fault
 * reaches it). Thread-safe (pthread_once). */
void kvt__mem_json_install(void);
/* Did one of jansson's allocations fail on this thread since the last call? (Resets the flag.)
 * jansson reports some failed allocations as syntax errors. */
bool kvt__mem_json_failed(void);

#endif
