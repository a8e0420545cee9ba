/* handles.h — the context and sequence handles (internal). */
#ifndef KVT_LIB_HANDLES_H
#define KVT_LIB_HANDLES_H

#include "base/base.h"
#include "base/alloc.h"
#include "tiers/tiers.h"

#define KVT__MAX_GROUPS 3

typedef struct kvt__group {
    kvt_policy policy;
    kvt__pool pool;
    uint32_t n_layers;
    uint32_t *layers; /* model layer indices */
    /* W of a none group whose layers are all sliding-window layers: the largest window among
     * them. After each commit the pages holding only rows before n_rows - W go back to the pool
     * (kvt__ptable_release_front), which leaves every layer its own window. 0: keep every row
     * (evict and salience groups, and a none group holding any layer that is not sliding). */
    uint32_t window_rows;
} kvt__group;

struct kvt_ctx {
    kvt__alloc alloc;
    kvt__backend backend;
    kvt_model *model;
    kvt_config cfg;
    uint32_t page_rows, n_pages;
    bool external;
    bool started; /* a reservation happened: storage can no longer be rebound */
    uint32_t n_layers;
    kvt__store *stores;    /* [n_layers] */
    kvt_policy *policies;  /* [n_layers] */
    uint32_t n_groups;
    kvt__group groups[KVT__MAX_GROUPS];
    kvt__sal_shared sal;
    kvt_seq *seqs; /* live sequences (doubly linked) */
    /* Parallelism (kvt_ctx_params): global ids = local + offset, for the Philox keys. */
    uint32_t kv_head_offset, n_kv_heads_global, layer_offset;
};

typedef struct kvt__layer_state {
    kvt__sal sal;
    kvt__ev ev;
} kvt__layer_state;

struct kvt_seq {
    kvt_ctx *ctx;
    kvt_seq *prev, *next;
    uint64_t request_id;
    uint64_t philox_key;
    uint64_t n_tokens;    /* committed */
    uint32_t n_pending;   /* reserved, not committed */
    uint64_t prompt_rows;
    kvt__ptable pt[KVT__MAX_GROUPS];
    kvt__layer_state *layers; /* [n_layers] */
};

/* Record a detail message on the context and return s. */
kvt_status kvt__ctx_fail(const kvt_ctx *ctx, kvt_status s, const char *fmt, ...) KVT__PRINTF(3, 4);
void kvt__ctx_clear_error(const kvt_ctx *ctx);
kvt__env kvt__ctx_env(const kvt_ctx *ctx, const kvt_seq *seq, void *stream);
/* A caller's config (any supported struct_size) checked and normalised into *out (may be NULL
 * to check only); the message names the field in err. */
kvt_status kvt__config_in(const kvt_config *user, kvt_config *out, char *err, size_t len);

#endif
