"""Issue 17, part 4: edge cases. A broken gzip body is a 400 (was 500); GET /v1/models/{id} exists (the openai
client's models.retrieve); n beyond the waiting queue is a 400 (was a 429 that could never succeed); the HTTP
parser's own errors (bad method, oversized header, bad chunking) come back as OpenAI-shaped JSON and are logged
as one line, not an ERROR traceback."""

from __future__ import annotations

import gzip
import json
import logging

import openai
import pytest
from openai import OpenAI

from tests.server.conftest import MODEL_NAME, make_llm, serve
from tests.server.rawhttp import exchange, openai_error

MAX_QUEUE = 3


@pytest.fixture(scope="module")
def server(model_dir):
    srv = serve(make_llm(model_dir, kv_cache_bytes=2 << 20, max_queue=MAX_QUEUE), max_choices=8)
    yield srv
    srv.stop()


def _post_raw(url: str, body: bytes, headers: str = "") -> tuple[int | None, dict, bytes, float]:
    return exchange(url, (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{headers}"
                          f"Content-Length: {len(body)}\r\n\r\n").encode() + body)


def test_broken_gzip_body_is_400(server):
    plain = json.dumps({"model": MODEL_NAME, "prompt": [5], "max_tokens": 1}).encode()
    status, _, body, _ = _post_raw(server.url, plain, "Content-Encoding: gzip\r\n")
    err = openai_error(body)
    assert status == 400 and "could not be read" in err["message"] and "gzip" in err["message"], err
    status, _, body, _ = _post_raw(server.url, gzip.compress(plain), "Content-Encoding: gzip\r\n")
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 1     # real gzip still works


def test_models_retrieve(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model" and card.model_extra["max_model_len"] == 4096
    assert card.model_dump()["created"] == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found" and "gpt-9" in e.value.body["message"]


def test_n_beyond_the_queue_is_400_not_429(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="ab", n=MAX_QUEUE + 1, max_tokens=1)
    err = e.value.body
    assert err["param"] == "n" and err["code"] == "too_many_choices" and f"--max-queue {MAX_QUEUE}" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=["ab"] * (MAX_QUEUE + 1), max_tokens=1)
    assert e.value.body["param"] == "prompt"
    r = client.completions.create(model=MODEL_NAME, prompt="ab", n=MAX_QUEUE, max_tokens=1)
    assert len(r.choices) == MAX_QUEUE           # exactly the queue: admitted


@pytest.mark.parametrize("name,data", [
    ("bad method", b"FO@O /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("oversized header", b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n"),
    ("bad chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"zz\r\nabc\r\n0\r\n\r\n"),
    ("bad content-length", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: -5\r\n\r\n"),
])
def test_http_parser_errors_are_json_and_one_log_line(server, caplog, name, data):
    with caplog.at_level(logging.DEBUG):
        status, headers, body, _ = exchange(server.url, data, until_close=True)
    assert status is not None and 400 <= status < 500, (name, status, body[:200])
    assert headers["content-type"].startswith("application/json"), (name, headers)
    assert openai_error(body)["type"] == "invalid_request_error"
    ours = [r for r in caplog.records if r.name.startswith(("aiohttp", "m3serve"))
            and r.levelno >= logging.INFO]
    assert all(r.levelno < logging.ERROR and r.exc_info is None and "\n" not in r.getMessage() for r in ours), \
        [(r.name, r.levelname, r.getMessage()[:200], r.exc_info is not None) for r in ours]
    assert len(ours) == 1, [r.getMessage()[:200] for r in ours]     # one line, and the capture works
