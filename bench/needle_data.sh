#!/usr/bin/env bash
# bench/needle_data.sh BUILD DIR [largest context in k rows (128)]: the needle data of
# bench_decode_step's data=needle cases (bench/bench_decode_case.h), written by BUILD's
# kvtier-needle into DIR: per context N (32k, 128k up to the largest) the trace
# needle-<N/1024>k.kvtt of one haystack of N − 2048 rows (the case's timed steps start at N − B/2
# rows) with 32 query heads, 18 no-salience needles at depths 0.1 .. 0.9 and a decode phase of
# 16 filler steps then 3 filler steps before each needle query (88 steps), and the generator's
# query subspace as the basis file needle-<N/1024>k.basis: 155 MB at 128k, 42 MB at 32k.
set -euo pipefail
build=${1:?usage: bench/needle_data.sh BUILD DIR [largest context in k rows]}
dir=${2:?usage: bench/needle_data.sh BUILD DIR [largest context in k rows]}
max_k=${3:-128}
mkdir -p "$dir"
for k in 32 128; do
  [ "$k" -le "$max_k" ] || break
  "$build/tools/kvtier-needle" --context "$((k - 2))k" --heads 32 --needles 2 --salience none \
    --depth 0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9 --decode-calib 16 --mode recall --seed 1 \
    --write-trace "$dir/needle-${k}k.kvtt" --write-basis "$dir/needle-${k}k.basis" >/dev/null
done
