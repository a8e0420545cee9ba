/*
 * recall.h — the recall trigger of one (request, layer) (docs/recall.md §4). The recall tier owns
 * no rows: the archive is the policy's (a salience layer's closed rows outside its kept set,
 * described by the policy's recall_view), the queries are the engine's. What it owns is the
 * request's trigger state, in one buffer of the backend's memory:
 *
 *   [kvt__recall_state | samples [sample_cap] | best [n_heads] | fired [cap + prom_cap] | n_fired |
 *    overflow | promotion (prom_cap > 0: kvt__recall_promo and its tables)]
 *
 * the conformal calibration and the last step's certificate (kvt__recall_state), the heads'
 * thresholds, and the fetch buffer the emission merges: at most cap rows (W) a step, past it the
 * step attends every row (overflow). Only the backend's recall_step op writes it in the decode
 * path; the host zeroes it at creation and reads it for statistics, checks and snapshots.
 */
#ifndef KVT_RECALL_RECALL_H
#define KVT_RECALL_RECALL_H

#include "kernels/backend.h"
#include "recall/kernels/conformal_math.h"
#include "tiers/policy.h"

/* Samples a calibration can hold per query head: one per calibration step, 64 steps. */
#define KVT__RECALL_SAMPLES_PER_HEAD KVT__CONFORMAL_LAST_WINDOW

typedef struct kvt__recall_layer {
    void *buf;               /* backend buffer (NULL: none allocated) */
    size_t bytes;
    kvt__recall_state *st;
    float *samples;
    float *best;
    uint32_t *fired;
    uint32_t *n_fired;
    uint32_t *overflow;
    uint32_t n_heads, sample_cap, cap;
    /* Promotion (kernels/backend.h, kvt__recall_promo; docs/recall.md §4.2): the header and its
     * tables after the trigger state, prom_cap promoted rows and cand_cap candidates; promo
     * NULL (prom_cap 0): off, the buffer laid out as without promotion. The fetch buffer holds
     * cap + prom_cap rows. */
    kvt__recall_promo *promo;
    uint32_t prom_cap, cand_cap;
    /* The pruned scan's group planes (recall/kernels/recall_group.h) for g_cap closed blocks of g_B
     * rows, centres of g_dim floats, in the backend's memory; grown at reserve (never in a
     * step), filled by the recall step as blocks close. g_cap 0: none (the full scan). */
    uint32_t *g_perm, *g_n, *g_end;
    float *g_centre, *g_stat;
    uint64_t g_cap;
    uint32_t g_B, g_dim;
    /* The lagged query (config.recall_lagged_query; docs/recall.md §4.3): the previous recall
     * step's queries, lag_floats floats in the backend's memory, which the next step scans
     * with. lag_q NULL: off. Host-side: lag_has (lag_q holds a query), last_lagged (the last
     * step scanned with it: its certificate), lag_next (this step's queries, backend memory,
     * copied into lag_q after the step's op). */
    float *lag_q;
    uint32_t lag_floats;
    uint8_t lag_has, last_lagged;
    const float *lag_next;
    /* A planned step (kvt_batch_plan_device): lag_plan_use, whether its item scans with lag_q
     * (lag_has when the step was planned, kept for a rewrite of the same plan); lag_plan_item,
     * the item was written (lag_has is set once the whole step is planned: the planned op copies
     * the step's queries into lag_q itself). */
    uint8_t lag_plan_use, lag_plan_item;
} kvt__recall_layer;

/* Allocate the buffer for n_heads query heads, a fetch cap of `cap` rows and a promoted set of
 * prom_cap rows (0: no promotion) in be's memory (kept when it already has that shape) and put
 * it in its initial state: no sample, z = Z_MAX, calibration open, zero counters, nothing
 * promoted. KVT_ERR_OUT_OF_MEMORY, or a backend write's status. */
kvt_status kvt__recall_layer_prepare(kvt__recall_layer *r, const kvt__backend *be,
                                     uint32_t n_heads, uint32_t cap, uint32_t prom_cap);
/* Bytes of the promotion part (header and tables; 0 without promotion), as read and loaded by
 * the two functions below (snapshots, checks). */
size_t kvt__recall_promo_bytes(const kvt__recall_layer *r);
/* The same for a promoted set of prom_cap rows (0: none), before any buffer exists. */
size_t kvt__recall_promo_bytes_for(uint32_t prom_cap);
kvt_status kvt__recall_layer_read_promo(const kvt__recall_layer *r, const kvt__backend *be,
                                        void *out);
/* Load a promotion part (checked by kvt__recall_promo_check first), or the empty one (NULL). */
kvt_status kvt__recall_layer_load_promo(kvt__recall_layer *r, const kvt__backend *be,
                                        const void *in);
/* A promotion part's invariants (host copy `in` of kvt__recall_promo_bytes) for a layer of
 * n_closed closed rows, S sinks in them, the kept set kept[0 .. m) (host copy, ascending), a
 * reserve of room rows and a window of `window` steps: KVT_OK or KVT_ERR_INVARIANT. Promoted
 * rows and candidates ascending, archived rows of [S, n_closed), disjoint; at most room
 * promoted; histories within the window; outside the kept set unless a close came after the
 * last step (which absorbs them). */
kvt_status kvt__recall_promo_check(const kvt__recall_layer *r, const void *in, uint64_t n_closed,
                                   uint64_t S, const uint32_t *kept, uint64_t m, uint64_t room,
                                   uint32_t window, char *err, size_t len);
void kvt__recall_layer_fini(kvt__recall_layer *r, const kvt__backend *be);
/* Room for the groups of `blocks` closed blocks of B rows (centres of dim floats), grown at
 * reserve so that no step allocates; what was built is kept. KVT_ERR_OUT_OF_MEMORY with nothing
 * changed. */
kvt_status kvt__recall_layer_groups_reserve(kvt__recall_layer *r, const kvt__backend *be,
                                            uint64_t blocks, uint32_t B, uint32_t dim);
/* dst (prepared with src's shape) takes src's state: a forked request continues its parent's
 * calibration, and src's built groups (dst's planes are grown to src's). On the backend. */
kvt_status kvt__recall_layer_copy(kvt__recall_layer *dst, const kvt__recall_layer *src,
                                  const kvt__backend *be);
/* The lagged query's buffer for queries of q_floats floats (0: off, freed), kept when it has
 * that size, and emptied (the next step scans with its own query). KVT_ERR_OUT_OF_MEMORY. */
kvt_status kvt__recall_layer_lag_prepare(kvt__recall_layer *r, const kvt__backend *be,
                                         uint32_t q_floats);
/* The query a step scans with: the lagged one when there is one, else q (and lag_next = q). */
const float *kvt__recall_layer_lag_query(kvt__recall_layer *r, const float *q);
/* After the step's op, on its stream: this step's queries become the next step's lagged ones. */
kvt_status kvt__recall_layer_lag_advance(kvt__recall_layer *r, const kvt__backend *be,
                                         void *stream);
/* Load a lagged query (a snapshot's: has, and q of lag_floats floats when has). */
kvt_status kvt__recall_layer_lag_load(kvt__recall_layer *r, const kvt__backend *be, bool has,
                                      bool last_lagged, const float *q);
/* Backend bytes the trigger holds (its buffer and group planes, capacity): memory accounting. */
uint64_t kvt__recall_layer_bytes(const kvt__recall_layer *r);
/* The state to the host (synchronising: statistics, checks, snapshots). */
kvt_status kvt__recall_layer_read(const kvt__recall_layer *r, const kvt__backend *be,
                                  kvt__recall_state *out);
/* The sorted samples [0 .. n) to the host (snapshots); n <= sample_cap. */
kvt_status kvt__recall_layer_read_samples(const kvt__recall_layer *r, const kvt__backend *be,
                                          float *out, uint32_t n);
/* The layer's basis was replaced and its archive sketched again (kvt_ctx_refit_recall_basis): the
 * pruned scan's groups are built anew at the next step, and with `recalibrate` the conformal
 * calibration starts again (no sample, z = Z_MAX, calibration open; the counters and the
 * promoted set as they are). A layer without a buffer: nothing to do. */
kvt_status kvt__recall_layer_rebase(kvt__recall_layer *r, const kvt__backend *be,
                                    bool recalibrate);
/* Load a state and its samples (a snapshot's, checked by kvt__recall_state_check first). */
kvt_status kvt__recall_layer_load(kvt__recall_layer *r, const kvt__backend *be,
                                  const kvt__recall_state *st, const float *samples);
/* A state's invariants for a buffer of this shape (and its samples when not NULL: sorted,
 * finite): KVT_OK or KVT_ERR_INVARIANT with the violation in err. */
kvt_status kvt__recall_state_check(const kvt__recall_layer *r, const kvt__recall_state *st,
                                   const float *samples, char *err, size_t len);

/* The step's work item of this request: the archive view the policy filled (its recall_view),
 * its queries q ([n_heads][latent_dim + branch_dim], backend memory), the table's rows n_rows,
 * the public mode and margin, the emission's dense flag (backend memory, or NULL). */
void kvt__recall_step_make(const kvt__recall_layer *r, const kvt__nope_view *view,
                           const float *q, uint64_t n_rows, kvt_recall_mode mode, float margin,
                           uint8_t *dense, kvt__recall_step_args *out);
/* Promotion's part of the work item (r with promotion; nothing otherwise): a reserve of room
 * rows (the salience table's promote_room), hits of window. */
void kvt__recall_step_promote(const kvt__recall_layer *r, uint64_t room, uint32_t hits,
                              uint32_t window, kvt__recall_step_args *out);
/* The emission's view of the step's outcome: fetched rows and the dense flag, in pq. */
void kvt__recall_pack_query(const kvt__recall_layer *r, kvt__pack_query *pq);

/* Floats of backend scratch a recall step of a layer may take at most: n_heads query heads, a
 * basis of rank, latent D, branch_dim, up to max_rows closed rows, group planes of block_rows
 * rows (0: none), promotion capacity prom_cap (0: off). The context sizes its workspace with it
 * at creation, so that no step grows it. */
size_t kvt__recall_step_scratch_max(uint32_t n_heads, uint32_t rank, uint32_t D,
                                    uint32_t branch_dim, uint64_t max_rows, uint32_t block_rows,
                                    uint32_t prom_cap);

/* The bound of a planned layer's recall items (kvt__recall_plan_args.bound): n_heads query heads,
 * sketch rank, latent D, branch_dim, at most max_rows closed (and kept) rows, a promoted set of
 * prom_cap rows (0: off), group planes over blocks of at most block_rows rows (0: none) with
 * centres of branch_dim + rank floats, as kvt__recall_layer_prepare and the group planes shape a
 * request's buffers. */
void kvt__recall_plan_bound(uint32_t n_heads, uint32_t rank, uint32_t D, uint32_t branch_dim,
                            uint64_t max_rows, uint32_t prom_cap, uint32_t block_rows,
                            kvt__recall_step_args *out);
/* A work item a planned op can run: the recall step's argument rules, within the bound. */
bool kvt__recall_plan_ok(const kvt__recall_step_args *bound, const kvt__recall_step_args *x);

#endif /* KVT_RECALL_RECALL_H */
