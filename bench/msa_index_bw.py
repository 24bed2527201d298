"""Bandwidth of msa.scores (index-K bytes read per second) at 128k context, plus msa.select and kv.write times.

    python3 bench/msa_index_bw.py [--out FILE.json]
    python3 bench/msa_index_bw.py --prefill-chunk 16384 --prefill-ctx 114688 [--out FILE.json]

Ceiling: a device-to-device copy of 1 GiB (bytes read + written over time). Every timing is the
median of CUDA-graph replays of 16 launches that rotate over distinct page pools (at least 8 x the
50 MB L2 in all), so no launch reads index-K another launch left in the cache.

--prefill-chunk N: instead, msa.scores of ONE sequence prefilling an N-token chunk after --prefill-ctx tokens
already cached (M3 TP1: Hk 4, Di 128, P 128, top-16; the table exactly the sequence's blocks), bf16 and fp8 index
pages: the decode tiling, the prefill (query-stationary) tiling's default tile, and prefill tile variants (BQ x
warps x stages, block splits), each first checked against the reference at a small step (compare_scores) and then
timed (median of CUDA-event timings of eager launches: each is milliseconds). TFLOP/s = 2 * Di * Hk * visible
(row, key) pairs / time. Also msa.select at the same shape. A variant that fails to build or check records its
error and the rest go on.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from m3serve.benchmeta import run_metadata
from m3serve.kernels.attention import kv_write as kw
from m3serve.kernels.attention import msa_index as mi
from prefill_attention_variants import time_ms  # bench/: the script's folder is on sys.path

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


# --- prefill: one long chunk ------------------------------------------------------------------------

PF_GEOM = {"hk": 4, "di": 128, "p": 128, "topk": 16}      # M3 TP1


def prefill_variants() -> list[tuple[str, str, mi.PrefillScoresTile | None]]:
    """(name, tiling, prefill tile) in the order they are timed: the two defaults first."""
    hk = PF_GEOM["hk"]
    default = mi.prefill_scores_tile(16384, hk)
    out = [("decode", "decode", None), ("prefill-default", "prefill", None)]
    for bq in (16, 32, 64):
        for warps in (4, 8):
            for stages in (2, 3):
                t = mi.PrefillScoresTile(bq=bq, split_blocks=default.split_blocks, num_warps=warps, num_stages=stages)
                # 256 dot rows on 4 warps: a 256-register accumulator per thread, spills at sm_90 (aot_compile)
                if t != default and bq * hk <= 32 * warps:
                    out.append((f"prefill-bq{bq}-w{warps}-s{stages}", "prefill", t))
    for split in (128, 1024):
        out.append((f"prefill-split{split}", "prefill", default._replace(split_blocks=split)))
    return out


def check_variant(fmt: str, tiling: str, tile) -> None:
    """compare_scores at a small step of the same geometry: a 1024-row chunk after 7168 keys, a shorter scored
    sequence, a padding one, over a 96-block table (-inf tail, splits past the context)."""
    g = PF_GEOM
    case = mi.build_scores_case(g["hk"], g["di"], g["p"], fmt, g["topk"], 1024, [8192, 3000, 0], 96, DEV,
                                torch.Generator().manual_seed(5))
    out = mi.msa_block_scores(*case.args, **case.kwargs, tiling=tiling, prefill_tile=tile)
    torch.cuda.synchronize()
    mi.compare_scores(out, mi.msa_block_scores_reference(*case.args, **case.kwargs), case)


def prefill_bench(chunk: int, ctx: int, reps: int, scores_variants: bool = True) -> dict:
    g = PF_GEOM
    hk, di, p, topk = g["hk"], g["di"], g["p"], g["topk"]
    seq_len = ctx + chunk
    b = triton.cdiv(seq_len, p)
    pairs = chunk * ctx + chunk * (chunk + 1) // 2          # visible (row, key) pairs
    flops = 2 * di * hk * pairs
    res = {"chunk": chunk, "context": ctx, "seq_len": seq_len, "blocks": b, **g, "flops": flops,
           "default_tile": mi.prefill_scores_tile(chunk, hk)._asdict(), "scores": [], "select": []}
    print(f"prefill: one sequence, {chunk}-token chunk after {ctx} keys (L {seq_len}, {b} blocks), Hk {hk} Di {di} "
          f"P {p}: {flops / 1e12:.2f} TFLOP per call", flush=True)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=DEV)
    qs = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
    table = torch.randperm(b, device=DEV).int().view(1, b)
    q = torch.randn(chunk, hk, di, device=DEV).to(torch.bfloat16)
    scores = torch.empty(chunk, hk, b, device=DEV)
    for fmt in ("bf16", "fp8") if scores_variants else ():
        try:
            pages = torch.randn(b + 1, p, di, device=DEV).to(torch.bfloat16)
            if fmt == "fp8":
                pages = pages.to(torch.float8_e4m3fn)
        except Exception as e:  # noqa: BLE001 (a bench: record and go on)
            res["scores"].append({"fmt": fmt, "error": f"setup: {type(e).__name__}: {e}"})
            continue
        base = None
        for name, tiling, tile in prefill_variants():
            rec = {"fmt": fmt, "variant": name, "tiling": tiling,
                   "tile": (tile or mi.prefill_scores_tile(chunk, hk))._asdict() if tiling == "prefill" else
                   dict(zip(("bq", "qchunks"), mi.scores_tile(chunk, hk)))}
            try:
                check_variant(fmt, tiling, tile)
                rec["check"] = "ok"

                def call(tiling=tiling, tile=tile):
                    mi.msa_block_scores(q, pages, table, lens, qs, scores, max_query_len=chunk, topk=topk,
                                        tiling=tiling, prefill_tile=tile)
                t = time_ms(call, reps) * 1e-3
                rec.update(ms=t * 1e3, tflops=flops / t / 1e12)
                if base is None:
                    base = scores.clone()
                    rec["vs_decode"] = "is the baseline"
                else:
                    fin = torch.isfinite(base)
                    same_inf = bool(torch.equal(torch.isfinite(scores), fin))
                    rec["vs_decode"] = ("bit-identical" if torch.equal(scores, base) else
                                        f"finite max |diff| {float((scores - base)[fin].abs().max()):.3g}, "
                                        f"non-finite positions {'equal' if same_inf else 'DIFFER'}")
                print(f"  scores {fmt:4s} {name:24s} {t * 1e3:9.2f} ms {flops / t / 1e12:7.1f} TFLOP/s  "
                      f"({rec['vs_decode']})", flush=True)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"  scores {fmt:4s} {name:24s} FAILED: {rec['error'][:300]}", flush=True)
            res["scores"].append(rec)
        del pages
        torch.cuda.empty_cache()
    # msa.select at the same shape: the default warps (select_warps, tuned for one decode row's latency) and each
    # warp count, since a prefill chunk's 65k (row, head) programs are a throughput problem; select is exact, so every
    # variant must equal the default's output
    sc = torch.randn(chunk, hk, b, device=DEV)
    base = None
    for warps in (None, 1, 2, 4, 8):
        rec = {"rows": chunk, "blocks": b, "num_warps": warps or mi.select_warps(triton.next_power_of_2(b)),
               "default": warps is None}
        try:
            sel = torch.full((chunk, hk, topk), mi.SEL_POISON, dtype=torch.int32, device=DEV)
            fn = lambda: mi.msa_select(sc, lens, qs, sel, max_query_len=chunk, topk=topk, block_size=p,  # noqa: E731
                                       local_blocks=1, init_blocks=0, num_warps=warps)
            fn()
            if base is None:
                base = sel.clone()
            rec["same_as_default"] = bool(torch.equal(sel, base))
            t = time_ms(fn, reps) * 1e-3
            rec["ms"] = t * 1e3
            print(f"  select Hk {hk} B {b} rows {chunk} warps {rec['num_warps']}: {t * 1e3:9.2f} ms "
                  f"(same as default: {rec['same_as_default']})", flush=True)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["select"].append(rec)
    # the same rows in a wider table, as the engine holds them (slot_table width = ceil(max_model_len / P): one more
    # block than the context at max_model_len = L + 16, 8192 blocks at M3's 1M tokens): the columns past each row's
    # blocks are never read, so the selection must equal the default's and the time should not grow with the width
    for width in (b + 1, 8192):
        if width <= b or base is None:
            continue
        rec = {"rows": chunk, "blocks": b, "table_width": width,
               "num_warps": mi.select_warps(triton.next_power_of_2(width)), "default": True}
        try:
            wide = torch.cat([sc, torch.randn(chunk, hk, width - b, device=DEV)], dim=2)
            sel = torch.full((chunk, hk, topk), mi.SEL_POISON, dtype=torch.int32, device=DEV)
            fn = lambda: mi.msa_select(wide, lens, qs, sel, max_query_len=chunk, topk=topk, block_size=p,  # noqa: E731
                                       local_blocks=1, init_blocks=0)
            fn()
            rec["same_as_default"] = bool(torch.equal(sel, base))
            rec["ms"] = time_ms(fn, reps)
            print(f"  select Hk {hk} B {b} in a {width}-block table rows {chunk}: {rec['ms']:9.2f} ms "
                  f"(same as default: {rec['same_as_default']})", flush=True)
            del wide
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["select"].append(rec)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="time one sequence's prefill chunk of this many tokens instead (see the module doc)")
    ap.add_argument("--prefill-ctx", type=int, default=114688, help="tokens cached before the prefill chunk")
    ap.add_argument("--prefill-reps", type=int, default=5, help="timed calls per prefill variant (median)")
    ap.add_argument("--select-only", action="store_true", help="prefill: msa.select only, no msa.scores variants")
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__}
    if a.prefill_chunk:
        res["prefill"] = prefill_bench(a.prefill_chunk, a.prefill_ctx, a.prefill_reps, not a.select_only)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({**run_metadata(), **res}, f, indent=1)
        return
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
