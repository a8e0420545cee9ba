/*
 * recall_rope.h — the recall trigger's state of one (request, GQA/MHA-RoPE layer) (docs/recall.md
 * §8, recall/kernels/rope_trigger.h). The archive is the evict policy's (its recall_rope_view);
 * what the recall tier owns is, in the backend's memory:
 *
 *   base: the NoPE layout for n_q query heads and no fetch list (kvt__recall_layer with cap 0):
 *         [kvt__recall_state | samples [64 · n_q] | best [n_q]] — one conformal calibration per
 *         (request, layer), samples of every query head together, as on NoPE layers;
 *   fetch: [fired [n_kv][cap] | n_fired [n_kv] | overflow [n_kv]] — each KV head's fired archive
 *         rows (archive indices, ascending), at most cap (W) a head.
 *
 * and the pruned scan's group planes in the base layer's (kvt__recall_rope_groups_reserve). So the
 * state's read, load, check and copy are recall.h's, and the fetch lists are per KV head.
 */
#ifndef KVT_RECALL_RECALL_ROPE_H
#define KVT_RECALL_RECALL_ROPE_H

#include "recall/kernels/rope_trigger.h"
#include "recall/recall.h"

typedef struct kvt__recall_rope_layer {
    kvt__recall_layer base;
    void *fbuf;  /* backend buffer of the fetch lists (NULL: none) */
    size_t fbytes;
    uint32_t *fired, *n_fired, *overflow;
    uint32_t n_kv, cap;
} kvt__recall_rope_layer;

/* Allocate (kept when it already has this shape) and reset to the initial state: no sample,
 * z = Z_MAX, calibration open, zero counters, empty lists. KVT_ERR_OUT_OF_MEMORY or a backend
 * write's status. */
kvt_status kvt__recall_rope_prepare(kvt__recall_rope_layer *r, const kvt__backend *be,
                                    uint32_t n_q, uint32_t n_kv, uint32_t cap);
void kvt__recall_rope_fini(kvt__recall_rope_layer *r, const kvt__backend *be);
/* dst (prepared with src's shape) takes src's state and lists (a fork continues its parent's
 * calibration). */
kvt_status kvt__recall_rope_copy(kvt__recall_rope_layer *dst, const kvt__recall_rope_layer *src,
                                 const kvt__backend *be);
/* Room for the pruned scan's group planes (recall/kernels/recall_group.h) of an archive of up to
 * `rows` rows a KV head, in blocks of B rows (a power of two >= 64; otherwise none: the full scan),
 * centres of dim floats: the base layer's planes, head h's block b at slot b·n_kv + h, so that
 * growing them (recall.h, which keeps what was built) and forking them (kvt__recall_rope_copy)
 * keep every built group. KVT_ERR_OUT_OF_MEMORY with nothing changed. */
kvt_status kvt__recall_rope_groups_reserve(kvt__recall_rope_layer *r, const kvt__backend *be,
                                           uint64_t rows, uint32_t B, uint32_t dim);
/* The step's work item: the archive view the policy filled (every field up to rank), the
 * queries q ([n_q][D], backend memory), the public mode and margin, the dense flag (backend
 * memory, or NULL). */
void kvt__recall_rope_make(const kvt__recall_rope_layer *r, const kvt__recall_rope_args *view,
                           const float *q, kvt_recall_mode mode, float margin, uint8_t *dense,
                           kvt__recall_rope_args *out);

#endif /* KVT_RECALL_RECALL_ROPE_H */
