/*
 * container.h — the generic kvtier container (internal): a file header and a sequence of
 * CRC-checked sections, closed by an END section. Traces use it (lib/trace.c) as files; request
 * snapshots (lib/snapshot.c) in memory, with their own content kind and section types. Layout: docs/trace-format.md
 * section 1. Little-endian helpers for payload (de)serialisation live here too.
 */
#ifndef KVT_LIB_CONTAINER_H
#define KVT_LIB_CONTAINER_H

#include "base/base.h"

#include <stdint.h>
#include <stdio.h>

#define KVT__CTR_MAGIC "\x89KVT\r\n\x1a\n"
#define KVT__CTR_MAJOR 1u
#define KVT__CTR_MINOR 0u
#define KVT__CTR_HEADER_BYTES 24u
#define KVT__CTR_SECTION_HEADER_BYTES 24u
#define KVT__CTR_FLAG_CRITICAL 1u /* a reader that does not know the type must refuse the file */
#define KVT__CTR_SEC_END 0u

enum { KVT__CTR_KIND_TRACE = 1, KVT__CTR_KIND_SNAPSHOT = 2 };

/* ---- little-endian fixed-layout helpers ---- */
static inline void kvt__put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void kvt__put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvt__put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t kvt__get_u16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t kvt__get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kvt__get_u64(const uint8_t *p) {
    return (uint64_t)kvt__get_u32(p) | ((uint64_t)kvt__get_u32(p + 4) << 32);
}

/* CRC-32 (zlib's, IEEE 802.3) continuing from crc over n bytes; n may exceed UINT_MAX. */
uint32_t kvt__crc32(uint32_t crc, const void *p, uint64_t n);

/* ---- writer ---- */
typedef struct kvt__ctr_writer {
    int fd;           /* -1: closed */
    uint32_t n_buf;   /* bytes waiting in buf */
    uint8_t buf[1u << 16]; /* small writes (headers, padding) gather here: a section header is
                            * not a system call of its own */
    uint64_t offset;  /* bytes written so far */
    kvt_status error; /* sticky I/O error (KVT_OK while healthy) */
    char msg[256];
} kvt__ctr_writer;

/* One piece of a section payload; a payload is written from several pieces without copying. */
typedef struct kvt__ctr_part {
    const void *p;
    uint64_t n;
} kvt__ctr_part;

/* Create path and write the file header of the given content kind. */
kvt_status kvt__ctr_writer_open(kvt__ctr_writer *w, const char *path, uint32_t kind);
/* Append a section whose payload is the concatenation of parts (CRC computed over them). */
kvt_status kvt__ctr_write_section(kvt__ctr_writer *w, uint32_t type, uint32_t flags,
                                  const kvt__ctr_part *parts, size_t n_parts);
/* Append END, flush and close. The file is closed even on error. */
kvt_status kvt__ctr_writer_finish(kvt__ctr_writer *w);
/* Close without END. */
void kvt__ctr_writer_abandon(kvt__ctr_writer *w);

/* ---- reader ---- */
typedef struct kvt__ctr_section {
    uint32_t type, flags;
    uint64_t header_offset; /* file offset of the section header */
    uint64_t offset;        /* file offset of the payload */
    uint64_t length;        /* payload bytes */
    uint32_t crc;           /* CRC-32 of the payload as recorded */
} kvt__ctr_section;

typedef struct kvt__ctr_reader {
    int fd;
    uint64_t size; /* file size in bytes */
    uint32_t major, minor, kind, flags;
    kvt__ctr_section *sections; /* every section but END, in file order */
    size_t n_sections, cap_sections;
} kvt__ctr_reader;

/* Open path, check the header (magic, major version, header CRC, content kind == kind) and walk
 * every section header to the END section: header CRCs, lengths inside the file, nothing after
 * END. Payloads are not read. On error *r is released (fd closed) and err holds the detail. */
kvt_status kvt__ctr_open(kvt__ctr_reader *r, const char *path, uint32_t kind, char *err,
                         size_t len);
void kvt__ctr_close(kvt__ctr_reader *r);
/* pread exactly n bytes at off (KVT_ERR_IO on error or short read). */
kvt_status kvt__ctr_pread(const kvt__ctr_reader *r, uint64_t off, void *dst, uint64_t n, char *err,
                          size_t len);
/* Read a whole (small) payload into dst (length bytes) and check its CRC. */
kvt_status kvt__ctr_read_payload(const kvt__ctr_reader *r, const kvt__ctr_section *s, void *dst,
                                 char *err, size_t len);
/* Stream bytes [off, off + n) through a bounded buffer, continuing *crc. */
kvt_status kvt__ctr_crc_range(const kvt__ctr_reader *r, uint64_t off, uint64_t n, uint32_t *crc,
                              char *err, size_t len);

/* ---- in memory (request snapshots) ----
 * The same layout in one caller buffer. A writer puts the 24-byte file header with
 * kvt__ctr_mem_header, then per section writes the payload at dst + KVT__CTR_SECTION_HEADER_BYTES
 * and seals it with kvt__ctr_mem_seal (header, CRC, zero padding; returns the bytes the section
 * took, header and padding included), and ends with a sealed END section (type 0, length 0). */
void kvt__ctr_mem_header(uint8_t *dst, uint32_t kind);
uint64_t kvt__ctr_mem_seal(uint8_t *dst, uint32_t type, uint32_t flags, uint64_t length);
/* Bytes a section of `length` payload bytes takes. */
static inline uint64_t kvt__ctr_mem_section_bytes(uint64_t length) {
    return KVT__CTR_SECTION_HEADER_BYTES + length + ((8 - (length & 7)) & 7);
}
/* Check the file header of buf[0..size) (as kvt__ctr_open: magic, major version, CRC, kind);
 * *minor receives the minor version. */
kvt_status kvt__ctr_mem_open(const uint8_t *buf, uint64_t size, uint32_t kind, uint32_t *minor,
                             char *err, size_t len);
/* The section whose header is at *off (idx: its index, for messages): header CRC, payload and
 * padding inside the buffer, payload CRC, END last with nothing after it; *off advances past
 * it. Start at *off = KVT__CTR_HEADER_BYTES and stop at type KVT__CTR_SEC_END. */
kvt_status kvt__ctr_mem_next(const uint8_t *buf, uint64_t size, uint64_t *off, size_t idx,
                             kvt__ctr_section *sec, char *err, size_t len);

#endif /* KVT_LIB_CONTAINER_H */
