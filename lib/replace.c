/* replace.c — atomic file replacement and stale temporaries (replace.h).
 *
 * A writer that is killed between creating its temporary and renaming it leaves
 * "<name>.tmp.XXXXXX" behind; nothing else would ever remove it. The next write to the same name
 * removes the ones that are stale, and kvt_snapshot_clean removes those of a whole directory.
 * "Stale" must never catch a temporary another writer is still filling (two processes may write
 * snapshots of the same name at once; the loser of the rename race only loses its rename, as it
 * would anyway): each writer holds an exclusive flock on its temporary from just after creating
 * it until it is renamed or removed, and the kernel drops the lock when the writer dies however
 * it dies. A cleaner removes a file only when its own non-blocking flock succeeds. The lock is
 * taken just after mkstemp, so a file younger than a few seconds may be unlocked only because its
 * writer has not reached flock yet: the age rule (KVT_SNAPSHOT_STALE_SECONDS) closes that window,
 * and also spares the temporaries of writers that take no lock (older kvtier versions) while they
 * write (each write updates the file's modification time). The name must be mkstemp's and the
 * content empty or a kvtier magic's prefix, so a cleaner never touches another program's files.
 * flock works on local file systems and, emulated with fcntl locks, on NFS.
 */
#include "replace.h"

#include "base/alloc.h"
#include "base/io.h"
#include "container.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* The recall basis file's magic (lib/recall_basis.c). */
#define RB_MAGIC "KVTRBAS1"

/* Is name "<base>.tmp.XXXXXX" (base NULL: any non-empty base)? */
static bool temp_name(const char *name, const char *base) {
    size_t n = strlen(name);
    const size_t tail = 5 + 6; /* ".tmp." + six characters */
    if (n <= tail || memcmp(name + n - tail, ".tmp.", 5) != 0)
        return false;
    for (size_t i = n - 6; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')))
            return false;
    }
    return !base || (strlen(base) == n - tail && memcmp(name, base, n - tail) == 0);
}

/* Remove dir/name when it is a stale temporary (see the file comment); true if removed. */
static bool remove_if_stale(const char *path, uint32_t min_age_s, time_t now) {
    int fd = kvt__io_open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0)
        return false;
    bool stale = false;
    struct stat st;
    uint8_t head[8];
    if (kvt__io_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
        (double)now - (double)st.st_mtime >= (double)min_age_s && kvt__io_lock(fd, false) == 0) {
        /* Locked by this cleaner now: no writer holds it. Its first bytes, if any, must be a
         * kvtier file's. */
        size_t k = st.st_size < 8 ? (size_t)st.st_size : 8;
        stale = kvt__io_pread_all(fd, head, k, 0) == 0 &&
                (memcmp(head, KVT__CTR_MAGIC, k) == 0 || memcmp(head, RB_MAGIC, k) == 0);
    }
    /* Unlinked while this descriptor holds the lock, so no new writer can lock it meanwhile
     * (a new writer's mkstemp makes a new name). */
    bool removed = stale && kvt__io_unlink(path) == 0;
    kvt__io_close(fd);
    return removed;
}

kvt_status kvt__clean_stale(const char *dir, const char *base, uint32_t min_age_s,
                            uint32_t *n_removed, char *err, size_t len) {
    if (n_removed)
        *n_removed = 0;
    kvt__io_dir *d = kvt__io_dir_open(dir);
    if (!d)
        return kvt__fail(err, len, KVT_ERR_IO, "cannot list %s: %s", dir, strerror(errno));
    const time_t now = time(NULL);
    const size_t dlen = strlen(dir);
    kvt_status s = KVT_OK;
    uint32_t removed = 0;
    for (const char *name; (name = kvt__io_dir_next(d));) {
        if (!temp_name(name, base))
            continue;
        size_t plen = dlen + 1 + strlen(name) + 1;
        char *path = kvt__mem_malloc(plen);
        if (!path) {
            s = kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "a path in %s", dir);
            break;
        }
        snprintf(path, plen, "%s/%s", dir, name);
        removed += remove_if_stale(path, min_age_s, now);
        kvt__mem_free(path);
    }
    kvt__io_dir_close(d);
    if (n_removed)
        *n_removed = removed;
    return s;
}

kvt_status kvt__replace_file(const char *path, const void *buf, size_t n, char *err, size_t len) {
    size_t plen = strlen(path);
    const char *slash = strrchr(path, '/');
    size_t dlen = slash ? (size_t)(slash - path) : 0;
    char *tmp = kvt__mem_malloc(plen + 16);
    char *dir = kvt__mem_malloc(dlen + 2);
    kvt_status s = KVT_OK;
    if (!tmp || !dir) {
        s = kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "the names of %s", path);
        goto out;
    }
    if (slash) {
        memcpy(dir, path, dlen ? dlen : 1); /* "/name": the root */
        dir[dlen ? dlen : 1] = '\0';
    } else {
        strcpy(dir, ".");
    }
    /* Best effort: a directory that cannot be listed is the write's to report, if it fails. */
    kvt_status cs =
        kvt__clean_stale(dir, slash ? slash + 1 : path, KVT_SNAPSHOT_STALE_SECONDS, NULL, NULL, 0);
    if (cs == KVT_ERR_OUT_OF_MEMORY) {
        s = kvt__fail(err, len, cs, "the names of %s's stale temporaries", path);
        goto out;
    }
    snprintf(tmp, plen + 16, "%s.tmp.XXXXXX", path);
    int fd = kvt__io_mkstemp(tmp);
    if (fd < 0) {
        s = kvt__fail(err, len, KVT_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    const char *step = NULL;
    if (kvt__io_lock(fd, false) != 0)
        step = "lock";
    else if (kvt__io_write_all(fd, buf, n) != 0)
        step = "write";
    else if (kvt__io_fsync(fd) != 0)
        step = "fsync";
    int e = errno;
    if (kvt__io_close(fd) != 0 && !step) {
        step = "close";
        e = errno;
    }
    if (!step && kvt__io_rename(tmp, path) != 0) {
        step = "rename";
        e = errno;
    }
    if (step) {
        /* A failed unlink leaves a temporary no one holds: the next write removes it. */
        kvt__io_unlink(tmp);
        s = kvt__fail(err, len, KVT_ERR_IO, "%s of %s failed: %s (%s left as it was)", step, tmp,
                      strerror(e), path);
        goto out;
    }
    /* The rename is durable once the directory is. */
    int dfd = kvt__io_open(dir, O_RDONLY | O_DIRECTORY, 0);
    if (dfd < 0 || kvt__io_fsync(dfd) != 0) {
        e = errno;
        s = kvt__fail(err, len, KVT_ERR_IO,
                      "%s written and renamed, but %s of its directory %s failed: %s (the new "
                      "name may not survive a crash)",
                      path, dfd < 0 ? "open" : "fsync", dir, strerror(e));
    }
    if (dfd >= 0)
        kvt__io_close(dfd);
out:
    kvt__mem_free(tmp);
    kvt__mem_free(dir);
    return s;
}
