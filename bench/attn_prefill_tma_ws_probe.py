"""Probe: does a TMA-fed, warp-specialized flash-attention loop (Triton 3.6's Hopper `tl.range(warp_specialize=True)`
over 2-D tensor descriptors) beat attn.prefill's pointer-load loop on the H200 / H100?

Not an entry: a standalone kernel over a contiguous head-major context K / V [Hk, L, D] (what a long prefill step's
pages would be copied into), every key visible (the long context part of a chunk, no causal diagonal), the same
numerics as attn.prefill (bf16 operands, fp32 online softmax, p.v as bf16 hi + lo). Prints, per variant, the max
error against an fp32 torch reference on a small problem, then TFLOP/s on --n queries x --ctx keys of one M3 TP1
layer (Hq 64, Hk 4, D 128), beside attn.prefill (default tiles) on the same chunk after the same context.

    python3 bench/attn_prefill_tma_ws_probe.py [--n 16384] [--ctx 114688] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.attention import prefill as pa  # noqa: E402
from prefill_attention_variants import time_ms  # noqa: E402  (bench/: the script's folder is on sys.path)

HQ, HK, D = 64, 4, 128


@triton.jit
def _fa_tma(q_ptr, k_ptr, v_ptr, o_ptr, T, L, qk_scale, HQ: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    """q [HQ, T, D] head-major, k/v [HK, L, D] head-major, o [T, HQ, D]; every key visible to every query."""
    head = tl.program_id(0)
    mb = tl.program_id(1)
    kvh = head // GROUP
    qd = tl.make_tensor_descriptor(q_ptr, shape=[HQ * T, D], strides=[D, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(k_ptr, shape=[(HQ // GROUP) * L, D], strides=[D, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(v_ptr, shape=[(HQ // GROUP) * L, D], strides=[D, 1], block_shape=[BN, D])
    q = qd.load([head * T + mb * BM, 0])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    base = kvh * L
    for kb in tl.range(0, L // BN, num_stages=STAGES, warp_specialize=WS):
        k = kd.load([base + kb * BN, 0])
        v = vd.load([base + kb * BN, 0])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        p_hi = p.to(tl.bfloat16)
        acc = tl.dot(p_hi, v, acc)
        acc = tl.dot((p - p_hi.to(tl.float32)).to(tl.bfloat16), v, acc)
        m_i = m_new
    o = acc / l_i[:, None]
    r = mb * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    tl.store(o_ptr + (r.to(tl.int64)[:, None] * HQ + head) * D + d[None, :], o.to(tl.bfloat16))


def run_tma(q_hm, k_hm, v_hm, out, bm, bn, warps, stages, ws):
    hq, t, d = q_hm.shape
    L = k_hm.shape[1]
    grid = (hq, t // bm)
    _fa_tma[grid](q_hm, k_hm, v_hm, out, t, L, (d ** -0.5) * pa.LOG2E, HQ=hq, D=d, GROUP=hq // k_hm.shape[0],
                  BM=bm, BN=bn, WS=ws, STAGES=stages, num_warps=warps)
    return out


def reference(q_hm, k_hm, v_hm):
    g = q_hm.shape[0] // k_hm.shape[0]
    k = k_hm.float().repeat_interleave(g, 0)
    v = v_hm.float().repeat_interleave(g, 0)
    s = torch.einsum("htd,hld->htl", q_hm.float(), k) * q_hm.shape[2] ** -0.5
    return torch.einsum("htl,hld->thd", torch.softmax(s, -1), v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--ctx", type=int, default=114688)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    variants = [(64, 64, 4, 3, False), (64, 64, 4, 3, True), (64, 64, 4, 2, True), (128, 64, 8, 2, False),
                (128, 64, 8, 2, True), (128, 128, 8, 2, True), (64, 128, 4, 2, True)]
    res = {"n": a.n, "ctx": a.ctx, "variants": []}
    # correctness on a small problem
    qs = torch.randn(HQ, 256, D, device=dev, generator=gen).bfloat16()
    ks = torch.randn(HK, 2048, D, device=dev, generator=gen).bfloat16()
    vs = torch.randn(HK, 2048, D, device=dev, generator=gen).bfloat16()
    ref = reference(qs, ks, vs)
    q = torch.randn(HQ, a.n, D, device=dev, generator=gen).bfloat16()
    k = torch.randn(HK, a.ctx, D, device=dev, generator=gen).bfloat16()
    v = torch.randn(HK, a.ctx, D, device=dev, generator=gen).bfloat16()
    out = torch.empty(a.n, HQ, D, device=dev, dtype=torch.bfloat16)
    flops = 4 * a.n * a.ctx * HQ * D
    for bm, bn, warps, stages, ws in variants:
        rec = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages, "warp_specialize": ws}
        try:
            o = run_tma(qs, ks, vs, torch.full((256, HQ, D), float("nan"), device=dev, dtype=torch.bfloat16),
                        bm, bn, warps, stages, ws)
            torch.cuda.synchronize()
            rec["max_err"] = float((o.float() - ref).abs().max())
            ms = time_ms(lambda: run_tma(q, k, v, out, bm, bn, warps, stages, ws), a.iters)
            rec.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001 (a probe: record and go on)
            rec["error"] = f"{type(e).__name__}: {e}"[:1500]
        print(json.dumps(rec), flush=True)
        res["variants"].append(rec)
    # attn.prefill on the same chunk after the same context (its causal diagonal included: flops counted exactly)
    case = pa.make_step_case((HQ, HK, D, 128, 16), [a.n], [a.ctx], dev, torch.Generator().manual_seed(1))
    cflops = pa.causal_flops([a.n], [a.n + a.ctx], HQ, D)
    ms = time_ms(lambda: pa.prefill_attention(*case.args, **case.kwargs), a.iters)
    res["attn_prefill"] = {"ms": ms, "tflops": cflops / ms / 1e9}
    print(json.dumps(res["attn_prefill"]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({**run_metadata(), "bench": "attn_prefill_tma_ws_probe", **res}, indent=1))


if __name__ == "__main__":
    main()
