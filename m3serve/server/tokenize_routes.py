"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /version, GET|POST /ping.

    /tokenize     {"prompt": str, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt": true,
                  "tools": [...]} -> {"count", "max_model_len", "tokens", "token_strs"} (token_strs with
                  "return_token_strs": true, else null). Chat messages are rendered as /v1/chat/completions
                  renders them (special-token text in a message stays text).
    /detokenize   {"tokens": [ids]} -> {"prompt": text}
    /tokenizer_info  the tokenizer's configuration (eos/bos/pad tokens, chat template, ...): what lm-eval's
                  remote tokenizer reads before it uses /tokenize and /detokenize.
    /version      {"version": m3serve's version}
    /ping         200, empty: a load balancer's liveness probe (vLLM's SageMaker route); 503 once shutdown began
                  or the engine loop died, as /health.
They sit outside /v1 (vLLM's paths), so an API key does not guard them, as in vLLM.
"""

from __future__ import annotations

from aiohttp import web

import m3serve
from m3serve.server.chat_tokens import ChatTemplateError, chat_encoder
from m3serve.server.engine_loop import SHUTTING_DOWN
from m3serve.server.errors import APIError, bad_field
from m3serve.server.protocol import ModelInfo, check_model, parse_messages
from m3serve.server.sse import dumps

MAX_DETOKENIZE = 1 << 20        # token ids in one /detokenize body


def _tokenizer(info: ModelInfo):
    if info.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; it works on token ids only", code="no_tokenizer")
    return info.tokenizer


def tokenize(body: object, info: ModelInfo) -> dict:
    """A /tokenize body -> its answer (runs on the prep pool: templating and encoding)."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(body).__name__}")
    check_model(body, info)
    tok = _tokenizer(info)
    strs = body.get("return_token_strs")
    if strs is not None and not isinstance(strs, bool):
        raise bad_field("return_token_strs", strs, "true or false")
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "expected exactly one of 'prompt' (text) or 'messages' (a conversation)",
                       param="prompt")
    if "prompt" in body:
        prompt, special = body["prompt"], body.get("add_special_tokens", True)
        if not isinstance(prompt, str):
            raise bad_field("prompt", prompt, "a string")
        if not isinstance(special, bool):
            raise bad_field("add_special_tokens", special, "true or false")
        ids = list(tok.encode(prompt, add_special_tokens=special))
    else:
        ids = _chat_ids(body, tok)
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if strs else None}


def _chat_ids(body: dict, tok) -> list[int]:
    messages = parse_messages(body["messages"])
    gen = body.get("add_generation_prompt", True)
    if not isinstance(gen, bool):
        raise bad_field("add_generation_prompt", gen, "true or false")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_field("tools", tools, "a list of tools")
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; tokenize a 'prompt' instead",
                       param="messages")
    try:
        ids, _ = chat_encoder(tok).encode(messages, tools or None, add_generation_prompt=gen)
    except ChatTemplateError as e:
        raise APIError(400, f"'messages': the chat template rejected them: {str(e)[:200]}", param="messages") from None
    return list(ids)


def detokenize(body: object, info: ModelInfo) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(body).__name__}")
    check_model(body, info)
    tok = _tokenizer(info)
    ids = body.get("tokens")
    vocab = info.vocab_size
    if not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE or \
            not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise bad_field("tokens", ids, f"a list of at most {MAX_DETOKENIZE} token ids in [0, {vocab})")
    return {"prompt": tok.decode(ids)}


def tokenizer_info(info: ModelInfo) -> dict:
    """The tokenizer's settings as JSON (vLLM's /tokenizer_info: its init kwargs plus the chat template)."""
    tok = _tokenizer(info)
    out = {"tokenizer_class": type(tok).__name__, "model_max_length": info.max_model_len,
           "vocab_size": info.vocab_size}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        out[name] = value if isinstance(value, str) else None
    out["chat_template"] = getattr(tok, "chat_template", None)
    out["added_special_tokens"] = list(getattr(tok, "all_special_tokens", []))
    return out


def version() -> dict:
    return {"version": m3serve.__version__}


def _ready(s) -> None:
    if s.draining:
        raise APIError(503, SHUTTING_DOWN, code="server_shutting_down")
    if not s.loop.alive:
        raise APIError(503, "the engine loop is not running", code="engine_unavailable")


def add_routes(app: web.Application, state_key, read_json) -> None:
    """The routes, on `app`. state_key: the app's ServerState key; read_json(request): the body as JSON (the
    app's reader, with its limits and error shapes)."""
    async def _tokenize(request: web.Request) -> web.Response:
        s = request.app[state_key]
        body = await read_json(request)
        return web.json_response(await s.prepare(tokenize, body, s.info), dumps=dumps)

    async def _detokenize(request: web.Request) -> web.Response:
        s = request.app[state_key]
        body = await read_json(request)
        return web.json_response(await s.prepare(detokenize, body, s.info), dumps=dumps)

    async def _tokenizer_info(request: web.Request) -> web.Response:
        return web.json_response(tokenizer_info(request.app[state_key].info), dumps=dumps)

    async def _version(request: web.Request) -> web.Response:
        return web.json_response(version())

    async def _ping(request: web.Request) -> web.Response:
        _ready(request.app[state_key])
        return web.Response(status=200)

    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/tokenizer_info", _tokenizer_info)
    app.router.add_get("/version", _version)
    app.router.add_get("/ping", _ping)
    app.router.add_post("/ping", _ping)
