"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms.

The engine thread observes latencies and token counts; the HTTP thread renders. Each instrument has its own
lock, so a render never sees a histogram whose buckets disagree with its count.
"""

from __future__ import annotations

import bisect
import math
import threading

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in d.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name} buckets: expected strictly increasing bounds, found {buckets}")
        self.name, self.help, self.bounds = name, help, tuple(buckets)
        self._counts = [0] * (len(buckets) + 1)   # last: above every bound (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)     # le semantics: value == bound falls in that bucket
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum

    def render(self) -> list[str]:
        counts, total = self.snapshot()
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for bound, c in zip(self.bounds + (math.inf,), counts):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cum}')
        out += [f"{self.name}_sum {_num(total)}", f"{self.name}_count {cum}"]
        return out


class Counter:
    """A monotone counter, optionally split by one label."""

    def __init__(self, name: str, help: str, label: str | None = None):
        if not name.endswith("_total"):
            raise ValueError(f"counter name {name!r}: expected the '_total' suffix")
        self.name, self.help, self.label = name, help, label
        self._values: dict[str | None, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, label_value: str | None = None) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up, found inc({amount})")
        with self._lock:
            self._values[label_value] = self._values.get(label_value, 0) + amount

    def value(self, label_value: str | None = None) -> float:
        with self._lock:
            return self._values.get(label_value, 0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items(), key=lambda kv: str(kv[0]))
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not items and self.label is None:
            items = [(None, 0)]
        for lv, v in items:
            out.append(f"{self.name}{_labels({self.label: lv} if self.label else {})} {_num(v)}")
        return out


def gauge(name: str, help: str, value: float) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {_num(value)}"]


def counter_value(name: str, help: str, value: float) -> list[str]:
    """A counter kept elsewhere (e.g. the engine's preemption count), exposed as is."""
    return [f"# HELP {name} {help}", f"# TYPE {name} counter", f"{name} {_num(value)}"]


class ServerMetrics:
    def __init__(self):
        self.ttft = Histogram("m3serve_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram("m3serve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram("m3serve_e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", E2E_BUCKETS)
        self.prompt_tokens = Counter("m3serve_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("m3serve_generation_tokens_total", "Generated tokens.")
        self.finished = Counter("m3serve_requests_finished_total",
                                "Finished sequences (one per choice; with best_of, one per candidate).",
                                "finish_reason")
        self.http = Counter("m3serve_http_responses_total", "HTTP responses by status code.", "status")

    def render(self, snap: dict) -> str:
        """`snap`: the engine loop's latest stats snapshot (engine.stats() plus loop fields)."""
        total = snap.get("kv_pages_total", 0)
        free = snap.get("kv_pages_free", 0)
        lines: list[str] = []
        lines += gauge("m3serve_engine_alive", "1 while the engine loop thread runs.", int(snap.get("alive", 0)))
        lines += gauge("m3serve_num_requests_waiting", "Requests in the engine's waiting queue (queue depth).",
                       snap.get("waiting", 0))
        lines += gauge("m3serve_num_requests_running", "Requests being prefilled or decoded.",
                       snap.get("running", 0))
        lines += gauge("m3serve_kv_pages_total", "KV cache pages in all.", total)
        lines += gauge("m3serve_kv_pages_free", "KV cache pages obtainable now (free or evictable cached).", free)
        lines += gauge("m3serve_kv_pages_used", "KV cache pages held by live requests.", total - free)
        lines += gauge("m3serve_kv_pages_cached", "KV cache pages in the prefix cache.",
                       snap.get("kv_pages_cached", 0))
        lines += counter_value("m3serve_preemptions_total", "Requests preempted (KV dropped, recomputed later).",
                               snap.get("preemptions", 0))
        lines += counter_value("m3serve_engine_steps_total", "Engine steps run.", snap.get("steps", 0))
        lines += counter_value("m3serve_prefix_cache_queries_total",
                               "Tokens of admitted requests looked up in the prefix cache.",
                               snap.get("prefix_cache_queries", 0))
        lines += counter_value("m3serve_prefix_cache_hits_total",
                               "Tokens of admitted requests found in the prefix cache (KV pages shared, not computed).",
                               snap.get("prefix_cache_hits", 0))
        if "acceptance_length" in snap:
            lines += gauge("m3serve_spec_acceptance_length",
                           "Mean tokens emitted per speculative verify step.", snap["acceptance_length"])
        for key in sorted(k for k in snap if k.startswith("spec_") and k.replace("_", "").isalnum()):
            if isinstance(snap[key], (int, float)) and not isinstance(snap[key], bool):
                lines += gauge(f"m3serve_{key}", f"Speculative decoding statistic {key} (engine.stats()).",
                               snap[key])
        for inst in (self.prompt_tokens, self.generation_tokens, self.finished, self.http,
                     self.ttft, self.itl, self.e2e):
            lines += inst.render()
        return "\n".join(lines) + "\n"
