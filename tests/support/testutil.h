/* testutil.h — helpers shared by the Criterion tests (seeded randomness, paths, row filling). */
#ifndef KVT_TESTS_TESTUTIL_H
#define KVT_TESTS_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Directory holding the real model configs (tests/data/models, or $KVT_MODELS_DIR). */
const char *tu_models_dir(void);
/* Path of a model config inside tu_models_dir() (static buffer, valid until the next call). */
const char *tu_model_path(const char *file);

/* Deterministic test RNG (splitmix64); every test prints its seed on failure. */
typedef struct tu_rng {
    uint64_t s;
} tu_rng;
uint64_t tu_next(tu_rng *r);
double tu_uniform(tu_rng *r);  /* [0, 1) */
double tu_normal(tu_rng *r);   /* standard normal (Box-Muller) */
/* A random fp8 row in FlashMLA's 656-B ds_mla layout: 512 E4M3 latent bytes (never the NaN
 * pattern), four fp32 scales in [0.002, 0.012) at byte 512, 64 bf16 branch values (normal draws,
 * rounded to nearest even) at byte 528. */
void tu_fp8_row(tu_rng *r, uint8_t *row);
/* rank orthonormal rows of n values into out ([rank][n] fp32): Gram-Schmidt in double on
 * normal draws from r, two passes for accuracy (kvt_orthonormalise_rows). false when out of
 * memory or the rows come out dependent (rank > n). */
bool tu_orthonormal_rows(tu_rng *r, uint32_t rank, uint32_t n, float *out);

/* ---------------------------------------------------------------------------------------------
 * Single-request drivers over the batch API (kvtier.h's step timeline), for tests that exercise
 * one request at a time. Each keeps a batch of one per request between tu_reserve and tu_commit
 * (tests are single-threaded). Statuses and messages are the library's.
 * ------------------------------------------------------------------------------------------- */
#include "kvtier.h"

/* A small model with one layer of each policy: salience (MLA NoPE, 1 head), two random-eviction
 * layers (GQA RoPE, 2 heads of 16 fp16), a sliding window of TU_WINDOW rows (GQA, 2 heads of 8
 * bf16); NULL on failure. Its context: block_rows TU_BLOCK, kappa 4, ratio 8, K TU_K, r = c =
 * TU_R, pages of 16 rows, libc allocation, the archive as asked; NULL on failure. */
enum { TU_L_SAL = 0, TU_L_EV1 = 1, TU_L_EV2 = 2, TU_L_SLIDE = 3, TU_N_LAYERS = 4 };
enum { TU_BLOCK = 64, TU_K = 32, TU_R = 8, TU_WINDOW = 40 };
kvt_model *tu_mixed_model(void);
kvt_ctx *tu_mixed_ctx(kvt_model *m, bool archive, uint32_t n_pages);
/* That context's config (the archive as asked, the random-eviction budget K). */
kvt_config tu_mixed_config(bool archive, uint32_t K);
/* The same with the random-eviction budget K given. */
kvt_ctx *tu_mixed_ctx_k(kvt_model *m, bool archive, uint32_t n_pages, uint32_t K);
/* The same with recall sketch planes of sketch_rank values a row on the salience layer (no
 * basis set: each sketch is 0 and ρ the latent's norm). */
kvt_ctx *tu_mixed_ctx_sketch(kvt_model *m, bool archive, uint32_t n_pages, uint32_t K,
                             uint32_t sketch_rank);
/* The same with max_seqs request slots of max_rows rows each (0, 0: none). */
kvt_ctx *tu_mixed_ctx_slots(kvt_model *m, bool archive, uint32_t n_pages, uint32_t K,
                            uint32_t sketch_rank, uint32_t max_seqs, uint32_t max_rows);
/* The same (K TU_K, no sketch, no slots) with pages of page_rows rows. */
kvt_ctx *tu_mixed_ctx_pages(kvt_model *m, bool archive, uint32_t n_pages, uint32_t page_rows);
/* The bytes of a row: a function of (layer, plane, position, seed); every byte <= 0x3f, so every
 * element is finite. */
void tu_row_bytes(uint8_t *buf, size_t n, uint32_t l, uint32_t pl, uint64_t pos, uint64_t seed);

/* kvt_seq_create with request_id set (other parameters default). */
kvt_status tu_seq_create(kvt_ctx *ctx, uint64_t request_id, kvt_seq **out);
/* kvt_batch_reserve of n tokens for seq in a batch of its own. */
kvt_status tu_reserve(kvt_seq *seq, uint32_t n);
/* kvt_batch_plan + kvt_batch_commit of seq's step (n must be what tu_reserve took; another n
 * gives the library's answer and the step stays open). All policy work happens at commit. */
kvt_status tu_commit(kvt_seq *seq, uint32_t n);
/* The same, but the step runs every layer with KV first (kvt_batch_run), so the policy work
 * happens inside the runs, as in an engine's forward; commit finishes it. */
kvt_status tu_commit_run(kvt_seq *seq, uint32_t n);
/* kvt_batch_run of a step of n_seqs requests into the caller's host arrays: directly on the CPU
 * backend; on another backend through kvt_buffer memory (the emission's space), read back after
 * the run. */
kvt_status tu_run(kvt_batch *b, kvt_ctx *ctx, uint32_t layer, uint32_t n_seqs, const kvt_emit *e);
/* The attended set of a layer for requests between steps: a step of zero new tokens (reserve,
 * plan, run into the given buffers, commit). Returns run's status (commit's if run succeeded). */
kvt_status tu_attended_tokens(kvt_ctx *ctx, uint32_t layer, kvt_seq *const *seqs, uint32_t n,
                              int32_t *indices, uint32_t topk, int32_t *lengths);
kvt_status tu_attended_csr(kvt_ctx *ctx, uint32_t layer, kvt_seq *const *seqs, uint32_t n,
                           int32_t *indptr, int32_t *indices, uint32_t capacity);
/* Rows each request attends on a layer between steps (kvt_seq_layer_stats.attended_rows). */
kvt_status tu_attended_count(kvt_ctx *ctx, uint32_t layer, kvt_seq *const *seqs, uint32_t n,
                             uint32_t *counts);
/* Two requests of the same model hold the same committed rows: the same length, and at every
 * (layer with KV, head, position) the same row state and, unless dropped, the same bytes in
 * every plane. KVT_OK, or KVT_ERR_INVARIANT with the first difference in why (the library's
 * status and message when a call fails). */
kvt_status tu_same_rows(const kvt_seq *a, const kvt_seq *b, char *why, size_t why_len);

#endif
