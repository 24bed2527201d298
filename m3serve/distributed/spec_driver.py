"""Rank 0 of a tensor-parallel group running speculative decoding: `TPSpecRunner`, the speculative passes of
the engine's SpecDecoding (beside driver.TPDriverRunner as its model runner), whose target and draft passes are
each broadcast to the followers first (the wire form of runtime/step_inputs.py; followers: spec_protocol.py).
Greedy verification and greedy drafts use vocab-parallel argmax (no full logits gathered); sampled verification,
sampled drafts and logprobs gather the full rows, and rank 0 runs the same exact rejection sampler as at TP 1.

The batch-size policy (speculative_config.disable_by_batch_size) is off here: its plain steps run the plain
sampling step, whose penalties and prompt plans this group does not broadcast."""

from __future__ import annotations

from m3serve.distributed.driver import StepBroadcast
from m3serve.engine.spec_config import SpecConfig
from m3serve.engine.spec_runner import SpecRunner
from m3serve.runtime.step_inputs import pack_draft, pack_target


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


class TPSpecRunner(SpecRunner):
    """SpecRunner whose every pass is broadcast first (the followers repeat it on their own SpecRunner)."""
    paged_batches = False    # the wire form carries per-sequence spans: eager batches keep them (stock attention)

    def __init__(self, model, drafter, broadcast: StepBroadcast):
        super().__init__(model, drafter)
        self.broadcast = broadcast

    def target(self, batch, mode):
        header, payload = pack_target(batch, mode, self.broadcast.step_no)
        return self.broadcast(header, payload, lambda: super(TPSpecRunner, self).target(batch, mode))

    def draft(self, batch, src, gather, mode):
        header, payload = pack_draft(batch, src, gather, mode, self.broadcast.step_no)
        return self.broadcast(header, payload, lambda: super(TPSpecRunner, self).draft(batch, src, gather, mode))


__all__ = ["TPSpecRunner", "tp_spec_config"]
