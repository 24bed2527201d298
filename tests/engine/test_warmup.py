"""Start-up warm-up (engine/warmup.py): throw-away requests that reach every prefill specialization, leaving the
engine empty (no requests, every page free, no prefix-cache entries)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from m3serve import LLM, SamplingParams
from m3serve.engine.warmup import shape_class, warm_up, warmup_prompt_lengths
from m3serve.kernels._jit import CompileWatch
from m3serve.kernels.attention.msa_index import scores_variant
from m3serve.runtime.step_inputs import split_plan


def test_prompt_lengths_cover_the_specializations_and_fit():
    lens = warmup_prompt_lengths(max_model_len=4096, max_num_batched_tokens=256, capacity_tokens=100_000)
    assert 1 in lens and 16 in lens and 256 in lens and 256 + 37 in lens     # 1, x16, a full and a chunked prompt
    assert any(n % 16 for n in lens if n > 1)                                # an odd length
    small = warmup_prompt_lengths(max_model_len=64, max_num_batched_tokens=2048, capacity_tokens=1000)
    assert small and max(small) <= 62 and sum(n + 2 for n in small) <= 500


def test_warm_up_leaves_the_engine_empty():
    llm = LLM("tiny", random_weights=True, max_num_batched_tokens=64)
    eng = llm.engine
    free = eng.blocks.num_free_slots()
    report = warm_up(eng)
    assert report["requests"] >= 5 and report["tokens"] > 0
    assert not eng.has_work() and not eng.requests
    assert eng.blocks.num_free_slots() == free
    # request ids start at 0 again: an unseeded request draws what it draws on an engine that never warmed up
    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    fresh = LLM("tiny", random_weights=True, max_num_batched_tokens=64)
    got, want = llm.generate(prompt, sampled), fresh.generate(prompt, sampled)
    assert got[0].request_id == want[0].request_id == "0"
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    eng.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="already has requests"):
        warm_up(eng)


@pytest.mark.parametrize("limits", [dict(max_num_batched_tokens=64),
                                    dict(max_num_batched_tokens=64, enable_prefix_caching=False),
                                    dict(max_num_batched_tokens=8192)],   # a budget past the tiny model's context
                         ids=["prefix-cache", "no-prefix-cache", "budget-past-context"])
def test_warm_up_reaches_every_sequence_and_token_count_class(limits):
    """Triton builds a variant per class (== 1, divisible by 16, other) of a kernel's integer arguments; the prefill
    steps' sequence and token counts are such arguments of the attention kernels, so the warm-up must run a step
    of every reachable (sequences, tokens) class pair, or the first such serving step compiles in front of its
    requests (16 prompts of 128 tokens prefilled together: (x16, x16), the TTFT spike measured at 16 users).
    The scored msa.scores tiles too, also where the step budget is past the context (seen on the H200 at 8192:
    whole chunks of the budget before each scored chunk no longer fit the embedded model's context)."""
    llm = LLM("tiny", random_weights=True, max_num_seqs=32, **limits)
    eng = llm.engine
    seen = set()
    build = eng.runner.build_batch

    longest, scored = set(), set()
    cfg = eng.model.cfg

    def recording(chunks):
        seen.add((shape_class(len(chunks)), shape_class(sum(c.num_tokens for c in chunks))))
        if len(chunks) == 1:
            longest.add(chunks[0].num_tokens)
        # msa.scores runs only for sequences past the indexer's top-k blocks, with a tile set by the longest chunk
        if any(c.request.num_computed + c.num_tokens > cfg.index_topk_blocks * cfg.index_block_size for c in chunks):
            scored.add(scores_variant(max(c.num_tokens for c in chunks), cfg.index_n_heads))
        return build(chunks)

    eng.runner.build_batch = recording
    warm_up(eng)
    want = {("1", "1"), ("1", "x16"), ("1", "other"), ("x16", "x16"), ("x16", "other"), ("other", "x16"),
            ("other", "other")}
    assert want <= seen, f"classes never run by the warm-up: {sorted(want - seen)}"
    # the attention kernels' variants chosen by a step's query length (msa.scores' tile, whether attn.paged
    # splits the keys: its split count is a runtime value): a prompt prefilled alone of each, up to the step budget
    hk = eng.kv.spec.num_kv_heads

    def variant(n):
        return (scores_variant(n, cfg.index_n_heads),
                tuple(splits > 1 for splits in split_plan(n, eng.runner.tables.max_blocks, hk, cfg.index_topk_blocks,
                                                          eng.runner.sparse_tiles)))

    if limits["max_num_batched_tokens"] == 64:       # prompts alone up to the budget (the context bounds larger ones)
        missing = {variant(n) for n in range(1, 65)} - {variant(n) for n in longest}
        assert not missing, f"attention variants never run alone by the warm-up: {sorted(missing)}"
    unscored = {scores_variant(n, cfg.index_n_heads) for n in range(1, 65)} - scored
    assert not unscored, f"msa.scores tiles never run on a scored sequence by the warm-up: {sorted(unscored)}"


def test_compile_watch_counts_and_exports(caplog):
    """The hook Triton calls after building a variant (called here as Triton calls it: keywords only) counts it and
    logs its name; the engine's stats and /metrics carry the count."""
    watch = CompileWatch()
    compile = {"signature": {"q_ptr": "*bf16", "S": "i32", "T": "constexpr", "B": "i32", "QB": "constexpr"},
               "constants": {(2,): 1, (4,): 4}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                             (3,): [["tt.divisibility", 16]]}],
               "num_warps": 4, "num_stages": 2}
    with caplog.at_level("WARNING", logger="m3serve"):
        watch._on_compile(key=None, repr="?", fn=SimpleNamespace(name="paged_attn_split"), compile=compile,
                          is_manual_warmup=False, already_compiled=False)
    assert watch.count == 1
    assert watch.compiled[0] == "paged_attn_split[num_warps=4, num_stages=2](T=1, QB=4; divisible by 16: B; 16-byte aligned: q_ptr)"
    assert watch.compiled[0] in caplog.text
    with watch.startup():          # a second LLM's start-up in the same process compiles its own variants
        with watch.startup():
            watch._on_compile(key=None, repr="?", fn=SimpleNamespace(name="k"), compile=compile,
                              is_manual_warmup=False, already_compiled=False)
    assert watch.count == 1
    watch._on_compile(key=None, repr="?", fn=SimpleNamespace(name="k"), compile=compile, is_manual_warmup=False,
                      already_compiled=False)
    assert watch.count == 2
    from m3serve.server.metrics import ServerMetrics
    text = ServerMetrics("m", process=False).render({"alive": 1, "kernel_compiles_after_warmup": 3})
    assert 'm3serve_kernel_compiles_after_warmup_total{model_name="m"} 3.0' in text
