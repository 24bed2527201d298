"""prompt_logprobs through the engine (tiny preset, fp32, CPU) against log_softmax of one unpaged forward of the
whole prompt: chunked prefill, a prompt whose pages sit in the prefix cache, candidates of n, and preemption.

Tolerance 1e-4 absolute on logprobs: paged chunked vs unpaged whole-sequence forward in fp32 differ only by
summation order (test_engine.py sees < 1e-5 on the last row; 1e-4 leaves room over 100 rows).
"""

from __future__ import annotations

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.model.m3 import ForwardBatch, SeqSpan


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20, max_num_batched_tokens=32)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _unpaged(llm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = llm.model(ForwardBatch(torch.tensor(ids), torch.arange(len(ids)), [SeqSpan(0, len(ids), len(ids))]))
    return torch.log_softmax(logits.float(), -1)


def _check(llm, ids: list[int], got, k: int) -> None:
    lp = _unpaged(llm, ids)
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry = got[p]
        tok = ids[p]
        assert tok in entry and abs(entry[tok] - lp[p - 1, tok].item()) < 1e-4
        assert entry[tok].logprob == float(entry[tok])
        top = torch.topk(lp[p - 1], k)
        assert [t for t in entry if entry[t].rank is not None] == top.indices.tolist()
        assert all(abs(entry[t] - v) < 1e-4 for t, v in zip(top.indices.tolist(), top.values.tolist()))
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_chunked_and_after_prefix_cache(llm):
    ids = _prompt(0, 75)                                     # 3 chunks of <= 32 tokens
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([{"prompt_token_ids": ids}], plain, use_tqdm=False)       # its pages are now cached
    assert llm.engine.blocks.num_cached_pages() >= 4
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    _check(llm, ids, out.prompt_logprobs, 3)
    assert llm.generate([{"prompt_token_ids": ids}], plain, use_tqdm=False)[0].prompt_logprobs is None


def test_prompt_logprobs_in_a_batch_and_with_n(llm):
    a, b = _prompt(1, 40), _prompt(2, 19)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}],
                        [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0),
                         SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=4, prompt_logprobs=2)],
                        use_tqdm=False)
    _check(llm, a, outs[0].prompt_logprobs, 0)
    _check(llm, b, outs[1].prompt_logprobs, 2)
    assert len(outs[1].outputs) == 2


def test_prompt_logprobs_survive_preemption():
    small = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=12 * 40960, max_num_seqs=4,
                max_num_batched_tokens=24)
    ps = [_prompt(10 + i, 38) for i in range(4)]
    outs = small.generate([{"prompt_token_ids": p} for p in ps],
                          SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
                          use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        _check(small, p, o.prompt_logprobs, 1)
