/*
 * test_cuda.c — every op of the CUDA backend against its CPU twin on the same random inputs,
 * bit for bit: select (segmented top-m with NaN/Inf and ties), score_rows (σ and the norm and
 * random selectors over a shuffled page table), pack (TOKENS and CSR), ev_append, ev_select and
 * ev_apply (per-head and shared keep sets, VaSE, with and without the archive), find_pos, and
 * the buffer copies. Without a device every test skips with the reason (KVT_REQUIRE_GPU=1 turns
 * the skip into a failure: scripts/gpu-check.sh sets it; KVT_CUDA_TEST_SELFCHECK=1 runs the tests
 * with the guarded backend in CUDA's place, which checks the tests themselves). The golden suite
 * (test_golden) drives whole scenarios on the CUDA backend; this one says which op differs.
 */
#include <criterion/criterion.h>

#include "kernels/backend.h"
#include "kernels/evict.h"
#include "kernels/sigma.h"
#include "lib/base/alloc.h"
#include "support/testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* A device copy of host bytes. */
static void *dev(rig *r, const void *host, size_t bytes) {
    void *p = NULL;
    cr_assert_eq(r->gpu.ops->buf_alloc(&r->gpu, bytes ? bytes : 1, &p), KVT_OK);
    if (bytes)
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
        kvt__pack_args pc = {.q = qc, .n = NQ, .pdiv = &pdiv, .csr = csr, .first_csr = true,
                             .indices = idx, .lengths = csr ? NULL : len,
                             .indptr = csr ? len : NULL};
        kvt__pack_args pg = pc;
        pg.q = qg;
        pg.indices = didx;
        pg.lengths = csr ? NULL : dlen;
        pg.indptr = csr ? dlen : NULL;
        cr_assert_eq(r.cpu.ops->pack(&r.cpu, &pc, NULL), KVT_OK);
        cr_assert_eq(r.gpu.ops->pack(&r.gpu, &pg, NULL), KVT_OK);
        same(&r, didx, idx, 4 * n_idx, "indices");
        same(&r, dlen, len, 4 * (csr ? NQ + 1 : NQ), csr ? "indptr" : "lengths");
        undev(&r, didx, 4 * n_idx);
        undev(&r, dlen, 4 * (NQ + 1));
        free(idx);
        free(len);
    }
    undev(&r, dpages, sizeof pages);
    undev(&r, dlist, sizeof list);
    rig_close(&r);
}

/* One layer's round on both backends: append, select, apply; every array compared. */
static void round_pair(rig *r, uint32_t H, bool shared, bool vase, bool archive) {
    const uint32_t PR = 16, K = 96, R = 16, C = 16, N = K + R + C, NP = 16;
    const uint32_t row_bytes = 64, n_planes = 2;
    const size_t slot = (size_t)H * row_bytes, plane = (size_t)NP * PR * slot;
    const uint64_t AR_CAP = 64, pos_cap = 256;
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
    /* a prior archive of 8 rows per head at odd positions beyond the table's */
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t k = 0; k < 8; k++) {
            arp[h * AR_CAP + k] = 1001 + 2 * (7 - k);
            arq[h * AR_CAP + k] = 7 - k;
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
                      .ar_n = 8, .ar_cap = AR_CAP, .N = N, .K = K, .r = R, .L = 6, .vase = vase,
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
            int64_t kc = kvt__find_pos(arp + h * AR_CAP, arq + h * AR_CAP, 8 + N - R - K, 1003),
                    kg = -2;
            cr_assert_eq(r->gpu.ops->find_pos(&r->gpu, d_arp + h * AR_CAP, d_arq + h * AR_CAP,
                                              8 + N - R - K, 1003, &kg),
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
        round_pair(&r, v & 1 ? 8 : 1, v & 2, v & 4, v % 3 != 0);
    rig_close(&r);
}
