"""The `openai` SDK against a live server on the embedded (verse-trained) model: tools in the prompt, forced
tool calls (named / required, by structured output) whole and streamed, tool messages, JSON-schema output,
vLLM's guided_* fields, reasoning with a prefilled <mm:think>, and the examples/ scripts."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from openai import BadRequestError, OpenAI

from m3serve import LLM
from m3serve.server.app import BackgroundServer, build_app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Forecast",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
MSG = [{"role": "user", "content": "Weather in Verona?"}]


@pytest.fixture(scope="module")
def server():
    llm = LLM(device="cpu", dtype="float32", kv_cache_bytes=8 << 20, max_num_seqs=8)
    srv = BackgroundServer(build_app(llm, served_model_name="verse"), host="127.0.0.1", port=0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_weather(args: dict) -> None:
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7


def test_tools_reach_the_prompt_and_auto_returns_content(client):
    plain = client.chat.completions.create(model="verse", messages=MSG, max_tokens=4, temperature=0)
    tooled = client.chat.completions.create(model="verse", messages=MSG, max_tokens=4, temperature=0, tools=TOOLS)
    assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 50       # the tools section is in the prompt
    m = tooled.choices[0].message
    assert m.tool_calls is None and isinstance(m.content, str)          # a verse model calls nothing by itself


def test_named_tool_choice_whole_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="verse", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=60,
                                       temperature=0.7, seed=5)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _check_weather(json.loads(call.function.arguments))
    args, names = "", []
    for ch in client.chat.completions.create(model="verse", messages=MSG, tools=TOOLS, tool_choice=choice,
                                             max_tokens=60, temperature=0.7, seed=5, stream=True):
        for tc in ch.choices[0].delta.tool_calls or []:
            names += [tc.function.name] if tc.function.name else []
            args += tc.function.arguments or ""
        assert not ch.choices[0].delta.content
    assert names == ["get_weather"] and json.loads(args) == json.loads(call.function.arguments)


def test_required_tool_choice_whole_and_streamed(client):
    # parallel_tool_calls=False: exactly one call (a verse model would otherwise keep appending calls)
    r = client.chat.completions.create(model="verse", messages=MSG, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    for call in c.message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            _check_weather(args)
        else:
            assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")
    got, fin = {}, None
    for ch in client.chat.completions.create(model="verse", messages=MSG, tools=TOOLS, tool_choice="required",
                                             max_tokens=120, temperature=0, parallel_tool_calls=False, stream=True):
        for tc in ch.choices[0].delta.tool_calls or []:
            got.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
        fin = ch.choices[0].finish_reason or fin
    assert fin == "tool_calls"
    assert [(n, json.loads(a)) for n, a in (got[i] for i in sorted(got))] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]


def test_tool_messages_are_accepted(client):
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Verona", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="verse", messages=history, tools=TOOLS, max_tokens=5)
    assert r.choices[0].message.content is not None
    with pytest.raises(BadRequestError, match="arguments"):
        bad = [dict(history[1], tool_calls=[{"id": "x", "type": "function",
                                             "function": {"name": "get_weather", "arguments": "{not json"}}])]
        client.chat.completions.create(model="verse", messages=MSG + bad, max_tokens=5)


def test_json_schema_and_guided_fields(client):
    schema = TOOLS[0]["function"]["parameters"]
    r = client.chat.completions.create(model="verse", messages=MSG, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    _check_weather(json.loads(r.choices[0].message.content))
    # any JSON object: a free-form key may run to max_tokens on a verse model; this seeded one closes
    obj = client.completions.create(model="verse", prompt="Shall I compare thee", max_tokens=40, temperature=0.8,
                                    seed=1, extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].text), dict)
    regex = client.completions.create(model="verse", prompt="ROMEO.", max_tokens=20,
                                      extra_body={"guided_regex": "[A-Z][a-z]{2,6}!"})
    assert regex.choices[0].text[0].isupper() and regex.choices[0].text.endswith("!")
    pick = client.chat.completions.create(model="verse", messages=MSG, max_tokens=10,
                                          extra_body={"structured_outputs": {"choice": ["aye", "nay"]}})
    assert pick.choices[0].message.content in ("aye", "nay")
    with pytest.raises(BadRequestError, match="at most one output constraint"):
        client.chat.completions.create(model="verse", messages=MSG, max_tokens=5, response_format={"type": "json_object"},
                                       extra_body={"guided_regex": "a"})
    with pytest.raises(BadRequestError, match="cannot be compiled") as e:   # compiled while parsing: a 400
        client.chat.completions.create(model="verse", messages=MSG, max_tokens=5, extra_body={"guided_regex": "(a"})
    assert e.value.body["param"] == "guided_regex"


def test_prefilled_reasoning_streams_as_reasoning_content(client):
    """enable_thinking prefills <mm:think>: a verse model never closes it, so every piece is reasoning."""
    kw = dict(model="verse", messages=MSG, max_tokens=12, temperature=0, extra_body={
        "chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**kw).choices[0].message
    assert whole.content == "" and whole.model_extra["reasoning_content"]
    reasoning, content = "", ""
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices:
            reasoning += (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.choices[0].delta.content or ""
    assert content == "" and reasoning == whole.model_extra["reasoning_content"]


@pytest.mark.parametrize("name", ["tool_calling", "json_schema"])
def test_examples_run(server, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(server.url + "/v1")
    if name == "tool_calling":
        assert out["name"] == "get_weather" and isinstance(out["answer"], str)
    else:
        assert set(out["poem"]) == {"title", "lines", "rhymed"} and out["choice"] in ("aye", "nay")
