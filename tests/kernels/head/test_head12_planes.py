"""prepare_head12: the kernel's planes zero every escaped slot (sign/mantissa byte and code nibble), touch nothing
else, and still decode, with the escape list, to the exact BF16 weight; adjacent escapes that share a code byte
(one in each nibble) are both cleared."""

from __future__ import annotations

import torch

from m3serve.kernels.head.head12 import prepare_head12
from m3serve.quant.head12 import ESCAPE_CODE, Head12, decode_head12, encode_head12


def _codes(exp_codes: torch.Tensor) -> torch.Tensor:
    """[V, K/2] packed nibbles -> [V, K] codes (column 2j in the low nibble)."""
    return torch.stack((exp_codes & 15, exp_codes >> 4), dim=-1).reshape(exp_codes.shape[0], -1)


def test_escaped_slots_are_zero_in_the_kernel_planes_and_decode_exactly():
    g = torch.Generator().manual_seed(12)
    w = (0.02 * torch.randn(64, 256, generator=g)).to(torch.bfloat16)
    w[3, 10], w[3, 11] = 3.0e4, -2.0e-30        # one code byte holding two escapes (columns 10 and 11)
    w[40, 129] = float("inf")                    # inf always escapes
    w.view(-1)[torch.randint(0, w.numel(), (40,), generator=g)] = 5.0e3
    h = encode_head12(w)
    codes = _codes(h.exp_codes).reshape(-1)
    esc = h.escape_index
    assert esc.numel() >= 3 and bool((codes[esc] == ESCAPE_CODE).all())
    assert {3 * 256 + 10, 3 * 256 + 11, 40 * 256 + 129} <= set(esc.tolist())
    d = prepare_head12(h)
    dev_codes = _codes(d.exp_codes).reshape(-1)
    dev_sm = d.sign_mantissa.reshape(-1)
    keep = torch.ones(w.numel(), dtype=torch.bool)
    keep[esc] = False
    assert bool((dev_codes[esc] == 0).all()) and bool((dev_sm[esc] == 0).all())
    assert torch.equal(dev_codes[keep], codes[keep])
    assert torch.equal(dev_sm[keep], h.sign_mantissa.reshape(-1)[keep])
    assert bool((h.sign_mantissa.reshape(-1)[esc] != 0).any())      # the format's own planes are left as they were
    again = Head12(sign_mantissa=d.sign_mantissa, exp_codes=d.exp_codes, tile_base=d.tile_base,
                   escape_index=d.esc_row.long() * 256 + d.esc_col.long(), escape_value=d.esc_val.to(torch.bfloat16),
                   shape=d.shape)
    assert torch.equal(decode_head12(again).view(torch.int16), w.view(torch.int16))
