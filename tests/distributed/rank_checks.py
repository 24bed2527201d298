"""What each gloo rank computes for tests/distributed/test_tp_model.py (runs inside ranks.run_ranks).

Every rank computes the same full-size references itself, so a wrong result is visible on every rank and the
parent test compares plain numbers; ranks never branch on their own results (no rank can hang the others).
"""

from __future__ import annotations

import torch

from m3serve.distributed.protocol import ARGMAX, run_step
from m3serve.distributed.vocab import vocab_parallel_argmax, vocab_parallel_logprobs
from m3serve.engine.sampler import top_logprobs
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.model.parallel import SINGLE, TPGroup

VOCAB = 48          # splits over 2 and 4 ranks


def vocab_cases(seed: int = 0) -> torch.Tensor:
    """[8, VOCAB] fp32 logits with the cases a vocab-parallel argmax can get wrong."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, VOCAB, generator=g)
    x[1, 3] = x[1, VOCAB - 2] = 10.0          # tie across the first and last shard: the first index wins
    x[2, 5] = x[2, 7] = 10.0                  # tie inside one shard
    x[3, 1] = float("inf")                    # +inf early, NaN later: torch.argmax picks the NaN
    x[3, VOCAB - 5] = float("nan")
    x[4] = float("-inf")                      # all -inf: index 0
    x[5, 30] = x[5, 40] = float("nan")        # two NaNs: the first
    x[6, VOCAB - 1] = 10.0                    # the maximum at the very last id
    return x


def vocab_checks(rank: int, n: int) -> dict:
    tp = TPGroup(rank, n)
    per = VOCAB // n
    x = vocab_cases()
    got = vocab_parallel_argmax(x[:, rank * per:(rank + 1) * per].contiguous(), tp, rank * per)
    g = torch.Generator().manual_seed(1)
    y = torch.randn(5, VOCAB, generator=g) * 3                    # finite rows for logprobs
    tokens = torch.randint(0, VOCAB, (5,), generator=g)
    lp = vocab_parallel_logprobs(y[:, rank * per:(rank + 1) * per].contiguous(), tokens, 5, tp, rank * per)
    lp0 = vocab_parallel_logprobs(y[:, rank * per:(rank + 1) * per].contiguous(), tokens, 0, tp, rank * per)
    return {"argmax": got.tolist(), "argmax_ref": x.argmax(-1).tolist(),
            "lp": [t.tolist() for t in lp], "lp_ref": [t.tolist() for t in top_logprobs(y, tokens, 5)],
            "lp0_shapes": [tuple(t.shape) for t in lp0[1:]], "lp0_chosen": lp0[0].tolist()}


def _prompt(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _prompt_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ForwardBatch(ids, torch.arange(ids.numel()), [SeqSpan(0, ids.numel(), ids.numel())]))


def greedy_paged(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Prefill then `steps` decode steps through the paged cache, sampling with the vocab-parallel argmax."""
    cfg = model.cfg
    spec = KVCacheSpec.from_model_config(cfg, tp_size=model.tp.size, model_dtype=model.dtype)
    page = spec.page_size
    total = ids.numel() + steps
    kv = PagedKVCache(spec, -(-total // page) + 1, "cpu")
    slots = torch.arange(1, kv.num_slots, dtype=torch.int64)    # slot 0 unused: ids need not start at 0
    seq = ids.tolist()
    out: list[int] = []
    start = 0
    while len(out) < steps:
        pos = torch.arange(start, len(seq))
        flat = slots[pos // page] * page + pos % page
        batch = ForwardBatch(torch.tensor(seq[start:]), pos, [SeqSpan(0, pos.numel(), len(seq), slots)],
                             slot_mapping=flat, kv=kv, logits_rows=torch.tensor([pos.numel() - 1]))
        tok = int(run_step(model, batch, ARGMAX, 0).tokens[0])
        out.append(tok)
        start = len(seq)
        seq.append(tok)
    return out


def model_checks(rank: int, n: int, cases: list[tuple[str, str, int, int]]) -> dict:
    """cases: (name, model dir or preset, prompt length, decode steps). TP1 and TP-n logits and greedy tokens."""
    tp = TPGroup(rank, n)
    out = {}
    for name, path, length, steps in cases:
        kw = dict(dtype=torch.float32, random_weights=path == "tiny", keep_quantized=True)
        full = load_model(path, tp=SINGLE, **kw)
        shard = load_model(path, tp=tp, **kw)
        ids = _prompt(full.cfg.vocab_size, length, 7)
        ref, got = _prompt_logits(full, ids), _prompt_logits(shard, ids)
        out[name] = {"max_abs": (ref - got).abs().max().item(), "ref_scale": ref.abs().max().item(),
                     "tokens_ref": greedy_paged(full, ids, steps), "tokens_tp": greedy_paged(shard, ids, steps),
                     "argmax_ref": ref.argmax(-1).tolist(), "argmax_tp": got.argmax(-1).tolist()}
    return out


def all_checks(rank: int, n: int, cases) -> dict:
    return {"vocab": vocab_checks(rank, n), "model": model_checks(rank, n, cases)}
