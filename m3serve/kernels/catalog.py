"""The kernel catalog contract: every fast path is an executable Entry with certified Cells.

An Entry bundles, for one kernel:
    raw_call      the launch: every tensor, size and tile config is an argument; no bound state
    reference     plain torch with the same signature, true fp32 (TF32 off), the contract
    compare       raises AssertionError unless `out` is inside the stated tolerance bands
    make_case     fresh random inputs for (cell, rows): (args, kwargs) for both calls + outputs
                  poisoned with NaN, so an unwritten element can never pass
    cells         the certified input space (real M3 shapes, run by the GPU tests)
    interp_cells  tiny shapes for the CPU interpreter tests (not certified, not dispatched)
    warmup        compiles every cell's kernel variants (call before any CUDA-graph capture)
    enabled       reads the entry module's ENABLED constant (the one switch for the fast path)

A Cell is a shape plus a range of row counts (tokens in the step) that one compiled variant
serves, with its tile config and the reason it exists. No entry reads environment variables.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

ARCHS = ("sm_90",)

# Row-parallel elementwise entries (one program per token row: norms, q/k prep, activations, the small router) are
# certified up to this many rows: every decode graph bucket and every prefill chunk (max_num_batched_tokens at most
# 16384) runs them; without them a prefill chunk's norms and activations are ~20 % of its GPU time in torch ops.
ROW_CELLS_MAX = 16384

# Entry modules, imported lazily by all_entries() so that importing the catalog stays cheap.
ENTRY_MODULES = (
    "m3serve.kernels.gemm.nvfp4",
    "m3serve.kernels.gemm.mxfp8",
    "m3serve.kernels.gemm.fp8",
    "m3serve.kernels.gemm.bf16",
    "m3serve.kernels.gemm.tiled",
    "m3serve.kernels.gemm.qkv_fused",
    "m3serve.kernels.norm.add_rms",
    "m3serve.kernels.head.bf16",
    "m3serve.kernels.head.head12",
    "m3serve.kernels.moe.nvfp4",
    "m3serve.kernels.moe.grouped",
    "m3serve.kernels.attention.kv_write",
    "m3serve.kernels.attention.msa_index",
    "m3serve.kernels.attention.paged",
    "m3serve.kernels.attention.prefill",
    "m3serve.kernels.norm.rms", "m3serve.kernels.attention.qk_prep", "m3serve.kernels.mlp.swiglu", "m3serve.kernels.moe.route_small",
    "m3serve.kernels.spec.step",
    "m3serve.kernels.sample.race",
)


@dataclass(frozen=True)
class Cell:
    rows: tuple[int, int]  # inclusive range of row counts (tokens in the step)
    shape: tuple[int, ...]  # kind-specific shape key, e.g. (N, K) for linears
    why: str
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def covers(self, rows: int, shape: tuple[int, ...]) -> bool:
        return self.rows[0] <= rows <= self.rows[1] and tuple(shape) == self.shape

    def row_counts(self) -> range:
        return range(self.rows[0], self.rows[1] + 1)


@dataclass(frozen=True)
class Case:
    """One test/bench invocation: call raw_call(*args, **kwargs) and reference(*args, **kwargs);
    `out` names the poisoned output tensors the raw call fills (for the compare)."""

    args: tuple
    kwargs: dict
    bytes_moved: int  # weight + activation bytes one call must read/write at least (bench)


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str
    raw_call: Callable[..., Any]
    reference: Callable[..., Any]
    compare: Callable[[Any, Any, Case], None]
    make_case: Callable[[Cell, int, torch.device, torch.Generator], Case]
    cells: tuple[Cell, ...]
    interp_cells: tuple[Cell, ...]
    warmup: Callable[[torch.device], None]
    enabled: Callable[[], bool]
    stock: Callable[..., Any] | None = None  # the unfused torch path, for the benchmark
    archs: tuple[str, ...] = ARCHS

    def cell_for(self, rows: int, shape: tuple[int, ...]) -> Cell | None:
        for c in self.cells:
            if c.covers(rows, shape):
                return c
        return None

    def nearest_cell(self, rows: int, shape: tuple[int, ...]) -> Cell | None:
        """The certified cell closest to (rows, shape): same shape first, then row distance."""

        def dist(c: Cell) -> tuple[int, int]:
            shape_d = sum(abs(a - b) for a, b in zip(c.shape, shape)) + 10**9 * (len(c.shape) != len(shape))
            row_d = 0 if c.rows[0] <= rows <= c.rows[1] else min(abs(rows - c.rows[0]), abs(rows - c.rows[1]))
            return (shape_d, row_d)

        return min(self.cells, key=dist) if self.cells else None


def all_entries() -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for mod in ENTRY_MODULES:
        m = importlib.import_module(mod)
        for e in m.ENTRIES:
            out[e.name] = e
    return out


def warmup_all(device: torch.device) -> None:
    """Compile every enabled entry's cells on `device` (call once, before graph capture)."""
    for e in all_entries().values():
        if e.enabled():
            e.warmup(device)


# --- shared contract helpers ---------------------------------------------------------------

BF16_REL = 2.0**-7  # one bf16 ulp is at most 2**-7 of the value (8 significant bits)
FP32_U = 2.0**-24  # fp32 unit roundoff


@contextlib.contextmanager
def true_fp32() -> Iterator[None]:
    """Reference matmuls in real fp32: TF32 off for cuBLAS and cuDNN, restored afterwards."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def device_rng(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on `device`, seeded from `gen`: large random weights are drawn where they
    live (GBs of expert weights on the GPU), while one CPU generator still fixes the case."""
    if device.type == "cpu":
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write fails the compare."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_band(name: str, out: torch.Tensor, ref: torch.Tensor, band: torch.Tensor) -> None:
    """|out - ref| <= band elementwise, out finite wherever ref is; reports the worst element."""
    o = out.float()
    r = ref.float()
    bad_nan = torch.isfinite(r) & ~torch.isfinite(o)
    if bool(bad_nan.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad_nan)[0])
        raise AssertionError(f"{name}: non-finite output at {idx} (ref {float(r[idx])}); "
                             f"{int(bad_nan.sum())} such elements (unwritten or overflow)")
    err = (o - r).abs()
    excess = torch.where(torch.isfinite(r), err - band, torch.zeros_like(err))
    if bool((excess > 0).any()):
        flat = int(torch.argmax(excess))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), excess.shape))
        raise AssertionError(
            f"{name}: |out-ref| exceeds the band at {idx}: out {float(o[idx])}, ref {float(r[idx])}, "
            f"err {float(err[idx]):.4g} > band {float(band[idx]):.4g}; {int((excess > 0).sum())} of "
            f"{excess.numel()} elements outside"
        )


def gemm_band(ref: torch.Tensor, absprod: torch.Tensor, k: int) -> torch.Tensor:
    """Tolerance for a bf16 output of an fp32-accumulated dot product of length k.

    ref      fp32 reference (same products, another summation order)
    absprod  sum_k |x_k * w_k| for each output (the scale of the accumulation error)

    * summation order: both sides accumulate exact products in fp32, so each differs from the
      exact sum by at most ~k * u * sum|x w| (u = 2**-24, the classical worst-case bound);
      the two together: 2 k u sum|x w|.
    * the kernel rounds once to bf16: <= half an ulp, and the exact value may sit on the other
      side of a rounding boundary from ref, so allow one full ulp: 2**-7 * |ref|.
    """
    return BF16_REL * ref.abs() + 2.0 * k * FP32_U * absprod + 1e-30


def check_tensor(name: str, t: Any, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """TypeError/ValueError naming the argument, the expected and the found value."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, found {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, found {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, found {t.device}")
    return t


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, found strides {tuple(t.stride())}")


def check_rows(name: str, x: torch.Tensor, cfg_bm: int) -> int:
    m = x.shape[0]
    if not 1 <= m <= cfg_bm:
        raise ValueError(f"{name}: expected 1..{cfg_bm} rows for this tile config, found {m}")
    return m


def check_operand(name: str, t: Any, dtypes: tuple[torch.dtype, ...], dims: int, device: torch.device | None,
                  contiguous: bool = False) -> torch.Tensor:
    """TypeError/ValueError naming `name` unless t is a tensor of one of `dtypes` with `dims` dims, a unit last
    stride (or fully contiguous) and on `device` (None: any)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {dtypes}, found {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, found shape {tuple(t.shape)}")
    if t.numel() and (not t.is_contiguous() if contiguous else t.stride(-1) != 1):
        raise ValueError(f"{name}: expected {'a contiguous tensor' if contiguous else 'a unit last stride'}, "
                         f"found strides {tuple(t.stride())}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, found {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, want: tuple[int, ...], meaning: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{name}: expected shape {meaning} = {want}, found {tuple(t.shape)}")
