"""The handle classes: Model, Context, Sequence, Batch (kvtier.h) over ctypes.

Ownership. Every C handle lives in a small ``_Handle`` object that frees it exactly once:
explicitly (``close()``, the end of a ``with`` block) or when the last Python reference goes.
A sequence's or batch's handle holds a strong reference to its context's handle, so the C context
outlives them under reference counting, and shares the context's liveness token, so that in a
collected reference cycle (finalized in any order) a child never frees itself after its context.
kvt_ctx_destroy destroys the context's live batches and sequences itself, so ``Context.close()``
first marks them closed (no double free) and then destroys the context. Zero-copy views of a context's
memory (``Context.plane``) also hold the context's handle: if one is still alive
at ``close()``, the C context is destroyed when the last of them goes.
"""

from __future__ import annotations

import ctypes
import json
import os
import weakref
from typing import Iterable, Sequence as _Seq

import numpy as np

from . import _lib
from ._errors import check
from ._lib import lib
from ._arrays import (DL_CPU, DL_CUDA, BF16, DeviceArray, MemorySpaceError, PlaneView,
                      array_ref, device_name)
from ._types import (Allocator, Space, Backend, DType, EmitFlag, EmitLayout, LayerKind, Policy,
                     RecallMode, RowState, Selector, SigmaBasis, as_array, as_output,
                     element_dtype_ok, maybe_enum, ptr, numpy_dtype, to_enum, typed_input, u32,
                     u64, integer, contiguous)

_ERR_LEN = 512


def _errbuf():
    return ctypes.create_string_buffer(_ERR_LEN)


def _str(p) -> str:
    return (p or b"").decode("utf-8", "replace")


class _Handle:
    """One C handle and how to free it.

    A child (sequence, batch, borrowed model) holds its context's handle in ``parent``, so the C
    context outlives it under reference counting, and shares the context's ``token``: a one-item
    list that is set False when the context is closed or destroyed. A child frees itself only
    while the token is True. This keeps frees single and ordered even when the garbage collector
    finalizes a reference cycle, where CPython calls the finalizers of every unreachable object
    in arbitrary order (PEP 442) and clears weak references before doing so.
    """

    __slots__ = ("ptr", "destroy", "parent", "token", "pins")

    def __init__(self, p: int, destroy, parent: "_Handle | None" = None):
        self.ptr = p
        self.destroy = destroy
        self.parent = parent
        self.token = parent.token if parent is not None else [True]
        self.pins = []  # host memory the C handle uses (kvt_layer_bind): dropped after it

    @property
    def live(self) -> bool:
        return bool(self.ptr) and (self.parent is None or self.token[0])

    def release(self) -> None:
        p, self.ptr = self.ptr, None
        parent, self.parent = self.parent, None
        if p and self.destroy is not None:
            if parent is None:  # a root (context, model, sigma): its children are gone with it
                self.token[0] = False
                self.destroy(p)
            elif self.token[0]:  # a child whose context is still there
                self.destroy(p)
        self.pins = []
        del parent  # the context may go now

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: never raise from a finalizer
            pass


class _Closable:
    _h: _Handle | None = None
    _kind = "handle"

    @property
    def _ptr(self) -> int:
        h = self._h
        if h is None or not h.live:
            raise ValueError(f"this {self._kind} is closed")
        return h.ptr

    @property
    def closed(self) -> bool:
        return self._h is None or not self._h.live

    def close(self) -> None:
        h, self._h = self._h, None
        if h is not None:
            h.release()

    def __enter__(self):
        self._ptr  # refuse a closed handle
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ---------------------------------------------------------------------------------------------
# Version and names
# ---------------------------------------------------------------------------------------------
def version() -> str:
    """kvt_version: "MAJOR.MINOR.PATCH" of the loaded library."""
    return _str(lib.kvt_version(None, None, None))


def version_info() -> tuple[int, int, int]:
    a, b, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    lib.kvt_version(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c))
    return a.value, b.value, c.value


def version_number() -> int:
    """kvt_version_number: MAJOR * 10000 + MINOR * 100 + PATCH of the loaded library."""
    return lib.kvt_version_number()


def last_error() -> str:
    """kvt_last_error: detail of the calling thread's last failing call ("" after a success)."""
    return _lib.last_error()


def policy_for_kind(kind) -> Policy:
    return maybe_enum(Policy, lib.kvt_policy_for_kind(int(to_enum(LayerKind, kind, "kind"))))


def layer_kind_name(kind) -> str:
    return _str(lib.kvt_layer_kind_name(integer(kind, "kind", "i32")))


def policy_name(policy) -> str:
    return _str(lib.kvt_policy_name(integer(policy, "policy", "i32")))


def recall_mode_name(mode) -> str:
    """kvt_recall_mode_name: "off", "conformal", "sound", "margin" ("unknown" otherwise)."""
    return _str(lib.kvt_recall_mode_name(integer(mode, "mode", "i32")))


def dtype_name(dtype) -> str:
    return _str(lib.kvt_dtype_name(integer(dtype, "dtype", "i32")))


def dtype_bytes(dtype) -> int:
    """Bytes of one element (fp8: 1); 0 for an unknown dtype."""
    return lib.kvt_dtype_bytes(integer(dtype, "dtype", "i32"))


# ---------------------------------------------------------------------------------------------
# Layer specs
# ---------------------------------------------------------------------------------------------
_SPEC_ENUMS = {"kind": LayerKind, "dtype": DType, "branch_dtype": DType}


class LayerSpec:
    """kvt_layer_spec: one layer's cache geometry. Fields as in kvtier.h; enums as
    :class:`LayerKind` / :class:`DType` (raw ints when a value is not a known member)."""

    __slots__ = tuple(name for name, _ in _lib.LayerSpecC._fields_)

    def __init__(self, **fields):
        for name, _ in _lib.LayerSpecC._fields_:
            setattr(self, name, 0)
        for name, value in fields.items():
            if name not in self.__slots__:
                raise TypeError(f"LayerSpec has no field {name!r}")
            setattr(self, name, value)

    @classmethod
    def _from_c(cls, c: _lib.LayerSpecC) -> "LayerSpec":
        s = cls()
        for name, _ in _lib.LayerSpecC._fields_:
            v = getattr(c, name)
            setattr(s, name, maybe_enum(_SPEC_ENUMS[name], v) if name in _SPEC_ENUMS else v)
        return s

    def _to_c(self) -> _lib.LayerSpecC:
        c = _lib.LayerSpecC()
        for name, _ in _lib.LayerSpecC._fields_:
            kind = "i32" if name in _SPEC_ENUMS else "u32"
            setattr(c, name, integer(getattr(self, name), f"LayerSpec.{name}", kind))
        return c

    @classmethod
    def _made_by(cls, function: str, kind, dtype, **dims) -> "LayerSpec":
        """A spec filled by kvt_layer_spec_mla / kvt_layer_spec_gqa (kind, dtype, two dims)."""
        c = _lib.LayerSpecC()
        args = [u32(v, k) for k, v in dims.items()]
        check(getattr(lib, function)(int(to_enum(LayerKind, kind, "kind")),
                                     int(to_enum(DType, dtype, "dtype")), *args,
                                     ctypes.byref(c)), function)
        return cls._from_c(c)

    @classmethod
    def mla(cls, kind=LayerKind.MLA_NOPE, dtype=DType.BF16, kv_lora_rank: int = 512,
            rope_dim: int = 64) -> "LayerSpec":
        """kvt_layer_spec_mla: 1 head, 1 plane, kv_lora_rank + rope_dim values."""
        return cls._made_by("kvt_layer_spec_mla", kind, dtype, kv_lora_rank=kv_lora_rank,
                            rope_dim=rope_dim)

    @classmethod
    def gqa(cls, kind=LayerKind.GQA_ROPE, dtype=DType.BF16, n_kv_heads: int = 8,
            head_dim: int = 128) -> "LayerSpec":
        """kvt_layer_spec_gqa: 2 planes (K, V), n_kv_heads rows of head_dim values."""
        return cls._made_by("kvt_layer_spec_gqa", kind, dtype, n_kv_heads=n_kv_heads,
                            head_dim=head_dim)

    def check(self) -> None:
        """kvt_layer_spec_check: raises InvalidArgumentError naming the bad field."""
        c = self._to_c()
        err = _errbuf()
        check(lib.kvt_layer_spec_check(ctypes.byref(c), err, _ERR_LEN), "kvt_layer_spec_check",
              err)

    @property
    def bytes_per_token(self) -> int:
        """kvt_layer_bytes_per_token: n_planes * n_kv_heads * row_bytes (0 for no-KV)."""
        c = self._to_c()
        return lib.kvt_layer_bytes_per_token(ctypes.byref(c))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one plane: n_kv_heads * row_bytes."""
        return int(self.n_kv_heads) * int(self.row_bytes)

    @property
    def policy(self) -> Policy:
        return policy_for_kind(self.kind)

    def __eq__(self, other):
        if not isinstance(other, LayerSpec):
            return NotImplemented
        return all(int(getattr(self, n)) == int(getattr(other, n)) for n in self.__slots__)

    def __repr__(self):
        parts = []
        for n in self.__slots__:
            v = getattr(self, n)
            parts.append(f"{n}={v.name if hasattr(v, 'name') else v}")
        return "LayerSpec(" + ", ".join(parts) + ")"


class CensusTotals:
    """kvt_census_totals (see kvt_model_census in kvtier.h)."""

    __slots__ = tuple(n for n, _ in _lib.CensusTotalsC._fields_)

    def __init__(self, c):
        for n in self.__slots__:
            setattr(self, n, int(getattr(c, n)))

    def as_dict(self) -> dict:
        return {n: getattr(self, n) for n in self.__slots__}

    def __repr__(self):
        return "CensusTotals(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class Model(_Closable):
    """kvt_model: an ordered list of layer specs, from a config.json (census) or built by hand.

    ``Model(layers, model_type)`` copies the specs (kvt_model_create); ``Model.from_file(path)``
    and ``Model.from_json(text)`` read a Hugging Face config. Use as a context manager or call
    ``close()``; a context copies the model, so the model may be closed once the context exists.
    """

    _kind = "model"

    def __init__(self, layers: Iterable[LayerSpec], model_type: str = "custom"):
        layers = list(layers)
        for i, s in enumerate(layers):
            if not isinstance(s, LayerSpec):
                raise TypeError(f"layers[{i}]: expected a LayerSpec, got {type(s).__name__}")
        arr = (_lib.LayerSpecC * max(1, len(layers)))(*[s._to_c() for s in layers])
        out = ctypes.c_void_p()
        err = _errbuf()
        check(lib.kvt_model_create(arr if layers else None, len(layers),
                                   model_type.encode() if model_type is not None else None,
                                   ctypes.byref(out), err, _ERR_LEN), "kvt_model_create", err)
        self._h = _Handle(out.value, lib.kvt_model_destroy)

    @classmethod
    def _adopt(cls, p: int, owner: _Handle | None) -> "Model":
        m = cls.__new__(cls)
        # A borrowed model (kvt_ctx_model) is freed by its context, whose handle it pins.
        m._h = _Handle(p, None if owner is not None else lib.kvt_model_destroy, owner)
        return m

    @classmethod
    def from_file(cls, path, dtype=DType.BF16) -> "Model":
        """kvt_model_from_file: census of a config.json; dtype is the cache element type.
        Raises IoError (cannot read) or ParseError (the key named in the message)."""
        out = ctypes.c_void_p()
        err = _errbuf()
        check(lib.kvt_model_from_file(os.fsencode(path), int(to_enum(DType, dtype, "dtype")),
                                      ctypes.byref(out), err, _ERR_LEN), "kvt_model_from_file", err)
        return cls._adopt(out.value, None)

    @classmethod
    def from_json(cls, text, dtype=DType.BF16) -> "Model":
        """kvt_model_from_json: text may be str, bytes or a dict (serialised here)."""
        if isinstance(text, dict):
            text = json.dumps(text)
        if isinstance(text, str):
            text = text.encode()
        if not isinstance(text, (bytes, bytearray)):
            raise TypeError(f"from_json: expected str, bytes or dict, got {type(text).__name__}")
        data = bytes(text)
        out = ctypes.c_void_p()
        err = _errbuf()
        check(lib.kvt_model_from_json(data, len(data), int(to_enum(DType, dtype, "dtype")),
                                      ctypes.byref(out), err, _ERR_LEN), "kvt_model_from_json", err)
        return cls._adopt(out.value, None)

    @property
    def n_layers(self) -> int:
        return lib.kvt_model_n_layers(self._ptr)

    def __len__(self) -> int:
        return self.n_layers

    def layer(self, i: int) -> LayerSpec:
        """A copy of layer i's spec; IndexError when out of range (kvt_model_layer gives NULL)."""
        p = lib.kvt_model_layer(self._ptr, u32(i, "layer")) if 0 <= i < 2**32 else None
        if not p:
            raise IndexError(f"layer {i} out of range ({self.n_layers} layers)")
        return LayerSpec._from_c(p.contents)

    def __getitem__(self, i: int) -> LayerSpec:
        if isinstance(i, int) and i < 0:
            i += self.n_layers
        return self.layer(i)

    @property
    def layers(self) -> list[LayerSpec]:
        return [self.layer(i) for i in range(self.n_layers)]

    @property
    def model_type(self) -> str:
        return _str(lib.kvt_model_type(self._ptr))

    @property
    def kv_bytes_per_token(self) -> int:
        return lib.kvt_model_kv_bytes_per_token(self._ptr)

    def census(self, context: int, concurrency: int = 1, ratio: float = 32.0,
               shared_prefix: int = 0) -> CensusTotals:
        """kvt_model_census at a context length (tokens), concurrency and ratio (>= 1); with
        shared_prefix > 0, kvt_model_census_shared (the requests' first shared_prefix tokens
        held once)."""
        out = _lib.CensusTotalsC()
        args = (self._ptr, u64(context, "context"), u64(concurrency, "concurrency"), float(ratio))
        if u64(shared_prefix, "shared_prefix") == 0:
            check(lib.kvt_model_census(*args, ctypes.byref(out)), "kvt_model_census")
        else:
            check(lib.kvt_model_census_shared(*args, shared_prefix, ctypes.byref(out)),
                  "kvt_model_census_shared")
        return CensusTotals(out)

    def __repr__(self):
        if self.closed:
            return "<kvtier.Model closed>"
        return f"<kvtier.Model {self.model_type!r}: {self.n_layers} layers>"


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
_CONFIG_ENUMS = {"recall": RecallMode, "selector": Selector, "sigma_basis": SigmaBasis}
_CONFIG_BOOLS = ("protect_prompt", "evict_archive", "evict_shared_draw", "evict_vase",
                 "salience_budget", "recall_lagged_query", "evict_ratio_budget")
_CONFIG_KINDS = {"ratio": "u32", "block_rows": "u32", "kappa": "u32", "sink_rows": "u32",
                 "evict_budget_rows": "u32", "recent_rows": "u32", "cadence_rows": "u32",
                 "seed": "u64", "recall_cap_rows": "u32", "budget_min_kept": "u32",
                 "recall_promote_capacity": "u32", "recall_promote_hits": "u32",
                 "recall_promote_window": "u32"}


def _defaults(struct, init):
    """A versioned struct filled with the library's defaults by its _init function: the C
    library writes only ctypes.sizeof(struct) bytes, so a library newer than this mirror (a
    larger struct) cannot overrun it, as returning the struct by value would."""
    out = struct()
    check(init(ctypes.byref(out), ctypes.sizeof(struct)), init.__name__, None)
    return out


class Config:
    """kvt_config: starts from the library's defaults (kvt_config_init, which writes no byte
    past this mirror's size); keyword arguments override fields.

    >>> Config(ratio=8, block_rows=64, kappa=4)
    """

    def __init__(self, **fields):
        object.__setattr__(self, "_c", _defaults(_lib.ConfigC, lib.kvt_config_init))
        for k, v in fields.items():
            setattr(self, k, v)

    @classmethod
    def _from_c(cls, c: _lib.ConfigC) -> "Config":
        cfg = cls()
        ctypes.memmove(ctypes.byref(cfg._c), ctypes.byref(c), ctypes.sizeof(_lib.ConfigC))
        return cfg

    @staticmethod
    def fields() -> list[str]:
        return [n for n, _ in _lib.ConfigC._fields_ if n != "struct_size"]

    def __getattr__(self, name):
        if name in _CONFIG_ENUMS:
            return maybe_enum(_CONFIG_ENUMS[name], getattr(self._c, name))
        if name in _CONFIG_KINDS or name in _CONFIG_BOOLS or name in ("struct_size",
                                                                      "recall_margin"):
            return getattr(self._c, name)
        raise AttributeError(f"Config has no field {name!r}")

    def __setattr__(self, name, value):
        if name in _CONFIG_ENUMS:
            value = int(to_enum(_CONFIG_ENUMS[name], value, f"Config.{name}"))
        elif name in _CONFIG_KINDS:
            value = integer(value, f"Config.{name}", _CONFIG_KINDS[name])
        elif name == "recall_margin":
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating,
                                                                              np.integer)):
                raise TypeError(f"Config.{name}: expected a number, got {type(value).__name__}")
            value = float(value)
        elif name in _CONFIG_BOOLS:
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"Config.{name}: expected a bool, got {type(value).__name__}")
            value = bool(value)
        else:
            raise AttributeError(f"Config has no settable field {name!r}")
        setattr(self._c, name, value)

    def check(self) -> None:
        """kvt_config_check: raises InvalidArgumentError / UnsupportedError naming the field."""
        err = _errbuf()
        check(lib.kvt_config_check(ctypes.byref(self._c), err, _ERR_LEN), "kvt_config_check", err)

    def as_dict(self) -> dict:
        return {n: getattr(self, n) for n in self.fields()}

    def __eq__(self, other):
        return isinstance(other, Config) and self.as_dict() == other.as_dict()

    def __repr__(self):
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"


def config_default() -> Config:
    return Config()


# ---------------------------------------------------------------------------------------------
# Row arrays
# ---------------------------------------------------------------------------------------------
def _rows_input(obj, spec: LayerSpec | None, what: str):
    """Validate rows for one plane: shape (n, ...) whose trailing part is one slot
    (n_kv_heads * row_bytes bytes), dtype uint8 (raw bytes) or the layer's element type,
    C-contiguous. Returns (array, n)."""
    arr = as_array(obj, what)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous (np.ascontiguousarray makes a copy that is)")
    if arr.ndim < 2:
        raise ValueError(f"{what}: expected shape (n_slots, ...) with one slot per leading index, "
                         f"got shape {arr.shape}")
    if spec is None:  # unknown layer: the C call names it; sizes still bound what C reads
        return arr, arr.shape[0]
    if arr.dtype != np.uint8:
        pure = int(spec.row_bytes) == int(spec.head_dim) * dtype_bytes(spec.dtype)
        if not (pure and element_dtype_ok(arr.dtype, spec.dtype)):
            raise TypeError(f"{what}: dtype {arr.dtype} does not match the layer's "
                            f"{dtype_name(spec.dtype)} rows (pass uint8 bytes or the element "
                            "dtype: bf16 as uint16 bits, fp16 as float16, fp32 as float32)")
    per_slot = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.itemsize
    if per_slot != spec.slot_bytes:
        raise ValueError(f"{what}: each slot must be {spec.slot_bytes} bytes "
                         f"({spec.n_kv_heads} heads x {spec.row_bytes} B), shape {arr.shape} of "
                         f"{arr.dtype} gives {per_slot}")
    return arr, arr.shape[0]


def rows_as_elements(raw: np.ndarray, spec: LayerSpec) -> np.ndarray:
    """View raw row bytes (..., row_bytes) as elements (..., head_dim) of the layer's dtype
    (bf16 as uint16 bits). Only for rows that hold nothing but head_dim values."""
    if int(spec.row_bytes) != int(spec.head_dim) * dtype_bytes(spec.dtype):
        raise ValueError("rows of this layer mix element types (e.g. fp8 ds_mla); read bytes")
    from ._types import numpy_dtype
    return np.ascontiguousarray(raw).view(numpy_dtype(spec.dtype))


def _snapshot_bytes(data) -> np.ndarray:
    """A snapshot's bytes as a contiguous uint8 array (bytes, bytearray, memoryview or an
    array; no copy where numpy can view it)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        buf = np.frombuffer(data, dtype=np.uint8)
    else:
        buf = as_array(data, "data")
        if buf.dtype != np.uint8:
            raise TypeError(f"data: expected bytes or a uint8 array, got {buf.dtype}")
    if buf.ndim != 1:
        buf = buf.reshape(-1)
    return np.ascontiguousarray(buf)


def snapshot_clean(directory, min_age_s: int = _lib.SNAPSHOT_STALE_SECONDS) -> int:
    """kvt_snapshot_clean: remove the stale temporaries ("<name>.tmp.XXXXXX") that killed
    snapshot and recall-basis writers left in ``directory`` — regular, empty or starting like a
    kvtier file, unmodified for min_age_s seconds and not locked by a live writer; other files
    are never touched. Returns how many were removed. InvalidArgumentError for an empty path,
    IoError when the folder cannot be listed."""
    n = ctypes.c_uint32()
    check(lib.kvt_snapshot_clean(os.fsencode(directory), u32(min_age_s, "min_age_s"),
                                 ctypes.byref(n)), "kvt_snapshot_clean")
    return int(n.value)


# ---------------------------------------------------------------------------------------------
# Recall bases (files of kvtier-inspect calibrate; docs/recall.md §5)
# ---------------------------------------------------------------------------------------------
def orthonormalise_rows(v, passes: int = 2) -> np.ndarray:
    """kvt_orthonormalise_rows: a copy of v (float64 [rank, n], rank <= n) whose rows are made
    orthonormal by modified Gram-Schmidt in double, ``passes`` times over (2: orthonormal to
    double precision), directions and signs kept. InvalidArgumentError for rows linearly
    dependent to double precision, NaN or Inf, rank > n or passes 0."""
    a = as_array(v, "v")
    if a.ndim != 2:
        raise ValueError(f"v: expected [rank, n], got shape {a.shape}")
    out = np.array(a, dtype=np.float64, order="C", copy=True)
    check(lib.kvt_orthonormalise_rows(ptr(out, ctypes.c_double), u32(out.shape[0], "rank"),
                                      u32(out.shape[1], "n"), u32(passes, "passes")),
          "kvt_orthonormalise_rows")
    return out


class RecallBasis:
    """A recall basis file's contents (kvt_recall_basis_info and V): ``layer`` it was
    calibrated for (informational), ``rank``, ``dim``, ``captured`` (share of the samples'
    energy the rank directions hold; NaN when unknown), ``samples``, ``id`` (CRC-32 of V's
    bytes, the basis id a context reports) and ``v`` (float32 [rank, dim])."""

    __slots__ = ("layer", "rank", "dim", "captured", "samples", "id", "v")

    def __init__(self, layer, rank, dim, captured, samples, id, v):
        self.layer, self.rank, self.dim = layer, rank, dim
        self.captured, self.samples, self.id, self.v = captured, samples, id, v

    def __repr__(self):
        return (f"RecallBasis(layer={self.layer}, rank={self.rank}, dim={self.dim}, "
                f"captured={self.captured}, samples={self.samples}, id={self.id:#010x})")


def recall_basis_write(path, v, layer: int = 0, captured: float = float("nan"),
                       samples: int = 0) -> None:
    """kvt_recall_basis_write: a basis file of v (float32 [rank, dim], rank 1..256), replacing
    any file at path atomically (as Sequence.snapshot_file). InvalidArgumentError (rank or dim
    out of range), IoError."""
    a = typed_input(v, "v", np.float32, ndim=2)
    info = _lib.RecallBasisInfoC(layer=u32(layer, "layer"), rank=u32(a.shape[0], "rank"),
                                 dim=u32(a.shape[1], "dim"), captured=float(captured),
                                 samples=u64(samples, "samples"))
    check(lib.kvt_recall_basis_write(os.fsencode(path), ctypes.byref(info),
                                     ptr(a, ctypes.c_float)), "kvt_recall_basis_write")


def recall_basis_read(path) -> RecallBasis:
    """kvt_recall_basis_read: a basis file with its V. IoError, ParseError, CorruptError (CRC)."""
    info = _lib.RecallBasisInfoC()
    p = os.fsencode(path)
    check(lib.kvt_recall_basis_read(p, ctypes.byref(info), None, 0), "kvt_recall_basis_read")
    v = np.empty((info.rank, info.dim), dtype=np.float32)
    check(lib.kvt_recall_basis_read(p, ctypes.byref(info), ptr(v, ctypes.c_float), v.size),
          "kvt_recall_basis_read")
    return RecallBasis(int(info.layer), int(info.rank), int(info.dim), float(info.captured),
                       int(info.samples), int(info.id), v)


class _PlaneBuffer:
    """Exports a context plane to numpy and pins the context while the view lives."""

    def __init__(self, address: int, shape, owner: _Handle):
        self._owner = owner
        self.__array_interface__ = {"shape": tuple(shape), "typestr": "|u1",
                                    "data": (address, False), "version": 3}


# ---------------------------------------------------------------------------------------------
# Context
# ---------------------------------------------------------------------------------------------
def _ctx_params(model, config=None, page_rows=None, n_pages=None, backend=None,
                allocator=None, external_storage=None, layer_policies=None, kv_head_offset=None,
                n_kv_heads_global=None, layer_offset=None, max_rows_per_seq=None,
                archive_rows_per_seq=None, max_seqs=None, recall_sketch_rank=None,
                archive_space=None, recall_scan_bits=None):
    """kvt_ctx_params from Context's keyword arguments: (the struct, what must outlive it)."""
    if not isinstance(model, Model):
        raise TypeError(f"model: expected a kvtier.Model, got {type(model).__name__}")
    p = _defaults(_lib.CtxParamsC, lib.kvt_ctx_params_init)
    p.model = model._ptr
    if isinstance(config, dict):
        config = Config(**config)
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config: expected a Config, a dict or None, got "
                        f"{type(config).__name__}")
    cfg_c = config._c if config is not None else None
    p.config = ctypes.pointer(cfg_c) if cfg_c is not None else None
    for name, value in (("page_rows", page_rows), ("n_pages", n_pages),
                        ("kv_head_offset", kv_head_offset),
                        ("n_kv_heads_global", n_kv_heads_global),
                        ("layer_offset", layer_offset), ("max_rows_per_seq", max_rows_per_seq),
                        ("archive_rows_per_seq", archive_rows_per_seq),
                        ("max_seqs", max_seqs), ("recall_sketch_rank", recall_sketch_rank),
                        ("recall_scan_bits", recall_scan_bits)):
        if value is not None:
            setattr(p, name, u32(value, name))
    if backend is not None:
        p.backend = int(to_enum(Backend, backend, "backend"))
    if allocator is not None:
        p.allocator = int(to_enum(Allocator, allocator, "allocator"))
    if archive_space is not None:
        p.archive_space = int(to_enum(Space, archive_space, "archive_space"))
    if external_storage is not None:
        p.external_storage = bool(external_storage)
    policies = None
    if layer_policies is not None:
        lp = list(layer_policies)
        # kvt_ctx_create reads exactly n_layers entries: a shorter list would be read past.
        if len(lp) != model.n_layers:
            raise ValueError(f"layer_policies: {len(lp)} entries for a model of "
                             f"{model.n_layers} layers")
        policies = (_lib.c_enum * max(1, len(lp)))(
            *[int(to_enum(Policy, x, f"layer_policies[{i}]")) for i, x in enumerate(lp)])
        p.layer_policies = ctypes.cast(policies, ctypes.POINTER(_lib.c_enum))
    return p, (config, cfg_c, policies)


class Context(_Closable):
    """kvt_ctx: one model, one configuration, one row pool.

    Keyword arguments are the fields of kvt_ctx_params (None: the library's default):
    ``config`` (a Config, a dict of its fields, or None), ``page_rows``, ``n_pages``,
    ``backend`` ("cpu", "guarded", "cuda", "auto" or a Backend), ``allocator`` ("default",
    "libc"), ``external_storage``, ``layer_policies`` (one Policy per layer), ``kv_head_offset``,
    ``n_kv_heads_global``, ``layer_offset``, ``max_rows_per_seq``, ``archive_rows_per_seq``,
    ``max_seqs`` (with max_rows_per_seq: request slots built at creation, reused),
    ``recall_sketch_rank``, ``archive_space`` ("device", "host" or a Space: where random
    eviction's archive keeps its rows), ``recall_scan_bits`` (16, the default, or 8: the recall
    scan reads an 8-bit plane per archived row; docs/recall.md §3.3).
    Asking for "cuda" where it is absent raises NoDeviceError with the library's reason.
    """

    _kind = "context"

    def __init__(self, model: Model, config=None, *, page_rows=None, n_pages=None, backend=None,
                 allocator=None, external_storage=None, layer_policies=None, kv_head_offset=None,
                 n_kv_heads_global=None, layer_offset=None, max_rows_per_seq=None,
                 archive_rows_per_seq=None, max_seqs=None, recall_sketch_rank=None,
                 archive_space=None, recall_scan_bits=None):
        p, _keep = _ctx_params(model, config, page_rows, n_pages, backend, allocator,
                               external_storage, layer_policies, kv_head_offset,
                               n_kv_heads_global, layer_offset, max_rows_per_seq,
                               archive_rows_per_seq, max_seqs, recall_sketch_rank, archive_space,
                               recall_scan_bits)
        out = ctypes.c_void_p()
        err = _errbuf()
        check(lib.kvt_ctx_create(ctypes.byref(p), ctypes.byref(out), err, _ERR_LEN),
              "kvt_ctx_create", err)
        self._h = _Handle(out.value, lib.kvt_ctx_destroy)
        self._page_rows = p.page_rows
        self._n_pages = p.n_pages
        self._describe(out.value)

    @staticmethod
    def estimate(model: Model, config=None, **params) -> dict:
        """kvt_ctx_estimate: the memory Context(model, config, **params) would allocate and the
        pages its requests need, without creating it. ``max_seqs`` and ``max_rows_per_seq`` must
        be given (the requests x rows the pages are for). A dict of kvt_ctx_estimate_out's fields,
        ``groups`` a list of one dict per policy group (``policy`` a Policy, ``n_layers``,
        ``row_bytes``, ``page_bytes``, ``pool_bytes`` at ``n_pages``, ``pages_needed``,
        ``side_bytes_per_seq``, ``archive_bytes_per_seq``). InvalidArgumentError names what is
        missing or what kvt_ctx_create would refuse."""
        p, _keep = _ctx_params(model, config, **params)
        out = _lib.CtxEstimateOutC(struct_size=ctypes.sizeof(_lib.CtxEstimateOutC))
        err = _errbuf()
        check(lib.kvt_ctx_estimate(ctypes.byref(p), ctypes.byref(out), err, _ERR_LEN),
              "kvt_ctx_estimate", err)
        groups = []
        for g in out.groups[:out.n_groups]:
            d = {n: int(getattr(g, n)) for n, _ in _lib.CtxEstimateGroupC._fields_}
            d["policy"] = Policy(d["policy"])
            groups.append(d)
        res = {n: int(getattr(out, n)) for n, _ in _lib.CtxEstimateOutC._fields_
               if n not in ("struct_size", "groups")}
        res["groups"] = groups
        return res

    def _describe(self, p: int) -> None:
        m = lib.kvt_ctx_model(p)
        self._specs = [LayerSpec._from_c(lib.kvt_model_layer(m, i).contents)
                       for i in range(lib.kvt_model_n_layers(m))]
        self._kv_heads = [int(sp.n_kv_heads) for sp in self._specs]
        # Where the backend keeps its memory: "host" (cpu), "device" (cuda: the arrays of a
        # step are device arrays of self._device) or "guarded" (its own buffers only).
        name = _str(lib.kvt_ctx_backend_name(p))
        self._space = {"cpu": "host", "cuda": "device"}.get(name, "guarded")
        self._device = (DL_CPU, 0)
        if self._space == "device":
            from . import cuda
            dev = cuda.current_device()
            self._device = (DL_CUDA, 0 if dev is None else dev)
        elif self._space == "guarded":
            self._device = (0, 0)  # no DLPack device: the host must not touch it

    @classmethod
    def _adopt(cls, p: int, page_rows, n_pages) -> "Context":
        """A Context object for a context the library just created (None: a size not known)."""
        ctx = cls.__new__(cls)
        ctx._h = _Handle(p, lib.kvt_ctx_destroy)
        ctx._page_rows, ctx._n_pages = page_rows, n_pages
        ctx._describe(p)
        return ctx

    @classmethod
    def from_snapshot(cls, data, backend="cpu") -> "Context":
        """kvt_snapshot_context (for tools): a context of the snapshot's own model,
        configuration, page size, policies and parallelism on ``backend``, with just enough pages
        in each pool to restore it (``ctx.restore(data)``: to verify or inspect it). Raises as
        restore's parsing does (ParseError, CorruptError, UnsupportedError) and as
        kvt_ctx_create does. Its ``page_rows`` and ``n_pages`` are None (not known here)."""
        buf = _snapshot_bytes(data)
        out = ctypes.c_void_p()
        check(lib.kvt_snapshot_context(ptr(buf), buf.nbytes,
                                       int(to_enum(Backend, backend, "backend")),
                                       ctypes.byref(out)), "kvt_snapshot_context")
        return cls._adopt(out.value, None, None)

    @classmethod
    def create_default(cls, model: Model) -> "Context":
        """kvt_ctx_create_default: every parameter at its default."""
        if not isinstance(model, Model):
            raise TypeError(f"model: expected a kvtier.Model, got {type(model).__name__}")
        out = ctypes.c_void_p()
        err = _errbuf()
        check(lib.kvt_ctx_create_default(model._ptr, ctypes.byref(out), err, _ERR_LEN),
              "kvt_ctx_create_default", err)
        d = _defaults(_lib.CtxParamsC, lib.kvt_ctx_params_init)
        return cls._adopt(out.value, d.page_rows, d.n_pages)

    # --- description ---------------------------------------------------------------------
    @property
    def model(self) -> Model:
        """The context's own copy of the model (kvt_ctx_model), borrowed: closed with the
        context."""
        return Model._adopt(lib.kvt_ctx_model(self._ptr), self._h)

    @property
    def config(self) -> Config:
        """A copy of the context's configuration (kvt_ctx_config)."""
        return Config._from_c(lib.kvt_ctx_config(self._ptr).contents)

    @property
    def n_layers(self) -> int:
        return len(self._specs)

    @property
    def page_rows(self) -> int | None:
        return self._page_rows

    @property
    def n_pages(self) -> int | None:
        """Pages of each pool as created (None for a context made by from_snapshot, whose
        pools are sized per group)."""
        return self._n_pages

    def layer_spec(self, layer: int) -> LayerSpec:
        return self._specs[layer]

    def _spec_or_none(self, layer) -> LayerSpec | None:
        return self._specs[layer] if isinstance(layer, int) and 0 <= layer < len(self._specs) \
            else None

    @property
    def backend_name(self) -> str:
        return _str(lib.kvt_ctx_backend_name(self._ptr))

    @property
    def allocator_name(self) -> str:
        return _str(lib.kvt_ctx_allocator_name(self._ptr))

    def layer_policy(self, layer: int) -> Policy:
        return maybe_enum(Policy, lib.kvt_ctx_layer_policy(self._ptr, u32(layer, "layer")))

    def layer_group(self, layer: int) -> int:
        """Policy group of a layer; -1 for a no-KV layer (or a layer out of range)."""
        return lib.kvt_ctx_layer_group(self._ptr, u32(layer, "layer"))

    @property
    def host_allocations(self) -> int:
        return lib.kvt_ctx_host_allocations(self._ptr)

    def free_pages(self, layer: int) -> int:
        out = ctypes.c_uint32()
        check(lib.kvt_ctx_free_pages(self._ptr, u32(layer, "layer"), ctypes.byref(out)),
              "kvt_ctx_free_pages")
        return out.value

    def memory(self) -> dict:
        """kvt_ctx_memory_stats: what the live requests hold, shared pages and side planes
        counted once (a dict of its fields)."""
        out = _lib.CtxMemoryC(struct_size=ctypes.sizeof(_lib.CtxMemoryC))
        check(lib.kvt_ctx_memory_stats(self._ptr, ctypes.byref(out)), "kvt_ctx_memory_stats")
        return {n: int(getattr(out, n)) for n, _ in _lib.CtxMemoryC._fields_ if n != "struct_size"}

    def _basis(self, basis, layer, kv_head: bool):
        """basis as a C-contiguous float32 [rank, D] array whose D is what the C call reads a
        row as (value_dim; a head's key basis: head_dim, or value_dim on an MLA-RoPE layer):
        the C library reads rank x D floats, so a narrower array would be read past its end."""
        v = as_array(basis, "basis")
        if v.dtype != np.float32 or v.ndim != 2 or not v.flags.c_contiguous:
            raise TypeError("basis: expected a C-contiguous float32 array [rank, "
                            f"{'D' if kv_head else 'value_dim'}]")
        if isinstance(layer, int) and 0 <= layer < len(self._specs):
            sp = self._specs[layer]
            d = int(sp.head_dim if kv_head and sp.n_planes == 2 else sp.value_dim)
            if v.shape[1] != d:
                raise ValueError(f"basis: {v.shape[1]} columns; layer {layer}'s "
                                 f"{'key' if kv_head else 'value'} rows have {d}")
        return v

    def set_recall_basis(self, layer: int, basis) -> None:
        """kvt_ctx_set_recall_basis: the layer's recall basis, float32 [rank, value_dim] with
        orthonormal rows, before any reserve (a context made with recall_sketch_rank > 0)."""
        v = self._basis(basis, layer, False)
        check(lib.kvt_ctx_set_recall_basis(self._ptr, u32(layer, "layer"),
                                           ptr(v, ctypes.c_float), u32(v.shape[0], "rank")),
              "kvt_ctx_set_recall_basis")

    def refit_recall_basis(self, layer: int, basis, keep_z: bool = False) -> None:
        """kvt_ctx_refit_recall_basis: replace the layer's recall basis between steps while
        requests live (float32 [rank, value_dim], orthonormal rows, the basis's rank): every
        closed row is sketched again, and each recalling request calibrates z again unless
        ``keep_z`` (KVT_REFIT_KEEP_Z); on the backend's default stream."""
        v = self._basis(basis, layer, False)
        check(lib.kvt_ctx_refit_recall_basis(self._ptr, u32(layer, "layer"),
                                             ptr(v, ctypes.c_float), u32(v.shape[0], "rank"),
                                             1 if keep_z else 0, None),
              "kvt_ctx_refit_recall_basis")

    def refit_recall_head_basis(self, layer: int, kv_head: int, basis,
                                keep_z: bool = False) -> None:
        """kvt_ctx_refit_recall_head_basis: replace KV head ``kv_head``'s key basis of an evict
        layer between steps while requests live (float32 [rank, D], the head basis's rank): its
        archived rows are sketched again, and each recalling request calibrates again unless
        ``keep_z``; on the backend's default stream."""
        v = self._basis(basis, layer, True)
        check(lib.kvt_ctx_refit_recall_head_basis(self._ptr, u32(layer, "layer"),
                                                  u32(kv_head, "kv_head"),
                                                  ptr(v, ctypes.c_float),
                                                  u32(v.shape[0], "rank"),
                                                  1 if keep_z else 0, None),
              "kvt_ctx_refit_recall_head_basis")

    def set_recall_head_basis(self, layer: int, kv_head: int, basis) -> None:
        """kvt_ctx_set_recall_head_basis: the key basis of KV head ``kv_head`` of an evict
        (GQA/MHA-RoPE or MLA-RoPE) layer, float32 [rank, D] with orthonormal rows (D = head_dim;
        MLA-RoPE: kv_lora_rank), before any reserve (a context made with recall_sketch_rank > 0;
        its archived keys are sketched on it for the RoPE recall trigger)."""
        v = self._basis(basis, layer, True)
        check(lib.kvt_ctx_set_recall_head_basis(self._ptr, u32(layer, "layer"),
                                                u32(kv_head, "kv_head"), ptr(v, ctypes.c_float),
                                                u32(v.shape[0], "rank")),
              "kvt_ctx_set_recall_head_basis")

    def load_recall_basis(self, layer: int, path) -> None:
        """kvt_ctx_load_recall_basis: a basis file (kvtier-inspect calibrate on an MLA-NoPE
        layer) set as the layer's recall basis; its dim must be the layer's value_dim."""
        check(lib.kvt_ctx_load_recall_basis(self._ptr, u32(layer, "layer"), os.fsencode(path)),
              "kvt_ctx_load_recall_basis")

    def load_recall_head_basis(self, layer: int, kv_head: int, path) -> None:
        """kvt_ctx_load_recall_head_basis: a key basis file (kvtier-inspect calibrate on a RoPE
        layer writes PREFIX.h<H>) set as KV head ``kv_head``'s basis; its dim must be the
        layer's key dim (head_dim; MLA-RoPE: kv_lora_rank)."""
        check(lib.kvt_ctx_load_recall_head_basis(self._ptr, u32(layer, "layer"),
                                                 u32(kv_head, "kv_head"), os.fsencode(path)),
              "kvt_ctx_load_recall_head_basis")

    def recall_basis(self, layer: int) -> tuple[int, int]:
        """kvt_ctx_recall_basis: (rank, id) of a layer's recall basis ((0, 0): none)."""
        r, i = ctypes.c_uint32(), ctypes.c_uint32()
        check(lib.kvt_ctx_recall_basis(self._ptr, u32(layer, "layer"), ctypes.byref(r),
                                       ctypes.byref(i)), "kvt_ctx_recall_basis")
        return int(r.value), int(i.value)

    def recall_head_basis(self, layer: int, kv_head: int) -> tuple[int, int]:
        """kvt_ctx_recall_head_basis: (rank, id) of a KV head's key basis ((0, 0): none)."""
        r, i = ctypes.c_uint32(), ctypes.c_uint32()
        check(lib.kvt_ctx_recall_head_basis(self._ptr, u32(layer, "layer"),
                                            u32(kv_head, "kv_head"), ctypes.byref(r),
                                            ctypes.byref(i)), "kvt_ctx_recall_head_basis")
        return int(r.value), int(i.value)

    # --- planes ------------------------------------------------------------------------
    def layer_data(self, layer: int, plane: int = 0) -> tuple[int, int]:
        """kvt_layer_data: (address, bytes) of a plane, the backend's pointer (a device pointer
        on CUDA; never dereference it on the guarded backend)."""
        base, size = ctypes.c_void_p(), ctypes.c_size_t()
        check(lib.kvt_layer_data(self._ptr, u32(layer, "layer"), u32(plane, "plane"),
                                 ctypes.byref(base), ctypes.byref(size)), "kvt_layer_data")
        return base.value or 0, size.value

    def plane(self, layer: int, plane: int = 0):
        """A zero-copy view [n_pages * page_rows, n_kv_heads, elements] of a plane, typed by the
        layer's dtype: float32, float16, bf16 as uint16 bit patterns (numpy has no bf16),
        fp8 rows and rows that mix types (e.g. fp8 ds_mla) as bytes (uint8, row_bytes). On the
        CPU backend a :class:`PlaneView` (numpy; an engine writes rows at slot_mapping and
        gathers them for attention) that refuses assignments of another dtype instead of
        casting them; on CUDA a :class:`DeviceArray` (``__cuda_array_interface__``, DLPack with
        bf16 as bfloat16: a torch / CuPy tensor of the cache, zero-copy). The view pins the
        context's memory. ValueError on the guarded backend, whose memory the host must not
        touch: use layer_read / layer_write there."""
        if self._space == "guarded":
            raise ValueError(f"plane(): the {self.backend_name} backend's memory is not host "
                             "memory; use layer_read / layer_write")
        address, size = self.layer_data(layer, plane)
        spec = self._specs[layer]
        slots = self._n_pages * self._page_rows if self._n_pages is not None else \
            size // max(1, spec.slot_bytes)
        if slots * spec.slot_bytes != size:
            raise RuntimeError(f"plane(): {size} bytes, expected {slots} slots of "
                               f"{spec.slot_bytes}")
        elem = dtype_bytes(spec.dtype)
        typed = spec.dtype in (DType.BF16, DType.FP16, DType.FP32) and \
            int(spec.row_bytes) == int(spec.head_dim) * elem
        dt = numpy_dtype(spec.dtype) if typed else np.dtype(np.uint8)
        shape = (slots, int(spec.n_kv_heads), int(spec.row_bytes) // dt.itemsize)
        name = BF16 if typed and spec.dtype == DType.BF16 else dt.name
        if self._space == "device":
            def read(out, layer=layer, plane=plane, slots=slots):
                self.layer_read(layer, plane, 0, slots, out=out.view(np.uint8))

            def write(a, layer=layer, plane=plane):
                self.layer_write(layer, plane, 0, a.view(np.uint8).reshape(slots, -1))
            return DeviceArray(address, shape, dt, self._device, self._h, read, write, name)
        raw = np.asarray(_PlaneBuffer(address, (size,), self._h))
        view = raw.view(dt).reshape(shape).view(PlaneView)
        view.kvt_dtype = maybe_enum(DType, int(spec.dtype))
        return view

    def layer_read(self, layer: int, plane: int, first_slot: int, n_slots: int,
                   out=None) -> np.ndarray:
        """kvt_layer_read: n_slots whole slots from first_slot, as uint8 [n, n_kv_heads,
        row_bytes] (or into ``out``: a writable C-contiguous array of exactly those bytes)."""
        spec = self._spec_or_none(layer)
        n = u64(n_slots, "n_slots")
        if out is None:
            shape = (n, int(spec.n_kv_heads), int(spec.row_bytes)) if spec else (n, 0)
            out = np.empty(shape, dtype=np.uint8)
        else:
            if not isinstance(out, np.ndarray) and not hasattr(out, "__array_interface__"):
                raise TypeError("out: expected a numpy array")
            out = np.asarray(out)
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("out: must be writable and C-contiguous")
        check(lib.kvt_layer_read(self._ptr, u32(layer, "layer"), u32(plane, "plane"),
                                 u64(first_slot, "first_slot"), n, ptr(out), out.nbytes),
              "kvt_layer_read")
        return out

    def layer_write(self, layer: int, plane: int, first_slot: int, rows) -> None:
        """kvt_layer_write: rows (n, ...) — one slot per leading index, uint8 bytes or the
        layer's element dtype — into slots [first_slot, first_slot + n)."""
        arr, n = _rows_input(rows, self._spec_or_none(layer), "rows")
        check(lib.kvt_layer_write(self._ptr, u32(layer, "layer"), u32(plane, "plane"),
                                  u64(first_slot, "first_slot"), n, ptr(arr), arr.nbytes),
              "kvt_layer_write")

    def layer_bind(self, layer: int, plane: int, buffer) -> None:
        """kvt_layer_bind (external_storage): the context uses ``buffer`` (a writable,
        C-contiguous host array of at least the plane's bytes) as the plane. The context keeps
        a reference to it until it is closed."""
        ref = self._backend_array(buffer, "buffer", None, writable=True)
        nbytes = int(np.prod(ref.shape, dtype=np.int64)) * ref.dtype.itemsize
        check(lib.kvt_layer_bind(self._ptr, u32(layer, "layer"), u32(plane, "plane"), ref.ptr,
                                 nbytes), "kvt_layer_bind")
        self._h.pins.append(ref.keep)  # the memory must outlive the C context

    def _backend_array(self, obj, what: str, dtype, writable: bool = False):
        """An ArrayRef of obj in this backend's memory space: host memory on the CPU backend,
        device memory of the context's device on CUDA (``__cuda_array_interface__``, DLPack,
        DeviceArray), a DeviceArray of this context's buffers on the guarded backend. Exactly
        dtype (None: any), C-contiguous, writable when asked. MemorySpaceError names both
        spaces."""
        ref = array_ref(obj, what)
        if self._space == "host":
            if not ref.on_host:
                raise MemorySpaceError(f"{what}: {ref.where} memory, but the cpu backend reads "
                                       "and writes host memory")
        elif self._space == "device":
            if ref.device[0] != DL_CUDA:
                raise MemorySpaceError(
                    f"{what}: {ref.where} memory, but the cuda backend reads and writes device "
                    "memory: pass a CUDA array (__cuda_array_interface__ or DLPack: torch, CuPy) "
                    "or one of Batch.emission() / Context.buffer().view()")
            if ref.device[1] is not None and ref.device[1] != self._device[1]:
                raise MemorySpaceError(f"{what}: {ref.where} memory, but the context uses "
                                       f"{device_name(*self._device)}")
        elif not (isinstance(obj, DeviceArray) and obj.device == self._device):
            raise MemorySpaceError(f"{what}: the guarded backend reads and writes only its own "
                                   "buffers (Batch.emission(), Context.buffer().view()), got "
                                   f"{ref.where} memory")
        if dtype is not None and ref.dtype != np.dtype(dtype):
            raise TypeError(f"{what}: dtype must be {np.dtype(dtype)}, got {ref.dtype_name}")
        if not ref.contiguous:
            raise ValueError(f"{what}: must be C-contiguous")
        if writable and not ref.writable:
            raise ValueError(f"{what}: must be writable")
        return ref

    # --- children ------------------------------------------------------------------------
    def sequence(self, request_id: int = 0, prompt_rows: int = 0, ratio: int = 0,
                 recall=None) -> "Sequence":
        return Sequence(self, request_id=request_id, prompt_rows=prompt_rows, ratio=ratio,
                        recall=recall)

    def batch(self, max_seqs: int) -> "Batch":
        return Batch(self, max_seqs)

    def restore(self, data) -> "Sequence":
        """kvt_seq_restore: a new request of this context holding the state of a snapshot
        (bytes, bytearray, memoryview or a uint8 array, as Sequence.snapshot() gives). Its request
        id is the snapshot's. On failure nothing changed: ParseError, CorruptError,
        UnsupportedError (a newer format), MismatchError (another model, configuration, page
        size, policy or parallelism: the message names it), CapacityError, PoolExhaustedError,
        InvalidArgumentError (its request id is live in this context), BadStateError."""
        buf = _snapshot_bytes(data)
        out = ctypes.c_void_p()
        check(lib.kvt_seq_restore(self._ptr, ptr(buf), buf.nbytes, ctypes.byref(out)),
              "kvt_seq_restore")
        return Sequence._adopt_new(self, out.value)

    def restore_file(self, path) -> "Sequence":
        """kvt_seq_restore_file: restore() of the file at path (IoError when unreadable)."""
        out = ctypes.c_void_p()
        check(lib.kvt_seq_restore_file(self._ptr, os.fsencode(path), ctypes.byref(out)),
              "kvt_seq_restore_file")
        return Sequence._adopt_new(self, out.value)

    def buffer(self, nbytes: int) -> "Buffer":
        return Buffer(self, nbytes)

    def close(self) -> None:
        """kvt_ctx_destroy: destroys the context's live batches and sequences too (their Python
        objects become closed). Deferred while a plane view still lives."""
        h, self._h = self._h, None
        if h is None:
            return
        h.token[0] = False  # its batches, sequences and borrowed models are closed now
        del h  # the last reference: kvt_ctx_destroy now (or when the last view goes)

    def __repr__(self):
        if self.closed:
            return "<kvtier.Context closed>"
        return f"<kvtier.Context {self.backend_name}: {self.n_layers} layers>"


# ---------------------------------------------------------------------------------------------
# Sequences
# ---------------------------------------------------------------------------------------------
class LayerStats:
    """kvt_layer_stats (see kvtier.h for each counter)."""

    __slots__ = tuple(n for n, _ in _lib.LayerStatsC._fields_ if n != "struct_size")

    def __init__(self, c):
        for n in self.__slots__:
            v = getattr(c, n)
            if n == "policy":
                v = maybe_enum(Policy, v)
            setattr(self, n, v)

    def as_dict(self) -> dict:
        return {n: getattr(self, n) for n in self.__slots__}

    def __repr__(self):
        return "LayerStats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


class Sequence(_Closable):
    """kvt_seq: one request of a context (kvt_seq_create with kvt_seq_params). A request id
    is unique among the context's live requests (it keys the random draws): InvalidArgumentError
    for one in use; it is free again once its request is closed."""

    _kind = "sequence"

    def __init__(self, ctx: Context, request_id: int = 0, prompt_rows: int = 0, ratio: int = 0,
                 recall=None):
        if not isinstance(ctx, Context):
            raise TypeError(f"ctx: expected a kvtier.Context, got {type(ctx).__name__}")
        sp = _defaults(_lib.SeqParamsC, lib.kvt_seq_params_init)
        sp.request_id = u64(request_id, "request_id")
        sp.prompt_rows = u64(prompt_rows, "prompt_rows")
        sp.ratio = u32(ratio, "ratio")
        sp.recall = -1 if recall is None else int(to_enum(RecallMode, recall, "recall"))
        out = ctypes.c_void_p()
        check(lib.kvt_seq_create(ctx._ptr, ctypes.byref(sp), ctypes.byref(out)),
              "kvt_seq_create")
        self._bind(ctx, out.value)

    def _bind(self, ctx: Context, p: int) -> None:
        """Own a request of ctx: freed by kvt_seq_destroy unless its context went first."""
        self._ctx = ctx
        self._h = _Handle(p, lib.kvt_seq_destroy, ctx._h)
        self.request_id = lib.kvt_seq_request_id(p)  # kept: readable after close()

    @classmethod
    def _adopt_new(cls, ctx: Context, p: int) -> "Sequence":
        """A Sequence object for a request the library just created in ctx (fork, attach,
        restore)."""
        s = cls.__new__(cls)
        s._bind(ctx, p)
        return s

    @property
    def context(self) -> Context:
        return self._ctx

    def _context_ptr(self) -> int | None:
        """kvt_seq_context (for tests: equals the context's handle)."""
        return lib.kvt_seq_context(self._ptr)

    def set_prompt_rows(self, n_rows: int) -> None:
        check(lib.kvt_seq_set_prompt_rows(self._ptr, u64(n_rows, "n_rows")),
              "kvt_seq_set_prompt_rows")

    @property
    def length(self) -> int:
        """Tokens committed so far."""
        return lib.kvt_seq_length(self._ptr)

    def __len__(self) -> int:
        return self.length

    @property
    def pending(self) -> int:
        """Rows reserved for the step in flight (0 between steps)."""
        return lib.kvt_seq_pending(self._ptr)

    def pages_needed(self, n_tokens: int) -> int:
        out = ctypes.c_uint32()
        check(lib.kvt_seq_pages_needed(self._ptr, u32(n_tokens, "n_tokens"), ctypes.byref(out)),
              "kvt_seq_pages_needed")
        return out.value

    def reserved_slot(self, layer: int, i: int) -> int:
        out = ctypes.c_int32()
        check(lib.kvt_seq_reserved_slot(self._ptr, u32(layer, "layer"), u32(i, "i"),
                                        ctypes.byref(out)), "kvt_seq_reserved_slot")
        return out.value

    def write(self, layer: int, plane: int, first: int, rows) -> None:
        """kvt_seq_write: rows (n, ...) for reserved tokens [first, first + n) of one plane."""
        arr, n = _rows_input(rows, self._ctx._spec_or_none(layer), "rows")
        check(lib.kvt_seq_write(self._ptr, u32(layer, "layer"), u32(plane, "plane"),
                                u32(first, "first"), u32(n, "n"), ptr(arr), arr.nbytes),
              "kvt_seq_write")

    def fork(self, request_id: int) -> "Sequence":
        """kvt_seq_fork: a new request sharing every committed row of this one (copy on write).
        InvalidArgumentError when request_id is live in the context (this request's included)."""
        out = ctypes.c_void_p()
        check(lib.kvt_seq_fork(self._ptr, u64(request_id, "request_id"), ctypes.byref(out)),
              "kvt_seq_fork")
        return Sequence._adopt_new(self._ctx, out.value)

    def attach(self, prefix_rows: int, request_id: int) -> "Sequence":
        """kvt_seq_attach: a new request holding this one's first prefix_rows rows (shared).
        InvalidArgumentError when request_id is live in the context."""
        out = ctypes.c_void_p()
        check(lib.kvt_seq_attach(self._ptr, u64(prefix_rows, "prefix_rows"),
                                 u64(request_id, "request_id"), ctypes.byref(out)),
              "kvt_seq_attach")
        return Sequence._adopt_new(self._ctx, out.value)

    def block_table(self, layer: int) -> tuple[np.ndarray, int]:
        """kvt_seq_block_table: (pages int32, n_rows committed) of the layer's group."""
        n_pages, n_rows = ctypes.c_uint32(), ctypes.c_uint64()
        check(lib.kvt_seq_block_table(self._ptr, u32(layer, "layer"), None, 0,
                                      ctypes.byref(n_pages), ctypes.byref(n_rows)),
              "kvt_seq_block_table")
        pages = np.empty(n_pages.value, dtype=np.int32)
        check(lib.kvt_seq_block_table(self._ptr, layer, ptr(pages, ctypes.c_int32), len(pages),
                                      ctypes.byref(n_pages), ctypes.byref(n_rows)),
              "kvt_seq_block_table")
        return pages[:n_pages.value], n_rows.value

    def first_row(self, layer: int) -> int:
        out = ctypes.c_uint64()
        check(lib.kvt_seq_first_row(self._ptr, u32(layer, "layer"), ctypes.byref(out)),
              "kvt_seq_first_row")
        return out.value

    def row_state(self, layer: int, head: int, position: int) -> tuple[RowState, int]:
        """kvt_seq_row_state: (state, slot) — slot -1 unless attended or pending."""
        st, slot = _lib.c_enum(), ctypes.c_int32()
        check(lib.kvt_seq_row_state(self._ptr, u32(layer, "layer"), u32(head, "head"),
                                    u64(position, "position"), ctypes.byref(st),
                                    ctypes.byref(slot)), "kvt_seq_row_state")
        return maybe_enum(RowState, st.value), slot.value

    def read_row(self, layer: int, plane: int, head: int, position: int) -> np.ndarray:
        """kvt_seq_read_row: the row's bytes (uint8, row_bytes). DroppedError for a dropped row."""
        spec = self._ctx._spec_or_none(layer)
        buf = np.empty(int(spec.row_bytes) if spec else 1, dtype=np.uint8)
        check(lib.kvt_seq_read_row(self._ptr, u32(layer, "layer"), u32(plane, "plane"),
                                   u32(head, "head"), u64(position, "position"), ptr(buf),
                                   buf.nbytes), "kvt_seq_read_row")
        return buf

    def positions(self, layer: int, head: int = 0) -> np.ndarray:
        """kvt_seq_positions: original position of each row index of the group (int64)."""
        n = ctypes.c_uint64()
        check(lib.kvt_seq_positions(self._ptr, u32(layer, "layer"), u32(head, "head"), None, 0,
                                    ctypes.byref(n)), "kvt_seq_positions")
        out = np.empty(n.value, dtype=np.int64)
        check(lib.kvt_seq_positions(self._ptr, layer, head, ptr(out, ctypes.c_int64), len(out),
                                    ctypes.byref(n)), "kvt_seq_positions")
        return out

    def last_slot_map(self, layer: int, head: int = 0) -> np.ndarray:
        """kvt_seq_last_slot_map: old row index -> new row index (-1: evicted) of the last
        round. PolicyMismatchError on a layer without eviction rounds."""
        n = ctypes.c_uint64()
        check(lib.kvt_seq_last_slot_map(self._ptr, u32(layer, "layer"), u32(head, "head"), None,
                                        0, ctypes.byref(n)), "kvt_seq_last_slot_map")
        out = np.empty(n.value, dtype=np.int32)
        check(lib.kvt_seq_last_slot_map(self._ptr, layer, head, ptr(out, ctypes.c_int32),
                                        len(out), ctypes.byref(n)), "kvt_seq_last_slot_map")
        return out

    def layer_stats(self, layer: int) -> LayerStats:
        out = _lib.LayerStatsC()
        out.struct_size = ctypes.sizeof(_lib.LayerStatsC)
        check(lib.kvt_seq_layer_stats(self._ptr, u32(layer, "layer"), ctypes.byref(out)),
              "kvt_seq_layer_stats")
        return LayerStats(out)

    def check(self) -> None:
        """kvt_seq_check: InvariantError with the first violation; BadStateError mid-step."""
        check(lib.kvt_seq_check(self._ptr), "kvt_seq_check")

    def scores(self, layer: int) -> np.ndarray:
        """kvt_seq_scores: σ of a salience layer's closed rows by position (float32; a
        non-finite σ reads +inf). Between steps only. PolicyMismatchError for a layer without
        scores."""
        n = ctypes.c_uint64()
        check(lib.kvt_seq_scores(self._ptr, u32(layer, "layer"), None, 0, ctypes.byref(n)),
              "kvt_seq_scores")
        out = np.empty(n.value, dtype=np.float32)
        check(lib.kvt_seq_scores(self._ptr, layer, ptr(out, ctypes.c_float), len(out),
                                 ctypes.byref(n)), "kvt_seq_scores")
        return out[:n.value]

    # --- snapshots ---------------------------------------------------------------------------
    def snapshot_size(self) -> int:
        """kvt_seq_snapshot_size: bytes snapshot() writes now. BadStateError mid-step."""
        n = ctypes.c_size_t()
        check(lib.kvt_seq_snapshot_size(self._ptr, ctypes.byref(n)), "kvt_seq_snapshot_size")
        return n.value

    def snapshot(self) -> bytes:
        """kvt_seq_snapshot: the request's whole state between steps (docs/snapshot-format.md),
        for Context.restore() here or in another context of the same model and configuration.
        The request is not changed. BadStateError mid-step."""
        buf = np.empty(max(1, self.snapshot_size()), dtype=np.uint8)
        n = ctypes.c_size_t()
        check(lib.kvt_seq_snapshot(self._ptr, ptr(buf), buf.nbytes, ctypes.byref(n)),
              "kvt_seq_snapshot")
        return buf[:n.value].tobytes()

    def snapshot_file(self, path) -> None:
        """kvt_seq_snapshot_file: snapshot() into the file at path, atomically (a locked
        temporary next to it, fsync'ed and renamed; a file already there is left as it was on
        failure; mode 0600). IoError with the failing step."""
        check(lib.kvt_seq_snapshot_file(self._ptr, os.fsencode(path)), "kvt_seq_snapshot_file")

    def __repr__(self):
        if self.closed:
            return "<kvtier.Sequence closed>"
        return f"<kvtier.Sequence request {self.request_id}: {self.length} tokens>"


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------
class Emission:
    """What kvt_batch_run wrote, with s_q = ``queries_per_seq`` sets per request (query q = i *
    s_q + t). TOKENS: ``indices`` [n_seqs * s_q, topk] (-1 padded) and ``lengths``
    [n_seqs * s_q], or [n_seqs] with ``flags`` EmitFlag.LENGTHS_PER_SEQ (FlashMLA's
    topk_length); CSR: ``indices`` [capacity] and ``indptr`` [n_seqs * s_q + 1];
    CSR_KV_HEADS: ``indptr`` [n_seqs * n_kv_heads + 1], one list per (request, KV head), and
    ``slots(i, h)`` takes the KV head h in place of the query token; PAGED (FlashInfer's paged
    KV cache, sets of whole pages): ``indices`` [capacity] page ids, ``indptr``
    [n_seqs * s_q + 1] over them and ``last_page_len`` [n_seqs * s_q] (``pages(i, t)``).
    ``dense`` [n_seqs] (uint8) when asked for. ``slots(i, t)`` gives request i's attended
    slots for its query token t (PAGED: every row of its pages, ``page_rows`` given).
    The arrays are numpy arrays on the CPU backend and :class:`DeviceArray` s (or the caller's
    device arrays) on CUDA and guarded: ``slots`` and ``counts`` then read a host copy
    (``host()``), off the decode path.

    An emission passed to ``Batch.run(layer, emission=e)`` is checked once: its kvt_emit is
    built at the first run and reused by every later one (the step's cost in Python: no array
    conversion per call); assigning an array attribute drops it."""

    __slots__ = ("layout", "n_seqs", "queries_per_seq", "flags", "_indices", "_lengths",
                 "_indptr", "_dense", "_last", "_c", "_cp", "_for", "_lists", "_dense_n",
                 "_views")

    def __init__(self, layout, n_seqs, indices, lengths=None, indptr=None, dense=None,
                 queries_per_seq=1, *, last_page_len=None, flags=0):
        # CSR_KV_HEADS: queries_per_seq is the layer's KV heads (the lists per request)
        self.layout, self.n_seqs, self.queries_per_seq = layout, n_seqs, queries_per_seq
        self.flags = EmitFlag(int(flags))
        self._indices, self._lengths, self._indptr, self._dense = indices, lengths, indptr, dense
        self._last = last_page_len
        self._c = self._cp = self._for = None
        self._views = {}

    def _set(name):  # noqa: N805  (a property factory, used in the class body only)
        def get(self):
            return getattr(self, name)

        def put(self, value):
            setattr(self, name, value)
            self._c = self._cp = self._for = None  # re-checked at the next run
            self._views = {}
        return property(get, put)

    indices, lengths, indptr, dense = _set("_indices"), _set("_lengths"), _set("_indptr"), \
        _set("_dense")
    last_page_len = _set("_last")
    del _set

    def _prepare(self, ctx: "Context") -> None:
        """Check the arrays once for ctx's memory space and build the kvt_emit (s_q = 1)."""
        layout = to_enum(EmitLayout, self.layout, "layout")
        tokens, paged = layout == EmitLayout.TOKENS, layout == EmitLayout.PAGED
        refs = {}
        for name, dt in (("indices", np.int32), ("lengths", np.int32), ("indptr", np.int32),
                         ("dense", np.uint8), ("last_page_len", np.int32)):
            v = getattr(self, name)
            if v is not None and (name != "lengths" or tokens) and \
                    (name != "indptr" or not tokens) and (name != "last_page_len" or paged):
                refs[name] = ctx._backend_array(v, f"emission.{name}", dt, writable=True)
        ind = refs["indices"]
        if tokens:
            if "lengths" not in refs or len(ind.shape) != 2:
                raise ValueError("emission: TOKENS needs indices (n, topk) and lengths (n,)")
            lists = min(ind.shape[0], refs["lengths"].shape[0])
        else:
            if "indptr" not in refs or len(ind.shape) != 1:
                raise ValueError("emission: CSR needs one-dimensional indices and an indptr")
            lists = refs["indptr"].shape[0] - 1
            if paged:
                if "last_page_len" not in refs:
                    raise ValueError("emission: PAGED needs last_page_len (one per list)")
                lists = min(lists, refs["last_page_len"].shape[0])
        e = _emit_c(layout, 1, refs, self.flags)
        self._dense_n = refs["dense"].shape[0] if "dense" in refs else None
        self._lists = lists
        self.layout = layout
        self._c, self._cp, self._for = e, ctypes.pointer(e), ctx._h
        self._views = {}

    def _view(self, n: int, qps: int) -> "Emission":
        """The emission of a step of n requests over these arrays (cached per shape)."""
        v = self._views.get((n, qps))
        if v is None:
            v = Emission(self.layout, n, self._indices, self._lengths, self._indptr, self._dense,
                         qps, last_page_len=self._last, flags=self.flags)
            v._c, v._cp, v._for, v._lists, v._dense_n = self._c, self._cp, self._for, \
                self._lists, self._dense_n
            self._views[(n, qps)] = v
        return v

    def host(self) -> "Emission":
        """This emission with host (numpy) arrays: itself when they are, else a copy."""
        arrays = [getattr(self, n) for n in ("indices", "lengths", "indptr", "dense",
                                             "last_page_len")]
        if all(a is None or isinstance(a, np.ndarray) for a in arrays):
            return self
        ind, lengths, indptr, dense, last = [
            None if a is None else a if isinstance(a, np.ndarray) else
            a.numpy() if isinstance(a, DeviceArray) else as_array(a, "emission")
            for a in arrays]
        return Emission(self.layout, self.n_seqs, ind, lengths, indptr, dense,
                        queries_per_seq=self.queries_per_seq, last_page_len=last,
                        flags=self.flags)

    def _query_index(self, i: int, t: int) -> int:
        if not 0 <= i < self.n_seqs:
            raise IndexError(f"request {i} out of range ({self.n_seqs} in the step)")
        if not 0 <= t < self.queries_per_seq:
            what = "KV head" if self.layout == EmitLayout.CSR_KV_HEADS else "query token"
            raise IndexError(f"{what} {t} out of range ({self.queries_per_seq} per request)")
        return i * self.queries_per_seq + t

    def slots(self, i: int, t: int = 0, page_rows: int | None = None) -> np.ndarray:
        """Request i's attended slots for its query token t. PAGED lists pages: their rows
        (page id x page_rows + row; the last page's first last_page_len), page_rows needed;
        on a sliding-window layer the first page may hold rows before the window (FlashInfer
        masks them: window_left = window - 1)."""
        q = self._query_index(i, t)
        h = self.host()
        if self.layout == EmitLayout.TOKENS:
            if self.flags & EmitFlag.LENGTHS_PER_SEQ:  # the request's count; -1 past the token's
                row = h.indices[q, :h.lengths[i]]
                return row[row >= 0]
            return h.indices[q, :h.lengths[q]]
        if self.layout == EmitLayout.PAGED:
            if page_rows is None:
                raise ValueError("slots: a PAGED emission lists pages; pass page_rows")
            pages, last = self.pages(i, t)
            rows = np.arange(page_rows, dtype=np.int32)
            out = (pages.astype(np.int32)[:, None] * page_rows + rows[None, :]).reshape(-1)
            return out[:len(out) - (page_rows - last)] if len(pages) else out
        return h.indices[h.indptr[q]:h.indptr[q + 1]]

    def pages(self, i: int, t: int = 0) -> tuple[np.ndarray, int]:
        """PAGED: request i's page ids for its query token t and its last page's rows (0 for
        an empty list) — FlashInfer's kv_indices[kv_indptr[q]:kv_indptr[q + 1]] and
        kv_last_page_len[q]."""
        if self.layout != EmitLayout.PAGED:
            raise ValueError(f"pages: the emission's layout is {EmitLayout(self.layout).name}, "
                             "not PAGED")
        q = self._query_index(i, t)
        h = self.host()
        return h.indices[h.indptr[q]:h.indptr[q + 1]], int(h.last_page_len[q])

    def counts(self) -> np.ndarray:
        """Rows per query (one per request when queries_per_seq is 1, or with
        LENGTHS_PER_SEQ); PAGED: pages per query."""
        h = self.host()
        nq = self.n_seqs * self.queries_per_seq
        if self.layout == EmitLayout.TOKENS:
            if self.flags & EmitFlag.LENGTHS_PER_SEQ:
                return h.lengths[:self.n_seqs].copy()
            return h.lengths[:nq].copy()
        return np.diff(h.indptr[:nq + 1])


class Buffer(_Closable):
    """kvt_buffer: zeroed memory in the context's backend space (host memory on the CPU backend,
    protected pages on the guarded one, device memory on CUDA) — where kvt_batch_run's emission
    lives. ``ptr`` is its address for kernels and for Batch.run's ``*_ptr`` arguments; the host
    reaches the bytes through ``read`` / ``write`` only (never dereference ``ptr`` off the CPU
    backend). Freed with its context."""

    _kind = "buffer"

    def __init__(self, ctx: Context, nbytes: int):
        if not isinstance(ctx, Context):
            raise TypeError(f"ctx: expected a kvtier.Context, got {type(ctx).__name__}")
        out = ctypes.c_void_p()
        check(lib.kvt_buffer_alloc(ctx._ptr, u64(nbytes, "nbytes"), ctypes.byref(out)),
              "kvt_buffer_alloc")
        self._ctx = ctx
        self._h = _Handle(out.value, lib.kvt_buffer_free, ctx._h)

    @property
    def ptr(self) -> int:
        return lib.kvt_buffer_ptr(self._ptr) or 0

    @property
    def nbytes(self) -> int:
        return lib.kvt_buffer_size(self._ptr)

    def write(self, data, offset: int = 0) -> None:
        """Copy a C-contiguous array (or bytes) into the buffer at offset."""
        a = np.ascontiguousarray(np.frombuffer(data, np.uint8) if isinstance(
            data, (bytes, bytearray, memoryview)) else as_array(data, "data"))
        check(lib.kvt_buffer_write(self._ptr, u64(offset, "offset"), ptr(a), a.nbytes),
              "kvt_buffer_write")

    def read(self, dtype=np.uint8, count: int | None = None, offset: int = 0) -> np.ndarray:
        """count elements of dtype from offset (None: to the end) as a new array."""
        dt = np.dtype(dtype)
        off = u64(offset, "offset")
        if count is None:
            count = max(0, (self.nbytes - off) // dt.itemsize)
        out = np.empty(u64(count, "count"), dtype=dt)
        check(lib.kvt_buffer_read(self._ptr, off, ptr(out), out.nbytes), "kvt_buffer_read")
        return out

    def write_async(self, data, stream, offset: int = 0) -> None:
        """kvt_buffer_write_async: enqueue a copy of ``data`` (a C-contiguous array, read in
        place: not copied here) into the buffer at offset on ``stream`` (a cudaStream_t as int,
        or an object with ``cuda_stream``; the CPU backends copy at once). ``data`` must stay
        alive and unchanged until the stream reaches the copy: the caller keeps it."""
        a = contiguous(as_array(data, "data"), "data")
        check(lib.kvt_buffer_write_async(self._ptr, u64(offset, "offset"), ptr(a), a.nbytes,
                                         _stream(stream)), "kvt_buffer_write_async")

    def read_async(self, out, stream, offset: int = 0) -> np.ndarray:
        """kvt_buffer_read_async: enqueue a copy of out.nbytes bytes from offset into ``out``
        (writable, C-contiguous) on ``stream``; ``out`` holds them once the stream reaches the
        copy (at once on the CPU backends) and must stay alive until then. Returns out."""
        if not isinstance(out, np.ndarray) and not hasattr(out, "__array_interface__"):
            raise TypeError("out: expected a numpy array")
        o = contiguous(np.asarray(out), "out")
        if not o.flags.writeable:
            raise ValueError("out: must be writable")
        check(lib.kvt_buffer_read_async(self._ptr, u64(offset, "offset"), ptr(o), o.nbytes,
                                        _stream(stream)), "kvt_buffer_read_async")
        return o

    def view(self, dtype=np.uint8, shape=None, offset: int = 0):
        """A typed zero-copy view of the buffer's bytes from offset (shape None: as many
        elements as fit): a numpy array on the CPU backend, a :class:`DeviceArray` on CUDA
        (exported by ``__cuda_array_interface__`` and DLPack) and on the guarded backend (passed
        to the library only). The view keeps the buffer alive."""
        dt = np.dtype(dtype)
        off = u64(offset, "offset")
        if shape is None:
            shape = (max(0, (self.nbytes - off) // dt.itemsize),)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64))
        if off + count * dt.itemsize > self.nbytes:
            raise ValueError(f"view: {count} x {dt} from byte {off} passes the buffer's "
                             f"{self.nbytes} bytes")
        base = self.ptr + off
        if self._ctx._space == "host":
            raw = np.asarray(_PlaneBuffer(base, (count * dt.itemsize,), self._h))
            return raw.view(dt).reshape(shape)

        def read(out):
            check(lib.kvt_buffer_read(self._ptr, off, ptr(out), out.nbytes), "kvt_buffer_read")

        def write(a):
            check(lib.kvt_buffer_write(self._ptr, off, ptr(a), a.nbytes), "kvt_buffer_write")
        return DeviceArray(base, shape, dt, self._ctx._device, self._h, read, write)

    def close(self) -> None:
        """kvt_buffer_free (a no-op once its context was closed: the context freed it);
        deferred while a view of it still lives."""
        h, self._h = self._h, None
        del h  # the last reference frees it (_Handle.__del__), now or when the last view goes


def _emit_c(layout, sq: int, refs, flags=0) -> _lib.EmitC:
    """The kvt_emit over checked arrays (ArrayRefs by name), with its KVT_EMIT_* flags."""
    P32 = ctypes.POINTER(ctypes.c_int32)
    e = _lib.EmitC()
    e.struct_size = ctypes.sizeof(_lib.EmitC)
    e.layout = int(layout)
    e.queries_per_seq = sq
    e.flags = u64(int(flags), "flags")
    e.indices = ctypes.cast(refs["indices"].ptr, P32)
    if "last_page_len" in refs:
        e.last_page_len = ctypes.cast(refs["last_page_len"].ptr, P32)
    if layout == EmitLayout.TOKENS:
        e.capacity = u32(refs["indices"].shape[1], "topk")
        e.lengths = ctypes.cast(refs["lengths"].ptr, P32)
    else:
        e.capacity = u32(refs["indices"].shape[0], "capacity")
        e.indptr = ctypes.cast(refs["indptr"].ptr, P32)
    if "dense" in refs:
        e.dense = ctypes.cast(refs["dense"].ptr, ctypes.POINTER(ctypes.c_uint8))
    return e


def _stream(stream):
    """A cudaStream_t as int, or an object with ``cuda_stream``; None passes NULL."""
    if stream is None:
        return None
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    return u64(stream, "stream")


def _per_request(values, n: int, name: str) -> list[int]:
    """One uint32 count per request: an int repeats; a sequence must hold exactly n (the C side
    reads n entries and would read past a shorter array)."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = [values] * n
    else:
        values = list(np.asarray(values).reshape(-1)) if not isinstance(values, list) else values
        if len(values) != n:
            raise ValueError(f"{name}: {len(values)} counts for {n} requests")
    return [u32(c, f"{name}[{i}]") for i, c in enumerate(values)]


_run = lib.kvt_batch_run
_reserve = lib.kvt_batch_reserve
_slot_mapping = lib.kvt_batch_slot_mapping
_slot_mapping64 = lib.kvt_batch_slot_mapping64
_commit = lib.kvt_batch_commit
_plan = lib.kvt_batch_plan
_U64 = 2**64


class Batch(_Closable):
    """kvt_batch: one step of many requests — reserve, slot_mapping, plan, run per layer,
    commit (the timeline and order rules of kvtier.h, "Batches"). A step's requests are kept
    alive by the batch until the commit.

    The decode loop's calls are cheap in Python when their arguments repeat: ``reserve`` with
    the same requests (and an int count), ``slot_mapping`` and ``run`` with the same ``out`` /
    ``emission`` / ``query`` objects (numpy arrays and DeviceArrays are checked once and their
    pointers kept; other array objects are read again at every call)."""

    _kind = "batch"

    def __init__(self, ctx: Context, max_seqs: int):
        if not isinstance(ctx, Context):
            raise TypeError(f"ctx: expected a kvtier.Context, got {type(ctx).__name__}")
        out = ctypes.c_void_p()
        check(lib.kvt_batch_create(ctx._ptr, u32(max_seqs, "max_seqs"), ctypes.byref(out)),
              "kvt_batch_create")
        self._ctx = ctx
        self._h = _Handle(out.value, lib.kvt_batch_destroy, ctx._h)
        self.max_seqs = max_seqs
        self._step: list[Sequence] = []
        self._n = 0
        self._tokens = 0
        self._planned_emits = None  # the arrays planned steps write (kept for the batch's life)
        self._rcache = None  # (seqs, n_tokens, C array of handles, C array of counts)
        self._scache = None  # (out, pointer, capacity) of slot_mapping
        self._qcache = None  # (query, pointer) of run
        self._n_out = ctypes.c_uint32()
        self._n_out_ref = ctypes.byref(self._n_out)

    def _bp(self) -> int:
        h = self._h
        if h is None or not h.ptr or not h.token[0]:
            raise ValueError("this batch is closed")
        return h.ptr

    @property
    def context(self) -> Context:
        return self._ctx

    @property
    def n_seqs(self) -> int:
        """Requests of the step in flight (0 between steps)."""
        return self._n

    def reserve(self, seqs: _Seq[Sequence], n_tokens, n_drafts=None) -> None:
        """kvt_batch_reserve: n_tokens[i] new tokens for seqs[i] (an int: the same for all) in
        every layer, all or nothing. PoolExhaustedError leaves everything unchanged. With
        ``n_drafts`` (kvt_batch_reserve_drafts; an int or one count per request) the last
        n_drafts[i] tokens are speculative drafts that commit may reject."""
        seqs = tuple(seqs)
        c = self._rcache
        if n_drafts is None and c is not None and c[1] == n_tokens and \
                type(n_tokens) is int and c[0] == seqs:
            for s in seqs:  # the same requests as the last reserve: still open?
                h = s._h
                if h is None or not h.ptr or not h.token[0]:
                    raise ValueError("this sequence is closed")
            check(_reserve(self._bp(), c[2], c[3], len(seqs)), "kvt_batch_reserve")
            self._step, self._n, self._tokens = seqs, len(seqs), c[4]
            return
        for i, s in enumerate(seqs):
            if not isinstance(s, Sequence):
                raise TypeError(f"seqs[{i}]: expected a kvtier.Sequence, got {type(s).__name__}")
        n = len(seqs)
        arr_s = (ctypes.c_void_p * max(1, n))(*[s._ptr for s in seqs])
        counts = _per_request(n_tokens, n, "n_tokens")
        arr_n = (ctypes.c_uint32 * max(1, n))(*counts)
        if n_drafts is None:
            check(_reserve(self._bp(), arr_s, arr_n, n), "kvt_batch_reserve")
            if type(n_tokens) is int:
                self._rcache = (seqs, n_tokens, arr_s, arr_n, sum(counts))
        else:
            arr_d = (ctypes.c_uint32 * max(1, n))(*_per_request(n_drafts, n, "n_drafts"))
            check(lib.kvt_batch_reserve_drafts(self._bp(), arr_s, arr_n, arr_d, n),
                  "kvt_batch_reserve_drafts")
        self._step, self._n = seqs, n
        self._tokens = sum(counts)

    def slot_mapping(self, layer: int, out=None, dtype=np.int32) -> np.ndarray:
        """kvt_batch_slot_mapping: the slot of every new token of the step (request order,
        then token order) in the layer's group, host memory, int32 — or int64 (``dtype=np.int64``
        or an int64 ``out``: kvt_batch_slot_mapping64, the dtype of vLLM's slot_mapping).
        ``out``: a caller buffer (CapacityError when shorter than the step's tokens), reused
        cheaply step after step."""
        c = self._scache
        if out is not None and c is not None and out is c[0]:
            p, cap, fn = c[1], c[2], c[3]
        else:
            if out is None:
                dt = np.dtype(dtype)
                if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
                    raise TypeError(f"dtype: int32 or int64, got {dt}")
                out = np.empty(self._tokens, dtype=dt)
            else:
                dt = getattr(out, "dtype", None)
                dt = np.dtype(np.int64) if dt == np.dtype(np.int64) else np.dtype(np.int32)
                out = as_output(out, "out", dt)
                if out.ndim != 1:
                    raise ValueError(f"out: expected one dimension, got shape {out.shape}")
            wide = out.dtype == np.dtype(np.int64)
            p = ptr(out, ctypes.c_int64 if wide else ctypes.c_int32)
            cap, fn = len(out), (_slot_mapping64 if wide else _slot_mapping)
            self._scache = (out, p, cap, fn)
        check(fn(self._bp(), u32(layer, "layer"), p, cap, self._n_out_ref),
              "kvt_batch_slot_mapping64" if fn is _slot_mapping64 else "kvt_batch_slot_mapping")
        return out[:self._n_out.value]

    def plan(self) -> None:
        """kvt_batch_plan (host only). BadStateError without a reservation."""
        check(_plan(self._bp()), "kvt_batch_plan")

    def emission(self, layout="tokens", capacity: int = 0, *, layer: int | None = None,
                 want_dense: bool = False, flags=0) -> Emission:
        """Zeroed emission buffers for every step of this batch, sized for max_seqs requests
        (what plan_device needs: a planned step's runs write the arrays of the batch's first
        planned step), in the backend's memory: numpy arrays on the CPU backend, DeviceArrays
        over kvt_buffers on CUDA (exported to torch / CuPy by DLPack and
        ``__cuda_array_interface__``) and guarded. TOKENS: ``indices`` int32 [max_seqs, capacity]
        (capacity: rows per request) and ``lengths`` [max_seqs]; CSR: ``indices`` [capacity] (all
        requests' rows) and ``indptr`` [max_seqs + 1]; CSR_KV_HEADS (``layer`` names the layer
        whose KV heads count the lists): ``indptr`` [max_seqs * n_kv_heads + 1]; PAGED:
        ``indices`` [capacity] (page ids), ``indptr`` [max_seqs + 1] and ``last_page_len``
        [max_seqs]. ``want_dense``: ``dense`` uint8 [max_seqs]. ``flags``: EmitFlag
        (LENGTHS_PER_SEQ: TOKENS' lengths one per request). Pass it to run(layer,
        emission=...) and plan_device()."""
        layout = to_enum(EmitLayout, layout, "layout")
        flags = EmitFlag(int(flags))
        n, cap = self.max_seqs, u32(capacity, "capacity")
        lists = n
        if layout == EmitLayout.CSR_KV_HEADS:
            if layer is None:
                raise ValueError("layer: CSR_KV_HEADS counts a list per KV head of a layer")
            lists = n * int(self._ctx.layer_spec(u32(layer, "layer")).n_kv_heads)
        if self._ctx._space == "host":
            zeros = np.zeros
        else:
            def zeros(shape, dt):
                dt = np.dtype(dt)
                count = int(np.prod(shape, dtype=np.int64))
                return Buffer(self._ctx, max(1, count * dt.itemsize)).view(dt, shape)
        dense = zeros(n, np.uint8) if want_dense else None
        if layout == EmitLayout.TOKENS:
            return Emission(layout, n, zeros((n, cap), np.int32), zeros(n, np.int32),
                            dense=dense, flags=flags)
        last = zeros(max(1, lists), np.int32) if layout == EmitLayout.PAGED else None
        return Emission(layout, n, zeros(max(1, cap), np.int32),
                        indptr=zeros(lists + 1, np.int32), dense=dense,
                        queries_per_seq=lists // n if n else 1, last_page_len=last, flags=flags)

    def plan_device(self, emits, stream=None) -> bool:
        """kvt_batch_plan_device, after plan() and before any run: plan every layer's run of a
        quiet step (no close, round, drafts or unplannable recall) into the batch's plan image,
        so that its runs only execute it (a CUDA graph can capture them: kvtier.cuda). ``emits``:
        one Emission (every layer writes its arrays) or one per layer, from ``emission()`` or
        over arrays of the backend's memory: each planned run must pass exactly that one
        (``run(layer, emission=e)``), and every planned step of the batch those of its first.
        Returns True when the step was planned, False when it is not plannable (run it as
        usual). BadStateError (not planned, already run, planned twice), InvalidArgumentError
        (emissions other than the first planned step's), CapacityError (nothing planned)."""
        lst = [emits] if isinstance(emits, Emission) else list(emits)
        n_layers = self._ctx.n_layers
        if len(lst) not in (1, n_layers):
            raise ValueError(f"emits: {len(lst)} given, 1 (every layer) or n_layers = {n_layers}")
        arr = (_lib.EmitC * len(lst))()
        n = self.max_seqs
        for i, e in enumerate(lst):
            if not isinstance(e, Emission):
                raise TypeError(f"emits[{i}]: expected a kvtier.Emission, got "
                                f"{type(e).__name__}")
            what = f"emits[{i}]"
            if e._c is None or e._for is not self._ctx._h:
                e._prepare(self._ctx)
            lists = n
            if e.layout == EmitLayout.CSR_KV_HEADS:
                layers = range(n_layers) if len(lst) == 1 else (i,)
                lists = n * max([self._ctx._kv_heads[l] for l in layers] or [1])
            if e._lists < lists:
                raise ValueError(f"{what}: holds {e._lists} lists, plan_device needs {lists} "
                                 f"(max_seqs = {n})")
            if e._dense_n is not None and e._dense_n < n:
                raise ValueError(f"{what}: dense needs (>= {n},) for max_seqs requests")
            arr[i] = e._c
        planned = ctypes.c_bool()
        check(lib.kvt_batch_plan_device(self._bp(), arr, len(lst), _stream(stream),
                                        ctypes.byref(planned)), "kvt_batch_plan_device")
        if planned.value and self._planned_emits is None:
            self._planned_emits = lst  # a captured graph writes these: they live with the batch
        return bool(planned.value)

    def emit_fits(self, layer: int, layout="paged") -> bool:
        """kvt_batch_emit_fits, after plan() and before the layer's first run: whether
        run(layer) can emit this step in ``layout`` — PAGED: every request's set is whole pages
        (False too where a salience close is due on the layer or a request recalls there: then
        use TOKENS or CSR); True for the other layouts."""
        fits = ctypes.c_bool()
        check(lib.kvt_batch_emit_fits(self._bp(), u32(layer, "layer"),
                                      int(to_enum(EmitLayout, layout, "layout")),
                                      ctypes.byref(fits)), "kvt_batch_emit_fits")
        return bool(fits.value)

    def capacity(self, layer: int) -> tuple[int, int]:
        """kvt_batch_capacity after plan: (topk, total) that always suffice for run(layer)."""
        topk, total = ctypes.c_uint32(), ctypes.c_uint32()
        check(lib.kvt_batch_capacity(self._bp(), u32(layer, "layer"), ctypes.byref(topk),
                                     ctypes.byref(total)), "kvt_batch_capacity")
        return topk.value, total.value

    def _query(self, query):
        """The query's pointer: float32, C-contiguous, in the backend's memory (cached for
        the same ndarray or DeviceArray)."""
        c = self._qcache
        if c is not None and query is c[0]:
            return c[1]
        ref = self._ctx._backend_array(query, "query", np.float32)
        if isinstance(query, (np.ndarray, DeviceArray)):
            self._qcache = (query, ref.ptr, ref)
        return ref.ptr

    def run(self, layer: int, layout="tokens", *, indices=None, lengths=None, indptr=None,
            dense=None, want_dense: bool = False, queries_per_seq: int = 1, query=None,
            stream=None, emission: Emission | None = None, last_page_len=None,
            flags=0) -> Emission:
        """kvt_batch_run: the layer's due close or round for every request, then its attended
        sets, one per request or, with ``queries_per_seq`` = s_q > 1, one per query token
        (causal: token t sees the step's rows up to its own). Buffers, in the backend's memory
        (numpy on the CPU backend; CUDA arrays by ``__cuda_array_interface__`` / DLPack, or
        DeviceArrays, on CUDA; MemorySpaceError otherwise): pass fixed-capacity
        ``indices`` (TOKENS: int32 [>= n_seqs * s_q, topk]; CSR: int32 [capacity]) and
        ``lengths`` / ``indptr`` (int32 [>= n_seqs * s_q] / [>= n_seqs * s_q + 1]), optional
        ``dense`` (uint8 [>= n_seqs]); or none, and buffers sized by capacity() are made.
        ``layout="csr_kv_heads"``: one list per (request, KV head) of the layer (needed where a
        request recalls on a GQA/MHA-RoPE layer), indptr [>= n_seqs * n_kv_heads + 1], capacity
        n_kv_heads x capacity()'s total; one query per request.
        ``layout="paged"``: FlashInfer's paged KV cache where every set is whole pages
        (emit_fits() says beforehand; UnsupportedError otherwise): ``indices`` [capacity] page
        ids, ``indptr`` [>= n_seqs * s_q + 1], ``last_page_len`` int32 [>= n_seqs * s_q].
        ``flags``: EmitFlag.LENGTHS_PER_SEQ (TOKENS: ``lengths`` [>= n_seqs], FlashMLA's
        topk_length).
        ``query`` (the recall trigger's queries: float32 [n_seqs, n_q_heads, value_dim +
        branch_dim], softmax-scaled, in the backend's memory; needed when a request recalls on
        the layer) and ``stream`` (a cudaStream_t as int, or an object with ``cuda_stream``:
        kvtier.cuda.Stream, torch.cuda.Stream; ignored on the CPU) pass through.
        ``emission``: an Emission (from ``emission()``; a planned step's runs pass the one
        plan_device planned) whose layout and arrays are used instead of the arguments above:
        the decode path (checked once, then one C call). CapacityError when a request's rows
        exceed the capacity."""
        if emission is not None and queries_per_seq == 1 and indices is None and \
                lengths is None and indptr is None and dense is None and \
                last_page_len is None and not flags:
            e = emission
            if type(e) is not Emission and not isinstance(e, Emission):
                raise TypeError(f"emission: expected a kvtier.Emission, got {type(e).__name__}")
            if e._c is None or e._for is not self._ctx._h:
                e._prepare(self._ctx)
            n = self._n
            if type(layer) is not int or not 0 <= layer < len(self._ctx._kv_heads):
                u32(layer, "layer")  # a TypeError / ValueError naming it; else the C range check
                kv = 1
            else:
                kv = self._ctx._kv_heads[layer]
            qps = kv if e.layout == EmitLayout.CSR_KV_HEADS else 1
            if n * qps > e._lists or (e._dense_n is not None and n > e._dense_n):
                raise ValueError(f"emission: holds {e._lists} lists"
                                 f"{'' if e._dense_n is None else f' and {e._dense_n} dense flags'}"
                                 f", the step needs {n * qps} (n_seqs = {n})")
            q = None if query is None else self._query(query)
            if stream is not None and not (type(stream) is int and 0 <= stream < _U64):
                stream = _stream(stream)
            rc = _run(self._bp(), layer, q, stream, e._cp)
            if rc:
                check(rc, "kvt_batch_run")
            return e._view(n, qps)
        if emission is not None:
            if any(x is not None for x in (indices, lengths, indptr, dense, last_page_len)):
                raise TypeError("run: pass emission or the buffers, not both")
            layout, indices, lengths = emission.layout, emission.indices, emission.lengths
            indptr, dense = emission.indptr, emission.dense
            last_page_len, flags = emission.last_page_len, flags or emission.flags
        layout = to_enum(EmitLayout, layout, "layout")
        flags = EmitFlag(int(flags))
        paged = layout == EmitLayout.PAGED
        n = self._n
        sq = u32(queries_per_seq, "queries_per_seq") or 1
        nq = n * sq
        lists = nq  # the emission's lists
        if layout == EmitLayout.CSR_KV_HEADS:
            if sq != 1:
                raise ValueError("queries_per_seq: CSR_KV_HEADS takes one query per request")
            n_kv = int(self._ctx.model.layer(u32(layer, "layer")).n_kv_heads)
            lists = n * n_kv
        host = self._ctx._space == "host"
        if host:
            alloc = np.empty
        else:  # the backend's memory: kvt_buffers (made per call: emission() is the fast way)
            def alloc(shape, dt):
                dt = np.dtype(dt)
                count = int(np.prod(shape, dtype=np.int64))
                return Buffer(self._ctx, max(1, count * dt.itemsize)).view(dt, shape)
        if indices is None:
            topk, total = self.capacity(layer)
            if layout == EmitLayout.TOKENS:
                indices = alloc((nq, topk), np.int32)
            else:
                indices = alloc(max(1, total * (lists // n if n else sq)), np.int32)
        refs = {"indices": self._ctx._backend_array(indices, "indices", np.int32, True)}
        if host:
            indices = refs["indices"].host
        shape = refs["indices"].shape
        if layout == EmitLayout.TOKENS:
            if len(shape) != 2 or shape[0] < nq:
                raise ValueError(f"indices: TOKENS needs shape (>= {nq}, topk), got {shape}")
            n_len = n if flags & EmitFlag.LENGTHS_PER_SEQ else nq
            lengths = alloc(max(1, n_len), np.int32) if lengths is None else lengths
            refs["lengths"] = self._ctx._backend_array(lengths, "lengths", np.int32, True)
            if len(refs["lengths"].shape) != 1 or refs["lengths"].shape[0] < n_len:
                raise ValueError(f"lengths: needs shape (>= {n_len},), got "
                                 f"{refs['lengths'].shape}")
        else:
            if len(shape) != 1:
                raise ValueError(f"indices: CSR needs one dimension, got {shape}")
            indptr = alloc(lists + 1, np.int32) if indptr is None else indptr
            refs["indptr"] = self._ctx._backend_array(indptr, "indptr", np.int32, True)
            if len(refs["indptr"].shape) != 1 or refs["indptr"].shape[0] < lists + 1:
                raise ValueError(f"indptr: needs shape (>= {lists + 1},), got "
                                 f"{refs['indptr'].shape}")
            if paged:
                last_page_len = alloc(max(1, lists), np.int32) if last_page_len is None \
                    else last_page_len
                refs["last_page_len"] = self._ctx._backend_array(last_page_len, "last_page_len",
                                                                 np.int32, True)
                if len(refs["last_page_len"].shape) != 1 or \
                        refs["last_page_len"].shape[0] < lists:
                    raise ValueError(f"last_page_len: needs shape (>= {lists},), got "
                                     f"{refs['last_page_len'].shape}")
        if dense is not None or want_dense:
            if dense is None:
                dense = np.zeros(n, dtype=np.uint8) if host else alloc(max(1, n), np.uint8)
            refs["dense"] = self._ctx._backend_array(dense, "dense", np.uint8, True)
            if len(refs["dense"].shape) != 1 or refs["dense"].shape[0] < n:
                raise ValueError(f"dense: needs shape (>= {n},), got {refs['dense'].shape}")
        if host:  # the caller's own objects become numpy views in the result
            lengths = refs["lengths"].host if "lengths" in refs else None
            indptr = refs["indptr"].host if "indptr" in refs else None
            dense = refs["dense"].host if "dense" in refs else None
            last_page_len = refs["last_page_len"].host if "last_page_len" in refs else None
        e = _emit_c(layout, sq, refs, flags)
        q = None
        if query is not None:
            q = self._ctx._backend_array(query, "query", np.float32).ptr
        check(lib.kvt_batch_run(self._bp(), u32(layer, "layer"), q, _stream(stream),
                                ctypes.byref(e)),
              "kvt_batch_run")
        return Emission(layout, n, indices, lengths if layout == EmitLayout.TOKENS else None,
                        indptr if layout != EmitLayout.TOKENS else None, dense,
                        lists // n if n else sq,
                        last_page_len=last_page_len if paged else None, flags=flags)

    def commit(self, n_accepted=None) -> None:
        """kvt_batch_commit: the first n_accepted[i] tokens of seqs[i] (None: all reserved);
        only drafts (reserve's n_drafts) may be rejected."""
        acc = None
        if n_accepted is not None:
            counts = list(n_accepted)
            # kvt_batch_commit reads one count per request of the step.
            if len(counts) != self._n:
                raise ValueError(f"n_accepted: {len(counts)} counts for the step's "
                                 f"{self._n} requests")
            acc = (ctypes.c_uint32 * max(1, len(counts)))(
                *[u32(c, f"n_accepted[{i}]") for i, c in enumerate(counts)])
        check(_commit(self._bp(), acc), "kvt_batch_commit")
        self._step = ()
        self._n = 0
        self._tokens = 0

    def close(self) -> None:
        """kvt_batch_destroy. A step in flight before any run is abandoned (its reservations
        released); after a run, commit first (the requests otherwise stay reserved)."""
        super().close()
        self._step = ()
        self._n = 0
        self._rcache = self._scache = self._qcache = None

    def __repr__(self):
        if self.closed:
            return "<kvtier.Batch closed>"
        return f"<kvtier.Batch max_seqs={self.max_seqs}, {self.n_seqs} in the step>"
