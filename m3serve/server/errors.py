"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every client mistake becomes an APIError with a 4xx status that names the offending field (`param`); only a
fault of the server itself may produce a 5xx.
"""

from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def short_repr(value: object, limit: int = 80) -> str:
    """repr() cut to `limit` characters: error messages echo the bad value without echoing a huge body."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def one_line(text: str, limit: int = 200) -> str:
    """Whitespace runs (newlines included) collapsed to one space, cut to `limit` characters: a message or log
    line from a hostile input stays one short line."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def bad_field(name: str, value: object, expected: str) -> APIError:
    return APIError(400, f"'{name}': expected {expected}, found {short_repr(value)}", param=name)
