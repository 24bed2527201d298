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


def test_prefill_rows_over_several_tiles_and_causal_skips() -> None:
    """300 query rows (3 tiles of 128) with a context that starts inside the chunk: blocks before
    the chunk, blocks no row of a tile can see (written -inf without loading K), blocks past L."""
    gen = torch.Generator().manual_seed(12)
    _scores(mi.build_scores_case(2, 16, 16, "bf16", 2, 300, [330], 24, CPU, gen))


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
