/* fuzz_api.c — the batch API driven by the input: a small model of every policy (salience on an
 * MLA-NoPE layer, random eviction on an MLA-RoPE and a GQA layer, a sliding-window layer, a
 * no-KV layer), tiny pages and pools so that exhaustion happens, and a program of calls read
 * from the input bytes: requests created and destroyed (also mid-step), reserve and
 * kvt_batch_reserve_drafts, row writes, plan, run in the emission layouts (TOKENS, CSR, PAGED
 * where kvt_batch_emit_fits answers first: refused only where it said no) with one or several
 * queries per request and capacities that sometimes fall short, commit with partial acceptance
 * (and acceptances the contract refuses), prompt changes, batches destroyed before their run,
 * the inspection calls, and snapshots: taken (refused inside a step), restored into a free
 * request slot (as they are, with a byte flipped, or cut short), replacing the original; steps
 * planned on the device (kvt_batch_plan_device, one fixed emission per batch: TOKENS, CSR,
 * CSR_KV_HEADS or PAGED) whose runs pass that emission or another one (refused); prefix
 * sharing: forks and attaches (at any prefix length, also past rounds and closes, also of a request inside a
 * step), with the context's max_seqs request slots stated or not.
 *
 * After every call: its status is in the set kvtier.h documents for it (KVT_ERR_INVARIANT never
 * is), and kvt_seq_check of every live request is KVT_OK (KVT_ERR_BAD_STATE allowed only for a
 * request inside a step). A failed reserve leaves every pool's free pages as they were; a
 * successful one gives each token a distinct slot inside the pool; an emission holds only
 * slots inside the pool; with every request destroyed, every page is free again. */
#include "fuzz.h"

#include <stdbool.h>
#include <string.h>

enum { L_SAL, L_MLAR, L_GQA, L_SLIDE, L_NOKV, N_LAYERS };
enum { MAX_SEQS = 4, MAX_BATCHES = 2, MAX_OPS = 256, PLAN_TOPK = 512 };

typedef struct fseq {
    kvt_seq *h;  /* NULL: slot free */
    int batch;   /* batch whose step holds it, or -1 */
} fseq;

typedef struct fbatch {
    kvt_batch *h;
    int phase; /* 0 idle, 1 reserved, 2 planned, 3 ran */
    uint32_t n;
    int idx[MAX_SEQS]; /* fseq index per entry; -1 once destroyed mid-step */
    uint32_t tok[MAX_SEQS], drafts[MAX_SEQS];
    bool ran[N_LAYERS];
    bool planned; /* the step was planned on the device, for pe */
    bool pe_set;  /* pe chosen (at the batch's first plan on the device: fixed for its life) */
    kvt_emit pe;  /* the batch's planned emission (TOKENS: PLAN_TOPK a request; CSR and
                   * CSR_KV_HEADS: PLAN_TOPK a request and KV head, at most 2 heads) */
    int32_t pidx[MAX_SEQS * PLAN_TOPK * 2], plen[MAX_SEQS], pptr[MAX_SEQS * 2 + 1];
    int32_t plast[MAX_SEQS];
    uint8_t pdense[MAX_SEQS];
} fbatch;

typedef struct fuzz_state {
    fuzz_in in;
    kvt_model *model;
    kvt_ctx *ctx;
    uint32_t page_rows, n_pages;
    fseq seq[MAX_SEQS];
    fbatch b[MAX_BATCHES];
    uint64_t rng;
    bool verbose; /* FUZZ_VERBOSE=1 in the environment: each call on stderr (replaying a crash) */
} fuzz_state;

static uint64_t next_rand(fuzz_state *f) {
    uint64_t z = (f->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static bool has_kv(uint32_t l) {
    return l != L_NOKV;
}

static uint64_t pool_slots(const fuzz_state *f) {
    return (uint64_t)f->page_rows * f->n_pages;
}

static void free_pages(fuzz_state *f, uint32_t *out) {
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        out[l] = 0;
        if (!has_kv(l))
            continue;
        kvt_status s = kvt_ctx_free_pages(f->ctx, l, &out[l]);
        FUZZ_REQUIRE(s == KVT_OK && out[l] <= f->n_pages, "free pages of layer %u: %s, %u of %u",
                     l, kvt_status_name(s), out[l], f->n_pages);
    }
}

static void check_all(fuzz_state *f, const char *after) {
    for (int i = 0; i < MAX_SEQS; i++) {
        if (!f->seq[i].h)
            continue;
        kvt_status s = kvt_seq_check(f->seq[i].h);
        if (s == KVT_ERR_BAD_STATE && f->seq[i].batch >= 0 && f->b[f->seq[i].batch].phase >= 2)
            continue;
        FUZZ_REQUIRE(s == KVT_OK, "kvt_seq_check of request %d after %s: %s", i, after,
                     kvt_status_name(s));
    }
}

static kvt_model *make_model(fuzz_state *f) {
    kvt_layer_spec s[N_LAYERS];
    FUZZ_REQUIRE(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 16, 64, &s[L_SAL]) ==
                     KVT_OK, "mla spec");
    FUZZ_REQUIRE(kvt_layer_spec_mla(KVT_LAYER_MLA_ROPE, KVT_DTYPE_BF16, 16, 16, &s[L_MLAR]) ==
                     KVT_OK, "mla rope spec");
    FUZZ_REQUIRE(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 4, &s[L_GQA]) == KVT_OK,
                 "gqa spec");
    FUZZ_REQUIRE(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 2, 4, &s[L_SLIDE]) ==
                     KVT_OK, "sliding spec");
    s[L_SLIDE].sliding_window = fuzz_range(&f->in, 1, 48);
    s[L_NOKV] = (kvt_layer_spec){.kind = KVT_LAYER_NO_KV};
    kvt_model *m = NULL;
    char err[256];
    FUZZ_REQUIRE(kvt_model_create(s, N_LAYERS, "fuzz", &m, err, sizeof err) == KVT_OK, "%s", err);
    return m;
}

static bool make_ctx(fuzz_state *f) {
    kvt_config c = kvt_config_default();
    c.block_rows = (fuzz_u8(&f->in) & 1) ? 128 : 64;
    c.kappa = fuzz_range(&f->in, 1, 33); /* 33 > 64/2 is refused: INVALID_ARGUMENT */
    c.ratio = fuzz_range(&f->in, 1, 16);
    c.sink_rows = fuzz_range(&f->in, 0, 8);
    c.evict_budget_rows = fuzz_range(&f->in, 1, 48);
    /* r <= K (kvt_config_check) */
    c.recent_rows = fuzz_range(&f->in, 0, c.evict_budget_rows < 16 ? c.evict_budget_rows : 16);
    c.cadence_rows = fuzz_range(&f->in, 0, 16);
    uint8_t flags = fuzz_u8(&f->in);
    c.protect_prompt = !(flags & 1);
    c.evict_archive = flags & 2;
    c.evict_shared_draw = flags & 4;
    c.evict_vase = flags & 8;
    c.selector = (kvt_selector)((flags >> 4) & 3);
    c.seed = fuzz_u8(&f->in);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = f->model;
    p.config = &c;
    p.page_rows = f->page_rows = fuzz_range(&f->in, 1, 16);
    p.n_pages = f->n_pages = fuzz_range(&f->in, 1, 48);
    p.allocator = KVT_ALLOC_LIBC;
    uint8_t more = fuzz_u8(&f->in);
    if (more & 1)
        p.max_rows_per_seq = fuzz_range(&f->in, 1, 600);
    if (more & 2)
        p.archive_rows_per_seq = fuzz_range(&f->in, 1, 200);
    /* Full attention on the GQA layer (a none group of a non-sliding layer and the sliding one). */
    static const kvt_policy pol[N_LAYERS] = {KVT_POLICY_SALIENCE, KVT_POLICY_EVICT,
                                             KVT_POLICY_NONE, KVT_POLICY_NONE, KVT_POLICY_NONE};
    if (more & 4)
        p.layer_policies = pol;
    if (more & 8) /* request slots: built at creation with max_rows_per_seq, else a cap */
        p.max_seqs = fuzz_range(&f->in, 1, MAX_SEQS);
    char err[256];
    kvt_status s = kvt_ctx_create(&p, &f->ctx, err, sizeof err);
    if (f->verbose)
        fprintf(stderr, "ctx: %s %s\n", kvt_status_name(s), s ? err : "");
    FUZZ_STATUS("kvt_ctx_create", s, KVT_ERR_INVALID_ARGUMENT, KVT_ERR_UNSUPPORTED,
                KVT_ERR_OUT_OF_MEMORY);
    if (c.kappa <= c.block_rows / 2 && (c.recent_rows || c.cadence_rows))
        FUZZ_REQUIRE(s == KVT_OK, "a valid context refused: %s", err);
    return s == KVT_OK;
}

/* Leave the batch's step: its requests are free for another. */
static void step_done(fuzz_state *f, fbatch *b) {
    for (uint32_t k = 0; k < b->n; k++)
        if (b->idx[k] >= 0)
            f->seq[b->idx[k]].batch = -1;
    memset(b->ran, 0, sizeof b->ran);
    b->n = 0;
    b->phase = 0;
    b->planned = false;
}

/* Is a live request of the context of this id? (Ids are unique among live requests.) */
static bool id_live(const fuzz_state *f, uint64_t id) {
    for (int k = 0; k < MAX_SEQS; k++)
        if (f->seq[k].h && kvt_seq_request_id(f->seq[k].h) == id)
            return true;
    return false;
}

static void op_seq_create(fuzz_state *f) {
    int i = fuzz_range(&f->in, 0, MAX_SEQS - 1);
    if (f->seq[i].h)
        return;
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = fuzz_u8(&f->in);
    sp.prompt_rows = fuzz_range(&f->in, 0, 100);
    sp.ratio = fuzz_range(&f->in, 0, 8);
    const bool dup = id_live(f, sp.request_id);
    kvt_status s = kvt_seq_create(f->ctx, &sp, &f->seq[i].h);
    FUZZ_STATUS("kvt_seq_create", s, KVT_ERR_OUT_OF_MEMORY, KVT_ERR_CAPACITY,
                KVT_ERR_INVALID_ARGUMENT);
    FUZZ_REQUIRE((s == KVT_ERR_INVALID_ARGUMENT) == dup, "request id %llu %s live: %s",
                 (unsigned long long)sp.request_id, dup ? "already" : "not",
                 kvt_status_name(s));
    FUZZ_REQUIRE(s != KVT_OK || kvt_seq_request_id(f->seq[i].h) == sp.request_id,
                 "kvt_seq_request_id of a new request");
    if (s != KVT_OK)
        f->seq[i].h = NULL;
    f->seq[i].batch = -1;
}

static void op_seq_destroy(fuzz_state *f) {
    int i = fuzz_range(&f->in, 0, MAX_SEQS - 1);
    if (!f->seq[i].h)
        return;
    kvt_seq_destroy(f->seq[i].h); /* any time, also inside a step: the batch forgets it */
    f->seq[i].h = NULL;
    if (f->seq[i].batch >= 0) {
        fbatch *b = &f->b[f->seq[i].batch];
        for (uint32_t k = 0; k < b->n; k++)
            if (b->idx[k] == i)
                b->idx[k] = -1;
    }
    f->seq[i].batch = -1;
}

static void op_reserve(fuzz_state *f) {
    fbatch *b = &f->b[fuzz_u8(&f->in) % MAX_BATCHES];
    uint8_t mask = fuzz_u8(&f->in), mode = fuzz_u8(&f->in);
    bool drafts = mode & 1, big = (mode & 6) == 6;
    kvt_seq *seqs[MAX_SEQS];
    uint32_t tok[MAX_SEQS], dr[MAX_SEQS], n = 0;
    int idx[MAX_SEQS];
    bool valid = b->phase == 0;
    for (int i = 0; i < MAX_SEQS; i++) {
        if (!(mask >> i & 1) || !f->seq[i].h)
            continue;
        seqs[n] = f->seq[i].h;
        idx[n] = i;
        tok[n] = fuzz_range(&f->in, 0, big ? 160 : 24);
        dr[n] = drafts ? fuzz_range(&f->in, 0, tok[n]) : 0;
        valid = valid && f->seq[i].batch < 0;
        n++;
    }
    if ((mode & 0x18) == 0x18 && n > 0 && n < MAX_SEQS) { /* the same request twice */
        seqs[n] = seqs[0];
        idx[n] = idx[0];
        tok[n] = tok[0];
        dr[n] = dr[0];
        n++;
        valid = false;
    }
    uint32_t before[N_LAYERS], after[N_LAYERS];
    free_pages(f, before);
    kvt_status s = drafts ? kvt_batch_reserve_drafts(b->h, seqs, tok, dr, n)
                          : kvt_batch_reserve(b->h, seqs, tok, n);
    if (f->verbose)
        fprintf(stderr, "  reserve of %u requests: %s\n", n, kvt_status_name(s));
    FUZZ_STATUS(drafts ? "kvt_batch_reserve_drafts" : "kvt_batch_reserve", s,
                KVT_ERR_POOL_EXHAUSTED, KVT_ERR_BAD_STATE, KVT_ERR_CAPACITY,
                KVT_ERR_ARCHIVE_FULL, KVT_ERR_OUT_OF_MEMORY, KVT_ERR_INVALID_ARGUMENT);
    if (valid)
        FUZZ_REQUIRE(s != KVT_ERR_BAD_STATE && s != KVT_ERR_INVALID_ARGUMENT,
                     "a valid reserve of %u requests refused: %s", n, kvt_status_name(s));
    free_pages(f, after);
    if (s != KVT_OK) {
        for (uint32_t l = 0; l < N_LAYERS; l++)
            FUZZ_REQUIRE(before[l] == after[l], "failed reserve (%s) moved layer %u's pages %u -> %u",
                         kvt_status_name(s), l, before[l], after[l]);
        return;
    }
    FUZZ_REQUIRE(valid, "reserve accepted on a busy batch or request");
    b->phase = 1;
    b->n = n;
    uint32_t total = 0;
    for (uint32_t k = 0; k < n; k++) {
        b->idx[k] = idx[k];
        b->tok[k] = tok[k];
        b->drafts[k] = dr[k];
        f->seq[idx[k]].batch = (int)(b - f->b);
        total += tok[k];
    }
    /* slot_mapping: every token of the step a distinct slot inside the pool, per group. */
    int32_t *slots = malloc(sizeof(int32_t) * (total + 1));
    uint8_t *seen = calloc(pool_slots(f), 1);
    FUZZ_REQUIRE(slots && seen, "oom");
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        if (!has_kv(l))
            continue;
        uint32_t got = 0;
        s = kvt_batch_slot_mapping(b->h, l, slots, total + 1, &got);
        FUZZ_REQUIRE(s == KVT_OK && got == total, "slot_mapping layer %u: %s, %u of %u", l,
                     kvt_status_name(s), got, total);
        memset(seen, 0, pool_slots(f));
        for (uint32_t t = 0; t < got; t++) {
            FUZZ_REQUIRE(slots[t] >= 0 && (uint64_t)slots[t] < pool_slots(f),
                         "layer %u token %u: slot %d outside the pool", l, t, slots[t]);
            FUZZ_REQUIRE(!seen[slots[t]], "layer %u: slot %d given twice", l, slots[t]);
            seen[slots[t]] = 1;
        }
        if (total > 0) {
            s = kvt_batch_slot_mapping(b->h, l, slots, total - 1, &got);
            FUZZ_REQUIRE(s == KVT_ERR_CAPACITY, "short slot_mapping: %s", kvt_status_name(s));
        }
    }
    free(seen);
    free(slots);
}

static void op_write(fuzz_state *f) {
    fbatch *b = &f->b[fuzz_u8(&f->in) % MAX_BATCHES];
    uint8_t mode = fuzz_u8(&f->in);
    if (b->phase == 0)
        return;
    uint8_t buf[2 * 128 * 2];
    for (uint32_t k = 0; k < b->n; k++) {
        if (b->idx[k] < 0)
            continue;
        kvt_seq *sq = f->seq[b->idx[k]].h;
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            if (!has_kv(l))
                continue;
            const kvt_layer_spec *sp = kvt_model_layer(f->model, l);
            size_t tb = (size_t)sp->n_kv_heads * sp->row_bytes;
            FUZZ_REQUIRE(tb <= sizeof buf, "row of %zu bytes", tb);
            for (uint32_t pl = 0; pl < sp->n_planes; pl++)
                for (uint32_t t = 0; t < b->tok[k]; t++) {
                    /* finite small values, raw bits (NaN and Inf among them), or zeros */
                    for (size_t j = 0; j < tb; j++) {
                        uint64_t r = next_rand(f);
                        buf[j] = (mode & 3) == 0 ? 0 : (mode & 3) == 1 ? (uint8_t)r : r & 0x3f;
                    }
                    kvt_status s = kvt_seq_write(sq, l, pl, t, 1, buf, tb);
                    FUZZ_STATUS("kvt_seq_write", s, KVT_ERR_BAD_STATE);
                    if (!b->ran[l])
                        FUZZ_REQUIRE(s == KVT_OK, "write before the layer's run: %s",
                                     kvt_status_name(s));
                }
        }
    }
}

/* Row writes outside the step's shape (kvt_seq_write's ranges and sizes), pool I/O at any
 * slot (kvt_layer_read / kvt_layer_write: the engine may write any slot), reserved slots. */
static void op_raw_io(fuzz_state *f) {
    int i = fuzz_range(&f->in, 0, MAX_SEQS - 1);
    uint32_t l = fuzz_range(&f->in, 0, N_LAYERS);
    uint32_t pl = fuzz_range(&f->in, 0, 2);
    uint32_t first = fuzz_range(&f->in, 0, 40), n = fuzz_range(&f->in, 0, 40);
    uint8_t mode = fuzz_u8(&f->in);
    size_t tb = 0;
    if (l < N_LAYERS && has_kv(l)) {
        const kvt_layer_spec *sp = kvt_model_layer(f->model, l);
        tb = (size_t)sp->n_kv_heads * sp->row_bytes;
    }
    size_t bytes = (size_t)n * tb + ((mode & 1) ? 1 : 0);
    uint8_t *buf = calloc(bytes + 1, 1);
    FUZZ_REQUIRE(buf, "oom");
    for (size_t j = 0; j < bytes; j++)
        buf[j] = (uint8_t)next_rand(f);
    kvt_status s;
    if (f->seq[i].h) {
        s = kvt_seq_write(f->seq[i].h, l, pl, first, n, buf, bytes);
        FUZZ_STATUS("kvt_seq_write", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                    KVT_ERR_INVALID_ARGUMENT, KVT_ERR_POLICY_MISMATCH);
        int32_t slot;
        s = kvt_seq_reserved_slot(f->seq[i].h, l, first, &slot);
        FUZZ_STATUS("kvt_seq_reserved_slot", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                    KVT_ERR_POLICY_MISMATCH, KVT_ERR_INVALID_ARGUMENT);
        if (s == KVT_OK)
            FUZZ_REQUIRE(slot >= 0 && (uint64_t)slot < pool_slots(f), "reserved slot %d", slot);
        (void)kvt_seq_pending(f->seq[i].h);
        (void)kvt_seq_length(f->seq[i].h);
    }
    uint64_t slot0 = (mode & 2) ? pool_slots(f) - (first % 4) : first;
    s = (mode & 4) ? kvt_layer_write(f->ctx, l, pl, slot0, n, buf, bytes)
                   : kvt_layer_read(f->ctx, l, pl, slot0, n, buf, bytes);
    FUZZ_STATUS("kvt_layer_read/write", s, KVT_ERR_OUT_OF_RANGE, KVT_ERR_INVALID_ARGUMENT,
                KVT_ERR_POLICY_MISMATCH);
    free(buf);
}

static void op_plan(fuzz_state *f) {
    fbatch *b = &f->b[fuzz_u8(&f->in) % MAX_BATCHES];
    kvt_status s = kvt_batch_plan(b->h);
    FUZZ_STATUS("kvt_batch_plan", s, KVT_ERR_BAD_STATE);
    if (b->phase == 1)
        FUZZ_REQUIRE(s == KVT_OK, "plan after reserve: %s", kvt_status_name(s));
    if (b->phase == 0)
        FUZZ_REQUIRE(s == KVT_ERR_BAD_STATE, "plan without a reservation accepted");
    if (s == KVT_OK && b->phase == 1) {
        b->phase = 2;
        const uint8_t how = fuzz_u8(&f->in);
        if ((how & 1) && !b->pe_set) { /* the batch's emission, in one of the layouts */
            static const kvt_emit_layout lay[3] = {KVT_EMIT_TOKENS, KVT_EMIT_CSR,
                                                   KVT_EMIT_CSR_KV_HEADS};
            /* (bit 7: FlashInfer's paged layout, refused where a set is not whole pages) */
            const kvt_emit_layout layout = (how & 0x80) ? KVT_EMIT_PAGED : lay[(how >> 1) % 3];
            b->pe = (kvt_emit){.struct_size = sizeof b->pe, .layout = layout,
                               .indices = b->pidx, .dense = b->pdense};
            if (layout == KVT_EMIT_TOKENS) {
                b->pe.capacity = PLAN_TOPK;
                b->pe.lengths = b->plen;
            } else {
                b->pe.capacity = MAX_SEQS * PLAN_TOPK * 2;
                b->pe.indptr = b->pptr;
                if (layout == KVT_EMIT_PAGED)
                    b->pe.last_page_len = b->plast;
            }
            b->pe_set = true;
        }
        if (how & 1) { /* and on the device */
            bool planned = false;
            s = kvt_batch_plan_device(b->h, &b->pe, 1, NULL, &planned);
            if (s == KVT_ERR_UNSUPPORTED) /* a set that is not whole pages */
                FUZZ_REQUIRE(b->pe.layout == KVT_EMIT_PAGED, "plan_device: %s",
                             kvt_status_name(s));
            else
                FUZZ_STATUS("kvt_batch_plan_device", s, KVT_ERR_CAPACITY, KVT_ERR_OUT_OF_MEMORY);
            b->planned = s == KVT_OK && planned;
        }
    }
}

static void check_emission(fuzz_state *f, const kvt_emit *e, uint32_t n_q) {
    if (e->layout == KVT_EMIT_TOKENS) {
        for (uint32_t q = 0; q < n_q; q++) {
            int32_t len = e->lengths[q];
            FUZZ_REQUIRE(len >= 0 && (uint32_t)len <= e->capacity, "query %u: length %d of %u", q,
                         len, e->capacity);
            for (uint32_t j = 0; j < e->capacity; j++) {
                int32_t v = e->indices[(size_t)q * e->capacity + j];
                if (j < (uint32_t)len)
                    FUZZ_REQUIRE(v >= 0 && (uint64_t)v < pool_slots(f),
                                 "query %u entry %u: slot %d outside the pool", q, j, v);
                else
                    FUZZ_REQUIRE(v == -1, "query %u entry %u: padding %d", q, j, v);
            }
        }
    } else if (e->layout == KVT_EMIT_PAGED) { /* page ids; the last page's rows */
        FUZZ_REQUIRE(e->indptr[0] == 0, "indptr[0] = %d", e->indptr[0]);
        for (uint32_t q = 0; q < n_q; q++) {
            const int32_t n = e->indptr[q + 1] - e->indptr[q], last = e->last_page_len[q];
            FUZZ_REQUIRE(n >= 0, "indptr falls at %u", q);
            FUZZ_REQUIRE(n ? last >= 1 && (uint32_t)last <= f->page_rows : last == 0,
                         "query %u: %d pages, last_page_len %d", q, n, last);
        }
        FUZZ_REQUIRE((uint32_t)e->indptr[n_q] <= e->capacity, "indptr end %d past %u",
                     e->indptr[n_q], e->capacity);
        for (int32_t j = 0; j < e->indptr[n_q]; j++)
            FUZZ_REQUIRE(e->indices[j] >= 0 && (uint32_t)e->indices[j] < f->n_pages,
                         "paged entry %d: page %d outside the pool", j, e->indices[j]);
    } else {
        FUZZ_REQUIRE(e->indptr[0] == 0, "indptr[0] = %d", e->indptr[0]);
        for (uint32_t q = 0; q < n_q; q++)
            FUZZ_REQUIRE(e->indptr[q + 1] >= e->indptr[q], "indptr falls at %u", q);
        FUZZ_REQUIRE((uint32_t)e->indptr[n_q] <= e->capacity, "indptr end %d past %u",
                     e->indptr[n_q], e->capacity);
        for (int32_t j = 0; j < e->indptr[n_q]; j++)
            FUZZ_REQUIRE(e->indices[j] >= 0 && (uint64_t)e->indices[j] < pool_slots(f),
                         "csr entry %d: slot %d outside the pool", j, e->indices[j]);
    }
}

static void op_run(fuzz_state *f) {
    fbatch *b = &f->b[fuzz_u8(&f->in) % MAX_BATCHES];
    uint32_t l = fuzz_range(&f->in, 0, N_LAYERS);
    uint8_t mode = fuzz_u8(&f->in);
    uint32_t topk = 0, total = 0;
    kvt_status s = kvt_batch_capacity(b->h, l, &topk, &total);
    FUZZ_STATUS("kvt_batch_capacity", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                KVT_ERR_POLICY_MISMATCH, KVT_ERR_INVALID_ARGUMENT);
    uint32_t max_tok = 1;
    for (uint32_t k = 0; k < b->n; k++)
        max_tok = b->tok[k] > max_tok ? b->tok[k] : max_tok;
    uint32_t sq = (mode & 12) == 0 ? 0 : (mode & 12) == 4 ? 1 : max_tok + (mode >> 6);
    uint32_t n_q = (b->n ? b->n : 1) * (sq > 1 ? sq : 1);
    bool csr = mode & 1, short_cap = (mode & 0x30) == 0x30;
    /* CSR with bits 0x30 = 0x20: FlashInfer's paged layout (refused only where
     * kvt_batch_emit_fits said no) */
    const bool paged = csr && (mode & 0x30) == 0x20;
    uint32_t cap = csr ? total * (sq > 1 ? sq : 1) : topk;
    if (short_cap && cap > 0)
        cap--;
    kvt_emit e = {.struct_size = sizeof e,
                  .layout = paged ? KVT_EMIT_PAGED
                            : csr ? KVT_EMIT_CSR
                                  : KVT_EMIT_TOKENS,
                  .capacity = cap,
                  .queries_per_seq = sq};
    size_t n_idx = csr ? cap : (size_t)n_q * cap;
    e.indices = malloc(sizeof(int32_t) * (n_idx + 1));
    e.lengths = malloc(sizeof(int32_t) * n_q);
    e.indptr = malloc(sizeof(int32_t) * (n_q + 1));
    e.last_page_len = malloc(sizeof(int32_t) * n_q);
    uint8_t dense[MAX_SEQS];
    e.dense = (mode & 2) ? dense : NULL;
    FUZZ_REQUIRE(e.indices && e.lengths && e.indptr && e.last_page_len, "oom");
    const bool planned_run = b->planned && (mode & 0x80); /* the emission it was planned for */
    bool fits = true;
    if (paged && !planned_run) {
        s = kvt_batch_emit_fits(b->h, l, KVT_EMIT_PAGED, &fits);
        FUZZ_STATUS("kvt_batch_emit_fits", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                    KVT_ERR_POLICY_MISMATCH);
        FUZZ_REQUIRE(s == KVT_OK || !fits, "emit_fits failed with fits set");
        if (b->phase >= 2 && l < N_LAYERS && has_kv(l))
            FUZZ_REQUIRE(s == KVT_OK, "kvt_batch_emit_fits after plan: %s", kvt_status_name(s));
    }
    s = kvt_batch_run(b->h, l, NULL, NULL, planned_run ? &b->pe : &e);
    if (f->verbose)
        fprintf(stderr, "  run layer %u (%s, s_q %u, capacity %u): %s\n", l,
                paged ? "paged"
                : csr ? "csr"
                      : "tokens",
                sq, cap, kvt_status_name(s));
    if (paged && !planned_run && s == KVT_ERR_UNSUPPORTED) /* a set of single rows */
        FUZZ_REQUIRE(!fits, "layer %u: PAGED refused where kvt_batch_emit_fits said it fits", l);
    else
        FUZZ_STATUS("kvt_batch_run", s, KVT_ERR_BAD_STATE, KVT_ERR_CAPACITY, KVT_ERR_OUT_OF_MEMORY,
                    KVT_ERR_OUT_OF_RANGE, KVT_ERR_POLICY_MISMATCH, KVT_ERR_INVALID_ARGUMENT);
    if (b->phase < 2)
        FUZZ_REQUIRE(s != KVT_OK, "run before plan accepted");
    if (b->phase >= 2 && l < N_LAYERS && has_kv(l) && !short_cap && sq <= 1 && !b->planned && fits)
        FUZZ_REQUIRE(s == KVT_OK, "run of layer %u with kvt_batch_capacity's capacity: %s", l,
                     kvt_status_name(s));
    if (b->phase >= 2 && l < N_LAYERS && has_kv(l) && planned_run)
        FUZZ_REQUIRE(s == KVT_OK, "planned run of layer %u: %s", l, kvt_status_name(s));
    /* CAPACITY and a PAGED refusal may come after the layer's work (kvtier.h): the layer may
     * have run, so its rows may have moved — treat it as run. */
    if (b->phase >= 2 && l < N_LAYERS &&
        (s == KVT_OK || s == KVT_ERR_CAPACITY || (paged && s == KVT_ERR_UNSUPPORTED))) {
        b->phase = 3;
        b->ran[l] = true;
    }
    if (s == KVT_OK && b->phase >= 2 && planned_run && has_kv(l))
        check_emission(f, &b->pe, b->pe.layout == KVT_EMIT_CSR_KV_HEADS
                                      ? b->n * kvt_model_layer(f->model, l)->n_kv_heads
                                      : b->n);
    else if (s == KVT_OK && b->phase >= 2 && !planned_run)
        check_emission(f, &e, b->n ? n_q : 0);
    free(e.indices);
    free(e.lengths);
    free(e.indptr);
    free(e.last_page_len);
}

static void op_commit(fuzz_state *f) {
    fbatch *b = &f->b[fuzz_u8(&f->in) % MAX_BATCHES];
    uint8_t mode = fuzz_u8(&f->in);
    uint32_t acc[MAX_SEQS];
    bool valid = true;
    for (uint32_t k = 0; !(mode & 1) && k < b->n; k++) {
        uint32_t lo = b->tok[k] - b->drafts[k];
        acc[k] = fuzz_range(&f->in, lo, b->tok[k]);
        if ((mode & 6) == 6) { /* outside the contract: a non-draft rejected, or one too many */
            acc[k] = (mode & 8) ? b->tok[k] + 1 : (lo > 0 ? lo - 1 : b->tok[k] + 1);
            valid = valid && b->idx[k] < 0;
        }
    }
    kvt_status s = kvt_batch_commit(b->h, (mode & 1) ? NULL : acc);
    if (f->verbose)
        fprintf(stderr, "  commit: %s\n", kvt_status_name(s));
    FUZZ_STATUS("kvt_batch_commit", s, KVT_ERR_BAD_STATE, KVT_ERR_INVALID_ARGUMENT,
                KVT_ERR_OUT_OF_MEMORY);
    if (b->phase == 0)
        FUZZ_REQUIRE(s == KVT_ERR_BAD_STATE, "commit without a step: %s", kvt_status_name(s));
    else if ((mode & 1) || valid)
        FUZZ_REQUIRE(s == KVT_OK, "commit of a valid step: %s", kvt_status_name(s));
    else
        FUZZ_REQUIRE(s == KVT_ERR_INVALID_ARGUMENT, "commit refusing nothing: %s",
                     kvt_status_name(s));
    if (s == KVT_OK)
        step_done(f, b);
}

static void op_batch_recreate(fuzz_state *f) {
    fbatch *b = &f->b[fuzz_u8(&f->in) % MAX_BATCHES];
    uint32_t max_seqs = fuzz_range(&f->in, 1, MAX_SEQS);
    if (b->phase == 3)
        return; /* after a run: commit first (kvtier.h, kvt_batch_destroy) */
    kvt_batch_destroy(b->h);
    step_done(f, b);
    kvt_status s = kvt_batch_create(f->ctx, max_seqs, &b->h);
    b->pe_set = false; /* a new batch plans its own emission */
    FUZZ_STATUS("kvt_batch_create", s, KVT_ERR_OUT_OF_MEMORY);
    FUZZ_REQUIRE(s == KVT_OK, "batch create");
}

static void op_prompt(fuzz_state *f) {
    int i = fuzz_range(&f->in, 0, MAX_SEQS - 1);
    uint32_t n = fuzz_range(&f->in, 0, 300);
    if (!f->seq[i].h)
        return;
    kvt_status s = kvt_seq_set_prompt_rows(f->seq[i].h, n);
    FUZZ_STATUS("kvt_seq_set_prompt_rows", s, KVT_ERR_BAD_STATE, KVT_ERR_INVALID_ARGUMENT);
}

static void op_inspect(fuzz_state *f) {
    int i = fuzz_range(&f->in, 0, MAX_SEQS - 1);
    uint32_t l = fuzz_range(&f->in, 0, N_LAYERS);
    uint32_t head = fuzz_range(&f->in, 0, 2);
    uint32_t pos = fuzz_u16(&f->in);
    if (!f->seq[i].h)
        return;
    pos %= (uint32_t)kvt_seq_length(f->seq[i].h) + kvt_seq_pending(f->seq[i].h) + 2;
    kvt_seq *sq = f->seq[i].h;
    kvt_status s;
    kvt_layer_stats st = {.struct_size = sizeof st};
    s = kvt_seq_layer_stats(sq, l, &st);
    FUZZ_STATUS("kvt_seq_layer_stats", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                KVT_ERR_POLICY_MISMATCH);
    if (s == KVT_OK && has_kv(l)) {
        const kvt_layer_spec *sp = kvt_model_layer(f->model, l);
        FUZZ_REQUIRE(st.attended_rows * sp->n_kv_heads + st.archived_rows + st.dropped_rows ==
                         st.appended_rows,
                     "layer %u: %llu x %u + %llu + %llu != %llu", l,
                     (unsigned long long)st.attended_rows, sp->n_kv_heads,
                     (unsigned long long)st.archived_rows, (unsigned long long)st.dropped_rows,
                     (unsigned long long)st.appended_rows);
    }
    kvt_row_state rs;
    int32_t slot;
    s = kvt_seq_row_state(sq, l, head, pos, &rs, &slot);
    FUZZ_STATUS("kvt_seq_row_state", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                KVT_ERR_POLICY_MISMATCH);
    if (s == KVT_OK)
        FUZZ_REQUIRE(((rs == KVT_ROW_ATTENDED || rs == KVT_ROW_PENDING) &&
                      slot >= 0 && (uint64_t)slot < pool_slots(f)) ||
                         ((rs == KVT_ROW_ARCHIVED || rs == KVT_ROW_DROPPED) && slot == -1),
                     "row state %d with slot %d", (int)rs, slot);
    uint8_t row[256];
    for (uint32_t pl = 0; pl < 2; pl++) {
        s = kvt_seq_read_row(sq, l, pl, head, pos, row, sizeof row);
        FUZZ_STATUS("kvt_seq_read_row", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                    KVT_ERR_POLICY_MISMATCH, KVT_ERR_DROPPED, KVT_ERR_INVALID_ARGUMENT,
                    KVT_ERR_CAPACITY);
    }
    uint64_t cap = fuzz_range(&f->in, 0, 800), n = 0;
    int64_t *positions = malloc(sizeof(int64_t) * (cap + 1));
    int32_t *map = malloc(sizeof(int32_t) * (cap + 1));
    FUZZ_REQUIRE(positions && map, "oom");
    s = kvt_seq_positions(sq, l, head, positions, cap, &n);
    FUZZ_STATUS("kvt_seq_positions", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                KVT_ERR_POLICY_MISMATCH, KVT_ERR_CAPACITY);
    s = kvt_seq_last_slot_map(sq, l, head, map, cap, &n);
    FUZZ_STATUS("kvt_seq_last_slot_map", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                KVT_ERR_POLICY_MISMATCH, KVT_ERR_CAPACITY);
    uint32_t np = 0;
    uint64_t rows = 0, first = 0;
    s = kvt_seq_block_table(sq, l, map, (uint32_t)cap, &np, &rows);
    FUZZ_STATUS("kvt_seq_block_table", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                KVT_ERR_POLICY_MISMATCH, KVT_ERR_CAPACITY);
    if (s == KVT_OK)
        for (uint32_t k = 0; k < np; k++)
            FUZZ_REQUIRE(map[k] >= 0 && (uint32_t)map[k] < f->n_pages, "page %d", map[k]);
    s = kvt_seq_first_row(sq, l, &first);
    FUZZ_STATUS("kvt_seq_first_row", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE,
                KVT_ERR_POLICY_MISMATCH);
    s = kvt_seq_pages_needed(sq, pos, &np);
    FUZZ_STATUS("kvt_seq_pages_needed", s, KVT_ERR_BAD_STATE, KVT_ERR_OUT_OF_RANGE);
    free(positions);
    free(map);
}

/* Snapshot request i; restore it (mode bit 0: one byte flipped, bit 1: cut short, both refused
 * with the pools unchanged) in place of the original (bit 2: the original destroyed first, as a
 * preemption does), or into a free request slot while the original lives: refused, its request
 * id being live. A restored request snapshots to the same bytes. */
static void op_snapshot(fuzz_state *f) {
    int i = fuzz_range(&f->in, 0, MAX_SEQS - 1);
    uint8_t mode = fuzz_u8(&f->in);
    uint32_t at = fuzz_u16(&f->in);
    if (!f->seq[i].h)
        return;
    size_t n = 0;
    kvt_status s = kvt_seq_snapshot_size(f->seq[i].h, &n);
    FUZZ_STATUS("kvt_seq_snapshot_size", s, KVT_ERR_BAD_STATE);
    if (f->seq[i].batch >= 0)
        FUZZ_REQUIRE(s == KVT_ERR_BAD_STATE, "snapshot inside a step: %s", kvt_status_name(s));
    if (s != KVT_OK)
        return;
    uint8_t *buf = malloc(n), *again = NULL;
    FUZZ_REQUIRE(buf, "oom");
    s = kvt_seq_snapshot(f->seq[i].h, buf, n - (mode & 8 ? 1 : 0), NULL);
    FUZZ_REQUIRE(s == ((mode & 8) ? KVT_ERR_CAPACITY : KVT_OK), "snapshot: %s",
                 kvt_status_name(s));
    if (mode & 8)
        s = kvt_seq_snapshot(f->seq[i].h, buf, n, NULL);
    int j = (mode & 4) ? i : -1;
    for (int k = 0; j < 0 && k < MAX_SEQS; k++)
        if (!f->seq[k].h)
            j = k;
    if (j == i) { /* preempted: the original goes, its snapshot comes back */
        kvt_seq_destroy(f->seq[i].h);
        f->seq[i].h = NULL;
    }
    uint32_t before[N_LAYERS], after[N_LAYERS];
    free_pages(f, before);
    size_t len = n;
    if (mode & 1)
        buf[at % n] ^= (uint8_t)(1 + (mode >> 4));
    else if (mode & 2)
        len = at % n;
    kvt_seq *r = NULL;
    s = j < 0 ? KVT_ERR_CAPACITY : kvt_seq_restore(f->ctx, buf, len, &r);
    if (f->verbose)
        fprintf(stderr, "  snapshot of %d (%zu bytes), restore into %d: %s\n", i, n, j,
                kvt_status_name(s));
    if (mode & 3) {
        FUZZ_STATUS("kvt_seq_restore (damaged)", s, KVT_ERR_PARSE, KVT_ERR_CORRUPT,
                    KVT_ERR_UNSUPPORTED, KVT_ERR_MISMATCH, KVT_ERR_CAPACITY,
                    KVT_ERR_INVALID_ARGUMENT);
        FUZZ_REQUIRE(s != KVT_OK, "a damaged snapshot was restored");
    } else if (j >= 0 && j != i) {
        FUZZ_REQUIRE(s == KVT_ERR_INVALID_ARGUMENT,
                     "restore beside the live original (same request id): %s",
                     kvt_status_name(s));
    } else {
        FUZZ_STATUS("kvt_seq_restore", s, KVT_ERR_POOL_EXHAUSTED, KVT_ERR_CAPACITY);
    }
    if (s != KVT_OK) {
        FUZZ_REQUIRE(!r, "a refused restore returned a request");
        free_pages(f, after);
        for (uint32_t l = 0; l < N_LAYERS; l++)
            FUZZ_REQUIRE(before[l] == after[l], "layer %u: %u free pages before a refused "
                         "restore, %u after", l, before[l], after[l]);
        free(buf);
        return;
    }
    size_t m = 0;
    FUZZ_REQUIRE(kvt_seq_snapshot_size(r, &m) == KVT_OK && m == n, "restored size %zu of %zu",
                 m, n);
    again = malloc(n);
    FUZZ_REQUIRE(again && kvt_seq_snapshot(r, again, n, NULL) == KVT_OK &&
                     memcmp(buf, again, n) == 0,
                 "a restored request snapshots to other bytes");
    f->seq[j].h = r;
    f->seq[j].batch = -1;
    free(buf);
    free(again);
}

/* kvt_seq_fork or kvt_seq_attach of request i into free slot j: its documented statuses, *out
 * NULL on refusal with every pool as it was; on success the child checks (check_all) and,
 * for an attach, holds the prefix. The prefix: any page multiple up to the length (the
 * library refuses those a round or a window changed: KVT_ERR_UNSUPPORTED), or a bad one. */
static void op_share(fuzz_state *f, bool attach) {
    int i = fuzz_range(&f->in, 0, MAX_SEQS - 1), j = fuzz_range(&f->in, 0, MAX_SEQS - 1);
    uint8_t mode = fuzz_u8(&f->in);
    if (!f->seq[i].h || f->seq[j].h)
        return;
    kvt_seq *src = f->seq[i].h;
    const uint64_t n = kvt_seq_length(src);
    uint64_t prefix = (uint64_t)f->page_rows * fuzz_range(&f->in, 0, (uint32_t)(n / f->page_rows));
    if ((mode & 3) == 3) /* not a page multiple, or past the length */
        prefix = mode & 4 ? n + f->page_rows : prefix + 1;
    uint32_t before[N_LAYERS], after[N_LAYERS];
    free_pages(f, before);
    kvt_seq *c = (kvt_seq *)&c;
    uint64_t id = mode & 8 ? fuzz_u8(&f->in) : 1000u + (uint64_t)j;
    kvt_status s = attach ? kvt_seq_attach(src, prefix, id, &c) : kvt_seq_fork(src, id, &c);
    if (f->verbose)
        fprintf(stderr, "  %s of %d (length %llu, prefix %llu) into %d: %s %s\n",
                attach ? "attach" : "fork", i, (unsigned long long)n,
                (unsigned long long)prefix, j, kvt_status_name(s), s ? kvt_last_error() : "");
    FUZZ_STATUS(attach ? "kvt_seq_attach" : "kvt_seq_fork", s, KVT_ERR_BAD_STATE,
                KVT_ERR_CAPACITY, KVT_ERR_OUT_OF_MEMORY, KVT_ERR_UNSUPPORTED,
                KVT_ERR_INVALID_ARGUMENT);
    free_pages(f, after);
    if (s != KVT_OK) {
        FUZZ_REQUIRE(c == NULL, "a refused %s left *out set", attach ? "attach" : "fork");
        for (uint32_t l = 0; l < N_LAYERS; l++)
            FUZZ_REQUIRE(before[l] == after[l], "refused %s (%s) moved layer %u's pages %u -> %u",
                         attach ? "attach" : "fork", kvt_status_name(s), l, before[l], after[l]);
        if (f->seq[i].batch < 0)
            FUZZ_REQUIRE(s != KVT_ERR_BAD_STATE, "a request between steps refused: %s",
                         kvt_last_error());
        return;
    }
    FUZZ_REQUIRE(f->seq[i].batch < 0, "shared a request inside a step");
    FUZZ_REQUIRE(kvt_seq_length(c) == (attach ? prefix : n), "child of length %llu",
                 (unsigned long long)kvt_seq_length(c));
    for (uint32_t l = 0; l < N_LAYERS; l++)
        FUZZ_REQUIRE(before[l] == after[l], "%s took pages of layer %u: %u -> %u",
                     attach ? "attach" : "fork", l, before[l], after[l]);
    f->seq[j].h = c;
    f->seq[j].batch = -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_state f = {.in = {data, size}};
    f.rng = size;
    f.verbose = getenv("FUZZ_VERBOSE") != NULL;
    for (size_t i = 0; i < size && i < 8; i++)
        f.rng = f.rng << 8 | data[i];
    f.model = make_model(&f);
    if (!make_ctx(&f)) {
        kvt_model_destroy(f.model);
        return 0;
    }
    for (int i = 0; i < MAX_SEQS; i++)
        f.seq[i].batch = -1;
    for (int k = 0; k < MAX_BATCHES; k++)
        FUZZ_REQUIRE(kvt_batch_create(f.ctx, MAX_SEQS, &f.b[k].h) == KVT_OK, "batch create");

    static const char *const names[] = {"create",  "destroy", "reserve", "write",
                                        "plan",    "run",     "commit",  "batch recreate",
                                        "prompt",  "inspect", "write",   "run",
                                        "raw io",  "snapshot", "fork",    "attach"};
    for (int op = 0; op < MAX_OPS && f.in.n > 0; op++) {
        /* bytes 252..255 (fork, attach) came later: every other byte keeps the op it had, so
         * the corpus and the regression inputs still drive what they were found with */
        uint8_t byte = fuzz_u8(&f.in), code = byte >= 252 ? 14 + (byte & 1) : byte % 14;
        if (f.verbose)
            fprintf(stderr, "op %d: %s\n", op, names[code]);
        switch (code) {
        case 0: op_seq_create(&f); break;
        case 1: op_seq_destroy(&f); break;
        case 2: op_reserve(&f); break;
        case 3: case 10: op_write(&f); break;
        case 4: op_plan(&f); break;
        case 5: case 11: op_run(&f); break;
        case 6: op_commit(&f); break;
        case 7: op_batch_recreate(&f); break;
        case 8: op_prompt(&f); break;
        case 9: op_inspect(&f); break;
        case 12: op_raw_io(&f); break;
        case 13: op_snapshot(&f); break;
        case 14: op_share(&f, false); break;
        case 15: op_share(&f, true); break;
        }
        check_all(&f, names[code]);
    }

    /* Finish every step, destroy every request: every page is back. */
    for (int k = 0; k < MAX_BATCHES; k++)
        if (f.b[k].phase > 0) {
            kvt_status s = kvt_batch_commit(f.b[k].h, NULL);
            FUZZ_REQUIRE(s == KVT_OK, "final commit: %s", kvt_status_name(s));
            step_done(&f, &f.b[k]);
        }
    check_all(&f, "the final commits");
    for (int i = 0; i < MAX_SEQS; i++)
        kvt_seq_destroy(f.seq[i].h);
    uint32_t fp[N_LAYERS];
    free_pages(&f, fp);
    for (uint32_t l = 0; l < N_LAYERS; l++)
        if (has_kv(l))
            FUZZ_REQUIRE(fp[l] == f.n_pages, "layer %u: %u of %u pages free with no request", l,
                         fp[l], f.n_pages);
    kvt_ctx_destroy(f.ctx); /* and the batches */
    kvt_model_destroy(f.model);
    return 0;
}
