"""Randomized Hadamard rotation of the NVFP4 K/V head vectors (QuaRot / SpinQuant-style), torch reference.

Why: NVFP4 keeps 2-3 significant bits per value and one E4M3 scale per 16 values, so a block with one outlier
channel flushes its other 15 values to 0 or +-0.5 of the scale. An orthogonal rotation of the head dimension
spreads every outlier over the whole vector; attention is unchanged in exact arithmetic because the rotation
is applied to K and to q alike (q.k = (qR).(kR)) and V's rotation is undone on the attention output.

The rotation (one per cache, shared by every NVFP4 layer; B = the Hadamard block size, see `hadamard_block`):

    write:   y = FWHT_B(x * s) * c_w           stored (then NVFP4-quantized) instead of x
    read:    x = FWHT_B(y) * c_r * s           (PagedKVCache.read gives back K and V in the model's basis)
    query:   q_rot = FWHT_B(q * s) * c_r       = q @ query_matrix(s); q_rot . y = q . x
    output:  o = o_rot @ query_matrix(s)^T     (the un-rotation of sum_j p_j y_j)

s is a +-1 vector drawn from the seed (`rotation_signs`), FWHT_B the unnormalised Walsh-Hadamard transform of
each B-value block of the head vector (Sylvester order, entries +-1, FWHT_B(FWHT_B(x)) = B x), and
c_w = 2^-floor(log2(B)/2), c_r = 2^-ceil(log2(B)/2), so c_w * c_r * B = 1. Both factors are powers of two: the
only roundings of the rotation are the fp32 additions of the butterfly, done in one fixed order (stage h = 1,
2, 4, ..., B/2: (a, b) -> (a + b, a - b) for a at index i and b at i + h of each 2h-group), which the Triton
twin (m3serve.kernels.attention._hadamard) repeats operation for operation, so kv.write stays bit-exact with
PagedKVCache.write. For B = 128 (M3) c_w = 1/8 and c_r = 1/16: the stored values are sqrt(2) times those of
the orthonormal rotation, which the calibrated NVFP4 global scale absorbs.

A head dim that is not a power of two is rotated block-diagonally, by a Hadamard of its largest power-of-two
divisor (a multiple of 16 for NVFP4: D = 96 -> three 32-blocks); the spec rejects a block below 16, which
could not spread an outlier beyond one NVFP4 block.

Non-finite values: an inf in x makes every value of its Hadamard block inf or NaN after the rotation (as it
would every attention score it meets anyway).

Shape legend:
    x, y   [..., D]  K or V head vectors (any float dtype; the rotation is computed in fp32)
    s      [D]       fp32 +-1 signs
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_ROTATION_SEED = 31   # the seed a rotated cache uses unless kv_scales.json or the caller names another
MIN_HADAMARD_BLOCK = 16       # one NVFP4 block: a smaller rotation could not move an outlier out of its block


def hadamard_block(head_dim: int) -> int:
    """The Hadamard size B for a head dim: its largest power-of-two divisor (head_dim itself for 64, 128)."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ValueError(f"head_dim: expected a positive int, found {head_dim!r}")
    return head_dim & -head_dim


def check_rotatable(head_dim: int) -> int:
    """B for `head_dim`, or a ValueError naming the head dim when B < MIN_HADAMARD_BLOCK."""
    b = hadamard_block(head_dim)
    if b < MIN_HADAMARD_BLOCK:
        raise ValueError(f"head_dim: the K/V rotation needs a power-of-two block of >= {MIN_HADAMARD_BLOCK} "
                         f"dividing the head dim, found head_dim {head_dim} (largest power-of-two divisor {b})")
    return b


def scale_exponents(block: int) -> tuple[int, int]:
    """(e_w, e_r) with c_w = 2^-e_w, c_r = 2^-e_r and e_w + e_r = log2(block)."""
    log2b = block.bit_length() - 1
    return log2b // 2, log2b - log2b // 2


def rotation_signs(head_dim: int, seed: int) -> Tensor:
    """The +-1 sign vector s [head_dim] (fp32, CPU) of a seed: deterministic across runs and machines."""
    check_rotatable(head_dim)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, found {seed!r}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (head_dim,), generator=gen).float() * 2.0 - 1.0


def fwht(x: Tensor, block: int) -> Tensor:
    """Unnormalised Walsh-Hadamard transform of each `block`-value block of the last dim, fp32, in the fixed
    butterfly order of the module doc. x [..., D] (D a multiple of block) -> fp32 [..., D]."""
    d = x.shape[-1]
    if block & (block - 1) or d % block:
        raise ValueError(f"block: expected a power of two dividing the last dim {d}, found {block}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < block:
        pairs = y.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return y.view(*lead, d)


def rotate(x: Tensor, signs: Tensor) -> Tensor:
    """x [..., D] -> the stored basis y = FWHT_B(x * s) * c_w, fp32."""
    b = check_rotatable(x.shape[-1])
    e_w, _ = scale_exponents(b)
    return fwht(x.float() * signs.to(x.device), b) * 2.0**-e_w


def unrotate(y: Tensor, signs: Tensor) -> Tensor:
    """y [..., D] (stored basis) -> x = FWHT_B(y) * c_r * s, fp32 (exact inverse of rotate up to rounding)."""
    b = check_rotatable(y.shape[-1])
    _, e_r = scale_exponents(b)
    return fwht(y, b) * 2.0**-e_r * signs.to(y.device)


def rotate_query(q: Tensor, signs: Tensor) -> Tensor:
    """q [..., D] -> q_rot = FWHT_B(q * s) * c_r, fp32: q_rot . rotate(k) = q . k in exact arithmetic."""
    b = check_rotatable(q.shape[-1])
    _, e_r = scale_exponents(b)
    return fwht(q.float() * signs.to(q.device), b) * 2.0**-e_r


def query_matrix(signs: Tensor) -> Tensor:
    """M [D, D] fp32 with q @ M = rotate_query(q) and o_rot @ M^T = the un-rotated output; entries 0 or +-c_r
    (exact in bf16, so the kernels use it as an MMA operand)."""
    d = signs.shape[0]
    return rotate_query(torch.eye(d, dtype=torch.float32), signs.cpu()).to(signs.device)
