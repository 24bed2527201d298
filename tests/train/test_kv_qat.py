from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from m3serve.kv import rotation
from m3serve.kv.calibrate import cache_roundtrip
from m3serve.model.m3 import M3ForCausalLM
from m3serve.quant.nvfp4 import nvfp4_global_scale
from m3serve.train.kv_qat import AMAX_HEADROOM, KVFakeQuant
from m3serve.train.loop import TrainConfig, train
from m3serve.train.presets import model_config

VERSES = [
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n",
    "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
    "Of Man's first disobedience, and the fruit\nOf that forbidden tree whose mortal taste\n",
]
TOY_RUN = dict(n_syn_train=300, n_syn_heldout=8, eval_items=2, heldout_windows=2, sample_tokens=4,
               max_new_tokens=6)


@pytest.mark.parametrize("seed", [31, None])
def test_fake_quant_forward_is_the_cache_roundtrip_and_backward_is_identity(seed) -> None:
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(2, 5, 3, 16, generator=gen) * 2.0).requires_grad_(True)
    v = torch.randn(2, 5, 3, 16, generator=gen).requires_grad_(True)
    fq = KVFakeQuant("nvfp4", [1], 16, seed)
    signs = None if seed is None else rotation.rotation_signs(16, seed)
    kq, vq = fq(1, k, v)
    for x, xq in ((k, kq), (v, vq)):
        basis = x.detach() if signs is None else rotation.rotate(x.detach(), signs)
        gs = nvfp4_global_scale(basis.abs().amax() * AMAX_HEADROOM)
        want = cache_roundtrip("nvfp4", x.detach(), gs, signs)
        torch.testing.assert_close(fq.roundtrip(x), want, rtol=0, atol=0)
        # x + (y - x) is y up to one fp32 rounding
        torch.testing.assert_close(xq.detach(), want, rtol=2e-7, atol=1e-7)
        assert not torch.equal(xq.detach(), x.detach())          # NVFP4 really rounded
    up_k, up_v = torch.randn_like(k), torch.randn_like(v)
    ((kq * up_k).sum() + (vq * up_v).sum()).backward()
    torch.testing.assert_close(k.grad, up_k, rtol=0, atol=0)      # straight-through
    torch.testing.assert_close(v.grad, up_v, rtol=0, atol=0)
    k2, v2 = fq(0, k, v)                                          # a layer not chosen passes through as is
    assert k2 is k and v2 is v


def test_fake_quant_rejects_an_unknown_format_and_an_empty_layer_set() -> None:
    with pytest.raises(ValueError, match="kv_qat: expected one of"):
        KVFakeQuant("int4", [1], 16, 31)
    with pytest.raises(ValueError, match="at least one layer"):
        KVFakeQuant("nvfp4", [], 16, 31)


def test_forward_train_applies_the_kv_transform_to_each_layer() -> None:
    cfg = model_config("toy", 64)
    model = M3ForCausalLM(cfg, device="cpu", dtype=torch.float32)
    model.init_random(0, nontrivial_norms=True)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    seen = []

    def identity(layer, k, v):
        seen.append((layer, tuple(k.shape), tuple(v.shape)))
        return k, v

    with torch.no_grad():
        plain, _ = model.forward_train(ids)
        same, _ = model.forward_train(ids, kv_transform=identity)
        quant, _ = model.forward_train(ids, kv_transform=KVFakeQuant("nvfp4", [1, 2], cfg.head_dim, 31))
    d, hk = cfg.head_dim, cfg.num_key_value_heads
    assert seen == [(i, (2, 24, hk, d), (2, 24, hk, d)) for i in range(cfg.num_hidden_layers)]
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    assert (quant - plain).abs().max() > 1e-4


def _write_corpus(root: Path) -> Path:
    root.mkdir()
    for i, v in enumerate(VERSES):
        (root / f"work{i}.txt").write_text((v + VERSES[(i + 1) % len(VERSES)]) * 12)
    return root


def test_kv_qat_fine_tune_starts_from_the_checkpoint(tmp_path: Path) -> None:
    data = _write_corpus(tmp_path / "text")
    base = tmp_path / "base"
    train(TrainConfig(preset="toy", device="cpu", steps=10, log_every=1, overrides=TOY_RUN), data, base,
          log=lambda s: None)
    base_report = json.loads((base / "train_report.json").read_text())
    tuned = tmp_path / "tuned"
    report = train(TrainConfig(preset="toy", device="cpu", steps=3, log_every=1, lr=1e-3, init_from=str(base),
                               kv_qat="nvfp4", overrides=dict(TOY_RUN, warmup_steps=1)), data, tuned,
                   log=lambda s: None)
    rec = report["recipe"]
    assert rec["init_from"] == str(base) and rec["kv_qat"] == "nvfp4"
    assert rec["kv_qat_layers"] == [1, 2] and rec["kv_qat_rotation_seed"] == rotation.DEFAULT_ROTATION_SEED
    assert rec["dense_warmup_steps"] == 0
    # The fine-tune continues the base model: its first loss is the base's level, far below a fresh start's.
    first = report["train"]["curve"][0]["ce"]
    assert first < base_report["train"]["curve"][0]["ce"] - 0.5
    assert abs(first - base_report["train"]["curve"][-1]["ce"]) < 0.5
    for f in ("tokenizer.json", "synthetic_heldout.jsonl"):
        assert (tuned / f).read_text() == (base / f).read_text(), f
    name = "language_model.model.layers.1.self_attn.k_proj.weight"
    with safe_open(str(base / "model.safetensors"), "pt") as a, safe_open(str(tuned / "model.safetensors"), "pt") as b:
        assert not torch.equal(a.get_tensor(name), b.get_tensor(name))   # trained
    assert report["run"]["command"] and report["run"]["commit"]


def test_train_config_rejects_a_bad_kv_qat_and_init_from(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_qat: expected one of"):
        TrainConfig(preset="toy", kv_qat="fp8").resolve()
    with pytest.raises(ValueError, match="init_from: expected a checkpoint directory"):
        TrainConfig(preset="toy", init_from=str(tmp_path)).resolve()
