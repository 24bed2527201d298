"""The serving process's interpreter settings: the GIL's switch interval and a frozen start-up heap.

The engine loop's thread (engine_loop.py) and the event loop's thread (HTTP, SSE, detokenizing) share one GIL.
The event loop's thread releases it around each socket call and takes it straight back, so a thread waiting for
it (the engine thread, back from its wait on the device) may only get it when the waiter's timer forces a
switch: after `sys.getswitchinterval()`, 5 ms by default, ten decode steps of the embedded model. Served, that
wait lands in every inter-token gap once the HTTP side is busy (many streams), never in the benchmark that
drives the engine in-process. A switch interval near one step's host work bounds the wait by it; the price is
more (cheap) switches while both threads compute.

The garbage collector's full passes walk every object alive, and after start-up that is the whole model,
tokenizer and server (millions of objects): tens of milliseconds that fall into one token's gap. `gc.freeze()`
after the warm-up moves them out of the collector's sight (they live as long as the process), so later passes
walk only what serving allocates. vLLM's engine freezes its heap after start-up for the same reason.
"""

from __future__ import annotations

import gc
import logging
import sys

log = logging.getLogger("m3serve.server")

DEFAULT_SWITCH_INTERVAL_MS = 0.2     # the embedded model's decode step is ~0.3 ms on the H200
PYTHON_SWITCH_INTERVAL_MS = 5.0      # CPython's default, for comparison runs


def check_switch_interval(ms: float) -> float:
    """ms, or a ValueError naming the flag: the interval must be a positive number of milliseconds."""
    if not (isinstance(ms, (int, float)) and ms > 0 and ms < 1e6):
        raise ValueError(f"--switch-interval-ms: expected milliseconds > 0 (and < 1e6), found {ms!r}")
    return float(ms)


def tune_for_serving(switch_interval_ms: float = DEFAULT_SWITCH_INTERVAL_MS, freeze_heap: bool = True) -> dict:
    """Set the GIL's switch interval and (freeze_heap) collect once, then freeze what start-up left alive.
    Call it once the engine is built and warm, before serving. Returns what it set, for the log."""
    sys.setswitchinterval(check_switch_interval(switch_interval_ms) / 1e3)
    frozen = 0
    if freeze_heap:
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    done = {"switch_interval_ms": sys.getswitchinterval() * 1e3, "frozen_objects": frozen}
    log.info("interpreter: GIL switch interval %.3f ms, %d start-up objects frozen", done["switch_interval_ms"],
             frozen)
    return done


__all__ = ["DEFAULT_SWITCH_INTERVAL_MS", "PYTHON_SWITCH_INTERVAL_MS", "check_switch_interval", "tune_for_serving"]
