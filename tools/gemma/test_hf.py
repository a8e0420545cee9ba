"""kvtier.hf.Cache on the real model (test.sh's hf configuration): Gemma-3-270M loaded into
transformers from the PyPI GGUF (hf_model.py) against the numpy engine (engine.py), all float32.

1. Every row attended: a 700-token prompt (past the 512-token window of the sliding layers)
   prefilled through kvtier.hf.Cache in forwards of 256 tokens, then model.generate with the
   cache, 8 greedy tokens: the same tokens as the engine over DenseStore, and every logit within
   TOL (measured 7-9e-5 on logits up to ~32; transformers' own DynamicCache differs from the
   engine by the same amount: summation order).
2. Random eviction at 8x on one fact case at 1k (probe.py's case, request id 0, K = (length + 8)
   / 8, chunks of 64): the answer's logits equal those of the engine over KvtierStore (the same
   draws through the same pool) within TOL, so the eviction decisions and the attention mask
   over the held rows are the same through transformers.

    python tools/gemma/test_hf.py
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import engine as eng_mod  # noqa: E402
import gguf_model  # noqa: E402
import hf_model  # noqa: E402
import hf_probe  # noqa: E402
import kvstore  # noqa: E402
import probe  # noqa: E402

TOL = 1e-3


def main():
    import torch
    from transformers import DynamicCache
    from transformers.utils import logging as hf_logging

    import kvtier.hf as khf

    hf_logging.set_verbosity_error()
    t0 = time.time()
    model = hf_model.load()
    w, tok = gguf_model.load()
    eng = eng_mod.GemmaEngine(w)
    ids = tok.encode(probe.FACT_INTRO + "".join(probe._sentences()[:80]))[:700]
    assert len(ids) == 700

    # 1. dense: the engine's greedy tokens and logits
    st = kvstore.DenseStore(kvstore.specs_for(eng.cfg))
    st.add_sequence(0)
    z = eng.logits(eng.prefill(st, [0], [ids], chunk=256)[0])[-1]
    ref, toks = [z], [int(z.argmax())]
    for _ in range(7):
        z = eng.logits(eng.step(st, [0], [[toks[-1]]])[0])[-1]
        ref.append(z)
        toks.append(int(z.argmax()))
    ref = np.stack(ref)
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    diffs = {}
    for name in ("kvtier", "dynamic"):
        cache = khf.Cache(model, "dense", max_tokens=1024) if name == "kvtier" else \
            DynamicCache(config=model.config)
        x = torch.tensor([ids])
        with torch.no_grad():
            for a in range(0, 699, 256):
                model(input_ids=x[:, a:min(a + 256, 699)], past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
        out = model.generate(x, past_key_values=cache, **kw)
        got = torch.stack(out.logits)[:, 0].numpy()
        assert out.sequences[0, 700:].tolist() == toks, (name, out.sequences[0, 700:], toks)
        diffs[name] = float(np.abs(got - ref).max())
        if name == "kvtier":
            cache.seqs[0].check()
            cache.close()
    print(f"test_hf: dense, 700-token prompt + 8 generated: the engine's tokens; max |logit "
          f"difference| kvtier {diffs['kvtier']:.2e}, DynamicCache {diffs['dynamic']:.2e} "
          f"(logits up to {np.abs(ref).max():.1f})")
    assert diffs["kvtier"] < TOL, diffs

    # 2. random eviction at 8x, one fact case at 1k
    c = probe.build_cases(tok, "fact", [1024], [0.5], 1, 13)[0]
    seq = c["prompt"] + c["answer"]
    n_p, n_ans = len(c["prompt"]), len(c["answer"])
    st = probe.make_store("kvtier-evict:8", eng.cfg, len(seq) + 8, 1)
    protect = len(tok.encode(probe.FACT_INTRO.rstrip()))
    st.add_sequence(0, protect)
    hid = eng.prefill(st, [0], [seq], chunk=64, out_rows="all")[0]
    zn = eng.logits(hid[n_p - 1:n_p - 1 + n_ans])
    zh, _ = hf_probe.run_kvtier(torch, khf, model, seq, n_p, n_ans, "evict", 8, len(seq) + 8,
                                protect, 0, None)
    d = float(np.abs(zh - zn).max())
    print(f"test_hf: evict 8x, fact case {c['key']} at {n_p} tokens: retrieved "
          f"{int((zn.argmax(1) == np.asarray(c['answer'])).all())} (engine); answer logits differ by at most {d:.2e}")
    assert d < TOL, d
    assert (zh.argmax(1) == zn.argmax(1)).all()
    print(f"test_hf: passed in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
