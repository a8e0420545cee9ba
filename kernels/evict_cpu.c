/* evict_cpu.c — the CPU reference of a random-eviction round's data-parallel half (evict.h). The
 * decisions are those tiers/evict.c made on the host before Core v2 part 2, bit for bit (the
 * goldens hold them). */
#include "kernels/evict.h"

#include "kernels/philox.h"
#include "kernels/topm.h"
#include "lib/base/base.h"

#include <math.h>
#include <string.h>

/* The selection's scratch, carved from one piece. */
typedef struct sel_scratch {
    uint32_t *keys; /* [cand] draws or value-range keys */
    uint32_t *ridx; /* [cand] row index of each entry of keys */
    int64_t *rpos;  /* [cand] positions of the rows drawn for */
    uint32_t *sel;  /* [K] top-m output */
    uint32_t *topm; /* top-m histogram */
    uint8_t *mark;  /* [cand] kept candidate */
} sel_scratch;

static size_t align8(size_t n) {
    return (n + 7) / 8 * 8;
}

size_t kvt__ev_select_scratch_bytes(uint64_t cand, uint64_t K) {
    return align8(sizeof(int64_t) * cand) + align8(sizeof(uint32_t) * cand) * 2 +
           align8(sizeof(uint32_t) * K) +
           align8(sizeof(uint32_t) * kvt__topm_scratch_u32((uint32_t)cand)) + align8(cand);
}

static sel_scratch carve(void *p, uint64_t cand, uint64_t K) {
    uint8_t *b = p;
    sel_scratch s;
    s.rpos = (int64_t *)b;
    b += align8(sizeof(int64_t) * cand);
    s.keys = (uint32_t *)b;
    b += align8(sizeof(uint32_t) * cand);
    s.ridx = (uint32_t *)b;
    b += align8(sizeof(uint32_t) * cand);
    s.sel = (uint32_t *)b;
    b += align8(sizeof(uint32_t) * K);
    s.topm = (uint32_t *)b;
    b += align8(sizeof(uint32_t) * kvt__topm_scratch_u32((uint32_t)cand));
    s.mark = b;
    return s;
}

/* VaSE's key of row `row` of head h: the range (max - min) of its first value_dim values in the
 * value plane, NaN when one is NaN (kvt__score_key ranks NaN with +Inf: a broken row is kept). */
static uint32_t value_key(const kvt__ev_args *a, uint32_t h, uint32_t row) {
    int32_t slot = kvt__page_slot(a->pages, a->first_page, a->pdiv, row);
    const uint8_t *p =
        a->plane[a->value_plane] + (size_t)slot * a->slot_bytes + (size_t)h * a->row_bytes;
    float lo = INFINITY, hi = -INFINITY;
    bool nan = false;
    for (uint32_t v = 0; v < a->value_dim; v++) {
        float x = kvt__load_elem(p, a->dtype, v);
        if (x != x)
            nan = true;
        lo = x < lo ? x : lo;
        hi = x > hi ? x : hi;
    }
    return kvt__score_key(nan ? NAN : hi - lo);
}

static void select_head(const kvt__ev_args *a, uint32_t h, sel_scratch *s) {
    const uint64_t K = a->K, cand = a->N - a->r;
    const int64_t *P = a->pos + (size_t)h * a->pos_cap;
    uint32_t *out = a->keep + (size_t)h * K;
    /* Protected prefix: positions below L. Positions ascend, so it is a prefix of row indices
     * (every such row is present: no round ever evicted one). */
    uint64_t f = 0;
    while (f < cand && (uint64_t)P[f] < a->L)
        f++;
    memset(s->mark, 0, cand);
    memset(s->mark, 1, f);
    uint64_t taken = f;
    if (a->vase) {
        uint64_t m_v = K / 4;
        if (m_v > K - taken)
            m_v = K - taken;
        if (m_v > 0) {
            for (uint64_t i = f; i < cand; i++)
                s->keys[i - f] = value_key(a, h, (uint32_t)i);
            kvt__topm_u32(s->keys, (uint32_t)(cand - f), (uint32_t)m_v, s->sel, s->topm);
            for (uint64_t j = 0; j < m_v; j++)
                s->mark[f + s->sel[j]] = 1;
            taken += m_v;
        }
    }
    /* Uniform fill: the largest draws among the unmarked candidates. */
    uint64_t n_rest = 0;
    for (uint64_t i = f; i < cand; i++) {
        if (s->mark[i])
            continue;
        s->ridx[n_rest] = (uint32_t)i;
        s->rpos[n_rest] = P[i];
        n_rest++;
    }
    uint64_t m_r = K - taken;
    if (m_r > 0) {
        /* Global ids (tensor/pipeline parallel ranks draw alike); the shared draw is one draw
         * for every head of the layer on every rank: global head 0. */
        uint32_t draw_head = a->shared_draw ? 0 : h + a->head_offset;
        uint64_t subseq = kvt__philox_subseq(a->round, a->layer, draw_head);
        kvt__philox_draws_cpu(a->philox_key, subseq, s->rpos, (size_t)n_rest, s->keys);
        kvt__topm_u32(s->keys, (uint32_t)n_rest, (uint32_t)m_r, s->sel, s->topm);
        for (uint64_t j = 0; j < m_r; j++)
            s->mark[s->ridx[s->sel[j]]] = 1;
    }
    uint64_t k = 0;
    for (uint64_t i = 0; i < cand; i++)
        if (s->mark[i])
            out[k++] = (uint32_t)i;
    KVT_ASSERT(k == K);
}

void kvt__ev_select_cpu(const kvt__ev_args *a, void *scratch) {
    sel_scratch s = carve(scratch, a->N - a->r, a->K);
    for (uint32_t h = 0; h < a->n_heads; h++)
        select_head(a, h, &s);
}

/* Copy head h's evicted candidates (every row in [0, cand) not in its keep set) into its
 * archive, all planes, and merge them into the by-position index. */
static void archive_head(const kvt__ev_args *a, uint32_t h) {
    const uint64_t K = a->K, cand = a->N - a->r;
    const uint32_t *keep = a->keep + (size_t)h * K;
    const int64_t *P = a->pos + (size_t)h * a->pos_cap;
    const size_t row_all = (size_t)a->n_planes * a->row_bytes;
    uint8_t *bytes = a->ar_bytes + (size_t)h * a->ar_cap * row_all;
    int64_t *apos = a->ar_pos + (size_t)h * a->ar_cap;
    uint64_t *by_pos = a->ar_by_pos + (size_t)h * a->ar_cap;
    const uint64_t n_old = a->ar_n;
    uint64_t n = n_old, k = 0;
    for (uint64_t i = 0; i < cand; i++) {
        if (k < K && keep[k] == i) {
            k++;
            continue;
        }
        size_t off = (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)i) *
                         a->slot_bytes +
                     (size_t)h * a->row_bytes;
        uint8_t *d = bytes + (size_t)n * row_all;
        for (uint32_t p = 0; p < a->n_planes; p++)
            memcpy(d + (size_t)p * a->row_bytes, a->plane[p] + off, a->row_bytes);
        apos[n] = P[i];
        n++;
    }
    /* The new entries n_old..n-1 ascend by position; merge them into by_pos from the back (in
     * place, no scratch). An old row kept in earlier rounds can be archived after newer ones,
     * so the two runs interleave. */
    uint64_t i = n_old, j = n - n_old, w = n;
    while (j > 0) {
        if (i > 0 && apos[by_pos[i - 1]] > apos[n_old + j - 1])
            by_pos[--w] = by_pos[--i];
        else
            by_pos[--w] = n_old + --j;
    }
}

/* Old row index of new row index j: the K kept candidates, then the r recent rows. */
static uint64_t old_row(const uint32_t *keep, uint64_t K, uint64_t cand, uint64_t j) {
    return j < K ? keep[j] : cand + (j - K);
}

/* A hint to bring the line at p into the cache for reading (nothing without GCC or Clang). The
 * loops below step by 64 bytes, the line size of current x86-64 and most Arm cores. */
#if defined(__GNUC__)
#define EV_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define EV_PREFETCH(p) ((void)(p))
#endif

/* memcpy of a per-head piece: inline 32-byte chunks when n is a multiple of 32 (a row of a
 * multiple of 16 bf16/fp16 or 8 fp32 values), else one memcpy call. Per-head pieces are a few hundred bytes,
 * and a libc call per piece measured 3-14% slower over the whole compaction (bench_compact's
 * setup, six A/B runs). */
static inline void copy_piece(uint8_t *d, const uint8_t *s, size_t n) {
    if (n % 32 != 0) {
        memcpy(d, s, n);
        return;
    }
    for (size_t i = 0; i < n; i += 32)
        memcpy(d + i, s + i, 32);
}

/* Destination rows the prefetch of compact() runs ahead of its moves (2 to 16 measured alike). */
enum { EV_PREFETCH_ROWS = 8 };

/* Move every head's survivors to the front, slot-major: destination rows in ascending order,
 * each destination slot filled head by head (its writes contiguous). In place: for a head, the
 * row a move writes is either evicted or the source of a move of a lower destination, which
 * already happened (sources never lie below their destinations). Adjacent heads that take the
 * same source row move as one piece (a slot is [head][row_bytes], so their bytes are contiguous
 * in both slots); when every head keeps the same rows (MLA, or a shared draw without VaSE) that
 * is the whole slot.
 *
 * Per-head keep sets scatter a destination slot's sources over up to cand - K + 1 slots, one
 * row_bytes piece from each, all read through the same memcpy instructions, so the hardware's
 * stride prefetchers see no pattern and each piece waited for memory (1.5-1.7x the copy floor in
 * bench_compact). So the slots are prefetched whole, in row order, by a cursor that stays ahead
 * of the furthest source of destination j + EV_PREFETCH_ROWS: one sequential stream per plane.
 * Nearly every line it brings is used: a slot's kept pieces are read as sources, its evicted
 * pieces below K + r written as destinations (unused: pieces of rows a head keeps in place, and
 * evicted pieces at or beyond K + r). The lines wait in cache for at most the spread of the
 * heads' sources (max - min over h of keep[h][j]) plus EV_PREFETCH_ROWS slots. With one keep
 * set for every head the moves are whole slots, which the hardware prefetches by itself: no
 * hints then (no gain measured there). */
static void compact(const kvt__ev_args *a) {
    const uint64_t K = a->K, cand = a->N - a->r, n_new = K + a->r;
    bool same = true;
    for (uint32_t h = 1; h < a->n_heads && same; h++)
        same = memcmp(a->keep, a->keep + (size_t)h * K, sizeof *a->keep * K) == 0;
    /* The moved pieces: one per head, or whole slots. */
    const uint32_t H = same ? 1 : a->n_heads;
    const size_t rb = same ? a->slot_bytes : a->row_bytes;
    for (uint32_t p = 0; p < a->n_planes; p++) {
        uint8_t *base = a->plane[p];
        uint64_t pf = 0; /* the next row to prefetch */
        for (uint64_t j = 0; j < n_new; j++) {
            if (!same) {
                const uint64_t jp =
                    j + EV_PREFETCH_ROWS < n_new ? j + EV_PREFETCH_ROWS : n_new - 1;
                uint64_t far = 0;
                for (uint32_t h = 0; h < H; h++) {
                    uint64_t o = old_row(a->keep + (size_t)h * K, K, cand, jp);
                    far = o > far ? o : far;
                }
                for (; pf <= far; pf++) {
                    const uint8_t *s =
                        base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv,
                                                      (uint32_t)pf) *
                                   a->slot_bytes;
                    for (size_t b = 0; b < a->slot_bytes; b += 64)
                        EV_PREFETCH(s + b);
                }
            }
            uint8_t *dst = NULL;
            for (uint32_t h = 0; h < H;) {
                uint64_t o = old_row(a->keep + (size_t)h * K, K, cand, j);
                uint32_t e = h + 1;
                while (e < H && old_row(a->keep + (size_t)e * K, K, cand, j) == o)
                    e++;
                if (o != j) {
                    if (!dst)
                        dst = base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv,
                                                            (uint32_t)j) *
                                         a->slot_bytes;
                    const uint8_t *src =
                        base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv,
                                                      (uint32_t)o) *
                                   a->slot_bytes;
                    if (same)
                        memcpy(dst, src, rb);
                    else
                        copy_piece(dst + (size_t)h * rb, src + (size_t)h * rb,
                                   (size_t)(e - h) * rb);
                }
                h = e;
            }
        }
    }
}

void kvt__ev_apply_cpu(const kvt__ev_args *a) {
    const uint64_t K = a->K, cand = a->N - a->r, n_new = K + a->r, N = a->N;
    for (uint32_t h = 0; a->ar_bytes && h < a->n_heads; h++)
        archive_head(a, h);
    compact(a);
    for (uint32_t h = 0; h < a->n_heads; h++) {
        const uint32_t *keep = a->keep + (size_t)h * K;
        int32_t *map = a->map + (size_t)h * N;
        int64_t *P = a->pos + (size_t)h * a->pos_cap;
        for (uint64_t i = 0; i < N; i++)
            map[i] = -1;
        for (uint64_t j = 0; j < n_new; j++) {
            uint64_t o = old_row(keep, K, cand, j);
            map[o] = (int32_t)j;
            P[j] = P[o]; /* o >= j: in place, ascending */
        }
    }
}

void kvt__ev_append_cpu(const kvt__ev_append_args *a) {
    for (uint32_t h = 0; h < a->n_heads; h++) {
        int64_t *P = a->pos + (size_t)h * a->pos_cap + a->first_row;
        for (uint64_t i = 0; i < a->n; i++)
            P[i] = (int64_t)(a->first_pos + i);
    }
}
