"""Drafter training: the training-time-test forward equals the serving draft loop (through a real draft KV view),
the feature tap equals the serving capture, and a toy end-to-end run (train, save, load, measure AL) on CPU."""

from __future__ import annotations

import json
import random

import pytest
import torch

from m3serve.engine.speculative import speculative_engine
from m3serve.kv import BlockManager, KVCacheSpec, PagedKVCache
from m3serve.model.eagle3 import load_drafter, random_drafter
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.train import eagle3 as tr

T = 24


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


def test_feature_tap_equals_serving_capture(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (2, T), generator=g)
    layers = (1, 2, 4)                                  # 4 = the stream after the last layer (before the norm)
    tap = tr.FeatureTap(model, layers)
    with torch.no_grad():
        model.forward_train(x)
        tapped = {i: tap.out[i].clone() for i in layers}
        tap.close()
        for b in range(2):
            batch = ForwardBatch(x[b], torch.arange(T), [SeqSpan(0, T, T)], capture_layers=layers)
            model.hidden(batch)
            for i in layers:
                # fp32, batched training attention vs the per-sequence serving path: rounding-level differences
                torch.testing.assert_close(tapped[i][b], batch.captured[i], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.forward_train(x[:, :4])                       # closed taps record nothing further
    assert tap.out[1].shape[1] == T


def test_ttt_forward_equals_serving_draft_loop(model):
    d = random_drafter(model.cfg, seed=1, own_lm_head=True).attach_target(model)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 512, (T + 1,), generator=g)
    with torch.no_grad():
        batch = ForwardBatch(x[:T], torch.arange(T), [SeqSpan(0, T, T)], capture_layers=d.cfg.capture_layers)
        model.hidden(batch)
        fused = d.fuse([batch.captured[i] for i in d.cfg.capture_layers])
        steps = tr.ttt_logits(d, x[None], fused[None], 3)
        spec = KVCacheSpec.from_model_config(model.cfg, model_dtype=torch.float32, num_draft_layers=1,
                                             draft_num_kv_heads=d.cfg.num_key_value_heads)
        cache = PagedKVCache(spec, 8, "cpu")
        mgr = BlockManager(8, cache.page_size, max_seqs=1, max_blocks_per_seq=4)
        view = cache.draft_view(mgr)
        mgr.allocate(0, x.tolist())
        slots = torch.tensor(mgr.slot_ids(0))
        p_sz = cache.page_size

        def smap(pos):
            return slots[pos // p_sz] * p_sz + pos % p_sz

        for p in (0, 7, 15, T - 4):
            # serving: iteration 0 over positions 0..p from target features, then one token per step
            pos = torch.arange(p + 1)
            b0 = ForwardBatch(x[1:p + 2], pos, [SeqSpan(0, p + 1, p + 1, slots)], slot_mapping=smap(pos), kv=view)
            normed, r2 = d(b0, fused[:p + 1])
            got = [d.logits(normed[p:p + 1])[0]]
            h = r2[p:p + 1]
            for s in (1, 2):
                ps = torch.tensor([p + s])
                bs = ForwardBatch(x[p + s + 1:p + s + 2], ps, [SeqSpan(0, 1, p + s + 1, slots)], slot_mapping=smap(ps),
                                  kv=view)
                normed, h = d(bs, h)
                got.append(d.logits(normed)[0])
            for s in range(3):
                # fp32 both; paged per-sequence attention vs the dense masked TTT attention
                torch.testing.assert_close(steps[s][0, p], got[s], rtol=1e-4, atol=1e-4)


def test_ttt_loss_targets_and_agreement():
    g = torch.Generator().manual_seed(3)
    tl = torch.randn(2, 10, 7, generator=g)
    # a drafter that equals the target shifted by s + 1 agrees everywhere and pays exactly the target's entropy
    steps = [torch.cat([tl[:, s + 1:], tl[:, :s + 1]], 1) for s in range(3)]
    loss, ces, accs = tr.ttt_loss(steps, tl, 0.8)
    ent = [float(-(torch.softmax(tl[:, s + 1:], -1) * torch.log_softmax(tl[:, s + 1:], -1)).sum(-1).mean())
           for s in range(3)]
    assert accs == [1.0, 1.0, 1.0]
    assert ces == pytest.approx(ent, rel=1e-5)
    assert float(loss) == pytest.approx(sum(0.8 ** s * e for s, e in enumerate(ent)), rel=1e-5)
    assert tr.pick_capture_layers(60) == (2, 30, 57) and tr.pick_capture_layers(6) == (1, 3, 5)
    assert len(set(tr.pick_capture_layers(3))) == 3
    with pytest.raises(ValueError, match="ttt_steps"):
        tr.DrafterTrainConfig(ttt_steps=2).validate()


# ---------------------------------------------------------------------- toy end-to-end
WORDS = ("the king and queen of night go forth to see what light of day may bring unto this land where "
         "all men sing and weep for love is but a dream").split()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy target checkpoint with its own tokenizer (random weights) and a plain-text corpus directory."""
    from m3serve.model.checkpoint import save_checkpoint
    from m3serve.model.m3 import M3ForCausalLM
    from m3serve.train.presets import model_config
    from m3serve.train.tokenizer import save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("toy")
    data = root / "data"
    data.mkdir()
    rnd = random.Random(0)
    texts = []
    for i in range(24):
        lines = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 10))).capitalize() + "."
                 for _ in range(40)]
        texts.append("\n".join(lines) + "\n")
        (data / f"work{i:02d}.txt").write_text(texts[-1])
    target = root / "target"
    tok = train_tokenizer(texts, 320)
    cfg = model_config("toy", tok.get_vocab_size())
    save_tokenizer(tok, target, cfg.max_position_embeddings)
    net = M3ForCausalLM(cfg)
    net.init_random(0)
    save_checkpoint(net, cfg, str(target), layout="original")
    return target, data, root


def test_toy_training_run_and_acceptance_measurement(toy):
    target, data, root = toy
    out = root / "drafter"
    tc = tr.DrafterTrainConfig(steps=30, batch_size=4, seq_len=32, device="cpu", n_syn_train=60, n_syn_heldout=4,
                               log_every=1, lr=3e-3, warmup_steps=3)
    logs = []
    report = tr.train_drafter(target, data, out, tc, log=logs.append)
    curve = report["curve"]
    assert len(curve) == 30 and report["recipe"]["steps_run"] == 30 and report["recipe"]["ttt_steps"] == 3
    assert all(len(r["top1"]) == 3 for r in curve)
    first = sum(r["loss"] for r in curve[:5]) / 5
    last = sum(r["loss"] for r in curve[-5:]) / 5
    assert last < first                                # it learns (soft targets from the frozen target)
    assert report["heldout_text"]["offline_acceptance_length"] >= 1.0
    saved = json.loads((out / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == list(tr.pick_capture_layers(3)) == [2, 1, 0]
    tgt = load_model(str(target), dtype=torch.float32)
    d = load_drafter(str(out), tgt.cfg)
    assert d.lm_head is not None and d.embed_tokens is None
    eng = speculative_engine(tgt, tr_engine_config(), speculative_config={"method": "eagle3", "model": str(out),
                                                                          "num_speculative_tokens": 3})
    assert eng.speculation.drafter.cfg.capture_layers == (2, 1, 0)
    res = tr.measure_acceptance(target, out, data, device="cpu", num_prompts=2, prompt_len=16, max_tokens=8,
                                sources=("text", "chat"), log=logs.append, target=tgt)
    for src in ("text", "chat"):
        for key in ("temperature_0.0", "temperature_0.8"):
            run = res["runs"][src][key]
            assert 1.0 <= run["acceptance_length"] <= 4.0 and run["spec_tokens_per_s"] > 0
        assert res["runs"][src]["temperature_0.0"]["greedy_identical_requests"] == 1.0    # fp32 CPU: exact
    # the CLI entry point (eval mode) prints the same measurement as JSON
    assert tr.main(["--eval", "--target", str(target), "--drafter", str(out), "--data", str(data), "--device",
                    "cpu", "--num-prompts", "1", "--prompt-len", "12", "--max-tokens", "4"]) == 0


def tr_engine_config():
    from m3serve.engine.engine import EngineConfig
    return EngineConfig(kv_cache_bytes=4 << 20)
