/*
 * kvtier_trace.h — the kvtier trace format: attention-level traces (the rows a model writes into
 * its KV cache, the absorbed queries it issues, and needle annotations) in a versioned binary
 * container of CRC-checked sections. The needle suite replays them; an engine dumps them.
 *
 * The byte layout is in docs/trace-format.md; tests/golden/make_golden.py is an independent
 * writer of it. In short: a 24-byte file header (magic "\x89KVT\r\n\x1a\n", major.minor version,
 * content kind, flags, header CRC), then sections (24-byte header: type, flags, 64-bit payload
 * length, CRC-32 of the payload, CRC-32 of the header; the payload; zero padding to 8 bytes),
 * closed by an END section. Little-endian throughout. Readers skip unknown sections unless they are
 * marked critical, accept newer minor versions and refuse an unknown major version.
 *
 * Trace content. "Layer" in every call below is the MODEL layer index (0-based, as in the model's
 * config), not the position of the layer in the trace. A trace carries any subset of the model's
 * layers; for each:
 *   - its kvt_layer_spec (serialised field by field),
 *   - its rows in append order, per plane (1 for MLA, K and V for GQA): token t's rows are
 *     n_kv_heads * row_bytes bytes, [kv_head][row_bytes], exactly as the engine stored them;
 *     written in chunks (any number, any size), so a writer never holds a whole layer,
 *   - optionally its queries: one record per decode step of n_q_heads * dim elements ([head][dim],
 *     fp32 or bf16; for MLA the absorbed query, dim 576 = 512 latent | 64 branch) and the step's
 *     position = the number of rows that exist when the query is issued (the query attends rows
 *     [0, position)).
 * Plus: prompt_rows (rows protected by the RoPE policy), needles (layer, first row, row count),
 * targets (query step, query heads, needle), and a free-form provenance text.
 *
 * Reading does not load the trace: kvt_trace_open reads the directory and the small sections; rows
 * and queries are fetched on demand with pread into caller buffers. CRCs of small sections are
 * checked at open; the CRC of a rows/queries chunk is checked whenever a read covers the whole
 * chunk, and kvt_trace_verify checks every CRC in one streaming pass.
 *
 * Threading: a writer is used by one thread at a time. A reader (kvt_trace) may be read from by
 * several threads at once (reads are positional: pread), except that the per-handle last-error
 * message is shared; kvt_trace_close must not race with reads. No context is needed: these
 * functions use malloc/free.
 */
#ifndef KVTIER_TRACE_H
#define KVTIER_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Container format version this library writes. It reads any KVT_TRACE_FORMAT_MAJOR.x file and
 * refuses other majors with KVT_ERR_UNSUPPORTED. */
#define KVT_TRACE_FORMAT_MAJOR 1
#define KVT_TRACE_FORMAT_MINOR 0

/* Limits a reader enforces (and a writer refuses past): anything beyond is KVT_ERR_PARSE. */
#define KVT_TRACE_MAX_TOKENS (UINT64_C(1) << 31) /* rows per layer and plane */
#define KVT_TRACE_MAX_STEPS (UINT64_C(1) << 31)  /* query steps per layer */
#define KVT_TRACE_MAX_Q_HEADS 4096u
#define KVT_TRACE_MAX_Q_DIM 65536u
#define KVT_TRACE_MAX_TEXT_BYTES (1u << 20)
#define KVT_TRACE_MAX_NEEDLES (1u << 20)
#define KVT_TRACE_MAX_TARGETS (1u << 20)
#define KVT_TRACE_MAX_LAYERS 65536u /* model layers (n_model_layers), and layers in a trace */

/* Section types below this value are kvtier's; kvt_trace_write_section takes types >= it. */
#define KVT_TRACE_SECTION_USER 0x10000u

/* Written once, at kvt_trace_writer_open. */
typedef struct kvt_trace_meta {
    uint64_t prompt_rows;    /* rows [0, prompt_rows) are the prompt (protected by RoPE policy) */
    uint32_t n_model_layers; /* layers of the whole model; every traced layer index is below it */
    const char *text;        /* provenance, free-form UTF-8 ("generator=..\nseed=..\n"); NULL:
                                no text section. At most KVT_TRACE_MAX_TEXT_BYTES bytes. */
} kvt_trace_meta;

/* A planted needle: rows [first_row, first_row + n_rows) of one layer (every KV head, every
 * plane). Its id is its index in the needle list. */
typedef struct kvt_trace_needle {
    uint32_t layer; /* model layer index */
    uint64_t first_row;
    uint64_t n_rows; /* >= 1 */
} kvt_trace_needle;

/* A query step that must retrieve a needle: step indexes the queries of the needle's layer; heads
 * lists the query heads (each < that layer's n_q_heads) whose attention targets the needle. */
typedef struct kvt_trace_target {
    uint64_t step;
    uint32_t needle;
    uint32_t n_heads;      /* >= 1 */
    const uint32_t *heads; /* n_heads entries */
} kvt_trace_target;

/* What a reader knows about one traced layer. */
typedef struct kvt_trace_layer {
    uint32_t layer; /* model layer index */
    kvt_layer_spec spec;
    uint64_t n_tokens;  /* rows per plane (every plane has the same count) */
    uint64_t n_steps;   /* query steps (0: no queries for this layer) */
    kvt_dtype q_dtype;  /* KVT_DTYPE_FP32 or KVT_DTYPE_BF16 (meaningful when n_steps > 0) */
    uint32_t n_q_heads; /* query heads per step */
    uint32_t q_dim;     /* elements per head (MLA absorbed: 576) */
} kvt_trace_layer;

/* ---------------------------------------------------------------------------------------------
 * Writer. Sections are appended in call order; nothing is buffered beyond a 64-KiB buffer, so a
 * layer of any size can be streamed in chunks. The file is valid only after
 * kvt_trace_writer_close succeeds (it appends the END section); a crashed or aborted writer
 * leaves a file that readers refuse as truncated.
 *
 * After an I/O error every later call on the writer returns KVT_ERR_IO again (the error sticks).
 * Argument errors (KVT_ERR_INVALID_ARGUMENT, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE) write
 * nothing and do not stick. kvt_trace_writer_last_error gives the detail.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt_trace_writer kvt_trace_writer;

/* Create (truncate) path and write the file header, the META section and, when meta->text is
 * non-NULL, the TEXT section. err (may be NULL) receives the detail. *out is NULL on failure.
 * Errors: KVT_ERR_INVALID_ARGUMENT (NULL path/meta/out, n_model_layers 0 or above
 * KVT_TRACE_MAX_LAYERS, text too long), KVT_ERR_IO (cannot create or write),
 * KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_trace_writer_open(const char *path, const kvt_trace_meta *meta,
                                         kvt_trace_writer **out, char *err, size_t err_len);

/* Declare a traced layer: model layer index and its spec (checked with kvt_layer_spec_check;
 * KVT_LAYER_NO_KV is refused: it has no rows). Must precede the layer's rows and queries.
 * Errors: KVT_ERR_INVALID_ARGUMENT (bad spec, index >= n_model_layers, layer already declared),
 * KVT_ERR_IO, KVT_ERR_OUT_OF_MEMORY. */
KVT_API kvt_status kvt_trace_write_layer(kvt_trace_writer *w, uint32_t layer,
                                         const kvt_layer_spec *spec);

/* Append n_tokens rows of one plane of a declared layer (one ROWS section). rows holds
 * n_tokens * n_kv_heads * row_bytes bytes ([token][kv_head][row_bytes]); rows_bytes must equal
 * that. The chunk continues the plane where the previous one stopped; planes may be interleaved
 * with each other and with other layers (e.g. one chunk per layer per decode step, as an engine
 * dumps live). n_tokens 0 is a no-op. Errors: KVT_ERR_INVALID_ARGUMENT (NULL rows, size mismatch,
 * plane >= n_planes, total above KVT_TRACE_MAX_TOKENS), KVT_ERR_BAD_STATE (layer not declared),
 * KVT_ERR_IO. */
KVT_API kvt_status kvt_trace_write_rows(kvt_trace_writer *w, uint32_t layer, uint32_t plane,
                                        const void *rows, uint64_t n_tokens, size_t rows_bytes);

/* Append n_steps query steps of a declared layer (one QUERIES section). q holds
 * n_steps * n_q_heads * dim elements of dtype ([step][head][dim]); q_bytes must equal that.
 * positions[s] is the number of the layer's rows that exist when step s is issued; positions must
 * not decrease. dtype is KVT_DTYPE_FP32 or KVT_DTYPE_BF16. dtype, n_q_heads and dim must be the
 * same for every chunk of a layer. Steps are numbered from 0 in append order. Errors:
 * KVT_ERR_INVALID_ARGUMENT (sizes, dtype, limits, a shape differing from the layer's previous
 * chunk, decreasing positions), KVT_ERR_BAD_STATE (layer not declared), KVT_ERR_IO. Positions are
 * checked against the layer's row count by the reader (rows may be written after queries). */
KVT_API kvt_status kvt_trace_write_queries(kvt_trace_writer *w, uint32_t layer, kvt_dtype dtype,
                                           uint32_t n_q_heads, uint32_t dim,
                                           const uint64_t *positions, const void *q,
                                           uint64_t n_steps, size_t q_bytes);

/* Write the needle list (one NEEDLES section; at most once per file). Each needle's layer must
 * be declared and n_rows >= 1; ranges are checked against row counts by the reader. Errors:
 * KVT_ERR_INVALID_ARGUMENT, KVT_ERR_BAD_STATE (written twice), KVT_ERR_IO. */
KVT_API kvt_status kvt_trace_write_needles(kvt_trace_writer *w, const kvt_trace_needle *needles,
                                           uint32_t n);

/* Write the target list (one TARGETS section; at most once per file). Each target needs
 * n_heads >= 1 and non-NULL heads; needle ids, steps and heads are checked by the reader.
 * Errors: KVT_ERR_INVALID_ARGUMENT, KVT_ERR_BAD_STATE (written twice), KVT_ERR_IO. */
KVT_API kvt_status kvt_trace_write_targets(kvt_trace_writer *w, const kvt_trace_target *targets,
                                           uint32_t n);

/* Append a section of a type kvtier does not define (type >= KVT_TRACE_SECTION_USER): readers
 * that do not know it skip it, unless critical is true, in which case they refuse the file with
 * KVT_ERR_UNSUPPORTED. Errors: KVT_ERR_INVALID_ARGUMENT (type below KVT_TRACE_SECTION_USER, NULL
 * payload with bytes > 0), KVT_ERR_IO. */
KVT_API kvt_status kvt_trace_write_section(kvt_trace_writer *w, uint32_t type, bool critical,
                                           const void *payload, size_t bytes);

/* Detail of the last error on w ("" if none). Valid until the next call on w. */
KVT_API const char *kvt_trace_writer_last_error(const kvt_trace_writer *w);

/* Append the END section, flush, close and free w (always freed, even on error). Returns the
 * sticky I/O error if one happened earlier, or KVT_ERR_IO if the final write/flush/close fails;
 * err (may be NULL) receives the detail. NULL w is a no-op returning KVT_OK. */
KVT_API kvt_status kvt_trace_writer_close(kvt_trace_writer *w, char *err, size_t err_len);

/* Close and free w without finalising, and remove the file. NULL is a no-op. */
KVT_API void kvt_trace_writer_abort(kvt_trace_writer *w);

/* ---------------------------------------------------------------------------------------------
 * Reader
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt_trace kvt_trace;

/* Open a trace: check the file header, walk every section header (header CRCs), read and check
 * the small sections (META, TEXT, LAYER, NEEDLES, TARGETS: payload CRCs) and the fixed headers
 * and positions of ROWS and QUERIES chunks, then cross-check everything (chunks contiguous, planes
 * of equal length, positions <= rows, needles inside rows, targets naming existing needles, steps
 * and heads). Memory held is O(sections + query steps + needles), never O(rows).
 * err (may be NULL) receives the detail; *out is NULL on failure. Errors:
 *   KVT_ERR_IO           cannot open / read the file
 *   KVT_ERR_PARSE        bad magic, truncated file (header, section header, payload, missing END
 *                        section), bytes after END, a section length that disagrees with its
 *                        contents (e.g. ROWS length != 24 + n_tokens * n_kv_heads * row_bytes),
 *                        absurd values (2^40 tokens, row_bytes 0, unknown kind/dtype, limits
 *                        above), missing META, duplicates, inconsistent cross-references, a
 *                        container that holds something else than a trace
 *   KVT_ERR_CORRUPT      a header or small-section CRC mismatch
 *   KVT_ERR_UNSUPPORTED  unknown major version; unknown section marked critical
 *   KVT_ERR_OUT_OF_MEMORY */
KVT_API kvt_status kvt_trace_open(const char *path, kvt_trace **out, char *err, size_t err_len);
/* NULL is a no-op. */
KVT_API void kvt_trace_close(kvt_trace *t);
/* Detail of the last error returned by a call on t ("" if none). */
KVT_API const char *kvt_trace_last_error(const kvt_trace *t);

/* Format version of the file (major, minor); either pointer may be NULL. */
KVT_API void kvt_trace_format_version(const kvt_trace *t, uint32_t *major, uint32_t *minor);
KVT_API uint64_t kvt_trace_prompt_rows(const kvt_trace *t);
KVT_API uint32_t kvt_trace_n_model_layers(const kvt_trace *t);
/* Provenance text, NUL-terminated, owned by t ("" when the file has none); *len (may be NULL)
 * receives its length in bytes. */
KVT_API const char *kvt_trace_text(const kvt_trace *t, size_t *len);

/* Traced layers, in the order the file declares them: i in [0, kvt_trace_n_layers). */
KVT_API uint32_t kvt_trace_n_layers(const kvt_trace *t);
/* KVT_ERR_OUT_OF_RANGE when i >= n_layers; KVT_ERR_INVALID_ARGUMENT on NULL. */
KVT_API kvt_status kvt_trace_layer_info(const kvt_trace *t, uint32_t i, kvt_trace_layer *out);
/* Info by model layer index; KVT_ERR_OUT_OF_RANGE when the trace does not carry that layer. */
KVT_API kvt_status kvt_trace_find_layer(const kvt_trace *t, uint32_t layer, kvt_trace_layer *out);

/* Copy rows [first, first + n) of one plane of a layer into dst ([token][kv_head][row_bytes]);
 * dst_bytes must be at least n * n_kv_heads * row_bytes. A chunk the range covers entirely has its
 * CRC checked. Errors: KVT_ERR_INVALID_ARGUMENT (NULL), KVT_ERR_OUT_OF_RANGE (layer not traced,
 * plane, range past n_tokens), KVT_ERR_CAPACITY (dst too small), KVT_ERR_IO, KVT_ERR_CORRUPT (CRC
 * mismatch; dst contents then unspecified). */
KVT_API kvt_status kvt_trace_read_rows(kvt_trace *t, uint32_t layer, uint32_t plane, uint64_t first,
                                       uint64_t n, void *dst, size_t dst_bytes);

/* Position (rows existing when issued) of query step `step` of a layer.
 * KVT_ERR_OUT_OF_RANGE for an untraced layer or step >= n_steps. */
KVT_API kvt_status kvt_trace_query_position(const kvt_trace *t, uint32_t layer, uint64_t step,
                                            uint64_t *position);

/* Copy the query of one step ([head][dim]) into dst as dtype `as`: the stored dtype (raw bytes),
 * or KVT_DTYPE_FP32 (bf16 widened exactly). dst_bytes must be at least
 * n_q_heads * dim * sizeof(as). position (may be NULL) receives the step's position. A chunk of
 * one step has its CRC checked on every read. Errors: KVT_ERR_INVALID_ARGUMENT (NULL dst),
 * KVT_ERR_OUT_OF_RANGE, KVT_ERR_UNSUPPORTED (conversion other than to the stored dtype or fp32),
 * KVT_ERR_CAPACITY, KVT_ERR_IO, KVT_ERR_CORRUPT. */
KVT_API kvt_status kvt_trace_read_query(kvt_trace *t, uint32_t layer, uint64_t step, kvt_dtype as,
                                        void *dst, size_t dst_bytes, uint64_t *position);

/* Needles and targets (arrays owned by t; NULL with *n = 0 when absent). Target heads point into
 * memory owned by t. */
KVT_API const kvt_trace_needle *kvt_trace_needles(const kvt_trace *t, uint32_t *n);
KVT_API const kvt_trace_target *kvt_trace_targets(const kvt_trace *t, uint32_t *n);

/* Stream every section of the file once and check every payload CRC (rows and queries
 * included), reading through a bounded buffer. KVT_OK, or KVT_ERR_CORRUPT naming the section
 * (index, type, file offset) in kvt_trace_last_error, or KVT_ERR_IO. */
KVT_API kvt_status kvt_trace_verify(kvt_trace *t);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_TRACE_H */
