/*
 * calibrate.c — `kvtier-inspect calibrate`: recall bases from kvtier traces.
 *
 * MLA-NoPE layer (docs/recall.md §5, DESIGN §2.1: "V = top-64 eigenvectors of the centred
 * covariance of calibration queries' latent parts"): every query step of the layer, in every
 * trace given, contributes one sample per query head: the first value_dim elements of the
 * absorbed query (the latent part; 512 of 576 on MLA). The covariance is accumulated in double
 * around the first sample (a shift that keeps a large mean from cancelling digits) and centred.
 * Rows are not queries here: a trace that carries no queries for the layer is refused with a
 * message (the basis must span the queries' energy, which is what widens the certificate; a basis
 * fitted to the rows answers another question). One basis file, -o FILE.
 *
 * RoPE layers (GQA/MHA with two planes K, V; MLA-RoPE with one latent plane; docs/recall.md §9):
 * the archive's sketch projects each archived row's post-RoPE KEY on its KV head's basis, so the
 * samples are the traced ROWS' keys, not queries: per KV head, every row of the K plane (head_dim
 * values; MLA-RoPE: the latent, the first kv_lora_rank = value_dim values of the one head, the
 * rotated branch being scored exactly). The matrix is the UNCENTRED second moment Σ k kᵀ / N
 * (the sketch projects uncentred keys: its top right singular vectors are the top eigenvectors of
 * this matrix — what tools/gemma/probe.py calibrate_bases takes by SVD). One basis file per KV
 * head, PREFIX.h<H> for -o PREFIX, for kvt_ctx_load_recall_head_basis.
 *
 * Either way LAPACKE_dsyevr gives the top-R eigenpairs (tools/common/eigen.c, which kvtier-needle's
 * --recall-adapt fits with too); V's row k is the eigenvector of the k-th
 * largest eigenvalue, its sign fixed so that its largest component is positive (the file is a
 * pure function of the samples), then the rows are re-orthonormalised in double (modified
 * Gram-Schmidt, twice: kvt_orthonormalise_rows) before the fp32 rounding, and ‖V Vᵀ − I‖_F of
 * the fp32 rows is measured and printed (the sound mode needs <= 2^-20; the tool refuses to
 * write a looser basis). The captured share — the R eigenvalues' sum over the matrix's trace —
 * is printed and stored in the file. Each trace is verified whole (kvt_trace_verify: every CRC) before a sample is taken.
 *
 * Built without LAPACKE (Debian liblapacke-dev absent at configure time), the subcommand says so
 * and exits 1.
 */
#include "inspect.h"

#include "../common/eigen.h" /* the accumulator and the eigenvectors, shared with kvtier-needle */

#include <kvtier.h>
#include <kvtier_ref.h> /* kvt_ref_load: the library's one bf16/fp16/fp32 -> fp32 element load */
#include <kvtier_trace.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "calibrate"
#define MAX_TRACES 256

static void calibrate_usage(FILE *f) {
    fprintf(f,
            "usage: kvtier-inspect calibrate TRACE... -o OUT [--layer L] [--rank R]\n"
            "  the recall basis of model layer L (default: the first traced MLA-NoPE layer, else\n"
            "  the first traced RoPE layer), R (default 64) eigenvectors, from every TRACE:\n"
            "  MLA-NoPE layer: the top-R eigenvectors of the centred covariance of the layer's\n"
            "    query latents (every step and head); writes the basis file OUT for\n"
            "    kvt_ctx_load_recall_basis (docs/recall.md section 5)\n"
            "  GQA/MHA or MLA-RoPE layer: per KV head H, the top-R eigenvectors of the uncentred\n"
            "    second moment of the traced ROWS' keys (not queries: K plane, head_dim values;\n"
            "    MLA-RoPE: the latent, one head 0); writes OUT.hH for each head, for\n"
            "    kvt_ctx_load_recall_head_basis (docs/recall.md section 9)\n"
            "  prints the samples, the captured share and |V V^T - I|_F of each basis\n");
}

/* Strict decimal in [0, max]. */
static bool parse_u32(const char *s, uint32_t max, uint32_t *out) {
    if (!s || *s < '0' || *s > '9')
        return false;
    errno = 0;
    char *end = NULL;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *end || v > max)
        return false;
    *out = (uint32_t)v;
    return true;
}

typedef struct cal_opts {
    const char *traces[MAX_TRACES];
    int n_traces;
    const char *out;
    bool layer_given;
    uint32_t layer, rank;
} cal_opts;

static int parse_args(int argc, char **argv, cal_opts *o) {
    memset(o, 0, sizeof *o);
    o->rank = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            calibrate_usage(stdout);
            return -1;
        }
        if (!strcmp(a, "-o") || !strcmp(a, "--layer") || !strcmp(a, "--rank")) {
            if (i + 1 >= argc)
                return inspect_error(INSPECT_EXIT_USAGE, CMD, "%s needs a value", a);
            const char *v = argv[++i];
            if (!strcmp(a, "-o"))
                o->out = v;
            else if (!strcmp(a, "--layer")) {
                if (!parse_u32(v, KVT_TRACE_MAX_LAYERS - 1, &o->layer))
                    return inspect_error(INSPECT_EXIT_USAGE, CMD, "--layer: bad layer '%s'", v);
                o->layer_given = true;
            } else if (!parse_u32(v, KVT_RECALL_MAX_RANK, &o->rank) || o->rank == 0)
                return inspect_error(INSPECT_EXIT_USAGE, CMD, "--rank: '%s' not in 1..%u", v,
                                     KVT_RECALL_MAX_RANK);
            continue;
        }
        if (a[0] == '-')
            return inspect_error(INSPECT_EXIT_USAGE, CMD, "unknown option '%s'", a);
        if (o->n_traces == MAX_TRACES)
            return inspect_error(INSPECT_EXIT_USAGE, CMD, "more than %d traces", MAX_TRACES);
        o->traces[o->n_traces++] = a;
    }
    if (o->n_traces == 0 || !o->out) {
        calibrate_usage(stderr);
        return INSPECT_EXIT_USAGE;
    }
    return 0;
}

#define CHUNK_ROWS 256u

/* What the traces gave for the layer: one accumulator per KV head (keys) or one (queries). */
typedef struct cal_state {
    bool keys; /* fitted to the rows' keys (RoPE layers), else to query latents (MLA-NoPE) */
    kvt_layer_kind kind;
    uint32_t dim, n_heads;
    eig_acc *acc;
    uint64_t units; /* query steps or rows read */
} cal_state;

static void state_free(cal_state *c) {
    for (uint32_t h = 0; c->acc && h < c->n_heads; h++)
        eig_acc_free(&c->acc[h]);
    free(c->acc);
    c->acc = NULL;
}

static bool key_kind(kvt_layer_kind k) {
    return k == KVT_LAYER_GQA_ROPE || k == KVT_LAYER_GQA_NOPE || k == KVT_LAYER_MLA_ROPE;
}

static bool all_finite(const float *x, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return false;
    return true;
}

/* The first traced MLA-NoPE layer, else the first traced RoPE layer (GQA/MHA-RoPE, MLA-RoPE). */
static bool default_layer(const kvt_trace *t, uint32_t *layer) {
    kvt_trace_layer li;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < kvt_trace_n_layers(t); i++)
            if (kvt_trace_layer_info(t, i, &li) == KVT_OK &&
                (pass == 0 ? li.spec.kind == KVT_LAYER_MLA_NOPE
                           : li.spec.kind == KVT_LAYER_GQA_ROPE ||
                                 li.spec.kind == KVT_LAYER_MLA_ROPE)) {
                *layer = li.layer;
                return true;
            }
    return false;
}

/* Every query step of the layer: one latent sample per query head. */
static int add_queries(kvt_trace *t, const char *path, const kvt_trace_layer *li, cal_state *c) {
    if (li->n_steps == 0)
        return inspect_error(INSPECT_EXIT_FAIL, CMD,
                             "%s: layer %u carries no queries (the trace holds %llu rows and no "
                             "QUERIES section for it); calibration needs the layer's absorbed "
                             "queries",
                             path, li->layer, (unsigned long long)li->n_tokens);
    if (li->q_dim < c->dim)
        return inspect_error(INSPECT_EXIT_FAIL, CMD,
                             "%s: layer %u's queries hold %u values, its latent %u", path,
                             li->layer, li->q_dim, c->dim);
    size_t qn = (size_t)li->n_q_heads * li->q_dim;
    float *q = malloc(sizeof(float) * qn);
    int rc = q ? INSPECT_EXIT_OK : inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
    for (uint64_t s = 0; rc == INSPECT_EXIT_OK && s < li->n_steps; s++) {
        if (kvt_trace_read_query(t, li->layer, s, KVT_DTYPE_FP32, q, sizeof(float) * qn, NULL) !=
            KVT_OK) {
            rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: query step %llu: %s", path,
                               (unsigned long long)s, kvt_trace_last_error(t));
            break;
        }
        for (uint32_t h = 0; h < li->n_q_heads; h++) {
            const float *x = q + (size_t)h * li->q_dim;
            if (!all_finite(x, c->dim)) {
                rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                                   "%s: query step %llu head %u holds a NaN or Inf", path,
                                   (unsigned long long)s, h);
                break;
            }
            eig_acc_add(&c->acc[0], x);
        }
        c->units++;
    }
    free(q);
    return rc;
}

/* Every row of the layer's K plane (plane 0): per KV head, its first dim values as one key. */
static int add_rows(kvt_trace *t, const char *path, const kvt_trace_layer *li, cal_state *c) {
    const kvt_layer_spec *sp = &li->spec;
    if (li->n_tokens == 0)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: layer %u holds no rows", path,
                             li->layer);
    const size_t tok_bytes = (size_t)sp->n_kv_heads * sp->row_bytes;
    uint8_t *buf = malloc(tok_bytes * CHUNK_ROWS);
    float *x = malloc(sizeof(float) * c->dim);
    int rc = buf && x ? INSPECT_EXIT_OK : inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
    for (uint64_t first = 0; rc == INSPECT_EXIT_OK && first < li->n_tokens; first += CHUNK_ROWS) {
        uint64_t n = li->n_tokens - first < CHUNK_ROWS ? li->n_tokens - first : CHUNK_ROWS;
        if (kvt_trace_read_rows(t, li->layer, 0, first, n, buf, tok_bytes * n) != KVT_OK) {
            rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: rows %llu..: %s", path,
                               (unsigned long long)first, kvt_trace_last_error(t));
            break;
        }
        for (uint64_t r = 0; r < n && rc == INSPECT_EXIT_OK; r++)
            for (uint32_t h = 0; h < sp->n_kv_heads; h++) {
                const uint8_t *row = buf + r * tok_bytes + (size_t)h * sp->row_bytes;
                for (uint32_t d = 0; d < c->dim; d++)
                    x[d] = kvt_ref_load(row, sp->dtype, d);
                if (!all_finite(x, c->dim)) {
                    rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                                       "%s: row %llu KV head %u holds a NaN or Inf", path,
                                       (unsigned long long)(first + r), h);
                    break;
                }
                eig_acc_add(&c->acc[h], x);
            }
        c->units += n;
    }
    free(buf);
    free(x);
    return rc;
}

/* Check the layer against the earlier traces' (or set the state up from it). */
static int layer_state(const char *path, const kvt_trace_layer *li, cal_state *c) {
    const kvt_layer_spec *sp = &li->spec;
    const bool keys = key_kind(sp->kind);
    if (sp->kind != KVT_LAYER_MLA_NOPE && !keys)
        return inspect_error(INSPECT_EXIT_FAIL, CMD,
                             "%s: layer %u is %s; recall bases are for MLA-NoPE layers (from "
                             "queries) and GQA/MHA or MLA-RoPE layers (from keys)",
                             path, li->layer, kvt_layer_kind_name(sp->kind));
    if (keys && (sp->dtype == KVT_DTYPE_FP8_E4M3 ||
                 (sp->kind == KVT_LAYER_MLA_ROPE) != (sp->n_planes == 1)))
        return inspect_error(INSPECT_EXIT_FAIL, CMD,
                             "%s: layer %u's rows (%u plane%s of %s) get no archive sketches "
                             "(bf16, fp16 or fp32 rows; K and V planes, or one MLA-RoPE plane)",
                             path, li->layer, sp->n_planes, sp->n_planes == 1 ? "" : "s",
                             kvt_dtype_name(sp->dtype));
    const uint32_t dim = keys && sp->kind != KVT_LAYER_MLA_ROPE ? sp->head_dim : sp->value_dim;
    const uint32_t heads = keys ? sp->n_kv_heads : 1;
    if (dim > EIG_MAX_DIM)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: layer %u: dim %u above %u", path,
                             li->layer, dim, EIG_MAX_DIM);
    if (c->acc) {
        if (c->kind != sp->kind || c->dim != dim || c->n_heads != heads)
            return inspect_error(INSPECT_EXIT_FAIL, CMD,
                                 "%s: layer %u is %s, dim %u, %u head%s; earlier traces: %s, "
                                 "dim %u, %u",
                                 path, li->layer, kvt_layer_kind_name(sp->kind), dim, heads,
                                 heads == 1 ? "" : "s", kvt_layer_kind_name(c->kind), c->dim,
                                 c->n_heads);
        return INSPECT_EXIT_OK;
    }
    c->keys = keys;
    c->kind = sp->kind;
    c->dim = dim;
    c->n_heads = heads;
    if (!(c->acc = calloc(heads, sizeof *c->acc)))
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
    for (uint32_t h = 0; h < heads; h++)
        if (eig_acc_init(&c->acc[h], dim, !keys) != EIG_OK)
            return inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
    return INSPECT_EXIT_OK;
}

/* Add the layer's samples of one trace. */
static int add_trace(const char *path, cal_opts *o, cal_state *c) {
    char err[512];
    kvt_trace *t = NULL;
    if (kvt_trace_open(path, &t, err, sizeof err) != KVT_OK)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: %s", path, err);
    int rc = INSPECT_EXIT_OK;
    kvt_trace_layer li;
    /* Every CRC first: reads check a chunk's CRC only when they cover it whole. */
    if (kvt_trace_verify(t) != KVT_OK)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: %s", path, kvt_trace_last_error(t));
    else if (!o->layer_given && !(o->layer_given = default_layer(t, &o->layer)))
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: no MLA-NoPE or RoPE layer traced", path);
    else if (kvt_trace_find_layer(t, o->layer, &li) != KVT_OK)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: layer %u is not traced", path, o->layer);
    else if ((rc = layer_state(path, &li, c)) == INSPECT_EXIT_OK)
        rc = c->keys ? add_rows(t, path, &li, c) : add_queries(t, path, &li, c);
    kvt_trace_close(t);
    return rc;
}

/* ‖V Vᵀ − I‖_F of fp32 rows, in double (what kvt_ctx_set_recall_basis measures). */
static double omega_of(const float *V, uint32_t rank, uint32_t n) {
    double frob = 0;
    for (uint32_t a = 0; a < rank; a++)
        for (uint32_t b = a; b < rank; b++) {
            double dot = 0;
            for (uint32_t d = 0; d < n; d++)
                dot += (double)V[(size_t)a * n + d] * V[(size_t)b * n + d];
            dot -= a == b ? 1.0 : 0.0;
            frob += (a == b ? 1.0 : 2.0) * dot * dot;
        }
    return sqrt(frob);
}

/* Fit, write and report the basis of one accumulator (head `head`, or the NoPE layer's one). */
static int fit_one(const cal_opts *o, const cal_state *c, uint32_t head, const char *path) {
    const eig_acc *a = &c->acc[head];
    char who[64] = "";
    if (c->keys)
        snprintf(who, sizeof who, " KV head %u", head);
    if (o->rank > c->dim || a->n < 2 || a->n <= o->rank)
        return inspect_error(INSPECT_EXIT_FAIL, CMD,
                             "layer %u%s: %llu samples of dim %u cannot give a rank-%u basis "
                             "(more samples than the rank, and a rank of at most the dim, are "
                             "needed)",
                             o->layer, who, (unsigned long long)a->n, c->dim, o->rank);
    float *V = malloc(sizeof(float) * o->rank * c->dim);
    double *w = malloc(sizeof(double) * o->rank);
    double total = 0;
    char err[512];
    int rc = !V || !w ? inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory")
             : eig_top(a, o->rank, V, w, &total, err, sizeof err) != EIG_OK
                 ? inspect_error(INSPECT_EXIT_FAIL, CMD, "%s", err)
                 : INSPECT_EXIT_OK;
    const double omega = rc == INSPECT_EXIT_OK ? omega_of(V, o->rank, c->dim) : 0;
    if (rc == INSPECT_EXIT_OK && !(omega <= 0x1p-20))
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                           "layer %u%s: the fp32 basis is orthonormal only to |V V^T - I|_F = "
                           "%.3g, above the sound mode's 2^-20; nothing written",
                           o->layer, who, omega);
    if (rc == INSPECT_EXIT_OK) {
        double top = 0;
        for (uint32_t k = 0; k < o->rank; k++)
            top += w[k];
        kvt_recall_basis_info info = {.layer = o->layer,
                                      .rank = o->rank,
                                      .dim = c->dim,
                                      .captured = total > 0 ? top / total : NAN,
                                      .samples = a->n};
        kvt_recall_basis_info back;
        if (kvt_recall_basis_write(path, &info, V) != KVT_OK ||
            kvt_recall_basis_read(path, &back, NULL, 0) != KVT_OK)
            rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s", kvt_last_error());
        else
            printf("layer %u%s: %llu samples (%s of %llu %s from %d trace%s), dim %u\n"
                   "rank %u captures %.4f%% of the %s (eigenvalues %.6g .. %.6g, trace %.6g), "
                   "|V V^T - I|_F %.3g\nbasis id 0x%08x written to %s\n",
                   o->layer, who, (unsigned long long)a->n, c->keys ? "keys" : "query latents",
                   (unsigned long long)c->units, c->keys ? "rows" : "query steps", o->n_traces,
                   o->n_traces == 1 ? "" : "s", c->dim, o->rank, 100.0 * info.captured,
                   c->keys ? "uncentred key energy" : "centred variance", w[0], w[o->rank - 1],
                   total, omega, back.id, path);
    }
    free(V);
    free(w);
    return rc;
}

int inspect_calibrate(int argc, char **argv) {
    cal_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc != 0)
        return rc < 0 ? INSPECT_EXIT_OK : rc;
    if (!eig_have_lapacke())
        return inspect_error(INSPECT_EXIT_FAIL, CMD,
                             "this kvtier-inspect was built without LAPACKE (install Debian's "
                             "liblapacke-dev, scripts/deps.sh, and reconfigure)");
    cal_state c;
    memset(&c, 0, sizeof c);
    for (int i = 0; rc == INSPECT_EXIT_OK && i < o.n_traces; i++)
        rc = add_trace(o.traces[i], &o, &c);
    for (uint32_t h = 0; rc == INSPECT_EXIT_OK && h < c.n_heads; h++) {
        char path[4096];
        if (c.keys && snprintf(path, sizeof path, "%s.h%u", o.out, h) >= (int)sizeof path)
            rc = inspect_error(INSPECT_EXIT_USAGE, CMD, "-o: '%s' is too long", o.out);
        else
            rc = fit_one(&o, &c, h, c.keys ? path : o.out);
    }
    state_free(&c);
    return rc;
}
