"""Per-request sampling parameters, vLLM's names and meanings.

Penalties follow vLLM: repetition_penalty r over the prompt and the output (a seen token's logit l becomes l / r
when l > 0, else l * r), frequency_penalty f and presence_penalty p over the output only
(l -= f * count + p * [count > 0]). logit_bias adds to the logits first; min_tokens forbids EOS and stop ids until
that many tokens are out, and no stop string ends the output before it. Range checks name the field.
vLLM's token filters (min_p, allowed_token_ids, bad_words: m3serve.engine.token_filters) are logits processing
too; truncate_prompt_tokens keeps the prompt's last k tokens (-1: as many as the context allows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from m3serve.engine.structured_params import StructuredOutputsParams, as_structured

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


@dataclass
class SamplingParams:
    n: int = 1                     # outputs returned per prompt (the engine runs them, sharing the prompt's pages)
    best_of: int | None = None     # candidates generated; the n with the highest cumulative logprob are returned
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None    # top-k logprobs per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None   # the same for every prompt token after the first
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0                            # drop tokens below min_p x the top probability (after temperature)
    allowed_token_ids: list[int] | None = None    # only these may be sampled
    bad_words: list[str] | None = None            # words the output may never complete
    truncate_prompt_tokens: int | None = None     # keep the prompt's last k tokens; -1: the context's limit
    # a grammar the output must follow (JSON schema / object, regex, choice, EBNF): m3serve.engine.structured
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):      # list() of an int or a dict would fail without the name
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):
                raise ValueError(f"SamplingParams.{name} = {v!r}: expected a list" +
                                 (" of strings (or one string)" if name == "stop" else " of token ids"))
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if isinstance(self.allowed_token_ids, (tuple, set, range)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.structured_outputs = as_structured(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def bad(name, value, want):
            raise ValueError(f"SamplingParams.{name} = {value!r}: {want}")

        def flag(name):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "expected True or False")

        if not _is_int(self.n) or self.n < 1:
            bad("n", self.n, "expected an integer >= 1")
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < self.n:
                bad("best_of", self.best_of, f"expected an integer >= n ({self.n}) or None")
            if self.best_of > self.n and self.temperature == 0.0:
                bad("best_of", self.best_of, "greedy candidates (temperature 0) are identical; expected "
                                             "best_of == n or temperature > 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "expected an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "expected an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"expected at most max_tokens ({self.max_tokens})")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", self.temperature, "expected a number in [0, 100]")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "expected a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", self.top_k, "expected an integer >= -1 (0 or -1 disable it)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                bad(name, v, "expected a number in [-2, 2]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            bad("repetition_penalty", self.repetition_penalty, "expected a finite number > 0 (1 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            bad("seed", self.seed, "expected an integer in [0, 2^63)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, v, f"expected an integer in [0, {MAX_LOGPROBS}] or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "expected non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "expected non-negative integers")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            flag(name)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", self.logit_bias, "expected a dict {token id: bias} or None")
            for tok, b in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    bad("logit_bias", self.logit_bias, f"expected non-negative integer token ids, found key {tok!r}")
                if not _is_num(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    bad("logit_bias", self.logit_bias,
                        f"expected biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], found {b!r} for token {tok}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", self.structured_outputs, "expected StructuredOutputsParams or None")
        if self.structured_outputs is not None and self.min_tokens > 0:
            bad("min_tokens", self.min_tokens, "expected 0 with structured_outputs (the grammar decides where the "
                                               "output may end)")
        self._validate_token_filters(bad)

    def _validate_token_filters(self, bad) -> None:
        """min_p, allowed_token_ids, bad_words, truncate_prompt_tokens (vLLM's ranges)."""
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "expected a number in [0, 1] (0 disables it)")
        ids = self.allowed_token_ids
        if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids)):
            bad("allowed_token_ids", ids, "expected a non-empty list of non-negative token ids or None")
        words = self.bad_words
        if words is not None and (not isinstance(words, list) or not all(isinstance(w, str) and w.strip()
                                                                         for w in words)):
            bad("bad_words", words, "expected a list of non-blank strings or None")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k >= 1 or k == -1)):
            bad("truncate_prompt_tokens", k, "expected an integer >= 1, -1 (the context's limit) or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_candidates(self) -> int:
        """Sequences the engine generates for this request (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the sampler must change this request's logits before sampling (penalties, bias, min_tokens,
        the token filters, a structured-output grammar)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.uses_token_filters
                or self.structured_outputs is not None)

    @property
    def uses_token_filters(self) -> bool:
        """min_p, allowed_token_ids or bad_words (m3serve.engine.token_filters)."""
        return (self.min_p > 0.0 and not self.greedy) or self.allowed_token_ids is not None or bool(self.bad_words)
