"""Offline API, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import os
import sys

import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.outputs import CompletionOutput, RequestOutput
from m3serve.engine.sampling_params import SamplingParams
from m3serve.model.loader import load_model
from m3serve.tokenizer import load_tokenizer

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "assets", "m3-tiny-verse")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def default_model() -> str:
    """The embedded trained model when it ships in the package, else the tiny preset (random weights)."""
    return DEFAULT_MODEL_DIR if os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "config.json")) else "tiny"


def parse_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model: str | None = None, *, device: str | None = None, dtype="auto", seed: int = 0,
                 random_weights: bool | None = None, quantization: str | None = None,
                 tensor_parallel_size: int = 1, cpu_threads: int | None = None,
                 speculative_config: dict | None = None, route: str | None = None, **engine_kwargs):
        """route: "off" (stock path), "auto" (certified Triton entries where a module's rows and shape lie in a
        cell, stock elsewhere) or "require" (raise outside the cells). Default: auto on CUDA, off on CPU. The
        mode is process-wide (the last LLM built sets it); tensor-parallel workers run the stock path."""
        model = model or default_model()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu" and (cpu_threads is not None or "OMP_NUM_THREADS" not in os.environ):
            # Decode on CPU is a stream of tiny ops; on small shared machines OpenMP's thread hand-off costs
            # milliseconds per op (measured: 5 ms vs 18 us for a 128x128 linear with 2 threads vs 1).
            torch.set_num_threads(cpu_threads or 1)
        self.dtype = parse_dtype(dtype, self.device)
        if random_weights is None:
            random_weights = not os.path.isdir(model)
        self.tp_context = None
        if tensor_parallel_size != 1:
            if speculative_config is not None:
                raise NotImplementedError("speculative_config with tensor_parallel_size > 1: not available yet")
            torch.manual_seed(seed)
            self._start_tp(model, tensor_parallel_size, seed, random_weights, quantization, engine_kwargs)
            return
        torch.manual_seed(seed)
        self.model = load_model(model, device=self.device, dtype=self.dtype, random_weights=random_weights,
                                quantization=quantization, seed=seed)
        self.route = route or ("auto" if self.device.type == "cuda" else "off")
        if self.route != "off" or "m3serve.targets.routing" in sys.modules:
            from m3serve.targets import routing
            routing.set_mode(self.route)
            routing.warmup(self.model)
        self.tokenizer = load_tokenizer(model if os.path.isdir(model) else None)
        if speculative_config is None:
            self.engine = LLMEngine(self.model, EngineConfig(seed=seed, **engine_kwargs), self.tokenizer)
        else:  # vLLM's shape: {"method": "eagle3", "model": dir | None, "num_speculative_tokens": K, ...}
            from m3serve.engine.speculative import SpeculativeEngine
            self.engine = SpeculativeEngine(self.model, EngineConfig(seed=seed, **engine_kwargs), self.tokenizer,
                                            speculative_config=speculative_config)

    def _start_tp(self, model: str, size, seed: int, random_weights: bool, quantization, engine_kwargs: dict) -> None:
        """tensor_parallel_size = N > 1 (m3serve.distributed): this process is rank 0 and starts ranks 1..N-1
        itself (one GPU each on CUDA, gloo on CPU). Under torchrun every process calls LLM(...): rank 0
        returns, the other ranks serve it and exit when it shuts down. `shutdown()` (or `with LLM(...)`)
        stops the workers early; they also stop when this object is collected or at exit."""
        import weakref

        from m3serve.distributed.driver import start_tp
        from m3serve.distributed.launch import TPLaunchSpec
        from m3serve.model.loader import resolve_config
        from m3serve.model.parallel import check_tp_shapes

        check_tp_shapes(resolve_config(model), size)       # a bad size fails here, before any process starts
        kw = dict(engine_kwargs)
        tp_kw = {k: kw.pop(k) for k in ("kv_cache_dtype", "index_k_dtype", "kv_cache_bytes",
                                        "gpu_memory_utilization", "keep_quantized") if k in kw}
        for k, name in (("tp_timeout_s", "timeout_s"), ("tp_load_timeout_s", "load_timeout_s"),
                        ("tp_grace_s", "grace_s")):
            if k in kw:
                tp_kw[name] = kw.pop(k)
        spec = TPLaunchSpec(model=os.path.abspath(model) if os.path.isdir(model) else model, world_size=size,
                            device=str(self.device), dtype=self.dtype, seed=seed, random_weights=random_weights,
                            quantization=quantization, **tp_kw)
        self.tokenizer = load_tokenizer(model if os.path.isdir(model) else None)
        self.tp_context, self.model, self.engine = start_tp(spec, kw, self.tokenizer)
        self.device = self.model.device
        self._finalizer = weakref.finalize(self, self.tp_context.shutdown)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (no-op at TP = 1)."""
        if self.tp_context is not None:
            self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"prompt dict: expected key 'prompt_token_ids', found {sorted(prompt)}")
            return list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt given but the model has no tokenizer; pass "
                                 "{'prompt_token_ids': [...]} instead")
            return self.tokenizer.encode(prompt), prompt
        raise TypeError(f"prompt: expected str or {{'prompt_token_ids': [...]}}, found {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]          # validate everything before queueing anything
        reqs = []
        try:
            for (ids, text), p in zip(encoded, params):
                reqs.append(self.engine.add_request(ids, p, text))
        except Exception:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(reqs), desc="generate", unit="req", dynamic_ncols=True)
        done = 0
        while any(not r.is_finished for r in reqs):
            self.engine.step()
            now = sum(r.is_finished for r in reqs)
            if bar is not None and now > done:
                bar.update(now - done)
            done = now
        if bar is not None:
            bar.close()
        outs = [self._output(r) for r in reqs]
        for r in reqs:
            self.engine.release(r)
        return outs

    def _output(self, r) -> RequestOutput:
        comp = CompletionOutput(0, self.engine.detokenize(r), list(r.output_token_ids),
                                r.output_logprobs if r.params.logprobs is not None else None,
                                r.finish_reason, r.stop_reason)
        out = RequestOutput(str(r.request_id), r.prompt, r.prompt_token_ids, [comp])
        out.spec_metrics = getattr(r, "spec_metrics", None)  # acceptance per request (SpeculativeEngine)
        return out
