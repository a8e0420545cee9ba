/*
 * kvtier_ref.h — reference math on host copies of rows: the salience σ of a block (the very
 * function, and so the very bits, the salience tier uses), an MLA decode attention over a set of
 * rows in double precision, and element conversions. For tools (kvtier-needle), engine-side
 * tests and benchmarks that need to compute what kvtier decides without reaching into its
 * internals. Nothing here touches a context; everything is host memory and single-threaded per
 * handle.
 */
#ifndef KVTIER_REF_H
#define KVTIER_REF_H

#include "kvtier.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element i of a row of dtype (bf16, fp16, fp32) as fp32; 0 for fp8 or an unknown dtype. */
KVT_API float kvt_ref_load(const void *row, kvt_dtype dtype, uint32_t i);
/* Store v as element i of a row of dtype (bf16, fp16, fp32), rounding to nearest even;
 * nothing for fp8 or an unknown dtype. */
KVT_API void kvt_ref_store(void *row, kvt_dtype dtype, uint32_t i, float v);

/* ---------------------------------------------------------------------------------------------
 * σ of one block (DESIGN §2.1; summation order in kernels/sigma.h). A handle holds the block's
 * basis (Fourier unless created with another) and scratch, so scoring many blocks allocates once.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvt_ref_sigma kvt_ref_sigma;

/* block_rows: a power of two >= 64; kappa in 1..block_rows/2; branch_dim in 1..256.
 * KVT_ERR_INVALID_ARGUMENT (NULL out or a bad value), KVT_ERR_OUT_OF_MEMORY. *out NULL on error. */
KVT_API kvt_status kvt_ref_sigma_create(uint32_t block_rows, uint32_t kappa, uint32_t branch_dim,
                                        kvt_ref_sigma **out);
/* The same with the basis kvt_config.sigma_basis names (kvt_ref_sigma_create is
 * KVT_SIGMA_FOURIER); KVT_ERR_INVALID_ARGUMENT for an unknown one. */
KVT_API kvt_status kvt_ref_sigma_create_basis(uint32_t block_rows, uint32_t kappa,
                                              uint32_t branch_dim, kvt_sigma_basis basis,
                                              kvt_ref_sigma **out);
/* NULL is a no-op. */
KVT_API void kvt_ref_sigma_destroy(kvt_ref_sigma *h);
/* The basis: n_basis = 2 kappa - 1 orthonormal columns of block_rows floats each, column j at
 * basis + j * block_rows (valid until destroy). */
KVT_API const float *kvt_ref_sigma_basis(const kvt_ref_sigma *h, uint32_t *n_basis);
/* σ of block_rows consecutive rows: row u at (const uint8_t *)rows + u * row_stride_bytes, its
 * branch of branch_dim values of branch_dtype (bf16, fp16, fp32) at byte branch_offset.
 * sigma_out[u] for u < block_rows. A row with a non-finite branch value is left out of the fit
 * and scores +Inf (the input rule of the salience tier). KVT_ERR_INVALID_ARGUMENT on NULL
 * pointers, a branch that does not fit in the stride, or a bad dtype. */
KVT_API kvt_status kvt_ref_sigma_block(kvt_ref_sigma *h, const void *rows,
                                       size_t row_stride_bytes, uint32_t branch_offset,
                                       kvt_dtype branch_dtype, float *sigma_out);

/* ---------------------------------------------------------------------------------------------
 * Reference MLA decode attention (absorbed form, double accumulation; order in kernels/attn.h):
 * for each head h, score_j = scale * q_h . key_j (key = the first key_dim values of row j),
 * softmax over the rows, output = Σ p_j value_j (value = the first value_dim values).
 * ------------------------------------------------------------------------------------------- */
#define KVT_REF_ATTN_DEFAULT_SCALE 0.07216878364870322 /* 192^-1/2, DeepSeek-V3 / Kimi MLA */
#define KVT_REF_ATTN_MAX_DIM 4096u

typedef struct kvt_ref_attn_args {
    const void *base;      /* first byte of the rows (a pool plane or any array of rows) */
    const int32_t *slots;  /* [n_rows]: row j at base + slots[j] * slot_stride + row_offset;
                              NULL: row j at slot j. Slots must be >= 0. */
    uint32_t n_rows;
    size_t slot_stride;    /* bytes between consecutive slots */
    size_t row_offset;     /* bytes from a slot's start to the row (kv head * row_bytes; 0) */
    kvt_dtype dtype;       /* bf16, fp16, fp32 */
    uint32_t key_dim;      /* values of a key (576), <= KVT_REF_ATTN_MAX_DIM */
    uint32_t value_dim;    /* leading values forming the value (512), <= key_dim */
    const float *q;        /* query of head h at q + h * q_stride, key_dim floats */
    uint32_t n_heads;
    size_t q_stride;       /* floats between heads (>= key_dim) */
    double scale;          /* softmax scale */
    const uint8_t *mark;   /* [n_rows]: nonzero marks row j; NULL: none */
    float *out;            /* [n_heads][value_dim] output; NULL: not written */
    double *mark_mass;     /* [n_heads] attention mass on marked rows; NULL: not written */
    double *lse;           /* [n_heads] log-sum-exp of the scores; NULL: not written */
    double *scratch;       /* kvt_ref_attn_scratch_doubles(...) doubles, caller-owned */
} kvt_ref_attn_args;

/* Doubles of scratch kvt_ref_attn needs. */
KVT_API size_t kvt_ref_attn_scratch_doubles(uint32_t n_rows, uint32_t n_heads, uint32_t value_dim,
                                            uint32_t key_dim);
/* One decode step. KVT_ERR_INVALID_ARGUMENT (nothing written) on a NULL args / base with rows /
 * q / scratch, key_dim 0 or too large, value_dim > key_dim, q_stride < key_dim, a negative slot
 * or an unsupported dtype. */
KVT_API kvt_status kvt_ref_attn(const kvt_ref_attn_args *args);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_REF_H */
