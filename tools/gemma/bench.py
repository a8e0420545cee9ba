"""Decode speed of the numpy engine: time per step and per token at batch 1 and batch N.

    python tools/gemma/bench.py [--batch 1,32] [--context 512] [--steps 4]

Each request is prefilled with `--context` tokens (not timed), then `--steps` greedy decode
steps run for the whole batch; the median step is reported, split into the model (18 layers,
attention through a DenseStore) and the tied output projection (logits over 262,144 tokens,
which dominate at this model size). One BLAS thread unless OPENBLAS_NUM_THREADS says otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine as eng_mod  # noqa: E402
import gguf_model  # noqa: E402
import kvstore  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gguf", default=None)
    a = ap.parse_args()
    w, tok = gguf_model.load(a.gguf)
    eng = eng_mod.GemmaEngine(w)
    rng = np.random.default_rng(0)
    print(f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}, context {a.context}")
    for B in [int(x) for x in a.batch.split(",")]:
        store = kvstore.DenseStore(kvstore.specs_for(w.config))
        ids = list(range(B))
        prompts = [[tok.bos_id] + rng.integers(1000, 200000, a.context - 1).tolist()
                   for _ in ids]
        for i in ids:
            store.add_sequence(i, a.context)
        h = eng.prefill(store, ids, prompts, chunk=256)
        nxt = [[int(eng.logits(x)[-1].argmax())] for x in h]
        t_model, t_head = [], []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            hs = eng.step(store, ids, nxt)
            t1 = time.perf_counter()
            z = eng.logits(np.concatenate(hs))
            nxt = [[int(t)] for t in z.argmax(axis=1)]
            t2 = time.perf_counter()
            t_model.append(t1 - t0)
            t_head.append(t2 - t1)
        m, hd = np.median(t_model), np.median(t_head)
        print(f"batch {B:>3}: step {1e3 * (m + hd):8.1f} ms (model {1e3 * m:7.1f}, logits "
              f"{1e3 * hd:7.1f}) = {1e3 * (m + hd) / B:6.1f} ms/token")


if __name__ == "__main__":
    main()
