"""Arrays in other memory spaces (kvtier._arrays): DLPack and __cuda_array_interface__ in and out,
the memory-space checks of each backend, typed plane views, and the CUDA backend with a captured
graph step from Python (through the CUDA emulation build, -DKVT_CUDA_EMU=ON, where no device
exists: docs/cuda-emulation.md). Device pointers made up here are never dereferenced: the
binding must refuse them before any C call on a backend whose memory is the host's."""

import ctypes
import gc

import numpy as np
import pytest

import kvtier
from kvtier import _arrays
from conftest import fill, small_config

FAKE = 0x7F00DEAD0000  # a "device" address: must reach C unchanged or be refused, never read


class CudaArray:
    """An array of our own exposing only __cuda_array_interface__ (as CuPy / Numba do)."""

    def __init__(self, ptr, shape, typestr="<i4", strides=None, readonly=False):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, readonly), "strides": strides,
                                         "version": 3}


class DLPackOnly:
    """A producer of our own exposing only __dlpack__ / __dlpack_device__ (as torch does)."""

    def __init__(self, inner):
        self.inner = inner

    def __dlpack__(self, **kw):
        return self.inner.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()


def fake_device_array(shape, dtype=np.int32, ptr=FAKE, dtype_name=None):
    """A DeviceArray describing CUDA memory at ptr (never read: no reader)."""
    return kvtier.DeviceArray(ptr, shape, dtype, (_arrays.DL_CUDA, 0), None, None,
                              dtype_name=dtype_name)


# --- parsing: pointer, shape, dtype and device exactly as the producer gave them ------------
def test_cuda_array_interface_is_read_unchanged():
    ref = _arrays.array_ref(CudaArray(FAKE, (3, 5)), "x")
    assert ref.ptr == FAKE and ref.shape == (3, 5) and ref.dtype == np.int32
    assert ref.device == (_arrays.DL_CUDA, None) and not ref.on_host and ref.contiguous
    assert ref.writable and ref.host is None
    strided = _arrays.array_ref(CudaArray(FAKE, (3, 5), strides=(40, 4)), "x")
    assert not strided.contiguous
    c_strides = _arrays.array_ref(CudaArray(FAKE, (3, 5), strides=(20, 4)), "x")
    assert c_strides.contiguous
    assert not _arrays.array_ref(CudaArray(FAKE, (2,), readonly=True), "x").writable


def test_dlpack_capsules_are_read_unchanged():
    # a device producer (our exporter over a made-up CUDA pointer): read, not dereferenced
    src = fake_device_array((4, 6), np.uint16, dtype_name="bfloat16")
    ref = _arrays.array_ref(DLPackOnly(src), "x")
    assert ref.ptr == FAKE and ref.shape == (4, 6) and ref.device == (_arrays.DL_CUDA, 0)
    assert ref.dtype == np.uint16 and ref.dtype_name == "bfloat16" and ref.host is None
    # numpy's own DLPack (host): a zero-copy view of the same memory
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    ref = _arrays.array_ref(DLPackOnly(a), "x")
    assert ref.on_host and ref.ptr == a.ctypes.data and np.shares_memory(ref.host, a)


def test_device_array_exports_to_numpy_by_dlpack():
    """The exporter's capsule, consumed by numpy (a CPU-device DeviceArray over numpy memory):
    the same memory, and the deleter releases what it kept once the consumer is done."""
    base = np.arange(10, dtype=np.int32)
    d = kvtier.DeviceArray(base.ctypes.data, (2, 5), np.int32, (_arrays.DL_CPU, 0), base, None)
    before = len(_arrays._exported)
    v = np.from_dlpack(d)
    assert v.shape == (2, 5) and np.shares_memory(v, base) and v[1, 4] == 9
    assert len(_arrays._exported) == before + 1
    del v
    gc.collect()
    assert len(_arrays._exported) == before
    cap = d.__dlpack__()  # an unconsumed capsule frees its tensor when it goes
    assert len(_arrays._exported) == before + 1
    del cap
    gc.collect()
    assert len(_arrays._exported) == before
    dev = fake_device_array((3,))
    cai = dev.__cuda_array_interface__
    assert cai["data"] == (FAKE, False) and cai["typestr"] == "<i4" and cai["shape"] == (3,)
    assert dev.__dlpack_device__() == (_arrays.DL_CUDA, 0)
    with pytest.raises(BufferError):
        dev.__dlpack__(copy=True)


# --- the CPU backend: host memory in, device memory refused before any C call ---------------
def step_ready(ctx, n=3):
    s = [ctx.sequence(1), ctx.sequence(2)]
    b = ctx.batch(3)
    b.reserve(s, n)
    for i, x in enumerate(s):
        fill(x, ctx, n, i)
    b.plan()
    return s, b


def test_cpu_backend_refuses_device_memory(mixed_ctx):
    s, b = step_ready(mixed_ctx)
    with pytest.raises(kvtier.MemorySpaceError, match="cuda memory, but the cpu backend"):
        b.run(1, "csr", indices=CudaArray(FAKE, (64,)), indptr=np.zeros(3, np.int32))
    with pytest.raises(kvtier.MemorySpaceError, match="cuda:0 memory"):
        b.run(1, emission=kvtier.Emission("csr", 2, fake_device_array((64,)),
                                          indptr=np.zeros(3, np.int32)))
    with pytest.raises(kvtier.MemorySpaceError):
        b.run(1, "csr", indices=np.zeros(64, np.int32), indptr=np.zeros(3, np.int32),
              query=CudaArray(FAKE, (2, 4, 16), "<f4"))
    with pytest.raises(kvtier.MemorySpaceError, match="host memory"):
        b.slot_mapping(0, out=CudaArray(FAKE, (8,)))
    with pytest.raises(kvtier.MemorySpaceError):
        s[0].write(1, 0, 0, DLPackOnly(fake_device_array((3, 64), np.uint8)))
    with pytest.raises(kvtier.MemorySpaceError):
        mixed_ctx.layer_write(1, 0, 0, CudaArray(FAKE, (1, 64), "|u1"))
    # host memory by DLPack or the array interface: the run writes behind the producer's pointer
    idx, ptr_ = np.full(64, -7, np.int32), np.zeros(3, np.int32)
    e = b.run(1, "csr", indices=DLPackOnly(idx), indptr=DLPackOnly(ptr_))
    assert ptr_[2] == 6 and np.array_equal(e.indices, idx) and (idx[:6] >= 0).all()
    b.commit()


def test_emission_is_checked_once_and_reused(mixed_ctx):
    s, b = step_ready(mixed_ctx)
    e = b.emission("csr", 64)
    r1 = b.run(1, emission=e)
    assert e._c is not None and r1.n_seqs == 2 and r1.counts().tolist() == [3, 3]
    assert b.run(2, emission=e) is r1  # the same view of the same arrays: nothing rebuilt
    q = np.zeros((2, 4, 16), np.float32)  # no request recalls: read by no one, still checked
    b.run(2, emission=e, query=q)
    assert b._qcache[0] is q and b._qcache[1] == q.ctypes.data  # kept for the next run
    with pytest.raises(TypeError, match="float32"):
        b.run(2, emission=e, query=q.astype(np.float64))
    e.indptr = np.zeros(4, np.int32)   # a new array: checked and built again at the next run
    assert e._c is None
    b.run(1, emission=e)
    assert e.indptr[2] == 6
    with pytest.raises(ValueError, match="holds 1 lists"):
        b.run(1, emission=kvtier.Emission("csr", 1, np.zeros(64, np.int32),
                                          indptr=np.zeros(2, np.int32)))
    with pytest.raises(TypeError, match="int32"):
        b.run(1, emission=kvtier.Emission("csr", 2, np.zeros(64, np.int64),
                                          indptr=np.zeros(3, np.int32)))
    b.commit()


# --- typed plane views ---------------------------------------------------------------------
def test_planes_are_typed_and_refuse_casts():
    specs = [kvtier.LayerSpec.mla(kvtier.LayerKind.MLA_NOPE, kvtier.DType.BF16, 512, 64),
             kvtier.LayerSpec.gqa(kvtier.LayerKind.GQA_ROPE, kvtier.DType.FP32, 2, 8)]
    ds_mla = kvtier.LayerSpec(kind=kvtier.LayerKind.MLA_NOPE, dtype=kvtier.DType.FP8_E4M3,
                              n_kv_heads=1, n_planes=1,
                              head_dim=576, value_dim=512, branch_dim=64, row_bytes=656,
                              branch_offset=528, branch_dtype=kvtier.DType.BF16, n_q_heads=16)
    with kvtier.Model([ds_mla], "ds_mla") as m, \
            kvtier.Context(m, small_config(), page_rows=16, n_pages=4) as ctx:
        fp8 = ctx.plane(0)  # FlashMLA's 656-B ds_mla rows (fp8 values, fp32 scales, bf16 rope)
        assert fp8.dtype == np.uint8 and fp8.shape == (64, 1, 656)
        with pytest.raises(TypeError):
            fp8[0] = np.ones((1, 656), np.float32)
    with kvtier.Model(specs, "typed") as m, \
            kvtier.Context(m, small_config(), page_rows=16, n_pages=4) as ctx:
        bf16, f32 = ctx.plane(0), ctx.plane(1, 1)
        assert bf16.dtype == np.uint16 and bf16.shape == (64, 1, 576)
        assert bf16.kvt_dtype == kvtier.DType.BF16
        assert f32.dtype == np.float32 and f32.shape == (64, 2, 8)
        x = np.linspace(-2, 2, 576, dtype=np.float32)
        with pytest.raises(TypeError, match="float32 into a bf16 plane"):
            bf16[3, 0] = x          # numpy would store int(x): the cache corrupted
        with pytest.raises(TypeError):
            bf16[3:5] = np.zeros((2, 1, 576), np.float16)
        assert not bf16.any()
        bf16[3, 0] = kvtier.bf16_from_float32(x)
        assert np.array_equal(kvtier.bf16_to_float32(ctx.layer_read(0, 0, 3, 1).view(
            np.uint16)).reshape(-1), kvtier.bf16_to_float32(kvtier.bf16_from_float32(x)))
        with pytest.raises(TypeError, match="float64 into a fp32 plane"):
            f32[0] = np.ones((2, 8))
        f32[0] = np.ones((2, 8), np.float32)
        assert ctx.layer_read(1, 1, 0, 1).view(np.float32).tolist() == [[[1.0] * 8] * 2]
        sub = bf16[10:12]                   # slices keep the guard
        assert isinstance(sub, kvtier.PlaneView)
        with pytest.raises(TypeError):
            sub[:] = 1.5


# --- the guarded backend: its own buffers only ---------------------------------------------
def test_guarded_emission_lives_in_its_buffers(mixed_model):
    out = {}
    for backend in ("cpu", "guarded"):
        with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64,
                            allocator="libc", backend=backend) as ctx:
            s, b = step_ready(ctx)
            e = b.emission("csr", 64, want_dense=True)
            if backend == "guarded":
                assert isinstance(e.indices, kvtier.DeviceArray)
                assert not hasattr(e.indices, "__cuda_array_interface__")
                with pytest.raises(BufferError):
                    e.indices.__dlpack__()
                with pytest.raises(kvtier.MemorySpaceError, match="guarded backend"):
                    b.run(1, "csr", indices=np.zeros(64, np.int32), indptr=np.zeros(3, np.int32))
                with pytest.raises(ValueError, match="not host memory"):
                    ctx.plane(0)
                d = b.run(1, "csr")  # no buffers given: made in its buffers, not on the host
                assert isinstance(d.indices, kvtier.DeviceArray) and \
                    d.counts().tolist() == [3, 3]
            with pytest.raises(TypeError, match="kvtier.Emission"):
                b.run(1, emission=np.zeros(4, np.int32))
            out[backend] = [b.run(layer, emission=e).host() for layer in (1, 2)]
            out[backend] = [(x.indices.copy(), x.indptr.copy()) for x in out[backend]]
            b.commit()
    for (ci, cp), (gi, gp) in zip(out["cpu"], out["guarded"]):
        assert np.array_equal(cp, gp) and np.array_equal(ci[:cp[-1]], gi[:gp[-1]])


# --- the CUDA backend ------------------------------------------------------------------------
emu = pytest.mark.skipif(not kvtier.cuda.emulated() and kvtier.cuda.device_count() == 0,
                         reason="the CUDA backend needs a device or the CUDA emulation build "
                                "(-DKVT_CUDA_EMU=ON, docs/cuda-emulation.md): this library has "
                                "neither")


def test_cuda_backend_selectable(mixed_model):
    if kvtier.cuda.emulated() or kvtier.cuda.device_count() > 0:
        with kvtier.Context(mixed_model, n_pages=8, backend="cuda") as ctx:
            assert ctx.backend_name == "cuda"
    else:
        with pytest.raises(kvtier.NoDeviceError):
            kvtier.Context(mixed_model, n_pages=8, backend="cuda")


@emu
def test_cuda_planes_and_emissions_are_device_arrays(mixed_model):
    with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64,
                        backend="cuda") as ctx:
        p = ctx.plane(1, 1)
        assert isinstance(p, kvtier.DeviceArray) and p.dtype == np.float16
        assert p.shape == (1024, 2, 16) and p.ptr == ctx.layer_data(1, 1)[0]
        cai = p.__cuda_array_interface__
        assert cai["data"][0] == p.ptr and cai["typestr"] == "<f2"
        ref = _arrays.array_ref(DLPackOnly(ctx.plane(0)), "plane")
        assert ref.dtype_name == "bfloat16" and ref.ptr == ctx.layer_data(0, 0)[0]
        rows = np.arange(2 * 2 * 16, dtype=np.float16).reshape(2, 2, 16)
        ctx.layer_write(1, 1, 5, rows)
        assert np.array_equal(p.numpy()[5:7], rows)
        s, b = step_ready(ctx)
        with pytest.raises(kvtier.MemorySpaceError, match="host memory, but the cuda backend"):
            b.run(1, "csr", indices=np.zeros(64, np.int32), indptr=np.zeros(3, np.int32))
        # device memory of our own (a kvt_buffer behind a bare __cuda_array_interface__ and a
        # DLPack capsule): the run writes behind exactly those pointers
        ib, pb = ctx.buffer(64 * 4), ctx.buffer(3 * 4)
        e = b.run(1, "csr", indices=CudaArray(ib.ptr, (64,)),
                  indptr=DLPackOnly(pb.view(np.int32)))
        got_ptr = pb.read(np.int32)
        assert got_ptr.tolist() == [0, 3, 6] and e.indices.__cuda_array_interface__["data"][0] \
            == ib.ptr
        with pytest.raises(kvtier.MemorySpaceError):
            e.host()  # a foreign device array: copied by its own library, not here
        em = b.emission("csr", 64)
        assert isinstance(em.indices, kvtier.DeviceArray)
        assert np.array_equal(b.run(1, emission=em).host().indptr[:3], got_ptr)
        assert np.array_equal(em.indices.numpy()[:6], ib.read(np.int32)[:6])
        b.commit()


@emu
def test_planned_steps_replay_a_graph_captured_from_python(mixed_model):
    """plan_device + a CUDA graph from Python (kvtier.cuda): the first planned step's runs are
    captured on a stream and every planned step launches the graph; each step's attended sets
    equal the CPU backend's eager runs of the same rows."""
    kw = dict(page_rows=16, n_pages=64)
    with kvtier.Context(mixed_model, small_config(), backend="cpu", **kw) as a, \
            kvtier.Context(mixed_model, small_config(), backend="cuda", **kw) as g, \
            kvtier.cuda.Stream() as stream:
        sa, sg = [a.sequence(1), a.sequence(2)], [g.sequence(1), g.sequence(2)]
        ba, bg = a.batch(3), g.batch(3)
        ea = [ba.emission("tokens", 64, want_dense=True), ba.emission("csr", 192)]
        eg = [bg.emission("tokens", 64, want_dense=True), bg.emission("csr", 192)]
        emits_g = [eg[0], eg[1], eg[1]]
        graph, replays, eager = None, 0, 0
        for step in range(24):
            n = [40, 20] if step == 0 else 1
            for ctx, b, s in ((a, ba, sa), (g, bg, sg)):
                b.reserve(s, n)
                for i, x in enumerate(s):
                    fill(x, ctx, n[i] if step == 0 else 1, 100 * step + i)
                b.plan()
            want = [ba.run(layer, emission=ea[min(layer, 1)]) for layer in range(3)]
            want = [(w.counts(), [w.slots(i) for i in range(2)]) for w in want]
            planned = bg.plan_device(emits_g, stream=stream)
            if planned and graph is None:
                with stream.capture() as cap:  # recorded, run at the launch below
                    for layer in range(3):
                        bg.run(layer, emission=emits_g[layer], stream=stream)
                graph = cap.graph
            if planned:
                graph.launch(stream)
                replays += 1
            else:
                for layer in range(3):
                    bg.run(layer, emission=emits_g[layer], stream=stream)
                eager += 1
            stream.synchronize()
            for layer in range(3):
                got = emits_g[layer]._view(2, 1)
                counts = got.counts()
                assert np.array_equal(counts, want[layer][0]), (step, layer)
                for i in range(2):
                    assert np.array_equal(got.slots(i), want[layer][1][i]), (step, layer, i)
            ba.commit()
            bg.commit()
            for x in sg:
                x.check()
        assert replays >= 15 and eager >= 2, (replays, eager)  # rounds run eagerly
        assert sg[0].layer_stats(1).rounds == sa[0].layer_stats(1).rounds >= 1
        graph.close()


@emu
def test_cuda_recall_scan_bits_8_emits_the_cpu_sets():
    """recall_scan_bits=8 on the CUDA backend (its close writes the 8-bit planes, its step scans
    them: docs/recall.md §3.3) emits the CPU backend's attended sets, step for step, with the
    same z and fetch counts; the queries in device memory on CUDA."""
    spec = kvtier.LayerSpec.mla("mla_nope", "bf16", 512, 64)
    spec.n_q_heads = 4
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="conformal")
    rng = np.random.default_rng(12)
    v, _ = np.linalg.qr(rng.standard_normal((512, 16)))
    basis = np.ascontiguousarray(v.T, dtype=np.float32)
    rows = rng.standard_normal((316, 576)).astype(np.float32)
    rows = (rows.view(np.uint32) >> 16).astype(np.uint16)  # bf16 (truncated)
    queries = rng.standard_normal((16, 1, 4, 576)).astype(np.float32)
    got = {}
    for backend in ("cpu", "cuda"):
        with kvtier.Model([spec], "recall8") as m, \
                kvtier.Context(m, cfg, page_rows=16, n_pages=256, recall_sketch_rank=16,
                               recall_scan_bits=8, backend=backend) as ctx:
            ctx.set_recall_basis(0, basis)
            qb = ctx.buffer(queries[0].nbytes)
            with ctx.sequence(request_id=1) as seq, ctx.batch(1) as b:
                b.reserve([seq], [300])
                seq.write(0, 0, 0, rows[:300])
                b.plan()
                b.commit()
                em = b.emission("tokens", 320, want_dense=True)
                sets = []
                for t in range(16):
                    b.reserve([seq], [1])
                    seq.write(0, 0, 0, rows[300 + t:301 + t])
                    b.plan()
                    qb.write(queries[t])
                    out = b.run(0, emission=em, query=qb.view(np.float32, (1, 4, 576))).host()
                    sets.append((out.slots(0).tolist(), int(out.dense[0])))
                    b.commit()
                st = seq.layer_stats(0)
                got[backend] = (sets, st.recall_z, st.recall_fetched_rows, st.recall_steps)
    assert got["cuda"] == got["cpu"]
    sets, _, fetched, steps = got["cpu"]
    assert steps == 16 and fetched > 0 and any(d == 0 for _, d in sets)


def test_buffer_views_and_the_cuda_module(mixed_ctx):
    buf = mixed_ctx.buffer(64)
    v = buf.view(np.int32, (4, 4))  # the CPU backend's buffers are host memory: numpy
    assert isinstance(v, np.ndarray) and v.shape == (4, 4) and not v.any()
    buf.write(np.arange(16, dtype=np.int32))
    assert v[3, 3] == 15
    with pytest.raises(ValueError, match="passes the buffer"):
        buf.view(np.int64, 9)
    buf.close()
    assert v[3, 3] == 15  # the view keeps the buffer until it goes
    if kvtier.cuda.emulated():  # the emulation models one device, device 0
        assert kvtier.cuda.device_count() == 1 and kvtier.cuda.current_device() == 0
    elif not kvtier.cuda.available():
        with pytest.raises(kvtier.cuda.CudaError, match="no CUDA runtime"):
            kvtier.cuda.Stream()
        assert kvtier.cuda.device_count() == 0 and kvtier.cuda.current_device() is None


def test_cached_step_arguments_follow_their_objects(mixed_ctx):
    """reserve / slot_mapping keep their C arguments for the same objects, never past them."""
    s = [mixed_ctx.sequence(1), mixed_ctx.sequence(2)]
    b = mixed_ctx.batch(2)
    out = np.full(8, -1, np.int32)
    for _ in range(2):
        b.reserve(s, 1)
        first = b.slot_mapping(0, out=out)
        b.plan()
        b.commit()
    assert b._rcache[0] == tuple(s) and b._scache[0] is out and first.tolist() == out[:2].tolist()
    b.reserve(s, 2)  # another count: built again
    assert b.slot_mapping(0, out=out).shape == (4,) and b._rcache[1] == 2
    b.plan()
    b.commit()
    s[1].close()
    with pytest.raises(ValueError, match="closed"):
        b.reserve(s, 2)
    b.reserve(s[:1], 2)
    assert b.n_seqs == 1 and b.slot_mapping(0, out=out).shape == (2,)
    b.plan()
    b.commit()
