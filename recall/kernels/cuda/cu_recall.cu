/*
 * cu_recall.cu — the recall scan (recall_scan) and the NoPE recall step (recall_step, eager and
 * planned) of the CUDA backend: their kernels and launches over cu_recall.cuh's pieces, each
 * following the CPU twins (recall_scan.c, recall_step.c, recall_group.c).
 */
#include "recall/kernels/cuda/cu_recall.cuh"

namespace kvt_cu {

namespace {

__global__ void k_scan_heads(const ScanParams p, const ScanWs w) {
    SCAN_ARGS(p, blockIdx.y);
    if (blockIdx.x < a.n_heads)
        scan_head(a, scan_item(w, blockIdx.y), blockIdx.x);
}

__global__ void k_scan_rows(const ScanParams p, const ScanWs w) {
    SCAN_ARGS(p, blockIdx.y);
    scan_rows(a, scan_item(w, blockIdx.y));
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

} // namespace

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

namespace {

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

} // namespace

namespace {

size_t plan_ws_bytes(const kvt__recall_plan_args *a, ScanWs *w, StepShape *sh) {
    *w = step_ws_of(&a->bound, 1, sh);
    return w->each * a->n_max;
}

} // namespace

kvt_status cu_recall_plan_reserve(const kvt__backend *be, const kvt__recall_plan_args *a) {
    ScanWs w;
    StepShape sh;
    const size_t bytes = plan_ws_bytes(a, &w, &sh);
    cuda_impl *c = (cuda_impl *)be->impl;
    return reserve_on(be, &c->plan_ws, &c->plan_ws_bytes, bytes);
}

namespace {

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

} // namespace

kvt_status cu_recall_step(const kvt__backend *be, const kvt__recall_plan_args *a, void *stream) {
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

} // namespace kvt_cu
