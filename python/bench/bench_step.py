"""The Python cost of a decode step: the kvtier package beside raw ctypes making the same C calls.

A step, as an engine's decode loop makes it: ``reserve`` (every request, one token), one
``slot_mapping`` (the model's layers share one policy group), ``plan``, ``run`` of every layer
into a fixed TOKENS emission (``Batch.emission``), ``commit``. "raw" makes exactly those C calls
(kvt_batch_reserve, kvt_batch_slot_mapping, kvt_batch_plan, kvt_batch_run per layer,
kvt_batch_commit) through ctypes with every argument built once, so raw's time is the C work plus
ctypes' own call cost; the package's time minus raw's is what the binding adds. The model: the
layers of Llama-3.1-8B (GQA-RoPE, 8 KV heads x 128, bf16; random eviction), 1 of them or all 32;
4 requests with a 64-token prompt (the prompt step is not timed), then ``--warm`` steps and
``--steps`` timed ones; a run's figure is the median step. Runs alternate package / raw in one
process, ``--runs`` of each (each on a fresh context), and the report gives each figure's range
over the runs.

    KVTIER_LIBRARY=build/libkvtier.so PYTHONPATH=python python3 python/bench/bench_step.py

``--package DIR`` imports kvtier from DIR instead (e.g. an older version of python/, to compare).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

REQUESTS = 4
PROMPT = 64
PAGE_ROWS = 16


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--package", type=Path, default=None,
                    help="import kvtier from this folder (default: as installed / PYTHONPATH)")
    return ap.parse_args()


def setup(kvtier, n_layers: int, steps: int):
    spec = kvtier.LayerSpec.gqa(kvtier.LayerKind.GQA_ROPE, kvtier.DType.BF16, 8, 128)
    model = kvtier.Model([spec] * n_layers, "llama-3.1-8b-layers")
    rows = PROMPT + steps
    pages = REQUESTS * ((rows + PAGE_ROWS - 1) // PAGE_ROWS + 1) + 4
    ctx = kvtier.Context(model, page_rows=PAGE_ROWS, n_pages=pages)
    seqs = [ctx.sequence(request_id=i + 1, prompt_rows=PROMPT) for i in range(REQUESTS)]
    batch = ctx.batch(REQUESTS)
    emit = batch.emission("tokens", rows + 16)
    batch.reserve(seqs, PROMPT)  # the prompt step (not timed)
    batch.plan()
    for layer in range(n_layers):
        batch.run(layer, emission=emit)
    batch.commit()
    return model, ctx, seqs, batch, emit


def package_steps(kvtier, n_layers, warm, steps):
    model, ctx, seqs, batch, emit = setup(kvtier, n_layers, warm + steps)
    slots = __import__("numpy").empty(REQUESTS, dtype="int32")
    times = []
    clock = time.perf_counter_ns
    for step in range(warm + steps):
        t0 = clock()
        batch.reserve(seqs, 1)
        batch.slot_mapping(0, out=slots)
        batch.plan()
        for layer in range(n_layers):
            batch.run(layer, emission=emit)
        batch.commit()
        times.append(clock() - t0)
    for x in (batch, *seqs, ctx, model):
        x.close()
    return times[warm:]


def raw_steps(kvtier, n_layers, warm, steps):
    import numpy as np
    lib = kvtier._lib.lib
    model, ctx, seqs, batch, emit = setup(kvtier, n_layers, warm + steps)
    # every argument built once: the floor of a ctypes binding
    bp = ctypes.c_void_p(batch._h.ptr)
    arr_s = (ctypes.c_void_p * REQUESTS)(*[s._h.ptr for s in seqs])
    ones = (ctypes.c_uint32 * REQUESTS)(*[1] * REQUESTS)
    slots = np.empty(REQUESTS, dtype=np.int32)
    slots_p = slots.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    n = ctypes.c_uint32()
    n_ref = ctypes.byref(n)
    e = kvtier._lib.EmitC()
    e.struct_size = ctypes.sizeof(kvtier._lib.EmitC)
    e.layout = 0
    e.indices = emit.indices.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    e.capacity = emit.indices.shape[1]
    e.lengths = emit.lengths.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    e.queries_per_seq = 1
    e_ref = ctypes.byref(e)
    reserve, slot_mapping, plan = lib.kvt_batch_reserve, lib.kvt_batch_slot_mapping, \
        lib.kvt_batch_plan
    run, commit = lib.kvt_batch_run, lib.kvt_batch_commit
    times = []
    clock = time.perf_counter_ns
    for step in range(warm + steps):
        t0 = clock()
        rc = reserve(bp, arr_s, ones, REQUESTS)
        rc |= slot_mapping(bp, 0, slots_p, REQUESTS, n_ref)
        rc |= plan(bp)
        for layer in range(n_layers):
            rc |= run(bp, layer, None, None, e_ref)
        rc |= commit(bp, None)
        times.append(clock() - t0)
        if rc:
            raise RuntimeError(f"raw step {step}: a call failed: {kvtier.last_error()}")
    for x in (batch, *seqs, ctx, model):
        x.close()
    return times[warm:]


def main():
    args = parse()
    if args.package is not None:
        sys.path.insert(0, str(args.package.resolve()))
    import kvtier
    print(f"kvtier {kvtier.__version__} from {Path(kvtier.__file__).parent} "
          f"(library {kvtier.library_path}); python {sys.version.split()[0]}")
    print(f"{REQUESTS} requests, {args.warm} warm-up + {args.steps} timed decode steps a run, "
          f"{args.runs} runs each, median step per run; ranges over the runs\n")
    print("| layers | package µs/step | raw ctypes µs/step | package − raw, µs/step | "
          "package − raw, µs per layer |")
    print("|---|---|---|---|---|")
    for n_layers in args.layers:
        pk, rw = [], []
        for _ in range(args.runs):
            pk.append(statistics.median(package_steps(kvtier, n_layers, args.warm,
                                                      args.steps)) / 1e3)
            rw.append(statistics.median(raw_steps(kvtier, n_layers, args.warm,
                                                  args.steps)) / 1e3)
        diff = [p - r for p, r in zip(pk, rw)]

        def rng(xs, scale=1.0):
            return f"{min(xs) / scale:.1f}–{max(xs) / scale:.1f}"
        print(f"| {n_layers} | {rng(pk)} | {rng(rw)} | {rng(diff)} | {rng(diff, n_layers)} |",
              flush=True)


if __name__ == "__main__":
    main()
