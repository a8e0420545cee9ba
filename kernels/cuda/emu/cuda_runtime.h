/*
 * cuda_runtime.h — the CUDA emulation's device side (-DKVT_CUDA_EMU=ON; docs/cuda-emulation.md).
 *
 * kvtier's .cu sources are compiled unmodified by a host C++20 compiler against this header: the
 * launch syntax is rewritten first (kernels/cuda/emu/rewrite.cmake: `k<<<cfg>>>(args)` becomes
 * `KVT_EMU_LAUNCH(k)(cfg)(args)`, on the same line), and everything a kernel reads from CUDA is
 * defined here: the qualifiers, threadIdx / blockIdx / blockDim / gridDim, __syncthreads,
 * __syncwarp, __shfl_down_sync, __any_sync, atomicAdd / atomicOr, __popc / __umulhi /
 * __umul64hi, and __shared__. Each CUDA thread of a block runs on its own fiber
 * (kernels/cuda/emu/emu.cpp): threads run one at a time, each until it reaches a barrier or ends,
 * in the order KVT_EMU_ORDER picks (forward, reverse, shuffle[:seed]).
 *
 * Only what kvtier's kernels use is modelled, exactly; everything else CUDA offers a kernel is
 * either undeclared or poisoned below, so using it fails to compile with a message naming it
 * (e.g. "attempt to use poisoned '__shfl_xor_sync'"): extend the emulation first, with a test.
 */
#ifndef KVT_CUDA_EMU_RUNTIME_H
#define KVT_CUDA_EMU_RUNTIME_H

#ifndef __cplusplus
#error "kernels/cuda/emu/cuda_runtime.h is the emulated device side: C++ only (C includes cuda_runtime_api.h)"
#endif

/* The system headers a .cu file may include come first, before the macros below change the
 * meaning of `__shared__` and the CUDA names. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"

/* The runtime's C++ overloads (cuda_runtime.h's templates over the pointer's type). */
template <class T>
inline cudaError_t cudaMalloc(T **p, size_t bytes) {
    return ::cudaMalloc((void **)(void *)p, bytes);
}
template <class T>
inline cudaError_t cudaMallocAsync(T **p, size_t bytes, cudaStream_t stream) {
    return ::cudaMallocAsync((void **)(void *)p, bytes, stream);
}
template <class T>
inline cudaError_t cudaHostAlloc(T **p, size_t bytes, unsigned int flags) {
    return ::cudaHostAlloc((void **)(void *)p, bytes, flags);
}

/* nvcc's view of the translation unit: the kernels' headers take their device branches
 * (kvt_hd.h's __umul64hi, philox.h's __umulhi, recall_promo.h's __popc). */
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
/* __noinline__: a device function nvcc keeps out of line (its registers apart from the callers'
 * inlined code); the host compiler's attribute, no other meaning here. */
#define __noinline__ __attribute__((noinline))
/* __shared__: static storage in the section kvt_emu_shared, which the emulation fills with the
 * poison byte before each block (blocks run one at a time, so a static is the block's own). */
#define __shared__ __attribute__((section("kvt_emu_shared"))) static

/* fmaf in a kernel is one rounding, like the device's; on an x86-64 host without FMA in the
 * compiler's target, glibc's fmaf is a slow software routine, so call the library's kvt__fmaf
 * (the instruction where the CPU has it; kernels/fmaf.c, kernels/kvt_hd.h), as the CPU twins do. */
#if defined(__x86_64__) && defined(__ELF__) && !defined(__FMA__) && defined(__GNUC__)
extern "C" float kvt__fmaf(float a, float b, float c);
#define fmaf(a, b, c) ::kvt__fmaf((a), (b), (c))
#endif

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
};

namespace kvt_emu {

/* The CUDA thread a fiber is running (the emulation runs one at a time). */
struct Thread {
    uint3 thread_idx, block_idx;
    dim3 block_dim, grid_dim;
};
extern Thread *g_thread; /* emu.cpp sets it before it switches to a thread */
[[noreturn]] void outside_kernel();
inline Thread *current() {
    Thread *t = __atomic_load_n(&g_thread, __ATOMIC_RELAXED);
    if (__builtin_expect(!t, 0))
        outside_kernel();
    return t;
}

/* Barriers and warp exchanges (emu.cpp). `line` names the call in a report. */
void syncthreads(const char *file, int line);
void syncwarp(const char *file, int line, unsigned mask = 0xffffffffu);
uint64_t warp_exchange(int kind, unsigned mask, uint64_t value, unsigned src_lane,
                       const char *file, int line);
bool any_sync(unsigned mask, int pred, const char *file, int line);
[[noreturn]] void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

enum { kShflDown = 1 };

template <class T>
T shfl_down(const char *file, int line, unsigned mask, T var, unsigned delta, int width = 32) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8,
                  "kvt_emu: __shfl_down_sync of a type other than 4 or 8 bytes is not modelled");
    static_assert(std::is_trivially_copyable<T>::value, "kvt_emu: __shfl_down_sync of a class");
    if (width < 1 || width > 32 || (width & (width - 1)))
        fatal("%s:%d: __shfl_down_sync width %d (a power of two up to 32)", file, line, width);
    const Thread *t = current();
    const unsigned lin =
        t->thread_idx.x + t->block_dim.x * (t->thread_idx.y + t->block_dim.y * t->thread_idx.z);
    const unsigned lane = lin % 32u;
    /* the source lane: lane + delta within the lane's width-wide segment, else the lane itself */
    const unsigned src = (lane % (unsigned)width) + delta < (unsigned)width ? lane + delta : lane;
    uint64_t bits = 0;
    memcpy(&bits, &var, sizeof var);
    bits = warp_exchange(kShflDown, mask, bits, src, file, line);
    T out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* A launch: the kernel called once per CUDA thread with its own copy of the arguments. */
struct Kernel {
    const char *name = "", *file = "";
    int line = 0;
    virtual ~Kernel() = default;
    virtual void run() = 0;
};

void launch(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream, std::shared_ptr<Kernel> k);

template <class F, class Tup>
struct Job final : Kernel {
    F f;
    Tup args;
    Job(F fn, Tup a) : f(fn), args(std::move(a)) {}
    void run() override {
        std::apply([this](const auto &...a) { f(a...); }, args);
    }
};

template <class F>
struct Configured {
    F f;
    const char *name, *file;
    int line;
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    /* The arguments as CUDA passes them: copied bytewise at the launch, at most 32,764 bytes
     * (CUDA 12.1+ on sm_70+), each trivially copyable. */
    template <class... A>
    void operator()(A &&...a) const {
        static_assert((std::is_trivially_copyable<std::decay_t<A>>::value && ...),
                      "kvt_emu: a kernel argument must be trivially copyable (CUDA copies it bytewise)");
        static_assert((sizeof(std::decay_t<A>) + ... + 0) <= 32764,
                      "kvt_emu: kernel arguments above CUDA's 32,764 bytes");
        auto job = std::make_shared<Job<F, std::tuple<std::decay_t<A>...>>>(
            f, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...));
        job->name = name;
        job->file = file;
        job->line = line;
        launch(grid, block, shmem, stream, std::move(job));
    }
};

template <class F>
struct Launcher {
    F f;
    const char *name, *file;
    int line;
    Configured<F> operator()(dim3 grid, dim3 block, size_t shmem = 0,
                             cudaStream_t stream = nullptr) const {
        return Configured<F>{f, name, file, line, grid, block, shmem, stream};
    }
};

template <class F>
Launcher<F> kernel(F f, const char *name, const char *file, int line) {
    return Launcher<F>{f, name, file, line};
}

} // namespace kvt_emu

/* `name<<<cfg>>>(args)` after kernels/cuda/emu/rewrite.cmake. */
#define KVT_EMU_LAUNCH(name)                                                                       \
    ::kvt_emu::kernel([](const auto &...kvt_emu_a) { name(kvt_emu_a...); }, #name, __FILE__,      \
                      __LINE__)

#define threadIdx (::kvt_emu::current()->thread_idx)
#define blockIdx (::kvt_emu::current()->block_idx)
#define blockDim (::kvt_emu::current()->block_dim)
#define gridDim (::kvt_emu::current()->grid_dim)

#define __syncthreads() ::kvt_emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::kvt_emu::syncwarp(__FILE__, __LINE__ __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_down_sync(...) ::kvt_emu::shfl_down(__FILE__, __LINE__, __VA_ARGS__)
#define __any_sync(mask, pred) ::kvt_emu::any_sync((mask), (pred), __FILE__, __LINE__)

/* Atomics: relaxed, as CUDA's (they order nothing; ThreadSanitizer sees them as atomic). */
inline unsigned int atomicAdd(unsigned int *p, unsigned int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned int atomicOr(unsigned int *p, unsigned int v) {
    return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}
/* No other overload: an atomicAdd on int, float or double does not compile. */
template <class T, class U>
T atomicAdd(T *, U) = delete;
template <class T, class U>
T atomicOr(T *, U) = delete;

/* Integer intrinsics the kernels' headers use on the device. */
inline int __popc(unsigned int v) {
    return __builtin_popcount(v);
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

/* What a kernel could use and the emulation does not model: a compile error naming it. */
#pragma GCC poison __shfl_sync __shfl_up_sync __shfl_xor_sync __ballot_sync __all_sync
#pragma GCC poison __activemask __match_any_sync __match_all_sync __reduce_add_sync
#pragma GCC poison __syncthreads_count __syncthreads_and __syncthreads_or
#pragma GCC poison __threadfence __threadfence_block __threadfence_system __nanosleep
#pragma GCC poison __ldg __ldcg __ldca __ldcs __stcg __stcs __prefetch_global_l2
#pragma GCC poison atomicSub atomicExch atomicMin atomicMax atomicInc atomicDec atomicCAS
#pragma GCC poison atomicAnd atomicXor atomicAdd_block atomicAdd_system
#pragma GCC poison __constant__ __managed__ __launch_bounds__ __grid_constant__ warpSize
#pragma GCC poison __clz __ffs __brev __popcll __clzll __ffsll __byte_perm __funnelshift_l
#pragma GCC poison __fmaf_rn __fadd_rn __fmul_rn __fdiv_rn __frcp_rn __fsqrt_rn __expf __logf
#pragma GCC poison __nv_bfloat16 __half2 __nv_fp8_e4m3
#pragma GCC poison curand_init curand curand_uniform curand_normal cooperative_groups
#pragma GCC poison cudaLaunchKernel cudaLaunchCooperativeKernel cudaFuncSetAttribute

#endif /* KVT_CUDA_EMU_RUNTIME_H */
