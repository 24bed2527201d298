"""Reading /metrics in tests through prometheus_client's own parser (what a scraper accepts), plus the checks
`promtool check metrics` makes that the parser does not: counters end in _total, gauges do not, histograms'
buckets are cumulative and end at +Inf = _count."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """-> (type of each metric family, {(sample name, sorted label items): value}). Raises on bad input."""
    assert text.endswith("\n"), "exposition must end with a newline"
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in types, f"duplicate family {fam.name}"
        assert fam.type in ("counter", "gauge", "histogram", "summary", "untyped"), (fam.name, fam.type)
        assert fam.type != "gauge" or not fam.name.endswith("_total"), f"gauge named like a counter: {fam.name}"
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"duplicate sample {key}"
            if fam.type == "counter":
                assert s.name == fam.name + "_total", f"counter sample {s.name} lacks _total"
            samples[key] = s.value
        if fam.type == "histogram":
            groups: dict[tuple, list] = {}
            for s in fam.samples:
                if s.name == fam.name + "_bucket":
                    rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    groups.setdefault(rest, []).append((float(s.labels["le"]), s.value))
            for rest, buckets in groups.items():
                buckets.sort()
                assert buckets[-1][0] == math.inf, f"{fam.name}: no +Inf bucket"
                counts = [c for _, c in buckets]
                assert counts == sorted(counts), f"{fam.name}: cumulative buckets decrease"
                assert counts[-1] == samples[(fam.name + "_count", rest)], f"{fam.name}: +Inf bucket != count"
    return types, samples


def value(samples: dict, name: str, **labels) -> float:
    """A sample's value; the model_name label may be left out (any model)."""
    want = tuple(sorted(labels.items()))
    if (name, want) in samples:
        return samples[(name, want)]
    for (n, ls), v in samples.items():
        if n == name and tuple(kv for kv in ls if kv[0] != "model_name") == want:
            return v
    return 0.0
