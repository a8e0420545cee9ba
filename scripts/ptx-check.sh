#!/usr/bin/env bash
# ptx-check.sh [--spills-only] [NVCC]: what ptxas makes of the CUDA backend's kernels
# (kernels/cuda/cu_*.cu and recall/kernels/cuda/cu_*.cu, sm_90, the build's floating-point
# flags). For every kernel: registers, stack frame, spill stores and loads (ptxas -v); for the
# files of the scan, step, RoPE and pack kernels, the byte loads (ld.*.u8/s8/b8) in each kernel's
# PTX, each traced to its source line (-lineinfo). An element of a row (bf16, fp16, fp32, an fp8
# code or scale) is read with aligned loads of 2 bytes or more (kernels/kvt_hd.h's device loads,
# issue 33 item 4), so a byte load is allowed only where the source line reads a 1-byte datum,
# listed in ONE_BYTE below (a flag, a bool field); any other, or one the PTX does not place,
# fails. Prints a table (bytes: the kernel's byte loads, all of them 1-byte data when it passes);
# exits 1 when a kernel spills or (without --spills-only) a scan/step/RoPE/pack kernel loads a
# byte that is not a 1-byte datum.
# No device needed.
set -euo pipefail
spills_only=0
if [ "${1:-}" = "--spills-only" ]; then spills_only=1; shift; fi
nvcc=${1:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ ! -x "$nvcc" ]; then
  echo "ptx-check: SKIPPED: no nvcc (looked for ${1:-nvcc on PATH and /usr/local/cuda/bin/nvcc})"
  exit 77
fi
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d "${TMPDIR:-/tmp}/ptx-check.XXXXXX")
trap 'rm -rf "$out"' EXIT
flags=(-arch=sm_90 -std=c++17 -O3 -I"$root" -I"$root/lib" --fmad=false --prec-sqrt=true
       --prec-div=true --ftz=false)
bad=0
printf '%-8s %-6s %-6s %-6s %-6s %s\n' regs stack spillS spillL bytes kernel
for f in "$root"/kernels/cuda/cu_*.cu "$root"/recall/kernels/cuda/cu_*.cu; do
  name=$(basename "$f" .cu)
  "$nvcc" "${flags[@]}" -Xptxas -v -c "$f" -o "$out/$name.o" 2> "$out/$name.ptxas"
  bytes_check=0
  case "$name" in cu_recall|cu_rope|cu_pack) bytes_check=1 ;; esac
  if [ "$bytes_check" = 1 ]; then
    "$nvcc" "${flags[@]}" -lineinfo -ptx "$f" -o "$out/$name.ptx"
  fi
  python3 - "$out/$name.ptxas" "$out/$name.ptx" "$bytes_check" "$spills_only" <<'PY' || bad=1
import os, re, sys
ptxas, ptx, bytes_check, spills_only = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
# The 1-byte data these kernels read (file, text of the source line): every other byte load is
# an element read a byte at a time (or one the PTX cannot place) and fails the check.
ONE_BYTE = [
    ("cu_recall.cuh", "flags[i] != 0"),    # the scan's fire flags (a byte a closed row)
    ("cu_recall.cuh", "gw.live["),         # the pruned scan's group liveness (a byte a group)
    ("rope_trigger.h", "capped"),          # kvt__recall_rope_args.capped (bool)
    ("cu_rope.cu", "a.capped"),            # the same field in the RoPE kernels
    ("cu_pack.cu", "q.all_rows"),          # kvt__pack_query.all_rows (bool), *q.dense (a byte)
    ("cu_pack.cu", "q.count_only"),        # kvt__pack_query.count_only (bool)
    ("cu_pack.cu", "q.paged"),             # kvt__pack_query.paged (bool, KVT_EMIT_PAGED)
]
# byte loads per entry in the PTX, each with the innermost source line it was compiled from
loads, bad_loads = {}, {}
if bytes_check:
    files, src, cur, loc = {}, {}, None, None
    lines = open(ptx).read().splitlines()
    for line in lines:
        m = re.match(r"\s*\.file\s+(\d+)\s+\"([^\"]+)\"", line)
        if m:
            files[m.group(1)] = m.group(2)
    for line in lines:
        m = re.match(r"\s*(\.visible\s+)?\.entry\s+(\S+?)\(", line)
        if m:
            cur, loc = m.group(2), None
            loads[cur], bad_loads[cur] = 0, []
            continue
        m = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line)
        if m:
            loc = (files.get(m.group(1), "?"), int(m.group(2)))
            continue
        if cur and re.search(r"\bld(\.global|\.shared|\.local|\.const)?(\.nc)?\.(u8|s8|b8)\b", line):
            loads[cur] += 1
            text = ""
            if loc and loc[1] > 0 and os.path.exists(loc[0]):
                if loc[0] not in src:
                    src[loc[0]] = open(loc[0]).read().splitlines()
                text = src[loc[0]][loc[1] - 1].strip() if loc[1] <= len(src[loc[0]]) else ""
            ok = bool(text) and any(os.path.basename(loc[0]) == f and t in text for f, t in ONE_BYTE)
            if not ok:
                where = f"{os.path.basename(loc[0])}:{loc[1]}" if loc else "no source line"
                bad_loads[cur].append(f"{line.strip()}  <- {where}: {text[:80]}")
fail = False
entry = None
for line in open(ptxas):
    m = re.search(r"Compiling entry function '(\S+)'", line)
    if m:
        entry = m.group(1)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and entry:
        stack, st, ld = (int(x) for x in m.groups())
        entry_stack = (stack, st, ld)
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and entry:
        stack, st, ld = entry_stack
        b = loads.get(entry) if bytes_check else None
        k = re.search(r"\d+(k_[a-z0-9_]+?)(E|I)", entry)
        short = (k.group(1) if k else entry) + (" (plan items)" if "PlanOf" in entry else "")
        print(f"{m.group(1):<8} {stack:<6} {st:<6} {ld:<6} {'-' if b is None else b!s:<6} {short}")
        bad = bad_loads.get(entry, []) if bytes_check else []
        for x in bad:
            print(f"         byte load of no 1-byte datum: {x}")
        if st or ld or (not spills_only and bad):
            fail = True
        entry = None
sys.exit(1 if fail else 0)
PY
done
if [ "$bad" = 0 ]; then
  echo "ptx-check: passed ($([ "$spills_only" = 1 ] && echo "no kernel spills" || echo "no spills; the scan/step/RoPE/pack kernels load bytes of 1-byte data only"))"
else
  echo "ptx-check: FAILED: a kernel spills$([ "$spills_only" = 1 ] || echo ", or a scan/step/RoPE/pack kernel loads an element a byte at a time (issue 33 item 4)")"
fi
exit "$bad"
