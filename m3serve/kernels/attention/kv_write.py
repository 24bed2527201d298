"""Catalog entry kv.write: one launch per layer quantizes every token of the step into the paged KV cache.

Bit-exact with PagedKVCache.write (m3serve/kv/cache.py): K and V of every head (and the index-K of
a sparse layer) are encoded with exactly the fp32 operations of m3serve.quant (see formats/_encode.py) and
stored at their flat slot; NVFP4 block scales go to the scale pool, K token-major (byte tok*G + g),
V in 4-token quads (byte (tok//4)*4G + 4g + tok%4). One program per token: the grid depends on T
only; nothing is allocated and nothing is read back to the host (graph capture).

Shape legend:
    T                 tokens in the step         Hk KV heads   D head dim (power of two)   Di index head dim
    k, v              [T, Hk, D]   bf16 / fp32 / fp16 activations, unit last stride
    index_k           [T, Di]      (sparse layers) or None
    slot_mapping      [T]          int64 flat slot = slot_id * P + offset; < 0 skips the token
    k_pages, v_pages  [N, Hk, P, Dc]  typed page views (slot stride = stride(0)); Dc = D/2 for nvfp4
    k_scale, v_scale  [N, Hk, P*G]    float8_e4m3fn scale pages (nvfp4 only), G = D/16
    kv_gs             [2]          fp32 NVFP4 ENCODE scales of K and V (nvfp4 only)
    index_pages       [N, P, Di]   bf16 / fp8 / ... index-K pages (sparse layers) or None
    rot_signs         [D]          fp32 +-1 signs of the K/V rotation (a rotated NVFP4 layer) or None

Rotated layers (KVCacheSpec.is_rotated): K and V are rotated in registers before the NVFP4 encode by
_hadamard.rotate_rows, the same fp32 butterfly as m3serve.kv.rotation.rotate, so the stored bytes stay
bit-exact with PagedKVCache.write. (A non-finite value spreads over its head's rotated vector; see rotation.py.)

A flat slot >= N*P cannot raise without a host sync: such a token is not written (the bounds
are the caller's, as with PagedKVCache.check_bounds = False), so a bad slot cannot corrupt memory.
NaN activations: fp8 / nvfp4 bytes are exact (torch's NaN rules are spelled out in formats/_encode.py), and
a bf16 cache fed bf16 stores the bits as given; an fp32 -> bf16/fp16 cast of a NaN stores a NaN whose
payload may differ from torch's (whose own CPU and CUDA casts differ there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16
from m3serve.kernels.formats._encode import f32_to_e4m3, nvfp4_encode
from m3serve.kernels.attention._hadamard import rotate_rows
from m3serve.kernels._jit import helper, is_compiled, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.catalog import Case, Cell, Entry, check_operand, check_shape
from m3serve.kv import codec, rotation
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.spec import FMT_TORCH_DTYPE, NVFP4_BLOCK, KVCacheSpec

ENABLED = True  # the one switch: False sends kv.write calls down the stock path (PagedKVCache.write)

# Storage format codes (a cell's shape holds them; the kernel branches on them at compile time).
FMT_CODE = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3, "nvfp4": 4}
FMT_NAME = {c: n for n, c in FMT_CODE.items()}
NO_INDEX = -1
_ACT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@helper
def _encode_plain(x, FMT: tl.constexpr, CUDA: tl.constexpr):
    """Loaded activations -> the stored element of a non-packed format (fp8 as its uint8 byte).
    The same type is stored as loaded (torch copies the bits, NaN payloads included)."""
    if FMT == 0:
        return x.to(tl.float32)
    elif FMT == 1:
        if x.dtype == tl.bfloat16:
            return x
        else:
            return to_bf16(x.to(tl.float32), CUDA)
    elif FMT == 2:
        return x.to(tl.float16)
    else:
        return f32_to_e4m3(x.to(tl.float32), CUDA)


@helper
def _write_heads(x, gs, page, head_stride, scale, scale_head_stride, off, store, HKP: tl.constexpr,
                 D: tl.constexpr, FMT: tl.constexpr, QUAD: tl.constexpr, CUDA: tl.constexpr):
    """x [HKP, D] (activation dtype) of one token -> its row of every head's page (page/scale point at the slot,
    page already at the token's row). store [HKP, 1]: valid token and real head."""
    h = tl.arange(0, HKP)[:, None]
    if FMT == 4:
        G: tl.constexpr = D // 16
        packed, sbytes = nvfp4_encode(x.to(tl.float32), gs, HKP, D, CUDA)
        tl.store(page + h * head_stride + tl.arange(0, D // 2)[None, :], packed, mask=store)
        g = tl.arange(0, G)[None, :]
        if QUAD:
            pos = (off // 4) * (4 * G) + 4 * g + off % 4
        else:
            pos = off * G + g
        tl.store(scale + h * scale_head_stride + pos, sbytes, mask=store)
    else:
        tl.store(page + h * head_stride + tl.arange(0, D)[None, :], _encode_plain(x, FMT, CUDA), mask=store)


@kernel
def _kv_write_kernel(slot_ptr, k_ptr, v_ptr, ik_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr, gs_ptr, ip_ptr, rot_ptr,
                     num_flat, stride_kt, stride_kh, stride_vt, stride_vh, stride_it,
                     kp_slot, kp_head, kp_tok, vp_slot, vp_head, vp_tok,
                     ks_slot, ks_head, vs_slot, vs_head, ip_slot, ip_tok, gs_stride,
                     HK: tl.constexpr, HKP: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, P: tl.constexpr,
                     FMT: tl.constexpr, IFMT: tl.constexpr, CUDA: tl.constexpr, ROT: tl.constexpr = False,
                     LOG2D: tl.constexpr = 0, E_W: tl.constexpr = 0, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    t = tl.program_id(0).to(tl.int64)
    flat = tl.load(slot_ptr + t)
    ok = (flat >= 0) & (flat < num_flat)
    flat = tl.where(ok, flat, 0)
    slot = flat // P
    off = flat % P
    h = tl.arange(0, HKP)[:, None]
    d = tl.arange(0, D)[None, :]
    store = ok & (h < HK)
    gs_k = 1.0
    gs_v = 1.0
    if FMT == 4:
        gs_k = tl.load(gs_ptr)
        gs_v = tl.load(gs_ptr + gs_stride)
    xk = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=h < HK, other=0.0)
    if ROT:
        signs = tl.load(rot_ptr + tl.arange(0, D))
        xk = rotate_rows(xk.to(tl.float32), signs, HKP, D, LOG2D, E_W)
    _write_heads(xk, gs_k, kp_ptr + slot * kp_slot + off * kp_tok, kp_head, ks_ptr + slot * ks_slot, ks_head,
                 off, store, HKP, D, FMT, False, CUDA)
    xv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=h < HK, other=0.0)
    if ROT:
        xv = rotate_rows(xv.to(tl.float32), signs, HKP, D, LOG2D, E_W)
    _write_heads(xv, gs_v, vp_ptr + slot * vp_slot + off * vp_tok, vp_head, vs_ptr + slot * vs_slot, vs_head,
                 off, store, HKP, D, FMT, True, CUDA)
    if IFMT >= 0:
        di = tl.arange(0, DI)
        xi = tl.load(ik_ptr + t * stride_it + di)
        tl.store(ip_ptr + slot * ip_slot + off * ip_tok + di, _encode_plain(xi, IFMT, CUDA), mask=ok)


# --- validation -------------------------------------------------------------------------------

_require, _require_shape = check_operand, check_shape


def _pow2(name: str, n: int, least: int) -> None:
    if n < least or n & (n - 1):
        raise ValueError(f"{name}: expected a power of two >= {least}, found {n}")


def kv_write(k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None, slot_mapping: torch.Tensor,
             k_pages: torch.Tensor, v_pages: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
             kv_gs: torch.Tensor | None, index_pages: torch.Tensor | None, *, fmt: str, index_fmt: str | None,
             rot_signs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Raw call: write T tokens of one layer; returns the written views
    (k_pages, v_pages, k_scale, v_scale, index_pages). rot_signs: rotate K and V first (NVFP4 only)."""
    if fmt not in FMT_CODE:
        raise ValueError(f"fmt: expected one of {tuple(FMT_CODE)}, found {fmt!r}")
    dev = slot_mapping.device if isinstance(slot_mapping, torch.Tensor) else None
    _require("slot_mapping", slot_mapping, (torch.int64,), 1, dev)
    t = slot_mapping.shape[0]
    _require("k", k, _ACT_DTYPES, 3, dev)
    hk, d = k.shape[1], k.shape[2]
    _require_shape("k", k, (t, hk, d), "[T, Hk, D]")
    _require("v", v, _ACT_DTYPES, 3, dev)
    _require_shape("v", v, (t, hk, d), "[T, Hk, D]")
    _pow2("k.shape[2] (head dim D)", d, NVFP4_BLOCK if fmt == "nvfp4" else 1)
    page_dtype = FMT_TORCH_DTYPE[fmt]
    _require("k_pages", k_pages, (page_dtype,), 4, dev)
    n, p = k_pages.shape[0], k_pages.shape[2]
    dc = d // 2 if fmt == "nvfp4" else d
    _require_shape("k_pages", k_pages, (n, hk, p, dc), "[N, Hk, P, Dc]")
    _require("v_pages", v_pages, (page_dtype,), 4, dev)
    _require_shape("v_pages", v_pages, (n, hk, p, dc), "[N, Hk, P, Dc]")
    if fmt == "nvfp4":
        if p % 4:
            raise ValueError(f"k_pages: NVFP4 V scales are stored in 4-token quads, so P must be a multiple of 4, "
                             f"found P = {p}")
        g = d // NVFP4_BLOCK
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            _require(name, s, (torch.float8_e4m3fn,), 3, dev)
            _require_shape(name, s, (n, hk, p * g), "[N, Hk, P*G]")
        _require("kv_gs", kv_gs, (torch.float32,), 1, dev)
        _require_shape("kv_gs", kv_gs, (2,), "[2] (K, V encode scales)")
    else:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale), ("kv_gs", kv_gs)):
            if s is not None:
                raise ValueError(f"{name}: only NVFP4 has block scales, expected None for fmt {fmt!r}, "
                                 f"found a {type(s).__name__}")
    if rot_signs is not None:
        if fmt != "nvfp4":
            raise ValueError(f"rot_signs: the K/V rotation applies to NVFP4 layers, found fmt {fmt!r}")
        _require("rot_signs", rot_signs, (torch.float32,), 1, dev)
        _require_shape("rot_signs", rot_signs, (d,), "[D]")
    if index_k is None:
        if index_pages is not None:
            raise ValueError("index_pages: expected None when index_k is None (dense/draft layer), found a tensor")
        ifmt, di = NO_INDEX, 1
    else:
        if index_fmt not in FMT_CODE or index_fmt == "nvfp4":
            raise ValueError(f"index_fmt: expected one of ('fp32', 'bf16', 'fp16', 'fp8') with index_k, "
                             f"found {index_fmt!r}")
        _require("index_k", index_k, _ACT_DTYPES, 2, dev)
        di = index_k.shape[1]
        _require_shape("index_k", index_k, (t, di), "[T, Di]")
        _pow2("index_k.shape[1] (Di)", di, 1)
        _require("index_pages", index_pages, (FMT_TORCH_DTYPE[index_fmt],), 3, dev)
        _require_shape("index_pages", index_pages, (n, p, di), "[N, P, Di]")
        ifmt = FMT_CODE[index_fmt]
    if t == 0:
        return k_pages, v_pages, k_scale, v_scale, index_pages

    def as_bytes(x: torch.Tensor | None) -> torch.Tensor | None:
        # fp8 is stored as its byte: the interpreter has no fp8 element type
        return x.view(torch.uint8) if x is not None and x.dtype == torch.float8_e4m3fn else x

    kp, vp, ks, vs, ip = (as_bytes(x) for x in (k_pages, v_pages, k_scale, v_scale, index_pages))
    # absent operands: any tensor of the call (the constexpr branches never touch them)
    ks = kp if ks is None else ks
    vs = vp if vs is None else vs
    gs = slot_mapping if kv_gs is None else kv_gs
    ik = k if index_k is None else index_k
    ip = kp if ip is None else ip
    rot = gs if rot_signs is None else rot_signs
    _kv_write_kernel[(t,)](
        slot_mapping, k, v, ik, kp, vp, ks, vs, gs, ip, rot, n * p,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), ik.stride(0),
        kp.stride(0), kp.stride(1), kp.stride(2), vp.stride(0), vp.stride(1), vp.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), ip.stride(0), ip.stride(1) if ip.dim() > 1 else 0,
        gs.stride(0),
        HK=hk, HKP=triton.next_power_of_2(hk), D=d, DI=di, P=p, FMT=FMT_CODE[fmt], IFMT=ifmt,
        ROT=rot_signs is not None, LOG2D=d.bit_length() - 1, E_W=rotation.scale_exponents(d)[0],
        # ~128 values per warp (at 4 warps for a [2, 128] tile ptxas keeps an unused 2-byte local depot)
        CUDA=is_compiled(k), num_warps=max(1, min(4, triton.next_power_of_2(hk) * d // 128)),
    )
    return k_pages, v_pages, k_scale, v_scale, index_pages


def write_layer(kv: PagedKVCache, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                index_k: torch.Tensor | None) -> None:
    """PagedKVCache.write(layer, slot_mapping, k, v, index_k) through the kernel: no host sync, no bounds check."""
    if not isinstance(kv, PagedKVCache):
        raise TypeError(f"kv: expected a PagedKVCache, found {type(kv).__name__}")
    kv.spec.check_layer(layer)
    fmt = kv.spec.kv_format(layer)
    sparse = kv.spec.is_sparse(layer)
    if sparse and index_k is None:
        raise ValueError(f"index_k: layer {layer} is sparse (MSA) and needs index_k [T, Di], found None")
    if not sparse and index_k is not None:
        raise ValueError(f"index_k: layer {layer} is dense/draft and has no index-K, found a tensor")
    nvfp4 = fmt == "nvfp4"
    kv_write(k, v, index_k, slot_mapping, kv.pages(layer, "k"), kv.pages(layer, "v"),
             kv.pages(layer, "k_scale") if nvfp4 else None, kv.pages(layer, "v_scale") if nvfp4 else None,
             kv.kv_global_scale[layer] if nvfp4 else None, kv.pages(layer, "index_k") if sparse else None,
             fmt=fmt, index_fmt=kv.spec.index_k_format() if sparse else None,
             rot_signs=kv.kv_rotation_signs if kv.spec.is_rotated(layer) else None)


# --- reference and compare ----------------------------------------------------------------------

def kv_write_reference(k, v, index_k, slot_mapping, k_pages=None, v_pages=None, k_scale=None, v_scale=None,
                       kv_gs=None, index_pages=None, *, fmt: str, index_fmt: str | None, rot_signs=None):
    """What every token must store, from codec.encode (PagedKVCache.write's own encoder), after
    rotation.rotate with rot_signs: (k data [T, Hk, Dc], v data, k scales [T, Hk, G] or None, v scales,
    index-K data [T, Di] or None)."""
    if rot_signs is not None:
        k, v = rotation.rotate(k, rot_signs), rotation.rotate(v, rot_signs)
    k_data, k_sc = codec.encode(fmt, k, None if kv_gs is None else kv_gs[0])
    v_data, v_sc = codec.encode(fmt, v, None if kv_gs is None else kv_gs[1])
    ik = None if index_k is None else codec.encode(index_fmt, index_k)[0]
    return k_data, v_data, k_sc, v_sc, ik


@dataclass(frozen=True)
class KVWriteCase(Case):
    """A Case whose outputs live in `cache`: the raw call writes `layer` of it in place.
    pristine_* are the pool bytes before the call (the expected pools are rebuilt from them)."""

    cache: PagedKVCache | None = None
    layer: int = 0
    pristine_data: torch.Tensor | None = None
    pristine_scales: torch.Tensor | None = None


def _expected_cache(case: KVWriteCase) -> PagedKVCache:
    """A copy of the case's pool before the call, written by PagedKVCache.write."""
    src = case.cache
    exp = PagedKVCache(src.spec, src.num_slots, src.device)
    exp.data.copy_(case.pristine_data)
    if exp.scales is not None:
        exp.scales.copy_(case.pristine_scales)
    exp.kv_global_scale.copy_(src.kv_global_scale)
    k, v, index_k, slot_mapping = case.args[:4]
    exp.write(case.layer, slot_mapping, k, v, index_k)
    return exp


def _first_diff(name: str, out: torch.Tensor, exp: torch.Tensor, slot_bytes: int) -> None:
    bad = out != exp
    if bool(bad.any()):
        flat = int(torch.nonzero(bad.reshape(-1))[0])
        raise AssertionError(f"kv.write: {name} pool differs from PagedKVCache.write in {int(bad.sum())} bytes; "
                             f"first at slot {flat // slot_bytes} byte {flat % slot_bytes}: "
                             f"{int(out.reshape(-1)[flat])} vs {int(exp.reshape(-1)[flat])}")


def compare(out, ref, case: KVWriteCase) -> None:
    """Bit-exact, by bytes: (1) every byte of the data and scale pools equals a copy of the pool
    before the call written by PagedKVCache.write (other layers, other tokens and padding
    untouched); (2) each written token's bytes equal the reference's encoding."""
    cache = case.cache
    for x in out:
        if x is not None and not (cache.data.data_ptr() <= x.data_ptr() < cache.data.data_ptr() + cache.data.numel()
                                  or (cache.scales is not None and cache.scales.data_ptr() <= x.data_ptr()
                                      < cache.scales.data_ptr() + cache.scales.numel())):
            raise AssertionError("kv.write: an output view does not alias the case's cache pools")
    exp = _expected_cache(case)
    _first_diff("data", cache.data, exp.data, cache.data.shape[1])
    if cache.scales is not None:
        _first_diff("scale", cache.scales, exp.scales, cache.scales.shape[1])
    slot_mapping = case.args[3]
    keep = slot_mapping >= 0
    slot, off = slot_mapping[keep] // cache.page_size, slot_mapping[keep] % cache.page_size
    k_data, v_data, k_sc, v_sc, ik = ref
    u8 = lambda x: x.contiguous().view(torch.uint8)  # noqa: E731
    layer = case.layer
    for role, want in (("k", k_data), ("v", v_data)):
        if not torch.equal(u8(cache.pages(layer, role)[slot, :, off]), u8(want[keep])):
            raise AssertionError(f"kv.write: {role} bytes of a written token differ from the reference encoding")
    if k_sc is not None:
        n, h, p, g = cache.num_slots, k_sc.shape[1], cache.page_size, k_sc.shape[2]
        got_k = cache.pages(layer, "k_scale").view(n, h, p, g)[slot, :, off]
        got_v = cache.pages(layer, "v_scale").view(n, h, p // 4, g, 4)[slot, :, off // 4, :, off % 4]
        if not (torch.equal(u8(got_k), u8(k_sc[keep])) and torch.equal(u8(got_v), u8(v_sc[keep]))):
            raise AssertionError("kv.write: scale bytes of a written token differ from the reference encoding")
    if ik is not None and not torch.equal(u8(cache.pages(layer, "index_k")[slot, off]), u8(ik[keep])):
        raise AssertionError("kv.write: index-K bytes of a written token differ from the reference encoding")


# --- cases and cells ----------------------------------------------------------------------------

def _cache_for(shape: tuple[int, ...], num_slots: int, device: torch.device, rotate: bool = False
               ) -> tuple[PagedKVCache, int]:
    """A two-layer cache whose layer 0 has the cell's format; layer 1 is the other kind, so every
    slot also holds sub-pages (and, in the hybrid cache, scales) the call must leave alone."""
    hk, d, p, di, fmt_code, ifmt_code = shape
    fmt = FMT_NAME[fmt_code]
    sparse0 = ifmt_code != NO_INDEX
    index_dtype = FMT_NAME[ifmt_code] if sparse0 else "bf16"
    if fmt == "nvfp4":
        kv_dtype, model = "nvfp4", torch.bfloat16
    elif fmt == "fp8":
        # dense fp8 = the hybrid cache's dense/draft layer (its sparse neighbour is nvfp4)
        kv_dtype, model = ("fp8" if sparse0 else "nvfp4"), torch.bfloat16
    elif fmt == "bf16":
        kv_dtype, model = "bf16", torch.bfloat16
    else:
        kv_dtype, model = "auto", {"fp32": torch.float32, "fp16": torch.float16}[fmt]
    if index_dtype in ("fp32", "fp16"):
        index_dtype = "auto"  # index-K in the model dtype
    spec = KVCacheSpec(page_size=p, num_layers=2, sparse_layers=(0,) if sparse0 else (1,), num_kv_heads=hk,
                       head_dim=d, index_head_dim=di if di else d, kv_cache_dtype=kv_dtype, index_k_dtype=index_dtype,
                       model_dtype=model, kv_rotation_seed=rotation.DEFAULT_ROTATION_SEED if rotate else None)
    cache = PagedKVCache(spec, num_slots, device)
    cache.check_bounds = False
    if cache.spec.kv_format(0) != fmt or (sparse0 and cache.spec.index_k_format() != FMT_NAME[ifmt_code]):
        raise AssertionError(f"kv.write cell {shape}: layer 0 is {cache.spec.kv_format(0)} / index "
                             f"{cache.spec.index_k_format()}, not the cell's formats")
    return cache, 0


def _nvfp4_tie_values(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Blocks of 16 whose E2M1 inputs (x * gs / block_scale with gs = 1) land exactly on the
    rounding midpoints and grid points: each block holds +-6 * 2**e (so its scale is 2**e)."""
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    vals = pts[torch.randint(0, len(pts), shape, generator=gen)]
    vals = vals * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    blocks = vals.view(*shape[:-1], shape[-1] // 16, 16)
    blocks[..., 0] = 6.0
    e = torch.randint(-6, 4, (*shape[:-1], shape[-1] // 16, 1), generator=gen).float()
    return (blocks * torch.exp2(e)).view(shape)


def _activations(t: int, hk: int, d: int, gen: torch.Generator, ties: bool, finite: bool = False) -> torch.Tensor:
    """K/V-like bf16 tokens: unit-RMS rows with outlier channels, zero / -0 / tiny / huge / inf blocks (finite:
    no inf, which a rotation turns into NaNs whose sign bit CPU and GPU arithmetic set differently),
    and (ties) exact E2M1 midpoints."""
    x = torch.randn(t, hk, d, generator=gen) * torch.exp2(torch.randint(-3, 4, (t, hk, 1), generator=gen).float())
    x[torch.rand(t, hk, d, generator=gen) < 0.02] *= 40.0
    if t >= 2:
        x[0, 0, :16] = 0.0
        x[0, 0, 16:32] = -0.0 if d >= 32 else x[0, 0, 16:32]
        x[1, -1, :16] *= 1e-6
        x[1, -1, -16:] *= 1e4
    if t >= 3 and not finite:
        x[2, 0, 3] = float("inf")
        x[2, -1, 5] = float("-inf")
    if ties:
        sel = torch.rand(t, generator=gen) < 0.5
        x[sel] = _nvfp4_tie_values((int(sel.sum()), hk, d), gen)
    return x.to(torch.bfloat16)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> KVWriteCase:
    hk, d, p, di, fmt_code, ifmt_code = cell.shape
    num_slots = cell.config.get("slots") or max(3, -(-3 * rows // (2 * p)) + 1)
    rotate = bool(cell.config.get("rotate"))
    cache, layer = _cache_for(cell.shape, num_slots, device, rotate)
    g = gen if gen is not None else torch.Generator().manual_seed(0)
    if gen is not None:
        cache.data.copy_(torch.randint(0, 256, cache.data.shape, generator=g, dtype=torch.uint8))
        if cache.scales is not None:
            cache.scales.copy_(torch.randint(0, 256, cache.scales.shape, generator=g, dtype=torch.uint8))
    ties = False
    if FMT_NAME[fmt_code] == "nvfp4":
        # amax 2688 gives gs = 448*6/2688 = 1 exactly (the midpoint tokens are exact); else a random calibration
        k_amax = 2688.0 if gen is None or float(torch.rand(1, generator=g)) < 0.5 else 8.0 + 56.0 * float(
            torch.rand(1, generator=g))
        v_amax = 2688.0 if k_amax == 2688.0 else 8.0 + 56.0 * float(torch.rand(1, generator=g))
        cache.set_nvfp4_amax(layer, k_amax, v_amax)
        ties = k_amax == 2688.0
    flat = torch.randperm(num_slots * p, generator=g)[:rows]
    flat[torch.rand(rows, generator=g) < 0.15] = -1
    slot_mapping = flat.to(device)
    k = _activations(rows, hk, d, g, ties, rotate).to(device)
    v = _activations(rows, hk, d, g, ties, rotate).to(device)
    index_k = None if ifmt_code == NO_INDEX else (3.0 * torch.randn(rows, di, generator=g)).to(torch.bfloat16).to(device)
    fmt = FMT_NAME[fmt_code]
    nvfp4 = fmt == "nvfp4"
    sparse = ifmt_code != NO_INDEX
    args = (k, v, index_k, slot_mapping, cache.pages(layer, "k"), cache.pages(layer, "v"),
            cache.pages(layer, "k_scale") if nvfp4 else None, cache.pages(layer, "v_scale") if nvfp4 else None,
            cache.kv_global_scale[layer] if nvfp4 else None, cache.pages(layer, "index_k") if sparse else None)
    kwargs = {"fmt": fmt, "index_fmt": cache.spec.index_k_format() if sparse else None}
    if rotate:
        kwargs["rot_signs"] = cache.kv_rotation_signs
    # bytes one call moves: bf16 activations in, encoded tokens (and scales) out
    dc_bytes = d // 2 if nvfp4 else d * FMT_TORCH_DTYPE[fmt].itemsize
    tok_bytes = 2 * hk * d * 2 + 2 * hk * dc_bytes + (2 * hk * (d // NVFP4_BLOCK) if nvfp4 else 0)
    if sparse:
        tok_bytes += di * (2 + FMT_TORCH_DTYPE[kwargs["index_fmt"]].itemsize)
    return KVWriteCase(args=args, kwargs=kwargs, bytes_moved=rows * tok_bytes, cache=cache, layer=layer,
                       pristine_data=cache.data.clone(),
                       pristine_scales=None if cache.scales is None else cache.scales.clone())


# Geometries: (Hk, D, P, Di, name)
_GEOMS = ((4, 128, 128, 128, "M3 TP1"), (2, 128, 128, 128, "M3 TP2"), (2, 64, 32, 64, "embedded m3-tiny-verse"))
# (fmt, index fmt or None, why)
_FORMATS = (
    ("nvfp4", "bf16", "sparse layer of the hybrid nvfp4 cache (NVFP4 K/V + scales, bf16 index-K)"),
    ("nvfp4", "fp8", "sparse layer of the hybrid nvfp4 cache with --index-k-dtype fp8"),
    ("fp8", None, "dense or draft layer of the hybrid nvfp4 cache / fp8 cache"),
    ("fp8", "bf16", "sparse layer of the fp8 cache"),
    ("bf16", "bf16", "sparse layer of the bf16 cache"),
    ("bf16", None, "dense or draft layer of the bf16 cache"),
)
_ROWS = (((1, 48), "decode / speculative verify"), ((49, 8192), "prefill chunk"))

CELLS = tuple(
    Cell(rows=rows, shape=(hk, d, p, di if ifmt else 0, FMT_CODE[fmt], FMT_CODE[ifmt] if ifmt else NO_INDEX),
         config={"rotate": True} if rot else {},
         why=f"{gname}: {why}{', K/V Hadamard-rotated' if rot else ''}; {rwhy} "
             f"(one program per token: one compiled variant for every T)")
    for hk, d, p, di, gname in _GEOMS for fmt, ifmt, why in _FORMATS for rows, rwhy in _ROWS
    for rot in ((False, True) if fmt == "nvfp4" else (False,))
)
INTERP_CELLS = (
    # one slot: the page views are contiguous, so the generic corruption test can flatten them
    Cell(rows=(5, 6), shape=(2, 32, 8, 16, FMT_CODE["nvfp4"], FMT_CODE["bf16"]), config={"slots": 1},
         why="interpreter: nvfp4 K/V + scales + bf16 index-K, one-page pool"),
    Cell(rows=(1, 4), shape=(2, 32, 8, 16, FMT_CODE["nvfp4"], FMT_CODE["fp8"]),
         why="interpreter: nvfp4 + fp8 index-K, several slots (slot stride)"),
    Cell(rows=(7, 7), shape=(3, 16, 4, 0, FMT_CODE["fp8"], NO_INDEX), why="interpreter: fp8 dense, 3 heads (masked)"),
    Cell(rows=(6, 6), shape=(2, 16, 4, 16, FMT_CODE["bf16"], FMT_CODE["bf16"]), why="interpreter: bf16 + index"),
    Cell(rows=(5, 5), shape=(1, 16, 4, 16, FMT_CODE["fp32"], FMT_CODE["fp32"]), why="interpreter: fp32 cache"),
    Cell(rows=(5, 5), shape=(2, 16, 4, 0, FMT_CODE["fp16"], NO_INDEX), why="interpreter: fp16 cache"),
    Cell(rows=(5, 6), shape=(2, 64, 8, 16, FMT_CODE["nvfp4"], FMT_CODE["bf16"]), config={"rotate": True},
         why="interpreter: Hadamard-rotated nvfp4 K/V (D 64, the embedded model's head dim), several slots"),
    Cell(rows=(3, 3), shape=(3, 128, 8, 16, FMT_CODE["nvfp4"], FMT_CODE["fp8"]), config={"rotate": True},
         why="interpreter: Hadamard-rotated nvfp4 K/V at M3's D 128 (c_w = 1/8), 3 heads (masked), fp8 index-K"),
)


def warmup(device: torch.device) -> None:
    seen = set()
    for c in CELLS:
        if c.shape in seen:  # the row range does not change the compiled variant
            continue
        seen.add(c.shape)
        case = make_case(c, c.rows[0], device, None)
        kv_write(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_write_stock(k, v, index_k, slot_mapping, k_pages, v_pages, k_scale, v_scale, kv_gs, index_pages, *, fmt,
                   index_fmt, rot_signs=None):
    """The unfused torch path: encode with codec and scatter (PagedKVCache.write without its checks)."""
    k_data, v_data, k_sc, v_sc, ik = kv_write_reference(k, v, index_k, slot_mapping, fmt=fmt, index_fmt=index_fmt,
                                                        kv_gs=kv_gs, rot_signs=rot_signs)
    keep = slot_mapping >= 0
    p = k_pages.shape[2]
    slot, off = slot_mapping[keep] // p, slot_mapping[keep] % p
    k_pages[slot, :, off] = k_data[keep]
    v_pages[slot, :, off] = v_data[keep]
    if k_sc is not None:
        n, h, g = k_pages.shape[0], k_pages.shape[1], k_sc.shape[2]
        k_scale.view(n, h, p, g)[slot, :, off] = k_sc[keep]
        v_scale.view(n, h, p // 4, g, 4)[slot, :, off // 4, :, off % 4] = v_sc[keep]
    if ik is not None:
        index_pages[slot, off] = ik[keep]
    return k_pages, v_pages, k_scale, v_scale, index_pages


ENTRY = Entry(
    name="kv.write", kind="kv.write", raw_call=kv_write, reference=kv_write_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=kv_write_stock,
)
ENTRIES = (ENTRY,)
