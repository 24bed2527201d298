"""Checkpoint loading: one explicit name table for every published MiniMax-M3 layout, per-parameter TP slices.

Accepted layouts (any of them, optionally under `language_model.`):
  original MiniMax   model.layers.{i}.self_attn.index_q_proj.*, block_sparse_moe.experts.{e}.w1|w2|w3.*,
                     block_sparse_moe.gate.weight, block_sparse_moe.e_score_correction_bias,
                     block_sparse_moe.shared_experts.{gate,up,down}_proj.*, mlp.{gate,up,down}_proj.*
  transformers       model.layers.{i}.self_attn.indexer.{q,k}_{proj,norm}.*, mlp.gate_up_proj [2I, H],
  (text and VL)      mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I],
                     mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.shared_experts.gate_up_proj.*,
                     model.language_model.* (VL wrapper)
Vision tower, projector, patch-merge and `mtp.*` tensors are skipped by name. Anything else raises.
Formats per linear come from the tensors present (see qweight.py). Only safetensors are read (no pickle).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from m3serve.config import M3Config
from m3serve.model.qweight import CheckpointError, QWeight, cast_dense, concat_parts, read_linear, stack_experts
from m3serve.quant.mxfp8 import MX_BLOCK
from m3serve.quant.nvfp4 import NVFP4_BLOCK

SUFFIXES = ("weight", "weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale", "weight_packed",
            "weight_global_scale", "weight_zero_point", "k_scale", "v_scale")
SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
                 "model.multi_modal_projector.", "visual.")
IGNORED_SUFFIXES = ("input_scale", "k_scale", "v_scale")  # W4A16 on Hopper: static activation scales unused

_SAFE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
                "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
                "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8)}


# ----------------------------------------------------------------------------- tensor sources
class TensorSource:
    """Read access to checkpoint tensors, sliced at read time so each rank reads only its shard."""

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
            dim1: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only (start, length) of its first dim (`rows`), last dim (`cols`) and/or second dim
        (`dim1`, for stacked [E, N, K] expert tensors)."""
        ...


def _index(nd: int, rows, cols, dim1) -> tuple[slice, ...]:
    idx = [slice(None)] * nd
    for axis, span in ((0, rows), (1, dim1), (nd - 1, cols)):
        if span is not None:
            idx[axis] = slice(span[0], span[0] + span[1])
    return tuple(idx)


class DictSource(TensorSource):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t = tensors

    def names(self):
        return list(self.t)

    def shape(self, name):
        return tuple(self.t[name].shape)

    def dtype(self, name):
        return self.t[name].dtype

    def get(self, name, rows=None, cols=None, dim1=None):
        x = self.t[name]
        if rows is None and cols is None and dim1 is None:
            return x
        return x[_index(x.dim(), rows, cols, dim1)]


class SafetensorsSource(TensorSource):
    """A checkpoint directory: model.safetensors, or shards listed in model.safetensors.index.json."""

    def __init__(self, path: str):
        from safetensors import safe_open
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            pickles = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
            hint = f" (found {pickles}: pickle checkpoints are never loaded; convert to safetensors)" if pickles else ""
            raise CheckpointError(f"{path}: no .safetensors files{hint}")
        index = os.path.join(path, "model.safetensors.index.json")
        self.where: dict[str, str] = {}
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            for name, file in weight_map.items():
                if not os.path.exists(os.path.join(path, file)):
                    raise CheckpointError(f"{index}: tensor {name} lives in {file}, which is missing")
                self.where[name] = file
        else:
            for file in files:
                with safe_open(os.path.join(path, file), "pt") as f:
                    for name in f.keys():
                        self.where[name] = file
        self._handles = {file: safe_open(os.path.join(path, file), "pt") for file in set(self.where.values())}

    def _slice(self, name):
        return self._handles[self.where[name]].get_slice(name)

    def names(self):
        return list(self.where)

    def shape(self, name):
        return tuple(self._slice(name).get_shape())

    def dtype(self, name):
        d = self._slice(name).get_dtype()
        if d not in _SAFE_DTYPES:
            raise CheckpointError(f"{name}: unsupported safetensors dtype {d}")
        return _SAFE_DTYPES[d]

    def get(self, name, rows=None, cols=None, dim1=None):
        s = self._slice(name)
        nd = len(s.get_shape())
        if rows is None and cols is None and dim1 is None:
            return s[:] if nd else self._handles[self.where[name]].get_tensor(name)
        return s[_index(nd, rows, cols, dim1)]


# ----------------------------------------------------------------------------- the name table
@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes. `module` is relative to model.layers[layer] (or the model root)."""
    kind: str             # "param" | "linear" | "expert" | "stacked_experts" | "kv_scale" (not loaded)
    module: str
    layer: int | None = None
    part: int = 0         # part of a fused linear (gate=0 | up=1)
    expert: int | None = None
    suffix: str = "weight"
    split_parts: int = 1  # a fused checkpoint tensor split into this many parts (transformers gate_up_proj)


_S = r"(?P<suffix>" + "|".join(SUFFIXES) + r")"
_LAYER_TABLE: list[tuple[re.Pattern, callable]] = [(re.compile(p + "$"), f) for p, f in [
    # KV-cache scales on the attention module (compressed-tensors, vLLM; legacy kv_scale = both); ModelOpt's
    # self_attn.{k,v}_proj.{k,v}_scale match the linear rows below. Read by read_kv_cache_scales.
    (r"self_attn\.(?:attn\.)?(?P<p>k|v|kv)_scale", lambda m: ("kv_scale", f"attn.{m['p']}_scale", {})),
    (r"input_layernorm\.weight", lambda m: ("param", "input_norm.weight", {})),
    (r"post_attention_layernorm\.weight", lambda m: ("param", "post_norm.weight", {})),
    (r"self_attn\.(?P<p>[qkvo])_proj\." + _S, lambda m: ("linear", f"attn.{m['p']}_proj", {})),
    (r"self_attn\.(?P<p>[qk])_norm\.weight", lambda m: ("param", f"attn.{m['p']}_norm.weight", {})),
    (r"self_attn\.(?:index_|indexer\.)(?P<p>[qk])_proj\." + _S,
     lambda m: ("linear", f"attn.index_{m['p']}_proj", {})),
    (r"self_attn\.(?:index_|indexer\.)(?P<p>[qk])_norm\.weight",
     lambda m: ("param", f"attn.index_{m['p']}_norm.weight", {})),
    # dense MLP (layers 0-2): original gate/up/down, or transformers' fused gate_up
    (r"mlp\.(?P<p>gate|up)_proj\." + _S,
     lambda m: ("linear", "mlp.gate_up_proj", {"part": 0 if m["p"] == "gate" else 1})),
    (r"mlp\.gate_up_proj\." + _S, lambda m: ("linear", "mlp.gate_up_proj", {"split_parts": 2})),
    (r"mlp\.down_proj\." + _S, lambda m: ("linear", "mlp.down_proj", {})),
    # MoE router
    (r"(?:block_sparse_moe|mlp)\.gate\.weight", lambda m: ("param", "mlp.router", {})),
    (r"(?:block_sparse_moe|mlp)(?:\.gate)?\.e_score_correction_bias",
     lambda m: ("param", "mlp.e_score_correction_bias", {})),
    # routed experts: original per-expert w1 (gate) / w3 (up) / w2 (down), or transformers stacked tensors
    (r"(?:block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\.(?P<w>w[123]|gate_proj|up_proj|down_proj)\." + _S,
     lambda m: ("expert", "mlp.w2" if m["w"] in ("w2", "down_proj") else "mlp.w13",
                {"expert": int(m["e"]), "part": 1 if m["w"] in ("w3", "up_proj") else 0})),
    (r"mlp\.experts\.gate_up_proj", lambda m: ("stacked_experts", "mlp.w13", {"split_parts": 2})),
    (r"mlp\.experts\.down_proj", lambda m: ("stacked_experts", "mlp.w2", {})),
    # shared expert
    (r"(?:block_sparse_moe|mlp)\.shared_experts?\.(?P<p>gate|up)_proj\." + _S,
     lambda m: ("linear", "mlp.shared.gate_up_proj", {"part": 0 if m["p"] == "gate" else 1})),
    (r"(?:block_sparse_moe|mlp)\.shared_experts?\.gate_up_proj\." + _S,
     lambda m: ("linear", "mlp.shared.gate_up_proj", {"split_parts": 2})),
    (r"(?:block_sparse_moe|mlp)\.shared_experts?\.down_proj\." + _S,
     lambda m: ("linear", "mlp.shared.down_proj", {})),
]]
_PREFIX = re.compile(r"^(?:language_model\.)?(?:model\.language_model\.|model\.)?")
_LAYER = re.compile(r"^layers\.(?P<i>\d+)\.(?P<rest>.+)$")


def classify(name: str) -> Slot | None:
    """The Slot of checkpoint tensor `name`; None when it is skipped by name; raises on unknown names."""
    if name.startswith(SKIP_PREFIXES) or ".mtp." in f".{name}" or name.startswith(("mtp.", "model.mtp.")):
        return None
    if name.startswith("language_model.") and name[len("language_model."):].startswith(SKIP_PREFIXES):
        return None
    if re.match(r"^(?:language_model\.)?lm_head\." + _S + "$", name):
        return Slot("linear", "lm_head", suffix=name.rsplit(".", 1)[1])
    rest = _PREFIX.sub("", name, count=1)
    if rest.startswith("mtp."):
        return None
    if rest == "embed_tokens.weight":
        return Slot("param", "embed.weight")
    if rest == "norm.weight":
        return Slot("param", "norm.weight")
    m = _LAYER.match(rest)
    if m:
        layer, tail = int(m["i"]), m["rest"]
        for pattern, make in _LAYER_TABLE:
            mm = pattern.match(tail)
            if mm:
                kind, module, extra = make(mm)
                suffix = mm.groupdict().get("suffix") or "weight"
                return Slot(kind, module, layer, suffix=suffix, **extra)
    raise CheckpointError(f"unknown checkpoint tensor {name!r}: not in m3serve's M3 name table")


def read_kv_cache_scales(src: TensorSource) -> dict[int, dict[str, float]]:
    """Per-layer KV-cache quantization scales a checkpoint carries, {layer: {"k": s, "v": s}}, as stored
    (their meaning, amax / 448 for FP8 or amax / (448*6) for NVFP4, is the exporter's: m3serve.kv.calibrate).
    A per-head scale is reduced to its max (the cache has one bound per layer and tensor)."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for name in src.names():
        slot = classify(name)
        if slot is None or slot.layer is None:
            continue
        if slot.kind == "kv_scale":
            roles = {"attn.k_scale": "k", "attn.v_scale": "v", "attn.kv_scale": "kv"}[slot.module]
        elif slot.kind == "linear" and slot.suffix in ("k_scale", "v_scale") \
                and slot.module == f"attn.{slot.suffix[0]}_proj":
            roles = slot.suffix[0]
        else:
            continue
        t = src.get(name).float()
        if t.numel() == 0 or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise CheckpointError(f"{name}: expected finite positive KV-cache scales, found {t.flatten()[:8].tolist()}")
        for role in roles:
            if role in out[slot.layer]:
                raise CheckpointError(f"{name}: a second {role}_scale for layer {slot.layer}")
            out[slot.layer][role] = float(t.max())
    return dict(out)


# ----------------------------------------------------------------------------- loading
def _resolve(model, slot: Slot):
    root = model if slot.layer is None else model.layers[slot.layer]
    obj = root
    for part in slot.module.split("."):
        obj = getattr(obj, part)
    return obj


def _linear_geometry(model, slot: Slot) -> tuple[int, int, str, tuple[int, int] | None]:
    """(full out rows of one part, full in cols, shard axis, this rank's (start, length) on that axis)."""
    cfg, tp = model.cfg, model.tp
    d, h = cfg.head_dim, cfg.hidden_size
    m = slot.module
    kv0, kvn = tp.kv_head_shard(cfg.num_key_value_heads)
    if m == "lm_head":
        return cfg.vocab_size, h, "rows", tp.shard(cfg.vocab_size, "vocab_size")
    if m == "attn.q_proj":
        s, n = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        return cfg.num_attention_heads * d, h, "rows", (s * d, n * d)
    if m in ("attn.k_proj", "attn.v_proj"):
        return cfg.num_key_value_heads * d, h, "rows", (kv0 * d, kvn * d)
    if m == "attn.index_q_proj":
        di = cfg.index_head_dim
        return cfg.index_n_heads * di, h, "rows", (kv0 * di, kvn * di)
    if m == "attn.index_k_proj":
        return cfg.index_head_dim, h, "rows", None
    if m == "attn.o_proj":
        s, n = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        return h, cfg.num_attention_heads * d, "cols", (s * d, n * d)
    inter = {"mlp.gate_up_proj": cfg.dense_intermediate_size, "mlp.down_proj": cfg.dense_intermediate_size,
             "mlp.shared.gate_up_proj": cfg.shared_intermediate_size,
             "mlp.shared.down_proj": cfg.shared_intermediate_size,
             "mlp.w13": cfg.intermediate_size, "mlp.w2": cfg.intermediate_size}[m]
    shard = tp.shard(inter, f"{m} intermediate size")
    if m.endswith(("down_proj", "w2")):
        return h, inter, "cols", shard
    return inter, h, "rows", shard


def _read_sharded(src: TensorSource, base: str, names: dict[str, str], n: int, k: int, axis: str,
                  shard: tuple[int, int] | None, split: tuple[int, int] | None = None) -> QWeight:
    """Read one part of a linear, only this rank's slice. `split` = (part, parts) cuts a fused tensor's rows."""
    present = {s: nm for s, nm in names.items() if s not in IGNORED_SUFFIXES}
    ckpt = next(iter(names.values())).rsplit(".", 1)[0]      # the checkpoint's own name for this linear
    if not present:
        raise CheckpointError(f"{ckpt}: only activation scales present, no weight")
    wname = present.get("weight_packed") or present.get("weight")
    if wname is None:
        raise CheckpointError(f"{ckpt}.weight: missing (for {base}); found {sorted(names)}")
    wdtype = src.dtype(wname)
    packed = wdtype == torch.uint8
    rows_full = n * (split[1] if split else 1)
    expect = (rows_full, k // 2 if packed else k)
    if tuple(src.shape(wname)) != expect:
        raise CheckpointError(f"{wname}: expected shape {list(expect)}, found {list(src.shape(wname))}")
    row0, nrows = 0, n
    if split:
        row0 = split[0] * n
    col0, ncols = 0, k
    if shard is not None and axis == "rows":
        row0, nrows = row0 + shard[0], shard[1]
    elif shard is not None and axis == "cols":
        col0, ncols = shard
    tensors = {}
    for suffix, nm in present.items():
        shape = src.shape(nm)
        if len(shape) == 0 or (len(shape) == 1 and shape[0] == 1):       # per-tensor scalars
            tensors[suffix] = src.get(nm)
            continue
        if len(shape) != 2 or shape[0] != rows_full:
            raise CheckpointError(f"{nm}: expected {rows_full} rows (2-D), found shape {list(shape)}")
        block = {"weight": 2 if packed else 1, "weight_packed": 2, "weight_scale_inv": MX_BLOCK,
                 "weight_scale": NVFP4_BLOCK}.get(suffix)
        if block is None or shape[1] != -(-k // block):
            raise CheckpointError(f"{nm}: {shape[1]} columns do not match in_features {k}")
        if col0 % block or (ncols % block and col0 + ncols != k):
            raise CheckpointError(f"{nm}: the tensor-parallel column slice [{col0}, {col0 + ncols}) does not "
                                  f"align with its block of {block} columns")
        cols = None if (col0 == 0 and ncols == k) else (col0 // block, -(-ncols // block))
        t = src.get(nm, rows=(row0, nrows), cols=cols)
        if suffix in ("weight_scale", "weight_scale_inv") and t.dtype == getattr(torch, "float8_e8m0fnu", None):
            t = t.view(torch.uint8)
        tensors[suffix] = t.contiguous()
    return read_linear(ckpt, tensors, nrows, ncols)


def load_checkpoint(model, src: TensorSource, *, keep_quantized: bool, dtype: torch.dtype,
                    device: torch.device | str = "cpu", check_complete: bool = True) -> set[str]:
    """Load every tensor of `src` into `model` (an M3ForCausalLM), slicing for its TP rank. Raises
    CheckpointError naming the tensor on anything missing, unknown, misshapen or wrongly typed."""
    cfg = model.cfg
    params: dict[Slot, str] = {}
    linears: dict[tuple, dict[str, str]] = defaultdict(dict)   # (layer, module, expert, part, split) -> suffix->name
    stacked: dict[tuple, str] = {}
    for name in src.names():
        slot = classify(name)
        if slot is None:
            continue
        if slot.layer is not None and slot.layer >= cfg.num_hidden_layers:
            continue  # a pruned model (minimax-m3:L) reads the first L layers of a full checkpoint
        if slot.kind == "kv_scale":
            continue  # the KV cache's, not a parameter: read_kv_cache_scales
        if slot.kind == "param":
            params[slot] = name
        elif slot.kind == "stacked_experts":
            stacked[(slot.layer, slot.module, slot.split_parts)] = name
        else:
            key = (slot.layer, slot.module, slot.expert, slot.part, slot.split_parts)
            if slot.suffix in linears[key]:
                raise CheckpointError(f"{name}: duplicate tensor for {slot.module} of layer {slot.layer}")
            linears[key][slot.suffix] = name

    def finish(q: QWeight) -> QWeight:
        if not keep_quantized or q.fmt == "dense":
            q = QWeight("dense", {"w": q.dequantize(dtype)})
        return QWeight(q.fmt, {k: v.to(device) for k, v in cast_dense(q, dtype).tensors.items()})

    # plain parameters ------------------------------------------------------
    loaded: set[str] = set()
    for slot, name in params.items():
        target = _resolve(model, slot)
        path = f"{'' if slot.layer is None else f'layers.{slot.layer}.'}{slot.module}"
        if slot.module == "embed.weight":
            v0, vn = model.tp.shard(cfg.vocab_size, "vocab_size")
            if tuple(src.shape(name)) != (cfg.vocab_size, cfg.hidden_size):
                raise CheckpointError(f"{name}: expected shape {[cfg.vocab_size, cfg.hidden_size]}, found "
                                      f"{list(src.shape(name))}")
            t = src.get(name, rows=(v0, vn)).to(dtype)
        else:
            t = src.get(name)
            if tuple(t.shape) != tuple(target.shape):
                raise CheckpointError(f"{name}: expected shape {list(target.shape)}, found {list(t.shape)}")
            if not t.dtype.is_floating_point:
                raise CheckpointError(f"{name}: expected a float tensor, found {t.dtype}")
            t = t.float()  # norms, router and correction bias stay fp32
        target.data = t.to(device)
        loaded.add(path)

    # linears (per part; experts stacked) ----------------------------------
    by_module: dict[tuple, dict] = defaultdict(lambda: defaultdict(dict))
    for (layer, module, expert, part, split), names in linears.items():
        by_module[(layer, module)][expert][(part, split)] = names
    for (layer, module), experts in by_module.items():
        slot = Slot("linear", module, layer)
        n, k, axis, shard = _linear_geometry(model, slot)
        base = f"{'' if layer is None else f'layers.{layer}.'}{module}"

        def read_one(parts: dict, where: str) -> QWeight:
            out = []
            if any(split > 1 for (_, split) in parts):
                (_, split), names = next(iter(parts.items()))
                for p in range(split):
                    out.append(_read_sharded(src, where, names, n, k, axis, shard, split=(p, split)))
            else:
                expected = 2 if module.endswith(("gate_up_proj", "w13")) else 1
                for p in range(expected):
                    if (p, 1) not in parts:
                        raise CheckpointError(f"{where}: missing the {('gate', 'up')[p] if expected == 2 else ''}"
                                              f" part".replace("  ", " "))
                    out.append(_read_sharded(src, f"{where}[{p}]", parts[(p, 1)], n, k, axis, shard))
            return out[0] if len(out) == 1 else concat_parts(where, out)

        target = _resolve(model, slot)
        if target.num_experts is None:
            target.set_weight(finish(read_one(experts[None], base)))
        else:
            missing = [e for e in range(cfg.num_local_experts) if e not in experts]
            if missing:
                raise CheckpointError(f"{base}: experts {missing[:8]}{'...' if len(missing) > 8 else ''} missing")
            target.set_weight(finish(stack_experts(base, [read_one(experts[e], f"{base}.experts.{e}")
                                                          for e in range(cfg.num_local_experts)])))
        loaded.add(base)

    for (layer, module, split), name in stacked.items():  # transformers [E, 2I, H] / [E, H, I] (dense only)
        slot = Slot("linear", module, layer)
        n, k, axis, shard = _linear_geometry(model, slot)
        rows_full = n * split
        expect = (cfg.num_local_experts, rows_full, k)
        if tuple(src.shape(name)) != expect:
            raise CheckpointError(f"{name}: expected shape {list(expect)}, found {list(src.shape(name))}")
        if not src.dtype(name).is_floating_point or src.dtype(name) == torch.float8_e4m3fn:
            raise CheckpointError(f"{name}: stacked expert tensors must be bf16/fp16/fp32, found {src.dtype(name)}")
        # Read only this rank's slice: rows of each fused part (column parallel) or input columns (row parallel).
        a, ln = shard if shard is not None else (0, n if axis == "rows" else k)
        if axis == "rows":
            parts = [src.get(name, dim1=(p * n + a, ln)) for p in range(split)]
        else:
            parts = [src.get(name, dim1=(p * n, n), cols=(a, ln)) for p in range(split)]
        w = torch.cat(parts, dim=1).to(dtype).contiguous()
        _resolve(model, slot).set_weight(QWeight("dense", {"w": w.to(device)}))
        loaded.add(f"layers.{layer}.{module}")

    if cfg.tie_word_embeddings and "lm_head" not in loaded and "embed.weight" in loaded:
        model.lm_head.set_weight(QWeight("dense", {"w": model.embed.weight.data}))
        loaded.add("lm_head")
    if check_complete:
        check_loaded(model, loaded)
    return loaded


def expected_paths(cfg: M3Config) -> list[str]:
    paths = ["embed.weight", "norm.weight", "lm_head"]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        paths += [p + "input_norm.weight", p + "post_norm.weight", p + "attn.q_norm.weight",
                  p + "attn.k_norm.weight"] + [p + f"attn.{x}_proj" for x in "qkvo"]
        if cfg.layer_types[i] == "sparse":
            paths += [p + "attn.index_q_proj", p + "attn.index_k_proj", p + "attn.index_q_norm.weight",
                      p + "attn.index_k_norm.weight"]
        if cfg.mlp_layer_types[i] == "dense":
            paths += [p + "mlp.gate_up_proj", p + "mlp.down_proj"]
        else:
            paths += [p + "mlp.router", p + "mlp.e_score_correction_bias", p + "mlp.w13", p + "mlp.w2"]
            if cfg.shared_intermediate_size:
                paths += [p + "mlp.shared.gate_up_proj", p + "mlp.shared.down_proj"]
    return paths


def check_loaded(model, loaded: set[str]) -> None:
    missing = [p for p in expected_paths(model.cfg) if p not in loaded]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors, first: {missing[:6]} "
                              "(m3serve module paths; see m3serve/model/weights.py for the checkpoint names)")
