"""Check the numpy Gemma-3 forward against llama.cpp (llama-cpp-python) on the same weights.

    python tools/gemma/check_forward.py [--text FILE] [--max-tokens N] [--new N] [--json OUT]

llama.cpp runs twice:
  [F32 weights, F32 KV]  on a float32 copy of the GGUF (f32_gguf.py: every tensor dequantised,
                         metadata unchanged) with an F32 KV cache: both sides then compute the
                         same model in float32, so what differs is rounding, and a wrong forward
                         would show. This is the check of the forward.
  [Q4_K_M as shipped]    on the .gguf itself, as an engine would run it: llama.cpp rounds the
                         activations entering quantised products to 8 bits (Q8_0/Q8_K) and keeps
                         an F16 cache, which moves Gemma's logits by ~0.6 rms (large outlier
                         channels). The numpy forward with those roundings emulated (engine
                         numerics "ggml") is run too, to show that this gap is numerics.
Each run measures: perplexity of the text (teacher-forced; the text is longer than the
512-token window, so local layers run past it); per position, argmax agreement and logit
differences; greedy continuations of a few prompts (`--new` tokens each): tokens before the
first divergence, equal positions, and the logit gap at a divergence (how near a tie it was).
Also: tokenization of the text and prompts by both (ids compared), and, on the numpy side,
that batching changes nothing: log-probs with prefill chunks of 1000 and 100 tokens, greedy
continuations as one batch and one request at a time.

Without llama_cpp installed the comparison is skipped (and said so).
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


def llama_model(path, n_ctx, f32_cache=False):
    from llama_cpp import Llama

    kw = {"type_k": 0, "type_v": 0} if f32_cache else {}  # GGML_TYPE_F32 (default: F16)
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=os.cpu_count(),
                 logits_all=True, verbose=False, **kw)


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


def compare_llama(label, llm, eng, cfg, tok, ids, lp, am, z_ours, prompts, g_ours, new):
    """llama.cpp on the text and the prompts, against the numpy results."""
    t0 = time.time()
    z = llama_text_logits(llm, ids)[:-1]
    dt = time.time() - t0
    llp = logsoftmax_at(z, np.asarray(ids[1:]))
    r = {"ppl": float(np.exp(-llp.mean())), "eval_s": dt,
         "argmax_agreement": float((z.argmax(axis=1) == am).mean()),
         "max_abs_logit_diff": float(np.abs(z_ours - z).max()),
         "rms_logit_diff": float(np.sqrt(np.mean((z_ours - z) ** 2))),
         "max_abs_logp_diff": float(np.abs(llp - lp).max())}
    print(f"[{label}] llama.cpp ppl {r['ppl']:.4f} (eval {dt:.1f}s); per position: argmax "
          f"agrees at {r['argmax_agreement'] * 100:.2f}% of {len(am)}, logits max |diff| "
          f"{r['max_abs_logit_diff']:.3f}, rms {r['rms_logit_diff']:.4f}, max |dlogp(target)| "
          f"{r['max_abs_logp_diff']:.4f}")
    rows = []
    for p_text, p, ours in zip(PROMPTS, prompts, g_ours):
        theirs = llama_greedy(llm, p, new)
        k = first_divergence(ours, theirs)
        eq = sum(x == y for x, y in zip(ours, theirs))
        gap = None
        if k < new:
            # How close the call was on the numpy side: logit of our pick minus theirs, given
            # the common prefix.
            st = kvstore.DenseStore(kvstore.specs_for(cfg))
            st.add_sequence(0)
            zz = eng.logits(eng.prefill(st, [0], [p + ours[:k]])[0])[-1]
            gap = float(zz[ours[k]] - zz[theirs[k]])
        rows.append({"prompt": p_text, "first_divergence": k, "equal": eq,
                     "logit_gap_at_divergence": gap,
                     "numpy": tok.decode(ours), "llama_cpp": tok.decode(theirs)})
        print(f"[{label}] greedy {p_text!r}: same prefix {k}/{new}, equal positions {eq}/{new}"
              + (f"; at the divergence numpy's pick leads by {gap:.3f} logits"
                 if gap is not None else ""))
        if k < new:
            print(f"   numpy:     {tok.decode(ours)!r}\n   llama.cpp: {tok.decode(theirs)!r}")
    n_all = new * len(prompts)
    r["greedy"] = rows
    r["greedy_tokens_before_divergence"] = f"{sum(x['first_divergence'] for x in rows)}/{n_all}"
    r["greedy_equal_positions"] = f"{sum(x['equal'] for x in rows)}/{n_all}"
    print(f"[{label}] greedy: {r['greedy_tokens_before_divergence']} tokens before the first "
          f"divergence, {r['greedy_equal_positions']} equal positions")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default=str(HERE / "data" / "declaration.txt"))
    ap.add_argument("--max-tokens", type=int, default=1200)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--no-f32", action="store_true", help="skip the F32-weights comparison")
    ap.add_argument("--no-emulate", action="store_true",
                    help="skip the numpy run with llama.cpp's roundings emulated")
    ap.add_argument("--json", default=None, help="write the numbers here")
    a = ap.parse_args()
    res: dict = {}

    t0 = time.time()
    w, tok = gguf_model.load()
    eng = eng_mod.GemmaEngine(w)
    cfg = w.config
    path = gguf_model.model_path()
    res["gguf"] = {"file": path.name, "sha256": gguf_model.MODEL_SHA256}
    print(f"loaded {path.name} (sha256 {gguf_model.MODEL_SHA256[:16]}...) in "
          f"{time.time() - t0:.1f}s")

    text = Path(a.text).read_text()
    ids = tok.encode(text)[:a.max_tokens]
    prompts = [tok.encode(p) for p in PROMPTS]
    print(f"text: {Path(a.text).name}, {len(ids)} tokens (BOS included)")

    lp, am, h, dt = numpy_text_logprobs(eng, cfg, ids, chunk=1000)
    z_ours = eng.logits(h[:-1])
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
        import llama_cpp
    except ImportError:
        print("llama_cpp not installed: the second implementation was not run")
        res["llama_cpp"] = None
    else:
        res["llama_cpp_version"] = llama_cpp.__version__
        n_ctx = max(len(ids), 512) + a.new + 16
        if not a.no_f32:
            import f32_gguf

            llm = llama_model(f32_gguf.f32_path(), n_ctx, f32_cache=True)
            res["llama_cpp_f32"] = compare_llama("F32 weights, F32 KV", llm, eng, cfg, tok, ids,
                                                 lp, am, z_ours, prompts, g_batch, a.new)
            del llm
        llm = llama_model(path, n_ctx)
        ltok = [llm.tokenize(text.encode(), add_bos=True, special=False)[:a.max_tokens]]
        ltok += [llm.tokenize(p.encode(), add_bos=True, special=False) for p in PROMPTS]
        tok_same = sum(list(x) == list(y) for x, y in zip(ltok, [ids] + prompts))
        res["tokenizer_agreement"] = f"{tok_same}/{len(ltok)}"
        print(f"tokenizer: identical ids for {tok_same}/{len(ltok)} strings "
              f"(text + {len(prompts)} prompts)")
        res["llama_cpp_q4km"] = compare_llama("Q4_K_M as shipped", llm, eng, cfg, tok, ids, lp,
                                              am, z_ours, prompts, g_batch, a.new)
        if not a.no_emulate:
            # The numpy forward with llama.cpp's roundings emulated (engine numerics "ggml"):
            # if the Q4_K_M gap is numerics, this lands near llama.cpp's ppl.
            eng_g = eng_mod.GemmaEngine(w, numerics="ggml")
            lpg, _, _, _ = numpy_text_logprobs(eng_g, cfg, ids, chunk=1000)
            res["numpy_ggml_numerics_ppl"] = float(np.exp(-lpg.mean()))
            print(f"numpy with llama.cpp's roundings emulated: ppl "
                  f"{res['numpy_ggml_numerics_ppl']:.4f}")

    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
