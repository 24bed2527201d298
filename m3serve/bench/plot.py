"""Pareto chart of serving results: interactivity (x, tokens/s/user) vs throughput per GPU (y).

Several result files overlay (e.g. stock vs target). Each file is one series: every concurrency level is a
point (labelled c=N); the series' Pareto front (no other point of it is better on both axes) is drawn as a
line. matplotlib is optional (the `plot` extra) and imported only here. The y axis says "per GPU" unless a
series ran on a CPU server (its meta.server_device); point labels are never clipped by the axes or the image.
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


def on_gpu(results: list[dict]) -> bool:
    """Whether every series ran on a GPU server (a result without the device, e.g. from another server: assumed)."""
    return all(res.get("meta", {}).get("server_device") in (None, "cuda") for res in results)


def plot_pareto(results: list[dict], out_png: str, x_key: str = X_KEY, y_key: str = Y_KEY,
                title: str | None = None) -> str:
    fig = pareto_figure(results, x_key, y_key, title)
    import matplotlib.pyplot as plt
    fig.savefig(out_png, bbox_inches="tight")
    plt.close(fig)
    return out_png


def pareto_figure(results: list[dict], x_key: str = X_KEY, y_key: str = Y_KEY, title: str | None = None):
    """The chart as a matplotlib Figure (plot_pareto saves it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the Pareto chart needs matplotlib: pip install matplotlib (m3serve's 'plot' extra)") from e
    if not results:
        raise ValueError("results: expected at least one result to plot")
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    top_x = top_y = 0.0
    for k, res in enumerate(results):
        rows = [r for r in res["results"] if r.get(x_key) is not None and r.get(y_key) is not None]
        label = res.get("meta", {}).get("label") or f"run {k}"
        if not rows:
            continue
        pts = [(r[x_key], r[y_key]) for r in rows]
        top_x, top_y = max([top_x] + [p[0] for p in pts]), max([top_y] + [p[1] for p in pts])
        color = f"C{k % 10}"
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, s=28, zorder=3)
        front = pareto_front(pts)
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], color=color, lw=1.8, label=label)
        for r, (x, y) in zip(rows, pts):
            ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=color, annotation_clip=False)
    ax.set_xlabel("interactivity x90 = 1 / P90(ITL)  [tokens/s/user]" if x_key == X_KEY else x_key)
    per = "tokens/s/GPU" if on_gpu(results) else "tokens/s, CPU server"
    ax.set_ylabel(f"throughput  [{per}, input + output]" if y_key == Y_KEY else y_key)
    ax.set_title(title or "m3serve serving benchmark: Pareto front over concurrency")
    ax.grid(True, alpha=0.3)
    # room above and right of the largest point for its label (annotations sit up and right of their point)
    ax.set_xlim(0, top_x * 1.15 if top_x > 0 else None)
    ax.set_ylim(0, top_y * 1.12 if top_y > 0 else None)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig
