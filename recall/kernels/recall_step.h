/*
 * recall_step.h — one decode step of the recall tier for one (request, layer), CPU twin
 * (docs/recall.md §4). Arranges the KVT_HD functions of recall_scan.h (exact score, idx, cert,
 * the triggers) and conformal_math.h (samples, z); a CUDA kernel over the same functions gives the
 * same bits. The step, given the request's absorbed queries (one per query head):
 *
 *   1. best_h = the head's highest exact score (kvt__recall_exact) over the rows attended without
 *      recall: rows [0, S) (S = min(sinks, n_closed)), the kept rows past S, the tail
 *      [n_closed, n_rows). NaN scores are skipped; no row: -Inf.
 *   2. No archived row: nothing fires, the step is not dense, no calibration step is counted.
 *   3. Conformal mode while the calibration is open: a calibration step. The step attends every
 *      row (dense); for each head, a* = its highest exact score among the archived rows (ties to
 *      the lower position, NaN skipped) gives e = (score − idx) / cert when defined
 *      (kvt__conformal_sample); the samples go in sorted, the step is counted, and at a window end
 *      z is fixed (kvt__conformal_close).
 *   4. Otherwise the scan with z = the state's (conformal), √(D − 64) (sound) or the margin δ
 *      (margin); its overflow makes the step dense. With group planes (conformal and sound) the
 *      groups of closed blocks are built first, on every scan step (kvt__recall_group_block_cpu;
 *      the newest KVT__RECALL_GROUP_LAG blocks one a step, kvt__recall_groups_want)
 *      and the scan is the pruned one (kvt__recall_scan_pruned_cpu: the full scan's output, bit
 *      for bit, visiting fewer rows); the margin mode and a step without planes scan in full.
 *
 * With promotion (a->promo, docs/recall.md §4.2): first, after a close, the promoted rows the
 * close kept are absorbed and those without a hit in the window demoted; the promoted rows are
 * attended in step 1 (each records whether it reached the others' best for some head) and are
 * not archived in steps 2-4; after the scan the candidates' histories take the fired rows, the
 * promoted rows join the fetch buffer (unless the step is dense), and candidates with enough
 * hits are promoted, up to prom_room.
 *
 * The state records the step's certificate (kvt__recall_state). Scratch: the scan's plus the
 * transposed queries and per-head scores of steps 1 and 3.
 */
#ifndef KVT_KERNELS_RECALL_STEP_H
#define KVT_KERNELS_RECALL_STEP_H

#include "kernels/backend.h"
#include "recall/kernels/conformal_math.h"
#include "recall/kernels/recall_scan.h"

#include <float.h>

/* A step's certificate into the trigger's state (every backend's step, NoPE and RoPE): the
 * last_* fields, their sums over steps, and the request's dense flag when asked for. */
KVT_HD void kvt__recall_state_record(kvt__recall_state *st, uint8_t *dense_out, uint32_t dense,
                                     uint32_t over, uint64_t archived, uint64_t visited,
                                     uint64_t fired, uint64_t fetched) {
    st->last_dense = dense;
    st->last_overflow = over;
    st->last_archived = archived;
    st->last_visited = visited;
    st->last_fired = fired;
    st->last_fetched = fetched;
    st->visited += visited;
    st->fired += fired;
    st->fetched += fetched;
    if (dense_out)
        *dense_out = (uint8_t)dense;
}

/* Does the step `step` (the state's steps counting this one) run the pruned scan where it has
 * group planes (conformal and sound modes)? After a dense step that did not overflow (a
 * calibration step: nothing known), while the last scan visited at most 7/8 of the archive, and
 * every 16th step to look again; otherwise the full scan, whose tiled form is cheaper than bounds
 * that skip nothing. After an overflow the full scan's early stop at the (W + 1)-th fired row is
 * what pays: the pruned scan visits every live group to know the first W (on random keys, where
 * every step overflows, pruning after each cost 5.7× the full scan's plan + run at 128k, 8 bits).
 * Both give the same fired rows (docs/recall.md §3.2): only `visited` and the planes built tell
 * them apart. */
KVT_HD int kvt__recall_prune_pays(const kvt__recall_state *st, uint64_t step) {
    return (st->last_dense && !st->last_overflow) ||
           st->last_visited * 8u <= st->last_archived * 7u || step % 16u == 0;
}

/* The recall ops' argument rules, one definition for every backend (the CPU and guarded ops in
 * backend_cpu.c and backend_guarded.c, the CUDA ops in cuda/cu_recall.cu and cu_rope.cu answer
 * KVT_ERR_INVALID_ARGUMENT when false).
 * The latent's row dtype by kvt__sketch_dtype_ok (fp8 ds_mla included), the branch's bf16 / fp16 /
 * fp32, and z as the mode takes it: sound >= √(D − 64) (false for NaN; +Inf fires every row),
 * margin a finite δ >= 0, conformal any finite z. */
KVT_HD int kvt__recall_scan_args_ok(const kvt__recall_scan_args *a) {
    const int br = a->branch_dtype;
    if (a->latent_dim <= 64u || a->latent_dim > KVT__SKETCH_MAX_DIM ||
        a->branch_dim > KVT__RECALL_MAX_BRANCH ||
        (a->q8_off ? a->rank > a->q8_off || a->q8_off > KVT__SKETCH_MAX_RANK ||
                         a->csk_stride != a->q8_off + kvt__recall_q8_words(a->branch_dim, a->q8_off)
                   : a->rank > a->csk_stride || a->csk_stride > KVT__SKETCH_MAX_RANK) ||
        (a->rank && !a->basis) ||
        !kvt__sketch_dtype_ok(a->dtype, a->latent_dim) ||
        (a->branch_dim && br != KVT__DT_BF16 && br != KVT__DT_FP16 && br != KVT__DT_FP32) ||
        a->n_closed > UINT32_MAX || a->m > a->n_closed || a->n_head > a->n_closed ||
        (a->n_head && (!a->csk_head || !a->rho_head)) || (a->cap && !a->fired) || !a->n_fired ||
        !a->overflow || !(a->scale > 0.0f && a->scale <= FLT_MAX))
        return 0;
    if (a->mode == KVT__RECALL_SOUND)
        return a->z >= sqrtf((float)(a->latent_dim - 64u));
    if (a->mode == KVT__RECALL_MARGIN)
        return a->z >= 0.0f && a->z <= FLT_MAX;
    return a->mode == KVT__RECALL_CONFORMAL && a->z >= -FLT_MAX && a->z <= FLT_MAX;
}

/* A recall step's arguments: the scan's rules with the z its mode takes (conformal: any finite
 * z, the state's), the state, the samples of a calibration, a tail within the table, the group
 * planes and the promotion tables when given. */
KVT_HD int kvt__recall_step_args_ok(const kvt__recall_step_args *x) {
    kvt__recall_scan_args a = x->scan;
    a.mode = x->mode;
    a.z = kvt__recall_mode_z(x->mode, a.latent_dim, x->margin, 0.0f); /* conformal: any z */
    const uint32_t B = x->block_rows;
    const int groups_ok =
        !x->g_perm || (B >= 64u && (B & (B - 1u)) == 0 && B <= (1u << 20) && x->g_n &&
                       x->g_end && x->g_centre && x->g_stat && x->g_dim >= a.branch_dim + a.rank);
    const int promo_ok =
        !x->promo || (x->prom_cap >= 1 && x->prom_cap <= (1u << 16) &&
                      x->cand_cap >= x->prom_cap && x->cand_cap <= (1u << 20) &&
                      x->prom_room <= x->prom_cap && x->hits >= 1 && x->hits <= x->window &&
                      x->window <= 32 && a.fired && a.n_closed <= UINT32_MAX);
    return kvt__recall_scan_args_ok(&a) && x->st && a.best && x->n_rows >= a.n_closed &&
           x->n_rows <= UINT32_MAX && (x->mode != KVT__RECALL_CONFORMAL || x->samples) &&
           (a.n_heads == 0 || a.q) && groups_ok && promo_ok;
}

/* A planned item within its plan's bound (kvt__recall_plan_args.bound): no more heads, rank,
 * latent values, closed or kept rows, samples, promotion tables, group blocks' rows or centre
 * values, so the launch and workspace the bound sized serve it. */
KVT_HD int kvt__recall_plan_fits(const kvt__recall_step_args *b, const kvt__recall_step_args *x) {
    const kvt__recall_scan_args *s = &x->scan, *t = &b->scan;
    return s->n_heads <= t->n_heads && s->rank <= t->rank && s->latent_dim <= t->latent_dim &&
           s->branch_dim <= t->branch_dim && s->n_closed <= t->n_closed && s->m <= t->m &&
           x->sample_cap <= b->sample_cap &&
           (!x->promo || (b->promo && x->prom_cap <= b->prom_cap && x->cand_cap <= b->cand_cap)) &&
           (!x->g_perm || (b->g_perm && x->block_rows <= b->block_rows && x->g_dim <= b->g_dim));
}

/* Planned item i of a (kvt__recall_plan_args) as recall_step takes it, on every backend: its
 * arguments with the queries at a->query + q_off (its lagged ones at lag when lag_use) and its
 * divider copied into *div (x->scan.pdiv = div); false when the queries lie past the query
 * buffer, or the item breaks the argument rules or the plan's bound. */
KVT_HD int kvt__recall_plan_item_args(const kvt__recall_plan_args *a, uint32_t i,
                                      kvt__recall_step_args *x, kvt__div32 *div) {
    const kvt__recall_plan_item *it = &a->items[i];
    *x = it->a;
    *div = it->div;
    x->scan.pdiv = div;
    x->scan.q = it->lag_use ? it->lag : a->query ? a->query + it->q_off : NULL;
    const size_t qf = (size_t)x->scan.n_heads * (x->scan.latent_dim + x->scan.branch_dim);
    return a->query && it->q_off <= a->query_floats && qf <= a->query_floats - it->q_off &&
           (!it->lag_use || it->lag) && kvt__recall_step_args_ok(x) &&
           kvt__recall_plan_fits(&a->bound, x);
}

/* Floats of scratch kvt__recall_step_cpu takes for this work item. */
size_t kvt__recall_step_scratch_floats(const kvt__recall_step_args *x);
/* One work item, arguments checked by the caller (the scan's rules, plus st, samples). */
void kvt__recall_step_cpu(const kvt__recall_step_args *a, float *scratch);

#endif /* KVT_KERNELS_RECALL_STEP_H */
