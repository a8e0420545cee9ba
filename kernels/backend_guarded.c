/*
 * backend_guarded.c — the guarded-device backend. Its buffers are mmap'd pages the host cannot
 * read or write except inside the backend's own ops, which proves on a machine without a GPU that
 * no host code path touches "device" bytes (a stray access faults with SIGSEGV). Protection keys
 * (pkey_alloc / pkey_mprotect, then pkey_set around each op: a register write of the calling
 * thread, ~0.15 us) where the CPU and kernel have them; otherwise mprotect around each op. In
 * mprotect mode every buffer is carved from one reserved arena, so a toggle is one system call
 * over the arena's used extent: with a mapping per buffer it was a call per buffer, each
 * splitting and re-merging kernel VMAs (on a 2-core machine without pkeys the default ctest spent
 * 17 min in the kernel, test_snapshot 562 s of it). The ops themselves are the CPU backend's
 * (backend_cpu.c, through cpu_internal.h), called after each op's checks.
 */
#define _GNU_SOURCE /* pkey_alloc, pkey_mprotect, pkey_set (glibc >= 2.27) */
#include "kernels/cpu_internal.h"
#include "recall/kernels/recall_group.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/sketch.h"
#include "lib/base/base.h"

#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct guard_region {
    void *p;
    size_t len;
} guard_region;

typedef struct guard_impl {
    cpu_ws ws;              /* first: the CPU ops read be->impl as their workspace */
    int pkey;               /* -1: mprotect mode */
    int depth;              /* nested opens (an op calling another) */
    guard_region *regions;  /* every live buffer; in mprotect mode sorted by address */
    uint64_t n_regions, regions_cap;
    uint8_t *arena;         /* mprotect mode: the reserved range every buffer is carved from */
    size_t arena_len;       /* its reserved bytes */
    size_t arena_hi;        /* the end of its last live buffer: a toggle covers [arena, +hi) */
    guard_region *pinned;   /* host_alloc's pages: open to the host, accepted by the ops */
    uint64_t n_pinned, pinned_cap;
    kvt__guarded_calls calls; /* kvt__backend_guarded_calls */
} guard_impl;

/* The mprotect-mode arena's reservation: address space only (PROT_NONE, MAP_NORESERVE: no
 * memory is committed until a buffer's pages are touched), halved until the kernel grants it. */
#define GUARD_ARENA_MAX ((size_t)64 << 30)
#define GUARD_ARENA_MIN ((size_t)1 << 30)

static const kvt__backend_ops guarded_ops_table;

bool kvt__backend_is_guarded(const kvt__backend *be) {
    return be->ops == &guarded_ops_table;
}

/* Count a call of n items (relaxed atomics: a TSan run may share a context's handle). */
static void g_count(const kvt__backend *be, uint64_t *calls, uint64_t *items, uint64_t n) {
    (void)be;
    __atomic_fetch_add(calls, 1, __ATOMIC_RELAXED);
    if (items)
        __atomic_fetch_add(items, n, __ATOMIC_RELAXED);
}

bool kvt__backend_guarded_calls(const kvt__backend *be, kvt__guarded_calls *out) {
    if (!kvt__backend_is_guarded(be))
        return false;
    const kvt__guarded_calls *c = &((const guard_impl *)be->impl)->calls;
    out->pack = __atomic_load_n(&c->pack, __ATOMIC_RELAXED);
    out->recall_step = __atomic_load_n(&c->recall_step, __ATOMIC_RELAXED);
    out->rope_step = __atomic_load_n(&c->rope_step, __ATOMIC_RELAXED);
    out->rope_emit = __atomic_load_n(&c->rope_emit, __ATOMIC_RELAXED);
    out->recall_step_items = __atomic_load_n(&c->recall_step_items, __ATOMIC_RELAXED);
    out->rope_step_items = __atomic_load_n(&c->rope_step_items, __ATOMIC_RELAXED);
    out->rope_emit_items = __atomic_load_n(&c->rope_emit_items, __ATOMIC_RELAXED);
    return true;
}

#define G_COUNT(be, op, n)                                                                         \
    g_count(be, &((guard_impl *)(be)->impl)->calls.op, &((guard_impl *)(be)->impl)->calls.op##_items, n)

static size_t page_round(size_t bytes) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + pg - 1) / pg * pg;
}

static void guard_set(const guard_impl *g, bool open) {
    if (g->pkey >= 0) {
        pkey_set(g->pkey, open ? 0 : PKEY_DISABLE_ACCESS);
        return;
    }
    if (g->arena_hi > 0)
        mprotect(g->arena, g->arena_hi, open ? PROT_READ | PROT_WRITE : PROT_NONE);
}

static void guard_open(const kvt__backend *be) {
    guard_impl *g = be->impl;
    if (g->depth++ == 0)
        guard_set(g, true);
}

static void guard_close(const kvt__backend *be) {
    guard_impl *g = be->impl;
    if (--g->depth == 0)
        guard_set(g, false);
}

/* mprotect mode: the first gap between live buffers (sorted by address) that holds len bytes,
 * else the arena's end. Gap pages were zapped (MADV_DONTNEED) and closed when their buffer was
 * freed, so they read as zero, like fresh pages. Returns the region's index, or -1 when full. */
static int64_t arena_place(const guard_impl *g, size_t len, size_t *off) {
    size_t at = 0;
    for (uint64_t i = 0; i < g->n_regions; i++) {
        size_t b = (size_t)((uint8_t *)g->regions[i].p - g->arena);
        if (b - at >= len) {
            *off = at;
            return (int64_t)i;
        }
        at = b + g->regions[i].len;
    }
    if (g->arena_len - at < len)
        return -1;
    *off = at;
    return (int64_t)g->n_regions;
}

static kvt_status g_buf_alloc(const kvt__backend *be, size_t bytes, void **out) {
    NOT_CAPTURED(be);
    guard_impl *g = be->impl;
    *out = NULL;
    if (bytes == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    void *arr = g->regions;
    if (kvt__grow(be->alloc, &arr, &g->regions_cap, g->n_regions + 1, sizeof *g->regions) != KVT_OK)
        return KVT_ERR_OUT_OF_MEMORY;
    g->regions = arr;
    size_t len = page_round(bytes);
    if (g->pkey < 0) {
        size_t off = 0;
        int64_t at = arena_place(g, len, &off);
        if (at < 0)
            return KVT_ERR_OUT_OF_MEMORY; /* the reservation is spent */
        uint8_t *p = g->arena + off;
        /* closed pages; inside an op (open) the new buffer opens with the rest */
        if (g->depth > 0 && mprotect(p, len, PROT_READ | PROT_WRITE) != 0)
            return KVT_ERR_OUT_OF_MEMORY;
        memmove(&g->regions[at + 1], &g->regions[at],
                sizeof *g->regions * (size_t)(g->n_regions - (uint64_t)at));
        g->regions[at].p = p;
        g->regions[at].len = len;
        g->n_regions++;
        if (off + len > g->arena_hi)
            g->arena_hi = off + len;
        *out = p;
        return KVT_OK;
    }
    void *p = kvt__mem_map(len, PROT_READ | PROT_WRITE, 0);
    if (!p)
        return KVT_ERR_OUT_OF_MEMORY;
    if (pkey_mprotect(p, len, PROT_READ | PROT_WRITE, g->pkey) != 0) {
        kvt__mem_unmap(p, len);
        return KVT_ERR_OUT_OF_MEMORY;
    }
    g->regions[g->n_regions].p = p;
    g->regions[g->n_regions].len = len;
    g->n_regions++;
    *out = p; /* mmap'd anonymous pages are zero */
    return KVT_OK;
}

static void g_buf_free(const kvt__backend *be, void *p, size_t bytes) {
    guard_impl *g = be->impl;
    if (!p)
        return;
    (void)bytes;
    for (uint64_t i = 0; i < g->n_regions; i++) {
        if (g->regions[i].p != p)
            continue;
        const guard_region r = g->regions[i];
        if (g->pkey >= 0) {
            g->regions[i] = g->regions[--g->n_regions];
            kvt__mem_unmap(r.p, r.len);
            return;
        }
        /* release the pages (they read as zero if the range is reused) and close them */
        madvise(r.p, r.len, MADV_DONTNEED);
        mprotect(r.p, r.len, PROT_NONE);
        memmove(&g->regions[i], &g->regions[i + 1],
                sizeof *g->regions * (size_t)(g->n_regions - i - 1));
        g->n_regions--;
        g->arena_hi = g->n_regions == 0 ? 0
                                        : (size_t)((uint8_t *)g->regions[g->n_regions - 1].p -
                                                   g->arena) +
                                              g->regions[g->n_regions - 1].len;
        return;
    }
}

/* Does [p, p + bytes) lie inside one of the backend's buffers? The guarded ops check every
 * pointer their op reads or writes as device memory: a host pointer handed to an op (which a
 * GPU could not dereference) is caught here, not only a host touch of a buffer. */
static bool guard_owns(const guard_impl *g, const void *p, size_t bytes) {
    if (!p)
        return bytes == 0;
    const uint8_t *q = p;
    for (uint64_t i = 0; i < g->n_regions; i++) {
        const uint8_t *b = g->regions[i].p;
        if (q >= b && q < b + g->regions[i].len)
            return bytes <= (size_t)(b + g->regions[i].len - q);
    }
    return false;
}

#define GUARD_OWNS(be, p, bytes)                                                                   \
    do {                                                                                           \
        if (!guard_owns((be)->impl, (p), (bytes))) {                                               \
            (void)kvt__cpu_capturing(be); /* a capture holding a refused op is refused */          \
            return KVT_ERR_INVARIANT;                                                              \
        }                                                                                          \
    } while (0)

/* Pinned host memory (host_alloc): mmap'd pages the host may touch, as a GPU's pinned host
 * memory is; the ops that take an archive accept them (GUARD_REACHES), no other op does. */
static kvt_status g_host_alloc(const kvt__backend *be, size_t bytes, void **out) {
    NOT_CAPTURED(be);
    guard_impl *g = be->impl;
    *out = NULL;
    if (bytes == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    void *arr = g->pinned;
    if (kvt__grow(be->alloc, &arr, &g->pinned_cap, g->n_pinned + 1, sizeof *g->pinned) != KVT_OK)
        return KVT_ERR_OUT_OF_MEMORY;
    g->pinned = arr;
    const size_t len = page_round(bytes);
    void *p = kvt__mem_map(len, PROT_READ | PROT_WRITE, 0);
    if (!p)
        return KVT_ERR_OUT_OF_MEMORY;
    g->pinned[g->n_pinned++] = (guard_region){p, len};
    *out = p; /* zero */
    return KVT_OK;
}

static void g_host_free(const kvt__backend *be, void *p, size_t bytes) {
    guard_impl *g = be->impl;
    (void)bytes;
    for (uint64_t i = 0; p && i < g->n_pinned; i++)
        if (g->pinned[i].p == p) {
            kvt__mem_unmap(p, g->pinned[i].len);
            g->pinned[i] = g->pinned[--g->n_pinned];
            return;
        }
}

static bool pinned_holds(const guard_impl *g, const void *p, size_t bytes) {
    const uint8_t *q = p;
    for (uint64_t i = 0; q && i < g->n_pinned; i++) {
        const uint8_t *b = g->pinned[i].p;
        if (q >= b && q < b + g->pinned[i].len)
            return bytes <= (size_t)(b + g->pinned[i].len - q);
    }
    return false;
}

/* A buffer of the backend's or pinned host memory of its (the archive's two spaces). */
#define GUARD_REACHES(be, p, bytes)                                                                \
    do {                                                                                           \
        if (!guard_owns((be)->impl, (p), (bytes)) && !pinned_holds((be)->impl, (p), (bytes))) {    \
            (void)kvt__cpu_capturing(be);                                                          \
            return KVT_ERR_INVARIANT;                                                              \
        }                                                                                          \
    } while (0)

static kvt_status g_write(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                          void *stream) {
    guard_open(be);
    kvt_status s = kvt__cpu_copy(be, dst, src, bytes, stream);
    guard_close(be);
    return s;
}

static kvt_status g_copy_rows(const kvt__backend *be, void *dst, size_t dst_stride,
                              const void *src, size_t src_stride, size_t width, uint64_t n,
                              void *stream) {
    if (n && width) {
        GUARD_OWNS(be, dst, (size_t)(n - 1) * dst_stride + width);
        GUARD_REACHES(be, src, (size_t)(n - 1) * src_stride + width);
    }
    guard_open(be);
    kvt_status s = kvt__cpu_copy_rows(be, dst, dst_stride, src, src_stride, width, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_score_rows(const kvt__backend *be, const kvt__score_args *args, uint32_t n,
                               void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        const kvt__score_args *a = &args[i];
        GUARD_OWNS(be, a->out, sizeof(float) * a->n_rows);
        if (a->selector != KVT_SELECT_RANDOM) {
            GUARD_OWNS(be, a->base, 1);
            GUARD_OWNS(be, a->pages, sizeof(int32_t));
        }
        if (a->selector == KVT_SELECT_SIGMA)
            GUARD_OWNS(be, a->basis, sizeof(float) * a->n_basis * a->n_rows);
    }
    guard_open(be);
    kvt_status s = kvt__cpu_score_rows(be, args, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_sketch_rows(const kvt__backend *be, const kvt__sketch_args *args, uint32_t n,
                                void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        const kvt__sketch_args *a = &args[i];
        GUARD_REACHES(be, a->base, 1); /* a random-eviction archive's rows may be pinned */
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
        GUARD_OWNS(be, a->basis, sizeof(float) * a->rank * a->latent_dim);
        GUARD_OWNS(be, a->csk, sizeof(uint16_t) * a->csk_stride * a->n_rows);
        GUARD_OWNS(be, a->rho, sizeof(float) * a->n_rows);
    }
    guard_open(be);
    kvt_status s = kvt__cpu_sketch_rows(be, args, n, stream);
    guard_close(be);
    return s;
}

/* Every buffer a scan reads or writes must be the backend's (pdiv is a host value). */
static kvt_status g_scan_owns(const kvt__backend *be, const kvt__recall_scan_args *a,
                              bool rows) {
    const size_t qdim = (size_t)a->latent_dim + a->branch_dim;
    if (rows) {
        GUARD_OWNS(be, a->base, 1);
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
    }
    if (a->n_head > a->n_closed)
        return KVT_ERR_INVALID_ARGUMENT;
    GUARD_OWNS(be, a->csk, sizeof(uint16_t) * a->csk_stride * (a->n_closed - a->n_head));
    GUARD_OWNS(be, a->rho, sizeof(float) * (a->n_closed - a->n_head));
    GUARD_OWNS(be, a->csk_head, sizeof(uint16_t) * a->csk_stride * a->n_head);
    GUARD_OWNS(be, a->rho_head, sizeof(float) * a->n_head);
    GUARD_OWNS(be, a->basis, sizeof(float) * a->rank * a->latent_dim);
    GUARD_OWNS(be, a->kept, sizeof(uint32_t) * a->m);
    GUARD_OWNS(be, a->q, sizeof(float) * qdim * a->n_heads);
    GUARD_OWNS(be, a->best, sizeof(float) * a->n_heads);
    GUARD_OWNS(be, a->fired, sizeof(uint32_t) * a->cap);
    GUARD_OWNS(be, a->n_fired, sizeof(uint32_t));
    GUARD_OWNS(be, a->overflow, sizeof(uint32_t));
    return KVT_OK;
}

static kvt_status g_recall_scan(const kvt__backend *be, const kvt__recall_scan_args *args,
                                uint32_t n, void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        kvt_status s = g_scan_owns(be, &args[i], args[i].n_closed > args[i].sinks);
        if (s != KVT_OK)
            return s;
    }
    guard_open(be);
    kvt_status s = kvt__cpu_recall_scan(be, args, n, stream);
    guard_close(be);
    return s;
}

/* Every buffer a RoPE recall step reads or writes is the backend's (pdiv and the ranks are host
 * values). */
static kvt_status g_rope_owns(const kvt__backend *be, const kvt__recall_rope_args *a) {
    if (!kvt__recall_rope_args_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    const size_t H = a->n_kv, nq = H * a->group;
    if (a->n_rows) {
        GUARD_OWNS(be, a->keys, 1);
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
    }
    if (a->ar_n) {
        GUARD_REACHES(be, a->ar_bytes, a->ar_row_bytes * H * a->ar_cap);
        GUARD_OWNS(be, a->ar_ident, sizeof(int32_t));
        GUARD_OWNS(be, a->csk, sizeof(uint16_t) * a->csk_stride * H * a->ar_cap);
        GUARD_OWNS(be, a->rho, sizeof(float) * H * a->ar_cap);
    }
    if (a->basis)
        GUARD_OWNS(be, a->basis, sizeof(float) * H * a->basis_stride * a->D);
    if (a->ar_n && a->ar_branch)
        GUARD_OWNS(be, a->ar_branch, (size_t)a->ar_branch_bytes * H * a->ar_cap);
    if (a->g_perm && a->g_blocks_cap) { /* the pruned scan's group planes, every head's */
        const size_t slots = H * a->g_blocks_cap, Gs = kvt__recall_group_slots(a->g_B);
        GUARD_OWNS(be, a->g_perm, sizeof(uint32_t) * slots * a->g_B);
        GUARD_OWNS(be, a->g_n, sizeof(uint32_t) * slots);
        GUARD_OWNS(be, a->g_end, sizeof(uint32_t) * slots * Gs);
        GUARD_OWNS(be, a->g_centre, sizeof(float) * slots * Gs * a->g_dim);
        GUARD_OWNS(be, a->g_stat, sizeof(float) * slots * Gs * KVT__RG_STATS);
    }
    GUARD_OWNS(be, a->q, sizeof(float) * nq * (a->D + a->branch_dim));
    GUARD_OWNS(be, a->best, sizeof(float) * nq);
    GUARD_OWNS(be, a->st, sizeof *a->st);
    GUARD_OWNS(be, a->samples, a->samples ? sizeof(float) * a->sample_cap : 0);
    GUARD_OWNS(be, a->fired, sizeof(uint32_t) * H * a->cap);
    GUARD_OWNS(be, a->n_fired, sizeof(uint32_t) * H);
    GUARD_OWNS(be, a->overflow, sizeof(uint32_t) * H);
    GUARD_OWNS(be, a->dense, a->dense ? 1 : 0);
    return KVT_OK;
}

/* The attention's buffers: the rows' plane, the index sets, queries and outputs. */
static kvt_status g_attend(const kvt__backend *be, const kvt__attend_args *a, void *stream) {
    if (!kvt__attend_args_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    const size_t nq = a->n_q, H = a->n_heads;
    if (nq) {
        GUARD_OWNS(be, a->base, 1);
        GUARD_OWNS(be, a->idx, sizeof(int32_t) * nq * a->topk);
        GUARD_OWNS(be, a->len, sizeof(int32_t) * nq);
        GUARD_OWNS(be, a->q, sizeof(float) * ((nq * H - 1) * a->q_stride + a->key_dim));
    }
    GUARD_OWNS(be, a->out, a->out ? sizeof(float) * nq * H * a->value_dim : 0);
    GUARD_OWNS(be, a->lse, a->lse ? sizeof(double) * nq * H : 0);
    guard_open(be);
    /* every listed row inside one of the backend's buffers (lengths checked by kvt__cpu_attend) */
    const size_t row = a->dtype == KVT__DT_FP8 ? KVT__FP8_BRANCH_AT + 2u * (KVT__FP8_KEY_DIM -
                                                                          KVT__FP8_VALUES)
                                               : (size_t)a->key_dim *
                                                     (a->dtype == KVT__DT_FP32 ? 4u : 2u);
    kvt_status s = KVT_OK;
    for (size_t i = 0; i < nq && s == KVT_OK; i++) {
        const int32_t n = a->len[i] < 0 || (uint32_t)a->len[i] > a->topk ? 0 : a->len[i];
        for (int32_t j = 0; j < n && s == KVT_OK; j++) {
            const int32_t slot = a->idx[i * a->topk + (size_t)j];
            if (slot >= 0 &&
                !guard_owns(be->impl, a->base + (size_t)slot * a->slot_stride + a->row_offset, row))
                s = KVT_ERR_INVARIANT;
        }
    }
    if (s == KVT_OK)
        s = kvt__cpu_attend(be, a, stream);
    guard_close(be);
    return s;
}

/* The emission's buffers, all the backend's (fetch slots, lists, planes, archive). */
static kvt_status g_rope_emit_owns(const kvt__backend *be, const kvt__recall_rope_emit_args *a) {
    if (!kvt__recall_rope_emit_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    const size_t H = a->n_kv;
    for (uint32_t p = 0; p < a->n_planes; p++)
        GUARD_OWNS(be, a->plane[p], 1);
    if (a->n_rows)
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
    if (a->ar_n)
        GUARD_REACHES(be, a->ar_bytes, (size_t)a->n_planes * a->row_bytes * H * a->ar_cap);
    GUARD_OWNS(be, a->fired, sizeof(uint32_t) * H * a->cap);
    GUARD_OWNS(be, a->n_fired, sizeof(uint32_t) * H);
    GUARD_OWNS(be, a->st, sizeof *a->st);
    GUARD_OWNS(be, a->fetch_pages,
               sizeof(int32_t) * ((a->fetch_cap + a->pdiv->d - 1) / a->pdiv->d));
    GUARD_OWNS(be, a->indices, sizeof(int32_t) * a->capacity);
    if (a->length)
        GUARD_OWNS(be, a->length, sizeof(int32_t));
    else
        GUARD_OWNS(be, a->indptr, sizeof(int32_t) * (H + 1));
    return KVT_OK;
}

/* A layer's RoPE trigger and emission: the plan image, its items and the query base, then
 * (when they run, not when they are captured) every buffer of each item the plan holds then. */
static kvt_status g_rope_plan_owns(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                   bool emit) {
    const size_t n_max = a->n_max ? a->n_max : 1u;
    GUARD_OWNS(be, emit ? a->n_emit : a->n, sizeof(uint32_t));
    if (emit)
        GUARD_OWNS(be, a->emits, sizeof(kvt__recall_rope_emit_plan_item) * n_max);
    else
        GUARD_OWNS(be, a->items, sizeof(kvt__recall_rope_plan_item) * n_max);
    if (!emit)
        GUARD_OWNS(be, a->query, sizeof(float) * a->query_floats);
    return KVT_OK;
}

static kvt_status g_rope_items(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                 void *stream, bool emit) {
    kvt_status s = g_rope_plan_owns(be, a, emit);
    if (s != KVT_OK)
        return s;
    if (be->cap) /* recorded */
        return emit ? kvt__cpu_recall_rope_emit(be, a, stream)
                    : kvt__cpu_recall_rope_step(be, a, stream);
    guard_open(be);
    const uint32_t n = emit ? *a->n_emit : *a->n;
    s = n > a->n_max ? KVT_ERR_INVALID_ARGUMENT : KVT_OK;
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        kvt__div32 d;
        if (emit) {
            kvt__recall_rope_emit_args x;
            s = kvt__recall_rope_emit_plan_item_args(a, i, &x, &d) ? g_rope_emit_owns(be, &x)
                                                                   : KVT_ERR_INVALID_ARGUMENT;
        } else {
            kvt__recall_rope_args x;
            s = kvt__recall_rope_plan_item_args(a, i, &x, &d) ? g_rope_owns(be, &x)
                                                              : KVT_ERR_INVALID_ARGUMENT;
        }
    }
    if (s == KVT_OK) {
        if (emit)
            G_COUNT(be, rope_emit, n);
        else
            G_COUNT(be, rope_step, n);
        s = emit ? kvt__cpu_recall_rope_emit(be, a, stream)
                 : kvt__cpu_recall_rope_step(be, a, stream);
    }
    guard_close(be);
    return s;
}

static kvt_status g_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                     void *stream) {
    return g_rope_items(be, a, stream, false);
}

static kvt_status g_recall_rope_emit(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                     void *stream) {
    return g_rope_items(be, a, stream, true);
}

/* Every buffer a recall step's work item reads or writes must be the backend's. */
static kvt_status g_step_owns(const kvt__backend *be, const kvt__recall_step_args *a) {
    kvt_status s = g_scan_owns(be, &a->scan, a->n_rows > 0);
    if (s != KVT_OK)
        return s;
    GUARD_OWNS(be, a->st, sizeof *a->st);
    GUARD_OWNS(be, a->samples, sizeof(float) * a->sample_cap);
    GUARD_OWNS(be, a->dense, a->dense ? 1 : 0);
    if (a->promo) {
        GUARD_OWNS(be, a->promo,
                   sizeof *a->promo + 2u * sizeof(uint32_t) * ((size_t)a->cand_cap + a->prom_cap));
        GUARD_OWNS(be, a->scan.fired, sizeof(uint32_t) * ((size_t)a->scan.cap + a->prom_cap));
    }
    if (a->g_perm) {
        const uint64_t nb = a->g_blocks_cap, G = a->block_rows / 32u;
        GUARD_OWNS(be, a->g_perm, sizeof(uint32_t) * nb * a->block_rows);
        GUARD_OWNS(be, a->g_n, sizeof(uint32_t) * nb);
        GUARD_OWNS(be, a->g_end, sizeof(uint32_t) * nb * G);
        GUARD_OWNS(be, a->g_centre, sizeof(float) * nb * G * a->g_dim);
        GUARD_OWNS(be, a->g_stat, sizeof(float) * nb * G * 5u);
    }
    return KVT_OK;
}

/* A layer's recall step: the plan image and the query base, then (when it runs, not when it is
 * captured) every buffer of each item the plan holds then. */
static kvt_status g_recall_step(const kvt__backend *be, const kvt__recall_plan_args *a,
                                void *stream) {
    GUARD_OWNS(be, a->n, sizeof(uint32_t));
    GUARD_OWNS(be, a->items, sizeof(kvt__recall_plan_item) * (a->n_max ? a->n_max : 1u));
    GUARD_OWNS(be, a->query, sizeof(float) * a->query_floats);
    if (be->cap)
        return kvt__cpu_recall_step(be, a, stream); /* recorded */
    guard_open(be);
    const uint32_t n = *a->n;
    kvt_status s = n > a->n_max ? KVT_ERR_INVALID_ARGUMENT : KVT_OK;
    if (s == KVT_OK)
        G_COUNT(be, recall_step, n);
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        kvt__recall_step_args x;
        kvt__div32 d;
        s = kvt__recall_plan_item_args(a, i, &x, &d) ? g_step_owns(be, &x)
                                                    : KVT_ERR_INVALID_ARGUMENT;
        const size_t qf = (size_t)x.scan.n_heads * (x.scan.latent_dim + x.scan.branch_dim);
        if (s == KVT_OK && a->items[i].lag && !guard_owns(be->impl, a->items[i].lag,
                                                            sizeof(float) * qf))
            s = KVT_ERR_INVARIANT; /* the lagged query's buffer is the backend's too */
    }
    if (s == KVT_OK)
        s = kvt__cpu_recall_step(be, a, stream);
    guard_close(be);
    return s;
}

/* Every buffer of a round's layers must be the backend's. */
static kvt_status g_ev_owns(const kvt__backend *be, const kvt__ev_args *a, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        const kvt__ev_args *x = &a[i];
        for (uint32_t p = 0; p < x->n_planes; p++)
            GUARD_OWNS(be, x->plane[p], 1);
        GUARD_OWNS(be, x->pages, sizeof(int32_t));
        GUARD_OWNS(be, x->pos, sizeof(int64_t) * x->n_heads * x->pos_cap);
        GUARD_OWNS(be, x->keep, sizeof(uint32_t) * x->n_heads * x->K);
        GUARD_OWNS(be, x->map, sizeof(int32_t) * x->n_heads * x->N);
        if (x->ar_bytes) {
            GUARD_REACHES(be, x->ar_bytes,
                          (size_t)x->n_heads * x->ar_cap * x->n_planes * x->row_bytes);
            GUARD_OWNS(be, x->ar_pos, sizeof(int64_t) * x->n_heads * x->ar_cap);
            GUARD_OWNS(be, x->ar_by_pos, sizeof(uint64_t) * x->n_heads * x->ar_cap);
        }
    }
    return KVT_OK;
}

/* A round's op on the guarded backend: every buffer checked, then the CPU op unguarded. */
static kvt_status g_ev_call(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                            void *stream,
                            kvt_status (*op)(const kvt__backend *, const kvt__ev_args *, uint32_t,
                                             void *)) {
    kvt_status s = g_ev_owns(be, a, n);
    if (s != KVT_OK)
        return s;
    guard_open(be);
    s = op(be, a, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_ev_select(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                              void *stream) {
    return g_ev_call(be, a, n, stream, kvt__cpu_ev_select);
}

static kvt_status g_ev_apply(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                             void *stream) {
    return g_ev_call(be, a, n, stream, kvt__cpu_ev_apply);
}

static kvt_status g_ev_append(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                              void *stream) {
    for (uint32_t i = 0; i < n; i++)
        GUARD_OWNS(be, a[i].pos, sizeof(int64_t) * a[i].n_heads * a[i].pos_cap);
    guard_open(be);
    kvt_status s = kvt__cpu_ev_append(be, a, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_find_pos(const kvt__backend *be, const int64_t *sorted, const uint64_t *perm,
                             uint64_t n, uint64_t key, int64_t *out) {
    GUARD_OWNS(be, sorted, sizeof(int64_t) * n);
    GUARD_OWNS(be, perm, perm ? sizeof(uint64_t) * n : 0);
    guard_open(be);
    kvt_status s = kvt__cpu_find_pos(be, sorted, perm, n, key, out);
    guard_close(be);
    return s;
}

static kvt_status g_select(const kvt__backend *be, kvt__select_args *a, uint32_t n,
                           void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        if (a[i].n_head > a[i].n_closed)
            return KVT_ERR_INVALID_ARGUMENT;
        GUARD_OWNS(be, a[i].score, sizeof(float) * (a[i].n_closed - a[i].n_head));
        GUARD_OWNS(be, a[i].score_head, sizeof(float) * a[i].n_head);
        GUARD_OWNS(be, a[i].kept, sizeof(uint32_t) * a[i].m);
    }
    guard_open(be);
    kvt_status s = kvt__cpu_select(be, a, n, stream);
    guard_close(be);
    return s;
}

/* What query q of a pack reads and writes, inside the backend's buffers. */
static kvt_status g_pack_owns(const kvt__backend *be, const kvt__pack_args *a,
                              const kvt__pack_query *q) {
    const bool recall = q->fetch || q->n_fetch || q->dense || q->all_rows;
    if (q->paged &&
        (q->fetch || q->n_fetch || q->dense || q->d.n_list || !a->csr || !a->last_page_len))
        return KVT_ERR_INVALID_ARGUMENT; /* a paged set is whole pages, in a CSR */
    /* The most it can write: every row of the view with recall (the count is the backend's). */
    uint64_t count = q->paged ? kvt__paged_count(&q->d, a->pdiv)
                     : recall ? q->d.hi_end
                              : kvt__attended_desc_count(&q->d);
    if (count)
        GUARD_OWNS(be, q->pages, sizeof(int32_t));
    if (q->d.n_list)
        GUARD_OWNS(be, q->d.list, sizeof(uint32_t) * q->d.n_list);
    if (q->n_fetch) {
        GUARD_OWNS(be, q->n_fetch, sizeof(uint32_t));
        GUARD_OWNS(be, q->fetch, sizeof(uint32_t) * (q->fetch_cap ? q->fetch_cap : 1u));
    }
    if (q->dense)
        GUARD_OWNS(be, q->dense, sizeof(uint32_t));
    uint64_t w = count > q->pad ? count : q->pad;
    if (a->csr) { /* where it starts is the backend's too */
        GUARD_OWNS(be, a->indices, sizeof(int32_t) * a->capacity);
        GUARD_OWNS(be, a->indptr + q->len_at - 1, sizeof(int32_t));
    } else if (w) {
        GUARD_OWNS(be, a->indices + q->out, sizeof(int32_t) * w);
    }
    if (a->csr || q->len_at != KVT__NO_LENGTH)
        GUARD_OWNS(be, a->csr ? a->indptr + q->len_at : a->lengths + q->len_at, sizeof(int32_t));
    if (q->paged)
        GUARD_OWNS(be, a->last_page_len + q->len_at - 1, sizeof(int32_t));
    return KVT_OK;
}

/* A pack: the plan image's, then (when it runs, not when it is captured) each query the image
 * holds then. */
static kvt_status g_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream) {
    g_count(be, &((guard_impl *)be->impl)->calls.pack, NULL, 0);
    GUARD_OWNS(be, a->n_plan, sizeof(uint32_t));
    GUARD_OWNS(be, a->q_plan, sizeof(kvt__pack_query) * (a->n_max ? a->n_max : 1u));
    if (a->dense_out)
        GUARD_OWNS(be, a->dense_out,
                   (a->n_max + (a->dense_stride ? a->dense_stride : 1u) - 1) /
                       (a->dense_stride ? a->dense_stride : 1u));
    if (a->csr && a->first_csr)
        GUARD_OWNS(be, a->indptr, sizeof(int32_t));
    if (be->cap)
        return kvt__cpu_pack(be, a, stream); /* recorded */
    guard_open(be);
    const uint32_t n = *a->n_plan;
    kvt_status s = n > a->n_max ? KVT_ERR_INVALID_ARGUMENT : KVT_OK;
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        const kvt__pack_query *q = &a->q_plan[i];
        s = g_pack_owns(be, a, q);
    }
    if (s == KVT_OK)
        s = kvt__cpu_pack(be, a, stream);
    guard_close(be);
    return s;
}

static bool g_holds(const kvt__backend *be, const void *p, size_t bytes) {
    return guard_owns(be->impl, p, bytes);
}

static const kvt__backend_ops guarded_ops_table = {
    .name = "guarded",
    .close = kvt__backend_cpu_close, /* which closes the guard too */
    .scratch_reserve = kvt__backend_cpu_reserve,
    .buf_alloc = g_buf_alloc,
    .buf_free = g_buf_free,
    .host_alloc = g_host_alloc,
    .host_free = g_host_free,
    .write = g_write,
    .read = g_write,
    .host_visible = false,
    .score_rows = g_score_rows,
    .sketch_rows = g_sketch_rows,
    .recall_scan = g_recall_scan,
    .recall_step = g_recall_step,
    .recall_promote = true,
    .recall_scan_q8 = true,
    .recall_rope_step = g_recall_rope_step,
    .recall_rope_emit = g_recall_rope_emit,
    .attend = g_attend,
    .pack = g_pack,
    .copy = g_write,
    .copy_rows = g_copy_rows,
    .select = g_select,
    .ev_select = g_ev_select,
    .ev_apply = g_ev_apply,
    .ev_append = g_ev_append,
    .find_pos = g_find_pos,
    .capture_begin = kvt__cpu_capture_begin,
    .capture_end = kvt__cpu_capture_end,
    .graph_launch = kvt__cpu_graph_launch,
    .graph_free = kvt__cpu_graph_free,
    .holds = g_holds,
};

/* Without a protection key: the largest arena from GUARD_ARENA_MAX down to GUARD_ARENA_MIN that
 * maps (PROT_NONE, reserved address space only). A failed size is absorbed by the next smaller
 * one; g->arena stays NULL when none maps. Its own function so that its mappings are a seam site
 * of their own (tests/test_seams.c lists them as absorbed where the CPU has no keys). */
static void guard_arena_map(guard_impl *g) {
    for (size_t len = GUARD_ARENA_MAX; len >= GUARD_ARENA_MIN && !g->arena; len /= 2) {
        void *a = kvt__mem_map(len, PROT_NONE, MAP_NORESERVE);
        if (a) {
            g->arena = a;
            g->arena_len = len;
        }
    }
}

kvt_status kvt__backend_guarded_open(kvt__backend *be, char *err, size_t err_len) {
    guard_impl *g = kvt__calloc(be->alloc, sizeof *g);
    if (!g)
        return kvt__fail(err, err_len, KVT_ERR_OUT_OF_MEMORY, "guarded backend");
    /* A key denies access to the calling thread at once; other threads start with every key but 0
     * denied. Sixteen keys exist per process: without one, fall back to mprotect. */
    g->pkey = pkey_alloc(0, PKEY_DISABLE_ACCESS);
    if (g->pkey < 0) {
        guard_arena_map(g);
        if (!g->arena) {
            kvt__free(be->alloc, g, sizeof *g);
            return kvt__fail(err, err_len, KVT_ERR_OUT_OF_MEMORY,
                             "guarded backend: no protection keys, and no address space for its "
                             "%zu-MiB arena", GUARD_ARENA_MIN >> 20);
        }
        /* A toggle rewrites the protection of every page table entry in use: on 2-MiB pages
         * there are 512x fewer (advice; without THP nothing changes). */
#ifdef MADV_HUGEPAGE
        (void)madvise(g->arena, g->arena_len, MADV_HUGEPAGE);
#endif
    }
    be->impl = g;
    be->ops = &guarded_ops_table;
    return KVT_OK;
}

void kvt__guarded_close(kvt__backend *be) {
    guard_impl *g = be->impl;
    if (g->arena)
        kvt__mem_unmap(g->arena, g->arena_len);
    else
        for (uint64_t i = 0; i < g->n_regions; i++)
            kvt__mem_unmap(g->regions[i].p, g->regions[i].len);
    kvt__free(be->alloc, g->regions, sizeof *g->regions * g->regions_cap);
    for (uint64_t i = 0; i < g->n_pinned; i++)
        kvt__mem_unmap(g->pinned[i].p, g->pinned[i].len);
    kvt__free(be->alloc, g->pinned, sizeof *g->pinned * g->pinned_cap);
    if (g->pkey >= 0)
        pkey_free(g->pkey);
    kvt__free(be->alloc, g->ws.sigma, sizeof *g->ws.sigma * g->ws.sigma_cap);
    kvt__free(be->alloc, g->ws.topm, sizeof *g->ws.topm * g->ws.topm_cap);
    kvt__free(be->alloc, g, sizeof *g);
    be->impl = NULL;
}
