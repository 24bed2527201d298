"""Engine death as the server sees it: the 503 every request gets, and when the process leaves.

When the engine loop reports a fault (a tensor-parallel worker died; see engine_loop.py) the server does not
try to rebuild the worker group in place (a group half torn down, weights to reload, KV state lost): it stops
admitting, answers /health and every /v1 request with 503 (code `engine_dead`), and exits with status
EXIT_ENGINE_DEAD once `dead_exit_delay` seconds have passed and the requests in flight have ended, so that a
supervisor (systemd, Kubernetes, a shell loop) starts a fresh one. vLLM's server behaves the same way. The
delay lets load balancers and health probes see the 503 before the port closes.
"""

from __future__ import annotations

import asyncio
import logging

from m3serve.server.engine_loop import ENGINE_DEAD_CODE
from m3serve.server.errors import APIError

log = logging.getLogger("m3serve.server")

EXIT_ENGINE_DEAD = 3           # the process's status after an engine death (0 is a requested shutdown)
DEAD_EXIT_DELAY_S = 2.0


def engine_dead_error(reason: str) -> APIError:
    return APIError(503, reason, code=ENGINE_DEAD_CODE, headers={"Connection": "close"})


async def wait_stop_or_death(stop: asyncio.Event, dead: asyncio.Event, dead_exit_delay: float) -> int:
    """Wait for a requested stop (-> 0) or the engine's death (-> EXIT_ENGINE_DEAD, after dead_exit_delay)."""
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(dead.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if stop.is_set():
        return 0
    log.error("the engine is dead: answering 503 for %.1f s, then exiting with status %d for a restart",
              dead_exit_delay, EXIT_ENGINE_DEAD)
    try:
        await asyncio.wait_for(stop.wait(), dead_exit_delay)
    except asyncio.TimeoutError:
        pass
    return EXIT_ENGINE_DEAD
