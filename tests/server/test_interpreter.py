"""The serving process's interpreter settings (m3serve/server/interpreter.py) and their `m3serve serve` flags."""

from __future__ import annotations

import argparse
import gc
import sys

import pytest

from m3serve.server import cli as server_cli
from m3serve.server.interpreter import SHORT_SWITCH_INTERVAL_MS, check_switch_interval, tune_for_serving


@pytest.fixture
def restore_interpreter():
    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)
    gc.unfreeze()


def test_tune_sets_the_switch_interval_and_freezes_the_start_up_heap(restore_interpreter):
    gc.unfreeze()
    survivor = [[] for _ in range(1000)]          # start-up objects (tracked containers), alive when serving starts
    done = tune_for_serving(0.3, freeze_heap=True)
    assert sys.getswitchinterval() == pytest.approx(0.3e-3)
    assert done["switch_interval_ms"] == pytest.approx(0.3)
    assert done["frozen_objects"] == gc.get_freeze_count() >= len(survivor)
    # the frozen ones are out of the collector's generations; what serving allocates later stays in them
    later = [[] for _ in range(10)]
    tracked = {id(o) for o in gc.get_objects()}
    assert id(survivor[0]) not in tracked and id(later[0]) in tracked


def test_tune_without_freeze_leaves_the_heap_to_the_collector(restore_interpreter):
    gc.unfreeze()
    done = tune_for_serving(5.0, freeze_heap=False)
    assert done == {"switch_interval_ms": pytest.approx(5.0), "frozen_objects": 0} and gc.get_freeze_count() == 0


def test_the_default_keeps_the_interpreters_switch_interval(restore_interpreter):
    sys.setswitchinterval(0.0042)
    done = tune_for_serving()
    assert sys.getswitchinterval() == pytest.approx(0.0042) and done["switch_interval_ms"] == pytest.approx(4.2)
    assert done["frozen_objects"] > 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "0.2"])
def test_a_bad_switch_interval_names_the_flag(bad, restore_interpreter):
    before = sys.getswitchinterval()
    with pytest.raises(ValueError, match=r"--switch-interval-ms: expected milliseconds > 0"):
        tune_for_serving(bad)
    assert sys.getswitchinterval() == before
    assert check_switch_interval(SHORT_SWITCH_INTERVAL_MS) == SHORT_SWITCH_INTERVAL_MS


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    server_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_serve_flags_parse_and_a_bad_interval_exits_2_before_the_model_loads(capsys):
    a = _serve_args("tiny", "--switch-interval-ms", "0.5", "--no-gc-freeze")
    assert (a.switch_interval_ms, a.no_gc_freeze) == (0.5, True)
    d = _serve_args("tiny")
    assert (d.switch_interval_ms, d.no_gc_freeze) == (None, False)
    # the model directory does not exist: reaching the load would fail differently
    assert server_cli.run(_serve_args("/nonexistent/model", "--switch-interval-ms", "0")) == 2
    err = capsys.readouterr().err
    assert "m3serve serve: --switch-interval-ms: expected milliseconds > 0 (and < 1e6), found 0.0" in err
