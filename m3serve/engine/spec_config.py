"""`speculative_config` (vLLM's shape): {"method": "eagle3", "model": dir | None, "num_speculative_tokens": K,
"forced_acceptance": AL | None, "draft_seed": int, "disable_by_batch_size": N | None | "auto" | "auto:N"}, parsed and validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# With more requests than this in the engine (running + waiting) a step runs plainly (SpecDecoding.step). From the
# measured sweeps in bench/results/serve/ (embedded model, Eagle3 K=3, H200): speculation wins per user at
# concurrency 1 and loses served from concurrency 4 on, so 2 is the largest load assumed to still gain from it.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2


@dataclass
class SpecConfig:
    method: str = "eagle3"
    model: str | None = None              # drafter directory; None: random weights shaped for the target
    num_speculative_tokens: int = 3
    forced_acceptance: float | None = None  # mean acceptance length (tokens per verify step) to force
    draft_seed: int = 0                   # random drafter weights
    # vLLM's name and meaning: above this many requests in the engine (running + waiting) steps run without
    # speculation; None: always speculate;
    # "auto": per batch bucket, whichever kind of step measured faster per sequence (engine/spec_policy.py);
    # "auto:N": that measured choice while at most N requests are in the engine, plain steps above
    disable_by_batch_size: int | str | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_dict(cls, d: dict | SpecConfig) -> SpecConfig:
        if isinstance(d, SpecConfig):
            cfg = d
        else:
            if not isinstance(d, dict):
                raise TypeError(f"speculative_config: expected a dict, found {type(d).__name__}")
            unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; expected some of "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
            cfg = cls(**d)
        if cfg.method != "eagle3":
            raise ValueError(f"speculative_config.method: expected 'eagle3', found {cfg.method!r}")
        k = cfg.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens: expected an int in [1, 16], found {k!r}")
        fa = cfg.forced_acceptance
        if fa is not None and (not isinstance(fa, (int, float)) or not 1.0 <= fa <= k + 1):
            raise ValueError(f"speculative_config.forced_acceptance: expected a mean acceptance length in "
                             f"[1, {k + 1}] (num_speculative_tokens + 1), found {fa!r}")
        policy_form(cfg.disable_by_batch_size)
        if cfg.model is not None and not isinstance(cfg.model, str):
            raise TypeError(f"speculative_config.model: expected a directory path or None, found "
                            f"{type(cfg.model).__name__}")
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def policy_form(n) -> tuple[bool, int | None]:
    """disable_by_batch_size -> (measured, load limit): N -> (False, N), None -> (False, None), "auto" -> (True,
    None), "auto:N" -> (True, N). Anything else is a ValueError naming the field."""
    if n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        return False, n
    if isinstance(n, str) and (n == "auto" or n.startswith("auto:")):
        if n == "auto":
            return True, None
        limit = n[len("auto:"):]
        if limit.isdigit() and int(limit) >= 1:
            return True, int(limit)
    raise ValueError(f"speculative_config.disable_by_batch_size: expected an int >= 1, None (never disable), "
                     f"'auto' (measured per batch bucket: engine/spec_policy.py) or 'auto:N' (measured while at most "
                     f"N requests are in the engine), found {n!r}")


__all__ = ["SpecConfig", "DEFAULT_DISABLE_BY_BATCH_SIZE", "policy_form"]
