"""norm.rms, attn.qk_prep, mlp.swiglu_oai, moe.route_small under the Triton interpreter (CPU), their hooks.

Beyond the generic catalog tests (interp cells through each entry's compare, corrupted outputs rejected):
the in-register cos/sin against fp64 truth and torch, each entry against the model's own stock module on the
same inputs (mostly bit-equal, all inside the entry's band), the edge cases each kernel claims (NaN through
the clamps, exact router ties -> lowest index, aliasing, masked tails, M3-scale positions), poisoned outputs
caught, bad arguments named, the one-op MoE combine bit-exact for top-2, and routing.install on a CPU model
leaving every module on the stock path. Shapes are tiny (the interpreter is slow); runtime ~3 s.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from m3serve.kernels.attention import qk_prep as QK
from m3serve.kernels.norm import rms as RN
from m3serve.kernels.moe import route_small as RS
from m3serve.kernels.mlp import swiglu as SW
from m3serve.kernels._jit import kernel
from m3serve.kernels.attention._rope import cos_sin_f32
from m3serve.kernels.catalog import poisoned
from m3serve.model.layers import RMSNorm, rope_cos_sin, rope_inv_freq, swiglu_oai

CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ulps(got: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """|got - truth| in fp32 ulps of truth (truth fp64)."""
    t32 = truth.float().abs().clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(t32)) - 23).double()
    return (got.double() - truth).abs() / ulp


# --- cos / sin in registers ----------------------------------------------------------------------------


@kernel
def _cos_sin_probe(a_ptr, c_ptr, s_ptr, N, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < N
    c, s = cos_sin_f32(tl.load(a_ptr + i, mask=m, other=0.0))
    tl.store(c_ptr + i, c, mask=m)
    tl.store(s_ptr + i, s, mask=m)


def test_cos_sin_within_half_an_ulp_of_truth_and_the_stated_bound_of_torch() -> None:
    """attention/_rope.py's claim: within 0.5 ulp + 2**-50 of the true value for |angle| <= 2**20 * pi/2, hence within
    2.5 * 2**-24 of torch's cos/sin (SLEEF u10 here, CUDA's 2-ulp cosf on the GPU). The angles are RoPE's
    own: pos * inv_freq at M3's theta and positions up to 2**20, plus small and negative ones."""
    g = _gen(0)
    pos = torch.randint(0, 1 << 20, (1024,), generator=g)
    pos[:4] = torch.tensor([0, 1, (1 << 20) - 1, 105615])
    angles = (pos.float().unsqueeze(-1) * rope_inv_freq(64, 5e6, CPU)).flatten()
    angles = torch.cat([angles, torch.randn(512, generator=g) * 3.0, torch.tensor([0.0, -0.0, 1e-30, -2.5e5])])
    n = angles.numel()
    c, s = poisoned((n,), torch.float32, CPU), poisoned((n,), torch.float32, CPU)
    _cos_sin_probe[((n + 1023) // 1024,)](angles, c, s, n, B=1024)
    a64 = angles.double()
    assert float(_ulps(c, a64.cos()).max()) <= 0.5 + 1e-6
    assert float(_ulps(s, a64.sin()).max()) <= 0.5 + 1e-6
    assert float((c - angles.cos()).abs().max()) <= 2.5 * 2.0**-24
    assert float((s - angles.sin()).abs().max()) <= 2.5 * 2.0**-24


def test_rope_inv_freq_is_rope_cos_sin_s_frequency() -> None:
    """attn.qk_prep takes the frequencies from rope_inv_freq; rope_cos_sin must be built on the same tensor."""
    pos = torch.tensor([0, 3, 4095, (1 << 20) - 1])
    for rd, theta in ((32, 1e4), (64, 5e6)):
        cos, sin = rope_cos_sin(pos, rd, theta)
        freqs = pos.float().unsqueeze(-1) * rope_inv_freq(rd, theta, CPU)
        assert torch.equal(cos, torch.cat((freqs, freqs), -1).cos())
        assert torch.equal(sin, torch.cat((freqs, freqs), -1).sin())


# --- norm.rms -------------------------------------------------------------------------------------------


def test_norm_matches_the_stock_module_and_may_run_in_place() -> None:
    g = _gen(1)
    norm = RMSNorm(200, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(200, generator=g))
    x = (4.0 * torch.randn(5, 200, generator=g)).to(torch.bfloat16)
    stock = norm(x)
    y = RN.rms_norm(x, norm.weight.data, 1e-6, poisoned((5, 200), torch.bfloat16, CPU))
    RN.compare(y, RN.rms_norm_reference(x, norm.weight.data, 1e-6),
               RN.Case(args=(x, norm.weight.data, 1e-6, None), kwargs={}, bytes_moved=0))
    same = (y.view(torch.int16) == stock.view(torch.int16)).float().mean().item()
    assert same >= 0.95, f"only {same:.3f} of the elements equal the stock bf16 output"
    inplace = x.clone()
    RN.rms_norm(inplace, norm.weight.data, 1e-6, inplace)  # y_out aliasing x: each row read before written
    assert torch.equal(inplace.view(torch.int16), y.view(torch.int16))


def test_norm_compare_catches_an_unwritten_element() -> None:
    e = RN.ENTRY
    case = e.make_case(e.interp_cells[0], 2, CPU, _gen(2))
    out = e.raw_call(*case.args, **case.kwargs)
    out.view(-1)[-1] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        e.compare(out, e.reference(*case.args, **case.kwargs), case)


def test_norm_rejects_bad_arguments() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(64)
    with pytest.raises(TypeError, match=r"x: expected dtype torch.bfloat16, found torch.float32"):
        RN.rms_norm(x.float(), w, 1e-6, torch.empty_like(x))
    with pytest.raises(ValueError, match=r"weight: expected shape \(64,\), found \(32,\)"):
        RN.rms_norm(x, torch.zeros(32), 1e-6, torch.empty_like(x))
    with pytest.raises(ValueError, match=r"y_out: expected shape \(2, 64\), found \(2, 32\)"):
        RN.rms_norm(x, w, 1e-6, torch.empty(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"eps: expected a positive float, found 0"):
        RN.rms_norm(x, w, 0, torch.empty_like(x))


# --- attn.qk_prep ---------------------------------------------------------------------------------------


def _tiny_attention(layer: int):
    from m3serve.model.loader import load_model
    model = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=4)
    with torch.no_grad():
        g = _gen(40 + layer)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.cfg, model.layers[layer].attn


@pytest.mark.parametrize("layer", [0, 1], ids=["full", "msa"])
def test_qk_prep_matches_attention_project(layer: int) -> None:
    """The kernel on the real projections of a (tiny) model's attention layer vs Attention.project's stock q,
    k, iq, ik: inside the entry's band everywhere, bit-equal almost everywhere (the norm's summation order
    and the cos/sin can move a value across a bf16 rounding boundary, rarely)."""
    cfg, attn = _tiny_attention(layer)
    t = 3
    x = torch.randn(t, cfg.hidden_size, generator=_gen(5)).to(torch.bfloat16)
    pos = torch.tensor([0, 17, 4095])
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)
    with torch.no_grad():
        q_s, k_s, _, iq_s, ik_s = attn.project(x, cos, sin)
        d, di = cfg.head_dim, cfg.index_head_dim
        args = (attn.q_proj(x), attn.k_proj(x), pos, attn.q_norm.weight, attn.k_norm.weight,
                rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, CPU), float(attn.q_norm.eps),
                poisoned((t, attn.hq, d), torch.bfloat16, CPU), poisoned((t, attn.hk, d), torch.bfloat16, CPU))
        kwargs = {}
        if attn.sparse:
            kwargs = dict(iq=attn.index_q_proj(x), ik=attn.index_k_proj(x), iq_norm_w=attn.index_q_norm.weight,
                          ik_norm_w=attn.index_k_norm.weight, iq_out=poisoned((t, attn.hk, di), torch.bfloat16, CPU),
                          ik_out=poisoned((t, di), torch.bfloat16, CPU))
        out = QK.qk_prep(*args, **kwargs)
        QK.compare(out, QK.qk_prep_reference(*args, **kwargs), QK.Case(args=args, kwargs=kwargs, bytes_moved=0))
    stock = (q_s, k_s) + ((iq_s, ik_s) if attn.sparse else ())
    got = tuple(o for o in out if o is not None)
    assert len(got) == len(stock)
    for o, s in zip(got, stock):
        assert o.shape == s.shape
        same = (o.view(torch.int16) == s.view(torch.int16)).float().mean().item()
        assert same >= 0.95, f"only {same:.3f} of the elements equal the stock output"


def test_qk_prep_compare_catches_an_unwritten_index_element() -> None:
    e = QK.ENTRY
    case = e.make_case(e.interp_cells[0], 2, CPU, _gen(6))
    out = e.raw_call(*case.args, **case.kwargs)
    out[3].view(-1)[-1] = float("nan")  # ik, the last program's output
    with pytest.raises(AssertionError, match="attn.qk_prep ik: non-finite"):
        e.compare(out, e.reference(*case.args, **case.kwargs), case)


def test_qk_prep_rejects_bad_arguments() -> None:
    case = QK.make_case(QK.INTERP_CELLS[0], 2, CPU, _gen(7))
    args, kw = list(case.args), dict(case.kwargs)
    with pytest.raises(ValueError, match=r"index tensors: expected all of .* or none, found only \('iq', 'ik'\)"):
        QK.qk_prep(*args, iq=kw["iq"], ik=kw["ik"])
    bad = list(args)
    bad[2] = args[2].float()
    with pytest.raises(TypeError, match=r"positions: expected torch.int64 or torch.int32, found torch.float32"):
        QK.qk_prep(*bad, **kw)
    bad = list(args)
    bad[1] = args[1][:, :8]
    with pytest.raises(ValueError, match=r"k: expected shape \(2, 16\), found \(2, 8\)"):
        QK.qk_prep(*bad, **kw)
    bad = list(args)
    bad[5] = rope_inv_freq(64, 1e4, CPU)
    with pytest.raises(ValueError, match=r"inv_freq: expected a contiguous \[rd/2\] with 2 <= rd <= D = 16"):
        QK.qk_prep(*bad, **kw)


# --- mlp.swiglu_oai -------------------------------------------------------------------------------------


def test_swiglu_propagates_nan_and_matches_stock_at_the_clamps() -> None:
    """torch.clamp keeps NaN (fmin/fmax would not); values at and beyond +-limit clamp exactly."""
    i = 40
    gu = torch.randn(1, 3, 2 * i, generator=_gen(8)) * 6.0
    gu[0, 0, 0] = float("nan")           # gate NaN
    gu[0, 1, i + 1] = float("nan")       # up NaN
    gu[0, 2, :4] = torch.tensor([7.0, 100.0, -100.0, -7.0])
    gu[0, 2, i:i + 4] = torch.tensor([7.0, -100.0, 100.0, -7.0])
    gu = gu.to(torch.bfloat16)
    out = SW.swiglu_oai(gu, 1.702, 7.0, poisoned((1, 3, i), torch.bfloat16, CPU))
    stock = swiglu_oai(gu, 1.702, 7.0).to(torch.bfloat16)
    assert torch.isnan(out[0, 0, 0]) and torch.isnan(out[0, 1, 1])
    finite = ~torch.isnan(stock)
    assert torch.equal(torch.isnan(out), ~finite)
    SW.compare(torch.where(finite, out, 0).to(torch.bfloat16), torch.where(finite, swiglu_oai(gu, 1.702, 7.0), 0),
               SW.Case(args=(gu, 1.702, 7.0, None), kwargs={}, bytes_moved=0))


def test_swiglu_rejects_bad_arguments() -> None:
    gu = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gate_up: expected \[E, T, 2I\], found shape \(2, 8\)"):
        SW.swiglu_oai(gu[0], 1.702, 7.0, torch.empty(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 4\), found \(1, 2, 8\)"):
        SW.swiglu_oai(gu, 1.702, 7.0, torch.empty(1, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"limit: expected a positive float, found 7"):
        SW.swiglu_oai(gu, 1.702, 7, torch.empty(1, 2, 4, dtype=torch.bfloat16))


# --- moe.route_small ------------------------------------------------------------------------------------


def _route(x, router, bias, top_k):
    t = x.shape[0]
    return RS.route_small(x, router, bias, top_k, poisoned((t, top_k), torch.float32, CPU),
                          torch.full((t, top_k), -1, dtype=torch.int64))


def test_route_exact_ties_take_the_lowest_expert_and_the_compare_accepts_either() -> None:
    """Experts 2, 5 and 6 share a router row and a bias: their scores are bit-equal. The kernel picks by
    descending score, then the lowest index, every time; whatever torch.topk picks among them, the compare
    accepts the kernel's ids (a tie within the band)."""
    g = _gen(9)
    e, h = 8, 64
    router = torch.randn(e, h, generator=g) / 8.0
    router[5] = router[6] = router[2]
    x = torch.randn(4, h, generator=g).to(torch.bfloat16)
    bias = torch.zeros(e)
    bias[[2, 5, 6]] = 10.0  # the three tied experts win for every token
    weights, ids = _route(x, router, bias, 2)
    assert ids.tolist() == [[2, 5]] * 4
    assert torch.allclose(weights, torch.full_like(weights, 0.5), rtol=0, atol=0)
    case = RS.Case(args=(x, router, bias, 2, None, None), kwargs={}, bytes_moved=0)
    RS.compare((weights, ids), RS.route_small_reference(x, router, bias, 2), case)


def test_route_compare_rejects_a_wrong_pick_and_an_unwritten_id() -> None:
    e = RS.ENTRY
    case = e.make_case(e.interp_cells[0], 2, CPU, _gen(10))
    weights, ids = e.raw_call(*case.args, **case.kwargs)
    ref = e.reference(*case.args, **case.kwargs)
    worst = int(torch.argmin(torch.sigmoid(ref.logits[0]) + case.args[2]))
    wrong = ids.clone()
    wrong[0, -1] = worst
    with pytest.raises(AssertionError, match="near-tie slack"):
        e.compare((weights, wrong), ref, case)
    unwritten = ids.clone()
    unwritten[1, 0] = -1
    with pytest.raises(AssertionError, match="ids outside"):
        e.compare((weights, unwritten), ref, case)
    twice = ids.clone()
    twice[1, 1] = twice[1, 0]
    with pytest.raises(AssertionError, match="picked twice"):
        e.compare((weights, twice), ref, case)


def test_route_rejects_bad_arguments() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    router, bias = torch.zeros(8, 64), torch.zeros(8)
    with pytest.raises(ValueError, match=r"top_k: expected an int in 1..8, found 9"):
        _route(x, router, bias, 9)
    with pytest.raises(ValueError, match=r"router: expected \[E, 64\] with 1 <= E <= 256, found \(300, 64\)"):
        _route(x, torch.zeros(300, 64), torch.zeros(300), 2)
    with pytest.raises(TypeError, match=r"ids_out: expected dtype torch.int64, found torch.int32"):
        RS.route_small(x, router, bias, 2, torch.empty(2, 2), torch.empty(2, 2, dtype=torch.int32))


# --- the one-op MoE combine -----------------------------------------------------------------------------


def _stock_combine(y, ids, weights):
    """MoE.forward's combine: index_add of each hit expert's weighted output, ascending expert order."""
    out = torch.zeros(y.shape[1], y.shape[2])
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        out.index_add_(0, rows, y[e, rows].float() * weights[rows, slot].unsqueeze(-1))
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_combine_selected_is_the_stock_sum(top_k: int) -> None:
    """Bit-exact for top-1 and top-2 (one rounding wherever the sum is taken); top-3 within 2 u sum|terms|.
    An unselected expert whose output overflowed (inf) must still contribute an exact 0."""
    from m3serve.targets.routing import combine_selected
    g = _gen(11 + top_k)
    e, t, h = 8, 6, 32
    y = (torch.randn(e, t, h, generator=g) * 10).to(torch.bfloat16)
    ids = torch.rand(t, e, generator=g).topk(top_k, dim=1).indices
    weights = torch.rand(t, top_k, generator=g)
    weights = weights / weights.sum(dim=1, keepdim=True)
    unselected = int(torch.tensor([i for i in range(e) if i not in ids[0].tolist()])[0])
    y[unselected, 0, 0] = float("inf")
    got, ref = combine_selected(y, ids, weights), _stock_combine(y, ids, weights)
    if top_k <= 2:
        assert torch.equal(got, ref)
    else:
        terms = sum((y[ids[:, a], torch.arange(t)].float() * weights[:, a:a + 1]).abs() for a in range(top_k))
        assert bool(((got - ref).abs() <= 2 * 2.0**-24 * terms).all())


# --- routing on a CPU model -----------------------------------------------------------------------------


def test_install_auto_on_a_cpu_model_leaves_every_module_stock(monkeypatch) -> None:
    """Kernels are bound on the decoder norms, attention prep and dense-MLP activations (not on the per-head
    norms, which belong to attn.qk_prep), none launches anything on CPU, and the logits equal the unrouted
    model's bit for bit (bf16 model)."""
    from m3serve.model.loader import load_model
    from m3serve.model.m3 import Attention, ForwardBatch, SeqSpan
    from m3serve.model.moe import DenseMLP
    from m3serve.targets import routing
    model = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=2)
    ids = torch.tensor([1, 7, 9, 30, 31])
    batch = lambda: ForwardBatch(ids, torch.arange(5), [SeqSpan(0, 5, 5)])  # noqa: E731
    with torch.no_grad():
        off = model(batch())
    routing.install(model, "auto")
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    head_norms = {id(n) for a in attn for n in (a.q_norm, a.k_norm, getattr(a, "index_q_norm", None),
                                                getattr(a, "index_k_norm", None)) if n is not None}
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert all((m.kernel is None) == (id(m) in head_norms) for m in norms)
    assert all(a.kernel is not None for a in attn)
    assert all(m.kernel is not None for m in model.modules() if isinstance(m, DenseMLP))
    calls = []
    for _, _, launch in routing.launches(model):
        launch.run = lambda *a, **k: calls.append(a)
    with torch.no_grad():
        auto = model(batch())
    assert calls == [], f"a bound kernel launched on CPU: {len(calls)} calls"
    assert torch.equal(auto, off)
    routing.install(model, "off")
    assert all(m.kernel is None for m in norms) and all(a.kernel is None for a in attn)
