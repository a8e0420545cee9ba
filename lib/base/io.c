/* io.c — the I/O seam (io.h, seam.h): the only object of the library that calls the system's file
 * functions. Each call asks the seam's hook first; a failed call does nothing (a failed close
 * still closes) and sets errno to what the hook answered. */
#define _GNU_SOURCE /* flock, mkostemp */
#include "io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

/* Ask the hook about an operation; -1 with errno set when it fails the call. */
static int enter(const char *op, size_t *bytes, const char *file, const char *func) {
    size_t none = 0;
    int e = kvt__seam_enter(KVT__SEAM_IO, op, file, func, bytes ? bytes : &none);
    if (e == 0)
        return 0;
    errno = e;
    return -1;
}

int kvt__io_open_at(const char *path, int flags, unsigned mode, const char *file,
                    const char *func) {
    if (enter("open", NULL, file, func) != 0)
        return -1;
    return open(path, flags | O_CLOEXEC, (mode_t)mode);
}

int kvt__io_mkstemp_at(char *tmpl, const char *file, const char *func) {
    if (enter("open", NULL, file, func) != 0)
        return -1;
    return mkostemp(tmpl, O_CLOEXEC);
}

ssize_t kvt__io_read_at(int fd, void *buf, size_t n, const char *file, const char *func) {
    if (enter("read", &n, file, func) != 0)
        return -1;
    return read(fd, buf, n);
}

ssize_t kvt__io_pread_at(int fd, void *buf, size_t n, uint64_t off, const char *file,
                         const char *func) {
    if (enter("read", &n, file, func) != 0)
        return -1;
    return pread(fd, buf, n, (off_t)off);
}

ssize_t kvt__io_write_at(int fd, const void *buf, size_t n, const char *file, const char *func) {
    if (enter("write", &n, file, func) != 0)
        return -1;
    return write(fd, buf, n);
}

int kvt__io_fsync_at(int fd, const char *file, const char *func) {
    if (enter("fsync", NULL, file, func) != 0)
        return -1;
    return fsync(fd);
}

int kvt__io_rename_at(const char *from, const char *to, const char *file, const char *func) {
    if (enter("rename", NULL, file, func) != 0)
        return -1;
    return rename(from, to);
}

int kvt__io_close_at(int fd, const char *file, const char *func) {
    if (enter("close", NULL, file, func) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return close(fd);
}

int kvt__io_unlink_at(const char *path, const char *file, const char *func) {
    if (enter("unlink", NULL, file, func) != 0)
        return -1;
    return unlink(path);
}

int kvt__io_fstat_at(int fd, struct stat *st, const char *file, const char *func) {
    if (enter("stat", NULL, file, func) != 0)
        return -1;
    return fstat(fd, st);
}

int kvt__io_lock_at(int fd, bool wait, const char *file, const char *func) {
    if (enter("lock", NULL, file, func) != 0)
        return -1;
    int r;
    while ((r = flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB))) != 0 && errno == EINTR)
        ;
    return r;
}

int kvt__io_write_all_at(int fd, const void *buf, size_t n, const char *file, const char *func) {
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = kvt__io_write_at(fd, p, n, file, func);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            if (k == 0)
                errno = EIO;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

int kvt__io_pread_all_at(int fd, void *buf, size_t n, uint64_t off, const char *file,
                         const char *func) {
    uint8_t *p = buf;
    while (n > 0) {
        size_t k = n > (1u << 30) ? (1u << 30) : n;
        ssize_t got = kvt__io_pread_at(fd, p, k, off, file, func);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return -1;
        if (got == 0)
            return 1;
        p += got;
        off += (uint64_t)got;
        n -= (size_t)got;
    }
    return 0;
}

/* kvt__io_dir is an incomplete type standing for opendir's DIR, kept out of the header. */
kvt__io_dir *kvt__io_dir_open_at(const char *path, const char *file, const char *func) {
    if (enter("opendir", NULL, file, func) != 0)
        return NULL;
    return (kvt__io_dir *)opendir(path);
}

const char *kvt__io_dir_next(kvt__io_dir *dir) {
    DIR *d = (DIR *)dir;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            return e->d_name;
    return NULL;
}

void kvt__io_dir_close(kvt__io_dir *dir) {
    if (dir)
        closedir((DIR *)dir);
}
