/*
 * tu_cuda.h — the CUDA runtime pieces the graph tests share (a stream to capture on). Include
 * after <criterion/criterion.h>; the test links the CUDA runtime (tests/<name>.cmake).
 */
#ifndef KVT_TESTS_TU_CUDA_H
#define KVT_TESTS_TU_CUDA_H

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
