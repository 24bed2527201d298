"""vLLM's text fields over HTTP equal the offline API on the embedded model: skip_special_tokens,
spaces_between_special_tokens, include_stop_str_in_output, the stop token's text (dropped unless asked, vLLM's
rule), stop_reason; whole and streamed, completions and chat. Unknown fields are ignored with a warning (vLLM);
fields vLLM defines but this server lacks are a 400 naming them.

Outputs are steered with logit_bias +100 (the biased token becomes the argmax whatever the model says), greedy, so
texts are compared exactly, with the offline LLM.generate / LLM.chat of a second engine on the same checkpoint.
"""

from __future__ import annotations

import logging

import pytest

from m3serve import SamplingParams
from tests.server.vllm_http import AB, EMBEDDED, EOS, USER, http_fields, post, stream, streamed_texts
from tests.server.vllm_http import embedded_ref_fixture, embedded_server_fixture  # noqa: F401 (fixtures ref, server)

PROMPT = "Once upon a time"




def _params(**kw) -> dict:
    return {"temperature": 0.0, "max_tokens": 8, **kw}


# (SamplingParams / request fields, the text both must show): literal texts pin vLLM's rules, not just agreement.
CASES = {
    "special tokens skipped": ({"max_tokens": 3, "logit_bias": {USER: 100.0}}, ""),
    "skip_special_tokens=False": ({"max_tokens": 3, "logit_bias": {USER: 100.0}, "skip_special_tokens": False},
                                  "<|user|> <|user|> <|user|>"),
    "spaces_between_special_tokens=False": ({"max_tokens": 3, "logit_bias": {USER: 100.0},
                                             "skip_special_tokens": False, "spaces_between_special_tokens": False},
                                            "<|user|><|user|><|user|>"),
    "stop string cut": ({"stop": ["ab"], "logit_bias": {AB: 100.0}, "min_tokens": 3}, "ababab"),
    "include_stop_str_in_output": ({"stop": ["ab"], "logit_bias": {AB: 100.0}, "min_tokens": 3,
                                    "include_stop_str_in_output": True}, "abababab"),
    "stop id's text dropped": ({"stop_token_ids": [AB], "logit_bias": {AB: 100.0}}, ""),
    "stop id's text shown": ({"stop_token_ids": [AB], "logit_bias": {AB: 100.0}, "include_stop_str_in_output": True},
                             "ab"),
    "EOS text dropped": ({"logit_bias": {EOS: 100.0}, "skip_special_tokens": False}, ""),
    "EOS text shown": ({"logit_bias": {EOS: 100.0}, "skip_special_tokens": False, "include_stop_str_in_output": True},
                       "<|eos|>"),
    # min_tokens masks the stop id for 2 tokens: the model's own text, then "ab" ends it unseen (None: the model's)
    "stop id after ordinary tokens": ({"stop_token_ids": [AB], "logit_bias": {AB: 100.0}, "min_tokens": 2}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_completion_text_equals_offline(server, ref, case):
    kw, text = CASES[case]
    want = ref.generate(PROMPT, SamplingParams(**_params(**kw)), use_tqdm=False)[0].outputs[0]
    body = {"model": EMBEDDED, "prompt": PROMPT, "return_token_ids": True, **http_fields(**_params(**kw))}
    status, r = post(server.url, "/v1/completions", body)
    assert status == 200, r
    c = r["choices"][0]
    assert (c["text"], c["token_ids"]) == (want.text, want.token_ids)
    if text is None:
        text = ref.get_tokenizer().decode(want.token_ids[:-1], skip_special_tokens=True)
        assert len(want.token_ids) == 3 and want.token_ids[-1] == AB and text
    assert want.text == text
    assert (c["finish_reason"], c["stop_reason"]) == (want.finish_reason, want.stop_reason)
    events = stream(server.url, "/v1/completions", body)
    assert streamed_texts(events, "completion") == {0: text}
    assert [ch["stop_reason"] for ev in events for ch in ev["choices"]][-1] == want.stop_reason


@pytest.mark.parametrize("case", ["skip_special_tokens=False", "include_stop_str_in_output", "stop id's text dropped",
                                  "EOS text shown"])
def test_chat_text_equals_offline(server, ref, case):
    kw, text = CASES[case]
    messages = [{"role": "user", "content": "Tell me a story."}]
    want = ref.chat(messages, SamplingParams(**_params(**kw)), use_tqdm=False)[0].outputs[0]
    body = {"model": EMBEDDED, "messages": messages, **http_fields(**_params(**kw))}
    status, r = post(server.url, "/v1/chat/completions", body)
    assert status == 200, r
    c = r["choices"][0]
    assert c["message"]["content"] == want.text == text and c["stop_reason"] == want.stop_reason
    assert streamed_texts(stream(server.url, "/v1/chat/completions", body), "chat") == {0: text}


def test_natural_text_with_special_tokens_kept_equals_offline(server, ref):
    """No steering: whatever the model writes (EOS included) reads the same over HTTP and offline."""
    kw = _params(max_tokens=40, skip_special_tokens=False, spaces_between_special_tokens=False,
                 logit_bias={USER: 3.0})
    want = ref.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    body = {"model": EMBEDDED, "prompt": PROMPT, **http_fields(**kw)}
    status, r = post(server.url, "/v1/completions", body)
    assert status == 200 and r["choices"][0]["text"] == want.text, (r, want.text)
    assert streamed_texts(stream(server.url, "/v1/completions", body), "completion") == {0: want.text}


@pytest.mark.parametrize("field,value", [("skip_special_tokens", "no"), ("spaces_between_special_tokens", 1),
                                         ("include_stop_str_in_output", 0)])
def test_bad_text_flags_are_400_naming_them(server, field, value):
    status, r = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": PROMPT, field: value})
    assert status == 400 and r["error"]["param"] == field and f"'{field}'" in r["error"]["message"], r


def test_unknown_fields_are_ignored_with_a_warning(server, caplog):
    """vLLM's rule (its request models allow extra fields and log them); OpenAI itself would answer 400."""
    body = {"model": EMBEDDED, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "x_trace_tag": "a",
            "zz_other": {"k": 1}}
    with caplog.at_level(logging.WARNING, logger="m3serve.server"):
        status, r = post(server.url, "/v1/completions", body)
    assert status == 200 and r["usage"]["completion_tokens"] == 2
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(lines) == 1 and "'x_trace_tag'" in lines[0] and "'zz_other'" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="m3serve.server"):
        status, _ = post(server.url, "/v1/completions", {**body, "x_trace_tag": None, "zz_other": None,
                                                          "ignore_eos": True, "min_p": 0.0})
    assert status == 200 and len([r for r in caplog.records if "ignored" in r.getMessage()]) == 1


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "use_beam_search", True), ("/v1/completions", "logits_processors", ["a"]),
    ("/v1/chat/completions", "continue_final_message", True), ("/v1/chat/completions", "chat_template", "{{ x }}"),
])
def test_fields_vllm_has_and_this_server_lacks_are_400(server, path, field, value):
    base = {"model": EMBEDDED, "max_tokens": 1}
    base.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    status, r = post(server.url, path, {**base, field: value})
    assert status == 400 and r["error"]["param"] == field and "not supported" in r["error"]["message"], r
