/* snapshot.c — one request's whole state to a buffer or a file and back (kvtier.h, "Snapshots";
 * byte layout in docs/snapshot-format.md).
 *
 * The format is a kvtier container (lib/container.c: file header, sections with a CRC-32 over
 * header and payload, END) of content kind 2 built in one caller buffer: META (model,
 * configuration, request, page-table counts), then per layer with KV a ROWS section (its pool
 * rows, read through the backend) and, when its policy has state, a STATE section (written by
 * the policy table's snap_save). Restore walks and checksums every section, compares META with
 * the context, checks every section's size against META, and only then builds the request:
 * pages, the policies' snap_load (each validates its own state in full), the rows written
 * through the backend, and kvt_seq_check over the whole. A failure anywhere destroys the
 * half-built request, which gives back every page and allocation: the context is as before. */
#define _GNU_SOURCE
#include "snapshot.h"

#include "container.h"
#include "replace.h"
#include "base/io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------- */
/* META                                                                                         */
/* ------------------------------------------------------------------------------------------- */
/* Fixed part: u32 version, n_layers, page_rows, n_groups, kv_head_offset, n_kv_heads_global,
 * layer_offset, budget_min_kept (0 without budget mode: the word was a reserved 0 before);
 * config: u32 ratio, block_rows, kappa, sink_rows, evict_budget_rows,
 * recent_rows, cadence_rows, flags (1 protect_prompt, 2 evict_archive, 4 evict_shared_draw,
 * 8 evict_vase, 16 salience_budget, 32 sigma_basis DCT, 64 evict_ratio_budget), u64 seed, u32 recall, selector; request: u64 request_id, n_tokens, prompt_rows,
 * u32 ratio, recall. Then per layer 14 u32 (the spec's 12 fields, policy, group as i32), per
 * group 3 u64 (n_rows, first_page, dropped_rows), u32 model type length and its bytes. */
#define META_FIXED (8 * 4 + 8 * 4 + 8 + 8 + 3 * 8 + 8)
#define META_LAYER (14 * 4)
#define META_GROUP (3 * 8)

typedef struct snap_meta {
    uint32_t version, n_layers, page_rows, n_groups;
    uint32_t kv_head_offset, n_kv_heads_global, layer_offset;
    kvt_config cfg; /* the context's */
    uint64_t request_id, n_tokens, prompt_rows;
    uint32_t seq_ratio, seq_recall;
    /* Pointers into the payload (not aligned): read with kvt__get_*. */
    const uint8_t *layers, *groups;
    const uint8_t *model_type;
    uint32_t model_type_len;
} snap_meta;

static uint64_t meta_bytes(const kvt_ctx *ctx) {
    const char *mt = kvt_model_type(ctx->model);
    return META_FIXED + (uint64_t)META_LAYER * ctx->n_layers + (uint64_t)META_GROUP * ctx->n_groups +
           4 + (mt ? strlen(mt) : 0);
}

static uint8_t *put32(uint8_t *p, uint32_t v) {
    kvt__put_u32(p, v);
    return p + 4;
}
static uint8_t *put64(uint8_t *p, uint64_t v) {
    kvt__put_u64(p, v);
    return p + 8;
}

static void spec_words(const kvt_layer_spec *sp, uint32_t w[12]) {
    const uint32_t v[12] = {(uint32_t)sp->kind,  (uint32_t)sp->dtype,        sp->n_kv_heads,
                            sp->n_planes,        sp->head_dim,               sp->value_dim,
                            sp->branch_dim,      sp->row_bytes,              sp->branch_offset,
                            (uint32_t)sp->branch_dtype, sp->sliding_window, sp->n_q_heads};
    memcpy(w, v, sizeof v);
}

static const char *const spec_names[12] = {
    "kind",       "dtype",      "n_kv_heads",    "n_planes",     "head_dim",       "value_dim",
    "branch_dim", "row_bytes",  "branch_offset", "branch_dtype", "sliding_window", "n_q_heads"};

static uint32_t cfg_flags(const kvt_config *c) {
    return (c->protect_prompt ? 1u : 0u) | (c->evict_archive ? 2u : 0u) |
           (c->evict_shared_draw ? 4u : 0u) | (c->evict_vase ? 8u : 0u) |
           (c->salience_budget ? 16u : 0u) | (c->sigma_basis == KVT_SIGMA_DCT ? 32u : 0u) |
           (c->evict_ratio_budget ? 64u : 0u);
}

static void meta_write(const kvt_seq *seq, uint8_t *p) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt_config *c = &ctx->cfg;
    p = put32(p, KVT__SNAP_VERSION);
    p = put32(p, ctx->n_layers);
    p = put32(p, ctx->page_rows);
    p = put32(p, ctx->n_groups);
    p = put32(p, ctx->kv_head_offset);
    p = put32(p, ctx->n_kv_heads_global);
    p = put32(p, ctx->layer_offset);
    p = put32(p, c->salience_budget ? c->budget_min_kept : 0); /* 0 without budget mode */
    const uint32_t cw[8] = {c->ratio,        c->block_rows,  c->kappa,     c->sink_rows,
                            c->evict_budget_rows, c->recent_rows, c->cadence_rows, cfg_flags(c)};
    for (int i = 0; i < 8; i++)
        p = put32(p, cw[i]);
    p = put64(p, c->seed);
    p = put32(p, (uint32_t)c->recall);
    p = put32(p, (uint32_t)c->selector);
    p = put64(p, seq->request_id);
    p = put64(p, seq->n_tokens);
    p = put64(p, seq->prompt_rows);
    p = put32(p, seq->cfg.ratio);
    p = put32(p, (uint32_t)seq->cfg.recall);
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        uint32_t w[12];
        spec_words(&ctx->stores[i].spec, w);
        for (int k = 0; k < 12; k++)
            p = put32(p, w[k]);
        p = put32(p, (uint32_t)ctx->policies[i]);
        p = put32(p, (uint32_t)ctx->stores[i].group);
    }
    for (uint32_t g = 0; g < ctx->n_groups; g++) {
        p = put64(p, seq->pt[g].n_rows);
        p = put64(p, seq->pt[g].first_page);
        p = put64(p, seq->pt[g].dropped_rows);
    }
    const char *mt = kvt_model_type(ctx->model);
    uint32_t n = mt ? (uint32_t)strlen(mt) : 0;
    p = put32(p, n);
    if (n)
        memcpy(p, mt, n);
}

/* Decode META's payload (sizes only: values are checked by whoever uses them). */
static kvt_status meta_read(const uint8_t *p, uint64_t n, snap_meta *m, char *err, size_t len) {
    memset(m, 0, sizeof *m);
    if (n < META_FIXED)
        return kvt__fail(err, len, KVT_ERR_PARSE, "META: %llu bytes, its fixed part needs %d",
                         (unsigned long long)n, META_FIXED);
    const uint8_t *q = p;
#define G32() (q += 4, kvt__get_u32(q - 4))
#define G64() (q += 8, kvt__get_u64(q - 8))
    m->version = G32();
    if (m->version != KVT__SNAP_VERSION)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "snapshot format version %u (this library reads version %u)", m->version,
                         KVT__SNAP_VERSION);
    m->n_layers = G32();
    m->page_rows = G32();
    m->n_groups = G32();
    m->kv_head_offset = G32();
    m->n_kv_heads_global = G32();
    m->layer_offset = G32();
    uint32_t min_kept = G32();
    kvt_config *c = &m->cfg;
    *c = kvt_config_default();
    c->ratio = G32();
    c->block_rows = G32();
    c->kappa = G32();
    c->sink_rows = G32();
    c->evict_budget_rows = G32();
    c->recent_rows = G32();
    c->cadence_rows = G32();
    uint32_t fl = G32();
    c->protect_prompt = fl & 1u;
    c->evict_archive = (fl & 2u) != 0;
    c->evict_shared_draw = (fl & 4u) != 0;
    c->evict_vase = (fl & 8u) != 0;
    c->salience_budget = (fl & 16u) != 0;
    c->sigma_basis = (fl & 32u) ? KVT_SIGMA_DCT : KVT_SIGMA_FOURIER;
    c->evict_ratio_budget = (fl & 64u) != 0;
    if (c->salience_budget)
        c->budget_min_kept = min_kept;
    c->seed = G64();
    c->recall = (kvt_recall_mode)G32();
    c->selector = (kvt_selector)G32();
    m->request_id = G64();
    m->n_tokens = G64();
    m->prompt_rows = G64();
    m->seq_ratio = G32();
    m->seq_recall = G32();
#undef G32
#undef G64
    if (fl & ~127u || (!(fl & 16u) && min_kept != 0))
        return kvt__fail(err, len, KVT_ERR_PARSE, "META: unknown configuration flags 0x%x", fl);
    if (m->n_groups > KVT__MAX_GROUPS)
        return kvt__fail(err, len, KVT_ERR_PARSE, "META: %u policy groups (at most %d)",
                         m->n_groups, KVT__MAX_GROUPS);
    uint64_t need = (uint64_t)META_LAYER * m->n_layers + (uint64_t)META_GROUP * m->n_groups + 4;
    if (n - META_FIXED < need)
        return kvt__fail(err, len, KVT_ERR_PARSE,
                         "META: %llu bytes for %u layers and %u groups", (unsigned long long)n,
                         m->n_layers, m->n_groups);
    m->layers = q;
    m->groups = q + (uint64_t)META_LAYER * m->n_layers;
    const uint8_t *t = m->groups + (uint64_t)META_GROUP * m->n_groups;
    m->model_type_len = kvt__get_u32(t);
    if (m->model_type_len != n - META_FIXED - need)
        return kvt__fail(err, len, KVT_ERR_PARSE, "META: model type of %u bytes in %llu left",
                         m->model_type_len, (unsigned long long)(n - META_FIXED - need));
    m->model_type = t + 4;
    return KVT_OK;
}

static void meta_spec(const snap_meta *m, uint32_t i, uint32_t w[12]) {
    for (int k = 0; k < 12; k++)
        w[k] = kvt__get_u32(m->layers + (size_t)i * META_LAYER + 4 * k);
}
static uint32_t meta_policy(const snap_meta *m, uint32_t i) {
    return kvt__get_u32(m->layers + (size_t)i * META_LAYER + 48);
}
static int32_t meta_group(const snap_meta *m, uint32_t i) {
    return (int32_t)kvt__get_u32(m->layers + (size_t)i * META_LAYER + 52);
}
static void meta_table(const snap_meta *m, uint32_t g, uint64_t *n_rows, uint64_t *first_page,
                       uint64_t *dropped) {
    const uint8_t *p = m->groups + (size_t)g * META_GROUP;
    *n_rows = kvt__get_u64(p);
    *first_page = kvt__get_u64(p + 8);
    *dropped = kvt__get_u64(p + 16);
}

/* The first difference between the snapshot's model and configuration and ctx's:
 * KVT_ERR_MISMATCH naming it. */
static kvt_status meta_compare(const kvt_ctx *ctx, const snap_meta *m) {
    const char *what = NULL;
    unsigned long long a = 0, b = 0;
#define DIFF(name, x, y)                                                                           \
    if (!what && (unsigned long long)(x) != (unsigned long long)(y)) {                            \
        what = name;                                                                               \
        a = (unsigned long long)(x);                                                               \
        b = (unsigned long long)(y);                                                               \
    }
    DIFF("number of layers", m->n_layers, ctx->n_layers);
    DIFF("page_rows", m->page_rows, ctx->page_rows);
    DIFF("kv_head_offset", m->kv_head_offset, ctx->kv_head_offset);
    DIFF("n_kv_heads_global", m->n_kv_heads_global, ctx->n_kv_heads_global);
    DIFF("layer_offset", m->layer_offset, ctx->layer_offset);
    const kvt_config *c = &ctx->cfg, *s = &m->cfg;
    DIFF("config.ratio", s->ratio, c->ratio);
    DIFF("config.block_rows", s->block_rows, c->block_rows);
    DIFF("config.kappa", s->kappa, c->kappa);
    DIFF("config.sink_rows", s->sink_rows, c->sink_rows);
    DIFF("config.evict_budget_rows", s->evict_budget_rows, c->evict_budget_rows);
    DIFF("config.recent_rows", s->recent_rows, c->recent_rows);
    DIFF("config.cadence_rows", s->cadence_rows, c->cadence_rows);
    DIFF("config.protect_prompt", s->protect_prompt, c->protect_prompt);
    DIFF("config.evict_archive", s->evict_archive, c->evict_archive);
    DIFF("config.evict_shared_draw", s->evict_shared_draw, c->evict_shared_draw);
    DIFF("config.evict_vase", s->evict_vase, c->evict_vase);
    DIFF("config.salience_budget", s->salience_budget, c->salience_budget);
    if (c->salience_budget)
        DIFF("config.budget_min_kept", s->budget_min_kept, c->budget_min_kept);
    DIFF("config.seed", s->seed, c->seed);
    DIFF("config.recall", s->recall, c->recall);
    DIFF("config.selector", s->selector, c->selector);
    DIFF("config.sigma_basis", s->sigma_basis, c->sigma_basis);
    DIFF("config.evict_ratio_budget", s->evict_ratio_budget, c->evict_ratio_budget);
    DIFF("number of policy groups", m->n_groups, ctx->n_groups);
    if (what)
        return kvt__ctx_fail(ctx, KVT_ERR_MISMATCH,
                             "snapshot %s is %llu, this context's is %llu", what, a, b);
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        uint32_t w[12], v[12];
        meta_spec(m, i, w);
        spec_words(&ctx->stores[i].spec, v);
        for (int k = 0; k < 12; k++)
            if (w[k] != v[k])
                return kvt__ctx_fail(ctx, KVT_ERR_MISMATCH,
                                     "snapshot layer %u has %s %u, this context's model has %u",
                                     i, spec_names[k], w[k], v[k]);
        if (meta_policy(m, i) != (uint32_t)ctx->policies[i] ||
            meta_group(m, i) != ctx->stores[i].group)
            return kvt__ctx_fail(ctx, KVT_ERR_MISMATCH,
                                 "snapshot layer %u is under policy %u (group %d), this "
                                 "context's under %s (group %d)",
                                 i, meta_policy(m, i), meta_group(m, i),
                                 kvt_policy_name(ctx->policies[i]), ctx->stores[i].group);
    }
#undef DIFF
    return KVT_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* Rows                                                                                         */
/* ------------------------------------------------------------------------------------------- */
/* ROWS payload: u32 layer, u32 n_planes, u64 first_row, u64 n_rows, then per plane the slots of
 * row indices [first_row, n_rows) of the group's table (n_kv_heads x row_bytes each). */
#define ROWS_HEAD 24
#define STATE_HEAD 8
/* RECALL: layer, n_heads, cap (W), margin (f32 bits), then the state and its samples; with
 * promotion (a request with config.recall_promote_capacity > 0), then u32 capacity, hits,
 * window, 0 and the promotion part (kvt__recall_promo and its tables). A section without that
 * tail (every file before promotion) restores with nothing promoted. */
#define RECALL_HEAD 16
#define PROMO_HEAD 16
/* Then, for a request with config.recall_lagged_query, the lagged query: u32 LAG_TAG ("LAGQ",
 * above any promotion capacity, so the parts cannot be confused), has, last_lagged, n, and n
 * floats (the kept queries; n = 0 when none is kept yet). */
#define LAG_HEAD 16
#define LAG_TAG 0x5147414cu

static uint64_t lag_section_bytes(const kvt__recall_layer *r) {
    return r->lag_q ? LAG_HEAD + (r->lag_has ? sizeof(float) * (uint64_t)r->lag_floats : 0) : 0;
}

static uint64_t recall_bytes(const kvt__recall_state *st) {
    return RECALL_HEAD + sizeof *st + sizeof(float) * (uint64_t)st->n_samples;
}

static uint64_t promo_section_bytes(const kvt__recall_layer *r) {
    return r->promo ? PROMO_HEAD + kvt__recall_promo_bytes(r) : 0;
}

/* Copy rows [first, end) of a layer's plane between host memory and the pool, a page's run of
 * consecutive slots per backend call: out of the pool (to_host) or into it. */
static kvt_status rows_copy(const kvt_ctx *ctx, const kvt__store *st, uint32_t plane,
                            const kvt__ptable *t, uint64_t first, uint64_t end, uint8_t *host,
                            bool to_host) {
    const kvt__backend *be = &ctx->backend;
    for (uint64_t r = first; r < end;) {
        uint64_t in_page = ctx->page_rows - r % ctx->page_rows;
        uint64_t n = end - r < in_page ? end - r : in_page;
        uint8_t *dev = st->plane[plane] + (size_t)kvt__slot(t, &ctx->pdiv, r) * st->slot_bytes;
        size_t bytes = (size_t)n * st->slot_bytes;
        kvt_status s = to_host ? be->ops->read(be, host, dev, bytes, NULL)
                               : be->ops->write(be, dev, host, bytes, NULL);
        if (s != KVT_OK)
            return kvt__ctx_fail(ctx, s, "layer %u plane %u: %s rows %llu..%llu", st->layer,
                                 plane, to_host ? "reading" : "writing", (unsigned long long)r,
                                 (unsigned long long)(r + n));
        host += bytes;
        r += n;
    }
    return KVT_OK;
}

static uint64_t rows_bytes(const kvt_ctx *ctx, const kvt__store *st, const kvt__ptable *t) {
    uint64_t first = kvt__ptable_first_row(t, ctx->page_rows);
    return ROWS_HEAD + (t->n_rows - first) * st->slot_bytes * st->spec.n_planes;
}

/* Layer i as its policy table's entries see it (seq_internal.h's kvt__seq_tier_layer builds the
 * same view). */
static kvt__tier_layer tier_layer(const kvt_seq *seq, uint32_t i) {
    const kvt_ctx *ctx = seq->ctx;
    const kvt__store *st = &ctx->stores[i];
    return (kvt__tier_layer){.cfg = &seq->cfg,
                             .page_rows = ctx->page_rows,
                             .pdiv = &ctx->pdiv,
                             .gr = &ctx->groups[st->group],
                             .st = st,
                             .pt = &seq->pt[st->group],
                             .state = kvt__seq_state(seq, i),
                             .appended = seq->n_tokens,
                             .prompt_rows = seq->prompt_rows};
}

/* ------------------------------------------------------------------------------------------- */
/* Snapshot                                                                                     */
/* ------------------------------------------------------------------------------------------- */
static kvt_status between_steps(const kvt_seq *seq) {
    if (kvt__seq_in_step(seq))
        return kvt__ctx_fail(seq->ctx, KVT_ERR_BAD_STATE,
                             "request %llu has a reservation open (%u tokens reserved, not "
                             "committed): snapshots are taken between steps",
                             (unsigned long long)seq->request_id, seq->n_pending);
    return kvt__seq_usable(seq);
}

static uint64_t snapshot_bytes(const kvt_seq *seq) {
    const kvt_ctx *ctx = seq->ctx;
    uint64_t n = KVT__CTR_HEADER_BYTES + kvt__ctr_mem_section_bytes(meta_bytes(ctx)) +
                 kvt__ctr_mem_section_bytes(0);
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        if (st->group < 0)
            continue;
        n += kvt__ctr_mem_section_bytes(rows_bytes(ctx, st, &seq->pt[st->group]));
        kvt__tier_layer l = tier_layer(seq, i);
        if (l.gr->ops->snap_size)
            n += kvt__ctr_mem_section_bytes(STATE_HEAD + l.gr->ops->snap_size(&l));
        kvt__recall_state rs;
        const kvt__recall_layer *rb = kvt__seq_recall_base(seq, i);
        if (rb && kvt__recall_layer_read(rb, &ctx->backend, &rs) == KVT_OK)
            n += kvt__ctr_mem_section_bytes(recall_bytes(&rs) + promo_section_bytes(rb) +
                                            lag_section_bytes(rb));
    }
    return n;
}

kvt_status kvt_seq_snapshot_size(const kvt_seq *seq, size_t *bytes) {
    if (!seq || !bytes)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(seq->ctx);
    kvt_status s = between_steps(seq);
    if (s != KVT_OK)
        return s;
    uint64_t n = snapshot_bytes(seq);
    if (n > SIZE_MAX)
        return kvt__ctx_fail(seq->ctx, KVT_ERR_CAPACITY, "snapshot of %llu bytes",
                             (unsigned long long)n);
    *bytes = (size_t)n;
    return KVT_OK;
}

kvt_status kvt_seq_snapshot(const kvt_seq *seq, void *buf, size_t capacity, size_t *written) {
    if (!seq || !buf)
        return KVT_ERR_INVALID_ARGUMENT;
    size_t need;
    kvt_status s = kvt_seq_snapshot_size(seq, &need);
    if (s != KVT_OK)
        return s;
    const kvt_ctx *ctx = seq->ctx;
    if (capacity < need)
        return kvt__ctx_fail(ctx, KVT_ERR_CAPACITY, "snapshot needs %zu bytes, capacity %zu",
                             need, capacity);
    uint8_t *p = buf, *w = p;
    kvt__ctr_mem_header(w, KVT__CTR_KIND_SNAPSHOT);
    w += KVT__CTR_HEADER_BYTES;
    meta_write(seq, w + KVT__CTR_SECTION_HEADER_BYTES);
    w += kvt__ctr_mem_seal(w, KVT__SNAP_SEC_META, KVT__CTR_FLAG_CRITICAL, meta_bytes(ctx));
    for (uint32_t i = 0; i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        if (st->group < 0)
            continue;
        const kvt__ptable *t = &seq->pt[st->group];
        uint64_t first = kvt__ptable_first_row(t, ctx->page_rows);
        uint8_t *q = w + KVT__CTR_SECTION_HEADER_BYTES;
        kvt__put_u32(q, i);
        kvt__put_u32(q + 4, st->spec.n_planes);
        kvt__put_u64(q + 8, first);
        kvt__put_u64(q + 16, t->n_rows);
        q += ROWS_HEAD;
        for (uint32_t pl = 0; pl < st->spec.n_planes; pl++) {
            s = rows_copy(ctx, st, pl, t, first, t->n_rows, q, true);
            if (s != KVT_OK)
                return s;
            q += (t->n_rows - first) * st->slot_bytes;
        }
        w += kvt__ctr_mem_seal(w, KVT__SNAP_SEC_ROWS, KVT__CTR_FLAG_CRITICAL,
                               rows_bytes(ctx, st, t));
        kvt__tier_layer l = tier_layer(seq, i);
        const kvt__policy_ops *ops = l.gr->ops;
        if (ops->snap_size) {
            uint64_t n = ops->snap_size(&l);
            q = w + KVT__CTR_SECTION_HEADER_BYTES;
            kvt__put_u32(q, i);
            kvt__put_u32(q + 4, (uint32_t)ctx->policies[i]);
            char msg[KVT__ERR_LEN];
            s = ops->snap_save(&l, q + STATE_HEAD, msg, sizeof msg);
            if (s != KVT_OK)
                return kvt__ctx_fail(ctx, s, "layer %u: %s", i, msg);
            w += kvt__ctr_mem_seal(w, KVT__SNAP_SEC_STATE, KVT__CTR_FLAG_CRITICAL,
                                   STATE_HEAD + n);
        }
        const kvt__recall_layer *r = kvt__seq_recall_base(seq, i);
        if (r) {
            kvt__recall_state rs;
            if ((s = kvt__recall_layer_read(r, &ctx->backend, &rs)) != KVT_OK)
                return kvt__ctx_fail(ctx, s, "layer %u: reading the recall state", i);
            q = w + KVT__CTR_SECTION_HEADER_BYTES;
            uint32_t margin;
            memcpy(&margin, &seq->cfg.recall_margin, 4);
            kvt__put_u32(q, i);
            kvt__put_u32(q + 4, r->n_heads);
            kvt__put_u32(q + 8, r->cap);
            kvt__put_u32(q + 12, margin);
            rs.n_grouped = 0; /* derived planes, not carried: a restore rebuilds them */
            memcpy(q + RECALL_HEAD, &rs, sizeof rs); /* little-endian host (snapshot.h) */
            if (rs.n_samples > r->sample_cap)
                return kvt__ctx_fail(ctx, KVT_ERR_INVARIANT, "layer %u: %u recall samples", i,
                                     rs.n_samples);
            if ((s = kvt__recall_layer_read_samples(r, &ctx->backend,
                                                    (float *)(void *)(q + RECALL_HEAD + sizeof rs),
                                                    rs.n_samples)) != KVT_OK)
                return kvt__ctx_fail(ctx, s, "layer %u: reading the recall samples", i);
            if (r->promo) {
                uint8_t *t = q + recall_bytes(&rs);
                kvt__put_u32(t, r->prom_cap);
                kvt__put_u32(t + 4, seq->cfg.recall_promote_hits);
                kvt__put_u32(t + 8, seq->cfg.recall_promote_window);
                kvt__put_u32(t + 12, 0);
                if ((s = kvt__recall_layer_read_promo(r, &ctx->backend, t + PROMO_HEAD)) != KVT_OK)
                    return kvt__ctx_fail(ctx, s, "layer %u: reading the recall promotion", i);
            }
            if (r->lag_q) {
                uint8_t *t = q + recall_bytes(&rs) + promo_section_bytes(r);
                kvt__put_u32(t, LAG_TAG);
                kvt__put_u32(t + 4, r->lag_has);
                kvt__put_u32(t + 8, r->last_lagged);
                kvt__put_u32(t + 12, r->lag_has ? r->lag_floats : 0);
                if (r->lag_has && (s = ctx->backend.ops->read(&ctx->backend, t + LAG_HEAD,
                                                              r->lag_q,
                                                              sizeof(float) * r->lag_floats,
                                                              NULL)) != KVT_OK)
                    return kvt__ctx_fail(ctx, s, "layer %u: reading the lagged query", i);
            }
            w += kvt__ctr_mem_seal(w, KVT__SNAP_SEC_RECALL, KVT__CTR_FLAG_CRITICAL,
                                   recall_bytes(&rs) + promo_section_bytes(r) +
                                       lag_section_bytes(r));
        }
    }
    w += kvt__ctr_mem_seal(w, KVT__CTR_SEC_END, 0, 0);
    KVT_ASSERT((size_t)(w - p) == need);
    if (written)
        *written = (size_t)(w - p);
    return KVT_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* Parsing                                                                                      */
/* ------------------------------------------------------------------------------------------- */
/* A parsed snapshot: META and, per model layer, its ROWS and STATE payloads. */
typedef struct snap_parsed {
    snap_meta meta;
    const uint8_t *buf;
    uint64_t len;
    kvt__ctr_section *rows, *state, *recall; /* [n_layers]; length 0 and offset 0: absent */
    uint32_t n_alloc;               /* entries allocated in each */
} snap_parsed;

static void parsed_free(snap_parsed *sp, const kvt__alloc *a) {
    kvt__free(a, sp->rows, sizeof *sp->rows * sp->n_alloc);
    kvt__free(a, sp->state, sizeof *sp->state * sp->n_alloc);
    kvt__free(a, sp->recall, sizeof *sp->recall * sp->n_alloc);
    sp->rows = sp->state = sp->recall = NULL;
}

/* Walk and checksum every section; decode META; file each layer's sections. a: where the
 * per-layer directories come from. Statuses: PARSE, CORRUPT, UNSUPPORTED, OUT_OF_MEMORY, with
 * the message in err. */
static kvt_status parse(const uint8_t *buf, uint64_t len, const kvt__alloc *a, snap_parsed *sp,
                        char *err, size_t elen) {
    memset(sp, 0, sizeof *sp);
    sp->buf = buf;
    sp->len = len;
    uint32_t minor;
    kvt_status s = kvt__ctr_mem_open(buf, len, KVT__CTR_KIND_SNAPSHOT, &minor, err, elen);
    if (s != KVT_OK)
        return s;
    uint64_t off = KVT__CTR_HEADER_BYTES;
    bool have_meta = false;
    for (size_t idx = 0;; idx++) {
        kvt__ctr_section sec;
        s = kvt__ctr_mem_next(buf, len, &off, idx, &sec, err, elen);
        if (s != KVT_OK)
            break;
        if (sec.type == KVT__CTR_SEC_END) {
            if (!have_meta)
                s = kvt__fail(err, elen, KVT_ERR_PARSE, "no META section");
            break;
        }
        if (idx == 0 && sec.type != KVT__SNAP_SEC_META) {
            s = kvt__fail(err, elen, KVT_ERR_PARSE, "first section is type %u, not META",
                          sec.type);
            break;
        }
        if (sec.type == KVT__SNAP_SEC_META) {
            if (have_meta) {
                s = kvt__fail(err, elen, KVT_ERR_PARSE, "a second META section (section %zu)",
                              idx);
                break;
            }
            have_meta = true;
            s = meta_read(buf + sec.offset, sec.length, &sp->meta, err, elen);
            if (s != KVT_OK)
                break;
            /* Every layer needs META_LAYER bytes of META, so the count is bounded by len. */
            sp->n_alloc = sp->meta.n_layers ? sp->meta.n_layers : 1;
            sp->rows = kvt__calloc(a, sizeof *sp->rows * sp->n_alloc);
            sp->state = kvt__calloc(a, sizeof *sp->state * sp->n_alloc);
            sp->recall = kvt__calloc(a, sizeof *sp->recall * sp->n_alloc);
            if (!sp->rows || !sp->state || !sp->recall) {
                s = kvt__fail(err, elen, KVT_ERR_OUT_OF_MEMORY, "section directory");
                break;
            }
            continue;
        }
        if (sec.type == KVT__SNAP_SEC_ROWS || sec.type == KVT__SNAP_SEC_STATE ||
            sec.type == KVT__SNAP_SEC_RECALL) {
            if (sec.length < 8) {
                s = kvt__fail(err, elen, KVT_ERR_PARSE, "section %zu (type %u): %llu bytes", idx,
                              sec.type, (unsigned long long)sec.length);
                break;
            }
            uint32_t layer = kvt__get_u32(buf + sec.offset);
            kvt__ctr_section *dir = sec.type == KVT__SNAP_SEC_ROWS    ? sp->rows
                                    : sec.type == KVT__SNAP_SEC_STATE ? sp->state
                                                                      : sp->recall;
            if (layer >= sp->meta.n_layers || dir[layer].length != 0) {
                s = kvt__fail(err, elen, KVT_ERR_PARSE,
                              "section %zu (type %u) names layer %u: out of range or repeated",
                              idx, sec.type, layer);
                break;
            }
            dir[layer] = sec;
            continue;
        }
        if (sec.flags & KVT__CTR_FLAG_CRITICAL) {
            s = kvt__fail(err, elen, KVT_ERR_UNSUPPORTED,
                          "section %zu has type %u, unknown to this reader and marked critical",
                          idx, sec.type);
            break;
        }
    }
    if (s != KVT_OK)
        parsed_free(sp, a);
    return s;
}

/* The page-table counts and section sizes of a parsed snapshot, against the layers' specs and
 * policies (rows, stores and policies of the context, or of the snapshot's own for
 * kvt_snapshot_context, whose stores are NULL: sizes are then checked from META alone). */
static kvt_status check_layout(const snap_parsed *sp, uint32_t window_of[KVT__MAX_GROUPS],
                               const bool positional[KVT__MAX_GROUPS], char *err, size_t elen) {
    const snap_meta *m = &sp->meta;
    if (m->page_rows == 0)
        return kvt__fail(err, elen, KVT_ERR_PARSE, "META: page_rows 0");
    for (uint32_t g = 0; g < m->n_groups; g++) {
        uint64_t n_rows, fp, dropped;
        meta_table(m, g, &n_rows, &fp, &dropped);
        uint32_t W = window_of[g];
        uint64_t want_fp = W && n_rows > W ? (n_rows - W) / m->page_rows : 0;
        if (n_rows > m->n_tokens || (positional[g] && n_rows != m->n_tokens) ||
            n_rows > INT32_MAX)
            return kvt__fail(err, elen, KVT_ERR_CORRUPT,
                             "group %u holds %llu rows for %llu tokens", g,
                             (unsigned long long)n_rows, (unsigned long long)m->n_tokens);
        if (fp != want_fp || dropped != fp * m->page_rows)
            return kvt__fail(err, elen, KVT_ERR_CORRUPT,
                             "group %u: %llu leading pages returned (%llu rows) where its window "
                             "of %u rows in %llu gives %llu",
                             g, (unsigned long long)fp, (unsigned long long)dropped, W,
                             (unsigned long long)n_rows, (unsigned long long)want_fp);
    }
    /* Every group holds a layer, so every table's rows are bounded by a ROWS section's bytes. */
    for (uint32_t g = 0; g < m->n_groups; g++) {
        uint32_t i = 0;
        while (i < m->n_layers && meta_group(m, i) != (int32_t)g)
            i++;
        if (i == m->n_layers)
            return kvt__fail(err, elen, KVT_ERR_PARSE, "group %u has no layer", g);
    }
    for (uint32_t i = 0; i < m->n_layers; i++) {
        int32_t g = meta_group(m, i);
        const kvt__ctr_section *rs = &sp->rows[i];
        if (g < 0) {
            if (rs->length || sp->state[i].length)
                return kvt__fail(err, elen, KVT_ERR_PARSE, "layer %u has no KV but has rows", i);
            continue;
        }
        if ((uint32_t)g >= m->n_groups)
            return kvt__fail(err, elen, KVT_ERR_PARSE, "layer %u in group %d of %u", i, g,
                             m->n_groups);
        uint32_t w[12];
        meta_spec(m, i, w);
        uint64_t n_rows, fp, dropped;
        meta_table(m, (uint32_t)g, &n_rows, &fp, &dropped);
        uint64_t slot = (uint64_t)w[2] * w[7], planes = w[3]; /* n_kv_heads x row_bytes */
        uint64_t first = fp * m->page_rows;
        const uint8_t *h = sp->buf + rs->offset;
        /* planes <= 2, slot <= 2^30 and rows < 2^31: the product fits in 64 bits. */
        if (planes > 2 || slot > (1u << 30) || rs->length < ROWS_HEAD ||
            kvt__get_u32(h + 4) != planes || kvt__get_u64(h + 8) != first ||
            kvt__get_u64(h + 16) != n_rows ||
            rs->length - ROWS_HEAD != (n_rows - first) * slot * planes)
            return kvt__fail(err, elen, KVT_ERR_PARSE,
                             "layer %u: ROWS section of %llu bytes does not hold %u planes of "
                             "rows [%llu, %llu) of %llu bytes",
                             i, (unsigned long long)rs->length, w[3], (unsigned long long)first,
                             (unsigned long long)n_rows, (unsigned long long)slot);
        const kvt__ctr_section *ss = &sp->state[i];
        if (ss->length && (ss->length < STATE_HEAD ||
                           kvt__get_u32(sp->buf + ss->offset + 4) != meta_policy(m, i)))
            return kvt__fail(err, elen, KVT_ERR_PARSE,
                             "layer %u: STATE section not of the layer's policy", i);
    }
    return KVT_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* Restore                                                                                      */
/* ------------------------------------------------------------------------------------------- */
/* Build the request from a parsed, compared snapshot. On failure *seq is destroyed. */
/* A layer's RECALL section into the restored request: present exactly when the request recalls
 * on the layer, of the buffer's shape and the context's margin, a state that passes its check. */
static kvt_status recall_load(kvt_ctx *ctx, kvt_seq *seq, uint32_t i, const kvt__ctr_section *rs,
                              const uint8_t *buf) {
    kvt__recall_layer *r = kvt__seq_recall_base(seq, i); /* salience or RoPE */
    if (!r != !rs->length)
        return kvt__ctx_fail(ctx, KVT_ERR_PARSE, "layer %u: RECALL section %s", i,
                             r ? "missing for a request with recall"
                               : "for a layer or request without recall");
    if (!r)
        return KVT_OK;
    kvt__recall_state st;
    if (rs->length < RECALL_HEAD + sizeof st)
        return kvt__ctx_fail(ctx, KVT_ERR_PARSE, "layer %u: RECALL section of %llu bytes", i,
                             (unsigned long long)rs->length);
    const uint8_t *p = buf + rs->offset;
    uint32_t heads = kvt__get_u32(p + 4), cap = kvt__get_u32(p + 8), mbits = kvt__get_u32(p + 12);
    float margin;
    memcpy(&margin, &mbits, 4);
    uint32_t want_bits;
    memcpy(&want_bits, &seq->cfg.recall_margin, 4);
    if (heads != r->n_heads || cap != r->cap || mbits != want_bits)
        return kvt__ctx_fail(ctx, KVT_ERR_MISMATCH,
                             "layer %u: the snapshot recalls with %u heads, W %u, margin %g; this "
                             "context with %u, %u, %g",
                             i, heads, cap, (double)margin, r->n_heads, r->cap,
                             (double)seq->cfg.recall_margin);
    memcpy(&st, p + RECALL_HEAD, sizeof st);
    st.n_grouped = 0; /* derived planes: the restored request builds its groups anew */
    /* the lagged query's part, last: present exactly when this context scans lagged */
    uint64_t len = rs->length;
    const uint8_t *pl = NULL;
    uint32_t lag_n = 0;
    /* it follows the samples, or the promotion part when there is one */
    const uint64_t lag_at[2] = {recall_bytes(&st), recall_bytes(&st) + promo_section_bytes(r)};
    for (int k = 0; k < 2 && !pl; k++) {
        const uint64_t at = lag_at[k];
        if (at + LAG_HEAD > len || kvt__get_u32(p + at) != LAG_TAG)
            continue;
        lag_n = kvt__get_u32(p + at + 12);
        if (at + LAG_HEAD + sizeof(float) * (uint64_t)lag_n == len) {
            pl = p + at;
            len = at;
        }
    }
    if (!pl != !r->lag_q)
        return kvt__ctx_fail(ctx, KVT_ERR_MISMATCH,
                             "layer %u: the snapshot %s with the previous step's query; this "
                             "context %s (config.recall_lagged_query)",
                             i, pl ? "scans" : "does not scan", r->lag_q ? "does" : "does not");
    if (pl && (kvt__get_u32(pl + 4) > 1 || kvt__get_u32(pl + 8) > 1 ||
               lag_n != (kvt__get_u32(pl + 4) ? r->lag_floats : 0u)))
        return kvt__ctx_fail(ctx, KVT_ERR_PARSE,
                             "layer %u: a lagged query of %u floats (has %u, lagged %u) for "
                             "queries of %u",
                             i, lag_n, kvt__get_u32(pl + 4), kvt__get_u32(pl + 8), r->lag_floats);
    const bool promo_tail = len > recall_bytes(&st);
    if ((len != recall_bytes(&st) &&
         (!r->promo || len != recall_bytes(&st) + promo_section_bytes(r))) ||
        st.n_samples > r->sample_cap)
        return kvt__ctx_fail(ctx, KVT_ERR_PARSE,
                             "layer %u: RECALL section of %llu bytes for %u samples%s", i,
                             (unsigned long long)rs->length, st.n_samples,
                             r->promo ? "" : " (a promotion part for a request without one?)");
    const uint8_t *pt = p + recall_bytes(&st);
    if (promo_tail && (kvt__get_u32(pt) != r->prom_cap ||
                       kvt__get_u32(pt + 4) != seq->cfg.recall_promote_hits ||
                       kvt__get_u32(pt + 8) != seq->cfg.recall_promote_window ||
                       kvt__get_u32(pt + 12) != 0))
        return kvt__ctx_fail(ctx, KVT_ERR_MISMATCH,
                             "layer %u: the snapshot promotes %u rows, %u hits of %u steps; this "
                             "context %u, %u of %u",
                             i, kvt__get_u32(pt), kvt__get_u32(pt + 4), kvt__get_u32(pt + 8),
                             r->prom_cap, seq->cfg.recall_promote_hits,
                             seq->cfg.recall_promote_window);
    const float *smp = (const float *)(const void *)(p + RECALL_HEAD + sizeof st);
    char msg[KVT__ERR_LEN];
    kvt_status s = kvt__recall_state_check(r, &st, smp, msg, sizeof msg);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, KVT_ERR_CORRUPT, "layer %u: %s", i, msg);
    if ((s = kvt__recall_layer_load(r, &ctx->backend, &st, smp)) != KVT_OK ||
        (s = kvt__recall_layer_load_promo(r, &ctx->backend,
                                          promo_tail ? pt + PROMO_HEAD : NULL)) != KVT_OK ||
        (s = kvt__recall_layer_lag_load(
             r, &ctx->backend, pl && kvt__get_u32(pl + 4), pl && kvt__get_u32(pl + 8),
             pl ? (const float *)(const void *)(pl + LAG_HEAD) : NULL)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "layer %u: writing the recall state", i);
    return KVT_OK;
}

static kvt_status build(kvt_ctx *ctx, const snap_parsed *sp, kvt_seq **out) {
    const snap_meta *m = &sp->meta;
    /* Before kvt_seq_create, whose KVT_ERR_INVALID_ARGUMENT reads as a damaged snapshot below. */
    if (kvt__ctx_live_request(ctx, m->request_id))
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "snapshot: request %llu is already live in this context: destroy "
                             "it first (preemption) or restore into another context",
                             (unsigned long long)m->request_id);
    kvt_seq_params p = kvt_seq_default_params();
    p.request_id = m->request_id;
    p.prompt_rows = m->prompt_rows;
    p.ratio = m->seq_ratio;
    p.recall = (int32_t)m->seq_recall;
    kvt_seq *seq;
    kvt_status s = kvt_seq_create(ctx, &p, &seq);
    if (s == KVT_ERR_INVALID_ARGUMENT) { /* the request's ratio or recall mode */
        char msg[KVT__ERR_LEN]; /* the thread's buffer is also the output: copy it first */
        snprintf(msg, sizeof msg, "%s", kvt_last_error());
        return kvt__ctx_fail(ctx, KVT_ERR_CORRUPT, "snapshot: request parameters: %s", msg);
    }
    if (s != KVT_OK)
        return s;
    seq->n_tokens = m->n_tokens;
    /* config.evict_ratio_budget: K as the request's next reservation would see it before its
     * tokens (the last round's K is its state's last_kept - r; the next reserve recomputes) */
    if (seq->cfg.evict_ratio_budget)
        seq->cfg.evict_budget_rows =
            kvt__ev_ratio_budget(&seq->cfg, seq->n_tokens, seq->prompt_rows);
    for (uint32_t g = 0; g < ctx->n_groups && s == KVT_OK; g++) {
        kvt__ptable *t = &seq->pt[g];
        meta_table(m, g, &t->n_rows, &t->first_page, &t->dropped_rows);
        s = kvt__ptable_reserve(t, &ctx->groups[g].pool, &ctx->alloc, 0);
        /* The table's mirror in the backend's memory (the ops read it; synced at the step). */
        if (s == KVT_OK)
            s = kvt__ptable_mirror_reserve(t, &ctx->backend, t->n_pages);
        if (s == KVT_ERR_POOL_EXHAUSTED)
            s = kvt__ctx_fail(ctx, s, "group %u (%s): %u free pages, the snapshot holds %llu", g,
                              kvt_policy_name(ctx->groups[g].policy), ctx->groups[g].pool.n_free,
                              (unsigned long long)kvt__ptable_pages_for(t, t->n_rows,
                                                                        ctx->page_rows));
        else if (s != KVT_OK)
            s = kvt__ctx_fail(ctx, s, "group %u: page table", g);
    }
    kvt__env env = kvt__ctx_env(ctx, seq, NULL);
    char why[KVT__ERR_LEN] = "";
    env.err = why;
    env.err_len = sizeof why;
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++) {
        const kvt__store *st = &ctx->stores[i];
        if (st->group < 0)
            continue;
        kvt__tier_layer l = tier_layer(seq, i);
        const kvt__policy_ops *ops = l.gr->ops;
        const kvt__ctr_section *ss = &sp->state[i];
        if (!ops->snap_load != !ss->length) {
            s = kvt__ctx_fail(ctx, KVT_ERR_PARSE, "layer %u: STATE section %s", i,
                              ops->snap_load ? "missing" : "for a policy without state");
            break;
        }
        if (ops->snap_load &&
            (s = ops->snap_load(kvt__seq_state(seq, i), &env, &l, sp->buf + ss->offset + STATE_HEAD,
                                ss->length - STATE_HEAD)) != KVT_OK)
            s = kvt__ctx_fail(ctx, s, "layer %u: %s", i, why);
        if (s == KVT_OK)
            s = recall_load(ctx, seq, i, &sp->recall[i], sp->buf);
        const uint8_t *src = sp->buf + sp->rows[i].offset + ROWS_HEAD;
        const kvt__ptable *t = &seq->pt[st->group];
        uint64_t first = kvt__ptable_first_row(t, ctx->page_rows);
        for (uint32_t pl = 0; s == KVT_OK && pl < st->spec.n_planes; pl++) {
            s = rows_copy(ctx, st, pl, t, first, t->n_rows, (uint8_t *)(uintptr_t)src, false);
            src += (t->n_rows - first) * st->slot_bytes;
        }
    }
    if (s == KVT_OK && (s = kvt_seq_check(seq)) != KVT_OK) {
        char msg[KVT__ERR_LEN];
        snprintf(msg, sizeof msg, "%s", kvt_last_error());
        s = kvt__ctx_fail(ctx, s == KVT_ERR_INVARIANT ? KVT_ERR_CORRUPT : s,
                          "restored state fails its check: %s", msg);
    }
    if (s != KVT_OK) {
        char msg[KVT__ERR_LEN];
        snprintf(msg, sizeof msg, "%s", kvt_last_error());
        kvt__seq_end(seq); /* in no batch yet */
        kvt__ctx_fail(ctx, s, "%s", msg);
        return s;
    }
    ctx->started = true; /* pages taken: storage can no longer be rebound (as after a reserve) */
    *out = seq;
    return KVT_OK;
}

/* Windows and positional flags of ctx's groups, as check_layout takes them. */
static void ctx_groups(const kvt_ctx *ctx, uint32_t W[KVT__MAX_GROUPS],
                       bool pos[KVT__MAX_GROUPS]) {
    for (uint32_t g = 0; g < KVT__MAX_GROUPS; g++) {
        W[g] = g < ctx->n_groups ? ctx->groups[g].window_rows : 0;
        pos[g] = g < ctx->n_groups && ctx->groups[g].ops->rows_are_positions;
    }
}

kvt_status kvt_seq_restore(kvt_ctx *ctx, const void *buf, size_t len, kvt_seq **out) {
    if (out)
        *out = NULL;
    if (!ctx || !out || (!buf && len))
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(ctx);
    snap_parsed sp;
    char err[KVT__ERR_LEN];
    kvt_status s = parse(buf, len, &ctx->alloc, &sp, err, sizeof err);
    if (s != KVT_OK)
        return kvt__ctx_fail(ctx, s, "snapshot: %s", err);
    s = meta_compare(ctx, &sp.meta);
    if (s == KVT_OK) {
        uint32_t W[KVT__MAX_GROUPS];
        bool pos[KVT__MAX_GROUPS];
        ctx_groups(ctx, W, pos);
        if ((s = check_layout(&sp, W, pos, err, sizeof err)) != KVT_OK)
            kvt__ctx_fail(ctx, s, "snapshot: %s", err);
    }
    if (s == KVT_OK && ctx->max_rows && sp.meta.n_tokens > ctx->max_rows)
        s = kvt__ctx_fail(ctx, KVT_ERR_CAPACITY,
                          "snapshot holds %llu tokens, the context's max_rows_per_seq is %u",
                          (unsigned long long)sp.meta.n_tokens, ctx->max_rows);
    for (uint32_t i = 0; s == KVT_OK && i < ctx->n_layers; i++)
        for (uint32_t p = 0; ctx->stores[i].group >= 0 && p < ctx->stores[i].spec.n_planes; p++)
            if (!ctx->stores[i].plane[p]) {
                s = kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                                  "layer %u plane %u: external storage not bound", i, p);
                break;
            }
    if (s == KVT_OK)
        s = build(ctx, &sp, out);
    parsed_free(&sp, &ctx->alloc);
    return s;
}

kvt_status kvt_snapshot_context(const void *buf, size_t len, kvt_backend_kind backend,
                                kvt_ctx **out) {
    if (out)
        *out = NULL;
    if (!out || (!buf && len))
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__tls_clear();
    kvt__alloc a;
    kvt_status s = kvt__alloc_init(&a, KVT_ALLOC_LIBC);
    if (s != KVT_OK)
        return s;
    snap_parsed sp;
    char err[KVT__ERR_LEN];
    s = parse(buf, len, &a, &sp, err, sizeof err);
    if (s != KVT_OK) {
        kvt__alloc_fini(&a);
        return kvt__fail(kvt__tls_error(), KVT__ERR_LEN, s, "snapshot: %s", err);
    }
    const snap_meta *m = &sp.meta;
    kvt_layer_spec *specs = kvt__mem_calloc(m->n_layers ? m->n_layers : 1, sizeof *specs);
    kvt_policy *pol = kvt__mem_calloc(m->n_layers ? m->n_layers : 1, sizeof *pol);
    char *type = kvt__mem_calloc(1, (size_t)m->model_type_len + 1);
    kvt_model *model = NULL;
    uint32_t W[KVT__MAX_GROUPS] = {0}, pages[KVT__MAX_GROUPS] = {0};
    bool positional[KVT__MAX_GROUPS] = {0};
    if (!specs || !pol || !type)
        s = kvt__fail(err, sizeof err, KVT_ERR_OUT_OF_MEMORY, "layer specs");
    for (uint32_t i = 0; s == KVT_OK && i < m->n_layers; i++) {
        uint32_t w[12];
        meta_spec(m, i, w);
        specs[i] = (kvt_layer_spec){.kind = (kvt_layer_kind)w[0],
                                    .dtype = (kvt_dtype)w[1],
                                    .n_kv_heads = w[2],
                                    .n_planes = w[3],
                                    .head_dim = w[4],
                                    .value_dim = w[5],
                                    .branch_dim = w[6],
                                    .row_bytes = w[7],
                                    .branch_offset = w[8],
                                    .branch_dtype = (kvt_dtype)w[9],
                                    .sliding_window = w[10],
                                    .n_q_heads = w[11]};
        pol[i] = (kvt_policy)meta_policy(m, i);
        int32_t g = meta_group(m, i);
        const kvt__policy_ops *t = kvt__policy_table(pol[i]); /* NULL: refused at creation */
        uint32_t win;
        if (g >= 0 && (uint32_t)g < KVT__MAX_GROUPS) {
            /* The window a group keeps: its widest (tiers/sliding.c), where its layers read
             * windows (policy.h layer_window); other groups never return leading pages. */
            if (t && t->layer_window && t->layer_window(&specs[i], &win) && win > W[g])
                W[g] = win;
            positional[g] = !t || t->rows_are_positions;
        }
    }
    /* A group with a layer that reads every row keeps every row (no window). */
    for (uint32_t i = 0; s == KVT_OK && i < m->n_layers; i++) {
        int32_t g = meta_group(m, i);
        const kvt__policy_ops *t = kvt__policy_table(pol[i]);
        uint32_t win;
        if (g >= 0 && (uint32_t)g < KVT__MAX_GROUPS && t && t->layer_window &&
            !t->layer_window(&specs[i], &win))
            W[g] = 0;
    }
    if (s == KVT_OK)
        s = check_layout(&sp, W, positional, err, sizeof err);
    if (s == KVT_OK) {
        memcpy(type, m->model_type, m->model_type_len);
        s = kvt_model_create(specs, m->n_layers, type, &model, err, sizeof err);
    }
    for (uint32_t g = 0; s == KVT_OK && g < m->n_groups; g++) {
        uint64_t n_rows, fp, dropped;
        meta_table(m, g, &n_rows, &fp, &dropped);
        uint64_t total = (n_rows + m->page_rows - 1) / m->page_rows;
        pages[g] = (uint32_t)(total - fp);
    }
    if (s == KVT_OK) {
        kvt_ctx_params p = kvt_ctx_default_params();
        p.model = model;
        kvt_config cfg = m->cfg;
        /* What META does not carry, from a RECALL section: W, margin, promotion (its tail). */
        for (uint32_t i = 0; i < m->n_layers; i++) {
            const kvt__ctr_section *rs = &sp.recall[i];
            if (rs->length < RECALL_HEAD + sizeof(kvt__recall_state))
                continue;
            const uint8_t *q = sp.buf + rs->offset;
            kvt__recall_state st;
            memcpy(&st, q + RECALL_HEAD, sizeof st);
            cfg.recall_cap_rows = kvt__get_u32(q + 8);
            uint32_t mb = kvt__get_u32(q + 12);
            memcpy(&cfg.recall_margin, &mb, 4);
            uint64_t at = recall_bytes(&st); /* the promotion part, then the lagged query */
            if (rs->length >= at + PROMO_HEAD && kvt__get_u32(q + at) != LAG_TAG)
                at += PROMO_HEAD + kvt__recall_promo_bytes_for(kvt__get_u32(q + at));
            if (rs->length >= at + LAG_HEAD && kvt__get_u32(q + at) == LAG_TAG)
                cfg.recall_lagged_query = true;
            if (rs->length >= recall_bytes(&st) + PROMO_HEAD &&
                kvt__get_u32(q + recall_bytes(&st)) != LAG_TAG) {
                const uint8_t *t = q + recall_bytes(&st);
                cfg.recall_promote_capacity = kvt__get_u32(t);
                cfg.recall_promote_hits = kvt__get_u32(t + 4);
                cfg.recall_promote_window = kvt__get_u32(t + 8);
            }
        }
        p.config = &cfg;
        p.page_rows = m->page_rows;
        p.n_pages = 1;
        for (uint32_t g = 0; g < m->n_groups; g++)
            p.n_pages = pages[g] > p.n_pages ? pages[g] : p.n_pages;
        p.backend = backend;
        p.allocator = KVT_ALLOC_LIBC;
        p.layer_policies = pol;
        p.kv_head_offset = m->kv_head_offset;
        p.n_kv_heads_global = m->n_kv_heads_global;
        p.layer_offset = m->layer_offset;
        /* Sketch planes: a policy's STATE may name the sketch stride it was saved with (the
         * table's snap_sketch_stride; salience: docs/snapshot-format.md); a context for the
         * snapshot needs the widest (a layer basis, if any, is the engine's to set before
         * restoring: restore names it when it differs). */
        for (uint32_t i = 0; i < m->n_layers; i++) {
            const kvt__ctr_section *ss = &sp.state[i];
            const kvt__policy_ops *t = kvt__policy_table(pol[i]);
            if (t && t->snap_sketch_stride && ss->length >= STATE_HEAD) {
                uint64_t stride = t->snap_sketch_stride(sp.buf + ss->offset + STATE_HEAD,
                                                        ss->length - STATE_HEAD);
                /* 2^32 + r: fp16 width r with the 8-bit scan's planes after it */
                if (stride >> 32 == 1u) {
                    stride &= 0xffffffffu;
                    p.recall_scan_bits = 8;
                }
                if (stride <= KVT_RECALL_MAX_RANK && stride > p.recall_sketch_rank)
                    p.recall_sketch_rank = (uint32_t)stride;
            }
        }
        /* Pools out of proportion to the snapshot (at least one page of the snapshot's page size
         * per group: a page far larger than the rows it holds, rows far wider than a model's)
         * are refused before any allocation: a tool inspecting a damaged file must not take
         * gigabytes for it. */
        uint64_t pool = 0;
        for (uint32_t i = 0; i < m->n_layers; i++) {
            const kvt_layer_spec *sp_i = kvt_model_layer(model, i);
            if (sp_i->kind != KVT_LAYER_NO_KV)
                pool += (uint64_t)sp_i->n_planes * sp_i->n_kv_heads * sp_i->row_bytes *
                        p.page_rows * p.n_pages;
        }
        const uint64_t cap = 8ull * len + (256ull << 20);
        if (pool > cap) {
            s = KVT_ERR_OUT_OF_MEMORY;
            snprintf(err, sizeof err,
                     "its context's pools would take %llu bytes, more than 8 x its %zu bytes + "
                     "256 MiB (%u pages of %u rows)",
                     (unsigned long long)pool, len, p.n_pages, p.page_rows);
        } else {
            s = kvt_ctx_create(&p, out, err, sizeof err);
        }
    }
    if (s != KVT_OK)
        kvt__fail(kvt__tls_error(), KVT__ERR_LEN, s, "snapshot: %s", err);
    kvt_model_destroy(model);
    kvt__mem_free(specs);
    kvt__mem_free(pol);
    kvt__mem_free(type);
    parsed_free(&sp, &a);
    kvt__alloc_fini(&a);
    return s;
}

/* ------------------------------------------------------------------------------------------- */
/* Files                                                                                        */
/* ------------------------------------------------------------------------------------------- */
/* The snapshot is built in memory first (kvt_seq_snapshot), then replaces the file atomically
 * (lib/replace.c: a locked temporary next to path, fsync'ed, renamed over path, the directory
 * fsync'ed; the stale temporaries of the same name removed first): a crash at any point leaves
 * either the old file or the new one, never a torn one. */
kvt_status kvt_seq_snapshot_file(const kvt_seq *seq, const char *path) {
    if (!seq || !path || !*path)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_ctx *ctx = seq->ctx;
    size_t n;
    kvt_status s = kvt_seq_snapshot_size(seq, &n);
    if (s != KVT_OK)
        return s;
    uint8_t *buf = kvt__malloc(&ctx->alloc, n ? n : 1);
    if (!buf)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "snapshot of %zu bytes", n);
    if ((s = kvt_seq_snapshot(seq, buf, n, &n)) == KVT_OK) {
        char err[KVT__ERR_LEN];
        s = kvt__replace_file(path, buf, n, err, sizeof err);
        if (s != KVT_OK)
            kvt__ctx_fail(ctx, s, "snapshot: %s", err);
    }
    kvt__free(&ctx->alloc, buf, n ? n : 1);
    return s;
}

kvt_status kvt_snapshot_clean(const char *dir, uint32_t min_age_s, uint32_t *n_removed) {
    if (n_removed)
        *n_removed = 0;
    if (!dir || !*dir)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "kvt_snapshot_clean: no directory");
    kvt__tls_clear();
    char err[KVT__ERR_LEN];
    kvt_status s = kvt__clean_stale(dir, NULL, min_age_s, n_removed, err, sizeof err);
    if (s != KVT_OK)
        kvt__tls_fail(s, "kvt_snapshot_clean: %s", err);
    return s;
}

kvt_status kvt_seq_restore_file(kvt_ctx *ctx, const char *path, kvt_seq **out) {
    if (out)
        *out = NULL;
    if (!ctx || !path || !out)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(ctx);
    int fd = kvt__io_open(path, O_RDONLY, 0);
    struct stat st;
    const char *why = NULL;
    if (fd < 0 || kvt__io_fstat(fd, &st) != 0)
        why = strerror(errno);
    else if (!S_ISREG(st.st_mode))
        why = "not a regular file";
    if (why) {
        kvt_status s = kvt__ctx_fail(ctx, KVT_ERR_IO, "snapshot: cannot read %s: %s", path, why);
        if (fd >= 0)
            kvt__io_close(fd);
        return s;
    }
    size_t n = (size_t)st.st_size;
    uint8_t *buf = kvt__malloc(&ctx->alloc, n ? n : 1);
    kvt_status s = KVT_OK;
    int rc = 0;
    if (!buf)
        s = kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "snapshot: %zu bytes for %s", n, path);
    else if ((rc = kvt__io_pread_all(fd, buf, n, 0)) != 0)
        s = kvt__ctx_fail(ctx, KVT_ERR_IO, "snapshot: reading %s: %s", path,
                          rc > 0 ? "file shrank while read" : strerror(errno));
    kvt__io_close(fd); /* read-only: a failed close loses nothing */
    if (s == KVT_OK)
        s = kvt_seq_restore(ctx, buf, n, out);
    kvt__free(&ctx->alloc, buf, n ? n : 1);
    return s;
}
