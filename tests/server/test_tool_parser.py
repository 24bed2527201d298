"""Scripted-output tests of the MiniMax-M3 tool-call parser, the reasoning parser and the embedded model's chat
template (tools section, assistant tool_calls, tool messages, prefilled <mm:think>)."""

from __future__ import annotations

import json
import random

import pytest

from m3serve.llm import DEFAULT_MODEL_DIR
from m3serve.server.chat_output import ChatDeltaStream, whole_message
from m3serve.server.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning
from m3serve.server.tool_parser import NS, ToolCallStream, collect, parse_tool_calls
from m3serve.server.tools import ChatPlan

WEATHER = {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"},
                                            "zip": {"type": "string"}, "hourly": {"type": "boolean"},
                                            "opts": {"type": "object", "properties": {"unit": {"type": "string"}}},
                                            "tags": {"type": "array", "items": {"type": "number"}}}}
SCRIPT = (f"Let me check.{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n{NS}<location>Paris, FR{NS}</location>\n"
          f"{NS}<days>3{NS}</days>\n{NS}<zip>07001{NS}</zip>\n{NS}<hourly>false{NS}</hourly>\n"
          f"{NS}<opts>{NS}<unit>celsius{NS}</unit>{NS}</opts>\n{NS}<tags>{NS}<item>1.5{NS}</item>{NS}<item>2{NS}</item>"
          f"{NS}</tags>\n{NS}</invoke>\n{NS}<invoke name=\"now\">\n{NS}</invoke>\n{NS}</tool_call>")
EXPECTED = [("get_weather", {"location": "Paris, FR", "days": 3, "zip": "07001", "hourly": False,
                             "opts": {"unit": "celsius"}, "tags": [1.5, 2]}), ("now", {})]


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_whole_parse_with_schema_types():
    content, calls = parse_tool_calls(SCRIPT, {"get_weather": WEATHER, "now": None})
    assert content == "Let me check."
    assert _calls(calls) == EXPECTED
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


def test_without_schema_json_looking_text_is_json_and_repeats_are_lists():
    text = f"{NS}<tool_call>{NS}<invoke name=\"f\">{NS}<a>12{NS}</a>{NS}<b>NYC{NS}</b>{NS}<c>x{NS}</c>{NS}<c>y{NS}</c>" \
           f"{NS}</invoke>{NS}</tool_call>"
    assert _calls(parse_tool_calls(text, {})[1]) == [("f", {"a": 12, "b": "NYC", "c": ["x", "y"]})]


def test_plain_text_and_near_misses_stay_content():
    for text in ["Just verse, no tools.", f"almost {NS}<tool_c", "a ]<]mini b", "<invoke name=\"x\">"]:
        content, calls = parse_tool_calls(text, {})
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_in_random_pieces_equals_whole(seed):
    rng = random.Random(seed)
    s, events, pos = ToolCallStream({"get_weather": WEATHER}), [], 0
    while pos < len(SCRIPT):
        k = rng.randint(1, 9)
        events += s.push(SCRIPT[pos:pos + k])
        pos += k
    events += s.finish()
    content, calls = collect(events)
    assert content == "Let me check." and _calls(calls) == EXPECTED
    # the call is announced (name, id) before its arguments arrive
    kinds = [e.kind for e in events if e.kind != "content"]
    assert kinds == ["call", "arguments", "call", "arguments"]


def test_unclosed_invoke_at_end_is_recovered():
    text = f"{NS}<tool_call>\n{NS}<invoke name=\"f\">\n{NS}<a>1{NS}</a>\n"
    assert _calls(parse_tool_calls(text, {})[1]) == [("f", {"a": 1})]


# ------------------------------------------------------------------------------------------- reasoning
def test_reasoning_split_forms():
    assert split_reasoning("<mm:think>plan</mm:think>\n\nAnswer.", False) == ("plan", "Answer.")
    assert split_reasoning("plan</mm:think>\nAnswer.", True) == ("plan", "Answer.")
    assert split_reasoning("unfinished thought", True) == ("unfinished thought", "")
    assert split_reasoning("Plain answer", False) == (None, "Plain answer")
    assert split_reasoning("Text <mm:think>x</mm:think>", False) == (None, "Text <mm:think>x</mm:think>")


@pytest.mark.parametrize("prefilled", [True, False])
def test_streamed_reasoning_never_leaks_into_content(prefilled):
    text = ("" if prefilled else "<mm:think>") + "I weigh the rhyme </mm think> still thinking</mm:think>\n\nThe answer."
    for seed in range(5):
        rng = random.Random(seed)
        s, pos, r, c = ReasoningStream(prefilled), 0, "", ""
        while pos < len(text):
            k = rng.randint(1, 4)
            a, b = s.push(text[pos:pos + k])
            pos += k
            r, c = r + a, c + b
            assert "think" not in c and "weigh" not in c       # no reasoning piece ever reaches content
        a, b = s.finish()
        assert (r + a, c + b) == ("I weigh the rhyme </mm think> still thinking", "The answer.")


def test_prompt_prefill_detection():
    assert prompt_opens_reasoning("<|assistant|>\n<mm:think>\n")
    assert not prompt_opens_reasoning("<|assistant|>\n")
    assert not prompt_opens_reasoning(None)


# ------------------------------------------------------------------------------------------- chat output
def test_chat_output_auto_whole_and_streamed_agree():
    plan = ChatPlan(tools=[{}], choice="auto", parameters={"get_weather": WEATHER, "now": None},
                    reasoning_prefilled=True)
    text = "Weather wanted.</mm:think>\n" + SCRIPT
    msg, called = whole_message(plan, text)
    assert called and msg["reasoning_content"] == "Weather wanted." and msg["content"] == "Let me check."
    assert _calls(msg["tool_calls"]) == EXPECTED
    s, deltas = ChatDeltaStream(plan), []
    for i in range(0, len(text), 5):
        deltas.append(s.push(text[i:i + 5]))
    deltas.append(s.finish())
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    args: dict[int, str] = {}
    names = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                names[tc["index"]] = tc["function"]["name"]
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
    assert (reasoning, content) == ("Weather wanted.", "Let me check.") and s.called
    assert [(names[i], json.loads(args[i])) for i in sorted(args)] == EXPECTED


def test_chat_output_forced_forms():
    named = ChatPlan(tools=[{}], choice="named", named="get_weather", parameters={"get_weather": WEATHER})
    msg, called = whole_message(named, '{"location": "Rome"}')
    assert not called and msg["content"] is None and _calls(msg["tool_calls"]) == [("get_weather", {"location": "Rome"})]
    req = ChatPlan(tools=[{}], choice="required", parameters={"a": None, "b": None})
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    msg, called = whole_message(req, text)
    assert called and _calls(msg["tool_calls"]) == [("a", {"x": 1}), ("b", {})]
    s, seen = ChatDeltaStream(req), []
    for ch in text:
        seen += s.push(ch).get("tool_calls", [])
    seen += s.finish().get("tool_calls", [])
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in seen] == \
        [(0, "a", {"x": 1}), (1, "b", {})]


# ------------------------------------------------------------------------------------------- the template
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def test_template_plain_chat_unchanged(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<|bos|><|system|>\nBe brief.<|eos|><|user|>\nhi<|eos|><|assistant|>\n"


def test_template_tools_calls_and_results_round_trip(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}}]
    args = {"location": "Paris, FR", "days": 3, "hourly": False, "opts": {"unit": "celsius"}, "tags": [1.5, 2]}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "content": "22C"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|bos|><|system|>\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0]["function"]) in text                      # the tool's JSON schema is shown
    assert text.count("<|system|>") == 1 and "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C" in text
    assert text.endswith("</tool_response>\n<|eos|><|assistant|>\n")
    # the assistant turn holds the call in M3's format: our parser reads back the same arguments
    turn = text.split("<|assistant|>\n")[1].split("<|eos|>")[0]
    assert _calls(parse_tool_calls(turn, {"get_weather": WEATHER})[1]) == [("get_weather", args)]


def test_template_enable_thinking_prefills_the_tag(tok):
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert text.endswith("<|assistant|>\n<mm:think>\n") and prompt_opens_reasoning(text)
