/* bench_attn.cu — bench_attn.h: cuBLAS GEMMs and two small kernels (gather, softmax). */
#include "bench_attn.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>

struct bench_attn {
    cudaStream_t stream;
    cublasHandle_t blas;
    uint32_t n_max, H, kd, vd;
    __nv_bfloat16 *q;     /* [H][kd] */
    __nv_bfloat16 *rows;  /* [n_max][kd]: the gathered rows */
    float *s;             /* [H][n_max] scores (column-major n × H) */
    __nv_bfloat16 *p;     /* [H][n_max] weights */
    float *out;           /* [H][vd] */
    float *qh;            /* [H][kd] staging */
};

namespace {

__global__ void k_to_bf16(const float *x, __nv_bfloat16 *y, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = __float2bfloat16(x[i]);
}

/* rows[i] = base + slots[i]·row_bytes, key_dim bf16 values each, 4 bytes a thread */
__global__ void k_gather(const uint8_t *base, size_t row_bytes, const int32_t *slots, uint32_t n,
                         uint32_t words, uint32_t *dst) {
    const uint64_t total = (uint64_t)n * words;
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t i = t / words, w = t % words;
        dst[t] = ((const uint32_t *)(base + (size_t)slots[i] * row_bytes))[w];
    }
}

/* head blockIdx.x: p = softmax(scale · s) over n scores, as bf16 */
__global__ void k_softmax(const float *s, __nv_bfloat16 *p, uint32_t n, size_t ld, float scale) {
    __shared__ float red[1024];
    const float *x = s + ld * blockIdx.x;
    __nv_bfloat16 *y = p + ld * blockIdx.x;
    float m = -INFINITY;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
        m = fmaxf(m, x[i]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (uint32_t h = blockDim.x / 2; h > 0; h /= 2) {
        if (threadIdx.x < h)
            red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + h]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float sum = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
        sum += expf(scale * (x[i] - m));
    red[threadIdx.x] = sum;
    __syncthreads();
    for (uint32_t h = blockDim.x / 2; h > 0; h /= 2) {
        if (threadIdx.x < h)
            red[threadIdx.x] += red[threadIdx.x + h];
        __syncthreads();
    }
    const float inv = 1.0f / red[0];
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
        y[i] = __float2bfloat16(expf(scale * (x[i] - m)) * inv);
}

int ok(cudaError_t e) {
    return e == cudaSuccess;
}

} // namespace

extern "C" bench_attn *bench_attn_create(uint32_t n_max, uint32_t H, uint32_t key_dim,
                                         uint32_t value_dim, void *stream, char *why,
                                         size_t why_len) {
    bench_attn *a = (bench_attn *)calloc(1, sizeof *a);
    if (!a)
        return NULL;
    a->stream = (cudaStream_t)stream;
    a->n_max = n_max;
    a->H = H;
    a->kd = key_dim;
    a->vd = value_dim;
    cublasStatus_t bs = cublasCreate(&a->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        snprintf(why, why_len, "cublasCreate: status %d", (int)bs);
        free(a);
        return NULL;
    }
    cublasSetStream(a->blas, a->stream);
    if (!ok(cudaMalloc(&a->q, sizeof(__nv_bfloat16) * H * key_dim)) ||
        !ok(cudaMalloc(&a->rows, sizeof(__nv_bfloat16) * (size_t)n_max * key_dim)) ||
        !ok(cudaMalloc(&a->s, sizeof(float) * (size_t)H * n_max)) ||
        !ok(cudaMalloc(&a->p, sizeof(__nv_bfloat16) * (size_t)H * n_max)) ||
        !ok(cudaMalloc(&a->out, sizeof(float) * H * value_dim)) ||
        !ok(cudaMalloc(&a->qh, sizeof(float) * H * key_dim))) {
        snprintf(why, why_len, "device buffers for %u rows: %s", n_max,
                 cudaGetErrorString(cudaGetLastError()));
        bench_attn_destroy(a);
        return NULL;
    }
    return a;
}

extern "C" int bench_attn_set_query(bench_attn *a, const float *q) {
    const uint32_t n = a->H * a->kd;
    if (!ok(cudaMemcpyAsync(a->qh, q, sizeof(float) * n, cudaMemcpyHostToDevice, a->stream)))
        return -1;
    k_to_bf16<<<(n + 255) / 256, 256, 0, a->stream>>>(a->qh, a->q, n);
    return ok(cudaGetLastError()) ? 0 : -1;
}

extern "C" int bench_attn_run(bench_attn *a, const void *base, size_t row_bytes,
                              const int32_t *slots, uint32_t n, float scale) {
    if (n == 0 || n > a->n_max || row_bytes % 4 || a->kd * 2 > row_bytes)
        return -1;
    const __nv_bfloat16 *K = (const __nv_bfloat16 *)base;
    int ldk = (int)(row_bytes / 2);
    if (slots) {
        const uint32_t words = a->kd / 2;
        const uint64_t total = (uint64_t)n * words;
        const unsigned blocks = (unsigned)((total + 255) / 256 < 65535 ? (total + 255) / 256 : 65535);
        k_gather<<<blocks, 256, 0, a->stream>>>((const uint8_t *)base, row_bytes, slots, n, words,
                                                (uint32_t *)a->rows);
        K = a->rows;
        ldk = (int)a->kd;
    }
    const float one = 1.0f, zero = 0.0f;
    /* S (n × H, column-major) = Kᵀ Q: K as kd × n (a row a column), Q as kd × H */
    cublasStatus_t bs = cublasGemmEx(a->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)a->H,
                                     (int)a->kd, &one, K, CUDA_R_16BF, ldk, a->q, CUDA_R_16BF,
                                     (int)a->kd, &zero, a->s, CUDA_R_32F, (int)n,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (bs != CUBLAS_STATUS_SUCCESS)
        return -1;
    k_softmax<<<a->H, 1024, 0, a->stream>>>(a->s, a->p, n, n, scale);
    /* O (vd × H) = V P: V as vd × n (the rows' first vd values), P as n × H */
    bs = cublasGemmEx(a->blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)a->vd, (int)a->H, (int)n, &one, K,
                      CUDA_R_16BF, ldk, a->p, CUDA_R_16BF, (int)n, &zero, a->out, CUDA_R_32F,
                      (int)a->vd, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (bs != CUBLAS_STATUS_SUCCESS)
        return -1;
    return ok(cudaGetLastError()) ? 0 : -1;
}

extern "C" void bench_attn_destroy(bench_attn *a) {
    if (!a)
        return;
    cudaFree(a->q);
    cudaFree(a->rows);
    cudaFree(a->s);
    cudaFree(a->p);
    cudaFree(a->out);
    cudaFree(a->qh);
    if (a->blas)
        cublasDestroy(a->blas);
    free(a);
}
