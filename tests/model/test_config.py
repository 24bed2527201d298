from __future__ import annotations

import json

import pytest

from m3serve.config import ConfigError, M3Config, preset
from tests.oracle import make_oracle


def test_presets():
    real = preset("minimax-m3")
    assert (real.hidden_size, real.num_hidden_layers, real.rotary_dim, real.index_topk_blocks) == (6144, 60, 64, 16)
    assert real.sparse_layers == tuple(range(3, 60))
    # the parameter count of the architecture doc (§1.4): 426.2B text parameters
    assert abs(real.num_parameters() / 1e9 - 426.2) < 0.3
    pruned = preset("minimax-m3:5")
    assert pruned.num_hidden_layers == 5 and pruned.layer_types == ["full"] * 3 + ["sparse"] * 2
    tiny = preset("tiny")
    assert tiny.index_block_size * tiny.index_topk_blocks < 100   # sparse selection within a few hundred tokens
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("minimax-m4")
    with pytest.raises(ConfigError, match="cannot keep 61"):
        preset("minimax-m3:61")


def test_published_and_text_forms_round_trip():
    cfg = preset("minimax-m3")
    assert M3Config.from_dict(cfg.to_published_dict()) == cfg
    assert M3Config.from_dict(json.loads(json.dumps(cfg.to_text_dict()))) == cfg


def test_transformers_written_config(tmp_path):
    m = make_oracle("b")
    m.config.save_pretrained(tmp_path)
    cfg = M3Config.from_file(str(tmp_path))
    assert cfg.rotary_dim == 4          # 16 * 0.25 from rope_parameters; the stale rotary_dim=64 is not read
    assert cfg.layer_types == ["sparse", "full", "sparse"] and cfg.mlp_layer_types == ["moe", "dense", "moe"]
    assert cfg.index_local_blocks == 2


def test_published_legacy_names():
    raw = preset("minimax-m3").to_published_dict()
    t = raw["text_config"]
    del t["partial_rotary_factor"]
    assert M3Config.from_dict(raw).rotary_dim == 64                     # rotary_dim is read in this form
    t["partial_rotary_factor"] = 1.0
    with pytest.raises(ConfigError, match="rotary_dim = 64 disagrees with partial_rotary_factor"):
        M3Config.from_dict(raw)


@pytest.mark.parametrize("field,value,match", [
    ("use_gemma_norm", False, "use_gemma_norm"),
    ("attention_output_gate", True, "attention_output_gate"),
    ("scoring_func", "softmax", "scoring_func"),
    ("hidden_act", "gelu", "hidden_act"),
    ("qk_norm_type", "per_layer", "qk_norm_type"),
])
def test_unsupported_fields_raise_naming_them(field, value, match):
    raw = preset("minimax-m3").to_published_dict()
    raw["text_config"][field] = value
    with pytest.raises(ConfigError, match=match):
        M3Config.from_dict(raw)


def test_inconsistent_fields_raise():
    raw = preset("minimax-m3").to_published_dict()
    raw["text_config"]["moe_layer_freq"] = [1] * 10
    with pytest.raises(ConfigError, match="mlp_layer_types has 10 entries but num_hidden_layers is 60"):
        M3Config.from_dict(raw)
    raw = preset("minimax-m3").to_published_dict()
    raw["text_config"]["sparse_attention_config"]["sparse_disable_index_value"][5] = 0
    with pytest.raises(ConfigError, match=r"sparse_disable_index_value\[5\]"):
        M3Config.from_dict(raw)
    raw = preset("minimax-m3").to_text_dict()
    raw["index_n_heads"] = 8
    with pytest.raises(ConfigError, match="index_n_heads"):
        M3Config.from_dict(raw)
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        M3Config.from_dict({"model_type": "llama"})
