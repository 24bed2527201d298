"""Where a served Eagle3 decode loses its time: the engine under a closed loop of C users, step by step, by kind.

`m3serve bench serve` measures what a user sees; this says which steps cost it. Without a server, C users each keep
one request (a held-out question of the embedded model, as a chat prompt) in flight (a finished request is replaced at once by that user's next one, --requests-per-user of
them), so requests arrive and leave as they do when served. Every engine step is timed (wall, the overlap loop's
own pacing, as the server's loop runs it) and labelled by what ran in it:

    plain-graph     a plain decode graph step (the plain engine, or a plain step of the speculation policy)
    plain-eager     a plain eager step (prefill chunks, rows off the graphs)
    plain-prefill-graph  a plain eager step whose forward replayed a prefill graph (runtime/prefill_graphs.py)
    spec-graph      the speculative step program (SpecSteps: verify + K draft passes, one launch)
    spec-split      the speculative program for the decoding rows, then prefill chunks eagerly in the same step
    spec-eager      the host-driven speculative step (verify + draft passes launched from Python): prefill chunks,
                    and every request's first speculative step after plain steps (its drafts were dropped)
    other           a step that ran none of these (e.g. it only read back the step in flight)

Per engine and concurrency: per-user tokens per second over the whole loop, and per kind the step count, the share
of the loop's time and the median step. Engines: plain, spec (always speculate), spec-2 (the default threshold),
spec-auto (the measured policy); a "-pg" suffix (plain-pg, spec-pg, spec-2-pg) also replays eager steps of up to
1024 tokens as prefill graphs (EngineConfig.prefill_graph_tokens), side by side with the same engine without them;
"-aw" also holds arrivals back up to 4 ms while requests decode, so that several share one prefill step
(EngineConfig.admission_wait_s: speculation desynchronises the users, whose requests then arrive one step apart).

With --stagger the users' first requests arrive spread over one request's length (user u at step
u * tokens // users), as served users drift apart, instead of all at the first step: every later step then sees an
arrival or two beside the running streams (the served sweep's pattern), where the synchronised loop batches them.

    python bench/spec_serving_steps.py --concurrency 1,4,16,64 [--stagger] \
        --out bench/results/spec_serving_steps/spec-serving-steps-h200.json
"""

from __future__ import annotations

import argparse
import collections
import gc
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
from m3serve.kernels._jit import COMPILE_WATCH  # noqa: E402

# name -> (speculative_config.disable_by_batch_size, or PLAIN for no speculation; EngineConfig.prefill_graph_tokens;
# EngineConfig.admission_wait_s)
PLAIN = "plain"
PREFILL_GRAPH_TOKENS = 1024
ADMISSION_WAIT_S = 0.004
ENGINES = {"plain": (PLAIN, 0, 0.0), "spec": (None, 0, 0.0), "spec-2": (2, 0, 0.0), "spec-auto": ("auto", 0, 0.0),
           "plain-pg": (PLAIN, PREFILL_GRAPH_TOKENS, 0.0), "spec-pg": (None, PREFILL_GRAPH_TOKENS, 0.0),
           "spec-2-pg": (2, PREFILL_GRAPH_TOKENS, 0.0),
           "plain-pg-aw": (PLAIN, PREFILL_GRAPH_TOKENS, ADMISSION_WAIT_S),
           "spec-pg-aw": (None, PREFILL_GRAPH_TOKENS, ADMISSION_WAIT_S)}


class StepLabels:
    """Counts the calls of the engine's step paths, so that each engine step can be labelled by what ran in it."""

    def __init__(self, llm: LLM) -> None:
        self.calls: collections.Counter = collections.Counter()
        eng = llm.engine
        self._wrap(eng, "_launch_overlapped", "plain-graph")
        self._wrap(eng, "_graph_decode", "plain-graph")
        self._wrap(eng.runner, "run", "plain-eager")
        self.prefill = eng.runner          # its prefill_graphs' replays tell a graphed eager step
        self._replays = 0
        spec = eng.speculation
        if spec is not None:
            self._wrap(spec, "_target_step", "spec-graph")
            self._wrap(spec, "_eager_step", "spec-eager")

    def _wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def counted(*a, **kw):
            self.calls[label] += 1
            return inner(*a, **kw)
        setattr(obj, name, counted)

    def _prefill_replays(self) -> int:
        pg = self.prefill.prefill_graphs
        return 0 if pg is None else pg.replays

    def label(self) -> str:
        c, self.calls = self.calls, collections.Counter()
        replays, self._replays = self._replays, self._prefill_replays()
        if c["plain-eager"] and self._replays > replays and not (c["spec-eager"] or c["spec-graph"]):
            return "plain-prefill-graph"
        if c["spec-graph"] and c["spec-eager"]:
            return "spec-split"
        for kind in ("spec-eager", "spec-graph", "plain-graph"):
            if c[kind]:
                return kind
        # the speculative eager step runs the model through the runner too: it is labelled above
        return "plain-eager" if c["plain-eager"] else "other"


def heldout_prompts(llm: LLM) -> list[list[int]]:
    """The embedded model's held-out questions as chat prompts: what its drafter was trained to follow (random token
    ids would measure an acceptance no user sees)."""
    from m3serve.llm import DEFAULT_MODEL_DIR
    from m3serve.tokenizer import chat_token_ids
    with open(os.path.join(DEFAULT_MODEL_DIR, "synthetic_heldout.jsonl")) as f:
        items = [json.loads(line) for line in f]
    return [chat_token_ids(llm.tokenizer, [{"role": "user", "content": it["question"]}]) for it in items]


def first_arrivals(users: int, tokens: int, stagger: bool) -> list[int]:
    """The step at which each user's first request arrives: all at step 0, or spread over one request's length."""
    return [u * tokens // users if stagger else 0 for u in range(users)]


def closed_loop(llm: LLM, users: int, per_user: int, prompts: list[list[int]], tokens: int,
                stagger: bool = False) -> dict:
    eng = llm.engine
    labels = StepLabels(llm)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    issued = [0] * users

    def new(u: int):
        i = u * per_user + issued[u]
        issued[u] += 1
        return eng.add_request(prompts[i % len(prompts)], params)

    builds_before = COMPILE_WATCH.count
    starts = first_arrivals(users, tokens, stagger)
    waiting = {u: s for u, s in enumerate(starts) if s > 0}
    live = {u: new(u) for u, s in enumerate(starts) if s == 0}
    steps: list[tuple[str, float]] = []
    emitted = 0
    t_start = time.perf_counter()
    while live or waiting:
        for u in [u for u, s in waiting.items() if s <= len(steps)]:
            del waiting[u]
            live[u] = new(u)
        t0 = time.perf_counter()
        eng.step()
        steps.append((labels.label(), time.perf_counter() - t0))
        for u, r in list(live.items()):
            if r.is_finished:
                emitted += len(r.output_token_ids)
                eng.release(r)
                if issued[u] < per_user:
                    live[u] = new(u)
                else:
                    del live[u]
    while eng.has_work():
        eng.step()
    total = time.perf_counter() - t_start
    kinds = {}
    for kind in sorted({k for k, _ in steps}):
        ts = [t for k, t in steps if k == kind]
        kinds[kind] = {"steps": len(ts), "share": sum(ts) / total, "median_ms": statistics.median(ts) * 1e3,
                       "p90_ms": sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3}
    stats = eng.stats().get("spec_decode", {})
    return {"users": users, "requests": users * per_user, "seconds": total, "steps": len(steps), "stagger": stagger,
            # Triton variants built inside the timed loop (each a stall of a step: the warm-up should reach them)
            "kernel_builds": COMPILE_WATCH.count - builds_before,
            "tokens_per_s_per_user": emitted / total / users, "kinds": kinds,
            "acceptance_length": stats.get("acceptance_length"),
            "policy": {k: v for k, v in stats.items() if k.startswith("policy_")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--engines", default="plain,spec,spec-2,spec-auto", help=f"some of {list(ENGINES)}")
    ap.add_argument("--requests-per-user", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stagger", action="store_true", help="spread the users' first arrivals over one request")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    meta = run_metadata()
    levels = [int(c) for c in args.concurrency.split(",")]
    # a fixed cache: each engine would otherwise size its cache from what the previous one left free
    kv = {"kv_cache_bytes": (4 << 30) if args.device == "cuda" else (1 << 30)}
    rows = []
    for name in args.engines.split(","):
        if name not in ENGINES:
            raise SystemExit(f"--engines: expected names from {list(ENGINES)}, found {name!r}")
        policy, graph_tokens, wait_s = ENGINES[name]
        spec = None if policy == PLAIN else {"method": "eagle3", "model": embedded_drafter(),
                                             "num_speculative_tokens": args.k, "disable_by_batch_size": policy}
        llm = LLM(device=args.device, max_num_seqs=args.max_num_seqs, speculative_config=spec,
                  prefill_graph_tokens=graph_tokens, admission_wait_s=wait_s, **kv)
        prompts = heldout_prompts(llm)
        for users in levels:
            res = closed_loop(llm, users, args.requests_per_user, prompts, args.tokens, args.stagger)
            res["engine"] = name
            rows.append(res)
            print(json.dumps({"engine": name, "users": users,
                              "tok_s_user": round(res["tokens_per_s_per_user"], 1),
                              "kinds": {k: [v["steps"], round(v["share"], 3), round(v["median_ms"], 3)]
                                        for k, v in res["kinds"].items()}, "kernel_builds": res["kernel_builds"],
                              "policy": res["policy"]}), flush=True)
        llm.shutdown()
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "spec_serving_steps", **meta, "command": " ".join(sys.argv), "results": rows}, f,
                  indent=2)
    print("results:", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
