from __future__ import annotations

import pytest
import torch

from m3serve.eval.reference import generate_tokens
from m3serve.model.m3 import M3ForCausalLM
from m3serve.train.presets import model_config


@pytest.fixture(scope="module")
def model() -> M3ForCausalLM:
    torch.backends.cuda.matmul.allow_tf32 = False
    m = M3ForCausalLM(model_config("toy", 300), device="cpu", dtype=torch.float32)
    m.init_random(3, std=0.2)  # a large std gives peaked logits: greedy picks are far from ties
    m.eval()
    return m


def _naive(model: M3ForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits, _ = model.forward_train(torch.tensor([ids]))
        t = int(logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
    return out


def test_batched_greedy_matches_one_at_a_time(model: M3ForCausalLM) -> None:
    g = torch.Generator().manual_seed(0)
    # Mixed lengths (two share a length, so one bucket holds two rows); 30 > 16 so MSA selection is active.
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 30, 5, 11)]
    got = generate_tokens(model, prompts, 6, eos_id=None)
    assert got == [_naive(model, p, 6) for p in prompts]


def test_eos_stops_only_its_row(model: M3ForCausalLM) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 7, 9)]
    free = generate_tokens(model, prompts, 8, eos_id=None)
    eos = free[0][0]
    got = generate_tokens(model, prompts, 8, eos_id=eos)
    for f, o in zip(free, got):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert o == f[:cut]
    assert got[0] == [eos]


def test_sampling_is_seeded(model: M3ForCausalLM) -> None:
    p = [[5, 6, 7, 8]]
    a = generate_tokens(model, p, 10, None, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = generate_tokens(model, p, 10, None, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert a == b and len(a[0]) == 10


def test_bad_input(model: M3ForCausalLM) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected at least one token"):
        generate_tokens(model, [[1], []], 2, None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_tokens(model, [[1]], -1, None)
