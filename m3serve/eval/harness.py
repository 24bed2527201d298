"""Paired accuracy comparison of two engine configurations on one task.

Each configuration is a plain callable `generate_fn(prompts: list[str]) -> list[str]`
(greedy completions, prompt excluded), so the harness knows nothing of engine internals.
Both run on the same items; per configuration we report strict and flexible exact match,
and for the pair the discordant counts (b, c) with McNemar's exact p-value.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from m3serve.eval.extract import flexible_extract, strict_extract
from m3serve.eval.mcnemar import discordant, mcnemar_exact_p
from m3serve.eval.tasks import TaskItem
from m3serve.train.tokenizer import chat_prompt

GenerateFn = Callable[[list[str]], list[str]]
METRICS = ("strict", "flexible")


@dataclass
class ConfigScore:
    name: str
    outputs: list[str]
    predictions: dict[str, list[str | None]]  # metric -> extracted answer per item
    correct: dict[str, list[bool]]  # metric -> per item
    wall_s: float

    def exact_match(self, metric: str) -> float:
        c = self.correct[metric]
        return sum(c) / len(c) if c else 0.0


@dataclass
class Comparison:
    items: list[TaskItem]
    a: ConfigScore
    b: ConfigScore
    paired: dict[str, dict[str, float | int]] = field(default_factory=dict)  # metric -> {b, c, p_value}
    agreement: dict[str, float] = field(default_factory=dict)               # see greedy_agreement

    def to_dict(self, include_items: bool = False) -> dict:
        out: dict = {"n": len(self.items), "configs": {}, "paired": self.paired}
        for s in (self.a, self.b):
            out["configs"][s.name] = {
                "exact_match_strict": s.exact_match("strict"),
                "exact_match_flexible": s.exact_match("flexible"),
                "correct_strict": sum(s.correct["strict"]),
                "correct_flexible": sum(s.correct["flexible"]),
                "wall_s": s.wall_s,
            }
        out["order"] = [self.a.name, self.b.name]
        out["agreement"] = self.agreement
        if include_items:
            out["items"] = [
                {
                    "index": it.index,
                    "question": it.question,
                    "target": it.target,
                    **{f"{s.name}.output": s.outputs[k] for s in (self.a, self.b)},
                    **{f"{s.name}.strict": s.predictions["strict"][k] for s in (self.a, self.b)},
                }
                for k, it in enumerate(self.items)
            ]
        return out


def score_outputs(name: str, items: Sequence[TaskItem], outputs: Sequence[str], wall_s: float = 0.0) -> ConfigScore:
    if len(outputs) != len(items):
        raise ValueError(f"outputs of {name}: expected {len(items)} completions, found {len(outputs)}")
    for k, o in enumerate(outputs):
        if not isinstance(o, str):
            raise TypeError(f"outputs of {name}[{k}]: expected str, found {type(o).__name__}")
    preds = {
        "strict": [strict_extract(o) for o in outputs],
        "flexible": [flexible_extract(o) for o in outputs],
    }
    correct = {m: [p is not None and p == it.target for p, it in zip(preds[m], items)] for m in METRICS}
    return ConfigScore(name, list(outputs), preds, correct, wall_s)


def run_config(name: str, fn: GenerateFn, items: Sequence[TaskItem],
               prompt_fn: Callable[[str], str] = chat_prompt, batch_size: int | None = None) -> ConfigScore:
    prompts = [prompt_fn(it.question) for it in items]
    bs = batch_size or max(1, len(prompts))
    if bs < 1:
        raise ValueError(f"batch_size: expected >= 1, found {batch_size}")
    outputs: list[str] = []
    t0 = time.perf_counter()
    for s in range(0, len(prompts), bs):
        chunk = prompts[s:s + bs]
        got = list(fn(chunk))
        if len(got) != len(chunk):
            raise ValueError(f"generate_fn {name}: expected {len(chunk)} completions, found {len(got)}")
        outputs.extend(got)
    return score_outputs(name, items, outputs, time.perf_counter() - t0)


def greedy_agreement(a: Sequence[str], b: Sequence[str], tokenize: Callable[[str], list[int]]) -> dict[str, float]:
    """How far two greedy configurations produce the same text. Per item, both outputs are tokenized and their
    common prefix counted: `tokens` = sum of common prefixes / sum of the longer output's tokens (a token after
    the first disagreement never counts as agreeing: greedy sequences diverge from there), `identical` = the
    fraction of items whose outputs are equal."""
    same = total = identical = 0
    for x, y in zip(a, b):
        tx, ty = tokenize(x), tokenize(y)
        n = 0
        for u, v in zip(tx, ty):
            if u != v:
                break
            n += 1
        same += n
        total += max(len(tx), len(ty))
        identical += x == y
    return {"tokens": same / total if total else 1.0, "identical": identical / len(a) if len(a) else 1.0}


def compare(items: Sequence[TaskItem], configs: Mapping[str, GenerateFn],
            prompt_fn: Callable[[str], str] = chat_prompt, batch_size: int | None = None,
            tokenize: Callable[[str], list[int]] | None = None) -> Comparison:
    """Run exactly two configurations (in mapping order) on `items` and pair their scores (and, given a
    tokenizer, their greedy agreement)."""
    if len(configs) != 2:
        raise ValueError(f"configs: expected exactly 2 configurations, found {len(configs)} ({list(configs)})")
    if not items:
        raise ValueError("items: expected at least one task item, found none")
    (na, fa), (nb, fb) = configs.items()
    a = run_config(na, fa, items, prompt_fn, batch_size)
    b = run_config(nb, fb, items, prompt_fn, batch_size)
    paired = {}
    for m in METRICS:
        bb, cc = discordant(a.correct[m], b.correct[m])
        paired[m] = {"b": bb, "c": cc, "p_value": mcnemar_exact_p(bb, cc)}
    agreement = greedy_agreement(a.outputs, b.outputs, tokenize) if tokenize is not None else {}
    return Comparison(list(items), a, b, paired, agreement)


def format_report(cmp: Comparison) -> str:
    lines = [f"items: {len(cmp.items)}"]
    for s in (cmp.a, cmp.b):
        lines.append(f"{s.name}: strict EM {s.exact_match('strict'):.4f}  flexible EM {s.exact_match('flexible'):.4f}"
                     f"  ({s.wall_s:.1f} s)")
    for m, r in cmp.paired.items():
        lines.append(f"McNemar [{m}]: b={r['b']} ({cmp.a.name} only) c={r['c']} ({cmp.b.name} only) p={r['p_value']:.4g}")
    if cmp.agreement:
        lines.append(f"greedy agreement: {cmp.agreement['tokens']:.4f} of tokens (common prefixes), "
                     f"{cmp.agreement['identical']:.4f} of outputs identical")
    return "\n".join(lines)
