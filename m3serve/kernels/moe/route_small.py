"""Catalog entry moe.route_small: the MoE router for up to 256 experts, one program per token, one launch.

    scores  = sigmoid(x.float() @ router.float().T)                      fp32 [T, E]
    ids     = top-A of (scores + bias)      (the bias only selects; ties -> the lowest expert index)
    weights = scores[ids] / sum(scores[ids])                              fp32 [T, A]

the stock m3serve.model.moe.route. Ties: torch.topk documents the order of tied values as unspecified (and
it differs between CPU and CUDA, pytorch#127196; on the CPU a three-way tie at k = 2 returned indices 2, 4
of 1, 2, 4), so there is no torch rule to copy; the kernel takes the lowest index, deterministically, and
the compare accepts any pick that is tied within the logits' rounding band. Ids come out in descending
order of biased score, as torch.topk's. NaN activations give unspecified ids (torch sorts NaN first).

Shape legend (T tokens, H hidden, E experts <= 256, A = top_k <= E):
    x        [T, H]  bf16, unit column stride
    router   [E, H]  fp32 (or bf16), contiguous
    bias     [E]     fp32 selection bias (e_score_correction_bias)
    weights  [T, A]  fp32, contiguous (written)
    ids      [T, A]  int64, contiguous (written)

The program streams the whole router (8 KB on the embedded model, 3 MB on M3: there the fused moe.nvfp4
router, split over experts and K, is the fast path; this one is for the dense all-experts MoE).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from m3serve.kernels._jit import kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.catalog import ROW_CELLS_MAX, FP32_U, Case, Cell, Entry, assert_band, check_tensor, poisoned, true_fp32
from m3serve.model.moe import route as route_stock

ENABLED = True  # the one switch: False sends moe.route_small calls down the stock path

MAX_EXPERTS = 256
TILE = 16384  # router elements per loop step (experts x columns)


@kernel
def _route_small_kernel(x_ptr, w_ptr, bias_ptr, wts_ptr, ids_ptr, H, E, stride_x, TOPK: tl.constexpr,
                        AP: tl.constexpr, EP: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    t = tl.program_id(0)
    ec = tl.arange(0, EP)
    emask = ec < E
    logits = tl.zeros([EP], tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < H
        xv = tl.load(x_ptr + t * stride_x + kk, mask=kmask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + ec[:, None] * H + kk[None, :], mask=emask[:, None] & kmask[None, :],
                     other=0.0).to(tl.float32)
        logits += tl.sum(wv * xv[None, :], axis=1)
    # IEEE divisions: tl.sigmoid and a plain `/` compile to the approximate div.full.f32
    sig = tl.div_rn(tl.full([EP], 1.0, tl.float32), 1.0 + tl.exp(-logits))
    bias = tl.load(bias_ptr + ec, mask=emask, other=0.0)
    score = tl.where(emask, sig + bias, float("-inf"))
    kc = tl.arange(0, AP)
    ids = tl.zeros([AP], tl.int32)
    wts = tl.zeros([AP], tl.float32)
    for k in tl.static_range(TOPK):
        j = tl.argmax(score, axis=0, tie_break_left=True)
        hit = ec == j
        ids = tl.where(kc == k, j, ids)
        wts = tl.where(kc == k, tl.sum(tl.where(hit, sig, 0.0), axis=0), wts)
        score = tl.where(hit, float("-inf"), score)
    wts = tl.div_rn(wts, tl.zeros([AP], tl.float32) + tl.sum(wts, axis=0))  # padding lanes hold 0
    out = kc < TOPK
    tl.store(wts_ptr + t * TOPK + kc, wts, mask=out)
    tl.store(ids_ptr + t * TOPK + kc, ids.to(tl.int64), mask=out)


def _tiles(h: int, e: int) -> tuple[int, int, int]:
    ep = triton.next_power_of_2(e)
    bk = max(16, min(triton.next_power_of_2(h), TILE // ep))
    return ep, bk, 8 if ep * bk >= 8192 else 4


def route_small(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, weights_out: torch.Tensor,
                ids_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw call. Writes and returns (weights_out, ids_out)."""
    check_tensor("x", x, torch.bfloat16)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [T, H] with unit column stride, found shape {tuple(x.shape)} "
                         f"strides {tuple(x.stride())}")
    t, h = x.shape
    if not isinstance(router, torch.Tensor):
        raise TypeError(f"router: expected a torch.Tensor, found {type(router).__name__}")
    if router.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"router: expected torch.float32 or torch.bfloat16, found {router.dtype}")
    if router.dim() != 2 or router.shape[1] != h or not 1 <= router.shape[0] <= MAX_EXPERTS:
        raise ValueError(f"router: expected [E, {h}] with 1 <= E <= {MAX_EXPERTS}, found {tuple(router.shape)}")
    e = router.shape[0]
    check_tensor("router", router, device=x.device)
    if not router.is_contiguous():
        raise ValueError(f"router: expected a contiguous tensor, found strides {tuple(router.stride())}")
    check_tensor("bias", bias, torch.float32, (e,), x.device)
    if not bias.is_contiguous():
        raise ValueError(f"bias: expected a contiguous tensor, found strides {tuple(bias.stride())}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k: expected an int in 1..{e}, found {top_k!r}")
    check_tensor("weights_out", weights_out, torch.float32, (t, top_k), x.device)
    check_tensor("ids_out", ids_out, torch.int64, (t, top_k), x.device)
    for name, o in (("weights_out", weights_out), ("ids_out", ids_out)):
        if not o.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, found strides {tuple(o.stride())}")
    if t == 0:
        return weights_out, ids_out
    ep, bk, warps = _tiles(h, e)
    _route_small_kernel[(t,)](x, router, bias, weights_out, ids_out, h, e, x.stride(0), TOPK=top_k,
                              AP=triton.next_power_of_2(top_k), EP=ep, BK=bk, num_warps=warps)
    return weights_out, ids_out


class RouteReference(NamedTuple):
    weights: torch.Tensor  # [T, A] fp32, the stock route's
    ids: torch.Tensor      # [T, A] int64
    logits: torch.Tensor   # [T, E] fp32
    logit_band: torch.Tensor  # [T, E] fp32: 2 H u sum|x w|, the bound on a logit's summation-order error


def route_small_reference(x, router, bias, top_k, weights_out=None, ids_out=None) -> RouteReference:
    """The stock route in true fp32 (TF32 off), plus the logits and their error bound for the compare."""
    with true_fp32():
        ids, weights = route_stock(x, router, bias, top_k)
        logits = x.float() @ router.float().t()
        band = 2.0 * x.shape[1] * FP32_U * (x.float().abs() @ router.float().abs().t())
    return RouteReference(weights, ids, logits, band)


def route_small_stock(x, router, bias, top_k, weights_out=None, ids_out=None):
    ids, weights = route_stock(x, router, bias, top_k)
    return weights, ids


def compare(out: tuple[torch.Tensor, torch.Tensor], ref: RouteReference, case: Case) -> None:
    """1. ids: in range, distinct per token, and either the reference's set or every pick scoring within
    the near-tie slack 2 ds of the reference's A-th best score, where ds = max over experts of
    b/4 + (|logit|/4 + 4) u bounds a score's error: b = 2 H u sum|x w| (both sides sum the same fp32 products
    in another order) through sigmoid' <= 1/4, the exponential's argument rounding (u |logit|, again
    through sigmoid' <= 1/4) and the sigmoid's own roundings (4u). A tie is legitimately resolved either way.
    2. weights, per (token, expert) against the reference scores gathered at the kernel's ids and
    renormalised: |dw_k| <= (|ds_k| + w_k sum|ds|) / sum s <= (1 + A) ds / sum s, plus 8u |w| for the sum
    and division."""
    weights, ids = out
    top_k = case.args[3]
    e = case.args[1].shape[0]
    if ids.dtype != torch.int64 or bool((ids < 0).any()) or bool((ids >= e).any()):
        raise AssertionError(f"moe.route_small: ids outside 0..{e - 1}: {ids.tolist()}")
    ids_sorted = ids.sort(dim=1).values
    if top_k > 1 and bool((ids_sorted[:, 1:] == ids_sorted[:, :-1]).any()):
        raise AssertionError(f"moe.route_small: an expert picked twice in a row: {ids.tolist()}")
    sig = torch.sigmoid(ref.logits)
    b_sig = (ref.logit_band / 4.0 + (ref.logits.abs() / 4.0 + 4.0) * FP32_U).max(dim=1, keepdim=True).values
    if not torch.equal(ids_sorted, ref.ids.sort(dim=1).values):
        score = sig + case.args[2].float()
        kth = torch.topk(score, top_k, dim=1).values[:, -1:]
        picked = score.gather(1, ids)
        if bool((picked < kth - 2.0 * b_sig).any()):
            raise AssertionError(f"moe.route_small: ids {ids.tolist()} vs reference {ref.ids.tolist()} are not "
                                 f"within the near-tie slack {float(2.0 * b_sig.max()):.3g}")
    s_k = sig.gather(1, ids)
    w_ref = s_k / s_k.sum(dim=1, keepdim=True)
    band = 8 * FP32_U * w_ref.abs() + (1 + top_k) * b_sig / s_k.sum(dim=1, keepdim=True) + 1e-30
    assert_band("moe.route_small weights", weights, w_ref, band)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    e, h, a = cell.shape
    if gen is None:
        x = torch.zeros(rows, h, dtype=torch.bfloat16, device=device)
        router = torch.zeros(e, h, dtype=torch.float32, device=device)
        bias = torch.zeros(e, dtype=torch.float32, device=device)
    else:
        x = torch.randn(rows, h, generator=gen).to(device=device, dtype=torch.bfloat16)
        # logits of order 1-3, and a bias that changes some selections (as e_score_correction_bias does)
        router = (torch.randn(e, h, generator=gen) * (1.5 / h**0.5)).to(device)
        bias = (0.05 * torch.randn(e, generator=gen)).to(device)
    ids = torch.full((rows, a), -1, dtype=torch.int64, device=device)
    return Case(args=(x, router, bias, a, poisoned((rows, a), torch.float32, device), ids), kwargs={},
                bytes_moved=rows * h * 2 + e * h * 4 + rows * a * 12)


CELLS = (
    Cell(rows=(1, ROW_CELLS_MAX), shape=(128, 6144, 4), why="M3 router (replicated at TP1 and TP2): 128 experts, top-4"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(8, 256, 2), why="embedded model router: 8 experts, top-2 (the all-experts MoE)"),
)
INTERP_CELLS = (
    Cell(rows=(1, 2), shape=(8, 64, 2), why="interpreter: 8 experts top-2"),
    Cell(rows=(3, 3), shape=(12, 40, 3), why="interpreter: masked experts and columns (E, H not powers of two)"),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        route_small(*make_case(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="moe.route_small", kind="moe.route_small", raw_call=route_small, reference=route_small_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=route_small_stock,
)
ENTRIES = (ENTRY,)
