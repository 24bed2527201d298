"""Speculative decoding on CUDA (stock path): exact greedy in fp32, the device RNG is bit-identical to the CPU one,
sampled verify on the device, and a bf16 smoke run with forced acceptance. Run with `pytest -m gpu tests/spec`."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.engine import EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import DeviceRNG, speculative_engine, verify_sampled
from m3serve.model.loader import load_model
from tests.spec.specutil import cheat_engine, plain_outputs, prompts, run_staggered, spec_cfg
from tests.greedy_ties import assert_only_near_ties
from tests.spec.test_verify import chi2_pvalue

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_device_rng_is_bit_identical_across_devices():
    keys = torch.tensor([0, 7, 2 ** 62 + 3], dtype=torch.int64)
    a = DeviceRNG(9, "cpu").uniform(3, 4096, keys)
    b = DeviceRNG(9, "cuda").uniform(3, 4096, keys.cuda())
    assert torch.equal(a, b.cpu())          # pure integer hashing: no device-dependent rounding


def test_greedy_exact_on_cuda_fp32():
    model = load_model("tiny", device="cuda", random_weights=True, dtype=torch.float32)
    ps = prompts(8, seed=40)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 8
    cfg = dict(kv_cache_bytes=8 << 20)
    ref = plain_outputs(model, ps, params, **cfg)
    eng = speculative_engine(model, EngineConfig(**cfg), speculative_config=spec_cfg(3))
    assert [list(r.output_token_ids) for r in run_staggered(eng, ps, params, [0, 0, 1, 2, 3, 5, 8, 9])] == ref
    eng = cheat_engine(model, ps, params, ref, k=3, **cfg)
    assert [list(r.output_token_ids) for r in run_staggered(eng, ps, params, [0, 0, 1, 2, 3, 5, 8, 9])] == ref
    assert eng.stats()["spec_decode"]["acceptance_length"] > 2.5


def test_sampled_verify_on_cuda_preserves_distribution():
    r, k, v = 200_000, 3, 8
    g = torch.Generator().manual_seed(41)
    p1 = torch.softmax(torch.randn(k + 1, v, generator=g), -1)
    q1 = torch.softmax(torch.randn(k, v, generator=g), -1)
    drafts = torch.stack([torch.multinomial(q1[i], r, replacement=True, generator=g) for i in range(k)], 1)
    dev = "cuda"
    tokens, n = verify_sampled(p1.expand(r, k + 1, v).contiguous().to(dev), q1.expand(r, k, v).contiguous().to(dev),
                               drafts.to(dev), torch.full((r,), k, device=dev), DeviceRNG(42, dev),
                               torch.arange(r, device=dev))
    tokens, n = tokens.cpu(), n.cpu()
    assert chi2_pvalue(tokens[:, 0], p1[0]) > 1e-3
    assert chi2_pvalue(tokens[n >= 2, 1], p1[1]) > 1e-3


def test_bf16_forced_acceptance_smoke():
    model = load_model("tiny", device="cuda", random_weights=True, dtype=torch.bfloat16)
    eng = speculative_engine(model, EngineConfig(kv_cache_bytes=32 << 20, kv_cache_dtype="fp8"),
                              speculative_config=spec_cfg(3, forced_acceptance=2.78))
    assert eng.kv.spec.kv_format(eng.kv.draft_layer) == "fp8"
    ps = prompts(4, seed=43)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=64, temperature=0.8, ignore_eos=True, seed=i))
            for i, p in enumerate(ps)]
    while eng.has_work():
        eng.step()
    assert all(len(r.output_token_ids) == 64 for r in reqs)
    st = eng.stats()["spec_decode"]
    assert abs(st["acceptance_length"] - 2.78) <= len(reqs) / st["verify_steps"]


def test_spec_target_graphs_equal_eager_steps_and_plain_greedy():
    """The embedded model with its trained drafter: SpecSteps replayed as CUDA graphs and the same program (same
    buckets, same kernels) run eagerly give the same greedy tokens; most steps run as graphs. Against the plain
    decode target (DecodeGraphs) the verify rows are other row counts, so other cells and summation orders: where
    a sequence first parts from plain greedy, plain must be near-indifferent between the two tokens there
    (tests/greedy_ties.py)."""
    import os
    from m3serve import LLM
    from m3serve.llm import DEFAULT_MODEL_DIR
    from m3serve.tokenizer import chat_token_ids
    import json
    llm = LLM(DEFAULT_MODEL_DIR, dtype="bfloat16", kv_cache_bytes=256 << 20, max_num_seqs=4)
    assert llm.engine.runner.graphs is not None
    items = [json.loads(line) for line in open(os.path.join(DEFAULT_MODEL_DIR, "synthetic_heldout.jsonl"))][:6]
    ps = [chat_token_ids(llm.tokenizer, [{"role": "user", "content": it["question"]}]) for it in items]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    spec = {"method": "eagle3", "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3"), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}

    def run(eng):
        reqs = [eng.add_request(p, params) for p in ps]
        while eng.has_work():
            eng.step()
        assert eng.blocks.num_free_slots() == eng.kv.num_slots
        return [list(r.output_token_ids) for r in reqs]

    ref = run(llm.engine)
    outs = {}
    for graphs in (True, False):
        eng = speculative_engine(llm.model, llm.engine.config, llm.tokenizer, speculative_config=spec)
        assert eng.enable_target(graphs=graphs, mode="require")
        outs[graphs] = run(eng)
        st = eng.stats()["spec_decode"]
        assert eng.speculation.graph_steps >= 10 and st["acceptance_length"] > 2.0   # verify_steps counts requests
    assert outs[True] == outs[False]
    assert_only_near_ties(llm, ps, ref, outs[True])


def test_batch_size_policy_on_the_decode_target_equals_plain_greedy():
    """The default policy (disable_by_batch_size 2) on the embedded model: batches of 3-4 decode through the plain
    decode graphs (captured by SpecDecoding.enable_target for the buckets above 2) and the overlap loop,
    batches of 1-2 through SpecSteps, switching as requests arrive and finish; greedy tokens equal the plain
    target's, with graphs and with enforce_eager; no page leaks."""
    import json
    import os
    from m3serve import LLM
    from m3serve.llm import DEFAULT_MODEL_DIR
    from m3serve.tokenizer import chat_token_ids
    llm = LLM(DEFAULT_MODEL_DIR, dtype="bfloat16", kv_cache_bytes=256 << 20, max_num_seqs=4)
    items = [json.loads(line) for line in open(os.path.join(DEFAULT_MODEL_DIR, "synthetic_heldout.jsonl"))][:6]
    ps = [chat_token_ids(llm.tokenizer, [{"role": "user", "content": it["question"]}]) for it in items]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 12, 56, 20, 30, 64)]
    spec = {"method": "eagle3", "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3"), "num_speculative_tokens": 3}
    arrivals = [0, 0, 0, 3, 9, 30]

    ref = [list(r.output_token_ids) for r in run_staggered(llm.engine, ps, params, arrivals)]
    for graphs in (True, False):
        eng = speculative_engine(llm.model, llm.engine.config, llm.tokenizer, speculative_config=spec)
        assert eng.enable_target(graphs=graphs, mode="require")
        assert (eng.runner.graphs is not None) == graphs and eng.runner.target_attention
        if graphs:
            assert eng.runner.graphs.captured == (4,) and not eng.runner.graphs.processed_graphs
        got = [list(r.output_token_ids) for r in run_staggered(eng, ps, params, arrivals)]
        assert got == ref, graphs
        st = eng.stats()["spec_decode"]
        assert st["disable_by_batch_size"] == 2 and st["policy_plain_steps"] >= 10 and st["policy_spec_steps"] >= 10
        assert eng.speculation.graph_steps >= 5 and st["verify_steps"] > 0
        if graphs:
            assert eng.runner.graphs.replays >= 10
        assert eng.blocks.num_free_slots() == eng.kv.num_slots and eng._inflight is None


def test_routed_drafter_norm_matches_the_stock_llama_norm():
    """install_drafter's norm.rms route of a Llama norm vs the stock fp32 formula, on fresh random rows: within
    one bf16 ulp plus H fp32 ulps (norm.rms's band: the mean's summation order and rsqrt rounding differ)."""
    from m3serve.kernels.catalog import BF16_REL, FP32_U
    from m3serve.model.eagle3 import LlamaRMSNorm
    from m3serve.targets.routing import install_drafter
    g = torch.Generator().manual_seed(7)
    norm = LlamaRMSNorm(256, 1e-6)
    norm.weight.data = 1.0 + 0.3 * torch.randn(256, generator=g)
    norm = norm.to("cuda", torch.bfloat16)
    holder = torch.nn.Sequential(norm)
    install_drafter(holder, "require", max_rows=13)
    assert norm.kernel is not None
    x = (torch.randn(13, 256, generator=g) * 3).to("cuda", torch.bfloat16)
    got = norm(x)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
    band = (BF16_REL + 256 * FP32_U) * ref.abs() + 1e-30
    assert ((got.float() - ref).abs() <= band).all()
    norm.kernel = None
    assert (norm(x).float() - got.float()).abs().max() <= band.max()


def test_routed_drafter_layer_matches_the_stock_layer():
    """install_drafter's attn.rope, mlp.silu_mul and norm.add_rms hooks inside the embedded drafter's layer vs
    the same layer stock, on fresh random rows: q/k inside attn.rope's band of the stock fp32 rotation; the layer
    output r2 and its final norm within 2 bf16 ulps + 2**-8 of the row's largest value: the routed norms may round
    an element one ulp the other way (norm.rms's band), which the MLP's GEMMs carry into every output as at most
    ~2**-8 of the row's scale; a mis-wired hook moves values by O(1) of it."""
    import os
    from m3serve.kernels.attention.qk_prep import rope_compare, rope_reference
    from m3serve.llm import DEFAULT_MODEL_DIR
    from m3serve.model.eagle3 import load_drafter
    from m3serve.model.layers import rope_inv_freq
    from m3serve.targets.routing import install_drafter
    d = load_drafter(os.path.join(DEFAULT_MODEL_DIR, "eagle3"), dtype=torch.bfloat16, device="cuda")
    layer = d.midlayer
    g = torch.Generator().manual_seed(11)
    t, h = 9, d.cfg.hidden_size
    emb, hidden = [(torch.randn(t, h, generator=g) * 2).to("cuda", torch.bfloat16) for _ in range(2)]
    pos = torch.randint(0, 4000, (t,), generator=g).to("cuda")
    attn = (torch.randn(t, d.cfg.num_attention_heads, d.cfg.head_dim, generator=g)).to("cuda", torch.bfloat16)
    install_drafter(d, "off")
    layer.self_attn.fuse_projections()
    layer.mlp.fuse_projections()
    q0, k0, _, res0 = layer.project(emb, hidden, pos)
    n0, r0 = layer.finish(attn, res0, d.norm)
    install_drafter(d, "require", max_rows=t)
    assert layer.self_attn.kernel is not None and layer.mlp.kernel is not None
    assert layer.post_attention_layernorm.kernel is not None
    q1, k1, _, res1 = layer.project(emb, hidden, pos)
    n1, r1 = layer.finish(attn, res1, d.norm)
    # the stock rotation's input: the joined GEMM's q, k before RoPE (the same GEMM on both sides)
    a = layer.self_attn
    x2 = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
    qkv = torch.nn.functional.linear(x2, a.qkv_weight)
    inv = rope_inv_freq(d.cfg.rotary_dim, d.cfg.rope_theta, pos.device)
    ref = rope_reference(qkv[:, :a.hq * a.d], qkv[:, a.hq * a.d:(a.hq + a.hk) * a.d], pos, inv, q1, k1)
    rope_compare((q1, k1), ref, None)
    assert torch.equal(res0, res1)
    for got, want in ((r1, r0), (n1, n0)):
        scale = want.float().abs().amax(dim=-1, keepdim=True)
        assert ((got.float() - want.float()).abs() <= 2 * 2.0 ** -7 * want.float().abs() + 2.0 ** -8 * scale).all()


def _two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test of homogeneity of two samples of token ids (categories with fewer than 10 pooled draws
    merged into one)."""
    n = int(max(a.max(), b.max())) + 1
    ca, cb = torch.bincount(a, minlength=n).double(), torch.bincount(b, minlength=n).double()
    small = (ca + cb) < 10
    ca = torch.cat((ca[~small], ca[small].sum().view(1)))
    cb = torch.cat((cb[~small], cb[small].sum().view(1)))
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    tot = ca + cb
    ea, eb = tot * ca.sum() / tot.sum(), tot * cb.sum() / tot.sum()
    stat = (((ca - ea) ** 2 / ea) + ((cb - eb) ** 2 / eb)).sum()
    df = int(tot.numel()) - 1
    if df == 0:
        return 1.0          # one category: both samples are the same constant
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_sampled_spec_graphs_match_the_plain_target_distribution():
    """The embedded model, one chat prompt, 3000 requests with their own seeds (temperature 4, top-k 8: the
    trained model is confident, so the temperature spreads its choices), through the plain decode target and
    through the speculative target's sampled graphs: output tokens 2-5 (drawn by the graphs' rejection sampling:
    the 1st comes from the prefill) have the same distribution in both (two-sample chi-square, p > 1e-3: it
    catches a departure as large as its 3000 draws can resolve; the exact maths is proven on synthetic p and q
    in tests/spec/test_verify.py). At least one position must spread over 3+ well-populated tokens, or the test
    would prove nothing."""
    import json
    import os
    from m3serve import LLM
    from m3serve.llm import DEFAULT_MODEL_DIR
    from m3serve.tokenizer import chat_token_ids
    llm = LLM(DEFAULT_MODEL_DIR, dtype="bfloat16", kv_cache_bytes=256 << 20, max_num_seqs=8)
    item = json.loads(open(os.path.join(DEFAULT_MODEL_DIR, "synthetic_heldout.jsonl")).readline())
    prompt = chat_token_ids(llm.tokenizer, [{"role": "user", "content": item["question"]}])
    n = 3000

    def run(eng):
        outs = []
        for g in range(0, n, 8):
            reqs = [eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=4.0, top_k=8, seed=1000 + i,
                                                           ignore_eos=True)) for i in range(g, g + 8)]
            while eng.has_work():
                eng.step()
            outs += [list(r.output_token_ids) for r in reqs]
        return torch.tensor(outs)

    plain = run(llm.engine)
    spec = {"method": "eagle3", "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3"), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    eng = speculative_engine(llm.model, llm.engine.config, llm.tokenizer, speculative_config=spec)
    assert eng.enable_target(graphs=True, mode="require")
    got = run(eng)
    assert eng.speculation.spec_steps.sampled_replays >= n // 8
    spread = 0
    for j in range(1, 5):
        assert _two_sample_pvalue(plain[:, j], got[:, j]) > 1e-3, f"output token {j}"
        spread = max(spread, int((torch.bincount(plain[:, j]) >= 50).sum()))
    assert spread >= 3
