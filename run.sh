#!/usr/bin/env bash
# Install dependencies, build kvtier, and run the demonstration.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/deps.sh
JOBS=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$JOBS"
MODELS=${KVT_MODELS_DIR:-../shared/models}
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
