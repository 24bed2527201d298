"""Which sampling steps the decode graphs' sampling variant draws with sample.race: temperature and greedy rows only.
A step with a row that asks for top-k (0 < k < V) or top-p (< 1) goes to the processed variant (neutral state rows,
the torch sampler), since the kernel reads temperature alone. The GPU side (tokens equal to the torch sampler's
through the graphs) is tests/runtime/test_decode_target_gpu.py."""

from __future__ import annotations

from m3serve.runtime.decode_graphs import GREEDY_ROW, filtered, race_config, sampling_row
from m3serve.targets import dispatch

V = 3840


def test_only_top_k_or_top_p_rows_leave_the_race():
    plain = [sampling_row(0.7, 0, 1.0, 5), sampling_row(1.3, -1, 1.0, 6), GREEDY_ROW,
             sampling_row(1.0, V, 1.0, 7), sampling_row(1.0, V + 10, 1.0, 8)]    # k >= V or <= 0: no top-k
    assert not filtered(plain, V)
    assert filtered(plain + [sampling_row(1.0, 40, 1.0, 9)], V)
    assert filtered(plain + [sampling_row(1.0, 0, 0.95, 9)], V)
    assert filtered([sampling_row(1.0, 1, 1.0, 9)], V)
    assert not filtered([], V)


def test_each_bucket_binds_the_race_by_its_dispatch_row(monkeypatch):
    from m3serve.kernels.sample import race
    assert race_config(1, V).BLOCK == 1024 and race_config(512, 200064).BLOCK == 2048
    assert race_config(513, V) is None           # past the table's rows: the torch sampler
    assert race_config(8, 1000) is None          # no certified vocabulary
    monkeypatch.setattr(race, "ENABLED", False)
    assert race_config(8, V) is None
    assert dispatch.TABLES["sample.race"] == (((1, 512), "sample.race"),)
