"""Serving benchmark: a closed-loop streaming client (aiohttp) at fixed concurrency levels.

At concurrency c, c workers each keep exactly one request in flight (closed loop). Workloads:
  fixed    every request: `input_len` random prompt tokens, exactly `output_len` generated (ignore_eos)
  agentic  each worker is one user in a multi-turn conversation: turn 1 = a system prefix shared by all users
           + `input_len` user tokens; each next turn resends the whole context (previous prompt + the model's
           reply + `input_len` new tokens), so prefixes shared with earlier turns (and with other users) grow.
Prompts are token ids (/v1/completions accepts them), so lengths are exact whatever the tokenizer.

The client must not be the bottleneck: one Python process parses ~40-50k SSE events a second (seen on the H200 at
64 users: a plain server's tokens reached the client in bursts 16 us apart, its ITL p50). At concurrency c the users
are spread over `client_procs` processes ("auto": one per 16 users, up to a quarter of the CPUs and 8), each with its
own event loop and connection pool; the level's records are merged (time.perf_counter is the system's monotonic
clock, the same in every process) and its duration runs from the first start to the last finish.

Per level: TTFT, ITL and per-request TPOT (mean, P50/P90/P99, ms); interactivity x90 = 1/P90(ITL) tokens/s
per user (the axis of the Pareto chart) and, for comparison, 1/P90(TPOT); output and total (input + output,
cached input included) tokens/s, and both per GPU.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from m3serve.benchmeta import git_commit

WORKLOADS = ("fixed", "agentic")


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    model: str | None = None                     # default: the server's first /v1/models entry
    workload: str = "fixed"
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    input_len: int = 1024
    output_len: int = 128
    requests_per_user: int = 4                   # fixed: requests per level = concurrency x this
    turns: int = 4                               # agentic: turns per user
    shared_prefix_len: int = 512                 # agentic: system prefix shared by every user
    temperature: float = 0.0
    num_gpus: int = 1
    seed: int = 0
    token_range: tuple[int, int] | None = None   # prompt ids drawn from [lo, hi); default from the vocab size
    timeout_s: float = 3600.0
    label: str | None = None
    progress: bool = True
    client_procs: int | str = "auto"             # processes the users are spread over ("auto": client_procs_for)

    def validate(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: expected one of {WORKLOADS}, found {self.workload!r}")
        if not self.concurrency or any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency: expected positive integers, found {self.concurrency}")
        if self.client_procs != "auto" and (isinstance(self.client_procs, bool) or not isinstance(self.client_procs, int)
                                            or self.client_procs < 1):
            raise ValueError(f"client_procs: expected a positive int or 'auto', found {self.client_procs!r}")
        for name in ("input_len", "output_len", "requests_per_user", "turns", "num_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, found {getattr(self, name)}")
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len: expected >= 0, found {self.shared_prefix_len}")

    def context_needed(self) -> int:
        if self.workload == "fixed":
            return self.input_len + self.output_len
        return self.shared_prefix_len + self.turns * (self.input_len + self.output_len)


@dataclass
class Record:
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)   # arrival time of every generated token
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- one request
async def stream_completion(session, cfg: BenchConfig, prompt: list[int]) -> Record:
    rec = Record(start=time.perf_counter())
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "return_token_ids": True}
    try:
        async with session.post(cfg.base_url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    rec.ok = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    rec.error = str(ev["error"].get("message"))
                    return rec
                now = time.perf_counter()
                for c in ev.get("choices") or []:
                    ids = c.get("token_ids")
                    n = len(ids) if ids is not None else int(bool(c.get("text")))
                    rec.output_ids += ids or []
                    rec.token_times += [now] * n
                if ev.get("usage"):
                    rec.prompt_tokens = ev["usage"]["prompt_tokens"]
                    rec.output_tokens = ev["usage"]["completion_tokens"]
    except (OSError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if not rec.ok:
        rec.error = "the stream ended without [DONE]"
    rec.prompt_tokens = rec.prompt_tokens or len(prompt)
    rec.output_tokens = rec.output_tokens or len(rec.token_times)
    return rec


# ---------------------------------------------------------------------------------------- statistics
def _dist(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: list[Record], duration_s: float, concurrency: int, num_gpus: int) -> dict:
    ok = [r for r in records if r.ok]
    ttft = [(r.token_times[0] - r.start) * 1e3 for r in ok if r.token_times]
    itl: list[float] = []
    tpot: list[float] = []
    for r in ok:
        t = r.token_times
        # Tokens that arrive in one chunk (e.g. one speculative step) share that chunk's gap evenly; extra
        # tokens in the first chunk have no gap of their own.
        groups: list[list] = []
        for x in t:
            if groups and groups[-1][0] == x:
                groups[-1][1] += 1
            else:
                groups.append([x, 1])
        for (t_prev, _), (t_now, n) in zip(groups, groups[1:]):
            itl += [(t_now - t_prev) * 1e3 / n] * n
        if len(t) >= 2:
            tpot.append((t[-1] - t[0]) * 1e3 / (len(t) - 1))
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    d = max(duration_s, 1e-9)
    itl_d, tpot_d = _dist(itl), _dist(tpot)
    return {
        "concurrency": concurrency, "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5], "duration_s": duration_s,
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "mean_input_len": in_tok / len(ok) if ok else None, "mean_output_len": out_tok / len(ok) if ok else None,
        "request_throughput": len(ok) / d,
        "output_tokens_per_s": out_tok / d, "total_tokens_per_s": (in_tok + out_tok) / d,
        "output_tokens_per_s_per_gpu": out_tok / d / num_gpus,
        "total_tokens_per_s_per_gpu": (in_tok + out_tok) / d / num_gpus,
        "ttft_ms": _dist(ttft), "itl_ms": itl_d, "tpot_ms": tpot_d,
        "interactivity_x90": 1e3 / itl_d["p90"] if itl_d["p90"] else None,
        "interactivity_tpot_p90": 1e3 / tpot_d["p90"] if tpot_d["p90"] else None,
    }


# ---------------------------------------------------------------------------------------- workloads
class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.done, self.total, self.enabled = 0, total, enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="bench serve", unit="req", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            pass

    def update(self, desc: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 20) == 0):
            print(f"bench serve: {self.done}/{self.total} requests ({desc})", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _fixed(session, cfg: BenchConfig, c: int, rng: random.Random, lo: int, hi: int, prog) -> list[Record]:
    prompts = [[rng.randrange(lo, hi) for _ in range(cfg.input_len)] for _ in range(c * cfg.requests_per_user)]
    records: list[Record] = []
    it = iter(prompts)

    async def worker():
        for p in it:
            records.append(await stream_completion(session, cfg, p))
            prog.update(f"c={c}")
    await asyncio.gather(*(worker() for _ in range(c)))
    return records


async def _agentic(session, cfg: BenchConfig, c: int, rng: random.Random, lo: int, hi: int, prog,
                   users: range | None = None) -> list[Record]:
    """Users `users` (default all c) of a level: every process of a spread client draws the same shared prefix
    and each user's own stream from (the level's rng, its index)."""
    shared = [rng.randrange(lo, hi) for _ in range(cfg.shared_prefix_len)]
    base = rng.random()
    records: list[Record] = []

    async def user(u: int):
        urng = random.Random(f"{base}-{u}")
        context = shared + [urng.randrange(lo, hi) for _ in range(cfg.input_len)]
        for _ in range(cfg.turns):
            rec = await stream_completion(session, cfg, context)
            records.append(rec)
            prog.update(f"c={c}")
            if not rec.ok:
                return
            reply = rec.output_ids or [urng.randrange(lo, hi) for _ in range(rec.output_tokens)]
            context = context + reply + [urng.randrange(lo, hi) for _ in range(cfg.input_len)]
    await asyncio.gather(*(user(u) for u in (users if users is not None else range(c))))
    return records


def client_procs_for(cfg: BenchConfig, c: int) -> int:
    """Client processes for concurrency c: cfg.client_procs (at most c), or "auto": one per 16 users, at most a
    quarter of the CPUs (the server shares the machine) and 8."""
    if cfg.client_procs != "auto":
        return min(int(cfg.client_procs), c)
    return max(1, min(c // 16, (os.cpu_count() or 1) // 4, 8))


def _session(cfg: BenchConfig):
    import aiohttp
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=cfg.timeout_s))


def _worker_ready(hold_s: float) -> int:
    time.sleep(hold_s)          # held, so that each of the warm-up's tasks starts a process of its own
    return os.getpid()


def _share_of_level(cfg: BenchConfig, c: int, k: int, proc: int, procs: int, lo: int, hi: int
                    ) -> tuple[list[Record], float, float]:
    """One client process's users of level k (run in a worker process): (records, start, finish)."""
    async def main():
        async with _session(cfg) as session:
            t0 = time.perf_counter()
            if cfg.workload == "fixed":
                share = c // procs + (proc < c % procs)
                rng = random.Random(f"{cfg.seed}-{k}-{proc}")
                records = await _fixed(session, cfg, share, rng, lo, hi, _Progress(0, False))
            else:
                users = range(proc, c, procs)
                records = await _agentic(session, cfg, c, random.Random(cfg.seed * 1_000_003 + k), lo, hi,
                                         _Progress(0, False), users)
            return records, t0, time.perf_counter()
    return asyncio.run(main())


async def _server_info(session, cfg: BenchConfig) -> dict:
    async with session.get(cfg.base_url + "/v1/models") as r:
        if r.status != 200:
            raise RuntimeError(f"GET {cfg.base_url}/v1/models: HTTP {r.status}: {(await r.text())[:300]}")
        data = (await r.json())["data"]
    if not data:
        raise RuntimeError(f"{cfg.base_url}/v1/models lists no model")
    card = next((m for m in data if m["id"] == cfg.model), None) if cfg.model else data[0]
    if card is None:
        raise RuntimeError(f"model {cfg.model!r} is not served at {cfg.base_url} (it serves {[m['id'] for m in data]})")
    return card


async def _spread_level(pool, cfg: BenchConfig, c: int, k: int, procs: int, lo: int, hi: int, prog
                        ) -> tuple[list[Record], float]:
    """Level k over `procs` client processes: the merged records and the level's duration."""
    loop = asyncio.get_running_loop()
    parts = await asyncio.gather(*(loop.run_in_executor(pool, _share_of_level, cfg, c, k, i, procs, lo, hi)
                                   for i in range(procs)))
    records = [r for recs, _, _ in parts for r in recs]
    for _ in records:
        prog.update(f"c={c}")
    return records, max(t1 for _, _, t1 in parts) - min(t0 for _, t0, _ in parts)


async def run_bench(cfg: BenchConfig) -> dict:
    cfg.validate()
    spread = max(client_procs_for(cfg, c) for c in cfg.concurrency)
    # spawned once for the run (their start-up stays out of every level's time); spawn: no forked event loop
    pool = ProcessPoolExecutor(spread, mp_context=multiprocessing.get_context("spawn")) if spread > 1 else None
    if pool is not None:
        list(pool.map(_worker_ready, [0.2] * spread))
    try:
        return await _run_levels(cfg, pool)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


async def _run_levels(cfg: BenchConfig, pool) -> dict:
    async with _session(cfg) as session:
        card = await _server_info(session, cfg)
        cfg.model = card["id"]
        vocab = card.get("vocab_size")
        lo, hi = cfg.token_range or ((min(1000, vocab // 8), min(vocab, 30000)) if vocab else (100, 1000))
        limit = card.get("max_model_len")
        if limit is not None and cfg.context_needed() > limit:
            raise ValueError(f"the {cfg.workload} workload needs {cfg.context_needed()} tokens of context; the "
                             f"server's max_model_len is {limit}")
        per_level = [c * (cfg.requests_per_user if cfg.workload == "fixed" else cfg.turns) for c in cfg.concurrency]
        prog = _Progress(sum(per_level), cfg.progress)
        run = _fixed if cfg.workload == "fixed" else _agentic
        levels = []
        try:
            for k, c in enumerate(cfg.concurrency):
                procs = client_procs_for(cfg, c)
                if procs > 1:
                    records, duration = await _spread_level(pool, cfg, c, k, procs, lo, hi, prog)
                else:
                    rng = random.Random(cfg.seed * 1_000_003 + k)
                    t0 = time.perf_counter()
                    records = await run(session, cfg, c, rng, lo, hi, prog)
                    duration = time.perf_counter() - t0
                levels.append({**summarize(records, duration, c, cfg.num_gpus), "client_procs": procs})
        finally:
            prog.close()
    meta = asdict(cfg)
    meta.pop("api_key", None)
    meta["label"] = cfg.label or f"{cfg.model} {cfg.workload}"
    meta["server_device"] = card.get("device")       # "cuda" / "cpu" from an m3serve server, else unknown
    meta["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["x_axis"] = "interactivity_x90 = 1000 / P90(ITL ms), tokens/s/user"
    meta["y_axis"] = "total_tokens_per_s_per_gpu = (input + output tokens) / s / num_gpus"
    return {"commit": git_commit(), "meta": meta, "results": levels}


def format_table(result: dict) -> str:
    rows = [f"{'conc':>5} {'req':>5} {'fail':>4} {'TTFT p50/p90 ms':>17} {'ITL p50/p90/p99 ms':>22} "
            f"{'x90 tok/s/u':>11} {'out tok/s':>10} {'tot tok/s/GPU':>13}"]

    def f(v, w=0):
        return f"{v:.{w}f}" if v is not None else "-"
    for r in result["results"]:
        t, i = r["ttft_ms"], r["itl_ms"]
        rows.append(f"{r['concurrency']:>5} {r['requests']:>5} {r['failed']:>4} "
                    f"{f(t['p50'], 1) + '/' + f(t['p90'], 1):>17} "
                    f"{f(i['p50'], 2) + '/' + f(i['p90'], 2) + '/' + f(i['p99'], 2):>22} "
                    f"{f(r['interactivity_x90'], 1):>11} {f(r['output_tokens_per_s'], 1):>10} "
                    f"{f(r['total_tokens_per_s_per_gpu'], 1):>13}")
    return "\n".join(rows)
