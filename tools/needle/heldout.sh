#!/usr/bin/env bash
# heldout.sh — the recall fidelity claims of docs/needle.md and docs/recall.md re-measured with
# bases fitted on OTHER seeds' traces (issue 32 item 5).
#
#   tools/needle/heldout.sh [BUILD_DIR [OUT_DIR [CONTEXTS]]]     (paths from the repository root;
#                                                                 defaults: build-cpu,
#                                                                 BUILD_DIR/heldout, "8k 32k")
#
# For each context: the synthetic generator writes traces of seeds 101-103 (NoPE and --rope, the
# same needles and decode phase as the evaluation), `kvtier-inspect calibrate` fits a basis on
# the three traces of each kind (NoPE: the query latents' centred covariance; RoPE: the keys'
# uncentred second moment, OUT.h0), and kvtier-needle evaluates seeds 1-3 (54 no-salience needles
# a cell: 9 depths x 2 needles x 3 seeds) with
#   NoPE, 32x and 128x: conformal with the generator's own subspace (the documented case), with
#     the held-out basis, with no basis, and with --query-rank 128 (the subspace's first 64 rows:
#     half of each direction); and the held-out basis as the start of --recall-adapt (refitted to
#     the request's own decode queries after steps 8, 16, 32, 64: issue 34 item 0);
#   RoPE, 8x: margin and conformal, each with the subspace and with the held-out key basis, and
#   margin with the held-out key basis refitted to each haystack's own keys (--recall-adapt).
# Then the independent writer's trace (tests/scripts/indep_trace.py), conformal without a basis
# and with its axes basis. It also writes each evaluation seed's subspace (--write-basis) and prints the share of it the
# held-out bases hold (mean over the subspace's directions of |V u|^2).
# Output: OUT_DIR/summary.txt (every "recall ..." summary line, prefixed by the run's label),
# OUT_DIR/heldout.csv (the same, parsed), OUT_DIR/share.txt. Each kvtier-needle call is one line
# of the log, so a run can be repeated by hand. About 20 minutes on the shared 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build-cpu}
O=${2:-$B/heldout}
CONTEXTS=${3:-"8k 32k"}
N=$B/tools/kvtier-needle
I=$B/tools/kvtier-inspect
mkdir -p "$O"
D="--depth 0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
COMMON="--needles 2 --salience none $D --no-progress"
: > "$O/summary.txt"
: > "$O/share.txt"

log() { echo "+ $*" >&2; "$@"; }

# One evaluation: label, then kvtier-needle flags. Keeps the summary lines.
evaluate() {
    local label=$1
    shift
    log "$N" --seed 1 --seeds 3 $COMMON --mode recall "$@" | grep -E '^recall (conformal|sound|margin) ' |
        sed "s/^/$label | /" | tee -a "$O/summary.txt"
}

# The share of subspace file U (rank r) that basis file V holds: mean_k |V u_k|^2.
share() {
    python3 - "$1" "$2" <<'EOF'
import struct, sys
def read(p):
    b = open(p, "rb").read()
    assert b[:8] == b"KVTRBAS1", p
    _, _, r, d = struct.unpack_from("<IIII", b, 8)
    v = struct.unpack_from("<%df" % (r * d), b, 40)
    return [v[i * d:(i + 1) * d] for i in range(r)]
u, v = read(sys.argv[1]), read(sys.argv[2])
s = sum(sum(sum(a * b for a, b in zip(x, y)) ** 2 for y in v) for x in u) / len(u)
print("%.4f" % s)
EOF
}

for s in 1 2 3; do # each evaluation seed's query subspace (it depends on the seed only)
    log "$N" --context 8k --seed $s $COMMON --mode recall --ratio 32 \
        --write-basis "$O/subspace_s$s.basis" > /dev/null
done
for ctx in $CONTEXTS; do
    for s in 101 102 103; do
        log "$N" --context "$ctx" --seed $s $COMMON --decode-calib 16 --mode dense \
            --write-trace "$O/nope_${ctx}_s$s.kvtt" > /dev/null
        log "$N" --rope --context "$ctx" --seed $s $COMMON --decode-calib 16 --mode dense \
            --write-trace "$O/rope_${ctx}_s$s.kvtt" > /dev/null
    done
    log "$I" calibrate "$O"/nope_"${ctx}"_s10{1,2,3}.kvtt -o "$O/nope_$ctx.basis" >&2
    log "$I" calibrate "$O"/rope_"${ctx}"_s10{1,2,3}.kvtt -o "$O/rope_$ctx.basis" >&2
    for s in 1 2 3; do
        echo "$ctx seed $s: nope held-out basis holds $(share "$O/subspace_s$s.basis" \
            "$O/nope_$ctx.basis") of the subspace, rope held-out key basis $(share \
            "$O/subspace_s$s.basis" "$O/rope_$ctx.basis.h0")" | tee -a "$O/share.txt"
    done
    evaluate "nope conformal subspace" --context "$ctx" --ratio 32,128
    evaluate "nope conformal heldout" --context "$ctx" --ratio 32,128 \
        --recall-basis "$O/nope_$ctx.basis"
    evaluate "nope conformal heldout_adapt" --context "$ctx" --ratio 32,128 \
        --recall-basis "$O/nope_$ctx.basis" --recall-adapt
    evaluate "nope conformal none" --context "$ctx" --ratio 32,128 --recall-basis none
    evaluate "nope conformal qrank128" --context "$ctx" --ratio 32,128 --query-rank 128
    evaluate "rope margin subspace" --rope --context "$ctx" --ratio 8 --recall margin
    evaluate "rope margin heldout" --rope --context "$ctx" --ratio 8 --recall margin \
        --recall-basis "$O/rope_$ctx.basis.h0"
    evaluate "rope conformal subspace" --rope --context "$ctx" --ratio 8
    evaluate "rope margin heldout_adapt" --rope --context "$ctx" --ratio 8 --recall margin \
        --recall-basis "$O/rope_$ctx.basis.h0" --recall-adapt
    evaluate "rope conformal heldout" --rope --context "$ctx" --ratio 8 \
        --recall-basis "$O/rope_$ctx.basis.h0"
done

# Other data: the independent writer's 2,072-row trace (tests/scripts/indep_trace.py: another
# haystack model, no generator subspace), conformal recall without a basis, with the rank-8
# axes basis the script writes, and with that basis as the start of --recall-adapt (its 24
# decode steps reach two refits, after 8 and 16).
python3 tests/scripts/indep_trace.py "$O/indep.kvtt" --basis "$O/indep_axes.basis"
for b in none axes axes_adapt; do
    f=none
    a=
    [ $b != none ] && f="$O/indep_axes.basis"
    [ $b = axes_adapt ] && a=--recall-adapt
    log "$N" --trace "$O/indep.kvtt" --mode recall --recall-basis "$f" --block 512 --kappa 8 \
        --ratio 32 --no-progress $a | grep -E '^recall (conformal|sound|margin) ' |
        sed "s/^/indep conformal $b | /" | tee -a "$O/summary.txt"
done

# summary.txt -> heldout.csv
python3 - "$O/summary.txt" > "$O/heldout.csv" <<'EOF'
import re, sys
pat = re.compile(
    r"^(\w+) (\w+) (\w+) \| recall (\w+) (\d+)k (\d+)x \((\d+) haystacks?\): pass (\d+)/(\d+) "
    r"\(by fetch (\d+), by overflow/dense (\d+), kept by salience (\d+)\); needle steps (\d+): "
    r"overflow (\d+), dense (\d+); other steps (\d+) \(after (\d+) calibration\): overflow (\d+), "
    r"dense (\d+); fetched on other non-dense steps ([0-9.]+)% of the archive; visited "
    r"([0-9.]+)%; z (\S+?)\.\.(\S+?)(?:; refits (\d+))?$")
print("layer,trigger,basis,context_k,ratio,haystacks,pass,counted,by_fetch,by_overflow_dense,"
      "kept,needle_steps,needle_overflow,needle_dense,other_steps,calib_steps,other_overflow,"
      "other_dense,fetched_other_pct,visited_pct,z_min,z_max,refits")
for line in open(sys.argv[1]):
    m = pat.match(line.strip())
    if not m:
        sys.exit("unparsed: " + line)
    g = list(m.groups())
    assert g[1] == g[3], line  # the label's trigger is the run's
    del g[3]
    print(",".join("" if x is None else x for x in g))
EOF
echo "wrote $O/summary.txt, $O/heldout.csv, $O/share.txt" >&2
