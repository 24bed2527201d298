"""Catalog entry mlp.swiglu_oai: the SwiGLU-OAI activation of a gate|up projection, rounded once to bf16.

    out = bf16( clamp(g, max=L) * sigmoid(alpha * clamp(g, max=L)) * (clamp(u, -L, L) + 1) )      fp32 inside

the stock m3serve.model.layers.swiglu_oai followed by the callers' .to(bf16) (DenseMLP, the dense
all-experts MoE), in one launch instead of eight. Also entry mlp.silu_mul: the Llama MLP gate of the Eagle3
draft layer, bf16(bf16(silu(g)) * u) as the stock F.silu(gate) * up rounds it, in one launch instead of two.

Shape legend (E stacked groups: 1 for a dense MLP, the expert count for the all-experts MoE; T tokens):
    gate_up  [E, T, 2I]  bf16, contiguous (gate columns [0, I), up columns [I, 2I))
    out      [E, T, I]   bf16, contiguous
    alpha, limit         runtime floats (the config's swiglu_alpha, swiglu_limit)
Grid: (E * T, ceil(I / BLOCK)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16
from m3serve.kernels._jit import is_compiled, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.catalog import ROW_CELLS_MAX, BF16_REL, FP32_U, Case, Cell, Entry, assert_band, check_tensor, poisoned
from m3serve.model.layers import swiglu_oai as swiglu_oai_stock_fp32

ENABLED = True  # the one switch: False sends mlp.swiglu_oai calls down the stock path

MAX_BLOCK = 1024  # columns per program: wide rows (I = 12288) spread over several programs


@kernel
def _gate_kernel(gu_ptr, out_ptr, I, alpha, limit, OAI: tl.constexpr, BLOCK: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    """OAI: SwiGLU-OAI (mlp.swiglu_oai); else the Llama gate bf16(bf16(silu(g)) * u) (mlp.silu_mul)."""
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    base = gu_ptr + row.to(tl.int64) * (2 * I)
    g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + I + cols, mask=mask, other=0.0).to(tl.float32)
    if OAI:
        # torch.clamp keeps NaN; fmin/fmax would replace it
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
        # IEEE division: tl.sigmoid and a plain `/` compile to the approximate div.full.f32
        sig = tl.div_rn(tl.full([BLOCK], 1.0, tl.float32), 1.0 + tl.exp(-(alpha * g)))
        y = g * sig * (u + 1.0)
    else:
        # the stock path rounds twice: F.silu's bf16 output, then the bf16 product
        y = to_bf16(tl.div_rn(g, 1.0 + tl.exp(-g)), CUDA).to(tl.float32) * u
    tl.store(out_ptr + row.to(tl.int64) * I + cols, to_bf16(y, CUDA), mask=mask)


def _launch_gate(gate_up: torch.Tensor, out: torch.Tensor, alpha: float, limit: float, oai: bool) -> torch.Tensor:
    """The checks and launch both gate entries share: gate_up [E, T, 2I] bf16 contiguous -> out [E, T, I]."""
    check_tensor("gate_up", gate_up, torch.bfloat16)
    if gate_up.dim() != 3 or gate_up.shape[2] % 2:
        raise ValueError(f"gate_up: expected [E, T, 2I], found shape {tuple(gate_up.shape)}")
    if not gate_up.is_contiguous():
        raise ValueError(f"gate_up: expected a contiguous tensor, found strides {tuple(gate_up.stride())}")
    e, t, two_i = gate_up.shape
    i = two_i // 2
    check_tensor("out", out, torch.bfloat16, (e, t, i), gate_up.device)
    if not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor, found strides {tuple(out.stride())}")
    if e * t == 0:
        return out
    block = min(triton.next_power_of_2(i), MAX_BLOCK)
    _gate_kernel[(e * t, triton.cdiv(i, block))](gate_up, out, i, alpha, limit, OAI=oai, BLOCK=block,
                                                 CUDA=is_compiled(gate_up), num_warps=4 if block >= 512 else 1)
    return out


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float, out: torch.Tensor) -> torch.Tensor:
    """Raw call. Writes and returns out."""
    for name, v in (("alpha", alpha), ("limit", limit)):
        if not isinstance(v, float) or not v > 0:
            raise ValueError(f"{name}: expected a positive float, found {v!r}")
    return _launch_gate(gate_up, out, alpha, limit, oai=True)


def swiglu_oai_reference(gate_up, alpha, limit, out=None) -> torch.Tensor:
    """The stock swiglu_oai (fp32), before the callers' bf16 cast."""
    return swiglu_oai_stock_fp32(gate_up, alpha, limit)


def swiglu_oai_stock(gate_up, alpha, limit, out=None) -> torch.Tensor:
    return swiglu_oai_stock_fp32(gate_up, alpha, limit).to(gate_up.dtype)


def compare(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """One bf16 ulp of the reference (2**-7 |ref|: one rounding to bf16 that may land on the other side of a
    boundary) plus (alpha |g| + 8) u |ref| for the fp32 differences before it, g the clamped gate: exp of
    the rounded argument -alpha g (an argument error of u |alpha g| is a relative error of u |alpha g| in
    exp, and sigmoid = 1 / (1 + e) has at most e's relative error), the exponential itself (compiled
    ex2.approx after a multiply by log2 e: <= 4 u) and the 1+e, division and two products (<= 4 u)."""
    gate_up, alpha, limit = case.args[0], case.args[1], case.args[2]
    i = gate_up.shape[-1] // 2
    g = gate_up[..., :i].float().clamp(max=limit)
    band = BF16_REL * ref.abs() + (alpha * g.abs() + 8.0) * FP32_U * ref.abs() + 1e-30
    assert_band("mlp.swiglu_oai", out, ref, band)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    e, i = cell.shape
    alpha, limit = 1.702, 7.0
    if gen is None:
        gu = torch.zeros(e, rows, 2 * i, dtype=torch.bfloat16, device=device)
    else:
        # gate|up outputs spanning both clamps (|x| > 7) and the sigmoid's tails
        gu = torch.randn(e, rows, 2 * i, generator=gen) * torch.exp(torch.randn(e, rows, 1, generator=gen))
        gu = (3.0 * gu).to(device=device, dtype=torch.bfloat16)
    return Case(args=(gu, alpha, limit, poisoned((e, rows, i), torch.bfloat16, device)), kwargs={},
                bytes_moved=e * rows * i * 2 * 3)


CELLS = (
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 12288), why="M3 TP1 dense-MLP layers (dense_intermediate_size 12288)"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 6144), why="M3 TP2 dense-MLP layers (12288 / 2 per rank)"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 3072), why="M3 TP1 shared expert / expert width 3072 (bf16 stock MoE paths)"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 1536), why="M3 TP2 shared expert / expert width 1536 per rank"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 512), why="embedded model dense-MLP layers (dense_intermediate_size 512)"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 128), why="embedded model shared expert (shared_intermediate_size 128)"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(8, 128), why="embedded model all-experts MoE: 8 experts x T tokens, I = 128"),
)
INTERP_CELLS = (
    Cell(rows=(1, 2), shape=(1, 64), why="interpreter: one group, power-of-two I"),
    Cell(rows=(3, 3), shape=(2, 40), why="interpreter: two stacked groups, masked tail (I not a power of two)"),
)


def _warmup(cells, make, call):
    """An entry's warmup: one call per cell at its largest row count."""
    def warm(device: torch.device) -> None:
        for c in cells:
            call(*make(c, c.rows[1], device, None).args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return warm


warmup = _warmup(CELLS, make_case, swiglu_oai)


# --- mlp.silu_mul: the Llama MLP's gate (the Eagle3 drafter), stock F.silu(gate) * up in bf16 --------------


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Raw call of mlp.silu_mul: gate_up [E, T, 2I] bf16 contiguous -> out [E, T, I] = silu(gate) * up. Writes
    and returns out."""
    return _launch_gate(gate_up, out, 1.0, 1.0, oai=False)


def silu_mul_reference(gate_up, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 product before the final bf16 cast, |silu(g)| * |u| in fp32): silu in fp32, rounded to bf16 as
    F.silu on bf16 stores it, times up."""
    i = gate_up.shape[-1] // 2
    g, u = gate_up[..., :i].float(), gate_up[..., i:].float()
    silu = g * torch.sigmoid(g)
    prod = silu.to(torch.bfloat16).float() * u
    return prod, (silu * u).abs()


def silu_mul_stock(gate_up, out=None) -> torch.Tensor:
    i = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:]


def silu_mul_compare(out: torch.Tensor, ref, case: Case) -> None:
    """|out - ref| <= 2**-7 (|ref| + |silu(g) u|) + 8u |silu(g) u|: the final bf16 rounding (one ulp: it may
    land on the other side of a boundary); silu's own bf16 rounding, which may go the other way when the two
    fp32 silu values (exp / division order) straddle a boundary (one bf16 ulp of silu, times |u|); the fp32
    silu differences themselves (exp within 4u, the division and the 1 + e: 8u)."""
    prod, mag = ref
    band = BF16_REL * (prod.abs() + mag) + 8.0 * FP32_U * mag + 1e-30
    assert_band("mlp.silu_mul", out, prod, band)


def silu_mul_make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    e, i = cell.shape
    if gen is None:
        gu = torch.zeros(e, rows, 2 * i, dtype=torch.bfloat16, device=device)
    else:
        gu = torch.randn(e, rows, 2 * i, generator=gen) * torch.exp(torch.randn(e, rows, 1, generator=gen))
        gu = (3.0 * gu).to(device=device, dtype=torch.bfloat16)
    return Case(args=(gu, poisoned((e, rows, i), torch.bfloat16, device)), kwargs={}, bytes_moved=e * rows * i * 2 * 3)


SILU_CELLS = (
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 12288), why="M3 Eagle3 draft layer MLP (Eagle3Config.for_target: the target's "
                                              "dense intermediate size)"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(1, 512), why="embedded model's Eagle3 draft layer MLP (intermediate 512)"),
)
SILU_INTERP_CELLS = (
    Cell(rows=(1, 2), shape=(1, 64), why="interpreter: one group, power-of-two I"),
    Cell(rows=(3, 3), shape=(1, 40), why="interpreter: masked tail"),
)


silu_mul_warmup = _warmup(SILU_CELLS, silu_mul_make_case, silu_mul)


SILU_ENTRY = Entry(
    name="mlp.silu_mul", kind="mlp.silu_mul", raw_call=silu_mul, reference=silu_mul_reference,
    compare=silu_mul_compare, make_case=silu_mul_make_case, cells=SILU_CELLS, interp_cells=SILU_INTERP_CELLS,
    warmup=silu_mul_warmup, enabled=lambda: ENABLED, stock=silu_mul_stock,
)

ENTRY = Entry(
    name="mlp.swiglu_oai", kind="mlp.swiglu_oai", raw_call=swiglu_oai, reference=swiglu_oai_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=swiglu_oai_stock,
)
ENTRIES = (ENTRY, SILU_ENTRY)
