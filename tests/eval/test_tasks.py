from __future__ import annotations

import json
from pathlib import Path

import pytest

from m3serve.eval.tasks import load_task_file, parse_items


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_gsm8k_format(tmp_path: Path) -> None:
    recs = [{"question": "q1", "answer": "1 + 1 = 2\n#### 2"}, {"question": "q2", "answer": "#### 1,500", "x": 1}]
    p = _write(tmp_path / "t.jsonl", [json.dumps(r) for r in recs] + [""])
    items = load_task_file(p)
    assert [(it.index, it.question, it.target) for it in items] == [(0, "q1", "2"), (1, "q2", "1500")]
    assert len(load_task_file(p, limit=1)) == 1


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"t.jsonl:2: expected a JSON object"):
        load_task_file(_write(tmp_path / "t.jsonl", ['{"question": "a", "answer": "#### 1"}', "{oops"]))
    with pytest.raises(ValueError, match="item 0: field 'answer'"):
        parse_items([{"question": "a"}])
    with pytest.raises(ValueError, match="item 0: answer: expected a '#### N'"):
        parse_items([{"question": "a", "answer": "42"}])
    with pytest.raises(ValueError, match="expected at least one item"):
        load_task_file(_write(tmp_path / "e.jsonl", [""]))
