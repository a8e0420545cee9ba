/* recall_basis.c — a salience layer's recall basis (kvt_ctx_set_recall_basis) and the basis file
 * (kvt_recall_basis_read / _write; layout in kvtier.h and docs/recall.md §5). */
#include "container.h"
#include "handles.h"
#include "replace.h"
#include "base/io.h"

#include "recall/kernels/sketch.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(KVT_RECALL_MAX_RANK == KVT__SKETCH_MAX_RANK, "one rank limit");

#define RB_MAGIC "KVTRBAS1"
#define RB_VERSION 1u
#define RB_HEADER_BYTES 40u
#define RB_MAX_DIM 65536u

/* The values of an archived key layer `layer`'s key bases span (its policy's archive_key_dim);
 * 0 for a layer whose policy keeps no archive sketches. */
static uint32_t key_dim_of(const kvt_ctx *ctx, uint32_t layer) {
    const kvt__policy_ops *t = kvt__layer_policy(ctx, layer);
    return t->archive_key_dim ? t->archive_key_dim(&ctx->stores[layer].spec) : 0;
}

void kvt__rbasis_free(kvt_ctx *ctx, kvt__store *st) {
    if (st->rbasis.V)
        ctx->backend.ops->buf_free(&ctx->backend, st->rbasis.V,
                                   sizeof(float) * (size_t)st->rbasis.rank * st->spec.value_dim);
    memset(&st->rbasis, 0, sizeof st->rbasis);
    const size_t H = st->spec.n_kv_heads;
    if (st->kb_V)
        ctx->backend.ops->buf_free(&ctx->backend, st->kb_V,
                                   sizeof(float) * H * st->kb_stride * key_dim_of(ctx, st->layer));
    kvt__free(&ctx->alloc, st->kb_rank, sizeof *st->kb_rank * H);
    kvt__free(&ctx->alloc, st->kb_id, sizeof *st->kb_id * H);
    kvt__free(&ctx->alloc, st->kb_omega, sizeof *st->kb_omega * H);
    st->kb_V = NULL;
    st->kb_rank = st->kb_id = NULL;
    st->kb_omega = NULL;
    st->kb_stride = 0;
}

/* The basis id: CRC-32 of V's bytes as stored (little-endian fp32, the only layout kvtier
 * builds for). */
uint32_t kvt__basis_id(const float *V, size_t n) {
    return kvt__crc32(0, V, sizeof(float) * n);
}

/* Rows of V (rank x D) orthonormal within 1e-3 in every entry of V Vᵀ (double sums), every value
 * finite. The certificates of docs/recall.md §3 (ρ bounds what the scan misses through
 * ‖q_res‖) assume an orthonormal basis. *omega (when not NULL) = ‖V Vᵀ − I‖_F (double sums,
 * rounded up to fp32), which bounds ‖V Vᵀ − I‖₂: sound mode needs it <= KVT__SOUND_MAX_OMEGA. */
kvt_status kvt__basis_check(const kvt_ctx *ctx, const char *fn, const float *V, uint32_t rank,
                            uint32_t D, float *omega) {
    for (size_t i = 0; i < (size_t)rank * D; i++)
        if (!isfinite(V[i]))
            return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "%s: V[%zu][%zu] is not finite",
                                 fn, i / D, i % D);
    double frob = 0.0;
    for (uint32_t a = 0; a < rank; a++)
        for (uint32_t b = a; b < rank; b++) {
            double dot = 0.0;
            for (uint32_t d = 0; d < D; d++)
                dot += (double)V[(size_t)a * D + d] * V[(size_t)b * D + d];
            double want = a == b ? 1.0 : 0.0;
            frob += (a == b ? 1.0 : 2.0) * (dot - want) * (dot - want);
            if (fabs(dot - want) > 1e-3)
                return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                                     "%s: rows %u and %u of V have dot product %.6g (orthonormal "
                                     "rows required)",
                                     fn, a, b, dot);
        }
    if (omega) {
        double w = sqrt(frob) * (1.0 + 1e-6);
        *omega = (double)(float)w < w ? nextafterf((float)w, INFINITY) : (float)w;
    }
    return KVT_OK;
}

static kvt_status check_basis(const kvt_ctx *ctx, const float *V, uint32_t rank, uint32_t D,
                              float *omega) {
    return kvt__basis_check(ctx, "kvt_ctx_set_recall_basis", V, rank, D, omega);
}

/* Sound mode (the context's, or a live request's) needs bases its margin covers. */
bool kvt__sound_live(const kvt_ctx *ctx) {
    bool sound = ctx->cfg.recall == KVT_RECALL_SOUND;
    for (const kvt_seq *q = ctx->seqs; q && !sound; q = q->next)
        sound = q->cfg.recall == KVT_RECALL_SOUND;
    return sound;
}

kvt_status kvt__sound_basis_check(const kvt_ctx *ctx, uint32_t layer, float omega) {
    if (omega <= KVT__SOUND_MAX_OMEGA)
        return KVT_OK;
    return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                         "sound recall on layer %u: its basis is orthonormal only to "
                         "|V V^T - I|_F = %.3g, above the %.3g the sound margin covers "
                         "(docs/recall.md 3.1); re-orthonormalise V (in double, then round to "
                         "fp32) or use the conformal or margin mode",
                         layer, (double)omega, (double)KVT__SOUND_MAX_OMEGA);
}

kvt_status kvt_ctx_set_recall_basis(kvt_ctx *ctx, uint32_t layer, const float *V, uint32_t rank) {
    if (!ctx || !V)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "kvt_ctx_set_recall_basis: %s is NULL",
                             ctx ? "V" : "ctx");
    kvt__ctx_clear_error(ctx);
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "kvt_ctx_set_recall_basis: layer %u of %u",
                             layer, ctx->n_layers);
    kvt__store *st = &ctx->stores[layer];
    if (!kvt__layer_policy(ctx, layer)->recall_view) /* the NoPE trigger's archive */
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH,
                             "kvt_ctx_set_recall_basis: layer %u is under policy %s; recall "
                             "sketches are built on salience (MLA-NoPE) layers",
                             layer, kvt_policy_name(ctx->policies[layer]));
    if (ctx->sketch_rank == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "kvt_ctx_set_recall_basis: the context builds no recall sketches "
                             "(params.recall_sketch_rank 0)");
    if (rank == 0 || rank > ctx->sketch_rank)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE,
                             "kvt_ctx_set_recall_basis: rank %u not in 1..%u "
                             "(params.recall_sketch_rank)",
                             rank, ctx->sketch_rank);
    if (ctx->started)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "kvt_ctx_set_recall_basis: a request already reserved rows (sketches "
                             "of a layer must all come from one basis)");
    uint32_t D = st->spec.value_dim;
    float omega = 0.0f;
    kvt_status s = check_basis(ctx, V, rank, D, &omega);
    if (s != KVT_OK)
        return s;
    if (kvt__sound_live(ctx) && (s = kvt__sound_basis_check(ctx, layer, omega)) != KVT_OK)
        return s;
    size_t bytes = sizeof(float) * (size_t)rank * D;
    void *dev = NULL;
    const kvt__backend *be = &ctx->backend;
    if ((s = be->ops->buf_alloc(be, bytes, &dev)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "kvt_ctx_set_recall_basis: %zu bytes of backend memory",
                             bytes);
    if ((s = be->ops->write(be, dev, V, bytes, NULL)) != KVT_OK) {
        be->ops->buf_free(be, dev, bytes);
        return kvt__ctx_fail(ctx, s, "kvt_ctx_set_recall_basis: writing V");
    }
    kvt__rbasis_free(ctx, st);
    st->rbasis = (kvt__rbasis){
        .V = dev, .rank = rank, .id = kvt__basis_id(V, (size_t)rank * D), .omega = omega};
    return KVT_OK;
}

/* ---- Per-KV-head key bases of evict layers (recall on RoPE layers, docs/recall.md §9) ---- */

/* The layer's [H][stride][D] buffer (D = key_dim_of) and host arrays, allocated on the first
 * head's basis
 * (zeroed: every other head has none). */
static kvt_status head_bases_alloc(kvt_ctx *ctx, kvt__store *st, uint32_t stride) {
    if (st->kb_V)
        return KVT_OK;
    const size_t H = st->spec.n_kv_heads;
    const size_t bytes = sizeof(float) * H * stride * key_dim_of(ctx, st->layer);
    void *dev = NULL;
    kvt_status s = ctx->backend.ops->buf_alloc(&ctx->backend, bytes, &dev);
    if (s != KVT_OK)
        return s;
    st->kb_rank = kvt__calloc(&ctx->alloc, sizeof *st->kb_rank * H);
    st->kb_id = kvt__calloc(&ctx->alloc, sizeof *st->kb_id * H);
    st->kb_omega = kvt__calloc(&ctx->alloc, sizeof *st->kb_omega * H);
    if (!st->kb_rank || !st->kb_id || !st->kb_omega) {
        kvt__free(&ctx->alloc, st->kb_rank, sizeof *st->kb_rank * H);
        kvt__free(&ctx->alloc, st->kb_id, sizeof *st->kb_id * H);
        kvt__free(&ctx->alloc, st->kb_omega, sizeof *st->kb_omega * H);
        st->kb_rank = st->kb_id = NULL;
        st->kb_omega = NULL;
        ctx->backend.ops->buf_free(&ctx->backend, dev, bytes);
        return KVT_ERR_OUT_OF_MEMORY;
    }
    st->kb_V = dev;
    st->kb_stride = stride;
    return KVT_OK;
}

kvt_status kvt_ctx_set_recall_head_basis(kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                         const float *V, uint32_t rank) {
    static const char fn[] = "kvt_ctx_set_recall_head_basis";
    if (!ctx || !V)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, ctx ? "V" : "ctx");
    kvt__ctx_clear_error(ctx);
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "%s: layer %u of %u", fn, layer,
                             ctx->n_layers);
    kvt__store *st = &ctx->stores[layer];
    const kvt__policy_ops *t = kvt__layer_policy(ctx, layer);
    if (!t->archive_sketch_stride) /* an archive with key sketches: random eviction's */
        return kvt__ctx_fail(ctx, KVT_ERR_POLICY_MISMATCH,
                             "%s: layer %u is under policy %s; key bases are for the archive of "
                             "evict (RoPE) layers",
                             fn, layer, kvt_policy_name(ctx->policies[layer]));
    if (ctx->sketch_rank == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "%s: the context builds no recall sketches (params.recall_sketch_rank "
                             "0)",
                             fn);
    const uint32_t stride = t->archive_sketch_stride(&st->spec, ctx->sketch_rank);
    if (stride == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_UNSUPPORTED,
                             "%s: layer %u's rows (%u planes of %s) get no archive sketches "
                             "(GQA/MHA and MLA-RoPE layers of bf16, fp16 or fp32 rows only)",
                             fn, layer, st->spec.n_planes, kvt_dtype_name(st->spec.dtype));
    if (kv_head >= st->spec.n_kv_heads)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "%s: KV head %u of %u", fn, kv_head,
                             st->spec.n_kv_heads);
    if (rank == 0 || rank > stride)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE,
                             "%s: rank %u not in 1..%u (min(recall_sketch_rank, the key's sketched dim))", fn,
                             rank, stride);
    if (ctx->started)
        return kvt__ctx_fail(ctx, KVT_ERR_BAD_STATE,
                             "%s: a request already reserved rows (sketches of a head must all "
                             "come from one basis)",
                             fn);
    const uint32_t D = t->archive_key_dim(&st->spec);
    float omega = 0.0f;
    kvt_status s = kvt__basis_check(ctx, fn, V, rank, D, &omega);
    if (s != KVT_OK)
        return s;
    if (kvt__sound_live(ctx) && (s = kvt__sound_basis_check(ctx, layer, omega)) != KVT_OK)
        return s;
    if ((s = head_bases_alloc(ctx, st, stride)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "%s: the key bases of layer %u", fn, layer);
    const size_t bytes = sizeof(float) * (size_t)rank * D;
    float *dst = st->kb_V + (size_t)kv_head * stride * D;
    if ((s = ctx->backend.ops->write(&ctx->backend, dst, V, bytes, NULL)) != KVT_OK)
        return kvt__ctx_fail(ctx, s, "%s: writing V", fn);
    st->kb_rank[kv_head] = rank;
    st->kb_id[kv_head] = kvt__basis_id(V, (size_t)rank * D);
    st->kb_omega[kv_head] = omega;
    return KVT_OK;
}

kvt_status kvt_ctx_recall_head_basis(const kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                     uint32_t *rank, uint32_t *id) {
    if (!ctx)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "kvt_ctx_recall_head_basis: ctx is NULL");
    if (layer >= ctx->n_layers || kv_head >= ctx->stores[layer].spec.n_kv_heads)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE,
                             "kvt_ctx_recall_head_basis: layer %u, KV head %u", layer, kv_head);
    const kvt__store *st = &ctx->stores[layer];
    if (rank)
        *rank = st->kb_rank ? st->kb_rank[kv_head] : 0;
    if (id)
        *id = st->kb_id ? st->kb_id[kv_head] : 0;
    return KVT_OK;
}

kvt_status kvt_ctx_recall_basis(const kvt_ctx *ctx, uint32_t layer, uint32_t *rank, uint32_t *id) {
    if (!ctx)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "kvt_ctx_recall_basis: ctx is NULL");
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "kvt_ctx_recall_basis: layer %u of %u",
                             layer, ctx->n_layers);
    if (rank)
        *rank = ctx->stores[layer].rbasis.rank;
    if (id)
        *id = ctx->stores[layer].rbasis.id;
    return KVT_OK;
}

kvt_status kvt_recall_basis_write(const char *path, const kvt_recall_basis_info *info,
                                  const float *V) {
    if (!path || !info || !V)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "kvt_recall_basis_write: NULL argument");
    if (info->rank == 0 || info->rank > KVT_RECALL_MAX_RANK || info->dim == 0 ||
        info->dim > RB_MAX_DIM)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT,
                             "kvt_recall_basis_write: rank %u / dim %u out of range", info->rank,
                             info->dim);
    uint8_t h[RB_HEADER_BYTES];
    memcpy(h, RB_MAGIC, 8);
    kvt__put_u32(h + 8, RB_VERSION);
    kvt__put_u32(h + 12, info->layer);
    kvt__put_u32(h + 16, info->rank);
    kvt__put_u32(h + 20, info->dim);
    uint64_t cap;
    memcpy(&cap, &info->captured, 8);
    kvt__put_u64(h + 24, cap);
    kvt__put_u64(h + 32, info->samples);
    size_t vb = sizeof(float) * (size_t)info->rank * info->dim;
    uint32_t crc = kvt__crc32(kvt__crc32(0, h, sizeof h), V, vb);
    uint8_t tail[4];
    kvt__put_u32(tail, crc);
    /* One buffer, replaced atomically (lib/replace.c): a file already at path is left as it was
     * on any failure. */
    size_t total = sizeof h + vb + 4;
    uint8_t *all = kvt__mem_malloc(total);
    if (!all)
        return kvt__tls_fail(KVT_ERR_OUT_OF_MEMORY, "kvt_recall_basis_write: %zu bytes", total);
    memcpy(all, h, sizeof h);
    memcpy(all + sizeof h, V, vb);
    memcpy(all + sizeof h + vb, tail, 4);
    char err[KVT__ERR_LEN];
    kvt_status s = kvt__replace_file(path, all, total, err, sizeof err);
    kvt__mem_free(all);
    if (s != KVT_OK)
        return kvt__tls_fail(s, "kvt_recall_basis_write: %s", err);
    return KVT_OK;
}

kvt_status kvt_recall_basis_read(const char *path, kvt_recall_basis_info *info, float *v,
                                 size_t v_floats) {
    if (!path || !info)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "kvt_recall_basis_read: NULL argument");
    int fd = kvt__io_open(path, O_RDONLY, 0);
    if (fd < 0)
        return kvt__tls_fail(KVT_ERR_IO, "kvt_recall_basis_read: cannot open %s: %s", path,
                             strerror(errno));
    uint8_t h[RB_HEADER_BYTES] = {0};
    kvt_status s = KVT_OK;
    long size = -1;
    struct stat st;
    int rc = 0;
    if (kvt__io_fstat(fd, &st) != 0)
        s = kvt__tls_fail(KVT_ERR_IO, "kvt_recall_basis_read: cannot stat %s: %s", path,
                          strerror(errno));
    else if ((size = (long)st.st_size) < (long)sizeof h)
        s = kvt__tls_fail(KVT_ERR_PARSE, "kvt_recall_basis_read: %s: truncated header", path);
    else if ((rc = kvt__io_pread_all(fd, h, sizeof h, 0)) != 0)
        s = kvt__tls_fail(KVT_ERR_IO, "kvt_recall_basis_read: reading %s: %s", path,
                          rc > 0 ? "file shrank while read" : strerror(errno));
    else if (memcmp(h, RB_MAGIC, 8) != 0)
        s = kvt__tls_fail(KVT_ERR_PARSE, "kvt_recall_basis_read: %s is not a basis file", path);
    else if (kvt__get_u32(h + 8) != RB_VERSION)
        s = kvt__tls_fail(KVT_ERR_PARSE,
                          "kvt_recall_basis_read: %s: version %u (this library "
                          "reads %u)",
                          path, kvt__get_u32(h + 8), RB_VERSION);
    kvt_recall_basis_info in = {.layer = kvt__get_u32(h + 12),
                                .rank = kvt__get_u32(h + 16),
                                .dim = kvt__get_u32(h + 20),
                                .samples = kvt__get_u64(h + 32)};
    uint64_t cap = kvt__get_u64(h + 24);
    memcpy(&in.captured, &cap, 8);
    size_t n = (size_t)in.rank * in.dim, vb = sizeof(float) * n;
    if (s == KVT_OK && (in.rank == 0 || in.rank > KVT_RECALL_MAX_RANK || in.dim == 0 ||
                        in.dim > RB_MAX_DIM || (uint64_t)size != RB_HEADER_BYTES + vb + 4))
        s = kvt__tls_fail(KVT_ERR_PARSE,
                          "kvt_recall_basis_read: %s: rank %u, dim %u and %ld bytes disagree", path,
                          in.rank, in.dim, size);
    float *buf = s == KVT_OK ? kvt__mem_malloc(vb) : NULL;
    uint8_t tail[4];
    if (s == KVT_OK && !buf)
        s = kvt__tls_fail(KVT_ERR_OUT_OF_MEMORY, "kvt_recall_basis_read: %zu bytes", vb);
    if (s == KVT_OK && ((rc = kvt__io_pread_all(fd, buf, vb, RB_HEADER_BYTES)) != 0 ||
                        (rc = kvt__io_pread_all(fd, tail, 4, RB_HEADER_BYTES + vb)) != 0))
        s = kvt__tls_fail(KVT_ERR_IO, "kvt_recall_basis_read: reading %s: %s", path,
                          rc > 0 ? "file shrank while read" : strerror(errno));
    if (s == KVT_OK && kvt__crc32(kvt__crc32(0, h, sizeof h), buf, vb) != kvt__get_u32(tail))
        s = kvt__tls_fail(KVT_ERR_CORRUPT, "kvt_recall_basis_read: %s: CRC mismatch", path);
    if (s == KVT_OK && v && v_floats < n)
        s = kvt__tls_fail(KVT_ERR_CAPACITY,
                          "kvt_recall_basis_read: %zu floats for a %u x %u "
                          "basis",
                          v_floats, in.rank, in.dim);
    if (s == KVT_OK) {
        in.id = kvt__basis_id(buf, n);
        *info = in;
        if (v)
            memcpy(v, buf, vb);
    }
    kvt__mem_free(buf);
    kvt__io_close(fd); /* read-only: a failed close loses nothing */
    return s;
}

/* Read the basis file at path for `layer` of ctx, whose sketched dim is want_dim (what_dim names
 * it in the message; 0: the layer takes no such basis, which the set call then refuses by name):
 * V (rank x dim fp32, the context's allocator, *V_floats of them) and *info. The errors of
 * kvt_recall_basis_read, KVT_ERR_OUT_OF_RANGE (layer), KVT_ERR_INVALID_ARGUMENT (a dim other than
 * want_dim), KVT_ERR_OUT_OF_MEMORY. */
static kvt_status read_for_layer(kvt_ctx *ctx, const char *fn, uint32_t layer, const char *path,
                                 uint32_t (*want_dim)(const kvt_ctx *, uint32_t),
                                 const char *what_dim,
                                 kvt_recall_basis_info *info, float **V, size_t *V_floats) {
    *V = NULL;
    if (!ctx || !path)
        return kvt__tls_fail(KVT_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    if (layer >= ctx->n_layers)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE, "%s: layer %u of %u", fn, layer,
                             ctx->n_layers);
    kvt_status s = kvt_recall_basis_read(path, info, NULL, 0);
    if (s != KVT_OK)
        return s;
    const uint32_t dim = want_dim(ctx, layer);
    if (dim && info->dim != dim)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT,
                             "%s: %s holds dim %u, layer %u (%s) has %s %u", fn, path, info->dim,
                             layer, kvt_layer_kind_name(ctx->stores[layer].spec.kind), what_dim,
                             dim);
    size_t n = (size_t)info->rank * info->dim;
    if (!(*V = kvt__malloc(&ctx->alloc, sizeof(float) * n)))
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "%s: %zu floats", fn, n);
    *V_floats = n;
    if ((s = kvt_recall_basis_read(path, info, *V, n)) != KVT_OK) {
        kvt__free(&ctx->alloc, *V, sizeof(float) * n);
        *V = NULL;
    }
    return s;
}

static uint32_t value_dim_of(const kvt_ctx *ctx, uint32_t layer) {
    return ctx->stores[layer].spec.value_dim;
}

kvt_status kvt_ctx_load_recall_basis(kvt_ctx *ctx, uint32_t layer, const char *path) {
    kvt_recall_basis_info info;
    float *V;
    size_t n = 0;
    kvt_status s = read_for_layer(ctx, "kvt_ctx_load_recall_basis", layer, path, value_dim_of,
                                  "value_dim", &info, &V, &n);
    if (s != KVT_OK)
        return s;
    s = kvt_ctx_set_recall_basis(ctx, layer, V, info.rank);
    kvt__free(&ctx->alloc, V, sizeof(float) * n);
    return s;
}

kvt_status kvt_ctx_load_recall_head_basis(kvt_ctx *ctx, uint32_t layer, uint32_t kv_head,
                                          const char *path) {
    kvt_recall_basis_info info;
    float *V;
    size_t n = 0;
    kvt_status s = read_for_layer(ctx, "kvt_ctx_load_recall_head_basis", layer, path,
                                  key_dim_of, "key dim", &info, &V, &n);
    if (s != KVT_OK)
        return s;
    s = kvt_ctx_set_recall_head_basis(ctx, layer, kv_head, V, info.rank);
    kvt__free(&ctx->alloc, V, sizeof(float) * n);
    return s;
}
