"""bench/prefill.py on CPU at the tiny preset: rows for m3serve and transformers with the issue's fields, and the
FLOP model (dense layers causal, MSA layers over the selected blocks only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from prefill import prefill_flops  # noqa: E402

from m3serve.config import preset  # noqa: E402


def test_flops_grow_quadratically_on_dense_layers_only():
    cfg = preset("minimax-m3:5")
    a, b = prefill_flops(cfg, 8192), prefill_flops(cfg, 16384)
    assert 2.0 < b / a < 4.0                       # linear GEMM part plus quadratic dense attention
    # the estimate: ~31 TFLOP of GEMMs at 8k tokens for minimax-m3:5 (within the attention term)
    assert 25e12 < a < 60e12, a


def test_bench_writes_both_engines(tmp_path):
    out = tmp_path / "prefill.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "prefill.py"), "--model", "tiny", "--tokens",
                        "40", "--quant", "none", "--repeat", "1", "--device", "cpu", "--sparse-prefill", "on,off",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    engines = {row["engine"] for row in doc["results"]}
    assert engines == {"m3serve", "transformers"}
    # one engine, both MSA prefill paths side by side
    assert [row["sparse_prefill"] for row in doc["results"] if row["engine"] == "m3serve"] == ["on", "off"]
    for row in doc["results"]:
        assert row["tokens"] == 40 and row["ttft_s"] > 0 and row["frac_bf16_peak"] > 0
    assert doc["commit"] and "command" in doc


def test_bench_refuses_an_unknown_sparse_prefill_mode(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "prefill.py"), "--sparse-prefill", "on,maybe",
                        "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--sparse-prefill" in r.stderr and "'on,maybe'" in r.stderr


def test_interference_bench_rows(tmp_path):
    """bench/prefill_interference.py at the tiny preset: one row per chunk size; a chunk 4x larger prefills the
    same prompt in fewer steps (the decode rows ride in every one of them); the streams' ITL is recorded."""
    out = tmp_path / "pi.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "prefill_interference.py"), "--model", "tiny",
                        "--quant", "none", "--prompt", "200", "--chunks", "32,128", "--streams", "2", "--device",
                        "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    small, large = doc["results"]
    assert (small["chunk"], large["chunk"]) == (32, 128)
    assert small["prefill_steps"] >= 200 // 32 and large["prefill_steps"] <= 2 < small["prefill_steps"]
    for row in (small, large):
        assert row["ttft_s"] > 0 and row["itl_ms"]["p99"] >= row["itl_ms"]["p50"] > 0
        assert row["baseline_itl_ms"]["p50"] > 0
    assert doc["bench"] == "prefill_interference" and doc["commit"]
