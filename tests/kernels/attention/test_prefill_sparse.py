"""attn.prefill_sparse (m3serve/kernels/attention/prefill.py, SPARSE): the tiled prefill kernel over each query's
MSA block selection.

CPU (Triton interpreter, tiny shapes): several sequences in one step (first chunk, a chunk after an unaligned
context, a one-token chunk, a sequence with no query, graph padding) with a selection as msa.select makes it, pages
scattered over a NaN-poisoned pool, outputs poisoned, against the fp32 reference through the entry's band; blocks
of one and of two key tiles, one and two heads a program, bf16 and FP8 pages; the real PagedKVCache layout against
the model's stock MSA attention (msa.attend with msa.selection_mask over its own block selection); rows that see
no key store 0; a selection is read as a set; a full selection equals the dense kernel; a wrong selection fails
the compare; bad input raises.
GPU (pytest -m gpu, the lead runs them on an H200): every certified cell at several (batch, context) points, an 8k
chunk after a context against the chunked fp32 reference, the decode kernel (attn.paged) on the same selection, and
a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.attention import prefill as pa
from m3serve.kernels.catalog import true_fp32

CPU = torch.device("cpu")
TINY = pa.PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)

# first chunk; chunk after an unaligned context; 1-token chunk; no query this step; padding (2 rows)
QUERY_LENS = [5, 19, 1, 0, 2]
CONTEXT_LENS = [0, 77, 50, 20, -1]


def _lens(query_lens: list[int], context_lens: list[int]) -> list[int]:
    return [0 if c < 0 else c + n for n, c in zip(query_lens, context_lens)]


def _sparse_case(shape, query_lens, context_lens, block_size: int, topk: int, seed: int,
                 tiles: pa.PrefillTiles = TINY, max_query_len: int | None = None) -> pa.Case:
    gen = torch.Generator().manual_seed(seed)
    case = pa.make_step_case(shape, query_lens, context_lens, CPU, gen, tiles, max_query_len=max_query_len)
    sel = pa.make_selection(query_lens, _lens(query_lens, context_lens), shape[1], block_size, topk, CPU, gen)
    return pa.Case(args=case.args, kwargs={**case.kwargs, "sel": sel, "block_size": block_size}, bytes_moved=0)


def _run(case: pa.Case) -> tuple[torch.Tensor, pa.PrefillReference]:
    out = pa.prefill_attention(*case.args, **case.kwargs)
    return out, pa.prefill_attention_reference(*case.args, **case.kwargs)


# P, block size, key tile, heads a program: a block of one key tile; a block of two key tiles spanning two pages
# (two heads); a block of two key tiles inside one page
@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("p,bs,block_n,heads", [(16, 16, 16, 1), (16, 32, 16, 2), (32, 32, 16, 1)],
                         ids=["block16", "block32-over-pages16-2heads", "block32-page32-tiles16"])
def test_several_sequences_with_context_and_padding(bits: int, p: int, bs: int, block_n: int, heads: int) -> None:
    tiles = pa.PrefillTiles(block_m=16 * heads, block_n=block_n, num_warps=4, num_stages=1, heads=heads)
    # the second sequence's rows see 4-6 blocks of 16 (top-3: 4 columns in the kernel, one masked) or 3 of 32
    # (top-2): the selection is active; the first chunk's rows see one block and keep one
    topk = 3 if bs == 16 else 2
    case = _sparse_case((4, 2, 32, p, bits), QUERY_LENS, CONTEXT_LENS, bs, topk, seed=p + bs + bits, tiles=tiles,
                        max_query_len=40)  # more query blocks in the grid than any sequence needs
    count = (case.kwargs["sel"] >= 0).sum(-1)
    assert bool((count[:5] == 1).all()) and bool((count[5:24] == topk).all())
    out, ref = _run(case)
    pa.compare(out, ref, case)
    assert torch.equal(out[25:27], torch.zeros_like(out[25:27])), "padding rows must be zeros"


def test_real_cache_layout_matches_the_models_msa_attention() -> None:
    """K/V/index-K of a sparse layer of a real PagedKVCache (strided sub-page views) written by cache.write; the
    selection is msa.select_blocks over the indexer's block scores (what Attention.core does); the kernel against
    msa.attend with msa.selection_mask over cache.read(..., bf16), the model's stock MSA path."""
    from m3serve.kv.cache import PagedKVCache
    from m3serve.kv.spec import KVCacheSpec
    from m3serve.model import msa

    gen = torch.Generator().manual_seed(12)
    hq, hk, d, p, di, topk = 4, 2, 32, 16, 16, 2
    spec = KVCacheSpec(page_size=p, num_layers=2, sparse_layers=(1,), num_kv_heads=hk, head_dim=d, index_head_dim=di,
                       kv_cache_dtype="fp8", model_dtype=torch.bfloat16)
    cache = PagedKVCache(spec, num_slots=12, device=CPU)
    lens, query_lens = [70, 23], [29, 23]
    slots = [torch.tensor([7, 2, 9, 5, 1]), torch.tensor([4, 11])]
    table = torch.zeros(2, 5, dtype=torch.int32)
    for s, sl in enumerate(slots):
        table[s, :len(sl)] = sl.to(torch.int32)
        pos = torch.arange(lens[s])
        mapping = sl[pos // p] * p + pos % p
        cache.write(1, mapping, torch.randn(lens[s], hk, d, generator=gen), torch.randn(lens[s], hk, d, generator=gen),
                    torch.randn(lens[s], di, generator=gen))
    t = sum(query_lens)
    q = (2 * torch.randn(t, hq, d, generator=gen)).to(torch.bfloat16)
    iq = torch.randn(t, hk, di, generator=gen).to(torch.bfloat16)
    qstart = [0, 29, 52]
    sel = torch.full((t, hk, topk), -1, dtype=torch.int32)
    model = []
    with true_fp32():
        for s in range(2):
            n, L = query_lens[s], lens[s]
            keys, values, index_keys = cache.read(1, slots[s], L, torch.bfloat16)
            rows = slice(qstart[s], qstart[s + 1])
            q_pos = (L - n + torch.arange(n))[None]
            scores = msa.block_scores(iq[rows][None], index_keys[None], q_pos, p)
            picked = msa.select_blocks(scores, q_pos, p, topk)  # [1, Hk, n, K']
            sel[rows, :, :picked.shape[-1]] = picked[0].permute(1, 0, 2).to(torch.int32)
            mask = msa.selection_mask(picked, L, p)
            model.append(msa.attend(q[rows][None], keys[None], values[None], q_pos, d ** -0.5, mask)[0])
    out = torch.full_like(q, float("nan"))
    args = (q, cache.pages(1, "k"), cache.pages(1, "v"), table, torch.tensor(lens, dtype=torch.int32),
            torch.tensor(qstart, dtype=torch.int32), out)
    kw = {"sm_scale": d ** -0.5, "max_query_len": 29, "tiles": TINY, "sel": sel, "block_size": p}
    assert cache.pages(1, "k").stride(0) > hk * p * d  # the slot holds other sub-pages: a strided view
    pa.prefill_attention(*args, **kw)
    ref = pa.prefill_attention_reference(*args, **kw)
    pa.compare(out, ref, pa.Case(args=args, kwargs=kw, bytes_moved=0))
    torch.testing.assert_close(ref.out, torch.cat(model), rtol=1e-5, atol=1e-6)
    stock = pa.prefill_attention_stock(*args[:6], torch.empty_like(out), **kw)
    torch.testing.assert_close(stock, torch.cat(model).to(torch.bfloat16), rtol=0, atol=0)


def test_rows_that_see_no_key_store_zero() -> None:
    """Rows selecting nothing (all -1) or only blocks past their position share their tiles with rows that see
    keys: the guarded max keeps them at 0 (no NaN), and every other row is unaffected."""
    case = _sparse_case((4, 2, 32, 16, 16), [21], [30], 16, 2, seed=4)  # positions 30..50, blocks 1..3
    sel = case.kwargs["sel"]
    sel[3] = -1                                   # nothing selected (both KV heads)
    sel[5, 0] = torch.tensor([3, -1])             # position 35 (block 2) selects only the future block 3
    sel[17, 1] = torch.tensor([-5, 9])            # negative and past-the-end ids select nothing either
    out, ref = _run(case)
    pa.compare(out, ref, case)
    for row, heads in ((3, slice(0, 4)), (5, slice(0, 2)), (17, slice(2, 4))):
        assert torch.equal(out[row, heads], torch.zeros_like(out[row, heads])), row
        assert torch.equal(ref.out[row, heads], torch.zeros_like(ref.out[row, heads])), row
    assert bool(out[5, 2:].float().abs().amax() > 0)   # the same token's other KV head sees keys


def test_a_selection_is_read_as_a_set() -> None:
    """Order, repeats and out-of-range ids do not change the result: the kernel walks the distinct selected
    blocks in ascending order whatever the row lists, so the output is bitwise the same."""
    case = _sparse_case((4, 2, 32, 16, 16), [21], [37], 16, 3, seed=5)
    out = pa.prefill_attention(*case.args, **case.kwargs).clone()
    sel = case.kwargs["sel"]
    messy = torch.cat([sel.flip(-1), sel[..., :1], torch.full_like(sel[..., :1], 1000)], dim=-1)  # [T, Hk, 5]
    args = list(case.args)
    args[6] = torch.full_like(out, float("nan"))
    again = pa.prefill_attention(*args, **{**case.kwargs, "sel": messy})
    assert torch.equal(again, out)


@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
def test_selecting_every_visible_block_is_the_dense_kernel(bits: int) -> None:
    """topk >= blocks: MSA == dense (msa's selection contract), and the sparse walk over every block does the
    dense kernel's arithmetic in the same order: the outputs are bitwise equal."""
    shape = (4, 2, 32, 16, bits)
    case = _sparse_case(shape, [5, 19], [0, 37], 16, 4, seed=6)  # 56 keys: 4 blocks
    sparse = pa.prefill_attention(*case.args, **case.kwargs).clone()
    args = list(case.args)
    args[6] = torch.full_like(sparse, float("nan"))
    dense = pa.prefill_attention(*args, **{k: v for k, v in case.kwargs.items() if k not in ("sel", "block_size")})
    assert torch.equal(sparse, dense)


def test_compare_rejects_a_wrong_selection() -> None:
    """The band is tight enough to see one row's extra block swapped for another block."""
    case = _sparse_case((2, 1, 16, 16, 16), [20], [40], 16, 2, seed=7)  # positions 40..59: blocks 2..3 own
    ref = pa.prefill_attention_reference(*case.args, **case.kwargs)
    sel = case.kwargs["sel"].clone()
    row = 10
    own, extra = int(sel[row, 0, 1]), int(sel[row, 0, 0])
    assert own == (40 + row) // 16 and 0 <= extra < own
    sel[row, 0, 0] = (extra + 1) % own
    out = pa.prefill_attention(*case.args, **{**case.kwargs, "sel": sel})
    with pytest.raises(AssertionError, match=r"attn.prefill_sparse: \|out-ref\| exceeds the band at \(10, "):
        pa.compare(out, ref, case)


def test_make_selection_is_a_realistic_msa_selection() -> None:
    """Own block forced, distinct earlier blocks, ascending, -1 padded; early tokens keep fewer; padding rows -1."""
    query_lens, context_lens = [40, 9, 2], [0, 70, -1]
    gen = torch.Generator().manual_seed(8)
    sel = pa.make_selection(query_lens, _lens(query_lens, context_lens), 2, 16, 3, CPU, gen)
    pos = torch.cat([torch.arange(40), 70 + torch.arange(9)])
    own = (pos // 16).view(-1, 1)
    s = sel[:49].long()
    valid = s >= 0
    assert bool((s.amax(-1) == own).all())                      # own block selected (and the largest)
    assert bool((valid.sum(-1) == torch.clamp(own + 1, max=3)).all())  # as many as there are, up to topk
    assert bool((s[..., 1:] > s[..., :-1])[valid[..., 1:]].all())        # ascending, distinct
    assert bool((~valid[..., :-1] <= ~valid[..., 1:]).all())             # right-padded
    assert bool((sel[49:] == -1).all())
    assert not torch.equal(sel[40:, 0], sel[40:, 1])  # each KV head picks its own


def _good_args():
    case = _sparse_case((2, 1, 16, 16, 16), [3], [20], 16, 2, seed=1)
    return list(case.args), dict(case.kwargs)


@pytest.mark.parametrize("what,exc,match", [
    ("sel_int64", TypeError, r"sel: expected dtype torch.int32, found torch.int64"),
    ("sel_tokens", ValueError, r"sel: expected int32 \[T, Hk, K\] = \[3, 1, K >= 1\].*found shape \(2, 1, 2\)"),
    ("sel_heads", ValueError, r"sel: expected int32 \[T, Hk, K\] = \[3, 1, K >= 1\].*found shape \(3, 2, 2\)"),
    ("sel_empty", ValueError, r"sel: expected int32 \[T, Hk, K\].*found shape \(3, 1, 0\)"),
    ("sel_stride", ValueError, r"sel: expected .*unit last stride, found shape \(3, 1, 2\) strides \(4, 4, 2\)"),
    ("no_block_size", ValueError, r"sel/block_size: expected both \(sparse\) or neither \(dense\), found sel a tensor"),
    ("no_sel", ValueError, r"sel/block_size: expected both .* found sel None and block_size 16"),
    ("block_size", ValueError, r"block_size: expected a positive multiple of the key tile BLOCK_N = 16, found 8"),
    ("block_size_bool", ValueError, r"block_size: expected a positive multiple .* found True"),
])
def test_bad_input_raises_naming_the_argument(what: str, exc: type, match: str) -> None:
    args, kw = _good_args()
    sel = kw["sel"]
    if what == "sel_int64":
        kw["sel"] = sel.long()
    elif what == "sel_tokens":
        kw["sel"] = sel[:2]
    elif what == "sel_heads":
        kw["sel"] = torch.cat([sel, sel], dim=1)
    elif what == "sel_empty":
        kw["sel"] = sel[..., :0]
    elif what == "sel_stride":
        kw["sel"] = torch.cat([sel, sel], dim=-1)[..., ::2]
    elif what == "no_block_size":
        kw["block_size"] = None
    elif what == "no_sel":
        kw["sel"] = None
    elif what == "block_size":
        kw["block_size"] = 8
    elif what == "block_size_bool":
        kw["block_size"] = True
    with pytest.raises(exc, match=match):
        pa.prefill_attention(*args, **kw)


def test_the_sparse_entry_is_registered_with_its_own_switch(monkeypatch) -> None:
    from m3serve.kernels.catalog import all_entries
    from m3serve.targets.dispatch import lookup
    e = all_entries()["attn.prefill_sparse"]
    assert e is pa.SPARSE_ENTRY and e.raw_call is pa.prefill_attention
    shape = (64, 4, 128, 128, 8, 128, 16)
    assert lookup("attn.prefill_sparse", 8192, shape, "require") is e
    monkeypatch.setattr(pa, "SPARSE_ENABLED", False)
    assert lookup("attn.prefill_sparse", 8192, shape, "require") is None
    assert lookup("attn.prefill", 8192, shape[:5], "require") is pa.ENTRY  # the dense form stays on


# --- GPU (H200) ------------------------------------------------------------------------------------


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _gpu_case(cell, query_lens, context_lens, seed: int, dev: torch.device, max_query_len=None) -> pa.Case:
    hq, hk, d, p, bits, bs, topk = cell.shape
    gen = torch.Generator().manual_seed(seed)
    case = pa.make_step_case(cell.shape[:5], query_lens, context_lens, dev, gen, cell.config["tiles"],
                             max_query_len=max_query_len)
    sel = pa.make_selection(query_lens, _lens(query_lens, context_lens), hk, bs, topk, dev, gen)
    return pa.Case(args=case.args, kwargs={**case.kwargs, "sel": sel, "block_size": bs}, bytes_moved=0)


# (query counts, contexts) per step: batch 1 first chunk, batch 1 after a long unaligned context, a batch
# mixing a first chunk, a later chunk, decode-like single tokens and padding
GPU_STEPS = [([1000], [0]), ([300], [5000 + 77]), ([129, 64, 1, 1, 2], [0, 1234, 3000, 0, -1])]


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(pa.SPARSE_CELLS)), ids=[str(c.shape) for c in pa.SPARSE_CELLS])
@pytest.mark.parametrize("step", range(len(GPU_STEPS)))
def test_gpu_cells_at_batch_and_context_points(i: int, step: int) -> None:
    dev = _cuda()
    qlens, ctx = GPU_STEPS[step]
    case = _gpu_case(pa.SPARSE_CELLS[i], qlens, ctx, 100 * i + step, dev)
    out, ref = _run(case)
    pa.compare(out, ref, case)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
def test_gpu_8k_chunk_after_context(bits: int) -> None:
    dev = _cuda()
    cell = next(c for c in pa.SPARSE_CELLS if c.shape[:5] == (64, 4, 128, 128, bits))
    case = _gpu_case(cell, [8192], [4096 + 77], bits, dev)
    out, ref = _run(case)
    pa.compare(out, ref, case)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
def test_gpu_agrees_with_the_decode_kernel_on_the_same_selection(bits: int) -> None:
    """attn.paged (the path sparse prefill rows took before) on the same step and selection: both inside the
    band of the same reference."""
    from m3serve.kernels.attention.paged import choose_num_splits, make_workspace, paged_attention
    dev = _cuda()
    cell = next(c for c in pa.SPARSE_CELLS if c.shape[:5] == (64, 4, 128, 128, bits))
    case = _gpu_case(cell, [700, 333], [0, 1000 + 77], 3, dev)
    out, ref = _run(case)
    pa.compare(out, ref, case)
    q, kp, vp, table, lens, qs, _ = case.args
    splits = choose_num_splits(q.shape[0], 16, kv_heads=4, min_blocks_per_split=1)
    ws = make_workspace(q.shape[0], q.shape[1], q.shape[2], splits, dev)
    paged = paged_attention(q, kp, vp, None, None, None, table, lens, qs, case.kwargs["sel"],
                            torch.full_like(out, float("nan")), ws, fmt="bf16" if bits == 16 else "fp8",
                            sm_scale=case.kwargs["sm_scale"], max_query_len=700, num_splits=splits)
    pa.compare(paged, ref, case)


@pytest.mark.gpu
def test_gpu_graph_replay_follows_the_device_metadata() -> None:
    """Captured once, replayed after the step metadata, the selection, q and V changed in place: no host state."""
    dev = _cuda()
    cell = pa.SPARSE_CELLS[1]  # TP1, FP8 pages
    case = _gpu_case(cell, [200, 50], [300, 0], 9, dev, max_query_len=256)
    q, k, v, table, seq_lens, qstart, out = case.args
    sel = case.kwargs["sel"]
    pa.prefill_attention(*case.args, **case.kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pa.prefill_attention(*case.args, **case.kwargs)
    seq_lens.copy_(torch.tensor([420, 40], dtype=torch.int32))  # keys stay inside what was written
    qstart.copy_(torch.tensor([0, 220, 250], dtype=torch.int32))
    sel.copy_(pa.make_selection([220, 30], [420, 40], 4, 128, 16, dev, torch.Generator().manual_seed(10)))
    q.copy_(torch.randn(q.shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev))
    v.view(torch.uint8).bitwise_xor_(0x80)  # flip every V sign (E4M3 sign bit)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = pa.prefill_attention_reference(*case.args, **case.kwargs)
    pa.compare(out, ref, case)
