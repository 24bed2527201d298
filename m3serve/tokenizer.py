"""The checkpoint's tokenizer and chat template, through transformers. A model without one works on ids."""

from __future__ import annotations

import json
import os


def load_tokenizer(path: str | None):
    if path is None or not os.path.isdir(path):
        return None
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    if _plain_fast_tokenizer(path):
        # transformers.AutoTokenizer imports the auto-model machinery (generation utilities, and scikit-learn
        # where installed): seconds on a small CPU machine, for a class this checkpoint names anyway
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _plain_fast_tokenizer(path: str) -> bool:
    """A tokenizer.json whose tokenizer_config.json names PreTrainedTokenizerFast (or no class)."""
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        return False
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return cls in (None, "PreTrainedTokenizerFast")


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Render `messages` with the checkpoint's chat template, then encode (the template writes any bos)."""
    if tokenizer is None:
        raise ValueError("chat messages need a tokenizer; this model has none")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; send a plain completion prompt instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
