/*
 * trace.c — kvtier trace files: writer (streaming) and reader (directory + on-demand reads).
 *
 * Sections of a trace (payload layouts byte by byte in docs/trace-format.md section 2):
 *   META (1)     prompt_rows, n_model_layers                          first section, once
 *   TEXT (2)     provenance text                                      optional, once
 *   LAYER (3)    model layer index + kvt_layer_spec, field by field   once per traced layer
 *   ROWS (4)     a chunk of one plane of one layer                    any number
 *   QUERIES (5)  a chunk of query steps of one layer                  any number
 *   NEEDLES (6)  needle list                                          optional, once
 *   TARGETS (7)  target list                                          optional, once
 *
 * Rows and queries are chunked rather than written as one section per layer so that an engine can
 * dump a live decode (every layer grows by one token per step) as it goes, and so that no writer
 * ever seeks back to patch a length. The reader indexes chunks at open (one small record each) and
 * serves ranges with pread.
 */
#include "kvtier_trace.h"
#include "base/alloc.h"
#include "base/io.h"

#include "container.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    SEC_META = 1,
    SEC_TEXT = 2,
    SEC_LAYER = 3,
    SEC_ROWS = 4,
    SEC_QUERIES = 5,
    SEC_NEEDLES = 6,
    SEC_TARGETS = 7,
};

#define META_BYTES 16u
#define LAYER_BYTES 56u
#define ROWS_HEADER_BYTES 24u
#define QUERIES_HEADER_BYTES 32u
#define NEEDLE_BYTES 24u
#define TARGET_BYTES 24u
#define MAX_TARGET_HEADS (1u << 24) /* head entries over all targets */

static const char *section_name(uint32_t type) {
    switch (type) {
    case SEC_META:
        return "META";
    case SEC_TEXT:
        return "TEXT";
    case SEC_LAYER:
        return "LAYER";
    case SEC_ROWS:
        return "ROWS";
    case SEC_QUERIES:
        return "QUERIES";
    case SEC_NEEDLES:
        return "NEEDLES";
    case SEC_TARGETS:
        return "TARGETS";
    }
    return "unknown";
}

static uint64_t token_bytes(const kvt_layer_spec *s) {
    return (uint64_t)s->n_kv_heads * s->row_bytes;
}

/* Grow *p (elements of size elt) to hold at least need; capacity doubles. */
static bool grow(void **p, size_t *cap, size_t need, size_t elt) {
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : 8;
    while (c < need)
        c *= 2;
    void *q = kvt__mem_realloc(*p, c * elt);
    if (!q)
        return false;
    *p = q;
    *cap = c;
    return true;
}

/* Serialise a spec: layer index, the 12 kvt_layer_spec fields in declaration order, reserved 0. */
static void spec_put(uint8_t *p, uint32_t layer, const kvt_layer_spec *s) {
    const uint32_t v[14] = {layer,
                            (uint32_t)s->kind,
                            (uint32_t)s->dtype,
                            s->n_kv_heads,
                            s->n_planes,
                            s->head_dim,
                            s->value_dim,
                            s->branch_dim,
                            s->row_bytes,
                            s->branch_offset,
                            (uint32_t)s->branch_dtype,
                            s->sliding_window,
                            s->n_q_heads,
                            0};
    for (int i = 0; i < 14; i++)
        kvt__put_u32(p + 4 * i, v[i]);
}

/* ============================================================================================
 * Writer
 * ========================================================================================== */

typedef struct wlayer {
    uint32_t index;
    kvt_layer_spec spec;
    uint64_t n_tokens[2];
    bool has_q;
    kvt_dtype q_dtype;
    uint32_t q_heads, q_dim;
    uint64_t n_steps, last_pos;
} wlayer;

struct kvt_trace_writer {
    kvt__ctr_writer c;
    char *path;
    uint32_t n_model_layers;
    wlayer *layers;
    size_t n_layers, cap_layers;
    bool wrote_needles, wrote_targets;
    char msg[256];
};

static kvt_status wfail(kvt_trace_writer *w, kvt_status s, const char *fmt, ...) KVT__PRINTF(3, 4);
static kvt_status wfail(kvt_trace_writer *w, kvt_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvt__vfail(w->msg, sizeof w->msg, s, fmt, ap);
    va_end(ap);
    return s;
}

/* Result of a container write: copy the container's I/O message on failure. */
static kvt_status wio(kvt_trace_writer *w, kvt_status s) {
    if (s != KVT_OK)
        snprintf(w->msg, sizeof w->msg, "%s", w->c.msg);
    return s;
}

static wlayer *wfind(kvt_trace_writer *w, uint32_t layer) {
    for (size_t i = 0; i < w->n_layers; i++)
        if (w->layers[i].index == layer)
            return &w->layers[i];
    return NULL;
}

kvt_status kvt_trace_writer_open(const char *path, const kvt_trace_meta *meta,
                                 kvt_trace_writer **out, char *err, size_t err_len) {
    if (out)
        *out = NULL;
    if (!path || !meta || !out)
        return kvt__fail(err, err_len, KVT_ERR_INVALID_ARGUMENT, "path, meta and out are required");
    if (meta->n_model_layers == 0 || meta->n_model_layers > KVT_TRACE_MAX_LAYERS)
        return kvt__fail(err, err_len, KVT_ERR_INVALID_ARGUMENT, "n_model_layers: %u not in 1..%u",
                         meta->n_model_layers, KVT_TRACE_MAX_LAYERS);
    size_t text_len = meta->text ? strlen(meta->text) : 0;
    if (text_len > KVT_TRACE_MAX_TEXT_BYTES)
        return kvt__fail(err, err_len, KVT_ERR_INVALID_ARGUMENT, "text: %zu bytes (limit %u)",
                         text_len, KVT_TRACE_MAX_TEXT_BYTES);
    kvt_trace_writer *w = kvt__mem_calloc(1, sizeof *w);
    char *p = kvt__mem_malloc(strlen(path) + 1);
    if (!w || !p) {
        kvt__mem_free(w);
        kvt__mem_free(p);
        return kvt__fail(err, err_len, KVT_ERR_OUT_OF_MEMORY, "trace writer");
    }
    strcpy(p, path);
    w->path = p;
    w->n_model_layers = meta->n_model_layers;
    kvt_status s = kvt__ctr_writer_open(&w->c, path, KVT__CTR_KIND_TRACE);
    if (s == KVT_OK) {
        uint8_t m[META_BYTES];
        kvt__put_u64(m, meta->prompt_rows);
        kvt__put_u32(m + 8, meta->n_model_layers);
        kvt__put_u32(m + 12, 0);
        kvt__ctr_part part = {m, sizeof m};
        s = kvt__ctr_write_section(&w->c, SEC_META, KVT__CTR_FLAG_CRITICAL, &part, 1);
    }
    if (s == KVT_OK && meta->text) {
        kvt__ctr_part part = {meta->text, text_len};
        s = kvt__ctr_write_section(&w->c, SEC_TEXT, 0, &part, 1);
    }
    if (s != KVT_OK) {
        kvt__fail(err, err_len, s, "%s", w->c.msg);
        kvt_trace_writer_abort(w);
        return s;
    }
    *out = w;
    return KVT_OK;
}

kvt_status kvt_trace_write_layer(kvt_trace_writer *w, uint32_t layer, const kvt_layer_spec *spec) {
    if (!w || !spec)
        return w ? wfail(w, KVT_ERR_INVALID_ARGUMENT, "spec is NULL") : KVT_ERR_INVALID_ARGUMENT;
    if (w->c.error != KVT_OK)
        return w->c.error;
    char sub[200];
    kvt_status s = kvt_layer_spec_check(spec, sub, sizeof sub);
    if (s != KVT_OK)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "layer %u: %s", layer, sub);
    if (spec->kind == KVT_LAYER_NO_KV)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "layer %u: a no-KV layer has no rows to trace",
                     layer);
    if (layer >= w->n_model_layers)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "layer %u: not below n_model_layers %u", layer,
                     w->n_model_layers);
    if (wfind(w, layer))
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "layer %u: declared twice", layer);
    if (!grow((void **)&w->layers, &w->cap_layers, w->n_layers + 1, sizeof *w->layers))
        return wfail(w, KVT_ERR_OUT_OF_MEMORY, "layer table");
    uint8_t p[LAYER_BYTES];
    spec_put(p, layer, spec);
    kvt__ctr_part part = {p, sizeof p};
    s = wio(w, kvt__ctr_write_section(&w->c, SEC_LAYER, KVT__CTR_FLAG_CRITICAL, &part, 1));
    if (s != KVT_OK)
        return s;
    wlayer *l = &w->layers[w->n_layers++];
    memset(l, 0, sizeof *l);
    l->index = layer;
    l->spec = *spec;
    return KVT_OK;
}

kvt_status kvt_trace_write_rows(kvt_trace_writer *w, uint32_t layer, uint32_t plane,
                                const void *rows, uint64_t n_tokens, size_t rows_bytes) {
    if (!w)
        return KVT_ERR_INVALID_ARGUMENT;
    if (w->c.error != KVT_OK)
        return w->c.error;
    wlayer *l = wfind(w, layer);
    if (!l)
        return wfail(w, KVT_ERR_BAD_STATE, "rows for layer %u before its kvt_trace_write_layer",
                     layer);
    if (plane >= l->spec.n_planes)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "layer %u: plane %u (layer has %u planes)", layer,
                     plane, l->spec.n_planes);
    if (n_tokens == 0)
        return KVT_OK;
    if (!rows)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "rows is NULL");
    if (n_tokens > KVT_TRACE_MAX_TOKENS - l->n_tokens[plane])
        return wfail(w, KVT_ERR_INVALID_ARGUMENT,
                     "layer %u plane %u: %llu + %llu tokens exceeds the limit 2^31", layer, plane,
                     (unsigned long long)l->n_tokens[plane], (unsigned long long)n_tokens);
    uint64_t bytes = n_tokens * token_bytes(&l->spec);
    if (bytes != rows_bytes)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT,
                     "layer %u: rows_bytes %zu != %llu tokens x %llu bytes", layer, rows_bytes,
                     (unsigned long long)n_tokens, (unsigned long long)token_bytes(&l->spec));
    uint8_t h[ROWS_HEADER_BYTES];
    kvt__put_u32(h, layer);
    kvt__put_u32(h + 4, plane);
    kvt__put_u64(h + 8, l->n_tokens[plane]);
    kvt__put_u64(h + 16, n_tokens);
    kvt__ctr_part parts[2] = {{h, sizeof h}, {rows, bytes}};
    kvt_status s =
        wio(w, kvt__ctr_write_section(&w->c, SEC_ROWS, KVT__CTR_FLAG_CRITICAL, parts, 2));
    if (s == KVT_OK)
        l->n_tokens[plane] += n_tokens;
    return s;
}

kvt_status kvt_trace_write_queries(kvt_trace_writer *w, uint32_t layer, kvt_dtype dtype,
                                   uint32_t n_q_heads, uint32_t dim, const uint64_t *positions,
                                   const void *q, uint64_t n_steps, size_t q_bytes) {
    if (!w)
        return KVT_ERR_INVALID_ARGUMENT;
    if (w->c.error != KVT_OK)
        return w->c.error;
    wlayer *l = wfind(w, layer);
    if (!l)
        return wfail(w, KVT_ERR_BAD_STATE, "queries for layer %u before its kvt_trace_write_layer",
                     layer);
    if (dtype != KVT_DTYPE_FP32 && dtype != KVT_DTYPE_BF16)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "query dtype must be fp32 or bf16");
    if (n_q_heads == 0 || n_q_heads > KVT_TRACE_MAX_Q_HEADS || dim == 0 ||
        dim > KVT_TRACE_MAX_Q_DIM)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "n_q_heads %u / dim %u not in 1..%u / 1..%u",
                     n_q_heads, dim, KVT_TRACE_MAX_Q_HEADS, KVT_TRACE_MAX_Q_DIM);
    if (l->has_q && (l->q_dtype != dtype || l->q_heads != n_q_heads || l->q_dim != dim))
        return wfail(w, KVT_ERR_INVALID_ARGUMENT,
                     "layer %u: query shape (%s, %u heads, dim %u) differs from the previous "
                     "chunk's (%s, %u, %u)",
                     layer, kvt_dtype_name(dtype), n_q_heads, dim, kvt_dtype_name(l->q_dtype),
                     l->q_heads, l->q_dim);
    if (n_steps == 0)
        return KVT_OK;
    if (!positions || !q)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "positions and q are required");
    if (n_steps > KVT_TRACE_MAX_STEPS - l->n_steps)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "layer %u: query steps exceed the limit 2^31",
                     layer);
    uint64_t step_bytes = (uint64_t)n_q_heads * dim * kvt_dtype_bytes(dtype);
    if (n_steps * step_bytes != q_bytes)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT,
                     "layer %u: q_bytes %zu != %llu steps x %llu bytes", layer, q_bytes,
                     (unsigned long long)n_steps, (unsigned long long)step_bytes);
    uint64_t prev = l->last_pos;
    for (uint64_t i = 0; i < n_steps; i++) {
        if (positions[i] < prev || positions[i] > KVT_TRACE_MAX_TOKENS)
            return wfail(w, KVT_ERR_INVALID_ARGUMENT,
                         "layer %u: position %llu of step %llu decreases or exceeds 2^31", layer,
                         (unsigned long long)positions[i], (unsigned long long)(l->n_steps + i));
        prev = positions[i];
    }
    uint8_t h[QUERIES_HEADER_BYTES];
    kvt__put_u32(h, layer);
    kvt__put_u32(h + 4, (uint32_t)dtype);
    kvt__put_u32(h + 8, n_q_heads);
    kvt__put_u32(h + 12, dim);
    kvt__put_u64(h + 16, l->n_steps);
    kvt__put_u64(h + 24, n_steps);
    /* Positions go to the file in little-endian order: serialise them in bounded pieces. */
    uint8_t *pos = kvt__mem_malloc((size_t)n_steps * 8);
    if (!pos)
        return wfail(w, KVT_ERR_OUT_OF_MEMORY, "positions");
    for (uint64_t i = 0; i < n_steps; i++)
        kvt__put_u64(pos + 8 * i, positions[i]);
    kvt__ctr_part parts[3] = {{h, sizeof h}, {pos, n_steps * 8}, {q, q_bytes}};
    kvt_status s =
        wio(w, kvt__ctr_write_section(&w->c, SEC_QUERIES, KVT__CTR_FLAG_CRITICAL, parts, 3));
    kvt__mem_free(pos);
    if (s != KVT_OK)
        return s;
    l->has_q = true;
    l->q_dtype = dtype;
    l->q_heads = n_q_heads;
    l->q_dim = dim;
    l->n_steps += n_steps;
    l->last_pos = prev;
    return KVT_OK;
}

kvt_status kvt_trace_write_needles(kvt_trace_writer *w, const kvt_trace_needle *needles,
                                   uint32_t n) {
    if (!w)
        return KVT_ERR_INVALID_ARGUMENT;
    if (w->c.error != KVT_OK)
        return w->c.error;
    if (w->wrote_needles)
        return wfail(w, KVT_ERR_BAD_STATE, "needles already written");
    if (n > KVT_TRACE_MAX_NEEDLES || (n > 0 && !needles))
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "needles: NULL or more than %u",
                     KVT_TRACE_MAX_NEEDLES);
    for (uint32_t i = 0; i < n; i++) {
        if (!wfind(w, needles[i].layer))
            return wfail(w, KVT_ERR_INVALID_ARGUMENT, "needle %u: layer %u not declared", i,
                         needles[i].layer);
        if (needles[i].n_rows == 0)
            return wfail(w, KVT_ERR_INVALID_ARGUMENT, "needle %u: n_rows is 0", i);
    }
    size_t bytes = 8 + (size_t)n * NEEDLE_BYTES;
    uint8_t *p = kvt__mem_calloc(1, bytes);
    if (!p)
        return wfail(w, KVT_ERR_OUT_OF_MEMORY, "needles");
    kvt__put_u32(p, n);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *r = p + 8 + (size_t)i * NEEDLE_BYTES;
        kvt__put_u32(r, needles[i].layer);
        kvt__put_u64(r + 8, needles[i].first_row);
        kvt__put_u64(r + 16, needles[i].n_rows);
    }
    kvt__ctr_part part = {p, bytes};
    kvt_status s =
        wio(w, kvt__ctr_write_section(&w->c, SEC_NEEDLES, KVT__CTR_FLAG_CRITICAL, &part, 1));
    kvt__mem_free(p);
    if (s == KVT_OK)
        w->wrote_needles = true;
    return s;
}

kvt_status kvt_trace_write_targets(kvt_trace_writer *w, const kvt_trace_target *targets,
                                   uint32_t n) {
    if (!w)
        return KVT_ERR_INVALID_ARGUMENT;
    if (w->c.error != KVT_OK)
        return w->c.error;
    if (w->wrote_targets)
        return wfail(w, KVT_ERR_BAD_STATE, "targets already written");
    if (n > KVT_TRACE_MAX_TARGETS || (n > 0 && !targets))
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "targets: NULL or more than %u",
                     KVT_TRACE_MAX_TARGETS);
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (targets[i].n_heads == 0 || !targets[i].heads)
            return wfail(w, KVT_ERR_INVALID_ARGUMENT, "target %u: no heads", i);
        total += targets[i].n_heads;
    }
    if (total > MAX_TARGET_HEADS)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "targets: %llu heads in all (limit %u)",
                     (unsigned long long)total, MAX_TARGET_HEADS);
    size_t bytes = 8 + (size_t)n * TARGET_BYTES + (size_t)total * 4;
    uint8_t *p = kvt__mem_calloc(1, bytes);
    if (!p)
        return wfail(w, KVT_ERR_OUT_OF_MEMORY, "targets");
    kvt__put_u32(p, n);
    kvt__put_u32(p + 4, (uint32_t)total);
    uint8_t *pool = p + 8 + (size_t)n * TARGET_BYTES;
    uint32_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *r = p + 8 + (size_t)i * TARGET_BYTES;
        kvt__put_u64(r, targets[i].step);
        kvt__put_u32(r + 8, targets[i].needle);
        kvt__put_u32(r + 12, at);
        kvt__put_u32(r + 16, targets[i].n_heads);
        for (uint32_t k = 0; k < targets[i].n_heads; k++)
            kvt__put_u32(pool + 4 * (size_t)(at + k), targets[i].heads[k]);
        at += targets[i].n_heads;
    }
    kvt__ctr_part part = {p, bytes};
    kvt_status s =
        wio(w, kvt__ctr_write_section(&w->c, SEC_TARGETS, KVT__CTR_FLAG_CRITICAL, &part, 1));
    kvt__mem_free(p);
    if (s == KVT_OK)
        w->wrote_targets = true;
    return s;
}

kvt_status kvt_trace_write_section(kvt_trace_writer *w, uint32_t type, bool critical,
                                   const void *payload, size_t bytes) {
    if (!w)
        return KVT_ERR_INVALID_ARGUMENT;
    if (w->c.error != KVT_OK)
        return w->c.error;
    if (type < KVT_TRACE_SECTION_USER)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "section type 0x%x is reserved for kvtier", type);
    if (bytes > 0 && !payload)
        return wfail(w, KVT_ERR_INVALID_ARGUMENT, "payload is NULL");
    kvt__ctr_part part = {payload, bytes};
    return wio(
        w, kvt__ctr_write_section(&w->c, type, critical ? KVT__CTR_FLAG_CRITICAL : 0, &part, 1));
}

const char *kvt_trace_writer_last_error(const kvt_trace_writer *w) {
    return w ? w->msg : "";
}

static void writer_free(kvt_trace_writer *w) {
    kvt__mem_free(w->layers);
    kvt__mem_free(w->path);
    kvt__mem_free(w);
}

kvt_status kvt_trace_writer_close(kvt_trace_writer *w, char *err, size_t err_len) {
    if (!w)
        return KVT_OK;
    kvt_status s = kvt__ctr_writer_finish(&w->c);
    if (s != KVT_OK)
        kvt__fail(err, err_len, s, "%s", w->c.msg);
    writer_free(w);
    return s;
}

void kvt_trace_writer_abort(kvt_trace_writer *w) {
    if (!w)
        return;
    /* The file is this writer's only when its open succeeded: a failed open leaves whatever
     * was at path alone. */
    bool created = w->c.fd >= 0;
    kvt__ctr_writer_abandon(&w->c);
    if (created && w->path)
        kvt__io_unlink(w->path);
    writer_free(w);
}

/* ============================================================================================
 * Reader
 * ========================================================================================== */

/* One ROWS or QUERIES chunk. The payload CRC covers the chunk's prefix (its fixed header, plus
 * the positions for QUERIES) and then its data; prefix_crc is the CRC of the prefix, computed at
 * open from the bytes read then, so a read that covers the whole data can finish the check. */
typedef struct chunk {
    uint64_t first, n;   /* tokens or steps */
    uint64_t data_off;   /* file offset of the data */
    uint32_t crc;        /* payload CRC as recorded */
    uint32_t prefix_crc; /* CRC of the payload bytes before data_off */
} chunk;

typedef struct tlayer {
    kvt_trace_layer info;
    uint64_t token_bytes;
    uint64_t n_tokens[2];
    chunk *rows[2];
    size_t n_rows[2], cap_rows[2];
    bool has_q;
    uint64_t step_bytes;
    chunk *q;
    size_t n_q, cap_q;
    uint64_t *pos; /* n_steps positions */
    size_t cap_pos;
} tlayer;

struct kvt_trace {
    kvt__ctr_reader c;
    uint64_t prompt_rows;
    uint32_t n_model_layers;
    char *text;
    size_t text_len;
    tlayer *layers;
    size_t n_layers, cap_layers;
    kvt_trace_needle *needles;
    uint32_t n_needles;
    kvt_trace_target *targets;
    uint32_t *heads;
    uint32_t n_targets;
    char msg[256];
};

static kvt_status tfail(kvt_trace *t, kvt_status s, const char *fmt, ...) KVT__PRINTF(3, 4);
static kvt_status tfail(kvt_trace *t, kvt_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvt__vfail(t->msg, sizeof t->msg, s, fmt, ap);
    va_end(ap);
    return s;
}

static tlayer *tfind(const kvt_trace *t, uint32_t layer) {
    for (size_t i = 0; i < t->n_layers; i++)
        if (t->layers[i].info.layer == layer)
            return &t->layers[i];
    return NULL;
}

/* Parse a LAYER payload into a spec, refusing values outside the enums before they become one. */
static kvt_status parse_layer(kvt_trace *t, const uint8_t *p, size_t idx) {
    uint32_t v[14];
    for (int i = 0; i < 14; i++)
        v[i] = kvt__get_u32(p + 4 * i);
    uint32_t layer = v[0];
    if (v[1] > KVT_LAYER_NO_KV)
        return tfail(t, KVT_ERR_PARSE, "LAYER (section %zu) layer %u: unknown kind %u", idx, layer,
                     v[1]);
    if (v[2] > KVT_DTYPE_FP8_E4M3 || v[10] > KVT_DTYPE_FP8_E4M3)
        return tfail(t, KVT_ERR_PARSE, "LAYER (section %zu) layer %u: unknown dtype %u / %u", idx,
                     layer, v[2], v[10]);
    kvt_layer_spec s = {.kind = (kvt_layer_kind)v[1],
                        .dtype = (kvt_dtype)v[2],
                        .n_kv_heads = v[3],
                        .n_planes = v[4],
                        .head_dim = v[5],
                        .value_dim = v[6],
                        .branch_dim = v[7],
                        .row_bytes = v[8],
                        .branch_offset = v[9],
                        .branch_dtype = (kvt_dtype)v[10],
                        .sliding_window = v[11],
                        .n_q_heads = v[12]};
    char sub[200];
    if (kvt_layer_spec_check(&s, sub, sizeof sub) != KVT_OK)
        return tfail(t, KVT_ERR_PARSE, "LAYER (section %zu) layer %u: %s", idx, layer, sub);
    if (s.kind == KVT_LAYER_NO_KV)
        return tfail(t, KVT_ERR_PARSE, "LAYER (section %zu) layer %u: no-KV layers carry no rows",
                     idx, layer);
    if (layer >= t->n_model_layers)
        return tfail(t, KVT_ERR_PARSE,
                     "LAYER (section %zu): layer index %u not below n_model_layers %u", idx, layer,
                     t->n_model_layers);
    if (tfind(t, layer))
        return tfail(t, KVT_ERR_PARSE, "LAYER (section %zu): layer %u declared twice", idx, layer);
    if (!grow((void **)&t->layers, &t->cap_layers, t->n_layers + 1, sizeof *t->layers))
        return tfail(t, KVT_ERR_OUT_OF_MEMORY, "layer table");
    tlayer *l = &t->layers[t->n_layers++];
    memset(l, 0, sizeof *l);
    l->info.layer = layer;
    l->info.spec = s;
    l->token_bytes = token_bytes(&s);
    return KVT_OK;
}

static kvt_status parse_rows(kvt_trace *t, const kvt__ctr_section *sec, size_t idx) {
    uint8_t h[ROWS_HEADER_BYTES];
    if (sec->length < sizeof h)
        return tfail(t, KVT_ERR_PARSE, "ROWS (section %zu): length %llu shorter than its header",
                     idx, (unsigned long long)sec->length);
    kvt_status s = kvt__ctr_pread(&t->c, sec->offset, h, sizeof h, t->msg, sizeof t->msg);
    if (s != KVT_OK)
        return s;
    uint32_t layer = kvt__get_u32(h), plane = kvt__get_u32(h + 4);
    uint64_t first = kvt__get_u64(h + 8), n = kvt__get_u64(h + 16);
    tlayer *l = tfind(t, layer);
    if (!l)
        return tfail(t, KVT_ERR_PARSE,
                     "ROWS (section %zu): layer %u has no preceding LAYER section", idx, layer);
    if (plane >= l->info.spec.n_planes)
        return tfail(t, KVT_ERR_PARSE, "ROWS (section %zu) layer %u: plane %u of %u", idx, layer,
                     plane, l->info.spec.n_planes);
    if (n == 0 || n > KVT_TRACE_MAX_TOKENS)
        return tfail(t, KVT_ERR_PARSE,
                     "ROWS (section %zu) layer %u: absurd n_tokens %llu (must be 1..2^31)", idx,
                     layer, (unsigned long long)n);
    if (first != l->n_tokens[plane])
        return tfail(t, KVT_ERR_PARSE,
                     "ROWS (section %zu) layer %u plane %u: chunk starts at token %llu, expected "
                     "%llu (chunks must be contiguous)",
                     idx, layer, plane, (unsigned long long)first,
                     (unsigned long long)l->n_tokens[plane]);
    if (n > KVT_TRACE_MAX_TOKENS - first)
        return tfail(t, KVT_ERR_PARSE, "ROWS (section %zu) layer %u: more than 2^31 tokens", idx,
                     layer);
    uint64_t want = sizeof h + n * l->token_bytes; /* <= 24 + 2^31 * 2^30: no overflow */
    if (sec->length != want)
        return tfail(t, KVT_ERR_PARSE,
                     "ROWS (section %zu) layer %u: length %llu != 24 + n_tokens %llu x %llu bytes",
                     idx, layer, (unsigned long long)sec->length, (unsigned long long)n,
                     (unsigned long long)l->token_bytes);
    if (!grow((void **)&l->rows[plane], &l->cap_rows[plane], l->n_rows[plane] + 1, sizeof(chunk)))
        return tfail(t, KVT_ERR_OUT_OF_MEMORY, "row chunk index");
    l->rows[plane][l->n_rows[plane]++] = (chunk){.first = first,
                                                 .n = n,
                                                 .data_off = sec->offset + sizeof h,
                                                 .crc = sec->crc,
                                                 .prefix_crc = kvt__crc32(0, h, sizeof h)};
    l->n_tokens[plane] += n;
    return KVT_OK;
}

static kvt_status parse_queries(kvt_trace *t, const kvt__ctr_section *sec, size_t idx) {
    uint8_t h[QUERIES_HEADER_BYTES];
    if (sec->length < sizeof h)
        return tfail(t, KVT_ERR_PARSE, "QUERIES (section %zu): length %llu shorter than its header",
                     idx, (unsigned long long)sec->length);
    kvt_status s = kvt__ctr_pread(&t->c, sec->offset, h, sizeof h, t->msg, sizeof t->msg);
    if (s != KVT_OK)
        return s;
    uint32_t layer = kvt__get_u32(h), dtype = kvt__get_u32(h + 4);
    uint32_t heads = kvt__get_u32(h + 8), dim = kvt__get_u32(h + 12);
    uint64_t first = kvt__get_u64(h + 16), n = kvt__get_u64(h + 24);
    tlayer *l = tfind(t, layer);
    if (!l)
        return tfail(t, KVT_ERR_PARSE,
                     "QUERIES (section %zu): layer %u has no preceding LAYER section", idx, layer);
    if (dtype != KVT_DTYPE_FP32 && dtype != KVT_DTYPE_BF16)
        return tfail(t, KVT_ERR_PARSE, "QUERIES (section %zu) layer %u: dtype %u (fp32 or bf16)",
                     idx, layer, dtype);
    if (heads == 0 || heads > KVT_TRACE_MAX_Q_HEADS || dim == 0 || dim > KVT_TRACE_MAX_Q_DIM)
        return tfail(
            t, KVT_ERR_PARSE,
            "QUERIES (section %zu) layer %u: absurd n_q_heads %u / dim %u (limits %u / %u)", idx,
            layer, heads, dim, KVT_TRACE_MAX_Q_HEADS, KVT_TRACE_MAX_Q_DIM);
    if (n == 0 || n > KVT_TRACE_MAX_STEPS)
        return tfail(t, KVT_ERR_PARSE, "QUERIES (section %zu) layer %u: absurd n_steps %llu", idx,
                     layer, (unsigned long long)n);
    if (l->has_q &&
        (l->info.q_dtype != (kvt_dtype)dtype || l->info.n_q_heads != heads || l->info.q_dim != dim))
        return tfail(t, KVT_ERR_PARSE,
                     "QUERIES (section %zu) layer %u: shape differs from the layer's earlier "
                     "chunks",
                     idx, layer);
    if (first != l->info.n_steps)
        return tfail(t, KVT_ERR_PARSE,
                     "QUERIES (section %zu) layer %u: chunk starts at step %llu, expected %llu",
                     idx, layer, (unsigned long long)first, (unsigned long long)l->info.n_steps);
    if (n > KVT_TRACE_MAX_STEPS - first)
        return tfail(t, KVT_ERR_PARSE, "QUERIES (section %zu) layer %u: more than 2^31 steps", idx,
                     layer);
    uint64_t step_bytes = (uint64_t)heads * dim * kvt_dtype_bytes((kvt_dtype)dtype); /* <= 2^30 */
    uint64_t want = sizeof h + n * (8 + step_bytes);
    if (sec->length != want)
        return tfail(t, KVT_ERR_PARSE,
                     "QUERIES (section %zu) layer %u: length %llu != 32 + n_steps %llu x (8 + "
                     "%llu bytes)",
                     idx, layer, (unsigned long long)sec->length, (unsigned long long)n,
                     (unsigned long long)step_bytes);
    /* n is now bounded by the section length, itself inside the file: safe to allocate. */
    if (!grow((void **)&l->pos, &l->cap_pos, (size_t)(first + n), sizeof *l->pos) ||
        !grow((void **)&l->q, &l->cap_q, l->n_q + 1, sizeof *l->q))
        return tfail(t, KVT_ERR_OUT_OF_MEMORY, "query index");
    uint8_t *raw = kvt__mem_malloc((size_t)n * 8);
    if (!raw)
        return tfail(t, KVT_ERR_OUT_OF_MEMORY, "query positions");
    s = kvt__ctr_pread(&t->c, sec->offset + sizeof h, raw, n * 8, t->msg, sizeof t->msg);
    if (s != KVT_OK) {
        kvt__mem_free(raw);
        return s;
    }
    uint64_t prev = first > 0 ? l->pos[first - 1] : 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t p = kvt__get_u64(raw + 8 * i);
        if (p < prev) {
            kvt__mem_free(raw);
            return tfail(t, KVT_ERR_PARSE,
                         "QUERIES (section %zu) layer %u: position %llu of step %llu is below the "
                         "previous step's %llu",
                         idx, layer, (unsigned long long)p, (unsigned long long)(first + i),
                         (unsigned long long)prev);
        }
        l->pos[first + i] = prev = p;
    }
    uint32_t pc = kvt__crc32(kvt__crc32(0, h, sizeof h), raw, n * 8);
    kvt__mem_free(raw);
    l->q[l->n_q++] = (chunk){.first = first,
                             .n = n,
                             .data_off = sec->offset + sizeof h + n * 8,
                             .crc = sec->crc,
                             .prefix_crc = pc};
    l->has_q = true;
    l->step_bytes = step_bytes;
    l->info.q_dtype = (kvt_dtype)dtype;
    l->info.n_q_heads = heads;
    l->info.q_dim = dim;
    l->info.n_steps = first + n;
    return KVT_OK;
}

/* Read a small section whole (after bounding its length) and check its CRC. */
static kvt_status read_small(kvt_trace *t, const kvt__ctr_section *sec, uint64_t max_len,
                             size_t idx, uint8_t **out) {
    *out = NULL;
    if (sec->length > max_len)
        return tfail(t, KVT_ERR_PARSE, "%s (section %zu): length %llu exceeds the limit %llu",
                     section_name(sec->type), idx, (unsigned long long)sec->length,
                     (unsigned long long)max_len);
    uint8_t *p = kvt__mem_malloc(sec->length ? (size_t)sec->length : 1);
    if (!p)
        return tfail(t, KVT_ERR_OUT_OF_MEMORY, "%s payload", section_name(sec->type));
    char sub[200];
    kvt_status s = kvt__ctr_read_payload(&t->c, sec, p, sub, sizeof sub);
    if (s != KVT_OK) {
        kvt__mem_free(p);
        return tfail(t, s, "%s (section %zu): %s", section_name(sec->type), idx, sub);
    }
    *out = p;
    return KVT_OK;
}

static kvt_status parse_needles(kvt_trace *t, const uint8_t *p, uint64_t len, size_t idx) {
    if (len < 8)
        return tfail(t, KVT_ERR_PARSE, "NEEDLES (section %zu): length %llu < 8", idx,
                     (unsigned long long)len);
    uint32_t n = kvt__get_u32(p);
    if (n > KVT_TRACE_MAX_NEEDLES || len != 8 + (uint64_t)n * NEEDLE_BYTES)
        return tfail(t, KVT_ERR_PARSE, "NEEDLES (section %zu): length %llu != 8 + %u x 24", idx,
                     (unsigned long long)len, n);
    t->needles = kvt__mem_calloc(n ? n : 1, sizeof *t->needles);
    if (!t->needles)
        return tfail(t, KVT_ERR_OUT_OF_MEMORY, "needles");
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *r = p + 8 + (size_t)i * NEEDLE_BYTES;
        t->needles[i] = (kvt_trace_needle){.layer = kvt__get_u32(r),
                                           .first_row = kvt__get_u64(r + 8),
                                           .n_rows = kvt__get_u64(r + 16)};
    }
    t->n_needles = n;
    return KVT_OK;
}

static kvt_status parse_targets(kvt_trace *t, const uint8_t *p, uint64_t len, size_t idx) {
    if (len < 8)
        return tfail(t, KVT_ERR_PARSE, "TARGETS (section %zu): length %llu < 8", idx,
                     (unsigned long long)len);
    uint32_t n = kvt__get_u32(p), total = kvt__get_u32(p + 4);
    if (n > KVT_TRACE_MAX_TARGETS || total > MAX_TARGET_HEADS ||
        len != 8 + (uint64_t)n * TARGET_BYTES + (uint64_t)total * 4)
        return tfail(t, KVT_ERR_PARSE,
                     "TARGETS (section %zu): length %llu != 8 + %u x 24 + %u heads x 4", idx,
                     (unsigned long long)len, n, total);
    t->targets = kvt__mem_calloc(n ? n : 1, sizeof *t->targets);
    t->heads = kvt__mem_calloc(total ? total : 1, sizeof *t->heads);
    if (!t->targets || !t->heads)
        return tfail(t, KVT_ERR_OUT_OF_MEMORY, "targets");
    const uint8_t *pool = p + 8 + (size_t)n * TARGET_BYTES;
    for (uint32_t k = 0; k < total; k++)
        t->heads[k] = kvt__get_u32(pool + 4 * (size_t)k);
    uint64_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *r = p + 8 + (size_t)i * TARGET_BYTES;
        uint32_t fh = kvt__get_u32(r + 12), nh = kvt__get_u32(r + 16);
        if (fh != at || nh == 0 || nh > total - at)
            return tfail(t, KVT_ERR_PARSE,
                         "TARGETS (section %zu) target %u: heads [%u, +%u) do not continue the "
                         "head list at %llu (of %u)",
                         idx, i, fh, nh, (unsigned long long)at, total);
        t->targets[i] = (kvt_trace_target){.step = kvt__get_u64(r),
                                           .needle = kvt__get_u32(r + 8),
                                           .n_heads = nh,
                                           .heads = t->heads + fh};
        at += nh;
    }
    if (at != total)
        return tfail(t, KVT_ERR_PARSE, "TARGETS (section %zu): %llu of %u head entries used", idx,
                     (unsigned long long)at, total);
    t->n_targets = n;
    return KVT_OK;
}

/* Checks that need the whole file: plane lengths, positions, prompt, needles, targets. */
static kvt_status cross_check(kvt_trace *t) {
    for (size_t i = 0; i < t->n_layers; i++) {
        tlayer *l = &t->layers[i];
        uint32_t li = l->info.layer;
        if (l->info.spec.n_planes == 2 && l->n_tokens[0] != l->n_tokens[1])
            return tfail(t, KVT_ERR_PARSE, "layer %u: plane 0 has %llu rows, plane 1 has %llu", li,
                         (unsigned long long)l->n_tokens[0], (unsigned long long)l->n_tokens[1]);
        l->info.n_tokens = l->n_tokens[0];
        if (t->prompt_rows > l->info.n_tokens)
            return tfail(t, KVT_ERR_PARSE, "prompt_rows %llu exceeds layer %u's %llu rows",
                         (unsigned long long)t->prompt_rows, li,
                         (unsigned long long)l->info.n_tokens);
        if (l->info.n_steps > 0 && l->pos[l->info.n_steps - 1] > l->info.n_tokens)
            return tfail(t, KVT_ERR_PARSE,
                         "layer %u: query step %llu at position %llu, beyond the layer's %llu "
                         "rows",
                         li, (unsigned long long)(l->info.n_steps - 1),
                         (unsigned long long)l->pos[l->info.n_steps - 1],
                         (unsigned long long)l->info.n_tokens);
    }
    for (uint32_t i = 0; i < t->n_needles; i++) {
        const kvt_trace_needle *nd = &t->needles[i];
        const tlayer *l = tfind(t, nd->layer);
        if (!l)
            return tfail(t, KVT_ERR_PARSE, "needle %u: layer %u is not in the trace", i, nd->layer);
        if (nd->n_rows == 0 || nd->first_row > l->info.n_tokens ||
            nd->n_rows > l->info.n_tokens - nd->first_row)
            return tfail(t, KVT_ERR_PARSE,
                         "needle %u: rows [%llu, +%llu) outside layer %u's %llu rows", i,
                         (unsigned long long)nd->first_row, (unsigned long long)nd->n_rows,
                         nd->layer, (unsigned long long)l->info.n_tokens);
    }
    for (uint32_t i = 0; i < t->n_targets; i++) {
        const kvt_trace_target *tg = &t->targets[i];
        if (tg->needle >= t->n_needles)
            return tfail(t, KVT_ERR_PARSE, "target %u: needle %u of %u", i, tg->needle,
                         t->n_needles);
        const kvt_trace_needle *nd = &t->needles[tg->needle];
        const tlayer *l = tfind(t, nd->layer);
        if (tg->step >= l->info.n_steps)
            return tfail(t, KVT_ERR_PARSE, "target %u: step %llu, layer %u has %llu query steps", i,
                         (unsigned long long)tg->step, nd->layer,
                         (unsigned long long)l->info.n_steps);
        for (uint32_t k = 0; k < tg->n_heads; k++)
            if (tg->heads[k] >= l->info.n_q_heads)
                return tfail(t, KVT_ERR_PARSE, "target %u: head %u, layer %u has %u query heads", i,
                             tg->heads[k], nd->layer, l->info.n_q_heads);
        if (l->pos[tg->step] < nd->first_row + nd->n_rows)
            return tfail(t, KVT_ERR_PARSE,
                         "target %u: step %llu at position %llu precedes the end of needle %u "
                         "(row %llu)",
                         i, (unsigned long long)tg->step, (unsigned long long)l->pos[tg->step],
                         tg->needle, (unsigned long long)(nd->first_row + nd->n_rows));
    }
    return KVT_OK;
}

static kvt_status parse_all(kvt_trace *t) {
    bool have_text = false;
    bool have_needles = false, have_targets = false;
    if (t->c.n_sections == 0 || t->c.sections[0].type != SEC_META)
        return tfail(t, KVT_ERR_PARSE, "missing META section: the first section is %s",
                     t->c.n_sections ? section_name(t->c.sections[0].type) : "END");
    for (size_t i = 0; i < t->c.n_sections; i++) {
        const kvt__ctr_section *sec = &t->c.sections[i];
        kvt_status s = KVT_OK;
        uint8_t *p = NULL;
        switch (sec->type) {
        case SEC_META:
            if (i != 0)
                return tfail(t, KVT_ERR_PARSE, "META (section %zu): more than one META", i);
            if (sec->length != META_BYTES)
                return tfail(t, KVT_ERR_PARSE, "META: length %llu != %u",
                             (unsigned long long)sec->length, META_BYTES);
            s = read_small(t, sec, META_BYTES, i, &p);
            if (s == KVT_OK) {
                t->prompt_rows = kvt__get_u64(p);
                t->n_model_layers = kvt__get_u32(p + 8);
                if (t->n_model_layers == 0 || t->n_model_layers > KVT_TRACE_MAX_LAYERS)
                    s = tfail(t, KVT_ERR_PARSE, "META: n_model_layers %u not in 1..%u",
                              t->n_model_layers, KVT_TRACE_MAX_LAYERS);
                else if (t->prompt_rows > KVT_TRACE_MAX_TOKENS)
                    s = tfail(t, KVT_ERR_PARSE, "META: absurd prompt_rows %llu",
                              (unsigned long long)t->prompt_rows);
            }
            break;
        case SEC_TEXT:
            if (have_text)
                return tfail(t, KVT_ERR_PARSE, "TEXT (section %zu): more than one TEXT", i);
            have_text = true;
            s = read_small(t, sec, KVT_TRACE_MAX_TEXT_BYTES, i, &p);
            if (s == KVT_OK) {
                t->text = kvt__mem_malloc((size_t)sec->length + 1);
                if (!t->text)
                    s = tfail(t, KVT_ERR_OUT_OF_MEMORY, "text");
                else {
                    memcpy(t->text, p, (size_t)sec->length);
                    t->text[sec->length] = '\0';
                    t->text_len = (size_t)sec->length;
                }
            }
            break;
        case SEC_LAYER:
            if (sec->length != LAYER_BYTES)
                return tfail(t, KVT_ERR_PARSE, "LAYER (section %zu): length %llu != %u", i,
                             (unsigned long long)sec->length, LAYER_BYTES);
            s = read_small(t, sec, LAYER_BYTES, i, &p);
            if (s == KVT_OK)
                s = parse_layer(t, p, i);
            break;
        case SEC_ROWS:
            s = parse_rows(t, sec, i);
            break;
        case SEC_QUERIES:
            s = parse_queries(t, sec, i);
            break;
        case SEC_NEEDLES:
            if (have_needles)
                return tfail(t, KVT_ERR_PARSE, "NEEDLES (section %zu): more than one", i);
            have_needles = true;
            s = read_small(t, sec, 8 + (uint64_t)KVT_TRACE_MAX_NEEDLES * NEEDLE_BYTES, i, &p);
            if (s == KVT_OK)
                s = parse_needles(t, p, sec->length, i);
            break;
        case SEC_TARGETS:
            if (have_targets)
                return tfail(t, KVT_ERR_PARSE, "TARGETS (section %zu): more than one", i);
            have_targets = true;
            s = read_small(t, sec,
                           8 + (uint64_t)KVT_TRACE_MAX_TARGETS * TARGET_BYTES +
                               (uint64_t)MAX_TARGET_HEADS * 4,
                           i, &p);
            if (s == KVT_OK)
                s = parse_targets(t, p, sec->length, i);
            break;
        default:
            /* Unknown: a later writer's addition. Skip it unless it says readers must know it. */
            if (sec->flags & KVT__CTR_FLAG_CRITICAL)
                return tfail(t, KVT_ERR_UNSUPPORTED,
                             "section %zu at offset %llu: unknown type 0x%x marked critical", i,
                             (unsigned long long)sec->header_offset, sec->type);
            break;
        }
        kvt__mem_free(p);
        if (s != KVT_OK)
            return s;
    }
    return cross_check(t);
}

kvt_status kvt_trace_open(const char *path, kvt_trace **out, char *err, size_t err_len) {
    if (out)
        *out = NULL;
    if (!path || !out)
        return kvt__fail(err, err_len, KVT_ERR_INVALID_ARGUMENT, "path and out are required");
    kvt_trace *t = kvt__mem_calloc(1, sizeof *t);
    if (!t)
        return kvt__fail(err, err_len, KVT_ERR_OUT_OF_MEMORY, "trace");
    t->c.fd = -1;
    kvt_status s = kvt__ctr_open(&t->c, path, KVT__CTR_KIND_TRACE, t->msg, sizeof t->msg);
    if (s == KVT_OK)
        s = parse_all(t);
    if (s != KVT_OK) {
        kvt__fail(err, err_len, s, "%s", t->msg);
        kvt_trace_close(t);
        return s;
    }
    t->msg[0] = '\0';
    *out = t;
    return KVT_OK;
}

void kvt_trace_close(kvt_trace *t) {
    if (!t)
        return;
    kvt__ctr_close(&t->c);
    for (size_t i = 0; i < t->n_layers; i++) {
        kvt__mem_free(t->layers[i].rows[0]);
        kvt__mem_free(t->layers[i].rows[1]);
        kvt__mem_free(t->layers[i].q);
        kvt__mem_free(t->layers[i].pos);
    }
    kvt__mem_free(t->layers);
    kvt__mem_free(t->text);
    kvt__mem_free(t->needles);
    kvt__mem_free(t->targets);
    kvt__mem_free(t->heads);
    kvt__mem_free(t);
}

const char *kvt_trace_last_error(const kvt_trace *t) {
    return t ? t->msg : "";
}

void kvt_trace_format_version(const kvt_trace *t, uint32_t *major, uint32_t *minor) {
    if (major)
        *major = t ? t->c.major : 0;
    if (minor)
        *minor = t ? t->c.minor : 0;
}

uint64_t kvt_trace_prompt_rows(const kvt_trace *t) {
    return t ? t->prompt_rows : 0;
}

uint32_t kvt_trace_n_model_layers(const kvt_trace *t) {
    return t ? t->n_model_layers : 0;
}

const char *kvt_trace_text(const kvt_trace *t, size_t *len) {
    if (len)
        *len = t && t->text ? t->text_len : 0;
    return t && t->text ? t->text : "";
}

uint32_t kvt_trace_n_layers(const kvt_trace *t) {
    return t ? (uint32_t)t->n_layers : 0;
}

kvt_status kvt_trace_layer_info(const kvt_trace *t, uint32_t i, kvt_trace_layer *out) {
    if (!t || !out)
        return KVT_ERR_INVALID_ARGUMENT;
    if (i >= t->n_layers)
        return KVT_ERR_OUT_OF_RANGE;
    *out = t->layers[i].info;
    return KVT_OK;
}

kvt_status kvt_trace_find_layer(const kvt_trace *t, uint32_t layer, kvt_trace_layer *out) {
    if (!t || !out)
        return KVT_ERR_INVALID_ARGUMENT;
    const tlayer *l = tfind(t, layer);
    if (!l)
        return KVT_ERR_OUT_OF_RANGE;
    *out = l->info;
    return KVT_OK;
}

/* First chunk whose range contains `at` (chunks are contiguous and sorted by first). */
static size_t chunk_at(const chunk *c, size_t n, uint64_t at) {
    size_t lo = 0, hi = n;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (c[mid].first <= at)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

kvt_status kvt_trace_read_rows(kvt_trace *t, uint32_t layer, uint32_t plane, uint64_t first,
                               uint64_t n, void *dst, size_t dst_bytes) {
    if (!t)
        return KVT_ERR_INVALID_ARGUMENT;
    const tlayer *l = tfind(t, layer);
    if (!l)
        return tfail(t, KVT_ERR_OUT_OF_RANGE, "layer %u is not in the trace", layer);
    if (plane >= l->info.spec.n_planes)
        return tfail(t, KVT_ERR_OUT_OF_RANGE, "layer %u: plane %u of %u", layer, plane,
                     l->info.spec.n_planes);
    if (first > l->info.n_tokens || n > l->info.n_tokens - first)
        return tfail(t, KVT_ERR_OUT_OF_RANGE, "layer %u: rows [%llu, +%llu) beyond %llu", layer,
                     (unsigned long long)first, (unsigned long long)n,
                     (unsigned long long)l->info.n_tokens);
    if (n == 0)
        return KVT_OK;
    if (!dst)
        return tfail(t, KVT_ERR_INVALID_ARGUMENT, "dst is NULL");
    uint64_t tb = l->token_bytes;
    if (dst_bytes < n * tb)
        return tfail(t, KVT_ERR_CAPACITY, "dst_bytes %zu < %llu rows x %llu bytes", dst_bytes,
                     (unsigned long long)n, (unsigned long long)tb);
    const chunk *ch = l->rows[plane];
    size_t nc = l->n_rows[plane];
    uint8_t *d = dst;
    uint64_t end = first + n;
    for (size_t k = chunk_at(ch, nc, first); k < nc && ch[k].first < end; k++) {
        uint64_t a = first > ch[k].first ? first : ch[k].first;
        uint64_t b = end < ch[k].first + ch[k].n ? end : ch[k].first + ch[k].n;
        uint8_t *to = d + (a - first) * tb;
        kvt_status s = kvt__ctr_pread(&t->c, ch[k].data_off + (a - ch[k].first) * tb, to,
                                      (b - a) * tb, t->msg, sizeof t->msg);
        if (s != KVT_OK)
            return s;
        if (a == ch[k].first && b == ch[k].first + ch[k].n) {
            uint32_t c = kvt__crc32(ch[k].prefix_crc, to, (b - a) * tb);
            if (c != ch[k].crc)
                return tfail(t, KVT_ERR_CORRUPT,
                             "CRC mismatch in ROWS chunk of layer %u plane %u, tokens [%llu, "
                             "+%llu): stored 0x%08x, computed 0x%08x",
                             layer, plane, (unsigned long long)ch[k].first,
                             (unsigned long long)ch[k].n, ch[k].crc, c);
        }
    }
    return KVT_OK;
}

kvt_status kvt_trace_query_position(const kvt_trace *t, uint32_t layer, uint64_t step,
                                    uint64_t *position) {
    if (!t || !position)
        return KVT_ERR_INVALID_ARGUMENT;
    const tlayer *l = tfind(t, layer);
    if (!l || step >= l->info.n_steps)
        return KVT_ERR_OUT_OF_RANGE;
    *position = l->pos[step];
    return KVT_OK;
}

kvt_status kvt_trace_read_query(kvt_trace *t, uint32_t layer, uint64_t step, kvt_dtype as,
                                void *dst, size_t dst_bytes, uint64_t *position) {
    if (!t)
        return KVT_ERR_INVALID_ARGUMENT;
    const tlayer *l = tfind(t, layer);
    if (!l)
        return tfail(t, KVT_ERR_OUT_OF_RANGE, "layer %u is not in the trace", layer);
    if (step >= l->info.n_steps)
        return tfail(t, KVT_ERR_OUT_OF_RANGE, "layer %u: step %llu of %llu", layer,
                     (unsigned long long)step, (unsigned long long)l->info.n_steps);
    if (!dst)
        return tfail(t, KVT_ERR_INVALID_ARGUMENT, "dst is NULL");
    if (as != l->info.q_dtype && as != KVT_DTYPE_FP32)
        return tfail(t, KVT_ERR_UNSUPPORTED, "queries are %s: read them as %s or fp32",
                     kvt_dtype_name(l->info.q_dtype), kvt_dtype_name(l->info.q_dtype));
    uint64_t elems = (uint64_t)l->info.n_q_heads * l->info.q_dim;
    uint64_t need = elems * kvt_dtype_bytes(as);
    if (dst_bytes < need)
        return tfail(t, KVT_ERR_CAPACITY, "dst_bytes %zu < %llu", dst_bytes,
                     (unsigned long long)need);
    const chunk *c = &l->q[chunk_at(l->q, l->n_q, step)];
    /* bf16 -> fp32 widens in place: the raw step is read into the upper half of dst
     * ([2E, 4E) for E elements), then widened front to back. Writing fp32 element i to [4i, 4i+4)
     * only overwrites raw elements 2i-E and 2i-E+1, both <= i, which are already consumed. */
    uint8_t *raw = (uint8_t *)dst + (need - l->step_bytes);
    kvt_status s = kvt__ctr_pread(&t->c, c->data_off + (step - c->first) * l->step_bytes, raw,
                                  l->step_bytes, t->msg, sizeof t->msg);
    if (s != KVT_OK)
        return s;
    if (c->n == 1) {
        uint32_t crc = kvt__crc32(c->prefix_crc, raw, l->step_bytes);
        if (crc != c->crc)
            return tfail(t, KVT_ERR_CORRUPT,
                         "CRC mismatch in QUERIES chunk of layer %u, step %llu: stored 0x%08x, "
                         "computed 0x%08x",
                         layer, (unsigned long long)step, c->crc, crc);
    }
    if (as != l->info.q_dtype) { /* bf16 -> fp32: exact, the bf16 bits are the fp32 top half */
        uint8_t *d = dst;
        for (uint64_t i = 0; i < elems; i++) {
            uint32_t bits = (uint32_t)kvt__get_u16(raw + 2 * i) << 16;
            memcpy(d + 4 * i, &bits, 4);
        }
    }
    if (position)
        *position = l->pos[step];
    return KVT_OK;
}

const kvt_trace_needle *kvt_trace_needles(const kvt_trace *t, uint32_t *n) {
    if (n)
        *n = t ? t->n_needles : 0;
    return t && t->n_needles ? t->needles : NULL;
}

const kvt_trace_target *kvt_trace_targets(const kvt_trace *t, uint32_t *n) {
    if (n)
        *n = t ? t->n_targets : 0;
    return t && t->n_targets ? t->targets : NULL;
}

kvt_status kvt_trace_verify(kvt_trace *t) {
    if (!t)
        return KVT_ERR_INVALID_ARGUMENT;
    for (size_t i = 0; i < t->c.n_sections; i++) {
        const kvt__ctr_section *sec = &t->c.sections[i];
        uint32_t crc = 0;
        kvt_status s =
            kvt__ctr_crc_range(&t->c, sec->offset, sec->length, &crc, t->msg, sizeof t->msg);
        if (s != KVT_OK)
            return s;
        if (crc != sec->crc)
            return tfail(t, KVT_ERR_CORRUPT,
                         "CRC mismatch in section %zu (%s, type %u) at offset %llu: stored "
                         "0x%08x, computed 0x%08x",
                         i, section_name(sec->type), sec->type,
                         (unsigned long long)sec->header_offset, sec->crc, crc);
    }
    return KVT_OK;
}
