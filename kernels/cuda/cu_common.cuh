/*
 * cu_common.cuh — what the CUDA backend's files (kernels/cuda/cu_*.cu) share: a handle's state
 * (cuda_impl), the frame of every op (op_begin / op_end, the workspaces, copies on a stream),
 * the kernel argument packs (Params), the block-wide top-m and compaction, and the ops each file
 * defines for the table in cu_backend.cu. Built without -rdc: each kernel is defined in the file
 * that launches it; what several files run is defined here, inline with internal linkage (each
 * file its own copy, as when the backend was one file).
 */
#ifndef KVT_KERNELS_CUDA_CU_COMMON_CUH
#define KVT_KERNELS_CUDA_CU_COMMON_CUH

#include <cuda_runtime.h>
#include <cub/block/block_scan.cuh>

#include <float.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "kernels/backend.h"
#include "recall/kernels/conformal_math.h"
#include "kernels/philox.h"
#include "recall/kernels/recall_group.h"
#include "recall/kernels/rope_trigger.h"
#include "recall/kernels/recall_scan.h"
#include "recall/kernels/recall_promo.h"
#include "recall/kernels/recall_step.h"
#include "kernels/sigma.h"
#include "recall/kernels/sketch.h"
#include "kernels/topm.h"
#include "lib/base/alloc.h"
}

namespace kvt_cu {

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
    /* The recall steps' own workspace (recall_step, recall_rope_step): sized by
     * recall_plan_reserve from the plan's bound (a batch's planned steps: once, never moved
     * after, since a captured graph holds its address; the workspace above may be freed and
     * grown by a later round). */
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

/* The calling thread's last CUDA error, for kvt__backend_ops.last_error (cu_backend.cu). */
extern thread_local char t_err[192];

/* The ops of the table (cu_backend.cu's make_ops), each in the file of its op family:
 * cu_close.cu (σ, sketches, select), cu_recall.cu (the recall scan and the NoPE step),
 * cu_rope.cu (the RoPE trigger and its emission), cu_pack.cu, cu_evict.cu, cu_attend.cu. */
kvt_status cu_score_rows(const kvt__backend *be, const kvt__score_args *a, uint32_t n,
                         void *stream);
kvt_status cu_sketch_rows(const kvt__backend *be, const kvt__sketch_args *a, uint32_t n,
                          void *stream);
kvt_status cu_recall_scan(const kvt__backend *be, const kvt__recall_scan_args *a, uint32_t n,
                          void *stream);
kvt_status cu_recall_step(const kvt__backend *be, const kvt__recall_plan_args *a, void *stream);
kvt_status cu_recall_plan_reserve(const kvt__backend *be, const kvt__recall_plan_args *a);
kvt_status cu_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                               void *stream);
kvt_status cu_recall_rope_plan_reserve(const kvt__backend *be, const kvt__recall_rope_plan_args *a);
kvt_status cu_recall_rope_emit(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                               void *stream);
kvt_status cu_select(const kvt__backend *be, kvt__select_args *a, uint32_t n, void *stream);
kvt_status cu_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream);
kvt_status cu_ev_select(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                        void *stream);
kvt_status cu_ev_apply(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                       void *stream);
kvt_status cu_ev_append(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                        void *stream);
kvt_status cu_attend(const kvt__backend *be, const kvt__attend_args *a, void *stream);

/* The workspace a round call needs for a batch's bounds (cu_backend.cu's cu_reserve); 0 where
 * the bounds have none. */
size_t ev_ws_need(const kvt__ws_bounds *b);

} // namespace kvt_cu

namespace kvt_cu {
namespace {

/* A stream capture's own errors: a call out of order with a capture, not a device failure. */
inline bool capture_error(cudaError_t e) {
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

inline kvt_status st(cudaError_t e) {
    if (e == cudaSuccess)
        return KVT_OK;
    snprintf(t_err, sizeof t_err, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    (void)cudaGetLastError();
    return e == cudaErrorMemoryAllocation ? KVT_ERR_OUT_OF_MEMORY
           : capture_error(e)             ? KVT_ERR_BAD_STATE
                                          : KVT_ERR_NO_DEVICE;
}

inline cudaStream_t strm(void *s) {
    return (cudaStream_t)s;
}

/* Every op: the handle's device; then order after the handle's last op when it ran on another
 * stream (op_end records where each op ended). */
/* The stream is being captured into a graph (kvt__backend_ops.capture_begin): the ops then
 * order with the handle's other streams only through the capturing stream (the engine's graph
 * launch), not through the handle's event, which a capture may not wait on or record. */
inline cudaStreamCaptureStatus capture_status(void *stream) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (!stream || cudaStreamIsCapturing(strm(stream), &cs) != cudaSuccess)
        return cudaStreamCaptureStatusNone;
    return cs;
}

inline bool capturing(void *stream) {
    return capture_status(stream) == cudaStreamCaptureStatusActive;
}

/* On a capturing stream only the ops fed from a plan image (planned: pack, recall_step, the RoPE
 * ones), whose arguments hold nothing of one step, are enqueued; any other is
 * refused with KVT_ERR_BAD_STATE (as on the CPU backends: its host-built arguments, and a
 * workspace it may grow, are one step's), and so is the capture_end after it. */
inline kvt_status op_begin(const kvt__backend *be, void *stream, bool planned = false) {
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

inline kvt_status op_end(const kvt__backend *be, void *stream, kvt_status s) {
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
inline kvt_status copy_on(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                          void *stream, bool host_reads = false) {
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
inline kvt_status regrow(cudaStream_t s, uint8_t **p, size_t *have, size_t want) {
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
inline kvt_status ws_get(const kvt__backend *be, void *stream, size_t bytes, uint8_t **out) {
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
inline kvt_status plan_ws_get(const kvt__backend *be, size_t bytes, uint8_t **out) {
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
inline kvt_status reserve_on(const kvt__backend *be, uint8_t **p, size_t *have, size_t want) {
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

__host__ __device__ inline size_t align256(size_t n) {
    return (n + 255) / 256 * 256;
}

/* Row copies (the RoPE emission's fetched rows, the eviction's archived rows). Copy one unit of
 * u bytes (16, 8, 4, 2 or 1; both addresses aligned to it) as one load and one
 * store (the emulation: a memcpy of the same bytes). A byte is read as the aligned word holding
 * it (kvt__dev_ld_u8): no byte load in the kernel's PTX (scripts/ptx-check.sh). */
struct alignas(16) Unit16 {
    uint64_t lo, hi;
};
template <class T>
__device__ inline void copy_as(uint8_t *d, const uint8_t *s) {
#if defined(KVT_CUDA_EMU_RUNTIME_H)
    memcpy(d, s, sizeof(T));
#else
    *(T *)d = *(const T *)s;
#endif
}
__device__ inline void copy_unit(uint8_t *d, const uint8_t *s, uint32_t u) {
    switch (u) {
    case 16:
        copy_as<Unit16>(d, s);
        break;
    case 8:
        copy_as<uint64_t>(d, s);
        break;
    case 4:
        copy_as<uint32_t>(d, s);
        break;
    case 2:
        copy_as<uint16_t>(d, s);
        break;
    default:
        *d = kvt__dev_ld_u8(s);
    }
}

/* The widest copy unit (16, 8, 4, 2 or 1 bytes) that `bits` (the OR of every base address,
 * stride and row size a copy adds up) is a multiple of: every unit's source and destination is
 * then aligned to it. 16 for every layout in practice. */
__host__ __device__ inline uint32_t copy_unit_of(uint64_t bits) {
    bits |= 16u;
    return (uint32_t)(bits & (~bits + 1u));
}

/* A block's walk over rows of `per` units each, thread t taking units t, t + blockDim.x, ..:
 * its row and unit carried forward (two divisions a thread, none a step). */
struct UnitWalk {
    uint64_t row, unit, per, sr, su;
    __device__ explicit UnitWalk(uint64_t units_per_row) : per(units_per_row) {
        row = threadIdx.x / per;
        unit = threadIdx.x % per;
        sr = blockDim.x / per;
        su = blockDim.x % per;
    }
    __device__ void next() {
        unit += su;
        row += sr;
        if (unit >= per) {
            unit -= per;
            row++;
        }
    }
};

/* ----------------------------------------------------------------------------------------------
 * Block-wide pieces
 * -------------------------------------------------------------------------------------------- */
/* Top-m of keys[0..n) (larger first, ties to the lower index), written ascending into idx.
 * Radix select of the threshold T, 8 bits at a time from the top, then one ordered pass that
 * emits every key > T and the first `need` keys == T (kvt__topm_u32's definition). */
__device__ inline void block_topm(const uint32_t *keys, uint32_t n, uint32_t m, uint32_t *idx) {
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


} // namespace
} // namespace kvt_cu

#endif /* KVT_KERNELS_CUDA_CU_COMMON_CUH */
