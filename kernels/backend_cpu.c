#define _GNU_SOURCE /* pkey_alloc, pkey_mprotect, pkey_set (glibc >= 2.27) */
/* backend_cpu.c — the CPU backend: loops over the KVT_HD per-element math. It is complete and is
 * the reference the CUDA backend is tested against. */
#include "backend.h"

#include "kernels/philox.h"
#include "kernels/recall_scan.h"
#include "kernels/recall_step.h"
#include "kernels/recall_group.h"
#include "kernels/rope_trigger.h"
#include "kernels/sigma.h"
#include "kernels/sketch.h"
#include "kernels/topm.h"
#include "lib/base/base.h"

#include <float.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>

static const kvt__backend_ops cpu_ops_table;

/* The CPU backend's workspace (be->impl when opened with kvt__backend_cpu_open): grow-only
 * scratch of σ and top-m, sized once from the context's stated limits so that no op allocates in
 * a steady state. Each batch has its own (kvt__backend_cpu_workspace), so the ops of two batches
 * may run at once. A backend without one (impl NULL, as tests build them) allocates per call. */
typedef struct cpu_ws {
    float *sigma;
    uint64_t sigma_cap;
    uint32_t *topm;
    uint64_t topm_cap;
} cpu_ws;

kvt_status kvt__backend_cpu_open(kvt__backend *be) {
    be->ops = &cpu_ops_table;
    be->impl = kvt__calloc(be->alloc, sizeof(cpu_ws));
    return be->impl ? KVT_OK : KVT_ERR_OUT_OF_MEMORY;
}

static void guarded_close(kvt__backend *be);

void kvt__backend_cpu_close(kvt__backend *be) {
    cpu_ws *w = be->impl;
    if (!w)
        return;
    if (kvt__backend_is_guarded(be)) {
        guarded_close(be);
        return;
    }
    kvt__free(be->alloc, w->sigma, sizeof *w->sigma * w->sigma_cap);
    kvt__free(be->alloc, w->topm, sizeof *w->topm * w->topm_cap);
    kvt__free(be->alloc, w, sizeof *w);
    be->impl = NULL;
}

kvt_status kvt__backend_cpu_reserve(kvt__backend *be, size_t sigma_floats, size_t topm_u32) {
    cpu_ws *w = be->impl;
    if (!w)
        return KVT_OK;
    void *p = w->sigma;
    kvt_status s = kvt__grow(be->alloc, &p, &w->sigma_cap, sigma_floats, sizeof *w->sigma);
    if (s != KVT_OK)
        return s;
    w->sigma = p;
    p = w->topm;
    s = kvt__grow(be->alloc, &p, &w->topm_cap, topm_u32, sizeof *w->topm);
    if (s == KVT_OK)
        w->topm = p;
    return s;
}

kvt_status kvt__backend_cpu_workspace(const kvt__backend *parent, size_t sigma_floats,
                                      size_t topm_u32, kvt__backend *out) {
    if (parent->ops != &cpu_ops_table)
        return KVT_ERR_UNSUPPORTED;
    out->alloc = parent->alloc;
    kvt_status s = kvt__backend_cpu_open(out);
    if (s == KVT_OK && (s = kvt__backend_cpu_reserve(out, sigma_floats, topm_u32)) != KVT_OK)
        kvt__backend_cpu_close(out);
    return s;
}

/* Scratch of n elements: the workspace's (grown when needed), or a fresh allocation the caller
 * frees (*owned). */
static void *scratch_get(const kvt__backend *be, bool sigma, size_t n, size_t elt, bool *owned) {
    cpu_ws *w = be->impl;
    *owned = false;
    if (!w) {
        *owned = true;
        return kvt__malloc(be->alloc, n * elt);
    }
    kvt_status s = sigma ? kvt__backend_cpu_reserve((kvt__backend *)be, n, 0)
                         : kvt__backend_cpu_reserve((kvt__backend *)be, 0, n);
    if (s != KVT_OK)
        return NULL;
    return sigma ? (void *)w->sigma : (void *)w->topm;
}

static int32_t *pack_range(int32_t *out, uint64_t a, uint64_t b, const int32_t *pages,
                           uint64_t first_page, const kvt__div32 *pd);

/* ---------------------------------------------------------------------------------------------
 * Capture (kvt__backend_ops.capture_begin): on the CPU backends a record of planned packs, their
 * arguments by value, as a CUDA graph's kernel nodes keep theirs; replayed through the handle's
 * pack op (the guarded one checks every buffer again at each launch). Any other op during a
 * capture is refused, and the capture with it: its host-built arguments are one step's.
 * ------------------------------------------------------------------------------------------- */
enum { CAP_PACK, CAP_RECALL, CAP_ROPE_STEP, CAP_ROPE_EMIT };
typedef struct captured_op {
    int kind; /* the planned op: pack, recall_step_planned, recall_rope_{step,emit}_planned */
    union {
        kvt__pack_args pack;
        kvt__recall_plan_args recall;
        kvt__recall_rope_plan_args rope;
    } u;
} captured_op;

struct kvt__capture { /* also the graph capture_end hands out (never refused then) */
    captured_op *ops;
    uint64_t n, cap;
    bool refused;
};

static bool capturing(const kvt__backend *be) {
    if (!be->cap)
        return false;
    be->cap->refused = true;
    return true;
}

#define NOT_CAPTURED(be)                                                                           \
    do {                                                                                           \
        if (capturing(be))                                                                         \
            return KVT_ERR_BAD_STATE;                                                              \
    } while (0)

/* One planned op into the record (kind CAP_*, its arguments; a pack: a planned one, else
 * refused). */
static kvt_status capture_op(const kvt__backend *be, int kind, const void *args) {
    kvt__capture *c = be->cap;
    const kvt__pack_args *pack = kind == CAP_PACK ? args : NULL;
    if (pack && !pack->q_plan) {
        c->refused = true;
        return KVT_ERR_BAD_STATE;
    }
    void *arr = c->ops;
    if (kvt__grow(be->alloc, &arr, &c->cap, c->n + 1, sizeof *c->ops) != KVT_OK) {
        c->refused = true; /* a graph without this op would replay a wrong step */
        return KVT_ERR_OUT_OF_MEMORY;
    }
    c->ops = arr;
    captured_op *o = &c->ops[c->n++];
    o->kind = kind;
    if (kind == CAP_PACK)
        o->u.pack = *pack;
    else if (kind == CAP_RECALL)
        o->u.recall = *(const kvt__recall_plan_args *)args;
    else
        o->u.rope = *(const kvt__recall_rope_plan_args *)args;
    return KVT_OK;
}

static void cpu_graph_free(const kvt__backend *be, void *graph) {
    kvt__capture *g = graph;
    if (!g)
        return;
    kvt__free(be->alloc, g->ops, sizeof *g->ops * g->cap);
    kvt__free(be->alloc, g, sizeof *g);
}

static kvt_status cpu_capture_begin(kvt__backend *be, void *stream) {
    (void)stream;
    if (be->cap)
        return KVT_ERR_BAD_STATE;
    be->cap = kvt__calloc(be->alloc, sizeof *be->cap);
    return be->cap ? KVT_OK : KVT_ERR_OUT_OF_MEMORY;
}

static kvt_status cpu_capture_end(kvt__backend *be, void *stream, void **graph) {
    (void)stream;
    *graph = NULL;
    kvt__capture *c = be->cap;
    if (!c)
        return KVT_ERR_BAD_STATE;
    be->cap = NULL;
    if (c->refused) {
        cpu_graph_free(be, c);
        return KVT_ERR_BAD_STATE;
    }
    *graph = c;
    return KVT_OK;
}

static kvt_status cpu_graph_launch(const kvt__backend *be, void *graph, void *stream) {
    NOT_CAPTURED(be);
    const kvt__capture *g = graph;
    if (!g)
        return KVT_ERR_INVALID_ARGUMENT;
    for (uint64_t i = 0; i < g->n; i++) {
        const captured_op *o = &g->ops[i];
        kvt_status s = o->kind == CAP_RECALL ? be->ops->recall_step_planned(be, &o->u.recall, stream)
                       : o->kind == CAP_ROPE_STEP
                           ? be->ops->recall_rope_step_planned(be, &o->u.rope, stream)
                       : o->kind == CAP_ROPE_EMIT
                           ? be->ops->recall_rope_emit_planned(be, &o->u.rope, stream)
                           : be->ops->pack(be, &o->u.pack, stream);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}


static kvt_status cpu_score_one(const kvt__backend *be, const kvt__score_args *a) {
    if (a->selector == KVT_SELECT_RANDOM) {
        /* One fixed uniform score per row, drawn at its original position. */
        for (uint32_t u = 0; u < a->n_rows; u++)
            a->out[u] = kvt__philox_uniform(
                kvt__philox_draw_at(a->key, a->subseq, a->first_position + u));
        return KVT_OK;
    }
    if (a->selector != KVT_SELECT_SIGMA && a->selector != KVT_SELECT_BRANCH_NORM &&
        a->selector != KVT_SELECT_ROW_NORM)
        return KVT_ERR_INVALID_ARGUMENT;
    /* The block's slots, expanded from the page table into the workspace (σ's own scratch
     * follows them in the same piece: one reservation). */
    size_t n_sig = a->selector == KVT_SELECT_SIGMA
                       ? kvt__sigma_scratch_floats(a->n_rows, a->n_basis, a->branch_dim)
                       : 0;
    size_t n = n_sig + a->n_rows;
    bool owned;
    float *scratch = scratch_get(be, true, n, sizeof(float), &owned);
    if (!scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    int32_t *slots = (int32_t *)(scratch + n_sig);
    pack_range(slots, a->first_row, a->first_row + a->n_rows, a->pages, a->first_page, a->pdiv);
    if (a->selector == KVT_SELECT_SIGMA)
        kvt__sigma_block_cpu(a->base, slots, a->n_rows, a->slot_stride, a->branch_offset,
                             a->branch_dtype, a->branch_dim, a->basis, a->n_basis, scratch,
                             a->out);
    else if (a->selector == KVT_SELECT_BRANCH_NORM)
        kvt__branch_norm_cpu(a->base, slots, a->n_rows, a->slot_stride, a->branch_offset,
                             a->branch_dtype, a->branch_dim, a->out);
    else
        kvt__row_norm_cpu(a->base, slots, a->n_rows, a->slot_stride, a->dtype, a->n_values,
                          a->out);
    if (owned)
        kvt__free(be->alloc, scratch, n * sizeof(float));
    return KVT_OK;
}

static kvt_status cpu_score_rows(const kvt__backend *be, const kvt__score_args *a, uint32_t n,
                                 void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    for (uint32_t i = 0; i < n; i++) {
        kvt_status s = cpu_score_one(be, &a[i]);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}

size_t kvt__backend_sketch_floats(uint32_t n_rows, uint32_t latent_dim) {
    return kvt__sketch_scratch_floats(latent_dim) + n_rows;
}

/* One block's sketches: its slots expanded into the workspace, the twin's scratch after them (one
 * reservation, the σ scratch's: a close runs σ, then the sketches, never both at once). */
static kvt_status cpu_sketch_one(const kvt__backend *be, const kvt__sketch_args *a) {
    if (a->latent_dim == 0 || a->latent_dim > KVT__SKETCH_MAX_DIM || a->rank > a->csk_stride ||
        a->csk_stride > KVT__SKETCH_MAX_RANK || (a->rank && !a->basis) ||
        !kvt__sketch_dtype_ok(a->dtype, a->latent_dim))
        return KVT_ERR_INVALID_ARGUMENT;
    size_t n_sk = kvt__sketch_scratch_floats(a->latent_dim);
    size_t n = kvt__backend_sketch_floats(a->n_rows, a->latent_dim);
    bool owned;
    float *scratch = scratch_get(be, true, n, sizeof(float), &owned);
    if (!scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    int32_t *slots = (int32_t *)(scratch + n_sk);
    pack_range(slots, a->first_row, a->first_row + a->n_rows, a->pages, a->first_page, a->pdiv);
    kvt__sketch_rows_cpu(a->base, slots, a->n_rows, a->slot_stride, a->dtype, a->latent_dim,
                         a->basis, a->rank, a->csk_stride, scratch, a->csk, a->rho);
    if (owned)
        kvt__free(be->alloc, scratch, n * sizeof(float));
    return KVT_OK;
}

static kvt_status cpu_sketch_rows(const kvt__backend *be, const kvt__sketch_args *a, uint32_t n,
                                  void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    for (uint32_t i = 0; i < n; i++) {
        kvt_status s = cpu_sketch_one(be, &a[i]);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}

/* Run n work items of item_bytes each through fn with one scratch of `need` floats (the
 * workspace's, or owned for this call), after their arguments passed: the recall ops' frame. */
static kvt_status run_items(const kvt__backend *be, const void *items, size_t item_bytes,
                            uint32_t n, size_t need, void (*fn)(const void *, float *)) {
    bool owned = false;
    float *scratch = need ? scratch_get(be, true, need, sizeof(float), &owned) : NULL;
    if (need && !scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < n; i++)
        fn((const uint8_t *)items + i * item_bytes, scratch);
    if (owned)
        kvt__free(be->alloc, scratch, need * sizeof(float));
    return KVT_OK;
}

static void scan_item(const void *a, float *scratch) {
    kvt__recall_scan_cpu(a, scratch);
}

static kvt_status cpu_recall_scan(const kvt__backend *be, const kvt__recall_scan_args *a,
                                  uint32_t n, void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    size_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!kvt__recall_scan_args_ok(&a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
        size_t f = kvt__recall_scan_scratch_floats(a[i].n_heads, a[i].rank, a[i].latent_dim);
        need = f > need ? f : need;
    }
    return run_items(be, a, sizeof *a, n, need, scan_item);
}


static void step_item(const void *a, float *scratch) {
    kvt__recall_step_cpu(a, scratch);
}

static kvt_status cpu_recall_step(const kvt__backend *be, const kvt__recall_step_args *a,
                                  uint32_t n, void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    size_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!kvt__recall_step_args_ok(&a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
        size_t f = kvt__recall_step_scratch_floats(&a[i]);
        need = f > need ? f : need;
    }
    return run_items(be, a, sizeof *a, n, need, step_item);
}

static kvt_status cpu_recall_step_planned(const kvt__backend *be, const kvt__recall_plan_args *a,
                                          void *stream) {
    (void)stream;
    if (be->cap)
        return capture_op(be, CAP_RECALL, a);
    const uint32_t n = *a->n;
    if (n > a->n_max)
        return KVT_ERR_INVALID_ARGUMENT;
    size_t need = 0;
    for (uint32_t i = 0; i < n; i++) { /* every item first: nothing runs on a bad plan */
        kvt__recall_step_args x;
        kvt__div32 d;
        if (!kvt__recall_plan_item_args(a, i, &x, &d))
            return KVT_ERR_INVALID_ARGUMENT;
        const size_t f = kvt__recall_step_scratch_floats(&x);
        need = f > need ? f : need;
    }
    bool owned = false;
    float *scratch = need ? scratch_get(be, true, need, sizeof(float), &owned) : NULL;
    if (need && !scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        kvt__recall_step_args x;
        kvt__div32 d;
        (void)kvt__recall_plan_item_args(a, i, &x, &d);
        kvt__recall_step_cpu(&x, scratch);
    }
    /* lagged queries: each step's own queries become its request's next ones (after every
     * step: an item's lag buffer is its own) */
    for (uint32_t i = 0; i < n; i++) {
        const kvt__recall_plan_item *it = &a->items[i];
        const kvt__recall_scan_args *s = &it->a.scan;
        if (it->lag)
            memcpy(it->lag, a->query + it->q_off,
                   sizeof(float) * s->n_heads * (s->latent_dim + s->branch_dim));
    }
    if (owned)
        kvt__free(be->alloc, scratch, need * sizeof(float));
    return KVT_OK;
}

static void rope_step_item(const void *a, float *scratch) {
    kvt__recall_rope_step_cpu(a, scratch);
}

static kvt_status cpu_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_args *a,
                                       uint32_t n, void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    size_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!kvt__recall_rope_args_ok(&a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
        size_t f = kvt__recall_rope_scratch_floats(&a[i]);
        need = f > need ? f : need;
    }
    return run_items(be, a, sizeof *a, n, need, rope_step_item);
}

static kvt_status cpu_recall_rope_emit(const kvt__backend *be,
                                       const kvt__recall_rope_emit_args *a, uint32_t n,
                                       void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    for (uint32_t i = 0; i < n; i++)
        if (!kvt__recall_rope_emit_ok(&a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
    for (uint32_t i = 0; i < n; i++)
        kvt__recall_rope_emit_cpu(&a[i]);
    return KVT_OK;
}

/* The planned RoPE trigger (emit false) or emission of a layer: every item checked first
 * (nothing runs on a bad plan), then each as the eager op runs it. */
static kvt_status cpu_rope_planned(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                   void *stream, bool emit) {
    if (be->cap)
        return capture_op(be, emit ? CAP_ROPE_EMIT : CAP_ROPE_STEP, a);
    const uint32_t n = *a->n;
    if (n > a->n_max)
        return KVT_ERR_INVALID_ARGUMENT;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < n; i++) {
            kvt__div32 d;
            kvt__recall_rope_args x;
            kvt__recall_rope_emit_args e;
            const int ok = emit ? kvt__recall_rope_emit_plan_item_args(a, i, &e, &d)
                                : kvt__recall_rope_plan_item_args(a, i, &x, &d);
            if (!ok)
                return KVT_ERR_INVALID_ARGUMENT; /* pass 0 only: the items do not change */
            if (pass == 0)
                continue;
            kvt_status s = emit ? cpu_recall_rope_emit(be, &e, 1, stream)
                                : cpu_recall_rope_step(be, &x, 1, stream);
            if (s != KVT_OK)
                return s;
        }
    return KVT_OK;
}

static kvt_status cpu_recall_rope_step_planned(const kvt__backend *be,
                                               const kvt__recall_rope_plan_args *a,
                                               void *stream) {
    return cpu_rope_planned(be, a, stream, false);
}

static kvt_status cpu_recall_rope_emit_planned(const kvt__backend *be,
                                               const kvt__recall_rope_plan_args *a,
                                               void *stream) {
    return cpu_rope_planned(be, a, stream, true);
}

/* The reference attention: kvt__attn_cpu per query over its listed slots (scratch for the
 * largest set, from the host allocator: a test and benchmark op, never on the decode path). */
static kvt_status cpu_attend(const kvt__backend *be, const kvt__attend_args *a, void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    if (!kvt__attend_args_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    uint32_t most = 0;
    for (uint32_t i = 0; i < a->n_q; i++) {
        if (a->len[i] < 0 || (uint32_t)a->len[i] > a->topk)
            return KVT_ERR_INVALID_ARGUMENT;
        for (int32_t j = 0; j < a->len[i]; j++)
            if (a->idx[(size_t)i * a->topk + (size_t)j] < 0)
                return KVT_ERR_INVALID_ARGUMENT;
        most = (uint32_t)a->len[i] > most ? (uint32_t)a->len[i] : most;
    }
    const size_t nd = kvt__attn_scratch_doubles(most, a->n_heads, a->value_dim, a->key_dim);
    double *scratch = kvt__malloc(be->alloc, sizeof(double) * nd);
    if (!scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < a->n_q; i++) {
        const size_t qi = (size_t)i * a->n_heads;
        kvt__attn_args x = {.base = a->base, .slots = a->idx + (size_t)i * a->topk,
                            .n_rows = (uint32_t)a->len[i], .slot_stride = a->slot_stride,
                            .row_offset = a->row_offset, .dtype = a->dtype,
                            .key_dim = a->key_dim, .value_dim = a->value_dim,
                            .q = a->q + qi * a->q_stride, .n_heads = a->n_heads,
                            .q_stride = a->q_stride, .scale = a->scale,
                            .out = a->out ? a->out + qi * a->value_dim : NULL,
                            .lse = a->lse ? a->lse + qi : NULL, .scratch = scratch};
        if (kvt__attn_cpu(&x) != 0) { /* (checked above: not reached) */
            kvt__free(be->alloc, scratch, sizeof(double) * nd);
            return KVT_ERR_INVALID_ARGUMENT;
        }
    }
    kvt__free(be->alloc, scratch, sizeof(double) * nd);
    return KVT_OK;
}

/* A round's selection for n layers: each layer's scratch from the workspace (one piece, reused
 * layer after layer), taken before any keep set is written. */
static kvt_status cpu_ev_select(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                                void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    size_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        size_t b = kvt__ev_select_scratch_bytes(a[i].N - a[i].r, a[i].K);
        need = b > need ? b : need;
    }
    size_t words = (need + 3) / 4;
    bool owned = false;
    void *scratch = words ? scratch_get(be, false, words, sizeof(uint32_t), &owned) : NULL;
    if (words && !scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < n; i++)
        kvt__ev_select_cpu(&a[i], scratch);
    if (owned)
        kvt__free(be->alloc, scratch, words * sizeof(uint32_t));
    return KVT_OK;
}

static kvt_status cpu_ev_apply(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                               void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    for (uint32_t i = 0; i < n; i++)
        kvt__ev_apply_cpu(&a[i]);
    return KVT_OK;
}

static kvt_status cpu_ev_append(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                                void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    for (uint32_t i = 0; i < n; i++)
        kvt__ev_append_cpu(&a[i]);
    return KVT_OK;
}

static kvt_status cpu_find_pos(const kvt__backend *be, const int64_t *sorted,
                               const uint64_t *perm, uint64_t n, uint64_t key, int64_t *out) {
    NOT_CAPTURED(be);
    (void)be;
    *out = kvt__find_pos(sorted, perm, n, key);
    return KVT_OK;
}

/* Buffers of at least this many bytes (the row pool, large side planes) are advised onto
 * transparent huge pages. */
#define HUGE_ADVICE_BYTES ((size_t)4 << 20)

/* The row pool is one large buffer that the scan and attention read in rows strided across it:
 * on 4-KiB pages those reads miss the TLB (bench_decode: the 128k decode step 3.60-4.02x dense on
 * 4-KiB pages, 4.33-4.86x on 2-MiB pages, bench/RESULTS.md). Where the kernel's THP mode is
 * "madvise" (Debian's default) a buffer gets huge pages only when asked, so large buffers are
 * advised MADV_HUGEPAGE over their 4-KiB-aligned interior before their first touch. Advice
 * only: a refusal (THP off, no support) changes nothing. */
static void advise_huge(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t pg = 4096, b = (uintptr_t)p, lo = (b + pg - 1) & ~(pg - 1),
                    hi = (b + bytes) & ~(pg - 1);
    if (bytes >= HUGE_ADVICE_BYTES && hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

static kvt_status cpu_buf_alloc(const kvt__backend *be, size_t bytes, void **out) {
    NOT_CAPTURED(be);
    if (bytes < HUGE_ADVICE_BYTES) {
        *out = kvt__calloc(be->alloc, bytes);
        return *out ? KVT_OK : KVT_ERR_OUT_OF_MEMORY;
    }
    /* advised before the zeroing touches it (kvt__calloc's libc path zeroes with memset) */
    *out = kvt__malloc(be->alloc, bytes);
    if (!*out)
        return KVT_ERR_OUT_OF_MEMORY;
    advise_huge(*out, bytes);
    memset(*out, 0, bytes);
    return KVT_OK;
}

static void cpu_buf_free(const kvt__backend *be, void *p, size_t bytes) {
    kvt__free(be->alloc, p, bytes);
}

static kvt_status cpu_copy(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                           void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    if (bytes)
        memmove(dst, src, bytes);
    return KVT_OK;
}

static kvt_status cpu_copy_rows(const kvt__backend *be, void *dst, size_t dst_stride,
                                const void *src, size_t src_stride, size_t width, uint64_t n,
                                void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    for (uint64_t i = 0; width && i < n; i++)
        memcpy((uint8_t *)dst + i * dst_stride, (const uint8_t *)src + i * src_stride, width);
    return KVT_OK;
}

/* One segment: canonicalise the fresh scores, top-m of all into kept, the two counters. keys
 * holds n_closed + kvt__topm_scratch_u32(n_closed) entries. */
static void select_one(kvt__select_args *a, uint32_t *keys) {
    uint32_t n = (uint32_t)a->n_closed;
    size_t sn = kvt__topm_scratch_u32(n);
    uint64_t nonfinite = 0;
    for (uint64_t u = a->first_new; u < n; u++)
        if (!(kvt__select_score(a, u) <= FLT_MAX)) {
            if (u >= a->n_head) /* a shared row's is canonical already */
                a->score[u - a->n_head] = INFINITY;
            nonfinite++;
        }
    for (uint32_t u = 0; u < n; u++)
        keys[u] = kvt__score_key(kvt__select_score(a, u));
    kvt__topm_u32(keys, n, a->m, a->kept, sn ? keys + n : NULL);
    uint64_t below = 0;
    while (below < a->m && a->kept[below] < a->sinks)
        below++;
    a->nonfinite = nonfinite;
    a->kept_in_sinks = below;
}

/* Keys, then the top-m scratch, in one piece of the workspace: taken (for the largest segment)
 * before anything is written, so a failure leaves every kept set as it was. */
static kvt_status cpu_select(const kvt__backend *be, kvt__select_args *args, uint32_t n_args,
                             void *stream) {
    NOT_CAPTURED(be);
    (void)stream;
    uint64_t most = 0;
    for (uint32_t i = 0; i < n_args; i++) {
        if (args[i].n_closed > UINT32_MAX)
            return KVT_ERR_UNSUPPORTED;
        if (args[i].n_head > args[i].n_closed || (args[i].n_head && !args[i].score_head))
            return KVT_ERR_INVALID_ARGUMENT;
        most = args[i].n_closed > most ? args[i].n_closed : most;
    }
    size_t need = (size_t)most + kvt__topm_scratch_u32((uint32_t)most);
    bool owned = false;
    uint32_t *keys = scratch_get(be, false, need, sizeof(uint32_t), &owned);
    if (!keys)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < n_args; i++)
        select_one(&args[i], keys);
    if (owned)
        kvt__free(be->alloc, keys, need * sizeof(uint32_t));
    return KVT_OK;
}

/* Slots of rows [a, b) into out: one division for the first row, then page by page. */
static int32_t *pack_range(int32_t *out, uint64_t a, uint64_t b, const int32_t *pages,
                           uint64_t first_page, const kvt__div32 *pd) {
    if (a >= b)
        return out;
    uint32_t pr = pd->d;
    uint64_t page = kvt__div32_q(pd, (uint32_t)a);
    uint32_t off = kvt__div32_r(pd, (uint32_t)a);
    uint64_t left = b - a;
    while (left > 0) {
        int32_t base = pages[page - first_page] * (int32_t)pr;
        uint32_t take = pr - off;
        if (take > left)
            take = (uint32_t)left;
        for (uint32_t j = 0; j < take; j++)
            out[j] = base + (int32_t)(off + j);
        out += take;
        left -= take;
        page++;
        off = 0;
    }
    return out;
}

/* Slots of list rows a[0 .. na) and b[0 .. nb) (both ascending, disjoint) merged, into out. */
static int32_t *pack_merge(int32_t *out, const uint32_t *a, uint64_t na, const uint32_t *b,
                           uint64_t nb, const int32_t *pages, uint64_t first_page,
                           const kvt__div32 *pd) {
    uint64_t i = 0, j = 0;
    while (i < na || j < nb) {
        uint32_t row = j == nb || (i < na && a[i] < b[j]) ? a[i++] : b[j++];
        *out++ = kvt__page_slot(pages, first_page, pd, row);
    }
    return out;
}

static kvt_status cpu_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream) {
    (void)stream;
    if (be->cap)
        return capture_op(be, CAP_PACK, a);
    /* planned: the queries as the plan buffer holds them when the op runs */
    const kvt__pack_query *qs = a->q_plan ? a->q_plan : a->q;
    const uint32_t n = a->q_plan ? *a->n_plan : a->n;
    if (a->q_plan && n > a->n_max)
        return KVT_ERR_INVALID_ARGUMENT;
    for (uint32_t i = 0; a->q_plan && a->csr && i < n; i++)
        if (qs[i].len_at != (uint64_t)i + 1)
            return KVT_ERR_INVALID_ARGUMENT;
    /* a planned CSR set starts where the one before ended (its count may be the device's) */
    const bool dev_offsets = a->csr && (a->dev_offsets || a->q_plan);
    const kvt__div32 *pd = a->pdiv;
    if (a->csr && a->first_csr)
        a->indptr[0] = 0;
    for (uint32_t i = 0; i < n; i++) {
        const kvt__pack_query *q = &qs[i];
        const kvt__attended_desc *d = &q->d;
        const bool all = q->all_rows || (q->dense && *q->dense);
        const uint64_t n_fetch = !all && q->n_fetch ? *q->n_fetch : 0;
        const uint64_t count = all ? d->hi_end : kvt__attended_desc_count(d) + n_fetch;
        if (a->q_plan && a->dense_out)
            a->dense_out[i / (a->dense_stride ? a->dense_stride : 1u)] = all ? 1 : 0;
        const uint64_t out = dev_offsets ? (uint64_t)a->indptr[q->len_at - 1] : q->out;
        if (a->csr)
            a->indptr[q->len_at] = (int32_t)(out + count);
        else
            a->lengths[q->len_at] = (int32_t)count;
        if ((count == 0 && q->pad == 0) || q->count_only)
            continue; /* nothing to write (indices may be NULL at capacity 0) */
        int32_t *o = a->indices + out;
        if (all) {
            o = pack_range(o, 0, d->hi_end, q->pages, q->first_page, pd);
        } else {
            o = pack_range(o, 0, d->lo_end, q->pages, q->first_page, pd);
            o = pack_merge(o, d->list, d->n_list, q->fetch, n_fetch, q->pages, q->first_page, pd);
            o = pack_range(o, d->hi_begin, d->hi_end, q->pages, q->first_page, pd);
        }
        KVT_ASSERT((uint64_t)(o - (a->indices + out)) == count);
        for (uint64_t j = count; j < q->pad; j++)
            a->indices[out + j] = -1;
    }
    return KVT_OK;
}

static const kvt__backend_ops cpu_ops_table = {
    .name = "cpu",
    .close = kvt__backend_cpu_close,
    .workspace = kvt__backend_cpu_workspace,
    .scratch_reserve = kvt__backend_cpu_reserve,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .host_alloc = cpu_buf_alloc, /* host memory is what the CPU backend's buffers are */
    .host_free = cpu_buf_free,
    .write = cpu_copy,
    .read = cpu_copy,
    .host_visible = true,
    .score_rows = cpu_score_rows,
    .sketch_rows = cpu_sketch_rows,
    .recall_scan = cpu_recall_scan,
    .recall_step = cpu_recall_step,
    .recall_step_planned = cpu_recall_step_planned,
    .recall_promote = true,
    .recall_rope_step = cpu_recall_rope_step,
    .recall_rope_emit = cpu_recall_rope_emit,
    .recall_rope_step_planned = cpu_recall_rope_step_planned,
    .recall_rope_emit_planned = cpu_recall_rope_emit_planned,
    .attend = cpu_attend,
    .pack = cpu_pack,
    .copy = cpu_copy,
    .copy_rows = cpu_copy_rows,
    .select = cpu_select,
    .ev_select = cpu_ev_select,
    .ev_apply = cpu_ev_apply,
    .ev_append = cpu_ev_append,
    .find_pos = cpu_find_pos,
    .capture_begin = cpu_capture_begin,
    .capture_end = cpu_capture_end,
    .graph_launch = cpu_graph_launch,
    .graph_free = cpu_graph_free,
};

const kvt__backend_ops *kvt__backend_cpu_ops(void) {
    return &cpu_ops_table;
}

/* ---------------------------------------------------------------------------------------------
 * The guarded-device backend. Its buffers are mmap'd pages the host cannot read or write except
 * inside the backend's own ops, which proves on a machine without a GPU that no host code path
 * touches "device" bytes (a stray access faults with SIGSEGV). Protection keys (pkey_alloc /
 * pkey_mprotect, then pkey_set around each op: a register write of the calling thread, ~0.15 us)
 * where the CPU and kernel have them; otherwise mprotect around each op. In mprotect mode every
 * buffer is carved from one reserved arena, so a toggle is one system call over the arena's used
 * extent: with a mapping per buffer it was a call per buffer, each splitting and re-merging
 * kernel VMAs (on a 2-core machine without pkeys the default ctest spent 17 min in the kernel,
 * test_snapshot 562 s of it). The ops themselves are the CPU backend's.
 * ------------------------------------------------------------------------------------------- */
#include <sys/mman.h>
#include <unistd.h>

typedef struct guard_region {
    void *p;
    size_t len;
} guard_region;

typedef struct guard_impl {
    cpu_ws ws;              /* first: the CPU ops read be->impl as their workspace */
    int pkey;               /* -1: mprotect mode */
    int depth;              /* nested opens (an op calling another) */
    guard_region *regions;  /* every live buffer; in mprotect mode sorted by address */
    uint64_t n_regions, regions_cap;
    uint8_t *arena;         /* mprotect mode: the reserved range every buffer is carved from */
    size_t arena_len;       /* its reserved bytes */
    size_t arena_hi;        /* the end of its last live buffer: a toggle covers [arena, +hi) */
    guard_region *pinned;   /* host_alloc's pages: open to the host, accepted by the ops */
    uint64_t n_pinned, pinned_cap;
    kvt__guarded_calls calls; /* kvt__backend_guarded_calls */
} guard_impl;

/* The mprotect-mode arena's reservation: address space only (PROT_NONE, MAP_NORESERVE: no
 * memory is committed until a buffer's pages are touched), halved until the kernel grants it. */
#define GUARD_ARENA_MAX ((size_t)64 << 30)
#define GUARD_ARENA_MIN ((size_t)1 << 30)

static const kvt__backend_ops guarded_ops_table;

bool kvt__backend_is_guarded(const kvt__backend *be) {
    return be->ops == &guarded_ops_table;
}

/* Count a call of n items (relaxed atomics: a TSan run may share a context's handle). */
static void g_count(const kvt__backend *be, uint64_t *calls, uint64_t *items, uint64_t n) {
    (void)be;
    __atomic_fetch_add(calls, 1, __ATOMIC_RELAXED);
    if (items)
        __atomic_fetch_add(items, n, __ATOMIC_RELAXED);
}

bool kvt__backend_guarded_calls(const kvt__backend *be, kvt__guarded_calls *out) {
    if (!kvt__backend_is_guarded(be))
        return false;
    const kvt__guarded_calls *c = &((const guard_impl *)be->impl)->calls;
    out->pack = __atomic_load_n(&c->pack, __ATOMIC_RELAXED);
    out->recall_step = __atomic_load_n(&c->recall_step, __ATOMIC_RELAXED);
    out->rope_step = __atomic_load_n(&c->rope_step, __ATOMIC_RELAXED);
    out->rope_emit = __atomic_load_n(&c->rope_emit, __ATOMIC_RELAXED);
    out->recall_step_items = __atomic_load_n(&c->recall_step_items, __ATOMIC_RELAXED);
    out->rope_step_items = __atomic_load_n(&c->rope_step_items, __ATOMIC_RELAXED);
    out->rope_emit_items = __atomic_load_n(&c->rope_emit_items, __ATOMIC_RELAXED);
    return true;
}

#define G_COUNT(be, op, n)                                                                         \
    g_count(be, &((guard_impl *)(be)->impl)->calls.op, &((guard_impl *)(be)->impl)->calls.op##_items, n)

static size_t page_round(size_t bytes) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + pg - 1) / pg * pg;
}

static void guard_set(const guard_impl *g, bool open) {
    if (g->pkey >= 0) {
        pkey_set(g->pkey, open ? 0 : PKEY_DISABLE_ACCESS);
        return;
    }
    if (g->arena_hi > 0)
        mprotect(g->arena, g->arena_hi, open ? PROT_READ | PROT_WRITE : PROT_NONE);
}

static void guard_open(const kvt__backend *be) {
    guard_impl *g = be->impl;
    if (g->depth++ == 0)
        guard_set(g, true);
}

static void guard_close(const kvt__backend *be) {
    guard_impl *g = be->impl;
    if (--g->depth == 0)
        guard_set(g, false);
}

/* mprotect mode: the first gap between live buffers (sorted by address) that holds len bytes,
 * else the arena's end. Gap pages were zapped (MADV_DONTNEED) and closed when their buffer was
 * freed, so they read as zero, like fresh pages. Returns the region's index, or -1 when full. */
static int64_t arena_place(const guard_impl *g, size_t len, size_t *off) {
    size_t at = 0;
    for (uint64_t i = 0; i < g->n_regions; i++) {
        size_t b = (size_t)((uint8_t *)g->regions[i].p - g->arena);
        if (b - at >= len) {
            *off = at;
            return (int64_t)i;
        }
        at = b + g->regions[i].len;
    }
    if (g->arena_len - at < len)
        return -1;
    *off = at;
    return (int64_t)g->n_regions;
}

static kvt_status g_buf_alloc(const kvt__backend *be, size_t bytes, void **out) {
    NOT_CAPTURED(be);
    guard_impl *g = be->impl;
    *out = NULL;
    if (bytes == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    void *arr = g->regions;
    if (kvt__grow(be->alloc, &arr, &g->regions_cap, g->n_regions + 1, sizeof *g->regions) != KVT_OK)
        return KVT_ERR_OUT_OF_MEMORY;
    g->regions = arr;
    size_t len = page_round(bytes);
    if (g->pkey < 0) {
        size_t off = 0;
        int64_t at = arena_place(g, len, &off);
        if (at < 0)
            return KVT_ERR_OUT_OF_MEMORY; /* the reservation is spent */
        uint8_t *p = g->arena + off;
        /* closed pages; inside an op (open) the new buffer opens with the rest */
        if (g->depth > 0 && mprotect(p, len, PROT_READ | PROT_WRITE) != 0)
            return KVT_ERR_OUT_OF_MEMORY;
        memmove(&g->regions[at + 1], &g->regions[at],
                sizeof *g->regions * (size_t)(g->n_regions - (uint64_t)at));
        g->regions[at].p = p;
        g->regions[at].len = len;
        g->n_regions++;
        if (off + len > g->arena_hi)
            g->arena_hi = off + len;
        *out = p;
        return KVT_OK;
    }
    void *p = kvt__mem_map(len, PROT_READ | PROT_WRITE, 0);
    if (!p)
        return KVT_ERR_OUT_OF_MEMORY;
    if (pkey_mprotect(p, len, PROT_READ | PROT_WRITE, g->pkey) != 0) {
        kvt__mem_unmap(p, len);
        return KVT_ERR_OUT_OF_MEMORY;
    }
    g->regions[g->n_regions].p = p;
    g->regions[g->n_regions].len = len;
    g->n_regions++;
    *out = p; /* mmap'd anonymous pages are zero */
    return KVT_OK;
}

static void g_buf_free(const kvt__backend *be, void *p, size_t bytes) {
    guard_impl *g = be->impl;
    if (!p)
        return;
    (void)bytes;
    for (uint64_t i = 0; i < g->n_regions; i++) {
        if (g->regions[i].p != p)
            continue;
        const guard_region r = g->regions[i];
        if (g->pkey >= 0) {
            g->regions[i] = g->regions[--g->n_regions];
            kvt__mem_unmap(r.p, r.len);
            return;
        }
        /* release the pages (they read as zero if the range is reused) and close them */
        madvise(r.p, r.len, MADV_DONTNEED);
        mprotect(r.p, r.len, PROT_NONE);
        memmove(&g->regions[i], &g->regions[i + 1],
                sizeof *g->regions * (size_t)(g->n_regions - i - 1));
        g->n_regions--;
        g->arena_hi = g->n_regions == 0 ? 0
                                        : (size_t)((uint8_t *)g->regions[g->n_regions - 1].p -
                                                   g->arena) +
                                              g->regions[g->n_regions - 1].len;
        return;
    }
}

/* Does [p, p + bytes) lie inside one of the backend's buffers? The guarded ops check every
 * pointer their op reads or writes as device memory: a host pointer handed to an op (which a
 * GPU could not dereference) is caught here, not only a host touch of a buffer. */
static bool guard_owns(const guard_impl *g, const void *p, size_t bytes) {
    if (!p)
        return bytes == 0;
    const uint8_t *q = p;
    for (uint64_t i = 0; i < g->n_regions; i++) {
        const uint8_t *b = g->regions[i].p;
        if (q >= b && q < b + g->regions[i].len)
            return bytes <= (size_t)(b + g->regions[i].len - q);
    }
    return false;
}

#define GUARD_OWNS(be, p, bytes)                                                                   \
    do {                                                                                           \
        if (!guard_owns((be)->impl, (p), (bytes))) {                                               \
            (void)capturing(be); /* a capture holding a refused op is refused */                 \
            return KVT_ERR_INVARIANT;                                                              \
        }                                                                                          \
    } while (0)

/* Pinned host memory (host_alloc): mmap'd pages the host may touch, as a GPU's pinned host
 * memory is; the ops that take an archive accept them (GUARD_REACHES), no other op does. */
static kvt_status g_host_alloc(const kvt__backend *be, size_t bytes, void **out) {
    NOT_CAPTURED(be);
    guard_impl *g = be->impl;
    *out = NULL;
    if (bytes == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    void *arr = g->pinned;
    if (kvt__grow(be->alloc, &arr, &g->pinned_cap, g->n_pinned + 1, sizeof *g->pinned) != KVT_OK)
        return KVT_ERR_OUT_OF_MEMORY;
    g->pinned = arr;
    const size_t len = page_round(bytes);
    void *p = kvt__mem_map(len, PROT_READ | PROT_WRITE, 0);
    if (!p)
        return KVT_ERR_OUT_OF_MEMORY;
    g->pinned[g->n_pinned++] = (guard_region){p, len};
    *out = p; /* zero */
    return KVT_OK;
}

static void g_host_free(const kvt__backend *be, void *p, size_t bytes) {
    guard_impl *g = be->impl;
    (void)bytes;
    for (uint64_t i = 0; p && i < g->n_pinned; i++)
        if (g->pinned[i].p == p) {
            kvt__mem_unmap(p, g->pinned[i].len);
            g->pinned[i] = g->pinned[--g->n_pinned];
            return;
        }
}

static bool pinned_holds(const guard_impl *g, const void *p, size_t bytes) {
    const uint8_t *q = p;
    for (uint64_t i = 0; q && i < g->n_pinned; i++) {
        const uint8_t *b = g->pinned[i].p;
        if (q >= b && q < b + g->pinned[i].len)
            return bytes <= (size_t)(b + g->pinned[i].len - q);
    }
    return false;
}

/* A buffer of the backend's or pinned host memory of its (the archive's two spaces). */
#define GUARD_REACHES(be, p, bytes)                                                                \
    do {                                                                                           \
        if (!guard_owns((be)->impl, (p), (bytes)) && !pinned_holds((be)->impl, (p), (bytes))) {    \
            (void)capturing(be);                                                                   \
            return KVT_ERR_INVARIANT;                                                              \
        }                                                                                          \
    } while (0)

static kvt_status g_write(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                          void *stream) {
    guard_open(be);
    kvt_status s = cpu_copy(be, dst, src, bytes, stream);
    guard_close(be);
    return s;
}

static kvt_status g_copy_rows(const kvt__backend *be, void *dst, size_t dst_stride,
                              const void *src, size_t src_stride, size_t width, uint64_t n,
                              void *stream) {
    if (n && width) {
        GUARD_OWNS(be, dst, (size_t)(n - 1) * dst_stride + width);
        GUARD_REACHES(be, src, (size_t)(n - 1) * src_stride + width);
    }
    guard_open(be);
    kvt_status s = cpu_copy_rows(be, dst, dst_stride, src, src_stride, width, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_score_rows(const kvt__backend *be, const kvt__score_args *args, uint32_t n,
                               void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        const kvt__score_args *a = &args[i];
        GUARD_OWNS(be, a->out, sizeof(float) * a->n_rows);
        if (a->selector != KVT_SELECT_RANDOM) {
            GUARD_OWNS(be, a->base, 1);
            GUARD_OWNS(be, a->pages, sizeof(int32_t));
        }
        if (a->selector == KVT_SELECT_SIGMA)
            GUARD_OWNS(be, a->basis, sizeof(float) * a->n_basis * a->n_rows);
    }
    guard_open(be);
    kvt_status s = cpu_score_rows(be, args, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_sketch_rows(const kvt__backend *be, const kvt__sketch_args *args, uint32_t n,
                                void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        const kvt__sketch_args *a = &args[i];
        GUARD_REACHES(be, a->base, 1); /* a random-eviction archive's rows may be pinned */
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
        GUARD_OWNS(be, a->basis, sizeof(float) * a->rank * a->latent_dim);
        GUARD_OWNS(be, a->csk, sizeof(uint16_t) * a->csk_stride * a->n_rows);
        GUARD_OWNS(be, a->rho, sizeof(float) * a->n_rows);
    }
    guard_open(be);
    kvt_status s = cpu_sketch_rows(be, args, n, stream);
    guard_close(be);
    return s;
}

/* Every buffer a scan reads or writes must be the backend's (pdiv is a host value). */
static kvt_status g_scan_owns(const kvt__backend *be, const kvt__recall_scan_args *a,
                              bool rows) {
    const size_t qdim = (size_t)a->latent_dim + a->branch_dim;
    if (rows) {
        GUARD_OWNS(be, a->base, 1);
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
    }
    if (a->n_head > a->n_closed)
        return KVT_ERR_INVALID_ARGUMENT;
    GUARD_OWNS(be, a->csk, sizeof(uint16_t) * a->csk_stride * (a->n_closed - a->n_head));
    GUARD_OWNS(be, a->rho, sizeof(float) * (a->n_closed - a->n_head));
    GUARD_OWNS(be, a->csk_head, sizeof(uint16_t) * a->csk_stride * a->n_head);
    GUARD_OWNS(be, a->rho_head, sizeof(float) * a->n_head);
    GUARD_OWNS(be, a->basis, sizeof(float) * a->rank * a->latent_dim);
    GUARD_OWNS(be, a->kept, sizeof(uint32_t) * a->m);
    GUARD_OWNS(be, a->q, sizeof(float) * qdim * a->n_heads);
    GUARD_OWNS(be, a->best, sizeof(float) * a->n_heads);
    GUARD_OWNS(be, a->fired, sizeof(uint32_t) * a->cap);
    GUARD_OWNS(be, a->n_fired, sizeof(uint32_t));
    GUARD_OWNS(be, a->overflow, sizeof(uint32_t));
    return KVT_OK;
}

static kvt_status g_recall_scan(const kvt__backend *be, const kvt__recall_scan_args *args,
                                uint32_t n, void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        kvt_status s = g_scan_owns(be, &args[i], args[i].n_closed > args[i].sinks);
        if (s != KVT_OK)
            return s;
    }
    guard_open(be);
    kvt_status s = cpu_recall_scan(be, args, n, stream);
    guard_close(be);
    return s;
}

/* Every buffer a RoPE recall step reads or writes is the backend's (pdiv and the ranks are host
 * values). */
static kvt_status g_rope_owns(const kvt__backend *be, const kvt__recall_rope_args *a) {
    if (!kvt__recall_rope_args_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    const size_t H = a->n_kv, nq = H * a->group;
    if (a->n_rows) {
        GUARD_OWNS(be, a->keys, 1);
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
    }
    if (a->ar_n) {
        GUARD_REACHES(be, a->ar_bytes, a->ar_row_bytes * H * a->ar_cap);
        GUARD_OWNS(be, a->ar_ident, sizeof(int32_t));
        GUARD_OWNS(be, a->csk, sizeof(uint16_t) * a->csk_stride * H * a->ar_cap);
        GUARD_OWNS(be, a->rho, sizeof(float) * H * a->ar_cap);
    }
    if (a->basis)
        GUARD_OWNS(be, a->basis, sizeof(float) * H * a->basis_stride * a->D);
    if (a->ar_n && a->ar_branch)
        GUARD_OWNS(be, a->ar_branch, (size_t)a->ar_branch_bytes * H * a->ar_cap);
    if (a->g_perm && a->g_blocks_cap) { /* the pruned scan's group planes, every head's */
        const size_t slots = H * a->g_blocks_cap, Gs = kvt__recall_group_slots(a->g_B);
        GUARD_OWNS(be, a->g_perm, sizeof(uint32_t) * slots * a->g_B);
        GUARD_OWNS(be, a->g_n, sizeof(uint32_t) * slots);
        GUARD_OWNS(be, a->g_end, sizeof(uint32_t) * slots * Gs);
        GUARD_OWNS(be, a->g_centre, sizeof(float) * slots * Gs * a->g_dim);
        GUARD_OWNS(be, a->g_stat, sizeof(float) * slots * Gs * KVT__RG_STATS);
    }
    GUARD_OWNS(be, a->q, sizeof(float) * nq * (a->D + a->branch_dim));
    GUARD_OWNS(be, a->best, sizeof(float) * nq);
    GUARD_OWNS(be, a->st, sizeof *a->st);
    GUARD_OWNS(be, a->samples, a->samples ? sizeof(float) * a->sample_cap : 0);
    GUARD_OWNS(be, a->fired, sizeof(uint32_t) * H * a->cap);
    GUARD_OWNS(be, a->n_fired, sizeof(uint32_t) * H);
    GUARD_OWNS(be, a->overflow, sizeof(uint32_t) * H);
    GUARD_OWNS(be, a->dense, a->dense ? 1 : 0);
    return KVT_OK;
}

static kvt_status g_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_args *args,
                                     uint32_t n, void *stream) {
    G_COUNT(be, rope_step, n);
    for (uint32_t i = 0; i < n; i++) {
        kvt_status s = g_rope_owns(be, &args[i]);
        if (s != KVT_OK)
            return s;
    }
    guard_open(be);
    kvt_status s = cpu_recall_rope_step(be, args, n, stream);
    guard_close(be);
    return s;
}

/* The attention's buffers: the rows' plane, the index sets, queries and outputs. */
static kvt_status g_attend(const kvt__backend *be, const kvt__attend_args *a, void *stream) {
    if (!kvt__attend_args_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    const size_t nq = a->n_q, H = a->n_heads;
    if (nq) {
        GUARD_OWNS(be, a->base, 1);
        GUARD_OWNS(be, a->idx, sizeof(int32_t) * nq * a->topk);
        GUARD_OWNS(be, a->len, sizeof(int32_t) * nq);
        GUARD_OWNS(be, a->q, sizeof(float) * ((nq * H - 1) * a->q_stride + a->key_dim));
    }
    GUARD_OWNS(be, a->out, a->out ? sizeof(float) * nq * H * a->value_dim : 0);
    GUARD_OWNS(be, a->lse, a->lse ? sizeof(double) * nq * H : 0);
    guard_open(be);
    /* every listed row inside one of the backend's buffers (lengths checked by cpu_attend) */
    const size_t row = a->dtype == KVT__DT_FP8 ? KVT__FP8_BRANCH_AT + 2u * (KVT__FP8_KEY_DIM -
                                                                          KVT__FP8_VALUES)
                                               : (size_t)a->key_dim *
                                                     (a->dtype == KVT__DT_FP32 ? 4u : 2u);
    kvt_status s = KVT_OK;
    for (size_t i = 0; i < nq && s == KVT_OK; i++) {
        const int32_t n = a->len[i] < 0 || (uint32_t)a->len[i] > a->topk ? 0 : a->len[i];
        for (int32_t j = 0; j < n && s == KVT_OK; j++) {
            const int32_t slot = a->idx[i * a->topk + (size_t)j];
            if (slot >= 0 &&
                !guard_owns(be->impl, a->base + (size_t)slot * a->slot_stride + a->row_offset, row))
                s = KVT_ERR_INVARIANT;
        }
    }
    if (s == KVT_OK)
        s = cpu_attend(be, a, stream);
    guard_close(be);
    return s;
}

/* The emission's buffers, all the backend's (fetch slots, lists, planes, archive). */
static kvt_status g_rope_emit_owns(const kvt__backend *be, const kvt__recall_rope_emit_args *a) {
    if (!kvt__recall_rope_emit_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    const size_t H = a->n_kv;
    for (uint32_t p = 0; p < a->n_planes; p++)
        GUARD_OWNS(be, a->plane[p], 1);
    if (a->n_rows)
        GUARD_OWNS(be, a->pages, sizeof(int32_t));
    if (a->ar_n)
        GUARD_REACHES(be, a->ar_bytes, (size_t)a->n_planes * a->row_bytes * H * a->ar_cap);
    GUARD_OWNS(be, a->fired, sizeof(uint32_t) * H * a->cap);
    GUARD_OWNS(be, a->n_fired, sizeof(uint32_t) * H);
    GUARD_OWNS(be, a->st, sizeof *a->st);
    GUARD_OWNS(be, a->fetch_pages,
               sizeof(int32_t) * ((a->fetch_cap + a->pdiv->d - 1) / a->pdiv->d));
    GUARD_OWNS(be, a->indices, sizeof(int32_t) * a->capacity);
    if (a->length)
        GUARD_OWNS(be, a->length, sizeof(int32_t));
    else
        GUARD_OWNS(be, a->indptr, sizeof(int32_t) * (H + 1));
    return KVT_OK;
}

static kvt_status g_recall_rope_emit(const kvt__backend *be,
                                     const kvt__recall_rope_emit_args *args, uint32_t n,
                                     void *stream) {
    G_COUNT(be, rope_emit, n);
    for (uint32_t i = 0; i < n; i++) {
        kvt_status s = g_rope_emit_owns(be, &args[i]);
        if (s != KVT_OK)
            return s;
    }
    guard_open(be);
    kvt_status s = cpu_recall_rope_emit(be, args, n, stream);
    guard_close(be);
    return s;
}

/* The planned RoPE trigger and emission: the plan buffer, its items and the query base, then
 * (when they run, not when they are captured) every buffer of each item the plan holds then. */
static kvt_status g_rope_plan_owns(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                   bool emit) {
    const size_t n_max = a->n_max ? a->n_max : 1u;
    GUARD_OWNS(be, a->n, sizeof(uint32_t));
    if (emit)
        GUARD_OWNS(be, a->emits, sizeof(kvt__recall_rope_emit_plan_item) * n_max);
    else
        GUARD_OWNS(be, a->items, sizeof(kvt__recall_rope_plan_item) * n_max);
    if (!emit)
        GUARD_OWNS(be, a->query, sizeof(float) * a->query_floats);
    return KVT_OK;
}

static kvt_status g_rope_planned(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                 void *stream, bool emit) {
    kvt_status s = g_rope_plan_owns(be, a, emit);
    if (s != KVT_OK)
        return s;
    if (be->cap) /* recorded */
        return emit ? cpu_recall_rope_emit_planned(be, a, stream)
                    : cpu_recall_rope_step_planned(be, a, stream);
    guard_open(be);
    const uint32_t n = *a->n;
    s = n > a->n_max ? KVT_ERR_INVALID_ARGUMENT : KVT_OK;
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        kvt__div32 d;
        if (emit) {
            kvt__recall_rope_emit_args x;
            s = kvt__recall_rope_emit_plan_item_args(a, i, &x, &d) ? g_rope_emit_owns(be, &x)
                                                                   : KVT_ERR_INVALID_ARGUMENT;
        } else {
            kvt__recall_rope_args x;
            s = kvt__recall_rope_plan_item_args(a, i, &x, &d) ? g_rope_owns(be, &x)
                                                              : KVT_ERR_INVALID_ARGUMENT;
        }
    }
    if (s == KVT_OK) {
        if (emit)
            G_COUNT(be, rope_emit, n);
        else
            G_COUNT(be, rope_step, n);
        s = emit ? cpu_recall_rope_emit_planned(be, a, stream)
                 : cpu_recall_rope_step_planned(be, a, stream);
    }
    guard_close(be);
    return s;
}

static kvt_status g_recall_rope_step_planned(const kvt__backend *be,
                                             const kvt__recall_rope_plan_args *a, void *stream) {
    return g_rope_planned(be, a, stream, false);
}

static kvt_status g_recall_rope_emit_planned(const kvt__backend *be,
                                             const kvt__recall_rope_plan_args *a, void *stream) {
    return g_rope_planned(be, a, stream, true);
}

/* Every buffer a recall step's work item reads or writes must be the backend's. */
static kvt_status g_step_owns(const kvt__backend *be, const kvt__recall_step_args *a) {
    kvt_status s = g_scan_owns(be, &a->scan, a->n_rows > 0);
    if (s != KVT_OK)
        return s;
    GUARD_OWNS(be, a->st, sizeof *a->st);
    GUARD_OWNS(be, a->samples, sizeof(float) * a->sample_cap);
    GUARD_OWNS(be, a->dense, a->dense ? 1 : 0);
    if (a->promo) {
        GUARD_OWNS(be, a->promo,
                   sizeof *a->promo + 2u * sizeof(uint32_t) * ((size_t)a->cand_cap + a->prom_cap));
        GUARD_OWNS(be, a->scan.fired, sizeof(uint32_t) * ((size_t)a->scan.cap + a->prom_cap));
    }
    if (a->g_perm) {
        const uint64_t nb = a->g_blocks_cap, G = a->block_rows / 32u;
        GUARD_OWNS(be, a->g_perm, sizeof(uint32_t) * nb * a->block_rows);
        GUARD_OWNS(be, a->g_n, sizeof(uint32_t) * nb);
        GUARD_OWNS(be, a->g_end, sizeof(uint32_t) * nb * G);
        GUARD_OWNS(be, a->g_centre, sizeof(float) * nb * G * a->g_dim);
        GUARD_OWNS(be, a->g_stat, sizeof(float) * nb * G * 5u);
    }
    return KVT_OK;
}

static kvt_status g_recall_step(const kvt__backend *be, const kvt__recall_step_args *args,
                                uint32_t n, void *stream) {
    G_COUNT(be, recall_step, n);
    for (uint32_t i = 0; i < n; i++) {
        kvt_status s = g_step_owns(be, &args[i]);
        if (s != KVT_OK)
            return s;
    }
    guard_open(be);
    kvt_status s = cpu_recall_step(be, args, n, stream);
    guard_close(be);
    return s;
}

/* A planned recall step: the plan buffer and the query base, then (when it runs, not when it is
 * captured) every buffer of each item the plan holds then. */
static kvt_status g_recall_step_planned(const kvt__backend *be, const kvt__recall_plan_args *a,
                                        void *stream) {
    GUARD_OWNS(be, a->n, sizeof(uint32_t));
    GUARD_OWNS(be, a->items, sizeof(kvt__recall_plan_item) * (a->n_max ? a->n_max : 1u));
    GUARD_OWNS(be, a->query, sizeof(float) * a->query_floats);
    if (be->cap)
        return cpu_recall_step_planned(be, a, stream); /* recorded */
    guard_open(be);
    const uint32_t n = *a->n;
    kvt_status s = n > a->n_max ? KVT_ERR_INVALID_ARGUMENT : KVT_OK;
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        kvt__recall_step_args x;
        kvt__div32 d;
        s = kvt__recall_plan_item_args(a, i, &x, &d) ? g_step_owns(be, &x)
                                                    : KVT_ERR_INVALID_ARGUMENT;
        const size_t qf = (size_t)x.scan.n_heads * (x.scan.latent_dim + x.scan.branch_dim);
        if (s == KVT_OK && a->items[i].lag && !guard_owns(be->impl, a->items[i].lag,
                                                            sizeof(float) * qf))
            s = KVT_ERR_INVARIANT; /* the lagged query's buffer is the backend's too */
    }
    if (s == KVT_OK)
        s = cpu_recall_step_planned(be, a, stream);
    guard_close(be);
    return s;
}

/* Every buffer of a round's layers must be the backend's. */
static kvt_status g_ev_owns(const kvt__backend *be, const kvt__ev_args *a, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        const kvt__ev_args *x = &a[i];
        for (uint32_t p = 0; p < x->n_planes; p++)
            GUARD_OWNS(be, x->plane[p], 1);
        GUARD_OWNS(be, x->pages, sizeof(int32_t));
        GUARD_OWNS(be, x->pos, sizeof(int64_t) * x->n_heads * x->pos_cap);
        GUARD_OWNS(be, x->keep, sizeof(uint32_t) * x->n_heads * x->K);
        GUARD_OWNS(be, x->map, sizeof(int32_t) * x->n_heads * x->N);
        if (x->ar_bytes) {
            GUARD_REACHES(be, x->ar_bytes,
                          (size_t)x->n_heads * x->ar_cap * x->n_planes * x->row_bytes);
            GUARD_OWNS(be, x->ar_pos, sizeof(int64_t) * x->n_heads * x->ar_cap);
            GUARD_OWNS(be, x->ar_by_pos, sizeof(uint64_t) * x->n_heads * x->ar_cap);
        }
    }
    return KVT_OK;
}

/* A round's op on the guarded backend: every buffer checked, then the CPU op unguarded. */
static kvt_status g_ev_call(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                            void *stream,
                            kvt_status (*op)(const kvt__backend *, const kvt__ev_args *, uint32_t,
                                             void *)) {
    kvt_status s = g_ev_owns(be, a, n);
    if (s != KVT_OK)
        return s;
    guard_open(be);
    s = op(be, a, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_ev_select(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                              void *stream) {
    return g_ev_call(be, a, n, stream, cpu_ev_select);
}

static kvt_status g_ev_apply(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                             void *stream) {
    return g_ev_call(be, a, n, stream, cpu_ev_apply);
}

static kvt_status g_ev_append(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                              void *stream) {
    for (uint32_t i = 0; i < n; i++)
        GUARD_OWNS(be, a[i].pos, sizeof(int64_t) * a[i].n_heads * a[i].pos_cap);
    guard_open(be);
    kvt_status s = cpu_ev_append(be, a, n, stream);
    guard_close(be);
    return s;
}

static kvt_status g_find_pos(const kvt__backend *be, const int64_t *sorted, const uint64_t *perm,
                             uint64_t n, uint64_t key, int64_t *out) {
    GUARD_OWNS(be, sorted, sizeof(int64_t) * n);
    GUARD_OWNS(be, perm, perm ? sizeof(uint64_t) * n : 0);
    guard_open(be);
    kvt_status s = cpu_find_pos(be, sorted, perm, n, key, out);
    guard_close(be);
    return s;
}

static kvt_status g_select(const kvt__backend *be, kvt__select_args *a, uint32_t n,
                           void *stream) {
    for (uint32_t i = 0; i < n; i++) {
        if (a[i].n_head > a[i].n_closed)
            return KVT_ERR_INVALID_ARGUMENT;
        GUARD_OWNS(be, a[i].score, sizeof(float) * (a[i].n_closed - a[i].n_head));
        GUARD_OWNS(be, a[i].score_head, sizeof(float) * a[i].n_head);
        GUARD_OWNS(be, a[i].kept, sizeof(uint32_t) * a[i].m);
    }
    guard_open(be);
    kvt_status s = cpu_select(be, a, n, stream);
    guard_close(be);
    return s;
}

/* What query q of a pack reads and writes, inside the backend's buffers. */
static kvt_status g_pack_owns(const kvt__backend *be, const kvt__pack_args *a,
                              const kvt__pack_query *q) {
    const bool recall = q->fetch || q->n_fetch || q->dense || q->all_rows;
    /* The most it can write: every row of the view with recall (the count is the backend's). */
    uint64_t count = recall ? q->d.hi_end : kvt__attended_desc_count(&q->d);
    if (count)
        GUARD_OWNS(be, q->pages, sizeof(int32_t));
    if (q->d.n_list)
        GUARD_OWNS(be, q->d.list, sizeof(uint32_t) * q->d.n_list);
    if (q->n_fetch) {
        GUARD_OWNS(be, q->n_fetch, sizeof(uint32_t));
        GUARD_OWNS(be, q->fetch, sizeof(uint32_t) * (q->fetch_cap ? q->fetch_cap : 1u));
    }
    if (q->dense)
        GUARD_OWNS(be, q->dense, sizeof(uint32_t));
    uint64_t w = count > q->pad ? count : q->pad;
    if (a->csr && (a->dev_offsets || a->q_plan)) { /* where it starts is the backend's too */
        GUARD_OWNS(be, a->indices, sizeof(int32_t) * a->capacity);
        GUARD_OWNS(be, a->indptr + q->len_at - 1, sizeof(int32_t));
    } else if (w) {
        GUARD_OWNS(be, a->indices + q->out, sizeof(int32_t) * w);
    }
    GUARD_OWNS(be, a->csr ? a->indptr + q->len_at : a->lengths + q->len_at, sizeof(int32_t));
    return KVT_OK;
}

/* A planned pack: the plan buffer's, then (when it runs, not when it is captured) each query
 * the plan holds then. */
static kvt_status g_pack_planned(const kvt__backend *be, const kvt__pack_args *a, void *stream) {
    GUARD_OWNS(be, a->n_plan, sizeof(uint32_t));
    GUARD_OWNS(be, a->q_plan, sizeof(kvt__pack_query) * (a->n_max ? a->n_max : 1u));
    if (a->dense_out)
        GUARD_OWNS(be, a->dense_out,
                   (a->n_max + (a->dense_stride ? a->dense_stride : 1u) - 1) /
                       (a->dense_stride ? a->dense_stride : 1u));
    if (a->csr && a->first_csr)
        GUARD_OWNS(be, a->indptr, sizeof(int32_t));
    if (be->cap)
        return cpu_pack(be, a, stream); /* recorded */
    guard_open(be);
    const uint32_t n = *a->n_plan;
    kvt_status s = n > a->n_max ? KVT_ERR_INVALID_ARGUMENT : KVT_OK;
    for (uint32_t i = 0; i < n && s == KVT_OK; i++) {
        const kvt__pack_query *q = &a->q_plan[i];
        s = g_pack_owns(be, a, q);
    }
    if (s == KVT_OK)
        s = cpu_pack(be, a, stream);
    guard_close(be);
    return s;
}

static kvt_status g_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream) {
    g_count(be, &((guard_impl *)be->impl)->calls.pack, NULL, 0);
    if (a->q_plan)
        return g_pack_planned(be, a, stream);
    if (be->cap)
        return cpu_pack(be, a, stream); /* refused */
    for (uint32_t i = 0; i < a->n; i++) {
        kvt_status s = g_pack_owns(be, a, &a->q[i]);
        if (s != KVT_OK)
            return s;
    }
    guard_open(be);
    kvt_status s = cpu_pack(be, a, stream);
    guard_close(be);
    return s;
}

static const kvt__backend_ops guarded_ops_table = {
    .name = "guarded",
    .close = kvt__backend_cpu_close, /* which closes the guard too */
    .scratch_reserve = kvt__backend_cpu_reserve,
    .buf_alloc = g_buf_alloc,
    .buf_free = g_buf_free,
    .host_alloc = g_host_alloc,
    .host_free = g_host_free,
    .write = g_write,
    .read = g_write,
    .host_visible = false,
    .score_rows = g_score_rows,
    .sketch_rows = g_sketch_rows,
    .recall_scan = g_recall_scan,
    .recall_step = g_recall_step,
    .recall_step_planned = g_recall_step_planned,
    .recall_promote = true,
    .recall_rope_step = g_recall_rope_step,
    .recall_rope_emit = g_recall_rope_emit,
    .recall_rope_step_planned = g_recall_rope_step_planned,
    .recall_rope_emit_planned = g_recall_rope_emit_planned,
    .attend = g_attend,
    .pack = g_pack,
    .copy = g_write,
    .copy_rows = g_copy_rows,
    .select = g_select,
    .ev_select = g_ev_select,
    .ev_apply = g_ev_apply,
    .ev_append = g_ev_append,
    .find_pos = g_find_pos,
    .capture_begin = cpu_capture_begin,
    .capture_end = cpu_capture_end,
    .graph_launch = cpu_graph_launch,
    .graph_free = cpu_graph_free,
};

kvt_status kvt__backend_guarded_open(kvt__backend *be, char *err, size_t err_len) {
    guard_impl *g = kvt__calloc(be->alloc, sizeof *g);
    if (!g)
        return kvt__fail(err, err_len, KVT_ERR_OUT_OF_MEMORY, "guarded backend");
    /* A key denies access to the calling thread at once; other threads start with every key but 0
     * denied. Sixteen keys exist per process: without one, fall back to mprotect. */
    g->pkey = pkey_alloc(0, PKEY_DISABLE_ACCESS);
    if (g->pkey < 0) {
        for (size_t len = GUARD_ARENA_MAX; len >= GUARD_ARENA_MIN && !g->arena; len /= 2) {
            void *a = kvt__mem_map(len, PROT_NONE, MAP_NORESERVE);
            if (a) {
                g->arena = a;
                g->arena_len = len;
            }
        }
        if (!g->arena) {
            kvt__free(be->alloc, g, sizeof *g);
            return kvt__fail(err, err_len, KVT_ERR_OUT_OF_MEMORY,
                             "guarded backend: no protection keys, and no address space for its "
                             "%zu-MiB arena", GUARD_ARENA_MIN >> 20);
        }
        /* A toggle rewrites the protection of every page table entry in use: on 2-MiB pages
         * there are 512x fewer (advice; without THP nothing changes). */
#ifdef MADV_HUGEPAGE
        (void)madvise(g->arena, g->arena_len, MADV_HUGEPAGE);
#endif
    }
    be->impl = g;
    be->ops = &guarded_ops_table;
    return KVT_OK;
}

static void guarded_close(kvt__backend *be) {
    guard_impl *g = be->impl;
    if (g->arena)
        kvt__mem_unmap(g->arena, g->arena_len);
    else
        for (uint64_t i = 0; i < g->n_regions; i++)
            kvt__mem_unmap(g->regions[i].p, g->regions[i].len);
    kvt__free(be->alloc, g->regions, sizeof *g->regions * g->regions_cap);
    for (uint64_t i = 0; i < g->n_pinned; i++)
        kvt__mem_unmap(g->pinned[i].p, g->pinned[i].len);
    kvt__free(be->alloc, g->pinned, sizeof *g->pinned * g->pinned_cap);
    if (g->pkey >= 0)
        pkey_free(g->pkey);
    kvt__free(be->alloc, g->ws.sigma, sizeof *g->ws.sigma * g->ws.sigma_cap);
    kvt__free(be->alloc, g->ws.topm, sizeof *g->ws.topm * g->ws.topm_cap);
    kvt__free(be->alloc, g, sizeof *g);
    be->impl = NULL;
}
