"""Tile configs of attn.prefill on the GPU: TFLOP/s at an 8k-token chunk of an M3 TP1 dense layer.

For each page dtype (bf16, fp8) and each PrefillTiles variant: correctness first (a mixed step of
first chunks, a chunk after an unaligned context and padding, through the entry's compare; the
single-bf16-p variants against their wider band), then the median time of --iters launches (CUDA
events) of one sequence of --n query tokens after --ctx context keys, and TFLOP/s over the causal
flops 2*2*D*Hq*(visible pairs). Also times torch's SDPA (flash, bf16, contiguous K/V, enable_gqa)
on the same problem as a yardstick. The p.v split (two MMAs) vs one bf16 MMA is the pv_split pair.

    python3 bench/prefill_attention_variants.py [--n 8192] [--ctx 0] [--iters 20] [--kv 16,8] [--out-dir DIR]

--sparse-topk K (16 for M3) times an MSA layer's prefill instead: the same chunk with a top-K selection of 128-key
blocks as msa.select makes one (each query's own block and random earlier ones), once drawn per token ("random":
the tokens of a tile share few blocks, the worst case) and once per 128-token query block ("shared": they share
all, the best case), through attn.prefill_sparse (default tiles, plus --variants if given) against the dense
attn.prefill on the same chunk and attn.paged (the decode kernel sparse prefill rows took before, at the split
count the target would use) on the same selection. TFLOP/s count the selected visible pairs for the sparse rows.

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
    # bf16 operands with the conditional rescale (lazy: acc / l rescaled only when a row's max grows by > 2**8;
    # no spills at sm_90 for these, aot-compiled on the CPU; 128 x 128 spills 64 B)
    T(64, 64, 4, 3, lazy=True), T(64, 64, 4, 3, heads=2, lazy=True), T(128, 64, 8, 2, heads=2, lazy=True),
    T(64, 64, 4, 4, lazy=True), T(64, 32, 4, 3, lazy=True), T(128, 64, 8, 1, heads=2, lazy=True),
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


def band_check(case) -> str:
    """"ok" when the variant's output on a small case lies within the entry's band of the fp32 reference, else
    "FAIL ..." with the compare's message (the variant is still timed, and the row says it failed)."""
    try:
        out = pa.prefill_attention(*case.args, **case.kwargs)
        pa.compare(out, pa.prefill_attention_reference(*case.args, **case.kwargs), case)
        return "ok"
    except AssertionError as exc:
        return f"FAIL {str(exc)[:160]}"


def sparse_flops(sel: torch.Tensor, pos: torch.Tensor, block_size: int, hq: int, d: int) -> int:
    """4 * D * Hq / Hk * (visible keys of the selected blocks, summed over (query, KV head)): sel [n, Hk, K]."""
    first = sel.long() * block_size
    keys = torch.clamp(pos.view(-1, 1, 1) - first + 1, min=0, max=block_size).masked_fill(sel < 0, 0)
    return 4 * d * (hq // sel.shape[1]) * int(keys.sum())


def time_sparse(a, chosen_sparse: list, dev: torch.device) -> list[dict]:
    """--sparse-topk: attn.prefill_sparse vs dense attn.prefill vs attn.paged on one chunk (module docstring)."""
    from m3serve.kernels.attention.paged import make_workspace, paged_attention
    from m3serve.runtime.step_inputs import split_plan

    hq, hk, d, p, bs, topk = 64, 4, 128, 128, 128, a.sparse_topk
    rows = []
    dense_flops = pa.causal_flops([a.n], [a.ctx + a.n], hq, d)
    pos = (a.ctx + torch.arange(a.n, device=dev))
    for bits in (int(b) for b in a.kv.split(",")):
        shape = (hq, hk, d, p, bits)
        big = pa.make_step_case(shape, [a.n], [a.ctx], dev, torch.Generator().manual_seed(0))
        args, kw = big.args, dict(big.kwargs)
        ms = time_ms(lambda: pa.prefill_attention(*args, **kw), a.iters)
        rows.append({"kv_bits": bits, "tiles": "dense attn.prefill (default tiles)", "ms": ms,
                     "tflops": dense_flops / ms / 1e9})
        print(f"kv{bits:2d} dense attn.prefill  {ms:8.3f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)
        fmt = "bf16" if bits == 16 else "fp8"
        _, splits = split_plan(a.n, big.args[3].shape[1], hk, topk)
        ws = make_workspace(a.n, hq, d, splits, dev)
        for shared in (False, True):
            flavour = "shared" if shared else "random"
            sel = pa.make_selection([a.n], [a.ctx + a.n], hk, bs, topk, dev, torch.Generator().manual_seed(1),
                                    shared=shared)
            flops = sparse_flops(sel, pos, bs, hq, d)
            for tiles in chosen_sparse:
                if tiles is not None and tiles.f16 and bits != 8:
                    continue
                small = pa.make_sparse_case(pa.Cell(rows=(1, 1), shape=(*shape, bs, topk), why="check",
                                                    config={"tiles": tiles}), 700, dev,
                                            torch.Generator().manual_seed(2))
                ok = band_check(small)
                skw = dict(kw, tiles=tiles, sel=sel, block_size=bs)
                ms = time_ms(lambda: pa.prefill_attention(*args, **skw), a.iters)
                name = f"sparse top-{topk} ({flavour}): attn.prefill_sparse {tiles or 'default tiles'}"
                rows.append({"kv_bits": bits, "tiles": name, "ms": ms, "tflops": flops / ms / 1e9, "check": ok})
                print(f"kv{bits:2d} {name}  {ms:8.3f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s  {ok}", flush=True)
            q, kp, vp, table, lens, qs, out = args
            ms = time_ms(lambda: paged_attention(q, kp, vp, None, None, None, table, lens, qs, sel, out, ws, fmt=fmt,
                                                 sm_scale=kw["sm_scale"], max_query_len=a.n, num_splits=splits),
                         a.iters)
            name = f"sparse top-{topk} ({flavour}): attn.paged ({splits} splits)"
            rows.append({"kv_bits": bits, "tiles": name, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"kv{bits:2d} {name}  {ms:8.3f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)
        del big, args, kw, ws
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default=None, help="comma-separated indices into VARIANTS")
    ap.add_argument("--kv", default="16,8", help="page dtypes by bits: 16 (bf16), 8 (fp8)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--sparse-topk", type=int, default=0,
                    help="time an MSA layer's prefill at this top-k instead (module docstring); 0: the dense sweep")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    chosen = VARIANTS if a.variants is None else [VARIANTS[int(i)] for i in a.variants.split(",")]
    rows = []
    hq, hk, d, p = 64, 4, 128, 128
    flops = pa.causal_flops([a.n], [a.ctx + a.n], hq, d)
    if a.sparse_topk:
        rows = time_sparse(a, [None] + ([] if a.variants is None else chosen), dev)
    for bits in (int(b) for b in a.kv.split(",")) if not a.sparse_topk else ():
        shape = (hq, hk, d, p, bits)
        big = pa.make_step_case(shape, [a.n], [a.ctx], dev, torch.Generator().manual_seed(0))
        for tiles in chosen:
            if tiles.f16 and bits != 8:
                continue
            small = pa.make_step_case(shape, [700, 333, 2], [0, 1000 + 77, -1], dev, torch.Generator().manual_seed(1),
                                      tiles)
            ok = band_check(small)
            args, kw = big.args, dict(big.kwargs, tiles=tiles)
            ms = time_ms(lambda: pa.prefill_attention(*args, **kw), a.iters)
            rec = {"kv_bits": bits, "tiles": tiles.__dict__, "ms": ms, "tflops": flops / ms / 1e9, "check": ok}
            rows.append(rec)
            print(f"kv{bits:2d} {tiles}  {ms:8.3f} ms  {rec['tflops']:6.1f} TFLOP/s  {ok}", flush=True)
        del big
        torch.cuda.empty_cache()
    if a.ctx == 0 and a.variants is None and not a.sparse_topk:
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
           **({"sparse_topk": a.sparse_topk} if a.sparse_topk else {}), "results": rows}
    if a.out_dir:
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        Path(a.out_dir, "prefill_attention_variants.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
