/*
 * bench_compact.c — the compaction of a random-eviction round alone (the CPU twin of the
 * backend's ev_apply, kernels/evict_cpu.c, without the archive), against memcpy of the bytes it
 * writes, measured side by side in one run:
 *   - slot-major (what ev_apply does): destination rows in ascending order, each destination
 *     slot filled head by head;
 *   - head-major (what the round did before Core v2 part 2, re-implemented here for the
 *     comparison): each head's survivors moved on their own, head after head;
 * for per-head keep sets (GQA, per-head draws) and one shared keep set (whole slots move).
 * 8 GQA layers x 8 KV heads x 128 dims bf16, K + r + c = 1024 + 64 + 64 rows, two planes, pages
 * of 64 rows in a shuffled order (as a pool hands them out after churn): 37 MB of kept rows, more
 * than the last-level cache. The rows are restored before each repetition (not timed). Each
 * figure is the best of `reps` repetitions. Usage: bench_compact [reps]
 */
#include "kernels/evict.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench_util.h"

enum { L = 8, H = 8, D = 128, K = 1024, R = 64, C = 64, PR = 64 };
#define NROWS (K + R + C)
#define ROW_BYTES (D * 2)
#define SLOT_BYTES (H * ROW_BYTES)

/* K of the cand candidates, ascending (Floyd's sampling then a mark pass). */
static void random_keep(uint32_t *keep, uint32_t cand) {
    uint8_t *mark = calloc(cand, 1);
    for (uint32_t j = cand - K; j < cand; j++) {
        uint32_t t = (uint32_t)(rnd() % (j + 1));
        if (mark[t])
            t = j;
        mark[t] = 1;
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < cand; i++)
        if (mark[i])
            keep[k++] = i;
    free(mark);
}

typedef struct layer {
    uint8_t *plane[2], *orig[2];
    int64_t *pos;
    uint32_t *keep;
    int32_t *map;
} layer;

static const int32_t *g_pages;
static kvt__div32 g_pdiv;

static kvt__ev_args args_of(layer *l) {
    kvt__ev_args a = {.plane = {l->plane[0], l->plane[1]},
                      .n_planes = 2,
                      .slot_bytes = SLOT_BYTES,
                      .row_bytes = ROW_BYTES,
                      .n_heads = H,
                      .pages = g_pages,
                      .first_page = 0,
                      .pdiv = &g_pdiv,
                      .pos = l->pos,
                      .pos_cap = NROWS,
                      .keep = l->keep,
                      .map = l->map,
                      .N = NROWS,
                      .K = K,
                      .r = R};
    return a;
}

static uint8_t *at(uint8_t *base, uint32_t row) {
    return base + (size_t)kvt__page_slot(g_pages, 0, &g_pdiv, row) * SLOT_BYTES;
}

/* The former order: head by head, each head's moves in ascending destination order. */
static void head_major(layer *l, bool same) {
    const uint32_t cand = NROWS - R;
    for (int p = 0; p < 2; p++)
        for (uint32_t h = 0; h < (same ? 1u : (uint32_t)H); h++) {
            const uint32_t *kh = l->keep + (size_t)h * K;
            for (uint32_t j = 0; j < K + R; j++) {
                uint32_t o = j < K ? kh[j] : cand + (j - K);
                if (o == j)
                    continue;
                size_t off = same ? 0 : (size_t)h * ROW_BYTES;
                memcpy(at(l->plane[p], j) + off, at(l->plane[p], o) + off,
                       same ? SLOT_BYTES : ROW_BYTES);
            }
        }
}

static void restore(layer *ls) {
    for (int i = 0; i < L; i++) {
        for (int p = 0; p < 2; p++)
            memcpy(ls[i].plane[p], ls[i].orig[p], (size_t)NROWS * SLOT_BYTES);
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t r = 0; r < NROWS; r++)
                ls[i].pos[(size_t)h * NROWS + r] = r;
    }
}

static double run_once(layer *ls, bool slot_major, bool same) {
    restore(ls);
    double t = now_s();
    for (int i = 0; i < L; i++) {
        if (slot_major) {
            kvt__ev_args a = args_of(&ls[i]);
            kvt__ev_apply_cpu(&a);
        } else {
            head_major(&ls[i], same);
        }
    }
    return now_s() - t;
}

/* Both orders, repetitions interleaved (the machine's state drifts alike for both); the best of
 * each after one untimed warm-up of each. */
static void run_both(layer *ls, bool same, int reps, double *sm, double *hm) {
    run_once(ls, true, same);
    run_once(ls, false, same);
    *sm = *hm = 1e30;
    for (int r = 0; r < reps; r++) {
        double a = run_once(ls, true, same), b = run_once(ls, false, same);
        *sm = a < *sm ? a : *sm;
        *hm = b < *hm ? b : *hm;
    }
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 7;
    if (reps < 1)
        reps = 1;
    /* Pages in a shuffled order. */
    static int32_t pages[NROWS / PR + 1];
    for (int i = 0; i < NROWS / PR + 1; i++)
        pages[i] = i;
    for (int i = NROWS / PR; i > 0; i--) {
        int j = (int)(rnd() % (uint64_t)(i + 1));
        int32_t t = pages[i];
        pages[i] = pages[j];
        pages[j] = t;
    }
    g_pages = pages;
    g_pdiv = kvt__div32_make(PR);
    const size_t plane_bytes = (size_t)(NROWS / PR + 1) * PR * SLOT_BYTES;
    layer ls[L];
    for (int i = 0; i < L; i++) {
        for (int p = 0; p < 2; p++) {
            ls[i].plane[p] = malloc(plane_bytes);
            ls[i].orig[p] = malloc(plane_bytes);
            for (size_t b = 0; b < plane_bytes; b += 8) {
                uint64_t v = rnd();
                memcpy(ls[i].orig[p] + b, &v, 8);
            }
        }
        ls[i].pos = malloc(sizeof(int64_t) * H * NROWS);
        ls[i].keep = malloc(sizeof(uint32_t) * H * K);
        ls[i].map = malloc(sizeof(int32_t) * H * NROWS);
    }
    for (int same = 0; same < 2; same++) {
        /* The copy floor: memcpy of exactly the bytes the compaction moves (a row that stays
         * where it is moves nothing). */
        size_t moved = 0;
        for (int i = 0; i < L; i++)
            for (uint32_t h = 0; h < H; h++) {
                uint32_t *kh = ls[i].keep + (size_t)h * K;
                if (same && h > 0)
                    memcpy(kh, ls[i].keep, sizeof(uint32_t) * K);
                else
                    random_keep(kh, NROWS - R);
                for (uint32_t j = 0; j < K + R; j++)
                    moved += (j < K ? kh[j] : NROWS - R + (j - K)) != j;
            }
        moved *= 2 * (size_t)ROW_BYTES; /* both planes, one head's row each */
        const double floor_t = memcpy_best(moved, reps * 2);
        double sm, hm;
        run_both(ls, same, reps, &sm, &hm);
        printf("compaction %s keep sets, %d layers x %d heads x %d rows: slot-major %7.3f ms "
               "= %4.2fx memcpy, head-major %7.3f ms = %4.2fx (memcpy of the %.1f MB moved: "
               "%.3f ms)\n",
               same ? "shared  " : "per-head", L, H, K + R, sm * 1e3, sm / floor_t, hm * 1e3,
               hm / floor_t, (double)moved / 1e6, floor_t * 1e3);
    }
    for (int i = 0; i < L; i++) {
        for (int p = 0; p < 2; p++) {
            free(ls[i].plane[p]);
            free(ls[i].orig[p]);
        }
        free(ls[i].pos);
        free(ls[i].keep);
        free(ls[i].map);
    }
    return 0;
}
