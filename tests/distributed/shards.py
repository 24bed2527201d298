"""Independent statement of which slice of each full (TP = 1) tensor rank r of n must hold.

Written from the model's math, not from the loader's tables: query heads split evenly; a rank's KV head is
the one its first query head attends to under GQA grouping (so KV heads split, or repeat when ranks outnumber
them); the index-query head follows its KV group; gate|up halves split row-wise part by part; row-parallel
layers split their input columns; the vocabulary splits evenly; the router, the index-K head and norms are
whole. Quantized tensors slice along their block structure: MXFP8 scales per 32 inputs, NVFP4 codes 2 per
byte and scales per 16, per-part global scales whole.
"""

from __future__ import annotations

import torch

from m3serve.model.layers import Linear

_COL_BLOCK = {"q": 1, "w": 1, "packed": 2}          # input columns per stored element
_SCALE_BLOCK = {"mxfp8": 32, "nvfp4": 16}


def _even(n_items: int, r: int, n: int) -> tuple[int, int]:
    per = n_items // n
    return r * per, (r + 1) * per


def row_ranges(cfg, module: str, r: int, n: int) -> list[tuple[int, int]] | None:
    """Output-row ranges of rank r in the full fused weight; None = whole (replicated or row-parallel)."""
    d = cfg.head_dim
    q0, q1 = _even(cfg.num_attention_heads, r, n)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kv_first, kv_count = q0 // group, max(1, cfg.num_key_value_heads // n)
    leaf = module.rsplit(".", 1)[-1]
    if module == "lm_head":
        return [_even(cfg.vocab_size, r, n)]
    if leaf == "q_proj":
        return [(q0 * d, q1 * d)]
    if leaf in ("k_proj", "v_proj"):
        return [(kv_first * d, (kv_first + kv_count) * d)]
    if leaf == "index_q_proj":
        di = cfg.index_head_dim
        return [(kv_first * di, (kv_first + kv_count) * di)]
    if leaf in ("gate_up_proj", "w13"):
        inter = _intermediate(cfg, module)
        a, b = _even(inter, r, n)
        return [(a, b), (inter + a, inter + b)]
    return None


def col_range(cfg, module: str, r: int, n: int) -> tuple[int, int] | None:
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "o_proj":
        return tuple(x * cfg.head_dim for x in _even(cfg.num_attention_heads, r, n))
    if leaf in ("down_proj", "w2"):
        return _even(_intermediate(cfg, module), r, n)
    return None


def _intermediate(cfg, module: str) -> int:
    if ".shared." in module:
        return cfg.shared_intermediate_size
    if module.endswith(("w13", "w2")):
        return cfg.intermediate_size
    return cfg.dense_intermediate_size


def expected_tensor(cfg, module: str, fmt: str, key: str, full: torch.Tensor, r: int, n: int) -> torch.Tensor:
    if key == "global_scale":
        return full                                            # per-part scalars: whole on every rank
    rows = row_ranges(cfg, module, r, n)
    if rows is not None:
        return torch.cat([full[..., a:b, :] for a, b in rows], dim=-2)
    cols = col_range(cfg, module, r, n)
    if cols is None:
        return full
    per = _SCALE_BLOCK[fmt] if key == "scale" else _COL_BLOCK[key]
    return full[..., cols[0] // per:cols[1] // per]


def compare_shard(full_model, shard_model, r: int, n: int) -> dict:
    """{"tensors": compared count, "formats": set, "mismatch": [names]} over every linear and parameter."""
    cfg = full_model.cfg
    full_mods = dict(full_model.named_modules())
    seen, formats, bad = 0, set(), []
    for name, mod in shard_model.named_modules():
        if not isinstance(mod, Linear):
            continue
        ref = full_mods[name]
        if mod.fmt != ref.fmt:
            bad.append(f"{name}: format {mod.fmt} vs {ref.fmt}")
            continue
        formats.add(mod.fmt)
        for key, t in mod.qweight.tensors.items():
            want = expected_tensor(cfg, name, mod.fmt, key, ref.qweight.tensors[key], r, n)
            seen += 1
            if t.shape != want.shape or not torch.equal(t, want):
                bad.append(f"{name}.{key}: {tuple(t.shape)} vs expected {tuple(want.shape)}")
    v0, v1 = _even(cfg.vocab_size, r, n)
    if not torch.equal(shard_model.embed.weight, full_model.embed.weight[v0:v1]):
        bad.append("embed.weight")
    seen += 1
    full_params = dict(full_model.named_parameters())
    for name, p in shard_model.named_parameters():
        if name.endswith(("norm.weight", "router", "e_score_correction_bias")):
            seen += 1
            if not torch.equal(p, full_params[name]):
                bad.append(name)
    return {"tensors": seen, "formats": formats, "mismatch": bad}
