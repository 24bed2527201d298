"""Admission batching (Scheduler.admission_wait_s): while requests decode, arrivals wait (up to the window, from
the oldest arrival) and then prefill together; nothing waits when the engine is idle, when the window has
passed, or when no more could join the step. Off by default: every arrival is admitted at once."""

from __future__ import annotations

import pytest

from m3serve.engine.request import Request, Status
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import Scheduler
from m3serve.kv.block_manager import BlockManager


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _sched(wait_s: float, clock, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    blocks = BlockManager(64, 16, max_seqs=max_num_seqs, max_blocks_per_seq=8, enable_prefix_caching=False)
    return Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, admission_wait_s=wait_s,
                     clock=clock)


_ids = iter(range(10_000))


def _req(clock, n: int = 10) -> Request:
    return Request(next(_ids), list(range(1, n + 1)), SamplingParams(max_tokens=50), arrival_time=clock())


def _decoding(s: Scheduler, clock) -> Request:
    """One request admitted and prefilled: the next schedule() is a pure decode step."""
    r = _req(clock)
    s.add(r)
    (c,) = s.schedule()
    r.num_computed += c.num_tokens
    r.output_token_ids.append(7)
    return r


def test_off_admits_at_once():
    clock = Clock()
    s = _sched(0.0, clock)
    _decoding(s, clock)
    s.add(_req(clock))
    assert [c.num_tokens for c in s.schedule()] == [1, 10]


def test_arrivals_wait_for_the_window_then_prefill_together():
    clock = Clock()
    s = _sched(0.010, clock)
    running = _decoding(s, clock)
    a = _req(clock)
    s.add(a)
    chunks = s.schedule()
    assert [c.request for c in chunks] == [running] and a.status is Status.WAITING
    running.num_computed += 1
    running.output_token_ids.append(7)
    clock.t += 0.004
    b = _req(clock)
    s.add(b)
    assert [c.request for c in s.schedule()] == [running]     # a waited 4 ms of 10
    running.num_computed += 1
    running.output_token_ids.append(7)
    clock.t += 0.006                                           # a's window is over: a and b together
    assert [c.request for c in s.schedule()] == [running, a, b]


def test_idle_engine_admits_at_once():
    clock = Clock()
    s = _sched(1.0, clock)
    r = _req(clock)
    s.add(r)
    assert [c.request for c in s.schedule()] == [r]


def test_no_wait_when_no_more_could_join():
    clock = Clock()
    s = _sched(1.0, clock, max_num_seqs=3)
    running = _decoding(s, clock)
    more = [_req(clock), _req(clock)]          # fills the rows: nothing could join them
    for r in more:
        s.add(r)
    assert [c.request for c in s.schedule()] == [running] + more
    clock2 = Clock()
    s2 = _sched(1.0, clock2, budget=20)
    running2 = _decoding(s2, clock2)
    big = _req(clock2, n=19)                   # with the decode token it fills the step's token budget
    s2.add(big)
    assert [c.request for c in s2.schedule()] == [running2, big]


def test_no_wait_beside_a_prefill_chunk():
    clock = Clock()
    s = _sched(1.0, clock, budget=16)
    long = _req(clock, n=40)
    s.add(long)
    (c,) = s.schedule()                        # 16 of its 40 prompt tokens
    long.num_computed += c.num_tokens
    r = _req(clock, n=4)
    s.add(r)
    assert [ch.request for ch in s.schedule()] == [long]   # the budget went to the chunk; r is next in line
    long.num_computed += 16
    assert [ch.num_tokens for ch in s.schedule()] == [8, 4]  # the step is eager anyway: r joins at once


def test_rejects_a_negative_window():
    with pytest.raises(ValueError, match="admission_wait_s"):
        _sched(-1.0, Clock())
