"""Tensor parallelism on torch.distributed: launch (spawn or torchrun), the rank-0 driver engine, followers,
and vocab-parallel sampling. Entry point for users: LLM(..., tensor_parallel_size=N)."""

from __future__ import annotations

from m3serve.distributed.context import TPContext, WorkerDiedError
from m3serve.distributed.vocab import vocab_parallel_argmax, vocab_parallel_logprobs

__all__ = ["TPContext", "WorkerDiedError", "vocab_parallel_argmax", "vocab_parallel_logprobs"]
