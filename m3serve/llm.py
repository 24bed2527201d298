"""Offline API, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`, `LLM.chat(messages, ...)`,
`LLM.get_tokenizer()`. vLLM's constructor arguments that do not apply here are accepted with one warning
(m3serve.vllm_args); `LLM.encode` is vLLM's pooling API, which a generation-only engine refuses."""

from __future__ import annotations

import logging
import os
import weakref

import torch

from m3serve.distributed.launch import TPLaunchSpec
from m3serve.distributed.spec_driver import tp_spec_config
from m3serve.distributed.startup import start_tp
from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.outputs import RequestOutput, request_output
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import speculative_engine
from m3serve.engine.warmup import warm_up
from m3serve.kernels._jit import COMPILE_WATCH
from m3serve.kv.scales import apply_model_kv_scales, resolve_kv_fp8_layers, resolve_kv_rotation
from m3serve.model.loader import load_model, resolve_config
from m3serve.model.parallel import check_tp_shapes
from m3serve.runtime.memory_plan import plan_working_memory
from m3serve.server.chat_tokens import chat_encoder
from m3serve.targets import routing
from m3serve.tokenizer import load_tokenizer
from m3serve.vllm_args import split_kwargs

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "assets", "m3-tiny-verse")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
# keyword arguments only a tensor-parallel launch reads (LLM._start_tp)
_TP_ONLY = ("keep_quantized", "tp_timeout_s", "tp_load_timeout_s", "tp_grace_s")


def embedded_drafter() -> str:
    """The embedded model's Eagle3 drafter directory, absolute (a speculative_config "model" that works from any
    working directory): LLM(speculative_config={"method": "eagle3", "model": embedded_drafter(), ...})."""
    path = os.path.join(DEFAULT_MODEL_DIR, "eagle3")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"the embedded Eagle3 drafter is not in this installation ({path})")
    return path


def default_model() -> str:
    """The embedded trained model when it ships in the package, else the tiny preset (random weights)."""
    return DEFAULT_MODEL_DIR if os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "config.json")) else "tiny"


def parse_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"LLM: dtype {dtype!r}: expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model: str | None = None, *, device: str | None = None, dtype="auto", seed: int = 0,
                 random_weights: bool | None = None, quantization: str | None = None,
                 tensor_parallel_size: int = 1, cpu_threads: int | None = None,
                 speculative_config: dict | None = None, route: str | None = None, enforce_eager: bool = False,
                 kv_scales: str | None = "auto", kv_fp8_layers: tuple[int, ...] | str = "auto",
                 kv_rotation: int | None | str = "auto", tokenizer: str | None = None, weight_layout: str | None = None,
                 **engine_kwargs):
        """route: "off" (stock path), "auto" (certified Triton entries where a module's rows and shape lie in a
        cell, stock elsewhere) or "require" (raise outside the cells). Default: auto on CUDA, off on CPU. The
        mode belongs to this LLM's model (two LLMs in one process route independently); tensor-parallel
        workers run the stock path. With routing on, a bf16 model on one GPU also runs the decode target:
        attention through the paged-cache kernels and pure decode steps as CUDA graphs (`enforce_eager=True`,
        vLLM's name, keeps the kernels and skips the graphs).
        kv_scales: NVFP4 KV-cache K/V amax per layer (m3serve.kv.calibrate): "auto" = <model>/kv_scales.json,
        else the checkpoint's k_scale/v_scale, else the uncalibrated default; a kv_scales.json path; or None.
        kv_fp8_layers: sparse layers the hybrid cache (kv_cache_dtype="nvfp4") stores in FP8 instead of NVFP4:
        "auto" = the `fp8_layers` of the kv_scales.json that kv_scales selects (none without one, and none for
        other KV dtypes), or an explicit tuple of sparse layer ids.
        kv_rotation: seed of the randomized Hadamard rotation of the hybrid cache's NVFP4 K/V (m3serve.kv.rotation),
        None = unrotated; "auto" = the `rotation` of the kv_scales.json that kv_scales selects (unrotated when
        that file has none), else the default seed.
        tokenizer: a directory holding the tokenizer (vLLM's argument), when it is not the model's.
        weight_layout: how the decode target holds NVFP4 / MXFP8 weights: None (default) = "mma_tile", the layout
        every kernel of those formats reads fastest (docs/kernels.md); "rows" keeps the checkpoint's row-major bytes
        (for side-by-side measurements). Ignored with routing off and by tensor-parallel workers (stock path).
        Other keyword arguments: EngineConfig's (max_model_len, max_num_seqs, kv_cache_dtype, ...); vLLM's that do
        not apply here are accepted with one warning naming them (m3serve.vllm_args.IGNORED)."""
        engine_kwargs = split_kwargs(engine_kwargs, EngineConfig, _TP_ONLY, tensor_parallel_size != 1)
        model = model or default_model()
        self._tokenizer_dir = tokenizer
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu" and (cpu_threads is not None or "OMP_NUM_THREADS" not in os.environ):
            # Decode on CPU is a stream of tiny ops; on small shared machines OpenMP's thread hand-off costs
            # milliseconds per op (measured: 5 ms vs 18 us for a 128x128 linear with 2 threads vs 1).
            torch.set_num_threads(cpu_threads or 1)
        self.dtype = parse_dtype(dtype, self.device)
        if random_weights is None:
            random_weights = not os.path.isdir(model)
        self.route = route or ("auto" if self.device.type == "cuda" else "off")
        _default_target_context(resolve_config(model), self.route, engine_kwargs)   # TP ranks get the same
        _default_step_tokens(self.device, self.route, engine_kwargs, speculative=speculative_config is not None)
        # no graphs will be captured: the memory plan reserves none for them (runtime/memory_plan.py)
        engine_kwargs.setdefault("enforce_eager", bool(enforce_eager) or self.route == "off")
        self.tp_context = None
        self.warmup_report = None      # engine/warmup.py's summary (decode target on CUDA)
        self.memory_report = None      # the memory plan against what start-up took (runner.check_memory_plan)
        self.kv_fp8_layers_source = None       # the kv_scales.json that named the FP8 layers (kv_fp8_layers="auto")
        if tensor_parallel_size != 1:
            if kv_scales not in (None, "auto"):
                raise NotImplementedError("kv_scales with tensor_parallel_size > 1: the ranks' caches keep the "
                                          "default NVFP4 amax (not available yet)")
            if not isinstance(kv_fp8_layers, str) and kv_fp8_layers:
                raise NotImplementedError("kv_fp8_layers with tensor_parallel_size > 1: the ranks' caches keep "
                                          "every sparse layer in NVFP4 (not available yet)")
            torch.manual_seed(seed)
            self._start_tp(model, tensor_parallel_size, seed, random_weights, quantization, engine_kwargs,
                           speculative_config)
            return
        torch.manual_seed(seed)
        self.model = load_model(model, device=self.device, dtype=self.dtype, random_weights=random_weights,
                                quantization=quantization, seed=seed)
        if self.route != "off":
            max_rows = _max_step_rows(engine_kwargs, speculative_config)
            with COMPILE_WATCH.startup():
                routing.install(self.model, self.route, max_rows=max_rows,   # require: uncovered rows raise here
                                weight_layout=weight_layout)
                routing.warmup(self.model, max_rows=max_rows)
        self.tokenizer = self._load_tokenizer(model)
        engine_kwargs["kv_fp8_layers"] = self._resolve_kv_fp8_layers(
            model, kv_scales, kv_fp8_layers, engine_kwargs.get("kv_cache_dtype", "auto"))
        engine_kwargs["kv_rotation"] = self._resolve_kv_rotation(
            model, kv_scales, kv_rotation, engine_kwargs.get("kv_cache_dtype", "auto"))
        if speculative_config is None:
            self.engine = LLMEngine(self.model, EngineConfig(seed=seed, **engine_kwargs), self.tokenizer)
            self._apply_kv_scales(model, kv_scales)
            self._enable_target(enforce_eager)
        else:  # vLLM's shape: {"method": "eagle3", "model": dir | None, "num_speculative_tokens": K, ...}
            self.engine = speculative_engine(self.model, EngineConfig(seed=seed, **engine_kwargs), self.tokenizer,
                                              speculative_config=speculative_config)
            self._apply_kv_scales(model, kv_scales)
            self._enable_target(enforce_eager)   # decode steps as SpecSteps graphs (spec_graphs.py)

    def _load_tokenizer(self, model: str):
        path = self._tokenizer_dir
        if path is None:
            return load_tokenizer(model if os.path.isdir(model) else None)
        tok = load_tokenizer(path)
        if tok is None:
            raise ValueError(f"LLM: tokenizer={path!r} is not a directory holding a tokenizer (tokenizer.json, ...)")
        return tok

    def _resolve_kv_fp8_layers(self, model: str, kv_scales: str | None, kv_fp8_layers, kv_cache_dtype: str
                               ) -> tuple[int, ...]:
        """The explicit tuple, or for "auto" the calibrated list (hybrid cache only); the spec validates it."""
        if not isinstance(kv_fp8_layers, str):
            return kv_fp8_layers
        if kv_fp8_layers != "auto":
            raise ValueError(f"kv_fp8_layers: expected 'auto' or a tuple of sparse layer ids, found {kv_fp8_layers!r}")
        if kv_cache_dtype != "nvfp4":
            return ()
        source, layers = resolve_kv_fp8_layers(model, self.model.cfg.layer_types, kv_scales)
        if layers:
            self.kv_fp8_layers_source = source
            logging.getLogger("m3serve").info("KV cache: sparse layers %s stored as FP8 (from %s)", list(layers),
                                              source)
        return layers

    def _resolve_kv_rotation(self, model: str, kv_scales: str | None, kv_rotation, kv_cache_dtype: str
                             ) -> int | None:
        """The explicit seed (or None), or for "auto" the calibrated rotation (hybrid cache only)."""
        if not isinstance(kv_rotation, str):
            return kv_rotation
        if kv_rotation != "auto":
            raise ValueError(f"kv_rotation: expected 'auto', None or a non-negative int seed, found {kv_rotation!r}")
        if kv_cache_dtype != "nvfp4":
            return None
        source, seed = resolve_kv_rotation(model, self.model.cfg.num_hidden_layers, kv_scales)
        logging.getLogger("m3serve").info("KV cache: NVFP4 K/V rotation %s (%s)",
                                          "off" if seed is None else f"seed {seed}", source or "default")
        return seed

    def _apply_kv_scales(self, model: str, kv_scales: str | None) -> None:
        """Calibrated NVFP4 global scales into the cache's NVFP4 layers (no-op for other KV dtypes)."""
        self.kv_scales_source = apply_model_kv_scales(self.engine.kv, model, self.model.cfg.num_hidden_layers,
                                                      kv_scales)

    def _enable_target(self, enforce_eager: bool) -> None:
        """Decode target on when routing is on and the model can run it; `require` raises when it cannot."""
        if self.route == "off":
            return
        if self.dtype != torch.bfloat16 or self.device.type != "cuda":
            if self.route == "require":
                raise ValueError(f"route='require': the decode target needs dtype bfloat16 on CUDA, found "
                                 f"{self.dtype} on {self.device}")
            return
        # compile every prefill / mixed-step variant now, not in front of the first request (engine/warmup.py)
        with COMPILE_WATCH.startup():
            self.engine.enable_target(graphs=not enforce_eager, mode=self.route)
            self.warmup_report = warm_up(self.engine, seed=self.engine.config.seed)
        # what start-up took against the plan the KV cache was sized by (a warning when the plan fell short)
        self.memory_report = self.engine.runner.check_memory_plan()

    def _start_tp(self, model: str, size, seed: int, random_weights: bool, quantization, engine_kwargs: dict,
                  speculative_config: dict | None = None) -> None:
        """tensor_parallel_size = N > 1 (m3serve.distributed): this process is rank 0 and starts ranks 1..N-1
        itself (one GPU each on CUDA, gloo on CPU). Under torchrun every process calls LLM(...): rank 0
        returns, the other ranks serve it and exit when it shuts down. `shutdown()` (or `with LLM(...)`)
        stops the workers early; they also stop when this object is collected or at exit. With a
        speculative_config every rank runs the same (replicated) drafter (m3serve.distributed.spec_driver)."""
        check_tp_shapes(resolve_config(model), size)       # a bad size fails here, before any process starts
        spec_dict = None
        if speculative_config is not None:                  # a bad config fails here too; a dir is made absolute
            spec_dict = tp_spec_config(speculative_config).to_dict()
            if spec_dict["model"] is not None:
                spec_dict["model"] = os.path.abspath(spec_dict["model"])
        kw = dict(engine_kwargs)
        tp_kw = {k: kw.pop(k) for k in ("kv_cache_dtype", "index_k_dtype", "kv_cache_bytes",
                                        "gpu_memory_utilization", "keep_quantized") if k in kw}
        for k, name in (("tp_timeout_s", "timeout_s"), ("tp_load_timeout_s", "load_timeout_s"),
                        ("tp_grace_s", "grace_s")):
            if k in kw:
                tp_kw[name] = kw.pop(k)
        # every rank reserves the eager steps' working memory before its cache (no graphs at TP > 1)
        k = int((speculative_config or {}).get("num_speculative_tokens", 0) or 0)
        cfg = resolve_config(model)
        working = plan_working_memory(
            cfg, max_num_seqs=kw.get("max_num_seqs", EngineConfig.max_num_seqs),
            max_num_batched_tokens=kw["max_num_batched_tokens"], max_step_tokens=_max_step_rows(kw, speculative_config),
            max_model_len=cfg.context_limit(kw.get("max_model_len")), graphs=False,
            spec_k=k, quantized_experts=True)   # the ranks' expert formats are not known before they load
        spec = TPLaunchSpec(model=os.path.abspath(model) if os.path.isdir(model) else model, world_size=size,
                            device=str(self.device), dtype=self.dtype, seed=seed, random_weights=random_weights,
                            quantization=quantization, speculative_config=spec_dict,
                            working_memory_bytes=working.total, **tp_kw)
        self.tokenizer = self._load_tokenizer(model)
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

    def encode(self, *args, **kwargs):
        """vLLM's LLM.encode runs a pooling model (embeddings); m3serve only generates."""
        raise NotImplementedError("LLM.encode is vLLM's pooling API (embeddings), which m3serve does not offer; "
                                  "use generate() / chat(), or get_tokenizer().encode(text) for token ids")

    def _prompt_ids(self, prompt) -> tuple[list[int], str | None]:
        """A generate() prompt (text or {"prompt_token_ids": [...]}) -> (token ids, its text if known)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"prompt dict: expected key 'prompt_token_ids', found {sorted(prompt)}")
            return list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt given but the model has no tokenizer; pass "
                                 "{'prompt_token_ids': [...]} instead")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:      # a lone surrogate ("\ud800"): not text, the tokenizer would fail
                raise ValueError(f"prompt: invalid Unicode at character {e.start} ({prompt[e.start]!r}: a lone "
                                 "UTF-16 surrogate)") from None
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
        encoded = [self._prompt_ids(p) for p in prompts]          # validate everything before queueing anything
        reqs = []
        try:
            for (ids, text), p in zip(encoded, params):
                reqs.append(self.engine.add_request(ids, p, text))
        except Exception:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        # n / best_of: the engine runs one request per candidate; a prompt is done when all of them are.
        members = [r.group.members if r.group is not None else [r] for r in reqs]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(reqs), desc="generate", unit="req", dynamic_ncols=True)
        done = 0
        while done < len(reqs):
            self.engine.step()
            now = sum(all(m.is_finished for m in ms) for ms in members)
            if now < len(reqs) and not self.engine.has_work():
                raise RuntimeError("the engine has no work left but requests are unfinished")
            if bar is not None and now > done:
                bar.update(now - done)
            done = now
        # the overlap loop may have queued one more step for requests that stopped: read it back so this call
        # leaves nothing in flight (their pages are free when generate returns)
        self.engine.drain()
        if bar is not None:
            bar.close()
        outs = [self._output(r) for r in reqs]
        for ms in members:
            for m in ms:
                self.engine.release(m)
        return outs

    def _output(self, r) -> RequestOutput:
        out = request_output(r, self.tokenizer)
        out.spec_metrics = getattr(r, "spec_metrics", None)  # acceptance per request (speculative decoding)
        return out

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (None for a model without one, such as the `tiny` preset)."""
        return self.tokenizer

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: `messages` is one conversation (a list of {"role", "content"} dicts) or a list of
        them; each is rendered with the tokenizer's chat template (or `chat_template`) and generated from.
        Returns one RequestOutput per conversation (a list even for one)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError(f"messages: expected a conversation (list of message dicts) or a list of them, found "
                            f"{type(messages).__name__ if messages else messages!r}")
        single = all(isinstance(m, dict) for m in messages)
        conversations = [list(messages)] if single else list(messages)
        prompts = [self._chat_prompt(c, i, chat_template, add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs) for i, c in enumerate(conversations)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_prompt(self, conversation, index: int, chat_template, add_generation_prompt: bool,
                     continue_final_message: bool, tools, chat_template_kwargs) -> dict:
        """One conversation -> {"prompt_token_ids", "prompt"}: the rendered template text, encoded without adding
        special tokens (the template writes any bos)."""
        where = "messages" if index == 0 else f"messages[{index}]"
        if not isinstance(conversation, (list, tuple)) or not conversation or \
                not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                        for m in conversation):
            raise TypeError(f"{where}: expected a non-empty list of {{'role': str, 'content': ...}} dicts, found "
                            f"{conversation!r:.200}")
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat: this model has no tokenizer; use generate() with prompt token ids")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("chat: the tokenizer has no chat_template; pass chat_template=...")
        if add_generation_prompt and continue_final_message:
            raise ValueError("chat: add_generation_prompt and continue_final_message cannot both be True")
        # The server's encoder: special-token text inside message content stays ordinary text (no forged turns).
        kwargs = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message)
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        ids, text = chat_encoder(tok).encode(list(conversation), tools, **kwargs)
        return {"prompt_token_ids": list(ids), "prompt": text}


# The decode target's default context on MSA models: the block-table width (1024 blocks of 128 tokens) at which
# msa.select scans the fewest blocks per selection round. M3's full 1M-token context is also certified (8192
# blocks) but makes every decode step's selection scan 8x the blocks, so it is taken only when asked for.
TARGET_DEFAULT_CONTEXT = 131072


def _default_target_context(cfg, route: str, engine_kwargs: dict) -> None:
    """max_model_len left unset on a routed MSA model: min(max_position_embeddings, TARGET_DEFAULT_CONTEXT),
    logged; an explicit max_model_len is kept as given."""
    if route == "off" or engine_kwargs.get("max_model_len") is not None \
            or not any(t == "sparse" for t in cfg.layer_types) or cfg.max_position_embeddings <= TARGET_DEFAULT_CONTEXT:
        return
    engine_kwargs["max_model_len"] = TARGET_DEFAULT_CONTEXT
    logging.getLogger("m3serve").info("max_model_len defaults to %d on the decode target (the model allows %d: pass max_model_len to "
             "use more)", TARGET_DEFAULT_CONTEXT, cfg.max_position_embeddings)


# Chosen on the H200 (bench/prefill_interference.py, minimax-m3:5 NVFP4, a 32k prompt beside 4 decoding streams;
# bench/results/prefill_interference/prefill-interference-h200.json): 2048 / 4096 / 8192-token steps gave the prompt a TTFT of
# 0.78 / 0.65 / 0.54 s and the streams an ITL p50 of 46 / 71 / 110 ms while it prefilled (2 ms before). 8192 is
# vLLM's serving default and where the quantized MoE's decode-once band pays (from 4096 tokens); a deployment
# that values the running streams' ITL over long prompts' TTFT passes a smaller max_num_batched_tokens.
# Eagle3 serving keeps 2048: with 8192 the served sweep (bench/serve_pareto.py, the embedded model and its
# drafter, 128/128 tokens) lost to plain serving per user at 4 and 16 users and fell to 0.42x plain's total at
# 64 (TTFT p50 557 ms vs 53 ms with 2048; bench/results/serve/serve-pareto-spec-8192-h200.json).
TARGET_DEFAULT_STEP_TOKENS = 8192


def _default_step_tokens(device: torch.device, route: str, engine_kwargs: dict, speculative: bool = False) -> None:
    """max_num_batched_tokens left unset (or None, the server's default): TARGET_DEFAULT_STEP_TOKENS on a routed
    CUDA model without speculation, EngineConfig's default elsewhere (the CPU stock path, Eagle3)."""
    if engine_kwargs.get("max_num_batched_tokens") is not None:
        return
    engine_kwargs["max_num_batched_tokens"] = TARGET_DEFAULT_STEP_TOKENS \
        if device.type == "cuda" and route != "off" and not speculative else EngineConfig.max_num_batched_tokens


def _max_step_rows(engine_kwargs: dict, speculative_config: dict | None) -> int:
    """The most tokens one forward can carry under these limits (a prefill chunk, a decode batch, a verify pass of
    max_num_seqs x (K + 1)): warm-up compiles every routed kernel variant up to it."""
    k = int((speculative_config or {}).get("num_speculative_tokens", 0) or 0)
    seqs = engine_kwargs.get("max_num_seqs", EngineConfig.max_num_seqs)
    return max(engine_kwargs.get("max_num_batched_tokens", EngineConfig.max_num_batched_tokens), seqs * (k + 1))
