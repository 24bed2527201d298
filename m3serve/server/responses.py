"""Response bodies in OpenAI's shapes: completions, chat completions, their stream chunks, logprobs, usage."""

from __future__ import annotations

import time
import uuid

from m3serve.server.sse import finite


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_str(tokenizer, tid: int) -> str:
    """A token's text for logprobs; without a tokenizer, vLLM's `token_id:N` form. A token that is part of a
    UTF-8 character decodes to U+FFFD, which would collide with every other such token as a top_logprobs key:
    those use the vocabulary's own (unique) token string instead."""
    if tokenizer is None:
        return f"token_id:{tid}"
    s = tokenizer.decode([tid], skip_special_tokens=False)
    if "\ufffd" in s:
        raw = tokenizer.convert_ids_to_tokens(tid)
        return raw if isinstance(raw, str) else s
    return s


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely of an engine logprob entry (top-k plus the sampled token), best first."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tokenizer, ids: list[int], lps: list[dict[int, float]], k: int, offset: int) -> dict:
    """`logprobs` of a /v1/completions choice; text_offset counts from `offset` (the text already sent)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, entry in zip(ids, lps):
        s = token_str(tokenizer, tid)
        tokens.append(s)
        token_lps.append(finite(entry[tid]))
        tops.append({token_str(tokenizer, t): finite(v) for t, v in _top(entry, k)})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(tokenizer, prompt_ids: list[int], prompt_entries: list[dict[int, float] | None], ids: list[int],
                  lps: list[dict[int, float]], k: int) -> dict:
    """`logprobs` of a completion choice with echo, as vLLM returns it: the prompt tokens first (the first has
    no logprob: null, and null top_logprobs), then the generated ones; text_offset runs over both."""
    head = completion_logprobs(tokenizer, prompt_ids[1:], prompt_entries[1:], k, 0)
    first = token_str(tokenizer, prompt_ids[0])
    shift = len(first)
    out = {"tokens": [first] + head["tokens"], "token_logprobs": [None] + head["token_logprobs"],
           "top_logprobs": [None] + head["top_logprobs"], "text_offset": [0] + [o + shift for o in head["text_offset"]]}
    end = shift + sum(len(t) for t in head["tokens"])
    tail = completion_logprobs(tokenizer, ids, lps, k, end)
    for key in out:
        out[key] += tail[key]
    return out


def chat_logprobs(tokenizer, ids: list[int], lps: list[dict[int, float]], k: int) -> dict:
    def item(tid: int, v: float) -> dict:
        s = token_str(tokenizer, tid)
        return {"token": s, "logprob": finite(v), "bytes": list(s.encode("utf-8", "replace"))}
    content = []
    for tid, entry in zip(ids, lps):
        d = item(tid, entry[tid])
        d["top_logprobs"] = [item(t, v) for t, v in _top(entry, k)]
        content.append(d)
    return {"content": content}


def prompt_logprobs(tokenizer, entries: list[dict[int, float] | None], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null (the first has none) or {"<token id>": {"logprob", "rank",
    "decoded_token"}} holding the top-k (ranks 1..k, best first) and the prompt token itself, whose rank is null
    when it lies outside the top-k (not computed); the values the offline RequestOutput.prompt_logprobs holds."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({str(tid): {"logprob": finite(v), "rank": i + 1 if i < k else None,
                               "decoded_token": tokenizer.decode([tid]) if tokenizer is not None else None}
                    for i, (tid, v) in enumerate(entry.items())})
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(engine_reason: str | None) -> str | None:
    """The engine's stop/length pass through; an aborted choice (server shutdown) reads as 'stop'."""
    if engine_reason is None:
        return None
    return engine_reason if engine_reason in ("stop", "length") else "stop"


def completion_body(rid: str, created: int, model: str, choices: list[dict], use: dict | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use, "system_fingerprint": None}


def chat_body(rid: str, created: int, model: str, choices: list[dict], use: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use, "system_fingerprint": None}


def _chunk(kind: str, rid: str, created: int, model: str, choices: list[dict], use: dict | None) -> dict:
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
            "system_fingerprint": None}
    if use is not None:
        body["usage"] = use
    return body


def completion_chunk(rid: str, created: int, model: str, choices: list[dict], use: dict | None = None) -> dict:
    return _chunk("text_completion", rid, created, model, choices, use)


def chat_chunk(rid: str, created: int, model: str, choices: list[dict], use: dict | None = None) -> dict:
    return _chunk("chat.completion.chunk", rid, created, model, choices, use)
