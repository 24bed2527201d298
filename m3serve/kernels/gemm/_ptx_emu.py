"""A warp-level interpreter for the PTX blocks of gemm/_mma_ptx.py, so the CPU tests execute the very text that is
compiled (the Triton interpreter cannot run inline PTX). Numpy over the 32 lanes of a warp; the only
cross-lane instruction is mma.sync, whose fragments are gathered as the PTX ISA lays them out.

Values are raw bits in uint64 arrays [32] (one per lane); memory is a set of byte regions at fake
addresses (Memory). Only the opcodes the blocks use are modelled; anything else raises. A predicated-off load
leaves its registers poisoned (NaN bit patterns), so a lane that should have loaded cannot pass by accident.

Semantics that matter for exactness:
    mul.rn.bf16x2, cvt.rn.bf16x2.f32, cvt.rn.bf16.f32   round to nearest even, subnormals kept
    cvt.rn.f16x2.e4m3x2, cvt.f32.f16                     exact (table / numpy)
    mma.sync ... f32.bf16.bf16.f32                       D = A @ B + C computed in float64, rounded to fp32
                                                         (the hardware's internal order is unspecified; the
                                                         tests' bands cover any order)
    mul.f32, add.f32, div.rn.f32, fma.rn.f32             numpy float32 (IEEE, round to nearest; fma rounded once)
    ex2.approx.ftz.f32                                   numpy's fp32 exp2 (the hardware is within 2 ulp of it;
                                                         the bands that cover it are stated where it is used)
"""

from __future__ import annotations

import re

import numpy as np

LANES = 32
_M32 = np.uint64(0xFFFFFFFF)


class Memory:
    """Byte regions at fake 256-aligned addresses."""

    def __init__(self) -> None:
        self.regions: list[tuple[int, np.ndarray]] = []
        self._next = 1 << 20

    def add(self, arr: np.ndarray) -> int:
        buf = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        base = self._next
        self.regions.append((base, buf))
        self._next += ((buf.size + 4095) // 4096 + 1) * 4096
        return base

    def add_view(self, arr: np.ndarray) -> tuple[int, np.ndarray]:
        """add, and the region's own buffer viewed as arr (stores land there)."""
        base = self.add(arr)
        return base, self.regions[-1][1].view(arr.dtype).reshape(arr.shape)

    def _find(self, addr: int, n: int) -> tuple[np.ndarray, int]:
        for base, buf in self.regions:
            if base <= addr and addr + n <= base + buf.size:
                return buf, addr - base
        raise IndexError(f"emulated memory: no region holds [{addr:#x}, +{n})")

    def load(self, addrs: np.ndarray, nbytes: int, active: np.ndarray) -> np.ndarray:
        out = np.zeros((LANES, nbytes), np.uint8)
        for i in np.nonzero(active)[0]:
            buf, off = self._find(int(addrs[i]), nbytes)
            out[i] = buf[off:off + nbytes]
        return out

    def store(self, addrs: np.ndarray, data: np.ndarray, active: np.ndarray) -> None:
        for i in np.nonzero(active)[0]:
            buf, off = self._find(int(addrs[i]), data.shape[1])
            buf[off:off + data.shape[1]] = data[i]


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits & _M32).astype(np.uint32).view(np.float32)


def _bits32(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float32).view(np.uint32).astype(np.uint64)


def _bf16_to_f64(h: np.ndarray) -> np.ndarray:
    return ((h.astype(np.uint64) & np.uint64(0xFFFF)) << np.uint64(16)).astype(np.uint32).view(np.float32).astype(np.float64)


def _f32_to_bf16_rne(f: np.ndarray) -> np.ndarray:
    bits = f.astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(f.astype(np.float32))
    r = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return np.where(nan, np.uint64(0x7FC0), r & np.uint64(0xFFFF))


def _f64_to_bf16_rne(v: np.ndarray) -> np.ndarray:
    f = v.astype(np.float32)
    finite = np.isfinite(v)
    if not np.array_equal(f.astype(np.float64)[finite], v[finite]):
        raise ArithmeticError("emulation: a bf16 product needs more than fp32 to round once")
    return _f32_to_bf16_rne(f)


def _e4m3_to_f16_table() -> np.ndarray:
    out = np.zeros(256, np.uint16)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            v = np.nan
        elif e == 0:
            v = m / 8 * 2.0**-6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        out[b] = np.array(-v if s else v, np.float16).view(np.uint16)
    return out


_E4M3_F16 = _e4m3_to_f16_table()


def _imm(tok: str) -> np.ndarray | None:
    t = tok.strip()
    if t.startswith("0f"):
        return np.full(LANES, int(t[2:], 16), np.uint64)
    if t.startswith("0x"):
        return np.full(LANES, int(t, 16), np.uint64)
    if re.fullmatch(r"-?\d+", t):
        return np.full(LANES, int(t) & 0xFFFFFFFFFFFFFFFF, np.uint64)
    return None


class Warp:
    """One warp executing one asm block: regs by name, $n operands bound to lane arrays."""

    def __init__(self, warp: int, operands: list[np.ndarray], mem: Memory) -> None:
        self.regs: dict[str, np.ndarray] = {}
        self.ops = operands
        self.mem = mem
        self.lane = np.arange(LANES, dtype=np.uint64)
        self.tid = self.lane + np.uint64(32 * warp)

    def get(self, tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok.startswith("$"):
            return self.ops[int(tok[1:])]
        if tok == "%laneid":
            return self.lane.copy()
        if tok == "%tid.x":
            return self.tid.copy()
        v = _imm(tok)
        if v is not None:
            return v
        return self.regs[tok]

    def set(self, tok: str, v: np.ndarray) -> None:
        tok = tok.strip()
        v = v.astype(np.uint64)
        if tok.startswith("$"):
            self.ops[int(tok[1:])] = v
        else:
            self.regs[tok] = v

    def addr(self, tok: str) -> np.ndarray:
        m = re.fullmatch(r"\[\s*([^\]+]+?)\s*(?:\+\s*(\d+))?\s*\]", tok.strip())
        if not m:
            raise ValueError(f"emulation: address operand {tok!r}")
        return self.get(m.group(1)) + np.uint64(int(m.group(2) or 0))

    def run(self, text: str) -> None:
        body = text.strip()
        if not (body.startswith("{") and body.endswith("}")):
            raise ValueError("emulate: expected a braced PTX block")
        for raw in body[1:-1].split(";"):
            line = " ".join(raw.split())
            if not line or line.startswith(".reg"):
                continue
            pred = None
            if line.startswith("@"):
                p, line = line.split(" ", 1)
                pred = self.regs[p[1:]].astype(bool)
            op, rest = line.split(" ", 1)
            self.exec(op, rest, pred)

    def exec(self, op: str, rest: str, pred) -> None:  # noqa: C901 - a flat opcode table reads best
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"):
            return self._mma(rest)
        args = [a.strip() for a in re.split(r",(?![^{]*\})", rest)]
        g = self.get
        if op in ("ld.global.nc.L1::no_allocate.v4.b32", "ld.global.nc.v4.b32"):
            active = pred if pred is not None else np.ones(LANES, bool)
            data = self.mem.load(self.addr(args[1]), 16, active).view(np.uint32)
            for i, r in enumerate(args[0].strip("{}").split(",")):
                # a predicated-off lane keeps its register: poison it, so a lane that should have loaded fails
                self.set(r, np.where(active, data[:, i].astype(np.uint64), np.uint64(0x7FC07FC0)))
            return
        if op in ("ld.global.nc.L1::no_allocate.u16", "ld.global.nc.L1::no_allocate.u8", "ld.global.nc.f32",
                  "ld.global.nc.L1::no_allocate.b32"):
            n = {"u16": 2, "u8": 1, "f32": 4, "b32": 4}[op.rsplit(".", 1)[1]]
            active = pred if pred is not None else np.ones(LANES, bool)
            data = self.mem.load(self.addr(args[1]), n, active)
            v = np.zeros(LANES, np.uint64)
            for i in range(n):
                v |= data[:, i].astype(np.uint64) << np.uint64(8 * i)
            # predicated off: the register keeps what it held (PTX), or poison if it held nothing yet
            before = self.regs.get(args[0], np.full(LANES, 0x7FC00000, np.uint64))
            return self.set(args[0], np.where(active, v, before))
        if op in ("st.global.b16", "st.global.cg.f32"):
            n = 2 if op.endswith("b16") else 4
            v = g(args[1])
            data = np.stack([((v >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.uint8) for i in range(n)], 1)
            return self.mem.store(self.addr(args[0]), data, pred if pred is not None else np.ones(LANES, bool))
        if op == "mov.b32" and args[1].startswith("{"):  # pack two 16-bit halves
            lo, hi = (g(t) & np.uint64(0xFFFF) for t in args[1].strip("{}").split(","))
            return self.set(args[0], lo | (hi << np.uint64(16)))
        if op == "mov.b32" and args[0].startswith("{"):  # unpack
            lo, hi = args[0].strip("{}").split(",")
            v = g(args[1])
            self.set(lo, v & np.uint64(0xFFFF))
            return self.set(hi, (v >> np.uint64(16)) & np.uint64(0xFFFF))
        if op in ("mov.u32", "mov.b32", "mov.f32"):
            return self.set(args[0], g(args[1]) & _M32)
        if op in ("shr.u32", "shl.b32", "and.b32", "or.b32", "mul.lo.u32", "add.u32", "min.u32"):
            a, b = g(args[1]) & _M32, g(args[2]) & _M32
            r = {"shr.u32": lambda: a >> b, "shl.b32": lambda: a << b, "and.b32": lambda: a & b,
                 "or.b32": lambda: a | b, "mul.lo.u32": lambda: a * b, "add.u32": lambda: a + b,
                 "min.u32": lambda: np.minimum(a, b)}[op]()
            return self.set(args[0], r & _M32)
        if op == "mad.lo.u32":
            return self.set(args[0], (g(args[1]) * g(args[2]) + g(args[3])) & _M32)
        if op == "mul.wide.u32":
            return self.set(args[0], (g(args[1]) & _M32) * (g(args[2]) & _M32))
        if op == "add.s64":
            return self.set(args[0], g(args[1]) + g(args[2]))
        if op == "shl.b64":
            return self.set(args[0], g(args[1]) << g(args[2]))
        if op == "cvt.u64.u32":
            return self.set(args[0], g(args[1]) & _M32)
        if op == "cvt.u32.u16":
            return self.set(args[0], g(args[1]) & np.uint64(0xFFFF))
        if op == "setp.eq.u32":
            return self.set(args[0], ((g(args[1]) & _M32) == (g(args[2]) & _M32)).astype(np.uint64))
        if op == "selp.b32":
            return self.set(args[0], np.where(self.regs[args[3]].astype(bool), g(args[1]), g(args[2])) & _M32)
        if op == "setp.le.u32":
            return self.set(args[0], ((g(args[1]) & _M32) <= (g(args[2]) & _M32)).astype(np.uint64))
        if op == "setp.lt.u32":
            return self.set(args[0], ((g(args[1]) & _M32) < (g(args[2]) & _M32)).astype(np.uint64))
        if op == "setp.ne.u32":
            return self.set(args[0], ((g(args[1]) & _M32) != (g(args[2]) & _M32)).astype(np.uint64))
        if op == "prmt.b32":
            a, b, sel = g(args[1]) & _M32, g(args[2]) & _M32, int(args[3], 0)
            pool = a | (b << np.uint64(32))
            r = np.zeros(LANES, np.uint64)
            for i in range(4):
                s = (sel >> (4 * i)) & 0xF
                byte = (pool >> np.uint64(8 * (s & 7))) & np.uint64(0xFF)
                if s & 8:  # sign replicate: the selected byte's msb in all 8 bits
                    byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                r |= byte << np.uint64(8 * i)
            return self.set(args[0], r)
        if op == "cvt.rn.f16x2.e4m3x2":
            v = g(args[1])
            lo = _E4M3_F16[(v & np.uint64(0xFF)).astype(np.int64)].astype(np.uint64)
            hi = _E4M3_F16[((v >> np.uint64(8)) & np.uint64(0xFF)).astype(np.int64)].astype(np.uint64)
            return self.set(args[0], lo | (hi << np.uint64(16)))
        if op == "cvt.f32.f16":
            h = (g(args[1]) & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16)
            return self.set(args[0], _bits32(h.astype(np.float32)))
        if op == "mul.f32":
            return self.set(args[0], _bits32(_f32(g(args[1])) * _f32(g(args[2]))))
        if op == "div.rn.f32":
            with np.errstate(divide="ignore", invalid="ignore"):
                return self.set(args[0], _bits32(_f32(g(args[1])) / _f32(g(args[2]))))
        if op in ("add.f32", "min.f32", "max.f32"):
            a, b = _f32(g(args[1])), _f32(g(args[2]))
            f = {"add.f32": np.add, "min.f32": np.fmin, "max.f32": np.fmax}[op]  # PTX min/max drop a NaN operand
            return self.set(args[0], _bits32(f(a, b)))
        if op == "neg.f32":
            return self.set(args[0], g(args[1]) ^ np.uint64(0x80000000))
        if op == "fma.rn.f32":  # one rounding: the float64 product of two fp32 values is exact
            a, b, c = (_f32(g(t)).astype(np.float64) for t in args[1:4])
            with np.errstate(invalid="ignore", over="ignore"):
                return self.set(args[0], _bits32((a * b + c).astype(np.float32)))
        if op == "ex2.approx.ftz.f32":  # the hardware's is within 2 ulp; fp32 exp2, subnormal results flushed
            with np.errstate(over="ignore", under="ignore"):
                v = np.exp2(_f32(g(args[1])))
            return self.set(args[0], _bits32(np.where(np.abs(v) < np.float32(2.0**-126), np.float32(0), v)))
        if op == "setp.ne.u64":
            return self.set(args[0], (g(args[1]) != g(args[2])).astype(np.uint64))
        if op == "and.pred":
            return self.set(args[0], (self.regs[args[1]].astype(bool) & self.regs[args[2]].astype(bool)).astype(np.uint64))
        if op == "selp.f32":
            return self.set(args[0], np.where(self.regs[args[3]].astype(bool), g(args[1]), g(args[2])) & _M32)
        if op == "cvt.rn.bf16x2.f32":
            hi, lo = _f32_to_bf16_rne(_f32(g(args[1]))), _f32_to_bf16_rne(_f32(g(args[2])))
            return self.set(args[0], lo | (hi << np.uint64(16)))
        if op == "cvt.rn.bf16.f32":
            return self.set(args[0], _f32_to_bf16_rne(_f32(g(args[1]))))
        if op == "mul.rn.bf16x2":
            a, b = g(args[1]), g(args[2])
            halves = [_f64_to_bf16_rne(_bf16_to_f64(a >> np.uint64(sh)) * _bf16_to_f64(b >> np.uint64(sh)))
                      for sh in (0, 16)]
            return self.set(args[0], halves[0] | (halves[1] << np.uint64(16)))
        raise ValueError(f"emulation: opcode {op!r} is not modelled")

    def _mma(self, rest: str) -> None:
        groups = [[t.strip() for t in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", rest)]
        d, a, b, c = groups
        g, t = (self.lane // np.uint64(4)).astype(np.int64), (self.lane % np.uint64(4)).astype(np.int64)
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        av = [self.get(r) for r in a]
        bv = [self.get(r) for r in b]
        cv = [_f32(self.get(r)).astype(np.float64) for r in c]
        for half in (0, 1):
            sh = np.uint64(16 * half)
            A[g, 2 * t + half] = _bf16_to_f64(av[0] >> sh)
            A[g + 8, 2 * t + half] = _bf16_to_f64(av[1] >> sh)
            A[g, 2 * t + 8 + half] = _bf16_to_f64(av[2] >> sh)
            A[g + 8, 2 * t + 8 + half] = _bf16_to_f64(av[3] >> sh)
            B[2 * t + half, g] = _bf16_to_f64(bv[0] >> sh)
            B[2 * t + 8 + half, g] = _bf16_to_f64(bv[1] >> sh)
        C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = cv
        with np.errstate(invalid="ignore", over="ignore"):
            D = A @ B + C
        out = (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
        for r, v in zip(d, out):
            self.set(r, _bits32(v.astype(np.float32)))


def run_block(text: str, warp: int, inputs: list[np.ndarray], n_outputs: int, mem: Memory) -> list[np.ndarray]:
    """Execute one block for one warp: `inputs` are the lane arrays of operands n_outputs.. in order;
    returns the output operands' lane arrays."""
    ops = [np.zeros(LANES, np.uint64) for _ in range(n_outputs)] + [np.asarray(v, np.uint64) for v in inputs]
    Warp(warp, ops, mem).run(text)
    return ops[:n_outputs]
