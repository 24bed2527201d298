"""bench/kv_rotation.py on the CPU at the `tiny` preset: the results file has every sparse layer's errors for
both variants, they are the codec's (NVFP4 round trips err by ~0.1 of the norm, so 0.02..0.5), and the
ratio is the one of the recorded means. A preset without a sparse layer stops the run by name. A few seconds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv_rotation", ROOT / "bench" / "kv_rotation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_kv_rotation"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_tiny_preset_on_cpu_writes_every_sparse_layer(bench, tmp_path: Path) -> None:
    out = tmp_path / "kv-rotation.json"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--tokens", "48", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for key in ("commit", "command", "preset", "weights", "head_dim", "layers", "mean_attn_out_rel_err",
                "mean_ratio_unrotated_over_rotated"):
        assert key in doc, key
    assert doc["weights"] == "random" and doc["hadamard_block"] == doc["head_dim"] == 32
    assert sorted(doc["layers"]) == ["1", "2", "3"]          # the tiny preset's sparse layers
    for row in doc["layers"].values():
        for name in ("nvfp4", "nvfp4_rotated"):
            for metric, val in row[name].items():
                assert 0.02 < val < 0.5, (name, metric, val)
    mean = doc["mean_attn_out_rel_err"]
    assert math.isclose(doc["mean_ratio_unrotated_over_rotated"], mean["nvfp4"] / mean["nvfp4_rotated"])


def test_a_preset_without_sparse_layers_is_refused(bench, monkeypatch) -> None:
    import m3serve.config as config
    base = config.PRESETS["tiny"]

    def dense_tiny():
        cfg = base()
        cfg.layer_types = ["full"] * cfg.num_hidden_layers
        return cfg

    monkeypatch.setitem(config.PRESETS, "tiny", dense_tiny)
    with pytest.raises(ValueError, match="no sparse"):
        bench.main(["--preset", "tiny", "--device", "cpu", "--tokens", "8"])
