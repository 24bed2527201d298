"""Raw HTTP/1.1 over a socket, for requests no client library sends (lying Content-Length, Expect, bad framing)."""

from __future__ import annotations

import json
import re
import socket
import time


def exchange(url: str, data: bytes, timeout: float = 10.0, until_close: bool = False) -> tuple[int | None, dict, bytes,
                                                                                                 float]:
    """Send `data`, read one response. -> (status, headers (lower-case names), body, seconds to the status line).
    Reads the body by Content-Length (or to EOF with until_close); status None if nothing came within timeout."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    t0 = time.monotonic()
    buf, t_status = b"", None
    try:
        s.sendall(data)
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if t_status is None and b"\r\n" in buf:
                t_status = time.monotonic() - t0
        head, _, body = buf.partition(b"\r\n\r\n")
        m = re.match(rb"HTTP/1\.\d (\d{3})", head)
        if not m:
            return None, {}, buf, time.monotonic() - t0
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        want = int(headers.get("content-length", "-1"))
        while (until_close or len(body) < want) and not (int(m.group(1)) == 100):
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(m.group(1)), headers, body, t_status if t_status is not None else time.monotonic() - t0
    except socket.timeout:
        return None, {}, buf, time.monotonic() - t0
    finally:
        s.close()


def openai_error(body: bytes) -> dict:
    """The `error` object of an OpenAI-shaped error body (asserts the shape)."""
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    return err
