#!/usr/bin/env python3
"""make_api_seeds.py — writes the fuzz_api seed corpus: byte programs in fuzz_api.c's encoding
(a context header, then one opcode byte per call with its argument bytes) for a prefill and a
decode loop that reaches block closes and eviction rounds, speculative steps with drafts and
per-token emission, pool exhaustion, archived eviction with limits, snapshots, and the paged
emission.
Usage: make_api_seeds.py DIR"""
import sys

CREATE, DESTROY, RESERVE, WRITE, PLAN, RUN, COMMIT, RECREATE, PROMPT, INSPECT = range(10)
SNAPSHOT = 13


def header(window=20, block128=0, kappa=4, ratio=4, sink=2, K=16, recent=4, cadence=4,
           flags=0, seed=1, page_rows=4, n_pages=40, more=0, max_rows=None, archive=None):
    b = [window - 1, block128, kappa - 1, ratio - 1, sink, K - 1, recent, cadence, flags, seed,
         page_rows - 1, n_pages - 1, more]
    if max_rows is not None:  # fuzz_range over more than 256 values reads 16 bits
        b += [(max_rows - 1) & 0xff, (max_rows - 1) >> 8]
    if archive is not None:
        b += [archive - 1]
    return b


def step(toks, batch=0, drafts=None, runs=((0, 0), (1, 1), (2, 0), (3, 1)), acc=None, wmode=2,
         how=None, big=False):
    mask = sum(1 << i for i in range(len(toks)))
    b = [RESERVE, batch, mask, (1 if drafts else 0) | (6 if big else 0)]  # big: up to 160
    for i, t in enumerate(toks):
        b.append(t)
        if drafts:
            b.append(drafts[i])
    b += [WRITE, batch, wmode, PLAN, batch]
    if how is not None:  # plan's own byte (else the first RUN byte serves as it)
        b.append(how)
    for layer, mode in runs:
        b += [RUN, batch, layer, mode]
    if acc is None:
        b += [COMMIT, batch, 1]
    else:
        b += [COMMIT, batch, 0] + acc
    return b


def seeds():
    two = [CREATE, 0, 7, 20, 0, CREATE, 1, 8, 0, 0]
    s = header() + two + step([60, 40])
    for _ in range(30):
        s += step([1, 1])
    s += [INSPECT, 0, 0, 0, 3, 0, 100, 0, INSPECT, 1, 2, 1, 10, 0, 50, 0]
    yield "decode", s
    # the ablation selectors (branch norm; row norm with archived eviction), then every
    # inspection call at positions across the request
    for name, flags in (("branch_norm", 0x10), ("row_norm_archive", 0x20 | 2)):
        s = header(flags=flags, ratio=2, K=8) + two + step([70, 50])
        for _ in range(8):
            s += step([8, 8])
        for pos in range(0, 140, 7):
            s += [INSPECT, pos % 2, pos % 5, pos % 3, pos, 0, 150, 0]
        yield name, s
    # drafts: 4 tokens of which 3 drafts, one query per token (mode 0x08), 2 accepted
    s = header(ratio=2, K=8, recent=2, cadence=2) + two + step([30, 30])
    for i in range(12):
        s += step([4, 1], drafts=[3, 0], runs=((0, 0x08), (1, 0x09), (3, 0x08)), acc=[i % 4, 0])
    yield "drafts", s
    # a pool of 3 one-row pages: exhaustion, then a destroy frees the pages
    s = header(page_rows=1, n_pages=3) + two + step([2, 1]) + step([2, 2]) + [DESTROY, 0]
    s += step([0, 1])
    yield "exhaust", s
    # archived eviction with VaSE, a row limit and an archive limit; raw (NaN) rows; CSR
    s = header(flags=2 | 8, more=3, max_rows=300, archive=40, K=8) + two
    for _ in range(20):
        s += step([6, 3], runs=((1, 1), (2, 1), (0, 0x31)), wmode=1)
    yield "archive", s
    # snapshots between steps: restored into a free slot, in place, with a byte flipped, cut
    # short, into a buffer one byte short; refused inside a step
    s = header(flags=2, K=8) + two
    for i in range(24):
        s += step([5, 2])
        s += [SNAPSHOT, i % 2, [0, 4, 1 | 0x30, 2, 8][i % 5], (i * 37) & 0xff, i & 3]
        s += [DESTROY, 2, DESTROY, 3]
    s += [RESERVE, 0, 1, 0, 2, SNAPSHOT, 0, 0, 0, 0, COMMIT, 0, 1]
    yield "snapshot", s
    # FlashInfer's paged layout (run mode 0x21) on every layer, after kvt_batch_emit_fits: a
    # prefill with per-token lists (0x29), then decode steps past closes and rounds, each layer
    # also emitting TOKENS from a second run; then steps planned on the device with a PAGED
    # emission (plan byte 0x81), their runs passing it (0xa1) where the step was plannable
    paged = tuple((layer, m) for layer in range(5) for m in (0x21, 0))
    s = header(K=8) + two + step([61, 40], runs=tuple((layer, 0x29) for layer in range(5)),
                                 how=0, big=True)
    for _ in range(6):  # request 0 closes its first block at 64 rows
        s += step([1, 1], runs=paged, how=0)
    for _ in range(12):
        s += step([1, 1], runs=tuple((layer, 0xa1) for layer in range(4)), how=0x81)
    yield "paged", s


if __name__ == "__main__":
    for name, s in seeds():
        with open(f"{sys.argv[1]}/{name}.bin", "wb") as f:
            f.write(bytes(b & 0xff for b in s))
