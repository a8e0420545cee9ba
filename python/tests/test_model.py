"""Layer specs, names, models from the real configs, census, and bad input."""

import json

import numpy as np
import pytest

import kvtier
from kvtier import DType, LayerKind, Policy

CONFIGS = {  # file -> (layers, kv bytes per token in bf16) — DESIGN §1 and the census
    "kimi-linear-48b-a3b-instruct.json": (27, 8064),
    "deepseek-v3.json": (61, 70272),
    "qwen3-8b.json": (36, 147456),
    "llama-3.1-8b.json": (32, 131072),
}


def test_names_and_policies():
    assert kvtier.policy_for_kind(LayerKind.MLA_NOPE) == Policy.SALIENCE
    assert kvtier.policy_for_kind("mla_rope") == Policy.EVICT
    assert kvtier.policy_for_kind(LayerKind.GQA_ROPE) == Policy.EVICT
    assert kvtier.policy_for_kind(LayerKind.SLIDING) == Policy.NONE
    assert kvtier.policy_for_kind(LayerKind.NO_KV) == Policy.NONE
    assert kvtier.dtype_bytes(DType.BF16) == 2 and kvtier.dtype_bytes(DType.FP32) == 4
    assert kvtier.dtype_bytes(DType.FP8_E4M3) == 1 and kvtier.dtype_bytes(99) == 0
    assert kvtier.dtype_name(DType.FP16) and kvtier.layer_kind_name(LayerKind.NO_KV)
    assert kvtier.policy_name(Policy.EVICT)
    assert kvtier.recall_mode_name(kvtier.RecallMode.SOUND) == "sound"
    assert kvtier.recall_mode_name(9) == "unknown"
    with pytest.raises(ValueError):
        kvtier.policy_for_kind("nonsense")
    with pytest.raises(ValueError):
        kvtier.policy_for_kind(17)
    with pytest.raises(TypeError):
        kvtier.policy_for_kind(1.5)


def test_layer_spec_helpers():
    s = kvtier.LayerSpec.mla(LayerKind.MLA_NOPE, DType.BF16, 512, 64)
    assert (s.head_dim, s.value_dim, s.branch_dim, s.row_bytes, s.branch_offset) == \
        (576, 512, 64, 1152, 1024)
    assert s.bytes_per_token == 1152 and s.slot_bytes == 1152 and s.policy == Policy.SALIENCE
    s.check()
    g = kvtier.LayerSpec.gqa(LayerKind.GQA_ROPE, DType.FP16, 8, 128)
    assert (g.n_planes, g.n_kv_heads, g.row_bytes) == (2, 8, 256)
    assert g.bytes_per_token == 2 * 8 * 256
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.LayerSpec.mla(LayerKind.MLA_NOPE, DType.BF16, 0, 64)
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.LayerSpec.gqa(LayerKind.GQA_ROPE, DType.BF16, 2000, 128)  # > 1024 heads
    with pytest.raises(ValueError):
        kvtier.LayerSpec.gqa(LayerKind.GQA_ROPE, DType.BF16, -1, 128)  # would wrap in C
    with pytest.raises(ValueError):
        kvtier.LayerSpec.gqa(LayerKind.GQA_ROPE, DType.BF16, 2**32, 128)
    bad = kvtier.LayerSpec.mla()
    bad.row_bytes = 100
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        bad.check()
    assert "row_bytes" in ei.value.message
    with pytest.raises(TypeError):
        kvtier.LayerSpec(colour=3)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_census_of_real_configs(models, name):
    n_layers, bpt = CONFIGS[name]
    with kvtier.Model.from_file(models / name, DType.BF16) as m:
        assert len(m) == n_layers and m.kv_bytes_per_token == bpt
        assert len(m.layers) == n_layers and m[-1] == m[n_layers - 1]
        assert sum(s.bytes_per_token for s in m.layers) == bpt
        t = m.census(32768, 1, 32.0)
        assert t.kv_bytes_per_token == bpt and t.dense_bytes == 32768 * bpt
        assert t.salience_layers + t.evict_layers + t.none_layers == n_layers
        # the same config through kvt_model_from_json gives the same model
        with kvtier.Model.from_json((models / name).read_text(), DType.BF16) as j:
            assert j.layers == m.layers and j.model_type == m.model_type


def test_kimi_census_numbers(kimi):
    assert [i for i, s in enumerate(kimi.layers) if s.kind == LayerKind.MLA_NOPE] == \
        [3, 7, 11, 15, 19, 23, 26]
    t = kimi.census(32768, 32, 32.0)
    assert t.dense_bytes == 32768 * 32 * 8064 and t.salience_layers == 7 and t.no_kv_layers == 20
    assert t.attended_bytes == 1024 * 32 * 8064 and t.freed_bytes == 0
    with pytest.raises(kvtier.InvalidArgumentError):
        kimi.census(1024, 1, 0.5)
    with pytest.raises(kvtier.InvalidArgumentError):
        kimi.census(1024, 1, float("nan"))
    with pytest.raises(kvtier.OutOfRangeError):
        kimi.census(2**62, 2**20, 1.0)
    # shared_prefix 0 is kvt_model_census; a prefix kvt_model_census_shared, held once
    s = kimi.census(32768, 32, 32.0, shared_prefix=4096)
    assert s.dense_bytes == t.dense_bytes - 31 * 4096 * 8064


def test_gemma_has_sliding_layers(models):
    with kvtier.Model.from_file(models / "gemma-3-1b-it.json", "fp32") as m:
        kinds = {s.kind for s in m.layers}
        assert LayerKind.SLIDING in kinds and all(s.dtype == DType.FP32 for s in m.layers)
        assert all(s.sliding_window > 0 for s in m.layers if s.kind == LayerKind.SLIDING)


def test_model_errors(tmp_path, models):
    with pytest.raises(kvtier.IoError):
        kvtier.Model.from_file(tmp_path / "missing.json")
    with pytest.raises(kvtier.ParseError):
        kvtier.Model.from_json("{not json")
    with pytest.raises(kvtier.ParseError) as ei:
        kvtier.Model.from_json({"model_type": "gpt-unknown"})
    assert "model_type" in ei.value.message
    cfg = json.loads((models / "llama-3.1-8b.json").read_text())
    with kvtier.Model.from_json(cfg) as m:  # a dict is serialised
        assert len(m) == 32
    with pytest.raises(TypeError):
        kvtier.Model.from_json(42)
    with pytest.raises(ValueError):
        kvtier.Model.from_file(models / "llama-3.1-8b.json", "bf17")


def test_model_by_hand():
    specs = [kvtier.LayerSpec.mla(), kvtier.LayerSpec.gqa(LayerKind.GQA_ROPE, DType.BF16, 2, 64)]
    with kvtier.Model(specs, "hand") as m:
        assert m.model_type == "hand" and m.layers == specs
        with pytest.raises(IndexError):
            m.layer(2)
        with pytest.raises(IndexError):
            m.layer(-1)
    assert m.closed
    with pytest.raises(ValueError, match="closed"):
        len(m)
    m.close()  # twice is fine
    bad = kvtier.LayerSpec.mla()
    bad.head_dim = 0
    with pytest.raises(kvtier.InvalidArgumentError) as ei:
        kvtier.Model([specs[0], bad])
    assert "layer 1" in ei.value.message or "[1]" in ei.value.message
    with pytest.raises(TypeError):
        kvtier.Model(["not a spec"])
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.Model([])
