"""Reference generation: the stock model's full forward recomputed every step, no KV cache.

Slow (O(n^2) per sequence) but independent of the engine, so it is the baseline
configuration an engine is compared against, and what training uses to measure exact
match. Prompts of equal token length are batched together (forward_train takes no padding
mask), so every sequence sees exactly its own tokens from position 0.

Shape legend: B prompts in a bucket, n current length, V vocab.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch


@torch.no_grad()
def generate_tokens(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None,
                    temperature: float = 0.0, generator: torch.Generator | None = None,
                    max_batch: int = 64) -> list[list[int]]:
    """New tokens per prompt (eos included when produced). temperature 0 = greedy."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, found {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}]: expected at least one token, found none")
    device = model.device
    out: list[list[int]] = [[] for _ in prompts]
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        buckets[len(p)].append(i)
    for _, members in sorted(buckets.items()):
        for s in range(0, len(members), max_batch):
            rows = members[s:s + max_batch]
            ids = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                logits, _ = model.forward_train(ids)
                last = logits[:, -1].float()                                            # [B, V]
                if temperature > 0:
                    probs = torch.softmax(last / temperature, dim=-1)
                    nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)
                else:
                    nxt = last.argmax(dim=-1)
                for r, t in zip(rows, torch.where(done, -1, nxt).tolist()):
                    if t >= 0:
                        out[r].append(t)
                if eos_id is not None:
                    done |= nxt == eos_id
                if bool(done.all()):
                    break
                ids = torch.cat([ids, nxt[:, None]], dim=1)
    return out


def make_reference_generate_fn(model, tokenizer, max_new_tokens: int = 64,
                               max_batch: int = 64) -> Callable[[list[str]], list[str]]:
    """generate_fn(prompts) -> greedy completions (special tokens dropped), for the eval harness.

    Prompts are complete texts (chat prompts already rendered, <|bos|> included), encoded
    without adding special tokens.
    """
    eos = tokenizer.eos_token_id

    def generate_fn(prompts: list[str]) -> list[str]:
        enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        new = generate_tokens(model, enc, max_new_tokens, eos, max_batch=max_batch)
        return [tokenizer.decode(t, skip_special_tokens=True) for t in new]

    return generate_fn
