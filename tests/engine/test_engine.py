"""Engine behaviour on the tiny preset (fp32, CPU): batching invariance, chunked prefill, preemption,
prefix reuse, stop conditions, seeded sampling, logprobs and input errors."""

from __future__ import annotations

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.model.m3 import ForwardBatch, SeqSpan

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _prompts(n, lo=5, hi=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 500, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20, max_num_batched_tokens=64)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_alone(llm):
    prompts = _prompts(6)
    alone = [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    batched = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert batched == alone
    assert all(len(t) == 20 for t in alone)


def test_engine_logits_equal_unpaged_forward(llm):
    p = _prompts(1, 70, 71, seed=4)[0]["prompt_token_ids"]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    ids = torch.tensor(p)
    with torch.no_grad():
        logits = llm.model(ForwardBatch(ids, torch.arange(len(p)), [SeqSpan(0, len(p), len(p))]))[-1]
    lp = torch.log_softmax(logits, -1)
    assert out.token_ids[0] == int(lp.argmax())
    for tok, v in out.logprobs[0].items():   # fp32 paged vs unpaged: same math, different chunking order
        assert abs(v - lp[tok].item()) < 1e-5


def test_preemption_under_page_pressure():
    # 12 pages of 16 tokens for 4 requests that each grow to ~70 tokens (5 pages): preemption must happen.
    small = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=12 * 40960, max_num_seqs=4)
    assert small.engine.kv.num_slots == 12
    prompts = _prompts(4, 30, 40, seed=1)
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    outs = _tokens(small.generate(prompts, params, use_tqdm=False))
    assert small.engine.scheduler.num_preemptions > 0
    alone = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=4 << 20)
    assert outs == [_tokens(alone.generate([p], params, use_tqdm=False))[0] for p in prompts]
    bm = small.engine.blocks
    bm.clear_prefix_cache()
    assert bm.num_free_slots() == small.engine.kv.num_slots and not bm.live_seq_ids()


def test_prefix_cache_reuse_keeps_outputs(llm):
    base = _prompts(1, 60, 61, seed=2)[0]["prompt_token_ids"]
    first = _tokens(llm.generate([{"prompt_token_ids": base}], GREEDY, use_tqdm=False))[0]
    cached_before = llm.engine.blocks.num_cached_pages()
    assert cached_before >= 60 // 16
    again = _tokens(llm.generate([{"prompt_token_ids": base}], GREEDY, use_tqdm=False))[0]
    assert again == first


def test_stop_conditions(llm):
    p = _prompts(1, seed=3)
    ref = _tokens(llm.generate(p, GREEDY, use_tqdm=False))[0]
    stop_tok = ref[5]
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop_tok) + 1] and out.finish_reason == "stop"
    out = llm.generate(p, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) <= 3


def test_seeded_sampling_is_batch_independent(llm):
    prompts = _prompts(4, seed=5)
    sp = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i) for i in range(4)]
    batched = _tokens(llm.generate(prompts, sp, use_tqdm=False))
    alone = [_tokens(llm.generate([p], s, use_tqdm=False))[0] for p, s in zip(prompts, sp)]
    assert batched == alone
    other_seed = _tokens(llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.9, seed=7),
                                      use_tqdm=False))[0]
    assert other_seed != batched[0]


def test_bad_input_names_the_problem(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 5000}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_token_ids: 1 ids outside \[0, 512\)"):
        llm.generate([{"prompt_token_ids": [5, 512]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    # a bad request in a batch leaves nothing behind: the next call runs normally
    with pytest.raises(ValueError):
        llm.generate(_prompts(2) + [{"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_work()
    assert len(_tokens(llm.generate(_prompts(1), GREEDY, use_tqdm=False))[0]) == 20
