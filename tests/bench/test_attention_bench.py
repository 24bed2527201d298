"""bench/attention.py on the CPU (Triton interpreter, the `tiny` preset): every row group runs and the
results file has the fields bench/report.py reads; a missing entry module stops the run by name.
About 15 s (each kernel launched twice per row)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "bench" / "attention.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_attention"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_cpu_quick_smoke_writes_every_row(bench, tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    assert bench.main(["--device", "cpu", "--quick", "--iters", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for key in ("commit", "gpu", "command", "date", "copy_bandwidth_Bps", "results"):
        assert key in doc, key
    entries = {r["entry"] for r in doc["results"]}
    assert entries == {"attn.paged/dense-fp8", "attn.paged/msa-nvfp4", "msa.scores", "msa.select", "msa.layer",
                       "kv.write/fp8", "kv.write/nvfp4", "attn.prefill/fp8", "attn.prefill/bf16"}
    for r in doc["results"]:
        for key in ("batch", "context", "query_tokens"):
            assert isinstance(r[key], int) and r[key] >= 0, (r, key)
        assert r["us"] > 0 and r["bytes"] > 0 and r["frac_copy"] > 0, r
        assert ("tflops" in r) == r["entry"].startswith("attn.prefill"), r


def test_a_missing_entry_module_stops_the_run(bench, monkeypatch) -> None:
    monkeypatch.setattr(bench, "MODULES", bench.MODULES + ("m3serve.kernels.no_such_entry",))
    with pytest.raises(SystemExit, match=r"cannot import m3serve.kernels.no_such_entry"):
        bench.main(["--device", "cpu", "--quick"])
