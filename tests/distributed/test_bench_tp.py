"""bench/tp.py's logic on CPU (gloo, tiny preset): it spawns its two ranks, runs TP1 / fp32 / TP2, times the
all-reduces and writes a complete result file. The GPU run (2 H200s) is the same code with NCCL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_tp_cpu_tiny(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tp.py"), "--device", "cpu", "--preset", "tiny",
                           "--prompt-len", "36", "--steps", "4", "--ar-iters", "5", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("tp-cpu-tiny-*.json")
    r = json.loads(path.read_text())
    for key in ("date", "commit", "command", "gpu", "model", "tp1", "tp2", "accuracy", "allreduce_12kb"):
        assert key in r, key
    assert r["model"]["quantization"] == "nvfp4" and r["launcher"] == "spawn"
    acc = r["accuracy"]
    assert acc["pass"] and acc["tp2_vs_tp1"]["rows"] == 5
    # bf16 TP2 vs TP1 is not bit-identical, and bf16 vs fp32 is measurably off: the tolerance is not vacuous
    assert 0 < acc["tp2_vs_tp1"]["rel_rms_max"] and 0 < acc["tp1_vs_fp32"]["rel_rms_max"] < 0.05
    ar = r["tp2"]["allreduce_per_decode_step"]
    assert ar["count"] == 2 * 4 + 1                  # one after attention and one after the MLP per layer + embed
    assert ar["bytes_each"] == 128 * 2               # one token's hidden state (tiny: 128) in bf16
    assert r["allreduce_12kb"]["nccl"]["correct"] and r["allreduce_12kb"]["bytes"] == 12288
    assert len(r["tp2"]["greedy_tokens"]) == 5 and len(r["tp2"]["per_rank"]) == 2
