/*
 * trace.c — `kvtier-inspect trace`: what a kvtier trace file (docs/trace-format.md) holds.
 *
 * Opens the file with kvt_trace_open (which checks the header, every section header, the small
 * sections' CRCs and every cross-reference) and prints the format version, prompt rows, model layer
 * count, the first lines of the provenance text, one block per traced layer (model index, kind and
 * the policy kvtier gives it, row geometry, tokens, query steps), the needles and the targets.
 * --verify adds kvt_trace_verify (one streaming pass over every payload CRC, rows and queries
 * included); --rows LAYER:FIRST:N hex-dumps the first bytes of rows [FIRST, FIRST + N) of a layer,
 * every plane and KV head; --json prints the same as one JSON object.
 *
 * Output stays bounded whatever the file holds: the text form shows the first
 * TRACE_TEXT_LINES provenance lines and TRACE_LIST_MAX needles and targets (--json lists them
 * all), and a --rows range is at most TRACE_ROWS_MAX tokens, TRACE_HEX_BYTES bytes per row.
 * Every reader error is reported as one line on stderr with the reader's message; exit 1.
 */
#include "inspect.h"

#include <kvtier.h>
#include <kvtier_trace.h>

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "trace"

enum {
    TRACE_TEXT_LINES = 8,  /* provenance lines shown in the text form */
    TRACE_TEXT_COLS = 160, /* bytes of one provenance line shown */
    TRACE_LIST_MAX = 32,   /* needles / targets listed in the text form */
    TRACE_ROWS_MAX = 64,   /* tokens per --rows range */
    TRACE_ROWS_RANGES = 8, /* --rows flags */
    TRACE_HEX_BYTES = 32,  /* bytes dumped per row */
};

static void trace_usage(FILE *f) {
    fprintf(
        f,
        "usage: kvtier-inspect trace FILE.kvtt [--verify] [--json] [--rows LAYER:FIRST:N]...\n"
        "  --verify              check every section's CRC (rows and queries included)\n"
        "  --rows LAYER:FIRST:N  hex-dump the first %d bytes of rows [FIRST, FIRST+N) of model\n"
        "                        layer LAYER, every plane and KV head (N <= %d; up to %d\n"
        "                        --rows flags)\n"
        "  --json                one JSON object on stdout\n",
        TRACE_HEX_BYTES, TRACE_ROWS_MAX, TRACE_ROWS_RANGES);
}

typedef struct rows_req {
    uint32_t layer;
    uint64_t first, n;
} rows_req;

typedef struct trace_opts {
    const char *path;
    bool verify, json;
    rows_req rows[TRACE_ROWS_RANGES];
    int n_rows;
} trace_opts;

/* Strict decimal in [0, max] (0 allowed, unlike inspect_parse_count); s ends at `end`. */
static bool parse_u64(const char *s, const char *end, uint64_t max, uint64_t *out) {
    if (s == end)
        return false;
    uint64_t v = 0;
    for (const char *p = s; p < end; p++) {
        if (!isdigit((unsigned char)*p))
            return false;
        unsigned d = (unsigned)(*p - '0');
        if (v > (max - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

/* "LAYER:FIRST:N" with LAYER < 2^32, FIRST < 2^63, N in 1..TRACE_ROWS_MAX. */
static bool parse_rows(const char *v, rows_req *r) {
    const char *c1 = strchr(v, ':');
    const char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c1 || !c2)
        return false;
    uint64_t layer, first, n;
    if (!parse_u64(v, c1, UINT32_MAX, &layer) || !parse_u64(c1 + 1, c2, INT64_MAX, &first) ||
        !parse_u64(c2 + 1, c2 + 1 + strlen(c2 + 1), TRACE_ROWS_MAX, &n) || n == 0)
        return false;
    *r = (rows_req){(uint32_t)layer, first, n};
    return true;
}

static int parse_args(int argc, char **argv, trace_opts *o) {
    memset(o, 0, sizeof *o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            trace_usage(stdout);
            return -1;
        }
        if (strncmp(a, "--", 2) != 0) {
            if (o->path)
                return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                     "one FILE expected, got '%s' and '%s'", o->path, a);
            o->path = a;
        } else if (strcmp(a, "--verify") == 0) {
            o->verify = true;
        } else if (strcmp(a, "--json") == 0) {
            o->json = true;
        } else if (strcmp(a, "--rows") == 0 || strncmp(a, "--rows=", 7) == 0) {
            const char *v = a[6] == '=' ? a + 7 : NULL;
            if (!v) {
                if (i + 1 >= argc)
                    return inspect_error(INSPECT_EXIT_USAGE, CMD, "--rows: missing value");
                v = argv[++i];
            }
            if (o->n_rows == TRACE_ROWS_RANGES)
                return inspect_error(INSPECT_EXIT_USAGE, CMD, "--rows: at most %d ranges",
                                     TRACE_ROWS_RANGES);
            if (!parse_rows(v, &o->rows[o->n_rows]))
                return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                     "--rows: expected LAYER:FIRST:N with N in 1..%d, got '%s'",
                                     TRACE_ROWS_MAX, v);
            o->n_rows++;
        } else {
            return inspect_error(INSPECT_EXIT_USAGE, CMD, "unknown flag '%s' (see --help)", a);
        }
    }
    if (!o->path)
        return inspect_error(INSPECT_EXIT_USAGE, CMD, "missing FILE (see --help)");
    return INSPECT_EXIT_OK;
}

/* One-line error for a reader failure: the reader's message (prefixed with the path unless it
 * already names it) and the status name. */
static int reader_error(const char *path, const char *msg, kvt_status s) {
    if (!msg || !msg[0])
        msg = kvt_strerror(s);
    if (strstr(msg, path))
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s (%s)", msg, kvt_status_name(s));
    return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: %s (%s)", path, msg, kvt_status_name(s));
}

static bool is_mla(const kvt_layer_spec *l) {
    return l->kind == KVT_LAYER_MLA_NOPE || l->kind == KVT_LAYER_MLA_ROPE;
}

/* Bytes of one token in one layer, all planes and heads (small: kvt_layer_spec_check bounds
 * n_kv_heads and row_bytes, and the reader runs it on every LAYER). */
static uint64_t token_bytes(const kvt_layer_spec *l) {
    return (uint64_t)l->n_planes * l->n_kv_heads * l->row_bytes;
}

/* "1 plane x 1 KV head x 1152 B (576 x bf16: 512 value | 64 branch bf16 at byte 1024)" or
 * "2 planes (K, V) x 2 KV heads x 16 B (8 x fp16)". */
static void geometry(const kvt_layer_spec *l, char *buf, size_t n) {
    char inner[128];
    if (is_mla(l))
        snprintf(inner, sizeof inner, "%u x %s: %u value | %u branch %s at byte %u", l->head_dim,
                 kvt_dtype_name(l->dtype), l->value_dim, l->branch_dim,
                 kvt_dtype_name(l->branch_dtype), l->branch_offset);
    else
        snprintf(inner, sizeof inner, "%u x %s", l->head_dim, kvt_dtype_name(l->dtype));
    snprintf(buf, n, "%u plane%s%s x %u KV head%s x %u B (%s)", l->n_planes,
             l->n_planes == 1 ? "" : "s", l->n_planes == 2 && !is_mla(l) ? " (K, V)" : "",
             l->n_kv_heads, l->n_kv_heads == 1 ? "" : "s", l->row_bytes, inner);
}

/* Provenance, line by line, control bytes escaped (the text is free-form: a terminal must not
 * receive escape sequences from a file). */
static void print_text_lines(const char *text, size_t len) {
    size_t lines = 0;
    for (size_t i = 0; i < len; i++)
        if (text[i] == '\n' || i + 1 == len)
            lines++;
    printf("provenance: %zu byte%s, %zu line%s\n", len, len == 1 ? "" : "s", lines,
           lines == 1 ? "" : "s");
    size_t shown = 0, p = 0;
    while (p < len && shown < TRACE_TEXT_LINES) {
        size_t e = p;
        while (e < len && text[e] != '\n')
            e++;
        fputs("  | ", stdout);
        for (size_t k = p; k < e && k - p < TRACE_TEXT_COLS; k++) {
            unsigned char ch = (unsigned char)text[k];
            if (ch < 0x20 || ch == 0x7f)
                printf("\\x%02x", ch);
            else
                fputc(ch, stdout);
        }
        if (e - p > TRACE_TEXT_COLS)
            fputs(" ...", stdout);
        fputc('\n', stdout);
        shown++;
        p = e + 1;
    }
    if (lines > shown)
        printf("  | ... %zu more line%s\n", lines - shown, lines - shown == 1 ? "" : "s");
}

static void hex(const uint8_t *b, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[3 * i] = digits[b[i] >> 4];
        out[3 * i + 1] = digits[b[i] & 15];
        out[3 * i + 2] = ' ';
    }
    out[n ? 3 * n - 1 : 0] = '\0';
}

/* A JSON integer, or a real past json_int_t's range (the reader bounds every count far below). */
static json_t *json_u64(uint64_t v) {
    return v <= (uint64_t)LLONG_MAX ? json_integer((json_int_t)v) : json_real((double)v);
}

/* Everything read from the file, gathered before printing so both forms show the same. */
typedef struct trace_view {
    kvt_trace *t;
    uint32_t major, minor, n_layers, n_needles, n_targets;
    kvt_trace_layer *layers;
    uint64_t *first_pos, *last_pos; /* query positions of the first and last step per layer */
    const kvt_trace_needle *needles;
    const kvt_trace_target *targets;
    const char *text;
    size_t text_len;
} trace_view;

static kvt_status gather(kvt_trace *t, trace_view *v) {
    memset(v, 0, sizeof *v);
    v->t = t;
    kvt_trace_format_version(t, &v->major, &v->minor);
    v->n_layers = kvt_trace_n_layers(t);
    v->text = kvt_trace_text(t, &v->text_len);
    v->needles = kvt_trace_needles(t, &v->n_needles);
    v->targets = kvt_trace_targets(t, &v->n_targets);
    size_t n = v->n_layers ? v->n_layers : 1;
    v->layers = calloc(n, sizeof *v->layers);
    v->first_pos = calloc(n, sizeof *v->first_pos);
    v->last_pos = calloc(n, sizeof *v->last_pos);
    if (!v->layers || !v->first_pos || !v->last_pos)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < v->n_layers; i++) {
        kvt_status s = kvt_trace_layer_info(t, i, &v->layers[i]);
        const kvt_trace_layer *li = &v->layers[i];
        if (s == KVT_OK && li->n_steps > 0)
            s = kvt_trace_query_position(t, li->layer, 0, &v->first_pos[i]);
        if (s == KVT_OK && li->n_steps > 0)
            s = kvt_trace_query_position(t, li->layer, li->n_steps - 1, &v->last_pos[i]);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}

static void view_free(trace_view *v) {
    free(v->layers);
    free(v->first_pos);
    free(v->last_pos);
}

/* Layer of a target = the layer of its needle (the reader checked the id). */
static uint32_t target_layer(const trace_view *v, const kvt_trace_target *g) {
    return g->needle < v->n_needles ? v->needles[g->needle].layer : UINT32_MAX;
}

static void print_summary(const trace_view *v, const char *path) {
    kvt_trace *t = v->t;
    char g[40], geo[256];
    printf("trace: %s\n", path);
    printf("format: %u.%u\n", v->major, v->minor);
    inspect_grouped(kvt_trace_prompt_rows(t), g, sizeof g);
    printf("prompt rows: %s\n", g);
    printf("model layers: %u\n", kvt_trace_n_model_layers(t));
    if (v->text_len > 0)
        print_text_lines(v->text, v->text_len);
    else
        printf("provenance: none\n");
    printf("traced layers: %u\n", v->n_layers);
    for (uint32_t i = 0; i < v->n_layers; i++) {
        const kvt_trace_layer *li = &v->layers[i];
        const kvt_layer_spec *l = &li->spec;
        char extra[48] = "";
        if (l->kind == KVT_LAYER_SLIDING)
            snprintf(extra, sizeof extra, ", window %u", l->sliding_window);
        printf("  layer %u: %s, policy %s%s, %u query heads\n", li->layer,
               kvt_layer_kind_name(l->kind), kvt_policy_name(kvt_policy_for_kind(l->kind)), extra,
               l->n_q_heads);
        geometry(l, geo, sizeof geo);
        inspect_grouped(token_bytes(l), g, sizeof g);
        printf("    rows     %s = %s B/token\n", geo, g);
        inspect_grouped(li->n_tokens, g, sizeof g);
        char h[24];
        /* Total shown only when it fits 64 bits (it does for any plausible trace). */
        uint64_t tb = token_bytes(l);
        if (tb == 0 || li->n_tokens <= UINT64_MAX / tb) {
            inspect_human(li->n_tokens * tb, h, sizeof h);
            printf("    tokens   %s (%s)\n", g, h);
        } else {
            printf("    tokens   %s\n", g);
        }
        if (li->n_steps == 0) {
            printf("    queries  none\n");
        } else {
            inspect_grouped(li->n_steps, g, sizeof g);
            printf("    queries  %s step%s, %s, %u heads x %u, positions %llu..%llu\n", g,
                   li->n_steps == 1 ? "" : "s", kvt_dtype_name(li->q_dtype), li->n_q_heads,
                   li->q_dim, (unsigned long long)v->first_pos[i],
                   (unsigned long long)v->last_pos[i]);
        }
    }
    printf("needles: %u\n", v->n_needles);
    for (uint32_t i = 0; i < v->n_needles && i < TRACE_LIST_MAX; i++) {
        const kvt_trace_needle *nd = &v->needles[i];
        printf("  #%u layer %u rows [%llu, %llu)\n", i, nd->layer,
               (unsigned long long)nd->first_row, (unsigned long long)(nd->first_row + nd->n_rows));
    }
    if (v->n_needles > TRACE_LIST_MAX)
        printf("  ... %u more (--json lists all)\n", v->n_needles - TRACE_LIST_MAX);
    printf("targets: %u\n", v->n_targets);
    for (uint32_t i = 0; i < v->n_targets && i < TRACE_LIST_MAX; i++) {
        const kvt_trace_target *tg = &v->targets[i];
        printf("  #%u layer %u step %llu -> needle %u, head%s", i, target_layer(v, tg),
               (unsigned long long)tg->step, tg->needle, tg->n_heads == 1 ? "" : "s");
        for (uint32_t k = 0; k < tg->n_heads && k < TRACE_LIST_MAX; k++)
            printf(" %u", tg->heads[k]);
        if (tg->n_heads > TRACE_LIST_MAX)
            printf(" ... (%u in all)", tg->n_heads);
        fputc('\n', stdout);
    }
    if (v->n_targets > TRACE_LIST_MAX)
        printf("  ... %u more (--json lists all)\n", v->n_targets - TRACE_LIST_MAX);
}

/* Read one --rows range token by token (memory bounded by one token of one plane) and either
 * print it or append it to `arr` (JSON). Errors come from the reader, with its message. */
static int dump_rows(kvt_trace *t, const char *path, const rows_req *r, json_t *arr) {
    kvt_trace_layer li;
    kvt_status s = kvt_trace_find_layer(t, r->layer, &li);
    if (s != KVT_OK)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "--rows: layer %u is not in %s (%s)", r->layer,
                             path, kvt_status_name(s));
    if (r->first >= li.n_tokens || r->n > li.n_tokens - r->first)
        return inspect_error(INSPECT_EXIT_FAIL, CMD,
                             "--rows: rows [%llu, %llu) past the %llu rows of layer %u",
                             (unsigned long long)r->first, (unsigned long long)(r->first + r->n),
                             (unsigned long long)li.n_tokens, r->layer);
    const kvt_layer_spec *l = &li.spec;
    size_t tok_bytes = (size_t)l->n_kv_heads * l->row_bytes;
    uint8_t *buf = malloc(tok_bytes);
    if (!buf)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "--rows: out of memory (%zu B)", tok_bytes);
    size_t show = l->row_bytes < TRACE_HEX_BYTES ? l->row_bytes : TRACE_HEX_BYTES;
    char hx[3 * TRACE_HEX_BYTES + 1];
    if (!arr)
        printf("rows of layer %u [%llu, %llu), first %zu of %u B per row (CRCs: --verify):\n",
               r->layer, (unsigned long long)r->first, (unsigned long long)(r->first + r->n), show,
               l->row_bytes);
    int rc = INSPECT_EXIT_OK;
    for (uint64_t tok = r->first; tok < r->first + r->n && rc == INSPECT_EXIT_OK; tok++) {
        for (uint32_t p = 0; p < l->n_planes && rc == INSPECT_EXIT_OK; p++) {
            s = kvt_trace_read_rows(t, r->layer, p, tok, 1, buf, tok_bytes);
            if (s != KVT_OK) {
                rc = reader_error(path, kvt_trace_last_error(t), s);
                break;
            }
            for (uint32_t h = 0; h < l->n_kv_heads; h++) {
                hex(buf + (size_t)h * l->row_bytes, show, hx);
                if (arr) {
                    json_t *e = json_object();
                    json_object_set_new(e, "layer", json_integer(r->layer));
                    json_object_set_new(e, "token", json_u64(tok));
                    json_object_set_new(e, "plane", json_integer(p));
                    json_object_set_new(e, "kv_head", json_integer(h));
                    json_object_set_new(e, "row_bytes", json_integer(l->row_bytes));
                    json_object_set_new(e, "hex", json_string(hx));
                    json_array_append_new(arr, e);
                } else {
                    printf("  token %llu plane %u head %u: %s%s\n", (unsigned long long)tok, p, h,
                           hx, show < l->row_bytes ? " ..." : "");
                }
            }
        }
    }
    free(buf);
    return rc;
}

static json_t *summary_json(const trace_view *v, const char *path) {
    kvt_trace *t = v->t;
    json_t *root = json_object();
    json_object_set_new(root, "file", json_string(path));
    json_t *fmt = json_object();
    json_object_set_new(fmt, "major", json_integer(v->major));
    json_object_set_new(fmt, "minor", json_integer(v->minor));
    json_object_set_new(root, "format", fmt);
    json_object_set_new(root, "prompt_rows", json_u64(kvt_trace_prompt_rows(t)));
    json_object_set_new(root, "n_model_layers", json_integer(kvt_trace_n_model_layers(t)));
    /* Provenance is meant to be UTF-8 but nothing enforces it; jansson refuses invalid UTF-8. */
    json_t *text = json_stringn(v->text, v->text_len);
    json_object_set_new(root, "text", text ? text : json_null());
    json_t *layers = json_array();
    for (uint32_t i = 0; i < v->n_layers; i++) {
        const kvt_trace_layer *li = &v->layers[i];
        const kvt_layer_spec *l = &li->spec;
        json_t *e = json_object();
        json_object_set_new(e, "layer", json_integer(li->layer));
        json_object_set_new(e, "kind", json_string(kvt_layer_kind_name(l->kind)));
        json_object_set_new(e, "policy",
                            json_string(kvt_policy_name(kvt_policy_for_kind(l->kind))));
        json_object_set_new(e, "dtype", json_string(kvt_dtype_name(l->dtype)));
        json_object_set_new(e, "n_kv_heads", json_integer(l->n_kv_heads));
        json_object_set_new(e, "n_planes", json_integer(l->n_planes));
        json_object_set_new(e, "head_dim", json_integer(l->head_dim));
        json_object_set_new(e, "value_dim", json_integer(l->value_dim));
        json_object_set_new(e, "branch_dim", json_integer(l->branch_dim));
        json_object_set_new(e, "row_bytes", json_integer(l->row_bytes));
        json_object_set_new(e, "branch_offset", json_integer(l->branch_offset));
        json_object_set_new(e, "branch_dtype", json_string(kvt_dtype_name(l->branch_dtype)));
        json_object_set_new(e, "sliding_window", json_integer(l->sliding_window));
        json_object_set_new(e, "n_q_heads", json_integer(l->n_q_heads));
        json_object_set_new(e, "bytes_per_token", json_u64(token_bytes(l)));
        json_object_set_new(e, "n_tokens", json_u64(li->n_tokens));
        json_t *q = json_object();
        json_object_set_new(q, "n_steps", json_u64(li->n_steps));
        if (li->n_steps > 0) {
            json_object_set_new(q, "dtype", json_string(kvt_dtype_name(li->q_dtype)));
            json_object_set_new(q, "n_heads", json_integer(li->n_q_heads));
            json_object_set_new(q, "dim", json_integer(li->q_dim));
            json_object_set_new(q, "first_position", json_u64(v->first_pos[i]));
            json_object_set_new(q, "last_position", json_u64(v->last_pos[i]));
        }
        json_object_set_new(e, "queries", q);
        json_array_append_new(layers, e);
    }
    json_object_set_new(root, "layers", layers);
    json_t *needles = json_array();
    for (uint32_t i = 0; i < v->n_needles; i++) {
        json_t *e = json_object();
        json_object_set_new(e, "id", json_integer(i));
        json_object_set_new(e, "layer", json_integer(v->needles[i].layer));
        json_object_set_new(e, "first_row", json_u64(v->needles[i].first_row));
        json_object_set_new(e, "n_rows", json_u64(v->needles[i].n_rows));
        json_array_append_new(needles, e);
    }
    json_object_set_new(root, "needles", needles);
    json_t *targets = json_array();
    for (uint32_t i = 0; i < v->n_targets; i++) {
        const kvt_trace_target *tg = &v->targets[i];
        json_t *e = json_object();
        json_object_set_new(e, "layer", json_integer(target_layer(v, tg)));
        json_object_set_new(e, "step", json_u64(tg->step));
        json_object_set_new(e, "needle", json_integer(tg->needle));
        json_t *heads = json_array();
        for (uint32_t k = 0; k < tg->n_heads; k++)
            json_array_append_new(heads, json_integer(tg->heads[k]));
        json_object_set_new(e, "heads", heads);
        json_array_append_new(targets, e);
    }
    json_object_set_new(root, "targets", targets);
    return root;
}

/* The JSON form: the whole object is built first, so a --rows error prints no partial JSON;
 * a verify failure is part of the object ("verify": {"ok": false, "error": ...}) and also the
 * one-line error on stderr. */
static int run_json(const trace_view *v, const trace_opts *o) {
    json_t *root = summary_json(v, o->path);
    int rc = INSPECT_EXIT_OK;
    if (o->verify) {
        kvt_status s = kvt_trace_verify(v->t);
        json_t *ver = json_object();
        json_object_set_new(ver, "ok", json_boolean(s == KVT_OK));
        if (s != KVT_OK) {
            json_object_set_new(ver, "status", json_string(kvt_status_name(s)));
            json_object_set_new(ver, "error", json_string(kvt_trace_last_error(v->t)));
            rc = reader_error(o->path, kvt_trace_last_error(v->t), s);
        }
        json_object_set_new(root, "verify", ver);
    }
    if (rc == INSPECT_EXIT_OK && o->n_rows > 0) {
        json_t *rows = json_array();
        for (int i = 0; i < o->n_rows && rc == INSPECT_EXIT_OK; i++)
            rc = dump_rows(v->t, o->path, &o->rows[i], rows);
        json_object_set_new(root, "rows", rows);
        if (rc != INSPECT_EXIT_OK) {
            json_decref(root);
            return rc;
        }
    }
    if (json_dumpf(root, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0) {
        json_decref(root);
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "cannot write JSON to stdout");
    }
    fputc('\n', stdout);
    json_decref(root);
    return rc;
}

static int run_text(const trace_view *v, const trace_opts *o) {
    print_summary(v, o->path);
    if (o->verify) {
        kvt_status s = kvt_trace_verify(v->t);
        if (s != KVT_OK) {
            printf("verify: FAILED\n");
            fflush(stdout);
            return reader_error(o->path, kvt_trace_last_error(v->t), s);
        }
        printf("verify: OK (every section CRC checked)\n");
    }
    for (int i = 0; i < o->n_rows; i++) {
        int rc = dump_rows(v->t, o->path, &o->rows[i], NULL);
        if (rc != INSPECT_EXIT_OK) {
            fflush(stdout);
            return rc;
        }
    }
    return INSPECT_EXIT_OK;
}

int inspect_trace(int argc, char **argv) {
    trace_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc < 0)
        return INSPECT_EXIT_OK; /* --help */
    if (rc != INSPECT_EXIT_OK)
        return rc;
    char err[512] = "";
    kvt_trace *t = NULL;
    kvt_status s = kvt_trace_open(o.path, &t, err, sizeof err);
    if (s != KVT_OK)
        return reader_error(o.path, err, s);
    trace_view v;
    s = gather(t, &v);
    if (s != KVT_OK) {
        rc = reader_error(o.path, kvt_trace_last_error(t), s);
    } else {
        rc = o.json ? run_json(&v, &o) : run_text(&v, &o);
        if (fflush(stdout) != 0 && rc == INSPECT_EXIT_OK)
            rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "cannot write to stdout");
    }
    view_free(&v);
    kvt_trace_close(t);
    return rc;
}
