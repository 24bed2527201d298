"""Compile every certified cell's kernels for sm_90 without a GPU and report resource use.

    python -m m3serve.kernels.aot_check [--entry NAME] [--sass-dir DIR] [--sass-stats [--e2m1 both|ptx|triton]]
                                        [--waves ROWS]

Each entry's raw call runs on 'meta' tensors of the real shapes inside capture_launches, so
the exact compiled variants (constexprs, 16-byte divisibility, ==1 specialisation) are
collected without allocating memory; each distinct variant is then built with Triton's own
ptxas and read back with cuobjdump. A register spill (stack > 0) is reported; a build error
fails. This is a CPU-side guard: it proves compilation and shows the code size, not speed.

--sass-stats: the instruction mix of each variant's K loop, read from `cuobjdump -sass`. Method:
every backward branch (BRA to a lower address) closes a loop spanning [target, branch]; the
INNERMOST loops are those containing no other loop; the K loop is the innermost loop with the
most instructions (the weight decode dominates; NOPs are not counted). One iteration of it
handles one BN x BK weight tile (Triton does not unroll the K loop; software pipelining keeps
one tile per iteration; moe_gate_up's K step streams two, its gate and up tiles: TILES_PER_K_STEP), i.e.
tiles*BN*BK / (32*num_warps) weights per thread, so

    instructions per weight = (K-loop instructions) * 32 * num_warps / (tiles * BN * BK)

For attention kernels (attn.paged: no BK) one K step is a BN-key tile of K and of V, so the unit is one
K/V value (an FP8 byte, a BF16 element, an NVFP4 nibble) and the BK column shows D.
(thread instructions per weight element: the unit of the H200 budget of ~5.6 per NVFP4 weight at
70 % of copy bandwidth). With --e2m1 both, every variant is compiled with the inline-PTX NVFP4
decoder (_e2m1_ptx.PTX_E2M1 = True) and with the pure-Triton one, for a before/after table. A
static count, not a timing: stalls, dual issue and memory are not modelled.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from dataclasses import dataclass

import torch

from m3serve.kernels.formats import _e2m1_ptx
from m3serve.kernels._jit import AotResult, aot_compile, capture_launches
from m3serve.kernels.catalog import Entry, all_entries

META = torch.device("meta")


def _variant_key(kern, args, kwargs) -> tuple:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    spec = []
    for a in args:
        ty, attr = native_specialize_impl(BaseBackend, a, False, True, True)
        spec.append((ty, attr if isinstance(attr, (str, int, float, bool, type(None))) else str(attr)))
    return (kern.__name__, tuple(spec), tuple(sorted((k, str(v)) for k, v in kwargs.items())))


def collect(entries: list[Entry]) -> dict[tuple, tuple]:
    """Distinct (kernel, specialisation) -> (entry name, cell why, kernel, args, kwargs)."""
    return {key: (ename, cell.why, kern, args, kwargs)
            for key, (ename, cell, _rows, kern, args, kwargs) in _variants_with_rows(entries).items()}


def run(entries: list[Entry], arch: int = 90, sass_dir: str | None = None) -> list[tuple[str, str, AotResult]]:
    out = []
    for key, (ename, why, kern, args, kwargs) in collect(entries).items():
        res = aot_compile(kern, args, kwargs, arch=arch, sass=sass_dir is not None)
        if sass_dir is not None and res.sass:
            os.makedirs(sass_dir, exist_ok=True)
            with open(os.path.join(sass_dir, f"{ename}.{kern.__name__}.{abs(hash(key)) % 10**8}.sass"), "w") as f:
                f.write(f"# {why}\n# {kwargs}\n{res.sass}")
        out.append((ename, why, res))
    return out


_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)")


@dataclass
class LoopStats:
    start: int
    end: int
    count: int
    mix: dict[str, int]


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text up to its ";") of each instruction in one cuobjdump -sass listing."""
    out = []
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text: str) -> str:
    """Base mnemonic: '@!P0 LOP3.LUT R1, ...' -> 'LOP3'."""
    toks = text.split()
    op = toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]
    return op.split(".")[0]


def innermost_loops(sass: str) -> list[LoopStats]:
    ins = sass_instructions(sass)
    spans = []
    for addr, text in ins:
        m = _BRANCH.search(text)
        if m and opcode(text) == "BRA" and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    inner = [(a, b) for a, b in spans if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    loops = []
    for a, b in inner:
        body = [opcode(t) for addr, t in ins if a <= addr <= b and opcode(t) != "NOP"]
        loops.append(LoopStats(a, b, len(body), dict(collections.Counter(body).most_common())))
    return loops


# kernels whose K step streams more than one BN x BK tile (moe_gate_up: the gate and the up tile)
TILES_PER_K_STEP = {"moe_gate_up": 2}


def k_loop_stats(sass: str, kwargs: dict, tiles: int = 1) -> tuple[LoopStats | None, float]:
    """(the K loop, thread instructions per weight) of one compiled variant whose K step streams `tiles`
    BN x BK weight tiles; see the module doc."""
    loops = innermost_loops(sass)
    if loops and "RP" in kwargs and "NW" in kwargs:  # mma_gemv: one K step = 2 * RP rows x 32 columns a thread
        loop = max(loops, key=lambda lp: lp.count)
        # PAIRED (the MMA MoE): two K steps an iteration; the down loop's once-a-slot blocks (a new slot's
        # addresses, the fold) are inside it and counted as if every pair ran them
        steps = 2 if kwargs.get("PAIRED") else 1
        return loop, loop.count / (steps * 2 * kwargs["RP"] * 32)
    if not loops or "BN" not in kwargs or ("BK" not in kwargs and "D" not in kwargs):
        return None, float("nan")
    loop = max(loops, key=lambda lp: lp.count)
    # attention (no BK): one K step is a BN-key tile of K and of V, D values per key each
    tile = kwargs["BN"] * kwargs["BK"] if "BK" in kwargs else 2 * kwargs["BN"] * kwargs["D"]
    per_thread = tiles * tile / (32 * kwargs.get("num_warps", 4))
    return loop, loop.count / per_thread


_MIX_KEYS = ("LOP3", "IMAD", "SHF", "PRMT", "HMUL2", "HADD2", "FFMA", "F2FP", "HMMA", "HGMMA", "LDG", "LDS", "LDSM", "STS",
             "BAR")


def _variants_with_rows(entries: list[Entry]) -> dict[tuple, tuple]:
    """As collect, also naming the row count that produced each variant (M == 1 is specialised)."""
    variants: dict[tuple, tuple] = {}
    for e in entries:
        for cell in e.cells:
            for rows in sorted({cell.rows[0], cell.rows[1]}):
                case = e.make_case(cell, rows, META, None)
                with capture_launches() as rec:
                    e.raw_call(*case.args, **case.kwargs)
                for kern, _grid, args, kwargs in rec:
                    variants.setdefault(_variant_key(kern, args, kwargs), (e.name, cell, rows, kern, args, kwargs))
    return variants


SM90_SMS = 132                  # H100 SXM and H200: the same die
SM90_REGS, SM90_WARPS, SM90_CTAS, SM90_SMEM = 65536, 64, 32, 228 * 1024


def ctas_per_sm(regs: int, warps: int, smem: int) -> int:
    """CTAs of one kernel resident on an sm_90 SM at once: registers are allocated per warp in units of 256 (a
    thread's count rounded up to 8), and each CTA also takes 1 KB of shared memory the runtime reserves."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (SM90_REGS // per_warp) // warps
    return max(0, min(by_regs, SM90_WARPS // warps, SM90_CTAS, SM90_SMEM // (smem + 1024)))


def waves(entries: list[Entry], rows: tuple[int, ...], arch: int = 90) -> list[str]:
    """One row per (cell, row count in `rows` inside the cell, launch): its grid, the CTAs an SM holds (from the
    compiled registers, warps and shared memory) and the waves the grid needs on 132 SMs. A launch of 1.0-1.5
    waves runs a partial second wave behind a full one (the one-token MoE down at 90 registers: 768 CTAs at 5 an
    SM); one well under 1 leaves SMs idle unless its CTAs stream enough bytes each. '<' marks a tail wave under
    half full, 'idle' a grid under half the card."""
    built: dict[tuple, AotResult] = {}
    out = [f"{'entry':13s} {'kernel':22s} {'rows':>4s} {'grid':>14s} {'CTAs':>6s} {'regs':>4s} {'w':>2s} "
           f"{'CTA/SM':>6s} {'waves':>6s}  [cell]"]
    for e in entries:
        for cell in e.cells:
            for n in rows:
                if not cell.rows[0] <= n <= cell.rows[1]:
                    continue
                case = e.make_case(cell, n, META, None)
                with capture_launches() as rec:
                    e.raw_call(*case.args, **case.kwargs)
                for kern, grid, args, kwargs in rec:
                    if callable(grid):
                        continue  # a meta-dependent grid: no static CTA count
                    key = _variant_key(kern, args, kwargs)
                    if key not in built:
                        built[key] = aot_compile(kern, args, kwargs, arch=arch)
                    r = built[key]
                    g = tuple(int(v) for v in (grid if isinstance(grid, tuple) else (grid,)))
                    ctas = 1
                    for v in g:
                        ctas *= v
                    w = kwargs.get("num_warps", 4)
                    per_sm = ctas_per_sm(r.regs, w, r.shared)
                    wv = ctas / (SM90_SMS * per_sm) if per_sm else float("inf")
                    tail = wv - int(wv)
                    flag = "<" if wv > 1 and 0 < tail < 0.5 else ("idle" if wv < 0.5 else "")
                    out.append(f"{e.name:13s} {kern.__name__:22s} {n:4d} {str(g):>14s} {ctas:6d} {r.regs:4d} {w:2d} "
                               f"{per_sm:6d} {wv:6.2f}{flag:>5s} [{cell.why}]")
    return out


def sass_stats(entries: list[Entry], modes: tuple[str, ...], arch: int = 90) -> list[str]:
    """One row per weight-streaming variant (kernels with BN/BK tiles): K-loop instructions and
    thread instructions per weight under each NVFP4 decoder mode, and the K-loop mix of the last."""
    saved = _e2m1_ptx.PTX_E2M1
    rows: dict[tuple, dict[str, tuple]] = {}
    info: dict[tuple, tuple] = {}
    try:
        for mode in modes:
            _e2m1_ptx.PTX_E2M1 = mode == "ptx"
            for key, (ename, cell, nrows, kern, args, kwargs) in _variants_with_rows(entries).items():
                if "RP" not in kwargs and ("BN" not in kwargs or ("BK" not in kwargs and "D" not in kwargs)):
                    continue  # no weight or key tile loop (e.g. the MoE router)
                res = aot_compile(kern, args, kwargs, arch=arch, sass=True)
                loop, per_w = k_loop_stats(res.sass or "", kwargs, TILES_PER_K_STEP.get(kern.__name__, 1))
                base = (ename, kern.__name__, cell.why, key[1], tuple(kv for kv in key[2] if kv[0] != "PTX"))
                bn = kwargs["BN"] if "BN" in kwargs else 16 * kwargs["RP"] * kwargs["NW"]
                info[base] = (bn, kwargs.get("BK", kwargs.get("D", 128)), kwargs.get("num_warps", 4), cell.shape, nrows)
                rows.setdefault(base, {})[mode] = (loop, per_w, res.stack + res.local)
    finally:
        _e2m1_ptx.PTX_E2M1 = saved
    head = (f"{'entry':13s} {'kernel':13s} {'shape':>22s} {'M':>3s} {'BN':>3s} {'BK':>4s} {'w':>2s} "
            + " ".join(f"{m + ' loop':>11s} {m + '/wt':>10s}" for m in modes) + f"  K-loop mix ({modes[-1]})  [cell]")
    out = [head]
    for base, per_mode in rows.items():
        ename, kname, why = base[:3]
        bn, bk, nw, shape, nrows = info[base]
        cols = []
        for m in modes:
            loop, per_w, spill = per_mode.get(m, (None, float("nan"), 0))
            cols.append(f"{(loop.count if loop else 0):11d} {per_w:9.2f}{'!' if spill else ' '}")
        loop = per_mode.get(modes[-1], (None,))[0]
        mix = " ".join(f"{k}:{loop.mix[k]}" for k in _MIX_KEYS if loop and k in loop.mix)
        out.append(f"{ename:13s} {kname:13s} {str(shape):>22s} {nrows:3d} {bn:3d} {bk:4d} {nw:2d} " + " ".join(cols)
                   + f"  {mix}  [{why}]")
    out.append("('!' = register spills in that variant)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entry", action="append", help="entry name (repeatable); default: all")
    ap.add_argument("--sass-dir", default=None)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sass-stats", action="store_true", help="K-loop instructions per weight (see module doc)")
    ap.add_argument("--e2m1", choices=("both", "ptx", "triton"), default="both",
                    help="with --sass-stats: NVFP4 decoder(s) to compile")
    ap.add_argument("--waves", default=None, metavar="ROWS",
                    help="comma list of row counts: each cell's launches there, their CTAs per SM and waves (see waves)")
    a = ap.parse_args(argv)
    ents = all_entries()
    chosen = [ents[n] for n in a.entry] if a.entry else list(ents.values())
    if a.waves:
        for line in waves(chosen, tuple(int(v) for v in a.waves.split(",")), a.arch):
            print(line, flush=True)
        return 0
    if a.sass_stats:
        modes = ("triton", "ptx") if a.e2m1 == "both" else (a.e2m1,)
        for line in sass_stats(chosen, modes, a.arch):
            print(line, flush=True)
        return 0
    spills = 0
    for ename, why, r in run(chosen, a.arch, a.sass_dir):
        flag = "  SPILL" if r.stack > 0 or r.local > 0 else ""
        spills += bool(flag)
        print(f"{ename:14s} {r.name:20s} regs {r.regs:3d} stack {r.stack:4d} smem {r.shared:6d}{flag}  [{why}]")
    print(f"done; {spills} variant(s) with spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
