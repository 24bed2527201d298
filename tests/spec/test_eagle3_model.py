"""The Eagle3 drafter against an independent fp32 reference; checkpoint names, configs and errors; the d2t map;
MHA and d2t drafters in the engine stay exact."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from m3serve.config import preset
from m3serve.engine.engine import EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import speculative_engine
from m3serve.model.eagle3 import (Eagle3Config, canonical_name, default_capture_layers,
                                  drafter_from_tensors, load_drafter, random_drafter, save_drafter)
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from tests.spec.specutil import plain_outputs, prompts, spec_cfg

TINY = preset("tiny")


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


def _reference(sd: dict, cfg: Eagle3Config, states: list, emb: torch.Tensor, head: torch.Tensor):
    """Eagle3 layer from the state dict with plain torch ops: returns (logits [T, V], pre-norm output [T, H])."""
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    t, d, hq, hk = emb.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    fused = torch.cat([rms(s, sd[f"fc_norm.{i}.weight"]) for i, s in enumerate(states)], -1) @ sd["fc.weight"].T
    x2 = torch.cat([rms(emb, sd["midlayer.input_layernorm.weight"]), rms(fused, sd["midlayer.hidden_norm.weight"])], -1)
    q = (x2 @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, hq, d)
    k = (x2 @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, hk, d)
    v = (x2 @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, hk, d)
    # Llama RoPE over the full head: pairs (i, i + d/2) rotated by pos * theta^(-2i/d)
    inv = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cos(ang).float()[:, None], torch.sin(ang).float()[:, None]

    def rope(x):
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("htl,lhd->thd", torch.softmax(s, -1), v).reshape(t, hq * d)
    r1 = fused + o @ sd["midlayer.self_attn.o_proj.weight"].T
    m = rms(r1, sd["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ sd["midlayer.mlp.gate_proj.weight"].T, m @ sd["midlayer.mlp.up_proj.weight"].T
    mlp = gate * torch.sigmoid(gate) * up
    r2 = r1 + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    return rms(r2, sd["norm.weight"]) @ head.T, r2


def test_drafter_matches_independent_reference(model):
    d = random_drafter(TINY, seed=3, own_lm_head=True).attach_target(model)
    g = torch.Generator().manual_seed(0)
    t = 23
    ids = torch.randint(0, TINY.vocab_size, (t,), generator=g)
    states = [torch.randn(t, TINY.hidden_size, generator=g) * 3 for _ in range(3)]
    with torch.no_grad():
        fused = d.fuse(states)
        normed, r2 = d(ForwardBatch(ids, torch.arange(t), [SeqSpan(0, t, t)]), fused)
        logits = d.logits(normed)
        sd = {k: v.float() for k, v in d.state_dict().items()}
        ref_logits, ref_r2 = _reference(sd, d.cfg, states, model.embed.weight[ids], sd["lm_head.weight"])
    # fp32 both sides, different op order (fused projections vs explicit einsums): a few ulps of O(1) values
    torch.testing.assert_close(r2, ref_r2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_capture_layer_convention_and_defaults():
    assert default_capture_layers(60) == (2, 30, 57)              # Inferact card's aux ids for M3
    assert default_capture_layers(4) == (2, 2, 1)
    cfg = Eagle3Config.for_target(preset("minimax-m3"))
    assert cfg.capture_layers == (2, 30, 57) and cfg.num_key_value_heads == 4 and cfg.head_dim == 128
    with pytest.raises(ValueError, match="capture_layers"):
        Eagle3Config.for_target(TINY, capture_layers=(0, 2, 5)).check_target(TINY)


def test_names_and_layouts(tmp_path, model):
    d = random_drafter(TINY, seed=4, own_lm_head=True)
    sd = d.state_dict()
    assert canonical_name("model.layers.0.self_attn.q_proj.weight") == "midlayer.self_attn.q_proj.weight"
    assert canonical_name("midlayer.hidden_norm.weight") == "midlayer.hidden_norm.weight"
    assert canonical_name("t2d") is None
    for bad in ("layers.1.self_attn.q_proj.weight", "fc.bias", "midlayer.self_attn.q_proj.weight_scale"):
        with pytest.raises(ValueError, match="checkpoint tensor"):
            canonical_name(bad)
    # the speculators layout (layers.0., model. prefix) + its config form load to the same drafter
    alt = {("model." + k.replace("midlayer.", "layers.0.")): v.to(torch.bfloat16) for k, v in sd.items()}
    alt["t2d"] = torch.ones(TINY.vocab_size, dtype=torch.bool)
    save_file(alt, str(tmp_path / "model.safetensors"))
    c = d.cfg
    cfgd = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": list(c.capture_layers),
            "transformer_layer_config": {"hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
                                         "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                                         "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
                                         "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                                         "num_hidden_layers": 1}}
    (tmp_path / "config.json").write_text(json.dumps(cfgd))
    loaded = load_drafter(str(tmp_path), TINY)
    assert loaded.cfg.fc_norm is True and loaded.lm_head is not None and loaded.embed_tokens is None
    for k, v in sd.items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16).float()), k
    # our own save/load round trip (midlayer. layout, flat config)
    save_drafter(loaded, str(tmp_path / "ours"))
    again = load_drafter(str(tmp_path / "ours"), TINY)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in loaded.state_dict().items())
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == \
        list(c.capture_layers)


def test_checkpoint_errors():
    d = random_drafter(TINY, seed=5)
    sd = {k: v.clone() for k, v in d.state_dict().items()}
    cfg = lambda: Eagle3Config.for_target(TINY)  # noqa: E731
    missing = dict(sd)
    del missing["midlayer.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing tensors.*up_proj"):
        drafter_from_tensors(cfg(), missing)
    wrong = dict(sd, **{"fc.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="fc.weight: expected shape"):
        drafter_from_tensors(cfg(), wrong)
    quant = dict(sd, **{"fc.weight": sd["fc.weight"].to(torch.float8_e4m3fn)})
    with pytest.raises(TypeError, match="fc.weight: expected dense"):
        drafter_from_tensors(cfg(), quant)
    mixed = dict(sd, **{"layers.0.hidden_norm.weight": sd["midlayer.hidden_norm.weight"]})
    with pytest.raises(ValueError, match="given twice"):
        drafter_from_tensors(cfg(), mixed)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        Eagle3Config.from_dict({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                "intermediate_size": 8, "vocab_size": 8, "eagle_aux_hidden_state_layer_ids": [1]})
    with pytest.raises(ValueError, match="vocab_size"):
        Eagle3Config.for_target(preset("minimax-m3")).check_target(TINY)


def test_d2t_maps_a_reduced_draft_vocabulary(model):
    vd = 100
    target_ids = torch.randperm(TINY.vocab_size, generator=torch.Generator().manual_seed(6))[:vd].sort().values
    base = random_drafter(TINY, seed=7)
    sd = {k: v for k, v in base.state_dict().items()}
    sd["lm_head.weight"] = 0.02 * torch.randn(vd, TINY.hidden_size, generator=torch.Generator().manual_seed(8))
    sd["d2t"] = target_ids - torch.arange(vd)                       # EAGLE convention: target = draft + d2t
    cfg = Eagle3Config.for_target(TINY)
    cfg.draft_vocab_size = vd
    d = drafter_from_tensors(cfg, sd)
    draft_ids = torch.tensor([0, 5, 99])
    assert torch.equal(d.to_target_ids(draft_ids), target_ids[draft_ids])
    probs = torch.softmax(torch.randn(2, vd), -1)
    full = d.to_target_probs(probs)
    assert full.shape == (2, TINY.vocab_size) and torch.equal(full[:, target_ids], probs)
    assert float(full.sum(-1).sub(1).abs().max()) < 1e-6
    bad = dict(sd, d2t=sd["d2t"] + TINY.vocab_size)
    with pytest.raises(ValueError, match="d2t"):
        drafter_from_tensors(cfg, bad)
    # in the engine: sampled and greedy requests, greedy stays exact
    ps = prompts(3, seed=9)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=1),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20), speculative_config=spec_cfg(3), drafter=d)
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    while eng.has_work():
        eng.step()
    ref = plain_outputs(model, ps, params)
    assert reqs[0].output_token_ids == ref[0] and reqs[2].output_token_ids == ref[2]
    assert eng.stats()["spec_decode"]["verify_steps"] > 0


def test_mha_drafter_exact_in_engine(model):
    # The MHA head (num_key_value_heads = num_attention_heads) has its own draft KV width in the shared cache.
    d = random_drafter(TINY, seed=10, num_key_value_heads=TINY.num_attention_heads)
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20), speculative_config=spec_cfg(2), drafter=d)
    assert eng.kv.spec.kv_heads(eng.kv.draft_layer) == TINY.num_attention_heads
    ps = prompts(3, seed=11)
    params = [SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True)] * 3
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    while eng.has_work():
        eng.step()
    assert [r.output_token_ids for r in reqs] == plain_outputs(model, ps, params)
