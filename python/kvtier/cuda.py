"""The few CUDA runtime calls a step needs from Python: a stream and a captured graph.

torch and CuPy users do not need this module: pass ``torch.cuda.Stream`` / ``cupy.cuda.Stream``
(anything with ``cuda_stream``) as ``stream=`` and capture with ``torch.cuda.graph``. Without them,
:class:`Stream` and :meth:`Stream.capture` drive kvtier's graph path (``Batch.plan_device``,
docs/guide.md) through the CUDA runtime found at import:

1. the library itself when it is the CUDA emulation build (``-DKVT_CUDA_EMU=ON``, which exports
   its emulated runtime: ``emulated()`` is True; docs/cuda-emulation.md);
2. ``$KVTIER_CUDART`` (a path), else ``libcudart.so`` (the CUDA toolkit's, or the
   nvidia-cuda-runtime wheel's on the loader's path).

``available()`` is False when none is found; :class:`Stream` then raises :class:`CudaError`.
A stream and graph of another copy of the runtime work with kvtier's (both are the driver's
objects).

>>> s = kvtier.cuda.Stream()
>>> with s.capture() as cap:          # the engine's forward: kvt_batch_run of every layer
...     for layer in range(n_layers):
...         batch.run(layer, emission=emits[layer], stream=s)
>>> cap.graph.launch(s)                # a later planned step: reserve, plan, plan_device, launch
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

from ._lib import lib

_CAPTURE_MODE = {"global": 0, "thread_local": 1, "relaxed": 2}


class CudaError(RuntimeError):
    """A CUDA runtime call failed (or no runtime was found): ``code`` and ``name`` say which."""

    def __init__(self, function: str, code: int, name: str):
        self.function, self.code, self.name = function, code, name
        super().__init__(f"{function}: {name} ({code})")


def _load():
    if hasattr(lib, "cudaStreamBeginCapture"):  # the emulation build exports its runtime
        return lib, True
    names = [os.environ["KVTIER_CUDART"]] if os.environ.get("KVTIER_CUDART") else \
        [ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.12"]
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name), False
        except OSError:
            continue
    return None, False


_rt, _emulated = _load()
_vp, _int = ctypes.c_void_p, ctypes.c_int
if _rt is not None:
    for _name, _args in (("cudaStreamCreateWithFlags", [ctypes.POINTER(_vp), ctypes.c_uint]),
                         ("cudaStreamDestroy", [_vp]), ("cudaStreamSynchronize", [_vp]),
                         ("cudaStreamBeginCapture", [_vp, _int]),
                         ("cudaStreamEndCapture", [_vp, ctypes.POINTER(_vp)]),
                         ("cudaGraphInstantiate", [ctypes.POINTER(_vp), _vp,
                                                   ctypes.c_ulonglong]),
                         ("cudaGraphLaunch", [_vp, _vp]), ("cudaGraphExecDestroy", [_vp]),
                         ("cudaGraphDestroy", [_vp]), ("cudaGetDevice", [ctypes.POINTER(_int)]),
                         ("cudaGetDeviceCount", [ctypes.POINTER(_int)])):
        _f = getattr(_rt, _name)
        _f.restype, _f.argtypes = _int, _args
    _rt.cudaGetErrorName.restype, _rt.cudaGetErrorName.argtypes = ctypes.c_char_p, [_int]


def available() -> bool:
    """A CUDA runtime was found (not that a device is present: see device_count())."""
    return _rt is not None


def emulated() -> bool:
    """The runtime is the CUDA emulation's, inside libkvtier.so (-DKVT_CUDA_EMU=ON)."""
    return _emulated


def _check(function: str, code: int) -> None:
    if code:
        raise CudaError(function, code, _rt.cudaGetErrorName(code).decode())


def _need():
    if _rt is None:
        raise CudaError("kvtier.cuda", -1, "no CUDA runtime found (libcudart.so, "
                        "$KVTIER_CUDART, or a -DKVT_CUDA_EMU=ON library)")
    return _rt


def device_count() -> int:
    """cudaGetDeviceCount (0 when no runtime or no device)."""
    if _rt is None:
        return 0
    n = _int()
    return n.value if _rt.cudaGetDeviceCount(ctypes.byref(n)) == 0 else 0


def current_device() -> int | None:
    """cudaGetDevice (None without a runtime)."""
    if _rt is None:
        return None
    d = _int()
    return d.value if _rt.cudaGetDevice(ctypes.byref(d)) == 0 else None


class Graph:
    """An instantiated graph (cudaGraphExec_t) captured by :meth:`Stream.capture`."""

    def __init__(self, graph: int, exec_: int):
        self._graph, self._exec = graph, exec_

    def launch(self, stream: "Stream") -> None:
        """cudaGraphLaunch on stream."""
        if not self._exec:
            raise ValueError("this graph is closed")
        _check("cudaGraphLaunch", _rt.cudaGraphLaunch(self._exec, stream.cuda_stream))

    def close(self) -> None:
        if self._exec:
            _rt.cudaGraphExecDestroy(self._exec)
            _rt.cudaGraphDestroy(self._graph)
        self._exec = self._graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class _Capture:
    graph: Graph | None = None


class Stream:
    """A non-blocking CUDA stream (cudaStreamCreateWithFlags). Pass it as ``stream=`` (its
    ``cuda_stream`` is the cudaStream_t)."""

    def __init__(self):
        rt = _need()
        s = _vp()
        _check("cudaStreamCreateWithFlags", rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1))
        self._s = s.value

    @property
    def cuda_stream(self) -> int:
        if not self._s:
            raise ValueError("this stream is closed")
        return self._s

    def synchronize(self) -> None:
        _check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(self.cuda_stream))

    @contextlib.contextmanager
    def capture(self, mode: str = "thread_local"):
        """Capture the work enqueued on this stream inside the block into a graph
        (cudaStreamBeginCapture / EndCapture / GraphInstantiate); the result's ``graph`` is set
        when the block ends without an exception. A call the capture forbids fails inside the
        block with the runtime's error (kvtier's: a KvtError naming the backend status)."""
        s = self.cuda_stream
        _check("cudaStreamBeginCapture", _rt.cudaStreamBeginCapture(s, _CAPTURE_MODE[mode]))
        cap = _Capture()
        graph = _vp()
        try:
            yield cap
        except BaseException:
            _rt.cudaStreamEndCapture(s, ctypes.byref(graph))
            if graph.value:
                _rt.cudaGraphDestroy(graph.value)
            raise
        _check("cudaStreamEndCapture", _rt.cudaStreamEndCapture(s, ctypes.byref(graph)))
        exec_ = _vp()
        code = _rt.cudaGraphInstantiate(ctypes.byref(exec_), graph.value, 0)
        if code:
            _rt.cudaGraphDestroy(graph.value)
            _check("cudaGraphInstantiate", code)
        cap.graph = Graph(graph.value, exec_.value)

    def close(self) -> None:
        if self._s:
            _rt.cudaStreamDestroy(self._s)
        self._s = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
