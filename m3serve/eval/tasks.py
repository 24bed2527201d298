"""Task files: JSON lines of {"question": str, "answer": str}, the answer ending "#### N".

Both the synthetic arithmetic task (m3serve.train.synthetic) and GSM8K's jsonl use this
format; extra keys are ignored. The prompt for an item is the single-turn chat rendering
of its question (m3serve.train.tokenizer.chat_prompt).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from m3serve.eval.extract import reference_answer
from m3serve.train.synthetic import make_split

SYNTHETIC_TASK_FILE = "synthetic_heldout.jsonl"
SYNTHETIC_HELDOUT_N = 500  # the training default (presets.RUN_PRESETS["m3-tiny-verse"].n_syn_heldout)


@dataclass(frozen=True)
class TaskItem:
    index: int
    question: str
    answer: str
    target: str  # normalised number after "#### "


def parse_items(records: list[dict], source: str = "<records>") -> list[TaskItem]:
    items = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise TypeError(f"{source} item {i}: expected a JSON object, found {type(rec).__name__}")
        for key in ("question", "answer"):
            if not isinstance(rec.get(key), str):
                raise ValueError(f"{source} item {i}: field {key!r}: expected str, found {type(rec.get(key)).__name__}")
        try:
            target = reference_answer(rec["answer"])
        except ValueError as e:
            raise ValueError(f"{source} item {i}: {e}") from None
        items.append(TaskItem(i, rec["question"], rec["answer"], target))
    return items


def load_task_file(path: str | Path, limit: int | None = None) -> list[TaskItem]:
    """Read a jsonl task file (blank lines skipped); `limit` keeps the first items."""
    p = Path(path)
    records = []
    with open(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: expected a JSON object per line, found invalid JSON ({e.msg})") from None
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{p}: expected at least one item, found none")
    return parse_items(records, str(p))


def load_task(spec: str, model_dir: str, limit: int | None) -> list[TaskItem]:
    """`synthetic`: the model's held-out synthetic file if it ships one, else regenerated (seed 0)."""
    if spec != "synthetic":
        return load_task_file(spec, limit)
    shipped = Path(model_dir) / SYNTHETIC_TASK_FILE
    if shipped.exists():
        return load_task_file(shipped, limit)
    _, held = make_split(0, SYNTHETIC_HELDOUT_N, seed=0)
    items = parse_items([p.to_json() for p in held], "synthetic")
    return items[:limit] if limit is not None else items
