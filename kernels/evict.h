/*
 * evict.h — the data-parallel half of a random-eviction round (tiers/evict.c decides when and
 * keeps the counts; these compute on the backend's memory). One kvt__ev_args describes one layer
 * of one request; the backend's ev_select / ev_apply take an array of them, so a commit runs one
 * call for every layer of a group. Every pointer in it is backend memory; the host never reads
 * the positions, keep sets, slot maps or archive except through synchronising inspection calls.
 *
 * The round over rows [0, N) of the layer (every head holds N): candidates are [0, cand),
 * cand = N - r; per head h the K kept candidates are
 *   the protected prefix (positions below L: rows [0, f)),
 *   with vase, the top min(K/4, K - f) others by value range (kvt__score_key, ties to the lower
 *   row),
 *   the rest by the largest Philox draws at the rows' positions (ties to the lower position),
 * written ascending to keep[h][0..K). Apply then archives (or drops) each head's other
 * candidates, moves its survivors — the K kept, then the r recent — to rows [0, K + r) in
 * chronological order, rewrites its positions and writes its slot map (old row -> new row or -1).
 */
#ifndef KVT_KERNELS_EVICT_H
#define KVT_KERNELS_EVICT_H

#include "kernels/kvt_hd.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt__ev_args {
    /* The layer's rows: planes [page][row][head][row_bytes], page table mirror. */
    uint8_t *plane[2];
    uint32_t n_planes;
    size_t slot_bytes; /* n_heads * row_bytes */
    uint32_t row_bytes;
    uint32_t n_heads;
    int dtype;          /* KVT_DTYPE_*, for the value range */
    uint32_t value_dim; /* values of a row VaSE ranges over */
    uint32_t value_plane;
    const int32_t *pages;
    uint64_t first_page;
    const kvt__div32 *pdiv; /* page_rows */
    /* The layer's state. */
    int64_t *pos;   /* [n_heads][pos_cap]: original position at each row index */
    uint64_t pos_cap;
    uint32_t *keep; /* [n_heads][K] */
    int32_t *map;   /* [n_heads][N] */
    uint8_t *ar_bytes;   /* [n_heads][ar_cap][n_planes][row_bytes]; NULL: evicted rows drop */
    int64_t *ar_pos;     /* [n_heads][ar_cap] positions in order of archiving */
    uint64_t *ar_by_pos; /* [n_heads][ar_cap] indices into ar_pos, sorted by position */
    uint64_t ar_n, ar_cap; /* every head archives the same count */
    /* The round. */
    uint64_t N, K, r, L;
    bool vase;
    uint64_t philox_key;
    uint32_t round;       /* rounds this layer ran before */
    uint32_t layer;       /* global layer id */
    uint32_t head_offset; /* global id of head 0 */
    bool shared_draw;     /* every head draws with global head 0's stream */
} kvt__ev_args;

/* Host scratch bytes one layer's selection needs (cand = N - r candidates, K kept). */
size_t kvt__ev_select_scratch_bytes(uint64_t cand, uint64_t K);
/* Choose every head's keep set (reads rows, positions; writes keep). */
void kvt__ev_select_cpu(const kvt__ev_args *a, void *scratch);
/* Archive or drop, compact, rewrite positions, write the slot maps (after kvt__ev_select_cpu). */
void kvt__ev_apply_cpu(const kvt__ev_args *a);
/* New rows' positions of one layer of one request: first_pos + i at rows first_row + i,
 * i < n, of every head. */
typedef struct kvt__ev_append_args {
    int64_t *pos; /* [n_heads][pos_cap] */
    uint64_t pos_cap;
    uint32_t n_heads;
    uint64_t first_row, first_pos, n;
} kvt__ev_append_args;

void kvt__ev_append_cpu(const kvt__ev_append_args *a);
/* Index i < n with sorted[perm ? perm[i] : i] == key (sorted ascending through perm), returned
 * as perm[i] (or i); -1 when absent. */
KVT_HD int64_t kvt__find_pos(const int64_t *sorted, const uint64_t *perm, uint64_t n,
                             uint64_t key) {
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if ((uint64_t)sorted[perm ? perm[mid] : mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < n && (uint64_t)sorted[perm ? perm[lo] : lo] == key)
        return (int64_t)(perm ? perm[lo] : lo);
    return -1;
}

#endif
