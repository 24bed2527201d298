"""The decode target on the GPU: graphs replay the same tokens as the eager target, the target agrees with the
stock path, and a real-dimension forward captures into a CUDA graph (nothing in it syncs the host)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.greedy_ties import assert_only_near_ties

pytestmark = pytest.mark.gpu


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _release(*llms):
    """Drop the LLMs and give their memory back: each of them sized its KV cache from what was free."""
    for llm in llms:
        llm.shutdown()
    del llms
    gc.collect()
    torch.cuda.empty_cache()


# The embedded model needs a few MiB of KV here; a fixed budget keeps the three LLMs of one test from each
# claiming 90 % of the GPU (the default, gpu_memory_utilization=0.9, sizes the cache from what is free).
TINY_KV = 256 << 20


def _greedy(llm, prompts, n):
    from m3serve import SamplingParams
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_embedded_model_graphs_eager_and_stock():
    """Graph replay == eager target token for token (same kernels, same order). Target vs stock: wherever the
    greedy sequences first part, the stock model must itself be near-indifferent between the two tokens there
    (its log-probabilities of them within NEAR_TIE): the target differs from stock only by summation order,
    which in bf16 moves logits by a few ulps and so may flip a near-tie, after which the sequences diverge.
    A real defect flips clear decisions. (The eval over the 500 held-out items is the aggregate gate.)"""
    _need_cuda()
    from m3serve import LLM
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 7 * i))} for i in range(6)]
    target = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", kv_cache_bytes=TINY_KV)
    assert target.engine.runner.graphs is not None
    got = _greedy(target, prompts, 48)
    assert target.engine.runner.graphs.replays > 0
    eager = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", enforce_eager=True, kv_cache_bytes=TINY_KV)
    assert eager.engine.runner.graphs is None and eager.engine.runner.target_attention
    assert _greedy(eager, prompts, 48) == got
    stock = LLM(dtype="bfloat16", max_num_seqs=8, route="off", kv_cache_bytes=TINY_KV)
    ref = _greedy(stock, prompts, 48)
    assert_only_near_ties(stock, [p["prompt_token_ids"] for p in prompts], ref, got)
    _release(target, eager, stock)



@pytest.mark.parametrize("kv", ["nvfp4", "fp8"])
def test_real_dims_forward_captures_in_a_graph(kv):
    """minimax-m3:4 (NVFP4 experts, MXFP8 projections, dense + MSA layers) builds its decode graphs: the whole
    forward, kv.write, MSA scorer/select and paged attention included, was captured, so nothing in it syncs
    the host. Replays agree with the eager target for 8 greedy tokens at batch 2."""
    _need_cuda()
    from m3serve import LLM
    llm = LLM("minimax-m3:4", device="cuda", dtype="bfloat16", random_weights=True, quantization="nvfp4",
              kv_cache_dtype=kv, max_num_seqs=2, max_model_len=4096, gpu_memory_utilization=0.5, route="auto")
    try:
        assert llm.engine.runner.graphs is not None and set(llm.engine.runner.graphs.graphs) == {1, 2}
        prompts = [{"prompt_token_ids": list(range(100, 100 + 2200))}, {"prompt_token_ids": list(range(7, 300))}]
        got = _greedy(llm, prompts, 8)
        assert llm.engine.runner.graphs.replays > 0
        llm.engine.disable_graphs()
        # the same prefill as the first run: with the prompts' pages cached it would compute only their tails,
        # in other chunks (other summation orders), and random weights leave many near-ties to flip
        llm.engine.blocks.clear_prefix_cache()
        assert _greedy(llm, prompts, 8) == got
    finally:
        _release(llm)


@pytest.mark.parametrize("pdl_from", [1, 2])
def test_real_dims_graphs_give_the_same_tokens_with_and_without_pdl(monkeypatch, pdl_from):
    """Programmatic dependent launch changes only when a kernel may start, never what it computes: minimax-m3:4
    (NVFP4 experts, MXFP8 projections, dense + MSA layers) replays the same greedy tokens, token for token, from
    graphs captured with and without it (the same kernels in the same order, so the same bits); a kernel that read
    its producer's output before the producer's grid finished would part them. The engine's graphs, captured
    without PDL (PDL_FROM_BUCKET past every bucket), against DecodeGraphs(pdl_from=1 / 2), which must capture the
    buckets of at least that many rows (of 1, 2, 4) inside pdl_launches(True) and the others inside
    pdl_launches(False)."""
    _need_cuda()
    from m3serve import LLM
    from m3serve.kernels import _jit
    from m3serve.runtime import decode_graphs
    monkeypatch.setattr(decode_graphs, "PDL_FROM_BUCKET", 1 << 30)
    llm = LLM("minimax-m3:4", device="cuda", dtype="bfloat16", random_weights=True, quantization="nvfp4",
              kv_cache_dtype="nvfp4", max_num_seqs=4, max_model_len=2048, gpu_memory_utilization=0.5, route="auto")
    try:
        eng = llm.engine
        buckets = tuple(eng.runner.graphs.graphs)
        assert set(buckets) >= {1, 2, 4}
        prompts = [{"prompt_token_ids": list(range(100 + 50 * i, 100 + 50 * i + 600 + 97 * i))} for i in range(4)]
        ref = _greedy(llm, prompts, 12)
        seen, real = [], _jit.pdl_launches

        def spy(enabled):
            seen.append(enabled)
            return real(enabled)

        monkeypatch.setattr(_jit, "pdl_launches", spy)
        g = decode_graphs.DecodeGraphs(llm.model, eng.kv, eng.runner.tables, buckets, penalties=eng.penalties,
                                       pdl_from=pdl_from)
        g.capture()
        assert not g.blocked
        variants = len(list(g._variants()))   # greedy, sampling, processed: each bucket captures every one
        assert variants >= 1
        want = [b >= pdl_from for b in sorted(buckets, reverse=True) for _ in range(variants)]
        assert seen == want
        eng.runner.graphs = g
        eng.blocks.clear_prefix_cache()
        assert _greedy(llm, prompts, 12) == ref
        assert g.replays > 0
    finally:
        _release(llm)


def test_embedded_model_samples_inside_the_graph_as_the_eager_target_does():
    """Temperature / top-k / top-p rows (seeded and not, mixed with greedy ones) and rows with penalties,
    logit_bias and min_tokens run on the graphs' sampling / processed variants and draw exactly the eager
    target's tokens: same logits (same kernels), same keyed noise, the same penalty state updated on the
    device."""
    _need_cuda()
    from m3serve import LLM, SamplingParams
    prompts = [{"prompt_token_ids": list(range(9 + i, 50 + 5 * i))} for i in range(5)]
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.2, top_p=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2, logit_bias={7: 3.0},
                             ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3,
                             min_tokens=10, seed=4)]
    prompts.append({"prompt_token_ids": list(range(30, 61))})
    prompts.append({"prompt_token_ids": list(range(60, 80))})
    target = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", kv_cache_bytes=TINY_KV, seed=5)
    eager = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", enforce_eager=True, kv_cache_bytes=TINY_KV, seed=5)
    try:
        got = [o.outputs[0].token_ids for o in target.generate(prompts, params, use_tqdm=False)]
        assert target.engine.runner.graphs.sampled_replays > 20 and target.engine.runner.graphs.processed_graphs
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        assert got == want
    finally:
        _release(target, eager)


def test_sample_race_draws_the_torch_samplers_tokens_in_the_graphs():
    """Temperature and greedy rows replay the sampling variant on sample.race and draw exactly the tokens of graphs
    that sample with the torch sampler (race_sampler=False): the same logits, the same keyed noise, the softmax sum
    in another order (a near-tie inside a few ulps could flip; none at these sizes). A step with a top-p row is
    sent to the processed variant and draws what the torch sampler draws there too."""
    _need_cuda()
    from m3serve import LLM, SamplingParams
    from m3serve.runtime.decode_graphs import DecodeGraphs
    prompts = [{"prompt_token_ids": list(range(11 + 3 * i, 60 + 4 * i))} for i in range(6)]
    temps = (0.3, 0.8, 1.0, 0.0, 1.5, 2.5)
    params = [SamplingParams(max_tokens=48, temperature=t, seed=100 + i, ignore_eos=True) for i, t in enumerate(temps)]
    top_p = params[:5] + [SamplingParams(max_tokens=48, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True)]
    llm = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", kv_cache_bytes=TINY_KV, seed=5, prefill_graph_tokens=0)
    try:
        eng = llm.engine
        race_graphs = eng.runner.graphs
        assert all(race_graphs.race[b] is not None for b in race_graphs.captured)
        sampled, filtered = race_graphs.sampled_replays, race_graphs.filtered_replays   # after the warm-up's
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert race_graphs.sampled_replays - sampled > 40 and race_graphs.filtered_replays == filtered
        got_p = [o.outputs[0].token_ids for o in llm.generate(prompts, top_p, use_tqdm=False)]
        assert race_graphs.filtered_replays - filtered > 20
        torch_graphs = DecodeGraphs(llm.model, eng.kv, eng.runner.tables, race_graphs.buckets,
                                    penalties=eng.penalties, race_sampler=False)
        torch_graphs.capture()
        assert all(v is None for v in torch_graphs.race.values())
        eng.runner.graphs = torch_graphs
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        want_p = [o.outputs[0].token_ids for o in llm.generate(prompts, top_p, use_tqdm=False)]
        assert torch_graphs.sampled_replays > 40 and torch_graphs.filtered_replays == 0
        assert got == want
        assert got_p == want_p
    finally:
        _release(llm)
