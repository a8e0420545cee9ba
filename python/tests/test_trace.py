"""kvtier.trace: the C library's trace writer and reader (lib/kvtier_trace.h) through ctypes."""

import numpy as np
import pytest

import kvtier
from kvtier import DType, LayerKind
from kvtier.trace import Trace, TraceWriter


def gqa_spec(n_kv=2, d=8, dtype=DType.FP32):
    s = kvtier.LayerSpec.gqa(LayerKind.GQA_ROPE, dtype, n_kv, d)
    s.n_q_heads = 4
    return s


def write_small(path, rng, tokens=40):
    k = rng.standard_normal((tokens, 2, 8)).astype(np.float32)
    v = rng.standard_normal((tokens, 2, 8)).astype(np.float32)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    with TraceWriter(path, n_model_layers=6, prompt_rows=5, text="model=test\nscale=0.25\n") as w:
        w.layer(3, gqa_spec())
        w.rows(3, 0, k[:17])  # chunks of any size, planes interleaved
        w.rows(3, 1, v)
        w.rows(3, 0, k[17:])
        w.queries(3, [20, 30, 40], q)
        w.needles([(3, 10, 4)])
        w.targets([(1, 0, [0, 3]), (2, 0, [2])])
    return k, v, q


def test_round_trip(tmp_path):
    rng = np.random.default_rng(5)
    p = tmp_path / "t.kvtt"
    k, v, q = write_small(p, rng)
    with Trace(p) as t:
        t.verify()
        assert t.prompt_rows == 5 and t.n_model_layers == 6
        assert "scale=0.25" in t.text
        (info,) = t.layers()
        assert info["layer"] == 3 and info["n_tokens"] == 40 and info["n_steps"] == 3
        assert info["n_q_heads"] == 4 and info["q_dim"] == 8 and info["spec"] == gqa_spec()
        assert np.array_equal(t.read_rows(3, 0, 0, 40).view(np.float32).reshape(40, 2, 8), k)
        assert np.array_equal(t.read_rows(3, 1, 5, 7).view(np.float32).reshape(7, 2, 8), v[5:12])
        got, pos = t.read_query(3, 1)
        assert pos == 30 and np.array_equal(got, q[1])
        assert t.needles() == [(3, 10, 4)]
        assert t.targets() == [(1, 0, [0, 3]), (2, 0, [2])]


def test_writer_errors_carry_the_library_message(tmp_path):
    p = tmp_path / "e.kvtt"
    with pytest.raises(kvtier.KvtError):
        TraceWriter(p, n_model_layers=0)
    w = TraceWriter(p, n_model_layers=2)
    with pytest.raises(kvtier.InvalidArgumentError):
        w.layer(2, gqa_spec())  # index >= n_model_layers
    w.layer(1, gqa_spec())
    with pytest.raises(ValueError):
        w.rows(1, 0, np.zeros(7, np.float32))  # not whole tokens
    with pytest.raises(kvtier.InvalidArgumentError):
        w.rows(1, 2, np.zeros((1, 2, 8), np.float32))  # plane 2 of 2
    with pytest.raises(kvtier.KvtError):
        w.queries(1, [3, 2], np.zeros((2, 4, 8), np.float32))  # decreasing positions
    w.close()
    w.close()  # a no-op once closed
    with Trace(p) as t:
        assert t.layers()[0]["n_tokens"] == 0


def test_abort_removes_the_file_and_reader_refuses_garbage(tmp_path):
    p = tmp_path / "a.kvtt"
    with pytest.raises(RuntimeError):
        with TraceWriter(p, n_model_layers=1):
            raise RuntimeError("engine failed")
    assert not p.exists()
    bad = tmp_path / "bad.kvtt"
    bad.write_bytes(b"not a trace" * 10)
    with pytest.raises(kvtier.ParseError):
        Trace(bad)
    with pytest.raises(kvtier.IoError):
        Trace(tmp_path / "missing.kvtt")


def test_corruption_is_found_by_verify(tmp_path):
    p = tmp_path / "c.kvtt"
    write_small(p, np.random.default_rng(2))
    raw = bytearray(p.read_bytes())
    raw[400] ^= 0xFF  # inside the first rows chunk
    p.write_bytes(bytes(raw))
    with pytest.raises(kvtier.KvtError):
        with Trace(p) as t:
            t.verify()


def test_find_layer_query_position_version_and_user_sections(tmp_path):
    """Trace.find_layer / query_position / format_version and TraceWriter.section: a user
    section a reader skips, and a critical one it refuses."""
    rng = np.random.default_rng(3)
    p = tmp_path / "u.kvtt"
    with TraceWriter(p, n_model_layers=6) as w:
        w.layer(3, gqa_spec())
        w.rows(3, 0, rng.standard_normal((10, 2, 8)).astype(np.float32))
        w.rows(3, 1, rng.standard_normal((10, 2, 8)).astype(np.float32))
        w.queries(3, [4, 9], rng.standard_normal((2, 4, 8)).astype(np.float32))
        w.section(kvtier.trace.SECTION_USER + 7, b"engine notes")
        w.section(kvtier.trace.SECTION_USER, np.arange(4, dtype=np.uint32))
        w.section(kvtier.trace.SECTION_USER + 1)  # empty payload
        with pytest.raises(kvtier.InvalidArgumentError):
            w.section(2, b"x")  # a type kvtier defines
    with Trace(p) as t:
        t.verify()
        assert t.format_version == (kvtier.trace.FORMAT_MAJOR, kvtier.trace.FORMAT_MINOR)
        info = t.find_layer(3)
        assert info == t.layers()[0] and info["n_tokens"] == 10
        with pytest.raises(kvtier.OutOfRangeError):
            t.find_layer(2)
        assert [t.query_position(3, s) for s in range(2)] == [4, 9]
        with pytest.raises(kvtier.OutOfRangeError):
            t.query_position(3, 2)
        with pytest.raises(KeyError):
            t.read_rows(2, 0, 0, 1)
    c = tmp_path / "crit.kvtt"
    with TraceWriter(c, n_model_layers=1) as w:
        w.section(kvtier.trace.SECTION_USER + 2, b"must understand", critical=True)
    with pytest.raises(kvtier.UnsupportedError):
        Trace(c)
