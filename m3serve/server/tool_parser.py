"""MiniMax-M3's tool-call text -> OpenAI `tool_calls`, whole and streamed.

The model writes (every tag prefixed by the namespace token NS = `]<]minimax[>[`):

    NS<tool_call>
    NS<invoke name="get_weather">
    NS<location>NYC NS</location>
    NS<days>3NS</days>
    NS</invoke>
    NS</tool_call>

one tag per argument named after it; an object argument holds one tag per key, a list holds `<item>` tags,
a scalar is its text (booleans and numbers as JSON writes them). Argument text becomes a JSON value guided by
the tool's parameter schema: a "string" stays text, numbers / booleans / null are read as JSON, objects and
arrays from their child tags; without a schema, text that reads as JSON is taken as that value. An argument
tag repeated at the top level becomes a list.

ToolCallStream is one state machine for both forms: text outside a tool-call block is content (a piece that
may be the start of NS<tool_call> is held back until decided); inside it, an invoke's header is announced
(id, name, arguments "") as soon as it is complete and its arguments follow, as JSON, at its close.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

NS = "]<]minimax[>["
CALL_OPEN = NS + "<tool_call>"
CALL_CLOSE = NS + "</tool_call>"
_INVOKE_HEAD = re.compile(re.escape(NS) + r'<invoke name="([^"]*)">')
_INVOKE_END = NS + "</invoke>"
_TAG = re.compile(r"<([A-Za-z_][\w.\-]*)>")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallEvent:
    """kind 'content' (text), 'call' (a new call: index, id, name) or 'arguments' (index, the JSON text)."""
    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


# ------------------------------------------------------------------------------------------- argument values
def _children(body: str) -> list[tuple[str, str]] | None:
    """Top-level <tag>…</tag> children of `body` (namespace tokens already removed), or None when the body is
    not made only of such children (whitespace between them allowed)."""
    out, pos = [], 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            return out
        m = _TAG.match(body, pos)
        if m is None:
            return None
        tag, depth, scan = m.group(1), 1, m.end()
        opener, closer = f"<{tag}>", f"</{tag}>"
        while depth:
            nxt_close = body.find(closer, scan)
            if nxt_close < 0:
                return None
            nxt_open = body.find(opener, scan)
            if 0 <= nxt_open < nxt_close:
                depth, scan = depth + 1, nxt_open + len(opener)
            else:
                depth, scan = depth - 1, nxt_close + len(closer)
        out.append((tag, body[m.end():scan - len(closer)]))
        pos = scan


def _schema_type(schema: dict | None) -> str | None:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    return t if isinstance(t, str) else None


def _scalar(text: str, kind: str | None):
    if kind == "string":
        return text
    s = text.strip()
    try:
        value = json.loads(s)
    except ValueError:
        return text
    if kind in ("integer", "number") and not isinstance(value, (int, float)):
        return text
    if kind == "boolean" and not isinstance(value, bool):
        return text
    return value


def xml_value(text: str, schema: dict | None = None):
    """One argument's text -> its JSON value (module docstring)."""
    kind = _schema_type(schema)
    if kind == "string":
        return text
    kids = _children(text) if "<" in text else None
    if kids and kind in (None, "array") and all(tag == "item" for tag, _ in kids):
        items = schema.get("items") if isinstance(schema, dict) else None
        return [xml_value(inner, items) for _, inner in kids]
    if kids and kind in (None, "object"):
        return _object(kids, schema)
    if kind == "array" and not text.strip():
        return []
    return _scalar(text, kind)


def _object(kids: list[tuple[str, str]], schema: dict | None) -> dict:
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    values: dict[str, list] = {}
    for tag, inner in kids:
        values.setdefault(tag, []).append(xml_value(inner, props.get(tag) if isinstance(props, dict) else None))
    return {tag: vs[0] if len(vs) == 1 else vs for tag, vs in values.items()}


def invoke_arguments(body: str, parameters: dict | None) -> str:
    """An invoke's body (between its header and NS</invoke>) -> the arguments as JSON text."""
    clean = body.replace(NS, "")
    kids = _children(clean)
    if kids is None:       # not argument tags at all: keep the text, so nothing the model wrote is lost
        return json.dumps({"_raw": clean.strip()}, ensure_ascii=False) if clean.strip() else "{}"
    return json.dumps(_object(kids, parameters), ensure_ascii=False)


# ------------------------------------------------------------------------------------------- the stream
def _held(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream:
    """push(text) -> events; finish() -> the rest (an invoke left open at the end is still parsed)."""

    def __init__(self, parameters: dict[str, dict | None]):
        self.parameters = parameters       # tool name -> its parameters schema
        self.buf = ""
        self.in_block = False
        self.open_call: int | None = None  # index of an announced call whose arguments are pending
        self.count = 0

    def _call_header(self, m: re.Match) -> ToolCallEvent:
        self.open_call = self.count
        self.count += 1
        return ToolCallEvent("call", index=self.open_call, call_id=new_call_id(), name=m.group(1))

    def push(self, text: str) -> list[ToolCallEvent]:
        self.buf += text
        events: list[ToolCallEvent] = []
        while True:
            if not self.in_block:
                start = self.buf.find(CALL_OPEN)
                if start < 0:
                    keep = _held(self.buf, CALL_OPEN)
                    out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    if out:
                        events.append(ToolCallEvent("content", out))
                    return events
                if start:
                    events.append(ToolCallEvent("content", self.buf[:start]))
                self.buf, self.in_block = self.buf[start + len(CALL_OPEN):], True
                continue
            if self.open_call is None:
                m = _INVOKE_HEAD.search(self.buf)
                close = self.buf.find(CALL_CLOSE)
                if 0 <= close and (m is None or close < m.start()):
                    self.buf, self.in_block = self.buf[close + len(CALL_CLOSE):], False
                    continue
                if m is None:
                    return events
                events.append(self._call_header(m))
                self._name = m.group(1)
                self.buf = self.buf[m.end():]
            end = self.buf.find(_INVOKE_END)
            if end < 0:
                return events
            events.append(self._arguments(self.buf[:end]))
            self.buf = self.buf[end + len(_INVOKE_END):]

    def _arguments(self, body: str) -> ToolCallEvent:
        index, self.open_call = self.open_call, None
        return ToolCallEvent("arguments", invoke_arguments(body, self.parameters.get(self._name)), index=index)

    def finish(self) -> list[ToolCallEvent]:
        events: list[ToolCallEvent] = []
        if self.open_call is not None:          # the output ended inside an invoke: take what is there
            events.append(self._arguments(self.buf))
        elif not self.in_block and self.buf:
            events.append(ToolCallEvent("content", self.buf))
        self.buf = ""
        return events


def parse_tool_calls(text: str, parameters: dict[str, dict | None]) -> tuple[str, list[dict]]:
    """A whole output -> (content, OpenAI tool_calls)."""
    s = ToolCallStream(parameters)
    return collect(s.push(text) + s.finish())


def collect(events: list[ToolCallEvent]) -> tuple[str, list[dict]]:
    content, calls = "", []
    for e in events:
        if e.kind == "content":
            content += e.text
        elif e.kind == "call":
            calls.append({"id": e.call_id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        else:
            calls[e.index]["function"]["arguments"] += e.text
    return content, calls
