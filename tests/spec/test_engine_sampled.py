"""Sampled speculative decoding through the whole engine preserves the target's distribution: the joint law of
the first three tokens (one from prefill, two from a verify step) against the exact law computed from the model,
chi-square over 1000 requests each, with the random drafter's own q and with a one-hot ("cheating") drafter.
(The >= 1e5-draw chi-square tests of the verify math itself are in test_verify.py.)"""

from __future__ import annotations


import pytest
import torch

from m3serve.engine.engine import EngineConfig
from m3serve.engine.sampler import processed_probs
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import speculative_engine
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from tests.spec.specutil import cheat_engine, plain_outputs, prompts, spec_cfg
from tests.spec.test_verify import chi2_pvalue

PARAMS = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


def _exact_joint(model, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) = p(t1) p(t2 | t1) p(t3 | t1, t2) with the request's processing (temperature 1, top-4)."""
    def dist(ids):
        n = len(ids)
        with torch.no_grad():
            logits = model(ForwardBatch(torch.tensor(ids), torch.arange(n), [SeqSpan(0, n, n)]))[-1:]
        return processed_probs(logits, [PARAMS])[0]
    out = {}
    p1 = dist(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            p3 = dist(prompt + [a, b])
            for c in p3.nonzero().flatten().tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def _sample(eng, prompt, n: int) -> list[tuple[int, ...]]:
    got = []
    for _ in range(n // 500):
        reqs = [eng.add_request(prompt, PARAMS) for _ in range(500)]
        while eng.has_work():
            eng.step()
        got += [tuple(r.output_token_ids) for r in reqs]
        for r in reqs:
            eng.release(r)
    return got


def _pvalue(joint, got, n: int) -> float:
    cells = sorted(joint, key=joint.get, reverse=True)
    index = {c: i for i, c in enumerate(cells)}
    assert all(g in index for g in got)                      # nothing outside the top-4 support is ever emitted
    probs = torch.tensor([joint[c] for c in cells], dtype=torch.float64)
    toks = torch.tensor([index[g] for g in got])
    # pool the cells expected to hold < 5 draws (chi-square validity) into the last kept cell
    keep = int((probs * n >= 5).sum())
    toks = toks.clamp(max=keep - 1)
    probs = torch.cat([probs[:keep - 1], probs[keep - 1:].sum(0, keepdim=True)])
    return chi2_pvalue(toks, probs)


@pytest.mark.parametrize("drafter, n", [("random", 1000), ("cheat", 1000)])
def test_sampled_engine_preserves_joint_distribution(model, drafter, n):
    prompt = prompts(1, 10, 11, seed=30)[0]
    joint = _exact_joint(model, prompt)
    cfg = dict(kv_cache_bytes=16 << 20, max_num_seqs=500, max_num_batched_tokens=4096)
    if drafter == "cheat":
        ref = plain_outputs(model, [prompt], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
        eng = cheat_engine(model, [prompt], [PARAMS], ref, k=3, corrupt_every=0, **cfg)
    else:
        eng = speculative_engine(model, EngineConfig(**cfg), speculative_config=spec_cfg(3))
    got = _sample(eng, prompt, n)
    st = eng.stats()["spec_decode"]
    assert n <= st["verify_steps"] <= 2 * n                  # tokens 2 and 3 come from one or two verify steps
    if drafter == "cheat":
        # greedy-path proposals: accepted when the sampled path agrees (accept path), residual otherwise
        assert st["accepted_tokens"] > n // 20
    assert _pvalue(joint, got, n) > 1e-3
