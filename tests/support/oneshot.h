/* oneshot.h — the backend's recall ops, which read their work items from the backend's memory (a
 * batch's plan image), called on items held on the host, as the tests and benchmarks that drive
 * the ops directly call them: the items and their counts are written into backend buffers, the
 * queries gathered into one (a single item's are read where they are), the bound is the items'
 * own; the backend's workspace is reserved first where it has the op, and everything allocated
 * here is freed before the call returns (a device's free waits for the op). */
#ifndef KVT_TESTS_ONESHOT_H
#define KVT_TESTS_ONESHOT_H

#include "kernels/backend.h"
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/recall_step.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define OS_MAX(a, b) ((a) > (b) ? (a) : (b))

/* The smallest NoPE bound that holds every item (kvt__recall_plan_fits). */
static inline void os_nope_bound(const kvt__recall_step_args *a, uint32_t n,
                                 kvt__recall_step_args *b) {
    *b = a[0];
    for (uint32_t i = 1; i < n; i++) {
        const kvt__recall_step_args *x = &a[i];
        b->scan.n_heads = OS_MAX(b->scan.n_heads, x->scan.n_heads);
        b->scan.rank = OS_MAX(b->scan.rank, x->scan.rank);
        b->scan.latent_dim = OS_MAX(b->scan.latent_dim, x->scan.latent_dim);
        b->scan.branch_dim = OS_MAX(b->scan.branch_dim, x->scan.branch_dim);
        b->scan.n_closed = OS_MAX(b->scan.n_closed, x->scan.n_closed);
        b->scan.m = OS_MAX(b->scan.m, x->scan.m);
        b->sample_cap = OS_MAX(b->sample_cap, x->sample_cap);
        if (x->promo) {
            b->prom_cap = b->promo ? OS_MAX(b->prom_cap, x->prom_cap) : x->prom_cap;
            b->cand_cap = b->promo ? OS_MAX(b->cand_cap, x->cand_cap) : x->cand_cap;
            b->promo = x->promo;
        }
        if (x->g_perm) {
            b->block_rows = b->g_perm ? OS_MAX(b->block_rows, x->block_rows) : x->block_rows;
            b->g_dim = b->g_perm ? OS_MAX(b->g_dim, x->g_dim) : x->g_dim;
            b->g_blocks_cap = b->g_perm ? OS_MAX(b->g_blocks_cap, x->g_blocks_cap)
                                        : x->g_blocks_cap;
            b->g_perm = x->g_perm;
        }
    }
}

/* The smallest RoPE bound that holds every item (kvt__recall_rope_plan_fits). */
static inline void os_rope_bound(const kvt__recall_rope_args *a, uint32_t n,
                                 kvt__recall_rope_args *b) {
    *b = a[0];
    for (uint32_t i = 1; i < n; i++) {
        const kvt__recall_rope_args *x = &a[i];
        b->n_kv = OS_MAX(b->n_kv, x->n_kv);
        b->group = OS_MAX(b->group, x->group);
        b->D = OS_MAX(b->D, x->D);
        b->branch_dim = OS_MAX(b->branch_dim, x->branch_dim);
        b->ar_n = OS_MAX(b->ar_n, x->ar_n);
        b->sample_cap = OS_MAX(b->sample_cap, x->sample_cap);
        b->capped = b->capped || x->capped;
        for (uint32_t h = 0; h < x->n_kv; h++)
            b->rank[h] = OS_MAX(b->rank[h], x->rank[h]);
        if (x->g_perm) {
            b->g_B = b->g_perm ? OS_MAX(b->g_B, x->g_B) : x->g_B;
            b->g_dim = b->g_perm ? OS_MAX(b->g_dim, x->g_dim) : x->g_dim;
            b->g_blocks_cap = b->g_perm ? OS_MAX(b->g_blocks_cap, x->g_blocks_cap)
                                        : x->g_blocks_cap;
            b->g_perm = x->g_perm;
        }
    }
}

/* Backend buffers of one call. */
typedef struct os_bufs {
    void *items, *emits, *count, *query;
    size_t items_bytes, emits_bytes, query_bytes;
} os_bufs;

static inline void os_free(const kvt__backend *be, os_bufs *b) {
    be->ops->buf_free(be, b->items, b->items_bytes);
    be->ops->buf_free(be, b->emits, b->emits_bytes);
    be->ops->buf_free(be, b->count, sizeof(uint32_t) * 2);
    be->ops->buf_free(be, b->query, b->query_bytes);
}

/* n items' queries (floats[i] each, at q[i]) as one base and offsets: a single item's where they
 * are, several gathered into one backend buffer. */
static inline kvt_status os_queries(const kvt__backend *be, os_bufs *b, const float *const *q,
                                    const size_t *floats, uint32_t n, uint64_t *off,
                                    const float **base, uint64_t *total, void *stream) {
    *total = 0;
    for (uint32_t i = 0; i < n; i++) {
        off[i] = *total;
        *total += floats[i];
    }
    if (n == 1) {
        off[0] = 0;
        *base = q[0];
        return KVT_OK;
    }
    b->query_bytes = sizeof(float) * (*total ? *total : 1);
    kvt_status s = be->ops->buf_alloc(be, b->query_bytes, &b->query);
    for (uint32_t i = 0; s == KVT_OK && i < n; i++)
        if (floats[i] && q[i])
            s = be->ops->copy(be, (float *)b->query + off[i], q[i], sizeof(float) * floats[i],
                              stream);
    *base = b->query;
    return s;
}

/* The items and their counts (NoPE or trigger items; emission items) into backend buffers. */
static inline kvt_status os_write(const kvt__backend *be, os_bufs *b, const void *items,
                                  size_t item_bytes, const void *emits, size_t emit_bytes,
                                  uint32_t n, void *stream) {
    const uint32_t counts[2] = {n, n};
    b->items_bytes = item_bytes * (n ? n : 1);
    b->emits_bytes = emits ? emit_bytes * (n ? n : 1) : 0;
    kvt_status s = be->ops->buf_alloc(be, sizeof counts, &b->count);
    if (s == KVT_OK)
        s = be->ops->write(be, b->count, counts, sizeof counts, stream);
    if (s == KVT_OK && item_bytes)
        s = be->ops->buf_alloc(be, b->items_bytes, &b->items);
    if (s == KVT_OK && item_bytes && n)
        s = be->ops->write(be, b->items, items, item_bytes * n, stream);
    if (s == KVT_OK && emits)
        s = be->ops->buf_alloc(be, b->emits_bytes, &b->emits);
    if (s == KVT_OK && emits && n)
        s = be->ops->write(be, b->emits, emits, emit_bytes * n, stream);
    return s;
}

/* A call's host scratch: the items (it, em) and each item's queries, their floats and offsets. */
typedef struct os_host {
    void *it, *em;
    const float **q;
    size_t *fl;
    uint64_t *off;
} os_host;

static inline kvt_status os_host_alloc(os_host *h, uint32_t n, size_t it_bytes,
                                       size_t em_bytes) {
    *h = (os_host){.it = calloc(n, it_bytes), .em = em_bytes ? calloc(n, em_bytes) : NULL,
                   .q = calloc(n, sizeof *h->q), .fl = calloc(n, sizeof *h->fl),
                   .off = calloc(n, sizeof *h->off)};
    return h->it && (h->em || !em_bytes) && h->q && h->fl && h->off ? KVT_OK
                                                                    : KVT_ERR_OUT_OF_MEMORY;
}

static inline void os_host_free(os_host *h) {
    free(h->it);
    free(h->em);
    free(h->q);
    free(h->fl);
    free(h->off);
}

/* The NoPE recall step of items a[0 .. n) (each as kvt__recall_step_cpu takes it). */
static inline kvt_status os_recall_step(const kvt__backend *be, const kvt__recall_step_args *a,
                                        uint32_t n, void *stream) {
    if (n == 0)
        return KVT_OK;
    os_bufs b = {0};
    os_host h;
    kvt_status s = os_host_alloc(&h, n, sizeof(kvt__recall_plan_item), 0);
    kvt__recall_plan_item *it = h.it;
    for (uint32_t i = 0; s == KVT_OK && i < n; i++) {
        h.q[i] = a[i].scan.q;
        h.fl[i] = (size_t)a[i].scan.n_heads * (a[i].scan.latent_dim + a[i].scan.branch_dim);
    }
    kvt__recall_plan_args pa = {.n_max = n};
    if (s == KVT_OK)
        s = os_queries(be, &b, h.q, h.fl, n, h.off, &pa.query, &pa.query_floats, stream);
    for (uint32_t i = 0; s == KVT_OK && i < n; i++) {
        it[i].a = a[i];
        it[i].div = a[i].scan.pdiv ? *a[i].scan.pdiv : (kvt__div32){0};
        it[i].a.scan.pdiv = NULL;
        it[i].a.scan.q = NULL;
        it[i].q_off = h.off[i];
    }
    if (s == KVT_OK)
        s = os_write(be, &b, it, sizeof *it, NULL, 0, n, stream);
    if (s == KVT_OK) {
        pa.items = b.items;
        pa.n = b.count;
        os_nope_bound(a, n, &pa.bound);
        if (be->ops->recall_plan_reserve)
            s = be->ops->recall_plan_reserve(be, &pa);
        if (s == KVT_OK)
            s = be->ops->recall_step(be, &pa, stream);
    }
    os_free(be, &b);
    os_host_free(&h);
    return s;
}

/* The RoPE trigger (emit false: items a) or emission (emit true: items e, their triggers a for
 * the bound when given, else e's sizes) of n requests. */
static inline kvt_status os_rope(const kvt__backend *be, const kvt__recall_rope_args *a,
                                 const kvt__recall_rope_emit_args *e, uint32_t n, bool emit,
                                 void *stream) {
    if (n == 0)
        return KVT_OK;
    os_bufs b = {0};
    os_host h;
    kvt_status s = os_host_alloc(&h, n, sizeof(kvt__recall_rope_plan_item),
                                 sizeof(kvt__recall_rope_emit_plan_item));
    kvt__recall_rope_plan_item *it = h.it;
    kvt__recall_rope_emit_plan_item *em = h.em;
    kvt__recall_rope_plan_args pa = {.n_max = n};
    if (!emit) {
        for (uint32_t i = 0; s == KVT_OK && i < n; i++) {
            h.q[i] = a[i].q;
            h.fl[i] = (size_t)a[i].n_kv * a[i].group * (a[i].D + a[i].branch_dim);
        }
        if (s == KVT_OK)
            s = os_queries(be, &b, h.q, h.fl, n, h.off, &pa.query, &pa.query_floats, stream);
        for (uint32_t i = 0; s == KVT_OK && i < n; i++) {
            it[i].a = a[i];
            it[i].div = a[i].pdiv ? *a[i].pdiv : (kvt__div32){0};
            it[i].a.pdiv = NULL;
            it[i].a.q = NULL;
            it[i].q_off = h.off[i];
        }
    } else {
        for (uint32_t i = 0; s == KVT_OK && i < n; i++) {
            em[i].a = e[i];
            em[i].div = e[i].pdiv ? *e[i].pdiv : (kvt__div32){0};
            em[i].a.pdiv = NULL;
        }
    }
    if (s == KVT_OK)
        s = os_write(be, &b, emit ? NULL : it, emit ? 0 : sizeof *it, emit ? em : NULL,
                     sizeof *em, n, stream);
    if (s == KVT_OK) {
        pa.items = b.items;
        pa.emits = b.emits;
        pa.n = b.count;
        pa.n_emit = (const uint32_t *)b.count + 1;
        if (a) {
            os_rope_bound(a, n, &pa.bound);
        } else { /* an emission's bound: its archive sizes */
            for (uint32_t i = 0; i < n; i++)
                pa.bound.ar_n = OS_MAX(pa.bound.ar_n, e[i].ar_n);
        }
        if (!emit && be->ops->recall_rope_plan_reserve)
            s = be->ops->recall_rope_plan_reserve(be, &pa);
        if (s == KVT_OK)
            s = emit ? be->ops->recall_rope_emit(be, &pa, stream)
                     : be->ops->recall_rope_step(be, &pa, stream);
    }
    os_free(be, &b);
    os_host_free(&h);
    return s;
}

static inline kvt_status os_rope_step(const kvt__backend *be, const kvt__recall_rope_args *a,
                                      uint32_t n, void *stream) {
    return os_rope(be, a, NULL, n, false, stream);
}

static inline kvt_status os_rope_emit(const kvt__backend *be,
                                      const kvt__recall_rope_emit_args *e, uint32_t n,
                                      void *stream) {
    return os_rope(be, NULL, e, n, true, stream);
}

#endif /* KVT_TESTS_ONESHOT_H */
