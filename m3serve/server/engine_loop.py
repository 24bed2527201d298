"""The engine loop: one dedicated thread owns the (synchronous, single-threaded) LLMEngine.

The asyncio side never touches the engine. It sends commands through a thread-safe FIFO (submit, abort, call)
and receives each request's new tokens as Delta events, posted into the request's asyncio.Queue with
loop.call_soon_threadsafe (one callback per engine step for all requests of that event loop). Between two
steps the thread drains every pending command, so an abort frees the request's KV pages before the next step;
when the engine is idle the thread blocks on the command queue instead of spinning. Nothing HTTP-side (parsing,
tokenizing, JSON, socket writes) runs on this thread, so it never delays a decode step.

Shutdown: drain() makes the loop refuse new jobs (ShuttingDown) and, between two steps, end every job in flight
with a 503 Delta and free its pages; stop() then ends the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from m3serve.engine.engine import LLMEngine
from m3serve.engine.request import Request
from m3serve.engine.sampling_params import SamplingParams
from m3serve.server.metrics import ServerMetrics

log = logging.getLogger("m3serve.server")

Choice = tuple[list[int], "str | None", SamplingParams]


@dataclass
class Delta:
    """New output of one choice since its previous Delta."""
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None           # stop | length | abort; None while running
    stop_reason: str | int | None = None
    final_text: str | None = None              # the engine's text when a stop string cut it
    error: str | None = None                   # the server failed this request (a 5xx, not a client mistake)
    error_status: int = 500                    # 500: the engine failed; 503: the server is shutting down
    error_code: str = "engine_error"


SHUTTING_DOWN = "the server is shutting down"


class EngineDead(RuntimeError):
    """The engine loop thread is not running."""


class ShuttingDown(EngineDead):
    """The engine loop is draining for a shutdown: it admits nothing new."""


class Job:
    """One HTTP request: its choices (each one engine request) and the queue its Deltas arrive in."""

    def __init__(self, choices: list[Choice], arrival: float, loop: asyncio.AbstractEventLoop):
        self.choices = choices
        self.arrival = arrival
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.submitted: concurrent.futures.Future = concurrent.futures.Future()
        self.remaining = len(choices)          # event-loop side: choices not yet seen finished
        # engine-thread side
        self.reqs: list[Request] = []
        self.sent: list[int] = []
        self.last_time: list[float | None] = []

    async def next(self) -> list[Delta]:
        """Wait for at least one Delta, then take every Delta already queued (batches a slow reader's backlog)."""
        out = [await self.queue.get()]
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        self.remaining -= sum(d.finish_reason is not None for d in out)
        return out


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, idle_poll_s: float = 0.25):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.idle_poll_s = idle_poll_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._by_req: dict[int, tuple[Job, int]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        # A job with more choices than the waiting queue holds can never be admitted (a 400, not a 429).
        self.max_queue: int | None = getattr(getattr(engine, "config", None), "max_queue", None)
        self.steps = 0
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
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    # ------------------------------------------------------------------ event-loop side
    async def submit(self, choices: list[Choice], arrival: float) -> Job:
        """Queue all choices at once (all or none). Raises what engine.add_request raised: ValueError (bad
        request), OverflowError (queue full); EngineDead when the loop is not running."""
        if self._draining:
            raise ShuttingDown(SHUTTING_DOWN)
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        job = Job(choices, arrival, asyncio.get_running_loop())
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
                self._publish(alive=1)
        except BaseException:
            log.exception("engine loop crashed")
            raise
        finally:
            self._stopping = True
            self._fail_all(SHUTTING_DOWN, status=503, code="server_shutting_down")
            self._publish(alive=0)
            self._reject_pending()

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
        reqs: list[Request] = []
        try:
            for ids, text, params in job.choices:
                reqs.append(self.engine.add_request(ids, params, text))
        except BaseException as e:
            for r in reqs:
                self.engine.abort(r.request_id)
            job.submitted.set_exception(e)
            return
        n = len(reqs)
        job.reqs, job.sent, job.last_time = reqs, [0] * n, [None] * n
        for i, r in enumerate(reqs):
            self._by_req[r.request_id] = (job, i)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in reqs))
        job.submitted.set_result(None)

    def _abort(self, job: Job) -> None:
        for r in job.reqs:
            if self._by_req.pop(r.request_id, None) is not None:
                self.engine.abort(r.request_id)             # frees its pages now
                self.metrics.finished.inc(1, "abort")

    def _step(self) -> None:
        try:
            reqs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(f"internal engine error: {type(e).__name__}: {e}")
            return
        self.steps += 1
        now = time.monotonic()
        out: list[tuple[Job, Delta]] = []
        for r in reqs:
            entry = self._by_req.get(r.request_id)
            if entry is None:
                continue
            job, i = entry
            new = r.output_token_ids[job.sent[i]:]
            lps = r.output_logprobs[job.sent[i]:] if r.params.logprobs is not None else None
            job.sent[i] += len(new)
            if new:
                self._observe(job, i, len(new), now)
            d = Delta(i, new, lps)
            if r.is_finished:
                d.finish_reason, d.stop_reason = r.finish_reason, r.stop_reason
                if r.finish_reason == "stop" and isinstance(r.stop_reason, str):
                    d.final_text = r.text
                del self._by_req[r.request_id]
                self.engine.release(r)
                self.metrics.finished.inc(1, r.finish_reason)
                self.metrics.e2e.observe(now - job.arrival)
            out.append((job, d))
        self._deliver(out)

    def _observe(self, job: Job, i: int, n: int, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc(n)
        last = job.last_time[i]
        if last is None:
            m.ttft.observe(now - job.arrival)
            n -= 1                   # tokens that came with the first one have no gap of their own
        elif n:
            m.itl.observe((now - last) / n, n)    # k tokens in one step (speculation): k gaps of dt/k
        job.last_time[i] = now

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
        for rid, (job, i) in list(self._by_req.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of request %d failed", rid)
            items.append((job, Delta(i, [], None, finish_reason=finish_reason, error=message, error_status=status,
                                     error_code=code)))
            self.metrics.finished.inc(1, "abort")
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
                fut.set_exception(ShuttingDown(SHUTTING_DOWN))

    def _publish(self, alive: int) -> None:
        s = dict(self.engine.stats())
        spec = s.pop("spec_decode", None)
        if spec:   # speculative engine: flat numbers for /metrics (m3serve_spec_*)
            s.update({f"spec_{k}": v for k, v in spec.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)})
            s["acceptance_length"] = spec.get("acceptance_length", 0.0)
        s.update(alive=alive, steps=self.steps, active_requests=len(self._by_req),
                 kv_pages_cached=self.engine.blocks.num_cached_pages())
        self.snapshot = s


def _put_all(batch: list[tuple[Job, Delta]]) -> None:
    for job, d in batch:
        job.queue.put_nowait(d)
