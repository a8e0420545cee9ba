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

`mode="recall"`: random eviction with the archive plus kvtier's RoPE recall trigger on the global
layers (docs/recall.md §9; `recall` = "margin", "conformal" or "sound"), the archived keys
sketched on per-(layer, KV head) key bases given as `bases` (calibrated from other text's keys).
attended(layer, q) then passes each request's last query (post-RoPE, scaled) to the run: a
decode step (one token per request, reserved without drafts) fetches the archived rows the
trigger fires on, listed after the held rows; a multi-token step (prefill, reserved as drafts)
attends every row, the whole archive included. Fetched rows carry position -1 in Rows (they
are older than every query; attention masks by position only) — kvtier does not report which
positions they hold. One KV head per global layer (Gemma-3-270M): the per-head lists are the
request's list.
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
    "dense" (every row of a global layer attended). ratio: K = max_tokens / ratio rows (at least
    recent_rows) kept per head by a round on the global layers (or budget_rows); recent_rows r
    and the cadence c = r.
    max_tokens sizes the pool (every request may reach it); at most 256 new tokens per request
    per step (kvtier's per-token emission limit)."""

    def __init__(self, layers: Sequence[LayerSpec], mode: str = "evict", *, max_seqs: int = 32,
                 max_tokens: int = 4096, ratio: int = 8, budget_rows: int | None = None,
                 recent_rows: int = 64, archive: bool = False, seed: int = 0,
                 page_rows: int = 64, recall: str = "margin", recall_margin: float = 1.0,
                 sketch_rank: int = 32, bases: dict | None = None):
        super().__init__(layers)
        if mode not in ("evict", "dense", "recall"):
            raise ValueError(f"mode: 'evict', 'dense' or 'recall', not {mode!r}")
        self.mode = mode
        self.wants_queries = mode == "recall"
        if mode == "recall" and any(sp.kind != "sliding" and sp.n_kv_heads != 1 for sp in layers):
            raise ValueError("recall: one KV head per global layer (the CSR list per request is "
                             "the per-head list)")
        specs = []
        for sp in layers:
            kind = kvtier.LayerKind.SLIDING if sp.kind == "sliding" else kvtier.LayerKind.GQA_ROPE
            s = kvtier.LayerSpec.gqa(kind, kvtier.DType.FP32, sp.n_kv_heads, sp.head_dim)
            if sp.kind == "sliding":
                s.sliding_window = sp.window
            s.n_q_heads = sp.n_q_heads
            specs.append(s)
        self.model = kvtier.Model(specs, "gemma3-engine")
        # K from the ratio: at least the recent window (kvt_config_check wants K >= r)
        K = budget_rows if budget_rows is not None else max(recent_rows, max_tokens // ratio, 1)
        cfg = kvtier.Config(evict_budget_rows=K, recent_rows=recent_rows,
                            cadence_rows=recent_rows, evict_archive=archive or mode == "recall",
                            seed=seed)
        if mode == "recall":
            cfg.recall = recall
            cfg.recall_margin = recall_margin
        policies = None
        if mode == "dense":
            policies = [kvtier.Policy.NONE] * len(layers)
        # recall: a fetch area of as many rows as the request holds (kvt_seq_pages_needed)
        pages = max_seqs * ((max_tokens + 256 + page_rows - 1) // page_rows + 2) \
            * (2 if mode == "recall" else 1)
        self.ctx = kvtier.Context(self.model, cfg, page_rows=page_rows, n_pages=pages,
                                  layer_policies=policies, max_rows_per_seq=max_tokens + 256,
                                  recall_sketch_rank=sketch_rank if mode == "recall" else None)
        for li, b in (bases or {}).items():
            b = np.asarray(b, dtype=np.float32)
            for h, v in enumerate(b.reshape(-1, *b.shape[-2:])):
                self.ctx.set_recall_head_basis(li, h, np.ascontiguousarray(v))
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
        self._decode = False
        self._slots: list[np.ndarray | None] = []
        self.stats = {"rounds": 0}
        # recall: the trigger's steps after calibration (not dense): rows fetched and archived,
        # summed over (request, global layer); dense ones (calibration, overflow) counted apart
        self.recall_tally = {"steps": 0, "dense": 0, "fetched": 0, "archived": 0}
        self._rsteps: dict = {}

    # -- requests -------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt_rows=0):
        if seq_id in self.seqs:
            raise KeyError(f"request {seq_id} exists")
        self.seqs[seq_id] = self.ctx.sequence(request_id=seq_id, prompt_rows=prompt_rows)
        self.rowpos[seq_id] = [None] * len(self.layers)
        if self.mode == "recall":  # kvtier recalls only where the layer allows it: check
            for li, ev in enumerate(self.evict):
                if ev and self.seqs[seq_id].layer_stats(li).recall_mode == 0:
                    raise RuntimeError(f"recall: request {seq_id} does not recall on global "
                                       f"layer {li} (kvtier refused the layer: see "
                                       "docs/recall.md §9)")

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
        # (recall: a decode step is reserved plainly, so that the trigger may fetch — a request
        # with drafts attends every row — and its positions are not needed: below)
        self._decode = self.mode == "recall" and all(n == 1 for n in ns)
        self.batch.reserve([self.seqs[s] for s in ids], ns,
                           n_drafts=None if self._decode else ns)
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

    def attended(self, layer, q=None):
        ids, ns, lengths = self._need_step()
        if not self._written[layer]:
            raise RuntimeError(f"attended({layer}) before write({layer})")
        spec = self.layers[layer]
        S = max(max(ns, default=1), 1)
        recall = self.mode == "recall" and self.evict[layer]
        if recall:
            if q is None:
                raise ValueError(f"attended({layer}): the recall trigger needs the step's queries")
            last = np.cumsum(ns) - 1  # each request's last query token
            qs = np.ascontiguousarray(np.asarray(q, dtype=np.float32)[last])
            e = self.batch.run(layer, "csr", queries_per_seq=1, query=qs)
        else:
            e = self.batch.run(layer, "csr", queries_per_seq=S)
        kp, vp = self.planes[layer]
        out = []
        for i, (s, n, n0) in enumerate(zip(ids, ns, lengths)):
            last = n - 1 if n > 0 else 0
            L = e.slots(i, 0 if recall else last)
            end = n0 + n  # positions < end are visible to the step's last query
            if recall and self._decode:
                # One token: every listed row (held, its own, fetched) is visible to it.
                pos = np.zeros((spec.n_kv_heads, len(L)), dtype=np.int64)
                slots = L
            elif recall:
                # Every row: the held ones, the step's, then the whole archive (fetch slots).
                rp = self.rowpos[s][layer]
                held = len(L) - n if rp is None else rp.shape[1]
                if rp is None:
                    rp = np.broadcast_to(np.arange(held, dtype=np.int64), (1, held))
                m = len(L) - held - n
                if m < 0:
                    raise RuntimeError(f"layer {layer}: {len(L)} rows listed, {held} held")
                pos = np.concatenate([rp, np.arange(n0, end, dtype=np.int64)[None],
                                      np.full((1, m), -1, dtype=np.int64)], 1)
                slots = L
            elif self.evict[layer]:
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
                if self.mode == "recall" and self.evict[li]:
                    st = seq.layer_stats(li)
                    if st.recall_steps != self._rsteps.get((s, li), 0):  # the trigger ran
                        self._rsteps[(s, li)] = st.recall_steps
                        t = self.recall_tally
                        t["steps"] += 1
                        if st.recall_last_dense:
                            t["dense"] += 1
                        else:
                            t["fetched"] += st.recall_last_fetched
                            t["archived"] += st.recall_last_archived

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
