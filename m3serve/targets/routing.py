"""Explicit routing of one model's modules to certified Triton entries (the Hopper decode target).

    install(model, "off")      the stock path, byte for byte (no hook on any module)
    install(model, "auto")     modules whose (rows, shape) lie in a certified cell run the entry; others stock
    install(model, "require")  as auto, but a module outside every certified cell raises, naming the shape and cell

The mode belongs to the model it is installed on (a hook per module, bound to its mode): two models in one
process route independently. Nothing here reads the environment.
Routed today: quantized linears (linear.nvfp4 / linear.mxfp8 / linear.fp8, 1-48 rows) and the NVFP4 MoE
layer (moe.nvfp4: router + routed experts + shared expert in three launches); on bf16 CUDA activations the
decoder-level Gemma norms (norm.rms; norm.add_rms where a residual add precedes the norm), each attention layer's q/k norms + RoPE (attn.qk_prep, one launch),
the dense MLPs' SwiGLU-OAI (mlp.swiglu_oai) and, in the dense all-experts MoE, the router (moe.route_small)
and the stacked experts' activation. CPU or fp32 activations always take the stock path (byte for byte).
Workspaces and output buffers are made once per call site and row cell, before any graph capture could
need them.
"""

from __future__ import annotations

import torch

import functools

from m3serve.kernels.moe.grouped import make_workspace as grouped_workspace
from m3serve.targets import fused_projection
from m3serve.kernels.catalog import all_entries
from m3serve.targets.dispatch import MODES, lookup, module_workspace


def install(model, mode: str) -> None:
    """Route `model`'s quantized linears, MoE layers, norms, attention q/k prep and dense-MLP activations in
    `mode` (replacing any earlier mode)."""
    from m3serve.model.layers import Linear, RMSNorm
    from m3serve.model.m3 import Attention
    from m3serve.model.moe import DenseMLP, MoE
    if mode not in MODES:
        raise ValueError(f"route mode: expected one of {MODES}, found {mode!r}")
    on = mode != "off"
    # the per-head q/k norms belong to attn.qk_prep: they run only when it falls back, on [T, heads, D]
    attention_norms = {id(n) for a in model.modules() if isinstance(a, Attention)
                       for n in (a.q_norm, a.k_norm, getattr(a, "index_q_norm", None), getattr(a, "index_k_norm", None))
                       if n is not None}
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.dispatch = functools.partial(_linear, mode=mode) if on else None
        elif isinstance(mod, MoE):
            mod.dispatch = functools.partial(_moe, mode=mode) if on else None
        elif isinstance(mod, RMSNorm):
            decoder_norm = on and id(mod) not in attention_norms
            mod.dispatch = functools.partial(_norm, mode=mode) if decoder_norm else None
            mod.add_dispatch = functools.partial(_add_norm, mode=mode) if decoder_norm else None
        elif isinstance(mod, Attention):
            mod.prep_dispatch = functools.partial(_qk_prep, mode=mode) if on else None
        elif isinstance(mod, DenseMLP):
            mod.act_dispatch = functools.partial(_swiglu, mode=mode) if on else None
    model.route_mode = mode


def install_drafter(drafter, mode: str) -> None:
    """Route an Eagle3 drafter's pieces on the decode target:
    - its Llama norms (y = x * rsqrt(mean(x^2) + eps) * w), alone or with the residual add before them, through
      norm.rms / norm.add_rms, which apply (1 + w'): w' = w - 1 in fp32, kept only where 1 + w' gives back w
      exactly for every element, so the product is the stock one; other norms stay stock;
    - the q/k RoPE through attn.rope and the MLP's silu(gate) * up through mlp.silu_mul;
    - q|k|v and gate|up joined into one GEMM each.
    mode off: every hook goes back to stock (the joined weights stay)."""
    from m3serve.model.eagle3 import Eagle3Attention, Eagle3MLP, LlamaRMSNorm
    if mode not in MODES:
        raise ValueError(f"route mode: expected one of {MODES}, found {mode!r}")
    on = mode != "off"
    for mod in drafter.modules():
        if isinstance(mod, LlamaRMSNorm):
            mod.dispatch = mod.add_dispatch = None
            if not on:
                continue
            w = mod.weight.detach().float()
            shifted = w - 1.0
            if torch.equal(1.0 + shifted, w):
                mod.gemma_weight = shifted.contiguous()
                mod.dispatch = functools.partial(_llama_norm, mode=mode)
                mod.add_dispatch = functools.partial(_llama_add_norm, mode=mode)
        elif isinstance(mod, Eagle3Attention):
            mod.rope_dispatch = functools.partial(_drafter_rope, mode=mode) if on else None
            if on:
                mod.fuse_projections()
        elif isinstance(mod, Eagle3MLP):
            mod.act_dispatch = functools.partial(_silu_mul, mode=mode) if on else None
            if on:
                mod.fuse_projections()


def _llama_norm(norm, x: torch.Tensor, mode: str):
    """A drafter's Llama RMSNorm as norm.rms with its exact Gemma-form weight (install_drafter)."""
    return _norm_rows("drafter norm", x, norm.gemma_weight, norm.eps, mode)


def _llama_add_norm(norm, residual: torch.Tensor, delta: torch.Tensor, mode: str):
    """A drafter's residual add and the Llama RMSNorm after it as norm.add_rms (its exact Gemma-form weight)."""
    return _add_rows("drafter add_norm", residual, delta, norm.gemma_weight, norm.eps, mode)


def _drafter_rope(attn, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  mode: str):
    """The draft layer's q/k RoPE in one attn.rope launch: q [T, Hq, D], k [T, Hk, D] (views of the joined q|k|v
    GEMM) -> (q, k) rotated, or None (stock)."""
    if not (_bf16_cuda("drafter rope", q, mode) and _bf16_cuda("drafter rope", k, mode)) or q.dim() != 3 \
            or q.shape[0] == 0:
        return None
    t, hq, d = q.shape
    hk = k.shape[1]
    entry = lookup("attn.rope", t, (hq, hk, d, 2 * inv_freq.shape[0]), mode)
    if entry is None:
        return None
    q2, k2 = q.reshape(t, hq * d), k.reshape(t, hk * d)
    if q2.stride(1) != 1 or k2.stride(1) != 1:
        return None
    q_out = torch.empty(t, hq, d, dtype=torch.bfloat16, device=q.device)
    k_out = torch.empty(t, hk, d, dtype=torch.bfloat16, device=q.device)
    return entry.raw_call(q2, k2, positions.contiguous(), inv_freq, q_out, k_out)


def _silu_mul(mlp, gate_up: torch.Tensor, mode: str):
    """The draft layer MLP's silu(gate) * up, [T, 2I] -> bf16 [T, I] (mlp.silu_mul), or None (stock)."""
    if not _bf16_cuda("drafter mlp activation", gate_up, mode) or gate_up.dim() != 2 or gate_up.numel() == 0:
        return None
    rows, two_i = gate_up.shape
    entry = lookup("mlp.silu_mul", rows, (1, two_i // 2), mode)
    if entry is None:
        return None
    out = torch.empty(1, rows, two_i // 2, dtype=torch.bfloat16, device=gate_up.device)
    entry.raw_call(gate_up.contiguous().view(1, rows, two_i), out)
    return out.view(rows, two_i // 2)


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
    from m3serve.kernels.gemm._gemm_tiles import make_workspace
    ws = module_workspace(lin, cell.rows, lambda: make_workspace(cfg, n, x.device))
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
    x2 = x2.contiguous()
    if lin.fmt == "nvfp4":
        entry.raw_call(x2, lin.q_packed, lin.q_scale, _per_row(lin, lin.q_global_scale, n), out, ws, cfg)
    elif lin.fmt == "mxfp8":
        entry.raw_call(x2, lin.q_q, lin.q_scale, out, ws, cfg)
    else:
        entry.raw_call(x2, lin.q_q, _per_row(lin, lin.q_scale, n), out, ws, cfg)
    return out.view(*x.shape[:-1], n)


def _bf16_cuda(where: str, t: torch.Tensor, mode: str) -> bool:
    """Whether the fused elementwise entries may take `t`: CPU tensors never (the stock path, also under
    require: as the linear hook); on CUDA anything but bf16 raises under require."""
    if t.device.type != "cuda":
        return False
    if t.dtype != torch.bfloat16:
        if mode == "require":
            raise ValueError(f"{where}: require mode needs bf16 activations, found {t.dtype}")
        return False
    return True


def _norm(norm, x: torch.Tensor, mode: str):
    """Gemma RMSNorm of [..., H] rows (norm.rms)."""
    return _norm_rows("norm", x, norm.weight, norm.eps, mode)


def _norm_rows(where: str, x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str):
    """x [..., H] through norm.rms with Gemma weight `weight` (1 + weight applied), or None (stock)."""
    h = x.shape[-1]
    if not _bf16_cuda(where, x, mode) or x.numel() == 0:
        return None
    rows = x.numel() // h
    entry = lookup("norm.rms", rows, (h,), mode)
    if entry is None:
        return None
    x2 = x.reshape(rows, h)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, h, dtype=torch.bfloat16, device=x.device)
    entry.raw_call(x2, weight, float(eps), out)
    return out.view(x.shape)


def _add_norm(norm, residual: torch.Tensor, delta: torch.Tensor, mode: str):
    """A residual boundary and the Gemma RMSNorm after it, (residual + delta, norm(.)), in one norm.add_rms
    launch."""
    return _add_rows("add_norm", residual, delta, norm.weight, norm.eps, mode)


def _add_rows(where: str, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, mode: str):
    """(residual + delta, Gemma RMSNorm of it with `weight`) through norm.add_rms, or None (stock)."""
    h = residual.shape[-1]
    if not (_bf16_cuda(where, residual, mode) and _bf16_cuda(where, delta, mode)) or residual.numel() == 0:
        return None
    rows = residual.numel() // h
    entry = lookup("norm.add_rms", rows, (h,), mode)
    if entry is None:
        return None
    r2, d2 = residual.reshape(rows, h), delta.reshape(rows, h)
    r2 = r2 if r2.stride(1) == 1 else r2.contiguous()
    d2 = d2 if d2.stride(1) == 1 else d2.contiguous()
    h_out = torch.empty(rows, h, dtype=torch.bfloat16, device=residual.device)
    y_out = torch.empty(rows, h, dtype=torch.bfloat16, device=residual.device)
    entry.raw_call(d2, r2, weight, float(eps), h_out, y_out)
    return h_out.view(residual.shape), y_out.view(residual.shape)


def _qk_prep(attn, x: torch.Tensor, positions: torch.Tensor, mode: str):
    """Attention.project with the q/k (and index q/k) norms and RoPE in one attn.qk_prep launch, after the
    projections as one fused GEMM (targets.fused_projection) or, where none serves, through each part's own
    Linear hook. x [T, H] -> (q, k, v, iq, ik)."""
    from m3serve.model.layers import rope_inv_freq
    where = f"layers.{attn.layer}.self_attn"
    if not _bf16_cuda(where, x, mode) or x.dim() != 2 or x.shape[0] == 0:
        return None
    cfg = attn.cfg
    t, d, rd = x.shape[0], cfg.head_dim, cfg.rotary_dim
    di = cfg.index_head_dim if attn.sparse else 0
    entry = lookup("attn.qk_prep", t, (attn.hq, attn.hk, d, di, rd), mode)
    if entry is None:
        return None
    inv_freq = module_workspace(attn, ("rope_inv_freq", x.device), lambda: rope_inv_freq(rd, cfg.rope_theta, x.device))
    fused = fused_projection.project(attn, x, mode)   # one GEMM for all parts, or None: one per part
    if fused is not None:
        q, k, v, *idx = fused
        index_in = dict(iq=idx[0], ik=idx[1]) if di else {}
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        index_in = dict(iq=attn.index_q_proj(x), ik=attn.index_k_proj(x)) if di else {}
    v = v.view(t, attn.hk, d)
    q_out = torch.empty(t, attn.hq, d, dtype=torch.bfloat16, device=x.device)
    k_out = torch.empty(t, attn.hk, d, dtype=torch.bfloat16, device=x.device)
    index = {}
    if di:
        index = dict(**index_in, iq_norm_w=attn.index_q_norm.weight,
                     ik_norm_w=attn.index_k_norm.weight,
                     iq_out=torch.empty(t, attn.hk, di, dtype=torch.bfloat16, device=x.device),
                     ik_out=torch.empty(t, di, dtype=torch.bfloat16, device=x.device))
    q_out, k_out, iq_out, ik_out = entry.raw_call(q, k, positions.contiguous(), attn.q_norm.weight,
                                                  attn.k_norm.weight, inv_freq, float(attn.q_norm.eps), q_out,
                                                  k_out, **index)
    return q_out, k_out, v, iq_out, ik_out


def _swiglu(mlp, gate_up: torch.Tensor, mode: str):
    """A dense MLP's SwiGLU-OAI activation, [..., 2I] -> bf16 [..., I] (mlp.swiglu_oai)."""
    two_i = gate_up.shape[-1]
    if not _bf16_cuda(f"{mlp.gate_up_proj.name.rsplit('.', 1)[0]} activation", gate_up, mode) or gate_up.numel() == 0:
        return None
    rows, i = gate_up.numel() // two_i, two_i // 2
    entry = lookup("mlp.swiglu_oai", rows, (1, i), mode)
    if entry is None:
        return None
    out = torch.empty(1, rows, i, dtype=torch.bfloat16, device=gate_up.device)
    entry.raw_call(gate_up.reshape(1, rows, two_i).contiguous(), float(mlp.alpha), float(mlp.limit), out)
    return out.view(*gate_up.shape[:-1], i)


# A dense-weight MoE with at most this many experts runs every expert on every token (masked): no host sync,
# so it can be captured in a CUDA graph; beyond it the wasted FLOPs outweigh that (the stock loop runs).
ALL_EXPERTS_MAX = 16


def combine_selected(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [E, T, H] every expert's output, ids / weights [T, A] -> fp32 [T, H]: sum over a of
    y[ids[t, a], t] * weights[t, a], as one reduction over E (see moe_all_experts for its exactness)."""
    e, t = y.shape[0], y.shape[1]
    coef = torch.zeros(t, e, dtype=torch.float32, device=y.device).scatter_(1, ids, weights)  # [T, E], A non-zero
    coef = coef.t().unsqueeze(-1)                                                    # [E, T, 1]
    # an unselected expert contributes an exact 0 even where its output overflowed (stock never computes it)
    return torch.where(coef != 0, y * coef, 0.0).sum(0)


def moe_all_experts(m, x: torch.Tensor, mode: str = "off") -> torch.Tensor:
    """The stock MoE without `torch.unique(...).tolist()`: every expert's GEMMs on all T tokens (two batched
    matmuls), then one reduction over the experts of the masked, weighted outputs. x [T, H] -> [T, H].

    Exactness of that reduction: a token's terms are its A selected experts' products y_e * w_e (fp32, each
    rounded once, as stock's) and exact zeros for the others. Adding an exact zero is exact, so any
    summation order rounds only where two non-zero partial sums meet: with A <= 2 (the embedded model) that is
    the single rounding of p1 + p2, and the one-op sum equals stock's ascending-expert loop bit for bit; with
    A > 2 it is within (A - 1) u sum|p| of it (torch's reduction order). With mode "off" (and on CPU or fp32)
    everything else is the stock arithmetic, so the result differs from the stock MoE only in the GEMMs'
    blocking. In auto / require mode on bf16 CUDA activations the router is moe.route_small (its logits in
    another fp32 summation order: a near-tie may select differently) and the experts' activation
    mlp.swiglu_oai (one bf16 ulp), each within its entry's stated tolerance; require raises outside their
    certified cells."""
    from m3serve.model.layers import swiglu_oai
    from m3serve.model.moe import route
    t, e = x.shape[0], m.w13.num_experts
    fused = mode != "off" and x.device.type == "cuda" and x.dtype == torch.bfloat16 and t > 0
    router = lookup("moe.route_small", t, (e, x.shape[1], m.top_k), mode) if fused else None
    if router is not None:
        weights = torch.empty(t, m.top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(t, m.top_k, dtype=torch.int64, device=x.device)
        router.raw_call(x.contiguous(), m.router, m.e_score_correction_bias, m.top_k, weights, ids)
    else:
        ids, weights = route(x, m.router, m.e_score_correction_bias, m.top_k)      # [T, A]
    w13, w2 = m.w13.dense_weight(x.dtype), m.w2.dense_weight(x.dtype)               # [E, 2I, H], [E, H, I]
    xe = x.unsqueeze(0).expand(e, *x.shape)                                          # [E, T, H]
    gate_up = torch.bmm(xe, w13.transpose(1, 2))                                     # [E, T, 2I]
    i = gate_up.shape[-1] // 2
    act = lookup("mlp.swiglu_oai", t, (e, i), mode) if fused else None
    if act is not None:
        a = torch.empty(e, t, i, dtype=torch.bfloat16, device=x.device)
        act.raw_call(gate_up.contiguous(), float(m.alpha), float(m.limit), a)
    else:
        a = swiglu_oai(gate_up, m.alpha, m.limit).to(x.dtype)                       # [E, T, I]
    y = torch.bmm(a, w2.transpose(1, 2))                                             # [E, T, H]
    out = combine_selected(y, ids, weights) * m.scaling
    if m.shared is not None:
        out = out + m.shared(x).float()
    return out.to(x.dtype)


def _moe(m, x: torch.Tensor, mode: str):
    """The MoE layer: dense experts (at most ALL_EXPERTS_MAX) on all experts; NVFP4 at 1-48 rows on moe.nvfp4 where
    one of its cells serves; everything else (every format, 1..16384 rows) on moe.grouped."""
    if x.device.type != "cuda":
        return None
    if m.w13.fmt == "dense" and m.w2.fmt == "dense" and m.w13.num_experts <= ALL_EXPERTS_MAX:
        return moe_all_experts(m, x, mode)
    y = _moe_nvfp4(m, x)
    return y if y is not None else _moe_grouped(m, x, mode)


def nvfp4_shape(m) -> tuple[int, ...] | None:
    """moe.nvfp4's cell shape key (E, H, I, shared_bf16) for MoE layer m, or None when that entry cannot take it
    (experts not NVFP4, no NVFP4 / BF16 shared expert as wide as the routed ones, or not top-4)."""
    if m.w13.fmt != "nvfp4" or m.w2.fmt != "nvfp4":
        return None
    sh = m.shared
    shared_bf16 = int(sh is not None and sh.gate_up_proj.fmt == "dense")
    i = m.w2.in_features
    if sh is None or (not shared_bf16 and sh.gate_up_proj.fmt != "nvfp4") or sh.down_proj.in_features != i \
            or m.top_k != 4:
        return None
    return (m.w13.num_experts, m.w13.in_features, i, shared_bf16)


def _moe_nvfp4(m, x: torch.Tensor):
    """moe.nvfp4 (the tuned 1-48 row NVFP4 entry) where one of its cells serves, else None: looked up in auto
    mode whatever the model's mode, since moe.grouped serves (or, under require, names) whatever it leaves."""
    shape = nvfp4_shape(m)
    if shape is None or x.dtype != torch.bfloat16:
        return None
    e, h, i, shared_bf16 = shape
    sh = m.shared
    rows = x.shape[0]
    entry = lookup("moe.nvfp4", rows, shape, "auto")
    if entry is None:
        return None
    cell = entry.cell_for(rows, shape)
    cfg = cell.config["moe"]
    from m3serve.kernels.moe.nvfp4 import make_moe_workspace
    ws = module_workspace(m, rows, lambda: make_moe_workspace(cfg, rows, e, h, i, x.device))
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
                   *sh_args, m.scaling, out, ws, cfg, swiglu_alpha=m.alpha, swiglu_limit=m.limit)
    return out


# moe.grouped's format codes (m3serve.kernels.formats._decode) by QWeight format
GROUPED_FMT = {"nvfp4": 0, "mxfp8": 1, "fp8": 2, "dense": 3}


def grouped_shape(m) -> tuple[int, ...] | None:
    """moe.grouped's cell shape key (FMT, E, H, I, A) for MoE layer m, or None when its experts are in no format
    the entry takes (gate|up and down in different formats, or dense weights other than bf16)."""
    fmt = m.w13.fmt
    if fmt != m.w2.fmt or fmt not in GROUPED_FMT or (fmt == "dense" and m.w13.weight.dtype != torch.bfloat16):
        return None
    return (GROUPED_FMT[fmt], m.w13.num_experts, m.w13.in_features, m.w2.in_features, m.top_k)


def _expert_args(lin) -> tuple:
    """A stacked expert Linear's tensors as moe.grouped takes them: (w, group scale, per-part factors [E, P])."""
    e = lin.num_experts
    if lin.fmt == "dense":
        return lin.weight, None, None
    if lin.fmt == "fp8":
        return lin.q_q, None, lin.q_scale.reshape(e, -1)
    if lin.fmt == "mxfp8":
        return lin.q_q, lin.q_scale, None
    return lin.q_packed, lin.q_scale, lin.q_global_scale.reshape(e, -1)


def _moe_grouped(m, x: torch.Tensor, mode: str):
    """moe.grouped: routing, grouping and both expert GEMMs on the device in fixed shapes (graph-safe); the shared
    expert through the model's own DenseMLP (its linears routed as usual)."""
    shape = grouped_shape(m)
    if shape is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] == 0:
        if mode == "require":
            raise ValueError(f"{m.w13.name}: require mode, but moe.grouped takes bf16 activations [T, H] and "
                             f"experts in one of {tuple(GROUPED_FMT)} (bf16 when dense); found {x.dtype} "
                             f"{tuple(x.shape)}, gate|up {m.w13.fmt} / down {m.w2.fmt}")
        return None
    rows = x.shape[0]
    entry = lookup("moe.grouped", rows, shape, mode)
    if entry is None:
        return None
    cfg = entry.cell_for(rows, shape).config["moe"]
    _, e, h, i, a = shape
    ws = grouped_workspace(cfg, rows, e, h, i, a, x.device)  # per call: sized by this step's rows only
    shared = m.shared(x).contiguous() if m.shared is not None else None
    out = torch.empty(rows, h, dtype=torch.bfloat16, device=x.device)
    return entry.raw_call(x.contiguous(), m.router, m.e_score_correction_bias, shape[0], *_expert_args(m.w13),
                          *_expert_args(m.w2), shared, m.scaling, out, ws, cfg, top_k=m.top_k,
                          swiglu_alpha=m.alpha, swiglu_limit=m.limit)


def warmup(model, max_rows: int = 48) -> int:
    """Compile, before serving, every kernel variant the model's routed modules can reach in steps of up to
    max_rows tokens: for each distinct weight shape, run the module on zero activations at EVERY row count
    1..min(max_rows, 48) for the decode entries (Triton also specializes on integer arguments (== 1, divisible
    by 16), so a cell compiles up to three variants), and once per reachable cell for moe.grouped (whose
    kernels do not specialize on the row count). Triton compiles on first use; doing it here keeps JIT time
    out of the first requests and out of any later CUDA-graph capture. Returns the number of module calls."""
    from m3serve.model.layers import Linear
    from m3serve.model.moe import MoE
    from m3serve.targets.dispatch import TABLES
    if mode_of(model) == "off" or model.device.type != "cuda":
        return 0
    calls, seen = 0, set()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, MoE):
                calls += _warm_grouped(mod, max_rows, seen, model.device)
            if isinstance(mod, Linear) and mod.num_experts is None and mod.fmt in ("nvfp4", "mxfp8", "fp8"):
                kind, shape, run = f"linear.{mod.fmt}", (mod.out_features, mod.in_features), mod
                width = mod.in_features
            elif isinstance(mod, MoE) and nvfp4_shape(mod) is not None:
                kind, shape, run, width = "moe.nvfp4", nvfp4_shape(mod), mod, mod.w13.in_features
            else:
                continue
            for (lo, hi), name in TABLES[kind]:
                for rows in range(lo, min(hi, max_rows) + 1):
                    entry = lookup(kind, rows, shape, "auto")
                    cell = entry.cell_for(rows, shape) if entry is not None else None
                    # row-count-agnostic kernels (the prefill linears): one call per cell compiles it
                    key = (kind, shape, cell.rows if name in ROW_AGNOSTIC else rows) if cell else None
                    if cell is None or key in seen:
                        continue
                    seen.add(key)
                    run(torch.zeros(rows, width, dtype=torch.bfloat16, device=model.device))
                    calls += 1
    torch.cuda.synchronize(model.device)
    return calls


# entries whose kernels do not specialise on the row count (kernel_unspecialized): warm-up runs one call per cell
ROW_AGNOSTIC = frozenset({"linear.nvfp4.tiled", "linear.mxfp8.tiled", "linear.fp8.tiled", "moe.grouped"})


def _warm_grouped(m, max_rows: int, seen: set, device: torch.device) -> int:
    """One call of MoE layer m per moe.grouped cell of its shape that steps of 1..max_rows tokens reach, at the
    cell's first row count the hook sends there (NVFP4 rows that moe.nvfp4 serves do not count)."""
    shape = grouped_shape(m)
    if shape is None or (m.w13.fmt == "dense" and m.w13.num_experts <= ALL_EXPERTS_MAX):
        return 0
    nv = nvfp4_shape(m)
    calls = 0
    for lo, hi in sorted({c.rows for c in all_entries()["moe.grouped"].cells if c.shape == shape}):
        for rows in range(lo, min(hi, max_rows) + 1):
            if nv is not None and lookup("moe.nvfp4", rows, nv, "auto") is not None:
                continue
            if lookup("moe.grouped", rows, shape, "auto") is not None and ("moe.grouped", shape, lo) not in seen:
                seen.add(("moe.grouped", shape, lo))
                m(torch.zeros(rows, m.w13.in_features, dtype=torch.bfloat16, device=device))
                calls += 1
            break
    return calls
