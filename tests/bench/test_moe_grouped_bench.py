"""bench/moe_grouped.py --decode-once on the CPU: the sweep's code path (weights made once per format, each row's
in-register and decode-once paths through the entry's compare, the split timings, the one-line summary) at a small
shape under the Triton interpreter, with a stand-in timer (CUDA events and graphs exist only on the GPU)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import moe_grouped as B  # noqa: E402

from m3serve.kernels.catalog import Cell  # noqa: E402
from m3serve.kernels.moe import grouped as G  # noqa: E402

SHAPE = (8, 64, 32, 2)


def _cells():
    """A small stand-in for the M3 bands: in-register below 40 tokens, the decode-once band from 40 (quantized)."""
    cfg = G.GroupedConfig(BM=16, BN=32, BK=32, CBH=64, CBT=2, GM=3)
    once = replace(cfg, DECODE_ONCE=True, EXPERT_GROUP=3, DEC_BN=32, DEC_BK=32)
    out = []
    for fmt in (G.FMT_BF16, G.FMT_MXFP8, G.FMT_NVFP4):
        if fmt == G.FMT_BF16:
            out.append(Cell(rows=(1, 16384), shape=(fmt, *SHAPE), why="t", config={"moe": cfg}))
        else:
            out += [Cell(rows=(1, 39), shape=(fmt, *SHAPE), why="t", config={"moe": cfg}),
                    Cell(rows=(40, 16384), shape=(fmt, *SHAPE), why="t", config={"moe": once})]
    return tuple(out)


@pytest.mark.slow   # ~30 s: the band's kernels in the interpreter at the sweep's shapes
def test_decode_once_sweep_runs_and_summarises():
    calls = []

    def timed(fn, iters):
        fn()
        calls.append(iters)
        return 1e-3 * len(calls)

    recs = B.decode_once_sweep(["nvfp4", "mxfp8", "bf16"], [20, 48], 2, 48, dev=torch.device("cpu"), shape=SHAPE,
                               cells=_cells(), timed=timed)
    assert [(r["fmt"], r["rows"]) for r in recs] == [(f, t) for f in ("nvfp4", "mxfp8", "bf16") for t in (20, 48)]
    for r in recs:
        assert not [k for k in r if k.endswith("_error")], r
        assert r["in_register_ok"] and r["in_register_checked"] and "DECODE_ONCE=False" in r["in_register_config"]
        if r["fmt"] == "bf16":
            assert "decode_once_config" not in r
            continue
        assert r["decode_once_ok"] and r["decode_once_checked"] and "DECODE_ONCE=True" in r["decode_once_config"]
        assert {"decode_once_total_ms", "decode_once_gemm_ms", "decode_once_decode_ms", "speedup"} <= set(r)
        assert r["decode_ahead_ok"] and "DECODE_AHEAD=True" in r["decode_ahead_config"] and "ahead_speedup" in r
        assert r.get("decode_ahead_checked") == (r["rows"] <= 48) and "decode_ahead_decode_ms" not in r
        line = B._summary(r)
        assert line.startswith(f"{r['fmt']:>5} T={r['rows']:>5}") and "decode-once total" in line
    assert set(calls) == {2}


def test_decode_tile_sweep_checks_exactness_and_records_bandwidth():
    """--decode-tiles at a small shape in the interpreter: every tile's scratch equals the first tile's, each row
    carries its time and HBM share (stand-in timer)."""
    recs = B.decode_tile_sweep(["nvfp4", "mxfp8"], 1, group=2, dev=torch.device("cpu"), shape=SHAPE,
                               tiles=((32, 32), (16, 64), (32, 64)), timed=lambda fn, iters: (fn(), 1e-3)[1])
    assert [(r["fmt"], r["dec_bn"], r["dec_bk"]) for r in recs] == [
        (f, bn, bk) for f in ("nvfp4", "mxfp8") for bn, bk in ((32, 32), (16, 64), (32, 64))]
    assert all(r["exact"] and r["ms"] == 1.0 and r["frac_hbm"] > 0 and "error" not in r for r in recs)
