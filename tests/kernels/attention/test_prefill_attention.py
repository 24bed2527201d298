"""attn.prefill (m3serve/kernels/attention/prefill.py): varlen causal attention over the paged cache.

CPU (Triton interpreter, tiny shapes): several sequences in one step (first chunks, chunks after a
context that is not page-aligned, a one-token chunk, a sequence with no query this step, graph
padding), pages scattered over a NaN-poisoned pool, outputs poisoned; the real PagedKVCache layout
against the model's stock attention; the compare rejects a wrong page; bad input raises.
GPU (pytest -m gpu, the lead runs them on an H200): every certified cell at several (batch, context)
points, an 8k chunk after a context against the chunked fp32 reference, and a CUDA-graph replay.
Tolerance: compare / band in the module (one bf16 ulp + worst-case score, p-split and summation terms).
"""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.attention import prefill as pa
from m3serve.kernels.catalog import true_fp32

CPU = torch.device("cpu")
TINY = pa.PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _run(case: pa.Case) -> tuple[torch.Tensor, pa.PrefillReference]:
    out = pa.prefill_attention(*case.args, **case.kwargs)
    return out, pa.prefill_attention_reference(*case.args, **case.kwargs)


# (Hq, Hk, D, P, kv bits), tiles: one key block per page, and two blocks per page
@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("p,block_n,heads", [(16, 16, 1), (32, 16, 2)], ids=["page16", "page32-half-2heads"])
def test_several_sequences_with_context_and_padding(bits: int, p: int, block_n: int, heads: int) -> None:
    tiles = pa.PrefillTiles(block_m=16 * heads, block_n=block_n, num_warps=4, num_stages=1, heads=heads)
    # first chunk; chunk after an unaligned context; 1-token chunk; no query this step; padding (2 rows)
    query_lens = [5, 19, 1, 0, 2]
    context_lens = [0, 37, 50, 20, -1]
    gen = torch.Generator().manual_seed(p + bits)
    case = pa.make_step_case((4, 2, 32, p, bits), query_lens, context_lens, CPU, gen, tiles,
                             max_query_len=40)  # more query blocks in the grid than any sequence needs
    out, ref = _run(case)
    pa.compare(out, ref, case)
    assert torch.equal(out[25:27], torch.zeros_like(out[25:27])), "padding rows must be zeros"


@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("q_gain", [1.0, 12.0, 100.0], ids=["scores-near", "scores-spread", "scores-past-fp32-range"])
def test_lazy_rescale_is_within_the_band(bits: int, q_gain: float) -> None:
    """tiles.lazy: acc / l rescaled only when a row's max grows by more than LAZY_TAU. q scaled up spreads the
    scores over hundreds of log2 units, so later blocks both raise the max past the threshold (rescale) and
    stay under it (no rescale, p up to 2**8); the output stays in the entry's band either way. At x100 a block's
    max exceeds the first block's by more than 128 log2 units: a kernel that never rescaled would overflow p."""
    tiles = pa.PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1, lazy=True)
    gen = torch.Generator().manual_seed(bits + int(q_gain))
    case = pa.make_step_case((4, 2, 32, 16, bits), [23, 9, 1], [0, 61, 40], CPU, gen, tiles)
    case.args[0].mul_(q_gain)
    out, ref = _run(case)
    pa.compare(out, ref, case)
    assert bool(torch.isfinite(out).all())


def _with_ctx(case: pa.Case) -> pa.Case:
    """The case's step with `ctx`: its pages copied head-major by copy_context into a NaN-poisoned buffer larger
    than the copy (so nothing past it can be read unnoticed)."""
    q, kp, vp, table, seq_lens, qstart, out = case.args
    index = pa.context_index(table, seq_lens, kp.shape[2])
    buf = torch.full((2 * kp[0].numel() * index[0].shape[0] + 4096,), float("nan"), dtype=torch.bfloat16,
                     device=q.device)
    ctx = pa.copy_context(kp, vp, index, buf)
    return pa.Case(args=(q, kp, vp, table, seq_lens, qstart, torch.full_like(out, float("nan"))),
                   kwargs={**case.kwargs, "ctx": ctx}, bytes_moved=case.bytes_moved)


@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
def test_context_copy_form_is_the_page_form(bits: int) -> None:
    """ctx: K/V by TMA boxes from copy_context's head-major bf16 copy (interpreted descriptors). Several sequences
    (first chunk, chunks after unaligned contexts, one token, padding), pages poisoned past every L: the copy holds
    exactly the pages' values, the output is within the band and equal to the page form's (same operand values,
    same tiles, same order)."""
    query_lens, context_lens = [5, 19, 1, 2], [0, 37, 50, -1]
    case = pa.make_step_case((4, 2, 32, 16, bits), query_lens, context_lens, CPU,
                             torch.Generator().manual_seed(bits), TINY)
    pages_out, ref = _run(case)
    ctx_case = _with_ctx(case)
    k_ctx, v_ctx, key_start = ctx_case.kwargs["ctx"]
    _, kp, vp, table, seq_lens, *_ = case.args
    for s, L in enumerate(seq_lens.tolist()):
        for j in range(-(-L // 16)):
            rows = slice(int(key_start[s]) + 16 * j, int(key_start[s]) + 16 * (j + 1))
            for got, pages in ((k_ctx, kp), (v_ctx, vp)):   # bits: the stale tail of a page is NaN codes
                assert torch.equal(got[:, rows].view(torch.int16),
                                   pages[int(table[s, j])].to(torch.bfloat16).view(torch.int16))
    out = pa.prefill_attention(*ctx_case.args, **ctx_case.kwargs)
    pa.compare(out, ref, ctx_case)
    assert torch.equal(out[:27], pages_out[:27])   # rows 25-26: the padding sequence's zeros


def test_context_copy_rejects_bad_arguments() -> None:
    case = pa.make_step_case((4, 2, 32, 16, 16), [5], [20], CPU, torch.Generator().manual_seed(2), TINY)
    k_ctx, v_ctx, key_start = _with_ctx(case).kwargs["ctx"]
    for ctx, match in (((k_ctx, v_ctx[:, :-16], key_start), "ctx v"), ((k_ctx.float(), v_ctx, key_start), "ctx k"),
                       ((k_ctx, v_ctx, key_start.long()), "key_start"), ((k_ctx, v_ctx), "ctx")):
        with pytest.raises((ValueError, TypeError), match=match):
            pa.prefill_attention(*case.args, **case.kwargs, ctx=ctx)
    with pytest.raises(ValueError, match="buf"):
        pa.copy_context(*case.args[1:3], pa.context_index(*case.args[3:5], 16), torch.empty(10, dtype=torch.bfloat16))


def test_single_bf16_p_is_within_its_own_band() -> None:
    tiles = pa.PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1, pv_split=False)
    case = pa.make_step_case((2, 1, 16, 16, 16), [17], [9], CPU, torch.Generator().manual_seed(3), tiles)
    out, ref = _run(case)
    pa.compare(out, ref, case)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_real_cache_layout_matches_the_models_attention(fmt: str) -> None:
    """Pages of layer 1 of a real PagedKVCache (strided sub-page views), K/V written by cache.write;
    the kernel against msa.attend over cache.read(..., bf16), the model's stock path."""
    from m3serve.kv.cache import PagedKVCache
    from m3serve.kv.spec import KVCacheSpec
    from m3serve.model.msa import attend

    gen = torch.Generator().manual_seed(11)
    hq, hk, d, p = 4, 2, 32, 16
    spec = KVCacheSpec(page_size=p, num_layers=2, sparse_layers=(), num_kv_heads=hk, head_dim=d, index_head_dim=16,
                       kv_cache_dtype=fmt, model_dtype=torch.bfloat16)
    cache = PagedKVCache(spec, num_slots=12, device=CPU)
    lens, query_lens = [40, 23], [13, 23]
    slots = [torch.tensor([7, 2, 9]), torch.tensor([4, 11])]
    table = torch.zeros(2, 3, dtype=torch.int32)
    for s, sl in enumerate(slots):
        table[s, :len(sl)] = sl.to(torch.int32)
        pos = torch.arange(lens[s])
        mapping = sl[pos // p] * p + pos % p
        k = torch.randn(lens[s], hk, d, generator=gen)
        v = torch.randn(lens[s], hk, d, generator=gen)
        cache.write(1, mapping, k, v)
    q = (2 * torch.randn(sum(query_lens), hq, d, generator=gen)).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qstart = torch.tensor([0, 13, 36], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    args = (q, cache.pages(1, "k"), cache.pages(1, "v"), table, seq_lens, qstart, out)
    kw = {"sm_scale": d ** -0.5, "max_query_len": 23, "tiles": TINY}
    assert cache.pages(1, "k").stride(0) > hk * p * d  # the slot holds other sub-pages: a strided view
    pa.prefill_attention(*args, **kw)
    ref = pa.prefill_attention_reference(*args, **kw)
    case = pa.Case(args=args, kwargs=kw, bytes_moved=0)
    pa.compare(out, ref, case)
    with true_fp32():
        for s in range(2):
            n, L = query_lens[s], lens[s]
            keys, values, _ = cache.read(1, slots[s], L, torch.bfloat16)
            rows = slice(int(qstart[s]), int(qstart[s + 1]))
            model = attend(q[rows][None], keys[None], values[None], (L - n + torch.arange(n))[None], d ** -0.5)[0]
            torch.testing.assert_close(ref.out[rows], model, rtol=1e-5, atol=1e-6)


def test_compare_rejects_a_wrong_page() -> None:
    """The band is tight enough to see one context page swapped for another sequence's page."""
    case = pa.make_step_case((2, 1, 16, 16, 16), [6, 9], [10, 30], CPU, torch.Generator().manual_seed(5), TINY)
    ref = pa.prefill_attention_reference(*case.args, **case.kwargs)
    bad_table = case.args[3].clone()
    bad_table[1, 1] = bad_table[0, 0]
    args = list(case.args)
    args[3] = bad_table
    out = pa.prefill_attention(*args, **case.kwargs)
    with pytest.raises(AssertionError, match="attn.prefill"):
        pa.compare(out, ref, case)


def _good_args():
    case = pa.make_step_case((2, 1, 16, 16, 16), [3], [4], CPU, torch.Generator().manual_seed(1), TINY)
    return list(case.args), dict(case.kwargs)


@pytest.mark.parametrize("what,exc,match", [
    ("q_fp32", TypeError, r"q: expected dtype torch.bfloat16, found torch.float32"),
    ("table_int64", TypeError, r"slot_table: expected dtype torch.int32, found torch.int64"),
    ("pages_transposed", ValueError, r"k_pages: expected contiguous \[Hk, P, D\]"),
    ("v_dtype", TypeError, r"v_pages: expected dtype torch.bfloat16, found torch.float8_e4m3fn"),
    ("gqa", ValueError, r"q: expected Hq a multiple of Hk = 2"),
    ("out_shape", ValueError, r"out: expected shape \(3, 2, 16\), found \(3, 2, 8\)"),
    ("qstart_len", ValueError, r"seq_lens/query_start: expected \[S\] and \[S\+1\]"),
    ("max_query_len", ValueError, r"max_query_len: expected a positive int, found 0"),
    ("sm_scale", ValueError, r"sm_scale: expected a positive float, found -1.0"),
    ("block_n", ValueError, r"tiles.block_n: expected a power of two >= 16 dividing P = 16, found 8"),
    ("heads", ValueError, r"tiles.heads: expected a divisor of the GQA group 2 and of block_m 16, found 4"),
])
def test_bad_input_raises_naming_the_argument(what: str, exc: type, match: str) -> None:
    args, kw = _good_args()
    q, k, v, table, lens, qs, out = args
    if what == "q_fp32":
        args[0] = q.float()
    elif what == "table_int64":
        args[3] = table.long()
    elif what == "pages_transposed":
        args[1] = k.transpose(2, 3)
    elif what == "v_dtype":
        args[2] = v.to(torch.float8_e4m3fn)
    elif what == "gqa":
        args[1] = k.expand(-1, 2, -1, -1).contiguous()
        args[2] = v.expand(-1, 2, -1, -1).contiguous()
        args[0] = torch.cat([q, q[:, :1]], dim=1)
    elif what == "out_shape":
        args[6] = out[..., :8]
    elif what == "qstart_len":
        args[5] = qs[:1]
    elif what == "max_query_len":
        kw["max_query_len"] = 0
    elif what == "sm_scale":
        kw["sm_scale"] = -1.0
    elif what == "block_n":
        kw["tiles"] = pa.PrefillTiles(block_m=16, block_n=8, num_warps=4, num_stages=1)
    elif what == "heads":
        kw["tiles"] = pa.PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1, heads=4)
    with pytest.raises(exc, match=match):
        pa.prefill_attention(*args, **kw)


def test_reference_rejects_a_grid_too_small_for_a_sequence() -> None:
    args, kw = _good_args()
    kw["max_query_len"] = 2
    with pytest.raises(ValueError, match=r"max_query_len: expected >= every sequence's query count"):
        pa.prefill_attention_reference(*args, **kw)


def test_causal_flops_counts_visible_pairs() -> None:
    # 3 queries after 2 context keys: 3 + 4 + 5 visible keys; padding counts nothing
    assert pa.causal_flops([3, 2], [5, 0], hq=2, d=4) == 4 * 4 * 2 * 12
    assert pa.causal_pairs([3, 2], [5, 0]) == 12 and pa.causal_pairs([2, 4], [6, 4]) == 11 + 10


# --- GPU (H200) ------------------------------------------------------------------------------------


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


# (query counts, contexts) per step: batch 1 first chunk, batch 1 after a long unaligned context, a batch
# mixing a first chunk, a later chunk, decode-like single tokens and padding
GPU_STEPS = [([1000], [0]), ([300], [5000 + 77]), ([129, 64, 1, 1, 2], [0, 1234, 3000, 0, -1])]


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(pa.CELLS)), ids=[str(c.shape) for c in pa.CELLS])
@pytest.mark.parametrize("step", range(len(GPU_STEPS)))
def test_gpu_cells_at_batch_and_context_points(i: int, step: int) -> None:
    dev = _cuda()
    cell = pa.CELLS[i]
    qlens, ctx = GPU_STEPS[step]
    case = pa.make_step_case(cell.shape, qlens, ctx, dev, torch.Generator().manual_seed(100 * i + step),
                             cell.config["tiles"])
    out, ref = _run(case)
    pa.compare(out, ref, case)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
def test_gpu_8k_chunk_after_context(bits: int) -> None:
    dev = _cuda()
    cell = next(c for c in pa.CELLS if c.shape == (64, 4, 128, 128, bits))
    case = pa.make_step_case(cell.shape, [8192], [4096 + 77], dev, torch.Generator().manual_seed(bits),
                             cell.config["tiles"])
    out, ref = _run(case)
    pa.compare(out, ref, case)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8-bf16-operands"])
def test_gpu_lazy_rescale_8k_chunk_after_context(bits: int) -> None:
    """tiles.lazy at M3 TP1 (64 x 64 tiles, bf16 operands): an 8k chunk after a context, q spread x4."""
    dev = _cuda()
    tiles = pa.PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=3, lazy=True)
    case = pa.make_step_case((64, 4, 128, 128, bits), [8192], [4096 + 77], dev,
                             torch.Generator().manual_seed(bits + 1), tiles)
    case.args[0].mul_(4.0)
    out, ref = _run(case)
    pa.compare(out, ref, case)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("step", range(len(GPU_STEPS) + 1))
def test_gpu_context_copy_form(bits: int, step: int) -> None:
    """ctx (TMA boxes from the head-major bf16 copy) at M3 TP1 with the default bf16 tiles: the GPU steps, and an
    8k chunk after a context, against the chunked fp32 reference."""
    dev = _cuda()
    qlens, ctx = GPU_STEPS[step] if step < len(GPU_STEPS) else ([8192], [4096 + 77])
    case = pa.make_step_case((64, 4, 128, 128, bits), qlens, ctx, dev, torch.Generator().manual_seed(7 + step))
    ctx_case = _with_ctx(case)
    out = pa.prefill_attention(*ctx_case.args, **ctx_case.kwargs)
    pa.compare(out, pa.prefill_attention_reference(*case.args, **case.kwargs), ctx_case)


@pytest.mark.gpu
def test_gpu_graph_replay_follows_the_device_metadata() -> None:
    """Captured once, replayed after the step metadata, q and V changed in place: no host state."""
    dev = _cuda()
    cell = pa.CELLS[1]  # TP1, FP8 pages
    case = pa.make_step_case(cell.shape, [200, 50], [300, 0], dev, torch.Generator().manual_seed(9),
                             cell.config["tiles"], max_query_len=256)
    q, k, v, table, seq_lens, qstart, out = case.args
    pa.prefill_attention(*case.args, **case.kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pa.prefill_attention(*case.args, **case.kwargs)
    seq_lens.copy_(torch.tensor([420, 40], dtype=torch.int32))  # keys stay inside what was written
    qstart.copy_(torch.tensor([0, 220, 250], dtype=torch.int32))
    q.copy_(torch.randn(q.shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev))
    v.view(torch.uint8).bitwise_xor_(0x80)  # flip every V sign (E4M3 sign bit)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = pa.prefill_attention_reference(*case.args, **case.kwargs)
    pa.compare(out, ref, case)
