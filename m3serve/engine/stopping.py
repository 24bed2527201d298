"""When a request ends, checked after each appended token (vLLM's rules).

Order: EOS (unless ignore_eos), stop ids, stop strings, max_tokens, the context limit. min_tokens: EOS and stop
ids end the output only once min_tokens tokens are out, stop strings only after that (a stop string whose text
lies wholly inside the first min_tokens tokens' text is never matched). Stop strings are searched only in the text
that is new since the last check (plus len(stop) - 1 characters before it), so each token costs one decode.
"""

from __future__ import annotations

from m3serve.engine.detokenize import decode_output
from m3serve.engine.request import Request


def stop_hit(req: Request, tok: int, eos_ids, tokenizer, max_model_len: int) -> tuple[str, str | int | None] | None:
    """(finish_reason, stop_reason) when `tok`, just appended, ends the request; else None. A stop string also
    sets req.text (cut before it, or after it with include_stop_str_in_output)."""
    p = req.params
    n_out = len(req.output_token_ids)
    if n_out >= p.min_tokens:
        if not p.ignore_eos and tok in eos_ids:
            return "stop", tok
        if tok in p.stop_token_ids:
            return "stop", tok
    if p.stop and tokenizer is not None and n_out > p.min_tokens:
        hit = _stop_string(req, tokenizer)
        if hit is not None:
            return "stop", hit
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return "length", None
    if req.num_known_tokens >= max_model_len:
        return "length", None
    return None


def _stable_len(text: str) -> int:
    """Characters that later tokens cannot change (a trailing U+FFFD may be half of a character)."""
    return len(text.rstrip("\ufffd"))


def _stop_string(req: Request, tokenizer) -> str | None:
    p = req.params
    text = decode_output(tokenizer, req)
    scanned = req.stop_scan_chars
    if scanned is None:      # first check: the text of earlier tokens (the min_tokens ones) is not searched
        scanned = _stable_len(decode_output(tokenizer, req, req.output_token_ids[:-1])) \
            if len(req.output_token_ids) > 1 else 0
    for s in p.stop:
        at = text.find(s, max(0, scanned - len(s) + 1))
        if at >= 0:
            req.text = text[:at + len(s)] if p.include_stop_str_in_output else text[:at]
            return s
    req.stop_scan_chars = _stable_len(text)
    return None
