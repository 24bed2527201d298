from __future__ import annotations

import numpy as np
import pytest
import torch

from m3serve.train.stream import TokenStream, encode_chats, encode_documents
from m3serve.train.synthetic import make_split
from m3serve.train.tokenizer import BOS_ID, EOS_ID, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["the quick brown fox jumps over the lazy dog 0123456789 " * 50], vocab_size=300)


def test_encode_documents_wraps_each_doc(tok) -> None:
    ids = encode_documents(tok, ["the fox", "lazy dog"])
    assert ids.dtype == np.uint16
    a, b = tok.encode("the fox").ids, tok.encode("lazy dog").ids
    assert ids.tolist() == [BOS_ID, *a, EOS_ID, BOS_ID, *b, EOS_ID]


def test_encode_chats(tok) -> None:
    _, held = make_split(0, 3, seed=0)
    ids = encode_chats(tok, held).tolist()
    assert ids.count(BOS_ID) == 3 and ids.count(EOS_ID) == 6  # one <eos> per turn
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID


def test_sampling_and_windows() -> None:
    s = TokenStream(np.arange(1000, dtype=np.uint16), "s")
    x = s.sample(4, 16, torch.Generator().manual_seed(0))
    y = s.sample(4, 16, torch.Generator().manual_seed(0))
    assert x.shape == (4, 17) and x.dtype == torch.int64 and torch.equal(x, y)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # contiguous windows
    w = s.fixed_windows(10, 99)
    assert w.shape == (10, 100)
    starts = w[:, 0].tolist()
    assert all(b - a >= 100 for a, b in zip(starts, starts[1:]))  # non-overlapping
    assert s.fixed_windows(50, 99).shape[0] == 10  # capped by the stream length
    with pytest.raises(ValueError, match="s: expected at least seq_len \\+ 1 = 1001 tokens, found 1000"):
        s.sample(1, 1000, torch.Generator())
    with pytest.raises(TypeError, match="1-D uint16"):
        TokenStream(np.arange(10, dtype=np.int64))
