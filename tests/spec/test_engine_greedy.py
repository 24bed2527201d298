"""Speculative greedy decoding == plain greedy decoding, token for token (tiny preset, fp32, CPU): random and
"cheating" drafters, requests joining and leaving mid-run, chunked prefill, prefix reuse, preemption, stops,
the context limit, logprobs, and greedy requests batched with sampled ones."""

from __future__ import annotations

import pytest
import torch

from m3serve import LLM
from m3serve.engine.engine import EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import speculative_engine
from m3serve.kv.layout import SlotLayout
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.loader import load_model
from tests.spec.specutil import cheat_engine, plain_outputs, prompts, run_staggered, spec_cfg


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


def _mix(n: int, seed: int = 0):
    """n prompts (some sharing a long prefix, for prefix-cache hits), greedy params with varied lengths so that
    requests leave at different steps, and staggered arrival steps so that they join mid-run."""
    ps = prompts(n, seed=seed)
    ps[3] = ps[1][:40] + ps[3][:10] if len(ps[1]) >= 40 else ps[3]
    ps[5] = list(ps[1])                                       # identical prompt: full-page prefix hits
    g = torch.Generator().manual_seed(seed + 100)
    params = [SamplingParams(max_tokens=int(torch.randint(4, 40, (1,), generator=g)), temperature=0.0,
                             ignore_eos=True) for _ in range(n)]
    arrivals = sorted(int(x) for x in torch.randint(0, 25, (n,), generator=g))
    arrivals[0] = 0
    return ps, params, arrivals


@pytest.mark.parametrize("k", [1, 3])
def test_random_drafter_equals_plain_greedy(model, k):
    ps, params, arrivals = _mix(14)
    ref = plain_outputs(model, ps, params)
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20, max_num_batched_tokens=48),
                              speculative_config=spec_cfg(k))
    reqs = run_staggered(eng, ps, params, arrivals)
    assert [list(r.output_token_ids) for r in reqs] == ref
    st = eng.stats()["spec_decode"]
    assert st["verify_steps"] > 50 and st["draft_tokens"] == k * st["verify_steps"]
    assert eng.blocks.num_free_slots() == eng.kv.num_slots     # every page came back


def test_cheating_drafter_long_accepts_equal_plain_greedy(model):
    ps, params, arrivals = _mix(14, seed=1)
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=4, corrupt_every=5, max_num_batched_tokens=48)
    cached = []
    allocate = eng.blocks.allocate
    eng.blocks.allocate = lambda sid, toks: cached.append(allocate(sid, toks)) or cached[-1]
    reqs = run_staggered(eng, ps, params, arrivals)
    assert [list(r.output_token_ids) for r in reqs] == ref
    # Every acceptance length 0..K occurred, and acceptance is high: the verifier took long draft prefixes.
    assert set(eng.speculation.accept_hist) == {0, 1, 2, 3, 4}
    assert eng.stats()["spec_decode"]["acceptance_length"] > 2.5
    assert max(cached) >= 32          # the repeated prompt reused cached pages (target and draft KV)


def test_cheating_drafter_all_correct_accepts_everything(model):
    ps = prompts(4, seed=2)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 4
    longer = plain_outputs(model, ps, [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4)
    eng = cheat_engine(model, ps, params, longer, k=3, corrupt_every=0)
    reqs = run_staggered(eng, ps, params, [0, 0, 2, 5])
    assert [list(r.output_token_ids) for r in reqs] == [x[:30] for x in longer]
    # All drafts correct (the reference runs past max_tokens): every verify step accepts all K.
    assert set(eng.speculation.accept_hist) == {3}
    assert eng.stats()["spec_decode"]["acceptance_length"] == 4.0
    assert all(r.spec_metrics["acceptance_length"] == 4.0 for r in reqs)


def test_abort_mid_run_leaves_others_exact(model):
    ps, params, arrivals = _mix(8, seed=3)
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3)
    reqs = run_staggered(eng, ps, params, arrivals, abort={2: arrivals[2] + 3})
    for i, r in enumerate(reqs):
        if i == 2:
            assert r.finish_reason == "abort"
        else:
            assert list(r.output_token_ids) == ref[i]
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


def test_preemption_under_page_pressure(model):
    # A cache of 14 pages of 16 tokens for 4 requests growing to ~75 tokens (5 pages each, plus K pages of
    # draft room): the scheduler must preempt, and recomputed requests must still decode exactly.
    spec = KVCacheSpec.from_model_config(model.cfg, kv_cache_dtype="auto", model_dtype=torch.float32,
                                         num_draft_layers=1, draft_num_kv_heads=model.cfg.num_key_value_heads)
    lay = SlotLayout(spec)
    ps = prompts(4, 30, 40, seed=4)
    params = [SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)] * 4
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3, kv_cache_bytes=14 * (lay.slot_bytes + lay.scale_slot_bytes),
                       max_num_seqs=4)
    assert eng.kv.num_slots == 14
    reqs = run_staggered(eng, ps, params, [0, 0, 0, 0])
    assert eng.scheduler.num_preemptions > 0
    assert [list(r.output_token_ids) for r in reqs] == ref


def test_stop_token_inside_accepted_drafts(model):
    ps = prompts(6, seed=5)
    base = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 6
    full = plain_outputs(model, ps, base)
    # stop at a token first emitted at index >= 9: with K = 4 it lies inside an accepted draft run (random tiny
    # models often loop, so keep the prompts whose output has such a token)
    firsts = [next((t for i, t in enumerate(out) if i >= 9 and t not in out[:i]), None) for out in full]
    keep = [i for i, t in enumerate(firsts) if t is not None][:3]
    assert len(keep) == 3
    ps, full = [ps[i] for i in keep], [full[i] for i in keep]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[firsts[i]])
              for i in keep]
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, full, k=4, corrupt_every=0)
    reqs = run_staggered(eng, ps, params, [0, 0, 1])
    assert [list(r.output_token_ids) for r in reqs] == ref
    assert all(r.finish_reason == "stop" for r in reqs) and all(len(x) >= 10 for x in ref)


def test_context_limit(model):
    ps = prompts(3, 40, 55, seed=6)
    params = [SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)] * 3
    ref = plain_outputs(model, ps, params, max_model_len=64)
    eng = cheat_engine(model, ps, params, ref, k=3, corrupt_every=0, max_model_len=64)
    reqs = run_staggered(eng, ps, params, [0, 1, 2])
    assert [list(r.output_token_ids) for r in reqs] == ref
    assert all(r.num_tokens == 64 and r.finish_reason == "length" for r in reqs)


def test_logprobs_match_plain(model):
    llm_plain = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=4 << 20)
    llm_spec = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=4 << 20, speculative_config=spec_cfg(3))
    ps = [{"prompt_token_ids": p} for p in prompts(3, seed=7)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    a = llm_plain.generate(ps, sp, use_tqdm=False)
    b = llm_spec.generate(ps, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert da.keys() == db.keys()
            # fp32, same math; the verify rows are computed batched (K+1 rows) instead of one row
            assert all(abs(da[t] - db[t]) < 1e-5 for t in da)
    assert b[0].spec_metrics["verify_steps"] > 0 and a[0].spec_metrics is None


def test_greedy_requests_exact_when_batched_with_sampled_ones(model):
    ps = prompts(6, seed=8)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    params = [greedy if i % 2 == 0 else SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9,
                                                       ignore_eos=True, seed=i) for i in range(6)]
    ref = plain_outputs(model, ps, [greedy] * 6)
    runs = []
    for _ in range(2):
        eng = cheat_engine(model, ps, params, ref, k=3)
        runs.append([list(r.output_token_ids) for r in run_staggered(eng, ps, params, [0, 0, 1, 1, 2, 3])])
    for i in range(0, 6, 2):
        assert runs[0][i] == ref[i]
    assert runs[0] == runs[1]                           # seeded: the device RNG replays
    for i in range(1, 6, 2):
        assert len(runs[0][i]) == 20 and all(0 <= t < 512 for t in runs[0][i])
        assert runs[0][i] != ref[i]                      # temperature 0.9 departs from the greedy path


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_quantized_caches_exact(model, kv_dtype):
    # The hybrid cache (NVFP4 sparse layers, FP8 dense and draft layers): rejected drafts' K/V and their NVFP4
    # block scales are overwritten in place later (append-only), and every token is quantized on its own, so
    # speculative greedy still equals plain greedy over the same cache format.
    ps = prompts(6, seed=50)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 6
    ref = plain_outputs(model, ps, params, kv_cache_dtype=kv_dtype)
    eng = cheat_engine(model, ps, params, ref, k=3, kv_cache_dtype=kv_dtype)
    assert eng.kv.spec.kv_format(eng.kv.draft_layer) == "fp8"
    assert [list(r.output_token_ids) for r in run_staggered(eng, ps, params, [0, 0, 1, 2, 3, 4])] == ref
    assert 0 in eng.speculation.accept_hist and 3 in eng.speculation.accept_hist
