"""attn.paged under the Triton interpreter at tiny shapes (D 32, P 16, Hq 4, Hk 2).

Every case is a real PagedKVCache (two layers, the second MSA) whose pages are scattered randomly
over the pool; K/V are written with the cache's own write() (so each format is quantized by its
codec), every other byte of the pool is random junk (NaN codes included), outputs and split
workspaces start as NaN. Checked with the entry's compare (fp32 reference, stated band) and with
an fp64 attention under a tight band (one bf16 rounding + 2**-12 vbar, see tight_check).
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from m3serve.kernels.attention import paged as PA
from m3serve.kernels._jit import is_compiled, kernel
from m3serve.kernels.attention._kv_tiles import load_dense_tile, load_nvfp4_tile, nvfp4_columns
from m3serve.kernels.attention._paged_case import CaseShape, build_case, resample_step
from m3serve.kernels.attention._paged_ref import AttnReference, gather_tokens
from m3serve.kernels.catalog import assert_band
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.spec import KVCacheSpec
from m3serve.model import msa

CPU = torch.device("cpu")
ENTRY = PA.ENTRY
FMTS = ("bf16", "fp32", "fp8", "nvfp4")


def key(fmt: str, topk: int = 0, hq: int = 4, hk: int = 2, d: int = 32, p: int = 16) -> tuple[int, ...]:
    return (PA.FMT_CODES[fmt], hq, hk, d, p, topk)


# --- helpers shared with the GPU tests ------------------------------------------------------


def attention_fp64(case) -> torch.Tensor:
    """The same attention as the reference, in float64 on the decoded bf16 K/V: [T, Hq, D]."""
    q, k_pages, v_pages, k_scale, v_scale, kv_gs, slot_table, seq_lens, query_start, sel = case.args[:10]
    fmt, scale = case.kwargs["fmt"], case.kwargs["sm_scale"]
    t_rows, hq, d = q.shape
    hk, p = k_pages.shape[1], k_pages.shape[2]
    g = hq // hk
    out = torch.zeros(t_rows, hq, d, dtype=torch.float64, device=q.device)
    qs, lens = query_start.tolist(), seq_lens.tolist()
    for s, length in enumerate(lens):
        n = qs[s + 1] - qs[s]
        if n == 0 or length == 0:
            continue
        slots = slot_table[s, :-(-length // p)].long()
        gk = kv_gs[0] if fmt == "nvfp4" else None
        gv = kv_gs[1] if fmt == "nvfp4" else None
        k = gather_tokens(k_pages, k_scale, gk, slots, length, fmt, "k").double()
        v = gather_tokens(v_pages, v_scale, gv, slots, length, fmt, "v").double()
        qr = q[qs[s]:qs[s + 1]].double().view(n, hk, g, d)
        sc = torch.einsum("nhgd,lhd->nhgl", qr, k) * scale
        pos = torch.arange(length - n, length, device=q.device)
        allowed = torch.arange(length, device=q.device).view(1, 1, 1, length) <= pos.view(n, 1, 1, 1)
        if sel is not None:
            m = msa.selection_mask(sel[qs[s]:qs[s + 1]].permute(1, 0, 2)[None].long(), length, p)[0]  # [Hk, n, L]
            allowed = allowed & m.permute(1, 0, 2)[:, :, None, :]
        pr = torch.softmax(sc.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        out[qs[s]:qs[s + 1]] = torch.einsum("nhgl,lhd->nhgd", pr, v).reshape(n, hq, d)
    return out


def tight_check(out: torch.Tensor, exact: torch.Tensor, ref: AttnReference) -> None:
    """|out - exact| <= 2**-8 |exact| + 2**-12 vbar: the final bf16 rounding (half an ulp) plus
    the kernel's fp32 error, which in practice is ~sqrt(keys) u, far below 2**-12 (the entry's
    compare states the worst-case bound instead). Catches a dropped or doubled key tile that a
    worst-case band at long contexts could hide."""
    band = 2.0**-8 * exact.abs() + 1.01 * 2.0**-12 * ref.vbar.double() + 1e-30
    assert_band("attn.paged vs fp64", out.double(), exact, band)


@kernel
def _decode_pages(x_ptr, s_ptr, gs_ptr, out_ptr, stride_slot, stride_h, stride_sslot, stride_sh, HK,
                  FMT: tl.constexpr, IS_V: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BN: tl.constexpr,
                  CUDA: tl.constexpr):
    """Page (program 0) / head (program 1) -> fp32 out [slots * P, Hk, D] through the tile decoders."""
    page = tl.program_id(0)
    h = tl.program_id(1)
    for t0 in tl.static_range(0, P, BN):
        tok = t0 + tl.arange(0, BN)
        ok = tok < P
        base = x_ptr + page * stride_slot + h * stride_h
        row = out_ptr + ((page * P + tok) * HK + h) * D
        if FMT == 0:
            lo, hi = load_nvfp4_tile(base, s_ptr + page * stride_sslot + h * stride_sh, tl.load(gs_ptr), tok, ok,
                                     IS_V, D, BN, CUDA)
            cols = nvfp4_columns(D // 2)
            tl.store(row[:, None] + cols[None, :], lo.to(tl.float32))
            tl.store(row[:, None] + cols[None, :] + 1, hi.to(tl.float32))
        else:
            x = load_dense_tile(base, tok, ok, FMT, D, CUDA)
            tl.store(row[:, None] + tl.arange(0, D)[None, :], x.to(tl.float32))


def decoded_page_matches_cache(fmt: str, device: torch.device, hk: int = 2, d: int = 64, p: int = 32) -> None:
    """Every token of every page decoded by the kernels' tile decoders equals
    PagedKVCache.read(..., torch.bfloat16) bit for bit, K and V, on values spread over many
    binades (NVFP4: per-block magnitudes 2**-14..2**4, so E4M3 subnormal and zero scales occur;
    fp8: subnormals and saturation; exact zeros and negative zeros included)."""
    kv_dtype, model = {"bf16": ("bf16", torch.bfloat16), "fp32": ("auto", torch.float32),
                       "fp8": ("fp8", torch.bfloat16), "nvfp4": ("nvfp4", torch.bfloat16)}[fmt]
    spec = KVCacheSpec(page_size=p, num_layers=2, sparse_layers=(1,), num_kv_heads=hk, head_dim=d, index_head_dim=16,
                       kv_cache_dtype=kv_dtype, model_dtype=model)
    num_slots = 5
    cache = PagedKVCache(spec, num_slots, device)
    gen = torch.Generator().manual_seed(hash(fmt) & 0xFFFF)
    n_tok = num_slots * p
    x = torch.randn(2, n_tok, hk, d, generator=gen)
    x = x * torch.exp2(torch.randint(-14, 5, (2, n_tok, hk, d // 16, 1), generator=gen).float()).repeat_interleave(
        16, -1).view(2, n_tok, hk, d)
    x[:, ::7] = 0.0
    x[:, 3::11, 0, :16] = -0.0
    if fmt == "fp8":
        x = x * 2.0**6  # fp8 is unscaled: reach saturation (448) and subnormals (< 2**-6)
    cache.set_nvfp4_amax(1, 12.0, 20.0) if fmt == "nvfp4" else None
    flat = torch.arange(n_tok, dtype=torch.int64, device=device)
    cache.write(1, flat, x[0].to(device), x[1].to(device), torch.randn(n_tok, 16).to(device))
    want_k, want_v, _ = cache.read(1, torch.arange(num_slots, device=device), n_tok, torch.bfloat16)
    code = PA.FMT_CODES[fmt]
    for role, want in (("k", want_k), ("v", want_v)):
        pages = cache.pages(1, role)
        pages = pages.view(torch.uint8) if fmt == "fp8" else pages
        sc = cache.pages(1, f"{role}_scale").view(torch.uint8) if fmt == "nvfp4" else pages
        gs = cache.kv_global_scale[1, 0 if role == "k" else 1:].contiguous()
        out = torch.full((n_tok, hk, d), float("nan"), device=device)
        _decode_pages[(num_slots, hk)](pages, sc, gs, out, pages.stride(0), pages.stride(1), sc.stride(0), sc.stride(1),
                                       hk, FMT=code, IS_V=role == "v", D=d, P=p, BN=min(p, 16),
                                       CUDA=is_compiled(pages))
        got = out.to(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
            f"{fmt} {role}: {int((got.view(torch.int16) != want.view(torch.int16)).sum())} decoded values differ"


def _run(shape_key, rows: int, cs: CaseShape, seed: int):
    pc = build_case(shape_key, rows, CPU, torch.Generator().manual_seed(seed), cs)
    out = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
    ref = ENTRY.reference(*pc.case.args, **pc.case.kwargs)
    return pc, out, ref


def _check(pc, out, ref) -> None:
    ENTRY.compare(out, ref, pc.case)
    tight_check(out, attention_fp64(pc.case), ref)


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_tile_decoders_equal_cache_read_bitwise(fmt: str) -> None:
    decoded_page_matches_cache(fmt, CPU)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_reference_gather_equals_cache_read(fmt: str) -> None:
    pc, _, _ = _run(key(fmt, 2), 1, CaseShape(batch=2, context=40, num_splits=1), seed=4)
    q, kp, vp, ks, vs, gs, table, lens = pc.case.args[:8]
    for s, length in enumerate(lens.tolist()):
        if length == 0:
            continue
        slots = torch.tensor(pc.slots[s], dtype=torch.int64)
        want_k, want_v, _ = pc.cache.read(pc.layer, slots, length, torch.bfloat16)
        got_k = gather_tokens(kp, ks, gs[0] if gs is not None else None, slots, length, fmt, "k")
        got_v = gather_tokens(vp, vs, gs[1] if gs is not None else None, slots, length, fmt, "v")
        assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
        assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))


DENSE = [("bf16", 1, 3), ("bf16", 3, 1), ("fp32", 2, 2), ("fp8", 1, 4), ("fp8", 4, 2), ("nvfp4", 2, 3)]


@pytest.mark.parametrize("fmt,rows,splits", DENSE, ids=[f"{f}-n{r}-s{s}" for f, r, s in DENSE])
def test_dense_causal_several_sequences(fmt: str, rows: int, splits: int) -> None:
    """4 sequences of different lengths (the first exactly 70 keys, others 1..70) and query
    counts (1..rows: decode and verify rows in one step), plus a padding sequence."""
    pc, out, ref = _run(key(fmt), rows, CaseShape(batch=4, context=70, num_splits=splits), seed=rows * 10 + splits)
    assert pc.case.args[7].tolist()[-1] == 0, "the last sequence is padding"
    _check(pc, out, ref)
    pad_rows = slice(pc.case.args[8].tolist()[-2], None)
    assert bool((out[pad_rows] == 0).all()), "padding rows get zeros"


SPARSE = [("bf16", 3, 1, 2), ("fp32", 2, 2, 1), ("fp8", 4, 1, 3), ("nvfp4", 3, 2, 2), ("nvfp4", 1, 1, 4)]


@pytest.mark.parametrize("fmt,topk,rows,splits", SPARSE, ids=[f"{f}-k{k}-n{r}-s{s}" for f, k, r, s in SPARSE])
def test_msa_sparse_random_selections(fmt: str, topk: int, rows: int, splits: int) -> None:
    pc, out, ref = _run(key(fmt, topk), rows, CaseShape(batch=3, context=90, num_splits=splits),
                        seed=topk * 100 + rows * 10 + splits)
    sel = pc.case.args[9]
    assert bool((sel == -1).any()), "some selections are -1 padded"
    _check(pc, out, ref)


@pytest.mark.parametrize("walk_all", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
def test_msa_rows_walk_only_the_slots_that_can_hold_a_block(monkeypatch, walk_all: bool, rows: int) -> None:
    """A context of 2-3 pages under a top-8 selection: the tile walk bounded by min(top-k, last // P + 1) slots
    (the default) and the walk over every slot, -1 padding included (SEL_WALK_ALL, the bench's side-by-side), both
    meet the reference and the float64 check; they split the tiles differently, so they are not compared bitwise."""
    from m3serve.kernels.attention import _paged_call
    monkeypatch.setattr(_paged_call, "SEL_WALK_ALL", walk_all)
    pc, out, ref = _run(key("nvfp4", 8), rows, CaseShape(batch=2, context=40, num_splits=4), seed=800 + rows)
    sel = pc.case.args[9]
    assert bool((sel == -1).any()), "the short contexts leave most of the 8 slots -1"
    _check(pc, out, ref)


def test_gqa_group_of_eight_and_wider_head_dim() -> None:
    """G = 8 (BM 16) with D = 64 and P = 32, a 2-token block (QB 2) over two splits."""
    pc, out, ref = _run(key("fp8", 0, hq=16, hk=2, d=64, p=32), 2, CaseShape(batch=2, context=100, num_splits=2), 8)
    _check(pc, out, ref)


def test_rows_past_the_last_sequence_get_zeros() -> None:
    pc, out, ref = _run(key("bf16"), 2, CaseShape(batch=2, context=30, num_splits=2, orphan_rows=3), seed=5)
    _check(pc, out, ref)
    assert bool((out[-3:] == 0).all())


def test_a_row_with_no_selected_block_gets_zeros() -> None:
    pc = build_case(key("fp8", 2), 1, CPU, torch.Generator().manual_seed(6), CaseShape(batch=2, context=50, num_splits=2))
    sel = pc.case.args[9]
    sel[0] = -1
    out = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
    ref = ENTRY.reference(*pc.case.args, **pc.case.kwargs)
    ENTRY.compare(out, ref, pc.case)
    assert bool((out[0] == 0).all())


def test_new_step_on_the_same_buffers() -> None:
    """The graph-replay situation under the interpreter: new lengths (some padding), queries and
    selections written into the same tensors."""
    pc, out, ref = _run(key("nvfp4", 3), 2, CaseShape(batch=3, context=64, num_splits=2), seed=12)
    _check(pc, out, ref)
    resample_step(pc, torch.Generator().manual_seed(13), pad_prob=0.4)
    out = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
    _check(pc, out, ENTRY.reference(*pc.case.args, **pc.case.kwargs))


def test_splits_are_deterministic() -> None:
    pc, out, _ = _run(key("bf16"), 1, CaseShape(batch=2, context=80, num_splits=3), seed=14)
    first = out.clone()
    pc.case.args[10].fill_(float("nan"))
    again = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
    assert torch.equal(again.view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("combine_launch", [False, True], ids=["merged-by-last-split", "combine-launch"])
def test_split_merge_in_the_kernel_and_in_a_second_launch(combine_launch: bool, monkeypatch) -> None:
    """Both merges of the splits meet the reference (they differ only in summation order), and the arrival
    counters are back at zero after the call, so the next call (a graph replay) starts from zero: a second call
    on the same workspace gives the same bits. 5 splits over 3 sequences of up to 80 keys: some splits of the
    short rows walk no tile (not read by the merge), a padding sequence, and NVFP4 MSA rows with -1 blocks."""
    monkeypatch.setattr("m3serve.kernels.attention._paged_call.COMBINE_LAUNCH", combine_launch)
    for k, seed in ((key("fp8"), 21), (key("nvfp4", 3), 22)):
        pc, out, ref = _run(k, 2, CaseShape(batch=3, context=80, num_splits=5), seed=seed)
        _check(pc, out, ref)
        ws = pc.case.args[11]
        assert ws.num_splits == 5 and ws.count is not None
        assert int(ws.count.abs().sum()) == 0, "every (row, KV head) counter is reset by its merging split"
        first = out.clone()
        pc.case.args[10].fill_(float("nan"))
        again = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
        assert torch.equal(again.view(torch.int16), first.view(torch.int16))


def test_who_merges_follows_the_split_count(monkeypatch) -> None:
    """Up to MERGE_IN_SPLIT_MAX splits the split kernel merges (no combine launch); above it the combine launch does.
    Both meet the reference."""
    from m3serve.kernels.attention import _paged_call
    launched = []
    real = _paged_call.paged_attn_combine

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(_paged_call, "paged_attn_combine", Spy())
    for splits, combine_launches in ((_paged_call.MERGE_IN_SPLIT_MAX, 0), (_paged_call.MERGE_IN_SPLIT_MAX + 1, 1)):
        launched.clear()
        pc, out, ref = _run(key("bf16"), 1, CaseShape(batch=2, context=200, num_splits=splits), seed=24 + splits)
        _check(pc, out, ref)
        assert len(launched) == combine_launches, (splits, launched)


def test_a_counter_left_nonzero_leaves_rows_unwritten() -> None:
    """The merge really is done by the LAST arrival: a counter one ticket ahead makes an earlier split believe it
    is last (it merges before the others wrote: NaN partials) or no split reach the count (rows never stored), so
    the compare fails. Guards the ticket arithmetic, which the reference alone would not see."""
    pc = build_case(key("bf16"), 1, CPU, torch.Generator().manual_seed(23), CaseShape(batch=2, context=70, num_splits=3))
    pc.case.args[11].count.fill_(1)
    out = ENTRY.raw_call(*pc.case.args, **pc.case.kwargs)
    ref = ENTRY.reference(*pc.case.args, **pc.case.kwargs)
    with pytest.raises(AssertionError):
        ENTRY.compare(out, ref, pc.case)


def test_compare_rejects_unwritten_and_shifted_outputs() -> None:
    pc, out, ref = _run(key("fp8"), 2, CaseShape(batch=2, context=60, num_splits=2), seed=15)
    ENTRY.compare(out, ref, pc.case)
    bad = out.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(AssertionError):
        ENTRY.compare(bad, ref, pc.case)
    # the first sequence with one key fewer (its last query now sees one key less): a wrong
    # causal bound must fail the compare
    args = list(pc.case.args)
    args[7] = args[7].clone()
    args[7][0] -= 1
    n0 = int(args[8][1] - args[8][0])
    shifted = ENTRY.reference(*args, **pc.case.kwargs).out
    bad = out.clone()
    bad[:n0] = shifted[:n0].to(torch.bfloat16)
    with pytest.raises(AssertionError):
        ENTRY.compare(bad, ref, pc.case)


def test_choose_num_splits() -> None:
    assert PA.choose_num_splits(1, 256, kv_heads=4) == 64  # 32k context, batch 1: 256 programs
    assert PA.choose_num_splits(16, 32, kv_heads=4) == 4  # 4k, batch 16: 256 programs (2 a SM: one wave)
    assert PA.choose_num_splits(64, 32, kv_heads=4) == 1
    assert PA.choose_num_splits(8, 32, kv_heads=4, min_blocks_per_split=1) == 8  # MSA at 8 rows: 256, not 288
    assert PA.choose_num_splits(1, 1, kv_heads=4) == 1  # one block: nothing to split
    assert PA.choose_num_splits(512, 1000, kv_heads=4) == 1
    with pytest.raises(ValueError, match=r"batch: expected a positive int, found 0"):
        PA.choose_num_splits(0, 4)


def test_bad_arguments_name_the_tensor() -> None:
    pc = build_case(key("nvfp4", 2), 1, CPU, torch.Generator().manual_seed(0), CaseShape(batch=1, context=20))
    a, kw = list(pc.case.args), dict(pc.case.kwargs)

    def call(i=None, v=None, **over):
        args = list(a)
        if i is not None:
            args[i] = v
        return ENTRY.raw_call(*args, **{**kw, **over})

    with pytest.raises(TypeError, match=r"q: expected dtype torch.bfloat16, found torch.float32"):
        call(0, a[0].float())
    with pytest.raises(ValueError, match=r"fmt: expected one of"):
        call(fmt="int4")
    with pytest.raises(TypeError, match=r"k_pages: expected dtype torch.float8_e4m3fn, found torch.uint8"):
        call(fmt="fp8")
    with pytest.raises(ValueError, match=r"k_scale: expected shape"):
        call(3, a[3][:, :, :-1])
    with pytest.raises(TypeError, match=r"seq_lens: expected dtype torch.int32, found torch.int64"):
        call(7, a[7].long())
    with pytest.raises(ValueError, match=r"query_start: expected shape \(3,\)"):
        call(8, a[8][:-1])
    with pytest.raises(ValueError, match=r"sel: expected \[T, Hk, topk\]"):
        call(9, a[9][:, :1])
    with pytest.raises(ValueError, match=r"num_splits: expected a positive int, found 0"):
        call(num_splits=0)
    with pytest.raises(ValueError, match=r"workspace: expected >= 4 splits"):
        call(num_splits=4)
    with pytest.raises(TypeError, match=r"workspace: expected an AttnWorkspace"):
        call(11, None)
    with pytest.raises(ValueError, match=r"num_splits: at most MAX_SPLITS = 64, found 65"):
        call(num_splits=65)
    with pytest.raises(ValueError, match=r"num_splits: at most MAX_SPLITS = 64"):
        PA.make_workspace(1, 4, 32, 65, CPU)
    ws = PA.make_workspace(a[0].shape[0], 4, 32, 2, CPU)
    ws.count = None
    with pytest.raises(ValueError, match=r"workspace.count: expected contiguous zero-filled torch.int32"):
        call(11, ws, num_splits=2)
    with pytest.raises(ValueError, match=r"sm_scale: expected a positive float"):
        call(sm_scale=0.0)


def test_tile_override_is_checked_and_pairs_need_compiled_fp8() -> None:
    """A tile override runs like tile_config's choice when it only changes BN / stages / warps; one whose QB / BM
    differ from the choice, or that asks for 16-bit FP8 pairs on the interpreter or on non-FP8 pages, raises."""
    from m3serve.kernels.attention._paged_call import TileConfig, tile_config
    pc = build_case(key("fp8", 2), 1, CPU, torch.Generator().manual_seed(21), CaseShape(batch=2, context=40))
    a, kw = pc.case.args, pc.case.kwargs
    hq, hk, p = a[0].shape[1], a[1].shape[1], a[1].shape[2]
    base = tile_config(hq // hk, p, kw["max_query_len"], False, False)
    ref = ENTRY.reference(*a, **kw)
    a[10].fill_(float("nan"))
    out = ENTRY.raw_call(*a, **kw, tile=TileConfig(QB=base.QB, BM=base.BM, BN=base.BN // 2, num_warps=2, num_stages=1))
    ENTRY.compare(out, ref, pc.case)
    with pytest.raises(ValueError, match=r"tile: expected QB="):
        ENTRY.raw_call(*a, **kw, tile=TileConfig(QB=base.QB, BM=2 * base.BM, BN=base.BN, num_warps=4, num_stages=2))
    with pytest.raises(ValueError, match=r"tile.PAIRS: FP8 pages on a compiled"):
        ENTRY.raw_call(*a, **kw, tile=TileConfig(QB=base.QB, BM=base.BM, BN=base.BN, num_warps=4, num_stages=2,
                                                 PAIRS=True))


# --- Hadamard-rotated NVFP4 layers ------------------------------------------------------------

ROTATED = [(3, 1, 1), (2, 2, 3), (4, 1, 2)]


@pytest.mark.parametrize("topk,rows,splits", ROTATED, ids=[f"k{k}-n{r}-s{s}" for k, r, s in ROTATED])
def test_rotated_nvfp4_matches_the_stock_cache_read(topk: int, rows: int, splits: int) -> None:
    """A rotated NVFP4 layer: the kernel (q rotated in its prologue, output un-rotated before the split store)
    within the entry's band, and against the stock path (PagedKVCache.read, which un-rotates K/V, then fp32
    attention with the model's q). The two differ by where the decode rounds: the kernel reads the rotated tiles
    decoded to bf16 (2**-9 relative per value), the stock read decodes to fp32. That moves each score by at most
    2**-9 qk_abs (the rotated-basis bound of the reference), so each p_j by a relative 2**-8 qk_abs (2**-7 with
    margin for exp's curvature), and each rotated V column by 2**-9, which un-rotation spreads as c_r sum_i
    vbar_rot_i; plus the output's own bf16 rounding, 2**-7 |exact|."""
    cs = CaseShape(batch=3, context=90, num_splits=splits, rotate=True)
    pc, out, ref = _run(key("nvfp4", topk), rows, cs, seed=topk * 100 + rows * 10 + splits + 7)
    assert pc.cache.spec.is_rotated(pc.layer) and "rot_matrix" in pc.case.kwargs
    ENTRY.compare(out, ref, pc.case)
    q, lens, qstart, sel = pc.case.args[0], pc.case.args[7], pc.case.args[8], pc.case.args[9]
    p = pc.cache.page_size
    for s, length in enumerate(lens.tolist()):
        n = int(qstart[s + 1] - qstart[s])
        if length == 0 or n == 0:
            continue
        k, v, _ = pc.cache.read(pc.layer, torch.tensor(pc.slots[s], dtype=torch.int64), length, torch.float32)
        rows_s = slice(int(qstart[s]), int(qstart[s + 1]))
        mask = msa.selection_mask(sel[rows_s].permute(1, 0, 2)[None].long(), length, p)
        q_pos = torch.arange(length - n, length)[None]
        d = q.shape[-1]
        exact = msa.attend(q[rows_s][None].double(), k[None].double(), v[None].double(), q_pos, d ** -0.5, mask)[0]
        vbar = msa.attend(q[rows_s][None].double(), k[None].double(), v.abs()[None].double(), q_pos, d ** -0.5, mask)[0]
        band = (2.0**-7 * exact.abs() + (2.0**-7 * ref.qk_abs[rows_s, :, None].double() + 2.0**-12) * vbar
                + ref.rot_scale * 2.0**-9 * ref.vbar[rows_s].sum(-1, keepdim=True).double() + 1e-30)
        assert_band("rotated attn.paged vs stock read", out[rows_s].double(), exact, band)


def test_rotated_pages_without_the_rotation_fail_the_compare() -> None:
    """The rotation is not optional: the same rotated pages attended without rot_matrix (q not rotated, output
    not un-rotated) must fall outside the band."""
    pc, out, ref = _run(key("nvfp4", 2), 1, CaseShape(batch=2, context=60, num_splits=1, rotate=True), seed=21)
    ENTRY.compare(out, ref, pc.case)
    kwargs = {k: v for k, v in pc.case.kwargs.items() if k != "rot_matrix"}
    args = list(pc.case.args)
    args[10] = torch.full_like(args[10], float("nan"))
    wrong = ENTRY.raw_call(*args, **kwargs)
    with pytest.raises(AssertionError):
        ENTRY.compare(wrong, ref, pc.case)


def test_rot_matrix_is_checked() -> None:
    pc = build_case(key("nvfp4", 2), 1, CPU, torch.Generator().manual_seed(3),
                    CaseShape(batch=2, context=40, num_splits=1, rotate=True))
    args, kw = pc.case.args, dict(pc.case.kwargs)
    with pytest.raises(TypeError, match="rot_matrix: expected dtype torch.bfloat16"):
        ENTRY.raw_call(*args, **{**kw, "rot_matrix": kw["rot_matrix"].float()})
    with pytest.raises(ValueError, match="rot_matrix"):
        ENTRY.raw_call(*args, **{**kw, "rot_matrix": kw["rot_matrix"][:16]})
    fp8 = build_case(key("fp8", 2), 1, CPU, torch.Generator().manual_seed(3), CaseShape(batch=2, context=40))
    with pytest.raises(ValueError, match="rot_matrix: the K/V rotation applies to NVFP4"):
        ENTRY.raw_call(*fp8.case.args, **{**fp8.case.kwargs, "rot_matrix": kw["rot_matrix"]})
