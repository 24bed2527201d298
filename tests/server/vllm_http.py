"""Plain-HTTP helpers for the vLLM-field tests: JSON in, JSON (or the SSE events) out, errors kept as data."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url: str, path: str, body: dict) -> list[dict]:
    """The events of a streamed request, [DONE] checked and dropped."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def streamed_texts(events: list[dict], kind: str) -> dict[int, str]:
    """Choice index -> the concatenated text of its chunks."""
    out: dict[int, str] = {}
    for ev in events:
        for c in ev["choices"]:
            piece = c["text"] if kind == "completion" else c["delta"].get("content") or ""
            out[c["index"]] = out.get(c["index"], "") + piece
    return out


def get_text(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


# ---------------------------------------------------------------------------------------- the embedded model
EMBEDDED = "m3"           # served model name
AB, USER, EOS = 876, 4, 2  # the embedded tokenizer: "ab", <|user|> (special), <|eos|>


def embedded_llm():
    """The embedded trained model (its real tokenizer and chat template), one sequence's prefill in one chunk."""
    from m3serve import LLM
    return LLM(max_num_batched_tokens=256)


def embedded_server():
    from m3serve.server.app import BackgroundServer, build_app
    return BackgroundServer(build_app(embedded_llm(), served_model_name=EMBEDDED, max_choices=8), port=0).start()


def http_fields(**kw) -> dict:
    """SamplingParams keyword arguments -> the same request fields (vLLM's names); logit_bias keys as strings."""
    body = dict(kw)
    if body.get("logit_bias") is not None:
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"].items()}
    return body


@pytest.fixture(scope="module", name="server")
def embedded_server_fixture():
    """The embedded model's server, one per test module (imported by the vLLM-field test modules)."""
    srv = embedded_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module", name="ref")
def embedded_ref_fixture():
    """The offline LLM every server answer is compared with."""
    return embedded_llm()
