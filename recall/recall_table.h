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
 *
 * A batch's plan image (lib/batch_plan.c) holds, per layer, the trigger items and (fetch_area
 * kinds) the emission items of the layer's kind: its run asks the table of that kind
 * (kvt__recall_kinds[kind], the kind a small index) for their sizes, their bound, the room of
 * the ops, the items themselves, the pack queries and the ops, and never which kind it is.
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

/* A layer as the plan entries size it: its spec and policy table, and the context's limits. */
typedef struct kvt__recall_site {
    const kvt_layer_spec *sp;
    const kvt__policy_ops *policy;
    uint32_t sketch_rank; /* the context's (0: no sketch planes) */
    uint32_t block_rows;  /* the context's config.block_rows */
    bool archive_host;    /* the archive lives in host memory (params.archive_host) */
    uint64_t archive_rows, max_rows; /* params.archive_rows, max_rows_per_seq (0: none) */
} kvt__recall_site;

/* The bound of a layer's items, of its kind. */
typedef union kvt__recall_bound {
    kvt__recall_step_args nope;
    kvt__recall_rope_args rope;
} kvt__recall_bound;

/* One run of a layer's ops over the items of a plan image (backend memory: the items, the
 * emission items, their counts), the run's query base and the layer's bound. */
typedef struct kvt__recall_run {
    const void *items, *emits;
    const uint32_t *n, *n_emit;
    uint32_t n_max;
    const float *query;
    uint64_t query_floats; /* floats from query on that the items may read */
    const kvt__recall_bound *bound;
} kvt__recall_run;

/* Request i of a run on a layer, as the item and pack-query entries read it. */
typedef struct kvt__recall_req {
    void *r;                    /* its state on the layer (the kind's) */
    const kvt__tier_layer *l;   /* the layer during the step (the rows its table holds) */
    uint32_t i;                 /* its place in the batch (its queries, its row of TOKENS) */
    const kvt_emit *e;          /* the run's emission */
    uint32_t lists;             /* lists a query token (KVT_EMIT_CSR_KV_HEADS: KV heads) */
    bool planned, first;        /* a planned image (first: the step's first one) */
    bool all;                   /* its set is every row (several query tokens) */
    const kvt__recall_bound *bound;
    const int32_t *fetch_pages; /* fetch_area kinds: the fetch area's mirror, */
    uint32_t fetch_rows;        /* and its rows */
} kvt__recall_req;

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

    /* --- A step's plan and run (lib/batch_plan.c) --- */
    /* The kind's index in kvt__recall_kinds (1, 2; 0 is no recall), which a plan image records
     * per layer. */
    uint8_t kind;
    /* Bytes of one trigger item and of one emission item (0: the kind has none) in a plan image;
     * an image holds max_seqs of each for a layer of the kind. */
    size_t item_bytes, emit_bytes;
    /* Does the layer `s` describes recall with this kind (its policy's view, the context's
     * sketch planes, the kernels' limits)? kvt__ctx_recall_of asks each kind in turn. */
    bool (*recalls)(const kvt__recall_site *s);
    /* Floats of one request's queries on the layer as the trigger reads them (the run's query
     * holds one such block a request). */
    uint64_t (*query_floats)(const kvt_layer_spec *sp);
    /* The bound of the layer's items (a shape every item lies within, which a device's launch
     * and workspace are sized by): planned, from the context's stated limits; otherwise for
     * requests of up to `rows` rows and promotion tables of up to prom_cap. false (out
     * unchanged): the layer does not recall with this kind. */
    bool (*bound)(const kvt__recall_site *s, uint64_t rows, uint32_t prom_cap, bool planned,
                  kvt__recall_bound *out);
    /* The backend's scratch floats the kind's step takes on the layer at the context's limits
     * (lib/context.c sizes the workspace by the largest). */
    size_t (*scratch_floats)(const kvt__recall_site *s, uint32_t prom_cap);
    /* The backend has the kind's ops (a request that recalls with it is refused without). */
    bool (*be_has)(const kvt__backend *be);
    /* Room for the step op over n_max items within bound (a device's workspace, made outside
     * any capture); KVT_OK where the backend needs none. */
    kvt_status (*reserve)(const kvt__backend *be, uint32_t n_max, const kvt__recall_bound *bound);
    /* The request's items of a run into a plan image (host copy): its trigger item when
     * `trigger` (*has: it wrote one; false where the layer has nothing to recall from this
     * step) and, fetch_area kinds, its emission item. KVT_OK; otherwise a status with the
     * message in the thread's error (kvt__tls_error): an item breaking the kernels' rules or
     * rq->bound, the view's refusal. The NoPE item fixes the request's lagged query (recall.h):
     * its run asks for it only after every capacity check passed. */
    kvt_status (*items)(const kvt__recall_req *rq, bool trigger, void *item, void *emit_item,
                        bool *has);
    /* The request's pack queries from q[0] (on entry: its set on the layer, the policy's): the
     * fetched rows merged into it (NoPE, one query; rq's r, i, e and lists only: the run asks
     * before the step's view is made), or (fetch_area kinds) the queries that place each of
     * its lists, from its emission item. Returns the queries written. */
    uint32_t (*pack_query)(const kvt__recall_req *rq, const void *emit_item, kvt__pack_query *q);
    /* The kind's ops over a run's items: the trigger (before the pack) and, fetch_area kinds,
     * the emission (after it; NULL: none). */
    kvt_status (*step)(const kvt__backend *be, const kvt__recall_run *run, void *stream);
    kvt_status (*emit)(const kvt__backend *be, const kvt__recall_run *run, void *stream);
} kvt__recall_ops;

extern const kvt__recall_ops kvt__recall_nope;
extern const kvt__recall_ops kvt__recall_rope;

/* The tables by kind index (kvt__recall_ops.kind); [0] is NULL (no recall). */
#define KVT__RECALL_KINDS 3u
extern const kvt__recall_ops *const kvt__recall_kinds[KVT__RECALL_KINDS];

/* The RoPE trigger's archive view of a layer: the policy's (recall_rope_view), refused where the
 * RoPE step's kernels cannot take it (KV heads above KVT__RECALL_ROPE_MAX_KV, query heads not a
 * multiple of them, a sketched key part of at most 64 values): KVT_ERR_UNSUPPORTED, as the
 * policy's own refusals (a layer without an archive or sketches does not recall). */
kvt_status kvt__recall_rope_view_of(const kvt__tier_layer *l, kvt__rope_view *v, char *err,
                                    size_t len);

#endif /* KVT_RECALL_RECALL_TABLE_H */
