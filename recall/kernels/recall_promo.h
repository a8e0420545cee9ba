/*
 * recall_promo.h — the bookkeeping of recall promotion (docs/recall.md §4.2), shared by the CPU
 * twin of the recall step (recall_step.c) and its CUDA kernels (cuda/cu_recall.cu),
 * so both move the same rows between the same tables. All of it is integer work on short sorted
 * lists (the promoted rows, the candidates, the step's fired rows); only the merge of the kept
 * set with the promoted rows is as long as the kept set, and it has a serial form (the CPU's) and
 * a per-element one (each element's place in the union, kvt__promo_merged_at, for a GPU). The
 * exact scores that decide a promoted row's hit are the step's own (kvt__recall_exact's chain).
 * Read by gcc and by nvcc: no C-only features.
 */
#ifndef KVT_KERNELS_RECALL_PROMO_H
#define KVT_KERNELS_RECALL_PROMO_H

#include "kernels/backend.h"

/* The tables after the header (kernels/backend.h, kvt__recall_promo). */
typedef struct kvt__promo_view {
    kvt__recall_promo *h;
    uint32_t *cand_row, *cand_hist, *prom_row, *prom_hist;
    uint32_t mask; /* the window's bits */
} kvt__promo_view;

KVT_HD kvt__promo_view kvt__promo_of(const kvt__recall_step_args *x) {
    kvt__promo_view p;
    p.h = x->promo;
    p.cand_row = (uint32_t *)(x->promo + 1);
    p.cand_hist = p.cand_row + x->cand_cap;
    p.prom_row = p.cand_hist + x->cand_cap;
    p.prom_hist = p.prom_row + x->prom_cap;
    p.mask = x->window >= 32 ? UINT32_MAX : (1u << x->window) - 1u;
    return p;
}

/* u32 of scratch the bookkeeping takes after the step's own: the kept set merged with the
 * promoted rows [m + prom_cap], then kvt__promo_after's tables [2·cand_cap + 2·prom_cap]. */
KVT_HD size_t kvt__promo_scratch_u32(const kvt__recall_step_args *x) {
    return x->promo ? (size_t)x->scan.m + x->prom_cap + 2u * (size_t)x->cand_cap +
                          2u * (size_t)x->prom_cap
                    : 0;
}

KVT_HD uint32_t kvt__promo_popcount(uint32_t v) {
#if defined(__CUDA_ARCH__)
    return (uint32_t)__popc(v);
#else
    return (uint32_t)__builtin_popcount(v);
#endif
}

/* After a close (the closed rows changed since the last step): promoted rows the close kept by
 * σ (or below the sinks S) are absorbed, the others without a hit in the window demoted;
 * candidates the close kept leave the table. Then the count the step attends. One thread. */
KVT_HD void kvt__promo_settle(const kvt__recall_step_args *x, const kvt__promo_view *p,
                              uint64_t S) {
    const kvt__recall_scan_args *a = &x->scan;
    kvt__recall_promo *h = p->h;
    if (h->last_closed != a->n_closed) {
        uint32_t k = 0;
        for (uint32_t i = 0; i < h->n_prom; i++) {
            const uint32_t row = p->prom_row[i];
            if (row < S || kvt__sorted_has(a->kept, a->m, row)) {
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
        for (uint32_t i = 0; i < h->n_cand; i++) {
            const uint32_t row = p->cand_row[i];
            if (row >= S && !kvt__sorted_has(a->kept, a->m, row)) {
                p->cand_row[k] = row;
                p->cand_hist[k++] = p->cand_hist[i];
            }
        }
        h->n_cand = k;
        h->last_closed = (uint32_t)a->n_closed;
    }
    h->last_promoted = h->n_prom;
}

/* kept[0 .. m) ∪ prom[0 .. np) (ascending, disjoint: kvt__promo_settle leaves no promoted row
 * in the kept set) into merged, serially; returns m + np. */
KVT_HD uint64_t kvt__promo_merge(const uint32_t *kept, uint64_t m, const uint32_t *prom,
                                 uint32_t np, uint32_t *merged) {
    uint64_t i = 0, j = 0, n = 0;
    while (i < m || j < np)
        merged[n++] = j == np || (i < m && kept[i] < prom[j]) ? kept[i++] : prom[j++];
    return n;
}

/* The same union one element at a time (any order, so one thread each): element t of
 * kept ++ prom (t < m: kept[t]; else prom[t - m]) goes to merged[kvt__promo_merged_at(...)]. */
KVT_HD uint64_t kvt__promo_merged_at(const uint32_t *kept, uint64_t m, const uint32_t *prom,
                                     uint32_t np, uint64_t t) {
    return t < m ? t + kvt__sorted_below(prom, np, kept[t])
                 : (t - m) + kvt__sorted_below(kept, m, prom[t - m]);
}

/* A promoted row's history after the step: one bit more, set when its exact score reached, for
 * some head, the best of the rows attended without recall. */
KVT_HD uint32_t kvt__promo_hist_next(uint32_t hist, uint32_t hit, uint32_t mask) {
    return (hist << 1 | (hit ? 1u : 0u)) & mask;
}

/* After the scan: every candidate's history moves one step and takes a bit when the step's
 * trigger fired on it (fired[0 .. nf), ascending; nf 0 on a step that attended every row); a
 * fired row not in the table joins it while there is room (the lowest positions first; a
 * candidate whose history empties leaves it). Then the promoted rows of the last step are
 * merged into the fetch buffer (fired, room for cap + prom_cap) unless the step is dense, and
 * the candidates with at least `hits` bits join the promoted set (ascending, while it holds
 * fewer than prom_room). tmp: 2·cand_cap + 2·prom_cap u32. One thread. */
KVT_HD void kvt__promo_after(const kvt__recall_step_args *x, const kvt__promo_view *p,
                             uint32_t *fired, uint32_t *n_fired, uint32_t nf, int dense,
                             uint32_t *tmp) {
    kvt__recall_promo *h = p->h;
    const uint32_t cc = x->cand_cap;
    uint32_t *tr = tmp, *th = tmp + cc, *nr = th + cc, *nh = nr + x->prom_cap;
    /* survivors first: they decide how many new rows fit */
    uint32_t keep = 0;
    for (uint32_t i = 0, f = 0; i < h->n_cand; i++) {
        while (f < nf && fired[f] < p->cand_row[i])
            f++;
        const uint32_t hit = f < nf && fired[f] == p->cand_row[i];
        keep += kvt__promo_hist_next(p->cand_hist[i], hit, p->mask) != 0;
    }
    uint32_t room = cc - keep, n = 0;
    for (uint32_t i = 0, f = 0; i < h->n_cand || f < nf;) {
        if (i < h->n_cand && (f == nf || p->cand_row[i] <= fired[f])) {
            const uint32_t hit = f < nf && fired[f] == p->cand_row[i];
            const uint32_t hist = kvt__promo_hist_next(p->cand_hist[i], hit, p->mask);
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
        if (kvt__promo_popcount(th[i]) >= x->hits && h->n_prom + np < x->prom_room) {
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
            const int old = i > 0 && p->prom_row[i - 1] > nr[j - 1];
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

#endif /* KVT_KERNELS_RECALL_PROMO_H */
