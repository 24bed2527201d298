"""Quantize-on-write / dequantize-on-read of KV tokens, per storage format (torch reference).

Shape legend:
    x        [T, H, D]    K or V tokens (any float dtype); index-K uses H-less [T, Di]
    data     [T, H, Dc]   stored container: model dtype / bf16 / float8_e4m3fn / packed uint8 (Dc = D/2)
    scale    [T, H, G]    float8_e4m3fn block scales, G = D/16 (NVFP4 only)
    gs       []           fp32 per-tensor NVFP4 encode scale (x * gs is quantized; decode divides)

All quantization goes through m3serve.quant, in fp32, so that Triton kernels are certified
against exactly these roundings. FP8 is unscaled: a saturating cast (scale 1), as TRT stores M3.
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3serve.kv.spec import FMT_TORCH_DTYPE
from m3serve.quant.fp8 import cast_to_fp8, dequantize_fp8
from m3serve.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4


def encode(fmt: str, x: Tensor, gs: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """x [..., D] -> (data [..., Dc], block scales [..., D/16] or None)."""
    if fmt == "nvfp4":
        if gs is None:
            raise ValueError("gs: NVFP4 encode needs the per-tensor global scale, found None")
        return quantize_nvfp4(x.float(), gs)
    if fmt == "fp8":
        return cast_to_fp8(x.float()), None
    return x.to(FMT_TORCH_DTYPE[fmt]), None


def decode(fmt: str, data: Tensor, scale: Tensor | None, gs: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Inverse of encode up to its rounding: data [..., Dc] (+ scales) -> [..., D] in `dtype`."""
    if fmt == "nvfp4":
        if scale is None or gs is None:
            raise ValueError("scale/gs: NVFP4 decode needs block scales and the global scale, found None")
        return dequantize_nvfp4(data, scale, gs, dtype)
    if fmt == "fp8":
        return dequantize_fp8(data, 1.0, dtype)
    return data.to(dtype)
