"""Errors of aiohttp's HTTP parser (bad method, oversized headers, bad framing) as OpenAI-shaped JSON.

aiohttp answers those itself, before any route or middleware runs, with a text/plain body and an ERROR-level
traceback in its log: a hostile client could fill the log at will. Here they get the same JSON error shape as
every other error and one log line (INFO: they are the client's fault). A 500 that is not a parser error is a
server bug and keeps its traceback.

aiohttp has no public hook for this response: the runner's Server is given a subclass whose protocol factory
makes a RequestHandler with its own handle_error (tests/server/test_hardening_http.py guards it).
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from m3serve.server.errors import APIError, one_line
from m3serve.server.sse import dumps

log = logging.getLogger("m3serve.server")


class JSONErrorHandler(web.RequestHandler):
    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:        # a response is under way: nothing more can be sent
            raise ConnectionError("the response has started; cannot send the error response")
        if isinstance(exc, HttpProcessingError) or status != 500:
            text = one_line(message or (exc.message if isinstance(exc, HttpProcessingError) else "")
                             or str(exc or "") or "bad request")
            log.info("bad HTTP request from %s: %d %s", request.remote, status, text)
        else:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            text = "internal server error"
        resp = web.Response(status=status, text=dumps(APIError(status, text).body()), content_type="application/json")
        resp.force_close()
        return resp

    def log_exception(self, *args, **kw) -> None:
        """A broken request body also surfaces after the answer, while aiohttp drains the rest of it: one line."""
        exc = kw.get("exc_info")
        if isinstance(exc, (web.RequestPayloadError, HttpProcessingError)):
            log.info("bad HTTP request body: %s", one_line(str(exc)))
        else:
            super().log_exception(*args, **kw)


class _JSONErrorServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class JSONErrorAppRunner(web.AppRunner):
    """web.AppRunner whose connections answer HTTP parser errors with JSON (see the module docstring)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer      # same object and layout; only the protocol it makes differs
        return server
