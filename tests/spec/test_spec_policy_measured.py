"""speculative_config.disable_by_batch_size = "auto" (engine/spec_policy.MeasuredPolicy): per graph bucket, the kind
of step with more tokens per second per sequence so far. The rule on a fake clock (a step's period = the time
between step starts; speculative steps weigh by the acceptance length), then the engine under it: greedy outputs
equal plain greedy decoding whichever way each step goes, no page leaks (tiny preset, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.spec_config import SpecConfig
from m3serve.engine.spec_policy import PLAIN, SPEC, FixedThreshold, MeasuredPolicy, make_policy
from m3serve.model.loader import load_model
from tests.engine.test_overlap_loop import FakeGraphs
from tests.spec.specutil import cheat_engine, plain_outputs, prompts


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_steps(policy: MeasuredPolicy, clock: Clock, kind: str, period: float, n: int, decoding: int = 1) -> None:
    """n pure decode steps of `kind`, each `period` seconds long."""
    for _ in range(n):
        policy.observe_step(kind, decoding, pure_decode=True)
        clock.t += period


def measured(**kw) -> tuple[MeasuredPolicy, Clock]:
    clock = Clock()
    return MeasuredPolicy(clock=clock, **kw), clock


def test_speculates_first_then_measures_plain_then_picks_the_faster():
    p, clock = measured()
    assert p.speculate(1, 1)                                  # nothing known: speculation first
    run_steps(p, clock, SPEC, 2.0, 3)
    p.observe_acceptance(6, 2)                             # 2 sequences, 3 tokens each
    assert p.period[(SPEC, 1)] == 2.0 and not p.speculate(1, 1)   # plain not yet measured: plain next
    run_steps(p, clock, PLAIN, 1.0, 3)
    p.observe_step(SPEC, 1, True)                          # closes the last plain step's period
    assert p.period[(PLAIN, 1)] == 1.0
    assert p.choice(1) == SPEC                             # 3 tokens / 2 s > 1 token / 1 s
    p.acceptance = 1.5
    assert p.choice(1) == PLAIN                            # 1.5 / 2 < 1 / 1


def test_only_steady_pure_decode_steps_are_timed():
    """The first step after a switch (the eager speculative step that drafts anew), steps with a prefill chunk and
    a change of bucket leave the estimates alone."""
    p, clock = measured()
    p.observe_step(PLAIN, 1, True)
    clock.t += 1.0
    p.observe_step(SPEC, 1, True)                          # first of its run: its 10 s are not a sample
    clock.t += 10.0
    p.observe_step(SPEC, 1, True)
    clock.t += 2.0
    p.observe_step(SPEC, 1, True)
    assert p.period == {(SPEC, 1): 2.0}
    p.observe_step(SPEC, 1, False)                         # a prefill chunk rides in this one
    clock.t += 50.0
    p.observe_step(SPEC, 1, True)
    clock.t += 50.0
    p.observe_step(SPEC, 16, True)                         # another bucket: the previous step is not its sample
    assert p.period == {(SPEC, 1): 2.0}
    run_steps(p, clock, SPEC, 4.0, 3, decoding=16)
    assert p.period[(SPEC, 1)] == 2.0 and p.period[(SPEC, 16)] == 4.0


def test_buckets_group_batches_and_explorations_refresh_the_other_kind():
    p, clock = measured(explore_every=10, explore_steps=3)
    run_steps(p, clock, SPEC, 1.0, 3, decoding=3)          # 3 and 4 decoding requests share bucket 4
    run_steps(p, clock, PLAIN, 2.0, 3, decoding=4)
    p.observe_step(SPEC, 3, True)
    assert set(p.period) == {(SPEC, 4), (PLAIN, 4)} and p.choice(4) == SPEC   # AL prior 1: 1/1 > 1/2
    kinds = [p.speculate(4, 4) for _ in range(20)]
    assert kinds.count(False) == 4 and kinds[9:12] == [False] * 3 and kinds[19] is False
    assert p.describe()["policy_choice"] == {4: SPEC}


def test_acceptance_is_a_moving_average_over_steps():
    """Per step: the tokens per sequence that verified drafts; a step where none did (every request without
    drafts, after a plain phase) tells nothing."""
    p, _ = measured(weight=0.5)
    p.observe_acceptance(0, 0)
    assert p.acceptance is None
    p.observe_acceptance(16, 4)
    p.observe_acceptance(2, 1)
    assert p.acceptance == 3.0


def test_config_and_factory():
    assert SpecConfig.from_dict({"disable_by_batch_size": "auto"}).disable_by_batch_size == "auto"
    assert isinstance(make_policy("auto"), MeasuredPolicy) and make_policy("auto").limit is None
    bounded = make_policy("auto:3")
    assert isinstance(bounded, MeasuredPolicy) and bounded.limit == 3
    assert SpecConfig.from_dict({"disable_by_batch_size": "auto:3"}).disable_by_batch_size == "auto:3"
    fixed = make_policy(2)
    assert isinstance(fixed, FixedThreshold) and fixed.speculate(9, 2) and not fixed.speculate(1, 3)
    assert make_policy(None).speculate(10_000, 10_000)
    for bad in ("fast", "auto:", "auto:0", "auto:-1", "auto:2.5", "auto2", 0, True):
        with pytest.raises(ValueError, match="disable_by_batch_size.*'auto:N'"):
            SpecConfig.from_dict({"disable_by_batch_size": bad})


def test_bounded_measured_policy_is_plain_above_its_limit_and_measured_within():
    """"auto:N": above N requests in the engine every step is plain, whatever the estimates (the fixed threshold's
    rule), and those plain steps still feed the plain estimate; within it the measured choice decides, so a model
    whose speculative step loses even at one sequence runs plain there."""
    p, clock = measured(limit=2)
    assert not p.speculate(1, 3) and not p.speculate(0, 3)    # over the limit: plain, prefill-only steps too
    assert p.speculate(1, 2)                                 # within it, nothing measured yet: speculation first
    run_steps(p, clock, SPEC, 3.0, 3)
    p.observe_acceptance(5, 2)                               # AL 2.5
    run_steps(p, clock, PLAIN, 1.0, 3)
    p.observe_step(PLAIN, 1, True)
    assert p.choice(1) == PLAIN and not p.speculate(1, 1)    # 2.5 tokens / 3 s < 1 token / 1 s
    p.period[(SPEC, 1)] = 2.0                                # now 2.5 / 2 > 1 / 1
    assert p.speculate(1, 1) and not p.speculate(1, 5)       # ... but never above the limit
    assert p.describe()["policy_limit"] == 2 and make_policy("auto").describe()["policy_limit"] is None


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_switches_by_measurement_and_stays_exact(model, overlap):
    """A clock on which speculative steps look slow (each speculative step start moves it 5 s, a plain one 1 s):
    after speculating first, the engine measures both kinds, settles on plain steps and explores speculation now
    and then; outputs equal plain greedy decoding and every page comes back."""
    ps = prompts(2, 20, 40, seed=23)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 2
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3, corrupt_every=3, spec={"disable_by_batch_size": "auto"})
    if overlap:
        eng.runner.graphs = FakeGraphs(eng)
    policy = eng.speculation.policy
    clock = Clock()
    policy.clock, policy.explore_every, policy.explore_steps = clock, 8, 3
    observe = policy.observe_step

    def timed(kind, decoding, pure):
        clock.t += 5.0 if kind == SPEC else 1.0
        observe(kind, decoding, pure)
    policy.observe_step = timed
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    while eng.has_work():
        eng.step()
    assert [list(r.output_token_ids) for r in reqs] == ref
    st = eng.stats()["spec_decode"]
    assert st["policy_plain_steps"] > st["policy_spec_steps"] > 0
    assert st["policy_choice"] and set(st["policy_choice"].values()) == {PLAIN}
    assert 1.0 < st["policy_acceptance"] <= 4.0            # the cheating drafter's drafts are mostly accepted
    assert eng.blocks.num_free_slots() == eng.kv.num_slots
