/*
 * emu.cpp — the CUDA emulation's runtime (-DKVT_CUDA_EMU=ON; docs/cuda-emulation.md): one
 * device in host memory, streams, events, stream capture and graphs, and the execution of kernel
 * launches on fibers.
 *
 * Execution. A launch runs its blocks one after another (forward, reverse or shuffled, as
 * KVT_EMU_ORDER says), under one process-wide lock: the emulated device runs one block at a time,
 * so `__shared__` variables (static storage in the section kvt_emu_shared) are the running
 * block's own; the section is filled with the poison byte before each block. A block's threads
 * run on fibers of the launching thread (a pool kept per host thread, 256 KiB stacks with a
 * guard page), one at a time: each runs until it reaches a barrier or returns, then the next
 * ready or unstarted one in the order's permutation (a new permutation every pass under
 * shuffle). A thread that waits keeps its fiber; one that returns hands its fiber to the next
 * unstarted thread of the pass without a switch (under TSan: a fiber of its own per thread).
 *   - __syncthreads: a counting barrier over the block's threads that have not returned (sm_70+:
 *     exited threads drop out); every thread must arrive at the same call (file and line), else
 *     the emulation stops, naming both (a barrier in divergent code).
 *   - __syncwarp(mask), __shfl_down_sync(mask, ..), __any_sync(mask, ..): a barrier of the
 *     lanes in mask of the thread's warp (32 consecutive linear thread indices); all lanes must
 *     arrive at the same kind of call with the same mask; a shuffle or vote whose mask names a
 *     lane that has returned or does not exist stops the emulation (undefined on a device);
 *     __syncwarp's exited lanes drop out. The values travel through a per-warp buffer.
 *   - a block whose threads all wait and none can go on (a barrier some thread never reaches)
 *     stops the emulation, saying where each waits.
 * Under ThreadSanitizer each fiber is a TSan fiber, switched without synchronisation; the only
 * happens-before edges between a block's threads are its barriers (released and acquired on the
 * barrier's object) and the launch's start and end, so an access pair that a missing
 * __syncthreads leaves unordered is reported as a race. Under AddressSanitizer the stack switches
 * are annotated.
 *
 * Memory. cudaMalloc gives exactly the bytes asked for, filled with the poison byte (0xff by
 * default, KVT_EMU_POISON=0xNN): in an ASan build from the sanitizer's allocator (every byte past
 * the end is a reported overflow); otherwise mapped so that the allocation ends where an
 * inaccessible guard page begins (16-byte aligned, so a read or write past the end faults within
 * 15 bytes of it), and unmapped when freed (a use after free faults). Copies and sets check both
 * ends against the allocation that holds the pointer.
 *
 * Streams are executed when their work is enqueued (the host waits), so no two streams ever
 * overlap and ordering bugs between streams are not found (docs/cuda-emulation.md). A stream
 * being captured records its launches, copies and sets into the graph, which cudaGraphLaunch
 * replays in order; the calls a capture forbids (synchronising, allocating, the legacy stream
 * beside a capturing blocking stream, waiting on an event recorded outside the capture)
 * return CUDA's errors and invalidate it.
 */
#include "cuda_runtime.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVT_EMU_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define KVT_EMU_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KVT_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define KVT_EMU_TSAN 1
#endif

#if KVT_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if KVT_EMU_TSAN
#include <sanitizer/tsan_interface.h>
#endif

/* The section's bounds (the linker defines them for a section named like a C identifier). */
extern "C" {
extern char __start_kvt_emu_shared[] __attribute__((weak));
extern char __stop_kvt_emu_shared[] __attribute__((weak));
}

/* The fibers' stack switch. On x86-64 a plain one (the callee-saved registers, MXCSR and the x87
 * control word, then the stack pointer): glibc's swapcontext also saves the signal mask, a
 * system call on every switch, which was half of the emulation's time. Elsewhere swapcontext. */
#if defined(__x86_64__) && defined(__ELF__)
#define KVT_EMU_ASM_SWITCH 1
extern "C" void kvt_emu_switch(void **save_sp, void *new_sp);
asm(R"(
    .text
    .globl kvt_emu_switch
    .hidden kvt_emu_switch
    .type kvt_emu_switch, @function
kvt_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvt_emu_switch, .-kvt_emu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif

namespace kvt_emu {

/* ---------------------------------------------------------------------------------------------
 * Reports
 * ------------------------------------------------------------------------------------------- */
[[noreturn]] void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("kvt_emu: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    abort();
}

namespace {

thread_local cudaError_t t_last = cudaSuccess;

cudaError_t ret(cudaError_t e) {
    if (e != cudaSuccess)
        t_last = e;
    return e;
}

unsigned char poison_byte() {
    static const unsigned char b = [] {
        const char *s = getenv("KVT_EMU_POISON");
        return (unsigned char)(s && *s ? strtoul(s, nullptr, 0) : 0xffu);
    }();
    return b;
}

/* ---------------------------------------------------------------------------------------------
 * Memory
 * ------------------------------------------------------------------------------------------- */
constexpr size_t kDeviceBytes = (size_t)16 << 30; /* the emulated device's memory */

struct Alloc {
    size_t bytes;
    void *map; /* the mapping (guard-page allocations), or NULL (malloc'd) */
    size_t map_bytes;
    bool host; /* cudaHostAlloc */
};

std::mutex g_mem_mu;
std::map<uintptr_t, Alloc> g_allocs; /* by first byte */
size_t g_device_used;

size_t page_size() {
    static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
    return p;
}

void *alloc_bytes(size_t bytes, Alloc *a) {
#if KVT_EMU_ASAN
    void *p = nullptr;
    a->map = nullptr;
    a->map_bytes = 0;
    return posix_memalign(&p, 256, bytes) == 0 ? p : nullptr;
#else
    /* [pages holding the bytes][guard page]; the bytes end 16-byte aligned at the guard */
    const size_t ps = page_size(), body = (bytes + 15) / 16 * 16;
    const size_t len = (body + ps - 1) / ps * ps + ps;
    void *m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED)
        return nullptr;
    uint8_t *guard = (uint8_t *)m + len - ps;
    if (mprotect(guard, ps, PROT_NONE) != 0) {
        munmap(m, len);
        return nullptr;
    }
    a->map = m;
    a->map_bytes = len;
    return guard - body;
#endif
}

void free_bytes(void *p, const Alloc &a) {
    if (a.map)
        munmap(a.map, a.map_bytes);
    else
        free(p);
}

cudaError_t new_alloc(void **out, size_t bytes, bool host) {
    if (!out)
        return cudaErrorInvalidValue;
    *out = nullptr;
    if (bytes == 0)
        return cudaSuccess;
    std::lock_guard<std::mutex> g(g_mem_mu);
    if (!host && (bytes > kDeviceBytes || g_device_used > kDeviceBytes - bytes))
        return cudaErrorMemoryAllocation;
    Alloc a{bytes, nullptr, 0, host};
    void *p = alloc_bytes(bytes, &a);
    if (!p)
        return cudaErrorMemoryAllocation;
    memset(p, poison_byte(), bytes);
    g_allocs[(uintptr_t)p] = a;
    if (!host)
        g_device_used += bytes;
    *out = p;
    return cudaSuccess;
}

cudaError_t drop_alloc(void *p, bool host) {
    if (!p)
        return cudaSuccess;
    std::lock_guard<std::mutex> g(g_mem_mu);
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || it->second.host != host)
        return host ? cudaErrorInvalidValue : cudaErrorInvalidDevicePointer;
    if (!host)
        g_device_used -= it->second.bytes;
    free_bytes(p, it->second);
    g_allocs.erase(it);
    return cudaSuccess;
}

/* [p, p + bytes) against the allocation holding p, if any (host memory the emulation did not
 * allocate passes: cudaMemcpyDefault takes pageable memory). Out of bounds stops: a device
 * overrun. Returns whether p is emulated memory (device or pinned host). */
bool check_range(const void *p, size_t bytes, const char *what) {
    std::lock_guard<std::mutex> g(g_mem_mu);
    auto it = g_allocs.upper_bound((uintptr_t)p);
    if (it == g_allocs.begin())
        return false;
    --it;
    const uintptr_t base = it->first, end = base + it->second.bytes;
    if ((uintptr_t)p >= end)
        return false;
    if ((uintptr_t)p + bytes > end)
        fatal("%s: %zu bytes at offset %zu of a %zu-byte %s allocation run %zu bytes past its end",
              what, bytes, (size_t)((uintptr_t)p - base), it->second.bytes,
              it->second.host ? "pinned host" : "device",
              (size_t)((uintptr_t)p + bytes - end));
    return true;
}

/* ---------------------------------------------------------------------------------------------
 * Streams, events, capture, graphs
 * ------------------------------------------------------------------------------------------- */
struct Node {
    enum Kind { kKernel, kCopy, kSet } kind;
    std::shared_ptr<Kernel> k;
    dim3 grid, block;
    void *dst;
    const void *src;
    size_t bytes, dpitch, spitch, height;
    int value;
};

struct Capture {
    std::vector<Node> nodes;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
    std::thread::id thread;
};

} // namespace
} // namespace kvt_emu

struct CUstream_st {
    unsigned flags;
    kvt_emu::Capture *cap;
};
struct CUevent_st {
    unsigned flags;
    kvt_emu::Capture *captured; /* recorded last in this capture (NULL: outside one) */
    std::chrono::steady_clock::time_point t;
    bool recorded;
};
struct CUgraph_st {
    std::vector<kvt_emu::Node> nodes;
};
struct CUgraphExec_st {
    std::vector<kvt_emu::Node> nodes;
};

namespace kvt_emu {
namespace {

std::mutex g_cap_mu;
std::vector<CUstream_st *> g_capturing; /* streams in an active or invalidated capture */

/* Invalidate every capture a potentially unsafe call of this thread breaks (global mode: any
 * thread's; thread-local: this thread's). True when there was one. */
bool unsafe_call() {
    std::lock_guard<std::mutex> g(g_cap_mu);
    bool any = false;
    for (CUstream_st *s : g_capturing)
        if (s->cap->status == cudaStreamCaptureStatusActive &&
            (s->cap->mode == cudaStreamCaptureModeGlobal ||
             (s->cap->mode == cudaStreamCaptureModeThreadLocal &&
              s->cap->thread == std::this_thread::get_id()))) {
            s->cap->status = cudaStreamCaptureStatusInvalidated;
            any = true;
        }
    return any;
}

/* Work on the legacy stream orders with every blocking stream: one being captured is invalidated
 * (cudaErrorStreamCaptureImplicit). */
bool legacy_breaks_capture() {
    std::lock_guard<std::mutex> g(g_cap_mu);
    bool any = false;
    for (CUstream_st *s : g_capturing)
        if (s->cap->status == cudaStreamCaptureStatusActive && !(s->flags & cudaStreamNonBlocking)) {
            s->cap->status = cudaStreamCaptureStatusInvalidated;
            any = true;
        }
    return any;
}

/* Where work enqueued on s goes: recorded into its capture (*cap), run now (ok, *cap NULL), or
 * refused (the error). */
cudaError_t route(cudaStream_t s, Capture **cap) {
    *cap = nullptr;
    if (!s)
        return legacy_breaks_capture() ? cudaErrorStreamCaptureImplicit : cudaSuccess;
    if (!s->cap)
        return cudaSuccess;
    if (s->cap->status != cudaStreamCaptureStatusActive)
        return cudaErrorStreamCaptureInvalidated;
    *cap = s->cap;
    return cudaSuccess;
}

/* ---------------------------------------------------------------------------------------------
 * Fibers
 * ------------------------------------------------------------------------------------------- */
constexpr size_t kStackBytes = (size_t)256 << 10;

enum State { kNotStarted, kReady, kWaitBlock, kWaitWarp, kDone };

struct Fiber;

/* A CUDA thread of the running block. */
struct TRec {
    Thread t;
    State state = kNotStarted;
    unsigned linear = 0;
    Fiber *fiber = nullptr; /* the fiber it runs on, once started and until it returns */
    const char *wait_file = "";
    int wait_line = 0;
};

/* A stack the block's threads run on. Outside ThreadSanitizer a fiber whose thread returns goes
 * on with the next thread of the pass that has not started, without a switch, so a block whose
 * threads never wait takes one fiber and two switches; a thread that waits keeps its fiber.
 * Under ThreadSanitizer thread i always runs on fiber i of the pool, alone (one TSan fiber per
 * CUDA thread of the block, so that every pair of them is concurrent unless a barrier orders it). */
struct Fiber {
#if KVT_EMU_ASM_SWITCH
    void *sp = nullptr;
#else
    ucontext_t ctx;
#endif
    void *stack_map = nullptr;
    size_t stack_map_bytes = 0;
    uint8_t *stack = nullptr; /* lowest usable byte */
    TRec *rec = nullptr;      /* the thread it runs */
    void *asan_fake = nullptr;
    void *tsan = nullptr;
};

/* A warp's barrier and exchange buffer. */
struct Warp {
    unsigned exists = 0;  /* lanes of the block in this warp */
    unsigned exited = 0;  /* lanes that have returned */
    unsigned arrived = 0; /* lanes waiting at the current barrier */
    unsigned mask = 0;    /* its mask */
    int kind = 0;         /* 0 syncwarp, kShflDown, 2 any */
    uint64_t gen = 0;
    uint64_t val[2][32];
    char tsan_sync[2]; /* TSan's objects of the barrier, by generation parity (below) */
};

/* The block being executed (one at a time, process-wide, under g_exec_mu). */
struct Block {
    Kernel *k = nullptr;
    unsigned n = 0, live = 0, arrived = 0;
    const char *bar_file = nullptr;
    int bar_line = 0, bar_first = 0;
    std::vector<TRec> recs;
    std::vector<Warp> warps;
    std::vector<unsigned> order; /* this pass's order */
    unsigned cursor = 0;         /* the pass's position in order */
    bool forward = true;
    uint64_t gen = 0; /* __syncthreads barriers completed */
    /* TSan's sync objects: the block's start and end, and its barrier by generation parity. A
     * thread released from generation g acquires only g's object: one object for all of them
     * would hand a late waker the releases of threads already past the next barrier (and hide
     * the race a missing barrier leaves); two suffice, since no thread passes g + 1 before every
     * thread has left g. */
    char tsan_start, tsan_end, tsan_bar[2];
};

std::mutex g_exec_mu;
Block g_block;
thread_local bool t_in_kernel; /* this host thread is executing a launch */
TRec *g_cur;                   /* the running CUDA thread (relaxed atomics: TSan) */
Fiber *g_fiber;                /* the fiber it runs on */

/* A host thread's fibers and its own context. */
struct Pool {
#if KVT_EMU_ASM_SWITCH
    void *sched_sp = nullptr;
#else
    ucontext_t sched;
#endif
    std::vector<Fiber *> fibers; /* all of them */
    std::vector<Fiber *> free;   /* those without a thread */
    const void *asan_bottom = nullptr;
    size_t asan_size = 0;
    void *tsan_sched = nullptr;
    ~Pool() {
        for (Fiber *f : fibers) {
#if KVT_EMU_TSAN
            __tsan_destroy_fiber(f->tsan);
#endif
            munmap(f->stack_map, f->stack_map_bytes);
            delete f;
        }
    }
};
thread_local Pool t_pool;

void set_cur(TRec *r) {
    __atomic_store_n(&g_cur, r, __ATOMIC_RELAXED);
    __atomic_store_n(&g_thread, r ? &r->t : nullptr, __ATOMIC_RELAXED);
}

TRec *cur_rec() {
    return __atomic_load_n(&g_cur, __ATOMIC_RELAXED);
}

void sync_release(void *addr) {
#if KVT_EMU_TSAN
    __tsan_release(addr);
#else
    (void)addr;
#endif
}

void sync_acquire(void *addr) {
#if KVT_EMU_TSAN
    __tsan_acquire(addr);
#else
    (void)addr;
#endif
}

/* The running fiber -> the scheduler. */
void yield_to_sched() {
    Pool &p = t_pool;
    Fiber *f = __atomic_load_n(&g_fiber, __ATOMIC_RELAXED);
#if KVT_EMU_ASAN
    __sanitizer_start_switch_fiber(&f->asan_fake, p.asan_bottom, p.asan_size);
#endif
#if KVT_EMU_TSAN
    __tsan_switch_to_fiber(p.tsan_sched, __tsan_switch_to_fiber_no_sync);
#endif
#if KVT_EMU_ASM_SWITCH
    kvt_emu_switch(&f->sp, p.sched_sp);
#else
    swapcontext(&f->ctx, &p.sched);
#endif
#if KVT_EMU_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake, &p.asan_bottom, &p.asan_size);
#endif
}

void thread_exited(TRec *r);

/* The next thread of the pass if it has not started (the fiber that ran the one before it goes
 * on with it), else NULL. */
TRec *next_unstarted() {
#if KVT_EMU_TSAN
    return nullptr;
#else
    Block &b = g_block;
    if (b.cursor + 1 >= b.n)
        return nullptr;
    TRec *r = &b.recs[b.forward ? b.cursor + 1 : b.order[b.cursor + 1]];
    if (r->state != kNotStarted)
        return nullptr;
    b.cursor++;
    return r;
#endif
}

/* A fiber's life: run its thread; when it returns, the next unstarted one of the pass, if the
 * next is; then back to the scheduler, free, until it is given another thread. */
void fiber_main() {
    for (;;) {
        Fiber *f = __atomic_load_n(&g_fiber, __ATOMIC_RELAXED);
        for (TRec *r = f->rec; r; r = next_unstarted()) {
            f->rec = r;
            r->fiber = f;
            r->state = kReady;
            set_cur(r);
            sync_acquire(&g_block.tsan_start);
            g_block.k->run();
            sync_release(&g_block.tsan_end);
            thread_exited(r);
            r->fiber = nullptr;
        }
        f->rec = nullptr;
        yield_to_sched();
    }
}

void fiber_entry() {
#if KVT_EMU_ASAN
    Pool &p = t_pool;
    __sanitizer_finish_switch_fiber(nullptr, &p.asan_bottom, &p.asan_size);
#endif
    fiber_main();
}

Fiber *new_fiber() {
    Fiber *f = new Fiber();
    const size_t ps = page_size();
    f->stack_map_bytes = kStackBytes + ps;
    f->stack_map = mmap(nullptr, f->stack_map_bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (f->stack_map == MAP_FAILED)
        fatal("cannot map a fiber stack: %s", strerror(errno));
    mprotect(f->stack_map, ps, PROT_NONE); /* overflow guard below the stack */
    f->stack = (uint8_t *)f->stack_map + ps;
#if KVT_EMU_ASM_SWITCH
    /* the frame kvt_emu_switch pops: MXCSR and x87 control word (the defaults), six registers,
     * then fiber_entry as the return address, entered with rsp = 8 (mod 16) as after a call */
    uint64_t *top = (uint64_t *)(f->stack + kStackBytes);
    *--top = 0; /* fiber_entry's return address: it never returns */
    *--top = (uint64_t)(uintptr_t)&fiber_entry;
    for (int i = 0; i < 6; i++)
        *--top = 0;
    *--top = 0x1f80ull | (uint64_t)0x037f << 32;
    f->sp = top;
#else
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = kStackBytes;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, fiber_entry, 0);
#endif
#if KVT_EMU_TSAN
    f->tsan = __tsan_create_fiber(0);
#endif
    t_pool.fibers.push_back(f);
    return f;
}

/* Scheduler -> fiber f (resuming its thread, or starting the thread it was given). */
void run_fiber(Fiber *f) {
    Pool &p = t_pool;
    __atomic_store_n(&g_fiber, f, __ATOMIC_RELAXED);
    set_cur(f->rec);
    void *fake = nullptr;
#if KVT_EMU_ASAN
    __sanitizer_start_switch_fiber(&fake, f->stack, kStackBytes);
#endif
#if KVT_EMU_TSAN
    __tsan_switch_to_fiber(f->tsan, __tsan_switch_to_fiber_no_sync);
#endif
#if KVT_EMU_ASM_SWITCH
    kvt_emu_switch(&p.sched_sp, f->sp);
#else
    swapcontext(&p.sched, &f->ctx);
#endif
#if KVT_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    (void)fake;
    set_cur(nullptr);
    __atomic_store_n(&g_fiber, (Fiber *)nullptr, __ATOMIC_RELAXED);
    if (!f->rec)
        p.free.push_back(f);
}

/* A fiber for thread r: under TSan fiber r.linear, else a free one. */
Fiber *fiber_for(TRec *r) {
    Pool &p = t_pool;
#if KVT_EMU_TSAN
    while (p.fibers.size() <= r->linear)
        new_fiber();
    return p.fibers[r->linear];
#else
    (void)r;
    if (p.free.empty())
        return new_fiber();
    Fiber *f = p.free.back();
    p.free.pop_back();
    return f;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * Orders
 * ------------------------------------------------------------------------------------------- */
enum Order { kForward, kReverse, kShuffle };

struct OrderCfg {
    Order order = kForward;
    uint64_t seed = 1;
};

const OrderCfg &order_cfg() {
    static const OrderCfg c = [] {
        OrderCfg o;
        const char *s = getenv("KVT_EMU_ORDER");
        if (!s || !*s || !strcmp(s, "forward"))
            return o;
        if (!strcmp(s, "reverse")) {
            o.order = kReverse;
            return o;
        }
        if (!strncmp(s, "shuffle", 7) && (s[7] == 0 || s[7] == ':')) {
            o.order = kShuffle;
            if (s[7] == ':')
                o.seed = strtoull(s + 8, nullptr, 0);
            return o;
        }
        fatal("KVT_EMU_ORDER=%s: forward, reverse or shuffle[:seed]", s);
    }();
    return c;
}

std::mt19937_64 g_rng; /* under g_exec_mu */
bool g_rng_seeded;

void permute(std::vector<unsigned> &v, unsigned n) {
    v.resize(n);
    for (unsigned i = 0; i < n; i++)
        v[i] = i;
    const OrderCfg &c = order_cfg();
    if (c.order == kReverse) {
        std::reverse(v.begin(), v.end());
    } else if (c.order == kShuffle) {
        if (!g_rng_seeded) {
            g_rng.seed(c.seed);
            g_rng_seeded = true;
        }
        std::shuffle(v.begin(), v.end(), g_rng);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Barriers
 * ------------------------------------------------------------------------------------------- */
void release_block() {
    Block &b = g_block;
    for (unsigned i = 0; i < b.n; i++)
        if (b.recs[i].state == kWaitBlock)
            b.recs[i].state = kReady;
    b.arrived = 0;
    b.bar_file = nullptr;
    b.gen++;
}

void release_warp(Warp &w, unsigned warp) {
    for (unsigned l = 0; l < 32; l++)
        if (w.arrived >> l & 1u)
            g_block.recs[warp * 32 + l].state = kReady;
    w.arrived = 0;
    w.gen++;
}

/* The lanes a warp barrier of mask waits for, checked against the lanes that exist and have
 * not returned (kind 0, __syncwarp: those drop out). */
unsigned warp_need(const Warp &w, unsigned mask, int kind, unsigned lane, const char *file,
                   int line, const TRec *r) {
    static const char *names[] = {"__syncwarp", "__shfl_down_sync", "__any_sync"};
    if (!(mask >> lane & 1u))
        fatal("%s:%d: %s in %s: lane %u calls it with mask 0x%08x, which does not name it "
              "(thread (%u, %u, %u) of block (%u, %u, %u))",
              file, line, names[kind], g_block.k->name, lane, mask, r->t.thread_idx.x,
              r->t.thread_idx.y, r->t.thread_idx.z, r->t.block_idx.x, r->t.block_idx.y,
              r->t.block_idx.z);
    if (mask & ~w.exists)
        fatal("%s:%d: %s in %s: mask 0x%08x names lanes the block does not have (0x%08x)", file,
              line, names[kind], g_block.k->name, mask, w.exists);
    if (kind != 0 && (mask & w.exited))
        fatal("%s:%d: %s in %s: mask 0x%08x names lanes that have returned (0x%08x): undefined "
              "on a device",
              file, line, names[kind], g_block.k->name, mask, mask & w.exited);
    return mask & ~w.exited;
}

/* Arrive at the warp barrier with a value; back once every lane needed has. Returns the
 * buffer's index the values are in. */
unsigned warp_arrive(int kind, unsigned mask, uint64_t value, const char *file, int line) {
    TRec *r = cur_rec();
    if (!r)
        fatal("%s:%d: a warp intrinsic outside a kernel", file, line);
    const unsigned warp = r->linear / 32, lane = r->linear % 32;
    Warp &w = g_block.warps[warp];
    const unsigned need = warp_need(w, mask, kind, lane, file, line, r);
    if (w.arrived) {
        if (w.kind != kind || w.mask != mask)
            fatal("%s:%d: warp %u of %s: lane %u arrives with kind %d mask 0x%08x where the "
                  "warp's other lanes wait with kind %d mask 0x%08x (divergent warp calls)",
                  file, line, warp, g_block.k->name, lane, kind, mask, w.kind, w.mask);
    } else {
        w.kind = kind;
        w.mask = mask;
    }
    const unsigned buf = (unsigned)(w.gen & 1u);
    w.val[buf][lane] = value;
    w.arrived |= 1u << lane;
    sync_release(&w.tsan_sync[buf]);
    r->state = kWaitWarp;
    r->wait_file = file;
    r->wait_line = line;
    if ((w.arrived & need) == need)
        release_warp(w, warp);
    yield_to_sched();
    sync_acquire(&w.tsan_sync[buf]);
    return buf;
}

void thread_exited(TRec *r) {
    Block &b = g_block;
    r->state = kDone;
    b.live--;
    Warp &w = b.warps[r->linear / 32];
    const unsigned lane = r->linear % 32;
    w.exited |= 1u << lane;
    if (w.arrived) {
        if (w.kind != 0 && (w.mask >> lane & 1u))
            fatal("%s: lane %u of warp %u returned while lanes 0x%08x wait for it in a %s",
                  b.k->name, lane, r->linear / 32, w.arrived,
                  w.kind == kShflDown ? "__shfl_down_sync" : "__any_sync");
        const unsigned need = w.mask & ~w.exited;
        if ((w.arrived & need) == need)
            release_warp(w, r->linear / 32);
    }
    if (b.arrived && b.arrived == b.live)
        release_block();
}

/* A block whose threads wait and none can run: where each waits. */
[[noreturn]] void deadlock() {
    Block &b = g_block;
    fprintf(stderr, "kvt_emu: %s (%s:%d): block deadlocked, its threads wait forever:\n",
            b.k->name, b.k->file, b.k->line);
    for (unsigned i = 0; i < b.n; i++) {
        const TRec &r = b.recs[i];
        if (r.state == kWaitBlock || r.state == kWaitWarp)
            fprintf(stderr, "  thread %u: %s at %s:%d\n", i,
                    r.state == kWaitBlock ? "__syncthreads" : "a warp barrier", r.wait_file,
                    r.wait_line);
    }
    fatal("deadlock in %s", b.k->name);
}

/* Run one block of k to its end: passes over its threads in the order's permutation (a new one
 * each pass under shuffle), each ready thread resumed, each unstarted one started, until all
 * have returned. */
void run_block(Kernel *k, dim3 grid, dim3 block, uint3 bid) {
    Block &b = g_block;
    const unsigned n = block.x * block.y * block.z;
#if KVT_EMU_TSAN
    if (!t_pool.tsan_sched)
        t_pool.tsan_sched = __tsan_get_current_fiber();
#endif
    b.k = k;
    b.n = n;
    b.live = n;
    b.arrived = 0;
    b.bar_file = nullptr;
    b.gen = 0;
    b.forward = order_cfg().order == kForward;
    if (b.recs.size() < n)
        b.recs.resize(n);
    const unsigned nw = (n + 31) / 32;
    if (b.warps.size() < nw)
        b.warps.resize(nw);
    for (unsigned i = 0; i < nw; i++) {
        Warp &w = b.warps[i];
        w.exists = w.exited = w.arrived = w.mask = 0;
        w.kind = 0;
    }
    for (unsigned i = 0; i < n; i++) {
        TRec &r = b.recs[i];
        r.linear = i;
        r.t.thread_idx = uint3{i % block.x, i / block.x % block.y, i / (block.x * block.y)};
        r.t.block_idx = bid;
        r.t.block_dim = block;
        r.t.grid_dim = grid;
        r.state = kNotStarted;
        r.fiber = nullptr;
        b.warps[i / 32].exists |= 1u << (i % 32);
    }
    char *sh0 = __start_kvt_emu_shared, *sh1 = __stop_kvt_emu_shared;
    if (sh0 && sh1 > sh0)
        memset(sh0, poison_byte(), (size_t)(sh1 - sh0));
    sync_release(&b.tsan_start);
    while (b.live) {
        if (!b.forward)
            permute(b.order, n);
        bool ran = false;
        for (b.cursor = 0; b.cursor < n; b.cursor++) {
            TRec *r = &b.recs[b.forward ? b.cursor : b.order[b.cursor]];
            if (r->state == kReady && r->fiber) {
                run_fiber(r->fiber);
                ran = true;
            } else if (r->state == kNotStarted) {
                Fiber *f = fiber_for(r);
                f->rec = r;
                run_fiber(f);
                ran = true;
            }
        }
        if (!ran && b.live)
            deadlock();
    }
    sync_acquire(&b.tsan_end);
    b.k = nullptr;
}

/* KVT_EMU_STATS=1: launches, blocks and threads run per kernel, printed at exit. */
struct Stat {
    uint64_t launches = 0, blocks = 0, threads = 0;
    double seconds = 0;
};
std::map<std::string, Stat> *g_stats;

void print_stats() {
    fprintf(stderr, "kvt_emu stats: kernel, launches, blocks, threads, seconds\n");
    for (auto &kv : *g_stats)
        fprintf(stderr, "  %-24s %8llu %10llu %12llu %8.3f\n", kv.first.c_str(),
                (unsigned long long)kv.second.launches, (unsigned long long)kv.second.blocks,
                (unsigned long long)kv.second.threads, kv.second.seconds);
}

void run_grid(Kernel *k, dim3 grid, dim3 block) {
    std::lock_guard<std::mutex> g(g_exec_mu);
    static const bool stats = getenv("KVT_EMU_STATS") != nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    t_in_kernel = true;
    const uint64_t nb = (uint64_t)grid.x * grid.y * grid.z;
    std::vector<unsigned> order;
    permute(order, (unsigned)nb);
    for (unsigned i : order)
        run_block(k, grid, block,
                  uint3{i % grid.x, i / grid.x % grid.y, (unsigned)(i / ((uint64_t)grid.x * grid.y))});
    t_in_kernel = false;
    if (stats) {
        if (!g_stats) {
            g_stats = new std::map<std::string, Stat>();
            atexit(print_stats);
        }
        Stat &st = (*g_stats)[k->name];
        st.launches++;
        st.blocks += nb;
        st.threads += nb * block.x * block.y * block.z;
        st.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
}

cudaError_t check_config(dim3 grid, dim3 block, size_t shmem) {
    if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z ||
        grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u || block.x > 1024u ||
        block.y > 1024u || block.z > 64u || (uint64_t)block.x * block.y * block.z > 1024u)
        return cudaErrorInvalidConfiguration;
    if ((uint64_t)grid.x * grid.y * grid.z > 0xffffffffull)
        fatal("a grid of more than 2^32 blocks: not modelled");
    if (shmem)
        fatal("dynamic shared memory (%zu bytes in a launch): not modelled", shmem);
    return cudaSuccess;
}

void run_node(const Node &n) {
    switch (n.kind) {
    case Node::kKernel:
        run_grid(n.k.get(), n.grid, n.block);
        break;
    case Node::kCopy:
        for (size_t r = 0; r < n.height; r++)
            memmove((uint8_t *)n.dst + r * n.dpitch, (const uint8_t *)n.src + r * n.spitch,
                    n.bytes);
        break;
    case Node::kSet:
        memset(n.dst, n.value, n.bytes);
        break;
    }
}

/* A copy's or set's work, checked, run now or recorded. */
cudaError_t enqueue(Node n, cudaStream_t s, bool check_src) {
    for (size_t r = 0; r < n.height; r++) {
        check_range((const uint8_t *)n.dst + r * n.dpitch, n.bytes, "a copy's or set's destination");
        if (check_src)
            check_range((const uint8_t *)n.src + r * n.spitch, n.bytes, "a copy's source");
    }
    Capture *cap;
    cudaError_t e = route(s, &cap);
    if (e != cudaSuccess)
        return e;
    if (cap) {
        /* a graph's copy reads and writes at replay: pageable host memory cannot be one */
        bool dev_dst = check_range(n.dst, 0, "a captured copy"),
             dev_src = n.kind != Node::kCopy || check_range(n.src, 0, "a captured copy");
        if (!dev_dst || !dev_src) {
            cap->status = cudaStreamCaptureStatusInvalidated;
            return cudaErrorStreamCaptureUnsupported;
        }
        cap->nodes.push_back(n);
        return cudaSuccess;
    }
    std::lock_guard<std::mutex> g(g_exec_mu);
    if (n.kind == Node::kCopy) {
        for (size_t r = 0; r < n.height; r++)
            memmove((uint8_t *)n.dst + r * n.dpitch, (const uint8_t *)n.src + r * n.spitch,
                    n.bytes);
    } else {
        memset(n.dst, n.value, n.bytes);
    }
    return cudaSuccess;
}

Node copy_node(void *dst, const void *src, size_t bytes) {
    Node n{};
    n.kind = Node::kCopy;
    n.dst = dst;
    n.src = src;
    n.bytes = bytes;
    n.dpitch = n.spitch = bytes;
    n.height = 1;
    return n;
}

} // namespace

Thread *g_thread;

void outside_kernel() {
    fatal("threadIdx, blockIdx, blockDim or gridDim read outside a kernel");
}

void syncthreads(const char *file, int line) {
    TRec *r = cur_rec();
    if (!r)
        fatal("%s:%d: __syncthreads outside a kernel", file, line);
    Block &b = g_block;
    if (b.arrived == 0) {
        b.bar_file = file;
        b.bar_line = line;
        b.bar_first = (int)r->linear;
    } else if (b.bar_line != line || (b.bar_file != file && strcmp(b.bar_file, file) != 0)) {
        fatal("%s:%d: __syncthreads in divergent code in %s: thread %u arrives here while "
              "thread %d waits at %s:%d (block (%u, %u, %u))",
              file, line, b.k->name, r->linear, b.bar_first, b.bar_file, b.bar_line,
              r->t.block_idx.x, r->t.block_idx.y, r->t.block_idx.z);
    }
    b.arrived++;
    const unsigned slot = (unsigned)(b.gen & 1u);
    sync_release(&b.tsan_bar[slot]);
    r->state = kWaitBlock;
    r->wait_file = file;
    r->wait_line = line;
    if (b.arrived == b.live)
        release_block();
    yield_to_sched();
    sync_acquire(&b.tsan_bar[slot]);
}

void syncwarp(const char *file, int line, unsigned mask) {
    warp_arrive(0, mask, 0, file, line);
}

uint64_t warp_exchange(int kind, unsigned mask, uint64_t value, unsigned src_lane,
                       const char *file, int line) {
    const unsigned buf = warp_arrive(kind, mask, value, file, line);
    TRec *r = cur_rec();
    const Warp &w = g_block.warps[r->linear / 32];
    if (!(mask >> src_lane & 1u))
        fatal("%s:%d: __shfl_down_sync in %s: lane %u reads lane %u, which the mask 0x%08x does "
              "not name (undefined on a device)",
              file, line, g_block.k->name, r->linear % 32, src_lane, mask);
    return w.val[buf][src_lane];
}

bool any_sync(unsigned mask, int pred, const char *file, int line) {
    const unsigned buf = warp_arrive(2, mask, pred != 0, file, line);
    const Warp &w = g_block.warps[cur_rec()->linear / 32];
    for (unsigned l = 0; l < 32; l++)
        if ((mask >> l & 1u) && w.val[buf][l])
            return true;
    return false;
}

void launch(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream, std::shared_ptr<Kernel> k) {
    if (t_in_kernel)
        fatal("%s (%s:%d): a launch from inside a kernel (dynamic parallelism): not modelled",
              k->name, k->file, k->line);
    cudaError_t e = check_config(grid, block, shmem);
    if (e != cudaSuccess) {
        ret(e);
        return;
    }
    Capture *cap;
    if ((e = route(stream, &cap)) != cudaSuccess) {
        ret(e);
        return;
    }
    if (cap) {
        Node n{};
        n.kind = Node::kKernel;
        n.k = std::move(k);
        n.grid = grid;
        n.block = block;
        cap->nodes.push_back(std::move(n));
        return;
    }
    run_grid(k.get(), grid, block);
}

} // namespace kvt_emu

/* -------------------------------------------------------------------------------------------------
 * The runtime API
 * ----------------------------------------------------------------------------------------------- */
using kvt_emu::ret;

extern "C" {

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
#define KVT_EMU_NAME(x)                                                                            \
    case x:                                                                                        \
        return #x;
        KVT_EMU_NAME(cudaSuccess)
        KVT_EMU_NAME(cudaErrorInvalidValue)
        KVT_EMU_NAME(cudaErrorMemoryAllocation)
        KVT_EMU_NAME(cudaErrorInvalidConfiguration)
        KVT_EMU_NAME(cudaErrorInvalidDevicePointer)
        KVT_EMU_NAME(cudaErrorInvalidMemcpyDirection)
        KVT_EMU_NAME(cudaErrorInvalidResourceHandle)
        KVT_EMU_NAME(cudaErrorIllegalState)
        KVT_EMU_NAME(cudaErrorIllegalAddress)
        KVT_EMU_NAME(cudaErrorLaunchFailure)
        KVT_EMU_NAME(cudaErrorInvalidDevice)
        KVT_EMU_NAME(cudaErrorNoDevice)
        KVT_EMU_NAME(cudaErrorStreamCaptureUnsupported)
        KVT_EMU_NAME(cudaErrorStreamCaptureInvalidated)
        KVT_EMU_NAME(cudaErrorStreamCaptureMerge)
        KVT_EMU_NAME(cudaErrorStreamCaptureUnmatched)
        KVT_EMU_NAME(cudaErrorStreamCaptureUnjoined)
        KVT_EMU_NAME(cudaErrorStreamCaptureIsolation)
        KVT_EMU_NAME(cudaErrorStreamCaptureImplicit)
        KVT_EMU_NAME(cudaErrorCapturedEvent)
        KVT_EMU_NAME(cudaErrorStreamCaptureWrongThread)
        KVT_EMU_NAME(cudaErrorNotSupported)
        KVT_EMU_NAME(cudaErrorUnknown)
#undef KVT_EMU_NAME
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
        return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit:
        return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureIsolation:
        return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureWrongThread:
        return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorIllegalState:
        return "the operation is not permitted in the current state";
    case cudaErrorNotSupported:
        return "operation not supported (not modelled by the CUDA emulation)";
    default:
        return cudaGetErrorName(e);
    }
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = kvt_emu::t_last;
    kvt_emu::t_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) {
    return kvt_emu::t_last;
}

cudaError_t cudaGetDeviceCount(int *n) {
    if (!n)
        return ret(cudaErrorInvalidValue);
    *n = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    if (!device)
        return ret(cudaErrorInvalidValue);
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    return device == 0 ? cudaSuccess : ret(cudaErrorInvalidDevice);
}

cudaError_t cudaDeviceSynchronize(void) {
    /* every stream's work is done when enqueued: only a capture can object */
    return kvt_emu::unsafe_call() ? ret(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
    if (kvt_emu::unsafe_call())
        return ret(cudaErrorStreamCaptureUnsupported);
    return ret(kvt_emu::new_alloc(p, bytes, false));
}

cudaError_t cudaFree(void *p) {
    if (kvt_emu::unsafe_call())
        return ret(cudaErrorStreamCaptureUnsupported);
    return ret(kvt_emu::drop_alloc(p, false));
}

/* The stream-ordered allocator: the stream's earlier work is done when this runs (streams run
 * when enqueued), so it allocates or frees at once. Not an unsafe call for a capture on another
 * stream; inside a capture (a graph's allocation node) not modelled. */
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t stream) {
    kvt_emu::Capture *cap;
    cudaError_t e = kvt_emu::route(stream, &cap);
    if (e != cudaSuccess)
        return ret(e);
    if (cap) {
        cap->status = cudaStreamCaptureStatusInvalidated;
        return ret(cudaErrorNotSupported);
    }
    return ret(kvt_emu::new_alloc(p, bytes, false));
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t stream) {
    kvt_emu::Capture *cap;
    cudaError_t e = kvt_emu::route(stream, &cap);
    if (e != cudaSuccess)
        return ret(e);
    if (cap) {
        cap->status = cudaStreamCaptureStatusInvalidated;
        return ret(cudaErrorNotSupported);
    }
    return ret(kvt_emu::drop_alloc(p, false));
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int flags) {
    (void)flags;
    if (kvt_emu::unsafe_call())
        return ret(cudaErrorStreamCaptureUnsupported);
    return ret(kvt_emu::new_alloc(p, bytes, true));
}

cudaError_t cudaFreeHost(void *p) {
    if (kvt_emu::unsafe_call())
        return ret(cudaErrorStreamCaptureUnsupported);
    return ret(kvt_emu::drop_alloc(p, true));
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
    if ((unsigned)kind > cudaMemcpyDefault)
        return ret(cudaErrorInvalidMemcpyDirection);
    if (!bytes)
        return cudaSuccess;
    if (!dst || !src)
        return ret(cudaErrorInvalidValue);
    return ret(kvt_emu::enqueue(kvt_emu::copy_node(dst, src, bytes), stream, true));
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    if (kvt_emu::unsafe_call())
        return ret(cudaErrorStreamCaptureUnsupported);
    return cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
    if ((unsigned)kind > cudaMemcpyDefault)
        return ret(cudaErrorInvalidMemcpyDirection);
    if (!width || !height)
        return cudaSuccess;
    if (!dst || !src || width > dpitch || width > spitch)
        return ret(cudaErrorInvalidValue);
    kvt_emu::Node n = kvt_emu::copy_node(dst, src, width);
    n.dpitch = dpitch;
    n.spitch = spitch;
    n.height = height;
    return ret(kvt_emu::enqueue(n, stream, true));
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream) {
    if (!bytes)
        return cudaSuccess;
    if (!p)
        return ret(cudaErrorInvalidValue);
    kvt_emu::Node n{};
    n.kind = kvt_emu::Node::kSet;
    n.dst = p;
    n.bytes = bytes;
    n.dpitch = bytes;
    n.height = 1;
    n.value = value;
    return ret(kvt_emu::enqueue(n, stream, false));
}

cudaError_t cudaMemset(void *p, int value, size_t bytes) {
    if (kvt_emu::unsafe_call())
        return ret(cudaErrorStreamCaptureUnsupported);
    return cudaMemsetAsync(p, value, bytes, nullptr);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
    if (!s || (flags & ~cudaStreamNonBlocking))
        return ret(cudaErrorInvalidValue);
    *s = new CUstream_st{flags, nullptr};
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (!s)
        return ret(cudaErrorInvalidResourceHandle);
    if (s->cap) {
        std::lock_guard<std::mutex> g(kvt_emu::g_cap_mu);
        auto &v = kvt_emu::g_capturing;
        v.erase(std::remove(v.begin(), v.end(), s), v.end());
        delete s->cap;
    }
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (s && s->cap) {
        if (s->cap->status == cudaStreamCaptureStatusActive)
            s->cap->status = cudaStreamCaptureStatusInvalidated;
        return ret(cudaErrorStreamCaptureUnsupported);
    }
    if (!s && kvt_emu::legacy_breaks_capture())
        return ret(cudaErrorStreamCaptureImplicit);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
    (void)flags;
    if (!e)
        return ret(cudaErrorInvalidResourceHandle);
    if (s && s->cap) {
        if (s->cap->status != cudaStreamCaptureStatusActive)
            return ret(cudaErrorStreamCaptureInvalidated);
        if (e->captured == s->cap)
            return cudaSuccess; /* inside the capture: the graph's order already */
        s->cap->status = cudaStreamCaptureStatusInvalidated;
        return ret(cudaErrorStreamCaptureIsolation);
    }
    if (e->captured)
        return ret(cudaErrorNotSupported); /* joining a capture from another stream */
    if (!s && kvt_emu::legacy_breaks_capture())
        return ret(cudaErrorStreamCaptureImplicit);
    return cudaSuccess; /* the event's work is done */
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    if (!s)
        return ret(cudaErrorStreamCaptureUnsupported);
    if (s->cap)
        return ret(cudaErrorIllegalState);
    if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
        mode != cudaStreamCaptureModeRelaxed)
        return ret(cudaErrorInvalidValue);
    s->cap = new kvt_emu::Capture();
    s->cap->mode = mode;
    s->cap->thread = std::this_thread::get_id();
    std::lock_guard<std::mutex> g(kvt_emu::g_cap_mu);
    kvt_emu::g_capturing.push_back(s);
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    if (!graph)
        return ret(cudaErrorInvalidValue);
    *graph = nullptr;
    if (!s || !s->cap)
        return ret(cudaErrorIllegalState);
    if (s->cap->mode == cudaStreamCaptureModeThreadLocal &&
        s->cap->thread != std::this_thread::get_id())
        return ret(cudaErrorStreamCaptureWrongThread);
    kvt_emu::Capture *c = s->cap;
    {
        std::lock_guard<std::mutex> g(kvt_emu::g_cap_mu);
        auto &v = kvt_emu::g_capturing;
        v.erase(std::remove(v.begin(), v.end(), s), v.end());
    }
    s->cap = nullptr;
    cudaError_t e = cudaSuccess;
    if (c->status != cudaStreamCaptureStatusActive)
        e = cudaErrorStreamCaptureInvalidated;
    else
        *graph = new CUgraph_st{std::move(c->nodes)};
    delete c;
    return ret(e);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
    if (!status)
        return ret(cudaErrorInvalidValue);
    *status = s && s->cap ? s->cap->status : cudaStreamCaptureStatusNone;
    if (!s) {
        std::lock_guard<std::mutex> g(kvt_emu::g_cap_mu);
        for (CUstream_st *c : kvt_emu::g_capturing)
            if (!(c->flags & cudaStreamNonBlocking))
                return ret(cudaErrorStreamCaptureImplicit);
    }
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
    if (!e || (flags & ~(unsigned)cudaEventDisableTiming))
        return ret(cudaErrorInvalidValue);
    *e = new CUevent_st{flags, nullptr, {}, false};
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) {
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
    if (!e)
        return ret(cudaErrorInvalidResourceHandle);
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (!e)
        return ret(cudaErrorInvalidResourceHandle);
    kvt_emu::Capture *cap;
    cudaError_t r = kvt_emu::route(s, &cap);
    if (r != cudaSuccess)
        return ret(r);
    e->captured = cap;
    e->recorded = true;
    e->t = std::chrono::steady_clock::now();
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (!e)
        return ret(cudaErrorInvalidResourceHandle);
    return e->captured ? ret(cudaErrorCapturedEvent) : cudaSuccess;
}

/* The host's time between the two records (the emulation's, not a device's: bench only). */
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!ms || !start || !end)
        return ret(cudaErrorInvalidValue);
    if ((start->flags | end->flags) & cudaEventDisableTiming)
        return ret(cudaErrorInvalidResourceHandle);
    if (!start->recorded || !end->recorded || start->captured || end->captured)
        return ret(cudaErrorInvalidResourceHandle);
    *ms = std::chrono::duration<float, std::milli>(end->t - start->t).count();
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags) {
    (void)flags;
    if (!exec || !graph)
        return ret(cudaErrorInvalidValue);
    *exec = new CUgraphExec_st{graph->nodes};
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (!exec)
        return ret(cudaErrorInvalidValue);
    kvt_emu::Capture *cap;
    cudaError_t e = kvt_emu::route(s, &cap);
    if (e != cudaSuccess)
        return ret(e);
    if (cap) /* a graph launched into a capture (a child graph): not modelled */
        return ret(cudaErrorNotSupported);
    for (const kvt_emu::Node &n : exec->nodes)
        if (n.kind == kvt_emu::Node::kKernel) {
            kvt_emu::run_node(n);
        } else {
            std::lock_guard<std::mutex> g(kvt_emu::g_exec_mu);
            kvt_emu::run_node(n);
        }
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}

} /* extern "C" */
