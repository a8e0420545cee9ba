/*
 * backend.h — the data-parallel operations kvtier runs, as a table of function pointers chosen at
 * context creation (ggml-backend style). The CPU backend is complete and is the reference; the
 * CUDA backend fills the same table (kernels/cuda/). Policy and state live in tiers/; a backend only
 * computes. Every operation takes the stream it runs on (a cudaStream_t for CUDA, ignored on CPU).
 */
#ifndef KVT_KERNELS_BACKEND_H
#define KVT_KERNELS_BACKEND_H

#include "kvtier.h"
#include "lib/base/alloc.h"
#include "kernels/attn.h"
#include "kernels/evict.h"
#include "kernels/kvt_hd.h"

typedef struct kvt__backend kvt__backend;
struct kvt__recall_rope_args;      /* recall/kernels/rope_trigger.h */
struct kvt__recall_rope_emit_args; /* recall/kernels/rope_trigger.h */
struct kvt__recall_rope_plan_args; /* recall/kernels/rope_trigger.h */

/* Score n rows of one closed block for the salience selector. Row u lives at
 * base + slot(first_row + u) * slot_stride (one plane, one head). Output: one fp32 score per row (raw: NaN and
 * Inf are left for the caller to canonicalise). */
typedef struct kvt__score_args {
    kvt_selector selector;
    const uint8_t *base;
    /* The rows: row indices [first_row, first_row + n_rows) of a page table in the backend's
     * memory (pages[k] holds row indices (first_page + k) * page_rows onwards), expanded to slots
     * by the backend. */
    const int32_t *pages;
    uint64_t first_page;
    const kvt__div32 *pdiv; /* page_rows */
    uint64_t first_row;
    uint32_t n_rows;        /* B */
    size_t slot_stride;     /* bytes between consecutive slots */
    uint32_t branch_offset; /* bytes */
    int branch_dtype;       /* KVT__DT_* */
    uint32_t branch_dim;
    int dtype;              /* row value dtype, for KVT_SELECT_ROW_NORM */
    uint32_t n_values;      /* values per row, for KVT_SELECT_ROW_NORM */
    const float *basis;     /* [n_basis][n_rows], for KVT_SELECT_SIGMA */
    uint32_t n_basis;
    uint64_t key, subseq;   /* Philox, for KVT_SELECT_RANDOM */
    uint64_t first_position;/* original position of row 0 (rows are consecutive positions) */
    float *out;             /* [n_rows] */
} kvt__score_args;

/* Sketch n rows of one closed block for the recall tier (recall/kernels/sketch.h): the rows as in
 * kvt__score_args (page-table mirror + first_row + n_rows, all in the backend's memory), the
 * layer's basis V and the output planes in the backend's memory too. */
typedef struct kvt__sketch_args {
    const uint8_t *base;
    const int32_t *pages;   /* the table's mirror, as kvt__score_args.pages */
    uint64_t first_page;
    const kvt__div32 *pdiv; /* page_rows */
    uint64_t first_row;
    uint32_t n_rows;        /* B */
    size_t slot_stride;     /* bytes between consecutive slots */
    int dtype;              /* kvt__sketch_dtype_ok: bf16 / fp16 / fp32 / fp8 (ds_mla layout) */
    uint32_t latent_dim;    /* D: the row's first D values (value_dim) */
    const float *basis;     /* [rank][latent_dim] fp32; NULL when rank is 0 */
    uint32_t rank;
    uint32_t csk_stride;    /* fp16 values per row in the plane (>= rank; the rest written 0) */
    uint16_t *csk;          /* [n_rows][csk_stride] out */
    float *rho;             /* [n_rows] out */
    /* q8_off > 0: also write each row's 8-bit plane (kvt__recall_q8_row) from fp16 word q8_off
     * of its sketch row (the fp16 values are csk[0 .. q8_off)), which reads the row's branch. */
    uint32_t q8_off;
    uint32_t branch_offset; /* bytes */
    int branch_dtype;
    uint32_t branch_dim;
} kvt__sketch_args;

/* One recall scan (recall/kernels/recall_scan.h): one request × layer of a step. Every pointer but
 * pdiv is in the backend's memory. The archived rows are the closed rows [sinks, n_closed) not in
 * kept (ascending, m entries, as the salience close writes it), scanned ascending; a row fires when
 * any head's trigger fires on it (mode: KVT__RECALL_CONFORMAL or KVT__RECALL_SOUND, which takes
 * z >= √(latent_dim − 64)). Out: fired[0 .. *n_fired) the first min(cap, fired) of them,
 * ascending; *overflow = 1 when more than cap fired (else 0). */
typedef struct kvt__recall_scan_args {
    const uint8_t *base;    /* pool plane */
    const int32_t *pages;   /* the table's mirror, as kvt__score_args.pages */
    uint64_t first_page;
    const kvt__div32 *pdiv; /* page_rows (a host value, as in kvt__score_args) */
    size_t slot_stride;     /* bytes */
    int dtype;              /* latent: KVT__DT_BF16 / FP16 / FP32 */
    uint32_t latent_dim;    /* D (> 64) */
    uint32_t branch_offset; /* bytes */
    int branch_dtype;
    uint32_t branch_dim;
    const uint16_t *csk;    /* [n_closed - n_head][csk_stride]: rows n_head on (csk[0] is row
                             * n_head's; kvt__scan_csk) */
    const float *rho;       /* [n_closed - n_head], likewise (kvt__scan_rho) */
    /* Rows [0, n_head) of the sketch planes, when they lie in a set shared with other requests
     * (prefix sharing, tiers/salience.c: read-only here); n_head 0: csk / rho hold every row. */
    const uint16_t *csk_head; /* [n_head][csk_stride] */
    const float *rho_head;    /* [n_head] */
    uint64_t n_head;
    uint32_t csk_stride;
    const float *basis;     /* [rank][latent_dim]; NULL when rank is 0 */
    uint32_t rank;          /* <= csk_stride */
    uint64_t n_closed;
    uint64_t sinks;
    const uint32_t *kept;   /* [m] ascending */
    uint32_t m;
    const float *q;         /* [n_heads][latent_dim + branch_dim], latent first */
    const float *best;      /* [n_heads]: the head's best attended score */
    uint32_t n_heads;
    float scale;            /* s (> 0, finite) */
    float z;                /* finite (conformal); >= √(latent_dim − 64) (sound) */
    int mode;
    uint32_t cap;           /* W */
    uint32_t *fired;        /* [cap] out */
    uint32_t *n_fired;      /* [1] out */
    uint32_t *overflow;     /* [1] out */
    /* The 8-bit scan (params.recall_scan_bits 8; recall/kernels/recall_scan.h): the fp16 word of each
     * sketch row where its 8-bit plane starts (the fp16 part's width, >= rank); 0: the 16-bit
     * scan. */
    uint32_t q8_off;
} kvt__recall_scan_args;

/* Closed row `row`'s sketch and ρ, from whichever piece of the planes holds it. */
KVT_HD const uint16_t *kvt__scan_csk(const kvt__recall_scan_args *a, uint64_t row) {
    return row < a->n_head ? a->csk_head + (size_t)row * a->csk_stride
                           : a->csk + (size_t)(row - a->n_head) * a->csk_stride;
}
KVT_HD const float *kvt__scan_rho(const kvt__recall_scan_args *a, uint64_t row) {
    return row < a->n_head ? a->rho_head + row : a->rho + (row - a->n_head);
}

/* What the recall tier keeps of one (request, layer) between steps, in the backend's memory:
 * the conformal calibration (recall/kernels/conformal_math.h) and the certificate of the last step
 * with its running totals (kvt_layer_stats' recall fields). Only the recall step op writes it; the
 * host zeroes it (z = Z_MAX) at creation and reads it for statistics and snapshots. */
typedef struct kvt__recall_state {
    float z;                 /* the conformal multiplier (Z_MAX until calibrated) */
    uint32_t phase;          /* KVT__CONFORMAL_OPEN / _CALIBRATED / _PROVISIONAL */
    uint32_t cal_steps;      /* calibration steps seen */
    uint32_t n_samples;      /* samples recorded (sorted ascending in the sample array) */
    uint32_t k;              /* the order statistic z came from (0 until calibrated) */
    uint32_t clamped;        /* that sample exceeded Z_MAX */
    uint32_t last_dense;     /* the last step attended every row (calibration or overflow) */
    uint32_t last_overflow;  /* the last step's fired rows exceeded the cap */
    uint32_t n_grouped;      /* closed blocks whose pruned-scan groups are built (0 after a
                              * restore or without group planes: built at the next step) */
    uint32_t reserved0;      /* 0 */
    uint64_t last_archived;  /* archived rows at the last step */
    uint64_t last_visited;   /* archived rows the last step's scan evaluated */
    uint64_t last_fired;     /* rows the last step's trigger fired (at most cap + 1 counted) */
    uint64_t last_fetched;   /* archived rows the last step attended (fired, or all when dense) */
    uint64_t steps;          /* steps the recall step ran on (single-query steps) */
    uint64_t calib_steps;    /* of which calibration steps (dense) */
    uint64_t overflow_steps; /* of which overflowed to dense */
    uint64_t visited, fired, fetched; /* sums of the last_* over the steps */
} kvt__recall_state;

/* Recall promotion of one (request, layer) (docs/recall.md §4.2), in the backend's memory after
 * the trigger state: this header, then cand_row [cand_cap], cand_hist [cand_cap], prom_row
 * [prom_cap], prom_hist [prom_cap] (u32). A history's bit k says the row hit k steps ago (bit 0:
 * the last step), masked to the window. Candidates: archived rows that fired in the window,
 * ascending; promoted rows: ascending, disjoint from the sinks, the kept set and the candidates.
 * Only the recall step op writes it. */
typedef struct kvt__recall_promo {
    uint32_t n_prom;      /* promoted rows now */
    uint32_t n_cand;      /* candidates now */
    uint32_t last_closed; /* closed rows at the last step (a change: a block closed since) */
    uint32_t last_promoted; /* promoted rows the last step attended (the certificate's) */
    uint64_t promotions, demotions, absorbed; /* totals */
} kvt__recall_promo;

/* One recall step of one (request, layer) (recall/kernels/recall_step.h): the archive view and the
 * queries in scan (scan.best, scan.z and the outputs point into the request's recall buffer; the
 * op sets best and z), the attended tail [scan.n_closed, n_rows), the state, and the step's
 * dense flag for the emission. Every pointer but scan.pdiv is in the backend's memory. */
typedef struct kvt__recall_step_args {
    kvt__recall_scan_args scan;
    uint64_t n_rows;         /* rows in the table, the step's included */
    int mode;                /* KVT__RECALL_CONFORMAL / SOUND / MARGIN */
    float margin;            /* δ of the margin mode (score units, >= 0) */
    kvt__recall_state *st;
    float *samples;          /* [sample_cap]: the calibration's samples, sorted */
    uint32_t sample_cap;
    uint8_t *dense;          /* [1] out, or NULL: 1 when the step attends every row */
    /* The pruned scan's group planes (recall/kernels/recall_group.h), for g_blocks_cap closed
     * blocks of block_rows rows, centres of g_dim floats; g_perm NULL: the full scan. The op builds
     * the groups of the blocks kvt__recall_groups_want names past the state's n_grouped (all but
     * the newest KVT__RECALL_GROUP_LAG at once, those one a step), then scans pruned (the same
     * fired rows as the full scan); the margin mode always scans in full. */
    uint32_t *g_perm, *g_n, *g_end;
    float *g_centre, *g_stat;
    uint64_t g_blocks_cap;
    uint32_t block_rows, g_dim;
    /* Promotion (kvt__recall_promo; promo NULL: off, nothing below is read). The fetch buffer
     * scan.fired holds scan.cap + prom_cap rows: a step that does not attend every row emits the
     * promoted rows merged into its fetched ones. prom_room <= prom_cap: the most rows promoted
     * at once (what the last close reserved), hits of window (1 <= hits <= window <= 32). */
    kvt__recall_promo *promo;
    uint32_t cand_cap, prom_cap, prom_room, hits, window;
} kvt__recall_step_args;

/* A recall step's work item, in a batch's plan image (lib/batch_plan.c): the step's arguments,
 * except that the queries are an offset from the op's query base (the engine's buffer: the
 * launch's argument, the same at every replay of a captured step) and the page-row divider is held
 * by value (a.scan.pdiv and a.scan.q are not read). */
typedef struct kvt__recall_plan_item {
    kvt__recall_step_args a;
    kvt__div32 div;
    uint64_t q_off; /* floats from kvt__recall_plan_args.query to this item's queries */
    /* The lagged query (config.recall_lagged_query): lag, the request's buffer of the previous
     * step's queries (NULL: none); lag_use 1: the step scans with lag's queries instead of its
     * own. After the step the op copies the step's own queries into lag (the next step's). */
    float *lag;
    uint32_t lag_use;
} kvt__recall_plan_item;

/* The recall step of one layer (kvt__backend_ops.recall_step): its work items
 * and their count are in the backend's memory, written before the op runs and read only when it
 * runs, so the op's arguments hold nothing of one step and a captured op replays over later
 * steps. bound: a shape every item lies within (kvt__recall_plan_fits: heads, rank, latent,
 * closed and kept rows, samples, promotion tables), from the context's stated limits, by which
 * a device sizes its launch and workspace once. */
typedef struct kvt__recall_plan_args {
    const kvt__recall_plan_item *items; /* [n_max] */
    const uint32_t *n;                  /* [1]: items this step (<= n_max) */
    uint32_t n_max;
    const float *query;                 /* the queries' base (backend memory) */
    size_t query_floats;                /* floats from query on that the items may read */
    kvt__recall_step_args bound;        /* host value */
} kvt__recall_plan_args;

/* An attended set as a policy describes it, in row indices of the group's table, ascending:
 * rows [0, lo_end), then list[0 .. n_list) (ascending, each in [lo_end, hi_begin)), then rows
 * [hi_begin, hi_end). O(1) to build on the host whatever the set's size: the rows themselves are
 * only written by the backend's pack. */
typedef struct kvt__attended_desc {
    uint64_t lo_end;
    const uint32_t *list;
    uint64_t n_list;
    uint64_t hi_begin, hi_end;
} kvt__attended_desc;

KVT_HD uint64_t kvt__attended_desc_count(const kvt__attended_desc *d) {
    return d->lo_end + d->n_list + (d->hi_end - d->hi_begin);
}

/* A set of whole pages of pd->d rows (KVT_EMIT_PAGED; lib/batch_plan.c puts a set in this form
 * or refuses it): rows [0, lo_end) and [hi_begin, hi_end), lo_end and hi_begin multiples of the
 * page size, lo_end <= hi_begin, no list. Its pages, in order: table pages [0, lo_end / d), then
 * [hi_begin / d, ceil(hi_end / d)); kvt__paged_page gives the table page of the j-th. */
KVT_HD uint64_t kvt__paged_count(const kvt__attended_desc *d, const kvt__div32 *pd) {
    const uint64_t lo = kvt__div32_q(pd, (uint32_t)d->lo_end);
    return d->hi_end > d->hi_begin ? lo + kvt__div32_q(pd, (uint32_t)(d->hi_end - 1u)) + 1u -
                                         kvt__div32_q(pd, (uint32_t)d->hi_begin)
                                   : lo;
}
KVT_HD uint64_t kvt__paged_page(const kvt__attended_desc *d, const kvt__div32 *pd, uint64_t j) {
    const uint64_t lo = kvt__div32_q(pd, (uint32_t)d->lo_end);
    return j < lo ? j : kvt__div32_q(pd, (uint32_t)d->hi_begin) + (j - lo);
}
/* The rows of its last page (FlashInfer's last_page_len): 1 .. d, 0 for an empty set. */
KVT_HD int32_t kvt__paged_last_len(const kvt__attended_desc *d, const kvt__div32 *pd) {
    if (d->hi_end > d->hi_begin)
        return (int32_t)kvt__div32_r(pd, (uint32_t)(d->hi_end - 1u)) + 1;
    return d->lo_end ? (int32_t)pd->d : 0;
}

/* One query's attended set to pack into an emission: its description, the request's page table
 * of the layer's group (pages[k] holds row indices (first_page + k) * page_rows onwards), and
 * where its slots go: indices[out + j], j < count; then -1 up to pad (TOKENS' topk; CSR: none),
 * and count into lengths[len_at] (TOKENS) or out + count into indptr[len_at] (CSR, whose
 * indptr[0] = 0 the caller's first chunk asks for with first_csr). */
typedef struct kvt__pack_query {
    kvt__attended_desc d;
    /* Recall (all NULL without): rows fetched this step, ascending, in (lo_end, hi_begin) and
     * not in d.list: fetch[0 .. *n_fetch), merged into the list; *dense != 0: the query attends
     * every row [0, d.hi_end) instead. In the backend's memory: the host knows neither count
     * (CSR offsets follow from the counts on the backend). */
    const uint32_t *fetch;
    const uint32_t *n_fetch;
    const uint32_t *dense;
    uint32_t fetch_cap;     /* fetch's length (W): what the guarded backend checks */
    bool all_rows;          /* attend every row [0, d.hi_end) (decided on the host) */
    bool count_only;        /* a list another op writes (a planned RoPE recall's): its count
                             * goes to lengths / indptr, so the lists after it start after it,
                             * and no index is written */
    bool paged;             /* KVT_EMIT_PAGED: d is whole pages (kvt__paged_count's form; no
                             * recall fields): page ids go to indices, their count to indptr,
                             * the last page's rows to last_page_len[len_at - 1] */
    const int32_t *pages;   /* the host's page table today: a device pack needs it mirrored in
                             * device memory (the CUDA issue) */
    uint64_t first_page;
    uint64_t out;
    uint64_t pad;
    uint64_t len_at;        /* KVT__NO_LENGTH: a TOKENS query whose count goes nowhere (an
                             * earlier token of a request whose lengths are per request) */
} kvt__pack_query;
#define KVT__NO_LENGTH UINT64_MAX

typedef struct kvt__pack_args {
    /* The queries and their count, in the backend's memory (a batch's plan image,
     * lib/batch_plan.c), written before the op runs and read only when it runs, so that the op's
     * arguments hold nothing of one step and a captured op replays over later steps. At most
     * n_max queries (the launch's size). Recall fields are read when the op runs (the recall
     * step's output); CSR offsets follow from the counts of the queries before (query i's at
     * indptr[i]: len_at must be i + 1). */
    const kvt__pack_query *q_plan;
    const uint32_t *n_plan;  /* [1] */
    uint32_t n_max;
    uint8_t *dense_out;      /* query i's dense flag (1: it attends every row) into
                              * dense_out[i / dense_stride] (NULL: none) */
    uint32_t dense_stride;   /* queries a request (CSR_KV_HEADS: its KV heads'); 0: 1 */
    const kvt__div32 *pdiv; /* page_rows */
    bool csr;
    bool first_csr;         /* write indptr[0] = 0 */
    uint64_t capacity;      /* entries of indices (the guarded backend checks writes against it) */
    int32_t *indices;       /* emission arrays: in the backend's memory space */
    int32_t *lengths;       /* TOKENS */
    int32_t *indptr;        /* CSR (and PAGED) */
    int32_t *last_page_len; /* PAGED: one a query (its paged queries write it) */
} kvt__pack_args;

/* The selection of a salience close, on the backend's memory: σ of the fresh rows
 * [first_new, n_closed) of the score plane is canonicalised (NaN/Inf -> +Inf, counted), then the
 * top-m of all n_closed scores by kvt__score_key (ties to the lower position) is written
 * ascending into kept. Two counters come back to the host: the close's one synchronisation (a
 * step with a close runs eagerly; steps without one never call this). On failure (scratch) the
 * kept set is untouched. */
typedef struct kvt__select_args {
    float *score;            /* backend: [n_closed - n_head], rows n_head on (score[0] is row
                              * n_head's) */
    /* Rows [0, n_head) in a score plane shared with other requests (prefix sharing): read, never
     * written (their scores are canonical since their own close; a non-finite one among the
     * fresh rows is counted, not rewritten). n_head 0: score holds every row. */
    const float *score_head; /* backend: [n_head] */
    uint64_t n_head;
    uint64_t first_new;
    uint64_t n_closed;
    uint32_t m;
    uint64_t sinks;          /* S: how many kept rows lie below it is reported */
    uint32_t *kept;          /* backend: [m] out */
    uint64_t nonfinite;      /* out (host) */
    uint64_t kept_in_sinks;  /* out (host) */
} kvt__select_args;

/* Closed row u's score, from whichever piece of the plane holds it. */
KVT_HD float kvt__select_score(const kvt__select_args *a, uint64_t u) {
    return u < a->n_head ? a->score_head[u] : a->score[u - a->n_head];
}

/* Reference MLA decode attention (kernels/attn.h: absorbed form, the key the row's first
 * key_dim values, the value its first value_dim) for n_q queries over index sets in the
 * backend's memory, as kvt_batch_run emits them in the TOKENS layout: query i attends the slots
 * idx[i * topk + j], j < len[i] (a slot's row at base + slot · slot_stride + row_offset). The
 * tests' and benchmarks' ruler on every backend: the CPU twin is kvt__attn_cpu in its fixed
 * order, the CUDA one splits the rows of each (query, head) into chunks merged in order (double
 * accumulation; agrees to a relative ~1e-12, not bit for bit). Out: out [n_q][n_heads]
 * [value_dim], lse [n_q][n_heads] (NULL: not written). An empty set gives out 0, lse −Inf; a
 * NaN in a row or query makes that head's outputs NaN. */
typedef struct kvt__attend_args {
    const uint8_t *base;
    size_t slot_stride, row_offset;
    int dtype;               /* bf16 / fp16 / fp32, or fp8 ds_mla rows (key_dim <= 576) */
    uint32_t key_dim;        /* <= KVT__ATTN_MAX_DIM */
    uint32_t value_dim;      /* <= key_dim */
    const int32_t *idx;      /* [n_q][topk] */
    const int32_t *len;      /* [n_q], each in [0, topk] */
    uint32_t topk;
    uint32_t n_q;
    const float *q;          /* [n_q][n_heads][q_stride] */
    uint32_t n_heads;
    uint32_t q_stride;       /* floats between heads (>= key_dim) */
    double scale;
    float *out;
    double *lse;
} kvt__attend_args;

/* The attention's argument rules every backend applies on the host. */
KVT_HD int kvt__attend_args_ok(const kvt__attend_args *a) {
    return a->key_dim > 0 && a->key_dim <= KVT__ATTN_MAX_DIM && a->value_dim <= a->key_dim &&
           a->q_stride >= a->key_dim && (a->n_q == 0 || (a->q && a->idx && a->len && a->base)) &&
           kvt__attn_dtype_ok(a->dtype, a->key_dim) && a->slot_stride > 0 && a->n_heads > 0 &&
           a->n_heads <= 1024u;
}

/* The largest work a batch's decode steps give the ops that take a backend workspace (a round;
 * the recall steps' is recall_plan_reserve's), from the context's stated limits
 * (max_rows_per_seq): kvt__backend_ops.reserve sizes the workspace for it when the batch is
 * created, so that no decode step grows it (a device workspace grows by synchronising and
 * allocating). */
typedef struct kvt__ws_bounds {
    uint32_t max_items;            /* requests of a step */
    kvt__ev_args round;            /* the largest round layer (N, K, r, n_heads, n_planes,
                                    * slot_bytes; no pointer read); n_heads 0: none */
    uint32_t round_layers;         /* layers one round call takes at most */
} kvt__ws_bounds;

typedef struct kvt__backend_ops {
    const char *name;
    /* Release the handle: its workspace and, for a handle that opened the backend, the
     * backend's own state (protection keys, device buffers); the buffers the library allocated
     * through it are freed before. Safe on a handle whose open failed (impl NULL). */
    void (*close)(kvt__backend *be);
    /* (optional) A second handle on parent with a workspace of its own into *out (σ scratch of
     * sigma_floats and top-m scratch of topm_u32 where the backend sizes them up front; a
     * device workspace grows through reserve): each batch runs its ops and commits through one,
     * so that two batches never share scratch (kvtier.h, "Threads"). Closed with close.
     * KVT_ERR_OUT_OF_MEMORY. NULL where the batches share the context's handle (the guarded
     * backend keeps its protection state there): one thread at a time on such a context. */
    kvt_status (*workspace)(const kvt__backend *parent, size_t sigma_floats, size_t topm_u32,
                            kvt__backend *out);
    /* (optional) Size this handle's host scratch for σ of sigma_floats and top-m of topm_u32
     * (grow only): the CPU backends, whose handles lib/context.c sizes from max_rows_per_seq
     * so that no step allocates. KVT_ERR_OUT_OF_MEMORY. NULL: the backend's scratch is its
     * device workspace (reserve). */
    kvt_status (*scratch_reserve)(kvt__backend *be, size_t sigma_floats, size_t topm_u32);
    /* Buffers in the backend's memory space (ggml-backend's rule: host code reaches a buffer's
     * bytes only through write/read). The row pool's planes live in them. alloc: zeroed bytes;
     * KVT_ERR_OUT_OF_MEMORY. free: bytes as allocated; NULL is a no-op. */
    kvt_status (*buf_alloc)(const kvt__backend *be, size_t bytes, void **out);
    void (*buf_free)(const kvt__backend *be, void *p, size_t bytes);
    /* Pinned host memory the backend's ops may read and write, as they do their buffers (a GPU
     * over the bus: cudaHostAlloc, mapped; the CPU backends: host pages, which the guarded
     * backend leaves open and its ops accept), and host code directly: the host-resident archive
     * (kvt_ctx_params.archive_space). alloc: zeroed bytes; KVT_ERR_OUT_OF_MEMORY. free: bytes as
     * allocated; NULL is a no-op. read/write/copy take these as they take buffers. */
    kvt_status (*host_alloc)(const kvt__backend *be, size_t bytes, void **out);
    void (*host_free)(const kvt__backend *be, void *p, size_t bytes);
    /* Copy bytes from host memory into a buffer (write) or out of one (read), on the stream. */
    kvt_status (*write)(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                        void *stream);
    kvt_status (*read)(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                       void *stream);
    /* Copy bytes between two buffers of the backend (regions may not overlap), on the stream. */
    kvt_status (*copy)(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                       void *stream);
    /* Copy n rows of `width` bytes, row i from src + i·src_stride to dst + i·dst_stride (a 2-D
     * copy; regions may not overlap), on the stream: dst a buffer, src a buffer or pinned host
     * memory (the host archive's rotated branches into their device plane). */
    kvt_status (*copy_rows)(const kvt__backend *be, void *dst, size_t dst_stride, const void *src,
                            size_t src_stride, size_t width, uint64_t n, void *stream);
    /* true when host code may dereference buffer pointers (engine-owned host storage can then be
     * bound with kvt_layer_bind). */
    bool host_visible;
    /* Salience scores of n blocks (every block closing in a step, across its requests). */
    kvt_status (*score_rows)(const kvt__backend *be, const kvt__score_args *a, uint32_t n,
                             void *stream);
    /* Recall sketches of n blocks (every block closing in a step, across its requests), next to
     * score_rows: csk and ρ of each row (kvt__sketch_args). */
    kvt_status (*sketch_rows)(const kvt__backend *be, const kvt__sketch_args *a, uint32_t n,
                              void *stream);
    /* Recall scans of n (request, layer) work items (kvt__recall_scan_args). Optional, like
     * sketch_rows: NULL in a backend without the recall ops (the CPU, guarded and CUDA backends
     * have both); the library then refuses recall (KVT_ERR_UNSUPPORTED).
     * KVT_ERR_INVALID_ARGUMENT for arguments out of their ranges. */
    kvt_status (*recall_scan)(const kvt__backend *be, const kvt__recall_scan_args *a, uint32_t n,
                              void *stream);
    /* The recall steps of a layer's work items (kvt__recall_plan_args: the items and their
     * count in the backend's memory, read when the op runs, so a captured op replays over later
     * steps; each item a kvt__recall_step_args with scan.q = query + q_off and scan.pdiv = &div):
     * each head's best attended score, then a calibration step (exact scores of the archived
     * rows, samples, z at a window end; the step is dense) or the scan with the request's z, its
     * fired rows, overflow and the step's certificate in the state; with group planes the groups
     * of newly closed blocks built and the pruned scan where kvt__recall_prune_pays says (every
     * backend: the same planes and state); a lagged query's buffer then holds the step's own
     * queries. Items past *n, or *n above n_max, run nothing; the CPU backends answer
     * KVT_ERR_INVALID_ARGUMENT when an item breaks the argument rules or its bound (nothing
     * run), the CUDA backend, which cannot read them on the host, makes that item's step dense
     * (every row attended: never a wrong set). Optional: NULL where the backend has none (the
     * CPU, guarded and CUDA backends have it); the library then refuses recall modes.
     * recall_plan_reserve (optional): make room for the op outside a capture (the CUDA
     * workspace), so that its capture allocates nothing. */
    kvt_status (*recall_step)(const kvt__backend *be, const kvt__recall_plan_args *a,
                              void *stream);
    kvt_status (*recall_plan_reserve)(const kvt__backend *be, const kvt__recall_plan_args *a);
    /* (optional) Size the handle's workspace for every op of a step within b (grow only):
     * KVT_ERR_OUT_OF_MEMORY. The CUDA backend has it (its workspace otherwise grows inside an
     * op, stream-ordered, when a larger step than any before arrives); the CPU backends size
     * theirs at context creation (lib/context.c). */
    kvt_status (*reserve)(const kvt__backend *be, const kvt__ws_bounds *b);
    /* Whether recall_step serves promotion (args.promo non-NULL): every backend's does (the
     * CPU, guarded and CUDA ones, over recall/kernels/recall_promo.h); one without it has the
     * library refuse config.recall_promote_capacity > 0, naming it. */
    bool recall_promote;
    /* Whether sketch_rows writes and recall_scan / recall_step read the 8-bit planes (args.q8_off
     * > 0; recall/kernels/recall_scan.h): the CPU, guarded and CUDA backends' do; one without
     * has the library refuse params.recall_scan_bits 8 (KVT_ERR_UNSUPPORTED, naming it). */
    bool recall_scan_q8;
    /* Write the slots of a.n attended sets into the emission arrays (kvt__pack_args): the host
     * describes each set in O(1); the rows are expanded here, page by page (one division per
     * range, not per row). The arrays live in the backend's memory space. */
    kvt_status (*pack)(const kvt__backend *be, const kvt__pack_args *a, void *stream);
    /* A random-eviction round (kernels/evict.h), for n layers at once: ev_select chooses every
     * head's keep set (draws, VaSE's value range, top-K; nothing but the keep sets changes, so a
     * failure — scratch — leaves the round undone), ev_apply archives or drops, compacts
     * slot-major, rewrites positions and slot maps. ev_append records new rows' positions (n
     * layers or requests at once). */
    kvt_status (*ev_select)(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                            void *stream);
    kvt_status (*ev_apply)(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                           void *stream);
    kvt_status (*ev_append)(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                            void *stream);
    /* Look a position up in a sorted array of the backend (kvt__find_pos) into *out, on the
     * host: synchronising, for inspection calls only. */
    kvt_status (*find_pos)(const kvt__backend *be, const int64_t *sorted, const uint64_t *perm,
                           uint64_t n, uint64_t key, int64_t *out);
    /* The selections of n salience closes (kvt__select_args; a segmented top-m: one segment per
     * request). A failure (scratch) leaves every kept set untouched. */
    kvt_status (*select)(const kvt__backend *be, kvt__select_args *a, uint32_t n, void *stream);
    /* (optional) A RoPE layer's trigger (recall_rope_step) and emission (recall_rope_emit) of
     * its recalling requests (kvt__recall_rope_plan_args, recall/kernels/rope_trigger.h: the items
     * and their counts in the backend's memory, read when the op runs): per KV head the scan of its
     * archive with its query heads, or a calibration step (the trigger's queries at query +
     * q_off); then fetched archive rows copied into each request's fetch slots, and per KV head
     * a list of the table's rows then the fetched ones. *n (*n_emit) above n_max runs nothing;
     * the CPU backends answer KVT_ERR_INVALID_ARGUMENT (nothing run) when an item breaks the
     * rules or the bound; the CUDA ones make such a trigger item's step dense and skip such an
     * emission item. NULL where the backend has none: the library then refuses recall on RoPE
     * layers. */
    kvt_status (*recall_rope_step)(const kvt__backend *be,
                                   const struct kvt__recall_rope_plan_args *a, void *stream);
    kvt_status (*recall_rope_emit)(const kvt__backend *be,
                                   const struct kvt__recall_rope_plan_args *a, void *stream);
    /* (optional) Room for recall_rope_step over a (its bound and n_max), made outside a
     * capture (the CUDA op's workspace may not grow in one). */
    kvt_status (*recall_rope_plan_reserve)(const kvt__backend *be,
                                           const struct kvt__recall_rope_plan_args *a);
    /* (optional) The reference attention over emitted index sets (kvt__attend_args), for tests
     * and benchmarks. KVT_ERR_INVALID_ARGUMENT (nothing written) when kvt__attend_args_ok is
     * false, and on the CPU backends for a length outside [0, topk] or a negative listed slot
     * (the CUDA backend cannot read device-resident lengths and slots on the host: such a
     * query's outputs come out NaN); KVT_ERR_OUT_OF_MEMORY (scratch). */
    kvt_status (*attend)(const kvt__backend *be, const kvt__attend_args *a, void *stream);
    /* (optional) The calling thread's last error the device runtime reported to this backend
     * since the previous call ("cudaErrorMemoryAllocation: out of memory"), then forgotten; NULL
     * when there is none. The library appends it to the message of a failed call. */
    const char *(*last_error)(const kvt__backend *be);
    /* (optional) Stream capture, CUDA graphs' way: after capture_begin the ops enqueued on the
     * stream are recorded, not run, until capture_end makes the record a graph that
     * graph_launch runs on a stream as often as wanted (graph_free: NULL is a no-op). CUDA:
     * cudaStreamBeginCapture (thread-local mode), cudaStreamEndCapture and cudaGraphInstantiate,
     * cudaGraphLaunch. The CPU backends record only the planned ops (the pack with
     * pack, recall_step and the RoPE ones), whose arguments hold nothing of one step; any
     * other op during a capture, which would
     * replay with its step's host-built arguments, answers KVT_ERR_BAD_STATE and so does
     * capture_end after it (the record is dropped). One capture at a time per handle.
     * KVT_ERR_BAD_STATE (capture_begin during a capture, capture_end outside one),
     * KVT_ERR_OUT_OF_MEMORY, or the CUDA error. */
    kvt_status (*capture_begin)(kvt__backend *be, void *stream);
    kvt_status (*capture_end)(kvt__backend *be, void *stream, void **graph);
    kvt_status (*graph_launch)(const kvt__backend *be, void *graph, void *stream);
    void (*graph_free)(const kvt__backend *be, void *graph);
    /* (optional) Whether [p, p + bytes) lies inside one of the backend's buffers, the only
     * memory its ops take as theirs: the guarded backend, which knows its buffers. NULL where
     * the backend does not tell (the CPU backend's memory is the host's). lib/batch.c asks it of
     * the arrays an engine hands kvt_batch_run and kvt_batch_plan_device before any work, so that
     * a host array there is the caller's error (KVT_ERR_INVALID_ARGUMENT naming the argument),
     * not an op's refusal (KVT_ERR_INVARIANT, kept for the library's own pointers). */
    bool (*holds)(const kvt__backend *be, const void *p, size_t bytes);
} kvt__backend_ops;

/* A capture in progress on a CPU backend handle (kernels/capture_cpu.c). */
typedef struct kvt__capture kvt__capture;

struct kvt__backend {
    const kvt__backend_ops *ops;
    const kvt__alloc *alloc; /* host scratch */
    void *impl;              /* backend's own state (CUDA: device buffers) */
    kvt__capture *cap;       /* CPU backends: the capture in progress (NULL: ops run) */
};

/* CPU backend: always available. */
const kvt__backend_ops *kvt__backend_cpu_ops(void);
/* The guarded-device backend: the CPU backend whose buffers the host cannot touch outside the
 * backend's own ops (memory protection keys where the CPU and kernel offer them, else a
 * serialised mprotect, which always works). KVT_ERR_OUT_OF_MEMORY with the reason in err. */
kvt_status kvt__backend_guarded_open(kvt__backend *be, char *err, size_t err_len);
bool kvt__backend_is_guarded(const kvt__backend *be);
/* The guarded backend's count of calls of its batched ops (each a launch, or a launch sequence,
 * on a device backend) and of the work items they took: the host-side proof that the library
 * makes one call per layer for all requests of a batch (DESIGN §3). */
typedef struct kvt__guarded_calls {
    uint64_t pack, recall_step, rope_step, rope_emit;          /* calls */
    uint64_t recall_step_items, rope_step_items, rope_emit_items; /* work items they took */
} kvt__guarded_calls;
/* false for any other backend. */
bool kvt__backend_guarded_calls(const kvt__backend *be, kvt__guarded_calls *out);
/* Open the CPU backend with a workspace (be->alloc set by the caller): ops, and impl = the
 * workspace. KVT_ERR_OUT_OF_MEMORY. Close frees it (NULL impl: nothing). */
kvt_status kvt__backend_cpu_open(kvt__backend *be);
void kvt__backend_cpu_close(kvt__backend *be);
/* Floats of workspace a sketch of n_rows rows of a latent of latent_dim values takes (its slots
 * and kvt__sketch_scratch_floats), for sizing kvt__backend_cpu_reserve's sigma_floats. */
size_t kvt__backend_sketch_floats(uint32_t n_rows, uint32_t latent_dim);
/* Size the workspace for σ scratch of sigma_floats and top-m scratch of topm_u32 (grow only; a
 * backend without a workspace: nothing). */
kvt_status kvt__backend_cpu_reserve(kvt__backend *be, size_t sigma_floats, size_t topm_u32);
/* A second handle on the CPU backend `parent` with a workspace of its own, sized as
 * kvt__backend_cpu_reserve: ops and allocator are parent's. Each batch runs its ops through one,
 * so that two batches' runs and commits never share scratch (kvtier.h, "Threads").
 * KVT_ERR_UNSUPPORTED for any other backend (the guarded backend keeps its protection state in
 * the same impl: its batches share the context's handle); KVT_ERR_OUT_OF_MEMORY. Close it with
 * kvt__backend_cpu_close. */
kvt_status kvt__backend_cpu_workspace(const kvt__backend *parent, size_t sigma_floats,
                                      size_t topm_u32, kvt__backend *out);
/* CUDA backend: KVT_ERR_NO_DEVICE with the reason in err when built without CUDA or when no
 * device is usable. */
kvt_status kvt__backend_cuda_open(kvt__backend *be, char *err, size_t err_len);
void kvt__backend_cuda_close(kvt__backend *be);
/* A second handle on the CUDA backend `parent` with a device workspace of its own (each batch
 * runs through one: two batches' ops on two streams share no scratch). KVT_ERR_UNSUPPORTED for
 * any other backend; KVT_ERR_OUT_OF_MEMORY. Close it with kvt__backend_cuda_close. */
kvt_status kvt__backend_cuda_workspace(const kvt__backend *parent, kvt__backend *out);

#endif
