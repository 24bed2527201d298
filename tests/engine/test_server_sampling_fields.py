"""The OpenAI server accepts the penalty fields, logit_bias and min_tokens with OpenAI's ranges (vLLM's for the
extensions), refuses bad values with a 400 naming the field, and the engine applies them: an HTTP completion
equals LLM.generate with the same SamplingParams (tiny preset, token-id prompts, greedy: exact ids).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from m3serve import LLM, SamplingParams
from m3serve.llm import DEFAULT_MODEL_DIR
from m3serve.server.app import BackgroundServer, build_app
from m3serve.server.errors import APIError
from m3serve.server.protocol import ModelInfo, parse_chat, parse_completion
from m3serve.tokenizer import load_tokenizer

INFO = ModelInfo(name="m", vocab_size=512, max_model_len=64, capacity_tokens=1000, max_choices=8)
BASE = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}
FIELDS = {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3, "min_tokens": 2,
          "logit_bias": {"17": 5, "300": -100}}


def test_fields_reach_sampling_params():
    p = parse_completion({**BASE, **FIELDS}, INFO).params[0]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (1.5, -0.5, 1.3, 2)
    assert p.logit_bias == {17: 5.0, 300: -100.0}
    plain = parse_completion(BASE, INFO).params[0]
    assert not plain.needs_logits_processing and plain.logit_bias is None
    info = ModelInfo(name="m", vocab_size=3840, max_model_len=64, capacity_tokens=1000,
                     tokenizer=load_tokenizer(DEFAULT_MODEL_DIR))
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **FIELDS}, info).params[0]
    assert chat.presence_penalty == 1.5 and chat.logit_bias == {17: 5.0, 300: -100.0}


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "1"), ("presence_penalty", True),
    ("frequency_penalty", 3), ("frequency_penalty", [1]), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("repetition_penalty", "1.1"), ("min_tokens", -1), ("min_tokens", 5), ("min_tokens", 1.5),
    ("logit_bias", {"1": 101}), ("logit_bias", {"1": -100.5}), ("logit_bias", {"512": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"x": 1}), ("logit_bias", {"1": "2"}), ("logit_bias", [1]), ("logit_bias", "x"),
    ("logit_bias", {str(i): 1 for i in range(1025)}),
])
def test_bad_values_are_400_naming_the_field(field, value):
    with pytest.raises(APIError) as e:
        parse_completion({**BASE, field: value}, INFO)
    assert e.value.status == 400 and e.value.param == field and f"'{field}'" in e.value.message, e.value.message


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=4 << 20)


def test_http_completion_applies_the_fields(tiny):
    body = {"model": "tiny", "prompt": list(range(10, 40)), "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "presence_penalty": 1.0, "frequency_penalty": 0.5,
            "repetition_penalty": 1.4, "min_tokens": 3, "logit_bias": {"42": 4.0}}
    with BackgroundServer(build_app(tiny, served_model_name="tiny")) as srv:
        req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            got = json.loads(resp.read())["choices"][0]["token_ids"]
    want = tiny.generate({"prompt_token_ids": body["prompt"]}, SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
        repetition_penalty=1.4, min_tokens=3, logit_bias={42: 4.0}), use_tqdm=False)[0].outputs[0].token_ids
    plain = tiny.generate({"prompt_token_ids": body["prompt"]}, SamplingParams(max_tokens=10, temperature=0.0,
                                                                              ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and got != plain
