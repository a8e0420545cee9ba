"""A small numpy reference engine for Gemma-3 (text), attending through a KVStore.

The forward, per layer (transformers' Gemma3DecoderLayer; llama.cpp's gemma3 graph):

    h = rmsnorm(x) * attn_norm                     (stored norm weights are 1 + w: see gguf_model)
    q, k, v = h Wq^T, h Wk^T, h Wv^T               (GQA: n_heads query heads, n_kv_heads KV heads)
    q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm    (per head, over head_dim)
    q, k = rope(q, pos), rope(k, pos)              rotate-half; base 1e6 global, 1e4 sliding
    q *= query_pre_attn_scalar^-1/2
    a = softmax(q K^T + mask) V                    mask: causal, and q - k < window when sliding
    x = x + rmsnorm(a Wo^T) * post_attention_norm
    h = rmsnorm(x) * ffn_norm
    x = x + rmsnorm((gelu_tanh(h Wg^T) * h Wu^T) Wd^T) * post_ffw_norm

with x0 = embed[token] * sqrt(hidden), and logits = rmsnorm(x) * output_norm @ embed^T (tied),
then tanh soft-capping when the config sets final_logit_softcapping (Gemma-3 does not).
All math in float32; the KV rows the store keeps are post-RoPE keys and values.

A step runs new tokens of several requests at once: every matrix product covers all the step's
tokens; attention runs per request over the rows the store hands back.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from kvstore import KVStore, Rows


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(ms + np.float32(eps))) * w


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


class Rope:
    """Rotate-half RoPE with cos/sin tables per base, extended on demand (float64 angles)."""

    def __init__(self, head_dim: int, base: float):
        self.half = head_dim // 2
        self.inv_freq = base ** (-np.arange(self.half, dtype=np.float64) * 2.0 / head_dim)
        self.cos = np.zeros((0, self.half), np.float32)
        self.sin = np.zeros((0, self.half), np.float32)

    def _grow(self, n: int):
        n = max(n, 2 * self.cos.shape[0], 1024)
        ang = np.arange(n, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def __call__(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [T, heads, head_dim], pos [T]."""
        if pos.size and pos.max() >= self.cos.shape[0]:
            self._grow(int(pos.max()) + 1)
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x[..., :self.half], x[..., self.half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def quantize_act(x: np.ndarray, block: int, fp16_scale: bool) -> np.ndarray:
    """x rounded the way ggml quantises a matrix product's activations: symmetric 8-bit per
    block of `block` values along the last axis, scale amax/127 (Q8_0: 32 values, fp16 scale;
    Q8_K: 256 values, fp32 scale)."""
    shp = x.shape
    b = x.reshape(-1, block)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    if fp16_scale:
        d = d.astype(np.float16).astype(np.float32)
    safe = np.where(d == 0, np.float32(1), d)
    return (np.rint(b / safe) * d).reshape(shp).astype(np.float32)


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def attend(q: np.ndarray, qpos: np.ndarray, rows: Rows, window: int,
           f16_probs: bool = False) -> np.ndarray:
    """One request's attention. q [T, H, d] (already scaled), qpos [T]; rows per KV head.
    Query head h reads KV head h // (H / n_kv). Returns [T, H * d]. f16_probs rounds the
    probabilities to fp16 before they weight V (ggml's mul_mat of an f16 V)."""
    T, H, d = q.shape
    n_kv = rows.k.shape[0]
    g = H // n_kv
    qh = q.transpose(1, 0, 2).reshape(n_kv, g * T, d)  # head-major: kv, then group, then token
    scores = np.matmul(qh, rows.k.transpose(0, 2, 1).astype(np.float32, copy=False))
    scores = scores.reshape(n_kv, g, T, -1)
    kp = rows.pos[:, None, None, :]  # [n_kv, 1, 1, n]
    qp = qpos[None, None, :, None]  # [1, 1, T, 1]
    bad = kp > qp
    if window:
        bad |= (qp - kp) >= window
    if bad.any():
        scores = np.where(bad, np.float32(-np.inf), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    if f16_probs:
        scores = f16(scores)
    out = np.matmul(scores.reshape(n_kv, g * T, -1), rows.v.astype(np.float32, copy=False))
    return out.reshape(H, T, d).transpose(1, 0, 2).reshape(T, H * d)


class GemmaEngine:
    """numerics: "f32" (default) computes every product in float32 from the dequantised
    weights. "ggml" adds, for diagnosis only, the roundings llama.cpp's CPU backend makes, so
    that a comparison can tell them from a wrong forward: activations entering a quantised
    weight's product are quantised to Q8_0 (for Q4_0/Q5_0/Q8_0-type weights) or Q8_K (for
    K-quants), K and V rows and the query are rounded to fp16 (its default f16 KV cache), and
    so are the attention probabilities before they weight V."""

    def __init__(self, weights, numerics: str = "f32"):
        if numerics not in ("f32", "ggml"):
            raise ValueError(f"numerics {numerics!r}: 'f32' or 'ggml'")
        self.ggml = numerics == "ggml"
        self.w = weights
        self.cfg = c = weights.config
        self.rope_global = Rope(c.head_dim, c.rope_base_global)
        self.rope_local = Rope(c.head_dim, c.rope_base_local)
        self.embed_scale = np.float32(math.sqrt(c.hidden))
        # Optional observer: tap(layer, seq_ids, bounds, pos, q, k, v) after RoPE, q scaled
        # (trace_dump.Recorder writes kvtier traces from it).
        self.tap = None

    def mm(self, x: np.ndarray, wt: np.ndarray, name: str) -> np.ndarray:
        """x @ wt.T; in ggml numerics x is first rounded as ggml rounds it for wt's type."""
        if self.ggml:
            qt = self.w.qtypes.get(name, "F32")
            if qt.endswith("_K"):
                x = quantize_act(x, 256, False)
            elif qt not in ("F32", "F16", "BF16"):
                x = quantize_act(x, 32, True)
        return x @ wt.T

    # -- one step -------------------------------------------------------------------------
    def step(self, store: KVStore, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]],
             out_rows: Sequence[Sequence[int]] | str = "last") -> list[np.ndarray]:
        """Run the new tokens of several requests through the model as one step.

        tokens[i]: the new tokens of seq_ids[i]. out_rows: per request, which of its new tokens
        to return the final hidden state of (indices into tokens[i]); "last" or "all".
        Returns, per request, the final normed hidden states [len(out_rows[i]), hidden]
        (feed them to logits())."""
        c, w = self.cfg, self.w
        toks = [np.asarray(t, dtype=np.int64) for t in tokens]
        ns = [t.size for t in toks]
        positions = store.reserve(seq_ids, ns)
        pos = np.concatenate(positions) if positions else np.zeros(0, np.int64)
        x = w.embed[np.concatenate(toks)] * self.embed_scale
        T = x.shape[0]
        H, Hkv, d = c.n_heads, c.n_kv_heads, c.head_dim
        bounds = np.cumsum([0] + ns)
        for li, L in enumerate(w.layers):
            nm = f"blk.{li}.{{}}.weight".format
            sliding = c.is_sliding(li)
            rope = self.rope_local if sliding else self.rope_global
            h = rmsnorm(x, L.attn_norm, c.eps)
            q = self.mm(h, L.wq, nm("attn_q")).reshape(T, H, d)
            k = self.mm(h, L.wk, nm("attn_k")).reshape(T, Hkv, d)
            v = self.mm(h, L.wv, nm("attn_v")).reshape(T, Hkv, d)
            q = rope(rmsnorm(q, L.q_norm, c.eps), pos) * np.float32(c.query_scale)
            k = rope(rmsnorm(k, L.k_norm, c.eps), pos)
            if self.ggml:
                q, k, v = f16(q), f16(k), f16(v)
            if self.tap is not None:
                self.tap(li, seq_ids, bounds, pos, q, k, v)
            store.write(li, k, v)
            # a store with a recall trigger scores its archive against the step's queries
            rows = store.attended(li, q) if getattr(store, "wants_queries", False) \
                else store.attended(li)
            a = np.empty((T, H * d), np.float32)
            win = c.sliding_window if sliding else 0
            for i in range(len(ns)):
                lo, hi = bounds[i], bounds[i + 1]
                if hi > lo:
                    a[lo:hi] = attend(q[lo:hi], pos[lo:hi], rows[i], win, self.ggml)
            x = x + rmsnorm(self.mm(a, L.wo, nm("attn_output")), L.post_attn_norm, c.eps)
            h = rmsnorm(x, L.ffn_norm, c.eps)
            f = gelu_tanh(self.mm(h, L.w_gate, nm("ffn_gate"))) * self.mm(h, L.w_up, nm("ffn_up"))
            x = x + rmsnorm(self.mm(f, L.w_down, nm("ffn_down")), L.post_ffn_norm, c.eps)
        store.commit()
        outs = []
        for i in range(len(ns)):
            lo, hi = bounds[i], bounds[i + 1]
            if out_rows == "last":
                sel = x[hi - 1:hi] if hi > lo else x[lo:lo]
            elif out_rows == "all":
                sel = x[lo:hi]
            else:
                sel = x[lo:hi][np.asarray(out_rows[i], dtype=np.int64)]
            outs.append(rmsnorm(sel, w.output_norm, c.eps))
        return outs

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [R, hidden] (from step) -> logits [R, vocab] float32."""
        z = self.mm(hidden, self.w.embed, "token_embd.weight")
        cap = self.cfg.final_logit_softcap
        if cap:
            z = np.tanh(z / np.float32(cap)) * np.float32(cap)
        return z

    def logprobs_of(self, hidden: np.ndarray, targets: np.ndarray, chunk: int = 256):
        """log p(targets[r] | row r) and whether targets[r] is the argmax, chunked over rows so
        that [rows, vocab] never exists at once. Returns (logp [R], is_argmax [R], argmax [R])."""
        R = hidden.shape[0]
        lp = np.empty(R, np.float64)
        am = np.empty(R, np.int64)
        for a in range(0, R, chunk):
            z = self.logits(hidden[a:a + chunk]).astype(np.float64)
            m = z.max(axis=1, keepdims=True)
            lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
            t = targets[a:a + chunk]
            lp[a:a + chunk] = z[np.arange(len(t)), t] - lse
            am[a:a + chunk] = z.argmax(axis=1)
        return lp, am == targets, am

    # -- drivers --------------------------------------------------------------------------
    def prefill(self, store: KVStore, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                chunk: int = 256, out_rows: str = "last") -> list[np.ndarray]:
        """Feed whole prompts, `chunk` tokens per request per step, all requests in each step
        (a request whose prompt ended drops out). out_rows "last": the last prompt token's
        hidden state per request; "all": every token's, concatenated per request."""
        done = [0] * len(prompts)
        outs: list[list[np.ndarray]] = [[] for _ in prompts]
        while True:
            live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            if not live:
                break
            toks = [prompts[i][done[i]:done[i] + chunk] for i in live]
            hs = self.step(store, [seq_ids[i] for i in live], toks,
                           "all" if out_rows == "all" else "last")
            for i, t, h in zip(live, toks, hs):
                done[i] += len(t)
                if out_rows == "all" or done[i] == len(prompts[i]):
                    outs[i].append(h)
        return [np.concatenate(o) if o else np.zeros((0, self.cfg.hidden), np.float32)
                for o in outs]

    def generate(self, store: KVStore, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                 max_new: int, chunk: int = 256, stop: int | None = None) -> list[list[int]]:
        """Greedy decoding of a batch: prefill every prompt, then one token per request per
        step, all requests in one step, until max_new tokens (or `stop`) each."""
        h = self.prefill(store, seq_ids, prompts, chunk)
        nxt = [int(self.logits(x)[-1].argmax()) for x in h]
        out = [[t] for t in nxt]
        live = [i for i in range(len(prompts)) if max_new > 1 and nxt[i] != stop]
        while live:
            hs = self.step(store, [seq_ids[i] for i in live], [[out[i][-1]] for i in live])
            z = self.logits(np.concatenate(hs))
            for i, t in zip(live, z.argmax(axis=1)):
                out[i].append(int(t))
            live = [i for i in live if len(out[i]) < max_new and out[i][-1] != stop]
        return out
