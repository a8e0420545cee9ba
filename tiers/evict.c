/*
 * evict.c — random eviction with prompt protection (DESIGN §2.2), the policy of every MLA-RoPE,
 * GQA-RoPE and GQA-NoPE layer, with the optional VaSE protection set (§2.3) and archive.
 *
 * The round. A (sequence, group) appends rows until it holds K + r + c of them (K = budget,
 * r = recent window, c = cadence, c = r when 0). Then, for every layer of the group and every KV
 * head h of it, independently:
 *
 *   candidates  = every row but the newest r;
 *   protected   = the rows whose original position is below L, the protected prefix: the prompt
 *                 (when cfg->protect_prompt; counted inside K; when the prompt alone reaches K
 *                 only its first K - 1 rows, so at least one slot stays random, and the stats say
 *                 prompt_over_budget), and with VaSE at least the first 4 rows;
 *   VaSE        = (cfg->evict_vase) the top min(K/4, K - protected) other candidates by value
 *                 range (max - min over the value dimensions), ties to the lower position;
 *   random      = the rest of K: the candidates left with the largest Philox draws
 *                     draw(pos) = kvt__philox_draw_at(key, subseq(round, layer, h), pos)
 *                 (ties to the lower position), selected by the O(n) radix top-m, no sort.
 *
 * so every head keeps exactly K candidates plus the r recent rows. The draw of a row depends only
 * on (seed, request, round, layer, head, position): the CPU and CUDA backends, and the replicas of
 * a latent cache on several GPUs, make identical choices with no communication. MLA layers have
 * one latent head, so one draw per layer; cfg->evict_shared_draw gives every head head 0's
 * stream, which keeps the same positions in every head (the paper's shared-draw control).
 *
 * Why per head and never the union. Each head gathers its own K rows. Gathering the union of the
 * heads' keep sets once would keep 1 - (1 - K/(K+c))^H of the candidates — 90% for 8 heads at a
 * 4x budget — and free almost nothing: a silent no-op that also throws away the cross-head
 * redundancy the method relies on (a row lost by one head survives in others).
 *
 * Compaction. Every head ends with the same count, K + r, which is what lets every layer of the
 * group share one page table while holding different positions: row index i of the table holds,
 * for head h of layer l, position pos[l][h][i]. Each head's survivors move, in chronological
 * order, to row indices 0..K+r-1 (its own row_bytes slice at head * row_bytes of the slot, in
 * each plane), through the backend's move_rows; then the table is cut to K + r rows and its
 * trailing pages go back to the pool — memory really freed, unlike the salience archive.
 * Moves are listed by ascending destination row index and every source row index is >= its
 * destination, so applying them in order never overwrites a row still to be read (a destination
 * row is either evicted or the source of an earlier move). Note that this holds for row indices;
 * slots need not be monotonic in them (the page table lists pages in the order they were taken).
 *
 * Failure safety. Everything a round allocates (scratch, the keep lists of every layer and head,
 * the published slot maps, the archive growth) is allocated, and every keep set is selected,
 * before the first byte moves; a failure there returns with nothing observable changed and the
 * next commit retries the round. From the first move on nothing can fail on the CPU backend.
 */
#include "policy.h"

#include "kernels/kvt_hd.h"
#include "kernels/philox.h"
#include "kernels/topm.h"

#include <math.h>
#include <string.h>

/* First rows VaSE always keeps (its released code's "first 4 tokens", attention sinks). */
#define KVT__VASE_SINK_ROWS 4u

static uint64_t cadence_rows(const kvt_config *cfg) {
    return cfg->cadence_rows ? cfg->cadence_rows : cfg->recent_rows;
}

bool kvt__ev_round_due(const kvt_config *cfg, uint64_t n_rows) {
    return n_rows >= (uint64_t)cfg->evict_budget_rows + cfg->recent_rows + cadence_rows(cfg);
}

static bool prompt_over_budget(const kvt_config *cfg, uint64_t prompt_rows) {
    return cfg->protect_prompt && prompt_rows >= cfg->evict_budget_rows;
}

uint64_t kvt__ev_protected_rows(const kvt_config *cfg, uint64_t prompt_rows) {
    uint64_t K = cfg->evict_budget_rows;
    uint64_t L = 0;
    if (cfg->protect_prompt)
        L = prompt_over_budget(cfg, prompt_rows) ? K - 1 : prompt_rows;
    if (cfg->evict_vase && L < KVT__VASE_SINK_ROWS)
        L = KVT__VASE_SINK_ROWS;
    return L < K ? L : K;
}

/* ------------------------------------------------------------------------------------------- */
/* State lifecycle                                                                             */
/* ------------------------------------------------------------------------------------------- */
kvt_status kvt__ev_init(kvt__ev *e, const kvt__alloc *a, uint32_t n_heads, bool archive) {
    memset(e, 0, sizeof *e);
    if (n_heads == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    e->n_heads = n_heads;
    if (archive) {
        e->archive = kvt__calloc(a, sizeof *e->archive * n_heads);
        if (!e->archive)
            return KVT_ERR_OUT_OF_MEMORY;
    }
    return KVT_OK;
}

static void archive_fini(kvt__ev_archive *ar, const kvt__alloc *a) {
    kvt__free(a, ar->bytes, ar->bytes_cap);
    kvt__free(a, ar->pos, sizeof *ar->pos * ar->cap);
    kvt__free(a, ar->by_pos, sizeof *ar->by_pos * ar->by_pos_cap);
    memset(ar, 0, sizeof *ar);
}

static void scratch_free(kvt__ev_scratch *s, const kvt__alloc *a);

void kvt__ev_fini(kvt__ev *e, const kvt__alloc *a) {
    if (e->archive) {
        for (uint32_t h = 0; h < e->n_heads; h++)
            archive_fini(&e->archive[h], a);
        kvt__free(a, e->archive, sizeof *e->archive * e->n_heads);
    }
    kvt__free(a, e->pos, sizeof *e->pos * e->n_heads * e->pos_cap);
    kvt__free(a, e->last_map, sizeof *e->last_map * e->last_map_cap);
    scratch_free(&e->sc, a);
    memset(e, 0, sizeof *e);
}

kvt_status kvt__ev_reserve(kvt__ev *e, const kvt__alloc *a, uint64_t rows) {
    if (rows <= e->pos_cap)
        return KVT_OK;
    /* Doubling keeps the per-token cost of decode-time reserves O(1) amortised. The rows of a
     * head are strided by pos_cap, so growth re-lays every head out (no realloc). */
    uint64_t cap = e->pos_cap ? e->pos_cap : 64;
    while (cap < rows) {
        if (cap > UINT64_MAX / 2)
            return KVT_ERR_OUT_OF_MEMORY;
        cap *= 2;
    }
    if (cap > SIZE_MAX / sizeof *e->pos / e->n_heads)
        return KVT_ERR_OUT_OF_MEMORY;
    int64_t *p = kvt__malloc(a, sizeof *p * e->n_heads * cap);
    if (!p)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t h = 0; h < e->n_heads && e->pos_cap; h++)
        memcpy(p + (size_t)h * cap, e->pos + (size_t)h * e->pos_cap, sizeof *p * e->pos_cap);
    kvt__free(a, e->pos, sizeof *e->pos * e->n_heads * e->pos_cap);
    e->pos = p;
    e->pos_cap = cap;
    return KVT_OK;
}

void kvt__ev_append(kvt__ev *e, uint64_t first_row, uint64_t first_pos, uint64_t n) {
    KVT_ASSERT(first_row + n <= e->pos_cap);
    for (uint32_t h = 0; h < e->n_heads; h++) {
        int64_t *P = e->pos + (size_t)h * e->pos_cap + first_row;
        for (uint64_t i = 0; i < n; i++)
            P[i] = (int64_t)(first_pos + i);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Lookups                                                                                     */
/* ------------------------------------------------------------------------------------------- */
int64_t kvt__ev_find(const kvt__ev *e, const kvt__ptable *pt, uint32_t head, uint64_t pos) {
    if (head >= e->n_heads || !e->pos)
        return -1;
    const int64_t *P = e->pos + (size_t)head * e->pos_cap;
    uint64_t lo = 0, hi = pt->n_rows;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if ((uint64_t)P[mid] < pos)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < pt->n_rows && (uint64_t)P[lo] == pos ? (int64_t)lo : -1;
}

/* Index into the archive's arrays of a position, or -1. */
static int64_t archive_find(const kvt__ev_archive *ar, uint64_t pos) {
    uint64_t lo = 0, hi = ar->n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if ((uint64_t)ar->pos[ar->by_pos[mid]] < pos)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < ar->n && (uint64_t)ar->pos[ar->by_pos[lo]] == pos)
        return (int64_t)ar->by_pos[lo];
    return -1;
}

const uint8_t *kvt__ev_archived(const kvt__ev *e, const kvt_layer_spec *spec, uint32_t head,
                                uint32_t plane, uint64_t pos) {
    if (!e->archive || head >= e->n_heads || plane >= spec->n_planes)
        return NULL;
    const kvt__ev_archive *ar = &e->archive[head];
    int64_t k = archive_find(ar, pos);
    if (k < 0)
        return NULL;
    return ar->bytes + ((size_t)k * spec->n_planes + plane) * spec->row_bytes;
}

/* ------------------------------------------------------------------------------------------- */
/* The round                                                                                   */
/* ------------------------------------------------------------------------------------------- */

static void scratch_free(kvt__ev_scratch *s, const kvt__alloc *a) {
    kvt__free(a, s->keys, sizeof *s->keys * s->keys_cap);
    kvt__free(a, s->ridx, sizeof *s->ridx * s->ridx_cap);
    kvt__free(a, s->rpos, sizeof *s->rpos * s->rpos_cap);
    kvt__free(a, s->sel, sizeof *s->sel * s->sel_cap);
    kvt__free(a, s->mark, sizeof *s->mark * s->mark_cap);
    kvt__free(a, s->src, sizeof *s->src * s->src_cap);
    kvt__free(a, s->dst, sizeof *s->dst * s->dst_cap);
    kvt__free(a, s->keep, sizeof *s->keep * s->keep_cap);
    memset(s, 0, sizeof *s);
}


/* Grow a layer's round scratch (capacity only). */
static kvt_status scratch_grow(kvt__ev_scratch *s, const kvt__alloc *a, uint64_t cand, uint64_t K,
                               uint64_t n_new, uint64_t keep_entries) {
    KVT__GROW_OR_RETURN(a, s->keys, s->keys_cap, cand);
    KVT__GROW_OR_RETURN(a, s->ridx, s->ridx_cap, cand);
    KVT__GROW_OR_RETURN(a, s->rpos, s->rpos_cap, cand);
    KVT__GROW_OR_RETURN(a, s->sel, s->sel_cap, K);
    KVT__GROW_OR_RETURN(a, s->mark, s->mark_cap, cand);
    KVT__GROW_OR_RETURN(a, s->src, s->src_cap, n_new);
    KVT__GROW_OR_RETURN(a, s->dst, s->dst_cap, n_new);
    KVT__GROW_OR_RETURN(a, s->keep, s->keep_cap, keep_entries);
    return KVT_OK;
}

kvt_status kvt__ev_prepare(kvt__ev *e, const kvt__alloc *a, const kvt_config *cfg,
                           uint64_t rows) {
    kvt_status rc = kvt__ev_reserve(e, a, rows);
    if (rc != KVT_OK)
        return rc;
    KVT__GROW_OR_RETURN(a, e->last_map, e->last_map_cap, (uint64_t)e->n_heads * rows);
    uint64_t K = cfg->evict_budget_rows;
    return scratch_grow(&e->sc, a, rows, K, K + cfg->recent_rows, (uint64_t)e->n_heads * K);
}

/* VaSE's score of a row: the range (max - min) of its value dimensions — plane 1 (V) for GQA,
 * the first value_dim values (the latent part, which is the value) for MLA. A NaN anywhere makes
 * the range NaN, which kvt__score_key ranks with +Inf: a broken row is kept, never ranked
 * arbitrarily. fp8 rows are refused at context creation (their range needs the scales). */
/* Choose head h's K kept candidates among row indices [0, cand) of one layer; write them,
 * ascending, to out[K]. Nothing is modified but the scratch. */
static kvt_status select_head(const kvt__env *env, const kvt__store *st, const kvt__ev *e,
                              const kvt__ptable *pt, uint32_t h, uint64_t cand, uint64_t L,
                              kvt__ev_scratch *s, uint32_t *out) {
    const kvt_config *cfg = env->cfg;
    const kvt__backend *be = env->backend;
    const uint32_t K = cfg->evict_budget_rows;
    const int64_t *P = e->pos + (size_t)h * e->pos_cap;
    kvt_status rc;

    /* Protected prefix: positions below L. Positions ascend, so it is a prefix of row indices
     * (every such row is present: no round ever evicted one). */
    uint64_t f = 0;
    while (f < cand && (uint64_t)P[f] < L)
        f++;
    memset(s->mark, 0, cand);
    memset(s->mark, 1, f);

    uint64_t taken = f;
    if (cfg->evict_vase) {
        uint64_t m_v = K / 4;
        if (m_v > K - taken)
            m_v = K - taken;
        if (m_v > 0) {
            /* The rows stay in the backend's memory: it computes their keys. */
            kvt__value_args va = {.base = st->plane[st->spec.n_planes > 1 ? 1 : 0],
                                  .slot_bytes = st->slot_bytes,
                                  .head_offset = (size_t)h * st->spec.row_bytes,
                                  .dtype = (int)st->spec.dtype,
                                  .value_dim = st->spec.value_dim,
                                  .pages = pt->pages,
                                  .first_page = pt->first_page,
                                  .pdiv = env->pdiv,
                                  .first_row = f,
                                  .n = cand - f,
                                  .keys = s->keys};
            rc = be->ops->value_keys(be, &va, env->stream);
            if (rc != KVT_OK)
                return rc;
            rc = be->ops->topm(be, s->keys, (uint32_t)(cand - f), (uint32_t)m_v, s->sel,
                               env->stream);
            if (rc != KVT_OK)
                return rc;
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
        uint32_t draw_head = cfg->evict_shared_draw ? 0 : h + env->head_offset;
        uint64_t subseq = kvt__philox_subseq((uint32_t)e->rounds, st->layer + env->layer_offset,
                                             draw_head);
        rc = be->ops->draws(be, env->philox_key, subseq, s->rpos, (size_t)n_rest, s->keys,
                            env->stream);
        if (rc != KVT_OK)
            return rc;
        rc = be->ops->topm(be, s->keys, (uint32_t)n_rest, (uint32_t)m_r, s->sel, env->stream);
        if (rc != KVT_OK)
            return rc;
        for (uint64_t j = 0; j < m_r; j++)
            s->mark[s->ridx[s->sel[j]]] = 1;
    }
    uint64_t k = 0;
    for (uint64_t i = 0; i < cand; i++)
        if (s->mark[i])
            out[k++] = (uint32_t)i;
    KVT_ASSERT(k == K);
    return KVT_OK;
}

/* Grow head h's archive for `add` more rows of row_all bytes. Capacity only: nothing observable
 * changes, so a failure half-way leaves the state valid. */
static kvt_status archive_reserve(kvt__ev_archive *ar, const kvt__alloc *a, uint64_t add,
                                  uint64_t row_all) {
    uint64_t need = ar->n + add;
    if (need > UINT64_MAX / row_all)
        return KVT_ERR_OUT_OF_MEMORY;
    void *p = ar->bytes;
    kvt_status s = kvt__grow(a, &p, &ar->bytes_cap, need * row_all, 1);
    if (s != KVT_OK)
        return s;
    ar->bytes = p;
    p = ar->pos;
    s = kvt__grow(a, &p, &ar->cap, need, sizeof *ar->pos);
    if (s != KVT_OK)
        return s;
    ar->pos = p;
    p = ar->by_pos;
    s = kvt__grow(a, &p, &ar->by_pos_cap, need, sizeof *ar->by_pos);
    if (s != KVT_OK)
        return s;
    ar->by_pos = p;
    return KVT_OK;
}

/* Copy head h's evicted candidates (every row in [0, cand) not in keep[K]) into its archive, all
 * planes, and merge them into the by-position index. Capacity was reserved. */
static kvt_status archive_evicted(kvt__ev_archive *ar, const kvt__env *env, const kvt__store *st,
                            const kvt__ptable *pt, const int64_t *P, uint32_t h, uint64_t cand,
                            const uint32_t *keep, uint64_t K) {
    const kvt_layer_spec *sp = &st->spec;
    const uint64_t n_old = ar->n;
    uint64_t n = n_old, k = 0;
    for (uint64_t i = 0; i < cand; i++) {
        if (k < K && keep[k] == i) {
            k++;
            continue;
        }
        size_t off =
            (size_t)kvt__slot(pt, env->pdiv, i) * st->slot_bytes + (size_t)h * sp->row_bytes;
        uint8_t *d = ar->bytes + (size_t)n * sp->n_planes * sp->row_bytes;
        for (uint32_t p = 0; p < sp->n_planes; p++) {
            /* out of the backend's memory into the host archive */
            kvt_status rc = env->backend->ops->read(env->backend, d + (size_t)p * sp->row_bytes,
                                                    st->plane[p] + off, sp->row_bytes,
                                                    env->stream);
            if (rc != KVT_OK)
                return rc;
        }
        ar->pos[n] = P[i];
        n++;
    }
    /* The new entries n_old..n-1 ascend by position; merge them into by_pos from the back (in
     * place, no scratch). An old row kept in earlier rounds can be archived after newer ones,
     * so the two runs interleave. */
    uint64_t i = n_old, j = n - n_old, w = n;
    while (j > 0) {
        if (i > 0 && ar->pos[ar->by_pos[i - 1]] > ar->pos[n_old + j - 1])
            ar->by_pos[--w] = ar->by_pos[--i];
        else
            ar->by_pos[--w] = n_old + --j;
    }
    ar->n = n;
    return KVT_OK;
}

/* Old row index of new row index j: the K kept candidates, then the r recent rows. */
static uint64_t old_row(const uint32_t *keep, uint64_t K, uint64_t cand, uint64_t j) {
    return j < K ? keep[j] : cand + (j - K);
}

/* Move one layer's survivors to the front. When every head keeps the same rows (MLA, or a
 * shared draw without VaSE) a whole slot moves at once; otherwise each head's slice moves on its
 * own. */
static kvt_status compact_layer(const kvt__env *env, kvt__store *st, const kvt__ptable *pt,
                                const uint32_t *keep, uint32_t H, uint64_t K, uint64_t cand,
                                uint64_t n_new, kvt__ev_scratch *s) {
    const kvt__backend *be = env->backend;
    const kvt_layer_spec *sp = &st->spec;
    bool same = true;
    for (uint32_t h = 1; h < H && same; h++)
        same = memcmp(keep, keep + (size_t)h * K, sizeof *keep * K) == 0;
    uint32_t n_heads_moved = same ? 1 : H;
    for (uint32_t h = 0; h < n_heads_moved; h++) {
        const uint32_t *kh = keep + (size_t)h * K;
        uint32_t n = 0;
        for (uint64_t j = 0; j < n_new; j++) {
            uint64_t o = old_row(kh, K, cand, j);
            if (o == j)
                continue;
            s->src[n] = kvt__slot(pt, env->pdiv, o);
            s->dst[n] = kvt__slot(pt, env->pdiv, j);
            n++;
        }
        if (n == 0)
            continue;
        size_t offset = same ? 0 : (size_t)h * sp->row_bytes;
        size_t bytes = same ? st->slot_bytes : sp->row_bytes;
        for (uint32_t p = 0; p < sp->n_planes; p++) {
            kvt_status rc = be->ops->move_rows(be, st->plane[p], st->slot_bytes, offset, bytes,
                                               s->src, s->dst, n, env->stream);
            if (rc != KVT_OK)
                return rc;
        }
    }
    return KVT_OK;
}

/* One round over the given layers of a group whose table holds N rows per head (the table's
 * committed rows, or those plus the rows of a step in flight): select, archive or drop, compact
 * each layer to K + r rows. The table itself (its n_rows, its pages) is left to the caller, so a
 * step can compact one layer inside its forward while the group's other layers still hold N. */
static kvt_status round_core(const kvt__env *env, kvt__store *const *stores,
                             kvt__ev *const *states, uint32_t n_layers, const kvt__ptable *pt,
                             uint64_t N, uint64_t prompt_rows) {
    const kvt_config *cfg = env->cfg;
    const kvt__alloc *a = env->alloc;
    const uint64_t K = cfg->evict_budget_rows;
    const uint64_t r = cfg->recent_rows;
    if (N < r || N - r <= K)
        return KVT_OK; /* nothing to evict */
    const uint64_t cand = N - r;
    const uint64_t n_new = K + r;
    const uint64_t L = kvt__ev_protected_rows(cfg, prompt_rows);
    if (N > INT32_MAX)
        return kvt__fail(env->err, env->err_len, KVT_ERR_UNSUPPORTED,
                         "eviction round over %llu rows: row indices must fit in int32",
                         (unsigned long long)N);

    /* 1. Capacity (grow-only: nothing to do when the states were sized for a stated limit). */
    kvt_status rc = KVT_OK;
    for (uint32_t l = 0; l < n_layers; l++) {
        kvt__ev *e = states[l];
        const kvt_layer_spec *sp = &stores[l]->spec;
        KVT_ASSERT(e->n_heads == sp->n_kv_heads && e->pos_cap >= N);
        rc = scratch_grow(&e->sc, a, cand, K, n_new, (uint64_t)e->n_heads * K);
        if (rc != KVT_OK) {
            kvt__fail(env->err, env->err_len, KVT_ERR_OUT_OF_MEMORY,
                      "eviction round: scratch for %llu candidates; nothing was evicted",
                      (unsigned long long)cand);
            goto done;
        }
        void *p = e->last_map;
        rc = kvt__grow(a, &p, &e->last_map_cap, (uint64_t)e->n_heads * N, sizeof *e->last_map);
        if (rc == KVT_OK)
            e->last_map = p;
        for (uint32_t h = 0; rc == KVT_OK && e->archive && h < e->n_heads; h++)
            rc = archive_reserve(&e->archive[h], a, cand - K,
                                 (uint64_t)sp->n_planes * sp->row_bytes);
        if (rc != KVT_OK) {
            kvt__fail(env->err, env->err_len, rc,
                      "eviction round: slot map / archive of layer %u; nothing was evicted",
                      stores[l]->layer);
            goto done;
        }
    }

    /* 2. Select every keep set (backend draws and top-m; nothing moves yet). */
    for (uint32_t l = 0; l < n_layers; l++) {
        uint32_t *keep = states[l]->sc.keep;
        for (uint32_t h = 0; h < states[l]->n_heads; h++, keep += K) {
            rc = select_head(env, stores[l], states[l], pt, h, cand, L, &states[l]->sc, keep);
            if (rc != KVT_OK) {
                kvt__fail(env->err, env->err_len, rc,
                          "eviction round: selecting layer %u head %u; nothing was evicted",
                          stores[l]->layer, h);
                goto done;
            }
        }
    }

    /* 3. Commit: archive, publish the maps, compact, update positions. */
    for (uint32_t l = 0; l < n_layers; l++) {
        kvt__ev *e = states[l];
        kvt__store *st = stores[l];
        const uint32_t H = e->n_heads;
        const uint32_t *keep = e->sc.keep;
        for (uint32_t h = 0; rc == KVT_OK && h < H; h++) {
            const int64_t *P = e->pos + (size_t)h * e->pos_cap;
            if (e->archive)
                rc = archive_evicted(&e->archive[h], env, st, pt, P, h, cand,
                                     keep + (size_t)h * K, K);
            else
                e->dropped += cand - K;
        }
        if (rc == KVT_OK)
            rc = compact_layer(env, st, pt, keep, H, K, cand, n_new, &e->sc);
        if (rc != KVT_OK) {
            /* Only a device error can land here; the bytes may be half moved and earlier layers
             * of the group are already compacted: no retry can repair that. Mark every layer of
             * the group damaged (sticky) so the sequence refuses further work. */
            for (uint32_t x = 0; x < n_layers; x++)
                states[x]->damaged = true;
            kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT,
                      "eviction round: moving rows of layer %u failed (%s); the sequence is "
                      "damaged and must be destroyed",
                      st->layer, kvt_status_name(rc));
            rc = KVT_ERR_CORRUPT;
            goto done;
        }
        e->last_n = N;
        for (uint32_t h = 0; h < H; h++, keep += K) {
            int32_t *map = e->last_map + (size_t)h * N;
            int64_t *P = e->pos + (size_t)h * e->pos_cap;
            for (uint64_t i = 0; i < N; i++)
                map[i] = -1;
            for (uint64_t j = 0; j < n_new; j++) {
                uint64_t o = old_row(keep, K, cand, j);
                map[o] = (int32_t)j;
                P[j] = P[o]; /* o >= j: in place, ascending */
            }
        }
        e->last_kept = n_new;
        e->rounds++;
        if (prompt_over_budget(cfg, prompt_rows))
            e->prompt_over_budget = true;
    }
done:
    return rc;
}

kvt_status kvt__ev_round(const kvt__env *env, kvt__store *const *stores, kvt__ev *const *states,
                         uint32_t n_layers, kvt__ptable *pt, kvt__pool *pool,
                         uint64_t prompt_rows) {
    const uint64_t N = pt->n_rows, K = env->cfg->evict_budget_rows, r = env->cfg->recent_rows;
    if (N < r || N - r <= K)
        return KVT_OK;
    kvt_status rc = round_core(env, stores, states, n_layers, pt, N, prompt_rows);
    if (rc != KVT_OK)
        return rc;
    pt->n_rows = K + r;
    kvt__ptable_trim(pt, pool);
    return KVT_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* Invariants                                                                                  */
/* ------------------------------------------------------------------------------------------- */
kvt_status kvt__ev_check(const kvt__ev *e, const kvt__ptable *pt, const kvt_config *cfg,
                         uint64_t appended, uint64_t prompt_rows, char *err, size_t len) {
    const uint32_t H = e->n_heads;
    const uint64_t n = pt->n_rows;
    if (n > e->pos_cap && n > 0)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "evict: %llu rows, position capacity %llu",
                         (unsigned long long)n, (unsigned long long)e->pos_cap);
    /* Counts: what every head holds + archived + dropped covers every appended row once. */
    uint64_t archived = 0;
    for (uint32_t h = 0; e->archive && h < H; h++)
        archived += e->archive[h].n;
    if (e->archive && e->dropped != 0)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "evict: archive on, %llu rows dropped",
                         (unsigned long long)e->dropped);
    if (n * H + archived + e->dropped != appended * H)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "evict: %llu rows x %u heads + %llu archived + %llu dropped != %llu "
                         "appended x %u heads",
                         (unsigned long long)n, H, (unsigned long long)archived,
                         (unsigned long long)e->dropped, (unsigned long long)appended, H);
    if (e->rounds > 0 && n < e->last_kept)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "evict: %llu rows, fewer than the %llu the last round kept",
                         (unsigned long long)n, (unsigned long long)e->last_kept);
    if (e->prompt_over_budget != (e->rounds > 0 && prompt_over_budget(cfg, prompt_rows)))
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "evict: prompt_over_budget %d with %llu prompt rows, K = %u, %llu rounds",
                         (int)e->prompt_over_budget, (unsigned long long)prompt_rows,
                         cfg->evict_budget_rows, (unsigned long long)e->rounds);
    uint64_t L = kvt__ev_protected_rows(cfg, prompt_rows);
    if (L > appended)
        L = appended;
    uint64_t R = cfg->recent_rows < appended ? cfg->recent_rows : appended;
    for (uint32_t h = 0; h < H; h++) {
        /* No committed row yet: pos may still be NULL, and NULL + 0 is undefined in C. */
        const int64_t *P = e->pos ? e->pos + (size_t)h * e->pos_cap : NULL;
        for (uint64_t i = 0; i < n; i++) {
            if (P[i] < 0 || (uint64_t)P[i] >= appended || (i > 0 && P[i] <= P[i - 1]))
                return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                 "evict: head %u row %llu holds position %lld: not ascending "
                                 "inside [0, %llu)",
                                 h, (unsigned long long)i, (long long)P[i],
                                 (unsigned long long)appended);
        }
        /* The protected prefix sits at row indices 0..L-1, the newest R at the end. */
        for (uint64_t i = 0; i < L; i++)
            if (i >= n || (uint64_t)P[i] != i)
                return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                 "evict: head %u lost protected position %llu", h,
                                 (unsigned long long)i);
        for (uint64_t t = 1; t <= R; t++)
            if (t > n || (uint64_t)P[n - t] != appended - t)
                return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                 "evict: head %u lost recent position %llu", h,
                                 (unsigned long long)(appended - t));
        if (e->archive) {
            const kvt__ev_archive *ar = &e->archive[h];
            for (uint64_t i = 0; i < ar->n; i++) {
                uint64_t k = ar->by_pos[i];
                if (k >= ar->n)
                    return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                     "evict: head %u archive index %llu out of range", h,
                                     (unsigned long long)k);
                int64_t p = ar->pos[k];
                /* Strictly ascending positions also make by_pos a permutation. */
                if (p < 0 || (uint64_t)p >= appended || (i > 0 && p <= ar->pos[ar->by_pos[i - 1]]))
                    return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                     "evict: head %u archive not sorted/unique at %llu", h,
                                     (unsigned long long)i);
                if (kvt__ev_find(e, pt, h, (uint64_t)p) >= 0)
                    return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                     "evict: head %u position %lld both attended and archived", h,
                                     (long long)p);
            }
        }
        /* The last slot map: kept old rows onto 0..m-1, ascending (chronological compaction). */
        if (e->rounds > 0) {
            const int32_t *map = e->last_map + (size_t)h * e->last_n;
            int64_t next = 0;
            for (uint64_t i = 0; i < e->last_n; i++) {
                if (map[i] == -1)
                    continue;
                if (map[i] != next)
                    return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                     "evict: head %u slot map %llu -> %d, expected %lld", h,
                                     (unsigned long long)i, map[i], (long long)next);
                next++;
            }
            if ((uint64_t)next != e->last_kept)
                return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                 "evict: head %u slot map keeps %lld rows, the round kept %llu", h,
                                 (long long)next, (unsigned long long)e->last_kept);
        }
    }
    return KVT_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* The policy table (policy.h)                                                                  */
/* ------------------------------------------------------------------------------------------- */
/* Rounds need rows; VaSE's value range needs values it cannot decode in fp8 rows without their
 * scales. */
static kvt_status ev_supports_layer(const kvt_layer_spec *sp, uint32_t i, const kvt_config *cfg,
                                    char *err, size_t len) {
    if (sp->kind == KVT_LAYER_NO_KV)
        return kvt__fail(err, len, KVT_ERR_POLICY_MISMATCH,
                         "layer %u has no per-token KV (%s); only policy none applies", i,
                         kvt_layer_kind_name(sp->kind));
    if (cfg->evict_vase && sp->dtype == KVT_DTYPE_FP8_E4M3)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "config.evict_vase: value range of fp8 rows (layer %u) needs their "
                         "scales; not supported",
                         i);
    return KVT_OK;
}

static kvt_status ev_layer_init(kvt__tier_state *s, const kvt__env *env, const kvt__store *st) {
    kvt_status rc = kvt__ev_init(&s->ev, env->alloc, st->spec.n_kv_heads, env->cfg->evict_archive);
    /* With a stated limit the table never holds more than K + r + c rows plus one step's (at
     * most max_rows); size for max_rows so that no round allocates. */
    if (rc == KVT_OK && env->max_rows)
        rc = kvt__ev_prepare(&s->ev, env->alloc, env->cfg, env->max_rows);
    /* A stated archive limit: the archive is allocated now, rounds never grow it. */
    for (uint32_t h = 0; rc == KVT_OK && s->ev.archive && env->archive_rows && h < s->ev.n_heads;
         h++)
        rc = archive_reserve(&s->ev.archive[h], env->alloc, env->archive_rows,
                             (uint64_t)st->spec.n_planes * st->spec.row_bytes);
    if (rc != KVT_OK)
        return kvt__fail(env->err, env->err_len, rc, "eviction state of layer %u", st->layer);
    return KVT_OK;
}

/* Counts back to zero; positions, slot maps, scratch and archives keep their capacity. */
static kvt_status ev_layer_reset(kvt__tier_state *s, const kvt__env *env, const kvt__store *st) {
    (void)env;
    (void)st;
    kvt__ev *e = &s->ev;
    e->last_n = e->last_kept = e->rounds = e->dropped = 0;
    e->prompt_over_budget = e->damaged = e->step_appended = e->step_round = false;
    for (uint32_t h = 0; e->archive && h < e->n_heads; h++)
        e->archive[h].n = 0;
    return KVT_OK;
}

static void ev_layer_fini(kvt__tier_state *s, const kvt__alloc *a) {
    kvt__ev_fini(&s->ev, a);
}

/* Positions grow for the table's rows; with a stated archive limit, a round this step would run
 * (a commit runs at most one, at K + r + c rows) must fit in every head's archive: the evicted
 * candidates are (rows - r) - K per head. */
static kvt_status ev_reserve(kvt__tier_state *s, const kvt__env *env, const kvt__store *st,
                             uint64_t rows) {
    kvt__ev *e = &s->ev;
    const kvt_config *cfg = env->cfg;
    if (e->archive && env->archive_rows && kvt__ev_round_due(cfg, rows)) {
        uint64_t evicted = rows - cfg->recent_rows - cfg->evict_budget_rows;
        for (uint32_t h = 0; h < e->n_heads; h++)
            if (e->archive[h].n + evicted > env->archive_rows)
                return kvt__fail(env->err, env->err_len, KVT_ERR_ARCHIVE_FULL,
                                 "layer %u head %u: the archive holds %llu of %llu rows and the "
                                 "step's round would add %llu",
                                 st->layer, h, (unsigned long long)e->archive[h].n,
                                 (unsigned long long)env->archive_rows,
                                 (unsigned long long)evicted);
    }
    kvt_status rc = kvt__ev_reserve(e, env->alloc, rows);
    return rc == KVT_OK ? KVT_OK
                        : kvt__fail(env->err, env->err_len, rc, "positions of layer %u", st->layer);
}

/* A step in flight (kvt_batch_run, inside the layer's forward, after the engine wrote the step's
 * rows): record the step's positions for this layer and, when the table with them reaches
 * K + r + c, run this layer's part of the round. Its rows are then compacted to K + r while the
 * group's other layers still hold N; the table (shared) shrinks at commit, once every layer has
 * compacted (ev_group_commit). Every layer keeps the same count, so after the last layer's round
 * row index i maps to the same slot in all of them, and the slots the engine wrote this step's
 * rows to stay valid for the layers whose forward comes later (pages are only trimmed at
 * commit). On a selection failure nothing of this layer changed. */
static kvt_status ev_layer_step(const kvt__env *env, const kvt__tier_step *t) {
    kvt__ev *e = &t->state->ev;
    const uint64_t N = t->pt->n_rows + t->step_rows;
    kvt__ev_append(e, t->pt->n_rows, t->appended, t->step_rows);
    e->step_appended = true;
    if (!kvt__ev_round_due(env->cfg, N))
        return KVT_OK;
    kvt__store *sp[1] = {t->st};
    kvt__ev *ep[1] = {e};
    kvt_status rc = round_core(env, sp, ep, 1, t->pt, N, t->prompt_rows);
    if (rc == KVT_OK)
        e->step_round = true;
    return rc;
}

static uint64_t ev_held_rows(const kvt__tier_state *s, uint64_t rows) {
    return s->ev.step_round ? s->ev.last_kept : rows;
}

/* Record the new rows' positions in every layer that did not in a step (capacity was grown at
 * reserve: cannot fail), then run the round when one is due: the layers of the group together
 * (they share the page table), except those that already ran theirs in the step. A group some of
 * whose layers compacted in the step while the others now fail cannot be made to agree again:
 * it is marked damaged (KVT_ERR_CORRUPT). */
static kvt_status ev_group_commit(const kvt__env *env, const kvt__tier_group *g) {
    kvt__group *gr = g->gr;
    uint32_t stepped = 0;
    for (uint32_t k = 0; k < gr->n_layers; k++) {
        kvt__ev *e = &g->states[gr->layers[k]].ev;
        if (g->new_rows > 0 && !e->step_appended)
            kvt__ev_append(e, g->pt->n_rows - g->new_rows, g->appended - g->new_rows,
                           g->new_rows);
        e->step_appended = false;
        stepped += e->step_round;
    }
    if (!kvt__ev_round_due(env->cfg, g->pt->n_rows)) {
        KVT_ASSERT(stepped == 0);
        return KVT_OK;
    }
    /* The group's pointer scratch (allocated with the group): no commit allocates. */
    kvt__store **sp = (kvt__store **)gr->ptrs;
    kvt__ev **ep = (kvt__ev **)(gr->ptrs + gr->n_layers);
    kvt_status s = KVT_OK;
    uint32_t n = 0;
    for (uint32_t k = 0; k < gr->n_layers; k++) {
        kvt__ev *e = &g->states[gr->layers[k]].ev;
        if (e->step_round)
            continue;
        sp[n] = &g->stores[gr->layers[k]];
        ep[n++] = e;
    }
    if (stepped == 0) {
        s = kvt__ev_round(env, sp, ep, n, g->pt, &gr->pool, g->prompt_rows);
        goto done;
    }
    s = n ? round_core(env, sp, ep, n, g->pt, g->pt->n_rows, g->prompt_rows) : KVT_OK;
    if (s != KVT_OK) {
        for (uint32_t k = 0; k < gr->n_layers; k++) {
            g->states[gr->layers[k]].ev.damaged = true;
            g->states[gr->layers[k]].ev.step_round = false;
        }
        s = kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT,
                      "eviction round: %u layers compacted in the step, the others failed at "
                      "commit (%s); the sequence is damaged and must be destroyed",
                      stepped, kvt_status_name(s));
        goto done;
    }
    g->pt->n_rows = env->cfg->evict_budget_rows + env->cfg->recent_rows;
    kvt__ptable_trim(g->pt, &gr->pool);
    for (uint32_t k = 0; k < gr->n_layers; k++)
        g->states[gr->layers[k]].ev.step_round = false;
done:
    /* On a host-memory failure the flags stay: the next commit finishes the other layers. */
    return s;
}

static kvt_row_state ev_row_state(const kvt__tier_layer *l, uint32_t head, uint64_t pos,
                                  int32_t *slot) {
    const kvt__ev *e = &l->state->ev;
    int64_t row = kvt__ev_find(e, l->pt, head, pos);
    if (row >= 0) {
        *slot = kvt__slot(l->pt, l->pdiv, (uint64_t)row);
        return KVT_ROW_ATTENDED;
    }
    *slot = -1;
    return kvt__ev_archived(e, &l->st->spec, head, 0, pos) ? KVT_ROW_ARCHIVED : KVT_ROW_DROPPED;
}

static const uint8_t *ev_archived_row(const kvt__tier_layer *l, uint32_t head, uint32_t plane,
                                      uint64_t pos) {
    return kvt__ev_archived(&l->state->ev, &l->st->spec, head, plane, pos);
}

static void ev_positions(const kvt__tier_layer *l, uint32_t head, int64_t *out) {
    const kvt__ev *e = &l->state->ev;
    if (l->pt->n_rows)
        memcpy(out, e->pos + (size_t)head * e->pos_cap, sizeof *out * l->pt->n_rows);
}

static uint64_t ev_last_slot_map(const kvt__tier_layer *l, uint32_t head, const int32_t **map) {
    const kvt__ev *e = &l->state->ev;
    *map = e->last_n ? e->last_map + (size_t)head * e->last_n : NULL;
    return e->last_n;
}

static bool ev_prompt_used(const kvt__tier_state *s) {
    return s->ev.rounds > 0;
}

static bool ev_damaged(const kvt__tier_state *s) {
    return s->ev.damaged;
}

static uint64_t archived_rows(const kvt__ev *e) {
    uint64_t n = 0;
    for (uint32_t h = 0; e->archive && h < e->n_heads; h++)
        n += e->archive[h].n;
    return n;
}

static void ev_stats(const kvt__tier_layer *l, kvt_layer_stats *out) {
    const kvt__ev *e = &l->state->ev;
    const kvt_layer_spec *sp = &l->st->spec;
    out->rounds = e->rounds;
    out->dropped_rows = e->dropped;
    out->prompt_over_budget = e->prompt_over_budget;
    out->archived_rows = archived_rows(e);
    out->archive_bytes = out->archived_rows * sp->n_planes * (uint64_t)sp->row_bytes;
    out->attended_rows = l->pt->n_rows; /* per head: every head keeps the same count */
}

static kvt_status ev_check_counts(const kvt__tier_layer *l, char *err, size_t len) {
    const kvt__ev *e = &l->state->ev;
    uint64_t H = l->st->spec.n_kv_heads, archived = archived_rows(e);
    if (l->pt->n_rows * H + archived + e->dropped != l->appended * H)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "%llu held x %llu heads + %llu archived + %llu dropped != %llu appended "
                         "rows",
                         (unsigned long long)l->pt->n_rows, (unsigned long long)H,
                         (unsigned long long)archived, (unsigned long long)e->dropped,
                         (unsigned long long)(l->appended * H));
    return KVT_OK;
}

static kvt_status ev_check(const kvt__tier_layer *l, char *err, size_t len) {
    return kvt__ev_check(&l->state->ev, l->pt, l->cfg, l->appended, l->prompt_rows, err, len);
}

static uint64_t ev_snap_size(const kvt__tier_layer *l);
static kvt_status ev_snap_save(const kvt__tier_layer *l, uint8_t *dst, char *err, size_t len);
static kvt_status ev_snap_load(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                               const uint8_t *src, uint64_t n);

const kvt__policy_ops kvt__policy_evict = {
    .rows_are_positions = false,
    .dropped_how = "by random eviction",
    .layer_init = ev_layer_init,
    .layer_reset = ev_layer_reset,
    .layer_fini = ev_layer_fini,
    .reserve = ev_reserve,
    .group_commit = ev_group_commit,
    .layer_step = ev_layer_step,
    .supports_layer = ev_supports_layer,
    .held_rows = ev_held_rows,
    .attended = kvt__none_attended,
    .row_state = ev_row_state,
    .archived_row = ev_archived_row,
    .positions = ev_positions,
    .last_slot_map = ev_last_slot_map,
    .prompt_used = ev_prompt_used,
    .damaged = ev_damaged,
    .stats = ev_stats,
    .check_counts = ev_check_counts,
    .check = ev_check,
    .snap_size = ev_snap_size,
    .snap_save = ev_snap_save,
    .snap_load = ev_snap_load,
};

/* ------------------------------------------------------------------------------------------- */
/* Snapshots (policy.h snap_*; lib/snapshot.c)                                                  */
/* ------------------------------------------------------------------------------------------- */
/* Layout: u32 n_heads, u32 flags (1: prompt_over_budget, 2: archive present); u64 rounds,
 * dropped, last_kept, last_n, n_rows; i64 pos[n_heads][n_rows]; i32 last_map[n_heads][last_n];
 * with the archive, per head: u64 n, i64 pos[n] (order of archiving), u64 by_pos[n],
 * u8 bytes[n][n_planes][row_bytes]. The round scratch is not state: it is rebuilt on demand. */
enum { EV_SNAP_FIXED = 8 + 5 * 8 };

static uint64_t ev_snap_size(const kvt__tier_layer *l) {
    const kvt__ev *e = &l->state->ev;
    const kvt_layer_spec *sp = &l->st->spec;
    uint64_t n = EV_SNAP_FIXED + (uint64_t)e->n_heads * (8 * l->pt->n_rows + 4 * e->last_n);
    for (uint32_t h = 0; e->archive && h < e->n_heads; h++)
        n += 8 + e->archive[h].n * (16 + (uint64_t)sp->n_planes * sp->row_bytes);
    return n;
}

static kvt_status ev_snap_save(const kvt__tier_layer *l, uint8_t *dst, char *err, size_t len) {
    (void)err;
    (void)len;
    const kvt__ev *e = &l->state->ev;
    const kvt_layer_spec *sp = &l->st->spec;
    const uint64_t rows = l->pt->n_rows;
    kvt__snap_cur c = {.w = dst};
    uint32_t head[2] = {e->n_heads, (e->prompt_over_budget ? 1u : 0u) | (e->archive ? 2u : 0u)};
    uint64_t v[5] = {e->rounds, e->dropped, e->last_kept, e->last_n, rows};
    kvt__snap_put(&c, head, sizeof head);
    kvt__snap_put(&c, v, sizeof v);
    for (uint32_t h = 0; h < e->n_heads && rows; h++)
        kvt__snap_put(&c, e->pos + (size_t)h * e->pos_cap, sizeof *e->pos * rows);
    if (e->last_n)
        kvt__snap_put(&c, e->last_map, sizeof *e->last_map * e->n_heads * e->last_n);
    for (uint32_t h = 0; e->archive && h < e->n_heads; h++) {
        const kvt__ev_archive *ar = &e->archive[h];
        kvt__snap_put(&c, &ar->n, sizeof ar->n);
        if (!ar->n)
            continue;
        kvt__snap_put(&c, ar->pos, sizeof *ar->pos * ar->n);
        kvt__snap_put(&c, ar->by_pos, sizeof *ar->by_pos * ar->n);
        kvt__snap_put(&c, ar->bytes, ar->n * sp->n_planes * sp->row_bytes);
    }
    return KVT_OK;
}

static kvt_status ev_snap_load(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                               const uint8_t *src, uint64_t n) {
    kvt__ev *e = &s->ev;
    const kvt_config *cfg = l->cfg;
    const kvt_layer_spec *sp = &l->st->spec;
    const uint64_t row_all = (uint64_t)sp->n_planes * sp->row_bytes;
    kvt__snap_cur c = {.r = src, .left = n};
    uint32_t head[2];
    uint64_t v[5];
    if (!kvt__snap_get(&c, head, sizeof head) || !kvt__snap_get(&c, v, sizeof v))
        return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                         "eviction state: %llu bytes, the counts need %d", (unsigned long long)n,
                         EV_SNAP_FIXED);
    const uint64_t rounds = v[0], dropped = v[1], last_kept = v[2], last_n = v[3], rows = v[4];
    const char *bad = NULL;
    if (head[0] != e->n_heads)
        bad = "KV heads differ from the layer's";
    else if ((head[1] & ~3u) != 0 || ((head[1] & 2u) != 0) != (e->archive != NULL))
        bad = "unknown flags, or an archive where the configuration has none (or none where it "
              "has one)";
    else if (rows != l->pt->n_rows)
        bad = "rows differ from the page table's";
    else if (rounds == 0 ? (last_n != 0 || last_kept != 0)
                         : (last_kept != (uint64_t)cfg->evict_budget_rows + cfg->recent_rows ||
                            last_n > l->appended))
        bad = "last round's counts out of range";
    if (bad)
        return kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT,
                         "eviction state: %s (%u heads, %llu rows, %llu rounds)", bad, head[0],
                         (unsigned long long)rows, (unsigned long long)rounds);
    const uint8_t *pos = kvt__snap_take_n(&c, rows, 8 * (uint64_t)e->n_heads);
    const uint8_t *map = pos ? kvt__snap_take_n(&c, last_n, 4 * (uint64_t)e->n_heads) : NULL;
    if (!map)
        return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                         "eviction state: %llu bytes for %llu rows and a slot map of %llu",
                         (unsigned long long)n, (unsigned long long)rows,
                         (unsigned long long)last_n);
    /* Sizes of everything before any allocation: each archive's count against the bytes. */
    kvt__snap_cur ac = c;
    for (uint32_t h = 0; e->archive && h < e->n_heads; h++) {
        uint64_t an;
        if (!kvt__snap_get(&ac, &an, sizeof an) || !kvt__snap_take_n(&ac, an, 16 + row_all))
            return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                             "eviction state: archive of head %u runs past the section", h);
        if (env->archive_rows && an > env->archive_rows)
            return kvt__fail(env->err, env->err_len, KVT_ERR_CAPACITY,
                             "eviction state: head %u archived %llu rows, the context's "
                             "archive_rows_per_seq is %llu",
                             h, (unsigned long long)an, (unsigned long long)env->archive_rows);
    }
    if (ac.left != 0)
        return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                         "eviction state: %llu bytes after the state", (unsigned long long)ac.left);
    kvt_status rc = kvt__ev_reserve(e, env->alloc, rows);
    if (rc == KVT_OK && last_n) {
        void *p = e->last_map;
        rc = kvt__grow(env->alloc, &p, &e->last_map_cap, (uint64_t)e->n_heads * last_n,
                       sizeof *e->last_map);
        e->last_map = p;
    }
    if (rc != KVT_OK)
        return kvt__fail(env->err, env->err_len, rc, "eviction state: positions, slot map");
    for (uint32_t h = 0; h < e->n_heads && rows; h++)
        memcpy(e->pos + (size_t)h * e->pos_cap, pos + (size_t)h * rows * 8, 8 * rows);
    if (last_n)
        memcpy(e->last_map, map, 4 * (size_t)e->n_heads * last_n);
    for (uint32_t h = 0; e->archive && h < e->n_heads; h++) {
        kvt__ev_archive *ar = &e->archive[h];
        uint64_t an = 0;
        kvt__snap_get(&c, &an, sizeof an); /* sizes were checked above */
        if ((rc = archive_reserve(ar, env->alloc, an, row_all)) != KVT_OK)
            return kvt__fail(env->err, env->err_len, rc, "eviction state: archive of head %u", h);
        if (!an)
            continue;
        memcpy(ar->pos, kvt__snap_take(&c, 8 * an), 8 * an);
        memcpy(ar->by_pos, kvt__snap_take(&c, 8 * an), 8 * an);
        memcpy(ar->bytes, kvt__snap_take(&c, an * row_all), an * row_all);
        ar->n = an;
    }
    e->rounds = rounds;
    e->dropped = dropped;
    e->last_kept = last_kept;
    e->last_n = last_n;
    e->prompt_over_budget = (head[1] & 1u) != 0;
    char msg[KVT__ERR_LEN];
    if (kvt__ev_check(e, l->pt, cfg, l->appended, l->prompt_rows, msg, sizeof msg) != KVT_OK)
        return kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT, "eviction state: %s", msg);
    return KVT_OK;
}
