"""Catalog entry head.head12: greedy token ids over the 12-bit lossless coding of a BF16 LM head
(m3serve.quant.head12): 1.5 bytes per weight instead of 2, decoded in registers; escapes
(code 15) are 0 in the dense tile and added exactly afterwards, so the logits equal the BF16
head's up to fp32 summation order. Same outputs and workspace as head.bf16.

Shape legend:
    x               [M, K]          bf16 (M = 1..48 tokens, K = 6144)
    sign_mantissa   [V, K]          uint8
    exp_codes       [V, K/2]        uint8
    tile_base       [V/16, K/128]   uint8
    esc_ptr         [V + 1]         int32 CSR: escapes of row r are esc_ptr[r] .. esc_ptr[r+1]-1
    esc_row/esc_col [E]             int32
    esc_val         [E]             fp32 (exact copies of the bf16 escape values)
    ids [M] int64, best [M] fp32    as in head.bf16
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.kernels.head import bf16 as HB
from m3serve.kernels.catalog import Case, Cell, Entry, check_tensor, true_fp32
from m3serve.kernels.gemm._linear import fresh_x
from m3serve.quant.head12 import TILE_COLS, TILE_ROWS, Head12, decode_head12, encode_head12

ENABLED = True  # the one switch: False sends head.head12 calls down the BF16 head


@dataclass
class Head12Device:
    """A Head12 laid out for the kernel (built once at load): its escape list as a per-row CSR, and the planes with
    every escaped slot's sign/mantissa byte and code nibble zeroed, so that the kernel decodes those slots to +0
    without testing for code 15 (the exact values come from the escape list; decode_head12 of these planes with
    that list is the same weight)."""

    sign_mantissa: torch.Tensor
    exp_codes: torch.Tensor
    tile_base: torch.Tensor
    esc_ptr: torch.Tensor
    esc_row: torch.Tensor
    esc_col: torch.Tensor
    esc_val: torch.Tensor
    shape: tuple[int, int]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.sign_mantissa, self.exp_codes, self.tile_base, self.esc_ptr, self.esc_row, self.esc_col, self.esc_val)


def prepare_head12(h: Head12) -> Head12Device:
    v, k = h.shape
    idx = h.escape_index
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise ValueError("Head12.escape_index: expected strictly increasing flat indices (row-major), found unsorted")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= v * k):
        raise ValueError(f"Head12.escape_index: expected values in [0, {v * k}), found [{int(idx.min())}, {int(idx.max())}]")
    rows = idx // k
    counts = torch.bincount(rows, minlength=v)
    ptr = torch.zeros(v + 1, dtype=torch.int64, device=idx.device)
    ptr[1:] = torch.cumsum(counts, 0)
    sm, codes = h.sign_mantissa.contiguous().clone(), h.exp_codes.contiguous().clone()
    sm.view(-1)[idx] = 0
    flat = codes.view(-1)  # flat index i's code: byte i // 2 (K is even), the low nibble for even i
    lo, hi = idx[idx % 2 == 0] // 2, idx[idx % 2 == 1] // 2   # each set names a byte at most once
    flat[lo] = flat[lo] & 0xF0
    flat[hi] = flat[hi] & 0x0F
    return Head12Device(
        sign_mantissa=sm, exp_codes=codes, tile_base=h.tile_base.contiguous(),
        esc_ptr=ptr.to(torch.int32), esc_row=rows.to(torch.int32), esc_col=(idx % k).to(torch.int32),
        esc_val=h.escape_value.float().contiguous(), shape=(v, k),
    )


def _check_planes(sm, codes, tb, esc_ptr, esc_row, esc_col, esc_val, device) -> tuple[int, int]:
    check_tensor("sign_mantissa", sm, torch.uint8, device=device)
    if sm.dim() != 2:
        raise ValueError(f"sign_mantissa: expected [V, K], found {tuple(sm.shape)}")
    v, k = sm.shape
    if v % TILE_ROWS or k % TILE_COLS:
        raise ValueError(f"sign_mantissa: expected V % {TILE_ROWS} == 0 and K % {TILE_COLS} == 0, found {(v, k)}")
    check_tensor("exp_codes", codes, torch.uint8, (v, k // 2), device)
    check_tensor("tile_base", tb, torch.uint8, (v // TILE_ROWS, k // TILE_COLS), device)
    check_tensor("esc_ptr", esc_ptr, torch.int32, (v + 1,), device)
    e = esc_row.numel()
    check_tensor("esc_row", esc_row, torch.int32, (e,), device)
    check_tensor("esc_col", esc_col, torch.int32, (e,), device)
    check_tensor("esc_val", esc_val, torch.float32, (e,), device)
    for name, t in (("sign_mantissa", sm), ("exp_codes", codes), ("tile_base", tb)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    return v, k


def head12_argmax(x: torch.Tensor, sign_mantissa: torch.Tensor, exp_codes: torch.Tensor, tile_base: torch.Tensor,
                  esc_ptr: torch.Tensor, esc_row: torch.Tensor, esc_col: torch.Tensor, esc_val: torch.Tensor,
                  ids: torch.Tensor, best: torch.Tensor, workspace: HB.HeadWorkspace, index_offset: int,
                  config: HB.HeadConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw call. Writes and returns (ids, best)."""
    v, k = _check_planes(sign_mantissa, exp_codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, x.device)
    if config.BN % TILE_ROWS or config.BK != TILE_COLS:
        raise ValueError(f"config: head12 needs BN % {TILE_ROWS} == 0 and BK == {TILE_COLS} (one tile base per row "
                         f"and K step), found {config}")
    return HB.launch_head(x, sign_mantissa.view(torch.int16), exp_codes, tile_base, esc_ptr, esc_row, esc_col, esc_val,
                          ids, best, workspace, index_offset, head12=True, v=v, k=k, cfg=config)


def head12_weight(sm, codes, tb, esc_row, esc_col, esc_val) -> torch.Tensor:
    """The exact bf16 weight the planes encode, via the format reference (decode_head12)."""
    v, k = sm.shape
    h = Head12(sign_mantissa=sm, exp_codes=codes, tile_base=tb,
               escape_index=esc_row.long() * k + esc_col.long(), escape_value=esc_val.to(torch.bfloat16), shape=(v, k))
    return decode_head12(h)


def head12_reference(x, sign_mantissa, exp_codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, ids=None, best=None,
                     workspace=None, index_offset=0, config=None) -> torch.Tensor:
    """fp32 logits [M, V] = x.float() @ decode_head12(W).float().T in true fp32."""
    w = head12_weight(sign_mantissa, exp_codes, tile_base, esc_row, esc_col, esc_val)
    with true_fp32():
        return x.float() @ w.float().T


def head12_stock(x, sign_mantissa, exp_codes, tile_base, esc_ptr, esc_row, esc_col, esc_val, ids=None, best=None,
                 workspace=None, index_offset=0, config=None) -> torch.Tensor:
    """Without this kernel: decode to bf16 (already resident in practice), bf16 logits, argmax."""
    w = head12_weight(sign_mantissa, exp_codes, tile_base, esc_row, esc_col, esc_val)
    return torch.argmax(x @ w.T, dim=-1) + index_offset


def compare(out, logits, case: Case) -> None:
    """As head.bf16 (the compare_argmax bands), with |W| from the exact decoded weight."""
    x = case.args[0]
    w = head12_weight(*case.args[1:4], *case.args[5:8])
    with true_fp32():
        absprod = x.float().abs() @ w.float().abs().T
    HB.compare_argmax("head.head12", out, logits, absprod, x.shape[1], case.args[11])


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    v, k = cell.shape
    cfg: HB.HeadConfig = cell.config["head"]
    if gen is None:  # warmup / compile check: zero planes and an empty escape list (no data-dependent ops)
        z = torch.zeros(0, dtype=torch.int32, device=device)
        h = Head12Device(torch.zeros(v, k, dtype=torch.uint8, device=device),
                         torch.zeros(v, k // 2, dtype=torch.uint8, device=device),
                         torch.zeros(v // TILE_ROWS, k // TILE_COLS, dtype=torch.uint8, device=device),
                         torch.zeros(v + 1, dtype=torch.int32, device=device), z, z,
                         torch.zeros(0, dtype=torch.float32, device=device), (v, k))
    else:
        h = prepare_head12(encode_head12(HB.random_head_weight(v, k, device, gen)))
    x = fresh_x(rows, k, device, gen)
    ids, best, ws = HB.head_case_io(cfg, rows, v, device)
    offset = 0 if gen is None else int(torch.randint(0, 3, (), generator=gen)) * v
    return Case(args=(x, *h.args(), ids, best, ws, offset, cfg), kwargs={},
                bytes_moved=v * k * 3 // 2 + h.esc_row.numel() * 12 + rows * k * 2)


CELLS = HB.head_cells("M3 LM head as head12 (1.5 B/weight)")
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(192, 256), why="interpreter: 3 programs, escapes, BM 16", config={"head": HB.HeadConfig(BM=16)}),
    Cell(rows=(20, 20), shape=(128, 128), why="interpreter: BM 32", config={"head": HB.HeadConfig(BM=32)}),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        head12_argmax(*make_case(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="head.head12", kind="head.head12", raw_call=head12_argmax, reference=head12_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=head12_stock,
)
ENTRIES = (ENTRY,)
