"""Rank 0 of a tensor-parallel group running speculative decoding: the SpeculativeEngine whose target and
draft passes are each broadcast to the followers first (spec_protocol.py). Greedy verification and greedy
drafts use vocab-parallel argmax (no full logits gathered); sampled verification, sampled drafts and logprobs
gather the full rows, and rank 0 runs the same exact rejection sampler as at TP 1.

The batch-size policy (speculative_config.disable_by_batch_size) is off here: its plain steps run LLMEngine's
sampling step, which this driver does not broadcast to the followers."""

from __future__ import annotations

from m3serve.distributed import spec_protocol
from m3serve.distributed.context import TPContext
from m3serve.distributed.driver import broadcast_and_run
from m3serve.engine.engine import EngineConfig
from m3serve.engine.spec_config import SpecConfig
from m3serve.engine.speculative import SpeculativeEngine


def tp_spec_config(speculative_config: dict | SpecConfig) -> SpecConfig:
    """The speculative_config of a tensor-parallel group: disable_by_batch_size defaults to None there (a dict
    without the key), and any other value is refused (ValueError naming the field)."""
    if isinstance(speculative_config, dict) and "disable_by_batch_size" not in speculative_config:
        speculative_config = {**speculative_config, "disable_by_batch_size": None}
    cfg = SpecConfig.from_dict(speculative_config)
    if cfg.disable_by_batch_size is not None:
        raise ValueError(f"speculative_config.disable_by_batch_size = {cfg.disable_by_batch_size!r}: not available "
                         "with tensor_parallel_size > 1 (pass None; the policy's plain steps are not broadcast to "
                         "the followers)")
    return cfg


class TPSpecDriverEngine(SpeculativeEngine):
    def __init__(self, model, config: EngineConfig, tokenizer, ctx: TPContext, *, speculative_config,
                 drafter=None):
        self.ctx = ctx
        self._step_no = 0
        super().__init__(model, config, tokenizer, speculative_config=tp_spec_config(speculative_config),
                         drafter=drafter)

    def fault(self) -> str | None:
        return self.ctx.fault()

    def _run_target(self, batch, mode):
        header, payload = spec_protocol.pack_target(batch, mode, self._step_no)
        return broadcast_and_run(self, header, payload, lambda: self.runner.target(batch, mode))

    def _run_draft(self, batch, src, gather, mode):
        header, payload = spec_protocol.pack_draft(batch, src, gather, mode, self._step_no)
        return broadcast_and_run(self, header, payload, lambda: self.runner.draft(batch, src, gather, mode))


__all__ = ["TPSpecDriverEngine", "tp_spec_config"]
