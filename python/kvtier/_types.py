"""Enums, argument checks and array conversions shared by the handle classes."""

from __future__ import annotations

import ctypes
import enum
import operator

import numpy as np

from . import _lib
from ._arrays import DeviceArray, MemorySpaceError, array_ref


class LayerKind(enum.IntEnum):
    MLA_NOPE = 0
    MLA_ROPE = 1
    GQA_ROPE = 2
    GQA_NOPE = 3
    SLIDING = 4
    NO_KV = 5


class DType(enum.IntEnum):
    BF16 = 0
    FP16 = 1
    FP32 = 2
    FP8_E4M3 = 3


class Policy(enum.IntEnum):
    NONE = 0
    SALIENCE = 1
    EVICT = 2


class RecallMode(enum.IntEnum):
    OFF = 0
    CONFORMAL = 1
    SOUND = 2
    MARGIN = 3
    ON = 1  # the default recall mode (an alias of CONFORMAL)


class Selector(enum.IntEnum):
    SIGMA = 0
    BRANCH_NORM = 1
    ROW_NORM = 2
    RANDOM = 3


class SigmaBasis(enum.IntEnum):
    FOURIER = 0
    DCT = 1


class Backend(enum.IntEnum):
    CPU = 0
    CUDA = 1
    AUTO = 2
    GUARDED = 3


class Allocator(enum.IntEnum):
    DEFAULT = 0
    LIBC = 1


class Space(enum.IntEnum):
    """kvt_space: where random eviction's archive keeps its rows (Context(archive_space=...))."""
    DEVICE = 0
    HOST = 1


class EmitLayout(enum.IntEnum):
    TOKENS = 0  # FlashMLA's sparse decode: slots [n, s_q, topk], topk_length
    CSR = 1  # FlashInfer with page_size 1: indptr over slots
    CSR_KV_HEADS = 2  # one list per (request, KV head): GQA/MHA-RoPE recall
    PAGED = 3  # FlashInfer's paged KV: indptr over page ids, indices, last_page_len


class EmitFlag(enum.IntFlag):
    """kvt_emit.flags (KVT_EMIT_*)."""
    NONE = 0
    LENGTHS_PER_SEQ = 1  # TOKENS: one length per request (FlashMLA's topk_length, (batch,))


class RowState(enum.IntEnum):
    ATTENDED = 0
    ARCHIVED = 1
    DROPPED = 2
    PENDING = 3


def to_enum(cls, value, what: str):
    """An enum member from a member, an int, or a (case-insensitive) member name."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value.upper()]
        except KeyError:
            names = ", ".join(m.name.lower() for m in cls)
            raise ValueError(f"{what}: unknown {cls.__name__} {value!r} (one of {names})") from None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what}: expected a {cls.__name__}, a name or an int, got "
                        f"{type(value).__name__}")
    i = operator.index(value)
    try:
        return cls(i)
    except ValueError:
        raise ValueError(f"{what}: {i} is not a {cls.__name__}") from None


def maybe_enum(cls, value: int):
    """A value read from C: the member when known, else the raw int (never raises)."""
    try:
        return cls(value)
    except ValueError:
        return value


_LIMITS = {
    "u32": (0, 2**32 - 1),
    "u64": (0, 2**64 - 1),
    "i32": (-2**31, 2**31 - 1),
}


def integer(value, what: str, kind: str = "u32") -> int:
    """An int that fits the C type exactly: ctypes would wrap -1 or 2**32 silently."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what}: expected an integer, got {type(value).__name__}")
    i = operator.index(value)
    lo, hi = _LIMITS[kind]
    if not lo <= i <= hi:
        raise ValueError(f"{what}: {i} does not fit the C type ({kind}: {lo}..{hi})")
    return i


def u32(value, what: str) -> int:
    return integer(value, what, "u32")


def u64(value, what: str) -> int:
    return integer(value, what, "u64")


# ---------------------------------------------------------------------------------------------
# Arrays
# ---------------------------------------------------------------------------------------------
def _host_or_refuse(obj, what: str):
    """An ndarray view of obj when it is host memory; None when obj is no array protocol this
    module reads (the caller tries numpy's own conversions); MemorySpaceError for device
    memory."""
    if not (isinstance(obj, DeviceArray) or hasattr(obj, "__cuda_array_interface__") or
            (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"))):
        return None
    ref = array_ref(obj, what)
    if ref.host is not None:
        return ref.host
    raise MemorySpaceError(f"{what}: {ref.where} memory, and this call reads and writes host "
                           "memory (copy it to the host first: DeviceArray.numpy(), "
                           "tensor.cpu())")


def as_array(obj, what: str) -> np.ndarray:
    """A numpy view of a host input: ndarray, anything with __array_interface__ / __array__, or a
    DLPack producer of host memory. Device memory (__cuda_array_interface__, a DLPack
    producer on a device, a DeviceArray) raises MemorySpaceError."""
    if isinstance(obj, np.ndarray):
        return obj
    if obj is None:
        raise TypeError(f"{what}: expected an array, got None")
    arr = _host_or_refuse(obj, what)
    if arr is not None:
        return arr
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        return np.asarray(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return np.frombuffer(obj, dtype=np.uint8)
    raise TypeError(f"{what}: expected an array (numpy, __array_interface__, __array__ or DLPack),"
                    f" got {type(obj).__name__}")


def as_output(obj, what: str, dtype, shape_check=None) -> np.ndarray:
    """A caller-owned host output buffer: must be writable, C-contiguous, of exactly dtype, and
    written in place (so only ndarrays, __array_interface__ exporters and host DLPack producers,
    which numpy views without a copy). Device memory raises MemorySpaceError."""
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        arr = _host_or_refuse(obj, what)
        if arr is None:
            if not hasattr(obj, "__array_interface__"):
                raise TypeError(f"{what}: an output buffer must be a numpy array or expose "
                                f"__array_interface__ or DLPack, got {type(obj).__name__}")
            arr = np.asarray(obj)
    if arr.dtype != np.dtype(dtype):
        raise TypeError(f"{what}: dtype must be {np.dtype(dtype)}, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous")
    if not arr.flags.writeable:
        raise ValueError(f"{what}: must be writable")
    return arr


def contiguous(arr: np.ndarray, what: str) -> np.ndarray:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous (np.ascontiguousarray makes a copy that is)")
    return arr


def typed_input(obj, what: str, dtype, ndim=None) -> np.ndarray:
    """An input of exactly dtype (no silent conversion) and C-contiguous."""
    arr = as_array(obj, what)
    if arr.dtype != np.dtype(dtype):
        raise TypeError(f"{what}: dtype must be {np.dtype(dtype)}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimension(s), got shape {arr.shape}")
    return contiguous(arr, what)


def ptr(arr: np.ndarray, ctype=None):
    if ctype is None:
        return ctypes.c_void_p(arr.ctypes.data)
    return arr.ctypes.data_as(ctypes.POINTER(ctype))


# numpy equivalents of the element types, for row arrays. bf16 has no numpy dtype: its rows are
# uint16 bit patterns (or ml_dtypes' "bfloat16" when the caller uses it); fp8 likewise uint8 or
# ml_dtypes' "float8_e4m3fn".
_ELEMENT_DTYPES = {
    DType.BF16: ("bfloat16", np.dtype(np.uint16)),
    DType.FP16: ("float16", np.dtype(np.float16)),
    DType.FP32: ("float32", np.dtype(np.float32)),
    DType.FP8_E4M3: ("float8_e4m3fn", np.dtype(np.uint8)),
}


def element_dtype_ok(arr_dtype: np.dtype, dtype: int) -> bool:
    try:
        name, bits = _ELEMENT_DTYPES[DType(dtype)]
    except ValueError:
        return False
    return arr_dtype == bits or arr_dtype.name == name


def numpy_dtype(dtype) -> np.dtype:
    """The numpy dtype holding one element of a kvtier dtype (bf16: uint16 bits; fp8: uint8)."""
    return _ELEMENT_DTYPES[to_enum(DType, dtype, "dtype")][1]


def bf16_from_float32(x) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even; NaN stays a quiet NaN.
    The same rounding as kvt_ref_store (checked bit for bit in test_ref.py)."""
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_to_float32(b) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly."""
    a = np.ascontiguousarray(np.asarray(b, dtype=np.uint16))
    return (a.astype(np.uint32) << 16).view(np.float32)
