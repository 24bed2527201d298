"""/metrics through prometheus_client: vLLM's metrics under m3serve_<vLLM's name> (and vllm:<name> on request)
with a model_name label, the KV usage fraction, process metrics, promtool's naming rules (counters _total,
gauges not), cumulative histograms; parsed with prometheus_client.parser (tests/server/promtext.py), and checked
by `promtool check metrics` where promtool is installed."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest

from m3serve.server.metrics import CONTENT_TYPE, VLLM_METRICS, ServerMetrics
from tests.server.promtext import parse, value

SNAP = {"alive": 1, "waiting": 3, "running": 2, "kv_pages_total": 10, "kv_pages_free": 6, "preemptions": 5,
        "steps": 9, "kv_pages_cached": 1, "acceptance_length": 2.5, "spec_draft_tokens": 30,
        "spec_disable_by_batch_size": 2, "spec_policy_plain_steps": 7, "spec_policy_spec_steps": 3,
        "spec_program_steps": 11, "spec_split_steps": 4, "spec_fresh_rows": 6,
        "prefix_cache_queries": 400, "prefix_cache_hits": 288, "prefill_graph_replays": 12}


def _filled() -> ServerMetrics:
    m = ServerMetrics("tiny-test")
    m.ttft.observe(0.02)
    for v in (0.05, 0.1, 0.3):
        m.e2e.observe(v)
    m.itl.observe(0.004, 3)
    m.prompt_tokens.inc(11)
    m.generation_tokens.inc(4)
    m.finished.inc(1, "length")
    m.finished.inc(2, "stop")
    m.http.inc(1, "200")
    return m


def test_vllm_names_with_the_model_label():
    types, s = parse(_filled().render(SNAP))
    lab = {"model_name": "tiny-test"}
    assert value(s, "m3serve_num_requests_waiting", **lab) == 3 and value(s, "m3serve_num_requests_running", **lab) == 2
    assert value(s, "m3serve_kv_cache_usage_perc", **lab) == pytest.approx(0.4)
    assert value(s, "m3serve_prompt_tokens_total", **lab) == 11 and value(s, "m3serve_generation_tokens_total", **lab) == 4
    assert value(s, "m3serve_request_success_total", finished_reason="stop", **lab) == 2
    assert value(s, "m3serve_request_success_total", finished_reason="length", **lab) == 1
    assert value(s, "m3serve_num_preemptions_total", **lab) == 5
    assert value(s, "m3serve_prefix_cache_queries_total", **lab) == 400
    assert value(s, "m3serve_prefix_cache_hits_total", **lab) == 288
    assert value(s, "m3serve_inter_token_latency_seconds_count", **lab) == 3
    assert value(s, "m3serve_time_to_first_token_seconds_count", **lab) == 1
    assert value(s, "m3serve_e2e_request_latency_seconds_bucket", le="0.1", **lab) == 2     # le is inclusive
    assert math.isclose(value(s, "m3serve_e2e_request_latency_seconds_sum", **lab), 0.45)
    assert value(s, "m3serve_engine_alive", **lab) == 1 and value(s, "m3serve_kv_pages_used", **lab) == 4
    assert value(s, "m3serve_kv_pages_capacity", **lab) == 10
    assert value(s, "m3serve_spec_acceptance_length", **lab) == 2.5 and value(s, "m3serve_spec_draft_tokens") == 30
    assert value(s, "m3serve_http_responses_total", status="200", **lab) == 1
    # the speculative batch-size policy: its threshold a gauge, its step counts counters
    assert value(s, "m3serve_spec_disable_by_batch_size", **lab) == 2
    assert value(s, "m3serve_spec_policy_plain_steps_total", **lab) == 7
    assert value(s, "m3serve_spec_policy_spec_steps_total", **lab) == 3
    assert types["m3serve_spec_policy_plain_steps"] == "counter"
    # how the speculative steps ran: counters too
    assert value(s, "m3serve_spec_program_steps_total", **lab) == 11 and value(s, "m3serve_spec_fresh_rows_total", **lab) == 6
    assert value(s, "m3serve_prefill_graph_replays_total", **lab) == 12
    assert types["m3serve_spec_split_steps"] == types["m3serve_spec_fresh_rows"] == "counter"
    assert types["m3serve_spec_disable_by_batch_size"] == "gauge"
    assert types["m3serve_request_success"] == "counter" and types["m3serve_kv_cache_usage_perc"] == "gauge"
    for (name, labels), _ in s.items():          # every series but the process collector's carries the model
        if name.startswith(("m3serve_", "m3serve_")):
            assert ("model_name", "tiny-test") in labels, name


def test_process_metrics_and_no_created_series():
    types, s = parse(_filled().render(SNAP))
    assert "process_cpu_seconds" in types and value(s, "process_resident_memory_bytes") > 0
    assert not any(name.endswith("_created") for name, _ in s)


def test_engine_death_and_absent_figures():
    m = _filled()
    types, s = parse(m.render({"alive": 0}))
    assert value(s, "m3serve_engine_alive", model_name="tiny-test") == 0
    assert value(s, "m3serve_kv_cache_usage_perc", model_name="tiny-test") == 0     # no pages known: 0, not NaN
    assert "m3serve_spec_acceptance_length" not in types


def test_counters_refuse_to_go_down():
    with pytest.raises(ValueError, match="only go up"):
        ServerMetrics("x", process=False).prompt_tokens.inc(-1)


def test_content_type_names_the_exposition_version():
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_two_servers_keep_their_own_series():
    a, b = ServerMetrics("a", process=False), ServerMetrics("b", process=False)
    a.generation_tokens.inc(3)
    _, sb = parse(b.render({}))
    assert value(sb, "m3serve_generation_tokens_total", model_name="b") == 0
    assert value(parse(a.render({}))[1], "m3serve_generation_tokens_total", model_name="a") == 3


def test_vllm_names_on_request():
    m = _filled()
    types, s = parse(m.render(SNAP, names="vllm"))
    ours, _ = parse(m.render(SNAP))
    for name in VLLM_METRICS:
        assert f"vllm:{name}" in types and f"m3serve_{name}" not in types and f"m3serve_{name}" in ours, name
    assert value(s, "vllm:request_success_total", finished_reason="stop", model_name="tiny-test") == 2
    assert value(s, "vllm:kv_cache_usage_perc", model_name="tiny-test") == pytest.approx(0.4)
    assert value(s, "vllm:time_to_first_token_seconds_count", model_name="tiny-test") == 1
    assert "m3serve_engine_alive" in types and "m3serve_kv_pages_used" in types      # this engine's own stay
    with pytest.raises(ValueError, match="names"):
        m.render(SNAP, names="prom")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_promtool_check_metrics_is_clean():
    text = _filled().render(SNAP)
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
