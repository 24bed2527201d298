"""How fast can the H200 stream a weight matrix under each access pattern a decode kernel might use?

A read-only kernel (no decode, no math): every thread reads 16-byte vectors of a [N, K-bytes] matrix and XORs
them into one register (stored at the end so nothing is dead). The patterns differ only in which bytes one warp
instruction touches and how far each row advances per loop iteration:

    rows R      rows one warp instruction covers (512 / R contiguous bytes of each)
    unroll U    loads per thread per iteration, to consecutive 512/R-byte segments of the same rows
                (so one iteration reads U * 512 / R contiguous bytes of each of its rows)
    ctas        CTAs of 4 warps; rows are split among CTAs, K among the CTAs of a row block (like split-K)
    order       "seg": a thread's U loads go to U consecutive segments (the quad reads 64 B, then the next 64 B);
                "lane": a lane's U loads are contiguous (lane c reads 16 B * U at c * 16 * U)

Reported: GB/s over the matrix bytes and the fraction of this run's device-to-device copy bandwidth (read +
write, as bench/kernels.py). The MMA GEMV (m3serve/kernels/gemm/_mma_gemv.py) reads R = 8 rows x 64 bytes per
instruction, which is the first thing this measures.

--staged (issue 30: where should the one-token MoE keep its loads in flight?): the MoE's gate|up step moves 8 words
(32 B) a thread and spends ~28 instructions a word on decode and MMA, with one step of loads in flight in registers.
The staged patterns stream the same matrix in that shape (CTAs of 4 warps, 32 rows x 128 B a step, 8 words a
thread) with WORK dependent integer rounds a word (2 instructions each: WORK 12 ~ the decode's count) through
    regs S     a register ring: S - 1 steps loaded ahead into registers (S = 1: load, then compute)
    smem S     Triton's software pipeline: cp.async into an S-stage shared-memory ring (tl.range num_stages=S)
    tma S      the same ring filled by TMA (a host tensor descriptor, one bulk copy a step a CTA)
so one run says whether more bytes in flight without more registers (shared memory) lifts the latency-bound
stream, and by how much with the decode's instructions in the loop.

    python3 bench/stream_patterns.py [--staged-only] [--out-dir DIR]        (GPU, ~20 s; --staged-only ~10 s)
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _asm(rows: int, unroll: int, order: str) -> tuple[str, str]:
    """One iteration's loads for one thread: base = row0 address + k offset (bytes); the thread's row and
    column inside the warp's [rows, 512 / rows] footprint come from %laneid."""
    seg = 512 // rows  # bytes of a row one instruction covers
    lanes_per_row = 32 // rows
    s = ["{", ".reg .b32 lane, r, cc, a0, a1, a2, a3, acc, tid, wp;", ".reg .b64 addr, o64;",
         "mov.u32 lane, %laneid;", "mov.u32 tid, %tid.x;", "shr.u32 wp, tid, 5;",
         f"div.u32 r, lane, {lanes_per_row};", f"rem.u32 cc, lane, {lanes_per_row};", "mad.lo.u32 r, wp, $8, r;",
         "mul.wide.u32 o64, r, $4;", "add.s64 addr, $2, o64;",
         f"mul.lo.u32 cc, cc, {16 * (unroll if order == 'lane' else 1)};", "cvt.u64.u32 o64, cc;",
         "add.s64 addr, addr, o64;", "mov.b32 acc, $6;"]
    for u in range(unroll):
        off = 16 * u if order == "lane" else seg * u
        s.append(f"ld.global.nc.L1::no_allocate.v4.b32 {{a0, a1, a2, a3}}, [addr+{off}];")
        s.append("xor.b32 acc, acc, a0;\nxor.b32 acc, acc, a1;\nxor.b32 acc, acc, a2;\nxor.b32 acc, acc, a3;")
    s.append("mov.b32 $0, acc;\nmov.b32 $1, acc;\n}")
    return "\n".join(s), "=r,=r,l,l,r,r,r,r,r,r"  # (out x2, base x2, stride x2, acc x2, warp rows x2)


@triton.jit
def _step(addr, stride, acc, wr, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,=r,l,l,r,r,r,r,r,r", (addr, stride, acc, wr), dtype=tl.int32,
                                     is_pure=False, pack=2)


PATTERNS = ((8, 1, "seg"), (8, 4, "seg"), (8, 4, "lane"), (4, 4, "seg"), (2, 1, "seg"), (2, 4, "seg"), (1, 4, "seg"))


@triton.jit
def stream(w_ptr, out_ptr, stride, k_bytes, SPLIT, ROWS_CTA: tl.constexpr, R: tl.constexpr, ITER_BYTES: tl.constexpr,
           ASM: tl.constexpr):
    """CTA (pid_n, pid_k): rows [pid_n * ROWS_CTA, +ROWS_CTA), bytes [pid_k * k_bytes / SPLIT, +k_bytes / SPLIT);
    warp w covers rows ROWS_CTA / 4 * w .. in blocks of R rows."""
    T: tl.constexpr = 256
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    zl = tl.zeros([T], tl.int64)
    zi = tl.zeros([T], tl.int32)
    k_len = k_bytes // SPLIT
    base = w_ptr.to(tl.int64) + (pid_n * ROWS_CTA).to(tl.int64) * stride + pid_k * k_len
    acc = zi
    BLOCKS: tl.constexpr = ROWS_CTA // (4 * R)  # row blocks per warp (warp w's rows start at w * ROWS_CTA / 4)
    wr = zi + ROWS_CTA // 4
    for b in tl.static_range(BLOCKS):
        for k in range(0, k_len, ITER_BYTES):
            acc = _step(zl + base + b * R * stride + k, zi + stride, acc, wr, ASM)
    tl.store(out_ptr + tl.program_id(0) * T + tl.arange(0, T), acc)


STAGED_ROWS, STAGED_BK = 32, 128  # a CTA's step: 32 rows x 128 B = 8 words a thread of 4 warps (gate|up's share)
STAGED = (("regs", 1), ("regs", 2), ("regs", 3), ("smem", 2), ("smem", 3), ("smem", 4), ("smem", 6), ("tma", 3),
          ("tma", 4), ("tma", 6))


@triton.jit
def _work(v, WORK: tl.constexpr):
    """WORK dependent rounds of 2 integer instructions a word (IMAD + shift): the decode's instruction load."""
    for _ in tl.static_range(WORK):
        v = v * 747796405 + (v >> 9)
    return v


@triton.jit
def staged_regs(w_ptr, out_ptr, stride_w, k_words, SPLIT, ROWS: tl.constexpr, BKW: tl.constexpr,
                AHEAD: tl.constexpr, WORK: tl.constexpr):
    """CTA (pid_n, pid_k): rows [pid_n * ROWS, +ROWS), words [pid_k * k_words / SPLIT, +k_words / SPLIT) of an int32
    view; AHEAD steps loaded ahead into registers (a ring of AHEAD + 1 steps), no shared memory."""
    pid_n = tl.program_id(0)
    k_len = tl.multiple_of(k_words // SPLIT, BKW)  # the launcher keeps it a multiple of the step
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    ptr = w_ptr + rows.to(tl.int64)[:, None] * stride_w + tl.program_id(1) * k_len + tl.arange(0, BKW)[None, :]
    acc = tl.zeros([ROWS, BKW], tl.int32)
    last = k_len - BKW  # loads past the slice repeat its last step (an L2 hit, unused)
    a = tl.load(ptr)
    b = tl.load(ptr + tl.minimum(BKW, last))
    for k in range(0, k_len, BKW):
        if AHEAD == 0:
            acc ^= _work(tl.load(ptr + k), WORK)
        elif AHEAD == 1:
            nxt = tl.load(ptr + tl.minimum(k + BKW, last))
            acc ^= _work(a, WORK)
            a = nxt
        else:
            nxt = tl.load(ptr + tl.minimum(k + 2 * BKW, last))
            acc ^= _work(a, WORK)
            a = b
            b = nxt
    tl.store(out_ptr + pid_n * ROWS * BKW + tl.arange(0, ROWS)[:, None] * BKW + tl.arange(0, BKW)[None, :], acc)


@triton.jit
def staged_smem(w_ptr, out_ptr, stride_w, k_words, SPLIT, ROWS: tl.constexpr, BKW: tl.constexpr,
                STAGES: tl.constexpr, WORK: tl.constexpr):
    """As staged_regs, the loads pipelined by Triton through an STAGES-deep shared-memory ring (cp.async)."""
    pid_n = tl.program_id(0)
    k_len = tl.multiple_of(k_words // SPLIT, BKW)  # the launcher keeps it a multiple of the step
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    ptr = w_ptr + rows.to(tl.int64)[:, None] * stride_w + tl.program_id(1) * k_len + tl.arange(0, BKW)[None, :]
    acc = tl.zeros([ROWS, BKW], tl.int32)
    for k in tl.range(0, k_len, BKW, num_stages=STAGES):
        acc ^= _work(tl.load(ptr + k), WORK)
    tl.store(out_ptr + pid_n * ROWS * BKW + tl.arange(0, ROWS)[:, None] * BKW + tl.arange(0, BKW)[None, :], acc)


@triton.jit
def staged_tma(desc, out_ptr, k_words, SPLIT, ROWS: tl.constexpr, BKW: tl.constexpr, STAGES: tl.constexpr,
               WORK: tl.constexpr):
    """As staged_smem, each step's [ROWS, BKW] block one TMA copy (desc: a host TensorDescriptor of that block)."""
    pid_n = tl.program_id(0)
    k_len = tl.multiple_of(k_words // SPLIT, BKW)  # the launcher keeps it a multiple of the step
    k0 = tl.program_id(1) * k_len
    acc = tl.zeros([ROWS, BKW], tl.int32)
    for k in tl.range(0, k_len, BKW, num_stages=STAGES):
        acc ^= _work(desc.load([pid_n * ROWS, k0 + k]), WORK)
    tl.store(out_ptr + pid_n * ROWS * BKW + tl.arange(0, ROWS)[:, None] * BKW + tl.arange(0, BKW)[None, :], acc)


def staged_patterns(kb, w: torch.Tensor, flush: torch.Tensor, bw: float) -> list[dict]:
    """Every STAGED pattern at WORK 0 and 12, split 1 and 2 (768 / 1536 CTAs), on the matrix `w` [n, k bytes]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, kbytes = w.shape
    words = w.view(torch.int32)
    kw, bkw = kbytes // 4, STAGED_BK // 4
    out = torch.empty((n // STAGED_ROWS) * STAGED_ROWS * bkw, dtype=torch.int32, device=w.device)
    desc = TensorDescriptor.from_tensor(words, [STAGED_ROWS, bkw])
    res = []
    for kind, depth in STAGED:
        for work in (0, 12):
            for split in (1, 2):
                grid = (n // STAGED_ROWS, split)

                def call(kind=kind, depth=depth, work=work, split=split, grid=grid):
                    if kind == "regs":
                        staged_regs[grid](words, out, kw, kw, split, ROWS=STAGED_ROWS, BKW=bkw, AHEAD=depth - 1,
                                          WORK=work, num_warps=4)
                    elif kind == "smem":
                        staged_smem[grid](words, out, kw, kw, split, ROWS=STAGED_ROWS, BKW=bkw, STAGES=depth,
                                          WORK=work, num_warps=4)
                    else:
                        staged_tma[grid](desc, out, kw, split, ROWS=STAGED_ROWS, BKW=bkw, STAGES=depth, WORK=work,
                                         num_warps=4)

                rec = {"pattern": kind, "depth": depth, "work_rounds": work, "split": split,
                       "ctas": grid[0] * grid[1]}
                try:
                    call()
                    torch.cuda.synchronize()
                    t = kb.time_call(kb.graphed(call) or call, 20, flush)
                    rec.update(us=t * 1e6, GBps=w.numel() / t / 1e9, frac_copy=w.numel() / t / bw)
                    print(f"{kind:4s} depth {depth}  work {work:2d}  split {split}  CTAs {rec['ctas']:5d}  "
                          f"{rec['us']:7.1f} us  {rec['GBps']:6.0f} GB/s  {100 * rec['frac_copy']:5.1f}% copy", flush=True)
                except Exception as exc:  # one pattern failing to build must not lose the others' numbers
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    print(f"{kind} depth {depth} work {work} split {split}: {rec['error']}", flush=True)
                res.append(rec)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.environ.get("OUT"))
    ap.add_argument("--staged-only", action="store_true", help="only the staged patterns (--staged in the docstring)")
    a = ap.parse_args(argv)
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    kb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kb)
    dev = torch.device("cuda")
    bw = kb.copy_bandwidth(dev)
    n, kbytes = 24576, 3072  # the dense gate|up projection in NVFP4 (85 MB with its scales; 75.5 MB of codes)
    w = torch.randint(0, 255, (n, kbytes), dtype=torch.uint8, device=dev)
    flush = torch.empty(kb.FLUSH_BYTES, dtype=torch.uint8, device=dev)
    res = []
    for r, u, order in (() if a.staged_only else PATTERNS):
        asm = _asm(r, u, order)[0]
        for rows_cta, split in ((128, 2), (128, 8), (32, 2)):
            iter_bytes = (512 // r) * u if order == "seg" else 16 * u * (32 // r)
            if (kbytes // split) % iter_bytes or rows_cta % (4 * r):
                continue
            out = torch.empty((n // rows_cta) * 256, dtype=torch.int32, device=dev)
            grid = (n // rows_cta, split)

            def call(rc=rows_cta, sp=split, ib=iter_bytes, text=asm, rr=r, o=out):
                stream[grid](w, o, kbytes, kbytes, sp, ROWS_CTA=rc, R=rr, ITER_BYTES=ib, ASM=text, num_warps=4)

            replay = kb.graphed(call)
            t = kb.time_call(replay or call, 20, flush)
            rec = {"rows_per_instr": r, "unroll": u, "order": order, "rows_per_cta": rows_cta, "split": split,
                   "ctas": grid[0] * grid[1], "us": t * 1e6, "GBps": w.numel() / t / 1e9, "frac_copy": w.numel() / t / bw}
            res.append(rec)
            print(f"R={r} U={u} {order:4s} rows/CTA {rows_cta:3d} split {split}  CTAs {rec['ctas']:5d}  "
                  f"{rec['us']:7.1f} us  {rec['GBps']:6.0f} GB/s  {100 * rec['frac_copy']:5.1f}% copy", flush=True)
    staged = staged_patterns(kb, w, flush, bw)
    from m3serve.benchmeta import git_commit
    doc = {"gpu": torch.cuda.get_device_name(dev), "git_commit": git_commit(), "command": " ".join(sys.argv),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "copy_bandwidth_Bps": bw, "matrix": [n, kbytes],
           "results": res, "staged": staged}
    card = "h100" if "H100" in doc["gpu"] else "h200"
    name = f"stream-patterns-{card}-{'staged-' if a.staged_only else ''}{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d')}.json"
    for d in ([Path(a.out_dir)] if a.out_dir else []) + [ROOT / "bench" / "results" / "stream_patterns"]:
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
