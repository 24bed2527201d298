"""The hand-written Prometheus text, and the streaming detokenizer's guarantee (pieces concatenate to the
final text, and nothing past a stop string is ever released)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.server.detok import TextStream
from m3serve.server.metrics import Counter, Histogram, ServerMetrics
from m3serve.tokenizer import load_tokenizer
from tests.server.promtext import parse, value


def test_histogram_buckets_use_le_and_accumulate():
    h = Histogram("x_seconds", "help", (0.1, 0.5, 1.0))
    for v in (0.05, 0.1, 0.3, 0.5, 0.7, 5.0):
        h.observe(v)
    h.observe(0.2, times=3)
    types, s = parse("\n".join(h.render()) + "\n")
    assert types == {"x_seconds": "histogram"}
    got = [value(s, "x_seconds_bucket", le=le) for le in ("0.1", "0.5", "1", "+Inf")]
    assert got == [2, 7, 8, 9]            # 0.1 and 0.5 fall in their own bucket (le is inclusive)
    assert math.isclose(value(s, "x_seconds_sum"), 0.05 + 0.1 + 0.3 + 0.5 + 0.7 + 5.0 + 0.6)
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram("y", "h", (1.0, 0.5))


def test_counter_labels_and_rules():
    c = Counter("req_total", "h", "code")
    c.inc(2, "200")
    c.inc(1, 'we"ird')
    _, s = parse("\n".join(c.render()) + "\n")
    assert value(s, "req_total", code="200") == 2 and value(s, "req_total", code='we\\"ird') == 1
    with pytest.raises(ValueError, match="only go up"):
        c.inc(-1)
    with pytest.raises(ValueError, match="_total"):
        Counter("bad", "h")


def test_server_metrics_render_is_valid_and_complete():
    m = ServerMetrics()
    m.ttft.observe(0.02)
    m.itl.observe(0.004, 3)
    m.prompt_tokens.inc(11)
    m.generation_tokens.inc(4)
    m.finished.inc(1, "length")
    snap = {"alive": 1, "waiting": 3, "running": 2, "kv_pages_total": 10, "kv_pages_free": 6, "preemptions": 5,
            "steps": 9, "kv_pages_cached": 1, "acceptance_length": 2.5, "spec_draft_tokens": 30,
            "prefix_cache_queries": 400, "prefix_cache_hits": 288}
    types, s = parse(m.render(snap))
    assert value(s, "m3serve_num_requests_waiting") == 3 and value(s, "m3serve_kv_pages_used") == 4
    assert value(s, "m3serve_preemptions_total") == 5 and value(s, "m3serve_spec_acceptance_length") == 2.5
    assert value(s, "m3serve_spec_draft_tokens") == 30
    assert value(s, "m3serve_prefix_cache_queries_total") == 400 and value(s, "m3serve_prefix_cache_hits_total") == 288
    assert types["m3serve_prefix_cache_hits_total"] == "counter"
    assert value(s, "m3serve_inter_token_latency_seconds_count") == 3
    assert value(s, "m3serve_time_to_first_token_seconds_count") == 1
    assert value(s, "m3serve_prompt_tokens_total") == 11 and value(s, "m3serve_generation_tokens_total") == 4
    assert types["m3serve_requests_finished_total"] == "counter"
    assert "m3serve_spec_acceptance_length" not in parse(m.render({k: v for k, v in snap.items()
                                                                    if k != "acceptance_length"}))[0]


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@settings(max_examples=150, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, 511), min_size=1, max_size=30), stop_at=st.integers(0, 40),
       stop_len=st.integers(1, 4), split=st.integers(1, 3))
def test_stream_pieces_concatenate_and_never_pass_a_stop(tok, ids, stop_at, stop_len, split):
    full = tok.decode(ids, skip_special_tokens=True)
    stop = full[stop_at:stop_at + stop_len] if stop_at < len(full) else None
    stop = stop if stop and "\ufffd" not in stop else None
    # Emulate the engine: after each token, the first occurrence of the stop string ends the request.
    ts = TextStream(tok, [stop] if stop else [])
    sent, final = "", None
    last: list[int] = []
    for k in range(0, len(ids), split):
        text = tok.decode(ids[:k + split], skip_special_tokens=True)
        if stop and stop in text:
            final, last = text[:text.find(stop)], ids[k:k + split]
            assert final.startswith(sent), (sent, final)     # nothing past the stop was released
            break
        sent += ts.push(ids[k:k + split])
        assert text.startswith(sent)
    sent += ts.finish(final, last)
    assert sent == (final if final is not None else full)


def test_stream_without_tokenizer_is_empty():
    ts = TextStream(None, ["x"])
    assert ts.push([1, 2]) == "" and ts.finish() == ""
