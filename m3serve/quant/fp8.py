"""FP8 E4M3 (``torch.float8_e4m3fn``): saturating cast and per-tensor scaling.

Shape legend:
    x, q   [...]   any shape; q is float8_e4m3fn with x's shape
    scale  []      fp32 0-dim decode scale (x ~= q * scale)

This module is the numeric reference that FP8 kernels and the FP8 KV cache are certified
against, so every rounding step is spelled out: all arithmetic is fp32, the cast is
torch's round-to-nearest-even, and out-of-range values saturate to +-448.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0
# Largest finite fp32. Used so that a per-tensor amax of +-inf still yields a finite scale.
FP32_MAX = torch.finfo(torch.float32).max

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _require_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected one of {_FLOAT_DTYPES}, found dtype {t.dtype}")


def _as_fp32_scalar(name: str, s: Tensor | float, device: torch.device) -> Tensor:
    """A scale given as float or tensor, as fp32 on `device` (tensor shape kept: it broadcasts)."""
    if isinstance(s, Tensor):
        return s.to(device=device, dtype=torch.float32)
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return torch.tensor(float(s), dtype=torch.float32, device=device)
    raise TypeError(f"{name}: expected a float or a torch.Tensor, found {type(s).__name__}")


def cast_to_fp8(x: Tensor) -> Tensor:
    """Saturating cast to float8_e4m3fn.

    Clamping first matters: on some torch builds the plain cast maps |x| >= 464 (and inf) to
    NaN. clamp keeps NaN as NaN, and +-inf become +-448.
    """
    _require_float("x", x)
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_amax(x: Tensor) -> Tensor:
    """max|x| in fp32 as a 0-dim tensor; +-inf counts as the largest finite fp32, NaN propagates.

    Treating inf as FP32_MAX keeps the scale finite, so an inf element saturates to +-448
    instead of becoming inf/inf = NaN (kernels: ``a = where(a > FP32_MAX, FP32_MAX, a)``).
    """
    _require_float("x", x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.float().abs().clamp(max=FP32_MAX).amax()


def quantize_fp8(x: Tensor, scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
    """Per-tensor FP8: returns (q, scale) with q = cast_to_fp8(x / scale), computed in fp32.

    Without `scale`: scale = fp8_amax(x) / 448 (amax == 0 -> 1.0). A NaN anywhere makes the
    scale NaN, so the whole tensor dequantizes to NaN (the per-tensor "block" contains NaN).
    """
    _require_float("x", x)
    if scale is None:
        amax = fp8_amax(x)
        scale_t = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    else:
        scale_t = _as_fp32_scalar("scale", scale, x.device)
    q = cast_to_fp8(x.float() / scale_t)
    return q, scale_t


def dequantize_fp8(q: Tensor, scale: Tensor | float = 1.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """q.float() * scale (fp32 product, then cast to `dtype`)."""
    if not isinstance(q, Tensor) or q.dtype != torch.float8_e4m3fn:
        found = q.dtype if isinstance(q, Tensor) else type(q).__name__
        raise TypeError(f"q: expected torch.float8_e4m3fn, found {found}")
    scale_t = _as_fp32_scalar("scale", scale, q.device)
    return (q.float() * scale_t).to(dtype)
