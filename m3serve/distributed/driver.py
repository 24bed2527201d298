"""Rank 0 of a tensor-parallel group: the runner plugged into the ordinary engine (LLMEngine or the speculative
one), whose model step is broadcast to the followers first and whose greedy rows are sampled vocab-parallel (the
group is started by m3serve.distributed.startup.start_tp). The engine stays the single-process one: scheduler,
block manager, stop checks; only the device side of a step differs.
"""

from __future__ import annotations

import torch.distributed as dist

from m3serve.distributed import protocol
from m3serve.distributed.context import TPContext, WorkerDiedError
from m3serve.engine.sampler import sample, top_logprobs
from m3serve.runtime.model_runner import ModelRunner
from m3serve.runtime.step_inputs import pack_step


class StepBroadcast:
    """Rank 0's end of the control group: each step (a plain step, or a speculative target or draft pass) is
    broadcast, then run here. One counter numbers them all: a follower checks it against its own."""

    def __init__(self, ctx: TPContext):
        self.ctx = ctx
        self.step_no = 0

    def __call__(self, header, payload, run):
        """Broadcast one step (header, payload) to the followers, then run it here (`run()`, whose collectives
        the followers match) and return its result. Any failure takes the whole group down: the followers are
        out of step with us (or gone)."""
        ctx = self.ctx
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
            ctx.fail(dead or f"tensor-parallel step {self.step_no} failed on rank 0: {type(e).__name__}: {e}")
            ctx.in_step = False
            ctx.shutdown(graceful=False)
            if dead:
                raise WorkerDiedError(dead) from e
            raise
        ctx.in_step = False
        self.step_no += 1
        return out


class TPDriverRunner(ModelRunner):
    """The ModelRunner of rank 0: the same cache, tables and batch packing (the followers receive the packed
    step), no penalties, prompt logprobs or grammar masks (the engine refuses them), no decode target (it needs
    TP 1)."""

    processes_logits = False

    def __init__(self, model, config, broadcast: StepBroadcast, **kw):
        super().__init__(model, config, **kw)
        self.broadcast = broadcast

    def fault(self) -> str | None:
        return self.broadcast.ctx.fault()

    def run(self, batch, reqs, prompt_plan=None, processing=None):
        """The step on every rank: rank 0 samples (greedy rows by vocab-parallel argmax, no full rows gathered;
        a sampling row gathers the full logits and takes the ordinary sampler)."""
        if prompt_plan is not None or processing is not None:
            raise ValueError("a tensor-parallel step takes no prompt logprobs or logits processing")
        mode, k = protocol.choose_mode([r.params.greedy for r in reqs], [r.params.logprobs for r in reqs])
        header, payload = pack_step(batch, mode, k, self.broadcast.step_no)

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

        return self.broadcast(header, payload, run)


__all__ = ["TPDriverRunner", "StepBroadcast"]
