from __future__ import annotations

import pytest

from m3serve.eval.harness import compare, format_report
from m3serve.eval.mcnemar import mcnemar_exact_p
from m3serve.eval.tasks import parse_items
from m3serve.train.tokenizer import chat_prompt

N = 20
ITEMS = parse_items([{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
                     for i in range(N)])
# A: right on items 0..14 (strict). B: right on 5..19, but on 15..19 only without the marker.
A_RIGHT = set(range(15))
B_STRICT = set(range(5, 15))
B_FLEX_ONLY = set(range(15, 20))


def _index(prompt: str) -> int:
    q = prompt.split("What is ")[1]
    return int(q.split(" ")[0])


def gen_a(prompts: list[str]) -> list[str]:
    return [f"#### {_index(p) + 1}" if _index(p) in A_RIGHT else "#### 0" for p in prompts]


def gen_b(prompts: list[str]) -> list[str]:
    out = []
    for p in prompts:
        i = _index(p)
        out.append(f"#### {i + 1}" if i in B_STRICT else (f"it is {i + 1}" if i in B_FLEX_ONLY else "#### -1"))
    return out


def test_compare_counts_and_pvalues() -> None:
    calls: list[int] = []

    def counted_a(prompts: list[str]) -> list[str]:
        calls.append(len(prompts))
        assert all(p == chat_prompt(f"What is {_index(p)} + 1?") for p in prompts)
        return gen_a(prompts)

    cmp = compare(ITEMS, {"a": counted_a, "b": gen_b}, batch_size=8)
    assert calls == [8, 8, 4]
    d = cmp.to_dict()
    assert d["configs"]["a"]["exact_match_strict"] == pytest.approx(15 / N)
    assert d["configs"]["b"]["exact_match_strict"] == pytest.approx(10 / N)
    assert d["configs"]["b"]["exact_match_flexible"] == pytest.approx(15 / N)
    # strict: a-only = {0..4}, b-only = {} ; flexible: a-only = {0..4}, b-only = {15..19}
    assert (d["paired"]["strict"]["b"], d["paired"]["strict"]["c"]) == (5, 0)
    assert d["paired"]["strict"]["p_value"] == mcnemar_exact_p(5, 0) == 0.0625
    assert (d["paired"]["flexible"]["b"], d["paired"]["flexible"]["c"]) == (5, 5)
    assert d["paired"]["flexible"]["p_value"] == 1.0
    assert "McNemar [strict]: b=5" in format_report(cmp)
    full = cmp.to_dict(include_items=True)
    assert full["items"][3]["a.output"] == "#### 4" and full["items"][3]["b.strict"] == "-1"


def test_contract_violations() -> None:
    with pytest.raises(ValueError, match="exactly 2 configurations"):
        compare(ITEMS, {"a": gen_a})
    with pytest.raises(ValueError, match="generate_fn b: expected 20 completions, found 19"):
        compare(ITEMS, {"a": gen_a, "b": lambda ps: gen_b(ps)[:-1]})
    with pytest.raises(TypeError, match=r"outputs of b\[0\]: expected str"):
        compare(ITEMS, {"a": gen_a, "b": lambda ps: [None] * len(ps)})
    with pytest.raises(ValueError, match="items: expected at least one"):
        compare([], {"a": gen_a, "b": gen_b})


def test_greedy_agreement_counts_common_prefixes_only() -> None:
    from m3serve.eval.harness import greedy_agreement
    chars = list  # one token per character: enough to check the counting
    a = ["abcdef", "xyz", "same", ""]
    b = ["abcxef", "xyz", "same", "q"]
    got = greedy_agreement(a, b, lambda s: [ord(c) for c in chars(s)])
    # prefixes 3 (the 'e', 'f' after the mismatch do not count) + 3 + 4 + 0 over 6 + 3 + 4 + 1 tokens
    assert got["tokens"] == 10 / 14
    assert got["identical"] == 0.5
    assert greedy_agreement(["ab"], ["ab"], list) == {"tokens": 1.0, "identical": 1.0}
