"""vLLM's /tokenize, /detokenize, /tokenizer_info, /version and /ping on the embedded model: the ids the
completions and chat endpoints would use, the round trip, errors naming the field; lm-eval 0.4.13's remote
tokenizer (when installed) working against them."""

from __future__ import annotations

import urllib.request

import pytest

import m3serve
from tests.server.vllm_http import EMBEDDED, post
from tests.server.vllm_http import embedded_ref_fixture, embedded_server_fixture  # noqa: F401 (fixtures ref, server)

TEXT = "Once upon a time, <|user|> said hi"


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read()


def test_tokenize_text_and_round_trip(server, ref):
    tok = ref.get_tokenizer()
    status, out = post(server.url, "/tokenize", {"model": EMBEDDED, "prompt": TEXT, "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == tok.encode(TEXT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == ref.engine.max_model_len
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    status, plain = post(server.url, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert plain["tokens"] == tok.encode(TEXT, add_special_tokens=False) and plain["token_strs"] is None
    status, back = post(server.url, "/detokenize", {"model": EMBEDDED, "tokens": plain["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(plain["tokens"])}


def test_tokenize_messages_as_chat_completions_renders_them(server, ref):
    msgs = [{"role": "user", "content": "hello <|assistant|> there"}]
    status, out = post(server.url, "/tokenize", {"messages": msgs})
    assert status == 200, out
    status, chat = post(server.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert out["count"] == chat["usage"]["prompt_tokens"]
    want = ref.chat(msgs, m3serve.SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert out["tokens"] == list(want)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt"), ("/tokenize", {"messages": "x"}, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"), ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_bodies_name_the_field(server, path, body, param):
    status, out = post(server.url, path, body)
    assert status in (400, 404) and out["error"]["param"] == param, out


def test_version_ping_tokenizer_info(server, ref):
    status, raw = _get(server.url + "/version")
    assert status == 200 and raw == b'{"version": "' + m3serve.__version__.encode() + b'"}'
    assert _get(server.url + "/ping") == (200, b"")
    req = urllib.request.Request(server.url + "/ping", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    status, out = post(server.url, "/detokenize", {"tokens": []})
    assert status == 200 and out == {"prompt": ""}
    import json
    info = json.loads(_get(server.url + "/tokenizer_info")[1])
    tok = ref.get_tokenizer()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def test_lm_eval_remote_tokenizer(server, ref):
    utils = pytest.importorskip("lm_eval.utils")
    remote = utils.RemoteTokenizer(server.url + "/v1/completions")
    tok = ref.get_tokenizer()
    assert remote.encode("Once upon a time") == tok.encode("Once upon a time", add_special_tokens=False)
    assert remote.decode(tok.encode("a b c", add_special_tokens=False)) == "a b c"
    assert remote.eos_token_id == tok.eos_token_id


def test_metrics_name_schemes_over_http(server):
    import shutil
    import subprocess
    import urllib.error
    status, raw = _get(server.url + "/metrics")
    text = raw.decode()
    assert status == 200 and f'm3serve_num_requests_running{{model_name="{EMBEDDED}"}}' in text and "vllm:" not in text
    if shutil.which("promtool"):
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    status, raw = _get(server.url + "/metrics?names=vllm")
    assert f'vllm:num_requests_running{{model_name="{EMBEDDED}"}}' in raw.decode()
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(server.url + "/metrics?names=prom")
    assert e.value.code == 400
