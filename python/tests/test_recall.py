"""The recall trigger through the binding: a NoPE MLA context with sketch planes and a basis,
decode steps with queries, the certificate in the layer statistics, bad input."""
import struct
import zlib

import numpy as np
import pytest

import kvtier


def _model(heads=4):
    spec = kvtier.LayerSpec.mla("mla_nope", "bf16", 512, 64)
    spec.n_q_heads = heads
    return kvtier.Model([spec], "recall")


def _bf16(x):
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncated


def _decode_steps(cfg, seed, steps, after_step):
    """A 4-head context with a rank-16 basis, a 300-row prefill, then `steps` decode steps of
    random rows and queries; after_step(seq) after each commit. Returns the last statistics."""
    with _model() as m, kvtier.Context(m, cfg, page_rows=16, n_pages=256,
                                      recall_sketch_rank=16) as ctx:
        rng = np.random.default_rng(seed)
        v, _ = np.linalg.qr(rng.standard_normal((512, 16)))
        ctx.set_recall_basis(0, np.ascontiguousarray(v.T, dtype=np.float32))
        with ctx.sequence(request_id=1) as seq, ctx.batch(1) as b:
            b.reserve([seq], [300])
            seq.write(0, 0, 0, _bf16(rng.standard_normal((300, 576))))
            b.plan()
            b.commit()
            for _ in range(steps):
                b.reserve([seq], [1])
                seq.write(0, 0, 0, _bf16(rng.standard_normal((1, 576))))
                b.plan()
                b.run(0, query=rng.standard_normal((1, 4, 576)).astype(np.float32))
                b.commit()
                after_step(seq)
            return seq.layer_stats(0)


def test_conformal_recall_decode_steps():
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="conformal")
    with _model() as m, kvtier.Context(m, cfg, page_rows=16, n_pages=256,
                                      recall_sketch_rank=16) as ctx:
        rng = np.random.default_rng(5)
        v, _ = np.linalg.qr(rng.standard_normal((512, 16)))
        ctx.set_recall_basis(0, np.ascontiguousarray(v.T, dtype=np.float32))
        with ctx.sequence(request_id=1) as seq, ctx.batch(1) as b:
            rows = rng.standard_normal((300, 576)).astype(np.float32)
            bf16 = (rows.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits (truncated)
            b.reserve([seq], [300])
            seq.write(0, 0, 0, bf16)
            b.plan()
            b.commit()
            dense_steps = 0
            for step in range(12):
                b.reserve([seq], [1])
                seq.write(0, 0, 0, (rng.standard_normal((1, 576)).astype(np.float32)
                                    .view(np.uint32) >> 16).astype(np.uint16))
                b.plan()
                q = rng.standard_normal((1, 4, 576)).astype(np.float32)
                em = b.run(0, query=q, want_dense=True)
                dense_steps += int(em.dense[0])
                b.commit()
                seq.check()
            st = seq.layer_stats(0)
            assert st.recall_mode == 1 and st.recall_steps == 12
            assert st.recall_calib_steps == dense_steps == 8  # the first window closes at 8
            assert st.recall_phase == 1 and st.recall_samples == 32
            assert st.recall_z <= 8.0


def test_recall_needs_sketch_planes_and_float32_queries():
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="sound")
    with _model() as m:
        with pytest.raises(kvtier.UnsupportedError) as ei:
            kvtier.Context(m, cfg, page_rows=16, n_pages=64)
        assert "recall_sketch_rank" in ei.value.message
        with kvtier.Context(m, cfg, page_rows=16, n_pages=64, recall_sketch_rank=8) as ctx:
            with pytest.raises(TypeError):
                ctx.set_recall_basis(0, np.zeros((2, 512)))
            with pytest.raises(kvtier.InvalidArgumentError):
                ctx.set_recall_basis(0, np.zeros((2, 512), dtype=np.float32))  # not orthonormal
            with ctx.sequence(request_id=1) as seq, ctx.batch(1) as b:
                b.reserve([seq], [1])
                b.plan()
                with pytest.raises(TypeError):
                    b.run(0, query=np.zeros((1, 4, 576)))
                with pytest.raises(kvtier.InvalidArgumentError):
                    b.run(0)  # a recalling request needs its query
                b.commit()


def test_promotion_through_the_binding():
    """Promotion's config fields and statistics cross the ABI; bad hits/window are refused."""
    assert kvtier.Config().recall_promote_capacity == 0  # off by default
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.Config(recall_promote_hits=9, recall_promote_window=8).check()
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="sound",
                        recall_promote_capacity=8, recall_promote_hits=2,
                        recall_promote_window=4)
    cfg.check()
    st = _decode_steps(cfg, 7, 12, lambda seq: seq.check())
    assert st.recall_promote_room == 8  # min(C, m - 1), m = 256 / 8
    assert 0 < st.recall_promoted <= 8
    assert st.recall_promotions >= st.recall_promoted
    assert st.kept_rows <= 256 // 8 - 8  # the reserve comes out of the kept set (m 32)


def test_lagged_query_through_the_binding():
    """config.recall_lagged_query crosses the ABI: off by default; on, every recall step after
    the first scans with the previous step's query, and the statistics say so."""
    assert kvtier.Config().recall_lagged_query is False
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="conformal",
                        recall_lagged_query=True)
    cfg.check()
    lagged = []
    _decode_steps(cfg, 9, 3, lambda seq: lagged.append(seq.layer_stats(0).recall_last_lagged))
    assert lagged == [False, True, True]


def test_rope_recall_head_basis_tokens_layout():
    """Recall on an MLA-RoPE layer (random eviction + archive): the key basis of its one head,
    decode steps with queries in FlashMLA's TOKENS layout (held rows, then fetched rows, -1
    after the length), the certificate in the statistics; a bad basis and a bad head refused."""
    spec = kvtier.LayerSpec.mla("mla_rope", "bf16", 128, 64)
    spec.n_q_heads = 4
    cfg = kvtier.Config(evict_budget_rows=32, recent_rows=8, cadence_rows=8, evict_archive=True,
                        recall="margin", recall_margin=0.5)
    with kvtier.Model([spec], "rope") as m, kvtier.Context(m, cfg, page_rows=16, n_pages=256,
                                                          recall_sketch_rank=16) as ctx:
        rng = np.random.default_rng(9)
        v, _ = np.linalg.qr(rng.standard_normal((128, 16)))
        basis = np.ascontiguousarray(v.T, dtype=np.float32)
        with pytest.raises(kvtier.KvtError):
            ctx.set_recall_head_basis(0, 1, basis)  # one KV head on an MLA layer
        with pytest.raises(kvtier.KvtError):
            ctx.set_recall_head_basis(0, 0, np.zeros((2, 128), dtype=np.float32))
        with pytest.raises(TypeError):
            ctx.set_recall_head_basis(0, 0, basis.astype(np.float64))
        ctx.set_recall_head_basis(0, 0, basis)
        rank, ident = ctx.recall_head_basis(0, 0)
        assert rank == 16 and ident != 0
        with ctx.sequence(request_id=1, prompt_rows=4) as seq, ctx.batch(1) as b:
            def bf16(x):
                return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            b.reserve([seq], [100])
            seq.write(0, 0, 0, bf16(rng.standard_normal((100, 192))))
            b.plan()
            b.commit()
            fetched = 0
            for step in range(20):
                b.reserve([seq], [1])
                seq.write(0, 0, 0, bf16(rng.standard_normal((1, 192))))
                b.plan()
                q = rng.standard_normal((1, 4, 192)).astype(np.float32)
                em = b.run(0, "tokens", query=q)
                b.commit()
                seq.check()
                st = seq.layer_stats(0)
                n = int(em.lengths[0])
                assert n == st.attended_rows + st.recall_last_fetched
                assert (em.indices[0, n:] == -1).all()
                assert len(set(em.indices[0, :n].tolist())) == n
                fetched += st.recall_last_fetched
            st = seq.layer_stats(0)
            assert st.recall_mode == int(kvtier.RecallMode.MARGIN)
            assert st.recall_steps == 20 and st.archived_rows > 0
            assert fetched == st.recall_fetched_rows and fetched > 0


def _basis_file(path, v, layer=0, captured=float("nan"), samples=0):
    """A basis file in the format kvtier.h documents (written here independently of the C
    writer): magic, version 1, layer, rank, dim, captured, samples, V row-major, CRC-32."""
    rank, dim = v.shape
    body = (b"KVTRBAS1" + struct.pack("<IIIIdQ", 1, layer, rank, dim, captured, samples) +
            np.ascontiguousarray(v, dtype="<f4").tobytes())
    path.write_bytes(body + struct.pack("<I", zlib.crc32(body)))


def test_load_recall_basis_files(tmp_path):
    """Context.load_recall_basis (a salience layer) and load_recall_head_basis (a KV head of a
    RoPE layer) read basis files: the loaded basis has the file's rank and the id of its bytes
    (the same as setting the array), and a wrong dim, a corrupt file, a missing file and a bad
    head are refused with the library's status."""
    rng = np.random.default_rng(5)
    v, _ = np.linalg.qr(rng.standard_normal((512, 8)))
    nope = np.ascontiguousarray(v.T, dtype=np.float32)
    _basis_file(tmp_path / "nope.kvtb", nope)
    with _model() as m, kvtier.Context(m, kvtier.Config(recall="conformal"), page_rows=64,
                                       n_pages=64, recall_sketch_rank=64) as ctx:
        ctx.load_recall_basis(0, tmp_path / "nope.kvtb")
        with ctx.sequence(request_id=1) as seq:
            st = seq.layer_stats(0)
            assert st.recall_rank == 8
            assert st.recall_basis_id == zlib.crc32(nope.astype("<f4").tobytes())
        with pytest.raises(kvtier.KvtError) as e:
            ctx.load_recall_basis(0, tmp_path / "missing.kvtb")
        assert e.value.name == "KVT_ERR_IO"
        bad = bytearray((tmp_path / "nope.kvtb").read_bytes())
        bad[100] ^= 1
        (tmp_path / "bad.kvtb").write_bytes(bytes(bad))
        with pytest.raises(kvtier.KvtError) as e:
            ctx.load_recall_basis(0, tmp_path / "bad.kvtb")
        assert e.value.name == "KVT_ERR_CORRUPT"
    spec = kvtier.LayerSpec.mla("mla_rope", "bf16", 128, 64)
    spec.n_q_heads = 4
    cfg = kvtier.Config(evict_budget_rows=32, recent_rows=8, cadence_rows=8, evict_archive=True,
                        recall="sound")
    k, _ = np.linalg.qr(rng.standard_normal((128, 16)))
    key = np.ascontiguousarray(k.T, dtype=np.float32)
    _basis_file(tmp_path / "keys.h0", key)
    with kvtier.Model([spec], "rope") as m, kvtier.Context(m, cfg, page_rows=16, n_pages=64,
                                                          recall_sketch_rank=16) as ctx:
        with pytest.raises(kvtier.KvtError) as e:
            ctx.load_recall_head_basis(0, 0, tmp_path / "nope.kvtb")  # dim 512, not 128
        assert e.value.name == "KVT_ERR_INVALID_ARGUMENT"
        with pytest.raises(kvtier.KvtError) as e:
            ctx.load_recall_head_basis(0, 1, tmp_path / "keys.h0")  # MLA-RoPE: one head
        assert e.value.name == "KVT_ERR_OUT_OF_RANGE"
        ctx.load_recall_head_basis(0, 0, tmp_path / "keys.h0")
        assert ctx.recall_head_basis(0, 0) == (16, zlib.crc32(key.astype("<f4").tobytes()))


def test_archive_space_host():
    """Context(archive_space=...): the archive's placement. A host archive's rows are counted in
    memory()'s archive_host_bytes after eviction rounds (the device's stay 0), the statistics name
    the space; MLA-RoPE recall runs with a host archive; an unknown space is refused before the
    library is called."""
    spec = kvtier.LayerSpec.mla("mla_rope", "bf16", 128, 64)
    spec.n_q_heads = 4
    rng = np.random.default_rng(3)
    with kvtier.Model([spec], "rope") as m:
        with pytest.raises(ValueError):
            kvtier.Context(m, page_rows=16, n_pages=64, archive_space="nowhere")
        for space in ("device", "host"):
            cfg = kvtier.Config(evict_budget_rows=32, recent_rows=8, cadence_rows=8,
                                evict_archive=True)
            with kvtier.Context(m, cfg, page_rows=16, n_pages=64, archive_space=space) as ctx, \
                    ctx.sequence(request_id=1, prompt_rows=4) as seq, ctx.batch(1) as b:
                for n in (100, 1, 1, 1):
                    b.reserve([seq], [n])
                    seq.write(0, 0, 0, _bf16(rng.standard_normal((n, 192))))
                    b.plan()
                    b.commit()
                    seq.check()
                st = seq.layer_stats(0)
                assert st.archived_rows > 0 and st.archive_bytes == st.archived_rows * 384
                assert st.archive_space == int(kvtier.Space[space.upper()])
                mem = ctx.memory()
                key = "archive_host_bytes" if space == "host" else "archive_device_bytes"
                other = "archive_device_bytes" if space == "host" else "archive_host_bytes"
                assert mem[key] == st.archive_bytes and mem[other] == 0
        cfg = kvtier.Config(evict_budget_rows=32, recent_rows=8, cadence_rows=8,
                            evict_archive=True, recall="conformal")
        with kvtier.Context(m, cfg, page_rows=16, n_pages=64, recall_sketch_rank=16,
                            archive_space=kvtier.Space.HOST) as ctx, \
                ctx.sequence(request_id=2, prompt_rows=4) as seq, ctx.batch(1) as b:
            for n in (100, 1, 1):  # MLA-RoPE recall with a host archive (its branch plane)
                b.reserve([seq], [n])
                seq.write(0, 0, 0, _bf16(rng.standard_normal((n, 192))))
                b.plan()
                if n == 1:
                    b.run(0, "tokens", query=rng.standard_normal((1, 4, 192)).astype(np.float32))
                b.commit()
                seq.check()
            st = seq.layer_stats(0)
            assert st.recall_steps == 2 and st.archive_space == int(kvtier.Space.HOST)


def test_gqa_rope_recall_csr_kv_heads_host_archive():
    """Recall on a GQA-RoPE layer from Python: run(layout="csr_kv_heads") gives one list per
    (request, KV head) — the held rows, then that head's fetched rows — with the archive in host
    memory: no dense step, the bytes moved are the fetched rows', slots(i, h) per KV head."""
    spec = kvtier.LayerSpec.gqa("gqa_rope", "bf16", 2, 128)
    spec.n_q_heads = 8
    cfg = kvtier.Config(evict_budget_rows=32, recent_rows=8, cadence_rows=8, evict_archive=True,
                        recall="conformal", recall_cap_rows=4)
    rng = np.random.default_rng(12)
    with kvtier.Model([spec], "gqa") as m, \
            kvtier.Context(m, cfg, page_rows=16, n_pages=64, recall_sketch_rank=16,
                           archive_space="host") as ctx:
        for h in range(2):
            v, _ = np.linalg.qr(rng.standard_normal((128, 16)))
            ctx.set_recall_head_basis(0, h, np.ascontiguousarray(v.T, dtype=np.float32))
        with ctx.sequence(request_id=1, prompt_rows=4) as seq, ctx.batch(1) as b:
            b.reserve([seq], [60])
            for plane in range(2):
                seq.write(0, plane, 0, _bf16(rng.standard_normal((60, 256))))
            b.plan()
            b.commit()
            moved = fetched = 0
            for step in range(40):
                b.reserve([seq], [1])
                for plane in range(2):
                    seq.write(0, plane, 0, _bf16(rng.standard_normal((1, 256))))
                b.plan()
                q = (0.1 * rng.standard_normal((1, 8, 128))).astype(np.float32)
                em = b.run(0, "csr_kv_heads", query=q, want_dense=True)
                b.commit()
                seq.check()
                st = seq.layer_stats(0)
                assert em.dense[0] == 0 and not st.recall_last_dense
                assert len(em.counts()) == 2
                listed = 0
                for h in range(2):
                    s = em.slots(0, h)
                    assert len(set(s.tolist())) == len(s)
                    assert len(s) >= st.attended_rows
                    listed += len(s) - st.attended_rows
                assert listed == st.recall_last_fetched <= 2 * 4
                assert st.recall_last_moved_bytes == listed * 2 * 256
                moved += st.recall_last_moved_bytes
                fetched += listed
            st = seq.layer_stats(0)
            assert st.archive_space == int(kvtier.Space.HOST) and st.archived_rows > 0
            assert st.recall_moved_bytes == moved and fetched > 0
            assert ctx.memory()["archive_host_bytes"] == st.archive_bytes
            with pytest.raises(IndexError):
                em.slots(0, 2)


def test_recall_basis_write_read_round_trip(tmp_path):
    """recall_basis_write / recall_basis_read (the C writer and reader): the same header and V
    back, the file equal to the one written independently above, the id the CRC-32 of V's
    bytes; Context.recall_basis reports (rank, id) once loaded; orthonormalise_rows makes the
    rows orthonormal keeping their span; bad input refused."""
    rng = np.random.default_rng(11)
    raw = rng.standard_normal((8, 512))
    v64 = kvtier.orthonormalise_rows(raw)
    assert v64.dtype == np.float64 and v64.shape == (8, 512)
    assert np.allclose(v64 @ v64.T, np.eye(8), atol=1e-12)
    assert np.allclose(raw, (raw @ v64.T) @ v64, atol=1e-9)  # the same row space
    assert np.dot(v64[0], raw[0]) > 0  # directions and signs kept
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.orthonormalise_rows(np.ones((2, 4)))  # linearly dependent rows
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.orthonormalise_rows(raw, passes=0)
    v = v64.astype(np.float32)
    path = tmp_path / "basis.kvtb"
    kvtier.recall_basis_write(path, v, layer=3, captured=0.75, samples=1234)
    _basis_file(tmp_path / "ref.kvtb", v, layer=3, captured=0.75, samples=1234)
    assert path.read_bytes() == (tmp_path / "ref.kvtb").read_bytes()
    b = kvtier.recall_basis_read(path)
    assert (b.layer, b.rank, b.dim, b.captured, b.samples) == (3, 8, 512, 0.75, 1234)
    assert b.id == zlib.crc32(v.astype("<f4").tobytes())
    assert np.array_equal(b.v, v) and "rank=8" in repr(b)
    with pytest.raises(TypeError):
        kvtier.recall_basis_write(path, v64)  # float32 only: no silent rounding
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.recall_basis_write(path, np.zeros((0, 512), np.float32))
    with pytest.raises(kvtier.IoError):
        kvtier.recall_basis_read(tmp_path / "missing.kvtb")
    bad = bytearray(path.read_bytes())
    bad[60] ^= 1
    (tmp_path / "bad.kvtb").write_bytes(bytes(bad))
    with pytest.raises(kvtier.CorruptError):
        kvtier.recall_basis_read(tmp_path / "bad.kvtb")
    with _model() as m, kvtier.Context(m, kvtier.Config(recall="conformal"), page_rows=64,
                                       n_pages=64, recall_sketch_rank=64) as ctx:
        assert ctx.recall_basis(0) == (0, 0)
        ctx.load_recall_basis(0, path)
        assert ctx.recall_basis(0) == (8, b.id)
        with pytest.raises(kvtier.OutOfRangeError):
            ctx.recall_basis(1)


def test_recall_scan_bits():
    """recall_scan_bits=8: the 8-bit scan (docs/recall.md §3.3) runs decode steps with the same z
    as the 16-bit scan and fetches at least its rows; a value other than 8 or 16 is refused."""
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="conformal")
    with _model() as m:
        with pytest.raises(kvtier.InvalidArgumentError) as ei:
            kvtier.Context(m, cfg, page_rows=16, n_pages=64, recall_sketch_rank=16,
                           recall_scan_bits=12)
        assert "recall_scan_bits" in ei.value.message
    stats = {}
    for bits in (16, 8):
        with _model() as m, kvtier.Context(m, cfg, page_rows=16, n_pages=256,
                                          recall_sketch_rank=16, recall_scan_bits=bits) as ctx:
            rng = np.random.default_rng(11)
            v, _ = np.linalg.qr(rng.standard_normal((512, 16)))
            ctx.set_recall_basis(0, np.ascontiguousarray(v.T, dtype=np.float32))
            with ctx.sequence(request_id=1) as seq, ctx.batch(1) as b:
                b.reserve([seq], [300])
                seq.write(0, 0, 0, _bf16(rng.standard_normal((300, 576))))
                b.plan()
                b.commit()
                for _ in range(12):
                    b.reserve([seq], [1])
                    seq.write(0, 0, 0, _bf16(rng.standard_normal((1, 576))))
                    b.plan()
                    b.run(0, query=rng.standard_normal((1, 4, 576)).astype(np.float32))
                    b.commit()
                stats[bits] = seq.layer_stats(0)
    assert stats[8].recall_z == stats[16].recall_z
    assert stats[8].recall_steps == stats[16].recall_steps == 12
    assert stats[8].recall_fetched_rows >= stats[16].recall_fetched_rows


def test_refit_recall_basis_recalibrates_or_keeps_z():
    """Context.refit_recall_basis between steps: the basis id changes, the next steps calibrate
    again (or keep z with keep_z); refused mid-step and at another rank, nothing changed."""
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="conformal")
    with _model() as m, kvtier.Context(m, cfg, page_rows=16, n_pages=256,
                                      recall_sketch_rank=16) as ctx:
        rng = np.random.default_rng(11)
        bases = [np.ascontiguousarray(np.linalg.qr(rng.standard_normal((512, 16)))[0].T,
                                      dtype=np.float32) for _ in range(2)]
        ctx.set_recall_basis(0, bases[0])
        with ctx.sequence(request_id=1) as seq, ctx.batch(1) as b:
            b.reserve([seq], [300])
            seq.write(0, 0, 0, _bf16(rng.standard_normal((300, 576))))
            b.plan()
            b.commit()

            def step():
                b.reserve([seq], [1])
                seq.write(0, 0, 0, _bf16(rng.standard_normal((1, 576))))
                b.plan()
                em = b.run(0, query=rng.standard_normal((1, 4, 576)).astype(np.float32),
                           want_dense=True)
                b.commit()
                seq.check()
                return int(em.dense[0])

            for _ in range(9):
                step()
            st0 = seq.layer_stats(0)
            assert st0.recall_phase == 1
            ctx.refit_recall_basis(0, bases[1], keep_z=True)
            st1 = seq.layer_stats(0)
            assert st1.recall_basis_id != st0.recall_basis_id
            assert st1.recall_phase == 1 and st1.recall_z == st0.recall_z
            ctx.refit_recall_basis(0, bases[0])
            assert seq.layer_stats(0).recall_basis_id == st0.recall_basis_id
            with pytest.raises(kvtier.PolicyMismatchError):  # key bases: evict layers only
                ctx.refit_recall_head_basis(0, 0, bases[1])
            assert seq.layer_stats(0).recall_phase == 0
            assert sum(step() for _ in range(8)) == 8  # every calibration step is dense
            assert seq.layer_stats(0).recall_phase == 1
            with pytest.raises(kvtier.OutOfRangeError):
                ctx.refit_recall_basis(0, bases[1][:8].copy())
            b.reserve([seq], [1])
            with pytest.raises(kvtier.BadStateError):
                ctx.refit_recall_basis(0, bases[1])
            seq.write(0, 0, 0, _bf16(rng.standard_normal((1, 576))))
            b.plan()
            b.commit()
            assert seq.layer_stats(0).recall_basis_id == st0.recall_basis_id
            with pytest.raises(kvtier.PolicyMismatchError):  # key bases: evict layers only
                ctx.refit_recall_head_basis(0, 0, bases[1])


def test_basis_of_the_wrong_width_is_refused_before_the_call():
    """A basis whose rows are not the layer's width is a ValueError naming both widths, for
    set and refit alike (the C library would read rank x value_dim floats: past the end of a
    narrower array); nothing is set."""
    cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, recall="conformal")
    with _model() as m, kvtier.Context(m, cfg, page_rows=16, n_pages=64,
                                      recall_sketch_rank=16) as ctx:
        rng = np.random.default_rng(5)
        for width in (16, 511, 513):
            bad = np.ascontiguousarray(rng.standard_normal((16, width)), dtype=np.float32)
            with pytest.raises(ValueError, match=f"{width} columns; layer 0's value rows have 512"):
                ctx.set_recall_basis(0, bad)
            with pytest.raises(ValueError, match="layer 0's value rows have 512"):
                ctx.refit_recall_basis(0, bad)
        good = np.ascontiguousarray(np.linalg.qr(rng.standard_normal((512, 16)))[0].T,
                                    dtype=np.float32)
        ctx.set_recall_basis(0, good)
