from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.moe import MoE
from m3serve.train.loop import RouterBalancer, TrainConfig, lr_at, prepare_for_training, train
from m3serve.train.presets import RUN_PRESETS, estimate_weight_bytes, model_config

VERSES = [
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n",
    "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n",
    "Sometime too hot the eye of heaven shines,\nAnd often is his gold complexion dimm'd;\n",
    "Of Man's first disobedience, and the fruit\nOf that forbidden tree whose mortal taste\n",
    "Brought death into the World, and all our woe,\nWith loss of Eden, till one greater Man\n",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
]


def test_lr_schedule() -> None:
    lrs = [lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # monotone decay after warm-up
    assert lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_router_balancer_pushes_toward_equal_load() -> None:
    cfg = model_config("toy", 64)
    model = M3ForCausalLM(cfg, device="cpu", dtype=torch.float32)
    model.init_random(0)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    with torch.no_grad():
        moe.router.zero_()
        moe.router[0].fill_(0.5)  # expert 0 wins every token with a positive hidden-state sum
    bal = RouterBalancer(model, rate=0.01)
    bal.active = True
    x = torch.randn(50, cfg.hidden_size).abs()
    moe(x)
    ratios = bal.update()
    bias = moe.e_score_correction_bias.detach()
    assert ratios[0] > 1.5                       # overloaded before the update
    assert float(bias[0]) == pytest.approx(-0.01)  # the busiest expert is pushed down ...
    assert (bias[1:] != 0).all()                 # ... every other one moves too (sign step)
    bal.close()


def test_prepare_for_training_freezes_only_the_selection_bias() -> None:
    model = M3ForCausalLM(model_config("toy", 64), device="cpu", dtype=torch.float32)
    model.init_random(0)
    groups = prepare_for_training(model)
    trainable = {id(p) for g in groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in trainable) == (not name.endswith("e_score_correction_bias")), name
        assert p.requires_grad == (id(p) in trainable)
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and all(p.dim() < 2 for p in groups[1]["params"])


def test_shipped_preset_fits_16_mb() -> None:
    rp = RUN_PRESETS["m3-tiny-verse"]
    cfg = model_config("m3-tiny-verse", rp.vocab_size)
    # 400 kB left for the safetensors header, tokenizer (~250 kB), configs and the held-out task file.
    assert estimate_weight_bytes(cfg) + 400_000 <= 16_000_000
    assert cfg.layer_types[:2] == ["full", "full"] and set(cfg.layer_types[2:]) == {"sparse"}
    assert rp.seq_len > cfg.index_block_size * cfg.index_topk_blocks  # selection active during training


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Path]:
    data = tmp_path_factory.mktemp("text")
    for i, v in enumerate(VERSES):
        (data / f"work{i}.txt").write_text((v + VERSES[(i + 1) % 6]) * 12)
    out = tmp_path_factory.mktemp("ckpt")
    tc = TrainConfig(preset="toy", device="cpu", steps=14, log_every=1,
                     overrides=dict(n_syn_train=300, n_syn_heldout=8, eval_items=3, heldout_windows=2,
                                    sample_tokens=4, max_new_tokens=6))
    report = train(tc, data, out, log=lambda s: None)
    return out, report, data


def test_training_reduces_loss(trained) -> None:
    _, report, _ = trained
    curve = report["train"]["curve"]
    first, last = curve[0]["ce"], curve[-1]["ce"]
    # Initial CE ~ ln(V); 14 AdamW steps at lr 3e-3 on repetitive verse take it down by well over 0.5.
    vocab = report["model"]["config"]["text_config"]["vocab_size"]
    assert first == pytest.approx(math.log(vocab), abs=0.3)
    assert last < first - 0.5
    assert report["heldout"]["text_loss"] < first
    for key in ("captured_share", "random_share", "oracle_share"):
        assert 0.0 < report["indexer"][key] <= 1.0 + 1e-6
    assert report["synthetic_exact_match"]["n"] == 3
    assert len(report["samples"]) == 5
    assert report["checkpoint"]["within_limit"]


def test_checkpoint_layout_and_reload(trained) -> None:
    out, report, data = trained
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json", "synthetic_heldout.jsonl", "train_report.json"):
        assert (out / f).is_file(), f
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["model_type"] == "minimax_m3_vl"
    assert cfg_json["text_config"]["sparse_attention_config"]["sparse_block_size"] == 8
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("language_model.model.layers.1.self_attn.index_q_proj.weight").dtype == torch.bfloat16
        bias = f.get_tensor("language_model.model.layers.1.block_sparse_moe.e_score_correction_bias")
    assert "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight" in keys
    assert "language_model.lm_head.weight" in keys
    assert bias.abs().sum() > 0  # the balancer ran

    from m3serve.model.loader import load_model
    from m3serve.train import evaluate as ev
    from m3serve.train.data import load_corpus
    from m3serve.train.stream import TokenStream, encode_documents
    from m3serve.train.tokenizer import load_tokenizer

    model = load_model(str(out), device="cpu", dtype=torch.float32)
    tok = load_tokenizer(out)
    assert tok.eos_token_id == cfg_json["text_config"]["eos_token_id"]
    corpus = load_corpus(data)
    held = TokenStream(encode_documents(tok.backend_tokenizer, [d.text for d in corpus.heldout]))
    loss = ev.heldout_loss(model, held.fixed_windows(2, report["recipe"]["seq_len"]), 8)
    # Same checkpoint, same windows, same fp32 CPU math: equal up to summation order (1e-5).
    assert loss == pytest.approx(report["heldout"]["text_loss"], abs=1e-5)
