"""In-register decoders for tiles of paged-KV-cache pages (Triton device functions).

Shape legend (one program's tile of one (slot, KV head) page):
    page_ptr   first element of the page [P, Dc] (Dc = D, or D/2 bytes for packed NVFP4)
    scale_ptr  first byte of the page's E4M3 block scales [P*G], G = D/16 (NVFP4 only)
    tok        [BN]        token offsets inside the page
    tile       [BN, D]     decoded values; NVFP4 returns the even and odd columns apart,
                           [BN, D/2] each, in the column order of nvfp4_columns

Every decoder reproduces PagedKVCache.read(..., torch.bfloat16) bit for bit: the stored value is
decoded in fp32 and rounded once to bf16. The result is bf16 when compiled (a tensor-core operand)
and the same values held in fp32 under the interpreter (whose tl.dot mis-computes bf16 operands).

NVFP4: the reference value is RN32(e2m1 * bs / gs) (bs the E4M3 block scale, gs the fp32 ENCODE
scale), then RN16. Every E2M1 magnitude is 2**k * c with c in {1, 1.5}, so
RN32(e2m1 * bs / gs) = 2**k * RN32(c * bs / gs) (c * bs is exact in fp32, and scaling by a power
of two commutes with rounding while the result stays a normal number), and likewise
RN16(2**k * x) = 2**k * RN16(x). Two IEEE divisions per 16-value group (c1 = RN32(bs / gs),
c15 = RN32(1.5 bs / gs)) then give every element by exact multiplies with +-2**k: in fp32 under the
interpreter (then RN16), in packed bf16 when compiled (the group constants rounded to bf16 first,
two elements per instruction, no conversion instructions per element). The codes 0 and 8 give
+-0 (NaN for a NaN scale, as in the reference). The identity only fails for results below 2**-126
(bs / gs < 2**-125 needs gs > 2**116, i.e. a calibration amax under 2**-105): not a reachable KV
cache. tests/kernels/attention/test_paged_attention*.py check every decoder against PagedKVCache.read bit
for bit, compiled and interpreted.
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels.formats._decode import e2m1_pair, e4m3_to_f32, to_bf16
from m3serve.kernels._jit import helper

# KV storage formats, by container. Codes 0/2/3 agree with _decode's weight FMT codes.
KV_NVFP4 = 0  # uint8 [P, D/2] packed E2M1 (column 2j in the low nibble) + E4M3 block scales
KV_FP8 = 2  # float8_e4m3fn [P, D], unscaled
KV_BF16 = 3  # bf16 [P, D]
KV_FP32 = 4  # fp32 [P, D]
_TWO_POW_120 = tl.constexpr(2.0**120)
_TWO_POW_126 = tl.constexpr(2.0**126)


@helper
def _rounded(x, CUDA: tl.constexpr):
    """fp32 -> RN bf16: bf16 when compiled, the same value in fp32 under the interpreter."""
    if CUDA:
        return to_bf16(x, CUDA)
    else:
        return to_bf16(x, CUDA).to(tl.float32)


@helper
def load_dense_tile(page_ptr, tok, tok_ok, FMT: tl.constexpr, D: tl.constexpr, CUDA: tl.constexpr):
    """[BN, D] tile of a bf16 / fp32 / fp8 page; rows with tok_ok False read as 0."""
    d = tl.arange(0, D)
    ptrs = page_ptr + tok[:, None] * D + d[None, :]
    m = tok_ok[:, None]
    if FMT == 3:
        x = tl.load(ptrs, mask=m, other=0.0)
        if not CUDA:
            x = x.to(tl.float32)
    elif FMT == 4:
        x = _rounded(tl.load(ptrs, mask=m, other=0.0), CUDA)
    else:
        q = tl.load(ptrs, mask=m, other=0)
        if CUDA:
            x = e4m3_to_bf16(q)
        else:
            x = e4m3_to_f32(q, CUDA)  # E4M3 values are exact in bf16
    return x


@helper
def e4m3_to_bf16(q):
    """uint8 E4M3 -> bf16, exact, without conversion instructions (which issue at a quarter of
    the integer rate on sm_90 and bound an fp8 tile's decode): s|eeee|mmm placed as the bf16 bits
    s|0000eeee|mmm0000 is e4m3 * 2**-120 (E4M3 subnormals land on bf16 subnormals), and one bf16
    multiply by 2**120 rescales it exactly (a power of two, the result normal or 0)."""
    x = q.to(tl.uint16)
    bits = ((x & 0x7F) << 4) | ((x & 0x80) << 8)
    return bits.to(tl.bfloat16, bitcast=True) * tl.full(x.shape, _TWO_POW_120, tl.bfloat16)


@helper
def _e2m1_times(nib, c1, c15, CUDA: tl.constexpr):
    """uint32 nibbles [BN, G, 8] and per-group RN(bs/gs), RN(1.5 bs/gs) [BN, G, 1] -> fp32 values.

    Magnitude code c, e = c >> 1, m = c & 1: the E2M1 value is 2**(e-1) * (1.5 if m and e > 0
    else 1) for c > 0 (c = 1 is the subnormal 0.5), so it is c15 or c1 times the fp32 power of
    two with biased exponent e + 126, and the sign is bit 3 of the nibble."""
    c = nib & 7
    e = c >> 1
    triple = ((c & 1) != 0) & (e > 0)
    pow2 = tl.where(c == 0, tl.zeros_like(e), (e + 126) << 23) | ((nib & 8) << 28)
    base = tl.where(triple, c15, c1)
    return base * pow2.to(tl.float32, bitcast=True)


@helper
def nvfp4_columns(DH: tl.constexpr):
    """Columns of the even half load_nvfp4_tile returns (the odd half is these + 1): position
    4c + i holds column 8c + (0, 4, 2, 6)[i], so that each 32-bit register of a decoded pair
    holds two positions that are adjacent along D (an MMA k-pair) without byte permutes."""
    e = tl.arange(0, DH)
    return 8 * (e // 4) + 4 * (e % 2) + 2 * ((e % 4) // 2)


@helper
def _spread(x, BN: tl.constexpr, G: tl.constexpr):
    """[BN, G] per-group values -> [BN, 2G], one per 32-bit word of packed nibbles (8 columns)."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (BN, G, 2)), (BN, 2 * G))


@helper
def _bf16_pair_half(x, HIGH: tl.constexpr):
    if HIGH:
        x = x >> 16
    return x.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@helper
def _decode_pair(w, J: tl.constexpr, b1w, bxw, c1w, c15w, CUDA: tl.constexpr):
    """Nibbles J and J+4 of each word w [BN, W] -> (columns 8c+J, 8c+J+4) decoded values.

    Compiled: e2m1_pair builds both as bf16 bits e2m1 * 2**-126 in one register; clearing the
    mantissa bit of the 1.5-mantissa codes leaves 2**(e-1) * 2**-126, and two exact bf16 products
    (by 2**126, then by the group's bf16(c1) or bf16(c15), picked per half by a bit mask) give
    2**(e-1) * RN16(c) = RN16(2**(e-1) * c), the reference rounding (module docstring)."""
    if CUDA:
        pj = e2m1_pair(w, J, 6)
        triple = pj & ((pj >> 1) | (pj >> 2)) & 0x00400040
        pp = pj ^ triple
        bsel = b1w ^ (bxw & ((triple >> 6) * 0xFFFF))
        two126 = tl.full(pj.shape, _TWO_POW_126, tl.bfloat16)
        lo = (_bf16_pair_half(pp, False) * two126) * _bf16_pair_half(bsel, False)
        hi = (_bf16_pair_half(pp, True) * two126) * _bf16_pair_half(bsel, True)
    else:
        lo = _rounded(_e2m1_times((w >> (4 * J)) & 15, c1w, c15w, CUDA), CUDA)
        hi = _rounded(_e2m1_times((w >> (4 * J + 16)) & 15, c1w, c15w, CUDA), CUDA)
    return lo, hi


@helper
def load_nvfp4_tile(page_ptr, scale_ptr, gs, tok, tok_ok, IS_V: tl.constexpr, D: tl.constexpr,
                    BN: tl.constexpr, CUDA: tl.constexpr):
    """(even, odd) column halves [BN, D/2] of an NVFP4 page tile, decoded exactly (see the module
    docstring), the even half in nvfp4_columns order and the odd half one column to the right.
    K scale byte of (token t, group g) is t*G + g; V scales are stored in 4-token quads:
    (t//4)*4G + 4g + t%4. Rows with tok_ok False read code 0 with scale 0, i.e. 0."""
    W: tl.constexpr = D // 8  # int32 words (8 nibbles) per token
    G: tl.constexpr = D // 16
    words = page_ptr.to(tl.pointer_type(tl.int32)) + tok[:, None] * W + tl.arange(0, W)[None, :]
    w = tl.load(words, mask=tok_ok[:, None], other=0).to(tl.uint32, bitcast=True)  # [BN, W]
    g = tl.arange(0, G)
    if IS_V:
        sidx = (tok // 4)[:, None] * (4 * G) + g[None, :] * 4 + (tok % 4)[:, None]
    else:
        sidx = tok[:, None] * G + g[None, :]
    bs = e4m3_to_f32(tl.load(scale_ptr + sidx, mask=tok_ok[:, None], other=0), CUDA)  # [BN, G]
    c1 = tl.math.div_rn(bs, gs)
    c15 = tl.math.div_rn(bs * 1.5, gs)
    if CUDA:
        b1 = c1.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        b15 = c15.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        b1w = _spread(b1 | (b1 << 16), BN, G)
        bxw = _spread((b1 ^ b15) | ((b1 ^ b15) << 16), BN, G)
        c1w = b1w
        c15w = bxw
    else:
        c1w = _spread(c1, BN, G)
        c15w = _spread(c15, BN, G)
        b1w = c1w
        bxw = c15w
    lo0, hi0 = _decode_pair(w, 0, b1w, bxw, c1w, c15w, CUDA)
    lo1, hi1 = _decode_pair(w, 1, b1w, bxw, c1w, c15w, CUDA)
    lo2, hi2 = _decode_pair(w, 2, b1w, bxw, c1w, c15w, CUDA)
    lo3, hi3 = _decode_pair(w, 3, b1w, bxw, c1w, c15w, CUDA)
    # flat order of join(join(a, b), join(c, d)) is a, c, b, d: columns 8c + 0, 4, 2, 6 (even)
    even = tl.join(tl.join(lo0, lo2), tl.join(hi0, hi2)).reshape(BN, D // 2)
    odd = tl.join(tl.join(lo1, lo3), tl.join(hi1, hi3)).reshape(BN, D // 2)
    return even, odd
