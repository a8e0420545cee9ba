"""Snapshots through the binding: Sequence.snapshot / snapshot_file, Context.restore /
restore_file / from_snapshot, snapshot_clean — the restored request equal to the original by
position (rows, states, σ scores, eviction positions), request ids unique among live requests,
and damaged or mismatched snapshots refused with the library's status."""

import os
import stat
import time

import numpy as np
import pytest

import kvtier
from kvtier import RowState

from conftest import fill, small_config

SAL, EVI = 0, 1


def grow(ctx, seq, steps, seed):
    """A 70-row prompt (a salience close at 64, an eviction round past K + r + c = 48), then
    `steps` decode steps, every row written."""
    b = ctx.batch(1)
    for i in range(steps + 1):
        n = 70 if i == 0 else 1
        b.reserve([seq], n)
        fill(seq, ctx, n, seed + i)
        b.plan()
        b.commit()
    b.close()
    seq.check()


def state(seq):
    """Everything by position: each layer's row states and row bytes, eviction positions, σ."""
    ctx, out = seq.context, {"length": seq.length, "id": seq.request_id}
    for layer in range(ctx.n_layers):
        spec = ctx.layer_spec(layer)
        for h in range(spec.n_kv_heads):
            out[layer, h, "pos"] = seq.positions(layer, h).tolist()
            for p in range(seq.length):
                st, _ = seq.row_state(layer, h, p)
                out[layer, h, p] = st
                if st != RowState.DROPPED:
                    for plane in range(spec.n_planes):
                        out[layer, h, p, plane] = seq.read_row(layer, plane, h, p).tobytes()
    out["scores"] = seq.scores(SAL).tobytes()
    out["stats"] = [{k: v for k, v in seq.layer_stats(l).as_dict().items()
                     if "pages" not in k and not k.endswith("bytes")}  # counts, not memory
                    for l in range(ctx.n_layers)]
    return out


@pytest.fixture
def twin_ctx(mixed_model):
    with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64) as ctx:
        yield ctx


def test_round_trip_in_memory_and_through_a_file(mixed_ctx, twin_ctx, tmp_path):
    s = mixed_ctx.sequence(7, prompt_rows=4)
    grow(mixed_ctx, s, 5, seed=1)
    want = state(s)
    assert s.layer_stats(EVI).rounds == 1 and s.layer_stats(SAL).closes == 1
    data = s.snapshot()
    assert isinstance(data, bytes) and len(data) == s.snapshot_size()
    r = twin_ctx.restore(data)
    assert r.request_id == 7 and r.context is twin_ctx and r.length == 75
    r.check()
    assert state(r) == want
    assert r.snapshot() == data  # the restored request snapshots to the same bytes
    path = tmp_path / "req7.kvts"
    s.snapshot_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == data
    r.close()
    f = twin_ctx.restore_file(path)
    assert state(f) == want
    # both continue alike: one more step each (the same row) gives the same state
    for ctx, q in ((mixed_ctx, s), (twin_ctx, f)):
        with ctx.batch(1) as b:
            b.reserve([q], 1)
            fill(q, ctx, 1, 99)
            b.plan()
            b.commit()
    assert state(f) == state(s)
    # any bytes-like or uint8 array is read without a copy being needed
    f.close()
    twin_ctx.restore(np.frombuffer(data, np.uint8)).close()
    twin_ctx.restore(memoryview(bytearray(data))).close()
    with pytest.raises(TypeError):
        twin_ctx.restore(np.zeros(4, np.float32))
    with pytest.raises(kvtier.IoError):
        twin_ctx.restore_file(tmp_path / "missing.kvts")


def test_restore_refusals_change_nothing(mixed_ctx, twin_ctx, mixed_model):
    s = mixed_ctx.sequence(3)
    grow(mixed_ctx, s, 2, seed=5)
    data = s.snapshot()
    free = [twin_ctx.free_pages(l) for l in range(3)]
    # the request id is live in the context that took it: refused, named
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        mixed_ctx.restore(data)
    assert "request 3 is already live" in ei.value.message
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises((kvtier.CorruptError, kvtier.ParseError)):
        twin_ctx.restore(bytes(bad))
    with pytest.raises(kvtier.ParseError):
        twin_ctx.restore(data[:-9])
    with pytest.raises(kvtier.ParseError):
        twin_ctx.restore(b"")
    assert [twin_ctx.free_pages(l) for l in range(3)] == free
    with kvtier.Context(mixed_model, small_config(ratio=16), page_rows=16, n_pages=64) as other:
        with pytest.raises(kvtier.MismatchError):
            other.restore(data)
    # mid-step: no snapshot
    b = mixed_ctx.batch(1)
    b.reserve([s], 1)
    with pytest.raises(kvtier.BadStateError):
        s.snapshot()
    b.commit()
    # a preempted request comes back into the context that took it once it is destroyed
    want = state(s)
    data = s.snapshot()
    s.close()
    back = mixed_ctx.restore(data)
    assert state(back) == want


def test_restored_request_lives_with_its_context(mixed_ctx, mixed_model):
    s = mixed_ctx.sequence(4)
    grow(mixed_ctx, s, 0, seed=2)
    ctx = kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64)
    r = ctx.restore(s.snapshot())
    ctx.close()  # kvt_ctx_destroy frees the restored request too: its object is closed
    assert r.closed
    with pytest.raises(ValueError):
        r.length
    r.close()  # no double free


def test_snapshot_context(mixed_ctx):
    s = mixed_ctx.sequence(11, prompt_rows=4)
    grow(mixed_ctx, s, 3, seed=4)
    data = s.snapshot()
    with kvtier.Context.from_snapshot(data) as ctx:
        assert ctx.n_layers == 3 and ctx.page_rows is None
        assert ctx.model.layers == mixed_ctx.model.layers
        assert ctx.config == mixed_ctx.config
        r = ctx.restore(data)
        r.check()
        assert state(r) == state(s)
        assert ctx.plane(SAL).shape[1:] == (1, 576)  # bf16 (uint16 bits)
    with pytest.raises(kvtier.ParseError):
        kvtier.Context.from_snapshot(data[:100])


def test_snapshot_clean(tmp_path):
    magic = b"\x89KVT\r\n\x1a\n"
    old = time.time() - 3600
    files = {
        "a.kvts.tmp.AbC123": magic + b"partial",  # a killed writer's: stale when old enough
        "b.kvts.tmp.xyz789": b"",                 # empty: killed before its first byte
        "c.kvtb.tmp.QQQQQQ": b"KVTRB",            # a basis writer's, cut in its magic
        "d.kvts.tmp.QWERTY": b"not ours",         # another program's: never touched
        "e.kvts.tmp.abc": magic,                  # not six characters
        "notes.txt": magic,
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, (old, old))
    (tmp_path / "f.kvts.tmp.NEW001").write_bytes(magic)  # fresh: a writer may own it
    assert kvtier.snapshot_clean(tmp_path) == 3
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["d.kvts.tmp.QWERTY", "e.kvts.tmp.abc", "f.kvts.tmp.NEW001", "notes.txt"]
    assert kvtier.snapshot_clean(str(tmp_path), min_age_s=0) == 1
    assert kvtier.snapshot_clean(tmp_path) == 0
    with pytest.raises(kvtier.IoError):
        kvtier.snapshot_clean(tmp_path / "missing")
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.snapshot_clean("")
    with pytest.raises(ValueError):
        kvtier.snapshot_clean(tmp_path, min_age_s=-1)
