/*
 * cu_pack.cu — emission on the CUDA backend (pack), following the CPU twin
 * (kernels/backend_cpu.c's pack).
 */
#include "kernels/cuda/cu_common.cuh"

namespace kvt_cu {

namespace {

/* ----------------------------------------------------------------------------------------------
 * pack: one block per query of the plan image, the CPU twin's cpu_pack. A query's count comes
 * from its values as they are when the kernel runs (a recall set's fetch count and dense flag
 * are device values), and in CSR its start is the sum of the counts before it. The fetched rows
 * merge into the list by position: a list row's output index is its own index plus the fetched
 * rows below it, and the other way round (the two are disjoint, both ascending).
 * -------------------------------------------------------------------------------------------- */

struct PackPlan {
    uint64_t out, count, n_fetch;
    uint32_t all;
};

/* A query's plan from the values as they are when the kernel runs (a recall set's fetch count
 * and dense flag are the device's), its slots from `out` on. */
__device__ PackPlan pack_plan_dev(const kvt__pack_query &q, const kvt__div32 *pd, uint64_t out) {
    PackPlan pl;
    pl.all = q.all_rows || (q.dense && *q.dense) ? 1u : 0u;
    pl.n_fetch = !pl.all && q.n_fetch ? *q.n_fetch : 0;
    pl.count = q.paged ? kvt__paged_count(&q.d, pd)
               : pl.all ? q.d.hi_end
                        : kvt__attended_desc_count(&q.d) + pl.n_fetch;
    pl.out = out;
    return pl;
}

/* How many of v[0 .. n) (ascending) lie below x (or_equal: at or below it). */
__device__ uint64_t below(const uint32_t *v, uint64_t n, uint32_t x, bool or_equal) {
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        const uint64_t mid = lo + (hi - lo) / 2;
        if (v[mid] < x || (or_equal && v[mid] == x))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Query q's set (block b of the launch) as planned in pl: its slots, padding, and (write_len)
 * its length or offset. */
__device__ void pack_body(const kvt__pack_query &q, uint32_t b, kvt__div32 pd, bool csr,
                          bool first_csr, const PackPlan pl, bool write_len, int32_t *indices,
                          int32_t *lengths, int32_t *indptr, int32_t *last_page_len) {
    const kvt__attended_desc &d = q.d;
    if (write_len && threadIdx.x == 0) {
        if (csr) {
            indptr[q.len_at] = (int32_t)(pl.out + pl.count);
            if (first_csr && b == 0)
                indptr[0] = 0;
        } else if (q.len_at != KVT__NO_LENGTH) {
            lengths[q.len_at] = (int32_t)pl.count;
        }
        if (q.paged)
            last_page_len[q.len_at - 1] = kvt__paged_last_len(&d, &pd);
    }
    if (q.count_only) /* another op writes this list */
        return;
    int32_t *o = indices + pl.out;
    if (q.paged) { /* page ids (a slot's page: slot / page_rows) */
        for (uint64_t j = threadIdx.x; j < pl.count; j += blockDim.x)
            o[j] = q.pages[kvt__paged_page(&d, &pd, j) - q.first_page];
        return;
    }
    const uint64_t count = pl.count;
    /* padding, and every row when the set is dense */
    for (uint64_t j = threadIdx.x; j < q.pad || (pl.all && j < count); j += blockDim.x) {
        if (j >= count)
            o[j] = -1;
        else if (pl.all)
            o[j] = kvt__page_slot(q.pages, q.first_page, &pd, (uint32_t)j);
    }
    if (pl.all)
        return;
    /* rows [0, lo_end), then list ∪ fetch by position, then [hi_begin, hi_end) */
    const uint64_t mid = d.n_list + pl.n_fetch, hi_at = d.lo_end + mid;
    for (uint64_t j = threadIdx.x; j < d.lo_end; j += blockDim.x)
        o[j] = kvt__page_slot(q.pages, q.first_page, &pd, (uint32_t)j);
    for (uint64_t j = threadIdx.x; j < count - hi_at; j += blockDim.x)
        o[hi_at + j] = kvt__page_slot(q.pages, q.first_page, &pd, (uint32_t)(d.hi_begin + j));
    /* (a row in both, which the contract rules out, comes out twice, the fetched one first:
     * the twin's merge) */
    for (uint64_t i = threadIdx.x; i < d.n_list; i += blockDim.x) {
        const uint32_t row = d.list[i];
        const uint64_t at = i + (pl.n_fetch ? below(q.fetch, pl.n_fetch, row, true) : 0);
        o[d.lo_end + at] = kvt__page_slot(q.pages, q.first_page, &pd, row);
    }
    for (uint64_t i = threadIdx.x; i < pl.n_fetch; i += blockDim.x) {
        const uint32_t row = q.fetch[i];
        o[d.lo_end + i + below(d.list, d.n_list, row, false)] =
            kvt__page_slot(q.pages, q.first_page, &pd, row);
    }
}

/* The pack: queries and count from the plan image as it is when the kernel runs (one block per
 * possible query; a count past n_max packs nothing), each query's count from its values then (a
 * recall set's are the recall step's output). CSR: query i's slots start
 * where the sets before it end, the block's sum of their counts in a fixed order (the CPU twin
 * reads indptr[i], which its loop wrote: the same value). */
__global__ void k_pack_planned(const kvt__pack_query *qs, const uint32_t *n_plan, uint32_t n_max,
                               kvt__div32 pd, bool csr, bool first_csr, int32_t *indices,
                               int32_t *lengths, int32_t *indptr, int32_t *last_page_len,
                               uint8_t *dense_out, uint32_t dense_stride) {
    const uint32_t n = *n_plan;
    if (csr && first_csr && blockIdx.x == 0 && threadIdx.x == 0)
        indptr[0] = 0;
    if (n > n_max || blockIdx.x >= n)
        return;
    const kvt__pack_query &q = qs[blockIdx.x];
    uint64_t out = q.out;
    if (csr) {
        __shared__ uint64_t s_sum[kThreads];
        uint64_t sum = 0;
        for (uint32_t i = threadIdx.x; i < blockIdx.x; i += blockDim.x)
            sum += pack_plan_dev(qs[i], &pd, 0).count;
        s_sum[threadIdx.x] = sum;
        __syncthreads();
        for (uint32_t half = kThreads / 2; half > 0; half /= 2) {
            if (threadIdx.x < half)
                s_sum[threadIdx.x] += s_sum[threadIdx.x + half];
            __syncthreads();
        }
        out = s_sum[0];
    }
    const PackPlan pl = pack_plan_dev(q, &pd, out);
    if (dense_out && threadIdx.x == 0) /* a request's queries all write its same flag */
        dense_out[blockIdx.x / dense_stride] = pl.all ? 1 : 0;
    pack_body(q, blockIdx.x, pd, csr, first_csr, pl, true, indices, lengths, indptr,
              last_page_len);
}

} // namespace

kvt_status cu_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream) {
    if (!a->q_plan || !a->n_plan) /* capturable: nothing of the step in the launch's arguments */
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream, true);
    if (s == KVT_OK)
        k_pack_planned<<<a->n_max ? a->n_max : 1, kThreads, 0, strm(stream)>>>(
            a->q_plan, a->n_plan, a->n_max, *a->pdiv, a->csr, a->first_csr, a->indices,
            a->lengths, a->indptr, a->last_page_len, a->dense_out,
            a->dense_stride ? a->dense_stride : 1u);
    return op_end(be, stream, s);
}

} // namespace kvt_cu
