"""Fuzz the HTTP API with hypothesis: over 1,000 malformed bodies, each answered with a 4xx in OpenAI's error
shape, and zero 5xx for anything at all (malformed or randomly mutated, on both endpoints)."""

from __future__ import annotations

import http.client
import json
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, engine_idle, make_llm, serve

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
BASE = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "ab cd", "max_tokens": 1, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 1, "temperature": 0},
}
# Values that are wrong for the field whatever else the body holds (the server: vocab 512, max_model_len 64,
# max_choices 4).
BAD = {
    "model": [3, [], "other-model", {"id": MODEL_NAME}],
    "max_tokens": [0, -5, 1.5, "2", True, 65, 10 ** 30, [1]],
    "temperature": [-1, 2.01, "0", [], {}, True, 3],
    "top_p": [0, -0.5, 1.5, "1", False],
    "top_k": [-2, 1.5, "3", True],
    "n": [0, 5, -1, 2.0, "1", True],
    "seed": [-1, 2 ** 63, 1.5, "7", True],
    "stop": ["", [""], [1], {"a": "b"}, ["x"] * 17, 5],
    "stop_token_ids": [[512], [-1], "1", [1.5], {}],
    "stream": ["true", 1, 0, [], "no"],
    "stream_options": [{"include_usage": "yes"}, [], 5],
    "ignore_eos": [1, "false", []],
    "return_token_ids": [0, "x"],
    "presence_penalty": [2.5, "1", -3],
    "frequency_penalty": [2.01, [], "x"],
    "logit_bias": [{"1": 101}, [1], "x"],
    "best_of": [9, "2", 0, -1],
    "skip_special_tokens": [0, "yes", []],
    "spaces_between_special_tokens": [1, "no"],
    "include_stop_str_in_output": [1, "true"],
    "prompt_logprobs": [21, -1, "1", True, 1.5],
    "min_p": [1.5, "0.1", -0.1],
    "allowed_token_ids": [[], [512], "1", [1.5]],
    "bad_words": [[""], "ab", [1]],
    "truncate_prompt_tokens": [0, -2, "3", 1.5],
    "use_beam_search": [True],
    "user": [1, [], {}],
}
BAD_COMPLETION = {**BAD, "prompt": ["", [], [[]], [512], [-1], [1, "a"], 5, None, {"t": 1}, [["a"]], [True],
                                    ["a"] * 5, [3] * 64],
                  "logprobs": [21, -1, True, "2", 1.5], "echo": [1, "yes"], "suffix": ["tail", 1]}
BAD_CHAT = {**BAD, "messages": [[], "hi", [1], [{"role": "x", "content": "a"}], [{"role": "user"}],
                                [{"content": "a"}], [{"role": "user", "content": 5}],
                                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                                [{"role": "user", "content": [{"type": "text"}]}],
                                [{"role": "user", "content": "a", "name": 5}],
                                [{"role": "user", "content": "a" * 200}]],
            "logprobs": [1, "true", []], "top_logprobs": [21, -1, "2"],
            "max_completion_tokens": [0, 65, "3"], "tool_choice": ["required", {"type": "function"}, 3],
            "response_format": [{"type": "yaml"}, "json", 3], "tools": [{"a": 1}, "x", 3]}

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False) |
           st.text(max_size=12))
json_values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch,
                                                                                         max_size=4), max_leaves=8)


@st.composite
def malformed(draw) -> tuple[str, bytes]:
    """A body that must be refused: one known-bad field on a valid base, plus random other mutations, or a
    body that is not a JSON object at all."""
    path = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.integers(0, 9))
    if kind < 7:
        catalog = BAD_COMPLETION if path == ENDPOINTS[0] else BAD_CHAT
        field = draw(st.sampled_from(sorted(catalog)))
        body = dict(BASE[path])
        for k in draw(st.lists(st.sampled_from(["user", "seed", "top_k", "ignore_eos", "n"]), max_size=2)):
            body[k] = draw(json_values)
        body[field] = draw(st.sampled_from(catalog[field]))
        if draw(st.booleans()):
            body.setdefault("stream", True)
        return path, json.dumps(body).encode()
    if kind == 7:           # not JSON / not UTF-8 / truncated
        raw = draw(st.binary(max_size=64) | st.just(b"") | st.just(b"\xff\xfe{") |
                   st.builds(lambda n: json.dumps(BASE[path]).encode()[:n], st.integers(1, 20)))
        try:
            if isinstance(json.loads(raw), dict):
                raw = b"{" + raw
        except (ValueError, UnicodeDecodeError, RecursionError):
            pass
        return path, raw
    if kind == 8:           # valid JSON, not an object
        v = draw(json_values.filter(lambda v: not isinstance(v, dict)))
        return path, json.dumps(v).encode()
    special = draw(st.sampled_from([
        b'{"prompt": NaN, "max_tokens": 1}', b'{"prompt": "a", "temperature": Infinity}',
        b'{"prompt": "a", "max_tokens": 1e400}', b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}",
        b'{"prompt": "a", "presence_penalty": -1' + b"0" * 400 + b"}", b'{"prompt": "a", "n": 1' + b"0" * 5000 + b"}",
        b"[" * 50000 + b"]" * 50000,
        b'{"prompt": "\\ud800", "max_tokens": 1}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        b'{"prompt": "a", "prompt": 5}', b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "a"',
        '{"prompt": "\u00e9", "max_tokens": "\u00e9"}'.encode("latin-1")]))
    return path, special


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    """Random values in random fields (some bodies stay valid): anything goes, except a 5xx."""
    path = draw(st.sampled_from(ENDPOINTS))
    body = dict(BASE[path])
    names = sorted(BAD_COMPLETION if path == ENDPOINTS[0] else BAD_CHAT) + ["x_unknown"]
    for k in draw(st.lists(st.sampled_from(names), min_size=1, max_size=4)):
        body[k] = draw(json_values)
    if draw(st.booleans()) and path == ENDPOINTS[1]:
        body["messages"] = draw(st.lists(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]),
                                                         json_values | st.sampled_from(["user", "system",
                                                                                        "assistant"])),
                                         max_size=3))
    return path, json.dumps(body).encode()


class _Client:
    def __init__(self, url: str):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)

    def post(self, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": content_type})
                r = self.conn.getresponse()
                return r.status, r.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
                if attempt:
                    raise
        raise AssertionError("unreachable")


def _check(status: int, data: bytes, tally: Counter) -> None:
    tally["sent"] += 1
    tally[f"{status // 100}xx"] += 1
    assert status < 500, (status, data[:300])
    if status >= 400:
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert set(err) == {"message", "type", "param", "code"}
    else:
        assert status == 200


def test_fuzz_api_no_5xx(model_dir, capsys):
    llm = make_llm(model_dir, kv_cache_bytes=2 << 20, max_model_len=64, max_queue=64)
    srv = serve(llm, max_choices=4)
    tally: Counter = Counter()
    client = _Client(srv.url)
    content_types = st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"])
    try:
        @settings(max_examples=1100, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=malformed(), ctype=content_types)
        def bad_bodies(case, ctype):
            status, data = client.post(case[0], case[1], ctype)
            _check(status, data, tally)
            tally["malformed"] += 1
            assert 400 <= status < 500, (case, status, data[:300])

        @settings(max_examples=300, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=mutated())
        def random_bodies(case):
            status, data = client.post(case[0], case[1], "application/json")
            _check(status, data, tally)
            if status == 200 and data.startswith(b"data: "):          # a valid streamed request
                events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
                assert events[-1] == b"[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
            elif status == 200:
                assert json.loads(data)["choices"]

        bad_bodies()
        random_bodies()
        after = engine_idle(srv)
    finally:
        srv.stop()
    with capsys.disabled():
        print(f"\n[fuzz] bodies={tally['sent']} malformed={tally['malformed']} 2xx={tally['2xx']} "
              f"4xx={tally['4xx']} 5xx={tally['5xx']}")
    assert tally["5xx"] == 0 and tally["malformed"] >= 1000 and tally["sent"] >= 1300
    assert after["kv_pages_free"] == after["kv_pages_total"] and after["live_seqs"] == 0
