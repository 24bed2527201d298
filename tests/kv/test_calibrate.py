"""NVFP4 KV-cache calibration (m3serve.kv.calibrate) and the scales' paths into LLM.

Tolerances, and why:
- nvfp4_roundtrip_mse vs the independent fp32 reference below: rel 1e-5. Both sum the same fp32 squared
  errors; only the reduction order differs (the element values match exactly on random, tie-free inputs).
- collect_kv vs what the serving forward writes to its cache: atol 1e-5 on unit-scale K/V. Both are the
  fp32 stock model; the training forward ([1, T] batch) and the serving forward ([T] packed) may pick
  different matmul blockings, so sums differ by a few fp32 ulps.
- kv_global_scale after calibration: exact against m3serve.quant.nvfp4.nvfp4_global_scale (its own
  arithmetic is tested in tests/quant); rtol 1e-6 where the expectation is written as a plain division
  (torch's scalar / tensor is a reciprocal-multiply, 1 ulp off a correctly rounded quotient).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from m3serve.kv import PagedKVCache
from m3serve.kv.cache import DEFAULT_NVFP4_KV_AMAX
from m3serve.kv.calibrate import (
    REL_TOL, amax_grid, calibrate_kv, calibration_texts, choose_nvfp4_amax, collect_kv, heldout_questions,
    nvfp4_roundtrip_mse, save_kv_scales)
from m3serve.kv.scales import KV_SCALES_FILE, apply_kv_amax, checkpoint_kv_amax, load_kv_scales, read_kv_scales
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.model.qweight import CheckpointError
from m3serve.model.weights import SafetensorsSource, read_kv_cache_scales
from m3serve.quant.nvfp4 import nvfp4_global_scale
from tests.kv.kvutil import small_spec

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def reference_nvfp4_mse(x: torch.Tensor, amax: float) -> float:
    """Independent fp32 NVFP4 round trip: E4M3 block scale by torch's cast, nearest E2M1 magnitude by argmin."""
    gs = torch.tensor(448.0 * 6.0, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
    b = x.float().reshape(-1, 16)
    scale = ((b.abs().amax(-1, keepdim=True) / 6.0) * gs).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    y = (b * gs / scale).clamp(-6.0, 6.0)
    mag = E2M1_GRID[(y.abs().unsqueeze(-1) - E2M1_GRID).abs().argmin(-1)]
    deq = torch.where(scale > 0, torch.sign(y) * mag * scale / gs, torch.zeros_like(y))
    return float((deq - b).pow(2).mean())


def poisoned(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"))


# ----------------------------------------------------------------------------- the MSE and the search
@pytest.mark.parametrize("std,amax", [(1.0, 64.0), (1.0, 4.0), (3e-3, 64.0), (200.0, 64.0)])
def test_roundtrip_mse_matches_independent_reference(std, amax):
    g = torch.Generator().manual_seed(int(std * 1000) + int(amax))
    x = torch.randn(64, 2, 32, generator=g) * std
    assert math.isclose(nvfp4_roundtrip_mse(x, amax), reference_nvfp4_mse(x, amax), rel_tol=1e-5)


@pytest.mark.parametrize("std", [1e-4, 1.0, 300.0])
def test_choice_is_the_grid_minimum_and_the_largest_tie(std):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 2, 32, generator=g) * std
    x[5, 1, 3] = 8 * std                       # one outlier: clipping it must show up in the MSE
    c = choose_nvfp4_amax(x)
    grid = amax_grid(float(x.abs().max()))
    mses = [reference_nvfp4_mse(x, a) for a in grid]
    best = min(mses)
    assert c.amax in grid
    assert c.mse <= best * (1 + REL_TOL) * (1 + 1e-5)
    ties = [a for a, m in zip(grid, mses) if m <= best * (1 + REL_TOL) * (1 - 1e-5)]
    assert c.amax >= max(ties)
    assert c.observed_amax == float(x.abs().max())


def test_calibration_beats_the_default_where_the_default_is_wrong():
    g = torch.Generator().manual_seed(3)
    # Tiny values: at amax 64 their block scales fall into E4M3's subnormals (most round to 0).
    tiny = torch.randn(256, 2, 32, generator=g) * 1e-4
    c = choose_nvfp4_amax(tiny)
    assert c.mse / c.mean_square < 0.02 < nvfp4_roundtrip_mse(tiny, DEFAULT_NVFP4_KV_AMAX) / c.mean_square
    # Huge values: at amax 64 the block scales saturate at 448 and the values clip.
    huge = torch.randn(256, 2, 32, generator=g) * 300.0
    c = choose_nvfp4_amax(huge)
    assert c.mse / c.mean_square < 0.02 < nvfp4_roundtrip_mse(huge, DEFAULT_NVFP4_KV_AMAX) / c.mean_square


def test_search_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN or inf"):
        choose_nvfp4_amax(poisoned((4, 16)))
    with pytest.raises(ValueError, match="every calibration value is 0"):
        choose_nvfp4_amax(torch.zeros(4, 16))
    with pytest.raises(ValueError, match="empty"):
        choose_nvfp4_amax(torch.zeros(0, 16))
    with pytest.raises(TypeError, match="float tensor"):
        choose_nvfp4_amax(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="finite positive"):
        nvfp4_roundtrip_mse(torch.ones(4, 16), 0.0)


# ----------------------------------------------------------------------------- calibration text
def test_calibration_texts_are_deterministic_distinct_and_exclude_heldout():
    model_dir = os.path.join(os.path.dirname(__file__), "..", "..", "m3serve", "assets", "m3-tiny-verse")
    held = heldout_questions(model_dir)
    assert len(held) == 500
    texts = calibration_texts(64, seed=1, exclude_questions=held)
    assert texts == calibration_texts(64, seed=1, exclude_questions=held) and len(set(texts)) == 64
    for t in texts:
        question = t.split("<|user|>\n", 1)[1].split("<|eos|>", 1)[0]
        assert question not in held and "<|assistant|>\n" in t and "####" in t
    banned = {t.split("<|user|>\n", 1)[1].split("<|eos|>", 1)[0] for t in texts[:10]}
    assert not banned & {t.split("<|user|>\n", 1)[1].split("<|eos|>", 1)[0]
                         for t in calibration_texts(64, seed=1, exclude_questions=banned)}
    with pytest.raises(ValueError, match="num_items"):
        calibration_texts(0)


# ----------------------------------------------------------------------------- K/V capture
@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny", random_weights=True, dtype=torch.float32, seed=5)


class RecordingCache:
    """Stands in for the paged cache: records what the serving forward writes, returns it on read."""

    def __init__(self):
        self.written = {}

    def write(self, layer, slot_mapping, k, v, index_k=None):
        self.written[layer] = (k.clone(), v.clone(), None if index_k is None else index_k.clone())

    def read(self, layer, slots, length, dtype):
        k, v, ik = self.written[layer]
        return k[:length].to(dtype), v[:length].to(dtype), None if ik is None else ik[:length].to(dtype)


def test_collect_kv_matches_what_the_serving_forward_writes(tiny_model):
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, 500, (n,), generator=g) for n in (40, 23)]
    got = collect_kv(tiny_model, seqs)
    assert "project" not in vars(tiny_model.layers[0].attn)           # restored
    for i in range(len(tiny_model.layers)):
        assert got[i][0].shape == (63, 2, 32) and got[i][1].shape == (63, 2, 32)
    start = 0
    for ids in seqs:
        cache = RecordingCache()
        n = ids.numel()
        batch = ForwardBatch(ids, torch.arange(n), [SeqSpan(0, n, n, torch.zeros(1, dtype=torch.int64))],
                             slot_mapping=torch.arange(n), kv=cache)
        with torch.no_grad():
            tiny_model.hidden(batch)
        for i, (k, v, _) in cache.written.items():
            torch.testing.assert_close(got[i][0][start:start + n], k, atol=1e-5, rtol=0)
            torch.testing.assert_close(got[i][1][start:start + n], v, atol=1e-5, rtol=0)
        start += n


def test_collect_kv_restores_on_error_and_checks_input(tiny_model):
    with pytest.raises(TypeError, match=r"token_seqs\[1\]"):
        collect_kv(tiny_model, [torch.arange(3, 9), torch.arange(4, dtype=torch.int32)])
    assert all("project" not in vars(layer.attn) for layer in tiny_model.layers)
    with pytest.raises(ValueError, match="layers"):
        collect_kv(tiny_model, [torch.arange(3, 9)], layers=[4])
    with pytest.raises(ValueError, match="at least one"):
        collect_kv(tiny_model, [])
    bf16 = load_model("tiny", random_weights=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        collect_kv(bf16, [torch.arange(3, 9)])


class ByteTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [3 + (b % 500) for b in text.encode()]


def test_calibrate_kv_end_to_end_and_file_round_trip(tiny_model, tmp_path):
    calib = calibrate_kv(tiny_model, ByteTokenizer(), ["To be, or not to be:", "that is the question."],
                         layers=[1, 3], description={"text_set": "two lines"}, sensitivity=False)
    assert sorted(calib.layers) == [1, 3] and calib.calibration["tokens"] == 41
    path = str(tmp_path / KV_SCALES_FILE)
    save_kv_scales(path, calib)
    doc = json.load(open(path))
    assert doc["calibration"]["text_set"] == "two lines" and doc["default_amax"] == DEFAULT_NVFP4_KV_AMAX
    assert load_kv_scales(path, 4) == calib.amax_table()
    assert "fp8_layers" not in doc and read_kv_scales(path, 4).fp8_layers == ()       # not measured
    with pytest.raises(ValueError, match=r"layers: the FP8-override search needs every sparse layer \[1, 2, 3\]"):
        calibrate_kv(tiny_model, ByteTokenizer(), ["To be, or not to be:"], layers=[1, 3])
    for i, (k, v) in calib.layers.items():
        assert doc["layers"][str(i)]["k"]["rel_mse"] == k.mse / k.mean_square
        assert doc["layers"][str(i)]["v"]["observed_amax"] == v.observed_amax


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="other"), "'format'"),
    (lambda d: d.update(version=2), "'version'"),
    (lambda d: d.update(num_layers=5), "'num_layers': expected 4"),
    (lambda d: d.update(layers=[]), "'layers'"),
    (lambda d: d["layers"].update({"9": d["layers"]["1"]}), "layers key"),
    (lambda d: d["layers"]["1"]["k"].update(amax=-1.0), r"layers\[1\]\.k\.amax"),
    (lambda d: d["layers"]["1"].pop("v"), r"layers\[1\]\.v\.amax"),
])
def test_load_kv_scales_rejects_bad_files(tmp_path, mutate, match):
    doc = {"format": "m3serve.kv_scales", "version": 1, "num_layers": 4,
           "layers": {"1": {"k": {"amax": 3.0}, "v": {"amax": 2.0}}}}
    assert load_kv_scales(_write(tmp_path / "ok.json", doc), 4) == {1: (3.0, 2.0)}
    mutate(doc)
    with pytest.raises(ValueError, match=match):
        load_kv_scales(_write(tmp_path / "bad.json", doc), 4)


def _write(path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


# ----------------------------------------------------------------------------- applying to a cache
def test_apply_sets_only_nvfp4_layers_and_the_cache_uses_them():
    cache = PagedKVCache(small_spec("nvfp4", draft=1), 2, "cpu")          # sparse 1, 3 NVFP4; 0, 2, draft FP8
    applied = apply_kv_amax(cache, {0: (9.0, 9.0), 1: (5.0, 2.5), 3: (7.0, 1.0)})
    assert applied == [1, 3]
    amax = [[2688.0, 2688.0], [5.0, 2.5], [2688.0, 2688.0], [7.0, 1.0], [2688.0, 2688.0]]   # 2688: scale 1
    want = torch.stack([torch.stack([nvfp4_global_scale(a) for a in row]) for row in amax])
    torch.testing.assert_close(cache.kv_global_scale, want, atol=0, rtol=0)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(8, 2, 32, generator=g), torch.randn(8, 2, 32, generator=g)
    cache.write(1, torch.arange(8), k, v, torch.randn(8, 16, generator=g))
    out_k, out_v, _ = cache.read(1, torch.tensor([0]), 8, torch.float32)
    assert not torch.isnan(out_k).any()
    got = float((out_k - k).pow(2).mean())
    assert math.isclose(got, nvfp4_roundtrip_mse(k, 5.0), rel_tol=1e-5)
    with pytest.raises(ValueError, match=r"found none for \[3\]"):
        apply_kv_amax(cache, {1: (5.0, 2.5)})


# ----------------------------------------------------------------------------- checkpoint k_scale / v_scale
def _scales_dir(tmp_path, tensors: dict, quant: dict | None = None, hf_quant: dict | None = None) -> str:
    save_file({k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()},
              str(tmp_path / "scales.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant} if quant else {}))
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return str(tmp_path)


def test_checkpoint_scales_modelopt_nvfp4(tmp_path):
    p = "model.layers.{}.self_attn.{}_proj.{}_scale"
    d = _scales_dir(tmp_path, {p.format(1, "k", "k"): [0.01], p.format(1, "v", "v"): [0.02, 0.005]},
                    hf_quant={"quantization": {"kv_cache_quant_algo": "NVFP4"}})
    assert read_kv_cache_scales(SafetensorsSource(d)) == {1: {"k": pytest.approx(0.01), "v": pytest.approx(0.02)}}
    amax = checkpoint_kv_amax(d, 4)
    assert amax[1] == (pytest.approx(0.01 * 2688), pytest.approx(0.02 * 2688))


def test_checkpoint_scales_compressed_tensors_fp8_and_legacy(tmp_path):
    d = _scales_dir(tmp_path, {"model.layers.2.self_attn.k_scale": 0.5, "model.layers.2.self_attn.v_scale": 0.25,
                               "model.layers.3.self_attn.kv_scale": 1.0},
                    quant={"kv_cache_scheme": {"type": "float", "num_bits": 8}})
    assert checkpoint_kv_amax(d, 4) == {2: (224.0, 112.0), 3: (448.0, 448.0)}
    assert checkpoint_kv_amax(d, 3) == {2: (224.0, 112.0)}              # a pruned model keeps its layers


@pytest.mark.parametrize("tensors,err,match", [
    ({"model.layers.1.self_attn.k_scale": -1.0, "model.layers.1.self_attn.v_scale": 1.0}, CheckpointError,
     "finite positive"),
    ({"model.layers.1.self_attn.k_scale": 1.0, "model.layers.1.self_attn.k_proj.k_scale": 1.0}, CheckpointError,
     "a second k_scale"),
    ({"model.layers.1.self_attn.k_scale": 1.0}, ValueError, "both k_scale and v_scale"),
])
def test_checkpoint_scales_reject_bad_tensors(tmp_path, tensors, err, match):
    with pytest.raises(err, match=match):
        checkpoint_kv_amax(_scales_dir(tmp_path, tensors), 4)


# ----------------------------------------------------------------------------- LLM picks them up
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from m3serve.model.checkpoint import save_checkpoint
    d = tmp_path_factory.mktemp("ckpt")
    m = load_model("tiny", random_weights=True, dtype=torch.float32)
    save_checkpoint(m, m.cfg, str(d), layout="original", dtype=torch.float32)
    return d


def test_llm_applies_checkpoint_scales_then_kv_scales_json(tiny_checkpoint, tmp_path):
    from m3serve.llm import LLM
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in os.listdir(tiny_checkpoint):
        (d / f).write_bytes((tiny_checkpoint / f).read_bytes())
    save_file({f"language_model.model.layers.{i}.self_attn.{t}_proj.{t}_scale": torch.tensor(0.01 * (i + 1))
               for i in range(4) for t in "kv"}, str(d / "kv.safetensors"))
    kw = dict(device="cpu", kv_cache_dtype="nvfp4", kv_cache_bytes=1 << 20)
    llm = LLM(str(d), **kw)                                             # checkpoint scales, FP8 convention
    assert llm.kv_scales_source.endswith("k_scale/v_scale")
    torch.testing.assert_close(llm.engine.kv.kv_global_scale[2], torch.tensor(2688.0) / (torch.tensor([0.03] * 2) * 448),
                               atol=0, rtol=1e-6)
    assert llm.engine.kv.kv_global_scale[0].tolist() == [1.0, 1.0]       # dense layer: FP8, unscaled
    out = llm.generate({"prompt_token_ids": [1, 5, 9, 13]}, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) > 0
    doc = {"format": "m3serve.kv_scales", "version": 1, "num_layers": 4,
           "layers": {str(i): {"k": {"amax": 4.0}, "v": {"amax": 2.0}} for i in (1, 2, 3)}}
    (d / KV_SCALES_FILE).write_text(json.dumps(doc))
    llm = LLM(str(d), **kw)                                             # kv_scales.json wins
    assert llm.kv_scales_source == str(d / KV_SCALES_FILE)
    assert llm.engine.kv.kv_global_scale[3].tolist() == [672.0, 1344.0]
    llm = LLM(str(d), kv_scales=None, **kw)                             # explicitly uncalibrated
    assert llm.kv_scales_source is None
    assert llm.engine.kv.kv_global_scale[3].tolist() == [2688 / DEFAULT_NVFP4_KV_AMAX] * 2
    with pytest.raises(ValueError, match="kv_scales: expected an existing"):
        LLM(str(d), kv_scales=str(d / "missing.json"), **kw)
