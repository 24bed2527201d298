"""/v1/completions and /v1/chat/completions: submit one engine request group per prompt, then answer in one body
or as SSE. Choice i belongs to prompt i // n; its text follows the offline API's rules (detok.py), its
prompt_logprobs are vLLM's (per completion choice, at the top of a chat completion; whole responses only).

Any way the handler ends (finished, client gone, cancelled by aiohttp on disconnect, error) passes through
`finally: abort(job)`, which cancels unfinished choices and frees their KV pages before the next engine step.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring

from aiohttp import web

from m3serve.server import responses as R
from m3serve.server.chat_output import ChatDeltaStream, whole_message
from m3serve.server.detok import TextStream, choice_text
from m3serve.server.engine_loop import (ENGINE_DEAD_CODE, Delta, EngineDead, EngineFailed, EngineLoop, Job,
                                        ShuttingDown)
from m3serve.server.errors import APIError
from m3serve.server.protocol import GenRequest, ModelInfo
from m3serve.server.sse import DONE, dumps, event, int_list, scalar

log = logging.getLogger("m3serve.server")


@dataclass
class _Choice:
    ids: list[int] = field(default_factory=list)
    lps: list[dict[int, float]] = field(default_factory=list)
    finish: str | None = None
    stop_reason: str | int | None = None
    final_text: str | None = None


def _param_of(message: str) -> str | None:
    m = re.match(r"SamplingParams\.(\w+)", message)
    if m:
        return m.group(1)
    return "prompt" if message.startswith("prompt") else None


async def submit(loop: EngineLoop, req: GenRequest) -> Job:
    count = req.num_candidates
    if loop.max_queue is not None and count > loop.max_queue:
        best_of = req.params[0].best_of
        param = "best_of" if best_of is not None and best_of > req.n else "n" if req.n > 1 else "prompt"
        raise APIError(400, f"'{param}': this request has {count} sequences ({len(req.prompts)} prompts x "
                            f"{best_of or req.n} candidates), more than the waiting queue holds (--max-queue "
                            f"{loop.max_queue}), so it could never be admitted", param=param, code="too_many_choices")
    try:
        return await loop.submit(req.submissions(), time.monotonic())
    except OverflowError as e:
        raise APIError(429, f"The server is overloaded: {e}. Retry later.", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from None
    except EngineFailed as e:
        raise APIError(503, str(e), code=ENGINE_DEAD_CODE) from None
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
    choices = [_Choice() for _ in range(job.num_choices)]
    prompt_lps: list[list | None] = [None] * len(req.prompts)
    while job.remaining > 0:
        for d in await job.next():
            if d.error:
                raise APIError(d.error_status, d.error, code=d.error_code)
            c = choices[d.index]
            c.ids += d.token_ids
            if d.logprobs:
                c.lps += d.logprobs
            if d.finish_reason is not None:
                c.finish, c.stop_reason, c.final_text = d.finish_reason, d.stop_reason, d.final_text
            if d.prompt_logprobs is not None:
                prompt_lps[d.index // req.n] = d.prompt_logprobs
    rid, created, tok = R.new_id("cmpl" if req.kind == "completion" else "chatcmpl"), R.now(), info.tokenizer
    shown = [None if lps is None or req.prompt_logprobs is None else R.prompt_logprobs(tok, lps, req.prompt_logprobs)
             for lps in prompt_lps]
    out = []
    if req.echo_only:      # max_tokens = 0: the one computed token is not part of the answer
        for c in choices:
            c.ids, c.lps, c.finish, c.stop_reason, c.final_text = [], [], "length", None, ""
    for i, c in enumerate(choices):
        p = i // req.n
        text = choice_text(tok, c.ids, req.params[p], c.finish, c.stop_reason, c.final_text)
        prefix = _prompt_text(info, req, p) if req.echo else ""
        if req.kind == "completion":
            if req.echo_logprobs:
                lp = R.echo_logprobs(tok, req.prompts[p], prompt_lps[p], c.ids, c.lps, req.logprobs)
            elif req.logprobs is not None:
                lp = R.completion_logprobs(tok, c.ids, c.lps, req.logprobs, len(prefix))
            else:
                lp = None
            d = {"index": i, "text": prefix + text, "logprobs": lp, "finish_reason": R.finish_reason(c.finish),
                 "stop_reason": c.stop_reason, "prompt_logprobs": shown[p]}
        else:
            lp = R.chat_logprobs(tok, c.ids, c.lps, req.logprobs) if req.logprobs is not None else None
            message, called = whole_message(req.chat, text)
            fin = R.finish_reason(c.finish)
            d = {"index": i, "message": message, "logprobs": lp,
                 "finish_reason": "tool_calls" if called and fin == "stop" else fin, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            d["token_ids"] = c.ids
            d["prompt_token_ids"] = req.prompts[p]
        out.append(d)
    use = R.usage(_prompt_tokens(req), sum(len(c.ids) for c in choices))
    if req.kind == "completion":
        body = R.completion_body(rid, created, info.name, out, use)
    else:
        body = R.chat_body(rid, created, info.name, out, use)
        body["prompt_logprobs"] = shown[0]            # vLLM: one prompt, so at the top of a chat completion
    return web.Response(text=dumps(body), content_type="application/json")


# ---------------------------------------------------------------------------------------- SSE
class _ChunkWriter:
    def __init__(self, info: ModelInfo, req: GenRequest):
        self.info, self.req = info, req
        self.rid = R.new_id("cmpl" if req.kind == "completion" else "chatcmpl")
        self.created = R.now()
        self.make = R.completion_chunk if req.kind == "completion" else R.chat_chunk
        self.texts = [TextStream(info.tokenizer, req.stop, req.params[i // req.n]) for i in range(req.num_choices)]
        self.offsets = [0] * len(self.texts)     # characters sent per choice (text_offset of logprobs)
        # chat: reasoning / tool-call parsing per choice (m3serve.server.chat_output)
        self.chat = [ChatDeltaStream(req.chat) for _ in self.texts] if req.chat is not None else None
        self.completion_tokens = 0
        # Every chunk of this response has the same envelope around its one choice: encode it once, as the
        # bytes before and after the choice (event(make(..., [choice])) == head + dumps(choice) + tail).
        envelope = dumps(self.make(self.rid, self.created, self.info.name, []))
        cut = envelope.rindex('"choices":[]') + len('"choices":[')
        self._head = b"data: " + envelope[:cut].encode("utf-8")
        self._tail = envelope[cut:].encode("utf-8") + b"\n\n"

    def chunk(self, choice: dict) -> bytes:
        return self._head + dumps(choice).encode("utf-8") + self._tail

    def _plain_completion_chunk(self, index: int, text: str, fin: str | None, stop_reason,
                                token_ids: list[int] | None) -> bytes:
        """chunk() of a completion choice without logprobs, written field by field (the per-token case)."""
        fin_s = "null" if fin is None else scalar(fin)
        stop_s = "null" if stop_reason is None else scalar(stop_reason)
        ids_s = "" if token_ids is None else ',"token_ids":' + int_list(token_ids)
        body = (f'{{"index":{index},"text":{encode_basestring(text)},"logprobs":null,"finish_reason":{fin_s},'
                f'"stop_reason":{stop_s}{ids_s}}}')
        return self._head + body.encode("utf-8") + self._tail

    def opening(self) -> bytes:
        """Chat: a first chunk per choice with the role. Completions with echo: the prompt text."""
        out = b""
        for i in range(len(self.texts)):
            if self.req.kind == "chat":
                out += self.chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None, "stop_reason": None})
            elif self.req.echo:
                text = _prompt_text(self.info, self.req, i // self.req.n)
                self.offsets[i] = len(text)
                out += self.chunk({"index": i, "text": text, "logprobs": None, "finish_reason": None,
                                   "stop_reason": None})
        return out

    def delta(self, d: Delta) -> bytes:
        ts = self.texts[d.index]
        text = ts.push(d.token_ids) if d.finish_reason is None else \
            ts.finish(d.final_text, d.token_ids, d.finish_reason, d.stop_reason)
        if not text and not d.token_ids and d.finish_reason is None:
            return b""
        self.completion_tokens += len(d.token_ids)
        req, tok = self.req, self.info.tokenizer
        fin = R.finish_reason(d.finish_reason)
        if req.kind == "completion" and req.logprobs is None:
            self.offsets[d.index] += len(text)
            return self._plain_completion_chunk(d.index, text, fin, d.stop_reason,
                                                d.token_ids if req.return_token_ids else None)
        if req.kind == "completion":
            lp = R.completion_logprobs(tok, d.token_ids, d.logprobs or [], req.logprobs, self.offsets[d.index]) \
                if req.logprobs is not None else None
            c = {"index": d.index, "text": text, "logprobs": lp, "finish_reason": fin, "stop_reason": d.stop_reason}
        elif self.chat is not None:
            return self._chat_delta(d, text, fin)
        else:
            lp = R.chat_logprobs(tok, d.token_ids, d.logprobs or [], req.logprobs) \
                if req.logprobs is not None else None
            c = {"index": d.index, "delta": {"content": text} if text or fin is None else {}, "logprobs": lp,
                 "finish_reason": fin, "stop_reason": d.stop_reason}
        if req.return_token_ids:
            c["token_ids"] = d.token_ids
        self.offsets[d.index] += len(text)
        return self.chunk(c)

    def _chat_delta(self, d: Delta, text: str, fin: str | None) -> bytes:
        """Chat chunks through the choice's reasoning / tool-call parser: the piece's delta, then at the end
        what the parser held back, in the chunk that carries finish_reason."""
        req, tok, cs = self.req, self.info.tokenizer, self.chat[d.index]
        lp = R.chat_logprobs(tok, d.token_ids, d.logprobs or [], req.logprobs) if req.logprobs is not None else None
        deltas = [cs.push(text)]
        if fin is not None:
            deltas.append(cs.finish())
            fin = "tool_calls" if cs.called and fin == "stop" else fin
        out = b""
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            extra = k == 0 and (lp is not None or req.return_token_ids)
            if not delta and not (last and fin is not None) and not extra:
                continue
            c = {"index": d.index, "delta": delta, "logprobs": lp if k == 0 else None,
                 "finish_reason": fin if last else None, "stop_reason": d.stop_reason if last else None}
            if req.return_token_ids:
                c["token_ids"] = d.token_ids if k == 0 else []
            out += self.chunk(c)
        self.offsets[d.index] += len(text)
        return out

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
