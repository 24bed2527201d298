"""examples/vllm_style.py (every vLLM offline option m3serve serves, on the embedded model) runs unchanged on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_vllm_style_example_runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "vllm_style.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert out.count("cumulative_logprob=") == 4 and out.count("logprob of prompt token 1") == 2
    assert "raw: " in out and "chat: " in out and "chat batch: ['" in out
