"""bench/memory_plan_startup.py's host side: config names and the LLM arguments each one builds."""

from __future__ import annotations

import os

import pytest

from bench import memory_plan_startup as mps


def test_configs_name_model_mode_and_quantization():
    assert mps.parse_config("embedded:spec") == ("embedded", "spec", None)
    assert mps.parse_config("minimax-m3:5:spec:nvfp4") == ("minimax-m3:5", "spec", "nvfp4")
    assert mps.parse_config("minimax-m3:5:plain") == ("minimax-m3:5", "plain", None)
    for bad in ("embedded", "minimax-m3:5:fast:nvfp4", "spec"):
        with pytest.raises(ValueError, match="expected MODEL:plain|spec"):
            mps.parse_config(bad)


def test_llm_arguments_follow_the_config():
    from m3serve.llm import default_model
    kw = mps.llm_kwargs("embedded", "spec", None, 128, 3, 8192)
    assert kw == {"dtype": "bfloat16", "max_num_seqs": 128,
                  "speculative_config": {"method": "eagle3", "num_speculative_tokens": 3,
                                         "model": os.path.join(default_model(), "eagle3")}}
    kw = mps.llm_kwargs("minimax-m3:5", "plain", "nvfp4", 64, 3, 4096)
    assert kw == {"model": "minimax-m3:5", "random_weights": True, "quantization": "nvfp4", "max_model_len": 4096,
                  "max_num_seqs": 64}
    assert mps.llm_kwargs("minimax-m3:5", "spec", "nvfp4", 64, 2, 4096)["speculative_config"]["model"] is None
