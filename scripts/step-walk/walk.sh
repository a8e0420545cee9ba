#!/usr/bin/env bash
# walk.sh [SOURCE_DIR]: the walk of one decode step (one MLA-NoPE layer, conformal recall,
# after calibration: reserve, plan, run, commit) through the library's source files. Builds the
# library of SOURCE_DIR (default: this checkout) with -finstrument-functions (CPU only, no
# tests or tools) under $TMPDIR, runs driver.c against it and prints walk.py's count of the
# whole step, then of its kvt_batch_run alone with the walk.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "${1:-$here/../..}" && pwd)
out=$(mktemp -d "${TMPDIR:-/tmp}/step-walk.XXXXXX")
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_CUDA=OFF \
  -DKVT_BUILD_TESTS=OFF -DKVT_BUILD_TOOLS=OFF -DKVT_BUILD_BENCH=OFF -DKVT_JEMALLOC=OFF \
  "-DCMAKE_C_FLAGS=-finstrument-functions" >/dev/null
cmake --build "$out/build" -j"$(nproc)" --target kvtier_static >/dev/null
lib=$(find "$out/build" -name 'libkvtier.a' | head -n 1)
cc -O1 -g -no-pie -I"$src/lib" "$here/driver.c" "$lib" -ljansson -lz -lm -lpthread \
  -o "$out/driver"
"$out/driver" "$out/trace.txt"
echo "== the whole step (reserve, write, plan, run, commit)"
python3 "$here/walk.py" "$out/driver" "$out/trace.txt" | sed -n 1p
echo "== kvt_batch_run"
python3 "$here/walk.py" "$out/driver" "$out/trace.txt" kvt_batch_run
rm -rf "$out"
