/*
 * kvtier.h — the public C API of kvtier.
 *
 * kvtier manages the attention KV cache of long requests for an inference engine. Each attention
 * layer's cache is split into an attended tier (the rows attention reads every step) and an
 * archive (rows taken out of the attended tier, kept exactly, never deleted). The policy per layer
 * follows from its kind:
 *
 *   MLA-NoPE            -> salience tiering (sigma of the 64-dim decoupled branch, global top-m)
 *   MLA-RoPE, GQA-*     -> random eviction with the prompt protected (rows dropped, or archived)
 *   sliding, no-KV      -> none (all stored rows attended; no-KV layers store nothing)
 *
 * Sliding-window layers attend their last sliding_window rows. When every layer of a none group
 * is a sliding layer, pages whose rows are all older than the group's widest window go back to
 * the pool after each commit, so the cache of a request stays capped near the window.
 *
 * This header is the documentation: every function states ownership, units, what NULL does and
 * the statuses it returns.
 *
 * Threads: which calls may run at once is stated in the "Threads" section below.
 *
 * Storage contract (vLLM's convention): each layer has arrays of rows ("planes": 1 for MLA, one
 * latent row per token; 2 for GQA, K then V), each laid out [page][row][kv_head][row_bytes].
 * Layers under the same policy form a group; each sequence has one page table per group, and a
 * token's slot in every layer of the group is page * page_rows + offset (any page size: the
 * division is by a precomputed inverse). A step (see "Batches" below) reserves slots for the new
 * tokens of a batch of requests in all layers at once (kvt_batch_reserve; vLLM's slot_mapping),
 * the engine writes the rows (its cache-write kernel into kvt_layer_data, or kvt_seq_write),
 * each layer's run does its policy work and emits the attended set, and the commit completes the
 * step. A row's slot is stable until an eviction round on its group compacts it.
 */
#ifndef KVTIER_H
#define KVTIER_H

/* =============================================================================================
 * Threads
 *
 * kvtier starts no threads and takes no locks. What may run at once follows from what each call
 * writes, and is this (the CPU backend; KVT_BACKEND_GUARDED is restricted further, below):
 *
 * 1. Across contexts: nothing. A context (kvt_ctx and every request and batch created from it)
 *    shares no mutable state with another; any number of threads may each drive contexts of
 *    their own. The library keeps no process-wide mutable state.
 *
 * 2. Within one context, calls have two roles, the scheduler's and the runner's:
 *
 *    scheduler  kvt_seq_create, kvt_seq_destroy, kvt_seq_set_prompt_rows, kvt_batch_create,
 *               kvt_batch_destroy, kvt_batch_reserve, kvt_batch_plan, kvt_batch_commit,
 *               kvt_layer_bind, kvt_layer_read, kvt_layer_write, kvt_ctx_free_pages,
 *               kvt_ctx_memory_stats, kvt_seq_fork, kvt_seq_attach,
 *               kvt_buffer_alloc, kvt_buffer_free, kvt_buffer_read / _write (_async), and the
 *               inspection calls (kvt_seq_check, kvt_seq_layer_stats, kvt_seq_row_state,
 *               kvt_seq_read_row, kvt_seq_positions, kvt_seq_last_slot_map,
 *               kvt_seq_block_table, kvt_seq_first_row, kvt_seq_pages_needed, kvt_seq_scores),
 *               the snapshot calls (kvt_seq_snapshot*, kvt_seq_restore*), and
 *               kvt_ctx_set_recall_basis / kvt_ctx_load_recall_basis (before any reserve),
 *               kvt_ctx_refit_recall_basis / kvt_ctx_refit_recall_head_basis (between steps)
 *               and kvt_ctx_recall_basis. They own the row
 *               pool's page allocators (reserve takes pages; commit, kvt_seq_destroy and an
 *               abandoned step return them), the context's lists of requests and batches, and
 *               every request between steps. At most one thread at a time in scheduler calls of
 *               a context: one scheduler thread, or a lock of the engine's around them.
 *    runner     kvt_batch_run, and the step's row writes (kvt_seq_write, or the engine's own
 *               writes at the slot_mapping into kvt_layer_data's memory). A run touches only its
 *               batch, the requests of its step (their policy state and the rows in their
 *               pages), and the batch's own backend workspace (σ and top-m scratch: one per
 *               batch); it never takes or returns a page and never walks the context's lists.
 *
 *    A batch, with the requests of its step, is held by one thread at a time: the scheduler
 *    from kvt_batch_reserve to kvt_batch_plan (and kvt_batch_capacity, kvt_batch_slot_mapping),
 *    then a runner for the step's writes and runs (each layer's run from that one thread), then
 *    the scheduler again for kvt_batch_commit. Every call that names the batch or one of its
 *    step's requests (kvt_seq_reserved_slot, kvt_seq_pending, kvt_seq_length included) comes
 *    from its holder. The hand-over (a mutex, a condition variable, a queue) is the engine's,
 *    and it is what orders plan before run and run before commit: kvtier publishes nothing
 *    between threads by itself.
 *
 *    So, on one context, these may overlap:
 *    - a runner's calls on batch A with scheduler calls that name neither A nor a request of
 *      A's step: reserve, plan and commit of another batch, kvt_seq_create / kvt_seq_destroy of
 *      other requests, kvt_seq_check of a request in no step (it reads every request's page
 *      table, which a run never writes), kvt_layer_read / kvt_layer_write of slots outside the
 *      pages of A's requests. A pipelined engine plans step t + 1 on batch B while step t runs
 *      on batch A, and commits A while B runs;
 *    - runners on distinct batches, one thread per batch (the runs of steps t and t + 1).
 *    And these must not: two scheduler calls; two calls on one batch or one request (each
 *    holder's calls, then the next holder's, in the hand-over's order); kvt_ctx_destroy with any other call on the context (it destroys the
 *    batches and requests); kvt_seq_destroy / kvt_batch_destroy with a call on what they destroy.
 *
 * 3. Any thread, any time (pure, or read-only on a context's fixed fields): kvt_strerror,
 *    kvt_status_name, kvt_version, kvt_version_number, the *_default* and *_name functions,
 *    kvt_layer_spec_*, kvt_policy_for_kind, kvt_layer_bytes_per_token, kvt_ctx_model,
 *    kvt_ctx_config, kvt_ctx_layer_policy, kvt_ctx_layer_group, kvt_ctx_backend_name,
 *    kvt_ctx_allocator_name, kvt_layer_data (once bound), kvt_seq_context, kvt_seq_request_id,
 *    kvt_recall_basis_read / kvt_recall_basis_write (files only; distinct paths),
 *    kvt_orthonormalise_rows (on distinct arrays), kvt_ctx_estimate (its probe context is its
 *    own), and
 *    kvt_ctx_host_allocations (a relaxed atomic count; exact once the threads that allocate
 *    are joined). A kvt_model is only read after kvt_model_create: the const kvt_model_* calls
 *    and kvt_ctx_create may use one model from many threads at once (a context copies it);
 *    kvt_model_destroy must not overlap them.
 *
 * 4. kvt_last_error is per thread: it holds the detail of the calling thread's last failing
 *    call, whatever other threads call meanwhile (a runner reads its run's message, never the
 *    scheduler's).
 *
 * 5. KVT_BACKEND_GUARDED keeps one protection state per context (its open/close depth; in its
 *    mprotect fallback, protections that are process-wide), and its batches share the context's
 *    workspace: a guarded context is used by one thread at a time, all roles together. The
 *    trace and reference APIs (kvtier_trace.h, kvtier_ref.h) state their own rules.
 *
 * tests/test_threads.c checks this model under ThreadSanitizer (test.sh, build-test-tsan).
 * ========================================================================================== */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define KVT_API
#elif defined(KVT_BUILDING_LIBRARY)
#define KVT_API __attribute__((visibility("default")))
#else
#define KVT_API
#endif

#define KVT_VERSION_MAJOR 0
#define KVT_VERSION_MINOR 2
#define KVT_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, for #if tests against the header an engine compiled with;
 * kvt_version_number() gives the library's at run time. */
#define KVT_VERSION_NUMBER (KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH)

/* ABI rule for the versioned structs (kvt_config, kvt_ctx_params, kvt_seq_params,
 * kvt_layer_stats): each begins with struct_size, set by its default function to the sizeof the
 * caller compiled with. Structs only grow at the end. An input struct is accepted with any
 * struct_size from its KVT_*_SIZE_MIN (the oldest layout this library reads) up: fields past the
 * caller's struct_size take their defaults, and bytes past this library's own struct (a caller
 * built against a newer kvtier) must be zero — KVT_ERR_UNSUPPORTED names the struct otherwise;
 * below KVT_*_SIZE_MIN is KVT_ERR_INVALID_ARGUMENT. An output struct is written up to
 * min(struct_size, this library's sizeof). So a caller built against an older or newer header
 * keeps working as long as it sets nothing the library does not know. */

/* ---------------------------------------------------------------------------------------------
 * Status codes. One list; KVT_OK = 0, every error negative. Codes only grow at the end.
 * ------------------------------------------------------------------------------------------- */
#define KVT_STATUS_LIST(X)                                                                         \
    X(OK, 0, "success")                                                                            \
    X(ERR_INVALID_ARGUMENT, -1, "invalid argument")                                                \
    X(ERR_OUT_OF_MEMORY, -2, "host memory allocation failed")                                      \
    X(ERR_POOL_EXHAUSTED, -3, "row pool exhausted: not enough free pages")                         \
    X(ERR_CAPACITY, -4, "caller buffer too small")                                                 \
    X(ERR_UNSUPPORTED, -5, "operation not supported")                                              \
    X(ERR_NO_DEVICE, -6, "CUDA backend unavailable (built without CUDA, or no device)")            \
    X(ERR_PARSE, -7, "malformed input")                                                            \
    X(ERR_IO, -8, "I/O error")                                                                     \
    X(ERR_OUT_OF_RANGE, -9, "index out of range")                                                  \
    X(ERR_BAD_STATE, -10, "call not valid in the current state")                                   \
    X(ERR_POLICY_MISMATCH, -11, "policy does not apply to this layer kind")                        \
    X(ERR_CORRUPT, -12, "data failed its integrity check")                                         \
    X(ERR_INVARIANT, -13, "internal invariant violated")                                           \
    X(ERR_DROPPED, -14, "row was dropped by policy and is not stored")                          \
    X(ERR_ARCHIVE_FULL, -15, "the archive of a request is full (archive_rows_per_seq)")          \
    X(ERR_MISMATCH, -16, "snapshot taken under another model or configuration")

typedef enum kvt_status {
#define KVT__STATUS_ENUM(name, code, text) KVT_##name = code,
    KVT_STATUS_LIST(KVT__STATUS_ENUM)
#undef KVT__STATUS_ENUM
} kvt_status;

/* Static description of a status ("row pool exhausted: ..."). Never NULL. */
KVT_API const char *kvt_strerror(kvt_status s);
/* Symbolic name of a status ("KVT_ERR_POOL_EXHAUSTED"). Never NULL. */
KVT_API const char *kvt_status_name(kvt_status s);
/* "MAJOR.MINOR.PATCH"; *major etc. filled when non-NULL. */
KVT_API const char *kvt_version(int *major, int *minor, int *patch);
/* KVT_VERSION_NUMBER of the library actually loaded. */
KVT_API int kvt_version_number(void);
/* Detail of the last failing kvtier call made by the calling thread: the JSON path that failed,
 * the field that is out of range, the layer and request an eviction round failed on. Like errno,
 * read it right after a call returned a failure status: a successful call clears it only where
 * it starts by doing so (most context, sequence and batch calls), so after a success it may
 * still describe an earlier failure. Thread-local, so threads that use distinct contexts never
 * race on it. Valid until the calling thread's next kvtier call. Never NULL. */
KVT_API const char *kvt_last_error(void);

/* ---------------------------------------------------------------------------------------------
 * Layer description
 * ------------------------------------------------------------------------------------------- */
typedef enum kvt_layer_kind {
    KVT_LAYER_MLA_NOPE = 0, /* MLA, 64-dim branch cached without rotation (Kimi Linear) */
    KVT_LAYER_MLA_ROPE = 1, /* MLA, branch rotated (DeepSeek-V2/V3) */
    KVT_LAYER_GQA_ROPE = 2, /* GQA/MHA with rotary positions (Llama, Qwen3) */
    KVT_LAYER_GQA_NOPE = 3, /* GQA/MHA without positions in the key */
    KVT_LAYER_SLIDING = 4,  /* sliding-window attention, cache capped at the window */
    KVT_LAYER_NO_KV = 5,    /* linear/recurrent layer (KDA, Gated DeltaNet): no per-token KV */
} kvt_layer_kind;

typedef enum kvt_dtype {
    KVT_DTYPE_BF16 = 0,
    KVT_DTYPE_FP16 = 1,
    KVT_DTYPE_FP32 = 2,
    KVT_DTYPE_FP8_E4M3 = 3, /* values only (e.g. FlashMLA's 656-B ds_mla row); never a branch */
} kvt_dtype;

typedef enum kvt_policy {
    KVT_POLICY_NONE = 0,     /* everything stored is attended */
    KVT_POLICY_SALIENCE = 1, /* NoPE MLA: sigma top-m + sinks + tail; the rest archived */
    KVT_POLICY_EVICT = 2,    /* RoPE / GQA: random eviction, prompt protected */
} kvt_policy;

/* One layer's cache geometry. A "row" is one (token, KV head) slice of one plane. */
typedef struct kvt_layer_spec {
    kvt_layer_kind kind;
    kvt_dtype dtype;          /* element type of the stored values */
    uint32_t n_kv_heads;      /* MLA: 1 (one latent head shared by all query heads) */
    uint32_t n_planes;        /* 1 for MLA (key = whole row, value = first value_dim); 2 for GQA */
    uint32_t head_dim;        /* values per row; MLA: kv_lora_rank + qk_rope_head_dim = 576 */
    uint32_t value_dim;       /* MLA: kv_lora_rank = 512; GQA: head_dim */
    uint32_t branch_dim;      /* MLA: qk_rope_head_dim = 64; GQA: 0 */
    uint32_t row_bytes;       /* bytes of one row: MLA bf16 1152, ds_mla fp8 656; GQA hd*elt */
    uint32_t branch_offset;   /* byte offset of the branch inside a row: 1024 (bf16), 528 (fp8) */
    kvt_dtype branch_dtype;   /* bf16, fp16 or fp32 */
    uint32_t sliding_window;  /* tokens, for KVT_LAYER_SLIDING; 0 otherwise */
    uint32_t n_q_heads;       /* query heads attending this layer (informational; recall uses it) */
} kvt_layer_spec;

/* Policy kvtier applies to a layer kind. */
KVT_API kvt_policy kvt_policy_for_kind(kvt_layer_kind kind);
KVT_API const char *kvt_layer_kind_name(kvt_layer_kind kind);
KVT_API const char *kvt_policy_name(kvt_policy policy);
KVT_API const char *kvt_dtype_name(kvt_dtype dtype);
/* Bytes of one element of dtype (fp8: 1). 0 for an unknown dtype. */
KVT_API uint32_t kvt_dtype_bytes(kvt_dtype dtype);

/* Fill *out with an MLA row spec: 1 head, 1 plane, kv_lora_rank + rope_dim values of dtype
 * (bf16/fp16/fp32), branch at byte kv_lora_rank * elt. KVT_ERR_INVALID_ARGUMENT on zero dims
 * and on a row over 1 MiB (dimensions are checked in 64 bits: none wraps to a small geometry). */
KVT_API kvt_status kvt_layer_spec_mla(kvt_layer_kind kind, kvt_dtype dtype, uint32_t kv_lora_rank,
                                      uint32_t rope_dim, kvt_layer_spec *out);
/* Fill *out with a GQA/MHA spec: 2 planes (K, V), n_kv_heads rows of head_dim values each.
 * KVT_ERR_INVALID_ARGUMENT on zero dims, more than 1024 KV heads or a row over 1 MiB. */
KVT_API kvt_status kvt_layer_spec_gqa(kvt_layer_kind kind, kvt_dtype dtype, uint32_t n_kv_heads,
                                      uint32_t head_dim, kvt_layer_spec *out);
/* Validate a spec; on error writes a message naming the field into err (may be NULL). */
KVT_API kvt_status kvt_layer_spec_check(const kvt_layer_spec *spec, char *err, size_t err_len);
/* Bytes per token the layer stores: n_planes * n_kv_heads * row_bytes (0 for no-KV). */
KVT_API uint64_t kvt_layer_bytes_per_token(const kvt_layer_spec *spec);

/* ---------------------------------------------------------------------------------------------
 * Model: an ordered list of layer specs, built by hand or read from a Hugging Face config.json.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt_model kvt_model;

/* Copy n_layers specs into a new model. Each spec is checked (kvt_layer_spec_check).
 * Returns KVT_ERR_INVALID_ARGUMENT (naming the layer and field in err) or KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_model_create(const kvt_layer_spec *layers, uint32_t n_layers,
                                    const char *model_type, kvt_model **out, char *err,
                                    size_t err_len);
/* Census: read a config.json. Families: deepseek_v2, deepseek_v3, kimi_linear, qwen3, qwen2,
 * llama, mistral, qwen3_next, gemma3_text (also gemma3 with a nested text_config). dtype is the
 * cache element type. Errors: KVT_ERR_IO (cannot read), KVT_ERR_PARSE (bad JSON, missing key,
 * wrong type, out-of-range value, unknown model_type), with the key named in err;
 * KVT_ERR_OUT_OF_MEMORY. The JSON is parsed by libjansson, whose allocator is one per process:
 * the first census call sets it (json_set_alloc_funcs) to malloc and free behind kvtier's
 * allocation seam, only while jansson still has its default malloc and free, so objects another
 * user of jansson in the process made before or after are freed correctly either way; a process
 * that gave jansson its own allocator keeps it. */
KVT_API kvt_status kvt_model_from_file(const char *path, kvt_dtype dtype, kvt_model **out,
                                       char *err, size_t err_len);
KVT_API kvt_status kvt_model_from_json(const char *json, size_t len, kvt_dtype dtype,
                                       kvt_model **out, char *err, size_t err_len);
/* NULL is a no-op. */
KVT_API void kvt_model_destroy(kvt_model *model);
KVT_API uint32_t kvt_model_n_layers(const kvt_model *model);
/* Pointer into the model, valid until kvt_model_destroy; NULL when i is out of range. */
KVT_API const kvt_layer_spec *kvt_model_layer(const kvt_model *model, uint32_t i);
KVT_API const char *kvt_model_type(const kvt_model *model);
/* Sum over layers with per-token KV of kvt_layer_bytes_per_token. */
KVT_API uint64_t kvt_model_kv_bytes_per_token(const kvt_model *model);

typedef struct kvt_census_totals {
    uint64_t kv_bytes_per_token;    /* uncapped */
    uint64_t dense_bytes;           /* cache bytes at context x concurrency, sliding caps applied */
    uint64_t attended_bytes;        /* bytes attention reads per step after the policies at ratio */
    uint64_t freed_bytes;           /* bytes no longer held in the attended pool (evicted/archived) */
    uint64_t salience_layers, evict_layers, none_layers, no_kv_layers;
} kvt_census_totals;

/* Totals at a context length (tokens), concurrency (requests) and compression ratio (>= 1).
 * Per layer with per-token KV, with S = min(context, sliding_window) on sliding layers and
 * S = context otherwise, and K = context / ratio rounded to nearest (at least 1 when context > 0,
 * at most context), every figure multiplied by bytes_per_token x concurrency:
 *   dense_bytes     S                      (what the cache holds with no policy)
 *   attended_bytes  salience: K rows read; evict: K rows kept; none (sliding): S
 *   freed_bytes     evict: S - K; salience: 0 (the archive is an index partition of the same
 *                   pool, so archiving stops the rows being read but frees nothing); none: 0
 * kv_bytes_per_token is uncapped (kvt_model_kv_bytes_per_token). salience_layers + evict_layers
 * + none_layers = n_layers; no_kv_layers counts the no-KV layers, which are among none_layers.
 * Errors: KVT_ERR_INVALID_ARGUMENT (NULL model/out, ratio < 1 or not finite),
 * KVT_ERR_OUT_OF_RANGE (a total overflows 64 bits). *out is zeroed on error. */
KVT_API kvt_status kvt_model_census(const kvt_model *model, uint64_t context, uint64_t concurrency,
                                    double ratio, kvt_census_totals *out);
/* kvt_model_census when the requests share their first shared_rows tokens (prefix sharing:
 * kvt_seq_fork, kvt_seq_attach; a common system prompt), which the pool holds once. Per layer,
 * with O = the shared rows the layer still holds (sliding: those inside its last S rows, else
 * shared_rows) and C = concurrency:
 *   dense_bytes     C x S - (C - 1) x O               rows held with no policy
 *   freed_bytes     dense rows - (C x K - (C - 1) x min(O, K)) for evict (the shared prefix is
 *                   taken to be the protected prompt, which rounds keep shared); 0 otherwise
 *   attended_bytes  as kvt_model_census: every request reads its own attended rows
 * each times bytes_per_token. shared_rows 0 gives kvt_model_census's figures.
 * KVT_ERR_INVALID_ARGUMENT also when shared_rows > context. */
KVT_API kvt_status kvt_model_census_shared(const kvt_model *model, uint64_t context,
                                           uint64_t concurrency, double ratio,
                                           uint64_t shared_rows, kvt_census_totals *out);

/* ---------------------------------------------------------------------------------------------
 * Configuration
 * ------------------------------------------------------------------------------------------- */
/* The recall trigger on salience layers (docs/recall.md §4; needs params.recall_sketch_rank > 0
 * and a backend with the recall ops). Each decode step (one query token per request), per query
 * head h, best_h = the highest exact score over the rows attended without recall (sinks, kept,
 * tail, promoted: config.recall_promote_capacity); an archived row a (a closed row outside the
 * kept and promoted sets) is fetched for the step when, for
 * some head, its approximate score idx_a (branch exact, latent through the rank-r sketch) plus a
 * certificate reaches best_h. At most config.recall_cap_rows rows (W) a step: past W the step
 * attends every row and says so (kvt_emit.dense, statistics). Steps of several query tokens
 * (prefill chunks, drafts, per-token emission) attend every row.
 * best_h is computed by the library inside kvt_batch_run, from the queries passed to it: exact
 * fp32 scores of the rows attended without recall, in a kernel that runs at the attention's
 * rate (CPU, 128k rows, 32 heads: 70–79 GFLOP/s against 72–75 for the fp32 attention in the same
 * runs; bench/RESULTS.md). It is not taken from the engine's attention, so an engine that runs
 * its own (FlashMLA, which returns the log-sum-exp and not the max) passes nothing more than the
 * step's queries, and one step reads the attended rows twice: here and in its attention.
 *
 *   CONFORMAL  certificate z·cert_a, cert_a = ‖q_res‖·ρ_a/√(D − 64) (q_res: the query's latent
 *              outside the basis, ρ_a: the row's sketch residual). z is calibrated per request
 *              and layer: during the first steps with archived rows (at most 64), each step
 *              attends every row and records, per head, e = (score − idx)/cert of its
 *              highest-scoring archived row; at the end of the windows of 8, 16, 32 and 64 steps,
 *              once n >= 18 samples, z = the k-th smallest e, k = ceil((n + 1)·0.947), clamped
 *              to 8, then fixed (with too few samples by step 64: z = 8, provisional, for good).
 *              Guarantee, as it is: if the request's later queries are exchangeable with its
 *              calibration queries, a head's best archived row is fetched with probability
 *              >= 0.947, marginally over calibration and query — not per query, not conditional
 *              on content, void when the queries drift.
 *   SOUND      z = √(D − 64) plus every rounding term (fp16 sketch, fp32 evaluation): never
 *              misses a row whose fp32 exact score reaches best_h, for any query, given a basis
 *              with ‖V Vᵀ − I‖_F <= 2^-20 (fp32 precision; an fp32-rounded orthonormal basis
 *              measures ~1e-7; on RoPE layers every KV head's key basis): a sound request
 *              on a layer whose basis is looser, or such a basis set while a sound request
 *              lives, is KVT_ERR_INVALID_ARGUMENT, named
 *              (docs/recall.md §3.1). Fires far more often.
 *   MARGIN     fires when idx_a >= best_h − config.recall_margin (no certificate: a heuristic).
 *
 * On GQA/MHA-RoPE layers under random eviction (docs/recall.md §9) the same modes apply to the
 * archive (config.evict_archive, with sketch planes): per KV head, its archived rows' post-RoPE
 * keys through the head's sketch (kvt_ctx_set_recall_head_basis), its query heads' best over the
 * rows it attends, D = head_dim (> 64), one z per request and layer; W is per KV head, and an
 * overflow in any head lists the whole archive (with a host archive, kvt_ctx_params.archive_space,
 * no step does: an overflowing head fetches its W best-scored fired rows, flagged, and a
 * calibration step each query head's best archived row). On an MLA-RoPE layer (one latent head) the
 * archived row is scored as on NoPE layers: its latent (kv_lora_rank values) through the head's
 * sketch, its rotated branch exactly, D = kv_lora_rank. Such a layer then needs the emission
 * layout KVT_EMIT_CSR_KV_HEADS (kvt_batch_run) — on a layer with one KV head (MLA-RoPE, MQA)
 * KVT_EMIT_TOKENS and KVT_EMIT_CSR serve too (one list, the same) — and costs the request a
 * fetch area of pool pages for as many rows as it holds (with a host archive at most W; counted
 * by kvt_seq_pages_needed); its snapshots carry the trigger's state (a RECALL section, as on
 * salience layers). CPU, guarded and CUDA backends (the CUDA twins have not run on a GPU yet).
 */
typedef enum kvt_recall_mode {
    KVT_RECALL_OFF = 0,       /* archived rows are never brought back */
    KVT_RECALL_CONFORMAL = 1,
    KVT_RECALL_SOUND = 2,
    KVT_RECALL_MARGIN = 3,
} kvt_recall_mode;
/* "off", "conformal", "sound", "margin"; "unknown" for another value. */
KVT_API const char *kvt_recall_mode_name(kvt_recall_mode mode);
/* The default recall mode (the design's). */
#define KVT_RECALL_ON KVT_RECALL_CONFORMAL

/* Selector for salience layers. SIGMA is the method; the others are ablations that share its
 * block-close schedule and top-m so that only the score differs. */
typedef enum kvt_selector {
    KVT_SELECT_SIGMA = 0,       /* Fourier low-pass residual of the 64-dim branch */
    KVT_SELECT_BRANCH_NORM = 1, /* L2 norm of the 64-dim branch */
    KVT_SELECT_ROW_NORM = 2,    /* L2 norm of all values of the row */
    KVT_SELECT_RANDOM = 3,      /* uniform Philox draw */
} kvt_selector;

/* Basis σ projects the block's branches on (n = 2 kappa - 1 orthonormal columns over the B rows
 * of a block; kernels/sigma.h). FOURIER is the reference: low-frequency real Fourier columns,
 * which assume the block is periodic, so a branch that drifts along the sequence leaves a large
 * residual at both ends of every block. DCT: the first n DCT-II columns, which do not (a linear
 * ramp lies mostly in their span). Measured in docs/needle.md ("Block edges"). */
typedef enum kvt_sigma_basis {
    KVT_SIGMA_FOURIER = 0, /* reference: cos/sin of k = 0 .. kappa-1 cycles per block */
    KVT_SIGMA_DCT = 1,     /* DCT-II columns k = 0 .. 2 kappa - 2 (k/2 cycles per block) */
} kvt_sigma_basis;

typedef struct kvt_config {
    size_t struct_size;       /* sizeof(kvt_config); set by kvt_config_default */
    uint32_t ratio;           /* compression ratio >= 1 (salience: m = closed / ratio) */
    uint32_t block_rows;      /* B: close block, power of two >= 64 (4096) */
    uint32_t kappa;           /* low-frequency bins, 1 <= kappa <= B/2, (2 kappa - 1) B <= 2^24 (16) */
    uint32_t sink_rows;       /* first rows always attended on salience layers (4) */
    uint32_t evict_budget_rows; /* K: rows kept per head by a random-eviction round, 1..2^28 and
                                 * >= recent_rows (1024) */
    uint32_t recent_rows;     /* r: newest rows never scored, at most evict_budget_rows (64) */
    uint32_t cadence_rows;    /* c: a round runs at K + r + c rows; 0 means c = r */
    bool protect_prompt;      /* prompt rows score +inf in eviction rounds (true) */
    bool evict_archive;       /* evicted rows are copied to the archive pool, not dropped (false) */
    bool evict_shared_draw;   /* one draw shared by all KV heads of a layer (false) */
    bool evict_vase;          /* VaSE protection: first 4 + top K/4 by value range (false) */
    uint64_t seed;            /* Philox seed for every random choice */
    kvt_recall_mode recall;   /* KVT_RECALL_OFF */
    kvt_selector selector;    /* KVT_SELECT_SIGMA */
    uint32_t recall_cap_rows; /* W: most rows a recall step fetches per request and layer, 1..2^24
                               * (4096); past it the step attends every row */
    float recall_margin;      /* δ of KVT_RECALL_MARGIN, in score units, finite >= 0 (1.0) */
    /* Salience budget that counts the tail (false: the reference's m = closed / ratio, which
     * leaves the unclosed tail, up to block_rows rows, attended on top). true: at each close
     * m = max(budget_min_kept, ceil((closed + B/2) / ratio) − sinks − B/2), at most the closed
     * rows, so that sinks + kept + the tail's mean B/2 ≈ the context over the next block / ratio
     * (kvt_layer_stats.effective_ratio reports what holds). */
    bool salience_budget;
    uint32_t budget_min_kept; /* the floor of kept rows in budget mode (256) */
    kvt_sigma_basis sigma_basis; /* KVT_SIGMA_FOURIER; a struct that ends before it gets that */
    /* Recall promotion (docs/recall.md §4.2; a request with recall on; off by default). An
     * archived row that fired in at least recall_promote_hits of the request's last
     * recall_promote_window recall steps joins the layer's promoted set: attended without
     * recall from the next step on (it counts in best_h and is emitted every step) until it
     * stops mattering (no hit in the window at a close: demoted; kept by a close's σ: absorbed).
     * The set holds at most recall_promote_capacity rows (C), reserved out of
     * the salience budget: every close keeps m − min(C, m − 1) rows by σ (the lowest-σ of the
     * top m give way), so sinks + kept + promoted + tail never exceeds the budget without
     * promotion. 0 (the default): off, every decision as without these fields. C <= 2^16,
     * 1 <= hits <= window <= 32 (3 of 8). A struct that ends before them gets the defaults. */
    uint32_t recall_promote_capacity;
    uint32_t recall_promote_hits;
    uint32_t recall_promote_window;
    /* Scan with the previous step's query (docs/recall.md §4.3; salience layers, a request with
     * recall on; false by default). true: each recall step (a single-query step) scans,
     * calibrates and fetches with the queries the request's previous recall step on that layer
     * was given — the reference's overlap, where the scan for step t runs beside step t − 1's
     * attention, before q_t exists — and its own queries are kept for the next one; the first
     * recall step, with none before it, uses its own. The certificate then holds for the query
     * the scan used, not for this step's (kvt_layer_stats.recall_last_lagged says which): a row
     * that only q_t needs is fetched a step late, or not at all. A RoPE recall layer refuses it
     * (KVT_ERR_UNSUPPORTED at request creation). Snapshots and forks carry the kept queries.
     * A struct that ends before it gets false. */
    bool recall_lagged_query;
    /* Random eviction's budget from the request's ratio (false by default: every request keeps
     * evict_budget_rows, K, per KV head, whatever its length and ratio, so a request shorter
     * than K + r + c is never evicted). true: at each reservation a request's K is recomputed
     * from its length T after the step's tokens, its ratio (kvt_seq_params.ratio, else
     * config.ratio) and its protected prompt P (protect_prompt: min(prompt_rows, T); else 0):
     * K = max(recent_rows, P + ceil((T − P) / ratio)), at most 2^28, so the prompt is never over
     * budget and the rest is kept at 1 / ratio (a round runs at K + r + c rows and keeps K + r:
     * attended rows stay within r + c of P + (T − P) / ratio). evict_budget_rows is then unused
     * (kvt_seq_layer_stats shows K through attended_rows). Rounds grow with the request: with
     * max_rows_per_seq stated the keep sets are sized for max_rows_per_seq rows at creation, and
     * a device workspace sized for K + r + c grows at a larger round (outside any graph). A
     * struct that ends before it gets false; snapshots carry it in the config flags. */
    bool evict_ratio_budget;
} kvt_config;
/* Oldest kvt_config layout this library reads (ABI rule at the top). */
#define KVT_CONFIG_SIZE_MIN (offsetof(kvt_config, selector) + sizeof(kvt_selector))

/* The defaults, returned by value: safe only when the caller's kvtier.h is this library's (a
 * caller built against an older, smaller kvt_config reserves less than this writes). Code that
 * may run against a newer library uses kvt_config_init. */
KVT_API kvt_config kvt_config_default(void);
/* Write the defaults into out's first struct_size bytes (the caller's sizeof(kvt_config), which
 * becomes out->struct_size). KVT_ERR_INVALID_ARGUMENT for NULL or a size below
 * KVT_CONFIG_SIZE_MIN. */
KVT_API kvt_status kvt_config_init(kvt_config *out, size_t struct_size);
/* Check every field (struct_size by the ABI rule at the top), the ranges in the comments above
 * and the rules between fields (sink_rows <= block_rows, evict_budget_rows >= recent_rows,
 * cadence_rows and recent_rows not both 0, recall_promote_hits <= recall_promote_window); on
 * error names the field in err. KVT_ERR_INVALID_ARGUMENT or KVT_ERR_UNSUPPORTED. */
KVT_API kvt_status kvt_config_check(const kvt_config *cfg, char *err, size_t err_len);

/* ---------------------------------------------------------------------------------------------
 * Context: one model, one configuration, one row pool (a page allocator per policy group).
 * ------------------------------------------------------------------------------------------- */
typedef enum kvt_backend_kind {
    KVT_BACKEND_CPU = 0,
    KVT_BACKEND_CUDA = 1, /* KVT_ERR_NO_DEVICE when built without CUDA or no device is present */
    KVT_BACKEND_AUTO = 2, /* CUDA when usable, else CPU */
    KVT_BACKEND_GUARDED = 3, /* the CPU backend with its buffers inaccessible to the host except
                              * inside its own ops (memory protection keys, else mprotect): host
                              * code that touches a row directly faults. For tests and tools: it
                              * proves without a GPU that nothing reads "device" memory behind the
                              * backend's back. kvt_layer_data's pointer must not be dereferenced;
                              * use kvt_layer_read / kvt_layer_write. external_storage refused.
                              * Not under valgrind (no protection keys there). */
} kvt_backend_kind;

typedef enum kvt_allocator {
    KVT_ALLOC_DEFAULT = 0, /* jemalloc private arena when jemalloc is in the process, else libc */
    KVT_ALLOC_LIBC = 1,    /* aligned_alloc/free, visible to ASan and valgrind */
} kvt_allocator;

/* A memory space (kvt_ctx_params.archive_space). */
typedef enum kvt_space {
    KVT_SPACE_DEVICE = 0, /* the backend's memory (device memory on CUDA) */
    KVT_SPACE_HOST = 1,   /* pinned host memory the backend's ops reach */
} kvt_space;

typedef struct kvt_ctx_params {
    size_t struct_size;        /* sizeof(kvt_ctx_params); ABI rule at the top */
    const kvt_model *model;    /* required; copied */
    const kvt_config *config;  /* NULL: kvt_config_default(); copied (its own struct_size) */
    uint32_t page_rows;        /* rows per page (64) */
    uint32_t n_pages;          /* pages in each policy group's pool (1024) */
    kvt_backend_kind backend;  /* KVT_BACKEND_CPU */
    kvt_allocator allocator;   /* KVT_ALLOC_DEFAULT */
    bool external_storage;     /* rows live in memory bound with kvt_layer_bind before use */
    /* NULL: each layer gets kvt_policy_for_kind(kind). Otherwise n_layers entries overriding it:
     * KVT_POLICY_NONE or KVT_POLICY_EVICT on any layer with KV (ablations, controls);
     * KVT_POLICY_SALIENCE only on MLA-NoPE layers (on a rotated branch σ collapses, DESIGN §2.1)
     * — anything else is KVT_ERR_POLICY_MISMATCH naming the layer. */
    const kvt_policy *layer_policies;
    /* Tensor and pipeline parallelism. A rank that holds KV heads [kv_head_offset,
     * kv_head_offset + n_kv_heads) of n_kv_heads_global per layer, and model layers from
     * layer_offset on, keys every random draw by the global head and layer ids, so every rank
     * (and an unsharded run) makes the same decision for the same (layer, head). MLA has one
     * latent head, replicated on every rank: leave kv_head_offset 0. n_kv_heads_global 0 means
     * the model's own count (no head sharding). Defaults 0. A layer whose kv_head_offset +
     * n_kv_heads exceeds n_kv_heads_global is KVT_ERR_INVALID_ARGUMENT. */
    uint32_t kv_head_offset;
    uint32_t n_kv_heads_global;
    uint32_t layer_offset;
    /* Stated limit: tokens a request may hold (0: no limit, state grows on demand). With a limit,
     * every per-request array (page tables, positions, scores, slot maps, round and close
     * scratch) and the backend's workspace are sized at kvt_seq_create / kvt_ctx_create and a
     * steady-state step (reserve, plan, run, commit: closes and rounds included) allocates no
     * host memory (kvt_ctx_host_allocations counts); a reservation past it is KVT_ERR_CAPACITY.
     * Archive copies (evict_archive) still grow with what is evicted. */
    uint32_t max_rows_per_seq;
    /* Stated limit of random eviction's archive (evict_archive): evicted rows kept per (request,
     * layer, KV head); 0: grows on demand. With a limit the archive is allocated at kvt_seq_create
     * and a reservation whose step would run a round past it answers KVT_ERR_ARCHIVE_FULL, nothing
     * reserved (preempt the request, or give it a context that drops). */
    uint32_t archive_rows_per_seq;
    /* Stated limit: live requests of the context (0: no limit); kvt_seq_create past it is
     * KVT_ERR_CAPACITY. With max_rows_per_seq stated too, kvt_ctx_create builds max_seqs request
     * slots up front (page tables, policy state, side planes, and the archive when
     * archive_rows_per_seq is stated) and kvt_seq_create / kvt_seq_destroy take and give back a
     * slot: admitting and finishing requests allocates nothing (continuous batching with no
     * allocator on the scheduler's path). */
    uint32_t max_seqs;
    /* Recall sketches (docs/recall.md): fp16 coefficients per closed row of every salience layer
     * (0, the default: none, and closes compute nothing more than σ). With r > 0 every row of
     * such a layer gets, by the close of its block (each commit sketches its committed rows of
     * the open block ahead, whole tiles of 32; the close the rest), csk = the row's latent (its first value_dim values) projected on the
     * layer's basis (kvt_ctx_set_recall_basis; r coefficients, fp16, entries past the basis's
     * rank 0) and ρ = the norm of what that fp16 sketch misses (fp32): 2r + 4 bytes a row, 132 B
     * at the design's r = 64, in the backend's memory, sized with the score plane and the open
     * block (at kvt_seq_create when max_rows_per_seq is stated). A layer without a basis gets empty
     * sketches and ρ = the latent's norm. The recall trigger (kvt_config.recall) reads them.
     * 1..KVT_RECALL_MAX_RANK and at most every salience layer's value_dim
     * (KVT_ERR_INVALID_ARGUMENT). fp8 rows are read in FlashMLA's 656-B ds_mla layout only (512
     * E4M3 latent values, 4 fp32 scales, one per 128 values, the bf16 branch at byte 528; latent
     * value i = e4m3(byte i) · scale[i / 128] in fp32); another fp8 layout is
     * KVT_ERR_UNSUPPORTED. */
    uint32_t recall_sketch_rank;
    /* Where random eviction's archive (config.evict_archive) keeps its rows. DEVICE (the
     * default): the backend's memory, like the pool. HOST: pinned host memory the backend's ops
     * reach over the bus (cudaHostAlloc, mapped; the CPU and guarded backends: host pages the
     * guarded backend leaves open, since a GPU reads pinned memory too). The archive then costs
     * no device memory; its positions and recall sketches stay in the backend's. With recall on a
     * GQA/MHA-RoPE layer only fetched rows cross the bus (docs/recall.md §9.7): no step attends
     * the whole archive — an overflow fetches the first recall_cap_rows fired rows per KV head
     * and is flagged (recall_last_overflow), a calibration step fetches each query head's best
     * archived row, a step of several query tokens attends the held rows only — and the fetch
     * area in the pool holds at most recall_cap_rows rows. On an MLA-RoPE layer the archived
     * rows' rotated branches (what its scan reads every step) are also kept in the backend's
     * memory (branch_dim values a row). A struct that ends before it gets DEVICE. */
    kvt_space archive_space;
    /* Precision of the recall scan on salience layers (docs/recall.md §3.3): 16 (the default;
     * 0 is read as 16) scans each archived row's fp16 sketch and its branch from the pool; 8 also
     * writes, with each row's sketch, an 8-bit plane per row (the branch and the fp16 sketch quantised
     * with per-row scales, their rounding-error norms: 24 + branch_dim + r bytes, rounded up to
     * 4) after the fp16 sketch, and the scan reads only that plane and ρ, on integer dot products
     * (AVX-512 VNNI where the CPU has it), widening each trigger by a proven bound on the
     * rounding — the sound mode stays sound, and the scan fires every row the 16-bit scan fires
     * (z calibrated as in the 16-bit mode). Needs recall_sketch_rank > 0 and every salience
     * layer's branch_dim <= 256; the CPU, guarded and CUDA backends (the same planes and fired
     * rows on each; a backend without the 8-bit planes: KVT_ERR_UNSUPPORTED); other values
     * KVT_ERR_INVALID_ARGUMENT. A struct that ends before it gets 16. */
    uint32_t recall_scan_bits;
} kvt_ctx_params;
/* Oldest kvt_ctx_params layout this library reads: the fields up to layer_policies (the
 * parallelism fields then take their defaults: one unsharded rank). */
#define KVT_CTX_PARAMS_SIZE_MIN (offsetof(kvt_ctx_params, layer_policies) + sizeof(const kvt_policy *))

typedef struct kvt_ctx kvt_ctx;
typedef struct kvt_seq kvt_seq;

/* The defaults by value: as kvt_config_default, safe only with this library's kvtier.h. */
KVT_API kvt_ctx_params kvt_ctx_default_params(void);
/* The defaults written into out's first struct_size bytes (the caller's sizeof), never past
 * them; as kvt_config_init. KVT_ERR_INVALID_ARGUMENT for NULL or a size below
 * KVT_CTX_PARAMS_SIZE_MIN. */
KVT_API kvt_status kvt_ctx_params_init(kvt_ctx_params *out, size_t struct_size);
/* Create a context. Errors: KVT_ERR_INVALID_ARGUMENT (bad params; err names the field),
 * KVT_ERR_UNSUPPORTED (a config option not available yet), KVT_ERR_NO_DEVICE (CUDA asked for and
 * absent), KVT_ERR_OUT_OF_MEMORY. err may be NULL; *out is NULL on failure. */
KVT_API kvt_status kvt_ctx_create(const kvt_ctx_params *params, kvt_ctx **out, char *err,
                                  size_t err_len);
/* kvt_ctx_create with kvt_ctx_default_params() and the given model: for foreign-function callers
 * (Python ctypes) that would rather not mirror the parameter struct. */
KVT_API kvt_status kvt_ctx_create_default(const kvt_model *model, kvt_ctx **out, char *err,
                                          size_t err_len);
/* Destroys every batch and sequence still alive. NULL is a no-op. */
KVT_API void kvt_ctx_destroy(kvt_ctx *ctx);
KVT_API const kvt_model *kvt_ctx_model(const kvt_ctx *ctx);
KVT_API const kvt_config *kvt_ctx_config(const kvt_ctx *ctx);
/* Name of the backend in use ("cpu", "guarded", "cuda") and of the host allocator ("jemalloc",
 * "libc"). */
KVT_API const char *kvt_ctx_backend_name(const kvt_ctx *ctx);
KVT_API const char *kvt_ctx_allocator_name(const kvt_ctx *ctx);
KVT_API kvt_policy kvt_ctx_layer_policy(const kvt_ctx *ctx, uint32_t layer);
/* Policy group of a layer (layers sharing a page table); -1 for a no-KV layer. */
KVT_API int32_t kvt_ctx_layer_group(const kvt_ctx *ctx, uint32_t layer);
/* Host allocations the context's allocator has made since creation (every byte kvtier owns goes
 * through it): a steady-state decode with max_rows_per_seq set makes none. 0 for NULL. */
KVT_API uint64_t kvt_ctx_host_allocations(const kvt_ctx *ctx);
/* Pages free in a layer's group pool. */
KVT_API kvt_status kvt_ctx_free_pages(const kvt_ctx *ctx, uint32_t layer, uint32_t *out);

/* The memory a context's live requests hold now, summed over its groups and layers, with what
 * requests share (kvt_seq_fork, kvt_seq_attach) counted once: a shared page is one page of the
 * pool, a shared set of side planes one set. The sum over requests of kvt_layer_stats'
 * pages_in_use / bytes_in_use / side_bytes counts it once per holder instead. */
typedef struct kvt_ctx_memory {
    size_t struct_size;        /* in: sizeof(kvt_ctx_memory) (output written up to it) */
    uint64_t requests;         /* live requests (parked request slots are not) */
    uint64_t pages_in_use;     /* pool pages held, over every group (each page once) */
    uint64_t shared_pages;     /* of which held by more than one request */
    uint64_t bytes_in_use;     /* their bytes: per group, pages x page_rows x the group's layers'
                                * row bytes of every plane */
    uint64_t shared_bytes;     /* of which in shared pages */
    uint64_t side_bytes;       /* kvt_layer_stats.side_bytes over requests and layers, a shared
                                * set counted once */
    uint64_t shared_side_bytes;/* of which in sets held by more than one request */
    /* Random eviction's archive rows over requests and layers (kvt_layer_stats.archive_bytes, at
     * capacity), by the space they live in (kvt_ctx_params.archive_space). */
    uint64_t archive_device_bytes;
    uint64_t archive_host_bytes;
} kvt_ctx_memory;
#define KVT_CTX_MEMORY_SIZE_MIN (offsetof(kvt_ctx_memory, shared_side_bytes) + sizeof(uint64_t))
/* Fill *out (out->struct_size set by the caller). KVT_ERR_INVALID_ARGUMENT (NULL, a struct_size
 * below KVT_CTX_MEMORY_SIZE_MIN), KVT_ERR_BAD_STATE (a step in flight: call between steps),
 * KVT_ERR_OUT_OF_MEMORY (host scratch). O(requests x layers). */
KVT_API kvt_status kvt_ctx_memory_stats(const kvt_ctx *ctx, kvt_ctx_memory *out);

/* A context's memory before it is created (kvt_ctx_estimate), per policy group (layers under one
 * policy share a page table and a page allocator of params.n_pages pages). */
typedef struct kvt_ctx_estimate_group {
    kvt_policy policy;
    uint32_t n_layers;         /* the group's layers (no-KV layers are in no group) */
    uint64_t row_bytes;        /* one token over the group's layers: sum of n_planes x n_kv_heads
                                * x row_bytes */
    uint64_t page_bytes;       /* page_rows x row_bytes: what one page of the group costs */
    uint64_t pool_bytes;       /* params.n_pages x page_bytes: the group's row pool, allocated by
                                * kvt_ctx_create in the backend's memory (the engine's with
                                * external_storage) */
    uint64_t pages_needed;     /* pages max_seqs requests hold at their peak, each with
                                * max_rows_per_seq rows reserved: max_seqs x ceil(max_rows_per_seq
                                * / page_rows). Excludes RoPE recall's fetch area (recall on an
                                * evict layer with an archive: up to recall_cap_rows rows more a
                                * request) */
    uint64_t side_bytes_per_seq; /* kvt_layer_stats.side_bytes of a request of max_rows_per_seq
                                * rows over the group's layers: salience σ, kept set and recall
                                * sketches, eviction positions, slot map and keep sets, the recall
                                * trigger's state (the backend's memory) */
    uint64_t archive_bytes_per_seq; /* random eviction's archive rows of a request (config.
                                * evict_archive with params.archive_rows_per_seq stated: allocated
                                * whole at kvt_seq_create, archive_rows_per_seq x n_kv_heads x
                                * n_planes x row_bytes per evict layer; 0 when it grows with what
                                * is evicted), in params.archive_space; its position indices and
                                * sketches are in side_bytes_per_seq */
} kvt_ctx_estimate_group;

typedef struct kvt_ctx_estimate_out {
    size_t struct_size;        /* in: sizeof(kvt_ctx_estimate_out) (output written up to it) */
    uint32_t n_groups;
    kvt_ctx_estimate_group groups[3]; /* [0, n_groups), in kvt_ctx_layer_group's order */
    uint32_t n_pages_needed;   /* the largest pages_needed: the params.n_pages that admits
                                * max_seqs requests of max_rows_per_seq rows each (0 when it
                                * exceeds 2^32 - 1 or 2^31 - 1 rows: no context holds them) */
    uint64_t pool_bytes;       /* sum of the groups' pool_bytes at params.n_pages */
    uint64_t pool_bytes_needed; /* the same at n_pages_needed */
    uint64_t side_bytes;       /* max_seqs x the groups' side_bytes_per_seq */
    uint64_t archive_bytes;    /* max_seqs x the groups' archive_bytes_per_seq */
} kvt_ctx_estimate_out;
#define KVT_CTX_ESTIMATE_OUT_SIZE_MIN sizeof(kvt_ctx_estimate_out)
/* The memory kvt_ctx_create(params) would allocate and the pages its requests would need, before
 * creating it: for each policy group the bytes of a row, a page and the pool (params.n_pages), the
 * pages that params.max_seqs requests of params.max_rows_per_seq rows each hold (both must be
 * stated), and the side planes and archive of one such request. The sizes of the side planes
 * come from the library's own sizing: a probe context of one page per group on the CPU backend
 * (a few bytes of pool, libc allocator) creates one request of max_rows_per_seq rows and reads
 * its kvt_layer_stats; the probe is destroyed before the call returns. Not counted: the backend's
 * workspace (σ and top-m scratch, sized by max_rows_per_seq) and host bookkeeping. err may be
 * NULL. KVT_ERR_INVALID_ARGUMENT (NULL, out->struct_size below KVT_CTX_ESTIMATE_OUT_SIZE_MIN,
 * max_seqs or max_rows_per_seq 0, or what kvt_ctx_create refuses; err names it), the statuses of
 * kvt_ctx_create and kvt_seq_create otherwise. */
KVT_API kvt_status kvt_ctx_estimate(const kvt_ctx_params *params, kvt_ctx_estimate_out *out,
                                    char *err, size_t err_len);

/* Base address and size of a layer's plane (0 = K or the MLA row, 1 = V): the array
 * [n_pages][page_rows][n_kv_heads][row_bytes]. KVT_ERR_OUT_OF_RANGE for a bad layer/plane,
 * KVT_ERR_POLICY_MISMATCH for a no-KV layer, KVT_ERR_BAD_STATE for an unbound external layer. */
KVT_API kvt_status kvt_layer_data(kvt_ctx *ctx, uint32_t layer, uint32_t plane, void **base,
                                  size_t *bytes);
/* Copy n_slots whole slots (n_kv_heads * row_bytes each) of a layer's plane, starting at slot
 * first_slot, out of (read) or into (write) host memory of exactly that many bytes, through the
 * backend (the way to reach rows on a backend whose memory the host cannot touch). For tools and
 * tests; not for the decode path. KVT_ERR_OUT_OF_RANGE past the pool, KVT_ERR_INVALID_ARGUMENT
 * for a wrong byte count or NULL, KVT_ERR_POLICY_MISMATCH for a no-KV layer. */
KVT_API kvt_status kvt_layer_read(kvt_ctx *ctx, uint32_t layer, uint32_t plane, uint64_t first_slot,
                                  uint64_t n_slots, void *dst, size_t bytes);
KVT_API kvt_status kvt_layer_write(kvt_ctx *ctx, uint32_t layer, uint32_t plane,
                                   uint64_t first_slot, uint64_t n_slots, const void *src,
                                   size_t bytes);
/* With external_storage: bind engine memory (host memory for the CPU backend) of at least
 * n_pages * page_rows * n_kv_heads * row_bytes bytes to a plane, before any reserve. The memory
 * stays the engine's. KVT_ERR_CAPACITY when too small, KVT_ERR_BAD_STATE after the first reserve
 * or without external_storage. */
KVT_API kvt_status kvt_layer_bind(kvt_ctx *ctx, uint32_t layer, uint32_t plane, void *base,
                                  size_t bytes);

/* ---------------------------------------------------------------------------------------------
 * Recall basis (docs/recall.md). A salience layer's recall sketches project each row's latent on
 * a rank-r basis V: r orthonormal rows of value_dim values, the top-r eigenvectors of the
 * centred covariance of calibration queries' latent parts (kvtier-inspect calibrate writes
 * them to a basis file). Its id is the CRC-32 (zlib's) of V's bytes as stored (r x value_dim
 * little-endian fp32), kept in kvt_layer_stats.recall_basis_id.
 * ------------------------------------------------------------------------------------------- */
/* Largest rank a basis may have (and params.recall_sketch_rank). The design's rank is 64. */
#define KVT_RECALL_MAX_RANK 256u

/* Give salience layer `layer` its basis: V is host memory of rank x value_dim fp32 values, row k
 * at V + k * value_dim, copied into the backend's memory (the caller keeps V). Rows must be
 * orthonormal (|V Vᵀ − I| <= 1e-3 in every entry): the certificates of docs/recall.md §3 rest on
 * it; the sound mode needs ‖V Vᵀ − I‖_F <= 2^-20 (KVT_ERR_INVALID_ARGUMENT when the context's
 * mode or a live request's is sound and V is looser). A second call replaces the basis. Errors (nothing changed): KVT_ERR_INVALID_ARGUMENT (NULL
 * ctx or V, a NaN or Inf in V, rows not orthonormal), KVT_ERR_OUT_OF_RANGE (layer >= n_layers;
 * rank 0 or above params.recall_sketch_rank), KVT_ERR_POLICY_MISMATCH (not a salience layer),
 * KVT_ERR_UNSUPPORTED (the context was created without recall_sketch_rank), KVT_ERR_BAD_STATE
 * once any request of the context has reserved rows (a block may close in the step's run, before
 * its commit, and every sketch of a layer must come from one basis), KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_ctx_set_recall_basis(kvt_ctx *ctx, uint32_t layer, const float *V,
                                            uint32_t rank);
/* A layer's basis: *rank (0: none) and *id (0 without one); either may be NULL.
 * KVT_ERR_INVALID_ARGUMENT (NULL ctx), KVT_ERR_OUT_OF_RANGE (layer). */
KVT_API kvt_status kvt_ctx_recall_basis(const kvt_ctx *ctx, uint32_t layer, uint32_t *rank,
                                        uint32_t *id);

/* Flag of kvt_ctx_refit_recall_basis: requests keep their calibrated z (no new calibration). */
#define KVT_REFIT_KEEP_Z 1u
/* Replace salience layer `layer`'s basis while requests live (docs/recall.md §5.1; a basis that
 * follows the requests' own queries: the fit is the caller's, e.g. the top eigenvectors of the
 * centred covariance of the query latents seen so far). V, rank: as for
 * kvt_ctx_set_recall_basis, with the rank of the layer's basis. Before any request reserved rows
 * it is kvt_ctx_set_recall_basis (any rank, flags ignored). Between steps only: every closed row
 * of every live request on the layer is sketched again with V (its fp16 sketch and ρ, and its
 * 8-bit plane at recall_scan_bits 8; a prefix shared by several requests once), the pruned
 * scan's groups are built again at each request's next step, and each request recalling on the
 * layer starts its conformal calibration again (its next steps with archived rows attend every
 * row, as its first did, until z is fixed) unless flags has KVT_REFIT_KEEP_Z. The basis stays in
 * the same backend buffer, so a recorded planned step (kvt_batch_plan_device) stays valid.
 * stream: where the sketches run (a cudaStream_t on the CUDA backend, stream-ordered after the
 * previous step's device work — the stream of its runs and commit — or NULL, the default one,
 * which waits for all of it); the call returns once they are done. Cost: the close's sketch of every closed row (CPU, one
 * thread, rank 64, 512 latent values: 0.9–1.1 µs a row at 16 bits, 1.35–1.5 µs at 8; 1.0–1.6
 * dense decode steps of bench_decode_step at 32k and 128k rows). The basis is the layer's: every
 * request on it gets the new one (snapshots name it by id, kvt_layer_stats.recall_basis_id).
 * Errors: those of kvt_ctx_set_recall_basis but KVT_ERR_BAD_STATE, nothing changed; then
 * KVT_ERR_BAD_STATE (nothing changed) while a request is in a step (reserved, not committed),
 * KVT_ERR_OUT_OF_RANGE (nothing changed) for a rank other than the layer's basis's, or when the
 * layer has no basis yet and a request reserved rows, KVT_ERR_INVALID_ARGUMENT for flags other
 * than 0 and KVT_REFIT_KEEP_Z; a backend failure while sketching is KVT_ERR_CORRUPT naming the
 * first request it hit and how many (every other request is still sketched again; theirs mix
 * two bases: call again with the same V, which sketches every request again, or destroy them;
 * every stored row is intact). */
KVT_API kvt_status kvt_ctx_refit_recall_basis(kvt_ctx *ctx, uint32_t layer, const float *V,
                                              uint32_t rank, uint32_t flags, void *stream);
/* Give KV head `kv_head` of an evict (GQA/MHA-RoPE or MLA-RoPE) layer its key basis
 * (docs/recall.md §9): V is host memory of rank x D fp32 values (D = head_dim on GQA/MHA layers,
 * kv_lora_rank = value_dim on MLA-RoPE layers, whose one head is 0 and whose rotated branch is
 * scored exactly), orthonormal rows as for kvt_ctx_set_recall_basis,
 * fitted to that head's post-RoPE keys; each archived row of the head gets csk = its key
 * projected on V (fp16) and ρ = the norm of what the sketch misses. A head without one gets
 * empty sketches and ρ = the key's norm (the trigger is still sound, it only fetches more).
 * Sketches are built on evict layers with two planes (K, V) or one MLA-RoPE plane of
 * bf16/fp16/fp32 rows in a context with params.recall_sketch_rank > 0, for requests with
 * config.evict_archive; their stride is min(recall_sketch_rank, D). A second call replaces the
 * head's basis. Errors (nothing changed): KVT_ERR_INVALID_ARGUMENT (NULL ctx or V, NaN/Inf,
 * rows not orthonormal),
 * KVT_ERR_OUT_OF_RANGE (layer, kv_head, or rank 0 or above the stride), KVT_ERR_POLICY_MISMATCH
 * (not an evict layer), KVT_ERR_UNSUPPORTED (no sketch planes, or a layer whose rows the sketch
 * cannot take: fp8, or a one-plane layer that is not MLA-RoPE), KVT_ERR_BAD_STATE (a request
 * already reserved rows), KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_ctx_set_recall_head_basis(kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                                 const float *V, uint32_t rank);
/* A head's key basis: *rank (0: none) and *id (CRC-32 of V's bytes, 0 without one); either may
 * be NULL. KVT_ERR_INVALID_ARGUMENT (NULL ctx), KVT_ERR_OUT_OF_RANGE (layer or kv_head). */
KVT_API kvt_status kvt_ctx_recall_head_basis(const kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                             uint32_t *rank, uint32_t *id);
/* kvt_ctx_refit_recall_basis for KV head `kv_head`'s key basis of an evict layer whose archive
 * recalls (docs/recall.md §9, §5.1): before any request reserved rows it is
 * kvt_ctx_set_recall_head_basis; between steps, V (rank x D as for that call, the head's basis's
 * rank) replaces the head's basis in place, every live request's archived rows of that head are
 * sketched again with it, and each request recalling on the layer starts its calibration again
 * unless KVT_REFIT_KEEP_Z (one z per request and layer). A fit on the request's own keys — the
 * top eigenvectors of the uncentred second moment of the head's post-RoPE keys, what
 * kvtier-inspect calibrate fits from traces — is what a basis fitted on other text lacks
 * (docs/needle.md). Errors as kvt_ctx_refit_recall_basis's, and KVT_ERR_OUT_OF_RANGE for a KV
 * head out of range or one without a basis; KVT_ERR_POLICY_MISMATCH on a layer that is not an
 * evict layer, KVT_ERR_UNSUPPORTED on one whose archive keeps no key sketches. */
KVT_API kvt_status kvt_ctx_refit_recall_head_basis(kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                                   const float *V, uint32_t rank, uint32_t flags,
                                                   void *stream);

/* Make the rows of V ([rank][n] doubles, row k at V + k * n) orthonormal in place, by modified
 * Gram-Schmidt in double: row k, in order, has its projection on each earlier row subtracted,
 * `passes` times over (re-orthogonalisation: 2 passes give rows orthonormal to double precision,
 * "twice is enough"), then is divided by its norm. Directions and signs are kept (row k spans
 * what rows 0..k did). How a basis for kvt_ctx_set_recall_basis / _head_basis is made
 * orthonormal before its rounding to fp32 (kvtier-inspect calibrate runs it twice with one pass,
 * kvtier-needle's query subspace once with two). Pure (any thread). Errors:
 * KVT_ERR_INVALID_ARGUMENT for NULL V with rank > 0, rank > n or passes 0 (nothing changed), or
 * a row whose norm once orthogonalised is below 1e-10 of its norm before, or not finite (rows
 * linearly dependent to double precision, or a NaN or Inf in V; V is then partly rewritten). */
KVT_API kvt_status kvt_orthonormalise_rows(double *V, uint32_t rank, uint32_t n, uint32_t passes);

/* A basis file (kvtier-inspect calibrate writes it: one for an MLA-NoPE layer, one per KV head,
 * PREFIX.h<H>, for a RoPE layer; format in docs/recall.md §5): little-endian,
 *   0   8 B   magic "KVTRBAS1"
 *   8   u32   format version (1)
 *   12  u32   layer the basis was calibrated for (informational: any salience layer of the same
 *             value_dim may load it; a key basis, any head of a layer of the same key dim)
 *   16  u32   rank r
 *   20  u32   dim (value_dim)
 *   24  f64   captured: share of the calibration samples' energy the r directions hold, in
 *             [0, 1] (NaN when unknown): the centred variance of query latents (a salience
 *             layer's basis) or the uncentred energy of one KV head's keys (a key basis)
 *   32  u64   samples: query latents, or key rows, the matrix was estimated from
 *   40  r x dim fp32: V, row-major
 *   end u32   CRC-32 of every byte before it. */
typedef struct kvt_recall_basis_info {
    uint32_t layer;
    uint32_t rank;
    uint32_t dim;
    double captured;
    uint64_t samples;
    uint32_t id;       /* read: CRC-32 of V's bytes (the basis id); ignored by write */
} kvt_recall_basis_info;

/* Write a basis file, replacing any file at path atomically as kvt_seq_snapshot_file does (a
 * locked temporary next to it, fsync'ed and renamed; on failure a file already at path is left
 * as it was; stale temporaries of the same path are removed first). V: info->rank x info->dim
 * fp32. Errors: KVT_ERR_INVALID_ARGUMENT (NULL, rank 0 or above KVT_RECALL_MAX_RANK, dim 0 or
 * above 65536), KVT_ERR_IO, KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_recall_basis_write(const char *path, const kvt_recall_basis_info *info,
                                          const float *V);
/* Read a basis file: *info always, and V into v (v_floats >= rank x dim) when v is not NULL.
 * Errors: KVT_ERR_INVALID_ARGUMENT (NULL path or info), KVT_ERR_IO, KVT_ERR_PARSE (bad magic,
 * unknown version, a size that disagrees with rank and dim, rank or dim out of range),
 * KVT_ERR_CORRUPT (CRC mismatch), KVT_ERR_CAPACITY (v too small). */
KVT_API kvt_status kvt_recall_basis_read(const char *path, kvt_recall_basis_info *info, float *v,
                                         size_t v_floats);
/* kvt_recall_basis_read, then kvt_ctx_set_recall_basis of its V on `layer` (whose value_dim
 * must equal the file's dim: KVT_ERR_INVALID_ARGUMENT). The errors of both. */
KVT_API kvt_status kvt_ctx_load_recall_basis(kvt_ctx *ctx, uint32_t layer, const char *path);
/* kvt_recall_basis_read, then kvt_ctx_set_recall_head_basis of its V on KV head `kv_head` of
 * `layer` (a file kvtier-inspect calibrate fitted to that head's keys, `PREFIX.h<kv_head>`; the
 * file's layer field is informational, as above). The file's dim must equal the layer's key dim
 * (head_dim on GQA/MHA layers, kv_lora_rank = value_dim on MLA-RoPE layers):
 * KVT_ERR_INVALID_ARGUMENT, naming both. A layer that takes no key basis (a salience layer, fp8
 * rows, no sketch planes) is refused as kvt_ctx_set_recall_head_basis refuses it. Errors: NULL
 * ctx or path (KVT_ERR_INVALID_ARGUMENT), layer out of range (KVT_ERR_OUT_OF_RANGE), the file's
 * (KVT_ERR_IO, KVT_ERR_PARSE, KVT_ERR_CORRUPT), KVT_ERR_OUT_OF_MEMORY, and every error of
 * kvt_ctx_set_recall_head_basis (kv_head and rank out of range, rows not orthonormal, sound mode's
 * 2^-20, a request already started); nothing changed on any error. */
KVT_API kvt_status kvt_ctx_load_recall_head_basis(kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                                  const char *path);

/* ---------------------------------------------------------------------------------------------
 * Backend buffers
 *
 * Memory in the context's backend's space: host memory on the CPU backend, pages the host cannot
 * touch on the guarded backend, device memory on CUDA (cudaMalloc, never managed memory). The
 * arrays kvt_batch_run writes (kvt_emit) live in this space, because attention reads them where
 * it runs; an engine on a device backend allocates them here once and reuses them every step
 * (and any other array it wants next to the cache). The host reaches a buffer's bytes only
 * through kvt_buffer_read / kvt_buffer_write (ggml-backend's rule); kvt_buffer_ptr is the
 * address to hand to kernels and to kvt_emit, to dereference on the host only on the CPU
 * backend. A buffer belongs to its context: kvt_ctx_destroy frees the live ones. Calls on one
 * buffer follow the scheduler's rules ("Threads"); copies are off the decode path except the
 * _async forms on the step's stream.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt_buffer kvt_buffer;

/* bytes > 0 of zeroed backend memory. KVT_ERR_INVALID_ARGUMENT (0 bytes, NULL),
 * KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_buffer_alloc(kvt_ctx *ctx, size_t bytes, kvt_buffer **out);
/* NULL is a no-op. Not after kvt_ctx_destroy of its context (which freed it). */
KVT_API void kvt_buffer_free(kvt_buffer *buf);
/* The buffer's address in the backend's space (NULL for NULL) and its size in bytes. */
KVT_API void *kvt_buffer_ptr(const kvt_buffer *buf);
KVT_API size_t kvt_buffer_size(const kvt_buffer *buf);
/* Copy bytes between host memory and [offset, offset + bytes) of the buffer; the copy is done
 * when the call returns. KVT_ERR_OUT_OF_RANGE past its end, KVT_ERR_INVALID_ARGUMENT for NULL. */
KVT_API kvt_status kvt_buffer_write(kvt_buffer *buf, size_t offset, const void *src, size_t bytes);
KVT_API kvt_status kvt_buffer_read(const kvt_buffer *buf, size_t offset, void *dst, size_t bytes);
/* The same, enqueued on stream (a cudaStream_t on CUDA; the CPU backends copy at once): the host
 * memory must stay valid, and unchanged for a write, until the stream reaches the copy. */
KVT_API kvt_status kvt_buffer_write_async(kvt_buffer *buf, size_t offset, const void *src,
                                          size_t bytes, void *stream);
KVT_API kvt_status kvt_buffer_read_async(const kvt_buffer *buf, size_t offset, void *dst,
                                         size_t bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * Sequences (requests)
 * ------------------------------------------------------------------------------------------- */
/* Per-request settings; defaults come from the context. */
typedef struct kvt_seq_params {
    size_t struct_size;    /* sizeof(kvt_seq_params); ABI rule at the top */
    uint64_t request_id;   /* keys the random draws of this request, with the config seed (0) */
    uint64_t prompt_rows;  /* rows [0, prompt_rows) are the prompt, protected from random
                            * eviction (0); kvt_seq_set_prompt_rows may change it until a round */
    uint32_t ratio;        /* ratio of this request (salience: m = closed / ratio; random
                            * eviction with config.evict_ratio_budget: K from it); 0: the
                            * context's config.ratio. Without evict_ratio_budget random
                            * eviction keeps config's K. */
    int32_t recall;        /* a kvt_recall_mode, or -1: the context's config.recall */
} kvt_seq_params;
#define KVT_SEQ_PARAMS_SIZE_MIN (offsetof(kvt_seq_params, recall) + sizeof(int32_t))

/* The defaults by value: as kvt_config_default, safe only with this library's kvtier.h. */
KVT_API kvt_seq_params kvt_seq_default_params(void);
/* As kvt_ctx_params_init (KVT_SEQ_PARAMS_SIZE_MIN). */
KVT_API kvt_status kvt_seq_params_init(kvt_seq_params *out, size_t struct_size);
/* Create a request. params NULL: kvt_seq_default_params(). A request id is unique among the
 * context's live requests (it keys the request's random draws with config.seed: two live
 * requests of one id would make the same eviction choices); once its request is destroyed the
 * id may be used again. Errors (nothing created, nothing changed): KVT_ERR_INVALID_ARGUMENT (NULL
 * ctx/out, a bad field: ratio above 2^20, an unknown recall; a request id already live in ctx,
 * named in the message), KVT_ERR_UNSUPPORTED (recall on in
 * a context without sketch planes or on a backend without the recall step; a struct from a newer
 * kvtier), KVT_ERR_OUT_OF_MEMORY (host, or the trigger's state in the backend's memory). */
KVT_API kvt_status kvt_seq_create(kvt_ctx *ctx, const kvt_seq_params *params, kvt_seq **out);
/* Returns every page and archive byte. NULL is a no-op. Allowed at any time, also while the
 * request is in a batch's step (preemption, an aborted request): the batch forgets it — the
 * step's slot_mapping gives -1 for its tokens, its run emits no row for it, its commit skips
 * it. */
KVT_API void kvt_seq_destroy(kvt_seq *seq);
/* Rows [0, n) are the prompt (protected from random eviction). May be called before or after the
 * rows are committed, but not after the first eviction round (KVT_ERR_BAD_STATE). */
KVT_API kvt_status kvt_seq_set_prompt_rows(kvt_seq *seq, uint64_t n_rows);
/* Tokens committed so far (original positions 0..n-1). */
KVT_API uint64_t kvt_seq_length(const kvt_seq *seq);
/* The context the request belongs to (NULL for NULL). */
KVT_API kvt_ctx *kvt_seq_context(const kvt_seq *seq);
/* The request's id (kvt_seq_params.request_id; a fork's or attach's request_id; a restored
 * request's, from its snapshot); 0 for NULL. */
KVT_API uint64_t kvt_seq_request_id(const kvt_seq *seq);
/* Rows reserved for the step in flight (0 between steps). */
KVT_API uint32_t kvt_seq_pending(const kvt_seq *seq);

/* Pages the sequence would need to take from the pools to reserve n more tokens, summed over
 * groups (admission control). Pages a sliding group will return at the next commit are not
 * counted as free: the reservation comes first. */
KVT_API kvt_status kvt_seq_pages_needed(const kvt_seq *seq, uint32_t n_tokens, uint32_t *out);
/* Slot of the i-th reserved (uncommitted) token in layer's group. */
KVT_API kvt_status kvt_seq_reserved_slot(const kvt_seq *seq, uint32_t layer, uint32_t i,
                                         int32_t *slot);
/* Copy rows for reserved tokens [first, first+n) of one plane: src holds n rows of
 * n_kv_heads * row_bytes bytes each (src_bytes must equal that). Host memory (CPU backend).
 * KVT_ERR_BAD_STATE after kvt_batch_run ran this layer for the step (its rows may have moved). */
KVT_API kvt_status kvt_seq_write(kvt_seq *seq, uint32_t layer, uint32_t plane, uint32_t first,
                                 uint32_t n, const void *src, size_t src_bytes);
/* Fork seq between steps into a new request *out of id request_id (parallel sampling, a shared
 * system prompt): the child holds every committed row of seq — the same pages, shared with
 * reference counts, none copied — and every layer's policy state: the σ and recall sketch
 * planes of the closed blocks shared the same way (they are fixed once written), a copy of the
 * rest (kept sets, eviction positions, slot maps and archive, recall groups), with seq's prompt
 * length, ratio and recall; from then on each decodes on its own. A shared page is read-only:
 * before a step writes into one (the partial last page at kvt_batch_reserve, the pages past the
 * protected prompt before an eviction round) the writer copies it into a page of its own, so
 * neither side ever sees the other's rows; a page goes back to the pool when its last holder
 * lets it go. The shared σ and sketch planes stay shared for as long as their holders live:
 * each holder writes the blocks it closes later into planes of its own and reads the shared
 * rows where they are (no copy). The request whose planes became the shared set takes new own
 * planes at its next kvt_batch_reserve (recall sketch planes, for its open block's rows) and at
 * that of its next closing step (KVT_ERR_OUT_OF_MEMORY there, nothing reserved, when it cannot;
 * so it may allocate at those reserves even with max_rows_per_seq);
 * forking a request that already shares planes and closed blocks since copies its closed rows'
 * planes once into one new shared set (at the fork). Later random
 * draws are keyed by the child's own request id, which must not be live in the context (as for
 * kvt_seq_create). KVT_ERR_BAD_STATE when seq has a step in flight
 * (or is damaged), KVT_ERR_INVALID_ARGUMENT (NULL; request_id already live, seq's own
 * included), KVT_ERR_CAPACITY (max_seqs reached),
 * KVT_ERR_OUT_OF_MEMORY; on failure nothing was forked. A later reserve that must copy a page
 * the pool cannot give answers KVT_ERR_POOL_EXHAUSTED with nothing reserved. */
KVT_API kvt_status kvt_seq_fork(kvt_seq *seq, uint64_t request_id, kvt_seq **out);
/* A new request *out of id request_id holding src's first prefix_rows committed rows —
 * positions [0, prefix_rows), a multiple of page_rows — sharing their pages (a system prompt or
 * document many requests start from), in exactly the state a request fed those rows alone would
 * have: salience layers keep the σ of the blocks closed within the prefix and select their
 * top-m anew, random-eviction layers start with no round, a sliding group holds the prefix's
 * last window. Its prompt length is min(src's, prefix_rows); src's parameters otherwise. Pages,
 * and the σ and sketch planes of the blocks closed within the prefix, are shared as with
 * kvt_seq_fork (pages copied on write). KVT_ERR_INVALID_ARGUMENT (prefix not a
 * multiple of page_rows or past src's length, out NULL, request_id already live in the context
 * as for kvt_seq_create), KVT_ERR_UNSUPPORTED when src no longer
 * holds the prefix as it was (an eviction round moved rows past its protected prompt; a
 * sliding group returned rows the prefix's window needs), KVT_ERR_BAD_STATE (a step in flight),
 * KVT_ERR_CAPACITY, KVT_ERR_OUT_OF_MEMORY; on failure nothing was created. */
KVT_API kvt_status kvt_seq_attach(kvt_seq *src, uint64_t prefix_rows, uint64_t request_id,
                                  kvt_seq **out);

/* ---------------------------------------------------------------------------------------------
 * Batches: one decode (or prefill) step of many requests.
 *
 * The decode-step timeline (FlashInfer's plan/run split; vLLM's slot_mapping):
 *
 *   kvt_batch_reserve(b, seqs, n_tokens, n)    scheduler, before the step: slots for every new
 *                                              token of every request in every layer, all or
 *                                              nothing; kvt_batch_slot_mapping gives them per
 *                                              policy group in vLLM's slot_mapping layout
 *   kvt_batch_plan(b)                          host, before the step, outside any CUDA graph:
 *                                              fixes the step (its requests answer no
 *                                              by-position query until commit) and sizes the
 *                                              emission (kvt_batch_capacity); which close or
 *                                              round is due follows from counts alone, and each
 *                                              layer's run does it
 *   for each layer, inside its forward:
 *     the engine writes the step's rows (its cache-write kernel at slot_mapping, or
 *     kvt_seq_write), then
 *     kvt_batch_run(b, layer, query, stream, &emit)
 *                                              that layer's due close or round for every request,
 *                                              then the attended set — sinks ∪ kept ∪ tail ∪ this
 *                                              step's rows (∪ fetched rows, with recall) — into
 *                                              the caller's fixed-capacity buffers
 *   attention over exactly those rows
 *   kvt_batch_commit(b, n_accepted)            after the step: counts, page release (rounds,
 *                                              windows), the O(layers x heads) accounting check;
 *                                              speculative decoding reserves with
 *                                              kvt_batch_reserve_drafts and accepts k of n here
 *
 * The decisions are those a commit of the same rows makes: a layer's round or close happens in
 * its run, so the step's attention already sees it, and a commit completes whatever a layer's run
 * did not (a layer the engine never ran, a retry after a host-memory failure). Pages are returned
 * only at commit, so every slot of the step's slot_mapping stays valid for all layers during the
 * step. Between plan and commit a request answers no by-position query (kvt_seq_row_state,
 * read_row, positions, last_slot_map, layer_stats, block_table, kvt_seq_check):
 * KVT_ERR_BAD_STATE; they describe the committed state between steps.
 *
 * Memory spaces and streams. Everything a step's device work reads or writes lives in the
 * backend's memory space, allocated at creation or at reserve (never in a run): the row pool,
 * the page tables' mirrors, σ and the kept sets, the eviction positions, keep sets, slot maps
 * and archive, the emission arrays the engine hands in (kvt_buffer on a device backend). The
 * host keeps counts and O(1) descriptions; a run enqueues, for the whole batch, one call per
 * layer and kind of work (the closing blocks' σ, one segmented top-m, the rounds' selections and
 * moves, the packing of the attended sets) on its stream and reads nothing back except a close's
 * two counters. The commit's device work (what deferred runs left, rounds of layers never run)
 * goes on the stream of the step's last run. The CPU backends execute each op when it is
 * enqueued, which is one valid order of the stream; the guarded backend (KVT_BACKEND_GUARDED)
 * refuses any op argument outside its buffers and faults on any host touch of them.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt_batch kvt_batch;

/* A batch of at most max_seqs requests of ctx (reused step after step). KVT_ERR_INVALID_ARGUMENT,
 * KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_batch_create(kvt_ctx *ctx, uint32_t max_seqs, kvt_batch **out);
/* NULL is a no-op. A step in flight is abandoned: its reservations are released (no row of it is
 * committed) — valid only before any kvt_batch_run of the step; after one, commit first (the
 * requests then keep their reservation and can only be destroyed). kvt_ctx_destroy destroys the
 * context's live batches; none may be used after it. */
KVT_API void kvt_batch_destroy(kvt_batch *batch);

/* Reserve n_tokens[i] new tokens for seqs[i], i < n_seqs (distinct requests of the batch's
 * context, none with a reservation pending), in every layer: all or nothing over the whole batch.
 * n_tokens[i] = 0 is a request that only attends this step (its run emits its attended set; its
 * commit finishes any policy work a failed earlier commit left, as a retry).
 * KVT_ERR_POOL_EXHAUSTED (the message names the request and group) leaves every request and pool
 * unchanged: preempt and retry. KVT_ERR_BAD_STATE when the batch already has a step in flight or
 * a request is in another one or damaged. KVT_ERR_CAPACITY when n_seqs > max_seqs or a request
 * would pass max_rows_per_seq; KVT_ERR_ARCHIVE_FULL when a round the step makes due would pass
 * archive_rows_per_seq; KVT_ERR_OUT_OF_MEMORY (host bookkeeping); each with nothing reserved. */
KVT_API kvt_status kvt_batch_reserve(kvt_batch *batch, kvt_seq *const *seqs,
                                     const uint32_t *n_tokens, uint32_t n_seqs);
/* vLLM's slot_mapping for the step: slots[t] = the slot of the batch's t-th new token (request
 * order, then token order) in the group of `layer` (every layer of a group shares it), *n =
 * total new tokens. KVT_ERR_CAPACITY (nothing written) when capacity < *n. */
KVT_API kvt_status kvt_batch_slot_mapping(const kvt_batch *batch, uint32_t layer, int32_t *slots,
                                          uint32_t capacity, uint32_t *n);
/* The same in int64, the dtype of vLLM's slot_mapping (reshape_and_cache,
 * reshape_and_cache_flash: `slot_mapping: torch.Tensor  # [num_tokens]`, int64; -1 skips a
 * token): slots[t] as above, widened. Same statuses. */
KVT_API kvt_status kvt_batch_slot_mapping64(const kvt_batch *batch, uint32_t layer,
                                            int64_t *slots, uint32_t capacity, uint32_t *n);
/* Fix the step: from here to commit its requests are read-only by position (the by-position and
 * statistics calls answer KVT_ERR_BAD_STATE) and its runs may start. Host only; it touches no
 * row, allocates nothing and decides nothing: which closes and rounds the step makes due follows
 * from counts, and each layer's first kvt_batch_run does them (or kvt_batch_commit, for a planned
 * step: kvt_batch_plan_device). KVT_ERR_BAD_STATE without a reservation. */
KVT_API kvt_status kvt_batch_plan(kvt_batch *batch);
/* After plan: the per-request row capacity (topk) that always suffices for kvt_batch_run on
 * `layer` this step — the longest request's rows, this step's included, which a step that must
 * attend every row (recall overflow, calibration) needs; *total: their sum (CSR capacity). */
KVT_API kvt_status kvt_batch_capacity(const kvt_batch *batch, uint32_t layer, uint32_t *topk,
                                      uint32_t *total);

/* Speculative decoding: as kvt_batch_reserve, where the last n_drafts[i] of request i's
 * n_tokens[i] tokens are drafts that kvt_batch_commit may reject (n_drafts NULL: none; each at
 * most n_tokens[i]). A request with drafts runs no policy work in kvt_batch_run: every block
 * close or eviction round its step makes due runs at commit, over the accepted rows only, so the
 * decisions are exactly those of a step that reserved the accepted tokens alone; meanwhile its
 * attended set is the committed one plus the step's rows (each query token: the rows up to its
 * own, with kvt_emit.queries_per_seq). KVT_ERR_INVALID_ARGUMENT for n_drafts[i] > n_tokens[i];
 * otherwise the errors of kvt_batch_reserve. */
KVT_API kvt_status kvt_batch_reserve_drafts(kvt_batch *batch, kvt_seq *const *seqs,
                                            const uint32_t *n_tokens, const uint32_t *n_drafts,
                                            uint32_t n_seqs);

/* The emission layouts and struct kvt_emit: kvtier_emit.h. */
#include "kvtier_emit.h"

/* After kvt_batch_plan, before the layer's first run of the step: *fits = whether kvt_batch_run
 * of `layer` can emit this step in `layout` — for KVT_EMIT_PAGED, every request's set is whole
 * pages as the layout states (false also where a request's close or eviction round is due on
 * the layer this step, which that run does first: its set is known only after it; a
 * full-attention, sliding-window or random-eviction layer, whose sets are whole pages after any
 * round, still answers true unless a request recalls there); true for the other layouts.
 * Host only, no side effect. kvt_batch_run's layer statuses (KVT_ERR_OUT_OF_RANGE,
 * KVT_ERR_POLICY_MISMATCH for a layer without per-token KV, KVT_ERR_BAD_STATE before plan);
 * KVT_ERR_INVALID_ARGUMENT (NULL, an unknown layout). */
KVT_API kvt_status kvt_batch_emit_fits(const kvt_batch *batch, uint32_t layer,
                                       kvt_emit_layout layout, bool *fits);

/* CUDA graphs: plan the step's emission on the device. After kvt_batch_plan and before any run,
 * for a step in which no layer's run has host-decided work of its own — no request with drafts,
 * none with several tokens on a recalling layer, no block close or eviction round due (the
 * commit does the step's policy work then: the same decisions) — write every layer's
 * attended-set descriptions (and
 * the page tables' new entries, the salience layers' recall steps, and 0 into the emissions'
 * dense flags where no request recalls) into the batch's plan buffer in the backend's memory,
 * on stream. Each kvt_batch_run of the step then enqueues, on a layer that plans recall, one
 * planned recall step (the trigger of every recalling request: calibration, scan, fetched rows,
 * promotion and dense flags, on the device), then one pack launch; both read their per-step
 * values from that buffer when they run, so the runs of one such step captured into a CUDA
 * graph (cudaStreamBeginCapture on stream around the engine's forward) replay over later
 * planned steps, recall included: every step, reserve, write rows and queries, plan,
 * plan_device, launch the graph, commit. A step that is not plannable (*planned = false,
 * KVT_OK, nothing written) runs eagerly: kvt_batch_run as usual.
 *
 * A layer plans recall when it is a salience layer where requests may recall (sketch planes,
 * and config.recall on or a request created with recall on) of a context that states
 * max_rows_per_seq (by which the planned step's launch and workspace are sized once, reserved
 * here, outside any capture), whether or not a request of the step recalls; which layers do is
 * fixed at the batch's first planned step (a batch planned before the first recalling request
 * runs that request's recalling steps eagerly: a new batch plans them). A planned run of such a
 * layer takes the query (KVT_ERR_INVALID_ARGUMENT when NULL), a buffer that holds max_seqs
 * requests' queries at their places in the batch (the graph replays over steps of any size);
 * emit.dense, when given, holds max_seqs flags, each planned run writing them as an eager run
 * does. Without max_rows_per_seq, steps in which a request recalls are not plannable. A RoPE
 * layer where requests may recall (random eviction's archive with recall_sketch_rank) plans its
 * RoPE recall the same way: the planned trigger, the pack, then the planned emission of the
 * recalling requests' lists (TOKENS on an MLA-RoPE layer, CSR, or CSR_KV_HEADS, their lists
 * placed by the device's counts). With config.recall_lagged_query the planned recall step scans
 * with the kept queries and then keeps the step's own, as an eager run does.
 *
 * emits: the emission each layer's run will pass (n_emits = 1: the same for every layer, or
 * n_emits = n_layers), TOKENS, CSR, CSR_KV_HEADS or PAGED with one query per request — an array
 * of n_emits elements of the caller's struct_size each (an older caller's smaller kvt_emit: read
 * at that stride, every element stating the same size); a run of a planned step must
 * pass exactly that emission, and every planned step of a batch the emissions of its first one
 * (the arrays and capacities a captured graph writes; KVT_ERR_INVALID_ARGUMENT otherwise, nothing
 * planned: plan other emissions on another batch). The plan buffer, n_layers x
 * (64 + 112 max_seqs) B on 64-bit hosts (CSR_KV_HEADS: 112 B a request and KV head), is
 * allocated at the batch's first planned step and never moves: a graph stays valid for the
 * batch's life with the same emission buffers; every planned step copies all of it (one write).
 * A layer that plans recall adds max_seqs recall items (384 B each on 64-bit hosts; on a RoPE
 * layer 616 + 216 B). stream: that of the graph launch
 * (stream-ordered after the previous step's device work). Errors:
 * KVT_ERR_BAD_STATE (not planned, already run, planned twice, a damaged request),
 * KVT_ERR_INVALID_ARGUMENT (emits; on the guarded backend an array outside its buffers, as for
 * kvt_batch_run), KVT_ERR_CAPACITY (as kvt_batch_run's, nothing planned), KVT_ERR_UNSUPPORTED
 * (PAGED on a layer where a request's set is not whole pages: nothing planned),
 * KVT_ERR_OUT_OF_MEMORY (the buffer), a backend status. */
KVT_API kvt_status kvt_batch_plan_device(kvt_batch *batch, const kvt_emit *emits,
                                         uint32_t n_emits, void *stream, bool *planned);

/* Run `layer` for the step: its due close or eviction round for every request of the batch (at
 * most once per step and layer; a second run of the layer only emits), then write the attended
 * sets into emit. query: the absorbed queries for the recall tier, fp32 in the backend's memory,
 * [n_seqs][n_q_heads][value_dim + branch_dim] (latent first, then the branch; multiplied by the
 * softmax scale), one query per request (its step's last token), request i at the batch's i-th
 * place; on a GQA/MHA-RoPE layer whose archive recalls (docs/recall.md §9) the post-RoPE queries
 * [n_seqs][n_q_heads][head_dim] (scaled alike; query head t attends KV head t / (n_q_heads /
 * n_kv_heads)); read only for requests with recall on such a layer, otherwise ignored (may be NULL
 * when no request of the batch recalls: KVT_ERR_INVALID_ARGUMENT otherwise). stream: a cudaStream_t on the CUDA backend, where every op of the run goes (the
 * CPU backends run each op as it is enqueued); the commit reuses the last run's.
 * Checked before any work (nothing done, nothing emitted): KVT_ERR_INVALID_ARGUMENT (emit NULL,
 * its struct_size below KVT_EMIT_SIZE_MIN, an unknown layout, a NULL array, queries_per_seq
 * above KVT_MAX_QUERIES_PER_SEQ; on the guarded backend an emission array, at the extent the
 * step writes, or the query where the run reads it, outside the backend's buffers: host memory
 * is the caller's error, named in the message), KVT_ERR_CAPACITY when queries_per_seq > 1 is below a
 * request's n_tokens, KVT_ERR_BAD_STATE before plan, on a damaged request, or for per-token
 * emission of a multi-token request whose earlier run of this layer already did its policy work.
 * KVT_ERR_UNSUPPORTED (PAGED where a request of the batch recalls on the layer).
 * After the work: KVT_ERR_CAPACITY (the layer's work is done, nothing emitted) when a set
 * exceeds the capacity — kvt_batch_capacity says what suffices; KVT_ERR_UNSUPPORTED (the
 * same) when PAGED meets a set that is not whole pages (kvt_batch_emit_fits says beforehand);
 * KVT_ERR_OUT_OF_MEMORY (host) from a close or round: nothing of that request's layer changed
 * and the commit retries it;
 * KVT_ERR_CORRUPT: a device error mid-compaction damaged a request (destroy it after commit). */
KVT_API kvt_status kvt_batch_run(kvt_batch *batch, uint32_t layer, const void *query,
                                 void *stream, const kvt_emit *emit);
/* Commit the step: the first n_accepted[i] tokens of seqs[i] (NULL: all reserved). Only drafts
 * (kvt_batch_reserve_drafts) may be rejected: n_accepted[i] below n_tokens[i] - n_drafts[i], or
 * above n_tokens[i], is KVT_ERR_INVALID_ARGUMENT with nothing committed (the step stays open).
 * Rejected rows are forgotten and their pages return; the engine writes the next step's tokens
 * at the slots the next reserve gives. Completes every layer's
 * policy work the runs did not do, returns pages (eviction rounds, sliding windows) and checks
 * the accounting. Every request is committed even when one fails; the first failure is returned
 * and named: KVT_ERR_OUT_OF_MEMORY (rows stored and attended, the policy work finishes at the
 * next commit), KVT_ERR_CORRUPT (that request is damaged: destroy it), KVT_ERR_INVARIANT (a bug:
 * please report it). After it the batch is ready for the next reserve. */
KVT_API kvt_status kvt_batch_commit(kvt_batch *batch, const uint32_t *n_accepted);

/* Block table of a sequence's group for this layer: pages[0..*n_pages) and *n_rows, the
 * committed rows of the group (reserved rows lie in the pages after them). For evict groups and
 * none groups of full-attention layers the table holds rows [0, *n_rows) and is the attended
 * set. A none group whose layers are all sliding-window layers returns its leading pages once
 * their rows are older than its widest window W: the table then holds only the pages of rows
 * [first_page * page_rows, *n_rows), i.e. pages[k] holds positions (first_page + k) * page_rows
 * onwards (kvt_seq_first_row gives first_page * page_rows); at least the last min(W, *n_rows)
 * rows are there, and each layer attends the last sliding_window of them (kvt_batch_run lists
 * exactly those). Between steps only (KVT_ERR_BAD_STATE during one). */
KVT_API kvt_status kvt_seq_block_table(const kvt_seq *seq, uint32_t layer, int32_t *pages,
                                       uint32_t capacity, uint32_t *n_pages, uint64_t *n_rows);
/* Original position held by the first row of the block table's first page: 0, except for a
 * sliding-window group that has returned leading pages (then first_page * page_rows). */
KVT_API kvt_status kvt_seq_first_row(const kvt_seq *seq, uint32_t layer, uint64_t *first_row);

/* ---------------------------------------------------------------------------------------------
 * Rows by original position (for tests, inspection and the recall tier)
 *
 * These calls, kvt_seq_layer_stats, kvt_seq_check, kvt_layer_read and kvt_layer_write inspect
 * state off the decode path: on a device backend they synchronise with the device (they wait for
 * the work enqueued on the context's stream) and may be slow, so never inside a captured graph;
 * the by-position and statistics calls answer KVT_ERR_BAD_STATE between kvt_batch_plan and
 * kvt_batch_commit.
 * ------------------------------------------------------------------------------------------- */
typedef enum kvt_row_state {
    KVT_ROW_ATTENDED = 0, /* in the attended tier (sink, kept, tail, or stored in an evict group) */
    KVT_ROW_ARCHIVED = 1, /* in the archive: bytes kept exactly */
    KVT_ROW_DROPPED = 2,  /* not stored any more: evicted and dropped by random eviction, or
                           * older than every window of a sliding group (its page returned) */
    KVT_ROW_PENDING = 3,  /* reserved, not committed */
} kvt_row_state;

/* State of (layer, kv head, position); *slot is its current slot when attended or pending,
 * else -1. On a sliding layer the last sliding_window rows are ATTENDED; older rows still within
 * the group's widest window W are ARCHIVED (stored, readable); rows older than that are DROPPED
 * once their page went back to the pool. KVT_ERR_OUT_OF_RANGE beyond the reserved rows or for a
 * bad layer/head, KVT_ERR_POLICY_MISMATCH for a no-KV layer. */
KVT_API kvt_status kvt_seq_row_state(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                     uint64_t position, kvt_row_state *state, int32_t *slot);
/* Copy the row_bytes of (layer, plane, head, position) into dst (attended or archived).
 * KVT_ERR_DROPPED for a dropped row (random eviction, or a sliding group's returned page). */
KVT_API kvt_status kvt_seq_read_row(const kvt_seq *seq, uint32_t layer, uint32_t plane,
                                    uint32_t head, uint64_t position, void *dst, size_t dst_bytes);
/* Original position held by each slot index 0..n-1 of the group for one head (evict groups
 * differ per head). positions has capacity entries; *n receives the count. In a sliding group
 * that returned leading pages, row indices before the first live page read -1. */
KVT_API kvt_status kvt_seq_positions(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                     int64_t *positions, uint64_t capacity, uint64_t *n);
/* Slot map of the last eviction round of layer's group for one head: old_to_new[old row index]
 * = new row index, or -1 when evicted. capacity entries; *n = rows before the round. */
KVT_API kvt_status kvt_seq_last_slot_map(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                         int32_t *old_to_new, uint64_t capacity, uint64_t *n);

/* ---------------------------------------------------------------------------------------------
 * Statistics and invariants
 * ------------------------------------------------------------------------------------------- */
/* attended_rows is per KV head (every head of a layer attends as many rows); archived_rows and
 * dropped_rows sum over heads, so attended_rows x n_kv_heads + archived_rows + dropped_rows =
 * appended_rows. On a sliding layer attended_rows = min(sliding_window, tokens); rows between
 * the layer's window and the group's widest window are archived; older rows are dropped and
 * their pages counted out of pages_in_use / bytes_in_use. */
typedef struct kvt_layer_stats {
    size_t struct_size;
    kvt_policy policy;
    uint64_t appended_rows;   /* committed tokens x kv heads */
    uint64_t attended_rows;   /* per KV head */
    uint64_t sink_rows, kept_rows, tail_rows; /* salience layers */
    uint64_t archived_rows;   /* rows stored but not attended (sum over heads) */
    uint64_t dropped_rows;    /* rows no longer stored: evicted and dropped, or older than a
                               * sliding group's window (sum over heads) */
    uint64_t closed_rows;     /* salience: rows in closed blocks */
    uint64_t closes;          /* salience: blocks closed */
    uint64_t rounds;          /* evict: rounds run */
    uint64_t nonfinite_sigma; /* salience: rows scored +inf because their score was not finite:
                               * a NaN/Inf in the branch (such a row is left out of its block's
                               * fit, so it changes no other row's σ) or an fp32 overflow. They
                               * rank first: attended, one slot of the budget each. */
    uint64_t sigma_bytes_read;/* salience: bytes read to score rows */
    uint64_t pages_in_use;    /* pages of this layer's group held by the sequence now (its
                               * table's, and the fetch area of recall on a RoPE layer) */
    uint64_t bytes_in_use;    /* pool bytes of this layer held (pages x page_rows x row size) */
    uint64_t archive_bytes;   /* bytes held in the separate archive pool for this layer */
    uint64_t prompt_rows;     /* protected prompt rows */
    bool prompt_over_budget;  /* prompt alone exceeded K: only its first K-1 rows protected */
    double attended_bytes_per_token; /* bytes attention reads per committed token this step */
    /* Recall (salience layers of a context with params.recall_sketch_rank): */
    uint32_t recall_rank;     /* rank of the layer's basis (0: none) */
    uint32_t recall_basis_id; /* CRC-32 of the basis's bytes (0: none) */
    uint64_t sketched_rows;   /* closed rows that carry a sketch (0 without sketch planes) */
    /* Prefix sharing (kvt_seq_fork, kvt_seq_attach): how many of pages_in_use another request
     * holds too — the memory the requests share, which the pool counts once
     * (kvt_ctx_free_pages). */
    uint64_t shared_pages;
    /* Recall trigger (a salience layer of a request with recall on; zero otherwise): the
     * certificate of the last step and totals over the request's steps (single-query steps). */
    int32_t recall_mode;          /* the request's kvt_recall_mode */
    int32_t recall_phase;         /* conformal: 0 calibrating, 1 calibrated, 2 provisional */
    float recall_z;               /* the multiplier: conformal z (8 until calibrated), sound
                                   * √(D − 64), margin δ */
    uint32_t recall_samples;      /* calibration samples recorded */
    uint64_t recall_steps;        /* steps the trigger ran */
    uint64_t recall_calib_steps;  /* of which calibration steps (every row attended) */
    uint64_t recall_overflow_steps; /* of which more than W rows fired (every row attended) */
    uint64_t recall_visited_rows; /* archived rows the scans evaluated (sum over steps) */
    uint64_t recall_fired_rows;   /* rows that fired (sum; an overflow step counts W + 1) */
    uint64_t recall_fetched_rows; /* archived rows attended (sum; dense steps count them all) */
    uint64_t recall_last_archived, recall_last_visited, recall_last_fired, recall_last_fetched;
    bool recall_last_dense;       /* the last step attended every row */
    bool recall_last_overflow;
    /* Committed rows per attended row (per KV head) now: the compression the step really gets,
     * tail included (0 when nothing is attended). */
    double effective_ratio;
    /* Backend bytes the layer holds for this request beyond its pool pages (capacity): the
     * policy's side planes (salience: σ, kept set, recall sketches; eviction: positions, slot
     * map, keep sets, the archive's position indices and sketches — its rows are in
     * archive_bytes) and the recall trigger's buffers (and group planes). */
    uint64_t side_bytes;
    /* Of side_bytes, the planes this request shares with others (kvt_seq_fork, kvt_seq_attach:
     * the σ and sketch planes of the closed blocks they share, fixed once written, shared for
     * as long as the holders live). kvt_ctx_memory counts them once. */
    uint64_t shared_side_bytes;
    /* Recall promotion (config.recall_promote_capacity > 0; zero otherwise): rows promoted now
     * (attended at every step without recall, part of the certificate), the room the last close
     * reserved for them, and totals: rows promoted, demoted (no hit in the window at a close),
     * absorbed (a close kept them by σ); then the rows the last step attended as promoted (the
     * step's certificate: promotions at a step take effect at the next). */
    uint64_t recall_promoted;
    uint64_t recall_promote_room;
    uint64_t recall_promotions, recall_demotions, recall_absorbed;
    uint64_t recall_last_promoted; /* promoted rows the last step attended (its certificate) */
    /* config.recall_lagged_query: the last recall step scanned with the previous recall step's
     * queries (false: with its own, as every step does without the option, and the first). */
    bool recall_last_lagged;
    /* Archive placement and traffic (random eviction with the archive): the space its rows live
     * in (kvt_ctx_params.archive_space), and the bytes recall steps copied out of it into the
     * fetch area — every plane of each fetched (row, KV head) — over the request's steps and at
     * the last one (with a host archive: the bytes that crossed the bus; calibration steps also
     * read every archived key in place, recall_calib_steps says how many there were). */
    int32_t archive_space;
    uint64_t recall_moved_bytes;
    uint64_t recall_last_moved_bytes;
} kvt_layer_stats;
/* Oldest kvt_layer_stats layout this library writes (an output: written up to
 * min(struct_size, sizeof)). */
#define KVT_LAYER_STATS_SIZE_MIN (offsetof(kvt_layer_stats, attended_bytes_per_token) + sizeof(double))

KVT_API kvt_status kvt_seq_layer_stats(const kvt_seq *seq, uint32_t layer, kvt_layer_stats *out);

/* Full invariant check of a sequence (every layer, every head): counters add up, membership sets
 * are disjoint and cover every appended row, page tables are valid, slot maps are bijections.
 * KVT_OK, or KVT_ERR_INVARIANT with the first violation in kvt_last_error(). O(rows).
 * KVT_ERR_BAD_STATE (not a check) for a request with a step in flight, or one whose batch was
 * destroyed after a run of its step (kvt_batch_destroy: it can only be destroyed). */
KVT_API kvt_status kvt_seq_check(const kvt_seq *seq);

/* ---------------------------------------------------------------------------------------------
 * Snapshots: one request's whole state, to memory or to a file, and back
 *
 * A snapshot holds, for one request between steps: its committed rows (every layer's pool rows,
 * each plane, in row-index order: positions for salience, none and sliding layers, the compacted
 * order of random eviction), every policy's state (salience: the σ score plane, the kept set and
 * the close counters; random eviction: each head's positions, the last slot map, the round
 * counters and the archive with its bytes; sliding: the pages already returned), the page
 * tables' counts, the request's id, prompt length, ratio and recall mode, and the statistics. A
 * restored request continues exactly as the original would have: the same closes, the same
 * eviction draws (keyed by the saved request id), the same keep sets and archived bytes; its
 * attended sets are the same by position (slots differ when the pool hands out other pages).
 * With recall, the sketch planes and the trigger's state (calibration samples, z, counters)
 * travel too.
 *
 * Restore needs a context of the same model (every layer's spec), the same configuration (every
 * field of kvt_config; the request's own ratio and recall travel with it), the same page_rows,
 * per-layer policies and parallelism offsets: anything else is KVT_ERR_MISMATCH naming the first
 * difference. The pool size, max_seqs and the backend may differ: restore across backends is
 * supported: every byte goes through the backend's read and write ops, so a snapshot taken on
 * one backend restores on any other (CPU <-> guarded tested; CPU <-> CUDA uses the CUDA
 * backend's same ops, tested where a device is present), as is restore into the context that
 * took it (once the original is destroyed: request ids are unique among live requests) or into
 * another one.
 *
 * Format: a kvtier container (docs/snapshot-format.md): file header, sections each with a CRC-32
 * (zlib's) over its payload and one over its header, END. Versioned: a newer major version is
 * KVT_ERR_UNSUPPORTED, as is an unknown section marked critical. Restore checks everything before
 * the request becomes visible — every CRC, every size against the configuration, every count,
 * positions ascending, kept sets inside the closed rows, archived positions not held, then the
 * full invariant check (kvt_seq_check) — and on any failure returns the status with nothing
 * changed: no request, every page back in its pool, no allocation kept.
 *
 * Threads: scheduler calls ("Threads"); kvt_snapshot_* are pure and may run on any thread.
 * ------------------------------------------------------------------------------------------- */
/* Bytes kvt_seq_snapshot will write for seq now. Between steps only: KVT_ERR_BAD_STATE for a
 * request with a reservation open (reserved, planned, not committed) or damaged;
 * KVT_ERR_INVALID_ARGUMENT for NULL. */
KVT_API kvt_status kvt_seq_snapshot_size(const kvt_seq *seq, size_t *bytes);
/* Write the snapshot of seq into buf[0..capacity) (caller's host memory); *written = its length
 * (may be NULL). The request is not changed. KVT_ERR_CAPACITY (nothing meaningful written) when
 * capacity is below kvt_seq_snapshot_size; KVT_ERR_BAD_STATE as kvt_seq_snapshot_size;
 * KVT_ERR_OUT_OF_MEMORY (host scratch); a backend error reading rows. */
KVT_API kvt_status kvt_seq_snapshot(const kvt_seq *seq, void *buf, size_t capacity,
                                    size_t *written);
/* A new request of ctx holding the state of the snapshot buf[0..len) (the caller keeps buf), of
 * the snapshot's request id: a request of that id must not be live in ctx (as for
 * kvt_seq_create; a preempted request is destroyed before its restore, or restored into another
 * context). *out is NULL on failure, and then nothing changed. Errors: KVT_ERR_INVALID_ARGUMENT
 * (NULL; the request id already live in ctx),
 * KVT_ERR_PARSE (truncated, malformed, sizes or counts that do not fit), KVT_ERR_CORRUPT (a
 * checksum, or a state that fails its invariants), KVT_ERR_UNSUPPORTED (a newer format),
 * KVT_ERR_MISMATCH (another model, configuration, page size, policy or parallelism: the message
 * names what differs), KVT_ERR_CAPACITY (max_seqs, max_rows_per_seq or archive_rows_per_seq too
 * small), KVT_ERR_POOL_EXHAUSTED (not enough free pages), KVT_ERR_BAD_STATE (external storage
 * not bound yet), KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_seq_restore(kvt_ctx *ctx, const void *buf, size_t len, kvt_seq **out);
/* kvt_seq_snapshot into the file at path, atomically: a temporary file "<path>.tmp.XXXXXX" in
 * the same directory, locked (flock) by the writer while it exists, written, fsync'ed, renamed
 * over path, then the directory fsync'ed. On any failure the temporary file is removed and a
 * file already at path is left as it was (a failing directory fsync is reported after the
 * rename: the new file is then in place). The file is created with mode 0600 (mkstemp). A writer
 * killed mid-write leaves its temporary behind: each call first removes the stale temporaries of
 * the same path (the rule of kvt_snapshot_clean with min_age_s = KVT_SNAPSHOT_STALE_SECONDS; a
 * temporary that cannot be removed is skipped). KVT_ERR_IO (with the failing step and errno's
 * text) besides kvt_seq_snapshot's errors. */
KVT_API kvt_status kvt_seq_snapshot_file(const kvt_seq *seq, const char *path);
/* The age below which a temporary is never stale (seconds of modification time): it covers the
 * moment between a writer creating its temporary and locking it, and writers that take no lock
 * (kvtier builds older than this rule) while they write. */
#define KVT_SNAPSHOT_STALE_SECONDS 60
/* Remove the stale temporaries that killed snapshot (and recall basis) writers left in dir: files
 * named "<name>.tmp.XXXXXX" (XXXXXX six letters or digits) that are regular, empty or beginning
 * with a prefix of a kvtier file's magic (a writer may be killed after any byte), last modified
 * at least min_age_s seconds ago, and not locked by a live writer. A live writer of this library
 * holds its temporary's lock until the rename, and a dead one holds none, so no temporary in use
 * is removed; with min_age_s = 0 a writer caught between creating and locking its temporary can
 * lose it, and then reports KVT_ERR_IO (nothing is silently lost). Other files are never
 * touched. *n_removed (may be NULL) receives the count. KVT_ERR_INVALID_ARGUMENT (NULL or empty
 * dir), KVT_ERR_IO (dir cannot be listed), KVT_ERR_OUT_OF_MEMORY. Files that cannot be removed
 * are skipped. */
KVT_API kvt_status kvt_snapshot_clean(const char *dir, uint32_t min_age_s, uint32_t *n_removed);
/* kvt_seq_restore of the file at path. KVT_ERR_IO when it cannot be read. */
KVT_API kvt_status kvt_seq_restore_file(kvt_ctx *ctx, const char *path, kvt_seq **out);

/* For tools (kvtier-inspect): a context of the snapshot's own model, configuration, page size,
 * policies and parallelism, on the given backend, with just enough pages in each pool to restore
 * it (the snapshot's checksums and sizes are checked first); the recall settings META does not
 * hold (recall_cap_rows, recall_margin, recall_promote_*) come from its RECALL sections. Restore the snapshot into it to
 * verify or inspect it. Errors: those of kvt_seq_restore's parsing, and of kvt_ctx_create;
 * KVT_ERR_OUT_OF_MEMORY, nothing allocated, when its pools would take more than 8 x len + 256
 * MiB (a page of the snapshot's page size far larger than its rows: a damaged file). */
KVT_API kvt_status kvt_snapshot_context(const void *buf, size_t len, kvt_backend_kind backend,
                                        kvt_ctx **out);

/* The σ scores of a salience layer's closed rows, by position (for inspection): scores has
 * capacity entries, *n receives the closed rows; non-finite σ reads +Inf. Between steps only.
 * KVT_ERR_POLICY_MISMATCH for a layer without scores, KVT_ERR_CAPACITY when capacity < *n
 * (nothing written; NULL scores asks for *n only). */
KVT_API kvt_status kvt_seq_scores(const kvt_seq *seq, uint32_t layer, float *scores,
                                  uint64_t capacity, uint64_t *n);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_H */
