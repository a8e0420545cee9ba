/*
 * sliding.c — policy none on a group that holds sliding-window layers (gemma-3, mistral, ...).
 *
 * Each sliding layer attends the last sliding_window rows of the group's table (a full-attention
 * layer moved into the group attends every row); rows are addressed by position. Stored rows
 * outside a layer's window are archived for it: still in the pool, readable.
 *
 * Recycled leading pages. When every layer of the group is a sliding-window layer, no layer ever
 * reads a row before n_rows - W again (W = the largest window of the group), so after each commit
 * the pages whose rows all lie before that go back to the pool (kvt__ptable_release_front); their
 * rows are dropped. Row indices keep meaning positions (first_page says where the table starts).
 * Between commits a sequence holds at most ceil((W + page_rows - 1) / page_rows) pages of the
 * group, plus what the next reservation takes. One full-attention layer in the group keeps every
 * row of the shared table: W = 0, nothing goes back.
 */
#include "policy.h"

bool kvt__sliding_layer_window(const kvt_layer_spec *sp, uint32_t *rows) {
    *rows = sp->kind == KVT_LAYER_SLIDING ? sp->sliding_window : 0;
    return sp->kind == KVT_LAYER_SLIDING;
}

static kvt_status sliding_group_init(kvt__group *gr, const kvt__store *stores, const kvt__alloc *a,
                                     const kvt_config *cfg, char *err, size_t len) {
    gr->window_rows = 0;
    bool all_sliding = gr->n_layers > 0;
    for (uint32_t k = 0; all_sliding && k < gr->n_layers; k++) {
        uint32_t w;
        if (!kvt__sliding_layer_window(&stores[gr->layers[k]].spec, &w) || w == 0)
            all_sliding = false;
        else if (w > gr->window_rows)
            gr->window_rows = w;
    }
    if (!all_sliding)
        gr->window_rows = 0;
    return KVT_OK;
}

/* Allocates nothing and cannot fail. */
static kvt_status sliding_group_commit(const kvt__env *env, const kvt__tier_group *g) {
    uint32_t W = g->gr->window_rows;
    kvt__ptable *t = g->pt;
    if (W != 0 && t->n_rows > W)
        kvt__ptable_release_front(t, &g->gr->pool, t->n_rows - W);
    return KVT_OK;
}

static uint64_t sliding_attended_count(const kvt__tier_layer *l) {
    const kvt_layer_spec *sp = &l->st->spec;
    if (sp->kind == KVT_LAYER_SLIDING && l->pt->n_rows > sp->sliding_window)
        return sp->sliding_window;
    return l->pt->n_rows;
}

static void sliding_attended(const kvt__tier_layer *l, kvt__attended_desc *d) {
    uint64_t n = sliding_attended_count(l);
    *d = (kvt__attended_desc){.hi_begin = l->pt->n_rows - n, .hi_end = l->pt->n_rows};
}

static kvt_row_state sliding_row_state(const kvt__tier_layer *l, uint32_t head, uint64_t pos,
                                       int32_t *slot) {
    const kvt__ptable *t = l->pt;
    if (pos < kvt__ptable_first_row(t, l->page_rows)) {
        /* Its page went back to the pool: older than every window of the group. */
        *slot = -1;
        return KVT_ROW_DROPPED;
    }
    *slot = kvt__slot(t, l->pdiv, pos);
    return pos >= t->n_rows - sliding_attended_count(l) ? KVT_ROW_ATTENDED : KVT_ROW_ARCHIVED;
}

static kvt_status sliding_positions(const kvt__tier_layer *l, uint32_t head, int64_t *out) {
    (void)head;
    uint64_t first = kvt__ptable_first_row(l->pt, l->page_rows);
    for (uint64_t i = 0; i < l->pt->n_rows; i++)
        out[i] = i < first ? -1 : (int64_t)i; /* -1: the row left with its page */
    return KVT_OK;
}

static void sliding_stats(const kvt__tier_layer *l, kvt_layer_stats *out) {
    /* Rows before the first live page left with it; the rest of those outside this layer's
     * window stay stored, archived. */
    uint64_t H = l->st->spec.n_kv_heads;
    uint64_t dropped = kvt__ptable_first_row(l->pt, l->page_rows);
    out->dropped_rows = dropped * H;
    out->archived_rows = (l->pt->n_rows - out->attended_rows - dropped) * H;
}

const kvt__policy_ops kvt__policy_sliding = {
    .rows_are_positions = true,
    .dropped_how = "with its page (outside every sliding window of its group)",
    .layer_window = kvt__sliding_layer_window,
    .group_init = sliding_group_init,
    .group_commit = sliding_group_commit,
    .attended = sliding_attended,
    .row_state = sliding_row_state,
    .positions = sliding_positions,
    .stats = sliding_stats,
    .check_counts = kvt__none_check_counts,
};
