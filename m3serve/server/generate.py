"""/v1/completions and /v1/chat/completions: submit the choices, then answer in one body or as SSE.

Any way the handler ends (finished, client gone, cancelled by aiohttp on disconnect, error) passes through
`finally: abort(job)`, which cancels unfinished choices and frees their KV pages before the next engine step.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

from aiohttp import web

from m3serve.server import responses as R
from m3serve.server.detok import TextStream, full_text
from m3serve.server.engine_loop import Delta, EngineDead, EngineLoop, Job, ShuttingDown
from m3serve.server.errors import APIError
from m3serve.server.protocol import GenRequest, ModelInfo
from m3serve.server.sse import DONE, dumps, event

log = logging.getLogger("m3serve.server")


@dataclass
class _Choice:
    ids: list[int] = field(default_factory=list)
    lps: list[dict[int, float]] = field(default_factory=list)
    finish: str | None = None
    final_text: str | None = None


def _param_of(message: str) -> str | None:
    m = re.match(r"SamplingParams\.(\w+)", message)
    if m:
        return m.group(1)
    return "prompt" if message.startswith("prompt") else None


async def submit(loop: EngineLoop, req: GenRequest) -> Job:
    choices = req.choices()
    if loop.max_queue is not None and len(choices) > loop.max_queue:
        param = "n" if req.n > 1 else "prompt"
        raise APIError(400, f"'{param}': this request has {len(choices)} choices ({len(req.prompts)} prompts x n = "
                            f"{req.n}), more than the waiting queue holds (--max-queue {loop.max_queue}), so it could "
                            "never be admitted", param=param, code="too_many_choices")
    try:
        return await loop.submit(choices, time.monotonic())
    except OverflowError as e:
        raise APIError(429, f"The server is overloaded: {e}. Retry later.", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from None
    except ShuttingDown as e:
        raise APIError(503, f"{e}; no new requests are admitted", code="server_shutting_down") from None
    except EngineDead as e:
        raise APIError(503, f"The engine is not running: {e}", code="engine_unavailable") from None


def _prompt_text(info: ModelInfo, req: GenRequest, p: int) -> str:
    if req.prompt_texts[p] is not None:
        return req.prompt_texts[p]
    return info.tokenizer.decode(req.prompts[p], skip_special_tokens=True) if info.tokenizer is not None else ""


def _prompt_tokens(req: GenRequest) -> int:
    return sum(len(p) for p in req.prompts)


async def respond(request: web.Request, loop: EngineLoop, info: ModelInfo, req: GenRequest) -> web.StreamResponse:
    job = await submit(loop, req)
    try:
        if req.stream:
            return await _stream(request, info, req, job)
        return await _whole(info, req, job)
    finally:
        loop.abort(job)


# ---------------------------------------------------------------------------------------- one body
async def _whole(info: ModelInfo, req: GenRequest, job: Job) -> web.Response:
    choices = [_Choice() for _ in job.choices]
    while job.remaining > 0:
        for d in await job.next():
            if d.error:
                raise APIError(d.error_status, d.error, code=d.error_code)
            c = choices[d.index]
            c.ids += d.token_ids
            if d.logprobs:
                c.lps += d.logprobs
            if d.finish_reason is not None:
                c.finish, c.final_text = d.finish_reason, d.final_text
    rid, created, tok = R.new_id("cmpl" if req.kind == "completion" else "chatcmpl"), R.now(), info.tokenizer
    out = []
    for i, c in enumerate(choices):
        text = c.final_text if c.final_text is not None else full_text(tok, c.ids)
        prefix = _prompt_text(info, req, i // req.n) if req.echo else ""
        if req.kind == "completion":
            lp = R.completion_logprobs(tok, c.ids, c.lps, req.logprobs, len(prefix)) \
                if req.logprobs is not None else None
            d = {"index": i, "text": prefix + text, "logprobs": lp, "finish_reason": R.finish_reason(c.finish)}
        else:
            lp = R.chat_logprobs(tok, c.ids, c.lps, req.logprobs) if req.logprobs is not None else None
            d = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                 "finish_reason": R.finish_reason(c.finish)}
        if req.return_token_ids:
            d["token_ids"] = c.ids
            d["prompt_token_ids"] = req.prompts[i // req.n]
        out.append(d)
    use = R.usage(_prompt_tokens(req), sum(len(c.ids) for c in choices))
    make = R.completion_body if req.kind == "completion" else R.chat_body
    return web.Response(text=dumps(make(rid, created, info.name, out, use)), content_type="application/json")


# ---------------------------------------------------------------------------------------- SSE
class _ChunkWriter:
    def __init__(self, info: ModelInfo, req: GenRequest):
        self.info, self.req = info, req
        self.rid = R.new_id("cmpl" if req.kind == "completion" else "chatcmpl")
        self.created = R.now()
        self.make = R.completion_chunk if req.kind == "completion" else R.chat_chunk
        self.texts = [TextStream(info.tokenizer, req.stop) for _ in range(len(req.prompts) * req.n)]
        self.offsets = [0] * len(self.texts)     # characters sent per choice (text_offset of logprobs)
        self.completion_tokens = 0

    def chunk(self, choice: dict) -> bytes:
        return event(self.make(self.rid, self.created, self.info.name, [choice]))

    def opening(self) -> bytes:
        """Chat: a first chunk per choice with the role. Completions with echo: the prompt text."""
        out = b""
        for i in range(len(self.texts)):
            if self.req.kind == "chat":
                out += self.chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
            elif self.req.echo:
                text = _prompt_text(self.info, self.req, i // self.req.n)
                self.offsets[i] = len(text)
                out += self.chunk({"index": i, "text": text, "logprobs": None, "finish_reason": None})
        return out

    def delta(self, d: Delta) -> bytes:
        ts = self.texts[d.index]
        text = ts.push(d.token_ids) if d.finish_reason is None else ts.finish(d.final_text, d.token_ids)
        if not text and not d.token_ids and d.finish_reason is None:
            return b""
        self.completion_tokens += len(d.token_ids)
        req, tok = self.req, self.info.tokenizer
        fin = R.finish_reason(d.finish_reason)
        if req.kind == "completion":
            lp = R.completion_logprobs(tok, d.token_ids, d.logprobs or [], req.logprobs, self.offsets[d.index]) \
                if req.logprobs is not None else None
            c = {"index": d.index, "text": text, "logprobs": lp, "finish_reason": fin}
        else:
            lp = R.chat_logprobs(tok, d.token_ids, d.logprobs or [], req.logprobs) \
                if req.logprobs is not None else None
            c = {"index": d.index, "delta": {"content": text} if text or fin is None else {}, "logprobs": lp,
                 "finish_reason": fin}
        if req.return_token_ids:
            c["token_ids"] = d.token_ids
        self.offsets[d.index] += len(text)
        return self.chunk(c)

    def usage(self) -> bytes:
        use = R.usage(_prompt_tokens(self.req), self.completion_tokens)
        return event(self.make(self.rid, self.created, self.info.name, [], use))


async def _stream(request: web.Request, info: ModelInfo, req: GenRequest, job: Job) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    w = _ChunkWriter(info, req)
    try:
        await resp.prepare(request)
        first = w.opening()
        if first:
            await resp.write(first)
        while job.remaining > 0:
            data = b""
            for d in await job.next():
                if d.error:                 # an engine fault (500) or the shutdown (503): an error event, then [DONE]
                    err = APIError(d.error_status, d.error, code=d.error_code)
                    await resp.write(event(err.body()) + DONE)
                    return resp
                data += w.delta(d)
            if data:
                await resp.write(data)
        await resp.write((w.usage() if req.include_usage else b"") + DONE)
        await resp.write_eof()
    except ConnectionError:          # the client went away mid-stream; `finally` in respond() aborts the job
        log.debug("client disconnected from %s", request.path)
    return resp
