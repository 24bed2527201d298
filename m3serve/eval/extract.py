"""Answer extraction for GSM8K-format tasks, following lm-eval-harness's gsm8k task.

- Reference answers: the text after the last "#### " (lm-eval's `doc_to_target`).
- strict:   the first match of `#### (\\-?[0-9\\.\\,]+)` in the model output ("strict-match").
- flexible: strict when it matches, else the last number in the output (lm-eval's
            "flexible-extract" regex `(-?[$0-9.,]{2,})|(-?[0-9]+)`, last match).
- Comparison normalises both sides as lm-eval's exact_match does with
  regexes_to_ignore [",", "\\$", "(?s).*#### ", "\\.$"], ignore_case and whitespace stripping.
- Unlike lm-eval's own "flexible-extract" (always the last number), our flexible mode is
  a fallback: it differs from strict only on outputs without a "#### N".
"""
from __future__ import annotations

import re

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEX_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def normalize(s: str) -> str:
    """lm-eval exact_match normalisation (applied to prediction and reference alike)."""
    s = s.strip()
    for pat in _IGNORE:
        s = pat.sub("", s)
    return s.strip().lower()


def reference_answer(answer: str) -> str:
    """The number after the last '#### ' of a reference answer, normalised."""
    if not isinstance(answer, str):
        raise TypeError(f"answer: expected str, found {type(answer).__name__}")
    if "####" not in answer:
        raise ValueError(f"answer: expected a '#### N' final line, found {answer[-80:]!r}")
    return normalize(answer.split("####")[-1])


def strict_extract(output: str) -> str | None:
    m = STRICT_RE.search(output)
    return normalize(m.group(1)) if m else None


def flexible_extract(output: str) -> str | None:
    """strict if present, else the last number-like span of the output."""
    s = strict_extract(output)
    if s is not None:
        return s
    matches = FLEX_RE.findall(output)
    if not matches:
        return None
    a, b = matches[-1]
    return normalize(a or b)


def is_correct(output: str, reference: str, mode: str = "strict") -> bool:
    """reference: already normalised (reference_answer)."""
    if mode == "strict":
        pred = strict_extract(output)
    elif mode == "flexible":
        pred = flexible_extract(output)
    else:
        raise ValueError(f"mode: expected 'strict' or 'flexible', found {mode!r}")
    return pred is not None and pred == reference
