"""Loading libkvtier.so and declaring its public C API (lib/kvtier.h, lib/kvtier_ref.h) for ctypes.

Nothing here is compiled: the structs below mirror the C layouts field for field (ctypes applies
the platform's C alignment rules), and tests/test_abi.py compares every offset and size with
what a C compiler says about the installed header.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# Locating the library
# ---------------------------------------------------------------------------------------------
ENV_LIBRARY = "KVTIER_LIBRARY"


def _candidates() -> list[Path]:
    """Where libkvtier.so may be, in the order tried.

    1. $KVTIER_LIBRARY (a file, or a folder holding libkvtier.so): an explicit choice wins;
    2. inside the installed package: kvtier/lib/libkvtier.so, where the wheel's CMake install
       puts it (kvtier/lib64 on distributions whose GNUInstallDirs say lib64);
    3. next to the package: kvtier/libkvtier.so, then the package's parent folder.
    """
    out: list[Path] = []
    env = os.environ.get(ENV_LIBRARY)
    if env:
        p = Path(env)
        out.append(p / "libkvtier.so" if p.is_dir() else p)
        return out  # explicit: no silent fallback to another copy
    for sub in ("lib", "lib64"):
        out.append(_HERE / sub / "libkvtier.so")
    out.append(_HERE / "libkvtier.so")
    out.append(_HERE.parent / "libkvtier.so")
    return out


def _load() -> tuple[ctypes.CDLL, Path]:
    tried = []
    for path in _candidates():
        if not path.is_file():
            tried.append(f"{path} (absent)")
            continue
        try:
            return ctypes.CDLL(str(path)), path
        except OSError as e:  # e.g. "cannot allocate memory in static TLS block"
            tried.append(f"{path} ({e})")
            if os.environ.get(ENV_LIBRARY):
                break
    raise ImportError(
        "kvtier: cannot load libkvtier.so; tried: " + "; ".join(tried) +
        f". Install the package with `pip install ./python` or set {ENV_LIBRARY} to the library "
        "built by CMake (e.g. build/libkvtier.so).")


lib, library_path = _load()

# ---------------------------------------------------------------------------------------------
# C types
# ---------------------------------------------------------------------------------------------
c_enum = ctypes.c_int  # every kvtier enum fits an int (gcc/clang on Linux: 4 bytes)
c_status = ctypes.c_int
c_u32 = ctypes.c_uint32
c_u64 = ctypes.c_uint64
c_i32 = ctypes.c_int32
c_size = ctypes.c_size_t
c_vp = ctypes.c_void_p
c_cp = ctypes.c_char_p
P = ctypes.POINTER


class LayerSpecC(ctypes.Structure):
    _fields_ = [
        ("kind", c_enum),
        ("dtype", c_enum),
        ("n_kv_heads", c_u32),
        ("n_planes", c_u32),
        ("head_dim", c_u32),
        ("value_dim", c_u32),
        ("branch_dim", c_u32),
        ("row_bytes", c_u32),
        ("branch_offset", c_u32),
        ("branch_dtype", c_enum),
        ("sliding_window", c_u32),
        ("n_q_heads", c_u32),
    ]


class CensusTotalsC(ctypes.Structure):
    _fields_ = [
        ("kv_bytes_per_token", c_u64),
        ("dense_bytes", c_u64),
        ("attended_bytes", c_u64),
        ("freed_bytes", c_u64),
        ("salience_layers", c_u64),
        ("evict_layers", c_u64),
        ("none_layers", c_u64),
        ("no_kv_layers", c_u64),
    ]


class ConfigC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size),
        ("ratio", c_u32),
        ("block_rows", c_u32),
        ("kappa", c_u32),
        ("sink_rows", c_u32),
        ("evict_budget_rows", c_u32),
        ("recent_rows", c_u32),
        ("cadence_rows", c_u32),
        ("protect_prompt", ctypes.c_bool),
        ("evict_archive", ctypes.c_bool),
        ("evict_shared_draw", ctypes.c_bool),
        ("evict_vase", ctypes.c_bool),
        ("seed", c_u64),
        ("recall", c_enum),
        ("selector", c_enum),
        ("recall_cap_rows", c_u32),
        ("recall_margin", ctypes.c_float),
        ("salience_budget", ctypes.c_bool),
        ("budget_min_kept", c_u32),
        ("sigma_basis", c_enum),
        ("recall_promote_capacity", c_u32),
        ("recall_promote_hits", c_u32),
        ("recall_promote_window", c_u32),
        ("recall_lagged_query", ctypes.c_bool),
        ("evict_ratio_budget", ctypes.c_bool),
    ]


class CtxParamsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size),
        ("model", c_vp),
        ("config", P(ConfigC)),
        ("page_rows", c_u32),
        ("n_pages", c_u32),
        ("backend", c_enum),
        ("allocator", c_enum),
        ("external_storage", ctypes.c_bool),
        ("layer_policies", P(c_enum)),
        ("kv_head_offset", c_u32),
        ("n_kv_heads_global", c_u32),
        ("layer_offset", c_u32),
        ("max_rows_per_seq", c_u32),
        ("archive_rows_per_seq", c_u32),
        ("max_seqs", c_u32),
        ("recall_sketch_rank", c_u32),
        ("archive_space", c_enum),
        ("recall_scan_bits", c_u32),
    ]


class SeqParamsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size),
        ("request_id", c_u64),
        ("prompt_rows", c_u64),
        ("ratio", c_u32),
        ("recall", c_i32),
    ]


class EmitC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size),
        ("layout", c_enum),
        ("indices", P(c_i32)),
        ("capacity", c_u32),
        ("lengths", P(c_i32)),
        ("indptr", P(c_i32)),
        ("dense", P(ctypes.c_uint8)),
        ("queries_per_seq", c_u32),
        ("flags", c_u64),
        ("last_page_len", P(c_i32)),
    ]


class LayerStatsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size),
        ("policy", c_enum),
        ("appended_rows", c_u64),
        ("attended_rows", c_u64),
        ("sink_rows", c_u64),
        ("kept_rows", c_u64),
        ("tail_rows", c_u64),
        ("archived_rows", c_u64),
        ("dropped_rows", c_u64),
        ("closed_rows", c_u64),
        ("closes", c_u64),
        ("rounds", c_u64),
        ("nonfinite_sigma", c_u64),
        ("sigma_bytes_read", c_u64),
        ("pages_in_use", c_u64),
        ("bytes_in_use", c_u64),
        ("archive_bytes", c_u64),
        ("prompt_rows", c_u64),
        ("prompt_over_budget", ctypes.c_bool),
        ("attended_bytes_per_token", ctypes.c_double),
        ("recall_rank", c_u32),
        ("recall_basis_id", c_u32),
        ("sketched_rows", c_u64),
        ("shared_pages", c_u64),
        ("recall_mode", c_i32),
        ("recall_phase", c_i32),
        ("recall_z", ctypes.c_float),
        ("recall_samples", c_u32),
        ("recall_steps", c_u64),
        ("recall_calib_steps", c_u64),
        ("recall_overflow_steps", c_u64),
        ("recall_visited_rows", c_u64),
        ("recall_fired_rows", c_u64),
        ("recall_fetched_rows", c_u64),
        ("recall_last_archived", c_u64),
        ("recall_last_visited", c_u64),
        ("recall_last_fired", c_u64),
        ("recall_last_fetched", c_u64),
        ("recall_last_dense", ctypes.c_bool),
        ("recall_last_overflow", ctypes.c_bool),
        ("effective_ratio", ctypes.c_double),
        ("side_bytes", c_u64),
        ("shared_side_bytes", c_u64),
        ("recall_promoted", c_u64),
        ("recall_promote_room", c_u64),
        ("recall_promotions", c_u64),
        ("recall_demotions", c_u64),
        ("recall_absorbed", c_u64),
        ("recall_last_promoted", c_u64),
        ("recall_last_lagged", ctypes.c_bool),
        ("archive_space", ctypes.c_int32),
        ("recall_moved_bytes", c_u64),
        ("recall_last_moved_bytes", c_u64),
    ]


class CtxMemoryC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size),
        ("requests", c_u64),
        ("pages_in_use", c_u64),
        ("shared_pages", c_u64),
        ("bytes_in_use", c_u64),
        ("shared_bytes", c_u64),
        ("side_bytes", c_u64),
        ("shared_side_bytes", c_u64),
        ("archive_device_bytes", c_u64),
        ("archive_host_bytes", c_u64),
    ]


class CtxEstimateGroupC(ctypes.Structure):
    _fields_ = [
        ("policy", c_enum),
        ("n_layers", c_u32),
        ("row_bytes", c_u64),
        ("page_bytes", c_u64),
        ("pool_bytes", c_u64),
        ("pages_needed", c_u64),
        ("side_bytes_per_seq", c_u64),
        ("archive_bytes_per_seq", c_u64),
    ]


class CtxEstimateOutC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size),
        ("n_groups", c_u32),
        ("groups", CtxEstimateGroupC * 3),
        ("n_pages_needed", c_u32),
        ("pool_bytes", c_u64),
        ("pool_bytes_needed", c_u64),
        ("side_bytes", c_u64),
        ("archive_bytes", c_u64),
    ]


class RecallBasisInfoC(ctypes.Structure):
    _fields_ = [
        ("layer", c_u32),
        ("rank", c_u32),
        ("dim", c_u32),
        ("captured", ctypes.c_double),
        ("samples", c_u64),
        ("id", c_u32),
    ]


class RefAttnArgsC(ctypes.Structure):
    _fields_ = [
        ("base", c_vp),
        ("slots", P(c_i32)),
        ("n_rows", c_u32),
        ("slot_stride", c_size),
        ("row_offset", c_size),
        ("dtype", c_enum),
        ("key_dim", c_u32),
        ("value_dim", c_u32),
        ("q", P(ctypes.c_float)),
        ("n_heads", c_u32),
        ("q_stride", c_size),
        ("scale", ctypes.c_double),
        ("mark", P(ctypes.c_uint8)),
        ("out", P(ctypes.c_float)),
        ("mark_mass", P(ctypes.c_double)),
        ("lse", P(ctypes.c_double)),
        ("scratch", P(ctypes.c_double)),
    ]


# The oldest layouts the library reads or writes (KVT_*_SIZE_MIN in kvtier.h): offsetof(last
# field of that layout) + its size. Python always sends its full struct (struct_size = sizeof),
# which is at least these; they are kept here for the ABI test and for documentation.
CONFIG_SIZE_MIN = ConfigC.selector.offset + ctypes.sizeof(c_enum)
CTX_PARAMS_SIZE_MIN = CtxParamsC.layer_policies.offset + ctypes.sizeof(P(c_enum))
SEQ_PARAMS_SIZE_MIN = SeqParamsC.recall.offset + ctypes.sizeof(c_i32)
EMIT_SIZE_MIN = EmitC.dense.offset + ctypes.sizeof(P(ctypes.c_uint8))
MAX_QUERIES_PER_SEQ = 256  # KVT_MAX_QUERIES_PER_SEQ
LAYER_STATS_SIZE_MIN = (LayerStatsC.attended_bytes_per_token.offset +
                        ctypes.sizeof(ctypes.c_double))
CTX_MEMORY_SIZE_MIN = CtxMemoryC.shared_side_bytes.offset + ctypes.sizeof(c_u64)

# ---------------------------------------------------------------------------------------------
# Function signatures: name -> (restype, argtypes). Every public function of kvtier.h and
# kvtier_ref.h is declared here; a missing symbol fails the import with its name.
# ---------------------------------------------------------------------------------------------
_SIGNATURES = {
    # statuses and version
    "kvt_strerror": (c_cp, [c_status]),
    "kvt_status_name": (c_cp, [c_status]),
    "kvt_version": (c_cp, [P(ctypes.c_int), P(ctypes.c_int), P(ctypes.c_int)]),
    "kvt_version_number": (ctypes.c_int, []),
    "kvt_last_error": (c_cp, []),
    # layer description
    "kvt_policy_for_kind": (c_enum, [c_enum]),
    "kvt_layer_kind_name": (c_cp, [c_enum]),
    "kvt_policy_name": (c_cp, [c_enum]),
    "kvt_recall_mode_name": (c_cp, [c_enum]),
    "kvt_dtype_name": (c_cp, [c_enum]),
    "kvt_dtype_bytes": (c_u32, [c_enum]),
    "kvt_layer_spec_mla": (c_status, [c_enum, c_enum, c_u32, c_u32, P(LayerSpecC)]),
    "kvt_layer_spec_gqa": (c_status, [c_enum, c_enum, c_u32, c_u32, P(LayerSpecC)]),
    "kvt_layer_spec_check": (c_status, [P(LayerSpecC), c_cp, c_size]),
    "kvt_layer_bytes_per_token": (c_u64, [P(LayerSpecC)]),
    # model and census
    "kvt_model_create": (c_status, [P(LayerSpecC), c_u32, c_cp, P(c_vp), c_cp, c_size]),
    "kvt_model_from_file": (c_status, [c_cp, c_enum, P(c_vp), c_cp, c_size]),
    "kvt_model_from_json": (c_status, [c_cp, c_size, c_enum, P(c_vp), c_cp, c_size]),
    "kvt_model_destroy": (None, [c_vp]),
    "kvt_model_n_layers": (c_u32, [c_vp]),
    "kvt_model_layer": (P(LayerSpecC), [c_vp, c_u32]),
    "kvt_model_type": (c_cp, [c_vp]),
    "kvt_model_kv_bytes_per_token": (c_u64, [c_vp]),
    "kvt_model_census": (c_status, [c_vp, c_u64, c_u64, ctypes.c_double, P(CensusTotalsC)]),
    "kvt_model_census_shared": (c_status, [c_vp, c_u64, c_u64, ctypes.c_double, c_u64,
                                           P(CensusTotalsC)]),
    # configuration
    "kvt_config_default": (ConfigC, []),
    "kvt_config_init": (c_status, [P(ConfigC), c_size]),
    "kvt_config_check": (c_status, [P(ConfigC), c_cp, c_size]),
    # context
    "kvt_ctx_default_params": (CtxParamsC, []),
    "kvt_ctx_params_init": (c_status, [P(CtxParamsC), c_size]),
    "kvt_ctx_create": (c_status, [P(CtxParamsC), P(c_vp), c_cp, c_size]),
    "kvt_ctx_create_default": (c_status, [c_vp, P(c_vp), c_cp, c_size]),
    "kvt_ctx_destroy": (None, [c_vp]),
    "kvt_ctx_model": (c_vp, [c_vp]),
    "kvt_ctx_config": (P(ConfigC), [c_vp]),
    "kvt_ctx_backend_name": (c_cp, [c_vp]),
    "kvt_ctx_allocator_name": (c_cp, [c_vp]),
    "kvt_ctx_layer_policy": (c_enum, [c_vp, c_u32]),
    "kvt_ctx_layer_group": (c_i32, [c_vp, c_u32]),
    "kvt_ctx_host_allocations": (c_u64, [c_vp]),
    "kvt_ctx_free_pages": (c_status, [c_vp, c_u32, P(c_u32)]),
    "kvt_ctx_memory_stats": (c_status, [c_vp, P(CtxMemoryC)]),
    "kvt_ctx_estimate": (c_status, [P(CtxParamsC), P(CtxEstimateOutC), c_cp, c_size]),
    "kvt_ctx_set_recall_basis": (c_status, [c_vp, c_u32, P(ctypes.c_float), c_u32]),
    "kvt_ctx_refit_recall_basis": (c_status, [c_vp, c_u32, P(ctypes.c_float), c_u32, c_u32, c_vp]),
    "kvt_ctx_refit_recall_head_basis": (c_status, [c_vp, c_u32, c_u32, P(ctypes.c_float), c_u32,
                                                   c_u32, c_vp]),
    "kvt_ctx_set_recall_head_basis": (c_status, [c_vp, c_u32, c_u32, P(ctypes.c_float), c_u32]),
    "kvt_ctx_load_recall_basis": (c_status, [c_vp, c_u32, ctypes.c_char_p]),
    "kvt_ctx_load_recall_head_basis": (c_status, [c_vp, c_u32, c_u32, ctypes.c_char_p]),
    "kvt_ctx_recall_head_basis": (c_status, [c_vp, c_u32, c_u32, P(c_u32), P(c_u32)]),
    "kvt_ctx_recall_basis": (c_status, [c_vp, c_u32, P(c_u32), P(c_u32)]),
    "kvt_orthonormalise_rows": (c_status, [P(ctypes.c_double), c_u32, c_u32, c_u32]),
    "kvt_recall_basis_write": (c_status, [c_cp, P(RecallBasisInfoC), P(ctypes.c_float)]),
    "kvt_recall_basis_read": (c_status, [c_cp, P(RecallBasisInfoC), P(ctypes.c_float), c_size]),
    "kvt_layer_data": (c_status, [c_vp, c_u32, c_u32, P(c_vp), P(c_size)]),
    "kvt_layer_read": (c_status, [c_vp, c_u32, c_u32, c_u64, c_u64, c_vp, c_size]),
    "kvt_layer_write": (c_status, [c_vp, c_u32, c_u32, c_u64, c_u64, c_vp, c_size]),
    "kvt_layer_bind": (c_status, [c_vp, c_u32, c_u32, c_vp, c_size]),
    # sequences
    "kvt_seq_default_params": (SeqParamsC, []),
    "kvt_seq_params_init": (c_status, [P(SeqParamsC), c_size]),
    "kvt_seq_create": (c_status, [c_vp, P(SeqParamsC), P(c_vp)]),
    "kvt_seq_destroy": (None, [c_vp]),
    "kvt_seq_set_prompt_rows": (c_status, [c_vp, c_u64]),
    "kvt_seq_length": (c_u64, [c_vp]),
    "kvt_seq_context": (c_vp, [c_vp]),
    "kvt_seq_request_id": (c_u64, [c_vp]),
    "kvt_seq_pending": (c_u32, [c_vp]),
    "kvt_seq_pages_needed": (c_status, [c_vp, c_u32, P(c_u32)]),
    "kvt_seq_reserved_slot": (c_status, [c_vp, c_u32, c_u32, P(c_i32)]),
    "kvt_seq_write": (c_status, [c_vp, c_u32, c_u32, c_u32, c_u32, c_vp, c_size]),
    "kvt_seq_fork": (c_status, [c_vp, c_u64, P(c_vp)]),
    "kvt_seq_attach": (c_status, [c_vp, c_u64, c_u64, P(c_vp)]),
    # batches
    "kvt_batch_create": (c_status, [c_vp, c_u32, P(c_vp)]),
    "kvt_batch_destroy": (None, [c_vp]),
    "kvt_batch_reserve": (c_status, [c_vp, P(c_vp), P(c_u32), c_u32]),
    "kvt_batch_reserve_drafts": (c_status, [c_vp, P(c_vp), P(c_u32), P(c_u32), c_u32]),
    "kvt_buffer_alloc": (c_status, [c_vp, c_size, P(c_vp)]),
    "kvt_buffer_free": (None, [c_vp]),
    "kvt_buffer_ptr": (c_vp, [c_vp]),
    "kvt_buffer_size": (c_size, [c_vp]),
    "kvt_buffer_write": (c_status, [c_vp, c_size, c_vp, c_size]),
    "kvt_buffer_read": (c_status, [c_vp, c_size, c_vp, c_size]),
    "kvt_buffer_write_async": (c_status, [c_vp, c_size, c_vp, c_size, c_vp]),
    "kvt_buffer_read_async": (c_status, [c_vp, c_size, c_vp, c_size, c_vp]),
    "kvt_batch_slot_mapping": (c_status, [c_vp, c_u32, P(c_i32), c_u32, P(c_u32)]),
    "kvt_batch_slot_mapping64": (c_status, [c_vp, c_u32, P(ctypes.c_int64), c_u32, P(c_u32)]),
    "kvt_batch_plan": (c_status, [c_vp]),
    "kvt_batch_plan_device": (c_status, [c_vp, P(EmitC), c_u32, c_vp, P(ctypes.c_bool)]),
    "kvt_batch_capacity": (c_status, [c_vp, c_u32, P(c_u32), P(c_u32)]),
    "kvt_batch_emit_fits": (c_status, [c_vp, c_u32, c_enum, P(ctypes.c_bool)]),
    "kvt_batch_run": (c_status, [c_vp, c_u32, c_vp, c_vp, P(EmitC)]),
    "kvt_batch_commit": (c_status, [c_vp, P(c_u32)]),
    "kvt_seq_block_table": (c_status, [c_vp, c_u32, P(c_i32), c_u32, P(c_u32), P(c_u64)]),
    "kvt_seq_first_row": (c_status, [c_vp, c_u32, P(c_u64)]),
    # rows by position, statistics, invariants
    "kvt_seq_row_state": (c_status, [c_vp, c_u32, c_u32, c_u64, P(c_enum), P(c_i32)]),
    "kvt_seq_read_row": (c_status, [c_vp, c_u32, c_u32, c_u32, c_u64, c_vp, c_size]),
    "kvt_seq_positions": (c_status, [c_vp, c_u32, c_u32, P(ctypes.c_int64), c_u64, P(c_u64)]),
    "kvt_seq_last_slot_map": (c_status, [c_vp, c_u32, c_u32, P(c_i32), c_u64, P(c_u64)]),
    "kvt_seq_layer_stats": (c_status, [c_vp, c_u32, P(LayerStatsC)]),
    "kvt_seq_check": (c_status, [c_vp]),
    "kvt_seq_scores": (c_status, [c_vp, c_u32, P(ctypes.c_float), c_u64, P(c_u64)]),
    # snapshots
    "kvt_seq_snapshot_size": (c_status, [c_vp, P(c_size)]),
    "kvt_seq_snapshot": (c_status, [c_vp, c_vp, c_size, P(c_size)]),
    "kvt_seq_restore": (c_status, [c_vp, c_vp, c_size, P(c_vp)]),
    "kvt_seq_snapshot_file": (c_status, [c_vp, c_cp]),
    "kvt_seq_restore_file": (c_status, [c_vp, c_cp, P(c_vp)]),
    "kvt_snapshot_clean": (c_status, [c_cp, c_u32, P(c_u32)]),
    "kvt_snapshot_context": (c_status, [c_vp, c_size, c_enum, P(c_vp)]),
    # kvtier_ref.h
    "kvt_ref_load": (ctypes.c_float, [c_vp, c_enum, c_u32]),
    "kvt_ref_store": (None, [c_vp, c_enum, c_u32, ctypes.c_float]),
    "kvt_ref_sigma_create": (c_status, [c_u32, c_u32, c_u32, P(c_vp)]),
    "kvt_ref_sigma_create_basis": (c_status, [c_u32, c_u32, c_u32, c_enum, P(c_vp)]),
    "kvt_ref_sigma_destroy": (None, [c_vp]),
    "kvt_ref_sigma_basis": (P(ctypes.c_float), [c_vp, P(c_u32)]),
    "kvt_ref_sigma_block": (c_status, [c_vp, c_vp, c_size, c_u32, c_enum, P(ctypes.c_float)]),
    "kvt_ref_attn_scratch_doubles": (c_size, [c_u32, c_u32, c_u32, c_u32]),
    "kvt_ref_attn": (c_status, [P(RefAttnArgsC)]),
}

for _name, (_res, _args) in _SIGNATURES.items():
    _f = getattr(lib, _name)  # AttributeError names the missing symbol
    _f.restype = _res
    _f.argtypes = _args

REF_ATTN_DEFAULT_SCALE = 0.07216878364870322  # KVT_REF_ATTN_DEFAULT_SCALE, 192^-1/2
REF_ATTN_MAX_DIM = 4096  # KVT_REF_ATTN_MAX_DIM
RECALL_MAX_RANK = 256  # KVT_RECALL_MAX_RANK
SNAPSHOT_STALE_SECONDS = 60  # KVT_SNAPSHOT_STALE_SECONDS


def last_error() -> str:
    return (lib.kvt_last_error() or b"").decode("utf-8", "replace")
