"""Size limits checked before any work: body bytes, prompt characters, chat message count.

A request is refused on its size before its body is read (Content-Length), before it is tokenized (prompt
characters) and before it is templated (message count, conversation characters): tokenizing a 20 MB prompt
only to learn that it is longer than the context costs seconds of CPU and gigabytes of memory. Each limit is a
flag of `m3serve serve`; the error names the limit, its flag and the value found.

Shapes: none (JSON values and integers).
"""

from __future__ import annotations

from dataclasses import dataclass

from m3serve.server.errors import APIError

# A generous bound on the characters one token covers: the prompt-characters limit is max_model_len times this,
# so a prompt refused by it could not have fit in the context either (the embedded model's longest token has 28
# characters; byte-level BPE tokens average ~4).
CHARS_PER_TOKEN_BOUND = 32
DEFAULT_MAX_BODY_BYTES = 32 << 20
DEFAULT_MAX_MESSAGES = 2048
# A whole request's prompts (characters x candidates) may hold this many maximal prompts: more is not one
# client's fair share of the tokenizer threads, whatever each prompt's size.
REQUEST_CHARS_PROMPTS = 4
DEFAULT_MAX_JSON_DEPTH = 64          # OpenAI bodies nest < 10 levels; tool schemas a few more
DEFAULT_MAX_JSON_KEYS = 65536
JSON_VALUES_SLACK = 65536            # values beyond every prompt of token ids at full length (fields, tools)
DEFAULT_BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int          # a request body (after decompression) above this gets 413
    max_prompt_chars: int        # characters of one completion prompt, or of a whole chat conversation
    max_messages: int            # messages in one chat request
    max_request_chars: int | None = None     # all prompts' characters x candidates (default 4 x max_prompt_chars)
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_json_keys: int = DEFAULT_MAX_JSON_KEYS
    max_json_values: int = 64 * 8192 + JSON_VALUES_SLACK      # list items and fields, token ids included
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S             # the whole body must arrive within this

    def __post_init__(self) -> None:
        if self.max_request_chars is None:
            object.__setattr__(self, "max_request_chars", REQUEST_CHARS_PROMPTS * self.max_prompt_chars)
        for name in ("max_body_bytes", "max_prompt_chars", "max_messages", "max_request_chars", "max_json_depth",
                     "max_json_keys", "max_json_values"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RequestLimits.{name}: expected a positive integer, found {v!r}")
        if not (isinstance(self.body_timeout_s, (int, float)) and self.body_timeout_s > 0):
            raise ValueError(f"RequestLimits.body_timeout_s: expected seconds > 0, found {self.body_timeout_s!r}")

    @classmethod
    def for_model(cls, max_model_len: int, *, max_body_bytes: int | None = None, max_prompt_chars: int | None = None,
                  max_messages: int | None = None, max_request_chars: int | None = None, max_choices: int = 64,
                  body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> "RequestLimits":
        """Defaults: 32 MiB bodies, max_model_len x CHARS_PER_TOKEN_BOUND prompt characters, 2048 messages,
        4 such prompts per request, JSON values for max_choices prompts of token ids at full length."""
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len: expected a positive integer, found {max_model_len!r}")
        return cls(max_body_bytes=DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
                   max_prompt_chars=max_model_len * CHARS_PER_TOKEN_BOUND if max_prompt_chars is None
                   else max_prompt_chars,
                   max_messages=DEFAULT_MAX_MESSAGES if max_messages is None else max_messages,
                   max_request_chars=max_request_chars, max_json_values=max_choices * max_model_len + JSON_VALUES_SLACK,
                   body_timeout_s=body_timeout_s)


def body_too_large(limits: RequestLimits, found: int | None = None, what: str = "Content-Length:") -> APIError:
    said = f" ({what} {found})" if found is not None else ""
    return APIError(413, f"the request body is larger than this server accepts{said}: at most "
                         f"{limits.max_body_bytes} bytes (--max-body-bytes)", code="request_too_large",
                    headers={"Connection": "close"})


def check_content_length(content_length: int | None, limits: RequestLimits) -> None:
    """Refuse a declared body size before reading a byte of it (a chunked body is checked as it is read)."""
    if content_length is not None and content_length > limits.max_body_bytes:
        raise body_too_large(limits, content_length)


def _prompt_too_long(param: str, found: int, limits: RequestLimits, what: str) -> APIError:
    return APIError(400, f"'{param}': {what} has {found} characters; this server accepts at most "
                         f"{limits.max_prompt_chars} (--max-prompt-chars) before tokenizing, so that no prompt "
                         "much longer than the context is ever tokenized", param=param, code="prompt_too_long")


def check_completion_size(body: object, limits: RequestLimits) -> None:
    """Each text prompt of a /v1/completions body within max_prompt_chars. Malformed fields are left to the
    protocol's validation (which names them); only sizes are judged here."""
    if not isinstance(body, dict):
        return
    prompt = body.get("prompt")
    items = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    total = 0
    for k, p in enumerate(items):
        if isinstance(p, str):
            if len(p) > limits.max_prompt_chars:
                raise _prompt_too_long("prompt", len(p), limits, "the prompt" if isinstance(prompt, str)
                                       else f"prompt {k}")
            total += len(p)
    candidates = max(_count(body.get("n")), _count(body.get("best_of")))
    if total * candidates > limits.max_request_chars:
        raise APIError(400, f"'prompt': this request's {len(items)} prompts have {total} characters, x {candidates} "
                            f"candidates (n / best_of) = {total * candidates}; this server accepts at most "
                            f"{limits.max_request_chars} per request (--max-request-chars) before tokenizing",
                       param="prompt", code="request_too_large")


def _count(v: object) -> int:
    """n / best_of as far as the budget goes: a valid count, else 1 (the protocol names a bad value)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1


def text_chars(value: object) -> int:
    """Characters in every string of a JSON value (keys included), without recursion (any nesting depth)."""
    total, stack = 0, [value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return total


def check_chat_size(body: object, limits: RequestLimits) -> None:
    """A /v1/chat/completions body: at most max_messages messages, and at most max_prompt_chars characters in
    the messages and tools together (they all become one prompt)."""
    if not isinstance(body, dict):
        return
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise APIError(400, f"'messages': {len(messages)} messages; this server accepts at most "
                            f"{limits.max_messages} (--max-messages)", param="messages", code="too_many_messages")
    chars = text_chars(messages) + text_chars(body.get("tools"))
    if chars > limits.max_prompt_chars:
        raise _prompt_too_long("messages", chars, limits, "the conversation (messages and tools)")
