"""When a step speculates: speculative_config.disable_by_batch_size as a fixed threshold, or "auto", measured.

The fixed threshold counts the requests in the engine (running + waiting: vLLM's "enqueued requests"), not the
decoding rows of the step. Under a served load of C users that number stays at about C while each user's requests
come and go, so the engine speculates at every step or at none; counted per step, every arrival made a step of
fewer decoding rows that speculated (an eager split step with the drafter's pass over the prompt, ~6 ms beside 16
streams on the H200 where the plain prefill graph takes ~1.5 ms) and switched the kinds back and forth
(bench/results/serve/serve-pareto-defaults-h200.json: 0.62-0.98x plain per user from 4 users up). A prompt that
a plain step prefills gets no draft-layer KV; if its request speculates later (the load fell), its drafts read
stale draft KV for those positions, which only lowers acceptance: verification keeps outputs exact.

Per user, a speculative step of batch b emits AL tokens per sequence (the acceptance length, 1 + accepted drafts)
in its step period P_spec(b); a plain step emits 1 in P_plain(b). Speculation pays at b iff

    AL / P_spec(b) > 1 / P_plain(b)          (tokens per second per sequence)

A fixed threshold (`FixedThreshold`, the default 2) assumes that holds up to the threshold and fails beyond it,
which one sweep of one model decided; it is wrong for a model whose verify step costs more than its acceptance
saves even at one sequence (minimax-m3:5 with a forced-acceptance drafter, served on the H200). `MeasuredPolicy`
decides per graph bucket from what the engine has run so far: the period of each kind of pure decode step
(wall time from one step's start to the next's, so host work, the overlap loop and the eager step that follows a
switch are all in it) and AL, each an exponential moving average. A bucket with no period of a kind yet runs that
kind first (speculation first); once both are known it runs the faster kind, and every `explore_every` steps at a
bucket it runs `explore_steps` of the other kind, so both estimates follow the workload (acceptance moves with the
prompts, the step periods with the contexts).

Measured (H200, embedded model, `bench/serve_pareto.py ... embedded:spec-auto`): opt-in, experimental. It beats the
fixed threshold at one user (1.33x plain per user) and loses to it from 4 users up, because it times steady decode
steps only: the prefill steps that arrivals add (an eager step per arrival, dearer when it speculates) are outside
both estimates.

"auto:N" joins the two: the fixed threshold's bound on the load (above N requests every step is plain, where the
arrivals' prefill steps decided the served sweeps) and the measured choice below it, which the fixed rule lacks
where speculation loses even at one sequence: minimax-m3:5 NVFP4 served at one user with a forced acceptance of
2.78 ran 0.91x plain (bench/results/serve/serve-pareto-m3_5-memory-plan-h200.json), because each of its K = 3 draft
passes reads the target's 2.46 GB LM head (the published drafters share it), so a speculative step cost about 3x a
plain one. Measured served on the H100 (bench/results/serve/serve-pareto-m3_5-policy-auto2-h100.json, minimax-m3:5
NVFP4, forced acceptance 2.78, two interleaved repeats, tokens per second per user at P90 TPOT): at one user 567.5 /
567.9 against plain's 586.5 / 586.8 (0.97x; the fixed threshold 491.6 / 491.6, 0.84x), within noise of both from 4
to 64 users, and at 128 users 92.5 / 94.1 against plain's 106.2 / 100.8 (the fixed threshold 93.6 / 89.1). The
default stays the fixed threshold: the measured choice depends on wall-clock step periods, so which kind a step
runs is not reproducible run to run (outputs are: verification is exact), and the one-user gap it closes is
minimax-m3:5's alone so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from m3serve.engine.spec_config import policy_form
from m3serve.runtime.step_inputs import DEFAULT_BUCKETS, bucket_for

SPEC, PLAIN = "spec", "plain"


@dataclass
class FixedThreshold:
    """Speculate while at most `limit` requests are in the engine (None: always)."""
    limit: int | None

    def speculate(self, decoding: int, load: int) -> bool:
        """decoding: the step's decoding rows (unused here); load: requests running or waiting."""
        return self.limit is None or load <= self.limit

    def observe_step(self, kind: str, decoding: int, pure_decode: bool) -> None:
        """Fixed: nothing to learn."""

    def observe_acceptance(self, emitted: int, sequences: int) -> None:
        """Fixed: nothing to learn."""

    def describe(self) -> dict:
        return {}


@dataclass
class MeasuredPolicy:
    """The measured choice per bucket (see the module docstring). `clock`: seconds, monotonic (tests pass a fake)."""
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    weight: float = 0.1                  # EMA weight of a new sample
    explore_every: int = 256             # steps at a bucket between two explorations of the other kind
    explore_steps: int = 5               # consecutive steps of an exploration (3 samples: the first pays the
                                         # switch, the last's period ends in the other kind)
    prior_acceptance: float = 1.0        # AL before any speculative step has been read back
    limit: int | None = None             # above this many requests in the engine every step is plain ("auto:N")
    clock: Callable[[], float] = time.perf_counter
    period: dict = field(default_factory=dict)          # (kind, bucket) -> EMA seconds per step
    acceptance: float | None = None                     # EMA tokens per sequence per speculative step
    _last: tuple | None = None                          # ((kind, bucket), start time, index in its run) of the
                                                        # previous pure decode step
    _count: dict = field(default_factory=dict)          # bucket -> steps run there
    _exploring: dict = field(default_factory=dict)      # bucket -> steps of exploration left

    def _bucket(self, decoding: int) -> int:
        return bucket_for(decoding, self.buckets) or self.buckets[-1]

    def choice(self, bucket: int) -> str:
        """The faster kind at `bucket` by the estimates (speculation while a kind has none)."""
        spec, plain = self.period.get((SPEC, bucket)), self.period.get((PLAIN, bucket))
        if spec is None:
            return SPEC
        if plain is None:
            return PLAIN
        al = self.acceptance if self.acceptance is not None else self.prior_acceptance
        return SPEC if al / spec > 1.0 / plain else PLAIN

    def speculate(self, decoding: int, load: int) -> bool:
        """Per bucket of the step's decoding rows, while the load (requests running or waiting) is within `limit`;
        a step of prefill chunks only speculates there (its drafter pass is what the next speculative step
        needs)."""
        if self.limit is not None and load > self.limit:
            return False
        if decoding == 0:
            return True
        b = self._bucket(decoding)
        best = self.choice(b)
        n = self._count[b] = self._count.get(b, 0) + 1
        left = self._exploring.get(b, 0)
        if left == 0 and n % self.explore_every == 0 and (SPEC, b) in self.period and (PLAIN, b) in self.period:
            left = self.explore_steps
        if left:
            self._exploring[b] = left - 1
            return best != SPEC
        return best == SPEC

    def observe_step(self, kind: str, decoding: int, pure_decode: bool) -> None:
        """A step of `kind` starts now. The time since the previous step's start is that step's period, counted
        when it was a pure decode step (every chunk one decode token) of the same kind and bucket as this one and
        not the first of its run: a prefill chunk, a change of batch or the switch from the other kind (whose first
        speculative step is the eager one that drafts anew) is not that kind's steady-state cost."""
        now = self.clock()
        key = (kind, self._bucket(decoding)) if pure_decode else None
        last = self._last
        same = key is not None and last is not None and last[0] == key
        if same and last[2] >= 1:
            sample = now - last[1]
            old = self.period.get(key)
            self.period[key] = sample if old is None else old + self.weight * (sample - old)
        self._last = (key, now, last[2] + 1 if same else 0) if key is not None else None

    def observe_acceptance(self, emitted: int, sequences: int) -> None:
        """A speculative step read back: `sequences` that verified drafts emitted `emitted` tokens in all (accepted
        drafts + 1 each). A step without such sequences tells nothing."""
        if sequences == 0:
            return
        sample, a = emitted / sequences, self.acceptance
        self.acceptance = sample if a is None else a + self.weight * (sample - a)

    def describe(self) -> dict:
        """For stats(): the estimates behind the choices."""
        return {"policy_limit": self.limit, "policy_acceptance": self.acceptance,
                "policy_choice": {b: self.choice(b) for b in sorted({b for _, b in self.period})},
                "policy_period_ms": {f"{k}@{b}": round(v * 1e3, 4) for (k, b), v in sorted(self.period.items())}}


def make_policy(disable_by_batch_size: int | str | None, buckets: tuple[int, ...] = DEFAULT_BUCKETS):
    """speculative_config.disable_by_batch_size -> its policy: "auto" / "auto:N" measure (the latter up to N
    requests), an int or None is fixed."""
    measured, limit = policy_form(disable_by_batch_size)
    return MeasuredPolicy(buckets=buckets, limit=limit) if measured else FixedThreshold(limit)


__all__ = ["FixedThreshold", "MeasuredPolicy", "PLAIN", "SPEC", "make_policy"]
