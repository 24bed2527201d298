"""SIGINT / SIGTERM for `m3serve serve`: the first starts a graceful shutdown, the second exits at once.

Graceful (app.graceful_stop): stop admitting (new requests get 503), end every request in flight within the
grace period (a stream gets an error event and [DONE], a non-streamed request a JSON 503), close the listener,
stop the engine loop, exit 0. A second signal while that runs means the operator will not wait: the process
exits immediately with status 128 + signal number, as if the signal had killed it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Callable

log = logging.getLogger("m3serve.server")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _exit_now(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:           # a closed or broken stream must not keep the process alive
            pass
    os._exit(status)


class ShutdownSignals:
    """Counts SIGINT/SIGTERM on an asyncio loop: the first calls on_first(), the second exit_now(128 + signum)."""

    def __init__(self, on_first: Callable[[], None], exit_now: Callable[[int], None] = _exit_now):
        self.on_first = on_first
        self.exit_now = exit_now
        self.received: list[int] = []

    def install(self, loop: asyncio.AbstractEventLoop) -> bool:
        """False where the loop cannot take signal handlers (not the main thread, or no signal support)."""
        try:
            for sig in SIGNALS:
                loop.add_signal_handler(sig, self.handle, sig)
        except (NotImplementedError, RuntimeError, ValueError):
            return False
        return True

    def handle(self, signum: int) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1:
            log.warning("%s: shutting down gracefully (ending the requests in flight); send it again to exit at "
                        "once", name)
            self.on_first()
        else:
            log.warning("%s again: exiting now", name)
            self.exit_now(128 + signum)
