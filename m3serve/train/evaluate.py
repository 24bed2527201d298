"""Quality measurements written into the training report.

- held-out loss: next-token cross-entropy on fixed windows of held-out text / synthetic chats;
- indexer: attention mass captured by the indexer's selection on held-out text (vs random, oracle);
- exact match: greedy answers to held-out synthetic problems, scored like GSM8K;
- samples: a few continuations, for a human look.

Shape legend: k windows, T sequence length, V vocab.
"""
from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from m3serve.eval.harness import score_outputs
from m3serve.eval.reference import generate_tokens, make_reference_generate_fn
from m3serve.eval.tasks import parse_items
from m3serve.train.indexer import selection_share
from m3serve.train.synthetic import Problem
from m3serve.train.tokenizer import chat_prompt


def autocast_ctx(device: torch.device, enabled: bool):
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int, autocast: bool = False) -> float:
    """Mean next-token CE (nats/token) over windows [k, T + 1]."""
    total, count = 0.0, 0
    dev = model.device
    for s in range(0, windows.shape[0], batch_size):
        w = windows[s:s + batch_size].to(dev)
        with autocast_ctx(dev, autocast):
            logits, _ = model.forward_train(w[:, :-1])
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += float(ce)
        count += w[:, 1:].numel()
    return total / count


@torch.no_grad()
def indexer_quality(model, windows: torch.Tensor, batch_size: int, autocast: bool = False) -> dict:
    """Per MSA layer and averaged: mass captured by the selection on windows [k, T + 1]."""
    cfg = model.cfg
    dev = model.device
    per_layer: list[list[dict]] = []
    for s in range(0, windows.shape[0], batch_size):
        w = windows[s:s + batch_size, :-1].to(dev)
        with autocast_ctx(dev, autocast):
            _, stats = model.forward_train(w, indexer_stats=True, sparse_attention=True)
        for i, (logits, mass) in enumerate(stats):
            if len(per_layer) <= i:
                per_layer.append([])
            per_layer[i].append(selection_share(logits, mass, cfg.index_block_size, cfg.index_topk_blocks,
                                                cfg.index_local_blocks, cfg.index_init_blocks))
    layers = []
    for i, rows in enumerate(per_layer):
        n = sum(r["active_queries"] for r in rows)
        avg = {k: (sum(r[k] * r["active_queries"] for r in rows) / n if n else 1.0)
               for k in ("captured", "random", "oracle")}
        layers.append({"layer": cfg.sparse_layers[i], **avg, "active_queries": n})
    mean = {k: (sum(x[k] for x in layers) / len(layers) if layers else float("nan"))
            for k in ("captured", "random", "oracle")}
    return {"captured_share": mean["captured"], "random_share": mean["random"], "oracle_share": mean["oracle"],
            "seq_len": int(windows.shape[1] - 1), "block_size": cfg.index_block_size,
            "topk_blocks": cfg.index_topk_blocks, "per_layer": layers}


def synthetic_exact_match(model, tokenizer, problems: Sequence[Problem], max_new_tokens: int,
                          examples: int = 5) -> dict:
    items = parse_items([p.to_json() for p in problems], "synthetic_heldout")
    fn = make_reference_generate_fn(model, tokenizer, max_new_tokens)
    outputs = fn([chat_prompt(it.question) for it in items])
    score = score_outputs("reference", items, outputs)
    return {
        "n": len(items),
        "strict": score.exact_match("strict"),
        "flexible": score.exact_match("flexible"),
        "examples": [{"question": it.question, "target": it.target, "output": o}
                     for it, o in zip(items[:examples], outputs[:examples])],
    }


def samples(model, tokenizer, text_prompts: Sequence[str], chat_questions: Sequence[str],
            max_new_tokens: int, temperature: float, seed: int) -> list[dict]:
    """Text continuations sampled at `temperature` (seeded) and greedy chat answers."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in text_prompts]
    for p, new in zip(text_prompts, generate_tokens(model, enc, max_new_tokens, tokenizer.eos_token_id,
                                                    temperature=temperature, generator=gen, max_batch=1)):
        out.append({"prompt": p, "mode": f"sampled T={temperature} seed={seed}",
                    "completion": tokenizer.decode(new, skip_special_tokens=True)})
    fn = make_reference_generate_fn(model, tokenizer, max_new_tokens)
    for q, c in zip(chat_questions, fn([chat_prompt(q) for q in chat_questions])):
        out.append({"prompt": q, "mode": "chat greedy", "completion": c})
    return out


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")
