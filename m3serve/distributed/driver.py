"""Rank 0 of a tensor-parallel group: the ordinary LLMEngine (scheduler, block manager, sampler) whose model
step is broadcast to the followers first and whose greedy rows are sampled vocab-parallel.

`start_tp(...)` is what LLM(..., tensor_parallel_size=N) calls: it launches or joins the group, loads this
rank's shard, agrees on the KV size, and returns (context, model, engine) on rank 0. On a torchrun follower
it serves until rank 0 shuts down and then ends the process (SystemExit(0)): only rank 0 runs the user's code
after LLM(...).
"""

from __future__ import annotations

import torch.distributed as dist

from m3serve.distributed import protocol
from m3serve.distributed.context import TPContext, WorkerDiedError
from m3serve.distributed.kv_slots import local_kv_slots, rank_kv_spec, slot_bytes
from m3serve.distributed.launch import TPLaunchSpec, start
from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampler import sample, top_logprobs


class TPDriverEngine(LLMEngine):
    def __init__(self, model, config: EngineConfig, tokenizer, ctx: TPContext):
        self.ctx = ctx
        self._step_no = 0
        super().__init__(model, config, tokenizer)

    def fault(self) -> str | None:
        return self.ctx.fault()

    def _forward_sample(self, batch, reqs):
        mode, k = protocol.choose_mode([r.params.greedy for r in reqs], [r.params.logprobs for r in reqs])
        header, payload = protocol.pack_step(batch, mode, k, self._step_no)

        def run():
            res = protocol.run_step(self.model, batch, mode, k)
            if mode == protocol.NONE:
                tokens, lp = [], None
            elif mode == protocol.GATHER:
                t = sample(res.logits, [r.params for r in reqs], [r.sample_key for r in reqs],
                           [r.num_tokens for r in reqs])
                lp = top_logprobs(res.logits, t, k) if k >= 0 else None
                tokens = t.tolist()
            else:
                tokens, lp = res.tokens.tolist(), res.logprobs
            if lp is not None:
                lp = tuple(x.tolist() for x in lp)
            return tokens, lp

        return broadcast_and_run(self, header, payload, run)


def broadcast_and_run(engine, header, payload, run):
    """Rank 0: broadcast one step (header, payload) to the followers, then run it here (`run()`, whose
    collectives the followers match) and return its result. engine: a driver engine (`ctx`, `_step_no`).
    Any failure takes the whole group down: the followers are out of step with us (or gone)."""
    ctx = engine.ctx
    ctx.check()
    ctx.in_step = True
    try:
        dist.broadcast(header, 0, group=ctx.control)
        dist.broadcast(payload, 0, group=ctx.control)
        out = run()
        if ctx.failure is not None:       # an aborted NCCL step returns garbage instead of raising
            raise WorkerDiedError(ctx.failure)
    except BaseException as e:        # incl. KeyboardInterrupt: a half-run step leaves the group unusable
        # gloo / NCCL report a dead peer as RuntimeError a moment before its process is reaped
        dead = ctx.failed_rank(wait_s=5.0 if isinstance(e, RuntimeError) else 0.0)
        ctx.fail(dead or f"tensor-parallel step {engine._step_no} failed on rank 0: {type(e).__name__}: {e}")
        ctx.in_step = False
        ctx.shutdown(graceful=False)
        if dead:
            raise WorkerDiedError(dead) from e
        raise
    ctx.in_step = False
    engine._step_no += 1
    return out


def start_tp(spec: TPLaunchSpec, engine_kwargs: dict, tokenizer) -> tuple[TPContext, object, TPDriverEngine]:
    from m3serve.distributed.worker import serve_follower
    from m3serve.model.loader import load_model

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
            from m3serve.engine.speculative import SpecConfig, build_drafter
            drafter = build_drafter(SpecConfig.from_dict(spec.speculative_config), model)
        kv_spec = rank_kv_spec(model, spec.kv_cache_dtype, spec.index_k_dtype,
                               None if drafter is None else drafter.cfg.num_key_value_heads)
        own = local_kv_slots(kv_spec, ctx.device, spec.kv_cache_bytes, spec.gpu_memory_utilization)
        others = ctx.wait_followers("slots", spec.load_timeout_s)
        slots = min([own] + [int(v) for v in others.values()])
        ctx.store.set("go", str(slots))
        config = EngineConfig(seed=spec.seed, kv_cache_dtype=spec.kv_cache_dtype, index_k_dtype=spec.index_k_dtype,
                              kv_cache_bytes=slots * slot_bytes(kv_spec), **engine_kwargs)
        if drafter is None:
            engine = TPDriverEngine(model, config, tokenizer, ctx)
        else:
            from m3serve.distributed.spec_driver import TPSpecDriverEngine
            engine = TPSpecDriverEngine(model, config, tokenizer, ctx, speculative_config=spec.speculative_config,
                                        drafter=drafter)
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


__all__ = ["TPDriverEngine", "start_tp"]
