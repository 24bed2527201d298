"""MXFP8: E4M3 elements with one E8M0 power-of-two scale per 32 elements of the last dim.

Shape legend:
    w, q   [..., K]              q is float8_e4m3fn
    scale  [..., ceil(K/32)]     uint8 E8M0 byte b: 2**(b - 127); b = 255 is NaN
    (the MiniMax-M3-MXFP8 checkpoint stores `weight` = q [out, in], `weight_scale_inv` = scale)

Encoding rule (exact, no floating log2): the block exponent e is the smallest integer with
amax_block <= 448 * 2**e, i.e. ceil(log2(amax_block / 448)) evaluated exactly, clamped to
[-127, 127]. Hence no finite element saturates. All-zero block -> e = 0 (byte 127); a block
with +-inf -> e = 127 and inf saturates to +-448 (dequantizing to +-inf, since 448 * 2**127
overflows fp32); a block with NaN -> byte 255, and the whole block dequantizes to NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3serve.quant._blocks import relayout
from m3serve.quant.fp8 import _require_float, cast_to_fp8

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_to_float(scale_e8m0: Tensor) -> Tensor:
    """uint8 E8M0 -> fp32 2**(b - 127), built from bits so it is exact (b = 0 is the fp32
    subnormal 2**-127; b = 255 is NaN)."""
    if not isinstance(scale_e8m0, Tensor) or scale_e8m0.dtype != torch.uint8:
        found = scale_e8m0.dtype if isinstance(scale_e8m0, Tensor) else type(scale_e8m0).__name__
        raise TypeError(f"scale_e8m0: expected torch.uint8, found {found}")
    b = scale_e8m0.to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(b == E8M0_NAN, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def mxfp8_scale_from_amax(amax: Tensor) -> Tensor:
    """Block amax (fp32, >= 0 or NaN) -> uint8 E8M0 byte; see the module docstring for the rule.

    frexp gives amax = m * 2**p with m in [0.5, 1); 448 = 0.875 * 2**9, so the smallest e with
    m * 2**(p - e) <= 448 is p - 9 when m <= 0.875 and p - 8 otherwise. This is exact for
    subnormal amax too, unlike a floating log2 near powers of two.
    """
    amax = amax.float()
    m, p = torch.frexp(amax)
    e = torch.where(m <= 0.875, p - 9, p - 8)
    e = torch.where(torch.isinf(amax), torch.full_like(e, 127), e)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    e = e.clamp(-E8M0_BIAS, E8M0_BIAS)
    b = (e + E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isnan(amax), torch.full_like(b, E8M0_NAN), b)


def _pad_to_blocks(x: Tensor, block: int) -> Tensor:
    """[..., K] -> [..., ceil(K/block), block], zero-padding the last (partial) block."""
    k = x.shape[-1]
    nb = -(-k // block)
    if nb * block != k:
        x = torch.nn.functional.pad(x, (0, nb * block - k))
    return x.reshape(*x.shape[:-1], nb, block)


def quantize_mxfp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., K] -> (q float8_e4m3fn [..., K], scale uint8 [..., ceil(K/32)]).

    q = cast_to_fp8(w / 2**e) in fp32; dividing by a power of two is exact unless the result
    is an fp32 subnormal, where it is a single correctly rounded step.
    """
    _require_float("w", w)
    if w.dim() == 0:
        raise ValueError("w: expected at least 1 dim [..., K], found a 0-dim tensor")
    k = w.shape[-1]
    blocks = _pad_to_blocks(w.float(), MX_BLOCK)
    scale = mxfp8_scale_from_amax(blocks.abs().amax(dim=-1))
    q = cast_to_fp8(blocks / e8m0_to_float(scale).unsqueeze(-1))
    q = q.reshape(*w.shape[:-1], -1)[..., :k]
    return q, scale


def dequantize_mxfp8(q: Tensor, scale_e8m0: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q.float() * 2**(scale - 127) broadcast over each 32-block (the last one may be partial)."""
    if not isinstance(q, Tensor) or q.dtype != torch.float8_e4m3fn:
        found = q.dtype if isinstance(q, Tensor) else type(q).__name__
        raise TypeError(f"q: expected torch.float8_e4m3fn, found {found}")
    k = q.shape[-1]
    want = (*q.shape[:-1], -(-k // MX_BLOCK))
    if tuple(scale_e8m0.shape) != want:
        raise ValueError(f"scale_e8m0: expected shape {want} for q {tuple(q.shape)}, found {tuple(scale_e8m0.shape)}")
    s = e8m0_to_float(scale_e8m0).repeat_interleave(MX_BLOCK, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


# --- The MMA tile layout of MXFP8 weights ----------------------------------------------------------------
# The MXFP8 twin of nvfp4.tile_nvfp4 (same purpose: the lanes of a warp feeding one mma.m16n8k16 read 512 contiguous
# bytes per load). Inside each block of 16 rows x 128 columns:
#     bytes   2 KB at rb * 16 * K + ks * 2048, ordered [h, v, lane, 16 B]:
#             lane = 4 g + c holds row 16 rb + 8 h + g, bytes 128 ks + 32 c + 16 v .. + 15 of that row
#     scales  64 B at rb * 16 * K/32 + ks * 64, ordered [g, c, h]: the scale of group 4 ks + c of row 16 rb + 8 h + g
# A block of 16 rows starts where its first row starts in the row-major layout (slices of whole blocks of rows are
# tiled weights too).


def check_tileable_mxfp8(q: Tensor, scale: Tensor) -> None:
    """Raise unless (q, scale) is an MXFP8 weight the MMA tile layout covers: N % 16 == 0, K % 128 == 0."""
    if q.dim() < 2 or scale.shape[:-1] != q.shape[:-1] or scale.shape[-1] * MX_BLOCK != q.shape[-1]:
        raise ValueError(f"q/scale: expected [..., N, K] and [..., N, K/32], found {tuple(q.shape)} and "
                         f"{tuple(scale.shape)}")
    n, k = q.shape[-2], q.shape[-1]
    if n % 16 or k % 128:
        raise ValueError(f"q: the MMA tile layout needs N % 16 == 0 and K % 128 == 0, found N={n}, K={k}")


def _mx_splits(q: Tensor) -> tuple[tuple, tuple]:
    """(bytes, scales) factor splits of the row-major layout: bytes [rb, h, g, ks, c, v, j], scales [rb, h, g, ks, c]."""
    n, k = q.shape[-2], q.shape[-1]
    return (n // 16, 2, 8, k // 128, 4, 2, 16), (n // 16, 2, 8, k // 128, 4)


# tiled orders: bytes [rb, ks, h, v, g, c, j], scales [rb, ks, g, c, h]
_ORDERS = (0, 3, 1, 5, 2, 4, 6), (0, 3, 2, 4, 1)


def tile_mxfp8(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Row-major MXFP8 (q [..., N, K], scale [..., N, K/32]) -> the MMA tile layout, same shapes and dtypes."""
    check_tileable_mxfp8(q, scale)
    return relayout(q, scale, _mx_splits(q), _ORDERS)


def untile_mxfp8(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of tile_mxfp8."""
    check_tileable_mxfp8(q, scale)
    return relayout(q, scale, _mx_splits(q), _ORDERS, inverse=True)
