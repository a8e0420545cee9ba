"""kvtier_trace.h: the kvtier trace format through the C library's own writer and reader (no
second implementation of the format here). An engine dumps its layers' rows, queries and
needle annotations with ``TraceWriter``; ``Trace`` reads a file back (the needle suite,
``kvtier-needle --trace``, is the C consumer).

>>> with kvtier.trace.TraceWriter("x.kvtt", n_model_layers=18, prompt_rows=21,
...                               text="model=gemma-3-270m\\n") as w:
...     w.layer(5, spec)                       # spec: kvtier.LayerSpec (GQA: planes K=0, V=1)
...     w.rows(5, 0, k_rows); w.rows(5, 1, v_rows)   # [tokens, n_kv_heads, head_dim]
...     w.queries(5, positions, q)             # [steps, n_q_heads, dim] float32
...     w.needles([(5, first_row, n_rows)]); w.targets([(step, needle, [heads])])
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from ._api import LayerSpec, _Closable, _Handle, _errbuf
from ._errors import ERROR_CLASSES, Status, check
from ._lib import P, c_cp, c_enum, c_size, c_status, c_u32, c_u64, c_vp, lib
from ._types import DType, as_array, contiguous, ptr, to_enum, u32, u64

FORMAT_MAJOR = 1  # KVT_TRACE_FORMAT_MAJOR
FORMAT_MINOR = 0  # KVT_TRACE_FORMAT_MINOR
SECTION_USER = 0x10000  # KVT_TRACE_SECTION_USER: the first section type a user may write


class MetaC(ctypes.Structure):
    _fields_ = [("prompt_rows", c_u64), ("n_model_layers", c_u32), ("text", c_cp)]


class NeedleC(ctypes.Structure):
    _fields_ = [("layer", c_u32), ("first_row", c_u64), ("n_rows", c_u64)]


class TargetC(ctypes.Structure):
    _fields_ = [("step", c_u64), ("needle", c_u32), ("n_heads", c_u32), ("heads", P(c_u32))]


class LayerInfoC(ctypes.Structure):
    _fields_ = [("layer", c_u32), ("spec", _lib.LayerSpecC), ("n_tokens", c_u64),
                ("n_steps", c_u64), ("q_dtype", c_enum), ("n_q_heads", c_u32), ("q_dim", c_u32)]


_SIGNATURES = {
    "kvt_trace_writer_open": (c_status, [c_cp, P(MetaC), P(c_vp), c_cp, c_size]),
    "kvt_trace_write_layer": (c_status, [c_vp, c_u32, P(_lib.LayerSpecC)]),
    "kvt_trace_write_rows": (c_status, [c_vp, c_u32, c_u32, c_vp, c_u64, c_size]),
    "kvt_trace_write_queries": (c_status, [c_vp, c_u32, c_enum, c_u32, c_u32, P(c_u64), c_vp,
                                           c_u64, c_size]),
    "kvt_trace_write_needles": (c_status, [c_vp, P(NeedleC), c_u32]),
    "kvt_trace_write_targets": (c_status, [c_vp, P(TargetC), c_u32]),
    "kvt_trace_write_section": (c_status, [c_vp, c_u32, ctypes.c_bool, c_vp, c_size]),
    "kvt_trace_writer_last_error": (c_cp, [c_vp]),
    "kvt_trace_writer_close": (c_status, [c_vp, c_cp, c_size]),
    "kvt_trace_writer_abort": (None, [c_vp]),
    "kvt_trace_open": (c_status, [c_cp, P(c_vp), c_cp, c_size]),
    "kvt_trace_close": (None, [c_vp]),
    "kvt_trace_last_error": (c_cp, [c_vp]),
    "kvt_trace_prompt_rows": (c_u64, [c_vp]),
    "kvt_trace_n_model_layers": (c_u32, [c_vp]),
    "kvt_trace_text": (c_cp, [c_vp, P(c_size)]),
    "kvt_trace_n_layers": (c_u32, [c_vp]),
    "kvt_trace_format_version": (None, [c_vp, P(c_u32), P(c_u32)]),
    "kvt_trace_layer_info": (c_status, [c_vp, c_u32, P(LayerInfoC)]),
    "kvt_trace_find_layer": (c_status, [c_vp, c_u32, P(LayerInfoC)]),
    "kvt_trace_query_position": (c_status, [c_vp, c_u32, c_u64, P(c_u64)]),
    "kvt_trace_read_rows": (c_status, [c_vp, c_u32, c_u32, c_u64, c_u64, c_vp, c_size]),
    "kvt_trace_read_query": (c_status, [c_vp, c_u32, c_u64, c_enum, c_vp, c_size, P(c_u64)]),
    "kvt_trace_needles": (P(NeedleC), [c_vp, P(c_u32)]),
    "kvt_trace_targets": (P(TargetC), [c_vp, P(c_u32)]),
    "kvt_trace_verify": (c_status, [c_vp]),
}
for _name, (_res, _args) in _SIGNATURES.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


def _s(b) -> str:
    return (b or b"").decode("utf-8", "replace")


def _check(status, fn, last_error, handle):
    """Raise status with the handle's last-error message (the trace calls keep theirs per
    handle, not in kvt_last_error)."""
    if status:
        check(status, fn, ctypes.create_string_buffer(last_error(handle) or b""))


class TraceWriter(_Closable):
    """kvt_trace_writer: the file is valid once ``close()`` succeeds (a ``with`` block that
    raises aborts it: the file is removed). Every call raises the library's status with its
    message on error."""

    _kind = "trace writer"

    def __init__(self, path, n_model_layers: int, prompt_rows: int = 0, text: str | None = None):
        self._text = None if text is None else text.encode("utf-8")
        meta = MetaC(u64(prompt_rows, "prompt_rows"), u32(n_model_layers, "n_model_layers"),
                     self._text)
        out, err = c_vp(), _errbuf()
        check(lib.kvt_trace_writer_open(str(path).encode(), ctypes.byref(meta), ctypes.byref(out),
                                        err, len(err)), "kvt_trace_writer_open", err)
        self._h = _Handle(out.value, lib.kvt_trace_writer_abort)
        self._specs: dict[int, LayerSpec] = {}

    def _check(self, status, fn):
        _check(status, fn, lib.kvt_trace_writer_last_error, self._ptr)

    def layer(self, layer: int, spec: LayerSpec) -> None:
        c = spec._to_c()
        self._check(lib.kvt_trace_write_layer(self._ptr, u32(layer, "layer"), ctypes.byref(c)),
                    "kvt_trace_write_layer")
        self._specs[layer] = spec

    def rows(self, layer: int, plane: int, rows) -> None:
        """rows: [tokens, n_kv_heads, row elements] (or any C-contiguous array whose bytes are
        tokens x n_kv_heads x row_bytes) of the layer's dtype."""
        spec = self._specs.get(layer)
        if spec is None:
            raise ValueError(f"layer {layer} not declared")
        arr = contiguous(as_array(rows, "rows"), "rows")
        per = spec.n_kv_heads * spec.row_bytes
        if arr.nbytes % per:
            raise ValueError(f"rows: {arr.nbytes} bytes is not a whole number of {per}-byte "
                             "tokens")
        self._check(lib.kvt_trace_write_rows(self._ptr, u32(layer, "layer"), u32(plane, "plane"),
                                             ptr(arr), arr.nbytes // per, arr.nbytes),
                    "kvt_trace_write_rows")

    def queries(self, layer: int, positions, q, dtype=DType.FP32) -> None:
        """q: [steps, n_q_heads, dim] float32 (or bf16 as uint16 with dtype=BF16); positions:
        [steps] rows existing when each query is issued."""
        dt = to_enum(DType, dtype, "dtype")
        arr = contiguous(as_array(q, "q"), "q")
        if arr.ndim != 3:
            raise ValueError(f"q: expected [steps, heads, dim], got shape {arr.shape}")
        pos = np.ascontiguousarray(positions, dtype=np.uint64)
        if pos.shape != (arr.shape[0],):
            raise ValueError(f"positions: {pos.shape}, expected ({arr.shape[0]},)")
        self._check(lib.kvt_trace_write_queries(
            self._ptr, u32(layer, "layer"), int(dt), arr.shape[1], arr.shape[2],
            pos.ctypes.data_as(P(c_u64)), ptr(arr), arr.shape[0], arr.nbytes),
            "kvt_trace_write_queries")

    def needles(self, needles) -> None:
        """needles: (layer, first_row, n_rows) each; a needle's id is its index."""
        arr = (NeedleC * max(1, len(needles)))(*[NeedleC(u32(a, "layer"), u64(b, "first_row"),
                                                        u64(c, "n_rows")) for a, b, c in needles])
        self._check(lib.kvt_trace_write_needles(self._ptr, arr, len(needles)),
                    "kvt_trace_write_needles")

    def targets(self, targets) -> None:
        """targets: (step, needle id, [query heads]) each."""
        keep = [(c_u32 * max(1, len(h)))(*[u32(x, "head") for x in h]) for _, _, h in targets]
        arr = (TargetC * max(1, len(targets)))(*[
            TargetC(u64(s, "step"), u32(n, "needle"), len(h), hk)
            for (s, n, h), hk in zip(targets, keep)])
        self._check(lib.kvt_trace_write_targets(self._ptr, arr, len(targets)),
                    "kvt_trace_write_targets")

    def section(self, type: int, payload=b"", critical: bool = False) -> None:
        """kvt_trace_write_section: a section of the writer's own type (>= SECTION_USER) holding
        payload (bytes or a C-contiguous array's bytes). Readers that do not know the type skip
        it, unless ``critical``: then they refuse the file (UnsupportedError)."""
        if isinstance(payload, (bytes, bytearray, memoryview)):
            data = np.frombuffer(payload, dtype=np.uint8)
        else:
            data = contiguous(as_array(payload, "payload"), "payload")
        self._check(lib.kvt_trace_write_section(self._ptr, u32(type, "type"), bool(critical),
                                                ptr(data) if data.nbytes else None, data.nbytes),
                    "kvt_trace_write_section")

    def close(self) -> None:
        """kvt_trace_writer_close: END section, flush; raises on a (sticky) I/O error."""
        h, self._h = self._h, None
        if h is None or not h.live:
            return
        p, h.ptr = h.ptr, None
        err = _errbuf()
        check(lib.kvt_trace_writer_close(p, err, len(err)), "kvt_trace_writer_close", err)

    def abort(self) -> None:
        """kvt_trace_writer_abort: close without finalising and remove the file."""
        super().close()

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            self.abort()
        else:
            self.close()
        return False


class Trace(_Closable):
    """kvt_trace: a trace file opened for reading (CRCs of the small sections checked)."""

    _kind = "trace"

    def __init__(self, path):
        out, err = c_vp(), _errbuf()
        check(lib.kvt_trace_open(str(path).encode(), ctypes.byref(out), err, len(err)),
              "kvt_trace_open", err)
        self._h = _Handle(out.value, lib.kvt_trace_close)

    def _check(self, status, fn):
        _check(status, fn, lib.kvt_trace_last_error, self._ptr)

    @property
    def format_version(self) -> tuple[int, int]:
        """kvt_trace_format_version: (major, minor) of the file."""
        a, b = c_u32(), c_u32()
        lib.kvt_trace_format_version(self._ptr, ctypes.byref(a), ctypes.byref(b))
        return int(a.value), int(b.value)

    @property
    def prompt_rows(self) -> int:
        return int(lib.kvt_trace_prompt_rows(self._ptr))

    @property
    def n_model_layers(self) -> int:
        return int(lib.kvt_trace_n_model_layers(self._ptr))

    @property
    def text(self) -> str:
        return _s(lib.kvt_trace_text(self._ptr, None))

    @staticmethod
    def _layer_dict(c: LayerInfoC) -> dict:
        return {"layer": c.layer, "spec": LayerSpec._from_c(c.spec), "n_tokens": c.n_tokens,
                "n_steps": c.n_steps, "q_dtype": DType(c.q_dtype) if c.n_steps else None,
                "n_q_heads": c.n_q_heads, "q_dim": c.q_dim}

    def layers(self) -> list[dict]:
        out = []
        for i in range(lib.kvt_trace_n_layers(self._ptr)):
            c = LayerInfoC()
            self._check(lib.kvt_trace_layer_info(self._ptr, i, ctypes.byref(c)),
                        "kvt_trace_layer_info")
            out.append(self._layer_dict(c))
        return out

    def find_layer(self, layer: int) -> dict:
        """kvt_trace_find_layer: the entry of layers() for model layer ``layer``;
        OutOfRangeError when the trace does not carry it."""
        c = LayerInfoC()
        self._check(lib.kvt_trace_find_layer(self._ptr, u32(layer, "layer"), ctypes.byref(c)),
                    "kvt_trace_find_layer")
        return self._layer_dict(c)

    def query_position(self, layer: int, step: int) -> int:
        """kvt_trace_query_position: rows existing when query step ``step`` of a layer was
        issued. OutOfRangeError for an untraced layer or a step past its steps."""
        pos = c_u64()
        self._check(lib.kvt_trace_query_position(self._ptr, u32(layer, "layer"),
                                                 u64(step, "step"), ctypes.byref(pos)),
                    "kvt_trace_query_position")
        return int(pos.value)

    def _info(self, layer):
        try:
            return self.find_layer(layer)
        except ERROR_CLASSES[Status.ERR_OUT_OF_RANGE]:
            raise KeyError(f"layer {layer} is not in the trace") from None

    def read_rows(self, layer: int, plane: int, first: int, n: int) -> np.ndarray:
        """Rows [first, first + n) of a plane as raw bytes [n, n_kv_heads, row_bytes]."""
        sp = self._info(layer)["spec"]
        out = np.empty((u64(n, "n"), sp.n_kv_heads, sp.row_bytes), np.uint8)
        self._check(lib.kvt_trace_read_rows(self._ptr, u32(layer, "layer"), u32(plane, "plane"),
                                            u64(first, "first"), n, ptr(out), out.nbytes),
                    "kvt_trace_read_rows")
        return out

    def read_query(self, layer: int, step: int) -> tuple[np.ndarray, int]:
        """(query [n_q_heads, dim] float32, position) of one step."""
        info = self._info(layer)
        out = np.empty((info["n_q_heads"], info["q_dim"]), np.float32)
        pos = c_u64()
        self._check(lib.kvt_trace_read_query(self._ptr, u32(layer, "layer"), u64(step, "step"),
                                             int(DType.FP32), ptr(out), out.nbytes,
                                             ctypes.byref(pos)), "kvt_trace_read_query")
        return out, int(pos.value)

    def needles(self) -> list[tuple[int, int, int]]:
        n = c_u32()
        p = lib.kvt_trace_needles(self._ptr, ctypes.byref(n))
        return [(p[i].layer, p[i].first_row, p[i].n_rows) for i in range(n.value)]

    def targets(self) -> list[tuple[int, int, list[int]]]:
        n = c_u32()
        p = lib.kvt_trace_targets(self._ptr, ctypes.byref(n))
        return [(p[i].step, p[i].needle, [p[i].heads[j] for j in range(p[i].n_heads)])
                for i in range(n.value)]

    def verify(self) -> None:
        """kvt_trace_verify: every CRC of the file, streaming."""
        self._check(lib.kvt_trace_verify(self._ptr), "kvt_trace_verify")
