"""bench/kv_smoothing.py on the CPU, on the embedded model with a few chats: the results file has every sparse
layer's errors for the four variants and its mean-component figures; smoothing is exact where the bench says
(attention ignores a per-channel shift of K, and a shift of V moves the output by the same vector), and it
lowers K's round-trip error, whose mean holds about a third of its energy. A few seconds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from m3serve.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "m3serve" / "assets" / "m3-tiny-verse"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv_smoothing", ROOT / "bench" / "kv_smoothing.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_kv_smoothing"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_embedded_model_few_chats_writes_every_sparse_layer(bench, tmp_path: Path) -> None:
    out = tmp_path / "kv-smoothing.json"
    assert bench.main(["--model", str(MODEL), "--calib-items", "12", "--items", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for key in ("commit", "command", "date", "calibration", "measured", "layers", "mean_attn_out_rel_err"):
        assert key in doc, key
    assert doc["measured"]["items"] == 3 and doc["calibration"]["items"] == 12
    assert sorted(doc["layers"]) == ["2", "3", "4", "5"]
    for row in doc["layers"].values():
        for name, _, _ in bench.VARIANTS:
            for metric in ("attn_out_rel_err", "k_rel_err", "v_rel_err"):
                assert 0.02 < row[name][metric] < 0.5, (name, metric, row[name][metric])
        assert row["nvfp4_smoothed_rotated"]["k_rel_err"] < row["nvfp4_rotated"]["k_rel_err"]
        assert 0.1 < row["mean_component"]["k"]["mean_energy_share"] < 0.6
        assert row["ratio_rotated_over_smoothed_rotated"] == pytest.approx(
            row["nvfp4_rotated"]["attn_out_rel_err"] / row["nvfp4_smoothed_rotated"]["attn_out_rel_err"])
    mean = doc["mean_attn_out_rel_err"]
    assert math.isclose(doc["mean_ratio_rotated_over_smoothed_rotated"],
                        mean["nvfp4_rotated"] / mean["nvfp4_smoothed_rotated"])


def test_attention_is_invariant_to_the_mean_shift_smoothing_relies_on(bench) -> None:
    model = load_model(str(MODEL), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    layer = 2                                   # sparse: 300 tokens > 8 blocks of 32, so MSA selection is active
    q, k, v, iq, ik = bench.capture(model, ids, [layer])[layer]
    attn = model.layers[layer].attn
    mu_k, mu_v = k.mean(0), v.mean(0)
    ref = bench.attention(attn, q, k, v, iq, ik)
    shifted = bench.attention(attn, q, k - mu_k, v - mu_v, iq, ik)
    hq, hk = q.shape[1], k.shape[1]
    mu_out = mu_v.repeat_interleave(hq // hk, dim=0)           # each query head reads its KV head's mean
    torch.testing.assert_close(shifted + mu_out, ref, rtol=1e-4, atol=1e-5)
