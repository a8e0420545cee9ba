"""Model-free checks of the KVStore contract and the engine's attention (numpy only, seconds).

    python tools/gemma/test_kvstore.py        (or: pytest tools/gemma/test_kvstore.py)

Random post-RoPE rows are fed through a DenseStore in steps of varying sizes for a batch of
requests; at every step each query's attention over the rows the store returns must equal
brute-force attention over the whole sequence with the causal mask and, on a sliding layer, the
window mask (q - k < window). Also: the store's contract errors (write before reserve, commit
with a layer unwritten, a second reserve in flight).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import attend  # noqa: E402
from kvstore import DenseStore, LayerSpec, Rows  # noqa: E402


def brute(q, qpos, K, V, window):
    """q [T, H, d]; K, V [n_kv, N, d] holding positions 0..N-1."""
    T, H, d = q.shape
    n_kv, N, _ = K.shape
    g = H // n_kv
    out = np.zeros((T, H, d), np.float64)
    for t in range(T):
        for h in range(H):
            kv = h // g
            ks = np.arange(N)
            ok = ks <= qpos[t]
            if window:
                ok &= (qpos[t] - ks) < window
            s = K[kv, ok] @ q[t, h]
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ V[kv, ok]
    return out.reshape(T, H * d)


def run_case(seed, window, steps, n_seqs=3, H=4, n_kv=2, d=8, make=DenseStore):
    rng = np.random.default_rng(seed)
    layers = [LayerSpec("full", n_kv, d), LayerSpec("sliding", n_kv, d, window)]
    store = make(layers)
    total = [sum(s) for s in zip(*steps)] if steps else []
    Ks = [rng.standard_normal((n_kv, total[i], d)).astype(np.float32) for i in range(n_seqs)]
    Vs = [rng.standard_normal((n_kv, total[i], d)).astype(np.float32) for i in range(n_seqs)]
    for i in range(n_seqs):
        store.add_sequence(i, prompt_rows=steps[0][i])
    worst = 0.0
    for ns in steps:
        pos = store.reserve(range(n_seqs), ns)
        for li, spec in enumerate(layers):
            k = np.concatenate([Ks[i][:, p].transpose(1, 0, 2) for i, p in enumerate(pos)])
            v = np.concatenate([Vs[i][:, p].transpose(1, 0, 2) for i, p in enumerate(pos)])
            store.write(li, k, v)
            rows = store.attended(li)
            for i, (p, r) in enumerate(zip(pos, rows)):
                assert isinstance(r, Rows) and r.pos.shape == r.k.shape[:2] == r.v.shape[:2]
                assert (np.diff(r.pos, axis=1) > 0).all()
                if p.size == 0:
                    continue
                q = rng.standard_normal((p.size, H, d)).astype(np.float32)
                got = attend(q, p, r, spec.window)
                want = brute(q.astype(np.float64), p, Ks[i][:, :p[-1] + 1].astype(np.float64),
                             Vs[i][:, :p[-1] + 1].astype(np.float64), spec.window)
                worst = max(worst, float(np.abs(got - want).max()))
        store.commit()
    for i in range(n_seqs):
        assert store.length(i) == total[i]
        held = store.stored_rows(i)
        assert held[0] == total[i]  # full layer: every row
        assert held[1] <= max(2 * window, total[i])  # sliding layer: trimmed
    assert worst < 1e-4, worst
    return worst


def test_decode_steps():
    # prompt 20/7/33 tokens, then 60 single-token steps (the window of 16 is crossed often)
    run_case(1, 16, [[20, 7, 33]] + [[1, 1, 1]] * 60)


def test_chunked_prefill_and_uneven_batches():
    # steps larger than the window, a request idle in some steps (0 new tokens)
    run_case(2, 16, [[40, 5, 0], [3, 40, 17], [0, 1, 50], [25, 0, 1], [1, 1, 1]])


def test_contract_errors():
    store = DenseStore([LayerSpec("full", 1, 4)])
    store.add_sequence(0)
    for bad in (lambda: store.write(0, np.zeros((1, 1, 4)), np.zeros((1, 1, 4))),
                lambda: store.attended(0), lambda: store.commit()):
        try:
            bad()
        except RuntimeError:
            pass
        else:
            raise AssertionError("expected RuntimeError outside a step")
    store.reserve([0], [2])
    try:
        store.reserve([0], [1])
    except RuntimeError:
        pass
    else:
        raise AssertionError("second reserve in flight accepted")
    try:
        store.commit()
    except RuntimeError:
        pass
    else:
        raise AssertionError("commit with layer 0 unwritten accepted")
    try:
        store.write(0, np.zeros((3, 1, 4)), np.zeros((3, 1, 4)))
    except ValueError:
        pass
    else:
        raise AssertionError("write of 3 rows for 2 reserved accepted")



# --- the same checks through kvtier's pool (KvtierStore, mode "dense": every row of a global
# layer attended, the sliding layer served by kvtier's window) ------------------------------------
def _kvtier_dense(layers):
    from kvtier_store import KvtierStore
    return KvtierStore(layers, "dense", max_seqs=4, max_tokens=512, page_rows=16)


def test_kvtier_store_decode_steps():
    run_case(1, 16, [[20, 7, 33]] + [[1, 1, 1]] * 60, make=_kvtier_dense)


def test_kvtier_store_chunked_prefill_and_uneven_batches():
    run_case(2, 16, [[40, 5, 0], [3, 40, 17], [0, 1, 50], [25, 0, 1], [1, 1, 1]],
             make=_kvtier_dense)


def test_kvtier_store_random_eviction_returns_exact_rows():
    """mode "evict": the global layer keeps K + r rows per head after each round, each head its
    own positions; every returned row is the one written at its position, the step's rows are
    always there, the prompt is protected, and kvtier's invariant check passes after each step."""
    from kvtier_store import KvtierStore
    rng = np.random.default_rng(3)
    n_kv, d, T = 2, 8, 400
    layers = [LayerSpec("full", n_kv, d), LayerSpec("sliding", n_kv, d, 16)]
    store = KvtierStore(layers, "evict", max_seqs=2, max_tokens=512, budget_rows=32,
                        recent_rows=8, page_rows=16)
    Ks = rng.standard_normal((2, n_kv, T, d)).astype(np.float32)
    Vs = rng.standard_normal((2, n_kv, T, d)).astype(np.float32)
    store.add_sequence(0, prompt_rows=10)
    store.add_sequence(1, prompt_rows=10)
    steps = [[10, 10]] + [[int(rng.integers(1, 5)), 1] for _ in range(120)]
    held_max = 0
    for ns in steps:
        pos = store.reserve([0, 1], ns)
        for li in range(2):
            k = np.concatenate([Ks[i][:, p].transpose(1, 0, 2) for i, p in enumerate(pos)])
            v = np.concatenate([Vs[i][:, p].transpose(1, 0, 2) for i, p in enumerate(pos)])
            store.write(li, k, v)
            for i, r in enumerate(store.attended(li)):
                for h in range(n_kv):
                    assert (np.diff(r.pos[h]) > 0).all()
                    np.testing.assert_array_equal(r.k[h], Ks[i][h, r.pos[h]])
                    np.testing.assert_array_equal(r.v[h], Vs[i][h, r.pos[h]])
                    assert set(pos[i].tolist()) <= set(r.pos[h].tolist())
                    if li == 0:
                        assert set(range(10)) <= set(r.pos[h].tolist())  # the prompt
                if li == 0:
                    held_max = max(held_max, r.pos.shape[1])
        store.commit()
        store.check()
    assert held_max <= 32 + 8 + 8 + 4, held_max  # K + r + c + the step
    assert store.length(0) == sum(s[0] for s in steps)
    # different heads keep different positions once rounds ran
    pos = store.reserve([0], [0])
    store.write(0, np.zeros((0, n_kv, d), np.float32), np.zeros((0, n_kv, d), np.float32))
    r = store.attended(0)[0]
    assert not np.array_equal(r.pos[0], r.pos[1])
    store.write(1, np.zeros((0, n_kv, d), np.float32), np.zeros((0, n_kv, d), np.float32))
    store.commit()


def test_kvtier_store_recall_rows_exact_and_sound():
    """mode "recall" (random eviction + archive + the RoPE recall trigger, sound mode, a rank-16
    key basis of 96): on multi-token steps every row written so far comes back exactly once (the
    held ones, the step's, the whole archive: fetched rows carry position -1); on decode steps
    every returned row is a written row, once, the step's own among them, and no row left out
    scores at or above the best returned one for any query head (what sound recall promises:
    it fetches every archived row that could beat the attended best)."""
    from kvtier_store import KvtierStore
    rng = np.random.default_rng(11)
    d, H, T = 96, 4, 260
    layers = [LayerSpec("full", 1, d, 0, H), LayerSpec("sliding", 1, d, 16, H)]
    basis, _ = np.linalg.qr(rng.standard_normal((d, 16)))
    store = KvtierStore(layers, "recall", max_seqs=2, max_tokens=512, budget_rows=32,
                        recent_rows=8, page_rows=16, recall="sound", sketch_rank=16,
                        bases={0: np.ascontiguousarray(basis.T, dtype=np.float32)[None]})
    assert store.wants_queries
    Ks = rng.standard_normal((2, 1, T, d)).astype(np.float32)
    Vs = rng.standard_normal((2, 1, T, d)).astype(np.float32)
    for i in range(2):
        store.add_sequence(i, prompt_rows=8)
    steps = [[30, 30], [25, 20], [40, 45]] + [[1, 1]] * 80
    fetched_some = False
    for ns in steps:
        pos = store.reserve([0, 1], ns)
        q = rng.standard_normal((sum(ns), H, d)).astype(np.float32) * 0.3
        ends = [int(p[-1]) + 1 for p in pos]
        for li in range(2):
            k = np.concatenate([Ks[i][:, p].transpose(1, 0, 2) for i, p in enumerate(pos)])
            v = np.concatenate([Vs[i][:, p].transpose(1, 0, 2) for i, p in enumerate(pos)])
            store.write(li, k, v)
            rows = store.attended(li, q)
            if li:
                continue
            for i, r in enumerate(rows):
                # each returned row: which written position holds these bytes (once each)
                got = []
                for j in range(r.k.shape[1]):
                    hit = np.flatnonzero((Ks[i][0, :ends[i]] == r.k[0, j]).all(axis=1))
                    assert hit.size == 1, (i, j, hit)
                    t = int(hit[0])
                    np.testing.assert_array_equal(r.v[0, j], Vs[i][0, t])
                    if r.pos[0, j] >= 0 and max(ns) > 1:
                        assert r.pos[0, j] == t
                    got.append(t)
                assert len(set(got)) == len(got)
                assert set(pos[i].tolist()) <= set(got)
                if max(ns) > 1:
                    assert sorted(got) == list(range(ends[i])), "every row on a multi-token step"
                    continue
                qi = q[i]  # this request's one query token [H, d]
                sc = Ks[i][0, :ends[i]] @ qi.T  # [rows, H]
                best = sc[got].max(axis=0)
                left = np.setdiff1d(np.arange(ends[i]), got)
                if left.size:
                    assert (sc[left] < best - 1e-4).all(), "sound recall left out a better row"
                fetched_some |= len(got) > 32 + 8 + 8 + 1
        store.commit()
        store.check()
    t = store.recall_tally
    assert t["steps"] > 0 and fetched_some, t


if __name__ == "__main__":
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_")]
    for n, f in tests:
        f()
        print(f"{n}: ok")
    print(f"{len(tests)} passed, 0 failed")
