"""The overlap loop's bookkeeping on CPU: a stand-in for the CUDA-graph runner that keeps each row's last token
"on the device" (the runner's contract: a staged id of -1 means "the token this request sampled in the previous
graph step") and computes the step with the stock model. The engine launches step n+1 before reading step n, so
tokens arrive one step late; every output must equal the synchronous engine's, through EOS, max_tokens,
preemption, aborts and new arrivals."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.model.loader import load_model
from m3serve.engine.sampler import sample_rows
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.runtime.decode_graphs import pack_decode, stage_offsets, staged_sampling


@dataclass
class _Launched:
    tokens: list[int]
    n: int
    logits: torch.Tensor | None = None


class FakeGraphs:
    """DecodeGraphs' interface (bucket_for / run / fetch_tokens / logits) over the stock model, eager, on CPU."""

    def __init__(self, engine: LLMEngine, buckets=(1, 2, 4, 8)):
        self.engine, self.buckets = engine, buckets
        self.sampling = True
        self.penalties = engine.penalties
        self.sampled_runs = self.processed_runs = self.logits_runs = 0
        self.device_tokens: dict[int, int] = {}     # request id -> token sampled in the last graph step
        self.runs = 0
        self.pending_reads = 0                       # launched steps whose tokens were not fetched yet

    def bucket_for(self, n):
        return next((b for b in self.buckets if b >= n), None)

    def run(self, seq_ids, token_ids, positions, sampling=None, penalty_rows=None, want_logits=False):
        eng = self.engine
        ids = [t if t >= 0 else self.device_tokens[s] for s, t in zip(seq_ids, token_ids)]
        pos = np.asarray(positions, dtype=np.int64)
        slot_table, _, slot_mapping = eng.runner.tables.prepare(seq_ids, np.arange(len(seq_ids)), pos)
        page = eng.kv.page_size
        spans = [SeqSpan(i, 1, int(p) + 1, slot_table[i, :-(-(int(p) + 1) // page)].long())
                 for i, p in enumerate(positions)]
        batch = ForwardBatch(torch.tensor(ids), torch.from_numpy(pos), spans, slot_mapping=slot_mapping, kv=eng.kv)
        with torch.inference_mode():
            logits = eng.model(batch)
        if sampling is None:
            tokens = logits.argmax(-1).tolist()
        else:   # what the sampling graph does: the staged payload, unpacked on the device, then sample_rows
            bucket = self.bucket_for(len(seq_ids))
            _, pos_b, extra = pack_decode(bucket, token_ids, positions, sampling, penalty_rows, self.penalties.neutral)
            stage = torch.zeros(4 * bucket + extra.shape[0], dtype=torch.int32)
            stage[3 * bucket:4 * bucket] = torch.from_numpy(pos_b)
            stage[4 * bucket:] = torch.from_numpy(extra)
            scores = torch.cat([logits, logits[:1].expand(bucket - len(seq_ids), -1)])
            if penalty_rows is not None:   # the processed variant: state rows from the payload, counted after
                prow = stage[stage_offsets(bucket)["penalty_row"]].long()
                scores = self.penalties.apply(scores, prow)
            tokens = sample_rows(scores, *staged_sampling(stage, bucket, logits.shape[1]))
            if penalty_rows is not None:
                self.penalties.record(prow, tokens)
                self.processed_runs += 1
            tokens = tokens[:len(seq_ids)].tolist()
            self.sampled_runs += 1
        for s, t in zip(seq_ids, tokens):
            self.device_tokens[s] = t
        self.runs += 1
        self.pending_reads += 1
        self.logits_runs += want_logits
        return _Launched(tokens, len(seq_ids), logits if want_logits else None)

    def fetch_tokens(self, launched):
        self.pending_reads -= 1
        return launched.tokens[:launched.n]

    def logits(self, launched):
        """As DecodeGraphs: only a step launched with want_logits has them (the greedy variant may write none)."""
        if launched.logits is None:
            raise AssertionError("logits read from a step launched without want_logits")
        self.pending_reads -= 1
        return launched.logits


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=5)


def _engine(model, graphs: bool, **kw):
    cfg = dict(kv_cache_bytes=1 << 20, max_num_seqs=8, max_num_batched_tokens=64)
    cfg.update(kw)
    eng = LLMEngine(model, EngineConfig(**cfg))
    if graphs:
        eng.runner.graphs = FakeGraphs(eng)
    return eng


def _drive(eng, prompts, params, abort_at=None, late=None):
    """Run to completion; returns {index: (tokens, finish_reason)}. abort_at: (step, index) aborts one request;
    late: (step, prompt, params) adds one request mid-run."""
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    step = 0
    while eng.has_work():
        if abort_at and step == abort_at[0]:
            eng.abort(reqs[abort_at[1]].request_id)
        if late and step == late[0]:
            reqs.append(eng.add_request(late[1], late[2]))
        eng.step()
        step += 1
        assert step < 2000
    return {i: (list(r.output_token_ids), r.finish_reason) for i, r in enumerate(reqs)}


def _assert_no_leak(eng):
    """Every page is obtainable again (free or an unreferenced prefix-cache page) and no sequence is live."""
    assert eng.blocks.live_seq_ids() == []
    assert eng.blocks.num_free_slots() == eng.kv.num_slots


def _prompts(rng, n, lo=3, hi=40, vocab=200):
    return [[int(t) for t in rng.integers(1, vocab, int(rng.integers(lo, hi)))] for _ in range(n)]


def test_overlapped_equals_synchronous(model):
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, 5)
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True) for m in (1, 7, 12, 3, 20)]
    ref = _drive(_engine(model, False), prompts, params)
    eng = _engine(model, True)
    got = _drive(eng, prompts, params)
    assert got == ref
    assert eng.runner.graphs.runs > 10 and eng.runner.graphs.pending_reads == 0 and eng._inflight is None
    assert all(r.pending == 0 for r in eng.requests.values())
    _assert_no_leak(eng)


def test_a_logprobs_request_asks_the_graph_step_for_its_logits(model):
    """A greedy request that wants logprobs is not decided by the graph: its step is launched with want_logits (the
    fused greedy variant writes none) and sampled from them; tokens and logprobs as the synchronous engine's."""
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, 3)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2) for _ in prompts]
    ref_eng = _engine(model, False)
    ref = _drive(ref_eng, prompts, params)
    eng = _engine(model, True)
    got = _drive(eng, prompts, params)
    assert got == ref
    assert eng.runner.graphs.logits_runs >= 5
    lp = [r.output_logprobs for r in eng.requests.values()]
    ref_lp = [r.output_logprobs for r in ref_eng.requests.values()]
    assert len(lp) == 3 and all(len(x) == 6 for x in lp)
    for a, b in zip(lp, ref_lp):
        for da, db in zip(a, b):
            assert da.keys() == db.keys() and all(abs(da[k] - db[k]) < 1e-4 for k in da)
    _assert_no_leak(eng)


def test_overlap_with_eos_stop_ids_abort_and_a_late_arrival(model):
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, 4)
    sync = _drive(_engine(model, False), prompts, [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 4)
    # a stop id that request 1 really produces mid-stream, so it finishes while its next step is in flight
    stop_tok = sync[1][0][9]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])] * 4
    late = (6, _prompts(rng, 1)[0], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    ref = _drive(_engine(model, False), prompts, params, abort_at=(5, 2), late=late)
    eng = _engine(model, True)
    got = _drive(eng, prompts, params, abort_at=(5, 2), late=late)
    assert got[1][1] == "stop" and got[1][0][-1] == stop_tok
    for i in (0, 1, 3, 4):
        assert got[i] == ref[i], i
    assert got[2][1] == "abort"
    # the aborted request's tokens may include the one step in flight when it was aborted
    assert got[2][0][:len(ref[2][0])] == ref[2][0] or ref[2][0][:len(got[2][0])] == got[2][0]
    _assert_no_leak(eng)


def test_overlap_under_page_pressure_preempts_and_recovers(model):
    """A cache of few pages forces preemption while steps are in flight; outputs still match."""
    rng = np.random.default_rng(2)
    prompts = _prompts(rng, 6, lo=20, hi=60)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 6
    small = dict(kv_cache_bytes=None)
    ref_eng = _engine(model, False, **small)
    pages = ref_eng.kv.num_slots
    budget = dict(kv_cache_bytes=int(ref_eng.kv.data.numel() * 14 / pages))   # ~14 pages
    ref_eng = _engine(model, False, **budget)
    ref = _drive(ref_eng, prompts, params)
    eng = _engine(model, True, **budget)
    got = _drive(eng, prompts, params)
    assert got == ref
    assert eng.scheduler.num_preemptions > 0, "the test needs preemption to happen"
    _assert_no_leak(eng)


def test_stopping_with_a_step_in_flight_then_drain_leaves_nothing_launched(model):
    """Drive only until every request is finished (as LLM.generate does): the overlap loop has already queued one
    more step for them. drain() reads it back, discards its tokens, and leaves the pages free; disable_graphs()
    then continues eagerly with the same outputs as a synchronous engine."""
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, 3)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3
    ref = _drive(_engine(model, False), prompts, params)
    eng = _engine(model, True)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while not all(r.is_finished for r in reqs):
        eng.step()
    assert eng._inflight is not None, "the test needs a step in flight after the last request finished"
    eng.drain()
    assert eng._inflight is None and eng.runner.graphs.pending_reads == 0
    assert [(list(r.output_token_ids), r.finish_reason) for r in reqs] == [ref[i] for i in range(3)]
    _assert_no_leak(eng)
    eng.disable_graphs()
    assert eng.runner.graphs is None
    again = _drive(eng, prompts, params)
    assert again == ref


def test_sampled_requests_overlap_and_draw_what_the_synchronous_engine_draws(model):
    """Seeded and unseeded temperature / top-k / top-p requests, mixed with greedy ones, run in the overlap loop
    on the graphs' sampling variant (its staged payload unpacked as on the device) and produce exactly the
    synchronous engine's tokens: the draws are keyed by (request key, token index), not by the path or batch."""
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, 5)
    params = [SamplingParams(max_tokens=14, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=1.1, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=1.0, top_p=0.7, seed=2 ** 40 + 3, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.6, top_k=5, top_p=0.9, ignore_eos=True)]
    ref = _drive(_engine(model, False), prompts, params)
    eng = _engine(model, True)
    got = _drive(eng, prompts, params)
    assert got == ref
    assert eng.runner.graphs.sampled_runs > 5 and eng._inflight is None
    _assert_no_leak(eng)


def test_penalised_requests_overlap_with_device_state_and_match_the_synchronous_engine(model):
    """Penalties, logit_bias and min_tokens (greedy and sampled rows, mixed with plain ones) run in the overlap
    loop on the processed variant: state rows staged per batch row, counts updated on the device, no host work
    per token; the tokens equal the synchronous engine's."""
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, 5)
    params = [SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, frequency_penalty=0.7, presence_penalty=0.4, seed=8,
                             ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.0, logit_bias={5: 4.0, 9: -100.0}, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=0.7, min_tokens=6, top_k=30)]
    ref = _drive(_engine(model, False), prompts, params)
    eng = _engine(model, True)
    got = _drive(eng, prompts, params)
    assert got == ref
    assert eng.runner.graphs.processed_runs > 5
    _assert_no_leak(eng)
