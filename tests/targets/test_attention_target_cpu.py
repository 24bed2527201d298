"""The decode target's attention path (kv.write, msa.scores, msa.select, attn.paged through m3serve.targets.attention)
end to end in the engine, on CPU under the Triton interpreter: greedy tokens equal the stock path's, for a BF16 and
a hybrid NVFP4 cache, with chunked prefill, two sequences of different lengths, and MSA selection active (the
40-token prompt spans 3 blocks of 16 > top-2). The kernels differ from stock by summation order only; at this size
no argmax is near a tie (checked: the same tokens come out)."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.model.loader import load_model
from m3serve.targets.attention import PAGED_KERNELS


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=2)


def _run(model, target: bool, kv: str):
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=2, max_num_batched_tokens=32,
                                        max_model_len=128, kv_cache_dtype=kv))
    eng.runner.target_attention = target
    if target:
        model.use_attention(PAGED_KERNELS)   # as enable_target does (it refuses the tiny preset's cells on CPU)
    reqs = [eng.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            for n in (40, 9)]
    while eng.has_work():
        eng.step()
    return [r.output_token_ids for r in reqs]


# The NVFP4 cache runs its E2M1 decode in the interpreter: ~6 min on 2 cores, so it is in the slow tier
# (`pytest -m slow`, .ci/run's second step); the BF16 case keeps the same path in the fast tier.
@pytest.mark.parametrize("kv", ["bf16", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_target_attention_matches_stock(model, kv):
    ref = _run(model, False, kv)
    got = _run(model, True, kv)
    assert got == ref and all(len(t) == 2 for t in got)


def test_split_plan_counts_key_tiles_on_msa_layers():
    """MSA layers split over the key tiles attn.paged walks (NVFP4 pages in half-page tiles: 2 per block at
    P = 128), dense layers over blocks; graph buckets and eager steps of the same size split alike."""
    from m3serve.config import preset
    from m3serve.kernels.attention.paged import choose_num_splits
    from m3serve.kv.spec import KVCacheSpec
    from m3serve.runtime.step_inputs import sparse_tiles_per_block, split_plan
    m3 = KVCacheSpec.from_model_config(preset("minimax-m3"), kv_cache_dtype="nvfp4")
    assert sparse_tiles_per_block(m3) == 2
    dense, sparse = split_plan(1, 1025, 4, 16, sparse_tiles_per_block(m3))
    assert dense == choose_num_splits(1, 1025, kv_heads=4) == 64
    assert sparse == 32   # one 64-key tile per split at batch 1 (264 programs wanted, 32 tiles available)
    assert split_plan(13, 1025, 4, 16, 2) == split_plan(16, 1025, 4, 16, 2)   # 13 rows run in the 16-row bucket
    bf16 = KVCacheSpec.from_model_config(preset("minimax-m3"), kv_cache_dtype="bf16")
    assert sparse_tiles_per_block(bf16) == 1   # whole 128-key pages
    with pytest.raises(ValueError, match="max_blocks"):
        split_plan(1, 0, 4, 16, 2)


# --- long prefill steps on MSA layers: attn.prefill_sparse ------------------------------------------------------

# a 49-token first chunk and a 20-token chunk after 37 tokens of context (tiny preset: 16-key blocks = pages, top-2)
MSA_QUERY, MSA_CONTEXT = [49, 20], [0, 37]


def _msa_layer_step(kv_dtype: str, query_lens: list[int], context_lens: list[int], sparse: bool = True,
                    device: str = "cpu"):
    """A tiny-preset attention layer (the first sparse one, or the first dense one), a PagedKVCache holding each
    sequence's context (written as the stock path writes it), and the step's tokens: (attn, cache, step,
    slot_mapping, q, k, v, iq, ik, per-sequence slots)."""
    from m3serve.config import preset
    from m3serve.kv.cache import PagedKVCache
    from m3serve.kv.spec import KVCacheSpec
    from m3serve.model.m3 import Attention
    from m3serve.runtime.step_inputs import PagedStep

    cfg = preset("tiny")
    attn = Attention(cfg, cfg.layer_types.index("sparse" if sparse else "full"))
    spec = KVCacheSpec.from_model_config(cfg, kv_cache_dtype=kv_dtype)
    p, hk, hq, d, di = spec.page_size, attn.hk, attn.hq, cfg.head_dim, cfg.index_head_dim
    cache = PagedKVCache(spec, num_slots=16, device=device)
    gen = torch.Generator().manual_seed(3)
    lens = [n + c for n, c in zip(query_lens, context_lens)]
    perm = (torch.randperm(15, generator=gen) + 1).tolist()
    slots, table = [], torch.zeros(len(lens), 8, dtype=torch.int32)
    for s, L in enumerate(lens):
        slots.append(torch.tensor([perm.pop() for _ in range(-(-L // p))]))
        table[s, :len(slots[-1])] = slots[-1].to(torch.int32)

    def mapping(s: int, pos: torch.Tensor) -> torch.Tensor:
        return slots[s][pos // p] * p + pos % p

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    for s, c in enumerate(context_lens):
        if c:
            cache.write(attn.layer, mapping(s, torch.arange(c)).to(device), rand(c, hk, d), rand(c, hk, d),
                        rand(c, di) if sparse else None)
    t = sum(query_lens)
    slot_mapping = torch.cat([mapping(s, c + torch.arange(n)) for s, (n, c) in enumerate(zip(query_lens,
                                                                                           context_lens))]).to(device)
    q, k, v = 2 * rand(t, hq, d), rand(t, hk, d), rand(t, hk, d)
    iq, ik = (rand(t, hk, di), rand(t, di)) if sparse else (None, None)
    step = PagedStep(slot_table=table.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                     query_start=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                              device=device),
                     max_query_len=max(query_lens), num_splits=1, num_splits_sparse=1)
    return attn.to(device), cache, step, slot_mapping, q, k, v, iq, ik, [sl.to(device) for sl in slots]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_long_prefill_on_an_msa_layer_runs_attn_prefill_sparse(kv, monkeypatch):
    """With MSA_PREFILL_TILED on (off by default), a step with more than DECODE_MAX_QUERY query tokens on an MSA
    layer whose pages attn.prefill reads: one attn.prefill_sparse launch over msa.select's selection (attn.paged not
    called), matching the stock model's attention (Attention.core: the indexer's block scores, select_blocks,
    attend with the selection mask) over the same cache."""
    from m3serve.model import msa
    from m3serve.targets import attention as target

    monkeypatch.setattr(target, "MSA_PREFILL_TILED", True)

    attn, cache, step, slot_mapping, q, k, v, iq, ik, slots = _msa_layer_step(kv, MSA_QUERY, MSA_CONTEXT)
    calls = []
    real = target.prefill_attention
    monkeypatch.setattr(target, "prefill_attention", lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    monkeypatch.setattr(target, "paged_attention", lambda *a, **kw: pytest.fail("attn.paged on a long MSA prefill"))
    out = target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step)
    assert len(calls) == 1 and calls[0]["block_size"] == attn.cfg.index_block_size
    sel = calls[0]["sel"]
    c = attn.cfg
    q0 = 0
    for s, (n, ctx) in enumerate(zip(MSA_QUERY, MSA_CONTEXT)):
        L, rows = n + ctx, slice(q0, q0 + n)
        keys, values, index_keys = cache.read(attn.layer, slots[s], L, torch.bfloat16)
        pos = (L - n + torch.arange(n))[None]
        stock = attn.core(q[rows][None], keys[None], values[None], iq[rows][None], index_keys[None], pos)[0]
        picked = msa.select_blocks(msa.block_scores(iq[rows][None], index_keys[None], pos, c.index_block_size), pos,
                                   c.index_block_size, c.index_topk_blocks, c.index_local_blocks, c.index_init_blocks)
        assert torch.equal(sel[rows].permute(1, 0, 2), picked[0].to(torch.int32))
        torch.testing.assert_close(out[rows].float(), stock, rtol=2**-7, atol=1e-6)
        q0 += n
    visible = (torch.cat([torch.arange(n) + ctx for n, ctx in zip(MSA_QUERY, MSA_CONTEXT)]) // 16 + 1)[:, None]
    assert bool(((sel >= 0).sum(-1) < visible).any()), "the selection must drop some visible blocks"


def _routed(monkeypatch, kv: str, query_lens: list[int], sparse: bool = True) -> list[tuple[str, dict]]:
    """Which attention kernel a layer's step goes to (the kernels themselves stubbed out: routing only)."""
    from m3serve.targets import attention as target

    attn, cache, step, slot_mapping, q, k, v, iq, ik, _ = _msa_layer_step(kv, query_lens, [0] * len(query_lens),
                                                                          sparse)
    calls = []
    for name in ("write_layer", "msa_block_scores", "msa_select"):
        monkeypatch.setattr(target, name, lambda *a, **kw: None)
    monkeypatch.setattr(target, "prefill_attention", lambda *a, **kw: calls.append(("prefill", kw)))
    monkeypatch.setattr(target, "paged_attention", lambda *a, **kw: calls.append(("paged", kw)))
    target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step)
    return calls


@pytest.mark.parametrize("kv,query_lens,sparse,tiled,enabled,want", [
    ("bf16", [49, 3], True, True, True, "prefill_sparse"),
    ("fp8", [60], True, True, True, "prefill_sparse"),
    ("bf16", [48, 48], True, True, True, "paged"),       # decode / verify / short chunks: attn.paged
    ("nvfp4", [60], True, True, True, "paged"),          # attn.prefill reads no NVFP4 pages
    ("bf16", [60], True, True, False, "paged"),          # prefill.SPARSE_ENABLED off: back to attn.paged
    ("bf16", [60], True, False, True, "paged"),          # the default: MSA prefill rows on attn.paged
    ("bf16", [60], False, False, False, "prefill"),      # dense layers: attn.prefill, whatever the sparse switches
    ("fp8", [60], False, True, True, "prefill"),
])
def test_msa_layer_routing(monkeypatch, kv, query_lens, sparse, tiled, enabled, want):
    from m3serve.kernels.attention import prefill
    from m3serve.targets import attention as target
    monkeypatch.setattr(prefill, "SPARSE_ENABLED", enabled)
    monkeypatch.setattr(target, "MSA_PREFILL_TILED", tiled)
    calls = _routed(monkeypatch, kv, query_lens, sparse)
    assert len(calls) == 1
    kind, kw = calls[0]
    got = "prefill_sparse" if kind == "prefill" and kw.get("sel") is not None else kind
    assert got == want, calls


# --- long prefill steps on dense layers: the context copy ------------------------------------------------------

@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_long_prefill_reads_a_context_copy(monkeypatch, kv, device):
    """A dense layer, an eager step over CONTEXT_COPY_MIN_ROWS rows: attn.prefill gets `ctx`, the step's visible pages
    copied head-major as bf16 into the held scratch (poisoned before), and its output is the page form's (the same
    operand values through the same tiles at this head dim) and the stock attention's. Without host lengths (a
    graph), without room in the scratch, below the pairs-per-key threshold, or at the row threshold, the pages are
    read directly."""
    from m3serve.targets import attention as target

    attn, cache, step, slot_mapping, q, k, v, iq, ik, slots = _msa_layer_step(kv, MSA_QUERY, MSA_CONTEXT,
                                                                              sparse=False, device=device)
    kp = cache.pages(attn.layer, "k")
    scratch = torch.full((4 * 16 * kp[0].numel(),), float("nan"), dtype=torch.bfloat16, device=device)
    monkeypatch.setattr(target, "held_scratch", lambda dev, dt, n: scratch[:n] if n <= scratch.numel() else None)
    monkeypatch.setattr(target, "CONTEXT_COPY_MIN_ROWS", 48)
    calls = []
    real = target.prefill_attention
    monkeypatch.setattr(target, "prefill_attention", lambda *a, **kw: (calls.append(kw.get("ctx")), real(*a, **kw))[1])
    direct = target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step)   # host lengths unknown
    step.host_seq_lens = step.seq_lens.cpu().numpy().astype("int64")
    step.host_query_lens = (step.query_start[1:] - step.query_start[:-1]).cpu().numpy().astype("int64")
    # 2175 causal pairs over 8 copied pages of 16 keys: 16.99 pairs per key
    monkeypatch.setattr(target, "CONTEXT_COPY_MIN_PAIRS_PER_KEY", 16)
    out = target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step)
    assert calls[0] is None and calls[1] is not None
    k_ctx, v_ctx, key_start = calls[1]
    pages = sum(len(sl) for sl in slots)
    assert k_ctx.shape == (kp.shape[1], pages * kp.shape[2], kp.shape[3]) and k_ctx.data_ptr() == scratch.data_ptr()
    assert key_start.tolist() == [0, len(slots[0]) * kp.shape[2]]
    assert torch.equal(out, direct)
    # the step's page index is made once and reused by its other dense layers
    made = []
    real_index = target.context_index
    monkeypatch.setattr(target, "context_index", lambda *a: (made.append(a), real_index(*a))[1])
    assert torch.equal(target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step), out)
    assert made == [] and len(calls) == 3 and calls[2] is not None
    q0 = 0
    for s, (n, ctx) in enumerate(zip(MSA_QUERY, MSA_CONTEXT)):
        L, rows = n + ctx, slice(q0, q0 + n)
        keys, values, _ = cache.read(attn.layer, slots[s], L, torch.bfloat16)
        pos = (L - n + torch.arange(n, device=device))[None]
        stock = attn.core(q[rows][None], keys[None], values[None], None, None, pos)[0]
        torch.testing.assert_close(out[rows].float(), stock.float(), rtol=2**-7, atol=1e-6)
        q0 += n

    monkeypatch.setattr(target, "held_scratch", lambda dev, dt, n: None)
    target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step)
    monkeypatch.setattr(target, "held_scratch", lambda dev, dt, n: scratch[:n])
    monkeypatch.setattr(target, "CONTEXT_COPY_MIN_PAIRS_PER_KEY", 17)   # the copy would not repay itself
    target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step)
    monkeypatch.setattr(target, "CONTEXT_COPY_MIN_PAIRS_PER_KEY", 16)
    monkeypatch.setattr(target, "CONTEXT_COPY_MIN_ROWS", 49)
    target.attention_forward(attn, q, k, v, iq, ik, slot_mapping, cache, step)
    assert calls[3:] == [None, None, None]
