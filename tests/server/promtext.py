"""A strict reader of Prometheus text exposition, for checking /metrics (no prometheus_client needed)."""

from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
                     r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)\})? (\S+)$')


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """-> (type of each metric family, {(sample name, sorted label items): value}). Raises on bad lines."""
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple], float] = {}
    assert text.endswith("\n"), "exposition must end with a newline"
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            assert name not in types, f"duplicate TYPE for {name}"
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        labels = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or "")))
        v = m.group(4)
        value = math.inf if v == "+Inf" else float(v)
        key = (m.group(1), labels)
        assert key not in samples, f"duplicate sample {key}"
        base = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in types or base in types, f"sample before its TYPE: {line}"
        samples[key] = value
    for name, kind in types.items():
        if kind == "histogram":
            buckets = sorted(((float(dict(k[1])["le"].replace("+Inf", "inf")), v) for k, v in samples.items()
                              if k[0] == name + "_bucket"))
            assert buckets and buckets[-1][0] == math.inf, f"{name}: no +Inf bucket"
            counts = [c for _, c in buckets]
            assert counts == sorted(counts), f"{name}: cumulative buckets decrease"
            assert counts[-1] == samples[(name + "_count", ())], f"{name}: +Inf bucket != count"
    return types, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
