"""The streaming detokenizer's guarantee (pieces concatenate to the
final text, and nothing past a stop string is ever released)."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.server.detok import TextStream
from m3serve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@settings(max_examples=150, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, 511), min_size=1, max_size=30), stop_at=st.integers(0, 40),
       stop_len=st.integers(1, 4), split=st.integers(1, 3))
def test_stream_pieces_concatenate_and_never_pass_a_stop(tok, ids, stop_at, stop_len, split):
    full = tok.decode(ids, skip_special_tokens=True)
    stop = full[stop_at:stop_at + stop_len] if stop_at < len(full) else None
    stop = stop if stop and "\ufffd" not in stop else None
    # Emulate the engine: after each token, the first occurrence of the stop string ends the request.
    ts = TextStream(tok, [stop] if stop else [])
    sent, final = "", None
    last: list[int] = []
    for k in range(0, len(ids), split):
        text = tok.decode(ids[:k + split], skip_special_tokens=True)
        if stop and stop in text:
            final, last = text[:text.find(stop)], ids[k:k + split]
            assert final.startswith(sent), (sent, final)     # nothing past the stop was released
            break
        sent += ts.push(ids[k:k + split])
        assert text.startswith(sent)
    sent += ts.finish(final, last)
    assert sent == (final if final is not None else full)


def test_stream_without_tokenizer_is_empty():
    ts = TextStream(None, ["x"])
    assert ts.push([1, 2]) == "" and ts.finish() == ""


def test_stream_uses_decode_stream_without_redecoding(tok):
    """The plain-decode cases step tokenizers' DecodeStream: no full decode per token, same text."""
    from m3serve import SamplingParams
    calls = []

    class Counting:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def decode(self, *a, **k):
            calls.append(1)
            return self._inner.decode(*a, **k)

    ids = list(range(5, 300, 7)) + [400, 401, 402]
    for params in (SamplingParams(), SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)):
        ts = TextStream(Counting(tok), [], params)
        assert ts._stream is not None
        calls.clear()
        sent = "".join(ts.push([t]) for t in ids)
        assert not calls
        sent += ts.finish(None, [], "length", None)
        assert sent == tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    spaced = TextStream(tok, [], SamplingParams(skip_special_tokens=False))   # " " between special tokens
    assert spaced._stream is None
