"""sample.race on the CPU (Triton interpreter): the same tokens as the torch sampler for temperature and top-p rows
staged as the decode graphs stage them (ties in the nucleus included), the keyed noise bit for bit, and bad arguments
refused by name. The catalog's own
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


def _staged(rows: list[tuple], vocab: int, gen: torch.Generator):
    """(temperature bits, top_k, top_p bits, key_lo, key_hi) int32 [R] as the decode step stages them, rows given as
    (temperature, key) or (temperature, key, top_p); positions int32 [R]."""
    packed = np.array([sampling_row(r[0], 0, r[2] if len(r) > 2 else 1.0, r[1]) for r in rows], dtype=np.int32).T
    fields = tuple(torch.from_numpy(np.ascontiguousarray(f)) for f in packed)
    positions = torch.randint(0, 2 ** 31 - 2, (len(rows),), generator=gen, dtype=torch.int32)
    return fields, positions


def _race(logits, fields, positions, block):
    got = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    return sample_race(logits, fields[0].view(torch.float32), fields[2].view(torch.float32), fields[3], fields[4],
                       positions, got, RaceConfig(BLOCK=block, SUB=min(block, 256)))


@pytest.mark.parametrize("vocab,block", [(777, 256), (3840, 1024)])
def test_tokens_equal_the_torch_samplers_for_temperature_and_top_p_rows(vocab, block):
    gen = torch.Generator().manual_seed(vocab)
    rows = [(0.0, 1.0), (0.05, 1.0), (0.4, 0.9), (0.8, 1.0), (1.0, 0.5), (1.7, 0.95), (5.0, 0.2), (0.0, 0.7),
            (1.2, 0.05)]
    rows = [(t, int(torch.randint(0, 2 ** 62, (), generator=gen)), p) for t, p in rows]
    for trial in range(2):
        # bf16 logits, then whole numbers (many ties): tied probabilities at the nucleus' edge stay or go together
        logits = (2.5 * torch.randn(len(rows), vocab, generator=gen)).to(torch.bfloat16).float()
        if trial == 1:
            logits = logits.round()
        fields, positions = _staged(rows, vocab, gen)
        temperature, top_k, top_p, greedy, keys = sampling_tensors(*fields, vocab)
        want = sample_rows(logits, temperature, top_k, top_p, greedy, keys, positions.long() + 1)
        got = _race(logits, fields, positions, block)
        assert torch.equal(got, want), (trial, got.tolist(), want.tolist())


def test_the_nucleus_decides_the_draw():
    """A hot row whose race winner over the whole vocabulary lies outside a 0.3 nucleus: with top_p the draw moves
    inside it, exactly where the torch sampler's does."""
    gen = torch.Generator().manual_seed(9)
    vocab = 512
    logits = torch.linspace(3.0, -3.0, vocab).expand(16, vocab).contiguous()
    rows = [(3.0, int(torch.randint(0, 2 ** 62, (), generator=gen)), 1.0) for _ in range(16)]
    fields, positions = _staged(rows, vocab, gen)
    free = _race(logits, fields, positions, 256)
    nucleus_rows = [(t, k, 0.3) for t, k, _ in rows]
    fields_p, _ = _staged(nucleus_rows, vocab, gen)
    inside = _race(logits, fields_p, positions, 256)
    temperature, top_k, top_p, greedy, keys = sampling_tensors(*fields_p, vocab)
    assert torch.equal(inside, sample_rows(logits, temperature, top_k, top_p, greedy, keys, positions.long() + 1))
    kept = int((torch.softmax(logits[0] / 3.0, -1).cumsum(0) < 0.3).sum()) + 1
    assert bool((inside < kept).all()) and bool((free >= kept).any())


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
    sample_race(torch.zeros(rows, vocab), fields[0].view(torch.float32), torch.ones(rows), fields[3], fields[4],
                positions, got, RaceConfig(BLOCK=1024))
    assert torch.equal(got, noise.argmin(-1))


def test_greedy_rows_take_the_first_maximum():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [5.0, 5.0, 5.0, 5.0]])
    got = torch.full((2,), -1, dtype=torch.int64)
    zero = torch.zeros(2, dtype=torch.int32)
    sample_race(logits, torch.zeros(2), torch.full((2,), 0.5), zero, zero, zero, got, RaceConfig(BLOCK=2))
    assert got.tolist() == [1, 0]
    assert GREEDY_ROW[0] == 0     # the staged greedy row is temperature bits 0: the kernel's greedy test


def _args(r=2, v=64):
    z = torch.zeros(r, dtype=torch.int32)
    return [torch.randn(r, v), torch.ones(r), torch.ones(r), z, z.clone(), z.clone(), torch.empty(r, dtype=torch.int64)]


@pytest.mark.parametrize("index,bad,needle", [
    (0, torch.randn(2, 64).to(torch.bfloat16), "logits: expected dtype torch.float32"),
    (0, torch.randn(2, 64).t(), "logits: expected [R >= 1, V >= 1] with unit column stride"),
    (1, torch.ones(3), "temperature: expected shape (2,)"),
    (2, torch.ones(2, dtype=torch.float64), "top_p: expected dtype torch.float32"),
    (4, torch.zeros(2, dtype=torch.int64), "key_hi: expected dtype torch.int32"),
    (5, torch.zeros(2), "positions: expected dtype torch.int32"),
    (6, torch.empty(2, dtype=torch.int32), "tokens: expected dtype torch.int64"),
])
def test_bad_arguments_are_refused_by_name(index, bad, needle):
    args = _args()
    args[index] = bad
    with pytest.raises((TypeError, ValueError)) as err:
        sample_race(*args)
    assert needle in str(err.value)
