/*
 * tu_cuda.h — the CUDA pieces tests share: whether the CUDA backend opens, and (tests that link
 * the CUDA runtime: tests/<name>.cmake) a stream to capture on. Include after
 * <criterion/criterion.h>.
 */
#ifndef KVT_TESTS_TU_CUDA_H
#define KVT_TESTS_TU_CUDA_H

#include <stdbool.h>
#include <stdlib.h>

#include "kernels/backend.h"

/* Can the library's CUDA backend open here (the emulation build, a device)? No: a note, or a
 * failure with KVT_REQUIRE_GPU=1. For tests whose CUDA leg runs beside the CPU ones. */
static inline bool tu_cuda_backend_usable(void) {
    kvt__alloc a;
    cr_assert_eq(kvt__alloc_init(&a, KVT_ALLOC_LIBC), KVT_OK);
    kvt__backend be = {.alloc = &a};
    char why[256] = "";
    const bool ok = kvt__backend_cuda_open(&be, why, sizeof why) == KVT_OK;
    if (ok)
        kvt__backend_cuda_close(&be);
    kvt__alloc_fini(&a);
    if (!ok && getenv("KVT_REQUIRE_GPU"))
        cr_assert_fail("KVT_REQUIRE_GPU set but the CUDA backend did not open: %s", why);
    if (!ok)
        cr_log_info("the CUDA leg is skipped: %s", why);
    return ok;
}

#if KVT_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <stdlib.h>

/* A non-blocking stream for a test's CUDA graph (a capture cannot use the legacy stream); where
 * none can be made the test is skipped, or fails with KVT_REQUIRE_GPU=1. */
static inline cudaStream_t tu_cuda_stream(void) {
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        if (getenv("KVT_REQUIRE_GPU"))
            cr_assert_fail("KVT_REQUIRE_GPU set but no CUDA stream could be made");
        cr_skip_test("no CUDA device: no stream to capture");
    }
    return s;
}
#endif

#endif /* KVT_TESTS_TU_CUDA_H */
