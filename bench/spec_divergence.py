"""Where speculative and plain greedy outputs part, and how close the target's top two logits are there.

Greedy speculation is exact only up to the summation order of the kernels: a verify step runs K+1 query rows per
sequence (other split-KV plans, other GEMM shapes than a one-row decode step), so at a near-tie the argmax may
flip. This runs the plain decode target and the speculative one (overlap loop on and off) on the same prompts,
and for every prompt whose outputs differ reports the first differing position and the stock forward's top-1 -
top-2 logit gap at it (fp32 logits of the bf16 model, the whole prefix at once).

    python bench/spec_divergence.py --batch 4 --prompts 16 --out bench/results/spec_divergence/spec-divergence-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from m3serve.benchmeta import run_metadata  # noqa: E402
from bench.spec_target import chat_prompts, decode  # noqa: E402
from m3serve import LLM, SamplingParams  # noqa: E402
from m3serve.engine.engine import EngineConfig  # noqa: E402
from m3serve.engine.speculative import speculative_engine  # noqa: E402
from m3serve.llm import DEFAULT_MODEL_DIR  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(DEFAULT_MODEL_DIR, dtype="bfloat16", kv_cache_bytes=1 << 30, max_num_seqs=args.batch)
    ps = chat_prompts(llm, args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    _, plain = decode(llm.engine, ps, params, args.batch)
    cfg = EngineConfig(**{f: getattr(llm.engine.config, f) for f in llm.engine.config.__dataclass_fields__})
    spec_cfg = {"method": "eagle3", "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3"), "num_speculative_tokens": 3,
                "disable_by_batch_size": None}       # the speculative step at this batch, not the policy
    out = {"bench": "spec_divergence", **run_metadata(), "batch": args.batch, "prompts": args.prompts, "runs": []}
    for overlap in (True, False):
        eng = speculative_engine(llm.model, cfg, llm.tokenizer, speculative_config=spec_cfg)
        assert eng.enable_target(graphs=True, mode="require")
        eng.overlap = overlap
        _, spec = decode(eng, ps, params, args.batch)
        diffs = []
        for i, (a, b) in enumerate(zip(plain, spec)):
            if a == b:
                continue
            j = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            ids = torch.tensor(ps[i] + a[:j], device=llm.device)[None]
            with torch.inference_mode():
                logits = llm.model.forward_train(ids, sparse_attention=True)[0][0, -1].float()
            top = logits.topk(2)
            diffs.append({"prompt": i, "position": j, "plain": a[j] if j < len(a) else None,
                          "spec": b[j] if j < len(b) else None, "top2": top.indices.tolist(),
                          "gap": float(top.values[0] - top.values[1])})
        run = {"overlap": overlap, "differing_prompts": len(diffs), "diffs": diffs}
        print(json.dumps(run), flush=True)
        out["runs"].append(run)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
