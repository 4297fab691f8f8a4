#!/usr/bin/env python3
"""Perplexity (GPL-3 text, ctx 256) against whole-file bits per weight, every
row of tests/data/quality/calibrated.json (tools/fidelity_eval.py) a labelled
point; the dense model's and llama.cpp's Q4_K_M perplexities as horizontal
reference lines. Writes docs/quality-ppl-bpw.png.

    tools/quality_plot.py [--data JSON] [--out PNG]

Needs matplotlib MATPLOTLIB (pinned below); when this python3 lacks that
version, the script reruns itself in rknot's Python environment
(tools/python-env.sh), installing it there.

Groups (colour and marker) come from a row's "group" when it has one, else
from the file: the dense reference, llama.cpp GGUFs without and with an
importance matrix (llama_peers.sh names those *.imatrix.gguf), rknot files.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATPLOTLIB = "3.11.2"
NUMPY = "2.4.6"
REFERENCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_matplotlib():
    try:
        import matplotlib

        if matplotlib.__version__ == MATPLOTLIB:
            return
    except ImportError:
        pass
    if os.environ.get("RKNOT_QUALITY_PLOT_REEXEC"):
        sys.exit(f"quality_plot: matplotlib {MATPLOTLIB} is still missing in {sys.executable}")
    script = (f'. tools/python-env.sh && rknot_python_env matplotlib=={MATPLOTLIB} numpy=={NUMPY} '
              f'&& exec python3 "$@"')
    env = dict(os.environ, RKNOT_QUALITY_PLOT_REEXEC="1")
    sys.exit(subprocess.call(["bash", "-c", script, "bash", str(Path(__file__).resolve()), *sys.argv[1:]],
                             cwd=ROOT, env=env))


# group -> (colour, marker, legend text), in legend order.
GROUPS = {
    "dense": ("black", "*", "dense (the Q4_1 GGUF)"),
    "llama.cpp": ("#888888", "o", "llama.cpp llama-quantize"),
    "llama.cpp+imatrix": ("#1f77b4", "s", "llama.cpp llama-quantize --imatrix"),
    "rknot": ("#d62728", "D", "rknot"),
    "rknot calibrated": ("#2ca02c", "^", "rknot, calibrated"),
}


def group_of(row):
    if row.get("group"):
        return row["group"]
    if row["file"] == REFERENCE_FILE and not row.get("dense"):
        return "dense"
    if row["format"] == "gguf":
        return "llama.cpp+imatrix" if ".imatrix." in row["file"] else "llama.cpp"
    return "rknot calibrated" if "calib" in row["label"].lower() else "rknot"


def place_labels(fig, ax, points, texts):
    """Put each label at the one of 24 offsets around its point that
    overlaps least (in display space) with the labels already placed, the
    points and the axes' edge: readable without a layout package."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axbox = ax.get_window_extent(renderer)
    pts = [ax.transData.transform(p) for p in points]
    near = [(6, 4), (6, -10), (-6, 4), (-6, -10), (0, 9), (0, -14), (10, -3), (-10, -3)]
    # Farther out, with a leader line (drawn for every label, hidden by the
    # marker when the label is near), when the near places are taken.
    offsets = near + [(3 * dx, 3 * dy) for dx, dy in near] + [(5 * dx, 5 * dy) for dx, dy in near]
    placed = []

    def overlap(a, b):
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        return w * h if w > 0 and h > 0 else 0.0

    # Labels of points crowded to the left first, so they pick before their
    # neighbours take the space.
    for i in sorted(range(len(texts)), key=lambda i: pts[i][0]):
        t = texts[i]
        best = None
        for dx, dy in offsets:
            t.set_position((dx, dy))
            t.set_horizontalalignment("left" if dx > 0 else "right" if dx < 0 else "center")
            bb = t.get_window_extent(renderer).expanded(1.05, 1.15)
            cost = sum(overlap(bb, p) for p in placed) + 0.5 * (abs(dx) + abs(dy))
            cost += sum(1e3 for (px, py) in pts if bb.x0 < px < bb.x1 and bb.y0 < py < bb.y1)
            outside = (max(0, axbox.x0 - bb.x0) + max(0, bb.x1 - axbox.x1)
                       + max(0, axbox.y0 - bb.y0) + max(0, bb.y1 - axbox.y1))
            cost += outside * 1e3
            if best is None or cost < best[0]:
                best = (cost, dx, dy, bb)
        _, dx, dy, bb = best
        t.set_position((dx, dy))
        t.set_horizontalalignment("left" if dx > 0 else "right" if dx < 0 else "center")
        placed.append(bb)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="tests/data/quality/calibrated.json")
    ap.add_argument("--out", default="docs/quality-ppl-bpw.png")
    args = ap.parse_args()
    ensure_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    rows = json.loads((ROOT / args.data).read_text())
    if not rows:
        sys.exit(f"quality_plot: {args.data} has no rows")
    xs = [r["bits_per_weight"] for r in rows]
    ys = [r["texts"]["gpl-3.0"]["perplexity"] for r in rows]

    fig, ax = plt.subplots(figsize=(9, 6), dpi=100)
    # A log axis when the perplexities span more than a factor of two, so
    # that the good encodings near the dense line stay apart.
    log_y = max(ys) / min(ys) > 2
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())

    def ref_line(pred, style, text):
        hits = [r for r in rows if pred(r)]
        if hits:
            y = hits[0]["texts"]["gpl-3.0"]["perplexity"]
            ax.axhline(y, color="#555555", linestyle=style, linewidth=0.8, zorder=1, label=f"{text}: {y:.2f}")

    ref_line(lambda r: group_of(r) == "dense", "-", "dense")
    ref_line(lambda r: r["file"] == "smollm2.Q4_K_M.gguf", "--", "llama.cpp Q4_K_M")
    ref_line(lambda r: r["file"] == "smollm2.Q4_K_M.imatrix.gguf", ":", "llama.cpp Q4_K_M + imatrix")

    # Rows at the same point (llama.cpp's Q8_0 ignores the imatrix: the same
    # tensors) share one marker and one label.
    points = {}
    for r, x, y in zip(rows, xs, ys):
        key = (round(x, 3), round(y, 3))
        points.setdefault(key, []).append(r)

    seen = set()
    texts, where = [], []
    for (x, y), same in points.items():
        g = group_of(same[0])
        colour, marker, legend = GROUPS.get(g, ("#9467bd", "v", g))
        ax.scatter([x], [y], c=colour, marker=marker, s=42 if marker != "*" else 110, zorder=3,
                   label=None if g in seen else legend, edgecolors="white", linewidths=0.5)
        seen.add(g)
        # The legend says which tool made a point; its label says how.
        names = [r["label"].removeprefix("llama.cpp ") if group_of(r).startswith("llama.cpp") else r["label"]
                 for r in same]
        texts.append(ax.annotate(" = ".join(names), (x, y), xytext=(6, 4), textcoords="offset points",
                                 fontsize=7, zorder=4, color=colour if g != "llama.cpp" else "#444444",
                                 arrowprops=dict(arrowstyle="-", color="#999999", linewidth=0.5,
                                                 shrinkA=0, shrinkB=3)))
        where.append((x, y))

    ax.set_xlabel("bits per weight (whole file × 8 / parameters served)")
    ax.set_ylabel("perplexity, GPL-3 text, ctx 256" + (" (log scale)" if log_y else ""))
    ax.set_title("SmolLM2-135M-Instruct: perplexity against size (rknot probe, fp32 forward pass)", fontsize=10)
    ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
    span = max(xs) - min(xs) or 1.0
    ax.set_xlim(min(xs) - 0.08 * span, max(xs) + 0.12 * span)
    ylo, yhi = min(ys), max(ys)
    if log_y:
        ax.set_ylim(ylo / 1.05, yhi * 1.08)
    else:
        pad = (yhi - ylo) * 0.08 or 0.5
        ax.set_ylim(ylo - pad, yhi + pad)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    fig.tight_layout()
    place_labels(fig, ax, where, texts)

    out = ROOT / args.out
    tmp = out.with_name(out.name + ".tmp.png")
    # A small palette keeps the PNG small.
    fig.savefig(tmp, dpi=100, pil_kwargs={"optimize": True})
    try:
        from PIL import Image

        Image.open(tmp).convert("RGB").quantize(colors=64).save(tmp, optimize=True)
    except ImportError:
        pass
    os.replace(tmp, out)
    print(f"{args.out}: {len(rows)} points, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
