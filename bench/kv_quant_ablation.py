"""Which KV-cache quantization costs accuracy: per layer and per tensor (K / V) ablations on the held-out items.

Each plan names, per attention layer, how K and V are stored: "nvfp4" (the cache codec at a given amax),
"nvfp4-search" (the same decode, but the encoder picks each block's E4M3 scale among its neighbours by
least squared error: what a smarter encoder could reach without changing the format), "fp8" (the
unscaled FP8 cache) or exact. The engine runs with an fp32 cache and the chosen K/V round trip is applied
at the attention projection's output, which is exactly what quantize-on-write / dequantize-on-read does
(checked: plan `hybrid` reproduces `engine:kv=nvfp4` item for item, 370/500 with b=56, c=19).
Each plan is scored against the same run's `exact` plan with McNemar's exact test.

Shape legend: k, v [T, Hk, D] (the cache's view of one step's tokens).

Usage:
    python bench/kv_quant_ablation.py [--limit N] [--plans exact,hybrid,...]
Writes bench/results/kv_quant_ablation/kv-quant-ablation-cpu.json (per plan: exact match, b, c, p).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kv.cache import DEFAULT_NVFP4_KV_AMAX  # noqa: E402
from m3serve.quant.fp8 import cast_to_fp8  # noqa: E402
from m3serve.quant.nvfp4 import (E2M1_MAX, dequantize_nvfp4, e2m1_decode, e2m1_encode,  # noqa: E402
                                 nvfp4_global_scale, quantize_nvfp4)

# Multiples of the round-to-nearest block scale the searching encoder tries (E4M3 rounds them to neighbours).
SEARCH_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 1.05, 1.1)


def nvfp4_roundtrip(x: torch.Tensor, amax: float = DEFAULT_NVFP4_KV_AMAX) -> torch.Tensor:
    gs = nvfp4_global_scale(amax)
    packed, scale = quantize_nvfp4(x.float(), gs)
    return dequantize_nvfp4(packed, scale, gs, x.dtype)


def nvfp4_search_roundtrip(x: torch.Tensor, amax: float = DEFAULT_NVFP4_KV_AMAX) -> torch.Tensor:
    """Per 16-value block, the E4M3 scale (near amax16/6 * gs) with the least squared error; decode as NVFP4."""
    gs = nvfp4_global_scale(amax)
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    base = cast_to_fp8(blocks.abs().amax(-1, keepdim=True) / E2M1_MAX * gs).float()
    best, best_err = None, None
    for f in SEARCH_FACTORS:
        bs = cast_to_fp8(base * f).float()
        y = e2m1_decode(e2m1_encode(blocks * gs / bs)) * bs / gs
        y = torch.where(bs > 0, y, torch.zeros_like(y))
        err = (y - blocks).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, y, best), torch.where(better, err, best_err)
    return best.reshape(x.shape).to(x.dtype)


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    return cast_to_fp8(x.float()).to(x.dtype)


CODECS = {"nvfp4": nvfp4_roundtrip, "nvfp4-search": nvfp4_search_roundtrip, "fp8": fp8_roundtrip, None: None}


def plans(sparse: list[int], dense: list[int]) -> dict[str, dict[int, tuple[str | None, str | None]]]:
    """plan -> {layer: (K format, V format)}; layers not named stay exact."""
    hybrid = {**{i: ("nvfp4", "nvfp4") for i in sparse}, **{i: ("fp8", "fp8") for i in dense}}
    out = {
        "exact": {},
        "hybrid": hybrid,                                               # today's engine:kv=nvfp4
        "sparse-K-only": {i: ("nvfp4", None) for i in sparse},
        "sparse-V-only": {i: (None, "nvfp4") for i in sparse},
        "dense-fp8-only": {i: ("fp8", "fp8") for i in dense},
        "hybrid-block-scale-search": {**hybrid, **{i: ("nvfp4-search", "nvfp4-search") for i in sparse}},
    }
    for i in sparse:
        out[f"only-layer{i}-nvfp4"] = {i: ("nvfp4", "nvfp4")}
    if sparse:
        first = sparse[0]
        out[f"hybrid-layer{first}-fp8"] = {**hybrid, first: ("fp8", "fp8")}
        out[f"hybrid-layer{first}-K-fp8"] = {**hybrid, first: ("fp8", "nvfp4")}
    return out


def install(llm, plan: dict[int, tuple[str | None, str | None]]) -> None:
    """Wrap each planned layer's attention projection so K / V leave it already round-tripped."""
    for layer in llm.model.layers:
        attn = layer.attn
        if attn.layer not in plan:
            continue
        fk, fv = (CODECS[f] for f in plan[attn.layer])
        original = attn.project

        def project(x, cos, sin, detach_indexer=False, positions=None, original=original, fk=fk, fv=fv):
            q, k, v, iq, ik = original(x, cos, sin, detach_indexer, positions=positions)
            return q, (fk(k) if fk else k), (fv(v) if fv else v), iq, ik

        attn.project = project


def run_plan(model_dir: str, plan, items, max_tokens: int) -> list[str]:
    from m3serve.engine.sampling_params import SamplingParams
    from m3serve.llm import LLM
    from m3serve.train.tokenizer import chat_prompt

    llm = LLM(model_dir, device="cpu", dtype="fp32", kv_cache_dtype="auto")
    install(llm, plan)
    ids = [{"prompt_token_ids": llm.tokenizer.encode(chat_prompt(it.question), add_special_tokens=False)}
           for it in items]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [o.outputs[0].text for o in llm.generate(ids, params, use_tqdm=False)]


def main(argv: list[str] | None = None) -> int:
    from m3serve.config import M3Config
    from m3serve.eval.cli import default_model_dir
    from m3serve.eval.tasks import load_task
    from m3serve.eval.harness import score_outputs
    from m3serve.eval.mcnemar import discordant, mcnemar_exact_p

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--plans", default=None, help="comma-separated plan names (default: all)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "kv_quant_ablation", "kv-quant-ablation-cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = M3Config.from_file(args.model)
    sparse = [i for i, k in enumerate(cfg.layer_types) if k == "sparse"]
    dense = [i for i, k in enumerate(cfg.layer_types) if k != "sparse"]
    table = plans(sparse, dense)
    names = list(table) if args.plans is None else args.plans.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"--plans: unknown {unknown}; expected names from {list(table)}")
    if "exact" not in names:
        names = ["exact"] + names
    items = load_task("synthetic", args.model, args.limit)
    result = {**run_metadata(), "model": args.model, "n": len(items), "sparse_layers": sparse,
              "nvfp4_amax": DEFAULT_NVFP4_KV_AMAX, "plans": {}}
    reference = None
    for name in names:
        t0 = time.perf_counter()
        outs = run_plan(args.model, table[name], items, args.max_tokens)
        score = score_outputs(name, items, outs, time.perf_counter() - t0)
        correct = score.correct["strict"]
        reference = correct if name == "exact" else reference
        b, c = discordant(reference, correct)
        row = {"layers": {str(i): list(f) for i, f in table[name].items()}, "exact_match": score.exact_match("strict"),
               "correct": sum(correct), "b": b, "c": c, "p_value": mcnemar_exact_p(b, c), "wall_s": score.wall_s}
        result["plans"][name] = row
        print(f"{name:28s} EM {row['exact_match']:.3f}  b={b:3d} c={c:3d}  p={row['p_value']:.3g}  "
              f"({row['wall_s']:.0f} s)", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
