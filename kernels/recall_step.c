/*
 * recall_step.c — CPU twin of one recall step (kernels/recall_step.h for what it computes). The
 * exact scores go 8 heads at a time over a row loaded once, each head keeping
 * kvt__recall_exact's chain (branch j ascending, then latent d ascending, from +0, then · s), so
 * the bits are the per-element function's.
 */
#include "kernels/recall_step.h"

#include "kernels/recall_group.h"
#include "kernels/recall_promo.h"
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

size_t kvt__recall_step_scratch_floats(const kvt__recall_step_args *x) {
    const kvt__recall_scan_args *s = &x->scan;
    return scan_floats(s->n_heads, s->rank, s->latent_dim, s->branch_dim, s->n_closed,
                       x->g_perm ? x->block_rows : 0) +
           own_floats(s->n_heads, s->rank, s->latent_dim, s->branch_dim) + kvt__promo_scratch_u32(x);
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
    uint32_t *merged = (uint32_t *)(tmp + D); /* promotion's part (kvt__promo_scratch_u32) */
    kvt__promo_view pv = {0};
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
        pv = kvt__promo_of(x);
        kvt__promo_settle(x, &pv, S);
        n_merged = kvt__promo_merge(a.kept, a.m, pv.prom_row, pv.h->n_prom, merged);
        promoted = pv.h->n_prom;
        for (uint32_t h = 0; h < H; h++)
            best_ar[h] = best[h];
        for (uint32_t i = 0; i < pv.h->n_prom; i++) {
            row_scores(&a, qT, HP, pv.prom_row[i], rb, sc);
            uint32_t hit = 0;
            for (uint32_t h = 0; h < H; h++)
                hit |= sc[h] >= best_ar[h];
            pv.prom_hist[i] = kvt__promo_hist_next(pv.prom_hist[i], hit, pv.mask);
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
                                        kvt__scan_csk(&a, arg[h]), rank, a.scale, &P,
                                        &ncsk);
            float cert = kvt__recall_cert(&hd, *kvt__scan_rho(&a, arg[h]), a.scale, D);
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
        /* The pruned scan where it pays (kvt__recall_prune_pays) */
        const bool prune_pays = kvt__recall_prune_pays(st, st->steps);
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
        kvt__promo_after(x, &pv, a.fired, a.n_fired, *a.n_fired, dense != 0,
                         merged + a.m + (x->prom_cap - promoted));
    kvt__recall_state_record(st, x->dense, dense, over, archived, visited, fired, fetched);
}
