"""SamplingParams: vLLM's field names and defaults, and every bad value raising ValueError that names the field."""

from __future__ import annotations

import pytest

from m3serve import SamplingParams
from m3serve.engine.groups import candidate_params


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.best_of, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == \
        (1, None, 0.0, 0.0, 1.0, 0)
    assert (p.logprobs, p.prompt_logprobs, p.logit_bias) == (None, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.include_stop_str_in_output
    assert not p.needs_logits_processing


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.1), ("presence_penalty", float("nan")), ("frequency_penalty", -2.5),
    ("frequency_penalty", "1"), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0), ("prompt_logprobs", 21), ("prompt_logprobs", -1),
    ("logit_bias", {1: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}), ("logit_bias", [1]),
    ("logit_bias", {True: 1.0}), ("skip_special_tokens", 1), ("spaces_between_special_tokens", None),
    ("include_stop_str_in_output", "yes"), ("best_of", 0), ("n", 2.0), ("max_tokens", True),
])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^SamplingParams.{field} = "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kw", [{"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1},
                                {"min_tokens": 1}, {"logit_bias": {3: 0.5}}])
def test_each_processing_field_turns_processing_on(kw):
    assert SamplingParams(**kw).needs_logits_processing
    assert not SamplingParams(logit_bias={}).needs_logits_processing


def test_candidates():
    assert candidate_params(p := SamplingParams(seed=3)) == [p]
    cands = candidate_params(SamplingParams(n=2, best_of=3, seed=2 ** 63 - 1, prompt_logprobs=2))
    assert [c.seed for c in cands] == [2 ** 63 - 1, 0, 1]           # seed + i, wrapped
    assert all(c.n == 1 and c.best_of is None and c.logprobs == 0 for c in cands)
    assert [c.prompt_logprobs for c in cands] == [2, None, None]
    unseeded = candidate_params(SamplingParams(n=2, logprobs=4))
    assert [(c.seed, c.logprobs) for c in unseeded] == [(None, 4), (None, 4)]
