"""The checkpoint's tokenizer and chat template, through transformers. A model without one works on ids."""

from __future__ import annotations

import os


def load_tokenizer(path: str | None):
    if path is None or not os.path.isdir(path):
        return None
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
