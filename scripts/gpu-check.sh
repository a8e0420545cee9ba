#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU (H100/H200: sm_90). One script, under 8
# minutes: build with CUDA, run the CUDA paths against their CPU twins, run the benchmarks, and
# leave everything it printed under OUT (default ./gpu-results). (An estimate: it has never run on
# a device. From the same tests' CPU times on this project's 2-core machine — golden 12 s, the
# CUDA ops' twins 12 s, recall_step 22 s, fp8 7 s, graph 5 s, the fast tests 37 CPU-s — the
# tests take ~1.5 min and the build ~2 min on 16 cores; compute-sanitizer is capped at 2 × 90 s,
# the older benchmarks at their timeouts; issue 34's two decode benchmarks add ~1.5 min.)
#
#   - test_golden with KVT_REQUIRE_GPU=1: every golden case driven in the engine's order on the
#     CUDA backend must give the CPU's keep-set file byte for byte (decisions bit-equal: σ, top-m,
#     Philox draws, VaSE, compaction, archive); without a device this fails instead of skipping.
#   - test_cuda with KVT_REQUIRE_GPU=1: each op against its CPU twin on random inputs (which op
#     differs, when the goldens do), the recall tier's sketch_rows, recall_scan, recall_step and
#     the pack's recall merge included (cuda::sketch_rows_equal_the_cpu,
#     cuda::recall_scan_equals_the_cpu, cuda::recall_step_equals_the_cpu,
#     cuda::recall_step_pruned_equals_the_cpu (the group build and pruned scan on the device:
#     planes byte for byte, visited counts), cuda::recall_step_planned_pruned_equals_the_cpu,
#     cuda::pack_recall_equals_the_cpu,
#     cuda::recall_step_promotion_equals_the_cpu, cuda::attend_equals_the_cpu (the reference MLA
#     attention over index sets, split over chunks in double): never run on a device before this
#     script's first run with them).
#   - test_recall_step's conformal decode with KVT_REQUIRE_GPU=1: 120 decode steps through the
#     library (calibration, fetches, CSR-free TOKENS emission) on the CUDA backend emit the CPU's
#     sets, slot for slot; and at 8 bits (params.recall_scan_bits 8, docs/recall.md §3.3: the
#     close's 8-bit planes and the 8-bit scan on the device), 96 decode steps whose planes equal
#     the guarded backend's byte for byte and whose sets equal its, slot for slot (test_cuda's
#     sketch, scan and step cases run at 8 bits too).
#   - test_recall_step's refit case with KVT_REQUIRE_GPU=1: a layer basis replaced while
#     requests live (kvt_ctx_refit_recall_basis) re-sketches every closed row on the device
#     (sketch_rows, 16 and 8 bits, a shared set) and the request then decides as one created with
#     the new basis, slot for slot (the CPU and guarded legs alongside).
#   - test_graph with KVT_REQUIRE_GPU=1: one CUDA graph captured over the runs of a planned
#     step (kvt_batch_plan_device) replayed over the later planned steps of 170 gives the eager
#     twin's sets on every layer, without recall and with the planned recall step (conformal
#     TOKENS, margin + promotion CSR: the replays' sets, dense flags and recall counters equal
#     the eager twin's); never run on a device before this script's first run with it.
#   - the fast tests, which include the CUDA skip paths' neighbours (guarded, batch, steady).
#   - bench_tiers and bench_compact (CPU figures, for the same-run ratios) and nvidia-smi.
#   - bench_ops on the device: a salience close (σ of a 4096-row block + top-m of 32k closed rows;
#     the goal is < 50 us) and an eviction round of 8 layers x 8 heads (ev_select + ev_apply; the
#     goal is <= 1.1x the copy of the kept rows), wall and device (event) times beside a
#     device-to-device copy floor measured in the same run; and the CPU backend's beside them.
#   - compute-sanitizer memcheck and racecheck on test_cuda's pack, attend, select and pruned
#     recall step tests.
#   - bench_step: the decode step of a batch (eager, planned, CUDA graph) at 4k rows (the per-step
#     fixed overhead), 32k and 128k rows, beside the floor of a dense attention (every row read
#     once: half a device-to-device copy), and at 32k with recall on every layer (the planned
#     recall step inside the graph).
#   - a needle cell (kvtier-needle --synthetic, 8k, ratios 8 and 32, salience / random / dense) on
#     the CUDA backend: its CSV must be the CPU backend's, byte for byte.
#   - the decode step's ratio on the device (issue 34): bench_step cuda decode — one absorbed-MLA
#     NoPE layer (32 heads, ratio 32, B = 4096), 32k and 128k rows, structured and random data,
#     recall conformal with a rank-64 basis at 16 and at 8 bits, and recall off; each case one
#     line `decode_step context=... data=... recall=... dense_over_kvtier=... bytes_per_token=...
#     close_over_median=... visited=...`, dense being a cuBLAS attention (GEMM, softmax, GEMM on
#     the bf16 rows) over every row in the same run (bench/bench_step_decode.h); beside it the CPU
#     backend's bench_decode_step (one thread, the 8-bit scan and recall off), the same case and
#     line (both from bench/bench_decode_case.h). The lines go to summary.txt.
#   - test_fp8's CUDA case: fp8 ds_mla rows recall on the device as their fp32 decoding does.
#   - test_rope_recall's CUDA graph case: batches with RoPE recall (MLA-RoPE TOKENS and CSR,
#     GQA-RoPE CSR_KV_HEADS), one recording of a planned step's runs (planned trigger, pack with
#     count-only lists, planned emission) replayed over the later planned steps equals the eager
#     twin: lists, offsets, dense flags, trigger state.
#
# Not yet covered on the device (the CUDA issue): capture of steps with a close or round due
# (those run eagerly, as the issue allows); fp8 rows on eviction layers.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
JOBS=$(nproc 2>/dev/null || echo 8)
export KVT_MODELS_DIR=${KVT_MODELS_DIR:-$PWD/tests/data/models}
{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi || true
} > "$OUT/machine.txt" 2>&1
t0=$SECONDS
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=${KVT_CUDA_ARCH:-90} > "$OUT/configure.txt" 2>&1
cmake --build build-gpu -j"$JOBS" > "$OUT/build.txt" 2>&1
echo "build: $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
status=0
(cd build-gpu && KVT_REQUIRE_GPU=1 ./tests/test_golden --verbose) > "$OUT/golden_cuda.txt" 2>&1 ||
  status=1
echo "golden on CUDA: $([ $status = 0 ] && echo passed || echo FAILED)" | tee -a "$OUT/summary.txt"
(cd build-gpu && KVT_REQUIRE_GPU=1 ./tests/test_cuda --verbose) > "$OUT/cuda_ops.txt" 2>&1 || status=1
echo "CUDA ops vs CPU twins: see cuda_ops.txt" | tee -a "$OUT/summary.txt"
(cd build-gpu && KVT_REQUIRE_GPU=1 timeout 300 ./tests/test_recall_step \
  --filter 'recall_step/@(conformal_decode_matches_the_oracle|scan_bits_8_emits_a_superset_and_snapshots)' \
  --verbose && KVT_REQUIRE_GPU=1 timeout 120 ./tests/test_recall_step \
  --filter 'recall_refit/refitted_request_decides_as_a_fresh_basis' --verbose) \
  > "$OUT/recall_step_cuda.txt" 2>&1 || status=1
echo "recall decode on CUDA vs CPU: see recall_step_cuda.txt" | tee -a "$OUT/summary.txt"
(cd build-gpu && KVT_REQUIRE_GPU=1 timeout 120 ./tests/test_fp8 \
  --filter 'fp8/*_cuda' --verbose) > "$OUT/fp8_cuda.txt" 2>&1 || status=1
echo "fp8 rows on CUDA vs their fp32 decoding: see fp8_cuda.txt" | tee -a "$OUT/summary.txt"
(cd build-gpu && KVT_REQUIRE_GPU=1 timeout 120 ./tests/test_graph --verbose) \
  > "$OUT/graph_cuda.txt" 2>&1 || status=1
echo "graph replay on CUDA vs eager: see graph_cuda.txt" | tee -a "$OUT/summary.txt"
(cd build-gpu && KVT_REQUIRE_GPU=1 timeout 120 ./tests/test_rope_recall \
  --filter 'rope_graph/*_cuda' --verbose) > "$OUT/rope_graph_cuda.txt" 2>&1 || status=1
echo "RoPE recall graph replay on CUDA vs eager: see rope_graph_cuda.txt" | tee -a "$OUT/summary.txt"
# compute-sanitizer (memcheck, racecheck) over the ops whose kernels are newest, where the
# toolkit ships it; Criterion runs each test in a child process (--target-processes all)
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$CS" ]; then
  for tool in memcheck racecheck; do
    (cd build-gpu && KVT_REQUIRE_GPU=1 timeout 90 "$CS" --tool "$tool" --target-processes all \
      --error-exitcode 3 ./tests/test_cuda --jobs 1 \
      --filter 'cuda/@(pack_equals_the_cpu|attend_equals_the_cpu|select_segments_equal_the_cpu|recall_step_pruned_equals_the_cpu)') \
      > "$OUT/sanitizer_$tool.txt" 2>&1 || status=1
    echo "compute-sanitizer $tool: see sanitizer_$tool.txt" | tee -a "$OUT/summary.txt"
  done
else
  echo "compute-sanitizer: not found, skipped" | tee -a "$OUT/summary.txt"
fi
(cd build-gpu && ctest -L fast -j"$JOBS" --output-on-failure) > "$OUT/fast_tests.txt" 2>&1 ||
  status=1
echo "fast tests: see fast_tests.txt" | tee -a "$OUT/summary.txt"
for b in bench_tiers bench_compact; do
  (cd build-gpu && timeout 120 ./bench/$b 5) > "$OUT/$b.txt" 2>&1 || true
done
(cd build-gpu && timeout 60 ./bench/bench_ops cuda 20 && timeout 60 ./bench/bench_ops cpu 3) \
  > "$OUT/bench_ops.txt" 2>&1 || true
echo "close and round on the device vs copy floors: see bench_ops.txt" | tee -a "$OUT/summary.txt"
# the decode step of a batch on the device: eager, planned and CUDA-graph steps at 32k rows
# (16 requests) and 128k (4), and the CPU backend's at 32k beside them
(cd build-gpu && timeout 60 ./bench/bench_step cuda 3 4096 16 &&
  timeout 90 ./bench/bench_step cuda 3 32768 16 &&
  timeout 90 ./bench/bench_step cuda 3 131072 4 &&
  timeout 90 ./bench/bench_step cuda 3 32768 16 recall &&
  timeout 60 ./bench/bench_step cpu 3 32768 16) \
  > "$OUT/bench_step.txt" 2>&1 || true
echo "decode step (eager / planned / graph, dense floor, recall): see bench_step.txt" |
  tee -a "$OUT/summary.txt"
# issue 34's decode step with recall on the device against a cuBLAS dense attention, and the CPU
# backend's (bench_decode_step, one thread) beside it: their decode_step lines into the summary
# (time: ~40 s and ~45 s, estimated from this project's 2-core machine: bench_step's decode mode
# is host-bound there — generating and writing the rows, ~2 s a 32k case on the CPU backend — and
# bench_decode_step 1 32 5 8 took 7.8 s for its three 32k cases, so 3 128 5 8's six cases ~45 s;
# the CPU run takes the 8-bit scan only, the 16-bit CPU figures are in bench/RESULTS.md)
(cd build-gpu && timeout 150 ./bench/bench_step cuda decode 3 128 5 both both) \
  > "$OUT/bench_decode_step_cuda.txt" 2>&1 || true
if [ -x build-gpu/bench/bench_decode_step ]; then
  (cd build-gpu && timeout 120 ./bench/bench_decode_step 3 128 5 8) \
    > "$OUT/bench_decode_step_cpu.txt" 2>&1 || true
fi
{
  echo "decode step, CUDA backend (bench_decode_step_cuda.txt):"
  grep '^decode_step' "$OUT/bench_decode_step_cuda.txt" || echo "  (no line: see the file)"
  echo "decode step, CPU backend, one thread (bench_decode_step_cpu.txt):"
  grep '^decode_step' "$OUT/bench_decode_step_cpu.txt" 2>/dev/null || echo "  (no line)"
} | tee -a "$OUT/summary.txt"
# a needle cell on the device: the CPU backend's CSV, byte for byte
needle="--synthetic --context 8192 --ratio 8,32 --mode salience,random,dense --needles 2 --seed 3"
if (cd build-gpu && timeout 120 ./tools/kvtier-needle $needle --csv "$OUT/needle_cpu.csv" \
      --no-progress && timeout 120 ./tools/kvtier-needle $needle --backend cuda \
      --csv "$OUT/needle_cuda.csv" --no-progress) > "$OUT/needle.txt" 2>&1 &&
   cmp -s "$OUT/needle_cpu.csv" "$OUT/needle_cuda.csv"; then
  echo "needle cell on CUDA: the CPU's CSV" | tee -a "$OUT/summary.txt"
else
  status=1
  echo "needle cell on CUDA: FAILED or differs (needle.txt, needle_*.csv)" | tee -a "$OUT/summary.txt"
fi
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
exit $status
