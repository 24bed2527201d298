"""Explicit routing of one model's modules to certified Triton entries (the Hopper decode target).

    install(model, "off")      the stock path, byte for byte (no hook on any module)
    install(model, "auto")     modules whose (rows, shape) lie in a certified cell run the entry; others stock
    install(model, "require")  as auto, but a module outside every certified cell raises, naming the shape and cell

The mode belongs to the model it is installed on (a hook per module, bound to its mode): two models in one
process route independently. Nothing here reads the environment.
Routed today: quantized linears (linear.nvfp4 / linear.mxfp8 / linear.fp8, 1-48 rows) and the NVFP4 MoE
layer (moe.nvfp4: router + routed experts + shared expert in three launches). Workspaces and output
buffers are made once per call site and row cell, before any graph capture could need them.
"""

from __future__ import annotations

import torch

import functools

from m3serve.targets.dispatch import MODES, lookup


def _workspace(module, key, make):
    """Per call site and cell, kept on the module itself (so it is freed with it and never shared by two
    modules, as the entries require)."""
    store = module.__dict__.setdefault("_routed_workspaces", {})
    if key not in store:
        store[key] = make()
    return store[key]


def install(model, mode: str) -> None:
    """Route `model`'s quantized linears and MoE layers in `mode` (replacing any earlier mode)."""
    from m3serve.model.layers import Linear
    from m3serve.model.moe import MoE
    if mode not in MODES:
        raise ValueError(f"route mode: expected one of {MODES}, found {mode!r}")
    on = mode != "off"
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.dispatch = functools.partial(_linear, mode=mode) if on else None
        elif isinstance(mod, MoE):
            mod.dispatch = functools.partial(_moe, mode=mode) if on else None
    model.route_mode = mode


def mode_of(model) -> str:
    return getattr(model, "route_mode", "off")


def _per_row(lin, t: torch.Tensor, n: int) -> torch.Tensor:
    """A [P] per-part scale as the entries take it: 0-dim when P == 1, else one value per output row (kept on
    the module, so it lives and dies with the weight it belongs to)."""
    if t.numel() == 1:
        return t.reshape(())
    cached = getattr(lin, "_routed_row_scale", None)
    if cached is None or cached.shape[0] != n:
        cached = lin._routed_row_scale = t.float().repeat_interleave(n // t.numel()).contiguous()
    return cached


def _linear(lin, x: torch.Tensor, mode: str):
    if x.device.type != "cuda" or lin.num_experts is not None or lin.fmt not in ("nvfp4", "mxfp8", "fp8"):
        if mode == "require" and x.device.type == "cuda" and lin.fmt in ("nvfp4", "mxfp8", "fp8"):
            raise ValueError(f"{lin.name}: require mode, but stacked expert linears route through moe.nvfp4")
        return None
    n, k = lin.out_features, lin.in_features
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if x2.dtype != torch.bfloat16:
        if mode == "require":
            raise ValueError(f"{lin.name}: require mode needs bf16 activations, found {x2.dtype}")
        return None
    entry = lookup(f"linear.{lin.fmt}", rows, (n, k), mode)
    if entry is None:
        return None
    cell = entry.cell_for(rows, (n, k))
    cfg = cell.config["gemm"]
    from m3serve.kernels._linear import make_workspace
    ws = _workspace(lin, cell.rows, lambda: make_workspace(cfg, n, x.device))
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
    x2 = x2.contiguous()
    if lin.fmt == "nvfp4":
        entry.raw_call(x2, lin.q_packed, lin.q_scale, _per_row(lin, lin.q_global_scale, n), out, ws, cfg)
    elif lin.fmt == "mxfp8":
        entry.raw_call(x2, lin.q_q, lin.q_scale, out, ws, cfg)
    else:
        entry.raw_call(x2, lin.q_q, _per_row(lin, lin.q_scale, n), out, ws, cfg)
    return out.view(*x.shape[:-1], n)


# A dense-weight MoE with at most this many experts runs every expert on every token (masked): no host sync,
# so it can be captured in a CUDA graph; beyond it the wasted FLOPs outweigh that (the stock loop runs).
ALL_EXPERTS_MAX = 16


def moe_all_experts(m, x: torch.Tensor) -> torch.Tensor:
    """The stock MoE without `torch.unique(...).tolist()`: every expert's GEMMs on all T tokens (two batched
    matmuls), each token's output the same fp32 sum of its selected experts in ascending expert order (other
    experts contribute an exact 0). Differs from stock only in the GEMMs' blocking. x [T, H] -> [T, H]."""
    from m3serve.model.layers import swiglu_oai
    from m3serve.model.moe import route
    ids, weights = route(x, m.router, m.e_score_correction_bias, m.top_k)          # [T, A]
    e = m.w13.num_experts
    w13, w2 = m.w13.dense_weight(x.dtype), m.w2.dense_weight(x.dtype)               # [E, 2I, H], [E, H, I]
    xe = x.unsqueeze(0).expand(e, *x.shape)                                          # [E, T, H]
    a = swiglu_oai(torch.bmm(xe, w13.transpose(1, 2)), m.alpha, m.limit).to(x.dtype)  # [E, T, I]
    y = torch.bmm(a, w2.transpose(1, 2))                                             # [E, T, H]
    hit = ids.t().unsqueeze(0) == torch.arange(e, device=x.device).view(e, 1, 1)     # [E, A, T]
    coef = (hit * weights.t().unsqueeze(0)).sum(1)                                   # [E, T] fp32, one term
    contrib = torch.where((coef != 0).unsqueeze(-1), y.float() * coef.unsqueeze(-1), 0.0)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for i in range(e):                                                               # ascending, as stock
        out = out + contrib[i]
    out = out * m.scaling
    if m.shared is not None:
        out = out + m.shared(x).float()
    return out.to(x.dtype)


def _moe(m, x: torch.Tensor, mode: str):
    if x.device.type != "cuda":
        return None
    if m.w13.fmt == "dense" and m.w2.fmt == "dense" and m.w13.num_experts <= ALL_EXPERTS_MAX:
        return moe_all_experts(m, x)
    if m.w13.fmt != "nvfp4" or m.w2.fmt != "nvfp4":
        if mode == "require":
            raise ValueError(f"moe: require mode routes NVFP4 experts or dense ones with at most "
                             f"{ALL_EXPERTS_MAX} experts; found {m.w13.fmt} with {m.w13.num_experts} experts")
        return None
    sh = m.shared
    shared_bf16 = int(sh is not None and sh.gate_up_proj.fmt == "dense")
    e, h, i = m.w13.num_experts, m.w13.in_features, m.w2.in_features
    if (sh is None or (not shared_bf16 and sh.gate_up_proj.fmt != "nvfp4") or x.dtype != torch.bfloat16
            or sh.down_proj.in_features != i or m.top_k != 4):
        if mode == "require":
            raise ValueError("moe: require mode needs bf16 activations, top-4 routing and an NVFP4 or BF16 shared "
                             "expert as wide as the routed ones")
        return None
    shape = (e, h, i, shared_bf16)
    rows = x.shape[0]
    entry = lookup("moe.nvfp4", rows, shape, mode)
    if entry is None:
        return None
    cell = entry.cell_for(rows, shape)
    cfg = cell.config["moe"]
    from m3serve.kernels.moe_nvfp4 import make_moe_workspace
    ws = _workspace(m, rows, lambda: make_moe_workspace(cfg, rows, e, h, i, x.device))
    if shared_bf16:
        sh_args = (sh.gate_up_proj.weight, None, None, sh.down_proj.weight, None, None)
    else:
        gu, dn = sh.gate_up_proj, sh.down_proj
        sh_args = (gu.q_packed.unsqueeze(0), gu.q_scale.unsqueeze(0), gu.q_global_scale.reshape(1, 2),
                   dn.q_packed.unsqueeze(0), dn.q_scale.unsqueeze(0), dn.q_global_scale.reshape(1))
    out = torch.empty(rows, h, dtype=torch.bfloat16, device=x.device)
    entry.raw_call(x.contiguous(), m.router, m.e_score_correction_bias,
                   m.w13.q_packed, m.w13.q_scale, m.w13.q_global_scale.reshape(e, 2),
                   m.w2.q_packed, m.w2.q_scale, m.w2.q_global_scale.reshape(e),
                   *sh_args, m.scaling, out, ws, cfg)
    return out


def warmup(model, max_rows: int = 48) -> int:
    """Compile, before serving, every kernel variant the model's routed modules can reach: for each distinct
    weight shape, run the module once at EVERY row count 1..max_rows on zero activations. Every row count,
    not one per cell, because Triton also specializes on integer arguments (== 1, divisible by 16), so a
    cell compiles up to three variants. Triton compiles on first use; doing it here keeps JIT time out of
    the first requests and out of any later CUDA-graph capture. Returns the number of module calls made."""
    from m3serve.model.layers import Linear
    from m3serve.model.moe import MoE
    from m3serve.targets.dispatch import TABLES
    if mode_of(model) == "off" or model.device.type != "cuda":
        return 0
    calls, seen = 0, set()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Linear) and mod.num_experts is None and mod.fmt in ("nvfp4", "mxfp8", "fp8"):
                kind, shape, run = f"linear.{mod.fmt}", (mod.out_features, mod.in_features), mod
                width = mod.in_features
            elif isinstance(mod, MoE) and mod.w13.fmt == "nvfp4":
                sh = mod.shared
                shape = (mod.w13.num_experts, mod.w13.in_features, mod.w2.in_features,
                         int(sh is not None and sh.gate_up_proj.fmt == "dense"))
                kind, run, width = "moe.nvfp4", mod, mod.w13.in_features
            else:
                continue
            for (lo, hi), _ in TABLES[kind]:
                for rows in range(lo, min(hi, max_rows) + 1):
                    entry = lookup(kind, rows, shape, "auto")
                    cell = entry.cell_for(rows, shape) if entry is not None else None
                    if cell is None or (kind, shape, rows) in seen:
                        continue
                    seen.add((kind, shape, rows))
                    run(torch.zeros(rows, width, dtype=torch.bfloat16, device=model.device))
                    calls += 1
    torch.cuda.synchronize(model.device)
    return calls
