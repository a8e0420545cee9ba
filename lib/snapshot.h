/* snapshot.h — request snapshots (lib/snapshot.c), internal: the format's version and section
 * types. (The file writer's I/O goes through the I/O seam, lib/base/io.h.) */
#ifndef KVT_LIB_SNAPSHOT_H
#define KVT_LIB_SNAPSHOT_H

#include "handles.h"

/* Snapshot format (docs/snapshot-format.md): container content kind 2, these section types. */
enum {
    KVT__SNAP_VERSION = 1,
    KVT__SNAP_SEC_META = 1,  /* model, configuration, request, page tables */
    KVT__SNAP_SEC_ROWS = 2,  /* one per layer with KV: its pool rows */
    KVT__SNAP_SEC_STATE = 3, /* one per layer whose policy has state */
    KVT__SNAP_SEC_RECALL = 4, /* one per layer where the request recalls: the trigger's state */
};

#endif
