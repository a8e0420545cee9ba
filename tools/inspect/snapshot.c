/*
 * kvtier-inspect snapshot FILE [--verify] [--json] [--basis BASIS]... — what a request snapshot
 * holds; kvtier-inspect snapshot --clean DIR [--min-age SECONDS] removes the temporaries that
 * killed snapshot writers left in DIR (kvt_snapshot_clean) and says how many (kvtier.h,
 * "Snapshots"): occupancy per tier and layer, the σ histogram of each salience layer, the recall
 * state, memory by tier.
 *
 * The file is restored into a context built from the snapshot's own model and configuration
 * (kvt_snapshot_context), so every figure comes from the library's public inspection calls, and
 * reading it already checks every CRC, size, count and invariant: a bad file exits 1 with the
 * reason. --verify also runs kvt_seq_check on the restored request and says so. A snapshot of a
 * request that recalls names each layer's basis by id and does not carry it: --basis loads a
 * basis file (kvtier-inspect calibrate's) on the layer it was made for before the restore, which
 * checks the id.
 */
#include "inspect.h"

#include <kvtier.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "snapshot"
#define SIGMA_BINS 10

static void usage(FILE *f) {
    fprintf(f, "usage: kvtier-inspect snapshot FILE [--verify] [--json] [--basis BASIS]...\n"
               "       kvtier-inspect snapshot --clean DIR [--min-age SECONDS]\n"
               "  occupancy per tier and layer, sigma histogram of salience layers, recall state,\n"
               "  memory by tier of a request snapshot (kvt_seq_snapshot_file).\n"
               "  --verify  check every checksum and invariant; exit 1 with the reason if bad\n"
               "  --json    one JSON object on stdout\n"
               "  --basis   a recall basis file (kvtier-inspect calibrate), loaded on its layer\n"
               "            before the restore: a snapshot of a recalling request needs the basis\n"
               "            of each such layer (the snapshot holds its id, not its values)\n"
               "  --clean   remove the stale temporaries (NAME.tmp.XXXXXX) that killed snapshot\n"
               "            writers left in DIR: unlocked by any writer, kvtier content, and last\n"
               "            modified at least --min-age seconds ago (default %d)\n",
            KVT_SNAPSHOT_STALE_SECONDS);
}

static uint8_t *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, len = 0;
    uint8_t *b = malloc(cap);
    while (b) {
        size_t k = fread(b + len, 1, cap - len, f);
        len += k;
        if (len < cap)
            break;
        uint8_t *nb = realloc(b, cap * 2);
        if (!nb) {
            free(b);
            b = NULL;
            break;
        }
        b = nb;
        cap *= 2;
    }
    if (b && ferror(f)) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = len;
    return b;
}

/* σ histogram over the finite scores: SIGMA_BINS equal bins between their min and max. */
typedef struct sigma_hist {
    uint64_t n, inf, bins[SIGMA_BINS];
    float lo, hi;
} sigma_hist;

static void histogram(const float *s, uint64_t n, sigma_hist *h) {
    memset(h, 0, sizeof *h);
    h->n = n;
    bool any = false;
    for (uint64_t i = 0; i < n; i++) {
        if (!isfinite(s[i]))
            continue;
        if (!any || s[i] < h->lo)
            h->lo = s[i];
        if (!any || s[i] > h->hi)
            h->hi = s[i];
        any = true;
    }
    for (uint64_t i = 0; i < n; i++) {
        if (!isfinite(s[i])) {
            h->inf++;
            continue;
        }
        int b = h->hi > h->lo ? (int)((s[i] - h->lo) / (h->hi - h->lo) * SIGMA_BINS) : 0;
        h->bins[b < SIGMA_BINS ? b : SIGMA_BINS - 1]++;
    }
}

#define MAX_BASES 64

int inspect_snapshot(int argc, char **argv) {
    const char *path = NULL;
    const char *bases[MAX_BASES];
    int n_bases = 0;
    bool verify = false, json = false;
    const char *clean = NULL;
    long min_age = KVT_SNAPSHOT_STALE_SECONDS;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return INSPECT_EXIT_OK;
        } else if (strcmp(argv[i], "--verify") == 0) {
            verify = true;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (strcmp(argv[i], "--basis") == 0) {
            if (i + 1 >= argc)
                return inspect_error(INSPECT_EXIT_USAGE, CMD, "--basis needs a FILE");
            if (n_bases == MAX_BASES)
                return inspect_error(INSPECT_EXIT_USAGE, CMD, "more than %d --basis files",
                                     MAX_BASES);
            bases[n_bases++] = argv[++i];
        } else if (strcmp(argv[i], "--clean") == 0) {
            if (i + 1 >= argc)
                return inspect_error(INSPECT_EXIT_USAGE, CMD, "--clean needs a DIR");
            clean = argv[++i];
        } else if (strcmp(argv[i], "--min-age") == 0) {
            char *end = NULL;
            if (i + 1 >= argc || (min_age = strtol(argv[i + 1], &end, 10)) < 0 || !*argv[i + 1] ||
                *end || min_age > UINT32_MAX)
                return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                     "--min-age needs a number of seconds (0 to 2^32 - 1)");
            i++;
        } else if (strncmp(argv[i], "--", 2) == 0) {
            return inspect_error(INSPECT_EXIT_USAGE, CMD, "unknown flag '%s' (see --help)",
                                 argv[i]);
        } else if (path) {
            return inspect_error(INSPECT_EXIT_USAGE, CMD, "one FILE expected, got '%s' and '%s'",
                                 path, argv[i]);
        } else {
            path = argv[i];
        }
    }
    if (clean) {
        if (path || verify || json || n_bases)
            return inspect_error(INSPECT_EXIT_USAGE, CMD,
                                 "--clean DIR takes no FILE or other flag");
        uint32_t removed = 0;
        kvt_status cs = kvt_snapshot_clean(clean, (uint32_t)min_age, &removed);
        if (cs != KVT_OK)
            return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s", kvt_last_error());
        printf("%s: %u stale temporar%s removed\n", clean, removed, removed == 1 ? "y" : "ies");
        return INSPECT_EXIT_OK;
    }
    if (!path)
        return inspect_error(INSPECT_EXIT_USAGE, CMD, "missing FILE (see --help)");
    size_t len;
    uint8_t *buf = read_all(path, &len);
    if (!buf)
        return inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: cannot read", path);
    kvt_ctx *ctx = NULL;
    kvt_seq *seq = NULL;
    kvt_status s = kvt_snapshot_context(buf, len, KVT_BACKEND_CPU, &ctx);
    for (int b = 0; s == KVT_OK && b < n_bases; b++) {
        kvt_recall_basis_info info;
        s = kvt_recall_basis_read(bases[b], &info, NULL, 0);
        if (s == KVT_OK)
            s = kvt_ctx_load_recall_basis(ctx, info.layer, bases[b]);
        if (s != KVT_OK) {
            int rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "basis %s: %s (%s)", bases[b],
                                   kvt_last_error(), kvt_status_name(s));
            free(buf);
            kvt_ctx_destroy(ctx);
            return rc;
        }
    }
    if (s == KVT_OK)
        s = kvt_seq_restore(ctx, buf, len, &seq);
    if (s == KVT_OK && verify)
        s = kvt_seq_check(seq);
    free(buf);
    if (s != KVT_OK) {
        int rc = inspect_error(INSPECT_EXIT_FAIL, CMD, "%s: %s (%s)%s", path, kvt_last_error(),
                               kvt_status_name(s),
                               s == KVT_ERR_MISMATCH && !n_bases
                                   ? "; a recalling request needs its layers' bases: --basis FILE"
                                   : "");
        kvt_ctx_destroy(ctx);
        return rc;
    }
    const kvt_model *m = kvt_ctx_model(ctx);
    uint32_t L = kvt_model_n_layers(m);
    uint64_t pool_bytes = 0, archive_bytes = 0, side_bytes = 0;
    uint32_t n_recall = 0;
    if (json)
        printf("{\"file\":\"%s\",\"bytes\":%zu,\"model_type\":\"%s\",\"layers\":%u,"
               "\"tokens\":%llu,\"verified\":%s,\"per_layer\":[",
               path, len, kvt_model_type(m), L, (unsigned long long)kvt_seq_length(seq),
               verify ? "true" : "false");
    else
        printf("snapshot %s: %zu bytes, model %s, %u layers, %llu tokens%s\n", path, len,
               kvt_model_type(m), L, (unsigned long long)kvt_seq_length(seq),
               verify ? "; verified: every CRC, size, count and invariant" : "");
    if (!json)
        printf("%5s %-10s %-9s %9s %9s %9s %9s %7s %7s %11s %11s\n", "layer", "kind", "policy",
               "appended", "attended", "archived", "dropped", "closes", "rounds", "pool B",
               "archive B");
    bool first = true;
    for (uint32_t l = 0; l < L; l++) {
        if (kvt_ctx_layer_group(ctx, l) < 0)
            continue;
        kvt_layer_stats st = {.struct_size = sizeof st};
        kvt_seq_layer_stats(seq, l, &st);
        pool_bytes += st.bytes_in_use;
        archive_bytes += st.archive_bytes;
        const char *kind = kvt_layer_kind_name(kvt_model_layer(m, l)->kind);
        sigma_hist h;
        uint64_t n_sig = 0;
        bool has_sigma = kvt_seq_scores(seq, l, NULL, 0, &n_sig) == KVT_OK;
        if (has_sigma) {
            float *sc = malloc(sizeof *sc * (n_sig ? n_sig : 1));
            if (sc && kvt_seq_scores(seq, l, sc, n_sig, &n_sig) == KVT_OK)
                histogram(sc, n_sig, &h);
            else
                has_sigma = false;
            free(sc);
            side_bytes += n_sig * 4 + st.kept_rows * 4;
        }
        /* sketch plane: rank fp16 coefficients and the fp32 residual norm a sketched row */
        side_bytes += st.sketched_rows * (2ull * st.recall_rank + 4);
        if (json) {
            printf("%s{\"layer\":%u,\"kind\":\"%s\",\"policy\":\"%s\",\"appended\":%llu,"
                   "\"attended_per_head\":%llu,\"sinks\":%llu,\"kept\":%llu,\"tail\":%llu,"
                   "\"archived\":%llu,\"dropped\":%llu,\"closed\":%llu,\"closes\":%llu,"
                   "\"rounds\":%llu,\"pool_bytes\":%llu,\"archive_bytes\":%llu",
                   first ? "" : ",", l, kind, kvt_policy_name(st.policy),
                   (unsigned long long)st.appended_rows, (unsigned long long)st.attended_rows,
                   (unsigned long long)st.sink_rows, (unsigned long long)st.kept_rows,
                   (unsigned long long)st.tail_rows, (unsigned long long)st.archived_rows,
                   (unsigned long long)st.dropped_rows, (unsigned long long)st.closed_rows,
                   (unsigned long long)st.closes, (unsigned long long)st.rounds,
                   (unsigned long long)st.bytes_in_use, (unsigned long long)st.archive_bytes);
            if (st.recall_mode != KVT_RECALL_OFF)
                printf(",\"recall\":{\"mode\":\"%s\",\"phase\":%d,\"z\":%g,\"samples\":%u,"
                       "\"steps\":%llu,\"calib_steps\":%llu,\"overflow_steps\":%llu,"
                       "\"visited\":%llu,\"fired\":%llu,\"fetched\":%llu,\"rank\":%u,"
                       "\"basis_id\":%u,\"sketched\":%llu}",
                       kvt_recall_mode_name((kvt_recall_mode)st.recall_mode), st.recall_phase, (double)st.recall_z,
                       st.recall_samples, (unsigned long long)st.recall_steps,
                       (unsigned long long)st.recall_calib_steps,
                       (unsigned long long)st.recall_overflow_steps,
                       (unsigned long long)st.recall_visited_rows,
                       (unsigned long long)st.recall_fired_rows,
                       (unsigned long long)st.recall_fetched_rows, st.recall_rank,
                       st.recall_basis_id, (unsigned long long)st.sketched_rows);
            if (has_sigma) {
                printf(",\"sigma\":{\"n\":%llu,\"inf\":%llu,\"lo\":%g,\"hi\":%g,\"bins\":[",
                       (unsigned long long)h.n, (unsigned long long)h.inf, h.lo, h.hi);
                for (int b = 0; b < SIGMA_BINS; b++)
                    printf("%s%llu", b ? "," : "", (unsigned long long)h.bins[b]);
                printf("]}");
            }
            printf("}");
        } else {
            printf("%5u %-10s %-9s %9llu %9llu %9llu %9llu %7llu %7llu %11llu %11llu\n", l, kind,
                   kvt_policy_name(st.policy), (unsigned long long)st.appended_rows,
                   (unsigned long long)st.attended_rows, (unsigned long long)st.archived_rows,
                   (unsigned long long)st.dropped_rows, (unsigned long long)st.closes,
                   (unsigned long long)st.rounds, (unsigned long long)st.bytes_in_use,
                   (unsigned long long)st.archive_bytes);
            if (has_sigma && h.n) {
                printf("      sigma of %llu closed rows (%llu +inf), %g .. %g:", (unsigned long long)h.n,
                       (unsigned long long)h.inf, h.lo, h.hi);
                for (int b = 0; b < SIGMA_BINS; b++)
                    printf(" %llu", (unsigned long long)h.bins[b]);
                printf("\n");
            }
            if (st.recall_mode != KVT_RECALL_OFF)
                printf("      recall %s, %s, z %.4g from %u samples; %llu steps (%llu "
                       "calibration, %llu overflow), rows visited %llu, fired %llu, fetched "
                       "%llu; basis rank %u id 0x%08x, %llu rows sketched\n",
                       kvt_recall_mode_name((kvt_recall_mode)st.recall_mode),
                       st.recall_phase == 0   ? "calibrating"
                       : st.recall_phase == 1 ? "calibrated"
                                              : "provisional",
                       (double)st.recall_z, st.recall_samples,
                       (unsigned long long)st.recall_steps,
                       (unsigned long long)st.recall_calib_steps,
                       (unsigned long long)st.recall_overflow_steps,
                       (unsigned long long)st.recall_visited_rows,
                       (unsigned long long)st.recall_fired_rows,
                       (unsigned long long)st.recall_fetched_rows, st.recall_rank,
                       st.recall_basis_id, (unsigned long long)st.sketched_rows);
        }
        n_recall += st.recall_mode != KVT_RECALL_OFF;
        first = false;
    }
    if (json) {
        printf("],\"recall_layers\":%u,\"memory\":{\"pool_bytes\":%llu,\"archive_bytes\":%llu,\"side_plane_bytes\":"
               "%llu}}\n",
               n_recall, (unsigned long long)pool_bytes, (unsigned long long)archive_bytes,
               (unsigned long long)side_bytes);
    } else {
        char a[32], b[32], c[32];
        inspect_human(pool_bytes, a, sizeof a);
        inspect_human(archive_bytes, b, sizeof b);
        inspect_human(side_bytes, c, sizeof c);
        printf("memory: row pool %s (attended tier, and salience's archive in place), archive "
               "pool %s (random eviction's copies), side planes %s (sigma, kept sets, sketches)\n",
               a, b, c);
        if (!n_recall)
            printf("recall: off in this request\n");
    }
    kvt_ctx_destroy(ctx);
    return INSPECT_EXIT_OK;
}
