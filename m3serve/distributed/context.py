"""One tensor-parallel group as seen from one rank: process groups, the rendezvous store, liveness.

Two process groups exist on every rank:
  model    NCCL on CUDA (one GPU per rank), gloo on CPU: the model's all-reduces and all-gathers
  control  gloo, host memory: rank 0's per-step broadcast to the followers. Its timeout is effectively
           infinite because a follower legitimately waits there for as long as the server idles; a dead
           peer still ends the wait at once (gloo reports the closed connection).
Handshakes that may take long (model loading) go through the store as keys polled with a liveness check,
so a rank that fails while loading is reported with its traceback instead of leaving the others waiting.

Rank 0 in spawn mode also runs a watchdog thread over its worker processes: a worker that exits marks the
group failed; on CUDA the model group is aborted so a rank-0 NCCL wait ends, and if the main thread is still
stuck inside a step after `grace_s` the process exits with the error printed (a hung NCCL kernel can not
be interrupted otherwise).
"""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from m3serve.model.parallel import TPGroup
from m3serve.runtime.step_inputs import HEADER_LEN, OP_STOP

CONTROL_TIMEOUT = _dt.timedelta(days=365)
POLL_S = 0.05


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank exited or failed; the group is down. The message names the rank and its error."""


@dataclass
class TPContext:
    rank: int
    world_size: int
    device: torch.device
    store: object                              # a torch.distributed Store (prefixed for m3serve's keys)
    control: object                            # gloo ProcessGroup for the step broadcast
    launcher: str                              # "spawn" (rank 0 started the workers) | "torchrun"
    owns_default_group: bool = True
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)   # rank -> worker (spawn mode, rank 0)
    grace_s: float = 60.0
    failure: str | None = None
    in_step: bool = False
    closed: bool = False
    _watchdog: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def tp(self) -> TPGroup:
        return TPGroup(self.rank, self.world_size, dist.group.WORLD)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ failure reporting
    def _worker_error(self, rank: int) -> str:
        key = f"error/{rank}"
        try:
            if self.store.check([key]):
                return "\n" + self.store.get(key).decode(errors="replace").rstrip()
        except Exception:                                  # the store itself may be gone with the rank
            pass
        return ""

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message

    def check(self) -> None:
        """Raise WorkerDiedError when the group is down (a rank died, or an earlier step failed)."""
        if self.closed and self.failure is None:
            raise WorkerDiedError("tensor-parallel group is shut down")
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def fault(self) -> str | None:
        """Why this group can run no more steps (None while it can): a failed step, a worker gone, shut down."""
        if self.failure is not None:
            return self.failure
        dead = self.dead_worker()
        if dead is None and self.closed:
            return "tensor-parallel group is shut down"
        return dead

    def dead_worker(self) -> str | None:
        """A message for the first worker process that has exited (spawn mode), else None."""
        for r, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                return (f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {rc}"
                        f"{self._worker_error(r)}")
        return None

    def failed_rank(self, wait_s: float = 5.0) -> str | None:
        """After a collective failed on rank 0: the message of the rank that caused it. A peer's socket
        closes a moment before its process is reaped, so wait up to wait_s for the exit or its error key."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = self.failure or self.dead_worker()
            if dead is None and not self.procs:                  # torchrun: no processes to watch
                for r in range(1, self.world_size):
                    text = self._worker_error(r)
                    if text:
                        dead = f"tensor-parallel rank {r} failed:{text}"
                        break
            if dead is not None or time.monotonic() > deadline:
                return dead
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ store handshakes
    def wait_followers(self, what: str, timeout_s: float) -> dict[int, bytes]:
        """Rank 0: each follower's `what/<rank>` value; raises WorkerDiedError naming the first rank that
        reported an error, exited, or did not answer within timeout_s."""
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size - 1:
            for r in range(1, self.world_size):
                if r in got:
                    continue
                if self.store.check([f"error/{r}"]):
                    raise WorkerDiedError(f"tensor-parallel rank {r} failed while {what}:"
                                          f"{self._worker_error(r)}")
                if self.store.check([f"{what}/{r}"]):
                    got[r] = self.store.get(f"{what}/{r}")
            dead = self.dead_worker() or self.failure
            if dead and len(got) < self.world_size - 1:
                raise WorkerDiedError(f"{dead} (while waiting for {what})")
            if time.monotonic() > deadline:
                missing = [r for r in range(1, self.world_size) if r not in got]
                raise WorkerDiedError(f"tensor-parallel ranks {missing} did not report {what!r} within "
                                      f"{timeout_s:.0f} s")
            if len(got) < self.world_size - 1:
                time.sleep(POLL_S)
        return got

    def wait_driver(self, key: str, timeout_s: float | None = None) -> bytes:
        """Follower: rank 0's value of `key`; raises when rank 0 aborted, went away or (spawn) our parent died."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.store.check(["abort"]):
                raise WorkerDiedError(f"rank 0 aborted start-up: {self.store.get('abort').decode(errors='replace')}")
            if self.store.check([key]):
                return self.store.get(key)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"rank 0 did not publish {key!r} within {timeout_s:.0f} s")
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ watchdog (rank 0, spawn mode)
    def start_watchdog(self) -> None:
        if not self.procs or self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, name="m3serve-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            dead = self.dead_worker()
            if dead is None or self.closed:
                continue
            self.fail(dead)
            if self.device.type == "cuda":
                abort_model_group()
            t0 = time.monotonic()
            while self.in_step and not self._stop.wait(0.5):
                if time.monotonic() - t0 > self.grace_s:
                    print(f"m3serve: {dead}\nm3serve: rank 0 is stuck in a collective with the dead rank; "
                          "exiting", file=sys.stderr, flush=True)
                    for p in self.procs.values():
                        if p.poll() is None:
                            p.kill()
                    os._exit(70)
            return

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, graceful: bool = True) -> None:
        """Stop the followers (a STOP broadcast when the group is healthy, else kill), then tear down the
        process groups. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        healthy = self.failure is None and not self.in_step and self.dead_worker() is None
        stopped = False
        if self.rank == 0 and graceful and healthy and self.control is not None:
            try:
                stop = torch.zeros(HEADER_LEN, dtype=torch.int64)
                stop[0] = OP_STOP
                dist.broadcast(stop, 0, group=self.control)
                stopped = True
            except Exception:
                healthy = False
        deadline = time.monotonic() + (30.0 if stopped else 0.0)
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()
        if not healthy and self.device.type == "cuda":
            abort_model_group()       # NCCL teardown with a dead or desynchronised peer would otherwise block
        destroy_groups(self)


def abort_model_group() -> None:
    """Abort the default (model) group's communicators (ncclCommAbort) so NCCL work blocked on a dead peer
    returns. Only the group object is aborted: the registry of groups is left to the main thread."""
    try:
        pg = dist.group.WORLD
        if pg is not None and hasattr(pg, "abort"):
            pg.abort()
    except Exception:
        pass


def destroy_groups(ctx: TPContext) -> None:
    try:
        if ctx.control is not None:
            dist.destroy_process_group(ctx.control)
    except Exception:
        pass
    ctx.control = None
    if ctx.owns_default_group and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
