/*
 * calibrate.c — `kvtier-inspect calibrate`: the recall basis of one MLA-NoPE layer from the
 * queries of kvtier traces (docs/recall.md §5, DESIGN §2.1: "V = top-64 eigenvectors of the
 * centred covariance of calibration queries' latent parts").
 *
 * Every query step of the layer, in every trace given, contributes one sample per query head:
 * the first value_dim elements of the absorbed query (the latent part; 512 of 576 on MLA). The
 * covariance is accumulated in double around the first sample (a shift that keeps a large mean
 * from cancelling digits), centred, and handed to LAPACKE_dsyevr for its top-R eigenpairs. V's
 * row k is the eigenvector of the k-th largest eigenvalue, its sign fixed so that its largest
 * component is positive (the file is a pure function of the queries). The captured variance —
 * the R eigenvalues' sum over the covariance's trace — is printed and stored in the file.
 *
 * Rows are not queries: a trace that carries no queries for the layer is refused with a message
 * (the basis must span the queries' energy, which is what widens the certificate; a basis fitted
 * to the rows answers another question).
 *
 * Built without LAPACKE (Debian liblapacke-dev absent at configure time), the subcommand says so
 * and exits 1.
 */
#include "inspect.h"

#include <kvtier.h>
#include <kvtier_trace.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if KVT_HAVE_LAPACKE
#include <lapacke.h>
#endif

#define CMD "calibrate"
#define MAX_TRACES 256

static void calibrate_usage(FILE *f) {
    fprintf(f,
            "usage: kvtier-inspect calibrate TRACE... -o FILE [--layer L] [--rank R]\n"
            "  the recall basis of model layer L (default: the first traced MLA-NoPE layer): the\n"
            "  top-R (default 64) eigenvectors of the centred covariance of the layer's query\n"
            "  latents (every step and head of every TRACE); prints the captured variance and\n"
            "  writes a basis file (docs/recall.md section 5) for kvt_ctx_load_recall_basis\n");
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

#if KVT_HAVE_LAPACKE
/* The running sums of one layer's samples: shift x0 (the first sample), Σ(x − x0) and the upper
 * triangle of Σ(x − x0)(x − x0)ᵀ, row-major [dim][dim]. */
typedef struct cal_acc {
    uint32_t dim;
    uint64_t n;
    double *x0, *s1, *s2;
    uint64_t steps;
} cal_acc;

static void acc_add(cal_acc *c, const float *x) {
    const uint32_t n = c->dim;
    if (c->n == 0)
        for (uint32_t i = 0; i < n; i++)
            c->x0[i] = x[i];
    double y[4096]; /* dim <= 4096 (add_trace) */
    for (uint32_t i = 0; i < n; i++) {
        y[i] = (double)x[i] - c->x0[i];
        c->s1[i] += y[i];
    }
    for (uint32_t i = 0; i < n; i++) {
        double *row = c->s2 + (size_t)i * n;
        const double yi = y[i];
        for (uint32_t j = i; j < n; j++)
            row[j] += yi * y[j];
    }
    c->n++;
}

/* Add every query step of `layer` in one trace. */
static int add_trace(const char *path, cal_opts *o, cal_acc *c, kvt_layer_spec *spec) {
    char err[512];
    kvt_trace *t = NULL;
    if (kvt_trace_open(path, &t, err, sizeof err) != KVT_OK)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: %s", path, err);
    int rc = INSPECT_EXIT_OK;
    kvt_trace_layer li;
    if (!o->layer_given) { /* the first traced MLA-NoPE layer of the first trace */
        for (uint32_t i = 0; i < kvt_trace_n_layers(t); i++)
            if (kvt_trace_layer_info(t, i, &li) == KVT_OK && li.spec.kind == KVT_LAYER_MLA_NOPE) {
                o->layer = li.layer;
                o->layer_given = true;
                break;
            }
        if (!o->layer_given) {
            kvt_trace_close(t);
            return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: no MLA-NoPE layer traced", path);
        }
    }
    if (kvt_trace_find_layer(t, o->layer, &li) != KVT_OK) {
        kvt_trace_close(t);
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: layer %u is not traced", path, o->layer);
    }
    uint32_t dim = li.spec.value_dim;
    if (li.spec.kind != KVT_LAYER_MLA_NOPE)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                           "%s: layer %u is %s; recall bases are for "
                           "MLA-NoPE layers",
                           path, o->layer, kvt_layer_kind_name(li.spec.kind));
    else if (li.n_steps == 0)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                           "%s: layer %u carries no queries (the trace holds %llu rows and no "
                           "QUERIES section for it); calibration needs the layer's absorbed "
                           "queries",
                           path, o->layer, (unsigned long long)li.n_tokens);
    else if (li.q_dim < dim || dim > 4096)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                           "%s: layer %u's queries hold %u values, its latent %u", path, o->layer,
                           li.q_dim, dim);
    else if (c->dim && c->dim != dim)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                           "%s: layer %u has value_dim %u, earlier "
                           "traces %u",
                           path, o->layer, dim, c->dim);
    if (rc != INSPECT_EXIT_OK) {
        kvt_trace_close(t);
        return rc;
    }
    if (!c->dim) {
        c->dim = dim;
        *spec = li.spec;
        c->x0 = calloc(dim, sizeof(double));
        c->s1 = calloc(dim, sizeof(double));
        c->s2 = calloc((size_t)dim * dim, sizeof(double));
        if (!c->x0 || !c->s1 || !c->s2) {
            kvt_trace_close(t);
            return inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
        }
    }
    size_t qn = (size_t)li.n_q_heads * li.q_dim;
    float *q = malloc(sizeof(float) * qn);
    if (!q)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
    for (uint64_t s = 0; rc == INSPECT_EXIT_OK && s < li.n_steps; s++) {
        if (kvt_trace_read_query(t, o->layer, s, KVT_DTYPE_FP32, q, sizeof(float) * qn, NULL) !=
            KVT_OK) {
            rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: query step %llu: %s", path,
                               (unsigned long long)s, kvt_trace_last_error(t));
            break;
        }
        for (uint32_t h = 0; h < li.n_q_heads; h++) {
            const float *x = q + (size_t)h * li.q_dim;
            bool finite = true;
            for (uint32_t i = 0; i < dim && finite; i++)
                finite = isfinite(x[i]);
            if (!finite) {
                rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                                   "%s: query step %llu head %u holds a "
                                   "NaN or Inf",
                                   path, (unsigned long long)s, h);
                break;
            }
            acc_add(c, x);
        }
        c->steps++;
    }
    free(q);
    kvt_trace_close(t);
    return rc;
}

/* The top-R eigenpairs of the centred covariance: V [rank][dim] fp32, descending eigenvalues
 * into w_top, the covariance's trace into *total. */
static int top_eigen(const cal_acc *c, uint32_t rank, float *V, double *w_top, double *total) {
    const uint32_t n = c->dim;
    const double N = (double)c->n;
    double *A = malloc(sizeof(double) * n * n);
    double *w = malloc(sizeof(double) * n);
    double *Z = malloc(sizeof(double) * n * rank);
    lapack_int *supp = malloc(sizeof(lapack_int) * 2 * rank);
    if (!A || !w || !Z || !supp) {
        free(A), free(w), free(Z), free(supp);
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
    }
    /* cov = (Σyyᵀ − (Σy)(Σy)ᵀ / N) / (N − 1): the shift x0 cancels. Upper triangle only. */
    *total = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = i; j < n; j++) {
            double v = (c->s2[(size_t)i * n + j] - c->s1[i] * c->s1[j] / N) / (N - 1.0);
            A[(size_t)i * n + j] = v;
            if (i == j)
                *total += v;
        }
    lapack_int m = 0;
    lapack_int info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', (lapack_int)n, A,
                                     (lapack_int)n, 0.0, 0.0, (lapack_int)(n - rank + 1),
                                     (lapack_int)n, 0.0, &m, w, Z, (lapack_int)rank, supp);
    int rc = INSPECT_EXIT_OK;
    if (info != 0 || m != (lapack_int)rank)
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                           "LAPACKE_dsyevr failed (info %d, %d of %u "
                           "eigenpairs)",
                           (int)info, (int)m, rank);
    /* dsyevr returns ascending eigenvalues; column j of Z (row-major [n][rank]) is eigenvector j.
     */
    for (uint32_t k = 0; rc == INSPECT_EXIT_OK && k < rank; k++) {
        uint32_t j = rank - 1 - k;
        w_top[k] = w[j];
        uint32_t arg = 0;
        for (uint32_t d = 1; d < n; d++)
            if (fabs(Z[(size_t)d * rank + j]) > fabs(Z[(size_t)arg * rank + j]))
                arg = d;
        double sign = Z[(size_t)arg * rank + j] < 0 ? -1.0 : 1.0;
        for (uint32_t d = 0; d < n; d++)
            V[(size_t)k * n + d] = (float)(sign * Z[(size_t)d * rank + j]);
    }
    free(A), free(w), free(Z), free(supp);
    return rc;
}
#endif

int inspect_calibrate(int argc, char **argv) {
    cal_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc != 0)
        return rc < 0 ? INSPECT_EXIT_OK : rc;
#if !KVT_HAVE_LAPACKE
    return inspect_error(INSPECT_EXIT_FAIL, CMD,
                         "this kvtier-inspect was built without LAPACKE (install Debian's "
                         "liblapacke-dev, scripts/deps.sh, and reconfigure)");
#else
    cal_acc c;
    memset(&c, 0, sizeof c);
    kvt_layer_spec spec;
    for (int i = 0; rc == INSPECT_EXIT_OK && i < o.n_traces; i++)
        rc = add_trace(o.traces[i], &o, &c, &spec);
    if (rc == INSPECT_EXIT_OK && (o.rank > c.dim || c.n < 2 || c.n <= o.rank))
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD,
                           "layer %u: %llu samples of dim %u cannot give a rank-%u basis (more "
                           "samples than the rank are needed)",
                           o.layer, (unsigned long long)c.n, c.dim, o.rank);
    float *V = rc == INSPECT_EXIT_OK ? malloc(sizeof(float) * o.rank * c.dim) : NULL;
    double *w = rc == INSPECT_EXIT_OK ? malloc(sizeof(double) * o.rank) : NULL;
    double total = 0;
    if (rc == INSPECT_EXIT_OK && (!V || !w))
        rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "out of memory");
    if (rc == INSPECT_EXIT_OK)
        rc = top_eigen(&c, o.rank, V, w, &total);
    if (rc == INSPECT_EXIT_OK) {
        double top = 0;
        for (uint32_t k = 0; k < o.rank; k++)
            top += w[k];
        kvt_recall_basis_info info = {.layer = o.layer,
                                      .rank = o.rank,
                                      .dim = c.dim,
                                      .captured = total > 0 ? top / total : NAN,
                                      .samples = c.n};
        kvt_recall_basis_info back;
        if (kvt_recall_basis_write(o.out, &info, V) != KVT_OK ||
            kvt_recall_basis_read(o.out, &back, NULL, 0) != KVT_OK)
            rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s", kvt_last_error());
        else
            printf("layer %u: %llu samples (%llu query steps from %d trace%s), dim %u\n"
                   "rank %u captures %.4f%% of the centred variance (eigenvalues %.6g .. %.6g, "
                   "trace %.6g)\nbasis id 0x%08x written to %s\n",
                   o.layer, (unsigned long long)c.n, (unsigned long long)c.steps, o.n_traces,
                   o.n_traces == 1 ? "" : "s", c.dim, o.rank, 100.0 * info.captured, w[0],
                   w[o.rank - 1], total, back.id, o.out);
    }
    free(V);
    free(w);
    free(c.x0);
    free(c.s1);
    free(c.s2);
    (void)spec;
    return rc;
#endif
}
