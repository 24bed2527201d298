"""n and best_of served by the engine (tiny preset, fp32, CPU): candidates equal single seeded runs, the prompt
is prefilled once (the others reuse its pages through the prefix cache), best_of returns the n best by cumulative
logprob, cumulative_logprob is the sum of the chosen tokens' logprobs, aborting the leader aborts the group.

Tolerance: token ids exact (same seeds, same per-request generators: batch-independent sampling); logprob sums
to 1e-4 (the candidates' logprobs come from differently batched steps: fp32 summation order, ~1e-6 per token).
"""

from __future__ import annotations

import pytest
import torch

from m3serve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20, max_num_batched_tokens=128)


def _prompt(seed: int, n: int) -> dict:
    return {"prompt_token_ids": torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()}


def test_n_candidates_equal_seeded_single_runs(llm):
    p = _prompt(0, 40)
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True, logprobs=1)
    out = llm.generate([p], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        alone = llm.generate([p], SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i, ignore_eos=True,
                                                 logprobs=1), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
        assert c.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids)))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_prompt_is_prefilled_once(llm):
    """60-token prompt, 16-token pages: the leader computes all 60, each other candidate only what lies past
    the 3 full pages it finds in the prefix cache."""
    llm.engine.blocks.clear_prefix_cache()
    computed: dict[int, int] = {}
    schedule = llm.engine.scheduler.schedule

    def counting():
        chunks = schedule()
        for c in chunks:
            computed[c.request.request_id] = computed.get(c.request.request_id, 0) + c.num_tokens
        return chunks
    llm.engine.scheduler.schedule = counting
    try:
        p = _prompt(1, 60)
        out = llm.generate([p], SamplingParams(n=4, max_tokens=5, temperature=1.0, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        llm.engine.scheduler.schedule = schedule
    leader = int(out.request_id)
    assert computed[leader] == 60 + 4                                 # prompt + 4 decode steps
    others = {rid: n for rid, n in computed.items() if rid != leader}
    assert len(others) == 3 and all(n == 60 - 48 + 4 for n in others.values())


def test_best_of_returns_the_best_n(llm):
    p = _prompt(2, 30)
    params = SamplingParams(n=2, best_of=5, max_tokens=8, temperature=1.2, seed=3, ignore_eos=True)
    out = llm.generate([p], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(c.logprobs is None for c in out.outputs)
    cands = [llm.generate([p], SamplingParams(max_tokens=8, temperature=1.2, seed=3 + i, ignore_eos=True,
                                              logprobs=0), use_tqdm=False)[0].outputs[0] for i in range(5)]
    best = sorted(cands, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_cumulative_logprob_is_none_without_logprobs(llm):
    out = llm.generate([_prompt(3, 10)], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].cumulative_logprob is None


def test_groups_mixed_with_single_requests_and_without_prefix_cache():
    plain = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20, enable_prefix_caching=False)
    ps = [_prompt(4, 25), _prompt(5, 33)]
    params = [SamplingParams(n=2, max_tokens=6, temperature=0.7, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    outs = plain.generate(ps, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1]
    for i in range(2):
        alone = plain.generate([ps[0]], SamplingParams(max_tokens=6, temperature=0.7, seed=1 + i, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        assert outs[0].outputs[i].token_ids == alone.token_ids
    assert not plain.engine.has_work() and not plain.engine.requests


def test_abort_of_the_leader_aborts_the_group(llm):
    eng = llm.engine
    leader = eng.add_request(_prompt(6, 20)["prompt_token_ids"], SamplingParams(n=3, max_tokens=5, temperature=1.0))
    members = leader.group.members
    eng.step()
    eng.abort(leader.request_id)
    assert all(m.is_finished and m.finish_reason == "abort" for m in members)
    assert not eng.has_work() and not eng._deferred
    assert all(m.request_id not in eng.requests for m in members)


def test_bad_n_and_best_of_name_the_field():
    for kw, field in (({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "temperature": 0.0},
                                                                             "best_of"), ({"n": True}, "n")):
        with pytest.raises(ValueError, match=f"SamplingParams.{field} ="):
            SamplingParams(**kw)
