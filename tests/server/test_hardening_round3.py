"""Issue 34, items 2, 6, 7 and 8 (HTTP side): bodies decoded off the event loop with limits applied before
parsing, bounded decompression, Content-Encoding / Content-Type rules, connection timeouts, /metrics behind
--api-key, no version banner."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import zlib

import pytest

from m3serve.server import body as body_mod
from tests.server.conftest import MODEL_NAME, make_llm, serve
from tests.server.rawhttp import exchange, openai_error

KEY = "sekrit"
TIMEOUT_S = 1.0          # keep-alive, header and body timeouts of the test server


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, kv_cache_bytes=2 << 20)


@pytest.fixture(scope="module")
def server(llm):
    srv = serve(llm, max_body_bytes=4 << 20, timeout_keep_alive=TIMEOUT_S, header_timeout=TIMEOUT_S,
                body_timeout=TIMEOUT_S)
    yield srv
    srv.stop()


@pytest.fixture
def keyed(llm):
    srv = serve(llm, api_key=KEY)
    yield srv
    srv.stop()


def _post(url: str, body: bytes, headers: str = "Content-Type: application/json\r\n",
          path: str = "/v1/completions") -> tuple[int | None, dict, bytes, float]:
    return exchange(url, (f"POST {path} HTTP/1.1\r\nHost: t\r\n{headers}"
                          f"Content-Length: {len(body)}\r\n\r\n").encode() + body, timeout=60)


@pytest.fixture
def spy(monkeypatch):
    """Where the decode ran, and whether json.loads was reached."""
    seen = {"threads": [], "loads": 0}
    real_shape, real_parse = body_mod.check_shape, body_mod.parse

    def shape(*a, **k):
        seen["threads"].append(threading.current_thread().name)
        return real_shape(*a, **k)

    def parse(*a, **k):
        seen["loads"] += 1
        return real_parse(*a, **k)
    monkeypatch.setattr(body_mod, "check_shape", shape)
    monkeypatch.setattr(body_mod, "parse", parse)
    return seen


# ---------------------------------------------------------------------------------------- item 2: body shapes
def test_token_id_flood_is_refused_before_parsing_off_the_loop(server, spy):
    limit = server.state.limits.max_json_values
    flood = json.dumps({"model": MODEL_NAME, "prompt": [7] * (limit + 10), "max_tokens": 1}).encode()
    for data, headers in ((flood, ""), (gzip.compress(flood), "Content-Encoding: gzip\r\n")):
        status, _, body, _ = _post(server.url, data, "Content-Type: application/json\r\n" + headers)
        err = openai_error(body)
        assert status == 400 and err["code"] == "body_too_complex" and str(limit) in err["message"], err
    assert spy["loads"] == 0, "a body over a limit must not be parsed"
    assert spy["threads"] and all(t.startswith("m3serve-prep") for t in spy["threads"]), spy["threads"]


def test_key_flood_and_deep_nesting_are_refused_before_parsing(server, spy):
    limits = server.state.limits
    keys = "{" + ",".join(f'"k{i}":0' for i in range(limits.max_json_keys + 1)) + ', "prompt": [5]}'
    status, _, body, _ = _post(server.url, zlib.compress(keys.encode()),
                               "Content-Type: application/json\r\nContent-Encoding: deflate\r\n")
    err = openai_error(body)
    assert status == 400 and err["code"] == "body_too_complex" and "keys" in err["message"], err
    deep = '{"prompt": [5], "x": ' + "[" * (limits.max_json_depth + 1) + "]" * (limits.max_json_depth + 1) + "}"
    status, _, body, _ = _post(server.url, deep.encode())
    err = openai_error(body)
    assert status == 400 and "nested" in err["message"], err
    assert spy["loads"] == 0
    # Brackets and colons inside strings are text, not structure.
    text = json.dumps({"model": MODEL_NAME, "prompt": "[{:" * 200 + '\\"]', "max_tokens": 1}).encode()
    status, _, body, _ = _post(server.url, text)
    assert status == 200, body


def test_gzip_bomb_gets_413_while_inflating(server):
    bomb = gzip.compress(b" " * (64 << 20))           # 64 MiB of spaces: ~64 KB on the wire
    t0 = time.monotonic()
    status, _, body, _ = _post(server.url, bomb, "Content-Type: application/json\r\nContent-Encoding: gzip\r\n")
    assert status == 413 and "--max-body-bytes" in openai_error(body)["message"]
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------------------------------- item 8: codings
def test_unknown_content_encoding_is_415_and_truncated_gzip_is_400(server):
    plain = json.dumps({"model": MODEL_NAME, "prompt": [5], "max_tokens": 1}).encode()
    for coding in ("br", "compress", "gzip, gzip", "bogus"):
        status, _, body, _ = _post(server.url, plain, f"Content-Type: application/json\r\nContent-Encoding: {coding}\r\n")
        assert status == 415 and "Content-Encoding" in openai_error(body)["message"], (coding, body)
    cut = gzip.compress(plain)[:-12]
    status, _, body, _ = _post(server.url, cut, "Content-Type: application/json\r\nContent-Encoding: gzip\r\n")
    assert status == 400 and "truncated" in openai_error(body)["message"], body
    status, _, body, _ = _post(server.url, zlib.compress(plain),
                               "Content-Type: application/json\r\nContent-Encoding: deflate\r\n")
    assert status == 200, body


# ---------------------------------------------------------------------------------------- item 7: web exposure
def test_post_needs_a_json_content_type(server):
    ok = json.dumps({"model": MODEL_NAME, "prompt": [5], "max_tokens": 1}).encode()
    for headers in ("Content-Type: text/plain\r\n", "", "Content-Type: application/x-www-form-urlencoded\r\n"):
        status, _, body, _ = _post(server.url, ok, headers)
        assert status == 415 and "Content-Type" in openai_error(body)["message"], (headers, body)
    status, _, body, _ = _post(server.url, ok, "Content-Type: application/json; charset=utf-8\r\n")
    assert status == 200, body


def test_no_version_banner(server):
    for req in (b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n", b"BROKEN\r\n\r\n"):
        _, headers, _, _ = exchange(server.url, req)
        banner = headers.get("server", "")
        assert "python" not in banner.lower() and "aiohttp" not in banner.lower(), banner


def test_api_key_covers_metrics(llm, keyed):
    status, _, body, _ = exchange(keyed.url, b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
    assert status == 401, body
    status, _, body, _ = exchange(keyed.url, f"GET /metrics HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}"
                                  "\r\n\r\n".encode())
    assert status == 200 and b"m3serve_engine_alive" in body
    assert exchange(keyed.url, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 200
    srv = serve(llm, api_key=KEY, public_metrics=True)
    try:
        assert exchange(srv.url, b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------- item 6: timeouts
def _open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=TIMEOUT_S + 10)


def _closed_after(s: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closes the connection, and what it sent before."""
    t0, got = time.monotonic(), b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    finally:
        s.close()
    return time.monotonic() - t0, got


def test_idle_partial_header_and_partial_body_connections_are_closed(server):
    silent = _open(server.url)
    partial_head = _open(server.url)
    partial_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: appl")
    partial_body = _open(server.url)
    partial_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    for s in (silent, partial_head, partial_body):
        seconds, _ = _closed_after(s)
        assert seconds < TIMEOUT_S + 5
    # The timeouts answer where a response can still be sent.
    s = _open(server.url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    _, got = _closed_after(s)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    s = _open(server.url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
    _, got = _closed_after(s)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]


def test_keep_alive_connection_survives_between_quick_requests(server):
    s = _open(server.url)
    try:
        for _ in range(3):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            got = b""
            while b'"ok"' not in got:
                chunk = s.recv(65536)
                assert chunk, "closed while in use"
                got += chunk
            time.sleep(TIMEOUT_S / 3)
    finally:
        s.close()


def test_a_chunk_declared_over_the_limit_is_refused_before_it_is_read(server):
    t0 = time.monotonic()
    status, headers, body, _ = exchange(server.url, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                                        b"application/json\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\n{",
                                        timeout=30)
    err = openai_error(body)
    assert status == 413 and "a chunk of 2814749767106" in err["message"] and "--max-body-bytes" in err["message"], err
    assert time.monotonic() - t0 < 5
    ok = json.dumps({"model": MODEL_NAME, "prompt": [5], "max_tokens": 1}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(ok[i:i + 7]), ok[i:i + 7]) for i in range(0, len(ok), 7)) + b"0\r\n\r\n"
    status, _, body, _ = exchange(server.url, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                                  b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
    assert status == 200, body
