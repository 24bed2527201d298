"""Why Eagle3 serving trails plain serving at 128 users: the engines' decode steps side by side, without a server.

With speculative_config.disable_by_batch_size (default 2) a batch of 128 decoding requests runs plain steps in the
speculative engine, the same decode graphs and overlap loop as the plain engine; yet the served sweep measured
ITL p50 3.7 vs 2.9 ms at 128 users (bench/results/serve/). This times, on the same model and requests, the
steady decode steps of: the plain engine, and the speculative engine under its policy (plain steps). Equal step
times put the gap in the server; a slower speculative engine puts it in the engine (the per-step split of host
and device time is printed to say where).

    python bench/spec_plain_step_cost.py --batch 128 --out bench/results/spec_plain_step_cost/spec-plain-step-cost-h200.json

Per engine: `batch` requests of --prompt tokens decode --tokens tokens each (greedy, ignore_eos); after every request
has its first token, the next --steps engine steps are timed one by one (wall, no sync: the overlap loop's own
pacing) and the median / p90 are reported, with the steps that ran as graph replays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve import LLM, SamplingParams, embedded_drafter  # noqa: E402
from m3serve.benchmeta import run_metadata  # noqa: E402


def time_steps(llm: LLM, batch: int, prompt: int, tokens: int, steps: int) -> dict:
    eng = llm.engine
    vocab = llm.model.cfg.vocab_size
    reqs = [eng.add_request([(101 + 7919 * i + 31 * j) % (vocab - 16) + 16 for j in range(prompt)],
                            SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)) for i in range(batch)]
    while not all(r.output_token_ids for r in reqs):
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    while eng.has_work():
        eng.step()
    for r in reqs:
        eng.release(r)
    times.sort()
    stats = eng.stats()
    policy = {k: v for k, v in stats.get("spec_decode", {}).items() if k.startswith("policy_")}
    return {"median_ms": statistics.median(times) * 1e3, "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
            "steps": len(times), "policy": policy,
            "stats": {k: v for k, v in stats.items() if not isinstance(v, dict)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    meta = run_metadata()
    spec = {"method": "eagle3", "model": embedded_drafter(), "num_speculative_tokens": 3}
    kv = {} if args.device == "cuda" else {"kv_cache_bytes": 1 << 30}
    rows = []
    for name, cfg in (("plain", None), ("spec-policy", spec)):
        llm = LLM(device=args.device, max_num_seqs=args.batch, speculative_config=cfg, **kv)
        res = time_steps(llm, args.batch, args.prompt, args.tokens, args.steps)
        res.update(engine=name, batch=args.batch)
        rows.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "stats"}), flush=True)
        llm.shutdown()
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "spec_plain_step_cost", **meta, "results": rows}, f, indent=2)
    print("results:", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
