/*
 * bench_ops.c — two ops of the backend table on a chosen backend (cpu, guarded, cuda), each
 * beside the copy floor of its bytes measured in the same run through the same backend's copy op
 * (a device-to-device copy on CUDA, memcpy on the CPU backends):
 *   1. a salience close: σ of one block of B = 4096 MLA rows (score_rows: the 64-dim bf16 branch
 *      projected on 2κ − 1 = 31 Fourier columns) then the global top-m of a request's closed rows
 *      (select: 32,768 closed, m = 1,024, one segment) — the CUDA issue's goal is < 50 µs on an
 *      H200; floor: a copy of the block's branch bytes (what σ must read);
 *   2. a random-eviction round of 8 GQA layers x 8 KV heads x 128 dims bf16 (K = 1,024,
 *      r = c = 64: the round fires at 1,152 rows), per-head draws, without VaSE (the default)
 *      and with it, evicted rows dropped (ev_select then ev_apply, both over the 8 layers in one
 *      call each) — goal ≤ 1.1x the compaction floor; floor: a copy of the bytes the kept rows
 *      hold (K + r rows, both planes, every layer: what any compaction must move at most).
 * Each figure: the best and the worst of `reps` repetitions (wall time from the first op's
 * enqueue to the stream's completion; on CUDA also the device time between two events around
 * the ops), the inputs restored before each (untimed). Usage: bench_ops [cpu|guarded|cuda] [reps]
 */
#include "kernels/backend.h"
#include "kernels/evict.h"
#include "kernels/sigma.h"
#include "lib/base/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_util.h"

#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static void die(kvt_status s, const char *what) {
    fprintf(stderr, "bench_ops: %s: %s\n", what, kvt_status_name(s));
    exit(1);
}

/* The backend and its stream (CUDA: a non-blocking stream; NULL on the CPU backends). */
typedef struct rig {
    kvt__alloc a;
    kvt__backend be;
    void *stream;
    bool cuda;
#if KVT_HAVE_CUDA
    cudaEvent_t e0, e1;
#endif
} rig;

static bool rig_open(rig *r, const char *name) {
    memset(r, 0, sizeof *r);
    if (kvt__alloc_init(&r->a, KVT_ALLOC_LIBC) != KVT_OK)
        die(KVT_ERR_OUT_OF_MEMORY, "allocator");
    r->be.alloc = &r->a;
    char why[256] = "";
    kvt_status s;
    if (strcmp(name, "cuda") == 0) {
        if ((s = kvt__backend_cuda_open(&r->be, why, sizeof why)) != KVT_OK) {
            printf("bench_ops: cuda backend unavailable: %s: nothing measured\n", why);
            return false;
        }
        r->cuda = true;
#if KVT_HAVE_CUDA
        cudaStream_t cs;
        if (cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess ||
            cudaEventCreate(&r->e0) != cudaSuccess || cudaEventCreate(&r->e1) != cudaSuccess)
            die(KVT_ERR_NO_DEVICE, "stream and events");
        r->stream = cs;
#endif
    } else if (strcmp(name, "guarded") == 0) {
        if ((s = kvt__backend_guarded_open(&r->be, why, sizeof why)) != KVT_OK)
            die(s, why);
    } else if ((s = kvt__backend_cpu_open(&r->be)) != KVT_OK) {
        die(s, "cpu backend");
    }
    return true;
}

static void rig_close(rig *r) {
#if KVT_HAVE_CUDA
    if (r->cuda) {
        cudaEventDestroy(r->e0);
        cudaEventDestroy(r->e1);
        cudaStreamDestroy((cudaStream_t)r->stream);
    }
#endif
    if (r->cuda)
        kvt__backend_cuda_close(&r->be);
    else
        kvt__backend_cpu_close(&r->be);
    kvt__alloc_fini(&r->a);
}

static void *dev(rig *r, const void *host, size_t bytes) {
    void *p = NULL;
    kvt_status s = r->be.ops->buf_alloc(&r->be, bytes, &p);
    if (s == KVT_OK && host)
        s = r->be.ops->write(&r->be, p, host, bytes, r->stream);
    if (s != KVT_OK)
        die(s, "device buffer");
    return p;
}

static void undev(rig *r, void *p, size_t bytes) {
    r->be.ops->buf_free(&r->be, p, bytes);
}

/* A timed section: start, then stop after the ops were enqueued (waits for the stream); wall
 * and (CUDA) device seconds. */
static double t_wall;
static void tic(rig *r) {
#if KVT_HAVE_CUDA
    if (r->cuda) {
        cudaStreamSynchronize((cudaStream_t)r->stream);
        cudaEventRecord(r->e0, (cudaStream_t)r->stream);
    }
#endif
    (void)r;
    t_wall = now_s();
}

static void toc(rig *r, double *wall, double *device) {
    *device = 0;
#if KVT_HAVE_CUDA
    if (r->cuda) {
        cudaEventRecord(r->e1, (cudaStream_t)r->stream);
        if (cudaStreamSynchronize((cudaStream_t)r->stream) != cudaSuccess)
            die(KVT_ERR_NO_DEVICE, "stream");
        float ms = 0;
        cudaEventElapsedTime(&ms, r->e0, r->e1);
        *device = ms * 1e-3;
    }
#endif
    *wall = now_s() - t_wall;
}

typedef struct range {
    double lo, hi, dlo, dhi;
} range;

static void take(range *g, double w, double d) {
    g->lo = w < g->lo ? w : g->lo;
    g->hi = w > g->hi ? w : g->hi;
    g->dlo = d < g->dlo ? d : g->dlo;
    g->dhi = d > g->dhi ? d : g->dhi;
}

static range range_new(void) {
    return (range){1e30, 0, 1e30, 0};
}

/* The copy floor of `bytes` through the backend's copy op, best and worst of reps. */
static range copy_floor(rig *r, size_t bytes, int reps) {
    void *a = dev(r, NULL, bytes), *b = dev(r, NULL, bytes);
    range g = range_new();
    for (int k = 0; k < reps; k++) {
        double w, d;
        tic(r);
        kvt_status s = r->be.ops->copy(&r->be, b, a, bytes, r->stream);
        if (s != KVT_OK)
            die(s, "copy");
        toc(r, &w, &d);
        take(&g, w, d);
    }
    undev(r, a, bytes);
    undev(r, b, bytes);
    return g;
}

static void print(const char *what, range op, range floor, bool cuda) {
    printf("%-30s %9.1f - %9.1f us wall = %6.2f - %6.2f x the floor's best (%.1f us)\n", what,
           op.lo * 1e6, op.hi * 1e6, op.lo / floor.lo, op.hi / floor.lo, floor.lo * 1e6);
    if (cuda)
        printf("%-30s %9.1f - %9.1f us device = %6.2f - %6.2f x the floor's best (%.1f us)\n",
               "", op.dlo * 1e6, op.dhi * 1e6, op.dlo / floor.dlo, op.dhi / floor.dlo,
               floor.dlo * 1e6);
}

static uint8_t *random_bf16(size_t bytes) {
    uint8_t *p = malloc(bytes);
    for (size_t i = 0; i + 1 < bytes; i += 2) {
        uint16_t v = (uint16_t)(0x3c00u + (rnd() & 0x3ffu)) ^ (uint16_t)((rnd() & 1u) << 15);
        memcpy(p + i, &v, 2);
    }
    return p;
}

static void shuffled(int32_t *pages, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        pages[i] = (int32_t)i;
    for (uint32_t i = n - 1; i > 0; i--) {
        uint32_t j = (uint32_t)(rnd() % (i + 1));
        int32_t t = pages[i];
        pages[i] = pages[j];
        pages[j] = t;
    }
}

/* 1. σ of one block + the top-m of every closed row. */
static void bench_close(rig *r, int reps) {
    enum { B = 4096, PR = 64, KAPPA = 16, NB = 2 * KAPPA - 1, NCLOSED = 32768, M = 1024 };
    const size_t slot = 1152, pool = (size_t)NCLOSED * slot;
    uint8_t *rows = random_bf16(pool);
    int32_t pages[NCLOSED / PR];
    shuffled(pages, NCLOSED / PR);
    float *basis = malloc(sizeof(float) * NB * B), *score = malloc(sizeof(float) * NCLOSED);
    if (kvt__fourier_basis(B, KAPPA, basis) != 0)
        die(KVT_ERR_INVALID_ARGUMENT, "basis");
    for (uint32_t u = 0; u < NCLOSED; u++)
        score[u] = (float)(rnd() >> 40);
    kvt__div32 pdiv = kvt__div32_make(PR);
    uint8_t *d_rows = dev(r, rows, pool);
    int32_t *d_pages = dev(r, pages, sizeof pages);
    float *d_basis = dev(r, basis, sizeof(float) * NB * B);
    float *d_score = dev(r, score, sizeof(float) * NCLOSED);
    float *d_saved = dev(r, score, sizeof(float) * NCLOSED);
    uint32_t *d_kept = dev(r, NULL, sizeof(uint32_t) * M);
    const uint64_t first = NCLOSED - B; /* the closing block: the last one */
    kvt__score_args sa = {.selector = KVT_SELECT_SIGMA, .base = d_rows, .pages = d_pages,
                          .first_page = 0, .pdiv = &pdiv, .first_row = first, .n_rows = B,
                          .slot_stride = slot, .branch_offset = 1024,
                          .branch_dtype = KVT__DT_BF16, .branch_dim = 64,
                          .dtype = KVT__DT_BF16, .n_values = 576, .basis = d_basis,
                          .n_basis = NB, .out = d_score + first};
    range g = range_new();
    for (int k = 0; k < reps + 1; k++) {
        kvt_status s = r->be.ops->copy(&r->be, d_score, d_saved, sizeof(float) * NCLOSED,
                                       r->stream);
        kvt__select_args se = {.score = d_score, .first_new = first, .n_closed = NCLOSED,
                               .m = M, .sinks = 4, .kept = d_kept};
        double w, d;
        tic(r);
        if (s == KVT_OK)
            s = r->be.ops->score_rows(&r->be, &sa, 1, r->stream);
        if (s == KVT_OK)
            s = r->be.ops->select(&r->be, &se, 1, r->stream);
        if (s != KVT_OK)
            die(s, "close");
        toc(r, &w, &d);
        if (k) /* the first one warms the workspace */
            take(&g, w, d);
    }
    const range floor = copy_floor(r, (size_t)B * 128, reps); /* the block's branch bytes */
    printf("close: sigma of %u rows (kappa %u) + top-%u of %u closed rows, %d reps\n", B, KAPPA,
           M, NCLOSED, reps);
    print("  sigma + top-m", g, floor, r->cuda);
    undev(r, d_rows, pool);
    undev(r, d_pages, sizeof pages);
    undev(r, d_basis, sizeof(float) * NB * B);
    undev(r, d_score, sizeof(float) * NCLOSED);
    undev(r, d_saved, sizeof(float) * NCLOSED);
    undev(r, d_kept, sizeof(uint32_t) * M);
    free(rows);
    free(basis);
    free(score);
}

/* 2. A round of L layers, one ev_select and one ev_apply call over all of them. */
static void bench_round(rig *r, int reps, bool vase) {
    enum { L = 8, H = 8, D = 128, K = 1024, R = 64, C = 64, N = K + R + C, PR = 64,
           NP = N / PR + 1 };
    const uint32_t row_bytes = D * 2;
    const size_t slot = (size_t)H * row_bytes, plane = (size_t)NP * PR * slot;
    const uint64_t pos_cap = NP * PR;
    int32_t pages[NP];
    shuffled(pages, NP);
    kvt__div32 pdiv = kvt__div32_make(PR);
    int32_t *d_pages = dev(r, pages, sizeof pages);
    kvt__ev_args a[L];
    kvt__ev_append_args ap[L];
    uint8_t *saved[L][2];
    for (uint32_t l = 0; l < L; l++) {
        a[l] = (kvt__ev_args){.n_planes = 2, .slot_bytes = slot, .row_bytes = row_bytes,
                              .n_heads = H, .dtype = KVT__DT_BF16, .value_dim = D,
                              .value_plane = 1, .pages = d_pages, .first_page = 0,
                              .pdiv = &pdiv, .pos_cap = pos_cap, .N = N, .K = K, .r = R,
                              .L = 4, .vase = vase, .philox_key = 0x5eed, .round = 0,
                              .layer = l, .head_offset = l * H, .shared_draw = false};
        for (int p = 0; p < 2; p++) {
            uint8_t *host = random_bf16(plane);
            a[l].plane[p] = dev(r, host, plane);
            saved[l][p] = dev(r, host, plane);
            free(host);
        }
        a[l].pos = dev(r, NULL, sizeof(int64_t) * H * pos_cap);
        a[l].keep = dev(r, NULL, sizeof(uint32_t) * H * K);
        a[l].map = dev(r, NULL, sizeof(int32_t) * H * N);
        ap[l] = (kvt__ev_append_args){.pos = a[l].pos, .pos_cap = pos_cap, .n_heads = H,
                                      .first_row = 0, .first_pos = 0, .n = N};
    }
    range g = range_new();
    for (int k = 0; k < reps + 1; k++) {
        kvt_status s = r->be.ops->ev_append(&r->be, ap, L, r->stream);
        for (uint32_t l = 0; s == KVT_OK && l < L; l++)
            for (int p = 0; s == KVT_OK && p < 2; p++)
                s = r->be.ops->copy(&r->be, a[l].plane[p], saved[l][p], plane, r->stream);
        double w, d;
        tic(r);
        if (s == KVT_OK)
            s = r->be.ops->ev_select(&r->be, a, L, r->stream);
        if (s == KVT_OK)
            s = r->be.ops->ev_apply(&r->be, a, L, r->stream);
        if (s != KVT_OK)
            die(s, "round");
        toc(r, &w, &d);
        if (k)
            take(&g, w, d);
    }
    const size_t kept = (size_t)(K + R) * slot * 2 * L;
    const range floor = copy_floor(r, kept, reps);
    printf("round: %u layers x %u heads x %u bf16, K %u, r = c = %u, per-head draws%s, "
           "dropped, %d reps; floor: a copy of the kept rows (%.1f MB)\n",
           L, H, D, K, R, vase ? " + VaSE" : "", reps, kept / 1e6);
    print("  ev_select + ev_apply", g, floor, r->cuda);
    for (uint32_t l = 0; l < L; l++) {
        for (int p = 0; p < 2; p++) {
            undev(r, a[l].plane[p], plane);
            undev(r, saved[l][p], plane);
        }
        undev(r, a[l].pos, sizeof(int64_t) * H * pos_cap);
        undev(r, a[l].keep, sizeof(uint32_t) * H * K);
        undev(r, a[l].map, sizeof(int32_t) * H * N);
    }
    undev(r, d_pages, sizeof pages);
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "cpu";
    const int reps = argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 5;
    rig r;
    if (!rig_open(&r, name))
        return 0;
    printf("bench_ops: %s backend\n", r.be.ops->name);
    bench_close(&r, reps);
    bench_round(&r, reps, false);
    bench_round(&r, reps, true);
    rig_close(&r);
    return 0;
}
