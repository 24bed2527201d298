"""Lossless 12-bit coding of BF16 weight matrices (the LM head), mechanisms.md §6.

Shape legend:
    w              [N, K]           bf16, N % 16 == 0, K % 128 == 0
    sign_mantissa  [N, K]           uint8  sign << 7 | mantissa (7 bits), kept for every element
    exp_codes      [N, K/2]         uint8  two 4-bit codes, column 2j in the LOW nibble
    tile_base      [N/16, K/128]    uint8  per (16-row, 128-col) tile, 0..240
    escape_index   [E]              int64  sorted flat indices row * K + col
    escape_value   [E]              bf16   their exact values
    x              [M, K]           activations for the GEMV reference

A BF16 value is sign(1) | exponent(8) | mantissa(7). The exponent is replaced by a code:
    0       exponent 0 (zero or subnormal; exact because the mantissa is kept)
    1..14   exponent tile_base + code
    15      escape: the value lives in (escape_index, escape_value); inf/NaN (exponent 255)
            always escape. The sign/mantissa byte of an escaped slot still holds the true bits.
tile_base <= 240 so that an in-window exponent is at most 254 (never inf/NaN).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from m3serve.quant.nvfp4 import pack_e2m1, unpack_e2m1

TILE_ROWS = 16
TILE_COLS = 128
ESCAPE_CODE = 15
WINDOW = 14  # codes 1..14
MAX_TILE_BASE = 254 - WINDOW
# Rows per encode/decode step: bounds the int64/int32 temporaries to ~100 MB at K = 6144,
# so the 200064 x 6144 LM head can be coded on a loader host without a 10 GB spike.
_CHUNK_ROWS = 1024

log = logging.getLogger(__name__)


@dataclass
class Head12:
    sign_mantissa: Tensor
    exp_codes: Tensor
    tile_base: Tensor
    escape_index: Tensor
    escape_value: Tensor
    shape: tuple[int, int]


def _check_weight(w: Tensor) -> tuple[int, int]:
    if not isinstance(w, Tensor) or w.dtype != torch.bfloat16:
        found = w.dtype if isinstance(w, Tensor) else type(w).__name__
        raise TypeError(f"w: expected torch.bfloat16, found {found}")
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D [N, K] matrix, found shape {tuple(w.shape)}")
    n, k = w.shape
    if n % TILE_ROWS != 0:
        raise ValueError(f"w: expected N % {TILE_ROWS} == 0 (rows are not padded), found N={n}")
    if k % TILE_COLS != 0:
        raise ValueError(f"w: expected K % {TILE_COLS} == 0, found K={k}")
    return n, k


def _bits(w: Tensor) -> Tensor:
    """bf16 -> its 16 bits as int32 in 0..65535."""
    return w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _expand_tiles(t: Tensor) -> Tensor:
    """[R/16, K/128] per-tile values -> [R, K] per element."""
    return t.repeat_interleave(TILE_ROWS, dim=0).repeat_interleave(TILE_COLS, dim=1)


def _best_base(exp: Tensor) -> Tensor:
    """exp int32 [R, K] -> uint8 [R/16, K/128]: the base whose window [base+1, base+14] holds
    the most elements with exponent 1..254; ties go to the smallest base (argmax is first-max)."""
    r, k = exp.shape
    tr, tc = r // TILE_ROWS, k // TILE_COLS
    tile_id = (
        torch.arange(tr, device=exp.device).view(tr, 1, 1, 1) * tc
        + torch.arange(tc, device=exp.device).view(1, 1, tc, 1)
    ).expand(tr, TILE_ROWS, tc, TILE_COLS)
    flat = tile_id.reshape(r, k) * 256 + exp.long()
    hist = torch.bincount(flat.reshape(-1), minlength=tr * tc * 256).view(tr, tc, 256)
    # window(base) = exponents base+1..base+14 = cum[base+14] - cum[base]; with 0 <= base <= 240
    # it never counts exponent 0 (own code) or 255 (inf/NaN, always escaped).
    cum = hist.cumsum(dim=-1)
    in_window = cum[..., WINDOW : WINDOW + MAX_TILE_BASE + 1] - cum[..., : MAX_TILE_BASE + 1]
    return in_window.argmax(dim=-1).to(torch.uint8)


def encode_head12(w: Tensor) -> Head12:
    n, k = _check_weight(w)
    sm_parts, code_parts, base_parts, esc_parts = [], [], [], []
    for r0 in range(0, n, _CHUNK_ROWS):
        bits = _bits(w[r0 : r0 + _CHUNK_ROWS])
        exp = (bits >> 7) & 0xFF
        base = _best_base(exp)
        c = exp - _expand_tiles(base).to(torch.int32)
        code = torch.where((c >= 1) & (c <= WINDOW), c, torch.full_like(c, ESCAPE_CODE))
        code = torch.where(exp == 0, torch.zeros_like(code), code)
        sm_parts.append((((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8))
        code_parts.append(pack_e2m1(code.to(torch.uint8)))
        base_parts.append(base)
        esc_parts.append(torch.nonzero(code.reshape(-1) == ESCAPE_CODE).reshape(-1) + r0 * k)
    escape_index = torch.cat(esc_parts)
    return Head12(
        sign_mantissa=torch.cat(sm_parts),
        exp_codes=torch.cat(code_parts),
        tile_base=torch.cat(base_parts),
        escape_index=escape_index,
        escape_value=w.reshape(-1)[escape_index].clone(),
        shape=(n, k),
    )


def _check_head(h: Head12) -> tuple[int, int]:
    n, k = h.shape
    want = {
        "sign_mantissa": ((n, k), torch.uint8),
        "exp_codes": ((n, k // 2), torch.uint8),
        "tile_base": ((n // TILE_ROWS, k // TILE_COLS), torch.uint8),
    }
    for name, (shape, dtype) in want.items():
        t = getattr(h, name)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"Head12.{name}: expected {dtype} {shape}, found {t.dtype} {tuple(t.shape)}")
    if h.escape_index.dtype != torch.int64 or h.escape_value.dtype != torch.bfloat16:
        raise ValueError(
            f"Head12.escape_index/escape_value: expected int64/bfloat16, "
            f"found {h.escape_index.dtype}/{h.escape_value.dtype}"
        )
    if h.escape_index.shape != h.escape_value.shape or h.escape_index.dim() != 1:
        raise ValueError(
            f"Head12.escape_index/escape_value: expected equal 1-D shapes, "
            f"found {tuple(h.escape_index.shape)} and {tuple(h.escape_value.shape)}"
        )
    return n, k


def _escapes_in_rows(h: Head12, r0: int, r1: int) -> tuple[Tensor, Tensor]:
    """Escapes with flat index in [r0*K, r1*K), as (index relative to row r0, value)."""
    k = h.shape[1]
    bounds = torch.tensor([r0 * k, r1 * k], dtype=torch.int64, device=h.escape_index.device)
    lo, hi = torch.searchsorted(h.escape_index, bounds).tolist()
    return h.escape_index[lo:hi] - r0 * k, h.escape_value[lo:hi]


def _decode_rows(h: Head12, r0: int, r1: int) -> tuple[Tensor, Tensor]:
    """Rows [r0, r1) -> (bf16 with escaped slots still unpatched, bool escape mask)."""
    sm = h.sign_mantissa[r0:r1].to(torch.int32)
    code = unpack_e2m1(h.exp_codes[r0:r1]).to(torch.int32)
    base = _expand_tiles(h.tile_base[r0 // TILE_ROWS : r1 // TILE_ROWS]).to(torch.int32)
    escaped = code == ESCAPE_CODE
    exp = torch.where((code == 0) | escaped, torch.zeros_like(code), base + code)
    bits = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # int16 two's complement, no wrap cast
    return bits.to(torch.int16).view(torch.bfloat16), escaped


def _decode_rows_exact(h: Head12, r0: int, r1: int) -> Tensor:
    out, _ = _decode_rows(h, r0, r1)
    idx, val = _escapes_in_rows(h, r0, r1)
    out.view(-1)[idx] = val
    return out


def decode_head12(h: Head12) -> Tensor:
    n, _ = _check_head(h)
    return torch.cat([_decode_rows_exact(h, r0, min(r0 + _CHUNK_ROWS, n)) for r0 in range(0, n, _CHUNK_ROWS)])


def head12_escape_rate(h: Head12) -> float:
    n, k = h.shape
    return h.escape_index.numel() / (n * k)


def try_encode_head12(w: Tensor, max_escape_rate: float = 1e-3) -> Head12 | None:
    """encode_head12 plus a full bit-exact check; None means "keep the BF16 weight".

    Shape/dtype errors still raise: they are caller bugs, not a property of the weights.
    """
    h = encode_head12(w)
    rate = head12_escape_rate(h)
    if rate > max_escape_rate:
        log.info("head12 refused: escape rate %.3g > %.3g", rate, max_escape_rate)
        return None
    n = h.shape[0]
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, n)
        got = _decode_rows_exact(h, r0, r1).view(torch.int16)
        if not torch.equal(got, w[r0:r1].contiguous().view(torch.int16)):
            log.warning("head12 refused: decode mismatch in rows [%d, %d)", r0, r1)
            return None
    return h


def head12_gemv_reference(x: Tensor, h: Head12) -> Tensor:
    """x [M, K] -> fp32 [M, N] = x @ w.T, computed like the kernel: escaped slots decode to 0
    in the dense product, then sum_e x[:, col_e] * value_e is added to column row_e.

    Runs on the CPU (result moved to x's device): CPU fp32 matmul never uses TF32, and this
    avoids touching the process-wide CUDA precision flags other code may own.
    """
    n, k = _check_head(h)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        found = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"x: expected a floating-point tensor, found {found}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected [M, {k}], found shape {tuple(x.shape)}")
    cpu = torch.device("cpu")
    xf = x.detach().to(cpu, torch.float32)
    planes = (h.sign_mantissa, h.exp_codes, h.tile_base, h.escape_index, h.escape_value)
    hc = Head12(*(t.to(cpu) for t in planes), shape=h.shape)
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, n)
        wb, escaped = _decode_rows(hc, r0, r1)
        w0 = torch.where(escaped, torch.zeros((), dtype=torch.float32), wb.float())
        y[:, r0:r1] = xf @ w0.T
    rows = hc.escape_index // k
    cols = hc.escape_index % k
    y.index_add_(1, rows, xf[:, cols] * hc.escape_value.float())
    return y.to(x.device)
