"""sample.race on the CPU (Triton interpreter): the same tokens as the torch sampler for temperature rows staged as the
decode graphs stage them, the keyed noise bit for bit, and bad arguments refused by name. The catalog's own
interpreter cells (tests/kernels/test_catalog_interp.py) compare it with its reference and check that the compare can
fail; tests/runtime/test_sampling_route.py checks which steps reach it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3serve.engine.sampler import sample_rows
from m3serve.keyed_noise import noise_from_seeds, row_seed
from m3serve.kernels.sample.race import RaceConfig, sample_race
from m3serve.runtime.decode_graphs import GREEDY_ROW, sampling_row, sampling_tensors


def _staged(rows: list[tuple[float, int]], vocab: int, gen: torch.Generator):
    """(temperature bits, top_k, top_p bits, key_lo, key_hi) int32 [R] as the decode step stages them, rows given as
    (temperature, key); positions int32 [R]."""
    packed = np.array([sampling_row(t, 0, 1.0, key) for t, key in rows], dtype=np.int32).T
    fields = tuple(torch.from_numpy(np.ascontiguousarray(f)) for f in packed)
    positions = torch.randint(0, 2 ** 31 - 2, (len(rows),), generator=gen, dtype=torch.int32)
    return fields, positions


@pytest.mark.parametrize("vocab,block", [(777, 256), (3840, 1024)])
def test_tokens_equal_the_torch_samplers_for_temperature_rows(vocab, block):
    gen = torch.Generator().manual_seed(vocab)
    temps = [0.0, 0.05, 0.4, 0.8, 1.0, 1.7, 5.0, 0.0]
    rows = [(t, int(torch.randint(0, 2 ** 62, (), generator=gen))) for t in temps]
    for trial in range(3):
        logits = (2.5 * torch.randn(len(rows), vocab, generator=gen)).to(torch.bfloat16).float()
        fields, positions = _staged(rows, vocab, gen)
        temperature, top_k, top_p, greedy, keys = sampling_tensors(*fields, vocab)
        want = sample_rows(logits, temperature, top_k, top_p, greedy, keys, positions.long() + 1)
        got = torch.full((len(rows),), -1, dtype=torch.int64)
        sample_race(logits, fields[0].view(torch.float32), fields[3], fields[4], positions, got,
                    RaceConfig(BLOCK=block))
        assert torch.equal(got, want), (trial, got.tolist(), want.tolist())


def test_the_keyed_noise_is_keyed_noise_bit_for_bit():
    """Flat logits at temperature 1: every p_v is the same value, so the draw is the first argmin of the noise row,
    which a hash off by one bit anywhere (key halves, counter, golden step, the 24 bits, the fp64 log) would move."""
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 24, 4096
    fields, positions = _staged([(1.0, int(torch.randint(0, 2 ** 63 - 1, (), generator=gen))) for _ in range(rows)],
                                vocab, gen)
    keys = sampling_tensors(*fields, vocab)[4]
    noise = noise_from_seeds(row_seed(keys, positions.long() + 1), vocab)
    got = torch.full((rows,), -1, dtype=torch.int64)
    sample_race(torch.zeros(rows, vocab), fields[0].view(torch.float32), fields[3], fields[4], positions, got,
                RaceConfig(BLOCK=1024))
    assert torch.equal(got, noise.argmin(-1))


def test_greedy_rows_take_the_first_maximum():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [5.0, 5.0, 5.0, 5.0]])
    got = torch.full((2,), -1, dtype=torch.int64)
    zero = torch.zeros(2, dtype=torch.int32)
    sample_race(logits, torch.zeros(2), zero, zero, zero, got, RaceConfig(BLOCK=2))
    assert got.tolist() == [1, 0]
    assert GREEDY_ROW[0] == 0     # the staged greedy row is temperature bits 0: the kernel's greedy test


def _args(r=2, v=64):
    z = torch.zeros(r, dtype=torch.int32)
    return [torch.randn(r, v), torch.ones(r), z, z.clone(), z.clone(), torch.empty(r, dtype=torch.int64)]


@pytest.mark.parametrize("index,bad,needle", [
    (0, torch.randn(2, 64).to(torch.bfloat16), "logits: expected dtype torch.float32"),
    (0, torch.randn(2, 64).t(), "logits: expected [R >= 1, V >= 1] with unit column stride"),
    (1, torch.ones(3), "temperature: expected shape (2,)"),
    (3, torch.zeros(2, dtype=torch.int64), "key_hi: expected dtype torch.int32"),
    (4, torch.zeros(2), "positions: expected dtype torch.int32"),
    (5, torch.empty(2, dtype=torch.int32), "tokens: expected dtype torch.int64"),
])
def test_bad_arguments_are_refused_by_name(index, bad, needle):
    args = _args()
    args[index] = bad
    with pytest.raises((TypeError, ValueError)) as err:
        sample_race(*args)
    assert needle in str(err.value)
