/* test_sliding.c — page recycling of sliding-window groups, through the public API only.
 *
 * A none group whose layers are all sliding-window layers returns the pages whose rows are all
 * older than n_rows - W (W = the group's widest window) after every commit. Every test keeps a
 * shadow copy of every appended row and, after every commit, runs kvt_seq_check and compares
 * what the library reports with what the rule above predicts: rows in the last W readable with
 * exact bytes, older rows dropped page by page, the attended set exactly the last window rows of
 * each layer, pages in use bounded and the freed pages back in the pool. */
#include <criterion/criterion.h>

#include "kvtier.h"
#include "support/testutil.h"

#include <stdlib.h>
#include <string.h>

#define MAX_LAYERS 32
#define MAX_SEQS 2

typedef struct harness {
    kvt_model *model;
    kvt_ctx *ctx;
    uint32_t n_layers, page_rows, n_pages;
    /* What the test expects of each layer's group: the widest window of an all-sliding none
     * group (pages before n - W are returned), or 0 for a group that keeps every row. */
    uint32_t group_window[MAX_LAYERS];
    uint32_t n_seqs;
    kvt_seq *seq[MAX_SEQS];
    uint64_t cap_tokens;
    /* shadow[s][l]: [plane][cap_tokens][n_kv_heads * row_bytes], every row ever appended. */
    uint8_t *shadow[MAX_SEQS][MAX_LAYERS];
    tu_rng rng;
    uint64_t seed;
} harness;

static const kvt_layer_spec *spec_of(const harness *h, uint32_t l) {
    return kvt_model_layer(h->model, l);
}

static size_t slot_bytes(const harness *h, uint32_t l) {
    return (size_t)spec_of(h, l)->n_kv_heads * spec_of(h, l)->row_bytes;
}

static uint8_t *shadow_row(const harness *h, uint32_t s, uint32_t l, uint32_t plane,
                           uint64_t pos) {
    return h->shadow[s][l] + ((size_t)plane * h->cap_tokens + pos) * slot_bytes(h, l);
}

static uint32_t ceil_div(uint64_t a, uint32_t b) {
    return (uint32_t)((a + b - 1) / b);
}

/* Largest number of pages a sequence of a recycled group may hold after a commit:
 * ceil((W + page_rows) / page_rows) + 1 (the brief's bound; the rule gives ceil((W+PR-1)/PR)). */
static uint32_t page_bound(uint32_t W, uint32_t page_rows) {
    return ceil_div((uint64_t)W + page_rows, page_rows) + 1;
}

static void harness_init(harness *h, kvt_model *m, const kvt_ctx_params *base, uint32_t n_seqs,
                         uint64_t cap_tokens, uint64_t seed) {
    memset(h, 0, sizeof *h);
    h->model = m;
    h->n_layers = kvt_model_n_layers(m);
    cr_assert(h->n_layers <= MAX_LAYERS);
    h->page_rows = base->page_rows;
    h->n_pages = base->n_pages;
    h->cap_tokens = cap_tokens;
    h->seed = seed;
    h->rng.s = seed;
    cr_log_info("seed %llu", (unsigned long long)seed);
    char err[512];
    kvt_ctx_params p = *base;
    p.model = m;
    cr_assert_eq(kvt_ctx_create(&p, &h->ctx, err, sizeof err), KVT_OK, "%s", err);
    h->n_seqs = n_seqs;
    for (uint32_t s = 0; s < n_seqs; s++) {
        cr_assert_eq(tu_seq_create(h->ctx, 100 + s, &h->seq[s]), KVT_OK);
        for (uint32_t l = 0; l < h->n_layers; l++) {
            h->shadow[s][l] = malloc(spec_of(h, l)->n_planes * cap_tokens * slot_bytes(h, l));
            cr_assert_not_null(h->shadow[s][l]);
        }
    }
}

static void harness_fini(harness *h) {
    for (uint32_t s = 0; s < h->n_seqs; s++)
        for (uint32_t l = 0; l < h->n_layers; l++)
            free(h->shadow[s][l]);
    kvt_ctx_destroy(h->ctx);
    kvt_model_destroy(h->model);
}

/* Reserve n tokens, write random rows (through kvt_seq_write on even layers, straight into the
 * pool at the reserved slots on odd ones), commit, check the invariants. */
static void append(harness *h, uint32_t s, uint32_t n) {
    kvt_seq *seq = h->seq[s];
    uint64_t pos = kvt_seq_length(seq);
    cr_assert(pos + n <= h->cap_tokens);
    cr_assert_eq(tu_reserve(seq, n), KVT_OK, "seed %llu: reserve %u at %llu: %s",
                 (unsigned long long)h->seed, n, (unsigned long long)pos,
                 kvt_last_error());
    for (uint32_t l = 0; l < h->n_layers; l++) {
        const kvt_layer_spec *sp = spec_of(h, l);
        size_t sb = slot_bytes(h, l);
        for (uint32_t p = 0; p < sp->n_planes; p++) {
            uint8_t *dst = shadow_row(h, s, l, p, pos);
            for (size_t b = 0; b < (size_t)n * sb; b += 8) {
                uint64_t r = tu_next(&h->rng);
                memcpy(dst + b, &r, (size_t)n * sb - b < 8 ? (size_t)n * sb - b : 8);
            }
            if (l % 2 == 0) {
                cr_assert_eq(kvt_seq_write(seq, l, p, 0, n, dst, (size_t)n * sb), KVT_OK, "%s",
                             kvt_last_error());
            } else {
                void *base;
                size_t bytes;
                cr_assert_eq(kvt_layer_data(h->ctx, l, p, &base, &bytes), KVT_OK);
                for (uint32_t i = 0; i < n; i++) {
                    int32_t slot;
                    cr_assert_eq(kvt_seq_reserved_slot(seq, l, i, &slot), KVT_OK);
                    cr_assert((size_t)(slot + 1) * sb <= bytes);
                    memcpy((uint8_t *)base + (size_t)slot * sb, dst + (size_t)i * sb, sb);
                }
            }
        }
    }
    cr_assert_eq(tu_commit(seq, n), KVT_OK, "seed %llu: commit %u at %llu: %s",
                 (unsigned long long)h->seed, n, (unsigned long long)pos,
                 kvt_last_error());
    cr_assert_eq(kvt_seq_check(seq), KVT_OK, "seed %llu at %llu: %s", (unsigned long long)h->seed,
                 (unsigned long long)(pos + n), kvt_last_error());
}

/* First row index still stored in a group of window W holding n rows (0: nothing returned). */
static uint64_t expected_first_row(uint32_t W, uint64_t n, uint32_t page_rows) {
    return (W && n > W) ? (n - W) / page_rows * page_rows : 0;
}

/* Rows layer l attends: the last sliding_window rows on a sliding layer, all of them otherwise
 * (none groups of full-attention layers, and evict groups before their first round). */
static uint64_t expected_attended(const kvt_layer_spec *sp, uint64_t n) {
    return sp->kind == KVT_LAYER_SLIDING && n > sp->sliding_window ? sp->sliding_window : n;
}

/* Pages of layer l held by a sequence right after a commit: those of rows [first_row, n). */
static uint64_t expected_pages(const harness *h, uint32_t l, uint64_t n) {
    uint64_t first = expected_first_row(h->group_window[l], n, h->page_rows);
    return ceil_div(n, h->page_rows) - first / h->page_rows;
}

/* Everything observable about one layer of one committed sequence, against the shadow. */
static void verify_layer(harness *h, uint32_t s, uint32_t l) {
    kvt_ctx *ctx = h->ctx;
    kvt_seq *seq = h->seq[s];
    const kvt_layer_spec *sp = spec_of(h, l);
    const uint32_t H = sp->n_kv_heads, RB = sp->row_bytes, PR = h->page_rows;
    const size_t sb = slot_bytes(h, l);
    const uint64_t n = kvt_seq_length(seq);
    const uint64_t first = expected_first_row(h->group_window[l], n, PR);
    const uint64_t att = expected_attended(sp, n);
    const unsigned long long seed = (unsigned long long)h->seed;

    /* Block table: live pages only, first_page derivable as documented. */
    uint32_t n_pages = 0;
    uint64_t n_rows = 0;
    cr_assert_eq(kvt_seq_block_table(seq, l, NULL, 0, &n_pages, &n_rows), KVT_OK);
    cr_assert_eq(n_rows, n);
    cr_assert_eq(n_pages, expected_pages(h, l, n), "seed %llu layer %u at %llu: %u pages", seed,
                 l, (unsigned long long)n, n_pages);
    int32_t *pages = malloc(sizeof *pages * (n_pages + 1));
    cr_assert_eq(kvt_seq_block_table(seq, l, pages, n_pages, &n_pages, &n_rows), KVT_OK);
    const uint64_t first_page = ceil_div(n, PR) - n_pages;
    cr_assert_eq(first_page * PR, first);
    uint64_t first_row = 7;
    cr_assert_eq(kvt_seq_first_row(seq, l, &first_row), KVT_OK);
    cr_assert_eq(first_row, first, "kvt_seq_first_row %llu, expected %llu",
                 (unsigned long long)first_row, (unsigned long long)first);

    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(seq, l, &ls), KVT_OK);
    cr_assert_eq(ls.appended_rows, n * H);
    cr_assert_eq(ls.attended_rows, att, "seed %llu layer %u: attended %llu, expected %llu", seed,
                 l, (unsigned long long)ls.attended_rows, (unsigned long long)att);
    cr_assert_eq(ls.dropped_rows, first * H, "seed %llu layer %u at %llu: dropped %llu", seed, l,
                 (unsigned long long)n, (unsigned long long)ls.dropped_rows);
    cr_assert_eq(ls.archived_rows, (n - att - first) * H);
    cr_assert_eq(ls.attended_rows * H + ls.archived_rows + ls.dropped_rows, ls.appended_rows);
    cr_assert_eq(ls.pages_in_use, n_pages);
    cr_assert_eq(ls.bytes_in_use, (uint64_t)n_pages * PR * sb * sp->n_planes);

    /* Row by row: state, slot (against the block table), bytes (against the shadow). */
    void *base[2] = {NULL, NULL};
    size_t bytes;
    for (uint32_t p = 0; p < sp->n_planes; p++)
        cr_assert_eq(kvt_layer_data(ctx, l, p, &base[p], &bytes), KVT_OK);
    int64_t *positions = malloc(sizeof *positions * (n + 1));
    uint64_t n_pos = 0;
    cr_assert_eq(kvt_seq_positions(seq, l, 0, positions, n + 1, &n_pos), KVT_OK);
    cr_assert_eq(n_pos, n);
    uint8_t row[4096];
    cr_assert(RB <= sizeof row);
    int32_t *want_slots = malloc(sizeof *want_slots * (att + 1));
    for (uint32_t hd = 0; hd < H; hd++) {
        for (uint64_t pos = 0; pos < n; pos++) {
            kvt_row_state st;
            int32_t slot = -7;
            cr_assert_eq(kvt_seq_row_state(seq, l, hd, pos, &st, &slot), KVT_OK);
            if (pos < first) {
                cr_assert_eq(st, KVT_ROW_DROPPED, "seed %llu layer %u pos %llu of %llu: state %d",
                             seed, l, (unsigned long long)pos, (unsigned long long)n, st);
                cr_assert_eq(slot, -1);
                cr_assert_eq(kvt_seq_read_row(seq, l, 0, hd, pos, row, RB), KVT_ERR_DROPPED);
                cr_assert_eq(positions[pos], -1);
                continue;
            }
            cr_assert_eq(positions[pos], (int64_t)pos);
            kvt_row_state want = pos >= n - att ? KVT_ROW_ATTENDED : KVT_ROW_ARCHIVED;
            cr_assert_eq(st, want, "seed %llu layer %u pos %llu of %llu: state %d, want %d", seed,
                         l, (unsigned long long)pos, (unsigned long long)n, st, want);
            int32_t table_slot = pages[pos / PR - first_page] * (int32_t)PR + (int32_t)(pos % PR);
            if (st == KVT_ROW_ATTENDED) {
                cr_assert_eq(slot, table_slot);
                if (hd == 0)
                    want_slots[pos - (n - att)] = slot;
            }
            for (uint32_t p = 0; p < sp->n_planes; p++) {
                const uint8_t *want_row = shadow_row(h, s, l, p, pos) + (size_t)hd * RB;
                cr_assert_eq(kvt_seq_read_row(seq, l, p, hd, pos, row, RB), KVT_OK, "%s",
                             kvt_last_error());
                cr_assert_eq(memcmp(row, want_row, RB), 0,
                             "seed %llu layer %u plane %u head %u pos %llu: bytes differ", seed,
                             l, p, hd, (unsigned long long)pos);
                /* And where the block table says it lives in the pool. */
                const uint8_t *in_pool =
                    (const uint8_t *)base[p] + (size_t)table_slot * sb + (size_t)hd * RB;
                cr_assert_eq(memcmp(in_pool, want_row, RB), 0);
            }
        }
    }
    /* The attended set handed to the engine: exactly the last `att` rows, ascending. */
    uint32_t cnt = 0;
    cr_assert_eq(tu_attended_count(ctx, l, &seq, 1, &cnt), KVT_OK);
    cr_assert_eq(cnt, att);
    int32_t *idx = malloc(sizeof *idx * (att + 2));
    int32_t len = -1;
    cr_assert_eq(tu_attended_tokens(ctx, l, &seq, 1, idx, (uint32_t)att + 2, &len),
                 KVT_OK);
    cr_assert_eq((uint64_t)len, att);
    cr_assert_eq(idx[att], -1);
    cr_assert_eq(memcmp(idx, want_slots, sizeof *idx * att), 0,
                 "seed %llu layer %u: attended slots differ", seed, l);
    int32_t indptr[2];
    cr_assert_eq(tu_attended_csr(ctx, l, &seq, 1, indptr, idx, (uint32_t)att),
                 KVT_OK);
    cr_assert_eq((uint64_t)indptr[1], att);
    cr_assert_eq(memcmp(idx, want_slots, sizeof *idx * att), 0);
    free(idx);
    free(want_slots);
    free(positions);
    free(pages);
}

/* Pages of layer l's group held by all sequences + free pages = the pool. */
static void verify_pool(const harness *h, uint32_t l) {
    uint64_t held = 0;
    for (uint32_t s = 0; s < h->n_seqs; s++) {
        kvt_layer_stats ls = {.struct_size = sizeof ls};
        cr_assert_eq(kvt_seq_layer_stats(h->seq[s], l, &ls), KVT_OK);
        held += ls.pages_in_use;
    }
    uint32_t free_pages = 0;
    cr_assert_eq(kvt_ctx_free_pages(h->ctx, l, &free_pages), KVT_OK);
    cr_assert_eq(held + free_pages, h->n_pages, "layer %u: %llu held + %u free != %u", l,
                 (unsigned long long)held, free_pages, h->n_pages);
}

static uint64_t pages_in_use(const harness *h, uint32_t s, uint32_t l) {
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(h->seq[s], l, &ls), KVT_OK);
    return ls.pages_in_use;
}

/* Two sliding layers (windows 64 and 100), 2 KV heads of 8 bf16 values, K and V planes. */
static kvt_model *two_sliding(kvt_layer_kind second_kind) {
    kvt_layer_spec specs[2];
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 2, 8, &specs[0]), KVT_OK);
    specs[0].sliding_window = 64;
    cr_assert_eq(kvt_layer_spec_gqa(second_kind, KVT_DTYPE_BF16, 2, 8, &specs[1]), KVT_OK);
    specs[1].sliding_window = second_kind == KVT_LAYER_SLIDING ? 100 : 0;
    kvt_model *m = NULL;
    char err[256];
    cr_assert_eq(kvt_model_create(specs, 2, "sliding-test", &m, err, sizeof err), KVT_OK, "%s",
                 err);
    return m;
}

Test(sliding, pages_recycled_one_at_a_time_and_in_chunks) {
    kvt_ctx_params p = kvt_ctx_default_params();
    p.page_rows = 16;
    p.n_pages = 64; /* 1024 rows: two sequences of 1000 rows only fit if pages come back */
    harness h;
    harness_init(&h, two_sliding(KVT_LAYER_SLIDING), &p, 2, 1000, 0x511d1);
    cr_assert_eq(kvt_ctx_layer_group(h.ctx, 0), kvt_ctx_layer_group(h.ctx, 1));
    h.group_window[0] = h.group_window[1] = 100; /* the widest window of the group */
    const uint32_t bound = page_bound(100, 16);  /* ceil(116 / 16) + 1 = 9 */
    const uint32_t chunks[] = {37, 1, 3, 16, 100, 5, 64, 2, 15, 17};
    uint64_t max_pages[2] = {0, 0};
    uint32_t k = 0;
    while (kvt_seq_length(h.seq[0]) < 1000 || kvt_seq_length(h.seq[1]) < 1000) {
        /* Sequence 0 decodes one token at a time; sequence 1 appends chunks. */
        if (kvt_seq_length(h.seq[0]) < 1000) {
            uint32_t free_before = 0, free_after = 0;
            cr_assert_eq(kvt_ctx_free_pages(h.ctx, 0, &free_before), KVT_OK);
            uint64_t pages_before = pages_in_use(&h, 0, 0);
            append(&h, 0, 1);
            cr_assert_eq(kvt_ctx_free_pages(h.ctx, 0, &free_after), KVT_OK);
            uint64_t pages_after = pages_in_use(&h, 0, 0);
            /* What this sequence gave back is exactly what the pool gained. */
            cr_assert_eq((int64_t)free_after - (int64_t)free_before,
                         (int64_t)pages_before - (int64_t)pages_after);
            if (pages_after > max_pages[0])
                max_pages[0] = pages_after;
            cr_assert_leq(pages_after, bound, "sequence 0 at %llu holds %llu pages",
                          (unsigned long long)kvt_seq_length(h.seq[0]),
                          (unsigned long long)pages_after);
            for (uint32_t l = 0; l < 2; l++)
                verify_layer(&h, 0, l);
        }
        if (kvt_seq_length(h.seq[1]) < 1000) {
            uint64_t left = 1000 - kvt_seq_length(h.seq[1]);
            uint32_t n = chunks[k++ % (sizeof chunks / sizeof *chunks)];
            append(&h, 1, left < n ? (uint32_t)left : n);
            uint64_t pg = pages_in_use(&h, 1, 0);
            if (pg > max_pages[1])
                max_pages[1] = pg;
            cr_assert_leq(pg, bound, "sequence 1 at %llu holds %llu pages",
                          (unsigned long long)kvt_seq_length(h.seq[1]), (unsigned long long)pg);
            for (uint32_t l = 0; l < 2; l++)
                verify_layer(&h, 1, l);
        }
        for (uint32_t l = 0; l < 2; l++)
            verify_pool(&h, l);
    }
    cr_log_info("max pages per sequence: %llu (one at a time), %llu (chunks); bound %u",
                (unsigned long long)max_pages[0], (unsigned long long)max_pages[1], bound);
    /* A reservation of one token on top of a committed window still stays under the bound. */
    cr_assert_eq(tu_reserve(h.seq[0], 1), KVT_OK);
    cr_assert_leq(pages_in_use(&h, 0, 0), bound);
    cr_assert_eq(kvt_seq_check(h.seq[0]), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(tu_commit(h.seq[0], 1), KVT_OK);
    cr_assert_eq(kvt_seq_check(h.seq[0]), KVT_OK, "%s", kvt_last_error());
    /* Destroying the sequences returns every live page. */
    kvt_seq_destroy(h.seq[0]);
    kvt_seq_destroy(h.seq[1]);
    uint32_t free_pages = 0;
    cr_assert_eq(kvt_ctx_free_pages(h.ctx, 0, &free_pages), KVT_OK);
    cr_assert_eq(free_pages, 64);
    harness_fini(&h);
}

Test(sliding, pool_smaller_than_context_keeps_working) {
    kvt_ctx_params p = kvt_ctx_default_params();
    p.page_rows = 16;
    p.n_pages = 10; /* 160 rows: room for the window (100) and one page being filled */
    const uint64_t total = 10 * 160;
    harness h;
    harness_init(&h, two_sliding(KVT_LAYER_SLIDING), &p, 1, total, 0x5a11);
    h.group_window[0] = h.group_window[1] = 100;
    while (kvt_seq_length(h.seq[0]) < total) {
        uint64_t len = kvt_seq_length(h.seq[0]);
        uint32_t n = len < total / 2 ? 1 : 13; /* decode, then 13-token chunks */
        if (total - len < n)
            n = (uint32_t)(total - len);
        append(&h, 0, n);
        cr_assert_leq(pages_in_use(&h, 0, 0), page_bound(100, 16));
        verify_pool(&h, 0);
        if (len % 97 == 0 || n > 1)
            for (uint32_t l = 0; l < 2; l++)
                verify_layer(&h, 0, l);
    }
    for (uint32_t l = 0; l < 2; l++)
        verify_layer(&h, 0, l);
    cr_assert_eq(kvt_seq_length(h.seq[0]), total);
    harness_fini(&h);
}

Test(sliding, none_group_with_full_attention_layer_keeps_everything) {
    /* Layer 1 is a full-attention GQA layer moved to policy none: the group shares one page
     * table, and that layer attends every row, so nothing may be returned. */
    kvt_policy pol[2] = {KVT_POLICY_NONE, KVT_POLICY_NONE};
    kvt_ctx_params p = kvt_ctx_default_params();
    p.page_rows = 16;
    p.n_pages = 40; /* 640 rows */
    p.layer_policies = pol;
    harness h;
    harness_init(&h, two_sliding(KVT_LAYER_GQA_ROPE), &p, 1, 640, 0xf011);
    cr_assert_eq(kvt_ctx_layer_policy(h.ctx, 1), KVT_POLICY_NONE);
    cr_assert_eq(kvt_ctx_layer_group(h.ctx, 0), kvt_ctx_layer_group(h.ctx, 1));
    h.group_window[0] = h.group_window[1] = 0; /* keeps every row */
    const uint32_t chunks[] = {1, 7, 16, 33};
    for (uint32_t k = 0; kvt_seq_length(h.seq[0]) < 640; k++) {
        uint64_t left = 640 - kvt_seq_length(h.seq[0]);
        uint32_t n = chunks[k % 4];
        append(&h, 0, left < n ? (uint32_t)left : n);
        cr_assert_eq(pages_in_use(&h, 0, 0), ceil_div(kvt_seq_length(h.seq[0]), 16));
        if (k % 8 == 0)
            for (uint32_t l = 0; l < 2; l++)
                verify_layer(&h, 0, l);
    }
    for (uint32_t l = 0; l < 2; l++)
        verify_layer(&h, 0, l);
    kvt_layer_stats ls = {.struct_size = sizeof ls};
    cr_assert_eq(kvt_seq_layer_stats(h.seq[0], 0, &ls), KVT_OK);
    cr_assert_eq(ls.dropped_rows, 0);
    cr_assert_eq(ls.attended_rows, 64); /* the sliding layer still attends only its window */
    cr_assert_eq(ls.archived_rows, (640 - 64) * 2);
    cr_assert_eq(kvt_seq_layer_stats(h.seq[0], 1, &ls), KVT_OK);
    cr_assert_eq(ls.attended_rows, 640);
    cr_assert_eq(ls.dropped_rows, 0);
    /* The pool is full: the whole context is held. */
    cr_assert_eq(tu_reserve(h.seq[0], 1), KVT_ERR_POOL_EXHAUSTED);
    harness_fini(&h);
}

Test(sliding, gemma3_1b_2000_tokens) {
    kvt_model *m = NULL;
    char err[512];
    cr_assert_eq(kvt_model_from_file(tu_model_path("gemma-3-1b-it.json"), KVT_DTYPE_BF16, &m,
                                     err, sizeof err),
                 KVT_OK, "%s", err);
    const uint32_t L = kvt_model_n_layers(m);
    uint32_t sliding_layer = UINT32_MAX, global_layer = UINT32_MAX, n_sliding = 0, W = 0;
    for (uint32_t l = 0; l < L; l++) {
        const kvt_layer_spec *sp = kvt_model_layer(m, l);
        if (sp->kind == KVT_LAYER_SLIDING) {
            n_sliding++;
            sliding_layer = sliding_layer == UINT32_MAX ? l : sliding_layer;
            W = sp->sliding_window > W ? sp->sliding_window : W;
        } else if (global_layer == UINT32_MAX) {
            global_layer = l;
        }
    }
    cr_assert_eq(L, 26);
    cr_assert_eq(n_sliding, 22);
    cr_assert_eq(W, 512);
    const uint64_t T = 2000;
    kvt_ctx_params p = kvt_ctx_default_params();
    kvt_config p_cfg = kvt_config_default();
    p.config = &p_cfg;
    p.page_rows = 16;
    p.n_pages = 130; /* the global layers hold all 2000 rows: 125 pages */
    p_cfg.evict_budget_rows = 4096; /* large budget: no round within 2000 tokens */
    harness h;
    harness_init(&h, m, &p, 1, T, 0x6e33a);
    cr_assert_eq(kvt_ctx_layer_policy(h.ctx, global_layer), KVT_POLICY_EVICT);
    cr_assert_eq(kvt_ctx_layer_policy(h.ctx, sliding_layer), KVT_POLICY_NONE);
    for (uint32_t l = 0; l < L; l++)
        h.group_window[l] = kvt_model_layer(m, l)->kind == KVT_LAYER_SLIDING ? W : 0;
    cr_assert_eq(kvt_seq_set_prompt_rows(h.seq[0], 300), KVT_OK);
    const uint32_t bound = page_bound(W, 16); /* ceil(528 / 16) + 1 = 34 */
    uint64_t max_sliding = 0;
    append(&h, 0, 300); /* prefill */
    while (kvt_seq_length(h.seq[0]) < T) {
        append(&h, 0, 1);
        uint64_t n = kvt_seq_length(h.seq[0]);
        uint64_t sp = pages_in_use(&h, 0, sliding_layer);
        max_sliding = sp > max_sliding ? sp : max_sliding;
        cr_assert_leq(sp, bound, "sliding group at %llu tokens holds %llu pages",
                      (unsigned long long)n, (unsigned long long)sp);
        cr_assert_eq(pages_in_use(&h, 0, global_layer), ceil_div(n, 16));
        if (n % 250 == 0) {
            verify_layer(&h, 0, sliding_layer);
            verify_layer(&h, 0, global_layer);
            verify_pool(&h, sliding_layer);
            verify_pool(&h, global_layer);
        }
    }
    for (uint32_t l = 0; l < L; l++) {
        verify_layer(&h, 0, l);
        verify_pool(&h, l);
    }
    kvt_layer_stats sl = {.struct_size = sizeof sl}, gl = {.struct_size = sizeof gl};
    cr_assert_eq(kvt_seq_layer_stats(h.seq[0], sliding_layer, &sl), KVT_OK);
    cr_assert_eq(kvt_seq_layer_stats(h.seq[0], global_layer, &gl), KVT_OK);
    cr_assert_eq(gl.attended_rows, T);
    cr_assert_eq(gl.dropped_rows + gl.archived_rows + gl.rounds, 0);
    cr_assert_eq(sl.attended_rows, W);
    cr_assert_eq(sl.dropped_rows, (T - W) / 16 * 16);
    uint64_t sliding_bytes = sl.bytes_in_use * n_sliding;
    uint64_t global_bytes = gl.bytes_in_use * (L - n_sliding);
    cr_log_info("gemma-3-1b at %llu tokens: sliding group %llu pages (%llu MiB over %u layers; "
                "%u pages without recycling), global group %llu pages (%llu MiB over %u layers)",
                (unsigned long long)T, (unsigned long long)sl.pages_in_use,
                (unsigned long long)(sliding_bytes >> 20), n_sliding, ceil_div(T, 16),
                (unsigned long long)gl.pages_in_use, (unsigned long long)(global_bytes >> 20),
                L - n_sliding);
    cr_assert_eq(sl.pages_in_use, ceil_div(T, 16) - (T - W) / 16);
    cr_assert_leq(max_sliding, bound);
    harness_fini(&h);
}
