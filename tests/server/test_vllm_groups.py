"""n / best_of through the engine's request groups, and prompt_logprobs, over HTTP on the embedded model: the
choices equal LLM.generate's outputs for the same SamplingParams (n, best_of, seed), the candidates share the
prompt's KV pages (the prefix-cache hit counter in /metrics grows by (n - 1) x the prompt's full pages), and
prompt_logprobs come in vLLM's shape with the offline values.

Tolerances: token ids and texts exact (seeded per-candidate generators: batch-independent sampling). Logprobs 1e-4
absolute: the server's engine and the offline one run the same fp32 CPU math, but in differently batched steps
(candidates join at different steps), which changes summation order only (~1e-6 per value).
"""

from __future__ import annotations

import pytest
import torch

from m3serve import SamplingParams
from tests.server.promtext import parse, value
from tests.server.vllm_http import EMBEDDED, get_text, post, stream, streamed_texts
from tests.server.vllm_http import embedded_ref_fixture, embedded_server_fixture  # noqa: F401 (fixtures ref, server)




def _ids(seed: int, n: int) -> list[int]:
    """Ordinary (non-special) token ids of the embedded vocabulary, fresh per test."""
    return torch.randint(6, 3840, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _metrics(srv) -> dict:
    srv.engine_loop.call_sync(lambda engine: None)     # the loop published the stats of every step before this
    return parse(get_text(srv.url, "/metrics"))[1]


def _by_index(r: dict) -> list[dict]:
    return sorted(r["choices"], key=lambda c: c["index"])


def test_n_runs_as_one_group_sharing_the_prompt_pages(server, ref):
    prompt, n = _ids(1, 100), 4
    kw = dict(n=n, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    server.engine_loop.call_sync(lambda engine: engine.blocks.clear_prefix_cache())
    before = _metrics(server)
    status, r = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": prompt, "return_token_ids": True,
                                                     **kw})
    after = _metrics(server)
    assert status == 200, r
    want = ref.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)[0].outputs
    got = _by_index(r)
    assert [c["index"] for c in got] == list(range(n))
    assert [(c["token_ids"], c["text"]) for c in got] == [(o.token_ids, o.text) for o in want]
    assert len({tuple(c["token_ids"]) for c in got}) == n          # seeds 11..14: the candidates differ
    page = server.engine_loop.engine.kv.page_size
    full = (len(prompt) - 1) // page * page                          # the leader's full prompt pages, in tokens

    def grew(name):
        return value(after, name) - value(before, name)
    assert grew("m3serve_prefix_cache_queries_total") == n * len(prompt)
    assert grew("m3serve_prefix_cache_hits_total") == (n - 1) * full > 0
    assert grew("m3serve_prompt_tokens_total") == len(prompt)         # one prompt, prefilled once
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n * 6,
                          "total_tokens": len(prompt) + n * 6}


def test_n_streams_each_choice_and_batched_prompts_keep_their_order(server, ref):
    prompts = [_ids(2, 20), _ids(3, 45)]
    kw = dict(n=2, temperature=0.8, seed=5, max_tokens=7, ignore_eos=True)
    body = {"model": EMBEDDED, "prompt": prompts, **kw}
    status, r = post(server.url, "/v1/completions", body)
    assert status == 200, r
    want = ref.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw), use_tqdm=False)
    assert [c["text"] for c in _by_index(r)] == [o.text for out in want for o in out.outputs]
    events = stream(server.url, "/v1/completions", body)
    assert streamed_texts(events, "completion") == {c["index"]: c["text"] for c in r["choices"]}


def test_best_of_returns_the_offline_best_n(server, ref):
    prompt = _ids(4, 30)
    kw = dict(n=2, best_of=4, temperature=1.0, seed=21, max_tokens=6, ignore_eos=True)
    status, r = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": prompt, "return_token_ids": True,
                                                     "logprobs": 1, **kw})
    assert status == 200, r
    want = ref.generate({"prompt_token_ids": prompt}, SamplingParams(logprobs=1, **kw), use_tqdm=False)[0].outputs
    got = _by_index(r)
    assert [c["token_ids"] for c in got] == [o.token_ids for o in want] and len(got) == 2
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in got]
    assert sums[0] >= sums[1] - 1e-4                                   # best first
    for s, o in zip(sums, want):
        assert s == pytest.approx(o.cumulative_logprob, abs=1e-4)
    assert r["usage"]["completion_tokens"] == 12                       # the returned choices' tokens (vLLM)
    chat = {"model": EMBEDDED, "messages": [{"role": "user", "content": "Tell me a story."}], **kw}
    status, r = post(server.url, "/v1/chat/completions", chat)
    want = ref.chat(chat["messages"], SamplingParams(**kw), use_tqdm=False)[0].outputs
    assert status == 200 and [c["message"]["content"] for c in _by_index(r)] == [o.text for o in want]


@pytest.mark.parametrize("extra,message", [
    ({"n": 2, "best_of": 1}, ">= n"), ({"n": 1, "best_of": 3, "temperature": 0}, "greedy"),
    ({"n": 1, "best_of": 3, "stream": True}, "cannot be streamed"), ({"best_of": 9}, "[1, 8]"),
    ({"best_of": 5, "prompt": ["a", "b"]}, "at most 8"),
])
def test_bad_best_of_is_400_naming_it(server, extra, message):
    status, r = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": "a", "max_tokens": 2, **extra})
    assert status == 400 and r["error"]["param"] == "best_of" and message in r["error"]["message"], r


def _check_prompt_logprobs(got: list, want: list, k: int) -> None:
    """HTTP prompt_logprobs (vLLM's shape) against the offline RequestOutput.prompt_logprobs."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == [str(t) for t in w], (g, w)                    # top-k best first, then the prompt token
        for tid, lp in w.items():
            entry = g[str(tid)]
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert abs(entry["logprob"] - lp.logprob) < 1e-4
            assert (entry["rank"], entry["decoded_token"]) == (lp.rank, lp.decoded_token)
        assert len([e for e in g.values() if e["rank"] is not None]) == k


def test_prompt_logprobs_completions_shape_and_values(server, ref):
    prompt, k = "Once upon a time there was a small dragon", 3
    kw = dict(n=2, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=k)
    status, r = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": prompt, **kw})
    assert status == 200, r
    want = ref.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]
    assert want.prompt_logprobs is not None and len(want.prompt_logprobs) > 5
    for c in r["choices"]:                                             # every choice of the prompt carries them
        _check_prompt_logprobs(c["prompt_logprobs"], want.prompt_logprobs, k)
    assert [c["text"] for c in _by_index(r)] == [o.text for o in want.outputs]
    status, r = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": prompt, "max_tokens": 2,
                                                     "prompt_logprobs": 0})
    assert status == 200 and all(len(e) == 1 and next(iter(e.values()))["rank"] is None
                                 for e in r["choices"][0]["prompt_logprobs"][1:])
    status, r = post(server.url, "/v1/completions", {"model": EMBEDDED, "prompt": prompt, "max_tokens": 2})
    assert status == 200 and r["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_chat_at_the_top(server, ref):
    messages = [{"role": "user", "content": "Where do dragons sleep?"}]
    kw = dict(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    status, r = post(server.url, "/v1/chat/completions", {"model": EMBEDDED, "messages": messages, **kw})
    assert status == 200, r
    want = ref.chat(messages, SamplingParams(**kw), use_tqdm=False)[0]
    _check_prompt_logprobs(r["prompt_logprobs"], want.prompt_logprobs, 2)
    assert "prompt_logprobs" not in r["choices"][0] and r["choices"][0]["message"]["content"] == want.outputs[0].text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,fragment", [({"prompt_logprobs": 2, "stream": True}, "stream"),
                                            ({"prompt_logprobs": 21}, "[0, 20]"),
                                            ({"prompt_logprobs": "2"}, "[0, 20]")])
def test_bad_prompt_logprobs_is_400_naming_it(server, path, extra, fragment):
    base = {"model": EMBEDDED, "max_tokens": 1}
    base.update({"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]})
    status, r = post(server.url, path, {**base, **extra})
    assert status == 400 and r["error"]["param"] == "prompt_logprobs" and fragment in r["error"]["message"], r


def test_hanging_up_aborts_every_candidate(server):
    """A group's candidates (running, or deferred until the leader's first token) all stop when the client
    leaves: streamed n = 3, and a whole best_of = 3 request whose client times out."""
    import asyncio
    import time

    import aiohttp

    from tests.server.conftest import engine_idle
    total = engine_idle(server)["kv_pages_total"]
    long = {"model": EMBEDDED, "prompt": _ids(5, 70), "max_tokens": 3000, "temperature": 1.0, "ignore_eos": True}

    async def idle(timeout: float = 5.0) -> float:
        t0 = time.monotonic()
        while True:
            snap = server.engine_loop.snapshot
            if snap["active_requests"] == snap["running"] == snap["waiting"] == 0:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout, snap
            await asyncio.sleep(0.005)

    async def run() -> tuple[float, float, int]:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(server.url + "/v1/completions", json={**long, "n": 3, "stream": True})
            seen = set()
            async for line in resp.content:              # until every candidate has streamed something
                if line.startswith(b"data: {"):
                    seen.add(line.split(b'"index":')[1].split(b",")[0])
                if len(seen) == 3:
                    break
            streamed = server.engine_loop.snapshot["active_requests"]
            resp.close()
            t_stream = await idle()
            try:
                await s.post(server.url + "/v1/completions", json={**long, "n": 1, "best_of": 3},
                             timeout=aiohttp.ClientTimeout(total=0.5))
                raise AssertionError("a 3000-token best_of request finished within 0.5 s")
            except asyncio.TimeoutError:
                pass
            return t_stream, await idle(), streamed
    t_stream, t_whole, streamed = asyncio.run(run())
    after = engine_idle(server)
    assert streamed == 3 and t_stream < 2.0 and t_whole < 2.0, (streamed, t_stream, t_whole)
    assert after["kv_pages_free"] == total and after["live_seqs"] == 0 and after["requests"] == 0
