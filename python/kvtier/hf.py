"""kvtier.hf: a Hugging Face transformers ``Cache`` whose rows live in kvtier's pool (CPU).

    pip install './python[hf]'          # torch + transformers
    cache = kvtier.hf.Cache(model, mode="evict", ratio=8, max_tokens=4096, prompt_rows=20)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    cache.close()

One forward of the model is one kvtier step: the first layer's ``update`` reserves the step's
tokens for every request (``Batch.reserve`` + ``plan``), each layer's ``update`` writes its
post-RoPE K and V rows into the layer's planes at the step's ``slot_mapping`` and runs the layer
(``Batch.run``: its eviction round or window close, then the attended set), gathering K and V at
the emitted slots, and the last layer's ``update`` commits. The rows are float32 in the pool (a
bf16 or fp16 model's rows are widened, the gathered rows narrowed back).

Modes (kvtier's policies on the model's full-attention layers; sliding-window layers are always
kvtier's window, policy none): ``"dense"`` every row attended; ``"evict"`` random eviction, K =
max_tokens / ratio rows per KV head (at least recent_rows), the first prompt_rows rows of every
request protected; ``"recall"`` the same with the archive and kvtier's RoPE recall trigger
(docs/recall.md §9), the archived keys sketched on per-(layer, KV head) key bases (``bases``, e.g.
from :func:`calibrate_bases`); the trigger reads each step's last query, which a forward pre-hook
on the model's attention modules recomputes (q_proj, q_norm, RoPE, scaling, as the model does).

How the attention mask is kept right. transformers builds one mask per layer type before the
layers run, from ``get_mask_sizes`` (kv_length, kv_offset): key j stands at position
kv_offset + j. The cache announces, per request, H + T keys from offset n0 - H (H rows held
before the step, n0 committed tokens, T new ones): the held rows (every one older than the
step's queries) first, then the step's rows, so the causal mask between the step's tokens is
exact whatever was evicted; a sliding layer's rows are contiguous positions, so its window mask
is exact too. The step's tokens are reserved as drafts (all accepted), which moves every round to
the commit: the held counts stay what they were when the mask was built. A recall decode step
(one token) is reserved plainly so that the trigger may fetch: it lists more rows than announced,
which only SDPA's single-query path (no mask) accepts, so mode "recall" needs
attn_implementation "sdpa"; a multi-token step of a request with recall attends every row (the
archive first, as the oldest positions). Requests of a batch advance together (no padding).
"""
from __future__ import annotations

from typing import Any

try:
    import torch
    from transformers.cache_utils import Cache as _HFCache
    from transformers.cache_utils import CacheLayerMixin as _HFLayer
except ImportError as e:  # pragma: no cover - exercised where the extra is missing
    raise ImportError(
        "kvtier.hf needs torch and transformers (the optional extra 'hf'): "
        "pip install './python[hf]' or pip install torch transformers") from e

import numpy as np

from . import _api, _lib
from ._types import DType, LayerKind, Policy

__all__ = ["Cache", "calibrate_bases"]


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


class _Layer(_HFLayer):
    """One model layer's view of the shared kvtier cache (transformers lists one per layer)."""

    is_compileable = False

    def __init__(self, cache: "Cache", index: int, sliding: bool):
        super().__init__()
        self.cache, self.index, self.is_sliding = cache, index, sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, cache_kwargs=None):
        return self.cache.update(key_states, value_states, self.index, cache_kwargs)

    def get_mask_sizes(self, cache_position):
        return self.cache.get_mask_sizes(cache_position, self.index)

    def get_seq_length(self):
        return self.cache.get_seq_length()

    def get_max_cache_shape(self):
        return -1

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("kvtier.hf.Cache: requests advance together; crop, reorder "
                                  "and batch reshaping (beam search, assisted decoding) are not "
                                  "supported")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported
    offload = prefetch = _unsupported

    def reset(self):
        self.cache.reset()


class Cache(_HFCache):
    """A transformers Cache over a kvtier context on the CPU backend.

    model: the transformers model (its text config gives the layers; mode "recall" hooks its
    attention modules) or a config. mode: "dense", "evict" or "recall" (above). max_tokens: the
    longest request (sizes the pool; with ratio gives K); ratio / budget_rows: K =
    budget_rows or max(recent_rows, max_tokens // ratio); recent_rows: kvtier's recent window r
    (and the cadence c unless cadence_rows: a round runs at K + r + c rows); prompt_rows: the protected prompt rows of each request; max_seqs: the largest
    batch; request_ids: one id per batch row (default 0, 1, ...); recall, recall_margin,
    sketch_rank, bases ({layer: [n_kv, rank, head_dim]}): the recall trigger's settings."""

    def __init__(self, model, mode: str = "dense", *, max_tokens: int = 4096, ratio: int = 8,
                 budget_rows: int | None = None, recent_rows: int = 64,
                 cadence_rows: int | None = None, prompt_rows: int = 0,
                 max_seqs: int = 1, request_ids=None, seed: int = 0, page_rows: int = 64,
                 recall: str = "conformal", recall_margin: float = 1.0, sketch_rank: int = 32,
                 bases: dict | None = None):
        if mode not in ("dense", "evict", "recall"):
            raise ValueError(f"mode: 'dense', 'evict' or 'recall', not {mode!r}")
        is_model = isinstance(model, torch.nn.Module)
        c = _text_config(model.config if is_model else model)
        n_layers = int(c.num_hidden_layers)
        types = list(getattr(c, "layer_types", None) or ["full_attention"] * n_layers)
        self.sliding = [t in ("sliding_attention", "chunked_attention") for t in types]
        self.window = int(getattr(c, "sliding_window", 0) or 0)
        n_kv, n_q = int(c.num_key_value_heads), int(c.num_attention_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // n_q)
        self.n_kv = n_kv
        if mode == "recall":
            if not is_model:
                raise ValueError("mode 'recall': pass the model (its attention modules are "
                                 "hooked for the trigger's queries), not a config")
            impl = getattr(model.config, "_attn_implementation", None)
            if impl != "sdpa":
                raise ValueError(f"mode 'recall': attn_implementation must be 'sdpa' (a decode "
                                 f"step attends the fetched rows beyond the announced mask), "
                                 f"not {impl!r}")
            if n_kv != 1:
                raise ValueError(f"mode 'recall': one KV head per layer ({n_kv} here: each head "
                                 "would fetch its own rows)")
        specs = []
        for sl in self.sliding:
            kind = LayerKind.SLIDING if sl else LayerKind.GQA_ROPE
            s = _api.LayerSpec.gqa(kind, DType.FP32, n_kv, self.head_dim)
            if sl:
                s.sliding_window = self.window
            s.n_q_heads = n_q
            specs.append(s)
        self.mode = mode
        self.model_kv = _api.Model(specs, str(getattr(c, "model_type", "hf")))
        K = budget_rows if budget_rows is not None else max(recent_rows, max_tokens // ratio, 1)
        cfg = _api.Config(evict_budget_rows=K, recent_rows=recent_rows,
                          cadence_rows=recent_rows if cadence_rows is None else cadence_rows,
                          evict_archive=mode == "recall", seed=seed)
        if mode == "recall":
            cfg.recall = recall
            cfg.recall_margin = recall_margin
        policies = [Policy.NONE] * n_layers if mode == "dense" else None
        per_seq = (max_tokens + page_rows - 1) // page_rows + 2
        self.ctx = _api.Context(self.model_kv, cfg, page_rows=page_rows,
                                n_pages=max_seqs * per_seq * (2 if mode == "recall" else 1),
                                layer_policies=policies, max_rows_per_seq=max_tokens,
                                recall_sketch_rank=sketch_rank if mode == "recall" else None)
        for li, b in ((bases or {}) if mode == "recall" else {}).items():
            b = np.asarray(b, dtype=np.float32)
            for h, v in enumerate(b.reshape(-1, *b.shape[-2:])):
                self.ctx.set_recall_head_basis(int(li), h, np.ascontiguousarray(v))
        self.batch = self.ctx.batch(max_seqs)
        self.max_seqs, self.prompt_rows = max_seqs, prompt_rows
        self.request_ids = list(request_ids) if request_ids is not None else None
        self.planes = [(self.ctx.plane(i, 0).view(np.float32).reshape(-1, n_kv, self.head_dim),
                        self.ctx.plane(i, 1).view(np.float32).reshape(-1, n_kv, self.head_dim))
                       for i in range(n_layers)]
        self.policies = [self.ctx.layer_policy(i) for i in range(n_layers)]
        self.seqs: list[_api.Sequence] = []
        self._step = None  # (T, n0, held per layer type) while a forward runs
        self._queries: dict[int, np.ndarray] = {}
        self._hooks = []
        if mode == "recall":
            self._hook_queries(model)
        super().__init__(layers=[_Layer(self, i, s) for i, s in enumerate(self.sliding)])

    # -- requests -----------------------------------------------------------------------
    def _open(self, batch: int) -> None:
        if batch > self.max_seqs:
            raise ValueError(f"batch of {batch} requests, the cache was made for max_seqs="
                             f"{self.max_seqs}")
        ids = self.request_ids or list(range(batch))
        if len(ids) != batch:
            raise ValueError(f"request_ids: {len(ids)} ids for a batch of {batch}")
        self.seqs = [self.ctx.sequence(request_id=int(r), prompt_rows=self.prompt_rows)
                     for r in ids]
        if self.mode == "recall":
            for li, pol in enumerate(self.policies):
                if pol == Policy.EVICT and self.seqs[0].layer_stats(li).recall_mode == 0:
                    raise RuntimeError(f"recall: kvtier refused recall on layer {li} "
                                       "(docs/recall.md §9)")

    def reset(self) -> None:
        """Forget every request (the context and its settings stay)."""
        if self._step is not None:
            raise RuntimeError("reset during a forward")
        for s in self.seqs:
            s.close()
        self.seqs = []

    def close(self) -> None:
        """Free kvtier's context and remove the query hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.seqs = []
        self.batch.close()
        self.ctx.close()
        self.model_kv.close()

    # -- sizes --------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seqs[0].length if self.seqs else 0

    def _held(self, layer: int) -> int:
        """Rows request 0 holds in `layer` between steps (every request of the batch the same:
        checked in update)."""
        return int(self.seqs[0].layer_stats(layer).attended_rows) if self.seqs else 0

    def get_mask_sizes(self, cache_position, layer_idx: int) -> tuple[int, int]:
        T = int(cache_position.shape[0])
        n0 = self.get_seq_length()
        if self.sliding[layer_idx]:
            lo = max(0, n0 - self.window + 1)
            return n0 + T - lo, lo
        if self.mode == "dense" or (self.mode == "recall" and T > 1):
            return n0 + T, 0  # every row
        H = self._held(layer_idx)
        return H + T, n0 - H

    # -- the step -----------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None):
        B, nkv, T, d = key_states.shape
        if (nkv, d) != (self.n_kv, self.head_dim):
            raise ValueError(f"layer {layer_idx}: keys [{B}, {nkv}, {T}, {d}], the cache holds "
                             f"{self.n_kv} KV heads of {self.head_dim}")
        if layer_idx == 0:
            self._begin(B, T)
        elif self._step is None or self._step[0] != T or len(self.seqs) != B:
            raise RuntimeError(f"layer {layer_idx}: update outside a forward that began at "
                               "layer 0, or with another shape")
        n0 = self._step[1]
        slots = self.batch.slot_mapping(layer_idx)
        kp, vp = self.planes[layer_idx]
        kp[slots] = key_states.detach().to(torch.float32).transpose(1, 2).reshape(
            B * T, nkv, d).cpu().numpy()
        vp[slots] = value_states.detach().to(torch.float32).transpose(1, 2).reshape(
            B * T, nkv, d).cpu().numpy()
        recall = self.mode == "recall" and self.policies[layer_idx] == Policy.EVICT
        if recall:
            q = self._queries.pop(layer_idx, None)
            if q is None:
                raise RuntimeError(f"layer {layer_idx}: no query captured (the attention "
                                   "module's pre-hook did not run)")
            e = self.batch.run(layer_idx, "csr", query=q)
        elif self.sliding[layer_idx] and T > 1:
            # one set per query token: the step's first query needs the window before it
            e = self.batch.run(layer_idx, "csr", queries_per_seq=T)
        else:
            e = self.batch.run(layer_idx, "csr")
        want, held = self._step[2][layer_idx]
        lists = []
        for i in range(B):
            L = self._window_union(e, i, T, n0) if self.sliding[layer_idx] and T > 1 \
                else e.slots(i, 0)
            if self.sliding[layer_idx]:
                # contiguous positions ending at n0 + T - 1: keep the announced window
                if len(L) < want:
                    raise RuntimeError(f"layer {layer_idx}: {len(L)} rows attended, the "
                                       f"window needs {want}")
                L = L[len(L) - want:]
            elif recall and T > 1:
                # every row: held, the step's, then the archive (the oldest) -> archive first
                if len(L) != n0 + T:
                    raise RuntimeError(f"layer {layer_idx}: {len(L)} rows, every row is "
                                       f"{n0 + T}")
                L = np.concatenate([L[held + T:], L[:held + T]])
            elif not (recall and T == 1) and len(L) != want:
                raise RuntimeError(f"layer {layer_idx}: request {i} attends {len(L)} rows, "
                                   f"the mask was built for {want}")
            lists.append(L)
        if len({len(x) for x in lists}) != 1:
            raise RuntimeError(f"layer {layer_idx}: the requests attend {[len(x) for x in lists]}"
                               " rows: a batch's requests must hold as many")
        idx = np.stack(lists)  # [B, n]
        k = torch.from_numpy(kp[idx]).permute(0, 2, 1, 3).to(key_states.dtype)
        v = torch.from_numpy(vp[idx]).permute(0, 2, 1, 3).to(value_states.dtype)
        if layer_idx == len(self.sliding) - 1:
            self.batch.commit()
            self._step = None
        return k, v

    def _window_union(self, e, i: int, T: int, n0: int) -> np.ndarray:
        """The slots of the rows some query of request i's step sees on a sliding layer: query t's
        set is a run of positions ending at its own (n0 + t); the union runs from the first
        query's start to the step's end (queries window apart cover it)."""
        first = e.slots(i, 0)
        start = n0 + 1 - len(first)
        out = np.full(n0 + T - start, -1, dtype=np.int64)
        for t in sorted(set(range(T - 1, -1, -max(1, self.window))) | {0}):
            st = e.slots(i, t)
            end = n0 + t + 1 - start
            out[end - len(st):end] = st
        if (out < 0).any():
            raise RuntimeError("a sliding layer's sets do not cover the step's window")
        return out

    def _begin(self, B: int, T: int) -> None:
        if self._step is not None:
            raise RuntimeError("a forward began before the last one reached the last layer")
        if not self.seqs:
            self._open(B)
        elif len(self.seqs) != B:
            raise ValueError(f"a batch of {B} requests, the cache holds {len(self.seqs)}")
        n0 = self.seqs[0].length
        for li, sl in enumerate(self.sliding):
            if not sl:
                helds = {int(s.layer_stats(li).attended_rows) for s in self.seqs}
                if len(helds) != 1 or {s.length for s in self.seqs} != {n0}:
                    raise RuntimeError("the batch's requests hold different row counts: they "
                                       "must advance together")
        # what the masks were built for (get_mask_sizes, before the reservation) and the rows
        # each layer held
        sizes = [(self.get_mask_sizes(torch.empty(T), li)[0], self._held(li))
                 for li in range(len(self.sliding))]
        if T > _lib.MAX_QUERIES_PER_SEQ and any(self.sliding):
            raise ValueError(f"a forward of {T} tokens: a sliding-window layer needs one "
                             f"attended set per token, at most {_lib.MAX_QUERIES_PER_SEQ} a "
                             "step; feed longer prompts in chunks (model.generate(..., "
                             f"prefill_chunk_size={_lib.MAX_QUERIES_PER_SEQ}))")
        decode = self.mode == "recall" and T == 1
        self.batch.reserve(self.seqs, T, n_drafts=None if decode else T)
        self.batch.plan()
        self._step = (T, n0, sizes)

    # -- recall queries -----------------------------------------------------------------
    def _hook_queries(self, model) -> None:
        from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

        want = {li for li, p in enumerate(self.policies) if p == Policy.EVICT}
        for m in model.modules():
            li = getattr(m, "layer_idx", None)
            if li in want and hasattr(m, "q_proj"):
                self._hooks.append(m.register_forward_pre_hook(self._query_hook(
                    m, apply_rotary_pos_emb), with_kwargs=True))
                want.discard(li)
        if want:
            raise ValueError(f"mode 'recall': no attention module with q_proj for layers "
                             f"{sorted(want)}")

    def _query_hook(self, m, rope):
        def hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            with torch.no_grad():
                x = h[:, -1:]  # the step's last token of every request
                q = module.q_proj(x).view(x.shape[0], 1, -1, module.head_dim).transpose(1, 2)
                if hasattr(module, "q_norm"):
                    q = module.q_norm(q)
                q, _ = rope(q, q, cos[:, -1:], sin[:, -1:])
                q = q * module.scaling
            self._queries[module.layer_idx] = np.ascontiguousarray(
                q[:, :, 0].to(torch.float32).cpu().numpy())
        return hook


def calibrate_bases(model, input_ids, rank: int = 32) -> dict:
    """Key bases for mode "recall": one dense forward over input_ids [1, n] (text without the
    facts to be recalled), then per full-attention layer and KV head the top-`rank` right singular
    vectors of its post-RoPE keys: {layer: [n_kv, rank, head_dim] float32}."""
    from transformers import DynamicCache

    c = _text_config(model.config)
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=input_ids, past_key_values=dc, use_cache=True, logits_to_keep=1)
    out = {}
    for li, t in enumerate(types):
        if t != "full_attention":
            continue
        keys = dc.layers[li].keys[0].to(torch.float64).cpu().numpy()  # [n_kv, n, d]
        heads = []
        for kh in keys:
            _, _, vt = np.linalg.svd(kh, full_matrices=False)
            q_, _ = np.linalg.qr(vt[:rank].T)
            heads.append(q_.T.astype(np.float32))
        out[li] = np.stack(heads)
    return out

