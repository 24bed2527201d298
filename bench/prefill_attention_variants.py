"""Tile configs of attn.prefill on the GPU: TFLOP/s at an 8k-token chunk of an M3 TP1 dense layer.

For each page dtype (bf16, fp8) and each PrefillTiles variant: correctness first (a mixed step of
first chunks, a chunk after an unaligned context and padding, through the entry's compare; the
single-bf16-p variants against their wider band), then the median time of --iters launches (CUDA
events) of one sequence of --n query tokens after --ctx context keys, and TFLOP/s over the causal
flops 2*2*D*Hq*(visible pairs). Also times torch's SDPA (flash, bf16, contiguous K/V, enable_gqa)
on the same problem as a yardstick. The p.v split (two MMAs) vs one bf16 MMA is the pv_split pair.

    python3 bench/prefill_attention_variants.py [--n 8192] [--ctx 0] [--iters 20] [--kv 16,8] [--out-dir DIR]

(saved as bench/results/prefill_attention_variants/<name>.json, rendered by bench/report.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.attention import prefill as pa  # noqa: E402

T = pa.PrefillTiles
VARIANTS = [
    T(64, 64, 4, 3), T(64, 64, 4, 2), T(64, 64, 4, 4), T(64, 128, 4, 2), T(64, 64, 4, 3, heads=2),
    T(128, 64, 8, 2, heads=2), T(128, 64, 8, 3, heads=2), T(128, 128, 8, 2, heads=2), T(128, 64, 8, 2, heads=4),
    T(64, 64, 4, 3, False), T(128, 128, 8, 2, False, heads=2),
    # fp8 pages: more heads per converted K/V tile
    T(128, 64, 8, 1, heads=2), T(64, 64, 4, 3, heads=4), T(64, 32, 4, 3, heads=2), T(128, 32, 8, 2, heads=2),
    T(128, 64, 8, 2, heads=8), T(128, 64, 4, 2, heads=2),
    # fp8 pages as fp16 MMA operands (attn.paged's F16 scheme; bf16 pages ignore f16, so these run on fp8 only):
    # compiled for sm_90 on the CPU without spills; their K loops hold ~19 % fewer instructions than the bf16
    # conversion's (479 vs 594 at 128 x 64, two heads: m3serve.kernels.aot_check's loop count)
    T(128, 64, 8, 1, heads=2, f16=True), T(128, 64, 8, 2, heads=2, f16=True), T(64, 64, 4, 3, f16=True),
    T(64, 64, 4, 3, heads=2, f16=True), T(128, 64, 8, 1, heads=4, f16=True), T(128, 128, 8, 1, heads=2, f16=True),
]


def time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default=None, help="comma-separated indices into VARIANTS")
    ap.add_argument("--kv", default="16,8", help="page dtypes by bits: 16 (bf16), 8 (fp8)")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    chosen = VARIANTS if a.variants is None else [VARIANTS[int(i)] for i in a.variants.split(",")]
    rows = []
    hq, hk, d, p = 64, 4, 128, 128
    flops = pa.causal_flops([a.n], [a.ctx + a.n], hq, d)
    for bits in (int(b) for b in a.kv.split(",")):
        shape = (hq, hk, d, p, bits)
        big = pa.make_step_case(shape, [a.n], [a.ctx], dev, torch.Generator().manual_seed(0))
        for tiles in chosen:
            if tiles.f16 and bits != 8:
                continue
            small = pa.make_step_case(shape, [700, 333, 2], [0, 1000 + 77, -1], dev, torch.Generator().manual_seed(1),
                                      tiles)
            try:
                out = pa.prefill_attention(*small.args, **small.kwargs)
                pa.compare(out, pa.prefill_attention_reference(*small.args, **small.kwargs), small)
                ok = "ok"
            except AssertionError as exc:
                ok = f"FAIL {str(exc)[:160]}"
            args, kw = big.args, dict(big.kwargs, tiles=tiles)
            ms = time_ms(lambda: pa.prefill_attention(*args, **kw), a.iters)
            rec = {"kv_bits": bits, "tiles": tiles.__dict__, "ms": ms, "tflops": flops / ms / 1e9, "check": ok}
            rows.append(rec)
            print(f"kv{bits:2d} {tiles}  {ms:8.3f} ms  {rec['tflops']:6.1f} TFLOP/s  {ok}", flush=True)
        del big
        torch.cuda.empty_cache()
    if a.ctx == 0 and a.variants is None:
        # yardstick: torch SDPA (flash) on contiguous bf16 K/V, no paging (its causal mask is top-left
        # aligned, so only a first chunk compares)
        g = torch.Generator(device=dev).manual_seed(2)
        q = torch.randn(1, hq, a.n, d, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, hk, a.n, d, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, hk, a.n, d, device=dev, generator=g, dtype=torch.bfloat16)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ms = time_ms(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), a.iters)
        rows.append({"kv_bits": 16, "tiles": "torch sdpa", "ms": ms, "tflops": flops / ms / 1e9})
        print(f"torch SDPA causal GQA bf16: {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
    doc = {"bench": "prefill_attention_variants", **run_metadata(), "n": a.n, "ctx": a.ctx, "flops": flops,
           "results": rows}
    if a.out_dir:
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        Path(a.out_dir, "prefill_attention_variants.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
