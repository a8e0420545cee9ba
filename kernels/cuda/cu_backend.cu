/*
 * cu_backend.cu — the CUDA backend: the operation table of kernels/backend.h on device memory.
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
 *
 * This file holds the handle (open, close, a batch's workspace handle), buffers and copies,
 * find_pos, the capture and the table; each op family's kernels and launches are in a file of
 * their own (cu_common.cuh lists them), next to what their CPU twins' files compute.
 */
#include "kernels/cuda/cu_common.cuh"

namespace kvt_cu {

/* The calling thread's last CUDA error, for kvt__backend_ops.last_error. */
thread_local char t_err[192];
static thread_local char t_err_out[192]; /* what cu_last_error hands out */

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

namespace {

__global__ void k_find(const int64_t *sorted, const uint64_t *perm, uint64_t n, uint64_t key,
                       int64_t *out) {
    *out = kvt__find_pos(sorted, perm, n, key);
}

} // namespace

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

namespace {

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

} // namespace

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

/* The workspace for every op of a step within b (kvt__ws_bounds) that takes it: a round call
 * (the recall steps have their own, recall_plan_reserve; the pack takes none). */
kvt_status cu_reserve(const kvt__backend *be, const kvt__ws_bounds *b) {
    const size_t bytes = ev_ws_need(b);
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

namespace {

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
    o.recall_plan_reserve = cu_recall_plan_reserve;
    o.reserve = cu_reserve;
    o.recall_promote = true; /* k_promo_before, k_step_best, k_step_finish */
    o.recall_scan_q8 = true; /* k_sketch's planes, scan_head's and scan_tiles' 8-bit paths */
    o.recall_rope_step = cu_recall_rope_step;
    o.recall_rope_emit = cu_recall_rope_emit;
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

} // namespace kvt_cu

using namespace kvt_cu;

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
