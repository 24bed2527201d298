"""The official `openai` client, unmodified, against a live server on 127.0.0.1: completions and chat, whole
and streamed, logprobs, stop, seed, n, usage, errors, auth, /v1/models, /health, /metrics, `m3serve serve`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from m3serve import SamplingParams
from m3serve.server.responses import token_str
from tests.server.conftest import MODEL_NAME, make_llm, serve
from tests.server.promtext import parse, value


@pytest.fixture(scope="module")
def server(model_dir):
    srv = serve(make_llm(model_dir, max_num_seqs=16, max_queue=64))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(model_dir):
    """The same checkpoint in a separate offline LLM: what a request run alone must produce."""
    return make_llm(model_dir)


def _alone(ref, prompt, **kw):
    kw.setdefault("temperature", 0.0)
    return ref.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def _http(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


PROMPTS = ["abc defg hij", "zq wert", "中文 ab"]


def test_models_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME] and models[0].model_extra["max_model_len"] == 4096
    status, body, _ = _http(server.url + "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_offline_run(client, ref, prompt):
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    want = _alone(ref, prompt, max_tokens=12, ignore_eos=True)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want.token_ids and c.text == want.text
    assert c.finish_reason == "length" and r.object == "text_completion" and r.model == MODEL_NAME
    n_prompt = len(ref.tokenizer.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_stream_equals_whole(client, prompt):
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({ch.id for ch in chunks}) == 1


def test_chat_whole_and_stream(client, ref):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc 中文"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    text = ref.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = ref.tokenizer.encode(text, add_special_tokens=False)
    want = _alone(ref, {"prompt_token_ids": ids}, max_tokens=10, ignore_eos=True)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.tokenizer.decode(want.token_ids,
                                                                                     skip_special_tokens=True)
    assert c.model_extra["token_ids"] == want.token_ids and r.usage.prompt_tokens == len(ids)
    assert r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_match_offline(client, ref):
    prompt = PROMPTS[0]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    want = _alone(ref, prompt, max_tokens=6, ignore_eos=True, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for tid, got, tops, entry in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        # Same fp32 math, different batch composition: ~1e-6 apart; 1e-4 leaves room without hiding a bug.
        assert abs(got - entry[tid]) < 1e-4
        assert len(tops) <= 3 and abs(max(tops.values()) - got) < 1e-4     # greedy: the top-1 token
    assert lp.tokens == [token_str(ref.tokenizer, t) for t in want.token_ids]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               for t in content)


def test_stop_string_cuts_text_whole_and_streamed(client, ref):
    prompt = PROMPTS[1]
    full = _alone(ref, prompt, max_tokens=24, ignore_eos=True).text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    want = full[:full.find(stop)]
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == want


def test_seed_n_and_batched_prompts(client, ref):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ids_a = [c.model_extra["token_ids"] for c in sorted(a.choices, key=lambda c: c.index)]
    assert ids_a == [c.model_extra["token_ids"] for c in sorted(b.choices, key=lambda c: c.index)]
    assert len({tuple(x) for x in ids_a}) == 3          # copies get seeds 7, 8, 9: they differ
    for j in range(3):
        assert ids_a[j] == _alone(ref, PROMPTS[0], max_tokens=8, ignore_eos=True, temperature=1.0,
                                  seed=7 + j).token_ids
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    got = {c.index: c.text for c in r.choices}
    assert sorted(got) == [0, 1, 2, 3] and got[0] == got[1] and got[2] == got[3]
    assert got[0] == _alone(ref, PROMPTS[0], max_tokens=5, ignore_eos=True).text
    assert r.usage.completion_tokens == 20


def test_client_errors_are_openai_shaped_4xx(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=[3 + i % 500 for i in range(4096)], max_tokens=1)
    err = e.value.body
    assert err["param"] == "prompt" and "4096" in err["message"] and err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=4095)
    assert e.value.body["param"] == "max_tokens" and "4096" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="abc")
    assert e.value.body["param"] == "model"
    for method, path, status in (("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404),
                                 ("POST", "/v1/completions", 400)):
        code, body, _ = _http(server.url + path, method, b"{bad json" if method == "POST" else None,
                              {"Content-Type": "application/json"})
        assert code == status and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_api_key_required_when_set(model_dir):
    srv = serve(make_llm(model_dir, kv_cache_bytes=1 << 20), api_key="s3cret")
    try:
        bad = OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        assert _http(srv.url + "/v1/models")[0] == 401
        good = OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="ab", max_tokens=2).usage.completion_tokens >= 1
        assert _http(srv.url + "/health")[0] == 200                  # probes need no key
        assert _http(srv.url + "/metrics")[0] == 401                 # metrics do (issue 34; --public-metrics)
        assert _http(srv.url + "/metrics", headers={"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        srv.stop()


def test_metrics_count_the_traffic(client, server):
    _, before = parse(_http(server.url + "/metrics")[1])
    usage = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True}).usage for p in PROMPTS]
    status, text, headers = _http(server.url + "/metrics")
    types, after = parse(text)
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)
    assert grew("m3serve_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert grew("m3serve_generation_tokens_total") == sum(u.completion_tokens for u in usage) == 15
    assert grew("m3serve_time_to_first_token_seconds_count") == 3
    assert grew("m3serve_inter_token_latency_seconds_count") == 12       # 4 gaps per 5-token request
    assert grew("m3serve_request_success_total", finished_reason="length") == 3
    assert grew("m3serve_http_responses_total", status="200") >= 4
    assert value(after, "m3serve_engine_alive") == 1 and value(after, "m3serve_kv_pages_capacity") > 0
    for name in ("m3serve_num_requests_waiting", "m3serve_num_requests_running", "m3serve_kv_pages_free",
                 "m3serve_kv_pages_used", "m3serve_num_preemptions", "m3serve_time_to_first_token_seconds",
                 "m3serve_inter_token_latency_seconds"):
        assert name in types


def test_m3serve_serve_subprocess(model_dir):
    """`m3serve serve` as a process: prints its URL, answers the client, exits cleanly on SIGTERM."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "m3serve.server", model_dir, "--port", "0", "--device", "cpu", "--dtype", "float32",
           "--kv-cache-bytes", str(1 << 20), "--served-model-name", "sub", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        c = OpenAI(base_url=m.group(1) + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="sub", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    assert rc == 0
