/* report.h — kvtier-needle's outputs: the table, per-needle lines, CSV and the SVG heatmap. */
#ifndef KVT_TOOLS_NEEDLE_REPORT_H
#define KVT_TOOLS_NEEDLE_REPORT_H

#include "needle.h"

#include <stdio.h>

/* One measured needle query of one replay. */
typedef struct nd_record {
    uint64_t context, seed;
    uint32_t ratio;
    nd_mode mode;
    bool rope;
    double sigma_pct; /* needle's σ percentile in its block (NaN: not in a complete block) */
    nd_result res;
} nd_record;

typedef struct nd_report {
    const nd_record *recs;
    size_t n;
    const char *source;
    double min_mass, min_cos;
} nd_report;

void nd_report_lines(const nd_report *r, FILE *f);
void nd_report_table(const nd_report *r, FILE *f);
/* --edges: per (mode, RoPE, context, ratio) of the salience policy, the share of kept rows near a
 * block edge (nd_result's kept_edge / kept_scored, each replay counted once) and its chance
 * share. */
void nd_report_edges(const nd_report *r, FILE *f);
int nd_report_csv(const nd_report *r, const char *path, char *err, size_t err_len);
int nd_report_svg(const nd_report *r, const char *path, char *err, size_t err_len);

#endif
