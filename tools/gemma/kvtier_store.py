"""A KVStore whose rows live in kvtier's pool (the `kvtier` Python package over libkvtier).

The engine's step maps onto kvtier's batch step one call to one call:

    reserve(ids, n_new)   Batch.reserve (+ plan): slots for every new token in every layer
    write(layer, k, v)    the rows go straight into the layer's K and V planes at the step's
                          slot_mapping (what an engine's cache-write kernel does)
    attended(layer)       Batch.run(layer, queries_per_seq=S): the layer's policy work (an
                          eviction round on a global layer) and one causal attended set per query
                          token; the store gathers K and V at those slots
    commit()              Batch.commit: counts, pages back (sliding windows, rounds)

Policies: the sliding-window layers of Gemma-3 are kvtier's policy "none" on sliding layers (the
last `window` rows are attended; older pages go back to the pool); the global layers are
GQA-RoPE layers, under random eviction with the prompt protected (`mode="evict"`, DESIGN §2.2)
or every row attended (`mode="dense"`, policy none).

Positions. A set of a sliding or dense layer holds contiguous positions (row index = position).
Random eviction keeps a different set of positions in each KV head at the same slots, so the
store reads each head's row -> position map after every commit (kvt_seq_positions: between
steps only) and extends it with the step's positions. The step's tokens are reserved as drafts
(all accepted), which moves every round to the commit, so that map holds through the step.

Rows are float32 in the pool (kvtier's FP32 row dtype), so `mode="dense"` gives the same rows as
DenseStore and the same attention up to summation order.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from kvstore import KVStore, LayerSpec, Rows

try:
    import kvtier
except ImportError:  # a build tree: python/ next to tools/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    import kvtier


class KvtierStore(KVStore):
    """mode: "evict" (global layers under random eviction, kvtier's default for GQA-RoPE) or
    "dense" (every row of a global layer attended). ratio: K = max_tokens / ratio rows kept per
    head by a round on the global layers (or budget_rows); recent_rows r and the cadence c = r.
    max_tokens sizes the pool (every request may reach it); at most 256 new tokens per request
    per step (kvtier's per-token emission limit)."""

    def __init__(self, layers: Sequence[LayerSpec], mode: str = "evict", *, max_seqs: int = 32,
                 max_tokens: int = 4096, ratio: int = 8, budget_rows: int | None = None,
                 recent_rows: int = 64, archive: bool = False, seed: int = 0,
                 page_rows: int = 64):
        super().__init__(layers)
        if mode not in ("evict", "dense"):
            raise ValueError(f"mode: 'evict' or 'dense', not {mode!r}")
        self.mode = mode
        specs = []
        for sp in layers:
            kind = kvtier.LayerKind.SLIDING if sp.kind == "sliding" else kvtier.LayerKind.GQA_ROPE
            s = kvtier.LayerSpec.gqa(kind, kvtier.DType.FP32, sp.n_kv_heads, sp.head_dim)
            if sp.kind == "sliding":
                s.sliding_window = sp.window
            specs.append(s)
        self.model = kvtier.Model(specs, "gemma3-engine")
        K = budget_rows if budget_rows is not None else max(1, max_tokens // ratio)
        cfg = kvtier.Config(evict_budget_rows=K, recent_rows=recent_rows,
                            cadence_rows=recent_rows, evict_archive=archive, seed=seed)
        policies = None
        if mode == "dense":
            policies = [kvtier.Policy.NONE] * len(layers)
        pages = max_seqs * ((max_tokens + 256 + page_rows - 1) // page_rows + 2)
        self.ctx = kvtier.Context(self.model, cfg, page_rows=page_rows, n_pages=pages,
                                  layer_policies=policies, max_rows_per_seq=max_tokens + 256)
        self.batch = self.ctx.batch(max_seqs)
        self.evict = [self.ctx.layer_policy(i) == kvtier.Policy.EVICT for i in range(len(layers))]
        # K and V planes as float32 views [slots, n_kv, head_dim] (zero copy, CPU backend).
        self.planes = []
        for i, sp in enumerate(layers):
            kp = self.ctx.plane(i, 0).view(np.float32).reshape(-1, sp.n_kv_heads, sp.head_dim)
            vp = self.ctx.plane(i, 1).view(np.float32).reshape(-1, sp.n_kv_heads, sp.head_dim)
            self.planes.append((kp, vp))
        self.seqs: dict[int, kvtier.Sequence] = {}
        self.rowpos: dict[int, list] = {}  # per request, per evict layer: [n_kv] row -> position
        self._step: tuple[list[int], list[int], list[int]] | None = None
        self._written: list[bool] = []
        self._slots: list[np.ndarray | None] = []
        self.stats = {"rounds": 0}

    # -- requests -------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt_rows=0):
        if seq_id in self.seqs:
            raise KeyError(f"request {seq_id} exists")
        self.seqs[seq_id] = self.ctx.sequence(request_id=seq_id, prompt_rows=prompt_rows)
        self.rowpos[seq_id] = [None] * len(self.layers)

    def remove_sequence(self, seq_id):
        if self._step and seq_id in self._step[0]:
            raise RuntimeError(f"request {seq_id} is in the step in flight")
        self.seqs.pop(seq_id).close()
        del self.rowpos[seq_id]

    def length(self, seq_id):
        return self.seqs[seq_id].length

    # -- step -----------------------------------------------------------------------------
    def reserve(self, seq_ids, n_new):
        ids, ns = self._step_args(seq_ids, n_new)
        if max(ns, default=0) > kvtier._lib.MAX_QUERIES_PER_SEQ:
            raise ValueError(f"reserve: at most {kvtier._lib.MAX_QUERIES_PER_SEQ} new tokens per "
                             "request per step (chunk the prefill)")
        lengths = [self.seqs[s].length for s in ids]
        # Every token is reserved as a draft (all accepted at commit): each close and eviction
        # round of the step then runs at commit (kvt_batch_reserve_drafts), so during the step
        # the rows stay where the last commit left them and the per-head positions read then
        # stay valid; attention sees the committed set plus the step's rows, and the decisions
        # are those of the plain step.
        self.batch.reserve([self.seqs[s] for s in ids], ns, n_drafts=ns)
        self.batch.plan()
        self._step = (ids, ns, lengths)
        self._written = [False] * len(self.layers)
        self._slots = [None] * len(self.layers)
        return [np.arange(n0, n0 + n, dtype=np.int64) for n0, n in zip(lengths, ns)]

    def write(self, layer, k, v):
        ids, ns, _ = self._need_step()
        spec = self.layers[layer]
        want = (sum(ns), spec.n_kv_heads, spec.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"write: k {k.shape}, v {v.shape}, expected {want}")
        slots = self.batch.slot_mapping(layer)
        kp, vp = self.planes[layer]
        kp[slots] = k
        vp[slots] = v
        self._written[layer] = True

    def attended(self, layer):
        ids, ns, lengths = self._need_step()
        if not self._written[layer]:
            raise RuntimeError(f"attended({layer}) before write({layer})")
        spec = self.layers[layer]
        S = max(max(ns, default=1), 1)
        e = self.batch.run(layer, "csr", queries_per_seq=S)
        kp, vp = self.planes[layer]
        out = []
        for i, (s, n, n0) in enumerate(zip(ids, ns, lengths)):
            last = n - 1 if n > 0 else 0
            L = e.slots(i, last)
            end = n0 + n  # positions < end are visible to the step's last query
            if self.evict[layer]:
                # Every held row (the committed ones in row order, each head its own positions),
                # then the step's rows.
                rp = self.rowpos[s][layer]
                held = len(L) - n
                step_pos = np.arange(n0, end, dtype=np.int64)
                if rp is None:
                    rp = np.broadcast_to(np.arange(held, dtype=np.int64), (spec.n_kv_heads, held))
                if rp.shape[1] != held:
                    raise RuntimeError(f"layer {layer}: {held} rows held, {rp.shape[1]} mapped")
                pos = np.concatenate([rp, np.broadcast_to(step_pos, (spec.n_kv_heads, n))], 1)
                slots = L
            else:
                # Contiguous positions: query token t's set is a run ending at its own
                # position (a window on a sliding layer); the union of the step's sets runs from
                # the first query's start to the end (a chunk longer than the window needs the
                # middle queries' rows too).
                sets = [e.slots(i, t) for t in range(max(n, 1))]
                ends = [n0 + t + 1 for t in range(n)] if n > 0 else [n0]
                start = min(t_end - len(st) for st, t_end in zip(sets, ends))
                slots = np.full(end - start, -1, dtype=np.int32)
                for st, t_end in zip(sets, ends):
                    slots[t_end - len(st) - start:t_end - start] = st
                if (slots < 0).any():
                    raise RuntimeError(f"layer {layer}: the step's sets are not contiguous")
                pos = np.broadcast_to(np.arange(start, end, dtype=np.int64),
                                      (spec.n_kv_heads, end - start))
            k = kp[slots].transpose(1, 0, 2)
            v = vp[slots].transpose(1, 0, 2)
            out.append(Rows(np.ascontiguousarray(pos), k, v))
        return out

    def commit(self):
        ids, ns, _ = self._need_step()
        if not all(self._written):
            missing = [i for i, w in enumerate(self._written) if not w]
            raise RuntimeError(f"commit: layers {missing[:8]} never written")
        self.batch.commit()
        self._step = None
        for s in ids:
            seq = self.seqs[s]
            for li, spec in enumerate(self.layers):
                if self.evict[li]:
                    self.rowpos[s][li] = np.stack([seq.positions(li, h)
                                                   for h in range(spec.n_kv_heads)])

    def _need_step(self):
        if self._step is None:
            raise RuntimeError("no step in flight: reserve first")
        return self._step

    def stored_rows(self, seq_id: int) -> list[int]:
        """Rows attended per layer (per KV head) between steps."""
        seq = self.seqs[seq_id]
        return [int(seq.layer_stats(li).attended_rows) for li in range(len(self.layers))]

    def check(self) -> None:
        for seq in self.seqs.values():
            seq.check()
