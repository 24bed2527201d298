"""The memory plan against what start-up takes: for each configuration, build the engine as `m3serve serve` would
(default gpu_memory_utilization, graphs, warm-up), then record the planned working memory by term
(runtime/memory_plan.py), what was taken once start-up finished (`LLM.memory_report`), each graph set's pool and
the KV pages left.

    python bench/memory_plan_startup.py --configs embedded:spec minimax-m3:5:spec:nvfp4 \
        --out bench/results/memory_plan_startup/memory-plan-startup-h200.json

A config is MODEL:MODE[:QUANT] with MODEL `embedded` (the default model) or a preset, MODE `plain` or `spec`
(Eagle3, K = --k; the embedded drafter, or random weights for a preset).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from m3serve.benchmeta import run_metadata  # noqa: E402


def parse_config(text: str) -> tuple[str, str, str | None]:
    """MODEL:MODE[:QUANT]; a preset name may hold one colon itself (minimax-m3:5)."""
    parts = text.split(":")
    if len(parts) >= 2 and parts[-1] not in ("plain", "spec"):
        quant, parts = parts[-1], parts[:-1]
    else:
        quant = None
    if len(parts) < 2 or parts[-1] not in ("plain", "spec"):
        raise ValueError(f"--configs: expected MODEL:plain|spec[:QUANT], found {text!r}")
    return ":".join(parts[:-1]), parts[-1], quant


def llm_kwargs(model: str, mode: str, quant: str | None, max_num_seqs: int, k: int, max_model_len: int) -> dict:
    from m3serve.llm import default_model
    embedded = model == "embedded"
    kw = {"dtype": "bfloat16"} if embedded else {"model": model, "random_weights": True, "quantization": quant,
                                                  "max_model_len": max_model_len}
    kw["max_num_seqs"] = max_num_seqs
    if mode == "spec":
        kw["speculative_config"] = {"method": "eagle3", "num_speculative_tokens": k,
                                    "model": os.path.join(default_model(), "eagle3") if embedded else None}
    return kw


def measure(model: str, mode: str, quant: str | None, args) -> dict:
    from m3serve import LLM
    llm = LLM(**llm_kwargs(model, mode, quant, args.max_num_seqs, args.k, args.max_model_len))
    plan = llm.engine.runner.working_memory
    free, total = torch.cuda.mem_get_info()
    row = {"model": model, "mode": mode, "quantization": quant or "none", "max_num_seqs": args.max_num_seqs,
           "k": args.k if mode == "spec" else 0, **llm.memory_report,
           "plan_terms_bytes": dict(plan.__dict__), "plan": plan.describe(),
           "graph_memory_bytes": llm.engine.stats()["graph_memory_bytes"], "kv_pages": llm.engine.kv.num_slots,
           "card_bytes": total, "free_after_start_bytes": free}
    row["measured_over_planned"] = row["measured_working_bytes"] / row["planned_working_bytes"]
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["embedded:spec", "minimax-m3:5:spec:nvfp4"])
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=8192, help="presets only (the embedded model's own)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/memory_plan_startup.py: the plan is for a CUDA card (none found)")
    configs = [parse_config(c) for c in args.configs]
    meta = run_metadata()
    results = []
    for model, mode, quant in configs:
        row = measure(model, mode, quant, args)
        print(json.dumps({k: v for k, v in row.items() if k != "plan_terms_bytes"}), flush=True)
        results.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "memory_plan_startup", **meta, "results": results}, f, indent=2)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
