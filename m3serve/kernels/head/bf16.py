"""Catalog entry head.bf16: greedy token ids = argmax(x @ W^T) over the vocabulary for a BF16
LM head, without writing the [M, V] logits (the 9-48-row head, and head12's fallback). The
logits are compared as bf16 values, as the BF16 head returns them: the decode graphs' greedy step
takes these ids where the stock path takes argmax of its bf16 logits.

Shape legend:
    x          [M, K]   bf16 final hidden states (M = 1..48 tokens, K = 6144)
    w          [V, K]   bf16 (V = 200064 at TP1, 100032 per rank at TP2 vocab-parallel)
    workspace  HeadWorkspace: part_val fp32 [BM, V/BN], part_idx int32 [BM, V/BN]
    ids        [M]      int64 argmax + index_offset (the shard's first vocabulary row)
    best       [M]      fp32 the winning logit, a bf16 value (combine shards with a max over ranks)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.kernels.head._argmax import argmax_reduce, head_partial_argmax
from m3serve.kernels._jit import is_compiled
from m3serve.kernels.gemm._linear import bm_for, fresh_x
from m3serve.kernels.catalog import FP32_U, Case, Cell, Entry, check_tensor, device_rng, poisoned, true_fp32

ENABLED = True  # the one switch: False sends head.bf16 calls down the stock path

HEAD_ROW_RANGES = ((1, 16), (17, 32), (33, 48))
VOCAB_TP1 = 200064
VOCAB_TP2 = VOCAB_TP1 // 2


@dataclass(frozen=True)
class HeadConfig:
    BM: int
    BN: int = 64
    BK: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass
class HeadWorkspace:
    part_val: torch.Tensor
    part_idx: torch.Tensor


def make_head_workspace(cfg: HeadConfig, v: int, device: torch.device) -> HeadWorkspace:
    p = v // cfg.BN
    return HeadWorkspace(torch.empty(cfg.BM, p, dtype=torch.float32, device=device),
                         torch.empty(cfg.BM, p, dtype=torch.int32, device=device))


def check_head_io(x: torch.Tensor, v: int, k: int, ids: torch.Tensor, best: torch.Tensor, ws: HeadWorkspace,
                  cfg: HeadConfig) -> int:
    check_tensor("x", x, torch.bfloat16)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, {k}] with unit column stride, found {tuple(x.shape)}")
    m = x.shape[0]
    if not 1 <= m <= cfg.BM:
        raise ValueError(f"x: this config (BM={cfg.BM}) serves 1..{cfg.BM} rows, found M={m}")
    if v % cfg.BN or k % cfg.BK:
        raise ValueError(f"head shape (V={v}, K={k}): expected V % {cfg.BN} == 0 and K % {cfg.BK} == 0")
    check_tensor("ids", ids, torch.int64, (m,), x.device)
    check_tensor("best", best, torch.float32, (m,), x.device)
    p = v // cfg.BN
    for name, t, dt in (("workspace.part_val", ws.part_val, torch.float32), ("workspace.part_idx", ws.part_idx, torch.int32)):
        check_tensor(name, t, dt, device=x.device)
        if t.dim() != 2 or t.shape[0] < m or t.shape[1] != p or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous [>= {m}, {p}], found {tuple(t.shape)}")
    return m


def head_bf16_argmax(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, best: torch.Tensor,
                     workspace: HeadWorkspace, index_offset: int, config: HeadConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw call. Writes and returns (ids, best)."""
    check_tensor("w", w, torch.bfloat16, device=x.device)
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"w: expected a contiguous [V, K] matrix, found {tuple(w.shape)}")
    v, k = w.shape
    m = check_head_io(x, v, k, ids, best, workspace, config)
    p = v // config.BN
    head_partial_argmax[(p,)](x, w, workspace.part_val, workspace.part_idx, m, v, k, x.stride(0), p, BM=config.BM,
                              BN=config.BN, BK=config.BK, CUDA=is_compiled(x), num_warps=config.num_warps,
                              num_stages=config.num_stages)
    argmax_reduce[(m,)](workspace.part_val, workspace.part_idx, ids, best, p, index_offset, BLOCK=1024, num_warps=4)
    return ids, best


def head_bf16_reference(x, w, ids=None, best=None, workspace=None, index_offset=0, config=None):
    """fp32 logits [M, V] = x.float() @ w.float().T (true fp32); the compare derives the
    acceptable ids from them (near-ties are legitimate either way)."""
    with true_fp32():
        return x.float() @ w.float().T


def head_bf16_stock(x, w, ids=None, best=None, workspace=None, index_offset=0, config=None):
    """Without this kernel: materialise bf16 logits, then torch.argmax."""
    return torch.argmax(x @ w.T, dim=-1) + index_offset


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |t| (fp32 in, fp32 out): 2**(exponent(t) - 7), at least the smallest normal's."""
    e = torch.floor(torch.log2(t.abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def compare_argmax(name: str, out: tuple[torch.Tensor, torch.Tensor], logits: torch.Tensor, absprod: torch.Tensor,
                   k: int, index_offset: int) -> None:
    """ids: the kernel rounds its fp32 logits l' to bf16 (as a BF16 head's logits) and picks the first maximum, so
    with b = 2*K*u*sum|x*w| per logit (fp32 accumulation in two orders, exact products) and the reference's true
    maximum j: logits[id] >= max - (b[id] + b[j] + (ulp_bf16(max) + ulp_bf16(logits[id])) / 2) (each side rounded
    by at most half its ulp). Exact ties and near-ties may go either way.
    best: the bf16 rounding of the kernel's logit: |best - logits[id]| <= b[id] + ulp_bf16(logits[id]) / 2."""
    ids, best = out
    m = logits.shape[0]
    local = ids.long() - index_offset
    if bool(((local < 0) | (local >= logits.shape[1])).any()):
        raise AssertionError(f"{name}: ids outside [{index_offset}, {index_offset + logits.shape[1]}): {ids.tolist()}")
    b = 2.0 * k * FP32_U * absprod + 1e-30
    rows = torch.arange(m, device=logits.device)
    j = torch.argmax(logits, dim=1)
    picked = logits[rows, local]
    top = logits[rows, j]
    slack = b[rows, local] + b[rows, j] + (bf16_ulp(top) + bf16_ulp(picked)) / 2
    short = top - picked - slack
    if bool((short > 0).any()):
        r = int(torch.argmax(short))
        raise AssertionError(f"{name}: row {r} picked {int(local[r])} (logit {float(picked[r])}) but "
                             f"{int(j[r])} has {float(logits[r, j[r]])}; allowed slack {float(slack[r]):.3g}")
    if not torch.equal(best.float(), best.float().to(torch.bfloat16).float()):
        raise AssertionError(f"{name}: best holds values that are not bf16: {best.tolist()[:8]}")
    err = (best.float() - picked).abs() - (b[rows, local] + bf16_ulp(picked) / 2)
    if bool((~torch.isfinite(best)).any()) or bool((err > 0).any()):
        r = int(torch.argmax(torch.nan_to_num(err, nan=float("inf"))))
        raise AssertionError(f"{name}: best[{r}] = {float(best[r])} but logit[{int(local[r])}] = {float(picked[r])}")


def compare(out, logits, case: Case) -> None:
    x, w = case.args[:2]
    with true_fp32():
        absprod = x.float().abs() @ w.float().abs().T
    compare_argmax("head.bf16", out, logits, absprod, x.shape[1], case.args[5])


def random_head_weight(v: int, k: int, device: torch.device, gen: torch.Generator | None) -> torch.Tensor:
    """LM-head-like bf16: N(0, 0.02) with a few large, tiny and zero entries (near-ties in the
    logits are still rare, and the compare accepts them)."""
    if gen is None:
        return torch.zeros(v, k, dtype=torch.bfloat16, device=device)
    g = device_rng(gen, device)
    w = 0.02 * torch.randn(v, k, generator=g, device=device)
    n_special = max(v * k // 4096, 4)
    idx = torch.randint(0, v * k, (n_special,), generator=g, device=device)
    specials = torch.tensor([0.0, 3.0, -5.0, 1e-30, -2e-38, 0.5], dtype=torch.float32, device=device)
    w.view(-1)[idx] = specials[torch.randint(0, len(specials), (n_special,), generator=g, device=device)]
    return w.to(torch.bfloat16)


def head_case_io(cfg: HeadConfig, rows: int, v: int, device: torch.device):
    ids = torch.full((rows,), -1, dtype=torch.int64, device=device)
    best = poisoned((rows,), torch.float32, device)
    return ids, best, make_head_workspace(cfg, v, device)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    v, k = cell.shape
    cfg: HeadConfig = cell.config["head"]
    w = random_head_weight(v, k, device, gen)
    x = fresh_x(rows, k, device, gen)
    ids, best, ws = head_case_io(cfg, rows, v, device)
    offset = 0 if gen is None else int(torch.randint(0, 3, (), generator=gen)) * v
    return Case(args=(x, w, ids, best, ws, offset, cfg), kwargs={}, bytes_moved=v * k * 2 + rows * k * 2)


def head_cells(why: str) -> tuple[Cell, ...]:
    cells = []
    for v, tp in ((VOCAB_TP1, "TP1"), (VOCAB_TP2, "TP2 vocab-parallel shard")):
        for lo, hi in HEAD_ROW_RANGES:
            cells.append(Cell(rows=(lo, hi), shape=(v, 6144), why=f"{why}, {tp}, rows {lo}-{hi}",
                              config={"head": HeadConfig(BM=bm_for(hi))}))
    return tuple(cells)


CELLS = head_cells("M3 LM head (vocab 200064, hidden 6144) / Eagle3 draft head")
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(192, 256), why="interpreter: 3 programs, BM 16", config={"head": HeadConfig(BM=16)}),
    Cell(rows=(20, 20), shape=(128, 128), why="interpreter: BM 32", config={"head": HeadConfig(BM=32)}),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        head_bf16_argmax(*make_case(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="head.bf16", kind="head.bf16", raw_call=head_bf16_argmax, reference=head_bf16_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=head_bf16_stock,
)
ENTRIES = (ENTRY,)
