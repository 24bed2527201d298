"""Writing checkpoints and building random ones, in the published layouts the loader reads.

`export_tensors` walks a loaded model and yields (name, tensor) in the original MiniMax layout (published,
under `language_model.`) or the transformers text layout, optionally quantized with the published split:
  nvfp4: routed and shared experts NVFP4 (ModelOpt names), attention and dense-MLP projections MXFP8
  mxfp8: every projection and expert MXFP8
  fp8:   every projection and expert FP8 E4M3 with one fp32 scale per tensor (per expert)
  router, correction bias, indexer, norms, embedding and head stay unquantized.
`random_tensors` yields the same names for deterministic random weights, generated directly in the storage
format on the target device (how real-size benchmarks get a model), one layer at a time.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Iterator

import torch
from safetensors.torch import save_file

from m3serve.config import M3Config
from m3serve.quant import check_finite
from m3serve.quant.fp8 import cast_to_fp8, quantize_fp8
from m3serve.quant.mxfp8 import quantize_mxfp8
from m3serve.quant.nvfp4 import E2M1_VALUES, nvfp4_global_scale, quantize_nvfp4

QUANTIZATIONS = (None, "fp8", "mxfp8", "nvfp4")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _linear_format(quantization: str | None, role: str) -> str:
    """role: "proj" (attention q/k/v/o, dense MLP), "expert" (routed / shared), "plain" (never quantized)."""
    if quantization is None or role == "plain":
        return "dense"
    if quantization in ("fp8", "mxfp8"):
        return quantization
    if quantization == "nvfp4":
        return "nvfp4" if role == "expert" else "mxfp8"
    raise ValueError(f"quantization {quantization!r}: expected one of {QUANTIZATIONS}")


def quantize_tensors(name: str, w: torch.Tensor, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of linear `name` (dense weight w [N, K]) in `fmt`."""
    if fmt == "dense":
        return {f"{name}.weight": w.to(dtype).contiguous()}
    check_finite(f"{name}.weight", w)
    if fmt == "fp8":                       # per-tensor E4M3 (one fp32 scale per linear, per expert)
        q, s = quantize_fp8(w.float())
        return {f"{name}.weight": q, f"{name}.weight_scale": s.reshape(()).float()}
    if fmt == "mxfp8":
        q, s = quantize_mxfp8(w.float())
        return {f"{name}.weight": q, f"{name}.weight_scale_inv": s}
    if w.shape[-1] % 16:
        raise ValueError(f"{name}: NVFP4 needs in_features divisible by 16, found {w.shape[-1]}")
    g = nvfp4_global_scale(w.float().abs().amax())
    packed, s = quantize_nvfp4(w.float(), g)
    return {f"{name}.weight": packed, f"{name}.weight_scale": s,
            f"{name}.weight_scale_2": (1.0 / g).reshape(()).float(),
            f"{name}.input_scale": torch.ones((), dtype=torch.float32)}


# ----------------------------------------------------------------------------- names
def _names(layout: str) -> dict:
    if layout not in ("original", "transformers"):
        raise ValueError(f"layout {layout!r}: expected 'original' or 'transformers'")
    root = "language_model.model." if layout == "original" else "model."
    head = "language_model.lm_head" if layout == "original" else "lm_head"
    return {"root": root, "head": head}


def export_tensors(model, layout: str = "original", quantization: str | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a loaded TP-1 model in `layout`, quantized per the published split."""
    if model.tp.size != 1:
        raise ValueError("export_tensors needs a tensor-parallel size 1 model")
    cfg = model.cfg
    n = _names(layout)
    root = n["root"]
    orig = layout == "original"
    yield f"{root}embed_tokens.weight", model.embed.weight.detach().to(dtype)
    yield f"{root}norm.weight", model.norm.weight.detach().to(dtype)
    yield from quantize_tensors(n["head"], model.lm_head.dense_weight(torch.float32).detach(), "dense", dtype).items()
    for i, layer in enumerate(model.layers):
        p = f"{root}layers.{i}."
        a = layer.attn
        yield p + "input_layernorm.weight", layer.input_norm.weight.detach().to(dtype)
        yield p + "post_attention_layernorm.weight", layer.post_norm.weight.detach().to(dtype)
        for proj in PROJECTIONS:
            w = getattr(a, proj).dense_weight(torch.float32).detach()
            yield from quantize_tensors(p + f"self_attn.{proj}", w, _linear_format(quantization, "proj"), dtype).items()
        yield p + "self_attn.q_norm.weight", a.q_norm.weight.detach().to(dtype)
        yield p + "self_attn.k_norm.weight", a.k_norm.weight.detach().to(dtype)
        if a.sparse:
            ip = p + ("self_attn.index_" if orig else "self_attn.indexer.")
            for x in ("q", "k"):
                w = getattr(a, f"index_{x}_proj").dense_weight(torch.float32).detach()
                yield from quantize_tensors(f"{ip}{x}_proj", w, "dense", dtype).items()
                yield f"{ip}{x}_norm.weight", getattr(a, f"index_{x}_norm").weight.detach().to(dtype)
        mlp = layer.mlp
        if cfg.mlp_layer_types[i] == "dense":
            yield from _export_glu(p + "mlp.", mlp, _linear_format(quantization, "proj"), orig, dtype)
            continue
        moe = p + ("block_sparse_moe." if orig else "mlp.")
        yield moe + "gate.weight", mlp.router.detach().float()
        yield moe + ("e_score_correction_bias" if orig else "gate.e_score_correction_bias"), \
            mlp.e_score_correction_bias.detach().float()
        fmt = _linear_format(quantization, "expert")
        if orig:
            for e in range(cfg.num_local_experts):
                gu = mlp.w13.dense_weight(torch.float32, e).detach()
                gate, up = gu.chunk(2, dim=0)
                for wname, w in (("w1", gate), ("w3", up), ("w2", mlp.w2.dense_weight(torch.float32, e).detach())):
                    yield from quantize_tensors(f"{moe}experts.{e}.{wname}", w, fmt, dtype).items()
        else:
            if fmt != "dense":
                raise ValueError("the transformers layout stores experts as stacked dense tensors; quantized "
                                 "checkpoints use layout='original'")
            yield moe + "experts.gate_up_proj", mlp.w13.dense_weight(dtype).detach()
            yield moe + "experts.down_proj", mlp.w2.dense_weight(dtype).detach()
        if mlp.shared is not None:
            yield from _export_glu(moe + "shared_experts.", mlp.shared, fmt, orig, dtype)


def _export_glu(prefix: str, mlp, fmt: str, orig: bool, dtype) -> Iterator[tuple[str, torch.Tensor]]:
    gu = mlp.gate_up_proj.dense_weight(torch.float32).detach()
    if orig:
        gate, up = gu.chunk(2, dim=0)
        yield from quantize_tensors(prefix + "gate_proj", gate, fmt, dtype).items()
        yield from quantize_tensors(prefix + "up_proj", up, fmt, dtype).items()
    else:
        if fmt != "dense":
            raise ValueError("the transformers layout is written unquantized")
        yield prefix + "gate_up_proj.weight", gu.to(dtype)
    yield from quantize_tensors(prefix + "down_proj", mlp.down_proj.dense_weight(torch.float32).detach(),
                                fmt, dtype).items()


def save_checkpoint(model, cfg: M3Config, out_dir: str, layout: str = "original", quantization: str | None = None,
                    dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json (published form for `original`, transformers text form otherwise) and safetensors
    shards with model.safetensors.index.json when more than one shard is needed."""
    os.makedirs(out_dir, exist_ok=True)
    write_tensors(out_dir, export_tensors(model, layout, quantization, dtype), max_shard_bytes)
    config = cfg.to_published_dict() if layout == "original" else cfg.to_text_dict()
    if quantization is not None:
        config["quantization_config"] = quantization_config(quantization)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def quantization_config(quantization: str) -> dict:
    ignored = ["lm_head", "model.embed_tokens", "*.gate", "*.index_q_proj", "*.index_k_proj"]
    if quantization == "mxfp8":
        return {"quant_method": "mxfp8", "weight_block_size": [1, 32], "ignored_layers": ignored}
    if quantization == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignored}
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
            "moe_quant_algo": "NVFP4", "group_size": 16, "projection_quant_algo": "MXFP8",
            "ignored_layers": ignored}


def write_tensors(out_dir: str, tensors: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().cpu().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname))
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


# ----------------------------------------------------------------------------- random weights
E2M1_RMS = float(E2M1_VALUES.pow(2).mean().sqrt())  # RMS of a uniformly random E2M1 magnitude


class _RandomStream:
    """Deterministic per-tensor randomness: the same (seed, name) gives the same tensor on any device count."""

    def __init__(self, seed: int, device):
        self.seed, self.device = seed, torch.device(device)

    def gen(self, name: str) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        return g

    def normal(self, name, shape, std, dtype=torch.float32):
        return (torch.randn(shape, generator=self.gen(name), device=self.device, dtype=torch.float32) * std).to(dtype)

    def linear(self, name: str, shape: tuple[int, int], fmt: str, std: float, dtype) -> dict[str, torch.Tensor]:
        n, k = shape
        if fmt == "dense":
            return {f"{name}.weight": self.normal(name, shape, std, dtype)}
        if fmt == "mxfp8":
            # E4M3 elements of RMS 16 under a power-of-two scale: W has RMS ~ std, no quantization step needed.
            q = cast_to_fp8(self.normal(name, shape, 16.0))
            exponent = round(torch.log2(torch.tensor(std / 16.0)).item())
            s = torch.full((n, -(-k // 32)), 127 + exponent, dtype=torch.uint8, device=self.device)
            return {f"{name}.weight": q, f"{name}.weight_scale_inv": s}
        if fmt == "fp8":
            # E4M3 elements of RMS 16 under one per-tensor fp32 scale std / 16.
            return {f"{name}.weight": cast_to_fp8(self.normal(name, shape, 16.0)),
                    f"{name}.weight_scale": torch.tensor(std / 16.0, dtype=torch.float32, device=self.device)}
        if fmt != "nvfp4":
            raise ValueError(f"{name}: unknown weight format {fmt!r}")
        # nvfp4: uniformly random codes (two per byte), unit block scales, a global scale giving RMS ~ std.
        packed = torch.randint(0, 256, (n, k // 2), generator=self.gen(name), device=self.device,
                               dtype=torch.uint8)
        scale = torch.ones(n, k // 16, device=self.device).to(torch.float8_e4m3fn)
        return {f"{name}.weight": packed, f"{name}.weight_scale": scale,
                f"{name}.weight_scale_2": torch.tensor(std / E2M1_RMS, device=self.device),
                f"{name}.input_scale": torch.ones((), device=self.device)}


def random_tensors(cfg: M3Config, seed: int = 0, quantization: str | None = None, device="cpu",
                   dtype: torch.dtype = torch.bfloat16, std: float = 0.02, nontrivial_norms: bool = True,
                   layers: range | None = None, include_globals: bool = True) -> dict[str, torch.Tensor]:
    """Deterministic random checkpoint tensors (original layout, published split) for `layers`
    (default: all) plus, when include_globals, the embedding, final norm and head."""
    r = _RandomStream(seed, device)
    h, d, di = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    out: dict[str, torch.Tensor] = {}
    root = "language_model.model."

    def norm(name, dim):
        # Gemma norms store w with scale (1 + w); non-zero w makes the "+1" matter in tests.
        out[name] = r.normal(name, (dim,), 0.1 if nontrivial_norms else 0.0, dtype)

    if include_globals:
        out[root + "embed_tokens.weight"] = r.normal("embed", (cfg.vocab_size, h), 1.0, dtype)
        norm(root + "norm.weight", h)
        out.update(r.linear("language_model.lm_head", (cfg.vocab_size, h), "dense", std, dtype))
    proj, expert = _linear_format(quantization, "proj"), _linear_format(quantization, "expert")
    for i in layers if layers is not None else range(cfg.num_hidden_layers):
        p = f"{root}layers.{i}."
        norm(p + "input_layernorm.weight", h)
        norm(p + "post_attention_layernorm.weight", h)
        for name, n_out, k_in in (("q_proj", cfg.num_attention_heads * d, h), ("k_proj", cfg.num_key_value_heads * d, h),
                                  ("v_proj", cfg.num_key_value_heads * d, h), ("o_proj", h, cfg.num_attention_heads * d)):
            out.update(r.linear(p + f"self_attn.{name}", (n_out, k_in), proj, std, dtype))
        norm(p + "self_attn.q_norm.weight", d)
        norm(p + "self_attn.k_norm.weight", d)
        if cfg.layer_types[i] == "sparse":
            out.update(r.linear(p + "self_attn.index_q_proj", (cfg.index_n_heads * di, h), "dense", std, dtype))
            out.update(r.linear(p + "self_attn.index_k_proj", (di, h), "dense", std, dtype))
            norm(p + "self_attn.index_q_norm.weight", di)
            norm(p + "self_attn.index_k_norm.weight", di)
        if cfg.mlp_layer_types[i] == "dense":
            inter = cfg.dense_intermediate_size
            for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                out.update(r.linear(p + f"mlp.{name}", shape, proj, std, dtype))
            continue
        m = p + "block_sparse_moe."
        e, inter = cfg.num_local_experts, cfg.intermediate_size
        out[m + "gate.weight"] = r.normal(m + "gate.weight", (e, h), std)
        out[m + "e_score_correction_bias"] = r.normal(m + "bias", (e,), 0.05 if nontrivial_norms else 0.0)
        for x in range(e):
            for name, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
                out.update(r.linear(f"{m}experts.{x}.{name}", shape, expert, std, dtype))
        if cfg.shared_intermediate_size:
            s = cfg.shared_intermediate_size
            for name, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
                out.update(r.linear(f"{m}shared_experts.{name}", shape, expert, std, dtype))
    return out
