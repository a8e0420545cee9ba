/* bench_attn.h — a dense absorbed-MLA decode attention on the device for the benchmarks
 * (bench_step's decode mode), built where the CUDA toolkit has cuBLAS (not under the emulation):
 * for H query heads, over n bf16 rows of key_dim values (the value their first value_dim), each
 * head's scores by one cuBLAS GEMM (bf16 in, fp32 accumulate), a softmax kernel writing the
 * weights as bf16, and the output by a second GEMM (fp32 out). The rows are rows 0 .. n of a
 * strided plane (the dense step: every row, no gather) or the slots a kvtier emission lists
 * (gathered into a contiguous copy first: the sparse step). Not the library: a baseline. */
#ifndef KVT_BENCH_CUDA_ATTN_H
#define KVT_BENCH_CUDA_ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bench_attn bench_attn;

/* For up to n_max rows and H heads of key_dim (<= 1024) / value_dim values, on stream (a
 * cudaStream_t). NULL, with a message in why, when cuBLAS or the device buffers fail. */
bench_attn *bench_attn_create(uint32_t n_max, uint32_t H, uint32_t key_dim, uint32_t value_dim,
                              void *stream, char *why, size_t why_len);
/* Queries: H × key_dim fp32 from host memory (converted to bf16 on the device). 0 or -1. */
int bench_attn_set_query(bench_attn *a, const float *q);
/* The attention over n rows at base (device, bf16, row_bytes apart): rows 0 .. n (slots NULL) or
 * base + slots[i]·row_bytes (slots: n int32 in device memory, gathered first). Enqueued on the
 * stream; 0, or -1 with a CUDA / cuBLAS failure. */
int bench_attn_run(bench_attn *a, const void *base, size_t row_bytes, const int32_t *slots,
                   uint32_t n, float scale);
void bench_attn_destroy(bench_attn *a);

#ifdef __cplusplus
}
#endif

#endif
