/* evict_cpu.c — the CPU reference of a random-eviction round's data-parallel half (evict.h). The
 * decisions are those tiers/evict.c made on the host before Core v2 part 2, bit for bit (the
 * goldens hold them). */
#include "kernels/evict.h"

#include "kernels/philox.h"
#include "kernels/topm.h"
#include "lib/base/base.h"

#include <math.h>
#include <string.h>
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#endif

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
#define EV_INLINE static inline __attribute__((always_inline))
#else
#define EV_PREFETCH(p) ((void)(p))
#define EV_INLINE static inline
#endif

/* memcpy of a per-head piece: inline 32-byte chunks, four at a time, when n is a multiple of 32
 * (a row of a multiple of 16 bf16/fp16 or 8 fp32 values), else one memcpy call. Per-head pieces
 * are a few hundred bytes, and a libc call per piece measured 3-14% slower over the whole
 * compaction (bench_compact's setup, six A/B runs). Compiled inside an AVX2 body (below), each
 * 32-byte memcpy is one 256-bit load and store. */
EV_INLINE void copy_piece(uint8_t *d, const uint8_t *s, size_t n) {
    if (n % 32 != 0) {
        memcpy(d, s, n);
        return;
    }
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        memcpy(d + i, s + i, 32);
        memcpy(d + i + 32, s + i + 32, 32);
        memcpy(d + i + 64, s + i + 64, 32);
        memcpy(d + i + 96, s + i + 96, 32);
    }
    for (; i < n; i += 32)
        memcpy(d + i, s + i, 32);
}

/* The 256-bit copy of the AVX2 body: explicit loads and stores (GCC's generic tuning splits a
 * 32-byte memcpy into two 16-byte moves even inside an AVX2 function), four chunks loaded before
 * they are stored. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define EV_HAVE_AVX2 1
__attribute__((target("avx2"))) static inline void copy_piece_avx2(uint8_t *d, const uint8_t *s,
                                                                   size_t n) {
    if (n % 32 != 0) {
        memcpy(d, s, n);
        return;
    }
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i x3 = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_storeu_si256((__m256i *)(d + i), x0);
        _mm256_storeu_si256((__m256i *)(d + i + 32), x1);
        _mm256_storeu_si256((__m256i *)(d + i + 64), x2);
        _mm256_storeu_si256((__m256i *)(d + i + 96), x3);
    }
    for (; i < n; i += 32)
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
}
#else
#define EV_HAVE_AVX2 0
#endif

/* Destination rows the prefetch of compact() runs ahead of its moves (2, 4 and 8 measured alike
 * with the spread prefetch, 16 to 64 slower; bench_compact, cold cache, thread CPU clock). */
enum { EV_PREFETCH_ROWS = 4 };

/* The prefetch cursor of one plane: the next head piece to bring, walking the slots in row
 * order, a piece (row_bytes) at a time. */
typedef struct ev_cursor {
    const uint8_t *slot;  /* slot of row `row` */
    size_t off;           /* byte offset of the next piece in it */
    uint32_t head;        /* its head */
    uint64_t row, issued, target; /* pieces issued and wanted (row * n_heads + head) */
} ev_cursor;

/* Issue up to n pieces of the cursor, not past its target. */
EV_INLINE void cursor_issue(const kvt__ev_args *a, const uint8_t *base, ev_cursor *c, uint64_t n) {
    if (n > c->target - c->issued)
        n = c->target - c->issued;
    c->issued += n;
    for (; n > 0; n--) {
        const uint8_t *q = c->slot + c->off, *qe = q + a->row_bytes;
        for (; q + 256 <= qe; q += 256) {
            EV_PREFETCH(q);
            EV_PREFETCH(q + 64);
            EV_PREFETCH(q + 128);
            EV_PREFETCH(q + 192);
        }
        for (; q < qe; q += 64)
            EV_PREFETCH(q);
        c->off += a->row_bytes;
        if (++c->head == a->n_heads) {
            c->head = 0;
            c->off = 0;
            if (++c->row < a->N)
                c->slot = base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv,
                                                        (uint32_t)c->row) *
                                     a->slot_bytes;
        }
    }
}

/* Per-head keep sets, one plane, destination rows [0, K): each destination slot filled head by
 * head, adjacent heads with the same source as one piece; the source slots prefetched in row
 * order by a cursor (see compact()). */
EV_INLINE void compact_heads_body(const kvt__ev_args *a, uint8_t *base, bool wide) {
    const uint64_t K = a->K;
    const uint32_t H = a->n_heads;
    const size_t rb = a->row_bytes;
    ev_cursor c = {.slot = base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, 0) *
                                      a->slot_bytes};
    for (uint64_t j = 0; j < K; j++) {
        const uint64_t jp = j + EV_PREFETCH_ROWS < K ? j + EV_PREFETCH_ROWS : K - 1;
        uint64_t far = 0;
        for (uint32_t h = 0; h < H; h++) {
            uint64_t o = a->keep[(size_t)h * K + jp];
            far = o > far ? o : far;
        }
        c.target = (far + 1) * H;
        uint8_t *dst = NULL;
        uint64_t o = a->keep[j], oe = 0;
        for (uint32_t h = 0; h < H;) {
            uint32_t e = h + 1;
            while (e < H && (oe = a->keep[(size_t)e * K + j]) == o)
                e++;
            /* This piece's share of the prefetch: as many pieces as it moves, plus a 16th of
             * any backlog (the furthest source jumps ahead when a head's keep set skips rows). */
            cursor_issue(a, base, &c, (uint64_t)(e - h) + ((c.target - c.issued) >> 4));
            if (o != j) {
                if (!dst)
                    dst = base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv,
                                                        (uint32_t)j) *
                                     a->slot_bytes;
                const uint8_t *src =
                    base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)o) *
                               a->slot_bytes;
#if EV_HAVE_AVX2
                if (wide)
                    copy_piece_avx2(dst + (size_t)h * rb, src + (size_t)h * rb,
                                    (size_t)(e - h) * rb);
                else
#endif
                    copy_piece(dst + (size_t)h * rb, src + (size_t)h * rb, (size_t)(e - h) * rb);
            }
            h = e;
            o = oe;
        }
    }
}

static void compact_heads_plain(const kvt__ev_args *a, uint8_t *base) {
    compact_heads_body(a, base, false);
}

/* The same body with 256-bit copies (half the copy instructions), chosen at run time. */
#if EV_HAVE_AVX2
__attribute__((target("avx2"))) static void compact_heads_avx2(const kvt__ev_args *a,
                                                               uint8_t *base) {
    compact_heads_body(a, base, true);
}
#endif

/* Move every head's survivors to the front, slot-major: destination rows in ascending order,
 * each destination slot filled head by head (its writes contiguous). In place: for a head, the
 * row a move writes is either evicted or the source of a move of a lower destination, which
 * already happened (sources never lie below their destinations). Adjacent heads that take the
 * same source row move as one piece (a slot is [head][row_bytes], so their bytes are contiguous
 * in both slots); when every head keeps the same rows (MLA, or a shared draw without VaSE), and
 * for the r recent rows, that is the whole slot.
 *
 * Per-head keep sets scatter a destination slot's sources over up to cand - K + 1 slots, one
 * row_bytes piece from each, all read through the same copy instructions, so the hardware's
 * stride prefetchers see no pattern and each piece waited for memory (1.5-1.7x the copy floor in
 * bench_compact). So the slots are prefetched whole, in row order, by a cursor that stays ahead
 * of the furthest source of destination j + EV_PREFETCH_ROWS: one sequential stream per plane.
 * The cursor's lines are issued a piece at a time with each move (spread over the row's moves,
 * not in a burst of a slot's 32 lines: the burst measured 1.15-1.2x the spread's time, cold cache,
 * thread CPU clock), and every line of a piece: hinting one line in 2 or 4 and leaving the rest
 * to the hardware measured 2.5x slower. Non-temporal stores measured no better (the destination
 * lines are already cached: each was a prefetched source slot). Nearly every line it brings is used: a slot's kept pieces are read as
 * sources, its evicted pieces below K + r written as destinations (unused: pieces of rows a
 * head keeps in place, and evicted pieces at or beyond K + r). With one keep set for every head
 * the moves are whole slots, which the hardware prefetches by itself: no hints then (no gain
 * measured there). */
static void compact(const kvt__ev_args *a) {
    const uint64_t K = a->K, cand = a->N - a->r, n_new = K + a->r;
    bool same = true;
    for (uint32_t h = 1; h < a->n_heads && same; h++)
        same = memcmp(a->keep, a->keep + (size_t)h * K, sizeof *a->keep * K) == 0;
#if EV_HAVE_AVX2
    const bool avx2 = __builtin_cpu_supports("avx2");
#endif
    for (uint32_t p = 0; p < a->n_planes; p++) {
        uint8_t *base = a->plane[p];
        uint64_t j = 0;
        if (!same && K > 0) {
#if EV_HAVE_AVX2
            if (avx2)
                compact_heads_avx2(a, base);
            else
#endif
                compact_heads_plain(a, base);
            j = K;
        }
        /* Whole slots: every row with a shared keep set, the recent rows with any; a run of
         * consecutive rows that moves by the same distance within one page on both sides is
         * one memmove (the same bytes as row by row in ascending order: a source row is read
         * before any move writes it, as the rows ascend). */
        while (j < n_new) {
            const uint64_t o = old_row(a->keep, K, cand, j);
            if (o == j) {
                j++;
                continue;
            }
            uint64_t n = 1;
            while (j + n < n_new && kvt__div32_r(a->pdiv, (uint32_t)(j + n)) != 0 &&
                   kvt__div32_r(a->pdiv, (uint32_t)(o + n)) != 0 &&
                   old_row(a->keep, K, cand, j + n) == o + n)
                n++;
            memmove(base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)j) *
                               a->slot_bytes,
                    base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)o) *
                               a->slot_bytes,
                    (size_t)n * a->slot_bytes);
            j += n;
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
