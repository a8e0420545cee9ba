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
 * each plane); then the table is cut to K + r rows and its trailing pages go back to the pool —
 * memory really freed, unlike the salience archive.
 *
 * Where it runs. The state this file keeps on the host is counts only (rows, rounds, archived
 * and dropped rows — all follow from N, K and r). Positions, keep sets, slot maps and the
 * archive are buffers of the backend's memory; a round is two backend calls for all the layers
 * it covers (ev_select, ev_apply: kernels/evict.h) and reads nothing back, so it adds no
 * synchronisation to a step. Inspection (row_state, positions, last_slot_map; the full check
 * and snapshots in evict_state.c) reads through the backend and synchronises.
 *
 * Failure safety. Everything a round allocates (the slot maps, keep sets, archive growth) is
 * allocated, and every keep set is selected, before the first byte moves; a failure there
 * returns with nothing observable changed and the next commit retries the round. Only a device
 * error in ev_apply can leave rows half moved: the group is then marked damaged.
 */
#include "tiers_internal.h"

#include "kernels/kvt_hd.h"
#include "kernels/philox.h"
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/sketch.h"
#include "kernels/topm.h"

#include <math.h>
#include <string.h>

/* First rows VaSE always keeps (its released code's "first 4 tokens", attention sinks). */
#define KVT__VASE_SINK_ROWS 4u

static uint64_t cadence_rows(const kvt_config *cfg) {
    return cfg->cadence_rows ? cfg->cadence_rows : cfg->recent_rows;
}

uint32_t kvt__ev_ratio_budget(const kvt_config *cfg, uint64_t rows, uint64_t prompt_rows) {
    const uint64_t P = cfg->protect_prompt ? (prompt_rows < rows ? prompt_rows : rows) : 0;
    const uint64_t ratio = cfg->ratio ? cfg->ratio : 1;
    uint64_t K = P + (rows - P + ratio - 1) / ratio;
    if (K < cfg->recent_rows)
        K = cfg->recent_rows;
    if (K < 1)
        K = 1;
    return K > (1u << 28) ? (1u << 28) : (uint32_t)K;
}

bool kvt__ev_round_due(const kvt_config *cfg, uint64_t n_rows) {
    return n_rows >= (uint64_t)cfg->evict_budget_rows + cfg->recent_rows + cadence_rows(cfg);
}

bool kvt__ev_prompt_over_budget(const kvt_config *cfg, uint64_t prompt_rows) {
    return cfg->protect_prompt && prompt_rows >= cfg->evict_budget_rows;
}

uint64_t kvt__ev_protected_rows(const kvt_config *cfg, uint64_t prompt_rows) {
    uint64_t K = cfg->evict_budget_rows;
    uint64_t L = 0;
    if (cfg->protect_prompt)
        L = kvt__ev_prompt_over_budget(cfg, prompt_rows) ? K - 1 : prompt_rows;
    if (cfg->evict_vase && L < KVT__VASE_SINK_ROWS)
        L = KVT__VASE_SINK_ROWS;
    return L < K ? L : K;
}

/* ------------------------------------------------------------------------------------------- */
/* State lifecycle: every array is a buffer of the backend's memory                             */
/* ------------------------------------------------------------------------------------------- */
kvt_status kvt__ev_init(kvt__ev *e, const kvt__backend *be, const kvt_layer_spec *spec,
                        bool archive) {
    memset(e, 0, sizeof *e);
    if (spec->n_kv_heads == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    e->be = be;
    e->n_heads = spec->n_kv_heads;
    e->archive = archive;
    e->ar_row_bytes = (size_t)spec->n_planes * spec->row_bytes;
    return KVT_OK;
}

static void buf_free(const kvt__backend *be, void *p, size_t bytes) {
    if (p)
        be->ops->buf_free(be, p, bytes);
}

/* The archive's row buffer, in the space the context placed it (ar_host). */
static kvt_status ar_rows_alloc(const kvt__ev *e, size_t bytes, void **out) {
    return e->ar_host ? e->be->ops->host_alloc(e->be, bytes, out)
                      : e->be->ops->buf_alloc(e->be, bytes, out);
}

static void ar_rows_free(const kvt__ev *e, void *p, size_t bytes) {
    if (p && e->ar_host)
        e->be->ops->host_free(e->be, p, bytes);
    else if (p)
        e->be->ops->buf_free(e->be, p, bytes);
}

void kvt__ev_fini(kvt__ev *e) {
    if (e->be) {
        const size_t H = e->n_heads;
        buf_free(e->be, e->pos, sizeof *e->pos * H * e->pos_cap);
        buf_free(e->be, e->last_map, sizeof *e->last_map * e->last_map_cap);
        buf_free(e->be, e->keep, sizeof *e->keep * e->keep_cap);
        ar_rows_free(e, e->ar_bytes, e->ar_row_bytes * H * e->ar_cap);
        buf_free(e->be, e->ar_pos, sizeof *e->ar_pos * H * e->ar_cap);
        buf_free(e->be, e->ar_by_pos, sizeof *e->ar_by_pos * H * e->ar_cap);
        buf_free(e->be, e->ar_csk, sizeof *e->ar_csk * e->sk_stride * H * e->ar_cap);
        buf_free(e->be, e->ar_rho, sizeof *e->ar_rho * H * e->ar_cap);
        buf_free(e->be, e->ar_branch, (size_t)e->br_bytes * H * e->ar_cap);
        buf_free(e->be, e->ar_ident, sizeof *e->ar_ident * e->ident_n);
    }
    memset(e, 0, sizeof *e);
}

/* Re-lay an [H][old_cap] array of elt-byte entries out as [H][cap] in a new buffer of the
 * backend (the first `used` entries of each head copied over on the device). */
static kvt_status relayout(const kvt__backend *be, void **arr, uint32_t H, uint64_t old_cap,
                           uint64_t cap, uint64_t used, size_t elt, void *stream) {
    if (cap > SIZE_MAX / elt / H)
        return KVT_ERR_OUT_OF_MEMORY;
    void *p = NULL;
    kvt_status s = be->ops->buf_alloc(be, elt * H * cap, &p);
    if (s != KVT_OK)
        return s;
    for (uint32_t h = 0; h < H && used; h++)
        if ((s = be->ops->copy(be, (uint8_t *)p + elt * h * cap,
                               (const uint8_t *)*arr + elt * h * old_cap, elt * used, stream)) !=
            KVT_OK) {
            be->ops->buf_free(be, p, elt * H * cap);
            return s;
        }
    buf_free(be, *arr, elt * H * old_cap);
    *arr = p;
    return KVT_OK;
}

/* Doubling from 64 up to at least n (O(1) amortised per decode-time reserve). */
static kvt_status doubled(uint64_t cap, uint64_t n, uint64_t *out) {
    cap = cap ? cap : 64;
    while (cap < n) {
        if (cap > UINT64_MAX / 2)
            return KVT_ERR_OUT_OF_MEMORY;
        cap *= 2;
    }
    *out = cap;
    return KVT_OK;
}

kvt_status kvt__ev_reserve(kvt__ev *e, uint64_t rows) {
    if (rows <= e->pos_cap)
        return KVT_OK;
    uint64_t cap;
    kvt_status s = doubled(e->pos_cap, rows, &cap);
    void *p = e->pos;
    if (s == KVT_OK &&
        (s = relayout(e->be, &p, e->n_heads, e->pos_cap, cap, e->pos_cap, sizeof *e->pos,
                      NULL)) ==
            KVT_OK) {
        e->pos = p;
        e->pos_cap = cap;
    }
    return s;
}

/* A flat buffer of the backend grown to n entries, its first `keep` entries copied over on the
 * device (0 for a round's scratch). */
static kvt_status flat_grow(const kvt__backend *be, void **arr, uint64_t *cap, uint64_t n,
                            size_t elt, uint64_t keep) {
    if (n <= *cap)
        return KVT_OK;
    if (n > SIZE_MAX / elt)
        return KVT_ERR_OUT_OF_MEMORY;
    void *p = NULL;
    kvt_status s = be->ops->buf_alloc(be, elt * n, &p);
    if (s != KVT_OK)
        return s;
    if (keep && (s = be->ops->copy(be, p, *arr, elt * keep, NULL)) != KVT_OK) {
        be->ops->buf_free(be, p, elt * n);
        return s;
    }
    buf_free(be, *arr, elt * *cap);
    *arr = p;
    *cap = n;
    return KVT_OK;
}

/* The slot map and keep sets of a round over N rows with budget K. The slot map of the last
 * round is published (kvt_seq_last_slot_map) until the next round rewrites it whole, and that
 * round can still fail for memory after this (keep sets, archive): growing it keeps the
 * published map. */
kvt_status kvt__ev_round_reserve(kvt__ev *e, uint64_t N, uint64_t K) {
    void *p = e->last_map;
    kvt_status s = flat_grow(e->be, &p, &e->last_map_cap, (uint64_t)e->n_heads * N,
                             sizeof *e->last_map, (uint64_t)e->n_heads * e->last_n);
    e->last_map = p;
    if (s != KVT_OK)
        return s;
    if (e->last_map_cap < (uint64_t)e->n_heads * e->last_n)
        return KVT_ERR_INVARIANT;
    p = e->keep;
    s = flat_grow(e->be, &p, &e->keep_cap, (uint64_t)e->n_heads * K, sizeof *e->keep, 0);
    e->keep = p;
    return s;
}

/* The identity page mirror of an archive of cap rows per head (entry i = i): ceil(cap /
 * page_rows) entries, written from the host once per growth. */
static kvt_status ident_grow(kvt__ev *e, uint64_t cap, int32_t **out, uint64_t *n_out) {
    const kvt__backend *be = e->be;
    const uint64_t n = (cap + e->page_rows - 1) / e->page_rows;
    *out = NULL;
    *n_out = n;
    if (n > INT32_MAX || n > SIZE_MAX / sizeof(int32_t))
        return KVT_ERR_OUT_OF_MEMORY;
    int32_t *host = kvt__malloc(be->alloc, sizeof *host * n);
    if (!host)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint64_t i = 0; i < n; i++)
        host[i] = (int32_t)i;
    void *p = NULL;
    kvt_status s = be->ops->buf_alloc(be, sizeof *host * n, &p);
    if (s == KVT_OK && (s = be->ops->write(be, p, host, sizeof *host * n, NULL)) != KVT_OK) {
        be->ops->buf_free(be, p, sizeof *host * n);
        p = NULL;
    }
    kvt__free(be->alloc, host, sizeof *host * n);
    *out = p;
    return s;
}

/* Grow the archive to hold `add` more rows per head: new buffers (rows, positions, lookup, and
 * with sketches csk and ρ) filled on the device (on `stream`, after the rounds that wrote the
 * old ones; NULL: synchronously), swapped in only when all succeeded (a failure changes
 * nothing). */
kvt_status kvt__ev_archive_reserve(kvt__ev *e, uint64_t add, void *stream) {
    uint64_t need = e->ar_n + add;
    if (need <= e->ar_cap)
        return KVT_OK;
    uint64_t cap = e->ar_cap + e->ar_cap / 2;
    if (cap < need)
        cap = need;
    const kvt__backend *be = e->be;
    const size_t H = e->n_heads;
    enum { N_AR = 6 };
    const int n_arr = e->sk_stride ? (e->br_bytes ? 6 : 5) : 3;
    const size_t elt[N_AR] = {e->ar_row_bytes, sizeof *e->ar_pos, sizeof *e->ar_by_pos,
                              sizeof *e->ar_csk * e->sk_stride, sizeof *e->ar_rho, e->br_bytes};
    /* rows already there worth copying: the sketches (and branches) only up to sk_n */
    const uint64_t used[N_AR] = {e->ar_n, e->ar_n, e->ar_n, e->sk_n, e->sk_n, e->sk_n};
    void *old[N_AR] = {e->ar_bytes, e->ar_pos, e->ar_by_pos, e->ar_csk, e->ar_rho, e->ar_branch};
    void *nw[N_AR] = {NULL, NULL, NULL, NULL, NULL, NULL};
    int32_t *ident = NULL;
    uint64_t ident_n = 0;
    kvt_status s = KVT_OK;
    for (int i = 0; i < n_arr && s == KVT_OK; i++) {
        s = cap > SIZE_MAX / elt[i] / H ? KVT_ERR_OUT_OF_MEMORY
            : i == 0                    ? ar_rows_alloc(e, elt[i] * H * cap, &nw[i])
                                        : be->ops->buf_alloc(be, elt[i] * H * cap, &nw[i]);
        for (size_t h = 0; s == KVT_OK && used[i] && h < H; h++)
            s = be->ops->copy(be, (uint8_t *)nw[i] + elt[i] * h * cap,
                              (const uint8_t *)old[i] + elt[i] * h * e->ar_cap,
                              elt[i] * used[i], stream);
    }
    if (s == KVT_OK && e->sk_stride)
        s = ident_grow(e, cap, &ident, &ident_n);
    for (int i = 0; i < n_arr; i++) {
        void *p = s == KVT_OK ? old[i] : nw[i];
        const size_t bytes = elt[i] * H * (s == KVT_OK ? e->ar_cap : cap);
        if (i == 0)
            ar_rows_free(e, p, bytes);
        else
            buf_free(be, p, bytes);
    }
    if (s != KVT_OK)
        return s;
    buf_free(be, e->ar_ident, sizeof *e->ar_ident * e->ident_n);
    e->ar_bytes = nw[0];
    e->ar_pos = nw[1];
    e->ar_by_pos = nw[2];
    e->ar_csk = nw[3];
    e->ar_rho = nw[4];
    e->ar_branch = nw[5];
    e->ar_ident = ident;
    e->ident_n = ident_n;
    e->ar_cap = cap;
    return KVT_OK;
}

kvt_status kvt__ev_prepare(kvt__ev *e, const kvt_config *cfg, uint64_t rows) {
    kvt_status rc = kvt__ev_reserve(e, rows);
    /* evict_ratio_budget: K grows with the request, up to its rows */
    const uint64_t K = cfg->evict_ratio_budget ? rows : cfg->evict_budget_rows;
    return rc == KVT_OK ? kvt__ev_round_reserve(e, rows, K) : rc;
}

static kvt__ev_append_args append_args(kvt__ev *e, uint64_t first_row, uint64_t first_pos,
                                       uint64_t n) {
    KVT_ASSERT(first_row + n <= e->pos_cap);
    return (kvt__ev_append_args){.pos = e->pos, .pos_cap = e->pos_cap, .n_heads = e->n_heads,
                                 .first_row = first_row, .first_pos = first_pos, .n = n};
}

kvt_status kvt__ev_append(kvt__ev *e, const kvt__backend *be, void *stream, uint64_t first_row,
                          uint64_t first_pos, uint64_t n) {
    if (n == 0)
        return KVT_OK;
    kvt__ev_append_args a = append_args(e, first_row, first_pos, n);
    return be->ops->ev_append(be, &a, 1, stream);
}

/* ------------------------------------------------------------------------------------------- */
/* Recall sketches of the archive (docs/recall.md §9)                                           */
/* ------------------------------------------------------------------------------------------- */
static bool float_dtype(kvt_dtype t) {
    return t == KVT_DTYPE_BF16 || t == KVT_DTYPE_FP16 || t == KVT_DTYPE_FP32;
}

bool kvt__spec_ds_mla(const kvt_layer_spec *sp) {
    return sp->dtype == KVT_DTYPE_FP8_E4M3 && sp->value_dim == KVT__FP8_VALUES &&
           sp->row_bytes == 656 &&
           sp->branch_offset == KVT__FP8_VALUES + 4 * (KVT__FP8_VALUES / KVT__FP8_GROUP) &&
           sp->branch_dtype == KVT_DTYPE_BF16 && sp->branch_dim == 64;
}

uint32_t kvt__ev_key_dim(const kvt_layer_spec *sp) {
    if (sp->n_planes == 2)
        return sp->head_dim;
    if (sp->n_planes == 1 && sp->kind == KVT_LAYER_MLA_ROPE && sp->n_kv_heads == 1 &&
        sp->branch_dim <= KVT__RECALL_MAX_BRANCH && float_dtype(sp->branch_dtype))
        return sp->value_dim;
    return 0;
}

uint32_t kvt__ev_sketch_stride(const kvt_layer_spec *sp, uint32_t stride) {
    const uint32_t D = kvt__ev_key_dim(sp);
    if (stride == 0 || D == 0 || D > KVT__SKETCH_MAX_DIM || !float_dtype(sp->dtype))
        return 0;
    return stride < D ? stride : D;
}

/* The sketch of archive rows [first, first + n) of head h: the archive of the head is a run of
 * ar_cap rows of ar_row_bytes (plane 0, the post-RoPE key, first), addressed through the
 * identity mirror as slots 0 .. ar_cap - 1; the head's basis from the store. */
static kvt__sketch_args archive_sketch_args(const kvt__env *env, const kvt__store *st,
                                            const kvt__ev *e, uint32_t h, uint64_t first,
                                            uint32_t n) {
    const kvt_layer_spec *sp = &st->spec;
    const uint32_t rank = st->kb_rank ? st->kb_rank[h] : 0;
    kvt__sketch_args a;
    memset(&a, 0, sizeof a);
    a.base = e->ar_bytes + (size_t)h * e->ar_cap * e->ar_row_bytes;
    a.pages = e->ar_ident;
    a.first_page = 0;
    a.pdiv = env->pdiv;
    a.first_row = first;
    a.n_rows = n;
    a.slot_stride = e->ar_row_bytes;
    a.dtype = (int)sp->dtype;
    a.latent_dim = kvt__ev_key_dim(sp);
    a.basis = rank ? st->kb_V + (size_t)h * st->kb_stride * a.latent_dim : NULL;
    a.rank = rank;
    a.csk_stride = e->sk_stride;
    a.csk = e->ar_csk + ((size_t)h * e->ar_cap + first) * e->sk_stride;
    a.rho = e->ar_rho + (size_t)h * e->ar_cap + first;
    return a;
}

/* Rows per sketch call of one head (a round archives cand - K rows: chunks keep the CPU
 * backend's scratch, which holds a chunk's slots, bounded). */
#define KVT__EV_SKETCH_ROWS 4096u
/* Sketch blocks per backend call (a stack array). */
#define KVT__EV_SKETCH_CHUNK 16u

/* Sketch archive rows [r0, r1) of heads [h0, h1) (the heads' bases from the store),
 * KVT__EV_SKETCH_ROWS rows a block, KVT__EV_SKETCH_CHUNK blocks a backend call. */
static kvt_status archive_sketch(const kvt__env *env, const kvt__store *st, const kvt__ev *e,
                                 uint32_t h0, uint32_t h1, uint64_t r0, uint64_t r1) {
    const kvt__backend *be = env->backend;
    kvt__sketch_args args[KVT__EV_SKETCH_CHUNK];
    uint32_t k = 0;
    kvt_status s = KVT_OK;
    for (uint32_t h = h0; h < h1 && s == KVT_OK; h++)
        for (uint64_t r = r0; r < r1 && s == KVT_OK; r += KVT__EV_SKETCH_ROWS) {
            uint64_t n = r1 - r < KVT__EV_SKETCH_ROWS ? r1 - r : KVT__EV_SKETCH_ROWS;
            args[k++] = archive_sketch_args(env, st, e, h, r, (uint32_t)n);
            if (k == KVT__EV_SKETCH_CHUNK) {
                s = be->ops->sketch_rows(be, args, k, env->stream);
                k = 0;
            }
        }
    if (s == KVT_OK && k)
        s = be->ops->sketch_rows(be, args, k, env->stream);
    return s;
}

/* The policy's resketch: head h's archived rows [0, sk_n) sketched again with the head's basis
 * (just replaced). The branches (a host archive's device copy) do not depend on the basis. */
static kvt_status ev_resketch(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                              uint32_t h, uint64_t epoch) {
    (void)epoch; /* nothing is shared between requests */
    kvt__ev *e = &s->ev;
    if (!e->archive || e->sk_stride == 0 || e->sk_n == 0 || h >= e->n_heads)
        return KVT_OK;
    kvt_status rc = archive_sketch(env, l->st, e, h, h + 1, 0, e->sk_n);
    return rc == KVT_OK ? KVT_OK
                        : kvt__fail(env->err, env->err_len, rc,
                                    "evict: sketching KV head %u's archived rows of layer %u again",
                                    h, l->st->layer);
}

kvt_status kvt__ev_sketch_pending(const kvt__env *env, const kvt__store *st, kvt__ev *e) {
    if (!e->archive || e->sk_stride == 0 || e->sk_n >= e->ar_n)
        return KVT_OK;
    KVT_ASSERT(e->page_rows == env->page_rows && st->spec.n_kv_heads == e->n_heads);
    const kvt__backend *be = env->backend;
    kvt_status s = archive_sketch(env, st, e, 0, e->n_heads, e->sk_n, e->ar_n);
    /* a host archive's rotated branches into their device plane (what the scan reads) */
    for (uint32_t h = 0; h < e->n_heads && s == KVT_OK && e->br_bytes; h++)
        s = be->ops->copy_rows(be, e->ar_branch + ((size_t)h * e->ar_cap + e->sk_n) * e->br_bytes,
                               e->br_bytes,
                               e->ar_bytes + ((size_t)h * e->ar_cap + e->sk_n) * e->ar_row_bytes +
                                   e->br_offset,
                               e->ar_row_bytes, e->br_bytes, e->ar_n - e->sk_n, env->stream);
    if (s != KVT_OK)
        return kvt__fail(env->err, env->err_len, s,
                         "sketching archived rows %llu..%llu of layer %u failed; retried at the "
                         "next commit",
                         (unsigned long long)e->sk_n, (unsigned long long)e->ar_n, st->layer);
    e->sk_n = e->ar_n;
    return KVT_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* The round                                                                                   */
/* ------------------------------------------------------------------------------------------- */
/* One layer of one request in a round: a commit runs the layers of one request's group
 * together, a step's run one layer of many requests. */
typedef struct ev_job {
    kvt__store *st;
    kvt__ev *e;
    const kvt__ptable *pt;
    uint64_t N;           /* rows per head the layer holds */
    uint64_t prompt_rows;
    const kvt_config *cfg;
    uint64_t philox_key;
    kvt_status status;    /* out */
    bool moving;          /* reached the moves */
} ev_job;

/* The description of one layer's round for the backend (kernels/evict.h). */
static kvt__ev_args round_args(const kvt__env *env, const ev_job *j) {
    const kvt_config *cfg = j->cfg;
    const kvt__store *st = j->st;
    const kvt__ev *e = j->e;
    const kvt_layer_spec *sp = &st->spec;
    kvt__ev_args a = {
        .plane = {st->plane[0], sp->n_planes > 1 ? st->plane[1] : NULL},
        .n_planes = sp->n_planes,
        .slot_bytes = st->slot_bytes,
        .row_bytes = sp->row_bytes,
        .n_heads = e->n_heads,
        .dtype = (int)sp->dtype,
        /* VaSE's value range: plane 1 (V) for GQA, the first value_dim values (the latent part,
         * which is the value) for MLA; fp8 rows in the ds_mla layout only (kvt_hd.h decodes them
         * with their scales; any other fp8 layout is refused at context creation). */
        .value_dim = sp->value_dim,
        .value_plane = sp->n_planes > 1 ? 1 : 0,
        .pages = j->pt->dpages, /* the mirror */
        .first_page = j->pt->first_page,
        .pdiv = env->pdiv,
        .pos = e->pos,
        .pos_cap = e->pos_cap,
        .keep = e->keep,
        .map = e->last_map,
        .ar_bytes = e->archive ? e->ar_bytes : NULL,
        .ar_pos = e->ar_pos,
        .ar_by_pos = e->ar_by_pos,
        .ar_n = e->ar_n,
        .ar_cap = e->ar_cap,
        .N = j->N,
        .K = cfg->evict_budget_rows,
        .r = cfg->recent_rows,
        .L = kvt__ev_protected_rows(cfg, j->prompt_rows),
        .vase = cfg->evict_vase,
        .philox_key = j->philox_key,
        .round = (uint32_t)e->rounds,
        .layer = st->layer + env->layer_offset,
        .head_offset = env->head_offset,
        .shared_draw = cfg->evict_shared_draw,
    };
    return a;
}

/* Layers handed to the backend per call (a stack array: a round allocates nothing on the host). */
#define KVT__EV_CHUNK 16u

/* Run the backend op over every job still KVT_OK, KVT__EV_CHUNK at a time; a failed call sets
 * its chunk's jobs to its status. */
static void ev_call(const kvt__env *env, ev_job *jobs, uint32_t n, bool apply) {
    const kvt__backend *be = env->backend;
    kvt__ev_args args[KVT__EV_CHUNK];
    uint32_t at[KVT__EV_CHUNK], k = 0;
    for (uint32_t i = 0; i <= n; i++) {
        if (i < n && jobs[i].status == KVT_OK) {
            args[k] = round_args(env, &jobs[i]);
            at[k++] = i;
        }
        if (k == KVT__EV_CHUNK || (i == n && k)) {
            kvt_status rc = apply ? be->ops->ev_apply(be, args, k, env->stream)
                                  : be->ops->ev_select(be, args, k, env->stream);
            for (uint32_t x = 0; rc != KVT_OK && x < k; x++)
                jobs[at[x]].status = rc;
            k = 0;
        }
    }
}

/* Capacity of one job's round (grow-only: nothing to do when the state was sized for a stated
 * limit). KVT_OK or a status with a message; nothing observable changes. */
static kvt_status job_reserve(const kvt__env *env, ev_job *j) {
    const uint64_t K = j->cfg->evict_budget_rows, cand = j->N - j->cfg->recent_rows;
    KVT_ASSERT(j->e->n_heads == j->st->spec.n_kv_heads && j->e->pos_cap >= j->N);
    if (j->N > INT32_MAX)
        return kvt__fail(env->err, env->err_len, KVT_ERR_UNSUPPORTED,
                         "eviction round over %llu rows: row indices must fit in int32",
                         (unsigned long long)j->N);
    kvt_status s = kvt__ev_round_reserve(j->e, j->N, K);
    if (s == KVT_OK && j->e->archive)
        s = kvt__ev_archive_reserve(j->e, cand - K, env->stream); /* after the earlier rounds */
    if (s != KVT_OK)
        return kvt__fail(env->err, env->err_len, s,
                         "eviction round: slot map / keep sets / archive of layer %u; nothing "
                         "was evicted",
                         j->st->layer);
    return KVT_OK;
}

/* After a job's moves: the counts, which follow from N, K and r (no read-back). */
static void job_done(const ev_job *j) {
    kvt__ev *e = j->e;
    const uint64_t K = j->cfg->evict_budget_rows, r = j->cfg->recent_rows;
    if (e->archive)
        e->ar_n += j->N - r - K;
    else
        e->dropped += (j->N - r - K) * e->n_heads;
    e->last_n = j->N;
    e->last_kept = K + r;
    e->rounds++;
    if (kvt__ev_prompt_over_budget(j->cfg, j->prompt_rows))
        e->prompt_over_budget = true;
}

static kvt_status damaged_msg(const kvt__env *env, uint32_t layer, kvt_status why) {
    return kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT,
                     "eviction round: moving rows of layer %u failed (%s); the sequence is "
                     "damaged and must be destroyed",
                     layer, kvt_status_name(why));
}

/* Rounds of up to KVT__EV_CHUNK independent jobs (one layer of as many requests: a step's
 * run), in one select and one apply call. Each job's status says how it went: a failure before
 * the moves changed nothing of that request (the commit retries it); one in the moves damaged
 * it. */
static void round_independent(const kvt__env *env, ev_job *jobs, uint32_t n) {
    KVT_ASSERT(n <= KVT__EV_CHUNK);
    for (uint32_t i = 0; i < n; i++)
        jobs[i].status = job_reserve(env, &jobs[i]);
    ev_call(env, jobs, n, false);
    for (uint32_t i = 0; i < n; i++)
        jobs[i].moving = jobs[i].status == KVT_OK;
    ev_call(env, jobs, n, true);
    for (uint32_t i = 0; i < n; i++) {
        ev_job *j = &jobs[i];
        if (j->moving && j->status == KVT_OK) {
            job_done(j);
        } else if (j->moving) {
            j->e->damaged = true;
            j->status = damaged_msg(env, j->st->layer, j->status);
        } else if (j->status != KVT_OK && j->status != KVT_ERR_OUT_OF_MEMORY &&
                   j->status != KVT_ERR_UNSUPPORTED) {
            kvt__fail(env->err, env->err_len, j->status,
                      "eviction round: selecting layer %u's keep sets failed; nothing was "
                      "evicted",
                      j->st->layer);
        }
    }
}

/* One round over the given layers of one request's group, whose table holds N rows per head
 * (the table's committed rows, or those plus the rows of a step in flight): they share the
 * table, so they go together — every capacity, then every keep set (batched selects), and only
 * then the moves (batched applies); any failure before the moves changes nothing, one in them
 * damages every layer. The table itself (its n_rows, its pages) is left to the caller. */
static kvt_status round_core(const kvt__env *env, kvt__store *const *stores,
                             kvt__ev *const *states, uint32_t n_layers, const kvt__ptable *pt,
                             uint64_t N, uint64_t prompt_rows) {
    const uint64_t K = env->cfg->evict_budget_rows, r = env->cfg->recent_rows;
    if (N < r || N - r <= K)
        return KVT_OK; /* nothing to evict */
    ev_job jobs[KVT__EV_CHUNK];
    kvt_status rc = KVT_OK;
    for (int phase = 0; phase < 3; phase++) {
        for (uint32_t l0 = 0; l0 < n_layers; l0 += KVT__EV_CHUNK) {
            uint32_t n = n_layers - l0 < KVT__EV_CHUNK ? n_layers - l0 : KVT__EV_CHUNK;
            for (uint32_t k = 0; k < n; k++)
                jobs[k] = (ev_job){.st = stores[l0 + k], .e = states[l0 + k], .pt = pt, .N = N,
                                   .prompt_rows = prompt_rows, .cfg = env->cfg,
                                   .philox_key = env->philox_key};
            if (phase == 0) {
                for (uint32_t k = 0; k < n; k++)
                    if ((rc = job_reserve(env, &jobs[k])) != KVT_OK)
                        return rc;
                continue;
            }
            ev_call(env, jobs, n, phase == 2);
            for (uint32_t k = 0; k < n; k++) {
                if (jobs[k].status == KVT_OK)
                    continue;
                if (phase == 1)
                    return kvt__fail(env->err, env->err_len, jobs[k].status,
                                     "eviction round: selecting layer %u's keep sets failed; "
                                     "nothing was evicted",
                                     jobs[k].st->layer);
                for (uint32_t x = 0; x < n_layers; x++)
                    states[x]->damaged = true;
                return damaged_msg(env, jobs[k].st->layer, jobs[k].status);
            }
            for (uint32_t k = 0; phase == 2 && k < n; k++)
                job_done(&jobs[k]);
        }
    }
    return KVT_OK;
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
/* The policy table (policy.h)                                                                  */
/* ------------------------------------------------------------------------------------------- */
/* Rounds need rows; VaSE's value range reads fp8 rows in the ds_mla layout only (its scales
 * within the row: kvt__load_elem), the first value_dim = 512 latent values. */
static kvt_status ev_supports_layer(const kvt_layer_spec *sp, uint32_t i, const kvt_config *cfg,
                                    char *err, size_t len) {
    if (sp->kind == KVT_LAYER_NO_KV)
        return kvt__fail(err, len, KVT_ERR_POLICY_MISMATCH,
                         "layer %u has no per-token KV (%s); only policy none applies", i,
                         kvt_layer_kind_name(sp->kind));
    if (cfg->evict_vase && sp->dtype == KVT_DTYPE_FP8_E4M3 && !kvt__spec_ds_mla(sp))
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "config.evict_vase: layer %u stores fp8 rows in a layout other than the "
                         "656-B ds_mla row (512 fp8 values, 4 fp32 scales, 64 bf16 branch values "
                         "at byte 528), the only one whose values kvtier decodes",
                         i);
    return KVT_OK;
}

/* Rows past the budget leave the pool (dropped, or copied to the archive); the budget is
 * attended. */
static void ev_census(uint64_t stored, uint64_t budget, uint64_t *attended, uint64_t *freed) {
    *attended = budget;
    *freed = stored - budget;
}

/* A decode step's largest round: K + r + c rows and up to 64 tokens of the step, the group's
 * layers in one call (at most 16). */
static void ev_step_bounds(const kvt__group *gr, const kvt__store *st, const kvt_config *c,
                           kvt__ws_bounds *x) {
    const uint64_t cad = c->cadence_rows ? c->cadence_rows : c->recent_rows;
    x->round = (kvt__ev_args){.n_planes = st->spec.n_planes, .slot_bytes = st->slot_bytes,
                              .row_bytes = st->spec.row_bytes, .n_heads = st->spec.n_kv_heads,
                              .N = (uint64_t)c->evict_budget_rows + c->recent_rows + cad + 64,
                              .K = c->evict_budget_rows, .r = c->recent_rows};
    x->round_layers = gr->n_layers < 16u ? gr->n_layers : 16u;
}

static kvt_status ev_layer_init(kvt__tier_state *s, const kvt__env *env, const kvt__store *st) {
    /* Buffers from the context's backend: they outlive every call. */
    kvt_status rc = kvt__ev_init(&s->ev, env->home, &st->spec, env->cfg->evict_archive);
    s->ev.ar_host = env->archive_host;
    /* Archive sketches (recall on RoPE layers) when the context builds sketch planes. */
    s->ev.sk_stride = kvt__ev_sketch_stride(&st->spec, env->sketch_stride);
    if (s->ev.sk_stride && s->ev.ar_host && st->spec.n_planes == 1 && st->spec.branch_dim) {
        s->ev.br_bytes = st->spec.branch_dim * (uint32_t)kvt_dtype_bytes(st->spec.branch_dtype);
        s->ev.br_offset = st->spec.branch_offset;
    }
    s->ev.page_rows = env->page_rows;
    /* With a stated limit the table never holds more than K + r + c rows plus one step's (at
     * most max_rows); size for max_rows so that no round allocates. */
    if (rc == KVT_OK && env->max_rows)
        rc = kvt__ev_prepare(&s->ev, env->cfg, env->max_rows);
    /* A stated archive limit: the archive is allocated now, rounds never grow it. */
    if (rc == KVT_OK && s->ev.archive && env->archive_rows)
        rc = kvt__ev_archive_reserve(&s->ev, env->archive_rows, NULL);
    if (rc != KVT_OK)
        return kvt__fail(env->err, env->err_len, rc, "eviction state of layer %u", st->layer);
    return KVT_OK;
}

/* Counts back to zero; positions, slot maps, keep sets and archives keep their capacity. */
static kvt_status ev_layer_reset(kvt__tier_state *s, const kvt__env *env, const kvt__store *st) {
    (void)env;
    (void)st;
    kvt__ev *e = &s->ev;
    e->last_n = e->last_kept = e->rounds = e->dropped = e->ar_n = e->sk_n = 0;
    e->prompt_over_budget = e->damaged = e->step_appended = e->step_round = false;
    e->archive = env->cfg->evict_archive && e->ar_row_bytes; /* the new request's choice */
    return KVT_OK;
}

static void ev_layer_fini(kvt__tier_state *s, const kvt__alloc *a) {
    (void)a;
    kvt__ev_fini(&s->ev);
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
        /* every head archives the same count */
        if (e->ar_n + evicted > env->archive_rows)
            return kvt__fail(env->err, env->err_len, KVT_ERR_ARCHIVE_FULL,
                             "layer %u: each head's archive holds %llu of %llu rows and the "
                             "step's round would add %llu",
                             st->layer, (unsigned long long)e->ar_n,
                             (unsigned long long)env->archive_rows, (unsigned long long)evicted);
    }
    kvt_status rc = kvt__ev_reserve(e, rows);
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
/* A round is due at the step's rows (the step's positions alone the commit records as well). */
static bool ev_step_due(const kvt__tier_step *t) {
    return kvt__ev_round_due(t->cfg, t->pt->n_rows + t->step_rows);
}

static kvt_status ev_layer_step(const kvt__env *env, kvt__tier_step *t, uint32_t n) {
    ev_job jobs[KVT__EV_CHUNK];
    kvt__ev_append_args app[KVT__EV_CHUNK];
    uint32_t at[KVT__EV_CHUNK];
    kvt_status first = KVT_OK;
    for (uint32_t i0 = 0; i0 < n; i0 += KVT__EV_CHUNK) {
        uint32_t m = n - i0 < KVT__EV_CHUNK ? n - i0 : KVT__EV_CHUNK, k = 0;
        /* 1. The step's positions of every request: one backend call. On failure nothing was
         * recorded for them (the commit records them) and they run no round. */
        for (uint32_t x = 0; x < m; x++) {
            kvt__tier_step *q = &t[i0 + x];
            app[x] = append_args(&q->state->ev, q->pt->n_rows, q->appended, q->step_rows);
        }
        kvt_status rc = env->backend->ops->ev_append(env->backend, app, m, env->stream);
        for (uint32_t x = 0; x < m; x++) {
            kvt__tier_step *q = &t[i0 + x];
            kvt__ev *e = &q->state->ev;
            const uint64_t N = q->pt->n_rows + q->step_rows;
            q->status = rc;
            if (rc != KVT_OK)
                continue;
            e->step_appended = true;
            if (kvt__ev_round_due(q->cfg, N)) {
                jobs[k] = (ev_job){.st = q->st, .e = e, .pt = q->pt, .N = N,
                                   .prompt_rows = q->prompt_rows, .cfg = q->cfg,
                                   .philox_key = q->philox_key};
                at[k++] = i0 + x;
            }
        }
        if (rc != KVT_OK) {
            kvt__fail(env->err, env->err_len, rc, "recording the step's positions");
            if (first == KVT_OK)
                first = rc;
            continue;
        }
        /* 2. The due rounds of those requests: one select and one apply call. */
        round_independent(env, jobs, k);
        for (uint32_t x = 0; x < k; x++) {
            t[at[x]].status = jobs[x].status;
            if (jobs[x].status == KVT_OK) {
                jobs[x].e->step_round = true;
                /* The rows just archived get their sketches now, so that the recall trigger
                 * of this step's attention sees them; a failure is left to the commit, which
                 * retries it (its message goes to a scratch buffer: the step did not fail). */
                char msg[KVT__ERR_LEN];
                kvt__env quiet = *env;
                quiet.err = msg;
                quiet.err_len = sizeof msg;
                (void)kvt__ev_sketch_pending(&quiet, jobs[x].st, jobs[x].e);
            } else if (first == KVT_OK)
                first = jobs[x].status;
        }
    }
    return first;
}

/* A round due once the table holds rows_after compacts every row past the protected prefix. */
static uint64_t ev_writes_from(const kvt__tier_state *s, const kvt_config *cfg, uint64_t n_rows,
                               uint64_t rows_after, uint64_t prompt_rows) {
    (void)s;
    if (!kvt__ev_round_due(cfg, rows_after))
        return n_rows;
    uint64_t L = kvt__ev_protected_rows(cfg, prompt_rows);
    return L < n_rows ? L : n_rows;
}

/* Copy H rows of n entries (strided by the caps) from one backend array to another. */
static kvt_status copy_strided(const kvt__backend *be, void *dst, uint64_t dst_cap,
                               const void *src, uint64_t src_cap, uint32_t H, uint64_t n,
                               size_t elt) {
    for (uint32_t h = 0; h < H && n; h++) {
        kvt_status s = be->ops->copy(be, (uint8_t *)dst + elt * h * dst_cap,
                                     (const uint8_t *)src + elt * h * src_cap, elt * n, NULL);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}

static kvt_status ev_layer_fork(kvt__tier_state *dst_s, kvt__tier_state *src_s,
                                const kvt__env *env, const kvt__store *st, uint64_t rows) {
    kvt__ev *d = &dst_s->ev;
    const kvt__ev *e = &src_s->ev;
    const kvt__backend *be = d->be;
    const uint32_t H = e->n_heads;
    kvt_status s = kvt__ev_reserve(d, rows);
    if (s == KVT_OK && e->last_n)
        s = kvt__ev_round_reserve(d, e->last_n, env->cfg->evict_budget_rows);
    if (s == KVT_OK && e->archive && d->archive)
        s = kvt__ev_archive_reserve(d, e->ar_n, NULL);
    if (s == KVT_OK)
        s = copy_strided(be, d->pos, d->pos_cap, e->pos, e->pos_cap, H, rows, sizeof *e->pos);
    if (s == KVT_OK && e->last_n)
        s = be->ops->copy(be, d->last_map, e->last_map, sizeof *e->last_map * H * e->last_n,
                          NULL);
    if (s == KVT_OK && e->archive && d->archive && e->ar_n) {
        s = copy_strided(be, d->ar_bytes, d->ar_cap, e->ar_bytes, e->ar_cap, H, e->ar_n,
                         e->ar_row_bytes);
        if (s == KVT_OK)
            s = copy_strided(be, d->ar_pos, d->ar_cap, e->ar_pos, e->ar_cap, H, e->ar_n,
                             sizeof *e->ar_pos);
        if (s == KVT_OK)
            s = copy_strided(be, d->ar_by_pos, d->ar_cap, e->ar_by_pos, e->ar_cap, H, e->ar_n,
                             sizeof *e->ar_by_pos);
        /* the sketches built so far (the same stride: one context) */
        if (s == KVT_OK && d->sk_stride && d->sk_stride == e->sk_stride)
            s = copy_strided(be, d->ar_csk, d->ar_cap, e->ar_csk, e->ar_cap, H, e->sk_n,
                             sizeof *e->ar_csk * e->sk_stride);
        if (s == KVT_OK && d->sk_stride && d->sk_stride == e->sk_stride)
            s = copy_strided(be, d->ar_rho, d->ar_cap, e->ar_rho, e->ar_cap, H, e->sk_n,
                             sizeof *e->ar_rho);
        if (s == KVT_OK && d->sk_stride == e->sk_stride && d->br_bytes && e->br_bytes)
            s = copy_strided(be, d->ar_branch, d->ar_cap, e->ar_branch, e->ar_cap, H, e->sk_n,
                             e->br_bytes);
    }
    if (s != KVT_OK)
        return kvt__fail(env->err, env->err_len, s, "forking the eviction state of layer %u",
                         st->layer);
    d->last_n = e->last_n;
    d->last_kept = e->last_kept;
    d->rounds = e->rounds;
    d->dropped = e->dropped;
    d->prompt_over_budget = e->prompt_over_budget;
    d->ar_n = e->archive && d->archive ? e->ar_n : 0;
    d->sk_n = d->ar_n && d->sk_stride == e->sk_stride ? e->sk_n : 0;
    return KVT_OK;
}

/* Rows [0, rows) of src are positions [0, rows) in every head while no round ran, or inside the
 * protected prefix, which no round moves. */
/* The prompt length cannot change after a round, so the protected prefix is what every round
 * kept in place; before the first round every row is where it was written. */
static uint64_t ev_attach_rows(const kvt__tier_state *src_s, const kvt_config *cfg,
                               uint64_t src_prompt_rows) {
    return src_s->ev.rounds > 0 ? kvt__ev_protected_rows(cfg, src_prompt_rows) : UINT64_MAX;
}

static kvt_status ev_layer_attach(kvt__tier_state *dst_s, kvt__tier_state *src_s,
                                  const kvt__env *env, const kvt__store *st, uint64_t rows,
                                  uint64_t src_prompt_rows) {
    kvt__ev *d = &dst_s->ev;
    const uint64_t L = ev_attach_rows(src_s, env->cfg, src_prompt_rows);
    if (rows > L)
        return kvt__fail(env->err, env->err_len, KVT_ERR_UNSUPPORTED,
                         "layer %u: rows past the %llu its eviction rounds protect have moved; "
                         "attach at most that prefix (asked %llu)",
                         st->layer, (unsigned long long)L, (unsigned long long)rows);
    kvt_status s = kvt__ev_reserve(d, rows);
    if (s == KVT_OK)
        s = kvt__ev_append(d, env->backend, NULL, 0, 0, rows);
    return s == KVT_OK ? KVT_OK
                       : kvt__fail(env->err, env->err_len, s, "positions of layer %u", st->layer);
}

static uint64_t ev_held_rows(const kvt__tier_state *s, uint64_t rows) {
    return s->ev.step_round ? s->ev.last_kept : rows;
}

/* Record the new rows' positions in every layer that did not in a step (capacity was grown at
 * reserve: cannot fail), then run the round when one is due: the layers of the group together
 * (they share the page table), except those that already ran theirs in the step. A group some of
 * whose layers compacted in the step while the others now fail cannot be made to agree again:
 * it is marked damaged (KVT_ERR_CORRUPT). */
static kvt_status ev_group_rounds(const kvt__env *env, const kvt__tier_group *g) {
    kvt__group *gr = g->gr;
    uint32_t stepped = 0;
    /* The new rows' positions in the layers whose run did not record them: batched calls. */
    kvt__ev_append_args app[KVT__EV_CHUNK];
    uint32_t m = 0;
    for (uint32_t k = 0; k <= gr->n_layers; k++) {
        kvt__ev *e = k < gr->n_layers ? &g->states[gr->layers[k]].ev : NULL;
        if (e && g->new_rows > 0 && !e->step_appended)
            app[m++] = append_args(e, g->pt->n_rows - g->new_rows, g->appended - g->new_rows,
                                   g->new_rows);
        if (m == KVT__EV_CHUNK || (!e && m)) {
            if (env->backend->ops->ev_append(env->backend, app, m, env->stream) != KVT_OK) {
                /* A device error: the positions of committed rows are unknown (no retry
                 * repeats the append) */
                for (uint32_t x = 0; x < gr->n_layers; x++)
                    g->states[gr->layers[x]].ev.damaged = true;
                return kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT,
                                 "recording positions failed on the device; the sequence is "
                                 "damaged and must be destroyed");
            }
            m = 0;
        }
    }
    for (uint32_t k = 0; k < gr->n_layers; k++) {
        kvt__ev *e = &g->states[gr->layers[k]].ev;
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

/* The rounds, then the sketches of every row archived and not yet sketched (this commit's round,
 * or an earlier one whose sketch failed: retried here). */
static kvt_status ev_group_commit(const kvt__env *env, const kvt__tier_group *g) {
    kvt_status s = ev_group_rounds(env, g);
    for (uint32_t k = 0; s == KVT_OK && k < g->gr->n_layers; k++) {
        const uint32_t l = g->gr->layers[k];
        s = kvt__ev_sketch_pending(env, &g->stores[l], &g->states[l].ev);
    }
    return s;
}

/* The archive as the RoPE recall trigger reads it (policy.h recall_rope_view). */
static kvt_status ev_recall_rope_view(const kvt__tier_layer *l, kvt__rope_view *a, char *err,
                                      size_t len) {
    const kvt__ev *e = &l->state->ev;
    const kvt__store *st = l->st;
    const kvt_layer_spec *sp = &st->spec;
    if (!e->archive || e->sk_stride == 0)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "layer %u has %s: recall on a RoPE layer reads the archive's sketches "
                         "(config.evict_archive, params.recall_sketch_rank > 0, two planes of "
                         "bf16/fp16/fp32)",
                         st->layer, e->archive ? "no archive sketches" : "no archive");
    if (e->sk_n != e->ar_n)
        return kvt__fail(err, len, KVT_ERR_BAD_STATE,
                         "layer %u: %llu of %llu archived rows sketched (a failed sketch, "
                         "retried at the next commit)",
                         st->layer, (unsigned long long)e->sk_n, (unsigned long long)e->ar_n);
    /* (the RoPE step's own limits are recall's to check: kvt__recall_rope_view_of) */
    const uint32_t D = kvt__ev_key_dim(sp);
    memset(a, 0, sizeof *a);
    a->plane[0] = st->plane[0];
    a->plane[1] = st->plane[1];
    a->n_planes = sp->n_planes;
    a->pages = l->pt->dpages;
    a->first_page = l->pt->first_page;
    a->pdiv = l->pdiv;
    a->slot_stride = st->slot_bytes;
    a->row_bytes = sp->row_bytes;
    a->n_rows = l->pt->n_rows;
    a->dtype = (int)sp->dtype;
    a->D = D;
    if (sp->n_planes == 1) { /* MLA-RoPE: the rotated branch scored exactly */
        a->branch_dim = sp->branch_dim;
        a->branch_offset = sp->branch_offset;
        a->branch_dtype = (int)sp->branch_dtype;
    }
    a->n_kv = e->n_heads;
    a->group = sp->n_q_heads / e->n_heads;
    a->ar_bytes = e->ar_bytes;
    a->ar_row_bytes = e->ar_row_bytes;
    a->ar_cap = e->ar_cap;
    a->ar_n = e->ar_n;
    a->ar_ident = e->ar_ident;
    a->capped = e->ar_host;
    a->ar_branch = e->ar_branch; /* a host archive's branches, in the backend's memory */
    a->ar_branch_bytes = e->br_bytes;
    a->csk = e->ar_csk;
    a->rho = e->ar_rho;
    a->csk_stride = e->sk_stride;
    a->basis = st->kb_V;
    a->basis_stride = st->kb_stride;
    a->rank = st->kb_rank;
    return KVT_OK;
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
    return kvt__ev_archive_find(e, head, pos) >= 0 ? KVT_ROW_ARCHIVED : KVT_ROW_DROPPED;
}

static kvt_status ev_read_archived(const kvt__tier_layer *l, uint32_t head, uint32_t plane,
                                   uint64_t pos, void *dst) {
    return kvt__ev_read_archived(&l->state->ev, &l->st->spec, head, plane, pos, dst);
}

static kvt_status ev_positions(const kvt__tier_layer *l, uint32_t head, int64_t *out) {
    const kvt__ev *e = &l->state->ev;
    if (l->pt->n_rows == 0)
        return KVT_OK;
    return e->be->ops->read(e->be, out, e->pos + (size_t)head * e->pos_cap,
                            sizeof *out * l->pt->n_rows, NULL);
}

static kvt_status ev_last_slot_map(const kvt__tier_layer *l, uint32_t head, int32_t *out,
                                   uint64_t *n) {
    const kvt__ev *e = &l->state->ev;
    *n = e->last_n;
    if (!out || e->last_n == 0)
        return KVT_OK;
    return e->be->ops->read(e->be, out, e->last_map + (size_t)head * e->last_n,
                            sizeof *out * e->last_n, NULL);
}

static bool ev_prompt_used(const kvt__tier_state *s) {
    return s->ev.rounds > 0;
}

static bool ev_damaged(const kvt__tier_state *s) {
    return s->ev.damaged;
}

static uint64_t archived_rows(const kvt__ev *e) {
    return e->archive ? e->ar_n * e->n_heads : 0;
}

static void ev_stats(const kvt__tier_layer *l, kvt_layer_stats *out) {
    const kvt__ev *e = &l->state->ev;
    const kvt_layer_spec *sp = &l->st->spec;
    out->rounds = e->rounds;
    out->dropped_rows = e->dropped;
    out->prompt_over_budget = e->prompt_over_budget;
    out->archived_rows = archived_rows(e);
    out->archive_bytes = out->archived_rows * sp->n_planes * (uint64_t)sp->row_bytes;
    out->archive_space = e->ar_host ? KVT_SPACE_HOST : KVT_SPACE_DEVICE;
    if (e->archive && e->sk_stride) {
        const kvt__store *st = l->st;
        out->sketched_rows = e->sk_n * e->n_heads;
        for (uint32_t h = 0; st->kb_rank && h < e->n_heads; h++)
            if (st->kb_rank[h] > out->recall_rank)
                out->recall_rank = st->kb_rank[h];
        out->recall_basis_id = st->kb_id ? st->kb_id[0] : 0; /* head 0's */
    }
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

/* Positions, slot map, keep sets, the archive's position indices and, when it is sketched, its
 * sketch planes (csk, ρ) and identity mirror (its rows count in archive_bytes); nothing is shared
 * (a fork copies them). */
/* A stated archive (policy.h archive_bytes_at_create): every plane's row of every KV head, for
 * archive_rows rows, allocated whole at kvt_seq_create. */
static uint64_t ev_archive_bytes_at_create(const kvt_layer_spec *sp, uint64_t archive_rows,
                                           bool archive) {
    return archive ? (uint64_t)sp->n_planes * sp->n_kv_heads * sp->row_bytes * archive_rows : 0;
}

static void ev_side_bytes(const kvt__tier_state *s, uint64_t *own, uint64_t *shared,
                          const void **key, uint32_t *holders) {
    const kvt__ev *e = &s->ev;
    const uint64_t H = e->n_heads;
    *own = sizeof *e->pos * H * e->pos_cap + sizeof *e->last_map * e->last_map_cap +
           sizeof *e->keep * e->keep_cap + (sizeof *e->ar_pos + sizeof *e->ar_by_pos) * H * e->ar_cap;
    if (e->ar_csk)
        *own += (sizeof *e->ar_csk * e->sk_stride + sizeof *e->ar_rho) * H * e->ar_cap;
    if (e->ar_ident)
        *own += sizeof *e->ar_ident * e->ident_n;
    *own += (uint64_t)e->br_bytes * H * e->ar_cap;
    *shared = 0;
    *key = NULL;
    *holders = 1;
}

const kvt__policy_ops kvt__policy_evict = {
    .rows_are_positions = false,
    .dropped_how = "by random eviction",
    .layer_init = ev_layer_init,
    .layer_reset = ev_layer_reset,
    .layer_fini = ev_layer_fini,
    .reserve = ev_reserve,
    .group_commit = ev_group_commit,
    .layer_step = ev_layer_step,
    .step_due = ev_step_due,
    .writes_from = ev_writes_from,
    .layer_fork = ev_layer_fork,
    .layer_attach = ev_layer_attach,
    .attach_rows = ev_attach_rows,
    .side_bytes = ev_side_bytes,
    .archive_bytes_at_create = ev_archive_bytes_at_create,
    .supports_layer = ev_supports_layer,
    .census = ev_census,
    .step_bounds = ev_step_bounds,
    .archive_key_dim = kvt__ev_key_dim,
    .archive_sketch_stride = kvt__ev_sketch_stride,
    .held_rows = ev_held_rows,
    .attended = kvt__none_attended,
    .recall_rope_view = ev_recall_rope_view,
    .resketch = ev_resketch,
    .row_state = ev_row_state,
    .read_archived = ev_read_archived,
    .positions = ev_positions,
    .last_slot_map = ev_last_slot_map,
    .prompt_used = ev_prompt_used,
    .damaged = ev_damaged,
    .stats = ev_stats,
    .check_counts = ev_check_counts,
    .check = ev_check,
    .snap_size = kvt__ev_snap_size,
    .snap_save = kvt__ev_snap_save,
    .snap_load = kvt__ev_snap_load,
};
