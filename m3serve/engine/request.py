"""A request's life: WAITING -> RUNNING (prefill in chunks, then decode) -> FINISHED; preemption sends it back
to WAITING with its KV dropped (recomputed from prompt + generated tokens).

SamplingParams(n > 1 or best_of > 1) makes a RequestGroup: one Request per candidate sequence, member 0 leads.
The other members wait until the leader's prompt KV is in the prefix cache, then reuse its full pages."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from m3serve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)   # a request is its own identity: `req in running` must not compare prompts field by field
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
    sample_key: int = 0               # keys its sampling noise (m3serve.engine.sampler): seed or a per-request id
    graph_sampling: tuple | None = None   # its sampling parameters as a decode graph stages them (made once)
    overlap_for: tuple | None = field(default=None, repr=False)   # (engine's graphs version, overlappable), cached
    group: RequestGroup | None = field(default=None, repr=False, compare=False)   # n / best_of candidates
    prompt_logprobs: list[dict[int, float] | None] | None = None   # [len(prompt)], None where not computed yet
    prompt_logprobs_left: int = 0        # entries of prompt_logprobs still to compute
    stop_scan_chars: int | None = None   # output text characters already searched for stop strings
    logits_processing: bool = field(init=False, default=False)   # penalties / bias / min_tokens (cached)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()     # params.bad_words as token sequences (the engine spells them)
    # Tokens sampled by graph steps still in flight (the overlap loop): their ids are on the device only.
    # They count for scheduling (num_tokens) but are not in output_token_ids yet.
    pending: int = 0

    def __post_init__(self) -> None:
        self.logits_processing = self.params.needs_logits_processing

    @property
    def has_dynamic_bans(self) -> bool:
        """A bad word of several tokens: its ban depends on the output so far, which the host must know."""
        return any(len(s) > 1 for s in self.bad_word_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence as the scheduler sees it: prompt + generated, including pending ones."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending

    @property
    def num_known_tokens(self) -> int:
        """prompt + generated tokens whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs were asked for and some are still missing (the first prompt token has none)."""
        return self.prompt_logprobs_left > 0

    @property
    def in_prefill(self) -> bool:
        """More than one token still lacks KV: the next chunk is (part of) a prefill."""
        return self.num_tokens - self.num_computed > 1


@dataclass
class RequestGroup:
    """The best_of (else n) candidate sequences of one user request; `params` are the user's (n, best_of,
    logprobs visibility), the members run with per-candidate copies (n = 1, seed + index)."""
    params: SamplingParams
    members: list[Request]

    @property
    def leader(self) -> Request:
        return self.members[0]

    @property
    def is_finished(self) -> bool:
        return all(m.is_finished for m in self.members)
