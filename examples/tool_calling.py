"""Tool calling with the `openai` SDK against an m3serve server.

    python -m m3serve.cli serve &            # the embedded model, on http://127.0.0.1:8000
    python examples/tool_calling.py [--base-url http://127.0.0.1:8000/v1]

The embedded verse model was never trained for tools, so this example forces the call with a named
tool_choice (the output is constrained to the tool's argument schema); with MiniMax-M3 weights,
tool_choice="auto" lets the model decide and its tool-call text comes back as tool_calls.
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}]


def get_weather(city: str, days: int) -> str:
    return f"{days} days of sun in {city}"


def main(base_url: str) -> dict:
    client = OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Verona this week?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    print("tool call:", call.function.name, args)
    # send the result back as a tool message; the model answers from it
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": get_weather(**args)}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=30)
    print("answer:", second.choices[0].message.content)
    return {"name": call.function.name, "arguments": args, "answer": second.choices[0].message.content}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    main(ap.parse_args().base_url)
