"""Errors of aiohttp's HTTP parser (bad method, oversized headers, bad framing) as OpenAI-shaped JSON.

aiohttp answers those itself, before any route or middleware runs, with a text/plain body and an ERROR-level
traceback in its log: a hostile client could fill the log at will. Here they get the same JSON error shape as
every other error and one log line (INFO: they are the client's fault). A 500 that is not a parser error is a
server bug and keeps its traceback.

aiohttp has no public hook for this response: the runner's Server is given a subclass whose protocol factory
makes a RequestHandler with its own handle_error (tests/server/test_hardening_http.py guards it).

The same handler enforces the header timeout: once the first byte of a request arrives on a connection with
no request in progress, its head must be complete within header_timeout seconds, else the client gets a 408
and the connection closes (aiohttp's keep-alive timer closes idle connections; body.py times the body). A
connection that has started a request is no longer idle, so the keep-alive close is pushed past the header
deadline.

Chunked bodies: given max_chunk_bytes, the connection parses with aiohttp's Python parser (the C one keeps a
chunk's declared size to itself), and a chunk declared larger than the body limit fails the request's payload
with ChunkTooLarge the moment its size line is parsed, before any of it is read (body.py answers 413).
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.helpers import DEFAULT_CHUNK_SIZE
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParserPy
from aiohttp.web_protocol import MAX_MSG_QUEUE_SIZE

from m3serve.server.errors import APIError, one_line
from m3serve.server.middleware import SERVER_NAME
from m3serve.server.sse import dumps

log = logging.getLogger("m3serve.server")


class ChunkTooLarge(web.RequestPayloadError):
    """A chunk of a chunked body declared more bytes than a whole body may have."""

    def __init__(self, declared: int, limit: int):
        super().__init__(f"a chunk declares {declared} bytes; bodies may have at most {limit}")
        self.declared, self.limit = declared, limit


class JSONErrorHandler(web.RequestHandler):
    __slots__ = ("_header_timeout", "_header_timer", "_max_chunk_bytes")

    def __init__(self, *args, header_timeout: float | None = None, max_chunk_bytes: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._header_timer = None
        self._max_chunk_bytes = max_chunk_bytes
        if max_chunk_bytes is not None:
            self._parser = HttpRequestParserPy(
                self, self._loop, kwargs.get("read_bufsize", DEFAULT_CHUNK_SIZE),
                max_line_size=kwargs.get("max_line_size", 8190), max_field_size=kwargs.get("max_field_size", 8190),
                max_headers=kwargs.get("max_headers", 128), payload_exception=web.RequestPayloadError,
                auto_decompress=kwargs.get("auto_decompress", True), max_msg_queue_size=MAX_MSG_QUEUE_SIZE)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count            # requests whose head the parser completed on this connection
        super().data_received(data)
        if self._max_chunk_bytes is not None:
            self._check_chunk()
        if self._request_count != heads:
            self._cancel_header_timer()
        elif data and self._header_timeout and self._header_timer is None and self._current_request is None \
                and not self._messages and not self._force_close:
            self._header_timer = self._loop.call_later(self._header_timeout, self._head_overdue, heads)
            self._next_keepalive_close_time = self._loop.time() + self._header_timeout + 1.0

    def _check_chunk(self) -> None:
        body = getattr(self._parser, "_payload_parser", None)       # the Python parser's state of this body
        declared = getattr(body, "_chunk_size", 0)
        if declared > self._max_chunk_bytes and body.payload.exception() is None:
            body.payload.set_exception(ChunkTooLarge(declared, self._max_chunk_bytes))

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _head_overdue(self, heads: int) -> None:
        self._header_timer = None
        if self._request_count != heads or self._current_request is not None or self._messages \
                or self.transport is None or self._force_close:
            return
        log.info("request head not received within %.1f s; closing the connection", self._header_timeout)
        text = dumps(APIError(408, f"the request head did not arrive within {self._header_timeout:g} s "
                                   "(--header-timeout)", code="request_timeout").body()).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nServer: " + SERVER_NAME.encode() +
                             b"\r\nContent-Length: " + str(len(text)).encode() + b"\r\n\r\n" + text)
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

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
        resp = web.Response(status=status, text=dumps(APIError(status, text).body()), content_type="application/json",
                            headers={"Server": SERVER_NAME})
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
