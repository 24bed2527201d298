from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from m3serve.eval import cli, tasks
from m3serve.train.synthetic import make_split


def test_synthetic_task_regenerates_the_training_heldout(tmp_path: Path) -> None:
    items = tasks.load_task("synthetic", str(tmp_path), limit=5)
    _, held = make_split(0, tasks.SYNTHETIC_HELDOUT_N, seed=0)
    assert [it.question for it in items] == [p.question for p in held[:5]]
    (tmp_path / tasks.SYNTHETIC_TASK_FILE).write_text(json.dumps({"question": "q", "answer": "#### 3"}) + "\n")
    shipped = tasks.load_task("synthetic", str(tmp_path), limit=None)
    assert [(it.question, it.target) for it in shipped] == [("q", "3")]


def test_run_with_registered_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    task = tmp_path / "t.jsonl"
    task.write_text("".join(json.dumps({"question": f"{i}?", "answer": f"#### {i}"}) + "\n" for i in range(6)))
    seen = []

    def builder(model_dir: str, options: str, device: str):
        seen.append((model_dir, options, device))
        right = int(options)
        return lambda prompts: [f"#### {k if k < right else -1}" for k in range(len(prompts))]

    cli.register_config("fake", builder)
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    args = ap.parse_args(["--model", "M", "--task", str(task), "--config-a", "fake:6", "--config-b", "fake:2",
                          "--device", "cpu", "--json", str(tmp_path / "r.json")])
    cmp = cli.run(args)
    assert seen == [("M", "6", "cpu"), ("M", "2", "cpu")]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["paired"]["strict"]["b"] == 4 and r["paired"]["strict"]["c"] == 0
    assert r["configs"]["fake:6"]["exact_match_strict"] == 1.0 and len(r["items"]) == 6
    assert cmp.paired["strict"]["p_value"] == 0.125
    assert "McNemar [strict]: b=4" in capsys.readouterr().out
    assert r["agreement"]["identical"] == 2 / 6 and r["agreement_unit"] == "characters"
    # the recorded outputs replay as a configuration of a later run (on another machine, say)
    args = ap.parse_args(["--model", "M", "--task", str(task), "--config-a", "fake:3",
                          "--config-b", f"recorded:{tmp_path / 'r.json'}#fake:2", "--device", "cpu"])
    again = cli.run(args)
    assert again.b.outputs == cmp.b.outputs and again.paired["strict"]["b"] == 1
    args = ap.parse_args(["--model", "M", "--task", str(task), "--limit", "2", "--config-a", "fake:3",
                          "--config-b", f"recorded:{tmp_path / 'r.json'}#fake:7", "--device", "cpu"])
    with pytest.raises(ValueError, match="no configuration 'fake:7'"):
        cli.run(args)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "never asked", "answer": "#### 1"}) + "\n")
    args = ap.parse_args(["--model", "M", "--task", str(other), "--config-a", "fake:3",
                          "--config-b", f"recorded:{tmp_path / 'r.json'}#fake:2", "--device", "cpu"])
    with pytest.raises(ValueError, match="1 prompts were not recorded"):
        cli.run(args)


def test_bad_specs() -> None:
    with pytest.raises(ValueError, match="expected a kind in"):
        cli.build_config("nope:1", "M", "cpu")
    with pytest.raises(ValueError, match="kind: expected a non-empty name"):
        cli.register_config("a:b", lambda m, o, d: (lambda p: p))
