/*
 * cu_rope.cu — the RoPE recall trigger (recall_rope_step, eager and planned) and its emission
 * (recall_rope_emit) of the CUDA backend, following the CPU twin (rope_trigger.c) over
 * cu_recall.cuh's pieces.
 */
#include "recall/kernels/cuda/cu_recall.cuh"

namespace kvt_cu {

namespace {

/* ----------------------------------------------------------------------------------------------
 * RoPE recall (recall_rope_step, recall_rope_emit): the CPU twin kvt__recall_rope_step_cpu
 * (rope_trigger.c) per request = grid z (up to kMaxRope a launch: the library calls the
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
 * The emission (k_rope_emit_planned) is one launch for the layer's requests: per request and KV
 * head its list (the table's slots, then its fetched rows copied into the fetch area), one block
 * a request; a chained list (CSR) starts at the offset the pack wrote from the lists' counts.
 * -------------------------------------------------------------------------------------------- */
constexpr uint32_t kMaxRope = 32;
typedef Params<kvt__recall_rope_args, kMaxRope> RopeParams;
static_assert(sizeof(RopeParams) <= 32000, "kernel parameters above CUDA's 32 KB");

/* Where a RoPE launch's requests come from (the kernels are templates over it, as the NoPE
 * step's: PlanItems): a batch's plan image as it is when the kernel runs (recall_rope_step).
 * get(): kItemOk with the request in x (its divider in d), kItemNone past them, kItemBad for an
 * item that breaks the rules or the plan's bound. */
typedef PlanOf<kvt__recall_rope_plan_args, kvt__recall_rope_args, kvt__recall_rope_plan_item_args>
    RopePlan;

/* Request r of a launch's items in the block's one shared copy (thread 0 builds it from the plan
 * image; every thread of the block calls this, and gets the item's kItem* status in `got`). A
 * copy per thread sat in local memory (608 B of stack in every k_rope_* kernel: the struct's
 * rank[] is indexed by the KV head at run time, so it could not live in registers). */
template <class Items>
__device__ const kvt__recall_rope_args &rope_item(const Items &src, uint32_t r, int &got) {
    __shared__ kvt__recall_rope_args s_a;
    __shared__ kvt__div32 s_div;
    __shared__ int s_got;
    __syncthreads(); /* every thread is done with the block's last request */
    if (threadIdx.x == 0) {
        s_got = src.get(r, s_a, s_div);
        s_a.pdiv = &s_div;
    }
    __syncthreads();
    got = s_got;
    return s_a;
}

/* Request r as `a`, or return when it is none or bad. */
#define ROPE_ITEM(src, r)                                                                          \
    int a_got;                                                                                     \
    const kvt__recall_rope_args &a = rope_item(src, r, a_got);                                     \
    if (a_got != kItemOk)                                                                          \
    return

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

/* KV head h's group planes (block b at slot b·n_kv + h, rope_trigger.h), its grouped
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
    int got;
    const kvt__recall_rope_args &a = rope_item(p, r, got);
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
        const size_t e1 = 4 * align256(sizeof(float) * nq) +
                          align256(sizeof(float) * x.sample_cap) +
                          (x.capped ? sizeof(uint32_t) * x.n_kv * x.ar_n : 0);
        if (x.g_perm && x.g_B) { /* each KV head's pruned scan: GroupWs */
            const size_t gb = group_build_bytes(x.g_B, x.g_dim),
                         gs = x.ar_n / KVT__RECALL_GROUP_MIN;
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

} // namespace

namespace {

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

} // namespace

kvt_status cu_recall_rope_plan_reserve(const kvt__backend *be,
                                       const kvt__recall_rope_plan_args *a) {
    ScanWs w;
    uint32_t KV, G;
    size_t rows;
    const size_t bytes = rope_plan_ws_bytes(a, &w, &KV, &G, &rows);
    cuda_impl *c = (cuda_impl *)be->impl;
    return reserve_on(be, &c->plan_ws, &c->plan_ws_bytes, bytes);
}

kvt_status cu_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
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

namespace {

constexpr uint32_t kMaxRopeEmit = 64;

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
    /* the fetched rows' copy unit: the widest power of two up to 16 that the planes, the archive,
     * the slot stride and the row size are all multiples of (every source and destination of a
     * unit is then aligned to it) */
    const uint32_t U = copy_unit_of((uint64_t)(uintptr_t)a.plane[0] |
                                    (a.n_planes == 2 ? (uint64_t)(uintptr_t)a.plane[1] : 0u) |
                                    (uint64_t)(uintptr_t)a.ar_bytes | (uint64_t)a.slot_stride | rb);
    const uint64_t per = (uint64_t)a.n_planes * rb;
    for (uint32_t h = 0; h < a.n_kv; h++) {
        if (offsets && !a.length && threadIdx.x == 0)
            a.indptr[h] = (int32_t)o;
        for (uint64_t r = threadIdx.x; r < a.n_rows; r += blockDim.x)
            a.indices[o + r] = kvt__page_slot(a.pages, a.first_page, a.pdiv, (uint32_t)r);
        o += a.n_rows;
        uint64_t m = dense ? a.ar_n : a.capped && a.all ? 0 : a.n_fired[h];
        m = m > a.cap && !dense ? a.cap : m;
        m = m > a.ar_n ? a.ar_n : m;
        /* the rows' bytes in units of U bytes (16 for every layout in practice), a UnitWalk */
        const uint64_t ur = rb / U, upr = (uint64_t)a.n_planes * ur;
        if (m)
            for (UnitWalk u(upr); u.row < m; u.next()) {
                const uint64_t j = u.row, pl = u.unit >= ur ? 1u : 0u,
                               off = (u.unit - pl * ur) * U;
                const uint64_t k = dense ? j : a.fired[(size_t)h * a.cap + j];
                const int32_t slot = kvt__recall_rope_fetch_slot(&a, (uint32_t)j);
                copy_unit((pl ? a.plane[1] : a.plane[0]) + (size_t)slot * a.slot_stride +
                              (size_t)h * rb + off,
                          a.ar_bytes + ((size_t)h * a.ar_cap + k) * per + pl * rb + off, U);
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

} // namespace

namespace {

/* The planned emission: the plan's items as they are when the kernel runs, one block a request
 * (a row of blocks walks them); an item that breaks the rules is skipped (the library never
 * writes one). A list at a fixed place writes its indptr entries, as the CPU twin does; a chained
 * one leaves them to the planned pack (the same values), since the next request's block reads its
 * start from them concurrently. (Found by the CUDA emulation: every item had been emitted without
 * its entries, cuda::recall_rope_planned_equals_the_cpu.) */
__global__ void k_rope_emit_planned(const kvt__recall_rope_plan_args a) {
    const uint32_t k = *a.n_emit;
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

} // namespace

kvt_status cu_recall_rope_emit(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                               void *stream) {
    if (a->n_max == 0)
        return KVT_OK;
    if (a->n_max > 65535u || !a->emits || !a->n_emit)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_status s = op_begin(be, stream, true);
    if (s == KVT_OK) {
        const uint32_t k = a->n_max < kMaxRopeEmit ? a->n_max : kMaxRopeEmit;
        k_rope_emit_planned<<<k, kThreads, 0, strm(stream)>>>(*a);
        s = st(cudaGetLastError());
    }
    return op_end(be, stream, s);
}

} // namespace kvt_cu
