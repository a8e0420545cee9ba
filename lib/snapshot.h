/* snapshot.h — request snapshots (lib/snapshot.c), internal: the I/O the atomic file writer
 * goes through, replaceable per context so that tests can fail each write, fsync and rename. */
#ifndef KVT_LIB_SNAPSHOT_H
#define KVT_LIB_SNAPSHOT_H

#include "handles.h"

#include <sys/types.h>

/* The system calls of kvt_seq_snapshot_file. Each returns what the POSIX call returns (-1 with
 * errno set on failure); write may write less than asked (it is called again for the rest). */
typedef struct kvt__io {
    ssize_t (*write)(int fd, const void *buf, size_t n);
    int (*fsync)(int fd);
    int (*rename)(const char *from, const char *to);
} kvt__io;

/* Route ctx's snapshot file I/O through io (NULL: the system's calls). io must outlive its use. */
void kvt__ctx_set_io(kvt_ctx *ctx, const kvt__io *io);

/* Snapshot format (docs/snapshot-format.md): container content kind 2, these section types. */
enum {
    KVT__SNAP_VERSION = 1,
    KVT__SNAP_SEC_META = 1,  /* model, configuration, request, page tables */
    KVT__SNAP_SEC_ROWS = 2,  /* one per layer with KV: its pool rows */
    KVT__SNAP_SEC_STATE = 3, /* one per layer whose policy has state */
    KVT__SNAP_SEC_RECALL = 4, /* one per layer where the request recalls: the trigger's state */
};

#endif
