"""Catalog entries head.head12: greedy token ids over the 12-bit lossless coding of a BF16 LM head
(m3serve.quant.head12), 1.5 bytes a weight instead of 2, for 1-8 token rows: the register-operand MMA head
(kernels/head/_head12_mma.py) sums the dense tiles in fp32, then one pass adds the escapes exactly, rounds the
logits to bf16 and reduces each program's rows to (max, first index), and the last pass picks over the programs
(kernels/head/_argmax.py). The ids equal the BF16 head's up to fp32 summation order, ties included; and
head.head12_logits: the same MMA sums, then one pass adds the escapes and writes the bf16 logits (the rows that
sample, or want logprobs).

Shape legend:
    x               [M, K]          bf16 (M = 1..8 tokens, K = 6144)
    sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val
                                    quant.head12_tiles.Head12Tiles.args() (the MMA head's layout of the weight)
    workspace       Head12Workspace: logits fp32 [8, V], part_val fp32 [8, P], part_idx int32 [8, P],
                    P = cdiv(V, BN_REDUCE)
    ids [M] int64, best [M] fp32    as in head.bf16
    out             [M, V]          bf16 logits (head.head12_logits)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.kernels.head import bf16 as HB
from m3serve.kernels.head._argmax import argmax_reduce, head12_escape_argmax, head12_escape_logits
from m3serve.kernels.head._head12_mma import Head12MmaConfig, emulate, launch_head12_mma
from m3serve.kernels._jit import is_compiled
from m3serve.kernels.catalog import Case, Cell, Entry, assert_band, check_tensor, gemm_band, poisoned, true_fp32
from m3serve.kernels.gemm._linear import fresh_x
from m3serve.quant.head12 import TILE_COLS, TILE_ROWS, encode_head12
from m3serve.quant.head12_tiles import Head12Tiles, head12_tiles_weight, tile_head12

ENABLED = True  # the one switch: False sends head.head12 calls down the BF16 head

ROWS = (1, 8)


@dataclass
class Head12Workspace:
    logits: torch.Tensor
    part_val: torch.Tensor
    part_idx: torch.Tensor


def make_head12_workspace(cfg: Head12MmaConfig, v: int, device: torch.device) -> Head12Workspace:
    p = -(-v // cfg.BN_REDUCE)
    return Head12Workspace(torch.empty(cfg.BM, v, dtype=torch.float32, device=device),
                           torch.empty(cfg.BM, p, dtype=torch.float32, device=device),
                           torch.empty(cfg.BM, p, dtype=torch.int32, device=device))


def _check_planes(x, sm, codes, tb, esc_ptr, esc_row, esc_col, esc_val, cfg: Head12MmaConfig) -> tuple[int, int, int]:
    """The tiles, x and the config: (M, V, K), or an error naming the argument."""
    if not isinstance(cfg, Head12MmaConfig):
        raise TypeError(f"config: expected a Head12MmaConfig, found {type(cfg).__name__}")
    check_tensor("sm", sm, torch.uint8, device=x.device)
    if sm.dim() != 2 or not sm.is_contiguous():
        raise ValueError(f"sm: expected a contiguous [V, K], found {tuple(sm.shape)}")
    v, k = sm.shape
    if v % TILE_ROWS or k % TILE_COLS:
        raise ValueError(f"sm: expected V % {TILE_ROWS} == 0 and K % {TILE_COLS} == 0, found {(v, k)}")
    check_tensor("codes", codes, torch.uint8, (v, k // 2), x.device)
    check_tensor("tile_base", tb, torch.uint8, (v // TILE_ROWS, k // TILE_COLS), x.device)
    check_tensor("esc_ptr", esc_ptr, torch.int32, (v + 1,), x.device)
    e = esc_row.numel()
    check_tensor("esc_row", esc_row, torch.int32, (e,), x.device)
    check_tensor("esc_col", esc_col, torch.int32, (e,), x.device)
    check_tensor("esc_val", esc_val, torch.float32, (e,), x.device)
    for name, t in (("codes", codes), ("tile_base", tb)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    check_tensor("x", x, torch.bfloat16)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, {k}] with unit column stride, found {tuple(x.shape)}")
    m = x.shape[0]
    if not ROWS[0] <= m <= ROWS[1]:
        raise ValueError(f"x: head.head12 serves {ROWS[0]}..{ROWS[1]} rows (one MMA column each), found M={m}")
    if v % cfg.BN:
        raise ValueError(f"head shape (V={v}): expected V % {cfg.BN} == 0 for {cfg}")
    return m, v, k


def _check_workspace(ws: Head12Workspace, m: int, v: int, cfg: Head12MmaConfig, device: torch.device,
                     partials: bool) -> None:
    p = -(-v // cfg.BN_REDUCE)
    parts = [("workspace.logits", ws.logits, torch.float32, v)]
    if partials:
        parts += [("workspace.part_val", ws.part_val, torch.float32, p),
                  ("workspace.part_idx", ws.part_idx, torch.int32, p)]
    for name, t, dt, width in parts:
        check_tensor(name, t, dt, device=device)
        if t.dim() != 2 or t.shape[0] < m or t.shape[1] != width or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous [>= {m}, {width}], found {tuple(t.shape)}")


def _check(x, sm, codes, tb, esc_ptr, esc_row, esc_col, esc_val, ids, best, ws: Head12Workspace,
           cfg: Head12MmaConfig) -> tuple[int, int, int]:
    m, v, k = _check_planes(x, sm, codes, tb, esc_ptr, esc_row, esc_col, esc_val, cfg)
    check_tensor("ids", ids, torch.int64, (m,), x.device)
    check_tensor("best", best, torch.float32, (m,), x.device)
    _check_workspace(ws, m, v, cfg, x.device, partials=True)
    return m, v, k


def _mma_sums(x, sm, codes, tile_base, ws: Head12Workspace, v: int, k: int, config: Head12MmaConfig) -> None:
    """The dense tiles' fp32 sums into ws.logits: the MMA head, or its PTX on the emulator for CPU tensors."""
    if is_compiled(x):
        launch_head12_mma(x, sm, codes, tile_base, ws.logits, v, k, config)
    else:
        emulate(x, sm, codes, tile_base, ws.logits, v, k, config)


def head12_argmax(x: torch.Tensor, sm: torch.Tensor, codes: torch.Tensor, tile_base: torch.Tensor,
                  esc_ptr: torch.Tensor, esc_row: torch.Tensor, esc_col: torch.Tensor, esc_val: torch.Tensor,
                  ids: torch.Tensor, best: torch.Tensor, workspace: Head12Workspace, index_offset: int,
                  config: Head12MmaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw call. Writes and returns (ids, best). CPU tensors run the MMA head's PTX on the emulator, then the same
    escape and argmax passes interpreted."""
    m, v, k = _check(x, sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, ids, best, workspace, config)
    ws = workspace
    _mma_sums(x, sm, codes, tile_base, ws, v, k, config)
    p = ws.part_val.shape[1]
    head12_escape_argmax[(p,)](x, ws.logits, esc_ptr, esc_col, esc_val, ws.part_val, ws.part_idx, m, v, x.stride(0), p,
                               BM=config.BM, BN=config.BN_REDUCE, num_warps=4)
    argmax_reduce[(m,)](ws.part_val, ws.part_idx, ids, best, p, index_offset, BLOCK=1024, num_warps=4)
    return ids, best


def _tiles(sm, codes, tb, esc_ptr, esc_row, esc_col, esc_val) -> Head12Tiles:
    return Head12Tiles(sm, codes, tb, esc_ptr, esc_row, esc_col, esc_val, tuple(sm.shape))


def head12_reference(x, sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, ids=None, best=None, workspace=None,
                     index_offset=0, config=None) -> torch.Tensor:
    """fp32 logits [M, V] = x.float() @ W.float().T in true fp32, W the exact weight the tiles encode."""
    w = head12_tiles_weight(_tiles(sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val))
    with true_fp32():
        return x.float() @ w.float().T


def head12_stock(x, sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, ids=None, best=None, workspace=None,
                 index_offset=0, config=None) -> torch.Tensor:
    """Without this kernel: the BF16 weight (resident in practice), bf16 logits, argmax."""
    w = head12_tiles_weight(_tiles(sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val))
    return torch.argmax(x @ w.T, dim=-1) + index_offset


def _absprod(case: Case) -> torch.Tensor:
    """sum_k |x w| per logit (the scale of the fp32 summation error), from the exact weight the tiles encode."""
    x = case.args[0]
    w = head12_tiles_weight(_tiles(*case.args[1:8]))
    with true_fp32():
        return x.float().abs() @ w.float().abs().T


def compare(out, logits, case: Case) -> None:
    """As head.bf16 (the compare_argmax bands)."""
    HB.compare_argmax("head.head12", out, logits, _absprod(case), case.args[0].shape[1], case.args[11])


def random_head12(v: int, k: int, device: torch.device, gen: torch.Generator) -> Head12Tiles:
    """head.bf16's LM-head-like weight (outliers, zeros, subnormals: escapes of both kinds) as tiles."""
    return tile_head12(encode_head12(HB.random_head_weight(v, k, device, gen)))


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    v, k = cell.shape
    cfg: Head12MmaConfig = cell.config["head"]
    if gen is None:  # warmup / compile check: zero planes and an empty escape list (no data-dependent ops)
        z = torch.zeros(0, dtype=torch.int32, device=device)
        h = Head12Tiles(torch.zeros(v, k, dtype=torch.uint8, device=device),
                        torch.zeros(v, k // 2, dtype=torch.uint8, device=device),
                        torch.zeros(v // TILE_ROWS, k // TILE_COLS, dtype=torch.uint8, device=device),
                        torch.zeros(v + 1, dtype=torch.int32, device=device), z, z,
                        torch.zeros(0, dtype=torch.float32, device=device), (v, k))
    else:
        h = random_head12(v, k, device, gen)
    x = fresh_x(rows, k, device, gen)
    ids = torch.full((rows,), -1, dtype=torch.int64, device=device)
    best = torch.full((rows,), float("nan"), dtype=torch.float32, device=device)
    ws = make_head12_workspace(cfg, v, device)
    ws.logits.fill_(float("nan"))  # poisoned: every sum the argmax reads must have been written
    offset = 0 if gen is None else int(torch.randint(0, 3, (), generator=gen)) * v
    return Case(args=(x, *h.args(), ids, best, ws, offset, cfg), kwargs={},
                bytes_moved=v * k * 3 // 2 + h.esc_row.numel() * 8 + rows * k * 2)


def head12_cells(cfg: Head12MmaConfig) -> tuple[Cell, ...]:
    return tuple(Cell(rows=ROWS, shape=(v, 6144), why=f"M3 LM head as head12 (1.5 B/weight), {tp}, rows 1-8",
                      config={"head": cfg})
                 for v, tp in ((HB.VOCAB_TP1, "TP1"), (HB.VOCAB_TP2, "TP2 vocab-parallel shard")))


# 2 row pairs a warp, 2 warps (BN 64, so V / BN divides both TP shapes; 163 registers, no spill): 656.9 / 683.0 us
# at 1 / 8 rows on the H100 against 663.2 / 687.8 for 1 pair x 4 warps and 960 / 962 for head.bf16
# (bench/results/kernel_variants/kernel-variants-head12-mma-h100.json)
CELLS = head12_cells(Head12MmaConfig(RP=2, num_warps=2))
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(192, 256), why="interpreter: 3 CTAs of 4 warps, escapes of both kinds, 2 reduce programs",
         config={"head": Head12MmaConfig(BN_REDUCE=128)}),
    Cell(rows=(8, 8), shape=(128, 384), why="interpreter: all 8 MMA columns, 2 row pairs a warp, 3 stages",
         config={"head": Head12MmaConfig(RP=2, num_warps=2, STAGES=3, BN_REDUCE=64)}),
)


def _warm(cells, raw_call, case_of, device: torch.device) -> None:
    for c in cells:
        raw_call(*case_of(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warmup(device: torch.device) -> None:
    _warm(CELLS, head12_argmax, make_case, device)


ENTRY = Entry(
    name="head.head12", kind="head.head12", raw_call=head12_argmax, reference=head12_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=head12_stock,
)


# --- head.head12_logits: the same head's bf16 logits, for the rows that sample ----------------------------------
def head12_logits(x: torch.Tensor, sm: torch.Tensor, codes: torch.Tensor, tile_base: torch.Tensor,
                  esc_ptr: torch.Tensor, esc_row: torch.Tensor, esc_col: torch.Tensor, esc_val: torch.Tensor,
                  out: torch.Tensor, workspace: Head12Workspace, config: Head12MmaConfig) -> torch.Tensor:
    """Raw call. Writes and returns out [M, V] bf16: the logits the BF16 head's GEMM returns (fp32 sums rounded to
    bf16), up to fp32 summation order. CPU tensors run the MMA head's PTX on the emulator, the escape pass
    interpreted."""
    m, v, k = _check_planes(x, sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, config)
    check_tensor("out", out, torch.bfloat16, device=x.device)
    if out.dim() != 2 or tuple(out.shape) != (m, v) or out.stride(1) != 1:
        raise ValueError(f"out: expected [{m}, {v}] with unit column stride, found {tuple(out.shape)}")
    _check_workspace(workspace, m, v, config, x.device, partials=False)
    _mma_sums(x, sm, codes, tile_base, workspace, v, k, config)
    head12_escape_logits[(-(-v // config.BN_REDUCE),)](x, workspace.logits, esc_ptr, esc_col, esc_val, out, m, v,
                                                        x.stride(0), out.stride(0), BM=config.BM,
                                                        BN=config.BN_REDUCE, num_warps=4)
    return out


def head12_logits_reference(x, sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, out=None, workspace=None,
                            config=None) -> torch.Tensor:
    """fp32 logits [M, V] in true fp32 from the exact weight the tiles encode."""
    return head12_reference(x, sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val)


def head12_logits_stock(x, sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, out=None, workspace=None,
                        config=None) -> torch.Tensor:
    """Without this kernel: the BF16 weight's GEMM (cuBLAS on the GPU)."""
    return x @ head12_tiles_weight(_tiles(sm, codes, tile_base, esc_ptr, esc_row, esc_col, esc_val)).T


def compare_logits(out, ref, case: Case) -> None:
    """gemm_band: one bf16 ulp of the reference + 2 K u sum|x w| (both sides sum exact products in fp32, in
    different orders; the escapes' products are exact too)."""
    assert_band("head.head12_logits", out, ref, gemm_band(ref, _absprod(case), case.args[0].shape[1]))


def make_logits_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    greedy = make_case(cell, rows, device, gen)     # the same tiles, x, config and poisoned workspace
    x, planes, ws, cfg = greedy.args[0], greedy.args[1:8], greedy.args[10], greedy.args[12]
    out = poisoned((rows, cell.shape[0]), torch.bfloat16, device)
    return Case(args=(x, *planes, out, ws, cfg), kwargs={},
                bytes_moved=greedy.bytes_moved + rows * cell.shape[0] * 2)


LOGITS_CELLS = tuple(Cell(rows=c.rows, shape=c.shape, why=c.why.replace("head12", "head12 logits"), config=c.config)
                     for c in CELLS)
LOGITS_INTERP_CELLS = INTERP_CELLS


def logits_warmup(device: torch.device) -> None:
    _warm(LOGITS_CELLS, head12_logits, make_logits_case, device)


LOGITS_ENTRY = Entry(
    name="head.head12_logits", kind="head.head12_logits", raw_call=head12_logits, reference=head12_logits_reference,
    compare=compare_logits, make_case=make_logits_case, cells=LOGITS_CELLS, interp_cells=LOGITS_INTERP_CELLS,
    warmup=logits_warmup, enabled=lambda: ENABLED, stock=head12_logits_stock,
)
ENTRIES = (ENTRY, LOGITS_ENTRY)
