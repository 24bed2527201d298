"""Eager steps as CUDA graphs on the GPU (runtime/prefill_graphs.py): a replay equals the same padded program run
eagerly, bit for bit, and the unpadded eager step up to summation order; serving with them gives the eager target's
greedy tokens (or parts only at near-ties); a real-dims model in every expert format captures every bucket (or names
the module that kept one eager)."""

from __future__ import annotations

import pytest
import torch

from tests.greedy_ties import assert_only_near_ties
from tests.runtime.test_decode_target_gpu import TINY_KV, _greedy, _need_cuda, _release

pytestmark = pytest.mark.gpu


def _prompts(n: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [(11 + 17 * i + 29 * j) % vocab for j in range(20 + 37 * i)]} for i in range(n)]


def test_replay_equals_the_padded_program_and_the_eager_step():
    _need_cuda()
    from m3serve import LLM, SamplingParams
    llm = LLM(dtype="bfloat16", max_num_seqs=8, kv_cache_bytes=TINY_KV, prefill_graph_tokens=512)
    eng, pg = llm.engine, llm.engine.runner.prefill_graphs
    assert pg is not None and not pg.blocked and len(pg.programs) == len(pg.tokens) * len(pg.seqs)
    vocab = llm.model.cfg.vocab_size
    for p in _prompts(3, vocab):
        eng.add_request(p["prompt_token_ids"], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    chunks = eng.scheduler.schedule()
    batch = eng.runner.build_batch(chunks)
    t, s = batch.input_ids.numel(), len(chunks)
    tb, sb = pg.bucket_for(t, s)
    with torch.inference_mode():
        replayed = pg.run(batch).clone()
        h, _ = pg._forward(tb, pg._step(tb, sb))               # the static inputs still hold this batch
        padded = llm.model.logits(h[:t][batch.logits_rows])
        eager = llm.model(batch)
    assert torch.equal(replayed, padded)          # the same kernels at the same shapes, in the same order
    # the unpadded step runs the routed cells of T rows, the program those of Tb: summation order only, which
    # moves bf16 activations by an ulp here and there (2**-8 relative) and the logits by a few of them; 2 % of the
    # largest logit is far above that and far below what a wrong row (padding leaking in) would do
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    assert (replayed - eager).abs().max().item() <= 0.02 * eager.abs().max().item()
    for c in chunks:
        eng.abort(c.request.request_id)
    _release(llm)


def test_serving_with_prefill_graphs_gives_the_eager_targets_tokens():
    """Staggered arrivals: lone prefills, prefills beside decoding rows (mixed steps), chunks past the largest
    bucket (eager). Tokens equal the target without prefill graphs, or part only at near-ties."""
    _need_cuda()
    from m3serve import LLM
    on = LLM(dtype="bfloat16", max_num_seqs=8, kv_cache_bytes=TINY_KV, prefill_graph_tokens=256)
    off = LLM(dtype="bfloat16", max_num_seqs=8, kv_cache_bytes=TINY_KV)
    assert off.engine.runner.prefill_graphs is None
    vocab = on.model.cfg.vocab_size
    prompts = _prompts(8, vocab)
    got = _greedy(on, prompts, 24)
    ref = _greedy(off, prompts, 24)
    assert on.engine.runner.prefill_graphs.replays > 0
    assert_only_near_ties(off, [p["prompt_token_ids"] for p in prompts], ref, got)
    _release(on, off)


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_real_dims_capture_every_bucket(quant):
    """minimax-m3:4 (3 dense layers + one 128-expert MoE layer): every (tokens, sequences) bucket up to 256 tokens
    captures (nothing on the prefill path syncs the host), and a prompt served through them completes."""
    _need_cuda()
    from m3serve import LLM
    llm = LLM("minimax-m3:4", random_weights=True, quantization=quant, kv_cache_bytes=2 << 30, max_model_len=4096,
              prefill_graph_tokens=256)
    pg = llm.engine.runner.prefill_graphs
    assert pg is not None and not pg.blocked, [b.line() for b in pg.blocked.values()]
    assert pg.memory_bytes < 4 << 30              # what the capture reserved (logged at start-up)
    out = _greedy(llm, _prompts(3, llm.model.cfg.vocab_size), 4)
    assert all(len(o) == 4 for o in out) and pg.replays > 0
    _release(llm)


def test_speculative_eager_steps_replay_prefill_graphs():
    """Eagle3 without a batch-size policy: arrivals' eager speculative steps replay the prefill graphs (which keep
    the drafter's layers); greedy tokens equal the plain target's, or part only at near-ties."""
    _need_cuda()
    from m3serve import LLM, embedded_drafter
    spec = {"method": "eagle3", "model": embedded_drafter(), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    on = LLM(dtype="bfloat16", max_num_seqs=8, kv_cache_bytes=TINY_KV, prefill_graph_tokens=256,
             speculative_config=spec)
    off = LLM(dtype="bfloat16", max_num_seqs=8, kv_cache_bytes=TINY_KV)
    prompts = _prompts(8, on.model.cfg.vocab_size)
    got = _greedy(on, prompts, 24)
    ref = _greedy(off, prompts, 24)
    pg = on.engine.speculation.spec_runner.prefill_graphs
    assert pg is not None and pg.capture_layers and pg.replays > 0
    assert_only_near_ties(off, [p["prompt_token_ids"] for p in prompts], ref, got)
    _release(on, off)
