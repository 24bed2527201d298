"""Eager steps as padded static-buffer programs (runtime/prefill_graphs.py), on CPU: the bucket rules, and the
program itself run eagerly under the Triton interpreter (graphs=False: the same padded forward a CUDA graph replays;
tests/runtime/test_prefill_graphs_gpu.py captures it).

tiny preset, random bf16 weights; the padded program runs the same kernels at the bucket's row count, so its logits
differ from the unpadded eager step's by summation order only and no greedy token here sits near a tie (checked:
the same tokens come out)."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.model.loader import load_model
from m3serve.runtime.prefill_graphs import PrefillGraphs, seq_buckets, token_buckets
from m3serve.targets.attention import PAGED_KERNELS

PROMPTS = ([5, 17, 99, 230, 7, 44, 81, 12, 9, 300, 41, 200, 6], list(range(60, 80)))


def test_bucket_sets():
    assert token_buckets(1024) == (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
    assert token_buckets(100) == (16, 32, 64, 100) and token_buckets(15) == ()
    assert token_buckets(8192)[-3:] == (1024, 1536, 2048)          # MAX_GRAPH_TOKENS
    assert seq_buckets(64) == (4, 16, 64) and seq_buckets(128) == (4, 16, 64, 128) and seq_buckets(2) == (2,)


class _Built(PrefillGraphs):
    """bucket_for over a given set of built programs (no model)."""

    def __init__(self, tokens, seqs, built):
        self.tokens, self.seqs, self.programs = tokens, seqs, {k: None for k in built}


def test_bucket_for_leaves_room_for_the_padding_sequence_and_skips_blocked_buckets():
    every = [(t, s) for t in (16, 32) for s in (4, 16)]
    g = _Built((16, 32), (4, 16), every)
    assert g.bucket_for(16, 4) == (16, 4)          # exact fit: no padding sequence
    assert g.bucket_for(15, 4) == (16, 16)         # 15 tokens pad to 16: a fifth sequence owns the padded row
    assert g.bucket_for(20, 1) == (32, 4)
    assert g.bucket_for(33, 1) is None and g.bucket_for(16, 17) is None
    g = _Built((16, 32), (4, 16), [k for k in every if k != (32, 4)])    # (32, 4) failed to capture
    assert g.bucket_for(20, 1) == (32, 16)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=2)


def _run(model, graph_tokens: int | None) -> tuple[list[list[int]], LLMEngine, int, torch.Tensor]:
    """The first prompt prefills alone (13 tokens: bucket 16, a padding sequence); the second arrives while it
    decodes (a mixed step of 21 tokens: past the bucket, eager); then both decode (2 tokens in 2 sequences: bucket
    16 again; on the GPU the decode graphs take such steps). graph_tokens None: the stock engine (reference).
    The cache starts poisoned (random bytes); returns (tokens, engine, steps, the cache bytes before)."""
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=32,
                                        max_model_len=128, prefill_graph_tokens=graph_tokens or 0))
    if graph_tokens is not None:
        model.use_attention(PAGED_KERNELS)
        eng.runner.target_attention = True
        eng.runner.enable_prefill_graphs("auto", graphs=False)
    g = torch.Generator().manual_seed(0)
    eng.kv.data.copy_(torch.randint(0, 256, eng.kv.data.shape, dtype=torch.uint8, generator=g))
    before = eng.kv.data.clone()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = eng.add_request(PROMPTS[0], params)
    eng.step()
    second = eng.add_request(PROMPTS[1], params)
    steps = 1
    while eng.has_work():
        eng.step()
        steps += 1
    assert eng.blocks.num_free_slots() == eng.kv.num_slots
    return [list(first.output_token_ids), list(second.output_token_ids)], eng, steps, before


def test_padded_program_equals_the_stock_engine_and_writes_only_its_tokens(model):
    ref = _run(model, None)[0]
    got, eng, steps, before = _run(model, 16)
    pg = eng.runner.prefill_graphs
    assert pg.tokens == (16,) and sorted(pg.programs) == [(16, 4)]
    assert got == ref
    assert pg.replays == steps - 1                 # every step but the 21-token mixed one
    # the padded rows (slot -1) wrote nothing: every cache byte past the pages the two requests took is unchanged
    kv = eng.kv
    used = sum(-(-(len(p) + 2) // kv.page_size) for p in PROMPTS)
    untouched = torch.ones(kv.num_slots, dtype=torch.bool)
    untouched[:used + 1] = False                   # the allocator's first slots (slot 0: the padding page)
    assert torch.equal(kv.data[untouched], before[untouched])
    assert not torch.equal(kv.data[~untouched], before[~untouched])


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_token_limit_is_refused(model, bad):
    with pytest.raises(ValueError, match="prefill_graph_tokens: expected an int >= 0"):
        LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, prefill_graph_tokens=bad))


def test_an_outgrown_scratch_stays_allocated_once_graphs_may_address_it(monkeypatch):
    """The DEQUANT_MM scratch grows into a new buffer; once prefill graphs are captured the old one is kept (a graph
    replays the addresses it recorded), before that it is let go."""
    from m3serve.kernels.gemm import _tiled
    monkeypatch.setattr(_tiled, "_SCRATCH", {})
    monkeypatch.setattr(_tiled, "_RETIRED", [])
    monkeypatch.setattr(_tiled, "_keep_outgrown", False)
    dev = torch.device("cpu")
    first = _tiled._scratch(dev, torch.float32, 8)
    _tiled._scratch(dev, torch.float32, 16)
    assert _tiled._RETIRED == []
    _tiled.keep_outgrown_scratch()
    held = _tiled._scratch(dev, torch.float32, 4)           # fits: the same buffer
    grown = _tiled._scratch(dev, torch.float32, 32)
    assert len(_tiled._RETIRED) == 1 and _tiled._RETIRED[0].data_ptr() == held.data_ptr() != grown.data_ptr()
    assert first.data_ptr() != held.data_ptr()


class _Stub:
    """A bucket's program that records nothing but returns its static hidden states (no forward)."""

    def __init__(self, tb: int, h: int):
        self.out = (torch.zeros(tb, h), {})

    def replay(self) -> None:
        pass


def test_each_step_restages_its_padding(model):
    """A step staged after a larger one leaves none of the larger one's inputs in its padding: the padded tokens
    write nowhere (slot -1) and belong to one length-0 sequence, the other padded sequences own no rows."""
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=32,
                                        max_model_len=128, prefill_graph_tokens=16))
    eng.runner.target_attention = True
    eng.runner.enable_prefill_graphs("auto", graphs=False)
    pg = eng.runner.prefill_graphs
    pg.programs = {k: _Stub(k[0], model.cfg.hidden_size) for k in pg.programs}
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for prompt in ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [21, 22], [31, 32, 33]):
        eng.add_request(prompt, params)
    big = eng.runner.build_batch(eng.scheduler.schedule())       # 19 tokens: past the 16-token bucket
    assert pg.hidden(big) is None
    for r in list(eng.requests.values()):
        eng.abort(r.request_id)
    eng.add_request(list(range(40, 54)), params)                   # 14 tokens in the 16-token bucket
    eng.add_request([70, 71], params)
    assert pg.hidden(eng.runner.build_batch(eng.scheduler.schedule())).shape == (16, model.cfg.hidden_size)
    for r in list(eng.requests.values()):
        eng.abort(r.request_id)
    eng.add_request([61, 62, 63], params)
    chunks = eng.scheduler.schedule()
    batch = eng.runner.build_batch(chunks)                          # then 3 tokens of one prompt
    t, s = batch.input_ids.numel(), len(chunks)
    assert (t, s) == (3, 1) and pg.hidden(batch).shape[0] == t and pg.replays == 2
    tb, sb = 16, 4
    assert torch.equal(pg.slot_mapping[:t], batch.slot_mapping) and bool((pg.slot_mapping[t:tb] == -1).all())
    assert torch.equal(pg.input_ids[:t], batch.input_ids) and torch.equal(pg.positions[:t], batch.positions)
    assert torch.equal(pg.seq_lens[:s], batch.step.seq_lens) and bool((pg.seq_lens[s:sb] == 0).all())
    assert torch.equal(pg.query_start[:s + 1], batch.step.query_start)
    assert pg.query_start[s + 1:sb + 1].tolist() == [tb] * (sb - s)  # sequence s owns rows t..tb-1, others none
    assert torch.equal(pg.slot_table[:s], batch.step.slot_table)



def _engine_with_programs(model) -> LLMEngine:
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=32,
                                        max_model_len=128, prefill_graph_tokens=16))
    model.use_attention(PAGED_KERNELS)
    eng.runner.target_attention = True
    eng.runner.enable_prefill_graphs("auto", graphs=False)
    return eng


def test_warm_up_runs_every_wave_eagerly_then_the_first_two_through_the_graphs(model, monkeypatch):
    """A graph pads every step to its bucket (a multiple of 16), so warm-up waves taken by the graphs never build
    the eager steps' variants for other token counts, which serving still reaches past the buckets (seen on the
    H200: a paged-attention variant built while serving). warm_up runs all its waves with the graphs off, then its
    first two waves through them, each pass from an empty prefix cache, and leaves the graphs on (also when a wave
    raises)."""
    from m3serve.engine import warmup
    eng = _engine_with_programs(model)
    pg = eng.runner.prefill_graphs
    passes = []

    def fake_waves(engine, waves, prompt, late_len, t0, timeout_s):
        passes.append((pg.enabled, len(waves)))
        return len(waves), 0

    cleared = []
    monkeypatch.setattr(warmup, "_run_waves", fake_waves)
    monkeypatch.setattr(eng.blocks, "clear_prefix_cache", lambda: cleared.append(len(passes)))
    warmup.warm_up(eng)
    assert len(passes) == 2 and passes[1] == (True, 2) and not passes[0][0] and passes[0][1] > 2
    assert cleared[:2] == [0, 1] and pg.enabled        # an empty prefix cache before each pass

    def failing(*a):
        assert not pg.enabled
        raise RuntimeError("a wave failed")

    monkeypatch.setattr(warmup, "_run_waves", failing)
    with pytest.raises(RuntimeError, match="a wave failed"):
        warmup.warm_up(eng)
    assert pg.enabled


def test_a_disabled_program_set_leaves_the_step_eager(model):
    eng = _engine_with_programs(model)
    pg = eng.runner.prefill_graphs
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    pg.enabled = False
    eng.add_request(PROMPTS[0], params)
    eng.step()
    assert pg.replays == 0
    pg.enabled = True
    eng.add_request(PROMPTS[0][:9], params)
    eng.step()
    assert pg.replays == 1


def test_captured_lists_graph_programs_only(model):
    """`captured` (what explain --graph-memory prints) names the buckets replayed as CUDA graphs: none while every
    program runs eagerly (graphs=False, zero bytes reserved), the graph ones once some are."""
    from m3serve.runtime import prefill_graphs as PG
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=32,
                                        max_model_len=128, prefill_graph_tokens=16))
    eng.runner.target_attention = True
    eng.runner.enable_prefill_graphs("auto", graphs=False)
    pg = eng.runner.prefill_graphs
    assert pg.programs and pg.captured == []
    assert eng.stats()["graph_memory_bytes"] == {"prefill": 0}
    key = sorted(pg.programs)[-1]
    pg.programs[key] = PG._Graph.__new__(PG._Graph)
    assert pg.captured == [key]
