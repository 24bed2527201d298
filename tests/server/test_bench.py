"""`m3serve bench serve` end to end on CPU (JSON + Pareto PNG), its statistics on known timings, the Pareto
front, and the CLI registration functions the top-level m3serve CLI calls."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os

import pytest

from m3serve.bench import cli as bench_cli
from m3serve.bench.plot import pareto_front, plot_pareto
from m3serve.bench.serve import Record, summarize
from m3serve.server import cli as server_cli
from tests.server.conftest import engine_idle, make_llm, serve

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_summarize_known_timings():
    # Request A: sent at 0, tokens at 0.1, 0.2, 0.3, 0.5 s. Request B: sent at 1.0, a first token at 1.2, then
    # three tokens in one chunk at 1.5 (a speculative step): each of those gets a 0.1 s gap.
    a = Record(ok=True, start=0.0, token_times=[0.1, 0.2, 0.3, 0.5], prompt_tokens=10, output_tokens=4)
    b = Record(ok=True, start=1.0, token_times=[1.2, 1.5, 1.5, 1.5], prompt_tokens=20, output_tokens=4)
    bad = Record(ok=False, error="HTTP 429: full", start=0.0)
    s = summarize([a, b, bad], duration_s=2.0, concurrency=2, num_gpus=2)
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (3, 2, 1, ["HTTP 429: full"])
    assert math.isclose(s["ttft_ms"]["mean"], 150.0) and math.isclose(s["ttft_ms"]["p50"], 150.0)
    # ITL samples (ms): A: 100, 100, 200; B: 100, 100, 100.
    assert math.isclose(s["itl_ms"]["p50"], 100.0) and math.isclose(s["itl_ms"]["mean"], 700 / 6)
    assert math.isclose(s["itl_ms"]["p90"], 150.0)        # numpy linear percentile of [100]*5 + [200]
    assert math.isclose(s["interactivity_x90"], 1000 / 150)
    # TPOT: A (0.5-0.1)/3, B (1.5-1.2)/3.
    assert math.isclose(s["tpot_ms"]["mean"], (400 / 3 + 100) / 2)
    assert math.isclose(s["output_tokens_per_s"], 4.0) and math.isclose(s["total_tokens_per_s"], 19.0)
    assert math.isclose(s["total_tokens_per_s_per_gpu"], 9.5) and math.isclose(s["request_throughput"], 1.0)


def test_pareto_front():
    pts = [(1, 10), (2, 8), (3, 9), (4, 1), (0.5, 10), (3, 9)]
    # (2, 8) is beaten by (3, 9) and (0.5, 10) by (1, 10); equal points do not beat each other.
    assert pareto_front(pts) == [0, 2, 5, 3]


@pytest.fixture(scope="module")
def server(model_dir):
    srv = serve(make_llm(model_dir, kv_cache_bytes=8 << 20, max_num_seqs=16))
    yield srv
    srv.stop()


def test_bench_fixed_and_agentic_end_to_end(server, tmp_path, capsys):
    fixed, agentic, png = tmp_path / "fixed.json", tmp_path / "agentic.json", tmp_path / "pareto.png"
    rc = bench_cli.main(["serve", "--base-url", server.url, "--concurrency", "1,2,4", "--input-len", "12",
                         "--output-len", "6", "--requests-per-user", "2", "--label", "stock", "--no-progress",
                         "--out", str(fixed)])
    assert rc == 0
    rc = bench_cli.main(["serve", "--base-url", server.url, "--workload", "agentic", "--concurrency", "1,2,4",
                         "--input-len", "8", "--output-len", "5", "--turns", "3", "--shared-prefix-len", "40",
                         "--num-gpus", "2", "--no-progress", "--out", str(agentic), "--plot", str(png),
                         "--compare", str(fixed)])
    assert rc == 0
    f, a = json.loads(fixed.read_text()), json.loads(agentic.read_text())
    assert [r["concurrency"] for r in f["results"]] == [1, 2, 4] and f["meta"]["label"] == "stock"
    from m3serve.benchmeta import git_commit
    assert f["commit"] == git_commit() != "", "a serving results file names the commit it measured"
    for r in f["results"]:
        n = 2 * r["concurrency"]
        assert (r["requests"], r["completed"], r["failed"]) == (n, n, 0)
        assert (r["prompt_tokens"], r["output_tokens"]) == (12 * n, 6 * n)
        assert r["itl_ms"]["p50"] > 0 and r["ttft_ms"]["p90"] >= r["ttft_ms"]["p50"] > 0
        assert r["interactivity_x90"] == pytest.approx(1000 / r["itl_ms"]["p90"])
        assert r["total_tokens_per_s_per_gpu"] == pytest.approx(18 * n / r["duration_s"])
    for r in a["results"]:
        n = 3 * r["concurrency"]
        assert (r["requests"], r["failed"]) == (n, 0)
        # Turn t resends everything: 40 + 8 + (t-1) * (8 + 5) prompt tokens, t = 1..3.
        assert r["mean_input_len"] == pytest.approx(40 + 8 + 13)
        assert r["total_tokens_per_s_per_gpu"] == pytest.approx(r["total_tokens_per_s"] / 2)
    out = capsys.readouterr()
    assert "x90 tok/s/u" in out.out
    if HAVE_MPL:
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000
        both = tmp_path / "both.png"
        assert bench_cli.main(["plot", str(fixed), str(agentic), "-o", str(both)]) == 0
        assert both.read_bytes()[:8] == PNG_MAGIC
    else:       # matplotlib is the optional `plot` extra: JSON still written, the chart explained away
        assert "matplotlib" in out.err and not png.exists()
    after = engine_idle(server)
    assert after["kv_pages_free"] == after["kv_pages_total"] and after["live_seqs"] == 0


def test_bench_spreads_its_users_over_client_processes(server, tmp_path):
    """--client-procs 2: each level's users run in two spawned processes (at most one per user); the merged records
    count every request once, the level says how many processes it used, and the agentic users still share one
    system prefix (the same prompt lengths as a one-process client)."""
    fixed, agentic = tmp_path / "fixed.json", tmp_path / "agentic.json"
    assert bench_cli.main(["serve", "--base-url", server.url, "--concurrency", "1,3", "--input-len", "12",
                           "--output-len", "6", "--requests-per-user", "2", "--client-procs", "2", "--no-progress",
                           "--out", str(fixed)]) == 0
    assert bench_cli.main(["serve", "--base-url", server.url, "--workload", "agentic", "--concurrency", "3",
                           "--input-len", "8", "--output-len", "5", "--turns", "2", "--shared-prefix-len", "40",
                           "--client-procs", "2", "--no-progress", "--out", str(agentic)]) == 0
    f, a = json.loads(fixed.read_text())["results"], json.loads(agentic.read_text())["results"]
    assert [(r["concurrency"], r["client_procs"]) for r in f] == [(1, 1), (3, 2)]
    for r in f:
        n = 2 * r["concurrency"]
        assert (r["requests"], r["completed"], r["output_tokens"]) == (n, n, 6 * n)
        assert r["duration_s"] > 0 and r["ttft_ms"]["p90"] >= r["ttft_ms"]["p50"] > 0
    (r,) = a
    assert (r["client_procs"], r["requests"], r["failed"]) == (2, 6, 0)
    assert r["mean_input_len"] == pytest.approx(40 + 8 + 13 / 2)
    after = engine_idle(server)
    assert after["kv_pages_free"] == after["kv_pages_total"] and after["live_seqs"] == 0


def test_client_procs_auto_and_refusals():
    from m3serve.bench.serve import BenchConfig, client_procs_for
    assert client_procs_for(BenchConfig(client_procs=4), 2) == 2
    auto = BenchConfig()
    cpus = os.cpu_count() or 1
    assert client_procs_for(auto, 8) == 1
    assert client_procs_for(auto, 128) == max(1, min(8, cpus // 4))
    for bad in (0, True, "two"):
        with pytest.raises(ValueError, match="client_procs"):
            BenchConfig(client_procs=bad).validate()
    with pytest.raises(SystemExit):
        bench_cli.main(["serve", "--client-procs", "0", "--no-progress"])


def test_bench_launches_its_own_server(model_dir, tmp_path):
    """`m3serve bench serve --launch MODEL`: a separate server process, benchmarked, then stopped."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench_cli.main(["serve", "--launch", model_dir, "--server-args",
                         f"--device cpu --dtype float32 --kv-cache-bytes {4 << 20} --log-level warning",
                         "--concurrency", "1,2", "--input-len", "10", "--output-len", "4", "--requests-per-user",
                         "2", "--no-progress", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["completed"], r["output_tokens"]) for r in res] == [(1, 2, 8), (2, 4, 16)]
    if HAVE_MPL:
        assert png.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ImportError if not HAVE_MPL else ValueError):
        plot_pareto([], str(tmp_path / "none.png"))


def test_register_functions_build_the_cli():
    top = argparse.ArgumentParser(prog="m3serve")
    sub = top.add_subparsers(dest="command", required=True)
    server_cli.register(sub)
    bench_cli.register(sub)
    a = top.parse_args(["serve", "tiny", "--port", "0", "--api-key", "k", "--max-queue", "8"])
    assert a.func is server_cli.run and (a.model_pos, a.port, a.api_key, a.max_queue, a.host) == \
        ("tiny", 0, "k", 8, "127.0.0.1")
    b = top.parse_args(["bench", "serve", "--concurrency", "1,2,64", "--workload", "agentic"])
    assert b.func is bench_cli.run_serve and b.concurrency == [1, 2, 64] and b.workload == "agentic"
    c = top.parse_args(["bench", "plot", "x.json", "y.json", "-o", "z.png"])
    assert c.func is bench_cli.run_plot and c.files == ["x.json", "y.json"]
    with pytest.raises(SystemExit):
        top.parse_args(["bench", "serve", "--concurrency", "0,2"])
