/*
 * seam.h — the two seams every host allocation and every file operation of the library goes
 * through, and the test hook that can fail any call of either.
 *
 * The allocation seam is lib/base/alloc.c (alloc.h): a context's allocator (kvt__malloc & co.,
 * jemalloc's arena or libc), the context-free allocations (kvt__mem_*: models, the census and
 * jansson's objects, traces, containers, reference handles, recall bases) and the guarded
 * backend's mappings (kvt__mem_map). The I/O seam is lib/base/io.c (io.h): open, read, write,
 * fsync, rename, close, unlink, fstat, directory listing and locks of every file the library
 * reads or writes. No other object of the library calls malloc, free, fopen, open, write ... by
 * itself: tests/scripts/seams.cmake checks every object file's undefined symbols.
 *
 * Each call reports a site: the kind of seam, the operation ("malloc", "write", ...), and the
 * source file and function of the library code that made it (__FILE__ and __func__, so a site
 * name survives edits that move lines). With no hook installed a seam call costs one relaxed
 * atomic load more than the call it wraps.
 *
 * The hook is process-wide, like the only allocator hook jansson has (json_set_alloc_funcs):
 * allocations of a model or a trace have no context to hang it on. It is for tests (the fault
 * sweeps of tests/test_seams.c, tests/support/fault_alloc.h): install it while no other thread
 * uses the library.
 */
#ifndef KVT_LIB_BASE_SEAM_H
#define KVT_LIB_BASE_SEAM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvt__seam_kind { KVT__SEAM_ALLOC = 0, KVT__SEAM_IO = 1 } kvt__seam_kind;

typedef struct kvt__seam_call {
    kvt__seam_kind kind;
    const char *op;   /* ALLOC: "malloc" "calloc" "realloc" "strdup" "mmap" "jansson";
                       * IO: "open" "read" "write" "fsync" "rename" "close" "unlink" "stat"
                       * "opendir" "lock" */
    const char *file; /* __FILE__ of the library code that made the call ("jansson" for jansson's
                       * own allocations) */
    const char *func; /* __func__ of that code */
    size_t bytes;     /* bytes asked for (allocations, read, write); a hook may lower it for a
                       * read or write, which then transfers fewer bytes (a short transfer) */
} kvt__seam_call;

/* Called before each seam call. Returns 0 to let the call go on, or a non-zero errno value: an
 * allocation then returns NULL, an I/O call fails with that errno (a failed close still closes
 * the descriptor, as POSIX close does on EIO). */
typedef int (*kvt__seam_hook)(void *user, kvt__seam_call *call);

/* Install (NULL: remove) the hook. */
void kvt__seam_set_hook(kvt__seam_hook fn, void *user);

/* Allocations live through the allocation seam: successful allocations (and mappings) minus
 * frees (and unmappings), process-wide. A call that leaves it changed has kept memory. Freeing
 * through the seam what it never counted (jansson objects made before kvtier installed its
 * functions) moves it too: compare it across one library call, not across a process. */
int64_t kvt__seam_live(void);

/* ---- for alloc.c and io.c only ---- */

/* Count a call and ask the hook: 0 (go on) or the errno to fail with. */
int kvt__seam_enter(kvt__seam_kind kind, const char *op, const char *file, const char *func,
                    size_t *bytes);
/* An allocation (+1) or a free (-1) happened. */
void kvt__seam_count(int64_t delta);

/* The site arguments every seam macro appends. */
#define KVT__SITE __FILE__, __func__

#ifdef __cplusplus
}
#endif

#endif /* KVT_LIB_BASE_SEAM_H */
