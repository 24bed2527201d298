"""/metrics through prometheus_client: vLLM's metrics under vLLM's names with the `m3serve_` prefix (promtool
clean), the same series as `vllm:<name>` on request (`/metrics?names=vllm`, for vLLM's dashboards), a
`model_name` label on each, this engine's own figures, and the process collector's `process_*`.

    m3serve_num_requests_running / _waiting          gauge      requests decoding or prefilling / queued
    m3serve_kv_cache_usage_perc                      gauge      fraction of KV pages held by live requests (0..1)
    m3serve_prompt_tokens_total, _generation_tokens_total   counter   prompt tokens admitted, tokens generated
    m3serve_request_success_total{finished_reason}   counter    finished sequences: stop | length | abort
    m3serve_num_preemptions_total                    counter
    m3serve_prefix_cache_queries_total / _hits_total counter    prompt tokens looked up / found in the prefix cache
    m3serve_time_to_first_token_seconds, m3serve_inter_token_latency_seconds, m3serve_e2e_request_latency_seconds
                                                     histogram
  (the lines above are vLLM's metrics: vllm:<name without m3serve_>; the ones below are this engine's only)
    m3serve_engine_alive                             gauge      1 while the engine loop runs (0 once it died)
    m3serve_kv_pages_capacity / _free / _used / _cached   gauge   KV pages
    m3serve_engine_steps_total, m3serve_http_responses_total{status}   counter
    m3serve_kernel_compiles_after_warmup_total       counter    Triton kernel variants built after the warm-up
    m3serve_prefill_graph_replays_total              counter    eager steps whose forward replayed a prefill graph
    m3serve_spec_*                                   gauge      speculative decoding statistics (engine.stats()),
                                                                among them m3serve_spec_disable_by_batch_size (the
                                                                policy's threshold; absent when the policy is off)
    m3serve_spec_policy_plain_steps_total / _spec_steps_total   counter   steps with decoding requests that the
                                                                batch-size policy ran plainly / speculatively
    m3serve_spec_program_steps_total / _split_steps_total / _fresh_rows_total   counter   how speculative steps ran

promtool's lint refuses ':' in names (it reserves them for recording rules; vLLM's own exposition fails it), so
the `vllm:` form is the alias, not the default. Engine figures come from the engine loop's latest snapshot, read
at scrape time by a collector; latencies and token counts are observed on the engine thread as they happen.
Each ServerMetrics has its own registry (two servers in one process do not share series). The exposition is
Prometheus' text format 0.0.4 (what Prometheus 2.x scrapes; `_created` series are off).
"""

from __future__ import annotations

import math
from bisect import bisect_left

from prometheus_client import (CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "m3serve_"
# the speculative batch-size policy's step counts (SpecDecoding.stats): counters, not spec_* gauges
SPEC_POLICY_COUNTERS = {
    "spec_policy_plain_steps": "Steps with decoding requests run without speculation (more requests running or "
                               "waiting than speculative_config.disable_by_batch_size).",
    "spec_policy_spec_steps": "Steps with decoding requests run speculatively under "
                              "speculative_config.disable_by_batch_size.",
    "spec_program_steps": "Speculative steps run as the step program (verify + K draft passes in one launch "
                          "sequence, a CUDA graph on the GPU).",
    "spec_split_steps": "Of the step program's steps, those beside prefill chunks run eagerly in the same step.",
    "spec_fresh_rows": "Rows the step program took without drafts (just prefilled, or after plain steps), stand-in drafts verified.",
}
# vLLM's metrics, by their names after the prefix (`vllm:` + name in vLLM's exposition)
VLLM_METRICS = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
    "request_success", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds"})
NAME_SCHEMES = ("m3serve", "vllm")

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _Counter:
    """A prometheus_client counter with the model_name label bound and at most one more label."""

    def __init__(self, name: str, help: str, registry, model: str, label: str | None = None):
        self._c = Counter(name, help, ["model_name"] + ([label] if label else []), registry=registry)
        self._model, self._label = model, label
        self._values: dict[str | None, float] = {}     # for value(): prometheus_client keeps no public read
        self._children: dict[str | None, object] = {}  # labels() per label value, bound once (it costs a lock)

    def inc(self, amount: float = 1, label_value: str | None = None) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up, found inc({amount})")
        child = self._children.get(label_value)
        if child is None:
            child = self._c.labels(self._model, str(label_value)) if self._label else self._c.labels(self._model)
            self._children[label_value] = child
        child.inc(amount)
        self._values[label_value] = self._values.get(label_value, 0) + amount

    def value(self, label_value: str | None = None) -> float:
        return self._values.get(label_value, 0)


class _Histogram:
    def __init__(self, name: str, help: str, buckets, registry, model: str):
        self._h = Histogram(name, help, ["model_name"], buckets=buckets, registry=registry).labels(model)
        # observe_many adds a step's observations per bucket through the child's own value cells (one locked add
        # per bucket hit and one for the sum, instead of two per observation); without those cells (another
        # prometheus_client layout) it observes one by one.
        h = self._h
        self._cells = None
        if all(hasattr(h, a) for a in ("_upper_bounds", "_buckets", "_sum")) and \
                len(h._upper_bounds) == len(h._buckets):
            self._cells = (list(h._upper_bounds), h._buckets, h._sum)

    def observe(self, value: float, times: int = 1) -> None:
        """`times` equal observations (k tokens of one speculative step share a gap)."""
        for _ in range(times):
            self._h.observe(value)

    def observe_many(self, values: list[float]) -> None:
        """Every value of `values` observed once (the same counts and sum as observe() per value)."""
        if not values:
            return
        if self._cells is None:
            for v in values:
                self._h.observe(v)
            return
        bounds, cells, total = self._cells
        hits: dict[int, int] = {}
        for v in values:
            if v == v:                     # NaN: no bucket, as observe() (it still adds to the sum)
                i = bisect_left(bounds, v)     # the first bucket whose upper bound is >= v (+Inf is the last)
                hits[i] = hits.get(i, 0) + 1
        total.inc(sum(values))
        for i, n in hits.items():
            cells[i].inc(n)


class _EngineCollector:
    """The engine loop's latest snapshot as gauges and counters, at scrape time."""

    def __init__(self, model: str):
        self.model = model
        self.snapshot: dict = {"alive": 0}

    def describe(self):
        return []

    def _gauge(self, name: str, help: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, help, labels=["model_name"])
        g.add_metric([self.model], float(value))
        return g

    def _counter(self, name: str, help: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, help, labels=["model_name"])
        c.add_metric([self.model], float(value))
        return c

    def collect(self):
        s = self.snapshot
        total, free = s.get("kv_pages_total", 0), s.get("kv_pages_free", 0)
        yield self._gauge("m3serve_engine_alive", "1 while the engine loop thread runs.", int(s.get("alive", 0)))
        yield self._gauge("m3serve_num_requests_running", "Requests being prefilled or decoded.", s.get("running", 0))
        yield self._gauge("m3serve_num_requests_waiting", "Requests in the engine's waiting queue.", s.get("waiting", 0))
        yield self._gauge("m3serve_kv_cache_usage_perc", "Fraction of KV cache pages held by live requests (1 = full).",
                          (total - free) / total if total else 0.0)
        yield self._gauge("m3serve_kv_pages_capacity", "KV cache pages in all.", total)
        yield self._gauge("m3serve_kv_pages_free", "KV cache pages obtainable now (free or evictable cached).", free)
        yield self._gauge("m3serve_kv_pages_used", "KV cache pages held by live requests.", total - free)
        yield self._gauge("m3serve_kv_pages_cached", "KV cache pages in the prefix cache.", s.get("kv_pages_cached", 0))
        yield self._counter("m3serve_num_preemptions", "Requests preempted (KV dropped, recomputed later).",
                            s.get("preemptions", 0))
        yield self._counter("m3serve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.get("prefix_cache_queries", 0))
        yield self._counter("m3serve_prefix_cache_hits", "Prompt tokens found in the prefix cache (KV shared).",
                            s.get("prefix_cache_hits", 0))
        yield self._counter("m3serve_engine_steps", "Engine steps run.", s.get("steps", 0))
        yield self._counter("m3serve_kernel_compiles_after_warmup", "Triton kernel variants built after the start-up "
                            "warm-up (each a stall in front of a step; 0 when the warm-up reached every shape class).",
                            s.get("kernel_compiles_after_warmup", 0))
        yield self._counter("m3serve_prefill_graph_replays", "Eager steps (prefill chunks, alone or beside decoding "
                            "rows) whose forward replayed a CUDA graph (--prefill-graph-tokens).",
                            s.get("prefill_graph_replays", 0))
        if "acceptance_length" in s:
            yield self._gauge("m3serve_spec_acceptance_length", "Mean tokens emitted per speculative verify step.",
                              s["acceptance_length"])
        for key, help in SPEC_POLICY_COUNTERS.items():
            if key in s:
                yield self._counter(f"m3serve_{key}", help, s[key])
        for key in sorted(k for k in s if k.startswith("spec_") and k.replace("_", "").isalnum()
                          and k not in SPEC_POLICY_COUNTERS):
            v = s[key]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                yield self._gauge(f"m3serve_{key}", f"Speculative decoding statistic {key} (engine.stats()).", v)


def vllm_name(name: str) -> str:
    """The `vllm:` alias of a sample or family name of vLLM's metrics; other names unchanged."""
    if not name.startswith(PREFIX):
        return name
    rest = name[len(PREFIX):]
    base = next((m for m in VLLM_METRICS if rest == m or rest.startswith(m + "_")), None)
    return "vllm:" + rest if base is not None else name


class _VllmNames:
    """A registry's families with vLLM's metrics renamed vllm:<name> (generate_latest reads any collect())."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        for fam in self.registry.collect():
            name = vllm_name(fam.name)
            if name == fam.name:
                yield fam
                continue
            out = Metric(name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(name=vllm_name(s.name)) for s in fam.samples]
            yield out


class ServerMetrics:
    def __init__(self, model_name: str = "m3serve", process: bool = True):
        self.registry = CollectorRegistry(auto_describe=False)
        r, m = self.registry, model_name
        self.ttft = _Histogram("m3serve_time_to_first_token_seconds",
                               "Time from request arrival to its first generated token.", TTFT_BUCKETS, r, m)
        self.itl = _Histogram("m3serve_inter_token_latency_seconds",
                              "Time between consecutive generated tokens of a request.", ITL_BUCKETS, r, m)
        self.e2e = _Histogram("m3serve_e2e_request_latency_seconds", "Time from request arrival to its last token.",
                              E2E_BUCKETS, r, m)
        self.prompt_tokens = _Counter("m3serve_prompt_tokens", "Prompt tokens of admitted requests.", r, m)
        self.generation_tokens = _Counter("m3serve_generation_tokens", "Generated tokens.", r, m)
        self.finished = _Counter("m3serve_request_success", "Finished sequences (one per choice; with best_of, one "
                                 "per candidate) by finish reason.", r, m, "finished_reason")
        self.http = _Counter("m3serve_http_responses", "HTTP responses by status code.", r, m, "status")
        self.engine = _EngineCollector(m)
        r.register(self.engine)
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)

    def render(self, snap: dict, names: str = "m3serve") -> str:
        """`snap`: the engine loop's latest stats snapshot (engine.stats() plus loop fields); names: "m3serve"
        (promtool clean) or "vllm" (vLLM's metrics as vllm:<name>)."""
        if names not in NAME_SCHEMES:
            raise ValueError(f"names: expected one of {NAME_SCHEMES}, found {names!r}")
        self.engine.snapshot = snap
        return generate_latest(self.registry if names == "m3serve" else _VllmNames(self.registry)).decode("utf-8")
