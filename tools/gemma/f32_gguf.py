"""Write a float32 copy of the GGUF: the same metadata, every tensor dequantised to F32.

    python tools/gemma/f32_gguf.py [--out PATH]   (default: cache_dir()/gemma-3-270m-f32.gguf)

Why: llama.cpp quantises the activations entering a product with a quantised weight (Q8_0 or
Q8_K), and Gemma's activations carry large outlier channels, so on the Q4_K_M file its logits
differ from a float32 forward of the same weights by ~0.6 rms — numerics, not architecture.
On F32 weights llama.cpp multiplies float32 by float32; with an F32 KV cache what is left
between it and engine.py is rounding (its GELU table is fp16), so the comparison can tell a
wrong forward from noise. The weights are the dequantised Q4_K_M ones: both sides run exactly
the same model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gguf_model  # noqa: E402

F32_FILE = "gemma-3-270m-f32.gguf"


def write_f32(src: Path, out: Path) -> Path:
    import gguf
    import numpy as np

    gguf_model.load()  # makes sure the dequantised tensors are cached
    reader = gguf.GGUFReader(str(src))
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        if f.name == "general.file_type":
            val = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(f.name, val, vt, sub_type=sub)
    folder = gguf_model.cache_dir() / f"f32-{gguf_model.MODEL_SHA256[:16]}"
    for t in reader.tensors:
        a = np.load(folder / f"{t.name}.npy", mmap_mode="r")
        writer.add_tensor(t.name, np.ascontiguousarray(a, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def f32_path(create: bool = True) -> Path:
    out = gguf_model.cache_dir() / F32_FILE
    if not out.exists() and create:
        write_f32(gguf_model.model_path(), out)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = write_f32(gguf_model.model_path(), Path(a.out)) if a.out else f32_path()
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
