"""Issue 17, part 2: shutdown. The first SIGTERM stops admitting (503), ends every stream in flight at once
with an error event and [DONE] (a non-streamed request gets a JSON 503), and the process is gone within 10 s
with status 0; a second signal exits at once (status 128 + signal)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from m3serve.server.app import drain
from m3serve.server.shutdown import ShutdownSignals
from tests.server.conftest import MODEL_NAME, engine_idle, make_llm, serve

N_STREAMS = 24


async def _stream(session, url: str, body: dict, started: asyncio.Event | None = None) -> dict:
    res = {"status": None, "chunks": 0, "finish": None, "error": None, "done": False, "after_done": 0}
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        res["status"] = resp.status
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            data = line.removeprefix("data: ")
            if res["done"]:
                res["after_done"] += 1
            elif data == "[DONE]":
                res["done"] = True
            elif "error" in (ev := json.loads(data)):
                res["error"] = ev["error"]
            else:
                res["chunks"] += 1
                res["finish"] = ev["choices"][0]["finish_reason"] or res["finish"]
                if started is not None:
                    started.set()
    return res


def _ended_properly(r: dict) -> bool:
    """An error event or a finish_reason, then [DONE] and nothing after it."""
    return r["status"] == 200 and (r["error"] is not None or r["finish"] is not None) and r["done"] \
        and not r["after_done"]


def test_signals_first_graceful_second_exits():
    calls = []
    s = ShutdownSignals(on_first=lambda: calls.append("graceful"), exit_now=lambda code: calls.append(code))
    s.handle(signal.SIGTERM)
    assert calls == ["graceful"]
    s.handle(signal.SIGINT)
    assert calls == ["graceful", 128 + signal.SIGINT]


def test_drain_ends_streams_and_requests_then_refuses(model_dir):
    srv = serve(make_llm(model_dir, kv_cache_bytes=64 << 20))
    long = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    try:
        async def run():
            async with aiohttp.ClientSession() as s:
                started = asyncio.Event()
                stream = asyncio.ensure_future(_stream(s, srv.url, long, started))

                async def whole():
                    async with s.post(srv.url + "/v1/completions", json=long) as r:
                        return r.status, await r.json()
                plain = asyncio.ensure_future(whole())
                await asyncio.wait_for(started.wait(), 30)
                while srv.engine_loop.snapshot.get("running", 0) < 2:
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(srv.app, 5.0), srv._loop))
                drained_s = time.monotonic() - t0
                after = []
                for path in ("/v1/completions", "/health"):
                    async with s.request("POST" if path.startswith("/v1") else "GET", srv.url + path,
                                         json=long) as r:
                        after.append((r.status, await r.json()))
                return await stream, await plain, drained_s, after
        streamed, whole, drained_s, after = asyncio.run(run())
        idle = engine_idle(srv)
    finally:
        srv.stop()
    assert _ended_properly(streamed) and streamed["error"]["code"] == "server_shutting_down", streamed
    assert streamed["error"]["type"] == "service_unavailable_error" and streamed["finish"] is None
    assert whole[0] == 503 and whole[1]["error"]["code"] == "server_shutting_down"
    assert drained_s < 2.0, drained_s             # 3000 tokens to go: only the drain ends them this soon
    assert [a[0] for a in after] == [503, 503] and after[0][1]["error"]["code"] == "server_shutting_down"
    assert idle["kv_pages_free"] == idle["kv_pages_total"] and idle["live_seqs"] == 0 and idle["requests"] == 0


def _start(model_dir: str, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "m3serve.server", model_dir, "--port", "0", "--device", "cpu", "--dtype", "float32",
           "--kv-cache-bytes", str(16 << 20), "--served-model-name", MODEL_NAME, "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
    if not m:
        proc.kill()
        pytest.fail(f"the server did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, m.group(1)


def test_sigterm_with_24_streams(model_dir):
    proc, url = _start(model_dir)
    try:
        async def run():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                started = [asyncio.Event() for _ in range(N_STREAMS)]
                streams = [asyncio.ensure_future(_stream(s, url, {
                    "model": MODEL_NAME, "prompt": f"ab {i}", "max_tokens": 3000, "temperature": 0,
                    "ignore_eos": True}, started[i])) for i in range(N_STREAMS)]

                async def whole():
                    async with s.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "cd",
                                                                     "max_tokens": 3000, "ignore_eos": True}) as r:
                        return r.status, await r.json()
                plain = asyncio.ensure_future(whole())
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                results = await asyncio.gather(*streams)
                return results, await plain, time.monotonic() - t0, t0
        results, whole, streams_s, t0 = asyncio.run(run())
        rc = proc.wait(timeout=30)
        gone_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = [r for r in results if not _ended_properly(r)]
    assert not bad, bad[:3]
    assert {r["error"]["code"] for r in results} == {"server_shutting_down"}
    assert whole[0] == 503 and whole[1]["error"]["code"] == "server_shutting_down"
    assert streams_s < 3.0, streams_s
    assert rc == 0 and gone_s < 10.0, (rc, gone_s)


def test_second_signal_exits_at_once(model_dir):
    """A stalled upload keeps the graceful shutdown waiting its grace period (30 s here); the second SIGTERM must
    not wait for it."""
    proc, url = _start(model_dir, "--shutdown-grace", "30")
    host, port = url.removeprefix("http://").split(":")
    stalled = socket.create_connection((host, int(port)))
    try:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"prompt\"")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None             # still draining: the upload holds it
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        exit_s = time.monotonic() - t0
    finally:
        stalled.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + signal.SIGTERM and exit_s < 1.0, (rc, exit_s)
