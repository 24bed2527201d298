"""The draft layer's KV lives in the shared cache and the DraftKVView is what the draft layer reads and writes:
call spying, content equal to a from-scratch recomputation, and poisoning of the view's pool."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.engine import EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import speculative_engine
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from tests.spec.specutil import cheat_engine, plain_outputs, prompts, spec_cfg


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


def _token_kv(eng, req, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [n, Hk, D] of `positions` read straight from the view's flat pool through its expanded table."""
    view = eng.runner.view
    _, sub = view.build([req.request_id])
    p = view.page_size
    ks = [view.pool[int(sub[0, 0, t // p]), :, t % p] for t in positions]
    vs = [view.pool[int(sub[0, 1, t // p]), :, t % p] for t in positions]
    return torch.stack(ks).float(), torch.stack(vs).float()


def test_draft_layer_reads_and_writes_only_through_the_view(model):
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20), speculative_config=spec_cfg(3))
    kv, view = eng.kv, eng.runner.view
    assert view.layer == kv.draft_layer == kv.spec.num_layers == model.cfg.num_hidden_layers
    assert view.cache is kv and view.manager is eng.blocks
    log = {"view_write": 0, "view_read": 0, "draft_write_outside": 0, "draft_read_outside": 0, "target_write": 0}
    inside = {"flag": False}
    kv_write, kv_read, v_write, v_read = kv.write, kv.read, view.write, view.read

    def spy_kv_write(layer, *a, **k):
        if layer == kv.draft_layer and not inside["flag"]:
            log["draft_write_outside"] += 1
        if layer != kv.draft_layer:
            log["target_write"] += 1
        return kv_write(layer, *a, **k)

    def spy_kv_read(layer, *a, **k):
        if layer == kv.draft_layer and not inside["flag"]:
            log["draft_read_outside"] += 1
        return kv_read(layer, *a, **k)

    def through(name, fn):
        def wrapped(*a, **k):
            log[name] += 1
            inside["flag"] = True
            try:
                return fn(*a, **k)
            finally:
                inside["flag"] = False
        return wrapped

    kv.write, kv.read = spy_kv_write, spy_kv_read
    view.write, view.read = through("view_write", v_write), through("view_read", v_read)
    ps = prompts(3, seed=20)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 3
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    assert all(r.is_finished for r in reqs)
    assert log["draft_write_outside"] == 0 and log["draft_read_outside"] == 0
    # one view write per draft-layer pass: iteration 0 plus K-1 single-token iterations per step that drafts
    assert log["view_write"] >= steps and log["view_read"] >= log["view_write"]
    assert log["target_write"] == steps * model.cfg.num_hidden_layers


def test_draft_kv_equals_recomputation_from_scratch(model):
    # After several steps with long accepted runs (the cheating drafter) and rejections, the draft KV of every
    # position below num_computed must be what the draft layer computes from (token p+1, fused target states
    # at p) in one whole-sequence pass: accepted positions were rewritten from target features.
    ps = prompts(3, 20, 40, seed=21)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    ref = plain_outputs(model, ps, params)
    eng = cheat_engine(model, ps, params, ref, k=3, corrupt_every=4)
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    for _ in range(6):
        eng.step()
    assert any(a > 0 for a in eng.speculation.accept_hist) and any(a < 3 for a in eng.speculation.accept_hist)
    d = eng.speculation.drafter
    with torch.no_grad():
        for r in reqs:
            assert not r.is_finished
            c = r.num_computed
            toks = torch.tensor(r.all_token_ids)
            batch = ForwardBatch(toks[:c], torch.arange(c), [SeqSpan(0, c, c)],
                                 capture_layers=tuple(d.cfg.capture_layers))
            model.hidden(batch)
            fused = d.fuse([batch.captured[i] for i in d.cfg.capture_layers])
            _, k_ref, v_ref, _ = d.midlayer.project(d.embed(toks[1:c + 1]), fused, torch.arange(c))
            k, v = _token_kv(eng, r, range(c))
            # fp32: the engine computed these in K+1-row steps, the reference in one pass; rounding differences
            # of ~1e-6 relative pass through 4 target layers, the fusion and the projections.
            torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4)


def test_view_pool_is_what_the_drafter_reads(model):
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=8 << 20), speculative_config=spec_cfg(3))
    seen = []
    logits = eng.speculation.drafter.logits
    eng.speculation.drafter.logits = lambda h: seen.append(bool(torch.isfinite(out := logits(h)).all())) or out
    ps = prompts(2, 20, 30, seed=22)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 2
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    for _ in range(3):
        eng.step()
    pool = eng.runner.view.pool
    p = eng.runner.view.page_size

    def poison(req, positions):
        _, sub = eng.runner.view.build([req.request_id])
        for t in positions:
            pool[int(sub[0, 0, t // p]), :, t % p] = float("nan")
            pool[int(sub[0, 1, t // p]), :, t % p] = float("nan")

    # 1. NaN everywhere the draft layer may not rely on: every position at or past num_computed of every
    #    allocated page. The draft loop rewrites those before it reads them, so nothing stays non-finite.
    for r in reqs:
        n_alloc = len(eng.blocks.slot_ids(r.request_id)) * p
        poison(r, range(r.num_computed, n_alloc))
    seen.clear()
    for _ in range(3):
        eng.step()
    assert seen and all(seen)
    # 2. NaN in the valid prefix of request 0: its drafts are computed from the pool, so they turn non-finite.
    poison(reqs[0], range(0, 4))
    seen.clear()
    eng.step()
    assert not all(seen)
