/* recall_table.c — the recall tables (recall_table.h) over recall.c's and recall_rope.c's
 * functions. */
#include "recall/recall_table.h"

static bool nope_live(const void *r) {
    return ((const kvt__recall_layer *)r)->buf != NULL;
}

static kvt__recall_layer *nope_base(void *r) {
    return (kvt__recall_layer *)r;
}

static uint64_t nope_bytes(const void *r) {
    return kvt__recall_layer_bytes((const kvt__recall_layer *)r);
}

static kvt_status nope_copy(void *dst, const void *src, const kvt__backend *be) {
    return kvt__recall_layer_copy((kvt__recall_layer *)dst, (const kvt__recall_layer *)src, be);
}

static void nope_fini(void *r, const kvt__backend *be) {
    kvt__recall_layer_fini((kvt__recall_layer *)r, be);
}

/* Closed blocks of block_rows rows; centres of the branch and the sketch. */
static kvt_status nope_groups_reserve(void *r, const kvt__backend *be,
                                      const kvt__recall_shape *sh) {
    const uint32_t B = sh->block_rows;
    return kvt__recall_layer_groups_reserve((kvt__recall_layer *)r, be, sh->rows / B, B,
                                            sh->branch_dim + sh->sketch_rank);
}

const kvt__recall_ops kvt__recall_nope = {
    .name = "recall",
    .layer_noun = "layer",
    .fetch_area = false,
    .live = nope_live,
    .base = nope_base,
    .bytes = nope_bytes,
    .copy = nope_copy,
    .fini = nope_fini,
    .groups_reserve = nope_groups_reserve,
};

static bool rope_live(const void *r) {
    return ((const kvt__recall_rope_layer *)r)->fbuf != NULL;
}

static kvt__recall_layer *rope_base(void *r) {
    return &((kvt__recall_rope_layer *)r)->base;
}

/* The trigger's state and the fetch lists. */
static uint64_t rope_bytes(const void *r) {
    const kvt__recall_rope_layer *rr = r;
    return kvt__recall_layer_bytes(&rr->base) + (rr->fbuf ? rr->fbytes : 0);
}

static kvt_status rope_copy(void *dst, const void *src, const kvt__backend *be) {
    return kvt__recall_rope_copy((kvt__recall_rope_layer *)dst,
                                 (const kvt__recall_rope_layer *)src, be);
}

static void rope_fini(void *r, const kvt__backend *be) {
    kvt__recall_rope_fini((kvt__recall_rope_layer *)r, be);
}

/* An archive of at most sh->rows rows a KV head (the archive's limit), in blocks of block_rows
 * archive rows (docs/recall.md §9.8); centres of MLA-RoPE's rotated branch and the archive's
 * sketch. */
static kvt_status rope_groups_reserve(void *r, const kvt__backend *be,
                                      const kvt__recall_shape *sh) {
    uint64_t rows = sh->rows;
    if (sh->archive_rows && rows > sh->archive_rows)
        rows = sh->archive_rows;
    const uint32_t branch = sh->n_planes == 1 ? sh->branch_dim : 0;
    return kvt__recall_rope_groups_reserve((kvt__recall_rope_layer *)r, be, rows, sh->block_rows,
                                           branch + sh->archive_stride);
}

const kvt__recall_ops kvt__recall_rope = {
    .name = "RoPE recall",
    .layer_noun = "RoPE layer",
    .fetch_area = true,
    .live = rope_live,
    .base = rope_base,
    .bytes = rope_bytes,
    .copy = rope_copy,
    .fini = rope_fini,
    .groups_reserve = rope_groups_reserve,
};
