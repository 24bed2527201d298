"""Speculative decoding under tensor parallelism on CPU (gloo): LLM(..., speculative_config=...,
tensor_parallel_size=2) against the same at TP 1.

Greedy outputs must be token-identical: fp32, the only TP differences are summation orders (~1e-7), far below
the gap between the top two logits of these models. The drafter is replicated on every rank, so it proposes
the same drafts at TP 1 and TP 2 and the acceptance counts agree too. Greedy verification and greedy drafts
take the vocab-parallel argmax: rank 0 never gathers a full logits row for them. Seeded sampled requests (and
logprobs) gather the full rows and run the same rejection sampler with the same device RNG on rank 0, so they
draw the same tokens as at TP 1.
"""

from __future__ import annotations

import os

import pytest

from m3serve import LLM, SamplingParams
from m3serve.llm import DEFAULT_MODEL_DIR
from m3serve.model.parallel import TPGroup
from tests.spec.specutil import prompts as token_prompts

KW = dict(device="cpu", dtype="float32", kv_cache_bytes=4 << 20, max_num_batched_tokens=48)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return _tokens(outs), llm.engine.stats()["spec_decode"]


@pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "eagle3", "config.json")),
                    reason="the embedded model and its drafter are not in this checkout")
def test_embedded_model_tp2_speculative_greedy_equals_tp1():
    # TP 1 speculates at every batch size too (the batch-size policy is off under TP)
    spec = {"method": "eagle3", "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3"), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    prompts = ["To be, or not to be, that is the question:", "ROMEO:\n", "The king is dead. Long live",
               "First Citizen:\nBefore we proceed any further, hear me speak."]
    one = LLM(DEFAULT_MODEL_DIR, speculative_config=spec, **KW)
    plain = LLM(DEFAULT_MODEL_DIR, **KW)
    want, st1 = _run(one, prompts, GREEDY)
    assert want == _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert st1["acceptance_length"] > 1.5            # the trained drafter really drafts
    with LLM(DEFAULT_MODEL_DIR, speculative_config=spec, tensor_parallel_size=2, **KW) as two:
        got, st2 = _run(two, prompts, GREEDY)
        assert two.engine.kv.spec.num_draft_layers == 1
        procs = list(two.tp_context.procs.values())
    assert got == want
    assert (st2["verify_steps"], st2["accepted_tokens"]) == (st1["verify_steps"], st1["accepted_tokens"])
    assert [p.returncode for p in procs] == [0]


def test_shared_head_drafter_tp2_equals_tp1_greedy_and_sampled(monkeypatch):
    # tiny + a random drafter that shares the target's vocab-parallel embedding and LM head: the greedy drafts
    # are a vocab-parallel argmax and the draft embedding an all-reduce, which the follower must match.
    spec = {"method": "eagle3", "model": None, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    prompts = [{"prompt_token_ids": p} for p in token_prompts(4, 5, 70, seed=40)]
    mixed = [GREEDY, SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True)]
    one = LLM("tiny", speculative_config=spec, **KW)
    want_greedy, _ = _run(one, prompts, GREEDY)
    want_mixed = one.generate(prompts, mixed, use_tqdm=False)
    gathers = []
    all_gather_last = TPGroup.all_gather_last
    monkeypatch.setattr(TPGroup, "all_gather_last", lambda self, x: gathers.append(x.shape) or all_gather_last(self, x))
    with LLM("tiny", speculative_config=spec, tensor_parallel_size=2, **KW) as two:
        assert two.engine.speculation.drafter.lm_head is None and two.model.tp.size == 2
        got_greedy, st = _run(two, prompts, GREEDY)
        assert gathers == [] and st["verify_steps"] > 0      # greedy: no full logits rows on rank 0
        got_mixed = two.generate(prompts, mixed, use_tqdm=False)
        assert gathers                                       # sampled rows and logprobs gather them
    assert got_greedy == want_greedy
    assert _tokens(got_mixed) == _tokens(want_mixed)
    for a, b in zip(want_mixed[2].outputs[0].logprobs, got_mixed[2].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)   # fp32 summation order


def test_bad_speculative_config_fails_before_any_worker_starts():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM("tiny", speculative_config={"method": "eagle3", "num_speculative_tokens": 0}, tensor_parallel_size=2,
            **KW)


def test_batch_size_policy_is_refused_before_any_worker_starts():
    """Its plain steps are not broadcast to the followers: a value is refused (the default there is None)."""
    with pytest.raises(ValueError, match="disable_by_batch_size = 2"):
        LLM("tiny", speculative_config={"method": "eagle3", "num_speculative_tokens": 3, "disable_by_batch_size": 2},
            tensor_parallel_size=2, **KW)
