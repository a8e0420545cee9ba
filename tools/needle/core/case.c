/*
 * case.c — nd_case lifecycle, names, and the kvtier trace bridge (lib/kvtier_trace.h): a case is
 * saved as a trace (one MLA or GQA layer, rows in chunks, one query step per target, needles,
 * targets, provenance text) and a trace is loaded back as a case (only the targeted query
 * steps).
 */
#include "nd_internal.h"

#include "kvtier_ref.h"
#include "kvtier_trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int nd_fail(char *err, size_t len, int code, const char *fmt, ...) {
    if (err && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, len, fmt, ap);
        va_end(ap);
    }
    return code;
}

static const char *const k_sal_names[ND_SAL_COUNT] = {"strong", "weak", "none", "natural",
                                                      "trace"};
static const char *const k_mode_names[ND_MODE_COUNT] = {"salience", "random", "dense", "recall",
                                                        "promote"};

const char *nd_salience_name(nd_salience s) {
    return (unsigned)s < ND_SAL_COUNT ? k_sal_names[s] : "?";
}

int nd_salience_parse(const char *s, nd_salience *out) {
    for (int i = 0; i < ND_SAL_COUNT; i++)
        if (strcmp(s, k_sal_names[i]) == 0) {
            *out = (nd_salience)i;
            return 0;
        }
    return -1;
}

const char *nd_mode_name(nd_mode m) {
    return (unsigned)m < ND_MODE_COUNT ? k_mode_names[m] : "?";
}

int nd_mode_parse(const char *s, nd_mode *out) {
    for (int i = 0; i < ND_MODE_COUNT; i++)
        if (strcmp(s, k_mode_names[i]) == 0) {
            *out = (nd_mode)i;
            return 0;
        }
    return -1;
}

void nd_widen(const uint8_t *row, kvt_dtype dt, uint32_t n, float *out) {
    for (uint32_t i = 0; i < n; i++)
        out[i] = kvt_ref_load(row, dt, i);
}

void nd_narrow(uint8_t *row, kvt_dtype dt, uint32_t n, const float *in) {
    for (uint32_t i = 0; i < n; i++)
        kvt_ref_store(row, dt, i, in[i]);
}

int nd_spec_layout_check(const kvt_layer_spec *sp, char *msg, size_t len) {
    const uint32_t elt = kvt_dtype_bytes(sp->dtype);
    if (sp->dtype != KVT_DTYPE_BF16 && sp->dtype != KVT_DTYPE_FP16 &&
        sp->dtype != KVT_DTYPE_FP32)
        return nd_fail(msg, len, -1, "row dtype %s not supported by the reference attention "
                       "(bf16, fp16, fp32)", kvt_dtype_name(sp->dtype));
    if (sp->head_dim != sp->value_dim + sp->branch_dim)
        return nd_fail(msg, len, -1, "head_dim %u != value_dim %u + branch_dim %u; the reference "
                       "attention reads the key as the row's first head_dim values",
                       sp->head_dim, sp->value_dim, sp->branch_dim);
    if (sp->branch_dtype != sp->dtype)
        return nd_fail(msg, len, -1, "branch_dtype %s != dtype %s; the reference attention "
                       "reads the whole key as dtype", kvt_dtype_name(sp->branch_dtype),
                       kvt_dtype_name(sp->dtype));
    if ((uint64_t)sp->branch_offset != (uint64_t)sp->value_dim * elt)
        return nd_fail(msg, len, -1, "branch_offset %u != value_dim %u x %u bytes; the "
                       "reference attention reads the branch right after the values",
                       sp->branch_offset, sp->value_dim, elt);
    if ((uint64_t)sp->head_dim * elt > sp->row_bytes)
        return nd_fail(msg, len, -1, "row_bytes %u < head_dim %u x %u bytes", sp->row_bytes,
                       sp->head_dim, elt);
    return 0;
}

void nd_case_free(nd_case *c) {
    if (!c)
        return;
    free(c->rows);
    free(c->vrows);
    free(c->needles);
    if (c->targets)
        for (uint32_t i = 0; i < c->n_targets; i++)
            free(c->targets[i].q);
    free(c->targets);
    free(c->text);
    free(c->decode_q);
    free(c->decode_target);
    free(c->qbasis);
    memset(c, 0, sizeof *c);
}

/* ------------------------------------------------------------------------------------------- */
/* Save                                                                                         */
/* ------------------------------------------------------------------------------------------- */
#define ROW_CHUNK 65536u

int nd_case_save(const nd_case *c, const char *path, char *err, size_t err_len) {
    kvt_trace_meta meta;
    memset(&meta, 0, sizeof meta);
    meta.prompt_rows = c->prompt_rows;
    meta.n_model_layers = c->layer + 1;
    meta.text = c->text;
    kvt_trace_writer *w = NULL;
    char e2[512];
    kvt_status s = kvt_trace_writer_open(path, &meta, &w, e2, sizeof e2);
    if (s != KVT_OK)
        return nd_fail(err, err_len, ND_EIO, "%s: %s", path, e2);
    const kvt_layer_spec *sp = &c->spec;
    const size_t tb = nd_token_bytes(sp);
    s = kvt_trace_write_layer(w, c->layer, sp);
    for (uint32_t pl = 0; pl < (nd_case_gqa(c) ? 2u : 1u); pl++) {
        const uint8_t *src = pl ? c->vrows : c->rows;
        for (uint64_t r = 0; s == KVT_OK && r < c->n_rows; r += ROW_CHUNK) {
            uint64_t n = c->n_rows - r < ROW_CHUNK ? c->n_rows - r : ROW_CHUNK;
            s = kvt_trace_write_rows(w, c->layer, pl, src + r * tb, n, (size_t)n * tb);
        }
    }
    size_t qbytes = (size_t)c->n_q_heads * c->q_dim * sizeof(float);
    /* With a decode phase every decode step is a query step (step k at position
     * decode_start + k + 1: filler and needle queries alike), the targets naming theirs; else
     * one query step per target. */
    for (uint32_t k = 0; s == KVT_OK && c->decode_start && k < c->n_decode; k++) {
        uint64_t pos = c->decode_start + k + 1;
        s = kvt_trace_write_queries(w, c->layer, KVT_DTYPE_FP32, c->n_q_heads, c->q_dim, &pos,
                                    c->decode_q + (size_t)k * c->n_q_heads * c->q_dim, 1,
                                    qbytes);
    }
    for (uint32_t i = 0; s == KVT_OK && !c->decode_start && i < c->n_targets; i++) {
        uint64_t pos = c->targets[i].position;
        s = kvt_trace_write_queries(w, c->layer, KVT_DTYPE_FP32, c->n_q_heads, c->q_dim, &pos,
                                    c->targets[i].q, 1, qbytes);
    }
    kvt_trace_needle *nds = calloc(c->n_needles ? c->n_needles : 1, sizeof *nds);
    kvt_trace_target *tgs = calloc(c->n_targets ? c->n_targets : 1, sizeof *tgs);
    if (!nds || !tgs) {
        free(nds), free(tgs);
        kvt_trace_writer_abort(w);
        return nd_fail(err, err_len, ND_ENOMEM, "trace lists");
    }
    for (uint32_t i = 0; i < c->n_needles; i++) {
        nds[i].layer = c->layer;
        nds[i].first_row = c->needles[i].first_row;
        nds[i].n_rows = c->needles[i].n_rows;
    }
    for (uint32_t i = 0; i < c->n_targets; i++) {
        tgs[i].step = c->decode_start ? c->targets[i].step : i;
        tgs[i].needle = c->targets[i].needle;
        tgs[i].n_heads = c->targets[i].n_heads;
        tgs[i].heads = c->targets[i].heads;
    }
    if (s == KVT_OK && c->n_needles)
        s = kvt_trace_write_needles(w, nds, c->n_needles);
    if (s == KVT_OK && c->n_targets)
        s = kvt_trace_write_targets(w, tgs, c->n_targets);
    free(nds), free(tgs);
    if (s != KVT_OK) {
        snprintf(e2, sizeof e2, "%s", kvt_trace_writer_last_error(w));
        kvt_trace_writer_abort(w);
        return nd_fail(err, err_len, ND_EIO, "%s: %s (%s)", path, kvt_status_name(s), e2);
    }
    s = kvt_trace_writer_close(w, e2, sizeof e2);
    if (s != KVT_OK)
        return nd_fail(err, err_len, ND_EIO, "%s: %s", path, e2);
    return ND_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* Load                                                                                         */
/* ------------------------------------------------------------------------------------------- */

/* Value of "key=" on its own line of text, or NULL. */
static const char *text_value(const char *text, const char *key, char *buf, size_t len) {
    size_t kl = strlen(key);
    for (const char *p = text; p && *p;) {
        const char *eol = strchr(p, '\n');
        size_t ll = eol ? (size_t)(eol - p) : strlen(p);
        if (ll > kl && strncmp(p, key, kl) == 0 && p[kl] == '=') {
            size_t vl = ll - kl - 1 < len - 1 ? ll - kl - 1 : len - 1;
            memcpy(buf, p + kl + 1, vl);
            buf[vl] = 0;
            return buf;
        }
        p = eol ? eol + 1 : NULL;
    }
    return NULL;
}

static int cmp_target_pos(const void *a, const void *b) {
    const nd_target *x = a, *y = b;
    if (x->position != y->position)
        return x->position < y->position ? -1 : 1;
    return x->step < y->step ? -1 : (x->step > y->step);
}

int nd_case_load(const char *path, uint32_t layer, nd_case *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    char e2[512];
    kvt_trace *t = NULL;
    kvt_status s = kvt_trace_open(path, &t, e2, sizeof e2);
    if (s != KVT_OK)
        return nd_fail(err, err_len, ND_EIO, "%s: %s", path, e2);
    uint32_t n_nd = 0, n_tg = 0;
    const kvt_trace_needle *tn = kvt_trace_needles(t, &n_nd);
    const kvt_trace_target *tt = kvt_trace_targets(t, &n_tg);
    kvt_trace_layer info;
    memset(&info, 0, sizeof info);
    int rc = ND_OK;
    if (layer == UINT32_MAX) {
        bool found = false;
        for (uint32_t i = 0; i < kvt_trace_n_layers(t) && !found; i++) {
            if (kvt_trace_layer_info(t, i, &info) != KVT_OK || info.n_steps == 0)
                continue;
            if (info.spec.kind != KVT_LAYER_MLA_NOPE && info.spec.kind != KVT_LAYER_MLA_ROPE &&
                info.spec.kind != KVT_LAYER_GQA_ROPE)
                continue;
            for (uint32_t k = 0; k < n_nd; k++)
                if (tn[k].layer == info.layer)
                    found = true;
        }
        if (!found) {
            rc = nd_fail(err, err_len, ND_EIO, "%s: no MLA or GQA-RoPE layer with queries and "
                         "needles", path);
            goto fail;
        }
    } else if (kvt_trace_find_layer(t, layer, &info) != KVT_OK) {
        rc = nd_fail(err, err_len, ND_EIO, "%s: layer %u is not in the trace", path, layer);
        goto fail;
    }
    const kvt_layer_spec *sp = &info.spec;
    const bool gqa = sp->kind == KVT_LAYER_GQA_ROPE;
    if (gqa) {
        if (nd_gqa_layout_check(sp, info.n_q_heads, info.q_dim, e2, sizeof e2) != 0) {
            rc = nd_fail(err, err_len, ND_EIO, "%s: layer %u: %s", path, info.layer, e2);
            goto fail;
        }
    } else if ((sp->kind != KVT_LAYER_MLA_NOPE && sp->kind != KVT_LAYER_MLA_ROPE) ||
               sp->n_planes != 1 || sp->n_kv_heads != 1) {
        rc = nd_fail(err, err_len, ND_EIO, "%s: layer %u is %s; the needle suite replays MLA "
                     "and GQA-RoPE layers", path, info.layer, kvt_layer_kind_name(sp->kind));
        goto fail;
    }
    if (!gqa && nd_spec_layout_check(sp, e2, sizeof e2) != 0) {
        rc = nd_fail(err, err_len, ND_EIO, "%s: layer %u: %s", path, info.layer, e2);
        goto fail;
    }
    for (uint32_t k = 0; k < n_nd; k++)
        if (tn[k].layer == info.layer && tn[k].n_rows > ND_MAX_NEEDLE_ROWS) {
            rc = nd_fail(err, err_len, ND_EIO, "%s: needle %u of layer %u has %llu rows; the "
                         "needle suite supports at most %u (ND_MAX_NEEDLE_ROWS)", path, k,
                         info.layer, (unsigned long long)tn[k].n_rows, ND_MAX_NEEDLE_ROWS);
            goto fail;
        }
    if (info.q_dim != sp->head_dim || info.n_q_heads == 0 || info.n_q_heads > ND_MAX_HEADS) {
        rc = nd_fail(err, err_len, ND_EIO, "%s: queries of layer %u are %u heads x %u values; "
                     "need 1..%u heads of %u (absorbed MLA queries)", path, info.layer,
                     info.n_q_heads, info.q_dim, ND_MAX_HEADS, sp->head_dim);
        goto fail;
    }
    out->spec = *sp;
    out->layer = info.layer;
    out->n_rows = info.n_tokens;
    out->prompt_rows = kvt_trace_prompt_rows(t);
    out->n_q_heads = info.n_q_heads;
    out->q_dim = info.q_dim;
    const size_t tb = nd_token_bytes(sp);
    if ((double)info.n_tokens * tb * (gqa ? 2 : 1) > 16e9) {
        rc = nd_fail(err, err_len, ND_EIO, "%s: %llu rows do not fit the 16 GB the runner allows",
                     path, (unsigned long long)info.n_tokens);
        goto fail;
    }
    /* kvt_trace_read_rows checks a chunk's CRC only when a read covers the whole chunk (reads
     * here are 65,536-row windows, chunks any size): check every CRC once, streaming. */
    if ((s = kvt_trace_verify(t)) != KVT_OK) {
        rc = nd_fail(err, err_len, ND_EIO, "%s: %s: %s", path, kvt_status_name(s),
                     kvt_trace_last_error(t));
        goto fail;
    }
    out->rows = malloc((size_t)info.n_tokens * tb + 1);
    if (gqa)
        out->vrows = malloc((size_t)info.n_tokens * tb + 1);
    uint32_t *nd_map = malloc(sizeof(uint32_t) * (n_nd ? n_nd : 1));
    out->needles = calloc(n_nd ? n_nd : 1, sizeof *out->needles);
    out->targets = calloc(n_tg ? n_tg : 1, sizeof *out->targets);
    if (!out->rows || (gqa && !out->vrows) || !nd_map || !out->needles || !out->targets) {
        free(nd_map);
        rc = nd_fail(err, err_len, ND_ENOMEM, "%s: %llu rows", path,
                     (unsigned long long)info.n_tokens);
        goto fail;
    }
    for (uint32_t pl = 0; pl < (gqa ? 2u : 1u); pl++) { /* GQA: K, then V */
        uint8_t *dst = pl ? out->vrows : out->rows;
        for (uint64_t r = 0; r < info.n_tokens; r += ROW_CHUNK) {
            uint64_t n = info.n_tokens - r < ROW_CHUNK ? info.n_tokens - r : ROW_CHUNK;
            s = kvt_trace_read_rows(t, info.layer, pl, r, n, dst + r * tb, (size_t)n * tb);
            if (s != KVT_OK) {
                free(nd_map);
                rc = nd_fail(err, err_len, ND_EIO, "%s: rows: %s", path,
                             kvt_trace_last_error(t));
                goto fail;
            }
        }
    }
    const char *text = kvt_trace_text(t, NULL);
    out->text = strdup(text ? text : "");
    char buf[128], key[64];
    if (text_value(out->text, "seed", buf, sizeof buf))
        out->seed = strtoull(buf, NULL, 10);
    if (text_value(out->text, "scale", buf, sizeof buf))
        out->scale = strtod(buf, NULL);
    for (uint32_t k = 0; k < n_nd; k++) {
        nd_map[k] = UINT32_MAX;
        if (tn[k].layer != info.layer)
            continue;
        nd_needle *nd = &out->needles[out->n_needles];
        nd->first_row = tn[k].first_row;
        nd->n_rows = tn[k].n_rows;
        nd->depth = (double)tn[k].first_row / (double)info.n_tokens;
        nd->salience = ND_SAL_TRACE;
        snprintf(key, sizeof key, "needle.%u.salience", k);
        if (text_value(out->text, key, buf, sizeof buf))
            nd_salience_parse(buf, &nd->salience);
        snprintf(key, sizeof key, "needle.%u.depth", k);
        if (text_value(out->text, key, buf, sizeof buf))
            nd->depth = strtod(buf, NULL);
        snprintf(key, sizeof key, "needle.%u.band_miss", k);
        if (text_value(out->text, key, buf, sizeof buf))
            nd->band_miss = strcmp(buf, "1") == 0;
        nd_map[k] = out->n_needles++;
    }
    size_t qfloats = (size_t)info.n_q_heads * info.q_dim;
    for (uint32_t k = 0; k < n_tg; k++) {
        if (tt[k].needle >= n_nd || nd_map[tt[k].needle] == UINT32_MAX)
            continue;
        nd_target *tg = &out->targets[out->n_targets];
        tg->step = tt[k].step;
        tg->needle = nd_map[tt[k].needle];
        tg->n_heads = tt[k].n_heads < ND_MAX_HEADS ? tt[k].n_heads : ND_MAX_HEADS;
        memcpy(tg->heads, tt[k].heads, sizeof(uint32_t) * tg->n_heads);
        tg->q = malloc(sizeof(float) * qfloats);
        out->n_targets++;
        if (!tg->q) {
            free(nd_map);
            rc = nd_fail(err, err_len, ND_ENOMEM, "query");
            goto fail;
        }
        s = kvt_trace_read_query(t, info.layer, tg->step, KVT_DTYPE_FP32, tg->q,
                                 sizeof(float) * qfloats, &tg->position);
        if (s != KVT_OK) {
            free(nd_map);
            rc = nd_fail(err, err_len, ND_EIO, "%s: query step %llu: %s", path,
                         (unsigned long long)tg->step, kvt_trace_last_error(t));
            goto fail;
        }
    }
    free(nd_map);
    if (out->n_targets == 0) {
        rc = nd_fail(err, err_len, ND_EIO, "%s: layer %u has no needle targets", path,
                     info.layer);
        goto fail;
    }
    qsort(out->targets, out->n_targets, sizeof *out->targets, cmp_target_pos);
    /* A decode phase is what the sections say, never provenance text: the layer's query steps
     * (two or more) are the decode steps of the trace's last rows, step k at position
     * decode_start + k + 1 (its query sees the rows before it and its own), the last one at
     * the last row. decode_start is then the first step's position - 1, the haystack's rows;
     * any writer of the format gives it so (docs/trace-format.md, "Decode phase"). A trace
     * whose query steps are anything else (one per needle target, as the generator writes
     * without a decode phase) has none. */
    {
        /* the positions tell: the last step at the last row, so the first at rows - steps + 1 */
        const uint64_t ds = info.n_steps < out->n_rows ? out->n_rows - info.n_steps : 0;
        bool ok = !gqa && info.n_steps >= 2 && info.n_steps <= UINT32_MAX && ds > 0;
        if (ok) {
            out->decode_q = malloc(sizeof(float) * qfloats * info.n_steps);
            out->decode_target = malloc(sizeof(int32_t) * info.n_steps);
            if (!out->decode_q || !out->decode_target) {
                rc = nd_fail(err, err_len, ND_ENOMEM, "decode queries");
                goto fail;
            }
        }
        for (uint64_t k = 0; ok && k < info.n_steps; k++) {
            uint64_t pos = 0;
            s = kvt_trace_read_query(t, info.layer, k, KVT_DTYPE_FP32, out->decode_q + k * qfloats,
                                     sizeof(float) * qfloats, &pos);
            if (s != KVT_OK) {
                rc = nd_fail(err, err_len, ND_EIO, "%s: query step %llu: %s", path,
                             (unsigned long long)k, kvt_trace_last_error(t));
                goto fail;
            }
            ok = pos == ds + k + 1;
            out->decode_target[k] = -1;
            for (uint32_t i = 0; i < out->n_targets; i++)
                if (out->targets[i].step == k)
                    out->decode_target[k] = (int32_t)i;
        }
        if (ok) {
            out->decode_start = ds;
            out->n_decode = (uint32_t)info.n_steps;
        } else {
            free(out->decode_q);
            free(out->decode_target);
            out->decode_q = NULL;
            out->decode_target = NULL;
        }
    }
    kvt_trace_close(t);
    return ND_OK;
fail:
    kvt_trace_close(t);
    nd_case_free(out);
    return rc;
}

/* ------------------------------------------------------------------------------------------- */
/* Non-finite rows                                                                              */
/* ------------------------------------------------------------------------------------------- */

/* Whether value i of a row of dtype dt is NaN or Inf: its exponent field is all ones (bf16: 8
 * bits at 7..14, fp16: 5 bits at 10..14, fp32: 8 bits at 23..30). Read from the bits, so a
 * signalling NaN is not quietened and nothing is widened. */
static bool value_nonfinite(const uint8_t *row, kvt_dtype dt, uint32_t i) {
    if (dt == KVT_DTYPE_FP32) {
        uint32_t u;
        memcpy(&u, row + 4u * i, 4);
        return (u & 0x7f800000u) == 0x7f800000u;
    }
    uint16_t h;
    memcpy(&h, row + 2u * i, 2);
    if (dt == KVT_DTYPE_FP16)
        return (h & 0x7c00u) == 0x7c00u;
    return (h & 0x7f80u) == 0x7f80u; /* bf16 */
}

uint64_t nd_case_nonfinite_rows(const nd_case *c, uint64_t *first_row) {
    const kvt_layer_spec *sp = &c->spec;
    uint64_t n = 0, first = UINT64_MAX;
    /* GQA: every KV head's key and value (the reference reads both); MLA: the key. */
    const uint32_t per_token = nd_case_gqa(c) ? 2 * sp->n_kv_heads : 1;
    for (uint64_t r = 0; r < c->n_rows; r++) {
        bool bad = false;
        for (uint32_t x = 0; x < per_token && !bad; x++) {
            const uint8_t *plane = x >= sp->n_kv_heads && nd_case_gqa(c) ? c->vrows : c->rows;
            const uint8_t *row = plane + r * nd_token_bytes(sp) +
                                 (size_t)(x % sp->n_kv_heads) * sp->row_bytes;
            for (uint32_t i = 0; i < sp->head_dim && !bad; i++)
                bad = value_nonfinite(row, sp->dtype, i);
        }
        if (bad && n++ == 0)
            first = r;
    }
    if (first_row)
        *first_row = first;
    return n;
}

/* ------------------------------------------------------------------------------------------- */
/* σ percentiles                                                                                */
/* ------------------------------------------------------------------------------------------- */
int nd_case_sigma_pct(const nd_case *c, uint32_t B, uint32_t kappa, double *out, char *err,
                      size_t err_len) {
    return nd_case_sigma_pct_basis(c, B, kappa, KVT_SIGMA_FOURIER, out, err, err_len);
}

int nd_case_sigma_pct_basis(const nd_case *c, uint32_t B, uint32_t kappa, kvt_sigma_basis basis,
                            double *out, char *err, size_t err_len) {
    const kvt_layer_spec *sp = &c->spec;
    if (nd_case_gqa(c)) { /* no salience branch: σ does not exist on GQA layers */
        for (uint32_t i = 0; i < c->n_needles; i++)
            out[i] = NAN;
        return ND_OK;
    }
    float *sig = malloc(sizeof(float) * B);
    kvt_ref_sigma *ref = NULL;
    int rc = ND_OK;
    if (!sig) {
        rc = nd_fail(err, err_len, ND_ENOMEM, "sigma scratch");
        goto done;
    }
    kvt_status st = kvt_ref_sigma_create_basis(B, kappa, sp->branch_dim, basis, &ref);
    if (st == KVT_ERR_OUT_OF_MEMORY) {
        rc = nd_fail(err, err_len, ND_ENOMEM, "sigma scratch");
        goto done;
    }
    if (st != KVT_OK) {
        rc = nd_fail(err, err_len, ND_EARG, "block rows %u / kappa %u invalid", B, kappa);
        goto done;
    }
    uint64_t cur_block = UINT64_MAX;
    for (uint32_t i = 0; i < c->n_needles; i++) {
        const nd_needle *nd = &c->needles[i];
        double mn = INFINITY;
        for (uint64_t r = nd->first_row; r < nd->first_row + nd->n_rows; r++) {
            uint64_t b = r / B;
            if ((b + 1) * (uint64_t)B > c->n_rows) {
                mn = NAN;
                break;
            }
            if (b != cur_block) {
                if (kvt_ref_sigma_block(ref, c->rows + b * B * sp->row_bytes, sp->row_bytes,
                                        sp->branch_offset, sp->branch_dtype, sig) != KVT_OK) {
                    rc = nd_fail(err, err_len, ND_EARG, "branch layout of the case");
                    goto done;
                }
                cur_block = b;
            }
            uint32_t u = (uint32_t)(r - b * B), below = 0;
            for (uint32_t v = 0; v < B; v++)
                if (v != u && sig[v] < sig[u])
                    below++;
            double p = 100.0 * below / (double)(B - 1);
            if (p < mn)
                mn = p;
        }
        out[i] = mn;
    }
done:
    kvt_ref_sigma_destroy(ref);
    free(sig);
    return rc;
}
