"""No cliffs on the GPU: every weight format builds and serves under the default arguments at real dims (a bucket
whose modules cannot be captured is left eager and named, never a crash), `require` names the module, the
embedded model captures a graph for every bucket up to max_num_seqs (plain and speculative), and the
graph-bucket steps past 48 sequences give the eager target's tokens."""

from __future__ import annotations

import logging

import pytest

from tests.runtime.test_decode_target_gpu import _greedy, _need_cuda, _release

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", [None, "fp8", "mxfp8", "nvfp4"])
def test_every_format_builds_and_decodes_at_real_dims(quant, caplog):
    """minimax-m3:4 (3 dense layers + one 128-expert MoE layer) with the defaults: LLM() never crashes; every
    bucket either has a graph or is named in the log as eager with its module."""
    _need_cuda()
    from m3serve import LLM
    with caplog.at_level(logging.WARNING, logger="m3serve"):
        llm = LLM("minimax-m3:4", random_weights=True, quantization=quant, kv_cache_bytes=2 << 30,
                  max_model_len=4096)
    g = llm.engine.graphs
    assert g is not None
    assert set(g.captured) | set(g.blocked) == set(g.buckets) and not set(g.captured) & set(g.blocked)
    for b, blocker in g.blocked.items():          # every eager bucket is named with its module and the reason
        assert blocker.module != "-" and f"bucket {b}" in caplog.text, blocker
    if quant == "nvfp4":                          # moe.nvfp4 serves 1-48 tokens: those buckets have graphs
        assert {1, 2, 4, 8, 16, 24, 32, 48} <= set(g.captured)
    vocab = llm.model.cfg.vocab_size
    prompts = [{"prompt_token_ids": [(7 + 13 * i + 31 * j) % vocab for j in range(40 + i)]} for i in range(3)]
    out = _greedy(llm, prompts, 8)
    assert all(len(o) == 8 for o in out)
    assert g.replays > 0
    _release(llm)


def test_require_names_an_uncapturable_module():
    """BF16 experts with no graph-safe MoE entry at some bucket: require raises naming the module — the capture
    check's (MoE) or the dispatch table's kind outside its cells — or, once every row count of every module is
    certified, builds with every bucket captured."""
    _need_cuda()
    from m3serve import LLM
    from m3serve.runtime.capture_check import GraphCaptureError
    try:
        llm = LLM("minimax-m3:4", random_weights=True, route="require", kv_cache_bytes=2 << 30, max_model_len=4096)
    except GraphCaptureError as e:
        assert "(MoE)" in str(e) and "bucket" in str(e)
        return
    except ValueError as e:          # a module outside every certified cell, named by the dispatch table
        assert "outside" in str(e) and "rows" in str(e) and "shape" in str(e)
        return
    assert not llm.engine.graphs.blocked
    _release(llm)


def test_embedded_model_graphs_up_to_max_num_seqs_plain_and_spec():
    """max_num_seqs = 128: buckets 1..128 all captured (plain), and speculative graphs for every bucket with
    (K + 1) x bucket verify rows; a 100-sequence batch replays a graph and gives the eager target's tokens."""
    _need_cuda()
    from m3serve import LLM
    from m3serve.llm import default_model
    kv = 512 << 20
    plain = LLM(dtype="bfloat16", max_num_seqs=128, kv_cache_bytes=kv)
    g = plain.engine.graphs
    assert g.captured == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) and not g.blocked
    prompts = [{"prompt_token_ids": list(range(5 + i % 50, 30 + i % 50))} for i in range(100)]
    before = g.replays
    got = _greedy(plain, prompts, 12)
    assert g.replays > before
    eager = LLM(dtype="bfloat16", max_num_seqs=128, kv_cache_bytes=kv, enforce_eager=True)
    assert _greedy(eager, prompts, 12) == got
    _release(plain, eager)
    import os
    spec = LLM(dtype="bfloat16", max_num_seqs=128, kv_cache_bytes=kv,
               speculative_config={"method": "eagle3", "model": os.path.join(default_model(), "eagle3"),
                                   "num_speculative_tokens": 3, "disable_by_batch_size": None})
    steps = spec.engine.spec_steps
    assert steps.buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert {b for b, _ in steps._graph} == set(steps.buckets) and not steps.blocked
    before = steps.replays
    out = _greedy(spec, prompts, 12)
    assert steps.replays > before and all(len(o) == 12 for o in out)
    _release(spec)
