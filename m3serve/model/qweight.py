"""Weight storage formats of one linear layer (or one stack of experts), read from checkpoint tensors.

A `QWeight` holds a [*, N, K] weight (y = x @ W^T) in one of four formats, in the layout the kernels read:
  dense  w       [*, N, K]  bf16 / fp16 / fp32
  fp8    q       [*, N, K]  float8_e4m3fn;  scale fp32 [*, P]   (W = q * scale of the row's part)
  mxfp8  q       [*, N, K]  float8_e4m3fn;  scale uint8 E8M0 [*, N, ceil(K/32)]
  nvfp4  packed  [*, N, K/2] uint8 (low nibble = even column); scale float8_e4m3fn [*, N, K/16];
         global_scale fp32 [*, P]   (the encode scale: W = e2m1 * scale / global_scale of the row's part)
`*` is an optional expert dim E. P "parts" exist because fused layers (gate|up, or q|k|v) are loaded from
separate checkpoint tensors with their own per-tensor scales: part p owns rows [p*N/P, (p+1)*N/P).
`layout` (NVFP4 and MXFP8): "rows", as checkpoints store it, or "mma_tile", the permutation inside blocks of 16 rows x
128 columns that the decode target's kernels read (m3serve.quant.tiles; same shapes, one copy). Dequantizing reads
either.

Checkpoint naming per linear (suffixes after `<name>.`):
  dense:  weight (bf16/fp16/fp32)
  fp8:    weight (float8_e4m3fn) + weight_scale (fp32 scalar)
  mxfp8:  weight (float8_e4m3fn) + weight_scale_inv (uint8 [N, K/32])
  nvfp4 ModelOpt:           weight (uint8 packed) + weight_scale (e4m3) + weight_scale_2 (fp32) [+ input_scale]
  nvfp4 compressed-tensors: weight_packed + weight_scale (e4m3) + weight_global_scale (fp32)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from m3serve.quant.mxfp8 import MX_BLOCK, dequantize_mxfp8
from m3serve.quant.nvfp4 import NVFP4_BLOCK, dequantize_nvfp4
from m3serve.quant.tiles import LAYOUTS, ROW_KEYS, TILED_FORMATS, to_layout

FORMATS = ("dense", "fp8", "mxfp8", "nvfp4")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, misshapen or wrongly typed; the message names it."""


@dataclass
class QWeight:
    fmt: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: str = "rows"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS or (self.layout != "rows" and self.fmt not in TILED_FORMATS):
            raise ValueError(f"QWeight.layout: expected 'rows' (any format) or one of {LAYOUTS} ({TILED_FORMATS}), "
                             f"found {self.layout!r} for {self.fmt}")

    @property
    def shape(self) -> tuple[int, ...]:
        if self.fmt == "nvfp4":
            s = self.tensors["packed"].shape
            return (*s[:-1], s[-1] * 2)
        return tuple(self.tensors["w" if self.fmt == "dense" else "q"].shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device) -> "QWeight":
        return QWeight(self.fmt, {k: v.to(device) for k, v in self.tensors.items()}, self.layout)

    def _row_major(self, index: int | None) -> dict[str, torch.Tensor]:
        """The tensors (of expert `index` when stacked) with the per-row ones in the row-major layout."""
        t = self.tensors if index is None else {k: v[index] for k, v in self.tensors.items()}
        if self.layout != "rows":
            kw, ks = ROW_KEYS[self.fmt]
            w, s = to_layout(self.fmt, t[kw], t[ks], self.layout, "rows")
            t = {**t, kw: w, ks: s}
        return t

    def dequantize(self, dtype: torch.dtype, index: int | None = None) -> torch.Tensor:
        """The dense weight (of expert `index` when stacked), in `dtype`."""
        t = self._row_major(index)
        if self.fmt == "dense":
            return t["w"].to(dtype)
        if self.fmt == "mxfp8":
            return dequantize_mxfp8(t["q"], t["scale"], dtype=torch.float32).to(dtype)
        if self.fmt == "fp8":
            return (t["q"].float() * _per_row(t["scale"], t["q"].shape[-2])).to(dtype)
        # nvfp4: dequantize with unit global scale, then divide each part by its own global scale.
        w = dequantize_nvfp4(t["packed"], t["scale"], 1.0, dtype=torch.float32)
        return (w / _per_row(t["global_scale"], w.shape[-2])).to(dtype)


    def dequantize_factored(self, dtype: torch.dtype, index: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W', f) with W = W' * f per output row, where W' is exact in bf16 (E2M1 x E4M3 has at most 6
        significant bits, FP8 and MXFP8 values at most 4) and f [N] fp32 (None when W' is W). The stock
        GEMM then rounds only where a fused kernel does: at the fp32 output, not in the weights."""
        t = self._row_major(index)
        if self.fmt == "nvfp4":
            w = dequantize_nvfp4(t["packed"], t["scale"], 1.0, dtype=torch.float32).to(dtype)
            return w, 1.0 / _per_row(t["global_scale"], w.shape[-2]).squeeze(-1)
        if self.fmt == "fp8":
            return t["q"].to(dtype), _per_row(t["scale"], t["q"].shape[-2]).squeeze(-1)
        return self.dequantize(dtype, index), None


def _per_row(part_scale: torch.Tensor, n: int) -> torch.Tensor:
    """[.., P] per-part factors -> [.., N, 1] per-row factors."""
    p = part_scale.shape[-1]
    return part_scale.float().repeat_interleave(n // p, dim=-1).unsqueeze(-1)


# ----------------------------------------------------------------------------- reading checkpoints
def detect_format(name: str, t: dict[str, torch.Tensor]) -> str:
    """The format of linear `name` from the tensor suffixes present (`t`: suffix -> tensor)."""
    if "weight_packed" in t:
        return "nvfp4"
    if "weight" not in t:
        raise CheckpointError(f"{name}: no `weight` (or `weight_packed`) tensor; found {sorted(t)}")
    w = t["weight"]
    if w.dtype == torch.uint8:
        return "nvfp4"
    if w.dtype == torch.float8_e4m3fn:
        if "weight_scale_inv" in t:
            return "mxfp8"
        if "weight_scale" in t:
            return "fp8"
        raise CheckpointError(f"{name}.weight is float8_e4m3fn but neither weight_scale_inv (MXFP8) nor "
                              f"weight_scale (FP8) is present; found {sorted(t)}")
    if w.dtype in FLOAT_DTYPES:
        return "dense"
    raise CheckpointError(f"{name}.weight has dtype {w.dtype}; expected bf16/fp16/fp32, float8_e4m3fn or uint8")


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{name}: expected shape {list(shape)}, found {list(t.shape)}")
    if t.dtype not in dtypes:
        raise CheckpointError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, found {t.dtype}")
    return t


def _scalar(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.numel() != 1:
        raise CheckpointError(f"{name}: expected a per-tensor scalar, found shape {list(t.shape)}")
    if not t.dtype.is_floating_point:
        raise CheckpointError(f"{name}: expected a float scalar, found {t.dtype}")
    v = t.reshape(()).float()
    if not torch.isfinite(v) or v <= 0:
        raise CheckpointError(f"{name}: per-tensor scale must be finite and positive, found {v.item()}")
    return v


def read_linear(name: str, t: dict[str, torch.Tensor], n: int, k: int) -> QWeight:
    """Canonical QWeight (one part) for checkpoint linear `name` of logical shape [n, k]; validates everything."""
    fmt = detect_format(name, t)
    if fmt == "dense":
        return QWeight("dense", {"w": _expect(f"{name}.weight", t["weight"], (n, k), FLOAT_DTYPES)})
    if fmt == "fp8":
        q = _expect(f"{name}.weight", t["weight"], (n, k), (torch.float8_e4m3fn,))
        return QWeight("fp8", {"q": q, "scale": _scalar(f"{name}.weight_scale", t["weight_scale"]).reshape(1)})
    if fmt == "mxfp8":
        q = _expect(f"{name}.weight", t["weight"], (n, k), (torch.float8_e4m3fn,))
        s = _expect(f"{name}.weight_scale_inv", t["weight_scale_inv"], (n, -(-k // MX_BLOCK)), (torch.uint8,))
        return QWeight("mxfp8", {"q": q, "scale": s})
    # nvfp4
    if k % NVFP4_BLOCK:
        raise CheckpointError(f"{name}: NVFP4 needs in_features divisible by {NVFP4_BLOCK}, found {k}")
    if "weight_packed" in t:  # compressed-tensors
        packed = _expect(f"{name}.weight_packed", t["weight_packed"], (n, k // 2), (torch.uint8,))
        if "weight_global_scale" not in t:
            raise CheckpointError(f"{name}: weight_packed without weight_global_scale")
        glob = _scalar(f"{name}.weight_global_scale", t["weight_global_scale"])
    else:  # ModelOpt
        packed = _expect(f"{name}.weight", t["weight"], (n, k // 2), (torch.uint8,))
        if "weight_scale_2" not in t:
            raise CheckpointError(f"{name}: packed uint8 weight without weight_scale_2 (ModelOpt NVFP4)")
        glob = 1.0 / _scalar(f"{name}.weight_scale_2", t["weight_scale_2"])
    if "weight_scale" not in t:
        raise CheckpointError(f"{name}: NVFP4 weight without weight_scale")
    scale = _expect(f"{name}.weight_scale", t["weight_scale"], (n, k // NVFP4_BLOCK), (torch.float8_e4m3fn,))
    return QWeight("nvfp4", {"packed": packed, "scale": scale, "global_scale": glob.reshape(1)})


# ----------------------------------------------------------------------------- slicing for tensor parallelism
def _require_rows(name: str, *qs: QWeight) -> None:
    """Loading-time cuts and joins work on the checkpoint (row-major) layout only."""
    for q in qs:
        if q.layout != "rows":
            raise ValueError(f"{name}: expected weights in the row-major layout (as loaded), found {q.layout!r}")


def slice_rows(q: QWeight, start: int, length: int) -> QWeight:
    """Rows [start, start+length) of a one-part QWeight (column parallelism)."""
    _require_rows("slice_rows", q)
    out = {}
    for key, v in q.tensors.items():
        out[key] = v if key in ("global_scale",) or (q.fmt == "fp8" and key == "scale") else v[start:start + length]
    return QWeight(q.fmt, out)


def slice_cols(q: QWeight, name: str, start: int, length: int) -> QWeight:
    """Input columns [start, start+length) (row parallelism), cut along the format's block structure."""
    _require_rows(name, q)
    block = {"dense": 1, "fp8": 1, "mxfp8": MX_BLOCK, "nvfp4": NVFP4_BLOCK}[q.fmt]
    if start % block or length % block:
        raise CheckpointError(f"{name}: a tensor-parallel slice of the input dim [{start}, {start + length}) "
                              f"does not align with the {q.fmt} block of {block}")
    t = q.tensors
    if q.fmt in ("dense",):
        return QWeight("dense", {"w": t["w"][:, start:start + length]})
    if q.fmt == "fp8":
        return QWeight("fp8", {"q": t["q"][:, start:start + length], "scale": t["scale"]})
    if q.fmt == "mxfp8":
        return QWeight("mxfp8", {"q": t["q"][:, start:start + length],
                                 "scale": t["scale"][:, start // block:(start + length) // block]})
    return QWeight("nvfp4", {"packed": t["packed"][:, start // 2:(start + length) // 2],
                             "scale": t["scale"][:, start // block:(start + length) // block],
                             "global_scale": t["global_scale"]})


def concat_parts(name: str, parts: list[QWeight]) -> QWeight:
    """Fuse parts along the output dim (gate|up, q|k|v): data concatenated, per-part scales kept per part."""
    _require_rows(name, *parts)
    fmts = {p.fmt for p in parts}
    if len(fmts) != 1:
        raise CheckpointError(f"{name}: fused parts have different formats {sorted(fmts)}")
    fmt = fmts.pop()
    out = {}
    for key in parts[0].tensors:
        if key == "global_scale" or (fmt == "fp8" and key == "scale"):
            out[key] = torch.cat([p.tensors[key].reshape(-1) for p in parts])
        else:
            out[key] = torch.cat([p.tensors[key] for p in parts], dim=0)
    return QWeight(fmt, out)


def stack_experts(name: str, experts: list[QWeight]) -> QWeight:
    _require_rows(name, *experts)
    fmts = {e.fmt for e in experts}
    if len(fmts) != 1:
        raise CheckpointError(f"{name}: experts are stored in different formats {sorted(fmts)}")
    return QWeight(fmts.pop(), {k: torch.stack([e.tensors[k] for e in experts]) for k in experts[0].tensors})


def cast_dense(q: QWeight, dtype: torch.dtype) -> QWeight:
    return QWeight("dense", {"w": q.tensors["w"].to(dtype)}) if q.fmt == "dense" else q
