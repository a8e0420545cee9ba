#!/usr/bin/env python3
"""Check that #include "..." lines point down the layers of kvtier (DESIGN §3):

    base (lib/base) <- kernels <- tiers <- recall <- lib <- tools, bench

A file may include its own layer and any layer below it. tools/ and bench/ may include only the
public headers (lib/kvtier*.h) and files of their own folder; bench/kernels/ (microbenchmarks of a
kernel's CPU twin) may also include kernels/ and lib/base. The public headers are declarations
every layer may read. tests/ is white-box and not checked. Usage: check_layers.py ROOT; exit 1 and
one line per violation when any include crosses a layer the wrong way."""
import os
import re
import sys

RANK = {"base": 0, "kernels": 1, "tiers": 2, "recall": 3, "lib": 4}
SRC_EXT = (".c", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(rel):
    parts = rel.split("/")
    if parts[0] == "lib":
        if len(parts) > 1 and parts[1] == "base":
            return "base"
        if len(parts) == 2 and re.fullmatch(r"kvtier(_[a-z0-9]+)?\.h", parts[1]):
            return "public"
        return "lib"
    return parts[0] if parts[0] in ("kernels", "tiers", "recall", "tools", "bench") else None


def resolve(root, src_rel, target):
    cands = [target, os.path.normpath(os.path.join(os.path.dirname(src_rel), target)),
             os.path.join("lib", target)]
    for c in cands:
        if os.path.isfile(os.path.join(root, c)):
            return c.replace(os.sep, "/")
    # A tool's own include directories (its CMake target adds them): a file of that name
    # anywhere under the tool's folder.
    top = src_rel.split("/")[0]
    if top in ("tools", "bench"):
        tool_dir = "/".join(src_rel.split("/")[:2])
        for dirpath, _, files in os.walk(os.path.join(root, tool_dir)):
            c = os.path.relpath(os.path.join(dirpath, target), root)
            if os.path.isfile(os.path.join(root, c)):
                return c.replace(os.sep, "/")
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    bad, n_files, n_inc = [], 0, 0
    for top in ("lib", "kernels", "tiers", "recall", "tools", "bench"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(SRC_EXT):
                    continue
                src = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                src_layer = layer_of(src)
                n_files += 1
                with open(os.path.join(root, src), encoding="utf-8", errors="replace") as fh:
                    for ln, line in enumerate(fh, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        n_inc += 1
                        tgt = resolve(root, src, m.group(1))
                        if tgt is None:
                            bad.append(f"{src}:{ln}: cannot resolve \"{m.group(1)}\"")
                            continue
                        tl = layer_of(tgt)
                        if tl == "public":
                            continue
                        if src_layer in ("tools", "bench"):
                            twin = src.startswith("bench/kernels/") and tl in ("kernels", "base")
                            if tgt.split("/")[0] != src_layer and not twin:
                                bad.append(f"{src}:{ln}: {src_layer}/ includes {tgt}: only public "
                                           f"headers (lib/kvtier*.h) and its own folder")
                            continue
                        sl = "lib" if src_layer == "public" else src_layer
                        if tl not in RANK or RANK[tl] > RANK[sl]:
                            bad.append(f"{src}:{ln}: {sl} includes {tgt} ({tl}): imports point "
                                       f"down only (base <- kernels <- tiers <- recall <- lib)")
    for b in bad:
        print(b)
    print(f"check_layers: {n_files} files, {n_inc} includes, {len(bad)} crossing the wrong way")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
