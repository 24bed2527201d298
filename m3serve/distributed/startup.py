"""Starting a tensor-parallel group: `start_tp(...)` is what LLM(..., tensor_parallel_size=N) calls. It launches or
joins the group, loads this rank's shard, agrees on the KV size, and returns (context, model, engine) on rank 0:
the ordinary LLMEngine with the group's broadcasting runner plugged in (driver.TPDriverRunner) and, with a
speculative config, SpecDecoding over spec_driver.TPSpecRunner. On a torchrun follower it serves until rank 0
shuts down and then ends the process (SystemExit(0)): only rank 0 runs the user's code after LLM(...).
"""

from __future__ import annotations

from m3serve.distributed.context import TPContext
from m3serve.distributed.driver import StepBroadcast, TPDriverRunner
from m3serve.distributed.kv_slots import local_kv_slots, rank_kv_spec, slot_bytes
from m3serve.distributed.launch import TPLaunchSpec, start
from m3serve.distributed.spec_driver import TPSpecRunner, tp_spec_config
from m3serve.distributed.worker import serve_follower
from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.spec_config import SpecConfig
from m3serve.engine.speculative import SpecDecoding, build_drafter, prepare_drafter, spec_runner_config
from m3serve.model.loader import load_model


def start_tp(spec: TPLaunchSpec, engine_kwargs: dict, tokenizer) -> tuple[TPContext, object, LLMEngine]:
    ctx = start(spec)
    if not ctx.is_driver:                                  # torchrun follower
        try:
            serve_follower(ctx, spec)
        except BaseException:
            ctx.shutdown(graceful=False)
            raise
        ctx.shutdown()
        raise SystemExit(0)
    try:
        model = load_model(spec.model, device=ctx.device, dtype=spec.torch_dtype, tp=ctx.tp,
                           random_weights=spec.random_weights, quantization=spec.quantization, seed=spec.seed,
                           keep_quantized=spec.keep_quantized)
        drafter = None
        if spec.speculative_config is not None:        # replicated drafter: the followers build the same one
            drafter = build_drafter(SpecConfig.from_dict(spec.speculative_config), model)
        kv_spec = rank_kv_spec(model, spec.kv_cache_dtype, spec.index_k_dtype,
                               None if drafter is None else drafter.cfg.num_key_value_heads)
        own = local_kv_slots(kv_spec, ctx.device, spec.kv_cache_bytes, spec.gpu_memory_utilization,
                                 spec.working_memory_bytes)
        others = ctx.wait_followers("slots", spec.load_timeout_s)
        slots = min([own] + [int(v) for v in others.values()])
        ctx.store.set("go", str(slots))
        config = EngineConfig(seed=spec.seed, kv_cache_dtype=spec.kv_cache_dtype, index_k_dtype=spec.index_k_dtype,
                              kv_cache_bytes=slots * slot_bytes(kv_spec), **engine_kwargs)
        broadcast = StepBroadcast(ctx)
        if drafter is None:
            engine = LLMEngine(model, config, tokenizer, runner=TPDriverRunner(model, config, broadcast))
        else:
            spec_cfg = tp_spec_config(spec.speculative_config)
            drafter = prepare_drafter(spec_cfg, model, drafter)
            engine = LLMEngine(
                model, config, tokenizer,
                runner=TPDriverRunner(model, config, broadcast, **spec_runner_config(config, spec_cfg, drafter)),
                speculation=SpecDecoding(spec_cfg, drafter, TPSpecRunner(model, drafter, broadcast)))
        if engine.kv.num_slots != slots:
            raise RuntimeError(f"rank 0 built {engine.kv.num_slots} KV slots, the group agreed on {slots}")
        return ctx, model, engine
    except BaseException as e:
        try:
            ctx.store.set("abort", f"{type(e).__name__}: {e}")
        except Exception:
            pass
        ctx.shutdown(graceful=False)
        raise
