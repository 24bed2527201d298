"""The engine loop: one dedicated thread owns the (synchronous, single-threaded) LLMEngine.

The asyncio side never touches the engine. It sends commands through a thread-safe FIFO (submit, abort, call)
and receives each request's new tokens as Delta events, posted into the request's asyncio.Queue with
loop.call_soon_threadsafe (one callback per engine step for all requests of that event loop). Between two
steps the thread drains every pending command, so an abort frees the request's KV pages before the next step;
when the engine is idle the thread blocks on the command queue instead of spinning. Nothing HTTP-side (parsing,
tokenizing, JSON, socket writes) runs on this thread, so it never delays a decode step.

Engine death: when the engine reports a fault (engine.fault(): a tensor-parallel worker exited, a step failed
in the group) the loop marks itself dead (`dead`: a client-facing reason without pids; the log keeps the
detail), ends every job in flight with a 503 Delta, answers every later command with EngineFailed and ends
the thread; on_dead() is called once, from the engine thread, so the server can stop admitting and exit.

Shutdown: drain() makes the loop refuse new jobs (ShuttingDown) and, between two steps, end every job in flight
with a 503 Delta and free its pages; stop() then ends the thread.

n / best_of: each prompt of a job is ONE engine request; the engine runs its candidates as a RequestGroup sharing
the prompt's KV pages (m3serve.engine.groups). With best_of == n candidate i is choice prompt * n + i and streams
as it goes; with best_of > n the n best (cumulative logprob) are delivered once every candidate finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from m3serve.engine.engine import LLMEngine
from m3serve.engine.groups import returned_members
from m3serve.engine.request import Request
from m3serve.engine.sampling_params import SamplingParams
from m3serve.server.metrics import ServerMetrics

log = logging.getLogger("m3serve.server")

Submission = tuple[list[int], "str | None", SamplingParams]     # one prompt: ids, text, params (with n / best_of)


@dataclass
class Delta:
    """New output of one choice since its previous Delta."""
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None           # stop | length | abort; None while running
    stop_reason: str | int | None = None
    final_text: str | None = None              # the engine's text when a stop string cut it
    prompt_logprobs: list[dict[int, float] | None] | None = None   # on the prompt's rank-0 finishing Delta
    error: str | None = None                   # the server failed this request (a 5xx, not a client mistake)
    error_status: int = 500                    # 500: the engine failed; 503: the server is shutting down
    error_code: str = "engine_error"


SHUTTING_DOWN = "the server is shutting down"
ENGINE_DEAD_CODE = "engine_dead"


def public_reason(detail: str) -> str:
    """The client-facing text of an engine fault: what failed, never a pid, path or traceback."""
    m = re.search(r"\brank (\d+)", detail)
    what = f"tensor-parallel worker rank {m.group(1)} failed" if m else "the engine failed"
    return (f"the inference engine is down ({what}); this server accepts no more requests and exits so that "
            "its supervisor can restart it")


# CUDA errors after which the context is unusable (every later launch fails with them too), and how many engine
# steps in a row may fail before the engine counts as down: a step that raises fails only the requests in flight
# (one bad request must not stop a server), but a failure that repeats on fresh requests is the engine's, not
# theirs (e.g. the engine thread cannot create its cuBLAS handle on a card the KV cache filled), and a server that
# reports healthy while failing every request is what a supervisor cannot see.
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                      "illegal instruction", "device-side assert", "uncorrectable ECC error")
MAX_FAILED_STEPS_IN_A_ROW = 3


def fatal_step_error(error: BaseException, failed_in_a_row: int) -> str | None:
    """Why a failed engine step takes the engine down (None: fail the requests in flight and go on)."""
    text = f"{type(error).__name__}: {error}"
    if any(s in str(error) for s in STICKY_CUDA_ERRORS):
        return f"a CUDA error that leaves the device context unusable ({text})"
    if failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
        return f"{failed_in_a_row} engine steps in a row failed (the last: {text})"
    return None


class EngineDead(RuntimeError):
    """The engine loop thread is not running."""


class EngineFailed(EngineDead):
    """The engine can run no more steps (its tensor-parallel group is down): only a restart helps."""


class ShuttingDown(EngineDead):
    """The engine loop is draining for a shutdown: it admits nothing new."""


class Job:
    """One HTTP request: one engine request (group) per prompt, and the queue its Deltas arrive in."""

    def __init__(self, prompts: list[Submission], arrival: float, loop: asyncio.AbstractEventLoop):
        self.prompts = prompts
        self.arrival = arrival
        self.loop = loop
        # Deltas not yet taken by next(), and the future next() waits on while there are none: lighter than an
        # asyncio.Queue (no per-item getter bookkeeping) for the one reader a job has. Event-loop side only.
        self._pending: list[Delta] = []
        self._waiter: asyncio.Future | None = None
        self.submitted: concurrent.futures.Future = concurrent.futures.Future()
        self.num_choices = sum(p.n for _, _, p in prompts)
        self.remaining = self.num_choices      # event-loop side: choices not yet seen finished
        self.tracks: list[_Track] = []         # engine-thread side, one per prompt

    async def next(self) -> list[Delta]:
        """Wait for at least one Delta, then take every Delta already queued (batches a slow reader's backlog)."""
        while not self._pending:
            waiter = self._waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        out, self._pending = self._pending, []
        for d in out:
            if d.finish_reason is not None:
                self.remaining -= 1
        return out

    def put(self, d: Delta) -> None:
        """Queue a Delta for next() (event-loop thread: the engine thread hands Deltas over with
        loop.call_soon_threadsafe)."""
        self._pending.append(d)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


@dataclass(eq=False)
class _Track:
    """Engine-thread view of one prompt of a job: its engine request group and what was sent of each member."""
    job: Job
    base: int                       # choice index of the prompt's first returned output
    params: SamplingParams          # the user's (n, best_of, logprobs visibility)
    members: list[Request]          # member 0 leads; a single request when n = best_of = 1
    sent: list[int]                 # tokens delivered (or, ranked, observed) per member
    last_time: list[float | None]
    finished: int = 0
    # best_of > n: which members become choices is known only when all of them finished (read per token)
    ranked: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ranked = self.params.best_of is not None and self.params.best_of > self.params.n

    @property
    def leader(self) -> Request:
        return self.members[0]

    @property
    def done(self) -> bool:
        return self.finished == len(self.members)


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, idle_poll_s: float = 0.25,
                 on_dead: Callable[[str], None] | None = None):
        self.engine = engine
        self.on_dead = on_dead
        self.dead: str | None = None           # set once the engine faulted: the client-facing reason
        self.metrics = metrics or ServerMetrics()
        self.idle_poll_s = idle_poll_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._by_req: dict[int, tuple[_Track, int]] = {}     # live member request id -> (its track, member index)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        # A job with more candidates than the waiting queue holds can never be admitted (a 400, not a 429).
        self.max_queue: int | None = getattr(getattr(engine, "config", None), "max_queue", None)
        self.steps = 0
        self.failed_steps_in_a_row = 0
        self.snapshot: dict[str, Any] = {"alive": 0}

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop.start: already started")
        self._publish(alive=1)
        self._thread = threading.Thread(target=self._run, name="m3serve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        if self._thread is None:
            return
        self._cmds.put(("stop",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, message: str = SHUTTING_DOWN) -> None:
        """Shutdown, step 1 (thread-safe, returns at once): refuse new jobs with ShuttingDown, and end every
        job in flight with a 503 Delta (error=message) before the next engine step, freeing its pages."""
        self._draining = True
        self._cmds.put(("drain", message))

    def abort(self, job: Job) -> None:
        """Cancel the job's unfinished choices (thread-safe, returns at once; a no-op for a finished job)."""
        if job.remaining > 0:
            self._cmds.put(("abort", job))

    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout: float | None = 30.0) -> Any:
        """Run fn(engine) on the engine thread between two steps and return its result (blocking)."""
        return self._call(fn).result(timeout)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self._call(fn))

    def _call(self, fn) -> concurrent.futures.Future:
        if self.dead is not None:
            raise EngineFailed(self.dead)
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    # ------------------------------------------------------------------ event-loop side
    async def submit(self, prompts: list[Submission], arrival: float) -> Job:
        """Queue every prompt's request group at once (all or none). Raises what engine.add_request raised:
        ValueError (bad request), OverflowError (queue full); EngineDead when the loop is not running."""
        if self.dead is not None:
            raise EngineFailed(self.dead)
        if self._draining:
            raise ShuttingDown(SHUTTING_DOWN)
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        job = Job(prompts, arrival, asyncio.get_running_loop())
        self._cmds.put(("submit", job))
        try:
            await asyncio.wrap_future(job.submitted)
        except asyncio.CancelledError:     # the client left before the engine took the request
            self.abort(job)
            raise
        return job

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain(block=not self.engine.has_work())
                if self._stopping:
                    break
                if self.engine.has_work():
                    self._step()
                fault = self.dead or self.engine.fault()
                if fault is not None:
                    self._die(fault)
                    break
                self._publish(alive=1)
        except BaseException:
            log.exception("engine loop crashed")
            raise
        finally:
            self._stopping = True
            self._fail_all(SHUTTING_DOWN, status=503, code="server_shutting_down")
            try:
                self._publish(alive=0)
            except Exception:        # a dead engine's stats may fail too: the gauge must still read 0
                self.snapshot = {**self.snapshot, "alive": 0}
            self._reject_pending()

    def _mark_dead(self, detail: str) -> None:
        if self.dead is None:
            self.snapshot = {**self.snapshot, "alive": 0}     # before `dead`: whoever sees it dead sees the gauge
            self.dead = public_reason(detail)
            log.error("engine dead: %s", detail)

    def _die(self, detail: str) -> None:
        """The engine faulted: one log line with the detail, 503 to everything in flight and everything later."""
        self._mark_dead(detail)
        self._fail_all(self.dead, status=503, code=ENGINE_DEAD_CODE)
        self._stopping = True
        if self.on_dead is not None:
            try:
                self.on_dead(self.dead)
            except Exception:
                log.exception("on_dead callback failed")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=self.idle_poll_s) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            if self._stopping:
                return
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "submit":
            self._submit(cmd[1])
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:
                    fut.set_exception(e)
        elif kind == "drain":
            self._draining = True
            self._fail_all(cmd[1], status=503, code="server_shutting_down")
        elif kind == "stop":
            self._stopping = True

    def _submit(self, job: Job) -> None:
        if not job.submitted.set_running_or_notify_cancel():
            return                                          # cancelled while queued: never admitted
        if self._draining:
            job.submitted.set_exception(ShuttingDown(SHUTTING_DOWN))
            return
        leaders: list[Request] = []
        try:
            for ids, text, params in job.prompts:
                leaders.append(self.engine.add_request(ids, params, text))
        except BaseException as e:
            for r in leaders:
                self.engine.abort(r.request_id)             # a leader's id aborts its whole group
            job.submitted.set_exception(e)
            return
        base = 0
        for (_, _, params), leader in zip(job.prompts, leaders):
            members = list(leader.group.members) if leader.group is not None else [leader]
            track = _Track(job, base, params, members, [0] * len(members), [None] * len(members))
            job.tracks.append(track)
            for m, r in enumerate(members):
                self._by_req[r.request_id] = (track, m)
            base += params.n
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in leaders))
        job.submitted.set_result(None)

    def _abort(self, job: Job) -> None:
        for track in job.tracks:
            live = [r for r in track.members if self._by_req.pop(r.request_id, None) is not None]
            if live:
                # The leader stays registered in the engine until its whole group is done, so its id reaches
                # every unfinished candidate (and frees their pages now).
                self.engine.abort(track.leader.request_id)
                self.metrics.finished.inc(len(live), "abort")

    def _step(self) -> None:
        try:
            reqs = self.engine.step()
        except Exception as e:
            fault = self.engine.fault()
            if fault is not None:          # the group is down: no traceback per request, one log line
                self._mark_dead(fault)
                self._fail_all(self.dead, status=503, code=ENGINE_DEAD_CODE)
                return
            self.failed_steps_in_a_row += 1
            log.exception("engine step failed; failing the requests in flight")
            fatal = fatal_step_error(e, self.failed_steps_in_a_row)
            if fatal is not None:          # the loop's _die follows: 503 from here on, then the exit
                self._mark_dead(fatal)
                self._fail_all(self.dead, status=503, code=ENGINE_DEAD_CODE)
                return
            # The detail (which may name processes or paths) stays in the log.
            self._fail_all(f"internal engine error ({type(e).__name__}); the server log has the details")
            return
        self.failed_steps_in_a_row = 0
        self.steps += 1
        now = time.monotonic()
        out: list[tuple[Job, Delta]] = []
        by_req, met = self._by_req, self.metrics
        generated = 0
        gaps: list[float] = []       # this step's inter-token gaps, observed at once after the loop
        for r in reqs:
            entry = by_req.get(r.request_id)
            if entry is None:
                continue
            track, m = entry
            start = track.sent[m]
            new = r.output_token_ids[start:]
            n = len(new)
            if n:
                track.sent[m] = start + n
                generated += n
                last = track.last_time[m]
                if last is None:
                    met.ttft.observe(now - track.job.arrival)   # tokens that came with the first have no gap
                elif n == 1:
                    gaps.append(now - last)
                else:
                    gaps += [(now - last) / n] * n   # k tokens in one step (speculation): k gaps of dt/k
                track.last_time[m] = now
            delta = None
            if not track.ranked:
                delta = Delta(track.base + m, new,
                              r.output_logprobs[start:] if track.params.logprobs is not None else None)
            if r.is_finished:
                del self._by_req[r.request_id]
                track.finished += 1
                self.metrics.finished.inc(1, r.finish_reason)
                self.metrics.e2e.observe(now - track.job.arrival)
                if delta is not None:
                    _finish(delta, r, track.leader if m == 0 else None)
                elif track.done:
                    out += [(track.job, ranked) for ranked in _ranked_deltas(track)]
                if track.done:
                    for member in track.members:
                        self.engine.release(member)
            if delta is not None:
                out.append((track.job, delta))
        if generated:
            met.generation_tokens.inc(generated)
            met.itl.observe_many(gaps)
        self._deliver(out)

    def _deliver(self, items: list[tuple[Job, Delta]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Delta]]] = {}
        for job, d in items:
            by_loop.setdefault(job.loop, []).append((job, d))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:     # that event loop is closed: nobody is listening any more
                for job, _ in batch:
                    self._abort(job)

    def _fail_all(self, message: str, finish_reason: str = "abort", status: int = 500,
                  code: str = "engine_error") -> None:
        items = []
        tracks = list({id(t): t for t, _ in self._by_req.values()}.values())
        for track in tracks:
            try:
                self.engine.abort(track.leader.request_id)
            except Exception:
                log.exception("abort of request %d failed", track.leader.request_id)
            live = sum(self._by_req.pop(r.request_id, None) is not None for r in track.members)
            # Every choice of the prompt still open gets the error (the handler answers at the first one).
            items += [(track.job, Delta(track.base + i, [], None, finish_reason=finish_reason, error=message,
                                        error_status=status, error_code=code))
                      for i in range(min(live, track.params.n))]
            self.metrics.finished.inc(live, "abort")
        self._by_req.clear()
        self._deliver(items)

    def _reject_pending(self) -> None:
        """Commands that arrived after the stop: answer them so no caller waits forever."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            fut = cmd[1].submitted if cmd[0] == "submit" else cmd[2] if cmd[0] == "call" else None
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineFailed(self.dead) if self.dead is not None else ShuttingDown(SHUTTING_DOWN))

    def _publish(self, alive: int) -> None:
        s = dict(self.engine.stats())
        spec = s.pop("spec_decode", None)
        if spec:   # speculative engine: flat numbers for /metrics (m3serve_spec_*)
            s.update({f"spec_{k}": v for k, v in spec.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)})
            s["acceptance_length"] = spec.get("acceptance_length", 0.0)
        sched = self.engine.scheduler
        s.update(alive=alive, steps=self.steps, active_requests=len(self._by_req),
                 kv_pages_cached=self.engine.blocks.num_cached_pages(),
                 prefix_cache_queries=getattr(sched, "prefix_cache_queries", 0),
                 prefix_cache_hits=getattr(sched, "prefix_cache_hits", 0))
        self.snapshot = s


def _finish(d: Delta, r: Request, leader: Request | None) -> None:
    """Fill a finishing Delta from its finished request; `leader`: the prompt's leader when d is rank 0."""
    d.finish_reason, d.stop_reason = r.finish_reason, r.stop_reason
    if r.finish_reason == "stop" and isinstance(r.stop_reason, str):
        d.final_text = r.text
    if leader is not None and leader.prompt_logprobs is not None:
        d.prompt_logprobs = list(leader.prompt_logprobs)


def _ranked_deltas(track: _Track) -> list[Delta]:
    """best_of > n, every candidate finished: the n best as whole Deltas, best first."""
    out = []
    for rank, r in enumerate(returned_members(track.leader.group)):
        lps = list(r.output_logprobs) if track.params.logprobs is not None else None
        d = Delta(track.base + rank, list(r.output_token_ids), lps)
        _finish(d, r, track.leader if rank == 0 else None)
        out.append(d)
    return out


def _put_all(batch: list[tuple[Job, Delta]]) -> None:
    for job, d in batch:
        job.put(d)
