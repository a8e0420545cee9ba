/*
 * cu_close.cu — a salience close on the CUDA backend: σ of the closing blocks (score_rows), the
 * recall sketches of their rows (sketch_rows) and the segmented top-m (select), following the
 * CPU twins (kernels/sigma.c, sketch.c, topm.c).
 */
#include "kernels/cuda/cu_common.cuh"

namespace kvt_cu {

namespace {

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
    /* a warp per row for the norms: lane l's partial in kvt__sumsq_lane's order, then the
     * lanes' stride-halving tree by __shfl_down_sync (kvt__tree32's order: p[i] + p[i + s]); no
     * per-row array (they lived in local memory: 1,152 B of stack) */
    const uint32_t lane = threadIdx.x % KVT__SIGMA_LANES, warp = threadIdx.x / KVT__SIGMA_LANES,
                   n_warps = blockDim.x / KVT__SIGMA_LANES;
    if (a.selector == KVT_SELECT_BRANCH_NORM || a.selector == KVT_SELECT_ROW_NORM) {
        const bool br = a.selector == KVT_SELECT_BRANCH_NORM;
        for (uint32_t u = warp; u < B; u += n_warps) {
            const uint8_t *row = row_of(a, u);
            float acc = br ? kvt__elem_sumsq_lane(row + a.branch_offset, a.branch_dtype, D, lane)
                           : kvt__elem_sumsq_lane(row, a.dtype, a.n_values, lane);
            for (uint32_t sh = KVT__SIGMA_LANES / 2; sh >= 1; sh >>= 1)
                acc = acc + __shfl_down_sync(0xffffffffu, acc, sh);
            if (lane == 0)
                a.out[u] = sqrtf(acc);
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
    /* 2-3: a warp per row: lane l the residual's elements l, l + 32, .. < D and their squares
     * summed in that order (kvt__sumsq_lane's chain), then the tree as above. */
    for (uint32_t u = warp; u < B; u += n_warps) {
        if (!fin[u]) {
            if (lane == 0)
                a.out[u] = INFINITY;
            continue;
        }
        const uint8_t *row = row_of(a, u);
        float acc = 0.0f;
        for (uint32_t d = lane; d < D; d += KVT__SIGMA_LANES) {
            const float r = kvt__sigma_residual(
                kvt__sigma_branch_val(row, a.branch_offset, a.branch_dtype, d),
                kvt__sigma_recon(a.basis, B, J, u, scratch, D, d));
            acc = fmaf(r, r, acc);
        }
        for (uint32_t sh = KVT__SIGMA_LANES / 2; sh >= 1; sh >>= 1)
            acc = acc + __shfl_down_sync(0xffffffffu, acc, sh);
        if (lane == 0)
            a.out[u] = sqrtf(acc);
    }
}

} // namespace

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

namespace {

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
           (a.q8_off ? a.q8_off <= KVT__SKETCH_MAX_RANK && a.rank <= a.q8_off &&
                           a.branch_dim <= KVT__RECALL_MAX_BRANCH &&
                           a.csk_stride == a.q8_off + kvt__recall_q8_words(a.branch_dim, a.q8_off)
                     : a.csk_stride <= KVT__SKETCH_MAX_RANK) &&
           (!a.rank || a.basis) && kvt__sketch_dtype_ok(a.dtype, a.latent_dim);
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
        const uint32_t w16 = a.q8_off ? a.q8_off : a.csk_stride; /* the fp16 part */
        for (uint32_t k = lane; k < w16; k += 32)
            out[k] = bad || k >= R ? (uint16_t)0 : cs[k];
        if (bad) { /* undescribable: every certificate on it is infinite */
            if (lane == 0)
                a.rho[u] = INFINITY;
        } else {
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
        if (a.q8_off) {
            /* the row's 8-bit plane from its branch and the fp16 sketch just written (the
             * warp's writes ordered by the barrier), by lane 0 through kvt__recall_q8_row: the
             * CPU twin's function (q8_rows in backend_cpu.c), so its scales, rounding norms and
             * bytes are the twin's; the latent in c is read no more (its scratch) */
            __syncwarp();
            if (lane == 0)
                kvt__recall_q8_row(row, a.branch_offset, a.branch_dtype, a.branch_dim, out,
                                   a.q8_off, c, (uint8_t *)(out + a.q8_off));
        }
    }
}

} // namespace

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

namespace {

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

} // namespace

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

} // namespace kvt_cu
