"""vLLM's LLM(...) habits: arguments that do not apply are accepted with one warning naming them, the rest are
refused naming `LLM`; dtype="half"; tokenizer=<dir>; LLM.encode is not a tokenizer helper."""

from __future__ import annotations

import logging

import pytest
import torch

from m3serve import LLM, SamplingParams

TINY = dict(device="cpu", kv_cache_bytes=1 << 20, max_num_batched_tokens=64)


def test_vllm_arguments_are_accepted_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="m3serve"):
        llm = LLM("tiny", trust_remote_code=True, swap_space=8, disable_log_stats=True, tokenizer_mode="auto",
                  download_dir="/nowhere", enable_chunked_prefill=True, task="generate", **TINY)
    lines = [r.getMessage() for r in caplog.records if "ignoring arguments" in r.getMessage()]
    assert len(lines) == 1
    for name in ("trust_remote_code", "swap_space", "disable_log_stats", "download_dir"):
        assert name in lines[0]
    for name in ("tokenizer_mode", "enable_chunked_prefill"):   # at their default: nothing to warn about
        assert name not in lines[0]
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_unknown_and_refused_arguments_name_llm():
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'max_num_seq'.*max_num_seqs"):
        LLM("tiny", max_num_seq=4, **TINY)
    with pytest.raises(ValueError, match="LLM: pipeline_parallel_size=2"):
        LLM("tiny", pipeline_parallel_size=2, **TINY)
    with pytest.raises(ValueError, match="LLM: task='embed'"):
        LLM("tiny", task="embed", **TINY)
    with pytest.raises(ValueError, match="LLM: dtype 'double'"):
        LLM("tiny", dtype="double", **TINY)


def test_dtype_half_and_float():
    assert LLM("tiny", dtype="half", **TINY).model.dtype == torch.float16
    assert LLM("tiny", dtype="float", **TINY).model.dtype == torch.float32


def test_tokenizer_directory():
    from m3serve.llm import DEFAULT_MODEL_DIR          # the embedded model's tokenizer, on the tiny preset
    llm = LLM("tiny", tokenizer=DEFAULT_MODEL_DIR, **TINY)
    assert llm.get_tokenizer() is not None and llm.get_tokenizer().encode("ab")
    with pytest.raises(ValueError, match="LLM: tokenizer="):
        LLM("tiny", tokenizer="/nonexistent", **TINY)


def test_encode_is_not_a_tokenizer_helper():
    llm = LLM("tiny", **TINY)
    with pytest.raises(NotImplementedError, match="pooling"):
        llm.encode("hello")


def test_routed_msa_model_defaults_to_the_target_context_and_keeps_an_explicit_one() -> None:
    """max_model_len unset on a routed MSA model: capped at TARGET_DEFAULT_CONTEXT (M3's 1M positions would
    make every decode step's block selection scan 8192 blocks); an explicit value, route off, or a model whose
    positions fit are left alone."""
    from m3serve.config import preset
    from m3serve.llm import TARGET_DEFAULT_CONTEXT, _default_target_context
    m3 = preset("minimax-m3:5")
    assert m3.max_position_embeddings > TARGET_DEFAULT_CONTEXT and "sparse" in m3.layer_types
    kw = {}
    _default_target_context(m3, "auto", kw)
    assert kw == {"max_model_len": TARGET_DEFAULT_CONTEXT}
    for route, given in (("auto", {"max_model_len": 1_048_576}), ("require", {"max_model_len": 4096}),
                         ("off", {})):
        kw = dict(given)
        _default_target_context(m3, route, kw)
        assert kw == given
    tiny = preset("tiny")
    kw = {}
    _default_target_context(tiny, "auto", kw)
    assert kw == {}


def test_step_token_default_follows_the_path():
    """max_num_batched_tokens unset or None (the server's default): 8192 on the GPU decode target (measured against
    the streams' ITL, llm.TARGET_DEFAULT_STEP_TOKENS), the engine's 2048 on the CPU stock path and with routing off;
    a given value is kept."""
    import torch
    from m3serve.llm import TARGET_DEFAULT_STEP_TOKENS, _default_step_tokens
    from m3serve.engine.engine import EngineConfig
    cases = [(torch.device("cuda"), "auto", {}, TARGET_DEFAULT_STEP_TOKENS),
             (torch.device("cuda"), "require", {"max_num_batched_tokens": None}, TARGET_DEFAULT_STEP_TOKENS),
             (torch.device("cuda"), "off", {}, EngineConfig.max_num_batched_tokens),
             (torch.device("cpu"), "off", {"max_num_batched_tokens": None}, EngineConfig.max_num_batched_tokens),
             (torch.device("cuda"), "auto", {"max_num_batched_tokens": 1024}, 1024)]
    for dev, route, kw, want in cases:
        _default_step_tokens(dev, route, kw)
        assert kw["max_num_batched_tokens"] == want, (dev, route)
    kw = {}
    _default_step_tokens(torch.device("cuda"), "auto", kw, speculative=True)    # Eagle3: measured better at 2048
    assert kw["max_num_batched_tokens"] == EngineConfig.max_num_batched_tokens
    assert TARGET_DEFAULT_STEP_TOKENS != EngineConfig.max_num_batched_tokens
