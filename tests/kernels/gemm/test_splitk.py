"""_splitk.ordered_sum (the last arrival's sum of split-K partials, four loads in flight): the plain sequential fp32
sum in the order 0..SPLIT-1 bit for bit, for split counts that are and are not multiples of four (the reads past
SPLIT add +0.0: exact), -0.0 and infinite partials included; masked elements 0. CPU tensors: the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl

from m3serve.kernels._jit import kernel
from m3serve.kernels.gemm._splitk import ordered_sum


@kernel
def _sum_kernel(part_ptr, out_ptr, split, N, BN: tl.constexpr):
    offs = tl.arange(0, BN)
    mask = offs < N
    tl.store(out_ptr + offs, ordered_sum(part_ptr, N, offs, mask, split), mask=offs < BN)


@pytest.mark.parametrize("split", [1, 2, 3, 4, 5, 8, 13])
def test_ordered_sum_is_the_sequential_sum_bit_for_bit(split):
    n, bn = 24, 32
    gen = torch.Generator().manual_seed(split)
    # magnitudes spread over 2**-20 .. 2**20: the order of the additions shows in the last bits
    part = torch.randn(split, n, generator=gen) * torch.exp2(torch.randint(-20, 20, (split, n), generator=gen).float())
    part[:, 0] = -0.0
    part[0, 1] = -0.0
    part[-1, 2] = float("-inf")
    out = torch.full((bn,), float("nan"))
    _sum_kernel[(1,)](part.contiguous(), out, split, n, BN=bn)
    want = np.zeros(n, np.float32)
    for s in range(split):
        want = (want + part[s].numpy()).astype(np.float32)
    assert np.array_equal(out[:n].numpy().view(np.uint32), want.view(np.uint32))
    assert torch.equal(out[n:], torch.zeros(bn - n))      # masked elements read as 0
