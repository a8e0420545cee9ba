/* buffer.c — buffers in the context's backend memory space (kvt_buffer_*): what an engine
 * allocates for the emission arrays of kvt_batch_run when attention runs where the backend's
 * memory is, and reaches from the host only through the backend's copies (ggml-backend's rule). */
#include "handles.h"

#include <string.h>

struct kvt_buffer {
    kvt_ctx *ctx;
    kvt_buffer *prev, *next; /* the context's live buffers: freed with it */
    void *p;
    size_t bytes;
};

kvt_status kvt_buffer_alloc(kvt_ctx *ctx, size_t bytes, kvt_buffer **out) {
    if (out)
        *out = NULL;
    if (!ctx || !out)
        return KVT_ERR_INVALID_ARGUMENT;
    kvt__ctx_clear_error(ctx);
    if (bytes == 0)
        return kvt__ctx_fail(ctx, KVT_ERR_INVALID_ARGUMENT, "kvt_buffer_alloc: 0 bytes");
    kvt_buffer *b = kvt__calloc(&ctx->alloc, sizeof *b);
    if (!b)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_MEMORY, "buffer handle");
    kvt_status s = ctx->backend.ops->buf_alloc(&ctx->backend, bytes, &b->p);
    if (s != KVT_OK) {
        kvt__free(&ctx->alloc, b, sizeof *b);
        return kvt__ctx_fail(ctx, s, "%zu bytes of %s backend memory", bytes,
                             ctx->backend.ops->name);
    }
    b->ctx = ctx;
    b->bytes = bytes;
    b->next = ctx->buffers;
    if (ctx->buffers)
        ctx->buffers->prev = b;
    ctx->buffers = b;
    *out = b;
    return KVT_OK;
}

void kvt_buffer_free(kvt_buffer *b) {
    if (!b)
        return;
    kvt_ctx *ctx = b->ctx;
    if (b->prev)
        b->prev->next = b->next;
    else
        ctx->buffers = b->next;
    if (b->next)
        b->next->prev = b->prev;
    ctx->backend.ops->buf_free(&ctx->backend, b->p, b->bytes);
    kvt__free(&ctx->alloc, b, sizeof *b);
}

void kvt__buffers_free(kvt_ctx *ctx) {
    while (ctx->buffers)
        kvt_buffer_free(ctx->buffers);
}

void *kvt_buffer_ptr(const kvt_buffer *b) {
    return b ? b->p : NULL;
}

size_t kvt_buffer_size(const kvt_buffer *b) {
    return b ? b->bytes : 0;
}

/* A copy between host memory and [offset, offset + bytes) of the buffer, through the backend. */
static kvt_status copy(const kvt_buffer *b, size_t offset, void *host, size_t bytes, bool write,
                       void *stream) {
    if (!b || (!host && bytes))
        return KVT_ERR_INVALID_ARGUMENT;
    kvt_ctx *ctx = b->ctx;
    kvt__ctx_clear_error(ctx);
    if (offset > b->bytes || bytes > b->bytes - offset)
        return kvt__ctx_fail(ctx, KVT_ERR_OUT_OF_RANGE,
                             "bytes [%zu, %zu + %zu) outside a buffer of %zu bytes", offset, offset,
                             bytes, b->bytes);
    if (bytes == 0)
        return KVT_OK;
    uint8_t *dev = (uint8_t *)b->p + offset;
    const kvt__backend *be = &ctx->backend;
    kvt_status s = write ? be->ops->write(be, dev, host, bytes, stream)
                         : be->ops->read(be, host, dev, bytes, stream);
    return s == KVT_OK ? KVT_OK
                       : kvt__ctx_fail(ctx, s, "%s %zu bytes of a buffer",
                                       write ? "writing" : "reading", bytes);
}

kvt_status kvt_buffer_write(kvt_buffer *b, size_t offset, const void *src, size_t bytes) {
    return copy(b, offset, (void *)src, bytes, true, NULL);
}

kvt_status kvt_buffer_read(const kvt_buffer *b, size_t offset, void *dst, size_t bytes) {
    return copy(b, offset, dst, bytes, false, NULL);
}

kvt_status kvt_buffer_write_async(kvt_buffer *b, size_t offset, const void *src, size_t bytes,
                                  void *stream) {
    return copy(b, offset, (void *)src, bytes, true, stream);
}

kvt_status kvt_buffer_read_async(const kvt_buffer *b, size_t offset, void *dst, size_t bytes,
                                 void *stream) {
    return copy(b, offset, dst, bytes, false, stream);
}
