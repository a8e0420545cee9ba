/*
 * test_cuda.c — every op of the CUDA backend against its CPU twin on the same random inputs,
 * bit for bit: select (segmented top-m with NaN/Inf and ties), score_rows (σ and the norm and
 * random selectors over a shuffled page table), pack (TOKENS and CSR), ev_append, ev_select and
 * ev_apply (per-head and shared keep sets, VaSE, with and without the archive), find_pos, the
 * buffer copies, and the recall tier's sketch_rows (csk and ρ, undescribable rows included) and
 * recall_scan (sound and conformal, caps and overflow: fired sets, counts and flags),
 * recall_step (conformal, sound and margin items; calibration, calibrated, overflowing and
 * nothing-archived steps: state, samples, best scores, fired sets; with promotion: its tables
 * byte for byte through a close) and pack with recall (fetched
 * rows merged, dense flags, device CSR offsets), recall_rope_step and recall_rope_emit (GQA-RoPE
 * archives per KV head: conformal calibration then scanning, sound, margin, overflow, a capped
 * host archive; best scores, state, samples, fired lists, the lists and the fetched bytes), and
 * attend (the reference attention over index sets: to a relative 1e-10, canaries); plus, host only, the positions the CUDA step's
 * parallel sample merge and promotion's merge use. Without a device every test skips with the reason (KVT_REQUIRE_GPU=1 turns
 * the skip into a failure: scripts/gpu-check.sh sets it; KVT_CUDA_TEST_SELFCHECK=1 runs the tests
 * with the guarded backend in CUDA's place, which checks the tests themselves). The golden suite
 * (test_golden) drives whole scenarios on the CUDA backend; this one says which op differs.
 */
#include <criterion/criterion.h>

#include "kernels/backend.h"
#include "recall/kernels/conformal_math.h"
#include "kernels/evict.h"
#include "recall/kernels/recall_promo.h"
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/recall_scan.h"
#include "kernels/sigma.h"
#include "recall/kernels/sketch.h"
#include "lib/base/alloc.h"
#include "recall/recall.h"
#include "support/oneshot.h"
#include "support/testutil.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

typedef struct rig {
    kvt__alloc a;
    kvt__backend cpu, gpu;
    bool guarded; /* KVT_CUDA_TEST_SELFCHECK without a device */
} rig;

/* Both backends, or a skip (a failure with KVT_REQUIRE_GPU) when no device is usable. */
static void rig_open(rig *r) {
    memset(r, 0, sizeof *r);
    cr_assert_eq(kvt__alloc_init(&r->a, KVT_ALLOC_LIBC), KVT_OK);
    r->cpu = (kvt__backend){.ops = kvt__backend_cpu_ops(), .alloc = &r->a, .impl = NULL};
    r->gpu.alloc = &r->a;
    char why[256] = "";
    kvt_status s = kvt__backend_cuda_open(&r->gpu, why, sizeof why);
    if (s != KVT_OK && getenv("KVT_CUDA_TEST_SELFCHECK")) {
        /* The test's own logic checked without a device: the guarded backend (its buffers are
         * not host memory either) stands in for CUDA. */
        s = kvt__backend_guarded_open(&r->gpu, why, sizeof why);
        cr_assert_eq(s, KVT_OK, "%s", why);
        r->guarded = true;
        return;
    }
    if (s != KVT_OK) {
        if (getenv("KVT_REQUIRE_GPU"))
            cr_assert_fail("KVT_REQUIRE_GPU set but the CUDA backend did not open: %s", why);
        kvt__alloc_fini(&r->a);
        cr_skip_test("CUDA backend unavailable: %s", why);
    }
}

static void rig_close(rig *r) {
    if (r->guarded)
        kvt__backend_cpu_close(&r->gpu);
    else
        kvt__backend_cuda_close(&r->gpu);
    kvt__alloc_fini(&r->a);
}

/* A device copy of host bytes (host NULL: zeroed bytes). */
static void *dev(rig *r, const void *host, size_t bytes) {
    void *p = NULL;
    cr_assert_eq(r->gpu.ops->buf_alloc(&r->gpu, bytes ? bytes : 1, &p), KVT_OK);
    if (bytes && host)
        cr_assert_eq(r->gpu.ops->write(&r->gpu, p, host, bytes, NULL), KVT_OK);
    return p;
}

/* Device bytes equal the host's. */
static void same(rig *r, const void *d, const void *host, size_t bytes, const char *what) {
    uint8_t *back = malloc(bytes ? bytes : 1);
    cr_assert_eq(r->gpu.ops->read(&r->gpu, back, d, bytes, NULL), KVT_OK);
    size_t i = 0;
    while (i < bytes && back[i] == ((const uint8_t *)host)[i])
        i++;
    cr_assert_eq(i, bytes, "%s: first difference at byte %zu of %zu", what, i, bytes);
    free(back);
}

static void undev(rig *r, void *p, size_t bytes) {
    r->gpu.ops->buf_free(&r->gpu, p, bytes ? bytes : 1);
}

/* The pack of n queries on both sides, compared: the CPU's from host memory (its backend
 * memory) into idx / len, the device's queries and count copied into device buffers (a plan
 * image's, as the library runs it) into didx / dlen (CSR: len and dlen are the indptr). */
static void pack_both(rig *r, const kvt__div32 *pdiv, bool csr, const kvt__pack_query *qc,
                      const kvt__pack_query *qg, uint32_t n, int32_t *idx, int32_t *len,
                      int32_t *didx, int32_t *dlen, size_t n_idx) {
    kvt__pack_query *dq = dev(r, qg, sizeof *qg * n);
    uint32_t *dn = dev(r, &n, sizeof n);
    const kvt__pack_args pc = {.q_plan = qc, .n_plan = &n, .n_max = n, .pdiv = pdiv, .csr = csr,
                               .first_csr = true, .capacity = n_idx, .indices = idx,
                               .lengths = csr ? NULL : len, .indptr = csr ? len : NULL};
    kvt__pack_args pg = pc;
    pg.q_plan = dq;
    pg.n_plan = dn;
    pg.indices = didx;
    pg.lengths = csr ? NULL : dlen;
    pg.indptr = csr ? dlen : NULL;
    cr_assert_eq(r->cpu.ops->pack(&r->cpu, &pc, NULL), KVT_OK);
    cr_assert_eq(r->gpu.ops->pack(&r->gpu, &pg, NULL), KVT_OK);
    same(r, didx, idx, 4 * n_idx, "indices");
    same(r, dlen, len, 4 * (csr ? n + 1 : n), csr ? "indptr" : "lengths");
    undev(r, dq, sizeof *qg * n);
    undev(r, dn, sizeof n);
}

static uint64_t rs = 0xc0da;
static uint32_t rnd32(void) {
    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rs >> 33);
}

Test(cuda, select_segments_equal_the_cpu) {
    rig r;
    rig_open(&r);
    enum { SEG = 5 };
    const uint32_t n[SEG] = {1, 100, 4096, 20000, 7};
    const uint32_t m[SEG] = {1, 30, 128, 625, 7};
    kvt__select_args c[SEG], g[SEG];
    float *hs[SEG];
    for (int i = 0; i < SEG; i++) {
        hs[i] = malloc(sizeof(float) * n[i]);
        for (uint32_t u = 0; u < n[i]; u++) {
            uint32_t x = rnd32();
            /* many ties (coarse values), some NaN/Inf among the fresh rows */
            hs[i][u] = (float)(x % 97) * 0.25f;
            if (u >= n[i] / 2 && x % 53 == 0)
                hs[i][u] = x % 2 ? NAN : INFINITY;
        }
        float *cs = malloc(sizeof(float) * n[i]);
        memcpy(cs, hs[i], sizeof(float) * n[i]);
        c[i] = (kvt__select_args){.score = cs, .first_new = n[i] / 2, .n_closed = n[i],
                                  .m = m[i], .sinks = 4, .kept = calloc(m[i], 4)};
        g[i] = c[i];
        g[i].score = dev(&r, hs[i], sizeof(float) * n[i]);
        g[i].kept = dev(&r, c[i].kept, sizeof(uint32_t) * m[i]);
    }
    cr_assert_eq(r.cpu.ops->select(&r.cpu, c, SEG, NULL), KVT_OK);
    cr_assert_eq(r.gpu.ops->select(&r.gpu, g, SEG, NULL), KVT_OK);
    for (int i = 0; i < SEG; i++) {
        same(&r, g[i].kept, c[i].kept, sizeof(uint32_t) * m[i], "kept");
        same(&r, g[i].score, c[i].score, sizeof(float) * n[i], "canonical scores");
        cr_assert_eq(g[i].nonfinite, c[i].nonfinite);
        cr_assert_eq(g[i].kept_in_sinks, c[i].kept_in_sinks);
        undev(&r, g[i].score, sizeof(float) * n[i]);
        undev(&r, g[i].kept, sizeof(uint32_t) * m[i]);
        free(c[i].score);
        free(c[i].kept);
        free(hs[i]);
    }
    rig_close(&r);
}

/* A pool of `pages` pages of PR rows, slot_bytes each, random bf16, and a shuffled table. */
static uint8_t *random_pool(size_t bytes) {
    uint8_t *p = malloc(bytes);
    for (size_t i = 0; i + 1 < bytes; i += 2) {
        uint16_t v = (uint16_t)(0x3c00u + (rnd32() & 0x3ffu)) ^ (uint16_t)((rnd32() & 1u) << 15);
        memcpy(p + i, &v, 2);
    }
    return p;
}

static void shuffled(int32_t *pages, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        pages[i] = (int32_t)i;
    for (uint32_t i = n - 1; i > 0; i--) {
        uint32_t j = rnd32() % (i + 1);
        int32_t t = pages[i];
        pages[i] = pages[j];
        pages[j] = t;
    }
}

Test(cuda, score_rows_equal_the_cpu) {
    rig r;
    rig_open(&r);
    const uint32_t B = 4096, PR = 64, NP = 2 * B / PR, KAPPA = 4, NB = 2 * KAPPA - 1;
    const size_t slot = 1152; /* MLA: 512 latent + 64 branch, bf16 */
    uint8_t *pool = random_pool((size_t)NP * PR * slot);
    int32_t pages[2 * 4096 / 64];
    shuffled(pages, NP);
    float *basis = malloc(sizeof(float) * NB * B);
    cr_assert_eq(kvt__fourier_basis(B, KAPPA, basis), 0);
    /* a row with a NaN branch value */
    uint16_t nan16 = 0x7fc0;
    memcpy(pool + (size_t)pages[3] * PR * slot + 5 * slot + 1024 + 6, &nan16, 2);
    uint8_t *dpool = dev(&r, pool, (size_t)NP * PR * slot);
    int32_t *dpages = dev(&r, pages, sizeof pages);
    float *dbasis = dev(&r, basis, sizeof(float) * NB * B);
    kvt__div32 pdiv = kvt__div32_make(PR);
    const kvt_selector sel[4] = {KVT_SELECT_SIGMA, KVT_SELECT_BRANCH_NORM, KVT_SELECT_ROW_NORM,
                                 KVT_SELECT_RANDOM};
    for (int k = 0; k < 4; k++) {
        kvt__score_args c[2], g[2];
        float *out[2], *dout[2];
        for (int i = 0; i < 2; i++) {
            out[i] = calloc(B, sizeof(float));
            dout[i] = dev(&r, out[i], sizeof(float) * B);
            c[i] = (kvt__score_args){.selector = sel[k], .base = pool, .pages = pages,
                                     .first_page = 0, .pdiv = &pdiv, .first_row = (uint64_t)i * B,
                                     .n_rows = B, .slot_stride = slot, .branch_offset = 1024,
                                     .branch_dtype = KVT__DT_BF16, .branch_dim = 64,
                                     .dtype = KVT__DT_BF16, .n_values = 576, .basis = basis,
                                     .n_basis = NB, .key = 77, .subseq = 5,
                                     .first_position = (uint64_t)i * B, .out = out[i]};
            g[i] = c[i];
            g[i].base = dpool;
            g[i].pages = dpages;
            g[i].basis = dbasis;
            g[i].out = dout[i];
        }
        cr_assert_eq(r.cpu.ops->score_rows(&r.cpu, c, 2, NULL), KVT_OK);
        cr_assert_eq(r.gpu.ops->score_rows(&r.gpu, g, 2, NULL), KVT_OK);
        for (int i = 0; i < 2; i++) {
            same(&r, dout[i], out[i], sizeof(float) * B, "scores");
            undev(&r, dout[i], sizeof(float) * B);
            free(out[i]);
        }
    }
    undev(&r, dpool, (size_t)NP * PR * slot);
    undev(&r, dpages, sizeof pages);
    undev(&r, dbasis, sizeof(float) * NB * B);
    free(pool);
    free(basis);
    rig_close(&r);
}

Test(cuda, pack_equals_the_cpu) {
    rig r;
    rig_open(&r);
    const uint32_t PR = 16, NP = 64, NQ = 70;
    int32_t pages[64];
    shuffled(pages, NP);
    int32_t *dpages = dev(&r, pages, sizeof pages);
    uint32_t list[200];
    for (uint32_t i = 0; i < 200; i++)
        list[i] = 40 + 3 * i;
    uint32_t *dlist = dev(&r, list, sizeof list);
    kvt__div32 pdiv = kvt__div32_make(PR);
    for (int csr = 0; csr < 2; csr++) {
        kvt__pack_query qc[NQ], qg[NQ];
        uint64_t off = 0, cap = 1024;
        for (uint32_t i = 0; i < NQ; i++) {
            uint64_t nl = rnd32() % 150, hi0 = 40 + 3 * 200, hi1 = hi0 + rnd32() % 200;
            qc[i] = (kvt__pack_query){.d = {.lo_end = rnd32() % 40, .list = list, .n_list = nl,
                                            .hi_begin = hi0, .hi_end = hi1},
                                      .pages = pages, .first_page = 0};
            uint64_t cnt = kvt__attended_desc_count(&qc[i].d);
            qc[i].out = csr ? off : (uint64_t)i * cap;
            qc[i].pad = csr ? 0 : cap;
            qc[i].len_at = csr ? i + 1 : i;
            off += cnt;
            qg[i] = qc[i];
            qg[i].d.list = dlist;
            qg[i].pages = dpages;
        }
        size_t n_idx = csr ? off : (size_t)NQ * cap;
        int32_t *idx = calloc(n_idx, 4), *len = calloc(NQ + 1, 4);
        int32_t *didx = dev(&r, idx, 4 * n_idx), *dlen = dev(&r, len, 4 * (NQ + 1));
        pack_both(&r, &pdiv, csr, qc, qg, NQ, idx, len, didx, dlen, n_idx);
        undev(&r, didx, 4 * n_idx);
        undev(&r, dlen, 4 * (NQ + 1));
        free(idx);
        free(len);
    }
    undev(&r, dpages, sizeof pages);
    undev(&r, dlist, sizeof list);
    rig_close(&r);
}

/* KVT_EMIT_PAGED's pack: sets of whole pages (sinks of whole pages and a tail from a page
 * boundary, one range from row 0, the sinks alone, empty), from a table with leading pages
 * returned (first_page 3), mixed with row queries; page ids, indptr and last_page_len equal. */
Test(cuda, pack_paged_equals_the_cpu) {
    rig r;
    rig_open(&r);
    const uint32_t PR = 16, NP = 64, NQ = 90, FP = 3;
    int32_t pages[64];
    shuffled(pages, NP);
    int32_t *dpages = dev(&r, pages, sizeof pages);
    kvt__div32 pdiv = kvt__div32_make(PR);
    kvt__pack_query qc[NQ], qg[NQ];
    uint64_t off = 0;
    for (uint32_t i = 0; i < NQ; i++) {
        const uint64_t lo = (rnd32() % 4) * PR, hb = lo + (rnd32() % 8) * PR;
        const uint64_t he = hb + (i % 5 == 0 ? 0 : rnd32() % (20 * PR));
        kvt__attended_desc d = {.lo_end = lo, .hi_begin = hb, .hi_end = he};
        if (i % 7 == 1)
            d = (kvt__attended_desc){.hi_end = he}; /* one range */
        if (i % 11 == 2)
            d = (kvt__attended_desc){0}; /* empty */
        if (i == 3) /* by hand below: 16 sinks, a tail [64, 70): pages 0 and 4, 6 rows */
            d = (kvt__attended_desc){.lo_end = 16, .hi_begin = 64, .hi_end = 70};
        qc[i] = (kvt__pack_query){.d = d, .pages = pages, .paged = true, .len_at = i + 1};
        if (i % 9 == 4) { /* a table from page FP on: a window's pages */
            qc[i].d = (kvt__attended_desc){.hi_begin = FP * PR, .hi_end = FP * PR + he + 1};
            qc[i].first_page = FP;
        }
        off += kvt__paged_count(&qc[i].d, &pdiv);
        qg[i] = qc[i];
        qg[i].pages = dpages;
    }
    int32_t *idx = calloc(off, 4), *ptr = calloc(NQ + 1, 4), *last = calloc(NQ, 4);
    int32_t *didx = dev(&r, idx, 4 * off), *dptr = dev(&r, ptr, 4 * (NQ + 1));
    int32_t *dlast = dev(&r, last, 4 * NQ);
    kvt__pack_query *dq = dev(&r, qg, sizeof qg);
    uint32_t n = NQ;
    uint32_t *dn = dev(&r, &n, sizeof n);
    const kvt__pack_args pc = {.q_plan = qc,
                               .n_plan = &n,
                               .n_max = n,
                               .pdiv = &pdiv,
                               .csr = true,
                               .first_csr = true,
                               .capacity = off,
                               .indices = idx,
                               .indptr = ptr,
                               .last_page_len = last};
    kvt__pack_args pg = pc;
    pg.q_plan = dq;
    pg.n_plan = dn;
    pg.indices = didx;
    pg.indptr = dptr;
    pg.last_page_len = dlast;
    cr_assert_eq(r.cpu.ops->pack(&r.cpu, &pc, NULL), KVT_OK);
    cr_assert_eq(r.gpu.ops->pack(&r.gpu, &pg, NULL), KVT_OK);
    cr_assert_eq((uint64_t)ptr[NQ], off);
    /* by hand: query 0 (he = hb: the sinks alone), 2 (empty), 3 (two ranges) */
    cr_assert_eq(last[0], qc[0].d.lo_end ? (int32_t)PR : 0);
    cr_assert_eq(ptr[3] - ptr[2], 0);
    cr_assert_eq(last[2], 0);
    cr_assert_eq(ptr[4] - ptr[3], 2);
    cr_assert(idx[ptr[3]] == pages[0] && idx[ptr[3] + 1] == pages[4] && last[3] == 6);
    same(&r, didx, idx, 4 * off, "page ids");
    same(&r, dptr, ptr, 4 * (NQ + 1), "indptr");
    same(&r, dlast, last, 4 * NQ, "last_page_len");
    undev(&r, didx, 4 * off);
    undev(&r, dptr, 4 * (NQ + 1));
    undev(&r, dlast, 4 * NQ);
    undev(&r, dq, sizeof qg);
    undev(&r, dn, sizeof n);
    undev(&r, dpages, sizeof pages);
    free(idx);
    free(ptr);
    free(last);
    rig_close(&r);
}

/* One layer's round on both backends: append, select, apply; every array compared. A prior
 * archive of n_old rows a head at odd positions: beyond the table's (0, 2, .., 2N - 2), or from 1
 * up (interleaved: the new entries merge between old ones, and with n_old above a block's 256
 * threads the device merge moves the old entries in several blocks from the back). */
static void round_pair(rig *r, uint32_t H, bool shared, bool vase, bool archive, uint32_t n_old,
                       bool interleave) {
    const uint32_t PR = 16, K = 96, R = 16, C = 16, N = K + R + C, NP = 16;
    const uint32_t row_bytes = 64, n_planes = 2;
    const size_t slot = (size_t)H * row_bytes, plane = (size_t)NP * PR * slot;
    const uint64_t AR_CAP = n_old + 56, pos_cap = 256;
    int32_t pages[16];
    shuffled(pages, NP);
    kvt__div32 pdiv = kvt__div32_make(PR);
    uint8_t *pl[2] = {random_pool(plane), random_pool(plane)};
    int64_t *pos = calloc(H * pos_cap, 8);
    uint32_t *keep = calloc(H * K, 4);
    int32_t *map = calloc(H * N, 4);
    const size_t row_all = (size_t)n_planes * row_bytes;
    uint8_t *arb = calloc(H * AR_CAP, row_all);
    int64_t *arp = calloc(H * AR_CAP, 8);
    uint64_t *arq = calloc(H * AR_CAP, 8);
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t k = 0; k < n_old; k++) {
            arp[h * AR_CAP + k] = (interleave ? 1 : 1001) + 2 * (int64_t)(n_old - 1 - k);
            arq[h * AR_CAP + k] = n_old - 1 - k;
        }
    void *d_pl[2] = {dev(r, pl[0], plane), dev(r, pl[1], plane)};
    int32_t *d_pages = dev(r, pages, sizeof pages);
    int64_t *d_pos = dev(r, pos, 8 * H * pos_cap);
    uint32_t *d_keep = dev(r, keep, 4 * H * K);
    int32_t *d_map = dev(r, map, 4 * H * N);
    uint8_t *d_arb = dev(r, arb, H * AR_CAP * row_all);
    int64_t *d_arp = dev(r, arp, 8 * H * AR_CAP);
    uint64_t *d_arq = dev(r, arq, 8 * H * AR_CAP);
    /* positions: rows 0..N-1 hold 0, 2, 4, ... (after earlier rounds), the prompt 0..5 */
    kvt__ev_append_args ac = {.pos = pos, .pos_cap = pos_cap, .n_heads = H, .first_row = 0,
                              .first_pos = 0, .n = N};
    kvt__ev_append_args ag = ac;
    ag.pos = d_pos;
    cr_assert_eq(r->cpu.ops->ev_append(&r->cpu, &ac, 1, NULL), KVT_OK);
    cr_assert_eq(r->gpu.ops->ev_append(&r->gpu, &ag, 1, NULL), KVT_OK);
    same(r, d_pos, pos, 8 * H * pos_cap, "appended positions");
    kvt__ev_args c = {.plane = {pl[0], pl[1]}, .n_planes = n_planes, .slot_bytes = slot,
                      .row_bytes = row_bytes, .n_heads = H, .dtype = KVT__DT_BF16,
                      .value_dim = 32, .value_plane = 1, .pages = pages, .first_page = 0,
                      .pdiv = &pdiv, .pos = pos, .pos_cap = pos_cap, .keep = keep, .map = map,
                      .ar_bytes = archive ? arb : NULL, .ar_pos = arp, .ar_by_pos = arq,
                      .ar_n = n_old, .ar_cap = AR_CAP, .N = N, .K = K, .r = R, .L = 6, .vase = vase,
                      .philox_key = 0x1234, .round = 3, .layer = 2, .head_offset = 0,
                      .shared_draw = shared};
    kvt__ev_args g = c;
    g.plane[0] = d_pl[0];
    g.plane[1] = d_pl[1];
    g.pages = d_pages;
    g.pos = d_pos;
    g.keep = d_keep;
    g.map = d_map;
    g.ar_bytes = archive ? d_arb : NULL;
    g.ar_pos = d_arp;
    g.ar_by_pos = d_arq;
    cr_assert_eq(r->cpu.ops->ev_select(&r->cpu, &c, 1, NULL), KVT_OK);
    cr_assert_eq(r->gpu.ops->ev_select(&r->gpu, &g, 1, NULL), KVT_OK);
    same(r, d_keep, keep, 4 * H * K, "keep sets");
    cr_assert_eq(r->cpu.ops->ev_apply(&r->cpu, &c, 1, NULL), KVT_OK);
    cr_assert_eq(r->gpu.ops->ev_apply(&r->gpu, &g, 1, NULL), KVT_OK);
    same(r, d_pl[0], pl[0], plane, "plane 0 after compaction");
    same(r, d_pl[1], pl[1], plane, "plane 1 after compaction");
    same(r, d_pos, pos, 8 * H * pos_cap, "positions after compaction");
    same(r, d_map, map, 4 * H * N, "slot maps");
    if (archive) {
        same(r, d_arb, arb, H * AR_CAP * row_all, "archive rows");
        same(r, d_arp, arp, 8 * H * AR_CAP, "archive positions");
        same(r, d_arq, arq, 8 * H * AR_CAP, "archive index");
        for (uint32_t h = 0; h < H; h++) {
            int64_t kc = kvt__find_pos(arp + h * AR_CAP, arq + h * AR_CAP, n_old + N - R - K, 1003),
                    kg = -2;
            cr_assert_eq(r->gpu.ops->find_pos(&r->gpu, d_arp + h * AR_CAP, d_arq + h * AR_CAP,
                                              n_old + N - R - K, 1003, &kg),
                         KVT_OK);
            cr_assert_eq(kg, kc);
        }
    }
    for (int p = 0; p < 2; p++) {
        undev(r, d_pl[p], plane);
        free(pl[p]);
    }
    undev(r, d_pages, sizeof pages);
    undev(r, d_pos, 8 * H * pos_cap);
    undev(r, d_keep, 4 * H * K);
    undev(r, d_map, 4 * H * N);
    undev(r, d_arb, H * AR_CAP * row_all);
    undev(r, d_arp, 8 * H * AR_CAP);
    undev(r, d_arq, 8 * H * AR_CAP);
    free(pos);
    free(keep);
    free(map);
    free(arb);
    free(arp);
    free(arq);
}

Test(cuda, eviction_rounds_equal_the_cpu) {
    rig r;
    rig_open(&r);
    for (int v = 0; v < 8; v++)
        round_pair(&r, v & 1 ? 8 : 1, v & 2, v & 4, v % 3 != 0, 8, false);
    rig_close(&r);
}

/* The archive index merged on the device (k_ev_archive: ranks, old entries moved in blocks from
 * the back) as the CPU twin's serial merge leaves it, new entries between old ones and more old
 * entries than a block has threads. */
Test(cuda, eviction_archive_merge_equals_the_cpu) {
    rig r;
    rig_open(&r);
    for (int v = 0; v < 4; v++)
        round_pair(&r, v & 1 ? 8 : 1, v & 2, false, true, v < 2 ? 300 : 40, true);
    rig_close(&r);
}

/* ---------------------------------------------------------------------------------------------
 * The recall tier's ops: sketch_rows and recall_scan against their CPU twins.
 * ------------------------------------------------------------------------------------------- */

/* A recall pool: NP pages of PR rows behind a shuffled table, each row a latent of D values then
 * a branch of 64, dtype dt; random values (random_pool), a few rows made undescribable (a NaN, an
 * Inf) and one whose first coefficient overflows fp16 (latent = 7e4 · V[0]), the rest of the
 * rows a mix of in-span and random latents. */
typedef struct rpool {
    uint32_t D, rank, NP, PR;
    int dt;
    size_t slot;
    uint8_t *pool;
    int32_t *pages;
    kvt__div32 pdiv;
    float *V; /* [rank][D] or NULL */
    void *dpool, *dpages, *dV; /* the device copies (dV NULL without a basis) */
} rpool;

static void rpool_make(rig *r, rpool *p, tu_rng *g, int dt, uint32_t D, uint32_t rank) {
    memset(p, 0, sizeof *p);
    p->D = D;
    p->rank = rank;
    p->dt = dt;
    p->PR = 16;
    p->NP = 32;
    p->slot = (size_t)(D + 64) * (dt == KVT__DT_FP32 ? 4 : 2);
    p->pool = random_pool((size_t)p->NP * p->PR * p->slot);
    p->pages = malloc(sizeof(int32_t) * p->NP);
    shuffled(p->pages, p->NP);
    p->pdiv = kvt__div32_make(p->PR);
    if (rank) {
        p->V = malloc(sizeof(float) * rank * D);
        cr_assert(tu_orthonormal_rows(g, rank, D, p->V));
    }
    for (uint32_t row = 0; row < p->NP * p->PR; row++) {
        uint8_t *x = p->pool + (size_t)kvt__page_slot(p->pages, 0, &p->pdiv, row) * p->slot;
        uint32_t kind = (uint32_t)(tu_next(g) % 4);
        if (row == 9 || row == 300)
            kvt__store_elem(x, dt, (uint32_t)(tu_next(g) % D), row == 9 ? NAN : INFINITY);
        else if (row == 40 && rank)
            for (uint32_t d = 0; d < D; d++)
                kvt__store_elem(x, dt, d, 7e4f * p->V[d]);
        else if (kind == 0 && rank) /* near span V: a few coefficients, small noise */
            for (uint32_t d = 0; d < D; d++) {
                float c = (float)(0.01 * tu_normal(g));
                for (uint32_t k = 0; k < rank; k += 1 + k % 5)
                    c += (float)(k % 3 + 1) * 0.5f * p->V[(size_t)k * D + d];
                kvt__store_elem(x, dt, d, c);
            }
    }
    p->dpool = dev(r, p->pool, (size_t)p->NP * p->PR * p->slot);
    p->dpages = dev(r, p->pages, sizeof(int32_t) * p->NP);
    p->dV = rank ? dev(r, p->V, sizeof(float) * rank * D) : NULL;
}

/* A pool where the pruned scan skips groups (test_recall_prune's clustered rows): runs of 64
 * rows around one of 4 centres (latent 3·N(0,1) coefficients on V plus 0.02·N(0,1) off it, a
 * N(0,1) branch), each member the centre plus 0.03·N(0,1), so a block's groups are tight and
 * whole clusters score below the heads' best. Re-uploads the pool. */
static void rpool_cluster(rig *r, rpool *p, tu_rng *g) {
    const uint32_t D = p->D, QD = D + 64, K = 4;
    cr_assert(p->rank);
    float *cen = malloc(sizeof(float) * K * QD);
    for (uint32_t k = 0; k < K; k++) {
        float *c = cen + (size_t)k * QD;
        for (uint32_t d = 0; d < QD; d++)
            c[d] = (float)(tu_normal(g) * (d < D ? 0.02 : 1.0));
        for (uint32_t j = 0; j < p->rank; j++) {
            const float a = (float)(3.0 * tu_normal(g));
            for (uint32_t d = 0; d < D; d++)
                c[d] += a * p->V[(size_t)j * D + d];
        }
    }
    for (uint32_t row = 0; row < p->NP * p->PR; row++) {
        uint8_t *x = p->pool + (size_t)kvt__page_slot(p->pages, 0, &p->pdiv, row) * p->slot;
        const float *c = cen + (size_t)(row / 64u % K) * QD;
        for (uint32_t i = 0; i < QD; i++)
            kvt__store_elem(x, p->dt, i, c[i] + (float)(0.03 * tu_normal(g)));
    }
    free(cen);
    cr_assert_eq(r->gpu.ops->write(&r->gpu, p->dpool, p->pool, (size_t)p->NP * p->PR * p->slot,
                                   NULL),
                 KVT_OK);
}

static void rpool_free(rig *r, rpool *p) {
    undev(r, p->dpool, (size_t)p->NP * p->PR * p->slot);
    undev(r, p->dpages, sizeof(int32_t) * p->NP);
    if (p->dV)
        undev(r, p->dV, sizeof(float) * p->rank * p->D);
    free(p->pool);
    free(p->pages);
    free(p->V);
}

Test(cuda, sketch_rows_equal_the_cpu) {
    rig r;
    rig_open(&r);
    tu_rng g = {.s = 0x5e7c4};
    /* dtype, D, rank, csk_stride: MLA's shape, odd ranks, a D off the warp width, no basis;
     * q8 > 0: the 8-bit planes too (params.recall_scan_bits 8: the fp16 part q8 wide, then the
     * plane of the row's branch and sketch, kvt__recall_q8_row), compared byte for byte */
    const struct {
        int dt;
        uint32_t D, rank, stride, q8;
    } cfg[] = {{KVT__DT_BF16, 512, 64, 64, 0},
               {KVT__DT_FP16, 512, 33, 40, 0},
               {KVT__DT_FP32, 200, 7, 8, 0},
               {KVT__DT_BF16, 512, 0, 1, 0},
               {KVT__DT_FP32, 1024, 96, 96, 0},
               {KVT__DT_BF16, 512, 64, 0, 64},
               {KVT__DT_FP16, 512, 33, 0, 40},
               {KVT__DT_FP32, 200, 7, 0, 7},
               {KVT__DT_BF16, 512, 0, 0, 1}};
    uint32_t q8_inf = 0, q8_rows = 0;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        rpool p;
        rpool_make(&r, &p, &g, cfg[c].dt, cfg[c].D, cfg[c].rank);
        const uint32_t q8 = cfg[c].q8, elt = cfg[c].dt == KVT__DT_FP32 ? 4 : 2;
        const uint32_t stride = q8 ? q8 + kvt__recall_q8_words(64, q8) : cfg[c].stride;
        if (q8) { /* rows 20 and 270: a non-finite branch value (their planes fire everywhere) */
            for (uint32_t row = 20; row < 300; row += 250)
                kvt__store_elem(p.pool + (size_t)kvt__page_slot(p.pages, 0, &p.pdiv, row) * p.slot,
                                p.dt, p.D + row % 64, row == 20 ? INFINITY : NAN);
            cr_assert_eq(r.gpu.ops->write(&r.gpu, p.dpool, p.pool, (size_t)p.NP * p.PR * p.slot,
                                          NULL),
                         KVT_OK);
        }
        /* two blocks in one call: rows [0, 200) and [256, 333) (a count off the warps) */
        enum { NB = 2 };
        const uint64_t first[NB] = {0, 256};
        const uint32_t nr[NB] = {200, 77};
        kvt__sketch_args ca[NB], ga[NB];
        for (int b = 0; b < NB; b++) {
            const size_t cb = sizeof(uint16_t) * nr[b] * stride;
            ca[b] = (kvt__sketch_args){.base = p.pool, .pages = p.pages, .first_page = 0,
                                       .pdiv = &p.pdiv, .first_row = first[b], .n_rows = nr[b],
                                       .slot_stride = p.slot, .dtype = p.dt, .latent_dim = p.D,
                                       .basis = p.V, .rank = p.rank,
                                       .csk_stride = stride, .csk = malloc(cb),
                                       .rho = malloc(sizeof(float) * nr[b]), .q8_off = q8,
                                       .branch_offset = p.D * elt, .branch_dtype = p.dt,
                                       .branch_dim = 64};
            /* stale values where the op must write */
            memset(ca[b].csk, 0x5a, cb);
            memset(ca[b].rho, 0x5a, sizeof(float) * nr[b]);
            ga[b] = ca[b];
            ga[b].base = p.dpool;
            ga[b].pages = p.dpages;
            ga[b].basis = p.dV;
            ga[b].csk = dev(&r, ca[b].csk, cb);
            ga[b].rho = dev(&r, ca[b].rho, sizeof(float) * nr[b]);
        }
        cr_assert_eq(r.cpu.ops->sketch_rows(&r.cpu, ca, NB, NULL), KVT_OK);
        cr_assert_eq(r.gpu.ops->sketch_rows(&r.gpu, ga, NB, NULL), KVT_OK);
        /* out of range: the CPU op's status (before the buffers go) */
        kvt__sketch_args bad = ga[0];
        bad.latent_dim = 0;
        kvt_status bs = r.gpu.ops->sketch_rows(&r.gpu, &bad, 1, NULL);
        cr_assert_eq(bs, KVT_ERR_INVALID_ARGUMENT, "config %zu: %s", c, kvt_status_name(bs));
        bad = ga[0];
        bad.dtype = 7; /* no such dtype */
        cr_assert_eq(r.gpu.ops->sketch_rows(&r.gpu, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        bad.dtype = KVT__DT_FP8; /* the ds_mla layout holds 512 latent values, no more */
        bad.latent_dim = KVT__FP8_VALUES + 1;
        bad.rank = 0; /* (no basis to own past its size) */
        cr_assert_eq(r.gpu.ops->sketch_rows(&r.gpu, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        if (p.rank) { /* a sketch plane narrower than the rank */
            bad = ga[0];
            bad.csk_stride = bad.rank - 1;
            cr_assert_eq(r.gpu.ops->sketch_rows(&r.gpu, &bad, 1, NULL),
                         KVT_ERR_INVALID_ARGUMENT);
        }
        if (q8) { /* the CPU op's 8-bit rules: a stride not the plane's, a branch too wide (one
                   * row: within the buffers, which the guarded backend checks first) */
            bad = ga[0];
            bad.n_rows = 1;
            bad.csk_stride++;
            cr_assert_eq(r.gpu.ops->sketch_rows(&r.gpu, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
            bad = ga[0];
            bad.n_rows = 1;
            bad.branch_dim = KVT__RECALL_MAX_BRANCH + 4;
            bad.csk_stride = q8 + kvt__recall_q8_words(bad.branch_dim, q8);
            cr_assert_eq(r.gpu.ops->sketch_rows(&r.gpu, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        }
        uint32_t inf = 0;
        for (int b = 0; b < NB; b++) {
            const size_t cb = sizeof(uint16_t) * nr[b] * stride;
            same(&r, ga[b].csk, ca[b].csk, cb,
                 q8 ? "sketch coefficients and 8-bit planes" : "sketch coefficients");
            for (uint32_t u = 0; q8 && u < nr[b]; u++) { /* rows whose plane fires everywhere */
                const uint8_t *pl = (const uint8_t *)(ca[b].csk + (size_t)u * stride + q8);
                q8_inf += isinf(kvt__recall_q8_f(pl, 2)) ? 1u : 0u;
                q8_rows++;
            }
            same(&r, ga[b].rho, ca[b].rho, sizeof(float) * nr[b], "rho");
            for (uint32_t u = 0; u < nr[b]; u++)
                inf += isinf(ca[b].rho[u]) ? 1u : 0u;
            undev(&r, ga[b].csk, cb);
            undev(&r, ga[b].rho, sizeof(float) * nr[b]);
            free(ca[b].csk);
            free(ca[b].rho);
        }
        /* the undescribable rows were in the blocks: NaN (9), Inf (300), fp16 overflow (40) */
        cr_assert_eq(inf, p.rank ? 3u : 2u, "config %zu: %u rows with rho = +Inf", c, inf);
        rpool_free(&r, &p);
    }
    /* the planes held finite rows and non-finite ones (a NaN or Inf branch: e_r = +Inf) */
    cr_assert(q8_inf > 0 && q8_inf < q8_rows, "%u of %u planes non-finite", q8_inf, q8_rows);
    rig_close(&r);
}

/* One scan work item on both backends' memory: the host arrays and their device copies. */
typedef struct scan_item {
    kvt__recall_scan_args c, g;
    uint32_t n_closed, H, cap;
    uint16_t *csk;
    float *rho, *q, *best;
    uint32_t *kept, *fired, n_fired, overflow;
    uint32_t n_kept; /* entries of kept written (it holds n_closed) */
} scan_item;

/* The 8-bit scan for the items scan_item_make makes next (params.recall_scan_bits 8): sketch rows
 * of the fp16 part (g_q8 0: rank + 1 wide; else max(rank, 1)) then the 8-bit plane. */
static bool g_q8;

/* Item i over pool p: its sketches (the CPU op), a kept set, H heads' queries and thresholds at
 * the q-th quantile of the archived rows' exact scores (so that some rows fire and some not). */
static void scan_item_make(rig *r, scan_item *it, const rpool *p, tu_rng *g, uint32_t n_closed,
                           uint32_t H, int mode, float z, double quant, uint32_t cap) {
    memset(it, 0, sizeof *it);
    const uint32_t q8 = g_q8 ? (p->rank ? p->rank : 1u) : 0u;
    const uint32_t D = p->D, QD = D + 64;
    const uint32_t S = q8 ? q8 + kvt__recall_q8_words(64, q8) : p->rank ? p->rank + 1 : 1;
    const uint32_t elt = p->dt == KVT__DT_FP32 ? 4 : 2;
    it->n_closed = n_closed;
    it->H = H;
    it->cap = cap;
    it->csk = malloc(sizeof(uint16_t) * n_closed * S);
    it->rho = malloc(sizeof(float) * n_closed);
    kvt__sketch_args sa = {.base = p->pool, .pages = p->pages, .first_page = 0, .pdiv = &p->pdiv,
                           .first_row = 0, .n_rows = n_closed, .slot_stride = p->slot,
                           .dtype = p->dt, .latent_dim = D, .basis = p->V, .rank = p->rank,
                           .csk_stride = S, .csk = it->csk, .rho = it->rho, .q8_off = q8,
                           .branch_offset = D * elt, .branch_dtype = p->dt, .branch_dim = 64};
    cr_assert_eq(r->cpu.ops->sketch_rows(&r->cpu, &sa, 1, NULL), KVT_OK);
    /* kept: every 5th row and row 3 (inside the sinks), ascending */
    uint32_t m = 0;
    it->kept = malloc(sizeof(uint32_t) * n_closed);
    for (uint32_t row = 0; row < n_closed; row++)
        if (row % 5 == 2 || row == 3)
            it->kept[m++] = row;
    it->n_kept = m;
    it->q = malloc(sizeof(float) * QD * H);
    it->best = malloc(sizeof(float) * H);
    float *sc = malloc(sizeof(float) * n_closed);
    for (uint32_t h = 0; h < H; h++) {
        float *qh = it->q + (size_t)h * QD;
        const double in = h % 3 == 0 ? 1.0 : tu_uniform(g);
        for (uint32_t i = 0; i < QD; i++)
            qh[i] = (float)(tu_normal(g) * (i < D ? (1.0 - in) * 0.3 : 1.0));
        for (uint32_t k = 0; k < p->rank; k++) {
            const float a = (float)(tu_normal(g) * in);
            for (uint32_t d = 0; d < D; d++)
                qh[d] += a * p->V[(size_t)k * D + d];
        }
        uint32_t n = 0;
        for (uint32_t row = 6; row < n_closed; row++) {
            const uint8_t *x =
                p->pool + (size_t)kvt__page_slot(p->pages, 0, &p->pdiv, row) * p->slot;
            const float e = kvt__recall_exact(qh, x, p->dt, D, D * elt, p->dt, 64, 0.07f);
            if (e == e)
                sc[n++] = e;
        }
        /* the quant-quantile by selection (n is small) */
        uint32_t want = (uint32_t)(quant * (n - 1));
        for (uint32_t i = 0; i <= want; i++)
            for (uint32_t j = i + 1; j < n; j++)
                if (sc[j] < sc[i]) {
                    float t = sc[i];
                    sc[i] = sc[j];
                    sc[j] = t;
                }
        it->best[h] = sc[want];
    }
    free(sc);
    it->fired = calloc(cap + 1, sizeof(uint32_t));
    it->c = (kvt__recall_scan_args){
        .base = p->pool, .pages = p->pages, .first_page = 0, .pdiv = &p->pdiv,
        .slot_stride = p->slot, .dtype = p->dt, .latent_dim = D, .branch_offset = D * elt,
        .branch_dtype = p->dt, .branch_dim = 64, .csk = it->csk, .rho = it->rho,
        .csk_stride = S, .basis = p->V, .rank = p->rank, .n_closed = n_closed, .sinks = 6,
        .kept = it->kept, .m = m, .q = it->q, .best = it->best, .n_heads = H, .scale = 0.07f,
        .z = z, .mode = mode, .cap = cap, .fired = it->fired, .n_fired = &it->n_fired,
        .overflow = &it->overflow, .q8_off = q8};
    it->g = it->c;
    it->g.base = p->dpool;
    it->g.pages = p->dpages;
    it->g.basis = p->dV;
    it->g.csk = dev(r, it->csk, sizeof(uint16_t) * n_closed * S);
    it->g.rho = dev(r, it->rho, sizeof(float) * n_closed);
    it->g.kept = dev(r, it->kept, sizeof(uint32_t) * (m ? m : 1));
    it->g.q = dev(r, it->q, sizeof(float) * QD * H);
    it->g.best = dev(r, it->best, sizeof(float) * H);
    it->g.fired = dev(r, it->fired, sizeof(uint32_t) * (cap + 1));
    /* stale values where the op must write */
    it->n_fired = it->overflow = 0x5a5a5a5au;
    it->g.n_fired = dev(r, &it->n_fired, 4);
    it->g.overflow = dev(r, &it->overflow, 4);
}

static void scan_item_free(rig *r, scan_item *it) {
    const uint32_t S = it->c.csk_stride, QD = it->c.latent_dim + 64;
    undev(r, (void *)it->g.csk, sizeof(uint16_t) * it->n_closed * S);
    undev(r, (void *)it->g.rho, sizeof(float) * it->n_closed);
    undev(r, (void *)it->g.kept, sizeof(uint32_t) * (it->c.m ? it->c.m : 1));
    undev(r, (void *)it->g.q, sizeof(float) * QD * it->H);
    undev(r, (void *)it->g.best, sizeof(float) * it->H);
    undev(r, it->g.fired, sizeof(uint32_t) * (it->cap + 1));
    undev(r, it->g.n_fired, 4);
    undev(r, it->g.overflow, 4);
    free(it->csk);
    free(it->rho);
    free(it->kept);
    free(it->q);
    free(it->best);
    free(it->fired);
}

Test(cuda, recall_scan_equals_the_cpu) {
    rig r;
    rig_open(&r);
    tu_rng g = {.s = 0x5ca9};
    const struct {
        int dt;
        uint32_t rank;
    } pcfg[] = {{KVT__DT_BF16, 64}, {KVT__DT_FP16, 17}, {KVT__DT_FP32, 0}};
    const float zs = sqrtf(512.0f - 64.0f);
    uint32_t some_fired = 0, some_quiet = 0, some_over = 0, q8_fired = 0, q8_quiet = 0;
    /* each pool at 16 bits, then at 8 (the 8-bit planes, heads and integer dots on the device) */
    for (size_t c = 0; c < 2 * (sizeof pcfg / sizeof pcfg[0]); c++) {
        g_q8 = c >= sizeof pcfg / sizeof pcfg[0];
        rpool p;
        rpool_make(&r, &p, &g, pcfg[c % 3].dt, 512, pcfg[c % 3].rank);
        /* four items in one call: sound and conformal (z > 0, z < 0), heads 1 .. 16, caps that
         * hold every fired row and one that overflows, a head whose best is NaN (all fire) */
        enum { NI = 4 };
        scan_item it[NI];
        scan_item_make(&r, &it[0], &p, &g, 512, 16, KVT__RECALL_SOUND, zs, 0.97, 512);
        scan_item_make(&r, &it[1], &p, &g, 333, 5, KVT__RECALL_CONFORMAL, 1.5f, 0.9, 512);
        scan_item_make(&r, &it[2], &p, &g, 400, 1, KVT__RECALL_CONFORMAL, -0.5f, 0.5, 20);
        scan_item_make(&r, &it[3], &p, &g, 256, 3, KVT__RECALL_SOUND, zs * 2.0f, 0.99, 64);
        it[3].best[1] = NAN;
        cr_assert_eq(r.gpu.ops->write(&r.gpu, (void *)it[3].g.best, it[3].best,
                                      sizeof(float) * it[3].H, NULL),
                     KVT_OK);
        kvt__recall_scan_args ca[NI], ga[NI];
        for (int i = 0; i < NI; i++) {
            ca[i] = it[i].c;
            ga[i] = it[i].g;
        }
        cr_assert_eq(r.cpu.ops->recall_scan(&r.cpu, ca, NI, NULL), KVT_OK);
        cr_assert_eq(r.gpu.ops->recall_scan(&r.gpu, ga, NI, NULL), KVT_OK);
        for (int i = 0; i < NI; i++) {
            uint32_t n_fired = 0, over = 0;
            cr_assert_eq(r.gpu.ops->read(&r.gpu, &n_fired, ga[i].n_fired, 4, NULL), KVT_OK);
            cr_assert_eq(r.gpu.ops->read(&r.gpu, &over, ga[i].overflow, 4, NULL), KVT_OK);
            cr_assert_eq(n_fired, it[i].n_fired, "config %zu item %d: %u fired, the CPU %u", c,
                         i, n_fired, it[i].n_fired);
            cr_assert_eq(over, it[i].overflow, "config %zu item %d: overflow", c, i);
            same(&r, ga[i].fired, it[i].fired, sizeof(uint32_t) * n_fired, "fired rows");
            some_fired += it[i].n_fired > 0;
            some_quiet += it[i].n_fired < it[i].n_closed - 6 - it[i].c.m && !it[i].overflow;
            some_over += it[i].overflow;
            q8_fired += g_q8 && it[i].n_fired > 0;
            q8_quiet += g_q8 && it[i].n_fired < it[i].n_closed - 6 - it[i].c.m && !it[i].overflow;
        }
        /* out of range: the CPU's statuses */
        kvt__recall_scan_args bad = ga[0];
        bad.latent_dim = 64;
        cr_assert_eq(r.gpu.ops->recall_scan(&r.gpu, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        bad = ga[0];
        bad.z = zs * 0.5f; /* sound mode below its proven z */
        cr_assert_eq(r.gpu.ops->recall_scan(&r.gpu, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        bad = ga[1];
        bad.z = NAN;
        cr_assert_eq(r.gpu.ops->recall_scan(&r.gpu, &bad, 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        cr_assert_eq(r.gpu.ops->recall_scan(&r.gpu, ga, 0, NULL), KVT_OK);
        for (int i = 0; i < NI; i++)
            scan_item_free(&r, &it[i]);
        rpool_free(&r, &p);
    }
    g_q8 = false;
    /* the inputs were not degenerate: rows fired, rows did not, a cap overflowed (and at 8 bits
     * rows fired and rows did not) */
    cr_assert(some_fired && some_quiet && some_over && q8_fired && q8_quiet,
              "fired %u, quiet %u, overflowed %u; 8-bit: fired %u, quiet %u", some_fired,
              some_quiet, some_over, q8_fired, q8_quiet);
    rig_close(&r);
}

/* ------------------------------------------------------------------------------------------------
 * recall_step: a sequence of steps of several (request, layer) items in one call per step, both
 * backends from the same inputs, every output compared after each step: the state bit for bit
 * (with group planes: the pruned scan's n_grouped and visited counts too), the samples, each
 * head's best, the fired rows, their count, the overflow and dense flags, and the group planes
 * of the blocks built.
 * ---------------------------------------------------------------------------------------------- */
typedef struct step_item {
    scan_item s;
    int mode;
    float margin;
    uint64_t n_rows;
    kvt__recall_state st;
    float *samples;
    uint32_t sample_cap;
    uint8_t dense;
    void *dst, *dsamples, *ddense;
    /* the group planes (groups): the CPU's, and the device's (dg) */
    uint32_t *g_perm, *g_n, *g_end;
    float *g_centre, *g_stat;
    void *dg[5];
    size_t g_bytes[5];
    uint64_t g_cap;
    uint32_t B, g_dim;
    float *q0; /* the item's base queries; each step perturbs them */
} step_item;

static void step_item_make(rig *r, step_item *it, const rpool *p, tu_rng *g, uint32_t n_closed,
                           uint32_t tail, uint32_t H, int mode, float margin, uint32_t cap,
                           bool groups) {
    memset(it, 0, sizeof *it);
    const float zs = sqrtf((float)p->D - 64.0f);
    scan_item_make(r, &it->s, p, g, n_closed, H, mode == KVT__RECALL_MARGIN ? KVT__RECALL_SOUND
                                                                             : mode,
                   mode == KVT__RECALL_CONFORMAL ? 1.0f : zs, 0.9, cap);
    it->mode = mode;
    it->margin = margin;
    it->n_rows = n_closed + tail;
    cr_assert(it->n_rows <= p->NP * p->PR);
    memset(&it->st, 0, sizeof it->st);
    it->st.z = KVT__CONFORMAL_Z_MAX;
    it->st.phase = KVT__CONFORMAL_OPEN;
    it->sample_cap = H * KVT__CONFORMAL_LAST_WINDOW;
    it->samples = calloc(it->sample_cap, sizeof(float));
    it->dense = 0x5a;
    it->dst = dev(r, &it->st, sizeof it->st);
    it->dsamples = dev(r, it->samples, sizeof(float) * it->sample_cap);
    it->ddense = dev(r, &it->dense, 1);
    const size_t QD = (size_t)(p->D + 64) * H;
    it->q0 = malloc(sizeof(float) * QD);
    memcpy(it->q0, it->s.q, sizeof(float) * QD);
    if (groups) {
        /* blocks of 128 rows: segments split before they are groups */
        it->B = 128;
        it->g_cap = n_closed / it->B + 1;
        it->g_dim = 64 + p->rank;
        const uint64_t G = it->B / 32u;
        const size_t b[5] = {it->g_cap * it->B * 4, it->g_cap * 4, it->g_cap * G * 4,
                             it->g_cap * G * it->g_dim * 4, it->g_cap * G * 5u * 4};
        void **c[5] = {(void **)&it->g_perm, (void **)&it->g_n, (void **)&it->g_end,
                       (void **)&it->g_centre, (void **)&it->g_stat};
        for (int k = 0; k < 5; k++) {
            it->g_bytes[k] = b[k];
            *c[k] = calloc(1, b[k]);
            it->dg[k] = dev(r, *c[k], b[k]);
        }
    }
}

static void step_item_free(rig *r, step_item *it) {
    undev(r, it->dst, sizeof it->st);
    undev(r, it->dsamples, sizeof(float) * it->sample_cap);
    undev(r, it->ddense, 1);
    scan_item_free(r, &it->s);
    for (int k = 0; k < 5; k++)
        if (it->dg[k])
            undev(r, it->dg[k], it->g_bytes[k]);
    free(it->samples);
    free(it->q0);
    free(it->g_perm);
    free(it->g_n);
    free(it->g_end);
    free(it->g_centre);
    free(it->g_stat);
}

/* The step's args on one backend's memory (gpu: the device copies). */
static kvt__recall_step_args step_args_of(step_item *it, bool gpu) {
    kvt__recall_step_args x;
    memset(&x, 0, sizeof x);
    x.scan = gpu ? it->s.g : it->s.c;
    x.n_rows = it->n_rows;
    x.mode = it->mode;
    x.margin = it->margin;
    x.st = gpu ? it->dst : &it->st;
    x.samples = gpu ? it->dsamples : it->samples;
    x.sample_cap = it->sample_cap;
    x.dense = gpu ? it->ddense : &it->dense;
    if (it->g_perm) {
        x.g_perm = gpu ? it->dg[0] : it->g_perm;
        x.g_n = gpu ? it->dg[1] : it->g_n;
        x.g_end = gpu ? it->dg[2] : it->g_end;
        x.g_centre = gpu ? it->dg[3] : it->g_centre;
        x.g_stat = gpu ? it->dg[4] : it->g_stat;
        x.g_blocks_cap = it->g_cap;
        x.block_rows = it->B;
        x.g_dim = it->g_dim;
    }
    return x;
}

/* New queries for a step on both sides: the base ones plus noise scaled by `noise`. */
static void step_queries(rig *r, step_item *it, tu_rng *g, double noise) {
    const size_t QD = (size_t)(it->s.c.latent_dim + 64) * it->s.H;
    for (size_t i = 0; i < QD; i++)
        it->s.q[i] = it->q0[i] + (float)(noise * tu_normal(g));
    cr_assert_eq(r->gpu.ops->write(&r->gpu, (void *)it->s.g.q, it->s.q, sizeof(float) * QD, NULL),
                 KVT_OK);
}

/* The planned op's device side (kvt__recall_plan_args): a plan of up to PLAN_MAX items, their
 * count, and one query buffer the items' queries are copied into. */
enum { PLAN_MAX = 8, PLAN_Q = PLAN_MAX * 16 * 576 };
typedef struct plan_rig {
    void *items, *n, *q;
} plan_rig;

/* Items ga[0 .. n) run as the planned op (its bound: 16 heads, rank 64, 512 rows): queries
 * copied to item i's q_off, the items and count written, the workspace reserved, then the op.
 * Returns its status. */
static kvt_status planned_step(rig *r, plan_rig *pr, const step_item *it,
                               const kvt__recall_step_args *ga, uint32_t n, uint64_t bound_rows) {
    kvt__recall_plan_item items[PLAN_MAX];
    memset(items, 0, sizeof items);
    size_t off = 0;
    cr_assert_leq(n, PLAN_MAX);
    for (uint32_t i = 0; i < n; i++) {
        const size_t qf = (size_t)(it[i].s.c.latent_dim + 64) * it[i].s.H;
        cr_assert_leq(off + qf, PLAN_Q);
        cr_assert_eq(r->gpu.ops->copy(&r->gpu, (float *)pr->q + off, ga[i].scan.q,
                                      sizeof(float) * qf, NULL),
                     KVT_OK);
        items[i].a = ga[i];
        items[i].div = *ga[i].scan.pdiv;
        items[i].a.scan.pdiv = NULL;
        items[i].a.scan.q = NULL;
        items[i].q_off = off;
        off += qf;
    }
    cr_assert_eq(r->gpu.ops->write(&r->gpu, pr->items, items, sizeof items, NULL), KVT_OK);
    cr_assert_eq(r->gpu.ops->write(&r->gpu, pr->n, &n, sizeof n, NULL), KVT_OK);
    kvt__recall_plan_args pa = {.items = pr->items, .n = pr->n, .n_max = PLAN_MAX,
                                .query = pr->q, .query_floats = PLAN_Q};
    kvt__recall_plan_bound(16, 64, 512, 64, bound_rows, 0, it[0].B, &pa.bound);
    if (r->gpu.ops->recall_plan_reserve)
        cr_assert_eq(r->gpu.ops->recall_plan_reserve(&r->gpu, &pa), KVT_OK);
    return r->gpu.ops->recall_step(&r->gpu, &pa, NULL);
}

/* planned: the device side runs the planned op (kvt__recall_plan_args) instead of recall_step,
 * from a plan buffer holding more slots than items. q8: the items scan at 8 bits (their planes,
 * the 8-bit scan; with group planes neither twin prunes nor builds a group: the same state). */
static void step_pair(bool groups, bool planned, bool q8) {
    rig r;
    rig_open(&r);
    plan_rig pr = {0};
    if (planned) {
        pr.items = dev(&r, NULL, sizeof(kvt__recall_plan_item) * PLAN_MAX);
        pr.n = dev(&r, NULL, sizeof(uint32_t));
        pr.q = dev(&r, NULL, sizeof(float) * PLAN_Q);
    }
    tu_rng g = {.s = groups ? 0x57e9u : 0x57e8u};
    g_q8 = q8;
    const struct {
        int dt;
        uint32_t rank;
    } pcfg[] = {{KVT__DT_BF16, 64}, {KVT__DT_FP16, 17}, {KVT__DT_FP32, 0}};
    uint32_t calibrated = 0, calib_dense = 0, some_fired = 0, some_over = 0, quiet = 0;
    uint32_t pruned = 0, grouped = 0;
    for (size_t c = 0; c < sizeof pcfg / sizeof pcfg[0]; c++) {
        rpool p, pc;
        rpool_make(&r, &p, &g, pcfg[c].dt, 512, pcfg[c].rank);
        /* conformal (calibrating, then calibrated; a wide and a narrow cap), sound with a cap
         * that overflows, margin, and an item with nothing archived (every row a sink); with
         * groups and a basis, a sound and a conformal item over clustered rows (groups skipped) */
        const bool clustered = groups && pcfg[c].rank;
        const int NI = clustered ? 7 : 5;
        step_item it[7];
        step_item_make(&r, &it[0], &p, &g, 400, 50, 5, KVT__RECALL_CONFORMAL, 0.0f, 400, groups);
        step_item_make(&r, &it[1], &p, &g, 333, 100, 3, KVT__RECALL_CONFORMAL, 0.0f, 6, groups);
        step_item_make(&r, &it[2], &p, &g, 256, 0, 16, KVT__RECALL_SOUND, 0.0f, 20, groups);
        step_item_make(&r, &it[3], &p, &g, 300, 12, 4, KVT__RECALL_MARGIN, 0.5f, 300, groups);
        step_item_make(&r, &it[4], &p, &g, 40, 30, 2, KVT__RECALL_CONFORMAL, 0.0f, 16, groups);
        it[4].s.c.sinks = it[4].s.g.sinks = 1000; /* S clamps to n_closed: nothing archived */
        if (clustered) {
            rpool_make(&r, &pc, &g, pcfg[c].dt, 512, pcfg[c].rank);
            rpool_cluster(&r, &pc, &g);
            step_item_make(&r, &it[5], &pc, &g, 448, 20, 2, KVT__RECALL_SOUND, 0.0f, 448, true);
            step_item_make(&r, &it[6], &pc, &g, 384, 40, 2, KVT__RECALL_CONFORMAL, 0.0f, 384,
                           true);
        }
        for (uint32_t step = 0; step < 12; step++) {
            kvt__recall_step_args ca[7], ga[7];
            for (int i = 0; i < NI; i++) {
                step_queries(&r, &it[i], &g, step ? 0.05 : 0.0);
                ca[i] = step_args_of(&it[i], false);
                ga[i] = step_args_of(&it[i], true);
            }
            cr_assert_eq(os_recall_step(&r.cpu, ca, NI, NULL), KVT_OK);
            if (planned)
                cr_assert_eq(planned_step(&r, &pr, it, ga, NI, 512), KVT_OK, "step %u", step);
            else
                cr_assert_eq(os_recall_step(&r.gpu, ga, NI, NULL), KVT_OK);
            for (int i = 0; i < NI; i++) {
                step_item *x = &it[i];
                kvt__recall_state gs;
                cr_assert_eq(r.gpu.ops->read(&r.gpu, &gs, x->dst, sizeof gs, NULL), KVT_OK);
                const kvt__recall_state cs = x->st;
                cr_assert(memcmp(&gs, &cs, sizeof gs) == 0,
                          "config %zu item %d step %u: state differs (phase %u/%u, samples "
                          "%u/%u, z %a/%a, fired %llu/%llu, dense %u/%u, grouped %u/%u, "
                          "visited %llu/%llu)",
                          c, i, step, gs.phase, cs.phase, gs.n_samples, cs.n_samples,
                          (double)gs.z, (double)cs.z, (unsigned long long)gs.last_fired,
                          (unsigned long long)cs.last_fired, gs.last_dense, cs.last_dense,
                          gs.n_grouped, cs.n_grouped, (unsigned long long)gs.last_visited,
                          (unsigned long long)cs.last_visited);
                if (groups) { /* the planes of the blocks built, byte for byte */
                    const uint64_t nb = cs.n_grouped, G = x->B / 32u;
                    same(&r, x->dg[0], x->g_perm, nb * x->B * 4, "group members");
                    same(&r, x->dg[1], x->g_n, nb * 4, "group counts");
                    same(&r, x->dg[2], x->g_end, nb * G * 4, "group ends");
                    same(&r, x->dg[3], x->g_centre, nb * G * x->g_dim * 4, "group centres");
                    same(&r, x->dg[4], x->g_stat, nb * G * 5u * 4, "group statistics");
                    grouped += nb > 0;
                    pruned += cs.last_visited < cs.last_archived && !cs.last_dense;
                }
                same(&r, x->dsamples, x->samples, sizeof(float) * cs.n_samples, "samples");
                same(&r, x->s.g.best, x->s.best, sizeof(float) * x->s.H, "best scores");
                same(&r, x->ddense, &x->dense, 1, "dense flag");
                same(&r, x->s.g.n_fired, &x->s.n_fired, 4, "fired count");
                same(&r, x->s.g.overflow, &x->s.overflow, 4, "overflow flag");
                same(&r, x->s.g.fired, x->s.fired, sizeof(uint32_t) * x->s.n_fired,
                     "fired rows");
                calib_dense += cs.last_dense && !cs.last_overflow;
                some_fired += x->s.n_fired > 0;
                some_over += cs.last_overflow;
                quiet += !cs.last_dense && cs.last_archived && x->s.n_fired < cs.last_archived;
                if (i == 4)
                    cr_assert_eq(cs.last_archived, 0u);
            }
        }
        calibrated += it[0].st.phase == KVT__CONFORMAL_CALIBRATED;
        calibrated += it[1].st.phase == KVT__CONFORMAL_CALIBRATED;
        /* out of range: the argument rules every backend applies (the library checks each item
         * when it plans it); the CPU backends' op refuses such an item, the CUDA one, which
         * cannot read items on the host, makes its step dense */
        kvt__recall_step_args bad[3] = {step_args_of(&it[0], true), step_args_of(&it[0], true),
                                        step_args_of(&it[3], true)};
        bad[0].n_rows = bad[0].scan.n_closed - 1;
        bad[1].samples = NULL; /* conformal mode without a sample array */
        bad[1].sample_cap = 0;
        bad[2].margin = -1.0f;
        for (int k = 0; k < 3; k++) {
            cr_assert(!kvt__recall_step_args_ok(&bad[k]), "bad item %d", k);
            if (r.guarded)
                cr_assert_eq(os_recall_step(&r.gpu, &bad[k], 1, NULL), KVT_ERR_INVALID_ARGUMENT);
        }
        cr_assert_eq(os_recall_step(&r.gpu, bad, 0, NULL), KVT_OK);
        if (planned) {
            /* an item outside the plan's bound (400 closed rows, a bound of 256): the CPU
             * backends refuse the op; the CUDA one, which cannot, makes the item's step dense */
            kvt__recall_step_args one = step_args_of(&it[0], true);
            const uint8_t zero = 0;
            cr_assert_eq(r.gpu.ops->write(&r.gpu, it[0].ddense, &zero, 1, NULL), KVT_OK);
            const kvt_status s = planned_step(&r, &pr, &it[0], &one, 1, 256);
            uint8_t d = 0;
            cr_assert_eq(r.gpu.ops->read(&r.gpu, &d, it[0].ddense, 1, NULL), KVT_OK);
            if (r.guarded) {
                cr_assert_eq(s, KVT_ERR_INVALID_ARGUMENT);
                cr_assert_eq(d, 0, "a refused plan ran nothing");
            } else {
                cr_assert_eq(s, KVT_OK);
                cr_assert_eq(d, 1, "the unservable item's step is dense");
            }
        }
        for (int i = 0; i < NI; i++)
            step_item_free(&r, &it[i]);
        rpool_free(&r, &p);
        if (clustered)
            rpool_free(&r, &pc);
    }
    g_q8 = false;
    /* the inputs were not degenerate: calibration steps, calibrated requests, fired rows, quiet
     * scans and overflows; with groups, built blocks and scans that skipped a group (at 8 bits
     * too: the groups' bound widened by the planes' rounding) */
    cr_assert(!groups || (grouped && pruned), "%s: grouped %u, pruned %u", q8 ? "8 bits" : "16 bits",
              grouped, pruned);
    cr_assert(calibrated && calib_dense && some_fired && some_over && quiet,
              "calibrated %u, calibration steps %u, fired %u, overflowed %u, quiet %u", calibrated,
              calib_dense, some_fired, some_over, quiet);
    if (planned) {
        undev(&r, pr.items, sizeof(kvt__recall_plan_item) * PLAN_MAX);
        undev(&r, pr.n, sizeof(uint32_t));
        undev(&r, pr.q, sizeof(float) * PLAN_Q);
    }
    rig_close(&r);
}

Test(cuda, recall_step_equals_the_cpu) {
    step_pair(false, false, false);
}

/* The planned op (a CUDA graph's recall step): items read from a plan buffer, queries from one
 * base, launch and workspace sized by the bound. */
Test(cuda, recall_step_planned_equals_the_cpu) {
    step_pair(false, true, false);
}

/* The pruned scan over group planes (the blocks' groups built on the device, then the groups
 * no head can fire on skipped): the CPU's decisions, counts and planes. */
Test(cuda, recall_step_pruned_equals_the_cpu) {
    step_pair(true, false, false);
}

/* The same through the planned op (its bound with the group blocks' size). */
Test(cuda, recall_step_planned_pruned_equals_the_cpu) {
    step_pair(true, true, false);
}

/* The 8-bit scan (params.recall_scan_bits 8) in the step, eager and with group planes (which
 * neither twin then uses), and planned (the bound's workspace sized for any plane width): the
 * CPU's state, fired sets, counts and flags. */
Test(cuda, recall_step_q8_equals_the_cpu, .timeout = 120) {
    step_pair(false, false, true);
    step_pair(true, false, true);
}

Test(cuda, recall_step_planned_q8_equals_the_cpu) {
    step_pair(false, true, true);
}

/* ------------------------------------------------------------------------------------------------
 * recall_step with promotion: the tables after the trigger state (kvt__recall_promo and its four
 * arrays), compared byte for byte after every step, with everything step_pair compares. 16 steps
 * over 384 closed rows, then a close (448 closed rows, a new kept set holding two of the rows
 * promoted by then: absorbed; the others without a hit in the window demoted), then 8 more; an
 * item without promotion in the same call.
 * ---------------------------------------------------------------------------------------------- */
enum { PR_CAP = 8, PR_CAND = 32, PR_HITS = 2, PR_WIN = 4 };

typedef struct promo_side {
    size_t bytes;
    void *c, *g;              /* the tables: host, device */
    uint32_t *fired, *kept;   /* the host's fetch buffer [cap + PR_CAP] and kept set */
    void *dfired, *dkept;     /* their device copies */
    const uint32_t *kept0;    /* the item's own kept set, restored before it is freed */
    const void *dkept0;
    uint32_t *fired0;
    void *dfired0;
    uint32_t m_all;           /* the item's kept rows below 448 */
} promo_side;

static void promo_side_make(rig *r, promo_side *ps, step_item *it) {
    memset(ps, 0, sizeof *ps);
    ps->bytes = sizeof(kvt__recall_promo) + sizeof(uint32_t) * 2u * (PR_CAND + PR_CAP);
    ps->c = calloc(1, ps->bytes);
    ps->g = dev(r, ps->c, ps->bytes);
    const uint32_t cap = it->s.c.cap, n = it->s.n_closed;
    ps->fired = calloc(cap + PR_CAP + 1, sizeof(uint32_t));
    ps->dfired = dev(r, ps->fired, sizeof(uint32_t) * (cap + PR_CAP + 1));
    ps->kept = malloc(sizeof(uint32_t) * n);
    memcpy(ps->kept, it->s.kept, sizeof(uint32_t) * it->s.c.m);
    ps->dkept = dev(r, ps->kept, sizeof(uint32_t) * n);
    ps->m_all = it->s.c.m;
    ps->kept0 = it->s.c.kept;
    ps->dkept0 = it->s.g.kept;
    ps->fired0 = it->s.c.fired;
    ps->dfired0 = it->s.g.fired;
    it->s.c.kept = ps->kept;
    it->s.g.kept = ps->dkept;
    it->s.c.fired = ps->fired;
    it->s.g.fired = ps->dfired;
    it->s.fired = ps->fired; /* step_pair's comparisons read it->s.fired */
}

static void promo_side_free(rig *r, promo_side *ps, step_item *it) {
    undev(r, ps->g, ps->bytes);
    undev(r, ps->dfired, sizeof(uint32_t) * (it->s.c.cap + PR_CAP + 1));
    undev(r, ps->dkept, sizeof(uint32_t) * it->s.n_closed);
    free(ps->c);
    free(ps->fired);
    free(ps->kept);
    it->s.c.kept = ps->kept0;
    it->s.g.kept = ps->dkept0;
    it->s.c.fired = it->s.fired = ps->fired0;
    it->s.g.fired = ps->dfired0;
    it->s.c.m = it->s.g.m = ps->m_all;
}

/* The closed rows of the step (n_closed <= the item's sketched rows) with the kept rows below. */
static void promo_closed(step_item *it, uint32_t n_closed, uint32_t m) {
    it->s.c.n_closed = it->s.g.n_closed = n_closed;
    it->s.c.m = it->s.g.m = m;
}

Test(cuda, recall_step_promotion_equals_the_cpu) {
    rig r;
    rig_open(&r);
    tu_rng g = {.s = 0x9e07};
    rpool p;
    rpool_make(&r, &p, &g, KVT__DT_BF16, 512, 64);
    enum { NI = 4 };
    step_item it[NI];
    /* conformal (calibrates, then scans), sound with a cap that overflows, margin; item 3 has
     * no promotion */
    step_item_make(&r, &it[0], &p, &g, 448, 40, 5, KVT__RECALL_CONFORMAL, 0.0f, 300, false);
    step_item_make(&r, &it[1], &p, &g, 448, 10, 16, KVT__RECALL_SOUND, 0.0f, 40, false);
    step_item_make(&r, &it[2], &p, &g, 448, 20, 4, KVT__RECALL_MARGIN, 0.5f, 300, false);
    step_item_make(&r, &it[3], &p, &g, 448, 30, 3, KVT__RECALL_CONFORMAL, 0.0f, 300, false);
    promo_side ps[NI - 1];
    for (int i = 0; i < NI - 1; i++)
        promo_side_make(&r, &ps[i], &it[i]);
    uint32_t m384[NI];
    for (int i = 0; i < NI; i++) {
        m384[i] = 0;
        while (m384[i] < it[i].s.c.m && it[i].s.c.kept[m384[i]] < 384)
            m384[i]++;
        promo_closed(&it[i], 384, m384[i]);
    }
    uint64_t merged_steps = 0, absorbed = 0, demoted = 0, promoted = 0;
    for (uint32_t step = 0; step < 24; step++) {
        if (step == 16) {
            /* the close: 448 closed rows; each item's kept set gains two promoted rows */
            for (int i = 0; i < NI; i++) {
                uint32_t m = i < NI - 1 ? ps[i].m_all : it[i].s.c.m;
                if (i < NI - 1) {
                    const kvt__recall_promo *h = ps[i].c;
                    const uint32_t *prow = (const uint32_t *)(h + 1) + 2u * PR_CAND;
                    uint32_t *k = ps[i].kept;
                    memcpy(k, ps[i].kept0, sizeof(uint32_t) * ps[i].m_all);
                    for (uint32_t j = 0; j < h->n_prom && j < 2; j++) {
                        uint32_t at = m++;
                        while (at > 0 && k[at - 1] > prow[j]) {
                            k[at] = k[at - 1];
                            at--;
                        }
                        k[at] = prow[j];
                    }
                    cr_assert_eq(r.gpu.ops->write(&r.gpu, ps[i].dkept, k, sizeof(uint32_t) * m,
                                                  NULL),
                                 KVT_OK);
                } else {
                    /* the kept rows below 448: within the n_kept entries written (the
                     * array's tail past them is unwritten; walking into it handed both twins
                     * an unsorted list and the device a count past its copy, which the CUDA
                     * emulation's bounds check caught) */
                    m = 0;
                    while (m < it[i].s.n_kept && it[i].s.kept[m] < 448)
                        m++;
                }
                promo_closed(&it[i], 448, m);
            }
        }
        kvt__recall_step_args ca[NI], ga[NI];
        for (int i = 0; i < NI; i++) {
            step_queries(&r, &it[i], &g, step ? 0.03 : 0.0);
            ca[i] = step_args_of(&it[i], false);
            ga[i] = step_args_of(&it[i], true);
            if (i < NI - 1) {
                const uint32_t room = step < 16 ? 6 : PR_CAP;
                ca[i].promo = ps[i].c;
                ga[i].promo = ps[i].g;
                ca[i].cand_cap = ga[i].cand_cap = PR_CAND;
                ca[i].prom_cap = ga[i].prom_cap = PR_CAP;
                ca[i].prom_room = ga[i].prom_room = room;
                ca[i].hits = ga[i].hits = PR_HITS;
                ca[i].window = ga[i].window = PR_WIN;
            }
        }
        cr_assert_eq(os_recall_step(&r.cpu, ca, NI, NULL), KVT_OK);
        cr_assert_eq(os_recall_step(&r.gpu, ga, NI, NULL), KVT_OK);
        for (int i = 0; i < NI; i++) {
            step_item *x = &it[i];
            kvt__recall_state gs;
            cr_assert_eq(r.gpu.ops->read(&r.gpu, &gs, x->dst, sizeof gs, NULL), KVT_OK);
            cr_assert(memcmp(&gs, &x->st, sizeof gs) == 0,
                      "item %d step %u: state differs (fired %llu/%llu, archived %llu/%llu)", i,
                      step, (unsigned long long)gs.last_fired,
                      (unsigned long long)x->st.last_fired,
                      (unsigned long long)gs.last_archived,
                      (unsigned long long)x->st.last_archived);
            same(&r, x->dsamples, x->samples, sizeof(float) * x->st.n_samples, "samples");
            same(&r, x->s.g.best, x->s.best, sizeof(float) * x->s.H, "best scores");
            same(&r, x->ddense, &x->dense, 1, "dense flag");
            same(&r, x->s.g.n_fired, &x->s.n_fired, 4, "fired count");
            same(&r, x->s.g.overflow, &x->s.overflow, 4, "overflow flag");
            same(&r, x->s.g.fired, x->s.c.fired, sizeof(uint32_t) * x->s.n_fired,
                 "fetched rows");
            if (i == NI - 1)
                continue;
            same(&r, ps[i].g, ps[i].c, ps[i].bytes, "promotion tables");
            const kvt__recall_promo *h = ps[i].c;
            merged_steps += !x->dense && h->n_prom && x->s.n_fired >= h->n_prom;
            if (step == 23) {
                absorbed += h->absorbed;
                demoted += h->demotions;
                promoted += h->promotions;
            }
        }
    }
    /* the inputs were not degenerate: rows promoted, merged into fetch buffers, absorbed or
     * demoted at the close */
    cr_assert(promoted && merged_steps && absorbed, "promoted %llu, merged %llu, absorbed %llu",
              (unsigned long long)promoted, (unsigned long long)merged_steps,
              (unsigned long long)absorbed);
    cr_log_info("promotion: %llu promoted, %llu absorbed, %llu demoted, %llu steps fetched "
                "promoted rows",
                (unsigned long long)promoted, (unsigned long long)absorbed,
                (unsigned long long)demoted, (unsigned long long)merged_steps);
    for (int i = 0; i < NI - 1; i++)
        promo_side_free(&r, &ps[i], &it[i]);
    for (int i = 0; i < NI; i++)
        step_item_free(&r, &it[i]);
    rpool_free(&r, &p);
    rig_close(&r);
}

/* ------------------------------------------------------------------------------------------------
 * pack with recall: fetched rows merged into the list, the dense flag, every row by the host,
 * plain queries in the same call, TOKENS and CSR with device offsets, in one call of more
 * queries than the host-described launches of a former form of the op took (64).
 * ---------------------------------------------------------------------------------------------- */
Test(cuda, pack_recall_equals_the_cpu) {
    rig r;
    rig_open(&r);
    enum { PR = 16, NP = 64, NQ = 70, FC = 48 };
    int32_t pages[NP];
    shuffled(pages, NP);
    int32_t *dpages = dev(&r, pages, sizeof pages);
    uint32_t list[200];
    for (uint32_t i = 0; i < 200; i++)
        list[i] = 40 + 3 * i;
    uint32_t *dlist = dev(&r, list, sizeof list);
    /* fetched rows: ascending, in (lo_end, hi_begin), off the list (40 + 3i + 1) */
    uint32_t *fetch = malloc(sizeof(uint32_t) * NQ * FC), n_fetch[NQ], dense[NQ];
    for (uint32_t i = 0; i < NQ; i++) {
        uint32_t row = 41 + rnd32() % 5 * 3, n = 0;
        for (; n < FC && row < 40 + 3 * 200; n++, row += 3 * (1 + rnd32() % 4))
            fetch[i * FC + n] = row;
        n_fetch[i] = i % 5 == 3 ? 0 : 1 + rnd32() % n; /* n >= 1: row 53 < 640 */
        dense[i] = i % 5 == 2 ? 1u : 0u;
    }
    uint32_t *dfetch = dev(&r, fetch, sizeof(uint32_t) * NQ * FC);
    uint32_t *dn_fetch = dev(&r, n_fetch, sizeof n_fetch), *ddense = dev(&r, dense, sizeof dense);
    kvt__div32 pdiv = kvt__div32_make(PR);
    const uint64_t cap = 1024; /* >= every set: hi_end < 40 + 3 * 200 + 200 */
    uint32_t kinds[5] = {0};
    for (int csr = 0; csr < 2; csr++) {
        kvt__pack_query qc[NQ], qg[NQ];
        for (uint32_t i = 0; i < NQ; i++) {
            uint64_t nl = rnd32() % 150, hi0 = 40 + 3 * 200, hi1 = hi0 + rnd32() % 200;
            qc[i] = (kvt__pack_query){.d = {.lo_end = 1 + rnd32() % 39, .list = list, .n_list = nl,
                                            .hi_begin = hi0, .hi_end = hi1},
                                      .pages = pages, .first_page = 0};
            /* 0: plain; 1: fetched rows; 2: dense by the flag; 3: a flag of 0, no fetched row;
             * 4: every row, decided on the host */
            const uint32_t kind = i % 5;
            kinds[kind]++;
            if (kind >= 1 && kind <= 3) {
                qc[i].fetch = fetch + i * FC;
                qc[i].n_fetch = &n_fetch[i];
                qc[i].dense = &dense[i];
                qc[i].fetch_cap = FC;
            }
            qc[i].all_rows = kind == 4;
            qc[i].out = csr ? 0 : (uint64_t)i * cap; /* CSR: the device's offsets */
            qc[i].pad = csr ? 0 : cap;
            qc[i].len_at = csr ? i + 1 : i;
            qg[i] = qc[i];
            qg[i].d.list = dlist;
            qg[i].pages = dpages;
            if (qc[i].fetch) {
                qg[i].fetch = dfetch + i * FC;
                qg[i].n_fetch = dn_fetch + i;
                qg[i].dense = ddense + i;
            }
        }
        const size_t n_idx = (size_t)NQ * cap;
        int32_t *idx = malloc(4 * n_idx), *len = malloc(4 * (NQ + 1));
        memset(idx, 0x5a, 4 * n_idx); /* stale values: what the op leaves must agree too */
        memset(len, 0x5a, 4 * (NQ + 1));
        int32_t *didx = dev(&r, idx, 4 * n_idx), *dlen = dev(&r, len, 4 * (NQ + 1));
        pack_both(&r, &pdiv, csr, qc, qg, NQ, idx, len, didx, dlen, n_idx);
        /* the merge was exercised: a set holds a fetched row between two list rows */
        if (!csr) {
            const uint32_t i = 1; /* kind 1 */
            cr_assert_gt(n_fetch[i] + 0u, 0u, "query 1 fetched nothing (test inputs)");
            cr_assert_eq((uint64_t)len[i], kvt__attended_desc_count(&qc[i].d) + n_fetch[i]);
        }
        undev(&r, didx, 4 * n_idx);
        undev(&r, dlen, 4 * (NQ + 1));
        free(idx);
        free(len);
    }
    cr_assert(kinds[0] && kinds[1] && kinds[2] && kinds[3] && kinds[4]);
    undev(&r, dpages, sizeof pages);
    undev(&r, dlist, sizeof list);
    undev(&r, dfetch, sizeof(uint32_t) * NQ * FC);
    undev(&r, dn_fetch, sizeof n_fetch);
    undev(&r, ddense, sizeof dense);
    free(fetch);
    rig_close(&r);
}

/* The places the CUDA step's parallel merge of the kept set with the promoted rows writes to
 * (kvt__promo_merged_at, one thread per element, any order) give kvt__promo_merge's serial
 * union: empty sides, a side of one, promoted rows below, between and above the kept ones.
 * Host only: runs everywhere. */
Test(cuda, promo_merge_places_equal_the_serial_merge) {
    uint32_t kept[300], prom[40], want[340], got[340];
    for (int it = 0; it < 20000; it++) {
        uint32_t m = 0, np = 0;
        const uint32_t n = rnd32() % 320, pk = 1 + rnd32() % 4, pp = 1 + rnd32() % 16;
        for (uint32_t row = 0; row < n; row++) { /* disjoint, ascending */
            const uint32_t u = rnd32() % (pk + pp + 1);
            if (u < pk && m < 300)
                kept[m++] = row;
            else if (u == pk && np < 40)
                prom[np++] = row;
        }
        const uint64_t total = kvt__promo_merge(kept, m, prom, np, want);
        cr_assert_eq(total, (uint64_t)m + np);
        memset(got, 0xff, sizeof got);
        for (uint64_t t = total; t-- > 0;) /* backwards: the order must not matter */
            got[kvt__promo_merged_at(kept, m, prom, np, t)] = t < m ? kept[t] : prom[t - m];
        cr_assert(memcmp(got, want, sizeof(uint32_t) * total) == 0, "case %d: m %u, np %u", it,
                  m, np);
    }
}

/* The positions the CUDA step's parallel sample merge writes to (kvt__conformal_merged_old /
 * _new) give kvt__conformal_insert's array bit for bit: ties, ±0, NaN samples (left out before
 * the merge, as the step does), a cap that cuts the new samples. Host only: runs everywhere. */
Test(cuda, sample_merge_equals_sequential_insertion) {
    uint32_t merged = 0, capped = 0;
    for (int it = 0; it < 20000; it++) {
        const uint32_t cap = 1 + rnd32() % 40, H = rnd32() % 12;
        float want[64], got[64], old[64], e[16], nw[16];
        uint32_t n = 0, n0 = rnd32() % (cap + 1);
        for (uint32_t i = 0; i < n0; i++) { /* coarse values: many ties; ±0 */
            const uint32_t k = rnd32() % 8;
            kvt__conformal_insert(want, &n, cap, k == 0 ? -0.0f : (float)k - 4.0f);
        }
        n0 = n;
        memcpy(old, want, sizeof(float) * n0);
        for (uint32_t h = 0; h < H; h++) {
            const uint32_t k = rnd32() % 10;
            e[h] = k == 0 ? 0.0f : k == 1 ? -0.0f : k == 2 ? NAN : (float)(k % 7) - 3.0f;
        }
        for (uint32_t h = 0; h < H; h++) /* the CPU step: valid samples in head order */
            if (!isnan(e[h]))
                kvt__conformal_insert(want, &n, cap, e[h]);
        uint32_t v = 0;
        for (uint32_t h = 0; h < H; h++)
            if (!isnan(e[h]) && n0 + v < cap)
                nw[v++] = e[h];
        memset(got, 0x5a, sizeof got);
        for (uint32_t t = 0; t < n0; t++)
            got[kvt__conformal_merged_old(nw, v, t, old[t])] = old[t];
        for (uint32_t j = 0; j < v; j++)
            got[kvt__conformal_merged_new(old, n0, nw, v, j)] = nw[j];
        cr_assert_eq(n, n0 + v, "case %d", it);
        cr_assert(memcmp(got, want, sizeof(float) * n) == 0, "case %d: arrays differ", it);
        merged += v > 0 && n0 > 0;
        capped += n == cap && v < H;
    }
    cr_assert(merged > 1000 && capped > 100, "merged %u, capped %u", merged, capped);
}

/* ---- RoPE recall: recall_rope_step and recall_rope_emit ------------------------------------- */

enum { RK = 2, RG = 4, RQ = RK * RG, RDIM = 128, RPR = 16, RTP = 12, RFP = 20, RSC = 512 };

/* One GQA-RoPE layer's request as the ops see it, host and device copies: a table of RTP pages
 * (keys, values), a fetch area of RFP pages after them (it holds the whole archive: dense steps), each KV head's archive (ar_n rows of
 * [K | V], sketched by the CPU backend's sketch_rows over the identity mirror), the bases, the
 * trigger's state and buffers. */
typedef struct rope_case {
    uint32_t n_rows, ar_n, ar_cap, stride, cap, rank[RK];
    size_t rb, slot, ar_row;
    kvt__div32 pdiv;
    uint8_t *plane[2], *ar;
    int32_t *pages, *fpages, *ident;
    uint16_t *csk;
    float *rho, *basis;
    /* host state and buffers (the CPU's), then the device's */
    kvt__recall_state st;
    float samples[RSC], best[RQ];
    uint32_t fired[RK * 64], n_fired[RK], overflow[RK];
    uint8_t dense;
    void *d_plane[2], *d_ar, *d_pages, *d_fpages, *d_ident, *d_csk, *d_rho, *d_basis, *d_st,
        *d_samples, *d_best, *d_fired, *d_nf, *d_ov, *d_dense, *d_q;
    /* the pruned scan's group planes (RGB-row archive blocks, every KV head's: slot b·RK + h),
     * host and device */
    void *gp[5], *d_gp[5];
    size_t gp_bytes[5];
} rope_case;

enum { RGB = 64, RGCAP = 5 }; /* archive blocks of 64 rows, room for 5 a head */

static void rope_case_make(rig *r, rope_case *c, tu_rng *g, uint32_t cap, uint32_t ar_n) {
    memset(c, 0, sizeof *c);
    c->rb = RDIM * 2;
    c->slot = RK * c->rb;
    c->ar_row = 2 * c->rb;
    c->n_rows = RTP * RPR - 5;
    c->ar_n = ar_n;
    c->ar_cap = 320;
    c->stride = 32;
    c->cap = cap;
    c->rank[0] = 32;
    c->rank[1] = 16;
    c->pdiv = kvt__div32_make(RPR);
    const size_t pool_bytes = (size_t)(RTP + RFP) * RPR * c->slot;
    for (int pl = 0; pl < 2; pl++)
        c->plane[pl] = random_pool(pool_bytes);
    c->pages = malloc(sizeof(int32_t) * (RTP + RFP));
    shuffled(c->pages, RTP + RFP);
    c->fpages = c->pages + RTP;
    c->basis = calloc((size_t)RK * c->stride * RDIM, sizeof(float));
    for (uint32_t h = 0; h < RK; h++)
        cr_assert(tu_orthonormal_rows(g, c->rank[h], RDIM, c->basis + (size_t)h * c->stride * RDIM));
    /* archive rows: in the head's span with noise, every tenth random; one NaN key */
    c->ar = random_pool((size_t)RK * c->ar_cap * c->ar_row);
    for (uint32_t h = 0; h < RK; h++)
        for (uint32_t k = 0; k < c->ar_n; k++) {
            uint8_t *x = c->ar + ((size_t)h * c->ar_cap + k) * c->ar_row;
            if (k % 10 == 0)
                continue;
            const float *V = c->basis + (size_t)h * c->stride * RDIM;
            for (uint32_t d = 0; d < RDIM; d++) {
                float v = (float)(0.05 * tu_normal(g));
                for (uint32_t j = 0; j < 8; j++)
                    v += (float)((k * 7 + j) % 5) * 0.4f * V[(size_t)j * RDIM + d];
                kvt__store_elem(x, KVT__DT_BF16, d, v);
            }
        }
    kvt__store_elem(c->ar + (size_t)17 * c->ar_row, KVT__DT_BF16, 3, NAN);
    const uint32_t n_ident = (c->ar_cap + RPR - 1) / RPR;
    c->ident = malloc(sizeof(int32_t) * n_ident);
    for (uint32_t i = 0; i < n_ident; i++)
        c->ident[i] = (int32_t)i;
    c->csk = calloc((size_t)RK * c->ar_cap * c->stride, sizeof(uint16_t));
    c->rho = calloc((size_t)RK * c->ar_cap, sizeof(float));
    for (uint32_t h = 0; h < RK; h++) {
        kvt__sketch_args sa = {.base = c->ar + (size_t)h * c->ar_cap * c->ar_row,
                               .pages = c->ident, .pdiv = &c->pdiv, .n_rows = c->ar_n,
                               .slot_stride = c->ar_row, .dtype = KVT__DT_BF16,
                               .latent_dim = RDIM,
                               .basis = c->basis + (size_t)h * c->stride * RDIM,
                               .rank = c->rank[h], .csk_stride = c->stride,
                               .csk = c->csk + (size_t)h * c->ar_cap * c->stride,
                               .rho = c->rho + (size_t)h * c->ar_cap};
        cr_assert_eq(r->cpu.ops->sketch_rows(&r->cpu, &sa, 1, NULL), KVT_OK);
    }
    c->st.z = KVT__CONFORMAL_Z_MAX;
    c->d_plane[0] = dev(r, c->plane[0], pool_bytes);
    c->d_plane[1] = dev(r, c->plane[1], pool_bytes);
    c->d_ar = dev(r, c->ar, (size_t)RK * c->ar_cap * c->ar_row);
    c->d_pages = dev(r, c->pages, sizeof(int32_t) * (RTP + RFP));
    c->d_fpages = (int32_t *)c->d_pages + RTP;
    c->d_ident = dev(r, c->ident, sizeof(int32_t) * n_ident);
    c->d_csk = dev(r, c->csk, sizeof(uint16_t) * RK * c->ar_cap * c->stride);
    c->d_rho = dev(r, c->rho, sizeof(float) * RK * c->ar_cap);
    c->d_basis = dev(r, c->basis, sizeof(float) * RK * c->stride * RDIM);
    c->d_st = dev(r, &c->st, sizeof c->st);
    c->d_samples = dev(r, c->samples, sizeof c->samples);
    c->d_best = dev(r, c->best, sizeof c->best);
    c->d_fired = dev(r, c->fired, sizeof c->fired);
    c->d_nf = dev(r, c->n_fired, sizeof c->n_fired);
    c->d_ov = dev(r, c->overflow, sizeof c->overflow);
    c->d_dense = dev(r, &c->dense, 1);
    c->d_q = dev(r, NULL, sizeof(float) * RQ * RDIM);
    const size_t slots = (size_t)RK * RGCAP, G = RGB / 32;
    const size_t gb[5] = {4 * slots * RGB, 4 * slots, 4 * slots * G, 4 * slots * G * c->stride,
                          4 * slots * G * 5};
    for (int k = 0; k < 5; k++) {
        c->gp_bytes[k] = gb[k];
        c->gp[k] = calloc(1, gb[k]);
        c->d_gp[k] = dev(r, c->gp[k], gb[k]);
    }
}

static void rope_case_free(rig *r, rope_case *c) {
    const size_t pool_bytes = (size_t)(RTP + RFP) * RPR * c->slot;
    undev(r, c->d_plane[0], pool_bytes);
    undev(r, c->d_plane[1], pool_bytes);
    undev(r, c->d_ar, (size_t)RK * c->ar_cap * c->ar_row);
    undev(r, c->d_pages, sizeof(int32_t) * (RTP + RFP));
    undev(r, c->d_ident, sizeof(int32_t) * ((c->ar_cap + RPR - 1) / RPR));
    undev(r, c->d_csk, sizeof(uint16_t) * RK * c->ar_cap * c->stride);
    undev(r, c->d_rho, sizeof(float) * RK * c->ar_cap);
    undev(r, c->d_basis, sizeof(float) * RK * c->stride * RDIM);
    undev(r, c->d_st, sizeof c->st);
    undev(r, c->d_samples, sizeof c->samples);
    undev(r, c->d_best, sizeof c->best);
    undev(r, c->d_fired, sizeof c->fired);
    undev(r, c->d_nf, sizeof c->n_fired);
    undev(r, c->d_ov, sizeof c->overflow);
    undev(r, c->d_dense, 1);
    undev(r, c->d_q, sizeof(float) * RQ * RDIM);
    for (int k = 0; k < 5; k++) {
        undev(r, c->d_gp[k], c->gp_bytes[k]);
        free(c->gp[k]);
    }
    free(c->plane[0]);
    free(c->plane[1]);
    free(c->ar);
    free(c->pages);
    free(c->ident);
    free(c->csk);
    free(c->rho);
    free(c->basis);
}

static kvt__recall_rope_args rope_args(rope_case *c, bool gpu, const float *q, int mode,
                                       bool capped) {
    kvt__recall_rope_args a = {
        .keys = gpu ? c->d_plane[0] : c->plane[0], .pages = gpu ? c->d_pages : c->pages,
        .pdiv = &c->pdiv, .slot_stride = c->slot, .row_bytes = (uint32_t)c->rb,
        .n_rows = c->n_rows, .dtype = KVT__DT_BF16, .D = RDIM, .n_kv = RK, .group = RG,
        .ar_bytes = gpu ? c->d_ar : c->ar, .ar_row_bytes = c->ar_row, .ar_cap = c->ar_cap,
        .ar_n = c->ar_n, .ar_ident = gpu ? c->d_ident : c->ident, .capped = capped,
        .csk = gpu ? c->d_csk : c->csk, .rho = gpu ? c->d_rho : c->rho,
        .csk_stride = c->stride, .basis = gpu ? c->d_basis : c->basis,
        .basis_stride = c->stride, .q = q, .best = gpu ? c->d_best : c->best, .mode = mode,
        .margin = 0.5f, .cap = c->cap, .st = gpu ? c->d_st : &c->st,
        .samples = gpu ? c->d_samples : c->samples, .sample_cap = RSC,
        .fired = gpu ? c->d_fired : c->fired, .n_fired = gpu ? c->d_nf : c->n_fired,
        .overflow = gpu ? c->d_ov : c->overflow, .dense = gpu ? c->d_dense : &c->dense,
        .g_B = RGB, .g_dim = c->stride, .g_blocks_cap = RGCAP,
        .g_perm = gpu ? c->d_gp[0] : c->gp[0], .g_n = gpu ? c->d_gp[1] : c->gp[1],
        .g_end = gpu ? c->d_gp[2] : c->gp[2], .g_centre = gpu ? c->d_gp[3] : c->gp[3],
        .g_stat = gpu ? c->d_gp[4] : c->gp[4]};
    for (uint32_t h = 0; h < RK; h++)
        a.rank[h] = c->rank[h];
    return a;
}

/* Two requests' steps of one mode in one call on both backends from the same state (one capped
 * as asked, the other not, with fewer archived rows): after each, every output equal. Then the
 * emission of the step's lists (CSR per KV head) of both in one call, both backends: chained
 * after 7 entries another list wrote (the second request's lists after the first's) on even
 * steps, at fixed offsets on odd ones (one block a request on the device): the lists and the
 * pool planes (the fetched rows copied in) equal. Returns the steps that overflowed and the
 * fired (row, head) pairs. */
enum { RN = 2 };

/* The planned ops' side of rope_pair (kvt__recall_rope_plan_args): RN trigger and emission
 * items in device memory, their count, one query buffer the items' queries are copied into. */
typedef struct rope_plan_rig {
    void *items, *emits, *n, *q;
} rope_plan_rig;

/* The device's trigger of items ga[0 .. RN) (emit false), or their emission (ge, emit true),
 * through the planned op: queries copied to item i's q_off, the items and count written, the
 * workspace reserved; the bound: the cases' shape with 320 archived rows and a capped
 * archive. */
static void rope_planned(rig *r, rope_plan_rig *pr, const rope_case *cs,
                         const kvt__recall_rope_args *ga, const kvt__recall_rope_emit_args *ge,
                         bool emit) {
    kvt__recall_rope_plan_args pa = {.items = pr->items, .emits = pr->emits, .n = pr->n,
                                     .n_emit = pr->n,
                                     .n_max = RN + 2, .query = pr->q,
                                     .query_floats = (RN + 2) * RQ * RDIM};
    pa.bound = ga[0];
    pa.bound.ar_n = 320;
    pa.bound.capped = true;
    for (uint32_t h = 0; h < RK; h++)
        pa.bound.rank[h] = 32;
    const uint32_t n = RN;
    if (emit) {
        kvt__recall_rope_emit_plan_item it[RN];
        memset(it, 0, sizeof it);
        for (int i = 0; i < RN; i++) {
            it[i].a = ge[i];
            it[i].div = *ge[i].pdiv;
            it[i].a.pdiv = NULL;
        }
        cr_assert_eq(r->gpu.ops->write(&r->gpu, pr->emits, it, sizeof it, NULL), KVT_OK);
    } else {
        kvt__recall_rope_plan_item it[RN];
        memset(it, 0, sizeof it);
        for (int i = 0; i < RN; i++) {
            cr_assert_eq(r->gpu.ops->copy(&r->gpu, (float *)pr->q + (size_t)i * RQ * RDIM,
                                          cs[i].d_q, sizeof(float) * RQ * RDIM, NULL),
                         KVT_OK);
            it[i].a = ga[i];
            it[i].div = *ga[i].pdiv;
            it[i].a.pdiv = NULL;
            it[i].a.q = NULL;
            it[i].q_off = (uint64_t)i * RQ * RDIM;
        }
        cr_assert_eq(r->gpu.ops->write(&r->gpu, pr->items, it, sizeof it, NULL), KVT_OK);
        if (r->gpu.ops->recall_rope_plan_reserve)
            cr_assert_eq(r->gpu.ops->recall_rope_plan_reserve(&r->gpu, &pa), KVT_OK);
    }
    cr_assert_eq(r->gpu.ops->write(&r->gpu, pr->n, &n, sizeof n, NULL), KVT_OK);
    cr_assert_eq(emit ? r->gpu.ops->recall_rope_emit(&r->gpu, &pa, NULL)
                      : r->gpu.ops->recall_rope_step(&r->gpu, &pa, NULL),
                 KVT_OK);
}

/* Make case c's attended rows outscore its archive for queries along u_h: per KV head a unit
 * direction orthogonal to the head's basis (its archived keys lie near that span), table rows
 * 0..3 set to 4·u_h (the other table rows stay tiny), both copies of the table. The pruned scan
 * then skips the archive's groups (its clusters score near 0, far below 8). */
static void rope_case_aim(rig *r, rope_case *c, tu_rng *g, float u[RK][RDIM]) {
    for (uint32_t h = 0; h < RK; h++) {
        double n2 = 0.0;
        for (uint32_t d = 0; d < RDIM; d++)
            u[h][d] = (float)tu_normal(g);
        const float *V = c->basis + (size_t)h * c->stride * RDIM;
        for (uint32_t k = 0; k < c->rank[h]; k++) {
            double dot = 0.0;
            for (uint32_t d = 0; d < RDIM; d++)
                dot += (double)u[h][d] * V[(size_t)k * RDIM + d];
            for (uint32_t d = 0; d < RDIM; d++)
                u[h][d] -= (float)(dot * V[(size_t)k * RDIM + d]);
        }
        for (uint32_t d = 0; d < RDIM; d++)
            n2 += (double)u[h][d] * u[h][d];
        for (uint32_t d = 0; d < RDIM; d++)
            u[h][d] = (float)(u[h][d] / sqrt(n2));
        for (uint32_t row = 0; row < 4; row++) {
            uint8_t *key = c->plane[0] + (size_t)kvt__page_slot(c->pages, 0, &c->pdiv, row) *
                                             c->slot + (size_t)h * c->rb;
            for (uint32_t d = 0; d < RDIM; d++)
                kvt__store_elem(key, KVT__DT_BF16, d, 4.0f * u[h][d]);
        }
    }
    cr_assert_eq(r->gpu.ops->write(&r->gpu, c->d_plane[0], c->plane[0],
                                   (size_t)(RTP + RFP) * RPR * c->slot, NULL),
                 KVT_OK);
}

/* planned: the device side's trigger through the planned op, and its emission too on the steps
 * whose lists are at fixed places. The second request's queries point along rope_case_aim's
 * directions (its groups are skipped); the first's at its archived keys. */
static void rope_pair(rig *r, int mode, bool capped, uint32_t cap, bool planned,
                      uint32_t *overflows, uint64_t *fired, uint32_t *grouped, uint32_t *pruned) {
    tu_rng g = {(uint64_t)mode * 131 + capped * 7 + cap};
    rope_plan_rig pr = {0};
    if (planned) {
        pr.items = dev(r, NULL, sizeof(kvt__recall_rope_plan_item) * (RN + 2));
        pr.emits = dev(r, NULL, sizeof(kvt__recall_rope_emit_plan_item) * (RN + 2));
        pr.n = dev(r, NULL, sizeof(uint32_t));
        pr.q = dev(r, NULL, sizeof(float) * (RN + 2) * RQ * RDIM);
    }
    rope_case cs[RN];
    for (int i = 0; i < RN; i++)
        rope_case_make(r, &cs[i], &g, cap, i ? 200 : 300);
    float u[RK][RDIM];
    rope_case_aim(r, &cs[1], &g, u);
    float q[RN][RQ * RDIM];
    const uint64_t per = (uint64_t)RK * (cs[0].n_rows + cs[0].ar_n);
    const uint64_t cap_idx = 7 + RN * per;
    int32_t *idx = malloc(sizeof(int32_t) * cap_idx);
    int32_t indptr[RN * RK + 1];
    void *d_idx = dev(r, NULL, sizeof(int32_t) * cap_idx), *d_ptr = dev(r, NULL, sizeof indptr);
    for (int step = 0; step < 14; step++) {
        kvt__recall_rope_args ac[RN], ag[RN];
        for (int i = 0; i < RN; i++) {
            rope_case *c = &cs[i];
            for (uint32_t t = 0; t < RQ; t++) { /* half the heads aimed at an archived key */
                const uint32_t h = t / RG, k = (uint32_t)(tu_next(&g) % c->ar_n);
                const uint8_t *key = c->ar + ((size_t)h * c->ar_cap + k) * c->ar_row;
                for (uint32_t d = 0; d < RDIM; d++) {
                    float kd = kvt__load_elem(key, KVT__DT_BF16, d);
                    q[i][t * RDIM + d] =
                        i ? 2.0f * u[h][d] + (float)(0.05 * tu_normal(&g))
                          : (float)(0.3 * tu_normal(&g)) +
                                (t % 2 && isfinite(kd) ? 0.5f * kd : 0.0f);
                }
            }
            cr_assert_eq(r->gpu.ops->write(&r->gpu, c->d_q, q[i], sizeof q[i], NULL), KVT_OK);
            const bool cp = i ? !capped : capped;
            ac[i] = rope_args(c, false, q[i], mode, cp);
            ag[i] = rope_args(c, true, c->d_q, mode, cp);
        }
        cr_assert_eq(os_rope_step(&r->cpu, ac, RN, NULL), KVT_OK);
        if (planned)
            rope_planned(r, &pr, cs, ag, NULL, false);
        else
            cr_assert_eq(os_rope_step(&r->gpu, ag, RN, NULL), KVT_OK);
        kvt__recall_rope_emit_args ec[RN], eg[RN];
        const bool chain = step % 2 == 0;
        for (int i = 0; i < RN; i++) {
            rope_case *c = &cs[i];
            same(r, c->d_best, c->best, sizeof c->best, "best");
            same(r, c->d_st, &c->st, sizeof c->st, "state");
            same(r, c->d_samples, c->samples, sizeof(float) * c->st.n_samples, "samples");
            same(r, c->d_nf, c->n_fired, sizeof c->n_fired, "n_fired");
            same(r, c->d_ov, c->overflow, sizeof c->overflow, "overflow");
            same(r, c->d_dense, &c->dense, 1, "dense");
            { /* the group planes of the blocks built (every head's), byte for byte */
                const size_t nb = c->st.n_grouped, sl = nb * RK, G = RGB / 32;
                const size_t used[5] = {4 * sl * RGB, 4 * sl, 4 * sl * G, 4 * sl * G * c->stride,
                                        4 * sl * G * 5};
                static const char *what[5] = {"group members", "group counts", "group ends",
                                              "group centres", "group statistics"};
                for (int k = 0; k < 5; k++)
                    same(r, c->d_gp[k], c->gp[k], used[k], what[k]);
                *grouped += nb > 0;
                *pruned += !c->st.last_dense && c->st.last_visited < c->st.last_archived;
            }
            for (uint32_t h = 0; h < RK; h++)
                if (c->n_fired[h])
                    same(r, (uint32_t *)c->d_fired + (size_t)h * cap, c->fired + (size_t)h * cap,
                         sizeof(uint32_t) * c->n_fired[h], "fired");
            *overflows += c->st.last_overflow;
            *fired += c->st.last_fired;
            ec[i] = (kvt__recall_rope_emit_args){
                .plane = {c->plane[0], c->plane[1]}, .n_planes = 2, .slot_stride = c->slot,
                .row_bytes = (uint32_t)c->rb, .n_kv = RK, .pages = c->pages, .pdiv = &c->pdiv,
                .n_rows = c->n_rows, .ar_bytes = c->ar, .ar_cap = c->ar_cap, .ar_n = c->ar_n,
                .fired = c->fired, .n_fired = c->n_fired, .cap = cap, .st = &c->st,
                .fetch_pages = c->fpages, .fetch_cap = RFP * RPR, .indices = idx,
                .capacity = cap_idx, .indptr = indptr + i * RK, .chain = chain,
                .out = 7 + (uint64_t)i * per, .all = step == 13,
                .capped = i ? !capped : capped};
            eg[i] = ec[i];
            eg[i].plane[0] = c->d_plane[0];
            eg[i].plane[1] = c->d_plane[1];
            eg[i].pages = c->d_pages;
            eg[i].ar_bytes = c->d_ar;
            eg[i].fired = c->d_fired;
            eg[i].n_fired = c->d_nf;
            eg[i].st = c->d_st;
            eg[i].fetch_pages = c->d_fpages;
            eg[i].indices = d_idx;
            eg[i].indptr = (int32_t *)d_ptr + i * RK;
        }
        /* fresh lists: -2 where nothing is written, so every entry compares */
        for (uint64_t j = 0; j < cap_idx; j++)
            idx[j] = -2;
        for (uint32_t j = 0; j <= RN * RK; j++)
            indptr[j] = 7;
        cr_assert_eq(r->gpu.ops->write(&r->gpu, d_idx, idx, sizeof(int32_t) * cap_idx, NULL),
                     KVT_OK);
        cr_assert_eq(r->gpu.ops->write(&r->gpu, d_ptr, indptr, sizeof indptr, NULL), KVT_OK);
        cr_assert_eq(os_rope_emit(&r->cpu, ec, RN, NULL), KVT_OK);
        /* chained lists start where the previous request's ended: in the library the pack
         * writes those offsets first (the lists' counts), here the CPU's are copied over */
        if (chain)
            cr_assert_eq(r->gpu.ops->write(&r->gpu, d_ptr, indptr, sizeof indptr, NULL), KVT_OK);
        if (planned && !chain)
            rope_planned(r, &pr, cs, ag, eg, true);
        else
            cr_assert_eq(os_rope_emit(&r->gpu, eg, RN, NULL), KVT_OK);
        same(r, d_ptr, indptr, sizeof indptr, "indptr");
        same(r, d_idx, idx, sizeof(int32_t) * cap_idx, "indices");
        for (int i = 0; i < RN; i++) {
            const size_t pool_bytes = (size_t)(RTP + RFP) * RPR * cs[i].slot;
            same(r, cs[i].d_plane[0], cs[i].plane[0], pool_bytes, "plane 0 (fetched keys)");
            same(r, cs[i].d_plane[1], cs[i].plane[1], pool_bytes, "plane 1 (fetched values)");
        }
    }
    free(idx);
    undev(r, d_idx, sizeof(int32_t) * cap_idx);
    undev(r, d_ptr, sizeof indptr);
    for (int i = 0; i < RN; i++)
        rope_case_free(r, &cs[i]);
    if (planned) {
        undev(r, pr.items, sizeof(kvt__recall_rope_plan_item) * (RN + 2));
        undev(r, pr.emits, sizeof(kvt__recall_rope_emit_plan_item) * (RN + 2));
        undev(r, pr.n, sizeof(uint32_t));
        undev(r, pr.q, sizeof(float) * (RN + 2) * RQ * RDIM);
    }
}

static void rope_pairs(bool planned) {
    rig r;
    rig_open(&r);
    uint32_t overflows = 0, grouped = 0, pruned = 0;
    uint64_t fired = 0;
    const int modes[3] = {KVT__RECALL_CONFORMAL, KVT__RECALL_SOUND, KVT__RECALL_MARGIN};
    for (int m = 0; m < 3; m++)
        for (int capped = 0; capped < 2; capped++)
            for (uint32_t cap = 3; cap <= 64; cap += 61)
                rope_pair(&r, modes[m], capped != 0, cap, planned, &overflows, &fired, &grouped,
                          &pruned);
    cr_assert_gt(overflows, 10u, "the small cap overflows");
    cr_assert_gt(fired, 100u, "rows fire");
    cr_assert_gt(grouped, 0u, "groups were built");
    cr_assert_gt(pruned, 0u, "pruned scans skipped groups");
    cr_log_info("RoPE recall%s on %s: %u overflowing steps, %llu fired (row, KV head) pairs, "
                "%u checks with groups built, %u pruned scans that skipped rows",
                planned ? " (planned ops)" : "",
                r.guarded ? "the guarded backend (self-check)" : "CUDA", overflows,
                (unsigned long long)fired, grouped, pruned);
    rig_close(&r);
}

Test(cuda, recall_rope_step_and_emit_equal_the_cpu, .timeout = 240) {
    rope_pairs(false);
}

/* The planned ops (a CUDA graph's RoPE trigger and emission): items from a plan buffer with
 * more slots than items, the launch and workspace sized by the bound. */
Test(cuda, recall_rope_planned_equals_the_cpu, .timeout = 240) {
    rope_pairs(true);
}

/* attend: the reference attention over index sets (a long set over three of the CUDA chunks, an
 * empty one, one just past a chunk, one holding a NaN row), bf16, fp32 and fp8 ds_mla rows, 4 heads. Double
 * accumulation in another order: lse to a relative 1e-10, out (fp32) by normalised error 1e-6
 * per head, NaN/Inf positions first; canary bytes around the outputs. The guarded stand-in runs
 * the CPU twin itself: byte-equal. On the device a length past topk gives NaN (the host cannot
 * refuse a device-resident set). */
static void attend_pair(rig *r, int dt) {
    enum { AK = 576, AV = 512, AH = 4, AQ = 5, ATOPK = 4100, ANS = 6001, CAN = 64 };
    const size_t eb = dt == KVT__DT_FP32 ? 4 : 2;
    const size_t stride = dt == KVT__DT_FP8 ? 656 : AK * eb; /* fp8: ds_mla rows */
    tu_rng g = {0xa11e + (uint64_t)dt};
    uint8_t *pool = malloc(stride * ANS);
    float *q = malloc(sizeof(float) * AQ * AH * AK);
    int32_t *idx = malloc(sizeof(int32_t) * AQ * ATOPK);
    for (size_t j = 0; dt == KVT__DT_FP8 && j < ANS; j++)
        tu_fp8_row(&g, pool + j * stride);
    for (size_t j = 0; dt != KVT__DT_FP8 && j < (size_t)ANS * AK; j++)
        kvt__store_elem(pool, dt, (uint32_t)j, (float)tu_normal(&g));
    if (dt == KVT__DT_FP8)
        pool[(ANS - 1) * stride + 3] = 0x7f; /* an E4M3 NaN */
    else
        kvt__store_elem(pool + (ANS - 1) * stride, dt, 3, NAN);
    for (size_t i = 0; i < (size_t)AQ * AH * AK; i++)
        q[i] = (float)(tu_normal(&g) * 1.5);
    int32_t len[AQ] = {ATOPK, 0, 2049, 10, 7};
    for (uint32_t i = 0; i < AQ; i++)
        for (uint32_t j = 0; j < ATOPK; j++)
            idx[i * ATOPK + j] = (int32_t)j < len[i] ? (int32_t)(tu_next(&g) % (ANS - 1)) : -1;
    idx[3 * ATOPK + 4] = ANS - 1;
    const size_t n_out = (size_t)AQ * AH * AV, n_lse = (size_t)AQ * AH;
    float *out = malloc(sizeof(float) * n_out), *gout = malloc(sizeof(float) * n_out);
    double *lse = malloc(sizeof(double) * n_lse), *glse = malloc(sizeof(double) * n_lse);
    kvt__attend_args c = {.base = pool, .slot_stride = stride, .dtype = dt, .key_dim = AK,
                          .value_dim = AV, .idx = idx, .len = len, .topk = ATOPK, .n_q = 4,
                          .q = q, .n_heads = AH, .q_stride = AK,
                          .scale = KVT__ATTN_DEFAULT_SCALE, .out = out, .lse = lse};
    cr_assert_eq(r->cpu.ops->attend(&r->cpu, &c, NULL), KVT_OK);
    /* query 4: a length past topk on the device only */
    const bool bad_len = !r->guarded;
    if (bad_len)
        len[4] = ATOPK + 1;
    kvt__attend_args d = c;
    d.n_q = bad_len ? 5 : 4;
    d.base = dev(r, pool, stride * ANS);
    d.q = dev(r, q, sizeof(float) * AQ * AH * AK);
    d.idx = dev(r, idx, sizeof(int32_t) * AQ * ATOPK);
    d.len = dev(r, len, sizeof len);
    uint8_t *can_o = malloc(sizeof(float) * n_out + 2 * CAN), *can_l = malloc(sizeof(double) * n_lse + 2 * CAN);
    memset(can_o, 0xa5, sizeof(float) * n_out + 2 * CAN);
    memset(can_l, 0xa5, sizeof(double) * n_lse + 2 * CAN);
    uint8_t *d_o = dev(r, can_o, sizeof(float) * n_out + 2 * CAN);
    uint8_t *d_l = dev(r, can_l, sizeof(double) * n_lse + 2 * CAN);
    d.out = (float *)(d_o + CAN);
    d.lse = (double *)(d_l + CAN);
    cr_assert_eq(r->gpu.ops->attend(&r->gpu, &d, NULL), KVT_OK);
    cr_assert_eq(r->gpu.ops->read(&r->gpu, can_o, d_o, sizeof(float) * n_out + 2 * CAN, NULL),
                 KVT_OK);
    cr_assert_eq(r->gpu.ops->read(&r->gpu, can_l, d_l, sizeof(double) * n_lse + 2 * CAN, NULL),
                 KVT_OK);
    for (size_t i = 0; i < CAN; i++) {
        cr_assert_eq(can_o[i], 0xa5, "out: canary byte %zu before written", i);
        cr_assert_eq(can_o[CAN + sizeof(float) * n_out + i], 0xa5, "out: canary after");
        cr_assert_eq(can_l[i], 0xa5, "lse: canary byte %zu before written", i);
        cr_assert_eq(can_l[CAN + sizeof(double) * n_lse + i], 0xa5, "lse: canary after");
    }
    memcpy(gout, can_o + CAN, sizeof(float) * n_out);
    memcpy(glse, can_l + CAN, sizeof(double) * n_lse);
    const size_t checked = (size_t)4 * AH;
    if (r->guarded) {
        cr_assert_eq(memcmp(gout, out, sizeof(float) * checked * AV), 0);
        cr_assert_eq(memcmp(glse, lse, sizeof(double) * checked), 0);
    }
    for (size_t k = 0; k < checked; k++) {
        const double a = lse[k], b = glse[k];
        cr_assert_eq(isnan(a), isnan(b), "lse %zu: %g vs %g", k, a, b);
        cr_assert_eq(isinf(a), isinf(b), "lse %zu: %g vs %g", k, a, b);
        if (isfinite(a))
            cr_assert(fabs(a - b) <= 1e-10 * (1 + fabs(a)), "lse %zu: %.17g vs %.17g", k, a, b);
        double e = 0, m = 0;
        for (size_t v = 0; v < AV; v++) {
            const float x = out[k * AV + v], y = gout[k * AV + v];
            cr_assert_eq(isnan(x), isnan(y), "out %zu/%zu: %g vs %g", k, v, x, y);
            cr_assert_eq(isinf(x), isinf(y), "out %zu/%zu: %g vs %g", k, v, x, y);
            if (isfinite(x)) {
                e += ((double)x - y) * ((double)x - y);
                m += (double)x * x;
            }
        }
        cr_assert(e <= 1e-12 * m, "out %zu: normalised error %g", k, m > 0 ? sqrt(e / m) : e);
        if (k / AH == 1)
            cr_assert(m == 0 && isinf(a) && a < 0, "an empty set gives 0 and -Inf");
        if (k / AH == 3)
            cr_assert(isnan(a), "a NaN row gives NaN");
    }
    if (bad_len)
        for (size_t k = 4 * AH; k < 5 * AH; k++)
            cr_assert(isnan(glse[k]) && isnan(gout[k * AV]), "a length past topk gives NaN");
    undev(r, (void *)d.base, stride * ANS);
    undev(r, (void *)d.q, sizeof(float) * AQ * AH * AK);
    undev(r, (void *)d.idx, sizeof(int32_t) * AQ * ATOPK);
    undev(r, (void *)d.len, sizeof len);
    undev(r, d_o, sizeof(float) * n_out + 2 * CAN);
    undev(r, d_l, sizeof(double) * n_lse + 2 * CAN);
    free(pool);
    free(q);
    free(idx);
    free(out);
    free(gout);
    free(lse);
    free(glse);
    free(can_o);
    free(can_l);
}

Test(cuda, attend_equals_the_cpu, .timeout = 120) {
    rig r;
    rig_open(&r);
    attend_pair(&r, KVT__DT_BF16);
    attend_pair(&r, KVT__DT_FP32);
    attend_pair(&r, KVT__DT_FP8);
    rig_close(&r);
}

/* ------------------------------------------------------------------------------------------------
 * The backend's own discipline around its ops (each found by the CUDA emulation,
 * docs/cuda-emulation.md): a refused op enqueues nothing; growing the workspace inside an op,
 * and find_pos, leave another thread's capture alone; a planned op never grows its workspace.
 * ---------------------------------------------------------------------------------------------- */

/* score_rows and select refuse a bad item of their second chunk (item 64) before enqueuing
 * anything: the first chunk's outputs stay as they were (both returned from inside their chunk
 * loop, after op_begin and the first chunk's launch, without op_end). */
Test(cuda, refused_score_rows_and_select_enqueue_nothing) {
    rig r;
    rig_open(&r);
    if (r.guarded) { /* the CPU ops score the items before a bad one */
        rig_close(&r);
        cr_skip_test("the CUDA backend's refusal: a device (or the CUDA emulation) only");
    }
    enum { N = 65, ROWS = 64 };
    int32_t pages[1] = {0};
    uint8_t *dpool = dev(&r, NULL, (size_t)ROWS * 1152);
    int32_t *dpages = dev(&r, pages, sizeof pages);
    kvt__div32 pdiv = kvt__div32_make(ROWS);
    float sentinel[ROWS];
    for (uint32_t u = 0; u < ROWS; u++)
        sentinel[u] = -7.0f;
    kvt__score_args sa[N];
    float *dout[N];
    for (uint32_t i = 0; i < N; i++) {
        dout[i] = dev(&r, sentinel, sizeof sentinel);
        sa[i] = (kvt__score_args){.selector = KVT_SELECT_RANDOM, .base = dpool, .pages = dpages,
                                  .pdiv = &pdiv, .n_rows = ROWS, .slot_stride = 1152,
                                  .branch_offset = 1024, .branch_dtype = KVT__DT_BF16,
                                  .branch_dim = 64, .dtype = KVT__DT_BF16, .n_values = 576,
                                  .key = 77, .subseq = i, .out = dout[i]};
    }
    sa[N - 1].selector = KVT_SELECT_SIGMA; /* fewer rows than a σ leaf: unsupported */
    sa[N - 1].n_rows = KVT__SIGMA_LEAF_ROWS - 1;
    cr_assert_eq(r.gpu.ops->score_rows(&r.gpu, sa, N, NULL), KVT_ERR_UNSUPPORTED);
    same(&r, dout[0], sentinel, sizeof sentinel, "a refused score_rows' first item");
    /* select: segment 64 has more shared head rows than closed rows */
    kvt__select_args ga[N];
    uint32_t kept0[4] = {9, 9, 9, 9};
    float sc[ROWS];
    for (uint32_t u = 0; u < ROWS; u++)
        sc[u] = (float)u;
    float *dsc = dev(&r, sc, sizeof sc);
    uint32_t *dkept[N];
    for (uint32_t i = 0; i < N; i++) {
        dkept[i] = dev(&r, kept0, sizeof kept0);
        ga[i] = (kvt__select_args){.score = dsc, .first_new = ROWS, .n_closed = ROWS, .m = 4,
                                   .sinks = 0, .kept = dkept[i]};
    }
    ga[N - 1].n_head = ROWS + 1;
    ga[N - 1].score_head = dsc;
    cr_assert_eq(r.gpu.ops->select(&r.gpu, ga, N, NULL), KVT_ERR_INVALID_ARGUMENT);
    same(&r, dkept[0], kept0, sizeof kept0, "a refused select's first segment");
    for (uint32_t i = 0; i < N; i++) {
        undev(&r, dout[i], sizeof sentinel);
        undev(&r, dkept[i], sizeof kept0);
    }
    undev(&r, dsc, sizeof sc);
    undev(&r, dpool, (size_t)ROWS * 1152);
    undev(&r, dpages, sizeof pages);
    rig_close(&r);
}

#if KVT_HAVE_CUDA
/* A capture of `mode` on a stream of the test's own, begun and ended by another thread (a
 * capture's mode says whose unsafe calls break it) while the main thread works. */
typedef struct side_capture {
    cudaStream_t s;
    enum cudaStreamCaptureMode mode;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stage; /* 1 begun, 2 end it */
    cudaError_t begin, end;
} side_capture;

static void *side_capture_run(void *p) {
    side_capture *c = p;
    c->begin = cudaStreamBeginCapture(c->s, c->mode);
    pthread_mutex_lock(&c->mu);
    c->stage = 1;
    pthread_cond_broadcast(&c->cv);
    while (c->stage != 2)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    cudaGraph_t g = NULL;
    c->end = cudaStreamEndCapture(c->s, &g);
    if (g)
        cudaGraphDestroy(g);
    (void)cudaGetLastError();
    return NULL;
}

/* fn(arg) while a capture of `mode` runs on a stream of `flags` in another thread: whether that
 * capture survived. */
static bool capture_survives(enum cudaStreamCaptureMode mode, unsigned flags, void (*fn)(void *),
                             void *arg) {
    side_capture c = {.mode = mode};
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    cr_assert_eq(cudaStreamCreateWithFlags(&c.s, flags), cudaSuccess);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, side_capture_run, &c), 0);
    pthread_mutex_lock(&c.mu);
    while (c.stage != 1)
        pthread_cond_wait(&c.cv, &c.mu);
    pthread_mutex_unlock(&c.mu);
    cr_assert_eq(c.begin, cudaSuccess);
    fn(arg);
    pthread_mutex_lock(&c.mu);
    c.stage = 2;
    pthread_cond_broadcast(&c.cv);
    pthread_mutex_unlock(&c.mu);
    pthread_join(t, NULL);
    cudaStreamDestroy(c.s);
    pthread_mutex_destroy(&c.mu);
    pthread_cond_destroy(&c.cv);
    return c.end == cudaSuccess;
}

typedef struct grow_ctx {
    rig *r;
    kvt__score_args *a;
    cudaStream_t s;
    kvt_status st;
} grow_ctx;

static void grow_score(void *p) {
    grow_ctx *g = p;
    g->st = g->r->gpu.ops->score_rows(&g->r->gpu, g->a, 1, g->s);
}

typedef struct find_ctx {
    rig *r;
    const int64_t *sorted;
    const uint64_t *perm;
    int64_t got;
    kvt_status st;
} find_ctx;

static void find_one(void *p) {
    find_ctx *f = p;
    f->st = f->r->gpu.ops->find_pos(&f->r->gpu, f->sorted, f->perm, 3, 20, &f->got);
}
#endif

/* A handle's first σ grows its workspace inside the op while another thread captures a stream in
 * global mode: that capture survives (the growth was cudaDeviceSynchronize + cudaFree +
 * cudaMalloc, unsafe calls that invalidate it, their status ignored). find_pos while another
 * thread captures a blocking stream in thread-local mode: likewise (its k_find ran on the legacy
 * stream, which would depend on every blocking stream). */
Test(cuda, workspace_growth_and_find_pos_leave_a_capture_alone) {
#if KVT_HAVE_CUDA
    rig r;
    rig_open(&r);
    if (r.guarded) { /* the guarded stand-in has no CUDA streams */
        rig_close(&r);
        cr_skip_test("the CUDA runtime's captures: a device (or the CUDA emulation) only");
    }
    const uint32_t B = 64, NB = 7;
    uint8_t *pool = random_pool((size_t)B * 1152);
    int32_t pages[1] = {0};
    float *basis = malloc(sizeof(float) * NB * B);
    cr_assert_eq(kvt__fourier_basis(B, 4, basis), 0);
    kvt__div32 pdiv = kvt__div32_make(B);
    kvt__score_args a = {.selector = KVT_SELECT_SIGMA, .base = dev(&r, pool, (size_t)B * 1152),
                         .pages = dev(&r, pages, sizeof pages), .pdiv = &pdiv, .n_rows = B,
                         .slot_stride = 1152, .branch_offset = 1024,
                         .branch_dtype = KVT__DT_BF16, .branch_dim = 64, .dtype = KVT__DT_BF16,
                         .n_values = 576, .basis = dev(&r, basis, sizeof(float) * NB * B),
                         .n_basis = NB, .out = dev(&r, NULL, sizeof(float) * B)};
    grow_ctx g = {.r = &r, .a = &a};
    cr_assert_eq(cudaStreamCreateWithFlags(&g.s, cudaStreamNonBlocking), cudaSuccess);
    cr_assert(capture_survives(cudaStreamCaptureModeGlobal, cudaStreamNonBlocking, grow_score, &g),
              "a global capture on another stream was invalidated by the workspace's growth");
    cr_assert_eq(g.st, KVT_OK, "%s", r.gpu.ops->last_error(&r.gpu));
    cr_assert_eq(cudaStreamSynchronize(g.s), cudaSuccess);
    cudaStreamDestroy(g.s);
    const int64_t sorted[3] = {10, 20, 30};
    const uint64_t perm[3] = {0, 1, 2};
    find_ctx f = {.r = &r, .sorted = dev(&r, sorted, sizeof sorted),
                  .perm = dev(&r, perm, sizeof perm)};
    cr_assert(capture_survives(cudaStreamCaptureModeThreadLocal, cudaStreamDefault, find_one, &f),
              "a capture of a blocking stream by another thread was invalidated by find_pos");
    cr_assert_eq(f.st, KVT_OK);
    cr_assert_eq(f.got, kvt__find_pos(sorted, perm, 3, 20));
    undev(&r, (void *)f.sorted, sizeof sorted);
    undev(&r, (void *)f.perm, sizeof perm);
    undev(&r, (void *)a.base, (size_t)B * 1152);
    undev(&r, (void *)a.pages, sizeof pages);
    undev(&r, (void *)a.basis, sizeof(float) * NB * B);
    undev(&r, a.out, sizeof(float) * B);
    free(pool);
    free(basis);
    rig_close(&r);
#else
    if (getenv("KVT_REQUIRE_GPU"))
        cr_assert_fail("KVT_REQUIRE_GPU set in a build without CUDA");
    cr_skip_test("built without CUDA");
#endif
}

/* A planned op whose workspace is larger than its reservation is refused (BAD_STATE, saying so)
 * and grows nothing (it grew with a device synchronisation: a captured graph holds the planned
 * workspace's address). */
Test(cuda, planned_step_past_its_reservation_is_refused) {
    rig r;
    rig_open(&r);
    if (r.guarded) {
        rig_close(&r);
        cr_skip_test("the CUDA backend's planned workspace: a device (or the CUDA emulation) only");
    }
    uint32_t zero = 0;
    kvt__recall_plan_args pa = {.items = dev(&r, NULL, sizeof(kvt__recall_plan_item)),
                                .n = dev(&r, &zero, sizeof zero), .n_max = 1,
                                .query = dev(&r, NULL, sizeof(float) * 16 * 576),
                                .query_floats = 16 * 576};
    kvt__recall_plan_bound(16, 64, 512, 64, 4096, 0, 128, &pa.bound);
    cr_assert_eq(r.gpu.ops->recall_plan_reserve(&r.gpu, &pa), KVT_OK);
    cr_assert_eq(r.gpu.ops->recall_step(&r.gpu, &pa, NULL), KVT_OK);
    kvt__recall_plan_args big = pa;
    kvt__recall_plan_bound(16, 64, 512, 64, 8192, 0, 128, &big.bound);
    cr_assert_eq(r.gpu.ops->recall_step(&r.gpu, &big, NULL), KVT_ERR_BAD_STATE);
    const char *e = r.gpu.ops->last_error(&r.gpu);
    cr_assert(e && strstr(e, "larger than its reservation"), "%s", e ? e : "(none)");
    undev(&r, (void *)pa.items, sizeof(kvt__recall_plan_item));
    undev(&r, (void *)pa.n, sizeof zero);
    undev(&r, (void *)pa.query, sizeof(float) * 16 * 576);
    rig_close(&r);
}
