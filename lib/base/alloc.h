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
/* NULL on failure or bytes == 0. */
void *kvt__malloc(const kvt__alloc *a, size_t bytes);
void *kvt__calloc(const kvt__alloc *a, size_t bytes);
/* bytes must be the size passed at allocation (sized deallocation). NULL is a no-op. */
void kvt__free(const kvt__alloc *a, void *p, size_t bytes);
/* Grow or shrink keeping the first min(old, new) bytes; NULL on failure (p untouched). */
void *kvt__realloc(const kvt__alloc *a, void *p, size_t old_bytes, size_t new_bytes);

/* Grow *arr (elements of elt bytes, capacity *cap) to hold at least need elements (doubling).
 * KVT_OK or KVT_ERR_OUT_OF_MEMORY (array unchanged). */
kvt_status kvt__grow(const kvt__alloc *a, void **arr, uint64_t *cap, uint64_t need, size_t elt);
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

#endif
