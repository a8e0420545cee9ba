/*
 * kvtier_emit.h — how kvt_batch_run (and kvt_batch_plan_device) hand an engine's attention kernel
 * the attended set: the layouts (FlashMLA's sparse decode TOKENS, FlashInfer's page-size-1 CSR,
 * CSR per KV head, FlashInfer's paged CSR) and the caller-owned kvt_emit they are written into.
 * kvtier.h includes it; an engine's glue between kvtier and its attention kernels may include it
 * alone (it needs nothing else of the API). docs/guide.md shows each layout with the kernel that
 * reads it.
 */
#ifndef KVTIER_EMIT_H
#define KVTIER_EMIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvt_emit_layout {
    KVT_EMIT_TOKENS = 0, /* FlashMLA sparse decode, [n_seqs][s_q][topk] with s_q =
                          * queries_per_seq: indices[(i * s_q + t) * topk + j] = slot, -1 padded
                          * to topk; lengths[i * s_q + t] = rows (topk_length) */
    KVT_EMIT_CSR = 1,    /* FlashInfer page-size-1 view: indptr[n_seqs * s_q + 1],
                          * indices[indptr[q] .. indptr[q+1]) = slots of query q = i * s_q + t */
    KVT_EMIT_CSR_KV_HEADS = 2, /* one list per (request, KV head) of the layer:
                          * indptr[n_seqs * n_kv_heads + 1], indices[indptr[q] .. indptr[q+1]) =
                          * the slots KV head h of request i attends, q = i * n_kv_heads + h (read
                          * head h's slice of each slot); one query per request (queries_per_seq
                          * <= 1). Required on a GQA/MHA-RoPE layer on which a request of the batch
                          * recalls (docs/recall.md §9: its heads fetch different archived rows,
                          * copied into fetch slots of the request's, listed after the table's
                          * rows); any layer may use it (every head then lists the same set).
                          * Capacity: n_kv_heads x kvt_batch_capacity's total. */
    KVT_EMIT_PAGED = 3,  /* FlashInfer's paged KV cache (BatchDecodeWithPagedKVCacheWrapper
                          * .plan(indptr, indices, last_page_len, ..., page_size)), for sets of
                          * whole pages: indptr[n_seqs * s_q + 1] over page ids,
                          * indices[indptr[q] .. indptr[q+1]) = the page ids (slot / page_rows)
                          * of query q's set, ascending by position, every one attended whole
                          * but the last, whose first last_page_len[q] rows are (1..page_rows;
                          * 0 for an empty set). Fits a set that is whole pages from row 0 of
                          * its first page — every row of a full-attention or random-eviction
                          * layer, a salience layer's set while it is contiguous or its sinks
                          * and tail start on page boundaries — and a sliding layer's window,
                          * listed from the start of the page holding its first row: the engine
                          * masks the rows before the window with FlashInfer's window_left =
                          * window - 1. A set of single rows (salience's kept list, a recall
                          * fetch: TOKENS or CSR list those) is KVT_ERR_UNSUPPORTED;
                          * kvt_batch_emit_fits says before the run. Capacity: pages, at most
                          * kvt_batch_capacity's total. CSR and CSR_KV_HEADS are its page-size-1
                          * view (one slot a page, last_page_len 1): they fit FlashInfer only
                          * with page_size 1; TOKENS (FlashMLA) lists slots of any page size. */
} kvt_emit_layout;

#define KVT_MAX_QUERIES_PER_SEQ 256u

/* Where kvt_batch_run writes the attended set: caller-owned, fixed capacity (the same buffers
 * can serve every step, e.g. inside a captured graph), in the backend's memory space (host
 * memory on the CPU backend; kvt_buffer memory on the guarded and CUDA backends — see "Backend
 * buffers"): the run describes each set in O(1) on the host and the backend writes the slots.
 * Slots ascend by original position. */
typedef struct kvt_emit {
    size_t struct_size;     /* sizeof(kvt_emit) */
    kvt_emit_layout layout;
    int32_t *indices;       /* TOKENS: [n_seqs * s_q][topk]; CSR: [capacity] */
    uint32_t capacity;      /* TOKENS: topk, the row capacity per request; CSR: total rows */
    int32_t *lengths;       /* TOKENS: [n_seqs * s_q] (topk_length per query), or [n_seqs]
                             * with KVT_EMIT_LENGTHS_PER_SEQ; unused by CSR */
    int32_t *indptr;        /* CSR: [n_seqs * s_q + 1]; unused by TOKENS */
    uint8_t *dense;         /* optional [n_seqs]: 1 where the step attends every row of the
                             * request (recall overflow or calibration, or a multi-token step of
                             * a request with recall; always 0 without recall).
                             * Informational: the layouts above already hold every row then. */
    uint32_t queries_per_seq; /* s_q: 0 or 1, one attended set per request holding all the
                               * step's rows (decode; a prefill chunk that attends as a whole);
                               * s_q > 1, one per query token, causal: token t of request i sees
                               * the step's rows up to its own (speculative verification,
                               * per-token sparse prefill); a request with fewer tokens repeats
                               * its last token's set, one with none its committed set; at most
                               * KVT_MAX_QUERIES_PER_SEQ and at least every request's n_tokens
                               * (KVT_ERR_CAPACITY). A request with several tokens then runs its
                               * policy work at commit, as a request with drafts does. CSR then
                               * needs at most s_q x kvt_batch_capacity's total. */
    uint64_t flags;         /* KVT_EMIT_* options below (0: none; an unknown bit is
                             * KVT_ERR_INVALID_ARGUMENT). A struct from before the field (its
                             * struct_size ends before it) has none. */
    int32_t *last_page_len; /* PAGED: [n_seqs * s_q], FlashInfer's kv_last_page_len; unused by
                             * the other layouts (a struct from before the field cannot ask for
                             * PAGED: KVT_ERR_INVALID_ARGUMENT) */
} kvt_emit;
/* TOKENS only (another layout: KVT_ERR_INVALID_ARGUMENT): lengths holds one count per request,
 * lengths[n_seqs] — FlashMLA's sparse decode topk_length, (batch_size,) int32, with indices
 * (batch_size, seq_len_q, topk) — instead of one per query. lengths[i] = the rows of request i's
 * last query token (t = s_q - 1), the most any of its tokens attends: token t sees the same
 * committed set plus the step's rows up to its own (on a sliding layer the window ending at
 * it), so the counts never decrease with t, and a request with fewer tokens repeats its last
 * one's set. Each token's row of indices is unchanged: its own count of slots, then -1 to topk,
 * so a token with fewer rows than lengths[i] has -1 at [its count, lengths[i]), which FlashMLA
 * reads as invalid indices and skips. With s_q <= 1 the same values as without the option. */
#define KVT_EMIT_LENGTHS_PER_SEQ 0x1u
#define KVT_EMIT_FLAGS_KNOWN KVT_EMIT_LENGTHS_PER_SEQ

/* The smallest struct_size kvt_batch_run accepts (a struct without queries_per_seq: s_q = 1). */
#define KVT_EMIT_SIZE_MIN (offsetof(kvt_emit, dense) + sizeof(uint8_t *))

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_EMIT_H */
