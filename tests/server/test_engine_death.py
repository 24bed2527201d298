"""Issue 34, item 1: a dead tensor-parallel worker. `m3serve serve --tp 2` on CPU (gloo); one worker is killed
by pid. The stream in flight ends with an error event and [DONE]; then /health is 503, m3serve_engine_alive 0,
a new request 503 with a message that names the cause but no pid; and the server exits non-zero (for a
supervisor to restart it) once --dead-exit-delay has passed and the requests in flight ended."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest


EXIT_DELAY_S = 6.0       # long enough for the probes below on a loaded 2-core machine


def _alive_gauge(text: str) -> float:
    return float(re.search(r"^m3serve_engine_alive(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _post(port: int, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_killed_tp_worker_marks_the_server_dead_and_it_exits_nonzero(model_dir):
    cmd = [sys.executable, "-m", "m3serve.server", model_dir, "--tp", "2", "--device", "cpu", "--dtype", "float32",
           "--port", "0", "--kv-cache-bytes", str(64 << 20), "--served-model-name", "m", "--log-level", "warning",
           "--dead-exit-delay", str(EXIT_DELAY_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = proc.stdout.readline()
        m = re.search(r"at http://127\.0\.0\.1:(\d+)", line)
        assert m, (line, proc.stderr.read()[-3000:] if proc.poll() is not None else "")
        port = int(m.group(1))
        assert _get(port, "/health")[0] == 200
        assert _alive_gauge(_get(port, "/metrics")[1].decode()) == 1

        # A stream in flight when the worker dies.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hello there", "max_tokens": 3000,
                                                            "ignore_eos": True, "stream": True}),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        first = stream.readline()
        assert first.startswith(b"data: "), first
        workers = _children(proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        t_kill = time.monotonic()
        rest = stream.read().decode()
        conn.close()
        events = [e.strip().removeprefix("data: ") for e in rest.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert "pid" not in err["message"] and str(workers[0]) not in err["message"], err

        deadline = time.monotonic() + 10
        while (status := _get(port, "/health")[0]) == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 503
        assert _alive_gauge(_get(port, "/metrics")[1].decode()) == 0
        status, body = _post(port, {"prompt": "hi", "max_tokens": 2})
        err = json.loads(body)["error"]
        assert status == 503 and err["code"] == "engine_dead", body
        assert "worker" in err["message"] and "pid" not in err["message"] and str(workers[0]) not in err["message"]

        rc = proc.wait(timeout=EXIT_DELAY_S + 30)
        assert rc != 0
        assert time.monotonic() - t_kill >= EXIT_DELAY_S - 0.5     # it waited for the delay, then left
        log = proc.stderr.read()
        assert str(workers[0]) in log          # the operator's log keeps the pid
        assert log.count("Traceback") <= 1, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_fault_while_idle_gives_503_and_a_nonzero_exit(model_dir, monkeypatch):
    """The same path without processes: the engine reports a fault between steps (as a TP driver does when
    its watchdog saw a worker exit); the loop marks itself dead without any request in flight."""
    from m3serve.server.app import BackgroundServer, build_app
    from m3serve.server.health import EXIT_ENGINE_DEAD
    from tests.server.conftest import make_llm

    llm = make_llm(model_dir)
    fault: list[str] = []
    monkeypatch.setattr(llm.engine, "fault", lambda: fault[0] if fault else None)
    srv = BackgroundServer(build_app(llm, served_model_name="m"), dead_exit_delay=EXIT_DELAY_S).start()
    try:
        port = srv.port
        assert _post(port, {"prompt": "hi", "max_tokens": 2})[0] == 200
        fault.append("tensor-parallel worker rank 1 (pid 4242) exited with code -9")
        deadline = time.monotonic() + 10
        while (status := _get(port, "/health")[0]) == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 503
        assert _alive_gauge(_get(port, "/metrics")[1].decode()) == 0
        status, body = _post(port, {"prompt": "hi", "max_tokens": 2})
        err = json.loads(body)["error"]
        assert status == 503 and err["code"] == "engine_dead" and "4242" not in err["message"], body
        srv._thread.join(EXIT_DELAY_S + 20)
        assert not srv._thread.is_alive() and srv.exit_code == EXIT_ENGINE_DEAD
    finally:
        srv.stop()


def test_a_step_failure_is_fatal_when_sticky_or_repeated():
    from m3serve.server.engine_loop import MAX_FAILED_STEPS_IN_A_ROW, fatal_step_error
    alloc = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert all(fatal_step_error(alloc, n) is None for n in range(1, MAX_FAILED_STEPS_IN_A_ROW))
    why = fatal_step_error(alloc, MAX_FAILED_STEPS_IN_A_ROW)
    assert f"{MAX_FAILED_STEPS_IN_A_ROW} engine steps in a row failed" in why and "CUBLAS_STATUS_ALLOC_FAILED" in why
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert "unusable" in fatal_step_error(sticky, 1)
    assert fatal_step_error(ValueError("bad logits_processors"), 1) is None


def _failing_steps(llm, monkeypatch, failures: int | None):
    """engine.step raises a cuBLAS allocation failure `failures` times (None: always), then runs as before."""
    real, count = llm.engine.step, [0]

    def step():
        count[0] += 1
        if failures is None or count[0] <= failures:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return real()
    monkeypatch.setattr(llm.engine, "step", step)


def test_steps_that_fail_every_time_take_the_server_down(model_dir, monkeypatch):
    """A failure that repeats on fresh requests (here every step raises) fails the first requests with a 500, then
    marks the engine dead: 503 with the engine_dead code, /health 503, and the exit for a supervisor."""
    from m3serve.server.app import BackgroundServer, build_app
    from m3serve.server.engine_loop import MAX_FAILED_STEPS_IN_A_ROW
    from m3serve.server.health import EXIT_ENGINE_DEAD
    from tests.server.conftest import make_llm

    llm = make_llm(model_dir)
    _failing_steps(llm, monkeypatch, None)
    srv = BackgroundServer(build_app(llm, served_model_name="m"), dead_exit_delay=EXIT_DELAY_S).start()
    try:
        port = srv.port
        statuses = [_post(port, {"prompt": "hi", "max_tokens": 2})[0] for _ in range(MAX_FAILED_STEPS_IN_A_ROW)]
        assert statuses[:-1] == [500] * (MAX_FAILED_STEPS_IN_A_ROW - 1) and statuses[-1] == 503, statuses
        assert _get(port, "/health")[0] == 503
        status, body = _post(port, {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and json.loads(body)["error"]["code"] == "engine_dead", body
        srv._thread.join(EXIT_DELAY_S + 20)
        assert not srv._thread.is_alive() and srv.exit_code == EXIT_ENGINE_DEAD
    finally:
        srv.stop()


def test_a_failure_that_does_not_repeat_keeps_the_server_up(model_dir, monkeypatch):
    """Failed steps below the limit, then a good one: the counter starts again, /health stays 200."""
    from m3serve.server.app import BackgroundServer, build_app
    from m3serve.server.engine_loop import MAX_FAILED_STEPS_IN_A_ROW
    from tests.server.conftest import make_llm

    llm = make_llm(model_dir)
    _failing_steps(llm, monkeypatch, MAX_FAILED_STEPS_IN_A_ROW - 1)
    srv = BackgroundServer(build_app(llm, served_model_name="m"), dead_exit_delay=EXIT_DELAY_S).start()
    try:
        port = srv.port
        assert [_post(port, {"prompt": "hi", "max_tokens": 2})[0] for _ in range(MAX_FAILED_STEPS_IN_A_ROW)] \
            == [500] * (MAX_FAILED_STEPS_IN_A_ROW - 1) + [200]
        assert _get(port, "/health")[0] == 200
        assert _post(port, {"prompt": "hi", "max_tokens": 2})[0] == 200
    finally:
        srv.stop()
