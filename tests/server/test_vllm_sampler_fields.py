"""vLLM's min_p, allowed_token_ids, bad_words and truncate_prompt_tokens over HTTP equal the offline API on the
embedded model (greedy or seeded, so the tokens compare exactly), and the filters visibly act."""

from __future__ import annotations

import pytest

from m3serve import SamplingParams
from tests.server.vllm_http import EMBEDDED, http_fields, post
from tests.server.vllm_http import embedded_ref_fixture, embedded_server_fixture  # noqa: F401 (fixtures ref, server)

PROMPT = "Once upon a time"


def _free(ref, **kw):
    return ref.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw),
                        use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_filters_match_the_offline_api(server, ref, path):
    free = _free(ref)
    tok = ref.get_tokenizer()
    cases = [dict(allowed_token_ids=sorted(set(range(50, 2000)) - {free.token_ids[0]})),
             dict(bad_words=[tok.decode([free.token_ids[0]]).strip() or "x"]),
             dict(min_p=0.3, temperature=0.9, seed=7)]
    for kw in cases:
        body = {"model": EMBEDDED, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                **http_fields(**kw)}
        if path == "/v1/completions":
            body["prompt"] = PROMPT
            want = ref.generate(PROMPT, SamplingParams(**{**dict(max_tokens=8, temperature=0.0, ignore_eos=True),
                                                          **kw}), use_tqdm=False)[0].outputs[0].token_ids
        else:
            msgs = [{"role": "user", "content": PROMPT}]
            body["messages"] = msgs
            want = ref.chat(msgs, SamplingParams(**{**dict(max_tokens=8, temperature=0.0, ignore_eos=True), **kw}),
                            use_tqdm=False)[0].outputs[0].token_ids
        status, out = post(server.url, path, body)
        assert status == 200, out
        got = out["choices"][0]["token_ids"]
        assert list(got) == list(want), kw
        if "allowed_token_ids" in kw:
            assert all(t in kw["allowed_token_ids"] for t in got)


def test_allowed_token_ids_change_the_output(ref):
    free = _free(ref)
    banned = _free(ref, allowed_token_ids=sorted(set(range(50, 2000)) - {free.token_ids[0]}))
    assert banned.token_ids[0] != free.token_ids[0]


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, ref):
    ids = ref.get_tokenizer().encode(PROMPT * 3, add_special_tokens=False)
    status, out = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": ids, "max_tokens": 4,
                                                       "temperature": 0.0, "truncate_prompt_tokens": 5,
                                                       "return_token_ids": True})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == 5 and out["choices"][0]["prompt_token_ids"] == ids[-5:]
    want = ref.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(max_tokens=4, temperature=0.0),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert out["choices"][0]["token_ids"] == list(want)
