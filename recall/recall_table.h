/*
 * recall_table.h — one table of functions per kind of recall layer, which lib/ calls as it calls
 * a policy's table (tiers/policy.h) instead of asking which kind a layer's recall is:
 *
 *   kvt__recall_nope  a salience (MLA-NoPE) layer's trigger (recall.h, kvt__recall_layer): the
 *                     fetched rows are the archive's own slots, merged by the pack;
 *   kvt__recall_rope  a random-eviction (GQA/MHA/MLA-RoPE) layer's (recall_rope.h,
 *                     kvt__recall_rope_layer): fetch lists per KV head, the rows copied into the
 *                     request's fetch area by the RoPE emission.
 *
 * A request holds each layer's state in the array of its kind (kvt_seq.recall, kvt_seq.rrope);
 * the entries take it as `r`, a pointer into that array (kvt__seq_recall_of gives both).
 */
#ifndef KVT_RECALL_RECALL_TABLE_H
#define KVT_RECALL_RECALL_TABLE_H

#include "recall/recall.h"
#include "recall/recall_rope.h"

/* What sizes a layer's pruned-scan group planes, as lib/ knows it: the request's rows, the
 * config's block_rows, the layer's spec (branch_dim, n_planes), the context's sketch rank, the
 * policy's archive sketch stride (0: none) and the archive's row limit (0: none). */
typedef struct kvt__recall_shape {
    uint64_t rows;
    uint32_t block_rows;
    uint32_t branch_dim, n_planes;
    uint32_t sketch_rank, archive_stride;
    uint64_t archive_rows;
} kvt__recall_shape;

typedef struct kvt__recall_ops {
    /* How messages name the trigger ("recall", "RoPE recall") and a layer of this kind
     * ("layer", "RoPE layer"). */
    const char *name;
    const char *layer_noun;
    /* The emission copies the fetched rows into the request's fetch area (pool pages of the
     * layer's group, reserved with the request's rows and mirrored for the step). */
    bool fetch_area;
    /* r holds buffers: the layer recalls (with the request's config on). */
    bool (*live)(const void *r);
    /* The trigger state every kind keeps (calibration, certificate, statistics, snapshots). */
    kvt__recall_layer *(*base)(void *r);
    /* Backend bytes r holds (memory accounting). */
    uint64_t (*bytes)(const void *r);
    /* dst (prepared with src's shape) takes src's state: a forked request continues its
     * parent's calibration. */
    kvt_status (*copy)(void *dst, const void *src, const kvt__backend *be);
    void (*fini)(void *r, const kvt__backend *be);
    /* Room for the pruned scan's group planes of a request of sh->rows rows, grown at reserve
     * so that no step allocates (what was built is kept). KVT_ERR_OUT_OF_MEMORY with nothing
     * changed. */
    kvt_status (*groups_reserve)(void *r, const kvt__backend *be, const kvt__recall_shape *sh);
} kvt__recall_ops;

extern const kvt__recall_ops kvt__recall_nope;
extern const kvt__recall_ops kvt__recall_rope;

#endif /* KVT_RECALL_RECALL_TABLE_H */
