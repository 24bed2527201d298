"""Streaming text of a growing token list: a piece of text is released only once it can no longer change.

Text is re-decoded from all tokens each time (byte-level BPE decodes of a prefix are prefixes of the full
decode, apart from an unfinished UTF-8 character at the end), so the released pieces always concatenate to
the non-streamed text. Two things are held back:
  * trailing U+FFFD: bytes of a character whose remaining bytes may arrive in the next token;
  * the last (longest stop string - 1) characters: a stop string that completes later may start there, and
    the text from a stop string on is never shown.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stop or []), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0          # characters released so far

    def _decode(self) -> str:
        return full_text(self.tokenizer, self.ids)

    def push(self, ids: list[int]) -> str:
        """Add new tokens; returns the text that became final."""
        self.ids.extend(ids)
        if self.tokenizer is None or not ids:
            return ""
        text = self._decode().rstrip("\ufffd")
        end = len(text) - self.holdback
        if end <= self.sent:
            return ""
        piece = text[self.sent:end]
        self.sent = end
        return piece

    def finish(self, final_text: str | None = None, ids: list[int] = ()) -> str:
        """The rest of the text once the request is over, given its last tokens `ids`; `final_text` is the
        engine's text when a stop string cut it (the last tokens are then never released past the cut)."""
        self.ids.extend(ids)
        text = final_text if final_text is not None else self._decode()
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece


def full_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
