"""bench/spec_serving_steps.py on CPU: per engine and concurrency, the closed loop's per-user rate and its steps
labelled by kind (every step of the loop counted once), in the form the report renders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from report import ResultFile, render_spec_serving_steps  # noqa: E402
from spec_serving_steps import first_arrivals  # noqa: E402


def test_staggered_first_arrivals_spread_over_one_request():
    assert first_arrivals(4, 128, False) == [0, 0, 0, 0]
    assert first_arrivals(4, 128, True) == [0, 32, 64, 96]
    assert first_arrivals(1, 128, True) == [0] and first_arrivals(3, 2, True) == [0, 0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("stagger", [False, True])
def test_closed_loop_rows(tmp_path, stagger):
    out = tmp_path / "steps.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "spec_serving_steps.py"), "--engines",
                        "plain,spec-2", "--concurrency", "1,3", "--requests-per-user", "2", "--tokens", "6",
                        "--device", "cpu", "--out", str(out)] + (["--stagger"] if stagger else []),
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "spec_serving_steps" and doc["commit"]
    rows = doc["results"]
    assert [(x["engine"], x["users"]) for x in rows] == [("plain", 1), ("plain", 3), ("spec-2", 1), ("spec-2", 3)]
    for x in rows:
        assert x["requests"] == 2 * x["users"] and x["tokens_per_s_per_user"] > 0 and x["stagger"] == stagger
        assert sum(k["steps"] for k in x["kinds"].values()) == x["steps"]
        assert 0.9 < sum(k["share"] for k in x["kinds"].values()) <= 1.0
        assert x["kernel_builds"] == 0          # counted on CUDA only (the watch is armed by the GPU warm-up)
    # on CPU there are no graphs: the plain engine's steps are eager; the speculative engine drafts at one user
    assert set(rows[0]["kinds"]) == {"plain-eager"} and "spec-eager" in rows[2]["kinds"]
    if not stagger:          # staggered, the three users' requests (6 tokens, first arrivals 2 steps apart) need not overlap
        assert rows[3]["policy"]["policy_plain_steps"] > 0   # 3 decoding requests > the default threshold 2
    text = render_spec_serving_steps([ResultFile("spec_serving_steps/x.json", doc)])
    assert "| spec-2 | 3 |" in text and "kernel variants built in the loop" in text
