"""Request validation: a parsed JSON body -> GenRequest, or an APIError (4xx) that names the field.

Follows OpenAI's /v1/completions and /v1/chat/completions fields; null means "unset" for every optional field.
Penalties follow OpenAI's ranges (presence_penalty, frequency_penalty in [-2, 2]; logit_bias {"token id": bias in
[-100, 100]}). Extensions (vLLM's names and meanings): top_k, ignore_eos, stop_token_ids, return_token_ids,
repetition_penalty (> 0), min_tokens (<= max_tokens), skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output, prompt_logprobs (not with stream, as vLLM), best_of (>= n; not with stream when > n,
as OpenAI), min_p, allowed_token_ids, bad_words, truncate_prompt_tokens (the prompt's last k tokens). Completions
with echo and logprobs return the prompt tokens' logprobs first in the `logprobs` object (null for the first
token), as vLLM does, and max_tokens = 0 with echo scores the prompt without generating (lm-eval's
log-likelihood requests); neither streams. n and best_of become one engine request group per prompt (SamplingParams.n / best_of).

Fields nobody defines are accepted and ignored with one warning naming them: vLLM's rule (its request models allow
extra fields and log "fields were present in the request but ignored"; OpenAI itself answers 400). Fields that
OpenAI or vLLM define but this engine cannot honour (suffix, beam search, ...) are refused with a 400 naming them
unless they hold their neutral value, rather than silently ignored. Tools, tool_choice and structured output
(response_format, guided_*, structured_outputs) are read by m3serve.server.tools.
"""

from __future__ import annotations

import heapq
import logging
import math
import re
from dataclasses import dataclass, field

from m3serve.engine.sampling_params import SamplingParams
from m3serve.server.chat_tokens import ChatTemplateError, chat_encoder
from m3serve.server.errors import APIError, bad_field, one_line, short_repr
from m3serve.server.reasoning import prompt_opens_reasoning
from m3serve.server.tools import STRUCTURED_FIELDS, ChatPlan, chat_plan, normalize_messages_tools, structured_request

log = logging.getLogger("m3serve.server")

MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


@dataclass
class ModelInfo:
    """What validation needs to know about the served model (read-only, safe off the engine thread)."""
    name: str
    vocab_size: int
    max_model_len: int
    capacity_tokens: int             # tokens the whole KV cache holds
    tokenizer: object | None = None
    max_choices: int = 64            # prompts x candidates (best_of, else n) in one request
    compile_grammar: object | None = None   # the engine's thread-safe grammar compiler (structured output)


@dataclass
class GenRequest:
    kind: str                               # "completion" | "chat"
    prompts: list[list[int]]                # token ids, one list per prompt
    prompt_texts: list[str | None]
    params: list[SamplingParams]            # one per prompt, carrying n and best_of (one engine request group)
    n: int = 1                              # choices returned per prompt
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None             # top-k alternatives per token; None: no logprobs
    prompt_logprobs: int | None = None      # top-k alternatives per prompt token; None: none
    return_token_ids: bool = False
    stop: list[str] = field(default_factory=list)
    echo_logprobs: bool = False             # echo with logprobs: the prompt's logprobs lead each choice's logprobs
    echo_only: bool = False                 # max_tokens = 0 with echo: the prompt alone (one token is computed, not shown)
    chat: ChatPlan | None = None            # chat: tools, tool_choice, reasoning (m3serve.server.chat_output)

    @property
    def num_choices(self) -> int:
        """Choices in the response: choice index = prompt * n + rank within the prompt."""
        return len(self.prompts) * self.n

    @property
    def num_candidates(self) -> int:
        """Sequences the engine generates (best_of, else n, per prompt)."""
        return sum(p.num_candidates for p in self.params)

    def submissions(self) -> list[tuple[list[int], str | None, SamplingParams]]:
        """One engine request per prompt; the engine runs its n / best_of candidates as a group (seed + i)."""
        return list(zip(self.prompts, self.prompt_texts, self.params))


# ---------------------------------------------------------------------------------------- field readers
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    # An int is always finite (and math.isfinite() overflows on one with 309+ digits).
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _int(body: dict, name: str, lo: int, hi: int, default):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise bad_field(name, v, f"an integer in [{lo}, {hi}]")
    return v


def _num(body: dict, name: str, lo: float, hi: float, default, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise bad_field(name, v, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_field(name, v, "true or false")
    return v


def _unsupported(body: dict, name: str, neutral) -> None:
    """A field the engine cannot honour: only its neutral value (or null) is accepted."""
    v = body.get(name)
    if v is None:
        return
    if isinstance(neutral, dict):
        if not isinstance(v, dict):
            raise bad_field(name, v, "an object")
        ok = not v
    elif isinstance(neutral, str):
        if not isinstance(v, str):
            raise bad_field(name, v, "a string")
        ok = v == neutral
    else:
        if not _is_num(v):
            raise bad_field(name, v, "a number")
        ok = v == neutral
    if not ok:
        raise APIError(400, f"'{name}' = {short_repr(v)} is not supported by this server (only "
                            f"{short_repr(neutral)} or null)", param=name)


def _neutral_only(body: dict, name: str, neutrals: tuple) -> None:
    """A field OpenAI or vLLM defines that this engine cannot honour: null or one of its neutral values only."""
    v = body.get(name)
    if v is None or any(type(v) is type(x) and v == x for x in neutrals):
        return
    allowed = ", ".join([short_repr(x) for x in neutrals] + ["null"])
    raise APIError(400, f"'{name}' = {short_repr(v)} is not supported by this server (only {allowed})", param=name)


# What each endpoint reads (OpenAI's names and vLLM's extensions).
_SAMPLING_FIELDS = frozenset({
    "model", "n", "best_of", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "user", "stream",
    "stream_options", "max_tokens", "logprobs", "prompt_logprobs", "return_token_ids", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "min_p", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens"})
# Defined by OpenAI or vLLM, not available here (they change the output, so ignoring them would mislead):
# {name: neutral values}; null is always accepted.
_UNAVAILABLE = {
    "use_beam_search": (False,),
    "logprob_token_ids": (), "return_tokens_as_token_ids": (False,),
    "logits_processors": ()}
_COMPLETION_UNAVAILABLE = {**_UNAVAILABLE, "add_special_tokens": (True,)}
_CHAT_UNAVAILABLE = {**_UNAVAILABLE, "add_special_tokens": (False,), "echo": (False,),
                     "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
                     "documents": (), "functions": (), "function_call": ()}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "suffix"} | set(_COMPLETION_UNAVAILABLE) | \
    set(STRUCTURED_FIELDS)
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                                  "parallel_tool_calls", "chat_template_kwargs"} | set(_CHAT_UNAVAILABLE) | \
    set(STRUCTURED_FIELDS)
MAX_NAMED_IGNORED = 8


def _screen_fields(body: dict, known: frozenset, unavailable: dict, endpoint: str) -> None:
    """Refuse unavailable features (400 naming the field); log once the fields nobody defines (vLLM's rule)."""
    for name, neutrals in unavailable.items():
        _neutral_only(body, name, neutrals)
    ignored = [k for k in body if k not in known]
    if ignored:
        more = len(ignored) - MAX_NAMED_IGNORED      # (nsmallest: a body of a million keys is not sorted)
        names = ", ".join(short_repr(k, 40) for k in heapq.nsmallest(MAX_NAMED_IGNORED, ignored)) + \
            (f" and {more} more" if more > 0 else "")
        log.warning("%s: the following fields were present in the request but ignored: %s", endpoint,
                    one_line(names, 500))


def _check_model(body: dict, info: ModelInfo) -> None:
    m = body.get("model")
    if m is None:
        return
    if not isinstance(m, str):
        raise bad_field("model", m, "a string")
    if m != info.name:
        raise APIError(404, f"The model {short_repr(m)} does not exist; this server serves {info.name!r}",
                       param="model", code="model_not_found")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_field("stop", v, "a non-empty string or a list of non-empty strings")
    if len(items) > MAX_STOP:
        raise bad_field("stop", v, f"at most {MAX_STOP} strings")
    return list(items)


def _stop_token_ids(body: dict, vocab: int) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > MAX_STOP_TOKEN_IDS or \
            not all(_is_int(t) and 0 <= t < vocab for t in v):
        raise bad_field("stop_token_ids", v, f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab})")
    return list(v)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(opts, dict):
        raise bad_field("stream_options", opts, "an object")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise bad_field("stream_options.include_usage", usage, "true or false")
    return stream, bool(usage)


def _prompt_limit(info: ModelInfo) -> int:
    return min(info.max_model_len, info.capacity_tokens) - 1


def _check_prompt_len(ids: list[int], info: ModelInfo, param: str) -> None:
    if not ids:
        raise APIError(400, f"'{param}': the prompt is empty (at least one token is needed)", param=param)
    limit = _prompt_limit(info)
    if len(ids) > limit:
        raise APIError(400, f"'{param}': the prompt has {len(ids)} tokens, but this model's context limit "
                            f"(max_model_len) is {info.max_model_len} tokens and the KV cache holds "
                            f"{info.capacity_tokens}; a prompt may have at most {limit} tokens so that at least one "
                            "can be generated", param=param, code="context_length_exceeded")


def _max_tokens(explicit: int | None, name: str, ids: list[int], info: ModelInfo, default: int | None) -> int:
    """vLLM's rule: prompt + max_tokens must fit one sequence (the context and the whole KV cache), else 400;
    unset, it is clamped to what fits. A request admitted here is never cut short for want of room."""
    fits = min(info.max_model_len, info.capacity_tokens)
    room = fits - len(ids)
    if explicit is None:
        return room if default is None else min(default, room)
    if explicit > room:
        raise APIError(400, f"'{name}' = {explicit} plus the prompt's {len(ids)} tokens exceeds the {fits} tokens "
                            f"one sequence can hold (this model's context limit, max_model_len, is "
                            f"{info.max_model_len} tokens and the KV cache holds {info.capacity_tokens}); at most "
                            f"{room} can be generated for this prompt", param=name, code="context_length_exceeded")
    return explicit


def _repetition_penalty(body: dict) -> float:
    v = body.get("repetition_penalty")
    if v is None:
        return 1.0
    if not _is_num(v) or not 0 < v <= 1e6:
        raise bad_field("repetition_penalty", v, "a number > 0 (1 disables it)")
    return float(v)


def _logit_bias(body: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's map {"token id": bias}; JSON keys are strings of decimal digits."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_field("logit_bias", v, f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} {{token id: bias}} entries")
    out = {}
    for key, bias in v.items():
        tok = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 else None
        if tok is None or tok >= vocab:
            raise APIError(400, f"'logit_bias': expected token id keys in [0, {vocab}), found {short_repr(key)}",
                           param="logit_bias")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise APIError(400, f"'logit_bias': expected biases in [-100, 100], found {short_repr(bias)} for token "
                                f"{tok}", param="logit_bias")
        out[tok] = float(bias)
    return out


def _token_ids(body: dict, name: str, vocab: int) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not v or len(v) > vocab or not all(_is_int(t) and 0 <= t < vocab for t in v):
        raise bad_field(name, v, f"a non-empty list of token ids in [0, {vocab})")
    return list(v)


def _bad_words(body: dict) -> list[str] | None:
    v = body.get("bad_words")
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_STOP_TOKEN_IDS or not all(isinstance(w, str) and w.strip() for w in v):
        raise bad_field("bad_words", v, f"a list of at most {MAX_STOP_TOKEN_IDS} non-blank strings")
    return list(v)


def _truncate_prompt_tokens(body: dict, info: ModelInfo) -> int | None:
    v = body.get("truncate_prompt_tokens")
    if v is None:
        return None
    if not _is_int(v) or not (1 <= v <= info.max_model_len or v == -1):
        raise bad_field("truncate_prompt_tokens", v, f"an integer in [1, {info.max_model_len}] or -1 (the context's "
                                                     "limit)")
    return v


def _truncated(ids: list[int], k: int | None, info: ModelInfo) -> list[int]:
    """The prompt's last k tokens (-1: as many as leave room for one generated token)."""
    if k is None:
        return ids
    return ids[-(_prompt_limit(info) if k == -1 else k):]


def _common(body: dict, info: ModelInfo) -> dict:
    """Sampling and text fields shared by both endpoints -> SamplingParams keyword arguments (no max_tokens,
    logprobs, n / best_of)."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_field("user", user, "a string")
    return dict(temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
                top_p=_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
                top_k=_int(body, "top_k", -1, 2 ** 31 - 1, 0),
                seed=_int(body, "seed", 0, 2 ** 63 - 1, None),
                stop=_stop(body),
                stop_token_ids=_stop_token_ids(body, info.vocab_size),
                ignore_eos=_bool(body, "ignore_eos", False),
                presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
                frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
                repetition_penalty=_repetition_penalty(body),
                min_tokens=_int(body, "min_tokens", 0, info.max_model_len, 0),
                logit_bias=_logit_bias(body, info.vocab_size),
                skip_special_tokens=_bool(body, "skip_special_tokens", True),
                spaces_between_special_tokens=_bool(body, "spaces_between_special_tokens", True),
                include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
                min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
                allowed_token_ids=_token_ids(body, "allowed_token_ids", info.vocab_size),
                bad_words=_bad_words(body),
                truncate_prompt_tokens=_truncate_prompt_tokens(body, info))


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    k = _int(body, "prompt_logprobs", 0, MAX_LOGPROBS, None)
    if k is not None and stream:     # vLLM's rule: prompt logprobs only come in a whole response
        raise APIError(400, "'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")
    return k


def _n(body: dict, info: ModelInfo, num_prompts: int, stream: bool) -> tuple[int, int | None]:
    """(n, best_of): n choices per prompt out of best_of (>= n) candidates the engine generates."""
    n = _int(body, "n", 1, info.max_choices, 1)
    best_of = _int(body, "best_of", 1, info.max_choices, None)
    if best_of is not None and best_of < n:
        raise APIError(400, f"'best_of' = {best_of}: expected an integer >= n ({n})", param="best_of")
    if best_of is not None and best_of > n and stream:    # OpenAI: best_of results cannot be streamed
        raise APIError(400, f"'best_of' = {best_of} > n = {n} cannot be streamed (the best n are known only at "
                            "the end)", param="best_of")
    per_prompt = best_of or n
    if per_prompt * num_prompts > info.max_choices:
        name = "best_of" if best_of is not None and best_of > n else "n"
        raise APIError(400, f"'{name}': {num_prompts} prompts x {name} = {per_prompt} gives {per_prompt * num_prompts} "
                            f"sequences; at most {info.max_choices} per request", param=name)
    return n, best_of


def _params(**kw) -> SamplingParams:
    """The fields were checked above; should SamplingParams still refuse one, it is a 400 naming it too."""
    if kw.get("max_tokens") is not None and kw.get("min_tokens", 0) > kw["max_tokens"]:
        raise bad_field("min_tokens", kw["min_tokens"], f"an integer in [0, max_tokens = {kw['max_tokens']}]")
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        m = re.match(r"SamplingParams\.(\w+)", str(e))
        raise APIError(400, str(e), param=m.group(1) if m else None) from None


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(body).__name__}", param=None)
    return body


# ---------------------------------------------------------------------------------------- /v1/completions
def _completion_items(v: object, info: ModelInfo) -> list[str | list[int]]:
    """The prompts of a /v1/completions body, each a text (to tokenize) or checked token ids."""
    want = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(v, str):
        items: list = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        items = [v]
    elif isinstance(v, list) and v and (all(isinstance(s, str) for s in v) or all(isinstance(s, list) for s in v)):
        items = v
    else:
        raise bad_field("prompt", v, want)
    if len(items) > info.max_choices:
        raise APIError(400, f"'prompt': {len(items)} prompts; at most {info.max_choices} per request", param="prompt")
    for p in items:
        if isinstance(p, str):
            if info.tokenizer is None:
                raise APIError(400, "'prompt': this model has no tokenizer, so prompts must be token ids",
                               param="prompt")
        else:
            if not p:
                raise bad_field("prompt", p, "a non-empty list of token ids")
            bad = next((k for k, t in enumerate(p) if not (_is_int(t) and 0 <= t < info.vocab_size)), None)
            if bad is not None:
                raise APIError(400, f"'prompt': expected token ids in [0, {info.vocab_size}), found "
                                    f"{short_repr(p[bad])} at position {bad}", param="prompt")
    return items


@dataclass
class CompletionPlan:
    """A /v1/completions body validated in everything but its prompts' token counts: `texts` still need
    tokenizing (finish_completion takes their ids). Splitting the two lets the server tokenize prompt by prompt
    as separate pool tasks, so one request with many prompts cannot hold the tokenizer threads."""
    info: ModelInfo
    items: list                     # per prompt: its text (to tokenize) or its token ids
    fields: dict                    # GenRequest fields
    sampling: dict                  # SamplingParams keyword arguments shared by every prompt
    max_tokens: int | None
    truncate: int | None            # truncate_prompt_tokens

    @property
    def texts(self) -> list[str]:
        return [p for p in self.items if isinstance(p, str)]


def plan_completion(body: object, info: ModelInfo) -> CompletionPlan:
    body = _object(body)
    _check_model(body, info)
    _screen_fields(body, COMPLETION_FIELDS, _COMPLETION_UNAVAILABLE, "/v1/completions")
    if "prompt" not in body:
        raise APIError(400, "'prompt' is required", param="prompt")
    common = _common(body, info)
    items = _completion_items(body["prompt"], info)
    _unsupported(body, "suffix", "")
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS, None)
    echo = _bool(body, "echo", False)
    stream, include_usage = _stream(body)
    max_tokens = _int(body, "max_tokens", 0, info.max_model_len, None)
    echo_only, engine_prompt_lps = _echo_mode(echo, logprobs, max_tokens, stream)
    if echo_only:
        max_tokens = 1       # the engine computes one token: the response shows the prompt only
    n, best_of = _n(body, info, len(items), stream)       # prompts x candidates judged before tokenizing
    prompt_logprobs = _prompt_logprobs(body, stream)
    engine_prompt_lps = max(prompt_logprobs or 0, engine_prompt_lps) if engine_prompt_lps is not None \
        else prompt_logprobs
    fields = dict(n=n, stream=stream, include_usage=include_usage, echo=echo, logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs, return_token_ids=_bool(body, "return_token_ids", False),
                  stop=common["stop"], echo_logprobs=echo and logprobs is not None, echo_only=echo_only)
    constraint = structured_request(body, compile_grammar=info.compile_grammar)
    sampling = dict(logprobs=logprobs, n=n, best_of=best_of, prompt_logprobs=engine_prompt_lps,
                    structured_outputs=constraint, **common)
    return CompletionPlan(info, items, fields, sampling, max_tokens, common["truncate_prompt_tokens"])


def finish_completion(plan: CompletionPlan, encoded: list[list[int]]) -> GenRequest:
    """`encoded`: the token ids of plan.texts, in order."""
    info, ids_of_texts = plan.info, iter(encoded)
    prompts, texts = [], []
    for p in plan.items:
        if isinstance(p, str):
            prompts.append(list(next(ids_of_texts)))
            texts.append(p)
        else:
            prompts.append(list(p))
            texts.append(None)
    if plan.truncate is not None:   # a truncated prompt's text is its tokens' (echo shows what the model saw)
        cut = [_truncated(ids, plan.truncate, info) for ids in prompts]
        texts = [t if len(c) == len(ids) else None for t, c, ids in zip(texts, cut, prompts)]
        prompts = cut
    for ids in prompts:
        _check_prompt_len(ids, info, "prompt")
    params = [_params(max_tokens=_max_tokens(plan.max_tokens, "max_tokens", ids, info, 16), **plan.sampling)
              for ids in prompts]
    return GenRequest("completion", prompts, texts, params, **plan.fields)


def parse_completion(body: object, info: ModelInfo) -> GenRequest:
    plan = plan_completion(body, info)
    return finish_completion(plan, [info.tokenizer.encode(t) for t in plan.texts])


def _echo_mode(echo: bool, logprobs: int | None, max_tokens: int | None, stream: bool) -> tuple[bool, int | None]:
    """(echo_only, prompt logprobs the engine must compute for echo) of a completion request."""
    if max_tokens == 0 and not echo:
        raise bad_field("max_tokens", 0, "an integer >= 1 (0 only with 'echo': true, which scores the prompt)")
    if echo and stream and (logprobs is not None or max_tokens == 0):
        raise APIError(400, "'echo' with 'logprobs' or 'max_tokens' = 0 is not available when 'stream' is true "
                            "(the prompt's logprobs come in a whole response)", param="echo")
    return max_tokens == 0, (logprobs if echo and logprobs is not None else None)


# ---------------------------------------------------------------------------------------- /v1/chat/completions
def _content(msg: dict, i: int) -> str | None:
    c = msg.get("content")
    name = f"messages[{i}].content"
    if c is None or isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad_field(name, c, "a string or a list of text parts")
    texts = []
    for j, part in enumerate(c):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"'{name}[{j}]': expected {{'type': 'text', 'text': str}} (only text is supported), "
                                f"found {short_repr(part)}", param=name)
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(v: object) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad_field("messages", v, "a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad_field(f"messages[{i}]", m, "an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_field(f"messages[{i}].role", role, f"one of {sorted(CHAT_ROLES)}")
        content = _content(m, i)
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
            raise bad_field(f"messages[{i}].tool_calls", tool_calls, "a list, on an assistant message")
        if role == "function":            # OpenAI's legacy tool result: a tool message named after the function
            role = "tool"
        if content is None and not (role == "assistant" and tool_calls):
            raise APIError(400, f"'messages[{i}].content' is required", param=f"messages[{i}].content")
        msg = {"role": "system" if role == "developer" else role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_field(f"messages[{i}].{key}", m[key], "a string")
                msg[key] = m[key]
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    return normalize_messages_tools(out)


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs: extra variables for the template (e.g. enable_thinking); not the names the
    renderer itself takes."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_field("chat_template_kwargs", v, "an object of template variables")
    taken = {"messages", "tools", "documents", "tokenize", "add_generation_prompt", "continue_final_message",
             "chat_template", "return_dict", "return_tensors", "tokenizer_kwargs", "padding", "truncation",
             "max_length", "return_assistant_tokens_mask", "kwargs"}
    bad = [k for k in v if not isinstance(k, str) or not k.isidentifier() or k in taken]
    if bad:
        raise APIError(400, f"'chat_template_kwargs': {short_repr(bad[0])} cannot be set (reserved, or not a name)",
                       param="chat_template_kwargs")
    return dict(v)


def _chat_prompt(messages: list[dict], tools: list | None, info: ModelInfo,
                 template_vars: dict | None = None) -> tuple[list[int], str]:
    tok = info.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    # Special-token text inside the messages is encoded as ordinary text: a user cannot forge a turn.
    try:
        return chat_encoder(tok).encode(messages, tools, template_vars=template_vars)
    except ChatTemplateError as e:
        raise APIError(400, f"'messages': the chat template rejected them: {short_repr(str(e), 200)}",
                       param="messages") from None
    except Exception as e:    # the encoder only ever sees these messages: whatever it raises on them is a 400
        log.info("chat encoding failed: %s: %s", type(e).__name__, one_line(str(e)))
        raise APIError(400, f"'messages': could not be encoded ({type(e).__name__}: {short_repr(str(e), 200)})",
                       param="messages") from None


def parse_chat(body: object, info: ModelInfo) -> GenRequest:
    body = _object(body)
    _check_model(body, info)
    _screen_fields(body, CHAT_FIELDS, _CHAT_UNAVAILABLE, "/v1/chat/completions")
    if "messages" not in body:
        raise APIError(400, "'messages' is required", param="messages")
    messages = _messages(body["messages"])
    plan = chat_plan(body)
    constraint = structured_request(body, plan, compile_grammar=info.compile_grammar)
    common = _common(body, info)
    want_lp = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS, None)
    if top is not None and not want_lp:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = (top or 0) if want_lp else None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, 1, info.max_model_len, None)
    ids, text = _chat_prompt(messages, plan.tools, info, _template_kwargs(body))
    plan.reasoning_prefilled = prompt_opens_reasoning(text)
    if common["truncate_prompt_tokens"] is not None:
        cut = _truncated(ids, common["truncate_prompt_tokens"], info)
        ids, text = cut, (text if len(cut) == len(ids) else None)
    _check_prompt_len(ids, info, "messages")
    stream, include_usage = _stream(body)
    n, best_of = _n(body, info, 1, stream)
    prompt_logprobs = _prompt_logprobs(body, stream)
    params = [_params(max_tokens=_max_tokens(max_tokens, name, ids, info, None), logprobs=logprobs, n=n,
                      best_of=best_of, prompt_logprobs=prompt_logprobs, structured_outputs=constraint, **common)]
    return GenRequest("chat", [ids], [text], params, n=n, stream=stream, include_usage=include_usage,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      return_token_ids=_bool(body, "return_token_ids", False), stop=common["stop"], chat=plan)


# for the utility endpoints (tokenize_routes.py): the same model check and message validation
check_model = _check_model
parse_messages = _messages
