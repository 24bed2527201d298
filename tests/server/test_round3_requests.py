"""Issue 34, items 3, 4, 5 and 8 (request side): a request-level character budget checked before tokenizing,
tokenization that one request cannot monopolise, chat-encoding errors as 400s, admission against the KV cache,
and offline errors that name the field."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest

from m3serve import SamplingParams
from m3serve.server.errors import APIError
from m3serve.server.limits import RequestLimits, check_completion_size
from m3serve.server.protocol import ModelInfo, parse_chat, parse_completion
from tests.server.conftest import MODEL_NAME, make_llm, serve

ENCODE_S = 0.25          # a slowed tokenizer: each prompt takes this long to encode


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, kv_cache_bytes=2 << 20)


def _info(llm, capacity: int | None = None) -> ModelInfo:
    return ModelInfo(name=MODEL_NAME, vocab_size=llm.model.cfg.vocab_size, max_model_len=llm.engine.max_model_len,
                     capacity_tokens=capacity or llm.engine.capacity_tokens, tokenizer=llm.tokenizer)


# ---------------------------------------------------------------------------------------- item 3
def test_request_character_budget_counts_prompts_times_candidates():
    lim = RequestLimits(max_body_bytes=1 << 20, max_prompt_chars=1000, max_messages=8)
    assert lim.max_request_chars == 4000
    check_completion_size({"prompt": ["a" * 999] * 4}, lim)             # 3,996 characters
    with pytest.raises(APIError) as e:
        check_completion_size({"prompt": ["a" * 999] * 5}, lim)
    assert e.value.status == 400 and "--max-request-chars" in e.value.message and e.value.param == "prompt"
    with pytest.raises(APIError) as e:                                   # 2 prompts x best_of 3
        check_completion_size({"prompt": ["a" * 999] * 2, "n": 1, "best_of": 3}, lim)
    assert "5994" in e.value.message
    with pytest.raises(APIError) as e:
        check_completion_size({"prompt": "a" * 900, "n": 5}, lim)
    assert e.value.status == 400


def test_issue_body_is_refused_before_any_tokenizing(llm, monkeypatch):
    calls = []
    real = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    srv = serve(llm)
    try:
        per_prompt = srv.state.limits.max_prompt_chars // len("Thou art ") * len("Thou art ") // 2
        body = json.dumps({"model": MODEL_NAME, "prompt": ["Thou art " * (per_prompt // 9)] * 64, "max_tokens": 4})
        status, data = _post_sync(srv.url, body)
        assert status == 400 and "--max-request-chars" in json.loads(data)["error"]["message"], data
        assert not calls
    finally:
        srv.stop()


def _post_sync(url: str, body: str) -> tuple[int, bytes]:
    import http.client
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_one_request_cannot_hold_the_tokenizer_pool(llm, monkeypatch):
    """Two requests of 6 slow prompts each (1.5 s of tokenizing apiece) on 2 prep threads, then a 1-prompt one:
    it is served after at most a prompt or two of theirs, not after both requests."""
    real = llm.tokenizer.encode

    def slow(*a, **k):
        time.sleep(ENCODE_S)
        return real(*a, **k)
    monkeypatch.setattr(llm.tokenizer, "encode", slow)
    srv = serve(llm, prep_threads=2)

    async def run() -> dict:
        done: dict[str, float] = {}
        async with aiohttp.ClientSession() as s:
            async def post(name: str, prompt, delay: float = 0.0):
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                async with s.post(srv.url + "/v1/completions",
                                  json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                done[name] = time.monotonic() - t0
            await asyncio.gather(post("a", ["ab cd"] * 6), post("b", ["ef gh"] * 6), post("small", "hi", 0.3))
        return done
    try:
        done = asyncio.run(run())
    finally:
        srv.stop()
    assert done["small"] < 4 * ENCODE_S + 0.5, done       # before the fix: after both big ones (>= 1.2 s of wait)
    assert done["small"] < min(done["a"], done["b"]), done


# ---------------------------------------------------------------------------------------- item 4
def test_every_chat_encoding_error_is_a_400_naming_messages(llm):
    every_private = "".join(chr(c) for c in range(0xE000, 0xF900))
    body = {"messages": [{"role": "user", "content": every_private + "<|im_start|>system"}], "max_tokens": 1}
    with pytest.raises(APIError) as e:
        parse_chat(body, _info(llm))
    assert e.value.status == 400 and e.value.param == "messages", e.value.message


# ---------------------------------------------------------------------------------------- item 5
def test_prompt_plus_max_tokens_must_fit_the_kv_cache(llm):
    info = _info(llm, capacity=3200)
    prompt = [5] * 3000
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": prompt, "max_tokens": 1000}, info)
    assert e.value.status == 400 and e.value.param == "max_tokens" and "3200" in e.value.message, e.value.message
    assert "KV cache" in e.value.message
    ok = parse_completion({"prompt": prompt, "max_tokens": 200}, info)
    assert ok.params[0].max_tokens == 200
    # unset: clamped to what fits (chat's default is "to the end of the context")
    msgs = [{"role": "user", "content": "hello"}]
    req = parse_chat({"messages": msgs}, info)
    assert req.params[0].max_tokens == 3200 - len(req.prompts[0])


def test_a_long_request_is_not_cut_short_silently(llm):
    """The issue's case end to end: the answer is a 400 naming the cache, never a short 'length' finish."""
    srv = serve(llm)
    try:
        cap = srv.state.info.capacity_tokens
        body = json.dumps({"model": MODEL_NAME, "prompt": [5] * (cap - 200), "max_tokens": 1000})
        status, data = _post_sync(srv.url, body)
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == "max_tokens" and str(cap) in err["message"], err
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------- item 8 (offline)
def test_offline_errors_name_the_field(llm):
    for bad in (5, 2.5, [1], ["ok", None], {"a": 1}):
        with pytest.raises((ValueError, TypeError), match=r"SamplingParams\.stop\b"):
            SamplingParams(stop=bad)
    with pytest.raises(ValueError, match=r"stop_token_ids.*1000000000.*vocabulary"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10 ** 9], max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt.*(surrogate|Unicode)"):
        llm.generate(["hi \ud800 there"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.requests, "a refused request leaves nothing behind"
