/*
 * report.c — kvtier-needle's outputs.
 *
 * Aggregation: a cell is (mode, RoPE, salience, context, ratio); its pass rate is
 * passes / counted needle queries, where queries whose needle is still in the rows no policy has
 * scored (the unclosed tail, the eviction window) are reported but not counted (those rows are
 * always attended, so they would pass for free), and so are needles that missed their requested
 * salience band (they would be counted under a band they are not in) and queries whose full-cache
 * reference is non-finite (there is nothing to compare the attended set with).
 */
#include "report.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *policy_name(kvt_policy p) {
    return kvt_policy_name(p);
}

static const char *status_name(nd_status s) {
    switch (s) {
    case ND_PASS:
        return "pass";
    case ND_FAIL:
        return "fail";
    case ND_TAIL:
        return "tail";
    case ND_BAND_MISS:
        return "band_miss";
    case ND_INVALID:
        return "invalid";
    }
    return "?";
}

static const char *ctx_label(uint64_t c, char *buf, size_t len) {
    if (c % 1024 == 0)
        snprintf(buf, len, "%lluk", (unsigned long long)(c / 1024));
    else
        snprintf(buf, len, "%llu", (unsigned long long)c);
    return buf;
}

void nd_report_lines(const nd_report *r, FILE *f) {
    fprintf(f, "%-8s %-5s %-7s %-8s %5s %6s %9s %8s %9s %8s %8s %8s %8s %8s\n", "mode", "rope",
            "context", "salience", "ratio", "depth", "first_row", "sigma%", "status", "mass_r",
            "out_cos", "rel_err", "full_m", "attended");
    char cb[32];
    for (size_t i = 0; i < r->n; i++) {
        const nd_record *x = &r->recs[i];
        fprintf(f, "%-8s %-5s %-7s %-8s %5u %6.3f %9llu %8.2f %9s %8.4f %8.4f %8.4f %8.4f %8llu\n",
                nd_mode_name(x->mode), x->rope ? "yes" : "no", ctx_label(x->context, cb, sizeof cb),
                nd_salience_name(x->res.salience), x->ratio, x->res.depth,
                (unsigned long long)x->res.first_row, x->sigma_pct, status_name(x->res.status),
                x->res.mass_ratio, x->res.out_cos, x->res.out_rel_err, x->res.full_mass,
                (unsigned long long)x->res.attended_rows);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Cells                                                                                        */
/* ------------------------------------------------------------------------------------------- */
typedef struct cell {
    nd_mode mode;
    bool rope;
    nd_salience sal;
    uint64_t context;
    uint32_t ratio;
    uint32_t n, pass, tail, miss, invalid;
    double *mass, *cos; /* counted queries' values, for medians */
    double rel_sum, att_sum, bpt_sum;
} cell;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, uint32_t n) {
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int cmp_cell(const void *a, const void *b) {
    const cell *x = a, *y = b;
    if (x->mode != y->mode)
        return (int)x->mode - (int)y->mode;
    if (x->rope != y->rope)
        return (int)x->rope - (int)y->rope;
    if (x->sal != y->sal)
        return (int)x->sal - (int)y->sal;
    if (x->context != y->context)
        return x->context < y->context ? -1 : 1;
    return x->ratio < y->ratio ? -1 : (x->ratio > y->ratio);
}

static bool same_key(const cell *c, const nd_record *x) {
    return c->mode == x->mode && c->rope == x->rope && c->sal == x->res.salience &&
           c->context == x->context && c->ratio == x->ratio;
}

/* Cells of the report, sorted; *n_cells receives the count. Caller frees with free_cells. */
static cell *make_cells(const nd_report *r, size_t *n_cells) {
    cell *cs = calloc(r->n ? r->n : 1, sizeof *cs);
    size_t nc = 0;
    if (!cs)
        return NULL;
    for (size_t i = 0; i < r->n; i++) {
        const nd_record *x = &r->recs[i];
        size_t k = 0;
        while (k < nc && !same_key(&cs[k], x))
            k++;
        if (k == nc) {
            cs[k].mode = x->mode;
            cs[k].rope = x->rope;
            cs[k].sal = x->res.salience;
            cs[k].context = x->context;
            cs[k].ratio = x->ratio;
            cs[k].mass = calloc(r->n, sizeof(double));
            cs[k].cos = calloc(r->n, sizeof(double));
            nc++;
        }
        cell *c = &cs[k];
        if (x->res.status == ND_TAIL) {
            c->tail++;
            continue;
        }
        if (x->res.status == ND_BAND_MISS) {
            c->miss++;
            continue;
        }
        if (x->res.status == ND_INVALID) {
            c->invalid++;
            continue;
        }
        if (c->mass)
            c->mass[c->n] = x->res.mass_ratio;
        if (c->cos)
            c->cos[c->n] = x->res.out_cos;
        c->n++;
        c->pass += x->res.status == ND_PASS;
        c->rel_sum += x->res.out_rel_err;
        c->att_sum += (double)x->res.attended_rows;
        c->bpt_sum += x->res.read_bytes_per_token;
    }
    qsort(cs, nc, sizeof *cs, cmp_cell);
    *n_cells = nc;
    return cs;
}

static void free_cells(cell *cs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(cs[i].mass);
        free(cs[i].cos);
    }
    free(cs);
}

void nd_report_table(const nd_report *r, FILE *f) {
    size_t nc = 0;
    cell *cs = make_cells(r, &nc);
    if (!cs)
        return;
    fprintf(f, "kvtier-needle: %s; pass = mass_ratio >= %.3g and out_cos >= %.3g (min over "
            "targeted heads)\n\n", r->source, r->min_mass, r->min_cos);
    fprintf(f, "%-8s %-4s %-8s %7s %5s %7s %6s %7s %5s %5s %7s %10s %9s %9s %10s %9s\n",
            "mode", "rope", "salience", "context", "ratio", "counted", "pass", "rate", "tail",
            "miss", "invalid", "mass_r(med)", "cos(med)", "rel(mean)", "attended", "B/token");
    char cb[32];
    for (size_t i = 0; i < nc; i++) {
        cell *c = &cs[i];
        double rate = c->n ? (double)c->pass / c->n : NAN;
        fprintf(f, "%-8s %-4s %-8s %7s %5u %7u %6u %6.1f%% %5u %5u %7u %10.3f %9.4f %9.3f "
                   "%10.0f %9.1f\n",
                nd_mode_name(c->mode), c->rope ? "yes" : "no", nd_salience_name(c->sal),
                ctx_label(c->context, cb, sizeof cb), c->ratio, c->n, c->pass, 100 * rate,
                c->tail, c->miss, c->invalid, median(c->mass, c->n), median(c->cos, c->n),
                c->n ? c->rel_sum / c->n : NAN, c->n ? c->att_sum / c->n : NAN,
                c->n ? c->bpt_sum / c->n : NAN);
    }
    /* A context x ratio matrix per (mode, rope, salience) when there is more than one cell. */
    size_t i = 0;
    while (i < nc) {
        size_t j = i;
        while (j < nc && cs[j].mode == cs[i].mode && cs[j].rope == cs[i].rope &&
               cs[j].sal == cs[i].sal)
            j++;
        if (j - i > 1) {
            uint32_t ratios[64];
            size_t nr = 0;
            for (size_t k = i; k < j; k++) {
                size_t q = 0;
                while (q < nr && ratios[q] != cs[k].ratio)
                    q++;
                if (q == nr && nr < 64)
                    ratios[nr++] = cs[k].ratio;
            }
            for (size_t a = 1; a < nr; a++)
                for (size_t b = a; b > 0 && ratios[b - 1] > ratios[b]; b--) {
                    uint32_t t = ratios[b];
                    ratios[b] = ratios[b - 1];
                    ratios[b - 1] = t;
                }
            fprintf(f, "\npass rate, mode %s%s, salience %s (rows: context, columns: ratio)\n",
                    nd_mode_name(cs[i].mode), cs[i].rope ? " (RoPE)" : "",
                    nd_salience_name(cs[i].sal));
            fprintf(f, "%8s", "");
            for (size_t q = 0; q < nr; q++)
                fprintf(f, " %14ux", ratios[q]);
            fprintf(f, "\n");
            size_t k = i;
            while (k < j) {
                uint64_t ctx = cs[k].context;
                fprintf(f, "%8s", ctx_label(ctx, cb, sizeof cb));
                for (size_t q = 0; q < nr; q++) {
                    const cell *hit = NULL;
                    for (size_t z = k; z < j && cs[z].context == ctx; z++)
                        if (cs[z].ratio == ratios[q])
                            hit = &cs[z];
                    if (hit && hit->n)
                        fprintf(f, "  %5.1f%% %3u/%-3u", 100.0 * hit->pass / hit->n, hit->pass,
                                hit->n);
                    else
                        fprintf(f, " %15s", "-");
                }
                fprintf(f, "\n");
                while (k < j && cs[k].context == ctx)
                    k++;
            }
        }
        i = j;
    }
    fprintf(f, "\n");
    free_cells(cs, nc);
}

/* ------------------------------------------------------------------------------------------- */
/* Block edges (--edges)                                                                        */
/* ------------------------------------------------------------------------------------------- */
/* One replay's attended set is measured by each of its queries at one position: count it once. */
static bool same_replay(const nd_record *a, const nd_record *b) {
    return a->context == b->context && a->seed == b->seed && a->ratio == b->ratio &&
           a->mode == b->mode && a->rope == b->rope && a->res.request == b->res.request &&
           a->res.position == b->res.position;
}

void nd_report_edges(const nd_report *r, FILE *f) {
    fprintf(f, "block edges: kept = attended rows that were scored (closed, not sinks); near = "
               "within %u rows of a block edge; chance = near share of all scored rows\n",
            ND_EDGE_ROWS);
    fprintf(f, "%-8s %-4s %7s %5s %7s %10s %10s %7s %7s\n", "mode", "rope", "context", "ratio",
            "replays", "kept", "near", "share", "chance");
    bool *done = calloc(r->n ? r->n : 1, sizeof *done);
    if (!done)
        return;
    char cb[32];
    for (size_t i = 0; i < r->n; i++) {
        const nd_record *x = &r->recs[i];
        if (done[i] || x->res.policy != KVT_POLICY_SALIENCE)
            continue;
        uint64_t replays = 0, kept = 0, near = 0, rows = 0, rows_near = 0;
        for (size_t j = i; j < r->n; j++) {
            const nd_record *y = &r->recs[j];
            if (done[j] || y->mode != x->mode || y->rope != x->rope ||
                y->context != x->context || y->ratio != x->ratio)
                continue;
            done[j] = true;
            bool seen = false;
            for (size_t k = i; k < j && !seen; k++)
                seen = same_replay(&r->recs[k], y) && k != j;
            if (seen)
                continue;
            replays++;
            kept += y->res.kept_scored;
            near += y->res.kept_edge;
            rows += y->res.scored_rows;
            rows_near += y->res.scored_edge;
        }
        fprintf(f, "%-8s %-4s %7s %5u %7llu %10llu %10llu %6.1f%% %6.1f%%\n",
                nd_mode_name(x->mode), x->rope ? "yes" : "no",
                ctx_label(x->context, cb, sizeof cb), x->ratio, (unsigned long long)replays,
                (unsigned long long)kept, (unsigned long long)near,
                kept ? 100.0 * (double)near / (double)kept : NAN,
                rows ? 100.0 * (double)rows_near / (double)rows : NAN);
    }
    fprintf(f, "\n");
    free(done);
}

/* ------------------------------------------------------------------------------------------- */
/* CSV                                                                                          */
/* ------------------------------------------------------------------------------------------- */
/* Columns are documented in docs/needle.md; the status flags (pass, in_tail, band_miss, invalid)
 * sit together after status, so read the file by header name, not by position. */
int nd_report_csv(const nd_report *r, const char *path, char *err, size_t err_len) {
    FILE *f = fopen(path, "w");
    if (!f) {
        snprintf(err, err_len, "cannot write %s", path);
        return -1;
    }
    fprintf(f, "context,seed,request,ratio,depth,mode,policy,rope,salience,needle,needle_rows,first_row,"
               "position,sigma_pct,status,pass,in_tail,band_miss,invalid,mass_ratio,out_cos,"
               "out_rel_err,full_mass,needle_rows_attended,attended_rows,archived_rows,"
               "dropped_rows,fetched_rows,m_rows,tail_rows,read_bytes_per_token");
    /* The recall columns are appended only when the run has recall-mode lines, so that the
     * CSV of every other run keeps its columns byte for byte. */
    bool any_recall = false;
    for (size_t i = 0; i < r->n; i++)
        any_recall |= r->recs[i].mode == ND_MODE_RECALL;
    /* Likewise the budget mode's eff_ratio column, last. */
    bool any_budget = false;
    for (size_t i = 0; i < r->n; i++)
        any_budget |= r->recs[i].res.budget;
    fprintf(f, "%s%s\n", any_recall ? ",fetched,visited_frac,overflow,z,dense,pass_by" : "",
            any_budget ? ",eff_ratio" : "");
    for (size_t i = 0; i < r->n; i++) {
        const nd_record *x = &r->recs[i];
        const nd_result *s = &x->res;
        fprintf(f, "%llu,%llu,%llu,%u,%.6f,%s,%s,%d,%s,%u,%llu,%llu,%llu,%.4f,%s,%d,%d,%d,%d,%.6f,%.6f,"
                   "%.6f,%.6f,%u,%llu,%llu,%llu,%llu,%llu,%llu,%.3f",
                (unsigned long long)x->context, (unsigned long long)x->seed,
                (unsigned long long)s->request, x->ratio, s->depth,
                nd_mode_name(x->mode), policy_name(s->policy), x->rope ? 1 : 0,
                nd_salience_name(s->salience), s->needle, (unsigned long long)s->n_rows,
                (unsigned long long)s->first_row, (unsigned long long)s->position, x->sigma_pct,
                status_name(s->status), s->status == ND_PASS, s->status == ND_TAIL,
                s->status == ND_BAND_MISS, s->status == ND_INVALID, s->mass_ratio, s->out_cos,
                s->out_rel_err, s->full_mass, s->needle_rows_attended,
                (unsigned long long)s->attended_rows, (unsigned long long)s->archived_rows,
                (unsigned long long)s->dropped_rows, (unsigned long long)s->fetched_rows,
                (unsigned long long)s->m_rows, (unsigned long long)s->tail_rows,
                s->read_bytes_per_token);
        /* recall columns (appended): empty outside recall mode */
        if (x->mode == ND_MODE_RECALL)
            fprintf(f, ",%llu,%.6f,%d,%.4f,%d,%s", (unsigned long long)s->fetched_rows,
                    s->recall_archived ? (double)s->recall_visited / (double)s->recall_archived
                                       : 0.0,
                    s->recall_overflow ? 1 : 0, (double)s->recall_z, s->recall_dense ? 1 : 0,
                    s->pass_by == 'f'   ? "fetch"
                    : s->pass_by == 'd' ? "dense"
                    : s->pass_by == 'k' ? "kept"
                                        : "");
        else if (any_recall)
            fprintf(f, ",,,,,,");
        if (any_budget)
            fprintf(f, ",%.3f", s->eff_ratio);
        fprintf(f, "\n");
    }
    if (fclose(f) != 0) {
        snprintf(err, err_len, "error writing %s", path);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* SVG heatmap                                                                                  */
/* ------------------------------------------------------------------------------------------- */

/* Red (0) -> yellow (0.5) -> green (1), ColorBrewer RdYlGn end points. */
static void rate_color(double t, char *buf, size_t len) {
    if (!(t >= 0)) {
        snprintf(buf, len, "#d9d9d9");
        return;
    }
    if (t > 1)
        t = 1;
    static const double c0[3] = {215, 48, 39}, c1[3] = {254, 224, 139}, c2[3] = {26, 152, 80};
    double rgb[3];
    for (int k = 0; k < 3; k++)
        rgb[k] = t < 0.5 ? c0[k] + (c1[k] - c0[k]) * t * 2 : c1[k] + (c2[k] - c1[k]) * (t - 0.5) * 2;
    snprintf(buf, len, "#%02x%02x%02x", (int)(rgb[0] + 0.5), (int)(rgb[1] + 0.5),
             (int)(rgb[2] + 0.5));
}

/* Depth bin of a record: distinct depths (to 1e-3) when there are at most 12, else deciles. */
static int depth_bin(double d, const double *depths, int nd, bool deciles) {
    if (deciles) {
        int b = (int)(d * 10);
        return b < 0 ? 0 : b > 9 ? 9 : b;
    }
    for (int k = 0; k < nd; k++)
        if (fabs(depths[k] - d) < 5e-4)
            return k;
    return 0;
}

int nd_report_svg(const nd_report *r, const char *path, char *err, size_t err_len) {
    size_t nc = 0;
    cell *cs = make_cells(r, &nc);
    if (!cs) {
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    /* Distinct depths. */
    double depths[16];
    int nd = 0;
    bool deciles = false;
    for (size_t i = 0; i < r->n && !deciles; i++) {
        double d = r->recs[i].res.depth;
        int k = 0;
        while (k < nd && fabs(depths[k] - d) >= 5e-4)
            k++;
        if (k == nd) {
            if (nd == 12)
                deciles = true;
            else
                depths[nd++] = d;
        }
    }
    if (deciles) {
        nd = 10;
        for (int k = 0; k < 10; k++)
            depths[k] = 0.05 + 0.1 * k;
    }
    for (int a = 1; a < nd; a++)
        for (int b = a; b > 0 && depths[b - 1] > depths[b]; b--) {
            double t = depths[b];
            depths[b] = depths[b - 1];
            depths[b - 1] = t;
        }
    if (nd == 0)
        nd = 1, depths[0] = 0;
    /* Panels: one per (mode, rope, salience). */
    typedef struct panel {
        size_t first, last;
        uint64_t ctxs[64];
        uint32_t ratios[64];
        int n_ctx, n_ratio;
    } panel;
    panel ps[64];
    int np = 0;
    for (size_t i = 0; i < nc && np < 64;) {
        size_t j = i;
        while (j < nc && cs[j].mode == cs[i].mode && cs[j].rope == cs[i].rope &&
               cs[j].sal == cs[i].sal)
            j++;
        panel *p = &ps[np++];
        memset(p, 0, sizeof *p);
        p->first = i;
        p->last = j;
        for (size_t k = i; k < j; k++) {
            int a = 0;
            while (a < p->n_ctx && p->ctxs[a] != cs[k].context)
                a++;
            if (a == p->n_ctx && a < 64)
                p->ctxs[p->n_ctx++] = cs[k].context;
            a = 0;
            while (a < p->n_ratio && p->ratios[a] != cs[k].ratio)
                a++;
            if (a == p->n_ratio && a < 64)
                p->ratios[p->n_ratio++] = cs[k].ratio;
        }
        for (int a = 1; a < p->n_ratio; a++)
            for (int b = a; b > 0 && p->ratios[b - 1] > p->ratios[b]; b--) {
                uint32_t t = p->ratios[b];
                p->ratios[b] = p->ratios[b - 1];
                p->ratios[b - 1] = t;
            }
        i = j;
    }
    const int cw = 132, ch = 54, lw = 64, th = 58, gap = 28, cols = np > 1 ? 2 : 1;
    int pw[64], ph[64], maxw = 0;
    for (int k = 0; k < np; k++) {
        pw[k] = lw + ps[k].n_ratio * cw;
        ph[k] = th + ps[k].n_ctx * ch;
        if (pw[k] > maxw)
            maxw = pw[k];
    }
    int rows = (np + cols - 1) / cols, total_h = 84;
    int row_h[64];
    for (int rr = 0; rr < rows; rr++) {
        row_h[rr] = 0;
        for (int k = rr * cols; k < np && k < (rr + 1) * cols; k++)
            if (ph[k] > row_h[rr])
                row_h[rr] = ph[k];
        total_h += row_h[rr] + gap;
    }
    int W = 20 + cols * (maxw + gap), H = total_h + 90;
    FILE *f = fopen(path, "w");
    if (!f) {
        free_cells(cs, nc);
        snprintf(err, err_len, "cannot write %s", path);
        return -1;
    }
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/"
               "svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"DejaVu Sans, "
               "Helvetica, Arial, sans-serif\">\n<rect width=\"100%%\" height=\"100%%\" "
               "fill=\"white\"/>\n", W, H, W, H);
    fprintf(f, "<text x=\"20\" y=\"28\" font-size=\"18\" font-weight=\"bold\">kvtier needle "
               "suite: pass rate per context x ratio</text>\n");
    fprintf(f, "<text x=\"20\" y=\"48\" font-size=\"12\" fill=\"#444\">source: %s. Pass = "
               "needle mass ratio &#8805; %.3g and output cosine &#8805; %.3g (min over targeted "
               "heads).</text>\n", r->source, r->min_mass, r->min_cos);
    fprintf(f, "<text x=\"20\" y=\"64\" font-size=\"12\" fill=\"#444\">Each cell: pass rate "
               "(passed/counted) over all depths; below it %d stripes, one per depth, shallow "
               "(left) to deep (right), coloured by that depth's pass rate.</text>\n", nd);
    int y0 = 84;
    char col[16], cb[32];
    for (int rr = 0; rr < rows; rr++) {
        for (int k = rr * cols; k < np && k < (rr + 1) * cols; k++) {
            const panel *p = &ps[k];
            const cell *c0 = &cs[p->first];
            int x0 = 20 + (k % cols) * (maxw + gap);
            fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"14\" font-weight=\"bold\">mode %s%s, "
                       "salience %s</text>\n", x0, y0 + 18, nd_mode_name(c0->mode),
                    c0->rope ? " (RoPE: random eviction)" : "", nd_salience_name(c0->sal));
            for (int q = 0; q < p->n_ratio; q++)
                fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\">"
                           "%ux</text>\n", x0 + lw + q * cw + cw / 2, y0 + th - 8,
                        p->ratios[q]);
            fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"11\" fill=\"#444\">ratio &#8594;"
                       "</text>\n", x0 + lw + p->n_ratio * cw - 60, y0 + 34);
            for (int a = 0; a < p->n_ctx; a++) {
                int cy = y0 + th + a * ch;
                fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"12\" text-anchor=\"end\">%s"
                           "</text>\n", x0 + lw - 8, cy + ch / 2 + 4,
                        ctx_label(p->ctxs[a], cb, sizeof cb));
                for (int q = 0; q < p->n_ratio; q++) {
                    int cx = x0 + lw + q * cw;
                    const cell *hit = NULL;
                    for (size_t z = p->first; z < p->last; z++)
                        if (cs[z].context == p->ctxs[a] && cs[z].ratio == p->ratios[q])
                            hit = &cs[z];
                    /* depth stripes */
                    for (int dk = 0; dk < nd; dk++) {
                        uint32_t dn = 0, dp = 0;
                        for (size_t i = 0; hit && i < r->n; i++) {
                            const nd_record *x = &r->recs[i];
                            if (!same_key(hit, x) || x->res.status == ND_TAIL ||
                                x->res.status == ND_BAND_MISS || x->res.status == ND_INVALID ||
                                depth_bin(x->res.depth, depths, nd, deciles) != dk)
                                continue;
                            dn++;
                            dp += x->res.status == ND_PASS;
                        }
                        rate_color(dn ? (double)dp / dn : NAN, col, sizeof col);
                        int sx = cx + 2 + (cw - 4) * dk / nd;
                        int sw = cx + 2 + (cw - 4) * (dk + 1) / nd - sx;
                        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" "
                                   "fill=\"%s\"><title>depth %.2f: %u/%u</title></rect>\n",
                                sx, cy + 24, sw, ch - 26, col, depths[dk], dp, dn);
                    }
                    rate_color(hit && hit->n ? (double)hit->pass / hit->n : NAN, col, sizeof col);
                    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"22\" "
                               "fill=\"%s\"/>\n", cx + 2, cy + 2, cw - 4, col);
                    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" "
                               "stroke=\"#333\" stroke-width=\"1\"/>\n", cx + 2, cy + 2, cw - 4,
                            ch - 4);
                    if (hit && hit->n) {
                        fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"13\" font-weight=\"bold\" "
                                   "text-anchor=\"middle\">%.0f%% <tspan font-size=\"10\" "
                                   "font-weight=\"normal\">(%u/%u)</tspan></text>\n", cx + cw / 2,
                                cy + 18, 100.0 * hit->pass / hit->n, hit->pass, hit->n);
                    } else {
                        fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"11\" "
                                   "text-anchor=\"middle\">no data</text>\n", cx + cw / 2,
                                cy + ch / 2 + 4);
                    }
                }
            }
        }
        y0 += row_h[rr] + gap;
    }
    /* Legend */
    int lx = 20, ly = y0 + 4;
    fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"12\">pass rate</text>\n", lx, ly + 14);
    for (int k = 0; k <= 20; k++) {
        rate_color(k / 20.0, col, sizeof col);
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"16\" fill=\"%s\"/>\n",
                lx + 70 + k * 12, ly + 2, col);
    }
    fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"11\">0%%</text>\n", lx + 70, ly + 32);
    fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"11\" text-anchor=\"end\">100%%</text>\n",
            lx + 70 + 21 * 12, ly + 32);
    rate_color(NAN, col, sizeof col);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"16\" height=\"16\" fill=\"%s\"/><text x=\"%d\" "
               "y=\"%d\" font-size=\"11\">no counted query (needle unscored, band "
               "missed, or reference non-finite)</text>\n",
            lx + 360, ly + 2, col, lx + 382, ly + 14);
    fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"11\" fill=\"#444\">depth stripes:", lx,
            ly + 52);
    for (int dk = 0; dk < nd; dk++)
        fprintf(f, " %.2f", depths[dk]);
    fprintf(f, " (left to right)</text>\n</svg>\n");
    free_cells(cs, nc);
    if (fclose(f) != 0) {
        snprintf(err, err_len, "error writing %s", path);
        return -1;
    }
    return 0;
}
