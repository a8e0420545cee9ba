"""The batch step's order rules, each with its documented status, both emission layouts,
caller buffers, and bad input checked before the call."""

import numpy as np
import pytest

import kvtier

from conftest import fill, small_config


def test_order_rules(mixed_ctx):
    ctx = mixed_ctx
    s = [ctx.sequence(1), ctx.sequence(2)]
    b = ctx.batch(2)
    assert b.context is ctx and b.n_seqs == 0
    with pytest.raises(kvtier.BadStateError):
        b.plan()
    with pytest.raises(kvtier.BadStateError):
        b.commit()
    with pytest.raises(kvtier.BadStateError):
        b.capacity(0)
    with pytest.raises(kvtier.BadStateError):
        b.run(0, indices=np.zeros((0, 4), np.int32), lengths=np.zeros(0, np.int32))
    b.reserve(s, [40, 3])
    assert b.n_seqs == 2
    with pytest.raises(kvtier.BadStateError):
        b.reserve(s, 1)  # a step is in flight
    with pytest.raises(kvtier.BadStateError):
        b.run(1)  # before plan (capacity refuses first, with the same status)
    fill(s[0], ctx, 40, 1)
    fill(s[1], ctx, 3, 2)
    b.plan()
    assert b.capacity(1) == (40, 43)
    with pytest.raises(kvtier.OutOfRangeError):
        b.capacity(3)
    tok = b.run(1)
    assert tok.lengths.tolist() == [40, 3] and tok.indices.shape == (2, 40)
    assert np.array_equal(tok.slots(0), [s[0].reserved_slot(1, j) for j in range(40)])
    with pytest.raises(IndexError):
        tok.slots(2)
    with pytest.raises(kvtier.BadStateError):  # its rows may have moved
        s[0].write(1, 0, 0, np.zeros((1, 64), np.uint8))
    s[0].write(2, 0, 0, np.zeros((1, 64), np.uint8))  # layer 2 has not run
    csr = b.run(1, "csr")
    assert csr.indptr.tolist() == [0, 40, 43] and csr.counts().tolist() == [40, 3]
    assert np.array_equal(csr.slots(1), tok.slots(1))
    with pytest.raises(kvtier.InvalidArgumentError):
        b.commit([40, 2])  # rejecting a token that is not a draft: the step stays open
    assert s[1].length == 0
    with pytest.raises(kvtier.InvalidArgumentError):
        b.commit([40, 4])
    with pytest.raises(ValueError):
        b.commit([40])  # one count per request, checked before the call
    b.commit([40, 3])
    assert [x.length for x in s] == [40, 3] and b.n_seqs == 0
    for x in s:
        x.check()


def test_reserve_checks(mixed_model):
    with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=6) as ctx:
        s = [ctx.sequence(i) for i in range(3)]
        b = ctx.batch(3)
        free = ctx.free_pages(0), ctx.free_pages(1)
        with pytest.raises(kvtier.PoolExhaustedError) as ei:
            b.reserve(s, [32, 48, 32])
        assert "nothing was reserved" in ei.value.message
        assert (ctx.free_pages(0), ctx.free_pages(1)) == free
        assert all(x.pending == 0 for x in s) and b.n_seqs == 0
        with pytest.raises(kvtier.CapacityError):
            ctx.batch(2).reserve(s, 1)  # 3 requests, max_seqs 2
        with pytest.raises(kvtier.InvalidArgumentError):
            b.reserve([s[0], s[0]], 1)  # the same request twice
        with kvtier.Context(mixed_model, small_config(), n_pages=4) as other:
            with pytest.raises(kvtier.InvalidArgumentError):
                b.reserve([other.sequence(9)], 1)  # a request of another context
        with pytest.raises(ValueError):
            b.reserve(s, [1, 2])  # one count per request, checked before the call
        with pytest.raises(ValueError):
            b.reserve(s, -1)
        with pytest.raises(TypeError):
            b.reserve([s[0], "s1"], 1)
        closed = ctx.sequence(7)
        closed.close()
        with pytest.raises(ValueError, match="closed"):
            b.reserve([closed], 1)
        with pytest.raises(kvtier.InvalidArgumentError):
            ctx.batch(0)
        b.reserve(s, np.array([16, 16, 16]))  # counts as an array
        other_b = ctx.batch(1)
        with pytest.raises(kvtier.BadStateError):  # s[0] is in b's step
            other_b.reserve([s[0]], 1)
        b.commit()


def test_slot_mapping_and_buffers(mixed_ctx):
    ctx = mixed_ctx
    s = [ctx.sequence(1), ctx.sequence(2)]
    b = ctx.batch(2)
    b.reserve(s, [5, 20])
    m = b.slot_mapping(0)
    assert m.dtype == np.int32 and len(m) == 25 and len(set(m.tolist())) == 25
    out = np.full(32, -7, np.int32)
    assert np.array_equal(b.slot_mapping(0, out=out), m) and out[25] == -7
    with pytest.raises(kvtier.CapacityError):
        b.slot_mapping(0, out=np.zeros(24, np.int32))
    # int64, vLLM's dtype (kvt_batch_slot_mapping64): the same slots, widened.
    m64 = b.slot_mapping(0, dtype=np.int64)
    assert m64.dtype == np.int64 and np.array_equal(m64, m)
    out64 = np.full(26, -7, np.int64)
    assert np.array_equal(b.slot_mapping(0, out=out64), m) and out64[25] == -7
    with pytest.raises(kvtier.CapacityError):
        b.slot_mapping(0, out=np.zeros(24, np.int64))
    with pytest.raises(TypeError):
        b.slot_mapping(0, out=np.zeros(25, np.int16))
    with pytest.raises(TypeError):
        b.slot_mapping(0, dtype=np.float64)
    with pytest.raises(ValueError):
        b.slot_mapping(0, out=np.zeros((5, 5), np.int32))
    with pytest.raises(kvtier.OutOfRangeError):
        b.slot_mapping(7)
    fill(s[0], ctx, 5)
    fill(s[1], ctx, 20)
    b.plan()
    # fixed-capacity caller buffers (e.g. reused by a captured graph)
    idx = np.full((4, 32), 99, np.int32)
    ln = np.zeros(4, np.int32)
    dense = np.full(4, 7, np.uint8)
    e = b.run(1, indices=idx, lengths=ln, dense=dense)
    assert e.indices is idx and ln[:2].tolist() == [5, 20] and dense[:2].tolist() == [0, 0]
    assert np.all(idx[0, 5:] == -1) and np.all(idx[2:] == 99)  # rows past n_seqs untouched
    with pytest.raises(kvtier.CapacityError):
        b.run(1, indices=np.zeros((2, 19), np.int32))
    with pytest.raises(kvtier.CapacityError):
        b.run(1, "csr", indices=np.zeros(24, np.int32))
    with pytest.raises(TypeError):
        b.run(1, indices=np.zeros((2, 32), np.int64))
    with pytest.raises(ValueError):
        b.run(1, indices=np.zeros((1, 32), np.int32))  # fewer rows than requests
    with pytest.raises(ValueError):
        b.run(1, indices=np.zeros((2, 32), np.int32), lengths=np.zeros(1, np.int32))
    with pytest.raises(ValueError):
        b.run(1, "csr", indices=np.zeros(32, np.int32), indptr=np.zeros(2, np.int32))
    with pytest.raises(ValueError):
        b.run(1, indices=np.zeros((2, 64), np.int32)[:, ::2])
    with pytest.raises(ValueError):
        ro = np.zeros((2, 32), np.int32)
        ro.flags.writeable = False
        b.run(1, indices=ro)
    with pytest.raises(TypeError):
        b.run(1, indices=[[0] * 32] * 2)  # a list would be copied: results lost
    with pytest.raises(ValueError):
        b.run(1, "pages")
    with pytest.raises(kvtier.OutOfRangeError):
        b.run(3, indices=np.zeros((2, 32), np.int32))
    # the query and stream pass through (recall off: ignored)
    q = np.zeros((2, 4, 576), np.float32)
    e = b.run(0, query=q, stream=0)
    assert e.lengths.tolist() == [5, 20]
    b.commit()


def test_destroying_things_mid_step(mixed_model):
    """kvt_batch_destroy before any run gives the reservations back; a request destroyed
    mid-step leaves it (its pages go back)."""
    with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=16) as ctx:
        free = ctx.free_pages(0), ctx.free_pages(1)
        s = [ctx.sequence(1), ctx.sequence(2)]
        b = ctx.batch(2)
        b.reserve(s, [20, 20])
        b.close()
        assert (ctx.free_pages(0), ctx.free_pages(1)) == free and s[0].pending == 0
        with pytest.raises(ValueError, match="closed"):
            b.plan()
        b = ctx.batch(2)
        b.reserve(s, [20, 20])
        fill(s[0], ctx, 20)
        b.plan()
        s[1].close()
        e = b.run(0)
        assert e.lengths.tolist() == [20, 0]
        b.commit()
        assert s[0].length == 20
        s[0].close()
        assert (ctx.free_pages(0), ctx.free_pages(1)) == free


def test_drafts_and_per_token_emission(mixed_ctx):
    """kvt_batch_reserve_drafts + queries_per_seq: token t of a request sees its committed set
    and the step's rows up to its own; commit accepts k of n, and only drafts may be rejected."""
    ctx = mixed_ctx
    s = ctx.sequence(1)
    b = ctx.batch(1)
    b.reserve([s], 20)
    fill(s, ctx, 20, 3)
    b.plan()
    b.commit()
    before = {layer: b_set for layer, b_set in
              ((layer, _attended(ctx, s, layer)) for layer in range(3))}
    b.reserve([s], [4], n_drafts=[3])
    fill(s, ctx, 4, 4)
    b.plan()
    for layer in range(3):
        for layout in ("tokens", "csr"):
            e = b.run(layer, layout, queries_per_seq=4)
            assert e.counts().tolist() == [len(before[layer]) + t + 1 for t in range(4)]
            for t in range(4):
                want = list(before[layer]) + [s.reserved_slot(layer, j) for j in range(t + 1)]
                assert e.slots(0, t).tolist() == want
            with pytest.raises(IndexError):
                e.slots(0, 4)
    with pytest.raises(kvtier.CapacityError):
        b.run(0, queries_per_seq=2)  # 4 query tokens do not fit in 2
    with pytest.raises(kvtier.InvalidArgumentError):
        b.commit([0])  # the sampled token is not a draft
    b.commit([2])
    assert s.length == 22
    s.check()
    with pytest.raises(kvtier.InvalidArgumentError):
        b.reserve([s], [2], n_drafts=[3])  # more drafts than tokens
    with pytest.raises(ValueError):
        b.reserve([s], [2], n_drafts=[1, 1])  # one count per request, checked before the call


def _attended(ctx, seq, layer):
    b = ctx.batch(1)
    b.reserve([seq], 0)
    b.plan()
    out = b.run(layer).slots(0).tolist()
    b.commit()
    b.close()
    return out


def test_buffers_hold_the_emission_on_the_guarded_backend(mixed_model):
    """kvt_buffer: backend memory, reached through read/write; on the guarded backend the run's
    emission goes there (a host array is also accepted there but proves nothing), and reading it
    back gives what the CPU backend emits into numpy arrays."""
    out = {}
    for backend in ("cpu", "guarded"):
        with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64,
                            allocator="libc", backend=backend) as ctx:
            s = ctx.sequence(5)
            b = ctx.batch(1)
            b.reserve([s], 70)
            fill(s, ctx, 70, 9)
            b.plan()
            b.commit()
            b.reserve([s], 3, n_drafts=2)
            fill(s, ctx, 3, 10)
            b.plan()
            topk, _ = b.capacity(0)
            idx = ctx.buffer(4 * 3 * topk)
            lens = ctx.buffer(4 * 3)
            assert idx.nbytes == 4 * 3 * topk and idx.read(np.int32).tolist() == [0] * (3 * topk)
            e = _lib_emit(b, 0, idx, lens, topk, 3)
            out[backend] = (idx.read(np.int32), lens.read(np.int32), e)
            b.commit([2])
            with pytest.raises(kvtier.OutOfRangeError):
                lens.read(np.int32, count=4)
            with pytest.raises(kvtier.InvalidArgumentError):
                ctx.buffer(0)
            lens.write(np.array([7], np.int32), offset=8)
            assert lens.read(np.int32).tolist()[2] == 7
            lens.write_async(np.array([9, 8], np.int32), stream=0)  # the CPU backends: at once
            assert lens.read_async(np.zeros(3, np.int32), stream=0).tolist() == [9, 8, 7]
            with pytest.raises(kvtier.OutOfRangeError):
                lens.read_async(np.zeros(4, np.int32), stream=None)
            lens.close()
            assert lens.closed
    assert np.array_equal(out["cpu"][0], out["guarded"][0])
    assert np.array_equal(out["cpu"][1], out["guarded"][1])
    assert out["cpu"][1].tolist()[1] == out["cpu"][1].tolist()[0] + 1  # causal per token


def test_host_arrays_on_the_guarded_backend_are_the_callers_error(mixed_model):
    """kvt_batch_run on the guarded backend with host (numpy) arrays as the emission, through the
    raw struct (Batch.run refuses them itself: MemorySpaceError): the C library answers
    InvalidArgumentError naming the array, not InvariantError, and nothing ran (the same step
    then runs into kvt_buffer memory)."""
    import ctypes
    from kvtier import _lib
    from kvtier._errors import check
    with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64,
                        allocator="libc", backend="guarded") as ctx:
        s = ctx.sequence(5)
        b = ctx.batch(1)
        b.reserve([s], 20)
        fill(s, ctx, 20, 9)
        b.plan()
        topk, _ = b.capacity(0)
        host_idx = np.zeros(topk, np.int32)
        host_len = np.zeros(1, np.int32)
        idx = ctx.buffer(4 * topk)
        lens = ctx.buffer(4)
        i32 = ctypes.POINTER(ctypes.c_int32)
        for ip, lp, named in ((host_idx.ctypes.data, lens.ptr, "emit.indices"),
                              (idx.ptr, host_len.ctypes.data, "emit.lengths")):
            e = _lib.EmitC()
            e.struct_size = ctypes.sizeof(_lib.EmitC)
            e.layout = int(kvtier.EmitLayout.TOKENS)
            e.indices = ctypes.cast(ip, i32)
            e.capacity = topk
            e.lengths = ctypes.cast(lp, i32)
            rc = _lib.lib.kvt_batch_run(b._ptr, 0, None, None, ctypes.byref(e))
            with pytest.raises(kvtier.InvalidArgumentError, match=named.replace(".", r"\.")):
                check(rc, "kvt_batch_run")
            assert "guarded backend's memory" in kvtier.last_error()
        _lib_emit(b, 0, idx, lens, topk, 1)
        assert lens.read(np.int32).tolist() == [20]
        b.commit()


def _lib_emit(b, layer, idx, lens, topk, sq):
    """kvt_batch_run into two kvt_buffers through the raw struct (Batch.run takes their views
    too, Buffer.view: test_device.py)."""
    import ctypes
    from kvtier import _lib
    e = _lib.EmitC()
    e.struct_size = ctypes.sizeof(_lib.EmitC)
    e.layout = int(kvtier.EmitLayout.TOKENS)
    e.indices = ctypes.cast(idx.ptr, ctypes.POINTER(ctypes.c_int32))
    e.capacity = topk
    e.lengths = ctypes.cast(lens.ptr, ctypes.POINTER(ctypes.c_int32))
    e.queries_per_seq = sq
    rc = _lib.lib.kvt_batch_run(b._ptr, layer, None, None, ctypes.byref(e))
    assert rc == 0, kvtier.status_name(rc)
    return rc


def test_plan_device_decode_steps(mixed_ctx):
    """Batch.plan_device (kvt_batch_plan_device) with buffers from Batch.emission: a quiet
    decode step (no close, round or drafts) is planned, its runs write the attended sets into
    the planned buffers (every row of the block tables: no close yet), and it commits; a step
    with work (a round, drafts) is not plannable and runs eagerly; later planned steps must
    pass the same buffers."""
    ctx = mixed_ctx
    s = [ctx.sequence(1), ctx.sequence(2)]
    b = ctx.batch(3)
    tok = b.emission("tokens", 64, want_dense=True)
    csr = b.emission("csr", 3 * 64)
    assert tok.indices.shape == (3, 64) and tok.lengths.shape == (3,) and tok.dense.shape == (3,)
    assert csr.indices.shape == (192,) and csr.indptr.shape == (4,)
    emits = [tok, csr, csr]  # one per layer (the evict layers share theirs)
    with pytest.raises(kvtier.BadStateError):
        b.plan_device(emits)  # no step
    b.reserve(s, [40, 20], n_drafts=[0, 2])
    fill(s[0], ctx, 40, 1)
    fill(s[1], ctx, 20, 2)
    b.plan()
    assert b.plan_device(emits) is False  # drafts: not plannable
    for layer in range(3):
        b.run(layer, emission=emits[layer])
    b.commit([40, 19])
    saw_planned = 0
    for step in range(12):  # one token each: 41..52 and 20..31 rows, a round at 48 rows
        due = s[0].length + 1 >= 48 and s[0].layer_stats(1).rounds == 0  # a round this step
        b.reserve(s, 1)
        fill(s[0], ctx, 1, 10 + step)
        fill(s[1], ctx, 1, 20 + step)
        b.plan()
        planned = b.plan_device(emits)
        assert planned is (not due), f"step {step}"
        if planned:
            with pytest.raises(kvtier.BadStateError):
                b.plan_device(emits)  # once a step
        sets = [b.run(layer, emission=emits[layer]) for layer in range(3)]
        assert sets[0].dense[:2].tolist() == [0, 0]
        b.commit()
        for i, x in enumerate(s):
            x.check()
            for layer in range(3):  # no close yet: every row of the table attended
                pages, n = x.block_table(layer)
                idx = np.arange(n)
                table = pages[idx // 16] * 16 + idx % 16
                got = sets[layer].slots(i)
                if layer == 0:
                    assert sorted(got.tolist()) == sorted(table.tolist()), (step, layer, i)
                else:
                    assert np.array_equal(got, table), (step, layer, i)
        saw_planned += planned
    assert 0 < saw_planned < 12 and s[0].layer_stats(1).rounds == 1
    # a planned step must pass its first planned step's buffers
    b.reserve(s, 1)
    fill(s[0], ctx, 1, 50)
    fill(s[1], ctx, 1, 51)
    b.plan()
    with pytest.raises(kvtier.InvalidArgumentError):
        b.plan_device(b.emission("tokens", 64))
    assert b.plan_device(emits) is True
    for layer in range(3):
        b.run(layer, emission=emits[layer])
    b.commit()
    with pytest.raises(ValueError):
        b.plan_device([tok, csr])  # 1 or n_layers
    with pytest.raises(TypeError):
        b.run(0, emission=tok, indices=tok.indices)
    small = kvtier.Emission(kvtier.EmitLayout.TOKENS, 2, np.zeros((2, 8), np.int32),
                            np.zeros(2, np.int32))
    with pytest.raises(ValueError):
        b.plan_device(small)  # sized for 2 requests, the batch takes 3
