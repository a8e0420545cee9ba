/*
 * cu_evict.cu — the eviction rounds on the CUDA backend (ev_select, ev_apply) and the position
 * appends (ev_append), following the CPU twin (kernels/evict_cpu.c).
 */
#include "kernels/cuda/cu_common.cuh"

namespace kvt_cu {

namespace {

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
    const uint8_t *p =
        a.plane[a.value_plane] + (size_t)slot * a.slot_bytes + (size_t)h * a.row_bytes;
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
    /* the rows, all planes, in units of U bytes (16 for every layout in practice), a UnitWalk
     * (a per-thread memcpy of a row before) */
    const uint32_t U = copy_unit_of((uint64_t)(uintptr_t)a.plane[0] |
                                    (a.n_planes == 2 ? (uint64_t)(uintptr_t)a.plane[1] : 0u) |
                                    (uint64_t)(uintptr_t)a.ar_bytes | (uint64_t)a.slot_bytes |
                                    a.row_bytes);
    const uint64_t ur = a.row_bytes / U;
    if (n_ev)
        for (UnitWalk u((uint64_t)a.n_planes * ur); u.row < n_ev; u.next()) {
            const uint64_t k = u.row, pl = u.unit >= ur ? 1u : 0u, off = (u.unit - pl * ur) * U;
            const size_t src = (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, ev[k]) *
                                   a.slot_bytes +
                               (size_t)h * a.row_bytes;
            copy_unit(bytes + (size_t)(a.ar_n + k) * row_all + pl * a.row_bytes + off,
                      (pl ? a.plane[1] : a.plane[0]) + src + off, U);
        }
    for (uint32_t k = threadIdx.x; k < n_ev; k += blockDim.x)
        apos[a.ar_n + k] = P[ev[k]];
    __syncthreads();
    /* by_pos merged with the new entries n_old .. n - 1 (ascending by position, as the old ones
     * through by_pos): the CPU twin's serial merge from the back (old before new on equal
     * positions) as ranks, every entry's place at once (thread 0 walked the whole archive
     * before: ~10^5 dependent loads a head at 128k rows). New entry k goes to k + #{old <= its
     * position}, old entry i to i + #{new < its position}. In place: the new entries' places
     * first (into ev, free after the copy; archive indices fit 32 bits, as rows do), then the
     * old entries that move, in blocks of blockDim.x from the back (a block's places are at or
     * after its own entries, so no entry is overwritten before it is read), then the new. */
    const uint64_t n_old = a.ar_n;
    for (uint32_t k = threadIdx.x; k < n_ev; k += blockDim.x) {
        const int64_t v = apos[n_old + k];
        uint64_t lo = 0, hi = n_old; /* old entries at or below v */
        while (lo < hi) {
            const uint64_t mid = lo + (hi - lo) / 2;
            if (apos[by_pos[mid]] <= v)
                lo = mid + 1;
            else
                hi = mid;
        }
        ev[k] = (uint32_t)(k + lo);
    }
    __syncthreads();
    /* old entries below new entry 0's place stay where they are */
    const uint64_t first = n_ev ? ev[0] : n_old;
    for (uint64_t top = n_old; top > first;) {
        const uint64_t base = top - first > blockDim.x ? top - blockDim.x : first;
        const uint64_t i = base + threadIdx.x;
        uint64_t v = 0, at = 0;
        if (i < top) {
            v = by_pos[i];
            const int64_t pv = apos[v];
            uint64_t lo = 0, hi = n_ev; /* new entries below pv */
            while (lo < hi) {
                const uint64_t mid = lo + (hi - lo) / 2;
                if (apos[n_old + mid] < pv)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            at = i + lo;
        }
        __syncthreads();
        if (i < top)
            by_pos[at] = v;
        __syncthreads();
        top = base;
    }
    for (uint32_t k = threadIdx.x; k < n_ev; k += blockDim.x)
        by_pos[ev[k]] = n_old + k;
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

} // namespace

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

namespace {

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

} // namespace

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

/* A round call at the batch's bounds (cu_reserve). */
size_t ev_ws_need(const kvt__ws_bounds *b) {
    if (!(b->round.n_heads && b->round_layers))
        return 0;
    kvt__ev_args l[kMaxEv];
    const uint32_t n = b->round_layers < kMaxEv ? b->round_layers : kMaxEv;
    for (uint32_t i = 0; i < n; i++)
        l[i] = b->round;
    const EvSizes z = ev_sizes(l, n);
    return z.sel_total > z.apply_total ? z.sel_total : z.apply_total;
}

} // namespace kvt_cu
