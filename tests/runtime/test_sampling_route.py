"""Which sampling steps the decode graphs' sampling variant draws with sample.race: temperature and greedy rows only.
A step with a row that asks for top-k (0 < k < V) or top-p (< 1) goes to the processed variant (neutral state rows,
the torch sampler), since the kernel reads temperature alone. The GPU side (tokens equal to the torch sampler's
through the graphs) is tests/runtime/test_decode_target_gpu.py."""

from __future__ import annotations

import numpy as np

from m3serve.runtime.decode_graphs import GREEDY_ROW, filtered as filtered_rows, pack_decode, race_config, sampling_row

V = 3840


def filtered(rows, vocab):
    return filtered_rows(np.asarray(rows, dtype=np.int32).reshape(-1, 5), vocab)


def test_only_top_k_or_top_p_rows_leave_the_race():
    plain = [sampling_row(0.7, 0, 1.0, 5), sampling_row(1.3, -1, 1.0, 6), GREEDY_ROW,
             sampling_row(1.0, V, 1.0, 7), sampling_row(1.0, V + 10, 1.0, 8)]    # k >= V or <= 0: no top-k
    assert not filtered(plain, V)
    assert filtered(plain + [sampling_row(1.0, 40, 1.0, 9)], V)
    assert filtered(plain + [sampling_row(1.0, 0, 0.95, 9)], V)
    assert filtered([sampling_row(1.0, 1, 1.0, 9)], V)
    assert not filtered([], V)


def test_the_staged_payload_is_the_same_from_rows_or_their_array():
    rows = [sampling_row(0.7, 40, 0.9, 2 ** 40 + 5), GREEDY_ROW]
    a = pack_decode(4, [3, 4], [10, 11], rows, [1, 2], neutral_row=8)
    b = pack_decode(4, [3, 4], [10, 11], np.asarray(rows, dtype=np.int32), [1, 2], neutral_row=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert a[2][2 * 4:7 * 4].reshape(5, 4)[:, :2].T.tolist() == [list(r) for r in rows]


def test_each_bucket_binds_the_race_by_its_dispatch_row(monkeypatch):
    from m3serve.kernels.sample import race
    assert race_config(1, V).BLOCK == 1024 and race_config(512, 200064).BLOCK == 2048
    assert race_config(513, V) is None           # past the table's rows: the torch sampler
    assert race_config(8, 1000) is None          # no certified vocabulary
    monkeypatch.setattr(race, "ENABLED", False)
    assert race_config(8, V) is None
