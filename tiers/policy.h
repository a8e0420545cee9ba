/*
 * policy.h — one table of functions per tier policy (ggml-backend / SQLite pcache style). Internal.
 *
 * lib/ validates everything from outside, then calls a layer's policy only through the table its
 * group was given at context creation (kvt__policy_ops_for); it never switches on a policy. Four
 * tables, one file each:
 *
 *   none.c      every stored row is attended (full attention under policy none);
 *   sliding.c   a policy-none group holding sliding-window layers: each layer attends its own
 *               window, older rows of the shared table stay stored (archived) until no layer's
 *               window reads their page, which then goes back to the pool (leading pages);
 *   salience.c  MLA-NoPE salience tiering: sinks, top-m closed rows by σ, tail; the rest archived
 *               in place;
 *   evict.c     random eviction rounds with compaction; rows dropped or copied to an archive.
 *
 * An entry marked (optional) may be NULL; its comment says what lib/ does without it. Entries
 * that can fail write their detail message into the err buffer they are given (the calling thread's
 * last error) and return the status; lib/ adds the layer or request where its messages did.
 */
#ifndef KVT_TIERS_POLICY_H
#define KVT_TIERS_POLICY_H

#include "tiers.h"

#include <string.h>

typedef struct kvt__policy_ops kvt__policy_ops;
/* The policies' own state, per (sequence, layer) and per group: defined in tiers/ only. */
typedef union kvt__tier_state kvt__tier_state;
typedef union kvt__group_state kvt__group_state;
/* Bytes of a group's policy state (kvt__group.state). */
extern const size_t kvt__group_state_bytes;

/* ---- The archive as the recall tier reads it ---------------------------------------------------
 * A policy describes its archive (rows, sketches, positions) in one of these views; recall/
 * builds its kernels' argument structs from them (recall/recall.h kvt__recall_step_make,
 * recall/recall_rope.h kvt__recall_rope_make). Every pointer is in the backend's memory unless
 * said otherwise. */

/* A salience (MLA-NoPE) layer's archive: its closed rows past the sinks outside the kept set,
 * in place in the pool (the policy's recall_view). */
typedef struct kvt__nope_view {
    /* the rows: pool plane 0 through the table's mirror */
    const uint8_t *base;
    const int32_t *pages;
    uint64_t first_page;
    const kvt__div32 *pdiv; /* page_rows (a host value) */
    size_t slot_stride;     /* bytes */
    int dtype;              /* the latent's */
    uint32_t latent_dim;    /* D: value_dim */
    uint32_t branch_offset; /* bytes */
    int branch_dtype;
    uint32_t branch_dim;
    /* the sketch planes of the closed rows: rows n_head on in csk / rho, rows [0, n_head) in a
     * set shared with other requests (csk_head / rho_head; n_head 0: none), and the basis */
    const uint16_t *csk;
    const float *rho;
    const uint16_t *csk_head;
    const float *rho_head;
    uint64_t n_head;
    uint32_t csk_stride;
    uint32_t q8_off;    /* the 8-bit plane's first fp16 word in a sketch row (0: none) */
    const float *basis; /* [rank][latent_dim]; NULL when rank is 0 */
    uint32_t rank;
    /* the positions: closed rows, sinks among them, the kept set (ascending, m rows) */
    uint64_t n_closed;
    uint64_t sinks;
    const uint32_t *kept;
    uint32_t m;
} kvt__nope_view;

/* A GQA/MHA/MLA-RoPE layer's archive of evicted rows, per KV head (the policy's
 * recall_rope_view), and the attended rows' keys. */
typedef struct kvt__rope_view {
    /* the attended rows: the pool's planes through the table's mirror */
    uint8_t *plane[2]; /* plane[0] the keys (MLA-RoPE: the rows); the emission writes them */
    uint32_t n_planes;
    const int32_t *pages;
    uint64_t first_page;
    const kvt__div32 *pdiv; /* page_rows (a host value) */
    size_t slot_stride;     /* bytes of one slot of a plane (n_kv · row_bytes) */
    uint32_t row_bytes;     /* head h's row at + h · row_bytes */
    uint64_t n_rows;        /* rows every head attends (the step's included) */
    int dtype;
    uint32_t D;             /* the sketched part of a key: head_dim (GQA), kv_lora_rank (MLA) */
    uint32_t branch_dim;    /* MLA-RoPE: the rotated branch; GQA: 0 */
    uint32_t branch_offset;
    int branch_dtype;
    uint32_t n_kv;          /* KV heads */
    uint32_t group;         /* query heads per KV head */
    /* the archive: [n_kv][ar_cap][ar_row_bytes], ar_n rows a head; capped: in host memory */
    const uint8_t *ar_bytes;
    size_t ar_row_bytes;
    uint64_t ar_cap, ar_n;
    const int32_t *ar_ident; /* identity page mirror of at least ar_n rows */
    bool capped;
    const uint8_t *ar_branch; /* a host archive's rotated branches (NULL: in the rows) */
    uint32_t ar_branch_bytes;
    /* its sketches and the KV heads' key bases */
    const uint16_t *csk; /* [n_kv][ar_cap][csk_stride] */
    const float *rho;    /* [n_kv][ar_cap] */
    uint32_t csk_stride;
    const float *basis; /* [n_kv][basis_stride][D]; NULL when no head has one */
    uint32_t basis_stride;
    const uint32_t *rank; /* [n_kv] host array (NULL: no head has a basis) */
} kvt__rope_view;

/* A policy group: the layers of a context under one policy, which share one page table per
 * sequence and one page allocator. */
typedef struct kvt__group {
    const kvt__policy_ops *ops; /* chosen once, at context creation */
    const kvt__backend *home;   /* the context's backend: group_init allocates shared tables
                                 * in its memory */
    kvt_policy policy;          /* the resolved public policy (names, stats) */
    kvt__pool pool;
    uint32_t n_layers;
    uint32_t *layers; /* model layer indices, ascending */
    /* Group-wide policy state, set by the table's group_init (zero otherwise). window_rows, of
     * the sliding table: rows before n_rows - window_rows are read by no layer of the group and
     * their pages go back to the pool; 0 keeps every row (lib/ checks page tables against it). */
    uint32_t window_rows;
    /* The policy's own group-wide state (salience: σ's basis tables): kvt__group_state_bytes
     * zeroed bytes lib/ allocates with the group, laid out and set by the table's group_init
     * (tiers/tiers_internal.h); lib/ never reads them. */
    kvt__group_state *state;
    /* [2 * n_layers] pointers a group_commit may use as scratch (the layers' stores and states
     * of a round), allocated with the layer list so that no commit allocates. */
    void **ptrs;
} kvt__group;

/* Policy state of one (sequence, layer), laid out by its policy (tiers/tiers_internal.h):
 * opaque to lib/, which holds a request's states as one zeroed array of kvt__tier_state_bytes a
 * layer, zeroes a state before layer_init and hands it to the entries of the layer's table only. */
extern const size_t kvt__tier_state_bytes;
/* The state of layer i in such an array. */
static inline kvt__tier_state *kvt__tier_state_at(kvt__tier_state *states, uint32_t i) {
    return (kvt__tier_state *)(void *)((char *)states + (size_t)i * kvt__tier_state_bytes);
}

/* One layer of one sequence, as the per-layer queries see it. Built by lib/ for each call. */
typedef struct kvt__tier_layer {
    const kvt_config *cfg;
    uint32_t page_rows;
    const kvt__div32 *pdiv;       /* page_rows as a divider (kvt__slot) */
    const kvt__group *gr;         /* the layer's group */
    const kvt__store *st;         /* the layer's storage and spec (st->layer: model index) */
    const kvt__ptable *pt;        /* the sequence's page table of the group */
    const kvt__tier_state *state; /* the layer's policy state */
    uint64_t appended;            /* tokens the sequence committed */
    uint64_t prompt_rows;         /* kvt_seq_set_prompt_rows */
} kvt__tier_layer;

/* One policy group of one sequence, as group_commit sees it. */
typedef struct kvt__tier_group {
    kvt__group *gr;
    kvt__ptable *pt;         /* n_rows already counts the rows this commit appended */
    kvt__store *stores;      /* the context's, [model layers]; gr->layers index it */
    kvt__tier_state *states; /* the sequence's, [model layers] */
    uint64_t appended;       /* tokens the sequence committed, these included */
    uint64_t new_rows;       /* rows this commit appended: the last new_rows row indices of pt,
                              * positions [appended - new_rows, appended); 0 on a retry */
    uint64_t prompt_rows;
} kvt__tier_group;

/* One layer of one sequence during a step in flight (kvt_batch_run): the group's table holds
 * pt->n_rows committed rows plus step_rows rows reserved and written for this step, positions
 * [appended, appended + step_rows). */
typedef struct kvt__tier_step {
    kvt__group *gr;
    kvt__store *st;
    const kvt__ptable *pt;     /* the table is the group's: a step never changes it */
    kvt__tier_state *state;
    uint64_t appended;         /* tokens committed before the step */
    uint64_t step_rows;
    uint64_t prompt_rows;
    const kvt_config *cfg;     /* the request's */
    uint64_t philox_key;       /* the request's */
    kvt_status status;         /* out: how this request's work went */
} kvt__tier_step;

struct kvt__policy_ops {
    /* Row index i of the group's table holds position i in every layer (no compaction), so the
     * table holds exactly the appended rows (some of them may have left with their pages). False
     * for a policy that compacts rows (kvt_seq_check then only requires n_rows <= appended). */
    bool rows_are_positions;
    /* (optional) How a row of this policy stops being stored, ending the message "... position
     * P was dropped %s" of kvt_seq_read_row. NULL: the policy never drops a row. */
    const char *dropped_how;

    /* ---- Context creation ------------------------------------------------------------------ */
    /* (optional) Can this policy serve layer `layer` with this spec and config? KVT_OK, or
     * KVT_ERR_POLICY_MISMATCH (a layer kind the policy does not apply to) or KVT_ERR_UNSUPPORTED
     * (a combination not implemented) with a message naming the layer or config field in err.
     * Without it every layer with KV is served. */
    kvt_status (*supports_layer)(const kvt_layer_spec *sp, uint32_t layer, const kvt_config *cfg,
                                 char *err, size_t len);
    /* (optional) Can this policy's side planes of layer `layer` hold recall sketches of `rank`
     * coefficients (params.recall_sketch_rank > 0)? KVT_OK, or a status with a message naming
     * the layer and params.recall_sketch_rank in err. Without it the policy builds no sketches
     * of its own and any rank is accepted. */
    kvt_status (*supports_sketch)(const kvt_layer_spec *sp, uint32_t layer, uint32_t rank,
                                  char *err, size_t len);
    /* (optional) Does layer sp, under this policy, read only a window of its group's newest
     * rows (a sliding-window layer under policy none)? true with the window's rows in *rows
     * (0 in a spec kvt_model_create would refuse). A group whose layers all do, each with
     * rows > 0, keeps only the widest window's pages (the sliding table's group_init); lib/
     * checks a snapshot's page tables against the same rule before any context exists.
     * Without it: false (the layer reads every row, and its group returns no leading page). */
    bool (*layer_window)(const kvt_layer_spec *sp, uint32_t *rows);
    /* (optional) A census's model of one layer (kvt_model_census): of the `stored` rows a
     * request holds, how many it attends and how many leave the pool at a budget of `budget`
     * rows. Without it: every stored row stays and is attended (*attended = stored,
     * *freed = 0). */
    void (*census)(uint64_t stored, uint64_t budget, uint64_t *attended, uint64_t *freed);

    /* ---- Sizing ---------------------------------------------------------------------------- */
    /* (optional) Floats of backend scratch one commit's work on layer sp takes (a salience close:
     * σ's scratch and the block's slots, the sketches' when rank > 0), for a context that sizes
     * its workspaces once (max_rows_per_seq). Without it: none. */
    size_t (*close_scratch_floats)(const kvt_layer_spec *sp, const kvt_config *cfg,
                                   uint32_t rank);
    /* (optional) Bytes a request's layer sp allocates whole at kvt_seq_create for an archive of
     * a stated archive_rows rows a KV head (params.archive_rows_per_seq; 0: none stated), with
     * the config's archive on (`archive`: config.evict_archive): kvt_ctx_estimate's
     * archive_bytes. Without it: none (the policy allocates no archive up front). */
    uint64_t (*archive_bytes_at_create)(const kvt_layer_spec *sp, uint64_t archive_rows,
                                        bool archive);
    /* (optional) The largest work a decode step of one request gives the backend's workspace
     * ops for the group's layer st (random eviction: a round of K + r + c rows and up to 64
     * tokens, the group's layers in one call, into x->round and x->round_layers), for
     * kvt__backend_ops.reserve. Without it: nothing of the policy's. */
    void (*step_bounds)(const kvt__group *gr, const kvt__store *st, const kvt_config *cfg,
                        kvt__ws_bounds *x);
    /* (optional) The values of an archived key the layer's archive sketches take (GQA/MHA: the
     * whole post-RoPE key; MLA-RoPE: the latent), and the sketch planes' stride at a context's
     * rank: min(rank, key dim), or 0 when the layer's rows get no archive sketches (the RoPE
     * trigger's archive, docs/recall.md §9). Both or neither. Without them the layer has no
     * archive sketches (key bases are refused, the RoPE trigger is never sized for it). */
    uint32_t (*archive_key_dim)(const kvt_layer_spec *sp);
    uint32_t (*archive_sketch_stride)(const kvt_layer_spec *sp, uint32_t rank);
    /* (optional) The rows of the attended budget a close reserves for recall's promoted set
     * when the layer holds closed_rows closed rows (docs/recall.md §4.2). Without it: 0. */
    uint64_t (*promote_room)(uint64_t closed_rows, const kvt_config *cfg);
    /* (optional) Set up the group's shared state (window, basis tables) once its layers are
     * known; stores[gr->layers[k]] are its layers. KVT_OK or a status with a message in err.
     * Without it the group has none. Called once; group_fini runs even after a failure. */
    kvt_status (*group_init)(kvt__group *gr, const kvt__store *stores, const kvt__alloc *a,
                             const kvt_config *cfg, char *err, size_t len);
    /* (optional) Free what group_init allocated; safe on a zeroed or half-built group. */
    void (*group_fini)(kvt__group *gr, const kvt__alloc *a);

    /* ---- Per (sequence, layer) state ------------------------------------------------------- */
    /* (optional) Initialise a zeroed state at sequence creation. KVT_OK or a status with a message
     * in env->err. Without it the zeroed state is the initial one. */
    kvt_status (*layer_init)(kvt__tier_state *s, const kvt__env *env, const kvt__store *st);
    /* (optional) Free the state; must accept a zeroed state (creation may stop half way). */
    void (*layer_fini)(kvt__tier_state *s, const kvt__alloc *a);
    /* (optional) Bring a state back to what layer_init made, keeping its allocations (a request
     * slot reused for a new request, env->cfg being the new request's). KVT_OK, or a status with
     * a message in env->err. Without it the zeroed state is the initial one. */
    kvt_status (*layer_reset)(kvt__tier_state *s, const kvt__env *env, const kvt__store *st);
    /* (optional) Reserve: the group's table will hold `rows` rows once the reserved tokens commit.
     * Grow whatever group_commit must append to, so that commit cannot fail for memory, and refuse
     * what a stated limit cannot hold. KVT_OK, or KVT_ERR_OUT_OF_MEMORY / KVT_ERR_ARCHIVE_FULL with
     * nothing observable changed and a message in env->err. Without it nothing grows. */
    kvt_status (*reserve)(kvt__tier_state *s, const kvt__env *env, const kvt__store *st,
                          uint64_t rows);

    /* (optional) The first row index of the group's table the work of a step that grows the
     * table from n_rows to rows_after may write (new rows are always written; a policy that
     * moves older rows — a due eviction round compacts everything past the protected prefix —
     * says from where). lib/ copies shared pages from there on before the step (copy on write,
     * kvt_seq_fork). Without it: n_rows. */
    uint64_t (*writes_from)(const kvt__tier_state *s, const kvt_config *cfg, uint64_t n_rows,
                            uint64_t rows_after, uint64_t prompt_rows);
    /* (optional) A forked request's state: dst (fresh from layer_init) becomes a copy of src,
     * whose group table holds `rows` rows (kvt_seq_fork; the rows' pages are shared, the state
     * is copied on the backend or, for planes fixed once written, shared with src: src's
     * sharing count changes, nothing it decides does). KVT_OK, or a status with a message in
     * env->err (dst stays valid for layer_fini). Without it the state is empty. */
    kvt_status (*layer_fork)(kvt__tier_state *dst, kvt__tier_state *src,
                             const kvt__env *env, const kvt__store *st, uint64_t rows);

    /* (optional) An attached request's state: dst (fresh from layer_init) becomes the state a
     * request holding only src's first `rows` rows (positions [0, rows), whose pages it shares)
     * would have (env->cfg: src's config). KVT_ERR_UNSUPPORTED with a message when src's rows
     * [0, rows) no longer are those positions (a round moved them: src_prompt_rows says what
     * its rounds protected), or a status from the backend. Without it the state is empty. */
    kvt_status (*layer_attach)(kvt__tier_state *dst, kvt__tier_state *src,
                               const kvt__env *env, const kvt__store *st, uint64_t rows,
                               uint64_t src_prompt_rows);
    /* (optional) The longest prefix of src's rows an attached request may take: positions
     * [0, n) still at rows [0, n) of the group's table (a round moves every row past the prefix
     * it protects, and compaction may leave fewer pages than a longer prefix covers).
     * kvt_seq_attach asks it before it shares a page, and layer_attach refuses past it.
     * Without it: every row. */
    uint64_t (*attach_rows)(const kvt__tier_state *src, const kvt_config *cfg,
                            uint64_t src_prompt_rows);
    /* (optional) A request slot is parked (kvt_seq_destroy keeps its allocations): give up what
     * the state shares with other requests (layer_fork, layer_attach), so that it holds no
     * other request's memory. Without it the policy shares nothing. */
    void (*layer_unshare)(kvt__tier_state *s, const kvt__alloc *a);
    /* (optional) Backend bytes of the state's side planes (capacity, beyond the pool's pages):
     * *own those only this request holds; *shared those of a set it shares with other requests,
     * *key naming that set (the same for every holder; NULL when *shared is 0) and *holders the
     * holders it records (kvt_seq_check counts them), so that a total over requests counts it
     * once. Without it: none. */
    void (*side_bytes)(const kvt__tier_state *s, uint64_t *own, uint64_t *shared,
                       const void **key, uint32_t *holders);

    /* ---- Commit ---------------------------------------------------------------------------- */
    /* (optional) Run the policy over one group of one sequence after rows were committed (block
     * close and re-selection, eviction rounds, leading pages returned). Incremental from the
     * states: after a failure (status and message in env->err) the next commit, with new_rows 0,
     * completes the work. Without it committing changes nothing but the table's n_rows. */
    kvt_status (*group_commit)(const kvt__env *env, const kvt__tier_group *g);

    /* ---- A step in flight ------------------------------------------------------------------ */
    /* (optional) This layer's due work of a step for the n requests t[0..n) of a batch that
     * have it, run inside the layer's forward after the engine wrote the step's rows and before
     * attention (kvt_batch_run), at most once per step and request: the decisions are those a
     * commit of the same rows would make (salience: the blocks complete at n_rows + step_rows
     * close; evict: this layer's part of a due round). The requests' work goes to the backend
     * in batched calls (one per layer for a decode step's closes or rounds). The tables are not
     * changed; group_commit completes what is left (layers that did not step, the table's count
     * and pages). t[i].status says how each request's went; on failure (message in env->err)
     * nothing of that request's layer changed and group_commit retries, or it is damaged
     * (KVT_ERR_CORRUPT). env carries the batch's backend and stream; cfg and philox_key are
     * each request's (t[i]). Without it the layer's work all happens at commit. */
    kvt_status (*layer_step)(const kvt__env *env, kvt__tier_step *t, uint32_t n);
    /* (optional) Whether the step's attention needs this layer's run to do t's work first (a
     * block close, an eviction round): when false, the run may leave all of it to the commit
     * (the decisions are the same), which a planned step (kvt_batch_plan_device: runs that only
     * pack, capturable into a CUDA graph) does. From counts only. Without it (and with
     * layer_step): always true. */
    bool (*step_due)(const kvt__tier_step *t);
    /* (optional) Rows the layer holds per head when the table holds `rows` (a layer that
     * compacted in a step holds fewer until commit). Without it: rows. */
    uint64_t (*held_rows)(const kvt__tier_state *s, uint64_t rows);

    /* ---- Attended set ---------------------------------------------------------------------- */
    /* The rows the layer attends (per KV head), described in O(1) as row-index ranges and one
     * list of the group's table (kernels/backend.h): the backend's pack expands them into
     * slots (the list may be in the backend's memory: the host never reads it). */
    void (*attended)(const kvt__tier_layer *l, kvt__attended_desc *d);

    /* (optional) The layer's archive as the NoPE recall trigger reads it, for the view l
     * (l->pt->n_rows rows, the step's included): rows, sketch planes, basis, closed rows, sinks,
     * kept set (kvt__nope_view); the query side is the recall tier's. false when the layer has
     * nothing to recall from (no sketch planes). Without it the layer never recalls. */
    bool (*recall_view)(const kvt__tier_layer *l, kvt__nope_view *v);
    /* (optional) Sketch the layer's rows again with a recall basis of its store that was just
     * replaced (kvt_ctx_refit_recall_basis / _head_basis, between steps): salience, the closed
     * rows (`head` ignored: the basis is the layer's), its own and those it reads of a set shared
     * with other requests — those once per `epoch` (a number the caller makes new for each
     * replacement: a set whose rows up to this state's were sketched in this epoch already is not
     * sketched again); evict, KV head `head`'s archived rows. The table's mirror must be current.
     * Through env->backend on env->stream; KVT_OK, or the backend's status with a message in
     * env->err (the planes are then partly of the new basis). Without it the layer keeps no
     * sketches. */
    kvt_status (*resketch)(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                           uint32_t head, uint64_t epoch);
    /* (optional) The archive of a GQA/MHA-RoPE layer as the RoPE recall trigger reads it, for
     * the view l: the attended rows (the table's mirror, l->pt->n_rows rows), every KV head's
     * archive, its sketches, bases and ranks (kvt__rope_view); the query side is the recall
     * tier's. KVT_OK; KVT_ERR_UNSUPPORTED when the layer has nothing to recall from (no archive, no
     * sketches: the message says which) or KVT_ERR_BAD_STATE when rows archived are not sketched
     * yet (a failed sketch, retried at commit), each with a message in err. Without it the layer
     * never recalls this way. */
    kvt_status (*recall_rope_view)(const kvt__tier_layer *l, kvt__rope_view *v, char *err,
                                   size_t len);

    /* ---- Rows by position ------------------------------------------------------------------ */
    /* State of (head, pos), pos < l->appended (lib/ answers for pending rows). *slot: the row's
     * slot while its bytes are in the pool (attended, or archived in place), else -1. */
    kvt_row_state (*row_state)(const kvt__tier_layer *l, uint32_t head, uint64_t pos,
                               int32_t *slot);
    /* (optional) Copy the bytes of an archived row that left the pool (plane `plane`, head
     * `head`, row_bytes) into dst: KVT_OK, or KVT_ERR_INVARIANT when it is not there.
     * Synchronising (inspection). Without it every archived row stays in the pool at the slot
     * row_state gives. */
    kvt_status (*read_archived)(const kvt__tier_layer *l, uint32_t head, uint32_t plane,
                                uint64_t pos, void *dst);
    /* Original position at each row index of the table for one head, into out[l->pt->n_rows]
     * (-1: the row left with its page). Synchronising when the positions are in backend
     * memory; a backend read's status. */
    kvt_status (*positions)(const kvt__tier_layer *l, uint32_t head, int64_t *out);
    /* (optional) Slot map of the last compaction of the group for one head: its length into *n
     * and, when out is not NULL, old row index -> new row index or -1 into out[*n]
     * (synchronising). Without it kvt_seq_last_slot_map answers KVT_ERR_POLICY_MISMATCH: rows
     * never move. */
    kvt_status (*last_slot_map)(const kvt__tier_layer *l, uint32_t head, int32_t *out,
                                uint64_t *n);

    /* ---- Sequence-wide conditions ---------------------------------------------------------- */
    /* (optional) Has a decision already used the prompt length? kvt_seq_set_prompt_rows refuses
     * to change it then. Without it, never. */
    bool (*prompt_used)(const kvt__tier_state *s);
    /* (optional) Did a device error leave the state half changed? The sequence then refuses every
     * call but kvt_seq_destroy. Without it, never. */
    bool (*damaged)(const kvt__tier_state *s);

    /* ---- Statistics and invariants --------------------------------------------------------- */
    /* (optional) Fill the policy's fields of out; lib/ has set struct_size, policy,
     * appended_rows, attended_rows (= attended_count), pages_in_use, bytes_in_use, prompt_rows
     * and zeroed the rest. Without it the rest stays zero. */
    void (*stats)(const kvt__tier_layer *l, kvt_layer_stats *out);
    /* O(heads) accounting after every commit: every appended (position, head) row is attended,
     * archived or dropped, counted by independent counters. KVT_ERR_INVARIANT with the violation
     * in err (lib/ prefixes the layer). */
    kvt_status (*check_counts)(const kvt__tier_layer *l, char *err, size_t len);
    /* (optional) Full check of the state (kvt_seq_check, O(rows)); as check_counts. Without it
     * the state has nothing to check beyond the counts and the page tables. */
    kvt_status (*check)(const kvt__tier_layer *l, char *err, size_t len);

    /* ---- Snapshots (lib/snapshot.c) -------------------------------------------------------- */
    /* (optional, all three or none) The layer's state in a request snapshot: snap_size bytes,
     * written by snap_save into dst in the byte order of kvt__snap_cur (little-endian), its
     * backend planes read through the backend's ops. Without them the layer has no state beyond
     * its group's page table (none, sliding). snap_save: KVT_OK, or a backend or host-memory
     * status with a message in err. */
    uint64_t (*snap_size)(const kvt__tier_layer *l);
    kvt_status (*snap_save)(const kvt__tier_layer *l, uint8_t *dst, char *err, size_t len);
    /* Load src[0..n), written by snap_save, into *s: a state fresh from layer_init of a request
     * nobody sees yet, whose group table l->pt already holds the restored count (l->state is s).
     * Every size is checked against n before anything is allocated, every count and range
     * against the configuration and l, and the loaded state must pass `check`. KVT_OK, or
     * KVT_ERR_PARSE (sizes), KVT_ERR_CORRUPT (a value out of range or an invariant broken),
     * KVT_ERR_CAPACITY (a stated limit too small), KVT_ERR_OUT_OF_MEMORY, with a message in
     * env->err; on failure *s may hold allocations that layer_fini frees. */
    kvt_status (*snap_load)(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                            const uint8_t *src, uint64_t n);
    /* (optional) The sketch stride (params.recall_sketch_rank) a context needs to restore the
     * state src[0..n) that snap_save wrote (kvt_snapshot_context reads it before any context
     * exists): its value, unchecked, or 0 when src is too short to hold one. Without it the
     * state asks for none. */
    uint64_t (*snap_sketch_stride)(const uint8_t *src, uint64_t n);
    /* (optional) Copy the layer's per-row scores (σ of the closed rows, by position; out holds
     * as many as stats' closed_rows) to host memory. Without it the layer has no scores. */
    kvt_status (*scores)(const kvt__tier_layer *l, float *out, char *err, size_t len);
};

/* Byte cursor of the snapshot entries: values are stored in the host's order, which the build
 * requires to be little-endian (the container's). take: the next n bytes, or NULL past the end
 * (the cursor then stays put). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvtier snapshots are little-endian: a big-endian host needs byte swaps here"
#endif
typedef struct kvt__snap_cur {
    uint8_t *w;         /* writing */
    const uint8_t *r;   /* reading */
    uint64_t left;      /* bytes left to read */
} kvt__snap_cur;
static inline void kvt__snap_put(kvt__snap_cur *c, const void *src, uint64_t n) {
    if (n)
        memcpy(c->w, src, (size_t)n);
    c->w += n;
}
static inline const uint8_t *kvt__snap_take(kvt__snap_cur *c, uint64_t n) {
    if (n > c->left)
        return NULL;
    const uint8_t *p = c->r;
    c->r += n;
    c->left -= n;
    return p;
}
/* Read a fixed-size value into *dst; false past the end. */
static inline bool kvt__snap_get(kvt__snap_cur *c, void *dst, uint64_t n) {
    const uint8_t *p = kvt__snap_take(c, n);
    if (p && n)
        memcpy(dst, p, (size_t)n);
    return p != NULL;
}
/* Take count elements of elt bytes (count checked against what is left before multiplying). */
static inline const uint8_t *kvt__snap_take_n(kvt__snap_cur *c, uint64_t count, uint64_t elt) {
    if (elt && count > c->left / elt)
        return NULL;
    return kvt__snap_take(c, count * elt);
}

extern const kvt__policy_ops kvt__policy_none;
extern const kvt__policy_ops kvt__policy_sliding;
extern const kvt__policy_ops kvt__policy_salience;
extern const kvt__policy_ops kvt__policy_evict;

/* The table that checks layers for a public policy (kvt__policy_none for KVT_POLICY_NONE: the
 * sliding table adds no requirement); NULL for an unknown value. */
const kvt__policy_ops *kvt__policy_table(kvt_policy policy);

/* The table of a group under gr->policy whose layers are stores[gr->layers[k]]: policy none
 * takes the sliding table when a layer of the group is a sliding-window layer (its window must
 * be honoured; whether pages can go back is the table's group_init), else the none table. NULL
 * for a policy no table implements. */
const kvt__policy_ops *kvt__policy_ops_for(const kvt__group *gr, const kvt__store *stores);

/* The none and sliding tables' layer_window: a sliding-window layer reads its window. */
bool kvt__sliding_layer_window(const kvt_layer_spec *sp, uint32_t *rows);

/* Entries shared by tables whose layers attend every row they hold (none, evict) and whose row
 * indices are positions (none, salience). */
void kvt__none_attended(const kvt__tier_layer *l, kvt__attended_desc *d);
/* How many rows the layer attends (from the policy's description; the rows themselves may be
 * in backend memory: only a backend op expands them). */
uint64_t kvt__attended_count(const kvt__tier_layer *l);
kvt_status kvt__none_positions(const kvt__tier_layer *l, uint32_t head, int64_t *out);
kvt_status kvt__none_check_counts(const kvt__tier_layer *l, char *err, size_t len);

#endif
