"""Catalog entry norm.add_rms: fused residual add + Gemma RMSNorm, one program per token row.

    h = x + residual                      (fp32 add, rounded once to bf16: torch's bf16 add)
    y = (h.float() * rsqrt(mean(h.float()**2) + eps)) * (1 + w.float())   -> bf16

Shape legend:
    x, residual   [M, H]   bf16 (M = 1..48 tokens, H = 6144)
    w             [H]      bf16 or fp32 Gemma weight (the stored value; 1 + w is applied)
    h_out, y_out  [M, H]   bf16; h_out may alias residual (each row is read before it is
                           written, by the same program)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16
from m3serve.kernels._jit import is_compiled, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.catalog import ROW_CELLS_MAX, BF16_REL, Case, Cell, Entry, assert_band, check_tensor, poisoned

ENABLED = True  # the one switch: False sends norm.add_rms calls down the stock path


@kernel
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, H, stride_x, stride_r, stride_h, stride_y, eps,
                        BLOCK: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = to_bf16(x + r, CUDA)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    mean = tl.sum(hf * hf, axis=0) / H
    # IEEE sqrt and division (not rsqrt.approx), so the only difference from torch.rsqrt is
    # the summation order of the mean and torch's own rsqrt rounding
    inv = 1.0 / tl.sqrt_rn(mean + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (hf * inv) * (1.0 + w)
    tl.store(y_ptr + row * stride_y + cols, to_bf16(y, CUDA), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                h_out: torch.Tensor, y_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw call. Writes and returns (h_out, y_out)."""
    check_tensor("x", x, torch.bfloat16)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, H] with unit column stride, found shape {tuple(x.shape)}")
    m, h = x.shape
    for name, t in (("residual", residual), ("h_out", h_out), ("y_out", y_out)):
        check_tensor(name, t, torch.bfloat16, (m, h), x.device)
        if t.stride(1) != 1:
            raise ValueError(f"{name}: expected unit column stride, found strides {tuple(t.stride())}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"weight: expected torch.bfloat16 or torch.float32, found {weight.dtype}")
    check_tensor("weight", weight, shape=(h,), device=x.device)
    if not weight.is_contiguous():
        raise ValueError("weight: expected a contiguous tensor")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: expected a positive float, found {eps!r}")
    block = triton.next_power_of_2(h)
    _add_rmsnorm_kernel[(m,)](x, residual, weight, h_out, y_out, h, x.stride(0), residual.stride(0),
                              h_out.stride(0), y_out.stride(0), eps, BLOCK=block, CUDA=is_compiled(x),
                              num_warps=16 if block >= 4096 else 4)
    return h_out, y_out


def add_rmsnorm_reference(x, residual, weight, eps, h_out=None, y_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h bf16, y fp32): h = x + residual in bf16 (torch: fp32 add, one rounding); y before its
    final bf16 cast, so the compare can place its band."""
    h = x + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)) * (1.0 + weight.float())
    return h, y


def add_rmsnorm_stock(x, residual, weight, eps, h_out=None, y_out=None):
    h, y = add_rmsnorm_reference(x, residual, weight, eps)
    return h, y.to(torch.bfloat16)


def compare(out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor], case: Case) -> None:
    """h: bit-exact (the same single fp32 add and RNE rounding on both sides).
    y: one bf16 ulp of the reference (2**-7 |ref|: the kernel rounds once to bf16 and may land
    on the other side of a rounding boundary) plus H*u |ref| for the fp32 differences before
    that rounding: the mean of squares in another summation order (<= H*u relative, halved by
    the square root) and rsqrt vs 1/sqrt_rn (a few u)."""
    h, y = out
    h_ref, y_ref = ref
    if not torch.equal(h.view(torch.int16), h_ref.view(torch.int16)):
        bad = int((h.view(torch.int16) != h_ref.view(torch.int16)).sum())
        raise AssertionError(f"norm.add_rms: h differs from the bf16 add in {bad} elements")
    x = case.args[0]
    band = BF16_REL * y_ref.abs() + (x.shape[1] * 2.0**-24) * y_ref.abs() + 1e-30
    assert_band("norm.add_rms y", y, y_ref, band)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    (h,) = cell.shape
    if gen is None:
        x = torch.ones(rows, h, dtype=torch.bfloat16, device=device)
        r = torch.ones(rows, h, dtype=torch.bfloat16, device=device)
        w = torch.zeros(h, dtype=torch.bfloat16, device=device)
    else:
        x = (3.0 * torch.randn(rows, h, generator=gen)).to(device=device, dtype=torch.bfloat16)
        r = (10.0 * torch.randn(rows, h, generator=gen)).to(device=device, dtype=torch.bfloat16)
        w = (0.2 * torch.randn(h, generator=gen)).to(device=device, dtype=torch.bfloat16)
    return Case(args=(x, r, w, 1e-6, poisoned((rows, h), torch.bfloat16, device),
                      poisoned((rows, h), torch.bfloat16, device)), kwargs={}, bytes_moved=rows * h * 2 * 4 + h * 2)


CELLS = (
    Cell(rows=(1, ROW_CELLS_MAX), shape=(6144,), why="hidden 6144: the two norms of every decoder layer and the final norm; "
         "one program per row, so every row count uses the same compiled variant"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(256,), why="embedded model hidden 256: the residual boundaries of every layer"),
)
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(256,), why="interpreter: power-of-two H"),
    Cell(rows=(2, 2), shape=(200,), why="interpreter: masked tail (H not a power of two)"),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        add_rmsnorm(*make_case(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="norm.add_rms", kind="norm.add_rms", raw_call=add_rmsnorm, reference=add_rmsnorm_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=add_rmsnorm_stock,
)
ENTRIES = (ENTRY,)
