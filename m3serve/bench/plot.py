"""Pareto chart of serving results: interactivity (x, tokens/s/user) vs throughput per GPU (y).

Several result files overlay (e.g. stock vs target). Each file is one series: every concurrency level is a
point (labelled c=N); the series' Pareto front (no other point of it is better on both axes) is drawn as a
line. matplotlib is optional (the `plot` extra) and imported only here.
"""

from __future__ import annotations

import json

X_KEY = "interactivity_x90"
Y_KEY = "total_tokens_per_s_per_gpu"


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (both larger is better), by x ascending."""
    idx = [i for i, (x, y) in enumerate(points)
           if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for x2, y2 in points)]
    return sorted(idx, key=lambda i: points[i][0])


def load(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(f"{path}: expected a `m3serve bench serve` result (an object with 'results')")
    return data


def plot_pareto(results: list[dict], out_png: str, x_key: str = X_KEY, y_key: str = Y_KEY,
                title: str | None = None) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the Pareto chart needs matplotlib: pip install matplotlib (m3serve's 'plot' extra)") from e
    if not results:
        raise ValueError("results: expected at least one result to plot")
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for k, res in enumerate(results):
        rows = [r for r in res["results"] if r.get(x_key) is not None and r.get(y_key) is not None]
        label = res.get("meta", {}).get("label") or f"run {k}"
        if not rows:
            continue
        pts = [(r[x_key], r[y_key]) for r in rows]
        color = f"C{k % 10}"
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, s=28, zorder=3)
        front = pareto_front(pts)
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], color=color, lw=1.8, label=label)
        for r, (x, y) in zip(rows, pts):
            ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=color)
    ax.set_xlabel("interactivity x90 = 1 / P90(ITL)  [tokens/s/user]" if x_key == X_KEY else x_key)
    ax.set_ylabel("throughput  [tokens/s/GPU, input + output]" if y_key == Y_KEY else y_key)
    ax.set_title(title or "m3serve serving benchmark: Pareto front over concurrency")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
