#!/usr/bin/env bash
# ptx-check.sh [--spills-only] [NVCC]: what ptxas makes of the CUDA backend's kernels
# (kernels/cuda/cu_*.cu, sm_90, the build's floating-point flags). For every kernel: registers,
# stack frame, spill stores and loads (ptxas -v); for the files of the scan, step, RoPE and pack
# kernels, the byte loads (ld.*.u8/s8/b8) in each kernel's PTX, which 2-byte (bf16/fp16) elements
# should not need (issue 33: aligned vector loads). Prints a table; exits 1 when a kernel spills
# or (without --spills-only) a scan/step/pack kernel loads bytes. No device needed.
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
for f in "$root"/kernels/cuda/cu_*.cu; do
  name=$(basename "$f" .cu)
  "$nvcc" "${flags[@]}" -Xptxas -v -c "$f" -o "$out/$name.o" 2> "$out/$name.ptxas"
  bytes_check=0
  case "$name" in cu_recall|cu_rope|cu_pack) bytes_check=1 ;; esac
  if [ "$bytes_check" = 1 ]; then
    "$nvcc" "${flags[@]}" -ptx "$f" -o "$out/$name.ptx"
  fi
  python3 - "$out/$name.ptxas" "$out/$name.ptx" "$bytes_check" "$spills_only" <<'PY' || bad=1
import re, sys
ptxas, ptx, bytes_check, spills_only = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
# byte loads per entry in the PTX
loads = {}
if bytes_check:
    cur = None
    for line in open(ptx):
        m = re.match(r"\s*(\.visible\s+)?\.entry\s+(\S+?)\(", line)
        if m:
            cur = m.group(2)
            loads[cur] = 0
        elif cur and re.search(r"\bld(\.global|\.shared|\.local|\.const)?(\.nc)?\.(u8|s8|b8)\b", line):
            loads[cur] += 1
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
        if st or ld or (not spills_only and b):
            fail = True
        entry = None
sys.exit(1 if fail else 0)
PY
done
if [ "$bad" = 0 ]; then
  echo "ptx-check: passed ($([ "$spills_only" = 1 ] && echo "no kernel spills" || echo "no spills, no byte loads in the scan/step/pack kernels"))"
else
  echo "ptx-check: FAILED: a kernel spills$([ "$spills_only" = 1 ] || echo ", or a scan/step/pack kernel loads bytes (issue 33 item 4)")"
fi
exit "$bad"
