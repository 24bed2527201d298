"""The aiohttp application: routes, auth, error shaping, and ways to run it (foreground or in a thread).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.
Every error leaves as OpenAI-shaped JSON; an exception that is not an APIError is a server bug and the only
path to a 500. The app is run with handler_cancellation=True so that a client disconnect cancels its handler,
which aborts the request (see generate.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from m3serve.server.engine_loop import EngineLoop
from m3serve.server.errors import APIError
from m3serve.server.generate import respond
from m3serve.server.metrics import ServerMetrics
from m3serve.server.protocol import ModelInfo, parse_chat, parse_completion
from m3serve.server.sse import dumps

log = logging.getLogger("m3serve.server")


@dataclass
class ServerState:
    loop: EngineLoop
    info: ModelInfo
    metrics: ServerMetrics
    api_key: str | None
    created: int


STATE = web.AppKey("m3serve_state", ServerState)


def _error_response(e: APIError) -> web.Response:
    return web.Response(status=e.status, text=dumps(e.body()), content_type="application/json", headers=e.headers)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _check_strings(obj: object) -> None:
    """JSON's \\ud800-style escapes can give lone surrogates, which are not text: refuse them up front."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "the request body contains an invalid \\u escape "
                                    "(a lone UTF-16 surrogate)") from None
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


async def read_json(request: web.Request) -> object:
    raw = await request.read()
    if not raw.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if "\\u" in text:
        _check_strings(body)
    return body


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        if state.api_key is not None and request.path.startswith("/v1"):
            _authorize(request, state.api_key)
        resp = await handler(request)
    except APIError as e:
        resp = _error_response(e)
    except web.HTTPException as e:      # aiohttp's own: unknown route, wrong method, body too large
        if e.status < 400:
            raise
        resp = _error_response(APIError(e.status, f"{e.reason}: {request.method} {request.path}"
                                        if e.status in (404, 405) else e.text or e.reason))
    except asyncio.CancelledError:
        raise
    except Exception as e:              # a server bug: log it, answer 500 in the same shape
        log.exception("unhandled error on %s %s", request.method, request.path)
        resp = _error_response(APIError(500, f"internal server error: {type(e).__name__}"))
    state.metrics.http.inc(1, str(resp.status))
    return resp


def _authorize(request: web.Request, key: str) -> None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                                                             key.encode("utf-8")):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return await respond(request, state.loop, state.info, parse_completion(await read_json(request), state.info))


async def _chat(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return await respond(request, state.loop, state.info, parse_chat(await read_json(request), state.info))


async def _models(request: web.Request) -> web.Response:
    s = request.app[STATE]
    card = {"id": s.info.name, "object": "model", "created": s.created, "owned_by": "m3serve",
            "max_model_len": s.info.max_model_len, "vocab_size": s.info.vocab_size}
    return web.json_response({"object": "list", "data": [card]}, dumps=dumps)


async def _health(request: web.Request) -> web.Response:
    s = request.app[STATE]
    if not s.loop.alive:
        raise APIError(503, "the engine loop is not running", code="engine_unavailable")
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    s = request.app[STATE]
    return web.Response(text=s.metrics.render(s.loop.snapshot), content_type="text/plain",
                        headers={"X-Prometheus-Format": "0.0.4"})


def build_app(llm, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = 32 << 20, max_choices: int = 64) -> web.Application:
    """The app for an `LLM` (m3serve.llm.LLM). The engine loop thread starts and stops with the app."""
    import time
    metrics = ServerMetrics()
    engine = llm.engine
    info = ModelInfo(name=served_model_name or "m3serve",
                     vocab_size=llm.model.cfg.vocab_size, max_model_len=engine.max_model_len,
                     capacity_tokens=engine.capacity_tokens, tokenizer=llm.tokenizer, max_choices=max_choices)
    state = ServerState(EngineLoop(engine, metrics), info, metrics, api_key or None, int(time.time()))
    app = web.Application(middlewares=[_middleware], client_max_size=max_body_bytes)
    app[STATE] = state

    async def engine_ctx(app: web.Application):
        state.loop.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.loop.stop)

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def model_name(path: str | None) -> str:
    if not path:
        return "m3serve"
    return os.path.basename(os.path.normpath(path)) or "m3serve"


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    return runner, f"http://{_host_for_url(bound[0])}:{bound[1]}"


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
          on_ready: Callable[[str], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM (blocking). on_ready(url) is called once the socket listens."""
    async def main() -> None:
        runner, url = await start_site(app, host, port)
        if on_ready is not None:
            on_ready(url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    factory = None
    try:
        import uvloop  # optional: a faster event loop where installed
        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as r:
        r.run(main())


class BackgroundServer:
    """The app served from a thread with its own event loop (tests, notebooks, benchmarks).

        with BackgroundServer(build_app(llm)) as srv:
            OpenAI(base_url=srv.url + "/v1", api_key="x")...
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="m3serve-http", daemon=True)

    @property
    def state(self) -> ServerState:
        return self.app[STATE]

    @property
    def engine_loop(self) -> EngineLoop:
        return self.app[STATE].loop

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the server did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError("the server failed to start") from self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                runner, self.url = await start_site(self.app, self.host, self.port)
            except BaseException as e:
                self._error = e
                self._ready.set()
                return
            self.port = int(self.url.rsplit(":", 1)[1])
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()
        asyncio.run(main())

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
