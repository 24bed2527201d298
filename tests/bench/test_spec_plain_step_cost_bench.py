"""bench/spec_plain_step_cost.py on CPU: one row per engine, the speculative engine's steps run under its policy
(plain at a batch above its threshold), with the step times the report reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_step_cost_rows(tmp_path):
    out = tmp_path / "cost.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "spec_plain_step_cost.py"), "--batch", "3",
                        "--prompt", "16", "--tokens", "12", "--steps", "4", "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "spec_plain_step_cost" and doc["commit"]
    plain, spec = doc["results"]
    assert (plain["engine"], spec["engine"]) == ("plain", "spec-policy")
    for row in (plain, spec):
        assert row["batch"] == 3 and row["steps"] == 4 and row["p90_ms"] >= row["median_ms"] > 0
    assert plain["policy"] == {}
    assert spec["policy"]["policy_plain_steps"] >= 4      # 3 decoding requests > the default threshold of 2
