/*
 * kvtier-needle — the long-context needle suite at the attention level (DESIGN §5; docs/needle.md).
 *
 *   kvtier-needle [--synthetic | --trace FILE [--layer L]] [options]
 *
 * Replays a trace (a kvtier trace file, or one the synthetic generator makes in memory) through
 * the real manager and measures, for every query that targets a needle, whether the attended set
 * kvtier chose keeps the needle's attention mass and the attention output. Prints a table, writes
 * CSV / SVG on request, and ends with one line "pass N/M".
 *
 * Exit status: 0 whatever the pass rate; 1 on an error (unreadable, corrupt or unsupported trace,
 * library error, an attended set that disagrees with the library, --recall-adapt in a build
 * without LAPACKE), 2 on a bad command line (a bad or empty list item, a flag of the synthetic
 * haystack given with --trace, --recall-adapt without --mode recall or without a basis), 3 for
 * a mode
 * that is not implemented yet (promote: nothing is measured) or that a case cannot run (recall
 * on a trace without a decode phase: said on stderr, every other mode still measured and
 * reported). A trace's decode phase is what its sections say: two or more query steps of the
 * layer, step k at position rows - steps + k + 1 (docs/trace-format.md). A query
 * whose full-cache reference is non-finite (NaN / Inf rows in a trace) is reported as
 * "invalid", not an error.
 */
#include "../common/eigen.h"
#include "needle.h"
#include "report.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXIT_ERR 1
#define EXIT_USAGE 2
#define EXIT_NOTIMPL 3

static void usage(FILE *f) {
    fprintf(f,
"usage: kvtier-needle [--synthetic | --trace FILE [--layer L]] [options]\n"
"\n"
"Source (default --synthetic):\n"
"  --synthetic            generate the haystack (model: docs/needle.md)\n"
"  --trace FILE           replay a kvtier trace (needles and targets from the file)\n"
"  --layer L              model layer of the trace to replay (default: first MLA or GQA-RoPE\n"
"                         layer with needles); --trace only\n"
"  --write-trace FILE     save the generated haystack as a trace (one context, one seed)\n"
"\n"
"Haystack (synthetic only: refused with --trace, except --seed):\n"
"  --context N            rows (= query position); k = 1024 (default 32k)\n"
"  --depth D              needle depth in [0, 1] (default 0.5); a comma list is allowed\n"
"  --needles K            needles per depth and salience level (default 1)\n"
"  --needle-rows R        rows per needle, 1..16 (default 1)\n"
"  --salience LIST        strong|weak|none|natural, comma list or 'all' (= strong,weak,none)\n"
"                         (default strong)\n"
"  --heads H              query heads (default 8)     --target-heads T  targeted (default 2)\n"
"  --kv-haystack F        fraction of key-value-pair rows (needle look-alikes) (default 0)\n"
"  --rope                 rotate the branch (MLA-RoPE layer: random eviction, prompt protected)\n"
"  --prompt-rows P        prompt rows (default 0; 256 with --rope)\n"
"  --branch smooth|drift  slow part of the background branch: two slow cosines per channel\n"
"                         (default), or those plus an AR(1) walk with phi near 1 (a branch\n"
"                         that drifts along the sequence: docs/needle.md)\n"
"  --calib-basis B        fourier (default) | dct: the sigma basis the needles' salience\n"
"                         bands are calibrated under\n"
"  --dtype bf16|fp16|fp32 row dtype (default bf16)\n"
"  --seed S               generator and kvtier seed (default 1); with --trace the kvtier\n"
"                         seed (random selector, random eviction)\n"
"  --batch N              replay N requests together in one engine batch (request ids S..);\n"
"                         each gives the results of a batch of one with its id (default 1)\n"
"  --backend B            cpu (default), guarded (the CPU backend with its memory closed to\n"
"                         the host outside its ops: same CSV as cpu), cuda\n"
"  --seeds N              haystacks per context: seeds S .. S+N-1 (default 1)\n"
"  --snapshot-at STEP     after the STEP-th committed step of each replay, snapshot every\n"
"                         request to a file, destroy it and restore it (same CSV as without)\n"
"  --snapshot-dir DIR     where those files go, one per request, kept (default .)\n"
"\n"
"Manager:\n"
"  --mode LIST            salience|random|dense|recall|promote, comma list (default salience)\n"
"                         salience = the policy table (sigma top-m; random eviction on RoPE)\n"
"                         random   = uniform Philox selector (KVT_SELECT_RANDOM)\n"
"                         dense    = ratio 1, everything attended\n"
"                         recall   = salience + the recall trigger over a decode phase\n"
"                                    (synthetic only; a summary line per context x ratio);\n"
"                                    with --rope: random eviction, archive and RoPE recall\n"
"                         promote: not implemented yet (exit 3)\n"
"  --recall M             conformal (default) | sound | margin\n"
"  --recall-basis B       subspace (default: the generator's query subspace) | none | FILE\n"
"                         (a basis file, kvtier-inspect calibrate's format)\n"
"  --recall-adapt         a basis that follows the request's own decode queries (MLA-NoPE;\n"
"                         needs a basis to start from and LAPACKE): after decode steps 8, 16,\n"
"                         32 and 64 the top eigenvectors of the centred covariance of every\n"
"                         query latent so far replace it (kvt_ctx_refit_recall_basis; z is\n"
"                         calibrated again after the first refit, kept after the others);\n"
"                         with --rope each KV head's key basis is fitted once to the prompt's\n"
"                         own keys before the first decode step (kvt_ctx_refit_recall_head_basis)\n"
"  --write-basis FILE     write the generator's query subspace as a basis file\n"
"  --recall-cap W         rows a recall step may fetch (default: the library's, 4096)\n"
"  --recall-scan-bits N   16 (default) | 8: the recall scan's precision\n"
"                         (kvt_ctx_params.recall_scan_bits)\n"
"  --archive-space S      device (default) | host: random eviction's archive in pinned host\n"
"                         memory (with --rope --mode recall: no step attends the whole archive)\n"
"  --decode-calib N       filler decode steps before the first needle query (16 with recall)\n"
"  --decode-gap N         filler decode steps before each needle query (default 3)\n"
"  --query-rank R         rank of the query subspace of the decode phase (default 64)\n"
"  --decoys F             multi-key haystack: fraction F of rows near-identical to the needles\n"
"  --ratio X              compression ratio (default 32); a comma list is allowed\n"
"  --block B              rows per block (default 4096)   --kappa K  (default 16)\n"
"  --sigma-basis B        fourier (reference, default) | dct: kvt_config.sigma_basis\n"
"  --budget               budget mode (kvt_config.salience_budget): m recomputed at each\n"
"                         block close so that sinks + kept + tail ~ context / ratio; adds\n"
"                         the CSV column eff_ratio (committed rows per attended row)\n"
"  --budget-min-kept N    its floor of kept rows (default: the library's, 256)\n"
"  --sinks S              sink rows (default 4)           --recent R (RoPE window, default 64)\n"
"  --scale S              softmax scale (default: the trace's scale= line, else head_dim^-1/2\n"
"                         on a GQA layer, 192^-1/2 on MLA)\n"
"\n"
"Pass rule:\n"
"  --min-mass M           needle mass ratio threshold (default 0.9)\n"
"  --min-cos C            output cosine threshold (default 0.95)\n"
"\n"
"Grid:\n"
"  --grid                 sweep contexts x ratios x depths (defaults below)\n"
"  --grid-contexts LIST   default 8k,32k,64k,128k (synthetic only)\n"
"  --grid-ratios LIST     default 8,32,128\n"
"  --grid-depths LIST     default 0.1,0.2,...,0.9 (synthetic only)\n"
"  Lists are comma separated, of any length up to 64 items; an empty item is an error.\n"
"\n"
"Output:\n"
"  --csv FILE             one line per needle query and run\n"
"  --svg FILE             heatmap: pass rate per (context, ratio), depth as sub-cells\n"
"  --verbose              one line per needle query on stdout\n"
"  --edges                share of the kept rows within 32 rows of a block edge, per\n"
"                         (mode, context, ratio) of the salience policy, after the table\n"
"  --progress / --no-progress   progress bar on stderr (default: when stderr is a terminal)\n"
"  --help\n");
}

/* ------------------------------------------------------------------------------------------- */
/* Flag parsing                                                                                 */
/* ------------------------------------------------------------------------------------------- */
static int parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0)
        return -1;
    if (*end == 'k' || *end == 'K') {
        v *= 1024;
        end++;
    } else if (*end == 'm' || *end == 'M') {
        v *= 1024 * 1024;
        end++;
    }
    if (*end || v != floor(v) || v > 1e15)
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static int parse_f64(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        return -1;
    *out = v;
    return 0;
}

#define MAX_LIST 64

typedef struct opts {
    const char *trace, *write_trace, *csv, *svg, *write_basis;
    uint32_t layer;
    nd_gen_params gen;
    nd_run_params run;
    bool scale_set; /* --scale given (else a trace's own scale applies) */
    uint64_t contexts[MAX_LIST];
    uint32_t n_contexts;
    uint64_t ratios[MAX_LIST];
    uint32_t n_ratios;
    double depths[MAX_LIST];
    uint32_t n_depths;
    nd_salience levels[ND_SAL_COUNT];
    uint32_t n_levels;
    nd_mode modes[ND_MODE_COUNT];
    uint32_t n_modes;
    uint64_t seeds;
    bool grid, verbose, prompt_set;
    bool edges; /* --edges: the block-edge share of the kept rows (nd_report_edges) */
    int progress; /* -1 auto */
} opts;

#if defined(__GNUC__)
#define USAGE_PRINTF __attribute__((format(printf, 1, 2)))
#else
#define USAGE_PRINTF
#endif
static int usage_err(const char *fmt, ...) USAGE_PRINTF;

static int usage_err(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvtier-needle: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (try --help)\n");
    va_end(ap);
    return EXIT_USAGE;
}

/* One item of a comma list: parse tok into element i of out (0, or -1 when tok is not a value
 * the flag accepts). */
typedef int (*item_fn)(const char *tok, void *out, uint32_t i);

static int item_u64(const char *tok, void *out, uint32_t i) {
    return parse_u64(tok, (uint64_t *)out + i);
}

static int item_f64(const char *tok, void *out, uint32_t i) {
    return parse_f64(tok, (double *)out + i);
}

static int item_salience(const char *tok, void *out, uint32_t i) {
    nd_salience s;
    /* "trace" labels needles of a trace without annotations; it is not a band to generate */
    if (nd_salience_parse(tok, &s) || s == ND_SAL_TRACE)
        return -1;
    ((nd_salience *)out)[i] = s;
    return 0;
}

static int item_mode(const char *tok, void *out, uint32_t i) {
    nd_mode m;
    if (nd_mode_parse(tok, &m))
        return -1;
    ((nd_mode *)out)[i] = m;
    return 0;
}

/* Parse the comma list v of flag into at most max items. The value is split in a heap copy of
 * its full length, never in a fixed buffer: a buffer cuts a long value, and the cut item then
 * parses as another value ("...,128" cut to "...,12", a long "000...0.9" to 0). Every item must
 * be a value: an empty one ("8,,32", a trailing comma) is refused rather than skipped, since it is
 * almost always a typo, and more than max items are refused rather than dropped. On success *n holds the count and out the
 * items; on a bad list *n is left alone, a usage message naming flag is printed and EXIT_USAGE
 * returned. what describes the accepted values for the message. */
static int parse_list(const char *flag, const char *v, uint32_t max, item_fn fn, void *out,
                      uint32_t *n, const char *what) {
    char *copy = strdup(v);
    if (!copy) {
        fprintf(stderr, "kvtier-needle: out of memory\n");
        return EXIT_ERR;
    }
    uint32_t k = 0;
    int rc = 0;
    for (char *tok = copy;; k++) {
        char *comma = strchr(tok, ',');
        if (comma)
            *comma = 0;
        if (!*tok) {
            rc = usage_err("bad %s '%s': item %u is empty", flag, v, k + 1);
            break;
        }
        if (k >= max) {
            rc = usage_err("bad %s '%s': more than %u items", flag, v, max);
            break;
        }
        if (fn(tok, out, k) != 0) {
            rc = usage_err("bad %s '%s': item %u '%s' (%s)", flag, v, k + 1, tok, what);
            break;
        }
        if (!comma)
            break;
        tok = comma + 1;
    }
    free(copy);
    if (rc == 0)
        *n = k + 1;
    return rc;
}

/* Flags that only shape the synthetic haystack. A trace brings its own rows, layer kind, dtype,
 * prompt, needles, heads and query positions, so with --trace these would be ignored, and a run
 * that silently ignores --context 128k or --salience weak reports on something other than what
 * was asked: they are refused instead. Flags of the manager and of the pass rule (--ratio, --mode,
 * --block, --kappa, --sinks, --recent, --scale, --seed as the kvtier seed, --min-*) and --grid
 * (its ratio axis) apply to a trace as well. --write-trace has its own check. */
static const char *const k_synthetic_only[] = {
    "--context", "--depth",        "--needles",       "--needle-rows", "--salience",
    "--heads",   "--target-heads", "--kv-haystack",   "--rope",        "--prompt-rows",
    "--dtype",   "--seeds",        "--grid-contexts", "--grid-depths", "--branch",
    "--calib-basis", "--decode-calib", "--decode-gap", "--query-rank", "--decoys",
};

static bool synthetic_only(const char *a) {
    for (size_t k = 0; k < sizeof k_synthetic_only / sizeof k_synthetic_only[0]; k++)
        if (!strcmp(a, k_synthetic_only[k]))
            return true;
    return false;
}

/* Ratios are used as uint32_t compression ratios: 1..2^20 (like the library's config). */
static int check_ratios(const char *flag, const char *v, const uint64_t *r, uint32_t n) {
    for (uint32_t k = 0; k < n; k++)
        if (r[k] < 1 || r[k] > 1u << 20)
            return usage_err("bad %s '%s': item %u is %llu (1..2^20)", flag, v, k + 1,
                             (unsigned long long)r[k]);
    return 0;
}

static int parse_args(int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    o->gen = nd_gen_default_params();
    o->run = nd_run_default_params();
    o->layer = UINT32_MAX;
    o->contexts[0] = 32768;
    o->n_contexts = 1;
    o->ratios[0] = 32;
    o->n_ratios = 1;
    o->depths[0] = 0.5;
    o->n_depths = 1;
    o->levels[0] = ND_SAL_STRONG;
    o->n_levels = 1;
    o->modes[0] = ND_MODE_SALIENCE;
    o->n_modes = 1;
    o->seeds = 1;
    o->progress = -1;
    bool ctx_set = false, ratio_set = false, depth_set = false;
    uint64_t gc[MAX_LIST], gr[MAX_LIST];
    double gd[MAX_LIST];
    uint32_t ngc = 0, ngr = 0, ngd = 0;
    const char *synth_flag = NULL; /* first synthetic-only flag given (refused with --trace) */
    bool layer_set = false;
    int rc;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!synth_flag && synthetic_only(a))
            synth_flag = a;
#define NEED_VALUE()                                                                               \
    do {                                                                                           \
        if (!v)                                                                                    \
            return usage_err("%s needs a value", a);                                               \
        i++;                                                                                       \
    } while (0)
        uint64_t u;
        double d;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--synthetic")) {
            o->trace = NULL;
        } else if (!strcmp(a, "--trace")) {
            NEED_VALUE();
            o->trace = v;
        } else if (!strcmp(a, "--layer")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u >= UINT32_MAX)
                return usage_err("bad --layer '%s'", v);
            o->layer = (uint32_t)u;
            layer_set = true;
        } else if (!strcmp(a, "--write-trace")) {
            NEED_VALUE();
            o->write_trace = v;
        } else if (!strcmp(a, "--context")) {
            NEED_VALUE();
            if ((rc = parse_list(a, v, MAX_LIST, item_u64, o->contexts, &o->n_contexts,
                                 "rows, k = 1024")))
                return rc;
            ctx_set = true;
        } else if (!strcmp(a, "--depth")) {
            NEED_VALUE();
            if ((rc = parse_list(a, v, MAX_LIST, item_f64, o->depths, &o->n_depths, "0..1")))
                return rc;
            depth_set = true;
        } else if (!strcmp(a, "--needles")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > 1000)
                return usage_err("bad --needles '%s' (1..1000)", v);
            o->gen.needles_per_depth = (uint32_t)u;
        } else if (!strcmp(a, "--needle-rows")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > ND_MAX_NEEDLE_ROWS)
                return usage_err("bad --needle-rows '%s' (1..16)", v);
            o->gen.needle_rows = (uint32_t)u;
        } else if (!strcmp(a, "--salience")) {
            NEED_VALUE();
            if (!strcmp(v, "all")) {
                o->levels[0] = ND_SAL_STRONG;
                o->levels[1] = ND_SAL_WEAK;
                o->levels[2] = ND_SAL_NONE;
                o->n_levels = 3;
            } else if ((rc = parse_list(a, v, 4, item_salience, o->levels, &o->n_levels,
                                        "strong|weak|none|natural, or 'all' alone"))) {
                return rc;
            }
        } else if (!strcmp(a, "--heads")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > ND_MAX_HEADS)
                return usage_err("bad --heads '%s' (1..64)", v);
            o->gen.n_q_heads = (uint32_t)u;
        } else if (!strcmp(a, "--target-heads")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > ND_MAX_HEADS)
                return usage_err("bad --target-heads '%s'", v);
            o->gen.n_target_heads = (uint32_t)u;
        } else if (!strcmp(a, "--kv-haystack")) {
            NEED_VALUE();
            if (parse_f64(v, &d) || d < 0 || d > 0.5)
                return usage_err("bad --kv-haystack '%s' (0..0.5)", v);
            o->gen.kv_haystack = d;
        } else if (!strcmp(a, "--branch")) {
            NEED_VALUE();
            if (nd_branch_parse(v, &o->gen.branch))
                return usage_err("bad --branch '%s' (smooth|drift)", v);
        } else if (!strcmp(a, "--sigma-basis") || !strcmp(a, "--calib-basis")) {
            NEED_VALUE();
            kvt_sigma_basis b;
            if (!strcmp(v, "fourier"))
                b = KVT_SIGMA_FOURIER;
            else if (!strcmp(v, "dct"))
                b = KVT_SIGMA_DCT;
            else
                return usage_err("bad %s '%s' (fourier|dct)", a, v);
            if (a[2] == 's')
                o->run.sigma_basis = b;
            else
                o->gen.calib_basis = b;
        } else if (!strcmp(a, "--budget")) {
            o->run.salience_budget = true;
        } else if (!strcmp(a, "--budget-min-kept")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > UINT32_MAX)
                return usage_err("bad --budget-min-kept '%s'", v);
            o->run.budget_min_kept = (uint32_t)u;
        } else if (!strcmp(a, "--edges")) {
            o->edges = true;
        } else if (!strcmp(a, "--rope")) {
            o->gen.rope = true;
        } else if (!strcmp(a, "--decode-calib")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > 65536)
                return usage_err("bad --decode-calib '%s' (1..65536)", v);
            o->gen.decode_calib = (uint32_t)u;
        } else if (!strcmp(a, "--decode-gap")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u > 4096)
                return usage_err("bad --decode-gap '%s' (0..4096)", v);
            o->gen.decode_gap = (uint32_t)u;
        } else if (!strcmp(a, "--query-rank")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > KVT_RECALL_MAX_RANK)
                return usage_err("bad --query-rank '%s' (1..%u)", v, KVT_RECALL_MAX_RANK);
            o->gen.query_rank = (uint32_t)u;
        } else if (!strcmp(a, "--decoys")) {
            NEED_VALUE();
            if (parse_f64(v, &d) || d < 0 || d > 0.5)
                return usage_err("bad --decoys '%s' (0..0.5)", v);
            o->gen.decoys = d;
        } else if (!strcmp(a, "--recall")) {
            NEED_VALUE();
            if (!strcmp(v, "conformal"))
                o->run.recall = KVT_RECALL_CONFORMAL;
            else if (!strcmp(v, "sound"))
                o->run.recall = KVT_RECALL_SOUND;
            else if (!strcmp(v, "margin"))
                o->run.recall = KVT_RECALL_MARGIN;
            else
                return usage_err("bad --recall '%s' (conformal, sound, margin)", v);
        } else if (!strcmp(a, "--recall-basis")) {
            NEED_VALUE();
            o->run.recall_basis = strcmp(v, "none") != 0;
            o->run.recall_basis_file = strcmp(v, "subspace") && strcmp(v, "none") ? v : NULL;
        } else if (!strcmp(a, "--recall-adapt")) {
            o->run.recall_adapt = true;
        } else if (!strcmp(a, "--write-basis")) {
            NEED_VALUE();
            o->write_basis = v;
        } else if (!strcmp(a, "--archive-space")) {
            NEED_VALUE();
            if (!strcmp(v, "device"))
                o->run.archive_space = KVT_SPACE_DEVICE;
            else if (!strcmp(v, "host"))
                o->run.archive_space = KVT_SPACE_HOST;
            else
                return usage_err("bad --archive-space '%s' (device, host)", v);
        } else if (!strcmp(a, "--recall-scan-bits")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || (u != 8 && u != 16))
                return usage_err("bad --recall-scan-bits '%s' (8, 16)", v);
            o->run.recall_scan_bits = (uint32_t)u;
        } else if (!strcmp(a, "--recall-cap")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > (1u << 24))
                return usage_err("bad --recall-cap '%s' (1..2^24)", v);
            o->run.recall_cap_rows = (uint32_t)u;
        } else if (!strcmp(a, "--prompt-rows")) {
            NEED_VALUE();
            if (parse_u64(v, &u))
                return usage_err("bad --prompt-rows '%s'", v);
            o->gen.prompt_rows = u;
            o->prompt_set = true;
        } else if (!strcmp(a, "--dtype")) {
            NEED_VALUE();
            if (!strcmp(v, "bf16"))
                o->gen.dtype = KVT_DTYPE_BF16;
            else if (!strcmp(v, "fp16"))
                o->gen.dtype = KVT_DTYPE_FP16;
            else if (!strcmp(v, "fp32"))
                o->gen.dtype = KVT_DTYPE_FP32;
            else
                return usage_err("bad --dtype '%s' (bf16|fp16|fp32)", v);
        } else if (!strcmp(a, "--seed")) {
            NEED_VALUE();
            if (parse_u64(v, &u))
                return usage_err("bad --seed '%s'", v);
            o->gen.seed = u;
            o->run.seed = u;
        } else if (!strcmp(a, "--batch")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > ND_MAX_BATCH)
                return usage_err("bad --batch '%s' (1..%u)", v, ND_MAX_BATCH);
            o->run.batch = (uint32_t)u;
        } else if (!strcmp(a, "--backend")) {
            NEED_VALUE();
            if (!strcmp(v, "cpu"))
                o->run.backend = KVT_BACKEND_CPU;
            else if (!strcmp(v, "guarded"))
                o->run.backend = KVT_BACKEND_GUARDED;
            else if (!strcmp(v, "cuda"))
                o->run.backend = KVT_BACKEND_CUDA;
            else
                return usage_err("bad --backend '%s' (cpu, guarded, cuda)", v);
        } else if (!strcmp(a, "--snapshot-at")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1)
                return usage_err("bad --snapshot-at '%s' (a step, 1..)", v);
            o->run.snapshot_at = u;
        } else if (!strcmp(a, "--snapshot-dir")) {
            NEED_VALUE();
            o->run.snapshot_dir = v;
        } else if (!strcmp(a, "--seeds")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > 10000)
                return usage_err("bad --seeds '%s'", v);
            o->seeds = u;
        } else if (!strcmp(a, "--mode")) {
            NEED_VALUE();
            if ((rc = parse_list(a, v, ND_MODE_COUNT, item_mode, o->modes, &o->n_modes,
                                 "salience|random|dense|recall|promote")))
                return rc;
        } else if (!strcmp(a, "--ratio")) {
            NEED_VALUE();
            if ((rc = parse_list(a, v, MAX_LIST, item_u64, o->ratios, &o->n_ratios, "1..2^20")))
                return rc;
            if ((rc = check_ratios(a, v, o->ratios, o->n_ratios)))
                return rc;
            ratio_set = true;
        } else if (!strcmp(a, "--block")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 64 || u > (1u << 20) || (u & (u - 1)))
                return usage_err("bad --block '%s' (power of two >= 64)", v);
            o->gen.block_rows = o->run.block_rows = (uint32_t)u;
        } else if (!strcmp(a, "--kappa")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > 4096)
                return usage_err("bad --kappa '%s'", v);
            o->gen.kappa = o->run.kappa = (uint32_t)u;
        } else if (!strcmp(a, "--sinks")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u > 4096)
                return usage_err("bad --sinks '%s'", v);
            o->gen.sink_rows = o->run.sink_rows = (uint32_t)u;
        } else if (!strcmp(a, "--recent")) {
            NEED_VALUE();
            if (parse_u64(v, &u) || u < 1 || u > 65536)
                return usage_err("bad --recent '%s'", v);
            o->run.recent_rows = (uint32_t)u;
        } else if (!strcmp(a, "--scale")) {
            NEED_VALUE();
            if (parse_f64(v, &d) || d <= 0)
                return usage_err("bad --scale '%s'", v);
            o->gen.scale = o->run.scale = d;
            o->scale_set = true;
        } else if (!strcmp(a, "--min-mass")) {
            NEED_VALUE();
            if (parse_f64(v, &d))
                return usage_err("bad --min-mass '%s'", v);
            o->run.min_mass = d;
        } else if (!strcmp(a, "--min-cos")) {
            NEED_VALUE();
            if (parse_f64(v, &d) || d < -1 || d > 1)
                return usage_err("bad --min-cos '%s'", v);
            o->run.min_cos = d;
        } else if (!strcmp(a, "--grid")) {
            o->grid = true;
        } else if (!strcmp(a, "--grid-contexts")) {
            NEED_VALUE();
            if ((rc = parse_list(a, v, MAX_LIST, item_u64, gc, &ngc, "rows, k = 1024")))
                return rc;
        } else if (!strcmp(a, "--grid-ratios")) {
            NEED_VALUE();
            /* range-checked like --ratio: a ratio is used as a uint32_t, and 2^32 + 8 must not
             * quietly become 8 */
            if ((rc = parse_list(a, v, MAX_LIST, item_u64, gr, &ngr, "1..2^20")))
                return rc;
            if ((rc = check_ratios(a, v, gr, ngr)))
                return rc;
        } else if (!strcmp(a, "--grid-depths")) {
            NEED_VALUE();
            if ((rc = parse_list(a, v, MAX_LIST, item_f64, gd, &ngd, "0..1")))
                return rc;
        } else if (!strcmp(a, "--csv")) {
            NEED_VALUE();
            o->csv = v;
        } else if (!strcmp(a, "--svg")) {
            NEED_VALUE();
            o->svg = v;
        } else if (!strcmp(a, "--verbose")) {
            o->verbose = true;
        } else if (!strcmp(a, "--progress")) {
            o->progress = 1;
        } else if (!strcmp(a, "--no-progress")) {
            o->progress = 0;
        } else {
            return usage_err("unknown option '%s'", a);
        }
#undef NEED_VALUE
    }
    /* Checked after the loop: --synthetic / --trace may come after the flags, the last wins. */
    if (o->trace && synth_flag)
        return usage_err("%s shapes the synthetic haystack and does not apply to --trace (the "
                         "trace brings its own rows, needles and queries)", synth_flag);
    if (!o->trace && layer_set)
        return usage_err("%s", "--layer applies to --trace only (a synthetic haystack has one "
                               "layer)");
    if (o->grid) {
        static const uint64_t dc[] = {8192, 32768, 65536, 131072};
        static const uint64_t dr[] = {8, 32, 128};
        if (ngc) {
            memcpy(o->contexts, gc, sizeof(uint64_t) * ngc);
            o->n_contexts = ngc;
        } else if (!ctx_set) {
            memcpy(o->contexts, dc, sizeof dc);
            o->n_contexts = 4;
        }
        if (ngr) {
            memcpy(o->ratios, gr, sizeof(uint64_t) * ngr);
            o->n_ratios = ngr;
        } else if (!ratio_set) {
            memcpy(o->ratios, dr, sizeof dr);
            o->n_ratios = 3;
        }
        if (ngd) {
            memcpy(o->depths, gd, sizeof(double) * ngd);
            o->n_depths = ngd;
        } else if (!depth_set) {
            for (int k = 0; k < 9; k++)
                o->depths[k] = 0.1 * (k + 1);
            o->n_depths = 9;
        }
    } else if (ngc || ngr || ngd) {
        return usage_err("%s", "--grid-* flags need --grid");
    }
    for (uint32_t k = 0; k < o->n_depths; k++)
        if (o->depths[k] < 0 || o->depths[k] > 1)
            return usage_err("%s", "depths must lie in [0, 1]");
    for (uint32_t k = 0; k < o->n_ratios; k++)
        if (o->ratios[k] < 1)
            return usage_err("%s", "ratios must be >= 1");
    if (o->gen.n_target_heads > o->gen.n_q_heads)
        return usage_err("%s", "--target-heads exceeds --heads");
    if (o->gen.rope && !o->prompt_set)
        o->gen.prompt_rows = 256;
    /* recall needs the decode phase: 16 filler steps before the first needle query unless
     * --decode-calib says otherwise; --decoys and the decode flags need it too */
    bool want_recall = false;
    for (uint32_t k = 0; k < o->n_modes; k++)
        want_recall |= o->modes[k] == ND_MODE_RECALL;
    if (want_recall && !o->gen.decode_calib)
        o->gen.decode_calib = 16;
    if (o->run.recall_adapt && !want_recall)
        return usage_err("%s", "--recall-adapt needs --mode recall (it refits the recall basis "
                               "to the decode phase's queries)");
    if (o->run.recall_adapt && !o->run.recall_basis)
        return usage_err("%s", "--recall-adapt needs a basis to start from (--recall-basis "
                               "subspace or FILE, not none)");
    if (o->gen.decoys > 0 && !o->gen.decode_calib)
        return usage_err("%s", "--decoys needs the decode phase (--mode recall or "
                               "--decode-calib)");
    if (o->write_basis && (o->trace || o->n_contexts != 1 || o->seeds != 1 || !want_recall))
        return usage_err("%s", "--write-basis needs --synthetic, one context, one seed and "
                               "--mode recall");
    if (o->write_trace && (o->trace || o->n_contexts != 1 || o->seeds != 1))
        return usage_err("%s", "--write-trace needs --synthetic, one context and one seed");
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* Progress                                                                                     */
/* ------------------------------------------------------------------------------------------- */
typedef struct progress {
    bool enabled;
    double t0, last_draw;
    double done, total; /* work units */
    double cur_base, cur_weight;
    bool drawn;
    const char *what;
} progress;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void progress_draw(progress *p, double frac_in_step) {
    if (!p->enabled)
        return;
    double t = now_s();
    /* Only on runs longer than a couple of seconds, at most 10 redraws per second. */
    if (t - p->t0 < 2.0 || t - p->last_draw < 0.1)
        return;
    p->last_draw = t;
    double f = (p->cur_base + p->cur_weight * frac_in_step) / (p->total > 0 ? p->total : 1);
    if (f > 1)
        f = 1;
    int w = 30, fill = (int)(f * w + 0.5);
    char bar[64];
    for (int i = 0; i < w; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[w] = 0;
    double el = t - p->t0, eta = f > 0.01 ? el * (1 - f) / f : 0;
    fprintf(stderr, "\r[%s] %3.0f%%  %-28.28s %5.0fs elapsed, ~%.0fs left ", bar, 100 * f,
            p->what ? p->what : "", el, eta);
    fflush(stderr);
    p->drawn = true;
}

static void progress_cb(void *ud, double frac) {
    progress_draw((progress *)ud, frac);
}

static void progress_step(progress *p, double weight, const char *what) {
    p->cur_base = p->done;
    p->cur_weight = weight;
    p->what = what;
}

static void progress_end_step(progress *p) {
    p->done = p->cur_base + p->cur_weight;
}

static void progress_clear(progress *p) {
    if (p->drawn) {
        fprintf(stderr, "\r%80s\r", "");
        fflush(stderr);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Driver                                                                                       */
/* ------------------------------------------------------------------------------------------- */
static int append_results(nd_record **recs, size_t *n, size_t *cap, const nd_case *c,
                          const nd_result *res, const double *pct, uint64_t context, uint64_t seed,
                          uint32_t ratio, nd_mode mode, uint32_t batch) {
    for (uint32_t i = 0; i < c->n_targets * batch; i++) {
        if (*n == *cap) {
            size_t nc = *cap ? *cap * 2 : 256;
            nd_record *r = realloc(*recs, nc * sizeof *r);
            if (!r)
                return -1;
            *recs = r;
            *cap = nc;
        }
        nd_record *r = &(*recs)[(*n)++];
        r->context = context;
        r->seed = seed;
        r->ratio = ratio;
        r->mode = mode;
        r->rope = c->spec.kind != KVT_LAYER_MLA_NOPE;
        r->res = res[i];
        r->sigma_pct = pct[res[i].needle];
    }
    return 0;
}

/* Recall summary of one (context, ratio) cell over its seeds. */
typedef struct recall_sum {
    nd_recall_stats st;
    uint32_t runs;
    uint32_t counted, pass, by_fetch, by_dense, by_kept;
    float z_min, z_max;
    uint64_t context; /* the haystack's rows (decode_start) */
    uint32_t refits;  /* --recall-adapt: basis refits, summed over the haystacks */
} recall_sum;

static void recall_add(recall_sum *a, const nd_recall_stats *s, const nd_result *res, size_t n) {
    a->st.steps += s->steps;
    a->st.calib_steps += s->calib_steps;
    a->st.needle_steps += s->needle_steps;
    a->st.needle_overflow += s->needle_overflow;
    a->st.needle_dense += s->needle_dense;
    a->st.other_steps += s->other_steps;
    a->st.other_overflow += s->other_overflow;
    a->st.other_dense += s->other_dense;
    a->st.other_fetched += s->other_fetched;
    a->st.other_archived += s->other_archived;
    a->st.visited += s->visited;
    a->st.archived += s->archived;
    a->refits += s->refits;
    if (!a->runs || s->z < a->z_min)
        a->z_min = s->z;
    if (!a->runs || s->z > a->z_max)
        a->z_max = s->z;
    a->runs++;
    for (size_t i = 0; i < n; i++) {
        if (res[i].status != ND_PASS && res[i].status != ND_FAIL)
            continue;
        a->counted++;
        if (res[i].status != ND_PASS)
            continue;
        a->pass++;
        a->by_fetch += res[i].pass_by == 'f';
        a->by_dense += res[i].pass_by == 'd';
        a->by_kept += res[i].pass_by == 'k';
    }
}

/* One line per (context, ratio); with --recall-adapt it ends "; refits N" (N summed over the
 * haystacks). */
static void recall_print(const recall_sum *a, uint64_t context, uint32_t ratio,
                         kvt_recall_mode mode, bool adapt, uint32_t seeds) {
    if (!a->runs)
        return;
    const nd_recall_stats *s = &a->st;
    printf("recall %s %lluk %ux (%u haystack%s): pass %u/%u (by fetch %u, by overflow/dense %u, "
           "kept by salience %u); needle steps %llu: overflow %llu, dense %llu; other steps %llu "
           "(after %llu calibration): overflow %llu, dense %llu; fetched on other non-dense "
           "steps %.4f%% of the archive; visited %.1f%%; z %.3g..%.3g",
           kvt_recall_mode_name(mode),
           (unsigned long long)(context / 1024), ratio, seeds, seeds == 1 ? "" : "s", a->pass,
           a->counted, a->by_fetch, a->by_dense, a->by_kept,
           (unsigned long long)s->needle_steps, (unsigned long long)s->needle_overflow,
           (unsigned long long)s->needle_dense, (unsigned long long)s->other_steps,
           (unsigned long long)s->calib_steps, (unsigned long long)s->other_overflow,
           (unsigned long long)s->other_dense,
           s->other_archived ? 100.0 * (double)s->other_fetched / (double)s->other_archived : 0.0,
           s->archived ? 100.0 * (double)s->visited / (double)s->archived : 0.0,
           (double)a->z_min, (double)a->z_max);
    if (adapt)
        printf("; refits %u", a->refits);
    printf("\n");
}

int main(int argc, char **argv) {
    opts o;
    int prc = parse_args(argc, argv, &o);
    if (prc)
        return prc;
    for (uint32_t k = 0; k < o.n_modes; k++)
        if (o.modes[k] == ND_MODE_PROMOTE) {
            fprintf(stderr, "kvtier-needle: mode '%s' is not implemented yet, so nothing is "
                    "measured\n", nd_mode_name(o.modes[k]));
            return EXIT_NOTIMPL;
        }
    if (o.run.recall_adapt && !eig_have_lapacke()) {
        fprintf(stderr, "kvtier-needle: --recall-adapt: this kvtier-needle was built without "
                "LAPACKE, which the eigenvectors need (install Debian's liblapacke-dev, "
                "scripts/deps.sh, and reconfigure); nothing was measured\n");
        return EXIT_ERR;
    }
    static recall_sum rsum[MAX_LIST][MAX_LIST];
    memset(rsum, 0, sizeof rsum);
    progress pg;
    memset(&pg, 0, sizeof pg);
    pg.enabled = o.progress == 1 || (o.progress == -1 && isatty(2));
    pg.t0 = now_s();
    double t_gen = 0, t_ref = 0, t_run = 0;

    /* Work estimate: per case, generation + references ~ 3 units per row, each replay ~1. */
    uint32_t runs_per_case = 0;
    for (uint32_t k = 0; k < o.n_modes; k++)
        runs_per_case += o.modes[k] == ND_MODE_DENSE ? 1 : o.n_ratios;
    uint32_t n_cases = o.trace ? 1 : o.n_contexts * (uint32_t)o.seeds;
    for (uint32_t ci = 0; ci < (o.trace ? 1 : o.n_contexts); ci++)
        pg.total += (double)(o.trace ? 1 : o.contexts[ci]) * (double)(o.trace ? 1 : o.seeds) *
                    (3.0 + runs_per_case);

    nd_record *recs = NULL;
    size_t n_recs = 0, cap_recs = 0;
    char err[1024];
    int rc = 0;
    bool skipped = false; /* a mode a case could not run (said on stderr; the others measured) */
    char what[64];
    uint64_t nonfinite_total = 0; /* rows holding NaN / Inf, over every case */
    const char *source = o.trace ? o.trace : "synthetic";
    (void)n_cases;
    for (uint32_t ci = 0; ci < (o.trace ? 1 : o.n_contexts) && rc == 0; ci++) {
        for (uint64_t si = 0; si < (o.trace ? 1 : o.seeds) && rc == 0; si++) {
            nd_case c;
            double units = o.trace ? 1 : (double)o.contexts[ci];
            double t = now_s();
            if (o.trace) {
                progress_step(&pg, 1.0 * units, "loading trace");
                int e = nd_case_load(o.trace, o.layer, &c, err, sizeof err);
                if (e) {
                    progress_clear(&pg);
                    fprintf(stderr, "kvtier-needle: %s\n", err);
                    rc = e == ND_EARG ? EXIT_USAGE : EXIT_ERR;
                    break;
                }
                /* The softmax scale: --scale, else the one the trace names, else a GQA layer's
                 * head_dim^-1/2 (an MLA layer keeps the 192^-1/2 default). */
                if (!o.scale_set && c.scale > 0)
                    o.run.scale = c.scale;
                else if (!o.scale_set && c.spec.n_planes == 2)
                    o.run.scale = 1.0 / sqrt((double)c.spec.head_dim);
            } else {
                nd_gen_params gp = o.gen;
                gp.context = o.contexts[ci];
                gp.seed = o.gen.seed + si;
                gp.depths = o.depths;
                gp.n_depths = o.n_depths;
                gp.levels = o.levels;
                gp.n_levels = o.n_levels;
                snprintf(what, sizeof what, "generating %lluk seed %llu",
                         (unsigned long long)(gp.context / 1024), (unsigned long long)gp.seed);
                progress_step(&pg, 1.5 * units, what);
                int e = nd_generate(&gp, &c, progress_cb, &pg, err, sizeof err);
                if (e) {
                    progress_clear(&pg);
                    fprintf(stderr, "kvtier-needle: generator: %s\n", err);
                    rc = e == ND_EARG ? EXIT_USAGE : EXIT_ERR;
                    break;
                }
            }
            progress_end_step(&pg);
            t_gen += now_s() - t;
            if (c.band_misses) {
                progress_clear(&pg);
                fprintf(stderr, "kvtier-needle: warning: %u needle row(s) of the %lluk haystack "
                        "(seed %llu) missed their salience band: those needles are reported as "
                        "band_miss, not counted (see the sigma_pct column)\n",
                        c.band_misses, (unsigned long long)(c.n_rows / 1024),
                        (unsigned long long)c.seed);
            }
            /* Rows holding NaN / Inf make the full-cache reference of every later query
             * non-finite; those queries are reported as invalid (nd_run). Say how many rows. */
            uint64_t first_bad = 0, n_bad = nd_case_nonfinite_rows(&c, &first_bad);
            if (n_bad) {
                progress_clear(&pg);
                fprintf(stderr, "kvtier-needle: warning: %llu row(s) of the %llu-row case (%s, "
                        "layer %u) hold NaN or Inf, the first at row %llu: needle queries whose "
                        "full-cache reference is non-finite are reported as invalid, not "
                        "counted\n", (unsigned long long)n_bad, (unsigned long long)c.n_rows,
                        source, c.layer, (unsigned long long)first_bad);
                nonfinite_total += n_bad;
            }
            if (o.write_basis) {
                kvt_recall_basis_info bi;
                memset(&bi, 0, sizeof bi);
                bi.rank = c.qbasis_rank < o.run.recall_rank ? c.qbasis_rank : o.run.recall_rank;
                bi.dim = c.spec.value_dim;
                bi.captured = NAN;
                kvt_status bs = c.qbasis ? kvt_recall_basis_write(o.write_basis, &bi, c.qbasis)
                                         : KVT_ERR_INVALID_ARGUMENT;
                if (bs != KVT_OK) {
                    progress_clear(&pg);
                    fprintf(stderr, "kvtier-needle: --write-basis %s: %s\n", o.write_basis,
                            c.qbasis ? kvt_strerror(bs) : "the case has no decode phase");
                    nd_case_free(&c);
                    rc = EXIT_ERR;
                    break;
                }
            }
            if (o.write_trace) {
                int e = nd_case_save(&c, o.write_trace, err, sizeof err);
                if (e) {
                    progress_clear(&pg);
                    fprintf(stderr, "kvtier-needle: %s\n", err);
                    nd_case_free(&c);
                    rc = EXIT_ERR;
                    break;
                }
            }
            double *pct = calloc(c.n_needles ? c.n_needles : 1, sizeof *pct);
            nd_result *res = calloc((size_t)(c.n_targets ? c.n_targets : 1) * o.run.batch,
                                    sizeof *res);
            nd_refs refs;
            memset(&refs, 0, sizeof refs);
            if (!pct || !res) {
                fprintf(stderr, "kvtier-needle: out of memory\n");
                rc = EXIT_ERR;
                goto case_done;
            }
            if (nd_case_sigma_pct_basis(&c, o.run.block_rows, o.run.kappa, o.run.sigma_basis,
                                        pct, err, sizeof err)) {
                fprintf(stderr, "kvtier-needle: %s\n", err);
                rc = EXIT_ERR;
                goto case_done;
            }
            t = now_s();
            progress_step(&pg, (o.trace ? 1.0 : 1.5) * units, "full-cache references");
            if (nd_refs_compute(&c, o.run.scale, &refs, progress_cb, &pg, err, sizeof err)) {
                progress_clear(&pg);
                fprintf(stderr, "kvtier-needle: %s\n", err);
                rc = EXIT_ERR;
                goto case_done;
            }
            progress_end_step(&pg);
            t_ref += now_s() - t;
            for (uint32_t mi = 0; mi < o.n_modes && rc == 0; mi++) {
                uint32_t nr = o.modes[mi] == ND_MODE_DENSE ? 1 : o.n_ratios;
                for (uint32_t ri = 0; ri < nr && rc == 0; ri++) {
                    nd_run_params rp = o.run;
                    rp.mode = o.modes[mi];
                    rp.ratio = o.modes[mi] == ND_MODE_DENSE ? 1 : (uint32_t)o.ratios[ri];
                    rp.seed = o.trace ? o.run.seed : o.gen.seed + si;
                    snprintf(what, sizeof what, "%s %lluk %ux", nd_mode_name(rp.mode),
                             (unsigned long long)(c.n_rows / 1024), rp.ratio);
                    progress_step(&pg, units, what);
                    t = now_s();
                    nd_recall_stats rst;
                    rp.recall_stats = &rst;
                    int e = nd_run(&c, &refs, &rp, res, progress_cb, &pg, err, sizeof err);
                    if (!e && rp.mode == ND_MODE_RECALL) {
                        recall_add(&rsum[ci][ri], &rst, res, (size_t)c.n_targets * rp.batch);
                        rsum[ci][ri].context = c.decode_start;
                    }
                    t_run += now_s() - t;
                    progress_end_step(&pg);
                    if (e == ND_ENOTIMPL) {
                        /* a mode this case cannot run (recall without a decode phase): said,
                         * and the other modes are still measured; the exit status says 3 */
                        progress_clear(&pg);
                        fprintf(stderr, "kvtier-needle: %s; the other modes are measured\n",
                                err);
                        skipped = true;
                        break;
                    }
                    if (e) {
                        progress_clear(&pg);
                        fprintf(stderr, "kvtier-needle: %s\n", err);
                        rc = e == ND_EARG ? EXIT_USAGE : EXIT_ERR;
                        break;
                    }
                    if (append_results(&recs, &n_recs, &cap_recs, &c, res, pct,
                                       c.decode_start ? c.decode_start : c.n_rows,
                                       c.seed, rp.ratio, rp.mode, rp.batch)) {
                        fprintf(stderr, "kvtier-needle: out of memory\n");
                        rc = EXIT_ERR;
                    }
                }
            }
        case_done:
            free(pct);
            free(res);
            nd_refs_free(&refs);
            nd_case_free(&c);
        }
    }
    progress_clear(&pg);
    if (rc) {
        free(recs);
        return rc;
    }
    nd_report rep;
    memset(&rep, 0, sizeof rep);
    rep.recs = recs;
    rep.n = n_recs;
    rep.source = source;
    rep.min_mass = o.run.min_mass;
    rep.min_cos = o.run.min_cos;
    if (o.verbose)
        nd_report_lines(&rep, stdout);
    nd_report_table(&rep, stdout);
    if (o.edges)
        nd_report_edges(&rep, stdout);
    if (o.csv && nd_report_csv(&rep, o.csv, err, sizeof err)) {
        fprintf(stderr, "kvtier-needle: %s\n", err);
        free(recs);
        return EXIT_ERR;
    }
    if (o.svg && nd_report_svg(&rep, o.svg, err, sizeof err)) {
        fprintf(stderr, "kvtier-needle: %s\n", err);
        free(recs);
        return EXIT_ERR;
    }
    uint64_t pass = 0, counted = 0, tails = 0, misses = 0, invalid = 0;
    for (size_t i = 0; i < n_recs; i++) {
        if (recs[i].res.status == ND_TAIL) {
            tails++;
            continue;
        }
        if (recs[i].res.status == ND_BAND_MISS) {
            misses++;
            continue;
        }
        if (recs[i].res.status == ND_INVALID) {
            invalid++;
            continue;
        }
        counted++;
        pass += recs[i].res.status == ND_PASS;
    }
    for (uint32_t ci = 0; ci < (o.trace ? 1 : o.n_contexts); ci++)
        for (uint32_t ri = 0; ri < o.n_ratios; ri++)
            recall_print(&rsum[ci][ri], rsum[ci][ri].context, (uint32_t)o.ratios[ri],
                         o.run.recall, o.run.recall_adapt, o.trace ? 1 : (uint32_t)o.seeds);
    printf("time: generate %.1f s, full-cache references %.1f s, replay %.1f s, total %.1f s\n",
           t_gen, t_ref, t_run, now_s() - pg.t0);
    if (tails)
        printf("%llu needle queries with the needle in rows not scored yet (unclosed tail, "
               "eviction window): reported, not counted\n", (unsigned long long)tails);
    if (misses)
        printf("%llu needle queries whose needle missed its salience band: reported as band_miss, "
               "not counted\n", (unsigned long long)misses);
    if (invalid || nonfinite_total)
        printf("%llu non-finite row(s) in the replayed rows; %llu needle queries with a "
               "non-finite full-cache reference: reported as invalid, not counted\n",
               (unsigned long long)nonfinite_total, (unsigned long long)invalid);
    printf("pass %llu/%llu\n", (unsigned long long)pass, (unsigned long long)counted);
    free(recs);
    return skipped ? EXIT_NOTIMPL : 0;
}
