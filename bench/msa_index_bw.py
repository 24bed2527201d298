"""Bandwidth of msa.scores (index-K bytes read per second) at 128k context, plus msa.select and kv.write times.

    python3 bench/msa_index_bw.py [--out FILE.json]

Ceiling: a device-to-device copy of 1 GiB (bytes read + written over time). Every timing is the
median of CUDA-graph replays of 16 launches that rotate over distinct page pools (at least 8 x the
50 MB L2 in all), so no launch reads index-K another launch left in the cache.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from m3serve.benchmeta import run_metadata
from m3serve.kernels.attention import kv_write as kw
from m3serve.kernels.attention import msa_index as mi

DEV = torch.device("cuda")
K128 = 128 * 1024


def graph_time(fns: list, reps: int = 20) -> float:
    """Median seconds per call of the launches in `fns`, captured once into a CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for f in fns:
                f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(fns))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    x = torch.randn(2**28, device=DEV)  # 1 GiB of fp32
    y = torch.empty_like(x)
    t = graph_time([lambda: y.copy_(x)] * 4)
    return 2 * x.numel() * 4 / t


def scores_setup(hk: int, di: int, p: int, fmt: str, batch: int, rows: int, context: int, pools: int):
    b = context // p
    nb_total = batch * b
    calls = []
    for _ in range(pools):
        pages = torch.randn(nb_total + 1, p, di, device=DEV).to(torch.bfloat16)
        if fmt == "fp8":
            pages = pages.to(torch.float8_e4m3fn)
        table = torch.randperm(nb_total, device=DEV).view(batch, b).int()
        q = torch.randn(batch * rows, hk, di, device=DEV).to(torch.bfloat16)
        lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
        qs = (torch.arange(batch + 1, device=DEV) * rows).int()
        out = torch.empty(batch * rows, hk, b, device=DEV)
        calls.append(lambda q=q, pages=pages, table=table, lens=lens, qs=qs, out=out: mi.msa_block_scores(
            q, pages, table, lens, qs, out, max_query_len=rows, topk=16))
    read = batch * b * p * di * (1 if fmt == "fp8" else 2)
    return calls, read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__}
    copy_bw = copy_bandwidth()
    res["copy_GBps"] = copy_bw / 1e9
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    rows_out = []
    for hk, fmt in ((4, "bf16"), (4, "fp8"), (2, "bf16")):
        for batch in (1, 8, 48):
            for rows in (1, 48):
                pools = max(1, min(16, (8 * 50 * 2**20) // (batch * K128 * 128 * 2) + 1))
                calls, read = scores_setup(hk, 128, 128, fmt, batch, rows, K128, pools)
                t = graph_time([calls[i % pools] for i in range(16)])
                bw = read / t
                rows_out.append({"hk": hk, "fmt": fmt, "batch": batch, "rows": rows, "us": t * 1e6,
                                 "GBps": bw / 1e9, "frac_copy": bw / copy_bw})
                print(f"scores Hk {hk} {fmt:4s} batch {batch:2d} rows {rows:2d} @128k: {t * 1e6:8.1f} us "
                      f"{bw / 1e9:6.0f} GB/s = {100 * bw / copy_bw:5.1f} % of copy", flush=True)
                del calls
                torch.cuda.empty_cache()
    res["scores"] = rows_out
    sel_out = []
    for batch, rows in ((1, 1), (48, 1), (16, 4), (1, 8192)):
        b = 1024
        sc = torch.randn(batch * rows, 4, b, device=DEV)
        lens = torch.full((batch,), K128, dtype=torch.int32, device=DEV)
        qs = (torch.arange(batch + 1, device=DEV) * rows).int()
        sel = torch.empty(batch * rows, 4, 16, dtype=torch.int32, device=DEV)
        t = graph_time([lambda: mi.msa_select(sc, lens, qs, sel, max_query_len=rows, topk=16, block_size=128,
                                              local_blocks=1, init_blocks=0)] * 4)
        sel_out.append({"batch": batch, "rows": rows, "us": t * 1e6})
        print(f"select Hk 4 B 1024 batch {batch:2d} rows {rows:4d}: {t * 1e6:8.1f} us", flush=True)
    res["select"] = sel_out
    kw_out = []
    for cell_i in (0, 4):
        cell = kw.CELLS[cell_i]
        for rows in (48, 8192):
            case = kw.make_case(cell, rows, DEV, torch.Generator().manual_seed(rows))
            t = graph_time([lambda: kw.kv_write(*case.args, **case.kwargs)] * 4)
            kw_out.append({"shape": cell.shape, "rows": rows, "us": t * 1e6, "GBps": case.bytes_moved / t / 1e9})
            print(f"kv.write {cell.shape} T {rows:5d}: {t * 1e6:8.1f} us ({case.bytes_moved / t / 1e9:.0f} GB/s)",
                  flush=True)
    res["kv_write"] = kw_out
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**run_metadata(), **res}, f, indent=1)


if __name__ == "__main__":
    main()
