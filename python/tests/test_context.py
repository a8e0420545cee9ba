"""Config, context creation on every backend, planes (data, view, read, write, bind) and bad
input."""

import numpy as np
import pytest

import kvtier
from kvtier import Backend, DType, LayerKind, Policy

from conftest import small_config


def test_config_defaults_and_fields():
    c = kvtier.Config()
    assert (c.ratio, c.block_rows, c.kappa, c.sink_rows, c.evict_budget_rows, c.recent_rows) == \
        (32, 4096, 16, 4, 1024, 64)
    assert c.protect_prompt is True and c.evict_archive is False
    assert c.recall == kvtier.RecallMode.OFF and c.selector == kvtier.Selector.SIGMA
    c.check()
    d = kvtier.Config(ratio=8, selector="random", evict_vase=True)
    assert d.ratio == 8 and d.selector == kvtier.Selector.RANDOM and d.evict_vase
    assert d != c and kvtier.config_default() == c
    with pytest.raises(AttributeError):
        kvtier.Config(colour=1)
    with pytest.raises(ValueError):
        kvtier.Config(ratio=-1)
    with pytest.raises(ValueError):
        kvtier.Config(seed=2**64)
    with pytest.raises(TypeError):
        kvtier.Config(protect_prompt=1)
    with pytest.raises(ValueError):
        kvtier.Config(selector="best")
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        kvtier.Config(block_rows=100).check()
    assert "block_rows" in ei.value.message
    kvtier.Config(recall="sound", recall_cap_rows=64, recall_margin=0.5).check()
    assert kvtier.Config(recall="on").recall == kvtier.RecallMode.CONFORMAL
    assert kvtier.Config().recall_cap_rows == 4096 and kvtier.Config().recall_margin == 1.0
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        kvtier.Config(recall_cap_rows=0).check()
    assert "recall_cap_rows" in ei.value.message
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.Config(recall_margin=float("nan")).check()
    with pytest.raises(TypeError):
        kvtier.Config(recall_margin="wide")
    # a random-eviction budget below the recent window: refused, both named, at the check and
    # at context creation
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        kvtier.Config(evict_budget_rows=8, recent_rows=9).check()
    assert "evict_budget_rows" in ei.value.message and "recent_rows" in ei.value.message
    kvtier.Config(evict_budget_rows=8, recent_rows=8).check()


def test_context_refuses_a_budget_below_the_recent_window(mixed_model):
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        kvtier.Context(mixed_model, {"evict_budget_rows": 16, "recent_rows": 32}, n_pages=8)
    assert "evict_budget_rows" in ei.value.message


def test_context_description(mixed_model):
    with kvtier.Context(mixed_model, {"ratio": 8, "block_rows": 64, "kappa": 4},
                        page_rows=16, n_pages=10) as ctx:
        assert ctx.backend_name == "cpu" and ctx.allocator_name in ("libc", "jemalloc")
        assert ctx.config.ratio == 8 and ctx.config.block_rows == 64
        assert ctx.n_layers == 3 and ctx.page_rows == 16 and ctx.n_pages == 10
        assert [ctx.layer_policy(i) for i in range(3)] == [Policy.SALIENCE, Policy.EVICT,
                                                           Policy.EVICT]
        assert ctx.layer_group(1) == ctx.layer_group(2) != ctx.layer_group(0)
        assert ctx.free_pages(0) == 10
        with pytest.raises(kvtier.OutOfRangeError):
            ctx.free_pages(3)
        m = ctx.model  # the context's own copy
        assert m.model_type == "mixed" and m.layers == mixed_model.layers
        assert ctx.host_allocations > 0
        base, size = ctx.layer_data(0, 0)
        assert base != 0 and size == 10 * 16 * 1152
    assert ctx.closed
    with pytest.raises(ValueError, match="closed"):
        ctx.free_pages(0)


def test_create_default(kimi):
    with kvtier.Context.create_default(kimi) as ctx:
        assert ctx.backend_name == "cpu" and ctx.config == kvtier.Config()
        assert ctx.n_pages == kvtier._lib.lib.kvt_ctx_default_params().n_pages


def test_backends(mixed_model):
    with kvtier.Context(mixed_model, small_config(), backend="guarded", n_pages=8,
                        page_rows=16) as g:
        assert g.backend_name == "guarded"
        with pytest.raises(ValueError, match="guarded"):
            g.plane(0)
        rows = np.arange(2 * 1152, dtype=np.uint32).astype(np.uint8).reshape(2, 1, 1152)
        g.layer_write(0, 0, 5, rows)
        assert np.array_equal(g.layer_read(0, 0, 5, 2), rows)
    with kvtier.Context(mixed_model, backend=Backend.AUTO, n_pages=8) as a:
        assert a.backend_name in ("cpu", "cuda")
    try:
        c = kvtier.Context(mixed_model, backend="cuda", n_pages=8)
    except kvtier.NoDeviceError as e:  # built without CUDA, or no device: say so
        assert e.name == "KVT_ERR_NO_DEVICE" and "CUDA" in e.message
    else:  # a machine with a GPU and a CUDA build
        assert c.backend_name == "cuda"
        assert isinstance(c.plane(0), kvtier.DeviceArray)  # device memory, never a numpy view
        c.close()
    with pytest.raises(ValueError):
        kvtier.Context(mixed_model, backend="tpu")


def test_context_bad_params(mixed_model, kimi):
    with pytest.raises(TypeError):
        kvtier.Context("model")
    with pytest.raises(TypeError):
        kvtier.Context(mixed_model, config=3)
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        kvtier.Context(mixed_model, page_rows=0)
    assert "page_rows" in ei.value.message
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.Context(mixed_model, small_config(kappa=0))
    with pytest.raises(ValueError):
        kvtier.Context(mixed_model, n_pages=-5)
    # layer_policies: one per layer, checked here (C reads n_layers entries) ...
    with pytest.raises(ValueError, match="3 layers"):
        kvtier.Context(mixed_model, layer_policies=[Policy.NONE])
    # ... and salience only where σ exists (MLA-NoPE)
    with pytest.raises(kvtier.PolicyMismatchError) as ei:
        kvtier.Context(mixed_model, layer_policies=["salience", "salience", "evict"])
    assert "layer 1" in ei.value.message
    with kvtier.Context(mixed_model, layer_policies=["none", "evict", "none"], n_pages=8) as c:
        assert [c.layer_policy(i) for i in range(3)] == [Policy.NONE, Policy.EVICT, Policy.NONE]
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.Context(mixed_model, kv_head_offset=1, n_kv_heads_global=2)
    with kvtier.Context(kimi, n_pages=4) as c:
        with pytest.raises(kvtier.PolicyMismatchError):
            c.layer_data(0, 0)  # a KDA layer stores no KV


def test_layer_read_write_and_plane_view(mixed_ctx):
    ctx = mixed_ctx
    view = ctx.plane(1, 1)  # GQA fp16 V plane: [slots, 2 heads, 16 halves], typed
    assert view.shape == (64 * 16, 2, 16) and view.dtype == np.float16
    assert isinstance(view, kvtier.PlaneView) and view.kvt_dtype == kvtier.DType.FP16
    rows = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float16)
    ctx.layer_write(1, 1, 10, rows)  # elements of the layer's dtype
    assert np.array_equal(view[10:13], rows)
    back = ctx.layer_read(1, 1, 10, 3)
    assert back.shape == (3, 2, 32) and np.array_equal(back.view(np.float16), rows)
    assert np.array_equal(kvtier.rows_as_elements(back, ctx.layer_spec(1)), rows)
    out = np.zeros((3, 64), np.uint8)
    ctx.layer_read(1, 1, 10, 3, out=out)
    assert np.array_equal(out.view(np.float16).reshape(3, 2, 16), rows)
    view[20] = np.full((2, 16), 7, np.float16)
    assert np.all(ctx.layer_read(1, 1, 20, 1).view(np.float16) == 7)
    # a cast is refused, not done: numpy would truncate float32 into the plane silently
    with pytest.raises(TypeError, match="float32 into a fp16 plane"):
        view[21] = np.ones((2, 16), np.float32)
    with pytest.raises(TypeError, match="int64"):
        view[21:23, 0] = 3
    assert np.all(ctx.layer_read(1, 1, 21, 2) == 0)  # nothing written
    # wrong dtype / shape / contiguity: refused before the call
    with pytest.raises(TypeError, match="float16"):
        ctx.layer_write(1, 1, 0, rows.astype(np.float32))
    with pytest.raises(ValueError, match="64 bytes"):
        ctx.layer_write(1, 1, 0, np.zeros((3, 2, 8), np.float16))
    with pytest.raises(ValueError, match="contiguous"):
        ctx.layer_write(1, 1, 0, np.zeros((3, 2, 32), np.float16)[:, :, ::2])
    with pytest.raises(ValueError):
        ctx.layer_write(1, 1, 0, np.zeros(64, np.uint8))  # no slot axis
    with pytest.raises(TypeError):
        ctx.layer_write(1, 1, 0, "rows")
    # the library's statuses
    with pytest.raises(kvtier.OutOfRangeError):
        ctx.layer_write(1, 1, 64 * 16 - 1, np.zeros((2, 64), np.uint8))  # past the pool
    with pytest.raises(kvtier.OutOfRangeError):
        ctx.layer_read(1, 2, 0, 1)  # plane 2
    with pytest.raises(kvtier.OutOfRangeError):
        ctx.layer_read(7, 0, 0, 1)
    with pytest.raises(kvtier.InvalidArgumentError):
        ctx.layer_read(1, 1, 0, 2, out=np.zeros((1, 64), np.uint8))  # wrong byte count
    with pytest.raises(ValueError):
        ctx.layer_read(1, 1, 0, 1, out=np.zeros((64, 2), np.uint8).T)
    # bf16 rows as uint16 bits
    mla = kvtier.bf16_from_float32(np.linspace(-1, 1, 576, dtype=np.float32)).reshape(1, 1, 576)
    ctx.layer_write(0, 0, 3, mla)
    assert np.array_equal(ctx.layer_read(0, 0, 3, 1).view(np.uint16), mla)


def test_dlpack_and_array_interface_inputs(mixed_ctx):
    rows = np.arange(128, dtype=np.uint8).reshape(2, 64)

    class Exporter:  # only __array_interface__
        def __init__(self, a):
            self.__array_interface__ = a.__array_interface__
            self._a = a

    mixed_ctx.layer_write(1, 0, 0, Exporter(rows))
    assert np.array_equal(mixed_ctx.layer_read(1, 0, 0, 2).reshape(2, 64), rows)
    if not hasattr(np, "from_dlpack"):
        pytest.skip("numpy without DLPack")

    class DL:  # only DLPack
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    mixed_ctx.layer_write(1, 0, 4, DL(rows[::-1].copy()))
    assert np.array_equal(mixed_ctx.layer_read(1, 0, 4, 2).reshape(2, 64), rows[::-1])


def test_external_storage(mixed_model):
    cfg = small_config()
    with kvtier.Context(mixed_model, cfg, page_rows=16, n_pages=4) as plain:
        with pytest.raises(kvtier.BadStateError):
            plain.layer_bind(0, 0, np.zeros(4 * 16 * 1152, np.uint8))
    ctx = kvtier.Context(mixed_model, cfg, page_rows=16, n_pages=4, external_storage=True)
    need = {0: 4 * 16 * 1152, 1: 4 * 16 * 64, 2: 4 * 16 * 64}
    with pytest.raises(kvtier.CapacityError):
        ctx.layer_bind(0, 0, np.zeros(need[0] - 1, np.uint8))
    with pytest.raises(ValueError):
        ctx.layer_bind(0, 0, np.zeros(2 * need[0], np.uint8)[::2])  # not contiguous
    buffers = {}
    for layer in range(3):
        for plane in range(ctx.layer_spec(layer).n_planes):
            buffers[layer, plane] = np.zeros(need[layer], np.uint8)
            ctx.layer_bind(layer, plane, buffers[layer, plane])
    seq = ctx.sequence(1)
    b = ctx.batch(1)
    b.reserve([seq], 3)
    with pytest.raises(kvtier.BadStateError):  # after the first reservation
        ctx.layer_bind(0, 0, np.zeros(need[0], np.uint8))
    slots = b.slot_mapping(0)
    seq.write(0, 0, 0, np.full((3, 1152), 9, np.uint8))
    b.commit()
    # the rows landed in our memory
    assert np.all(buffers[0, 0].reshape(-1, 1152)[slots] == 9)
    ctx.close()


def test_request_slots(mixed_model):
    """max_seqs: past it kvt_seq_create is CapacityError; with max_rows_per_seq the slots are
    built at creation and reused, so admissions allocate nothing."""
    with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64, allocator="libc",
                        max_rows_per_seq=128, max_seqs=2) as ctx:
        before = ctx.host_allocations
        a, b = ctx.sequence(1), ctx.sequence(2)
        with pytest.raises(kvtier.CapacityError):
            ctx.sequence(3)
        a.close()
        c = ctx.sequence(3)
        assert ctx.host_allocations == before
        c.check()
        b.check()
