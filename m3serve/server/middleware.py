"""Rules every request passes before its route (called from app.py's middleware): which paths need the API
key, the JSON Content-Type a POST must declare, and the Server header.

Content-Type: a web page can POST `text/plain` (or a form) to any address without a CORS preflight, so a
server on localhost that parsed such a body as JSON would generate for any site its user visits; requiring
`application/json` (or `application/<x>+json`) forces the preflight, which this server never grants.
"""

from __future__ import annotations

from aiohttp import web

from m3serve.server.errors import APIError, short_repr

SERVER_NAME = "m3serve"          # the Server header: no interpreter or library versions


def needs_key(path: str, public_metrics: bool) -> bool:
    """--api-key covers /v1/* and /metrics (unless --public-metrics); /health stays open for probes."""
    return path.startswith("/v1") or (path == "/metrics" and not public_metrics)


# POST routes that read no body (vLLM's POST /ping is a bodyless liveness probe): nothing to parse, nothing to forge
BODYLESS_POST = frozenset({"/ping"})


def check_content_type(request: web.Request) -> None:
    """415 for a POST to a route that exists (an unknown one keeps its 404) without a JSON Content-Type."""
    if request.method != "POST" or request.match_info.http_exception is not None or request.path in BODYLESS_POST:
        return
    header = request.headers.get("Content-Type")
    mime = (header or "").split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    found = "none" if header is None else short_repr(header)
    raise APIError(415, f"Content-Type {found} is not supported; send the body as 'Content-Type: "
                        "application/json'", code="unsupported_media_type", headers={"Connection": "close"})


async def set_server_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: runs before aiohttp fills in its default (which names Python and aiohttp)."""
    response.headers["Server"] = SERVER_NAME
