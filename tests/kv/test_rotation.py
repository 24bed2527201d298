"""The randomized Hadamard K/V rotation (m3serve.kv.rotation) and the rotated hybrid cache.

Tolerances: the rotation's only roundings are fp32 additions (log2 B per value), so round trips and q.k are
checked at 1e-5 relative to the vectors' norms (~50x the fp32 worst case for B = 128)."""

from __future__ import annotations

import json

import pytest
import torch

from m3serve.kv import PagedKVCache, codec, rotation
from m3serve.kv.calibrate import KVCalibration, choose_nvfp4_amax, save_kv_scales
from m3serve.kv.scales import read_kv_scales, rotation_record
from m3serve.kv.spec import KVCacheSpec


def _hadamard(b: int) -> torch.Tensor:
    """Sylvester Hadamard of order b, built by Kronecker products (independent of the butterfly)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [16, 64, 128, 96])
def test_rotate_is_the_scaled_signed_hadamard_and_unrotate_inverts_it(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    s = rotation.rotation_signs(d, 7)
    b = rotation.hadamard_block(d)
    x = torch.randn(5, 3, d, generator=gen) * torch.exp2(torch.randint(-6, 6, (5, 3, d), generator=gen).float())
    e_w, e_r = rotation.scale_exponents(b)
    assert e_w + e_r == b.bit_length() - 1
    full = torch.block_diag(*[_hadamard(b)] * (d // b))
    want = (x.double() * s.double()) @ full * 2.0**-e_w
    y = rotation.rotate(x, s)
    assert y.dtype == torch.float32
    tol = 1e-5 * x.double().norm(dim=-1, keepdim=True)
    assert bool(((y.double() - want).abs() <= tol).all())
    assert bool(((rotation.unrotate(y, s).double() - x.double()).abs() <= tol).all())
    q = torch.randn(5, 3, d, generator=gen)
    qk = (rotation.rotate_query(q, s) * y).sum(-1).double()
    assert bool(((qk - (q * x).sum(-1).double()).abs() <= 1e-5 * q.norm(dim=-1).double() * x.norm(dim=-1).double()).all())
    m = rotation.query_matrix(s)
    assert torch.equal(m.to(torch.bfloat16).float(), m), "M's entries are exact in bf16 (MMA operand)"
    assert bool(((q @ m - rotation.rotate_query(q, s)).abs() <= 1e-5 * q.norm(dim=-1, keepdim=True)).all())
    assert bool(((y @ m.T - rotation.unrotate(y, s)).abs() <= tol.float()).all())


def test_signs_are_deterministic_per_seed_and_head_dim() -> None:
    a, b = rotation.rotation_signs(64, 31), rotation.rotation_signs(64, 31)
    assert torch.equal(a, b) and set(a.tolist()) == {-1.0, 1.0}
    assert not torch.equal(a, rotation.rotation_signs(64, 32))


@pytest.mark.parametrize("d", [8, 24, 40])
def test_a_head_dim_without_a_16_block_is_rejected(d: int) -> None:
    with pytest.raises(ValueError, match=f"head_dim {d}"):
        rotation.check_rotatable(d)


def _spec(seed=31, kv="nvfp4", d=64, fp8_layers=()) -> KVCacheSpec:
    return KVCacheSpec(page_size=16, num_layers=3, sparse_layers=(1, 2), num_kv_heads=2, head_dim=d,
                       index_head_dim=16, kv_cache_dtype=kv, model_dtype=torch.float32, kv_rotation_seed=seed,
                       fp8_layers=fp8_layers)


def test_spec_rotates_only_nvfp4_layers_and_checks_its_seed() -> None:
    spec = _spec(fp8_layers=(2,))
    assert [spec.is_rotated(i) for i in range(3)] == [False, True, False]
    assert "Hadamard-rotated (seed 31)" in spec.split_summary()
    with pytest.raises(ValueError, match="kv_rotation_seed.*hybrid cache"):
        _spec(kv="fp8")
    with pytest.raises(ValueError, match="kv_rotation_seed: expected None or a non-negative int"):
        _spec(seed=-1)
    with pytest.raises(ValueError, match="head_dim 40"):
        KVCacheSpec(page_size=16, num_layers=2, sparse_layers=(1,), num_kv_heads=2, head_dim=40, index_head_dim=16,
                    kv_cache_dtype="nvfp4", kv_rotation_seed=0)


def test_rotated_cache_reads_back_the_model_basis() -> None:
    """K with two outlier channels: the rotated cache stores the NVFP4 encoding of rotate(K) (bytes equal) and
    read() gives back K and V in the model's basis within NVFP4's own error (<= 0.12 relative in norm; 4-bit
    values with 16-value block scales round Gaussian-like data at ~0.095, and the unrotated cache is compared
    beside it: on such data the rotation does not lower the MSE, it spreads each error over the head vector)."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(64, 2, 64, generator=gen)
    k[:, :, [5, 40]] *= 25.0
    v = torch.randn(64, 2, 64, generator=gen)
    ik = torch.randn(64, 16, generator=gen)
    errs = {}
    for seed in (None, 31):
        cache = PagedKVCache(_spec(seed=seed), 4, "cpu")
        rk = rotation.rotate(k, cache.kv_rotation_signs) if seed is not None else k
        rv = rotation.rotate(v, cache.kv_rotation_signs) if seed is not None else v
        cache.set_nvfp4_amax(1, choose_nvfp4_amax(rk).amax, choose_nvfp4_amax(rv).amax)
        cache.write(1, torch.arange(64), k, v, ik)
        got_k, got_v, _ = cache.read(1, torch.arange(4), 64, torch.float32)
        errs[seed] = (float((got_k - k).norm() / k.norm()), float((got_v - v).norm() / v.norm()))
        data, _ = codec.encode("nvfp4", rk, cache.kv_global_scale[1, 0])
        assert torch.equal(cache.pages(1, "k")[:4].permute(0, 2, 1, 3).reshape(64, 2, 32), data)
    assert max(max(e) for e in errs.values()) <= 0.12, errs


def test_kv_scales_file_records_and_checks_the_rotation(tmp_path) -> None:
    choice = choose_nvfp4_amax(torch.randn(100, 2, 64))
    calib = KVCalibration(num_layers=2, layers={0: (choice, choice), 1: (choice, choice)}, default_amax=64.0,
                          default_mse={0: (1.0, 1.0), 1: (1.0, 1.0)}, rotation_seed=31, head_dim=64)
    path = str(tmp_path / "kv_scales.json")
    save_kv_scales(path, calib)
    doc = json.load(open(path))
    assert doc["rotation"] == rotation_record(64, 31)
    assert doc["rotation"]["signs"] == [int(x) for x in rotation.rotation_signs(64, 31).tolist()]
    assert read_kv_scales(path, 2).rotation_seed == 31
    doc["rotation"]["signs"][0] *= -1
    json.dump(doc, open(path, "w"))
    with pytest.raises(ValueError, match="rotation.signs"):
        read_kv_scales(path, 2)
    del doc["rotation"]
    json.dump(doc, open(path, "w"))
    assert read_kv_scales(path, 2).rotation_seed is None
