"""How many package files one decode step crosses (issue: a newcomer follows a step through <= 20 files). Traced on
the CPU stock path of the embedded model: LLMEngine.step of two decoding requests, host -> model -> host. The list
is the one docs/architecture.md names ("Files one decode step crosses")."""

from __future__ import annotations

import os
import sys

import m3serve
from m3serve import LLM, SamplingParams

ROOT = os.path.dirname(m3serve.__file__) + os.sep
LIMIT = 20


def _files_of_one_step() -> set[str]:
    llm = LLM(device="cpu")
    eng = llm.engine
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(2):
        eng.add_request([5 + i, 17, 99, 230, 7, 44], sp)
    for _ in range(3):          # prefill, then decode steps: the traced step decodes both requests
        eng.step()
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.add(frame.f_code.co_filename[len(ROOT):].replace(os.sep, "/"))

    sys.setprofile(profile)
    try:
        eng.step()
    finally:
        sys.setprofile(None)
    return seen


def test_a_decode_step_crosses_at_most_twenty_files() -> None:
    files = _files_of_one_step()
    assert "engine/engine.py" in files and "model/m3.py" in files   # the trace saw the step and the model
    assert len(files) <= LIMIT, f"{len(files)} files: {sorted(files)}"
    listed = open(os.path.join(ROOT, "..", "docs", "architecture.md")).read()
    missing = [f for f in sorted(files) if f"`{f}`" not in listed]
    assert not missing, f"docs/architecture.md does not list these files of a decode step: {missing}"
