"""`m3serve bench pareto`: several serve runs into one file (and chart), rows kept unchanged."""

from __future__ import annotations

import json

import pytest

from m3serve.bench import pareto
from m3serve.bench.cli import main


def _run(path, label, scale):
    rows = [{"concurrency": c, "interactivity_x90": 1000.0 / (c * scale), "total_tokens_per_s_per_gpu": 500.0 * c,
             "failed": 0} for c in (1, 4, 16)]
    path.write_text(json.dumps({"meta": {"label": label, "model": "m"}, "results": rows}))
    return rows


def test_pareto_combines_runs_with_modes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    ra, rb = _run(a, "plain", 1.0), _run(b, "eagle3", 0.5)
    out = tmp_path / "front.json"
    png = tmp_path / "front.png"
    assert main(["pareto", f"{a}:plain:nvfp4", f"{b}:spec", "--out", str(out), "--plot", str(png),
                 "--commit", "abc", "--gpu", "H200"]) == 0
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc" and doc["gpu"] == "H200"
    assert [r["mode"] for r in doc["runs"]] == ["plain", "spec"]
    assert doc["runs"][0]["quantization"] == "nvfp4" and doc["runs"][1]["quantization"] is None
    assert doc["runs"][0]["results"] == ra and doc["runs"][1]["results"] == rb
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_pareto_rejects_an_unknown_mode(tmp_path):
    a = tmp_path / "a.json"
    _run(a, "x", 1.0)
    with pytest.raises(ValueError, match="mode"):
        pareto.describe_run(pareto.load(str(a)), "turbo")
