"""Continuous batching: running decodes first (one token each), then prefill chunks under a token budget.
When pages run out the most recently admitted running request is preempted (KV dropped, recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from m3serve.engine.request import Request, Status
from m3serve.kv.block_manager import BlockManager, OutOfPagesError


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int          # tokens computed for it this step

    @property
    def reaches_end(self) -> bool:
        """This chunk computes the request's last known token, so a new token is sampled after it."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_queue: int | None = None, admission_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        if not admission_wait_s >= 0:
            raise ValueError(f"admission_wait_s: expected seconds >= 0, found {admission_wait_s!r}")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue = max_queue
        # Admission batching (0 = off): while requests decode, new arrivals wait up to this long (from the oldest
        # one's arrival) so that several prefill in one step. A step with a prefill chunk leaves the decode graphs
        # for an eager step whose host cost barely depends on how many prompts it carries (docs/architecture.md).
        self.admission_wait_s = admission_wait_s
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Admissions' prompt(+output) tokens looked up in the prefix cache, and those found (vLLM's
        # prefix_cache_queries / prefix_cache_hits, in tokens).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, req: Request) -> None:
        if self.max_queue is not None and len(self.waiting) >= self.max_queue:
            raise OverflowError(f"the waiting queue is full ({self.max_queue} requests)")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        req.allocated = False
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        # 1. decodes and unfinished prefills of running requests, oldest first
        for req in list(self.running):
            # (a request preempted earlier in this loop is WAITING again: a status test, not an O(batch) search)
            if req.status is not Status.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self.blocks.append_slots(req.request_id, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                out = [c for c in out if c.request is not victim]
                if victim is req:
                    break
            else:
                out.append(ScheduledChunk(req, n))
                budget -= n
        # 2. admit waiting requests (FCFS) while rows, pages and budget last
        if self.waiting and self._defer_admission(out, budget):
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            try:
                req.num_computed = self.blocks.allocate(req.request_id, req.all_token_ids)
            except OutOfPagesError:
                break
            req.allocated = True
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += req.num_computed
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed, budget)
            out.append(ScheduledChunk(req, n))
            budget -= n
        return out

    def _defer_admission(self, decodes: list[ScheduledChunk], budget: int) -> bool:
        """Admission batching: hold the waiting requests back this step while every scheduled chunk is one
        decode token, the oldest waiting request arrived less than admission_wait_s ago, and more of them
        would still fit in one step (rows and token budget)."""
        if self.admission_wait_s <= 0 or not decodes or any(c.num_tokens != 1 for c in decodes):
            return False
        if self.clock() - self.waiting[0].arrival_time >= self.admission_wait_s:
            return False
        if len(self.running) + len(self.waiting) >= self.max_num_seqs:
            return False
        waiting_tokens = sum(r.num_tokens - r.num_computed for r in self.waiting)
        return waiting_tokens < budget

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req.allocated:
            self.blocks.free(req.request_id)
            req.allocated = False
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
