"""vLLM's token filters, as rows of the device penalty state (m3serve.engine.penalties): allowed_token_ids,
bad_words and min_p.

    allowed_token_ids   every other token's logit is -inf (a static ban, written once into the row's bias)
    bad_words           each word is tokenized as written and with one leading space (its mid-text form); a
                        one-token word is banned at every step (static); for a longer one only its last token is
                        banned, and only on steps where the output so far ends with its other tokens (vLLM's
                        rule: the word can never be completed). Those bans change per step, so the host
                        rewrites them before each step (refresh), and such requests leave the overlap loop.
    min_p               tokens whose probability after temperature is below min_p x the top one's are dropped:
                        p_v < min_p p_max  <=>  x_v - x_max < T ln(min_p) on the processed logits x (softmax of
                        x / T), so one per-row floor in logit units does it, temperature folded in.
"""

from __future__ import annotations

import math

from m3serve.engine.sampling_params import SamplingParams

TokenSeq = tuple[int, ...]


def bad_word_sequences(words: list[str], tokenizer) -> tuple[TokenSeq, ...]:
    """The token sequences that spell each bad word (as written and after a space), without duplicates."""
    if not words:
        return ()
    if tokenizer is None:
        raise ValueError("SamplingParams.bad_words: this model has no tokenizer to spell the words with; "
                         "use logit_bias or allowed_token_ids with token ids instead")
    out: dict[TokenSeq, None] = {}
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def static_bans(params: SamplingParams, sequences: tuple[TokenSeq, ...], vocab: int) -> list[int]:
    """Token ids banned at every step: outside allowed_token_ids, and the one-token bad words."""
    banned = {s[0] for s in sequences if len(s) == 1}
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        banned |= {t for t in range(vocab) if t not in allowed}
    return sorted(t for t in banned if 0 <= t < vocab)


def banned_statically(params: SamplingParams, sequences: tuple[TokenSeq, ...], tok: int) -> bool:
    """Whether static_bans holds `tok`."""
    return (params.allowed_token_ids is not None and tok not in params.allowed_token_ids) or (tok,) in sequences


def dynamic_bans(sequences: tuple[TokenSeq, ...], output_ids: list[int]) -> set[int]:
    """Last tokens of the multi-token bad words whose other tokens end the output so far."""
    out = set()
    for s in sequences:
        k = len(s) - 1
        if k >= 1 and len(output_ids) >= k and tuple(output_ids[-k:]) == s[:-1]:
            out.add(s[-1])
    return out


def has_dynamic_bans(sequences: tuple[TokenSeq, ...]) -> bool:
    return any(len(s) > 1 for s in sequences)


def min_p_floor(params: SamplingParams) -> float:
    """The row's floor on x_v - x_max in logit units; -inf where min_p is off (greedy: the argmax always stays)."""
    if params.min_p <= 0.0 or params.greedy:
        return -math.inf
    return params.temperature * math.log(params.min_p)


__all__ = ["bad_word_sequences", "banned_statically", "dynamic_bans", "has_dynamic_bans", "min_p_floor", "static_bans"]
