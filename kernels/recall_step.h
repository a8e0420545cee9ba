/*
 * recall_step.h — one decode step of the recall tier for one (request, layer), CPU twin
 * (docs/recall.md §4). Arranges the KVT_HD functions of recall_scan.h (exact score, idx, cert,
 * the triggers) and conformal.h (samples, z); a CUDA kernel over the same functions gives the
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
 *      groups of blocks closed since the last step are built first (kvt__recall_group_block_cpu)
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
#include "kernels/conformal.h"
#include "kernels/recall_scan.h"

/* Floats of scratch kvt__recall_step_cpu takes for this work item. */
size_t kvt__recall_step_scratch_floats(const kvt__recall_step_args *x);
/* One work item, arguments checked by the caller (the scan's rules, plus st, samples). */
void kvt__recall_step_cpu(const kvt__recall_step_args *a, float *scratch);

#endif /* KVT_KERNELS_RECALL_STEP_H */
