"""MiniMax-M3's reasoning markup: `<mm:think>…</mm:think>` before the answer becomes `reasoning_content`.

The chat template may prefill the opening tag (the prompt ends with `<mm:think>`), so the output can start
inside the reasoning: then everything up to `</mm:think>` is reasoning from the first token on, and a streamed
response never shows it as `content` (the bug other engines are known for). Without a prefilled tag, output
that begins (after whitespace) with `<mm:think>` is reasoning up to its close; any other output is content.
One state machine serves streamed and whole responses, so both split a text the same way: a streamed piece
that may still turn out to be (part of) a tag is held back until the next piece or the end decides it.
"""

from __future__ import annotations

THINK_OPEN = "<mm:think>"
THINK_CLOSE = "</mm:think>"


def prompt_opens_reasoning(prompt_text: str | None) -> bool:
    """The rendered prompt ends inside a reasoning block (the template prefilled `<mm:think>`)."""
    if not prompt_text:
        return False
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (a tag that may be completing)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """push(text) -> (reasoning piece, content piece); finish() -> the held-back rest."""

    def __init__(self, prefilled: bool):
        self.state = "reasoning" if prefilled else "start"
        self.buf = ""
        self.strip_newlines = False      # right after </mm:think>: the answer's leading newlines are markup

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self.buf = "reasoning", head[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(head):
                return "", ""                       # still undecided (empty, or a prefix of the tag)
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.buf.find(THINK_CLOSE)
            if end < 0:
                keep = _partial_suffix(self.buf, THINK_CLOSE)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning = self.buf[:end]
            self.buf = self.buf[end + len(THINK_CLOSE):]
            self.state, self.strip_newlines = "content", True
        if self.state == "content":
            if self.strip_newlines:
                self.buf = self.buf.lstrip("\n")
                if self.buf:
                    self.strip_newlines = False
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of output: an unclosed reasoning block stays reasoning; undecided text is content."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest.lstrip("\n") if self.strip_newlines else rest


def split_reasoning(text: str, prefilled: bool) -> tuple[str | None, str]:
    """A whole output -> (reasoning_content or None when there was no reasoning block, content)."""
    s = ReasoningStream(prefilled)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    had = prefilled or s.state != "start" and (r1 or r2 or text.lstrip().startswith(THINK_OPEN))
    return (r1 + r2 if had else None), c1 + c2
