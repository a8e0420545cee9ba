"""Check the numpy Gemma-3 forward against llama.cpp (llama-cpp-python) on the same GGUF.

    python tools/gemma/check_forward.py [--text FILE] [--max-tokens N] [--new N] [--json OUT]

What it measures, each on both paths:
  - tokenization of the text and of the prompts (ids compared);
  - perplexity of the text (teacher-forced, every next token, one sequence; the text is longer
    than the 512-token sliding window, so local layers are exercised past their window);
  - per position, agreement of the argmax and the largest |logit difference|;
  - greedy continuations of a few prompts (`--new` tokens each): tokens equal up to the first
    divergence, and in total.
and, on the numpy side alone, that the batch path changes nothing: the text's log-probs with
prefill chunks of 1000 and 100 tokens (window boundaries fall inside and across chunks), and the
greedy continuations run as one batch vs one request at a time.

Without llama_cpp installed the llama.cpp half is skipped (and said so).
"""
from __future__ import annotations

import argparse
import json
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

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, there was a",
    "The three primary colors are",
    "In 1492, Columbus",
    "Water boils at a temperature of",
]


def numpy_text_logprobs(eng, cfg, ids, chunk):
    store = kvstore.DenseStore(kvstore.specs_for(cfg))
    store.add_sequence(0, len(ids))
    t0 = time.time()
    h = eng.prefill(store, [0], [ids], chunk=chunk, out_rows="all")[0]
    lp, hit, am = eng.logprobs_of(h[:-1], np.asarray(ids[1:]))
    return lp, am, h, time.time() - t0


def numpy_greedy(eng, cfg, prompts, new, batch=True):
    if batch:
        store = kvstore.DenseStore(kvstore.specs_for(cfg))
        for i, p in enumerate(prompts):
            store.add_sequence(i, len(p))
        return eng.generate(store, list(range(len(prompts))), prompts, new)
    out = []
    for p in prompts:
        store = kvstore.DenseStore(kvstore.specs_for(cfg))
        store.add_sequence(0, len(p))
        out += eng.generate(store, [0], [p], new)
    return out


def llama_model(path, n_ctx):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=os.cpu_count(),
                 logits_all=True, verbose=False)


def llama_text_logits(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def llama_greedy(llm, prompt, new):
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(new):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        llm.eval([t])
    return out


def logsoftmax_at(z, targets):
    z = z.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return z[np.arange(len(targets)), targets] - lse


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default=str(HERE / "data" / "declaration.txt"))
    ap.add_argument("--max-tokens", type=int, default=1200)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--json", default=None, help="write the numbers here")
    a = ap.parse_args()
    res: dict = {}

    t0 = time.time()
    w, tok = gguf_model.load(a.gguf)
    eng = eng_mod.GemmaEngine(w)
    cfg = w.config
    path = gguf_model.model_path(a.gguf)
    res["gguf"] = {"file": path.name, "sha256": gguf_model.MODEL_SHA256}
    print(f"loaded {path.name} (sha256 {gguf_model.MODEL_SHA256[:16]}...) in "
          f"{time.time() - t0:.1f}s")

    text = Path(a.text).read_text()
    ids = tok.encode(text)[:a.max_tokens]
    prompts = [tok.encode(p) for p in PROMPTS]
    print(f"text: {Path(a.text).name}, {len(ids)} tokens (BOS included)")

    lp, am, h, dt = numpy_text_logprobs(eng, cfg, ids, chunk=1000)
    ppl = float(np.exp(-lp.mean()))
    res["numpy"] = {"ppl": ppl, "tokens": len(ids), "prefill_s": dt}
    print(f"numpy  ppl {ppl:.4f}  ({len(ids) - 1} predictions, prefill {dt:.1f}s)")
    lp2, _, _, _ = numpy_text_logprobs(eng, cfg, ids, chunk=100)
    res["numpy"]["chunk100_vs_1000_max_abs_logp_diff"] = float(np.abs(lp2 - lp).max())
    print(f"numpy  chunk 100 vs 1000: max |dlogp| {np.abs(lp2 - lp).max():.2e}")

    t0 = time.time()
    g_batch = numpy_greedy(eng, cfg, prompts, a.new, batch=True)
    tb = time.time() - t0
    t0 = time.time()
    g_single = numpy_greedy(eng, cfg, prompts, a.new, batch=False)
    ts = time.time() - t0
    same = sum(x == y for x, y in zip(g_batch, g_single))
    res["numpy"]["greedy_batch_equals_single"] = f"{same}/{len(prompts)}"
    print(f"numpy  greedy: batch of {len(prompts)} == one at a time for {same}/{len(prompts)} "
          f"prompts ({tb:.1f}s batched, {ts:.1f}s one by one)")

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama_cpp not installed: the second implementation was not run")
        res["llama_cpp"] = None
    else:
        import llama_cpp

        llm = llama_model(path, n_ctx=max(len(ids), 512) + 16)
        res["llama_cpp"] = {"version": llama_cpp.__version__}
        ltok = [llm.tokenize(text.encode(), add_bos=True, special=False)[:a.max_tokens]]
        ltok += [llm.tokenize(p.encode(), add_bos=True, special=False) for p in PROMPTS]
        ours = [ids] + prompts
        tok_same = sum(list(x) == list(y) for x, y in zip(ltok, ours))
        res["tokenizer_agreement"] = f"{tok_same}/{len(ours)}"
        print(f"tokenizer: identical ids for {tok_same}/{len(ours)} strings "
              f"(text + {len(prompts)} prompts)")

        t0 = time.time()
        z = llama_text_logits(llm, ids)
        dt = time.time() - t0
        llp = logsoftmax_at(z[:-1], np.asarray(ids[1:]))
        lppl = float(np.exp(-llp.mean()))
        lam = z[:-1].argmax(axis=1)
        ours_z = eng.logits(h[:-1])
        agree = float((lam == am).mean())
        dmax = float(np.abs(ours_z - z[:-1]).max())
        drms = float(np.sqrt(np.mean((ours_z - z[:-1]) ** 2)))
        # The same text under the engine's "ggml" numerics (llama.cpp's roundings emulated):
        # if the forward is right, what is left of the difference should mostly go away.
        eng_g = eng_mod.GemmaEngine(w, numerics="ggml")
        lpg, amg, hg, _ = numpy_text_logprobs(eng_g, cfg, ids, chunk=1000)
        zg = eng_g.logits(hg[:-1])
        res["numpy_ggml_numerics"] = {
            "ppl": float(np.exp(-lpg.mean())),
            "argmax_agreement_vs_llama_cpp": float((lam == amg).mean()),
            "max_abs_logit_diff_vs_llama_cpp": float(np.abs(zg - z[:-1]).max()),
            "rms_logit_diff_vs_llama_cpp": float(np.sqrt(np.mean((zg - z[:-1]) ** 2)))}
        del zg
        res["llama_cpp"].update({"ppl": lppl, "eval_s": dt, "argmax_agreement": agree,
                                 "max_abs_logit_diff": dmax, "rms_logit_diff": drms,
                                 "max_abs_logp_diff": float(np.abs(llp - lp).max())})
        print(f"llama.cpp ppl {lppl:.4f}  (eval {dt:.1f}s)")
        print(f"per position: argmax agrees at {agree * 100:.2f}% of {len(lam)}; logits "
              f"max |diff| {dmax:.3f}, rms {drms:.4f}; max |dlogp(target)| "
              f"{np.abs(llp - lp).max():.3f}")
        r = res["numpy_ggml_numerics"]
        print(f"numpy with llama.cpp's roundings emulated: ppl {r['ppl']:.4f}, argmax agrees at "
              f"{r['argmax_agreement_vs_llama_cpp'] * 100:.2f}%, logits max |diff| "
              f"{r['max_abs_logit_diff_vs_llama_cpp']:.3f}, rms "
              f"{r['rms_logit_diff_vs_llama_cpp']:.4f}")

        rows = []
        for p_text, p, ours_g in zip(PROMPTS, prompts, g_batch):
            theirs = llama_greedy(llm, p, a.new)
            k = first_divergence(ours_g, theirs)
            eq = sum(x == y for x, y in zip(ours_g, theirs))
            gap = None
            if k < a.new:
                # How close the call was, on the numpy side: logit of our pick minus theirs,
                # given the common prefix.
                st = kvstore.DenseStore(kvstore.specs_for(cfg))
                st.add_sequence(0)
                zz = eng.logits(eng.prefill(st, [0], [p + ours_g[:k]])[0])[-1]
                gap = float(zz[ours_g[k]] - zz[theirs[k]])
            rows.append({"prompt": p_text, "first_divergence": k, "equal": eq,
                         "logit_gap_at_divergence": gap,
                         "numpy": tok.decode(ours_g), "llama_cpp": tok.decode(theirs)})
            print(f"greedy {p_text!r}: same prefix {k}/{a.new}, equal positions {eq}/{a.new}"
                  + (f"; at the divergence numpy's pick leads llama.cpp's by {gap:.3f} logits"
                     if gap is not None else ""))
            if k < a.new:
                print(f"   numpy:     {tok.decode(ours_g)!r}\n   llama.cpp: {tok.decode(theirs)!r}")
        res["greedy"] = rows
        n_all = a.new * len(prompts)
        res["greedy_prefix_agreement"] = sum(r["first_divergence"] for r in rows) / n_all
        print(f"greedy: {sum(r['first_divergence'] for r in rows)}/{n_all} tokens before the "
              f"first divergence, {sum(r['equal'] for r in rows)}/{n_all} equal positions")

    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
