"""kvtier.hf.Cache on a tiny random Gemma-3 (no download): every row attended, it reproduces
transformers' own DynamicCache (the mask offsets, the sliding window across steps, a batch of
two); under random eviction each full-attention layer attends K held rows plus the step's, the
very rows (K and V) the dense run computed at the positions kvtier reports; misuse is refused.
Skipped, saying so, without torch and transformers (the optional extra: pip install
'./python[hf]'); test.sh's hf configuration installs them."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="kvtier.hf needs torch (pip install './python[hf]')")
transformers = pytest.importorskip("transformers", reason="kvtier.hf needs transformers")

import kvtier.hf as khf  # noqa: E402

WINDOW = 8


@pytest.fixture(scope="module")
def model():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=16, sliding_window=WINDOW, max_position_embeddings=512,
                           layer_types=["sliding_attention"] * 2 + ["full_attention"]
                           + ["sliding_attention"] * 2 + ["full_attention"])
    cfg._attn_implementation = "sdpa"
    return Gemma3ForCausalLM(cfg).eval()


def run(model, cache, ids, chunk):
    """Logits of every position, the sequence fed `chunk` tokens a forward."""
    out = []
    with torch.no_grad():
        for a in range(0, ids.shape[1], chunk):
            out.append(model(input_ids=ids[:, a:a + chunk], past_key_values=cache,
                             use_cache=True).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_dense_equals_dynamic_cache(model, chunk):
    from transformers import DynamicCache

    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = run(model, DynamicCache(config=model.config), ids, chunk)
    c = khf.Cache(model, "dense", max_tokens=64, max_seqs=2)
    got = run(model, c, ids, chunk)
    assert c.get_seq_length() == 40
    c.close()
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), float((got - ref).abs().max())


def test_generate(model):
    from transformers import DynamicCache

    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    c = khf.Cache(model, "dense", max_tokens=64)
    got = model.generate(ids, past_key_values=c, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    d = (torch.stack(got.logits) - torch.stack(ref.logits)).abs().max()
    assert float(d) < 1e-5, float(d)
    c.close()


def test_evict_attends_k_rows_at_their_positions(model):
    """K = 16, r = 8: rounds at the commits; the full layers then attend 16 held rows plus the
    step's. Layer 2's rows depend only on the sliding layers before it (unchanged by eviction),
    so its gathered K and V equal the dense run's at the positions kvtier reports."""
    from transformers import DynamicCache

    ids = torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(3))
    dense = DynamicCache(config=model.config)
    run(model, dense, ids, 48)
    c = khf.Cache(model, "evict", max_tokens=64, budget_rows=16, recent_rows=8, prompt_rows=4)
    seen = {}
    orig = c.update

    def spy(k, v, layer, kw=None):
        K, V = orig(k, v, layer, kw)
        seen[layer] = (K, V, k.shape[2])
        return K, V

    c.update = spy
    run(model, c, ids[:, :40], 8)
    pos = c.seqs[0].positions(2, 0)
    # K rows after a round, up to a cadence more before the next; the prompt kept
    assert 16 <= len(pos) <= 24 and pos[:4].tolist() == [0, 1, 2, 3]
    run(model, c, ids[:, 40:44], 4)  # one more step, the 16 held rows then its 4
    K, V, T = seen[2]
    assert K.shape[2] == len(pos) + T
    want = np.concatenate([pos, np.arange(40, 44)])
    assert torch.allclose(K[0, 0], dense.layers[2].keys[0, 0, want], atol=1e-6)
    assert torch.allclose(V[0, 0], dense.layers[2].values[0, 0, want], atol=1e-6)
    H = len(c.seqs[0].positions(2, 0))
    assert c.get_mask_sizes(torch.arange(1), 2) == (H + 1, 44 - H)
    c.seqs[0].check()
    c.close()


def test_refusals(model):
    with pytest.raises(ValueError, match="mode"):
        khf.Cache(model, "snap")
    with pytest.raises(ValueError, match="attn_implementation"):
        m2 = type(model)(model.config)
        m2.config._attn_implementation = "eager"
        khf.Cache(m2, "recall")
    c = khf.Cache(model, "dense", max_tokens=600)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        run(model, c, torch.zeros((1, 300), dtype=torch.long), 300)
    c.close()
    c = khf.Cache(model, "dense", max_tokens=64)
    with pytest.raises(ValueError, match="max_seqs"):
        run(model, c, torch.zeros((2, 4), dtype=torch.long), 4)
    with pytest.raises(NotImplementedError, match="beam"):
        c.crop(3)
    c.close()


def test_import_error_names_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import kvtier.hf\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install './python[hf]'" in out.stdout, out.stdout + out.stderr
