/* container.c — the generic kvtier container: file header, CRC-checked sections, END marker.
 * Byte layout in docs/trace-format.md section 1. */
#include "container.h"

#include "base/alloc.h"
#include "base/io.h"

#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <zlib.h>

_Static_assert(sizeof(off_t) >= 8, "kvtier traces need 64-bit file offsets");

static const uint8_t zero_pad[8];

uint32_t kvt__crc32(uint32_t crc, const void *p, uint64_t n) {
    const Bytef *b = p;
    uLong c = crc;
    /* zlib's crc32 takes a uInt length: feed it in 1 GiB pieces. */
    while (n > 0) {
        uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, b, k);
        b += k;
        n -= k;
    }
    return (uint32_t)c;
}

/* ------------------------------------------------------------------------------------------ */
/* Writer                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* Write buf's bytes out (the sticky error on failure). */
static kvt_status w_flush(kvt__ctr_writer *w) {
    if (w->error != KVT_OK || w->n_buf == 0)
        return w->error;
    if (kvt__io_write_all(w->fd, w->buf, w->n_buf) != 0)
        w->error = kvt__fail(w->msg, sizeof w->msg, KVT_ERR_IO, "write failed at offset %llu: %s",
                             (unsigned long long)(w->offset - w->n_buf), strerror(errno));
    w->n_buf = 0;
    return w->error;
}

static kvt_status w_put(kvt__ctr_writer *w, const void *p, uint64_t n) {
    if (w->error != KVT_OK)
        return w->error;
    if (n == 0) /* an empty section may pass p = NULL: memcpy's source must not be NULL */
        return KVT_OK;
    if (n <= sizeof w->buf - w->n_buf) {
        memcpy(w->buf + w->n_buf, p, (size_t)n);
        w->n_buf += (uint32_t)n;
        w->offset += n;
        return KVT_OK;
    }
    if (w_flush(w) != KVT_OK)
        return w->error;
    if (n <= sizeof w->buf) {
        memcpy(w->buf, p, (size_t)n);
        w->n_buf = (uint32_t)n;
    } else if (kvt__io_write_all(w->fd, p, (size_t)n) != 0) {
        w->error = kvt__fail(w->msg, sizeof w->msg, KVT_ERR_IO, "write failed at offset %llu: %s",
                             (unsigned long long)w->offset, strerror(errno));
        return w->error;
    }
    w->offset += n;
    return KVT_OK;
}

/* The 24-byte file header of a content kind. */
static void put_file_header(uint8_t *h, uint32_t kind) {
    memcpy(h, KVT__CTR_MAGIC, 8);
    kvt__put_u16(h + 8, KVT__CTR_MAJOR);
    kvt__put_u16(h + 10, KVT__CTR_MINOR);
    kvt__put_u32(h + 12, kind);
    kvt__put_u32(h + 16, 0); /* flags: none defined */
    kvt__put_u32(h + 20, kvt__crc32(0, h, 20));
}

/* The 24-byte header of a section. */
static void put_section_header(uint8_t *h, uint32_t type, uint32_t flags, uint64_t length,
                               uint32_t crc) {
    kvt__put_u32(h, type);
    kvt__put_u32(h + 4, flags);
    kvt__put_u64(h + 8, length);
    kvt__put_u32(h + 16, crc);
    kvt__put_u32(h + 20, kvt__crc32(0, h, 20));
}

kvt_status kvt__ctr_writer_open(kvt__ctr_writer *w, const char *path, uint32_t kind) {
    memset(w, 0, offsetof(kvt__ctr_writer, buf));
    w->offset = 0;
    w->error = KVT_OK;
    w->msg[0] = '\0';
    w->fd = kvt__io_open(path, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (w->fd < 0) {
        w->error = kvt__fail(w->msg, sizeof w->msg, KVT_ERR_IO, "cannot create %s: %s", path,
                             strerror(errno));
        return w->error;
    }
    uint8_t h[KVT__CTR_HEADER_BYTES];
    put_file_header(h, kind);
    return w_put(w, h, sizeof h);
}

kvt_status kvt__ctr_write_section(kvt__ctr_writer *w, uint32_t type, uint32_t flags,
                                  const kvt__ctr_part *parts, size_t n_parts) {
    if (w->error != KVT_OK)
        return w->error;
    uint64_t length = 0;
    uint32_t crc = 0;
    for (size_t i = 0; i < n_parts; i++) {
        length += parts[i].n;
        crc = kvt__crc32(crc, parts[i].p, parts[i].n);
    }
    uint8_t h[KVT__CTR_SECTION_HEADER_BYTES];
    put_section_header(h, type, flags, length, crc);
    kvt_status s = w_put(w, h, sizeof h);
    for (size_t i = 0; s == KVT_OK && i < n_parts; i++)
        s = w_put(w, parts[i].p, parts[i].n);
    if (s == KVT_OK)
        s = w_put(w, zero_pad, (8 - (length & 7)) & 7);
    return s;
}

/* ---- in memory ---- */
void kvt__ctr_mem_header(uint8_t *dst, uint32_t kind) {
    put_file_header(dst, kind);
}

uint64_t kvt__ctr_mem_seal(uint8_t *dst, uint32_t type, uint32_t flags, uint64_t length) {
    uint64_t pad = (8 - (length & 7)) & 7;
    uint8_t *payload = dst + KVT__CTR_SECTION_HEADER_BYTES;
    put_section_header(dst, type, flags, length, kvt__crc32(0, payload, length));
    memset(payload + length, 0, (size_t)pad);
    return KVT__CTR_SECTION_HEADER_BYTES + length + pad;
}

kvt_status kvt__ctr_writer_finish(kvt__ctr_writer *w) {
    kvt_status s = kvt__ctr_write_section(w, KVT__CTR_SEC_END, 0, NULL, 0);
    if (s == KVT_OK)
        s = w_flush(w);
    if (w->fd >= 0 && kvt__io_close(w->fd) != 0 && s == KVT_OK)
        s = w->error =
            kvt__fail(w->msg, sizeof w->msg, KVT_ERR_IO, "close failed: %s", strerror(errno));
    w->fd = -1;
    return s;
}

void kvt__ctr_writer_abandon(kvt__ctr_writer *w) {
    if (w->fd >= 0)
        kvt__io_close(w->fd);
    w->fd = -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Reader                                                                                       */
/* ------------------------------------------------------------------------------------------ */

kvt_status kvt__ctr_pread(const kvt__ctr_reader *r, uint64_t off, void *dst, uint64_t n, char *err,
                          size_t len) {
    int rc = kvt__io_pread_all(r->fd, dst, (size_t)n, off);
    if (rc < 0)
        return kvt__fail(err, len, KVT_ERR_IO, "read at offset %llu failed: %s",
                         (unsigned long long)off, strerror(errno));
    if (rc > 0)
        return kvt__fail(err, len, KVT_ERR_IO,
                         "unexpected end of file at offset %llu (file changed while open?)",
                         (unsigned long long)off);
    return KVT_OK;
}

kvt_status kvt__ctr_crc_range(const kvt__ctr_reader *r, uint64_t off, uint64_t n, uint32_t *crc,
                              char *err, size_t len) {
    enum { BUF = 1 << 20 };
    uint8_t *buf = kvt__mem_malloc(n < BUF ? (n ? (size_t)n : 1) : BUF);
    if (!buf)
        return kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "CRC buffer");
    kvt_status s = KVT_OK;
    while (n > 0 && s == KVT_OK) {
        uint64_t k = n < BUF ? n : BUF;
        s = kvt__ctr_pread(r, off, buf, k, err, len);
        if (s == KVT_OK)
            *crc = kvt__crc32(*crc, buf, k);
        off += k;
        n -= k;
    }
    kvt__mem_free(buf);
    return s;
}

kvt_status kvt__ctr_read_payload(const kvt__ctr_reader *r, const kvt__ctr_section *s, void *dst,
                                 char *err, size_t len) {
    kvt_status st = kvt__ctr_pread(r, s->offset, dst, s->length, err, len);
    if (st != KVT_OK)
        return st;
    uint32_t c = kvt__crc32(0, dst, s->length);
    if (c != s->crc)
        return kvt__fail(err, len, KVT_ERR_CORRUPT,
                         "CRC mismatch in section type %u at offset %llu: stored 0x%08x, "
                         "computed 0x%08x",
                         s->type, (unsigned long long)s->header_offset, s->crc, c);
    return KVT_OK;
}

void kvt__ctr_close(kvt__ctr_reader *r) {
    if (r->fd >= 0)
        kvt__io_close(r->fd);
    r->fd = -1;
    kvt__mem_free(r->sections);
    r->sections = NULL;
    r->n_sections = r->cap_sections = 0;
}

static kvt_status ctr_fail(kvt__ctr_reader *r, char *err, size_t len, kvt_status s, const char *fmt,
                           ...) KVT__PRINTF(5, 6);
static kvt_status ctr_fail(kvt__ctr_reader *r, char *err, size_t len, kvt_status s, const char *fmt,
                           ...) {
    va_list ap;
    va_start(ap, fmt);
    kvt__vfail(err, len, s, fmt, ap);
    va_end(ap);
    kvt__ctr_close(r);
    return s;
}

/* Check a file header h of the first `have` (>= 8) bytes of a container of `size` bytes: magic,
 * then the version (bytes 8..11 keep their meaning in every major version, the rest of the header
 * may not), then the length, then the CRC, then the content kind. */
static kvt_status check_file_header(const uint8_t *h, uint64_t size, uint32_t kind, uint32_t *major,
                                    uint32_t *minor, uint32_t *flags, char *err, size_t len) {
    if (memcmp(h, KVT__CTR_MAGIC, 8) != 0)
        return kvt__fail(err, len, KVT_ERR_PARSE, "bad magic: not a kvtier container");
    if (size < KVT__CTR_HEADER_BYTES)
        return kvt__fail(err, len, KVT_ERR_PARSE,
                         "truncated file header: file is %llu bytes, header needs %u",
                         (unsigned long long)size, KVT__CTR_HEADER_BYTES);
    *major = kvt__get_u16(h + 8);
    *minor = kvt__get_u16(h + 10);
    if (*major != KVT__CTR_MAJOR)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "unknown format version %u.%u (this reader reads major version %u)",
                         *major, *minor, KVT__CTR_MAJOR);
    uint32_t hc = kvt__crc32(0, h, 20);
    if (hc != kvt__get_u32(h + 20))
        return kvt__fail(err, len, KVT_ERR_CORRUPT,
                         "file header CRC mismatch: stored 0x%08x, computed 0x%08x",
                         kvt__get_u32(h + 20), hc);
    uint32_t got = kvt__get_u32(h + 12);
    *flags = kvt__get_u32(h + 16);
    if (got != kind)
        return kvt__fail(err, len, KVT_ERR_PARSE,
                         "container holds content kind %u (%s), expected kind %u", got,
                         got == KVT__CTR_KIND_TRACE      ? "trace"
                         : got == KVT__CTR_KIND_SNAPSHOT ? "snapshot"
                                                         : "unknown",
                         kind);
    return KVT_OK;
}

/* Decode the section header sh found at offset off (index idx) of a container of `size` bytes:
 * its CRC, its payload inside the container with its padding, END's length. *next: the offset
 * after its padded payload. */
static kvt_status parse_section_header(const uint8_t *sh, uint64_t off, uint64_t size, size_t idx,
                                       kvt__ctr_section *sec, uint64_t *next, char *err,
                                       size_t len) {
    uint32_t c = kvt__crc32(0, sh, 20);
    if (c != kvt__get_u32(sh + 20))
        return kvt__fail(err, len, KVT_ERR_CORRUPT,
                         "section %zu header CRC mismatch at offset %llu: stored 0x%08x, "
                         "computed 0x%08x",
                         idx, (unsigned long long)off, kvt__get_u32(sh + 20), c);
    *sec = (kvt__ctr_section){.type = kvt__get_u32(sh),
                              .flags = kvt__get_u32(sh + 4),
                              .header_offset = off,
                              .offset = off + KVT__CTR_SECTION_HEADER_BYTES,
                              .length = kvt__get_u64(sh + 8),
                              .crc = kvt__get_u32(sh + 16)};
    uint64_t room = size - sec->offset;
    if (sec->length > room)
        return kvt__fail(err, len, KVT_ERR_PARSE,
                         "truncated section %zu (type %u) at offset %llu: payload length %llu "
                         "runs past the end of the file (%llu bytes left)",
                         idx, sec->type, (unsigned long long)off, (unsigned long long)sec->length,
                         (unsigned long long)room);
    uint64_t padded = sec->length + ((8 - (sec->length & 7)) & 7);
    if (padded > room)
        return kvt__fail(err, len, KVT_ERR_PARSE,
                         "truncated section %zu (type %u) at offset %llu: padding missing", idx,
                         sec->type, (unsigned long long)off);
    *next = sec->offset + padded;
    if (sec->type == KVT__CTR_SEC_END) {
        if (sec->length != 0)
            return kvt__fail(err, len, KVT_ERR_PARSE,
                             "END section at offset %llu has length %llu (must be 0)",
                             (unsigned long long)sec->header_offset,
                             (unsigned long long)sec->length);
        if (*next != size)
            return kvt__fail(err, len, KVT_ERR_PARSE,
                             "%llu bytes after the END section (offset %llu)",
                             (unsigned long long)(size - *next), (unsigned long long)*next);
    }
    return KVT_OK;
}

/* A section header's bytes at off must be there. */
static kvt_status section_room(uint64_t off, uint64_t size, size_t idx, char *err, size_t len) {
    if (size - off >= KVT__CTR_SECTION_HEADER_BYTES)
        return KVT_OK;
    return kvt__fail(err, len, KVT_ERR_PARSE,
                     off == size ? "truncated file: no END section after section %zu (offset %llu)"
                                 : "truncated section header: section %zu at offset %llu",
                     idx, (unsigned long long)off);
}

kvt_status kvt__ctr_open(kvt__ctr_reader *r, const char *path, uint32_t kind, char *err,
                         size_t len) {
    memset(r, 0, sizeof *r);
    r->fd = kvt__io_open(path, O_RDONLY, 0);
    if (r->fd < 0)
        return ctr_fail(r, err, len, KVT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (kvt__io_fstat(r->fd, &st) != 0)
        return ctr_fail(r, err, len, KVT_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return ctr_fail(r, err, len, KVT_ERR_IO, "%s is not a regular file", path);
    r->size = (uint64_t)st.st_size;

    uint8_t h[KVT__CTR_HEADER_BYTES];
    if (r->size < 8)
        return ctr_fail(r, err, len, KVT_ERR_PARSE,
                        "truncated file header: file is %llu bytes, header needs %u",
                        (unsigned long long)r->size, KVT__CTR_HEADER_BYTES);
    kvt_status s = kvt__ctr_pread(r, 0, h, r->size < sizeof h ? r->size : sizeof h, err, len);
    if (s == KVT_OK)
        s = check_file_header(h, r->size, kind, &r->major, &r->minor, &r->flags, err, len);
    if (s != KVT_OK)
        return ctr_fail(r, NULL, 0, s, "%s", "");
    r->kind = kind;

    uint64_t off = KVT__CTR_HEADER_BYTES;
    for (size_t idx = 0;; idx++) {
        uint8_t sh[KVT__CTR_SECTION_HEADER_BYTES];
        kvt__ctr_section sec;
        uint64_t next = 0;
        s = section_room(off, r->size, idx, err, len);
        if (s == KVT_OK)
            s = kvt__ctr_pread(r, off, sh, sizeof sh, err, len);
        if (s == KVT_OK)
            s = parse_section_header(sh, off, r->size, idx, &sec, &next, err, len);
        if (s != KVT_OK)
            return ctr_fail(r, NULL, 0, s, "%s", "");
        off = next;
        if (sec.type == KVT__CTR_SEC_END)
            return KVT_OK;
        if (r->n_sections == r->cap_sections) {
            /* Grows with sections actually present: bounded by file size / 24. */
            size_t cap = r->cap_sections ? 2 * r->cap_sections : 16;
            kvt__ctr_section *p = kvt__mem_realloc(r->sections, cap * sizeof *p);
            if (!p)
                return ctr_fail(r, err, len, KVT_ERR_OUT_OF_MEMORY, "section directory");
            r->sections = p;
            r->cap_sections = cap;
        }
        r->sections[r->n_sections++] = sec;
    }
}

kvt_status kvt__ctr_mem_open(const uint8_t *buf, uint64_t size, uint32_t kind, uint32_t *minor,
                             char *err, size_t len) {
    if (size < 8)
        return kvt__fail(err, len, KVT_ERR_PARSE,
                         "truncated header: %llu bytes, the header needs %u",
                         (unsigned long long)size, KVT__CTR_HEADER_BYTES);
    uint32_t major, flags;
    return check_file_header(buf, size, kind, &major, minor, &flags, err, len);
}

kvt_status kvt__ctr_mem_next(const uint8_t *buf, uint64_t size, uint64_t *off, size_t idx,
                             kvt__ctr_section *sec, char *err, size_t len) {
    uint64_t next = 0;
    kvt_status s = section_room(*off, size, idx, err, len);
    if (s == KVT_OK)
        s = parse_section_header(buf + *off, *off, size, idx, sec, &next, err, len);
    if (s != KVT_OK)
        return s;
    /* Padding is not under the CRC: in memory it must be zero, so that every byte counts. */
    for (uint64_t i = sec->offset + sec->length; i < next; i++)
        if (buf[i] != 0)
            return kvt__fail(err, len, KVT_ERR_CORRUPT,
                             "section %zu (type %u): padding byte at offset %llu is not zero",
                             idx, sec->type, (unsigned long long)i);
    uint32_t c = kvt__crc32(0, buf + sec->offset, sec->length);
    if (c != sec->crc)
        return kvt__fail(err, len, KVT_ERR_CORRUPT,
                         "CRC mismatch in section %zu (type %u) at offset %llu: stored 0x%08x, "
                         "computed 0x%08x",
                         idx, sec->type, (unsigned long long)sec->header_offset, sec->crc, c);
    *off = next;
    return KVT_OK;
}
