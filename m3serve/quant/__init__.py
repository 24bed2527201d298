"""Reference quantization formats of m3serve (FP8, MXFP8, NVFP4, lossless 12-bit head).

Every Triton kernel and the KV cache are certified against these functions, so they are
written for exactness, not speed. They never raise on NaN/inf values (they also run on
activations); use `check_finite` where non-finite input is an error (checkpoint weights).
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3serve.quant.fp8 import FP8_MAX, cast_to_fp8, dequantize_fp8, quantize_fp8
from m3serve.quant.head12 import (
    TILE_COLS,
    TILE_ROWS,
    Head12,
    decode_head12,
    encode_head12,
    head12_escape_rate,
    head12_gemv_reference,
    try_encode_head12,
)
from m3serve.quant.mxfp8 import MX_BLOCK, dequantize_mxfp8, e8m0_to_float, quantize_mxfp8
from m3serve.quant.nvfp4 import (
    E2M1_VALUES,
    NVFP4_BLOCK,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    nvfp4_global_scale,
    pack_e2m1,
    quantize_nvfp4,
    unpack_e2m1,
)


def check_finite(name: str, t: Tensor) -> None:
    """Raise ValueError naming `name` and the count of NaN/inf values; integer tensors pass."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if not t.is_floating_point():
        return
    # isfinite is not implemented for the float8 dtypes; the fp32 upcast is exact.
    tf = t.float() if t.element_size() == 1 else t
    bad = int((~torch.isfinite(tf)).sum())
    if bad:
        n_nan = int(torch.isnan(tf).sum())
        raise ValueError(
            f"{name}: expected all values finite, found {bad} non-finite of {t.numel()} "
            f"({n_nan} NaN, {bad - n_nan} inf)"
        )


__all__ = [
    "E2M1_VALUES",
    "FP8_MAX",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "TILE_COLS",
    "TILE_ROWS",
    "Head12",
    "cast_to_fp8",
    "check_finite",
    "decode_head12",
    "dequantize_fp8",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_to_float",
    "encode_head12",
    "head12_escape_rate",
    "head12_gemv_reference",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantize_fp8",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "try_encode_head12",
    "unpack_e2m1",
]
