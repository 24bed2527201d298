"""Request validation without a server: each bad field gives a 400 that names it; limits name their value."""

from __future__ import annotations

import pytest

from m3serve.server.errors import APIError
from m3serve.server.protocol import ModelInfo, parse_chat, parse_completion
from m3serve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def info(model_dir) -> ModelInfo:
    return ModelInfo(name="m", vocab_size=512, max_model_len=64, capacity_tokens=1000,
                     tokenizer=load_tokenizer(model_dir), max_choices=8)


def _err(fn, body, info) -> APIError:
    with pytest.raises(APIError) as e:
        fn(body, info)
    return e.value


BASE = {"model": "m", "prompt": "abc", "max_tokens": 4}

BAD_COMPLETION = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "4"),
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", 10 ** 400), ("presence_penalty", -10 ** 400),
    ("temperature", "hot"), ("temperature", [1]),
    ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.0), ("seed", -1), ("seed", 2 ** 63), ("seed", "1"),
    ("n", 0), ("n", 9), ("n", False), ("logprobs", 21), ("logprobs", -1), ("logprobs", True),
    ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", ["a"] * 17), ("stop", {"a": 1}),
    ("stop_token_ids", [512]), ("stop_token_ids", [-1]), ("stop_token_ids", "1"),
    ("stream", "yes"), ("stream", 1), ("echo", 1), ("ignore_eos", "no"), ("return_token_ids", 0),
    ("presence_penalty", 2.5), ("frequency_penalty", "x"), ("logit_bias", {"1": 101}), ("logit_bias", [1]),
    ("suffix", "tail"), ("best_of", 0), ("best_of", 9), ("best_of", "2"), ("user", 5), ("model", 3),
    ("min_tokens", 5), ("skip_special_tokens", 0), ("spaces_between_special_tokens", "no"),
    ("include_stop_str_in_output", 1), ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", True),
    ("min_p", 1.1), ("min_p", "0.1"), ("use_beam_search", True), ("allowed_token_ids", []),
    ("allowed_token_ids", [512]), ("bad_words", [""]), ("bad_words", "ab"), ("truncate_prompt_tokens", 0),
    ("guided_json", "{not json"), ("add_special_tokens", False), ("response_format", {"type": "xml"}),
    ("guided_choice", []), ("structured_outputs", {"json": {}, "regex": "a"}),
    ("prompt", []), ("prompt", [[]]), ("prompt", [1, "a"]), ("prompt", [512]), ("prompt", [-1]), ("prompt", 5),
    ("prompt", None), ("prompt", {"text": "a"}), ("prompt", [["a"]]), ("prompt", ["a"] * 9),
]


@pytest.mark.parametrize("field,value", BAD_COMPLETION)
def test_bad_completion_field_is_400_naming_it(info, field, value):
    e = _err(parse_completion, {**BASE, field: value}, info)
    assert e.status == 400 and e.param == field, (e.status, e.param, e.message)
    assert f"'{field}'" in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value,param", [
    ("messages", [], "messages"), ("messages", "hi", "messages"), ("messages", [{"role": "boss", "content": "x"}],
                                                                  "messages[0].role"),
    ("messages", [{"role": "user"}], "messages[0].content"), ("messages", [5], "messages[0]"),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ("messages", [{"role": "user", "content": 7}], "messages[0].content"),
    ("logprobs", 1, "logprobs"), ("top_logprobs", 3, "top_logprobs"), ("max_completion_tokens", 0,
                                                                       "max_completion_tokens"),
    ("tool_choice", "required", "tool_choice"), ("response_format", {"type": "xml"}, "response_format"),
    ("tool_choice", {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ("tools", [{"type": "function", "function": {"name": 3}}], "tools[0].function.name"),
    ("messages", [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ("chat_template_kwargs", {"tools": []}, "chat_template_kwargs"),
    ("tools", {"a": 1}, "tools"), ("stream_options", {"include_usage": True}, "stream_options"),
])
def test_bad_chat_field_is_400_naming_it(info, field, value, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    e = _err(parse_chat, body, info)
    assert e.status == 400 and e.param == param, (e.status, e.param, e.message)


def test_body_must_be_object_and_model_must_match(info):
    assert _err(parse_completion, [1, 2], info).status == 400
    e = _err(parse_completion, {**BASE, "model": "other"}, info)
    assert e.status == 404 and e.param == "model" and e.code == "model_not_found"
    assert _err(parse_completion, {"model": "m"}, info).param == "prompt"
    assert _err(parse_chat, {"model": "m"}, info).param == "messages"


def test_prompt_longer_than_context_names_the_limit(info):
    e = _err(parse_completion, {**BASE, "prompt": list(range(3, 3 + 64))}, info)
    assert e.status == 400 and e.param == "prompt" and e.code == "context_length_exceeded"
    assert "64" in e.message and "max_model_len" in e.message and "63" in e.message
    ok = parse_completion({**BASE, "prompt": list(range(3, 3 + 63)), "max_tokens": None}, info)
    assert ok.params[0].max_tokens == 1          # the default (16) shrinks to the room left
    e = _err(parse_completion, {**BASE, "prompt": list(range(3, 3 + 60)), "max_tokens": 5}, info)
    assert e.param == "max_tokens" and "64" in e.message and "at most 4" in e.message
    small = ModelInfo("m", 512, 64, capacity_tokens=20, tokenizer=None)
    e = _err(parse_completion, {**BASE, "prompt": list(range(3, 3 + 25))}, small)
    assert e.param == "prompt" and "20" in e.message


def test_prompt_forms_and_choice_expansion(info):
    tok = info.tokenizer
    r = parse_completion({**BASE, "prompt": ["ab cd", "zz"], "n": 2, "seed": 5, "temperature": 0.7}, info)
    assert r.prompts == [tok.encode("ab cd"), tok.encode("zz")] and r.prompt_texts == ["ab cd", "zz"]
    sub = r.submissions()           # one engine request group per prompt; the engine gives candidate i seed + i
    assert len(sub) == 2 and r.num_choices == r.num_candidates == 4 and sub[1][0] == tok.encode("zz")
    assert all(p.n == 2 and p.best_of is None and p.seed == 5 and p.temperature == 0.7 for _, _, p in sub)
    r = parse_completion({**BASE, "prompt": ["ab", "zz"], "n": 2, "best_of": 3, "temperature": 0.7}, info)
    assert (r.num_choices, r.num_candidates, r.params[0].best_of) == (4, 6, 3)
    r = parse_completion({**BASE, "prompt": [[5, 6], [7]], "stop": "x", "stream": True,
                          "stream_options": {"include_usage": True}}, info)
    assert r.prompts == [[5, 6], [7]] and r.prompt_texts == [None, None] and r.stop == ["x"]
    assert r.stream and r.include_usage and r.params[0].stop == ["x"]
    r = parse_completion({"prompt": [9, 10], "max_tokens": None, "temperature": None, "stop": None}, info)
    assert r.params[0].max_tokens == 16 and r.params[0].temperature == 1.0 and r.n == 1
    e = _err(parse_completion, {**BASE, "n": 3, "prompt": ["a", "b", "c"]}, info)   # 9 choices > 8
    assert e.param == "n"
    no_tok = ModelInfo("m", 512, 64, 1000, tokenizer=None)
    assert _err(parse_completion, BASE, no_tok).param == "prompt"


def test_chat_prompt_uses_the_template(info):
    tok = info.tokenizer
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    r = parse_chat({"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 2,
                    "max_completion_tokens": 3}, info)
    want = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    assert r.prompt_texts == [want] and r.prompts == [tok.encode(want, add_special_tokens=False)]
    assert r.logprobs == 2 and r.params[0].logprobs == 2 and r.params[0].max_tokens == 3
    r = parse_chat({"messages": [{"role": "user", "content": "x"}]}, info)
    assert r.params[0].max_tokens == 64 - len(r.prompts[0]) and r.logprobs is None   # default: the room left
    no_tmpl = ModelInfo("m", 512, 64, 1000, tokenizer=None)
    assert _err(parse_chat, {"messages": [{"role": "user", "content": "x"}]}, no_tmpl).param == "messages"
