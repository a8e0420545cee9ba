/*
 * rope_trigger.h — one decode step of the recall trigger on a GQA/MHA-RoPE layer under random
 * eviction with the archive (docs/recall.md §9), CPU twin. The NoPE step (recall_step.h)
 * per KV head: the archive of head h is the scanned set, its query heads (the group of h) the
 * scan's heads. Arranges the KVT_HD functions of recall_scan.h and conformal_math.h, and calls the
 * full scan (kvt__recall_scan_cpu) once per KV head; a CUDA kernel over the same functions gives
 * the same bits.
 *
 * A row here is one KV head's post-RoPE key: on a GQA/MHA layer D = head_dim values and no
 * branch; on an MLA-RoPE layer (one latent head, n_kv = 1, G = n_q_heads) the row [c | r] of the
 * NoPE scan: latent c of D = kv_lora_rank values, sketched, and the rotated branch r (branch_dim
 * values at branch_offset) scored exactly — the NoPE scan's arithmetic on the archive of random
 * eviction. D > 64: the certificate unit is s·‖q̃_res‖·ρ/√(D − 64) as on NoPE layers, so sound
 * z = √(D − 64). Query head t attends KV head t / G (G = n_q_heads / n_kv_heads; MHA: G = 1). The
 * step, given one query per query head (fp32 [n_q][D + branch_dim], latent first, the softmax
 * scale already applied):
 *
 *   1. best_t = the head's highest exact score (kvt__recall_exact) over the rows its KV
 *      head attends without recall: the table's rows [0, n_rows) (the step's included), key at
 *      keys + slot·slot_stride + h·row_bytes. NaN skipped; no row: -Inf.
 *   2. No archived row (ar_n = 0): nothing fires, the step is not dense.
 *   3. Conformal while the calibration is open: a calibration step (dense: every archived row of
 *      every head attended). For each query head, a* = its highest exact score over its KV head's
 *      archive (ties to the lower archive index, NaN skipped) gives e = (score − idx)/cert
 *      (kvt__conformal_sample); samples of every head go into the one sorted array, and at a
 *      window end z is fixed (kvt__conformal_close): one z per (request, layer).
 *   4. Otherwise per KV head h the full scan of h's archive (rows [0, ar_n), addressed through the
 *      identity mirror) with its G query heads, z = the state's (conformal), √(D − 64) (sound) or
 *      δ (margin): fired[h][0 .. n_fired[h]) ascending archive indices, the union over the group;
 *      overflow[h] when more than cap fired. An overflow in any head makes the step dense (every
 *      archived row of every head attended), as on NoPE layers.
 *
 * Counts in the state are (row, KV head) pairs: archived = n_kv·ar_n, fetched = Σ_h n_fired[h]
 * (all archived when dense), fired = Σ_h (n_fired[h] + overflow[h]).
 *
 * Capped (the archive in pinned host memory, kvt_ctx_params.archive_space HOST): no step is
 * dense, so only fetched rows cross the bus. A calibration step samples as in 3. and fetches,
 * per KV head, the best archived rows a* of its query heads (distinct, ascending, at most cap);
 * an overflow in 4. keeps cap of the head's fired rows — those of the highest
 * kvt__recall_rope_capped_key (the row's best idx over the group's heads relative to their best
 * attended scores), ties to the lower index, ascending — with overflow[h] set, and counts as an
 * overflow step.
 */
#ifndef KVT_KERNELS_ROPE_TRIGGER_H
#define KVT_KERNELS_ROPE_TRIGGER_H

#include "kernels/backend.h"
#include "recall/kernels/conformal_math.h"
#include "recall/kernels/recall_scan.h"
#include "kernels/topm.h"

#include <float.h>
#include <string.h>

/* Most KV heads a RoPE recall step takes (the per-head ranks are passed by value). */
#define KVT__RECALL_ROPE_MAX_KV 64u

typedef struct kvt__recall_rope_args {
    /* The rows attended without recall: the pool's key plane through the table's mirror. */
    const uint8_t *keys;      /* plane 0 */
    const int32_t *pages;     /* the table's mirror (kvt__score_args.pages) */
    uint64_t first_page;
    const kvt__div32 *pdiv;   /* page_rows (a host value) */
    size_t slot_stride;       /* bytes of one slot of the plane (n_kv · row_bytes) */
    uint32_t row_bytes;       /* head h's key at + h · row_bytes */
    uint64_t n_rows;          /* rows every head attends (the step's included) */
    int dtype;                /* KVT__DT_BF16 / FP16 / FP32 */
    uint32_t D;               /* the sketched part: head_dim (GQA), kv_lora_rank (MLA-RoPE); > 64 */
    uint32_t branch_dim;      /* MLA-RoPE: the rotated branch, scored exactly (64); GQA: 0 */
    uint32_t branch_offset;   /* its byte offset in a row */
    int branch_dtype;
    uint32_t n_kv;            /* KV heads (<= KVT__RECALL_ROPE_MAX_KV) */
    uint32_t group;           /* query heads per KV head (G >= 1) */
    /* The archive (tiers/evict.c): [n_kv][ar_cap][ar_row_bytes], key first, ar_n rows a head. */
    const uint8_t *ar_bytes;
    size_t ar_row_bytes;
    uint64_t ar_cap, ar_n;
    const int32_t *ar_ident;  /* identity page mirror of at least ar_n rows */
    bool capped;              /* the archive is host memory: no dense step (above) */
    /* A host archive on an MLA-RoPE layer: the rows' rotated branches in the backend's memory,
     * [n_kv][ar_cap][ar_branch_bytes], which the scan reads instead of the archived rows (NULL:
     * it reads the branch in the rows). */
    const uint8_t *ar_branch;
    uint32_t ar_branch_bytes;
    const uint16_t *csk;      /* [n_kv][ar_cap][csk_stride] */
    const float *rho;         /* [n_kv][ar_cap] */
    uint32_t csk_stride;
    /* The pruned scan's group planes (recall_group.h) over each head's archive in blocks
     * of g_B archive rows (archive indices [b·g_B, (b + 1)·g_B)): head h's block b at plane slot
     * b·n_kv + h (kvt__recall_groups.stride n_kv), room for g_blocks_cap blocks a head, centres of
     * g_dim >= branch_dim + csk_stride floats; st->n_grouped blocks of every head built. g_perm
     * NULL: the full scan only (the CUDA twin's: the pruned scan's fired rows are the full
     * scan's, bit for bit, so the choice moves only the step's `visited` and its time). */
    uint32_t g_B, g_dim;
    uint64_t g_blocks_cap;
    uint32_t *g_perm, *g_n, *g_end;
    float *g_centre, *g_stat;
    const float *basis;       /* [n_kv][basis_stride][D]; NULL when no head has one */
    uint32_t basis_stride;
    uint32_t rank[KVT__RECALL_ROPE_MAX_KV]; /* per head, <= csk_stride (0: none) */
    /* The request's queries and trigger. */
    const float *q;           /* [n_kv · group][D + branch_dim] */
    float *best;              /* [n_kv · group] out */
    int mode;                 /* KVT__RECALL_CONFORMAL / SOUND / MARGIN */
    float margin;             /* δ (margin mode) */
    uint32_t cap;             /* W per KV head */
    kvt__recall_state *st;
    float *samples;           /* [sample_cap] sorted */
    uint32_t sample_cap;
    uint32_t *fired;          /* [n_kv][cap] out */
    uint32_t *n_fired;        /* [n_kv] out */
    uint32_t *overflow;       /* [n_kv] out */
    uint8_t *dense;           /* [1] out, or NULL */
} kvt__recall_rope_args;

/* Does query head g of a scan view fire on an archived row (its idx, P, ‖csk‖ and ρ)? The scan's
 * predicate (recall_scan.h): margin !(idx + z < best), sound, conformal. */
KVT_HD int kvt__recall_rope_fires(const kvt__recall_scan_args *v, const kvt__recall_head *hd,
                                  uint32_t g, float idx, float P, float ncsk, float rho) {
    if (v->mode == KVT__RECALL_MARGIN)
        return !(idx + v->z < v->best[g]);
    if (v->mode == KVT__RECALL_SOUND)
        return kvt__recall_sound_fires(idx,
                                       kvt__recall_sound_margin(hd, idx, P, ncsk, rho, v->scale,
                                                                v->z, v->latent_dim,
                                                                v->branch_dim, v->rank),
                                       v->best[g]);
    return kvt__recall_conformal_fires(idx, kvt__recall_cert(hd, rho, v->scale, v->latent_dim),
                                       v->z, v->best[g]);
}

/* A capped overflow's priority of an archived row (kernels/topm.h keys, larger first): 0 when no
 * query head of the group fires on it, else kvt__score_key of max_g (idx_g − best_g) (NaN as
 * +Inf). */
KVT_HD uint32_t kvt__recall_rope_capped_key(int fires, float score) {
    return fires ? kvt__score_key(score != score ? INFINITY : score) : 0u;
}

/* Are the arguments in the ranges the twin takes? (The op answers KVT_ERR_INVALID_ARGUMENT.)
 * Every backend's rule (the CUDA planned op checks its items with it on the device). */
KVT_HD int kvt__recall_rope_args_ok(const kvt__recall_rope_args *a) {
    if (a->D <= 64u || a->D > KVT__SKETCH_MAX_DIM || a->n_kv == 0 ||
        a->n_kv > KVT__RECALL_ROPE_MAX_KV || a->group == 0 || a->group > 4096u ||
        (a->dtype != KVT__DT_BF16 && a->dtype != KVT__DT_FP16 && a->dtype != KVT__DT_FP32) ||
        a->csk_stride > KVT__SKETCH_MAX_RANK || a->cap == 0 || a->n_rows > UINT32_MAX ||
        a->branch_dim > KVT__RECALL_MAX_BRANCH ||
        (a->branch_dim && a->branch_dtype != KVT__DT_BF16 && a->branch_dtype != KVT__DT_FP16 &&
         a->branch_dtype != KVT__DT_FP32) ||
        a->ar_n > a->ar_cap || a->ar_n > UINT32_MAX || !a->q || !a->best || !a->st ||
        !a->fired || !a->n_fired || !a->overflow || !a->pdiv ||
        (a->n_rows && (!a->keys || !a->pages)) ||
        (a->ar_n && (!a->ar_bytes || !a->ar_ident || !a->csk || !a->rho)) ||
        (a->mode == KVT__RECALL_CONFORMAL && !a->samples))
        return 0;
    if (a->mode == KVT__RECALL_MARGIN && !(a->margin >= 0.0f && a->margin <= FLT_MAX))
        return 0;
    if (a->mode != KVT__RECALL_CONFORMAL && a->mode != KVT__RECALL_SOUND &&
        a->mode != KVT__RECALL_MARGIN)
        return 0;
    for (uint32_t h = 0; h < a->n_kv; h++)
        if (a->rank[h] > a->csk_stride || a->rank[h] > a->basis_stride ||
            (a->rank[h] && !a->basis))
            return 0;
    const uint32_t B = a->g_B;
    if (a->g_perm && !(B >= 64u && (B & (B - 1u)) == 0 && B <= (1u << 20) && a->g_n &&
                       a->g_end && a->g_centre && a->g_stat &&
                       a->g_dim >= a->branch_dim + a->csk_stride))
        return 0;
    return 1;
}

/* Floats of scratch one step takes. */
size_t kvt__recall_rope_scratch_floats(const kvt__recall_rope_args *a);
/* The scan view of KV head h's archive (its group's queries and outputs, z and mode as given);
 * every backend's (the CUDA kernels build each head's on the device). */
KVT_HD void kvt__recall_rope_view(const kvt__recall_rope_args *a, uint32_t h, float z,
                                  kvt__recall_scan_args *v) {
    const size_t G = a->group;
    memset(v, 0, sizeof *v);
    const int plane = a->ar_branch && a->branch_dim; /* the scan reads only the branch */
    v->base = plane ? a->ar_branch + (size_t)h * a->ar_cap * a->ar_branch_bytes
                    : a->ar_bytes + (size_t)h * a->ar_cap * a->ar_row_bytes;
    v->pages = a->ar_ident;
    v->first_page = 0;
    v->pdiv = a->pdiv;
    v->slot_stride = plane ? a->ar_branch_bytes : a->ar_row_bytes;
    v->dtype = a->dtype;
    v->latent_dim = a->D;
    v->branch_offset = plane ? 0u : a->branch_offset;
    v->branch_dtype = a->branch_dim ? a->branch_dtype : a->dtype;
    v->branch_dim = a->branch_dim;
    v->csk = a->csk + (size_t)h * a->ar_cap * a->csk_stride;
    v->rho = a->rho + (size_t)h * a->ar_cap;
    v->csk_stride = a->csk_stride;
    v->rank = a->rank[h];
    v->basis = a->rank[h] ? a->basis + (size_t)h * a->basis_stride * a->D : NULL;
    v->n_closed = a->ar_n;
    v->sinks = 0;
    v->kept = NULL;
    v->m = 0;
    v->q = a->q + (size_t)h * G * (a->D + a->branch_dim);
    v->best = a->best + (size_t)h * G;
    v->n_heads = a->group;
    v->scale = 1.0f; /* the engine's queries carry the softmax scale */
    v->z = z;
    v->mode = a->mode;
    v->cap = a->cap;
    v->fired = a->fired + (size_t)h * a->cap;
    v->n_fired = a->n_fired + h;
    v->overflow = a->overflow + h;
}

/* One step (arguments checked). */
void kvt__recall_rope_step_cpu(const kvt__recall_rope_args *a, float *scratch);

/* ---------------------------------------------------------------------------------------------
 * Emission of a recall step (docs/recall.md §9.3). On a recall step each KV head attends the
 * table's rows [0, n_rows) plus its own fetched archive rows, so the sets differ per KV head:
 * one CSR list per (request, KV head). The archive is not in the pool's slot space, so the
 * fetched rows are first copied into slots the attention can read: a fetch area of the
 * request's (pool pages it owns), fetched row j of head h into fetch row j, head h's slice, every
 * plane. Head h's list: the slots of rows [0, n_rows) ascending, then fetch rows
 * [0 .. m_h), m_h = n_fired[h] (archive order), or ar_n on a dense step (every
 * archived row; st->last_dense). No filler row: a head whose m_h is smaller lists fewer slots (a
 * zero key is not neutral, a duplicate doubles its weight). Other heads' slices of a fetch slot
 * are never listed for head h unless written for it in the same call.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt__recall_rope_emit_args {
    uint8_t *plane[2];          /* the layer's pool planes (K, V; MLA: the one row plane) */
    uint32_t n_planes;          /* 2 (GQA/MHA) or 1 (MLA-RoPE) */
    size_t slot_stride;         /* bytes of a slot of a plane (n_kv · row_bytes) */
    uint32_t row_bytes;
    uint32_t n_kv;
    const int32_t *pages;       /* the table's mirror */
    uint64_t first_page;
    const kvt__div32 *pdiv;     /* page_rows (host value) */
    uint64_t n_rows;            /* rows every head attends without recall */
    const uint8_t *ar_bytes;    /* [n_kv][ar_cap][n_planes][row_bytes] */
    uint64_t ar_cap, ar_n;
    const uint32_t *fired;      /* [n_kv][cap] */
    const uint32_t *n_fired;    /* [n_kv] */
    uint32_t cap;
    const kvt__recall_state *st; /* last_dense */
    /* The fetch area: fetch rows [0, fetch_cap) of pool pages the request owns, as a page table
     * (a kvt__ptable's mirror: fetch row j at kvt__page_slot(fetch_pages, 0, pdiv, j)), so the
     * request can grow it at reserve like its other tables. */
    const int32_t *fetch_pages;
    uint32_t fetch_cap;         /* rows, >= ar_n (a dense step lists every archived row) */
    int32_t *indices;           /* [capacity] */
    uint64_t capacity;          /* >= out + n_kv · (n_rows + ar_n): held + archived rows per
                                 * head are at most the request's rows (kvt_batch_capacity) */
    int32_t *indptr;            /* [n_kv + 1]: head h's entries [indptr[h], indptr[h + 1]);
                                 * NULL with `length` */
    int32_t *length;            /* FlashMLA's layout (one KV head: n_kv = 1, not chained): the
                                 * list's length is written here instead of an indptr, and
                                 * indices [out + length, out + pad) get -1; NULL: CSR */
    uint64_t pad;
    uint64_t out;               /* first entry written (indptr[0] = out) */
    bool chain;                 /* out = indptr[0] as the backend already wrote it (requests
                                 * emitted one after another: the host knows no count) */
    bool all;                   /* every archived row, whatever the state says (a request with
                                 * recall whose step has several query tokens); capped: none */
    bool capped;                /* a host archive: never every archived row (the step capped
                                 * its lists at cap), and the fetch area holds cap rows */
} kvt__recall_rope_emit_args;

/* The emission's argument rules, every backend's. */
KVT_HD int kvt__recall_rope_emit_ok(const kvt__recall_rope_emit_args *a) {
    /* a head lists at most every archived row once (its fired rows are distinct archive rows) */
    const uint64_t m = a->capped && a->ar_n > a->cap ? a->cap : a->ar_n;
    const int tokens = a->length != NULL; /* one list, its length instead of an indptr */
    return a->n_kv && a->n_kv <= KVT__RECALL_ROPE_MAX_KV && a->row_bytes &&
           a->slot_stride >= (size_t)a->n_kv * a->row_bytes && a->plane[0] &&
           (a->n_planes == 1 || (a->n_planes == 2 && a->plane[1])) && a->pdiv && a->st &&
           a->fired && a->n_fired && a->cap && a->indices &&
           (tokens ? a->n_kv == 1 && !a->chain && a->out + a->pad <= a->capacity
                   : a->indptr != NULL) &&
           a->ar_n <= a->ar_cap && (a->ar_n == 0 || a->ar_bytes) && (a->n_rows == 0 || a->pages) &&
           a->fetch_pages && a->fetch_cap >= m && a->n_rows <= INT32_MAX &&
           (a->chain || a->capacity >= a->out + (uint64_t)a->n_kv * (a->n_rows + m)) &&
           a->capacity <= (uint64_t)INT32_MAX;
}

/* The slot of fetch row j. */
KVT_HD int32_t kvt__recall_rope_fetch_slot(const kvt__recall_rope_emit_args *a, uint32_t j) {
    return kvt__page_slot(a->fetch_pages, 0, a->pdiv, j);
}
/* One request's emission (arguments checked). */
void kvt__recall_rope_emit_cpu(const kvt__recall_rope_emit_args *a);

/* ---------------------------------------------------------------------------------------------
 * Planned RoPE recall (kvt_batch_plan_device; docs/recall.md §9.4): a layer's trigger items and
 * emissions in a batch's plan image, read by the ops when they run (recall_rope_step,
 * recall_rope_emit), so one captured launch replays over many steps. An item is the request's
 * arguments with the queries an offset from the op's query base and the page-row
 * divider by value (a.q and a.pdiv are not read).
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt__recall_rope_plan_item {
    kvt__recall_rope_args a;
    kvt__div32 div;
    uint64_t q_off; /* floats from kvt__recall_rope_plan_args.query to the item's queries */
} kvt__recall_rope_plan_item;

typedef struct kvt__recall_rope_emit_plan_item {
    kvt__recall_rope_emit_args a;
    kvt__div32 div;
} kvt__recall_rope_emit_plan_item;

typedef struct kvt__recall_rope_plan_args {
    const kvt__recall_rope_plan_item *items;      /* [n_max], the backend's memory */
    const kvt__recall_rope_emit_plan_item *emits; /* [n_max], the backend's memory */
    const uint32_t *n;      /* [1], the backend's memory: the step's trigger items */
    const uint32_t *n_emit; /* [1], the backend's memory: the step's emission items */
    uint32_t n_max;
    const float *query;  /* the run's query base (the trigger) */
    uint64_t query_floats;
    kvt__recall_rope_args bound; /* the layer's largest item (the RoPE table's bound): the launch
                                  * and workspace it sizes serve every item within it */
} kvt__recall_rope_plan_args;

/* An item within the plan's bound: no more KV heads, query heads a KV head, key values, branch
 * values, archived rows a head, samples or rank per head, group blocks' rows or centre values;
 * capped only where the bound is. */
KVT_HD int kvt__recall_rope_plan_fits(const kvt__recall_rope_args *b,
                                      const kvt__recall_rope_args *x) {
    if (x->n_kv > b->n_kv || x->group > b->group || x->D > b->D ||
        x->branch_dim > b->branch_dim || x->ar_n > b->ar_n || x->sample_cap > b->sample_cap ||
        (x->capped && !b->capped) ||
        (x->g_perm && !(b->g_perm && x->g_B <= b->g_B && x->g_dim <= b->g_dim)))
        return 0;
    for (uint32_t h = 0; h < x->n_kv; h++)
        if (x->rank[h] > b->rank[h])
            return 0;
    return 1;
}

/* Planned trigger item i as recall_rope_step takes it (queries at a->query + q_off, the divider
 * copied into *div); false when the queries lie past the query buffer, or the item breaks the
 * argument rules or the plan's bound. */
KVT_HD int kvt__recall_rope_plan_item_args(const kvt__recall_rope_plan_args *a, uint32_t i,
                                           kvt__recall_rope_args *x, kvt__div32 *div) {
    const kvt__recall_rope_plan_item *it = &a->items[i];
    *x = it->a;
    *div = it->div;
    x->pdiv = div;
    x->q = a->query ? a->query + it->q_off : NULL;
    const size_t qf = (size_t)x->n_kv * x->group * (x->D + x->branch_dim);
    return a->query && it->q_off <= a->query_floats && qf <= a->query_floats - it->q_off &&
           kvt__recall_rope_args_ok(x) && kvt__recall_rope_plan_fits(&a->bound, x);
}

/* Planned emission item i as recall_rope_emit takes it; false when it breaks the rules. A
 * chained item (CSR_KV_HEADS) starts at its indptr[0], which the planned pack wrote before the
 * op runs (the pack's count-only queries hold its lists' counts): items do not depend on each
 * other. */
KVT_HD int kvt__recall_rope_emit_plan_item_args(const kvt__recall_rope_plan_args *a, uint32_t i,
                                                kvt__recall_rope_emit_args *x, kvt__div32 *div) {
    const kvt__recall_rope_emit_plan_item *it = &a->emits[i];
    *x = it->a;
    *div = it->div;
    x->pdiv = div;
    return x->ar_n <= a->bound.ar_n && kvt__recall_rope_emit_ok(x);
}

#endif /* KVT_KERNELS_ROPE_TRIGGER_H */
