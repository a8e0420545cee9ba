/*
 * cu_attend.cu — the reference attention over index sets (attend) on the CUDA backend.
 */
#include "kernels/cuda/cu_common.cuh"

namespace kvt_cu {

namespace {

/* ----------------------------------------------------------------------------------------------
 * attend: the reference attention (kvt__attend_args), split-K in double. k_attend_chunk: one block
 * per (chunk of kAttnChunk listed rows, head, query): scores (kvt__attn_score's 8 lanes, one
 * thread each, then its stride-halving tree by shuffles), the chunk's max M and sum Z in row
 * order on one thread, then Σ w·v by value index; its (M, Z, acc) into the workspace.
 * k_attend_merge: one block per (head, query) merges the chunks in order. A length outside
 * [0, topk] or a negative listed slot makes that (query, head)'s outputs NaN (the host cannot
 * read device-resident sets to refuse them). The order is not kvt__attn_cpu's (nor is fmaf
 * contraction): a relative ~1e-12 apart.
 * -------------------------------------------------------------------------------------------- */
constexpr uint32_t kAttnChunk = 2048;
constexpr int kAttnThreads = 128;

__device__ bool attend_len_ok(const kvt__attend_args &a, uint32_t i, uint32_t *len) {
    const int32_t l = a.len[i];
    *len = l < 0 ? 0u : (uint32_t)l;
    return l >= 0 && (uint32_t)l <= a.topk;
}

__global__ void k_attend_chunk(const kvt__attend_args a, uint32_t n_chunks, double *part) {
    const uint32_t c = blockIdx.x, h = blockIdx.y, i = blockIdx.z;
    const uint32_t K = a.key_dim, V = a.value_dim;
    double *pp = part + (((size_t)i * a.n_heads + h) * n_chunks + c) * (V + 3);
    uint32_t len;
    const bool ok = attend_len_ok(a, i, &len);
    const uint32_t lo = c * kAttnChunk, hi = len < lo + kAttnChunk ? len : lo + kAttnChunk;
    __shared__ double s_score[kAttnChunk];
    __shared__ float s_q[KVT__ATTN_MAX_DIM];
    __shared__ double s_m, s_z;
    __shared__ int s_bad;
    if (threadIdx.x == 0)
        s_bad = ok ? 0 : 1;
    const float *q = a.q + ((size_t)i * a.n_heads + h) * a.q_stride;
    for (uint32_t d = threadIdx.x; d < K; d += kAttnThreads)
        s_q[d] = q[d];
    __syncthreads();
    const int32_t *slots = a.idx + (size_t)i * a.topk;
    const uint32_t n = ok && hi > lo ? hi - lo : 0;
    /* scores: 8 threads a row (kvt__attn_score's lanes), 16 rows a pass */
    const uint32_t lane = threadIdx.x % KVT__ATTN_LANES;
    for (uint32_t r0 = 0; r0 < n; r0 += kAttnThreads / KVT__ATTN_LANES) {
        const uint32_t r = r0 + threadIdx.x / KVT__ATTN_LANES;
        double p = 0.0;
        int32_t slot = 0;
        if (r < n) {
            slot = slots[lo + r];
            if (slot >= 0) {
                const uint8_t *row = a.base + (size_t)slot * a.slot_stride + a.row_offset;
                for (uint32_t d = lane; d < K; d += KVT__ATTN_LANES)
                    p += (double)s_q[d] * kvt__attn_val(row, a.dtype, d);
            }
        }
        for (uint32_t w = KVT__ATTN_LANES / 2; w >= 1; w >>= 1) /* p[l] + p[l + w] */
            p = p + __shfl_down_sync(0xffffffffu, p, w, KVT__ATTN_LANES);
        if (r < n && lane == 0) {
            s_score[r] = slot >= 0 ? a.scale * p : NAN;
            if (slot < 0)
                s_bad = 1;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) { /* max and sum in row order (NaN propagates) */
        double m = n ? s_score[0] : -INFINITY;
        for (uint32_t j = 1; j < n && m == m; j++)
            m = s_score[j] != s_score[j] ? s_score[j] : (s_score[j] > m ? s_score[j] : m);
        double z = 0.0;
        for (uint32_t j = 0; j < n; j++) {
            const double w = kvt__attn_weight(s_score[j], m);
            s_score[j] = w;
            z += w;
        }
        s_m = m;
        s_z = z;
    }
    __syncthreads();
    const uint32_t nv = s_bad ? 0u : n; /* a bad set reads no value (its slots may not be) */
    for (uint32_t d = threadIdx.x; d < V; d += kAttnThreads) {
        double acc = 0.0;
        for (uint32_t j = 0; j < nv; j++) {
            const uint8_t *row = a.base + (size_t)slots[lo + j] * a.slot_stride + a.row_offset;
            acc += s_score[j] * kvt__attn_val(row, a.dtype, d);
        }
        pp[3 + d] = acc;
    }
    if (threadIdx.x == 0) {
        pp[0] = s_m;
        pp[1] = s_z;
        pp[2] = s_bad ? 1.0 : (double)n; /* rows, or 1 with a bad set (its M is NaN or unused) */
        if (s_bad)
            pp[0] = NAN;
    }
}

__global__ void k_attend_merge(const kvt__attend_args a, uint32_t n_chunks, const double *part) {
    const uint32_t h = blockIdx.x, i = blockIdx.y, V = a.value_dim;
    const double *pp = part + ((size_t)i * a.n_heads + h) * n_chunks * (V + 3);
    __shared__ double s_m, s_z;
    if (threadIdx.x == 0) {
        double m = -INFINITY;
        bool any = false, nan = false;
        for (uint32_t c = 0; c < n_chunks; c++) {
            const double *q = pp + (size_t)c * (V + 3);
            if (q[2] == 0.0)
                continue; /* an empty chunk */
            if (q[0] != q[0])
                nan = true;
            else if (!any || q[0] > m)
                m = q[0];
            any = true;
        }
        /* a chunk whose scores are all -Inf weighs 0 beside a finite maximum (the twin's
         * exp(-Inf - m)); its own sums are NaN (exp(-Inf + Inf)), so it is left out */
        double z = 0.0;
        for (uint32_t c = 0; c < n_chunks && !nan; c++) {
            const double *q = pp + (size_t)c * (V + 3);
            if (q[2] != 0.0 && !(q[0] == -INFINITY && m > -INFINITY))
                z += q[1] * exp(q[0] - m);
        }
        s_m = nan ? NAN : m;
        s_z = nan ? NAN : z;
        if (a.lse)
            a.lse[(size_t)i * a.n_heads + h] = !any ? -INFINITY : (nan ? NAN : m + log(z));
    }
    __syncthreads();
    if (!a.out)
        return;
    float *o = a.out + ((size_t)i * a.n_heads + h) * V;
    const double m = s_m, z = s_z;
    for (uint32_t d = threadIdx.x; d < V; d += kAttnThreads) {
        double acc = 0.0;
        bool any = false;
        for (uint32_t c = 0; c < n_chunks; c++) {
            const double *q = pp + (size_t)c * (V + 3);
            if (q[2] == 0.0)
                continue;
            any = true;
            if (!(q[0] == -INFINITY && m > -INFINITY))
                acc += q[3 + d] * exp(q[0] - m);
        }
        o[d] = !any ? 0.0f : (float)(m != m ? (double)NAN : acc / z);
    }
}

} // namespace

kvt_status cu_attend(const kvt__backend *be, const kvt__attend_args *a, void *stream) {
    if (!kvt__attend_args_ok(a))
        return KVT_ERR_INVALID_ARGUMENT;
    if (a->n_q == 0)
        return KVT_OK;
    kvt_status s = op_begin(be, stream);
    const uint32_t n_chunks = a->topk ? (a->topk + kAttnChunk - 1) / kAttnChunk : 1;
    const size_t bytes = sizeof(double) * (size_t)a->n_q * a->n_heads * n_chunks *
                         (a->value_dim + 3);
    uint8_t *ws = NULL;
    if (s == KVT_OK && a->n_q > 65535u)
        s = KVT_ERR_INVALID_ARGUMENT;
    if (s == KVT_OK)
        s = ws_get(be, stream, bytes, &ws);
    if (s == KVT_OK) {
        const dim3 g1(n_chunks, a->n_heads, a->n_q), g2(a->n_heads, a->n_q);
        k_attend_chunk<<<g1, kAttnThreads, 0, strm(stream)>>>(*a, n_chunks, (double *)ws);
        k_attend_merge<<<g2, kAttnThreads, 0, strm(stream)>>>(*a, n_chunks, (double *)ws);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

} // namespace kvt_cu
