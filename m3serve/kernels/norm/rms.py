"""Catalog entry norm.rms: Gemma RMSNorm of token rows, one program per row (one launch per norm).

    y = bf16( (x.float() * rsqrt(mean(x.float()**2) + eps)) * (1 + w.float()) )

the stock m3serve.model.layers.RMSNorm on a bf16 input, with the fp32 arithmetic in one kernel
instead of eight.

Shape legend:
    x      [M, H]   bf16, unit column stride (M = 1..48 tokens; H = 6144 on M3, 256 on the embedded model)
    w      [H]      bf16 or fp32 Gemma weight (the stored value; 1 + w is applied)
    y_out  [M, H]   bf16, unit column stride; may alias x (each row is read before it is written,
                    by the same program)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16
from m3serve.kernels._jit import helper, is_compiled, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.catalog import ROW_CELLS_MAX, BF16_REL, FP32_U, Case, Cell, Entry, assert_band, check_tensor, poisoned

ENABLED = True  # the one switch: False sends norm.rms calls down the stock path


@helper
def rms_inverse(xf, n, eps):
    """1 / sqrt(mean(xf**2) + eps) over a masked (zero-padded) fp32 row of n elements.

    IEEE sqrt and divisions (a plain `/` compiles to the approximate div.full.f32): the only differences
    from torch are the summation order of the mean and torch's own rsqrt rounding."""
    mean = tl.div_rn(tl.sum(xf * xf, axis=0), n * 1.0)
    return tl.div_rn(1.0, tl.sqrt_rn(mean + eps))


@kernel
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = rms_inverse(xf, H, eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, to_bf16((xf * inv) * (1.0 + w), CUDA), mask=mask)


def _warps(block: int) -> int:
    return 16 if block >= 4096 else (4 if block >= 1024 else 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, y_out: torch.Tensor) -> torch.Tensor:
    """Raw call. Writes and returns y_out."""
    check_tensor("x", x, torch.bfloat16)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, H] with unit column stride, found shape {tuple(x.shape)} "
                         f"strides {tuple(x.stride())}")
    m, h = x.shape
    check_tensor("y_out", y_out, torch.bfloat16, (m, h), x.device)
    if y_out.stride(1) != 1:
        raise ValueError(f"y_out: expected unit column stride, found strides {tuple(y_out.stride())}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"weight: expected torch.bfloat16 or torch.float32, found {weight.dtype}")
    check_tensor("weight", weight, shape=(h,), device=x.device)
    if not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous tensor, found strides {tuple(weight.stride())}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: expected a positive float, found {eps!r}")
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(m,)](x, weight, y_out, h, x.stride(0), y_out.stride(0), eps, BLOCK=block,
                           CUDA=is_compiled(x), num_warps=_warps(block))
    return y_out


def rms_norm_reference(x, weight, eps, y_out=None) -> torch.Tensor:
    """The stock RMSNorm in fp32, before its final bf16 cast (so the compare can place its band)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)) * (1.0 + weight.float())


def rms_norm_stock(x, weight, eps, y_out=None) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps).to(x.dtype)


def compare(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """One bf16 ulp of the reference (2**-7 |ref|: the kernel rounds once to bf16 and may land on
    the other side of a rounding boundary) plus H*u |ref| for the fp32 differences before that
    rounding: the mean of squares in another summation order (<= H*u relative, halved by the
    square root) and torch's rsqrt vs 1/sqrt_rn (a few u)."""
    h = case.args[0].shape[1]
    band = BF16_REL * ref.abs() + (h * FP32_U) * ref.abs() + 1e-30
    assert_band("norm.rms", out, ref, band)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    (h,) = cell.shape
    if gen is None:
        x = torch.ones(rows, h, dtype=torch.bfloat16, device=device)
        w = torch.zeros(h, dtype=torch.float32, device=device)
    else:
        # residual-stream-like rows: a few large channels over a unit background, fp32 Gemma weights
        x = torch.randn(rows, h, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
        x[:, torch.randint(0, h, (max(1, h // 64),), generator=gen)] *= 30.0
        x = x.to(device=device, dtype=torch.bfloat16)
        w = (0.3 * torch.randn(h, generator=gen)).to(device)
    return Case(args=(x, w, 1e-6, poisoned((rows, h), torch.bfloat16, device)), kwargs={},
                bytes_moved=rows * h * 2 * 2 + h * 4)


CELLS = (
    Cell(rows=(1, ROW_CELLS_MAX), shape=(6144,), why="M3 hidden 6144 (TP1 and TP2: norms see the full hidden state): the two "
         "norms of every decoder layer and the final norm; one program per row, one compiled variant"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(256,), why="embedded model hidden 256: input/post norms and the final norm"),
)
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(64,), why="interpreter: power-of-two H"),
    Cell(rows=(2, 2), shape=(200,), why="interpreter: masked tail (H not a power of two)"),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        rms_norm(*make_case(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="norm.rms", kind="norm.rms", raw_call=rms_norm, reference=rms_norm_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=rms_norm_stock,
)
ENTRIES = (ENTRY,)
