"""Re-laying a weight's per-row tensors out inside blocks: the one operation behind the MMA tile layouts of
nvfp4.tile_nvfp4 and mxfp8.tile_mxfp8. A layout is named by how the row-major bytes of [..., N, C] split into
factors (`split`, row factors first) and the order the tiled layout stores those factors in (`perm`)."""

from __future__ import annotations

import torch
from torch import Tensor


def permute_blocks(t: Tensor, split: tuple[int, ...], perm: tuple[int, ...], inverse: bool = False) -> Tensor:
    """t [..., N, C] (any 1-byte or wider dtype, read as bytes) -> a new tensor of the same shape and dtype whose
    bytes are row-major's factors `split` stored in the order `perm` (inverse: back from that order)."""
    lead = t.shape[:-2]
    d = len(lead)
    if inverse:
        src = tuple(split[i] for i in perm)
        order = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    else:
        src, order = split, perm
    b = t.contiguous().view(torch.uint8).reshape(*lead, *src)
    return b.permute(*range(d), *(d + i for i in order)).contiguous().reshape(t.shape).view(t.dtype)


def relayout(w: Tensor, s: Tensor, splits: tuple[tuple, tuple], orders: tuple[tuple, tuple],
             inverse: bool = False) -> tuple[Tensor, Tensor]:
    """A weight's bytes and its scales through permute_blocks, each with its own split and order."""
    return (permute_blocks(w, splits[0], orders[0], inverse), permute_blocks(s, splits[1], orders[1], inverse))
