"""The main job as a new user meets it: `m3serve generate` with no arguments, run as fresh processes.

    python bench/generate_main_job.py --runs 2 --out bench/results/generate_main_job/generate-h200.json

Run 1 starts with an empty Triton disk cache (a first install), every later run reuses it (the cache the
first run left). Each run is a separate `python -m m3serve.cli generate` process, so the wall time includes
imports, model build, warm-up and graph capture; the engine's own summary line gives load time, tokens and
decode tok/s. Nothing is timed inside this process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from m3serve.benchmeta import run_metadata  # noqa: E402

# "[64 tokens in 0.05 s, 1392.3 tok/s; load 6.3 s; finish: length; device cuda, torch.bfloat16 ...]"
SUMMARY = re.compile(r"\[(\d+) tokens in ([\d.]+) s, ([\d.]+) tok/s; load ([\d.]+) s; finish: (\w+); device (\S+),")


def parse_summary(stderr: str) -> dict:
    """The engine's summary line of one generate run; raises if the run printed none (it failed)."""
    m = SUMMARY.search(stderr)
    if m is None:
        raise RuntimeError(f"generate printed no summary line; stderr tail:\n{stderr[-2000:]}")
    n, dt, tps, load, finish, device = m.groups()
    return {"tokens": int(n), "decode_s": float(dt), "tok_s": float(tps), "load_s": float(load),
            "finish": finish, "device": device}


def run_once(cache_dir: str, extra: list[str]) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "m3serve.cli", "generate", *extra], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"generate exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return {**parse_summary(proc.stderr), "process_wall_s": round(wall, 2), "text": proc.stdout[-400:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="run 1 cold Triton cache, later runs warm")
    ap.add_argument("--out", required=True)
    ap.add_argument("generate_args", nargs="*", help="arguments passed to `m3serve generate` (default: none)")
    args = ap.parse_args()
    meta = run_metadata()
    runs = []
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        for i in range(args.runs):
            r = run_once(cache, args.generate_args)
            r["triton_cache"] = "cold" if i == 0 else "warm"
            runs.append(r)
            print(f"run {i + 1} ({r['triton_cache']}): load {r['load_s']} s, {r['tok_s']} tok/s, "
                  f"process {r['process_wall_s']} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "generate_main_job", **meta, "generate_args": args.generate_args, "runs": runs}, f,
                  indent=2)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
