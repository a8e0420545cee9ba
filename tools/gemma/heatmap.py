"""Merge probe CSVs into one and draw accuracy heatmaps (depth x length, one panel per store).

    python tools/gemma/heatmap.py OUT.csv OUT.png IN.csv [IN.csv ...]

Also prints the accuracy table (markdown) the README quotes: per store and length, retrieved /
cases, and per store and depth.
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict

STORE_ORDER = ["dense", "kvtier-dense", "kvtier-evict:4", "kvtier-evict:8",
               "kvtier-recall:8:conformal:128"]


def load(paths):
    rows = []
    for p in paths:
        with open(p, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def order(stores):
    return sorted(stores, key=lambda s: (STORE_ORDER.index(s) if s in STORE_ORDER else 99, s))


def table(rows) -> str:
    stores = order({r["store"] for r in rows})
    lengths = sorted({int(r["length"]) for r in rows})
    acc = defaultdict(lambda: [0, 0])
    secs = defaultdict(float)
    for r in rows:
        a = acc[(r["store"], int(r["length"]))]
        a[0] += int(r["retrieved"])
        a[1] += 1
        secs[(r["store"], int(r["length"]))] = float(r.get("seconds") or 0)
    head = "| store | " + " | ".join(f"{L:,} tokens" for L in lengths) + " | all |"
    out = [head, "|---" * (len(lengths) + 2) + "|"]
    for s in stores:
        cells, tot = [], [0, 0]
        for L in lengths:
            k, n = acc[(s, L)]
            tot[0] += k
            tot[1] += n
            cells.append(f"{k}/{n}" if n else "—")
        out.append(f"| {s} | " + " | ".join(cells) + f" | {tot[0]}/{tot[1]} |")
    out.append("")
    out.append("prefill seconds per batch: " + "; ".join(
        f"{s} {L}: {secs[(s, L)]:.0f}" for s in stores for L in lengths if acc[(s, L)][1]))
    return "\n".join(out)


def main():
    out_csv, out_png, ins = sys.argv[1], sys.argv[2], sys.argv[3:]
    rows = load(ins)
    with open(out_csv, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        wr.writeheader()
        wr.writerows(rows)
    print(table(rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    stores = order({r["store"] for r in rows})
    lengths = sorted({int(r["length"]) for r in rows})
    depths = sorted({float(r["depth"]) for r in rows})
    fig, axes = plt.subplots(1, len(stores), figsize=(3.2 * len(stores), 3.4), squeeze=False)
    for ax, s in zip(axes[0], stores):
        k = np.zeros((len(depths), len(lengths)))
        n = np.zeros_like(k)
        for r in rows:
            if r["store"] == s:
                i, j = depths.index(float(r["depth"])), lengths.index(int(r["length"]))
                k[i, j] += int(r["retrieved"])
                n[i, j] += 1
        frac = np.where(n > 0, k / np.maximum(n, 1), np.nan)
        ax.imshow(frac, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if n[i, j]:
                    ax.text(j, i, f"{int(k[i, j])}/{int(n[i, j])}", ha="center", va="center",
                            fontsize=9)
        ax.set_xticks(range(len(lengths)), [f"{L // 1024}k" if L % 1024 == 0 else str(L)
                                            for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context (tokens)")
        ax.set_title(s, fontsize=10)
    axes[0][0].set_ylabel("depth of the fact")
    fig.suptitle("Gemma-3-270M once-stated fact, retrieved / cases", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


if __name__ == "__main__":
    main()
