"""PTX text of the register-operand MMA head over the 12-bit coded LM head (kernels/head/_head12_mma.py), in the
frame of gemm/_mma_ptx.py: each block is one thread's whole share of one step of 128 columns, its lanes and rows
fixed by %laneid and %tid.

Shape legend (one CTA, one step; the weights in quant.head12_tiles' layout):
    warp w, lane L = 4 g + c; row pair p = 0..RP-1: rows rA = 16 * (RP * w + p) + g, rB = rA + 8, one tile (16 rows)
    lane c holds columns 32 c .. 32 c + 31 of rA and rB, and the same 32 columns of x (token g)
    sm word i (i = 0..7) of a row = columns 4 i .. 4 i + 3, one byte each (the MXFP8 register order)
    code word q (q = 0..3) of a row = columns 8 q .. 8 q + 7, column 8 q + 2 j + e at nibble j + 4 e
    MMA i: a0 / a1 = columns (4 i, 4 i + 1) of rA / rB, a2 / a3 = (4 i + 2, 4 i + 3); b0 = x pair 2 i, b1 = 2 i + 1

Decode of one bf16 pair (4 integer operations, no test): the byte permute puts each sign/mantissa byte in its low
byte and its sign, replicated, in the high byte; masked with 0x807F, sign and mantissa are in place. The two
codes, shifted into bits 7..10 of each half and masked, are the exponent field: code c gives the weight times
2**-base (c = 0 gives +-0; quant.head12_tiles moved every other weight to the escape list). Each step's 8 MMAs
sum into fresh registers that one FMA per accumulator then adds times 2**(base - 64): exact, since x enters the
MMAs times 2**64 (so a product of a code-1 weight and any x from 2**-62 up stays a normal fp32) and a power of two
only moves the exponent.
"""

from __future__ import annotations

from m3serve.kernels.gemm._mma_ptx import X_REGS, _mma, _Operands, v4_loads

SM_REGS = 16  # a row pair's sign/mantissa words a step (2 rows x 32 bytes)
CODE_REGS = 8  # a row pair's code words a step (2 rows x 16 bytes)
X_SCALE_BF16X2 = "0x5F805F80"  # (2**64, 2**64) as bf16x2
_PERMUTE = (0x9180, 0xB3A2)  # bytes (0, sign of 0, 1, sign of 1) and (2, sign of 2, 3, sign of 3)


def base_regs(rp: int) -> int:
    return rp + (rp % 2)


def load_asm(rp: int) -> tuple[str, str]:
    """One step's words into registers: SM (16 a row pair), CD (8 a row pair) and the tile base byte B of each row
    pair. sk / ck / bk: the CTA's first tile of the step in the sm, codes and tile_base planes; ssw / csw / bsw:
    bytes from one row block's tile to the next row block's in each."""
    o = _Operands()
    o.out("SM", SM_REGS * rp, "r")
    o.out("CD", CODE_REGS * rp, "r")
    o.out("B", base_regs(rp), "r")
    for name, c in (("sk", "l"), ("ck", "l"), ("bk", "l"), ("ssw", "r"), ("csw", "r"), ("bsw", "r")):
        o.inp(name, 2, c)
    r, cons = o.build()
    sk, ck, bk, ssw, csw, bsw = (r[n][0] for n in ("sk", "ck", "bk", "ssw", "csw", "bsw"))
    SM, CD, B = r["SM"], r["CD"], r["B"]
    s = ["{", ".reg .b32 lane, tid, warp, rb, cb;", ".reg .b64 sa, ca, ba, o64;", ".reg .b16 hb;",
         f"""mov.u32 lane, %laneid;
mov.u32 tid, %tid.x;
shr.u32 warp, tid, 5;
mul.lo.u32 rb, warp, {rp};"""]
    for p in range(rp):
        s.append(f"""add.u32 cb, rb, {p};
mul.wide.u32 o64, cb, {ssw};
add.s64 sa, {sk}, o64;
mul.wide.u32 o64, cb, {csw};
add.s64 ca, {ck}, o64;
mul.wide.u32 o64, cb, {bsw};
add.s64 ba, {bk}, o64;
shl.b32 cb, lane, 4;
cvt.u64.u32 o64, cb;
add.s64 sa, sa, o64;
add.s64 ca, ca, o64;""")
        # sm tile [h, v, lane, 16 B], code tile [h, lane, 16 B]
        s += v4_loads(SM[SM_REGS * p:SM_REGS * (p + 1)], "sa", [1024 * h + 512 * v for h in range(2) for v in range(2)])
        s += v4_loads(CD[CODE_REGS * p:CODE_REGS * (p + 1)], "ca", [0, 512])
        s.append(f"ld.global.nc.L1::no_allocate.u8 hb, [ba];\ncvt.u32.u16 {B[p]}, hb;")
    if base_regs(rp) > rp:
        s.append(f"mov.b32 {B[rp]}, 0;")
    s.append("}")
    return "\n".join(s), cons


def _pair(dst: str, sm_word: str, code_word: str, half: int, j: int) -> str:
    """bf16x2 of columns (4 i + 2 half, + 1) from its sm word and code pair j of its code word."""
    shift = 7 - 4 * j
    move = f"shl.b32 v0, {code_word}, {shift};" if shift > 0 else f"shr.u32 v0, {code_word}, {-shift};"
    return f"""prmt.b32 t0, {sm_word}, {sm_word}, {_PERMUTE[half]:#x};
and.b32 t0, t0, 0x807F807F;
{move}
and.b32 v0, v0, 0x07800780;
or.b32 {dst}, t0, v0;"""


def compute_asm(rp: int) -> tuple[str, str]:
    """acc += 2**(base - 64) * (the step's decoded weights @ x * 2**64), per row pair."""
    o = _Operands()
    na = 4 * rp
    o.out("A", na, "f")
    o.inp("Ai", na, "f")
    o.inp("SM", SM_REGS * rp, "r")
    o.inp("CD", CODE_REGS * rp, "r")
    o.inp("B", base_regs(rp), "r")
    o.inp("X", X_REGS, "r")
    r, cons = o.build()
    A, Ai, SM, CD, B, X = r["A"], r["Ai"], r["SM"], r["CD"], r["B"], r["X"]
    s = ["{", ".reg .b32 t0, v0, xs, DA<2>, DB<2>, XS<16>;", ".reg .f32 T<4>, scf;"]
    s += [f"mov.f32 {A[i]}, {Ai[i]};" for i in range(na)]
    s.append(f"mov.b32 xs, {X_SCALE_BF16X2};")
    s += [f"mul.rn.bf16x2 XS{j}, {X[j]}, xs;" for j in range(X_REGS)]
    for p in range(rp):
        # 2**(base - 64) as fp32 bits: exponent field base + 63 (base <= 191: quant.head12_tiles)
        s.append(f"and.b32 t0, {B[p]}, 255;\nadd.u32 t0, t0, 63;\nshl.b32 t0, t0, 23;\nmov.b32 scf, t0;")
        s += [f"mov.f32 T{i}, 0f00000000;" for i in range(4)]
        for i in range(8):
            q, j0 = i // 2, 2 * (i % 2)
            for h, d in ((0, "DA"), (1, "DB")):
                sm_word, code_word = SM[SM_REGS * p + 8 * h + i], CD[CODE_REGS * p + 4 * h + q]
                for half in range(2):
                    s.append(_pair(f"{d}{half}", sm_word, code_word, half, j0 + half))
            s.append(_mma([f"T{i}" for i in range(4)], ["DA0", "DB0", "DA1", "DB1"], [f"XS{2 * i}", f"XS{2 * i + 1}"]))
        s += [f"fma.rn.f32 {A[4 * p + i]}, T{i}, scf, {A[4 * p + i]};" for i in range(4)]
    s.append("}")
    return "\n".join(s), cons
