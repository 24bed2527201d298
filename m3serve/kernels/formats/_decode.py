"""In-register decoders for the weight formats (Triton device functions).

Shape legend (per program tile):
    wd     [BN, BK/8]  int32 words of packed NVFP4 (the uint8 [N, K/2] tensor viewed as int32;
                       byte i of a word holds columns 2i (low nibble) and 2i+1)
    q      [BN, BK]    uint8 E4M3 bytes
    w      [BN, G, GS] decoded weights, G = BK/GS groups of GS columns sharing one scale
    s      [BN, G]     group scales

Every decoder is exact: E2M1, E4M3, E8M0 and BF16 values are representable in fp32 and in
bf16, and the bit tricks below rebuild them without rounding (Triton cannot keep a look-up
table in registers). Two precisions:

* fp32 (LOWP=False; CUDA cores and the interpreter). E2M1 nibble s|e e|m -> fp16 bits
  s<<15 | (eem)<<9, which as an fp16 is exactly e2m1 * 2**-14 (e = 0 lands on the fp16
  subnormal m * 2**-15 = 0.5 * m * 2**-14); the group scale is returned times 2**6.
* bf16 (LOWP=True; tensor-core operands, compiled only). E2M1 -> bf16 bits s<<15 | (eem)<<6,
  exactly e2m1 * 2**-126 (e = 0 is the bf16 subnormal m * 2**-127); the group scale is
  returned times 2**118 (at most 448 * 2**118 < 2**127), and the bf16 product
  e2m1 * scale * 2**-8 is exact (at most 6 significant bits, at least 2**-18): no cvt
  instruction per element. SM90's bf16 multiply keeps subnormal inputs (there is no .ftz
  form for bf16 in PTX).

Either way w * s = e2m1 * scale * 2**-8, so NVFP4 outputs are multiplied by NVFP4_UNIT = 2**8
(and divided by the ENCODE global scale) once per output element.

Compiled NVFP4 weight streaming uses the inline-PTX decoder of formats/_e2m1_ptx.py instead (same bf16
bit patterns, scale folded in with packed bf16 multiplies, ~2 instructions per weight); the
decoders here remain the interpreter path, the PTX_E2M1 = False fallback and the KV-cache one.

* E4M3 byte s|eeee|mmm -> fp16 bits s<<15 | (eeeemmm)<<7 is e4m3 * 2**-8, subnormals
  included (interpreter path). The E4M3 NaN codes decode to +-480 that way; the quantizers
  never emit NaN scales for finite weights (checkpoints are checked with quant.check_finite).
  Compiled (CUDA=True), Triton's fp8 conversion is used: SM90 converts two per instruction.
* E8M0 byte b -> fp32 bits b<<23 = 2**(b-127) (bf16: b<<7); b = 0 is the subnormal 2**-127,
  b = 255 NaN.
* fp32 -> bf16 stores round to nearest even in both executors (to_bf16): compiled code uses
  the hardware conversion; the Triton 3.6 interpreter's cast truncates, so interpreted runs use
  the integer RNE trick (bits + 0x7FFF + lsb) >> 16, identical for finite values.
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels._jit import helper

NVFP4_UNIT = tl.constexpr(256.0)  # 2**8, see above
_SCALE_FP32 = tl.constexpr(64.0)  # 2**6
_SCALE_BF16 = tl.constexpr(3.3230699894622794e35)  # 2**118

# FMT codes shared by the weight-streaming kernels.
FMT_NVFP4 = 0  # packed E2M1 [N, K/2] + E4M3 [N, K/16] (+ global ENCODE scale, divided out)
FMT_MXFP8 = 1  # E4M3 [N, K] + E8M0 [N, K/32]
FMT_FP8 = 2  # E4M3 [N, K] + fp32 per-tensor (or per-row) DECODE scale, multiplied
FMT_BF16 = 3  # BF16 [N, K]


@helper
def e2m1_pair(w, J: tl.constexpr, MAG: tl.constexpr):
    """uint32 words of 8 nibbles -> 16-bit pairs for nibbles J and J+4 (bits 4J and 4J+16):
    magnitude bits to MAG..MAG+2 and the sign bit to 15 in both halves at once."""
    if MAG >= 4 * J:
        mag = (w << (MAG - 4 * J)) & ((7 << MAG) * 0x10001)
    else:
        mag = (w >> (4 * J - MAG)) & ((7 << MAG) * 0x10001)
    if J < 3:
        sgn = (w << (12 - 4 * J)) & 0x80008000
    else:
        sgn = w & 0x80008000
    return mag | sgn


@helper
def e2m1_words(w, LOWP: tl.constexpr):
    """int32 words [R, C] (nibble j of word c = element 8c+j) -> [R, 8C] in PAIR ORDER:
    fp32 e2m1 * 2**-14 (LOWP=False) or bf16 e2m1 * 2**-126 (LOWP=True).

    Nibbles j and j+4 are placed by one shift-and-mask into the two halves of one register, so
    the tile keeps them adjacent: position p of each word's 8 holds element
    pair_order(p) = p // 2 + 4 * (p % 2), i.e. 0,4,1,5,2,6,3,7. The MMA operand takes adjacent
    K pairs from one register, so no byte permutes are needed; the caller loads x in the same
    order (x_cols), which leaves the dot product unchanged (a sum is order-free up to rounding).
    Each group of 16 columns is 2 whole words, so group scales are unaffected."""
    w = w.to(tl.uint32, bitcast=True)
    MAG: tl.constexpr = 6 if LOWP else 9
    HT: tl.constexpr = tl.bfloat16 if LOWP else tl.float16
    p0 = e2m1_pair(w, 0, MAG)
    p1 = e2m1_pair(w, 1, MAG)
    p2 = e2m1_pair(w, 2, MAG)
    p3 = e2m1_pair(w, 3, MAG)
    l0 = p0.to(tl.uint16).to(HT, bitcast=True)
    h0 = (p0 >> 16).to(tl.uint16).to(HT, bitcast=True)
    l1 = p1.to(tl.uint16).to(HT, bitcast=True)
    h1 = (p1 >> 16).to(tl.uint16).to(HT, bitcast=True)
    l2 = p2.to(tl.uint16).to(HT, bitcast=True)
    h2 = (p2 >> 16).to(tl.uint16).to(HT, bitcast=True)
    l3 = p3.to(tl.uint16).to(HT, bitcast=True)
    h3 = (p3 >> 16).to(tl.uint16).to(HT, bitcast=True)
    if not LOWP:
        l0, h0, l1, h1 = l0.to(tl.float32), h0.to(tl.float32), l1.to(tl.float32), h1.to(tl.float32)
        l2, h2, l3, h3 = l2.to(tl.float32), h2.to(tl.float32), l3.to(tl.float32), h3.to(tl.float32)
    # lo = [l0 l1 l2 l3], hi = [h0 h1 h2 h3] (flat index of a nested join = the outer selector
    # last); join(lo, hi) then interleaves them: l0 h0 l1 h1 ... = elements 0 4 1 5 2 6 3 7.
    lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))
    hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    return tl.join(lo, hi).reshape(w.shape[0], w.shape[1] * 8)


@helper
def x_cols(k0, BK: tl.constexpr, FMT: tl.constexpr):
    """Columns [k0, k0+BK) of x in the order load_w_groups returns the weight columns."""
    k = tl.arange(0, BK)
    if FMT == 0:
        k = (k // 8) * 8 + (k % 8) // 2 + 4 * (k % 2)
    return k0 + k


@helper
def e4m3_to_f32(q, CUDA: tl.constexpr):
    """uint8 E4M3 bytes -> fp32 (exact)."""
    if CUDA:
        return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        qi = q.to(tl.int32)
        bits = ((qi & 0x80) << 8) | ((qi & 0x7F) << 7)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@helper
def e4m3_to(q, CUDA: tl.constexpr, LOWP: tl.constexpr):
    """uint8 E4M3 bytes -> fp32, or bf16 when LOWP (compiled only; E4M3 is a subset of bf16)."""
    if LOWP:
        return q.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    else:
        return e4m3_to_f32(q, CUDA)


@helper
def to_bf16(x, CUDA: tl.constexpr):
    """fp32 -> bf16, round to nearest even in both executors."""
    if CUDA:
        return x.to(tl.bfloat16)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@helper
def e8m0_to_f32(b):
    """uint8 E8M0 bytes -> fp32 2**(b-127) (exact; 0 -> 2**-127, 255 -> NaN)."""
    bi = b.to(tl.int32)
    bits = tl.where(bi == 0, 0x00400000, bi << 23)
    bits = tl.where(bi == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@helper
def e8m0_to_bf16(b):
    """uint8 E8M0 bytes -> bf16 2**(b-127) (exact; 0 -> the subnormal 2**-127, 255 -> NaN)."""
    bi = b.to(tl.int32)
    bits = tl.where(bi == 0, 0x0040, bi << 7)
    bits = tl.where(bi == 255, 0x7FC0, bits)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@helper
def nvfp4_word_offsets(rn, kw, K, TILED: tl.constexpr):
    """[BN, BKW] int32-word offsets of rows rn [BN], words kw [BKW] (word w of a row = columns 8w..8w+7) of an
    NVFP4 [N, K] weight, row-major or (TILED) in the MMA tile layout of m3serve.quant.nvfp4.tile_nvfp4: a block
    of 16 rows x 128 columns is 256 words [h, g, c, 4 words], row 16 rb + 8 h + g. A row's 16 words of one
    128-column step stay contiguous."""
    if TILED:
        row = (rn // 16) * (2 * K) + ((rn // 8) % 2) * 128 + (rn % 8) * 16
        col = (kw // 16) * 256 + kw % 16
        return row[:, None] + col[None, :]
    else:
        return rn[:, None] * (K // 8) + kw[None, :]


@helper
def nvfp4_scale_offsets(rn, ks, K, TILED: tl.constexpr):
    """[BN, G] byte offsets of the E4M3 group scales of rows rn, groups ks (16 columns each), row-major or
    (TILED) in the tile layout: 128 B a block, [g, c, h, 2 scales], groups 8 ks' + 2 c, + 1."""
    if TILED:
        row = (rn // 16) * K + (rn % 8) * 16 + ((rn // 8) % 2) * 2
        col = (ks // 8) * 128 + ((ks % 8) // 2) * 4 + ks % 2
        return row[:, None] + col[None, :]
    else:
        return rn[:, None] * (K // 16) + ks[None, :]


@helper
def mxfp8_byte_offsets(rn, kk, K, TILED: tl.constexpr):
    """[BN, BK] byte offsets of rows rn [BN], columns kk [BK] of an MXFP8 [N, K] weight, row-major or (TILED) in
    the MMA tile layout of m3serve.quant.mxfp8.tile_mxfp8: a block of 16 rows x 128 columns is 2 KB
    [h, v, g, c, 16 B] holding row 16 rb + 8 h + g, columns 32 c + 16 v .. + 15 (runs of 16 contiguous bytes)."""
    if TILED:
        row = (rn // 16) * (16 * K) + ((rn // 8) % 2) * 1024 + (rn % 8) * 64
        col = (kk // 128) * 2048 + ((kk // 16) % 2) * 512 + ((kk // 32) % 4) * 16 + kk % 16
        return row[:, None] + col[None, :]
    else:
        return rn[:, None] * K + kk[None, :]


@helper
def mxfp8_scale_offsets(rn, ks, K, TILED: tl.constexpr):
    """[BN, G] byte offsets of the E8M0 scales of rows rn, groups ks (32 columns each), row-major or (TILED) in the
    tile layout: 64 B a block, [g, c, h], group 4 ks' + c."""
    if TILED:
        row = (rn // 16) * (K // 2) + (rn % 8) * 8 + (rn // 8) % 2
        col = (ks // 4) * 64 + (ks % 4) * 2
        return row[:, None] + col[None, :]
    else:
        return rn[:, None] * (K // 32) + ks[None, :]


@helper
def load_w_groups(w_ptr, s_ptr, rn, k0, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GS: tl.constexpr, CUDA: tl.constexpr, LOWP: tl.constexpr, TILED: tl.constexpr = False):
    """Rows `rn` [BN] (int64-safe offsets are the caller's job: pass shifted base pointers),
    columns [k0, k0+BK) -> (w [BN, BK/GS, GS] unscaled, s [BN, BK/GS] group scale), fp32 or
    (LOWP, compiled only) bf16. w * s is the weight (NVFP4: times 2**-8 and the global scale);
    FP8/BF16 have no group scale and return s = 1. TILED: NVFP4 / MXFP8 in the MMA tile layout."""
    G: tl.constexpr = BK // GS
    rn2 = rn[:, None]
    if FMT == 0:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        w = e2m1_words(tl.load(w_ptr + nvfp4_word_offsets(rn, kw, K, TILED)), LOWP).reshape(BN, G, GS)
        ks = k0 // 16 + tl.arange(0, G)
        s = e4m3_to_f32(tl.load(s_ptr + nvfp4_scale_offsets(rn, ks, K, TILED)), CUDA)
        if LOWP:
            s = (s * _SCALE_BF16).to(tl.bfloat16)
        else:
            s = s * _SCALE_FP32
    elif FMT == 1:
        kk = k0 + tl.arange(0, BK)
        w = e4m3_to(tl.load(w_ptr + mxfp8_byte_offsets(rn, kk, K, TILED)), CUDA, LOWP).reshape(BN, G, GS)
        ks = k0 // 32 + tl.arange(0, G)
        sb = tl.load(s_ptr + mxfp8_scale_offsets(rn, ks, K, TILED))
        s = e8m0_to_bf16(sb) if LOWP else e8m0_to_f32(sb)
    elif FMT == 2:
        kk = k0 + tl.arange(0, BK)
        w = e4m3_to(tl.load(w_ptr + rn2 * K + kk[None, :]), CUDA, LOWP).reshape(BN, G, GS)
        s = tl.full([BN, G], 1.0, tl.bfloat16 if LOWP else tl.float32)
    else:
        kk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn2 * K + kk[None, :])
        if not LOWP:
            w = w.to(tl.float32)
        w = w.reshape(BN, G, GS)
        s = tl.full([BN, G], 1.0, tl.bfloat16 if LOWP else tl.float32)
    return w, s
