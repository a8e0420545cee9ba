#!/usr/bin/env bash
# The once-stated-fact grid (issue 13 item 3): lengths x depths x seeds, per store, one batch per
# (store, length) so that K = length / ratio for every request of the batch. Writes
# results/fact_<store>_<length>.csv and .log, then results/fact_grid.csv and the heatmap.
#   tools/gemma/fact_grid.sh [LENGTHS] [DEPTHS] [KEYS] [STORES]
set -euo pipefail
cd "$(dirname "$0")"
LENGTHS=${1:-1024,2048,4096}
DEPTHS=${2:-0.1,0.3,0.5,0.7,0.9}
KEYS=${3:-3}
STORES=${4:-dense,kvtier-evict:4,kvtier-evict:8}
PY=${PYTHON:-$HOME/.cache/kvtier/venv/bin/python}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p results
for st in ${STORES//,/ }; do
  for L in ${LENGTHS//,/ }; do
    tag=fact_${st//:/_}_$L
    t0=$SECONDS
    nice -n 10 "$PY" probe.py --task fact --lengths "$L" --depths "$DEPTHS" --keys "$KEYS" \
      --seed 13 --chunk 64 --store "$st" --csv "results/$tag.csv" > "results/$tag.log" 2>&1
    echo "$tag: $((SECONDS - t0)) s, $(grep -o 'retrieved [0-9]*/[0-9]*' "results/$tag.log")"
  done
done
"$PY" heatmap.py results/fact_grid.csv results/fact_heatmap.png results/fact_*_*.csv
