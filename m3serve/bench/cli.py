"""`m3serve bench serve` and `m3serve bench plot`.

    m3serve bench serve [--base-url URL | --launch MODEL [--server-args "..."]] [--workload fixed|agentic]
                        [--concurrency 1,2,4,...,64] [--input-len N] [--output-len N] [--num-gpus G]
                        [--out results.json] [--plot pareto.png] [--compare other.json ...] [--label NAME]
    m3serve bench plot a.json b.json ... -o pareto.png

--launch starts `python -m m3serve.server MODEL --port 0 <server-args>` as a separate process (so client and
server do not share an interpreter), benchmarks it and stops it. The lead's m3serve/cli.py calls
register(subparsers); `python -m m3serve.bench` runs main() alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import subprocess
import sys
import threading

from m3serve.bench import pareto
from m3serve.bench.plot import load, plot_pareto
from m3serve.bench.serve import WORKLOADS, BenchConfig, format_table, run_bench


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, found {text!r}")
    return vals


def _range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+),(\d+)", text)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"expected LO,HI with LO < HI, found {text!r}")
    return int(m.group(1)), int(m.group(2))


def _procs(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', found {text!r}")
    return int(text)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--base-url", default=d.base_url, help="server root (without /v1)")
    p.add_argument("--launch", metavar="MODEL", default=None,
                   help="start `m3serve serve MODEL` on a free local port for the run (overrides --base-url)")
    p.add_argument("--server-args", default="", help="extra arguments for the launched server (one string)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--model", default=None, help="model name (default: %(default)s = the server's first /v1/models entry)")
    p.add_argument("--workload", choices=WORKLOADS, default=d.workload, help="traffic shape")
    p.add_argument("--concurrency", type=_int_list, default=d.concurrency, help="comma-separated levels")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens (agentic: new tokens per turn)")
    p.add_argument("--output-len", type=int, default=d.output_len, help="tokens generated per request")
    p.add_argument("--requests-per-user", type=int, default=d.requests_per_user, help="fixed workload")
    p.add_argument("--turns", type=int, default=d.turns, help="agentic workload")
    p.add_argument("--shared-prefix-len", type=int, default=d.shared_prefix_len, help="agentic workload")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    p.add_argument("--num-gpus", type=int, default=d.num_gpus, help="divides throughput for the per-GPU figures")
    p.add_argument("--token-range", type=_range, default=None, help="LO,HI: prompt token ids drawn from [LO, HI)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the prompts drawn")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds allowed for the whole run")
    p.add_argument("--label", default=None, help="series name in charts")
    p.add_argument("--out", default="bench_serve.json", help="JSON results path")
    p.add_argument("--plot", default=None, metavar="PNG", help="also write the Pareto chart here")
    p.add_argument("--compare", nargs="*", default=[], metavar="JSON", help="result files to overlay on the chart")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--client-procs", type=_procs, default="auto",
                   help="client processes the users are spread over (auto: one per 16 users, up to a quarter of the "
                        "CPUs and 8): one Python process parses ~40-50k streamed tokens a second")


def launch_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "m3serve.server", model, "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    while True:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise RuntimeError(f"the launched server exited ({proc.returncode}) before listening: {shlex.join(cmd)}")
        m = re.search(r" at (http://\S+)", line)
        if m:
            break
    # Keep draining its stdout so the server can never block on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, m.group(1)


def run_serve(args: argparse.Namespace) -> int:
    cfg = BenchConfig(base_url=args.base_url.rstrip("/"), api_key=args.api_key, model=args.model,
                      workload=args.workload, concurrency=args.concurrency, input_len=args.input_len,
                      output_len=args.output_len, requests_per_user=args.requests_per_user, turns=args.turns,
                      shared_prefix_len=args.shared_prefix_len, temperature=args.temperature, num_gpus=args.num_gpus,
                      seed=args.seed, token_range=args.token_range, timeout_s=args.timeout, label=args.label,
                      progress=not args.no_progress, client_procs=args.client_procs)
    cfg.validate()
    others = [load(p) for p in args.compare]           # fail on a bad --compare file before the long run
    proc = None
    try:
        if args.launch:
            proc, cfg.base_url = launch_server(args.launch, shlex.split(args.server_args))
        result = asyncio.run(run_bench(cfg))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(format_table(result))
    print(f"results: {args.out}")
    if args.plot:
        try:
            print(f"chart: {plot_pareto([result] + others, args.plot)}")
        except ImportError as e:
            print(f"no chart: {e}", file=sys.stderr)
    failed = sum(r["failed"] for r in result["results"])
    if failed:
        print(f"{failed} requests failed, e.g. {result['results'][0]['errors'][:1]}", file=sys.stderr)
    return 1 if failed else 0


def run_plot(args: argparse.Namespace) -> int:
    print(f"chart: {plot_pareto([load(p) for p in args.files], args.output, title=args.title)}")
    return 0


def add_commands(sub) -> None:
    """Add `serve` and `plot` to an existing `bench` subparsers object."""
    s = sub.add_parser("serve", help="closed-loop serving benchmark (JSON + Pareto PNG)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(s)
    s.set_defaults(func=run_serve)
    p = sub.add_parser("plot", help="overlay result files on one Pareto chart",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("files", nargs="+", metavar="JSON")
    p.add_argument("-o", "--output", default="pareto.png", help="PNG path")
    p.add_argument("--title", default=None, help="chart title")
    p.set_defaults(func=run_plot)
    pareto.add_command(sub)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `bench` (with `serve` and `plot`) to the top-level m3serve CLI's subparsers."""
    p = subparsers.add_parser("bench", help="benchmarks")
    sub = p.add_subparsers(dest="bench_command", required=True)
    add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="m3serve bench")
    sub = p.add_subparsers(dest="bench_command", required=True)
    add_commands(sub)
    args = p.parse_args(argv)
    return args.func(args)
