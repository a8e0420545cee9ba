/*
 * seq_internal.h — what the files of a request share (lib/: sequence.c its lifecycle, seq_fork.c
 * fork and attach with copy on write, seq_step.c reserve / write / commit and the step's
 * queries, seq_inspect.c rows by position, statistics and the invariant check): the argument
 * checks of the public calls and the views of a layer its policy table's entries take.
 */
#ifndef KVT_LIB_SEQ_INTERNAL_H
#define KVT_LIB_SEQ_INTERNAL_H

#include "handles.h"

#define CHECK_SEQ(seq)                                                                             \
    do {                                                                                           \
        if (!(seq))                                                                                \
            return KVT_ERR_INVALID_ARGUMENT;                                                       \
        kvt__ctx_clear_error((seq)->ctx);                                                          \
    } while (0)

/* CHECK_SEQ for calls that change a sequence: a damaged one only accepts kvt_seq_destroy. */
#define CHECK_LIVE_SEQ(seq)                                                                        \
    do {                                                                                           \
        CHECK_SEQ(seq);                                                                            \
        kvt_status live_ = kvt__seq_usable(seq);                                                   \
        if (live_ != KVT_OK)                                                                       \
            return live_;                                                                          \
    } while (0)

/* By-position queries describe the committed state: refused while a step is in flight (a
 * layer's run may have compacted its rows while the table still holds the old count). */
#define CHECK_BETWEEN_STEPS(seq)                                                                   \
    do {                                                                                           \
        CHECK_SEQ(seq);                                                                            \
        if ((seq)->in_step)                                                                        \
            return kvt__ctx_fail((seq)->ctx, KVT_ERR_BAD_STATE,                                    \
                                 "request %llu has a step in flight (planned, not committed): "    \
                                 "by-position queries answer between steps",                       \
                                 (unsigned long long)(seq)->request_id);                           \
    } while (0)

/* Layer `layer` of the request, one with KV (KVT_ERR_OUT_OF_RANGE, KVT_ERR_POLICY_MISMATCH with
 * the context's message otherwise); kvt__seq_layer_head_of: and a KV head of that layer. */
kvt_status kvt__seq_layer_of(const kvt_seq *seq, uint32_t layer, const kvt__store **st);
kvt_status kvt__seq_layer_head_of(const kvt_seq *seq, uint32_t layer, uint32_t head,
                                  const kvt__store **st);

/* Layer `layer` (one with KV) of a sequence as its policy table's per-layer entries see it. */
static inline kvt__tier_layer kvt__seq_tier_layer(const kvt_seq *seq, uint32_t layer) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__store *st = &ctx->stores[layer];
    kvt__tier_layer l;
    l.cfg = &seq->cfg;
    l.page_rows = ctx->page_rows;
    l.pdiv = &ctx->pdiv;
    l.gr = &ctx->groups[st->group];
    l.st = st;
    l.pt = &seq->pt[st->group];
    l.state = kvt__seq_state(seq, layer);
    l.appended = seq->n_tokens;
    l.prompt_rows = seq->prompt_rows;
    return l;
}

/* The policy table of a layer with KV. */
static inline const kvt__policy_ops *kvt__seq_ops_of(const kvt_ctx *ctx, uint32_t layer) {
    return ctx->groups[ctx->stores[layer].group].ops;
}

/* The rows of a close's budget reserved for recall's promoted set (the table's promote_room;
 * 0 without one). */
static inline uint64_t kvt__seq_promote_room(const kvt__policy_ops *ops, uint64_t closed_rows,
                             const kvt_config *cfg) {
    return ops->promote_room ? ops->promote_room(closed_rows, cfg) : 0;
}

/* The group planes of the pruned scan of `layer`'s trigger (table ro, state r) for a request
 * holding `rows` rows (a RoPE trigger's: an archive of at most that many rows a KV head), through
 * the table's groups_reserve (sequence.c). */
kvt_status kvt__seq_recall_groups_reserve(kvt_seq *seq, uint32_t layer,
                                          const kvt__recall_ops *ro, void *r, uint64_t rows);

/* Copy on write (seq_fork.c): group g's shared pages holding rows at or past from_row become the
 * request's own; kvt__seq_cow_undo undoes group g's copies of the reservation being made;
 * kvt__seq_group_writes_from: the first row a step growing the table to rows_after may write. */
kvt_status kvt__seq_own_pages(kvt_seq *seq, uint32_t g, uint64_t from_row);
void kvt__seq_cow_undo(kvt_seq *seq, uint32_t g);
uint64_t kvt__seq_group_writes_from(const kvt_seq *seq, uint32_t g, uint64_t rows_after);

/* One layer's check: its counts (every commit), or full (kvt_seq_check). seq_step.c. */
kvt_status kvt__seq_check_layer(const kvt_seq *seq, uint32_t layer, bool full);

#endif /* KVT_LIB_SEQ_INTERNAL_H */
