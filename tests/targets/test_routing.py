"""Routing modes: off installs nothing, auto falls back outside certified cells, require raises naming the
shape; on the GPU the stock model routed through the catalog stays within bf16 tolerance of stock."""

from __future__ import annotations

import pytest
import torch

from m3serve.model.layers import Linear
from m3serve.model.moe import MoE
from m3serve.targets import routing
from tests.targets.routed_logits import check_routed_logits


def _kernels(model):
    """The kernels of the decoder norms, attention layers, MLPs and MoE layers (the tiny preset's linears are
    dense: cuBLAS, no kernel)."""
    from m3serve.model.layers import RMSNorm
    from m3serve.model.m3 import Attention
    from m3serve.model.moe import DenseMLP
    mods = [m for name, m in model.named_modules() if isinstance(m, (Attention, DenseMLP, MoE))
            or isinstance(m, RMSNorm) and not name.endswith("_norm") or name.endswith(("input_norm", "post_norm"))]
    assert len(mods) > 4
    return [m.kernel for m in mods]


def test_modes_bind_and_remove_kernels_per_model():
    from m3serve.model.loader import load_model
    a = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, quantization="nvfp4", seed=0)
    b = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, quantization="nvfp4", seed=0)
    routing.install(a, "auto")
    assert all(k is not None for k in _kernels(a)) and routing.mode_of(a) == "auto"
    assert all(k is None for k in _kernels(b)) and routing.mode_of(b) == "off", "another model was touched"
    routing.install(b, "require")
    assert routing.mode_of(a) == "auto" and routing.mode_of(b) == "require"
    assert all(k is not None for k in _kernels(b)) and not set(map(id, _kernels(a))) & set(map(id, _kernels(b)))
    routing.install(a, "off")
    assert all(k is None for k in _kernels(a)) and routing.mode_of(a) == "off"
    with pytest.raises(ValueError, match="route mode"):
        routing.install(a, "on")


def test_cpu_model_is_unaffected_by_auto():
    from m3serve import LLM, SamplingParams
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="nvfp4")
    p = [{"prompt_token_ids": [1, 7, 9, 30, 31]}]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    off = llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
    routing.install(llm.model, "auto")
    assert llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == off


@pytest.fixture(scope="module")
def real_model():
    from m3serve.model.loader import load_model
    return load_model("minimax-m3:4", device="cuda", dtype=torch.bfloat16, random_weights=True,
                      quantization="nvfp4", seed=1)


def _record_moe_inputs(model, store: list):
    from m3serve.model.moe import MoE
    return [m.register_forward_pre_hook(lambda mod, args: store.append(args[0].detach().clone()))
            for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,seed", [(1, 0), (4, 1), (4, 2), (16, 3)])
def test_routed_matches_stock_on_gpu(rows, seed, real_model):
    """minimax-m3:4 (real dims, NVFP4 experts, MXFP8 projections) decode logits, routed vs stock.

    Tolerance: each entry equals its fp32 reference to one bf16 ulp plus fp32 reordering; the stock path
    rounds each GEMM output to bf16 once more before its per-row scale. The logits are bf16 outputs of the
    head, so a change in the hidden state shows up as whole bf16 ulps of the logit magnitude: a token whose
    experts are the same in both runs must agree within 4 ulps of max |logit| (measured on the H200 over
    five inputs: 1.1-2.5 ulps; a wrong kernel moves logits by tens of ulps, as a routing flip does).
    Top-k routing is discontinuous: those rounding differences upstream may flip a near-tied 4th/5th
    expert, which legitimately moves that token's logits by O(1). Such a token is accepted only when its
    expert sets really differ and the stock router's 4th-5th score gap is below 0.02 (a near tie)."""
    from m3serve.model.m3 import ForwardBatch, SeqSpan
    model = real_model
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), device="cuda", generator=g)
    batch = lambda: ForwardBatch(ids, torch.arange(rows, device="cuda"),  # noqa: E731
                                 [SeqSpan(i, 1, 1) for i in range(rows)])
    x_ref, x_got = [], []
    with torch.no_grad():
        routing.install(model, "off")
        hooks = _record_moe_inputs(model, x_ref)
        ref = model(batch())
        for h in hooks:
            h.remove()
        routing.install(model, "require")
        hooks = _record_moe_inputs(model, x_got)
        got = model(batch())
        for h in hooks:
            h.remove()
    assert torch.isfinite(got).all()
    moes = [m for m in model.modules() if m.__class__.__name__ == "MoE"]
    check_routed_logits(moes, x_ref, x_got, ref, got, label=f"rows {rows} seed {seed}")


def test_per_module_caches_belong_to_their_module():
    """Per-row scales live on the module (they live and die with its weight) and are reused across calls; the
    bound launches (and so their workspaces) are one per module and cell, never shared by two modules (the
    entries forbid sharing a workspace between call sites)."""
    from m3serve.model.loader import load_model
    a, b = Linear(16, 8, name="a"), Linear(16, 8, name="b")
    parts = torch.tensor([2.0, 4.0])
    rows = routing._per_row(a, parts, 8)
    assert rows.tolist() == [2.0] * 4 + [4.0] * 4 and routing._per_row(a, parts, 8) is rows
    assert routing._per_row(b, torch.tensor([3.0]), 8).shape == ()
    model = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, quantization="nvfp4",
                       seed=0, keep_quantized=True)
    routing.install(model, "auto")
    launches = [launch for _, _, launch in routing.launches(model)]
    assert launches and len({id(x) for x in launches}) == len(launches)
    assert all(x.workspace is None for x in launches), "workspaces are made on a launch's first call"


def test_add_norm_kernel_fuses_the_residual_boundary(monkeypatch):
    """RMSNorm.add_forward through its bound norm.add_rms launch (the interpreter on CPU, with the CUDA-only gate
    opened): h is the stock bf16 add bit for bit, y within one bf16 ulp of the stock norm of h; a shape with no
    certified cell falls back to the stock pair in auto and raises in require, naming the module."""
    from m3serve.model.layers import RMSNorm
    monkeypatch.setattr(routing, "_bf16_cuda", lambda where, t, mode: t.dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(256, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(256, generator=g))
    residual = (10 * torch.randn(3, 256, generator=g)).to(torch.bfloat16)
    delta = (3 * torch.randn(3, 256, generator=g)).to(torch.bfloat16)
    h_ref, y_ref = norm.add_forward(residual, delta)  # no kernel: the stock pair
    routing.install(torch.nn.Sequential(norm), "require")
    assert norm.kernel is not None
    h, y = norm.add_forward(residual, delta)
    assert torch.equal(h.view(torch.int16), h_ref.view(torch.int16))
    assert ((y.float() - y_ref.float()).abs() <= 2.0**-7 * y_ref.float().abs() + 1e-30).all()
    odd = RMSNorm(200, 1e-6)
    holder = torch.nn.Sequential(odd)
    routing.install(holder, "require")   # a CPU model: nothing is checked at build, a call raises
    with pytest.raises(ValueError, match=r"^0: require mode, but norm.add_rms: rows 3 shape \(200,\)"):
        odd.add_forward(residual[:, :200].contiguous(), delta[:, :200].contiguous())
    routing.install(holder, "auto")
    h2, y2 = odd.add_forward(residual[:, :200].contiguous(), delta[:, :200].contiguous())
    assert torch.equal(h2, residual[:, :200] + delta[:, :200]) and torch.equal(y2, odd(h2))
