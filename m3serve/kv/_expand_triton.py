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

from m3serve.kernels._jit import kernel_unspecialized


# index_scale / kv_offset: 1 and 1 for the cache's tables, a multiple of 16 for the draft view's: not specialised,
# so one variant serves both (the view's was once built after the warm-up, in front of a user)
@kernel_unspecialized("index_scale", "kv_offset")
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


# every eager step stages a different number of rows and tokens (and so offsets into the stage): not specialised,
# so one variant serves all of them instead of one per (== 1 / divisible by 16 / other) class of each; nor are
# index_scale / kv_offset (the cache's tables and the draft view's differ there, see _expand_kernel)
@kernel_unspecialized("num_seqs", "num_tokens", "off_change", "off_data", "off_tok", "off_pos", "index_scale",
                      "kv_offset")
def _prepare_kernel(mirror_ptr, stage_ptr, slot_ptr, sub_ptr, slotmap_ptr, num_seqs, num_tokens, num_blocks,
                    page_size, index_scale, kv_offset, off_change, off_data, off_tok, off_pos,
                    BLOCK: tl.constexpr, TBLOCK: tl.constexpr):
    """Programs [0, S): one batch row each -- take its row from the staged data when it changed (and write
    it into the mirror), else from the mirror; expand it. Programs [S, ...): TBLOCK tokens each -- their
    flat slot (page * page_size + offset, -1 when unallocated), read from the same sources, so no program
    depends on another's writes (changed rows are read from the stage, never from the mirror)."""
    pid = tl.program_id(0)
    if pid < num_seqs:
        row = tl.load(stage_ptr + pid).to(tl.int64)
        ci = tl.load(stage_ptr + off_change + pid).to(tl.int64)
        changed = ci >= 0
        src = stage_ptr + off_data + tl.maximum(ci, 0) * num_blocks
        base = pid.to(tl.int64) * num_blocks
        for j0 in range(0, num_blocks, BLOCK):
            offs = j0 + tl.arange(0, BLOCK)
            mask = offs < num_blocks
            staged = tl.load(src + offs, mask=mask & changed, other=-1)
            old = tl.load(mirror_ptr + row * num_blocks + offs, mask=mask & (ci < 0), other=-1)
            page = tl.where(changed, staged, old)
            tl.store(mirror_ptr + row * num_blocks + offs, page, mask=mask & changed)
            valid = page >= 0
            slot = tl.where(valid, page, 0)
            k = slot * index_scale
            tl.store(slot_ptr + base + offs, slot, mask=mask)
            tl.store(sub_ptr + 2 * base + offs, k, mask=mask)
            tl.store(sub_ptr + 2 * base + num_blocks + offs, tl.where(valid, k + kv_offset, 0), mask=mask)
    else:
        t = (pid - num_seqs) * TBLOCK + tl.arange(0, TBLOCK)
        tm = t < num_tokens
        t_seq = tl.load(stage_ptr + off_tok + t, mask=tm, other=0).to(tl.int64)
        t_pos = tl.load(stage_ptr + off_pos + t, mask=tm, other=0).to(tl.int64)
        t_row = tl.load(stage_ptr + t_seq, mask=tm, other=0).to(tl.int64)
        t_ci = tl.load(stage_ptr + off_change + t_seq, mask=tm, other=-1).to(tl.int64)
        t_blk = t_pos // page_size
        t_staged = tl.load(stage_ptr + off_data + tl.maximum(t_ci, 0) * num_blocks + t_blk, mask=tm & (t_ci >= 0),
                           other=-1)
        t_old = tl.load(mirror_ptr + t_row * num_blocks + t_blk, mask=tm & (t_ci < 0), other=-1)
        t_page = tl.where(t_ci >= 0, t_staged, t_old).to(tl.int64)
        tl.store(slotmap_ptr + t, tl.where(t_page >= 0, t_page * page_size + t_pos % page_size, -1), mask=tm)


def prepare_triton(mirror: Tensor, stage: Tensor, num_seqs: int, num_tokens: int, page_size: int,
                   index_scale: int, kv_offset: int, offsets: tuple[int, int, int, int], slot_out: Tensor,
                   sub_out: Tensor, slotmap_out: Tensor, block: int = 1024, tblock: int = 128) -> None:
    if num_seqs == 0:
        return
    grid = (num_seqs + triton.cdiv(num_tokens, tblock),)
    _prepare_kernel[grid](mirror, stage, slot_out, sub_out, slotmap_out, num_seqs, num_tokens, mirror.shape[1],
                          page_size, index_scale, kv_offset, *offsets, BLOCK=block, TBLOCK=tblock)
