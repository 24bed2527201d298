"""Output token ids -> text, with vLLM's skip_special_tokens / spaces_between_special_tokens /
include_stop_str_in_output.

skip_special_tokens=True drops special tokens and decodes the rest as one sequence (the spacing flag has no
effect then). With skip_special_tokens=False the ids are cut into runs of ordinary tokens and single special
tokens, each decoded alone, joined by " " when spaces_between_special_tokens (the Hugging Face slow tokenizers'
and vLLM's reference meaning) and by "" otherwise - which equals one plain decode for byte-level BPE.
A request ended by EOS or a stop id does not show that token's text unless include_stop_str_in_output (vLLM).
"""

from __future__ import annotations

import weakref

from m3serve.engine.request import Request

_SPECIAL: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def special_ids(tokenizer) -> frozenset[int]:
    ids = _SPECIAL.get(tokenizer)
    if ids is None:
        ids = _SPECIAL[tokenizer] = frozenset(tokenizer.all_special_ids)
    return ids


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True,
           spaces_between_special_tokens: bool = True) -> str:
    if not ids:
        return ""
    if skip_special_tokens or not spaces_between_special_tokens:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    special = special_ids(tokenizer)
    pieces, run = [], []
    for t in ids:
        if t in special:
            if run:
                pieces.append(tokenizer.decode(run, skip_special_tokens=False))
                run = []
            pieces.append(tokenizer.decode([t], skip_special_tokens=False))
        else:
            run.append(t)
    if run:
        pieces.append(tokenizer.decode(run, skip_special_tokens=False))
    return " ".join(pieces)


def decode_output(tokenizer, req: Request, ids: list[int] | None = None) -> str:
    """The request's output ids (or `ids`) decoded with its own flags."""
    p = req.params
    return decode(tokenizer, req.output_token_ids if ids is None else ids, p.skip_special_tokens,
                  p.spaces_between_special_tokens)


def output_text(tokenizer, req: Request) -> str:
    """The text a finished (or running) request shows: cut at its stop string, without its stop token."""
    if tokenizer is None:
        return ""
    if req.finish_reason == "stop" and isinstance(req.stop_reason, str):
        return req.text
    ids = req.output_token_ids
    if req.finish_reason == "stop" and isinstance(req.stop_reason, int) and not req.params.include_stop_str_in_output:
        ids = ids[:-1]
    return decode_output(tokenizer, req, ids)
