"""Server-sent events, written by hand: each event is `data: <json>\\n\\n`; a stream ends with `data: [DONE]`."""

from __future__ import annotations

import json
import math
from json.encoder import encode_basestring

DONE = b"data: [DONE]\n\n"


def finite(x: float) -> float:
    """JSON has no -Infinity/NaN; a log-probability of -inf (a token the model rules out) is sent as -9999."""
    return x if math.isfinite(x) else -9999.0


def dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def event(obj: object) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


def scalar(v: str | int | float | None) -> str:
    """dumps(v) for a None, str or int (what stream chunks carry per token), without the encoder's setup."""
    if v is None:
        return "null"
    if type(v) is str:
        return encode_basestring(v)          # the encoder's own escaping with ensure_ascii=False
    if type(v) is int:
        return int.__repr__(v)
    return dumps(v)


def int_list(ids: list[int]) -> str:
    """dumps(ids) for a list of Python ints (token ids: the engine hands them over as ints)."""
    return "[" + ",".join(map(str, ids)) + "]"
