"""Server-sent events, written by hand: each event is `data: <json>\\n\\n`; a stream ends with `data: [DONE]`."""

from __future__ import annotations

import json
import math

DONE = b"data: [DONE]\n\n"


def finite(x: float) -> float:
    """JSON has no -Infinity/NaN; a log-probability of -inf (a token the model rules out) is sent as -9999."""
    return x if math.isfinite(x) else -9999.0


def dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def event(obj: object) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"
