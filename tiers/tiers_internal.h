/*
 * tiers_internal.h — the policies' own state, private to tiers/: a salience layer's (kvt__sal,
 * with the shared closed-row planes kvt__sal_head and the group's basis tables kvt__sal_shared)
 * and a random-eviction layer's (kvt__ev), and the functions that run them. lib/ never sees
 * these layouts: it holds each (request, layer) state and each group's state as opaque storage
 * of the sizes policy.h publishes (kvt__tier_state_bytes, kvt__group_state_bytes) and reaches
 * them only through the layer's policy table (policy.h). tests/scripts/check_layers.py refuses an
 * include of a *_internal.h header from outside its folder (white-box tests aside).
 */
#ifndef KVT_TIERS_TIERS_INTERNAL_H
#define KVT_TIERS_TIERS_INTERNAL_H

#include "policy.h"

/* ------------------------------------------------------------------------------------------- */
/* Salience tier (MLA-NoPE): sigma at block close, global top-m, sinks, tail, archive by index. */
/* ------------------------------------------------------------------------------------------- */
/* A set of closed-row planes shared by requests (prefix sharing: kvt_seq_fork, kvt_seq_attach):
 * σ and the sketches of rows [0, rows), fixed once written, in the backend's memory; freed by its
 * last holder. The struct is host memory. */
typedef struct kvt__sal_head {
    float *score;
    uint16_t *csk;
    float *rho;
    uint64_t cap[3];  /* rows each plane (score, csk, rho) was allocated for */
    uint64_t rows;    /* rows written */
    uint32_t holders; /* requests reading it */
    /* A basis replacement (the policy's resketch): its epoch, and the rows [0, resketched) of
     * the set sketched again in it. */
    uint64_t resketch_epoch, resketched;
} kvt__sal_head;

typedef struct kvt__sal {
    uint64_t n_rows;      /* committed rows (= positions) */
    uint64_t closed_rows; /* rows in closed blocks: a multiple of block_rows */
    /* Side planes in the backend's memory space (the host reaches them only through the backend:
     * inspection calls read them; a close's selection op writes them). The closed-row planes
     * (score, csk, rho) come in two pieces: rows [0, n_head) in a shared set (head, read-only;
     * NULL and 0 when the state shares none), rows n_head on in the state's own planes at index
     * row − n_head — so requests sharing closed blocks hold one copy of their planes for as
     * long as they live, and each writes its later closes into its own. */
    const kvt__backend *be; /* the context's backend, which allocated them */
    float *score;           /* backend: own rows' canonical score (NaN -> +Inf), fixed at close */
    uint64_t score_cap;     /* own rows */
    uint32_t *kept;         /* backend: [n_kept] ascending positions of the top-m closed rows */
    uint64_t n_kept, kept_cap;
    uint64_t kept_in_sinks; /* host: kept rows below the sinks' end (attended as sinks) */
    uint64_t closes, nonfinite, score_bytes_read;
    /* Recall sketches of the closed rows (recall/kernels/sketch.h), written at each close next to σ
     * when sk_stride > 0: csk [rows][sk_stride] fp16 (entries past the layer's basis rank are 0)
     * and ρ [rows] fp32, own rows as score; caps in rows. */
    uint32_t sk_stride;
    /* The 8-bit scan's planes (params.recall_scan_bits 8): each sketch row is sk_q8 fp16 values
     * then the row's 8-bit plane (recall/kernels/recall_scan.h), sk_stride = sk_q8 + its words; 0: the
     * rows are fp16 values only. */
    uint32_t sk_q8;
    uint16_t *csk;
    uint64_t csk_cap;
    float *rho;
    uint64_t rho_cap;
    kvt__sal_head *head; /* the shared piece, or NULL */
    uint64_t n_head;     /* rows read from it: a multiple of block_rows, <= head->rows */
    uint64_t prep_rows;  /* closed rows kvt__sal_prepare sized the planes for */
    /* Rows of the open block sketched ahead, at the commits that made them final: rows
     * [closed_rows, sk_rows) hold their sketches (and 8-bit planes) in the own planes already, so
     * that a close sketches only the rest. 0 (or any value <= closed_rows): none. Every change
     * of n_head, closed_rows or the basis sets it to 0 (kvt__sal_tail_forget). */
    uint64_t sk_rows;
} kvt__sal;

/* Forget the rows sketched ahead (their planes moved, the basis changed, the state was rebuilt):
 * the next close sketches its whole block. */
static inline void kvt__sal_tail_forget(kvt__sal *s) {
    s->sk_rows = 0;
}

/* Basis tables shared by all salience layers of a context: [n_basis][block_rows], in the
 * backend's memory (σ reads them there). */
typedef struct kvt__sal_shared {
    const kvt__backend *be; /* which allocated basis */
    float *basis;
    uint32_t n_basis;
    uint32_t block_rows;
} kvt__sal_shared;

kvt_status kvt__sal_shared_init(kvt__sal_shared *sh, const kvt__alloc *a, const kvt__backend *be,
                                const kvt_config *cfg);
void kvt__sal_shared_fini(kvt__sal_shared *sh);

/* Bind the state to the backend that holds its side planes (at layer init), with sketch planes
 * of sk_stride fp16 values a row (0: none). */
void kvt__sal_init(kvt__sal *s, const kvt__backend *home, uint32_t sk_stride);
void kvt__sal_fini(kvt__sal *s, const kvt__alloc *a);
/* Prefix sharing: dst (no closed row yet) reads src's first `rows` closed rows (a multiple of
 * block_rows, at most src's closed rows) from a set it shares with src, and keeps its own planes
 * for the rows it closes later. src's closed rows become one shared set first when they are not
 * already: its own planes move into a new set (no copy), or, when src already shares a set and
 * closed blocks since, the set and its own rows are copied into a new one (on the backend, once).
 * KVT_ERR_OUT_OF_MEMORY with nothing changed. */
kvt_status kvt__sal_share(kvt__sal *dst, kvt__sal *src, uint64_t rows, const kvt__alloc *a);
/* Give up a shared set (a request slot parked): the set is forgotten (freed by its last
 * holder); the state then reads no shared rows. */
void kvt__sal_unshare(kvt__sal *s, const kvt__alloc *a);
/* Backend bytes of the state's side planes (capacity): *own those only it holds, *shared those
 * of a set it shares with other requests (0 when none). */
void kvt__sal_side_bytes(const kvt__sal *s, uint64_t *own, uint64_t *shared);
/* Size the state for `rows` committed rows (scores, kept set, close scratch) so that closes up
 * to there allocate nothing. KVT_OK or KVT_ERR_OUT_OF_MEMORY (capacity only: nothing observable
 * changes). */
kvt_status kvt__sal_prepare(kvt__sal *s, const kvt__alloc *a, const kvt_config *cfg, uint64_t rows);
/* m for a number of closed rows: max(1, (closed + ratio/2) / ratio), 0 when closed is 0; in
 * budget mode (cfg->salience_budget) the tail-aware m of kvtier.h's kvt_config; minus the rows
 * reserved for recall promotion (kvt__sal_promote_room). */
uint64_t kvt__sal_m(uint64_t closed_rows, const kvt_config *cfg);
/* The rows of the budget a close reserves for recall's promoted set (docs/recall.md §4.2):
 * min(config.recall_promote_capacity, m − 1) with m the budget's top-m, for a request with
 * recall and promotion on; 0 otherwise (every decision as without promotion). */
uint64_t kvt__sal_promote_room(uint64_t closed_rows, const kvt_config *cfg);
/* One (request, layer) of a batched close: its state, tables and request config. */
typedef struct kvt__sal_job {
    kvt__sal *s;
    const kvt__sal_shared *sh;
    const kvt__store *st;
    const kvt__ptable *pt;
    const kvt_config *cfg;
    uint64_t philox_key;
    uint64_t new_n_rows;
    /* the rows up to new_n_rows are committed (a commit, not a step in flight, whose rows an
     * engine may still write again): whole tiles of them past the closed rows are sketched ahead
     * (kvt__sal.sk_rows) */
    bool final;
    /* filled by kvt__sal_commit_many */
    uint64_t n_close, new_closed, m;
    kvt_status status;
} kvt__sal_job;

/* Close every block the jobs' rows complete, for all of them together: σ of every closing
 * block in batched backend calls, then one segmented top-m. Each job's status says how it went;
 * a failed job changed nothing observable (its rows stay attended in the tail) and the next
 * commit retries it. Returns the first failure. */
kvt_status kvt__sal_commit_many(const kvt__env *env, kvt__sal_job *jobs, uint32_t n);
/* Rows [s->n_rows, new_n_rows) were committed: close every full block (score it), then re-select
 * the global top-m once if anything closed. On failure nothing observable changed. */
kvt_status kvt__sal_commit(kvt__sal *s, const kvt__env *env, const kvt__sal_shared *sh,
                           const kvt__store *st, const kvt__ptable *pt, uint64_t new_n_rows);
/* The attended rows when the table holds n_rows rows (>= closed_rows; more than s->n_rows
 * during a step whose work runs at commit): sinks [0, S), the kept rows past them, the tail
 * [closed_rows, n_rows). */
void kvt__sal_attended(const kvt__sal *s, const kvt_config *cfg, uint64_t n_rows,
                       kvt__attended_desc *d);
bool kvt__sal_is_attended(const kvt__sal *s, const kvt_config *cfg, uint64_t pos);
/* Full check; writes the first violation into err. */
kvt_status kvt__sal_check(const kvt__sal *s, const kvt_config *cfg, char *err, size_t len);

/* ------------------------------------------------------------------------------------------- */
/* Random eviction (MLA-RoPE, GQA): rounds, compaction, optional archive pool.                  */
/* ------------------------------------------------------------------------------------------- */
/* The state of one (request, layer). Positions, keep sets, slot maps and the archive live in
 * the backend's memory (kernels/evict.h computes on them); the host keeps counts only, which
 * follow from N, K and r alone: a round needs no synchronisation. */
typedef struct kvt__ev {
    const kvt__backend *be; /* the context's backend, which allocated the buffers */
    uint32_t n_heads;
    int64_t *pos; /* backend [n_heads][pos_cap]: original position at row index i */
    uint64_t pos_cap;
    int32_t *last_map; /* backend [n_heads][last_n]: old row index -> new row index or -1 */
    uint64_t last_n, last_map_cap; /* cap in entries */
    uint32_t *keep;     /* backend [n_heads][K]: the round's keep sets (select -> apply) */
    uint64_t keep_cap;  /* in entries */
    uint64_t last_kept; /* rows per head right after the last round (K + r) */
    uint64_t rounds;
    uint64_t dropped; /* summed over heads */
    bool prompt_over_budget;
    /* A device error hit mid-compaction: rows may be half moved and the group's layers disagree.
     * Sticky; the sequence refuses further work (KVT_ERR_BAD_STATE) and can only be destroyed. */
    bool damaged;
    /* The archive (cfg->evict_archive): rows copied out before compaction, kept exactly; every
     * head archives the same count. backend [n_heads][ar_cap] of rows (all planes), positions in
     * order of archiving, and indices sorted by position (lookup). */
    bool archive;
    uint8_t *ar_bytes;
    int64_t *ar_pos;
    uint64_t *ar_by_pos;
    uint64_t ar_n, ar_cap;
    size_t ar_row_bytes; /* n_planes * row_bytes */
    /* ar_bytes in pinned host memory (the backend's host_alloc; kvt_ctx_params.archive_space
     * HOST), the other archive arrays in the backend's: the rows cost no device memory. */
    bool ar_host;
    /* With a host archive on an MLA-RoPE layer with sketches: each archived row's rotated branch
     * (br_bytes at br_offset of the row) also in a plane of the backend's, [n_heads][ar_cap]
     * [br_bytes], written when the row is sketched (derived data), so that the per-step scan
     * reads no archived row over the bus. br_bytes 0: no plane. */
    uint8_t *ar_branch;
    uint32_t br_bytes, br_offset;
    /* A step in flight (policy.h layer_step): this layer recorded the step's positions / ran its
     * part of a due round (it then holds last_kept rows while the table still holds N). Cleared
     * by the group's commit. */
    bool step_appended, step_round;
    /* Recall sketches of the archive (docs/recall.md §9; GQA/MHA layers of a context with
     * recall_sketch_rank, archive on): per head and archived row, the key (plane 0) projected on
     * the head's basis (store kb_*), fp16, and ρ, fp32, built after the round that archived it
     * (kvt__ev_sketch_pending). Derived data: a snapshot does not carry them, a restore rebuilds
     * them. ar_ident is an identity page mirror (entry i = i, of page_rows rows) so that the
     * page-table ops (sketch_rows, the recall scan) address archive row k of a head as slot k. */
    uint32_t sk_stride; /* fp16 coefficients per archived row (0: no sketches) */
    uint16_t *ar_csk;   /* backend [n_heads][ar_cap][sk_stride] */
    float *ar_rho;      /* backend [n_heads][ar_cap] */
    int32_t *ar_ident;  /* backend [ident_n] */
    uint64_t ident_n;
    uint32_t page_rows;
    uint64_t sk_n; /* archived rows per head sketched: [0, sk_n), sk_n <= ar_n */
} kvt__ev;

kvt_status kvt__ev_init(kvt__ev *e, const kvt__backend *be, const kvt_layer_spec *spec,
                        bool archive);
void kvt__ev_fini(kvt__ev *e);
/* Grow the position arrays to hold `rows` row indices per head (called at reserve, so that the
 * append at commit cannot fail). KVT_OK or KVT_ERR_OUT_OF_MEMORY (nothing changed). */
kvt_status kvt__ev_reserve(kvt__ev *e, uint64_t rows);
/* Size the state for a table of up to `rows` rows (positions, slot map, keep sets) so that
 * rounds up to there allocate nothing (archive copies still grow). Capacity only. */
kvt_status kvt__ev_prepare(kvt__ev *e, const kvt_config *cfg, uint64_t rows);
/* Record positions [first_pos, first_pos + n) at row indices [first_row, first_row + n) for
 * every head (on commit, before any round), on the stream. Capacity was reserved. */
kvt_status kvt__ev_append(kvt__ev *e, const kvt__backend *be, void *stream, uint64_t first_row,
                          uint64_t first_pos, uint64_t n);
/* Does a group holding n_rows need a round? (n_rows >= K + r + c) */
bool kvt__ev_round_due(const kvt_config *cfg, uint64_t n_rows);
/* Rows of the prefix of positions every round keeps: the prompt (when cfg->protect_prompt; its
 * first K - 1 rows when the prompt alone reaches K), and with cfg->evict_vase at least the first
 * 4 rows; never more than K. */
uint64_t kvt__ev_protected_rows(const kvt_config *cfg, uint64_t prompt_rows);
/* Does the prompt alone reach the budget K (cfg->protect_prompt)? Then a round keeps only its
 * first K - 1 rows. */
bool kvt__ev_prompt_over_budget(const kvt_config *cfg, uint64_t prompt_rows);
/* Capacity for a round over N rows per head keeping K (slot map, keep sets; evict.c), and for
 * `add` more archived rows per head (on the stream; NULL: synchronously). A failure changes
 * nothing. Used by the rounds and by a snapshot's load (evict_state.c). */
kvt_status kvt__ev_round_reserve(kvt__ev *e, uint64_t N, uint64_t K);
kvt_status kvt__ev_archive_reserve(kvt__ev *e, uint64_t add, void *stream);
/* Run one round on every layer of an evict group of one sequence: per layer and head choose the
 * K kept rows among candidates (all but the newest r), archive or drop the others, compact each
 * head's survivors to the front in chronological order, then shrink the page table to K + r rows
 * and return trailing pages to the pool. prompt_rows are protected (when cfg->protect_prompt).
 * stores[i] / states[i] for the n_layers layers of the group. Every allocation happens before
 * anything moves: KVT_ERR_OUT_OF_MEMORY (or a backend error during selection) leaves every
 * state, the page table and the pool unchanged, and the next commit retries. A group holding
 * fewer than K + r + c rows is left as it is (KVT_OK). */
kvt_status kvt__ev_round(const kvt__env *env, kvt__store *const *stores, kvt__ev *const *states,
                         uint32_t n_layers, kvt__ptable *pt, kvt__pool *pool, uint64_t prompt_rows);
/* Sketch the archived rows [e->sk_n, e->ar_n) of every head (store st's key bases), through
 * env->backend on env->stream; sk_n = ar_n on success. KVT_OK when there is nothing to do, or the
 * backend's status with a message in env->err (nothing recorded: the next call retries). */
kvt_status kvt__ev_sketch_pending(const kvt__env *env, const kvt__store *st, kvt__ev *e);
/* The sketched part of an archived key, in values: head_dim on a GQA/MHA layer (two planes, the
 * whole post-RoPE key), value_dim on an MLA-RoPE layer (one plane: the latent kv_lora_rank; its
 * rotated branch is scored exactly, as on NoPE layers); 0 for any other spec. */
uint32_t kvt__ev_key_dim(const kvt_layer_spec *sp);
/* Are the spec's rows FlashMLA's 656-B ds_mla rows (512 E4M3 latent values, 4 fp32 scales at byte
 * 512, 64 bf16 branch values at byte 528: kernels/kvt_hd.h), the one fp8 layout kvtier decodes? */
bool kvt__spec_ds_mla(const kvt_layer_spec *sp);
/* Does this layer spec get archive sketches when the context builds sketch planes of `stride`?
 * Its stride (min(stride, kvt__ev_key_dim)), or 0: GQA/MHA layers (two planes) and MLA-RoPE
 * layers (one plane, branch of at most KVT__RECALL_MAX_BRANCH values) of bf16/fp16/fp32 rows
 * whose key the sketch takes. */
uint32_t kvt__ev_sketch_stride(const kvt_layer_spec *sp, uint32_t stride);
/* Row index of a position for head h, or -1 when not attended. O(log rows), synchronising. */
int64_t kvt__ev_find(const kvt__ev *e, const kvt__ptable *pt, uint32_t head, uint64_t pos);
/* Index into head's archive of a position, or -1. Synchronising. */
int64_t kvt__ev_archive_find(const kvt__ev *e, uint32_t head, uint64_t pos);
/* Copy the archived row of (head, pos), plane `plane` (row_bytes), into dst: KVT_OK, or
 * KVT_ERR_INVARIANT when it is not archived, or the backend read's status. Synchronising. */
kvt_status kvt__ev_read_archived(const kvt__ev *e, const kvt_layer_spec *spec, uint32_t head,
                                 uint32_t plane, uint64_t pos, void *dst);
/* Full check of one layer's state against its group's page table; `appended` = committed
 * tokens. Writes the first violation into err (KVT_ERR_INVARIANT). O(rows + archived). */
kvt_status kvt__ev_check(const kvt__ev *e, const kvt__ptable *pt, const kvt_config *cfg,
                         uint64_t appended, uint64_t prompt_rows, char *err, size_t len);

/* The evict table's snapshot entries (tiers/evict_state.c; policy_ops.snap_*). */
uint64_t kvt__ev_snap_size(const kvt__tier_layer *l);
kvt_status kvt__ev_snap_save(const kvt__tier_layer *l, uint8_t *dst, char *err, size_t len);
kvt_status kvt__ev_snap_load(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                             const uint8_t *src, uint64_t n);

/* ------------------------------------------------------------------------------------------- */
/* The storage lib/ holds for them (policy.h).                                                 */
/* ------------------------------------------------------------------------------------------- */
/* Policy state of one (sequence, layer): the member of the layer's policy. */
union kvt__tier_state {
    kvt__sal sal;
    kvt__ev ev;
};

/* Group-wide state of a group's policy, set by the table's group_init. */
union kvt__group_state {
    kvt__sal_shared sal; /* salience: the basis tables of σ */
};

#endif
