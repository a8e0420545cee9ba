#!/usr/bin/env python3
"""cert_study.py — issue 34 item 0: which recall certificate would FETCH instead of overflow on a
basis fitted on other text?  A study, offline: it changes nothing in the library.

    KVTIER_LIBRARY=BUILD/libkvtier.so PYTHONPATH=python \
        python3 tools/needle/cert_study.py --basis HELDOUT.basis TRACE... [--json OUT.json]

Each TRACE is a kvtier-needle trace with a decode phase (`kvtier-needle --write-trace`, one
MLA-NoPE layer, docs/trace-format.md), read through the library (python/kvtier/trace.py). For
each trace:

1. The library's own run (`--ratio`, default 32; everything else kvtier-needle's settings:
   block 4096 and κ 16 unless `--block` / `--kappa`, 4 sinks, the trace's prompt rows
   protected, cadence 0, sketch rank 64,
   conformal recall with the basis file): the prefill in block chunks, then one step per decode
   query exactly as `tools/needle/core/run.c` drives it. From it the study takes the
   attended/archived split (kvt_seq_row_state over every position after the prefill; the
   decode phase closes no block, which is checked at the end) and, per decode step, the
   library's own certificate (recall_last_fired, _overflow, _dense, z) to compare with.
2. An offline simulation of the trigger of docs/recall.md §3–§4 on the same rows and queries:
   best_h = max exact score over the attended rows (sinks, kept, tail with the step's row),
   conformal calibration on the library's first window (8 dense steps; n >= 18 samples, z =
   the k-th smallest e, k = ceil((n+1) · 0.947), at most Z_MAX 8; candidates fitted on the
   request's queries calibrate on the 8 steps after the fit), then fire when idx + z·cert >
   best_h, union over heads; more than W (4096)
   fired rows is an overflow (the step goes dense). Every fired row is counted (the library's
   scan stops at W + 1).

Candidates (each simulated with its own idx, cert and z):
  a      today's: idx = s(q_br·r + q_sk·csk), cert = s‖q_res‖ρ/√(D−64), V = the basis file.
  u      the same with the trace's own query subspace as V (`--subspace`, one file per trace:
         kvtier-needle --write-basis), the library run again with it for the comparison.
  b<k>   a per-request KEY basis U (k rows): the top-k right singular vectors of the first closed
         block's latent residuals e⊥ = c − (cVᵀ)V (sinks left out); each row stores
         coef = fp16(e Uᵀ) (e = c − csk V, what the sketch misses) and ρ₂ = ‖e − coef U‖;
         idx₂ = idx + s(q_res Uᵀ)·coef, cert₂ = s‖q_res − (q_res Uᵀ)U‖ρ₂/√(D−64).
  c<r>   a per-request QUERY basis: the top-r eigenvectors of the centred covariance of the
         request's first 64 query latents (the first 8 decode steps × 8 heads, the library's first
         calibration window), every archived row re-sketched with it; z calibrated on the NEXT
         8 steps (a second window: the fit's own queries would give an in-sample z).
  c<r>in the same basis with z calibrated on the fit's own 8 steps (in-sample, shown to say why
         the second window is needed). c<r>q<n>[in]: fitted on the first n query latents.
  d      the held-out basis and the request's own query directions together: [V ; top-64 own
         directions orthogonalised against V] (rank 128), z on the second window as c.
         d q<n>[in] as c.
  cs, cs<r>, ds  streaming: c64 (cs<r>: rank r) or d, refitted at steps 16, 32 and 64 on every
         query latent before them, the archive re-sketched each time, z kept from steps 8–15.

Output: per candidate, per trace, counts of fired rows on needle steps and on filler steps after
calibration (median, max), overflows, needle rows fired, passes by fetch / by overflow / missed,
z, the smallest z that fires each needle and what fires with it; for `a` and `u`, the
step-by-step comparison with the library; then two markdown tables (as calibrated, and what each
fixed z of ZGRID would fire). `--json` writes every per-step record; `--table A.json[,B.json]`
prints the tables again (candidates of several runs over the same traces side by side).
tools/needle/cert_study.sh makes the data and runs the study as bench/RESULTS.md reports it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np

import kvtier
import kvtier.trace as kt

W_DEFAULT = 4096
Z_MAX = 8.0
TAU_PERMILLE = 947
MIN_SAMPLES = 18  # the library's n >= 18 before z is fixed
ZGRID = (4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, math.sqrt(448.0))  # fixed z to report


# ---------------------------------------------------------------------------------------------
# inputs

def read_basis(path):
    """A KVTRBAS1 file (docs/recall.md §5): V [rank][dim] float32."""
    b = open(path, "rb").read()
    if b[:8] != b"KVTRBAS1":
        sys.exit(f"{path}: not a recall basis file")
    _, _, r, d = struct.unpack_from("<IIII", b, 8)
    return np.frombuffer(b, dtype="<f4", count=r * d, offset=40).reshape(r, d).copy()


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def load_trace(path):
    t = kt.Trace(path)
    layer = None
    for info in t.layers():
        if info["spec"].kind == kvtier.LayerKind.MLA_NOPE:
            layer = info
            break
    if layer is None:
        sys.exit(f"{path}: no MLA-NoPE layer")
    L = layer["layer"]
    spec = layer["spec"]
    if spec.dtype != kvtier.DType.BF16:
        sys.exit(f"{path}: the study reads bf16 rows only")
    n = layer["n_tokens"]
    raw = t.read_rows(L, 0, 0, n)  # [n, 1, row_bytes]
    u16 = np.ascontiguousarray(raw).view(np.uint16).reshape(n, -1)
    rows = bf16_to_f32(u16)
    steps = layer["n_steps"]
    if steps == 0 or layer["q_dim"] != spec.value_dim + spec.branch_dim:
        sys.exit(f"{path}: layer {L} has no decode phase of absorbed queries (QUERIES steps of "
                 f"{spec.value_dim + spec.branch_dim} values)")
    qs, pos = [], []
    for k in range(steps):
        q, p = t.read_query(L, k)
        qs.append(q)
        pos.append(p)
    pos = np.array(pos, dtype=np.int64)
    if np.any(np.diff(pos) != 1):
        sys.exit(f"{path}: the query steps are not a decode phase (one step a row, "
                 "docs/trace-format.md)")
    needles = t.needles()
    targets = t.targets()
    return dict(path=path, layer=L, spec=spec, rows_bf16=u16, rows=rows,
                q=np.stack(qs).astype(np.float32), pos=pos,
                n_q_heads=layer["n_q_heads"], needles=needles, targets=targets,
                prompt_rows=t.prompt_rows)


# ---------------------------------------------------------------------------------------------
# the library's own run

def library_run(tr, basis_path, ratio, cap, block=4096, kappa=16):
    """The attended/archived split after the prefill and the library's per-step certificate."""
    spec = tr["spec"]
    spec.n_q_heads = tr["n_q_heads"]
    n = len(tr["rows"])
    decode_start = int(tr["pos"][0]) - 1
    cfg = kvtier.Config(ratio=ratio, recall="conformal", cadence_rows=0, protect_prompt=True,
                        recall_cap_rows=cap, block_rows=block, kappa=kappa)
    per = []
    with kvtier.Model([spec], "cert-study") as m, \
            kvtier.Context(m, cfg, page_rows=64, n_pages=(n + 63) // 64 + 4,
                           recall_sketch_rank=64) as ctx:
        ctx.load_recall_basis(0, basis_path)
        block = ctx.config.block_rows
        with ctx.sequence(request_id=1, prompt_rows=tr["prompt_rows"]) as seq, \
                ctx.batch(1) as b:
            done = 0
            while done < decode_start:
                k = min(block, decode_start - done)
                b.reserve([seq], [k])
                seq.write(0, 0, 0, tr["rows_bf16"][done:done + k])
                b.commit()
                done += k

            def split():
                return np.array([seq.row_state(0, 0, p)[0] == kvtier.RowState.ARCHIVED
                                 for p in range(decode_start)], dtype=bool)

            archived = split()
            for k in range(len(tr["q"])):
                b.reserve([seq], [1])
                seq.write(0, 0, 0, tr["rows_bf16"][done:done + 1])
                b.plan()
                em = b.run(0, query=tr["q"][k][None], want_dense=True)
                dense = bool(em.dense[0])
                b.commit()
                done += 1
                st = seq.layer_stats(0)
                per.append(dict(fired=int(st.recall_last_fired), dense=dense,
                                overflow=bool(st.recall_last_overflow), z=float(st.recall_z),
                                phase=int(st.recall_phase),
                                archived=int(st.recall_last_archived),
                                fetched=int(st.recall_last_fetched)))
            if not np.array_equal(split(), archived):
                sys.exit("the decode phase changed the archive (a block closed): the study "
                         "assumes one split")
    return archived, per


# ---------------------------------------------------------------------------------------------
# candidate certificates: each gives, per step, idx [archived, heads], cert [archived, heads]

def f16(x):
    return x.astype(np.float16).astype(np.float64)


class Sketch:
    """Rows sketched with basis V (rank r): csk = fp16(c Vᵀ), e = c − csk V, ρ = ‖e‖; optionally
    a second level U: coef = fp16(e Uᵀ), ρ₂ = ‖e − coef U‖ (then ρ is replaced by ρ₂)."""

    def __init__(self, C, V, U=None):
        self.V = V.astype(np.float64)
        self.csk = f16(C @ self.V.T)
        E = C - self.csk @ self.V
        self.U = None
        if U is not None:
            self.U = U.astype(np.float64)
            self.coef = f16(E @ self.U.T)
            E = E - self.coef @ self.U
        self.rho = np.sqrt(np.einsum("ij,ij->i", E, E))

    def subset(self, rows):
        """The sketch of rows `rows` only (the archived ones)."""
        out = Sketch.__new__(Sketch)
        out.V, out.U = self.V, self.U
        out.csk, out.rho = self.csk[rows], self.rho[rows]
        if self.U is not None:
            out.coef = self.coef[rows]
        return out

    def idx_cert(self, R, qlat, qbr, unit):
        """idx [rows, heads], cert [rows, heads] for queries qlat [heads, D], qbr [heads, 64]."""
        qsk = qlat @ self.V.T
        qres = qlat - qsk @ self.V
        idx = R @ qbr.T + self.csk @ qsk.T
        if self.U is not None:
            qu = qres @ self.U.T
            idx += self.coef @ qu.T
            qres = qres - qu @ self.U
        nres = np.sqrt(np.einsum("ij,ij->i", qres, qres))
        cert = self.rho[:, None] * nres[None, :] / unit
        return idx, cert


def top_eigvecs_centred(X, r):
    Xc = X - X.mean(axis=0)
    w, v = np.linalg.eigh(Xc.T @ Xc)
    return v[:, ::-1][:, :r].T.copy()


def top_right_singular(X, k):
    _, _, vt = np.linalg.svd(X, full_matrices=False)
    return vt[:k].copy()


def orth_against(A, B):
    """Rows of A orthonormalised against the orthonormal rows of B and each other."""
    A = A - (A @ B.T) @ B
    q, _ = np.linalg.qr(A.T)
    q = q.T
    q = q - (q @ B.T) @ B
    q, _ = np.linalg.qr(q.T)
    return q.T


# ---------------------------------------------------------------------------------------------
# the trigger, offline

def conformal_rank(n):
    return ((n + 1) * TAU_PERMILLE + 999) // 1000


def simulate(tr, archived, sk, cal_steps, cap):
    """One candidate over the decode phase. cal_steps = (first, n): steps first .. first + n − 1
    are calibration steps (dense; each head's best archived row gives a sample), and z is the
    order statistic of their samples at the end (n = 8 is the library's first window, which
    closes with 64 samples on these 8-head traces). Steps before `first` are dense too (a basis
    being fitted on their queries). Returns per-step records and z."""
    C, R = tr["C"], tr["R"]
    D = C.shape[1]
    unit = math.sqrt(D - 64)
    decode_start = int(tr["pos"][0]) - 1
    arch_idx = np.flatnonzero(archived)
    att_prompt = np.flatnonzero(~archived)
    Ca, Ra = C[arch_idx], R[arch_idx]
    # A candidate is one sketch, or a schedule [(from step, sketch), ...] (a streaming basis).
    sched = [(0, x.subset(arch_idx)) for x in [sk]] if isinstance(sk, Sketch) else \
        [(k0, x.subset(arch_idx)) for k0, x in sk]
    needle_rows = {}
    for i, (_, first, nr) in enumerate(tr["needles"]):
        needle_rows[i] = list(range(first, first + nr))
    step_target = {s: nd for (s, nd, _) in tr["targets"]}
    pos_in_arch = {int(p): j for j, p in enumerate(arch_idx)}
    samples = []
    z = None
    first_cal, n_cal = cal_steps
    cal_end = first_cal + n_cal
    out = []
    cal_count = 0
    for k in range(len(tr["q"])):
        P = int(tr["pos"][k])
        q = tr["q"][k].astype(np.float64)
        qlat, qbr = q[:, :D], q[:, D:]
        cache = tr.setdefault("exact", {})  # the exact scores do not depend on the candidate
        if k not in cache:
            att = np.concatenate([att_prompt, np.arange(decode_start, P)])
            cache[k] = [(C[att] @ qlat.T + R[att] @ qbr.T).max(axis=0), None]
        best = cache[k][0]
        sk_k = [x for k0, x in sched if k0 <= k][-1]
        idx, cert = sk_k.idx_cert(Ra, qlat, qbr, unit)
        rec = dict(step=k, needle=step_target.get(k, -1))
        if k < first_cal or (z is None and k < cal_end):
            rec["phase"] = "fit" if k < first_cal else "calib"
            if k >= first_cal:
                if cache[k][1] is None:
                    cache[k][1] = Ca @ qlat.T + Ra @ qbr.T
                s_arch = cache[k][1]
                a_star = s_arch.argmax(axis=0)
                h = np.arange(s_arch.shape[1])
                c = cert[a_star, h]
                ok = (c > 0) & np.isfinite(c)
                e = (s_arch[a_star, h] - idx[a_star, h])[ok] / c[ok]
                samples.extend(e.tolist())
                cal_count += 1
                if cal_count == n_cal and len(samples) >= MIN_SAMPLES:
                    srt = sorted(samples)
                    z = min(Z_MAX, srt[conformal_rank(len(srt)) - 1])
            out.append(rec)
            continue
        if z is None:
            z = Z_MAX  # provisional (not reached on these traces)
        fire = (idx + z * cert > best[None, :]).any(axis=1)
        # Row a fires at a given z iff z > tau_a = min over heads of (best_h − idx)/cert (cert
        # > 0; cert = 0: fires iff idx > best): what any fixed z would fire (ZGRID).
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (best[None, :] - idx) / cert
        t = np.where(cert > 0, t, np.where(idx > best[None, :], -np.inf, np.inf))
        tau = t.min(axis=1)
        rec_z = [int((tau < zg).sum()) for zg in ZGRID]
        n_fired = int(fire.sum())
        rec.update(phase="scan", fired=n_fired, overflow=n_fired > cap, z=z, zgrid=rec_z)
        if rec["needle"] >= 0:
            rows = needle_rows[rec["needle"]]
            js = [pos_in_arch.get(r) for r in rows]
            rec["needle_archived"] = all(j is not None for j in js)
            rec["needle_fired"] = rec["needle_archived"] and all(bool(fire[j]) for j in js)
            if rec["needle_archived"]:
                # The smallest z that fires the needle row(s), and what fires with it: row a
                # fires at z iff z > min over heads of (best_h − idx)/cert (cert > 0).
                tn = float(max(tau[j] for j in js))
                rec["z_need"] = tn
                rec["rows_at_need"] = int((tau <= tn).sum())
        out.append(rec)
    return out, z


def summarise(steps, z, cap):
    scan = [s for s in steps if s["phase"] == "scan"]
    nd = [s for s in scan if s["needle"] >= 0]
    fl = [s for s in scan if s["needle"] < 0]

    def med_max(xs):
        if not xs:
            return (0, 0)
        return (float(np.median(xs)), int(max(xs)))

    arch = [s for s in nd if s.get("needle_archived")]
    zn = [s["z_need"] for s in arch]
    return dict(
        z=z, needle_steps=len(nd), filler_steps=len(fl),
        needle_fired_med_max=med_max([s["fired"] for s in nd]),
        filler_fired_med_max=med_max([s["fired"] for s in fl]),
        needle_overflow=sum(s["overflow"] for s in nd),
        filler_overflow=sum(s["overflow"] for s in fl),
        needles_archived=len(arch),
        needle_row_fired=sum(bool(s.get("needle_fired")) for s in arch),
        pass_fetch=sum(bool(s.get("needle_fired")) and not s["overflow"] for s in arch),
        pass_overflow=sum(s["overflow"] for s in arch),
        missed=sum((not s.get("needle_fired")) and not s["overflow"] for s in arch),
        calib_steps=sum(s["phase"] != "scan" for s in steps),
        z_need_min_med_max=(min(zn), float(np.median(zn)), max(zn)) if zn else None,
        rows_at_need_med_max=med_max([s["rows_at_need"] for s in arch]),
        fetchable_at_need=sum(s["rows_at_need"] <= cap for s in arch))


def make_candidate(name, C, V, tr, D, subspace_file, block=4096):
    """(Sketch over every row, (first calibration step, calibration steps)) of a candidate:
    a | u | b<k> | c<r>[q<n>][in] | d[q<n>][in]  (q<n>: the fit's query count, 64 by default;
    in: z calibrated on the fit's own steps, else on the 8 steps after them)."""
    decode_start = int(tr["pos"][0]) - 1
    H = tr["n_q_heads"]
    if name == "a":
        return Sketch(C, V), (0, 8)
    if name == "u":
        return Sketch(C, read_basis(subspace_file)), (0, 8)
    if name.startswith("b"):
        first_block = np.arange(4, min(block, decode_start))  # sinks left out
        Eperp = C[first_block] - (C[first_block] @ V.T) @ V
        return Sketch(C, V, top_right_singular(Eperp, int(name[1:]))), (0, 8)
    if name in ("cs", "ds") or name.startswith("cs"):
        # Streaming: fitted on the first 8 steps' 64 queries, z on the next 8 (as c64 / d), then
        # refitted at the window ends 16, 32 and 64 on every query before them and the archive
        # re-sketched; z is kept, not recalibrated for the refitted basis (the fixed-z table
        # says how much z matters).
        sched = []
        for k0 in (0, 16, 32, 64):
            fit = max(8, k0)
            if fit > len(tr["q"]):
                break
            Q = tr["q"][:fit, :, :D].reshape(-1, D).astype(np.float64)
            if name.startswith("cs"):
                basis = top_eigvecs_centred(Q, int(name[2:] or 64))
            else:
                basis = np.vstack([V, orth_against(top_eigvecs_centred(Q, 64), V)])
            sched.append((0 if k0 == 0 else k0, Sketch(C, basis)))
        return sched, (8, 8)  # (fit 0-7 for every rank: rank > 63 keeps noise directions)
    insample = name.endswith("in")
    core = name[:-2] if insample else name
    nq = 64
    if "q" in core:
        core, nq = core.split("q")
        nq = int(nq)
    fit_steps = nq // H
    Q = tr["q"][:fit_steps, :, :D].reshape(-1, D).astype(np.float64)
    if core.startswith("c"):
        basis = top_eigvecs_centred(Q, int(core[1:]))
    elif core == "d":
        basis = np.vstack([V, orth_against(top_eigvecs_centred(Q, 64), V)])
    else:
        sys.exit(f"unknown candidate {name}")
    return Sketch(C, basis), ((0, fit_steps) if insample else (fit_steps, 8))


def compare(steps, lib, z):
    """The simulation against the library's own run, step by step (scan steps)."""
    cmp = dict(steps=0, overflow_equal=0, fired_equal=0, fired_absdiff_max=0,
               z_lib=lib[-1]["z"], z_sim=z, dense_lib=sum(l["dense"] for l in lib))
    for s, l in zip(steps, lib):
        if s["phase"] != "scan":
            continue
        cmp["steps"] += 1
        cmp["overflow_equal"] += s["overflow"] == l["overflow"]
        if not s["overflow"] and not l["overflow"]:
            d = abs(s["fired"] - l["fired"])
            cmp["fired_equal"] += d == 0
            cmp["fired_absdiff_max"] = max(cmp["fired_absdiff_max"], d)
        elif s["overflow"] and l["overflow"]:
            cmp["fired_equal"] += 1
    return cmp


def table(result):
    """A markdown table: one line per candidate, pooled over the traces (per-trace figures in
    brackets where they matter)."""
    traces = list(result["traces"].values())
    names = list(traces[0]["candidates"])
    lines = ["| candidate | needles: fired / by fetch / by overflow / missed (per trace) | "
             "rows fired, needle steps: median, max | rows fired, filler steps: median, max | "
             "overflow: needle / filler steps | z | smallest z firing the needle: median "
             "(min–max) | rows fired at it: median, max; needles with ≤ W |",
             "|---|---|---|---|---|---|---|---|"]
    for n in names:
        per = [t["candidates"][n] for t in traces]
        st = [x for c in per for x in c["steps"] if x["phase"] == "scan"]
        nd = [x for x in st if x["needle"] >= 0]
        fl = [x for x in st if x["needle"] < 0]
        ar = [x for x in nd if x.get("needle_archived")]
        sm = [c["summary"] for c in per]

        def mm(xs):
            return f"{np.median(xs):g}, {max(xs)}" if xs else "—"

        def tot(key):
            return sum(x[key] for x in sm)

        zs = [x["z"] for x in sm]
        zn = [x["z_need"] for x in ar]
        ra = [x["rows_at_need"] for x in ar]
        lines.append(
            f"| {n} | {tot('needle_row_fired')}/{tot('needles_archived')} / "
            f"**{tot('pass_fetch')}** ({', '.join(str(x['pass_fetch']) for x in sm)}) / "
            f"{tot('pass_overflow')} / {tot('missed')} | {mm([x['fired'] for x in nd])} | "
            f"{mm([x['fired'] for x in fl])} | {tot('needle_overflow')} of {len(nd)} / "
            f"{tot('filler_overflow')} of {len(fl)} | {min(zs):.2f}–{max(zs):.2f} | " +
            (f"{np.median(zn):.2f} ({min(zn):.2f}–{max(zn):.2f}) | "
             f"{np.median(ra):g}, {max(ra)}; {sum(r <= result['cap'] for r in ra)}/{len(ra)} |"
             if zn else "— | — |"))
    return "\n".join(lines)


def ztable(result, names):
    """What a fixed z would do (each candidate's idx and cert, z not calibrated): needles fired
    with the step under W, needle-step overflows, filler rows fired (median, max), filler
    overflows."""
    traces = list(result["traces"].values())
    cap = result["cap"]
    head = "| candidate | " + " | ".join(
        ("z = √448" if abs(zg - math.sqrt(448.0)) < 1e-9 else f"z = {zg:g}") for zg in ZGRID) + " |"
    lines = [head, "|---" * (len(ZGRID) + 1) + "|"]
    for n in names:
        if n not in traces[0]["candidates"]:
            continue
        st = [x for t in traces for x in t["candidates"][n]["steps"] if x["phase"] == "scan"]
        nd = [x for x in st if x["needle"] >= 0 and x.get("needle_archived")]
        fl = [x for x in st if x["needle"] < 0]
        cells = []
        for i, zg in enumerate(ZGRID):
            fetch = sum(x["z_need"] < zg and x["zgrid"][i] <= cap for x in nd)
            ovf = sum(x["zgrid"][i] > cap for x in nd)
            ff = [x["zgrid"][i] for x in fl] or [0]
            fo = sum(v > cap for v in ff)
            cells.append(f"{fetch}/{len(nd)}, ovf {ovf}; filler {np.median(ff):g}, {max(ff)}"
                         f"{'' if not fo else f', ovf {fo}'}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--basis", help="the held-out basis (kvtier-inspect calibrate)")
    ap.add_argument("--ratio", type=int, default=32)
    ap.add_argument("--cap", type=int, default=W_DEFAULT)
    ap.add_argument("--block", type=int, default=4096, help="block_rows (kvtier-needle --block)")
    ap.add_argument("--kappa", type=int, default=16, help="κ (kvtier-needle --kappa)")
    ap.add_argument("--json", help="write every per-step record here")
    ap.add_argument("--candidates",
                    default="a,u,b8,b16,b32,c64,c64in,c32,c64q128in,cs,d,dq128in,ds")
    ap.add_argument("--subspace", help="comma-separated basis files, one per trace: each "
                    "trace's own query subspace (kvtier-needle --write-basis), candidate u")
    ap.add_argument("--table", metavar="JSON", help="print the table of --json files (comma-separated) and stop")
    args = ap.parse_args()
    if args.table:  # several files of the same traces: their candidates side by side
        res = None
        for f in args.table.split(","):
            r = json.load(open(f))
            if res is None:
                res = r
            else:  # the same traces in the same order (paths may differ)
                mine, theirs = list(res["traces"].values()), list(r["traces"].values())
                if len(mine) != len(theirs):
                    sys.exit(f"--table: {f} holds {len(theirs)} traces, not {len(mine)}")
                for a, b in zip(mine, theirs):
                    a["candidates"].update(b["candidates"])
        print(table(res))
        print()
        print(ztable(res, list(next(iter(res["traces"].values()))["candidates"])))
        return
    if not args.traces or not args.basis:
        sys.exit("give traces and --basis (or --table JSON)")
    V = read_basis(args.basis).astype(np.float64)
    cands = args.candidates.split(",")
    subspace = {}
    if args.subspace:
        files = args.subspace.split(",")
        if len(files) != len(args.traces):
            sys.exit("--subspace: one file per trace")
        subspace = dict(zip(args.traces, files))
    elif "u" in cands:
        cands.remove("u")
    result = {"basis": args.basis, "ratio": args.ratio, "cap": args.cap, "traces": {}}
    for path in args.traces:
        t0 = time.time()
        tr = load_trace(path)
        D = tr["spec"].value_dim
        tr["C"] = tr["rows"][:, :D].astype(np.float64)
        tr["R"] = tr["rows"][:, D:].astype(np.float64)
        if V.shape[1] != D:
            sys.exit(f"{args.basis}: dim {V.shape[1]}, the trace's latent has {D}")
        archived, lib = library_run(tr, args.basis, args.ratio, args.cap, args.block,
                                    args.kappa)
        if not archived.any():
            sys.exit(f"{path}: nothing is archived at ratio {args.ratio}: no trigger to study")
        decode_start = int(tr["pos"][0]) - 1
        print(f"# {path}: {len(tr['rows'])} rows, decode from {decode_start}, "
              f"{len(tr['q'])} decode steps, {int(archived.sum())} archived, "
              f"library run {time.time() - t0:.0f} s", file=sys.stderr)
        C = tr["C"]
        per_trace = {"library": lib, "candidates": {}}
        for name in cands:
            sk, cal = make_candidate(name, C, V, tr, D, subspace.get(path), args.block)
            steps, z = simulate(tr, archived, sk, cal, args.cap)
            per_trace["candidates"][name] = {"steps": steps, "summary": summarise(steps, z, args.cap)}
            if name == "a":  # step-by-step against the library
                per_trace["compare_a_library"] = compare(steps, lib, z)
            if name == "u":
                _, lib_u = library_run(tr, subspace[path], args.ratio, args.cap, args.block,
                                       args.kappa)
                per_trace["library_u"] = lib_u
                per_trace["compare_u_library"] = compare(steps, lib_u, z)
            print(f"{os.path.basename(path)} {name}: {per_trace['candidates'][name]['summary']}",
                  flush=True)
        for k in ("compare_a_library", "compare_u_library"):
            if k in per_trace:
                print(f"{os.path.basename(path)} {k}: {per_trace[k]}", flush=True)
        result["traces"][path] = per_trace
        del tr
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    print()
    print(ztable(result, cands))


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, json.JSONDecodeError, kvtier.KvtError) as e:
        sys.exit(f"cert_study: {type(e).__name__}: {e}")
