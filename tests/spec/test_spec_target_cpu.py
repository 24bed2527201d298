"""The speculative decode target's step program (m3serve.runtime.spec_graphs.SpecSteps, run eagerly: graphs=False)
on CPU under the Triton interpreter, against the eager speculative engine (stock attention, host verification):

- greedy: the same tokens as the eager engine (both are exact greedy decoding);
- forced acceptance (every accepted count 0..K occurs): the same tokens and the same per-position acceptance as
  the eager engine in forced mode. Forced outputs are the drafts themselves, so this checks that the device's
  draft passes (pass 1 over all K+1 verify rows, passes 2..K at positions that depend on the device's accepted
  count) propose exactly what the eager draft loop proposes, step after step.

tiny preset, random bf16 weights, a random drafter; the attention kernels differ from stock by summation order only
and at this size no argmax is near a tie (checked: the same tokens come out)."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import speculative_engine
from m3serve.model.loader import load_model
from m3serve.runtime.spec_graphs import SpecSteps
from m3serve.targets.attention import PAGED_KERNELS
from tests.spec.specutil import spec_cfg

PROMPTS = ([5, 17, 99, 230, 7, 44, 81, 12, 9, 300, 41, 200, 6], list(range(20, 58)))
MAX_TOKENS = (12, 9)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=2)


def _config() -> EngineConfig:
    return EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=128)


def _run(eng) -> tuple[list[list[int]], list]:
    reqs = [eng.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            for p, m in zip(PROMPTS, MAX_TOKENS)]
    while eng.has_work():
        eng.step()
    assert eng.blocks.num_free_slots() == eng.kv.num_slots      # every page came back
    return [list(r.output_token_ids) for r in reqs], reqs


def _spec(model, target: bool, **kw) -> LLMEngine:
    """The tiny preset's shapes lie outside the GPU-certified cells (enable_target would refuse them: see the last
    test), so the step program is attached directly; the interpreter runs the same kernels either way."""
    eng = speculative_engine(model, _config(), speculative_config=spec_cfg(3, **kw))
    if target:
        model.use_attention(PAGED_KERNELS)
        spec = eng.speculation
        spec.spec_steps = SpecSteps(model, spec.drafter, eng.runner.view, eng.runner.tables, 3, (1, 2), graphs=False)
    return eng


@pytest.fixture(scope="module")
def greedy_reference(model):
    return _run(_spec(model, False))[0]


# Slow tier (`pytest -m slow`): minutes each in the interpreter. The fast tier keeps the forced-acceptance run
# with the overlap loop, which drives the same step program through every accepted count.
@pytest.mark.slow
def test_greedy_equals_the_eager_engine(model, greedy_reference):
    """Both are exact greedy decoding (the eager engine's own tests compare it with plain greedy)."""
    ref = greedy_reference
    eng = _spec(model, True)
    got, _ = _run(eng)
    assert got == ref
    assert eng.speculation.graph_steps >= 3 and eng.speculation.spec_steps.replays == eng.speculation.graph_steps


@pytest.fixture(scope="module")
def forced_reference(model):
    """The eager engine, told (as the step program's engine decides) that a finished prompt proposes no drafts:
    its first decode step then verifies none, as the program's fresh row verifies stand-ins never forced in."""
    eager = _spec(model, False, forced_acceptance=3.5)
    eager.speculation._program_takes = lambda r: True     # its eager steps still run: it has no step program
    out, _ = _run(eager)
    return out, eager.stats()["spec_decode"]["accepted_per_position"]


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_forced_acceptance_proposes_what_the_eager_draft_loop_proposes(model, forced_reference, overlap):
    """overlap: each step is launched before the previous one is read back, its rows' n, x and drafts taken
    from the device."""
    ref, ref_per_pos = forced_reference
    eng = _spec(model, True, forced_acceptance=3.5)
    eng.overlap = overlap
    got, reqs = _run(eng)
    assert got == ref
    spec = eng.speculation
    assert spec.graph_steps >= 3 and (spec.overlapped_steps >= 2 if overlap else spec.overlapped_steps == 0)
    # the second prompt is prefilled in two chunks: its second chunk runs eagerly beside the first request's
    # decode, which keeps the step program
    assert eng.speculation.split_steps >= 1
    # each prompt's prefill proposed no drafts: its first decode step joined the program as a fresh row
    assert spec.fresh_rows == len(PROMPTS)
    per_pos = eng.stats()["spec_decode"]["accepted_per_position"]
    assert per_pos == ref_per_pos
    assert 0 < per_pos[-1] < per_pos[0]          # 2 and 3 = K drafts accepted both occurred


@pytest.mark.slow   # ~20 s of interpreter end to end: the fast tier keeps the forced-acceptance run
def test_arrival_while_a_step_is_in_flight(model, forced_reference):
    """A prompt arriving while the first request's step is in flight: the split step launches the decoding row,
    which reads the flight back, and there the first request finishes (max_tokens 2; the warm-up's shape): its
    chunk must not be taken for a prefill (it was, and the eager step got a row of 0 tokens). Both requests get
    the tokens they get when they arrive together (greedy, forced acceptance: the outputs depend on neither the
    batch nor the arrival step); no page leaks."""
    ref, _ = forced_reference
    eng = _spec(model, True, forced_acceptance=3.5)
    first = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng._inflight is None:
        eng.step()
    late = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert [list(first.output_token_ids), list(late.output_token_ids)] == [ref[0][:2], ref[1]]
    assert eng.speculation.split_steps >= 1
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


@pytest.mark.slow   # ~20 s of interpreter end to end: the fast tier keeps the forced-acceptance run
def test_abort_while_a_step_is_in_flight(model, forced_reference):
    """An aborted request's in-flight results are dropped; the other request is unaffected; no page leaks."""
    ref, _ = forced_reference
    eng = _spec(model, True, forced_acceptance=3.5)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            for p, m in zip(PROMPTS, MAX_TOKENS)]
    while eng._inflight is None:
        eng.step()
    eng.abort(reqs[1].request_id)
    while eng.has_work():
        eng.step()
    assert list(reqs[0].output_token_ids) == ref[0] and reqs[1].is_finished
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


def test_sampled_requests_take_the_eager_path_without_the_sampled_variant(model):
    eng = _spec(model, True)
    r = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0.8, seed=3))
    while eng.has_work():
        eng.step()
    assert len(r.output_token_ids) == 5 and eng.speculation.graph_steps == 0


def test_a_sampled_prompt_joins_the_sampled_variant_as_a_fresh_row(model):
    """Its prefill proposes no drafts (the eager step runs draft pass 1 only); its first decode step verifies K
    stand-ins with q one-hot (exact: tests/spec/test_verify.py) inside the sampled variant, not the eager path.
    (That the same seed draws the same tokens is the slow mixed test's.)"""
    eng = speculative_engine(model, _config(), speculative_config=spec_cfg(3))
    model.use_attention(PAGED_KERNELS)
    spec = eng.speculation
    spec.spec_steps = SpecSteps(model, spec.drafter, eng.runner.view, eng.runner.tables, 3, (1,), graphs=False,
                                sampling=True)
    eager = []
    spec._eager_step = lambda chunks, inner=spec._eager_step: eager.append(len(chunks)) or inner(chunks)
    r = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.9, top_k=40, seed=7, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert len(r.output_token_ids) == 4 and eager == [1]          # the prefill only
    assert spec.fresh_rows == 1 and spec.spec_steps.sampled_replays == spec.graph_steps >= 1
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


def _mixed(model, overlap: bool) -> tuple[list[list[int]], LLMEngine]:
    eng = speculative_engine(model, _config(), speculative_config=spec_cfg(3))
    model.use_attention(PAGED_KERNELS)
    spec = eng.speculation
    spec.spec_steps = SpecSteps(model, spec.drafter, eng.runner.view, eng.runner.tables, 3, (1, 2), graphs=False,
                                sampling=True)
    eng.overlap = overlap
    params = [SamplingParams(max_tokens=MAX_TOKENS[0], temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS[1] + 4, temperature=0.9, top_p=0.95, top_k=40, seed=5,
                             ignore_eos=True)]
    reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    while eng.has_work():
        eng.step()
    assert eng.blocks.num_free_slots() == eng.kv.num_slots
    return [list(r.output_token_ids) for r in reqs], eng


@pytest.mark.slow
def test_sampled_variant_keeps_greedy_rows_exact_and_is_reproducible(model, greedy_reference):
    """A greedy and a sampled request share SpecSteps' sampled variant: the greedy one's tokens equal the eager
    engine's greedy tokens (greedy rows reduce to the prefix rule exactly), the sampled one gets all its tokens,
    every step after the prefill runs on the target, and the same seed draws the same tokens with and without
    the overlap loop (keyed draws: nothing depends on step boundaries or launch order). That the sampled tokens
    follow the target's distribution is the keyed acceptance's chi-square test (tests/spec/test_verify.py) and
    the GPU test of the graphs."""
    (greedy, sampled), eng = _mixed(model, overlap=True)
    assert greedy == greedy_reference[0]
    assert len(sampled) == MAX_TOKENS[1] + 4
    # every step with both rows takes the sampled variant; a split step (the greedy row decoding beside the
    # sampled request's second prefill chunk) may hold greedy rows only
    spec = eng.speculation
    ss = spec.spec_steps
    assert ss.sampled_replays >= 2 and spec.graph_steps - spec.split_steps <= ss.sampled_replays <= spec.graph_steps
    assert ss.replays == spec.graph_steps
    assert spec.overlapped_steps >= 1
    assert _mixed(model, overlap=False)[0] == [greedy, sampled]


def test_require_raises_outside_the_certified_cells(model):
    eng = speculative_engine(model, _config(), speculative_config=spec_cfg(3))
    with pytest.raises(ValueError, match=r"route='require': speculative attention outside the certified cells"):
        eng.enable_target(graphs=False, buckets=(1,), mode="require")
    assert not eng.enable_target(graphs=False, buckets=(1,), mode="auto") and eng.speculation.spec_steps is None


def test_embedded_model_and_drafter_lie_in_certified_cells():
    """The embedded model with its trained drafter: every verify (K+1 rows) and draft-pass placement is certified,
    so `require` builds the step program (nothing runs here)."""
    from m3serve.llm import DEFAULT_MODEL_DIR
    import os
    m = load_model(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.bfloat16)
    eng = speculative_engine(m, EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=8, max_num_batched_tokens=64),
                             speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                                 "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3")})
    assert eng.enable_target(graphs=False, mode="require")
    assert eng.speculation.spec_steps.buckets == (1, 2, 4, 8) and eng.speculation.spec_steps.k == 3
    # max_num_seqs 64: speculative buckets reach it as the plain ones do (verify rows 64 x 4 = 256; modules past
    # their cells' rows run stock code inside the program)
    big = speculative_engine(m, EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=64),
                             speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                                 "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3")})
    assert big.enable_target(graphs=False, mode="require")
    assert big.speculation.spec_steps.buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    # without a batch-size policy (no plain decode target) the eager speculative steps still carry the paged
    # kernels' metadata: they ran the stock loop over sequences before
    always = speculative_engine(m, EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=8, max_num_batched_tokens=64),
                                speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                                    "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3"),
                                                    "disable_by_batch_size": None})
    assert always.enable_target(graphs=False, mode="require")
    assert always.runner.graphs is None and always.speculation._paged(draft=False) is not None
    assert always.speculation._paged(draft=True) is not None


def test_install_drafter_routes_exact_norms_and_joins_projections():
    """install_drafter: a Llama norm goes to norm.rms only when 1 + (w - 1) == w exactly in fp32 (a weight of
    2**-30 does not survive the shift: that norm stays stock); q|k|v and gate|up become one GEMM each, the
    Linears keep views of the joined weight, and the layer's output is unchanged (fp32: the same dot products)."""
    from m3serve.config import preset
    from m3serve.model.eagle3 import random_drafter
    from m3serve.targets.routing import install_drafter
    d = random_drafter(preset("tiny"), seed=3)
    d.norm.weight.data[5] = 2.0 ** -30
    layer = d.midlayer
    emb, hidden = torch.randn(5, d.cfg.hidden_size), torch.randn(5, d.cfg.hidden_size)
    pos = torch.arange(5)
    before = layer.project(emb, hidden, pos)
    mlp_before = layer.mlp(hidden)
    install_drafter(d, "auto")
    assert d.norm.kernel is None
    assert layer.input_layernorm.kernel is not None and torch.equal(
        1.0 + layer.input_layernorm.gemma_weight, layer.input_layernorm.weight.float())
    assert layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
    assert layer.self_attn.k_proj.weight.data_ptr() == layer.self_attn.qkv_weight[layer.self_attn.q_proj.out_features:].data_ptr()
    after = layer.project(emb, hidden, pos)
    for x, y in zip(before, after):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.mlp(hidden), mlp_before, rtol=1e-5, atol=1e-6)
    assert layer.self_attn.kernel is not None and layer.mlp.kernel is not None
    install_drafter(d, "off")
    assert all(getattr(m, "kernel", None) is None for m in d.modules())


@pytest.mark.slow   # ~20 s of interpreter end to end: the fast tier keeps the forced-acceptance run
def test_batch_size_policy_switches_between_the_step_program_and_plain_decode_graphs(model):
    """disable_by_batch_size=1 with SpecSteps for single requests and the plain overlap loop (the stand-in for the
    decode graphs) for two. A SpecSteps step is in flight when a request whose prompt is all in the prefix cache
    but its last token joins: that step holds two decoding rows, so it runs plainly and must read the flight
    back first (both in flight are different kinds: they share nothing on the device); when the first request
    finishes, the other speculates again (first the eager step: no drafts for its state, then SpecSteps). Both
    get exactly the eager engine's greedy tokens; no page leaks."""
    from m3serve.engine.speculative import _SpecFlight
    from tests.engine.test_overlap_loop import FakeGraphs

    eng = _spec(model, True, disable_by_batch_size=1)
    eng.runner.graphs = FakeGraphs(eng, buckets=(2, 4))
    cached = PROMPTS[1][:eng.kv.page_size + 1]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    ref_eng = _spec(model, False)
    ref = [ref_eng.add_request(p, sp) for p, sp in zip((PROMPTS[0], cached), params)]
    while ref_eng.has_work():
        ref_eng.step()
    ref = [list(r.output_token_ids) for r in ref]
    seen = []
    spec = eng.speculation
    plain_step = spec._plain_step
    spec._plain_step = lambda chunks: seen.append(isinstance(eng._inflight, _SpecFlight)) or plain_step(chunks)
    warm = eng.add_request(cached, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert warm.is_finished
    first = eng.add_request(PROMPTS[0], params[0])
    while not isinstance(eng._inflight, _SpecFlight):
        eng.step()
    late = eng.add_request(cached, params[1])
    while eng.has_work():
        eng.step()
    assert [list(first.output_token_ids), list(late.output_token_ids)] == ref
    assert seen[0] is True and eng.speculation.policy_plain_steps >= 3 and eng.runner.graphs.runs >= 3
    assert eng.stats()["spec_decode"]["policy_spec_steps"] >= 4 and eng.speculation.graph_steps >= 3
    assert eng.runner.graphs.pending_reads == 0 and eng._inflight is None
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


def test_rows_without_drafts_join_the_step_program_after_plain_steps(model, greedy_reference):
    """disable_by_batch_size = 1: while both requests decode, the policy runs plain steps (no drafts); when the
    second finishes, the first speculates again. It holds no drafts, so it joins the step program as a fresh row
    (K copies of its last token staged as stand-in drafts, verified greedily like any: it emits what plain greedy
    steps would and leaves with K drafts) instead of sending the step down the eager path. Greedy tokens equal
    the stock eager engine's; later program steps verify the new drafts; stats() reports both counts."""
    eng = _spec(model, True, disable_by_batch_size=1)
    got, _ = _run(eng)
    assert got == greedy_reference
    spec = eng.speculation
    assert spec.policy_plain_steps >= 3 and spec.fresh_rows >= 1
    assert spec.graph_steps > spec.fresh_rows            # the fresh row's next steps verified its new drafts
    st = eng.stats()["spec_decode"]
    assert st["verify_steps"] > 0
    assert (st["program_steps"], st["fresh_rows"]) == (spec.graph_steps, spec.fresh_rows)


# Slow tier: ~1 min of interpreter; the fast tier checks the packed metadata itself (test_spec_batch.py, paged_plan).
@pytest.mark.slow
@pytest.mark.parametrize("forced", [None, 3.5])
def test_eager_steps_on_the_target_run_the_kernels_and_equal_the_stock_loop(model, monkeypatch, forced):
    """On the decode target the eager speculative step (prefill chunks, a request's first step after plain steps)
    packs its verify and draft batches with the paged-cache kernels' metadata (the runner's PagedPlan), so every
    attention layer and the draft layer run as the kernels instead of the stock loop over sequences (a dozen
    small launches per sequence and layer: 0.7 s for 64 prompts on the H200). No step program here, so every
    step is eager; the stock loop is made to fail, and the tokens equal the stock eager engine's: greedy (the
    target's path), and under forced acceptance, whose outputs are the drafts themselves (the draft layer's path:
    greedy outputs would stay exact even with wrong drafts). Two prompts prefilled together, then verify steps of
    K + 1 rows (the interpreter keeps this short)."""
    from m3serve.model.attention_backend import StockAttention
    kw = {} if forced is None else {"forced_acceptance": forced}

    def run(eng):
        reqs = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
                for p in (PROMPTS[0], PROMPTS[1][:21])]
        while eng.has_work():
            eng.step()
        assert eng.blocks.num_free_slots() == eng.kv.num_slots
        return [list(r.output_token_ids) for r in reqs], eng.stats()["spec_decode"]["accepted_per_position"]

    ref, ref_per_pos = run(_spec(model, False, **kw))

    def stock(*a, **kw):
        raise AssertionError("the stock attention loop ran on the target's eager step")
    eng = speculative_engine(model, _config(), speculative_config=spec_cfg(3, **kw))
    model.use_attention(PAGED_KERNELS)
    eng.runner.target_attention = True      # what ModelRunner.enable_target sets (the tiny shapes are uncertified)
    monkeypatch.setattr(StockAttention, "layer", stock)
    monkeypatch.setattr(StockAttention, "draft_layer", stock)
    got, per_pos = run(eng)
    monkeypatch.undo()
    assert got == ref and all(len(g) == 5 for g in got)
    assert per_pos == ref_per_pos
    assert eng.speculation.graph_steps == 0 and eng.stats()["spec_decode"]["verify_steps"] > 0
    if forced is not None:
        assert sum(per_pos) > 0                  # drafts were accepted: the outputs hold drafted tokens


@pytest.mark.slow   # ~1 min of interpreter end to end
def test_eager_speculative_steps_replay_the_prefill_programs(model, greedy_reference):
    """The eager speculative step's target forward (prefills, a prompt's second chunk beside a decoding row) runs
    the runner's padded prefill programs, which also keep the drafter's layers: the same greedy tokens."""
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=48,
                                                 max_model_len=128, prefill_graph_tokens=64),
                             speculative_config=spec_cfg(3))
    model.use_attention(PAGED_KERNELS)
    spec = eng.speculation
    spec.spec_steps = SpecSteps(model, spec.drafter, eng.runner.view, eng.runner.tables, 3, (1, 2), graphs=False)
    eng.runner.target_attention = True
    eng.runner.enable_prefill_graphs("auto", graphs=False)
    pg = spec.spec_runner.prefill_graphs = eng.runner.prefill_graphs
    assert pg.capture_layers == spec.spec_runner.capture and pg.capture_layers
    got, _ = _run(eng)
    assert got == greedy_reference
    assert pg.replays >= 2
