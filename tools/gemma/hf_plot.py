"""The bar chart of hf_probe.py's table: facts retrieved per method at each ratio.

    python tools/gemma/hf_plot.py [results/hf_fact_table.csv] [results/hf_fact.png]
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LABELS = {"kvtier-evict": "kvtier random eviction", "kvtier-recall": "kvtier + archive + recall",
          "streaming": "StreamingLLM", "snapkv": "SnapKV", "knorm": "Knorm",
          "expected": "ExpectedAttention"}


def main():
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "hf_fact_table.csv"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "results" / "hf_fact.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(src.open()))
    dense = [r for r in rows if r["method"] == "dense"]
    ratios = sorted({int(r["ratio"]) for r in rows if int(r["ratio"]) > 1})
    methods = [m for m in LABELS if any(r["method"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    width = 0.8 / max(1, len(ratios))
    for j, ratio in enumerate(ratios):
        vals = []
        for m in methods:
            sel = [r for r in rows if r["method"] == m and int(r["ratio"]) == ratio]
            vals.append(int(sel[0]["retrieved"]) if sel else 0)
        xs = [i + (j - (len(ratios) - 1) / 2) * width for i in range(len(methods))]
        ax.bar(xs, vals, width, label=f"{ratio}x")
    if dense:
        ax.axhline(int(dense[0]["retrieved"]), color="k", ls="--", lw=1,
                   label=f"dense ({dense[0]['retrieved']}/{dense[0]['cases']})")
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels([LABELS[m] for m in methods], rotation=15, fontsize=8)
    n = int(rows[0]["cases"])
    ax.set_ylim(0, n * 1.35)
    ax.set_ylabel(f"facts retrieved of {n}")
    ax.set_title(f"Gemma-3-270M, a fact stated once in {rows[0]['length']} tokens "
                 "(transformers, CPU)", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
