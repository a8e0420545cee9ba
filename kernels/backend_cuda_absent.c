/* backend_cuda_absent.c — the CUDA slot of a build without nvcc: a clear NO_DEVICE answer.
 * Builds with CUDA define these in kernels/cuda/cu_backend.cu instead. */
#include "backend.h"

#include "lib/base/base.h"

#ifndef KVT_HAVE_CUDA
kvt_status kvt__backend_cuda_open(kvt__backend *be, char *err, size_t err_len) {
    (void)be;
    return kvt__fail(err, err_len, KVT_ERR_NO_DEVICE,
                     "kvtier was built without CUDA (nvcc not found or KVT_CUDA=OFF); use "
                     "KVT_BACKEND_CPU or rebuild with the CUDA toolkit");
}

void kvt__backend_cuda_close(kvt__backend *be) {
    (void)be;
}

kvt_status kvt__backend_cuda_workspace(const kvt__backend *parent, kvt__backend *out) {
    (void)parent;
    (void)out;
    return KVT_ERR_UNSUPPORTED;
}
#endif
