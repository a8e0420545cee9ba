"""Passkey probe: a 5-digit pass key stated once inside filler text, asked for at the end; does
Gemma-3-270M (base) retrieve it with the cache this run attends through?

    python tools/gemma/probe.py [--lengths 1024,2048,4096] [--depths 0.1,0.5,0.9] [--keys 1]
                                [--chunk 256] [--store dense] [--csv OUT]

The prompt is the classic one (Mohtashami & Jaggi, "Landmark Attention", 2023): an instruction,
filler sentences repeated ("The grass is green. The sky is blue. ..."), at a depth the needle
"The pass key is K. Remember it. K is the pass key.", more filler, then
"What is the pass key? The pass key is". Lengths are in tokens (the whole prompt, BOS
included, within a few tokens: filler comes in whole sentences); depth is the fraction of the
filler before the needle.

Scoring is teacher-forced: the prompt and the answer " K" are prefilled as one sequence, and the
model's prediction at each answer position is read. `retrieved` = every answer token is the
argmax there, which is exactly "greedy decoding writes the key" (greedy with the right prefix
makes the same predictions). Also reported: the answer's log-loss (nats, summed over its tokens)
and the digits right.

Every case runs in one batch: each prefill step carries `--chunk` tokens of every request that
has tokens left, through a KVStore (`--store dense`: every row of the global layers, the window
of the sliding ones).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

# One BLAS thread unless told otherwise: on a small shared machine OpenBLAS's spinning threads
# made matrix products 10x slower than one thread (measured here, 2 cores under load).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine as eng_mod  # noqa: E402
import gguf_model  # noqa: E402
import kvstore  # noqa: E402

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


def build_case(tok, length: int, depth: float, key: int):
    """Token ids of prompt + answer, and how many of them are the answer."""
    # Tokens one more filler sentence group adds inside a run of them (its first word merges
    # with the space before it, so encoding FILLER alone would count one token too many).
    per_fill = (len(tok.encode(FILLER * 20, bos=False)) - len(tok.encode(FILLER * 10, bos=False))) / 10
    fixed = len(tok.encode(INTRO + NEEDLE.format(key=key) + QUESTION))
    n_fill = max(0, round((length - fixed) / per_fill))
    before = round(n_fill * depth)
    text = (INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n_fill - before)
            + QUESTION)
    prompt = tok.encode(text)
    answer = tok.encode(f" {key}", bos=False)
    return prompt, answer


def make_store(kind: str, cfg, max_tokens: int, n_seqs: int):
    """dense: numpy, every row; kvtier-dense: kvtier's pool, every row of the global layers;
    kvtier-evict:R: kvtier's random eviction on the global layers at K = max_tokens / R."""
    if kind == "dense":
        return kvstore.DenseStore(kvstore.specs_for(cfg))
    if kind == "kvtier-dense" or kind.startswith("kvtier-evict"):
        from kvtier_store import KvtierStore
        ratio = int(kind.split(":")[1]) if ":" in kind else 8
        return KvtierStore(kvstore.specs_for(cfg), "dense" if kind == "kvtier-dense" else "evict",
                           max_seqs=n_seqs, max_tokens=max_tokens, ratio=ratio)
    raise SystemExit(f"--store {kind}: dense, kvtier-dense or kvtier-evict[:RATIO]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--keys", type=int, default=1, help="pass keys per (length, depth)")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--store", default="dense",
                    help="dense | kvtier-dense | kvtier-evict[:RATIO] (random eviction, K = "
                         "longest case / RATIO, only the first --protect tokens protected)")
    ap.add_argument("--protect", type=int, default=64,
                    help="prompt rows protected from eviction (the instruction; the filler and "
                         "the needle are fed as generated text)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--gguf", default=None)
    a = ap.parse_args()

    w, tok = gguf_model.load(a.gguf)
    eng = eng_mod.GemmaEngine(w)
    rng = np.random.default_rng(a.seed)
    cases = []
    for L in [int(x) for x in a.lengths.split(",")]:
        for d in [float(x) for x in a.depths.split(",")]:
            for _ in range(a.keys):
                key = int(rng.integers(10000, 100000))
                prompt, answer = build_case(tok, L, d, key)
                cases.append({"length": L, "depth": d, "key": key, "prompt": prompt,
                              "answer": answer})

    seqs = [p["prompt"] + p["answer"] for p in cases]
    store = make_store(a.store, w.config, max(len(x) for x in seqs) + 8, len(cases))
    for i, c in enumerate(cases):
        store.add_sequence(i, min(len(c["prompt"]), a.protect))
    total = sum(len(s) for s in seqs)
    print(f"{len(cases)} cases in one batch, {total} tokens, store {a.store}, chunk {a.chunk}")
    t0 = time.time()
    hid = eng.prefill(store, list(range(len(cases))), seqs, chunk=a.chunk, out_rows="all")
    dt = time.time() - t0
    print(f"prefill {dt:.1f}s ({dt / total * 1e3:.1f} ms/token)")

    rows = []
    for c, h in zip(cases, hid):
        n_p, ans = len(c["prompt"]), np.asarray(c["answer"])
        # The prediction of answer token j is made at position n_p - 1 + j.
        lp, hit, am = eng.logprobs_of(h[n_p - 1:n_p - 1 + len(ans)], ans)
        got = tok.decode(am)
        digits = sum(x == y for x, y in zip(got.strip(), str(c["key"])))
        rows.append({"store": a.store, "length": c["length"], "tokens": n_p, "depth": c["depth"],
                     "key": c["key"], "retrieved": int(hit.all()), "answer_nll": -lp.sum(),
                     "digits_right": digits, "predicted": got.strip()})
    print(f"{'length':>6} {'tokens':>6} {'depth':>5} {'key':>6} {'pred':>6} {'ok':>3} "
          f"{'nll':>7}")
    for r in rows:
        print(f"{r['length']:>6} {r['tokens']:>6} {r['depth']:>5.2f} {r['key']:>6} "
              f"{r['predicted']:>6} {r['retrieved']:>3} {r['answer_nll']:>7.3f}")
    for L in sorted({r["length"] for r in rows}):
        sel = [r for r in rows if r["length"] == L]
        print(f"length {L}: retrieved {sum(r['retrieved'] for r in sel)}/{len(sel)}")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    main()
