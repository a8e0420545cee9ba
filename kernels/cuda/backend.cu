/*
 * backend.cu — the CUDA backend's entry points. This build has nvcc: the backend opens only when
 * the runtime finds a usable device. The kernels that fill the operation table (σ, top-m, Philox,
 * gather/compact) arrive with the CUDA issue; until then a present device is answered with
 * KVT_ERR_NO_DEVICE and a message saying the CUDA operations are not built yet, never a crash.
 * Runtime API only: linking libcuda would break loading where no driver is installed.
 */
#include <cuda_runtime.h>

#include <stdio.h>

extern "C" {
#include "kernels/backend.h"
}

extern "C" kvt_status kvt__backend_cuda_open(kvt__backend *be, char *err, size_t err_len) {
    (void)be;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        if (err && err_len)
            snprintf(err, err_len, "no usable CUDA device: %s",
                     e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
        (void)cudaGetLastError(); /* clear the sticky error for the caller */
        return KVT_ERR_NO_DEVICE;
    }
    if (err && err_len)
        snprintf(err, err_len,
                 "CUDA device found, but the CUDA operations are not implemented yet; use "
                 "KVT_BACKEND_CPU or KVT_BACKEND_AUTO");
    return KVT_ERR_NO_DEVICE;
}

extern "C" void kvt__backend_cuda_close(kvt__backend *be) {
    (void)be;
}
