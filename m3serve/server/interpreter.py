"""The serving process's interpreter settings: a frozen start-up heap, and (opt-in) the GIL's switch interval.

The garbage collector's full passes walk every object alive, and after start-up that is the whole model,
tokenizer and server: about 237,000 objects with the embedded model loaded, a 29 ms full pass on the CPU box,
which falls into one token's gap. `gc.freeze()` after the warm-up moves them out of the collector's sight (they
live as long as the process), so later passes walk only what serving allocates (the same pass then took 2 µs).
On by default (`--no-gc-freeze` leaves the heap as it is).

The engine loop's thread (engine_loop.py) and the event loop's thread (HTTP, SSE, detokenizing) share one GIL.
The event loop's thread releases it around each socket call and takes it straight back, so a thread waiting for
it (the engine thread, back from its wait on the device) may only get it when the waiter's timer forces a
switch: after `sys.getswitchinterval()`, 5 ms by default. A shorter interval bounds that wait, at the price of
more switches while both threads compute. Measured with bench/host_stream_cost.py (the real server, the device
replaced by fixed waits; 2-core CPU box, bench/results/host_overhead/host_stream_cost-cpu-interpreter-*.json)
the frozen heap gave 8 % / 14 % more tokens per second at 16 / 64 streams than the heap left alone, and a 0.2 ms
interval on top of it 6 % / 9 % fewer, so the default keeps CPython's interval and
`--switch-interval-ms` sets another; bench/serve_pareto.py's "-si" modes measure it served on the GPU.
"""

from __future__ import annotations

import gc
import logging
import sys

log = logging.getLogger("m3serve.server")

SHORT_SWITCH_INTERVAL_MS = 0.2     # what the "-si" serving sweeps try: under the embedded model's decode step


def check_switch_interval(ms: float) -> float:
    """ms, or a ValueError naming the flag: the interval must be a positive number of milliseconds."""
    if not (isinstance(ms, (int, float)) and ms > 0 and ms < 1e6):
        raise ValueError(f"--switch-interval-ms: expected milliseconds > 0 (and < 1e6), found {ms!r}")
    return float(ms)


def tune_for_serving(switch_interval_ms: float | None = None, freeze_heap: bool = True) -> dict:
    """Set the GIL's switch interval (None: keep the interpreter's) and (freeze_heap) collect once, then freeze
    what start-up left alive. Call it once the engine is built and warm, before serving. Returns what it set."""
    if switch_interval_ms is not None:
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


__all__ = ["SHORT_SWITCH_INTERVAL_MS", "check_switch_interval", "tune_for_serving"]
