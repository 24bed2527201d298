"""The decode target with and without Eagle3 speculation, side by side in one run, per user at a fixed batch.

Both engines share one model (bf16, routed, CUDA graphs): the plain one replays DecodeGraphs, the speculative one
SpecSteps (verify + greedy acceptance + K draft passes per graph). Decode speed per user = output tokens after the
first one / the time after the first step (the prompt's prefill and the first drafts are excluded, the same way
for both engines); each configuration runs once untimed first (compilation, allocator).

    embedded model (m3-tiny-verse): its trained drafter, real acceptance on held-out chat questions; greedy outputs
                                    are compared token for token with the plain target's (identical_to_plain);
                                    --temperature > 0 samples (both engines on their sampling graphs)
    minimax-m3:N (random weights):  a random drafter with FORCED acceptance (--forced-al, the seed's 2.78): the
                                    drafts are accepted by count, so outputs are not the plain ones (null)

    python bench/spec_target.py --models m3-tiny-verse,minimax-m3:5 --batch 1,4 --k 3 --out bench/results/spec_target/spec-target-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from m3serve import LLM, SamplingParams  # noqa: E402
from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.engine.engine import EngineConfig  # noqa: E402
from m3serve.engine.speculative import speculative_engine  # noqa: E402
from m3serve.engine.warmup import warm_up  # noqa: E402
from m3serve.kernels._jit import COMPILE_WATCH  # noqa: E402
from m3serve.llm import DEFAULT_MODEL_DIR  # noqa: E402
from m3serve.tokenizer import chat_token_ids  # noqa: E402


def chat_prompts(llm, n: int) -> list[list[int]]:
    items = [json.loads(line) for line in open(os.path.join(DEFAULT_MODEL_DIR, "synthetic_heldout.jsonl"))][:n]
    return [chat_token_ids(llm.tokenizer, [{"role": "user", "content": it["question"]}]) for it in items]


def random_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode(engine, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[float, list[list[int]]]:
    """(tokens per second per user after each group's first step, outputs): the prompts run in groups of
    `batch`, one group after the other; per-user tokens and decode time are summed over the groups."""
    per_user, seconds, outs = 0.0, 0.0, []
    for g in range(0, len(prompts), batch):
        reqs = [engine.add_request(p, params) for p in prompts[g:g + batch]]
        engine.step()                                   # prefill (+ first drafts): not timed
        torch.cuda.synchronize()
        first = [len(r.output_token_ids) for r in reqs]
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        torch.cuda.synchronize()
        seconds += time.perf_counter() - t
        per_user += sum(len(r.output_token_ids) - f for r, f in zip(reqs, first)) / len(reqs)
        outs += [list(r.output_token_ids) for r in reqs]
    return per_user / seconds, outs


def bench_model(name: str, batches: list[int], ks: list[int], args) -> list[dict]:
    tiny = name == "m3-tiny-verse"
    kw = dict(dtype="bfloat16", route="auto", kv_cache_bytes=2 << 30, max_num_seqs=max(batches),
              max_model_len=args.context + 2 * args.max_tokens + 64)
    if tiny:
        llm = LLM(DEFAULT_MODEL_DIR, **kw)
        forced = None
    else:
        llm = LLM(name, random_weights=True, quantization=args.quantization, **kw)
        forced = args.forced_al
    plain = llm.engine
    cfg = EngineConfig(**{f: getattr(plain.config, f) for f in plain.config.__dataclass_fields__})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            ignore_eos=not tiny)
    greedy = args.temperature == 0
    engines = [("plain", 0, plain)]
    for k in ks:
        spec_cfg = {"method": "eagle3", "num_speculative_tokens": k, "disable_by_batch_size": None,  # every batch
                    "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3") if tiny else None}
        if forced is not None:
            spec_cfg["forced_acceptance"] = forced
        # started as LLM(speculative_config=...) starts one: graphs, then the warm-up requests, so that a kernel
        # variant built after this (the log names it) is one a served Eagle3 engine would build in front of a user
        with COMPILE_WATCH.startup():
            spec = speculative_engine(llm.model, cfg, llm.tokenizer, speculative_config=spec_cfg)
            if not spec.enable_target(graphs=True, mode="require"):
                raise SystemExit(f"{name}: the speculative target is off")
            warm_up(spec, seed=cfg.seed)
        engines.append(("spec", k, spec))
    rows = []
    for b in batches:
        n = args.groups * b
        ps = chat_prompts(llm, n) if tiny else random_prompts(llm.model.cfg.vocab_size, n, args.context)
        got, base = {}, None
        for mode, k, eng in engines:
            decode(eng, ps[:b], params, b)                            # warm-up
            if mode == "spec":
                eng.speculation.reset_stats()
                steps0 = eng.speculation.graph_steps
            tps, outs = decode(eng, ps, params, b)
            got[k] = outs
            st = eng.stats()["spec_decode"] if mode == "spec" else None
            row = {"model": name, "mode": mode, "batch": b, "k": k, "prompts": n,
                   "forced_al": forced if mode == "spec" else None,
                   "acceptance_length": st["acceptance_length"] if st else None,
                   "tokens_per_s_per_user": tps, "context": None if tiny else args.context,
                   "graph_steps": eng.speculation.graph_steps - steps0 if mode == "spec" else None,
                   "temperature": args.temperature, "top_p": args.top_p, "identical_to_plain": None}
            if mode == "plain":
                base = tps
            else:
                row["speedup_vs_plain"] = tps / base
                row["identical_to_plain"] = got[k] == got[0] if forced is None and greedy else None
                print(f"{name} b{b} K={k}: spec {tps:.0f} vs plain {base:.0f} tok/s/user = {tps / base:.2f}x, "
                      f"AL {row['acceptance_length']}, identical {row['identical_to_plain']}", flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    del engines, llm
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="m3-tiny-verse,minimax-m3:5")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--k", default="3", help="comma-separated draft counts (one speculative engine each)")
    ap.add_argument("--groups", type=int, default=4, help="prompt groups of `batch` run one after the other")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of the random-weight models")
    ap.add_argument("--forced-al", type=float, default=2.78)
    ap.add_argument("--quantization", default="nvfp4")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled requests (the speculative target's rejection-sampling graphs; one seed per "
                         "request, outputs not comparable token for token)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "spec_target", "spec-target-h200.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/spec_target.py: needs a CUDA GPU (the decode target's graphs)")
    batches = [int(x) for x in args.batch.split(",")]
    ks = [int(x) for x in args.k.split(",")]
    out = {"bench": "spec_target", **run_metadata(), "max_tokens": args.max_tokens, "results": []}
    for name in args.models.split(","):
        out["results"] += bench_model(name, batches, ks, args)
        with open(args.out, "w") as f:                        # saved after each model
            json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
