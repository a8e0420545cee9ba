/*
 * census.c — `kvtier-inspect census`: what a model's KV cache costs and what kvtier's policies do
 * to it. Reads the config with kvt_model_from_file, prints a layer table (runs of identical
 * layers grouped), bytes per token, and kvt_model_census totals at context x concurrency; with
 * --ratio, what each policy frees or stops reading. --json prints the same as one JSON object.
 *
 * The per-policy figures come from kvt_model_census on one sub-model per policy (the layers of
 * that policy), so the formulas live in one place: the library.
 */
#include "inspect.h"

#include <kvtier.h>

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "census"

static void census_usage(FILE *f) {
    fprintf(f,
            "usage: kvtier-inspect census CONFIG.json [--context N] [--concurrency C] [--ratio X]\n"
            "                             [--shared-prefix P] [--dtype bf16|fp16|fp32] [--json]\n"
            "  --context N      tokens per request (default 32768)\n"
            "  --concurrency C  requests (default 1)\n"
            "  --shared-prefix P  the requests share their first P tokens (prefix sharing: a\n"
            "                   system prompt, forks), held once: the totals with it too\n"
            "  --ratio X        compression ratio >= 1: show what each policy frees or stops\n"
            "                   reading (default: none, i.e. 1)\n"
            "  --dtype D        cache element type (default bf16)\n"
            "  --json           one JSON object on stdout\n");
}

typedef struct census_opts {
    const char *path;
    uint64_t context, concurrency, shared_prefix;
    double ratio;
    bool have_ratio, json;
    kvt_dtype dtype;
} census_opts;

/* Value of a flag given as "--flag V" or "--flag=V"; NULL (and an error printed) when absent. */
static const char *flag_value(int argc, char **argv, int *i, const char *arg, const char *eq) {
    if (eq)
        return eq + 1;
    if (*i + 1 >= argc) {
        inspect_error(INSPECT_EXIT_USAGE, CMD, "%s: missing value", arg);
        return NULL;
    }
    return argv[++*i];
}

static int parse_args(int argc, char **argv, census_opts *o) {
    *o = (census_opts){NULL, 32768, 1, 0, 1.0, false, false, KVT_DTYPE_BF16};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            census_usage(stdout);
            return -1;
        }
        if (strncmp(a, "--", 2) != 0) {
            if (o->path)
                return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                     "one CONFIG.json expected, got '%s' and '%s'", o->path, a);
            o->path = a;
            continue;
        }
        const char *eq = strchr(a, '=');
        size_t name_len = eq ? (size_t)(eq - a) : strlen(a);
        char name[32];
        if (name_len >= sizeof name)
            return inspect_error(INSPECT_EXIT_USAGE, CMD, "unknown flag '%s'", a);
        memcpy(name, a, name_len);
        name[name_len] = '\0';
        if (strcmp(name, "--json") == 0 && !eq) {
            o->json = true;
            continue;
        }
        const char *v;
        /* The count flags: name, what it counts, its largest power of two, where it goes. */
        const struct {
            const char *name, *unit;
            int log2_max;
            uint64_t *out;
        } counts[] = {{"--context", "tokens", 40, &o->context},
                      {"--concurrency", "requests", 24, &o->concurrency},
                      {"--shared-prefix", "tokens", 40, &o->shared_prefix}};
        size_t c = 0;
        while (c < sizeof counts / sizeof counts[0] && strcmp(name, counts[c].name) != 0)
            c++;
        if (c < sizeof counts / sizeof counts[0]) {
            if (!(v = flag_value(argc, argv, &i, name, eq)))
                return INSPECT_EXIT_USAGE;
            if (!inspect_parse_count(v, UINT64_C(1) << counts[c].log2_max, counts[c].out))
                return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                     "%s: expected %s in 1..2^%d, got '%s'", name, counts[c].unit,
                                     counts[c].log2_max, v);
        } else if (strcmp(name, "--ratio") == 0) {
            if (!(v = flag_value(argc, argv, &i, name, eq)))
                return INSPECT_EXIT_USAGE;
            if (!inspect_parse_real(v, 1.0, &o->ratio))
                return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                     "--ratio: expected a number >= 1, got '%s'", v);
            o->have_ratio = true;
        } else if (strcmp(name, "--dtype") == 0) {
            if (!(v = flag_value(argc, argv, &i, name, eq)))
                return INSPECT_EXIT_USAGE;
            if (strcmp(v, "bf16") == 0)
                o->dtype = KVT_DTYPE_BF16;
            else if (strcmp(v, "fp16") == 0)
                o->dtype = KVT_DTYPE_FP16;
            else if (strcmp(v, "fp32") == 0)
                o->dtype = KVT_DTYPE_FP32;
            else
                return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                     "--dtype: expected bf16, fp16 or fp32, got '%s'", v);
        } else {
            return inspect_error(INSPECT_EXIT_USAGE, CMD, "unknown flag '%s' (see --help)", a);
        }
    }
    if (!o->path)
        return inspect_error(INSPECT_EXIT_USAGE, CMD, "missing CONFIG.json (see --help)");
    if (o->shared_prefix > o->context)
        return inspect_error(INSPECT_EXIT_USAGE, CMD,
                             "--shared-prefix %llu exceeds the context of %llu tokens",
                             (unsigned long long)o->shared_prefix,
                             (unsigned long long)o->context);
    return INSPECT_EXIT_OK;
}

/* Name of the model's recurrent layers, for the table. */
static const char *no_kv_note(const char *model_type) {
    if (strcmp(model_type, "kimi_linear") == 0)
        return "(KDA)";
    if (strcmp(model_type, "qwen3_next") == 0)
        return "(Gated DeltaNet)";
    return "(linear/recurrent)";
}

static bool same_layer(const kvt_layer_spec *a, const kvt_layer_spec *b) {
    return a->kind == b->kind && a->dtype == b->dtype && a->n_kv_heads == b->n_kv_heads &&
           a->n_planes == b->n_planes && a->head_dim == b->head_dim &&
           a->value_dim == b->value_dim && a->branch_dim == b->branch_dim &&
           a->row_bytes == b->row_bytes && a->sliding_window == b->sliding_window &&
           a->n_q_heads == b->n_q_heads;
}

/* "576 x bf16 = 1152 B" (MLA) or "2 x 8 x 128 x bf16 = 4096 B" (planes x heads x head_dim). */
static void geometry(const kvt_layer_spec *l, char *buf, size_t n) {
    unsigned long long bpt = (unsigned long long)kvt_layer_bytes_per_token(l);
    const char *dt = kvt_dtype_name(l->dtype);
    if (l->kind == KVT_LAYER_MLA_NOPE || l->kind == KVT_LAYER_MLA_ROPE)
        snprintf(buf, n, "%u x %s = %llu B", l->head_dim, dt, bpt);
    else
        snprintf(buf, n, "%u x %u x %u x %s = %llu B", l->n_planes, l->n_kv_heads, l->head_dim, dt,
                 bpt);
}

/* Totals of the sub-model made of the layers under one policy (all zero when there are none). */
static kvt_status policy_totals(const kvt_model *m, kvt_policy pol, const census_opts *o,
                                kvt_census_totals *t) {
    memset(t, 0, sizeof *t);
    uint32_t n = kvt_model_n_layers(m), k = 0;
    kvt_layer_spec *sub = calloc(n, sizeof *sub);
    if (!sub)
        return KVT_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < n; i++)
        if (kvt_policy_for_kind(kvt_model_layer(m, i)->kind) == pol)
            sub[k++] = *kvt_model_layer(m, i);
    kvt_status s = KVT_OK;
    if (k > 0) {
        kvt_model *sm = NULL;
        s = kvt_model_create(sub, k, kvt_model_type(m), &sm, NULL, 0);
        if (s == KVT_OK)
            s = kvt_model_census(sm, o->context, o->concurrency, o->ratio, t);
        kvt_model_destroy(sm);
    }
    free(sub);
    return s;
}

static const kvt_policy k_policies[] = {KVT_POLICY_SALIENCE, KVT_POLICY_EVICT, KVT_POLICY_NONE};

static void print_bytes(const char *label, uint64_t b) {
    char g[40], h[24];
    inspect_grouped(b, g, sizeof g);
    inspect_human(b, h, sizeof h);
    printf("  %-22s %s B (%s)\n", label, g, h);
}

static void print_text(const kvt_model *m, const census_opts *o, const kvt_census_totals *t,
                       const kvt_census_totals *by_policy, const kvt_census_totals *sh) {
    uint32_t n = kvt_model_n_layers(m);
    char g[40], g2[40], geo[96];
    printf("model: %s, %u layers, cache dtype %s\n", kvt_model_type(m), n,
           kvt_dtype_name(o->dtype));
    printf("layers (0-indexed; identical neighbours grouped):\n");
    for (uint32_t i = 0; i < n;) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        uint32_t j = i + 1;
        while (j < n && same_layer(kvt_model_layer(m, j), l))
            j++;
        char range[32];
        if (j - i == 1)
            snprintf(range, sizeof range, "%u", i);
        else
            snprintf(range, sizeof range, "%u-%u", i, j - 1);
        if (l->kind == KVT_LAYER_NO_KV)
            snprintf(geo, sizeof geo, "%s", no_kv_note(kvt_model_type(m)));
        else
            geometry(l, geo, sizeof geo);
        char extra[48] = "";
        if (l->kind == KVT_LAYER_SLIDING)
            snprintf(extra, sizeof extra, ", window %u", l->sliding_window);
        printf("  %-8s %-9s %-32s policy %s%s\n", range, kvt_layer_kind_name(l->kind), geo,
               kvt_policy_name(kvt_policy_for_kind(l->kind)), extra);
        i = j;
    }
    inspect_grouped(t->kv_bytes_per_token, g, sizeof g);
    printf("kv bytes per token: %s B/token (%llu salience, %llu random-evict, %llu none of which "
           "%llu no-kv)\n",
           g, (unsigned long long)t->salience_layers, (unsigned long long)t->evict_layers,
           (unsigned long long)t->none_layers, (unsigned long long)t->no_kv_layers);
    inspect_grouped(o->context, g, sizeof g);
    inspect_grouped(o->concurrency, g2, sizeof g2);
    printf("totals at context %s tokens x %s request%s:\n", g, g2, o->concurrency == 1 ? "" : "s");
    print_bytes("dense cache", t->dense_bytes);
    uint64_t tokens = o->context * o->concurrency; /* <= 2^64 by the flag limits */
    if (t->dense_bytes / tokens != t->kv_bytes_per_token)
        printf("  %-22s %llu B/token with the sliding-window caps\n", "",
               (unsigned long long)(t->dense_bytes / tokens));
    if (o->shared_prefix) {
        inspect_grouped(o->shared_prefix, g, sizeof g);
        printf("with the first %s tokens shared by the requests (held once):\n", g);
        print_bytes("dense cache", sh->dense_bytes);
        if (o->have_ratio)
            print_bytes("freed from the pool", sh->freed_bytes);
    }
    if (!o->have_ratio)
        return;
    printf("at ratio %g:\n", o->ratio);
    print_bytes("attended per step", t->attended_bytes);
    printf("  %-22s ~%.0f B/token of context\n", "", (double)t->attended_bytes / (double)tokens);
    print_bytes("freed from the pool", t->freed_bytes);
    for (size_t p = 0; p < 3; p++) {
        const kvt_census_totals *b = &by_policy[p];
        uint64_t layers = k_policies[p] == KVT_POLICY_SALIENCE ? t->salience_layers
                          : k_policies[p] == KVT_POLICY_EVICT  ? t->evict_layers
                                                               : t->none_layers;
        if (layers == 0)
            continue;
        char d[40], a[40], f[40], stop[40];
        inspect_human(b->dense_bytes, d, sizeof d);
        inspect_human(b->attended_bytes, a, sizeof a);
        inspect_human(b->freed_bytes, f, sizeof f);
        inspect_human(b->dense_bytes - b->attended_bytes, stop, sizeof stop);
        switch (k_policies[p]) {
        case KVT_POLICY_SALIENCE:
            printf("  salience (%llu layers): reads %s of %s, stops reading %s, frees 0 B "
                   "(archived rows stay in the pool)\n",
                   (unsigned long long)layers, a, d, stop);
            break;
        case KVT_POLICY_EVICT:
            printf("  random-evict (%llu layers): keeps %s of %s, frees %s\n",
                   (unsigned long long)layers, a, d, f);
            break;
        case KVT_POLICY_NONE:
            if (layers == t->no_kv_layers)
                printf("  none (%llu no-kv layers): no per-token cache to free or skip\n",
                       (unsigned long long)layers);
            else
                printf("  none (%llu layers, %llu of them no-kv): reads all %s, frees 0 B\n",
                       (unsigned long long)layers, (unsigned long long)t->no_kv_layers, d);
            break;
        }
    }
}

/* A JSON integer, or a real past json_int_t's range (only for absurd contexts). */
static json_t *json_u64(uint64_t v) {
    return v <= (uint64_t)LLONG_MAX ? json_integer((json_int_t)v) : json_real((double)v);
}

static json_t *totals_json(const kvt_census_totals *t, bool counts) {
    json_t *o = json_object();
    json_object_set_new(o, "dense_bytes", json_u64(t->dense_bytes));
    json_object_set_new(o, "attended_bytes", json_u64(t->attended_bytes));
    json_object_set_new(o, "freed_bytes", json_u64(t->freed_bytes));
    if (counts) {
        json_object_set_new(o, "salience_layers", json_u64(t->salience_layers));
        json_object_set_new(o, "evict_layers", json_u64(t->evict_layers));
        json_object_set_new(o, "none_layers", json_u64(t->none_layers));
        json_object_set_new(o, "no_kv_layers", json_u64(t->no_kv_layers));
    }
    return o;
}

static int print_json(const kvt_model *m, const census_opts *o, const kvt_census_totals *t,
                      const kvt_census_totals *by_policy, const kvt_census_totals *sh) {
    json_t *root = json_object();
    json_object_set_new(root, "model_type", json_string(kvt_model_type(m)));
    json_object_set_new(root, "dtype", json_string(kvt_dtype_name(o->dtype)));
    json_object_set_new(root, "n_layers", json_integer(kvt_model_n_layers(m)));
    json_object_set_new(root, "kv_bytes_per_token", json_u64(t->kv_bytes_per_token));
    json_object_set_new(root, "context", json_u64(o->context));
    json_object_set_new(root, "concurrency", json_u64(o->concurrency));
    json_object_set_new(root, "ratio", json_real(o->ratio));
    json_t *layers = json_array();
    for (uint32_t i = 0; i < kvt_model_n_layers(m); i++) {
        const kvt_layer_spec *l = kvt_model_layer(m, i);
        json_t *e = json_object();
        json_object_set_new(e, "index", json_integer(i));
        json_object_set_new(e, "kind", json_string(kvt_layer_kind_name(l->kind)));
        json_object_set_new(e, "policy",
                            json_string(kvt_policy_name(kvt_policy_for_kind(l->kind))));
        json_object_set_new(e, "bytes_per_token", json_u64(kvt_layer_bytes_per_token(l)));
        if (l->kind != KVT_LAYER_NO_KV) {
            json_object_set_new(e, "n_kv_heads", json_integer(l->n_kv_heads));
            json_object_set_new(e, "n_planes", json_integer(l->n_planes));
            json_object_set_new(e, "head_dim", json_integer(l->head_dim));
            json_object_set_new(e, "row_bytes", json_integer(l->row_bytes));
        }
        if (l->kind == KVT_LAYER_SLIDING)
            json_object_set_new(e, "sliding_window", json_integer(l->sliding_window));
        json_object_set_new(e, "n_q_heads", json_integer(l->n_q_heads));
        json_array_append_new(layers, e);
    }
    json_object_set_new(root, "layers", layers);
    json_object_set_new(root, "totals", totals_json(t, true));
    json_t *bp = json_object();
    for (size_t p = 0; p < 3; p++)
        json_object_set_new(bp, kvt_policy_name(k_policies[p]), totals_json(&by_policy[p], false));
    json_object_set_new(root, "by_policy", bp);
    if (o->shared_prefix) {
        json_object_set_new(root, "shared_prefix", json_u64(o->shared_prefix));
        json_object_set_new(root, "shared_totals", totals_json(sh, false));
    }
    int rc =
        json_dumpf(root, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (rc != 0)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "cannot write JSON to stdout");
    fputc('\n', stdout);
    return INSPECT_EXIT_OK;
}

int inspect_census(int argc, char **argv) {
    census_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc < 0)
        return INSPECT_EXIT_OK; /* --help */
    if (rc != INSPECT_EXIT_OK)
        return rc;
    char err[512] = "";
    kvt_model *m = NULL;
    kvt_status s = kvt_model_from_file(o.path, o.dtype, &m, err, sizeof err);
    if (s != KVT_OK)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s (%s)", err, kvt_status_name(s));
    kvt_census_totals t, by_policy[3], sh;
    s = kvt_model_census(m, o.context, o.concurrency, o.ratio, &t);
    if (s == KVT_OK)
        s = kvt_model_census_shared(m, o.context, o.concurrency, o.ratio, o.shared_prefix, &sh);
    for (size_t p = 0; p < 3 && s == KVT_OK; p++)
        s = policy_totals(m, k_policies[p], &o, &by_policy[p]);
    if (s != KVT_OK) {
        kvt_model_destroy(m);
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "totals: %s (%s)",
                             s == KVT_ERR_OUT_OF_RANGE
                                 ? "bytes overflow 64 bits at this context x concurrency"
                                 : kvt_strerror(s),
                             kvt_status_name(s));
    }
    if (o.json)
        rc = print_json(m, &o, &t, by_policy, &sh);
    else
        print_text(m, &o, &t, by_policy, &sh);
    kvt_model_destroy(m);
    if (!o.json && fflush(stdout) != 0)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "cannot write to stdout");
    return rc;
}
