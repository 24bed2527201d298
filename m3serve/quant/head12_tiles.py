"""The 12-bit head (m3serve.quant.head12) laid out for the register-operand MMA head (kernels/head/_head12_ptx.py):
the same 12 bits a weight, permuted so that each lane of a warp reads its own MMA fragments as 16-byte vectors,
and with every weight the decode cannot express moved to an exact escape list.

Shape legend:
    sm         [V, K]          uint8  sign << 7 | mantissa, bytes in the MXFP8 MMA tile order (quant.mxfp8):
                                      2 KB a tile of 16 rows x 128 columns, [h, v, lane, 16 B]
    codes      [V, K/2]        uint8  exponent codes 0..14, 1 KB a tile in the NVFP4 byte order [h, lane, 16 B]
                                      (quant.nvfp4), and inside each 32-bit word (8 columns 8q .. 8q+7 of the
                                      lane's 32) the code of column 8q + 2j + e at nibble j + 4e
    tile_base  [V/16, K/128]   uint8  the format's tile base, <= MAX_MMA_BASE
    esc_ptr    [V + 1]         int32  CSR: escapes of row r are esc_ptr[r] .. esc_ptr[r + 1] - 1 (row, then column order)
    esc_row    [E]             int32
    esc_col    [E]             int32
    esc_val    [E]             fp32   the exact bf16 values

Why this decode: the kernel builds a bf16 pair from its sign/mantissa bytes with one byte permute and a mask,
and puts the code c itself in the exponent field (no tile base added, no test for code 0): c = 0 is then
+-0, and 1..14 is the weight times 2**-base. The tile base comes back as one exact power-of-two scale of each
16 x 128 step sum (2**(base - 64), with x scaled by 2**64 so no product leaves fp32's normal range). So what the
format's code 0 means besides +-0 (a subnormal weight) and code 15 (an escape) both live in the escape list, and
their dense slots are zeroed (sign/mantissa 0, code 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from m3serve.quant._blocks import permute_blocks
from m3serve.quant.head12 import ESCAPE_CODE, TILE_COLS, TILE_ROWS, Head12, _check_head
from m3serve.quant.nvfp4 import pack_e2m1, unpack_e2m1

# 2**(base - 64) must be a normal fp32 scale: base + 63 <= 254. A tile base above 191 means weights of at least
# 2**65: no LM head has them, and such a head keeps the BF16 kernel (tile_head12 raises).
MAX_MMA_BASE = 191
X_SCALE_LOG2 = 64
_CHUNK_ROWS = 1024  # rows re-laid out at a time (a multiple of 16): bounds the temporaries to ~40 MB at K = 6144

# the code nibble order inside a 32-bit word: position j + 4e holds column 2j + e of the word's 8
_NIBBLE_OF_COLUMN = tuple((col >> 1) + 4 * (col & 1) for col in range(8))
_COLUMN_OF_NIBBLE = tuple(sorted(range(8), key=lambda col: _NIBBLE_OF_COLUMN[col]))


@dataclass
class Head12Tiles:
    sm: Tensor
    codes: Tensor
    tile_base: Tensor
    esc_ptr: Tensor
    esc_row: Tensor
    esc_col: Tensor
    esc_val: Tensor
    shape: tuple[int, int]

    def args(self) -> tuple[Tensor, ...]:
        return (self.sm, self.codes, self.tile_base, self.esc_ptr, self.esc_row, self.esc_col, self.esc_val)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.args())


def _sm_split(n: int, k: int) -> tuple[int, ...]:
    """sm [rb, h, g, ks, c, v, j] (the MXFP8 tile's byte factors)."""
    return (n // 16, 2, 8, k // 128, 4, 2, 16)


_SM_ORDER = (0, 3, 1, 5, 2, 4, 6)  # [rb, ks, h, v, g, c, j]


def _codes_split(n: int, k: int) -> tuple[int, ...]:
    """codes [rb, h, g, ks, c, j] (the NVFP4 tile's byte factors: 16 bytes a lane)."""
    return (n // 16, 2, 8, k // 128, 4, 16)


_CODES_ORDER = (0, 3, 1, 2, 4, 5)  # [rb, ks, h, g, c, j]


def _words_to_kernel_order(codes: Tensor) -> Tensor:
    """uint8 codes [R, K] (one a column) -> the same with each group of 8 columns in nibble order."""
    r, k = codes.shape
    idx = torch.tensor(_COLUMN_OF_NIBBLE, device=codes.device)
    return codes.reshape(r, k // 8, 8).index_select(2, idx).reshape(r, k)


def _words_from_kernel_order(codes: Tensor) -> Tensor:
    r, k = codes.shape
    idx = torch.tensor(_NIBBLE_OF_COLUMN, device=codes.device)
    return codes.reshape(r, k // 8, 8).index_select(2, idx).reshape(r, k)


def tile_head12(h: Head12) -> Head12Tiles:
    """The Head12 in the MMA head's layout, on h's device. Raises ValueError (naming the tile) when a tile base is
    above MAX_MMA_BASE: the caller keeps the BF16 head."""
    n, k = _check_head(h)
    if int(h.tile_base.max()) > MAX_MMA_BASE:
        flat = int(torch.argmax(h.tile_base.reshape(-1).to(torch.int32)))
        tc = k // TILE_COLS
        raise ValueError(f"Head12.tile_base[{flat // tc}, {flat % tc}] = {int(h.tile_base.reshape(-1)[flat])}: the "
                         f"MMA head's step scale 2**(base - 64) needs base <= {MAX_MMA_BASE} (weights below 2**65)")
    sm_parts, code_parts, extra = [], [], []
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, n)
        sm = h.sign_mantissa[r0:r1].clone()
        code = unpack_e2m1(h.exp_codes[r0:r1])
        # code 0 with a mantissa is a subnormal: exact only through the escape list
        sub = (code == 0) & ((sm & 0x7F) != 0)
        extra.append(torch.nonzero(sub.reshape(-1)).reshape(-1) + r0 * k)
        dead = sub | (code == ESCAPE_CODE)
        sm[dead] = 0
        code = torch.where(dead, torch.zeros_like(code), code)
        sm_parts.append(permute_blocks(sm, _sm_split(r1 - r0, k), _SM_ORDER))
        packed = pack_e2m1(_words_to_kernel_order(code))
        code_parts.append(permute_blocks(packed, _codes_split(r1 - r0, k), _CODES_ORDER))
    sub_index = torch.cat(extra)
    sub_sm = h.sign_mantissa.reshape(-1)[sub_index].to(torch.int32)
    sub_bits = ((sub_sm & 0x80) << 8) | (sub_sm & 0x7F)  # exponent 0: the subnormal itself
    sub_val = sub_bits.to(torch.int16).view(torch.bfloat16)
    index = torch.cat([h.escape_index, sub_index])
    value = torch.cat([h.escape_value, sub_val])
    index, order = torch.sort(index)
    value = value[order]
    rows = index // k
    ptr = torch.zeros(n + 1, dtype=torch.int64, device=index.device)
    ptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
    return Head12Tiles(sm=torch.cat(sm_parts), codes=torch.cat(code_parts), tile_base=h.tile_base.contiguous(),
                       esc_ptr=ptr.to(torch.int32), esc_row=rows.to(torch.int32), esc_col=(index % k).to(torch.int32),
                       esc_val=value.float(), shape=(n, k))


def head12_tiles_weight(t: Head12Tiles) -> Tensor:
    """The exact bf16 weight [V, K] that the tiles encode (the kernel's decode, then the escapes), decoded _CHUNK_ROWS
    rows at a time (a block of 16 rows owns its tiles' bytes, so each chunk re-lays out alone)."""
    n, k = t.shape
    w = torch.empty(n, k, dtype=torch.bfloat16, device=t.sm.device)
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, n)
        sm = permute_blocks(t.sm[r0:r1], _sm_split(r1 - r0, k), _SM_ORDER, inverse=True).to(torch.int32)
        packed = permute_blocks(t.codes[r0:r1], _codes_split(r1 - r0, k), _CODES_ORDER, inverse=True)
        code = _words_from_kernel_order(unpack_e2m1(packed)).to(torch.int32)
        base = t.tile_base[r0 // TILE_ROWS:r1 // TILE_ROWS].to(torch.int32)
        base = base.repeat_interleave(TILE_ROWS, 0).repeat_interleave(TILE_COLS, 1)
        exp = torch.where(code == 0, torch.zeros_like(code), base + code)
        bits = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
        bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)
        w[r0:r1] = bits.to(torch.int16).view(torch.bfloat16)
    w.view(-1)[t.esc_row.long() * k + t.esc_col.long()] = t.esc_val.to(torch.bfloat16)
    return w
