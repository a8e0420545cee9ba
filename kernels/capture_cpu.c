/*
 * capture_cpu.c — the capture of the CPU backends (kvt__backend_ops.capture_begin): a record of
 * planned packs, their arguments by value, as a CUDA graph's kernel nodes keep theirs; replayed
 * through the handle's pack op (the guarded one checks every buffer again at each launch). Any
 * other op during a capture is refused, and the capture with it: its host-built arguments are one
 * step's.
 */
#include "kernels/cpu_internal.h"
#include "lib/base/base.h"

typedef struct captured_op {
    int kind; /* the op: pack, recall_step, recall_rope_{step,emit} */
    union {
        kvt__pack_args pack;
        kvt__recall_plan_args recall;
        kvt__recall_rope_plan_args rope;
    } u;
} captured_op;

struct kvt__capture { /* also the graph capture_end hands out (never refused then) */
    captured_op *ops;
    uint64_t n, cap;
    bool refused;
};

bool kvt__cpu_capturing(const kvt__backend *be) {
    if (!be->cap)
        return false;
    be->cap->refused = true;
    return true;
}

/* One op into the record (kind CAP_*, its arguments, which hold nothing of one step). */
kvt_status kvt__cpu_capture_op(const kvt__backend *be, int kind, const void *args) {
    kvt__capture *c = be->cap;
    const kvt__pack_args *pack = kind == CAP_PACK ? args : NULL;
    void *arr = c->ops;
    if (kvt__grow(be->alloc, &arr, &c->cap, c->n + 1, sizeof *c->ops) != KVT_OK) {
        c->refused = true; /* a graph without this op would replay a wrong step */
        return KVT_ERR_OUT_OF_MEMORY;
    }
    c->ops = arr;
    captured_op *o = &c->ops[c->n++];
    o->kind = kind;
    if (kind == CAP_PACK)
        o->u.pack = *pack;
    else if (kind == CAP_RECALL)
        o->u.recall = *(const kvt__recall_plan_args *)args;
    else
        o->u.rope = *(const kvt__recall_rope_plan_args *)args;
    return KVT_OK;
}

void kvt__cpu_graph_free(const kvt__backend *be, void *graph) {
    kvt__capture *g = graph;
    if (!g)
        return;
    kvt__free(be->alloc, g->ops, sizeof *g->ops * g->cap);
    kvt__free(be->alloc, g, sizeof *g);
}

kvt_status kvt__cpu_capture_begin(kvt__backend *be, void *stream) {
    (void)stream;
    if (be->cap)
        return KVT_ERR_BAD_STATE;
    be->cap = kvt__calloc(be->alloc, sizeof *be->cap);
    return be->cap ? KVT_OK : KVT_ERR_OUT_OF_MEMORY;
}

kvt_status kvt__cpu_capture_end(kvt__backend *be, void *stream, void **graph) {
    (void)stream;
    *graph = NULL;
    kvt__capture *c = be->cap;
    if (!c)
        return KVT_ERR_BAD_STATE;
    be->cap = NULL;
    if (c->refused) {
        kvt__cpu_graph_free(be, c);
        return KVT_ERR_BAD_STATE;
    }
    *graph = c;
    return KVT_OK;
}

kvt_status kvt__cpu_graph_launch(const kvt__backend *be, void *graph, void *stream) {
    NOT_CAPTURED(be);
    const kvt__capture *g = graph;
    if (!g)
        return KVT_ERR_INVALID_ARGUMENT;
    for (uint64_t i = 0; i < g->n; i++) {
        const captured_op *o = &g->ops[i];
        kvt_status s = o->kind == CAP_RECALL ? be->ops->recall_step(be, &o->u.recall, stream)
                       : o->kind == CAP_ROPE_STEP
                           ? be->ops->recall_rope_step(be, &o->u.rope, stream)
                       : o->kind == CAP_ROPE_EMIT
                           ? be->ops->recall_rope_emit(be, &o->u.rope, stream)
                           : be->ops->pack(be, &o->u.pack, stream);
        if (s != KVT_OK)
            return s;
    }
    return KVT_OK;
}
