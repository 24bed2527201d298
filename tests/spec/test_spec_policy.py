"""speculative_config.disable_by_batch_size: with more requests in the engine (running + waiting) than the threshold
a step runs as a plain step (no drafts, verify rows or draft passes), the others speculate. Whatever the switching pattern, greedy
outputs equal plain greedy decoding, seeded sampled outputs are reproducible, no page leaks, and the step counts
show which steps ran which way (tiny preset, fp32, CPU; the eager speculative engine, and the plain overlap loop
through the stand-in for the decode graphs of tests/engine/test_overlap_loop.py)."""

from __future__ import annotations

import pytest
import torch

from m3serve.distributed.spec_driver import tp_spec_config
from m3serve.engine.engine import EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.spec_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpecConfig
from m3serve.engine.speculative import speculative_engine
from m3serve.model.loader import load_model
from tests.engine.test_overlap_loop import FakeGraphs
from tests.spec.specutil import cheat_engine, plain_outputs, prompts, run_staggered, spec_cfg


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _counts(eng) -> tuple[int, int, int]:
    st = eng.stats()["spec_decode"]
    return st["policy_plain_steps"], st["policy_spec_steps"], st["verify_steps"]


def _drive_two(eng, ps, params) -> tuple[list, list[tuple[int, int, int, int]]]:
    """Both requests at once; per step (requests decoding, plain steps, spec steps, verify steps) after it."""
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    log = []
    while eng.has_work():
        decoding = sum(not r.is_finished and r.num_computed >= len(r.prompt_token_ids) for r in reqs)
        eng.step()
        log.append((decoding, *_counts(eng)))
        assert len(log) < 500
    return reqs, log


@pytest.mark.parametrize("overlap", [False, True])
def test_two_decoding_requests_run_plainly_then_one_speculates_again(model, overlap):
    """disable_by_batch_size=1: while both requests decode every step is plain (no verify step, the plain counter
    rises); once the short one finished the long one speculates again (drafts accepted: the cheating drafter) and
    both still equal plain greedy decoding. overlap: plain steps go through the overlap loop (a plain step in
    flight when speculation resumes)."""
    ps = prompts(2, 20, 40, seed=11)
    params = [_greedy(7), _greedy(30)]
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3, corrupt_every=4, spec={"disable_by_batch_size": 1})
    if overlap:
        eng.runner.graphs = FakeGraphs(eng)
    reqs, log = _drive_two(eng, ps, params)
    assert [list(r.output_token_ids) for r in reqs] == ref
    both = [i for i, row in enumerate(log) if row[0] == 2]
    assert len(both) >= 5
    for i in both:                                  # plain: counted, and no verify step
        prev = log[i - 1] if i else (0, 0, 0, 0)
        assert log[i][1] == prev[1] + 1 and log[i][3] == prev[3], (i, log)
    after = log[both[-1]]
    last = log[-1]
    assert last[2] > after[2] and last[3] > after[3]        # the survivor speculated again
    assert max(eng.speculation.accept_hist[-3:]) > 0                    # ... and its drafts were accepted
    assert reqs[1].spec_metrics["verify_steps"] > 0
    if overlap:
        assert eng.runner.graphs.runs >= 5 and eng.runner.graphs.pending_reads == 0
    assert eng._inflight is None
    assert eng.blocks.num_free_slots() == eng.kv.num_slots  # every page came back


def test_the_threshold_counts_requests_in_the_engine_not_decoding_rows(model):
    """disable_by_batch_size=2 with three requests: their prompts' step (no decoding row yet) runs plainly too, so no
    draft pass runs over the prompts while the load is 3, and no verify step runs while three requests are in the
    engine; once one finished (load 2) the others speculate. Outputs equal plain greedy decoding."""
    ps = prompts(3, 12, 20, seed=21)
    params = [_greedy(4), _greedy(20), _greedy(20)]
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3, spec={"disable_by_batch_size": 2})
    spec = eng.speculation
    drafts = []
    real_draft = spec.spec_runner.draft
    spec.spec_runner.draft = lambda *a, **kw: drafts.append(len(eng.scheduler.running)) or real_draft(*a, **kw)
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    loads = []
    while eng.has_work():
        loads.append(len(eng.scheduler.running) + len(eng.scheduler.waiting))
        before = _counts(eng)
        eng.step()
        if loads[-1] == 3:
            assert _counts(eng)[1:] == before[1:], (loads, before, _counts(eng))   # no speculative step at load 3
        assert len(loads) < 200
    assert [list(r.output_token_ids) for r in reqs] == ref
    assert loads[0] == 3 and drafts and min(drafts) <= 2 and max(drafts) <= 2   # no draft pass at load 3
    plain, spec_steps, verify = _counts(eng)
    assert plain >= 3 and spec_steps >= 3 and verify >= 3
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_arrivals_switch_often_and_stay_exact(model, overlap):
    """Requests joining and leaving mid-run with chunked prefill and a shared prefix: the batch crosses the
    threshold (2) back and forth; outputs equal plain greedy decoding, no page leaks."""
    ps = prompts(8, seed=12)
    ps[5] = list(ps[1])
    g = torch.Generator().manual_seed(13)
    params = [_greedy(int(torch.randint(4, 30, (1,), generator=g))) for _ in ps]
    arrivals = [0, 0, 3, 6, 10, 18, 25, 40]
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3, corrupt_every=3, spec={"disable_by_batch_size": 2},
                       max_num_batched_tokens=48)
    if overlap:
        eng.runner.graphs = FakeGraphs(eng)
    reqs = run_staggered(eng, ps, params, arrivals)
    assert [list(r.output_token_ids) for r in reqs] == ref
    plain, spec, verify = _counts(eng)
    assert plain >= 5 and spec >= 5 and verify > 0
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


def test_preemption_with_the_policy(model):
    """Page pressure preempts requests during plain and speculative phases alike; outputs stay exact."""
    ps = prompts(4, 30, 40, seed=4)
    params = [_greedy(36)] * 4
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3, spec={"disable_by_batch_size": 2}, kv_cache_bytes=1 << 19,
                       max_num_seqs=4)
    reqs = run_staggered(eng, ps, params, [0, 0, 0, 5])
    assert eng.scheduler.num_preemptions > 0
    assert [list(r.output_token_ids) for r in reqs] == ref
    assert _counts(eng)[0] > 0
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


def test_sampled_requests_are_reproducible_per_seed(model):
    """Seeded sampled requests through plain and speculative phases: the same tokens from two fresh engines; a
    greedy request in the same batch still equals plain greedy decoding."""
    ps = prompts(3, 10, 30, seed=14)
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7),
              SamplingParams(max_tokens=8, temperature=0.7, top_k=40, seed=8), _greedy(20)]
    ref = plain_outputs(model, ps[2:], params[2:])[0]
    outs = []
    for _ in range(2):
        eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20),
                                  speculative_config=spec_cfg(3, disable_by_batch_size=1))
        reqs = run_staggered(eng, ps, params, [0, 0, 0])
        outs.append([list(r.output_token_ids) for r in reqs])
        plain, spec, _ = _counts(eng)
        assert plain > 0 and spec > 0
        assert eng.blocks.num_free_slots() == eng.kv.num_slots
    assert outs[0] == outs[1]
    assert outs[0][2] == ref
    assert [len(o) for o in outs[0]] == [16, 8, 20]


def test_logprobs_through_plain_and_speculative_phases(model):
    """Logprobs requests (which never overlap) across the switch: tokens and logprobs as plain decoding's."""
    from m3serve import LLM
    kw = dict(device="cpu", dtype="float32", kv_cache_bytes=4 << 20)
    ps = [{"prompt_token_ids": p} for p in prompts(2, seed=16)]
    sp = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in (5, 14)]
    a = LLM("tiny", **kw).generate(ps, sp, use_tqdm=False)
    spec = LLM("tiny", **kw, speculative_config=spec_cfg(3, disable_by_batch_size=1))
    b = spec.generate(ps, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert da.keys() == db.keys() and all(abs(da[t] - db[t]) < 1e-5 for t in da)
    plain, spec_steps, _ = _counts(spec.engine)
    assert plain >= 3 and spec_steps >= 3 and b[1].spec_metrics["verify_steps"] > 0


def test_policy_off_and_default(model):
    """None speculates at every batch size (no plain step, nothing counted); the default threshold is the named
    constant and shows in stats()."""
    ps = prompts(3, seed=15)
    params = [_greedy(6)] * 3
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20), speculative_config=spec_cfg(2))
    run_staggered(eng, ps, params, [0, 0, 0])
    assert _counts(eng)[:2] == (0, 0) and eng.stats()["spec_decode"]["verify_steps"] > 0
    dflt = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20),
                               speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    assert dflt.speculation.spec.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE == 2
    assert dflt.stats()["spec_decode"]["disable_by_batch_size"] == 2


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_config_rejects_bad_thresholds(value):
    with pytest.raises(ValueError, match=f"disable_by_batch_size.*{value!r}"):
        SpecConfig.from_dict({"method": "eagle3", "disable_by_batch_size": value})


def test_config_accepts_none_and_positive_ints():
    assert SpecConfig.from_dict({"disable_by_batch_size": None}).disable_by_batch_size is None
    assert SpecConfig.from_dict({"disable_by_batch_size": 64}).to_dict()["disable_by_batch_size"] == 64


def test_tensor_parallel_default_is_off_and_a_value_is_refused():
    assert tp_spec_config({"method": "eagle3", "num_speculative_tokens": 3}).disable_by_batch_size is None
    assert tp_spec_config({"disable_by_batch_size": None}).disable_by_batch_size is None
    with pytest.raises(ValueError, match="disable_by_batch_size = 2.*tensor_parallel_size"):
        tp_spec_config({"method": "eagle3", "disable_by_batch_size": 2})


@pytest.mark.parametrize("argv, err", [
    (["--speculative-disable-by-batch-size", "4"], "needs --speculative-tokens or --speculative-config"),
    (["--speculative-config", '{"method": "eagle3", "disable_by_batch_size": 8}',
      "--speculative-disable-by-batch-size", "4"], "disagree"),
    (["--speculative-config", '{"method": "eagle3"}', "--speculative-disable-by-batch-size", "four"],
     "expected an int >= 1, 'none', 'auto' or 'auto:N'"),
    (["--speculative-config", '{"method": "eagle3"}', "--speculative-disable-by-batch-size", "auto:0"],
     "expected an int >= 1, 'none', 'auto' or 'auto:N', found 'auto:0'"),
    (["--speculative-config", '{"method": "eagle3", "disable_by_batch_size": "auto"}',
      "--speculative-disable-by-batch-size", "auto:2"], "disagree"),
])
def test_serve_flag_errors(argv, err, capsys):
    import argparse

    from m3serve.server import cli
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["tiny", "--device", "cpu"] + argv)) == 2
    assert err in capsys.readouterr().err


@pytest.mark.parametrize("limit, want", [(2, (1, 2, 4, 8)), ("auto", (1, 2, 4, 8)), (None, ())])
def test_plain_graphs_cover_every_bucket_under_a_policy(model, limit, want):
    """Counting requests, not decoding rows, a plain step may decode one or two rows (three requests in the
    engine, one still prefilling): the plain decode graphs cover every bucket, none without a policy."""
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20),
                             speculative_config=spec_cfg(3, disable_by_batch_size=limit))
    assert eng.speculation._policy_buckets((1, 2, 4, 8)) == want
