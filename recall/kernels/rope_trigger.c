/*
 * rope_trigger.c — CPU twin of the RoPE recall step (rope_trigger.h for what it computes).
 * Straight loops over the per-element functions (kvt__recall_exact, kvt__recall_idx,
 * kvt__recall_cert, the conformal functions) and one call of the full scan per KV head — or of
 * the pruned scan over the archive's groups (recall_group.h), whose outputs are the full
 * scan's — every value is the per-element function's, so a host oracle over the same functions
 * gives the same bits. Not tiled yet (the NoPE step's 8-head tiles are the model for that).
 */
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/recall_group.h"

#include "recall/kernels/recall_step.h"
#include "recall/kernels/sketch.h"
#include "kernels/topm.h"
#include "lib/base/base.h"

#include <float.h>
#include <string.h>


/* The scan's region of the scratch: one KV head's full scan, or its pruned scan and the group
 * build (one at a time), even so that what follows stays 8-byte aligned. */
static size_t scan_region_floats(const kvt__recall_rope_args *a, uint32_t rmax) {
    size_t f = kvt__recall_scan_scratch_floats(a->group, rmax, a->D);
    if (a->g_perm) {
        const size_t p =
            (kvt__recall_scan_pruned_scratch_bytes(a->group, rmax, a->D, a->ar_n) + 3u) / 4u;
        const size_t g =
            (kvt__recall_group_build_scratch_bytes(a->g_B, a->branch_dim, rmax) + 3u) / 4u;
        f = p > f ? p : f;
        f = g > f ? g : f;
    }
    return (f + 1u) & ~(size_t)1u;
}

size_t kvt__recall_rope_scratch_floats(const kvt__recall_rope_args *a) {
    uint32_t rmax = 0;
    for (uint32_t h = 0; h < a->n_kv; h++)
        rmax = a->rank[h] > rmax ? a->rank[h] : rmax;
    /* the scan's (one KV head at a time), then per query head the best archived score and row,
     * and one head's prep: q̃_sk [rank], tmp [D] */
    size_t f = scan_region_floats(a, rmax) + 2u * (size_t)a->group + rmax + a->D;
    /* capped (a host archive): an overflow's choice of W rows, one head at a time — the group's
     * preps (q̃_sk [G][rank], heads [G]), a key per archived row and the top-m's scratch */
    if (a->capped)
        f += (size_t)a->group * rmax +
             (sizeof(kvt__recall_head) * a->group + sizeof(float) - 1) / sizeof(float) + a->ar_n +
             kvt__topm_scratch_u32((uint32_t)a->ar_n);
    return f;
}


/* The key of head h at row `row` of the table. */
static inline const uint8_t *table_key(const kvt__recall_rope_args *a, uint32_t h, uint64_t row) {
    return a->keys +
           (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)row) *
               a->slot_stride +
           (size_t)h * a->row_bytes;
}

static inline const uint8_t *archive_key(const kvt__recall_rope_args *a, uint32_t h, uint64_t k) {
    return a->ar_bytes + ((size_t)h * a->ar_cap + k) * a->ar_row_bytes;
}

/* The distinct archive rows of arg[0 .. G) (UINT32_MAX: none) ascending, at most cap, into out:
 * a capped calibration step's fetched rows. Returns how many. */
static uint32_t capped_calibration_rows(const uint32_t *arg, uint32_t G, uint32_t cap,
                                        uint32_t *out) {
    uint32_t n = 0;
    uint32_t last = 0;
    bool any = false;
    /* repeated minimum over the rows above the last taken: O(G²), G is a group's query heads */
    while (n < cap) {
        uint32_t next = UINT32_MAX;
        for (uint32_t g = 0; g < G; g++)
            if (arg[g] != UINT32_MAX && (!any || arg[g] > last) && arg[g] < next)
                next = arg[g];
        if (next == UINT32_MAX)
            break;
        out[n++] = last = next;
        any = true;
    }
    return n;
}

/* kvt__recall_exact (s = 1) of nr keys against m query heads (q_t at q + t·qw), out[r][t]: the
 * same chain per (key, head) — branch j ascending, then latent d ascending, from +0 — with the
 * nr·m chains interleaved (independent: up to 16 in flight instead of one; the same bits). */
#define EXACT_HEADS 4u
#define EXACT_ROWS 4u
static inline __attribute__((always_inline)) void
exact_block(const float *q, size_t qw, uint32_t m, const uint8_t *const *keys, uint32_t nr,
            int dtype, uint32_t D, uint32_t bo, int bt, uint32_t bd,
            float out[EXACT_ROWS][EXACT_HEADS]) {
    float acc[EXACT_ROWS][EXACT_HEADS] = {{0}};
    for (uint32_t j = 0; j < bd; j++)
        for (uint32_t r = 0; r < nr; r++) {
            const float kj = kvt__sigma_branch_val(keys[r], bo, bt, j);
            for (uint32_t t = 0; t < m; t++)
                acc[r][t] = fmaf(q[(size_t)t * qw + D + j], kj, acc[r][t]);
        }
    for (uint32_t d = 0; d < D; d++)
        for (uint32_t r = 0; r < nr; r++) {
            const float kd = kvt__sketch_latent(keys[r], dtype, d);
            for (uint32_t t = 0; t < m; t++)
                acc[r][t] = fmaf(q[(size_t)t * qw + d], kd, acc[r][t]);
        }
    for (uint32_t r = 0; r < nr; r++)
        for (uint32_t t = 0; t < m; t++)
            out[r][t] = 1.0f * acc[r][t];
}

/* exact_block for a whole block (EXACT_ROWS keys × EXACT_HEADS heads) with the latent's dtype a
 * constant (each caller below folds the conversion): constant bounds, so the 16 chains stay in
 * registers. The same chains as exact_block, in the same order per chain. */
static inline __attribute__((always_inline)) void
exact_full(const float *q, size_t qw, const uint8_t *const *keys, int dtype, uint32_t D,
           uint32_t bo, int bt, uint32_t bd, float out[EXACT_ROWS][EXACT_HEADS]) {
    float acc[EXACT_ROWS][EXACT_HEADS] = {{0}};
    for (uint32_t j = 0; j < bd; j++)
#pragma GCC unroll 4
        for (uint32_t r = 0; r < EXACT_ROWS; r++) {
            const float kj = kvt__sigma_branch_val(keys[r], bo, bt, j);
#pragma GCC unroll 4
            for (uint32_t t = 0; t < EXACT_HEADS; t++)
                acc[r][t] = fmaf(q[(size_t)t * qw + D + j], kj, acc[r][t]);
        }
    for (uint32_t d = 0; d < D; d++) {
        float qd[EXACT_HEADS];
        for (uint32_t t = 0; t < EXACT_HEADS; t++)
            qd[t] = q[(size_t)t * qw + d];
#pragma GCC unroll 4
        for (uint32_t r = 0; r < EXACT_ROWS; r++) {
            const float kd = kvt__sketch_latent(keys[r], dtype, d);
#pragma GCC unroll 4
            for (uint32_t t = 0; t < EXACT_HEADS; t++)
                acc[r][t] = fmaf(qd[t], kd, acc[r][t]);
        }
    }
    for (uint32_t r = 0; r < EXACT_ROWS; r++)
        for (uint32_t t = 0; t < EXACT_HEADS; t++)
            out[r][t] = 1.0f * acc[r][t];
}

/* Over rows [0, n) of KV head h (key(a, h, row)), ascending, each of its G query heads' highest
 * exact score (NaN skipped: ties and NaN as a plain ascending loop of `sc > best`) into
 * best[0 .. G) (starting from what best holds) and, when arg is not NULL, the row of it. */
static inline __attribute__((always_inline)) void
exact_best(const kvt__recall_rope_args *a, uint32_t h, uint64_t n,
           const uint8_t *(*key)(const kvt__recall_rope_args *, uint32_t, uint64_t), float *best,
           uint32_t *arg) {
    const uint32_t D = a->D, G = a->group, bd = a->branch_dim;
    const size_t qw = (size_t)D + bd;
    const int bt = bd ? a->branch_dtype : a->dtype;
    float sc[EXACT_ROWS][EXACT_HEADS];
    const uint8_t *keys[EXACT_ROWS];
    for (uint64_t r0 = 0; r0 < n; r0 += EXACT_ROWS) {
        const uint32_t nr = n - r0 < EXACT_ROWS ? (uint32_t)(n - r0) : EXACT_ROWS;
        for (uint32_t r = 0; r < nr; r++)
            keys[r] = key(a, h, r0 + r);
        for (uint32_t g0 = 0; g0 < G; g0 += EXACT_HEADS) {
            const uint32_t m = G - g0 < EXACT_HEADS ? G - g0 : EXACT_HEADS;
            const float *qg = a->q + (size_t)(h * G + g0) * qw;
            if (nr < EXACT_ROWS || m < EXACT_HEADS)
                exact_block(qg, qw, m, keys, nr, a->dtype, D, a->branch_offset, bt, bd, sc);
            else if (a->dtype == KVT__DT_BF16)
                exact_full(qg, qw, keys, KVT__DT_BF16, D, a->branch_offset, bt, bd, sc);
            else if (a->dtype == KVT__DT_FP16)
                exact_full(qg, qw, keys, KVT__DT_FP16, D, a->branch_offset, bt, bd, sc);
            else
                exact_full(qg, qw, keys, KVT__DT_FP32, D, a->branch_offset, bt, bd, sc);
            for (uint32_t r = 0; r < nr; r++)
                for (uint32_t g = 0; g < m; g++)
                    if (sc[r][g] > best[g0 + g]) {
                        best[g0 + g] = sc[r][g];
                        if (arg)
                            arg[g0 + g] = (uint32_t)(r0 + r);
                    }
        }
    }
}

/* A capped overflow of KV head h (more than cap of its archived rows fired): the cap rows it keeps
 * are the fired ones of the highest kvt__recall_rope_capped_key, ties to the lower index,
 * ascending — every row's fire test and score from the per-element functions (the scan's
 * predicate), the selection kvt__topm_u32's. ws: the scratch past the step's own. */
static void capped_choice(const kvt__recall_rope_args *a, uint32_t h, float z, float *ws,
                          float *tmp) {
    const uint32_t G = a->group, D = a->D, rank = a->rank[h];
    kvt__recall_scan_args v;
    kvt__recall_rope_view(a, h, z, &v);
    float *q_sk = ws;
    kvt__recall_head *hd = (kvt__recall_head *)(q_sk + (size_t)G * (rank ? rank : 1u));
    uint32_t *keys = (uint32_t *)(ws + (size_t)G * (rank ? rank : 1u) +
                                  (sizeof(kvt__recall_head) * G + sizeof(float) - 1) /
                                      sizeof(float));
    uint32_t *topm = keys + a->ar_n;
    const size_t qw = (size_t)D + v.branch_dim;
    for (uint32_t g = 0; g < G; g++)
        kvt__recall_head_prep(v.q + g * qw, D, v.basis, rank, q_sk + (size_t)g * rank, tmp,
                              &hd[g]);
    for (uint64_t k = 0; k < a->ar_n; k++) {
        const uint8_t *row = v.base + (size_t)k * v.slot_stride;
        const uint16_t *csk = v.csk + (size_t)k * v.csk_stride;
        int fires = 0;
        float score = -INFINITY;
        for (uint32_t g = 0; g < G; g++) {
            float P, ncsk;
            const float idx = kvt__recall_idx(v.q + g * qw, q_sk + (size_t)g * rank, row, D,
                                              v.branch_offset, v.branch_dtype, v.branch_dim, csk,
                                              rank, 1.0f, &P, &ncsk);
            fires |= kvt__recall_rope_fires(&v, &hd[g], g, idx, P, ncsk, v.rho[k]);
            const float sc = idx - v.best[g];
            if (sc > score || sc != sc)
                score = sc;
        }
        keys[k] = kvt__recall_rope_capped_key(fires, score);
    }
    kvt__topm_u32(keys, (uint32_t)a->ar_n, a->cap, a->fired + (size_t)h * a->cap, topm);
    a->n_fired[h] = a->cap;
}

KVT__FMA_CLONES
void kvt__recall_rope_step_cpu(const kvt__recall_rope_args *a, float *scratch) {
    kvt__recall_state *st = a->st;
    const uint32_t D = a->D, G = a->group, H = a->n_kv, nq = H * G;
    const uint32_t bd = a->branch_dim, bo = a->branch_offset, qw = D + bd;
    const int bt = bd ? a->branch_dtype : a->dtype;
    float *scan_scratch = scratch;
    uint32_t rmax = 0;
    for (uint32_t h = 0; h < H; h++)
        rmax = a->rank[h] > rmax ? a->rank[h] : rmax;
    float *best_ar = scratch + scan_region_floats(a, rmax);
    uint32_t *arg = (uint32_t *)(best_ar + G);
    float *q_sk = (float *)(arg + G);
    float *tmp = q_sk + rmax;

    /* 1. Each query head's best over the rows its KV head attends without recall. */
    for (uint32_t t = 0; t < nq; t++)
        a->best[t] = -INFINITY;
    for (uint32_t h = 0; h < H; h++)
        exact_best(a, h, a->n_rows, table_key, a->best + (size_t)h * G, NULL);

    const uint64_t archived = a->ar_n * H;
    uint32_t dense = 0, over = 0;
    uint64_t fired = 0, fetched = 0, visited = archived;
    for (uint32_t h = 0; h < H; h++)
        a->n_fired[h] = a->overflow[h] = 0;
    st->steps++;
    if (a->ar_n == 0) {
        /* 2. nothing to recall */
    } else if (a->mode == KVT__RECALL_CONFORMAL && st->phase == KVT__CONFORMAL_OPEN) {
        /* 3. A calibration step: every archived row attended; one sample per query head. */
        for (uint32_t h = 0; h < H; h++) {
            for (uint32_t g = 0; g < G; g++) {
                best_ar[g] = -INFINITY;
                arg[g] = UINT32_MAX;
            }
            exact_best(a, h, a->ar_n, archive_key, best_ar, arg);
            const uint32_t rank = a->rank[h];
            const float *V = rank ? a->basis + (size_t)h * a->basis_stride * D : NULL;
            if (a->capped) /* fetch each query head's a*, distinct and ascending, at most cap */
                a->n_fired[h] =
                    capped_calibration_rows(arg, G, a->cap, a->fired + (size_t)h * a->cap);
            fetched += a->n_fired[h];
            for (uint32_t g = 0; g < G; g++) {
                if (arg[g] == UINT32_MAX)
                    continue;
                const float *q = a->q + (size_t)(h * G + g) * qw;
                kvt__recall_head hd;
                kvt__recall_head_prep(q, D, V, rank, q_sk, tmp, &hd);
                const size_t k = arg[g];
                float P, ncsk, e;
                float idx = kvt__recall_idx(q, q_sk, archive_key(a, h, k), D, bo, bt, bd,
                                            a->csk + ((size_t)h * a->ar_cap + k) * a->csk_stride,
                                            rank, 1.0f, &P, &ncsk);
                float cert = kvt__recall_cert(&hd, a->rho[(size_t)h * a->ar_cap + k], 1.0f, D);
                if (kvt__conformal_sample(best_ar[g], idx, cert, &e))
                    kvt__conformal_insert(a->samples, &st->n_samples, a->sample_cap, e);
            }
        }
        st->cal_steps++;
        st->phase = kvt__conformal_close(a->samples, st->n_samples, st->cal_steps, &st->z, &st->k,
                                         &st->clamped);
        st->calib_steps++;
        dense = !a->capped;
        if (dense)
            fetched = archived;
    } else {
        /* 4. Per KV head, the scan of its archive with its group's queries: the pruned scan
         * where it pays, as on NoPE layers (kvt__recall_prune_pays), for heads with a basis;
         * otherwise the full scan. The same fired rows either way. */
        const float z = kvt__recall_mode_z(a->mode, D, a->margin, st->z);
        const bool prune = a->g_perm && a->mode != KVT__RECALL_MARGIN &&
                           kvt__recall_prune_pays(st, st->steps);
        uint64_t want = prune ? a->ar_n / a->g_B : 0;
        if (want > a->g_blocks_cap)
            want = a->g_blocks_cap;
        visited = 0;
        for (uint32_t h = 0; h < H; h++) {
            kvt__recall_scan_args v;
            kvt__recall_rope_view(a, h, z, &v);
            if (prune && a->rank[h]) {
                const uint32_t B = a->g_B, Gs = kvt__recall_group_slots(B);
                const size_t dim = a->g_dim;
                const kvt__recall_group_block planes = {
                    .perm = a->g_perm + (size_t)h * B, .n_groups = a->g_n + h,
                    .end = a->g_end + (size_t)h * Gs, .centre = a->g_centre + h * Gs * dim,
                    .stat = a->g_stat + (size_t)h * Gs * KVT__RG_STATS};
                if (want > st->n_grouped) /* the blocks archived since the last build */
                    kvt__recall_group_build_cpu(&v, B, a->g_dim, H, &planes, st->n_grouped, want,
                                                scan_scratch);
                const kvt__recall_groups g = {.block_rows = B,
                                              .n_blocks = want > st->n_grouped ? want
                                                                               : st->n_grouped,
                                              .dim = a->g_dim,
                                              .stride = H,
                                              .perm = planes.perm,
                                              .n_groups = planes.n_groups,
                                              .end = planes.end,
                                              .centre = planes.centre,
                                              .stat = planes.stat};
                kvt__recall_prune_stats ps;
                kvt__recall_scan_pruned_cpu(&v, &g, scan_scratch, &ps);
                visited += ps.visited;
            } else {
                kvt__recall_scan_cpu(&v, scan_scratch);
                visited += a->ar_n;
            }
            if (a->capped && a->overflow[h])
                capped_choice(a, h, z, tmp + D, tmp);
            fired += (uint64_t)a->n_fired[h] + a->overflow[h];
            fetched += a->n_fired[h];
            over |= a->overflow[h];
        }
        if (want > st->n_grouped)
            st->n_grouped = (uint32_t)want;
        dense = over && !a->capped; /* capped: the first cap fired rows of each head */
        if (dense)
            fetched = archived;
        st->overflow_steps += over;
    }
    if (dense)
        for (uint32_t h = 0; h < H; h++)
            a->n_fired[h] = 0; /* the emission attends every archived row instead */
    kvt__recall_state_record(st, a->dense, dense, over, archived, a->ar_n ? visited : 0, fired,
                             fetched);
}


void kvt__recall_rope_emit_cpu(const kvt__recall_rope_emit_args *a) {
    const bool dense = !a->capped && (a->all || a->st->last_dense != 0);
    const size_t rb = a->row_bytes;
    uint64_t o = a->chain ? (uint64_t)a->indptr[0] : a->out;
    /* chained: the host checked the batch's total; a set past the capacity is cut here (never
     * written past the array) — kvt_batch_capacity's figures make it unreachable */
    const uint64_t o0 = o;
    if (o + (uint64_t)a->n_kv * (a->n_rows + a->ar_n) > a->capacity) {
        for (uint32_t h = 0; !a->length && h <= a->n_kv; h++)
            a->indptr[h] = (int32_t)o;
        if (a->length)
            *a->length = 0;
        return;
    }
    for (uint32_t h = 0; h < a->n_kv; h++) {
        if (!a->length)
            a->indptr[h] = (int32_t)o;
        for (uint64_t r = 0; r < a->n_rows; r++)
            a->indices[o++] = kvt__page_slot(a->pages, a->first_page, a->pdiv, (uint32_t)r);
        uint64_t m = dense ? a->ar_n : a->capped && a->all ? 0 : a->n_fired[h];
        /* never past the list or the fetch area (the step keeps n_fired <= min(cap, ar_n)) */
        m = m > a->cap && !dense ? a->cap : m;
        m = m > a->ar_n ? a->ar_n : m;
        for (uint64_t j = 0; j < m; j++) {
            const uint64_t k = dense ? j : a->fired[(size_t)h * a->cap + j];
            const int32_t slot = kvt__recall_rope_fetch_slot(a, (uint32_t)j);
            const uint8_t *src = a->ar_bytes + ((size_t)h * a->ar_cap + k) * a->n_planes * rb;
            for (uint32_t p = 0; p < a->n_planes; p++)
                memcpy(a->plane[p] + (size_t)slot * a->slot_stride + (size_t)h * rb, src + p * rb,
                       rb);
            a->indices[o++] = slot;
        }
    }
    if (a->length) {
        *a->length = (int32_t)(o - o0);
        for (; o < o0 + a->pad; o++)
            a->indices[o] = -1;
        return;
    }
    a->indptr[a->n_kv] = (int32_t)o;
}
