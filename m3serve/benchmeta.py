"""Provenance recorded with every benchmark result: GPU, commit, command, date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch


def git_commit() -> str:
    """$M3SERVE_COMMIT when set (the device machine receives a working-tree copy, whose .git, if any, may be
    stale), else HEAD of the checkout (+ "-dirty" when tracked files outside bench/results/ differ: a results file
    written by an earlier run of the same session changes no code that is measured)."""
    if os.environ.get("M3SERVE_COMMIT"):
        return os.environ["M3SERVE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        if out.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
            return out.stdout.strip() + ("-dirty" if changes_measured_code(status) else "")
    except OSError:
        pass
    return "unknown"


def changes_measured_code(porcelain_status: str) -> bool:
    """True when `git status --porcelain` lists a changed path outside bench/results/."""
    return any(line.strip() and not line[3:].strip().strip('"').startswith("bench/results/")
               for line in porcelain_status.splitlines())


def run_metadata() -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "date": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(), "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if gpu else 0, "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "host": platform.node()}
