"""kvtier: Python binding (ctypes) of the kvtier C library's public API (lib/kvtier.h).

>>> import kvtier
>>> with kvtier.Model.from_file("kimi-linear-48b-a3b-instruct.json") as model, \\
...         kvtier.Context(model, kvtier.Config(ratio=32)) as ctx:
...     seq = ctx.sequence(request_id=1, prompt_rows=128)
...     batch = ctx.batch(max_seqs=8)

The library is found in the installed package (kvtier/lib/libkvtier.so, built by
``pip install ./python``), or at $KVTIER_LIBRARY, or next to the package. ``__version__`` is the
loaded library's own version string (kvt_version()).
"""

from . import _lib
from ._api import (Batch, Buffer, CensusTotals, Config, Context, Emission, LayerSpec, LayerStats, Model,
                   RecallBasis, Sequence, config_default, dtype_bytes, dtype_name, last_error,
                   layer_kind_name, orthonormalise_rows, policy_for_kind, policy_name,
                   recall_mode_name,
                   recall_basis_read, recall_basis_write, rows_as_elements, snapshot_clean,
                   version, version_info, version_number)
from ._arrays import DeviceArray, MemorySpaceError, PlaneView
from ._errors import *  # noqa: F401,F403  Status, KvtError and one subclass per error status
from ._errors import ERROR_CLASSES, KvtError, Status, status_name, strerror
from ._types import (Allocator, Space, Backend, DType, EmitFlag, EmitLayout, LayerKind, Policy,
                     RecallMode, RowState, Selector, SigmaBasis, bf16_from_float32,
                     bf16_to_float32, numpy_dtype)
from . import cuda, ref, trace

__version__ = version()
library_path = str(_lib.library_path)

__all__ = [
    "__version__", "library_path", "version", "version_info", "version_number", "last_error",
    "Status", "KvtError", "ERROR_CLASSES", "strerror", "status_name",
    "LayerKind", "DType", "Policy", "RecallMode", "Selector", "SigmaBasis", "Backend", "Allocator",
    "Space",
    "EmitFlag", "EmitLayout", "RowState",
    "policy_for_kind", "layer_kind_name", "policy_name", "recall_mode_name", "dtype_name",
    "dtype_bytes",
    "LayerSpec", "Model", "CensusTotals", "Config", "config_default", "Context", "Sequence",
    "Batch", "Buffer", "Emission", "LayerStats", "rows_as_elements", "numpy_dtype",
    "snapshot_clean", "RecallBasis", "recall_basis_read", "recall_basis_write",
    "orthonormalise_rows",
    "bf16_from_float32", "bf16_to_float32", "ref", "trace", "cuda",
    "DeviceArray", "MemorySpaceError", "PlaneView",
] + [c.__name__ for c in ERROR_CLASSES.values()]
