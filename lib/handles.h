/* handles.h — the context and sequence handles (internal). */
#ifndef KVT_LIB_HANDLES_H
#define KVT_LIB_HANDLES_H

#include "base/base.h"
#include "base/alloc.h"
#include "recall/recall.h"
#include "recall/recall_rope.h"
#include "recall/recall_table.h"
#include "tiers/policy.h"

#define KVT__MAX_GROUPS 3

struct kvt_ctx {
    kvt__alloc alloc;
    kvt__backend backend;
    kvt_model *model;
    kvt_config cfg;
    uint32_t page_rows, n_pages;
    kvt__div32 pdiv; /* page_rows as a divider */
    bool external;
    bool started; /* a reservation happened: storage can no longer be rebound */
    uint32_t n_layers;
    kvt__store *stores;    /* [n_layers] */
    kvt_policy *policies;  /* [n_layers], resolved (kvt_ctx_layer_policy, stats) */
    uint32_t n_groups;
    kvt__group groups[KVT__MAX_GROUPS]; /* each with its policy table (tiers/policy.h) */
    kvt_seq *seqs; /* live sequences (doubly linked) */
    kvt_batch *batches; /* live batches (doubly linked): destroyed with the context */
    kvt_buffer *buffers; /* live kvt_buffer allocations (doubly linked): freed with it */
    /* Parallelism (kvt_ctx_params): global ids = local + offset, for the Philox keys. */
    uint32_t kv_head_offset, n_kv_heads_global, layer_offset;
    uint32_t max_rows;     /* max_rows_per_seq (0: none) */
    /* A backend workspace for max_rows (0: none stated, grown on demand): each batch's size. */
    size_t ws_sigma_floats, ws_topm_u32;
    uint32_t archive_rows; /* archive_rows_per_seq (0: none) */
    bool archive_host;     /* archive_space == KVT_SPACE_HOST: the archive's rows in pinned host
                            * memory (the backend's host_alloc) */
    uint32_t max_seqs;     /* max_seqs (0: none) */
    uint32_t sketch_rank;  /* recall_sketch_rank (0: no sketch planes) */
    uint32_t scan_bits;    /* recall_scan_bits: 8 or 16 */
    bool recall_seen;      /* a request with recall on was created here (never reset): with
                            * config.recall, whether a salience layer may recall (planned steps,
                            * batch workspaces) */
    uint32_t n_live;       /* live requests */
    kvt_seq *free_seqs;    /* request slots built at creation, not in use (linked by next) */
    bool destroying;       /* kvt_ctx_destroy: requests are freed, not parked */
    uint64_t refits;       /* kvt_ctx_refit_recall_basis calls that re-sketched (the epochs of
                            * the policies' resketch) */
};

struct kvt_seq {
    kvt_ctx *ctx;
    kvt_seq *prev, *next;
    uint64_t request_id;
    uint64_t philox_key;
    uint64_t n_tokens;    /* committed */
    uint32_t n_pending;   /* reserved, not committed */
    uint64_t prompt_rows;
    kvt__ptable pt[KVT__MAX_GROUPS];
    kvt__tier_state *layers; /* [n_layers]: policy state of each layer with KV */
    kvt_config cfg;          /* the context's, with this request's ratio and recall */
    /* A step in flight (kvt_batch_*): the batch holding the reservation, planned or not, and the
     * layers whose run already did their step work. */
    kvt_batch *batch;
    bool in_step;            /* planned, not yet committed: by-position queries refused */
    uint8_t *stepped;        /* [2 * n_layers]: the first n_layers, then `recalled` */
    uint8_t *recalled;       /* [n_layers], inside stepped's allocation: the layer's recall
                              * step ran this step (a second run of the layer only emits) */
    bool slot;               /* built at context creation: parked on destroy, reused */
    /* The recall trigger's state per layer ([n_layers]; NULL until a request of this handle
     * recalls): a buffer for each layer whose policy has recall_view. */
    kvt__recall_layer *recall;
    /* Recall on GQA/MHA-RoPE layers (docs/recall.md §9): the trigger's state per layer
     * ([n_layers]; NULL until a request of this handle recalls; fbuf NULL on a layer that does
     * not) and, per policy group, the fetch area the emission copies fetched rows into (a table
     * of pool pages, n_rows 0 and n_pending the rows it holds: sized at reserve to hold the
     * archive). */
    kvt__recall_rope_layer *rrope;
    kvt__ptable fetch[KVT__MAX_GROUPS];
    /* The copies on write of the reservation being made (kvt__seq_reserve through the end of
     * kvt_batch_reserve): each page a table made its own, with the shared page it left, so that
     * a refused reservation gives the copies back and shares again (kvt__seq_unreserve_cow):
     * every request and pool as they were. Empty outside a batch reserve. */
    struct kvt__cow {
        uint32_t g, k, old; /* group, table index, the page shared before */
    } *cow;
    uint64_t cow_cap;
    uint32_t n_cow;
};

/* Is the request in a step: rows reserved and not committed, held by a batch, or planned? The
 * calls that want it between steps (snapshots, basis refits) refuse it then. */
static inline bool kvt__seq_in_step(const kvt_seq *seq) {
    return seq->n_pending || seq->batch || seq->in_step;
}

/* The policy state of layer `layer` of a request (opaque: only the layer's table reads it). */
static inline kvt__tier_state *kvt__seq_state(const kvt_seq *seq, uint32_t layer) {
    return kvt__tier_state_at(seq->layers, layer);
}

/* A basis's rows checked as kvt_ctx_set_recall_basis checks them (finite, orthonormal within 1e-3
 * per entry; *omega = ‖V Vᵀ − I‖_F rounded up), errors named with fn; its id (CRC-32 of the
 * bytes); whether the context or a live request recalls in sound mode (lib/recall_basis.c). */
kvt_status kvt__basis_check(const kvt_ctx *ctx, const char *fn, const float *V, uint32_t rank,
                            uint32_t D, float *omega);
uint32_t kvt__basis_id(const float *V, size_t n);
bool kvt__sound_live(const kvt_ctx *ctx);
/* Free a layer's recall basis (lib/recall_basis.c; kvt_ctx_destroy). */
void kvt__rbasis_free(kvt_ctx *ctx, kvt__store *st);
/* Sound recall on `layer` with a basis of ‖V Vᵀ − I‖_F = omega: KVT_OK when the sound margin
 * covers it (omega <= KVT__SOUND_MAX_OMEGA), else KVT_ERR_INVALID_ARGUMENT naming both. */
kvt_status kvt__sound_basis_check(const kvt_ctx *ctx, uint32_t layer, float omega);
/* params.recall_scan_bits against a backend's table (lib/context.c, kvt_ctx_create): KVT_OK for
 * 16 bits, or for 8 where the table has the 8-bit planes (kvt__backend_ops.recall_scan_q8); else
 * KVT_ERR_UNSUPPORTED naming the backend. A capability, never the backend's name. */
kvt_status kvt__backend_scan_bits_check(const kvt__backend_ops *ops, uint32_t bits, char *err,
                                        size_t len);
/* The live request of ctx with this id, or NULL. Ids are unique among a context's live requests
 * (kvt_seq_create, fork, attach and restore refuse one in use): an id keys the request's random
 * draws with the config seed (kernels/philox.h), so two live requests of one id would draw alike
 * (the same eviction choices, correlated where they must be independent). */
const kvt_seq *kvt__ctx_live_request(const kvt_ctx *ctx, uint64_t request_id);
/* Free a request and everything it holds, whether or not it is a slot (kvt_ctx_destroy). The
 * request is in no batch. */
void kvt__seq_free(kvt_seq *seq);
/* kvt_seq_destroy of a request in no batch (kvt_seq_destroy, in batch.c, first takes it out of
 * its batch's step): a slot is parked (its pages back, its allocations kept), any other request
 * freed (kvt__seq_free); during kvt_ctx_destroy every request is freed. */
void kvt__seq_end(kvt_seq *seq);
/* Build ctx->max_seqs request slots, parked (kvt_ctx_create with max_seqs and max_rows). */
kvt_status kvt__seq_slots_build(kvt_ctx *ctx);
/* Free the parked slots. */
void kvt__seq_slots_free(kvt_ctx *ctx);

/* Internal sequence operations the batch (lib/batch.c) drives. */
kvt_status kvt__seq_usable(const kvt_seq *seq);
/* Reserve n tokens in every group: all or nothing (message names the request). */
kvt_status kvt__seq_reserve(kvt_seq *seq, uint32_t n);
/* Give a reservation back (no run happened): pages beyond the committed rows return. */
void kvt__seq_unreserve(kvt_seq *seq);
/* The same within the kvt_batch_reserve that made the reservation (nothing ran since): its
 * copies on write are given back too, newest first, so the pools' free stacks are as before. */
void kvt__seq_unreserve_cow(kvt_seq *seq);
/* A batch reserve succeeded: its copies on write stay (the log is emptied). */
static inline void kvt__seq_reserve_done(kvt_seq *seq) {
    seq->n_cow = 0;
}
/* Commit the first n of the pending rows (the rest are rejected drafts: their pages return), run
 * the policies' commit work through backend be (the batch's: its own workspace), check counts. */
kvt_status kvt__seq_commit(kvt_seq *seq, uint32_t n, const kvt__backend *be, void *stream);
/* What a layer's run did with the step's policy work (kvt_seq.stepped). */
enum { KVT__STEP_NONE = 0, KVT__STEP_NOTHING = 1, KVT__STEP_WORKED = 2, KVT__STEP_DEFERRED = 3 };
/* The step work of one layer for the n requests seqs[0..n) of a batch (NULL entries skipped),
 * through the batch's backend be, once per step and request: defer[i] leaves request i's to the
 * commit (drafts that may be rejected; per-token emission of a multi-token step); the others'
 * due work goes to the layer's policy in one call (batched backend ops). t and who are scratch
 * of n entries. Returns the first failure, named by request (KVT_OK when all is done). */
kvt_status kvt__seqs_step(kvt_ctx *ctx, kvt_seq *const *seqs, const uint8_t *defer, uint32_t n,
                          uint32_t layer, const kvt__backend *be, void *stream,
                          kvt__tier_step *t, kvt_seq **who);
/* The backend handle a batch's runs and commit use (tests capture its ops). */
kvt__backend *kvt__batch_backend(kvt_batch *b);
/* Bring the backend's mirror of the request's page table of the layer's group (and, for a RoPE
 * recall, its fetch area's) up to the host's, on stream. */
kvt_status kvt__seq_mirror_sync(kvt_seq *seq, uint32_t layer, const kvt__backend *be,
                                void *stream);
/* The layer's run has no device work for the request this step but what a planned step can
 * do (kvt_batch_plan_device): no close or round due (kvt__policy_ops.step_due; its commit then
 * does the step's policy work), and no recall unless recall_planned (the layer's planned recall
 * ops, NoPE or RoPE) and the request's trigger is one a plan can hold (one token). */
bool kvt__seq_step_quiet(kvt_seq *seq, uint32_t layer, bool recall_planned);
/* The attended set of the layer during the step for a query token that sees the first `visible`
 * of the step's rows (>= the pending count: all of them), described in O(1) into q (its desc,
 * pages and first_page; the caller sets where it goes). A visible count below the pending count
 * is valid only when no work of the step moved rows (STEP_WORKED not set, or a policy without
 * layer_step). */
void kvt__seq_step_query(const kvt_seq *seq, uint32_t layer, uint32_t visible,
                         kvt__pack_query *q);
/* Does the request recall on this layer (recall on, a policy with an archive view)? */
bool kvt__seq_recalls(const kvt_seq *seq, uint32_t layer);
/* The trigger state of a layer the request recalls on — the salience layer's, or the common part
 * of a RoPE layer's (kvt__recall_rope_layer.base) — or NULL. */
kvt__recall_layer *kvt__seq_recall_base(const kvt_seq *seq, uint32_t layer);
/* The recall table of a layer the request recalls on (kvt__recall_nope, kvt__recall_rope) with
 * its state in *r, or NULL (recall off, or nothing to recall from there). The one place lib/
 * asks which kind a request's recall on a layer is (a context's layer: kvt__ctx_recall_of). */
const kvt__recall_ops *kvt__seq_recall_of(const kvt_seq *seq, uint32_t layer, void **r);
/* Does the request's recall on this layer copy fetched rows into its fetch area (the table's
 * fetch_area)? */
bool kvt__seq_recall_fetches(const kvt_seq *seq, uint32_t layer);
/* Does the request recall on this RoPE layer (its trigger state prepared)? */
bool kvt__seq_recalls_rope(const kvt_seq *seq, uint32_t layer);
/* Layer `layer` of the request during the step as its policy's entries see it: the rows its
 * table holds, the step's included (the policy's held_rows), in *view. */
kvt__tier_layer kvt__seq_step_layer(const kvt_seq *seq, uint32_t layer, kvt__ptable *view);
/* The RoPE recall trigger's archive view (tiers/policy.h kvt__rope_view) of a request's layer
 * between steps, its page table mirrored: the evict policy's recall_rope_view.
 * KVT_ERR_POLICY_MISMATCH (a layer without one), the view's statuses (UNSUPPORTED, BAD_STATE),
 * KVT_ERR_BAD_STATE (a step in flight), a mirror sync's status. For inspection between steps
 * (the tests' oracles read the archive through it); a step's items take the view of its own
 * table (kvt__recall_rope.items). Refused as the step refuses (kvt__recall_rope_view_of). */
kvt_status kvt__seq_rope_recall_view(kvt_seq *seq, uint32_t layer, kvt__rope_view *out);
/* Free every live kvt_buffer of the context (kvt_ctx_destroy). */
void kvt__buffers_free(kvt_ctx *ctx);
/* Destroy every live batch of the context (kvt_ctx_destroy). */
void kvt__batches_destroy(kvt_ctx *ctx);

/* The recall table of the kind requests recall with on `layer` (the first of kvt__recall_kinds
 * whose `recalls` holds: a salience layer's NoPE view, random eviction's sketched archive), with
 * *site filled (the layer's spec and policy table, the context's sketch rank, block_rows and
 * limits); NULL where no request recalls there. The context's one place that asks which
 * kind a layer's recall is (a request's: kvt__seq_recall_of). */
const kvt__recall_ops *kvt__ctx_recall_of(const kvt_ctx *ctx, uint32_t layer,
                                          kvt__recall_site *site);
/* Record a detail message in the calling thread's last-error buffer (kvt_last_error) and
 * return s; ctx is only there to name the call's context. */
/* The policy table that answers for layer `layer`'s policy (tiers/policy.h kvt__policy_table: the
 * one resolve_policies checked the layer with; never NULL in a created context, a layer without
 * KV included). lib/ asks a layer's policy questions of its table's entries, never of the
 * policy's value (DESIGN §3). */
static inline const kvt__policy_ops *kvt__layer_policy(const kvt_ctx *ctx, uint32_t layer) {
    return kvt__policy_table(ctx->policies[layer]);
}
kvt_status kvt__ctx_fail(const kvt_ctx *ctx, kvt_status s, const char *fmt, ...) KVT__PRINTF(3, 4);
void kvt__ctx_clear_error(const kvt_ctx *ctx);
kvt__env kvt__ctx_env(const kvt_ctx *ctx, const kvt_seq *seq, void *stream);
/* A caller's config (any supported struct_size) checked and normalised into *out (may be NULL
 * to check only); the message names the field in err. */
kvt_status kvt__config_in(const kvt_config *user, kvt_config *out, char *err, size_t len);

#endif
