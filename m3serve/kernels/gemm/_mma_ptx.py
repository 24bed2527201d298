"""PTX text of the register-operand MMA GEMV (gemm/_mma_gemv.py): each block is one thread's whole share of one
step (its loads, or its decode + MMAs, or its stores), so what data a lane holds is fixed here, by %laneid and
%tid, and never by Triton's layouts.

Shape legend (one CTA, one K step of 128 columns):
    warp w = %tid.x / 32, lane L = %laneid, g = L / 4 (the MMA's group), c = L % 4 (thread in group)
    row pair p = 0..RP-1: rows rA = 16 * (RP * w + p) + g and rB = rA + 8 of the CTA's BN = 16 * RP * warps
    columns: lane c holds k0 + 32c .. k0 + 32c + 31 of each of its rows, and the same 32 columns of x
    x token: g; lanes of tokens g >= M load no x (their B columns feed only D columns that are never stored)

mma.sync.m16n8k16 (bf16 in, fp32 accumulate) fragments, per lane (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
    A regs a0 = (row g, k 2c..2c+1), a1 = (row g+8, same k), a2 = (row g, k 2c+8..2c+9), a3 = (row g+8, same k)
    B regs b0 = (k 2c..2c+1, column g), b1 = (k 2c+8..2c+9, column g)
    D regs d0, d1 = (row g, columns 2c, 2c+1), d2, d3 = (row g+8, columns 2c, 2c+1)
Within one MMA the 16 "k" of the instruction may stand for any 16 real columns, as long as A and B name the
same ones: each lane feeds its own columns, in the same order, to its A and B registers. A row pair's D
holds y[rows rA, rB; tokens 0..7] spread over the 32 lanes.

NVFP4 (8 nibbles a word; the decode of _e2m1_ptx: register j of a word = columns (j, j+4), scaled exactly):
    word q (q = 0..3) of a lane's 16 bytes = columns 8q .. 8q+7 of its 32
    MMA (q, h), h = 0, 1:  a0/a1 = rA/rB register 2h of word q  (columns 8q+2h, 8q+2h+4)
                           a2/a3 = rA/rB register 2h+1           (columns 8q+2h+1, 8q+2h+5)
                           b0 = (x[8q+2h], x[8q+2h+4]), b1 = (x[8q+2h+1], x[8q+2h+5])  (one PRMT each)
    group scales (E4M3, one per 16 columns): lane c's columns are groups 2c, 2c+1 of the step: one u16 per row
MXFP8 (4 E4M3 bytes a word, natural pairs; one E8M0 scale per 32 columns = one byte per row and lane):
    word i (i = 0..7) of a lane's 32 bytes = columns 4i .. 4i+3
    MMA i: a0/a1 = (columns 4i, 4i+1) of rA/rB, a2/a3 = (4i+2, 4i+3); b0 = x pair 2i, b1 = x pair 2i+1

Each builder returns (text, constraints) for tl.inline_asm_elementwise with pack=2: every operand group has
an even count (2 elements of a [64 * warps] tensor per thread, one tensor per 2 registers); a scalar input
is a broadcast tensor whose 2 operands are the same value, and only the first is read.
"""

from __future__ import annotations

from m3serve.kernels.formats._e2m1_ptx import e2m1_word_ptx

FMT_NVFP4 = 0
FMT_MXFP8 = 1

X_REGS = 16  # 32 bf16 columns of x per lane and step
_TWO_118 = "0f7A800000"  # 2**118 as an fp32 immediate
_TWO_8 = "0f43800000"  # 2**8: the NVFP4 unit of _decode, undone in the epilogue


def word_regs(fmt: int, rp: int) -> int:
    """Weight registers one thread loads per step: 16 (NVFP4) / 32 (MXFP8) bytes per row, 2 rows per pair."""
    return rp * (8 if fmt == FMT_NVFP4 else 16)


def acc_regs(rp: int) -> int:
    return 4 * rp


class _Operands:
    """Numbers the operands: outputs first, then inputs, each group a run of consecutive $n."""

    def __init__(self) -> None:
        self.outs: list[tuple[str, int, str]] = []
        self.ins: list[tuple[str, int, str]] = []

    def out(self, name: str, count: int, cons: str) -> None:
        self.outs.append((name, count, cons))

    def inp(self, name: str, count: int, cons: str) -> None:
        self.ins.append((name, count, cons))

    def build(self) -> tuple[dict[str, list[str]], str]:
        regs: dict[str, list[str]] = {}
        cons: list[str] = []
        n = 0
        for group, prefix in ((self.outs, "="), (self.ins, "")):
            for name, count, c in group:
                if count % 2:
                    raise ValueError(f"operand group {name}: count {count} is odd (pack=2 needs pairs)")
                regs[name] = [f"${n + i}" for i in range(count)]
                cons += [prefix + c] * count
                n += count
        return regs, ",".join(cons)


def _lane_prologue(rp: int, warp_rows: int = 16) -> str:
    """lane, g, c and the thread's first CTA-relative row r0 = warp_rows * RP * warp + g (warp_rows: 16 for the
    linear's row pairs (rA, rA + 8); 8 for the MoE gate|up, whose row pair is (gate n, up n))."""
    return f"""mov.u32 lane, %laneid;
mov.u32 tid, %tid.x;
shr.u32 warp, tid, 5;
shr.u32 g, lane, 2;
and.b32 c, lane, 3;
mad.lo.u32 r0, warp, {warp_rows * rp}, g;"""


def _token_address(e: int, m: str, rs: str, base: str, esize: int) -> str:
    """The thread's token column t = 2c + e, pr = (t < M), and a64 = base + (t * rs + n) * esize: the address of
    element (t, n) of a row-major output whose row stride is rs elements (n, c: the caller's registers)."""
    return f"""shl.b32 t, c, 1;
add.u32 t, t, {e};
setp.lt.u32 pr, t, {m};
mad.lo.u32 idx, t, {rs}, n;
mul.wide.u32 o64, idx, {esize};
add.s64 a64, {base}, o64;"""


def v4_loads(regs: list[str], addr: str, offsets: list[int]) -> list[str]:
    """One 16-byte load per run of 4 registers: regs[4 i .. 4 i + 3] from [addr + offsets[i]] (read-only, no L1)."""
    return [f"ld.global.nc.L1::no_allocate.v4.b32 {{{', '.join(regs[4 * i:4 * i + 4])}}}, [{addr}+{off}];"
            for i, off in enumerate(offsets)]


def scale_regs(rp: int) -> int:
    """One register of scale bits per row pair (both rows), rounded up to the pack of 2."""
    return rp + (rp % 2)


def tiled_load_asm(rp: int, fmt: int = FMT_NVFP4) -> tuple[str, str]:
    """load_asm for weights in the MMA tile layout (m3serve.quant.tiles), the same registers from the same rows. A
    tile is one row block of 16 rows x one 128-column step, its bytes [h, v, lane, 16 B] (NVFP4: 1 KB, v = 0 only;
    MXFP8: 2 KB, v = the lane's first or second 16 B of its 32) and its scales [lane, h] (NVFP4: 2 B each, 128 B;
    MXFP8: 1 B each, 64 B), so each warp instruction reads 512 contiguous bytes of words (128 / 64 of scales).
    wk / sk: the CTA's first tile of the step; sw / ss: bytes from one row block's tile to the next row block's."""
    o = _Operands()
    o.out("W", word_regs(fmt, rp), "r")
    o.out("S", scale_regs(rp), "r")
    for name, c in (("wk", "l"), ("sk", "l"), ("sw", "r"), ("ss", "r")):
        o.inp(name, 2, c)
    r, cons = o.build()
    wk, sk, sw, ss = (r[n][0] for n in ("wk", "sk", "sw", "ss"))
    W = r["W"]
    per_row = word_regs(fmt, 1) // 2          # registers of one row: 4 (NVFP4) / 8 (MXFP8)
    half = 512 * (per_row // 4)               # bytes of one h half of a tile
    scale_bytes = 2 if fmt == FMT_NVFP4 else 1
    s = ["{", ".reg .b32 lane, tid, warp, rb, cb;", ".reg .b64 wa, sa, o64;"] + ([] if fmt == FMT_NVFP4 else
                                                                               [".reg .b16 hs;"])
    s += [f"""mov.u32 lane, %laneid;
mov.u32 tid, %tid.x;
shr.u32 warp, tid, 5;
mul.lo.u32 rb, warp, {rp};"""]
    for p in range(rp):
        s.append(f"""add.u32 cb, rb, {p};
mul.wide.u32 o64, cb, {sw};
add.s64 wa, {wk}, o64;
shl.b32 cb, lane, 4;
cvt.u64.u32 o64, cb;
add.s64 wa, wa, o64;
add.u32 cb, rb, {p};
mul.wide.u32 o64, cb, {ss};
add.s64 sa, {sk}, o64;
shl.b32 cb, lane, {scale_bytes};
cvt.u64.u32 o64, cb;
add.s64 sa, sa, o64;""")
        s += v4_loads(W[2 * p * per_row:(2 * p + 2) * per_row], "wa",
                      [h * half + 512 * v for h in range(2) for v in range(per_row // 4)])
        if fmt == FMT_NVFP4:  # rows rA, rB: two E4M3 pairs, one word
            s.append(f"ld.global.nc.L1::no_allocate.b32 {r['S'][p]}, [sa];")
        else:                 # rows rA, rB: one E8M0 each, as load_asm's hA | hB << 8
            s.append(f"ld.global.nc.L1::no_allocate.u16 hs, [sa];\ncvt.u32.u16 {r['S'][p]}, hs;")
    if scale_regs(rp) > rp:
        s.append(f"mov.b32 {r['S'][rp]}, 0;")
    s.append("}")
    return "\n".join(s), cons


def _half_tile_address(dst: str, tile0: str, block_bytes: str, half_bytes: int, lane_bytes: int) -> str:
    """dst = tile0 + rb * block_bytes + h * half_bytes + lane * lane_bytes: this lane's part of half h of row block
    rb's tile (registers rb, h, lane set; cb, o64 scratch)."""
    return f"""mul.wide.u32 o64, rb, {block_bytes};
add.s64 {dst}, {tile0}, o64;
shl.b32 cb, h, {half_bytes.bit_length() - 1};
mad.lo.u32 cb, lane, {lane_bytes}, cb;
cvt.u64.u32 o64, cb;
add.s64 {dst}, {dst}, o64;"""


def tiled_gate_up_load_asm(rp: int) -> tuple[str, str]:
    """load_asm(FMT_NVFP4, rp, gate_up=True) for weights in the MMA tile layout: the same registers from the same
    rows, so compute_asm and swiglu_store_asm serve both layouts unchanged. Row pair p's gate row
    n = 8q + g (q = RP * warp + p) is half h = q & 1 of row block q >> 1, so a warp's gate words are 512 contiguous
    bytes of one tile; the up row n + I is in the tile `ub` bytes (`usb` scale bytes) further, at the same place,
    which is why its scales take a u16 load of their own where tiled_load_asm reads a row pair's in one b32.
    wk / sk: the CTA's first tile of the step (the CTA's first column is a multiple of 16); sw / ss: bytes
    from one row block's tile to the next row block's."""
    o = _Operands()
    o.out("W", word_regs(FMT_NVFP4, rp), "r")
    o.out("S", scale_regs(rp), "r")
    for name, c in (("wk", "l"), ("sk", "l"), ("sw", "r"), ("ss", "r"), ("ub", "l"), ("usb", "l")):
        o.inp(name, 2, c)
    r, cons = o.build()
    wk, sk, sw, ss, ub, usb = (r[n][0] for n in ("wk", "sk", "sw", "ss", "ub", "usb"))
    W = r["W"]
    s = ["{", ".reg .b32 lane, tid, warp, q, rb, h, cb;", ".reg .b64 wa, sa, wb, sb, o64;", ".reg .b16 hA, hB;",
         """mov.u32 lane, %laneid;
mov.u32 tid, %tid.x;
shr.u32 warp, tid, 5;"""]
    for p in range(rp):
        # tile_nvfp4's orders: words [h, lane, 16 B], scales [g, c, h, 2 B] (lane = 4g + c)
        s.append(f"""mad.lo.u32 q, warp, {rp}, {p};
shr.u32 rb, q, 1;
and.b32 h, q, 1;
{_half_tile_address("wa", wk, sw, 512, 16)}
{_half_tile_address("sa", sk, ss, 2, 4)}
add.s64 wb, wa, {ub};
add.s64 sb, sa, {usb};
ld.global.nc.L1::no_allocate.v4.b32 {{{', '.join(W[8 * p:8 * p + 4])}}}, [wa+0];
ld.global.nc.L1::no_allocate.u16 hA, [sa];
ld.global.nc.L1::no_allocate.v4.b32 {{{', '.join(W[8 * p + 4:8 * p + 8])}}}, [wb+0];
ld.global.nc.L1::no_allocate.u16 hB, [sb];
mov.b32 {r['S'][p]}, {{hA, hB}};""")
    if scale_regs(rp) > rp:
        s.append(f"mov.b32 {r['S'][rp]}, 0;")
    s.append("}")
    return "\n".join(s), cons


def load_asm(fmt: int, rp: int, gate_up: bool = False) -> tuple[str, str]:
    """One step's weight words and this lane's scale bits straight into registers (ld.global, no shared
    memory); the kernel keeps STAGES - 1 steps of them in flight.

    gate_up (NVFP4, the MoE's gate|up projection): row pair p of a thread is (gate row n, up row n) with
    n = 8 * (RP * warp + p) + g, the up row `ub` bytes (`usb` scale bytes) after the gate row, so that one
    MMA's D holds gate and up of the same activation column (the SwiGLU epilogue needs both in one lane)."""
    if gate_up and fmt != FMT_NVFP4:
        raise ValueError(f"load_asm: the gate|up row pairing serves NVFP4 only, found format {fmt}")
    o = _Operands()
    nw, ns = word_regs(fmt, rp), scale_regs(rp)
    o.out("W", nw, "r")
    o.out("S", ns, "r")
    ins = [("wk", "l"), ("sk", "l"), ("sw", "r"), ("ss", "r")] + ([("ub", "l"), ("usb", "l")] if gate_up else [])
    for name, c in ins:
        o.inp(name, 2, c)
    r, cons = o.build()
    wk, sk, sw, ss = (r[n][0] for n in ("wk", "sk", "sw", "ss"))
    row_bytes = 16 if fmt == FMT_NVFP4 else 32  # one lane's share of a row per step
    s = ["{", ".reg .b32 lane, tid, warp, g, c, r0, t, cb;", f".reg .b64 wa, sa, o64, w8, s8{', wb, sb' if gate_up else ''};",
         ".reg .b16 hA, hB;", _lane_prologue(rp, 8 if gate_up else 16)]
    # weights: wk + r0 * sw + row_bytes * c, w8 = 8 rows; scales: sk + r0 * ss + the lane's byte (NVFP4 groups
    # 2c, 2c+1 at 2c; MXFP8 group c at c), s8 = 8 rows
    s.append(f"""mul.wide.u32 o64, r0, {sw};
add.s64 wa, {wk}, o64;
mul.lo.u32 cb, c, {row_bytes};
cvt.u64.u32 o64, cb;
add.s64 wa, wa, o64;
mul.wide.u32 w8, {sw}, 8;
mul.wide.u32 o64, r0, {ss};
add.s64 sa, {sk}, o64;
{"shl.b32 cb, c, 1;" if fmt == FMT_NVFP4 else "mov.b32 cb, c;"}
cvt.u64.u32 o64, cb;
add.s64 sa, sa, o64;
mul.wide.u32 s8, {ss}, 8;""")
    W = r["W"]
    per_row = row_bytes // 4
    width = "u16" if fmt == FMT_NVFP4 else "u8"
    for p in range(rp):
        if gate_up:
            s.append(f"add.s64 wb, wa, {r['ub'][0]};\nadd.s64 sb, sa, {r['usb'][0]};")
        for h in range(2):
            regs = W[(2 * p + h) * per_row:(2 * p + h + 1) * per_row]
            wsrc, ssrc = ("wb", "sb") if gate_up and h == 1 else ("wa", "sa")
            for v in range(per_row // 4):
                s.append(f"ld.global.nc.L1::no_allocate.v4.b32 {{{', '.join(regs[4 * v:4 * v + 4])}}}, [{wsrc}+{16 * v}];")
            s.append(f"ld.global.nc.L1::no_allocate.{width} {'hA' if h == 0 else 'hB'}, [{ssrc}];")
            if not gate_up:
                s.append("add.s64 wa, wa, w8;\nadd.s64 sa, sa, s8;")
        if gate_up:
            s.append("add.s64 wa, wa, w8;\nadd.s64 sa, sa, s8;")
        S = r["S"][p]
        if fmt == FMT_NVFP4:
            s.append(f"mov.b32 {S}, {{hA, hB}};")
        else:
            s.append(f"cvt.u32.u16 t, hA;\ncvt.u32.u16 cb, hB;\nshl.b32 cb, cb, 8;\nor.b32 {S}, t, cb;")
    if ns > rp:
        s.append(f"mov.b32 {r['S'][rp]}, 0;")
    s.append("}")
    return "\n".join(s), cons


def xload_asm() -> tuple[str, str]:
    """x of this thread for one step: token min(g, M - 1), columns 32c .. 32c + 31 (xk = x + k0 columns)."""
    o = _Operands()
    o.out("X", X_REGS, "r")
    for name, c in (("xk", "l"), ("sx", "r"), ("mm", "r")):
        o.inp(name, 2, c)
    r, cons = o.build()
    xk, sx, mm = (r[n][0] for n in ("xk", "sx", "mm"))
    X = r["X"]
    s = ["{", ".reg .b32 lane, g, c, t, cb;", ".reg .b64 xa, o64;", ".reg .pred px;",
         f"""mov.u32 lane, %laneid;
shr.u32 g, lane, 2;
and.b32 c, lane, 3;
setp.le.u32 px, g, {mm};
min.u32 t, g, {mm};
mul.wide.u32 o64, t, {sx};
add.s64 xa, {xk}, o64;
shl.b32 cb, c, 6;
cvt.u64.u32 o64, cb;
add.s64 xa, xa, o64;"""]
    # lanes of tokens >= M load nothing: their B columns only feed D columns that are never stored, so the
    # registers may hold anything (MMA columns are independent); only the M token rows are read
    for v in range(4):
        s.append(f"@px ld.global.nc.v4.b32 {{{', '.join(X[4 * v:4 * v + 4])}}}, [xa+{16 * v}];")
    s.append("}")
    return "\n".join(s), cons


def _nvfp4_scales(src: str, half: int, out0: str, out1: str) -> str:
    """16 bits of two E4M3 group scales (groups 2c, 2c+1) -> bf16x2 registers (s, s) of each, times 2**118
    (exact: see _e2m1_ptx)."""
    return f"""mov.b32 {{sl, sh}}, {src};
cvt.rn.f16x2.e4m3x2 sf, {'sl' if half == 0 else 'sh'};
mov.b32 {{fl, fh}}, sf;
cvt.f32.f16 g0, fl;
cvt.f32.f16 g1, fh;
mul.f32 g0, g0, {_TWO_118};
mul.f32 g1, g1, {_TWO_118};
cvt.rn.bf16x2.f32 tb, g1, g0;
prmt.b32 {out0}, tb, tb, 0x1010;
prmt.b32 {out1}, tb, tb, 0x3232;"""


def _nvfp4_word(src: str, dst: list[str], sc: str) -> str:
    """One word of 8 nibbles -> 4 bf16x2 registers, register j = columns (j, j + 4), times the scale: the
    decode of _e2m1_ptx (the same text generator), with dst as its own temporaries."""
    ints, muls = e2m1_word_ptx(src, dst, sc, shifted="tq")
    return "\n".join(ints + muls)


def _mxfp8_word(src: str, dst: list[str], sc: str) -> str:
    """One word of 4 E4M3 bytes -> 2 bf16x2 registers (columns (0, 1) and (2, 3)) times 2**(s - 127): the
    hardware E4M3 -> f16 conversion is exact, f16 -> f32 -> bf16 too (E4M3 has 4 significant bits), and
    the bf16 product has at most 4 significant bits (exact unless it leaves bf16's range, see _mma_gemv)."""
    d0, d1 = dst
    return f"""mov.b32 {{sl, sh}}, {src};
cvt.rn.f16x2.e4m3x2 sf, sl;
mov.b32 {{fl, fh}}, sf;
cvt.f32.f16 g0, fl;
cvt.f32.f16 g1, fh;
cvt.rn.bf16x2.f32 {d0}, g1, g0;
cvt.rn.f16x2.e4m3x2 sf, sh;
mov.b32 {{fl, fh}}, sf;
cvt.f32.f16 g0, fl;
cvt.f32.f16 g1, fh;
cvt.rn.bf16x2.f32 {d1}, g1, g0;
mul.rn.bf16x2 {d0}, {d0}, {sc};
mul.rn.bf16x2 {d1}, {d1}, {sc};"""


def _e8m0_bf16x2(src: str, shift: int, out: str) -> str:
    """The E8M0 byte at bit `shift` of src -> (s, s) as bf16x2: 2**(s - 127) = bits s << 7, with 0 -> the
    subnormal 2**-127 and 255 -> NaN (as _decode.e8m0_to_bf16)."""
    return f"""shr.u32 t0, {src}, {shift};
and.b32 t0, t0, 0xFF;
setp.eq.u32 pz, t0, 0;
setp.eq.u32 pn, t0, 255;
shl.b32 t0, t0, 7;
selp.b32 t0, 0x40, t0, pz;
selp.b32 t0, 0x7FC0, t0, pn;
prmt.b32 {out}, t0, t0, 0x1010;"""


def _mma(acc: list[str], a: list[str], b: list[str]) -> str:
    return (f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{', '.join(acc)}}}, {{{', '.join(a)}}}, "
            f"{{{', '.join(b)}}}, {{{', '.join(acc)}}};")


def compute_asm(fmt: int, rp: int) -> tuple[str, str]:
    """acc += this thread's share of one step: decode the words and scale bits load_asm returned, build
    the B fragments from x, 8 MMAs per row pair (per 16 NVFP4 / MXFP8 columns of the lane: 4 x 2 or 8)."""
    o = _Operands()
    na = acc_regs(rp)
    o.out("A", na, "f")
    o.inp("Ai", na, "f")
    o.inp("W", word_regs(fmt, rp), "r")
    o.inp("S", scale_regs(rp), "r")
    o.inp("X", X_REGS, "r")
    r, cons = o.build()
    A, Ai, W, S, X = r["A"], r["Ai"], r["W"], r["S"], r["X"]
    s = ["{", ".reg .b32 tq, sf, tb, sA0, sA1, sB0, sB1, t0;", ".reg .b16 sl, sh, fl, fh;", ".reg .f32 g0, g1;",
         ".reg .pred pz, pn;", ".reg .b32 DA<16>, DB<16>, P<16>;"]
    s += [f"mov.f32 {A[i]}, {Ai[i]};" for i in range(na)]
    if fmt == FMT_NVFP4:
        # B fragments: P[4q + 2h + e], e = 0: (x[8q+2h], x[8q+2h+4]) low halves, e = 1: the high halves
        for q in range(4):
            for h in range(2):
                lo, hi = X[4 * q + h], X[4 * q + h + 2]
                s.append(f"prmt.b32 P{4 * q + 2 * h}, {lo}, {hi}, 0x5410;\nprmt.b32 P{4 * q + 2 * h + 1}, {lo}, {hi}, 0x7632;")
        # word by word: decode rA's and rB's word q, then its 2 MMAs, so 8 decoded registers are live, not 32
        for p in range(rp):
            # S[p]: this lane's 16 scale bits of rA (low half) and rB (high half)
            s.append(_nvfp4_scales(S[p], 0, "sA0", "sA1"))
            s.append(_nvfp4_scales(S[p], 1, "sB0", "sB1"))
            acc = A[4 * p:4 * p + 4]
            for q in range(4):
                s.append(_nvfp4_word(W[8 * p + q], [f"DA{4 * q + j}" for j in range(4)], "sA0" if q < 2 else "sA1"))
                s.append(_nvfp4_word(W[8 * p + 4 + q], [f"DB{4 * q + j}" for j in range(4)], "sB0" if q < 2 else "sB1"))
                for h in range(2):
                    a = [f"DA{4 * q + 2 * h}", f"DB{4 * q + 2 * h}", f"DA{4 * q + 2 * h + 1}", f"DB{4 * q + 2 * h + 1}"]
                    s.append(_mma(acc, a, [f"P{4 * q + 2 * h}", f"P{4 * q + 2 * h + 1}"]))
    else:
        for p in range(rp):
            # S[p]: the E8M0 bytes of rA (bits 0..7) and rB (bits 8..15)
            for src_shift, out in ((0, "sA0"), (8, "sB0")):
                s.append(_e8m0_bf16x2(S[p], src_shift, out))
            acc = A[4 * p:4 * p + 4]
            for i in range(8):
                s.append(_mxfp8_word(W[16 * p + i], [f"DA{2 * i}", f"DA{2 * i + 1}"], "sA0"))
                s.append(_mxfp8_word(W[16 * p + 8 + i], [f"DB{2 * i}", f"DB{2 * i + 1}"], "sB0"))
                s.append(_mma(acc, [f"DA{2 * i}", f"DB{2 * i}", f"DA{2 * i + 1}", f"DB{2 * i + 1}"],
                              [X[2 * i], X[2 * i + 1]]))
    s.append("}")
    return "\n".join(s), cons


MODE_FINAL = 0  # bf16 y with the row epilogue (SPLIT == 1)
MODE_PARTIAL = 1  # fp32 split-K partials, summed by the last arrival in Triton


def store_asm(rp: int, mode: int, alpha: int) -> tuple[str, str]:
    """Write this thread's accumulators: y[t, n] = bf16(epilogue(acc)) (MODE_FINAL) or part[t, n] = acc
    (MODE_PARTIAL), for tokens t < M. alpha: 0 none, 1 multiply by alpha[n], 2 acc * 2**8 / alpha[n] (the
    NVFP4 ENCODE global scale; division correctly rounded)."""
    o = _Operands()
    o.out("dummy", 2, "r")
    o.inp("A", acc_regs(rp), "f")
    for name, c in (("ya", "l"), ("n0", "r"), ("m", "r"), ("rs", "r"), ("aa", "l"), ("ast", "r")):
        o.inp(name, 2, c)
    r, cons = o.build()
    A = r["A"]
    ya, n0, m, rs, aa, ast = (r[n][0] for n in ("ya", "n0", "m", "rs", "aa", "ast"))
    esize = 2 if mode == MODE_FINAL else 4
    s = ["{", ".reg .b32 lane, tid, warp, g, c, r0, n, t, idx;", ".reg .b64 a64, o64;", ".reg .f32 al, v;",
         ".reg .b16 hv;", ".reg .pred pr;", _lane_prologue(rp)]
    for p in range(rp):
        for h in range(2):
            s.append(f"add.u32 n, {n0}, r0;\nadd.u32 n, n, {16 * p + 8 * h};")
            if mode == MODE_FINAL and alpha:
                s.append(f"mul.wide.u32 o64, n, {ast};\nshl.b64 o64, o64, 2;\nadd.s64 a64, {aa}, o64;\n"
                         "ld.global.nc.f32 al, [a64];")
            for e in range(2):
                s.append(_token_address(e, m, rs, ya, esize))
                val = A[4 * p + 2 * h + e]
                if mode == MODE_FINAL:
                    if alpha == 2:
                        s.append(f"mul.f32 v, {val}, {_TWO_8};\ndiv.rn.f32 v, v, al;")
                    elif alpha == 1:
                        s.append(f"mul.f32 v, {val}, al;")
                    else:
                        s.append(f"mov.f32 v, {val};")
                    s.append("cvt.rn.bf16.f32 hv, v;\n@pr st.global.b16 [a64], hv;")
                else:
                    s.append(f"@pr st.global.cg.f32 [a64], {val};")
    s.append(f"mov.b32 {r['dummy'][0]}, 0;\nmov.b32 {r['dummy'][1]}, 0;")
    s.append("}")
    return "\n".join(s), cons


# --- MoE blocks (moe/_mma.py) --------------------------------------------------------------------------------

_ONE = "0f3F800000"
_NEG_LOG2E = "0fBFB8AA3B"  # -log2(e): exp(-z) = 2**(-z log2 e)


def swiglu_store_asm(rp: int) -> tuple[str, str]:
    """The MoE gate|up epilogue: this thread's accumulators hold gate (D rows g) and up (rows g + 8) of
    activation column n = n0 + 8 * (RP * warp + p) + g for tokens 2c, 2c + 1 (load_asm's gate_up pairing);
    act[t, n] = bf16(swiglu_oai(gate * 2**8 / gg, up * 2**8 / gu)) for tokens t < M, with moe/_nvfp4.py's swiglu_oai's
    operations in its order: g = min(g, limit), u = clamp(u, -limit, limit), g * sigmoid(alpha * g) * (u + 1),
    sigmoid(z) = 1 / (1 + 2**(-z log2 e)) (ex2.approx, as Triton's exp)."""
    o = _Operands()
    o.out("dummy", 2, "r")
    o.inp("A", acc_regs(rp), "f")
    for name, c in (("ya", "l"), ("n0", "r"), ("m", "r"), ("rs", "r"), ("gg", "f"), ("gu", "f"), ("al", "f"),
                    ("lim", "f")):
        o.inp(name, 2, c)
    r, cons = o.build()
    A = r["A"]
    ya, n0, m, rs, gg, gu, al, lim = (r[n][0] for n in ("ya", "n0", "m", "rs", "gg", "gu", "al", "lim"))
    s = ["{", ".reg .b32 lane, tid, warp, g, c, r0, n, t, idx;", ".reg .b64 a64, o64;",
         ".reg .f32 gv, uv, nl, z, sg, one;", ".reg .b16 hv;", ".reg .pred pr;", _lane_prologue(rp, 8),
         f"neg.f32 nl, {lim};\nmov.f32 one, {_ONE};"]
    for p in range(rp):
        s.append(f"add.u32 n, {n0}, r0;\nadd.u32 n, n, {8 * p};")
        for e in range(2):
            s.append(_token_address(e, m, rs, ya, 2))
            s.append(f"""mul.f32 gv, {A[4 * p + e]}, {_TWO_8};
div.rn.f32 gv, gv, {gg};
mul.f32 uv, {A[4 * p + 2 + e]}, {_TWO_8};
div.rn.f32 uv, uv, {gu};
min.f32 gv, gv, {lim};
max.f32 uv, uv, nl;
min.f32 uv, uv, {lim};
mul.f32 z, {al}, gv;
mul.f32 z, z, {_NEG_LOG2E};
ex2.approx.ftz.f32 z, z;
add.f32 z, z, one;
div.rn.f32 sg, one, z;
mul.f32 gv, gv, sg;
add.f32 uv, uv, one;
mul.f32 gv, gv, uv;
cvt.rn.bf16.f32 hv, gv;
@pr st.global.b16 [a64], hv;""")
    s.append(f"mov.b32 {r['dummy'][0]}, 0;\nmov.b32 {r['dummy'][1]}, 0;")
    s.append("}")
    return "\n".join(s), cons


def gate_up_partial_asm(rp: int) -> tuple[str, str]:
    """The MoE gate|up epilogue of one K split (moe/_mma.py's GSPLIT): this thread's raw fp32 sums, gate of activation
    column n (load_asm's gate_up pairing, as swiglu_store_asm) to part[t, n] and up to part[t, I + n], tokens
    t = 2c, 2c + 1 < M; the last arrival sums the splits in order and applies SwiGLU-OAI in Triton."""
    o = _Operands()
    o.out("dummy", 2, "r")
    o.inp("A", acc_regs(rp), "f")
    for name, c in (("pa", "l"), ("n0", "r"), ("m", "r"), ("rs", "r"), ("ui", "r")):
        o.inp(name, 2, c)
    r, cons = o.build()
    A = r["A"]
    pa, n0, m, rs, ui = (r[n][0] for n in ("pa", "n0", "m", "rs", "ui"))
    s = ["{", ".reg .b32 lane, tid, warp, g, c, r0, n, t, idx;", ".reg .b64 a64, o64;", ".reg .pred pr;",
         _lane_prologue(rp, 8)]
    for p in range(rp):
        s.append(f"add.u32 n, {n0}, r0;\nadd.u32 n, n, {8 * p};")
        for e in range(2):
            s.append(_token_address(e, m, rs, pa, 4))
            s.append(f"""@pr st.global.cg.f32 [a64], {A[4 * p + e]};
add.u32 idx, idx, {ui};
mul.wide.u32 o64, idx, 4;
add.s64 a64, {pa}, o64;
@pr st.global.cg.f32 [a64], {A[4 * p + 2 + e]};""")
    s.append(f"mov.b32 {r['dummy'][0]}, 0;\nmov.b32 {r['dummy'][1]}, 0;")
    s.append("}")
    return "\n".join(s), cons


def fold_asm(rp: int) -> tuple[str, str]:
    """The MoE down projection at the end of one expert's K range: out += acc * (cs * w[t]) per token column
    t = 2c + e < M, w[t] the slot's routing weight (fp32 at wr + 4t; wr = 0: the shared expert, weight 1),
    cs = 2**8 / the expert's global scale; tokens >= M get weight 0."""
    o = _Operands()
    na = acc_regs(rp)
    o.out("O", na, "f")
    o.inp("Oi", na, "f")
    o.inp("A", na, "f")
    for name, c in (("wr", "l"), ("cs", "f"), ("m", "r")):
        o.inp(name, 2, c)
    r, cons = o.build()
    O, Oi, A = r["O"], r["Oi"], r["A"]
    wr, cs, m = (r[n][0] for n in ("wr", "cs", "m"))
    s = ["{", ".reg .b32 lane, c, t;", ".reg .b64 a64, o64;", ".reg .f32 w0, w1;", ".reg .pred pw, pt, pl;",
         f"""mov.u32 lane, %laneid;
and.b32 c, lane, 3;
setp.ne.u64 pw, {wr}, 0;"""]
    for e in range(2):
        s.append(f"""shl.b32 t, c, 1;
add.u32 t, t, {e};
setp.lt.u32 pt, t, {m};
and.pred pl, pw, pt;
mul.wide.u32 o64, t, 4;
add.s64 a64, {wr}, o64;
mov.f32 w{e}, 0f00000000;
@pl ld.global.nc.f32 w{e}, [a64];
selp.f32 w{e}, w{e}, {_ONE}, pw;
mul.f32 w{e}, w{e}, {cs};""")
    for i in range(na):
        s.append(f"fma.rn.f32 {O[i]}, {A[i]}, w{i % 2}, {Oi[i]};")
    s.append("}")
    return "\n".join(s), cons


# --- hoisted gate|up loads (moe/_mma.py, MmaMoEConfig.HOIST) --------------------------------------------------
# The load blocks above derive lane, warp, g, c and the row-block / half-tile offsets from %laneid and %tid every K
# step, although only the step's bases (wk, sk, xk) change from one step to the next. Here a prologue block computes
# a thread's offsets from those bases once, before the K loop, and the loop's blocks only add them: the same
# addresses, so the same registers and the same bits. The offsets are 32-bit (one register each, where a 64-bit one
# would hold two across the whole loop): from its first row a CTA's gate words span fewer than BNA * H / 2 + 1024
# bytes (tiled: the same rows' tiles) and x's tokens 8 row strides, which the launch checks fit.


def _gate_up_pairs(rp: int, tiled: bool) -> int:
    """Row pairs whose offsets the prologue hands over. Tiled, RP = 2's second pair is half 1 of the first pair's
    row block (q = 2 warp + p: rb = warp, h = p), 512 word bytes and 2 scale bytes further: an immediate. Row-major,
    its rows are 8 rows further (8 sw, a runtime stride), so each pair has its own offsets."""
    if rp not in (1, 2):
        raise ValueError(f"hoisted gate|up loads: expected RP 1 or 2, found {rp}")
    return 1 if tiled else rp


def gate_up_lane_offsets_asm(rp: int, tiled: bool) -> tuple[str, str]:
    """The hoisted gate|up loop's prologue, once per thread: its byte offsets from a step's bases. Outputs (u32):
        XO, 0    x: g * sx + 64 c from xk for a token g <= mm (xload_asm's address), else ~0, which stands for
                 xload_asm's px being false (a real offset is even), so the predicate costs no register of its
                 own across the loop; the 0 only pads the pair (pack=2)
        WO, SO   per handed-over row pair p (_gate_up_pairs), its gate row's words from wk and scales from sk:
                 tiled rb * sw + 512 h + 16 lane and rb * ss + 2 h + 4 lane (tiled_gate_up_load_asm's), row-major
                 r * sw + 16 c and r * ss + 2 c with r = 8 (RP warp + p) + g (load_asm(gate_up=True)'s)
    Inputs sw, ss, sx, mm: the load blocks' strides and xload_asm's."""
    pairs = _gate_up_pairs(rp, tiled)
    o = _Operands()
    o.out("X", 2, "r")
    o.out("O", 2 * pairs, "r")
    for name in ("sw", "ss", "sx", "mm"):
        o.inp(name, 2, "r")
    r, cons = o.build()
    sw, ss, sx, mm = (r[n][0] for n in ("sw", "ss", "sx", "mm"))
    xo, pad = r["X"]
    O = r["O"]
    s = ["{", ".reg .b32 lane, tid, warp, g, c, r0, q, rb, h, t, cb;", ".reg .pred px;", _lane_prologue(rp, 8),
         f"""setp.le.u32 px, g, {mm};
shl.b32 cb, c, 6;
mad.lo.u32 t, g, {sx}, cb;
selp.b32 {xo}, t, -1, px;
mov.b32 {pad}, 0;"""]
    if tiled:
        s.append(f"""mul.lo.u32 q, warp, {rp};
shr.u32 rb, q, 1;
and.b32 h, q, 1;
shl.b32 cb, h, 9;
mad.lo.u32 cb, lane, 16, cb;
mad.lo.u32 {O[0]}, rb, {sw}, cb;
shl.b32 cb, h, 1;
mad.lo.u32 cb, lane, 4, cb;
mad.lo.u32 {O[1]}, rb, {ss}, cb;""")
    else:
        for p in range(pairs):
            s.append(f"""add.u32 q, r0, {8 * p};
shl.b32 cb, c, 4;
mad.lo.u32 {O[2 * p]}, q, {sw}, cb;
shl.b32 cb, c, 1;
mad.lo.u32 {O[2 * p + 1]}, q, {ss}, cb;""")
    s.append("}")
    return "\n".join(s), cons


def _base_plus(dst: str, base: str, off: str) -> str:
    """dst = base (64-bit) + off (u32)."""
    return f"cvt.u64.u32 o64, {off};\nadd.s64 {dst}, {base}, o64;"


def gate_up_load_hoisted_asm(rp: int, tiled: bool) -> tuple[str, str]:
    """tiled_gate_up_load_asm (tiled) / load_asm(FMT_NVFP4, rp, gate_up=True) with the thread's offsets from
    gate_up_lane_offsets_asm: the same loads from the same addresses into the same registers. Operands: W, S as
    theirs; inputs wk, sk, the O offsets, ub, usb."""
    pairs = _gate_up_pairs(rp, tiled)
    o = _Operands()
    o.out("W", word_regs(FMT_NVFP4, rp), "r")
    o.out("S", scale_regs(rp), "r")
    o.inp("wk", 2, "l")
    o.inp("sk", 2, "l")
    o.inp("O", 2 * pairs, "r")
    o.inp("ub", 2, "l")
    o.inp("usb", 2, "l")
    r, cons = o.build()
    wk, sk, ub, usb = (r[n][0] for n in ("wk", "sk", "ub", "usb"))
    W, O = r["W"], r["O"]
    s = ["{", ".reg .b64 wa, sa, wb, sb, o64;", ".reg .b16 hA, hB;"]
    for p in range(rp):
        # tiled: one base for both pairs, pair p at half p of the row block (_gate_up_pairs)
        q, wo, so = (0, 512 * p, 2 * p) if tiled else (p, 0, 0)
        if p == 0 or not tiled:
            s.append(f"""{_base_plus("wa", wk, O[2 * q])}
{_base_plus("sa", sk, O[2 * q + 1])}
add.s64 wb, wa, {ub};
add.s64 sb, sa, {usb};""")
        s.append(f"""ld.global.nc.L1::no_allocate.v4.b32 {{{', '.join(W[8 * p:8 * p + 4])}}}, [wa+{wo}];
ld.global.nc.L1::no_allocate.u16 hA, [sa+{so}];
ld.global.nc.L1::no_allocate.v4.b32 {{{', '.join(W[8 * p + 4:8 * p + 8])}}}, [wb+{wo}];
ld.global.nc.L1::no_allocate.u16 hB, [sb+{so}];
mov.b32 {r['S'][p]}, {{hA, hB}};""")
    if scale_regs(rp) > rp:
        s.append(f"mov.b32 {r['S'][rp]}, 0;")
    s.append("}")
    return "\n".join(s), cons


def xload_hoisted_asm() -> tuple[str, str]:
    """xload_asm with the thread's x offset from gate_up_lane_offsets_asm (inputs xk, then its XO pair): ~0 for a
    lane of no token, which loads nothing (xload_asm's px)."""
    o = _Operands()
    o.out("X", X_REGS, "r")
    o.inp("xk", 2, "l")
    o.inp("XO", 2, "r")
    r, cons = o.build()
    xk = r["xk"][0]
    xo = r["XO"][0]
    X = r["X"]
    s = ["{", ".reg .b64 xa, o64;", ".reg .pred px;", f"setp.ne.u32 px, {xo}, -1;", _base_plus("xa", xk, xo)]
    for v in range(4):
        s.append(f"@px ld.global.nc.v4.b32 {{{', '.join(X[4 * v:4 * v + 4])}}}, [xa+{16 * v}];")
    s.append("}")
    return "\n".join(s), cons
