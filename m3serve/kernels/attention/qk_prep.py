"""Catalog entry attn.qk_prep: one attention layer's per-head q/k norm and partial NeoX RoPE in one launch.

From the projections' outputs, for every token and head (q, k and, on MSA layers, index-q and index-k):

    n   = bf16( RMSNorm_gemma(x_head; w) )                   the stock q_norm / k_norm / index_*_norm
    out = bf16( n[c] * cos[c] + sign(c) * n[partner(c)] * sin[c] )   c < rd  (apply_rope: rotate-half)
    out = n[c]                                                        c >= rd (pass through)

with cos/sin of angle = float(position) * inv_freq[c mod rd/2], inv_freq = layers.rope_inv_freq (the very
tensor rope_cos_sin builds), i.e. exactly Attention.project's q, k, iq, ik.

Why inv_freq is an input and not computed in-kernel from theta: the angle is pos * inv_freq in fp32, and at
M3's positions (up to 2**20) one fp32 ulp of a frequency moves the angle by up to 2**-4 rad, far outside a
bf16 band; theta**x in Triton (exp2/log2) is not torch's powf bit for bit. The product pos * inv_freq is a
single fp32 multiply on both sides, so the angles are bit-identical; cos/sin are computed in-kernel
(_rope.cos_sin_f32, within 2.5 fp32 ulp of torch's) - a [max_pos, rd] table would be 256 MB for M3.

Also entry attn.rope: the same kernel without the norms (NORM = False), the Eagle3 draft layer's q/k RoPE
(Llama attention has no per-head norms), apply_rope on the projections as they are.

Shape legend (T tokens; Hq / Hk query / KV heads on this rank; D head dim; Di index head dim; rd rotary dim):
    q            [T, Hq*D]   bf16 (unit column stride)        q_out   [T, Hq, D]  bf16 contiguous
    k            [T, Hk*D]   bf16                             k_out   [T, Hk, D]
    iq           [T, Hk*Di]  bf16 (MSA layers, else None)     iq_out  [T, Hk, Di]
    ik           [T, Di]     bf16 (MSA layers, else None)     ik_out  [T, Di]
    positions    [T]         int64 or int32
    *_norm_w     [D] / [Di]  fp32 or bf16 Gemma weights (1 + w is applied)
    inv_freq     [rd/2]      fp32
Grid: (T, Hq + Hk [+ Hk + 1]): one program per (token, head); nothing depends on device-held lengths.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16
from m3serve.kernels._jit import helper, is_compiled, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.attention._rope import cos_sin_f32
from m3serve.kernels.catalog import ROW_CELLS_MAX, BF16_REL, FP32_U, Case, Cell, Entry, assert_band, check_tensor, poisoned
from m3serve.kernels.norm.rms import rms_inverse, rms_norm_reference
from m3serve.model.layers import apply_rope, rope_inv_freq

ENABLED = True  # the one switch: False sends attn.qk_prep calls down the stock path


@helper
def _norm_rope_head(src, w_ptr, dst, pos, inv_freq_ptr, eps, DIM: tl.constexpr, RD: tl.constexpr,
                    BLOCK: tl.constexpr, CUDA: tl.constexpr, NORM: tl.constexpr):
    """One head: Gemma RMSNorm rounded to bf16 (as the stock path stores it), then rotate-half RoPE on
    channels < RD. The rotation partner of channel c is loaded and normalised by this same program with
    the same inverse rms, so both sides of a pair see identical bf16 values. NORM = False: RoPE of the
    head as loaded (attn.rope)."""
    HALF: tl.constexpr = RD // 2
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    rot = cols < RD
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    xf = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    if NORM:
        inv = rms_inverse(xf, DIM, eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        xn = to_bf16((xf * inv) * (1.0 + w), CUDA).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
        xpn = to_bf16((xp * inv) * (1.0 + wp), CUDA).to(tl.float32)
    else:
        xn = xf
        xpn = xp
    freq = tl.load(inv_freq_ptr + cols % HALF, mask=rot, other=0.0)
    cos, sin = cos_sin_f32(pos * freq)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    y = tl.where(rot, xn * cos + (sign * xpn) * sin, xn)
    tl.store(dst + cols, to_bf16(y, CUDA), mask=mask)


@kernel
def _qk_prep_kernel(q_ptr, k_ptr, iq_ptr, ik_ptr, pos_ptr, wq_ptr, wk_ptr, wiq_ptr, wik_ptr, inv_freq_ptr,
                    qo_ptr, ko_ptr, iqo_ptr, iko_ptr, stride_q, stride_k, stride_iq, stride_ik, eps,
                    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, RD: tl.constexpr,
                    BLOCK: tl.constexpr, CUDA: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.float32)  # round to nearest, as torch's positions.float()
    if h < HQ:
        _norm_rope_head(q_ptr + t * stride_q + h * D, wq_ptr, qo_ptr + (t * HQ + h) * D, pos, inv_freq_ptr,
                        eps, D, RD, BLOCK, CUDA, NORM)
    elif h < HQ + HK:
        hk = h - HQ
        _norm_rope_head(k_ptr + t * stride_k + hk * D, wk_ptr, ko_ptr + (t * HK + hk) * D, pos, inv_freq_ptr,
                        eps, D, RD, BLOCK, CUDA, NORM)
    elif h < HQ + 2 * HK:
        hi = h - HQ - HK
        _norm_rope_head(iq_ptr + t * stride_iq + hi * DI, wiq_ptr, iqo_ptr + (t * HK + hi) * DI, pos,
                        inv_freq_ptr, eps, DI, RD, BLOCK, CUDA, NORM)
    else:
        _norm_rope_head(ik_ptr + t * stride_ik, wik_ptr, iko_ptr + t * DI, pos, inv_freq_ptr, eps, DI, RD,
                        BLOCK, CUDA, NORM)


def _check_rows(name: str, t: torch.Tensor, rows: int, width: int, device: torch.device) -> None:
    check_tensor(name, t, torch.bfloat16, (rows, width), device)
    if t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit column stride, found strides {tuple(t.stride())}")


def _check_out(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    check_tensor(name, t, torch.bfloat16, shape, device)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, found strides {tuple(t.stride())}")


def _check_weight(name: str, w: torch.Tensor, dim: int, device: torch.device) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, found {type(w).__name__}")
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: expected torch.bfloat16 or torch.float32, found {w.dtype}")
    check_tensor(name, w, shape=(dim,), device=device)
    if not w.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, found strides {tuple(w.stride())}")


def _check_q_k(q, k, positions, inv_freq, q_out, k_out) -> tuple[int, int, int, int, int]:
    """The q/k/positions/inv_freq/outputs checks attn.qk_prep and attn.rope share -> (T, Hq, Hk, D, rd)."""
    if q_out is None or q_out.dim() != 3:
        raise ValueError(f"q_out: expected [T, Hq, D], found {None if q_out is None else tuple(q_out.shape)}")
    if k_out is None or k_out.dim() != 3:
        raise ValueError(f"k_out: expected [T, Hk, D], found {None if k_out is None else tuple(k_out.shape)}")
    t, hq, d = q_out.shape
    hk = k_out.shape[1]
    dev = q_out.device
    _check_out("q_out", q_out, (t, hq, d), dev)
    _check_out("k_out", k_out, (t, hk, d), dev)
    _check_rows("q", q, t, hq * d, dev)
    _check_rows("k", k, t, hk * d, dev)
    check_tensor("positions", positions, shape=(t,), device=dev)
    if positions.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"positions: expected torch.int64 or torch.int32, found {positions.dtype}")
    if not positions.is_contiguous():
        raise ValueError(f"positions: expected a contiguous tensor, found strides {tuple(positions.stride())}")
    check_tensor("inv_freq", inv_freq, torch.float32, device=dev)
    if inv_freq.dim() != 1 or not inv_freq.is_contiguous() or not 1 <= 2 * inv_freq.shape[0] <= d:
        raise ValueError(f"inv_freq: expected a contiguous [rd/2] with 2 <= rd <= D = {d}, found shape "
                         f"{tuple(inv_freq.shape)}")
    return t, hq, hk, d, 2 * inv_freq.shape[0]


def qk_prep(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_norm_w: torch.Tensor,
            k_norm_w: torch.Tensor, inv_freq: torch.Tensor, eps: float, q_out: torch.Tensor, k_out: torch.Tensor,
            iq: torch.Tensor | None = None, ik: torch.Tensor | None = None, iq_norm_w: torch.Tensor | None = None,
            ik_norm_w: torch.Tensor | None = None, iq_out: torch.Tensor | None = None,
            ik_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                          torch.Tensor | None]:
    """Raw call. Writes and returns (q_out, k_out, iq_out, ik_out); the index tensors are all given (MSA
    layer) or all None."""
    t, hq, hk, d, rd = _check_q_k(q, k, positions, inv_freq, q_out, k_out)
    dev = q_out.device
    _check_weight("q_norm_w", q_norm_w, d, dev)
    _check_weight("k_norm_w", k_norm_w, d, dev)
    index = (iq, ik, iq_norm_w, ik_norm_w, iq_out, ik_out)
    names = ("iq", "ik", "iq_norm_w", "ik_norm_w", "iq_out", "ik_out")
    given = [n for n, v in zip(names, index) if v is not None]
    if given and len(given) != len(names):
        raise ValueError(f"index tensors: expected all of {names} or none, found only {tuple(given)}")
    di = 0
    if given:
        if ik.dim() != 2:
            raise ValueError(f"ik: expected [T, Di], found shape {tuple(ik.shape)}")
        di = ik.shape[1]
        if rd > di:
            raise ValueError(f"inv_freq: rotary dim {rd} exceeds the index head dim Di = {di}")
        _check_rows("iq", iq, t, hk * di, dev)
        _check_rows("ik", ik, t, di, dev)
        _check_weight("iq_norm_w", iq_norm_w, di, dev)
        _check_weight("ik_norm_w", ik_norm_w, di, dev)
        _check_out("iq_out", iq_out, (t, hk, di), dev)
        _check_out("ik_out", ik_out, (t, di), dev)
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: expected a positive float, found {eps!r}")
    if t == 0:
        return q_out, k_out, iq_out, ik_out
    # dense layers: the index pointers are never dereferenced (DI = 0 removes their branch)
    iq_, ik_, wiq, wik, iqo, iko = (iq, ik, iq_norm_w, ik_norm_w, iq_out, ik_out) if di else \
        (q, q, q_norm_w, q_norm_w, q_out, q_out)
    block = triton.next_power_of_2(max(d, di))
    heads = hq + hk + (hk + 1 if di else 0)
    _qk_prep_kernel[(t, heads)](
        q, k, iq_, ik_, positions, q_norm_w, k_norm_w, wiq, wik, inv_freq, q_out, k_out, iqo, iko,
        q.stride(0), k.stride(0), iq_.stride(0), ik_.stride(0), eps,
        HQ=hq, HK=hk, D=d, DI=di, RD=rd, BLOCK=block, CUDA=is_compiled(q), NORM=True,
        num_warps=1 if block <= 128 else 2)
    return q_out, k_out, iq_out, ik_out


# --- reference and compare -------------------------------------------------------------------------------


class QKPrepReference(NamedTuple):
    """fp32 values before each output's final bf16 cast, and for the band: per element the rotation's
    magnitudes |n c| + |n' s| and |n| + |n'| (zero on pass-through channels)."""
    outs: tuple
    rot_mag: tuple
    pair_mag: tuple


def _reference_one(x: torch.Tensor, heads: int, w: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor):
    rd = cos.shape[-1]
    norm = rms_norm_reference(x.view(x.shape[0], heads, -1), w, eps)     # [T, heads, dim] fp32
    n = norm.to(torch.bfloat16).float()  # the stock q_norm output (bf16) that apply_rope reads
    rotated = apply_rope(n, cos, sin)                                      # fp32 in, fp32 out
    out = torch.cat((rotated[..., :rd], norm[..., rd:]), dim=-1)
    nr = n[..., :rd]
    partner = torch.cat((nr[..., rd // 2:], nr[..., : rd // 2]), dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    zeros = torch.zeros_like(norm[..., rd:])
    rot_mag = torch.cat(((nr * c).abs() + (partner * s).abs(), zeros), dim=-1)
    pair_mag = torch.cat((nr.abs() + partner.abs(), zeros), dim=-1)
    return out, rot_mag, pair_mag


def qk_prep_reference(q, k, positions, q_norm_w, k_norm_w, inv_freq, eps, q_out=None, k_out=None, iq=None,
                      ik=None, iq_norm_w=None, ik_norm_w=None, iq_out=None, ik_out=None) -> QKPrepReference:
    """Attention.project's stock q/k path in fp32: RMSNorm per head, rounded to bf16, apply_rope with
    rope_cos_sin's cos/sin (freqs = positions.float() * inv_freq)."""
    d = q_norm_w.shape[0]
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    parts = [_reference_one(q, q.shape[1] // d, q_norm_w, eps, cos, sin),
             _reference_one(k, k.shape[1] // d, k_norm_w, eps, cos, sin)]
    if iq is not None:
        di = ik.shape[1]
        parts.append(_reference_one(iq, iq.shape[1] // di, iq_norm_w, eps, cos, sin))
        o, r, p = _reference_one(ik, 1, ik_norm_w, eps, cos, sin)
        parts.append((o[:, 0], r[:, 0], p[:, 0]))
    return QKPrepReference(tuple(p[0] for p in parts), tuple(p[1] for p in parts), tuple(p[2] for p in parts))


def qk_prep_stock(q, k, positions, q_norm_w, k_norm_w, inv_freq, eps, q_out=None, k_out=None, iq=None, ik=None,
                  iq_norm_w=None, ik_norm_w=None, iq_out=None, ik_out=None):
    ref = qk_prep_reference(q, k, positions, q_norm_w, k_norm_w, inv_freq, eps, iq=iq, ik=ik, iq_norm_w=iq_norm_w,
                            ik_norm_w=ik_norm_w)
    return tuple(o.to(torch.bfloat16) for o in ref.outs)


def compare(out, ref: QKPrepReference, case: Case) -> None:
    """Per element, |out - ref| <= 2**-7 (|ref| + rot) + 4u pair + (dim + 4) u |ref|, where rot = |n c| + |n' s|
    and pair = |n| + |n'| on rotated channels (0 elsewhere), u = 2**-24:

    * 2**-7 |ref|: the kernel rounds once to bf16 and may land on the other side of a rounding boundary;
    * 2**-7 rot: the normalised head is rounded to bf16 before RoPE (as stock); the kernel's fp32 norm differs
      from torch's by the mean's summation order and rsqrt (<= dim u relative), so near a rounding boundary
      n or its partner n' may round one bf16 ulp (<= 2**-7 |n|) the other way, moving the rotation by
      <= 2**-7 (|n c| + |n' s|);
    * 4u pair: cos/sin within 2.5 fp32 ulp of torch's (see attention/_rope.py), plus FMA contraction of n c + n' s;
    * (dim + 4) u |ref|: the norm's own fp32 differences on pass-through channels (dim u) and the rotation's
      roundings."""
    outs = tuple(o for o in out if o is not None)
    if len(outs) != len(ref.outs):
        raise AssertionError(f"attn.qk_prep: {len(outs)} outputs, the reference has {len(ref.outs)}")
    for name, o, r, rot, pair in zip(("q", "k", "iq", "ik"), outs, ref.outs, ref.rot_mag, ref.pair_mag):
        if tuple(o.shape) != tuple(r.shape):
            raise AssertionError(f"attn.qk_prep {name}: shape {tuple(o.shape)}, reference {tuple(r.shape)}")
        dim = r.shape[-1]
        band = BF16_REL * (r.abs() + rot) + 4 * FP32_U * pair + (dim + 4) * FP32_U * r.abs() + 1e-30
        assert_band(f"attn.qk_prep {name}", o, r, band)


# --- cases and cells --------------------------------------------------------------------------------------


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    hq, hk, d, di, rd = cell.shape
    theta, max_pos = cell.config["theta"], cell.config["max_position"]

    def act(width: int) -> torch.Tensor:
        if gen is None:
            return torch.ones(rows, width, dtype=torch.bfloat16, device=device)
        # projection outputs: per-head scales over three orders of magnitude
        x = torch.randn(rows, width, generator=gen) * torch.exp(2.0 * torch.randn(1, width, generator=gen))
        return x.to(device=device, dtype=torch.bfloat16)

    def weight(dim: int) -> torch.Tensor:
        if gen is None:
            return torch.zeros(dim, dtype=torch.float32, device=device)
        return (0.3 * torch.randn(dim, generator=gen)).to(device)

    if gen is None:
        pos = torch.zeros(rows, dtype=torch.int64, device=device)
    else:
        # uniform over the context plus both ends (position 0 and the largest angle)
        pos = torch.randint(0, max_pos, (rows,), generator=gen)
        pos[0] = max_pos - 1
        if rows > 1:
            pos[1] = 0
        pos = pos.to(device)
    args = (act(hq * d), act(hk * d), pos, weight(d), weight(d), rope_inv_freq(rd, theta, device), 1e-6,
            poisoned((rows, hq, d), torch.bfloat16, device), poisoned((rows, hk, d), torch.bfloat16, device))
    kwargs = {}
    if di:
        kwargs = dict(iq=act(hk * di), ik=act(di), iq_norm_w=weight(di), ik_norm_w=weight(di),
                      iq_out=poisoned((rows, hk, di), torch.bfloat16, device),
                      ik_out=poisoned((rows, di), torch.bfloat16, device))
    return Case(args=args, kwargs=kwargs, bytes_moved=rows * (hq * d + hk * d + hk * di + di) * 2 * 2)


M3 = {"theta": 5_000_000.0, "max_position": 1 << 20}
TINY = {"theta": 10_000.0, "max_position": 4096}


def _cell(hq: int, hk: int, d: int, di: int, rd: int, cfg: dict, why: str) -> Cell:
    return Cell(rows=(1, ROW_CELLS_MAX), shape=(hq, hk, d, di, rd), why=why, config=cfg)


CELLS = (
    _cell(64, 4, 128, 128, 64, M3, "M3 TP1 MSA layer: 64 q / 4 kv / 4 index-q heads + index-k, D = Di = 128, rd 64"),
    _cell(64, 4, 128, 0, 64, M3, "M3 TP1 full-attention layer"),
    _cell(32, 2, 128, 128, 64, M3, "M3 TP2 MSA layer: 32 q / 2 kv heads per rank, index-k replicated"),
    _cell(32, 2, 128, 0, 64, M3, "M3 TP2 full-attention layer"),
    _cell(4, 2, 64, 64, 32, TINY, "embedded model MSA layer: 4 q / 2 kv heads, D = Di = 64, rd 32"),
    _cell(4, 2, 64, 0, 32, TINY, "embedded model full-attention layer"),
)
INTERP_CELLS = (
    Cell(rows=(1, 2), shape=(2, 1, 16, 16, 8), config=TINY, why="interpreter: MSA layer, D = Di"),
    Cell(rows=(3, 3), shape=(3, 1, 32, 0, 16), config=M3, why="interpreter: full layer at M3 theta and positions"),
    Cell(rows=(2, 2), shape=(2, 2, 32, 16, 16), config=M3,
         why="interpreter: Di < D (index heads in a masked tail), rotary = Di"),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        case = make_case(c, c.rows[1], device, None)
        qk_prep(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- attn.rope: RoPE alone (the Eagle3 drafter's Llama attention has no per-head norms) -----------------------


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, q_out: torch.Tensor,
         k_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw call of attn.rope: q [T, Hq*D], k [T, Hk*D] (unit column stride, any row stride: views of a fused
    q|k|v GEMM) -> q_out [T, Hq, D], k_out [T, Hk, D] with rotate-half RoPE on channels < rd (2 * inv_freq's
    length), apply_rope's maths in one launch."""
    t, hq, hk, d, rd = _check_q_k(q, k, positions, inv_freq, q_out, k_out)
    if t == 0:
        return q_out, k_out
    block = triton.next_power_of_2(d)
    # the norm-weight and index pointers are never dereferenced (NORM = False, DI = 0)
    _qk_prep_kernel[(t, hq + hk)](
        q, k, q, q, positions, q, q, q, q, inv_freq, q_out, k_out, q_out, q_out, q.stride(0), k.stride(0),
        q.stride(0), q.stride(0), 1e-6, HQ=hq, HK=hk, D=d, DI=0, RD=rd, BLOCK=block,
        CUDA=is_compiled(q), NORM=False, num_warps=1 if block <= 128 else 2)
    return q_out, k_out


class RopeReference(NamedTuple):
    """fp32 rotated q, k before the bf16 cast; per element |x c| + |x' s| and |x| + |x'| (0 past rd)."""
    outs: tuple
    rot_mag: tuple
    pair_mag: tuple


def rope_reference(q, k, positions, inv_freq, q_out=None, k_out=None) -> RopeReference:
    """The Eagle3 layer's stock q/k RoPE (layers.apply_rope with rope_cos_sin's cos/sin) in fp32."""
    d = q_out.shape[-1] if q_out is not None else None
    rd = 2 * inv_freq.shape[0]
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    outs, rots, pairs = [], [], []
    for x, heads in ((q, q.shape[1] // d), (k, k.shape[1] // d)):
        xf = x.float().view(x.shape[0], heads, d)
        outs.append(apply_rope(xf, cos, sin))
        xr = xf[..., :rd]
        partner = torch.cat((xr[..., rd // 2:], xr[..., : rd // 2]), dim=-1)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        zeros = torch.zeros_like(xf[..., rd:])
        rots.append(torch.cat(((xr * c).abs() + (partner * s).abs(), zeros), dim=-1))
        pairs.append(torch.cat((xr.abs() + partner.abs(), zeros), dim=-1))
    return RopeReference(tuple(outs), tuple(rots), tuple(pairs))


def rope_stock(q, k, positions, inv_freq, q_out=None, k_out=None):
    return tuple(o.to(torch.bfloat16) for o in rope_reference(q, k, positions, inv_freq, q_out, k_out).outs)


def rope_compare(out, ref: RopeReference, case: Case) -> None:
    """Per element, |out - ref| <= 2**-7 |ref| + 4u pair + 4u |ref| (u = 2**-24): one bf16 rounding that may
    land on the other side of a boundary; cos/sin within 2.5 fp32 ulp of torch's plus the FMA contraction of
    x c + x' s (4u of |x| + |x'|); the rotation's own fp32 roundings. The inputs are bf16 values read
    exactly on both sides: nothing else differs."""
    for name, o, r, pair in zip(("q", "k"), out, ref.outs, ref.pair_mag):
        if tuple(o.shape) != tuple(r.shape):
            raise AssertionError(f"attn.rope {name}: shape {tuple(o.shape)}, reference {tuple(r.shape)}")
        band = BF16_REL * r.abs() + 4 * FP32_U * pair + 4 * FP32_U * r.abs() + 1e-30
        assert_band(f"attn.rope {name}", o, r, band)


def rope_make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    hq, hk, d, rd = cell.shape
    theta, max_pos = cell.config["theta"], cell.config["max_position"]
    width = (hq + 2 * hk) * d

    if gen is None:
        qkv = torch.ones(rows, width, dtype=torch.bfloat16, device=device)
        pos = torch.zeros(rows, dtype=torch.int64, device=device)
    else:
        # one fused q|k|v GEMM output (q and k are strided views of it), scales over three orders of magnitude
        qkv = torch.randn(rows, width, generator=gen) * torch.exp(2.0 * torch.randn(1, width, generator=gen))
        qkv = qkv.to(device=device, dtype=torch.bfloat16)
        pos = torch.randint(0, max_pos, (rows,), generator=gen)
        pos[0] = max_pos - 1
        if rows > 1:
            pos[1] = 0
        pos = pos.to(device)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]
    args = (q, k, pos, rope_inv_freq(rd, theta, device), poisoned((rows, hq, d), torch.bfloat16, device),
            poisoned((rows, hk, d), torch.bfloat16, device))
    return Case(args=args, kwargs={}, bytes_moved=rows * (hq + hk) * d * 2 * 2)


ROPE_CELLS = (
    Cell(rows=(1, ROW_CELLS_MAX), shape=(64, 4, 128, 128), config=M3,
         why="M3 Eagle3 draft layer (GQA head): 64 q / 4 kv heads, D = 128, full rotary, the target's theta"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(64, 64, 128, 128), config=M3, why="M3 Eagle3 draft layer (MHA head)"),
    Cell(rows=(1, ROW_CELLS_MAX), shape=(4, 2, 64, 64), config=TINY, why="embedded model's Eagle3 draft layer"),
)
ROPE_INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(2, 1, 16, 16), config=TINY, why="interpreter: full rotary"),
    Cell(rows=(2, 2), shape=(3, 1, 32, 16), config=M3, why="interpreter: partial rotary at M3 theta and positions"),
)


def rope_warmup(device: torch.device) -> None:
    for c in ROPE_CELLS:
        rope(*rope_make_case(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ROPE_ENTRY = Entry(
    name="attn.rope", kind="attn.rope", raw_call=rope, reference=rope_reference, compare=rope_compare,
    make_case=rope_make_case, cells=ROPE_CELLS, interp_cells=ROPE_INTERP_CELLS, warmup=rope_warmup,
    enabled=lambda: ENABLED, stock=rope_stock,
)

ENTRY = Entry(
    name="attn.qk_prep", kind="attn.qk_prep", raw_call=qk_prep, reference=qk_prep_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=qk_prep_stock,
)
ENTRIES = (ENTRY, ROPE_ENTRY)
