#!/usr/bin/env python3
"""walk.py EXE TRACE [FUNCTION]: the walk of one traced decode step through the source files.

Inside a backend op (a function of kernels/), the walk stays at the op's file: the per-element
math below it is one stop.

TRACE holds the driver's "> addr" (entered) and "< addr" (left) lines. Each address is named by
addr2line (function, file). The walk is the file of the innermost running function after every
event, consecutive repeats collapsed: a stop is a visit to a file; a return is a stop at a file
the walk had already left (FUNCTION: only inside its calls). Printed: stops, returns, the visits of each file, and the walk."""
import collections
import os
import subprocess
import sys


def main():
    exe, trace = sys.argv[1], sys.argv[2]
    only = sys.argv[3] if len(sys.argv) > 3 else None
    events = []
    for line in open(trace):
        kind, addr = line.split()
        events.append((kind, addr))
    addrs = sorted({a for _, a in events})
    out = subprocess.run(["addr2line", "-f", "-e", exe] + addrs, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    name = {}
    for i, a in enumerate(addrs):
        fn, loc = out[2 * i], out[2 * i + 1]
        path = loc.split(":")[0]
        parts = path.split(os.sep)
        for root in ("lib", "tiers", "recall", "kernels"):
            if root in parts:
                path = os.sep.join(parts[len(parts) - 1 - parts[::-1].index(root):])
                break
        name[a] = (fn, path)
    if only:  # the events inside the calls of that function
        kept, depth = [], 0
        for kind, a in events:
            if depth == 0 and kind == ">" and name[a][0] == only:
                depth = 1
                kept.append((kind, a))
                continue
            if depth:
                kept.append((kind, a))
                depth += 1 if kind == ">" else -1
        events = kept
    stack, walk = [], []
    for kind, a in events:
        if kind == ">":
            stack.append(a)
        elif stack:
            stack.pop()
        # the innermost frame's file; inside a backend op (kernels/), the op's: the per-element
        # math below it is one stop
        top = next((x for x in stack if name[x][1].startswith("kernels/")), None)
        top = top or (stack[-1] if stack else None)
        f = name[top][1] if top else "(caller)"
        if not walk or walk[-1][0] != f:
            walk.append((f, name[top][0] if top else ""))
    stops = [w for w in walk if w[0] != "(caller)"]
    seen, returns = set(), 0
    prev = None
    for f, _ in walk:
        if f in seen and f != prev:
            returns += f != "(caller)"
        seen.add(f)
        prev = f
    visits = collections.Counter(f for f, _ in stops)
    calls = sum(1 for k, _ in events if k == ">")
    print(f"functions entered: {calls}; stops: {len(stops)}; returns to a file already left: "
          f"{returns}; files: {len(visits)}")
    for f, n in visits.most_common():
        print(f"  {n:4d}  {f}")
    print("walk:", " -> ".join(f"{f}({fn})" for f, fn in walk))


main()
