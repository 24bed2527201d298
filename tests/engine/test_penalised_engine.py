"""Penalties, logit_bias and min_tokens through the engine (tiny preset, fp32, CPU).

The equivalence test runs penalised greedy requests batched with plain greedy and seeded sampled ones, and
compares them with a cache-free reference loop: the whole sequence through the model each step (no KV cache,
no batching), reference_process on the last row, argmax. Greedy token ids must be equal; paged and unpaged
logits agree to ~1e-5 in fp32 (tests/engine/test_engine.py), far inside the margins between distinct logits
of these prompts, so any mismatch is a real difference in the processing.
"""

from __future__ import annotations

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.engine.penalties import reference_process
from m3serve.model.m3 import ForwardBatch, SeqSpan


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20, max_num_batched_tokens=64,
               max_num_seqs=8)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(llm, prompt: list[int], params: SamplingParams) -> list[int]:
    eos = llm.engine.eos
    out: list[int] = []
    for _ in range(params.max_tokens):
        ids = prompt + out
        with torch.no_grad():
            logits = llm.model(ForwardBatch(torch.tensor(ids), torch.arange(len(ids)),
                                            [SeqSpan(0, len(ids), len(ids))]))[-1]
        tok = int(reference_process(logits, prompt, out, params, eos).argmax())
        out.append(tok)
        if (not params.ignore_eos and tok in eos) or tok in params.stop_token_ids:
            break
    return out


PENALISED = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=0.6),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=-0.5),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                   logit_bias={17: 3.0, 99: -100.0}),
]


def test_penalised_greedy_equals_cache_free_reference(llm):
    prompts = [_prompt(i, 20 + 7 * i) for i in range(len(PENALISED))]
    plain = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=14, temperature=0.8, seed=5, ignore_eos=True)
    extra = [_prompt(50, 30), _prompt(51, 25)]
    alone = [llm.generate([{"prompt_token_ids": p}], s, use_tqdm=False)[0].outputs[0].token_ids
             for p, s in zip(extra, [plain, sampled])]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + extra], PENALISED + [plain, sampled],
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for p, params, toks in zip(prompts, PENALISED, got):
        assert toks == _reference(llm, p, params)
    assert got[len(PENALISED):] == alone            # requests without processing are not disturbed
    unpenalised = [llm.generate([{"prompt_token_ids": p}], plain, use_tqdm=False)[0].outputs[0].token_ids
                   for p in prompts]
    assert all(a != b for a, b in zip(unpenalised, got))     # the penalties changed every run


def test_repetition_penalty_stops_a_forced_loop(llm):
    p = _prompt(7, 12)
    forced = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={42: 8.0})
    assert llm.generate([{"prompt_token_ids": p}], forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 6
    heavy = SamplingParams(**{**forced.__dict__, "frequency_penalty": 2.0})
    toks = llm.generate([{"prompt_token_ids": p}], heavy, use_tqdm=False)[0].outputs[0].token_ids
    assert toks.count(42) < 6 and toks == _reference(llm, p, heavy)


def test_min_tokens_holds_back_eos_and_stop_ids(llm):
    p = _prompt(8, 15)
    eos = min(llm.engine.eos)
    want_eos = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={eos: 100.0})
    out = llm.generate([{"prompt_token_ids": p}], want_eos, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    held = SamplingParams(**{**want_eos.__dict__, "min_tokens": 5})
    out = llm.generate([{"prompt_token_ids": p}], held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop" and out.token_ids == _reference(llm, p, held)
    stop_id = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[77],
                             logit_bias={77: 100.0}, min_tokens=3)
    out = llm.generate([{"prompt_token_ids": p}], stop_id, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == 77 and len(out.token_ids) == 4 and out.finish_reason == "stop"


def test_penalties_survive_preemption():
    """Preempted requests keep (or rebuild) their counts: outputs equal an unpressured run."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, frequency_penalty=0.7,
                            repetition_penalty=1.3)
    prompts = [{"prompt_token_ids": _prompt(20 + i, 35)} for i in range(4)]
    small = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=12 * 40960, max_num_seqs=4)
    outs = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0
    roomy = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=4 << 20)
    assert outs == [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]


def test_bias_token_outside_vocab_names_the_field(llm):
    with pytest.raises(ValueError, match=r"SamplingParams.logit_bias: token id 512 outside"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
    assert not llm.engine.has_work()


def test_speculative_engine_refuses_what_it_cannot_apply():
    spec = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20,
               speculative_config={"method": "eagle3", "model": None, "num_speculative_tokens": 2})
    for kw in ({"presence_penalty": 0.5}, {"repetition_penalty": 1.2}, {"logit_bias": {3: 1.0}},
               {"min_tokens": 2}, {"prompt_logprobs": 1}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"SamplingParams.{name} .*speculative decoding"):
            spec.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, **kw), use_tqdm=False)
    # n runs on it too (candidates are ordinary requests)
    out = spec.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(n=2, max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.outputs[0].token_ids == out.outputs[1].token_ids
