"""Synthetic arithmetic word problems with exact integer answers.

Each item is GSM8K-shaped: {"question": str, "answer": str} where the answer shows the
worked steps, one per line, and ends with "#### N". The same extraction code
(m3serve.eval.extract) scores both this task and GSM8K.

Generation is deterministic in the seed. The held-out split is drawn first from its own
random stream, and the training split excludes every held-out question, so no held-out
question is ever trained on.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

NAMES = (
    "Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kit", "Lena",
    "Milo", "Nora", "Otto", "Pia", "Quin", "Rosa", "Sam", "Tess", "Uma", "Vic", "Wren", "Zoe",
)
ITEMS = (
    "apples", "books", "coins", "pens", "shells", "stamps", "marbles", "cards", "eggs",
    "pears", "plums", "rings", "ribbons", "stones", "candles", "buttons", "lemons", "kites",
)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # worked steps + "\n#### N"
    value: int

    def to_json(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer}


def _finish(question: str, steps: list[str], value: int) -> Problem:
    return Problem(question, "\n".join(steps + [f"#### {value}"]), value)


def _add(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 99), r.randint(2, 99)
    q = f"{n} has {a} {it}. {n} gets {b} more. How many {it} does {n} have now?"
    return _finish(q, [f"{a} + {b} = {a + b}"], a + b)


def _sub(r: random.Random) -> Problem:
    n, m, it = r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    a = r.randint(5, 99)
    b = r.randint(1, a - 1)
    q = f"{n} had {a} {it} and gave {b} of them to {m}. How many {it} does {n} have left?"
    return _finish(q, [f"{a} - {b} = {a - b}"], a - b)


def _mul(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 12), r.randint(2, 12)
    q = f"{n} buys {a} boxes of {it}. Each box holds {b} {it}. How many {it} does {n} buy?"
    return _finish(q, [f"{a} * {b} = {a * b}"], a * b)


def _div(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 12), r.randint(2, 12)
    q = f"{n} shares {a * b} {it} equally among {b} friends. How many {it} does each friend get?"
    return _finish(q, [f"{a * b} / {b} = {a}"], a)


def _add_sub(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 60), r.randint(2, 39)
    c = r.randint(1, a + b - 1)
    s = a + b
    q = f"{n} has {a} {it}, finds {b} more and then loses {c}. How many {it} does {n} have?"
    return _finish(q, [f"{a} + {b} = {s}", f"{s} - {c} = {s - c}"], s - c)


def _mul_add(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(2, 9), r.randint(2, 9), r.randint(1, 30)
    p = a * b
    q = f"{n} fills {a} bags with {b} {it} each and keeps {c} more in a pocket. How many {it} does {n} have?"
    return _finish(q, [f"{a} * {b} = {p}", f"{p} + {c} = {p + c}"], p + c)


GENERATORS: tuple[Callable[[random.Random], Problem], ...] = (_add, _sub, _mul, _div, _add_sub, _mul_add)


def make_problem(r: random.Random) -> Problem:
    return r.choice(GENERATORS)(r)


def make_split(n_train: int, n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Deterministic (train, heldout) with disjoint question texts."""
    if n_train < 0 or n_heldout < 0:
        raise ValueError(f"n_train/n_heldout: expected >= 0, found {n_train}/{n_heldout}")
    held: list[Problem] = []
    seen: set[str] = set()
    rh = random.Random(f"m3serve-synthetic-heldout-{seed}")
    while len(held) < n_heldout:
        p = make_problem(rh)
        if p.question not in seen:
            seen.add(p.question)
            held.append(p)
    train: list[Problem] = []
    rt = random.Random(f"m3serve-synthetic-train-{seed}")
    # Train items may repeat among themselves (the space is finite for some templates);
    # only overlap with held-out is forbidden.
    while len(train) < n_train:
        p = make_problem(rt)
        if p.question not in seen:
            train.append(p)
    return train, held


def write_jsonl(problems: Iterable[Problem], path: str | Path) -> None:
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps(p.to_json()) + "\n")
