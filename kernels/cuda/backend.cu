/*
 * backend.cu — the CUDA backend: the operation table of kernels/backend.h on device memory.
 *
 * Every op is enqueued on the caller's stream and takes only device pointers (plus small host
 * argument arrays, copied into the device workspace on the same stream). Results the host must
 * see (a close's two counters, find_pos, read) are the only synchronisations. Each kernel follows
 * its CPU twin (backend_cpu.c, evict_cpu.c, sigma.c, sketch.c, recall_scan.c) through the same
 * KVT_HD per-element functions and the same accumulation order, so every decision is bit-equal;
 * the twins are the oracle of the GPU tests (scripts/gpu-check.sh), which need a device this
 * build machine lacks.
 *
 * Written for clarity first: one thread block per work item (a closing block, a selection
 * segment, a head of a layer's round, a query to pack). Runtime API only (cudart_static): linking
 * libcuda would break loading where no driver is installed.
 */
#include <cuda_runtime.h>
#include <cub/block/block_scan.cuh>

#include <float.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "kernels/backend.h"
#include "kernels/conformal_math.h"
#include "kernels/philox.h"
#include "kernels/recall_group.h"
#include "kernels/rope_trigger.h"
#include "kernels/recall_scan.h"
#include "kernels/recall_promo.h"
#include "kernels/recall_step.h"
#include "kernels/sigma.h"
#include "kernels/sketch.h"
#include "kernels/topm.h"
#include "lib/base/alloc.h"
}

namespace {

constexpr int kThreads = 256;
typedef cub::BlockScan<uint32_t, kThreads> Scan;

/* A handle's state: the context's, or a batch's own (kvt__backend_cuda_workspace). */
struct cuda_impl {
    int device;
    uint8_t *ws; /* device workspace: scratch of one op at a time, grow-only */
    size_t ws_bytes;
    uint64_t *counters; /* device [2 * 64]: select's per-segment counters */
    /* The workspace is reused op after op: an op on another stream than the last one waits for
     * the last one's work first (event), so two streams never share it at once. */
    cudaEvent_t ev;
    void *last_stream;
    bool have_ev;
    /* The planned ops' own workspace (recall_step_planned): sized once by recall_plan_reserve
     * from the plan's bound, never moved after, since a captured graph holds its address (the
     * workspace above may be freed and grown by a later eager op). */
    uint8_t *plan_ws;
    size_t plan_ws_bytes;
    /* An op that is not a planned one was refused on a capturing stream since capture_begin:
     * capture_end refuses the graph (it would replay without that op). */
    bool cap_refused;
    /* The handle's own non-blocking stream, for the work that has no caller's stream: the
     * reservations (workspace growth outside an op) and find_pos. Never the legacy stream, which
     * orders with every blocking stream and breaks a capture running on one. */
    cudaStream_t aux;
};

constexpr uint32_t kMaxSeg = 64; /* work items per call (score, select, pack) */
constexpr uint32_t kMaxEv = 16;  /* layers per eviction call (KVT__EV_CHUNK) */

/* The calling thread's last CUDA error, for kvt__backend_ops.last_error. */
thread_local char t_err[192];
thread_local char t_err_out[192];

/* A stream capture's own errors: a call out of order with a capture, not a device failure. */
bool capture_error(cudaError_t e) {
    switch (e) {
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureMerge:
    case cudaErrorStreamCaptureUnmatched:
    case cudaErrorStreamCaptureUnjoined:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorCapturedEvent:
    case cudaErrorStreamCaptureWrongThread:
        return true;
    default:
        return false;
    }
}

kvt_status st(cudaError_t e) {
    if (e == cudaSuccess)
        return KVT_OK;
    snprintf(t_err, sizeof t_err, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    (void)cudaGetLastError();
    return e == cudaErrorMemoryAllocation ? KVT_ERR_OUT_OF_MEMORY
           : capture_error(e)             ? KVT_ERR_BAD_STATE
                                          : KVT_ERR_NO_DEVICE;
}

cudaStream_t strm(void *s) {
    return (cudaStream_t)s;
}

/* Every op: the handle's device; then order after the handle's last op when it ran on another
 * stream (op_end records where each op ended). */
/* The stream is being captured into a graph (kvt__backend_ops.capture_begin): the ops then
 * order with the handle's other streams only through the capturing stream (the engine's graph
 * launch), not through the handle's event, which a capture may not wait on or record. */
cudaStreamCaptureStatus capture_status(void *stream) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (!stream || cudaStreamIsCapturing(strm(stream), &cs) != cudaSuccess)
        return cudaStreamCaptureStatusNone;
    return cs;
}

bool capturing(void *stream) {
    return capture_status(stream) == cudaStreamCaptureStatusActive;
}

/* On a capturing stream only the planned ops (planned: kvt__pack_args.q_plan,
 * recall_step_planned), whose arguments hold nothing of one step, are enqueued; any other is
 * refused with KVT_ERR_BAD_STATE (as on the CPU backends: its host-built arguments, and a
 * workspace it may grow, are one step's), and so is the capture_end after it. */
kvt_status op_begin(const kvt__backend *be, void *stream, bool planned = false) {
    cuda_impl *c = (cuda_impl *)be->impl;
    kvt_status s = st(cudaSetDevice(c->device));
    const bool cap = s == KVT_OK && capturing(stream);
    if (cap && !planned) {
        c->cap_refused = true;
        snprintf(t_err, sizeof t_err,
                 "a step's op on a capturing stream (only a planned step's runs, after "
                 "kvt_batch_plan_device, can be captured): refused, and the capture with it");
        return KVT_ERR_BAD_STATE;
    }
    if (s == KVT_OK && c->have_ev && c->last_stream != stream && !cap)
        s = st(cudaStreamWaitEvent(strm(stream), c->ev, 0));
    return s;
}

kvt_status op_end(const kvt__backend *be, void *stream, kvt_status s) {
    cuda_impl *c = (cuda_impl *)be->impl;
    if (s == KVT_OK)
        s = st(cudaGetLastError());
    if (capturing(stream)) {
        if (s != KVT_OK) /* a graph without this op would replay a wrong step */
            c->cap_refused = true;
        return s;
    }
    if (s == KVT_OK && (s = st(cudaEventRecord(c->ev, strm(stream)))) == KVT_OK) {
        c->last_stream = stream;
        c->have_ev = true;
    }
    return s;
}

/* A copy with stream NULL is synchronous with the whole device (the library's calls outside a
 * run, e.g. at reserve, pass NULL): the legacy default stream orders nothing with non-blocking
 * streams, so wait for everything before and after. */
kvt_status copy_on(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, void *stream,
                   bool host_reads = false) {
    if (!bytes)
        return KVT_OK;
    if (!stream) {
        kvt_status s = st(cudaDeviceSynchronize());
        if (s == KVT_OK)
            s = st(cudaMemcpy(dst, src, bytes, kind));
        return s == KVT_OK ? st(cudaDeviceSynchronize()) : s;
    }
    kvt_status s = st(cudaMemcpyAsync(dst, src, bytes, kind, strm(stream)));
    if (s == KVT_OK && (host_reads || kind == cudaMemcpyDeviceToHost)) /* the host reads it now */
        s = st(cudaStreamSynchronize(strm(stream)));
    return s;
}

/* Kernel arguments by value (CUDA 12.1+: up to 32 KB of parameters): no host staging, nothing
 * synchronises, and a captured graph holds the values. The dividers the args point at travel
 * with them. */
template <typename T, uint32_t N>
struct Params {
    T a[N];
    kvt__div32 div[N];
    uint32_t n;
};

template <typename T, uint32_t N>
Params<T, N> params_of(const T *host, uint32_t n) {
    Params<T, N> p;
    memset(&p, 0, sizeof p);
    p.n = n;
    for (uint32_t i = 0; i < n; i++)
        p.a[i] = host[i];
    return p;
}

/* Job i's args in a kernel as `a`, with its divider (the args' pdiv pointed at host memory). */
#define JOB_ARGS(T, p, i)                                                                          \
    T a = (p).a[i];                                                                                \
    const kvt__div32 a_div = (p).div[i];                                                           \
    a.pdiv = &a_div

template <typename T, uint32_t N>
Params<T, N> params_div(const T *host, uint32_t n) {
    Params<T, N> p = params_of<T, N>(host, n);
    for (uint32_t i = 0; i < n; i++)
        if (host[i].pdiv)
            p.div[i] = *host[i].pdiv;
    return p;
}

/* Replace *p (of *have bytes) by `want` bytes, ordered on stream s: the old block freed and the
 * new one allocated by the stream-ordered allocator (cudaFreeAsync, cudaMallocAsync), so nothing
 * synchronises the host or the device, and a capture running on another stream is left alone
 * (a cudaDeviceSynchronize + cudaFree + cudaMalloc there was an unsafe call, whose error was
 * ignored). s is ordered after the handle's last op (op_begin's event wait, or reserve_on). */
kvt_status regrow(cudaStream_t s, uint8_t **p, size_t *have, size_t want) {
    if (*p) {
        kvt_status r = st(cudaFreeAsync(*p, s));
        if (r != KVT_OK)
            return r;
        *p = NULL;
        *have = 0;
    }
    kvt_status r = st(cudaMallocAsync((void **)p, want, s));
    if (r != KVT_OK) {
        *p = NULL;
        return r;
    }
    *have = want;
    return KVT_OK;
}

/* Workspace of at least `bytes` for an op on `stream` (grow-only, by half again; at a batch's
 * creation from the context's stated limits, cu_reserve, then only when a larger step than those
 * arrives: a long prefill). Never in a capture: op_begin refuses every op there but the planned
 * ones, which use plan_ws. */
kvt_status ws_get(const kvt__backend *be, void *stream, size_t bytes, uint8_t **out) {
    cuda_impl *c = (cuda_impl *)be->impl;
    if (bytes > c->ws_bytes) {
        kvt_status s = regrow(strm(stream), &c->ws, &c->ws_bytes, bytes + bytes / 2);
        if (s != KVT_OK)
            return s;
    }
    *out = c->ws;
    return KVT_OK;
}

/* The planned ops' workspace (plan_ws) of at least `bytes`: reserved beforehand
 * (recall_plan_reserve, recall_rope_plan_reserve: kvt_batch_plan_device, from the batch's fixed
 * bound), never grown by the op itself, since a captured graph holds its address and the op may
 * be running in a capture: a planned op larger than its reservation is refused. */
kvt_status plan_ws_get(const kvt__backend *be, size_t bytes, uint8_t **out) {
    cuda_impl *c = (cuda_impl *)be->impl;
    if (bytes > c->plan_ws_bytes) {
        snprintf(t_err, sizeof t_err,
                 "a planned op's workspace (%zu B) is larger than its reservation (%zu B): "
                 "refused (recall_plan_reserve first, outside any capture)",
                 bytes, c->plan_ws_bytes);
        return KVT_ERR_BAD_STATE;
    }
    *out = c->plan_ws;
    return KVT_OK;
}

/* Growth outside an op (the reservations): on the handle's own stream, after its last op, and
 * recorded as its last op, so the next op on any stream orders after the new allocation. */
kvt_status reserve_on(const kvt__backend *be, uint8_t **p, size_t *have, size_t want) {
    cuda_impl *c = (cuda_impl *)be->impl;
    if (want <= *have)
        return KVT_OK;
    kvt_status s = st(cudaSetDevice(c->device));
    if (s == KVT_OK && c->have_ev)
        s = st(cudaStreamWaitEvent(c->aux, c->ev, 0));
    if (s == KVT_OK)
        s = regrow(c->aux, p, have, want);
    if (s == KVT_OK && (s = st(cudaEventRecord(c->ev, c->aux))) == KVT_OK) {
        c->last_stream = (void *)c->aux;
        c->have_ev = true;
    }
    return s;
}

__host__ __device__ size_t align256(size_t n) {
    return (n + 255) / 256 * 256;
}

/* ----------------------------------------------------------------------------------------------
 * Buffers
 * -------------------------------------------------------------------------------------------- */
kvt_status cu_buf_alloc(const kvt__backend *be, size_t bytes, void **out) {
    *out = NULL;
    if (bytes == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = st(cudaSetDevice(((cuda_impl *)be->impl)->device));
    if (s == KVT_OK)
        s = st(cudaMalloc(out, bytes));
    /* zeroed before any stream can use it */
    if (s == KVT_OK && ((s = st(cudaMemset(*out, 0, bytes))) != KVT_OK ||
                        (s = st(cudaDeviceSynchronize())) != KVT_OK)) {
        cudaFree(*out);
        *out = NULL;
    }
    return s;
}

void cu_buf_free(const kvt__backend *be, void *p, size_t bytes) {
    (void)be;
    (void)bytes;
    if (p)
        cudaFree(p);
}

/* Pinned host memory the kernels read and write over the bus: mapped, and with unified
 * addressing (every 64-bit sm_90 system) its host pointer is its device pointer, so the ops take
 * it as they take a buffer. read/write/copy use cudaMemcpyDefault for the same reason: either
 * side may be pinned host memory. */
kvt_status cu_host_alloc(const kvt__backend *be, size_t bytes, void **out) {
    *out = NULL;
    if (bytes == 0)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = st(cudaSetDevice(((cuda_impl *)be->impl)->device));
    if (s == KVT_OK)
        s = st(cudaHostAlloc(out, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    if (s == KVT_OK)
        memset(*out, 0, bytes);
    return s;
}

void cu_host_free(const kvt__backend *be, void *p, size_t bytes) {
    (void)be;
    (void)bytes;
    if (p)
        cudaFreeHost(p);
}

kvt_status cu_write(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                    void *stream) {
    kvt_status s = op_begin(be, stream);
    return op_end(be, stream,
                  s == KVT_OK ? copy_on(dst, src, bytes, cudaMemcpyDefault, stream) : s);
}

/* The host reads what it asked for: the one op that waits for the stream. */
kvt_status cu_read(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                   void *stream) {
    kvt_status s = op_begin(be, stream);
    return op_end(be, stream,
                  s == KVT_OK ? copy_on(dst, src, bytes, cudaMemcpyDefault, stream, true) : s);
}

kvt_status cu_copy(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                   void *stream) {
    kvt_status s = op_begin(be, stream);
    return op_end(be, stream,
                  s == KVT_OK ? copy_on(dst, src, bytes, cudaMemcpyDefault, stream) : s);
}

kvt_status cu_copy_rows(const kvt__backend *be, void *dst, size_t dst_stride, const void *src,
                        size_t src_stride, size_t width, uint64_t n, void *stream) {
    if (!n || !width)
        return KVT_OK;
    kvt_status s = op_begin(be, stream);
    if (s == KVT_OK && !stream)
        s = st(cudaDeviceSynchronize());
    if (s == KVT_OK)
        s = st(cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, width, (size_t)n,
                                 cudaMemcpyDefault, strm(stream)));
    if (s == KVT_OK && !stream)
        s = st(cudaDeviceSynchronize());
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * Block-wide pieces
 * -------------------------------------------------------------------------------------------- */
/* Top-m of keys[0..n) (larger first, ties to the lower index), written ascending into idx.
 * Radix select of the threshold T, 8 bits at a time from the top, then one ordered pass that
 * emits every key > T and the first `need` keys == T (kvt__topm_u32's definition). */
__device__ void block_topm(const uint32_t *keys, uint32_t n, uint32_t m, uint32_t *idx) {
    __shared__ uint32_t hist[256];
    __shared__ uint32_t s_prefix, s_need;
    __shared__ typename Scan::TempStorage scan;
    __shared__ uint32_t s_base, s_eq_base;
    if (m > n)
        m = n;
    if (m == 0)
        return;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_need = m;
    }
    __syncthreads();
    for (int level = 0; level < 4; level++) {
        const int shift = 24 - 8 * level;
        const uint32_t mask_hi = level == 0 ? 0u : 0xffffffffu << (32 - 8 * level);
        for (int b = threadIdx.x; b < 256; b += blockDim.x)
            hist[b] = 0;
        __syncthreads();
        const uint32_t prefix = s_prefix;
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
            uint32_t k = keys[i];
            if ((k & mask_hi) == prefix)
                atomicAdd(&hist[(k >> shift) & 0xffu], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t need = s_need, acc = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (acc + hist[b] >= need)
                    break;
                acc += hist[b];
            }
            s_prefix = prefix | ((uint32_t)b << shift);
            s_need = need - acc;
        }
        __syncthreads();
    }
    const uint32_t T = s_prefix, need = s_need;
    if (threadIdx.x == 0) {
        s_base = 0;
        s_eq_base = 0;
    }
    __syncthreads();
    for (uint64_t i0 = 0; i0 < n; i0 += blockDim.x) {
        uint32_t i = (uint32_t)(i0 + threadIdx.x);
        uint32_t k = i0 + threadIdx.x < n ? keys[i] : 0;
        const bool in = i0 + threadIdx.x < n;
        uint32_t eq = in && k == T ? 1u : 0u, eq_before, eq_total;
        Scan(scan).ExclusiveSum(eq, eq_before, eq_total);
        __syncthreads();
        uint32_t take = in && (k > T || (eq && s_eq_base + eq_before < need)) ? 1u : 0u;
        uint32_t at, total;
        Scan(scan).ExclusiveSum(take, at, total);
        if (take)
            idx[s_base + at] = i;
        __syncthreads();
        if (threadIdx.x == 0) {
            s_base += total;
            s_eq_base += eq_total;
        }
        __syncthreads();
    }
}

/* Stable compaction: out[k] = i for every i < n with flag(i), ascending, the first `cap` of them
 * written (out holds cap entries); returns the count of all flagged (all threads). */
template <typename F>
__device__ uint32_t block_compact(uint32_t n, F flag, uint32_t *out, uint32_t cap = UINT32_MAX) {
    __shared__ typename Scan::TempStorage scan;
    __shared__ uint32_t s_base;
    if (threadIdx.x == 0)
        s_base = 0;
    __syncthreads();
    for (uint64_t i0 = 0; i0 < n; i0 += blockDim.x) {
        uint32_t i = (uint32_t)(i0 + threadIdx.x);
        uint32_t f = i0 + threadIdx.x < n && flag(i) ? 1u : 0u, at, total;
        Scan(scan).ExclusiveSum(f, at, total);
        if (f && s_base + at < cap)
            out[s_base + at] = i;
        __syncthreads();
        if (threadIdx.x == 0)
            s_base += total;
        __syncthreads();
    }
    return s_base;
}

/* ----------------------------------------------------------------------------------------------
 * σ (score_rows): one thread block per closing block, the CPU twin's order (sigma.c).
 * -------------------------------------------------------------------------------------------- */
__device__ const uint8_t *row_of(const kvt__score_args &a, uint32_t u) {
    int32_t slot = kvt__page_slot(a.pages, a.first_page, a.pdiv, (uint32_t)(a.first_row + u));
    return a.base + (size_t)slot * a.slot_stride;
}

/* scratch: [P][n_basis][D] floats for this block. pdiv: the args' divider, copied to the device
 * next to them (the args' pointer is rewritten to it). */
typedef Params<kvt__score_args, kMaxSeg> ScoreParams;

__global__ void k_score(const ScoreParams p, float *scratch_all, size_t scratch_each) {
    JOB_ARGS(kvt__score_args, p, blockIdx.x);
    float *scratch = scratch_all + scratch_each * blockIdx.x;
    const uint32_t B = a.n_rows, D = a.branch_dim;
    if (a.selector == KVT_SELECT_RANDOM) {
        for (uint32_t u = threadIdx.x; u < B; u += blockDim.x)
            a.out[u] =
                kvt__philox_uniform(kvt__philox_draw_at(a.key, a.subseq, a.first_position + u));
        return;
    }
    if (a.selector == KVT_SELECT_BRANCH_NORM || a.selector == KVT_SELECT_ROW_NORM) {
        for (uint32_t u = threadIdx.x; u < B; u += blockDim.x) {
            const uint8_t *row = row_of(a, u);
            a.out[u] = a.selector == KVT_SELECT_BRANCH_NORM
                           ? kvt__elem_norm_fixed(row + a.branch_offset, a.branch_dtype, D)
                           : kvt__elem_norm_fixed(row, a.dtype, a.n_values);
        }
        return;
    }
    const uint32_t P = B / KVT__SIGMA_LEAF_ROWS, J = a.n_basis;
    const size_t part = (size_t)J * D;
    /* each row's finiteness once (scratch after the partials) */
    uint8_t *fin = (uint8_t *)(scratch + (size_t)P * part);
    for (uint32_t u = threadIdx.x; u < B; u += blockDim.x)
        fin[u] = (uint8_t)kvt__sigma_branch_finite(row_of(a, u), a.branch_offset,
                                                   a.branch_dtype, D);
    __syncthreads();
    /* 1a: leaf partials, u ascending within each leaf. */
    for (uint32_t t = threadIdx.x; t < P * part; t += blockDim.x) {
        uint32_t p = t / (uint32_t)part, e = t % (uint32_t)part, j = e / D, d = e % D;
        float acc = 0.0f;
        for (uint32_t u = p * KVT__SIGMA_LEAF_ROWS; u < (p + 1) * KVT__SIGMA_LEAF_ROWS; u++) {
            const uint8_t *row = row_of(a, u);
            float r = kvt__sigma_fit_val(row, a.branch_offset, a.branch_dtype, d, fin[u]);
            acc = kvt__sigma_leaf_step(acc, a.basis[(size_t)j * B + u], r);
        }
        scratch[(size_t)p * part + e] = acc;
    }
    __syncthreads();
    /* 1b: stride-halving tree over the leaves. */
    for (uint32_t s = P / 2; s >= 1; s >>= 1) {
        for (uint32_t t = threadIdx.x; t < s * part; t += blockDim.x) {
            uint32_t i = t / (uint32_t)part, e = t % (uint32_t)part;
            scratch[(size_t)i * part + e] = scratch[(size_t)i * part + e] +
                                            scratch[(size_t)(i + s) * part + e];
        }
        __syncthreads();
    }
    /* 2-3: per row, the residual and its fixed-order norm. */
    for (uint32_t u = threadIdx.x; u < B; u += blockDim.x) {
        const uint8_t *row = row_of(a, u);
        if (!fin[u]) {
            a.out[u] = INFINITY;
            continue;
        }
        float r[KVT__SIGMA_MAX_BRANCH_DIM];
        for (uint32_t d = 0; d < D; d++)
            r[d] = kvt__sigma_residual(kvt__sigma_branch_val(row, a.branch_offset,
                                                             a.branch_dtype, d),
                                       kvt__sigma_recon(a.basis, B, J, u, scratch, D, d));
        a.out[u] = kvt__norm_fixed(r, D);
    }
}

kvt_status cu_score_rows(const kvt__backend *be, const kvt__score_args *a, uint32_t n,
                         void *stream) {
    /* every item checked before anything is enqueued (a refusal from inside the chunk loop
     * returned after op_begin without op_end: the handle's event never recorded, so another
     * stream could reuse the workspace while this one's earlier chunks ran) */
    for (uint32_t i = 0; i < n; i++)
        if (a[i].selector == KVT_SELECT_SIGMA &&
            (a[i].branch_dim > KVT__SIGMA_MAX_BRANCH_DIM || a[i].n_rows < KVT__SIGMA_LEAF_ROWS))
            return KVT_ERR_UNSUPPORTED;
    kvt_status s = op_begin(be, stream);
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxSeg) {
        uint32_t k = n - i0 < kMaxSeg ? n - i0 : kMaxSeg;
        size_t each = 0;
        for (uint32_t i = 0; i < k; i++) {
            const kvt__score_args &x = a[i0 + i];
            if (x.selector == KVT_SELECT_SIGMA) {
                size_t f = kvt__sigma_scratch_floats(x.n_rows, x.n_basis, x.branch_dim) +
                           (x.n_rows + 3) / 4; /* + the finiteness flags */
                each = f > each ? f : each;
            }
        }
        uint8_t *ws = NULL;
        if (each && (s = ws_get(be, stream, sizeof(float) * each * k, &ws)) != KVT_OK)
            break;
        k_score<<<k, kThreads, 0, strm(stream)>>>(params_div<kvt__score_args, kMaxSeg>(a + i0, k),
                                                  (float *)ws, each);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * Recall sketches (sketch_rows): one warp per row, every block of the call in one launch (grid y
 * = the block), the CPU twin's order (sketch.h, sketch.c). Lane k computes coefficient k's chain
 * (kvt__sketch_coef: d ascending from +0), lane l the residual elements d = l, l+32, ..
 * (kvt__sketch_resid) and their squares' chain, then the shuffle tree of kvt__tree32 and sqrtf:
 * kvt__norm_fixed's lanes, so the bits are the twin's.
 * -------------------------------------------------------------------------------------------- */
typedef Params<kvt__sketch_args, kMaxSeg> SketchParams;
constexpr uint32_t kWarps = kThreads / 32;

/* The CPU op's argument check (backend_cpu.c, cpu_sketch_one). */
bool sketch_args_ok(const kvt__sketch_args &a) {
    return a.latent_dim >= 1 && a.latent_dim <= KVT__SKETCH_MAX_DIM && a.rank <= a.csk_stride &&
           a.csk_stride <= KVT__SKETCH_MAX_RANK && (!a.rank || a.basis) &&
           kvt__sketch_dtype_ok(a.dtype, a.latent_dim);
}

__global__ void k_sketch(const SketchParams p) {
    JOB_ARGS(kvt__sketch_args, p, blockIdx.y);
    /* each warp's row: its latent as fp32 and its fp16 sketch (36 KB a block) */
    __shared__ float s_c[kWarps][KVT__SKETCH_MAX_DIM];
    __shared__ uint16_t s_csk[kWarps][KVT__SKETCH_MAX_RANK];
    const uint32_t w = threadIdx.x / 32, lane = threadIdx.x % 32, D = a.latent_dim, R = a.rank;
    const unsigned full = 0xffffffffu;
    float *c = s_c[w];
    uint16_t *cs = s_csk[w];
    /* u is the same for the warp's 32 lanes: every branch below is warp-uniform */
    for (uint32_t u = blockIdx.x * kWarps + w; u < a.n_rows; u += gridDim.x * kWarps) {
        __syncwarp(); /* the previous row's reads of c and cs are done */
        const uint8_t *row =
            a.base + (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv,
                                            (uint32_t)(a.first_row + u)) *
                         a.slot_stride;
        uint32_t bad = 0; /* kvt__sketch_row_finite, fused with the load */
        for (uint32_t d = lane; d < D; d += 32) {
            const float x = kvt__sketch_latent(row, a.dtype, d);
            bad |= (kvt__bits_from_f32(x) & 0x7f800000u) == 0x7f800000u;
            c[d] = x;
        }
        __syncwarp();
        bad = __any_sync(full, bad);
        /* step 1: coefficient k on lane k % 32, then fp16 */
        uint32_t inf = 0;
        for (uint32_t k = lane; !bad && k < R; k += 32) {
            const uint16_t h = kvt__f32_to_f16(kvt__sketch_coef(c, D, a.basis + (size_t)k * D));
            inf |= !kvt__f16_finite(h);
            cs[k] = h;
        }
        __syncwarp();
        bad = __any_sync(full, bad | inf);
        uint16_t *out = a.csk + (size_t)u * a.csk_stride;
        for (uint32_t k = lane; k < a.csk_stride; k += 32)
            out[k] = bad || k >= R ? (uint16_t)0 : cs[k];
        if (bad) { /* undescribable: every certificate on it is infinite */
            if (lane == 0)
                a.rho[u] = INFINITY;
            continue;
        }
        /* steps 2-3: residual against the stored sketch, lane l's chain of squares */
        float acc = 0.0f;
        for (uint32_t d = lane; d < D; d += 32) {
            const float e = kvt__sketch_resid(c[d], cs, R, a.basis, D, d);
            acc = fmaf(e, e, acc);
        }
        /* kvt__tree32: p[i] = p[i] + p[i + s], s = 16 .. 1 (lane i < s holds p[i]) */
        for (uint32_t s = KVT__SIGMA_LANES / 2; s >= 1; s >>= 1)
            acc = acc + __shfl_down_sync(full, acc, s);
        if (lane == 0)
            a.rho[u] = kvt__sketch_rho_canon(sqrtf(acc));
    }
}

kvt_status cu_sketch_rows(const kvt__backend *be, const kvt__sketch_args *a, uint32_t n,
                          void *stream) {
    for (uint32_t i = 0; i < n; i++)
        if (!sketch_args_ok(a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream);
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxSeg) {
        uint32_t k = n - i0 < kMaxSeg ? n - i0 : kMaxSeg, most = 0;
        for (uint32_t i = 0; i < k; i++)
            most = a[i0 + i].n_rows > most ? a[i0 + i].n_rows : most;
        if (!most)
            continue;
        const uint32_t groups = (most + kWarps - 1) / kWarps;
        k_sketch<<<dim3(groups < 4096 ? groups : 4096, k), kThreads, 0, strm(stream)>>>(
            params_div<kvt__sketch_args, kMaxSeg>(a + i0, k));
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * Recall scans (recall_scan): three launches for up to kMaxSeg work items (grid y = the item):
 * the heads prepared (one block per head), the archived rows' fire flags (one thread per row,
 * its heads in order until one fires: the OR), then the fired rows compacted ascending (one
 * block per item), the first cap written. Every value through recall_scan.h's KVT_HD functions
 * (kvt__recall_idx's chains are the twin's tiled ones), so fired sets are the CPU twin's.
 * -------------------------------------------------------------------------------------------- */
typedef Params<kvt__recall_scan_args, kMaxSeg> ScanParams;

/* The argument rules: kvt__recall_scan_args_ok / kvt__recall_step_args_ok
 * (kernels/recall_step.h), one definition with the CPU ops'. */
bool scan_args_ok(const kvt__recall_scan_args &a) {
    return kvt__recall_scan_args_ok(&a);
}

/* Workspace of each item (`each` bytes apart): q̃_sk [heads][rank] floats, the residuals
 * [heads][D] floats, the heads' fields [heads], one fire flag per closed row. */
struct ScanWs {
    uint8_t *base;
    size_t each, off_res, off_heads, off_flags, off_extra;
    size_t off_promo; /* recall_step with promotion: PromoWs (0 elsewhere) */
    size_t off_groups, group_each, off_live, off_visit; /* recall_step's pruned scan: GroupWs */
};

/* The layout of k work items' scan workspace (item i's scan args at (char *)a0 + i * stride on
 * the host), `extra` more bytes each at off_extra; the most heads and closed rows among them. */
/* The layout of scan items of at most qsk q̃_sk floats, res residual floats, H heads and rows
 * closed rows each, `extra` more bytes at off_extra. */
ScanWs scan_ws_make(size_t qsk, size_t res, uint32_t H, size_t rows, size_t extra) {
    ScanWs w;
    w.base = NULL;
    w.off_res = align256(sizeof(float) * qsk);
    w.off_heads = w.off_res + align256(sizeof(float) * res);
    w.off_flags = w.off_heads + align256(sizeof(kvt__recall_head) * H);
    w.off_extra = w.off_flags + align256(rows);
    w.each = w.off_extra + align256(extra);
    w.off_promo = w.off_groups = w.group_each = w.off_live = w.off_visit = 0;
    return w;
}

ScanWs scan_ws_of(const kvt__recall_scan_args *a0, size_t stride, uint32_t k, size_t extra,
                  uint32_t *H_out, size_t *rows_out) {
    size_t qsk = 0, res = 0, rows = 0;
    uint32_t H = 0;
    for (uint32_t i = 0; i < k; i++) {
        const kvt__recall_scan_args &x =
            *(const kvt__recall_scan_args *)((const uint8_t *)a0 + i * stride);
        const size_t q1 = (size_t)x.n_heads * x.rank, r1 = (size_t)x.n_heads * x.latent_dim;
        qsk = q1 > qsk ? q1 : qsk;
        res = r1 > res ? r1 : res;
        rows = x.n_closed > rows ? x.n_closed : rows;
        H = x.n_heads > H ? x.n_heads : H;
    }
    *H_out = H;
    *rows_out = rows;
    return scan_ws_make(qsk, res, H, rows, extra);
}

struct ScanItem {
    float *q_sk, *res;
    kvt__recall_head *heads;
    uint8_t *flags;
};

__device__ ScanItem scan_item(const ScanWs &w, uint32_t i) {
    uint8_t *b = w.base + w.each * i;
    ScanItem it;
    it.q_sk = (float *)b;
    it.res = (float *)(b + w.off_res);
    it.heads = (kvt__recall_head *)(b + w.off_heads);
    it.flags = b + w.off_flags;
    return it;
}

#define SCAN_ARGS(p, i) JOB_ARGS(kvt__recall_scan_args, p, i)

/* Head prep (kvt__recall_head_prep, parallel over k then d): q̃_sk[k] by kvt__sketch_coef's
 * chain, q̃_res[d] by kvt__recall_resid's, then the norms and bounds by thread 0. The whole
 * block calls it for head h < a.n_heads. */
__device__ void scan_head(const kvt__recall_scan_args &a, const ScanItem &it, uint32_t h) {
    const uint32_t D = a.latent_dim, rank = a.rank;
    const float *q = a.q + (size_t)h * (D + a.branch_dim);
    float *q_sk = it.q_sk + (size_t)h * rank, *res = it.res + (size_t)h * D;
    for (uint32_t k = threadIdx.x; k < rank; k += blockDim.x)
        q_sk[k] = kvt__sketch_coef(q, D, a.basis + (size_t)k * D);
    __syncthreads();
    for (uint32_t d = threadIdx.x; d < D; d += blockDim.x)
        res[d] = kvt__recall_resid(q, q_sk, a.basis, rank, D, d);
    __syncthreads();
    if (threadIdx.x == 0)
        kvt__recall_head_finish(q, D, rank, q_sk, res, &it.heads[h]);
}

__global__ void k_scan_heads(const ScanParams p, const ScanWs w) {
    SCAN_ARGS(p, blockIdx.y);
    if (blockIdx.x < a.n_heads)
        scan_head(a, scan_item(w, blockIdx.y), blockIdx.x);
}

/* Does an archived row fire? Its heads in order until one does (the twin's OR). */
__device__ bool scan_fires(const kvt__recall_scan_args &a, const ScanItem &it, uint32_t row) {
    const uint32_t D = a.latent_dim, bd = a.branch_dim, rank = a.rank;
    const uint8_t *p =
        a.base + (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, row) * a.slot_stride;
    const uint16_t *csk = kvt__scan_csk(&a, row);
    const float rho = *kvt__scan_rho(&a, row);
    for (uint32_t h = 0; h < a.n_heads; h++) {
        float P, ncsk;
        const float idx =
            kvt__recall_idx(a.q + (size_t)h * (D + bd), it.q_sk + (size_t)h * rank, p, D,
                            a.branch_offset, a.branch_dtype, bd, csk, rank, a.scale, &P, &ncsk);
        const kvt__recall_head hd = it.heads[h];
        /* margin mode: the twin's !(s·acc + δ < best), idx being s·acc */
        const int fire =
            a.mode == KVT__RECALL_MARGIN ? !(idx + a.z < a.best[h])
            : a.mode == KVT__RECALL_SOUND
                ? kvt__recall_sound_fires(idx,
                                          kvt__recall_sound_margin(&hd, idx, P, ncsk, rho,
                                                                   a.scale, a.z, D, bd, rank),
                                          a.best[h])
                : kvt__recall_conformal_fires(idx, kvt__recall_cert(&hd, rho, a.scale, D), a.z,
                                              a.best[h]);
        if (fire)
            return true;
    }
    return false;
}

/* One flag per closed row: archived (>= sinks, not kept) and fired; rows split over the grid's x
 * (every block of an item calls it). */
__device__ void scan_rows(const kvt__recall_scan_args &a, const ScanItem &it) {
    for (uint64_t r = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; r < a.n_closed;
         r += (uint64_t)gridDim.x * blockDim.x)
        it.flags[r] = r >= a.sinks && !kvt__sorted_has(a.kept, a.m, r) &&
                      scan_fires(a, it, (uint32_t)r);
}

__global__ void k_scan_rows(const ScanParams p, const ScanWs w) {
    SCAN_ARGS(p, blockIdx.y);
    scan_rows(a, scan_item(w, blockIdx.y));
}

/* The fired rows ascending, the first cap of them into a.fired; returns how many fired (all
 * threads of the block call it). */
__device__ uint32_t scan_compact(const kvt__recall_scan_args &a, const uint8_t *flags) {
    return block_compact(
        (uint32_t)a.n_closed, [&](uint32_t i) { return flags[i] != 0; }, a.fired, a.cap);
}

/* The fired rows ascending, the first cap of them; the count and the overflow flag. */
__global__ void k_scan_compact(const ScanParams p, const ScanWs w) {
    const kvt__recall_scan_args &a = p.a[blockIdx.x];
    const uint32_t total = scan_compact(a, scan_item(w, blockIdx.x).flags);
    if (threadIdx.x == 0) {
        *a.n_fired = total < a.cap ? total : a.cap;
        *a.overflow = total > a.cap ? 1u : 0u;
    }
}

/* The grid of a per-row launch over k items of at most `rows` rows (a thread per row, at most
 * 4096 blocks an item: the rest in strides). */
dim3 rows_grid(size_t rows, uint32_t k) {
    const size_t blocks = (rows + kThreads - 1) / kThreads;
    return dim3((unsigned)(blocks < 4096 ? blocks : 4096), k);
}

kvt_status cu_recall_scan(const kvt__backend *be, const kvt__recall_scan_args *a, uint32_t n,
                          void *stream) {
    for (uint32_t i = 0; i < n; i++)
        if (!scan_args_ok(a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream);
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxSeg) {
        const uint32_t k = n - i0 < kMaxSeg ? n - i0 : kMaxSeg;
        uint32_t H;
        size_t rows;
        ScanWs w = scan_ws_of(a + i0, sizeof *a, k, 0, &H, &rows);
        if ((s = ws_get(be, stream, w.each * k, &w.base)) != KVT_OK)
            break;
        const ScanParams prm = params_div<kvt__recall_scan_args, kMaxSeg>(a + i0, k);
        if (H)
            k_scan_heads<<<dim3(H, k), kThreads, 0, strm(stream)>>>(prm, w);
        if (rows)
            k_scan_rows<<<rows_grid(rows, k), kThreads, 0, strm(stream)>>>(prm, w);
        k_scan_compact<<<k, kThreads, 0, strm(stream)>>>(prm, w);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * Recall steps (recall_step): the CPU twin's kvt__recall_step_cpu (kernels/recall_step.c) in four
 * launches for up to kMaxStep work items (grid y = the item), nothing read back by the host:
 *   1. the heads prepared (scan_head, as the scan's first launch);
 *   2. one block per head: the best attended exact score (kvt__recall_exact; a max over rows,
 *      ties to the lower row: the twin's first-seen), and on a calibration step the best archived
 *      score with its row, whose sample (kvt__recall_idx, kvt__recall_cert,
 *      kvt__conformal_sample) goes to the workspace (NaN: none);
 *   3. the scan's fire flags (scan_rows) with the state's z, on scanning steps only;
 *   4. one block per item: the samples merged into the sorted array by the block exactly as
 *      kvt__conformal_insert in head order leaves it (step_insert) and z fixed at a window end
 *      (kvt__conformal_close, one thread), or the fired rows compacted; the certificate into the
 *      state, the dense flag.
 * Which kind of step it is, the device decides from the state (its phase as launch 2 and 3 find
 * it: launch 4 alone writes the state). With group planes (conformal and sound modes, on the
 * steps kvt__recall_prune_pays picks) two launches come before launch 3, as the twin's pruned
 * scan (kernels/recall_group.h): the groups of the blocks closed since the state's n_grouped
 * built (one block of threads per closed block, k_step_groups), then each group's liveness over
 * the heads (kvt__recall_group_live, a thread per group, k_step_live); launch 3 then evaluates
 * the archived members of live groups (and the rows past the grouped blocks) and counts them, so
 * the state's visited and n_grouped, and the planes, are the twin's too.
 * -------------------------------------------------------------------------------------------- */
constexpr uint32_t kMaxStep = 32;
typedef Params<kvt__recall_step_args, kMaxStep> StepParams;
static_assert(sizeof(StepParams) <= 32000, "kernel parameters above CUDA's 32 KB");

StepParams step_params(const kvt__recall_step_args *host, uint32_t n) {
    StepParams p = params_of<kvt__recall_step_args, kMaxStep>(host, n);
    for (uint32_t i = 0; i < n; i++)
        if (host[i].scan.pdiv)
            p.div[i] = *host[i].scan.pdiv;
    return p;
}

/* Where a recall step launch's work items come from (the kernels are templates over it): the
 * eager op's arguments by value, or a batch's plan buffer in device memory as it is when the
 * kernel runs (recall_step_planned: a captured launch replays over later steps). get(): kItemOk
 * with the item in x (its divider in d), kItemNone past the items, kItemBad for a planned item
 * that breaks the argument rules or the plan's bound (k_step_finish makes its step dense). */
enum { kItemNone = 0, kItemOk = 1, kItemBad = 2 };

template <class T, uint32_t N>
struct EagerOf {
    Params<T, N> p;
    __device__ uint32_t count() const {
        return p.n;
    }
    __device__ int get(uint32_t i, T &x, kvt__div32 &d) const {
        x = p.a[i];
        d = p.div[i];
        return kItemOk;
    }
};

/* A plan's items (PA: its op's arguments, with n, n_max; Item: the KVT_HD check that builds
 * item i as the eager op takes it). */
template <class PA, class T, int (*Item)(const PA *, uint32_t, T *, kvt__div32 *)>
struct PlanOf {
    PA a;
    /* the items the kernel walks: the plan's count, or every slot when it is out of range
     * (get() then says none, and the finish leaves the bad ones alone) */
    __device__ uint32_t count() const {
        const uint32_t k = *a.n;
        return k < a.n_max ? k : a.n_max;
    }
    __device__ int get(uint32_t i, T &x, kvt__div32 &d) const {
        const uint32_t k = *a.n;
        if (i >= k || k > a.n_max)
            return kItemNone;
        return Item(&a, i, &x, &d) ? kItemOk : kItemBad;
    }
};

typedef EagerOf<kvt__recall_step_args, kMaxStep> EagerItems;
typedef PlanOf<kvt__recall_plan_args, kvt__recall_step_args, kvt__recall_plan_item_args>
    PlanItems;

#define STEP_ARGS(src, i)                                                                          \
    kvt__recall_step_args x;                                                                       \
    kvt__div32 x_div;                                                                              \
    if ((src).get(i, x, x_div) != kItemOk)                                                         \
        return;                                                                                    \
    x.scan.pdiv = &x_div

/* The CPU ops' rules (kvt__recall_step_args_ok: one definition). */
bool step_args_ok(const kvt__recall_step_args &x) {
    return kvt__recall_step_args_ok(&x);
}

/* Promotion's part of an item's workspace, after its step extra (ScanWs.off_promo): the merged
 * list's length [1], then per promoted row its hit flag [prom_cap] (the heads' blocks OR into
 * it), the kept set merged with the promoted rows [m + prom_cap], and kvt__promo_after's
 * tables [2·cand_cap + 2·prom_cap], u32 each (kvt__promo_scratch_u32 + prom_cap + 1). */
struct PromoWs {
    uint32_t *n_merged, *hit, *merged, *tmp;
};

size_t promo_ws_u32(const kvt__recall_step_args &x) {
    return x.promo ? 1u + x.prom_cap + kvt__promo_scratch_u32(&x) : 0;
}

__device__ PromoWs promo_ws(const ScanWs &w, uint32_t item, const kvt__recall_step_args &x) {
    uint32_t *b = (uint32_t *)(w.base + w.each * item + w.off_promo);
    PromoWs p;
    p.n_merged = b;
    p.hit = b + 1;
    p.merged = p.hit + x.prom_cap;
    p.tmp = p.merged + x.scan.m + x.prom_cap;
    return p;
}

/* The item as the step's scan and calibration see it: with promotion, the rows attended
 * without recall past the sinks are the kept set merged with the promoted rows (written by
 * k_promo_before); without, the item itself. Launch 2's best attended score alone reads the
 * policy's kept set (the promoted rows' scores come after it, as in the twin). */
__device__ kvt__recall_step_args step_view(const kvt__recall_step_args &x, const ScanWs &w,
                                           uint32_t item) {
    kvt__recall_step_args v = x;
    if (x.promo) {
        const PromoWs pw = promo_ws(w, item, x);
        v.scan.kept = pw.merged;
        v.scan.m = *pw.n_merged;
    }
    return v;
}


/* What the step is, from the item and the state's phase (the twin's S, archived, branches). */
struct StepPlan {
    uint64_t S, archived;
    bool calib, scan;
};

__device__ StepPlan step_plan(const kvt__recall_step_args &x, uint32_t phase) {
    const kvt__recall_scan_args &a = x.scan;
    StepPlan pl;
    pl.S = a.sinks < a.n_closed ? a.sinks : a.n_closed;
    const uint64_t kept_past = a.m - kvt__sorted_below(a.kept, a.m, pl.S);
    pl.archived = a.n_closed - pl.S - kept_past;
    pl.calib = pl.archived && x.mode == KVT__RECALL_CONFORMAL && phase == KVT__CONFORMAL_OPEN;
    pl.scan = pl.archived && !pl.calib;
    return pl;
}

/* The scan the step runs: the request's z (the state's in conformal mode), the clamped sinks. */
__device__ kvt__recall_scan_args step_scan(const kvt__recall_step_args &x, const StepPlan &pl,
                                           float state_z) {
    kvt__recall_scan_args a = x.scan;
    a.z = kvt__recall_mode_z(x.mode, a.latent_dim, x.margin, state_z);
    a.mode = x.mode;
    a.sinks = pl.S;
    return a;
}

/* The running best of a block: higher score, ties (==, so ±0 too) to the lower row; a score
 * that is not above -Inf (NaN, -Inf) never counts — the twin's `sc > best` from -Inf. */
__device__ void best_take(float v, uint64_t row, float &bv, uint64_t &br) {
    if (v > -INFINITY && (v > bv || (v == bv && row < br))) {
        bv = v;
        br = row;
    }
}

__device__ void best_reduce(float &bv, uint64_t &br) {
    __shared__ float sv[kThreads];
    __shared__ uint64_t sr[kThreads];
    sv[threadIdx.x] = bv;
    sr[threadIdx.x] = br;
    __syncthreads();
    for (uint32_t half = kThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            float v = sv[threadIdx.x];
            uint64_t r = sr[threadIdx.x];
            best_take(sv[threadIdx.x + half], sr[threadIdx.x + half], v, r);
            sv[threadIdx.x] = v;
            sr[threadIdx.x] = r;
        }
        __syncthreads();
    }
    bv = sv[0];
    br = sr[0];
    __syncthreads(); /* the arrays are reused by the next call */
}

__device__ float step_exact(const kvt__recall_scan_args &a, const float *q, uint64_t row) {
    const uint8_t *p =
        a.base + (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, (uint32_t)row) *
                     a.slot_stride;
    return kvt__recall_exact(q, p, a.dtype, a.latent_dim, a.branch_offset, a.branch_dtype,
                             a.branch_dim, a.scale);
}

/* The calibration's part of an item's workspace: each head's sample e [H] (NaN: none), the
 * valid ones' heads in order [H] and their samples [H], the samples as the step found them
 * [sample_cap]. */
struct StepExtra {
    float *e;
    uint32_t *valid;
    float *nw;
    float *old;
};

__device__ StepExtra step_extra(const ScanWs &w, uint32_t item, uint32_t n_heads) {
    uint8_t *b = w.base + w.each * item + w.off_extra;
    const size_t hb = align256(sizeof(float) * n_heads);
    StepExtra x;
    x.e = (float *)b;
    x.valid = (uint32_t *)(b + hb);
    x.nw = (float *)(b + 2 * hb);
    x.old = (float *)(b + 3 * hb);
    return x;
}

/* Launch 0, items with promotion (one block each): the tables settled after a close
 * (kvt__promo_settle, one thread), the hit flags cleared, and the kept set merged with the
 * promoted rows, an element per thread (kvt__promo_merged_at: the serial merge's places). */
template <class Items>
__device__ void promo_before_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    if (!x.promo)
        return;
    const kvt__recall_scan_args &a = x.scan;
    const PromoWs pw = promo_ws(w, item, x);
    const kvt__promo_view pv = kvt__promo_of(&x);
    if (threadIdx.x == 0)
        kvt__promo_settle(&x, &pv, a.sinks < a.n_closed ? a.sinks : a.n_closed);
    __syncthreads();
    const uint32_t np = pv.h->n_prom;
    for (uint32_t i = threadIdx.x; i < np; i += blockDim.x)
        pw.hit[i] = 0;
    const uint64_t total = (uint64_t)a.m + np;
    for (uint64_t t = threadIdx.x; t < total; t += blockDim.x)
        pw.merged[kvt__promo_merged_at(a.kept, a.m, pv.prom_row, np, t)] =
            t < a.m ? a.kept[t] : pv.prom_row[t - a.m];
    if (threadIdx.x == 0)
        *pw.n_merged = (uint32_t)total;
}

template <class Items>
__device__ void step_heads_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    if (blockIdx.x < x.scan.n_heads)
        scan_head(x.scan, scan_item(w, item), blockIdx.x);
}

/* Launch 2: head blockIdx.x of the item. */
template <class Items>
__device__ void step_best_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    const kvt__recall_scan_args &a = x.scan;
    const uint32_t h = blockIdx.x, D = a.latent_dim, bd = a.branch_dim;
    if (h >= a.n_heads)
        return;
    const StepPlan pl = step_plan(step_view(x, w, item), x.st->phase);
    const float *q = a.q + (size_t)h * (D + bd);
    /* 1. rows [0, S), the kept rows past S, the tail [n_closed, n_rows): ascending rows */
    float bv = -INFINITY;
    uint64_t br = UINT64_MAX;
    const uint64_t n_tail = x.n_rows - a.n_closed, n_att = pl.S + a.m + n_tail;
    for (uint64_t j = threadIdx.x; j < n_att; j += blockDim.x) {
        uint64_t row;
        if (j < pl.S) {
            row = j;
        } else if (j < pl.S + a.m) {
            row = a.kept[j - pl.S];
            if (row < pl.S)
                continue;
        } else {
            row = a.n_closed + (j - pl.S - a.m);
        }
        best_take(step_exact(a, q, row), row, bv, br);
    }
    best_reduce(bv, br);
    if (x.promo) {
        /* the promoted rows: attended too; each hits when its score reaches, for some head,
         * this best (the heads' blocks OR their verdicts), then the best takes them: the
         * twin's fold of them after the others (a strictly higher one wins) */
        const kvt__promo_view pv = kvt__promo_of(&x);
        const PromoWs pw = promo_ws(w, item, x);
        float pb = -INFINITY;
        uint64_t prow = UINT64_MAX;
        for (uint32_t i = threadIdx.x; i < pv.h->n_prom; i += blockDim.x) {
            const uint32_t row = pv.prom_row[i];
            const float sc = step_exact(a, q, row);
            if (sc >= bv)
                atomicOr(&pw.hit[i], 1u);
            best_take(sc, row, pb, prow);
        }
        best_reduce(pb, prow);
        if (pb > bv)
            bv = pb;
    }
    if (threadIdx.x == 0)
        ((float *)a.best)[h] = bv;
    if (!pl.calib)
        return;
    /* 3. the calibration's sample of this head: its best archived row (not kept, not
     * promoted) */
    const kvt__recall_scan_args av = step_view(x, w, item).scan;
    const ScanItem it = scan_item(w, item);
    float *e_out = step_extra(w, item, a.n_heads).e;
    bv = -INFINITY;
    br = UINT64_MAX;
    for (uint64_t row = pl.S + threadIdx.x; row < a.n_closed; row += blockDim.x)
        if (!kvt__sorted_has(av.kept, av.m, row))
            best_take(step_exact(a, q, row), row, bv, br);
    best_reduce(bv, br);
    if (threadIdx.x != 0)
        return;
    float e = NAN;
    if (br != UINT64_MAX) {
        const uint32_t rank = a.rank;
        const uint8_t *row = a.base + (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv,
                                                             (uint32_t)br) * a.slot_stride;
        float P, ncsk, v;
        const float idx = kvt__recall_idx(q, it.q_sk + (size_t)h * rank, row, D, a.branch_offset,
                                          a.branch_dtype, bd, kvt__scan_csk(&a, br),
                                          rank, a.scale, &P, &ncsk);
        const kvt__recall_head hd = it.heads[h];
        const float cert = kvt__recall_cert(&hd, *kvt__scan_rho(&a, br), a.scale, D);
        if (kvt__conformal_sample(bv, idx, cert, &v))
            e = v; /* finite: NaN marks no sample */
    }
    e_out[h] = e;
}

/* ----------------------------------------------------------------------------------------------
 * The pruned scan's groups (kernels/recall_group.h; the twin: kvt__recall_group_block_cpu and
 * kvt__recall_scan_pruned_cpu). An item's part of the workspace (ScanWs.off_groups): a build
 * scratch for each of the kGroupBlocks blocks of threads that build its closed blocks (sort keys
 * [B] u64, t by row and t sorted [B] floats each, a centre and a direction [dim] floats each),
 * one liveness byte per group slot of its blocks, and the count of rows the scan evaluated.
 * -------------------------------------------------------------------------------------------- */
constexpr uint32_t kGroupBlocks = 4;

size_t group_build_bytes(uint32_t B, uint32_t dim) {
    return align256(sizeof(uint64_t) * B) + align256(2 * sizeof(float) * B) +
           align256(2 * sizeof(float) * dim);
}

struct GroupWs {
    uint8_t *build; /* kGroupBlocks scratches, `each` bytes apart */
    size_t each;
    uint8_t *live;  /* [blocks][B/32] */
    unsigned long long *visit;
};

__device__ GroupWs group_ws(const ScanWs &w, uint32_t item) {
    uint8_t *b = w.base + w.each * item;
    GroupWs g;
    g.build = b + w.off_groups;
    g.each = w.group_each;
    g.live = b + w.off_live;
    g.visit = (unsigned long long *)(b + w.off_visit);
    return g;
}

/* Does this step run the pruned scan (the twin's choice: planes, not the margin mode, a scanning
 * step the state says pays; launch 4 counts the step, so this one is steps + 1)? */
__device__ bool step_prunes(const kvt__recall_step_args &x, const StepPlan &pl) {
    return x.g_perm && x.mode != KVT__RECALL_MARGIN && pl.scan &&
           kvt__recall_prune_pays(x.st, x.st->steps + 1u);
}

/* The closed blocks whose groups the step wants built (the twin's min(n_closed / B, cap)), and
 * the grouped blocks after its build: max(n_grouped, that), within the closed rows. */
__device__ uint64_t groups_want(const kvt__recall_step_args &x) {
    const uint64_t w = x.scan.n_closed / x.block_rows;
    return w < x.g_blocks_cap ? w : x.g_blocks_cap;
}

__device__ uint64_t groups_after(const kvt__recall_step_args &x) {
    const uint64_t w = groups_want(x), o = x.st->n_grouped, lim = x.scan.n_closed / x.block_rows;
    const uint64_t n = o > w ? o : w;
    return n < lim ? n : lim;
}

/* The item's group planes as the pruned scan reads them (kvt__recall_groups: block b at slot b),
 * its grouped blocks after this step's build. */
__device__ kvt__recall_groups step_groups(const kvt__recall_step_args &x) {
    kvt__recall_groups g;
    g.block_rows = x.block_rows;
    g.n_blocks = groups_after(x);
    g.dim = x.g_dim;
    g.stride = 1;
    g.perm = x.g_perm;
    g.n_groups = x.g_n;
    g.end = x.g_end;
    g.centre = x.g_centre;
    g.stat = x.g_stat;
    return g;
}

/* Block b's slot in a kvt__recall_groups (stride 0 reads as 1). */
__device__ uint64_t groups_slot(const kvt__recall_groups &g, uint64_t b) {
    return b * (g.stride ? g.stride : 1u);
}

/* One closed block's rows as the build reads them: row u's embedding element j
 * (kvt__recall_embed of the row through its page, its sketch), its ρ. */
struct BlockRows {
    const kvt__recall_scan_args *a;
    uint64_t r0;
    const uint16_t *csk;
    const float *rho;
    __device__ const uint8_t *row(uint32_t u) const {
        return a->base + (size_t)kvt__page_slot(a->pages, a->first_page, a->pdiv,
                                                (uint32_t)(r0 + u)) * a->slot_stride;
    }
    __device__ float x(const uint8_t *p, uint32_t u, uint32_t j) const {
        return kvt__recall_embed(p, a->branch_offset, a->branch_dtype, a->branch_dim,
                                 csk + (size_t)u * a->csk_stride, j);
    }
    /* the fmaf chain over j ascending of (x_j − c_j)² (dot 0: kvt__recall_dist2) or c_j·x_j
     * (dot 1: the twin's projection), from +0 */
    __device__ float chain(uint32_t u, const float *c, uint32_t n, bool dot) const {
        const uint8_t *p = row(u);
        float acc = 0.0f;
        for (uint32_t j = 0; j < n; j++) {
            const float v = x(p, u, j);
            if (dot) {
                acc = fmaf(c[j], v, acc);
            } else {
                const float d = v - c[j];
                acc = fmaf(d, d, acc);
            }
        }
        return acc;
    }
};

/* The member of perm[lo .. lo + cnt) farthest from c: the first in segment order on a tie, a NaN
 * distance never (all NaN: the first). The whole block calls it. */
__device__ uint32_t seg_farthest(const BlockRows &br, const uint32_t *perm, uint32_t lo,
                                 uint32_t cnt, const float *c, uint32_t n) {
    float bv = -INFINITY;
    uint64_t bi = UINT64_MAX;
    for (uint32_t i = threadIdx.x; i < cnt; i += blockDim.x)
        best_take(br.chain(perm[lo + i], c, n, false), i, bv, bi);
    best_reduce(bv, bi);
    return perm[lo + (bi == UINT64_MAX ? 0u : (uint32_t)bi)];
}

/* key[0 .. P) ascending (P a power of two), by the whole block: a bitonic network (the keys
 * are distinct, so any correct sort gives the twin's order). */
__device__ void block_sort_u64(uint64_t *key, uint32_t P) {
    for (uint32_t k = 2; k <= P; k <<= 1)
        for (uint32_t j = k >> 1; j > 0; j >>= 1) {
            for (uint32_t i = threadIdx.x; i < P; i += blockDim.x) {
                const uint32_t l = i ^ j;
                if (l > i) {
                    const uint64_t u = key[i], v = key[l];
                    if ((u > v) == ((i & k) == 0)) {
                        key[i] = v;
                        key[l] = u;
                    }
                }
            }
            __syncthreads();
        }
}

/* The twin's kvt__recall_group_block_cpu (as kvt__recall_group_build_cpu calls it) for closed
 * block blk of the rows of scan view a into the planes of gp (written through its const
 * pointers: the build's own planes), by the whole block of threads: the same segments split at
 * the same cuts (means summed in perm order by a thread per element, the farthest rows by a
 * reduction that keeps the twin's tie rule, the sort of distinct keys, the cut by one thread),
 * the members sorted, the centres and statistics. */
__device__ void group_build_block(const kvt__recall_scan_args &a, const kvt__recall_groups &gp,
                                  uint64_t blk, uint8_t *scr) {
    const uint32_t B = gp.block_rows, dim = gp.dim, G = kvt__recall_group_slots(B);
    const uint32_t n = a.branch_dim + a.rank;
    const uint64_t k = groups_slot(gp, blk);
    uint64_t *key = (uint64_t *)scr;
    float *tv = (float *)(scr + align256(sizeof(uint64_t) * B)), *ts = tv + B;
    float *c = (float *)((uint8_t *)tv + align256(2 * sizeof(float) * B)), *v = c + dim;
    uint32_t *perm = (uint32_t *)gp.perm + k * B, *end = (uint32_t *)gp.end + k * G;
    float *centre = (float *)gp.centre + k * G * dim;
    float *stat = (float *)gp.stat + k * G * KVT__RG_STATS;
    BlockRows br;
    br.a = &a;
    br.r0 = blk * B;
    br.csk = kvt__scan_csk(&a, br.r0);
    br.rho = kvt__scan_rho(&a, br.r0);
    __shared__ uint32_t s_stack[2 * 64], s_sp, s_ng, s_lo, s_hi;
    for (uint32_t u = threadIdx.x; u < B; u += blockDim.x)
        perm[u] = u;
    if (threadIdx.x == 0) {
        s_stack[0] = 0;
        s_stack[1] = B;
        s_sp = 2;
        s_ng = 0;
    }
    for (;;) {
        __syncthreads();
        if (s_sp == 0)
            break;
        __syncthreads(); /* every thread has read s_sp */
        if (threadIdx.x == 0) {
            s_hi = s_stack[--s_sp];
            s_lo = s_stack[--s_sp];
        }
        __syncthreads();
        const uint32_t lo = s_lo, hi = s_hi, cnt = hi - lo;
        if (cnt <= KVT__RECALL_GROUP_MAX) {
            if (threadIdx.x == 0)
                end[s_ng++] = hi;
            continue;
        }
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) { /* the twin's seg_mean */
            float m = 0.0f;
            for (uint32_t i = lo; i < hi; i++)
                m += br.x(br.row(perm[i]), perm[i], j);
            c[j] = m / (float)cnt;
        }
        __syncthreads();
        const uint32_t p1 = seg_farthest(br, perm, lo, cnt, c, n);
        const uint8_t *r1 = br.row(p1);
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x)
            c[j] = br.x(r1, p1, j);
        __syncthreads();
        const uint32_t p2 = seg_farthest(br, perm, lo, cnt, c, n);
        const uint8_t *r2 = br.row(p2);
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x)
            v[j] = br.x(r2, p2, j) - c[j];
        __syncthreads();
        uint32_t P = 1;
        while (P < cnt)
            P <<= 1;
        for (uint32_t i = threadIdx.x; i < P; i += blockDim.x) {
            if (i < cnt) {
                const uint32_t u = perm[lo + i];
                const float t = br.chain(u, v, n, true);
                tv[u] = t;
                key[i] = (uint64_t)kvt__recall_order_key(t) << 32 | u;
            } else {
                key[i] = UINT64_MAX; /* padding: after every key of the segment */
            }
        }
        __syncthreads();
        block_sort_u64(key, P);
        for (uint32_t i = threadIdx.x; i < cnt; i += blockDim.x) {
            const uint32_t u = (uint32_t)key[i];
            perm[lo + i] = u;
            ts[lo + i] = tv[u];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const uint32_t k = kvt__recall_group_cut(ts + lo, cnt);
            s_stack[s_sp++] = lo + k;
            s_stack[s_sp++] = hi;
            s_stack[s_sp++] = lo;
            s_stack[s_sp++] = lo + k;
        }
    }
    const uint32_t ng = s_ng;
    /* members ascending within each group, a thread per group */
    for (uint32_t g = threadIdx.x; g < ng; g += blockDim.x) {
        const uint32_t glo = g ? end[g - 1] : 0u;
        for (uint32_t i = glo + 1; i < end[g]; i++)
            for (uint32_t j = i, u = perm[i]; j > glo && perm[j - 1] > u; j--) {
                perm[j] = perm[j - 1];
                perm[j - 1] = u;
            }
    }
    if (threadIdx.x == 0)
        ((uint32_t *)gp.n_groups)[k] = ng;
    __syncthreads();
    /* centres: a thread per (group, element), the sum in perm order; unused slots zero */
    for (uint32_t t = threadIdx.x; t < G * dim; t += blockDim.x) {
        const uint32_t g = t / dim, j = t % dim;
        float m = 0.0f;
        if (g < ng && j < n) {
            const uint32_t glo = g ? end[g - 1] : 0u, ge = end[g];
            for (uint32_t i = glo; i < ge; i++)
                m += br.x(br.row(perm[i]), perm[i], j);
            m /= (float)(ge - glo);
        }
        centre[t] = m;
    }
    __syncthreads();
    /* statistics: a thread per group slot */
    for (uint32_t g = threadIdx.x; g < G; g += blockDim.x) {
        float *st = stat + (size_t)g * KVT__RG_STATS;
        if (g >= ng) {
            end[g] = B;
            for (uint32_t f = 0; f < KVT__RG_STATS; f++)
                st[f] = 0.0f;
            continue;
        }
        const float *cg = centre + (size_t)g * dim;
        kvt__recall_group_acc acc = kvt__recall_group_acc_new();
        for (uint32_t i = g ? end[g - 1] : 0u; i < end[g]; i++) {
            const uint32_t u = perm[i];
            kvt__recall_group_acc_take(&acc, br.chain(u, cg, n, false), n, br.rho[u],
                                       kvt__recall_csk_norm(br.csk + (size_t)u * a.csk_stride,
                                                            a.rank));
        }
        kvt__recall_group_acc_stat(&acc, kvt__recall_norm2(cg, n), n, st);
    }
}

/* The groups of blocks [from, to) of view a into g's planes, this row of kGroupBlocks blocks of
 * threads taking them in strides (grid x), each with its own scratch of gw. */
__device__ void groups_build(const kvt__recall_scan_args &a, const kvt__recall_groups &g,
                             uint64_t from, uint64_t to, const GroupWs &gw) {
    for (uint64_t blk = from + blockIdx.x; blk < to; blk += gridDim.x) {
        group_build_block(a, g, blk, gw.build + gw.each * blockIdx.x);
        __syncthreads(); /* the scratch is reused by the next block */
    }
}

/* One byte per group slot of g's blocks (live[b·G + j]), 1 where some head of view a (its
 * prepared heads in it) may fire on a member (kvt__recall_group_live with the twin's y·c chain
 * and Y), a thread per slot over the grid's x. */
__device__ void groups_live(const kvt__recall_scan_args &a, const ScanItem &it,
                            const kvt__recall_groups &g, uint8_t *live) {
    const uint32_t G = kvt__recall_group_slots(g.block_rows), D = a.latent_dim;
    const uint32_t bd = a.branch_dim, rank = a.rank;
    const uint64_t slots = g.n_blocks * G;
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < slots;
         t += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t k = groups_slot(g, t / G) * G + t % G; /* the group's plane slot */
        int on = 0;
        if (t % G < g.n_groups[groups_slot(g, t / G)]) {
            const float *c = g.centre + k * g.dim, *stt = g.stat + k * KVT__RG_STATS;
            for (uint32_t h = 0; h < a.n_heads && !on; h++) {
                const float *qb = a.q + (size_t)h * (D + bd) + D, *qs = it.q_sk + (size_t)h * rank;
                const kvt__recall_head hd = it.heads[h];
                on = kvt__recall_group_live(&hd, kvt__recall_group_ynorm(qb, qs, bd, rank),
                                            kvt__recall_group_ydot(qb, qs, c, bd, rank), stt,
                                            a.mode, a.scale, a.z, a.best[h], D, bd, rank);
            }
        }
        live[t] = (uint8_t)on;
    }
}

/* Launch 2b, pruning steps: the groups of closed blocks [n_grouped, want), the item's
 * kGroupBlocks blocks of threads taking them in strides. */
template <class Items>
__device__ void step_groups_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    if (!step_prunes(x, step_plan(step_view(x, w, item), x.st->phase)))
        return;
    groups_build(x.scan, step_groups(x), x.st->n_grouped, groups_want(x), group_ws(w, item));
}

/* Launch 2c, pruning steps: one byte per group slot of the grouped blocks, 1 where some head may
 * fire on a member (kvt__recall_group_live with the twin's y·c chain and Y), a thread per slot;
 * the visited count zeroed. */
template <class Items>
__device__ void step_live_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    const kvt__recall_step_args v = step_view(x, w, item);
    const StepPlan pl = step_plan(v, x.st->phase);
    if (!step_prunes(x, pl))
        return;
    const GroupWs gw = group_ws(w, item);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *gw.visit = 0;
    groups_live(step_scan(v, pl, x.st->z), scan_item(w, item), step_groups(x), gw.live);
}

/* Launch 3 of a pruning step: the flags of the grouped blocks' rows in perm order (those of a
 * group no head can fire on cleared, the others' archived rows evaluated), then the rows past
 * them; the archived rows evaluated counted into the visited count. */
__device__ void scan_rows_pruned(const kvt__recall_scan_args &a, const ScanItem &it,
                                 const kvt__recall_groups &g, const GroupWs &gw) {
    const uint32_t B = g.block_rows, G = kvt__recall_group_slots(B);
    const uint64_t grouped = g.n_blocks * B;
    unsigned long long cnt = 0;
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < a.n_closed;
         t += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t row = t;
        bool on = true;
        if (t < grouped) {
            const uint64_t b = t / B, k = groups_slot(g, b);
            const uint32_t i = (uint32_t)(t % B), ng = g.n_groups[k];
            const uint32_t *end = g.end + k * G;
            uint32_t lo = 0, hi = ng; /* the first group whose end is past i */
            while (lo < hi) {
                const uint32_t mid = (lo + hi) / 2;
                if (end[mid] > i)
                    hi = mid;
                else
                    lo = mid + 1;
            }
            row = b * B + g.perm[k * B + i];
            on = lo < ng && gw.live[b * G + lo];
        }
        const bool arch = row >= a.sinks && !kvt__sorted_has(a.kept, a.m, row);
        cnt += on && arch;
        it.flags[row] = on && arch && scan_fires(a, it, (uint32_t)row);
    }
    if (cnt)
        atomicAdd(gw.visit, cnt);
}

/* Launch 3: the scan's fire flags, scanning steps only. */
template <class Items>
__device__ void step_rows_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    const kvt__recall_step_args v = step_view(x, w, item);
    const StepPlan pl = step_plan(v, x.st->phase);
    if (!pl.scan)
        return;
    if (step_prunes(x, pl))
        scan_rows_pruned(step_scan(v, pl, x.st->z), scan_item(w, item), step_groups(x),
                         group_ws(w, item));
    else
        scan_rows(step_scan(v, pl, x.st->z), scan_item(w, item));
}

/* The heads' samples into the sorted array, as kvt__conformal_insert one by one in head order
 * leaves it, by the whole block: the first `room` valid samples in head order go in (the rest are
 * dropped, as past the cap), each value moved to where kvt__conformal_merged_old / _new say
 * (never computed, so the bits are the twin's); then n_samples. */
/* e[0 .. n) (NaN: none) into samples[0 .. n0) (sorted, at most cap), by the whole block, with
 * valid / nw [n] and old [n0] as scratch; thread 0 writes the new count to *n_out. */
__device__ void samples_merge(const float *e, uint32_t n, uint32_t *valid, float *nw, float *old,
                              float *samples, uint32_t cap, uint32_t n0, uint32_t *n_out) {
    const uint32_t room = n0 < cap ? cap - n0 : 0;
    const uint32_t total = block_compact(
        n, [&](uint32_t h) { return !isnan(e[h]); }, valid, room);
    const uint32_t v = total < room ? total : room;
    for (uint32_t j = threadIdx.x; j < v; j += blockDim.x)
        nw[j] = e[valid[j]];
    for (uint32_t t = threadIdx.x; t < n0; t += blockDim.x)
        old[t] = samples[t];
    __syncthreads();
    for (uint32_t t = threadIdx.x; t < n0; t += blockDim.x)
        samples[kvt__conformal_merged_old(nw, v, t, old[t])] = old[t];
    for (uint32_t j = threadIdx.x; j < v; j += blockDim.x)
        samples[kvt__conformal_merged_new(old, n0, nw, v, j)] = nw[j];
    __syncthreads();
    if (threadIdx.x == 0)
        *n_out = n0 + v;
}

__device__ void step_insert(const kvt__recall_step_args &x, const StepExtra &ex, uint32_t n0) {
    samples_merge(ex.e, x.scan.n_heads, ex.valid, ex.nw, ex.old, x.samples, x.sample_cap, n0,
                  &x.st->n_samples);
}

/* Launch 4: one block per item (a row of blocks walks several). */
template <class Items>
__device__ void step_finish_item(const Items &p, const ScanWs &w, uint32_t item) {
    kvt__recall_step_args x;
    kvt__div32 x_div;
    const int got = p.get(item, x, x_div);
    if (got == kItemBad && threadIdx.x == 0 && x.st) {
        /* a planned item the device cannot run: its step attends every row (never a wrong set) */
        x.st->last_dense = 1;
        if (x.dense)
            *x.dense = 1;
    }
    if (got != kItemOk)
        return;
    x.scan.pdiv = &x_div;
    kvt__recall_state *st = x.st;
    __shared__ uint32_t s_phase, s_n, s_prune;
    __shared__ float s_z;
    const kvt__recall_step_args v = step_view(x, w, item);
    if (threadIdx.x == 0) {
        s_phase = st->phase;
        s_z = st->z;
        s_n = st->n_samples;
        s_prune = step_prunes(x, step_plan(v, s_phase));
    }
    __syncthreads();
    const StepPlan pl = step_plan(v, s_phase);
    uint32_t dense = 0, over = 0, n_fired = 0;
    uint64_t visited = 0, fired = 0, fetched = 0;
    if (pl.calib) {
        step_insert(x, step_extra(w, item, x.scan.n_heads), s_n);
        if (threadIdx.x == 0) {
            st->cal_steps++;
            st->phase = kvt__conformal_close(x.samples, st->n_samples, st->cal_steps, &st->z,
                                             &st->k, &st->clamped);
            st->calib_steps++;
        }
        dense = 1;
        visited = fetched = pl.archived;
    } else if (pl.scan) {
        const kvt__recall_scan_args a = step_scan(v, pl, s_z);
        const uint32_t total = scan_compact(a, scan_item(w, item).flags);
        n_fired = total < a.cap ? total : a.cap;
        over = total > a.cap ? 1u : 0u;
        dense = over;
        visited = pl.archived; /* the full scan's: every archived row */
        if (s_prune)
            visited = *group_ws(w, item).visit;
        fired = (uint64_t)n_fired + over;
        fetched = over ? pl.archived : n_fired;
    }
    __syncthreads(); /* the fired rows are in x.scan.fired for thread 0 */
    if (threadIdx.x != 0)
        return;
    *x.scan.n_fired = dense || pl.archived == 0 ? 0u : n_fired;
    *x.scan.overflow = over;
    if (x.promo) {
        /* the promoted rows' hits (launch 2's flags), then the candidates, the fetch buffer and
         * the promotions: the twin's kvt__promo_after, on one thread */
        const kvt__promo_view pv = kvt__promo_of(&x);
        const PromoWs pw = promo_ws(w, item, x);
        for (uint32_t i = 0; i < pv.h->n_prom; i++)
            pv.prom_hist[i] = kvt__promo_hist_next(pv.prom_hist[i], pw.hit[i], pv.mask);
        kvt__promo_after(&x, &pv, x.scan.fired, x.scan.n_fired, *x.scan.n_fired, dense != 0,
                         pw.tmp);
    }
    const uint64_t want = s_prune ? groups_want(x) : 0; /* the twin's build_groups */
    if (want > st->n_grouped)
        st->n_grouped = (uint32_t)want;
    st->steps++;
    st->overflow_steps += over;
    kvt__recall_state_record(st, x.dense, dense, over, pl.archived, visited, fired, fetched);
}

/* The launches: each walks the items in strides of its grid's item dimension (eager: a block
 * row an item; planned: at most kPlanItems rows over n_max items, most of them past the step's
 * count), so an item's blocks call the item's function together. */
template <class Items>
__global__ void k_promo_before(const Items p, const ScanWs w) {
    for (uint32_t i = blockIdx.x; i < p.count(); i += gridDim.x)
        promo_before_item(p, w, i);
}

/* A launch whose grid's y walks the items, each item's function called by its row of blocks. */
#define STEP_KERNEL_Y(name, item_fn)                                                               \
    template <class Items> __global__ void name(const Items p, const ScanWs w) {                   \
        for (uint32_t i = blockIdx.y; i < p.count(); i += gridDim.y)                               \
            item_fn(p, w, i);                                                                      \
    }
STEP_KERNEL_Y(k_step_heads, step_heads_item)
STEP_KERNEL_Y(k_step_best, step_best_item)
STEP_KERNEL_Y(k_step_groups, step_groups_item)
STEP_KERNEL_Y(k_step_live, step_live_item)
STEP_KERNEL_Y(k_step_rows, step_rows_item)

template <class Items>
__global__ void k_step_finish(const Items p, const ScanWs w) {
    for (uint32_t i = blockIdx.x; i < p.count(); i += gridDim.x) {
        __syncthreads(); /* the last item's shared values read by every thread */
        step_finish_item(p, w, i);
    }
}

/* What a step launch needs to know of its items beyond the workspace: the most heads, closed
 * rows and group slots of grouped blocks among them, whether any promotes or has group planes. */
struct StepShape {
    uint32_t H;
    size_t rows, group_slots;
    bool promo, groups;
};

/* The workspace layout of k items a[0 .. k) (each item `each` bytes apart): the scan's, then
 * step_extra's (its offsets from each item's own head count fit in this), then promotion's
 * (PromoWs, sized for the largest item), then the pruned scan's (GroupWs: the largest block and
 * centre, the most group slots). */
ScanWs step_ws_of(const kvt__recall_step_args *a, uint32_t k, StepShape *sh) {
    uint32_t h = 0, cap = 0;
    size_t promo = 0, gbuild = 0, gslots = 0;
    sh->promo = sh->groups = false;
    for (uint32_t i = 0; i < k; i++) {
        h = a[i].scan.n_heads > h ? a[i].scan.n_heads : h;
        cap = a[i].sample_cap > cap ? a[i].sample_cap : cap;
        const size_t u = promo_ws_u32(a[i]);
        promo = u > promo ? u : promo;
        sh->promo |= a[i].promo != NULL;
        if (a[i].g_perm && a[i].block_rows) {
            const size_t gb = group_build_bytes(a[i].block_rows, a[i].g_dim);
            const size_t gs = a[i].scan.n_closed / KVT__RECALL_GROUP_MIN; /* any B's slots */
            gbuild = gb > gbuild ? gb : gbuild;
            gslots = gs > gslots ? gs : gslots;
            sh->groups = true;
        }
    }
    const size_t extra = align256(3 * align256(sizeof(float) * h) + sizeof(float) * cap);
    const size_t promo_b = align256(sizeof(uint32_t) * promo);
    const size_t groups_b = sh->groups ? kGroupBlocks * gbuild + align256(gslots) + 256 : 0;
    ScanWs w = scan_ws_of(&a[0].scan, sizeof *a, k, extra + promo_b + groups_b, &sh->H, &sh->rows);
    w.off_promo = w.off_extra + extra;
    if (sh->groups) {
        w.off_groups = w.off_promo + promo_b;
        w.group_each = gbuild;
        w.off_live = w.off_groups + kGroupBlocks * gbuild;
        w.off_visit = w.off_live + align256(gslots);
    }
    sh->group_slots = gslots;
    return w;
}

/* The launches over the items of `items`, k rows of blocks for them (grid: heads x k, rows x k;
 * each row walks the items in strides of k; rows_x: the per-row launches' blocks an item). */
template <class Items>
void step_launch(const Items &items, const ScanWs &w, uint32_t k, const StepShape &sh,
                 uint32_t rows_x, void *stream) {
    if (sh.promo)
        k_promo_before<<<k, kThreads, 0, strm(stream)>>>(items, w);
    if (sh.H) {
        k_step_heads<<<dim3(sh.H, k), kThreads, 0, strm(stream)>>>(items, w);
        k_step_best<<<dim3(sh.H, k), kThreads, 0, strm(stream)>>>(items, w);
    }
    if (sh.groups) {
        k_step_groups<<<dim3(kGroupBlocks, k), kThreads, 0, strm(stream)>>>(items, w);
        size_t lb = (sh.group_slots + kThreads - 1) / kThreads; /* a thread a group slot */
        lb = lb < 1 ? 1 : rows_x && lb > rows_x ? rows_x : lb;  /* at most the rows' blocks */
        k_step_live<<<dim3((unsigned)lb, k), kThreads, 0, strm(stream)>>>(items, w);
    }
    if (rows_x)
        k_step_rows<<<dim3(rows_x, k), kThreads, 0, strm(stream)>>>(items, w);
    k_step_finish<<<k, kThreads, 0, strm(stream)>>>(items, w);
}

kvt_status cu_recall_step(const kvt__backend *be, const kvt__recall_step_args *a, uint32_t n,
                          void *stream) {
    for (uint32_t i = 0; i < n; i++)
        if (!step_args_ok(a[i]))
            return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream);
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxStep) {
        const uint32_t k = n - i0 < kMaxStep ? n - i0 : kMaxStep;
        StepShape sh;
        ScanWs w = step_ws_of(a + i0, k, &sh);
        if ((s = ws_get(be, stream, w.each * k, &w.base)) != KVT_OK)
            break;
        const EagerItems items = {step_params(a + i0, k)};
        step_launch(items, w, k, sh, sh.rows ? rows_grid(sh.rows, k).x : 0u, stream);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* The planned op (kvt__recall_plan_args): the layout of n_max items of the bound's shape and
 * the grids, fixed for the batch's life, so a captured launch replays over any later step: at
 * most kPlanItems rows of blocks walk the step's items (a step with few recalling requests
 * launches few idle blocks), rows in strides of at most kPlanRowBlocks blocks an item (the
 * bound's rows may be far more than a step's). */
constexpr uint32_t kPlanRowBlocks = 64;
constexpr uint32_t kPlanItems = 16;

size_t plan_ws_bytes(const kvt__recall_plan_args *a, ScanWs *w, StepShape *sh) {
    *w = step_ws_of(&a->bound, 1, sh);
    return w->each * a->n_max;
}

kvt_status cu_recall_plan_reserve(const kvt__backend *be, const kvt__recall_plan_args *a) {
    ScanWs w;
    StepShape sh;
    const size_t bytes = plan_ws_bytes(a, &w, &sh);
    cuda_impl *c = (cuda_impl *)be->impl;
    return reserve_on(be, &c->plan_ws, &c->plan_ws_bytes, bytes);
}

/* After a planned step's finish: each item's own queries into its lagged-query buffer (the
 * next step's), a row of blocks walking the items. */
__global__ void k_plan_lag(const PlanItems p) {
    for (uint32_t i = blockIdx.x; i < p.count(); i += gridDim.x) {
        kvt__recall_step_args x;
        kvt__div32 d;
        const kvt__recall_plan_item &it = p.a.items[i];
        if (p.get(i, x, d) != kItemOk || !it.lag)
            continue;
        const float *src = p.a.query + it.q_off;
        const size_t qf = (size_t)x.scan.n_heads * (x.scan.latent_dim + x.scan.branch_dim);
        for (size_t j = threadIdx.x; j < qf; j += blockDim.x)
            it.lag[j] = src[j];
    }
}

kvt_status cu_recall_step_planned(const kvt__backend *be, const kvt__recall_plan_args *a,
                                  void *stream) {
    if (a->n_max == 0)
        return KVT_OK;
    if (a->n_max > 65535u || !a->items || !a->n)
        return KVT_ERR_INVALID_ARGUMENT;
    ScanWs w;
    StepShape sh;
    const size_t bytes = plan_ws_bytes(a, &w, &sh);
    kvt_status s = op_begin(be, stream, true);
    if (s == KVT_OK)
        s = plan_ws_get(be, bytes, &w.base);
    if (s == KVT_OK) {
        const PlanItems items = {*a};
        const uint32_t k = a->n_max < kPlanItems ? a->n_max : kPlanItems;
        uint32_t rx = sh.rows ? rows_grid(sh.rows, k).x : 0u;
        step_launch(items, w, k, sh, rx < kPlanRowBlocks ? rx : kPlanRowBlocks, stream);
        k_plan_lag<<<k, kThreads, 0, strm(stream)>>>(items); /* items without one: nothing */
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * RoPE recall (recall_rope_step, recall_rope_emit): the CPU twin kvt__recall_rope_step_cpu
 * (kernels/rope_trigger.c) per request = grid z (up to kMaxRope a launch: the library calls the
 * op once per layer for the batch), KV head h = grid y, its G query heads = grid x; each
 * (request, KV head) a scan item of the workspace (request r's head h: item r·KV + h, KV the
 * most KV heads of the launch), each KV head's scan view built on the device
 * (kvt__recall_rope_view):
 *   1. the query heads prepared against their KV head's basis (scan_head on the head's view,
 *      kvt__recall_rope_view: its archive as a scan over slots 0 .. ar_n);
 *   2. one block per query head: its best exact score over the table's rows (kvt__recall_exact:
 *      each row's chain is the twin's, the max is order-free), and on a calibration step its
 *      best archived row (ties to the lower index: the twin's first-seen) with its sample;
 *   3. the scan's fire flags of each KV head's archive, with the state's z, on scanning steps;
 *   4. one block per request: the samples merged in query-head order (as kvt__conformal_insert
 *      one by one) and z fixed at a window end, or each head's fired rows compacted, the first W
 *      of them; capped (a host archive): the calibration's rows, no dense step; the certificate.
 * The emission (k_rope_emit) is one launch for the call's requests: per request and KV head its
 * list (the table's slots, then its fetched rows copied into the fetch area); one block a
 * request, or, when lists are chained (each starts where the previous request's ended, a device
 * value), one block taking the requests in order.
 * -------------------------------------------------------------------------------------------- */
constexpr uint32_t kMaxRope = 32;
typedef Params<kvt__recall_rope_args, kMaxRope> RopeParams;
static_assert(sizeof(RopeParams) <= 32000, "kernel parameters above CUDA's 32 KB");

/* Where a RoPE launch's requests come from (the kernels are templates over it, as the NoPE
 * step's: EagerItems / PlanItems): the eager op's arguments by value, or a batch's plan buffer
 * as it is when the kernel runs (recall_rope_step_planned). get(): kItemOk with the request in
 * x (its divider in d), kItemNone past them, kItemBad for a planned item that breaks the rules
 * or the plan's bound. */
typedef EagerOf<kvt__recall_rope_args, kMaxRope> RopeEager;
typedef PlanOf<kvt__recall_rope_plan_args, kvt__recall_rope_args, kvt__recall_rope_plan_item_args>
    RopePlan;

/* Request r as `a` (its divider local), or return when it is none or bad. */
#define ROPE_ITEM(src, r)                                                                          \
    kvt__recall_rope_args a;                                                                       \
    kvt__div32 a_div;                                                                              \
    if ((src).get(r, a, a_div) != kItemOk)                                                         \
        return;                                                                                    \
    a.pdiv = &a_div

/* A launch whose grid's z walks the requests (each request's function by its blocks). */
#define ROPE_KERNEL_Z(name, item_fn)                                                               \
    template <class Items> __global__ void name(const Items p, const ScanWs w, uint32_t KV) {      \
        for (uint32_t r = blockIdx.z; r < p.count(); r += gridDim.z)                               \
            item_fn(p, w, KV, r);                                                                  \
    }

/* KV head h's scan view with the step's z (the state's in conformal mode). */
__device__ kvt__recall_scan_args rope_view(const kvt__recall_rope_args &a, uint32_t h,
                                           float state_z) {
    kvt__recall_scan_args v;
    kvt__recall_rope_view(&a, h, kvt__recall_mode_z(a.mode, a.D, a.margin, state_z), &v);
    return v;
}

__device__ bool rope_calibrating(const kvt__recall_rope_args &a, uint32_t phase) {
    return a.ar_n && a.mode == KVT__RECALL_CONFORMAL && phase == KVT__CONFORMAL_OPEN;
}

/* Does this RoPE step run the pruned scan on its KV heads with a basis (the twin's choice:
 * group planes, not the margin mode, a scanning step the state says pays; launch 4 counts the
 * step, so this one is steps + 1)? */
__device__ bool rope_prunes(const kvt__recall_rope_args &a, uint32_t phase) {
    return a.g_perm && a.mode != KVT__RECALL_MARGIN && a.ar_n && !rope_calibrating(a, phase) &&
           kvt__recall_prune_pays(a.st, a.st->steps + 1u);
}

/* Does KV head h (a head of a, with a basis) run the pruned scan this step? */
__device__ bool rope_head_prunes(const kvt__recall_rope_args &a, uint32_t h) {
    return h < a.n_kv && a.rank[h] && rope_prunes(a, a.st->phase);
}

/* The archive blocks whose groups the step wants built (the twin's min(ar_n / g_B, cap)). */
__device__ uint64_t rope_groups_want(const kvt__recall_rope_args &a) {
    const uint64_t w = a.ar_n / a.g_B;
    return w < a.g_blocks_cap ? w : a.g_blocks_cap;
}

/* KV head h's group planes (block b at slot b·n_kv + h, kernels/rope_trigger.h), its grouped
 * blocks after this step's build: max(n_grouped, want), within the archive. */
__device__ kvt__recall_groups rope_groups(const kvt__recall_rope_args &a, uint32_t h) {
    const uint32_t B = a.g_B, G = kvt__recall_group_slots(B);
    const uint64_t w = rope_groups_want(a), o = a.st->n_grouped, lim = a.ar_n / B;
    const uint64_t nb = o > w ? o : w;
    kvt__recall_groups g;
    g.block_rows = B;
    g.n_blocks = nb < lim ? nb : lim;
    g.dim = a.g_dim;
    g.stride = a.n_kv;
    g.perm = a.g_perm + (size_t)h * B;
    g.n_groups = a.g_n + h;
    g.end = a.g_end + (size_t)h * G;
    g.centre = a.g_centre + (size_t)h * G * a.g_dim;
    g.stat = a.g_stat + (size_t)h * G * KVT__RG_STATS;
    return g;
}

/* The step's own workspace after the scan items': each query head's sample e [nq] (NaN: none)
 * and best archived row [nq] (UINT32_MAX: none), the valid samples' heads [nq] and values [nq],
 * the samples as the step found them [sample_cap]. */
struct RopeExtra {
    float *e;
    uint32_t *arg, *valid;
    float *nw, *old;
    uint32_t *keys; /* capped: [n_kv][ar_n] the overflow's priorities */
};

__device__ RopeExtra rope_extra(const ScanWs &w, uint32_t item0, uint32_t nq,
                                uint32_t sample_cap) {
    uint8_t *b = w.base + w.each * item0 + w.off_extra; /* the request's first item's extra */
    const size_t hb = align256(sizeof(float) * nq);
    RopeExtra x;
    x.e = (float *)b;
    x.arg = (uint32_t *)(b + hb);
    x.valid = (uint32_t *)(b + 2 * hb);
    x.nw = (float *)(b + 3 * hb);
    x.old = (float *)(b + 4 * hb);
    x.keys = (uint32_t *)(b + 4 * hb + align256(sizeof(float) * sample_cap));
    return x;
}

template <class Items>
__device__ void rope_heads_item(const Items &p, const ScanWs &w, uint32_t KV, uint32_t r) {
    ROPE_ITEM(p, r);
    const uint32_t h = blockIdx.y;
    if (h < a.n_kv && blockIdx.x < a.group && a.ar_n)
        scan_head(rope_view(a, h, 0.0f), scan_item(w, r * KV + h), blockIdx.x);
}
ROPE_KERNEL_Z(k_rope_heads, rope_heads_item)

__device__ const uint8_t *rope_table_key(const kvt__recall_rope_args &a, uint32_t h,
                                         uint64_t row) {
    return a.keys +
           (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, (uint32_t)row) * a.slot_stride +
           (size_t)h * a.row_bytes;
}

template <class Items>
__device__ void rope_best_item(const Items &p, const ScanWs &w, uint32_t KV, uint32_t r) {
    ROPE_ITEM(p, r);
    const uint32_t h = blockIdx.y, g = blockIdx.x, G = a.group, t = h * G + g;
    const uint32_t item0 = r * KV;
    if (h >= a.n_kv || g >= G)
        return;
    const uint32_t D = a.D, bd = a.branch_dim;
    const int bt = bd ? a.branch_dtype : a.dtype;
    const float *q = a.q + (size_t)t * (D + bd);
    float bv = -INFINITY;
    uint64_t br = UINT64_MAX;
    for (uint64_t r = threadIdx.x; r < a.n_rows; r += blockDim.x)
        best_take(kvt__recall_exact(q, rope_table_key(a, h, r), a.dtype, D, a.branch_offset, bt,
                                    bd, 1.0f),
                  r, bv, br);
    best_reduce(bv, br);
    if (threadIdx.x == 0)
        a.best[t] = bv;
    if (!rope_calibrating(a, a.st->phase))
        return;
    const RopeExtra ex = rope_extra(w, item0, a.n_kv * G, a.sample_cap);
    bv = -INFINITY;
    br = UINT64_MAX;
    for (uint64_t k = threadIdx.x; k < a.ar_n; k += blockDim.x)
        best_take(kvt__recall_exact(q, a.ar_bytes + ((size_t)h * a.ar_cap + k) * a.ar_row_bytes,
                                    a.dtype, D, a.branch_offset, bt, bd, 1.0f),
                  k, bv, br);
    best_reduce(bv, br);
    if (threadIdx.x != 0)
        return;
    float e = NAN;
    ex.arg[t] = br == UINT64_MAX ? UINT32_MAX : (uint32_t)br;
    if (br != UINT64_MAX) {
        const kvt__recall_scan_args v = rope_view(a, h, 0.0f);
        const ScanItem it = scan_item(w, item0 + h);
        float P, ncsk, sv;
        const float idx = kvt__recall_idx(q, it.q_sk + (size_t)g * v.rank,
                                          a.ar_bytes + ((size_t)h * a.ar_cap + br) * a.ar_row_bytes,
                                          D, a.branch_offset, bt, bd,
                                          v.csk + (size_t)br * v.csk_stride, v.rank, 1.0f, &P,
                                          &ncsk);
        const kvt__recall_head hd = it.heads[g];
        const float cert = kvt__recall_cert(&hd, v.rho[br], 1.0f, D);
        if (kvt__conformal_sample(bv, idx, cert, &sv))
            e = sv;
    }
    ex.e[t] = e;
}
ROPE_KERNEL_Z(k_rope_best, rope_best_item)

/* Launch 3: each KV head's fire flags (grid y), scanning steps only. */
template <class Items>
__device__ void rope_rows_item(const Items &p, const ScanWs &w, uint32_t KV, uint32_t r) {
    ROPE_ITEM(p, r);
    const uint32_t h = blockIdx.y;
    if (h >= a.n_kv || !a.ar_n || rope_calibrating(a, a.st->phase))
        return;
    const kvt__recall_scan_args v = rope_view(a, h, a.st->z);
    if (rope_head_prunes(a, h))
        scan_rows_pruned(v, scan_item(w, r * KV + h), rope_groups(a, h), group_ws(w, r * KV + h));
    else
        scan_rows(v, scan_item(w, r * KV + h));
}
ROPE_KERNEL_Z(k_rope_rows, rope_rows_item)

/* Launch 2b, pruning steps: each KV head with a basis (grid y) builds the groups of its
 * archive blocks [n_grouped, want), kGroupBlocks blocks of threads (grid x) in strides. */
template <class Items>
__device__ void rope_groups_item(const Items &p, const ScanWs &w, uint32_t KV, uint32_t r) {
    ROPE_ITEM(p, r);
    const uint32_t h = blockIdx.y;
    if (!rope_head_prunes(a, h))
        return;
    groups_build(rope_view(a, h, 0.0f), rope_groups(a, h), a.st->n_grouped, rope_groups_want(a),
                 group_ws(w, r * KV + h));
}
ROPE_KERNEL_Z(k_rope_groups, rope_groups_item)

/* Launch 2c, pruning steps: each KV head's group liveness over its query heads, its visited
 * count zeroed. */
template <class Items>
__device__ void rope_live_item(const Items &p, const ScanWs &w, uint32_t KV, uint32_t r) {
    ROPE_ITEM(p, r);
    const uint32_t h = blockIdx.y;
    if (!rope_head_prunes(a, h))
        return;
    const GroupWs gw = group_ws(w, r * KV + h);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *gw.visit = 0;
    groups_live(rope_view(a, h, a.st->z), scan_item(w, r * KV + h), rope_groups(a, h), gw.live);
}
ROPE_KERNEL_Z(k_rope_live, rope_live_item)

/* Launch 3b (capped): each archived row's overflow priority per KV head (grid y), the CPU
 * twin's capped_choice keys: the scan's fire test and max_g (idx_g − best_g). */
template <class Items>
__device__ void rope_keys_item(const Items &p, const ScanWs &w, uint32_t KV, uint32_t r) {
    ROPE_ITEM(p, r);
    const uint32_t h = blockIdx.y;
    if (h >= a.n_kv || !a.capped || !a.ar_n || rope_calibrating(a, a.st->phase))
        return;
    const kvt__recall_scan_args v = rope_view(a, h, a.st->z);
    const ScanItem it = scan_item(w, r * KV + h);
    uint32_t *keys =
        rope_extra(w, r * KV, a.n_kv * a.group, a.sample_cap).keys + (size_t)h * a.ar_n;
    const size_t qw = (size_t)v.latent_dim + v.branch_dim;
    for (uint64_t k = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; k < a.ar_n;
         k += (uint64_t)gridDim.x * blockDim.x) {
        const uint8_t *row = v.base + (size_t)k * v.slot_stride;
        const uint16_t *csk = v.csk + (size_t)k * v.csk_stride;
        int fires = 0;
        float score = -INFINITY;
        for (uint32_t g = 0; g < v.n_heads; g++) {
            float P, ncsk;
            const float idx = kvt__recall_idx(v.q + g * qw, it.q_sk + (size_t)g * v.rank, row,
                                              v.latent_dim, v.branch_offset, v.branch_dtype,
                                              v.branch_dim, csk, v.rank, 1.0f, &P, &ncsk);
            const kvt__recall_head hd = it.heads[g];
            fires |= kvt__recall_rope_fires(&v, &hd, g, idx, P, ncsk, v.rho[k]);
            const float sc = idx - v.best[g];
            if (sc > score || sc != sc)
                score = sc;
        }
        keys[k] = kvt__recall_rope_capped_key(fires, score);
    }
}

ROPE_KERNEL_Z(k_rope_keys, rope_keys_item)

/* Launch 4: one block per request (a row of blocks walks several). */
template <class Items>
__device__ void rope_finish_item(const Items &p, const ScanWs &w, uint32_t KV, uint32_t r) {
    kvt__recall_rope_args a;
    kvt__div32 a_div;
    const int got = p.get(r, a, a_div);
    if (got == kItemBad && threadIdx.x == 0 && a.st) {
        /* a planned item the device cannot run: its step attends every row (never a wrong set);
         * a host archive's, whose lists ignore the dense flag, only its held rows (no fetch) */
        a.st->last_dense = a.capped ? 0u : 1u;
        for (uint32_t h = 0; a.n_fired && h < a.n_kv && h < KVT__RECALL_ROPE_MAX_KV; h++)
            a.n_fired[h] = 0;
        if (a.dense)
            *a.dense = a.capped ? 0 : 1;
    }
    if (got != kItemOk)
        return;
    a.pdiv = &a_div;
    const uint32_t item0 = r * KV;
    kvt__recall_state *st = a.st;
    const uint32_t H = a.n_kv, G = a.group, nq = H * G;
    __shared__ uint32_t s_phase, s_n, s_prune;
    __shared__ float s_z;
    __shared__ uint32_t s_over;
    __shared__ unsigned long long s_fired, s_fetched;
    if (threadIdx.x == 0) {
        s_phase = st->phase;
        s_z = st->z;
        s_n = st->n_samples;
        s_prune = rope_prunes(a, s_phase);
        s_over = 0;
        s_fired = s_fetched = 0;
    }
    __syncthreads();
    const uint64_t archived = a.ar_n * H;
    const bool calib = rope_calibrating(a, s_phase);
    uint32_t dense = 0;
    if (a.ar_n == 0) {
        /* nothing to recall */
    } else if (calib) {
        const RopeExtra ex = rope_extra(w, item0, nq, a.sample_cap);
        samples_merge(ex.e, nq, ex.valid, ex.nw, ex.old, a.samples, a.sample_cap, s_n,
                      &st->n_samples);
        if (threadIdx.x == 0) {
            st->cal_steps++;
            st->phase = kvt__conformal_close(a.samples, st->n_samples, st->cal_steps, &st->z,
                                             &st->k, &st->clamped);
            st->calib_steps++;
            /* capped: each KV head fetches its query heads' best rows, distinct, ascending */
            for (uint32_t h = 0; h < H; h++) {
                uint32_t n = 0, last = 0;
                bool any = false;
                while (a.capped && n < a.cap) {
                    uint32_t next = UINT32_MAX;
                    for (uint32_t g = 0; g < G; g++) {
                        const uint32_t r = ex.arg[h * G + g];
                        if (r != UINT32_MAX && (!any || r > last) && r < next)
                            next = r;
                    }
                    if (next == UINT32_MAX)
                        break;
                    a.fired[(size_t)h * a.cap + n++] = last = next;
                    any = true;
                }
                a.n_fired[h] = a.capped ? n : 0;
                a.overflow[h] = 0;
                s_fetched += a.capped ? n : 0;
            }
        }
        dense = !a.capped;
    } else {
        for (uint32_t h = 0; h < H; h++) {
            const kvt__recall_scan_args v = rope_view(a, h, s_z);
            const uint32_t total = scan_compact(v, scan_item(w, item0 + h).flags);
            if (a.capped && total > a.cap) { /* the cap best fired rows, not the first */
                __syncthreads();
                block_topm(rope_extra(w, item0, nq, a.sample_cap).keys + (size_t)h * a.ar_n,
                           (uint32_t)a.ar_n, a.cap, a.fired + (size_t)h * a.cap);
                __syncthreads();
            }
            if (threadIdx.x == 0) {
                const uint32_t nf = total < a.cap ? total : a.cap, over = total > a.cap ? 1u : 0u;
                a.n_fired[h] = nf;
                a.overflow[h] = over;
                s_fired += (uint64_t)nf + over;
                s_fetched += nf;
                s_over |= over;
            }
            __syncthreads();
        }
        dense = s_over && !a.capped;
    }
    if (threadIdx.x != 0)
        return;
    if (a.ar_n == 0)
        for (uint32_t h = 0; h < H; h++)
            a.n_fired[h] = a.overflow[h] = 0;
    const uint32_t over = a.ar_n && !calib ? s_over : 0u;
    if (dense)
        for (uint32_t h = 0; h < H; h++)
            a.n_fired[h] = 0;
    /* visited: every archived row, but a pruned head's the rows its scan evaluated */
    uint64_t visited = archived;
    for (uint32_t h = 0; s_prune && h < H; h++)
        visited += a.rank[h] ? (uint64_t)*group_ws(w, item0 + h).visit - a.ar_n : 0;
    const uint64_t want = s_prune ? rope_groups_want(a) : 0; /* the twin's n_grouped */
    if (want > st->n_grouped)
        st->n_grouped = (uint32_t)want;
    st->steps++;
    st->overflow_steps += over;
    kvt__recall_state_record(st, a.dense, dense, over, archived, a.ar_n ? visited : 0, s_fired,
                             dense ? archived : s_fetched);
}

template <class Items>
__global__ void k_rope_finish(const Items p, const ScanWs w, uint32_t KV) {
    for (uint32_t r = blockIdx.x; r < p.count(); r += gridDim.x) {
        __syncthreads(); /* the last request's shared values read by every thread */
        rope_finish_item(p, w, KV, r);
    }
}

/* The workspace of k RoPE steps a[0 .. k): KV items a request (its KV heads' scans, the most
 * KV heads among them), sized for the largest view and the largest step extra (each query
 * head's values, the samples, a capped archive's keys); the most query heads a KV head (Gmax)
 * and archived rows (rows) among them. */
ScanWs rope_ws_of(const kvt__recall_rope_args *a, uint32_t k, uint32_t *KV, uint32_t *Gmax,
                  size_t *rows) {
    size_t qsk = 0, res = 0, extra = 0, gbuild = 0, gslots = 0;
    bool groups = false;
    uint32_t kv = 1, G = 0;
    *rows = 0;
    for (uint32_t i = 0; i < k; i++) {
        const kvt__recall_rope_args &x = a[i];
        uint32_t rmax = 0;
        for (uint32_t h = 0; h < x.n_kv; h++)
            rmax = x.rank[h] > rmax ? x.rank[h] : rmax;
        const size_t q1 = (size_t)x.group * rmax, r1 = (size_t)x.group * x.D;
        const uint32_t nq = x.n_kv * x.group;
        const size_t e1 = 4 * align256(sizeof(float) * nq) + align256(sizeof(float) * x.sample_cap) +
                          (x.capped ? sizeof(uint32_t) * x.n_kv * x.ar_n : 0);
        if (x.g_perm && x.g_B) { /* each KV head's pruned scan: GroupWs */
            const size_t gb = group_build_bytes(x.g_B, x.g_dim), gs = x.ar_n / KVT__RECALL_GROUP_MIN;
            gbuild = gb > gbuild ? gb : gbuild;
            gslots = gs > gslots ? gs : gslots;
            groups = true;
        }
        qsk = q1 > qsk ? q1 : qsk;
        res = r1 > res ? r1 : res;
        extra = e1 > extra ? e1 : extra;
        *rows = x.ar_n > *rows ? x.ar_n : *rows;
        kv = x.n_kv > kv ? x.n_kv : kv;
        G = x.group > G ? x.group : G;
    }
    *KV = kv;
    *Gmax = G;
    const size_t groups_b = groups ? kGroupBlocks * gbuild + align256(gslots) + 256 : 0;
    ScanWs w = scan_ws_make(qsk, res, G, *rows, align256(extra) + groups_b);
    if (groups) {
        w.off_groups = w.off_extra + align256(extra);
        w.group_each = gbuild;
        w.off_live = w.off_groups + kGroupBlocks * gbuild;
        w.off_visit = w.off_live + align256(gslots);
    }
    return w;
}

/* The launches over `items`: grid (query heads, KV heads, k rows of requests; each row walks
 * the requests in strides of k), rows_x blocks a (request, KV head) for the per-row launches. */
template <class Items>
void rope_launch(const Items &items, const ScanWs &w, uint32_t KV, uint32_t G, uint32_t k,
                 uint32_t rows_x, bool capped, void *stream) {
    const dim3 grid(G ? G : 1, KV, k);
    k_rope_heads<<<grid, kThreads, 0, strm(stream)>>>(items, w, KV);
    k_rope_best<<<grid, kThreads, 0, strm(stream)>>>(items, w, KV);
    if (rows_x && w.off_groups) { /* some request has group planes: its pruning steps */
        k_rope_groups<<<dim3(kGroupBlocks, KV, k), kThreads, 0, strm(stream)>>>(items, w, KV);
        k_rope_live<<<dim3(rows_x, KV, k), kThreads, 0, strm(stream)>>>(items, w, KV);
    }
    if (rows_x) {
        const dim3 rg(rows_x, KV, k);
        k_rope_rows<<<rg, kThreads, 0, strm(stream)>>>(items, w, KV);
        if (capped) /* the capped requests' overflow keys */
            k_rope_keys<<<rg, kThreads, 0, strm(stream)>>>(items, w, KV);
    }
    k_rope_finish<<<k, kThreads, 0, strm(stream)>>>(items, w, KV);
}

kvt_status cu_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_args *args,
                               uint32_t n, void *stream) {
    for (uint32_t i = 0; i < n; i++)
        if (!kvt__recall_rope_args_ok(&args[i]) || args[i].group > 4096u)
            return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream);
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxRope) {
        const uint32_t k = n - i0 < kMaxRope ? n - i0 : kMaxRope;
        uint32_t KV, G;
        size_t rows;
        ScanWs w = rope_ws_of(args + i0, k, &KV, &G, &rows);
        if ((s = ws_get(be, stream, w.each * KV * k, &w.base)) != KVT_OK)
            break;
        const RopeEager items = {params_div<kvt__recall_rope_args, kMaxRope>(args + i0, k)};
        bool capped = false;
        for (uint32_t i = 0; i < k; i++)
            capped |= args[i0 + i].capped;
        rope_launch(items, w, KV, G, k, rows ? rows_grid(rows, KV).x : 0u, capped, stream);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* The planned trigger (kvt__recall_rope_plan_args): the layout of n_max requests of the bound's
 * shape and the grids, fixed for the batch's life, so a captured launch replays over any later
 * step: at most kPlanItems rows of blocks walk the step's requests, the per-row launches in
 * strides of at most kPlanRowBlocks blocks a (request, KV head). Its workspace is the planned
 * ops' own (plan_ws, shared with the NoPE planned step: stream order keeps them apart). */
size_t rope_plan_ws_bytes(const kvt__recall_rope_plan_args *a, ScanWs *w, uint32_t *KV,
                          uint32_t *G, size_t *rows) {
    *w = rope_ws_of(&a->bound, 1, KV, G, rows);
    return w->each * *KV * a->n_max;
}

kvt_status cu_recall_rope_plan_reserve(const kvt__backend *be, const kvt__recall_rope_plan_args *a) {
    ScanWs w;
    uint32_t KV, G;
    size_t rows;
    const size_t bytes = rope_plan_ws_bytes(a, &w, &KV, &G, &rows);
    cuda_impl *c = (cuda_impl *)be->impl;
    return reserve_on(be, &c->plan_ws, &c->plan_ws_bytes, bytes);
}

kvt_status cu_recall_rope_step_planned(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                       void *stream) {
    if (a->n_max == 0)
        return KVT_OK;
    if (a->n_max > 65535u || !a->items || !a->n || a->bound.group > 4096u ||
        a->bound.n_kv == 0 || a->bound.n_kv > KVT__RECALL_ROPE_MAX_KV)
        return KVT_ERR_INVALID_ARGUMENT;
    ScanWs w;
    uint32_t KV, G;
    size_t rows;
    const size_t bytes = rope_plan_ws_bytes(a, &w, &KV, &G, &rows);
    kvt_status s = op_begin(be, stream, true);
    if (s == KVT_OK)
        s = plan_ws_get(be, bytes, &w.base);
    if (s == KVT_OK) {
        const RopePlan items = {*a};
        const uint32_t k = a->n_max < kPlanItems ? a->n_max : kPlanItems;
        const uint32_t rx = rows ? rows_grid(rows, KV).x : 0u;
        rope_launch(items, w, KV, G, k, rx < kPlanRowBlocks ? rx : kPlanRowBlocks,
                    a->bound.capped, stream);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

constexpr uint32_t kMaxRopeEmit = 64;
typedef Params<kvt__recall_rope_emit_args, kMaxRopeEmit> RopeEmitParams;
static_assert(sizeof(RopeEmitParams) <= 32000, "kernel parameters above CUDA's 32 KB");

/* One request's lists: kvt__recall_rope_emit_cpu's, in its order, by the whole block. Every
 * thread walks the heads alike (the counts are device values every thread reads), each writes
 * its share. offsets false (a planned step's chained lists): the indptr entries are the planned
 * pack's (the same values), left as they are, since the next request's block reads its start
 * from them concurrently. */
__device__ void rope_emit_one(kvt__recall_rope_emit_args a, bool offsets) {
    const bool dense = !a.capped && (a.all || a.st->last_dense != 0);
    const size_t rb = a.row_bytes;
    uint64_t o = a.chain ? (uint64_t)a.indptr[0] : a.out;
    const uint64_t o0 = o;
    __syncthreads(); /* every thread read indptr[0] before thread 0 rewrites it */
    if (o + (uint64_t)a.n_kv * (a.n_rows + a.ar_n) > a.capacity) {
        if (threadIdx.x == 0) {
            for (uint32_t h = 0; offsets && !a.length && h <= a.n_kv; h++)
                a.indptr[h] = (int32_t)o;
            if (a.length)
                *a.length = 0;
        }
        return;
    }
    for (uint32_t h = 0; h < a.n_kv; h++) {
        if (offsets && !a.length && threadIdx.x == 0)
            a.indptr[h] = (int32_t)o;
        for (uint64_t r = threadIdx.x; r < a.n_rows; r += blockDim.x)
            a.indices[o + r] = kvt__page_slot(a.pages, a.first_page, a.pdiv, (uint32_t)r);
        o += a.n_rows;
        uint64_t m = dense ? a.ar_n : a.capped && a.all ? 0 : a.n_fired[h];
        m = m > a.cap && !dense ? a.cap : m;
        m = m > a.ar_n ? a.ar_n : m;
        /* the rows' bytes, 4 at a time (row_bytes is a multiple of 2; copy by bytes past it) */
        const uint64_t per = (uint64_t)a.n_planes * rb;
        for (uint64_t x = threadIdx.x; x < m * per; x += blockDim.x) {
            const uint64_t j = x / per, b = x % per, pl = b / rb, off = b % rb;
            const uint64_t k = dense ? j : a.fired[(size_t)h * a.cap + j];
            const int32_t slot = kvt__recall_rope_fetch_slot(&a, (uint32_t)j);
            a.plane[pl][(size_t)slot * a.slot_stride + (size_t)h * rb + off] =
                a.ar_bytes[((size_t)h * a.ar_cap + k) * per + pl * rb + off];
        }
        for (uint64_t j = threadIdx.x; j < m; j += blockDim.x)
            a.indices[o + j] = kvt__recall_rope_fetch_slot(&a, (uint32_t)j);
        o += m;
    }
    if (threadIdx.x != 0)
        return;
    if (a.length) {
        *a.length = (int32_t)(o - o0);
        for (; o < o0 + a.pad; o++)
            a.indices[o] = -1;
        return;
    }
    if (offsets)
        a.indptr[a.n_kv] = (int32_t)o;
}

/* The call's requests: one block each, or (serial: chained lists) one block taking them in
 * order, each list's start the previous one's end as the block wrote it. */
__global__ void k_rope_emit(const RopeEmitParams p, bool serial) {
    for (uint32_t i = serial ? 0u : blockIdx.x; i < (serial ? p.n : blockIdx.x + 1u); i++) {
        JOB_ARGS(kvt__recall_rope_emit_args, p, i);
        rope_emit_one(a, true);
        __syncthreads(); /* the next request reads what thread 0 wrote */
    }
}

kvt_status cu_recall_rope_emit(const kvt__backend *be, const kvt__recall_rope_emit_args *args,
                               uint32_t n, void *stream) {
    for (uint32_t i = 0; i < n; i++)
        if (!kvt__recall_rope_emit_ok(&args[i]))
            return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream);
    /* a launch per kMaxRopeEmit requests, in order: a chained list starts where the previous
     * one ended (in the launch, or the previous launch: stream order) */
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxRopeEmit) {
        const uint32_t k = n - i0 < kMaxRopeEmit ? n - i0 : kMaxRopeEmit;
        const RopeEmitParams p = params_div<kvt__recall_rope_emit_args, kMaxRopeEmit>(args + i0, k);
        bool serial = false;
        for (uint32_t i = 0; i < k; i++)
            serial |= args[i0 + i].chain;
        k_rope_emit<<<serial ? 1u : k, kThreads, 0, strm(stream)>>>(p, serial);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* The planned emission: the plan's items as they are when the kernel runs, one block a request
 * (a row of blocks walks them); an item that breaks the rules is skipped (the library never
 * writes one). A list at a fixed place writes its indptr entries, as the CPU twin does; a chained
 * one leaves them to the planned pack (the same values), since the next request's block reads its
 * start from them concurrently. (Found by the CUDA emulation: every item had been emitted without
 * its entries, cuda::recall_rope_planned_equals_the_cpu.) */
__global__ void k_rope_emit_planned(const kvt__recall_rope_plan_args a) {
    const uint32_t k = *a.n;
    if (k > a.n_max)
        return;
    for (uint32_t i = blockIdx.x; i < k; i += gridDim.x) {
        kvt__recall_rope_emit_args x;
        kvt__div32 d;
        if (kvt__recall_rope_emit_plan_item_args(&a, i, &x, &d))
            rope_emit_one(x, !x.chain);
        __syncthreads();
    }
}

kvt_status cu_recall_rope_emit_planned(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                       void *stream) {
    if (a->n_max == 0)
        return KVT_OK;
    if (a->n_max > 65535u || !a->emits || !a->n)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream, true);
    if (s == KVT_OK) {
        const uint32_t k = a->n_max < kMaxRopeEmit ? a->n_max : kMaxRopeEmit;
        k_rope_emit_planned<<<k, kThreads, 0, strm(stream)>>>(*a);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * select: one block per segment (a request's close): canonicalise, keys, top-m, counters.
 * -------------------------------------------------------------------------------------------- */
typedef Params<kvt__select_args, kMaxSeg> SelectParams;

__global__ void k_select(const SelectParams p, uint32_t *keys_all, size_t keys_each,
                         uint64_t *counters) {
    kvt__select_args a = p.a[blockIdx.x];
    uint32_t *keys = keys_all + keys_each * blockIdx.x;
    const uint32_t n = (uint32_t)a.n_closed;
    __shared__ unsigned long long s_nonfinite, s_below;
    if (threadIdx.x == 0)
        s_nonfinite = s_below = 0;
    __syncthreads();
    for (uint32_t u = threadIdx.x; u < n; u += blockDim.x) {
        float f = kvt__select_score(&a, u);
        if (u >= a.first_new && !(f <= 3.402823466e+38f)) {
            if (u >= a.n_head) /* a shared row's is canonical already */
                a.score[u - a.n_head] = INFINITY;
            f = INFINITY;
            atomicAdd(&s_nonfinite, 1ull);
        }
        keys[u] = kvt__score_key(f);
    }
    __syncthreads();
    block_topm(keys, n, a.m, a.kept);
    __syncthreads();
    uint32_t m = a.m < n ? a.m : n;
    for (uint32_t j = threadIdx.x; j < m; j += blockDim.x)
        if (a.kept[j] < a.sinks)
            atomicAdd(&s_below, 1ull);
    __syncthreads();
    if (threadIdx.x == 0) {
        counters[2 * blockIdx.x] = s_nonfinite;
        counters[2 * blockIdx.x + 1] = s_below;
    }
}

kvt_status cu_select(const kvt__backend *be, kvt__select_args *a, uint32_t n, void *stream) {
    cuda_impl *c = (cuda_impl *)be->impl;
    /* every segment checked before anything is enqueued (as cu_score_rows) */
    for (uint32_t i = 0; i < n; i++)
        if (a[i].n_closed > UINT32_MAX)
            return KVT_ERR_UNSUPPORTED;
    for (uint32_t i = 0; i < n; i++)
        if (a[i].n_head > a[i].n_closed || (a[i].n_head && !a[i].score_head))
            return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream);
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxSeg) {
        uint32_t k = n - i0 < kMaxSeg ? n - i0 : kMaxSeg;
        size_t most = 0;
        for (uint32_t i = 0; i < k; i++)
            most = a[i0 + i].n_closed > most ? a[i0 + i].n_closed : most;
        uint8_t *ws;
        if ((s = ws_get(be, stream, sizeof(uint32_t) * most * k, &ws)) != KVT_OK)
            break;
        k_select<<<k, kThreads, 0, strm(stream)>>>(params_of<kvt__select_args, kMaxSeg>(a + i0, k),
                                                   (uint32_t *)ws, most, c->counters);
        if ((s = st(cudaGetLastError())) != KVT_OK)
            break;
        /* The close's one synchronisation: its two counters per request. */
        uint64_t h[2 * kMaxSeg];
        if ((s = copy_on(h, c->counters, sizeof(uint64_t) * 2 * k, cudaMemcpyDeviceToHost,
                         stream ? stream : NULL)) != KVT_OK)
            break;
        for (uint32_t i = 0; i < k; i++) {
            a[i0 + i].nonfinite = h[2 * i];
            a[i0 + i].kept_in_sinks = h[2 * i + 1];
        }
    }
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * pack: one block per query, the CPU twin's cpu_pack. A query's count and where its slots start
 * are the host's (q.out, the description's count) unless the set is a recall one: then its fetch
 * count and dense flag are device values, and with dev_offsets (CSR) its start is the indptr entry
 * the previous query wrote. Such a chunk first runs k_pack_plan, one thread walking the queries
 * in order (the twin's loop: a query's indptr entry is read after the previous one wrote it),
 * which writes lengths / indptr and each query's (out, count, every row?, fetched) for k_pack.
 * The fetched rows merge into the list by position: a list row's output index is its own index
 * plus the fetched rows below it, and the other way round (the two are disjoint, both ascending).
 * -------------------------------------------------------------------------------------------- */
typedef Params<kvt__pack_query, kMaxSeg> PackParams;

struct PackPlan {
    uint64_t out, count, n_fetch;
    uint32_t all;
};

/* The host's plan of a query without device values (no fetch, no dense flag, host offsets). */
__device__ PackPlan pack_plan_host(const kvt__pack_query &q) {
    PackPlan pl;
    pl.all = q.all_rows ? 1u : 0u;
    pl.n_fetch = 0;
    pl.count = pl.all ? q.d.hi_end : kvt__attended_desc_count(&q.d);
    pl.out = q.out;
    return pl;
}

/* A query's plan from the values as they are when the kernel runs (a recall set's fetch count
 * and dense flag are the device's), its slots from `out` on. */
__device__ PackPlan pack_plan_dev(const kvt__pack_query &q, uint64_t out) {
    PackPlan pl;
    pl.all = q.all_rows || (q.dense && *q.dense) ? 1u : 0u;
    pl.n_fetch = !pl.all && q.n_fetch ? *q.n_fetch : 0;
    pl.count = pl.all ? q.d.hi_end : kvt__attended_desc_count(&q.d) + pl.n_fetch;
    pl.out = out;
    return pl;
}

__global__ void k_pack_plan(const PackParams p, bool csr, bool first_csr, bool dev_offsets,
                            int32_t *lengths, int32_t *indptr, PackPlan *plan) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    if (csr && first_csr)
        indptr[0] = 0;
    for (uint32_t i = 0; i < p.n; i++) {
        const kvt__pack_query &q = p.a[i];
        const PackPlan pl =
            pack_plan_dev(q, csr && dev_offsets ? (uint64_t)indptr[q.len_at - 1] : q.out);
        if (csr)
            indptr[q.len_at] = (int32_t)(pl.out + pl.count);
        else
            lengths[q.len_at] = (int32_t)pl.count;
        plan[i] = pl;
    }
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

/* Query q's set (block b of the launch) as planned in pl: its slots, padding, and (write_len:
 * k_pack_plan did not) its length or offset. */
__device__ void pack_body(const kvt__pack_query &q, uint32_t b, kvt__div32 pd, bool csr,
                          bool first_csr, const PackPlan pl, bool write_len, int32_t *indices,
                          int32_t *lengths, int32_t *indptr) {
    const kvt__attended_desc &d = q.d;
    if (write_len && threadIdx.x == 0) {
        if (csr) {
            indptr[q.len_at] = (int32_t)(pl.out + pl.count);
            if (first_csr && b == 0)
                indptr[0] = 0;
        } else {
            lengths[q.len_at] = (int32_t)pl.count;
        }
    }
    if (q.count_only) /* another op writes this list */
        return;
    int32_t *o = indices + pl.out;
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

__global__ void k_pack(const PackParams p, kvt__div32 pd, bool csr, bool first_csr,
                       const PackPlan *plan, int32_t *indices, int32_t *lengths,
                       int32_t *indptr) {
    const kvt__pack_query &q = p.a[blockIdx.x];
    pack_body(q, blockIdx.x, pd, csr, first_csr, plan ? plan[blockIdx.x] : pack_plan_host(q),
              !plan, indices, lengths, indptr);
}

/* The planned pack: queries and count from the plan buffer as it is when the kernel runs (one
 * block per possible query; a count past n_max packs nothing), each query's count from its
 * values then (a recall set's are the planned recall step's output). CSR: query i's slots start
 * where the sets before it end, the block's sum of their counts in a fixed order (the CPU twin
 * reads indptr[i], which its loop wrote: the same value). */
__global__ void k_pack_planned(const kvt__pack_query *qs, const uint32_t *n_plan, uint32_t n_max,
                               kvt__div32 pd, bool csr, bool first_csr, int32_t *indices,
                               int32_t *lengths, int32_t *indptr, uint8_t *dense_out,
                               uint32_t dense_stride) {
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
            sum += pack_plan_dev(qs[i], 0).count;
        s_sum[threadIdx.x] = sum;
        __syncthreads();
        for (uint32_t half = kThreads / 2; half > 0; half /= 2) {
            if (threadIdx.x < half)
                s_sum[threadIdx.x] += s_sum[threadIdx.x + half];
            __syncthreads();
        }
        out = s_sum[0];
    }
    const PackPlan pl = pack_plan_dev(q, out);
    if (dense_out && threadIdx.x == 0) /* a request's queries all write its same flag */
        dense_out[blockIdx.x / dense_stride] = pl.all ? 1 : 0;
    pack_body(q, blockIdx.x, pd, csr, first_csr, pl, true, indices, lengths, indptr);
}

kvt_status cu_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream) {
    if (a->q_plan) { /* capturable: nothing of the step in the launch's arguments */
        kvt_status s = op_begin(be, stream, true);
        if (s == KVT_OK)
            k_pack_planned<<<a->n_max ? a->n_max : 1, kThreads, 0, strm(stream)>>>(
                a->q_plan, a->n_plan, a->n_max, *a->pdiv, a->csr, a->first_csr, a->indices,
                a->lengths, a->indptr, a->dense_out, a->dense_stride ? a->dense_stride : 1u);
        return op_end(be, stream, s);
    }
    kvt_status s = op_begin(be, stream);
    if (s == KVT_OK && a->n == 0 && a->csr && a->first_csr) /* the CPU twin writes indptr[0] */
        s = st(cudaMemsetAsync(a->indptr, 0, sizeof(int32_t), strm(stream)));
    for (uint32_t i0 = 0; s == KVT_OK && i0 < a->n; i0 += kMaxSeg) {
        uint32_t k = a->n - i0 < kMaxSeg ? a->n - i0 : kMaxSeg;
        const PackParams prm = params_of<kvt__pack_query, kMaxSeg>(a->q + i0, k);
        const bool first = a->first_csr && i0 == 0;
        /* device values in the chunk: plan on the device */
        bool dev = a->csr && a->dev_offsets;
        for (uint32_t i = 0; i < k && !dev; i++)
            dev = a->q[i0 + i].n_fetch || a->q[i0 + i].dense;
        PackPlan *plan = NULL;
        if (dev) {
            uint8_t *ws;
            if ((s = ws_get(be, stream, sizeof(PackPlan) * kMaxSeg, &ws)) != KVT_OK)
                break;
            plan = (PackPlan *)ws;
            k_pack_plan<<<1, 32, 0, strm(stream)>>>(prm, a->csr, first, a->dev_offsets,
                                                     a->lengths, a->indptr, plan);
        }
        k_pack<<<k, kThreads, 0, strm(stream)>>>(prm, *a->pdiv, a->csr, first, plan, a->indices,
                                                 a->lengths, a->indptr);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

/* ----------------------------------------------------------------------------------------------
 * Eviction rounds (evict.h): select one block per (layer, head), apply in staged kernels.
 * -------------------------------------------------------------------------------------------- */
struct ev_scratch {
    uint32_t *keys, *ridx, *sel;
    uint8_t *mark;
};

__device__ ev_scratch ev_carve(uint8_t *base, uint64_t cand, uint64_t K) {
    ev_scratch s;
    s.keys = (uint32_t *)base;
    s.ridx = s.keys + cand;
    s.sel = s.ridx + cand;
    s.mark = (uint8_t *)(s.sel + K);
    return s;
}

size_t ev_scratch_bytes(uint64_t cand, uint64_t K) {
    return align256(sizeof(uint32_t) * (2 * cand + K) + cand);
}

__device__ uint32_t value_key_dev(const kvt__ev_args &a, uint32_t h, uint32_t row) {
    int32_t slot = kvt__page_slot(a.pages, a.first_page, a.pdiv, row);
    const uint8_t *p = a.plane[a.value_plane] + (size_t)slot * a.slot_bytes + (size_t)h * a.row_bytes;
    float lo = INFINITY, hi = -INFINITY;
    bool nan = false;
    for (uint32_t v = 0; v < a.value_dim; v++) {
        float x = kvt__load_elem(p, a.dtype, v);
        if (x != x)
            nan = true;
        lo = x < lo ? x : lo;
        hi = x > hi ? x : hi;
    }
    return kvt__score_key(nan ? NAN : hi - lo);
}

typedef Params<kvt__ev_args, kMaxEv> EvParams;

#define EV_ARGS(p, i) JOB_ARGS(kvt__ev_args, p, i)

__global__ void k_ev_select(const EvParams p, uint32_t n_heads_max, uint8_t *scr_all,
                            size_t scr_each) {
    EV_ARGS(p, blockIdx.x / n_heads_max);
    const uint32_t h = blockIdx.x % n_heads_max;
    if (h >= a.n_heads)
        return;
    const uint64_t K = a.K, cand = a.N - a.r;
    ev_scratch s = ev_carve(scr_all + scr_each * blockIdx.x, cand, K);
    const int64_t *P = a.pos + (size_t)h * a.pos_cap;
    __shared__ uint32_t s_f;
    if (threadIdx.x == 0)
        s_f = 0;
    __syncthreads();
    /* protected prefix: positions below L (ascending: a prefix) */
    for (uint64_t i = threadIdx.x; i < cand; i += blockDim.x) {
        s.mark[i] = (uint64_t)P[i] < a.L ? 1 : 0;
        if (s.mark[i])
            atomicAdd(&s_f, 1u);
    }
    __syncthreads();
    const uint64_t f = s_f;
    uint64_t taken = f;
    if (a.vase) {
        uint64_t m_v = K / 4;
        if (m_v > K - taken)
            m_v = K - taken;
        if (m_v > 0) {
            for (uint64_t i = f + threadIdx.x; i < cand; i += blockDim.x)
                s.keys[i - f] = value_key_dev(a, h, (uint32_t)i);
            __syncthreads();
            block_topm(s.keys, (uint32_t)(cand - f), (uint32_t)m_v, s.sel);
            __syncthreads();
            for (uint64_t j = threadIdx.x; j < m_v; j += blockDim.x)
                s.mark[f + s.sel[j]] = 1;
            __syncthreads();
            taken += m_v;
        }
    }
    /* the unmarked candidates, ascending, and their draws */
    const uint32_t n_rest =
        block_compact((uint32_t)(cand - f), [&](uint32_t i) { return !s.mark[f + i]; }, s.ridx);
    const uint32_t draw_head = a.shared_draw ? 0 : h + a.head_offset;
    const uint64_t subseq = kvt__philox_subseq(a.round, a.layer, draw_head);
    for (uint32_t k = threadIdx.x; k < n_rest; k += blockDim.x) {
        s.ridx[k] += (uint32_t)f;
        s.keys[k] = kvt__philox_draw_at(a.philox_key, subseq, (uint64_t)P[s.ridx[k]]);
    }
    __syncthreads();
    const uint64_t m_r = K - taken;
    if (m_r > 0) {
        block_topm(s.keys, n_rest, (uint32_t)m_r, s.sel);
        __syncthreads();
        for (uint64_t j = threadIdx.x; j < m_r; j += blockDim.x)
            s.mark[s.ridx[s.sel[j]]] = 1;
        __syncthreads();
    }
    block_compact((uint32_t)cand, [&](uint32_t i) { return s.mark[i] != 0; },
                  a.keep + (size_t)h * K);
}

/* Old row index of new row index j (evict_cpu.c's old_row). */
__device__ uint64_t old_row_dev(const uint32_t *keep, uint64_t K, uint64_t cand, uint64_t j) {
    return j < K ? keep[j] : cand + (j - K);
}

/* Archive: per (layer, head) block, the evicted candidates ascending copied out (all planes),
 * then the by-position index merged by thread 0 (a sequential merge: first version). */
__global__ void k_ev_archive(const EvParams p, uint32_t n_heads_max, uint8_t *scr_all,
                             size_t scr_each) {
    EV_ARGS(p, blockIdx.x / n_heads_max);
    const uint32_t h = blockIdx.x % n_heads_max;
    if (h >= a.n_heads || !a.ar_bytes)
        return;
    const uint64_t K = a.K, cand = a.N - a.r;
    uint32_t *ev = (uint32_t *)(scr_all + scr_each * blockIdx.x);
    uint8_t *mark = (uint8_t *)(ev + cand);
    const uint32_t *keep = a.keep + (size_t)h * K;
    for (uint64_t i = threadIdx.x; i < cand; i += blockDim.x)
        mark[i] = 0;
    __syncthreads();
    for (uint64_t j = threadIdx.x; j < K; j += blockDim.x)
        mark[keep[j]] = 1;
    __syncthreads();
    const uint32_t n_ev = block_compact((uint32_t)cand, [&](uint32_t i) { return !mark[i]; }, ev);
    const size_t row_all = (size_t)a.n_planes * a.row_bytes;
    uint8_t *bytes = a.ar_bytes + (size_t)h * a.ar_cap * row_all;
    int64_t *apos = a.ar_pos + (size_t)h * a.ar_cap;
    uint64_t *by_pos = a.ar_by_pos + (size_t)h * a.ar_cap;
    const int64_t *P = a.pos + (size_t)h * a.pos_cap;
    for (uint32_t k = threadIdx.x; k < n_ev; k += blockDim.x) {
        uint32_t i = ev[k];
        size_t off = (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, i) * a.slot_bytes +
                     (size_t)h * a.row_bytes;
        uint8_t *d = bytes + (size_t)(a.ar_n + k) * row_all;
        for (uint32_t p = 0; p < a.n_planes; p++)
            memcpy(d + (size_t)p * a.row_bytes, a.plane[p] + off, a.row_bytes);
        apos[a.ar_n + k] = P[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t n_old = a.ar_n, n = n_old + n_ev, i = n_old, j = n - n_old, w = n;
        while (j > 0) {
            if (i > 0 && apos[by_pos[i - 1]] > apos[n_old + j - 1])
                by_pos[--w] = by_pos[--i];
            else
                by_pos[--w] = n_old + --j;
        }
    }
}

/* Compaction, staged: survivors of every head gathered into the workspace (one block per
 * (layer, plane, new row)), then written back to rows 0..K+r-1 by a second kernel. Positions and
 * slot maps likewise through the workspace (a parallel in-place pass would race). */
__global__ void k_ev_gather(const EvParams p, uint8_t *stage_all, size_t stage_each,
                            int64_t *pos_stage_all, size_t pos_each) {
    EV_ARGS(p, blockIdx.y);
    const uint64_t K = a.K, cand = a.N - a.r, n_new = K + a.r;
    uint8_t *stage = stage_all + stage_each * blockIdx.y;
    int64_t *pstage = pos_stage_all + pos_each * blockIdx.y;
    /* one (row, head) slice per warp-stride: the slot and source computed once per slice; 4-byte
     * words when the rows allow (bf16/fp16 rows of even dims, fp32), bytes otherwise */
    const uint32_t unit = a.row_bytes % 4 == 0 ? 4 : 1, per_row = a.row_bytes / unit;
    for (uint64_t j = blockIdx.x; j < n_new; j += gridDim.x) {
        for (uint32_t p = 0; p < a.n_planes; p++) {
            uint8_t *dst = stage + ((size_t)p * n_new + j) * a.slot_bytes;
            for (uint32_t t = threadIdx.x; t < a.n_heads * per_row; t += blockDim.x) {
                uint32_t h = t / per_row, w = t % per_row;
                uint64_t o = old_row_dev(a.keep + (size_t)h * K, K, cand, j);
                int32_t slot = kvt__page_slot(a.pages, a.first_page, a.pdiv, (uint32_t)o);
                size_t off = (size_t)h * a.row_bytes + (size_t)w * unit;
                const uint8_t *src = a.plane[p] + (size_t)slot * a.slot_bytes + off;
                if (unit == 4)
                    *(uint32_t *)(dst + off) = *(const uint32_t *)src;
                else
                    dst[off] = *src;
            }
        }
        for (uint32_t h = threadIdx.x; h < a.n_heads; h += blockDim.x)
            pstage[(size_t)h * n_new + j] =
                a.pos[(size_t)h * a.pos_cap + old_row_dev(a.keep + (size_t)h * K, K, cand, j)];
    }
}

__global__ void k_ev_scatter(const EvParams p, const uint8_t *stage_all, size_t stage_each,
                             const int64_t *pos_stage_all, size_t pos_each) {
    EV_ARGS(p, blockIdx.y);
    const uint64_t n_new = a.K + a.r;
    const uint8_t *stage = stage_all + stage_each * blockIdx.y;
    const int64_t *pstage = pos_stage_all + pos_each * blockIdx.y;
    for (uint64_t j = blockIdx.x; j < n_new; j += gridDim.x) {
        int32_t slot = kvt__page_slot(a.pages, a.first_page, a.pdiv, (uint32_t)j);
        const bool words = a.slot_bytes % 4 == 0;
        for (uint32_t p = 0; p < a.n_planes; p++) {
            uint8_t *d = a.plane[p] + (size_t)slot * a.slot_bytes;
            const uint8_t *src = stage + ((size_t)p * n_new + j) * a.slot_bytes;
            if (words)
                for (uint32_t t = threadIdx.x; t < a.slot_bytes / 4; t += blockDim.x)
                    ((uint32_t *)d)[t] = ((const uint32_t *)src)[t];
            else
                for (uint32_t t = threadIdx.x; t < a.slot_bytes; t += blockDim.x)
                    d[t] = src[t];
        }
        for (uint32_t h = threadIdx.x; h < a.n_heads; h += blockDim.x)
            a.pos[(size_t)h * a.pos_cap + j] = pstage[(size_t)h * n_new + j];
    }
    /* slot maps: old -> new or -1 */
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < a.n_heads * a.N;
         t += (uint64_t)gridDim.x * blockDim.x)
        a.map[t] = -1;
}

__global__ void k_ev_map(const EvParams p) {
    EV_ARGS(p, blockIdx.y);
    const uint64_t K = a.K, cand = a.N - a.r, n_new = K + a.r;
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < a.n_heads * n_new;
         t += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)(t / n_new);
        uint64_t j = t % n_new;
        a.map[(size_t)h * a.N + old_row_dev(a.keep + (size_t)h * K, K, cand, j)] = (int32_t)j;
    }
}

/* Workspace layout of a round's select and of its apply over n layers: ev_select reserves the
 * larger, so that ev_apply (past which a failure damages the request) never needs to grow it. */
struct EvSizes {
    uint32_t H;
    size_t sel_each, ar_each, stage_each, pos_each, sel_total, apply_total;
    uint64_t most_new;
};

EvSizes ev_sizes(const kvt__ev_args *a, uint32_t n) {
    EvSizes z;
    memset(&z, 0, sizeof z);
    for (uint32_t i = 0; i < n; i++) {
        const kvt__ev_args &x = a[i];
        const uint64_t cand = x.N - x.r, n_new = x.K + x.r;
        size_t b[4] = {ev_scratch_bytes(cand, x.K), align256(sizeof(uint32_t) * cand + cand),
                       align256((size_t)x.n_planes * n_new * x.slot_bytes),
                       (size_t)x.n_heads * n_new};
        size_t *m[4] = {&z.sel_each, &z.ar_each, &z.stage_each, &z.pos_each};
        for (int k = 0; k < 4; k++)
            *m[k] = b[k] > *m[k] ? b[k] : *m[k];
        z.H = x.n_heads > z.H ? x.n_heads : z.H;
        z.most_new = n_new > z.most_new ? n_new : z.most_new;
    }
    z.sel_total = z.sel_each * n * z.H;
    z.apply_total =
        z.ar_each * n * z.H + z.stage_each * n + align256(sizeof(int64_t) * z.pos_each * n);
    return z;
}

/* An eviction op's start: its sizes, ordering, and `bytes(z)` of workspace. */
kvt_status ev_begin(const kvt__backend *be, const kvt__ev_args *a, uint32_t n, void *stream,
                    bool for_select, EvSizes *z, uint8_t **ws) {
    if (n > kMaxEv)
        return KVT_ERR_INVALID_ARGUMENT;
    *z = ev_sizes(a, n);
    kvt_status s = op_begin(be, stream);
    size_t bytes = for_select && z->sel_total > z->apply_total ? z->sel_total : z->apply_total;
    return s == KVT_OK ? ws_get(be, stream, bytes, ws) : s;
}

kvt_status cu_ev_select(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                        void *stream) {
    if (n == 0)
        return KVT_OK;
    EvSizes z;
    uint8_t *ws = NULL;
    kvt_status s = ev_begin(be, a, n, stream, true, &z, &ws);
    if (s == KVT_OK) {
        k_ev_select<<<n * z.H, kThreads, 0, strm(stream)>>>(
            params_div<kvt__ev_args, kMaxEv>(a, n), z.H, ws, z.sel_each);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

kvt_status cu_ev_apply(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                       void *stream) {
    if (n == 0)
        return KVT_OK;
    EvSizes z;
    uint8_t *ws = NULL;
    kvt_status s = ev_begin(be, a, n, stream, false, &z, &ws); /* reserved by ev_select */
    if (s != KVT_OK)
        return op_end(be, stream, s);
    const EvParams p = params_div<kvt__ev_args, kMaxEv>(a, n);
    const uint32_t H = z.H;
    const size_t ar_each = z.ar_each, stage_each = z.stage_each, pos_each = z.pos_each;
    const uint64_t most_new = z.most_new;
    uint8_t *ar_scr = ws, *stage = ws + ar_each * n * H;
    int64_t *pstage = (int64_t *)(stage + stage_each * n);
    k_ev_archive<<<n * H, kThreads, 0, strm(stream)>>>(p, H, ar_scr, ar_each);
    dim3 grid((unsigned)(most_new < 1024 ? most_new : 1024), n);
    k_ev_gather<<<grid, kThreads, 0, strm(stream)>>>(p, stage, stage_each, pstage, pos_each);
    k_ev_scatter<<<grid, kThreads, 0, strm(stream)>>>(p, stage, stage_each, pstage, pos_each);
    k_ev_map<<<grid, kThreads, 0, strm(stream)>>>(p);
    return op_end(be, stream, KVT_OK);
}

typedef Params<kvt__ev_append_args, kMaxEv> AppendParams;

__global__ void k_ev_append(const AppendParams p) {
    const kvt__ev_append_args a = p.a[blockIdx.y];
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < a.n_heads * a.n;
         t += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)(t / a.n);
        uint64_t i = t % a.n;
        a.pos[(size_t)h * a.pos_cap + a.first_row + i] = (int64_t)(a.first_pos + i);
    }
}

kvt_status cu_ev_append(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                        void *stream) {
    kvt_status s = op_begin(be, stream);
    for (uint32_t i0 = 0; s == KVT_OK && i0 < n; i0 += kMaxEv) {
        uint32_t k = n - i0 < kMaxEv ? n - i0 : kMaxEv;
        k_ev_append<<<dim3(8, k), kThreads, 0, strm(stream)>>>(
            params_of<kvt__ev_append_args, kMaxEv>(a + i0, k));
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

__global__ void k_find(const int64_t *sorted, const uint64_t *perm, uint64_t n, uint64_t key,
                       int64_t *out) {
    *out = kvt__find_pos(sorted, perm, n, key);
}

kvt_status cu_find_pos(const kvt__backend *be, const int64_t *sorted, const uint64_t *perm,
                       uint64_t n, uint64_t key, int64_t *out) {
    /* inspection: after everything enqueued on any stream, then on the handle's own stream (the
     * op has none of the caller's; k_find ran on the legacy stream, which orders with every
     * blocking stream and invalidates a capture running on one) */
    cuda_impl *c = (cuda_impl *)be->impl;
    void *aux = (void *)c->aux;
    kvt_status s = op_begin(be, aux);
    uint8_t *ws = NULL;
    if (s == KVT_OK)
        s = st(cudaDeviceSynchronize());
    if (s == KVT_OK)
        s = ws_get(be, aux, sizeof(int64_t), &ws);
    if (s == KVT_OK) {
        k_find<<<1, 1, 0, c->aux>>>(sorted, perm, n, key, (int64_t *)ws);
        s = st(cudaGetLastError());
    }
    if (s == KVT_OK)
        s = copy_on(out, ws, sizeof(int64_t), cudaMemcpyDeviceToHost, aux);
    return op_end(be, aux, s);
}

/* A handle's state on `device`: the select counters and the ordering event, made now so that
 * no op allocates them. */
kvt_status impl_new(const kvt__alloc *a, int device, cuda_impl **out) {
    cuda_impl *c = (cuda_impl *)kvt__calloc(a, sizeof *c);
    if (!c)
        return KVT_ERR_OUT_OF_MEMORY;
    c->device = device;
    kvt_status s = st(cudaSetDevice(device));
    if (s == KVT_OK)
        s = st(cudaMalloc(&c->counters, sizeof(uint64_t) * 2 * kMaxSeg));
    if (s == KVT_OK)
        s = st(cudaEventCreateWithFlags(&c->ev, cudaEventDisableTiming));
    if (s == KVT_OK)
        s = st(cudaStreamCreateWithFlags(&c->aux, cudaStreamNonBlocking));
    if (s != KVT_OK) {
        if (c->ev)
            cudaEventDestroy(c->ev);
        cudaFree(c->counters);
        kvt__free(a, c, sizeof *c);
        return s;
    }
    *out = c;
    return KVT_OK;
}

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

/* ----------------------------------------------------------------------------------------------
 * Capture: CUDA graphs over the caller's stream (thread-local mode: other threads' CUDA calls
 * are not affected). The legacy default stream (NULL) cannot be captured.
 * -------------------------------------------------------------------------------------------- */
kvt_status cu_capture_begin(kvt__backend *be, void *stream) {
    cuda_impl *c = (cuda_impl *)be->impl;
    if (!stream)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = st(cudaSetDevice(c->device));
    if (s == KVT_OK && capturing(stream))
        return KVT_ERR_BAD_STATE;
    c->cap_refused = false;
    return s == KVT_OK ? st(cudaStreamBeginCapture(strm(stream), cudaStreamCaptureModeThreadLocal))
                       : s;
}

kvt_status cu_capture_end(kvt__backend *be, void *stream, void **graph) {
    cuda_impl *c = (cuda_impl *)be->impl;
    *graph = NULL;
    const cudaStreamCaptureStatus cs = capture_status(stream);
    if (cs == cudaStreamCaptureStatusNone)
        return KVT_ERR_BAD_STATE;
    /* an invalidated capture, or one an op was refused in, is ended too (the stream leaves
     * capture mode), then refused */
    cudaGraph_t g = NULL;
    kvt_status s = st(cudaStreamEndCapture(strm(stream), &g));
    if (s == KVT_OK && (cs != cudaStreamCaptureStatusActive || c->cap_refused))
        s = KVT_ERR_BAD_STATE;
    c->cap_refused = false;
    cudaGraphExec_t x = NULL;
    if (s == KVT_OK)
        s = st(cudaGraphInstantiate(&x, g, 0));
    if (g)
        (void)cudaGraphDestroy(g);
    if (s == KVT_OK)
        *graph = (void *)x;
    return s;
}

kvt_status cu_graph_launch(const kvt__backend *be, void *graph, void *stream) {
    if (!graph)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream);
    if (s == KVT_OK)
        s = st(cudaGraphLaunch((cudaGraphExec_t)graph, strm(stream)));
    return op_end(be, stream, s);
}

void cu_graph_free(const kvt__backend *be, void *graph) {
    (void)be;
    if (graph)
        (void)cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

const char *cu_last_error(const kvt__backend *be) {
    (void)be;
    if (!t_err[0])
        return NULL;
    memcpy(t_err_out, t_err, sizeof t_err_out);
    t_err[0] = '\0';
    return t_err_out;
}

/* The workspace for every op of a step within b (kvt__ws_bounds): the largest of a recall step's
 * chunk of items, a RoPE step, a round call and the pack's plan, each by the layout its op
 * uses. */
kvt_status cu_reserve(const kvt__backend *be, const kvt__ws_bounds *b) {
    size_t bytes = sizeof(PackPlan) * kMaxSeg;
    if (b->recall.scan.n_heads) {
        StepShape sh;
        const ScanWs w = step_ws_of(&b->recall, 1, &sh);
        const uint32_t k = b->max_items < kMaxStep ? b->max_items : kMaxStep;
        bytes = w.each * (k ? k : 1) > bytes ? w.each * (k ? k : 1) : bytes;
    }
    if (b->rope && b->rope->n_kv <= KVT__RECALL_ROPE_MAX_KV) {
        uint32_t KV, G;
        size_t rows;
        const uint32_t k = b->max_items < kMaxRope ? b->max_items : kMaxRope;
        const size_t need = rope_ws_of(b->rope, 1, &KV, &G, &rows).each * KV * (k ? k : 1);
        bytes = need > bytes ? need : bytes;
    }
    if (b->round.n_heads && b->round_layers) {
        kvt__ev_args l[kMaxEv];
        const uint32_t n = b->round_layers < kMaxEv ? b->round_layers : kMaxEv;
        for (uint32_t i = 0; i < n; i++)
            l[i] = b->round;
        const EvSizes z = ev_sizes(l, n);
        const size_t need = z.sel_total > z.apply_total ? z.sel_total : z.apply_total;
        bytes = need > bytes ? need : bytes;
    }
    cuda_impl *c = (cuda_impl *)be->impl;
    return reserve_on(be, &c->ws, &c->ws_bytes, bytes + bytes / 2);
}

/* The table, filled by field name (C++ has no C designated initialisers out of order). */
/* Each batch's handle: a device workspace of its own, grown through reserve (the host-scratch
 * sizes are the CPU backends'). */
kvt_status cu_workspace(const kvt__backend *parent, size_t sigma_floats, size_t topm_u32,
                        kvt__backend *out) {
    (void)sigma_floats;
    (void)topm_u32;
    return kvt__backend_cuda_workspace(parent, out);
}

kvt__backend_ops make_ops() {
    kvt__backend_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.close = kvt__backend_cuda_close;
    o.workspace = cu_workspace;
    o.buf_alloc = cu_buf_alloc;
    o.buf_free = cu_buf_free;
    o.host_alloc = cu_host_alloc;
    o.host_free = cu_host_free;
    o.write = cu_write;
    o.read = cu_read;
    o.copy = cu_copy;
    o.copy_rows = cu_copy_rows;
    o.host_visible = false;
    o.score_rows = cu_score_rows;
    o.sketch_rows = cu_sketch_rows;
    o.recall_scan = cu_recall_scan;
    o.recall_step = cu_recall_step;
    o.recall_step_planned = cu_recall_step_planned;
    o.recall_plan_reserve = cu_recall_plan_reserve;
    o.reserve = cu_reserve;
    o.recall_promote = true; /* k_promo_before, k_step_best, k_step_finish */
    o.recall_rope_step = cu_recall_rope_step;
    o.recall_rope_emit = cu_recall_rope_emit;
    o.recall_rope_step_planned = cu_recall_rope_step_planned;
    o.recall_rope_emit_planned = cu_recall_rope_emit_planned;
    o.recall_rope_plan_reserve = cu_recall_rope_plan_reserve;
    o.pack = cu_pack;
    o.select = cu_select;
    o.ev_select = cu_ev_select;
    o.ev_apply = cu_ev_apply;
    o.ev_append = cu_ev_append;
    o.find_pos = cu_find_pos;
    o.attend = cu_attend;
    o.last_error = cu_last_error;
    o.capture_begin = cu_capture_begin;
    o.capture_end = cu_capture_end;
    o.graph_launch = cu_graph_launch;
    o.graph_free = cu_graph_free;
    return o;
}

const kvt__backend_ops cuda_ops = make_ops();

} // namespace

extern "C" kvt_status kvt__backend_cuda_open(kvt__backend *be, char *err, size_t err_len) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        if (err && err_len)
            snprintf(err, err_len, "no usable CUDA device: %s",
                     e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
        (void)cudaGetLastError(); /* clear the sticky error for the caller */
        return KVT_ERR_NO_DEVICE;
    }
    int device = 0;
    cudaGetDevice(&device);
    cuda_impl *c;
    kvt_status s = impl_new(be->alloc, device, &c);
    if (s != KVT_OK) {
        if (err && err_len)
            snprintf(err, err_len, "CUDA device %d: setting up the backend failed (%s)", device,
                     kvt_status_name(s));
        return s;
    }
    be->impl = c;
    be->ops = &cuda_ops;
    return KVT_OK;
}

extern "C" kvt_status kvt__backend_cuda_workspace(const kvt__backend *parent,
                                                  kvt__backend *out) {
    if (parent->ops != &cuda_ops)
        return KVT_ERR_UNSUPPORTED;
    cuda_impl *c;
    kvt_status s = impl_new(parent->alloc, ((const cuda_impl *)parent->impl)->device, &c);
    if (s != KVT_OK)
        return s;
    out->ops = parent->ops;
    out->alloc = parent->alloc;
    out->impl = c;
    return KVT_OK;
}

extern "C" void kvt__backend_cuda_close(kvt__backend *be) {
    cuda_impl *c = (cuda_impl *)be->impl;
    if (!c)
        return;
    cudaSetDevice(c->device);
    cudaDeviceSynchronize();
    cudaFree(c->ws);
    cudaFree(c->plan_ws);
    cudaFree(c->counters);
    cudaEventDestroy(c->ev);
    cudaStreamDestroy(c->aux);
    kvt__free(be->alloc, c, sizeof *c);
    be->impl = NULL;
}
