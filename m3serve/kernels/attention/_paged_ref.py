"""Torch reference and tolerance of attn.paged: gather a sequence's pages, decode them exactly as
PagedKVCache.read(..., torch.bfloat16) does, then msa.attend in true fp32.

Shape legend:
    pages     [slots, Hk, P, Dc]   typed K or V page view (see m3serve/kv/cache.py)
    scales    [slots, Hk, P*G]     NVFP4 E4M3 block scales, G = D/16 (V in 4-token quads)
    tokens    [L, Hk, D]           one sequence's keys or values in position order, bf16
    out, vbar [T, Hq, D]           fp32 reference output and sum_j p_j |v_j| / sum_j p_j
    qk_abs    [T, Hq]              max over visible keys of sum_d |q_d k_jd| * sm_scale
    keys      [T, Hq]              visible keys of each (row, head)
    M         [D, D]               rotation.query_matrix of a rotated layer (rot_matrix): pages hold K, V @ M^-T

Rotated layers: the tokens are decoded in the stored (rotated) basis exactly as the kernel decodes them (bf16),
then un-rotated in fp32 (y @ M^T, as PagedKVCache.read does up to fp32 rounding), and attended with the
un-rotated q: the reference is the model's attention on the dequantized cache. Its bound terms are computed in
the rotated basis, where the kernel's arithmetic happens (see compare).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from m3serve.kernels.catalog import BF16_REL, FP32_U, Case, assert_band, true_fp32
from m3serve.kv import codec
from m3serve.model import msa
from m3serve.quant.nvfp4 import v_scale_from_quad_order


def gather_tokens(pages: Tensor, scales: Tensor | None, gs: Tensor | None, slots: Tensor, length: int, fmt: str,
                  role: str) -> Tensor:
    """[length, Hk, D] bf16 tokens of one sequence whose pages are `slots` (int64, in order)."""
    data = pages[slots]
    nb, hk, p, dc = data.shape
    tokens = data.permute(0, 2, 1, 3).reshape(nb * p, hk, dc)[:length]
    scale = None
    if fmt == "nvfp4":
        sp = scales[slots]  # [nb, Hk, P*G]
        sp = v_scale_from_quad_order(sp, p) if role == "v" else sp.view(nb, hk, p, -1)
        scale = sp.permute(0, 2, 1, 3).reshape(nb * p, hk, -1)[:length]
    return codec.decode(fmt, tokens, scale, gs, torch.bfloat16)


@dataclass
class AttnReference:
    out: Tensor  # fp32 [T, Hq, D]; 0 on rows without keys (padding)
    vbar: Tensor  # fp32 [T, Hq, D]  (rotated layers: sum_j p_j |v_rot_j| / sum_j p_j, in the rotated basis)
    qk_abs: Tensor  # fp32 [T, Hq]  (rotated layers: of q_rot and the stored K)
    keys: Tensor  # fp32 [T, Hq]
    rot_scale: float | None = None  # rotated layers: c_r, the magnitude of M's entries


def paged_attention_reference(q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table, seq_lens, query_start, sel,
                              out=None, workspace=None, *, fmt: str, sm_scale: float, max_query_len: int,
                              num_splits: int, rot_matrix: Tensor | None = None) -> AttnReference:
    t_rows, hq, d = q.shape
    hk, p = k_pages.shape[1], k_pages.shape[2]
    g = hq // hk
    dev = q.device
    ref = AttnReference(out=torch.zeros(t_rows, hq, d, dtype=torch.float32, device=dev),
                        vbar=torch.zeros(t_rows, hq, d, dtype=torch.float32, device=dev),
                        qk_abs=torch.zeros(t_rows, hq, dtype=torch.float32, device=dev),
                        keys=torch.zeros(t_rows, hq, dtype=torch.float32, device=dev),
                        rot_scale=None if rot_matrix is None else float(rot_matrix.float().abs().max()))
    m = None if rot_matrix is None else rot_matrix.float()
    qs = query_start.tolist()
    lens = seq_lens.tolist()
    gs_k = kv_gs[0] if fmt == "nvfp4" else None
    gs_v = kv_gs[1] if fmt == "nvfp4" else None
    for s in range(len(lens)):
        n, length = qs[s + 1] - qs[s], lens[s]
        if n == 0 or length == 0:
            continue
        rows = slice(qs[s], qs[s + 1])
        slots = slot_table[s, :-(-length // p)].long()
        k = gather_tokens(k_pages, k_scale, gs_k, slots, length, fmt, "k")
        v = gather_tokens(v_pages, v_scale, gs_v, slots, length, fmt, "v")
        k_bound, v_bound, q_bound = k, v, q[rows]
        if m is not None:
            with true_fp32():
                k_bound, v_bound, q_bound = k.float(), v.float(), q[rows].float() @ m
                k, v = k_bound @ m.T, v_bound @ m.T
        q_pos = torch.arange(length - n, length, device=dev)
        mask = None
        if sel is not None:
            mask = msa.selection_mask(sel[rows].permute(1, 0, 2)[None].long(), length, p)  # [1, Hk, n, L]
        qr = q[rows][None]
        with true_fp32():
            ref.out[rows] = msa.attend(qr, k[None], v[None], q_pos[None], sm_scale, mask)[0]
            ref.vbar[rows] = msa.attend(qr, k[None], v_bound.abs()[None], q_pos[None], sm_scale, mask)[0]
            a = torch.einsum("nhgd,lhd->nhgl", q_bound.float().abs().view(n, hk, g, d),
                             k_bound.float().abs()) * sm_scale
        allowed = torch.arange(length, device=dev).view(1, 1, 1, length) <= q_pos.view(n, 1, 1, 1)
        if mask is not None:
            allowed = allowed & mask[0].permute(1, 0, 2)[:, :, None, :]  # [n, Hk, 1, L]
        a = a.masked_fill(~allowed, 0.0)
        ref.qk_abs[rows] = a.amax(-1).reshape(n, hq)
        ref.keys[rows] = allowed.expand(n, hk, g, length).sum(-1).reshape(n, hq).float()
    return ref


def compare(out: Tensor, ref: AttnReference, case: Case) -> None:
    """Band per element: 2**-7 |ref| + beta * vbar, vbar = sum_j p_j |v_j| / sum_j p_j.

    * 2**-7 |ref|: the kernel rounds once to bf16 and may land on the other side of a rounding
      boundary from the fp32 reference: one bf16 ulp.
    * each p_j = exp(s_j - max) / sum differs relatively by at most dp: the score dot products
      (exact bf16 products, fp32 sums in another order, 2 D u qk_abs for both sides together),
      the exponent argument (sm_scale*log2(e) folded into one fp32 factor, then s - m: <= 6 u
      qk_abs) and ex2.approx (< 2**-22 relative; 2**-21 allowed). Perturbing every p_j by <= dp
      moves sum p v / sum p by <= 2.01 dp vbar.
    * p.v with p = p_hi + p_lo (two bf16 MMA operands): |p - p_hi - p_lo| <= 2**-18 p; 2**-17.
    * fp32 accumulation of sum p v and sum p: the classical worst case keys*u for each side and
      each of numerator and denominator, plus one rounding per online-softmax rescale (<= keys),
      the split combine (num_splits terms) and the final IEEE division: 2 (2 keys + splits + 8) u.

    Rotated layers (rot_scale = c_r): the kernel's arithmetic runs in the rotated basis, so the terms above bound
    each rotated output column i by beta * vbar_rot_i; q_rot's rounding to bf16 (2**-9 of each |q_rot_d|) moves
    every score by <= 2**-9 qk_abs, adding 2**-8 qk_abs to dp; un-rotating acc through bf16 hi + lo (2**-18) and
    an fp32 sum of D terms (2 (D + 2) u) adds to beta; and a rotated-basis error e maps to |e @ M^T|_j <=
    c_r sum_i |e_i|. Band: 2**-7 |ref| + c_r (beta + 2**-17 + 2 (D + 2) u) sum_i vbar_rot_i.
    """
    t_rows = out.shape[0]
    if tuple(out.shape) != tuple(ref.out.shape):
        raise AssertionError(f"attn.paged: out shape {tuple(out.shape)} vs reference {tuple(ref.out.shape)}")
    d = out.shape[2]
    ns = case.kwargs["num_splits"]
    dp = (2 * d + 8) * FP32_U * ref.qk_abs + 2.0**-21
    if ref.rot_scale is not None:
        dp = dp + 2.0**-8 * ref.qk_abs
    beta = 2.01 * dp + 2.0**-17 + 2.0 * (2.0 * ref.keys + ns + 8) * FP32_U
    if ref.rot_scale is None:
        band = BF16_REL * ref.out.abs() + beta[:, :, None] * ref.vbar + 1e-30
    else:
        spread = ref.rot_scale * (beta + 2.0**-17 + 2.0 * (d + 2) * FP32_U) * ref.vbar.sum(-1)
        band = BF16_REL * ref.out.abs() + spread[:, :, None] + 1e-30
    assert_band(f"attn.paged ({case.kwargs['fmt']}, {t_rows} rows)", out, ref.out, band)
