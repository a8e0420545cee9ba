/*
 * test_paged.c — KVT_EMIT_PAGED, FlashInfer's paged CSR (kv_indptr over page ids, kv_indices,
 * kv_last_page_len), and kvt_batch_plan_device's emission array at an older caller's stride.
 *
 *   - sets of whole pages (requests under the salience budget and the eviction budget, the
 *     random-eviction layers after their rounds, a sliding window listed from its first page)
 *     give the page ids of the request's block table, hand-computed from its rows, page size and
 *     window; expanded into slots (and, on the sliding layer, trimmed by FlashInfer's
 *     window_left = W - 1) they are the TOKENS layout's slots of the same step;
 *   - a salience set of single kept rows is refused (KVT_ERR_UNSUPPORTED, kvt_batch_emit_fits
 *     said so before the run) and the same step still emits TOKENS; a close that kept every
 *     row (ratio 1) is one range again; sinks and tail on page boundaries are two ranges;
 *   - a request that recalls is refused before the layer's work; PAGED from a struct that ends
 *     before last_page_len, with per-request lengths, or before plan is refused;
 *   - the planned path (kvt_batch_plan_device, a captured run replayed) writes what the eager
 *     runs write, on the CPU, guarded and CUDA backends (the CUDA one under KVT_CUDA_EMU);
 *   - plan_device reads an array of an older caller's smaller kvt_emit at its struct_size stride.
 */
#include <criterion/criterion.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "lib/kvtier.h"
#include "support/testutil.h"
#include "support/tu_cuda.h"

kvt__backend *kvt__batch_backend(kvt_batch *b);

enum { NQ = 3, P = 16, W = TU_WINDOW, CAP = 4096 };

/* The mixed model's context (salience, two random-eviction layers, a sliding window of W) with
 * pages of P rows on backend k, the salience ratio and sinks given; NULL where the backend is
 * unavailable (why says so). */
static kvt_ctx *open_ctx(kvt_model *m, kvt_backend_kind k, uint32_t ratio, uint32_t sinks,
                         char *why, size_t why_len) {
    kvt_config c = tu_mixed_config(false, TU_K);
    c.ratio = ratio;
    c.sink_rows = sinks;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = P;
    p.n_pages = 512;
    p.backend = k;
    kvt_ctx *ctx = NULL;
    return kvt_ctx_create(&p, &ctx, why, why_len) == KVT_OK ? ctx : NULL;
}

/* One emission's arrays in kvt_buffer memory (any backend), read back into host copies. */
typedef struct em {
    kvt_buffer *idx, *ptr, *last;
    kvt_emit e;
    int32_t h_idx[CAP], h_ptr[NQ + 1], h_last[NQ];
} em;

static void em_open(kvt_ctx *ctx, em *x, kvt_emit_layout layout) {
    memset(x, 0, sizeof *x);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof x->h_idx, &x->idx), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof x->h_ptr, &x->ptr), KVT_OK);
    cr_assert_eq(kvt_buffer_alloc(ctx, sizeof x->h_last, &x->last), KVT_OK);
    x->e = (kvt_emit){
        .struct_size = sizeof(kvt_emit), .layout = layout, .indices = kvt_buffer_ptr(x->idx)};
    if (layout == KVT_EMIT_TOKENS) { /* [NQ][CAP / NQ], lengths in ptr */
        x->e.capacity = CAP / NQ;
        x->e.lengths = kvt_buffer_ptr(x->ptr);
    } else {
        x->e.capacity = CAP;
        x->e.indptr = kvt_buffer_ptr(x->ptr);
        if (layout == KVT_EMIT_PAGED)
            x->e.last_page_len = kvt_buffer_ptr(x->last);
    }
}

static void em_read(em *x) {
    cr_assert_eq(kvt_buffer_read(x->idx, 0, x->h_idx, sizeof x->h_idx), KVT_OK);
    cr_assert_eq(kvt_buffer_read(x->ptr, 0, x->h_ptr, sizeof x->h_ptr), KVT_OK);
    cr_assert_eq(kvt_buffer_read(x->last, 0, x->h_last, sizeof x->h_last), KVT_OK);
}

static void em_close(em *x) {
    kvt_buffer_free(x->idx);
    kvt_buffer_free(x->ptr);
    kvt_buffer_free(x->last);
}

/* Reserve n[i] tokens per request, write the salience rows (a function of position), plan. */
static void step_begin(kvt_batch *b, kvt_seq **seq, const uint32_t *n, uint64_t *pos) {
    cr_assert_eq(kvt_batch_reserve(b, seq, n, NQ), KVT_OK, "%s", kvt_last_error());
    uint8_t mla[1152];
    for (uint32_t i = 0; i < NQ; i++)
        for (uint32_t r = 0; r < n[i]; r++, pos[i]++) {
            tu_row_bytes(mla, sizeof mla, 0, 0, pos[i], 5 + i);
            cr_assert_eq(kvt_seq_write(seq[i], TU_L_SAL, 0, r, 1, mla, sizeof mla), KVT_OK);
        }
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
}

/* Request i's paged list on `layer` (read back in x) against its block table after the commit
 * (pages and rows; sliding: the window's first row floored to a page): the page ids, their
 * count and the last page's rows. Returns the list's page count. */
static uint32_t check_against_table(const em *x, kvt_seq *seq, uint32_t i, uint32_t layer) {
    int32_t pages[256];
    uint32_t n_pages = 0;
    uint64_t n_rows = 0, first_row = 0;
    cr_assert_eq(kvt_seq_block_table(seq, layer, pages, 256, &n_pages, &n_rows), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(kvt_seq_first_row(seq, layer, &first_row), KVT_OK);
    uint64_t lo = 0;
    if (layer == TU_L_SLIDE && n_rows > W)
        lo = (n_rows - W) / P * P; /* FlashInfer masks [lo, n_rows - W) with window_left */
    const uint64_t want = n_rows ? (n_rows + P - 1) / P - lo / P : 0;
    const int32_t got = x->h_ptr[i + 1] - x->h_ptr[i];
    cr_assert_eq((uint64_t)got, want, "request %u layer %u: %d pages, want %llu (rows %llu)", i,
                 layer, got, (unsigned long long)want, (unsigned long long)n_rows);
    for (uint64_t j = 0; j < want; j++)
        cr_assert_eq(x->h_idx[x->h_ptr[i] + j], pages[lo / P + j - first_row / P],
                     "request %u layer %u page %llu", i, layer, (unsigned long long)j);
    const int32_t last = n_rows ? (int32_t)(n_rows - (n_rows - 1) / P * P) : 0;
    cr_assert_eq(x->h_last[i], last, "request %u layer %u: last_page_len %d, want %d", i, layer,
                 x->h_last[i], last);
    return (uint32_t)want;
}

/* The paged list of request i expanded into slots (every row of each page but the last, the
 * last's first last_page_len rows), less the rows before the window on the sliding layer,
 * equals its TOKENS row t. */
static void same_as_tokens(const em *pg, const em *tk, uint32_t i, uint32_t layer) {
    static int32_t slots[CAP];
    uint32_t n = 0;
    for (int32_t j = pg->h_ptr[i]; j < pg->h_ptr[i + 1]; j++) {
        const int32_t rows = j + 1 == pg->h_ptr[i + 1] ? pg->h_last[i] : P;
        for (int32_t r = 0; r < rows; r++)
            slots[n++] = pg->h_idx[j] * P + r;
    }
    const uint32_t len = (uint32_t)tk->h_ptr[i];
    cr_assert_geq(n, len);
    cr_assert(layer == TU_L_SLIDE || n == len, "request %u layer %u: %u rows paged, %u listed", i,
              layer, n, len);
    cr_assert_lt(n - len, P, "the window's first page holds its masked rows only");
    cr_assert_eq(
        memcmp(slots + (n - len), tk->h_idx + (size_t)i * (CAP / NQ), sizeof(int32_t) * len), 0,
        "request %u layer %u: pages expanded are not the TOKENS slots", i, layer);
}

/* Whole pages on every layer: requests under the salience budget (no close before 64 rows),
 * random eviction before and after its rounds (at K + r + c = 48 rows), the sliding window.
 * Each step: PAGED, then TOKENS from a second run of the layer (it only emits). */
Test(paged, whole_pages_match_the_block_table_and_tokens) {
    kvt_model *m = tu_mixed_model();
    char why[256] = "";
    kvt_ctx *ctx = open_ctx(m, KVT_BACKEND_CPU, 8, 4, why, sizeof why);
    cr_assert(ctx, "%s", why);
    kvt_seq *seq[NQ];
    for (uint32_t i = 0; i < NQ; i++)
        cr_assert_eq(tu_seq_create(ctx, 20 + i, &seq[i]), KVT_OK);
    kvt_batch *b;
    cr_assert_eq(kvt_batch_create(ctx, NQ, &b), KVT_OK);
    static em pg[TU_N_LAYERS], tk;
    for (uint32_t l = 0; l < TU_N_LAYERS; l++)
        em_open(ctx, &pg[l], KVT_EMIT_PAGED);
    em_open(ctx, &tk, KVT_EMIT_TOKENS);
    const uint32_t prompt[NQ] = {40, 17, 5};
    uint64_t pos[NQ] = {0};
    for (uint32_t step = 0; step < 23; step++) { /* request 0 ends at 62 rows: no close */
        uint32_t n[NQ];
        for (uint32_t i = 0; i < NQ; i++)
            n[i] = step == 0 ? prompt[i] : 1;
        step_begin(b, seq, n, pos);
        for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
            bool fits = false;
            cr_assert_eq(kvt_batch_emit_fits(b, l, KVT_EMIT_PAGED, &fits), KVT_OK);
            cr_assert(fits, "step %u layer %u", step, l);
            cr_assert_eq(kvt_batch_run(b, l, NULL, NULL, &pg[l].e), KVT_OK, "step %u layer %u: %s",
                         step, l, kvt_last_error());
            cr_assert_eq(kvt_batch_run(b, l, NULL, NULL, &tk.e), KVT_OK, "%s", kvt_last_error());
            em_read(&pg[l]);
            em_read(&tk);
            cr_assert_eq(pg[l].h_ptr[0], 0);
            for (uint32_t i = 0; i < NQ; i++)
                same_as_tokens(&pg[l], &tk, i, l);
        }
        cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
        for (uint32_t l = 0; l < TU_N_LAYERS; l++)
            for (uint32_t i = 0; i < NQ; i++)
                check_against_table(&pg[l], seq[i], i, l);
        if (step == 0) { /* by hand: 40, 17 and 5 rows in pages of 16, a window of 40 */
            const int32_t ptr[NQ + 1] = {0, 3, 5, 6}, last[NQ] = {8, 1, 5};
            for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
                cr_assert_eq(memcmp(pg[l].h_ptr, ptr, sizeof ptr), 0, "layer %u", l);
                cr_assert_eq(memcmp(pg[l].h_last, last, sizeof last), 0, "layer %u", l);
            }
        }
        if (step == 20) { /* request 0 at 60 rows: window [20, 60) from page 1; evicted to 48 */
            cr_assert_eq(pg[TU_L_SLIDE].h_ptr[1], 3); /* pages 1, 2, 3 */
            cr_assert_eq(pg[TU_L_SLIDE].h_last[0], 12);
            cr_assert_eq(pg[TU_L_SAL].h_ptr[1], 4); /* rows [0, 60): 4 pages */
        }
    }
    for (uint32_t l = 0; l < TU_N_LAYERS; l++)
        em_close(&pg[l]);
    em_close(&tk);
    kvt_batch_destroy(b);
    for (uint32_t i = 0; i < NQ; i++)
        kvt_seq_destroy(seq[i]);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
}

/* Run n steps of one token (after a prompt step of `prompt` rows) for request 0 alone of a
 * one-request batch; returns it planned and open for the next step (rows then prompt + n + 1). */
static void grow(kvt_batch *b, kvt_seq *s, uint32_t prompt, uint32_t steps, em *tk) {
    uint64_t pos = 0;
    for (uint32_t k = 0; k <= steps; k++) {
        uint32_t n = k == 0 ? prompt : 1;
        cr_assert_eq(kvt_batch_reserve(b, &s, &n, 1), KVT_OK, "%s", kvt_last_error());
        uint8_t mla[1152];
        for (uint32_t r = 0; r < n; r++, pos++) {
            tu_row_bytes(mla, sizeof mla, 0, 0, pos, 9);
            cr_assert_eq(kvt_seq_write(s, TU_L_SAL, 0, r, 1, mla, sizeof mla), KVT_OK);
        }
        cr_assert_eq(kvt_batch_plan(b), KVT_OK);
        if (k == steps)
            return;
        for (uint32_t l = 0; l < TU_N_LAYERS; l++)
            cr_assert_eq(kvt_batch_run(b, l, NULL, NULL, &tk->e), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    }
}

/* One request in a batch of one on ctx (of model m; both closed with it), with a PAGED and a
 * TOKENS emission; sp NULL: default parameters, request id 1. */
typedef struct solo {
    kvt_model *m;
    kvt_ctx *ctx;
    kvt_seq *s;
    kvt_batch *b;
    em pg, tk;
} solo;

static void solo_open(solo *o, kvt_model *m, kvt_ctx *ctx, const kvt_seq_params *sp) {
    cr_assert(ctx);
    o->m = m;
    o->ctx = ctx;
    cr_assert_eq(sp ? kvt_seq_create(ctx, sp, &o->s) : tu_seq_create(ctx, 1, &o->s), KVT_OK, "%s",
                 kvt_last_error());
    cr_assert_eq(kvt_batch_create(ctx, 1, &o->b), KVT_OK);
    em_open(ctx, &o->pg, KVT_EMIT_PAGED);
    em_open(ctx, &o->tk, KVT_EMIT_TOKENS);
}

static void solo_close(solo *o) {
    em_close(&o->pg);
    em_close(&o->tk);
    kvt_batch_destroy(o->b);
    kvt_seq_destroy(o->s);
    kvt_ctx_destroy(o->ctx);
    kvt_model_destroy(o->m);
}

/* After a close (ratio 8: 8 kept rows of 64, single rows) the salience set is not whole pages:
 * emit_fits says so, the run refuses it after its work (nothing emitted) and a TOKENS run of
 * the same step emits; the other layers still fit. */
Test(paged, kept_single_rows_are_refused) {
    static solo o;
    kvt_model *m = tu_mixed_model();
    solo_open(&o, m, open_ctx(m, KVT_BACKEND_CPU, 8, 4, NULL, 0), NULL);
    kvt_batch *b = o.b;
    em *pg = &o.pg, *tk = &o.tk;
    bool fits = true;
    cr_assert_eq(kvt_batch_emit_fits(b, 0, KVT_EMIT_PAGED, &fits), KVT_ERR_BAD_STATE);
    grow(b, o.s, 60, 4, tk); /* the step of row 64 is due to close: planned, not run */
    cr_assert_eq(kvt_batch_emit_fits(b, TU_L_SAL, KVT_EMIT_PAGED, &fits), KVT_OK);
    cr_assert_not(fits, "a close is due: its set is known only after it");
    cr_assert_eq(kvt_batch_emit_fits(b, TU_L_SAL, KVT_EMIT_TOKENS, &fits), KVT_OK);
    cr_assert(fits);
    cr_assert_eq(kvt_batch_emit_fits(b, TU_N_LAYERS, KVT_EMIT_PAGED, &fits), KVT_ERR_OUT_OF_RANGE);
    cr_assert_eq(kvt_batch_emit_fits(b, 0, (kvt_emit_layout)9, &fits), KVT_ERR_INVALID_ARGUMENT);
    pg->h_ptr[1] = -7;
    cr_assert_eq(kvt_buffer_write(pg->ptr, 0, pg->h_ptr, sizeof pg->h_ptr), KVT_OK);
    cr_assert_eq(kvt_batch_run(b, TU_L_SAL, NULL, NULL, &pg->e), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "not whole pages") != NULL, "%s", kvt_last_error());
    em_read(pg);
    cr_assert_eq(pg->h_ptr[1], -7, "nothing emitted");
    cr_assert_eq(kvt_batch_emit_fits(b, TU_L_SAL, KVT_EMIT_PAGED, &fits), KVT_OK);
    cr_assert_not(fits, "after the close: kept single rows");
    cr_assert_eq(kvt_batch_run(b, TU_L_SAL, NULL, NULL, &tk->e), KVT_OK, "%s", kvt_last_error());
    em_read(tk);
    cr_assert_eq(tk->h_ptr[0], 4 + 8, "sinks and 8 kept rows (the tail empty at 64 rows)");
    for (uint32_t l = TU_L_EV1; l < TU_N_LAYERS; l++) {
        cr_assert_eq(kvt_batch_emit_fits(b, l, KVT_EMIT_PAGED, &fits), KVT_OK);
        cr_assert(fits, "layer %u", l);
        cr_assert_eq(kvt_batch_run(b, l, NULL, NULL, &pg->e), KVT_OK, "%s", kvt_last_error());
    }
    /* wrong emissions: before any work */
    kvt_emit e = pg->e;
    e.struct_size = offsetof(kvt_emit, last_page_len); /* an older struct: no last_page_len */
    cr_assert_eq(kvt_batch_run(b, TU_L_EV1, NULL, NULL, &e), KVT_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(kvt_last_error(), "last_page_len") != NULL, "%s", kvt_last_error());
    e = pg->e;
    e.last_page_len = NULL;
    cr_assert_eq(kvt_batch_run(b, TU_L_EV1, NULL, NULL, &e), KVT_ERR_INVALID_ARGUMENT);
    e = pg->e;
    e.flags = KVT_EMIT_LENGTHS_PER_SEQ;
    cr_assert_eq(kvt_batch_run(b, TU_L_EV1, NULL, NULL, &e), KVT_ERR_INVALID_ARGUMENT);
    e = pg->e;
    e.capacity = 2; /* 40 to 48 rows held: 3 pages */
    cr_assert_eq(kvt_batch_run(b, TU_L_EV1, NULL, NULL, &e), KVT_ERR_CAPACITY);
    cr_assert(strstr(kvt_last_error(), "3 pages on layer") != NULL, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    solo_close(&o);
}

/* A salience set that stays whole pages across a close: with ratio 1 the close at 64 rows
 * keeps every row (the list fills the gap between sinks and tail: one range), at 70 rows 5
 * pages, 6 rows in the last, equal to its TOKENS row and the block table's pages. (A close
 * keeps at least one row, so the two-range form, sinks and tail with no kept row between, is
 * the pack's case in test_cuda.) */
Test(paged, a_close_that_kept_every_row_is_one_range) {
    static solo o;
    kvt_model *m = tu_mixed_model();
    solo_open(&o, m, open_ctx(m, KVT_BACKEND_CPU, 1, 4, NULL, 0), NULL);
    kvt_batch *b = o.b;
    kvt_seq *s = o.s;
    em *pg = &o.pg, *tk = &o.tk;
    grow(b, s, 60, 10, tk); /* closed at 64, now 70 rows */
    bool fits = false;
    cr_assert_eq(kvt_batch_emit_fits(b, TU_L_SAL, KVT_EMIT_PAGED, &fits), KVT_OK);
    cr_assert(fits);
    cr_assert_eq(kvt_batch_run(b, TU_L_SAL, NULL, NULL, &pg->e), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_run(b, TU_L_SAL, NULL, NULL, &tk->e), KVT_OK, "%s", kvt_last_error());
    em_read(pg);
    em_read(tk);
    cr_assert_eq(pg->h_ptr[1], 5);
    cr_assert_eq(pg->h_last[0], 70 - 64);
    same_as_tokens(pg, tk, 0, TU_L_SAL);
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    int32_t pages[16];
    uint32_t n_pages = 0;
    uint64_t n_rows = 0;
    cr_assert_eq(kvt_seq_block_table(s, TU_L_SAL, pages, 16, &n_pages, &n_rows), KVT_OK);
    cr_assert_eq(n_rows, 70);
    cr_assert_eq(memcmp(pg->h_idx, pages, sizeof(int32_t) * 5), 0);
    solo_close(&o);
}

/* A request that recalls on the salience layer (its fetched rows are single rows): PAGED is
 * refused before the layer's work, emit_fits said so; the other layers fit; TOKENS runs. */
Test(paged, a_recalling_request_is_refused_before_the_work) {
    kvt_layer_spec sp4[TU_N_LAYERS]; /* the mixed model, its salience layer with 4 query heads */
    cr_assert_eq(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &sp4[0]), KVT_OK);
    sp4[0].n_q_heads = 4;
    for (uint32_t l = 1; l < 3; l++)
        cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 16, &sp4[l]),
                     KVT_OK);
    cr_assert_eq(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 2, 8, &sp4[3]), KVT_OK);
    sp4[3].sliding_window = W;
    kvt_model *m;
    cr_assert_eq(kvt_model_create(sp4, TU_N_LAYERS, "recall", &m, NULL, 0), KVT_OK);
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 3;
    sp.recall = KVT_RECALL_CONFORMAL;
    static solo o;
    solo_open(&o, m, tu_mixed_ctx_sketch(m, false, 256, TU_K, 16), &sp);
    kvt_seq *s = o.s;
    kvt_batch *b = o.b;
    em *pg = &o.pg, *tk = &o.tk;
    static float query[4096];
    uint32_t n = 70;
    cr_assert_eq(kvt_batch_reserve(b, &s, &n, 1), KVT_OK);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) /* a prefill step: every row, no fetch */
        cr_assert_eq(kvt_batch_run(b, l, query, NULL, &tk->e), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    n = 1;
    cr_assert_eq(kvt_batch_reserve(b, &s, &n, 1), KVT_OK);
    cr_assert_eq(kvt_batch_plan(b), KVT_OK);
    bool fits = true;
    cr_assert_eq(kvt_batch_emit_fits(b, TU_L_SAL, KVT_EMIT_PAGED, &fits), KVT_OK);
    cr_assert_not(fits);
    cr_assert_eq(kvt_batch_run(b, TU_L_SAL, query, NULL, &pg->e), KVT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvt_last_error(), "recalls") && strstr(kvt_last_error(), "nothing done"), "%s",
              kvt_last_error());
    cr_assert_eq(kvt_batch_run(b, TU_L_SAL, query, NULL, &tk->e), KVT_OK, "%s", kvt_last_error());
    for (uint32_t l = TU_L_EV1; l < TU_N_LAYERS; l++) {
        cr_assert_eq(kvt_batch_emit_fits(b, l, KVT_EMIT_PAGED, &fits), KVT_OK);
        cr_assert(fits, "layer %u", l);
        cr_assert_eq(kvt_batch_run(b, l, query, NULL, &pg->e), KVT_OK, "%s", kvt_last_error());
    }
    cr_assert_eq(kvt_batch_commit(b, NULL), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_seq_check(s), KVT_OK, "%s", kvt_last_error());
    solo_close(&o);
}

/* ------------------------------------------------------------------------------------------
 * The planned path equals the eager one: twins of the same requests and rows; a's runs eager,
 * g's planned (plan_device, a captured run replayed) where the step is plannable. The salience
 * layer emits TOKENS (its kept rows are single rows), the others PAGED; then an older caller's
 * emission array (struct_size KVT_EMIT_SIZE_MIN, the array at that stride).
 * ---------------------------------------------------------------------------------------- */

/* kvt_emit as a caller built before queries_per_seq, flags and last_page_len had it. */
typedef struct old_emit {
    size_t struct_size;
    kvt_emit_layout layout;
    int32_t *indices;
    uint32_t capacity;
    int32_t *lengths;
    int32_t *indptr;
    uint8_t *dense;
} old_emit;

typedef struct twin {
    kvt_ctx *ctx;
    kvt_seq *seq[NQ];
    kvt_batch *b;
    em x[TU_N_LAYERS];
    kvt_emit e[TU_N_LAYERS];
    old_emit old[TU_N_LAYERS];
    uint64_t pos[NQ];
} twin;

static bool twin_open(twin *t, kvt_model *m, kvt_backend_kind k, bool old, char *why,
                      size_t why_len) {
    memset(t, 0, sizeof *t);
    if (!(t->ctx = open_ctx(m, k, 8, 4, why, why_len)))
        return false;
    for (uint32_t i = 0; i < NQ; i++)
        cr_assert_eq(tu_seq_create(t->ctx, 30 + i, &t->seq[i]), KVT_OK);
    cr_assert_eq(kvt_batch_create(t->ctx, NQ, &t->b), KVT_OK);
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        /* an older struct knows no PAGED: CSR there */
        const kvt_emit_layout lay = l == TU_L_SAL ? KVT_EMIT_TOKENS
                                    : old         ? KVT_EMIT_CSR
                                                  : KVT_EMIT_PAGED;
        em_open(t->ctx, &t->x[l], lay);
        t->e[l] = t->x[l].e;
        t->old[l] = (old_emit){.struct_size = sizeof(old_emit),
                               .layout = lay,
                               .indices = t->e[l].indices,
                               .capacity = t->e[l].capacity,
                               .lengths = t->e[l].lengths,
                               .indptr = t->e[l].indptr};
    }
    return true;
}

static void twin_close(twin *t) {
    for (uint32_t l = 0; l < TU_N_LAYERS; l++)
        em_close(&t->x[l]);
    kvt_batch_destroy(t->b);
    for (uint32_t i = 0; i < NQ; i++)
        kvt_seq_destroy(t->seq[i]);
    kvt_ctx_destroy(t->ctx);
}

static void twin_run(twin *t, bool old, void *stream) {
    for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
        const kvt_emit *e = old ? (const kvt_emit *)&t->old[l] : &t->e[l];
        cr_assert_eq(kvt_batch_run(t->b, l, NULL, stream, e), KVT_OK, "layer %u: %s", l,
                     kvt_last_error());
    }
}

static void planned_equals_eager(kvt_backend_kind k, void *stream, bool old) {
    cr_assert_eq(sizeof(old_emit), KVT_EMIT_SIZE_MIN, "the older struct is the oldest layout");
    kvt_model *m = tu_mixed_model();
    twin a, g;
    char why[256] = "";
    if (!twin_open(&a, m, k, old, why, sizeof why)) {
        kvt_model_destroy(m);
        if (getenv("KVT_REQUIRE_GPU"))
            cr_assert_fail("KVT_REQUIRE_GPU set but the context did not open: %s", why);
        cr_skip_test("backend unavailable: %s", why);
    }
    cr_assert(twin_open(&g, m, k, old, why, sizeof why), "%s", why);
    kvt__backend *be = kvt__batch_backend(g.b);
    void *graph = NULL;
    uint32_t replays = 0, eager = 0;
    const uint32_t prompt[NQ] = {40, 70, 9};
    const kvt_emit *emits = old ? (const kvt_emit *)g.old : g.e;
    for (uint32_t step = 0; step < 90; step++) {
        uint32_t n[NQ];
        for (uint32_t i = 0; i < NQ; i++)
            n[i] = step == 0 ? prompt[i] : 1;
        step_begin(a.b, a.seq, n, a.pos);
        step_begin(g.b, g.seq, n, g.pos);
        twin_run(&a, old, stream);
        bool planned = false;
        cr_assert_eq(kvt_batch_plan_device(g.b, emits, TU_N_LAYERS, stream, &planned), KVT_OK,
                     "step %u: %s", step, kvt_last_error());
        if (planned && !graph) {
            cr_assert_eq(be->ops->capture_begin(be, stream), KVT_OK);
            twin_run(&g, old, stream);
            cr_assert_eq(be->ops->capture_end(be, stream, &graph), KVT_OK);
        }
        if (planned) {
            cr_assert_eq(be->ops->graph_launch(be, graph, stream), KVT_OK);
            replays++;
        } else {
            twin_run(&g, old, stream);
            eager++;
        }
#if KVT_HAVE_CUDA
        if (stream)
            cr_assert_eq(cudaStreamSynchronize((cudaStream_t)stream), cudaSuccess);
#endif
        for (uint32_t l = 0; l < TU_N_LAYERS; l++) {
            em_read(&a.x[l]);
            em_read(&g.x[l]);
            const bool tokens = a.e[l].layout == KVT_EMIT_TOKENS;
            const size_t n_ptr = tokens ? NQ : NQ + 1;
            cr_assert_eq(memcmp(a.x[l].h_ptr, g.x[l].h_ptr, sizeof(int32_t) * n_ptr), 0,
                         "step %u layer %u: lengths / indptr", step, l);
            const size_t n_idx = tokens ? CAP : (size_t)a.x[l].h_ptr[NQ];
            cr_assert_eq(memcmp(a.x[l].h_idx, g.x[l].h_idx, sizeof(int32_t) * n_idx), 0,
                         "step %u layer %u: indices", step, l);
            if (a.e[l].layout == KVT_EMIT_PAGED)
                cr_assert_eq(memcmp(a.x[l].h_last, g.x[l].h_last, sizeof a.x[l].h_last), 0,
                             "step %u layer %u: last_page_len", step, l);
        }
        cr_assert_eq(kvt_batch_commit(a.b, NULL), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(kvt_batch_commit(g.b, NULL), KVT_OK, "%s", kvt_last_error());
        for (uint32_t l = TU_L_EV1; !old && l < TU_N_LAYERS; l++)
            for (uint32_t i = 0; i < NQ; i++)
                check_against_table(&g.x[l], g.seq[i], i, l);
    }
    cr_log_info("%s%s: %u replays, %u eager steps", kvt_ctx_backend_name(g.ctx),
                old ? " (older kvt_emit)" : "", replays, eager);
    cr_assert_geq(replays, 60, "%u replays, %u eager", replays, eager);
    cr_assert_geq(eager, 3, "closes and rounds ran eagerly: %u", eager);
    be->ops->graph_free(be, graph);
    twin_close(&a);
    twin_close(&g);
    kvt_model_destroy(m);
}

Test(paged, planned_equals_eager) {
    planned_equals_eager(KVT_BACKEND_CPU, NULL, false);
}

Test(paged, planned_equals_eager_guarded) {
    planned_equals_eager(KVT_BACKEND_GUARDED, NULL, false);
}

Test(paged, older_emit_array_at_its_stride) {
    planned_equals_eager(KVT_BACKEND_GUARDED, NULL, true);
    planned_equals_eager(KVT_BACKEND_CPU, NULL, true);
}

#if KVT_HAVE_CUDA
Test(paged, planned_equals_eager_cuda, .timeout = 240) {
    cudaStream_t s = tu_cuda_stream();
    planned_equals_eager(KVT_BACKEND_CUDA, s, false);
    planned_equals_eager(KVT_BACKEND_CUDA, s, true);
    cudaStreamDestroy(s);
}
#endif

/* An array whose elements state different sizes has no stride: refused, nothing planned. */
Test(paged, emit_array_of_mixed_sizes_is_refused) {
    kvt_model *m = tu_mixed_model();
    twin g;
    char why[256] = "";
    cr_assert(twin_open(&g, m, KVT_BACKEND_CPU, true, why, sizeof why), "%s", why);
    uint32_t n[NQ] = {5, 5, 5};
    step_begin(g.b, g.seq, n, g.pos);
    g.old[2].struct_size = sizeof(kvt_emit);
    bool planned = true;
    cr_assert_eq(kvt_batch_plan_device(g.b, (const kvt_emit *)g.old, TU_N_LAYERS, NULL, &planned),
                 KVT_ERR_INVALID_ARGUMENT);
    cr_assert_not(planned);
    cr_assert(strstr(kvt_last_error(), "emits[2].struct_size") != NULL, "%s", kvt_last_error());
    g.old[2].struct_size = sizeof(old_emit);
    cr_assert_eq(kvt_batch_plan_device(g.b, (const kvt_emit *)g.old, TU_N_LAYERS, NULL, &planned),
                 KVT_OK, "%s", kvt_last_error());
    cr_assert(planned);
    twin_run(&g, true, NULL);
    cr_assert_eq(kvt_batch_commit(g.b, NULL), KVT_OK, "%s", kvt_last_error());
    twin_close(&g);
    kvt_model_destroy(m);
}
