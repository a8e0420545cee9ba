"""kvtier_ref.h: reference math on host copies of rows — σ of a block (the very function the
salience tier uses, so the same bits), a double-precision MLA decode attention, and element
conversions. Every buffer is checked here against the sizes the C code will read."""

from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from ._api import _Closable, _Handle, dtype_bytes
from ._errors import check
from ._lib import lib
from ._types import DType, SigmaBasis, as_array, contiguous, ptr, to_enum, typed_input, u32

DEFAULT_SCALE = _lib.REF_ATTN_DEFAULT_SCALE
MAX_DIM = _lib.REF_ATTN_MAX_DIM


def _float_dtype(dtype, what="dtype") -> DType:
    return to_enum(DType, dtype, what)


def load(row, dtype, i: int) -> float:
    """kvt_ref_load: element i of a row (bf16, fp16, fp32) as fp32 (0.0 for fp8)."""
    arr = contiguous(as_array(row, "row"), "row")
    dt = _float_dtype(dtype)
    i = u32(i, "i")
    elt = dtype_bytes(dt)
    if elt and (i + 1) * elt > arr.nbytes:
        raise IndexError(f"element {i} of {dt.name} lies past the row's {arr.nbytes} bytes")
    return float(lib.kvt_ref_load(ptr(arr), int(dt), i))


def store(row, dtype, i: int, value: float) -> None:
    """kvt_ref_store: value as element i of a writable row, rounding to nearest even."""
    if not isinstance(row, np.ndarray):
        raise TypeError("row: expected a writable numpy array")
    contiguous(row, "row")
    if not row.flags.writeable:
        raise ValueError("row: must be writable")
    dt = _float_dtype(dtype)
    i = u32(i, "i")
    elt = dtype_bytes(dt)
    if elt and (i + 1) * elt > row.nbytes:
        raise IndexError(f"element {i} of {dt.name} lies past the row's {row.nbytes} bytes")
    lib.kvt_ref_store(ptr(row), int(dt), i, float(value))


class Sigma(_Closable):
    """kvt_ref_sigma: the basis of a block (Fourier, or ``basis`` = the kvt_config.sigma_basis
    to score as: "fourier", "dct") and scratch, reused for many blocks. block_rows a power of two
    >= 64, kappa in 1..block_rows/2, branch_dim in 1..256 (InvalidArgumentError otherwise)."""

    _kind = "sigma handle"

    def __init__(self, block_rows: int = 4096, kappa: int = 16, branch_dim: int = 64,
                 basis=SigmaBasis.FOURIER):
        out = ctypes.c_void_p()
        b = to_enum(SigmaBasis, basis, "basis")
        args = (u32(block_rows, "block_rows"), u32(kappa, "kappa"), u32(branch_dim, "branch_dim"))
        if b == SigmaBasis.FOURIER:  # kvt_ref_sigma_create is kvt_ref_sigma_create_basis(FOURIER)
            check(lib.kvt_ref_sigma_create(*args, ctypes.byref(out)), "kvt_ref_sigma_create")
        else:
            check(lib.kvt_ref_sigma_create_basis(*args, int(b), ctypes.byref(out)),
                  "kvt_ref_sigma_create_basis")
        self._h = _Handle(out.value, lib.kvt_ref_sigma_destroy)
        self.block_rows, self.kappa, self.branch_dim = block_rows, kappa, branch_dim
        self.sigma_basis = b

    @property
    def basis(self) -> np.ndarray:
        """A copy of the basis: float32 [2 kappa - 1, block_rows], orthonormal columns."""
        n = ctypes.c_uint32()
        p = lib.kvt_ref_sigma_basis(self._ptr, ctypes.byref(n))
        flat = np.ctypeslib.as_array(p, shape=(n.value * self.block_rows,))
        return flat.reshape(n.value, self.block_rows).copy()

    def block(self, rows, branch_offset: int, branch_dtype=DType.BF16) -> np.ndarray:
        """σ of block_rows consecutive rows: ``rows`` is C-contiguous with block_rows entries on
        its first axis (any dtype: the row stride is nbytes / block_rows); each row's branch of
        branch_dim values of branch_dtype starts at byte branch_offset. float32 [block_rows]."""
        arr = contiguous(as_array(rows, "rows"), "rows")
        if arr.ndim < 1 or arr.shape[0] != self.block_rows:
            raise ValueError(f"rows: expected {self.block_rows} rows on the first axis, got shape "
                             f"{arr.shape}")
        stride = arr.nbytes // self.block_rows
        out = np.empty(self.block_rows, dtype=np.float32)
        check(lib.kvt_ref_sigma_block(self._ptr, ptr(arr), stride,
                                      u32(branch_offset, "branch_offset"),
                                      int(_float_dtype(branch_dtype, "branch_dtype")),
                                      ptr(out, ctypes.c_float)), "kvt_ref_sigma_block")
        return out


class AttnResult:
    __slots__ = ("out", "mark_mass", "lse")

    def __init__(self, out, mark_mass, lse):
        self.out, self.mark_mass, self.lse = out, mark_mass, lse


def scratch_doubles(n_rows: int, n_heads: int, value_dim: int, key_dim: int) -> int:
    return lib.kvt_ref_attn_scratch_doubles(u32(n_rows, "n_rows"), u32(n_heads, "n_heads"),
                                            u32(value_dim, "value_dim"), u32(key_dim, "key_dim"))


def attn(rows, q, *, dtype=DType.BF16, key_dim: int = 576, value_dim: int = 512, slots=None,
         slot_stride: int | None = None, row_offset: int = 0, scale: float = DEFAULT_SCALE,
         mark=None) -> AttnResult:
    """kvt_ref_attn: one MLA decode step in double precision.

    rows: C-contiguous rows (row j at byte ``slots[j] * slot_stride + row_offset``, or slot j when
    ``slots`` is None; ``slot_stride`` defaults to nbytes / rows.shape[0]). q: float32
    [n_heads, q_stride >= key_dim]. mark: optional [n_rows] flags. Returns out float32
    [n_heads, value_dim], mark_mass and lse float64 [n_heads]. Every row the C code would read is
    checked to lie inside ``rows`` first (IndexError otherwise)."""
    base = contiguous(as_array(rows, "rows"), "rows")
    if base.ndim < 1 or base.shape[0] == 0:
        raise ValueError(f"rows: expected at least one row, got shape {base.shape}")
    qa = typed_input(q, "q", np.float32, ndim=2)
    dt = _float_dtype(dtype)
    key_dim, value_dim = u32(key_dim, "key_dim"), u32(value_dim, "value_dim")
    stride = base.nbytes // base.shape[0] if slot_stride is None else int(slot_stride)
    if stride < 0 or row_offset < 0:
        raise ValueError("slot_stride and row_offset must be >= 0")
    if slots is None:
        n_rows = base.shape[0]
        sl = None
        used = np.arange(n_rows, dtype=np.int64)
    else:
        sl = typed_input(slots, "slots", np.int32, ndim=1)
        n_rows = sl.shape[0]
        used = sl[sl >= 0].astype(np.int64)  # negative slots: the C call refuses them
    elt = dtype_bytes(dt)
    if 0 < key_dim <= MAX_DIM and elt and used.size:
        end = int(used.max()) * stride + row_offset + key_dim * elt
        if end > base.nbytes:
            raise IndexError(f"rows: a row ends at byte {end}, past the {base.nbytes} given")
    mk = None
    if mark is not None:
        mk = as_array(mark, "mark")
        if mk.dtype == np.bool_:
            mk = mk.view(np.uint8)
        if mk.dtype != np.uint8 or mk.shape != (n_rows,):
            raise ValueError(f"mark: expected uint8/bool [{n_rows}], got {mk.dtype} {mk.shape}")
        mk = contiguous(mk, "mark")
    n_heads = qa.shape[0]
    out = np.zeros((n_heads, value_dim), dtype=np.float32)
    mass = np.zeros(n_heads, dtype=np.float64)
    lse = np.zeros(n_heads, dtype=np.float64)
    scratch = np.empty(max(1, scratch_doubles(n_rows, n_heads, value_dim, key_dim)),
                       dtype=np.float64)
    a = _lib.RefAttnArgsC()
    a.base = base.ctypes.data
    a.slots = ptr(sl, ctypes.c_int32) if sl is not None else None
    a.n_rows = u32(n_rows, "n_rows")
    a.slot_stride = stride
    a.row_offset = int(row_offset)
    a.dtype = int(dt)
    a.key_dim, a.value_dim = key_dim, value_dim
    a.q = ptr(qa, ctypes.c_float)
    a.n_heads = u32(n_heads, "n_heads")
    a.q_stride = qa.shape[1]
    a.scale = float(scale)
    a.mark = ptr(mk, ctypes.c_uint8) if mk is not None else None
    a.out = ptr(out, ctypes.c_float)
    a.mark_mass = ptr(mass, ctypes.c_double)
    a.lse = ptr(lse, ctypes.c_double)
    a.scratch = ptr(scratch, ctypes.c_double)
    check(lib.kvt_ref_attn(ctypes.byref(a)), "kvt_ref_attn")
    return AttnResult(out, mass if mk is not None else None, lse)
