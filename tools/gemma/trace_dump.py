"""Dump one probe case's global (GQA-RoPE) layers as a kvtier trace, written through the C
library's writer (kvtier.trace over lib/trace.c; the format is docs/trace-format.md).

    python tools/gemma/probe.py --task fact --lengths 1024 --depths 0.5 --store dense \
        --trace OUT.kvtt [--trace-case I]

What the file holds, per global layer (5, 11, 17 of Gemma-3-270M; the sliding layers cannot
see a needle more than 512 tokens back and are left out):
  - the K and V rows exactly as the engine wrote them (float32, post-RoPE keys; 1 KV head of 256),
    for every token of prompt + answer;
  - the queries (4 heads x 256, float32, post-RoPE, *before* the 1/sqrt(256) scale: a replay
    uses scale = head_dim^-1/2, written in the provenance text) of the last QUERY_TAIL tokens
    (the question and the answer), each at position = its token's index + 1 (it attends
    rows [0, position), its own row included);
  - NEEDLES: the fact's (passkey's) sentence rows, one needle per layer;
  - TARGETS: the query steps that predict the answer tokens, each with the query heads whose
    full-cache attention puts at least TARGET_MASS of its mass on the needle rows (a step with
    no such head is not a target on that layer).
prompt_rows = the protected instruction rows of the probe. The provenance text records the model
file and its sha256, the case, the command and every targeted head's needle mass.
"""
from __future__ import annotations

import sys

import numpy as np

import gguf_model
from kvtier_store import kvtier

QUERY_TAIL = 40      # query steps dumped: the last tokens of prompt + answer
TARGET_MASS = 0.05   # a head targets the needle when full attention gives it this much mass


class Recorder:
    """engine.tap: keeps one request's global layers' K, V and its last queries."""

    def __init__(self, cfg, case: int, n_prompt: int, n_answer: int):
        self.cfg, self.case = cfg, case
        self.layers = [i for i in range(cfg.n_layers) if not cfg.is_sliding(i)]
        self.k = {li: [] for li in self.layers}
        self.v = {li: [] for li in self.layers}
        self.q = {li: [] for li in self.layers}
        self.qpos = {li: [] for li in self.layers}
        self.q_from = max(0, n_prompt + n_answer - QUERY_TAIL)

    def __call__(self, li, seq_ids, bounds, pos, q, k, v):
        if li not in self.k or self.case not in seq_ids:
            return
        i = list(seq_ids).index(self.case)
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        self.k[li].append(k[lo:hi].copy())
        self.v[li].append(v[lo:hi].copy())
        p = pos[lo:hi]
        sel = p >= self.q_from
        if sel.any():
            # q arrives scaled by query_scale = 256^-1/2 = 2^-4: dividing it out is exact.
            self.q[li].append(q[lo:hi][sel] / np.float32(self.cfg.query_scale))
            self.qpos[li].append(p[sel] + 1)

    def write(self, path, case, store_kind, protect, task):
        cfg = self.cfg
        n_p, n_a = len(case["prompt"]), len(case["answer"])
        first, end = case["span"]
        spec = kvtier.LayerSpec.gqa(kvtier.LayerKind.GQA_ROPE, kvtier.DType.FP32,
                                    cfg.n_kv_heads, cfg.head_dim)
        spec.n_q_heads = cfg.n_heads
        scale = float(cfg.query_scale)
        group = cfg.n_heads // cfg.n_kv_heads
        # Steps predicting the answer: token n_p - 1 + j predicts answer token j.
        ans_tokens = range(n_p - 1, n_p - 1 + n_a)
        data, needles, targets, notes = {}, [], [], []
        for li in self.layers:
            K, V = np.concatenate(self.k[li]), np.concatenate(self.v[li])
            Q, qp = np.concatenate(self.q[li]), np.concatenate(self.qpos[li])
            assert K.shape[0] == n_p + n_a, (K.shape, n_p, n_a)
            data[li] = (K, V, Q, qp)
            nid = len(needles)
            needles.append((li, first, end - first))
            for t in ans_tokens:
                step = int(np.nonzero(qp == t + 1)[0][0])
                heads = []
                for h in range(cfg.n_heads):
                    g = h // group
                    s = (K[:t + 1, g] @ Q[step, h]).astype(np.float64) * scale
                    p = np.exp(s - s.max())
                    mass = p[first:end].sum() / p.sum()
                    notes.append(f"mass.layer{li}.step{step}.head{h}={mass:.4f}")
                    if mass >= TARGET_MASS:
                        heads.append(h)
                if heads:
                    targets.append((step, nid, heads))
        text = "\n".join([
            "generator=tools/gemma/trace_dump.py (numpy Gemma-3 engine, issue 13)",
            f"model={gguf_model.MODEL_FILE}", f"model.sha256={gguf_model.MODEL_SHA256}",
            f"task={task}", f"length={case['length']}", f"depth={case['depth']}",
            f"key={case['key']}", f"tokens={n_p + n_a}", f"prompt_tokens={n_p}",
            f"answer_tokens={n_a}", f"needle.rows={first}..{end}", f"store={store_kind}",
            f"protect={protect}", f"scale={scale!r}", "queries=unscaled, post-RoPE",
            f"target_mass={TARGET_MASS}", "command=" + " ".join(sys.argv)] + notes) + "\n"
        with kvtier.trace.TraceWriter(path, cfg.n_layers, prompt_rows=protect, text=text) as w:
            for li in self.layers:
                K, V, Q, qp = data[li]
                w.layer(li, spec)
                w.rows(li, 0, K)
                w.rows(li, 1, V)
                w.queries(li, qp, np.ascontiguousarray(Q, np.float32))
            w.needles(needles)
            w.targets(targets)
        return targets
