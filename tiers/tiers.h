/*
 * tiers.h — the row pool, the layers' storage, page tables and what tier code needs from the
 * context (kvt__env). Internal to the library.
 *
 * Ownership: lib/ owns the context and sequence handles and validates everything from outside;
 * tiers/ owns page allocation, page tables and the tier state machines (salience tiering, random
 * eviction), reached from lib/ through one table per policy (policy.h), and never reads queries;
 * kernels/ computes (through the backend table). The state machines' state (kvt__sal, kvt__ev) is
 * tiers/'s own: tiers_internal.h, which lib/ does not include.
 *
 * Positions and row indices. A sequence's tokens have original positions 0, 1, 2, ... . Each
 * policy group has a page table per sequence whose row index i maps to the slot
 *     slot(i) = pages[i / page_rows] * page_rows + i % page_rows
 * in every layer of the group. Salience and none groups never move rows, so row index =
 * position. Evict groups compact: after a round, row index i holds, for KV head h, the original
 * position pos[h][i] (ascending in i, different per head).
 *
 * Recycled leading pages. A none group whose layers are all sliding-window layers only ever
 * attends its last W rows (W = the largest window in the group), so after each commit the pages
 * whose rows all lie before n_rows - W go back to the pool (sliding.c). Row indices keep meaning
 * positions; the table remembers how many leading pages it gave back (first_page) and holds only
 * the live ones, so pages[k] is the page of rows [(first_page + k) * page_rows, ...). Every other
 * group keeps first_page = 0, where this reduces to the plain table above.
 */
#ifndef KVT_TIERS_TIERS_H
#define KVT_TIERS_TIERS_H

#include "kernels/backend.h"
#include "kernels/kvt_hd.h"
#include "lib/base/alloc.h"
#include "lib/base/base.h"
#include "kvtier.h"

/* ------------------------------------------------------------------------------------------- */
/* Page allocator: one per policy group. A stack of free page ids.                              */
/* ------------------------------------------------------------------------------------------- */
typedef struct kvt__pool {
    uint32_t n_pages, page_rows;
    uint32_t n_free;
    uint32_t *free_ids; /* [n_pages]; free_ids[0..n_free) are free */
    /* [n_pages] how many page tables hold each page (0: free). A page held by more than one
     * (kvt_seq_fork) is read-only: whoever writes into it copies it first (kvt__ptable_own). */
    uint32_t *refs;
    uint64_t shared; /* pages with refs > 1 */
} kvt__pool;

/* A page a table lets go: back to the free list when no other table holds it. */
static inline void kvt__pool_put(kvt__pool *p, uint32_t page) {
    KVT_ASSERT(p->refs[page] > 0);
    if (--p->refs[page] == 0)
        p->free_ids[p->n_free++] = page;
    else if (p->refs[page] == 1)
        p->shared--;
}

/* A page another table takes too (sharing). */
static inline void kvt__pool_share(kvt__pool *p, uint32_t page) {
    KVT_ASSERT(p->refs[page] > 0);
    if (p->refs[page]++ == 1)
        p->shared++;
}

/* Random eviction's K for a request of `rows` tokens (after its step) with prompt_rows, under
 * config.evict_ratio_budget (kvtier.h): max(recent_rows, P + ceil((rows - P) / cfg->ratio)),
 * P = min(prompt_rows, rows) when protect_prompt (else 0), at most 2^28. */
uint32_t kvt__ev_ratio_budget(const kvt_config *cfg, uint64_t rows, uint64_t prompt_rows);
kvt_status kvt__pool_init(kvt__pool *p, const kvt__alloc *a, uint32_t n_pages, uint32_t page_rows);
void kvt__pool_fini(kvt__pool *p, const kvt__alloc *a);

/* A salience layer's recall basis (kvt_ctx_set_recall_basis): rank orthonormal rows of
 * value_dim fp32 in the backend's memory, which the sketch op reads; id = CRC-32 of its bytes.
 * rank 0: no basis (empty sketches, ρ = the latent's norm). */
typedef struct kvt__rbasis {
    float *V;      /* backend: [rank][value_dim] */
    uint32_t rank;
    uint32_t id;
    float omega;   /* ‖V Vᵀ − I‖_F, rounded up (sound mode: <= KVT__SOUND_MAX_OMEGA) */
} kvt__rbasis;

/* The largest ‖V Vᵀ − I‖_F sound recall accepts: 2^-20, which the sound margin's relative slack
 * of 2^-8 covers (docs/recall.md §3.1; an fp32 rounding of an orthonormal basis measures
 * 1e-7 to 2e-7 at rank 16 to 128). */
#define KVT__SOUND_MAX_OMEGA 9.5367431640625e-7f

/* One layer's storage: planes laid out [page][row][head][row_bytes]. */
typedef struct kvt__store {
    kvt_layer_spec spec;
    uint32_t layer;     /* model layer index */
    int32_t group;      /* policy group, -1 for no-KV */
    size_t slot_bytes;  /* n_kv_heads * row_bytes: one slot of one plane */
    size_t plane_bytes; /* n_pages * page_rows * slot_bytes */
    uint8_t *plane[2];
    bool owned[2];      /* allocated by kvtier (vs bound by the engine) */
    kvt__rbasis rbasis; /* salience layers of a context with recall sketches */
    /* Per-KV-head key bases of an evict (GQA/MHA-RoPE, MLA-RoPE) layer whose archive is
     * sketched (kvt_ctx_set_recall_head_basis; docs/recall.md §9): V is one backend buffer
     * [n_kv_heads][kb_stride][D] fp32 (D = kvt__ev_key_dim; NULL until the first head's basis),
     * kb_rank, kb_id and kb_omega (‖V Vᵀ − I‖_F, what sound mode checks) host arrays
     * [n_kv_heads] (rank 0: that head has none: empty sketches, ρ = ‖k‖). */
    float *kb_V;
    uint32_t kb_stride;
    uint32_t *kb_rank, *kb_id;
    float *kb_omega;
} kvt__store;

/* Page table of one sequence in one group. */
typedef struct kvt__ptable {
    int32_t *pages;        /* [n_pages] live pages; pages[k] is page index first_page + k */
    uint64_t cap;          /* capacity of pages[] */
    uint32_t n_pages;      /* live pages held */
    uint64_t n_rows;       /* committed rows (per head); row indices [0, n_rows) */
    uint32_t n_pending;    /* reserved rows after n_rows */
    uint64_t first_page;   /* leading pages already returned to the pool (recycled groups) */
    uint64_t dropped_rows; /* rows in those pages, counted as they go (= first_page * page_rows;
                            * kept apart so that the commit check compares two counters) */
    /* The table's mirror in the backend's memory space, which the backend's ops (pack, value
     * range, eviction rounds, σ) read: dpages[0 .. dsynced) equal pages[0 .. dsynced). Grown at
     * reserve (kvt__ptable_mirror_reserve, may fail), brought up to date on the step's stream
     * before an op reads it (kvt__ptable_mirror_sync: only the pages taken since, O(1) per
     * decode step). */
    int32_t *dpages;
    uint64_t dcap;
    uint32_t dsynced;
} kvt__ptable;

/* Slot of row index `row`, which must lie in a live page (row >= first_page * page_rows). The
 * page size is divided by its precomputed inverse (kvt__div32): no hardware division per row. */
static inline int32_t kvt__slot(const kvt__ptable *t, const kvt__div32 *pr, uint64_t row) {
    KVT_ASSERT(row <= UINT32_MAX);
    KVT_ASSERT(kvt__div32_q(pr, (uint32_t)row) >= t->first_page &&
               kvt__div32_q(pr, (uint32_t)row) - t->first_page < t->n_pages);
    return kvt__page_slot(t->pages, t->first_page, pr, (uint32_t)row);
}

/* First row index still held (rows before it left with their pages). */
static inline uint64_t kvt__ptable_first_row(const kvt__ptable *t, uint32_t page_rows) {
    return t->first_page * page_rows;
}

/* Pages needed to hold `rows` rows. */
static inline uint32_t kvt__pages_for(uint64_t rows, uint32_t page_rows) {
    return (uint32_t)((rows + page_rows - 1) / page_rows);
}

/* Live pages a table needs to hold row indices [first_page * page_rows, rows). */
static inline uint64_t kvt__ptable_pages_for(const kvt__ptable *t, uint64_t rows,
                                             uint32_t page_rows) {
    uint64_t total = (rows + page_rows - 1) / page_rows;
    return total > t->first_page ? total - t->first_page : 0;
}

/* Take pages so the table holds n_rows + n_pending + extra rows: all or nothing
 * (KVT_ERR_POOL_EXHAUSTED, KVT_ERR_OUT_OF_MEMORY leave both unchanged). */
kvt_status kvt__ptable_reserve(kvt__ptable *t, kvt__pool *p, const kvt__alloc *a, uint32_t extra);
/* Return pages beyond what n_rows + n_pending rows need. */
void kvt__ptable_trim(kvt__ptable *t, kvt__pool *p);
/* Return to the pool every leading page whose rows all lie before row index `keep_from`
 * (keep_from <= n_rows), advancing first_page and dropped_rows. Allocates nothing, cannot
 * fail; returns the pages given back. */
uint32_t kvt__ptable_release_front(kvt__ptable *t, kvt__pool *p, uint64_t keep_from);
/* Return every live page and free the table and its mirror (allocated from `be`). */
void kvt__ptable_fini(kvt__ptable *t, kvt__pool *p, const kvt__alloc *a, const kvt__backend *be);
/* Grow the mirror to hold `pages` live pages (after kvt__ptable_reserve: t->n_pages; at
 * creation: a stated limit's): KVT_OK or KVT_ERR_OUT_OF_MEMORY with the table unchanged. */
kvt_status kvt__ptable_mirror_reserve(kvt__ptable *t, const kvt__backend *be, uint64_t pages);
/* Write the pages taken since the last sync into the mirror, on the stream (`be`: any handle on
 * the backend that allocated the mirror). */
kvt_status kvt__ptable_mirror_sync(kvt__ptable *t, const kvt__backend *be, void *stream);

/* What tier code needs from the context and sequence. */
typedef struct kvt__env {
    const kvt__alloc *alloc;
    const kvt__backend *backend; /* the ops of this call (a batch's: its own workspace) */
    const kvt__backend *home;    /* the context's: buffers that outlive the call (side planes) */
    const kvt_config *cfg;
    uint32_t page_rows;
    const kvt__div32 *pdiv; /* page_rows as a divider (kvt__slot) */
    uint64_t philox_key; /* kvt__philox_key(seed, request_id) */
    /* Tensor / pipeline parallelism: a rank's local layer l and KV head h are global layer
     * l + layer_offset and head h + head_offset; every random draw is keyed by the global ids so
     * every rank decides alike (kvt_ctx_params). */
    uint32_t layer_offset, head_offset;
    /* Stated limit on a request's tokens (kvt_ctx_params.max_rows_per_seq; 0: none): per-request
     * state is sized for it at creation so that no step allocates. */
    uint64_t max_rows;
    /* Stated limit of the eviction archive per (layer, KV head) (archive_rows_per_seq; 0: none). */
    uint64_t archive_rows;
    /* The archive's rows in pinned host memory (kvt_ctx_params.archive_space HOST). */
    bool archive_host;
    /* fp16 values per row of the recall sketch planes (kvt_ctx_params.recall_sketch_rank; 0: no
     * sketches are built). */
    uint32_t sketch_stride;
    /* params.recall_scan_bits: 8 adds an 8-bit plane to each salience sketch row (16: none). */
    uint32_t scan_bits;
    void *stream;
    char *err;           /* detail message buffer (the calling thread's, kvt_last_error) */
    size_t err_len;
} kvt__env;

#endif
