/*
 * recall_step.c — CPU twin of one recall step (recall_step.h for what it computes). The
 * exact scores go 8 heads at a time over a row loaded once, each head keeping
 * kvt__recall_exact's chain (branch j ascending, then latent d ascending, from +0, then · s), so
 * the bits are the per-element function's.
 */
#include "recall/kernels/recall_step.h"

#include "recall/kernels/recall_group.h"
#include "recall/kernels/recall_promo.h"
#include "recall/kernels/sketch.h"
#include "lib/base/base.h"

#define TILE 8u

static size_t heads_padded(uint32_t n_heads) {
    return ((size_t)n_heads + TILE - 1) / TILE * TILE;
}

/* Rows whose exact scores are computed together (a multiple of the tiled chains' 6 rows). */
#define SB 24u

/* Floats of the step's own part of the scratch (after the scan's). */
static size_t own_floats(uint32_t n_heads, uint32_t D, uint32_t branch_dim) {
    const size_t HP = heads_padded(n_heads), qdim = (size_t)D + branch_dim;
    /* qT [qdim][HP]; SB rows [SB][qdim]; their chains [SB][HP]; scores [HP]; best archived and
     * its row [2H] (a calibration step prepares its heads in the scan's part, unused there) */
    return qdim * HP + SB * qdim + SB * HP + HP + 2u * (size_t)n_heads;
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
           own_floats(s->n_heads, s->latent_dim, s->branch_dim) + kvt__promo_scratch_u32(x);
}

/* Build the groups of closed blocks [st->n_grouped, kvt__recall_groups_want) into the planes. */
static void build_groups(const kvt__recall_step_args *x, const kvt__recall_scan_args *a,
                         kvt__recall_state *st, void *scratch) {
    const uint64_t want =
        kvt__recall_groups_want(a->n_closed, x->block_rows, x->g_blocks_cap, st->n_grouped);
    const kvt__recall_group_block planes = {.perm = x->g_perm, .n_groups = x->g_n,
                                            .end = x->g_end, .centre = x->g_centre,
                                            .stat = x->g_stat};
    kvt__recall_group_build_cpu(a, x->block_rows, x->g_dim, 1, &planes, st->n_grouped, want,
                                scratch);
    if (want > st->n_grouped)
        st->n_grouped = (uint32_t)want;
}

/* best[h] = max(best[h], sc[h]) skipping NaN. */
static void fold_max(float *best, const float *sc, uint32_t H) {
    for (uint32_t h = 0; h < H; h++)
        if (sc[h] > best[h])
            best[h] = sc[h];
}

/* n values of a row part of dtype dt into out as floats (the per-element loads' values; bf16,
 * the rows' usual dtype, by the shift alone, which the compiler vectorises). */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define STEP_AVX2 1
/* bf16 to fp32, eight at a time (n a multiple of 8): the shift, lane for lane. */
__attribute__((target("avx2"))) static void bf16_avx2(const uint8_t *src, uint32_t n,
                                                      float *out) {
    for (uint32_t i = 0; i < n; i += 8u) {
        const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2u * i)));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_slli_epi32(b, 16));
    }
}
#endif

static void load_vals(const uint8_t *src, int dt, uint32_t n, float *out) {
#ifdef STEP_AVX2
    if (dt == KVT__DT_BF16 && n % 8u == 0 && kvt__recall_scan_tiled(-1)) {
        bf16_avx2(src, n, out);
        return;
    }
#endif
    if (dt == KVT__DT_BF16) {
        for (uint32_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2u * i, sizeof h);
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(out + i, &bits, sizeof bits);
        }
        return;
    }
    for (uint32_t i = 0; i < n; i++)
        out[i] = kvt__load_elem(src, dt, i);
}

/* What the scores of a scored row are for. */
typedef enum { USE_BEST, USE_PROMO, USE_CAL } score_use;

/* Rows scored SB at a time, in the order they are pushed, each row's scores then used in that
 * order as if scored alone: a row's chains are kvt__recall_exact's (branch j ascending, then
 * latent d ascending, from +0, then · s), on the tiled chains where the CPU runs them
 * (kvt__recall_chains_tiled) or eight heads at a time here — the same bits either way. */
typedef struct scorer {
    const kvt__recall_scan_args *a;
    const float *qT;
    size_t HP, qdim;
    float *X, *acc, *sc;
    uint64_t row[SB];
    uint32_t tag[SB], n;
    score_use use;
    float *best, *best_ar;
    uint32_t *arg;
    kvt__promo_view *pv;
} scorer;

/* The chains of rows 0 .. n of X, eight heads at a time over a row (no tiled chains here). */
KVT__FMA_CLONES
static void chains_rows(const float *X, size_t qdim, const float *qT, size_t HP, uint32_t n,
                        float *acc) {
    for (uint32_t r = 0; r < n; r++) {
        const float *x = X + r * qdim;
        for (size_t h0 = 0; h0 < HP; h0 += TILE) {
            float c[TILE];
            for (uint32_t t = 0; t < TILE; t++)
                c[t] = 0.0f;
            for (size_t j = 0; j < qdim; j++) {
                const float xj = x[j];
                const float *qj = qT + j * HP + h0;
#pragma GCC unroll 8
                for (uint32_t t = 0; t < TILE; t++)
                    c[t] = fmaf(qj[t], xj, c[t]);
            }
            for (uint32_t t = 0; t < TILE; t++)
                acc[r * HP + h0 + t] = c[t];
        }
    }
}

static void sc_flush(scorer *s) {
    const kvt__recall_scan_args *a = s->a;
    const uint32_t H = a->n_heads, n = s->n;
    if (n == 0)
        return;
    const uint32_t nr = (n + 5u) / 6u * 6u;
    if (nr > n) /* padding rows: zero, their chains unread */
        memset(s->X + n * s->qdim, 0, sizeof(float) * (nr - n) * s->qdim);
    if (!kvt__recall_chains_tiled(s->X, s->qdim, s->qT, s->HP, nr, s->acc))
        chains_rows(s->X, s->qdim, s->qT, s->HP, n, s->acc);
    for (uint32_t i = 0; i < n; i++) {
        float *sc = s->sc;
        for (uint32_t h = 0; h < H; h++)
            sc[h] = a->scale * s->acc[i * s->HP + h];
        if (s->use == USE_BEST) {
            fold_max(s->best, sc, H);
        } else if (s->use == USE_PROMO) {
            uint32_t hit = 0;
            for (uint32_t h = 0; h < H; h++)
                hit |= sc[h] >= s->best_ar[h];
            s->pv->prom_hist[s->tag[i]] =
                kvt__promo_hist_next(s->pv->prom_hist[s->tag[i]], hit, s->pv->mask);
            fold_max(s->best, sc, H);
        } else {
            for (uint32_t h = 0; h < H; h++)
                if (sc[h] > s->best_ar[h]) {
                    s->best_ar[h] = sc[h];
                    s->arg[h] = (uint32_t)s->row[i];
                }
        }
    }
    s->n = 0;
}

/* Queue row (tag: its place in the promoted list) for scoring. */
static void sc_push(scorer *s, uint64_t row, uint32_t tag) {
    const kvt__recall_scan_args *a = s->a;
    const uint32_t bd = a->branch_dim;
    const uint8_t *p =
        a->base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) *
                      a->slot_stride;
    float *x = s->X + s->n * s->qdim;
    load_vals(p + a->branch_offset, a->branch_dtype, bd, x); /* kvt__sigma_branch_val's */
    load_vals(p, a->dtype, a->latent_dim, x + bd);            /* kvt__sketch_latent's */
    s->row[s->n] = row;
    s->tag[s->n] = tag;
    if (++s->n == SB)
        sc_flush(s);
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
    float *X = qT + qdim * HP;
    float *acc = X + SB * qdim;
    float *sc = acc + SB * HP;
    float *best_ar = sc + HP;
    uint32_t *arg = (uint32_t *)(best_ar + H);
    uint32_t *merged = arg + H; /* promotion's part (kvt__promo_scratch_u32) */
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
    scorer sr = {.a = &a, .qT = qT, .HP = HP, .qdim = qdim, .X = X, .acc = acc, .sc = sc,
                 .use = USE_BEST, .best = best, .best_ar = best_ar, .arg = arg};
    for (uint64_t r = 0; r < S; r++)
        sc_push(&sr, r, 0);
    for (uint64_t i = 0; i < a.m; i++) {
        if (a.kept[i] < S)
            continue;
        kept_past++;
        sc_push(&sr, a.kept[i], 0);
    }
    for (uint64_t r = a.n_closed; r < x->n_rows; r++)
        sc_push(&sr, r, 0);
    sc_flush(&sr);
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
        sr.use = USE_PROMO;
        sr.pv = &pv;
        for (uint32_t i = 0; i < pv.h->n_prom; i++)
            sc_push(&sr, pv.prom_row[i], i);
        sc_flush(&sr);
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
        sr.use = USE_CAL;
        FOR_ARCHIVED(&a, S, row, sc_push(&sr, row, 0));
        sc_flush(&sr);
        /* the heads prepared together (kvt__recall_heads_prep_cpu: kvt__recall_head_prep's bits)
         * in the scan's part of the scratch, laid out as the scan's: q̃_sk [H][rank], the heads
         * [H], then the preparation's own */
        float *q_sk = scan_scratch;
        kvt__recall_head *heads = (kvt__recall_head *)(q_sk + (size_t)H * rank);
        kvt__recall_heads_prep_cpu(a.q, qdim, H, D, a.basis, rank, q_sk, heads,
                                   (float *)(heads + H));
        for (uint32_t h = 0; h < H; h++) {
            if (arg[h] == UINT32_MAX)
                continue;
            const float *q = a.q + h * qdim;
            const uint8_t *p =
                a.base +
                (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, arg[h]) * a.slot_stride;
            float P, ncsk, e;
            float idx = kvt__recall_idx(q, q_sk + (size_t)h * rank, p, D, a.branch_offset,
                                        a.branch_dtype, bd, kvt__scan_csk(&a, arg[h]), rank,
                                        a.scale, &P, &ncsk);
            float cert = kvt__recall_cert(&heads[h], *kvt__scan_rho(&a, arg[h]), a.scale, D);
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
        /* The groups due (kvt__recall_groups_want) are built on every scan step, so that a
         * step that does not prune still brings the newest blocks' groups in; the pruned scan
         * runs where it pays (kvt__recall_prune_pays) */
        const bool groups = Bg && x->mode != KVT__RECALL_MARGIN;
        const bool prune_pays = kvt__recall_prune_pays(st, st->steps);
        if (groups)
            build_groups(x, &a, st, scan_scratch);
        /* (at 8 bits the groups' bound is widened by the planes' rounding: the same fired
         * rows as the full 8-bit scan; recall_group.h, kvt__recall_group_upper) */
        if (groups && prune_pays) {
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
