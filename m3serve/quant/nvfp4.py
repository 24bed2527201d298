"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements of the last dim, one fp32 global scale.

Shape legend:
    x            [..., K]        K % 16 == 0
    codes        [..., K]        uint8 0..15 = sign << 3 | magnitude index into E2M1_VALUES
    packed       [..., K/2]      uint8, column 2j in the LOW nibble, 2j+1 in the high nibble
    block_scale  [..., K/16]     float8_e4m3fn
    global_scale []              fp32 ENCODE scale gs = 448 * 6 / amax
                                 (compressed-tensors `weight_global_scale`; ModelOpt
                                 `weight_scale_2` = 1 / gs)

Encode, all fp32, in exactly this order (kernels are compared against it):
    block_scale = cast_to_fp8((amax16 / 6) * gs)
    codes       = e2m1_encode((x * gs) / block_scale.float())   # RNE, saturating at +-6
    codes       = 0 where block_scale is 0 or NaN
Decode: (e2m1 * block_scale.float()) / gs.

Non-finite inputs: +-inf makes amax16 inf, so the block scale saturates to 448 and inf gets
code +-6 (finite neighbours are scaled by 448 and usually round to 0). NaN makes the block
scale NaN (E4M3 0x7F), so the whole block dequantizes to NaN; its codes are 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3serve.quant._blocks import relayout
from m3serve.quant.fp8 import FP8_MAX, FP32_MAX, _as_fp32_scalar, _require_float, cast_to_fp8

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)

# Decision points between neighbouring magnitudes. At an exact midpoint round-to-nearest-even
# picks the neighbour whose code is even (its mantissa bit is 0): ties at 0.25, 1.25, 2.5, 5
# round down (to 0, 1, 2, 4) and ties at 0.75, 1.75, 3.5 round up (to 1, 2, 4).
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIE_UP = (0.75, 1.75, 3.5)


def _require_uint8(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.uint8:
        found = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name}: expected torch.uint8, found {found}")


def _global_scale_tensor(global_scale: Tensor | float, device: torch.device) -> Tensor:
    gs = _as_fp32_scalar("global_scale", global_scale, device)
    if gs.numel() != 1:
        raise ValueError(f"global_scale: expected a single per-tensor value, found shape {tuple(gs.shape)}")
    return gs.reshape(())


def e2m1_encode(y: Tensor) -> Tensor:
    """fp32 values in E2M1 units -> uint8 codes: round-to-nearest-even, |y| > 6 saturates to 6.

    The sign bit is the sign bit of y (so -0.0 and tiny negatives give code 8, "-0"); NaN gets
    code 0 so the output never depends on a NaN's sign bit.
    """
    a = y.float().abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _TIE_DOWN:
        mag += (a > t).to(torch.uint8)
    for t in _TIE_UP:
        mag += (a >= t).to(torch.uint8)
    neg = torch.signbit(y) & ~torch.isnan(y)
    return mag | (neg.to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 codes (0..15) -> fp32 values; code 8 decodes to -0.0."""
    _require_uint8("codes", codes)
    mag = E2M1_VALUES.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_e2m1(codes: Tensor) -> Tensor:
    """uint8 codes [..., K] -> packed [..., K/2]; even column in the low nibble."""
    _require_uint8("codes", codes)
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        found = "0-dim" if codes.dim() == 0 else f"K={codes.shape[-1]}"
        raise ValueError(f"codes: expected an even last dim K, found {found}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes: expected values 0..15, found max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """packed [..., K/2] -> uint8 codes [..., K] (inverse of pack_e2m1)."""
    _require_uint8("packed", packed)
    if packed.dim() == 0:
        raise ValueError("packed: expected at least 1 dim [..., K/2], found a 0-dim tensor")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_global_scale(amax: Tensor | float) -> Tensor:
    """448 * 6 / amax as an fp32 0-dim tensor; amax == 0 -> 1.0.

    amax = +-inf is read as the largest finite fp32 (a tiny but nonzero scale, so inf saturates
    instead of x * 0 = NaN); NaN propagates.
    """
    a = _as_fp32_scalar("amax", amax, amax.device if isinstance(amax, Tensor) else torch.device("cpu"))
    if a.numel() != 1:
        raise ValueError(f"amax: expected a single value, found shape {tuple(a.shape)}")
    a = a.reshape(()).abs().clamp(max=FP32_MAX)
    return torch.where(a == 0, torch.ones_like(a), (FP8_MAX * E2M1_MAX) / a)


def quantize_nvfp4(x: Tensor, global_scale: Tensor | float) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (packed uint8 [..., K/2], block_scale float8_e4m3fn [..., K/16])."""
    _require_float("x", x)
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK != 0:
        found = "a 0-dim tensor" if x.dim() == 0 else f"K={x.shape[-1]}"
        raise ValueError(f"x: NVFP4 needs the last dim K to be a multiple of {NVFP4_BLOCK}, found {found}")
    gs = _global_scale_tensor(global_scale, x.device)
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    amax16 = blocks.abs().amax(dim=-1)
    block_scale = cast_to_fp8((amax16 / E2M1_MAX) * gs)
    bs = block_scale.float().unsqueeze(-1)
    codes = e2m1_encode((blocks * gs) / bs)
    # bs > 0 is False for 0 and NaN: a zero scale would give 0/0 = NaN or x/0 = inf codes.
    codes = torch.where(bs > 0, codes, torch.zeros_like(codes))
    return pack_e2m1(codes.reshape(x.shape)), block_scale


def dequantize_nvfp4(
    packed: Tensor, block_scale: Tensor, global_scale: Tensor | float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(e2m1 * block_scale.float()) / global_scale, fp32, then cast to `dtype`."""
    _require_uint8("packed", packed)
    if not isinstance(block_scale, Tensor) or block_scale.dtype != torch.float8_e4m3fn:
        found = block_scale.dtype if isinstance(block_scale, Tensor) else type(block_scale).__name__
        raise TypeError(f"block_scale: expected torch.float8_e4m3fn, found {found}")
    if packed.dim() == 0:
        raise ValueError("packed: expected at least 1 dim [..., K/2], found a 0-dim tensor")
    k = packed.shape[-1] * 2
    want = (*packed.shape[:-1], k // NVFP4_BLOCK)
    if k % NVFP4_BLOCK != 0 or tuple(block_scale.shape) != want:
        raise ValueError(
            f"block_scale: expected shape {want} (K={k}, one scale per {NVFP4_BLOCK}) "
            f"for packed {tuple(packed.shape)}, found {tuple(block_scale.shape)}"
        )
    gs = _global_scale_tensor(global_scale, packed.device)
    vals = e2m1_decode(unpack_e2m1(packed))
    bs = block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return ((vals * bs) / gs).to(dtype)


# --- KV-cache scale-pool byte order (mechanisms.md §1.1) ------------------------------------
# Per (slot, head) sub-page of T tokens and G = head_dim/16 scale columns: K scales are
# token-major (byte t*G + g, a plain reshape); V scales use the 4x4 "token-quad" order,
# byte (t//4)*(4*G) + 4*g + (t%4).


def v_scale_to_quad_order(scale: Tensor) -> Tensor:
    """V block scales [..., T, G] -> page bytes [..., T*G] in token-quad order (T % 4 == 0)."""
    if scale.dim() < 2 or scale.shape[-2] % 4 != 0:
        found = tuple(scale.shape)
        raise ValueError(f"scale: expected [..., T, G] with T % 4 == 0, found shape {found}")
    *lead, t, g = scale.shape
    quads = scale.reshape(*lead, t // 4, 4, g).transpose(-1, -2)
    return quads.reshape(*lead, t * g)


def v_scale_from_quad_order(page: Tensor, tokens: int) -> Tensor:
    """Inverse of v_scale_to_quad_order: page bytes [..., T*G] -> [..., T, G]."""
    if tokens % 4 != 0 or page.dim() < 1 or page.shape[-1] % tokens != 0:
        raise ValueError(
            f"page: expected [..., T*G] with T={tokens} a multiple of 4 dividing the last dim, "
            f"found shape {tuple(page.shape)}"
        )
    *lead, n = page.shape
    g = n // tokens
    quads = page.reshape(*lead, tokens // 4, g, 4).transpose(-1, -2)
    return quads.reshape(*lead, tokens, g)


# --- The MMA tile layout of NVFP4 weights ----------------------------------------------------------------
# A weight [..., N, K] in NVFP4 is two tensors: packed bytes [..., N, K/2] and E4M3 group scales [..., N, K/16].
# Checkpoints store both row-major. The decode kernels read them in the "MMA tile layout": the same bytes, the
# same shapes, permuted inside each block of 16 rows x 128 columns so that the 32 lanes of a warp that feed one
# mma.m16n8k16 read 512 contiguous bytes per load instead of 8 rows x 64 B:
#     bytes   block (rb, ks) = 1 KB at rb * 16 * K/2 + ks * 1024, ordered [h, lane, 16 B]:
#             lane = 4 g + c holds row 16 rb + 8 h + g, bytes 64 ks + 16 c .. + 15 of that row
#     scales  block (rb, ks) = 128 B at rb * 16 * K/16 + ks * 128, ordered [g, c, h, 2 B]:
#             the two scales of groups 8 ks + 2 c, + 1 of row 16 rb + 8 h + g
# A block of 16 rows starts where its first row starts in the row-major layout, so a slice of whole blocks of
# rows (a fused projection's part, one expert of a stack) is itself a tiled weight.
TILE_ROWS, TILE_COLS = 16, 128


def check_tileable(packed: Tensor, scale: Tensor) -> None:
    """Raise unless (packed, scale) is an NVFP4 weight the MMA tile layout covers: N % 16 == 0, K % 128 == 0."""
    if packed.dim() < 2 or scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * 8 != packed.shape[-1]:
        raise ValueError(f"packed/scale: expected [..., N, K/2] and [..., N, K/16], found {tuple(packed.shape)} "
                         f"and {tuple(scale.shape)}")
    n, kb = packed.shape[-2], packed.shape[-1]
    if n % TILE_ROWS or (2 * kb) % TILE_COLS:
        raise ValueError(f"packed: the MMA tile layout needs N % {TILE_ROWS} == 0 and K % {TILE_COLS} == 0, found "
                         f"N={n}, K={2 * kb}")


def _splits(packed: Tensor) -> tuple[tuple, tuple]:
    """(bytes, scales) factor splits of the row-major layout: bytes [rb, h, g, ks, c, j], scales [rb, h, g, ks, c, e]."""
    n, kb = packed.shape[-2], packed.shape[-1]
    return (n // 16, 2, 8, kb // 64, 4, 16), (n // 16, 2, 8, kb // 64, 4, 2)


# tiled orders: bytes [rb, ks, h, g, c, j], scales [rb, ks, g, c, h, e]
_ORDERS = (0, 3, 1, 2, 4, 5), (0, 3, 2, 4, 1, 5)


def tile_nvfp4(packed: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Row-major NVFP4 (packed [..., N, K/2], scale [..., N, K/16]) -> the MMA tile layout, same shapes and
    dtypes, new tensors."""
    check_tileable(packed, scale)
    return relayout(packed, scale, _splits(packed), _ORDERS)


def untile_nvfp4(packed: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of tile_nvfp4: MMA tile layout -> row-major, new tensors."""
    check_tileable(packed, scale)
    return relayout(packed, scale, _splits(packed), _ORDERS, inverse=True)
