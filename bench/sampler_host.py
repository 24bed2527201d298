"""Per-step host time of the sampler with and without penalties / logit_bias / min_tokens, batch 8.

Times exactly what an eager step's sampling runs before reading tokens back (LLMEngine._logits_processing:
PenaltyState.rows_for; ModelRunner.sample: apply,
sampler.sample, record. Requests are in steady decode (rows assigned in a warm-up step, as after a request's
first token). Host time is the wall time of those calls; on CUDA the device is synchronized outside the timed
region, so it is the host cost of enqueueing. On CPU the device work runs on the host too: the small-vocab CPU
case (V = 512) shows host overhead, the large one adds the element work. Also counts the aten ops dispatched per
step (TorchDispatchMode): the host cost driver, expected constant in what is enabled and in how many rows use it.

Usage:
    python bench/sampler_host.py --device cpu
    python bench/sampler_host.py --device cuda --vocab 200064
Writes bench/results/sampler_host/sampler_host-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.engine.penalties import PenaltyState  # noqa: E402
from m3serve.engine.request import Request, Status  # noqa: E402
from m3serve.engine.sampler import sample  # noqa: E402
from m3serve.engine.sampling_params import SamplingParams  # noqa: E402
from m3serve.opcount import AtenOpCount  # noqa: E402

BATCH = 8
ALL = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={5: 2.0, 9: -3.0},
           min_tokens=4)
CASES = {   # name -> (params of the penalised rows, number of penalised rows of 8, temperature)
    "greedy_plain": ({}, 0, 0.0),
    "greedy_1_of_8_all_penalties": (ALL, 1, 0.0),
    "greedy_8_of_8_presence_only": ({"presence_penalty": 0.5}, 8, 0.0),
    "greedy_8_of_8_all_penalties": (ALL, 8, 0.0),
    "sampled_plain": ({}, 0, 0.8),
    "sampled_8_of_8_all_penalties": (ALL, 8, 0.8),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _requests(penalised: dict, n_pen: int, temperature: float, device: torch.device, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(BATCH):
        kw = dict(penalised) if i < n_pen else {}
        r = Request(i, torch.randint(0, vocab, (512,), generator=g).tolist(),
                    SamplingParams(temperature=temperature, max_tokens=None, seed=i, **kw))
        r.status = Status.RUNNING
        r.sample_key = i
        reqs.append(r)
    return reqs


def _step(state: PenaltyState, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
    rows = state.rows_for(reqs)
    scores = logits if rows is None else state.apply(logits, rows)
    tokens = sample(scores, [r.params for r in reqs], [r.sample_key for r in reqs], [r.num_tokens for r in reqs])
    if rows is not None:
        state.record(rows, tokens)
    return tokens


def run_case(name: str, device: torch.device, vocab: int, steps: int) -> dict:
    penalised, n_pen, temperature = CASES[name]
    reqs = _requests(penalised, n_pen, temperature, device, vocab)
    state = PenaltyState(64, vocab, device, {2})
    logits = torch.randn(BATCH, vocab, device=device)
    for _ in range(5):                      # warm-up: row assignment (once per request), allocator, kernels
        _step(state, reqs, logits)
    _sync(device)
    with AtenOpCount() as count:
        _step(state, reqs, logits)
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(state, reqs, logits)
        times.append(time.perf_counter() - t0)
        _sync(device)
    times.sort()
    return {"case": name, "penalised_rows": n_pen, "temperature": temperature, "ops_per_step": count.n,
            "host_us_median": statistics.median(times) * 1e6, "host_us_p90": times[int(0.9 * len(times))] * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    vocabs = args.vocab or ([512, 200064] if device.type == "cpu" else [200064])
    results = []
    for v in vocabs:
        for name in CASES:
            steps = args.steps if v <= 4096 or device.type == "cuda" else max(20, args.steps // 10)
            r = {"vocab": v, **run_case(name, device, v, steps)}
            results.append(r)
            print(f"V={v:>6} {name:<32} ops/step {r['ops_per_step']:>3}  host {r['host_us_median']:9.1f} us "
                  f"(p90 {r['host_us_p90']:9.1f})", flush=True)
    meta = run_metadata()
    out = {**meta, "meta": meta, "batch": BATCH, "device": str(device), "results": results}
    path = Path(args.out) if args.out else Path(__file__).parent / "results" / "sampler_host" / \
        f"sampler_host-{device.type}-{dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
