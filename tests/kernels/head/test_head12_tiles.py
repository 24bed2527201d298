"""tile_head12: the MMA head's layout of a 12-bit head holds exactly the BF16 weight (escapes and subnormals in the
list, their dense slots zero), the nibble and byte orders are the ones the PTX reads, and a tile base the step
scale cannot express is refused by name."""

from __future__ import annotations

import pytest
import torch

from m3serve.quant.head12 import ESCAPE_CODE, encode_head12
from m3serve.quant.head12_tiles import (MAX_MMA_BASE, _COLUMN_OF_NIBBLE, head12_tiles_weight, tile_head12)
from m3serve.quant.nvfp4 import unpack_e2m1


def _weight(seed: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (0.02 * torch.randn(64, 256, generator=g)).to(torch.bfloat16)
    w[3, 10], w[3, 11] = 3.0e4, -2.0e-30      # two escapes sharing a code byte
    w[40, 129] = float("inf")                  # inf always escapes
    w[5, 7], w[9, 200] = -3.0e-39, 1.0e-39     # subnormals: code 0 with a mantissa
    w[6, 6] = -0.0                             # -0 stays in the dense tile
    return w


@pytest.mark.parametrize("chunk", [1024, 16, 32])
def test_tiles_hold_the_exact_weight_with_escapes_and_subnormals_in_the_list(monkeypatch, chunk):
    import m3serve.quant.head12_tiles as tiles_mod
    monkeypatch.setattr(tiles_mod, "_CHUNK_ROWS", chunk)   # the layout and its inverse, chunk by chunk
    w = _weight()
    h = encode_head12(w)
    t = tile_head12(h)
    assert torch.equal(head12_tiles_weight(t).view(torch.int16), w.view(torch.int16))
    flat = (t.esc_row.long() * 256 + t.esc_col.long()).tolist()
    assert flat == sorted(flat) and len(set(flat)) == len(flat)
    assert {5 * 256 + 7, 9 * 256 + 200, 3 * 256 + 10, 3 * 256 + 11, 40 * 256 + 129} <= set(flat)
    assert set(h.escape_index.tolist()) < set(flat)
    ptr = t.esc_ptr.long()
    assert int(ptr[-1]) == len(flat) and torch.equal(torch.bincount(t.esc_row.long(), minlength=64), ptr[1:] - ptr[:-1])


def test_dense_slots_of_listed_weights_are_zero_in_kernel_order():
    w = _weight()
    t = tile_head12(encode_head12(w))
    # tile (rb 0, step 0), row 5 = h 0, g 5; column 7 = lane c 0, word 1, byte 3 of the sm tile [h, v, lane, 16 B]
    lane = 4 * 5 + 0
    assert int(t.sm.reshape(-1)[0 * 1024 + 0 * 512 + lane * 16 + 7]) == 0
    # its code: code word 0 of the lane (columns 0..7), column 7 = 2j + e with j 3, e 1 -> nibble 7
    word = t.codes.reshape(-1)[lane * 16:lane * 16 + 4]
    nib = unpack_e2m1(word.reshape(1, 4)).reshape(-1)
    assert int(nib[7]) == 0
    # a live weight of that row: column 6 (-0.0 is row 6; take row 5 col 6) at nibble j 3, e 0 -> 3
    assert int(nib[3]) != 0 and _COLUMN_OF_NIBBLE[3] == 6 and _COLUMN_OF_NIBBLE[7] == 7
    assert int(unpack_e2m1(t.codes).max()) < ESCAPE_CODE


def test_a_tile_base_above_the_step_scale_is_refused():
    w = _weight()
    w[16:32, 128:256] = 2.0 ** 100           # tile (1, 1): every weight 2**100 -> base 213 (the smallest that holds it)
    with pytest.raises(ValueError, match=r"tile_base\[1, 1\] = \d+: .* base <= " + str(MAX_MMA_BASE)):
        tile_head12(encode_head12(w))
