"""Triton kernel: gather the batch's rows from the device table mirror and expand them, in ONE launch.

Shape legend:
    mirror    int32 [max_seqs, B]      device copy of the host table (-1 = unallocated)
    rows      int32 [S]                table row of each batch position
    slot_out  int32 [S, B]             slot ids, -1 -> 0
    sub_out   int32 [S, 2, B]          K = slot*index_scale, V = K + kv_offset; unallocated -> 0
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _expand_kernel(mirror_ptr, rows_ptr, slot_ptr, sub_ptr, num_blocks, index_scale, kv_offset,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_blocks
    page = tl.load(mirror_ptr + row * num_blocks + offs, mask=mask, other=-1)
    valid = page >= 0
    slot = tl.where(valid, page, 0)
    k = slot * index_scale
    v = tl.where(valid, k + kv_offset, 0)
    base = i.to(tl.int64) * num_blocks
    tl.store(slot_ptr + base + offs, slot, mask=mask)
    tl.store(sub_ptr + 2 * base + offs, k, mask=mask)
    tl.store(sub_ptr + 2 * base + num_blocks + offs, v, mask=mask)


def expand_triton(mirror: Tensor, rows: Tensor, index_scale: int, kv_offset: int, slot_out: Tensor,
                  sub_out: Tensor, block: int = 512) -> None:
    s = rows.shape[0]
    if s == 0:
        return
    b = mirror.shape[1]
    grid = (s, triton.cdiv(b, block))
    _expand_kernel[grid](mirror, rows, slot_out, sub_out, b, index_scale, kv_offset, BLOCK=block)
