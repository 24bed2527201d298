"""The decode graphs' greedy variant on the fused greedy head (head.bf16: no logits written) at real dims: it is
bound and captured without logits, its tokens equal those of graphs captured through the head's logits + argmax
(the same bf16 logits, summed in another order: a near-tie may flip, hence a 90 % floor over 4 x 24 tokens), and a
greedy request that asks for logprobs (which needs the logits) replays the sampling variant and gets the same
tokens as without."""

from __future__ import annotations

import pytest

from tests.runtime.test_decode_target_gpu import _greedy, _need_cuda, _release

pytestmark = pytest.mark.gpu


def _check_greedy_ids(llm, row_counts, seed: int) -> None:
    """The greedy head on fresh hidden states: ids = argmax of the bf16 logits, a pick that differs only where the
    two bf16 logits lie within fp32 summation noise of each other (one bf16 ulp apart or tied), at most 1 in 10."""
    import torch

    from m3serve.kernels.head.bf16 import bf16_ulp
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for rows in row_counts:
        h = torch.randn(rows, llm.model.cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            logits = llm.model.logits(h)
            ids = llm.model.greedy_tokens(h)
        want = logits.argmax(-1)
        top = logits.gather(1, want[:, None])[:, 0]
        got = logits.gather(1, ids[:, None])[:, 0]
        assert bool(((ids == want) | (top - got <= bf16_ulp(top))).all()), (rows, ids, want)
        assert (ids == want).float().mean() >= 0.9, (rows, ids, want)


def test_fused_greedy_head_in_the_decode_graphs():
    _need_cuda()
    from m3serve import LLM, SamplingParams
    from m3serve.runtime.decode_graphs import DecodeGraphs
    llm = LLM("minimax-m3:2", random_weights=True, quantization="nvfp4", kv_cache_bytes=1 << 30, max_model_len=2048,
              max_num_seqs=8)
    runner = llm.engine.runner
    g = runner.graphs
    assert llm.model.greedy_head is not None and g.fused_greedy
    assert all(g.graphs[b].logits is None for b in g.captured)
    assert all(g.sampled_graphs[b].logits is not None for b in g.captured)
    vocab = llm.model.cfg.vocab_size
    prompts = [{"prompt_token_ids": [(11 + 17 * i + 29 * j) % vocab for j in range(30 + 7 * i)]} for i in range(4)]
    replays, sampled = g.replays, g.sampled_replays      # (the engine's warm-up requests sample)
    fused = _greedy(llm, prompts, 24)
    assert g.replays > replays and g.sampled_replays == sampled
    _check_greedy_ids(llm, (1, 3, 8, 16, 33, 48), seed=0)
    # the same greedy requests with logprobs: the engine asks for logits, the sampling variant supplies them
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    with_lp = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert g.sampled_replays > 0
    # graphs captured through the logits (as before the fused head)
    llm.model.greedy_head = None
    plain = DecodeGraphs(llm.model, runner.kv, runner.tables, g.buckets, penalties=llm.engine.penalties)
    plain.capture()
    assert not plain.fused_greedy and all(plain.graphs[b].logits is not None for b in plain.captured)
    runner.graphs = plain
    logits_head = _greedy(llm, prompts, 24)
    assert plain.replays > 0
    for other in (with_lp, logits_head):
        same = sum(a == b for x, y in zip(fused, other) for a, b in zip(x, y))
        assert same >= 0.9 * 4 * 24, (fused, other)
    _release(llm)


def test_head12_greedy_head_in_the_decode_graphs(monkeypatch):
    """With targets.plan.HEAD12 the real-dims head is encoded, bit-checked and tiled at bind; the greedy variant's
    1-8 rows run head.head12 (9-48 the BF16 head), its ids are argmax of the bf16 logits up to fp32 summation order,
    and the decode graphs' tokens agree with graphs captured on the BF16 head (a near-tie may flip: 90 % floor)."""
    _need_cuda()
    from m3serve import LLM
    from m3serve.runtime.decode_graphs import DecodeGraphs
    from m3serve.targets import plan, routing
    monkeypatch.setattr(plan, "HEAD12", True)
    # no prefill graphs: the second binding below would make them stale (the decode graphs are captured again)
    llm = LLM("minimax-m3:2", random_weights=True, quantization="nvfp4", kv_cache_bytes=1 << 30, max_model_len=2048,
              max_num_seqs=8, prefill_graph_tokens=0)
    head = llm.model.greedy_head
    assert head.tiles is not None and head.table12 is not None, "the random head must pass the bit check"
    assert llm.engine.runner.graphs.fused_greedy
    _check_greedy_ids(llm, (1, 2, 8, 9, 33), seed=1)
    vocab = llm.model.cfg.vocab_size
    prompts = [{"prompt_token_ids": [(7 + 13 * i + 31 * j) % vocab for j in range(20 + 9 * i)]} for i in range(4)]
    coded = _greedy(llm, prompts, 24)
    monkeypatch.setattr(plan, "HEAD12", False)
    routing.install(llm.model, "auto")
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(llm.model, runner.kv, runner.tables, runner.graphs.buckets,
                                 penalties=llm.engine.penalties)
    runner.graphs.capture()
    assert llm.model.greedy_head.table12 is None
    bf16 = _greedy(llm, prompts, 24)
    same = sum(a == b for x, y in zip(coded, bf16) for a, b in zip(x, y))
    assert same >= 0.9 * 4 * 24, (coded, bf16)
    _release(llm)


def test_head12_logits_in_the_sampling_graphs(monkeypatch):
    """With targets.plan.HEAD12_LOGITS the head Linear's 1-8 logits rows come from the 12-bit tiles
    (head.head12_logits): within gemm_band of the true-fp32 logits of the BF16 weight at real dims, bf16 values,
    cuBLAS from 9 rows; the sampling variant captured on them (greedy requests that want logprobs replay it) gives
    the tokens of the fused greedy step (a near-tie may flip: 90 % floor)."""
    _need_cuda()
    import torch

    from m3serve import LLM, SamplingParams
    from m3serve.kernels.catalog import assert_band, gemm_band, true_fp32
    from m3serve.targets import plan, routing
    monkeypatch.setattr(plan, "HEAD12", True)
    monkeypatch.setattr(plan, "HEAD12_LOGITS", True)
    llm = LLM("minimax-m3:2", random_weights=True, quantization="nvfp4", kv_cache_bytes=1 << 30, max_model_len=2048,
              max_num_seqs=8, prefill_graph_tokens=0)
    head = llm.model.lm_head
    assert isinstance(head.kernel, routing.HeadLogitsKernel) and head.kernel.tiles is not None
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = head.weight
    for rows in (1, 3, 8, 9):
        h = torch.randn(rows, llm.model.cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            got = llm.model.logits(h)
        with true_fp32():
            ref = h.float() @ w.float().T
            absprod = h.float().abs() @ w.float().abs().T
        assert_band(f"lm_head logits, {rows} rows", got, ref, gemm_band(ref, absprod, h.shape[1]))
        assert torch.equal(got, got.to(torch.bfloat16).float())
    g = llm.engine.runner.graphs
    vocab = llm.model.cfg.vocab_size
    prompts = [{"prompt_token_ids": [(5 + 19 * i + 23 * j) % vocab for j in range(25 + 6 * i)]} for i in range(4)]
    fused = _greedy(llm, prompts, 24)
    sampled = g.sampled_replays
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    with_lp = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert g.sampled_replays > sampled
    same = sum(a == b for x, y in zip(fused, with_lp) for a, b in zip(x, y))
    assert same >= 0.9 * 4 * 24, (fused, with_lp)
    _release(llm)
