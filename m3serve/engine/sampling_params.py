"""Per-request sampling parameters, vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None    # top-k logprobs per generated token (the sampled token is always included)
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def bad(name, value, want):
            raise ValueError(f"SamplingParams.{name} = {value!r}: {want}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "expected an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0 \
                or self.temperature != self.temperature:
            bad("temperature", self.temperature, "expected a number in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "expected a number in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "expected an integer >= -1 (0 or -1 disable it)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63):
            bad("seed", self.seed, "expected an integer in [0, 2^63)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", self.logprobs, "expected an integer in [0, 20]")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "expected non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "expected non-negative integers")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "expected an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
