"""kvtier_ref.h: element conversions, σ of a block, reference attention — against numpy."""

import numpy as np
import pytest

import kvtier
from kvtier import DType, ref


def test_bf16_helpers_match_the_library_bit_for_bit():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, size=4000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                        0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000001], np.uint32)
    x = np.concatenate([bits, special]).view(np.float32)
    mine = kvtier.bf16_from_float32(x)
    row = np.zeros(len(x) * 2, np.uint8)
    for i, v in enumerate(x):
        ref.store(row, DType.BF16, i, v)
    assert np.array_equal(row.view(np.uint16), mine)
    back = kvtier.bf16_to_float32(mine)
    for i in range(0, len(x), 97):
        got = ref.load(row, DType.BF16, i)
        assert got == back[i] or (np.isnan(got) and np.isnan(back[i]))


def test_load_store_fp16_fp32_and_bounds():
    row = np.zeros(8, np.uint8)
    ref.store(row, DType.FP16, 1, 1.5)
    assert row.view(np.float16)[1] == 1.5 and ref.load(row, "fp16", 1) == 1.5
    ref.store(row, DType.FP32, 1, -2.25)
    assert row.view(np.float32)[1] == -2.25 and ref.load(row, DType.FP32, 1) == -2.25
    assert ref.load(row, DType.FP8_E4M3, 0) == 0.0  # no fp8 conversion: documented 0
    with pytest.raises(IndexError):
        ref.load(row, DType.FP32, 2)
    with pytest.raises(IndexError):
        ref.store(row, DType.FP16, 4, 1.0)
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        ref.store(ro, DType.FP32, 0, 1.0)


def test_sigma_basis_and_block():
    B, kappa = 128, 4
    with ref.Sigma(B, kappa, 64) as s:
        basis = s.basis
        assert basis.shape == (2 * kappa - 1, B)
        assert np.allclose(basis @ basis.T, np.eye(2 * kappa - 1), atol=1e-5)
        rng = np.random.default_rng(2)
        u = np.arange(B)[:, None]
        smooth = (3 * np.cos(2 * np.pi * 2 * u / B + rng.uniform(0, 6, (1, 64)))).astype(
            np.float32)
        noise = rng.standard_normal((B, 64)).astype(np.float32)
        noise[:, :] *= np.where(np.arange(B) % 10 == 0, 1.0, 0.01)[:, None].astype(np.float32)
        branch = smooth + noise
        rows = np.concatenate([np.zeros((B, 8), np.float32), branch], axis=1)  # branch at 32 B
        sig = s.block(rows, 32, DType.FP32)
        # σ_u = ‖R_u − projection onto the low-frequency basis‖, in float64 here
        R = branch.astype(np.float64)
        Bm = basis.astype(np.float64)
        want = np.linalg.norm(R - Bm.T @ (Bm @ R), axis=1)
        assert np.allclose(sig, want, rtol=1e-4, atol=1e-4)
        assert np.all(sig[::10] > 10 * np.median(sig))  # the noisy rows stand out
        # a non-finite branch scores +inf and changes no other row's σ
        rows2 = rows.copy()
        rows2[5, 8 + 3] = np.nan
        sig2 = s.block(rows2, 32, "fp32")
        assert np.isinf(sig2[5])
        with pytest.raises(ValueError):
            s.block(rows[:64], 32, DType.FP32)
        with pytest.raises(ValueError):
            s.block(np.asfortranarray(rows), 32, DType.FP32)
        with pytest.raises(kvtier.InvalidArgumentError):
            s.block(rows, 40, DType.FP32)  # the branch does not fit in the 288-byte stride
        with pytest.raises(kvtier.InvalidArgumentError):
            s.block(rows, 32, DType.FP8_E4M3)
    with pytest.raises(kvtier.InvalidArgumentError):
        ref.Sigma(100, 4, 64)  # not a power of two
    with pytest.raises(kvtier.InvalidArgumentError):
        ref.Sigma(64, 33, 64)
    with pytest.raises(kvtier.InvalidArgumentError):
        ref.Sigma(64, 4, 300)


def numpy_attn(keys, values, q, scale):
    s = scale * (q.astype(np.float64) @ keys.T.astype(np.float64))
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    p = np.exp(s - lse[:, None])
    return p @ values.astype(np.float64), lse, p


def test_reference_attention():
    rng = np.random.default_rng(3)
    n, heads, kd, vd = 40, 4, 576, 512
    vals = rng.standard_normal((n, kd)).astype(np.float32)
    rows = kvtier.bf16_from_float32(vals)
    exact = kvtier.bf16_to_float32(rows)
    q = rng.standard_normal((heads, kd)).astype(np.float32)
    res = ref.attn(rows, q, dtype=DType.BF16, key_dim=kd, value_dim=vd)
    want, lse, p = numpy_attn(exact, exact[:, :vd], q, ref.DEFAULT_SCALE)
    assert res.out.shape == (heads, vd) and res.mark_mass is None
    assert np.allclose(res.out, want, rtol=1e-5, atol=1e-5)
    assert np.allclose(res.lse, lse, rtol=1e-9)
    # a subset by slots, with marks
    slots = np.array([3, 17, 0, 39], np.int32)
    mark = np.array([1, 0, 0, 1], bool)
    sub = ref.attn(rows, q, dtype="bf16", key_dim=kd, value_dim=vd, slots=slots, mark=mark)
    w2, _, p2 = numpy_attn(exact[slots], exact[slots, :vd], q, ref.DEFAULT_SCALE)
    assert np.allclose(sub.out, w2, rtol=1e-5, atol=1e-5)
    assert np.allclose(sub.mark_mass, p2[:, mark].sum(1), rtol=1e-9)
    # bounds: every row the C code would read lies in the array
    with pytest.raises(IndexError):
        ref.attn(rows, q, dtype="bf16", key_dim=kd, value_dim=vd, slots=np.array([40], np.int32))
    with pytest.raises(IndexError):
        ref.attn(rows, q, dtype="bf16", key_dim=kd, value_dim=vd, row_offset=2)
    with pytest.raises(kvtier.InvalidArgumentError):
        ref.attn(rows, q, dtype="bf16", key_dim=kd, value_dim=vd, slots=np.array([-1], np.int32))
    with pytest.raises(kvtier.InvalidArgumentError):
        ref.attn(rows, q, dtype="bf16", key_dim=kd, value_dim=kd + 1)
    with pytest.raises(kvtier.InvalidArgumentError):
        ref.attn(rows, q[:, :500].copy(), dtype="bf16", key_dim=kd, value_dim=vd)  # q_stride
    with pytest.raises(TypeError):
        ref.attn(rows, q.astype(np.float64), dtype="bf16", key_dim=kd, value_dim=vd)
    with pytest.raises(TypeError):
        ref.attn(rows, q, dtype="bf16", key_dim=kd, value_dim=vd, slots=np.array([1], np.int64))
    with pytest.raises(ValueError):
        ref.attn(rows, q, dtype="bf16", key_dim=kd, value_dim=vd, mark=np.ones(3, bool))
    assert ref.scratch_doubles(10, 4, 512, 576) > 0


def test_sigma_with_the_dct_basis():
    """Sigma(basis=...) is kvt_ref_sigma_create_basis: the DCT's columns are orthonormal and
    not the Fourier ones; σ of one block differs between the two; bad values are refused."""
    rng = np.random.default_rng(4)
    with ref.Sigma(64, 4, 8) as f, ref.Sigma(64, 4, 8, basis="dct") as d:
        assert f.sigma_basis == kvtier.SigmaBasis.FOURIER and d.sigma_basis == kvtier.SigmaBasis.DCT
        bf, bd = f.basis, d.basis
        assert bd.shape == bf.shape == (7, 64)
        assert np.allclose(bd @ bd.T, np.eye(7), atol=1e-5)
        assert not np.allclose(bd, bf)
        rows = rng.standard_normal((64, 8)).astype(np.float32)
        sf, sd = f.block(rows, 0, DType.FP32), d.block(rows, 0, DType.FP32)
        assert np.all(np.isfinite(sd)) and not np.array_equal(sf, sd)
    for bad in ("wavelet", 7):  # not a SigmaBasis: refused before the call
        with pytest.raises(ValueError):
            ref.Sigma(64, 4, 8, basis=bad)
    with pytest.raises(kvtier.InvalidArgumentError):
        ref.Sigma(64, 33, 8, basis="dct")  # kappa above block_rows / 2
