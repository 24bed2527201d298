"""Request bodies: read from the socket under a size limit and a deadline, then decoded off the event loop.

  read_wire(request, limits)      event loop: the body as it came (still compressed), at most max_body_bytes,
                                  within body_timeout_s (408 after), refused while reading once over (413)
  decode_json(raw, coding, limits)  prep thread: Content-Encoding undone in bounded steps (identity, gzip,
                                  deflate; anything else 415; a truncated or corrupt stream 400; more than
                                  max_body_bytes out 413 as soon as it is produced), then the JSON's shape
                                  checked before it is parsed: nesting depth, object keys and values (token
                                  ids, list items) are counted by a scan that skips string contents, so a body
                                  over a limit is refused without ever being turned into Python objects.

The shape scan walks the text in pieces of at most SCAN_PIECE bytes (a Python loop between pieces), and zlib
releases the GIL while inflating: a large body costs the event loop a few milliseconds at a time, not the
whole decode. json.loads then runs on a body already known to be small in structure.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import zlib

from aiohttp import web

from m3serve.server.errors import APIError, one_line, short_repr
from m3serve.server.http_errors import ChunkTooLarge
from m3serve.server.limits import RequestLimits, body_too_large

SCAN_PIECE = 1 << 16             # bytes of non-string text, or of a string's plain text, per step of the scan
INFLATE_STEP = 1 << 20           # bytes produced per zlib call

# Runs of bytes outside strings and inside them (up to an escape or the closing quote); UTF-8 continuation
# bytes never equal an ASCII quote or backslash, so working on the raw bytes is exact.
_OUTSIDE = re.compile(rb'[^"]{1,%d}' % SCAN_PIECE)
_INSIDE = re.compile(rb'[^"\\]{0,%d}(?:\\.[^"\\]{0,4096}){0,256}' % SCAN_PIECE, re.S)   # <= ~1 MB a step
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_CODINGS = ("identity", "gzip", "x-gzip", "deflate")


async def read_wire(request: web.Request, limits: RequestLimits) -> bytes:
    """The body bytes as sent (Content-Encoding not undone: the runner has auto_decompress off)."""
    buf = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                if len(buf) + len(chunk) > limits.max_body_bytes:
                    raise body_too_large(limits)
                buf += chunk
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                            "(--body-timeout)", code="request_timeout", headers={"Connection": "close"}) from None
    except ChunkTooLarge as e:
        raise body_too_large(limits, e.declared, "a chunk of") from None
    except web.RequestPayloadError as e:     # bad chunking, a connection cut mid-body
        raise APIError(400, f"the request body could not be read: {one_line(str(e))}") from None
    return bytes(buf)


def content_coding(header: str | None) -> str:
    """The one Content-Encoding this server undoes (415 for any other, or for a list of several)."""
    coding = (header or "identity").strip().lower()
    if coding not in _CODINGS:
        raise APIError(415, f"Content-Encoding {short_repr(header)} is not supported; send the body as identity, "
                            "gzip or deflate", param=None, code="unsupported_content_encoding")
    return coding


def inflate(raw: bytes, coding: str, limits: RequestLimits) -> bytes:
    """Undo gzip / deflate, producing at most max_body_bytes (413 the moment more would come)."""
    if coding == "identity":
        return raw
    if coding == "deflate":
        # RFC 9110's deflate is the zlib format; some clients send raw deflate: tell them apart by the header.
        zlib_header = len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0
        wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    else:
        wbits = zlib.MAX_WBITS | 16
    out = bytearray()
    data = raw
    while True:                                   # gzip: one decompressor per member (RFC 1952 allows several)
        d = zlib.decompressobj(wbits)
        try:
            while data:
                room = limits.max_body_bytes - len(out)
                out += d.decompress(data, min(INFLATE_STEP, room + 1))
                if len(out) > limits.max_body_bytes:
                    raise body_too_large(limits)
                data = d.unconsumed_tail
            out += d.flush()
        except zlib.error as e:
            raise APIError(400, f"the request body could not be read: not valid {coding} data ({e})") from None
        if len(out) > limits.max_body_bytes:
            raise body_too_large(limits)
        if not d.eof:
            raise APIError(400, f"the request body could not be read: truncated {coding} data (the compressed "
                                "stream does not end)")
        data = d.unused_data
        if not data:
            return bytes(out)
        if wbits != zlib.MAX_WBITS | 16:
            raise APIError(400, f"the request body could not be read: {len(data)} bytes after the end of its "
                                f"{coding} stream")


def check_shape(raw: bytes, limits: RequestLimits) -> None:
    """Refuse (400) a JSON text deeper than max_json_depth or with more than max_json_keys object keys or
    max_json_values values, without parsing it. Only structure outside strings is counted; malformed JSON
    is left for json.loads to name. Every step handles at most SCAN_PIECE bytes, so the GIL is free between
    steps however long one string is."""
    depth = keys = values = deepest = 0
    pos, end = 0, len(raw)
    while pos < end:
        m = _OUTSIDE.match(raw, pos)
        if m is not None:                       # structure: count it
            piece = m.group()
            pos = m.end()
            keys += piece.count(b":")
            values += piece.count(b",")
            brackets = piece.translate(None, _NOT_BRACKETS)
            if brackets:
                run = list(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets), initial=depth))
                deepest = max(deepest, max(run))
                depth = run[-1]
            _over(deepest, keys, values, limits)
            continue
        pos += 1                                # an opening quote: skip the string's contents
        quote = raw.find(b'"', pos)
        if quote >= 0 and raw.find(b"\\", pos, quote) < 0:
            pos = quote + 1                     # no escape before the next quote (memchr speed): it closes
            continue
        while pos < end:
            stop = _INSIDE.match(raw, pos).end()     # text and escapes (it may match nothing)
            if stop > pos:
                pos = stop
            elif raw[pos] == 0x5C:              # a backslash as the last byte: nothing left to escape
                pos += 2
            else:                               # the closing quote
                pos += 1
                break


def _over(deepest: int, keys: int, values: int, limits: RequestLimits) -> None:
    if deepest > limits.max_json_depth:
        raise APIError(400, f"the request body is nested more than {limits.max_json_depth} levels deep",
                       code="body_too_complex")
    if keys > limits.max_json_keys:
        raise APIError(400, f"the request body has more than {limits.max_json_keys} object keys",
                       code="body_too_complex")
    if values > limits.max_json_values:
        raise APIError(400, f"the request body has more than {limits.max_json_values} values (token ids, "
                            "list items, fields); no request needs that many", code="body_too_complex")


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


def decode_json(raw: bytes, coding: str, limits: RequestLimits) -> object:
    """Wire bytes -> the JSON value (run it on the prep pool). Every failure is an APIError naming it."""
    raw = inflate(raw, coding, limits)
    if not raw or raw.isspace():         # (not raw.strip(): no copy of a large body)
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    check_shape(raw, limits)
    return parse(text)


def parse(text: str) -> object:
    """json.loads with OpenAI-shaped errors, NaN / Infinity refused, lone surrogates refused."""
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if "\\u" in text:
        _check_strings(body)
    return body
