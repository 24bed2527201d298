"""Token streams and batch sampling for pre-training.

Shape legend: N tokens in a stream, B batch rows, T sequence length.

A stream is one flat uint16 array: documents are wrapped as <|bos|> text <|eos|> and
concatenated; chat items are rendered with the chat template (which writes <|bos|> and
ends each turn with <|eos|>). A batch row is a random window of T + 1 tokens (input =
first T, target = last T), so sequences cross document boundaries as usual in packed
pre-training.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from m3serve.train.synthetic import Problem
from m3serve.train.tokenizer import BOS_ID, EOS_ID, render_chat


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """[N] uint16: <bos> doc <eos> for each text, concatenated."""
    parts = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        parts.append(np.asarray([BOS_ID] + enc.ids + [EOS_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def chat_text(p: Problem) -> str:
    return render_chat([{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}])


def encode_chats(tok: Tokenizer, problems: Sequence[Problem]) -> np.ndarray:
    """[N] uint16: each problem as a full user/assistant exchange, concatenated."""
    encs = tok.encode_batch([chat_text(p) for p in problems], add_special_tokens=False)
    parts = [np.asarray(e.ids, dtype=np.uint16) for e in encs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


@dataclass
class TokenStream:
    ids: np.ndarray  # [N] uint16
    name: str = "stream"

    def __post_init__(self) -> None:
        if self.ids.ndim != 1 or self.ids.dtype != np.uint16:
            raise TypeError(f"{self.name}.ids: expected a 1-D uint16 array, found {self.ids.ndim}-D {self.ids.dtype}")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def _check(self, seq_len: int) -> None:
        if len(self) < seq_len + 1:
            raise ValueError(f"{self.name}: expected at least seq_len + 1 = {seq_len + 1} tokens, found {len(self)}")

    def sample(self, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """[batch, seq_len + 1] int64 random windows (seeded by `gen`)."""
        self._check(seq_len)
        starts = torch.randint(0, len(self) - seq_len, (batch,), generator=gen).numpy()
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        return torch.from_numpy(self.ids[idx].astype(np.int64))

    def fixed_windows(self, count: int, seq_len: int) -> torch.Tensor:
        """[k, seq_len + 1] evenly spaced, non-overlapping windows (k <= count): a fixed eval set."""
        self._check(seq_len)
        k = max(1, min(count, len(self) // (seq_len + 1)))
        stride = len(self) // k  # >= seq_len + 1 because k <= N // (seq_len + 1)
        idx = (np.arange(k) * stride)[:, None] + np.arange(seq_len + 1)[None, :]
        return torch.from_numpy(self.ids[idx].astype(np.int64))
