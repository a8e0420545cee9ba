/*
 * needle.h — the long-context needle suite at the attention level (DESIGN §5), as a library the
 * kvtier-needle tool and tests/test_needle.c share (kvtier_needle_core).
 *
 *   nd_case      an attention-level trace held in memory: one MLA layer's rows (or one GQA
 *                layer's K and V rows, from a real engine's trace), the needles
 *                planted in it and the queries that target them. Made by the synthetic
 *                generator (nd_generate, statistical model in docs/needle.md) or read from a
 *                kvtier trace file (nd_case_load); written with nd_case_save.
 *   nd_refs      full-cache attention of every target (computed once per case, reused across
 *                ratios and modes).
 *   nd_run       replays a case through the real manager (kvt_ctx_create, reserve / write /
 *                commit, kvt_attended_tokens at each query) and measures each target.
 *
 * Functions return 0 on success or a nonzero ND_E* code with a message in err.
 */
#ifndef KVT_TOOLS_NEEDLE_H
#define KVT_TOOLS_NEEDLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"

#define ND_OK 0
#define ND_EARG 2   /* bad parameter / flag */
#define ND_EIO 3    /* cannot read / write a file, malformed trace */
#define ND_ELIB 4   /* kvtier returned an error */
#define ND_ENOMEM 5
#define ND_ENOTIMPL 6 /* promote; recall on a case without a decode phase */

#define ND_MAX_HEADS 64u         /* targeted heads per target, and query heads of a case */
#define ND_MAX_BATCH 64u         /* requests replayed together (--batch) */
#define ND_EDGE_ROWS 32u          /* "near a block edge": within this many rows of it */
#define ND_MAX_NEEDLE_ROWS 16u   /* rows per needle: the generator's limit, and what nd_case_load
                                    accepts from a trace (a longer needle is refused) */

/* Needle salience band: the needle rows' σ percentile within their block (docs/needle.md). */
typedef enum nd_salience {
    ND_SAL_STRONG = 0,  /* top 1%: percentile >= 99 */
    ND_SAL_WEAK = 1,    /* percentile in [90, 97] */
    ND_SAL_NONE = 2,    /* below the median: percentile < 50 (only recall can save it) */
    ND_SAL_NATURAL = 3, /* not calibrated: whatever the generator's branch model gives */
    ND_SAL_TRACE = 4,   /* unknown (a trace without the generator's annotations) */
} nd_salience;
#define ND_SAL_COUNT 5

typedef enum nd_mode {
    ND_MODE_SALIENCE = 0, /* the policy table (σ top-m on NoPE; random eviction on RoPE) */
    ND_MODE_RANDOM = 1,   /* salience tier with the uniform Philox selector (KVT_SELECT_RANDOM) */
    ND_MODE_DENSE = 2,    /* ratio 1: everything attended */
    ND_MODE_RECALL = 3,   /* salience + the recall trigger, over the case's decode phase */
    ND_MODE_PROMOTE = 4,  /* not implemented yet */
} nd_mode;
#define ND_MODE_COUNT 5

const char *nd_salience_name(nd_salience s);
int nd_salience_parse(const char *s, nd_salience *out);
const char *nd_mode_name(nd_mode m);
int nd_mode_parse(const char *s, nd_mode *out);

/* ------------------------------------------------------------------------------------------- */
/* Case                                                                                         */
/* ------------------------------------------------------------------------------------------- */
typedef struct nd_needle {
    uint64_t first_row, n_rows;
    double depth;          /* nominal depth in [0, 1] (generator), else first_row / n_rows */
    nd_salience salience;  /* requested band */
    bool band_miss;        /* generator: a row of this needle ended outside its requested band
                              (then it is not counted under that band: ND_BAND_MISS) */
} nd_needle;

typedef struct nd_target {
    uint64_t step;         /* query step in the trace */
    uint64_t position;     /* rows existing when the query is issued */
    uint32_t needle;
    uint32_t n_heads;
    uint32_t heads[ND_MAX_HEADS];
    float *q;              /* [n_q_heads][q_dim] fp32 absorbed query (owned) */
} nd_target;

typedef struct nd_case {
    kvt_layer_spec spec;   /* one MLA layer (NoPE or RoPE), or one GQA-RoPE layer (traces) */
    uint32_t layer;        /* model layer index in the source trace (0 for synthetic) */
    uint64_t n_rows;
    uint8_t *rows;         /* [n_rows][n_kv_heads][row_bytes] (owned): MLA rows, or GQA keys */
    uint8_t *vrows;        /* GQA: the V plane, laid out as rows (owned); NULL for MLA, whose
                              value is the first value_dim values of the row */
    uint64_t prompt_rows;
    uint32_t n_q_heads, q_dim;
    nd_needle *needles;
    uint32_t n_needles;
    nd_target *targets;    /* sorted by position */
    uint32_t n_targets;
    char *text;            /* provenance text (owned, may be NULL) */
    uint64_t seed;         /* generator seed (0 for a loaded trace without one) */
    uint32_t band_misses;  /* generator: needle rows whose σ calibration missed the band */
    double scale;          /* softmax scale a trace names (text line "scale="); 0: none */
    /* Decode phase (generator with nd_gen_params.decode_calib > 0; none from a trace): rows
     * [decode_start, n_rows) are committed one per decode step, step k committing row
     * decode_start + k and querying with decode_q + k x n_q_heads x q_dim (the rows [0,
     * decode_start + k + 1)). decode_target[k] = the target whose query it is (a copy of its q),
     * or -1 for a filler query. decode_start = 0: no decode phase. */
    uint64_t decode_start;
    uint32_t n_decode;
    float *decode_q;       /* [n_decode][n_q_heads][q_dim] (owned) */
    int32_t *decode_target; /* [n_decode] (owned) */
    /* The generator's query subspace (decode phase only): qbasis_rank orthonormal rows of
     * value_dim fp32 values spanning the latent directions of every query (filler, needle and
     * non-targeted heads) and of the needles (owned; NULL: none). */
    float *qbasis;
    uint32_t qbasis_rank;
} nd_case;

void nd_case_free(nd_case *c);

/* Read a kvtier trace: layer = model layer index, or UINT32_MAX for the first MLA or GQA-RoPE
 * layer that has queries and needles. A GQA-RoPE layer (both planes, n_kv_heads rows per token,
 * query heads grouped over them: nd_gqa_layout_check) is replayed under the RoPE policy (random
 * eviction, prompt protected) with attention over its K and V; its needle rows are marked per KV
 * head by the positions each head holds. Every CRC of the file is checked first (kvt_trace_verify: one streaming
 * pass; a corrupt file is refused with ND_EIO and a message naming KVT_ERR_CORRUPT). The layer
 * must be laid out the way the reference attention reads it: key = head_dim contiguous values of
 * dtype from byte 0, i.e. head_dim == value_dim + branch_dim, branch_offset == value_dim x
 * sizeof(dtype), branch_dtype == dtype (else ND_EIO naming the field); needles longer than
 * ND_MAX_NEEDLE_ROWS are refused. Only the targeted query steps are loaded. Needle labels,
 * depths and band misses come from the generator's text lines ("needle.<i>.salience=",
 * "needle.<i>.depth=", "needle.<i>.band_miss=1") when present. */
int nd_case_load(const char *path, uint32_t layer, nd_case *out, char *err, size_t err_len);
/* Write a case as a kvtier trace (rows in chunks, one query step per target). */
int nd_case_save(const nd_case *c, const char *path, char *err, size_t err_len);

/* Rows of c whose key (the first head_dim values: what the reference attention reads) holds a NaN
 * or an Inf, found from the stored bits (no widening). *first_row (may be NULL) receives the first
 * such row, UINT64_MAX when there is none. Such a row before a query's position makes that query's
 * full-cache reference non-finite (the softmax max is NaN, or Inf minus Inf), and nd_run then
 * reports the query as ND_INVALID. */
uint64_t nd_case_nonfinite_rows(const nd_case *c, uint64_t *first_row);

/* σ percentile of each needle within its block: the minimum over its rows of
 * 100 · #{rows v of the block, v != u, σ_v < σ_u} / (B − 1). NaN when a row is not in a complete
 * block. out has c->n_needles entries. */
int nd_case_sigma_pct(const nd_case *c, uint32_t block_rows, uint32_t kappa, double *out,
                      char *err, size_t err_len);
/* The same under the σ basis `basis` (nd_case_sigma_pct: KVT_SIGMA_FOURIER). */
int nd_case_sigma_pct_basis(const nd_case *c, uint32_t block_rows, uint32_t kappa,
                            kvt_sigma_basis basis, double *out, char *err, size_t err_len);

/* ------------------------------------------------------------------------------------------- */
/* Generator (statistical model: docs/needle.md)                                                */
/* ------------------------------------------------------------------------------------------- */
/* Model of the background branch's slow part (docs/needle.md, item 2). */
typedef enum nd_branch {
    ND_BRANCH_SMOOTH = 0, /* two slow cosines per channel (periods 16k..256k rows) */
    ND_BRANCH_DRIFT = 1,  /* the same plus a per-channel AR(1) walk with φ near 1: a branch that
                             drifts along the sequence, so the ends of a block differ */
} nd_branch;
const char *nd_branch_name(nd_branch b);
int nd_branch_parse(const char *s, nd_branch *out);

typedef struct nd_gen_params {
    uint64_t context;        /* rows (= query position of every target) */
    uint64_t seed;
    kvt_dtype dtype;         /* row dtype: bf16 (default), fp16, fp32 */
    bool rope;               /* rotate the branch by position; layer kind MLA_ROPE */
    uint64_t prompt_rows;    /* rows [0, prompt_rows) are the prompt (protected under RoPE) */
    uint32_t block_rows;     /* B the σ calibration uses (4096) */
    uint32_t kappa;          /* κ (16) */
    uint32_t sink_rows;      /* attention sinks at rows 0.. (4) */
    uint32_t n_q_heads;      /* query heads (8) */
    uint32_t n_target_heads; /* heads each needle query targets (2) */
    uint32_t needle_rows;    /* rows per needle, 1..16 (1) */
    /* Needles: every depth x every salience level x needles_per_depth. */
    const double *depths;
    uint32_t n_depths;
    const nd_salience *levels;
    uint32_t n_levels;
    uint32_t needles_per_depth;
    double kv_haystack;      /* fraction of haystack rows that are key-value-pair rows (0) */
    double mass_lo, mass_hi; /* needle mass under the full cache, per targeted head (0.6, 0.9) */
    double scale;            /* softmax scale (192^-1/2) */
    nd_branch branch;        /* ND_BRANCH_SMOOTH */
    kvt_sigma_basis calib_basis; /* σ basis the needles' bands are calibrated under
                                    (KVT_SIGMA_FOURIER, the reference) */
    /* Decode phase (docs/needle.md, item 8): 0 = none (every query at position = context).
     * Otherwise decode_calib filler decode steps follow the haystack, then for each needle
     * decode_gap filler steps and the needle's query step; every step commits one background
     * row. Query and needle latent directions are then drawn in a rank-query_rank subspace. */
    uint32_t decode_calib;
    uint32_t decode_gap;
    uint32_t query_rank;     /* 64 */
    /* Multi-key (UUID-style) haystack, decode phase only: this fraction of haystack rows are
     * decoys sharing a template direction with every needle (cosine 0.5 with each needle's
     * latent direction); 0 = none. */
    double decoys;
} nd_gen_params;

nd_gen_params nd_gen_default_params(void);
/* progress(ud, fraction) is called now and then (may be NULL). */
int nd_generate(const nd_gen_params *p, nd_case *out, void (*progress)(void *, double), void *ud,
                char *err, size_t err_len);

/* ------------------------------------------------------------------------------------------- */
/* Full-cache references                                                                        */
/* ------------------------------------------------------------------------------------------- */
typedef struct nd_ref {
    float *out;              /* [n_heads][value_dim] */
    double mass[ND_MAX_HEADS];
} nd_ref;

typedef struct nd_refs {
    nd_ref *t;               /* [n_targets] */
    uint32_t n;
    uint32_t value_dim;
} nd_refs;

int nd_refs_compute(const nd_case *c, double scale, nd_refs *out, void (*progress)(void *, double),
                    void *ud, char *err, size_t err_len);
void nd_refs_free(nd_refs *r);

/* ------------------------------------------------------------------------------------------- */
/* Replay                                                                                       */
/* ------------------------------------------------------------------------------------------- */
typedef struct nd_run_params {
    nd_mode mode;
    uint32_t ratio;          /* compression ratio (ignored by dense) */
    uint32_t block_rows, kappa, sink_rows;
    uint32_t recent_rows;    /* RoPE eviction: r (64) */
    uint64_t seed;           /* kvtier config seed (Philox) */
    double scale;
    double min_mass, min_cos; /* pass rule: mass_ratio >= min_mass and out_cos >= min_cos */
    kvt_backend_kind backend;
    /* Where random eviction's archive lives (kvt_ctx_params.archive_space): KVT_SPACE_DEVICE, or
     * KVT_SPACE_HOST (RoPE recall then never attends the whole archive: docs/recall.md §9.7). */
    kvt_space archive_space;
    /* Requests replayed together, as one engine batch (1): request r (0 <= r < batch) has request
     * id request_base + r and the case's rows; its results land at out[r * n_targets + ...].
     * Every request's results equal a batch-of-one run with its request id. */
    uint32_t batch;
    uint64_t request_base; /* 1 */
    /* Test hook (NULL in normal runs): called at every query after kvt_attended_tokens and
     * before the attended set is checked, with the layer's pool plane and the returned slots, so
     * that tests can damage them and see the check refuse the measurement. */
    void (*tamper)(void *ud, uint8_t *pool, size_t pool_bytes, int32_t *slots, int32_t *len);
    void *tamper_ud;
    /* Preemption drill (0: off): after the snapshot_at-th committed step of the replay, every
     * request is snapshotted to snapshot_dir/r<request id>.kvts (kvt_seq_snapshot_file),
     * destroyed, and restored from the file (kvt_seq_restore_file); the replay continues on the
     * restored requests and must give the same results. */
    uint64_t snapshot_at;
    const char *snapshot_dir;
    kvt_sigma_basis sigma_basis; /* kvt_config.sigma_basis (the library's default) */
    /* kvt_config.salience_budget and budget_min_kept (0: the library's floor). */
    bool salience_budget;
    uint32_t budget_min_kept;
    /* ND_MODE_RECALL: the trigger's mode (KVT_RECALL_CONFORMAL), cap W (0: the library's),
     * sketch rank (64), and whether the case's query subspace is loaded as the recall basis
     * (true; false: recall without a basis). */
    kvt_recall_mode recall;
    uint32_t recall_cap_rows;
    uint32_t recall_rank;
    uint32_t recall_scan_bits; /* kvt_ctx_params.recall_scan_bits (0: the library's, 16) */
    bool recall_basis;
    const char *recall_basis_file; /* a basis file instead of the case's subspace (NULL: none):
                                    * kvt_ctx_load_recall_basis, or on a RoPE layer
                                    * kvt_ctx_load_recall_head_basis of head 0 */
    /* Output (may be NULL): the decode steps' recall statistics, summed over requests. */
    struct nd_recall_stats *recall_stats;
    /* A basis that follows the request's own queries (ND_MODE_RECALL on an MLA-NoPE layer, with
     * a basis to start from; issue 34 item 0, docs/needle.md "Adaptive basis"): the centred
     * covariance (double) of every decode query's latent (the first value_dim values of each
     * head's absorbed query) is accumulated as the steps run, and after the commit of the decode
     * step that makes ND_ADAPT_AT[i] queries seen (8, 16, 32, 64) its top eigenvectors, as many
     * as the layer's basis rank (tools/common/eigen.c, rounded to fp32), replace the layer's
     * basis through kvt_ctx_refit_recall_basis: flags 0 at the first refit (the requests
     * calibrate z again), KVT_REFIT_KEEP_Z after. With a batch, the requests share the queries
     * and the layer's basis: each step's latents are counted once. On a RoPE layer (GQA/MHA or
     * MLA-RoPE) each KV head's key basis is fitted instead, once, to the request's own keys over
     * the prompt (the uncentred second moment of at most 65,536 of them, evenly spaced), between
     * the prompt's last step and the first decode step (kvt_ctx_refit_recall_head_basis, flags
     * 0). ND_EARG without a basis; ND_ENOTIMPL when built without LAPACKE. */
    bool recall_adapt;
} nd_run_params;

/* The decode steps after whose commit recall_adapt refits the basis: when this many decode
 * queries have been seen. */
#define ND_ADAPT_N 4
extern const uint32_t ND_ADAPT_AT[ND_ADAPT_N];

/* Recall statistics of a replay's decode steps (ND_MODE_RECALL), summed over requests. A step is
 * "dense" when it attended every row (calibration or overflow); "overflow" when more than W rows
 * fired. Needle steps are the decode steps whose query is a target's. */
typedef struct nd_recall_stats {
    uint64_t steps, calib_steps;               /* decode steps run; filler calibration steps */
    /* needle steps: every needle query step (dense ones included: calibration or overflow) */
    uint64_t needle_steps, needle_overflow, needle_dense;
    uint64_t other_steps, other_overflow, other_dense; /* filler steps after calibration */
    uint64_t other_fetched, other_archived;    /* filler steps after calibration, not dense */
    uint64_t visited, archived;                /* over every non-calibration step */
    float z;                                   /* the last step's recall_z */
    int32_t phase;                             /* the last step's recall_phase */
    uint32_t refits;                           /* recall_adapt: the layer's basis refits that
                                                  ran (one per refit, whatever the batch) */
} nd_recall_stats;

nd_run_params nd_run_default_params(void);

/* ND_TAIL, ND_BAND_MISS and ND_INVALID are reported but excluded from every pass rate. */
typedef enum nd_status {
    ND_FAIL = 0,
    ND_PASS = 1,
    ND_TAIL = 2,
    ND_BAND_MISS = 3,
    ND_INVALID = 4, /* the full-cache reference of a targeted head is non-finite (NaN / Inf in
                       its output or needle mass: a row before the query, or the query, holds a
                       non-finite value), so there is nothing to compare against */
} nd_status;

typedef struct nd_result {
    uint64_t request;        /* the request id the query was replayed under */
    uint32_t target, needle;
    uint64_t position, first_row, n_rows;
    double depth;
    nd_salience salience;
    nd_status status;        /* ND_TAIL: needle (partly) in the unclosed tail (salience) or in
                                the rows no eviction round has scored yet (eviction); excluded.
                                ND_BAND_MISS: the needle missed its requested salience band;
                                excluded. ND_INVALID: non-finite reference; excluded, takes
                                precedence over tail and band miss, and the four metrics below
                                are NaN */
    double mass_ratio;       /* min over targeted heads of mass(attended) / mass(full) */
    double out_cos;          /* min over targeted heads of cos(out(attended), out(full)) */
    double out_rel_err;      /* max over targeted heads of |out(att) − out(full)| / |out(full)| */
    double full_mass;        /* min over targeted heads of the needle mass under the full cache */
    uint32_t needle_rows_attended;
    kvt_policy policy;
    uint64_t attended_rows;  /* rows of the measured attended set (checked: = the layer's
                                attended_rows, unique slots, bytes = the case's rows) */
    uint64_t archived_rows, dropped_rows, fetched_rows;
    uint64_t closed_rows;
    uint64_t tail_rows;      /* rows attended without having been scored: the unclosed tail
                                (salience); attended_rows - K after a round, all rows before
                                the first (eviction); 0 for policy none */
    uint64_t kept_rows, sink_rows, m_rows;
    bool budget;             /* run in budget mode (kvt_config.salience_budget) */
    double eff_ratio;        /* kvt_layer_stats.effective_ratio at the query */
    /* Block edges (salience policy; 0 otherwise): of the attended rows that were scored (closed,
     * not sinks), how many lie within ND_EDGE_ROWS rows of a block edge (position mod B below
     * ND_EDGE_ROWS or at least B − ND_EDGE_ROWS); and the same two counts over every scored row,
     * whose ratio is the share a selection blind to the position would give ("chance"). */
    uint64_t kept_scored, kept_edge, scored_rows, scored_edge;
    double read_bytes_per_token;
    /* Recall (ND_MODE_RECALL; zero otherwise): the needle step's recall_last_fetched,
     * recall_last_visited / recall_last_archived, overflow and dense flags, recall_z, and how a
     * pass came about: 'k' needle kept by salience, 'f' fetched by recall, 'd' a dense step
     * (calibration or overflow: counted as overflow, not fetch), 0 none. */
    uint64_t recall_visited, recall_archived;
    bool recall_overflow, recall_dense;
    float recall_z;
    char pass_by;
} nd_result;

/* Replay c through kvtier under p and measure every target of every request into
 * out[p->batch * c->n_targets] (request-major). refs from
 * nd_refs_compute(c, p->scale). Before measuring a query the attended set is checked against the
 * library: its length equals the layer's attended_rows and the number of positions in state
 * ATTENDED, slots are unique and in ascending position, and each slot's pool bytes equal the
 * case's row at the position the library says the slot holds; a mismatch is ND_ELIB with a
 * message ("attended set check: ..."), nothing measured. ND_ENOTIMPL for recall / promote. */
int nd_run(const nd_case *c, const nd_refs *refs, const nd_run_params *p, nd_result *out,
           void (*progress)(void *, double), void *ud, char *err, size_t err_len);

/* Count results: passes, counted (neither tail, band miss nor invalid), tail queries and band
 * misses (any pointer may be NULL). Pass rate = pass / counted. Invalid queries are counted by
 * nd_count_status (kept out of this signature so existing callers stay as they are). */
void nd_tally(const nd_result *r, size_t n, uint32_t *pass, uint32_t *counted, uint32_t *tail,
              uint32_t *band_miss);
/* Results whose status is s. */
uint32_t nd_count_status(const nd_result *r, size_t n, nd_status s);

#endif /* KVT_TOOLS_NEEDLE_H */
