"""The chat request's tools, tool_choice and structured-output fields -> a ChatPlan (what the prompt shows,
which grammar constrains the output, how the output is read back).

tool_choice (OpenAI): "none" (tools shown, output is content), "auto" (default with tools: the model's
MiniMax-M3 tool-call text is parsed into tool_calls), "required" and {"type": "function", "function":
{"name": ...}} (forced, as vLLM does, by structured output: "required" makes the output a JSON array of
{"name", "parameters"} objects matching one of the tools, a named choice makes it that tool's arguments).
Structured output (both endpoints): response_format json_object / json_schema, vLLM's guided_json /
guided_regex / guided_choice / guided_grammar and structured_outputs {json | regex | choice | grammar |
json_object}; at most one of them, and not together with a forced tool choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from m3serve.engine.structured_params import StructuredOutputsParams
from m3serve.server.errors import APIError, bad_field, short_repr

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


@dataclass
class ChatPlan:
    tools: list[dict] | None = None                  # as the template receives them (validated)
    choice: str = "none"                             # none | auto | required | named
    named: str | None = None                         # the forced tool's name
    parallel: bool = True
    parameters: dict[str, dict | None] = field(default_factory=dict)   # tool name -> parameters schema
    reasoning_prefilled: bool = False                # the prompt ends inside <mm:think>


def _tools(v: object) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_field("tools", v, "a list of {'type': 'function', 'function': {...}} objects")
    seen = set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_field(where, t, "{'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in '"<>'):
            raise bad_field(f"{where}.function.name", name, "a non-empty name without quotes or angle brackets")
        if name in seen:
            raise bad_field(f"{where}.function.name", name, "a name no other tool has")
        seen.add(name)
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise bad_field(f"{where}.function.parameters", f["parameters"], "a JSON schema object")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad_field(f"{where}.function.description", f["description"], "a string")
    return list(v) or None


def chat_plan(body: dict) -> ChatPlan:
    tools = _tools(body.get("tools"))
    plan = ChatPlan(tools=tools, choice="auto" if tools else "none")
    if tools:
        plan.parameters = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_field("parallel_tool_calls", parallel, "true or false")
    plan.parallel = parallel is not False
    c = body.get("tool_choice")
    if c is None:
        return plan
    if c in ("none", "auto", "required"):
        if c != "none" and not tools:
            raise APIError(400, f"'tool_choice' = {c!r} needs 'tools'", param="tool_choice")
        plan.choice = c
        return plan
    name = c.get("function", {}).get("name") if isinstance(c, dict) and c.get("type") == "function" and \
        isinstance(c.get("function"), dict) else None
    if not isinstance(name, str):
        raise bad_field("tool_choice", c, "'none', 'auto', 'required' or {'type': 'function', 'function': "
                                          "{'name': ...}}")
    if name not in plan.parameters:
        raise APIError(400, f"'tool_choice': no tool named {short_repr(name)} in 'tools'", param="tool_choice")
    plan.choice, plan.named = "named", name
    return plan


def _any_object(schema: dict | None) -> dict:
    return schema if isinstance(schema, dict) and schema else {"type": "object"}


def forced_tool_schema(plan: ChatPlan) -> dict | None:
    """The JSON schema that forces a tool call ("required" / named), or None."""
    if plan.choice == "named":
        return _any_object(plan.parameters[plan.named])
    if plan.choice != "required":
        return None
    one = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _any_object(p)},
            "required": ["name", "parameters"], "additionalProperties": False} for n, p in plan.parameters.items()]
    schema = {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one}, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


def _json_schema_format(fmt: dict) -> StructuredOutputsParams:
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise bad_field("response_format.json_schema", js, "an object with 'name' and 'schema'")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_field("response_format.json_schema.schema", schema, "a JSON schema object")
    return StructuredOutputsParams(json=schema)


def structured_request(body: dict, plan: ChatPlan | None = None,
                       compile_grammar=None) -> StructuredOutputsParams | None:
    """The request's output constraint (module docstring), or None. APIError names the field.
    compile_grammar: the engine's compiler, called here (off the engine thread) so a grammar that does not
    compile is a 400 naming its field and the engine finds the others in its cache."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            found.append(("response_format", _json_schema_format(fmt)))
        elif kind != "text":
            raise bad_field("response_format", fmt, "{'type': 'text' | 'json_object' | 'json_schema', ...}")
    simple = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    for name, kind in simple.items():
        v = body.get(name)
        if v is None:
            continue
        if name == "guided_json" and isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise bad_field(name, v, "a JSON schema (object, or its JSON text)") from None
        found.append((name, _params(name, {kind: v})))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_field("structured_outputs", so, "an object with one of json, regex, choice, grammar, json_object")
        keep = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object")
                and v is not None}
        found.append(("structured_outputs", _params("structured_outputs", keep)))
    if plan is not None:
        forced = forced_tool_schema(plan)
        if forced is not None:
            found.append(("tool_choice", StructuredOutputsParams(json=forced)))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise APIError(400, f"at most one output constraint per request, found {names}", param=found[1][0])
    if not found:
        return None
    name, constraint = found[0]
    if compile_grammar is not None:
        try:
            compile_grammar(constraint)
        except ValueError as e:
            raise APIError(400, f"'{name}': {str(e).split(': ', 1)[-1]}", param=name) from None
    return constraint


def _params(name: str, fields: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        why = str(e).split(": ", 1)[-1]          # drop the SamplingParams.structured_outputs.<kind> prefix
        raise APIError(400, f"'{name}': {why}", param=name) from None


def normalize_messages_tools(messages: list[dict]) -> list[dict]:
    """Assistant tool_calls as the template renders them (arguments as an object; OpenAI sends JSON text);
    APIError names a malformed one."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if not calls:
            continue
        out = []
        for j, c in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                raise bad_field(where, c, "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
            args = f.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise bad_field(f"{where}.function.arguments", args, "a JSON object (as text)") from None
            if not isinstance(args, dict):
                raise bad_field(f"{where}.function.arguments", args, "a JSON object")
            out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
        m["tool_calls"] = out
    return messages
