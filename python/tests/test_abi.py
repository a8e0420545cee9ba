"""The ctypes mirrors of kvtier.h's (and kvtier_trace.h's) structs against a C compiler's view of the real header:
every field's offset and every struct's size, and the KVT_*_SIZE_MIN constants."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

import kvtier
from kvtier import _lib, trace

REPO = Path(__file__).resolve().parents[2]

STRUCTS = {
    "kvt_layer_spec": _lib.LayerSpecC, "kvt_census_totals": _lib.CensusTotalsC,
    "kvt_config": _lib.ConfigC, "kvt_ctx_params": _lib.CtxParamsC,
    "kvt_seq_params": _lib.SeqParamsC, "kvt_emit": _lib.EmitC,
    "kvt_layer_stats": _lib.LayerStatsC, "kvt_ref_attn_args": _lib.RefAttnArgsC,
    "kvt_ctx_memory": _lib.CtxMemoryC, "kvt_recall_basis_info": _lib.RecallBasisInfoC,
    "kvt_trace_meta": trace.MetaC, "kvt_trace_needle": trace.NeedleC,
    "kvt_trace_target": trace.TargetC, "kvt_trace_layer": trace.LayerInfoC,
}
MINS = {"KVT_CONFIG_SIZE_MIN": _lib.CONFIG_SIZE_MIN,
        "KVT_CTX_PARAMS_SIZE_MIN": _lib.CTX_PARAMS_SIZE_MIN,
        "KVT_SEQ_PARAMS_SIZE_MIN": _lib.SEQ_PARAMS_SIZE_MIN,
        "KVT_LAYER_STATS_SIZE_MIN": _lib.LAYER_STATS_SIZE_MIN,
        "KVT_CTX_MEMORY_SIZE_MIN": _lib.CTX_MEMORY_SIZE_MIN,
        "KVT_EMIT_SIZE_MIN": _lib.EMIT_SIZE_MIN,
        "KVT_MAX_QUERIES_PER_SEQ": _lib.MAX_QUERIES_PER_SEQ,
        "KVT_TRACE_FORMAT_MAJOR": trace.FORMAT_MAJOR,
        "KVT_TRACE_FORMAT_MINOR": trace.FORMAT_MINOR,
        "KVT_TRACE_SECTION_USER": trace.SECTION_USER,
        "KVT_RECALL_MAX_RANK": _lib.RECALL_MAX_RANK,
        "KVT_SNAPSHOT_STALE_SECONDS": _lib.SNAPSHOT_STALE_SECONDS}


def test_struct_layouts_match_the_c_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.fail("no C compiler to compare the struct layouts with")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvtier_ref.h"',
             '#include "kvtier_trace.h"',
             "int main(void) {"]
    for cname, cls in STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for f, _ in cls._fields_:
            lines.append(f'printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));')
    for name in MINS:
        lines.append(f'printf("{name} %zu\\n", (size_t){name});')
    lines += ['printf("KVT_VERSION_NUMBER %d\\n", KVT_VERSION_NUMBER);', "return 0; }"]
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "abi"
    subprocess.run([cc, "-std=c11", "-I", str(REPO / "lib"), str(src), "-o", str(exe)],
                   check=True)
    got = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        *key, value = line.split()
        got[" ".join(key)] = int(value)
    for cname, cls in STRUCTS.items():
        assert got[f"{cname} sizeof"] == ctypes.sizeof(cls), cname
        for f, _ in cls._fields_:
            assert got[f"{cname} {f}"] == getattr(cls, f).offset, f"{cname}.{f}"
    for name, value in MINS.items():
        assert got[name] == value, name
    assert got["KVT_VERSION_NUMBER"] == kvtier.version_number()


def test_default_structs_carry_this_size():
    assert _lib.lib.kvt_config_default().struct_size == ctypes.sizeof(_lib.ConfigC)
    assert _lib.lib.kvt_ctx_default_params().struct_size == ctypes.sizeof(_lib.CtxParamsC)
    assert _lib.lib.kvt_seq_default_params().struct_size == ctypes.sizeof(_lib.SeqParamsC)
