"""The KV cache the reference engine attends through, behind one interface.

The interface follows kvtier's step (lib/kvtier.h, "Batches") so that a store backed by the
kvtier binding is a thin adaptor:

    engine                           KVStore                      kvtier
    ------                           -------                      ------
    new request                      add_sequence(id, prompt)     kvt_seq_create (prompt_rows:
                                                                  the protected prompt)
    a step's new tokens              reserve(ids, n_new)          kvt_batch_reserve, then
                                       -> positions per request   kvt_batch_slot_mapping +
                                                                  kvt_batch_plan
    per layer, after q/k/v + RoPE:
      cache the step's rows          write(layer, k, v)           kvt_layer_write / cache-write
                                                                  kernel at slot_mapping
      rows attention reads           attended(layer)              kvt_batch_run -> emit (slots)
                                       -> Rows per request        -> gather K/V at those slots
      attention over exactly those rows (the engine masks by position: causal, and the window
      of a sliding layer)
    end of step                      commit()                     kvt_batch_commit
    request done                     remove_sequence(id)          kvt_seq_destroy

Rows are post-RoPE keys and values, one row per (token, KV head), in the order of
`reserve`: request order, then token order. `attended` returns, per request, positions and
rows per KV head — [n_kv, n] positions, [n_kv, n, head_dim] K and V — because random eviction
keeps a different set of positions in each KV head (the same count in all). The set always
includes the step's own rows; the engine applies the causal and window masks from the
positions, so a store may return a superset of what a query can see (the dense store does, for
multi-token steps on sliding layers) but never less.

A store never sees queries. Recall (kvtier's recall tier) would need the step's queries: when it
lands, `attended(layer, query=...)` grows an optional argument, as kvt_batch_run's `query`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache geometry (the part of kvt_layer_spec the engine needs)."""

    kind: str  # "full" (global attention) or "sliding"
    n_kv_heads: int
    head_dim: int
    window: int = 0  # tokens a query sees on a sliding layer, itself included (q - k < window)
    n_q_heads: int = 0  # query heads reading the layer (0: not stated; a recall trigger needs it)


@dataclass
class Rows:
    """What one request's attention reads in one layer this step."""

    pos: np.ndarray  # int64 [n_kv, n]: original positions, ascending in each head
    k: np.ndarray  # [n_kv, n, head_dim]: keys after RoPE
    v: np.ndarray  # [n_kv, n, head_dim]


def specs_for(config) -> list[LayerSpec]:
    """Layer specs of a GemmaConfig (gguf_model.GemmaConfig)."""
    return [LayerSpec("sliding" if config.is_sliding(i) else "full", config.n_kv_heads,
                      config.head_dim, config.sliding_window if config.is_sliding(i) else 0,
                      config.n_heads)
            for i in range(config.n_layers)]


class KVStore(ABC):
    """A model's KV cache (every layer) for a set of requests. One step at a time:
    reserve -> (write, attended) per layer in layer order -> commit."""

    def __init__(self, layers: Sequence[LayerSpec]):
        self.layers = list(layers)

    @abstractmethod
    def add_sequence(self, seq_id: int, prompt_rows: int = 0) -> None:
        """Start request seq_id. prompt_rows: how many of its first tokens are the prompt (the
        rows a store that evicts must protect); 0 when unknown."""

    @abstractmethod
    def remove_sequence(self, seq_id: int) -> None:
        """Forget a request and free its rows."""

    @abstractmethod
    def length(self, seq_id: int) -> int:
        """Committed tokens of a request (the position its next token takes)."""

    @abstractmethod
    def reserve(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> list[np.ndarray]:
        """Open a step: room for n_new[i] tokens of seq_ids[i] in every layer, all or nothing.
        Returns the new tokens' positions (int64) per request."""

    @abstractmethod
    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """The step's rows of one layer: k, v [total_new, n_kv, head_dim], in reserve order."""

    @abstractmethod
    def attended(self, layer: int) -> list[Rows]:
        """After write(layer): the rows each request of the step attends in this layer (its
        policy work for the step done first), in reserve order."""

    @abstractmethod
    def commit(self) -> None:
        """Close the step: the reserved tokens become committed."""

    def _step_args(self, seq_ids, n_new) -> tuple[list[int], list[int]]:
        """reserve's arguments checked: no step in flight, distinct requests, one non-negative
        count each."""
        if getattr(self, "_step", None) is not None:
            raise RuntimeError("a step is in flight: commit it first")
        ids, ns = [int(s) for s in seq_ids], [int(n) for n in n_new]
        if len(set(ids)) != len(ids) or len(ids) != len(ns) or min(ns, default=0) < 0:
            raise ValueError("reserve: distinct requests, one non-negative count each")
        return ids, ns


class _Seq:
    __slots__ = ("length", "prompt_rows", "k", "v", "start", "n")

    def __init__(self, n_layers: int, prompt_rows: int):
        self.length = 0
        self.prompt_rows = prompt_rows
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.start = [0] * n_layers  # position of stored row 0 (sliding layers trim)
        self.n = [0] * n_layers  # rows stored


class DenseStore(KVStore):
    """Every row of every full-attention layer; the last `window` rows (plus the step's) of a
    sliding layer. numpy arrays per (request, layer), grown by doubling; dtype float32 by default
    (float16 shows what a half-precision pool costs in accuracy)."""

    def __init__(self, layers: Sequence[LayerSpec], dtype=np.float32):
        super().__init__(layers)
        self.dtype = np.dtype(dtype)
        self.seqs: dict[int, _Seq] = {}
        self._step: tuple[list[int], list[int]] | None = None
        self._written: list[bool] = []

    # -- requests -------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt_rows=0):
        if seq_id in self.seqs:
            raise KeyError(f"request {seq_id} exists")
        self.seqs[seq_id] = _Seq(len(self.layers), prompt_rows)

    def remove_sequence(self, seq_id):
        if self._step and seq_id in self._step[0]:
            raise RuntimeError(f"request {seq_id} is in the step in flight")
        del self.seqs[seq_id]

    def length(self, seq_id):
        return self.seqs[seq_id].length

    # -- step -----------------------------------------------------------------------------
    def reserve(self, seq_ids, n_new):
        ids, ns = self._step_args(seq_ids, n_new)
        for s, n in zip(ids, ns):
            q = self.seqs[s]
            for li, spec in enumerate(self.layers):
                need = q.n[li] + n
                k = q.k[li]
                if k is None or k.shape[1] < need:
                    cap = max(need, 2 * (k.shape[1] if k is not None else 0), 64)
                    nk = np.empty((spec.n_kv_heads, cap, spec.head_dim), self.dtype)
                    nv = np.empty_like(nk)
                    if k is not None:
                        nk[:, :q.n[li]] = k[:, :q.n[li]]
                        nv[:, :q.n[li]] = q.v[li][:, :q.n[li]]
                    q.k[li], q.v[li] = nk, nv
        self._step = (ids, ns)
        self._written = [False] * len(self.layers)
        return [np.arange(self.seqs[s].length, self.seqs[s].length + n, dtype=np.int64)
                for s, n in zip(ids, ns)]

    def write(self, layer, k, v):
        ids, ns = self._need_step()
        total = sum(ns)
        spec = self.layers[layer]
        want = (total, spec.n_kv_heads, spec.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"write: k {k.shape}, v {v.shape}, expected {want}")
        o = 0
        for s, n in zip(ids, ns):
            q = self.seqs[s]
            a = q.n[layer]
            q.k[layer][:, a:a + n] = k[o:o + n].transpose(1, 0, 2)
            q.v[layer][:, a:a + n] = v[o:o + n].transpose(1, 0, 2)
            o += n
        self._written[layer] = True

    def attended(self, layer):
        ids, ns = self._need_step()
        if not self._written[layer]:
            raise RuntimeError(f"attended({layer}) before write({layer})")
        spec = self.layers[layer]
        out = []
        for s, n in zip(ids, ns):
            q = self.seqs[s]
            end = q.n[layer] + n  # stored rows, this step's included
            lo = 0
            if spec.kind == "sliding":
                # The step's first query (position q.length) sees positions > q.length - window.
                lo = max(0, q.length - spec.window + 1 - q.start[layer])
            pos = np.arange(q.start[layer] + lo, q.start[layer] + end, dtype=np.int64)
            out.append(Rows(np.broadcast_to(pos, (spec.n_kv_heads, pos.size)),
                            q.k[layer][:, lo:end], q.v[layer][:, lo:end]))
        return out

    def commit(self):
        ids, ns = self._need_step()
        if not all(self._written):
            missing = [i for i, w in enumerate(self._written) if not w]
            raise RuntimeError(f"commit: layers {missing[:8]} never written")
        for s, n in zip(ids, ns):
            q = self.seqs[s]
            q.length += n
            for li, spec in enumerate(self.layers):
                q.n[li] += n
                if spec.kind == "sliding" and q.n[li] > 2 * spec.window:
                    # Keep the last window rows; the copy is amortised over window tokens.
                    drop = q.n[li] - spec.window
                    keep = spec.window
                    q.k[li][:, :keep] = q.k[li][:, drop:q.n[li]].copy()
                    q.v[li][:, :keep] = q.v[li][:, drop:q.n[li]].copy()
                    q.start[li] += drop
                    q.n[li] = keep
        self._step = None

    def _need_step(self):
        if self._step is None:
            raise RuntimeError("no step in flight: reserve first")
        return self._step

    def stored_rows(self, seq_id: int) -> list[int]:
        """Rows held per layer (per KV head), for reports."""
        return list(self.seqs[seq_id].n)
