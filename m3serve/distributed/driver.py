"""Rank 0 of a tensor-parallel group: the ordinary LLMEngine (scheduler, block manager, sampler) whose model
step is broadcast to the followers first and whose greedy rows are sampled vocab-parallel (the group is
started by m3serve.distributed.startup.start_tp).
"""

from __future__ import annotations

import torch.distributed as dist

from m3serve.distributed import protocol
from m3serve.distributed.context import TPContext, WorkerDiedError
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


__all__ = ["TPDriverEngine", "broadcast_and_run"]
