"""A chat choice's text -> its message: reasoning_content, content and tool_calls, whole or as stream deltas.

Text passes through the reasoning parser (m3serve.server.reasoning) first, then, by the plan's tool_choice:
  auto       the content through the MiniMax-M3 tool-call parser (m3serve.server.tool_parser);
  named      the content is the forced tool's arguments (JSON, the grammar made sure): one tool call;
  required   the content is a JSON array of {"name", "parameters"} (the grammar made sure): one call each;
  none       content as it is.
finish_reason becomes "tool_calls" when auto / required produced calls and the output stopped (vLLM's rule;
a named choice keeps "stop", as OpenAI answers it).
"""

from __future__ import annotations

import json

from m3serve.server.reasoning import ReasoningStream, split_reasoning
from m3serve.server.tool_parser import ToolCallStream, ToolCallEvent, collect, new_call_id, parse_tool_calls
from m3serve.server.tools import ChatPlan


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _required_calls(text: str) -> list[dict]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [_call(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items
            if isinstance(i, dict) and isinstance(i.get("name"), str)]


def whole_message(plan: ChatPlan | None, text: str) -> tuple[dict, bool]:
    """-> (the assistant message, whether it called tools: finish_reason 'tool_calls')."""
    if plan is None:
        return {"role": "assistant", "content": text}, False
    reasoning, content = split_reasoning(text, plan.reasoning_prefilled)
    calls: list[dict] = []
    if plan.choice == "auto":
        content, calls = parse_tool_calls(content, plan.parameters)
    elif plan.choice == "named":
        calls, content = [_call(plan.named, content)], ""
    elif plan.choice == "required":
        calls = _required_calls(content)
        content = "" if calls else content
    msg: dict = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg, bool(calls) and plan.choice != "named"


class ChatDeltaStream:
    """push(text piece) / finish() -> the delta dict for the next chunk ({} when nothing is due yet)."""

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.reasoning = ReasoningStream(plan.reasoning_prefilled)
        self.tools = ToolCallStream(plan.parameters) if plan.choice == "auto" else None
        self.called = False
        self._named_open = False
        self._required_text = ""
        self._required_sent = 0

    def push(self, text: str) -> dict:
        return self._delta(*self.reasoning.push(text), final=False)

    def finish(self) -> dict:
        return self._delta(*self.reasoning.finish(), final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict:
        d: dict = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        choice = self.plan.choice
        if choice == "none":
            if content:
                d["content"] = content
        elif choice == "auto":
            events = self.tools.push(content) + (self.tools.finish() if final else [])
            self._events(d, events)
        elif choice == "named":
            if content or final:
                if not self._named_open:
                    self._named_open = True
                    d["tool_calls"] = [{"index": 0, **_call(self.plan.named, content)}]
                elif content:
                    d["tool_calls"] = [{"index": 0, "function": {"arguments": content}}]
        else:
            self._required_text += content
            calls = _complete_items(self._required_text)
            new = calls[self._required_sent:]
            if new:
                d["tool_calls"] = [{"index": self._required_sent + i, **c} for i, c in enumerate(new)]
                self._required_sent += len(new)
                self.called = True
        return d

    def _events(self, d: dict, events: list[ToolCallEvent]) -> None:
        content, calls = "", []
        for e in events:
            if e.kind == "content":
                content += e.text
            elif e.kind == "call":
                self.called = True
                calls.append({"index": e.index, "id": e.call_id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            else:
                calls.append({"index": e.index, "function": {"arguments": e.text}})
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = calls


def _complete_items(text: str) -> list[dict]:
    """The complete {"name", "parameters"} objects at the start of a (growing) JSON array text."""
    dec, out = json.JSONDecoder(), []
    pos = text.find("[")
    if pos < 0:
        return out
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return out
        try:
            item, pos = dec.raw_decode(text, pos)
        except ValueError:
            return out
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            out.append(_call(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))


__all__ = ["ChatDeltaStream", "whole_message", "collect"]
