"""Raw call of attn.paged (attention/paged.py): argument checks, tile config, workspace and the
split-count heuristic around the two launches of attention/_paged.py.

Semantics (the reference, attention/_paged_ref.py): query row t of sequence s sits at position
p = L - n + i (L = seq_lens[s], n its query count, i its index); head h (group g = h // (Hq/Hk))
attends to keys j <= p, and with `sel` only to keys in the blocks sel[t, g] lists. K and V are
decoded exactly as PagedKVCache.read(..., torch.bfloat16) does; scores = fp32 q.k * sm_scale,
fp32 softmax, out = bf16(sum p v). A sequence with seq_len 0 is padding: its rows get zeros.

Shape legend:
    q             [T, Hq, D]           bf16 (unit column stride)
    k/v_pages     [slots, Hk, P, Dc]   PagedKVCache.pages(layer, "k"/"v"): bf16, fp32,
                                       float8_e4m3fn, or uint8 packed NVFP4 (Dc = D/2)
    k/v_scale     [slots, Hk, P*D/16]  float8_e4m3fn NVFP4 block scales, else None
    kv_gs         [2]                  fp32 NVFP4 ENCODE scales of K and V (kv.kv_global_scale[layer]);
                                       None for other formats
    slot_table    [S, B] int32;  seq_lens [S] int32;  query_start [S+1] int32
    sel           [T, Hk, topk] int32  selected block ids, ascending, -1 padded; None = dense causal
    out           [T, Hq, D]           bf16
    workspace     make_workspace(max_rows, Hq, D, num_splits): acc [NS, T, Hq, D], ml [NS, T, Hq, 2],
                                       count [T, Hq] int32 (zero between calls; the split merging last resets it)
    rot_matrix    [D, D] bf16          a rotated NVFP4 layer's kv.kv_rotation_matrix (m3serve.kv.rotation), else
                                       None: the pages hold K/V in the rotated basis; q is rotated and the output
                                       un-rotated inside the split kernel
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from m3serve.kernels._jit import is_compiled
from m3serve.kernels.attention._kv_tiles import KV_BF16, KV_FP8, KV_FP32, KV_NVFP4
from m3serve.kernels.attention._paged import paged_attn_combine, paged_attn_split
from m3serve.kernels.attention._paged_ref import AttnReference, paged_attention_reference
from m3serve.kernels.catalog import check_tensor

FMT_CODES = {"nvfp4": KV_NVFP4, "fp8": KV_FP8, "bf16": KV_BF16, "fp32": KV_FP32}
FMT_NAMES = {v: k for k, v in FMT_CODES.items()}
_CONTAINER = {"nvfp4": torch.uint8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
N_SM = 132  # H200 multiprocessors
MAX_SPLITS = 64  # caps the fp32 partial traffic (Hq*D*4 bytes written + read per split and row)
SPLITS_ROUND_UP = False  # choose_num_splits' rule before the one-wave rule (bench/decode.py route target-splits-up)
# Who merges the splits: the last split of each (row, KV head) to finish (one launch), at most MERGE_IN_SPLIT_MAX
# splits; above it the combine launch (paged_attn_combine, one program per (row, head)). Measured on the H200
# (bench/paged_attention.py --combine-launch both, paged_attention/paged-attention-h200-combine-fold.json): the one
# CTA's merge wins where each group has few splits (16 rows at 4 splits: 56.4 vs 59.8 µs MSA, 36.0 vs 39.2 µs dense;
# 8 rows at 8 splits: 34.4 vs 35.6 µs) and loses where one row's 16-64 live splits all land on it (MSA at one row,
# 16 splits: 20.4 vs 19.4 µs; dense at 32k, 64 splits: 32.5 vs 28.4 µs).
MERGE_IN_SPLIT_MAX = 8
COMBINE_LAUNCH = False  # True: always the combine launch (bench/decode.py route target-combine-launch, side by side)
# False: MSA rows walk only the selection slots that can hold a block (min(top-k, last // P + 1)), True: all top-k
# slots, -1 padding included (as before the bound; bench/decode.py routes target-msa-bound / target-msa-walk-all,
# side by side). The skipped slots contribute nothing, but fewer tiles change how they are shared among the splits,
# so the two walks sum in different orders
SEL_WALK_ALL = False


def merges_in_split(num_splits: int) -> bool:
    """Whether the split kernel merges a launch of `num_splits` splits itself (else, with > 1, the combine launch)."""
    return 1 < num_splits <= MERGE_IN_SPLIT_MAX and not COMBINE_LAUNCH


COMBINE_SP = triton.next_power_of_2(MAX_SPLITS)   # the combine's (m, l) vector: one variant for every split count
MMA_ROWS = 64  # a multi-token block stacks up to this many (query token, head) rows


@dataclass
class AttnWorkspace:
    acc: torch.Tensor  # fp32 [NS, max_rows, Hq, D] (1 element when NS = 1: unused)
    ml: torch.Tensor  # fp32 [NS, max_rows, Hq, 2]
    num_splits: int
    max_rows: int
    count: torch.Tensor | None = None  # int32 [max_rows, Hq] zeros: the splits' arrival tickets (None when NS = 1)


def make_workspace(max_rows: int, hq: int, d: int, num_splits: int, device: torch.device) -> AttnWorkspace:
    """Per call site, allocated once before graph capture; serves any T <= max_rows."""
    for name, v in (("max_rows", max_rows), ("hq", hq), ("d", d), ("num_splits", num_splits)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, found {v!r}")
    if num_splits * max_rows * hq * d >= 2**31:
        raise ValueError(f"make_workspace: {num_splits} splits x {max_rows} rows x {hq} heads x {d} exceeds the "
                         "int32 offsets of the kernels; lower num_splits or max_rows")
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits: at most MAX_SPLITS = {MAX_SPLITS} (paged_attn_combine reads every split's "
                         f"(m, l) in one load), found {num_splits}")
    if num_splits == 1:
        acc = torch.empty(1, dtype=torch.float32, device=device)
        ml = torch.empty(1, dtype=torch.float32, device=device)
        count = None
    else:
        acc = torch.empty(num_splits, max_rows, hq, d, dtype=torch.float32, device=device)
        ml = torch.empty(num_splits, max_rows, hq, 2, dtype=torch.float32, device=device)
        count = torch.zeros(max_rows, hq, dtype=torch.int32, device=device)
    return AttnWorkspace(acc=acc, ml=ml, num_splits=num_splits, max_rows=max_rows, count=count)


def choose_num_splits(batch: int, max_blocks: int, sms: int = N_SM, kv_heads: int = 1,
                      min_blocks_per_split: int = 2) -> int:
    """Splits per (query row, KV head) for a call site: as many programs as 2 per SM without going over
    (batch * kv_heads * splits <= 2 * sms while batch * kv_heads <= 2 * sms), at least min_blocks_per_split key
    blocks per split (2 for dense attention; 1 suits MSA, whose top-k blocks are few), at most MAX_SPLITS.
    batch = query rows of the step; max_blocks = the key blocks one row may visit (B of the slot
    table for dense attention, topk for MSA). Measured on the H200 (bench/paged_attention.py):
    more splits than this only add fp32 partial traffic (each split writes T x Hq x D). Why not over: the
    M3 split launches hold 2 CTAs an SM (168-255 registers a thread, python -m m3serve.kernels.aot_check
    --entry attn.paged --waves 1,8), so rounding the split count up (8 MSA rows: 9 splits, 288 CTAs) ran a
    second wave of 24 CTAs behind the first."""
    for name, v in (("batch", batch), ("max_blocks", max_blocks), ("sms", sms), ("kv_heads", kv_heads),
                    ("min_blocks_per_split", min_blocks_per_split)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, found {v!r}")
    want = -(-2 * sms // (batch * kv_heads)) if SPLITS_ROUND_UP else 2 * sms // (batch * kv_heads)
    return max(1, min(want, max_blocks // min_blocks_per_split, MAX_SPLITS))


@dataclass(frozen=True)
class TileConfig:
    QB: int  # query tokens of one sequence per program
    BM: int  # MMA rows: QB * G padded to a power of two >= 16
    BN: int  # keys per tile (divides the page)
    num_warps: int
    num_stages: int
    # FP8 pages only, compiled only: read K/V as 16-bit column pairs and convert each pair in registers
    # (sweep-only: fewer shared-memory loads in the SASS, but no faster on the H200; docs/kernels.md)
    PAIRS: bool = False


def tile_config(g: int, p: int, max_query_len: int, sparse: bool, nvfp4: bool = False) -> TileConfig:
    """Decode and MSA rows are one token per program (each MSA row has its own block list);
    dense multi-token steps stack the tokens of a sequence so that a key tile is read once for
    all of them. Key tiles: a whole 128-token page with 2 stages for one-token rows (BM 16) on
    bf16/fp8/fp32 pages, the best of the H200 sweep in bench/paged_attention_sweep.sh; half a page
    with 3 stages for NVFP4 and for stacked multi-token rows, whose registers a 128-key tile
    would spill (aot_check)."""
    qb = 1
    if not sparse and max_query_len > 1:
        qb = min(triton.next_power_of_2(max_query_len), max(1, MMA_ROWS // g))
    bm = max(16, triton.next_power_of_2(qb * g))
    bn, stages = (min(p, 64), 3) if nvfp4 or bm > 16 else (min(p, 128), 2)
    return TileConfig(QB=qb, BM=bm, BN=bn, num_warps=4 if bm <= 32 else 8, num_stages=stages)


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive int, found {v!r}")
    return v


def _check(q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table, seq_lens, query_start, sel, out, workspace,
           fmt, sm_scale, max_query_len, num_splits, rot_matrix=None) -> tuple[int, int, int, int, int, int, int]:
    if fmt not in FMT_CODES:
        raise ValueError(f"fmt: expected one of {tuple(FMT_CODES)}, found {fmt!r}")
    check_tensor("q", q)
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q: expected dtype torch.bfloat16, found {q.dtype}")
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q: expected [T, Hq, D] with unit column stride, found shape {tuple(q.shape)} "
                         f"strides {tuple(q.stride())}")
    t_rows, hq, d = q.shape
    dev = q.device
    if d % 16 or d & (d - 1):
        raise ValueError(f"q: expected a head dim D that is a power of two >= 16, found D={d}")
    want_dtype = _CONTAINER[fmt]
    for name, pg in (("k_pages", k_pages), ("v_pages", v_pages)):
        check_tensor(name, pg, want_dtype, device=dev)
        if pg.dim() != 4:
            raise ValueError(f"{name}: expected [slots, Hk, P, Dc], found shape {tuple(pg.shape)}")
    slots, hk, p, dc = k_pages.shape
    want_dc = d // 2 if fmt == "nvfp4" else d
    if dc != want_dc:
        raise ValueError(f"k_pages: expected Dc = {want_dc} for fmt {fmt} and D = {d}, found {dc}")
    check_tensor("v_pages", v_pages, shape=tuple(k_pages.shape))
    for name, pg in (("k_pages", k_pages), ("v_pages", v_pages)):
        if pg.stride(3) != 1 or pg.stride(2) != dc:
            raise ValueError(f"{name}: expected each page [P, Dc] contiguous, found strides {tuple(pg.stride())}")
    if hq % hk:
        raise ValueError(f"q: expected Hq a multiple of the KV heads Hk = {hk}, found Hq = {hq}")
    if p & (p - 1):
        raise ValueError(f"k_pages: expected a power-of-two page size P, found {p}")
    if fmt == "nvfp4":
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(name, sc, torch.float8_e4m3fn, (slots, hk, p * d // 16), dev)
            if sc.stride(2) != 1:
                raise ValueError(f"{name}: expected a unit last stride, found strides {tuple(sc.stride())}")
        check_tensor("kv_gs", kv_gs, torch.float32, (2,), dev)
        if p % 4:
            raise ValueError(f"k_pages: NVFP4 V scales come in 4-token quads, found page size {p}")
    else:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is not None:
                raise ValueError(f"{name}: expected None for fmt {fmt}, found a tensor")
    if rot_matrix is not None:
        if fmt != "nvfp4":
            raise ValueError(f"rot_matrix: the K/V rotation applies to NVFP4 layers, found fmt {fmt!r}")
        check_tensor("rot_matrix", rot_matrix, torch.bfloat16, (d, d), dev)
        if not rot_matrix.is_contiguous():
            raise ValueError(f"rot_matrix: expected a contiguous [D, D], found strides {tuple(rot_matrix.stride())}")
    check_tensor("slot_table", slot_table, torch.int32, device=dev)
    if slot_table.dim() != 2 or not slot_table.is_contiguous():
        raise ValueError(f"slot_table: expected a contiguous [S, B], found shape {tuple(slot_table.shape)} "
                         f"strides {tuple(slot_table.stride())}")
    n_seq = slot_table.shape[0]
    check_tensor("seq_lens", seq_lens, torch.int32, (n_seq,), dev)
    check_tensor("query_start", query_start, torch.int32, (n_seq + 1,), dev)
    if n_seq < 1 or slot_table.shape[1] < 1:
        raise ValueError(f"slot_table: expected at least one sequence and one block, found {tuple(slot_table.shape)}")
    topk = 0
    if sel is not None:
        check_tensor("sel", sel, torch.int32, device=dev)
        if sel.dim() != 3 or tuple(sel.shape[:2]) != (t_rows, hk) or sel.stride(2) != 1:
            raise ValueError(f"sel: expected [T, Hk, topk] = [{t_rows}, {hk}, topk] with unit last stride, found "
                             f"shape {tuple(sel.shape)} strides {tuple(sel.stride())}")
        topk = sel.shape[2]
        if topk < 1:
            raise ValueError("sel: expected topk >= 1 selected blocks per row, found 0")
    check_tensor("out", out, torch.bfloat16, (t_rows, hq, d), dev)
    if out.stride(2) != 1:
        raise ValueError(f"out: expected a unit column stride, found strides {tuple(out.stride())}")
    if not isinstance(sm_scale, float) or not sm_scale > 0:
        raise ValueError(f"sm_scale: expected a positive float, found {sm_scale!r}")
    _positive_int("max_query_len", max_query_len)
    _positive_int("num_splits", num_splits)
    if not isinstance(workspace, AttnWorkspace):
        raise TypeError(f"workspace: expected an AttnWorkspace (make_workspace), found {type(workspace).__name__}")
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits: at most MAX_SPLITS = {MAX_SPLITS}, found {num_splits}")
    if num_splits > 1:
        if workspace.num_splits < num_splits or workspace.max_rows < t_rows:
            raise ValueError(f"workspace: expected >= {num_splits} splits and >= {t_rows} rows, found "
                             f"{workspace.num_splits} splits and {workspace.max_rows} rows")
        for name, need in (("acc", num_splits * t_rows * hq * d), ("ml", num_splits * t_rows * hq * 2)):
            w = getattr(workspace, name)
            if w.dtype != torch.float32 or w.device != dev or not w.is_contiguous() or w.numel() < need:
                raise ValueError(f"workspace.{name}: expected contiguous torch.float32 with >= {need} elements on "
                                 f"{dev} (make_workspace), found {w.dtype} {tuple(w.shape)} on {w.device}")
        c = workspace.count
        if (c is None or c.dtype != torch.int32 or c.device != dev or not c.is_contiguous()
                or c.numel() < t_rows * hq):
            raise ValueError(f"workspace.count: expected contiguous zero-filled torch.int32 with >= {t_rows * hq} "
                             f"elements on {dev} (make_workspace), found "
                             f"{None if c is None else (c.dtype, tuple(c.shape), str(c.device))}")
    return t_rows, hq, hk, d, p, n_seq, topk


def paged_attention(q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table, seq_lens, query_start, sel, out,
                    workspace, *, fmt: str, sm_scale: float, max_query_len: int, num_splits: int,
                    tile: TileConfig | None = None, rot_matrix: torch.Tensor | None = None) -> torch.Tensor:
    """Raw call: one split launch (grid T x Hk x num_splits); with 2..MERGE_IN_SPLIT_MAX splits the last split of
    each (row, KV head) to finish merges them, with more (or COMBINE_LAUNCH) a second launch (grid T x Hq) does.
    Writes and returns `out`. No host sync, no allocation.
    tile: a TileConfig in place of tile_config()'s choice (tile sweeps; QB and BM must match it)."""
    t_rows, hq, hk, d, p, n_seq, topk = _check(q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table, seq_lens,
                                               query_start, sel, out, workspace, fmt, sm_scale, max_query_len,
                                               num_splits, rot_matrix)
    g = hq // hk
    cfg = tile_config(g, p, max_query_len, topk > 0, fmt == "nvfp4")
    if tile is not None:
        if (tile.QB, tile.BM) != (cfg.QB, cfg.BM) or p % tile.BN or tile.BN & (tile.BN - 1):
            raise ValueError(f"tile: expected QB={cfg.QB}, BM={cfg.BM} and a power-of-two BN dividing the page "
                             f"({p}), found {tile}")
        cfg = tile
    if cfg.PAIRS and not (fmt == "fp8" and is_compiled(q)):
        raise ValueError(f"tile.PAIRS: FP8 pages on a compiled (CUDA) launch only, found fmt {fmt!r} on "
                         f"{q.device.type}")
    code = FMT_CODES[fmt]
    # fp8 travels as bytes (the interpreter has no fp8 pointers; compiled code bitcasts them back)
    pair = torch.int16 if cfg.PAIRS else torch.uint8
    kp = k_pages.view(pair) if fmt == "fp8" else k_pages
    vp = v_pages.view(pair) if fmt == "fp8" else v_pages
    ks = k_scale.view(torch.uint8) if fmt == "nvfp4" else kp  # unused pointers otherwise
    vs = v_scale.view(torch.uint8) if fmt == "nvfp4" else vp
    gs = kv_gs if fmt == "nvfp4" else seq_lens
    sel_t = sel if sel is not None else slot_table
    sel_strides = (sel.stride(0), sel.stride(1)) if sel is not None else (0, 0)
    scale_strides = ((ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1)) if fmt == "nvfp4" else (0, 0, 0, 0))
    qk_scale = float(sm_scale * math.log2(math.e))
    cuda = is_compiled(q)
    rot = rot_matrix if rot_matrix is not None else q
    merge_in_split = merges_in_split(num_splits)
    count = workspace.count if workspace.count is not None else seq_lens  # unused pointer when NS = 1
    paged_attn_split[(t_rows, hk, num_splits)](
        q, kp, vp, ks, vs, gs, rot, slot_table, seq_lens, query_start, sel_t, out, workspace.acc, workspace.ml,
        count, n_seq, t_rows, slot_table.shape[1], qk_scale, num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1), *scale_strides, *sel_strides,
        FMT=code, HQ=hq, G=g, D=d, P=p, BN=cfg.BN, BM=cfg.BM, QB=cfg.QB, TOPK=topk, SPLIT=num_splits > 1,
        CUDA=cuda, F16=cuda and fmt == "fp8", PAIRS=cfg.PAIRS, ROT=rot_matrix is not None, COMBINE=merge_in_split,
        WALK_ALL=SEL_WALK_ALL, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1 and not merge_in_split:
        paged_attn_combine[(t_rows, hq)](
            workspace.acc, workspace.ml, out, t_rows, num_splits, out.stride(0), out.stride(1), HQ=hq, D=d,
            SP=COMBINE_SP, SC=16, CUDA=cuda, num_warps=4)
    return out


def paged_attention_stock(q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table, seq_lens, query_start, sel,
                          out=None, workspace=None, **kw) -> torch.Tensor:
    """The stock path's arithmetic: gather + decode per sequence, fp32 attention, one bf16 rounding."""
    ref: AttnReference = paged_attention_reference(q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table,
                                                   seq_lens, query_start, sel, **kw)
    return ref.out.to(torch.bfloat16)
