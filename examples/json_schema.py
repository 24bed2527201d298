"""JSON-schema output with the `openai` SDK against an m3serve server: the output is constrained token by
token (xgrammar), so even the embedded verse model returns JSON that matches the schema.

    python -m m3serve.cli serve &
    python examples/json_schema.py [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "lines", "rhymed"],
          "properties": {"title": {"type": "string", "maxLength": 24},
                         "lines": {"type": "integer", "minimum": 2, "maximum": 20},
                         "rhymed": {"type": "boolean"}}}


def main(base_url: str) -> dict:
    client = OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, max_tokens=80,
        messages=[{"role": "user", "content": "Describe a sonnet as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "poem", "schema": SCHEMA}})
    poem = json.loads(r.choices[0].message.content)
    print("json_schema:", poem)
    # vLLM's extensions work too, through extra_body: a regex, or a choice among strings
    pick = client.chat.completions.create(model=model, max_tokens=10, messages=[{"role": "user", "content": "Yes?"}],
                                          extra_body={"guided_choice": ["aye", "nay"]})
    print("guided_choice:", pick.choices[0].message.content)
    return {"poem": poem, "choice": pick.choices[0].message.content}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    main(ap.parse_args().base_url)
