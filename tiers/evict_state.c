/*
 * evict_state.c — the random-eviction tier's state read back and written whole (evict.c keeps the
 * state, its rounds and its policy table): the lookups of a position (row_state, read_row), the
 * full invariant check (kvt_seq_check) and the snapshot entries (snap_size / snap_save /
 * snap_load). Everything here reads or writes the backend arrays through the backend's ops and
 * synchronises: inspection and persistence, off the decode path.
 */
#include "tiers_internal.h"

#include "kernels/kvt_hd.h"
#include "kernels/philox.h"
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/sketch.h"
#include "kernels/topm.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------- */
/* Lookups (inspection: synchronising)                                                          */
/* ------------------------------------------------------------------------------------------- */
int64_t kvt__ev_find(const kvt__ev *e, const kvt__ptable *pt, uint32_t head, uint64_t pos) {
    if (head >= e->n_heads || !e->pos || pt->n_rows == 0)
        return -1;
    int64_t at = -1;
    if (e->be->ops->find_pos(e->be, e->pos + (size_t)head * e->pos_cap, NULL, pt->n_rows, pos,
                             &at) != KVT_OK)
        return -1;
    return at;
}

/* Index into head's archive of a position, or -1. */
int64_t kvt__ev_archive_find(const kvt__ev *e, uint32_t head, uint64_t pos) {
    if (!e->archive || head >= e->n_heads || e->ar_n == 0)
        return -1;
    int64_t k = -1;
    const size_t h = head;
    if (e->be->ops->find_pos(e->be, e->ar_pos + h * e->ar_cap, e->ar_by_pos + h * e->ar_cap,
                             e->ar_n, pos, &k) != KVT_OK)
        return -1;
    return k;
}

kvt_status kvt__ev_read_archived(const kvt__ev *e, const kvt_layer_spec *spec, uint32_t head,
                                 uint32_t plane, uint64_t pos, void *dst) {
    int64_t k = plane < spec->n_planes ? kvt__ev_archive_find(e, head, pos) : -1;
    if (k < 0)
        return KVT_ERR_INVARIANT;
    const size_t h = head;
    const uint8_t *src = e->ar_bytes + (h * e->ar_cap + (size_t)k) * e->ar_row_bytes +
                         (size_t)plane * spec->row_bytes;
    return e->be->ops->read(e->be, dst, src, spec->row_bytes, NULL);
}


/* ------------------------------------------------------------------------------------------- */
/* Invariants                                                                                  */
/* ------------------------------------------------------------------------------------------- */
/* Host copies of a state's backend arrays, for the full check (synchronising, O(rows)). */
typedef struct ev_host {
    int64_t *pos;       /* [H][n] */
    int64_t *ar_pos;    /* [H][ar_n] */
    uint64_t *ar_by_pos;/* [H][ar_n] */
    int32_t *map;       /* [H][last_n] */
    size_t b_pos, b_ar_pos, b_ar_by, b_map;
} ev_host;

static void ev_host_free(ev_host *v, const kvt__alloc *a) {
    kvt__free(a, v->pos, v->b_pos);
    kvt__free(a, v->ar_pos, v->b_ar_pos);
    kvt__free(a, v->ar_by_pos, v->b_ar_by);
    kvt__free(a, v->map, v->b_map);
}

/* Read H rows of `n` entries strided by `cap` into a host [H][n] array. */
static kvt_status read_strided(const kvt__backend *be, void **out, size_t *bytes,
                               const void *src, uint32_t H, uint64_t n, uint64_t cap, size_t elt) {
    *bytes = elt * H * n;
    if (*bytes == 0)
        return KVT_OK;
    *out = kvt__malloc(be->alloc, *bytes);
    if (!*out)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t h = 0; h < H; h++) {
        kvt_status s = be->ops->read(be, (uint8_t *)*out + elt * h * n,
                                     (const uint8_t *)src + elt * h * cap, elt * n, NULL);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}

static kvt_status ev_host_read(const kvt__ev *e, uint64_t n, ev_host *v) {
    memset(v, 0, sizeof *v);
    const kvt__backend *be = e->be;
    kvt_status s = read_strided(be, (void **)&v->pos, &v->b_pos, e->pos, e->n_heads, n,
                                e->pos_cap, sizeof *v->pos);
    if (s == KVT_OK && e->archive)
        s = read_strided(be, (void **)&v->ar_pos, &v->b_ar_pos, e->ar_pos, e->n_heads, e->ar_n,
                         e->ar_cap, sizeof *v->ar_pos);
    if (s == KVT_OK && e->archive)
        s = read_strided(be, (void **)&v->ar_by_pos, &v->b_ar_by, e->ar_by_pos, e->n_heads,
                         e->ar_n, e->ar_cap, sizeof *v->ar_by_pos);
    if (s == KVT_OK && e->rounds > 0)
        s = read_strided(be, (void **)&v->map, &v->b_map, e->last_map, e->n_heads, e->last_n,
                         e->last_n, sizeof *v->map);
    return s;
}

static kvt_status ev_check_host(const kvt__ev *e, const ev_host *v, uint64_t n,
                                const kvt_config *cfg, uint64_t appended, uint64_t prompt_rows,
                                char *err, size_t len) {
    const uint32_t H = e->n_heads;
    uint64_t L = kvt__ev_protected_rows(cfg, prompt_rows);
    if (L > appended)
        L = appended;
    uint64_t R = cfg->recent_rows < appended ? cfg->recent_rows : appended;
    for (uint32_t h = 0; h < H; h++) {
        const int64_t *P = v->pos ? v->pos + (size_t)h * n : NULL;
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
        if (e->archive && e->ar_n) {
            const int64_t *apos = v->ar_pos + (size_t)h * e->ar_n;
            const uint64_t *by = v->ar_by_pos + (size_t)h * e->ar_n;
            for (uint64_t i = 0; i < e->ar_n; i++) {
                uint64_t k = by[i];
                if (k >= e->ar_n)
                    return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                     "evict: head %u archive index %llu out of range", h,
                                     (unsigned long long)k);
                int64_t p = apos[k];
                /* Strictly ascending positions also make by_pos a permutation. */
                if (p < 0 || (uint64_t)p >= appended || (i > 0 && p <= apos[by[i - 1]]))
                    return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                     "evict: head %u archive not sorted/unique at %llu", h,
                                     (unsigned long long)i);
                if (n && kvt__find_pos(P, NULL, n, (uint64_t)p) >= 0)
                    return kvt__fail(err, len, KVT_ERR_INVARIANT,
                                     "evict: head %u position %lld both attended and archived", h,
                                     (long long)p);
            }
        }
        /* The last slot map: kept old rows onto 0..m-1, ascending (chronological compaction). */
        if (e->rounds > 0 && e->last_n) {
            const int32_t *map = v->map + (size_t)h * e->last_n;
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

/* The archive's sketches (rows [0, sk_n) of every head): ρ never NaN or negative, coefficients
 * finite, and zero on a ρ = +Inf row (docs/recall.md §2's rule for rows the sketch cannot
 * describe). Synchronising, O(sketched rows). */
static kvt_status ev_check_sketches(const kvt__ev *e, char *err, size_t len) {
    if (e->sk_n > e->ar_n)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "evict: %llu rows sketched of %llu archived",
                         (unsigned long long)e->sk_n, (unsigned long long)e->ar_n);
    if (!e->archive || e->sk_stride == 0 || e->sk_n == 0)
        return KVT_OK;
    const kvt__backend *be = e->be;
    float *rho = NULL;
    uint16_t *csk = NULL;
    size_t b_rho = 0, b_csk = 0;
    kvt_status s = read_strided(be, (void **)&rho, &b_rho, e->ar_rho, e->n_heads, e->sk_n,
                                e->ar_cap, sizeof *rho);
    if (s == KVT_OK)
        s = read_strided(be, (void **)&csk, &b_csk, e->ar_csk, e->n_heads, e->sk_n, e->ar_cap,
                         sizeof *csk * e->sk_stride);
    if (s != KVT_OK)
        s = kvt__fail(err, len, s, "evict: reading the archive's sketches from the backend");
    for (uint64_t i = 0; s == KVT_OK && i < (uint64_t)e->n_heads * e->sk_n; i++) {
        bool bad = isnan(rho[i]) || rho[i] < 0.0f;
        for (uint32_t k = 0; !bad && k < e->sk_stride; k++) {
            uint16_t c = csk[i * e->sk_stride + k];
            bad = !kvt__f16_finite(c) || (isinf(rho[i]) && (c & 0x7fffu) != 0);
        }
        if (bad)
            s = kvt__fail(err, len, KVT_ERR_INVARIANT,
                          "evict: head %llu archived row %llu: sketch with rho %g",
                          (unsigned long long)(i / e->sk_n), (unsigned long long)(i % e->sk_n),
                          (double)rho[i]);
    }
    kvt__free(be->alloc, rho, b_rho);
    kvt__free(be->alloc, csk, b_csk);
    /* a host archive's branch plane: each sketched row's branch, byte for byte */
    uint8_t *br = NULL, *rows = NULL;
    size_t b_br = 0, b_rows = 0;
    if (s == KVT_OK && e->br_bytes &&
        ((s = read_strided(be, (void **)&br, &b_br, e->ar_branch, e->n_heads, e->sk_n, e->ar_cap,
                           e->br_bytes)) != KVT_OK ||
         (s = read_strided(be, (void **)&rows, &b_rows, e->ar_bytes, e->n_heads, e->sk_n,
                           e->ar_cap, e->ar_row_bytes)) != KVT_OK))
        s = kvt__fail(err, len, s, "evict: reading the archive's branch plane");
    for (uint64_t i = 0; s == KVT_OK && e->br_bytes && i < (uint64_t)e->n_heads * e->sk_n; i++)
        if (memcmp(br + i * e->br_bytes, rows + i * e->ar_row_bytes + e->br_offset,
                   e->br_bytes) != 0)
            s = kvt__fail(err, len, KVT_ERR_INVARIANT,
                          "evict: head %llu archived row %llu: its branch plane entry differs "
                          "from the row's branch",
                          (unsigned long long)(i / e->sk_n), (unsigned long long)(i % e->sk_n));
    kvt__free(be->alloc, br, b_br);
    kvt__free(be->alloc, rows, b_rows);
    return s;
}

kvt_status kvt__ev_check(const kvt__ev *e, const kvt__ptable *pt, const kvt_config *cfg,
                         uint64_t appended, uint64_t prompt_rows, char *err, size_t len) {
    const uint32_t H = e->n_heads;
    const uint64_t n = pt->n_rows;
    if (n > e->pos_cap && n > 0)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "evict: %llu rows, position capacity %llu",
                         (unsigned long long)n, (unsigned long long)e->pos_cap);
    /* Counts: what every head holds + archived + dropped covers every appended row once. */
    uint64_t archived = e->archive ? e->ar_n * H : 0;
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
    if (e->prompt_over_budget != (e->rounds > 0 && kvt__ev_prompt_over_budget(cfg, prompt_rows)))
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "evict: prompt_over_budget %d with %llu prompt rows, K = %u, %llu rounds",
                         (int)e->prompt_over_budget, (unsigned long long)prompt_rows,
                         cfg->evict_budget_rows, (unsigned long long)e->rounds);
    if (e->ar_n > e->ar_cap || (e->rounds > 0 && e->last_map_cap < (uint64_t)H * e->last_n))
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "evict: archive %llu of capacity %llu, slot map %llu of %llu",
                         (unsigned long long)e->ar_n, (unsigned long long)e->ar_cap,
                         (unsigned long long)H * e->last_n,
                         (unsigned long long)e->last_map_cap);
    if (!e->be) /* a state never initialised holds nothing */
        return KVT_OK;
    ev_host v;
    kvt_status s = ev_host_read(e, n, &v);
    if (s != KVT_OK)
        s = kvt__fail(err, len, s, "evict: reading the state from the backend");
    else
        s = ev_check_host(e, &v, n, cfg, appended, prompt_rows, err, len);
    ev_host_free(&v, e->be->alloc);
    return s == KVT_OK ? ev_check_sketches(e, err, len) : s;
}


/* ------------------------------------------------------------------------------------------- */
/* Snapshots (policy.h snap_*; lib/snapshot.c)                                                  */
/* ------------------------------------------------------------------------------------------- */
/* Layout: u32 n_heads, u32 flags (1: prompt_over_budget, 2: archive present); u64 rounds,
 * dropped, last_kept, last_n, n_rows, ar_n; i64 pos[n_heads][n_rows];
 * i32 last_map[n_heads][last_n]; with the archive (ar_n rows per head), i64 ar_pos[n_heads][ar_n]
 * (order of archiving), u64 ar_by_pos[n_heads][ar_n], u8 bytes[n_heads][ar_n][n_planes x
 * row_bytes]. Every array lives in the backend's memory: saved and loaded through its read and
 * write ops, head by head (the buffers are strided by their capacities). The keep sets are a
 * round's scratch, not state. */
enum { EV_SNAP_FIXED = 8 + 6 * 8 };

uint64_t kvt__ev_snap_size(const kvt__tier_layer *l) {
    const kvt__ev *e = &l->state->ev;
    uint64_t n = EV_SNAP_FIXED + (uint64_t)e->n_heads * (8 * l->pt->n_rows + 4 * e->last_n);
    if (e->archive)
        n += (uint64_t)e->n_heads * e->ar_n * (16 + e->ar_row_bytes);
    return n;
}

/* Copy `rows` entries of elt bytes of every head between the snapshot (packed [H][rows]) and a
 * backend array strided by cap ([H][cap]): out of the backend (save) or into it (load). */
static kvt_status heads_copy(const kvt__backend *be, uint8_t *dev, uint64_t cap, uint8_t *host,
                             uint64_t rows, size_t elt, uint32_t H, bool save) {
    kvt_status s = KVT_OK;
    for (uint32_t h = 0; h < H && rows && s == KVT_OK; h++) {
        uint8_t *d = dev + elt * h * cap, *p = host + elt * h * rows;
        s = save ? be->ops->read(be, p, d, elt * rows, NULL)
                 : be->ops->write(be, d, p, elt * rows, NULL);
    }
    return s;
}

/* The backend arrays of a state and the bytes of each in the snapshot, in layout order. */
static void ev_snap_arrays(const kvt__ev *e, uint64_t rows, uint8_t *dev[5], uint64_t cap[5],
                           size_t elt[5], uint64_t count[5]) {
    uint8_t *d[5] = {(uint8_t *)e->pos, (uint8_t *)e->last_map, (uint8_t *)e->ar_pos,
                     (uint8_t *)e->ar_by_pos, e->ar_bytes};
    const uint64_t c[5] = {e->pos_cap, e->last_n, e->ar_cap, e->ar_cap, e->ar_cap};
    const size_t el[5] = {8, 4, 8, 8, e->ar_row_bytes};
    const uint64_t k[5] = {rows, e->last_n, e->ar_n, e->ar_n, e->ar_n};
    for (int i = 0; i < 5; i++) {
        dev[i] = d[i];
        cap[i] = c[i];
        elt[i] = el[i];
        count[i] = i >= 2 && !e->archive ? 0 : k[i];
    }
}

kvt_status kvt__ev_snap_save(const kvt__tier_layer *l, uint8_t *dst, char *err, size_t len) {
    const kvt__ev *e = &l->state->ev;
    const uint64_t rows = l->pt->n_rows;
    kvt__snap_cur c = {.w = dst};
    uint32_t head[2] = {e->n_heads, (e->prompt_over_budget ? 1u : 0u) | (e->archive ? 2u : 0u)};
    uint64_t v[6] = {e->rounds, e->dropped, e->last_kept, e->last_n, rows, e->ar_n};
    kvt__snap_put(&c, head, sizeof head);
    kvt__snap_put(&c, v, sizeof v);
    uint8_t *dev[5];
    uint64_t cap[5], count[5];
    size_t elt[5];
    ev_snap_arrays(e, rows, dev, cap, elt, count);
    kvt_status s = KVT_OK;
    for (int i = 0; i < 5 && s == KVT_OK; i++) {
        s = heads_copy(e->be, dev[i], cap[i], c.w, count[i], elt[i], e->n_heads, true);
        c.w += elt[i] * e->n_heads * count[i];
    }
    return s == KVT_OK ? KVT_OK : kvt__fail(err, len, s, "eviction state: reading it back");
}

kvt_status kvt__ev_snap_load(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                             const uint8_t *src, uint64_t n) {
    kvt__ev *e = &s->ev;
    const kvt_config *cfg = l->cfg;
    const uint32_t H = e->n_heads;
    kvt__snap_cur c = {.r = src, .left = n};
    uint32_t head[2];
    uint64_t v[6];
    if (!kvt__snap_get(&c, head, sizeof head) || !kvt__snap_get(&c, v, sizeof v))
        return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                         "eviction state: %llu bytes, the counts need %d", (unsigned long long)n,
                         EV_SNAP_FIXED);
    const uint64_t rounds = v[0], dropped = v[1], last_kept = v[2], last_n = v[3], rows = v[4],
                   ar_n = v[5];
    const char *bad = NULL;
    if (head[0] != H)
        bad = "KV heads differ from the layer's";
    else if ((head[1] & ~3u) != 0 || ((head[1] & 2u) != 0) != e->archive ||
             (!e->archive && ar_n != 0))
        bad = "unknown flags, or an archive where the configuration has none (or none where it "
              "has one)";
    else if (rows != l->pt->n_rows)
        bad = "rows differ from the page table's";
    else if (rounds == 0 ? (last_n != 0 || last_kept != 0)
                         : ((cfg->evict_ratio_budget
                                 ? last_kept <= cfg->recent_rows || last_kept > rows
                                 : last_kept != (uint64_t)cfg->evict_budget_rows + cfg->recent_rows) ||
                            last_n > l->appended))
        bad = "last round's counts out of range";
    if (bad)
        return kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT,
                         "eviction state: %s (%u heads, %llu rows, %llu rounds)", bad, head[0],
                         (unsigned long long)rows, (unsigned long long)rounds);
    /* Sizes of everything before any allocation. */
    const uint64_t per_row[5] = {8, 4, 8, 8, e->ar_row_bytes};
    const uint64_t count[5] = {rows, last_n, ar_n, ar_n, ar_n};
    const uint8_t *part[5];
    for (int i = 0; i < 5; i++)
        if (!(part[i] = kvt__snap_take_n(&c, count[i], per_row[i] * H)))
            return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                             "eviction state: %llu bytes for %llu rows, a slot map of %llu and "
                             "%llu archived rows per head",
                             (unsigned long long)n, (unsigned long long)rows,
                             (unsigned long long)last_n, (unsigned long long)ar_n);
    if (c.left != 0)
        return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                         "eviction state: %llu bytes after the state", (unsigned long long)c.left);
    if (env->archive_rows && ar_n > env->archive_rows)
        return kvt__fail(env->err, env->err_len, KVT_ERR_CAPACITY,
                         "eviction state: %llu rows archived per head, the context's "
                         "archive_rows_per_seq is %llu",
                         (unsigned long long)ar_n, (unsigned long long)env->archive_rows);
    kvt_status rc = kvt__ev_reserve(e, rows);
    if (rc == KVT_OK && last_n)
        rc = kvt__ev_round_reserve(e, last_n, cfg->evict_ratio_budget
                                                  ? last_kept - cfg->recent_rows /* its round's K */
                                                  : cfg->evict_budget_rows);
    if (rc == KVT_OK && ar_n)
        rc = kvt__ev_archive_reserve(e, ar_n, NULL);
    if (rc != KVT_OK)
        return kvt__fail(env->err, env->err_len, rc,
                         "eviction state: positions, slot map, archive");
    e->last_n = last_n;
    e->ar_n = ar_n;
    uint8_t *dev[5];
    uint64_t cap[5], cnt[5];
    size_t elt[5];
    ev_snap_arrays(e, rows, dev, cap, elt, cnt);
    for (int i = 0; i < 5 && rc == KVT_OK; i++)
        rc = heads_copy(e->be, dev[i], cap[i], (uint8_t *)(uintptr_t)part[i], cnt[i], elt[i], H,
                        false);
    if (rc != KVT_OK)
        return kvt__fail(env->err, env->err_len, rc, "eviction state: writing it");
    e->rounds = rounds;
    e->dropped = dropped;
    e->last_kept = last_kept;
    e->prompt_over_budget = (head[1] & 1u) != 0;
    char msg[KVT__ERR_LEN];
    rc = kvt__ev_check(e, l->pt, cfg, l->appended, l->prompt_rows, msg, sizeof msg);
    if (rc != KVT_OK) /* an invariant broken: the snapshot's fault; else the check's (memory) */
        return kvt__fail(env->err, env->err_len, rc == KVT_ERR_INVARIANT ? KVT_ERR_CORRUPT : rc,
                         "eviction state: %s", msg);
    /* The archive's sketches are derived (the rows and the context's bases): rebuilt here. */
    return kvt__ev_sketch_pending(env, l->st, e);
}
