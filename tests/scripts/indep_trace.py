#!/usr/bin/env python3
"""An independent writer of a kvtier trace (docs/trace-format.md), for needle_indep_trace_*.

It uses only the format document: `struct` and `zlib`, no kvtier code, not the library's writer
(kvt_trace_writer_*), not tests/golden/make_golden.py. What it writes is what an engine's dump
would hold, and nothing the needle generator writes: no TEXT section at all (so no provenance
lines such as the generator's `decode_calib=` or `context=`), rows and queries in chunks
interleaved as a live decode dumps them (a ROWS chunk per prefill chunk and per decode step, a
QUERIES chunk per decode step).

The content: one MLA-NoPE layer (model layer 2 of 4), bf16 rows of 512 latent + 64 branch values,
fp32 absorbed queries of 4 heads x 576. A haystack of HAY rows (the prompt), then a decode phase:
CALIB filler steps, then for each needle GAP filler steps and its query step. Each decode step
appends one row and issues one query at position = rows so far. The needle rows' latent is
4 * e_k (plus the background's noise) and their branch is the smooth background curve without
its noise, so their salience is in the bottom of their block: salience at 32x archives them and
only recall can bring them back. The needle query's targeted heads (0 and 1) have latent
60 * e_k: under full attention the needle holds almost all of their mass. Filler queries lie in
span(e_0 .. e_7).

--basis FILE also writes the recall basis file of docs/recall.md §5 (KVTRBAS1): rank 8, the
coordinate axes e_0 .. e_7 of the 512-value latent (exactly orthonormal), which hold every query's
and needle's latent direction (a basis an engine would fit; kvtier-inspect calibrate is not used).

--needle-only writes the same rows but only the needle query steps (no filler steps between
them): a trace without a decode phase, for the "recall cannot run, the others are measured" case.
"""
import argparse
import math
import random
import struct
import zlib

HAY = 2048               # haystack rows (4 blocks of 512)
CALIB = 16               # filler decode steps before the first needle's gap
GAP = 3                  # filler steps before each needle query
NEEDLE_ROWS = (614, 1433)  # depths 0.3 and 0.7
NEEDLE_AXES = (1, 5)     # each needle's latent axis
HEADS = 4
TARGET_HEADS = (0, 1)
LATENT, BRANCH = 512, 64
LAYER, N_MODEL_LAYERS = 2, 4
PROMPT_ROWS = HAY

MAGIC = b"\x89KVT\r\n\x1a\n"
SEC_END, SEC_META, SEC_LAYER, SEC_ROWS, SEC_QUERIES, SEC_NEEDLES, SEC_TARGETS = 0, 1, 3, 4, 5, 6, 7
CRITICAL = 1
MLA_NOPE, BF16, FP32 = 0, 0, 2


def crc(b):
    return zlib.crc32(b) & 0xFFFFFFFF


def file_header():
    h = MAGIC + struct.pack("<HHII", 1, 0, 1, 0)      # major 1, minor 0, kind 1 = trace, flags
    return h + struct.pack("<I", crc(h))


def section(typ, payload, flags=CRITICAL):
    h = struct.pack("<IIQI", typ, flags, len(payload), crc(payload))
    h += struct.pack("<I", crc(h))
    return h + payload + b"\0" * ((8 - len(payload) % 8) % 8)


def bf16(x):
    """fp32 -> bf16 bits, round to nearest even (finite values only)."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def rows_section(first, rows):
    vals = [bf16(v) for r in rows for v in r]
    payload = struct.pack("<IIQQ", LAYER, 0, first, len(rows)) + struct.pack("<%dH" % len(vals),
                                                                            *vals)
    return section(SEC_ROWS, payload)


def queries_section(first_step, positions, qs):
    flat = [v for q in qs for head in q for v in head]
    payload = struct.pack("<IIIIQQ", LAYER, FP32, HEADS, LATENT + BRANCH, first_step,
                          len(positions))
    payload += struct.pack("<%dQ" % len(positions), *positions)
    payload += struct.pack("<%df" % len(flat), *flat)
    return section(SEC_QUERIES, payload)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--basis")
    ap.add_argument("--needle-only", action="store_true")
    a = ap.parse_args()
    rng = random.Random(20261205)
    g = rng.gauss
    periods = [20000.0 + 1500.0 * d for d in range(BRANCH)]
    phases = [rng.uniform(0, 2 * math.pi) for _ in range(BRANCH)]

    def row(t, needle_axis=None):
        lat = [0.05 * g(0, 1) for _ in range(LATENT)]
        smooth = [0.5 * math.cos(2 * math.pi * t / periods[d] + phases[d]) for d in range(BRANCH)]
        if needle_axis is None:
            br = [smooth[d] + 0.05 * g(0, 1) for d in range(BRANCH)]
        else:
            lat[needle_axis] += 4.0
            br = smooth
        return lat + br

    def filler_head():
        w = [g(0, 1) for _ in range(8)]
        n = math.sqrt(sum(x * x for x in w))
        lat = [0.02 * g(0, 1) for _ in range(LATENT)]
        for i in range(8):
            lat[i] += 8.0 * w[i] / n
        return lat + [0.1 * g(0, 1) for _ in range(BRANCH)]

    def needle_query(axis):
        q = []
        for h in range(HEADS):
            if h in TARGET_HEADS:
                lat = [0.02 * g(0, 1) for _ in range(LATENT)]
                lat[axis] += 60.0
                q.append(lat + [0.1 * g(0, 1) for _ in range(BRANCH)])
            else:
                q.append(filler_head())
        return q

    out = [file_header(), section(SEC_META, struct.pack("<QII", PROMPT_ROWS, N_MODEL_LAYERS, 0))]
    # LAYER: the kvt_layer_spec fields in order (trace-format.md §2.2).
    out.append(section(SEC_LAYER, struct.pack("<14I", LAYER, MLA_NOPE, BF16, 1, 1,
                                              LATENT + BRANCH, LATENT, BRANCH,
                                              (LATENT + BRANCH) * 2, LATENT * 2, BF16, 0, HEADS,
                                              0)))
    needle_at = dict(zip(NEEDLE_ROWS, NEEDLE_AXES))
    for first in range(0, HAY, 512):                  # prefill: one ROWS chunk per 512 rows
        out.append(rows_section(first, [row(t, needle_at.get(t)) for t in range(first,
                                                                                first + 512)]))
    # Decode: a filler or needle query at each step; step k appends row HAY + k, then queries.
    plan = [None] * CALIB
    for i in range(len(NEEDLE_ROWS)):
        plan += [None] * GAP + [i]
    targets, step = [], 0
    for k, needle in enumerate(plan):
        t = HAY + k
        out.append(rows_section(t, [row(t)]))
        q = needle_query(NEEDLE_AXES[needle]) if needle is not None else [filler_head()
                                                                          for _ in range(HEADS)]
        if a.needle_only and needle is None:
            continue
        out.append(queries_section(step, [t + 1], [q]))
        if needle is not None:
            targets.append((step, needle))
        step += 1
    nd = struct.pack("<II", len(NEEDLE_ROWS), 0)
    for r in NEEDLE_ROWS:
        nd += struct.pack("<IIQQ", LAYER, 0, r, 1)
    out.append(section(SEC_NEEDLES, nd))
    tg = struct.pack("<II", len(targets), len(targets) * len(TARGET_HEADS))
    for i, (st, needle) in enumerate(targets):
        tg += struct.pack("<QIIII", st, needle, i * len(TARGET_HEADS), len(TARGET_HEADS), 0)
    tg += struct.pack("<%dI" % (len(targets) * len(TARGET_HEADS)),
                      *[h for _ in targets for h in TARGET_HEADS])
    out.append(section(SEC_TARGETS, tg))
    out.append(section(SEC_END, b"", flags=0))
    with open(a.out, "wb") as f:
        f.write(b"".join(out))
    if a.basis:
        rank = 8
        v = [1.0 if j == i else 0.0 for i in range(rank) for j in range(LATENT)]
        b = b"KVTRBAS1" + struct.pack("<IIIIdQ", 1, LAYER, rank, LATENT, float("nan"), 0)
        b += struct.pack("<%df" % len(v), *v)
        with open(a.basis, "wb") as f:
            f.write(b + struct.pack("<I", crc(b)))


if __name__ == "__main__":
    main()
