"""vLLM's `LLM(...)` keyword arguments that m3serve accepts without using them, and the check that names an
unknown one.

Each ignored argument has the reason it does not apply here; LLM logs one warning line naming those given with a
non-default value. An argument that would change the result if honoured (pipeline parallelism, a pooling task)
is refused instead (ValueError naming it), as is an unknown one (TypeError naming `LLM`, not an internal class).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging

log = logging.getLogger("m3serve")

# name -> (its neutral / default value, why m3serve does not use it)
IGNORED = {
    "trust_remote_code": (False, "the M3 model code is built in; no checkpoint code is run"),
    "tokenizer_mode": ("auto", "the checkpoint's fast tokenizer is always used"),
    "revision": (None, "models load from a local directory"),
    "tokenizer_revision": (None, "tokenizers load from a local directory"),
    "download_dir": (None, "models load from a local directory (nothing is downloaded)"),
    "hf_token": (None, "nothing is downloaded"),
    "load_format": ("auto", "safetensors checkpoints are read as they are"),
    "swap_space": (4, "no CPU swap: a preempted request's KV is recomputed"),
    "cpu_offload_gb": (0, "no weight offloading"),
    "disable_log_stats": (False, "the offline API logs no periodic stats"),
    "disable_custom_all_reduce": (False, "tensor parallelism uses NCCL's all-reduce"),
    "max_seq_len_to_capture": (8192, "decode graphs are captured per batch size, any length"),
    "disable_async_output_proc": (False, "output processing overlaps the next step already"),
    "enable_chunked_prefill": (True, "chunked prefill is always on"),
    "block_size": (None, "the KV page size follows the cache format"),
    "distributed_executor_backend": (None, "tensor-parallel ranks are processes started by m3serve"),
    "compilation_config": (None, "no torch.compile; the decode target is Triton kernels and CUDA graphs"),
    "served_model_name": (None, "used by the server only"),
    "skip_tokenizer_init": (False, "the tokenizer is needed for text prompts and stop strings"),
    "hf_overrides": (None, "the checkpoint's config.json is read as it is"),
    "generation_config": ("auto", "defaults come from SamplingParams"),
}
# Accepted only at their neutral value: anything else would change what is computed.
NEUTRAL_ONLY = {"pipeline_parallel_size": (1,), "task": ("auto", "generate"), "runner": ("auto", "generate")}


def split_kwargs(kwargs: dict, engine_config_cls, tp_only: tuple[str, ...], tp: bool) -> dict:
    """kwargs of LLM(...) beyond its own -> the EngineConfig (and tensor-parallel launch) ones; logs the ignored
    ones, raises on refused or unknown ones."""
    engine_names = {f.name for f in dataclasses.fields(engine_config_cls)} - {"seed"}
    allowed = engine_names | (set(tp_only) if tp else set())
    out, ignored = {}, []
    for name, value in kwargs.items():
        if name in allowed:
            out[name] = value
        elif name in IGNORED:
            if value != IGNORED[name][0]:
                ignored.append(f"{name} ({IGNORED[name][1]})")
        elif name in NEUTRAL_ONLY:
            if value not in NEUTRAL_ONLY[name]:
                raise ValueError(f"LLM: {name}={value!r} is not supported (only "
                                 f"{', '.join(map(repr, NEUTRAL_ONLY[name]))})")
        else:
            known = sorted(allowed | set(IGNORED) | set(NEUTRAL_ONLY))
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")
    if ignored:
        log.warning("LLM: ignoring arguments that do not apply to m3serve: %s", "; ".join(ignored))
    return out


__all__ = ["IGNORED", "NEUTRAL_ONLY", "split_kwargs"]
