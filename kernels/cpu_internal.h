/*
 * cpu_internal.h — what the CPU backend (backend_cpu.c), its capture (capture_cpu.c) and the
 * guarded backend (backend_guarded.c) share: the CPU workspace, the CPU ops the guarded ones call
 * after their checks, and the capture's record. Internal to kernels/.
 */
#ifndef KVT_KERNELS_CPU_INTERNAL_H
#define KVT_KERNELS_CPU_INTERNAL_H

#include "kernels/backend.h"
#include "recall/kernels/recall_step.h"
#include "recall/kernels/rope_trigger.h"

/* The CPU backend's workspace (be->impl when opened with kvt__backend_cpu_open): grow-only
 * scratch of σ and top-m, sized once from the context's stated limits so that no op allocates in
 * a steady state. Each batch has its own (kvt__backend_cpu_workspace), so the ops of two batches
 * may run at once. A backend without one (impl NULL, as tests build them) allocates per call. */
typedef struct cpu_ws {
    float *sigma;
    uint64_t sigma_cap;
    uint32_t *topm;
    uint64_t topm_cap;
} cpu_ws;

/* The guarded backend's close (backend_guarded.c); kvt__backend_cpu_close calls it for a guarded
 * handle. */
void kvt__guarded_close(kvt__backend *be);

/* ---------------------------------------------------------------------------------------------
 * The capture (capture_cpu.c). kvt__cpu_capturing: whether a capture is in progress, refusing it
 * (any op but a planned one called during a capture makes it refused); NOT_CAPTURED returns
 * KVT_ERR_BAD_STATE from such an op. kvt__cpu_capture_op records a planned op (kind CAP_*).
 * ------------------------------------------------------------------------------------------- */
enum { CAP_PACK, CAP_RECALL, CAP_ROPE_STEP, CAP_ROPE_EMIT };
bool kvt__cpu_capturing(const kvt__backend *be);
kvt_status kvt__cpu_capture_op(const kvt__backend *be, int kind, const void *args);

#define NOT_CAPTURED(be)                                                                           \
    do {                                                                                           \
        if (kvt__cpu_capturing(be))                                                                \
            return KVT_ERR_BAD_STATE;                                                              \
    } while (0)

kvt_status kvt__cpu_capture_begin(kvt__backend *be, void *stream);
kvt_status kvt__cpu_capture_end(kvt__backend *be, void *stream, void **graph);
kvt_status kvt__cpu_graph_launch(const kvt__backend *be, void *graph, void *stream);
void kvt__cpu_graph_free(const kvt__backend *be, void *graph);

/* ---------------------------------------------------------------------------------------------
 * The CPU backend's ops (backend_cpu.c), as its table holds them (kvt__backend_ops in backend.h
 * for each one's contract).
 * ------------------------------------------------------------------------------------------- */
kvt_status kvt__cpu_score_rows(const kvt__backend *be, const kvt__score_args *a, uint32_t n,
                               void *stream);
kvt_status kvt__cpu_sketch_rows(const kvt__backend *be, const kvt__sketch_args *a, uint32_t n,
                                void *stream);
kvt_status kvt__cpu_recall_scan(const kvt__backend *be, const kvt__recall_scan_args *a, uint32_t n,
                                void *stream);
kvt_status kvt__cpu_recall_step(const kvt__backend *be, const kvt__recall_plan_args *a,
                                void *stream);
kvt_status kvt__cpu_recall_rope_step(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                     void *stream);
kvt_status kvt__cpu_recall_rope_emit(const kvt__backend *be, const kvt__recall_rope_plan_args *a,
                                     void *stream);
kvt_status kvt__cpu_attend(const kvt__backend *be, const kvt__attend_args *a, void *stream);
kvt_status kvt__cpu_ev_select(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                              void *stream);
kvt_status kvt__cpu_ev_apply(const kvt__backend *be, const kvt__ev_args *a, uint32_t n,
                             void *stream);
kvt_status kvt__cpu_ev_append(const kvt__backend *be, const kvt__ev_append_args *a, uint32_t n,
                              void *stream);
kvt_status kvt__cpu_find_pos(const kvt__backend *be, const int64_t *sorted, const uint64_t *perm,
                             uint64_t n, uint64_t key, int64_t *out);
kvt_status kvt__cpu_copy(const kvt__backend *be, void *dst, const void *src, size_t bytes,
                         void *stream);
kvt_status kvt__cpu_copy_rows(const kvt__backend *be, void *dst, size_t dst_stride, const void *src,
                              size_t src_stride, size_t width, uint64_t n, void *stream);
kvt_status kvt__cpu_select(const kvt__backend *be, kvt__select_args *args, uint32_t n_args,
                           void *stream);
kvt_status kvt__cpu_pack(const kvt__backend *be, const kvt__pack_args *a, void *stream);

#endif /* KVT_KERNELS_CPU_INTERNAL_H */
