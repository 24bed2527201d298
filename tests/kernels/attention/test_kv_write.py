"""kv.write: the in-register encoders and the fused KV write, bit-exact with PagedKVCache.write.

CPU tests run the kernels under the Triton interpreter on tiny shapes; the `gpu` tests run the
compiled kernels (hardware E4M3 conversion, fp64 reciprocal division) over every certified cell.
Every comparison is by bytes: there is no tolerance, the contract is bit-exactness.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from m3serve.kernels.attention import kv_write as kw
from m3serve.kernels.formats._encode import div_by_small, f32_to_e4m3, nvfp4_encode, rcp64
from m3serve.kernels._jit import is_compiled, kernel
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.spec import KVCacheSpec
from m3serve.quant.fp8 import cast_to_fp8
from m3serve.quant.nvfp4 import quantize_nvfp4

CPU = torch.device("cpu")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- probes ---------------------------------------------------------------------------------------

@kernel
def _probe_e4m3(x_ptr, o_ptr, N, B: tl.constexpr, CUDA: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    m = offs < N
    tl.store(o_ptr + offs, f32_to_e4m3(tl.load(x_ptr + offs, mask=m, other=0.0), CUDA), mask=m)


@kernel
def _probe_quotient(y_ptr, d_ptr, o_ptr, N, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    m = offs < N
    y = tl.load(y_ptr + offs, mask=m, other=1.0)
    d = tl.load(d_ptr + offs, mask=m, other=1.0)
    tl.store(o_ptr + offs, div_by_small(y, d, rcp64(d)), mask=m)


@kernel
def _probe_nvfp4(x_ptr, gs_ptr, p_ptr, s_ptr, R: tl.constexpr, D: tl.constexpr, CUDA: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    x = tl.load(x_ptr + r * D + tl.arange(0, D)[None, :])
    packed, sbytes = nvfp4_encode(x, tl.load(gs_ptr), R, D, CUDA)
    tl.store(p_ptr + r * (D // 2) + tl.arange(0, D // 2)[None, :], packed)
    tl.store(s_ptr + r * (D // 16) + tl.arange(0, D // 16)[None, :], sbytes)


def e4m3_inputs() -> torch.Tensor:
    """Every E4M3 value, the midpoints between neighbours and one fp32 ulp either side, the
    saturation edge, +-inf, signed NaN, +-0, fp32 subnormals, and every finite bf16 value."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)), grid,
                      torch.tensor([448.0, 464.0, 463.99, 480.0, 1e30, 2.0**-10, 2.0**-10 * 1.0001, 1e-45, 1e-40])])
    bf16 = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    special = torch.tensor([float("inf"), 0.0, float("nan")])
    x = torch.cat([near, -near, bf16, special, -special])
    return x


def nvfp4_rows(gen: torch.Generator, rows: int, d: int) -> torch.Tensor:
    """Rows of 16-blocks: random scales over 20 octaves, exact E2M1 midpoints, zeros, -0, inf, NaN."""
    x = torch.randn(rows, d, generator=gen) * torch.exp2(torch.randint(-12, 12, (rows, d // 16), generator=gen)
                                                         .float()).repeat_interleave(16, dim=1)
    x[: rows // 2] = kw._nvfp4_tie_values((rows // 2, d), gen)
    x[-1, :16] = 0.0
    x[-1, 16:32] = -0.0
    x[-2, 3] = float("inf")
    x[-2, 20] = float("-inf")
    x[-3, 7] = float("nan")
    return x


# --- encoders (interpreter) -----------------------------------------------------------------------

def _e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _probe_e4m3[(triton_cdiv(x.numel(), 1024),)](x, out, x.numel(), B=1024, CUDA=is_compiled(x))
    return out


def test_f32_to_e4m3_is_cast_to_fp8() -> None:
    x = e4m3_inputs()
    got = _e4m3_bytes(x)
    want = cast_to_fp8(x).view(torch.uint8)
    bad = got != want
    assert not bool(bad.any()), f"{int(bad.sum())} bytes differ, e.g. x={x[bad][:4].tolist()}: " \
                                f"{got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"


def _quotients(device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every positive finite E4M3 value as divisor against random fp32 dividends (all exponents,
    incl. subnormal quotients and overflow) and dividends that are exact multiples."""
    d = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    bits = torch.randint(0, 2**31 - 2**23, (4000,), generator=gen, dtype=torch.int64).to(torch.int32)
    y = bits.view(torch.float32)
    y = torch.cat([y, -y[:500], (torch.randint(1, 2**24, (500,), generator=gen) * 2.0**-20)])
    yy = y.repeat_interleave(d.numel())
    dd = d.repeat(y.numel())
    # quotients exactly on a midpoint of the subnormal grid: y = d * (2j+1) * 2**-150, where y is an fp32
    odd = (2 * torch.randint(0, 2**16, (d.numel() * 40,), generator=gen) + 1).double()
    dt = d.double().repeat(40)
    ties = dt * odd * 2.0**-150
    exact = ties.float().double() == ties
    ties = torch.cat([ties[exact], -ties[exact]]).float()
    yy = torch.cat([ties, yy])
    dd = torch.cat([dt[exact], dt[exact]]).float().tolist() + dd.tolist()
    return yy.to(device), torch.tensor(dd, dtype=torch.float32, device=device)


def test_div_by_small_is_correctly_rounded() -> None:
    """The module's claim: div_by_small(y, d) == y / d (IEEE, incl. subnormal ties) for every E4M3 divisor."""
    y, d = _quotients(CPU, torch.Generator().manual_seed(3))
    y, d = y[:80000], d[:80000]
    assert bool(((y / d).abs() < 2.0**-126).sum() > 1000), "the subnormal ties must be in the sample"
    out = torch.empty_like(y)
    _probe_quotient[(triton_cdiv(y.numel(), 4096),)](y, d, out, y.numel(), B=4096)
    want = y / d
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("gs", [1.0, 41.99, 2688.0 / 17.3, 1e-3])
def test_nvfp4_encode_is_quantize_nvfp4(gs: float) -> None:
    gen = torch.Generator().manual_seed(int(gs * 100))
    x = nvfp4_rows(gen, 8, 64)
    g = torch.tensor([gs], dtype=torch.float32)
    packed = torch.empty(8, 32, dtype=torch.uint8)
    scale = torch.empty(8, 4, dtype=torch.uint8)
    _probe_nvfp4[(1,)](x, g, packed, scale, R=8, D=64, CUDA=False)
    want_p, want_s = quantize_nvfp4(x, g[0])
    assert torch.equal(scale, want_s.view(torch.uint8))
    assert torch.equal(packed, want_p)


# --- the write (interpreter) ----------------------------------------------------------------------

def _spec(kv_dtype: str, index_dtype: str = "bf16", model=torch.bfloat16, hk: int = 2, d: int = 32, p: int = 8,
          draft_heads: int | None = 3) -> KVCacheSpec:
    return KVCacheSpec(page_size=p, num_layers=3, sparse_layers=(0, 2), num_kv_heads=hk, head_dim=d,
                       index_head_dim=16, kv_cache_dtype=kv_dtype, index_k_dtype=index_dtype, model_dtype=model,
                       num_draft_layers=1, draft_num_kv_heads=draft_heads)


def _random_cache(spec: KVCacheSpec, num_slots: int, gen: torch.Generator) -> tuple[PagedKVCache, PagedKVCache]:
    a = PagedKVCache(spec, num_slots, CPU)
    a.data.copy_(torch.randint(0, 256, a.data.shape, generator=gen, dtype=torch.uint8))
    if a.scales is not None:
        a.scales.copy_(torch.randint(0, 256, a.scales.shape, generator=gen, dtype=torch.uint8))
    for layer in range(spec.num_attention_layers):
        if spec.kv_format(layer) == "nvfp4":
            a.set_nvfp4_amax(layer, float(4 + 60 * torch.rand(1, generator=gen)), 2688.0)
    b = PagedKVCache(spec, num_slots, CPU)
    b.data.copy_(a.data)
    if a.scales is not None:
        b.scales.copy_(a.scales)
    b.kv_global_scale.copy_(a.kv_global_scale)
    return a, b


def _assert_same_pools(a: PagedKVCache, b: PagedKVCache) -> None:
    assert torch.equal(a.data, b.data), f"data pools differ in {int((a.data != b.data).sum())} bytes"
    if a.scales is not None:
        assert torch.equal(a.scales, b.scales), f"scale pools differ in {int((a.scales != b.scales).sum())} bytes"


@pytest.mark.parametrize("kv_dtype,index_dtype,model,act", [
    ("nvfp4", "bf16", torch.bfloat16, torch.bfloat16),
    ("nvfp4", "fp8", torch.bfloat16, torch.float32),
    ("fp8", "auto", torch.bfloat16, torch.bfloat16),
    ("bf16", "fp8", torch.bfloat16, torch.float32),
    ("auto", "auto", torch.float16, torch.float16),
    ("auto", "auto", torch.float32, torch.float32),
])
def test_write_layer_equals_paged_cache_write(kv_dtype: str, index_dtype: str, model: torch.dtype,
                                              act: torch.dtype) -> None:
    """Every layer kind of the spec (sparse, dense, the draft layer with its own head count):
    write_layer on one copy of a random pool, PagedKVCache.write on the other, same bytes."""
    gen = torch.Generator().manual_seed(hash((kv_dtype, index_dtype, str(model))) & 0xFFFF)
    spec = _spec(kv_dtype, index_dtype, model)
    a, b = _random_cache(spec, 5, gen)
    t = 9
    for layer in range(spec.num_attention_layers):
        hk = spec.kv_heads(layer)
        flat = torch.randperm(5 * spec.page_size, generator=gen)[:t]
        flat[[2, 6]] = -1
        k = kw._activations(t, hk, spec.head_dim, gen, ties=True).to(act)
        v = kw._activations(t, hk, spec.head_dim, gen, ties=False).to(act)
        ik = (2.0 * torch.randn(t, spec.index_head_dim, generator=gen)).to(act) if spec.is_sparse(layer) else None
        kw.write_layer(a, layer, flat, k, v, ik)
        b.write(layer, flat, k, v, ik)
        _assert_same_pools(a, b)


@pytest.mark.parametrize("d,hk", [(64, 2), (128, 3)])
def test_rotated_write_layer_equals_paged_cache_write(d: int, hk: int) -> None:
    """A Hadamard-rotated hybrid cache (the embedded model's D 64, M3's D 128 with its non-orthonormal 1/8
    write factor, a masked third head): write_layer rotates in registers exactly as PagedKVCache.write does
    (bytes equal), and the rotation really happened (the bytes differ from the unrotated encoding)."""
    gen = torch.Generator().manual_seed(d + hk)
    spec = KVCacheSpec(page_size=8, num_layers=2, sparse_layers=(0,), num_kv_heads=hk, head_dim=d,
                       index_head_dim=16, kv_cache_dtype="nvfp4", model_dtype=torch.bfloat16, kv_rotation_seed=5)
    a, b = _random_cache(spec, 4, gen)
    flat = torch.randperm(32, generator=gen)[:11]
    flat[3] = -1
    k = kw._activations(11, hk, d, gen, ties=False, finite=True)
    v = kw._activations(11, hk, d, gen, ties=True, finite=True)
    ik = torch.randn(11, 16, generator=gen).to(torch.bfloat16)
    kw.write_layer(a, 0, flat, k, v, ik)
    b.write(0, flat, k, v, ik)
    _assert_same_pools(a, b)
    plain = KVCacheSpec(page_size=8, num_layers=2, sparse_layers=(0,), num_kv_heads=hk, head_dim=d,
                        index_head_dim=16, kv_cache_dtype="nvfp4", model_dtype=torch.bfloat16)
    c = PagedKVCache(plain, 4, CPU)
    c.data.copy_(b.data)
    c.kv_global_scale.copy_(b.kv_global_scale)
    c.write(0, flat, k, v, ik)
    assert not torch.equal(c.pages(0, "k"), a.pages(0, "k")), "the rotated write stored the unrotated bytes"


def test_rot_signs_are_checked() -> None:
    spec = _spec("nvfp4")
    a, _ = _random_cache(spec, 2, torch.Generator().manual_seed(1))
    k = torch.randn(2, 2, 32).to(torch.bfloat16)
    args = (k, k, torch.randn(2, 16).to(torch.bfloat16), torch.tensor([0, 1]), a.pages(0, "k"), a.pages(0, "v"),
            a.pages(0, "k_scale"), a.pages(0, "v_scale"), a.kv_global_scale[0], a.pages(0, "index_k"))
    with pytest.raises(ValueError, match="rot_signs"):
        kw.kv_write(*args, fmt="nvfp4", index_fmt="bf16", rot_signs=torch.ones(16))
    with pytest.raises(TypeError, match="rot_signs"):
        kw.kv_write(*args, fmt="nvfp4", index_fmt="bf16", rot_signs=torch.ones(32, dtype=torch.float64))


def test_strided_activations_and_out_of_range_slot() -> None:
    """k/v as head-strided views of a wider buffer; a flat slot >= N*P is not written (no device raise)."""
    gen = torch.Generator().manual_seed(5)
    spec = _spec("nvfp4")
    a, b = _random_cache(spec, 3, gen)
    wide = torch.randn(4, 2, 3 * 32, generator=gen).to(torch.bfloat16)
    k, v = wide[:, :, :32], wide[:, :, 64:]
    ik = torch.randn(4, 16, generator=gen).to(torch.bfloat16)
    flat = torch.tensor([3, 3 * 8, 17, -5])  # 24 = N*P: out of range
    kw.write_layer(a, 0, flat, k, v, ik)
    keep = torch.tensor([True, False, True, False])
    b.write(0, flat[keep], k[keep], v[keep], ik[keep])
    _assert_same_pools(a, b)


def _with_nans(x: torch.Tensor) -> torch.Tensor:
    """+NaN, -NaN and a bf16 NaN with a payload in three blocks of token 0."""
    x = x.clone()
    x[0, 0, 1] = float("nan")
    x[0, 0, -1] = -float("nan")
    x.view(torch.int16)[0, -1, 2] = -63  # 0xFFC1
    return x


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8", "bf16"])
def test_nan_activations_are_stored_as_paged_cache_write_stores_them(kv_dtype: str) -> None:
    gen = torch.Generator().manual_seed(13)
    spec = _spec(kv_dtype)
    a, b = _random_cache(spec, 2, gen)
    flat = torch.tensor([3, 9, 12])
    k = _with_nans(kw._activations(3, 2, 32, gen, ties=False))
    v = _with_nans(kw._activations(3, 2, 32, gen, ties=False))
    ik = _with_nans(torch.randn(3, 1, 16, generator=gen).to(torch.bfloat16))[:, 0]
    kw.write_layer(a, 0, flat, k, v, ik)
    b.write(0, flat, k, v, ik)
    _assert_same_pools(a, b)


def test_empty_step_writes_nothing() -> None:
    a, b = _random_cache(_spec("fp8"), 2, torch.Generator().manual_seed(9))
    kw.write_layer(a, 1, torch.empty(0, dtype=torch.int64), torch.empty(0, 2, 32), torch.empty(0, 2, 32), None)
    _assert_same_pools(a, b)


def test_compare_rejects_a_stray_byte_elsewhere_in_the_pool() -> None:
    """The entry's compare covers the whole pool: a byte of another layer changed must fail, as must a
    missed token; the untouched case passes."""
    e = kw.ENTRY
    cell = e.interp_cells[1]
    for corrupt in ("none", "other_layer", "scale", "token"):
        case = e.make_case(cell, 4, CPU, torch.Generator().manual_seed(21))
        out = e.raw_call(*case.args, **case.kwargs)
        ref = e.reference(*case.args, **case.kwargs)
        cache = case.cache
        if corrupt == "other_layer":
            cache.pages(1, "k").view(torch.uint8)[0, 0, 0, 0] += 1
        elif corrupt == "scale":
            cache.pages(0, "v_scale").view(torch.uint8)[0, 0, 0] += 1
        elif corrupt == "token":
            sm = case.args[3]
            t = int(torch.nonzero(sm >= 0)[0])
            slot, off = int(sm[t]) // cache.page_size, int(sm[t]) % cache.page_size
            kp = cache.pages(0, "k")
            kp[slot, :, off] = kp[slot, :, off] ^ 0x11
        if corrupt == "none":
            e.compare(out, ref, case)
        else:
            with pytest.raises(AssertionError):
                e.compare(out, ref, case)


# --- validation -----------------------------------------------------------------------------------

def _args():
    case = kw.ENTRY.make_case(kw.INTERP_CELLS[1], 2, CPU, torch.Generator().manual_seed(1))
    return list(case.args), dict(case.kwargs)


@pytest.mark.parametrize("mutate,exc,needle", [
    (lambda a, k: a.__setitem__(0, a[0].to(torch.int32)), TypeError, "k:"),
    (lambda a, k: a.__setitem__(1, a[1][:, :1]), ValueError, "v:"),
    (lambda a, k: a.__setitem__(3, a[3].int()), TypeError, "slot_mapping"),
    (lambda a, k: a.__setitem__(4, a[4].view(torch.int8)), TypeError, "k_pages"),
    (lambda a, k: a.__setitem__(6, None), TypeError, "k_scale"),
    (lambda a, k: a.__setitem__(8, a[8][:1]), ValueError, "kv_gs"),
    (lambda a, k: a.__setitem__(9, None), TypeError, "index_pages"),
    (lambda a, k: a.__setitem__(2, None), ValueError, "index_pages"),
    (lambda a, k: k.__setitem__("fmt", "fp4"), ValueError, "fmt"),
    (lambda a, k: k.__setitem__("index_fmt", None), ValueError, "index_fmt"),
])
def test_bad_arguments_raise_naming_the_tensor(mutate, exc, needle: str) -> None:
    args, kwargs = _args()
    mutate(args, kwargs)
    with pytest.raises(exc, match=needle):
        kw.kv_write(*args, **kwargs)


def test_scales_for_a_plain_format_raise() -> None:
    case = kw.ENTRY.make_case(kw.INTERP_CELLS[2], 7, CPU, torch.Generator().manual_seed(1))
    args = list(case.args)
    args[8] = torch.ones(2)
    with pytest.raises(ValueError, match="kv_gs"):
        kw.kv_write(*args, **case.kwargs)


def test_write_layer_checks_index_k_against_the_layer_kind() -> None:
    a, _ = _random_cache(_spec("nvfp4"), 2, torch.Generator().manual_seed(2))
    sm = torch.tensor([0, 1])
    k = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="index_k"):
        kw.write_layer(a, 0, sm, k, k, None)
    with pytest.raises(ValueError, match="index_k"):
        kw.write_layer(a, 1, sm, k, k, torch.randn(2, 16))


# --- GPU ------------------------------------------------------------------------------------------

def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.gpu
def test_compiled_e4m3_and_division_are_exact() -> None:
    dev = _dev()
    x = e4m3_inputs().to(dev)
    assert torch.equal(_e4m3_bytes(x), cast_to_fp8(x).view(torch.uint8))
    y, d = _quotients(dev, torch.Generator().manual_seed(4))
    out = torch.empty_like(y)
    _probe_quotient[(triton_cdiv(y.numel(), 4096),)](y, d, out, y.numel(), B=4096)
    assert torch.equal(out.view(torch.int32), (y / d).view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("gs", [1.0, 41.99, 1e-3, 3e4])
def test_compiled_nvfp4_encode_is_exact(gs: float) -> None:
    dev = _dev()
    x = nvfp4_rows(torch.Generator().manual_seed(7), 64, 128).to(dev)
    g = torch.tensor([gs], dtype=torch.float32, device=dev)
    packed = torch.empty(64, 64, dtype=torch.uint8, device=dev)
    scale = torch.empty(64, 8, dtype=torch.uint8, device=dev)
    _probe_nvfp4[(1,)](x, g, packed, scale, R=64, D=128, CUDA=True)
    want_p, want_s = quantize_nvfp4(x, g[0])
    assert torch.equal(scale, want_s.view(torch.uint8))
    assert torch.equal(packed, want_p)


GPU_ROWS = {(1, 48): (1, 3, 17, 48), (49, 8192): (49, 1000, 8192)}


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(kw.CELLS)), ids=[str(c.shape) + f"-r{c.rows[1]}" for c in kw.CELLS])
def test_every_cell_on_the_gpu(i: int) -> None:
    dev = _dev()
    cell = kw.CELLS[i]
    for rows in GPU_ROWS[cell.rows]:
        case = kw.make_case(cell, rows, dev, torch.Generator().manual_seed(rows + 31 * i))
        out = kw.kv_write(*case.args, **case.kwargs)
        ref = kw.kv_write_reference(*case.args, **case.kwargs)
        kw.compare(out, ref, case)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8", "bf16"])
def test_write_layer_on_the_gpu(kv_dtype: str) -> None:
    dev = _dev()
    gen = torch.Generator().manual_seed(11)
    spec = KVCacheSpec(page_size=128, num_layers=2, sparse_layers=(0,), num_kv_heads=4, head_dim=128,
                       index_head_dim=128, kv_cache_dtype=kv_dtype, model_dtype=torch.bfloat16, num_draft_layers=1)
    a, b = PagedKVCache(spec, 40, dev), PagedKVCache(spec, 40, dev)
    noise = torch.randint(0, 256, a.data.shape, generator=gen, dtype=torch.uint8).to(dev)
    a.data.copy_(noise)
    b.data.copy_(noise)
    for layer in range(spec.num_attention_layers):
        flat = torch.randperm(40 * 128, generator=gen)[:300].to(dev)
        k = _with_nans(kw._activations(300, 4, 128, gen, ties=True)).to(dev)
        v = _with_nans(kw._activations(300, 4, 128, gen, ties=False)).to(dev)
        ik = torch.randn(300, 128, generator=gen).to(torch.bfloat16).to(dev) if spec.is_sparse(layer) else None
        kw.write_layer(a, layer, flat, k, v, ik)
        b.write(layer, flat, k, v, ik)
    torch.cuda.synchronize()
    _assert_same_pools(a, b)


@pytest.mark.gpu
def test_rotated_write_layer_on_the_gpu() -> None:
    """M3's geometry (Hk 4, D 128, P 128), Hadamard-rotated NVFP4: the compiled butterfly is bit-exact too."""
    dev = _dev()
    gen = torch.Generator().manual_seed(17)
    spec = KVCacheSpec(page_size=128, num_layers=2, sparse_layers=(0,), num_kv_heads=4, head_dim=128,
                       index_head_dim=128, kv_cache_dtype="nvfp4", model_dtype=torch.bfloat16, kv_rotation_seed=31)
    a, b = PagedKVCache(spec, 40, dev), PagedKVCache(spec, 40, dev)
    noise = torch.randint(0, 256, a.data.shape, generator=gen, dtype=torch.uint8).to(dev)
    a.data.copy_(noise)
    b.data.copy_(noise)
    for cache in (a, b):
        cache.set_nvfp4_amax(0, 9.0, 13.0)
    flat = torch.randperm(40 * 128, generator=gen)[:700].to(dev)
    k = kw._activations(700, 4, 128, gen, ties=True, finite=True).to(dev)
    v = kw._activations(700, 4, 128, gen, ties=False, finite=True).to(dev)
    ik = torch.randn(700, 128, generator=gen).to(torch.bfloat16).to(dev)
    kw.write_layer(a, 0, flat, k, v, ik)
    b.write(0, flat, k, v, ik)
    assert torch.equal(a.data, b.data), f"data pools differ in {int((a.data != b.data).sum())} bytes"
    assert torch.equal(a.scales, b.scales), f"scale pools differ in {int((a.scales != b.scales).sum())} bytes"
