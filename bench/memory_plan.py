"""Per-rank GPU memory plan of MiniMax-M3 under tensor parallelism, computed from the config.

    python bench/memory_plan.py                       # TP4 and TP8, full depth, NVFP4 experts + MXFP8 projections
    python bench/memory_plan.py --tp 2 4 8 --markdown --max-context 131072
    python bench/memory_plan.py --max-layers --tp 1 2 # the deepest minimax-m3:L that fits (bench/tp.py uses this)

Nothing here is typed in by hand:
  weights     the model is built on the meta device with the TP rank's own sharding code (the shapes every
              rank really allocates), and each linear is priced in the format the published split gives its
              role (m3serve.model.checkpoint._linear_format): NVFP4 = 1/2 B per weight + 1 E4M3 byte per 16
              + fp32 per-part global scale; MXFP8 = 1 B + 1 E8M0 byte per 32; router, indexer, norms, embedding
              and head unquantized (router/norms fp32, embedding/head/indexer in the model dtype).
  KV pages    m3serve.kv.SlotLayout of the rank's KVCacheSpec (hybrid "nvfp4": NVFP4 K/V on the 57 MSA layers
              with E4M3 scales per 16, FP8 on the 3 dense layers, index-K bf16 or fp8), padding included.
  workspaces  the stock path's largest transient buffers for a prefill chunk of B tokens over a context of C
              keys (formulas in `stock_workspace`), per-call weight dequantization, the sampler's logits.
  reserve     CUDA context, NCCL buffers and allocator slack: RESERVE_BYTES, an assumption (not computed).
The KV budget follows LLMEngine's rule: utilization x GPU bytes minus what is resident after loading (the weights and
the reserve) minus the steps' planned working memory (m3serve/runtime/memory_plan.py; no graphs at TP > 1).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve.config import M3Config, preset  # noqa: E402
from m3serve.kv.layout import SlotLayout  # noqa: E402
from m3serve.kv.spec import KVCacheSpec  # noqa: E402
from m3serve.model.checkpoint import _linear_format  # noqa: E402
from m3serve.model.layers import Linear  # noqa: E402
from m3serve.model.m3 import M3ForCausalLM  # noqa: E402
from m3serve.model.parallel import TPGroup  # noqa: E402
from m3serve.runtime.memory_plan import plan_working_memory  # noqa: E402

GB = 1e9
GIB = 2 ** 30
H200_BYTES = 141 * GB                 # the brief's "141 GB per GPU" (torch reports ~139.8 GiB = 150 GB on H200)
RESERVE_BYTES = 3 * GIB               # CUDA context (~0.5-1 GiB), NCCL buffers, allocator fragmentation
QUERY_CHUNK = 256                     # m3serve.model.msa.attend processes queries in chunks of 256
_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


# ----------------------------------------------------------------------------- weights
def _role(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if name == "lm_head" or leaf.startswith("index_"):
        return "plain"
    if ".w13" in name or ".w2" in name or ".shared." in name:
        return "expert"
    return "proj"


def linear_bytes(n: int, k: int, experts: int | None, fmt: str, dtype_bytes: int, parts: int) -> int:
    e = experts or 1
    if fmt == "dense":
        return e * n * k * dtype_bytes
    if fmt == "mxfp8":
        return e * (n * k + n * math.ceil(k / 32))
    if fmt == "nvfp4":
        return e * (n * k // 2 + n * (k // 16) + 4 * parts)
    raise ValueError(f"fmt: expected dense, mxfp8 or nvfp4, found {fmt!r}")


def skeleton(cfg: M3Config, tp: int, dtype: torch.dtype = torch.bfloat16) -> M3ForCausalLM:
    """Rank 0's module tree (all ranks hold the same shapes) on the meta device: no memory."""
    with torch.device("meta"):
        return M3ForCausalLM(cfg, tp=TPGroup(0, tp), dtype=dtype)


def weight_bytes(cfg: M3Config, tp: int, quantization: str | None, dtype: torch.dtype = torch.bfloat16,
                 by_layer: bool = False) -> dict:
    """Resident weight bytes of one rank: {"total", "linears", "embed", "other", "layers": [...] (by_layer)}."""
    model = skeleton(cfg, tp, dtype)
    db = _DTYPE_BYTES[dtype]
    layers = [0] * cfg.num_hidden_layers
    lin = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        fmt = _linear_format(quantization, _role(name))
        parts = 2 if name.endswith(("gate_up_proj", "w13")) else 1
        b = linear_bytes(mod.out_features, mod.in_features, mod.num_experts, fmt, db, parts)
        lin += b
        if name.startswith("layers."):
            layers[int(name.split(".")[1])] += b
    embed = model.embed.vocab_local * cfg.hidden_size * db
    other = 0
    for name, p in model.named_parameters():        # norms, router, correction bias: fp32 (the loader's rule)
        if name != "embed.weight":
            other += p.numel() * 4
            if name.startswith("layers."):
                layers[int(name.split(".")[1])] += p.numel() * 4
    out = {"total": lin + embed + other, "linears": lin, "embed": embed, "other": other}
    if by_layer:
        out["layers"] = layers
    return out


# ----------------------------------------------------------------------------- KV pages
def kv_page_bytes(cfg: M3Config, tp: int, kv_cache_dtype: str = "nvfp4", index_k_dtype: str = "bf16",
                  num_draft_layers: int = 0) -> dict:
    spec = KVCacheSpec.from_model_config(cfg, tp_size=tp, kv_cache_dtype=kv_cache_dtype,
                                         index_k_dtype=index_k_dtype, model_dtype=torch.bfloat16,
                                         num_draft_layers=num_draft_layers)
    layout = SlotLayout(spec)
    page = layout.slot_bytes + layout.scale_slot_bytes
    return {"page_bytes": page, "page_tokens": spec.page_size, "bytes_per_token": page / spec.page_size,
            "padding_bytes": layout.padding_bytes + layout.scale_padding_bytes,
            "split": spec.split_summary(), "roles_per_token": spec.bytes_per_token()}


# ----------------------------------------------------------------------------- workspaces
def stock_workspace(cfg: M3Config, tp: int, quantization: str | None, *, tokens: int, context: int, seqs: int,
                    dtype: torch.dtype = torch.bfloat16) -> dict:
    """Largest transient buffers of the stock (reference) path on one rank, in bytes.

    tokens  B  tokens in one step (max_num_batched_tokens; one sequence may own all of them)
    context C  keys the longest sequence attends to;  seqs S  rows sampled in one step
      hidden      6 B H x 4 B          residual, norm outputs, fp32 MoE accumulator, all-reduce buffers
      attention   Hq/tp x 256 x C x 4 B x 3 (scores, mask fill, softmax) + index scores Hk/tp x B x C x 4 B x 3
                  (+ selection mask B x C bytes per head) + the sequence's dequantized K/V and index-K
      mlp         B x 2I/tp x (2 + 4 + 4) B (gate|up out, fp32 SwiGLU in/out), dense or one expert (worst case
                  every token on one expert)
      dequant     the largest quantized weight dequantized per call: fp32 copy + model-dtype copy
      logits      S x V/tp x 4 B (local) + S x V x 4 B x 4 (gathered rows, probs, noise, sort) when sampling
    Attention, MLP and logits are never live together: total = hidden + dequant + max(attention, mlp, logits).
    """
    model = skeleton(cfg, tp, dtype)
    db = _DTYPE_BYTES[dtype]
    a0 = model.layers[0].attn
    hq, hk, d, di = a0.hq, a0.hk, cfg.head_dim, cfg.index_head_dim
    b, c, h = tokens, context, cfg.hidden_size
    hidden = 6 * b * h * 4
    attn = hq * min(QUERY_CHUNK, b) * c * 4 * 3 + c * hk * d * db * 2 + c * di * db
    if "sparse" in cfg.layer_types:
        attn += hk * b * c * 4 * 3 + hk * b * c
    widths = [m.down_proj.in_features for m in model.modules() if hasattr(m, "down_proj")]
    widths += [m.w2.in_features for m in model.modules() if hasattr(m, "w2")]
    mlp = b * 2 * max(widths) * (db + 4 + 4)
    dequant = 0
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and _linear_format(quantization, _role(name)) != "dense":
            dequant = max(dequant, mod.out_features * mod.in_features * (4 + db))   # one expert at a time
    v_local = model.lm_head.out_features
    logits = seqs * v_local * 4 + seqs * cfg.vocab_size * 4 * 4
    total = hidden + dequant + max(attn, mlp, logits)
    return {"total": total, "hidden": hidden, "attention": attn, "mlp": mlp, "dequant": dequant, "logits": logits}


def load_transient(cfg: M3Config, tp: int, quantization: str | None, random_weights: bool,
                   dtype: torch.dtype = torch.bfloat16) -> int:
    """Peak extra bytes while loading one layer: its slices and the stacked copy (2 x the local layer); random
    weights are generated at full size on every rank first (the same tensors at any TP), then sliced."""
    local = max(weight_bytes(cfg, tp, quantization, dtype, by_layer=True)["layers"])
    full = max(weight_bytes(cfg, 1, quantization, dtype, by_layer=True)["layers"]) if random_weights else 0
    return full + 2 * local


# ----------------------------------------------------------------------------- plans
def plan(cfg: M3Config, tp: int, quantization: str | None = "nvfp4", *, gpu_bytes: float = H200_BYTES,
         utilization: float = 0.9, tokens: int = 2048, context: int = 131072, seqs: int = 64,
         index_k_dtype: str = "bf16", kv_cache_dtype: str = "nvfp4", num_draft_layers: int = 0) -> dict:
    w = weight_bytes(cfg, tp, quantization)
    kv = kv_page_bytes(cfg, tp, kv_cache_dtype, index_k_dtype, num_draft_layers)
    ws = stock_workspace(cfg, tp, quantization, tokens=tokens, context=context, seqs=seqs)
    working = plan_working_memory(cfg, max_num_seqs=seqs, max_num_batched_tokens=tokens, max_step_tokens=tokens,
                                  max_model_len=context, graphs=tp == 1, quantized_experts=quantization is not None)
    kv_budget = int(utilization * gpu_bytes) - w["total"] - RESERVE_BYTES - working.total
    pages = max(0, kv_budget // kv["page_bytes"])
    headroom = gpu_bytes - (w["total"] + RESERVE_BYTES + pages * kv["page_bytes"])
    return {
        "tp": tp, "layers": cfg.num_hidden_layers, "quantization": quantization, "gpu_bytes": gpu_bytes,
        "utilization": utilization, "weights": w, "reserve": RESERVE_BYTES,
        "working_memory": working.total, "kv": kv, "kv_budget": kv_budget,
        "kv_pages": pages, "kv_tokens": pages * kv["page_tokens"],
        "workspace": ws, "workspace_headroom": headroom, "workspace_fits": ws["total"] <= headroom,
        "load_transient_checkpoint": load_transient(cfg, tp, quantization, False),
        "load_transient_random": load_transient(cfg, tp, quantization, True),
        "workspace_args": {"tokens": tokens, "context": context, "seqs": seqs},
    }


def bench_bytes(cfg: M3Config, tp: int, quantization: str | None, dtype: torch.dtype, prompt: int,
                kv_tokens: int, _full: dict | None = None) -> int:
    """Peak bytes of bench/tp.py's run at this TP: weights, random-weight load transient, a prefill of `prompt`
    tokens (one sequence, greedy), a KV cache in the model dtype for `kv_tokens` and the reserve.
    `_full` caches per-layer weight bytes of a deeper config that `cfg` truncates (max_layers)."""
    n = cfg.num_hidden_layers
    if _full is None:
        _full = {t: weight_bytes(cfg, t, quantization, dtype, by_layer=True) for t in {1, tp}}
    local, full = _full[tp], _full[1]
    w = local["total"] - sum(local["layers"][n:])
    transient = max(full["layers"][:n]) + 2 * max(local["layers"][:n])
    ws = stock_workspace(cfg.truncated(min(n, 4)) if n < cfg.num_hidden_layers else cfg, tp, quantization,
                         tokens=prompt, context=prompt, seqs=1, dtype=dtype)["total"]
    spec = KVCacheSpec.from_model_config(cfg, tp_size=tp, kv_cache_dtype="auto", model_dtype=dtype)
    layout = SlotLayout(spec)
    kv = math.ceil(kv_tokens / spec.page_size) * (layout.slot_bytes + layout.scale_slot_bytes)
    return w + kv + RESERVE_BYTES + max(ws, transient)


def max_layers(tp: int, gpu_bytes: float, quantization: str | None = "nvfp4", *, dtypes=(torch.bfloat16,),
               prompt: int = 2176, kv_tokens: int = 3 * 2304, base: M3Config | None = None) -> int:
    """Deepest minimax-m3:L whose bench run fits `gpu_bytes` per rank at this TP in every dtype of `dtypes`
    (0 when not even one layer fits)."""
    base = base or M3Config()
    full = {dt: {t: weight_bytes(base, t, quantization, dt, by_layer=True) for t in {1, tp}} for dt in dtypes}
    best = 0
    for n in range(1, base.num_hidden_layers + 1):
        cfg = base.truncated(n)
        if all(bench_bytes(cfg, tp, quantization, dt, prompt, kv_tokens, full[dt]) <= gpu_bytes for dt in dtypes):
            best = n
        else:
            break
    return best


# ----------------------------------------------------------------------------- report
def _g(x: float) -> str:
    return f"{x / GB:.2f}"


def markdown(plans: list[dict]) -> str:
    ws = plans[0]["workspace_args"]
    rows = ["| | " + " | ".join(f"TP{p['tp']} idx-K {p['kv']['split'].split('index-K = ')[-1]}" for p in plans)
            + " |", "|---|" + "---|" * len(plans)]

    def row(label, f):
        rows.append(f"| {label} | " + " | ".join(f(p) for p in plans) + " |")

    row("weights per rank (GB)", lambda p: _g(p["weights"]["total"]))
    row("&nbsp;&nbsp;linears incl. lm_head slice (GB)", lambda p: _g(p["weights"]["linears"]))
    row("&nbsp;&nbsp;embedding slice (GB)", lambda p: _g(p["weights"]["embed"]))
    row("&nbsp;&nbsp;norms, routers (GB)", lambda p: _g(p["weights"]["other"]))
    row("reserve: context, NCCL, slack (GB)", lambda p: _g(p["reserve"]))
    row("KV page: 128 tokens (bytes)", lambda p: f"{p['kv']['page_bytes']:,}")
    row("KV bytes per token", lambda p: f"{p['kv']['bytes_per_token']:,.0f}")
    row(f"KV budget at {plans[0]['utilization']:.0%} (GB)", lambda p: _g(p["kv_budget"]))
    row("KV capacity (pages)", lambda p: f"{p['kv_pages']:,}")
    row("KV capacity (tokens)", lambda p: f"{p['kv_tokens']:,}")
    row(f"stock workspace B={ws['tokens']}, C={ws['context']}, S={ws['seqs']} (GB)",
        lambda p: _g(p["workspace"]["total"]))
    row("&nbsp;&nbsp;attention / mlp / dequant / logits (GB)",
        lambda p: " / ".join(_g(p["workspace"][k]) for k in ("attention", "mlp", "dequant", "logits")))
    row("headroom left for workspaces (GB)", lambda p: _g(p["workspace_headroom"]))
    row("workspace fits", lambda p: "yes" if p["workspace_fits"] else "**no**")
    row("load transient, checkpoint / random weights (GB)",
        lambda p: f"{_g(p['load_transient_checkpoint'])} / {_g(p['load_transient_random'])}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="minimax-m3")
    ap.add_argument("--tp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--quantization", default="nvfp4", choices=["nvfp4", "mxfp8", "none"])
    ap.add_argument("--gpu-bytes", type=float, default=H200_BYTES)
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument("--max-tokens", type=int, default=2048, help="max_num_batched_tokens (B)")
    ap.add_argument("--max-context", type=int, default=131072, help="longest context for the workspace (C)")
    ap.add_argument("--max-seqs", type=int, default=64, help="rows sampled per step (S)")
    ap.add_argument("--index-k", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--max-layers", action="store_true", help="print the deepest minimax-m3:L per TP that fits")
    args = ap.parse_args(argv)
    quant = None if args.quantization == "none" else args.quantization
    if args.max_layers:
        for tp in args.tp:
            print(f"TP{tp}: minimax-m3:{max_layers(tp, args.gpu_bytes, quant)} fits {args.gpu_bytes / GB:.0f} GB "
                  f"per GPU (bf16; with the fp32 reference: "
                  f"{max_layers(tp, args.gpu_bytes, quant, dtypes=(torch.bfloat16, torch.float32))})")
        return 0
    cfg = preset(args.preset)
    plans = [plan(cfg, tp, quant, gpu_bytes=args.gpu_bytes, utilization=args.utilization, tokens=args.max_tokens,
                  context=args.max_context, seqs=args.max_seqs, index_k_dtype=ik)
             for tp in args.tp for ik in args.index_k]
    if args.markdown:
        print(markdown(plans))
    else:
        print(json.dumps(plans, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["weight_bytes", "kv_page_bytes", "stock_workspace", "plan", "max_layers", "bench_bytes"]
