"""msa.scores and msa.select against m3serve.model.msa (block_scores, select_blocks), the MSA spec.

Tolerances: select is exact (integer output). Scores are compared through the entry's compare:
-inf / NaN exactly, finite values within 2 * Di * 2**-24 * max_j sum|q k_j| (bf16 products are exact
in fp32, so the two sides differ only in summation order); rows of sequences with ceil(L/P) <= topk
must stay unwritten. The end-to-end test uses small-integer index vectors, so every dot is exact
and the kernel's selection must equal the model's selection exactly, ties included.
"""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.attention import kv_write as kw
from m3serve.kernels.attention import msa_index as mi
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.spec import KVCacheSpec
from m3serve.model import msa

CPU = torch.device("cpu")


def _scores(case) -> torch.Tensor:
    out = mi.msa_block_scores(*case.args, **case.kwargs)
    mi.compare_scores(out, mi.msa_block_scores_reference(*case.args, **case.kwargs), case)
    return out


# --- scores (interpreter) -------------------------------------------------------------------------

@pytest.mark.parametrize("hk,di,p,fmt,topk,rows,contexts,blocks", [
    (1, 16, 16, "bf16", 1, 1, [17, 64, 5, 0], 4),          # one head, identity / padding / full
    (2, 32, 16, "fp8", 2, 3, [48, 49, 96, 3], 6),           # fp8 index-K, block edges
    (4, 16, 32, "bf16", 1, 4, [100, 128, 33], 4),           # M3's 4 heads: rows*Hk fill one dot
    (2, 16, 16, "bf16", 3, 40, [200, 64, 250], 16),         # verify-like rows, several dots per tile
])
def test_scores_match_block_scores(hk, di, p, fmt, topk, rows, contexts, blocks) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + hk)
    _scores(mi.build_scores_case(hk, di, p, fmt, topk, rows, contexts, blocks, CPU, gen))


@pytest.mark.parametrize("tiling", [None, "decode"])
def test_prefill_rows_over_several_tiles_and_causal_skips(tiling) -> None:
    """300 query rows (several query tiles of either tiling) with a context that starts inside the chunk: blocks
    before the chunk, blocks no row of a tile can see (written -inf without loading K), blocks past L."""
    gen = torch.Generator().manual_seed(12)
    case = mi.build_scores_case(2, 16, 16, "bf16", 2, 300, [330], 24, CPU, gen)
    out = mi.msa_block_scores(*case.args, **case.kwargs, tiling=tiling)
    mi.compare_scores(out, mi.msa_block_scores_reference(*case.args, **case.kwargs), case)


# --- scores: the query-stationary (prefill) tiling, past DECODE_MAX_QUERY rows ----------------------

def _tile(bq: int, split_blocks: int) -> mi.PrefillScoresTile:
    return mi.PrefillScoresTile(bq=bq, split_blocks=split_blocks, num_warps=4, num_stages=2)


@pytest.mark.parametrize("hk,di,p,fmt,topk,rows,contexts,blocks,tile", [
    (1, 16, 16, "bf16", 1, 49, [49, 100, 300], 20, None),          # a fresh prompt; chunks after a context
    (2, 16, 16, "fp8", 2, 130, [130, 333, 0], 24, None),           # fp8 index-K, L % P != 0, a padding sequence
    (3, 16, 16, "bf16", 4, 60, [60, 517, 1000, 0], 64, None),      # 3 heads (padded to 4), an identity sequence
    (4, 32, 16, "fp8", 3, 300, [1000, 300, 47 * 16 + 5], 70, None),  # M3's 4 heads, Di 32, several tiles
    (4, 16, 32, "bf16", 2, 97, [97, 64 * 32, 1111], 64, None),     # P 32; every block of the table visible
    (2, 16, 16, "bf16", 2, 90, [93, 300, 0, 29 * 16], 30, _tile(8, 4)),    # 16-row dots, 4-block splits
    (4, 16, 16, "fp8", 3, 150, [150, 700, 0], 50, _tile(64, 7)),   # 256-row dots, splits across the diagonal
    (3, 16, 16, "bf16", 1, 49, [49, 300], 21, _tile(16, 1)),       # one block per program
])
def test_prefill_tiling_matches_block_scores(hk, di, p, fmt, topk, rows, contexts, blocks, tile) -> None:
    """Fresh random inputs and poisoned outputs; rows > DECODE_MAX_QUERY choose the prefill tiling by themselves."""
    assert mi.scores_tiling(rows) == "prefill"
    gen = torch.Generator().manual_seed(rows * 13 + hk * 5 + blocks)
    case = mi.build_scores_case(hk, di, p, fmt, topk, rows, contexts, blocks, CPU, gen)
    out = mi.msa_block_scores(*case.args, **case.kwargs, prefill_tile=tile)
    mi.compare_scores(out, mi.msa_block_scores_reference(*case.args, **case.kwargs), case)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_the_two_tilings_agree_bit_for_bit_on_exact_dots(fmt) -> None:
    """Both tilings over the same > 48-row step. With small-integer index vectors every dot is exact in fp32 whatever
    the summation order, so the outputs must be equal bit for bit (-inf, NaN and unwritten rows included). On random
    vectors the tilings' fp32 sums may be ordered differently (a 64-row dot against a 128-row one, another MMA
    shape on the GPU), so there each is compared against the reference instead."""
    gen = torch.Generator().manual_seed(31 if fmt == "bf16" else 32)
    hk, di, p, topk, rows, contexts, blocks = 3, 16, 16, 2, 50, [50, 200, 0, 130], 14
    for exact in (True, False):
        case = mi.build_scores_case(hk, di, p, fmt, topk, rows, contexts, blocks, CPU, gen)
        index_q, pages = case.args[0], case.args[1]
        if exact:
            index_q.copy_(torch.randint(-3, 4, index_q.shape, generator=gen).to(torch.bfloat16))
            ints = torch.randint(-3, 4, pages.shape, generator=gen).to(torch.bfloat16)
            pages.copy_(ints.to(pages.dtype))
            if fmt == "bf16":  # (the interpreter's e4m3 decode has no NaN: on the CPU fp8 NaN keys are untested)
                pages[int(case.args[2][1, 7]), 3, 5] = float("nan")   # a NaN key in sequence 1, block 7
        outs = {}
        for tiling in ("decode", "prefill"):
            scores = case.args[5].clone()
            outs[tiling] = mi.msa_block_scores(*case.args[:5], scores, **case.kwargs, tiling=tiling)
            mi.compare_scores(outs[tiling], mi.msa_block_scores_reference(*case.args, **case.kwargs), case)
        if exact:
            a, b = outs["decode"], outs["prefill"]
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())
            assert fmt != "bf16" or bool(torch.isnan(b[rows:2 * rows, :, 7]).all())


def test_prefill_tiling_nan_key_visible_and_invisible() -> None:
    """A NaN key in a block every row of the tile sees whole (the unmasked walk) makes the block NaN for every row;
    one in the diagonal block only for the rows that see it; NaN garbage past L is never read."""
    gen = torch.Generator().manual_seed(5)
    rows, ctx = 60, 100                                  # positions 40 .. 99, P 16: blocks 0, 1 whole, 2 .. 6 diagonal
    for tile in (None, _tile(16, 3)):
        case = mi.build_scores_case(2, 16, 16, "bf16", 1, rows, [ctx], 8, CPU, gen)
        pages, table = case.args[1], case.args[2]
        pages[int(table[0, 1]), 5, 3] = float("nan")     # key 21: visible to every row
        pages[int(table[0, 5]), 15, 0] = float("nan")    # key 95: visible to rows 55 .. 59 only
        pages[int(table[0, 6]), 4:, :] = float("nan")    # keys 100 .. 111: past L
        out = mi.msa_block_scores(*case.args, **case.kwargs, prefill_tile=tile)
        mi.compare_scores(out, mi.msa_block_scores_reference(*case.args, **case.kwargs), case)
        assert bool(torch.isnan(out[:, :, 1]).all())
        assert bool(torch.isnan(out[55:, :, 5]).all()) and not bool(torch.isnan(out[:55, :, 5]).any())
        assert not bool(torch.isnan(out[:, :, 6]).any()) and bool(torch.isfinite(out[-4:, :, 6]).all())
        assert bool((out[:, :, 7] == float("-inf")).all())


def test_scores_tiling_is_chosen_by_rows_and_validated() -> None:
    assert [mi.scores_tiling(n) for n in (1, 48, 49, 16384)] == ["decode", "decode", "prefill", "prefill"]
    assert mi.scores_variant(49, 4) == mi.scores_variant(8192, 4)   # one compiled prefill variant per geometry
    t = mi.prefill_scores_tile(16384, 4)
    assert t.bq * 4 == 128 and t.split_blocks >= 1
    args, kwargs = _score_args()
    with pytest.raises(ValueError, match="tiling"):
        mi.msa_block_scores(*args, **kwargs, tiling="stationary")
    with pytest.raises(ValueError, match="prefill_tile.bq"):
        mi.msa_block_scores(*args, **kwargs, tiling="prefill", prefill_tile=_tile(4, 8))   # 4 x 2 heads < 16 rows
    with pytest.raises(ValueError, match="split_blocks"):
        mi.msa_block_scores(*args, **kwargs, tiling="prefill", prefill_tile=_tile(8, 0))
    with pytest.raises(ValueError, match="grid"):
        mi.msa_block_scores(*args, **{**kwargs, "max_query_len": 70000 * 64}, tiling="prefill")


def test_nan_key_gives_a_nan_block_and_invisible_nan_is_ignored() -> None:
    gen = torch.Generator().manual_seed(3)
    case = mi.build_scores_case(2, 16, 16, "bf16", 1, 2, [64], 4, CPU, gen)
    pages, table = case.args[1], case.args[2]
    pages[int(table[0, 1]), 5, 3] = float("nan")     # key 21: visible to both rows
    pages[int(table[0, 3]), 15, 0] = float("nan")    # key 63: visible only to the last row
    out = _scores(case)
    assert bool(torch.isnan(out[:, :, 1]).all())
    assert bool(torch.isfinite(out[0, :, 3]).all()) and bool(torch.isnan(out[1, :, 3]).all())


def test_compare_rejects_wrong_scores() -> None:
    gen = torch.Generator().manual_seed(4)
    case = mi.build_scores_case(2, 16, 16, "bf16", 1, 2, [64, 20, 0], 4, CPU, gen)
    out = mi.msa_block_scores(*case.args, **case.kwargs)
    ref = mi.msa_block_scores_reference(*case.args, **case.kwargs)
    mi.compare_scores(out, ref, case)
    for mutate in ("finite", "neg_inf", "skipped_row"):
        bad = out.clone()
        if mutate == "finite":
            bad[0, 0, 0] += 1e-3 * bad[0, 0, 0].abs() + 1e-6
        elif mutate == "neg_inf":
            bad[0, 1, 3] = float("-inf")
        else:
            bad[4, 0, 0] = 0.0  # a row of the padding sequence (L = 0): must stay unwritten
        with pytest.raises(AssertionError):
            mi.compare_scores(bad, ref, case)


# --- select (interpreter) -------------------------------------------------------------------------

@pytest.mark.parametrize("hk,p,topk,blocks,rows,contexts,local,init", [
    (2, 4, 4, 16, 1, [64, 5, 17, 0, 40], 1, 0),
    (1, 4, 3, 12, 3, [48, 13, 30], 2, 1),
    (3, 2, 5, 32, 2, [64, 9, 50, 0], 1, 2),
    (2, 8, 2, 9, 4, [72, 40, 16], 3, 0),                  # local + init > topk: forced blocks compete
    (2, 2, 5, 16, 16, [16, 32], 1, 0),                    # prefill rows: early rows pick -inf blocks (-1)
    # B 200 (BP 256): rows of 10, 30, 50, 100 and 200 blocks take each lane width of the ladder (16 .. 256)
    (2, 2, 4, 200, 2, [20, 60, 100, 200, 400], 1, 1),
])
def test_select_equals_select_blocks(hk, p, topk, blocks, rows, contexts, local, init) -> None:
    gen = torch.Generator().manual_seed(p * 100 + topk)
    case = mi.build_select_case(hk, p, topk, blocks, rows, contexts, CPU, gen, local, init)
    out = mi.msa_select(*case.args, **case.kwargs)
    ref = mi.msa_select_reference(*case.args, **case.kwargs)
    assert bool((ref[:, 0, 0] != -2).all()), "every row is owned"
    mi.compare_select(out, ref, case)
    # the case must exercise the ranking: some non-identity rows with ties among picked scores
    assert any(-(-c // p) > topk for c in contexts)


def test_select_widths_ladder() -> None:
    """Each row scans the narrowest power of two holding its blocks: halvings of the padded table, floored."""
    assert mi.select_widths(256, 4) == (128, 64, 32, 16)
    assert mi.select_widths(2048, 16) == (1024, 512, 256, 128)
    assert mi.select_widths(64, 16) == (32, 32, 32, 32)
    assert mi.select_widths(16, 4) == (16, 16, 16, 16)


def test_select_ties_between_plus_and_minus_zero() -> None:
    """-0.0 == +0.0: equal scores, so the smaller block wins (an ordering on the bits would not)."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        scores = torch.where(torch.rand(6, 2, 32, generator=gen) < 0.5, 0.0, -0.0)
        scores[torch.rand(6, 2, 32, generator=gen) < 0.3] = -1.0
        args = (scores, torch.tensor([64, 61], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32),
                torch.full((6, 2, 4), mi.SEL_POISON, dtype=torch.int32))
        kwargs = {"max_query_len": 3, "topk": 4, "block_size": 2, "local_blocks": 1, "init_blocks": 0}
        case = mi.Case(args=args, kwargs=kwargs, bytes_moved=0)
        mi.compare_select(mi.msa_select(*args, **kwargs), mi.msa_select_reference(*args, **kwargs), case)


def test_select_identity_and_padding_rows() -> None:
    """nb <= topk: 0..own then -1 whatever the (unwritten, NaN) scores; L = 0: all -1."""
    scores = torch.full((4, 2, 8), float("nan"))
    seq_lens = torch.tensor([10, 0], dtype=torch.int32)
    qs = torch.tensor([0, 3, 4], dtype=torch.int32)
    sel = torch.full((4, 2, 4), mi.SEL_POISON, dtype=torch.int32)
    mi.msa_select(scores, seq_lens, qs, sel, max_query_len=3, topk=4, block_size=4, local_blocks=1, init_blocks=0)
    # positions 7, 8, 9: own blocks 1, 2, 2
    assert sel[:, 0].tolist() == [[0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, -1], [-1, -1, -1, -1]]
    assert torch.equal(sel[:, 0], sel[:, 1])


def test_select_rows_past_max_query_len_are_not_written() -> None:
    scores = torch.zeros(3, 1, 4)
    sel = torch.full((3, 1, 2), mi.SEL_POISON, dtype=torch.int32)
    mi.msa_select(scores, torch.tensor([16], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), sel,
                  max_query_len=2, topk=2, block_size=4, local_blocks=1, init_blocks=0)
    assert sel[2].tolist() == [[mi.SEL_POISON] * 2] and bool((sel[:2] != mi.SEL_POISON).all())


# --- end to end: model path vs kernels on a real paged cache -------------------------------------

@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_kernels_select_what_the_model_selects(index_dtype: str) -> None:
    """write_layer -> msa_block_scores -> msa_select equals kv.read -> msa.block_scores -> msa.select_blocks
    exactly: index vectors of small integers make every dot exact, so ties are real ties."""
    gen = torch.Generator().manual_seed(8)
    p, hk, di, topk, blocks = 16, 2, 16, 3, 10
    spec = KVCacheSpec(page_size=p, num_layers=1, sparse_layers=(0,), num_kv_heads=hk, head_dim=16,
                       index_head_dim=di, kv_cache_dtype="bf16", index_k_dtype=index_dtype,
                       model_dtype=torch.bfloat16)
    kv = PagedKVCache(spec, 40, CPU)
    contexts, rows = [150, 20, 45, 70], 3
    table = torch.zeros(len(contexts), blocks, dtype=torch.int32)
    free = torch.randperm(40, generator=gen)
    used = 0
    for i, seq_len in enumerate(contexts):
        nb = -(-seq_len // p)
        table[i, :nb] = free[used:used + nb].int()
        used += nb
        pos = torch.arange(seq_len)
        flat = table[i].long()[pos // p] * p + pos % p
        ik = torch.randint(-2, 3, (seq_len, di), generator=gen).float()
        kw.write_layer(kv, 0, flat, torch.zeros(seq_len, hk, 16), torch.zeros(seq_len, hk, 16), ik)
    iq = torch.randint(-2, 3, (len(contexts) * rows, hk, di), generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    qs = torch.arange(len(contexts) + 1, dtype=torch.int32) * rows
    t = len(contexts) * rows
    scores = torch.full((t, hk, blocks), float("nan"))
    mi.msa_block_scores(iq, kv.pages(0, "index_k"), table, seq_lens, qs, scores, max_query_len=rows, topk=topk)
    sel = torch.full((t, hk, topk), mi.SEL_POISON, dtype=torch.int32)
    mi.msa_select(scores, seq_lens, qs, sel, max_query_len=rows, topk=topk, block_size=p, local_blocks=1,
                  init_blocks=0)
    for i, seq_len in enumerate(contexts):
        nb = -(-seq_len // p)
        _, _, ik = kv.read(0, table[i, :nb].long(), seq_len, torch.bfloat16)
        pos = torch.arange(seq_len - rows, seq_len)
        want_scores = msa.block_scores(iq[i * rows:(i + 1) * rows][None], ik[None], pos[None], p)
        want = msa.select_blocks(want_scores, pos[None], p, topk, 1, 0)[0].permute(1, 0, 2)  # [n, Hk, K']
        got = sel[i * rows:(i + 1) * rows]
        assert torch.equal(got[..., :want.shape[-1]], want.int()), (i, got.tolist(), want.tolist())
        assert bool((got[..., want.shape[-1]:] == -1).all())
        if nb > topk:  # exact dots: the scores themselves are equal too
            want_full = torch.full((rows, hk, blocks), float("-inf"))
            want_full[..., :nb] = want_scores[0].permute(1, 0, 2)
            assert torch.equal(scores[i * rows:(i + 1) * rows], want_full)


# --- validation -----------------------------------------------------------------------------------

def _score_args():
    case = mi.build_scores_case(2, 16, 16, "bf16", 1, 2, [40, 0], 4, CPU, torch.Generator().manual_seed(1))
    return list(case.args), dict(case.kwargs)


@pytest.mark.parametrize("i,value,exc,needle", [
    (0, lambda a: a.float(), TypeError, "index_q"),
    (1, lambda a: a.view(torch.int16), TypeError, "index_pages"),
    (1, lambda a: a[:, :, :8], ValueError, "index_pages"),
    (2, lambda a: a.long(), TypeError, "slot_table"),
    (3, lambda a: a[:1], ValueError, "query_start"),
    (4, lambda a: a[:2], ValueError, "query_start"),
    (5, lambda a: a[:, :, :3], ValueError, "scores"),
])
def test_scores_bad_arguments(i, value, exc, needle) -> None:
    args, kwargs = _score_args()
    args[i] = value(args[i])
    with pytest.raises(exc, match=needle):
        mi.msa_block_scores(*args, **kwargs)


def test_scores_bad_sizes() -> None:
    args, kwargs = _score_args()
    with pytest.raises(ValueError, match="max_query_len"):
        mi.msa_block_scores(*args, **{**kwargs, "max_query_len": 0})
    with pytest.raises(ValueError, match="topk"):
        mi.msa_block_scores(*args, **{**kwargs, "topk": 1.5})


def test_select_bad_arguments() -> None:
    case = mi.build_select_case(2, 4, 4, 16, 1, [64, 5], CPU, torch.Generator().manual_seed(1))
    args, kwargs = list(case.args), dict(case.kwargs)
    with pytest.raises(TypeError, match="sel"):
        mi.msa_select(*args[:3], args[3].long(), **kwargs)
    with pytest.raises(ValueError, match="sel"):
        mi.msa_select(*args[:3], args[3][:, :, :2], **kwargs)
    with pytest.raises(ValueError, match="local_blocks"):
        mi.msa_select(*args, **{**kwargs, "local_blocks": 0})
    with pytest.raises(TypeError, match="seq_lens"):
        mi.msa_select(args[0], args[1].long(), *args[2:], **kwargs)


# --- GPU ------------------------------------------------------------------------------------------

def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


K128 = 128 * 1024


def _score_points(cell) -> list[tuple[int, list[int], int]]:
    """(rows per sequence, contexts, B) points of a cell: 128k contexts for the decode cells."""
    hk, di, p, _, topk = cell.shape
    top = K128 if p == 128 else 4096
    b = top // p
    if cell.rows[1] <= 48:
        return [(1, [top], b), (1, [top, 3000, 700, 0, top // 2, 5 * p + 1, top, 17], b),
                (4, [top, top // 3], b), (48, [top, top // 6, 60, 0], b)]
    return [(49, [9000, 49], 9000 // p + 1), (1000, [16000, 1000], 16000 // p + 1),
            (4096 if p == 32 else 8192, [4096 if p == 32 else 16384], (4096 if p == 32 else 16384) // p)]


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(mi.SCORES_CELLS)),
                         ids=[f"{c.shape}-r{c.rows[1]}" for c in mi.SCORES_CELLS])
def test_scores_cells_on_the_gpu(i: int) -> None:
    dev = _dev()
    cell = mi.SCORES_CELLS[i]
    hk, di, p, ifmt, topk = cell.shape
    for rows, contexts, b in _score_points(cell):
        case = mi.build_scores_case(hk, di, p, mi._IFMT_NAME[ifmt], topk, rows, contexts, b, dev,
                                    torch.Generator().manual_seed(rows + i))
        out = mi.msa_block_scores(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        mi.compare_scores(out, mi.msa_block_scores_reference(*case.args, **case.kwargs), case)
        del case, out
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_scores_prefill_tiling_on_the_gpu(fmt: str) -> None:
    """M3 TP1 (Hk 4, Di 128, P 128, top-16): an 8192-row chunk after an 8k context over a 1024-block table (the
    -inf tail and block splits past the context), beside a shorter chunk and a padding sequence; both tilings
    against the reference (their fp32 sums may be ordered differently, see the CPU test)."""
    dev = _dev()
    for tiling in ("prefill", "decode"):
        case = mi.build_scores_case(4, 128, 128, fmt, 16, 8192, [16384, 8192 + 3000, 0], 1024, dev,
                                    torch.Generator().manual_seed(77))
        out = mi.msa_block_scores(*case.args, **case.kwargs, tiling=tiling)
        torch.cuda.synchronize()
        mi.compare_scores(out, mi.msa_block_scores_reference(*case.args, **case.kwargs), case)
        del case, out
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(mi.SELECT_CELLS)),
                         ids=[f"{c.shape}-r{c.rows[1]}" for c in mi.SELECT_CELLS])
def test_select_cells_on_the_gpu(i: int) -> None:
    dev = _dev()
    cell = mi.SELECT_CELLS[i]
    hk, p, topk, b = cell.shape
    top = b * p
    points = ([(1, [top, 3000, 700, 0, top // 2, 5 * p + 1, top, 17]), (3, [top, top // 3]), (48, [top, 9000, 60, 0])]
              if cell.rows[1] <= 48 else [(49, [top, 49]), (2000, [top, 2000])])
    for rows, contexts in points:
        case = mi.build_select_case(hk, p, topk, b, rows, contexts, dev, torch.Generator().manual_seed(rows + i))
        out = mi.msa_select(*case.args, **case.kwargs)
        torch.cuda.synchronize()
        mi.compare_select(out, mi.msa_select_reference(*case.args, **case.kwargs), case)
