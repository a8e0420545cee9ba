"""Shared fixtures: the real model configs (KVT_MODELS_DIR, default tests/data/models of the
repository) and small geometries that make closes and rounds happen in a few steps."""

import os
from pathlib import Path

import numpy as np
import pytest

import kvtier

REPO = Path(__file__).resolve().parents[2]


def models_dir() -> Path:
    return Path(os.environ.get("KVT_MODELS_DIR", REPO / "tests" / "data" / "models"))


@pytest.fixture(scope="session")
def models() -> Path:
    d = models_dir()
    if not (d / "kimi-linear-48b-a3b-instruct.json").is_file():
        pytest.fail(f"model configs not found in {d} (set KVT_MODELS_DIR)")
    return d


@pytest.fixture
def kimi(models):
    with kvtier.Model.from_file(models / "kimi-linear-48b-a3b-instruct.json") as m:
        yield m


@pytest.fixture
def llama(models):
    with kvtier.Model.from_file(models / "llama-3.1-8b.json") as m:
        yield m


def small_config(**kw) -> kvtier.Config:
    """B = 64, kappa = 4, ratio 8; K = 32, r = 8, c = 8 (the C tests' mixed geometry)."""
    base = dict(block_rows=64, kappa=4, ratio=8, evict_budget_rows=32, recent_rows=8,
                cadence_rows=8)
    base.update(kw)
    return kvtier.Config(**base)


@pytest.fixture
def mixed_model():
    """An MLA-NoPE salience layer (1 head, bf16) and two GQA-RoPE evict layers (2 heads, fp16)."""
    specs = [kvtier.LayerSpec.mla(kvtier.LayerKind.MLA_NOPE, kvtier.DType.BF16, 512, 64),
             kvtier.LayerSpec.gqa(kvtier.LayerKind.GQA_ROPE, kvtier.DType.FP16, 2, 16),
             kvtier.LayerSpec.gqa(kvtier.LayerKind.GQA_ROPE, kvtier.DType.FP16, 2, 16)]
    with kvtier.Model(specs, "mixed") as m:
        yield m


@pytest.fixture
def mixed_ctx(mixed_model):
    with kvtier.Context(mixed_model, small_config(), page_rows=16, n_pages=64,
                        allocator="libc") as ctx:
        yield ctx


def fill(seq: kvtier.Sequence, ctx: kvtier.Context, n: int, seed: int = 0) -> None:
    """Write n reserved tokens of every plane of every layer with KV (kvt_seq_write)."""
    rng = np.random.default_rng(seed)
    for layer in range(ctx.n_layers):
        spec = ctx.layer_spec(layer)
        if spec.kind == kvtier.LayerKind.NO_KV:
            continue
        for plane in range(spec.n_planes):
            seq.write(layer, plane, 0,
                      rng.integers(0, 64, size=(n, spec.slot_bytes), dtype=np.uint8))
