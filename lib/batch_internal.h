/*
 * batch_internal.h — what lib/batch.c (the batch's calls: reserve, plan, run, commit, the
 * emissions' checks) and lib/batch_plan.c (the plan image: one function writes a layer's part,
 * one executes it) share: the batch's state and the image's layout. batch.c calls batch_plan.c,
 * never the other way (tests/scripts/check_layers.py checks lib/'s calls for cycles).
 */
#ifndef KVT_LIB_BATCH_INTERNAL_H
#define KVT_LIB_BATCH_INTERNAL_H

#include "handles.h"

#include <stddef.h>

enum batch_state { BATCH_IDLE = 0, BATCH_RESERVED, BATCH_PLANNED };

/* A plan image: what every run of a layer does, in the backend's memory (dev) with its host image
 * (host). Layer l's part, from byte at[l] on: three counts (uint32: the pack queries at byte 0,
 * the trigger items at 4, the emission items at 8), from byte PLAN_HEAD on qcap[l] pack queries,
 * then on a layer of a recall kind max_seqs of the kind's trigger items and max_seqs of its
 * emission items (the recall table's item_bytes, emit_bytes; 64-byte aligned pieces). */
typedef struct kvt__plan_buf {
    uint8_t *dev, *host;
    size_t *at;     /* [n_layers + 1]: at[n_layers] is the image's size; NULL: not laid out */
    uint8_t *kind;  /* [n_layers]: the layer's recall kind (kvt__recall_kinds; 0: none) */
    uint32_t *qcap; /* [n_layers] */
    uint32_t *qpr;  /* [n_layers]: pack queries a request (the planned image's; the eager image
                     * holds max_seqs x qpr queries of any shape) */
} kvt__plan_buf;

struct kvt_batch {
    kvt_ctx *ctx;
    kvt_batch *prev, *next; /* the context's live batches */
    uint32_t max_seqs, n_seqs;
    kvt_seq **seqs;      /* [max_seqs]; an entry is NULL once its request was destroyed */
    uint32_t *n_tokens;  /* [max_seqs]; 0 once the request was destroyed */
    uint32_t *n_slots;   /* [max_seqs]: the tokens reserved, kept when the request is destroyed
                          * mid-step, so that the step's slot_mapping keeps every later token's
                          * index (its own entries -1) */
    uint32_t *n_drafts;  /* [max_seqs]: the last n_drafts tokens may be rejected at commit */
    /* A run's scratch (allocated with the batch: a run allocates nothing): each request's
     * defer flag and the policy work handed to the layer's table in one call. */
    uint8_t *defer;          /* [max_seqs] */
    kvt__tier_step *steps;   /* [max_seqs] */
    kvt_seq **step_seqs;     /* [max_seqs] */
    /* Recall: each request's way on the layer being run (RECALL_*), and which requests an eager
     * run's image gave a trigger item (their recall ran once the run succeeds). */
    uint8_t *recall_way;     /* [max_seqs] */
    uint8_t *itemized;       /* [max_seqs] */
    enum batch_state state;
    bool ran;            /* a run happened this step (the reservation can no longer be undone) */
    void *stream;        /* the stream of the step's last run: the commit's device work goes on
                          * it (NULL, the default stream, for a step without a run) */
    /* The backend the batch's runs and commit use: on the CPU and CUDA backends a handle with a
     * workspace of its own (own_be), so that runs and commits of distinct batches share no
     * scratch (kvtier.h, "Threads"); on the guarded backend a copy of the context's handle. */
    kvt__backend be;
    bool own_be;
    /* The step's description (kvt__batch_plan_layer writes it, kvt__batch_exec_layer runs it): the
     * planned step's image (kvt_batch_plan_device; laid out at the first planned step, never moved:
     * a captured run's launch points into it) and the eager runs' (laid out at the first run, grown
     * when a run needs more room). plan_emit[layer]: the emission a planned step's runs must pass.
     */
    kvt__plan_buf plan, eager;
    kvt_emit *plan_emit; /* [n_layers] */
    uint8_t *recall_ran; /* [n_layers]: a planned run of the layer enqueued its recall step */
    /* [n_layers]: each layer as the recall tables size it and the kind requests recall with
     * there (kvt__ctx_recall_of, 0: none), fixed with the context. */
    kvt__recall_site *sites;
    uint8_t *kinds;
    bool plan_reserved;  /* the planned recall ops' room was made (the tables' reserve) */
    bool planned;
    bool planned_once; /* a step was planned: plan_emit holds its emissions, every later one's */
};

/* Bytes before a layer's queries in the plan buffer (its counts, then alignment). */
#define PLAN_HEAD 64u

/* An emission's options (KVT_EMIT_*): 0 for a struct from before the field. */
static inline uint64_t kvt__emit_flags(const kvt_emit *e) {
    return e->struct_size >= offsetof(kvt_emit, flags) + sizeof e->flags ? e->flags : 0;
}

/* An emission's last_page_len (KVT_EMIT_PAGED): NULL for a struct from before the field. */
static inline int32_t *kvt__emit_last_page_len(const kvt_emit *e) {
    return e->struct_size >= offsetof(kvt_emit, last_page_len) + sizeof e->last_page_len
               ? e->last_page_len
               : NULL;
}

/* How a request's set is made on a layer: without recall; with the trigger's fetched rows (one
 * query token); every row (a request with recall whose step has several query tokens). */
enum { RECALL_NONE = 0, RECALL_FETCH = 1, RECALL_ALL = 2 };

/* One run's shape (kvt__batch_plan_layer's arguments beside the emission) and what it planned. */
typedef struct kvt__layer_run {
    uint32_t S;            /* query tokens a request (a planned step: 1) */
    uint32_t qpr;          /* lists a query token: KVT_EMIT_CSR_KV_HEADS's KV heads, else 1 */
    bool planned;          /* the planned image: every fetching request has its items (the op
                            * runs once per step), the bounds are the context's; an item outside
                            * them makes the step not plannable */
    bool first;            /* planned: the step's first image (a lagged query is fixed then) */
    uint64_t query_floats; /* floats of the run's query buffer the items may read */
    uint32_t n_q;          /* out: pack queries */
    uint32_t n_recall;     /* out: trigger items */
    uint32_t n_emit;       /* out: emission items */
    kvt__recall_bound bound; /* the items' bound (the layer's recall kind's) */
} kvt__layer_run;

/* --- lib/batch_plan.c --- */
/* The recall kind a planned step's runs of the layer hold (0: none); the batch's for its life
 * once its planned image is laid out. */
uint8_t kvt__batch_plan_kind(const kvt_batch *b, uint32_t layer);
/* Free image p (its backend and host copies); lay out and allocate an image of the given kinds
 * and pack queries a request (*p replaced only on success: KVT_ERR_OUT_OF_MEMORY). */
void kvt__batch_plan_free(kvt_batch *b, kvt__plan_buf *p);
kvt_status kvt__batch_plan_layout(kvt_batch *b, kvt__plan_buf *p, const uint8_t *kind,
                                  const uint32_t *qpr);
/* The eager image with room for layer l's run (l = UINT32_MAX: the first layout). */
kvt_status kvt__batch_eager_room(kvt_batch *b, uint32_t l, uint32_t n_q, uint8_t kind);
/* A batch's own device workspace sized once for its decode steps (max_rows_per_seq). */
kvt_status kvt__batch_reserve_workspace(kvt_batch *b);
/* Request i's way on the layer (RECALL_*) and its recall table (*ro). */
uint8_t kvt__batch_recall_way(const kvt_batch *b, uint32_t i, uint32_t layer, uint32_t S,
                              const kvt__recall_ops **ro);
/* pq's set as whole pages of the context's page_rows (KVT_EMIT_PAGED), or false. */
bool kvt__batch_paged_query(const kvt_ctx *ctx, uint32_t layer, kvt__pack_query *pq);
/* The run's bound of layer l's items of recall kind `kind` in lr->bound; room for the kind's
 * ops within it. */
void kvt__batch_plan_bounds(const kvt_batch *b, uint32_t l, uint8_t kind, kvt__layer_run *lr);
kvt_status kvt__batch_reserve_recall(const kvt_batch *b, uint8_t kind, const kvt__layer_run *lr);
/* A request's lagged query settled after the items of a run or a plan ran (ok) or not. */
void kvt__batch_lag_settle(kvt__recall_layer *r, bool ok);
/* An eager run of layer l after its policy work (lr: its shape, the query's floats): the bound
 * of the step's requests (of the layer's recall kind when `recalls`), the layer's description
 * into the eager image, that part to the backend, its execution; then the requests whose
 * trigger ran are marked (once per step and layer) and their lagged queries settled. */
kvt_status kvt__batch_run_eager(kvt_batch *b, uint32_t layer, const float *query, void *stream,
                                const kvt_emit *emit, bool recalls, kvt__layer_run *lr);
/* One description of a step: layer l's run written into image pb (host copy), that part to the
 * backend, and executed (the recall step when `trigger`, the pack, the emission). */
kvt_status kvt__batch_plan_layer(kvt_batch *b, const kvt__plan_buf *pb, uint32_t l,
                                 const kvt_emit *e, kvt__layer_run *lr, bool *fits);
kvt_status kvt__batch_plan_write_layer(kvt_batch *b, const kvt__plan_buf *pb, uint32_t l,
                                       const kvt__layer_run *lr, void *stream);
kvt_status kvt__batch_exec_layer(kvt_batch *b, const kvt__plan_buf *pb, uint32_t l,
                                 const float *query, void *stream, const kvt_emit *emit,
                                 const kvt__layer_run *lr, bool trigger);
/* Every layer's sets of the planned step into the planned image, then to the backend. */
kvt_status kvt__batch_plan_fill(kvt_batch *b, const kvt_emit *emits, uint32_t n_emits,
                                void *stream, bool sync, bool *fits);

#endif /* KVT_LIB_BATCH_INTERNAL_H */
