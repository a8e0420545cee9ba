#!/usr/bin/env python3
"""Write an MLA-NoPE bf16 trace with a decode phase the way an engine's own dumper would, from
docs/trace-format.md alone (the container helpers of tests/golden/make_golden.py, which use only
struct and zlib; not the library's writer): a haystack of H rows, then D decode steps, each
appending one row and issuing its query at position H + k + 1; N needles (rows whose latent
points along a random direction) each asked for by one decode step whose query points the same
way. No TEXT section unless --provenance is given (then the lines the needle generator writes),
so a reader cannot lean on provenance to find the decode phase.

usage: decode_trace.py OUT.kvtt [--provenance] [--seed S] [--haystack H] [--decode D]
"""
import argparse
import os
import random
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden"))
import make_golden as g  # noqa: E402

LAYER, HEADS, LATENT, BRANCH = 2, 4, 512, 64
DIM = LATENT + BRANCH


def bf16(x):
    """Round-to-nearest-even fp32 -> bf16 bytes (finite inputs only)."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return struct.pack("<H", u)


def unit(rng, n):
    v = [rng.gauss(0.0, 1.0) for _ in range(n)]
    s = sum(x * x for x in v) ** 0.5
    return [x / s for x in v]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--provenance", action="store_true")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--haystack", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=96)
    ap.add_argument("--needles", type=int, default=3)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    H, D = a.haystack, a.decode
    n_rows = H + D
    # needles at depths spread over the haystack, asked for in the second half of the decode phase
    dirs = [unit(rng, DIM) for _ in range(a.needles)]
    needle_rows = [int(H * (k + 1) / (a.needles + 1)) for k in range(a.needles)]
    ask_steps = [D // 2 + k * (D // (2 * a.needles)) for k in range(a.needles)]
    rows = bytearray()
    for r in range(n_rows):
        if r in needle_rows:
            v = [4.0 * x for x in dirs[needle_rows.index(r)]]
        else:
            v = [rng.gauss(0.0, 0.25) for _ in range(DIM)]
        rows += b"".join(bf16(x) for x in v)
    positions = [H + k + 1 for k in range(D)]
    q = bytearray()
    for k in range(D):
        for h in range(HEADS):
            if k in ask_steps:
                d = dirs[ask_steps.index(k)]
                v = [6.0 * x + rng.gauss(0.0, 0.05) for x in d]
            else:
                v = [rng.gauss(0.0, 0.25) for _ in range(DIM)]
            q += struct.pack("<%df" % DIM, *v)
    s = [g.meta(0, 4)]
    if a.provenance:
        s.append(g.text("generator=kvtier-needle\ncontext=%d\ndecode_calib=16\n" % H))
    s.append(g.layer(LAYER, g.MLA_NOPE, g.BF16, 1, 1, DIM, LATENT, BRANCH, 2 * DIM, 2 * LATENT,
                     g.BF16, 0, HEADS))
    tb = 2 * DIM
    for first in range(0, n_rows, 1000):  # chunks, as a live dump would come
        n = min(1000, n_rows - first)
        s.append(g.section(g.SEC_ROWS, struct.pack("<IIQQ", LAYER, 0, first, n) +
                           bytes(rows[first * tb:(first + n) * tb])))
    s.append(g.section(g.SEC_QUERIES, struct.pack("<IIIIQQ", LAYER, 2, HEADS, DIM, 0, D) +
                       struct.pack("<%dQ" % D, *positions) + bytes(q)))
    s.append(g.needles([(LAYER, r, 1) for r in needle_rows]))
    s.append(g.targets([(ask_steps[k], k, list(range(HEADS))) for k in range(a.needles)]))
    with open(a.out, "wb") as f:
        f.write(g.file_header() + b"".join(s) + g.end())


if __name__ == "__main__":
    main()
