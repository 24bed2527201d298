"""Structured output: the device token mask against a plain reference, and the embedded (verse-trained) model
forced by a JSON schema / regex / choice on CPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.engine.structured_params import StructuredOutputsParams
from m3serve.engine.token_masks import TokenMaskRows, reference_apply


def test_mask_rows_match_reference_on_random_masks():
    torch.manual_seed(0)
    rows_n, vocab = 5, 1000                   # vocab not a multiple of 32: the last word is partial
    masks = TokenMaskRows(rows_n, vocab, "cpu")
    allowed = [sorted(torch.randperm(vocab)[:k].tolist()) for k in (1, 7, 300, 999)]
    for row, ids in enumerate(allowed):
        bits = torch.zeros(masks.words * 32, dtype=torch.bool)
        bits[ids] = True
        words = (bits.view(masks.words, 32).long() << torch.arange(32)).sum(1)   # [W] as uint32 values
        masks.host[row] = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        masks.write_row(row)
    rows = torch.tensor([3, 0, masks.neutral, 2, 1])
    scores = torch.randn(5, vocab)
    out = masks.apply(scores, rows)
    want = reference_apply(scores, [allowed[3], allowed[0], list(range(vocab)), allowed[2], allowed[1]])
    assert torch.equal(out, want)        # exact: a mask either keeps a score bit for bit or sets -inf
    masks.clear_row(0)
    assert torch.equal(masks.apply(scores[:1], torch.tensor([0])), scores[:1])


def test_structured_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).needs_logits_processing


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", kv_cache_bytes=8 << 20)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["speaker", "act", "rhymes"],
          "properties": {"speaker": {"type": "string", "maxLength": 16}, "act": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 5},
                         "rhymes": {"type": "boolean"}, "mood": {"enum": ["grave", "merry"]}}}


def _check_schema(value: dict) -> None:
    assert set(value) >= {"speaker", "act", "rhymes"} and set(value) <= set(SCHEMA["properties"])
    assert isinstance(value["speaker"], str) and len(value["speaker"]) <= 16
    assert isinstance(value["act"], int) and 1 <= value["act"] <= 5 and isinstance(value["rhymes"], bool)
    assert value.get("mood", "grave") in ("grave", "merry")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verse_model_forced_by_schema_returns_valid_json(llm, temperature):
    prompts = ["Shall I compare thee to a summer's day?", "ROMEO.\n", "Once more unto the breach"]
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate(prompts, SamplingParams(temperature=temperature, seed=3, max_tokens=80, structured_outputs=so),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        _check_schema(json.loads(c.text))
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    with pytest.raises(ValueError):                  # unconstrained, the model writes verse, not JSON
        json.loads(plain.text)


def test_regex_choice_and_json_object(llm):
    kinds = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}"), StructuredOutputsParams(choice=["thee", "thou art"]),
             StructuredOutputsParams(json_object=True)]
    outs = llm.generate(["Shall I compare thee"] * 3, [SamplingParams(temperature=0.8, seed=1, max_tokens=40,
                                                                      structured_outputs=k) for k in kinds],
                        use_tqdm=False)
    regex, choice, obj = (o.outputs[0].text for o in outs)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", regex)
    assert choice in ("thee", "thou art")
    assert isinstance(json.loads(obj), dict)
    st = llm.engine.stats()
    assert st["structured_masked_steps"] > 0 and st["structured_graph_masked_steps"] == 0   # CPU: no graphs


def test_bad_schema_is_refused_and_nothing_leaks(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    assert not llm.engine.requests and len(llm.engine.grammars) == 0


def test_grammar_end_finishes_even_with_ignore_eos_and_min_tokens_is_refused(llm):
    so = StructuredOutputsParams(choice=["thee", "thou art"])
    out = llm.generate(["Shall I compare thee"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                                structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("thee", "thou art")
    assert len(out.token_ids) < 30
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs=so)


def test_preempted_constrained_request_keeps_its_grammar():
    """A KV cache too small for all requests at once: preemption recomputes a constrained request, whose
    matcher keeps its state; every output still matches its grammar."""
    small = LLM(device="cpu", dtype="float32", kv_cache_bytes=1 << 20, max_num_seqs=4)
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = [("Shall I compare thee to a summer's day? " * 6)[:200 + 7 * i] for i in range(4)]
    outs = small.generate(prompts, SamplingParams(temperature=0.9, seed=7, max_tokens=80, structured_outputs=so),
                          use_tqdm=False)
    assert small.engine.stats()["preemptions"] > 0        # 128 cache slots for 4 x ~64-token prompts + outputs
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        _check_schema(json.loads(o.outputs[0].text))
