"""No cliffs on the GPU: every weight format builds and serves under the default arguments at real dims (a bucket
whose modules cannot be captured is left eager and named, never a crash), `require` names the module, the
embedded model captures a graph for every bucket up to max_num_seqs (plain and speculative), and the
graph-bucket steps past 48 sequences give the eager target's tokens."""

from __future__ import annotations

import logging

import pytest
import torch

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
    g = llm.engine.runner.graphs
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
    assert not llm.engine.runner.graphs.blocked
    _release(llm)


def test_embedded_model_graphs_up_to_max_num_seqs_plain_and_spec():
    """max_num_seqs = 128: buckets 1..128 all captured (plain), and speculative graphs for every bucket with
    (K + 1) x bucket verify rows; a 100-sequence batch replays a graph and gives the eager target's tokens."""
    _need_cuda()
    from m3serve import LLM
    from m3serve.llm import default_model
    kv = 512 << 20
    plain = LLM(dtype="bfloat16", max_num_seqs=128, kv_cache_bytes=kv)
    g = plain.engine.runner.graphs
    assert g.captured == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) and not g.blocked
    memory = plain.engine.stats()["graph_memory_bytes"]     # what explain --graph-memory reports
    assert set(memory) == {"decode", "prefill"} and memory["decode"] > 0 and memory["prefill"] > 0, memory
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
    steps = spec.engine.speculation.spec_steps
    assert steps.buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert {b for b, _ in steps._graph} == set(steps.buckets) and not steps.blocked
    assert spec.engine.stats()["graph_memory_bytes"]["speculative"] > 0
    before = steps.replays
    out = _greedy(spec, prompts, 12)
    assert steps.replays > before and all(len(o) == 12 for o in out)
    _release(spec)


@pytest.mark.parametrize("spec", [False, True])
def test_no_kernel_variant_is_built_after_the_warm_up(spec):
    """What a serving sweep sends (128-token prompts arriving 1, 4, 16 and 64 at a time, then arrivals beside
    decoding requests) builds no Triton variant the warm-up did not: each one would stall the step in front of
    its requests (the TTFT p90 of ~0.7 s at 16 users)."""
    _need_cuda()
    from m3serve import LLM, SamplingParams, embedded_drafter
    from m3serve.kernels._jit import COMPILE_WATCH
    kw = {"speculative_config": {"method": "eagle3", "model": embedded_drafter(), "num_speculative_tokens": 3}} \
        if spec else {}
    llm = LLM(device="cuda", max_num_seqs=128, kv_cache_bytes=2 << 30, **kw)
    before = COMPILE_WATCH.count
    vocab = llm.model.cfg.vocab_size
    eng = llm.engine
    salt = 0
    for wave in (1, 4, 16, 64, 5, 17):
        reqs = []
        for i in range(wave):
            salt += 1
            reqs.append(eng.add_request([(101 + 7919 * salt + 31 * j) % (vocab - 16) + 16 for j in range(128)],
                                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
            if i == wave // 2:
                eng.step()                       # the rest arrive beside a decoding or prefilling step
        while any(not r.is_finished for r in reqs):
            eng.step()
        eng.drain()
        for r in reqs:
            eng.release(r)
    assert COMPILE_WATCH.count == before, COMPILE_WATCH.compiled[before:]
    _release(llm)


@pytest.mark.parametrize("model,quant", [("embedded", None), ("minimax-m3:5", "nvfp4")])
def test_memory_plan_holds_what_start_up_and_a_full_batch_take(model, quant):
    """Eagle3 (K = 3) at max_num_seqs = 128 with the default gpu_memory_utilization: the cache is sized after the
    planned working memory (runtime/memory_plan.py). Start-up (every graph captured, the warm-up run) and then
    128 sampled requests at once take no more than the plan, and every request completes (on the 80 GB H100,
    minimax-m3:5 failed every request here before the plan: graph capture ran out of memory, then cuBLAS)."""
    _need_cuda()
    import os

    from m3serve import LLM
    from m3serve.llm import default_model
    embedded = model == "embedded"
    spec = {"method": "eagle3", "model": os.path.join(default_model(), "eagle3") if embedded else None,
            "num_speculative_tokens": 3}
    llm = LLM(**({"dtype": "bfloat16"} if embedded else {"model": model, "random_weights": True,
                                                        "quantization": quant, "max_model_len": 8192}),
              max_num_seqs=128, speculative_config=spec)
    try:
        report, after, blocked = _start_up_and_full_batch(llm)
    finally:
        llm.shutdown()
        del llm              # the next case sizes its cache from what is free: drop the engine even on a failure
        _release()
    assert report is not None and report["measured_working_bytes"] <= report["planned_working_bytes"], report
    assert blocked == ({}, {}), blocked
    assert after <= report["planned_working_bytes"], (after, report)


def _start_up_and_full_batch(llm):
    """(the start-up memory report, bytes taken after 128 sampled requests at once, the buckets left eager:
    speculative and plain); every request must complete its 16 tokens."""
    from m3serve import SamplingParams
    vocab = llm.model.cfg.vocab_size
    prompts = [{"prompt_token_ids": [(11 + 7 * i + 13 * j) % vocab for j in range(24 + i % 40)]} for i in range(128)]
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1, ignore_eos=True)
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [16] * 128
    blocked = (dict(llm.engine.speculation.spec_steps.blocked), dict(llm.engine.runner.graphs.blocked))
    return llm.memory_report, llm.engine.runner.measured_working_bytes(), blocked


def test_sampler_peak_stays_within_its_planned_bytes_per_logit():
    """memory_plan.SAMPLER_BYTES_PER_LOGIT against the graph form of the sampler (top-k by a full sort, top-p,
    the noise race) at minimax-m3's vocabulary, measured by the caching allocator's peak beyond the logits."""
    _need_cuda()
    from m3serve.engine.sampler import sample_rows
    from m3serve.runtime.memory_plan import SAMPLER_BYTES_PER_LOGIT
    rows, vocab, dev = 64, 200064, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(rows, vocab, device=dev, generator=g)
    params = (torch.full((rows,), 0.7, device=dev), torch.full((rows,), 40, dtype=torch.int64, device=dev),
              torch.full((rows,), 0.9, device=dev), torch.zeros(rows, dtype=torch.bool, device=dev),
              torch.arange(rows, dtype=torch.int64, device=dev), torch.arange(rows, dtype=torch.int64, device=dev))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    tokens = sample_rows(logits, *params)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base + logits.numel() * 4     # the logits count in the plan too
    assert tokens.shape == (rows,) and int(tokens.max()) < vocab
    assert peak <= rows * vocab * SAMPLER_BYTES_PER_LOGIT, peak / (rows * vocab)
