"""Sequences: params, prompt rows, pages, reserved slots, writes, by-position queries, stats,
checks — and their statuses mid-step and on bad input."""

import numpy as np
import pytest

import kvtier
from kvtier import RowState

from conftest import fill, small_config


def test_params_and_bad_params(mixed_ctx):
    s = mixed_ctx.sequence(request_id=2**64 - 1, prompt_rows=5, ratio=32)
    assert s.request_id == 2**64 - 1 and s.length == 0 and len(s) == 0 and s.pending == 0
    assert s.context is mixed_ctx and s._context_ptr() == mixed_ctx._ptr
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        mixed_ctx.sequence(ratio=2**20 + 1)
    assert "ratio" in ei.value.message
    with pytest.raises(kvtier.UnsupportedError):
        mixed_ctx.sequence(recall="on")
    with pytest.raises(ValueError):
        mixed_ctx.sequence(request_id=-1)
    with pytest.raises(TypeError):
        kvtier.Sequence("ctx")
    f = s.fork(9)
    assert f.request_id == 9 and f.length == 0
    f.check()
    f.close()
    a = s.attach(0, 10)
    assert a.request_id == 10 and a.length == 0
    with pytest.raises(kvtier.InvalidArgumentError):
        s.attach(1, 11)  # not a multiple of the page size (and past the length)
    a.close()


def test_rows_by_position(mixed_ctx):
    ctx = mixed_ctx
    s = ctx.sequence(1, prompt_rows=4)
    assert s.pages_needed(40) == 3 + 3  # two groups of 16-row pages
    b = ctx.batch(1)
    b.reserve([s], 40)
    assert s.pending == 40
    assert [s.reserved_slot(1, j) for j in range(40)] == b.slot_mapping(1).tolist()
    with pytest.raises(kvtier.OutOfRangeError):
        s.reserved_slot(1, 40)
    with pytest.raises(kvtier.OutOfRangeError):
        s.reserved_slot(5, 0)
    fill(s, ctx, 40, seed=3)
    s.set_prompt_rows(6)
    # mid-step: by-position queries wait for the commit
    b.plan()
    for call in (lambda: s.row_state(0, 0, 0), lambda: s.check(), lambda: s.layer_stats(0),
                 lambda: s.positions(1, 0), lambda: s.block_table(1),
                 lambda: s.read_row(0, 0, 0, 0), lambda: s.last_slot_map(1, 0)):
        with pytest.raises(kvtier.BadStateError):
            call()
    b.commit()
    s.check()
    assert s.length == 40 and s.pending == 0
    rows = np.random.default_rng(3)  # fill()'s first layer: what read_row must give back
    first = rows.integers(0, 64, size=(40, 1152), dtype=np.uint8)
    assert np.array_equal(s.read_row(0, 0, 0, 17), first[17])
    state, slot = s.row_state(0, 0, 17)
    assert state == RowState.ATTENDED and slot >= 0
    assert np.array_equal(ctx.layer_read(0, 0, slot, 1).reshape(-1), first[17])
    pages, n_rows = s.block_table(1)
    assert n_rows == 40 and len(pages) == 3 and pages.dtype == np.int32
    assert s.first_row(1) == 0
    assert np.array_equal(s.positions(1, 1), np.arange(40))
    with pytest.raises(kvtier.PolicyMismatchError):
        s.last_slot_map(0, 0)  # salience rows never move
    assert len(s.last_slot_map(1, 0)) == 0  # no round yet (40 < K + r + c = 48)
    with pytest.raises(kvtier.OutOfRangeError):
        s.row_state(0, 0, 40)
    with pytest.raises(kvtier.OutOfRangeError):
        s.row_state(1, 2, 0)  # head 2 of 2
    with pytest.raises(kvtier.OutOfRangeError):
        s.read_row(9, 0, 0, 0)
    with pytest.raises(kvtier.OutOfRangeError):
        s.positions(0, 1)
    st = s.layer_stats(1)
    assert st.policy == kvtier.Policy.EVICT and st.appended_rows == 80 and st.prompt_rows == 6
    assert st.attended_rows == 40 and st.rounds == 0
    sal = s.layer_stats(0)
    assert sal.policy == kvtier.Policy.SALIENCE and sal.tail_rows == 40 and sal.closes == 0
    # a round moves rows: afterwards the prompt can no longer change
    b.reserve([s], 8)
    fill(s, ctx, 8, seed=4)
    b.commit()
    assert s.layer_stats(1).rounds == 1
    with pytest.raises(kvtier.BadStateError):
        s.set_prompt_rows(10)
    smap = s.last_slot_map(1, 0)
    assert len(smap) == 48 and (smap >= 0).sum() == 40
    s.check()


def test_write_checks(mixed_ctx):
    s = mixed_ctx.sequence(1)
    b = mixed_ctx.batch(1)
    with pytest.raises(kvtier.OutOfRangeError):  # nothing reserved
        s.write(1, 0, 0, np.zeros((1, 64), np.uint8))
    b.reserve([s], 4)
    s.write(1, 0, 0, np.zeros((4, 2, 16), np.float16))
    with pytest.raises(TypeError):
        s.write(1, 0, 0, np.zeros((4, 2, 16), np.float32))  # fp16 layer
    with pytest.raises(TypeError):
        s.write(0, 0, 0, np.zeros((1, 576), np.float16))    # bf16 layer: uint16 bits
    with pytest.raises(ValueError):
        s.write(1, 0, 0, np.zeros((4, 2, 15), np.float16))
    with pytest.raises(kvtier.OutOfRangeError):
        s.write(1, 0, 2, np.zeros((4, 64), np.uint8))       # tokens 2..5 of 4
    with pytest.raises(kvtier.OutOfRangeError):
        s.write(1, 2, 0, np.zeros((4, 64), np.uint8))       # plane 2
    b.commit()


def test_forks_share_pages_and_side_planes_counted_once(mixed_ctx):
    """kvt_ctx_memory_stats: a fork takes no page and no σ plane; the pages and the closed
    block's σ plane are counted once; kvt_layer_stats says what each request shares."""
    ctx = mixed_ctx
    s = ctx.sequence(1, prompt_rows=4)
    b = ctx.batch(1)
    b.reserve([s], 48)  # stays under the evict layers' first round (K + r + c = 48)
    fill(s, ctx, 48, seed=1)
    b.commit()
    b.reserve([s], 16)  # 64 rows: the salience layer closes its first block
    fill(s, ctx, 16, seed=2)
    b.commit()
    before = ctx.memory()
    assert before["requests"] == 1 and before["shared_pages"] == 0
    assert before["shared_side_bytes"] == 0 and before["side_bytes"] > 0
    kids = [s.fork(10 + i) for i in range(3)]
    after = ctx.memory()
    assert after["requests"] == 4
    assert after["pages_in_use"] == before["pages_in_use"]
    assert after["shared_pages"] == after["pages_in_use"]
    assert after["bytes_in_use"] == before["bytes_in_use"] == after["shared_bytes"]
    st = kids[0].layer_stats(0)
    assert st.shared_side_bytes >= 4 * 64 and st.side_bytes >= st.shared_side_bytes
    assert after["shared_side_bytes"] == st.shared_side_bytes
    for k in kids:
        k.check()
        k.close()
    assert ctx.memory()["shared_side_bytes"] == 0


def test_census_with_a_shared_prefix(mixed_model):
    t = mixed_model.census(1000, 4, 10.0)
    u = mixed_model.census(1000, 4, 10.0, shared_prefix=600)
    bpt = mixed_model.kv_bytes_per_token
    assert t.dense_bytes - u.dense_bytes == 3 * 600 * bpt
    assert u.attended_bytes == t.attended_bytes
    with pytest.raises(kvtier.InvalidArgumentError):
        mixed_model.census(100, 2, 10.0, shared_prefix=101)


def test_scores_are_the_sigma_of_the_closed_rows(mixed_ctx):
    """Sequence.scores (kvt_seq_scores): σ of the salience layer's closed rows by position, the
    very numbers kvtier.ref.Sigma gives for the rows written; empty before a close; refused on
    an evict layer and mid-step."""
    ctx = mixed_ctx
    rng = np.random.default_rng(8)
    s = ctx.sequence(1)
    assert s.scores(0).shape == (0,)
    with pytest.raises(kvtier.PolicyMismatchError):
        s.scores(1)
    rows = kvtier.bf16_from_float32(rng.standard_normal((70, 576)).astype(np.float32))
    b = ctx.batch(1)
    b.reserve([s], 70)
    fill(s, ctx, 70, seed=1)
    s.write(0, 0, 0, rows)
    b.plan()
    with pytest.raises(kvtier.BadStateError):
        s.scores(0)
    b.commit()
    got = s.scores(0)
    assert got.dtype == np.float32 and got.shape == (64,)
    with kvtier.ref.Sigma(64, 4, 64) as sigma:
        want = sigma.block(rows[:64].view(np.uint8), 1024, kvtier.DType.BF16)
    assert np.array_equal(got, np.where(np.isfinite(want), want, np.inf))


def test_request_ids_are_unique_among_live_requests(mixed_ctx):
    """kvt_seq_create, kvt_seq_fork and kvt_seq_attach refuse an id a live request of the
    context holds (it keys the random draws), with nothing created; the id is free again once
    its request is destroyed, and other contexts are independent."""
    ctx = mixed_ctx
    a = ctx.sequence(5)
    b = ctx.batch(1)
    b.reserve([a], 32)
    fill(a, ctx, 32)
    b.plan()
    b.commit()
    free = [ctx.free_pages(l) for l in range(3)]
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        ctx.sequence(5)
    assert "request id 5 is already live" in ei.value.message
    c = ctx.sequence(6)
    for make in (lambda: a.fork(6), lambda: a.fork(5), lambda: a.attach(16, 6),
                 lambda: c.attach(0, 5)):
        with pytest.raises(kvtier.InvalidArgumentError) as ei:
            make()
        assert "already live" in ei.value.message
    assert [ctx.free_pages(l) for l in range(3)] == free
    assert ctx.memory()["requests"] == 2
    c.close()
    f = a.fork(6)  # free again
    assert f.request_id == 6 and f.length == 32
    assert a.attach(16, 7).request_id == 7
    with kvtier.Context(ctx.model, small_config(), page_rows=16, n_pages=16) as other:
        assert other.sequence(5).request_id == 5
