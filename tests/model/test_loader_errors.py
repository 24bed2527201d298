"""Bad checkpoints fail with errors that name the tensor, the expectation and what was found."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3serve.model.checkpoint import save_checkpoint
from m3serve.model.loader import load_model
from m3serve.model.qweight import CheckpointError


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    m = load_model("tiny", random_weights=True, dtype=torch.float32)
    d = tmp_path_factory.mktemp("good")
    save_checkpoint(m, m.cfg, str(d), layout="original", quantization="nvfp4", dtype=torch.bfloat16)
    return str(d)


def _mutate(good_dir, tmp_path, fn):
    t = load_file(os.path.join(good_dir, "model.safetensors"))
    fn(t)
    save_file(t, str(tmp_path / "model.safetensors"))
    with open(os.path.join(good_dir, "config.json")) as f, open(tmp_path / "config.json", "w") as g:
        g.write(f.read())
    return str(tmp_path)


def test_good_checkpoint_loads(good_dir):
    m = load_model(good_dir, dtype=torch.float32, keep_quantized=True)
    assert m.layers[1].mlp.w13.fmt == "nvfp4" and m.layers[0].attn.q_proj.fmt == "mxfp8"
    assert m.layers[1].attn.index_q_proj.fmt == "dense"       # the indexer is never quantized


P = "language_model.model.layers.1."


@pytest.mark.parametrize("mutation,match", [
    (lambda t: t.pop(P + "self_attn.q_norm.weight"), r"layers.1.attn.q_norm.weight"),
    (lambda t: t.pop(P + "block_sparse_moe.experts.3.w3.weight"), r"block_sparse_moe.experts.3.w3.weight: missing"),
    (lambda t: t.__setitem__(P + "self_attn.index_k_proj.weight", torch.zeros(8, 128)),
     r"index_k_proj.weight: expected shape \[32, 128\], found \[8, 128\]"),
    (lambda t: t.__setitem__(P + "block_sparse_moe.gate.weight", torch.zeros(8, 128, dtype=torch.int32)),
     r"gate.weight: expected a float tensor, found torch.int32"),
    (lambda t: t.__setitem__(P + "self_attn.q_proj.weight_scale_inv", torch.zeros(128, 3, dtype=torch.uint8)),
     r"q_proj.weight_scale_inv: 3 columns do not match in_features 128"),
    (lambda t: t.__setitem__(P + "block_sparse_moe.experts.0.w1.weight_scale_2", torch.tensor(-1.0)),
     r"experts.0.w1.weight_scale_2: per-tensor scale must be finite and positive"),
    (lambda t: t.__setitem__("language_model.model.layers.1.self_attn.mystery.weight", torch.zeros(2)),
     r"unknown checkpoint tensor 'language_model.model.layers.1.self_attn.mystery.weight'"),
    (lambda t: t.__setitem__(P + "self_attn.k_proj.weight", t[P + "self_attn.k_proj.weight"].to(torch.int8)),
     r"k_proj.weight has dtype torch.int8; expected bf16/fp16/fp32, float8_e4m3fn or uint8"),
])
def test_bad_checkpoints_name_the_tensor(good_dir, tmp_path, mutation, match):
    d = _mutate(good_dir, tmp_path, mutation)
    with pytest.raises(CheckpointError, match=match):
        load_model(d, dtype=torch.float32)


def test_skipped_names_and_no_pickle(good_dir, tmp_path):
    def add_vision(t):
        t["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"] = torch.zeros(2, 2)
        t["language_model.model.mtp.layers.0.eh_proj.weight"] = torch.zeros(2, 2)
    load_model(_mutate(good_dir, tmp_path, add_vision), dtype=torch.float32)   # skipped by name
    p = tmp_path / "pickled"
    p.mkdir()
    (p / "config.json").write_text(open(os.path.join(good_dir, "config.json")).read())
    torch.save({"x": torch.zeros(1)}, p / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle checkpoints are never loaded"):
        load_model(str(p), dtype=torch.float32)


def test_sharded_index_checkpoint(tmp_path):
    m = load_model("tiny", random_weights=True, dtype=torch.float32)
    save_checkpoint(m, m.cfg, str(tmp_path), layout="original", dtype=torch.float32, max_shard_bytes=200_000)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    m2 = load_model(str(tmp_path), dtype=torch.float32)
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
