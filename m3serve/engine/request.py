"""A request's life: WAITING -> RUNNING (prefill in chunks, then decode) -> FINISHED; preemption sends it back
to WAITING with its KV dropped (recomputed from prompt + generated tokens)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from m3serve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed: int = 0             # tokens whose KV is in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    allocated: bool = False
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: object | None = None   # the request's own torch.Generator (seeded sampling)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token still lacks KV: the next chunk is (part of) a prefill."""
        return self.num_tokens - self.num_computed > 1
