"""The engine / model runner seam (runtime/model_runner.py): the engine is host-only (a stand-in runner without
any model or tensor serves it, and an engine step then dispatches no aten op), the real runner packs and runs a
step on the tiny preset, and a runner that cannot process logits makes the engine refuse such requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from m3serve.config import preset
from m3serve.distributed.driver import StepBroadcast, TPDriverRunner
from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.model.loader import load_model
from m3serve.opcount import AtenOpCount
from m3serve.runtime.model_runner import ModelRunner

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


class HostRunner:
    """The runner interface the engine uses, with no device: a 'step' is the packed token ids, a token is a
    function of the request's context length, so the outputs are known in advance."""

    processes_logits = False
    graphs = None
    graphs_version = 0

    def __init__(self, page_size: int = 16, num_slots: int = 32):
        self.kv = SimpleNamespace(page_size=page_size, num_slots=num_slots)
        self.steps: list[list[list[int]]] = []      # per step: each chunk's token ids

    def bind_tables(self, blocks) -> None:
        self.blocks = blocks

    def fault(self):
        return None

    def build_batch(self, chunks):
        return [c.request.all_token_ids[c.request.num_computed:c.request.num_computed + c.num_tokens]
                for c in chunks]

    def run(self, batch, reqs, prompt_plan=None, processing=None):
        assert prompt_plan is None and processing is None
        self.steps.append(batch)
        return [100 + r.num_tokens for r in reqs], None


def _host_engine(**kw) -> tuple[LLMEngine, HostRunner]:
    model = SimpleNamespace(cfg=preset("tiny"), device=torch.device("cpu"))    # a config, no weights, no forward
    runner = HostRunner()
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16)
    cfg.update(kw)
    return LLMEngine(model, EngineConfig(**cfg), runner=runner), runner


def test_the_engine_steps_on_a_host_only_runner():
    eng, runner = _host_engine()
    a = eng.add_request(list(range(5, 25)), GREEDY)       # 20 tokens: two prefill chunks under a 16-token budget
    b = eng.add_request([7, 8, 9], GREEDY)
    while eng.has_work():
        eng.step()
    assert a.output_token_ids == [120, 121, 122, 123, 124] and b.output_token_ids == [103, 104, 105, 106, 107]
    assert a.finish_reason == b.finish_reason == "length"
    # chunked prefill and decode rows came through build_batch / run: first the 16-token budget, then the rest
    assert runner.steps[0] == [list(range(5, 21))] and [7, 8, 9] in runner.steps[1]
    assert eng.blocks.num_free_slots() == runner.kv.num_slots     # every page came back
    assert eng.runner.blocks is eng.blocks                        # the runner's tables follow the engine's allocator


def test_an_engine_step_dispatches_no_aten_op():
    """Host-only: with the device side stubbed out, scheduling, appending, stop checks and page commits run no
    tensor op at all (a device op would show up as an aten dispatch)."""
    eng, _ = _host_engine()
    for p in ([5, 6, 7, 8], [9, 10, 11]):
        eng.add_request(p, GREEDY)
    with AtenOpCount() as ops:
        steps = 0
        while eng.has_work():
            eng.step()
            steps += 1
    assert steps >= 5 and ops.n == 0


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=3)


def test_the_real_runner_packs_and_runs_a_step(model):
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=64))
    assert isinstance(eng.runner, ModelRunner) and eng.kv is eng.runner.kv and eng.runner.processes_logits
    prompts = [[5, 17, 99, 230, 7], [44, 3, 8]]
    for p in prompts:
        eng.add_request(p, GREEDY)
    chunks = eng.scheduler.schedule()
    batch = eng.runner.build_batch(chunks)
    assert batch.input_ids.tolist() == prompts[0] + prompts[1]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.logits_rows.tolist() == [4, 7]                   # the last row of each prompt is sampled
    assert [(s.start, s.num_query, s.seq_len) for s in batch.seqs] == [(0, 5, 5), (5, 3, 3)]
    reqs = [c.request for c in chunks]
    tokens, lp = eng.runner.run(batch, reqs)
    with torch.inference_mode():
        again = model(batch).argmax(-1).tolist()                  # the same step re-run: same K/V, same logits
    assert tokens == again and lp is None
    # the engine's own step on a fresh engine chooses the same first tokens
    fresh = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=64))
    got = [fresh.add_request(p, GREEDY) for p in prompts]
    fresh.step()
    assert [r.output_token_ids for r in got] == [[t] for t in tokens]


def test_on_the_target_the_runner_packs_the_paged_kernels_metadata(model):
    """With target attention on (what enable_target sets), build_batch stages [query starts | lengths] in the same
    upload and hands the batch a PagedStep from the runner's PagedPlan (no per-sequence spans); before, none."""
    from m3serve.runtime.step_inputs import PagedPlan, split_plan
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=64))
    runner = eng.runner
    assert runner.paged_plan() is None
    runner.target_attention = True
    cfg = model.cfg
    assert runner.paged_plan() == PagedPlan(runner.kv.spec.num_kv_heads, cfg.index_topk_blocks, runner.sparse_tiles)
    prompts = [[5, 17, 99, 230, 7], [44, 3, 8]]
    for p in prompts:
        eng.add_request(p, GREEDY)
    batch = runner.build_batch(eng.scheduler.schedule())
    st = batch.step
    assert batch.seqs == [] and st.query_start.tolist() == [0, 5, 8] and st.seq_lens.tolist() == [5, 3]
    assert st.max_query_len == 5 and st.slot_table.shape[0] == 2
    plan = runner.paged_plan()
    assert (st.num_splits, st.num_splits_sparse) == split_plan(8, runner.tables.max_blocks, plan.kv_heads, plan.topk,
                                                               plan.sparse_tiles)


def test_the_engine_hands_the_runner_its_logits_processing(model):
    """Penalty-state rows are assigned by the engine (per request) and applied by the runner: a biased request's
    step carries its row, a plain batch none; the bias decides the token."""
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4))
    seen = []
    run = eng.runner.run

    def recording(batch, reqs, prompt_plan=None, processing=None):
        seen.append(processing)
        return run(batch, reqs, prompt_plan, processing)

    eng.runner.run = recording
    plain = eng.add_request([5, 6, 7], GREEDY)
    eng.step()
    biased = eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, logit_bias={11: 100.0}))
    eng.step()
    assert seen[0] is None and seen[1] is not None and seen[1].masks is None
    assert seen[1].penalties is eng.penalties
    assert seen[1].rows.tolist() == eng.penalties.row_ids_for([plain, biased])   # decode row first, then prefill
    assert biased.output_token_ids == [11]


def test_the_real_runner_owns_the_target_switch(model):
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20))
    with pytest.raises(ValueError, match="needs a bf16 model on CUDA at TP 1"):
        eng.enable_target()
    assert eng.runner.graphs is None and not eng.runner.target_attention


def test_a_runner_without_logits_processing_makes_the_engine_refuse_it(model):
    """Rank 0's tensor-parallel runner samples without penalties or prompt logprobs; the engine asks its runner
    (no broadcast happens: the request is refused before it is queued)."""
    cfg = EngineConfig(kv_cache_bytes=1 << 20)
    eng = LLMEngine(model, cfg, runner=TPDriverRunner(model, cfg, StepBroadcast(ctx=None)))
    with pytest.raises(ValueError, match=r"SamplingParams.presence_penalty .*TPDriverRunner"):
        eng.add_request([5, 6, 7], SamplingParams(presence_penalty=0.5))
    assert not eng.has_work() and not eng.requests
