"""vLLM's token filters (min_p, allowed_token_ids, bad_words) and truncate_prompt_tokens: the batched penalty
state against the per-token reference on fresh random inputs, the per-step bans of multi-token bad words, and
the engine's tokens against a cache-free reference loop (tiny preset, fp32, CPU).

Tolerance: the banned set must be identical and the surviving logits equal exactly (torch.equal on the finite
entries): the filters only write -inf, they never change a surviving value. min_p is decided in logit units by
the state (x - max < T ln min_p) and in probability units by the reference (p < min_p p_max); on fresh
continuous random logits no token lies within rounding of the boundary (the test checks the margin first).
"""

from __future__ import annotations

import math

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.engine import token_filters
from m3serve.engine.penalties import PenaltyState, reference_process
from m3serve.engine.request import Request, Status
from m3serve.model.m3 import ForwardBatch, SeqSpan

EOS = {1}


def _req(rid, prompt, output, params, bad=()) -> Request:
    r = Request(rid, list(prompt), params)
    r.output_token_ids = list(output)
    r.status = Status.RUNNING
    r.bad_word_ids = tuple(bad)
    return r


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.equal(got[fin], want[fin])


def _min_p_margin(x: torch.Tensor, params: SamplingParams) -> float:
    """Smallest |(x_v - x_max) - T ln min_p| over finite x_v: the distance of any token from min_p's boundary."""
    fin = x[torch.isfinite(x)]
    return float(((fin - fin.max()) - params.temperature * math.log(params.min_p)).abs().min())


def test_random_rows_match_the_reference():
    g = torch.Generator().manual_seed(1234)
    vocab, rows = 97, 6
    state = PenaltyState(8, vocab, "cpu", EOS)
    reqs, bads = [], []
    for i in range(rows):
        u = lambda a, b: float(torch.empty(()).uniform_(a, b, generator=g))      # noqa: E731
        allowed = torch.randperm(vocab, generator=g)[:40].tolist() if i % 2 else None
        bad = [tuple(torch.randint(0, vocab, (k,), generator=g).tolist()) for k in (1, 2, 3)]
        params = SamplingParams(temperature=u(0.3, 1.5), min_p=u(0.01, 0.3) if i != 3 else 0.0,
                                allowed_token_ids=allowed, repetition_penalty=u(0.7, 1.5),
                                frequency_penalty=u(-1, 1), logit_bias={int(t): u(-5, 5) for t in
                                                                        torch.randint(0, vocab, (4,), generator=g)})
        prompt = torch.randint(0, vocab, (7,), generator=g).tolist()
        output = torch.randint(0, vocab, (5,), generator=g).tolist()
        if i == 0:          # make the 2- and 3-token bad words' heads end the output: their last tokens are banned
            output = output[:3] + list(bad[2][:2])
            bad[1] = (output[-1], bad[1][1])
        reqs.append(_req(i, prompt, output, params, bad))
        bads.append(bad)
    logits = torch.randn(rows, vocab, generator=g) * 3
    r = state.rows_for(reqs)
    state.refresh()
    got = state.apply(logits.clone(), r)
    for i, req in enumerate(reqs):
        want = reference_process(logits[i], req.prompt_token_ids, req.output_token_ids, req.params, EOS, bads[i])
        if req.params.min_p > 0:
            pre = reference_process(logits[i], req.prompt_token_ids, req.output_token_ids,
                                    SamplingParams(**{**req.params.__dict__, "min_p": 0.0}), EOS, bads[i])
            assert _min_p_margin(pre, req.params) > 1e-4
            assert torch.isinf(want).sum() > torch.isinf(pre).sum()      # min_p removed something
        _same(got[i], want)
    assert torch.isinf(got[0, bads[0][2][2]]) and torch.isinf(got[0, bads[0][1][1]])


def test_multi_token_bad_word_is_banned_only_after_its_head():
    vocab = 11
    state = PenaltyState(2, vocab, "cpu", EOS)
    params = SamplingParams(bad_words=["x"], logit_bias={5: 2.0})
    req = _req(0, [0], [], params, bad=[(3, 4, 5)])
    logits = torch.linspace(-1, 1, vocab)[None]
    rows = state.rows_for([req])
    for out, banned in (([], False), ([3], False), ([3, 4], True), ([3, 4, 5], False), ([9, 3, 4], True)):
        req.output_token_ids = list(out)
        state.refresh()
        x = state.apply(logits, rows)[0]
        assert bool(torch.isinf(x[5])) is banned, out
        if not banned:
            assert float(x[5]) == pytest.approx(float(logits[0, 5]) + 2.0)     # its logit_bias came back


def test_bad_word_sequences_spell_both_forms():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [ord(c) for c in text]
    seqs = token_filters.bad_word_sequences(["  ab", "c"], Tok())
    assert seqs == ((97, 98), (32, 97, 98), (99,), (32, 99))
    with pytest.raises(ValueError, match="bad_words"):
        token_filters.bad_word_sequences(["a"], None)


@pytest.mark.parametrize("kw,msg", [({"min_p": 1.5}, "min_p"), ({"allowed_token_ids": []}, "allowed_token_ids"),
                                    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                                    ({"bad_words": [" "]}, "bad_words"),
                                    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")])
def test_bad_values_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=f"SamplingParams.{msg}"):
        SamplingParams(**kw)


# ---------------------------------------------------------------------------------------- through the engine
class _CharTok:
    """Each character one token id (ord % 500 + 3): enough to spell bad words for the tiny preset."""
    all_special_ids: list[int] = []
    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 500 + 3 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(max(t - 3, 32)) for t in ids)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20, max_num_batched_tokens=64,
               max_num_seqs=8)


def _logits(llm, ids):
    with torch.no_grad():
        return llm.model(ForwardBatch(torch.tensor(ids), torch.arange(len(ids)), [SeqSpan(0, len(ids), len(ids))]))[-1]


def _run(llm, prompt, params):
    req = llm.engine.add_request(prompt, params)
    while not req.is_finished:
        llm.engine.step()
    llm.engine.drain()
    out = list(req.output_token_ids)
    llm.engine.release(req)
    return req, out


def test_engine_greedy_filters_match_a_cache_free_reference(llm):
    prompt = torch.randint(3, 500, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    free = _run(llm, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[1]
    llm.engine.tokenizer = _CharTok()
    try:
        # ban the free run's 2nd token outright, and its 4th only right after its 3rd (a two-token bad word)
        word = [chr((t - 3) % 500) for t in free[1:2]]
        pair = "".join(chr((t - 3) % 500) for t in free[2:4])
        allowed = sorted(set(range(3, 500)) - {free[5]})
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, bad_words=word + [pair],
                                allowed_token_ids=allowed)
        req, got = _run(llm, prompt, params)
    finally:
        llm.engine.tokenizer = None
    bad = req.bad_word_ids
    assert (free[1],) in bad and (free[2], free[3]) in bad
    want: list[int] = []
    for _ in range(8):
        want.append(int(reference_process(_logits(llm, prompt + want), prompt, want, params, llm.engine.eos,
                                          bad).argmax()))
    assert got == want and got != free
    assert all(t in allowed and t != free[1] for t in got)


def test_engine_min_p_only_samples_tokens_above_the_floor(llm):
    prompt = list(range(20, 31))
    kw = dict(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    params = SamplingParams(min_p=0.8, **kw)   # the tiny preset's logits are flat: 0.8 keeps a few tokens
    got = _run(llm, prompt, params)[1]
    plain = _run(llm, prompt, SamplingParams(**kw))[1]

    def violations(out):
        bad = 0
        for i, tok in enumerate(out):
            p = torch.softmax(_logits(llm, prompt + out[:i]) / params.temperature, -1)
            bad += bool(p[tok] < params.min_p * p.max())
        return bad
    assert violations(got) == 0
    assert violations(plain) > 0             # the same draws without min_p do cross the floor: it was applied


def test_engine_truncates_the_prompt(llm):
    prompt = list(range(40, 70))
    req, got = _run(llm, prompt, SamplingParams(max_tokens=4, temperature=0.0, truncate_prompt_tokens=10))
    assert req.prompt_token_ids == prompt[-10:]
    assert got == _run(llm, prompt[-10:], SamplingParams(max_tokens=4, temperature=0.0))[1]
    req, _ = _run(llm, prompt, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert req.prompt_token_ids == prompt
