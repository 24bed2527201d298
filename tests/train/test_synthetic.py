from __future__ import annotations

import json
import operator
import re
from pathlib import Path

from m3serve.eval.extract import reference_answer
from m3serve.train.synthetic import make_split, write_jsonl

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def test_answers_are_correct_and_consistent() -> None:
    train, held = make_split(3000, 200, seed=5)
    for p in train + held:
        *steps, final = p.answer.split("\n")
        assert final == f"#### {p.value}" and reference_answer(p.answer) == str(p.value)
        prev = None
        for s in steps:
            m = re.fullmatch(r"(\d+) ([-+*/]) (\d+) = (-?\d+)", s)
            assert m, s
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert OPS[op](a, b) == c and (op != "/" or a % b == 0)
            assert prev is None or a == prev  # each step uses the previous result
            assert str(a) in p.question or a == prev
            prev = c
        assert prev == p.value >= 0


def test_deterministic_disjoint_and_varied() -> None:
    t1, h1 = make_split(500, 100, seed=1)
    t2, h2 = make_split(500, 100, seed=1)
    assert t1 == t2 and h1 == h2
    assert {p.question for p in t1}.isdisjoint(p.question for p in h1)
    assert len({p.question for p in h1}) == 100  # held-out items are unique
    _, h3 = make_split(0, 100, seed=1)
    assert h3 == h1  # the held-out set does not depend on the training-set size
    _, h4 = make_split(0, 100, seed=2)
    assert h4 != h1
    kinds = {p.answer.count("\n") for p in t1} | {s for p in t1 for s in "+-*/" if f" {s} " in p.answer}
    assert kinds >= {1, 2, "+", "-", "*", "/"}


def test_write_jsonl(tmp_path: Path) -> None:
    _, held = make_split(0, 3, seed=0)
    write_jsonl(held, tmp_path / "h.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert rows == [{"question": p.question, "answer": p.answer} for p in held]
