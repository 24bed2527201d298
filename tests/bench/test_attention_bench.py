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
    assert doc["decode_step"] == [] and doc["decode_step_setup"] is None   # CUDA only: skipped, key kept


def test_a_missing_entry_module_stops_the_run(bench, monkeypatch) -> None:
    monkeypatch.setattr(bench, "MODULES", bench.MODULES + ("m3serve.kernels.no_such_entry",))
    with pytest.raises(SystemExit, match=r"cannot import m3serve.kernels.no_such_entry"):
        bench.main(["--device", "cpu", "--quick"])


def test_target_len_limit_is_the_certified_msa_select_width(bench) -> None:
    from m3serve.config import preset
    assert bench.target_len_limit(preset("minimax-m3:5")) == 1024 * 128


def test_decode_step_builds_the_decode_benchs_llm_and_fits_128k(bench, monkeypatch) -> None:
    """decode_step without a GPU: the LLM arguments, the max_model_len cap and the prompt per context."""
    import types

    import m3serve

    built, timed = [], []

    class FakeLLM:
        def __init__(self, model, **kw):
            built.append((model, kw))
            runner = types.SimpleNamespace(graphs=object(), target_attention=True)
            self.engine = types.SimpleNamespace(runner=runner, max_model_len=kw["max_model_len"],
                                                capacity_tokens=1 << 22)

    def time_decode(llm, batch, context, steps, seed, window):
        timed.append((batch, context, steps, seed, window))
        return {"median_s": 0.01, "min_s": 0.009, "steps": window * (steps - 1), "window": window,
                "gpu_busy_s": 0.008, "launches_per_step": 1.0, "_tokens": []}

    monkeypatch.setattr(m3serve, "LLM", FakeLLM)
    monkeypatch.setattr(bench, "_load_decode_bench", lambda: types.SimpleNamespace(WINDOW=8, time_decode=time_decode))
    rows, setup = bench.decode_step("minimax-m3:5", [4096, 131072], 12)
    (model, kw), = built
    assert model == "minimax-m3:5"
    assert kw == dict(device="cuda", dtype="bfloat16", random_weights=True, quantization="nvfp4",
                      kv_cache_dtype="nvfp4", max_num_seqs=1, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
                      max_model_len=131072, route="auto")
    assert timed == [(1, 4096, 12, 0, 8), (1, 131072 - 8 * 12 - 64, 12, 0, 8)]
    assert [(r["model"], r["context"], r["batch"], r["prompt_tokens"]) for r in rows] == [
        ("minimax-m3:5", 4096, 1, 4096), ("minimax-m3:5", 131072, 1, 131072 - 160)]
    assert all(r["median_s"] == 0.01 and "gpu_busy_s" in r and "launches_per_step" in r for r in rows)
    assert setup["max_model_len"] == 131072 and setup["window"] == 8


def test_decode_step_stops_when_the_target_is_off(bench, monkeypatch) -> None:
    import types

    import m3serve

    class FakeLLM:
        def __init__(self, model, **kw):
            runner = types.SimpleNamespace(graphs=None, target_attention=False)
            self.engine = types.SimpleNamespace(runner=runner, max_model_len=kw["max_model_len"])

    monkeypatch.setattr(m3serve, "LLM", FakeLLM)
    monkeypatch.setattr(bench, "_load_decode_bench", lambda: types.SimpleNamespace(WINDOW=8, time_decode=None))
    with pytest.raises(SystemExit, match="decode target is off"):
        bench.decode_step("minimax-m3:5", [4096], 12)
