"""Write the Hugging Face config.json of the GGUF's model (Gemma3TextConfig's keys), for the
census: `kvtier-inspect census tests/data/gemma-3-270m.json`.

    python tools/gemma/write_config.py [--out tests/data/gemma-3-270m.json] [--gguf PATH]

Every value comes from the GGUF metadata except those llama.cpp hard-codes for the gemma3
architecture (see gguf_model.read_config): the sliding pattern 6 (written out as layer_types,
and as sliding_window_pattern for readers that predate layer_types), rope_local_base_freq
10000, query_pre_attn_scalar = head_dim.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = Path(__file__).resolve().parents[2]
    ap.add_argument("--out", default=str(root / "tests" / "data" / "gemma-3-270m.json"))
    ap.add_argument("--gguf", default=None, help="the .gguf (default: the cached download)")
    a = ap.parse_args()
    cfg = gguf_model.load(a.gguf)[0].config
    Path(a.out).write_text(json.dumps(cfg.hf_config(), indent=2) + "\n")
    print(f"wrote {a.out}: {cfg.n_layers} layers, "
          f"{sum(cfg.is_sliding(i) for i in range(cfg.n_layers))} sliding (window "
          f"{cfg.sliding_window}), {cfg.n_kv_heads} KV head x {cfg.head_dim}")


if __name__ == "__main__":
    main()
