"""End-to-end decode throughput with and without Eagle3 speculation, side by side in one run.

For each batch size: the same prompts (held-out synthetic questions in the chat template, and held-out verse),
greedy and temperature 0.8, `max_tokens` each; plain engine vs speculative decoding (K = 3). Reports output
tokens/s and the mean acceptance length (tokens emitted per verify step). Greedy outputs of the two engines
are also compared token for token (they must be identical).

    python bench/spec_decode.py --device cuda --drafter m3serve/assets/m3-tiny-verse/eagle3
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
from m3serve.llm import DEFAULT_MODEL_DIR  # noqa: E402
from m3serve.tokenizer import chat_token_ids  # noqa: E402


def prompts(llm, n: int) -> list[dict]:
    tok = llm.tokenizer
    items = [json.loads(line) for line in open(os.path.join(DEFAULT_MODEL_DIR, "synthetic_heldout.jsonl"))][:n]
    return [{"prompt_token_ids": chat_token_ids(tok, [{"role": "user", "content": it["question"]}])}
            for it in items]


def run(llm, ps, params) -> tuple[float, list, dict | None]:
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats().get("spec_decode")
    return n / dt, [o.outputs[0].token_ids for o in outs], stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--drafter", default=os.path.join(DEFAULT_MODEL_DIR, "eagle3"))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the speculative step itself at every batch size (the batch-size policy off)
    spec_cfg = {"method": "eagle3", "model": args.drafter, "num_speculative_tokens": args.k,
                "disable_by_batch_size": None}
    # Two engines share the process: each takes a bounded KV budget instead of 90 % of the GPU.
    kv = {"kv_cache_bytes": 2 << 30}
    plain = LLM(DEFAULT_MODEL_DIR, device=args.device, **kv)
    spec = LLM(DEFAULT_MODEL_DIR, device=args.device, speculative_config=spec_cfg, **kv)
    results = []
    for b in (int(x) for x in args.batch.split(",")):
        ps = prompts(plain, b)
        for temp in (0.0, 0.8):
            sp = SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=1 if temp else None,
                                ignore_eos=True)
            run(plain, ps, sp)                                     # warm-up (allocator, kernels)
            tps_plain, toks_plain, _ = run(plain, ps, sp)
            run(spec, ps, sp)
            if spec.engine.speculation is not None:
                spec.engine.speculation.reset_stats()
            tps_spec, toks_spec, stats = run(spec, ps, sp)
            r = {"batch": b, "temperature": temp, "plain_tok_s": tps_plain, "spec_tok_s": tps_spec,
                 "speedup": tps_spec / tps_plain, "spec_stats": stats}
            if temp == 0.0:
                r["greedy_identical"] = toks_plain == toks_spec
            print(json.dumps(r), flush=True)
            results.append(r)
    out = {"bench": "spec_decode", **run_metadata(), "device": str(plain.device), "dtype": str(plain.dtype),
           "model": "m3-tiny-verse", "drafter": args.drafter, "k": args.k, "max_tokens": args.max_tokens,
           "results": results}
    path = args.out or os.path.join(os.path.dirname(__file__), "results", "spec_decode",
                                    f"spec-decode-{plain.device.type}-{out['date'][:10]}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
