"""Emission options from Python: FlashInfer's paged layout (EmitLayout.PAGED: page ids over
kv_indptr, kv_last_page_len) where sets are whole pages, refused where they are not (and
Batch.emit_fits says so before the run), and EmitFlag.LENGTHS_PER_SEQ (FlashMLA's per-request
topk_length), eager and on a planned step, and PAGED on the CUDA backend (a device or the
emulation build) equal to the CPU's."""

import numpy as np
import pytest

import kvtier

from conftest import fill, small_config

P = 16


def pages_of(seq, layer):
    pages, rows = seq.block_table(layer)
    n = (rows + P - 1) // P
    return pages[:n], rows - (n - 1) * P if rows else 0


def test_paged_whole_pages_and_tokens(mixed_ctx):
    """Two requests under both budgets (40 and 17 rows, no close, no round): every layer's
    paged lists are their block tables' pages, last pages of 8 and 1 rows; expanded into slots
    they are the TOKENS lists."""
    ctx = mixed_ctx
    s = [ctx.sequence(1), ctx.sequence(2)]
    b = ctx.batch(2)
    b.reserve(s, [40, 17])
    fill(s[0], ctx, 40, 1)
    fill(s[1], ctx, 17, 2)
    b.plan()
    out = {}
    for layer in range(ctx.n_layers):
        assert b.emit_fits(layer) and b.emit_fits(layer, "tokens")
        pg = b.run(layer, "paged")
        tok = b.run(layer)  # a second run of the layer only emits
        assert pg.layout == kvtier.EmitLayout.PAGED
        assert pg.indptr.tolist() == [0, 3, 5] and pg.last_page_len.tolist() == [8, 1]
        assert pg.counts().tolist() == [3, 2]
        for i in range(2):
            assert np.array_equal(pg.slots(i, page_rows=P), tok.slots(i))
        out[layer] = pg
    b.commit()
    for layer, pg in out.items():
        for i in range(2):
            ids, last = pg.pages(i)
            want, want_last = pages_of(s[i], layer)
            assert np.array_equal(ids, want) and last == want_last
    with pytest.raises(ValueError):
        out[0].slots(0)  # a paged list needs the page size
    with pytest.raises(ValueError):
        tok.pages(0)


def test_paged_refused_after_a_close(mixed_ctx):
    """At 64 rows the salience close keeps 8 single rows: emit_fits says no (the close is due,
    then its list), the paged run is UnsupportedError, TOKENS emits; the eviction layers fit."""
    ctx = mixed_ctx
    s = ctx.sequence(1)
    b = ctx.batch(1)
    b.reserve([s], 63)
    fill(s, ctx, 63)
    b.plan()
    for layer in range(ctx.n_layers):
        b.run(layer)
    b.commit()
    b.reserve([s], 1)
    fill(s, ctx, 1, 3)
    b.plan()
    assert not b.emit_fits(0)
    with pytest.raises(kvtier.UnsupportedError) as ei:
        b.run(0, "paged")
    assert "not whole pages" in ei.value.message
    assert not b.emit_fits(0)
    assert b.run(0).counts().tolist() == [4 + 8]
    assert b.emit_fits(1) and b.run(1, "paged").counts().tolist() == [3]
    with pytest.raises(kvtier.InvalidArgumentError):  # a TOKENS-only option
        b.run(2, "paged", flags=kvtier.EmitFlag.LENGTHS_PER_SEQ)
    with pytest.raises(kvtier.OutOfRangeError):
        b.emit_fits(3)
    b.commit()
    with pytest.raises(kvtier.BadStateError):
        b.emit_fits(0)


def test_lengths_per_seq(mixed_ctx):
    """Two query tokens a request (s_q = 2), lengths one per request: the last token's count,
    each token's row its own slots then -1."""
    ctx = mixed_ctx
    s = [ctx.sequence(1), ctx.sequence(2)]
    b = ctx.batch(2)
    b.reserve(s, [10, 5])
    fill(s[0], ctx, 10)
    fill(s[1], ctx, 5)
    b.plan()
    for layer in range(ctx.n_layers):
        b.run(layer)
    b.commit()
    b.reserve(s, [2, 1])
    fill(s[0], ctx, 2, 4)
    fill(s[1], ctx, 1, 5)
    b.plan()
    per_q = b.run(1, queries_per_seq=2)
    per_s = b.run(1, queries_per_seq=2, flags=kvtier.EmitFlag.LENGTHS_PER_SEQ)
    assert per_q.counts().tolist() == [11, 12, 6, 6]
    assert per_s.flags == kvtier.EmitFlag.LENGTHS_PER_SEQ
    assert per_s.counts().tolist() == [12, 6]
    assert np.array_equal(per_s.indices[:4], per_q.indices[:4])
    for i in range(2):
        for t in range(2):
            assert np.array_equal(per_s.slots(i, t), per_q.slots(i, t))
    b.commit()


def paged_twins(a, g, prompt, steps):
    """Two requests on contexts a (eager runs) and g (plan_device where the step is plannable,
    else eager): TOKENS on the salience layer, PAGED on the eviction layers; every step's paged
    lists of g equal a's. Returns g's planned steps."""
    sa, sg = [a.sequence(1), a.sequence(2)], [g.sequence(1), g.sequence(2)]
    ba, bg = a.batch(2), g.batch(2)
    ea = [ba.emission("tokens", 256)] + [ba.emission("paged", 64) for _ in range(2)]
    eg = [bg.emission("tokens", 256)] + [bg.emission("paged", 64) for _ in range(2)]
    planned = 0
    for step in range(steps):
        n = prompt if step == 0 else [1, 1]
        for ctx, b, s in ((a, ba, sa), (g, bg, sg)):
            b.reserve(s, n)
            for i in range(2):
                fill(s[i], ctx, n[i], 10 * step + i)
            b.plan()
        for layer in range(3):
            ba.run(layer, emission=ea[layer])
        planned += bg.plan_device(eg)
        for layer in range(3):
            bg.run(layer, emission=eg[layer])
        for layer in (1, 2):
            x, y = ea[layer], eg[layer].host()  # (g's device arrays copied on CUDA)
            assert np.array_equal(x.indptr[:3], y.indptr[:3])
            assert np.array_equal(x.indices[:x.indptr[2]], y.indices[:y.indptr[2]])
            assert np.array_equal(x.last_page_len[:2], y.last_page_len[:2])
            for i in range(2):
                assert np.array_equal(x.slots(i, page_rows=P), y.slots(i, page_rows=P))
        ba.commit()
        bg.commit()
    return planned


def test_paged_planned_equals_eager(mixed_model):
    """plan_device with a PAGED emission on the eviction layers (TOKENS on the salience
    layer): each planned step's lists equal an eager twin's."""
    def open_ctx():
        return kvtier.Context(mixed_model, small_config(), page_rows=P, n_pages=64,
                              allocator="libc")
    with open_ctx() as ca, open_ctx() as cg:
        assert paged_twins(ca, cg, [30, 20], 40) >= 30


@pytest.mark.skipif(not kvtier.cuda.emulated() and kvtier.cuda.device_count() == 0,
                    reason="the CUDA backend needs a device or the CUDA emulation build "
                           "(-DKVT_CUDA_EMU=ON, docs/cuda-emulation.md): this library has neither")
def test_paged_on_the_cuda_backend_equals_the_cpu(mixed_model):
    """PAGED emissions in device memory (Batch.emission on the CUDA backend), eager and planned
    (plan_device), equal the CPU backend's lists of the same steps."""
    kw = dict(page_rows=P, n_pages=64)
    with kvtier.Context(mixed_model, small_config(), backend="cpu", **kw) as a, \
            kvtier.Context(mixed_model, small_config(), backend="cuda", **kw) as g:
        assert isinstance(g.batch(1).emission("paged", 8).last_page_len, kvtier.DeviceArray)
        assert paged_twins(a, g, [37, 18], 30) >= 20
