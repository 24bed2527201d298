"""Structured output on the decode target: constrained requests replay the processed decode graph (their token
masks applied inside it) and draw exactly the eager target's tokens; their outputs follow the grammar."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

pytestmark = pytest.mark.gpu

TINY_KV = 256 << 20
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["speaker", "act"],
          "properties": {"speaker": {"type": "string", "maxLength": 16}, "act": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 5}}}


def test_constrained_rows_in_the_processed_graph_match_the_eager_target():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from m3serve import LLM, SamplingParams
    from m3serve.engine.structured_params import StructuredOutputsParams as S
    prompts = ["Shall I compare thee", "ROMEO.\n", "Once more unto the breach", "To be, or not", "KING."]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=S(json=SCHEMA)),
              SamplingParams(max_tokens=40, temperature=0.9, seed=2, structured_outputs=S(regex=r"[a-z]{3,8}-[0-9]{2}")),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True),       # unconstrained
              SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0.7, seed=4, structured_outputs=S(json_object=True))]
    target = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", kv_cache_bytes=TINY_KV, seed=5)
    eager = LLM(dtype="bfloat16", max_num_seqs=8, route="auto", enforce_eager=True, kv_cache_bytes=TINY_KV, seed=5)
    try:
        got = target.generate(prompts, params, use_tqdm=False)
        st = target.engine.stats()
        assert st["structured_graph_masked_steps"] > 10, st
        want = eager.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        value = json.loads(got[0].outputs[0].text)
        assert set(value) == {"speaker", "act"} and 1 <= value["act"] <= 5
        assert re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", got[1].outputs[0].text)
        if got[4].outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(got[4].outputs[0].text), dict)
    finally:
        for llm in (target, eager):
            llm.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
