"""Host cost per stream per decode step of the serving path, without the model's compute.

The real server (m3serve/server: aiohttp app, engine loop thread, SSE writer, detokenizer with the embedded
model's tokenizer), the real engine and scheduler, and the decode target's host path, with the device replaced
(in this harness only) by stand-ins that cost a fixed, GIL-free wait:
  * pure decode steps run through the overlap loop (LLMEngine._launch_overlapped) on `HostOnlyGraphs`: the real
    staging (pack_decode + DeviceBlockTables.stage, what DecodeGraphs.run does on the host), then a random token
    per row "on the device"; reading a step's tokens waits until `--device-step-us` after its launch (a sleep,
    which releases the GIL like a CUDA event wait);
  * steps with a prefill chunk take the synchronous path (read the step in flight, ModelRunner.build_batch with
    the target's metadata, forward) with the forward replaced by a `--eager-step-us` wait and random tokens.
`bench/host_overhead.py` times the block-table build alone; this one times everything around it.

Clients: `m3serve bench serve`'s own closed-loop streaming client (m3serve.bench.serve.run_bench, aiohttp) in
a separate process, fixed workload (--input-len / --output-len, ignore_eos, return_token_ids), at each --streams
count. Measured in the server process: CPU time of each thread (pthread CPU clocks: the engine thread, the
event-loop thread, the prep pool), and per-step CPU spans on the engine thread (time.thread_time) split into the
engine's step (schedule, stage, read back, accept: append, stop checks, page commits) by step kind (overlapped
decode / synchronous prefill), and the loop's post-step work (Deltas, metrics, the hand-off to the event loop).
Thread CPU time, not wall time: the box may be shared, and waiting for the GIL or the fake device costs no CPU.
"us per stream-step" = that thread's CPU time / tokens generated (one token per stream per step).

    python bench/host_stream_cost.py                       # N = 1, 16, 64; writes a results JSON
    python bench/host_stream_cost.py --streams 64 --profile  # + cProfile top functions per thread (slower)
Writes bench/results/host_overhead/host_stream_cost-<label>-<date>.json (label: --label, default "cpu").
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import os
import pstats
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve.benchmeta import run_metadata  # noqa: E402


# ------------------------------------------------------------------------------------------ device stand-ins
@dataclass
class _Launched:
    tokens: np.ndarray
    n: int
    ready_at: float          # perf_counter time the "device" finishes the step


class HostOnlyGraphs:
    """DecodeGraphs' interface for the overlap loop (bucket_for / run / fetch_tokens / logits) with the graph
    replay replaced by random tokens: run() does the real host staging of a decode step, fetch_tokens() waits
    (GIL released) until the step's fixed device time has passed since its launch."""

    def __init__(self, engine, buckets, device_step_s: float, token_range: tuple[int, int], seed: int = 0):
        from m3serve.runtime.step_inputs import bucket_for
        self.engine, self.captured = engine, tuple(buckets)
        self._bucket_for = bucket_for
        self.sampling = True
        self.penalties = engine.penalties
        self.device_step_s = device_step_s
        self.lo, self.hi = token_range
        self.rng = np.random.default_rng(seed)
        self.busy_until = 0.0    # the fake device runs one step at a time, in launch order
        self.runs = 0

    def bucket_for(self, batch: int):
        return self._bucket_for(batch, self.captured)

    def run(self, seq_ids, token_ids, positions, sampling=None, penalty_rows=None, want_logits=False) -> _Launched:
        from m3serve.runtime.decode_graphs import pack_decode
        if want_logits:
            raise RuntimeError("HostOnlyGraphs: the harness's requests are greedy without logprobs; no step reads "
                               "logits")
        bucket = self.bucket_for(len(seq_ids))
        neutral = self.penalties.neutral if self.penalties is not None else 0
        tsi, pos, extra = pack_decode(bucket, token_ids, positions, sampling, penalty_rows, neutral)
        self.engine.runner.tables.stage(seq_ids, tsi, pos, extra=extra, pad_to=bucket)
        now = time.perf_counter()
        self.busy_until = max(now, self.busy_until) + self.device_step_s
        self.runs += 1
        return _Launched(self.rng.integers(self.lo, self.hi, len(seq_ids)), len(seq_ids), self.busy_until)

    def fetch_tokens(self, launched: _Launched) -> list[int]:
        wait = launched.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return launched.tokens.tolist()

    def logits(self, launched):
        raise RuntimeError("HostOnlyGraphs: the harness's requests are greedy without logprobs; no step reads logits")


def _install_fakes(engine, device_step_s: float, eager_step_s: float, token_range: tuple[int, int], stats: dict):
    """The decode target's host path on CPU: overlap loop on HostOnlyGraphs, eager steps with the target's batch
    metadata and a fixed-cost forward. Also counts step kinds for the report."""
    from m3serve.runtime.step_inputs import buckets_up_to
    runner = engine.runner
    runner.graphs = HostOnlyGraphs(engine, buckets_up_to(engine.config.max_num_seqs), device_step_s, token_range)
    runner.target_attention = True      # build_batch stages the kernels' metadata as on the GPU
    rng = np.random.default_rng(1)
    lo, hi = token_range

    def run(batch, reqs, prompt_plan=None, processing=None):
        stats["sync_steps"] += 1
        stats["sync_rows"] += len(reqs)
        # the eager step waits for the device (the real one also spends host time launching kernels: not here)
        time.sleep(eager_step_s)
        return rng.integers(lo, hi, len(reqs)).tolist(), None

    runner.run = run
    launch = engine._launch_overlapped

    def launch_overlapped(reqs):
        stats["overlapped_steps"] += 1
        stats["overlapped_rows"] += len(reqs)
        return launch(reqs)

    engine._launch_overlapped = launch_overlapped


# ------------------------------------------------------------------------------------------ engine-thread spans
class StepSpans:
    """thread_time spans on the engine thread around EngineLoop._step and the engine's step inside it, by kind."""

    def __init__(self, loop, stats: dict):
        self.loop, self.stats = loop, stats
        self.reset()
        engine = loop.engine
        step, loop_step = engine.step, loop._step
        spans = self

        def timed_engine_step():
            k0 = stats["sync_steps"]
            t0 = time.thread_time()
            out = step()
            dt_ = time.thread_time() - t0
            kind = "sync" if stats["sync_steps"] > k0 else "overlapped"
            spans.engine[kind] += dt_
            spans.count[kind] += 1
            spans.current = dt_
            return out

        def timed_loop_step():
            spans.current = 0.0
            t0 = time.thread_time()
            loop_step()
            spans.post += time.thread_time() - t0 - spans.current

        engine.step = timed_engine_step
        loop._step = timed_loop_step

    def reset(self) -> None:
        self.engine = {"overlapped": 0.0, "sync": 0.0}
        self.count = {"overlapped": 0, "sync": 0}
        self.post = 0.0
        self.current = 0.0


class WriteCounter:
    """Counts StreamResponse.write calls (one per SSE write to a client) by wrapping the method, harness only."""

    def __init__(self):
        from aiohttp import web
        self.count = 0
        write = web.StreamResponse.write
        counter = self

        async def counted_write(resp, data):
            counter.count += 1
            return await write(resp, data)

        web.StreamResponse.write = counted_write


def _thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def _prep_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("m3serve-prep")]


# ------------------------------------------------------------------------------------------ one level
CLIENT = r"""
import asyncio, json, sys
from m3serve.bench.serve import BenchConfig, run_bench
cfg = BenchConfig(**json.loads(sys.argv[1]))
print(json.dumps(asyncio.run(run_bench(cfg))))
"""


def run_client(url: str, streams: int, args) -> dict:
    cfg = {"base_url": url, "concurrency": [streams], "input_len": args.input_len, "output_len": args.output_len,
           "requests_per_user": args.requests_per_stream, "seed": 1000 + streams, "progress": False}
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(cfg)], capture_output=True, text=True, env=env,
                         timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"client at {streams} streams failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["results"][0]


def _profile_top(prof: cProfile.Profile, n: int) -> list[dict]:
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({fn})",
                     "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:n]


def run_level(srv, spans: StepSpans, stats: dict, writes: WriteCounter, streams: int, args) -> dict:
    loop, metrics = srv.engine_loop, srv.state.metrics
    http_ident, eng_ident = srv._thread.ident, loop._thread.ident
    profs = None
    if args.profile:
        # thread CPU time as the timer: wall time would charge GIL waits to whatever function held the thread
        profs = {"engine": cProfile.Profile(time.thread_time), "loop": cProfile.Profile(time.thread_time)}
        loop.call_sync(lambda e: profs["engine"].enable())
        done = threading.Event()
        srv._loop.call_soon_threadsafe(lambda: (profs["loop"].enable(), done.set()))
        done.wait(10)
    for k in stats:
        stats[k] = 0
    loop.call_sync(lambda e: spans.reset())
    prep = _prep_threads()
    c0 = {"engine": _thread_cpu(eng_ident), "loop": _thread_cpu(http_ident),
          "prep": sum(_thread_cpu(t.ident) for t in prep)}
    tok0, steps0, writes0 = metrics.generation_tokens.value(), loop.steps, writes.count
    w0 = time.perf_counter()
    client = run_client(srv.url, streams, args)
    wall = time.perf_counter() - w0
    # read the spans on the engine thread (it writes them), after the last step of the level
    span = loop.call_sync(lambda e: (dict(spans.engine), dict(spans.count), spans.post))
    c1 = {"engine": _thread_cpu(eng_ident), "loop": _thread_cpu(http_ident),
          "prep": sum(_thread_cpu(t.ident) for t in _prep_threads())}
    if profs is not None:
        loop.call_sync(lambda e: profs["engine"].disable())
        done = threading.Event()
        srv._loop.call_soon_threadsafe(lambda: (profs["loop"].disable(), done.set()))
        done.wait(10)
    tokens = metrics.generation_tokens.value() - tok0
    steps = loop.steps - steps0
    eng_s, count, post_s = span
    cpu = {k: c1[k] - c0[k] for k in c0}
    per_tok = lambda s: round(s / tokens * 1e6, 2) if tokens else None     # noqa: E731
    per_step = lambda s, n: round(s / n * 1e6, 1) if n else None           # noqa: E731
    point = {
        "streams": streams, "requests": client["requests"], "completed": client["completed"], "tokens": tokens,
        "steps": steps, "wall_s": round(wall, 3),
        "tokens_per_sse_write": round(tokens / (writes.count - writes0), 2) if writes.count > writes0 else None,
        "rows_per_step": round(tokens / steps, 2) if steps else None,
        "sync_step_fraction": round(count["sync"] / steps, 3) if steps else None,
        # CPU us per stream-step (= per generated token), by thread
        "engine_thread_us_per_stream_step": per_tok(cpu["engine"]),
        "loop_thread_us_per_stream_step": per_tok(cpu["loop"]),
        "prep_threads_us_per_stream_step": per_tok(cpu["prep"]),
        "total_us_per_stream_step": per_tok(cpu["engine"] + cpu["loop"] + cpu["prep"]),
        # engine-thread spans: the engine's step by kind, and the loop's post-step work
        "engine_step_us_per_stream_step": per_tok(sum(eng_s.values())),
        "engine_post_step_us_per_stream_step": per_tok(post_s),
        "overlapped_step_us_mean": per_step(eng_s["overlapped"], count["overlapped"]),
        "sync_step_us_mean": per_step(eng_s["sync"], count["sync"]),
        "overlapped_rows_mean": round(stats["overlapped_rows"] / stats["overlapped_steps"], 2)
        if stats["overlapped_steps"] else None,
        "sync_rows_mean": round(stats["sync_rows"] / stats["sync_steps"], 2) if stats["sync_steps"] else None,
        "client_itl_ms_p50": round(client["itl_ms"]["p50"], 3) if client["itl_ms"]["p50"] else None,
        "client_itl_ms_p90": round(client["itl_ms"]["p90"], 3) if client["itl_ms"]["p90"] else None,
        "client_tpot_ms_p90": round(client["tpot_ms"]["p90"], 3) if client["tpot_ms"]["p90"] else None,
        "client_output_tok_per_s": round(client["output_tokens_per_s"], 1),
    }
    if profs is not None:
        point["profile_top"] = {k: _profile_top(p, args.profile_top) for k, p in profs.items()}
    return point


def _median_point(runs: list[dict]) -> dict:
    """One level over --repeat runs: the median of each number (a shared box's other load moves single runs),
    each run's total kept for the spread."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for k, v in runs[0].items():
        vals = [r[k] for r in runs]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(isinstance(x, (int, float)) for x in vals):
            out[k] = round(float(np.median(vals)), 3)
    out["runs"] = len(runs)
    out["total_us_per_stream_step_each"] = [r["total_us_per_stream_step"] for r in runs]
    out["total_us_per_stream_step_min"] = min(out["total_us_per_stream_step_each"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16,64", help="concurrent streaming clients per level")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=128, help="as bench/serve_pareto.py runs the server")
    ap.add_argument("--device-step-us", type=float, default=300.0,
                    help="fake device time of an overlapped decode step (the H200's C=1 ITL is ~310 us)")
    ap.add_argument("--eager-step-us", type=float, default=1000.0,
                    help="fake device time of a synchronous (prefill) step")
    ap.add_argument("--repeat", type=int, default=3, help="runs per level; the report takes each number's median")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine and event-loop threads")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per level")
    ap.add_argument("--label", default="cpu")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results" / "host_overhead"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="the GIL switch interval the server process runs with (default: `m3serve serve`'s)")
    ap.add_argument("--no-gc-freeze", action="store_true", help="as `m3serve serve --no-gc-freeze`")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(1)
    from m3serve.llm import LLM, default_model
    from m3serve.server.app import BackgroundServer, build_app
    from m3serve.server.interpreter import tune_for_serving

    import logging
    logging.basicConfig(level=logging.WARNING)
    model = default_model()
    llm = LLM(model, device="cpu", max_num_seqs=args.max_num_seqs)
    engine = llm.engine
    vocab = llm.model.cfg.vocab_size
    token_range = (min(1000, vocab // 8), min(vocab, 30000))     # the bench client's prompt-id range
    stats = {"sync_steps": 0, "sync_rows": 0, "overlapped_steps": 0, "overlapped_rows": 0}
    _install_fakes(engine, args.device_step_us * 1e-6, args.eager_step_us * 1e-6, token_range, stats)
    srv = BackgroundServer(build_app(llm, served_model_name="m3-tiny-verse"), host="127.0.0.1", port=0).start()
    interpreter = tune_for_serving(args.switch_interval_ms, freeze_heap=not args.no_gc_freeze)
    spans = StepSpans(srv.engine_loop, stats)
    writes = WriteCounter()
    points = []
    try:
        for n in [int(x) for x in args.streams.split(",")]:
            runs = [run_level(srv, spans, stats, writes, n, args) for _ in range(args.repeat)]
            point = _median_point(runs)
            points.append(point)
            print(json.dumps({k: v for k, v in point.items() if k != "profile_top"}), flush=True)
            if "profile_top" in point:
                for thread, rows in point["profile_top"].items():
                    print(f"--- {thread} thread, top by tottime", flush=True)
                    for r in rows[:args.profile_top]:
                        print(f"  {r['tottime_s']:8.3f} {r['cumtime_s']:8.3f} {r['calls']:8d}  {r['function']}")
    finally:
        srv.stop()
    result = {
        "bench": "host_stream_cost", **run_metadata(), "model": os.path.basename(model),
        "setup": {"input_len": args.input_len, "output_len": args.output_len,
                  "requests_per_stream": args.requests_per_stream, "max_num_seqs": args.max_num_seqs,
                  "repeat": args.repeat,
                  "device_step_us": args.device_step_us, "eager_step_us": args.eager_step_us,
                  "profile": args.profile, "cpu_count": os.cpu_count(), **interpreter},
        "note": "CPU us per generated token by server thread; the device is a fixed GIL-free wait, the eager "
                "forward's host launch cost is not in it",
        "points": points,
    }
    if not args.no_write:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"host_stream_cost-{args.label}-{dt.date.today().isoformat()}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
