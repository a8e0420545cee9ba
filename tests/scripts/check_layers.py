#!/usr/bin/env python3
"""Check that #include "..." lines and calls point down the layers of kvtier (DESIGN §3):

    base (lib/base) <- kernels (and recall/kernels) <- tiers <- recall <- lib <- tools, bench

recall/kernels/ (with recall/kernels/cuda/) is a sub-layer of recall/ at the kernels rank, as lib/base/
is a sub-layer of lib/ at rank 0: recall's per-element math, CPU twins and CUDA bodies, which the
backend tables of kernels/ call, so it may include kernels/ and base only, never recall/ itself.
Includes: a file may include its own layer and any layer below it. tools/ and bench/ may include
only the public headers (lib/kvtier*.h) and files of their own folder; bench/kernels/
(microbenchmarks of a kernel's CPU twin) may also include kernels/ and lib/base. The public headers
are declarations every layer may read. A header named *_internal.h is private to its folder: only
files in that folder (or below it) include it (tiers/tiers_internal.h, the policies' states,
which lib/ holds as opaque storage). tests/ is white-box and not checked.

Calls (with --objects): a public header declares functions of every layer, so the include rule
cannot see a tier calling a function defined in lib/ (kvt_dtype_bytes was, in lib/model.c). The
object files of the library are read with nm: a symbol an object of one layer references (U) and
an object of a higher layer defines fails, whatever header declared it. Each object is mapped to
its source by the longest suffix of its path (CMakeFiles/<target>.dir/lib/batch.c.o ->
lib/batch.c) that is a source file under ROOT. lib/'s files call one another without a cycle: a
file calling another that calls it back, directly or not, fails (each cycle one line, its files
and the calls of each edge).

Usage: check_layers.py ROOT [--objects LIST --nm NM] [--graph]; LIST names the object files, one
a line; --graph also prints lib/'s file-level call graph (one line per edge, with the functions
called). Exit 1 and one line per violation when any include or call crosses a layer the wrong
way, a private header is included from outside its folder, or lib/'s files call in a cycle."""
import argparse
import os
import re
import subprocess
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
    if parts[0] == "recall" and len(parts) > 2 and parts[1] == "kernels":
        return "kernels"
    return parts[0] if parts[0] in ("kernels", "tiers", "recall", "tools", "bench") else None


def label(rel, layer):
    """How a message names a file's layer: a sub-layer by its folder."""
    return "recall/kernels" if rel.startswith("recall/kernels/") else layer


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


def check_includes(root, bad):
    n_files, n_inc = 0, 0
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
                        if tgt.endswith("_internal.h"):
                            home = os.path.dirname(tgt)
                            if not (src.startswith(home + "/") or src == tgt):
                                bad.append(f"{src}:{ln}: includes {tgt}, private to {home}/ "
                                           f"(a *_internal.h header is its folder's own)")
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
                            bad.append(f"{src}:{ln}: {label(src, sl)} includes {tgt} ({tl}): "
                                       f"imports point down only (base <- kernels, "
                                       f"recall/kernels <- tiers <- recall <- lib)")
    return n_files, n_inc


def source_of(root, obj):
    """The source under root an object file was compiled from: the longest suffix of its path,
    less the object extension, that names a file there."""
    path = obj.replace(os.sep, "/")
    for ext in (".o", ".obj"):
        if path.endswith(ext):
            path = path[: -len(ext)]
            break
    parts = path.split("/")
    for k in range(len(parts)):
        rel = "/".join(parts[k:])
        if rel and os.path.isfile(os.path.join(root, rel)):
            return rel
    return None


def lib_cycles(edges):
    """Strongly connected components of more than one file (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def check_calls(root, list_file, nm, bad, graph):
    with open(list_file, encoding="utf-8") as fh:
        objs = [l.strip() for l in fh.read().replace(";", "\n").splitlines() if l.strip()]
    if not objs:
        bad.append(f"{list_file}: no object files listed")
        return 0, 0
    missing = [o for o in objs if not os.path.isfile(o)]
    if missing:
        bad.append(f"{missing[0]}: object file missing (build the library before this check)")
        return 0, 0
    src = {}
    for o in objs:
        rel = source_of(root, o)
        if rel is None or layer_of(rel) not in RANK:
            bad.append(f"{o}: no source of a library layer under {root} matches this object")
            return 0, 0
        src[o] = rel
    # One nm for every object: -A prefixes each line with the object's path, -P is POSIX's
    # "name type [value size]" format.
    res = subprocess.run([nm, "-A", "-P"] + objs, capture_output=True, text=True)
    if res.returncode != 0:
        bad.append(f"{nm}: {res.stderr.strip()}")
        return 0, 0
    defined, refs = {}, []
    for line in res.stdout.splitlines():
        head, _, rest = line.rpartition(": ")
        fields = rest.split()
        if len(fields) < 2:
            continue
        name, kind = fields[0], fields[1]
        obj = head[:-1] if head.endswith(":") else head
        # An archive member would read "lib.a[x.o]"; the list names object files only.
        if obj not in src:
            continue
        if kind == "U":
            refs.append((src[obj], name))
        elif kind.isupper() and kind not in ("U", "N"):  # a global definition
            defined.setdefault(name, src[obj])
    edges, calls = {}, {}
    for user, name in refs:
        owner = defined.get(name)
        if owner is None or owner == user:
            continue
        ul, ol = layer_of(user), layer_of(owner)
        if RANK[ol] > RANK[ul]:
            bad.append(f"{user}: {label(user, ul)} calls {name}, defined in {owner} ({ol}): calls "
                       f"point down only (base <- kernels, recall/kernels <- tiers <- recall <- lib)")
        if ul == "lib" and ol == "lib":
            edges.setdefault(user, set()).add(owner)
            calls.setdefault((user, owner), set()).add(name)
    for comp in lib_cycles(edges):
        inside = [f"{u} -> {o} ({', '.join(sorted(calls[(u, o)]))})"
                  for u in comp for o in sorted(edges.get(u, ())) if o in comp]
        bad.append("lib/ call cycle among " + ", ".join(comp) + ": " + "; ".join(inside) +
                   ": lib/'s files call one another in one direction (move the function that "
                   "closes the cycle to the file above both)")
    for (u, o) in sorted(calls):
        graph.append(f"{u} -> {o}: {', '.join(sorted(calls[(u, o)]))}")
    return len(objs), len(refs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?", default=".")
    ap.add_argument("--objects", help="file listing the library's object files, one a line")
    ap.add_argument("--nm", default="nm")
    ap.add_argument("--graph", action="store_true",
                    help="print lib/'s file-level call graph (with --objects)")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    bad, graph = [], []
    n_files, n_inc = check_includes(root, bad)
    n_inc_bad = len(bad)
    summary = f"check_layers: {n_files} files, {n_inc} includes, {n_inc_bad} crossing the wrong way"
    if args.objects:
        n_obj, n_ref = check_calls(root, args.objects, args.nm, bad, graph)
        n_cyc = sum(b.startswith("lib/ call cycle") for b in bad)
        summary += (f"; {n_obj} objects, {n_ref} references, {len(bad) - n_inc_bad - n_cyc} "
                    f"calls crossing the wrong way, {n_cyc} lib/ call cycles")
    for b in bad:
        print(b)
    if args.graph:
        for g in graph:
            print("graph: " + g)
    print(summary)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
