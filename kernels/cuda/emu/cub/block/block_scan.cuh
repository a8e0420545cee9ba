/*
 * block_scan.cuh — the CUDA emulation's stand-in for the one cub piece kvtier uses:
 * cub::BlockScan<T, BLOCK_THREADS>::ExclusiveSum(input, output, block_aggregate) over a
 * 1-D block (docs/cuda-emulation.md). Its contract is cub's: every thread of the block calls it,
 * the block has exactly BLOCK_THREADS threads, and the TempStorage may be used again only after a
 * __syncthreads() (this stand-in, like cub, does not synchronise on the way out, so a kernel that
 * forgets that barrier races here too: a wrong result under another thread order, a
 * ThreadSanitizer report). Every other member of cub's BlockScan fails to compile, naming itself.
 */
#ifndef KVT_CUDA_EMU_CUB_BLOCK_SCAN_CUH
#define KVT_CUDA_EMU_CUB_BLOCK_SCAN_CUH

#include <cuda_runtime.h>

namespace kvt_emu {
template <class... A>
constexpr bool unmodelled = false;
}

namespace cub {

enum BlockScanAlgorithm { BLOCK_SCAN_RAKING, BLOCK_SCAN_RAKING_MEMOIZE, BLOCK_SCAN_WARP_SCANS };

template <class T, int BLOCK_DIM_X, BlockScanAlgorithm ALGORITHM = BLOCK_SCAN_RAKING,
          int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1>
class BlockScan {
    static constexpr unsigned kThreads = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;

  public:
    struct TempStorage {
        T v[kThreads];
    };

    __device__ explicit BlockScan(TempStorage &t) : t_(t) {
        if (blockDim.x * blockDim.y * blockDim.z != kThreads || blockDim.y != BLOCK_DIM_Y ||
            blockDim.z != BLOCK_DIM_Z)
            ::kvt_emu::fatal("cub::BlockScan for %u threads in a block of (%u, %u, %u)", kThreads,
                             blockDim.x, blockDim.y, blockDim.z);
    }

    /* output = the sum of the inputs of the threads before this one (linear order); aggregate
     * = the sum of all. One barrier between the writes and the reads, none after (cub's). */
    __device__ void ExclusiveSum(T input, T &output, T &block_aggregate) {
        const unsigned i = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
        t_.v[i] = input;
        __syncthreads();
        T before = T(), all = T();
        for (unsigned j = 0; j < kThreads; j++) {
            if (j == i)
                before = all;
            all = all + t_.v[j];
        }
        output = before;
        block_aggregate = all;
    }

    template <class... A>
        requires(sizeof...(A) != 3)
    __device__ void ExclusiveSum(A &&...) {
        static_assert(kvt_emu::unmodelled<A...>,
                      "kvt_emu: cub::BlockScan::ExclusiveSum without the block aggregate is not modelled");
    }
    template <class... A>
    __device__ void InclusiveSum(A &&...) {
        static_assert(kvt_emu::unmodelled<A...>, "kvt_emu: cub::BlockScan::InclusiveSum is not modelled");
    }
    template <class... A>
    __device__ void ExclusiveScan(A &&...) {
        static_assert(kvt_emu::unmodelled<A...>, "kvt_emu: cub::BlockScan::ExclusiveScan is not modelled");
    }
    template <class... A>
    __device__ void InclusiveScan(A &&...) {
        static_assert(kvt_emu::unmodelled<A...>, "kvt_emu: cub::BlockScan::InclusiveScan is not modelled");
    }

  private:
    TempStorage &t_;
};

} // namespace cub

#endif /* KVT_CUDA_EMU_CUB_BLOCK_SCAN_CUH */
