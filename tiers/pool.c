/* pool.c — page allocator (a stack of free page ids per policy group) and page tables. */
#include "tiers.h"

#include <string.h>

kvt_status kvt__pool_init(kvt__pool *p, const kvt__alloc *a, uint32_t n_pages, uint32_t page_rows) {
    memset(p, 0, sizeof *p);
    if (n_pages == 0 || page_rows == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    p->free_ids = kvt__malloc(a, sizeof *p->free_ids * n_pages);
    p->refs = kvt__calloc(a, sizeof *p->refs * n_pages);
    if (!p->free_ids || !p->refs) {
        kvt__free(a, p->free_ids, sizeof *p->free_ids * n_pages);
        kvt__free(a, p->refs, sizeof *p->refs * n_pages);
        memset(p, 0, sizeof *p);
        return KVT_ERR_OUT_OF_MEMORY;
    }
    p->n_pages = n_pages;
    p->page_rows = page_rows;
    /* Pop order: page 0 first, so a fresh pool hands out pages in ascending order. */
    for (uint32_t i = 0; i < n_pages; i++)
        p->free_ids[i] = n_pages - 1 - i;
    p->n_free = n_pages;
    return KVT_OK;
}

void kvt__pool_fini(kvt__pool *p, const kvt__alloc *a) {
    kvt__free(a, p->free_ids, sizeof *p->free_ids * p->n_pages);
    kvt__free(a, p->refs, sizeof *p->refs * p->n_pages);
    memset(p, 0, sizeof *p);
}

kvt_status kvt__ptable_reserve(kvt__ptable *t, kvt__pool *p, const kvt__alloc *a, uint32_t extra) {
    uint64_t rows = t->n_rows + t->n_pending + extra;
    uint64_t need64 = kvt__ptable_pages_for(t, rows, p->page_rows);
    if (need64 > p->n_pages)
        return KVT_ERR_POOL_EXHAUSTED;
    uint32_t need = (uint32_t)need64;
    if (need <= t->n_pages)
        return KVT_OK;
    uint32_t more = need - t->n_pages;
    if (more > p->n_free)
        return KVT_ERR_POOL_EXHAUSTED;
    void *arr = t->pages;
    kvt_status s = kvt__grow(a, &arr, &t->cap, need, sizeof *t->pages);
    if (s != KVT_OK)
        return s;
    t->pages = arr;
    for (uint32_t i = 0; i < more; i++) {
        uint32_t id = p->free_ids[--p->n_free];
        p->refs[id] = 1;
        t->pages[t->n_pages + i] = (int32_t)id;
    }
    t->n_pages = need;
    return KVT_OK;
}

void kvt__ptable_trim(kvt__ptable *t, kvt__pool *p) {
    uint64_t need = kvt__ptable_pages_for(t, t->n_rows + t->n_pending, p->page_rows);
    while (t->n_pages > need)
        kvt__pool_put(p, (uint32_t)t->pages[--t->n_pages]);
    if (t->dsynced > t->n_pages)
        t->dsynced = t->n_pages;
}

kvt_status kvt__ptable_mirror_reserve(kvt__ptable *t, const kvt__backend *be, uint64_t pages) {
    if (pages <= t->dcap)
        return KVT_OK;
    /* Doubling: decode reserves a page now and then, the copy stays O(1) amortised. */
    uint64_t cap = t->dcap ? t->dcap : 16;
    while (cap < pages)
        cap *= 2;
    void *p = NULL;
    kvt_status s = be->ops->buf_alloc(be, sizeof *t->dpages * cap, &p);
    if (s != KVT_OK)
        return s;
    if (t->dsynced && (s = be->ops->copy(be, p, t->dpages, sizeof *t->dpages * t->dsynced,
                                         NULL)) != KVT_OK) {
        be->ops->buf_free(be, p, sizeof *t->dpages * cap);
        return s;
    }
    be->ops->buf_free(be, t->dpages, sizeof *t->dpages * t->dcap);
    t->dpages = p;
    t->dcap = cap;
    return KVT_OK;
}

kvt_status kvt__ptable_mirror_sync(kvt__ptable *t, const kvt__backend *be, void *stream) {
    KVT_ASSERT(t->n_pages <= t->dcap || t->n_pages == 0);
    if (t->dsynced >= t->n_pages)
        return KVT_OK;
    kvt_status s = be->ops->write(be, t->dpages + t->dsynced, t->pages + t->dsynced,
                                  sizeof *t->pages * (t->n_pages - t->dsynced), stream);
    if (s == KVT_OK)
        t->dsynced = t->n_pages;
    return s;
}

/* The live pages are few (a window's worth plus one reservation), so shifting them down is
 * cheaper than any ring structure would be to read: kvt__slot stays one subtraction. */
uint32_t kvt__ptable_release_front(kvt__ptable *t, kvt__pool *p, uint64_t keep_from) {
    KVT_ASSERT(keep_from <= t->n_rows);
    uint64_t upto = keep_from / p->page_rows; /* pages [0, upto) hold only rows < keep_from */
    if (upto <= t->first_page)
        return 0;
    uint64_t n64 = upto - t->first_page;
    KVT_ASSERT(n64 <= t->n_pages);
    uint32_t n = (uint32_t)n64;
    for (uint32_t i = 0; i < n; i++)
        kvt__pool_put(p, (uint32_t)t->pages[i]);
    memmove(t->pages, t->pages + n, sizeof *t->pages * (t->n_pages - n));
    t->n_pages -= n;
    t->dsynced = 0; /* the live pages shifted: the next sync rewrites them (a window's worth) */
    t->first_page = upto;
    t->dropped_rows += (uint64_t)n * p->page_rows;
    return n;
}

void kvt__ptable_fini(kvt__ptable *t, kvt__pool *p, const kvt__alloc *a, const kvt__backend *be) {
    while (t->n_pages > 0)
        kvt__pool_put(p, (uint32_t)t->pages[--t->n_pages]);
    kvt__free(a, t->pages, sizeof *t->pages * t->cap);
    if (t->dpages)
        be->ops->buf_free(be, t->dpages, sizeof *t->dpages * t->dcap);
    memset(t, 0, sizeof *t);
}
