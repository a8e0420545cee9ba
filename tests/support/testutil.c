#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

const char *tu_models_dir(void) {
    const char *env = getenv("KVT_MODELS_DIR");
    if (env && *env)
        return env;
    return KVT_SOURCE_DIR "/tests/data/models";
}

const char *tu_model_path(const char *file) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", tu_models_dir(), file);
    return buf;
}

uint64_t tu_next(tu_rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double tu_uniform(tu_rng *r) {
    return (double)(tu_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

double tu_normal(tu_rng *r) {
    double u1 = tu_uniform(r), u2 = tu_uniform(r);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

bool tu_orthonormal_rows(tu_rng *g, uint32_t rank, uint32_t n, float *out) {
    double *v = malloc(sizeof(double) * rank * n + 1);
    if (!v)
        return false;
    for (size_t i = 0; i < (size_t)rank * n; i++)
        v[i] = tu_normal(g);
    const bool ok = kvt_orthonormalise_rows(v, rank, n, 2) == KVT_OK;
    for (size_t i = 0; ok && i < (size_t)rank * n; i++)
        out[i] = (float)v[i];
    free(v);
    return ok;
}

/* ---- single-request drivers over the batch API ---- */
#include <string.h>

#define TU_MAX_OPEN 64
static struct {
    kvt_seq *seq;
    kvt_batch *b;
} tu_open[TU_MAX_OPEN];

kvt_model *tu_mixed_model(void) {
    kvt_layer_spec s[TU_N_LAYERS];
    if (kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[TU_L_SAL]) ||
        kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 16, &s[TU_L_EV1]) ||
        kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 16, &s[TU_L_EV2]) ||
        kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_BF16, 2, 8, &s[TU_L_SLIDE]))
        return NULL;
    s[TU_L_SLIDE].sliding_window = TU_WINDOW;
    kvt_model *m;
    return kvt_model_create(s, TU_N_LAYERS, "mixed", &m, NULL, 0) == KVT_OK ? m : NULL;
}

kvt_ctx *tu_mixed_ctx(kvt_model *m, bool archive, uint32_t n_pages) {
    return tu_mixed_ctx_k(m, archive, n_pages, TU_K);
}

kvt_ctx *tu_mixed_ctx_k(kvt_model *m, bool archive, uint32_t n_pages, uint32_t K) {
    return tu_mixed_ctx_sketch(m, archive, n_pages, K, 0);
}

kvt_ctx *tu_mixed_ctx_sketch(kvt_model *m, bool archive, uint32_t n_pages, uint32_t K,
                             uint32_t sketch_rank) {
    return tu_mixed_ctx_slots(m, archive, n_pages, K, sketch_rank, 0, 0);
}

kvt_config tu_mixed_config(bool archive, uint32_t K) {
    kvt_config c = kvt_config_default();
    c.block_rows = TU_BLOCK;
    c.kappa = 4;
    c.ratio = 8;
    c.evict_budget_rows = K;
    c.recent_rows = TU_R;
    c.cadence_rows = TU_R;
    c.evict_archive = archive;
    return c;
}

static kvt_ctx *mixed_ctx(kvt_model *m, bool archive, uint32_t n_pages, uint32_t K,
                          uint32_t sketch_rank, uint32_t max_seqs, uint32_t max_rows,
                          uint32_t page_rows) {
    kvt_config c = tu_mixed_config(archive, K);
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = page_rows;
    p.n_pages = n_pages;
    p.allocator = KVT_ALLOC_LIBC;
    p.recall_sketch_rank = sketch_rank;
    p.max_seqs = max_seqs;
    p.max_rows_per_seq = max_rows;
    kvt_ctx *ctx;
    return kvt_ctx_create(&p, &ctx, NULL, 0) == KVT_OK ? ctx : NULL;
}

kvt_ctx *tu_mixed_ctx_slots(kvt_model *m, bool archive, uint32_t n_pages, uint32_t K,
                            uint32_t sketch_rank, uint32_t max_seqs, uint32_t max_rows) {
    return mixed_ctx(m, archive, n_pages, K, sketch_rank, max_seqs, max_rows, 16);
}

kvt_ctx *tu_mixed_ctx_pages(kvt_model *m, bool archive, uint32_t n_pages, uint32_t page_rows) {
    return mixed_ctx(m, archive, n_pages, TU_K, 0, 0, 0, page_rows);
}

void tu_row_bytes(uint8_t *buf, size_t n, uint32_t l, uint32_t pl, uint64_t pos, uint64_t seed) {
    uint64_t x = (pos + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)l << 40) ^ ((uint64_t)pl << 48) ^
                 (seed * 0xD1B54A32D192ED03ull);
    for (size_t k = 0; k < n; k++) {
        x ^= x >> 29;
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 32;
        buf[k] = (uint8_t)(x & 0x3f);
    }
}

kvt_status tu_seq_create(kvt_ctx *ctx, uint64_t request_id, kvt_seq **out) {
    kvt_seq_params p = kvt_seq_default_params();
    p.request_id = request_id;
    return kvt_seq_create(ctx, &p, out);
}

static int tu_slot(const kvt_seq *seq) {
    for (int i = 0; i < TU_MAX_OPEN; i++)
        if (tu_open[i].seq == seq && tu_open[i].b)
            return i;
    return -1;
}

kvt_status tu_reserve(kvt_seq *seq, uint32_t n) {
    if (!seq)
        return KVT_ERR_INVALID_ARGUMENT;
    int k = tu_slot(seq);
    kvt_batch *b = k >= 0 ? tu_open[k].b : NULL;
    if (!b) {
        kvt_status s = kvt_batch_create(kvt_seq_context(seq), 1, &b);
        if (s != KVT_OK)
            return s;
    }
    kvt_status s = kvt_batch_reserve(b, &seq, &n, 1);
    if (k >= 0)
        return s; /* the open step stays open (the library said why not) */
    if (s != KVT_OK) {
        kvt_batch_destroy(b);
        return s;
    }
    for (int i = 0; i < TU_MAX_OPEN; i++)
        if (!tu_open[i].b) {
            tu_open[i].seq = seq;
            tu_open[i].b = b;
            return KVT_OK;
        }
    kvt_batch_destroy(b);
    return KVT_ERR_CAPACITY;
}

static kvt_status tu_finish(kvt_seq *seq, uint32_t n, bool run) {
    int k = tu_slot(seq);
    if (k < 0) {
        /* No step open: the library's answer to a commit with nothing reserved is a zero-token
         * step (a retry of unfinished policy work) when n is 0, else the batch refuses. */
        if (!seq)
            return KVT_ERR_INVALID_ARGUMENT;
        kvt_status s = tu_reserve(seq, 0);
        if (s != KVT_OK)
            return s;
        k = tu_slot(seq);
    }
    kvt_batch *b = tu_open[k].b;
    kvt_status s = kvt_batch_plan(b);
    if (s == KVT_ERR_BAD_STATE) /* planned already: a commit that failed before */
        s = KVT_OK;
    if (s != KVT_OK)
        return s;
    if (run) {
        kvt_ctx *ctx = kvt_seq_context(seq);
        const kvt_model *m = kvt_ctx_model(ctx);
        uint32_t topk = 0;
        for (uint32_t l = 0; l < kvt_model_n_layers(m); l++) {
            if (kvt_ctx_layer_group(ctx, l) < 0)
                continue;
            kvt_batch_capacity(b, l, &topk, NULL);
            int32_t *idx = malloc(sizeof(int32_t) * (topk ? topk : 1));
            int32_t len;
            kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = idx,
                          .capacity = topk, .lengths = &len};
            s = tu_run(b, ctx, l, 1, &e);
            free(idx);
            if (s != KVT_OK)
                break; /* the commit below finishes what the runs did not */
        }
    }
    uint32_t acc = n;
    s = kvt_batch_commit(b, &acc);
    if (s == KVT_ERR_UNSUPPORTED || s == KVT_ERR_INVALID_ARGUMENT)
        return s; /* nothing committed: the step stays open */
    kvt_batch_destroy(b);
    tu_open[k].b = NULL;
    tu_open[k].seq = NULL;
    return s;
}

/* One buffer of the emission: in host memory on a host-visible backend, else a kvt_buffer whose
 * bytes are read back into the caller's host array after the run. */
typedef struct tu_mirror {
    kvt_buffer *buf;
    void *host;
    size_t bytes;
} tu_mirror;

static void *tu_mirror_of(kvt_ctx *ctx, void *host, size_t bytes, tu_mirror *m, kvt_status *s) {
    m->buf = NULL;
    m->host = host;
    m->bytes = bytes;
    if (!host || bytes == 0 || strcmp(kvt_ctx_backend_name(ctx), "cpu") == 0 || *s != KVT_OK)
        return host;
    *s = kvt_buffer_alloc(ctx, bytes, &m->buf);
    return m->buf ? kvt_buffer_ptr(m->buf) : NULL;
}

static kvt_status tu_mirror_back(tu_mirror *m, kvt_status s) {
    if (m->buf) {
        if (s == KVT_OK)
            s = kvt_buffer_read(m->buf, 0, m->host, m->bytes);
        kvt_buffer_free(m->buf);
        m->buf = NULL;
    }
    return s;
}

kvt_status tu_run(kvt_batch *b, kvt_ctx *ctx, uint32_t layer, uint32_t n_seqs, const kvt_emit *e) {
    uint32_t sq = e->queries_per_seq > 1 ? e->queries_per_seq : 1;
    size_t nq = (size_t)n_seqs * sq;
    bool tokens = e->layout == KVT_EMIT_TOKENS;
    kvt_emit d = *e;
    tu_mirror m[4];
    kvt_status s = KVT_OK;
    d.indices = tu_mirror_of(ctx, e->indices,
                             sizeof(int32_t) * (tokens ? nq * e->capacity : e->capacity), &m[0], &s);
    d.lengths = tu_mirror_of(ctx, tokens ? e->lengths : NULL, sizeof(int32_t) * nq, &m[1], &s);
    d.indptr = tu_mirror_of(ctx, tokens ? NULL : e->indptr, sizeof(int32_t) * (nq + 1), &m[2], &s);
    d.dense = tu_mirror_of(ctx, e->dense, n_seqs, &m[3], &s);
    if (s == KVT_OK)
        s = kvt_batch_run(b, layer, NULL, NULL, &d);
    for (int i = 0; i < 4; i++)
        s = tu_mirror_back(&m[i], s);
    return s;
}

kvt_status tu_commit(kvt_seq *seq, uint32_t n) {
    return tu_finish(seq, n, false);
}

kvt_status tu_commit_run(kvt_seq *seq, uint32_t n) {
    return tu_finish(seq, n, true);
}

static kvt_status tu_emit(kvt_ctx *ctx, uint32_t layer, kvt_seq *const *seqs, uint32_t n,
                          const kvt_emit *e) {
    kvt_batch *b;
    kvt_status s = kvt_batch_create(ctx, n ? n : 1, &b);
    if (s != KVT_OK)
        return s;
    uint32_t *zero = calloc(n ? n : 1, sizeof *zero);
    s = kvt_batch_reserve(b, seqs, zero, n);
    if (s == KVT_OK)
        s = kvt_batch_plan(b);
    if (s == KVT_OK) {
        s = tu_run(b, ctx, layer, n, e);
        kvt_status c = kvt_batch_commit(b, NULL);
        if (s == KVT_OK)
            s = c;
    }
    free(zero);
    kvt_batch_destroy(b);
    return s;
}

kvt_status tu_attended_tokens(kvt_ctx *ctx, uint32_t layer, kvt_seq *const *seqs, uint32_t n,
                              int32_t *indices, uint32_t topk, int32_t *lengths) {
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_TOKENS, .indices = indices,
                  .capacity = topk, .lengths = lengths};
    return tu_emit(ctx, layer, seqs, n, &e);
}

kvt_status tu_attended_csr(kvt_ctx *ctx, uint32_t layer, kvt_seq *const *seqs, uint32_t n,
                           int32_t *indptr, int32_t *indices, uint32_t capacity) {
    kvt_emit e = {.struct_size = sizeof e, .layout = KVT_EMIT_CSR, .indices = indices,
                  .capacity = capacity, .indptr = indptr};
    return tu_emit(ctx, layer, seqs, n, &e);
}

kvt_status tu_attended_count(kvt_ctx *ctx, uint32_t layer, kvt_seq *const *seqs, uint32_t n,
                             uint32_t *counts) {
    if (!ctx)
        return KVT_ERR_INVALID_ARGUMENT;
    for (uint32_t i = 0; i < n; i++) {
        kvt_layer_stats ls = {.struct_size = sizeof ls};
        kvt_status s = kvt_seq_layer_stats(seqs[i], layer, &ls);
        if (s != KVT_OK)
            return s;
        counts[i] = (uint32_t)ls.attended_rows;
    }
    return KVT_OK;
}

kvt_status tu_same_rows(const kvt_seq *a, const kvt_seq *b, char *why, size_t why_len) {
    if (kvt_seq_length(a) != kvt_seq_length(b)) {
        snprintf(why, why_len, "lengths %llu and %llu", (unsigned long long)kvt_seq_length(a),
                 (unsigned long long)kvt_seq_length(b));
        return KVT_ERR_INVARIANT;
    }
    const kvt_ctx *ctx = kvt_seq_context(a);
    const kvt_model *m = kvt_ctx_model(ctx);
    uint64_t total = kvt_seq_length(a);
    uint8_t *ra = NULL, *rb = NULL;
    kvt_status s = KVT_OK;
    for (uint32_t l = 0; s == KVT_OK && l < kvt_model_n_layers(m); l++) {
        if (kvt_ctx_layer_group(ctx, l) < 0)
            continue;
        const kvt_layer_spec *sp = kvt_model_layer(m, l);
        free(ra);
        free(rb);
        ra = malloc(sp->row_bytes);
        rb = malloc(sp->row_bytes);
        if (!ra || !rb)
            return KVT_ERR_OUT_OF_MEMORY;
        for (uint32_t h = 0; s == KVT_OK && h < sp->n_kv_heads; h++)
            for (uint64_t p = 0; s == KVT_OK && p < total; p++) {
                kvt_row_state x, y;
                if ((s = kvt_seq_row_state(a, l, h, p, &x, NULL)) != KVT_OK ||
                    (s = kvt_seq_row_state(b, l, h, p, &y, NULL)) != KVT_OK) {
                    snprintf(why, why_len, "row_state: %s", kvt_last_error());
                    break;
                }
                if (x != y) {
                    snprintf(why, why_len, "layer %u head %u position %llu: states %d and %d", l,
                             h, (unsigned long long)p, (int)x, (int)y);
                    s = KVT_ERR_INVARIANT;
                    break;
                }
                for (uint32_t pl = 0; x != KVT_ROW_DROPPED && pl < sp->n_planes; pl++) {
                    if ((s = kvt_seq_read_row(a, l, pl, h, p, ra, sp->row_bytes)) != KVT_OK ||
                        (s = kvt_seq_read_row(b, l, pl, h, p, rb, sp->row_bytes)) != KVT_OK) {
                        snprintf(why, why_len, "read_row: %s", kvt_last_error());
                        break;
                    }
                    if (memcmp(ra, rb, sp->row_bytes) != 0) {
                        snprintf(why, why_len, "layer %u plane %u head %u position %llu: bytes differ",
                                 l, pl, h, (unsigned long long)p);
                        s = KVT_ERR_INVARIANT;
                        break;
                    }
                }
            }
    }
    free(ra);
    free(rb);
    return s;
}

void tu_fp8_row(tu_rng *r, uint8_t *row) {
    for (uint32_t i = 0; i < 512; i++) {
        uint8_t b = (uint8_t)tu_next(r);
        row[i] = (b & 0x7fu) == 0x7fu ? (uint8_t)(b ^ 1u) : b;
    }
    for (uint32_t k = 0; k < 4; k++) {
        const float sc = (float)(0.002 + 0.01 * tu_uniform(r));
        memcpy(row + 512 + 4 * k, &sc, 4);
    }
    for (uint32_t i = 0; i < 64; i++) {
        const float v = (float)tu_normal(r);
        uint32_t x;
        memcpy(&x, &v, 4);
        const uint16_t h = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
        memcpy(row + 528 + 2 * i, &h, 2);
    }
}
