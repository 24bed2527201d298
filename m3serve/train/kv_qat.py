"""Quantization-aware training for the KV cache: each chosen layer attends over its K and V as the cache would hand
them back (straight-through), so the model learns weights that the cache's rounding costs less.

Why: the hybrid cache stores the sparse (MSA) layers' K/V in NVFP4 (E2M1 values, one E4M3 scale per 16 values,
rotated by m3serve.kv.rotation). On the embedded model the K/V have no outliers to remove: the round trip's error
is NVFP4's floor (~9.5 % relative per value), and neither the rotation nor per-head scales nor mean smoothing
(bench/kv_smoothing.py) brings it down by more than 1.2x. What is left is to make the model tolerate it.

The fake quant (KVFakeQuant, per chosen layer, K and V each):

    y    = unrotate(decode(encode(rotate(x), gs)))    the cache's exact round trip (m3serve.kv.codec, fp32)
    out  = x + stop_gradient(y - x)                   forward sees y; backward passes d/dx as identity (STE)

gs = 448 * 6 / amax with amax = AMAX_HEADROOM x this tensor's max |rotate(x)| in the batch (no gradient). The
serving cache uses the per-layer amax `m3serve calibrate-kv` chose instead; the two agree in effect because
the round-trip error is flat in amax over a wide range (every 16-value block has its own E4M3 scale, the global
scale only places them in E4M3's range; see m3serve.kv.calibrate), and calibrate-kv's ties go to the largest
amax of its grid, 4x the observed max, which AMAX_HEADROOM copies. A dynamic amax follows K/V's scale while the
weights move; recalibrate the checkpoint after training (`m3serve calibrate-kv`).

Shape legend: k, v [..., T, Hk, D] (any leading batch dims), D the head dim.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from m3serve.kv import codec, rotation
from m3serve.quant.nvfp4 import nvfp4_global_scale

KV_QAT_FORMATS = ("nvfp4",)
AMAX_HEADROOM = 4.0


class KVFakeQuant:
    """forward_train's kv_transform: (layer, k, v) -> (k, v), the chosen layers' K/V through the cache round trip
    (straight-through), every other layer's unchanged."""

    def __init__(self, fmt: str, layers: Sequence[int], head_dim: int, rotation_seed: int | None):
        if fmt not in KV_QAT_FORMATS:
            raise ValueError(f"kv_qat: expected one of {KV_QAT_FORMATS}, found {fmt!r}")
        self.fmt = fmt
        self.layers = frozenset(int(i) for i in layers)
        if not self.layers:
            raise ValueError("layers: expected at least one layer to fake-quantize, found none (a model without "
                             "sparse layers has no NVFP4 K/V in the hybrid cache)")
        self.rotation_seed = rotation_seed
        self.signs = None if rotation_seed is None else rotation.rotation_signs(head_dim, rotation_seed)

    def __call__(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if layer not in self.layers:
            return k, v
        return self.straight_through(k), self.straight_through(v)

    @torch.no_grad()
    def roundtrip(self, x: Tensor) -> Tensor:
        """x [..., D] -> what the (rotated) NVFP4 cache reads back, fp32."""
        signs = None if self.signs is None else self.signs.to(x.device)
        y = x.float() if signs is None else rotation.rotate(x, signs)
        amax = y.abs().amax() * AMAX_HEADROOM
        gs = nvfp4_global_scale(amax)
        data, scale = codec.encode(self.fmt, y, gs)
        y = codec.decode(self.fmt, data, scale, gs, torch.float32)
        return y if signs is None else rotation.unrotate(y, signs)

    def straight_through(self, x: Tensor) -> Tensor:
        return x + (self.roundtrip(x).to(x.dtype) - x).detach()
