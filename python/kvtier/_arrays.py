"""Arrays in other memory spaces: DLPack and ``__cuda_array_interface__`` in and out, typed plane
views.

In: :func:`array_ref` reads any array-like (numpy, ``__array_interface__``,
``__cuda_array_interface__`` v2/v3, a DLPack producer: ``__dlpack__`` / ``__dlpack_device__``,
legacy or versioned capsules) into an :class:`ArrayRef`: its address, shape, dtype, contiguity and
device, the pointer exactly as the producer gave it (``data + byte_offset``), with the capsule or
object kept alive by the reference. Host arrays become numpy views (no copy); device arrays are
never dereferenced here.

Out: :class:`DeviceArray` describes backend memory (a kvt_buffer, a plane on the CUDA backend)
without touching it and exports it to torch / CuPy / JAX by ``__cuda_array_interface__`` (v3) and
DLPack (a legacy ``"dltensor"`` capsule, bf16 as DLPack's bfloat type); ``numpy()`` copies it to
the host through the library. :class:`PlaneView` is the CPU backend's zero-copy plane, typed by the
layer's dtype, refusing any assignment that numpy would cast.
"""

from __future__ import annotations

import ctypes

import numpy as np

# DLPack device types (dlpack.h)
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
_HOST_DEVICES = (DL_CPU, DL_CUDA_HOST, DL_CUDA_MANAGED)  # the host may read these
_DEVICE_NAMES = {DL_CPU: "cpu", DL_CUDA: "cuda", DL_CUDA_HOST: "cuda_host",
                 DL_CUDA_MANAGED: "cuda_managed"}
# DLPack type codes
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6

BF16 = "bfloat16"  # kvtier's name for a uint16 array that holds bf16 bit patterns


class MemorySpaceError(TypeError):
    """An array in the wrong memory space for the call: device memory where the call reads host
    memory, or host memory where the backend reads and writes device memory."""


def device_name(device_type: int, device_id) -> str:
    name = _DEVICE_NAMES.get(device_type, f"DLPack device type {device_type}")
    return name if device_id is None else f"{name}:{device_id}"


class ArrayRef:
    """An array's address and description. ``host`` is a numpy view for host memory (None for
    device memory). ``device``: (DLPack device type, id or None when the producer did not say)."""

    __slots__ = ("ptr", "shape", "dtype", "dtype_name", "contiguous", "writable", "device",
                 "host", "keep")

    def __init__(self, ptr, shape, dtype, dtype_name, contiguous, writable, device, host, keep):
        self.ptr, self.shape, self.dtype, self.dtype_name = ptr, shape, dtype, dtype_name
        self.contiguous, self.writable, self.device = contiguous, writable, device
        self.host, self.keep = host, keep

    @property
    def on_host(self) -> bool:
        return self.device[0] in _HOST_DEVICES

    @property
    def where(self) -> str:
        return "host" if self.device[0] == DL_CPU else device_name(*self.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _numpy_ref(arr: np.ndarray) -> ArrayRef:
    return ArrayRef(arr.ctypes.data, arr.shape, arr.dtype, arr.dtype.name,
                    arr.flags.c_contiguous, arr.flags.writeable, (DL_CPU, 0), arr, arr)


def _c_contiguous(shape, strides_elems) -> bool:
    """Element strides of a C-contiguous array (dimensions of extent 1 may have any stride)."""
    want = 1
    for n, s in zip(reversed(shape), reversed(strides_elems)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def _cai_ref(obj, cai, what) -> ArrayRef:
    try:
        shape = tuple(int(n) for n in cai["shape"])
        dtype = np.dtype(cai["typestr"])
        address, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as e:
        raise TypeError(f"{what}: malformed __cuda_array_interface__: {e}") from None
    if cai.get("mask") is not None:
        raise TypeError(f"{what}: a masked __cuda_array_interface__ is not supported")
    strides = cai.get("strides")
    contiguous = True
    if strides is not None:
        if any(s % dtype.itemsize for s in strides):
            contiguous = False
        else:
            contiguous = _c_contiguous(shape, [s // dtype.itemsize for s in strides])
    return ArrayRef(int(address or 0), shape, dtype, dtype.name, contiguous, not readonly,
                    (DL_CUDA, None), None, obj)


# --- DLPack structs (dlpack.h, v0.8 legacy and v1.x versioned) --------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DL_FLAG_READ_ONLY = 1

_api = ctypes.pythonapi
_CapsuleGetName = _api.PyCapsule_GetName
_CapsuleGetName.restype, _CapsuleGetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
_CapsuleGetPointer = _api.PyCapsule_GetPointer
_CapsuleGetPointer.restype = ctypes.c_void_p
_CapsuleGetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CapsuleNew = _api.PyCapsule_New
_CapsuleNew.restype = ctypes.py_object
_CapsuleNew.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
# The capsule destructor gets the capsule as a raw PyObject *: these two take it so.
_CapsuleIsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_CapsuleGetPointerRaw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_DLTENSOR = b"dltensor"
_DLTENSOR_VERSIONED = b"dltensor_versioned"


def _dl_dtype(t: _DLTensor, what: str) -> tuple[np.dtype, str]:
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    if lanes != 1 or bits % 8:
        raise TypeError(f"{what}: DLPack dtype (code {code}, {bits} bits, {lanes} lanes) "
                        "is not supported")
    kind = {_DL_INT: "i", _DL_UINT: "u", _DL_FLOAT: "f", _DL_BOOL: "b"}.get(code)
    if code == _DL_BFLOAT and bits == 16:
        return np.dtype(np.uint16), BF16
    if kind is None:
        raise TypeError(f"{what}: DLPack type code {code} is not supported")
    dt = np.dtype(f"{kind}{bits // 8}" if kind != "b" else "?")
    return dt, dt.name


def _dlpack_ref(obj, what) -> ArrayRef:
    try:
        dev_type, dev_id = obj.__dlpack_device__()
    except Exception as e:  # noqa: BLE001  the producer's own refusal, named
        raise TypeError(f"{what}: __dlpack_device__ failed: {e}") from e
    if dev_type == DL_CPU:  # host memory: numpy's own consumer (zero copy)
        try:
            arr = np.from_dlpack(obj)
        except (RuntimeError, TypeError, BufferError, ValueError) as e:
            raise TypeError(f"{what}: DLPack object not readable as host memory: {e}") from e
        ref = _numpy_ref(arr)
        ref.keep = (arr, obj)
        return ref
    try:
        cap = obj.__dlpack__()
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"{what}: __dlpack__ failed: {e}") from e
    name = _CapsuleGetName(cap)
    if name not in (_DLTENSOR, _DLTENSOR_VERSIONED):
        raise TypeError(f"{what}: __dlpack__ gave a capsule named {name!r} (already consumed?)")
    p = _CapsuleGetPointer(cap, name)
    writable = True
    if name == _DLTENSOR:
        t = _DLManagedTensor.from_address(p).dl_tensor
    else:
        m = _DLManagedTensorVersioned.from_address(p)
        t, writable = m.dl_tensor, not (m.flags & _DL_FLAG_READ_ONLY)
    dtype, dtype_name = _dl_dtype(t, what)
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    contiguous = not t.strides or _c_contiguous(shape, [int(t.strides[i])
                                                        for i in range(t.ndim)])
    ptr = (t.data or 0) + int(t.byte_offset)
    dev = (int(t.device.device_type), int(t.device.device_id))
    if dev != (dev_type, dev_id):
        raise TypeError(f"{what}: __dlpack_device__ says {device_name(dev_type, dev_id)}, "
                        f"the tensor {device_name(*dev)}")
    # The capsule stays unconsumed and alive with the reference: its destructor calls the
    # producer's deleter when the reference goes (the DLPack protocol's rule).
    return ArrayRef(ptr, shape, dtype, dtype_name, contiguous, writable, dev, None, (cap, obj))


def array_ref(obj, what: str) -> ArrayRef:
    """Describe obj without copying it: numpy and ``__array_interface__`` (host),
    :class:`DeviceArray`, ``__cuda_array_interface__`` (CUDA), DLPack (any device)."""
    if isinstance(obj, np.ndarray):
        return _numpy_ref(obj)
    if isinstance(obj, DeviceArray):
        return obj._ref()
    if obj is None:
        raise TypeError(f"{what}: expected an array, got None")
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is not None:
        return _cai_ref(obj, cai, what)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _dlpack_ref(obj, what)
    if hasattr(obj, "__array_interface__"):
        return _numpy_ref(np.asarray(obj))
    raise TypeError(f"{what}: expected an array (numpy, __array_interface__, "
                    f"__cuda_array_interface__ or DLPack), got {type(obj).__name__}")


# --- DLPack out ---------------------------------------------------------------------------
_exported: dict[int, tuple] = {}  # DLManagedTensor address -> what it keeps alive


def _delete(address) -> None:
    _exported.pop(address, None)


_deleter = _DELETER(_delete)


def _capsule_gone(capsule) -> None:
    # An unconsumed capsule frees its tensor; a consumed one ("used_dltensor") leaves that to
    # the consumer, which calls the deleter.
    if _CapsuleIsValid(capsule, _DLTENSOR):
        _delete(_CapsuleGetPointerRaw(capsule, _DLTENSOR))


_capsule_destructor = _CAPSULE_DESTRUCTOR(_capsule_gone)


def _dl_type_of(dtype: np.dtype, dtype_name: str) -> tuple[int, int]:
    if dtype_name == BF16:
        return _DL_BFLOAT, 16
    code = {"i": _DL_INT, "u": _DL_UINT, "f": _DL_FLOAT, "b": _DL_BOOL}.get(dtype.kind)
    if code is None:
        raise BufferError(f"no DLPack type for {dtype}")
    return code, dtype.itemsize * 8


def dlpack_capsule(ptr: int, shape, dtype: np.dtype, dtype_name: str, device, owner):
    """A legacy ``"dltensor"`` capsule over ptr (C-contiguous), keeping owner alive until the
    consumer calls the deleter (or the capsule goes unconsumed)."""
    m = _DLManagedTensor()
    dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    t = m.dl_tensor
    t.data = ptr or None
    t.device.device_type, t.device.device_id = device
    t.ndim = len(shape)
    t.dtype.code, t.dtype.bits = _dl_type_of(dtype, dtype_name)
    t.dtype.lanes = 1
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    t.strides = None
    t.byte_offset = 0
    m.deleter = _deleter
    address = ctypes.addressof(m)
    _exported[address] = (m, dims, owner)
    return _CapsuleNew(address, _DLTENSOR, _capsule_destructor)


class DeviceArray:
    """A typed, C-contiguous view of backend memory the host may not touch: a kvt_buffer's bytes
    (``Buffer.view``, ``Batch.emission`` on the CUDA and guarded backends) or a plane of a CUDA
    context (``Context.plane``). ``ptr``: its address in the backend's space; ``device``:
    (DLPack device type, id). Exported to torch / CuPy / JAX zero-copy by
    ``__cuda_array_interface__`` (v3) and ``__dlpack__`` on CUDA (bf16 planes as DLPack's
    bfloat16; ``__cuda_array_interface__`` has no bf16 and says uint16); the guarded backend's
    memory is exported by neither (the host must not touch it). ``numpy()`` copies it to the
    host through the library (kvt_buffer_read / kvt_layer_read), ``write(a)`` copies a host
    array of the same dtype and size in. Keeps its context (or buffer) alive."""

    __slots__ = ("ptr", "shape", "dtype", "dtype_name", "device", "_owner", "_read", "_write",
                 "__weakref__")

    def __init__(self, ptr, shape, dtype, device, owner, read, write=None, dtype_name=None):
        self.ptr, self.shape, self.dtype = int(ptr), tuple(int(n) for n in shape), np.dtype(dtype)
        self.dtype_name = dtype_name or self.dtype.name
        self.device, self._owner, self._read, self._write = device, owner, read, write

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def _ref(self) -> ArrayRef:
        return ArrayRef(self.ptr, self.shape, self.dtype, self.dtype_name, True, True,
                        self.device, None, self)

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device[0] != DL_CUDA:
            raise AttributeError("__cuda_array_interface__: not CUDA memory "
                                 f"({device_name(*self.device)})")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "strides": None, "version": 3, "stream": None}

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A legacy DLPack capsule (stream ignored: kvtier's work is ordered on the step's
        stream, which the caller synchronises with its own). BufferError for memory the host
        must not see (the guarded backend) and for copy=True."""
        if self.device[0] not in (DL_CPU, DL_CUDA):
            raise BufferError(f"{device_name(*self.device)} memory cannot be exported")
        if copy:
            raise BufferError("DeviceArray: copy=True is not supported (zero-copy only)")
        if dl_device is not None and tuple(dl_device) != tuple(self.device):
            raise BufferError(f"DeviceArray lives on {device_name(*self.device)}")
        return dlpack_capsule(self.ptr, self.shape, self.dtype, self.dtype_name, self.device,
                              self)

    def numpy(self) -> np.ndarray:
        """A host copy (through the library, never by dereferencing ptr)."""
        out = np.empty(self.shape, dtype=self.dtype)
        self._read(out)
        return out

    def write(self, data) -> None:
        """Copy a host array of exactly this dtype and byte size in (through the library)."""
        if self._write is None:
            raise TypeError("this DeviceArray is read-only from the host")
        a = np.ascontiguousarray(data)
        if a.dtype != self.dtype or a.nbytes != self.nbytes:
            raise TypeError(f"write: expected {self.nbytes} bytes of {self.dtype}, got "
                            f"{a.nbytes} of {a.dtype}")
        self._write(a)

    def __repr__(self):
        return (f"<kvtier.DeviceArray {device_name(*self.device)} {self.dtype_name}"
                f"{list(self.shape)} at {self.ptr:#x}>")


# --- typed planes ---------------------------------------------------------------------------
class PlaneView(np.ndarray):
    """A zero-copy view of a context's plane on the CPU backend, typed by the layer's dtype:
    float32, float16, bf16 as uint16 bit patterns (``kvt_dtype`` names it), fp8 rows and rows
    mixing types as bytes (uint8). Assigning an array of another dtype raises TypeError instead
    of numpy's silent cast (a float32 array into a bf16 plane would otherwise be truncated to
    integers): convert first (``kvtier.bf16_from_float32``, ``astype(np.float16)``); an
    ml_dtypes bfloat16 array goes into a bf16 plane as is."""

    kvt_dtype = None

    def __array_finalize__(self, obj):
        self.kvt_dtype = getattr(obj, "kvt_dtype", None)

    def __setitem__(self, key, value):
        v = value if isinstance(value, np.ndarray) else np.asarray(value)
        if v.dtype != self.dtype:
            if v.dtype.name == BF16 and self.dtype == np.uint16 and v.dtype.itemsize == 2:
                v = v.view(np.uint16)
            else:
                name = getattr(self.kvt_dtype, "name", self.dtype.name).lower()
                raise TypeError(f"plane: assigning {v.dtype} into a {name} plane (stored as "
                                f"{self.dtype}) would cast it; convert it first "
                                "(kvtier.bf16_from_float32 for bf16)")
        super().__setitem__(key, v)
