"""lm-evaluation-harness 0.4.13's `local-completions` requests, as that version builds them, against the embedded
model: log-likelihood (echo + logprobs=1 + max_tokens=1, token-id prompts batched, and text prompts), echo with
max_tokens = 0, and generate_until. The answer is read the way lm-eval's parse_logprobs reads it (written out
below from its documented behaviour: token_logprobs[ctxlen:-1] summed, greedy when each continuation token's
logprob is the top of its top_logprobs), and compared with the offline API's prompt_logprobs.

Tolerance: logprobs agree to 1e-4 (absolute). The server batches the two prompts' prefills into one step, the
offline reference runs each alone: fp32 on CPU, the same weights, a different reduction grouping, measured
differences ~1e-6; 1e-4 is far below the gaps between distinct tokens' logprobs that decide greediness.
"""

from __future__ import annotations

from operator import itemgetter

import pytest

from m3serve import SamplingParams
from tests.server.vllm_http import EMBEDDED, post
from tests.server.vllm_http import embedded_ref_fixture, embedded_server_fixture  # noqa: F401 (fixtures ref, server)

CONTEXT = "Once upon a time there was a"
CONTINUATIONS = [" little girl", " dragon who lived in"]


def loglikelihood_payload(prompts) -> dict:
    """lm-eval 0.4.13 LocalCompletionsAPI._create_payload(generate=False)."""
    return {"model": EMBEDDED, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def generate_payload(prompts, max_tokens=16) -> dict:
    """The same, generate=True, with a task's `until`."""
    return {"prompt": prompts, "model": EMBEDDED, "max_tokens": max_tokens, "temperature": 0, "stop": ["\n\n"],
            "seed": 1234}


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """How lm-eval 0.4.13 reads a log-likelihood answer (LocalCompletionsAPI.parse_logprobs)."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return res


def _encode(ref, text):
    return ref.get_tokenizer().encode(text, add_special_tokens=False)


def _offline(ref, ids: list[int]) -> tuple[list[float | None], list[int | None]]:
    """Each prompt token's logprob and the argmax token id at its position (None for the first token)."""
    out = ref.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                       use_tqdm=False)[0]
    lps, tops = [], []
    for tid, entry in zip(ids, out.prompt_logprobs):
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(entry[tid].logprob)
        tops.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return lps, tops


def test_loglikelihood_token_prompts(server, ref):
    ctx = _encode(ref, CONTEXT)
    prompts = [ctx + _encode(ref, c) for c in CONTINUATIONS]
    status, out = post(server.url, "/v1/completions", loglikelihood_payload(prompts))
    assert status == 200, out
    for choice, ids in zip(sorted(out["choices"], key=itemgetter("index")), prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want, _ = _offline(ref, ids)
        assert lp["token_logprobs"][1:-1] == pytest.approx(want[1:], abs=1e-4)
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        assert choice["text"].startswith(ref.get_tokenizer().decode(ids, skip_special_tokens=True))
    got = parse_logprobs(out, [len(ctx)] * len(prompts))
    for (total, greedy), ids in zip(got, prompts):
        want, argmax = _offline(ref, ids)
        assert total == pytest.approx(sum(want[len(ctx):]), abs=1e-3)
        assert greedy == all(a == t for a, t in zip(argmax[len(ctx):], ids[len(ctx):]))
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_loglikelihood_text_prompt_and_a_greedy_continuation(server, ref):
    """tokenized_requests=False sends text; a continuation that is the model's own greedy output is greedy."""
    ctx = _encode(ref, CONTEXT)
    gen = ref.generate({"prompt_token_ids": ctx}, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    cont = list(gen[0].outputs[0].token_ids)
    status, out = post(server.url, "/v1/completions", loglikelihood_payload([ctx + cont]))
    assert status == 200, out
    assert parse_logprobs(out, [len(ctx)])[0][1] is True
    status, out = post(server.url, "/v1/completions", loglikelihood_payload(CONTEXT))
    assert status == 200, out
    assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == len(ctx) + 1


def test_echo_with_max_tokens_zero_scores_the_prompt_only(server, ref):
    ids = _encode(ref, CONTEXT)
    status, out = post(server.url, "/v1/completions", {**loglikelihood_payload([ids]), "max_tokens": 0})
    assert status == 200, out
    c = out["choices"][0]
    assert len(c["logprobs"]["token_logprobs"]) == len(ids)
    assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(_offline(ref, ids)[0][1:], abs=1e-4)
    assert c["text"] == ref.get_tokenizer().decode(ids, skip_special_tokens=True)
    assert c["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    status, out = post(server.url, "/v1/completions", {"prompt": CONTEXT, "max_tokens": 0, "echo": True})
    assert status == 200 and out["choices"][0]["text"] == CONTEXT and out["choices"][0]["logprobs"] is None


def test_generate_until(server, ref):
    status, out = post(server.url, "/v1/completions", generate_payload([CONTEXT, "The sun"]))
    assert status == 200, out
    want = ref.generate([CONTEXT, "The sun"], SamplingParams(max_tokens=16, temperature=0.0, stop=["\n\n"],
                                                            seed=1234), use_tqdm=False)
    assert [c["text"] for c in sorted(out["choices"], key=itemgetter("index"))] == [o.outputs[0].text for o in want]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0, "echo": True, "stream": True}, "echo"),
    ({"prompt": "a", "logprobs": 1, "echo": True, "stream": True}, "echo"),
])
def test_refusals_name_the_field(server, body, param):
    status, out = post(server.url, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == param, out


def test_lm_eval_itself_reads_the_answer(server, ref):
    """When lm-eval 0.4.13 is installed: its own parse_logprobs on the server's answer."""
    oc = pytest.importorskip("lm_eval.models.openai_completions")
    ctx = _encode(ref, CONTEXT)
    prompts = [ctx + _encode(ref, c) for c in CONTINUATIONS]
    status, out = post(server.url, "/v1/completions", loglikelihood_payload(prompts))
    assert status == 200
    assert oc.LocalCompletionsAPI.parse_logprobs(out, ctxlens=[len(ctx)] * 2) == parse_logprobs(out, [len(ctx)] * 2)
