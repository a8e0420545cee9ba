/*
 * cu_recall.cuh — the recall trigger's device pieces that the NoPE step (cu_recall.cu) and the
 * RoPE step (cu_rope.cu) share: the scan's workspace and per-head preparation, the fire flags
 * and their compaction, the work items (eager or planned), the best-score reduction, the
 * pruned scan's groups and the samples' merge. Inline with internal linkage (cu_common.cuh).
 */
#ifndef KVT_KERNELS_CUDA_CU_RECALL_CUH
#define KVT_KERNELS_CUDA_CU_RECALL_CUH

#include "kernels/cuda/cu_common.cuh"

namespace kvt_cu {
namespace {

/* ----------------------------------------------------------------------------------------------
 * Recall scans (recall_scan): three launches for up to kMaxSeg work items (grid y = the item):
 * the heads prepared (one block per head), the archived rows' fire flags (scan_rows: tiles of
 * rows staged in shared memory, the heads split over a row's threads, the flag their OR), then
 * the fired rows compacted ascending (one block per item), the first cap written. Every value through recall_scan.h's KVT_HD functions
 * (kvt__recall_idx's chains are the twin's tiled ones), so fired sets are the CPU twin's.
 * -------------------------------------------------------------------------------------------- */
typedef Params<kvt__recall_scan_args, kMaxSeg> ScanParams;

/* The argument rules: kvt__recall_scan_args_ok / kvt__recall_step_args_ok
 * (recall_step.h), one definition with the CPU ops' (the 8-bit scan's, q8_off > 0, included). */
inline bool scan_args_ok(const kvt__recall_scan_args &a) {
    return kvt__recall_scan_args_ok(&a) != 0;
}

/* Bytes of one head's 8-bit vector (kvt__recall_q8_len) in a workspace sized for any 8-bit
 * item of branch_dim bd: the widest sketch a plane may hold (a planned step's bound does not
 * say the width). */
inline size_t q8_head_bytes_max(uint32_t bd) {
    return kvt__recall_q8_len(bd, KVT__SKETCH_MAX_RANK);
}

/* Workspace of each item (`each` bytes apart): q̃_sk [heads][rank] floats, the residuals
 * [heads][D] floats, the heads' fields [heads], the 8-bit scan's heads (kvt__recall_q8h [heads],
 * then their vectors [heads][kvt__recall_q8_len], both 0 bytes for 16-bit items), one fire flag
 * per closed row. */
struct ScanWs {
    uint8_t *base;
    size_t each, off_res, off_heads, off_q8h, off_q8v, off_flags, off_extra;
    size_t off_promo; /* recall_step with promotion: PromoWs (0 elsewhere) */
    size_t off_groups, group_each, off_live, off_visit; /* recall_step's pruned scan: GroupWs */
};

/* The layout of k work items' scan workspace (item i's scan args at (char *)a0 + i * stride on
 * the host), `extra` more bytes each at off_extra; the most heads and closed rows among them. */
/* The layout of scan items of at most qsk q̃_sk floats, res residual floats, H heads and rows
 * closed rows each, `extra` more bytes at off_extra; q8: the most bytes of a head's 8-bit
 * vector (0: 16-bit items only). */
inline ScanWs scan_ws_make(size_t qsk, size_t res, uint32_t H, size_t rows, size_t extra,
                           size_t q8 = 0) {
    ScanWs w;
    w.base = NULL;
    w.off_res = align256(sizeof(float) * qsk);
    w.off_heads = w.off_res + align256(sizeof(float) * res);
    w.off_q8h = w.off_heads + align256(sizeof(kvt__recall_head) * H);
    w.off_q8v = w.off_q8h + (q8 ? align256(sizeof(kvt__recall_q8h) * H) : 0);
    w.off_flags = w.off_q8v + align256(q8 * H);
    w.off_extra = w.off_flags + align256(rows);
    w.each = w.off_extra + align256(extra);
    w.off_promo = w.off_groups = w.group_each = w.off_live = w.off_visit = 0;
    return w;
}

/* q8_any: size every item's 8-bit heads for the widest plane (a planned step's bound, whose
 * q8_off is not stated); else by each item's own q8_off. */
inline ScanWs scan_ws_of(const kvt__recall_scan_args *a0, size_t stride, uint32_t k, size_t extra,
                         uint32_t *H_out, size_t *rows_out, bool q8_any = false) {
    size_t qsk = 0, res = 0, rows = 0, q8 = 0;
    uint32_t H = 0;
    for (uint32_t i = 0; i < k; i++) {
        const kvt__recall_scan_args &x =
            *(const kvt__recall_scan_args *)((const uint8_t *)a0 + i * stride);
        const size_t q1 = (size_t)x.n_heads * x.rank, r1 = (size_t)x.n_heads * x.latent_dim;
        qsk = q1 > qsk ? q1 : qsk;
        res = r1 > res ? r1 : res;
        rows = x.n_closed > rows ? x.n_closed : rows;
        H = x.n_heads > H ? x.n_heads : H;
        const size_t v = q8_any      ? q8_head_bytes_max(x.branch_dim)
                         : x.q8_off ? kvt__recall_q8_len(x.branch_dim, x.q8_off)
                                    : 0;
        q8 = v > q8 ? v : q8;
    }
    *H_out = H;
    *rows_out = rows;
    return scan_ws_make(qsk, res, H, rows, extra, q8);
}

struct ScanItem {
    float *q_sk, *res;
    kvt__recall_head *heads;
    kvt__recall_q8h *q8h; /* the 8-bit scan's heads (q8_off > 0) */
    uint8_t *q8v;         /* their vectors, kvt__recall_q8_len bytes a head */
    uint8_t *flags;
};

__device__ inline ScanItem scan_item(const ScanWs &w, uint32_t i) {
    uint8_t *b = w.base + w.each * i;
    ScanItem it;
    it.q_sk = (float *)b;
    it.res = (float *)(b + w.off_res);
    it.heads = (kvt__recall_head *)(b + w.off_heads);
    it.q8h = (kvt__recall_q8h *)(b + w.off_q8h);
    it.q8v = b + w.off_q8v;
    it.flags = b + w.off_flags;
    return it;
}

#define SCAN_ARGS(p, i) JOB_ARGS(kvt__recall_scan_args, p, i)

/* Head prep (kvt__recall_head_prep, parallel over k then d): q̃_sk[k] by kvt__sketch_coef's
 * chain, q̃_res[d] by kvt__recall_resid's, then the norms and bounds by thread 0, and for the
 * 8-bit scan its quantised head (kvt__recall_q8_head: the CPU twin's q8_prep, one thread, so the
 * scales and rounding norms are its bits). The whole block calls it for head h < a.n_heads. */
__device__ inline void scan_head(const kvt__recall_scan_args &a, const ScanItem &it, uint32_t h) {
    __shared__ float s_q8tmp[KVT__RECALL_MAX_BRANCH + KVT__SKETCH_MAX_RANK];
    const uint32_t D = a.latent_dim, rank = a.rank;
    const float *q = a.q + (size_t)h * (D + a.branch_dim);
    float *q_sk = it.q_sk + (size_t)h * rank, *res = it.res + (size_t)h * D;
    for (uint32_t k = threadIdx.x; k < rank; k += blockDim.x)
        q_sk[k] = kvt__sketch_coef(q, D, a.basis + (size_t)k * D);
    __syncthreads();
    for (uint32_t d = threadIdx.x; d < D; d += blockDim.x)
        res[d] = kvt__recall_resid(q, q_sk, a.basis, rank, D, d);
    __syncthreads();
    if (threadIdx.x == 0) {
        kvt__recall_head_finish(q, D, rank, q_sk, res, &it.heads[h]);
        if (a.q8_off)
            kvt__recall_q8_head(q, D, a.branch_dim, q_sk, rank, a.q8_off, s_q8tmp,
                                it.q8v + (size_t)h * kvt__recall_q8_len(a.branch_dim, a.q8_off),
                                &it.q8h[h]);
    }
}

/* Does a head fire in the 8-bit scan on a row whose plane is pl (kvt__recall_q8_words fp16
 * words: its six values, then its vector), ρ rho? kvt__recall_q8_dots (exact integers) and
 * kvt__recall_q8_fires: the CPU twin's per-element functions. Not inlined, its arguments scalars
 * and global pointers: the 16-bit scan's kernels keep their registers (56 for k_scan_rows, not
 * 142 with this inlined) and no stack frame. */
__device__ __noinline__ bool q8_fires(const kvt__recall_head *hd, const kvt__recall_q8h *qh,
                                      const uint8_t *qv, const uint8_t *pl, uint32_t len,
                                      float rho, float s, float z, float best, int mode,
                                      uint32_t D, uint32_t bd, uint32_t rank) {
    int32_t ib, is;
    kvt__recall_q8_dots(pl + 4u * KVT__Q8_FLOATS, qv, bd, len, &ib, &is);
    const kvt__recall_head h = *hd;
    const kvt__recall_q8h q = *qh;
    return kvt__recall_q8_fires(&h, &q, pl, ib, is, rho, s, z, best, mode, D, bd, rank) != 0;
}

/* Head h of the item in the 8-bit scan (q8_fires on its prepared values). */
__device__ inline bool scan_q8_fires(const kvt__recall_scan_args &a, const ScanItem &it,
                                     uint32_t h, const uint8_t *pl, float rho) {
    const uint32_t len = kvt__recall_q8_len(a.branch_dim, a.q8_off);
    return q8_fires(it.heads + h, it.q8h + h, it.q8v + (size_t)h * len, pl, len, rho, a.scale,
                    a.z, a.best[h], a.mode, a.latent_dim, a.branch_dim, a.rank);
}

/* Does head h fire on a row whose branch is at `br` (branch_dtype, branch_dim values) and whose
 * sketch is csk (rank fp16 values), ρ rho? kvt__recall_idx and the mode's predicate. */
__device__ inline bool scan_head_fires(const kvt__recall_scan_args &a, const ScanItem &it,
                                       uint32_t h, const uint8_t *br, const uint16_t *csk,
                                       float rho) {
    const uint32_t D = a.latent_dim, bd = a.branch_dim, rank = a.rank;
    float P, ncsk;
    const float idx = kvt__recall_idx(a.q + (size_t)h * (D + bd), it.q_sk + (size_t)h * rank, br,
                                      D, 0u, a.branch_dtype, bd, csk, rank, a.scale, &P, &ncsk);
    const kvt__recall_head hd = it.heads[h];
    /* margin mode: the twin's !(s·acc + δ < best), idx being s·acc */
    return a.mode == KVT__RECALL_MARGIN ? !(idx + a.z < a.best[h])
           : a.mode == KVT__RECALL_SOUND
               ? kvt__recall_sound_fires(idx,
                                         kvt__recall_sound_margin(&hd, idx, P, ncsk, rho, a.scale,
                                                                  a.z, D, bd, rank),
                                         a.best[h]) != 0
               : kvt__recall_conformal_fires(idx, kvt__recall_cert(&hd, rho, a.scale, D), a.z,
                                             a.best[h]) != 0;
}

/* The first byte of a row's branch in the pool. */
__device__ inline const uint8_t *scan_branch(const kvt__recall_scan_args &a, uint32_t row) {
    return a.base + (size_t)kvt__page_slot(a.pages, a.first_page, a.pdiv, row) * a.slot_stride +
           a.branch_offset;
}

/* Does an archived row fire? Its heads in order until one does (the twin's OR). */
__device__ inline bool scan_fires(const kvt__recall_scan_args &a, const ScanItem &it,
                                  uint32_t row) {
    const uint16_t *csk = kvt__scan_csk(&a, row);
    const float rho = *kvt__scan_rho(&a, row);
    if (a.q8_off) {
        for (uint32_t h = 0; h < a.n_heads; h++)
            if (scan_q8_fires(a, it, h, (const uint8_t *)(csk + a.q8_off), rho))
                return true;
        return false;
    }
    const uint8_t *br = scan_branch(a, row);
    for (uint32_t h = 0; h < a.n_heads; h++)
        if (scan_head_fires(a, it, h, br, csk, rho))
            return true;
    return false;
}

/* Is closed row r archived (past the sinks, not kept)? */
__device__ inline bool scan_archived(const kvt__recall_scan_args &a, uint64_t r) {
    return r >= a.sinks && !kvt__sorted_has(a.kept, a.m, r);
}

/* One flag per scanned row: evaluated and fired. Positions t < n map to rows (map(t, &row) sets
 * the row and returns whether it is evaluated: archived, and in the pruned scan in a live
 * group); flags[row] = evaluated && fires for every position, and *visit (when given) gains the
 * positions evaluated. The positions go in tiles of T (a power of two, 8 .. kThreads) a block,
 * the grid's x striding over the tiles (every block of an item calls it): the tile's evaluated
 * rows' branches and sketches copied to shared memory first, a warp reading one row's bytes at a
 * time (consecutive u16 units, so its loads coalesce: a thread a row read 32 rows' lines a load),
 * then kThreads / T threads a row, each its share of the heads (h, h + L, ..) from the shared
 * copy, the row's flag their OR. Each head's chain is kvt__recall_idx's on the same values, so
 * the flags are the thread-a-row scan's. A row too wide for 8 in the tile (branch and sketch
 * over 3,072 bytes) takes the thread-a-row scan. */
constexpr uint32_t kScanTileU16 = 12288; /* 24 KB */
struct alignas(16) ScanTile {
    uint16_t u[kScanTileU16];
};
/* The tile's shared memory, one per kernel whatever the row maps (a __shared__ variable in the
 * template would be one per instantiation: the full and the pruned scan in one kernel would hold
 * two tiles, over the 48 KB of static shared memory). */
struct ScanShared {
    ScanTile tile;
    const uint8_t *br[kThreads];
    const uint16_t *csk[kThreads];
    float rho[kThreads];
    uint32_t fire[kThreads];
    uint64_t row[kThreads];
};
__device__ inline ScanShared &scan_shared() {
    __shared__ ScanShared s;
    return s;
}
template <class Map>
__device__ inline void scan_tiles(const kvt__recall_scan_args &a, const ScanItem &it, uint64_t n,
                                  Map map, unsigned long long *visit) {
    const uint32_t elt = a.branch_dtype == KVT__DT_FP32 ? 4u : 2u;
    /* 16-bit: the branch's u16 units then the sketch; 8-bit: the plane's words alone (at
     * q8_off of the sketch row; an even count: 24 bytes and a multiple of 4) */
    const uint32_t q8w = a.q8_off ? kvt__recall_q8_words(a.branch_dim, a.q8_off) : 0u;
    const uint32_t bw = a.q8_off ? 0u : a.branch_dim * elt / 2u;
    const uint32_t nu = a.q8_off ? q8w : bw + a.rank;   /* a row's units */
    const uint32_t W = (nu + 1u) & ~1u;                  /* even: 4-byte rows */
    uint32_t T = kThreads;
    while (T >= 8 && (uint64_t)T * W > kScanTileU16)
        T /= 2;
    unsigned long long cnt = 0;
    if (T < 8) {
        for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < n;
             t += (uint64_t)gridDim.x * blockDim.x) {
            uint64_t r = t;
            const bool ev = map(t, &r);
            cnt += ev;
            it.flags[r] = ev && scan_fires(a, it, (uint32_t)r);
        }
        if (visit && cnt)
            atomicAdd(visit, cnt);
        return;
    }
    ScanShared &sh = scan_shared();
    uint16_t *s_u = sh.tile.u;
    const uint8_t **s_br = sh.br;
    const uint16_t **s_csk = sh.csk;
    float *s_rho = sh.rho;
    uint32_t *s_fire = sh.fire;
    uint64_t *s_row = sh.row;
    const uint32_t L = kThreads / T, slot = threadIdx.x / L, lane = threadIdx.x % L;
    for (uint64_t t0 = (uint64_t)blockIdx.x * T; t0 < n; t0 += (uint64_t)gridDim.x * T) {
        __syncthreads(); /* the last tile's copy read by every thread */
        if (threadIdx.x < T) {
            const uint64_t t = t0 + threadIdx.x;
            uint64_t r = t;
            const bool ev = t < n && map(t, &r);
            cnt += ev;
            s_row[threadIdx.x] = r;
            /* s_br marks an evaluated row (8-bit: the plane's first word) */
            s_csk[threadIdx.x] = ev ? kvt__scan_csk(&a, r) : NULL;
            s_br[threadIdx.x] = !ev        ? NULL
                                : a.q8_off ? (const uint8_t *)(s_csk[threadIdx.x] + a.q8_off)
                                           : scan_branch(a, (uint32_t)r);
            s_rho[threadIdx.x] = ev ? *kvt__scan_rho(&a, r) : 0.0f;
            s_fire[threadIdx.x] = 0;
        }
        __syncthreads();
        for (UnitWalk u(W ? W : 1u); W && u.row < T; u.next()) {
            const uint8_t *br = s_br[u.row];
            if (br && u.unit < nu)
                s_u[u.row * W + u.unit] = a.q8_off || u.unit >= bw
                                              ? s_csk[u.row][u.unit - bw + a.q8_off]
                                              : kvt__dev_ld_u16(br + 2u * u.unit);
        }
        __syncthreads();
        if (s_br[slot]) {
            const uint8_t *br = (const uint8_t *)(s_u + slot * W);
            const uint16_t *csk = s_u + slot * W + bw;
            for (uint32_t h = lane; h < a.n_heads; h += L)
                if (a.q8_off ? scan_q8_fires(a, it, h, br, s_rho[slot])
                             : scan_head_fires(a, it, h, br, csk, s_rho[slot])) {
                    atomicOr(&s_fire[slot], 1u);
                    break;
                }
        }
        __syncthreads();
        if (threadIdx.x < T && t0 + threadIdx.x < n)
            it.flags[s_row[threadIdx.x]] = s_fire[threadIdx.x] ? 1 : 0;
    }
    if (visit && cnt)
        atomicAdd(visit, cnt);
}

/* One flag per closed row: archived and fired (the full scan). */
__device__ inline void scan_rows(const kvt__recall_scan_args &a, const ScanItem &it) {
    scan_tiles(
        a, it, a.n_closed, [&](uint64_t t, uint64_t *) { return scan_archived(a, t); }, NULL);
}

/* The fired rows ascending, the first cap of them into a.fired; returns how many fired (all
 * threads of the block call it). */
__device__ inline uint32_t scan_compact(const kvt__recall_scan_args &a, const uint8_t *flags) {
    return block_compact(
        (uint32_t)a.n_closed, [&](uint32_t i) { return flags[i] != 0; }, a.fired, a.cap);
}

/* The grid of a per-row launch over k items of at most `rows` rows (a block per kThreads rows,
 * at most 4096 blocks an item: the rest in strides). */
inline dim3 rows_grid(size_t rows, uint32_t k) {
    const size_t blocks = (rows + kThreads - 1) / kThreads;
    return dim3((unsigned)(blocks < 4096 ? blocks : 4096), k);
}

/* ----------------------------------------------------------------------------------------------
 * Recall steps (recall_step): the CPU twin's kvt__recall_step_cpu (recall_step.c) in four
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
 * scan (recall_group.h): the groups of the blocks kvt__recall_groups_want names past the
 * state's n_grouped built (one block of threads per group block, k_step_groups), then each
 * group's liveness over
 * the heads (kvt__recall_group_live, a thread per group, k_step_live); launch 3 then evaluates
 * the archived members of live groups (and the rows past the grouped blocks) and counts them, so
 * the state's visited and n_grouped, and the planes, are the twin's too.
 * -------------------------------------------------------------------------------------------- */
constexpr uint32_t kMaxStep = 32;
typedef Params<kvt__recall_step_args, kMaxStep> StepParams;
static_assert(sizeof(StepParams) <= 32000, "kernel parameters above CUDA's 32 KB");

inline StepParams step_params(const kvt__recall_step_args *host, uint32_t n) {
    StepParams p = params_of<kvt__recall_step_args, kMaxStep>(host, n);
    for (uint32_t i = 0; i < n; i++)
        if (host[i].scan.pdiv)
            p.div[i] = *host[i].scan.pdiv;
    return p;
}

/* Where a recall step launch's work items come from (the kernels are templates over it): a
 * batch's plan image in device memory as it is when the kernel runs (a captured launch replays
 * over later steps). get(): kItemOk with the item in x (its divider in d), kItemNone past the
 * items, kItemBad for an item that breaks the argument rules or the plan's bound (k_step_finish
 * makes its step dense). */
enum { kItemNone = 0, kItemOk = 1, kItemBad = 2 };

/* A plan's items (PA: its op's arguments, with n, n_max; Item: the KVT_HD check that builds
 * item i as the op runs it). */
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

typedef PlanOf<kvt__recall_plan_args, kvt__recall_step_args, kvt__recall_plan_item_args>
    PlanItems;

#define STEP_ARGS(src, i)                                                                          \
    kvt__recall_step_args x;                                                                       \
    kvt__div32 x_div;                                                                              \
    if ((src).get(i, x, x_div) != kItemOk)                                                         \
        return;                                                                                    \
    x.scan.pdiv = &x_div

/* Promotion's part of an item's workspace, after its step extra (ScanWs.off_promo): the merged
 * list's length [1], then per promoted row its hit flag [prom_cap] (the heads' blocks OR into
 * it), the kept set merged with the promoted rows [m + prom_cap], and kvt__promo_after's
 * tables [2·cand_cap + 2·prom_cap], u32 each (kvt__promo_scratch_u32 + prom_cap + 1). */
struct PromoWs {
    uint32_t *n_merged, *hit, *merged, *tmp;
};

inline size_t promo_ws_u32(const kvt__recall_step_args &x) {
    return x.promo ? 1u + x.prom_cap + kvt__promo_scratch_u32(&x) : 0;
}

__device__ inline PromoWs promo_ws(const ScanWs &w, uint32_t item, const kvt__recall_step_args &x) {
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
__device__ inline kvt__recall_step_args step_view(const kvt__recall_step_args &x, const ScanWs &w,
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

__device__ inline StepPlan step_plan(const kvt__recall_step_args &x, uint32_t phase) {
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
__device__ inline kvt__recall_scan_args step_scan(const kvt__recall_step_args &x,
                                                  const StepPlan &pl, float state_z) {
    kvt__recall_scan_args a = x.scan;
    a.z = kvt__recall_mode_z(x.mode, a.latent_dim, x.margin, state_z);
    a.mode = x.mode;
    a.sinks = pl.S;
    return a;
}

/* The running best of a block: higher score, ties (==, so ±0 too) to the lower row; a score
 * that is not above -Inf (NaN, -Inf) never counts — the twin's `sc > best` from -Inf. */
__device__ inline void best_take(float v, uint64_t row, float &bv, uint64_t &br) {
    if (v > -INFINITY && (v > bv || (v == bv && row < br))) {
        bv = v;
        br = row;
    }
}

__device__ inline void best_reduce(float &bv, uint64_t &br) {
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

__device__ inline float step_exact(const kvt__recall_scan_args &a, const float *q, uint64_t row) {
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

__device__ inline StepExtra step_extra(const ScanWs &w, uint32_t item, uint32_t n_heads) {
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
__device__ inline void promo_before_item(const Items &p, const ScanWs &w, uint32_t item) {
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
__device__ inline void step_heads_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    if (blockIdx.x < x.scan.n_heads)
        scan_head(x.scan, scan_item(w, item), blockIdx.x);
}

/* Launch 2: head blockIdx.x of the item. */
template <class Items>
__device__ inline void step_best_item(const Items &p, const ScanWs &w, uint32_t item) {
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
 * The pruned scan's groups (recall_group.h; the twin: kvt__recall_group_block_cpu and
 * kvt__recall_scan_pruned_cpu). An item's part of the workspace (ScanWs.off_groups): a build
 * scratch for each of the kGroupBlocks blocks of threads that build its closed blocks (sort keys
 * [B] u64, t by row and t sorted [B] floats each, a centre and a direction [dim] floats each),
 * one liveness byte per group slot of its blocks, and the count of rows the scan evaluated.
 * -------------------------------------------------------------------------------------------- */
constexpr uint32_t kGroupBlocks = 4;

inline size_t group_build_bytes(uint32_t B, uint32_t dim) {
    return align256(sizeof(uint64_t) * B) + align256(2 * sizeof(float) * B) +
           align256(2 * sizeof(float) * dim);
}

struct GroupWs {
    uint8_t *build; /* kGroupBlocks scratches, `each` bytes apart */
    size_t each;
    uint8_t *live;  /* [blocks][B/32] */
    unsigned long long *visit;
};

__device__ inline GroupWs group_ws(const ScanWs &w, uint32_t item) {
    uint8_t *b = w.base + w.each * item;
    GroupWs g;
    g.build = b + w.off_groups;
    g.each = w.group_each;
    g.live = b + w.off_live;
    g.visit = (unsigned long long *)(b + w.off_visit);
    return g;
}

/* Does this step run the pruned scan (the twin's choice: planes, not the margin mode, a
 * scanning step the state says pays; launch 4 counts the step, so this one is steps + 1)? At
 * 8 bits the groups' bound is the widened one (kvt__recall_group_live with the heads' 8-bit
 * values). */
__device__ inline bool step_prunes(const kvt__recall_step_args &x, const StepPlan &pl) {
    return x.g_perm && x.mode != KVT__RECALL_MARGIN && pl.scan &&
           kvt__recall_prune_pays(x.st, x.st->steps + 1u);
}

/* Does the step build the groups due (every scan step with group planes, pruning or not: the
 * twin's build_groups)? */
__device__ inline bool step_builds(const kvt__recall_step_args &x, const StepPlan &pl) {
    return x.g_perm && x.mode != KVT__RECALL_MARGIN && pl.scan;
}

/* The closed blocks whose groups the step wants built (the twin's kvt__recall_groups_want: all
 * but the newest KVT__RECALL_GROUP_LAG at once, those one a step), and the grouped blocks after
 * its build: max(n_grouped, that), within the closed rows. */
__device__ inline uint64_t groups_want(const kvt__recall_step_args &x) {
    return kvt__recall_groups_want(x.scan.n_closed, x.block_rows, x.g_blocks_cap, x.st->n_grouped);
}

__device__ inline uint64_t groups_after(const kvt__recall_step_args &x) {
    const uint64_t w = groups_want(x), o = x.st->n_grouped, lim = x.scan.n_closed / x.block_rows;
    const uint64_t n = o > w ? o : w;
    return n < lim ? n : lim;
}

/* The item's group planes as the pruned scan reads them (kvt__recall_groups: block b at slot b),
 * its grouped blocks after this step's build. */
__device__ inline kvt__recall_groups step_groups(const kvt__recall_step_args &x) {
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
__device__ inline uint64_t groups_slot(const kvt__recall_groups &g, uint64_t b) {
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
__device__ inline uint32_t seg_farthest(const BlockRows &br, const uint32_t *perm, uint32_t lo,
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
__device__ inline void block_sort_u64(uint64_t *key, uint32_t P) {
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
__device__ inline void group_build_block(const kvt__recall_scan_args &a,
                                         const kvt__recall_groups &gp, uint64_t blk, uint8_t *scr) {
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
__device__ inline void groups_build(const kvt__recall_scan_args &a, const kvt__recall_groups &g,
                                    uint64_t from, uint64_t to, const GroupWs &gw) {
    for (uint64_t blk = from + blockIdx.x; blk < to; blk += gridDim.x) {
        group_build_block(a, g, blk, gw.build + gw.each * blockIdx.x);
        __syncthreads(); /* the scratch is reused by the next block */
    }
}

/* One byte per group slot of g's blocks (live[b·G + j]), 1 where some head of view a (its
 * prepared heads in it) may fire on a member (kvt__recall_group_live with the twin's y·c chain
 * and Y), a thread per slot over the grid's x. */
__device__ inline void groups_live(const kvt__recall_scan_args &a, const ScanItem &it,
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
                const double Y = kvt__recall_group_ynorm(qb, qs, bd, rank);
                const float yc = kvt__recall_group_ydot(qb, qs, c, bd, rank);
                on = kvt__recall_group_live(&hd, a.q8_off ? &it.q8h[h] : NULL, Y, yc, stt, a.mode,
                                            a.scale, a.z, a.best[h], D, bd, rank, a.q8_off);
            }
        }
        live[t] = (uint8_t)on;
    }
}

/* Launch 2b, scan steps with group planes: the groups of closed blocks [n_grouped, want), the
 * item's kGroupBlocks blocks of threads taking them in strides. */
template <class Items>
__device__ inline void step_groups_item(const Items &p, const ScanWs &w, uint32_t item) {
    STEP_ARGS(p, item);
    if (!step_builds(x, step_plan(step_view(x, w, item), x.st->phase)))
        return;
    groups_build(x.scan, step_groups(x), x.st->n_grouped, groups_want(x), group_ws(w, item));
}

/* Launch 2c, pruning steps: one byte per group slot of the grouped blocks, 1 where some head may
 * fire on a member (kvt__recall_group_live with the twin's y·c chain and Y), a thread per slot;
 * the visited count zeroed. */
template <class Items>
__device__ inline void step_live_item(const Items &p, const ScanWs &w, uint32_t item) {
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
 * them; the archived rows evaluated counted into the visited count. In scan_tiles' tiles: the
 * rows of a tile are scattered (perm order), each still read by a warp and split over heads. */
__device__ inline void scan_rows_pruned(const kvt__recall_scan_args &a, const ScanItem &it,
                                        const kvt__recall_groups &g, const GroupWs &gw) {
    const uint32_t B = g.block_rows, G = kvt__recall_group_slots(B);
    const uint64_t grouped = g.n_blocks * B;
    scan_tiles(
        a, it, a.n_closed,
        [&](uint64_t t, uint64_t *row) {
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
                *row = b * B + g.perm[k * B + i];
                on = lo < ng && gw.live[b * G + lo];
            }
            return on && *row >= a.sinks && !kvt__sorted_has(a.kept, a.m, *row);
        },
        gw.visit);
}

/* Launch 3: the scan's fire flags, scanning steps only. */
template <class Items>
__device__ inline void step_rows_item(const Items &p, const ScanWs &w, uint32_t item) {
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
__device__ inline void samples_merge(const float *e, uint32_t n, uint32_t *valid, float *nw,
                                     float *old, float *samples, uint32_t cap, uint32_t n0,
                                     uint32_t *n_out) {
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

__device__ inline void step_insert(const kvt__recall_step_args &x, const StepExtra &ex,
                                   uint32_t n0) {
    samples_merge(ex.e, x.scan.n_heads, ex.valid, ex.nw, ex.old, x.samples, x.sample_cap, n0,
                  &x.st->n_samples);
}

/* Launch 4: one block per item (a row of blocks walks several). */
template <class Items>
__device__ inline void step_finish_item(const Items &p, const ScanWs &w, uint32_t item) {
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
    __shared__ uint32_t s_phase, s_n, s_prune, s_build;
    __shared__ float s_z;
    const kvt__recall_step_args v = step_view(x, w, item);
    if (threadIdx.x == 0) {
        s_phase = st->phase;
        s_z = st->z;
        s_n = st->n_samples;
        s_prune = step_prunes(x, step_plan(v, s_phase));
        s_build = step_builds(x, step_plan(v, s_phase));
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
    const uint64_t want = s_build ? groups_want(x) : 0; /* the twin's build_groups */
    if (want > st->n_grouped)
        st->n_grouped = (uint32_t)want;
    st->steps++;
    st->overflow_steps += over;
    kvt__recall_state_record(st, x.dense, dense, over, pl.archived, visited, fired, fetched);
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
inline ScanWs step_ws_of(const kvt__recall_step_args *a, uint32_t k, StepShape *sh) {
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
    ScanWs w = scan_ws_of(&a[0].scan, sizeof *a, k, extra + promo_b + groups_b, &sh->H, &sh->rows,
                          true);
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

/* The planned op (kvt__recall_plan_args): the layout of n_max items of the bound's shape and
 * the grids, fixed for the batch's life, so a captured launch replays over any later step: at
 * most kPlanItems rows of blocks walk the step's items (a step with few recalling requests
 * launches few idle blocks), rows in strides of at most kPlanRowBlocks blocks an item (the
 * bound's rows may be far more than a step's). */
constexpr uint32_t kPlanRowBlocks = 64;
constexpr uint32_t kPlanItems = 16;

} // namespace
} // namespace kvt_cu

#endif /* KVT_KERNELS_CUDA_CU_RECALL_CUH */
