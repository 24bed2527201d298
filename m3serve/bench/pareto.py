"""Several `m3serve bench serve` runs as one Pareto file and one chart.

    m3serve bench pareto RUN.json [RUN.json ...] --out serve-pareto.json --plot serve-pareto.png

Each input is one run (one model, plain or speculative, one weight format) over a sweep of concurrency levels.
The output keeps every run's rows unchanged under {"commit", "gpu", "date", "command", "runs": [{"model",
"mode", "quantization", "label", "results": [...]}]}; the chart puts throughput per GPU on x and tokens/s per
user at P90 ITL on y, one series per run, each point labelled with its concurrency.
"""

from __future__ import annotations

import json
import sys
import time

from m3serve.bench.plot import X_KEY, Y_KEY, load, plot_pareto

MODES = ("plain", "spec")


def describe_run(result: dict, mode: str | None = None, quantization: str | None = None) -> dict:
    """One run's entry: model, mode (plain / spec), quantization and label from its meta (overridable)."""
    meta = result.get("meta", {})
    mode = mode or meta.get("mode") or "plain"
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, found {mode!r}")
    return {"model": meta.get("model"), "mode": mode, "quantization": quantization or meta.get("quantization"),
            "label": meta.get("label"), "meta": meta, "results": result["results"]}


def combine(runs: list[dict], commit: str | None = None, gpu: str | None = None, command: str | None = None) -> dict:
    if not runs:
        raise ValueError("runs: expected at least one `bench serve` result")
    return {"bench": "serve_pareto", "commit": commit, "gpu": gpu, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command,
            "runs": runs}


def plot_combined(doc: dict, out_png: str, title: str | None = None) -> str:
    """x = total tok/s per GPU, y = tok/s per user at P90 ITL; one series per run (its label)."""
    series = [{"meta": {"label": r.get("label") or f"{r['model']} {r['mode']}"}, "results": r["results"]}
              for r in doc["runs"]]
    return plot_pareto(series, out_png, x_key=Y_KEY, y_key=X_KEY,
                       title=title or "m3serve serving: throughput vs interactivity (points: concurrency)")


def _spec(text: str) -> tuple[str, str | None, str | None]:
    """PATH[:MODE[:QUANTIZATION]]"""
    parts = text.split(":")
    if len(parts) > 3:
        raise ValueError(f"{text!r}: expected PATH[:MODE[:QUANTIZATION]]")
    return parts[0], (parts[1] or None) if len(parts) > 1 else None, (parts[2] or None) if len(parts) > 2 else None


def add_command(sub) -> None:
    p = sub.add_parser("pareto", help="several `bench serve` results as one Pareto file and chart")
    p.add_argument("runs", nargs="+", metavar="PATH[:MODE[:QUANT]]",
                   help="result files; MODE plain|spec and QUANT override what the file's meta says")
    p.add_argument("--out", required=True, help="combined JSON path")
    p.add_argument("--plot", default=None, metavar="PNG", help="also write the chart here")
    p.add_argument("--commit", default=None)
    p.add_argument("--gpu", default=None)
    p.add_argument("--title", default=None)
    p.set_defaults(func=run_pareto)


def run_pareto(args) -> int:
    runs = []
    for text in args.runs:
        path, mode, quant = _spec(text)
        runs.append(describe_run(load(path), mode, quant))
    doc = combine(runs, commit=args.commit, gpu=args.gpu, command="m3serve bench pareto " + " ".join(args.runs))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"combined {len(runs)} runs: {args.out}")
    if args.plot:
        try:
            print(f"chart: {plot_combined(doc, args.plot, args.title)}")
        except ImportError as e:
            print(f"no chart: {e}", file=sys.stderr)
    return 0


__all__ = ["combine", "describe_run", "plot_combined", "add_command"]
