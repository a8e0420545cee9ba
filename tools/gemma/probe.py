"""Passkey and once-stated-fact probes: a 5-digit pass key (--task passkey) or a fact
(--task fact) stated once inside a long stretch of text, asked for at the end; does
Gemma-3-270M (base) retrieve it with the cache this run attends through?

    python tools/gemma/probe.py [--task passkey|fact] [--lengths 1024,2048,4096]
                                [--depths 0.1,0.5,0.9] [--keys 1] [--chunk 256] [--store dense]
                                [--csv OUT] [--trace OUT.kvtt --trace-case I]

Fact task: the stretch is the US Declaration of Independence (data/declaration.txt, public
domain) cut into clauses and cycled; at a depth the sentence "NAME keeps a red boat in CITY."
(a name and a city drawn per case from fixed lists); the question at the end is "Where does
NAME keep a red boat?" and the answer " CITY". Only the instruction before the text is
protected (--protect defaults to its token count), so the stretch and the fact are fed as
generated text.

Passkey task: the prompt is the classic one (Mohtashami & Jaggi, "Landmark Attention", 2023):
an instruction, filler sentences repeated ("The grass is green. The sky is blue. ..."), at a depth the needle
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


FACT_INTRO = ("Read the following document carefully. Afterwards you will be asked a question "
              "about one fact stated in it.\n\n")
FACT = "{name} keeps a red boat in {city}. "
FACT_QUESTION = ("\n\nQuestion: Where does {name} keep a red boat?\n"
                 "Answer: {name} keeps a red boat in")
NAMES = ["Alice", "Peter", "Maria", "John", "Hannah", "Oliver", "Sofia", "Daniel", "Emma",
         "Lucas", "Clara", "Victor", "Laura", "Martin", "Julia", "Simon"]
CITIES = ["Paris", "London", "Tokyo", "Cairo", "Lisbon", "Dublin", "Oslo", "Vienna", "Prague",
          "Madrid", "Rome", "Berlin", "Athens", "Seoul", "Lima", "Boston", "Chicago", "Sydney",
          "Toronto", "Mumbai", "Istanbul", "Moscow", "Warsaw", "Helsinki", "Stockholm",
          "Amsterdam", "Brussels", "Geneva", "Naples", "Denver"]


def _sentences() -> list[str]:
    import re
    text = (HERE / "data" / "declaration.txt").read_text()
    clauses = re.split(r"(?<=[.;:,])\s+", " ".join(text.split()))
    return [x.strip() + " " for x in clauses if x.strip()]


def _span(tok, before: str, part: str) -> tuple[int, int]:
    """The token range [a, b) that `part` covers in the encoding of before + part + ..."""
    # SentencePiece glues a space to the next word: measure the prefixes without trailing blanks.
    return len(tok.encode(before.rstrip(" "))), len(tok.encode((before + part).rstrip(" ")))


def build_fact(tok, length: int, depth: float, rng):
    """prompt ids, answer ids, and the fact sentence's token range [first, end) in the prompt."""
    name = NAMES[int(rng.integers(len(NAMES)))]
    city = CITIES[int(rng.integers(len(CITIES)))]
    sents = _sentences()
    fact, question = FACT.format(name=name, city=city), FACT_QUESTION.format(name=name)

    def text(n):  # n clauses of the stretch, the fact before the clause nearest the depth
        fill = [sents[i % len(sents)] for i in range(n)]
        cut = round(depth * n)
        return FACT_INTRO + "".join(fill[:cut]), fact + "".join(fill[cut:]) + question

    # Clauses encoded one by one overcount (each starts a word): refine n on the real count.
    n = max(1, length // 25)
    for _ in range(8):
        m = len(tok.encode("".join(text(n))))
        step = round((length - m) / 25)
        if step == 0 or n + step < 1:
            break
        n += step
    while n > 1 and len(tok.encode("".join(text(n)))) > length:
        n -= 1
    before, after = text(n)
    a, b = _span(tok, before, fact)
    prompt = tok.encode(before + after)
    answer = tok.encode(f" {city}", bos=False)
    return prompt, answer, (a, b), f"{name}/{city}"


def build_passkey(tok, length: int, depth: float, key: int):
    """prompt ids, answer ids, and the needle sentence's token range in the prompt."""
    # Tokens one more filler sentence group adds inside a run of them (its first word merges
    # with the space before it, so encoding FILLER alone would count one token too many).
    per_fill = (len(tok.encode(FILLER * 20, bos=False)) - len(tok.encode(FILLER * 10, bos=False))) / 10
    fixed = len(tok.encode(INTRO + NEEDLE.format(key=key) + QUESTION))
    n_fill = max(0, round((length - fixed) / per_fill))
    before = round(n_fill * depth)
    text = (INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n_fill - before)
            + QUESTION)
    prompt = tok.encode(text)
    a, b = _span(tok, INTRO + FILLER * before, NEEDLE.format(key=key))
    answer = tok.encode(f" {key}", bos=False)
    return prompt, answer, (a, b)


# Recall on the global layers: the key bases come from other text (the calibration stretch below,
# no fact in it), rank RECALL_RANK of head_dim; the trigger scans decode steps only, so the last
# DECODE_TAIL tokens of every case (the question and the answer) are fed one per step.
RECALL_RANK = 32
DECODE_TAIL = 24


def calibrate_bases(eng, tok, rank: int = RECALL_RANK, tokens: int = 1024) -> dict:
    """Key bases of the global layers: the top-`rank` right singular vectors of the post-RoPE
    keys one dense pass over `tokens` tokens of the Declaration (cycled, no fact) produces, per
    (layer, KV head): {layer: [n_kv, rank, head_dim] float32}. Uncentred, as the sketch
    projects uncentred keys."""
    sents = _sentences()
    text, n = FACT_INTRO, 0
    while len(tok.encode(text)) < tokens:
        text += sents[n % len(sents)]
        n += 1
    ids = tok.encode(text)[:tokens]
    c = eng.cfg
    keys: dict = {li: [] for li in range(c.n_layers) if not c.is_sliding(li)}

    def tap(li, seq_ids, bounds, pos, q, k, v):
        if li in keys:
            keys[li].append(np.array(k, dtype=np.float32))

    store = kvstore.DenseStore(kvstore.specs_for(c))
    store.add_sequence(0, 0)
    eng.tap = tap
    try:
        eng.prefill(store, [0], [ids], chunk=256)
    finally:
        eng.tap = None
    out = {}
    for li, ks in keys.items():
        K = np.concatenate(ks)  # [tokens, n_kv, head_dim]
        heads = []
        for h in range(K.shape[1]):
            _, _, vt = np.linalg.svd(K[:, h, :].astype(np.float64), full_matrices=False)
            q_, _ = np.linalg.qr(vt[:rank].T)  # orthonormal to double precision, then fp32
            heads.append(q_.T.astype(np.float32))
        out[li] = np.stack(heads)
    return out


def recall_kind(kind: str) -> tuple[int, str, int]:
    """kvtier-recall[:RATIO[:MODE[:RANK]]] -> (ratio, mode, key basis rank)."""
    parts = kind.split(":")
    return (int(parts[1]) if len(parts) > 1 else 8, parts[2] if len(parts) > 2 else "margin",
            int(parts[3]) if len(parts) > 3 else RECALL_RANK)


def make_store(kind: str, cfg, max_tokens: int, n_seqs: int, bases=None):
    """dense: numpy, every row; kvtier-dense: kvtier's pool, every row of the global layers;
    kvtier-evict:R: kvtier's random eviction on the global layers at K = max_tokens / R;
    kvtier-recall:R[:MODE]: the same with the archive and the recall trigger (MODE margin
    (default), conformal or sound) over key bases `bases` (calibrate_bases)."""
    if kind == "dense":
        return kvstore.DenseStore(kvstore.specs_for(cfg))
    if kind.startswith("kvtier-recall"):
        from kvtier_store import KvtierStore
        ratio, mode, rank = recall_kind(kind)
        return KvtierStore(kvstore.specs_for(cfg), "recall", max_seqs=n_seqs,
                           max_tokens=max_tokens, ratio=ratio, recall=mode, sketch_rank=rank,
                           bases=bases)
    if kind == "kvtier-dense" or kind.startswith("kvtier-evict"):
        from kvtier_store import KvtierStore
        ratio = int(kind.split(":")[1]) if ":" in kind else 8
        return KvtierStore(kvstore.specs_for(cfg), "dense" if kind == "kvtier-dense" else "evict",
                           max_seqs=n_seqs, max_tokens=max_tokens, ratio=ratio)
    raise SystemExit(f"--store {kind}: dense, kvtier-dense or kvtier-evict[:RATIO]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="passkey", choices=["passkey", "fact"])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--keys", type=int, default=1, help="cases (keys, facts) per (length, depth)")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--store", default="dense",
                    help="dense | kvtier-dense | kvtier-evict[:RATIO] (random eviction, K = "
                         "longest case / RATIO, only the first --protect tokens protected) | "
                         "kvtier-recall[:RATIO[:MODE[:RANK]]] (the same with the archive and the "
                         "RoPE recall trigger, MODE margin|conformal|sound, key bases of RANK (32) "
                         "fitted on other text; the question and answer decoded one token per "
                         "step)")
    ap.add_argument("--protect", type=int, default=None,
                    help="prompt rows protected from eviction (passkey: 64; fact: the "
                         "instruction's tokens); the stretch and the needle are fed as generated "
                         "text")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--trace", default=None,
                    help="write case --trace-case's global layers (rows and the queries of the "
                         "question and answer) as a kvtier trace here (trace_dump.py)")
    ap.add_argument("--trace-case", type=int, default=0)
    a = ap.parse_args()

    w, tok = gguf_model.load(a.gguf)
    eng = eng_mod.GemmaEngine(w)
    rows, _ = run_cases(eng, tok, a.task, [int(x) for x in a.lengths.split(",")],
                        [float(x) for x in a.depths.split(",")], a.keys, a.seed, a.store,
                        a.chunk, a.protect, trace=a.trace, trace_case=a.trace_case)
    if a.csv:
        write_csv(a.csv, rows)


def build_cases(tok, task: str, lengths, depths, keys: int, seed: int):
    rng = np.random.default_rng(seed)
    cases = []
    for L in lengths:
        for d in depths:
            for _ in range(keys):
                if task == "passkey":
                    key = int(rng.integers(10000, 100000))
                    prompt, answer, span = build_passkey(tok, L, d, key)
                else:
                    prompt, answer, span, key = build_fact(tok, L, d, rng)
                cases.append({"length": L, "depth": d, "key": key, "prompt": prompt,
                              "answer": answer, "span": span})
    return cases


def run_cases(eng, tok, task, lengths, depths, keys, seed, store_kind, chunk, protect=None,
              trace=None, trace_case=0, quiet=False):
    """Every case in one batch through one store. Returns (rows for the CSV, the store)."""
    cases = build_cases(tok, task, lengths, depths, keys, seed)
    if protect is None:
        protect = 64 if task == "passkey" else len(tok.encode(FACT_INTRO.rstrip()))
    seqs = [p["prompt"] + p["answer"] for p in cases]
    recall = store_kind.startswith("kvtier-recall")
    bases = calibrate_bases(eng, tok, recall_kind(store_kind)[2]) if recall else None
    store = make_store(store_kind, eng.cfg, max(len(x) for x in seqs) + 8, len(cases), bases)
    for i, c in enumerate(cases):
        store.add_sequence(i, min(len(c["prompt"]), protect))
    tap = None
    if trace:
        import trace_dump
        c = cases[trace_case]
        tap = trace_dump.Recorder(eng.cfg, trace_case, len(c["prompt"]), len(c["answer"]))
        eng.tap = tap
    total = sum(len(s) for s in seqs)
    say = (lambda *x: None) if quiet else print
    say(f"{task}: {len(cases)} cases in one batch, {total} tokens, store {store_kind}, "
        f"chunk {chunk}, {protect} prompt rows protected")
    t0 = time.time()
    ids = list(range(len(cases)))
    if recall:
        # the stretch in chunks, then the question and the answer one token per step
        tail = min(DECODE_TAIL, min(len(x) for x in seqs) - 1)
        hid = eng.prefill(store, ids, [x[:-tail] for x in seqs], chunk=chunk, out_rows="all")
        for j in range(tail, 0, -1):
            hs = eng.step(store, ids, [[x[-j]] for x in seqs], "all")
            hid = [np.concatenate([a, b]) for a, b in zip(hid, hs)]
    else:
        hid = eng.prefill(store, ids, seqs, chunk=chunk, out_rows="all")
    dt = time.time() - t0
    eng.tap = None
    say(f"prefill {dt:.1f}s ({dt / total * 1e3:.1f} ms/token)")
    if hasattr(store, "check"):
        store.check()  # kvt_seq_check on every request
    if recall:
        say("recall: " + recall_summary(store, len(cases)))
    rows = []
    for c, h in zip(cases, hid):
        n_p, ans = len(c["prompt"]), np.asarray(c["answer"])
        # The prediction of answer token j is made at position n_p - 1 + j.
        lp, hit, am = eng.logprobs_of(h[n_p - 1:n_p - 1 + len(ans)], ans)
        got = tok.decode(am)
        want = str(c["key"]).split("/")[-1]
        digits = sum(x == y for x, y in zip(got.strip(), want))
        rows.append({"task": task, "store": store_kind, "length": c["length"], "tokens": n_p,
                     "depth": c["depth"], "key": c["key"], "needle_first": c["span"][0],
                     "needle_end": c["span"][1], "retrieved": int(hit.all()),
                     "answer_nll": round(float(-lp.sum()), 4), "digits_right": digits,
                     "predicted": got.strip(), "seconds": round(dt, 1)})
    say(f"{'length':>6} {'tokens':>6} {'depth':>5} {'key':>16} {'pred':>10} {'ok':>3} "
        f"{'nll':>7}")
    for r in rows:
        say(f"{r['length']:>6} {r['tokens']:>6} {r['depth']:>5.2f} {str(r['key']):>16} "
            f"{r['predicted']:>10} {r['retrieved']:>3} {r['answer_nll']:>7.3f}")
    for L in sorted({r["length"] for r in rows}):
        sel = [r for r in rows if r["length"] == L]
        say(f"length {L}: retrieved {sum(r['retrieved'] for r in sel)}/{len(sel)}")
    if trace:
        c = cases[trace_case]
        tap.write(trace, c, store_kind, protect, task)
        say(f"trace: {trace} ({os.path.getsize(trace)} bytes)")
    return rows, store


def recall_summary(store, n_cases: int) -> str:
    """The trigger's certificate over the global layers, summed over the requests."""
    tot = {"steps": 0, "calib": 0, "overflow": 0, "fetched": 0, "archived": 0}
    for i in range(n_cases):
        seq = store.seqs[i]
        for li in range(len(store.layers)):
            if not store.evict[li]:
                continue
            st = seq.layer_stats(li)
            tot["steps"] += st.recall_steps
            tot["calib"] += st.recall_calib_steps
            tot["overflow"] += st.recall_overflow_steps
            tot["fetched"] += st.recall_fetched_rows
            tot["archived"] += st.archived_rows
    t = store.recall_tally
    frac = t["fetched"] / t["archived"] if t["archived"] else 0.0
    return (f"{tot['steps']} (request, layer) steps, {tot['calib']} calibration, "
            f"{tot['overflow']} overflow; the {t['steps'] - t['dense']} others fetched "
            f"{100 * frac:.1f}% of the archive (mean {t['fetched'] / max(1, t['steps'] - t['dense']):.0f} "
            f"rows a step)")


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        wr.writeheader()
        wr.writerows(rows)


if __name__ == "__main__":
    main()
