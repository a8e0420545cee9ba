#define _GNU_SOURCE /* MADV_HUGEPAGE (advise_huge) */
/* backend_cpu.c — the CPU backend: loops over the KVT_HD per-element math. It is complete and is
 * the reference the CUDA backend is tested against. Its capture is capture_cpu.c; the guarded
 * backend, which runs these ops on protected buffers, is backend_guarded.c (cpu_internal.h). */
#include "backend.h"
#include "kernels/cpu_internal.h"

#include "kernels/philox.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/recall_step.h"
#include "recall/kernels/recall_group.h"
#include "recall/kernels/rope_trigger.h"
#include "kernels/sigma.h"
#include "recall/kernels/sketch.h"
#include "kernels/topm.h"
#include "lib/base/base.h"

#include <float.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>

static const kvt__backend_ops cpu_ops_table;

kvt_status kvt__backend_cpu_open(kvt__backend *be) {
    be->ops = &cpu_ops_table;
    be->impl = kvt__calloc(be->alloc, sizeof(cpu_ws));
    return be->impl ? KVT_OK : KVT_ERR_OUT_OF_MEMORY;
}

void kvt__backend_cpu_close(kvt__backend *be) {
    cpu_ws *w = be->impl;
    if (!w)
        return;
    if (kvt__backend_is_guarded(be)) {
        kvt__guarded_close(be);
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

kvt_status kvt__cpu_score_rows(const kvt__backend *be, const kvt__score_args *a, uint32_t n,
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

/* The 8-bit planes of rows [0, n) (kvt__recall_q8_rows_cpu) from their fp16 sketches t16
 * ([n][q8_off]) into the sketch rows (stride csk_stride), each row's fp16 values copied first. */
static void q8_rows(const kvt__sketch_args *a, const int32_t *slots, const uint16_t *t16,
                    float *tq) {
    for (uint32_t u = 0; u < a->n_rows; u++)
        memcpy(a->csk + (size_t)u * a->csk_stride, t16 + (size_t)u * a->q8_off,
               sizeof *a->csk * a->q8_off);
    kvt__recall_q8_rows_cpu(a->base, slots, a->n_rows, a->slot_stride, a->branch_offset,
                            a->branch_dtype, a->branch_dim, a->csk, a->csk_stride, a->q8_off, tq);
}

/* One block's sketches: its slots expanded into the workspace, the twin's scratch after them (one
 * reservation, the σ scratch's: a close runs σ, then the sketches, never both at once). */
static kvt_status cpu_sketch_one(const kvt__backend *be, const kvt__sketch_args *a) {
    if (a->latent_dim == 0 || a->latent_dim > KVT__SKETCH_MAX_DIM || a->rank > a->csk_stride ||
        (a->q8_off ? a->q8_off > KVT__SKETCH_MAX_RANK || a->rank > a->q8_off ||
                         a->branch_dim > KVT__RECALL_MAX_BRANCH ||
                         a->csk_stride != a->q8_off + kvt__recall_q8_words(a->branch_dim, a->q8_off)
                   : a->csk_stride > KVT__SKETCH_MAX_RANK) ||
        (a->rank && !a->basis) ||
        !kvt__sketch_dtype_ok(a->dtype, a->latent_dim))
        return KVT_ERR_INVALID_ARGUMENT;
    size_t n_sk = kvt__sketch_scratch_floats(a->latent_dim);
    size_t n = kvt__backend_sketch_floats(a->n_rows, a->latent_dim);
    /* 8-bit: the fp16 sketches at their own width first ([n_rows][q8_off]), and the planes'
     * writer's scratch */
    const size_t n_q8_rows =
        a->q8_off ? kvt__recall_q8_rows_scratch_floats(a->branch_dim, a->q8_off) : 0;
    const size_t n_q8 = a->q8_off ? ((size_t)a->n_rows * a->q8_off + 1u) / 2u + n_q8_rows : 0;
    n += n_q8;
    bool owned;
    float *scratch = scratch_get(be, true, n, sizeof(float), &owned);
    if (!scratch)
        return KVT_ERR_OUT_OF_MEMORY;
    int32_t *slots = (int32_t *)(scratch + n_sk);
    pack_range(slots, a->first_row, a->first_row + a->n_rows, a->pages, a->first_page, a->pdiv);
    if (!a->q8_off) {
        kvt__sketch_rows_cpu(a->base, slots, a->n_rows, a->slot_stride, a->dtype, a->latent_dim,
                             a->basis, a->rank, a->csk_stride, scratch, a->csk, a->rho);
    } else { /* each row's fp16 sketch, then its 8-bit plane from its branch and that sketch */
        uint16_t *t16 = (uint16_t *)(slots + a->n_rows);
        float *tq = scratch + n - n_q8_rows;
        kvt__sketch_rows_cpu(a->base, slots, a->n_rows, a->slot_stride, a->dtype, a->latent_dim,
                             a->basis, a->rank, a->q8_off, scratch, t16, a->rho);
        q8_rows(a, slots, t16, tq);
    }
    if (owned)
        kvt__free(be->alloc, scratch, n * sizeof(float));
    return KVT_OK;
}

kvt_status kvt__cpu_sketch_rows(const kvt__backend *be, const kvt__sketch_args *a, uint32_t n,
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

kvt_status kvt__cpu_recall_scan(const kvt__backend *be, const kvt__recall_scan_args *a, uint32_t n,
                                void *stream) {
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

kvt_status kvt__cpu_recall_step(const kvt__backend *be, const kvt__recall_plan_args *a,
                                void *stream) {
    (void)stream;
    if (be->cap)
        return kvt__cpu_capture_op(be, CAP_RECALL, a);
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

/* n RoPE trigger items as they are (arguments checked here). */
static kvt_status rope_steps(const kvt__backend *be, const kvt__recall_rope_args *a, uint32_t n) {
    size_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!kvt__recall_rope_args_ok(&a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
        size_t f = kvt__recall_rope_scratch_floats(&a[i]);
        need = f > need ? f : need;
    }
    return run_items(be, a, sizeof *a, n, need, rope_step_item);
}

/* n RoPE emission items as they are (arguments checked here). */
static kvt_status rope_emits(const kvt__recall_rope_emit_args *a, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (!kvt__recall_rope_emit_ok(&a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
    for (uint32_t i = 0; i < n; i++)
        kvt__recall_rope_emit_cpu(&a[i]);
    return KVT_OK;
}

/* A layer's RoPE trigger (emit false) or emission from its items in the backend's memory: every
 * item checked first (nothing runs on a bad plan), then each one. */
static kvt_status cpu_rope_items(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                   void *stream, bool emit) {
    if (be->cap)
        return kvt__cpu_capture_op(be, emit ? CAP_ROPE_EMIT : CAP_ROPE_STEP, a);
    const uint32_t n = emit ? *a->n_emit : *a->n;
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
            kvt_status s = emit ? rope_emits(&e, 1) : rope_steps(be, &x, 1);
            if (s != KVT_OK)
                return s;
        }
    return KVT_OK;
}

kvt_status kvt__cpu_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                     void *stream) {
    return cpu_rope_items(be, a, stream, false);
}

kvt_status kvt__cpu_recall_rope_emit(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                     void *stream) {
    return cpu_rope_items(be, a, stream, true);
}

/* The reference attention: kvt__attn_cpu per query over its listed slots (scratch for the
 * largest set, from the host allocator: a test and benchmark op, never on the decode path). */
kvt_status kvt__cpu_attend(const kvt__backend *be, const kvt__attend_args *a, void *stream) {
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
kvt_status kvt__cpu_ev_select(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
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

kvt_status kvt__cpu_ev_apply(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                             void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    for (uint32_t i = 0; i < n; i++)
        kvt__ev_apply_cpu(&a[i]);
    return KVT_OK;
}

kvt_status kvt__cpu_ev_append(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                              void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    for (uint32_t i = 0; i < n; i++)
        kvt__ev_append_cpu(&a[i]);
    return KVT_OK;
}

kvt_status kvt__cpu_find_pos(const kvt__backend *be, const int64_t *sorted, const uint64_t *perm,
                             uint64_t n, uint64_t key, int64_t *out) {
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

kvt_status kvt__cpu_copy(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                         void *stream) {
    NOT_CAPTURED(be);
    (void)be;
    (void)stream;
    if (bytes)
        memmove(dst, src, bytes);
    return KVT_OK;
}

kvt_status kvt__cpu_copy_rows(const kvt__backend *be, void *dst, size_t dst_stride, const void *src,
                              size_t src_stride, size_t width, uint64_t n, void *stream) {
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
kvt_status kvt__cpu_select(const kvt__backend *be, kvt__select_args *args, uint32_t n_args,
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

kvt_status kvt__cpu_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream) {
    (void)stream;
    if (be->cap)
        return kvt__cpu_capture_op(be, CAP_PACK, a);
    /* the queries as the plan image holds them when the op runs */
    const kvt__pack_query *qs = a->q_plan;
    const uint32_t n = *a->n_plan;
    if (n > a->n_max)
        return KVT_ERR_INVALID_ARGUMENT;
    for (uint32_t i = 0; a->csr && i < n; i++)
        if (qs[i].len_at != (uint64_t)i + 1)
            return KVT_ERR_INVALID_ARGUMENT;
    /* a planned CSR set starts where the one before ended (its count may be the device's) */
    const kvt__div32 *pd = a->pdiv;
    if (a->csr && a->first_csr)
        a->indptr[0] = 0;
    for (uint32_t i = 0; i < n; i++) {
        const kvt__pack_query *q = &qs[i];
        const kvt__attended_desc *d = &q->d;
        const bool all = q->all_rows || (q->dense && *q->dense);
        const uint64_t n_fetch = !all && q->n_fetch ? *q->n_fetch : 0;
        const uint64_t count = q->paged ? kvt__paged_count(d, pd)
                               : all    ? d->hi_end
                                        : kvt__attended_desc_count(d) + n_fetch;
        if (a->dense_out)
            a->dense_out[i / (a->dense_stride ? a->dense_stride : 1u)] = all ? 1 : 0;
        const uint64_t out = a->csr ? (uint64_t)a->indptr[q->len_at - 1] : q->out;
        if (a->csr)
            a->indptr[q->len_at] = (int32_t)(out + count);
        else if (q->len_at != KVT__NO_LENGTH)
            a->lengths[q->len_at] = (int32_t)count;
        if (q->paged && count == 0)
            a->last_page_len[q->len_at - 1] = 0;
        if ((count == 0 && q->pad == 0) || q->count_only)
            continue; /* nothing to write (indices may be NULL at capacity 0) */
        int32_t *o = a->indices + out;
        if (q->paged) { /* page ids (a slot's page: slot / page_rows) */
            a->last_page_len[q->len_at - 1] = kvt__paged_last_len(d, pd);
            for (uint64_t j = 0; j < count; j++)
                *o++ = q->pages[kvt__paged_page(d, pd, j) - q->first_page];
        } else if (all) {
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
    .write = kvt__cpu_copy,
    .read = kvt__cpu_copy,
    .host_visible = true,
    .score_rows = kvt__cpu_score_rows,
    .sketch_rows = kvt__cpu_sketch_rows,
    .recall_scan = kvt__cpu_recall_scan,
    .recall_step = kvt__cpu_recall_step,
    .recall_promote = true,
    .recall_scan_q8 = true,
    .recall_rope_step = kvt__cpu_recall_rope_step,
    .recall_rope_emit = kvt__cpu_recall_rope_emit,
    .attend = kvt__cpu_attend,
    .pack = kvt__cpu_pack,
    .copy = kvt__cpu_copy,
    .copy_rows = kvt__cpu_copy_rows,
    .select = kvt__cpu_select,
    .ev_select = kvt__cpu_ev_select,
    .ev_apply = kvt__cpu_ev_apply,
    .ev_append = kvt__cpu_ev_append,
    .find_pos = kvt__cpu_find_pos,
    .capture_begin = kvt__cpu_capture_begin,
    .capture_end = kvt__cpu_capture_end,
    .graph_launch = kvt__cpu_graph_launch,
    .graph_free = kvt__cpu_graph_free,
};

const kvt__backend_ops *kvt__backend_cpu_ops(void) {
    return &cpu_ops_table;
}
