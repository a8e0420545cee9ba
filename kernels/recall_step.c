/*
 * recall_step.c — CPU twin of one recall step (kernels/recall_step.h for what it computes). The
 * exact scores go 8 heads at a time over a row loaded once, each head keeping
 * kvt__recall_exact's chain (branch j ascending, then latent d ascending, from +0, then · s), so
 * the bits are the per-element function's.
 */
#include "kernels/recall_step.h"

#include "kernels/recall_group.h"
#include "kernels/sketch.h"
#include "lib/base/base.h"

#define TILE 8u

static size_t heads_padded(uint32_t n_heads) {
    return ((size_t)n_heads + TILE - 1) / TILE * TILE;
}

/* Floats of the step's own part of the scratch (after the scan's). */
static size_t own_floats(uint32_t n_heads, uint32_t rank, uint32_t D, uint32_t branch_dim) {
    const size_t HP = heads_padded(n_heads), qdim = (size_t)D + branch_dim;
    /* qT [qdim][HP]; the row [qdim]; scores [HP]; best archived and its row [2H]; one head's
     * prep: q̃_sk [rank], tmp [D] */
    return qdim * HP + qdim + HP + 2u * (size_t)n_heads + rank + D;
}

/* The scan's part: the full scan's, or the pruned scan's (which holds it) and, while groups are
 * built, the build's and a block's slots — one region, used by one at a time. */
static size_t scan_floats(uint32_t n_heads, uint32_t rank, uint32_t D, uint32_t branch_dim,
                          uint64_t n_closed, uint32_t block_rows) {
    size_t f = kvt__recall_scan_scratch_floats(n_heads, rank, D);
    if (block_rows) {
        size_t p = (kvt__recall_scan_pruned_scratch_bytes(n_heads, rank, D, n_closed) + 7u) / 4u;
        size_t g = (kvt__recall_group_build_scratch_bytes(block_rows, branch_dim, rank) + 3u) / 4u;
        f = p > f ? p : f;
        f = g > f ? g : f;
    }
    return (f + 1u) & ~(size_t)1u; /* keeps what follows 8-byte aligned */
}

/* Promotion's part (after the step's own): the kept set merged with the promoted rows, the
 * candidates' next table (rows, histories) and the rows promoted at this step (rows,
 * histories), u32 each. */
static size_t promo_floats(const kvt__recall_step_args *x) {
    return x->promo ? (size_t)x->scan.m + x->prom_cap + 2u * (size_t)x->cand_cap +
                          2u * (size_t)x->prom_cap
                    : 0;
}

size_t kvt__recall_step_scratch_floats(const kvt__recall_step_args *x) {
    const kvt__recall_scan_args *s = &x->scan;
    return scan_floats(s->n_heads, s->rank, s->latent_dim, s->branch_dim, s->n_closed,
                       x->g_perm ? x->block_rows : 0) +
           own_floats(s->n_heads, s->rank, s->latent_dim, s->branch_dim) + promo_floats(x);
}

/* Build the groups of closed blocks [st->n_grouped, n_closed / B) into the planes. */
static void build_groups(const kvt__recall_step_args *x, const kvt__recall_scan_args *a,
                         kvt__recall_state *st, void *scratch) {
    uint64_t want = a->n_closed / x->block_rows;
    if (want > x->g_blocks_cap)
        want = x->g_blocks_cap;
    const kvt__recall_group_block planes = {.perm = x->g_perm, .n_groups = x->g_n,
                                            .end = x->g_end, .centre = x->g_centre,
                                            .stat = x->g_stat};
    kvt__recall_group_build_cpu(a, x->block_rows, x->g_dim, 1, &planes, st->n_grouped, want,
                                scratch);
    if (want > st->n_grouped)
        st->n_grouped = (uint32_t)want;
}

/* Exact scores of one row for every head into sc[0 .. HP). */
KVT__FMA_CLONES
static void row_scores(const kvt__recall_scan_args *a, const float *qT, size_t HP, uint64_t row,
                       float *rb, float *sc) {
    const uint32_t D = a->latent_dim, bd = a->branch_dim;
    const uint8_t *p =
        a->base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) *
                      a->slot_stride;
    for (uint32_t j = 0; j < bd; j++)
        rb[j] = kvt__sigma_branch_val(p, a->branch_offset, a->branch_dtype, j);
    for (uint32_t d = 0; d < D; d++)
        rb[bd + d] = kvt__sketch_latent(p, a->dtype, d);
    for (size_t h0 = 0; h0 < HP; h0 += TILE) {
        float acc[TILE];
        for (uint32_t t = 0; t < TILE; t++)
            acc[t] = 0.0f;
        for (uint32_t j = 0; j < bd + D; j++) {
            const float x = rb[j];
            const float *qj = qT + (size_t)j * HP + h0;
#pragma GCC unroll 8
            for (uint32_t t = 0; t < TILE; t++)
                acc[t] = fmaf(qj[t], x, acc[t]);
        }
        for (uint32_t t = 0; t < TILE; t++)
            sc[h0 + t] = a->scale * acc[t];
    }
}

/* best[h] = max(best[h], sc[h]) skipping NaN. */
static void fold_max(float *best, const float *sc, uint32_t H) {
    for (uint32_t h = 0; h < H; h++)
        if (sc[h] > best[h])
            best[h] = sc[h];
}

/* Calls f(row) for the archived rows ascending: [S, n_closed) not in kept. */
#define FOR_ARCHIVED(a, S, row, body)                                                              \
    do {                                                                                           \
        uint64_t jk_ = 0;                                                                          \
        for (uint64_t row = (S); row < (a)->n_closed; row++) {                                     \
            while (jk_ < (a)->m && (a)->kept[jk_] < row)                                           \
                jk_++;                                                                             \
            if (jk_ < (a)->m && (a)->kept[jk_] == row)                                             \
                continue;                                                                          \
            body;                                                                                  \
        }                                                                                          \
    } while (0)

/* Promotion's tables in the state (kernels/backend.h, kvt__recall_promo). */
typedef struct promo_view {
    kvt__recall_promo *h;
    uint32_t *cand_row, *cand_hist, *prom_row, *prom_hist;
    uint32_t mask;
} promo_view;

static promo_view promo_of(const kvt__recall_step_args *x) {
    promo_view p = {.h = x->promo};
    p.cand_row = (uint32_t *)(x->promo + 1);
    p.cand_hist = p.cand_row + x->cand_cap;
    p.prom_row = p.cand_hist + x->cand_cap;
    p.prom_hist = p.prom_row + x->prom_cap;
    p.mask = x->window >= 32 ? UINT32_MAX : (1u << x->window) - 1u;
    return p;
}

/* Whether row is in kept[*j ..) (ascending; *j advances past the rows below it). */
static bool in_sorted(const uint32_t *kept, uint64_t m, uint64_t *j, uint32_t row) {
    while (*j < m && kept[*j] < row)
        (*j)++;
    return *j < m && kept[*j] == row;
}

/* After a close (the closed rows moved since the last step): promoted rows the close kept by σ
 * (or below the sinks) are absorbed, the others without a hit in the window demoted; candidates
 * the close kept leave the table. Then the list of rows attended without recall past the
 * policy's own: kept ∪ promoted, ascending, into merged (the scan's "not archived" list). */
static uint64_t promo_before(const kvt__recall_step_args *x, const promo_view *p, uint64_t S,
                             uint32_t *merged) {
    const kvt__recall_scan_args *a = &x->scan;
    kvt__recall_promo *h = p->h;
    if (h->last_closed != a->n_closed) {
        uint32_t k = 0;
        uint64_t j = 0;
        for (uint32_t i = 0; i < h->n_prom; i++) {
            const uint32_t row = p->prom_row[i];
            if (row < S || in_sorted(a->kept, a->m, &j, row)) {
                h->absorbed++;
            } else if ((p->prom_hist[i] & p->mask) == 0) {
                h->demotions++;
            } else {
                p->prom_row[k] = row;
                p->prom_hist[k++] = p->prom_hist[i] & p->mask;
            }
        }
        h->n_prom = k;
        k = 0;
        j = 0;
        for (uint32_t i = 0; i < h->n_cand; i++) {
            const uint32_t row = p->cand_row[i];
            if (row >= S && !in_sorted(a->kept, a->m, &j, row)) {
                p->cand_row[k] = row;
                p->cand_hist[k++] = p->cand_hist[i];
            }
        }
        h->n_cand = k;
        h->last_closed = (uint32_t)a->n_closed;
    }
    uint64_t i = 0, j = 0, n = 0;
    while (i < a->m || j < h->n_prom)
        merged[n++] = j == h->n_prom || (i < a->m && a->kept[i] < p->prom_row[j]) ? a->kept[i++]
                                                                                  : p->prom_row[j++];
    return n;
}

/* After the scan: every candidate's history moves one step and takes a bit when the step's
 * trigger fired on it (fired[0 .. nf), ascending; nf 0 on a step that attended every row); a
 * fired row not in the table joins it while there is room (the lowest positions first; a
 * candidate whose history empties leaves it). Then the promoted rows of the last step are
 * merged into the fetch buffer (fired, room for cap + prom_cap) unless the step is dense, and
 * the candidates with at least `hits` bits join the promoted set (ascending, while it holds
 * fewer than prom_room). tmp: 2·cand_cap + 2·prom_cap u32. */
static void promo_after(const kvt__recall_step_args *x, const promo_view *p, uint32_t *fired,
                        uint32_t *n_fired, uint32_t nf, bool dense, uint32_t *tmp) {
    kvt__recall_promo *h = p->h;
    const uint32_t cc = x->cand_cap;
    uint32_t *tr = tmp, *th = tmp + cc, *nr = th + cc, *nh = nr + x->prom_cap;
    /* survivors first: they decide how many new rows fit */
    uint32_t keep = 0;
    for (uint32_t i = 0, f = 0; i < h->n_cand; i++) {
        while (f < nf && fired[f] < p->cand_row[i])
            f++;
        const uint32_t hit = f < nf && fired[f] == p->cand_row[i];
        keep += ((p->cand_hist[i] << 1 | hit) & p->mask) != 0;
    }
    uint32_t room = cc - keep, n = 0;
    for (uint32_t i = 0, f = 0; i < h->n_cand || f < nf;) {
        if (i < h->n_cand && (f == nf || p->cand_row[i] <= fired[f])) {
            const uint32_t hit = f < nf && fired[f] == p->cand_row[i];
            const uint32_t hist = (p->cand_hist[i] << 1 | hit) & p->mask;
            if (hist) {
                tr[n] = p->cand_row[i];
                th[n++] = hist;
            }
            f += hit;
            i++;
        } else {
            if (room) {
                tr[n] = fired[f];
                th[n++] = 1u;
                room--;
            }
            f++;
        }
    }
    /* the fetch buffer: this step's fired rows ∪ the promoted rows it did not scan */
    if (!dense && h->n_prom) {
        uint64_t i = nf, j = h->n_prom, o = (uint64_t)nf + h->n_prom;
        while (j > 0)
            fired[--o] = i > 0 && fired[i - 1] > p->prom_row[j - 1] ? fired[--i]
                                                                    : p->prom_row[--j];
        *n_fired = nf + h->n_prom;
    }
    /* promotions */
    uint32_t k = 0, np = 0;
    for (uint32_t i = 0; i < n; i++) {
        if ((uint32_t)__builtin_popcount(th[i]) >= x->hits && h->n_prom + np < x->prom_room) {
            nr[np] = tr[i];
            nh[np++] = th[i];
        } else {
            p->cand_row[k] = tr[i];
            p->cand_hist[k++] = th[i];
        }
    }
    h->n_cand = k;
    if (np) {
        uint64_t i = h->n_prom, j = np, o = (uint64_t)h->n_prom + np;
        while (j > 0) {
            const bool old = i > 0 && p->prom_row[i - 1] > nr[j - 1];
            --o;
            p->prom_row[o] = old ? p->prom_row[i - 1] : nr[j - 1];
            p->prom_hist[o] = old ? p->prom_hist[i - 1] : nh[j - 1];
            if (old)
                i--;
            else
                j--;
        }
        h->n_prom += np;
        h->promotions += np;
    }
}

void kvt__recall_step_cpu(const kvt__recall_step_args *x, float *scratch) {
    kvt__recall_scan_args a = x->scan;
    kvt__recall_state *st = x->st;
    const uint32_t D = a.latent_dim, bd = a.branch_dim, H = a.n_heads, rank = a.rank;
    const size_t HP = heads_padded(H), qdim = (size_t)D + bd;
    const uint32_t Bg = x->g_perm ? x->block_rows : 0;
    float *scan_scratch = scratch;
    float *qT = scratch + scan_floats(H, rank, D, bd, a.n_closed, Bg);
    float *rb = qT + qdim * HP;
    float *sc = rb + qdim;
    float *best_ar = sc + HP;
    uint32_t *arg = (uint32_t *)(best_ar + H);
    float *q_sk = (float *)(arg + H);
    float *tmp = q_sk + rank;
    uint32_t *merged = (uint32_t *)(tmp + D); /* promotion's part (promo_floats) */
    promo_view pv = {0};
    uint64_t n_merged = 0;
    /* The queries transposed in the exact score's order: branch first, then latent. */
    for (size_t h = 0; h < HP; h++)
        for (size_t j = 0; j < qdim; j++) {
            size_t src = j < bd ? D + j : j - bd;
            qT[j * HP + h] = h < H ? a.q[h * qdim + src] : 0.0f;
        }

    /* 1. Each head's best score over the rows attended without recall. */
    const uint64_t S = a.sinks < a.n_closed ? a.sinks : a.n_closed;
    float *best = (float *)a.best;
    for (uint32_t h = 0; h < H; h++)
        best[h] = -INFINITY;
    uint64_t kept_past = 0;
    for (uint64_t r = 0; r < S; r++) {
        row_scores(&a, qT, HP, r, rb, sc);
        fold_max(best, sc, H);
    }
    for (uint64_t i = 0; i < a.m; i++) {
        if (a.kept[i] < S)
            continue;
        kept_past++;
        row_scores(&a, qT, HP, a.kept[i], rb, sc);
        fold_max(best, sc, H);
    }
    for (uint64_t r = a.n_closed; r < x->n_rows; r++) {
        row_scores(&a, qT, HP, r, rb, sc);
        fold_max(best, sc, H);
    }
    /* Promoted rows: attended too; one hits when its exact score reaches, for some head, the
     * best of the other rows attended without recall (what firing in the sound mode needs). */
    uint64_t promoted = 0;
    if (x->promo) {
        pv = promo_of(x);
        n_merged = promo_before(x, &pv, S, merged);
        promoted = pv.h->n_prom;
        pv.h->last_promoted = pv.h->n_prom;
        for (uint32_t h = 0; h < H; h++)
            best_ar[h] = best[h];
        for (uint32_t i = 0; i < pv.h->n_prom; i++) {
            row_scores(&a, qT, HP, pv.prom_row[i], rb, sc);
            uint32_t hit = 0;
            for (uint32_t h = 0; h < H; h++)
                hit |= sc[h] >= best_ar[h];
            pv.prom_hist[i] = (pv.prom_hist[i] << 1 | hit) & pv.mask;
            fold_max(best, sc, H);
        }
        a.kept = merged;
        a.m = (uint32_t)n_merged;
    }

    const uint64_t archived = a.n_closed - S - kept_past - promoted;
    uint32_t dense = 0, over = 0, n_fired = 0;
    uint64_t visited = 0, fired = 0, fetched = 0;
    st->steps++;
    if (archived == 0) {
        /* 2. nothing to recall */
    } else if (x->mode == KVT__RECALL_CONFORMAL && st->phase == KVT__CONFORMAL_OPEN) {
        /* 3. A calibration step: every row attended; one sample per head. */
        for (uint32_t h = 0; h < H; h++) {
            best_ar[h] = -INFINITY;
            arg[h] = UINT32_MAX;
        }
        FOR_ARCHIVED(&a, S, row, {
            row_scores(&a, qT, HP, row, rb, sc);
            for (uint32_t h = 0; h < H; h++)
                if (sc[h] > best_ar[h]) {
                    best_ar[h] = sc[h];
                    arg[h] = (uint32_t)row;
                }
        });
        for (uint32_t h = 0; h < H; h++) {
            if (arg[h] == UINT32_MAX)
                continue;
            const float *q = a.q + h * qdim;
            kvt__recall_head hd;
            kvt__recall_head_prep(q, D, a.basis, rank, q_sk, tmp, &hd);
            const uint8_t *p =
                a.base +
                (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, arg[h]) * a.slot_stride;
            float P, ncsk, e;
            float idx = kvt__recall_idx(q, q_sk, p, D, a.branch_offset, a.branch_dtype, bd,
                                        a.csk + (size_t)arg[h] * a.csk_stride, rank, a.scale, &P,
                                        &ncsk);
            float cert = kvt__recall_cert(&hd, a.rho[arg[h]], a.scale, D);
            if (kvt__conformal_sample(best_ar[h], idx, cert, &e))
                kvt__conformal_insert(x->samples, &st->n_samples, x->sample_cap, e);
        }
        st->cal_steps++;
        st->phase = kvt__conformal_close(x->samples, st->n_samples, st->cal_steps, &st->z, &st->k,
                                         &st->clamped);
        st->calib_steps++;
        dense = 1;
        visited = fetched = archived;
    } else {
        /* 4. The scan with the request's multiplier. */
        a.z = kvt__recall_mode_z(x->mode, D, x->margin, st->z);
        a.mode = x->mode;
        a.sinks = S;
        visited = archived;
        /* The pruned scan where it pays: after a dense step (nothing known), while the last
         * scan visited at most 7/8 of the archive, and every 16th step to look again; otherwise
         * the full scan, whose tiled form is cheaper than bounds that skip nothing. Both give
         * the same fired rows (docs/recall.md §3.2): only `visited` tells them apart. */
        const bool prune_pays = st->last_dense ||
                                st->last_visited * 8u <= st->last_archived * 7u ||
                                st->steps % 16u == 0;
        if (Bg && x->mode != KVT__RECALL_MARGIN && prune_pays) {
            build_groups(x, &a, st, scan_scratch);
            kvt__recall_groups g = {.block_rows = Bg,
                                    .n_blocks = st->n_grouped,
                                    .dim = x->g_dim,
                                    .perm = x->g_perm,
                                    .n_groups = x->g_n,
                                    .end = x->g_end,
                                    .centre = x->g_centre,
                                    .stat = x->g_stat};
            kvt__recall_prune_stats ps;
            kvt__recall_scan_pruned_cpu(&a, &g, scan_scratch, &ps);
            visited = ps.visited;
        } else {
            kvt__recall_scan_cpu(&a, scan_scratch);
        }
        n_fired = *a.n_fired;
        over = *a.overflow;
        dense = over;
        fired = (uint64_t)n_fired + over;
        fetched = over ? archived : n_fired;
        st->overflow_steps += over;
    }
    if (dense || archived == 0) {
        *a.n_fired = 0;
        *a.overflow = over;
    }
    if (x->promo)
        promo_after(x, &pv, a.fired, a.n_fired, *a.n_fired, dense != 0,
                    merged + a.m + (x->prom_cap - promoted));
    kvt__recall_state_record(st, x->dense, dense, over, archived, visited, fired, fetched);
}
