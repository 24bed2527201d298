"""min_p, allowed_token_ids and bad_words on the decode target: the graphs' processed variant (the filters are
rows of the penalty state it applies) draws exactly the eager target's tokens, and every token obeys them.
One-token bad words are static bans (graph rows); a multi-token bad word needs the previous token on the host
(a dynamic ban), so a batch holding one runs eager steps: the graph comparison uses one-token words."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

TINY_KV = 256 << 20


def test_token_filters_inside_the_graph_as_the_eager_target():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from m3serve import LLM, SamplingParams
    prompts = [{"prompt_token_ids": list(range(9 + i, 50 + 5 * i))} for i in range(4)]
    allowed = list(range(100, 400))
    params = [SamplingParams(max_tokens=40, temperature=1.0, min_p=0.2, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.9, allowed_token_ids=allowed, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, bad_words=["the", "and"], ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, min_p=0.1, bad_words=["of"], ignore_eos=True)]
    target = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", kv_cache_bytes=TINY_KV, seed=5)
    eager = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", enforce_eager=True, kv_cache_bytes=TINY_KV, seed=5)
    try:
        outs = target.generate(prompts, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert target.engine.runner.graphs.processed_graphs and target.engine.runner.graphs.sampled_replays > 20
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert all(t in allowed for t in got[1])
        tok = target.get_tokenizer()
        for row, words in ((2, ("the", " the", "and", " and")), (3, ("of", " of"))):   # each request its own bans
            for seq in (tuple(tok.encode(w, add_special_tokens=False)) for w in words):
                if len(seq) == 1:
                    assert seq[0] not in got[row], (row, seq)
    finally:
        for llm in (target, eager):
            llm.shutdown()
        del target, eager
        gc.collect()
        torch.cuda.empty_cache()
