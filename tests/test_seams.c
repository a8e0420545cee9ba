/* test_seams.c — the allocation and I/O seams (lib/base/seam.h): for each public entry point
 * that allocates or touches files, run it once to record every seam call it makes, then fail
 * each call in turn (the k-th of the run, k = 0, 1, ...) and check that
 *   - the documented status comes back (KVT_ERR_OUT_OF_MEMORY for an allocation, KVT_ERR_IO
 *     for a file operation), or KVT_OK where the failed call is one the entry point may do
 *     without (each such site is listed: a best-effort cleanup, the close of a read-only file);
 *   - nothing changed: no handle handed out, the target request and pools as they were, a file
 *     at the destination byte for byte as it was, no temporary left behind;
 *   - nothing leaked: the live allocations through the seam are what they were before the call
 *     (and, in the sanitizer build, LeakSanitizer sees every byte at exit);
 * and that the sites the successful run reached are exactly the expected list, so a new
 * allocation or file operation shows up here (and one that bypasses the seams is caught by
 * tests/scripts/check_seams.py).
 *
 * Stale temporaries of snapshot writers (lib/replace.c) are tested on real files at the end. */
#define _GNU_SOURCE /* pkey_alloc, pkey_free (glibc >= 2.27) */
#include <criterion/criterion.h>

#include "kvtier.h"
#include "kvtier_ref.h"
#include "kvtier_trace.h"
#include "lib/base/seam.h"
#include "support/testutil.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------- */
/* The recording hook                                                                          */
/* ------------------------------------------------------------------------------------------- */
enum { MAX_SITES = 256 };
static struct {
    kvt__seam_kind kind; /* the seam being swept */
    long fail_at;        /* fail the call with this index (-1: none) */
    long calls;          /* calls of that seam since arming */
    char failed[128];    /* the site of the failed call ("" if none) */
    int n_sites;         /* distinct sites seen since arming */
    char sites[MAX_SITES][128];
} rec;

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* "file.c:function" for an allocation, "file.c:function:op" for a file operation. */
static void site_name(const kvt__seam_call *c, char *out, size_t n) {
    if (c->kind == KVT__SEAM_ALLOC)
        snprintf(out, n, "%s:%s", base_name(c->file), c->func);
    else
        snprintf(out, n, "%s:%s:%s", base_name(c->file), c->func, c->op);
}

static int rec_hook(void *user, kvt__seam_call *c) {
    (void)user;
    if (c->kind != rec.kind)
        return 0;
    char site[128];
    site_name(c, site, sizeof site);
    bool seen = false;
    for (int i = 0; i < rec.n_sites && !seen; i++)
        seen = strcmp(rec.sites[i], site) == 0;
    if (!seen && rec.n_sites < MAX_SITES)
        snprintf(rec.sites[rec.n_sites++], sizeof rec.sites[0], "%s", site);
    if (rec.calls++ == rec.fail_at) {
        snprintf(rec.failed, sizeof rec.failed, "%s", site);
        return c->kind == KVT__SEAM_ALLOC ? ENOMEM : EIO;
    }
    return 0;
}

static void arm(kvt__seam_kind kind, long fail_at) {
    rec.kind = kind;
    rec.fail_at = fail_at;
    rec.calls = 0;
    rec.failed[0] = '\0';
    rec.n_sites = 0;
    kvt__seam_set_hook(rec_hook, NULL);
}

static void disarm(void) {
    kvt__seam_set_hook(NULL, NULL);
}

static bool listed(const char *site, const char *const *list) {
    for (int i = 0; list && list[i]; i++)
        if (strcmp(site, list[i]) == 0)
            return true;
    return false;
}

/* ------------------------------------------------------------------------------------------- */
/* The sweep                                                                                   */
/* ------------------------------------------------------------------------------------------- */
/* One entry point: run it (on success it releases what it made, so the live count must come
 * back), and check after a failed run that nothing changed. */
typedef struct entry {
    const char *name;
    kvt_status (*run)(void *st);
    void (*unchanged)(void *st, const char *failed_site); /* after a failure; may be NULL */
    void *st;
} entry;

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Sweep one seam over one entry point. expected: the sites a successful run reaches (NULL-
 * terminated, any order); absorbed: the sites whose failure the entry point may survive with
 * KVT_OK. Returns the number of failures injected. */
static int sweep(const entry *e, kvt__seam_kind kind, kvt_status want, const char *const *expected,
                 const char *const *absorbed) {
    const char *what = kind == KVT__SEAM_ALLOC ? "allocation" : "I/O";
    /* The recording run. */
    int64_t live0 = kvt__seam_live();
    arm(kind, -1);
    kvt_status s = e->run(e->st);
    disarm();
    cr_assert_eq(s, KVT_OK, "%s: the run without faults: %s (%s)", e->name, kvt_status_name(s),
                 kvt_last_error());
    cr_assert_eq(kvt__seam_live(), live0, "%s: %lld allocations kept by a successful run", e->name,
                 (long long)(kvt__seam_live() - live0));
    long n_calls = rec.calls;
    int n_sites = rec.n_sites;
    const char *got[MAX_SITES];
    for (int i = 0; i < n_sites; i++)
        got[i] = rec.sites[i];
    static char copy[MAX_SITES][128];
    for (int i = 0; i < n_sites; i++) {
        snprintf(copy[i], sizeof copy[i], "%s", got[i]);
        got[i] = copy[i];
    }
    qsort(got, (size_t)n_sites, sizeof *got, cmp_str);
    int n_want = 0;
    while (expected[n_want])
        n_want++;
    const char *wanted[MAX_SITES];
    memcpy(wanted, expected, sizeof *expected * (size_t)n_want);
    qsort(wanted, (size_t)n_want, sizeof *wanted, cmp_str);
    bool same = n_want == n_sites;
    for (int i = 0; same && i < n_sites; i++)
        same = strcmp(got[i], wanted[i]) == 0;
    if (!same) {
        char all[8192] = "";
        for (int i = 0; i < n_sites; i++) {
            strncat(all, "\n  \"", sizeof all - strlen(all) - 1);
            strncat(all, got[i], sizeof all - strlen(all) - 1);
            strncat(all, "\",", sizeof all - strlen(all) - 1);
        }
        cr_assert_fail("%s: the %s sites reached are not the expected %d; reached %d:%s", e->name,
                       what, n_want, n_sites, all);
    }
    /* Fail each call in turn. */
    int failures = 0;
    for (long k = 0; k < n_calls; k++) {
        live0 = kvt__seam_live();
        arm(kind, k);
        s = e->run(e->st);
        disarm();
        cr_assert_neq(rec.failed[0], '\0', "%s: call %ld of %ld not reached", e->name, k, n_calls);
        cr_assert_eq(kvt__seam_live(), live0, "%s: %s %ld failed (%s): %lld allocations leaked",
                     e->name, what, k, rec.failed, (long long)(kvt__seam_live() - live0));
        if (s == KVT_OK) {
            cr_assert(listed(rec.failed, absorbed), "%s: %s %ld failed (%s), yet KVT_OK", e->name,
                      what, k, rec.failed);
            continue;
        }
        failures++;
        cr_assert_eq(s, want, "%s: %s %ld failed (%s): %s (%s)", e->name, what, k, rec.failed,
                     kvt_status_name(s), kvt_last_error());
        if (e->unchanged)
            e->unchanged(e->st, rec.failed);
    }
    cr_log_info("%s: %d of %ld %s calls failed in turn (%d sites)", e->name, failures, n_calls,
                what, n_sites);
    return failures;
}

/* ------------------------------------------------------------------------------------------- */
/* Fixtures                                                                                    */
/* ------------------------------------------------------------------------------------------- */
static char g_dir[64];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/kvt-seams-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
}

static void remove_dir(void) {
    DIR *d = opendir(g_dir);
    if (!d)
        return;
    char p[512];
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", g_dir, e->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(g_dir);
}

static int n_files(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*n ? *n : 1);
    cr_assert_eq(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

static void put_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

/* A request with rows in every policy's layer: closes, eviction rounds, an archive. */
static kvt_seq *driven(kvt_ctx *ctx) {
    kvt_seq *seq;
    cr_assert_eq(tu_seq_create(ctx, 7, &seq), KVT_OK);
    kvt_seq_set_prompt_rows(seq, 6);
    for (int i = 0; i < 12; i++) {
        cr_assert_eq(tu_reserve(seq, 16), KVT_OK, "%s", kvt_last_error());
        cr_assert_eq(tu_commit(seq, 16), KVT_OK, "%s", kvt_last_error());
    }
    return seq;
}

static uint32_t free_pages(kvt_ctx *ctx) {
    uint32_t sum = 0;
    for (uint32_t g = 0;; g++) {
        uint32_t n;
        if (kvt_ctx_free_pages(ctx, g, &n) != KVT_OK)
            return sum;
        sum += n;
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Models and the census                                                                       */
/* ------------------------------------------------------------------------------------------- */
static kvt_status run_model_create(void *st) {
    (void)st;
    kvt_layer_spec s[2];
    kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 512, 64, &s[0]);
    kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 4, 64, &s[1]);
    kvt_model *m = (kvt_model *)&m; /* must come back NULL on failure */
    kvt_status r = kvt_model_create(s, 2, "seams", &m, NULL, 0);
    if (r != KVT_OK)
        cr_assert_null(m);
    kvt_model_destroy(r == KVT_OK ? m : NULL);
    return r;
}

static const char *g_config;

static kvt_status run_model_from_file(void *st) {
    (void)st;
    kvt_model *m = (kvt_model *)&m;
    char err[256] = "";
    kvt_status r = kvt_model_from_file(g_config, KVT_DTYPE_BF16, &m, err, sizeof err);
    if (r != KVT_OK) {
        cr_assert_null(m);
        cr_assert_neq(err[0], '\0');
    }
    kvt_model_destroy(r == KVT_OK ? m : NULL);
    return r;
}

static kvt_status run_model_from_json(void *st) {
    (void)st;
    size_t n = 0;
    char *json = (char *)slurp(g_config, &n);
    kvt_model *m = (kvt_model *)&m;
    char err[256] = "";
    kvt_status r = kvt_model_from_json(json, n, KVT_DTYPE_BF16, &m, err, sizeof err);
    if (r != KVT_OK) {
        cr_assert_null(m);
        cr_assert(r == KVT_ERR_OUT_OF_MEMORY, "%s: %s", kvt_status_name(r), err);
    }
    kvt_model_destroy(r == KVT_OK ? m : NULL);
    free(json);
    return r;
}

static const char *const model_create_sites[] = {"model.c:kvt_model_create", NULL};
/* The census of Kimi Linear: its JSON parsed by jansson, the roles of its layers, its specs. */
static const char *const census_sites[] = {"jansson:json_malloc", "census.c:read_kimi",
                                           "census.c:build_mla", "model.c:kvt_model_create", NULL};

Test(seams, models_and_census) {
    entry e = {"kvt_model_create", run_model_create, NULL, NULL};
    cr_assert_gt(sweep(&e, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, model_create_sites, NULL), 1);
    g_config = tu_model_path("kimi-linear-48b-a3b-instruct.json");
    entry j = {"kvt_model_from_json", run_model_from_json, NULL, NULL};
    cr_assert_gt(sweep(&j, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, census_sites, NULL), 50);
    static const char *const file_sites[] = {"census.c:kvt_model_from_file", "jansson:json_malloc",
                                             "census.c:read_kimi",           "census.c:build_mla",
                                             "model.c:kvt_model_create",     NULL};
    entry f = {"kvt_model_from_file", run_model_from_file, NULL, NULL};
    cr_assert_gt(sweep(&f, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, file_sites, NULL), 50);
    static const char *const file_io[] = {"census.c:kvt_model_from_file:open",
                                          "census.c:kvt_model_from_file:read",
                                          "census.c:kvt_model_from_file:close", NULL};
    static const char *const file_io_absorbed[] = {"census.c:kvt_model_from_file:close", NULL};
    cr_assert_eq(sweep(&f, KVT__SEAM_IO, KVT_ERR_IO, file_io, file_io_absorbed), 3);
}

/* ------------------------------------------------------------------------------------------- */
/* Contexts                                                                                    */
/* ------------------------------------------------------------------------------------------- */
typedef struct ctx_st {
    kvt_model *m;
    kvt_ctx_params p;
    kvt_config c;
} ctx_st;

static kvt_status run_ctx_create(void *v) {
    ctx_st *st = v;
    kvt_ctx *ctx = (kvt_ctx *)&ctx;
    char err[256] = "";
    kvt_status r = kvt_ctx_create(&st->p, &ctx, err, sizeof err);
    if (r != KVT_OK) {
        cr_assert_null(ctx);
        cr_assert_neq(err[0], '\0');
    }
    kvt_ctx_destroy(r == KVT_OK ? ctx : NULL);
    return r;
}

static void ctx_params(ctx_st *st, kvt_backend_kind be, kvt_allocator alloc) {
    st->m = tu_mixed_model();
    st->c = kvt_config_default();
    st->c.block_rows = TU_BLOCK;
    st->c.kappa = 4;
    st->c.ratio = 8;
    st->c.evict_budget_rows = TU_K;
    st->c.recent_rows = TU_R;
    st->c.cadence_rows = TU_R;
    st->c.evict_archive = true;
    st->p = kvt_ctx_default_params();
    st->p.model = st->m;
    st->p.config = &st->c;
    st->p.page_rows = 16;
    st->p.n_pages = 64;
    st->p.backend = be;
    st->p.allocator = alloc;
}

/* Context creation allocates in every layer of the library: the list (support/seams_ctx_sites.h)
 * is long, and a new allocation anywhere in it must be added there. */
/* Whether this process can have a memory protection key (the guarded backend's first choice). */
static int have_pkeys(void) {
    const int k = pkey_alloc(0, 0);
    if (k >= 0)
        pkey_free(k);
    return k >= 0;
}

Test(seams, context_creation) {
    for (int variant = 0; variant < 3; variant++) {
        ctx_st st;
        ctx_params(&st, variant == 2 ? KVT_BACKEND_GUARDED : KVT_BACKEND_CPU,
                   variant == 1 ? KVT_ALLOC_LIBC : KVT_ALLOC_DEFAULT);
        entry e = {variant == 2 ? "kvt_ctx_create (guarded)" : "kvt_ctx_create", run_ctx_create,
                   NULL, &st};
        static const char *const cpu[] = {
#include "support/seams_ctx_sites.h"
            "backend_cpu.c:cpu_buf_alloc", "backend_cpu.c:kvt__backend_cpu_open", NULL};
        static const char *const guarded[] = {
#include "support/seams_ctx_sites.h"
            "backend_guarded.c:kvt__backend_guarded_open", "backend_guarded.c:g_buf_alloc", NULL};
        /* Without protection keys (a CPU or kernel without them) the guarded backend maps an
         * arena instead, largest size first: a failed size is absorbed by a smaller one. */
        static const char *const guarded_arena[] = {
#include "support/seams_ctx_sites.h"
            "backend_guarded.c:kvt__backend_guarded_open", "backend_guarded.c:g_buf_alloc",
            "backend_guarded.c:guard_arena_map", NULL};
        static const char *const arena_absorbed[] = {"backend_guarded.c:guard_arena_map", NULL};
        const int keys = have_pkeys();
        cr_assert_gt(sweep(&e, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY,
                           variant != 2 ? cpu : keys ? guarded : guarded_arena,
                           variant == 2 && !keys ? arena_absorbed : NULL),
                     10);
        kvt_model_destroy(st.m);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Snapshots: memory, files, restore, the inspection context                                   */
/* ------------------------------------------------------------------------------------------- */
typedef struct snap_st {
    kvt_model *m;
    kvt_ctx *ctx;
    kvt_ctx *into; /* where the snapshot is restored: ids are unique among a context's live
                    * requests, and seq lives in ctx */
    kvt_seq *seq;
    uint8_t *snap; /* the request's snapshot */
    size_t n;
    uint32_t free0, free_into; /* the contexts' free pages */
    char path[128]; /* a snapshot file (holding an older snapshot: `old`) */
    uint8_t *old;
    size_t n_old;
} snap_st;

static void snap_setup(snap_st *st, kvt_backend_kind be) {
    memset(st, 0, sizeof *st);
    st->m = tu_mixed_model();
    ctx_st cs;
    ctx_params(&cs, be, KVT_ALLOC_DEFAULT);
    kvt_model_destroy(cs.m);
    cs.p.model = st->m;
    cs.p.n_pages = 96;
    cr_assert_eq(kvt_ctx_create(&cs.p, &st->ctx, NULL, 0), KVT_OK, "%s", kvt_last_error());
    cr_assert_eq(kvt_ctx_create(&cs.p, &st->into, NULL, 0), KVT_OK, "%s", kvt_last_error());
    st->seq = driven(st->ctx);
    cr_assert_eq(kvt_seq_snapshot_size(st->seq, &st->n), KVT_OK);
    st->snap = malloc(st->n);
    cr_assert_eq(kvt_seq_snapshot(st->seq, st->snap, st->n, &st->n), KVT_OK);
    st->free0 = free_pages(st->ctx);
    make_dir();
    snprintf(st->path, sizeof st->path, "%s/s.kvts", g_dir);
    /* An older snapshot of the request (a step behind) at the destination. */
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore(st->into, st->snap, st->n, &r), KVT_OK);
    cr_assert_eq(tu_reserve(r, 3), KVT_OK);
    cr_assert_eq(tu_commit(r, 3), KVT_OK);
    cr_assert_eq(kvt_seq_snapshot_file(r, st->path), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(r);
    st->old = slurp(st->path, &st->n_old);
    cr_assert_neq(st->n_old, st->n);
    st->free_into = free_pages(st->into);
}

static void snap_teardown(snap_st *st) {
    remove_dir();
    free(st->snap);
    free(st->old);
    kvt_seq_destroy(st->seq);
    kvt_ctx_destroy(st->into);
    kvt_ctx_destroy(st->ctx);
    kvt_model_destroy(st->m);
}

/* The request and the pools as they were. */
static void request_unchanged(snap_st *st) {
    cr_assert_eq(free_pages(st->ctx), st->free0, "pages");
    cr_assert_eq(free_pages(st->into), st->free_into, "pages of the restores' context");
    cr_assert_eq(kvt_seq_check(st->seq), KVT_OK, "%s", kvt_last_error());
    size_t n;
    cr_assert_eq(kvt_seq_snapshot_size(st->seq, &n), KVT_OK);
    cr_assert_eq(n, st->n);
    uint8_t *b = malloc(n);
    cr_assert_eq(kvt_seq_snapshot(st->seq, b, n, &n), KVT_OK);
    cr_assert_eq(memcmp(b, st->snap, n), 0, "the request changed");
    free(b);
}

static kvt_status run_snapshot_mem(void *v) {
    snap_st *st = v;
    size_t n;
    kvt_status r = kvt_seq_snapshot_size(st->seq, &n);
    if (r != KVT_OK)
        return r;
    uint8_t *b = malloc(n);
    r = kvt_seq_snapshot(st->seq, b, n, &n);
    free(b);
    return r;
}

static kvt_status run_restore(void *v) {
    snap_st *st = v;
    kvt_seq *r = (kvt_seq *)&r;
    kvt_status s = kvt_seq_restore(st->into, st->snap, st->n, &r);
    if (s != KVT_OK)
        cr_assert_null(r);
    kvt_seq_destroy(s == KVT_OK ? r : NULL);
    return s;
}

static void restore_unchanged(void *v, const char *site) {
    (void)site;
    request_unchanged(v);
}

static kvt_status run_snapshot_file(void *v) {
    snap_st *st = v;
    kvt_status s = kvt_seq_snapshot_file(st->seq, st->path);
    if (s == KVT_OK) { /* put the older file back for the next run */
        put_file(st->path, st->old, st->n_old);
        size_t n;
        uint8_t *now = slurp(st->path, &n);
        cr_assert_eq(n, st->n_old);
        free(now);
    }
    return s;
}

/* The destination holds the old file byte for byte, or (a failure after the rename: the
 * directory's open or fsync) the new one; no temporary is left. */
static void file_unchanged(void *v, const char *site) {
    snap_st *st = v;
    bool renamed = strstr(kvt_last_error(), "of its directory") != NULL;
    request_unchanged(st);
    size_t n;
    uint8_t *now = slurp(st->path, &n);
    cr_assert_not_null(now);
    if (renamed) {
        cr_assert_eq(n, st->n, "%s: the new file", site);
        cr_assert_eq(memcmp(now, st->snap, n), 0, "%s: the new file", site);
        put_file(st->path, st->old, st->n_old);
    } else {
        cr_assert_eq(n, st->n_old, "%s: the old file's size", site);
        cr_assert_eq(memcmp(now, st->old, n), 0, "%s: the old file changed", site);
    }
    free(now);
    cr_assert_eq(n_files(g_dir), 1, "%s: a temporary left behind", site);
}

static kvt_status run_restore_file(void *v) {
    snap_st *st = v;
    kvt_seq *r = (kvt_seq *)&r;
    kvt_status s = kvt_seq_restore_file(st->into, st->path, &r);
    if (s != KVT_OK)
        cr_assert_null(r);
    kvt_seq_destroy(s == KVT_OK ? r : NULL);
    return s;
}

static kvt_status run_snapshot_context(void *v) {
    snap_st *st = v;
    kvt_ctx *c = (kvt_ctx *)&c;
    kvt_status s = kvt_snapshot_context(st->snap, st->n, KVT_BACKEND_CPU, &c);
    if (s != KVT_OK)
        cr_assert_null(c);
    kvt_ctx_destroy(s == KVT_OK ? c : NULL);
    return s;
}

Test(seams, snapshots) {
    snap_st st;
    snap_setup(&st, KVT_BACKEND_CPU);
    static const char *const mem[] = {
#include "support/seams_snapshot_sites.h"
        NULL};
    entry sm = {"kvt_seq_snapshot", run_snapshot_mem, restore_unchanged, &st};
    sweep(&sm, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, mem, NULL);
    static const char *const restore[] = {
#include "support/seams_restore_sites.h"
        NULL};
    entry r = {"kvt_seq_restore", run_restore, restore_unchanged, &st};
    cr_assert_gt(sweep(&r, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, restore, NULL), 10);

    static const char *const file_alloc[] = {
#include "support/seams_snapshot_sites.h"
        "snapshot.c:kvt_seq_snapshot_file", "replace.c:kvt__replace_file", NULL};
    entry f = {"kvt_seq_snapshot_file", run_snapshot_file, file_unchanged, &st};
    cr_assert_gt(sweep(&f, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, file_alloc, NULL), 2);
    static const char *const file_io[] = {
        "replace.c:kvt__clean_stale:opendir", "replace.c:kvt__replace_file:open",
        "replace.c:kvt__replace_file:lock",   "replace.c:kvt__replace_file:write",
        "replace.c:kvt__replace_file:fsync",  "replace.c:kvt__replace_file:close",
        "replace.c:kvt__replace_file:rename", NULL};
    /* Absorbed: the listing of stale temporaries (best effort), the directory's close after
     * its fsync. */
    static const char *const file_io_absorbed[] = {"replace.c:kvt__clean_stale:opendir",
                                                   "replace.c:kvt__replace_file:close", NULL};
    cr_assert_geq(sweep(&f, KVT__SEAM_IO, KVT_ERR_IO, file_io, file_io_absorbed), 8);

    put_file(st.path, st.snap, st.n); /* restore_file reads the request's own snapshot */
    static const char *const rf_alloc[] = {
#include "support/seams_restore_sites.h"
        "snapshot.c:kvt_seq_restore_file", NULL};
    entry rf = {"kvt_seq_restore_file", run_restore_file, restore_unchanged, &st};
    cr_assert_gt(sweep(&rf, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, rf_alloc, NULL), 10);
    static const char *const rf_io[] = {
        "snapshot.c:kvt_seq_restore_file:open", "snapshot.c:kvt_seq_restore_file:stat",
        "snapshot.c:kvt_seq_restore_file:read", "snapshot.c:kvt_seq_restore_file:close", NULL};
    static const char *const rf_absorbed[] = {"snapshot.c:kvt_seq_restore_file:close", NULL};
    cr_assert_eq(sweep(&rf, KVT__SEAM_IO, KVT_ERR_IO, rf_io, rf_absorbed), 3);

    static const char *const sc[] = {
#include "support/seams_ctx_sites.h"
        "backend_cpu.c:cpu_buf_alloc", "backend_cpu.c:kvt__backend_cpu_open",
        "snapshot.c:kvt_snapshot_context", "snapshot.c:parse", NULL};
    entry c = {"kvt_snapshot_context", run_snapshot_context, NULL, &st};
    cr_assert_gt(sweep(&c, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, sc, NULL), 10);
    snap_teardown(&st);
}

/* ------------------------------------------------------------------------------------------- */
/* Traces                                                                                      */
/* ------------------------------------------------------------------------------------------- */
enum { TR_TOKENS = 600, TR_STEPS = 6, TR_HEADS = 2, TR_DIM = 64 };
static char g_trace[128];

/* Write a small trace (one GQA layer: rows of both planes in two chunks, each larger than the
 * container writer's 64-KiB buffer, so both of its write paths run; queries, a needle, a
 * target, a user section); a failing call aborts the writer. */
static kvt_status write_trace(const char *path) {
    kvt_layer_spec spec;
    kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_BF16, 2, 64, &spec);
    kvt_trace_meta meta = {.prompt_rows = 4, .n_model_layers = 2, .text = "generator=seams\n"};
    kvt_trace_writer *w = (kvt_trace_writer *)&w;
    char err[256] = "";
    kvt_status s = kvt_trace_writer_open(path, &meta, &w, err, sizeof err);
    if (s != KVT_OK) {
        cr_assert_null(w);
        cr_assert_neq(err[0], '\0');
        return s;
    }
    static uint8_t rows[TR_TOKENS * 2 * 128];
    static float q[TR_STEPS * TR_HEADS * TR_DIM];
    for (size_t i = 0; i < sizeof rows; i++)
        rows[i] = (uint8_t)(i * 7) & 0x3f;
    for (size_t i = 0; i < sizeof q / sizeof *q; i++)
        q[i] = (float)(i % 13) / 13.0f;
    uint64_t pos[TR_STEPS];
    for (int i = 0; i < TR_STEPS; i++)
        pos[i] = TR_TOKENS - TR_STEPS + (uint64_t)i;
    const uint32_t heads[1] = {1};
    const kvt_trace_needle needle = {.layer = 1, .first_row = 10, .n_rows = 2};
    const kvt_trace_target target = {.step = 3, .needle = 0, .n_heads = 1, .heads = heads};
    const size_t half = sizeof rows / 2;
    s = kvt_trace_write_layer(w, 1, &spec);
    for (uint32_t pl = 0; pl < 2 && s == KVT_OK; pl++)
        for (int c = 0; c < 2 && s == KVT_OK; c++)
            s = kvt_trace_write_rows(w, 1, pl, rows + c * half, TR_TOKENS / 2, half);
    if (s == KVT_OK)
        s = kvt_trace_write_queries(w, 1, KVT_DTYPE_FP32, TR_HEADS, TR_DIM, pos, q, TR_STEPS,
                                    sizeof q);
    if (s == KVT_OK)
        s = kvt_trace_write_needles(w, &needle, 1);
    if (s == KVT_OK)
        s = kvt_trace_write_targets(w, &target, 1);
    if (s == KVT_OK)
        s = kvt_trace_write_section(w, KVT_TRACE_SECTION_USER, false, "user", 4);
    if (s != KVT_OK) {
        cr_assert_neq(kvt_trace_writer_last_error(w)[0], '\0');
        kvt_trace_writer_abort(w);
        return s;
    }
    return kvt_trace_writer_close(w, err, sizeof err);
}

static kvt_status run_trace_write(void *v) {
    (void)v;
    kvt_status s = write_trace(g_trace);
    if (s == KVT_OK)
        unlink(g_trace);
    return s;
}

/* A writer that failed leaves no file (aborted), or one that readers refuse (its close failed
 * to write the END section, as after a crash). A failed close(2) comes after every byte was
 * written: the file may read then (on a local file system it does), and close reported the
 * error all the same. */
static void trace_write_unchanged(void *v, const char *site) {
    (void)v;
    struct stat st;
    if (stat(g_trace, &st) != 0)
        return;
    if (strstr(site, ":close")) {
        unlink(g_trace);
        return;
    }
    kvt_trace *t;
    cr_assert_neq(kvt_trace_open(g_trace, &t, NULL, 0), KVT_OK, "%s: a failed writer's file reads",
                  site);
    unlink(g_trace);
}

/* Read everything a needle run reads: open, the layer, rows, queries, needles, verify. */
static kvt_status run_trace_read(void *v) {
    (void)v;
    kvt_trace *t = (kvt_trace *)&t;
    char err[256] = "";
    kvt_status s = kvt_trace_open(g_trace, &t, err, sizeof err);
    if (s != KVT_OK) {
        cr_assert_null(t);
        cr_assert_neq(err[0], '\0');
        return s;
    }
    kvt_trace_layer li;
    static uint8_t rows[TR_TOKENS * 2 * 128];
    float q[TR_HEADS * TR_DIM];
    uint32_t n;
    s = kvt_trace_find_layer(t, 1, &li);
    cr_assert_eq(s, KVT_OK);
    cr_assert_eq(li.n_tokens, TR_TOKENS);
    cr_assert_eq(kvt_trace_needles(t, &n)[0].first_row, 10);
    cr_assert_eq(kvt_trace_targets(t, &n)[0].heads[0], 1);
    for (uint32_t pl = 0; pl < 2 && s == KVT_OK; pl++)
        s = kvt_trace_read_rows(t, 1, pl, 0, TR_TOKENS, rows, sizeof rows);
    for (uint64_t k = 0; k < TR_STEPS && s == KVT_OK; k++)
        s = kvt_trace_read_query(t, 1, k, KVT_DTYPE_FP32, q, sizeof q, NULL);
    if (s == KVT_OK)
        s = kvt_trace_verify(t);
    kvt_trace_close(t);
    return s;
}

Test(seams, traces) {
    make_dir();
    snprintf(g_trace, sizeof g_trace, "%s/t.kvtt", g_dir);
    entry w = {"trace writer", run_trace_write, trace_write_unchanged, NULL};
    static const char *const w_alloc[] = {
        "trace.c:kvt_trace_writer_open",   "trace.c:grow",
        "trace.c:kvt_trace_write_queries", "trace.c:kvt_trace_write_needles",
        "trace.c:kvt_trace_write_targets", NULL};
    cr_assert_gt(sweep(&w, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, w_alloc, NULL), 4);
    static const char *const w_io[] = {"container.c:kvt__ctr_writer_open:open",
                                       "container.c:w_flush:write", "container.c:w_put:write",
                                       "container.c:kvt__ctr_writer_finish:close", NULL};
    cr_assert_gt(sweep(&w, KVT__SEAM_IO, KVT_ERR_IO, w_io, NULL), 3);

    cr_assert_eq(write_trace(g_trace), KVT_OK);
    entry r = {"trace reader", run_trace_read, NULL, NULL};
    static const char *const r_alloc[] = {"container.c:kvt__ctr_crc_range",
                                          "container.c:kvt__ctr_open",
                                          "trace.c:grow",
                                          "trace.c:kvt_trace_open",
                                          "trace.c:parse_all",
                                          "trace.c:parse_needles",
                                          "trace.c:parse_queries",
                                          "trace.c:parse_targets",
                                          "trace.c:read_small",
                                          NULL};
    cr_assert_gt(sweep(&r, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, r_alloc, NULL), 4);
    static const char *const r_io[] = {
        "container.c:kvt__ctr_open:open", "container.c:kvt__ctr_open:stat",
        "container.c:kvt__ctr_pread:read", "container.c:kvt__ctr_close:close", NULL};
    static const char *const r_absorbed[] = {"container.c:kvt__ctr_close:close", NULL};
    cr_assert_gt(sweep(&r, KVT__SEAM_IO, KVT_ERR_IO, r_io, r_absorbed), 10);
    remove_dir();
}

/* ------------------------------------------------------------------------------------------- */
/* Recall bases, reference handles                                                             */
/* ------------------------------------------------------------------------------------------- */
enum { RB_RANK = 4, RB_DIM = 16 };
static float g_V[RB_RANK * RB_DIM], g_V2[RB_RANK * RB_DIM];
static char g_basis[128];
static uint8_t *g_basis_old;
static size_t g_basis_n_old;

static kvt_status run_basis_write(void *v) {
    (void)v;
    kvt_recall_basis_info in = {.layer = 3, .rank = RB_RANK, .dim = RB_DIM, .samples = 9};
    kvt_status s = kvt_recall_basis_write(g_basis, &in, g_V2);
    if (s == KVT_OK)
        put_file(g_basis, g_basis_old, g_basis_n_old);
    return s;
}

static void basis_unchanged(void *v, const char *site) {
    (void)v;
    bool renamed = strstr(kvt_last_error(), "of its directory") != NULL;
    size_t n;
    uint8_t *now = slurp(g_basis, &n);
    cr_assert_not_null(now, "%s", site);
    if (!renamed) {
        cr_assert_eq(n, g_basis_n_old, "%s", site);
        cr_assert_eq(memcmp(now, g_basis_old, n), 0, "%s: the old basis file changed", site);
    } else {
        put_file(g_basis, g_basis_old, g_basis_n_old);
    }
    free(now);
    cr_assert_eq(n_files(g_dir), 1, "%s: a temporary left behind", site);
}

static kvt_status run_basis_read(void *v) {
    (void)v;
    kvt_recall_basis_info out;
    float back[RB_RANK * RB_DIM];
    kvt_status s = kvt_recall_basis_read(g_basis, &out, back, RB_RANK * RB_DIM);
    if (s == KVT_OK)
        cr_assert_eq(memcmp(back, g_V, sizeof back), 0);
    return s;
}

static kvt_status run_ref_sigma(void *v) {
    (void)v;
    kvt_ref_sigma *h = (kvt_ref_sigma *)&h;
    kvt_status s = kvt_ref_sigma_create(64, 4, 64, &h);
    if (s != KVT_OK)
        cr_assert_null(h);
    kvt_ref_sigma_destroy(s == KVT_OK ? h : NULL);
    return s;
}

Test(seams, recall_bases_and_reference) {
    make_dir();
    snprintf(g_basis, sizeof g_basis, "%s/b.kvtb", g_dir);
    for (int i = 0; i < RB_RANK * RB_DIM; i++) {
        g_V[i] = (float)i / 64.0f;
        g_V2[i] = -(float)i / 64.0f;
    }
    kvt_recall_basis_info in = {.layer = 3, .rank = RB_RANK, .dim = RB_DIM, .samples = 9};
    cr_assert_eq(kvt_recall_basis_write(g_basis, &in, g_V), KVT_OK, "%s", kvt_last_error());
    g_basis_old = slurp(g_basis, &g_basis_n_old);
    entry w = {"kvt_recall_basis_write", run_basis_write, basis_unchanged, NULL};
    static const char *const w_alloc[] = {"recall_basis.c:kvt_recall_basis_write",
                                          "replace.c:kvt__replace_file", NULL};
    cr_assert_eq(sweep(&w, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, w_alloc, NULL), 3);
    static const char *const w_io[] = {
        "replace.c:kvt__clean_stale:opendir", "replace.c:kvt__replace_file:open",
        "replace.c:kvt__replace_file:lock",   "replace.c:kvt__replace_file:write",
        "replace.c:kvt__replace_file:fsync",  "replace.c:kvt__replace_file:close",
        "replace.c:kvt__replace_file:rename", NULL};
    static const char *const w_absorbed[] = {"replace.c:kvt__clean_stale:opendir",
                                             "replace.c:kvt__replace_file:close", NULL};
    cr_assert_geq(sweep(&w, KVT__SEAM_IO, KVT_ERR_IO, w_io, w_absorbed), 8);
    entry r = {"kvt_recall_basis_read", run_basis_read, NULL, NULL};
    static const char *const r_alloc[] = {"recall_basis.c:kvt_recall_basis_read", NULL};
    cr_assert_eq(sweep(&r, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, r_alloc, NULL), 1);
    static const char *const r_io[] = {"recall_basis.c:kvt_recall_basis_read:open",
                                       "recall_basis.c:kvt_recall_basis_read:stat",
                                       "recall_basis.c:kvt_recall_basis_read:read",
                                       "recall_basis.c:kvt_recall_basis_read:close", NULL};
    static const char *const r_absorbed[] = {"recall_basis.c:kvt_recall_basis_read:close", NULL};
    cr_assert_eq(sweep(&r, KVT__SEAM_IO, KVT_ERR_IO, r_io, r_absorbed), 5);
    free(g_basis_old);
    remove_dir();

    entry ref = {"kvt_ref_sigma_create", run_ref_sigma, NULL, NULL};
    static const char *const ref_alloc[] = {"ref.c:kvt_ref_sigma_create_basis", NULL};
    cr_assert_eq(sweep(&ref, KVT__SEAM_ALLOC, KVT_ERR_OUT_OF_MEMORY, ref_alloc, NULL), 4);
}

/* ------------------------------------------------------------------------------------------- */
/* Stale temporaries of killed writers (lib/replace.c), on real files                          */
/* ------------------------------------------------------------------------------------------- */
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

static void make_file(const char *name, const void *p, size_t n, long age_s) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    put_file(path, p, n);
    struct timespec t[2];
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= age_s;
    t[1] = t[0];
    cr_assert_eq(utimensat(AT_FDCWD, path, t, 0), 0);
}

static bool exists(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    struct stat st;
    return lstat(path, &st) == 0;
}

/* The temporaries in g_dir ("*.tmp.*"). */
static int n_temps(char *first, size_t n) {
    DIR *d = opendir(g_dir);
    int k = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strstr(e->d_name, ".tmp.") && k++ == 0 && first)
            snprintf(first, n, "%s", e->d_name);
    closedir(d);
    return k;
}

/* A writer process that stops at its first write: killed there (SIGKILL, as a crash), or left
 * waiting (a live writer holding its temporary) until the parent kills it. */
static int g_sync[2];

static int stop_at_write(void *user, kvt__seam_call *c) {
    if (c->kind == KVT__SEAM_IO && strcmp(c->op, "write") == 0) {
        if (user)
            raise(SIGKILL);
        char b = 1;
        cr_assert_eq(write(g_sync[1], &b, 1), 1);
        pause();
    }
    return 0;
}

static pid_t writer_stopped(kvt_seq *seq, const char *path, bool die) {
    cr_assert_eq(pipe(g_sync), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        /* A parked writer must not outlive a test that failed before killing it. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        alarm(60);
        kvt__seam_set_hook(stop_at_write, die ? (void *)1 : NULL);
        kvt_seq_snapshot_file(seq, path);
        _exit(3); /* not reached: the hook kills or parks the writer */
    }
    close(g_sync[1]);
    if (!die) {
        char b;
        cr_assert_eq(read(g_sync[0], &b, 1), 1); /* the writer holds its temporary */
    } else {
        int st;
        cr_assert_eq(waitpid(pid, &st, 0), pid);
        cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    }
    close(g_sync[0]);
    return pid;
}

Test(seams, stale_temporaries_removed_by_the_next_write) {
    snap_st st;
    snap_setup(&st, KVT_BACKEND_CPU);
    const long old = 2 * KVT_SNAPSHOT_STALE_SECONDS;
    /* A writer killed mid-write leaves its temporary. */
    writer_stopped(st.seq, st.path, true);
    char killed[256];
    cr_assert_eq(n_temps(killed, sizeof killed), 1, "the killed writer left no temporary");
    char kpath[512];
    snprintf(kpath, sizeof kpath, "%s/%s", g_dir, killed);
    struct timespec t[2];
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= old;
    t[1] = t[0];
    cr_assert_eq(utimensat(AT_FDCWD, kpath, t, 0), 0);
    /* Stale: empty, or a prefix of the container magic (a writer killed after 5 bytes). */
    make_file("s.kvts.tmp.AAAAAA", "", 0, old);
    make_file("s.kvts.tmp.BBBBBB", "\x89KVT\r", 5, old);
    /* Kept: too young; another name; not kvtier's content; not mkstemp's name; a directory. */
    make_file("s.kvts.tmp.CCCCCC", "", 0, 0);
    make_file("t.kvts.tmp.EEEEEE", "", 0, old);
    make_file("s.kvts.tmp.FFFFFF", "hello", 5, old);
    make_file("s.kvts.tmp.GG", "", 0, old);
    char hdir[512];
    snprintf(hdir, sizeof hdir, "%s/s.kvts.tmp.HHHHHH", g_dir);
    cr_assert_eq(mkdir(hdir, 0700), 0);
    /* Kept: old, but its writer is alive and holds it (the one name new after it started). */
    char before[16][256];
    int n_before = 0;
    DIR *d = opendir(g_dir);
    for (struct dirent *e; (e = readdir(d)) && n_before < 16;)
        snprintf(before[n_before++], sizeof before[0], "%s", e->d_name);
    closedir(d);
    pid_t live = writer_stopped(st.seq, st.path, false);
    char lname[256] = "";
    d = opendir(g_dir);
    for (struct dirent *e; (e = readdir(d));) {
        bool old_name = false;
        for (int i = 0; i < n_before && !old_name; i++)
            old_name = strcmp(before[i], e->d_name) == 0;
        if (!old_name)
            snprintf(lname, sizeof lname, "%s", e->d_name);
    }
    closedir(d);
    cr_assert_neq(lname[0], '\0', "the live writer's temporary");
    char lpath[512];
    snprintf(lpath, sizeof lpath, "%s/%s", g_dir, lname);
    cr_assert_eq(utimensat(AT_FDCWD, lpath, t, 0), 0);

    cr_assert_eq(kvt_seq_snapshot_file(st.seq, st.path), KVT_OK, "%s", kvt_last_error());
    cr_assert(!exists(killed), "the killed writer's temporary is still there");
    cr_assert(!exists("s.kvts.tmp.AAAAAA") && !exists("s.kvts.tmp.BBBBBB"));
    cr_assert(exists("s.kvts.tmp.CCCCCC") && exists("t.kvts.tmp.EEEEEE") &&
              exists("s.kvts.tmp.FFFFFF") && exists("s.kvts.tmp.GG") &&
              exists("s.kvts.tmp.HHHHHH"));
    cr_assert(exists(lname), "a live writer's temporary was removed");
    kvt_seq *r;
    cr_assert_eq(kvt_seq_restore_file(st.into, st.path, &r), KVT_OK, "%s", kvt_last_error());
    kvt_seq_destroy(r);

    /* kvt_snapshot_clean: the whole directory, any name, the same rule. */
    uint32_t n = 99;
    cr_assert_eq(kvt_snapshot_clean(g_dir, KVT_SNAPSHOT_STALE_SECONDS, &n), KVT_OK);
    cr_assert_eq(n, 1); /* t.kvts's; the live writer's is held */
    cr_assert(!exists("t.kvts.tmp.EEEEEE") && exists(lname));
    kill(live, SIGKILL);
    cr_assert_eq(waitpid(live, NULL, 0), live);
    cr_assert_eq(kvt_snapshot_clean(g_dir, KVT_SNAPSHOT_STALE_SECONDS, &n), KVT_OK);
    cr_assert_eq(n, 1); /* its writer died: stale now */
    cr_assert(!exists(lname));
    cr_assert_eq(kvt_snapshot_clean(g_dir, 0, &n), KVT_OK);
    cr_assert_eq(n, 1); /* the young one, with no age asked */
    cr_assert(!exists("s.kvts.tmp.CCCCCC") && exists("s.kvts.tmp.FFFFFF") &&
              exists("s.kvts.tmp.GG") && exists("s.kvts.tmp.HHHHHH"));
    cr_assert_eq(kvt_snapshot_clean(g_dir, 0, &n), KVT_OK);
    cr_assert_eq(n, 0);
    cr_assert_eq(kvt_snapshot_clean("/nonexistent-kvt-dir", 0, &n), KVT_ERR_IO);
    cr_assert_eq(kvt_snapshot_clean(NULL, 0, &n), KVT_ERR_INVALID_ARGUMENT);
    rmdir(hdir);
    snap_teardown(&st);
}
