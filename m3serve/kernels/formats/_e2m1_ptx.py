"""Inline-PTX NVFP4 decoder: one 32-bit word of 8 E2M1 nibbles + one bf16 group scale -> 8 scaled
bf16 weights in 4 packed bf16x2 registers (compiled path only; the interpreter keeps _decode's
pure-Triton decoders, which give the same values).

Shape legend:
    words  [R, C]      int32, nibble j of a word = column 8c+j (byte i holds columns 2i, 2i+1)
    scale  [R, C]      bf16 group scale * 2**118 of each word (broadcast: 2 words per 16-col group)
    out    8 x [R, C]  bf16, in PAIR ORDER: out[2j] = column j, out[2j+1] = column j+4, i.e.
                       register j of the asm holds (column j, column j+4) as (low, high) half
                       (E2M1_BF16X2_PTX); or the same 8 values as fp32 (E2M1_F32_PTX)

Decode (per output register j = 0..3, 3 integer instructions, no look-up table):
    x_j = src_j & 0x000F000F << 4*(j%2)         nibbles j and j+4 of the word, nothing else
          (src_j = word for j < 2, word >> 8 for j >= 2: one shift shared by j = 2, 3)
    y_j = x_j * (2**6 + 2**12) >> 4*(j%2)        as an integer multiply: two shifted copies of
          (j even: * 0x1040; j odd: * 0x104)     each nibble; the copies' bits never overlap, so
                                                 no carries: bits 6..9 and 12..15 of each half
    r_j = y_j & 0x81C081C0                       keep e e m at bits 8..6 and the sign at bit 15
which is the bf16 bit pattern s<<15 | eem<<6 = e2m1 * 2**-126 (e = 0 lands on the bf16
subnormal m * 2**-127 = 0.5 * m * 2**-126), the same value as _decode.e2m1_words(LOWP=True).
13 integer instructions per 8 weights (4 AND + 4 IMAD + 4 AND + 1 SHR; ptxas emits LOP3/IMAD).

Scale (4 packed multiplies per 8 weights): r_j *= (scale, scale) with mul.rn.bf16x2. The scale
arrives as bf16(e4m3 * 2**118) (exact: E4M3 has 4 significant bits and 2**109 <= |.| < 2**127),
so the product is e2m1 * e4m3 * 2**-8 = the weight in the NVFP4 unit of _decode. It is EXACT
for every finite E4M3 scale, subnormal scales included: the product has at most 2 + 4 = 6
significant bits (bf16 has 8) and |product| >= 0.5 * 2**-9 * 2**-8 = 2**-18 (or exactly 0),
far inside bf16's normal range, so mul.rn never rounds. Its INPUT e2m1 * 2**-126 is a bf16
subnormal when e = 0; PTX has no .ftz for bf16 arithmetic (subnormals are always kept), which
the emulation assumes and the GPU test (test_e2m1_ptx_gpu.py::test_e2m1_ptx_decoder_compiled) checks.
Not exact: E4M3 NaN codes (0x7F / 0xFF) give NaN weights (the torch reference gives NaN too);
quant.check_finite rejects them at load.

The PTX text below is also what `emulate` executes (a tiny interpreter of exactly the opcodes
used here, on numpy arrays), so the CPU exactness test runs the very instructions that are
compiled; see tests/kernels/formats/test_e2m1_ptx.py.
"""

from __future__ import annotations

import re

import numpy as np
import triton.language as tl

from m3serve.kernels.formats._decode import _SCALE_BF16, e4m3_to_f32
from m3serve.kernels._jit import helper, is_compiled

# The one switch: False sends compiled NVFP4 decode back to _decode's pure-Triton bit tricks
# (same values; aot_check --sass-stats --e2m1 triton measures that path).
PTX_E2M1 = True


def use_ptx(t) -> bool:
    """The PTX constexpr of a launch on `t`: inline PTX runs only compiled (never interpreted)."""
    return is_compiled(t) and PTX_E2M1


_MASK = 0x81C081C0  # sign bits 15 / 31, e e m bits 8..6 / 24..22

def e2m1_word_ptx(src: str, out: list[str], scale: str, tmp: list[str] | None = None,
                  shifted: str = "q2") -> tuple[list[str], list[str]]:
    """The decode above as PTX lines, for any register names: word `src` -> out[0..3] (register j = columns
    (j, j + 4)): 13 integer instructions (tmp holds the isolated nibble pairs; default out itself, `shifted`
    the word >> 8), then the 4 packed multiplies by the bf16x2 register `scale`. Returns (integer, multiply)
    lines so a caller may place the scale's own setup between them."""
    x = tmp or out
    ints = []
    for j in range(4):
        if j == 2:
            ints.append(f"shr.u32 {shifted}, {src}, 8;")
        word = src if j < 2 else shifted
        keep, copies = ("0x000F000F", "0x1040") if j % 2 == 0 else ("0x00F000F0", "0x104")
        ints += [f"and.b32 {x[j]}, {word}, {keep};", f"mul.lo.u32 {out[j]}, {x[j]}, {copies};",
                 f"and.b32 {out[j]}, {out[j]}, {_MASK:#010x};"]
    return ints, [f"mul.rn.bf16x2 {r}, {r}, {scale};" for r in out]


_INTS, _MULS = e2m1_word_ptx("$8", ["r0", "r1", "r2", "r3"], "sc", tmp=["x0", "x1", "x2", "x3"])
_DECODE = ("\n.reg .b32 q2, x0, x1, x2, x3, r0, r1, r2, r3, sc;\n" + "\n".join(_INTS)
           + "\nmov.b32 sc, {$9, $9};\n" + "\n".join(_MULS) + "\n")

E2M1_BF16X2_PTX = "{" + _DECODE + """mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}"""

# fp32 outputs for CUDA-core use (the decode GEMV): a bf16 in the low half becomes an fp32 by a
# left shift of 16, one in the high half by clearing the low 16 bits: 1 instruction per weight
# instead of the unpack + cvt pair (PRMT + shift) ptxas emits for a bf16 -> fp32 conversion.
E2M1_F32_PTX = "{" + _DECODE + """shl.b32 $0, r0, 16;
and.b32 $1, r0, 0xFFFF0000;
shl.b32 $2, r1, 16;
and.b32 $3, r1, 0xFFFF0000;
shl.b32 $4, r2, 16;
and.b32 $5, r2, 0xFFFF0000;
shl.b32 $6, r3, 16;
and.b32 $7, r3, 0xFFFF0000;
}"""

_ASM = tl.constexpr(E2M1_BF16X2_PTX)  # jit code reads module globals only as constexprs
_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,h")  # 8 bf16 out, word in, bf16 scale in
_ASM_F32 = tl.constexpr(E2M1_F32_PTX)
_CONSTRAINTS_F32 = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,h")  # 8 fp32 out


@helper
def e2m1_scaled_ptx(words, scale):
    """int32 words [R, C] and bf16 scale * 2**118 [R, C] (broadcastable) -> 8 bf16 tensors [R, C]
    in pair order (columns 0,4,1,5,2,6,3,7 of each word), each = e2m1 * scale * 2**-8 exactly."""
    return tl.inline_asm_elementwise(
        _ASM, _CONSTRAINTS, [words, scale],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
               tl.bfloat16),
        is_pure=True, pack=1)


@helper
def e2m1_scaled_ptx_f32(words, scale):
    """As e2m1_scaled_ptx, the 8 outputs as fp32 (exact: every bf16 is an fp32)."""
    return tl.inline_asm_elementwise(
        _ASM_F32, _CONSTRAINTS_F32, [words, scale],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1)


@helper
def scale_bf16_2_118(sr, CUDA: tl.constexpr):
    """uint8 E4M3 group scales -> bf16 e4m3 * 2**118 (exact, see above)."""
    return (e4m3_to_f32(sr, CUDA) * _SCALE_BF16).to(tl.bfloat16)


@helper
def nvfp4_words_scaled(wd, sc, NATURAL: tl.constexpr):
    """int32 words [R, C] + bf16 scale * 2**118 [R, C/2] (one per 16 columns = 2 words) ->
    weights * 2**-8 [R, 8C]: bf16 in pair order (NATURAL=False, the MMA operand order of
    _decode.x_cols) or fp32 in natural column order (NATURAL=True, for CUDA-core FMAs). The joins
    only rename registers: join(a, b) adds a fastest axis of size 2."""
    R: tl.constexpr = wd.shape[0]
    C: tl.constexpr = wd.shape[1]
    sw = tl.join(sc, sc).reshape(R, C)
    if NATURAL:
        l0, h0, l1, h1, l2, h2, l3, h3 = e2m1_scaled_ptx_f32(wd, sw)  # l_j = column j, h_j = column j+4
        # [R, C, h] then [R, C, h, b] and [R, C, h, b, a] with j = 2b + a: flat 4h + 2b + a = column
        u0 = tl.join(tl.join(l0, h0), tl.join(l2, h2))
        u1 = tl.join(tl.join(l1, h1), tl.join(l3, h3))
        return tl.join(u0, u1).reshape(R, C * 8)
    else:
        l0, h0, l1, h1, l2, h2, l3, h3 = e2m1_scaled_ptx(wd, sw)
        # pair order 0,4,1,5,2,6,3,7: as _decode.e2m1_words (l_j, h_j adjacent = one register)
        lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))
        hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))
        return tl.join(lo, hi).reshape(R, C * 8)


# --- bit-exact CPU emulation of E2M1_BF16X2_PTX ----------------------------------------------


def _bf16_bits_to_f64(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _f64_to_bf16_bits_rn(v: np.ndarray) -> np.ndarray:
    """Round to nearest even into bf16 (what mul.rn.bf16x2 does). The products this decoder forms
    have <= 16 significant bits and lie in fp32's range, so the fp64 -> fp32 step is exact (checked);
    fp32 -> bf16 RNE on the bit pattern is then exact for normals and subnormals alike."""
    f32 = v.astype(np.float32)
    finite = np.isfinite(v)
    if not np.array_equal(f32.astype(np.float64)[finite], v[finite]):
        raise ArithmeticError("emulation: a product needs more than fp32 to round once; extend _f64_to_bf16_bits_rn")
    bits = f32.view(np.uint32).astype(np.uint64)
    nan = np.isnan(f32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, np.uint16(0x7FC0), rounded)


def _operand(tok: str, regs: dict, args: dict) -> np.ndarray:
    tok = tok.strip()
    if tok.startswith("$"):
        return args[int(tok[1:])]
    if tok.startswith("0x") or tok.isdigit():
        return np.uint32(int(tok, 0))
    return regs[tok]


def emulate(words: np.ndarray, scale_bits: np.ndarray, ptx: str = E2M1_BF16X2_PTX) -> list[np.ndarray]:
    """Execute `ptx` on uint32 `words` and uint16 bf16 `scale_bits` (same shape) -> the 8 outputs
    ($0..$7): uint16 bf16 bit patterns (E2M1_BF16X2_PTX) or uint32 fp32 ones (E2M1_F32_PTX).
    Instruction semantics (PTX ISA):
        and.b32 d, a, b          d = a & b                     (32-bit, ptxas: LOP3.LUT)
        mul.lo.u32 d, a, b       d = (a * b) mod 2**32         (ptxas: IMAD)
        shr.u32 d, a, n          d = a >> n, zero fill         (ptxas: SHF.R.U32)
        shl.b32 d, a, n          d = (a << n) mod 2**32        (ptxas: SHF.L / IMAD.SHL)
        mov.b32 d, {lo, hi}      d = lo | hi << 16             (pack; ptxas: PRMT or a rename)
        mov.b32 {lo, hi}, a      lo = a & 0xFFFF, hi = a >> 16 (unpack; a rename)
        mul.rn.bf16x2 d, a, b    each 16-bit half: bf16 product rounded to nearest even, subnormal
                                 inputs and outputs kept (PTX has no .ftz for bf16)"""
    words = np.asarray(words, dtype=np.uint32)
    args: dict[int, np.ndarray] = {8: words, 9: np.asarray(scale_bits, dtype=np.uint16)}
    regs: dict[str, np.ndarray] = {}
    body = ptx.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError("emulate: expected a braced PTX block")
    for line in body[1:-1].split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":
            dst, src = (s.strip() for s in rest.split(",", 1)) if not rest.startswith("{") else \
                re.match(r"(\{[^}]*\})\s*,\s*(.*)", rest).groups()
            if dst.startswith("{"):  # unpack
                lo, hi = (t.strip() for t in dst[1:-1].split(","))
                v = _operand(src, regs, args).astype(np.uint32)
                for name, part in ((lo, v & 0xFFFF), (hi, v >> 16)):
                    args[int(name[1:])] = part.astype(np.uint16)
            else:  # pack
                lo, hi = (t.strip() for t in src.strip()[1:-1].split(","))
                regs[dst] = (_operand(lo, regs, args).astype(np.uint32)
                             | (_operand(hi, regs, args).astype(np.uint32) << 16))
            continue
        dst, a, b = (t.strip() for t in rest.split(","))
        va, vb = _operand(a, regs, args), _operand(b, regs, args)
        out = args if dst.startswith("$") else regs
        key = int(dst[1:]) if dst.startswith("$") else dst
        if op == "and.b32":
            out[key] = (np.asarray(va, np.uint32) & np.asarray(vb, np.uint32)).astype(np.uint32)
        elif op == "mul.lo.u32":
            out[key] = ((np.asarray(va, np.uint64) * np.asarray(vb, np.uint64)) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "shr.u32":
            out[key] = (np.asarray(va, np.uint32) >> np.uint32(vb)).astype(np.uint32)
        elif op == "shl.b32":
            out[key] = ((np.asarray(va, np.uint64) << np.uint64(vb)) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "mul.rn.bf16x2":
            va, vb = np.asarray(va, np.uint32), np.asarray(vb, np.uint32)
            halves = []
            for sh in (0, 16):
                pa = _bf16_bits_to_f64((va >> sh) & 0xFFFF)
                pb = _bf16_bits_to_f64((vb >> sh) & 0xFFFF)
                halves.append(_f64_to_bf16_bits_rn(pa * pb).astype(np.uint32))
            out[key] = (halves[0] | (halves[1] << 16)).astype(np.uint32)
        else:
            raise ValueError(f"emulate: opcode {op!r} is not modelled")
    return [args[i] for i in range(8)]


# pair-order position p of a word's 8 outputs holds column PAIR_ORDER[p]
PAIR_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
