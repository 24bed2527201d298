"""bench/kernel_variants.py's head group on the CPU: the BF16 head and every head.head12 config of the group on one
weight with escapes, each through the entries' argmax band, at a small shape under the Triton interpreter, with a
stand-in timer (CUDA events and graphs exist only on the GPU). A variant whose ids or best values leave the band is
recorded as failed: the test fails on it."""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import kernel_variants as KV  # noqa: E402


class CpuRunner(KV.Runner):
    def __init__(self) -> None:  # no copy-bandwidth probe, no L2 flush buffer
        self.dev, self.iters, self.bw, self.rows = torch.device("cpu"), 1, 1e12, []

    def time(self, fn) -> float:
        fn()
        return 1e-3


def test_head_group_checks_every_tile_against_the_band():
    r = CpuRunner()
    KV.head_group(r, row_counts=(1, 3), shape=(256, 256))
    want = {"bf16"} | {f"h12/{c[0]}" for c in KV.HEAD12_CONFIGS}
    for rows in (1, 3):
        got = {row["variant"]: row for row in r.rows if row["rows"] == rows}
        assert set(got) == want
        assert all(row["ok"] for row in got.values()), [(n, row["why"]) for n, row in got.items() if not row["ok"]]
        assert got["bf16"]["bytes"] == 256 * 256 * 2 and got["h12/r2w2s2"]["bytes"] > 256 * 256 * 3 // 2
