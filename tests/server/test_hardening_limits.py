"""Issue 17, part 1: size limits before work, and no parsing/templating/tokenizing on the event loop.

A 20 MB prompt is refused on its characters before tokenization, fast, naming the limit; a chat request on its
message count or conversation characters before templating; a declared body too large gets 413 before it is
read (also under `Expect: 100-continue`), a chunked one as it arrives; while a request is tokenized /health
still answers; and the process's memory comes back after big refused requests.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from m3serve.server.limits import CHARS_PER_TOKEN_BOUND, RequestLimits, text_chars
from tests.server.conftest import MODEL_NAME, make_llm, serve
from tests.server.rawhttp import exchange, openai_error

MAX_MESSAGES = 8


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, kv_cache_bytes=2 << 20)


@pytest.fixture(scope="module")
def server(llm):
    srv = serve(llm, max_messages=MAX_MESSAGES)
    yield srv
    srv.stop()


@pytest.fixture
def spy(llm, monkeypatch):
    """Counts tokenizer.encode and apply_chat_template calls (the work a size limit must prevent)."""
    calls = {"encode": 0, "template": 0}
    tok = llm.tokenizer
    real_encode, real_template = tok.encode, tok.apply_chat_template

    def encode(*a, **k):
        calls["encode"] += 1
        return real_encode(*a, **k)

    def template(*a, **k):
        calls["template"] += 1
        return real_template(*a, **k)
    monkeypatch.setattr(tok, "encode", encode)
    monkeypatch.setattr(tok, "apply_chat_template", template)
    return calls


def _post(url: str, path: str, body: bytes, timeout: float = 60) -> tuple[int, bytes, float]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read(), time.monotonic() - t0
    finally:
        conn.close()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_defaults_derive_from_the_context():
    lim = RequestLimits.for_model(4096)
    assert lim.max_prompt_chars == 4096 * CHARS_PER_TOKEN_BOUND and lim.max_body_bytes == 32 << 20
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_messages"):
            RequestLimits.for_model(4096, max_messages=bad)


def test_20mb_prompt_refused_before_tokenizing(server, spy):
    body = json.dumps({"model": MODEL_NAME, "prompt": "the " * 5242880, "max_tokens": 2}).encode()
    status, data, seconds = _post(server.url, "/v1/completions", body)
    err = openai_error(data)
    assert status == 400 and err["code"] == "prompt_too_long" and err["param"] == "prompt", err
    assert "20971520" in err["message"] and "--max-prompt-chars" in err["message"] and "131072" in err["message"]
    assert spy["encode"] == 0
    # Before the limit: 14-21 s of tokenizing. Reading and parsing 20 MB takes ~0.1 s; 1 s is the goal.
    assert seconds < 1.0, seconds


def test_prompt_chars_limit_is_exact(server, spy):
    limit = 4096 * CHARS_PER_TOKEN_BOUND
    over = json.dumps({"model": MODEL_NAME, "prompt": ["ab", "x" * (limit + 1)], "max_tokens": 1}).encode()
    status, data, _ = _post(server.url, "/v1/completions", over)
    err = openai_error(data)
    assert status == 400 and err["code"] == "prompt_too_long" and "prompt 1 has" in err["message"]
    assert spy["encode"] == 0
    at = json.dumps({"model": MODEL_NAME, "prompt": "ab " * (limit // 3), "max_tokens": 1}).encode()
    status, data, _ = _post(server.url, "/v1/completions", at)      # passes the gate; too many tokens for 4096
    err = openai_error(data)
    assert status == 400 and err["code"] == "context_length_exceeded" and spy["encode"] == 1


def test_chat_message_count_and_characters_refused_before_templating(server, spy):
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    status, data, _ = _post(server.url, "/v1/chat/completions", json.dumps({"messages": many}).encode())
    err = openai_error(data)
    assert status == 400 and err["code"] == "too_many_messages" and err["param"] == "messages"
    assert f"{MAX_MESSAGES + 1} messages" in err["message"] and f"at most {MAX_MESSAGES} (--max-messages)" in \
        err["message"]
    long = [{"role": "user", "content": "word " * 30000}, {"role": "assistant", "content": "word " * 30000}]
    status, data, _ = _post(server.url, "/v1/chat/completions", json.dumps({"messages": long}).encode())
    err = openai_error(data)
    assert status == 400 and err["code"] == "prompt_too_long" and err["param"] == "messages"
    assert f"{text_chars(long)} characters" in err["message"] and text_chars(long) > 300000
    assert spy["template"] == 0 and spy["encode"] == 0


def test_declared_body_too_large_gets_413_before_it_is_read(server):
    # 50 GB declared, 2 bytes sent: the answer must not wait for the rest.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" \
        b"Content-Length: 50000000000\r\n"
    status, headers, body, seconds = exchange(server.url, head + b"\r\n{}")
    err = openai_error(body)
    assert status == 413 and err["code"] == "request_too_large" and "--max-body-bytes" in err["message"]
    assert "50000000000" in err["message"] and headers["connection"] == "close"
    assert seconds < 1.0, seconds


def test_expect_100_continue_is_refused_when_too_large_and_granted_otherwise(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n")
    status, headers, body, seconds = exchange(server.url, head)
    assert status == 413 and openai_error(body)["code"] == "request_too_large" and seconds < 1.0
    ok = json.dumps({"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(ok))
    assert exchange(server.url, head)[0] == 100
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=ok, headers={"Content-Type": "application/json",
                                                              "Expect": "100-continue"})
    r = conn.getresponse()             # http.client reads past the interim 100 to the real answer
    assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 1
    status, _, body, _ = exchange(server.url, head.replace(b"100-continue", b"200-ok"))
    assert status == 417 and openai_error(body)["type"] == "invalid_request_error"


def test_chunked_body_over_the_limit_gets_413(llm):
    srv = serve(llm, max_body_bytes=4096)
    try:
        chunk = b"x" * 3000
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 3 + b"0\r\n\r\n")
        status, _, body, _ = exchange(srv.url, data)
        err = openai_error(body)
        assert status == 413 and err["code"] == "request_too_large" and "4096 bytes" in err["message"]
    finally:
        srv.stop()


def test_tokenizing_and_templating_run_off_the_event_loop(server, llm, monkeypatch):
    """A slow tokenizer (1 s, as a long prompt would take) must not hold /health: before, parsing ran on the
    event loop and /health waited the whole second."""
    tok = llm.tokenizer
    real_encode, real_template = tok.encode, tok.apply_chat_template
    busy = threading.Event()

    def slow(real):
        def fn(*a, **k):
            busy.set()
            time.sleep(1.0)            # releases the GIL, as the Rust tokenizer does
            return real(*a, **k)
        return fn
    monkeypatch.setattr(tok, "encode", slow(real_encode))
    monkeypatch.setattr(tok, "apply_chat_template", slow(real_template))
    for path, body in (("/v1/completions", {"model": MODEL_NAME, "prompt": "ab cd", "max_tokens": 1}),
                       ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "hi"}]})):
        busy.clear()
        result = {}
        th = threading.Thread(target=lambda: result.update(r=_post(server.url, path, json.dumps(body).encode())))
        th.start()
        assert busy.wait(10)
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        t0 = time.monotonic()
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        health_s = time.monotonic() - t0
        th.join(30)
        assert result["r"][0] == 200, result
        assert health_s < 0.5, (path, health_s)


def test_memory_returns_after_big_refused_requests(server):
    """Before, each 20 MB prompt was tokenized (RSS 0.7 -> 4-6 GB, never returned). Now: within 200 MB (the
    issue's bound) of the start after 10 of them, with the test client in the same process."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "the " * 5242880, "max_tokens": 2}).encode()
    _post(server.url, "/v1/completions", body)            # first one: lazy allocations, pools
    start = _rss_mb()
    for _ in range(10):
        assert _post(server.url, "/v1/completions", body)[0] == 400
    grown = _rss_mb() - start
    assert grown < 200, grown
