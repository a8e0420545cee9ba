#!/usr/bin/env bash
# cert_study.sh — issue 34 item 0's study (bench/RESULTS.md, 2026-12-06, "branch certify").
#
#   tools/needle/cert_study.sh [BUILD_DIR [OUT_DIR]]     (defaults: build-cpu, BUILD_DIR/cert-study)
#
# Writes, with tools/needle/heldout.sh's commands (NoPE only), the traces of seeds 101-103 and the
# held-out basis `kvtier-inspect calibrate` fits on them, the same traces of the evaluation seeds
# 1-3 and each seed's own subspace (candidate u), then runs tools/needle/cert_study.py: 32k at
# ratio 32 and 128, 8k at 32, and 32k with --query-rank 128.
# Needs the library and tools built in BUILD_DIR and numpy for the interpreter in $PYTHON
# (default python3). Output: OUT_DIR/{r32,r128,r8k,qr128}.{txt,json}. About 35 minutes on the shared
# 2-core machine, one process at a time.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-cpu}
O=${2:-$B/cert-study}
PY=${PYTHON:-python3}
N=$B/tools/kvtier-needle
I=$B/tools/kvtier-inspect
mkdir -p "$O"
D="--depth 0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
log() { echo "+ $*" >&2; "$@"; }

# One data set: name, context, extra generator flags.
data() {
    local name=$1 ctx=$2
    shift 2
    local common="--needles 2 --salience none $D --no-progress $*"
    for s in 101 102 103 1 2 3; do
        log "$N" --context "$ctx" --seed $s $common --decode-calib 16 --mode dense \
            --write-trace "$O/${name}_s$s.kvtt" > /dev/null
    done
    log "$I" calibrate "$O/${name}"_s10{1,2,3}.kvtt -o "$O/$name.basis" >&2
    for s in 1 2 3; do # each evaluation seed's query subspace (it depends on the seed only)
        log "$N" --context 8k --seed $s $common --mode recall --ratio 32 \
            --write-basis "$O/${name}_subspace_s$s.basis" > /dev/null
    done
}

study() { # out name, data name, study flags
    local out=$1 name=$2
    shift 2
    KVTIER_LIBRARY=$B/libkvtier.so PYTHONPATH=python log "$PY" tools/needle/cert_study.py \
        --basis "$O/$name.basis" "$O/${name}"_s{1,2,3}.kvtt \
        --subspace "$O/${name}_subspace_s1.basis,$O/${name}_subspace_s2.basis,$O/${name}_subspace_s3.basis" \
        --json "$O/$out.json" "$@" > "$O/$out.txt"
}

data nope 32k
data nope8k 8k
data qr128 32k --query-rank 128
study r32 nope
study r128 nope --ratio 128 --candidates a,u,b32,c64,cs,d,ds
study r8k nope8k --candidates a,u,b32,c64,cs,d,ds
study qr128 qr128 --candidates a,u,b32,c64,cs,cs128,d,ds
echo "wrote $O/r32.txt, $O/r128.txt, $O/r8k.txt, $O/qr128.txt (tables at the end of each)" >&2
