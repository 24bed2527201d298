"""A choice's text, by the offline API's rules (m3serve.engine.detokenize): skip_special_tokens,
spaces_between_special_tokens, and the stop token's text shown only with include_stop_str_in_output. A stop string
cut is the engine's own text (Delta.final_text), so nothing is re-derived for it.

Streaming: a piece of text is released only once it can no longer change. Where the text is one plain decode
of the ids (skip_special_tokens, or no spaces between special tokens) and the tokenizer is a `tokenizers` one
without post-decode clean-up, it grows through tokenizers' DecodeStream: each new token decodes a few tokens of
context, not the whole output again, and an unfinished UTF-8 character waits inside the stream. Otherwise the
text is re-decoded from all tokens each time (byte-level BPE decodes of a prefix are prefixes of the full
decode, apart from an unfinished UTF-8 character at the end; with skip_special_tokens=False a special token is a
piece of its own, joined by " " or ""). Either way the released pieces concatenate to the non-streamed text.
Two things are held back:
  * trailing U+FFFD: bytes of a character whose remaining bytes may arrive in the next token;
  * the last (longest stop string - 1) characters: a stop string that completes later may start there, and
    the text from a stop string on is never shown (unless include_stop_str_in_output, where the engine's cut
    text still ends at the stop string).
The stop token (EOS or a stop id) always comes in the request's last Delta, so it is never released early.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from m3serve.engine.detokenize import decode
from m3serve.engine.sampling_params import SamplingParams

_DEFAULT = SamplingParams()


def _decode_stream(tokenizer, params: SamplingParams):
    """(DecodeStream, the tokenizers.Tokenizer it steps) where a stream gives exactly decode()'s text, else
    (None, None)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None, None
    if not params.skip_special_tokens and params.spaces_between_special_tokens:
        return None, None          # special tokens joined by " ": not one plain decode
    return DecodeStream(skip_special_tokens=params.skip_special_tokens), backend


def drops_stop_token(params: SamplingParams, finish_reason: str | None, stop_reason) -> bool:
    """A request ended by EOS or a stop id does not show that token's text unless include_stop_str_in_output."""
    return finish_reason == "stop" and isinstance(stop_reason, int) and not params.include_stop_str_in_output


def choice_text(tokenizer, ids: list[int], params: SamplingParams, finish_reason: str | None, stop_reason,
                final_text: str | None) -> str:
    """The text of a finished choice (m3serve.engine.detokenize.output_text on the server's data)."""
    if tokenizer is None:
        return ""
    if final_text is not None:
        return final_text
    if drops_stop_token(params, finish_reason, stop_reason):
        ids = ids[:-1]
    return decode(tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens)


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, params: SamplingParams | None = None):
        self.tokenizer = tokenizer
        self.params = params or _DEFAULT
        self.holdback = max((len(s) for s in stop or []), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0          # characters released so far
        self._stream, self._backend = _decode_stream(tokenizer, self.params)
        self._unsent = ""      # the stream's text after the released characters (DecodeStream path)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return decode(self.tokenizer, ids, self.params.skip_special_tokens, self.params.spaces_between_special_tokens)

    def push(self, ids: list[int]) -> str:
        """Add new tokens; returns the text that became final."""
        self.ids.extend(ids)
        if self.tokenizer is None or not ids:
            return ""
        if self._stream is not None:
            # Only the unreleased tail is kept: each token costs its own piece, not a copy of the whole text.
            step, backend, unsent = self._stream.step, self._backend, self._unsent
            for t in ids:
                piece = step(backend, t)
                if piece:
                    unsent += piece
            cut = len(unsent) - self.holdback
            if cut <= 0:
                self._unsent = unsent
                return ""
            self._unsent = unsent[cut:]
            self.sent += cut
            return unsent[:cut]
        text = self._decode(self.ids).rstrip("\ufffd")
        end = len(text) - self.holdback
        if end <= self.sent:
            return ""
        piece = text[self.sent:end]
        self.sent = end
        return piece

    def finish(self, final_text: str | None = None, ids: list[int] = (), finish_reason: str | None = None,
               stop_reason=None) -> str:
        """The rest of the text once the request is over, given its last tokens `ids` and how it ended;
        `final_text` is the engine's text when a stop string cut it (the last tokens are then never released
        past the cut)."""
        self.ids.extend(ids)
        if final_text is not None:
            text = final_text
        else:
            text = choice_text(self.tokenizer, self.ids, self.params, finish_reason, stop_reason, None)
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece
