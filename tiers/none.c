/*
 * none.c — policy none on full-attention layers: every committed row stays stored at row index =
 * position and is attended; nothing runs at commit. Its entries double as the shared behaviour of
 * tables that attend every row they hold (evict) or keep row index = position (salience,
 * sliding).
 */
#include "policy.h"

void kvt__none_attended(const kvt__tier_layer *l, kvt__attended_desc *d) {
    *d = (kvt__attended_desc){.lo_end = l->pt->n_rows};
}

static kvt_row_state none_row_state(const kvt__tier_layer *l, uint32_t head, uint64_t pos,
                                    int32_t *slot) {
    *slot = kvt__slot(l->pt, l->pdiv, pos);
    return KVT_ROW_ATTENDED;
}

kvt_status kvt__none_positions(const kvt__tier_layer *l, uint32_t head, int64_t *out) {
    (void)head;
    for (uint64_t i = 0; i < l->pt->n_rows; i++)
        out[i] = (int64_t)i;
    return KVT_OK;
}

/* Row index = position: the table holds every appended row, those before the first live page
 * (returned with it, sliding groups) counted in dropped_rows. */
kvt_status kvt__none_check_counts(const kvt__tier_layer *l, char *err, size_t len) {
    const kvt__ptable *t = l->pt;
    uint64_t first = kvt__ptable_first_row(t, l->page_rows);
    if (t->n_rows != l->appended)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "%llu rows held, %llu appended",
                         (unsigned long long)t->n_rows, (unsigned long long)l->appended);
    if (t->n_rows - first + t->dropped_rows != l->appended)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "%llu held + %llu dropped != %llu appended rows",
                         (unsigned long long)(t->n_rows - first),
                         (unsigned long long)t->dropped_rows, (unsigned long long)l->appended);
    return KVT_OK;
}

/* layer_window: the table that checks a policy-none layer (kvt__policy_table) answers for the
 * sliding layers a group of it may hold, as the sliding table it then gets does. */
const kvt__policy_ops kvt__policy_none = {
    .rows_are_positions = true,
    .layer_window = kvt__sliding_layer_window,
    .attended = kvt__none_attended,
    .row_state = none_row_state,
    .positions = kvt__none_positions,
    .check_counts = kvt__none_check_counts,
};
