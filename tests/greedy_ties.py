"""Where two greedy runs that may differ only by summation order part, the reference must be near-indifferent.

A fast path that differs from its reference only in summation order moves bf16 logits by a few ulps, which may
flip a near-tied argmax; from there the two sequences diverge. A real defect flips clear decisions. So at each
sequence's first difference the reference LLM is asked for its log-probabilities there (teacher-forced on the
common prefix): it must still choose its own token, the other run's token must be among its 20 most likely, and
its margin between them must be at most NEAR_TIE."""

from __future__ import annotations

# bf16 logits of magnitude 4-16 have an ulp of 1/32-1/16; a few ulps of summation-order drift
NEAR_TIE = 0.125


def first_divergence_margins(reference_llm, prompt_ids: list[list[int]], ref: list[list[int]],
                             got: list[list[int]]) -> list[tuple[int, float]]:
    """(position, reference log-prob of its token minus that of got's) at each sequence's first difference."""
    from m3serve import SamplingParams
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20)
    margins = []
    for p, r, g in zip(prompt_ids, ref, got):
        i = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if i is None:
            continue
        out = reference_llm.generate([{"prompt_token_ids": list(p) + list(r[:i])}], one, use_tqdm=False)[0]
        top = out.outputs[0].logprobs[0]
        assert out.outputs[0].token_ids[0] == r[i], "the reference does not repeat its own greedy token"
        assert g[i] in top, f"the other run's token {g[i]} is not among the reference's 20 most likely there"
        margins.append((i, top[r[i]] - top[g[i]]))
    return margins


def assert_only_near_ties(reference_llm, prompt_ids, ref, got) -> list[tuple[int, float]]:
    margins = first_divergence_margins(reference_llm, prompt_ids, ref, got)
    print("first divergence (position, reference log-prob margin of its token over the other's):", margins)
    assert all(m <= NEAR_TIE for _, m in margins), margins
    return margins
