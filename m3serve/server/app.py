"""The aiohttp application: routes, auth, limits, error shaping, shutdown, and ways to run it (foreground or in
a thread).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, GET /health,
GET /metrics, and vLLM's utility routes (tokenize_routes.py). Every error leaves as OpenAI-shaped JSON (the HTTP parser's own errors too, see http_errors.py);
an exception that is not an APIError is a server bug and the only path to a 500. The app is run with
handler_cancellation=True so that a client disconnect cancels its handler, which aborts the request (see
generate.py).

Work is refused on size first (limits.py): a declared body too large gets 413 before it is read (an
`Expect: 100-continue` one before `100 Continue`), prompts and conversations too long get 400 before they are
tokenized. Parsing, templating and tokenizing run on a small thread pool, never on the event loop, so a large
request cannot stall the other streams or /health.

Shutdown (graceful_stop): the app stops admitting (503), the engine loop ends every request in flight with a
503 (a stream: an error event, then [DONE]), and once those handlers returned, or the grace period passed, the
listener closes and the engine thread stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web
from aiohttp.http import HttpVersion11

from m3serve.server import tokenize_routes
from m3serve.server.engine_loop import SHUTTING_DOWN, EngineLoop
from m3serve.server.errors import APIError, short_repr
from m3serve.server.body import content_coding, decode_json, read_wire
from m3serve.server.generate import respond
from m3serve.server.health import DEAD_EXIT_DELAY_S, engine_dead_error, wait_stop_or_death
from m3serve.server.http_errors import JSONErrorAppRunner
from m3serve.server.limits import (DEFAULT_BODY_TIMEOUT_S, RequestLimits, check_chat_size, check_completion_size,
                                   check_content_length)
from m3serve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from m3serve.server.metrics import NAME_SCHEMES, ServerMetrics
from m3serve.server.middleware import check_content_type, needs_key, set_server_header
from m3serve.server.protocol import ModelInfo, finish_completion, parse_chat, plan_completion
from m3serve.server.shutdown import ShutdownSignals
from m3serve.server.sse import dumps

log = logging.getLogger("m3serve.server")


DEFAULT_GRACE_S = 5.0          # shutdown: how long requests in flight get to end before their connections close
PREP_THREADS = 2               # threads that parse, template and tokenize requests (the tokenizer drops the GIL)
LINGER_S = 1.0                 # after a refused, unread body: how long to drain it so the client reads the answer
KEEP_ALIVE_S = 5.0             # --timeout-keep-alive (uvicorn's and so vLLM's default)
HEADER_TIMEOUT_S = 10.0        # --header-timeout


@dataclass
class ServerState:
    loop: EngineLoop
    info: ModelInfo
    metrics: ServerMetrics
    api_key: str | None
    created: int
    limits: RequestLimits
    prep: concurrent.futures.ThreadPoolExecutor
    public_metrics: bool = False              # /metrics without the API key
    keep_alive_s: float = KEEP_ALIVE_S        # an idle connection is closed after this
    header_timeout_s: float = HEADER_TIMEOUT_S    # a request's head must arrive within this of its first byte
    draining: bool = False                    # shutdown began: /v1 answers 503, /health 503
    inflight: int = 0                         # /v1 requests inside the middleware (event-loop side)
    idle: asyncio.Event = field(default_factory=asyncio.Event)    # set while inflight == 0
    dead: asyncio.Event = field(default_factory=asyncio.Event)    # set once the engine died (health.py)

    def __post_init__(self) -> None:
        self.idle.set()

    async def prepare(self, fn, *args):
        """fn(*args) on the prep pool: parsing, templating and tokenizing never run on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)


STATE = web.AppKey("m3serve_state", ServerState)


def _error_response(e: APIError) -> web.Response:
    resp = web.Response(status=e.status, text=dumps(e.body()), content_type="application/json", headers=e.headers)
    if e.headers.get("Connection", "").lower() == "close":
        resp.force_close()
    return resp


async def read_json(request: web.Request, check_size: Callable[[object, RequestLimits], None] | None = None) -> object:
    """The body as JSON, sized by check_size: read on the event loop (body.read_wire: limit and deadline),
    decoded, shape-checked, parsed and sized on the prep pool (body.decode_json)."""
    state = request.app[STATE]
    coding = content_coding(request.headers.get("Content-Encoding"))
    raw = await read_wire(request, state.limits)
    return await state.prepare(_decode_and_size, raw, coding, state.limits, check_size)


def _decode_and_size(raw: bytes, coding: str, limits: RequestLimits, check_size) -> object:
    body = decode_json(raw, coding, limits)
    if check_size is not None:
        check_size(body, limits)
    return body


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    api = request.path.startswith("/v1")
    if api:
        state.inflight += 1
        state.idle.clear()
    try:
        if api and state.loop.dead is not None:
            raise engine_dead_error(state.loop.dead)
        if api and state.draining:
            raise _shutting_down()
        check_content_length(request.content_length, state.limits)
        if state.api_key is not None and needs_key(request.path, state.public_metrics):
            _authorize(request, state.api_key)
        check_content_type(request)
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
    finally:
        if api:
            state.inflight -= 1
            if state.inflight == 0:
                state.idle.set()
    state.metrics.http.inc(1, str(resp.status))
    return resp


def _shutting_down() -> APIError:
    return APIError(503, f"{SHUTTING_DOWN}; no new requests are admitted", code="server_shutting_down",
                    headers={"Connection": "close"})


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: answer the body's fate before the client sends it (413, 503, 417 or 100)."""
    state = request.app[STATE]
    if request.version != HttpVersion11:
        return None
    expect = request.headers.get("Expect", "")
    try:
        if expect.lower() != "100-continue":
            raise APIError(417, f"unsupported Expect header {short_repr(expect)}; only 100-continue is",
                           headers={"Connection": "close"})
        if state.draining:
            raise _shutting_down()
        check_content_length(request.content_length, state.limits)
    except APIError as e:
        state.metrics.http.inc(1, str(e.status))       # answered here, before the middleware
        return _error_response(e)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0      # the interim response is not the start of the real one
    return None


def _authorize(request: web.Request, key: str) -> None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                                                             key.encode("utf-8")):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request, check_completion_size)
    plan = await state.prepare(plan_completion, body, state.info)
    # One pool task per prompt: another request's work gets its turn between two of this one's prompts.
    encoded = [await state.prepare(state.info.tokenizer.encode, text) for text in plan.texts]
    return await respond(request, state.loop, state.info, finish_completion(plan, encoded))


async def _chat(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request, check_chat_size)
    return await respond(request, state.loop, state.info, await state.prepare(parse_chat, body, state.info))


def _card(s: ServerState) -> dict:
    return {"id": s.info.name, "object": "model", "created": s.created, "owned_by": "m3serve",
            "max_model_len": s.info.max_model_len, "vocab_size": s.info.vocab_size,
            "device": s.loop.engine.model.device.type}


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(request.app[STATE])]}, dumps=dumps)


async def _model(request: web.Request) -> web.Response:
    s = request.app[STATE]
    wanted = request.match_info["model_id"]
    if wanted != s.info.name:
        raise APIError(404, f"The model {short_repr(wanted)} does not exist; this server serves {s.info.name!r}",
                       param="model", code="model_not_found")
    return web.json_response(_card(s), dumps=dumps)


async def _health(request: web.Request) -> web.Response:
    s = request.app[STATE]
    if s.loop.dead is not None:
        raise engine_dead_error(s.loop.dead)
    if s.draining:
        raise APIError(503, SHUTTING_DOWN, code="server_shutting_down")
    if not s.loop.alive:
        raise APIError(503, "the engine loop is not running", code="engine_unavailable")
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    s = request.app[STATE]
    names = request.query.get("names", "m3serve")      # ?names=vllm: vLLM's metrics as vllm:<name> (metrics.py)
    if names not in NAME_SCHEMES:
        raise APIError(400, f"'names' = {short_repr(names)}: expected one of {list(NAME_SCHEMES)}", param="names")
    return web.Response(text=s.metrics.render(s.loop.snapshot, names), headers={"Content-Type": METRICS_CONTENT_TYPE})


def build_app(llm, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int | None = None, max_prompt_chars: int | None = None, max_messages: int | None = None,
              max_request_chars: int | None = None, max_choices: int = 64, prep_threads: int = PREP_THREADS,
              public_metrics: bool = False, timeout_keep_alive: float = KEEP_ALIVE_S,
              header_timeout: float = HEADER_TIMEOUT_S, body_timeout: float = DEFAULT_BODY_TIMEOUT_S
              ) -> web.Application:
    """The app for an `LLM` (m3serve.llm.LLM). The engine loop thread starts and stops with the app. Limits left
    None take RequestLimits.for_model's defaults (32 MiB bodies, max_model_len x 32 prompt characters, 2048
    messages, 4 such prompts per request). Timeouts in seconds: an idle keep-alive connection is closed after
    timeout_keep_alive, a request head must arrive within header_timeout and its body within body_timeout."""
    for name, v in (("timeout_keep_alive", timeout_keep_alive), ("header_timeout", header_timeout)):
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"{name}: expected seconds > 0, found {v!r}")
    metrics = ServerMetrics(served_model_name or "m3serve")
    engine = llm.engine
    info = ModelInfo(name=served_model_name or "m3serve",
                     vocab_size=llm.model.cfg.vocab_size, max_model_len=engine.max_model_len,
                     capacity_tokens=engine.capacity_tokens, tokenizer=llm.tokenizer, max_choices=max_choices,
                     compile_grammar=getattr(engine, "compile_grammar", None))
    limits = RequestLimits.for_model(engine.max_model_len, max_body_bytes=max_body_bytes,
                                     max_prompt_chars=max_prompt_chars, max_messages=max_messages,
                                     max_request_chars=max_request_chars, max_choices=max_choices,
                                     body_timeout_s=body_timeout)
    prep = concurrent.futures.ThreadPoolExecutor(max_workers=prep_threads, thread_name_prefix="m3serve-prep")
    state = ServerState(EngineLoop(engine, metrics), info, metrics, api_key or None, int(time.time()), limits, prep,
                        public_metrics=public_metrics, keep_alive_s=timeout_keep_alive,
                        header_timeout_s=header_timeout)
    app = web.Application(middlewares=[_middleware], client_max_size=limits.max_body_bytes)
    app[STATE] = state
    app.on_response_prepare.append(set_server_header)

    async def engine_ctx(app: web.Application):
        aloop = asyncio.get_running_loop()
        state.loop.on_dead = lambda reason: aloop.call_soon_threadsafe(state.dead.set)
        state.loop.start()
        yield
        state.prep.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, state.loop.stop)

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/completions", _completions, expect_handler=_expect)
    app.router.add_post("/v1/chat/completions", _chat, expect_handler=_expect)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    tokenize_routes.add_routes(app, STATE, read_json)   # /tokenize, /detokenize, /tokenizer_info, /version, /ping
    return app


async def drain(app: web.Application, grace_s: float = DEFAULT_GRACE_S) -> None:
    """Shutdown, first half: stop admitting, end every request in flight (the engine loop sends each a 503), and
    wait up to grace_s for their handlers to return."""
    state = app[STATE]
    state.draining = True
    state.loop.drain()
    if state.inflight:
        try:
            await asyncio.wait_for(state.idle.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("shutdown: %d requests still open after %.1f s; closing their connections", state.inflight,
                        grace_s)


async def graceful_stop(runner: web.AppRunner, grace_s: float = DEFAULT_GRACE_S) -> None:
    """drain(), then close the listener and the connections (a handler still running is cancelled after
    grace_s) and stop the engine loop (app cleanup)."""
    await drain(runner.app, grace_s)
    await runner.cleanup()


def model_name(path: str | None) -> str:
    if not path:
        return "m3serve"
    return os.path.basename(os.path.normpath(path)) or "m3serve"


async def start_site(app: web.Application, host: str, port: int,
                     grace_s: float = DEFAULT_GRACE_S) -> tuple[web.AppRunner, str]:
    state = app[STATE]
    # auto_decompress off: body.py undoes Content-Encoding itself, bounded and off the event loop.
    runner = JSONErrorAppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s,
                                lingering_time=LINGER_S, auto_decompress=False, keepalive_timeout=state.keep_alive_s,
                                header_timeout=state.header_timeout_s, max_chunk_bytes=state.limits.max_body_bytes)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    return runner, f"http://{_host_for_url(bound[0])}:{bound[1]}"


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
          on_ready: Callable[[str], None] | None = None, grace_s: float = DEFAULT_GRACE_S,
          dead_exit_delay: float = DEAD_EXIT_DELAY_S) -> int:
    """Run until SIGINT/SIGTERM (blocking), then stop gracefully (graceful_stop); a second signal exits at once
    (shutdown.py). on_ready(url) is called once the socket listens. Returns the process's exit status: 0, or
    health.EXIT_ENGINE_DEAD when the engine died (after dead_exit_delay s of 503s; see health.py)."""
    async def main() -> int:
        runner, url = await start_site(app, host, port, grace_s)
        stop = asyncio.Event()
        ShutdownSignals(stop.set).install(asyncio.get_running_loop())
        if on_ready is not None:
            on_ready(url)
        try:
            return await wait_stop_or_death(stop, app[STATE].dead, dead_exit_delay)
        finally:
            await graceful_stop(runner, grace_s)

    factory = None
    try:
        import uvloop  # optional: a faster event loop where installed
        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as r:
        return r.run(main())


class BackgroundServer:
    """The app served from a thread with its own event loop (tests, notebooks, benchmarks).

        with BackgroundServer(build_app(llm)) as srv:
            OpenAI(base_url=srv.url + "/v1", api_key="x")...
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0,
                 grace_s: float = DEFAULT_GRACE_S, dead_exit_delay: float = DEAD_EXIT_DELAY_S):
        self.app, self.host, self.port, self.grace_s = app, host, port, grace_s
        self.dead_exit_delay = dead_exit_delay
        self.exit_code: int | None = None     # serve()'s status once stopped (health.EXIT_ENGINE_DEAD: engine died)
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
                runner, self.url = await start_site(self.app, self.host, self.port, self.grace_s)
            except BaseException as e:
                self._error = e
                self._ready.set()
                return
            self.port = int(self.url.rsplit(":", 1)[1])
            self._ready.set()
            try:
                self.exit_code = await wait_stop_or_death(self._stop, self.state.dead, self.dead_exit_delay)
            finally:
                await graceful_stop(runner, self.grace_s)
        asyncio.run(main())

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: requests in flight end with a 503 (streams: an error event, then [DONE])."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
