"""What a step that admits a request costs next to an overlapped decode step, on the real engine and model (GPU).

`bench/host_stream_cost.py` times the host path with the device replaced; this one times the engine's steps
themselves (no server): R requests decode (the overlap loop on the decode graphs), then, repeatedly, k new
requests arrive (and k running ones are aborted, so the batch stays at R) and the step that prefills them is
timed: wall time and the engine thread's CPU time (time.thread_time; the rest is waiting for the device),
followed by the next step (which restarts the overlap loop). For contrast: a prefill step with nothing else
running.

    python bench/prefill_step_cost.py --rows 64 --new 1,4,16
Writes bench/results/host_overhead/prefill_step_cost-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve.benchmeta import run_metadata  # noqa: E402


def _timed(engine, sync) -> tuple[float, float]:
    """(wall us, engine-thread CPU us) of one engine.step()."""
    sync()
    w0, c0 = time.perf_counter(), time.thread_time()
    engine.step()
    return (time.perf_counter() - w0) * 1e6, (time.thread_time() - c0) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="requests decoding while new ones arrive")
    ap.add_argument("--new", default="1,4,16", help="requests arriving together, per measured prefill step")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results" / "host_overhead"))
    args = ap.parse_args()

    import torch
    from m3serve import LLM, SamplingParams
    from m3serve.llm import default_model

    llm = LLM(default_model(), max_num_seqs=128)
    engine = llm.engine
    dev = llm.model.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    vocab = llm.model.cfg.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=4000 - args.prompt_len, temperature=0.0, ignore_eos=True)

    def prompt() -> list[int]:
        return rng.integers(vocab // 8, vocab, args.prompt_len).tolist()

    def settle() -> None:
        while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
            engine.step()
        for _ in range(3):
            engine.step()

    # prefill alone (nothing decoding)
    alone = []
    for _ in range(args.repeats):
        req = engine.add_request(prompt(), params)
        alone.append(_timed(engine, sync))
        engine.abort(req.request_id)
        engine.drain()
    running = [engine.add_request(prompt(), params) for _ in range(args.rows)]
    settle()
    decode = [_timed(engine, lambda: None) for _ in range(args.decode_steps)]   # steady overlap: no sync
    out = {"rows": args.rows, "prompt_len": args.prompt_len, "graphs": engine.runner.graphs is not None,
           "decode_step": _summary(decode), "prefill_alone": _summary(alone), "with_prefill": []}
    for k in [int(x) for x in args.new.split(",")]:
        first, after = [], []
        for _ in range(args.repeats):
            for r in running[:k]:
                engine.abort(r.request_id)
            running = running[k:] + [engine.add_request(prompt(), params) for _ in range(k)]
            first.append(_timed(engine, lambda: None))
            after.append(_timed(engine, lambda: None))
            settle()
        out["with_prefill"].append({"new": k, "prefill_step": _summary(first), "next_step": _summary(after)})
    for r in running:
        engine.abort(r.request_id)
    engine.drain()
    print(json.dumps(out, indent=1))
    meta = run_metadata()
    result = {"bench": "prefill_step_cost", **meta, "model": os.path.basename(default_model()), "point": out}
    label = (meta["gpu"] or "cpu").lower().replace(" ", "-")
    path = Path(args.out_dir) / f"prefill_step_cost-{label}-{dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def _summary(samples: list[tuple[float, float]]) -> dict:
    wall = [w for w, _ in samples]
    cpu = [c for _, c in samples]
    return {"n": len(samples), "wall_us_median": round(statistics.median(wall), 1),
            "wall_us_max": round(max(wall), 1), "host_cpu_us_median": round(statistics.median(cpu), 1)}


if __name__ == "__main__":
    main()
