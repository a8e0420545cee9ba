/* replace.h — atomic replacement of a file (snapshots, recall bases) and the removal of the
 * temporaries that writers killed mid-write leave behind (lib/replace.c). */
#ifndef KVT_LIB_REPLACE_H
#define KVT_LIB_REPLACE_H

#include "base/base.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Write buf[0..n) to path atomically: a temporary "<path>.tmp.XXXXXX" (mkstemp, mode 0600) in
 * path's directory, locked (flock) while it exists, written, fsync'ed, renamed over path, then
 * the directory fsync'ed. First, the stale temporaries of the same name are removed
 * (kvt__clean_stale with base = path's last component, min_age_s = KVT_SNAPSHOT_STALE_SECONDS).
 * KVT_OK, KVT_ERR_OUT_OF_MEMORY, or KVT_ERR_IO with err naming the failing step ("create",
 * "lock", "write", "fsync", "close", "rename": the temporary removed, a file at path left as it
 * was; or "fsync of its directory": the new file is in place). */
kvt_status kvt__replace_file(const char *path, const void *buf, size_t n, char *err, size_t len);

/* Remove the stale temporaries in dir: regular files named "<base>.tmp.XXXXXX" (base NULL: any
 * name; XXXXXX six letters or digits, mkstemp's), empty or beginning with a prefix of a kvtier
 * file's magic, last modified at least min_age_s seconds ago, and not locked by a live writer
 * (a non-blocking flock succeeds). *n_removed (may be NULL) counts the files removed. KVT_OK, or
 * KVT_ERR_IO when dir cannot be listed (the files that could not be removed are only skipped:
 * a writer may have renamed or removed them meanwhile). */
kvt_status kvt__clean_stale(const char *dir, const char *base, uint32_t min_age_s,
                            uint32_t *n_removed, char *err, size_t len);

#endif /* KVT_LIB_REPLACE_H */
