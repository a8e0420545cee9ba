/*
 * attn.c — CPU twin of the reference MLA decode attention (see attn.h for the math, the precision
 * and the fixed summation order). The loops only arrange attn.h's KVT_HD functions.
 *
 * Layout of the work: rows are read in gather order and widened once per pass into a row buffer
 * shared by all heads (reading a 1152-B row costs more than one 576-wide dot product). Pass 1
 * computes every (head, row) score into scratch; pass 2 takes each head's maximum; pass 3 reads the
 * rows again and accumulates weights, marked mass and weighted values per head.
 */
#include "kernels/attn.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

size_t kvt__attn_scratch_doubles(uint32_t n_rows, uint32_t n_heads, uint32_t value_dim,
                                 uint32_t key_dim) {
    return (size_t)n_heads * n_rows + (size_t)n_heads * value_dim + key_dim;
}

static void widen_row(const uint8_t *row, int dt, uint32_t n, double *out) {
    for (uint32_t i = 0; i < n; i++)
        out[i] = kvt__attn_val(row, dt, i);
}

int kvt__attn_cpu(const kvt__attn_args *a) {
    if (!a || !a->q || !a->scratch || (a->n_rows > 0 && !a->base) || a->key_dim == 0 ||
        a->key_dim > KVT__ATTN_MAX_DIM || a->value_dim > a->key_dim || a->q_stride < a->key_dim)
        return -1;
    if (!kvt__attn_dtype_ok(a->dtype, a->key_dim))
        return -1;
    if (a->slots)
        for (uint32_t j = 0; j < a->n_rows; j++)
            if (a->slots[j] < 0)
                return -1;
    const uint32_t H = a->n_heads, N = a->n_rows, K = a->key_dim, V = a->value_dim;
    double *score = a->scratch;                 /* [H][N] */
    double *acc = score + (size_t)H * N;        /* [H][V] */
    double *row = acc + (size_t)H * V;          /* [K] */

    if (N == 0) {
        for (uint32_t h = 0; h < H; h++) {
            if (a->out)
                memset(a->out + (size_t)h * V, 0, sizeof(float) * V);
            if (a->mark_mass)
                a->mark_mass[h] = 0.0;
            if (a->lse)
                a->lse[h] = -INFINITY;
        }
        return 0;
    }

    /* Pass 1: scores. */
    for (uint32_t j = 0; j < N; j++) {
        size_t slot = a->slots ? (size_t)a->slots[j] : (size_t)j;
        widen_row(a->base + slot * a->slot_stride + a->row_offset, a->dtype, K, row);
        for (uint32_t h = 0; h < H; h++)
            score[(size_t)h * N + j] = kvt__attn_score(row, a->q + (size_t)h * a->q_stride, K,
                                                       a->scale);
    }
    /* Pass 2: per-head maximum (NaN propagates: a NaN score makes the max NaN). */
    double mx[64], z[64], mm[64];
    for (uint32_t h0 = 0; h0 < H; h0 += 64) {
        uint32_t hn = H - h0 < 64 ? H - h0 : 64;
        for (uint32_t h = 0; h < hn; h++) {
            const double *s = score + (size_t)(h0 + h) * N;
            double m = s[0];
            for (uint32_t j = 1; j < N && m == m; j++) {
                if (s[j] != s[j])
                    m = s[j]; /* NaN: the head's results are NaN */
                else if (s[j] > m)
                    m = s[j];
            }
            mx[h] = m;
            z[h] = 0.0;
            mm[h] = 0.0;
        }
        memset(acc, 0, sizeof(double) * (size_t)hn * V);
        /* Pass 3: weights, marked mass, weighted values. */
        for (uint32_t j = 0; j < N; j++) {
            size_t slot = a->slots ? (size_t)a->slots[j] : (size_t)j;
            widen_row(a->base + slot * a->slot_stride + a->row_offset, a->dtype, V, row);
            bool marked = a->mark && a->mark[j];
            for (uint32_t h = 0; h < hn; h++) {
                double w = kvt__attn_weight(score[(size_t)(h0 + h) * N + j], mx[h]);
                z[h] += w;
                if (marked)
                    mm[h] += w;
                kvt__attn_accum(acc + (size_t)h * V, row, V, w);
            }
        }
        for (uint32_t h = 0; h < hn; h++) {
            uint32_t hh = h0 + h;
            if (a->out)
                for (uint32_t d = 0; d < V; d++)
                    a->out[(size_t)hh * V + d] = (float)(acc[(size_t)h * V + d] / z[h]);
            if (a->mark_mass)
                a->mark_mass[hh] = mm[h] / z[h];
            if (a->lse)
                a->lse[hh] = mx[h] + log(z[h]);
        }
    }
    return 0;
}
