"""The fused attention projection: one concatenated weight whose row views the parts keep (nothing stored
twice, the stock path reads the same bytes), and one GEMM whose split output equals the parts' own GEMMs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m3serve.kernels.gemm._gemm_tiles import GemmConfig
from m3serve.kernels.gemm.qkv_fused import QKV_MXFP8
from m3serve.model.loader import load_model
from m3serve.model.m3 import Attention
from m3serve.model.qweight import QWeight
from m3serve.targets import fused_projection


def _attentions(model):
    return [m for m in model.modules() if isinstance(m, Attention)]


def _quantize(w: torch.Tensor, fmt: str) -> QWeight:
    from m3serve.quant.mxfp8 import quantize_mxfp8
    from m3serve.quant.nvfp4 import nvfp4_global_scale, quantize_nvfp4
    if fmt == "mxfp8":
        q, s = quantize_mxfp8(w)
        return QWeight("mxfp8", {"q": q, "scale": s})
    if fmt == "fp8":
        scale = w.abs().amax() / 448.0
        return QWeight("fp8", {"q": (w / scale).to(torch.float8_e4m3fn), "scale": scale.reshape(1)})
    g = nvfp4_global_scale(w.abs().amax())
    packed, s = quantize_nvfp4(w, g)
    return QWeight("nvfp4", {"packed": packed, "scale": s, "global_scale": torch.as_tensor(g).float().reshape(1)})


@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "mxfp8", "fp8"])
def test_fusing_keeps_every_part_weight_bit_for_bit_and_shares_storage(fmt):
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=3)
    for attn in _attentions(model):
        parts = fused_projection.projection_parts(attn)
        if fmt != "dense":
            for p in parts:
                p.set_weight(_quantize(p.weight.detach().float(), fmt))
        before = [p.dense_weight(torch.float32).clone() for p in parts]
        fp = fused_projection.fuse(attn)
        assert fp is not None and [g.fmt for g in fp.groups] == [fmt] and fp.splits == tuple(p.out_features for p in parts)
        assert len(parts) == (5 if attn.sparse else 3)
        for p, w in zip(parts, before):
            assert torch.equal(p.dense_weight(torch.float32), w), p.name
        assert fused_projection._still_views(attn, fp), "each part must read its rows of the concatenation"


def test_dense_projection_equals_the_parts_and_refuses_replaced_weights():
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=4)
    gen = torch.Generator().manual_seed(0)
    for attn in _attentions(model):
        x = torch.randn(5, attn.cfg.hidden_size, generator=gen)
        parts = fused_projection.projection_parts(attn)
        want = [F.linear(x, p.weight) for p in parts]
        got = fused_projection.project(attn, x)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            # fp32: the same dot products, the GEMM's blocking may change their summation order only
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        # a part whose weight is replaced afterwards is fused again, with its new values
        q = attn.q_proj
        q.set_weight(QWeight("dense", {"w": torch.randn(q.out_features, q.in_features, generator=gen)}))
        got = fused_projection.project(attn, x)
        torch.testing.assert_close(got[0], F.linear(x, q.weight), rtol=1e-5, atol=1e-6)
        assert fused_projection._still_views(attn, attn._routed_workspaces["fused_projection"])


def test_quantized_projection_needs_a_certified_cell():
    """On the tiny model's shapes no qkv cell is certified: the plan's qkv route serves no row, and project with it
    bound returns None in auto and in require mode (qkv is never strict: the parts then run one by one through
    their own linear kernels, which enforce require)."""
    from m3serve.targets.plan import build_plan
    from m3serve.targets.routing import RowTable
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=5)
    attn = _attentions(model)[0]
    for p in fused_projection.projection_parts(attn):
        p.set_weight(_quantize(p.weight.detach().float(), "mxfp8"))
    name = next(n for n, m in model.named_modules() if m is attn)
    route = build_plan(model, "auto").module(name).routes["qkv"]
    assert route.kind == "qkv.mxfp8" and not route.strict and all(s.cell is None for s in route.spans)
    x = torch.randn(2, attn.cfg.hidden_size, dtype=torch.bfloat16)
    for mode in ("auto", "require"):
        assert fused_projection.project(attn, x, RowTable(route, name, mode)) is None



def _tiny_mxfp8():
    """The tiny preset with MXFP8 q|k|v and a dense indexer, as quantized M3 checkpoints store them."""
    return load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, quantization="mxfp8", seed=6,
                      keep_quantized=True)


class _QkvLaunch:
    """A bound qkv.mxfp8 launch (routing.Launch's fields) on an interpreter-sized tile."""
    run = staticmethod(QKV_MXFP8.raw_call)
    config = GemmConfig(BM=16, BN=64, BK=128, SPLIT=1)
    workspace = None


def test_quantized_qkv_and_dense_index_run_as_two_gemms():
    """As quantized M3 checkpoints store them (the indexer is never quantized): q|k|v join in their format's qkv
    GEMM and index-q|index-k in one dense GEMM; the plan keys the qkv route by q|k|v alone; each output is its
    part's own (stock) output up to the kernel's rounding."""
    from m3serve.targets.plan import qkv_key

    model = _tiny_mxfp8()
    gen = torch.Generator().manual_seed(1)
    Launch = _QkvLaunch
    checked = 0
    for attn in _attentions(model):
        parts = fused_projection.projection_parts(attn)
        x = torch.randn(3, attn.cfg.hidden_size, generator=gen).to(torch.bfloat16)
        want = [p(x).float() for p in parts]                       # the stock path, before fusing
        fp = fused_projection.fuse(attn)
        if attn.sparse:
            assert [g.fmt for g in fp.groups] == ["mxfp8", "dense"]
            assert [len(g.parts) for g in fp.groups] == [3, 2]
            assert qkv_key(attn) == ("qkv.mxfp8", (sum(p.out_features for p in parts[:3]), attn.cfg.hidden_size))
        else:
            assert [g.fmt for g in fp.groups] == ["mxfp8"]
        got = fused_projection.project(attn, x, lambda rows: Launch())
        assert got is not None and len(got) == len(parts)
        for p, g, w in zip(parts, got, want):
            assert g.shape == (3, p.out_features), p.name
            # the kernel rounds once to bf16 from fp32 sums, the stock path rounds its GEMM's output: one bf16 ulp
            # of each side plus fp32 order
            torch.testing.assert_close(g.float(), w, rtol=2 ** -6, atol=2 ** -6 * float(w.abs().max())), p.name
        assert fused_projection.project(attn, x, lambda rows: None) is None   # no qkv cell: every part alone
        checked += attn.sparse
    assert checked >= 1


def test_dense_index_group_runs_on_linear_bf16_where_its_route_serves():
    """The index-q|index-k group beside a quantized q|k|v: at the rows its linear.bf16 row table serves, that entry's
    GEMV (interpreted here) gives each part's own output up to summation order; where the table gives None, cuBLAS
    (torch.mm) does, bit for bit with the concatenated weight."""
    from m3serve.kernels.gemm import bf16
    from m3serve.kernels.gemm._gemv import GemvConfig
    from m3serve.targets.plan import index_key

    model = _tiny_mxfp8()
    gen = torch.Generator().manual_seed(2)
    QkvLaunch = _QkvLaunch
    calls = []

    class IndexLaunch:
        config = GemvConfig(BM=4, BN=16, BK=64, SPLIT=2)
        workspace = None

        @staticmethod
        def run(*args, **kw):
            calls.append(args[1].shape)
            return bf16.bf16_linear(*args, **kw)

    sparse = [a for a in _attentions(model) if a.sparse]
    assert sparse
    for attn in sparse:
        parts = fused_projection.projection_parts(attn)
        n_index = sum(p.out_features for p in parts[3:])
        assert index_key(attn) == ("linear.bf16", (n_index, attn.cfg.hidden_size))
        x = torch.randn(3, attn.cfg.hidden_size, generator=gen).to(torch.bfloat16)
        want = [p(x).float() for p in parts[3:]]
        calls.clear()
        got = fused_projection.project(attn, x, lambda rows: QkvLaunch(), lambda rows: IndexLaunch())
        assert calls == [(n_index, attn.cfg.hidden_size)]
        for p, g, w in zip(parts[3:], got[3:], want):
            assert g.shape == (3, p.out_features), p.name
            torch.testing.assert_close(g.float(), w, rtol=2 ** -6, atol=2 ** -6 * float(w.abs().max())), p.name
        calls.clear()
        cublas = fused_projection.project(attn, x, lambda rows: QkvLaunch(), lambda rows: None)
        assert calls == []
        w_index = torch.cat([p.weight for p in parts[3:]])
        assert torch.equal(torch.cat(cublas[3:], dim=-1), torch.mm(x, w_index.t()))
