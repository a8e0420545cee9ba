/*
 * io.h — the I/O seam (seam.h): every file the library reads or writes (configs, snapshots,
 * traces, recall bases) is opened, read, written, synced, renamed, closed and removed through
 * these calls, and only io.c calls the system's. Each is a macro that passes its caller's file
 * and function as the site; each returns what the POSIX call returns (-1 with errno set on
 * failure; read and write may transfer less than asked).
 */
#ifndef KVT_LIB_BASE_IO_H
#define KVT_LIB_BASE_IO_H

#include "seam.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#define kvt__io_open(path, flags, mode) kvt__io_open_at((path), (flags), (mode), KVT__SITE)
/* mkstemp(tmpl) (its "open"), with O_CLOEXEC. */
#define kvt__io_mkstemp(tmpl) kvt__io_mkstemp_at((tmpl), KVT__SITE)
#define kvt__io_read(fd, buf, n) kvt__io_read_at((fd), (buf), (n), KVT__SITE)
#define kvt__io_pread(fd, buf, n, off) kvt__io_pread_at((fd), (buf), (n), (off), KVT__SITE)
#define kvt__io_write(fd, buf, n) kvt__io_write_at((fd), (buf), (n), KVT__SITE)
#define kvt__io_fsync(fd) kvt__io_fsync_at((fd), KVT__SITE)
#define kvt__io_rename(from, to) kvt__io_rename_at((from), (to), KVT__SITE)
/* Closes fd even when it reports an error (Linux close). */
#define kvt__io_close(fd) kvt__io_close_at((fd), KVT__SITE)
#define kvt__io_unlink(path) kvt__io_unlink_at((path), KVT__SITE)
#define kvt__io_fstat(fd, st) kvt__io_fstat_at((fd), (st), KVT__SITE)
/* flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB)): 0, or -1 (EWOULDBLOCK: another open file holds a
 * lock on it). Released by closing fd, or when the process dies. */
#define kvt__io_lock(fd, wait) kvt__io_lock_at((fd), (wait), KVT__SITE)

/* Write all n bytes (short writes continue, EINTR retries): 0, or -1 with errno (EIO for a
 * write that wrote nothing). */
#define kvt__io_write_all(fd, buf, n) kvt__io_write_all_at((fd), (buf), (n), KVT__SITE)
/* Read exactly n bytes at offset off (pread; EINTR retries): 0, -1 with errno, or 1 at an
 * early end of file. */
#define kvt__io_pread_all(fd, buf, n, off) kvt__io_pread_all_at((fd), (buf), (n), (off), KVT__SITE)

/* A directory listing: names only, "." and ".." left out. kvt__io_dir_open: NULL with errno
 * on failure; kvt__io_dir_next: the next name (valid until the next call), NULL at the end. */
typedef struct kvt__io_dir kvt__io_dir;
#define kvt__io_dir_open(path) kvt__io_dir_open_at((path), KVT__SITE)
const char *kvt__io_dir_next(kvt__io_dir *d);
void kvt__io_dir_close(kvt__io_dir *d);

int kvt__io_open_at(const char *path, int flags, unsigned mode, const char *file, const char *func);
int kvt__io_mkstemp_at(char *tmpl, const char *file, const char *func);
ssize_t kvt__io_read_at(int fd, void *buf, size_t n, const char *file, const char *func);
ssize_t kvt__io_pread_at(int fd, void *buf, size_t n, uint64_t off, const char *file,
                         const char *func);
ssize_t kvt__io_write_at(int fd, const void *buf, size_t n, const char *file, const char *func);
int kvt__io_fsync_at(int fd, const char *file, const char *func);
int kvt__io_rename_at(const char *from, const char *to, const char *file, const char *func);
int kvt__io_close_at(int fd, const char *file, const char *func);
int kvt__io_unlink_at(const char *path, const char *file, const char *func);
int kvt__io_fstat_at(int fd, struct stat *st, const char *file, const char *func);
int kvt__io_lock_at(int fd, bool wait, const char *file, const char *func);
int kvt__io_write_all_at(int fd, const void *buf, size_t n, const char *file, const char *func);
int kvt__io_pread_all_at(int fd, void *buf, size_t n, uint64_t off, const char *file,
                         const char *func);
kvt__io_dir *kvt__io_dir_open_at(const char *path, const char *file, const char *func);

#endif /* KVT_LIB_BASE_IO_H */
